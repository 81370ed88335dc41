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
}

#[tokio::main]
async fn main() -> Result<()> {
    larder::init_logging("info");
    let args = Args::parse();
    let config = larder::config::Config::load(&args.config)?;
    let daemon = larder::server::Daemon::start(config)
        .await
        .context("starting larderd")?;
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
