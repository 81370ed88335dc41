//! The gRPC server: `service` (handlers and validation), `stream` (batch assembly and metered
//! forwarding), `shm` (shared-memory rings for clients on the Unix socket), `buffers` (message
//! buffers reused by the bytes path), `sent` (encoded messages counted until sent), `shutdown` (the daemon's stop, a type every part holds), `daemon` (wiring and listeners).

pub mod buffers;
mod daemon;
mod sent;
mod service;
mod shm;
pub mod shutdown;
mod stream;

pub use daemon::Daemon;
pub use service::Service;
pub use stream::MAX_BATCH_BYTES;
