//! larder: a node-local daemon that keeps GPUs fed with preprocessed samples.
//!
//! Data path: sampler (seeded, sharded order) -> tiers (memory -> scratch -> raw source +
//! preprocessing) -> batch assembly -> gRPC stream or shared-memory ring. See docs/design.md.

pub mod access;
pub mod alloc;
pub mod catalog;
pub mod cli_text;
pub mod client;
pub mod config;
pub mod demo;
pub mod error;
pub mod fields;
pub mod fingerprint;
pub mod footprint;
pub mod input_bound;
pub mod manpage;
pub mod metrics;
pub mod objects;
pub mod open_streams;
pub mod peer;
pub mod permutation;
pub mod pipeline;
pub mod privsep;
pub mod prometheus_metrics;
pub mod sampler;
pub mod server;
pub mod source;
pub mod store;
pub mod sync;
pub mod synthetic;
pub mod tiers;
pub mod turns;
pub mod user_datasets;
pub mod workers;

/// Generated gRPC types for `larder.v1`.
pub mod proto {
    tonic::include_proto!("larder.v1");

    /// The standard gRPC health service's messages (grpc.health.v1).
    pub mod health {
        tonic::include_proto!("grpc.health.v1");
    }

    /// The descriptors of every service the daemon serves, for gRPC reflection.
    pub const DESCRIPTORS: &[u8] = tonic::include_file_descriptor_set!("descriptors");
}

/// Logs to stderr (the journal, under systemd) at `$LARDER_LOG`, else at `default_level`.
pub fn init_logging(default_level: &str) {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LARDER_LOG")
                .unwrap_or_else(|_| default_level.into()),
        )
        .init();
}
