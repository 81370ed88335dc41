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
    /// Once listening, write the address clients connect to (e.g. "http://127.0.0.1:41234",
    /// the port the kernel gave for `listen = "127.0.0.1:0"`) to this file, renamed into
    /// place: a script or test waits for the file instead of guessing a free port.
    #[arg(long)]
    address_file: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> Result<()> {
    larder::init_logging("info");
    let args = Args::parse();
    let config = larder::config::Config::load(&args.config)?;
    let daemon = larder::server::Daemon::start(config)
        .await
        .context("starting larderd")?;
    if let Some(path) = &args.address_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, format!("{}\n", daemon.client_addr()))
            .and_then(|()| std::fs::rename(&tmp, path))
            .with_context(|| format!("writing the address to {}", path.display()))?;
    }
    let stop = daemon.shutdown_handle();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
        stop.fire();
    });
    daemon.wait().await
}
