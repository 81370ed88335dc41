//! larderd: the daemon.

use anyhow::{Context, Result};
use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    version,
    about = "larder daemon: serves preprocessed training samples over gRPC"
)]
struct Args {
    /// Path of the TOML config.
    #[arg(
        long,
        short,
        default_value = "/etc/larder/larder.toml",
        env = "LARDER_CONFIG"
    )]
    config: PathBuf,
    /// Once listening and the config's datasets have been tried, write the address clients
    /// connect to (e.g. "http://127.0.0.1:41234", the port the kernel gave for `listen =
    /// "127.0.0.1:0"`) to this file (PATH.tmp renamed into place): a script or test waits for
    /// the file instead of guessing a free port or racing the datasets' opening.
    #[arg(long)]
    address_file: Option<PathBuf>,
    /// Started as root: become this user first, keeping only CAP_SETUID and CAP_SETGID (for
    /// the launcher of readers) and dropping every other right of root's. A container's start
    /// (Kubernetes gives a process started as another user no capabilities); under systemd the
    /// unit starts larderd as its user instead.
    #[arg(long, env = "LARDER_USER")]
    user: Option<String>,
    /// Print larderd's manual page (roff, section 8) and exit (scripts/package uses it).
    #[arg(long, hide = true)]
    man: bool,
}

/// The config at `path`, its datasets of a known kind checked by their kind's format.
fn load(path: &std::path::Path) -> Result<larder::config::Config> {
    let config = larder::config::Config::load(path)?;
    larder::source::check_config(&config)
        .with_context(|| format!("in config file {}", path.display()))?;
    Ok(config)
}

fn main() -> Result<()> {
    // A child of the daemon's (the launcher, a reader, a check) runs here and never returns.
    larder::privsep::child::run_if_child();
    larder::init_logging("info");
    let args = Args::parse();
    if args.man {
        use clap::CommandFactory;
        let man = clap_mangen::Man::new(Args::command().name("larderd")).section("8");
        man.render(&mut std::io::stdout())?;
        return Ok(());
    }
    if let Some(name) = &args.user {
        larder::privsep::start_as(name).context("starting larderd")?;
    }
    let as_root = larder::access::euid() == 0;
    // Before any thread, and before the config is read (a reader, forked from the launcher,
    // holds nothing of it): the launcher keeps the capabilities to switch users, this process
    // none (see `privsep`).
    let separated = larder::privsep::separate().context("starting the launcher")?;
    if as_root {
        // uid 0 without capabilities still owns root's files (/etc/shadow is root's, 0640).
        tracing::warn!(
            "larderd serves as uid 0: start it as its own user (the systemd unit does), or as \
             root with --user larder"
        );
    }
    let config = load(&args.config)?;
    if let Some(name) = &config.reader_user {
        larder::privsep::set_config_reader(name)
            .with_context(|| format!("in config file {}", args.config.display()))?;
    }
    if !larder::alloc::start_background_thread() {
        tracing::warn!("jemalloc's background thread did not start: freed memory goes back later");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?;
    runtime.block_on(serve(args, config, separated))
}

async fn serve(args: Args, config: larder::config::Config, separated: bool) -> Result<()> {
    if separated {
        tracing::info!(
            cap_eff = larder::privsep::caps::status_line("CapEff").unwrap_or_default(),
            "users' datasets are read by readers running as their owners; this process holds no capabilities"
        );
    }
    let daemon = larder::server::Daemon::listen(config)
        .await
        .context("starting larderd")?;
    if let Some(path) = args.address_file.clone() {
        // Written once the config's datasets have been tried (opened, or found not to open),
        // so a script or test that waits for it can stream at once.
        let (addr, datasets) = (daemon.client_addr(), daemon.datasets());
        tokio::spawn(async move {
            datasets.reconcile().await;
            let mut tmp = path.as_os_str().to_owned();
            tmp.push(".tmp");
            let written = std::fs::write(&tmp, format!("{addr}\n"))
                .and_then(|()| std::fs::rename(&tmp, &path));
            if let Err(e) = written {
                tracing::error!("writing the address to {}: {e}", path.display());
            }
        });
    }
    let stop = daemon.shutdown_handle();
    let datasets = daemon.datasets();
    let path = args.config.clone();
    tokio::spawn(async move {
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .expect("installing the SIGHUP handler");
        while hup.recv().await.is_some() {
            notify(&format!("RELOADING=1\nMONOTONIC_USEC={}", monotonic_usec()));
            match load(&path) {
                Ok(config) => {
                    tracing::info!(config = %path.display(), "reloading the datasets");
                    datasets.reload(config.datasets).await;
                }
                Err(e) => tracing::error!("not reloading: {e:#}"),
            }
            notify("READY=1");
        }
    });
    // Listening: systemd (Type=notify) may start what depends on larder.
    notify("READY=1");
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
        notify("STOPPING=1");
        stop.fire();
    });
    daemon.wait().await
}

/// Tells systemd about the daemon's state (sd_notify), when it runs under a unit of
/// Type=notify (NOTIFY_SOCKET set); else does nothing.
fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = (|| -> std::io::Result<()> {
        let sock = std::os::unix::net::UnixDatagram::unbound()?;
        let bytes = path.as_encoded_bytes();
        if let Some(name) = bytes.strip_prefix(b"@") {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(state.as_bytes(), &addr)?;
        } else {
            sock.send_to(state.as_bytes(), &path)?;
        }
        Ok(())
    })();
    if let Err(e) = sent {
        tracing::warn!("telling systemd {state:?}: {e}");
    }
}

/// CLOCK_MONOTONIC in microseconds, as systemd wants it with RELOADING=1.
fn monotonic_usec() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000
}
