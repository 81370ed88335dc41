//! The tiers a sample is kept in, fastest first: `memory` (a byte budget, shared by every
//! client; which sample it lets go is an `eviction` policy), `scratch` (preprocessed samples in
//! checksummed shard files on local disk), and `store`, the lookup through them down to the raw
//! source, filling them on the way.

pub mod eviction;
pub mod future;
pub mod memory;
pub mod scratch;
pub mod store;
pub mod trace;
