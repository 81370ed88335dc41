//! The memory tier: preprocessed samples within a byte budget, shared by all clients (the
//! watcher that gives memory back when the machine runs short is `watcher`'s). Which sample it lets go, and
//! whether a newcomer comes in, is its eviction policy's (`eviction/`; `NextUse` by default),
//! which hears every open stream's future through it (`stream_opened`, `stream_at`,
//! `stream_closed`).

use super::eviction::{Eviction, Key, KeyMap, NextUse, PolicyName, Size, StaleLru};
use super::orders::{OrderKey, Orders, StreamEvent};
use super::slabs::Slabs;
use crate::sync::Locked;
use bytes::Bytes;
use std::sync::Mutex;

/// Bookkeeping bytes charged per entry on top of the sample itself: the entry map's bucket and
/// spare capacity (about 65-128 bytes), the policy's node and its map (about 64-85), the
/// Bytes header.
pub const ENTRY_OVERHEAD: u64 = 192;

struct Entry {
    data: Bytes,
    /// Bytes the sample takes in raw storage.
    disk: u64,
    /// What the tier charges for it (`Slabs::place`'s bytes and `ENTRY_OVERHEAD`).
    cost: u64,
}

/// The tier looks for slabs to give back or compact once per this many samples let go.
const COMPACT_EVERY: u64 = 64;

struct Inner {
    entries: KeyMap<Entry>,
    /// Where records of the sizes fixed-shape datasets expect are packed.
    slabs: Slabs,
    policy: Box<dyn Eviction>,
    /// Bytes held, overhead included.
    bytes: u64,
    /// Raw-storage bytes of the samples held.
    disk_bytes: u64,
    /// Configured budget.
    budget: u64,
    /// Current limit: the budget less `reserved`, lowered while the machine is short of memory
    /// (to `watched`).
    limit: u64,
    /// The limit the machine's available memory allows (`set_limit`).
    watched: u64,
    /// Bytes of the budget taken by other things (the shared-memory rings). The policy's own
    /// bookkeeping beyond the entries (the open streams' futures) is taken off too.
    reserved: u64,
    /// Bytes of the budget held back for good (the message path's share).
    held_back: u64,
    /// Bytes of the budget the footprint account holds (what datasets and streams take
    /// outside the cache).
    footprint: u64,
    /// Lookup counter, the clock policies measure time in.
    clock: u64,
    declined: u64,
    evicted: u64,
    /// Policy calls, and the time they took (estimated from one in `TIMED_EVERY`).
    policy_calls: u64,
    policy_nanos: u64,
    /// What reading the clock twice costs, taken off each timed call.
    clock_nanos: u64,
}

/// One policy call in this many is timed (the clock costs about as much as a small call).
const TIMED_EVERY: u64 = 16;

pub struct MemoryTier {
    inner: Mutex<Inner>,
    /// The orders the open streams read, made outside the tier's lock.
    pub(crate) orders: Orders,
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
    /// Bytes of the policy's own bookkeeping beyond the entries (the streams' futures).
    pub policy_bytes: u64,
    /// CPU time the policy has spent (estimated).
    pub policy_seconds: f64,
    pub policy: &'static str,
}

/// What the tier charges for a sample of `len` bytes kept alone (before its size has slabs):
/// the allocator rounds each allocation up to a size class (a 3x64x64 record and its label,
/// 12,296 bytes, takes 14,336), so the tier counts the class, not the length, and
/// `ENTRY_OVERHEAD` on top. In a slab it is charged its slot (12,304) instead.
pub fn cost_of(len: usize) -> u64 {
    crate::alloc::allocation_size(len) as u64 + ENTRY_OVERHEAD
}

impl MemoryTier {
    /// A tier of `budget` bytes with the default policy.
    pub fn new(budget: u64) -> MemoryTier {
        MemoryTier::named(budget, PolicyName::default())
    }

    /// A tier of `budget` bytes with the policy `name`.
    pub fn named(budget: u64, name: PolicyName) -> MemoryTier {
        let policy: Box<dyn Eviction> = match name {
            PolicyName::NextUse => Box::new(NextUse::new()),
            PolicyName::StaleLru => Box::new(StaleLru::new()),
        };
        MemoryTier::with_policy(budget, policy)
    }

    /// A tier of `budget` bytes with the stale-LRU policy.
    pub fn stale_lru(budget: u64) -> MemoryTier {
        MemoryTier::named(budget, PolicyName::StaleLru)
    }

    pub fn with_policy(budget: u64, policy: Box<dyn Eviction>) -> MemoryTier {
        MemoryTier {
            inner: Mutex::new(Inner {
                entries: KeyMap::default(),
                slabs: Slabs::default(),
                policy,
                bytes: 0,
                disk_bytes: 0,
                budget,
                limit: budget,
                watched: budget,
                reserved: 0,
                held_back: 0,
                footprint: 0,
                clock: 0,
                declined: 0,
                evicted: 0,
                policy_calls: 0,
                policy_nanos: 0,
                clock_nanos: clock_cost(),
            }),
            orders: Orders::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the accounting half-done in a way
        // that matters more than stopping the daemon would, so keep serving.
        self.inner.locked()
    }

    /// Looks a sample up, marking it used.
    pub fn get(&self, key: &Key) -> Option<Bytes> {
        let mut inner = self.lock();
        inner.clock += 1;
        let data = inner.entries.get(key)?.data.clone();
        let now = inner.clock;
        inner.timed(|p| p.on_hit(key, now));
        Some(data)
    }

    /// Looks a sample up without counting a lookup or marking it used.
    pub fn peek(&self, key: &Key) -> Option<Bytes> {
        self.lock().entries.get(key).map(|e| e.data.clone())
    }

    /// Offers a sample that takes `disk` bytes in raw storage. Returns whether it was kept.
    pub fn insert(&self, key: Key, data: Bytes, disk: u64) -> bool {
        let mut inner = self.lock();
        if inner.entries.contains_key(&key) {
            return true;
        }
        let cost = inner.slabs.cost(data.len()) + ENTRY_OVERHEAD;
        if cost > inner.limit {
            inner.declined += 1;
            return false;
        }
        let size = Size {
            bytes: cost,
            miss_bytes: disk,
        };
        while inner.bytes + cost > inner.limit {
            let now = inner.clock;
            match inner.timed(|p| p.victim_for_newcomer(&key, size, now)) {
                Some(victim) => inner.remove(&victim),
                None => {
                    inner.declined += 1;
                    return false;
                }
            }
        }
        let now = inner.clock;
        // Placed now (copied into a slot when its size has slabs): its cost is the place's.
        let placed = inner.slabs.place(data);
        let cost = placed.bytes + ENTRY_OVERHEAD;
        let size = Size {
            bytes: cost,
            ..size
        };
        inner.bytes += cost;
        inner.disk_bytes += disk;
        let data = placed.data;
        inner.entries.insert(key, Entry { data, disk, cost });
        inner.timed(|p| p.on_insert(key, size, now));
        true
    }

    /// Records of `len` bytes will come (a fixed-shape dataset's): slabs for them from the
    /// first.
    pub fn expect_size(&self, len: usize) {
        self.lock().slabs.expect(len);
    }

    /// Tells the policy how many samples the open streams look up an epoch together.
    pub fn set_streaming_samples(&self, samples: u64) {
        self.lock().policy.set_streaming_samples(samples);
    }

    /// Stream `id` opened: it reads the order `key` from `position` on. Streams that report no
    /// future (an order too long to keep) are as if not open to the policy.
    pub fn stream_opened(&self, id: u64, key: OrderKey, position: u64) {
        let (Some(order), Some(next)) = (self.orders.get(key), self.orders.get(key.next())) else {
            return;
        };
        let event = StreamEvent::Opened {
            id,
            order,
            next,
            position,
        };
        self.tell(event);
    }

    /// Stream `id` is reading its order up to `position`.
    pub fn stream_at(&self, id: u64, position: u64) {
        self.tell(StreamEvent::At { id, position });
    }

    /// Stream `id` ended, having read its whole epoch or not.
    pub fn stream_closed(&self, id: u64, finished: bool) {
        self.tell(StreamEvent::Closed { id, finished });
    }

    fn tell(&self, event: StreamEvent) {
        let mut inner = self.lock();
        let now = inner.clock;
        let moved = matches!(event, StreamEvent::At { .. });
        inner.timed(|p| p.on_stream(event, now));
        // The streams' futures take memory of the budget too (a stream moving on changes none).
        if !moved {
            inner.apply_limit();
        }
    }

    /// Lowers (or restores, up to the budget less what is reserved) the byte limit, evicting at
    /// the policy's word until the tier fits.
    pub fn set_limit(&self, limit: u64) {
        let mut inner = self.lock();
        inner.watched = limit;
        inner.apply_limit();
    }

    /// Leaves `bytes` of the budget to something else (the shared-memory rings), evicting at the
    /// policy's word until the tier fits in the rest.
    pub fn set_reserved(&self, bytes: u64) {
        self.reserve_from(&std::sync::atomic::AtomicU64::new(bytes));
    }

    /// Holds `bytes` of the budget back for good (the message path's share of it), evicting at
    /// the policy's word until the tier fits in the rest.
    pub fn hold_back(&self, bytes: u64) {
        let mut inner = self.lock();
        inner.held_back = bytes;
        inner.apply_limit();
    }

    /// Leaves `bytes` of the budget to what the footprint account counts, evicting at the
    /// policy's word until the tier fits in the rest.
    pub fn set_footprint(&self, bytes: u64) {
        let mut inner = self.lock();
        inner.footprint = bytes;
        inner.apply_limit();
    }

    /// As `set_reserved`, with the bytes read from `counter` under the tier's lock (so that
    /// changes told at once cannot land in the wrong order).
    pub fn reserve_from(&self, counter: &std::sync::atomic::AtomicU64) {
        let mut inner = self.lock();
        inner.reserved = counter.load(std::sync::atomic::Ordering::Acquire);
        inner.apply_limit();
    }

    pub fn snapshot(&self) -> MemorySnapshot {
        let inner = self.lock();
        MemorySnapshot {
            bytes: inner.bytes,
            limit: inner.limit,
            budget: inner.budget,
            entries: inner.entries.len() as u64,
            disk_bytes: inner.disk_bytes,
            declined: inner.declined,
            evicted: inner.evicted,
            policy_bytes: inner.policy.extra_bytes() as u64,
            policy_seconds: inner.policy_nanos as f64 / 1e9,
            policy: inner.policy.name(),
        }
    }
}

impl Inner {
    fn apply_limit(&mut self) {
        let others =
            self.reserved + self.held_back + self.footprint + self.policy.extra_bytes() as u64;
        self.limit = self.watched.min(self.budget.saturating_sub(others));
        while self.bytes > self.limit {
            let now = self.clock;
            match self.timed(|p| p.victim(now)) {
                Some(victim) => self.remove(&victim),
                None => break,
            }
        }
    }

    /// Calls the policy, timing one call in `TIMED_EVERY`.
    fn timed<R>(&mut self, call: impl FnOnce(&mut dyn Eviction) -> R) -> R {
        self.policy_calls += 1;
        if !self.policy_calls.is_multiple_of(TIMED_EVERY) {
            return call(&mut *self.policy);
        }
        let started = std::time::Instant::now();
        let r = call(&mut *self.policy);
        let took = (started.elapsed().as_nanos() as u64).saturating_sub(self.clock_nanos);
        self.policy_nanos += took * TIMED_EVERY;
        r
    }

    /// Lets `key` go (the policy chose it).
    fn remove(&mut self, key: &Key) {
        self.timed(|p| p.on_remove(key));
        if let Some(e) = self.entries.remove(key) {
            self.bytes -= e.cost;
            self.disk_bytes -= e.disk;
            self.evicted += 1;
            if self.evicted.is_multiple_of(COMPACT_EVERY) {
                let Inner { slabs, entries, .. } = self;
                slabs.compact(entries.iter_mut().map(|(k, e)| (k, &mut e.data)));
            }
        }
    }
}

/// What timing a call costs beyond the call: the least of some back-to-back clock readings.
fn clock_cost() -> u64 {
    (0..64)
        .map(|_| {
            let t = std::time::Instant::now();
            t.elapsed().as_nanos() as u64
        })
        .min()
        .unwrap_or(0)
}
