//! Least recently used, resistant to shuffled epochs: once the tier is full, a newcomer only
//! displaces the least recently used entry when that entry is *stale*, unused for longer than
//! two epochs of the streams now open would take. Epochs visit every sample once in a fresh
//! random order, the worst case for a plain LRU (by the time a sample comes round again it has
//! long been evicted); here entries of a dataset still being trained on are never stale, so the
//! tier keeps a stable working set and reaches the hit rate of cache size / dataset size, while
//! entries of a dataset nobody reads any more go stale and make room. With no stream open it is
//! a plain LRU.

use super::Key;
use super::{Eviction, Size};
use lru::LruCache;

pub struct StaleLru {
    /// Entries, least recently used first, with their last use.
    order: LruCache<Key, u64>,
    /// An entry unused for more than this many lookups may be displaced (0: plain LRU).
    stale_after: u64,
}

impl StaleLru {
    pub fn new() -> StaleLru {
        StaleLru {
            order: LruCache::unbounded(),
            stale_after: 0,
        }
    }
}

impl Default for StaleLru {
    fn default() -> Self {
        StaleLru::new()
    }
}

impl Eviction for StaleLru {
    fn name(&self) -> &'static str {
        "stale_lru"
    }

    fn on_hit(&mut self, key: &Key, clock: u64) {
        if let Some(last) = self.order.get_mut(key) {
            *last = clock;
        }
    }

    fn on_insert(&mut self, key: Key, _size: Size, clock: u64) {
        self.order.put(key, clock);
    }

    fn victim_for_newcomer(&mut self, _newcomer: &Key, _size: Size, clock: u64) -> Option<Key> {
        let (&key, &last) = self.order.peek_lru()?;
        (clock.saturating_sub(last) > self.stale_after).then_some(key)
    }

    fn victim(&mut self, _clock: u64) -> Option<Key> {
        self.order.peek_lru().map(|(&k, _)| k)
    }

    fn on_remove(&mut self, key: &Key) {
        self.order.pop(key);
    }

    fn set_streaming_samples(&mut self, samples: u64) {
        self.stale_after = samples.saturating_mul(2);
    }
}

#[cfg(test)]
mod tests {
    use crate::sampler::epoch_order;
    use crate::tiers::memory::{cost_of, MemoryTier};
    use bytes::Bytes;

    fn sample(n: usize) -> Bytes {
        Bytes::from(vec![7u8; n])
    }

    #[test]
    fn plain_lru_when_no_stream_is_open() {
        let tier = MemoryTier::stale_lru(2 * cost_of(10));
        tier.insert((0, 1), sample(10), 1);
        tier.insert((0, 2), sample(10), 1);
        assert!(tier.get(&(0, 1)).is_some());
        assert!(tier.insert((0, 3), sample(10), 1));
        assert!(
            tier.get(&(0, 2)).is_none(),
            "least recently used goes first"
        );
        assert!(tier.get(&(0, 1)).is_some());
    }

    #[test]
    fn keeps_recently_used_entries_and_declines_newcomers() {
        let tier = MemoryTier::stale_lru(2 * cost_of(10));
        tier.set_streaming_samples(50); // stale after 100 lookups
        tier.insert((0, 1), sample(10), 1);
        tier.insert((0, 2), sample(10), 1);
        assert!(!tier.insert((0, 3), sample(10), 1));
        assert_eq!(tier.snapshot().declined, 1);
        for _ in 0..101 {
            tier.get(&(9, 9));
        }
        assert!(
            tier.insert((0, 3), sample(10), 1),
            "stale entries make room"
        );
    }

    /// The design note's simulation: 20,000 samples, a cache of half of them, shuffled epochs.
    fn hit_rate(streaming: u64) -> f64 {
        let n = 20_000u64;
        let tier = MemoryTier::stale_lru((n / 2) * cost_of(1));
        tier.set_streaming_samples(streaming);
        let (mut hits, mut lookups) = (0u64, 0u64);
        for epoch in 0..4 {
            for i in epoch_order(n, 42, epoch, true) {
                let hit = tier.get(&(0, i)).is_some();
                if !hit {
                    tier.insert((0, i), sample(1), 1);
                }
                if epoch > 0 {
                    lookups += 1;
                    hits += hit as u64;
                }
            }
        }
        hits as f64 / lookups as f64
    }

    #[test]
    fn shuffled_epochs_beat_plain_lru() {
        let lru = hit_rate(0);
        let larder = hit_rate(20_000);
        assert!(lru < 0.3, "plain LRU {lru}");
        assert!(larder > 0.45, "scan-resistant {larder}");
    }
}
