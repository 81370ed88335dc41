//! The memory tier: a byte-budgeted LRU of preprocessed samples, shared by all clients,
//! and a watcher that gives memory back when the machine runs short.
//!
//! Epochs visit every sample once in a fresh random order, which is the worst case for a plain
//! LRU: by the time a sample comes round again it has long been evicted. So once the tier is
//! full, a newcomer only displaces the least recently used entry when that entry is *stale*:
//! unused for longer than two epochs of the streams now open would take. Entries of a dataset
//! that is still being trained on are never stale, so the tier keeps a stable working set and
//! reaches the hit rate of the optimum (cache size / dataset size); entries of a dataset nobody
//! reads any more go stale and make room.

use bytes::Bytes;
use lru::LruCache;
use std::sync::Mutex;
use std::time::Duration;

/// Which sample: (dataset id, sample index).
pub type Key = (u32, u64);

/// Bookkeeping bytes charged per entry on top of the sample itself (LRU node, key, Bytes header).
pub const ENTRY_OVERHEAD: u64 = 96;

struct Entry {
    data: Bytes,
    /// Bytes the sample takes in raw storage.
    disk: u64,
    last_use: u64,
}

struct Inner {
    lru: LruCache<Key, Entry>,
    /// Bytes held, overhead included.
    bytes: u64,
    /// Raw-storage bytes of the samples held.
    disk_bytes: u64,
    /// Configured budget.
    budget: u64,
    /// Current limit: the budget, lowered while the machine is short of memory.
    limit: u64,
    /// Lookup counter, the clock that staleness is measured in.
    clock: u64,
    /// An entry unused for more than this many lookups may be displaced.
    stale_after: u64,
    declined: u64,
    evicted: u64,
}

pub struct MemoryTier {
    inner: Mutex<Inner>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MemorySnapshot {
    pub bytes: u64,
    pub limit: u64,
    pub budget: u64,
    pub entries: u64,
    /// Raw-storage bytes of the samples held: bytes / disk_bytes is the measured expansion factor.
    pub disk_bytes: u64,
    pub declined: u64,
    pub evicted: u64,
}

pub fn entry_cost(data: &Bytes) -> u64 {
    data.len() as u64 + ENTRY_OVERHEAD
}

impl MemoryTier {
    pub fn new(budget: u64) -> MemoryTier {
        MemoryTier {
            inner: Mutex::new(Inner {
                lru: LruCache::unbounded(),
                bytes: 0,
                disk_bytes: 0,
                budget,
                limit: budget,
                clock: 0,
                stale_after: 0,
                declined: 0,
                evicted: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the accounting half-done in a way
        // that matters more than stopping the daemon would, so keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Looks a sample up, marking it used.
    pub fn get(&self, key: &Key) -> Option<Bytes> {
        let mut inner = self.lock();
        inner.clock += 1;
        let now = inner.clock;
        let entry = inner.lru.get_mut(key)?;
        entry.last_use = now;
        Some(entry.data.clone())
    }

    /// Looks a sample up without counting a lookup or marking it used.
    pub fn peek(&self, key: &Key) -> Option<Bytes> {
        self.lock().lru.peek(key).map(|e| e.data.clone())
    }

    /// Offers a sample that takes `disk` bytes in raw storage. Returns whether it was kept.
    pub fn insert(&self, key: Key, data: Bytes, disk: u64) -> bool {
        let cost = entry_cost(&data);
        let mut inner = self.lock();
        if inner.lru.contains(&key) {
            return true;
        }
        if cost > inner.limit {
            inner.declined += 1;
            return false;
        }
        while inner.bytes + cost > inner.limit {
            let stale = match inner.lru.peek_lru() {
                Some((_, e)) => inner.clock.saturating_sub(e.last_use) > inner.stale_after,
                None => true,
            };
            if !stale {
                inner.declined += 1;
                return false;
            }
            inner.evict_lru();
        }
        let now = inner.clock;
        inner.bytes += cost;
        inner.disk_bytes += disk;
        inner.lru.put(
            key,
            Entry {
                data,
                disk,
                last_use: now,
            },
        );
        true
    }

    /// Sets how many lookups an entry may go unused before a newcomer may displace it.
    /// 0 makes the tier a plain LRU.
    pub fn set_stale_after(&self, lookups: u64) {
        self.lock().stale_after = lookups;
    }

    /// Lowers (or restores, up to the budget) the byte limit, evicting least recently used
    /// entries until the tier fits.
    pub fn set_limit(&self, limit: u64) {
        let mut inner = self.lock();
        inner.limit = limit.min(inner.budget);
        while inner.bytes > inner.limit {
            inner.evict_lru();
        }
    }

    pub fn snapshot(&self) -> MemorySnapshot {
        let inner = self.lock();
        MemorySnapshot {
            bytes: inner.bytes,
            limit: inner.limit,
            budget: inner.budget,
            entries: inner.lru.len() as u64,
            disk_bytes: inner.disk_bytes,
            declined: inner.declined,
            evicted: inner.evicted,
        }
    }
}

impl Inner {
    fn evict_lru(&mut self) {
        if let Some((_, e)) = self.lru.pop_lru() {
            self.bytes -= entry_cost(&e.data);
            self.disk_bytes -= e.disk;
            self.evicted += 1;
        }
    }
}

/// The limit the memory tier should have so that the machine keeps `floor` bytes available:
/// it may grow only into memory above the floor, and shrinks by however far below it the
/// machine has fallen.
pub fn limit_for(budget: u64, held: u64, available: u64, floor: u64) -> u64 {
    if available >= floor {
        budget.min(held.saturating_add(available - floor))
    } else {
        held.saturating_sub(floor - available)
    }
}

/// Watches the machine's available memory and keeps the tier within it, forever.
pub async fn watch_available_memory(
    tier: std::sync::Arc<MemoryTier>,
    floor: u64,
    interval: Duration,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    release_buffers: impl Fn(),
) {
    let mut sys = sysinfo::System::new();
    let mut ticker = tokio::time::interval(interval);
    let mut short = false;
    loop {
        ticker.tick().await;
        sys.refresh_memory();
        let available = sys.available_memory();
        metrics.set_machine_available(available);
        let snap = tier.snapshot();
        let limit = limit_for(snap.budget, snap.bytes, available, floor);
        if available < floor && !short {
            tracing::warn!(
                available,
                floor,
                held = snap.bytes,
                new_limit = limit,
                "machine is short of memory; the memory tier is giving memory back"
            );
        } else if available >= floor && short {
            tracing::info!(available, floor, "machine memory recovered");
        }
        short = available < floor;
        if short {
            // Spare buffers first: they cost a page fault per 4 KiB to make again, a sample
            // costs a read and a decode.
            release_buffers();
        }
        tier.set_limit(limit);
        if short {
            // What the tier let go, back to the machine now rather than at the allocator's
            // leisure.
            crate::alloc::give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::epoch_order;

    fn sample(n: usize) -> Bytes {
        Bytes::from(vec![7u8; n])
    }

    #[test]
    fn never_exceeds_its_budget() {
        let tier = MemoryTier::new(10 * (100 + ENTRY_OVERHEAD));
        for i in 0..100 {
            tier.insert((0, i), sample(100), 1);
            assert!(tier.snapshot().bytes <= tier.snapshot().budget);
        }
        assert_eq!(tier.snapshot().entries, 10);
        assert!(
            !tier.insert((0, 1000), sample(100_000), 1),
            "larger than the budget"
        );
    }

    #[test]
    fn plain_lru_when_nothing_is_protected() {
        let tier = MemoryTier::new(2 * (10 + ENTRY_OVERHEAD));
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
        let tier = MemoryTier::new(2 * (10 + ENTRY_OVERHEAD));
        tier.set_stale_after(100);
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

    #[test]
    fn shrinking_the_limit_evicts() {
        let tier = MemoryTier::new(10 * (10 + ENTRY_OVERHEAD));
        tier.set_stale_after(u64::MAX);
        for i in 0..10 {
            tier.insert((0, i), sample(10), 1);
        }
        tier.set_limit(3 * (10 + ENTRY_OVERHEAD));
        let s = tier.snapshot();
        assert_eq!((s.entries, s.evicted), (3, 7));
        tier.set_limit(u64::MAX);
        assert_eq!(tier.snapshot().limit, tier.snapshot().budget);
    }

    #[test]
    fn limit_follows_available_memory() {
        // Plenty available: the budget.
        assert_eq!(limit_for(100, 10, 1000, 100), 100);
        // Close to the floor: may only grow into what is above it.
        assert_eq!(limit_for(100, 10, 120, 100), 30);
        // Below the floor: give back the deficit.
        assert_eq!(limit_for(100, 50, 80, 100), 30);
        assert_eq!(limit_for(100, 5, 0, 100), 0);
    }

    /// The design note's simulation: 20,000 samples, a cache of half of them, shuffled epochs.
    fn hit_rate(stale_after: u64) -> f64 {
        let n = 20_000u64;
        let tier = MemoryTier::new((n / 2) * (1 + ENTRY_OVERHEAD));
        tier.set_stale_after(stale_after);
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
        let larder = hit_rate(2 * 20_000);
        assert!(lru < 0.3, "plain LRU {lru}");
        assert!(larder > 0.45, "scan-resistant {larder}");
    }
}
