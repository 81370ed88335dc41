//! The gRPC server: `service` (handlers and validation), `admission` (may this caller have
//! this dataset now), `stream` (field selection, batch
//! assembly, the producer that forwards a stream's batches, metered delivery), `layout` (a
//! batch's fields laid out for the message or a slot), `shm` (shared-memory rings for clients on
//! the Unix socket), `buffers` (message buffers reused by the bytes path), `sent` (encoded
//! messages counted until sent), `shutdown` (the daemon's stop, a type every part holds),
//! `datasets` (the catalog kept current: reload, retry, reopen), `daemon` (wiring and
//! listeners).

mod admission;
mod batch_stream;
pub mod buffers;
mod daemon;
mod health;
mod held_messages;
mod layout;
mod planning;
pub mod reload;
mod service;
pub mod shm;
pub mod shutdown;

pub use daemon::Daemon;
pub use service::Service;
