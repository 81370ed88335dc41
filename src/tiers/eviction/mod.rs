//! Which sample the memory tier lets go, and whether a newcomer comes in at all. The tier keeps
//! the samples and their bytes; a policy keeps only the order it evicts in. One trait, one file
//! per policy, and one test module (`tests.rs`) every policy passes.
//!
//! - `NextUse` (the default): every open stream publishes its future (its epoch's order, where
//!   it is, how fast it goes); the entry whose next use by any stream is furthest, weighed by
//!   the bytes it holds per byte a miss would read, goes first, and a newcomer that would
//!   itself be the furthest stays out. Near the offline optimum for any number of jobs.
//! - `StaleLru`: a fixed working set (the entry least recently used, and only once stale for
//!   two epochs of the open streams): optimal for one job, blind to several.

mod next_use;
mod stale_lru;
#[cfg(test)]
mod tests;

pub use next_use::NextUse;
pub use stale_lru::StaleLru;

use super::orders::StreamEvent;
use std::collections::HashMap;

/// Which sample: (dataset id, sample index).
pub type Key = (u32, u64);

/// A map by sample, with a fast hash (seeded per process).
pub type KeyMap<V> = HashMap<Key, V, foldhash::fast::RandomState>;

/// Which eviction policy a tier runs (`[memory] policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyName {
    /// Next use across the open streams, in bytes (`eviction::NextUse`).
    #[default]
    NextUse,
    /// A fixed working set: least recently used once stale (`eviction::StaleLru`).
    StaleLru,
}

/// What an entry costs and saves: the bytes it holds in memory, and the bytes its miss reads
/// from raw storage (what keeping it saves; a stand-in for decode time, which grows with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    pub bytes: u64,
    pub miss_bytes: u64,
}

/// An eviction and admission policy for the memory tier. The tier calls it under its lock, in
/// the order things happen; `clock` counts the tier's lookups (the time policies measure in).
pub trait Eviction: Send {
    /// How `[memory] policy` names it.
    fn name(&self) -> &'static str;
    /// A lookup found `key`.
    fn on_hit(&mut self, key: &Key, clock: u64);
    /// `key` came in.
    fn on_insert(&mut self, key: Key, size: Size, clock: u64);
    /// The entry to let go so that `newcomer` fits, or None to decline the newcomer. The tier
    /// removes the entry and calls `on_remove`, and asks again until the newcomer fits.
    fn victim_for_newcomer(&mut self, newcomer: &Key, size: Size, clock: u64) -> Option<Key>;
    /// The entry to let go when the tier must shrink: one while any is held.
    fn victim(&mut self, clock: u64) -> Option<Key>;
    /// `key` left the tier.
    fn on_remove(&mut self, key: &Key);
    /// The open streams together look up `samples` samples an epoch.
    fn set_streaming_samples(&mut self, _samples: u64) {}
    /// A stream opened, moved on, or ended.
    fn on_stream(&mut self, _event: StreamEvent, _clock: u64) {}
    /// Bytes of bookkeeping beyond what the tier charges its entries (the streams' futures).
    fn extra_bytes(&self) -> usize {
        0
    }
}
