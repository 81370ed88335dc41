//! The gRPC server: `service` (handlers and validation), `stream` (batch assembly and metered
//! forwarding), `daemon` (wiring and listeners).

mod daemon;
mod service;
mod stream;

pub use daemon::Daemon;
pub use service::Service;
pub use stream::MAX_BATCH_BYTES;
