//! Which sample the memory tier lets go, and whether a newcomer comes in at all. The tier keeps
//! the samples and their bytes; a policy keeps only the order it evicts in. One trait, one file
//! per policy, and one test module (`tests.rs`) every policy passes.

mod stale_lru;
#[cfg(test)]
mod tests;

pub use stale_lru::StaleLru;

use super::memory::Key;

/// An eviction and admission policy for the memory tier. The tier calls it under its lock, in
/// the order things happen; `clock` counts the tier's lookups.
pub trait Eviction: Send {
    /// A lookup found `key`.
    fn on_hit(&mut self, key: &Key, clock: u64);
    /// `key` came in.
    fn on_insert(&mut self, key: Key, clock: u64);
    /// The entry to let go so that a newcomer fits, or None to decline the newcomer. The tier
    /// removes the entry and calls `on_remove`, and asks again until the newcomer fits.
    fn victim_for_newcomer(&mut self, clock: u64) -> Option<Key>;
    /// The entry to let go when the tier must shrink: one while any is held.
    fn victim(&mut self) -> Option<Key>;
    /// `key` left the tier.
    fn on_remove(&mut self, key: &Key);
    /// The open streams together look up `samples` samples an epoch.
    fn set_streaming_samples(&mut self, samples: u64);
}
