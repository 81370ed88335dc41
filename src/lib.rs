//! larder: a node-local daemon that keeps GPUs fed with preprocessed samples.
//!
//! Data path: sampler (seeded, sharded order) -> store (memory LRU -> raw source) ->
//! batch assembly -> gRPC stream. See README.md.

pub mod catalog;
pub mod client;
pub mod config;
pub mod demo;
pub mod memory;
pub mod metrics;
pub mod preprocess;
pub mod sampler;
pub mod scratch;
pub mod server;
pub mod source;
pub mod store;

/// Generated gRPC types for `larder.v1`.
pub mod proto {
    tonic::include_proto!("larder.v1");
}
