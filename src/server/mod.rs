//! The gRPC server: `service` (handlers and validation), `stream` (batch assembly and metered
//! forwarding), `shm` (shared-memory rings for clients on the Unix socket), `daemon` (wiring and listeners).

mod daemon;
mod service;
mod shm;
mod stream;

pub use daemon::Daemon;
pub use service::Service;
pub use stream::MAX_BATCH_BYTES;
