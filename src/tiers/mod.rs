//! The tiers a sample is kept in, fastest first: `memory` (a byte budget, shared by every
//! client; which sample it lets go is an `eviction` policy, told the open streams' `orders`)
//! and `slabs`, where it packs records of one size) and `scratch` (preprocessed samples in checksummed shard files on local disk). The lookup
//! through them down to the raw source is `crate::store`'s.

pub mod eviction;
pub mod memory;
pub mod orders;
pub mod scratch;
pub mod slabs;
pub mod trace;
pub mod watcher;
