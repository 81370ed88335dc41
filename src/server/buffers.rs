//! Buffers for batches that go in gRPC messages (the bytes path: TCP clients, and Unix-socket
//! clients without a ring), reused from batch to batch. A batch of ImageNet-size samples is
//! tens of MB; a fresh buffer each time costs the kernel a page fault per 4 KiB, which took
//! more of the daemon's time than copying the samples.
//!
//! Every large buffer is counted from the moment it is handed out until its memory is freed:
//! a batch's bytes own their buffer ([`Bytes::from_owner`]), and when gRPC has encoded and
//! dropped the batch the buffer comes back here, where it waits for a later batch of its size
//! class (sizes are rounded up to one of four steps per power of two, so batches of nearby
//! sizes share buffers and a buffer is at most a quarter larger than its batch). Waiting
//! buffers are let go oldest first past the byte limit, when unused for [`SPARE_IDLE`], and
//! all at once when the machine runs short of memory ([`MessageBuffers::release`]).
//!
//! A spare is counted by its allocation's capacity, never by the length of the last batch
//! written into it: a small field written into a large spare still counts tens of MB.

use crate::sync::Locked;
use bytes::Bytes;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Buffers smaller than this are plain allocations, neither pooled nor counted: the allocator
/// serves them from its own free lists without page faults.
pub const POOLED_FROM: usize = 256 << 10;

/// A spare unused for this long is freed (an idle daemon keeps no message buffers).
pub const SPARE_IDLE: Duration = Duration::from_secs(10);

/// The daemon's message buffers: the spares, and the count of those in batches.
pub struct MessageBuffers {
    inner: Arc<Inner>,
}

/// Counts bytes in a counter while it lives.
pub struct Held {
    bytes: u64,
    counter: Arc<AtomicU64>,
}

impl Held {
    fn new(counter: &Arc<AtomicU64>, bytes: u64) -> Held {
        counter.fetch_add(bytes, Relaxed);
        Held {
            bytes,
            counter: counter.clone(),
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Relaxed);
    }
}

struct Inner {
    /// Buffers whose batches are gone, oldest first, with the time each came back.
    spare: Mutex<VecDeque<(Vec<u8>, Instant)>>,
    /// Bytes (allocated capacity) of the spares.
    spare_bytes: AtomicU64,
    /// Bytes (allocated capacity) of the pooled buffers taken and not yet back.
    in_use_bytes: Arc<AtomicU64>,
    /// Bytes the spares may take at most.
    keep_bytes: usize,
    /// Bytes of encoded messages (tonic's copies of batches) that hyper has not yet sent
    /// (counted by `sent::CountedBody`).
    encoded: Arc<AtomicU64>,
    /// Bytes of the samples that batches being assembled hold (some of them are also in the
    /// memory tier; the rest were fetched past it, or evicted from it since).
    assembling: Arc<AtomicU64>,
    /// The message path's share of the memory budget: spares and bytes in flight together.
    /// Spares are kept only within what the batches in flight leave of it, and streams read
    /// ahead into messages only while the path holds less ([`MessageBuffers::may_read_ahead`]).
    cap: u64,
}

/// A buffer from [`MessageBuffers::take`] being written: counted as in use from the start
/// (`held`), and uncounted however it ends, finished or dropped half-way.
pub struct Pooled {
    data: Vec<u8>,
    held: Held,
}

impl std::ops::Deref for Pooled {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.data
    }
}

impl std::ops::DerefMut for Pooled {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.data
    }
}

/// A pooled buffer while it holds a batch: gives itself back to the pool when the last
/// `Bytes` of the batch is dropped (and is uncounted as in use then, by its `held`).
struct Lent {
    data: Vec<u8>,
    _held: Held,
    pool: Arc<Inner>,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.pool.put_back(std::mem::take(&mut self.data));
    }
}

/// The size class of a buffer for `len` bytes: `len` rounded up to 1, 1.25, 1.5 or 1.75 times
/// a power of two.
pub fn size_class(len: usize) -> usize {
    if len <= 4 {
        return len.max(1);
    }
    let top = usize::BITS - 1 - len.leading_zeros(); // 2^top <= len < 2^(top+1)
    let step = 1usize << (top - 2);
    len.div_ceil(step) * step
}

impl MessageBuffers {
    /// Buffers keeping at most `keep_bytes` of spares, the path without a share of its own.
    pub fn new(keep_bytes: usize) -> MessageBuffers {
        MessageBuffers::within(keep_bytes, u64::MAX)
    }

    /// Buffers keeping at most `keep_bytes` of spares, the path within `cap` bytes (spares
    /// and bytes in flight; see [`MessageBuffers::may_read_ahead`]).
    pub fn within(keep_bytes: usize, cap: u64) -> MessageBuffers {
        MessageBuffers {
            inner: Arc::new(Inner {
                spare: Mutex::new(VecDeque::new()),
                spare_bytes: AtomicU64::new(0),
                in_use_bytes: Arc::new(AtomicU64::new(0)),
                keep_bytes,
                encoded: Arc::new(AtomicU64::new(0)),
                assembling: Arc::new(AtomicU64::new(0)),
                cap,
            }),
        }
    }

    /// Counts `bytes` of samples held by a batch being assembled, until the guard is dropped.
    pub fn hold_samples(&self, bytes: u64) -> Held {
        Held::new(&self.inner.assembling, bytes)
    }

    /// The count of encoded messages not yet sent, for the servers' response bodies.
    pub fn encoded_counter(&self) -> Arc<AtomicU64> {
        self.inner.encoded.clone()
    }

    /// The message path's share of the memory budget.
    pub fn cap(&self) -> u64 {
        self.inner.cap
    }

    /// Whether a stream may start a batch ahead of the one its client waits for: while the path
    /// (bytes in flight and spares) holds less than its share. Spares go first: past the share
    /// they are freed before any stream is held back.
    pub fn may_read_ahead(&self) -> bool {
        let in_flight = self.in_flight();
        let room = self.inner.cap.saturating_sub(in_flight);
        if self.inner.spare_bytes.load(Relaxed) > room {
            self.inner.shed(room);
        }
        room > 0
    }

    /// Waits until the stream may assemble its batch: at once when it is the batch the client
    /// waits for (`next()`: so every stream moves on, whatever the others hold), else when
    /// [`MessageBuffers::may_read_ahead`] says so. Polls every millisecond: the bytes it waits
    /// on are freed by other streams' sends, in hyper's tasks.
    pub async fn wait_to_read_ahead(&self, next: impl Fn() -> bool) {
        while !next() && !self.may_read_ahead() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// An empty buffer with room for `len` bytes: a spare of its size class (no page faults),
    /// else new memory. Write the batch into it and hand it to `finish`.
    pub fn take(&self, len: usize) -> Pooled {
        if len < POOLED_FROM {
            let held = Held::new(&self.inner.in_use_bytes, 0);
            return Pooled {
                data: Vec::with_capacity(len),
                held,
            };
        }
        let class = size_class(len);
        let reused = {
            let mut spare = self.inner.lock();
            let at = spare.iter().position(|(b, _)| b.capacity() == class);
            at.and_then(|i| spare.remove(i)).map(|(b, _)| b)
        };
        let data = match reused {
            Some(b) => {
                self.inner
                    .spare_bytes
                    .fetch_sub(b.capacity() as u64, Relaxed);
                b
            }
            None => Vec::with_capacity(class),
        };
        let held = Held::new(&self.inner.in_use_bytes, data.capacity() as u64);
        Pooled { data, held }
    }

    /// The batch written into `buf` (from `take`), for a message; its buffer comes back when
    /// the last handle on the batch is dropped.
    pub fn finish(&self, buf: Pooled) -> Bytes {
        let Pooled { data, held } = buf;
        if held.bytes == 0 {
            return Bytes::from(data);
        }
        Bytes::from_owner(Lent {
            data,
            _held: held,
            pool: self.inner.clone(),
        })
    }

    /// Frees the spares unused for `idle` or longer.
    pub fn trim(&self, idle: Duration) {
        let mut spare = self.inner.lock();
        while spare.front().is_some_and(|(_, at)| at.elapsed() >= idle) {
            let (b, _) = spare.pop_front().expect("checked");
            self.inner
                .spare_bytes
                .fetch_sub(b.capacity() as u64, Relaxed);
        }
    }

    /// Frees every spare (the machine is short of memory).
    pub fn release(&self) {
        self.trim(Duration::ZERO);
    }

    /// Bytes on their way to clients: pooled buffers in batches, the samples batches being
    /// assembled hold, and encoded messages not yet sent.
    pub fn in_flight(&self) -> u64 {
        self.inner.in_flight()
    }

    /// Bytes of (spare, in batches now) pooled buffers.
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.inner.spare_bytes.load(Relaxed),
            self.inner.in_use_bytes.load(Relaxed),
        )
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(Vec<u8>, Instant)>> {
        self.spare.locked()
    }

    fn in_flight(&self) -> u64 {
        self.in_use_bytes.load(Relaxed) + self.assembling.load(Relaxed) + self.encoded.load(Relaxed)
    }

    /// Keeps `data` as a spare (emptied), letting the oldest go past the byte limit: the
    /// spares' own cap, and what the bytes in flight leave of the path's share.
    fn put_back(&self, mut data: Vec<u8>) {
        let cap = data.capacity();
        // Only buffers of a size class are ever taken again (one a writer grew is not).
        if cap > self.keep_bytes || cap < POOLED_FROM || size_class(cap) != cap {
            return;
        }
        data.clear();
        // The buffer is still counted in flight (its batch's count goes after this returns).
        let in_flight = self.in_flight().saturating_sub(cap as u64);
        let keep = self
            .cap
            .saturating_sub(in_flight)
            .min(self.keep_bytes as u64);
        let mut spare = self.lock();
        spare.push_back((data, Instant::now()));
        self.spare_bytes.fetch_add(cap as u64, Relaxed);
        self.shed_locked(&mut spare, keep);
    }

    /// Frees spares, oldest first, until they take at most `keep` bytes.
    fn shed(&self, keep: u64) {
        self.shed_locked(&mut self.lock(), keep);
    }

    /// As `shed`, with the spares' lock held.
    fn shed_locked(&self, spare: &mut VecDeque<(Vec<u8>, Instant)>, keep: u64) {
        while self.spare_bytes.load(Relaxed) > keep {
            let Some((b, _)) = spare.pop_front() else {
                break;
            };
            self.spare_bytes.fetch_sub(b.capacity() as u64, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: usize = 1 << 20;

    fn batch(pool: &MessageBuffers, len: usize, byte: u8) -> Bytes {
        let mut buf = pool.take(len);
        buf.resize(len, byte);
        pool.finish(buf)
    }

    #[test]
    fn size_classes_are_at_most_a_quarter_larger() {
        for len in [5, 7, 100, 1000, 4096, 4097, 300_000, 19 * MB + 3, 200 * MB] {
            let c = size_class(len);
            assert!(c >= len && c * 4 <= len * 5 + 4 * 4, "{len} -> {c}");
            assert_eq!(size_class(c), c, "a class is its own class");
        }
        // Nearby sizes share a class.
        assert_eq!(size_class(3 * MB + 1), size_class(3 * MB + 100_000));
    }

    #[test]
    fn a_batch_s_buffer_is_reused_once_the_batch_is_dropped() {
        let pool = MessageBuffers::new(64 * MB);
        let first = batch(&pool, MB, 7);
        let at = first.as_ptr();
        // Still in use: the next batch gets other memory, and the first keeps its bytes.
        let second = batch(&pool, MB, 8);
        assert_ne!(second.as_ptr(), at);
        assert!(first.iter().all(|&b| b == 7) && second.iter().all(|&b| b == 8));
        assert_eq!(pool.bytes(), (0, 2 * MB as u64));
        let clone = first.slice(10..20);
        drop(first);
        assert_eq!(pool.bytes().0, 0, "a slice of the batch still holds it");
        drop(clone);
        assert_eq!(pool.bytes(), (MB as u64, MB as u64));
        // Gone: a batch of the same size class reuses its memory.
        let third = batch(&pool, MB - 1000, 9);
        assert_eq!(third.as_ptr(), at);
        assert_eq!(pool.bytes(), (0, 2 * MB as u64));
    }

    #[test]
    fn a_small_field_never_takes_a_large_buffer() {
        let pool = MessageBuffers::new(64 * MB);
        drop(batch(&pool, 4 * MB, 1));
        let small = pool.take(300_000);
        assert!(small.capacity() < 400_000, "{}", small.capacity());
        let labels = pool.take(1024);
        assert_eq!(labels.capacity(), 1024);
        assert_eq!(
            pool.bytes().0,
            4 * MB as u64,
            "the large spare is still there"
        );
    }

    #[test]
    fn spares_are_counted_by_their_allocation_and_kept_up_to_the_limit() {
        let pool = MessageBuffers::new(10 * MB);
        // Batches of many sizes, as clients with different batch sizes send.
        for i in 0..200 {
            drop(batch(&pool, MB + i * 37_000, 1));
        }
        let (spare, in_use) = pool.bytes();
        assert_eq!(in_use, 0);
        assert!(spare <= 10 * MB as u64, "{spare}");
        let held: u64 = pool
            .inner
            .lock()
            .iter()
            .map(|(b, _)| b.capacity() as u64)
            .sum();
        assert_eq!(held, spare, "the count is the allocations' capacity");
        // A buffer larger than the limit is never kept.
        drop(batch(&pool, 11 * MB, 1));
        assert_eq!(pool.bytes().1, 0);
        assert!(pool.bytes().0 <= 10 * MB as u64);
    }

    #[test]
    fn a_buffer_dropped_unfinished_or_grown_keeps_the_count_right() {
        let pool = MessageBuffers::new(64 * MB);
        let failed = pool.take(MB);
        assert_eq!(pool.bytes().1, size_class(MB) as u64);
        drop(failed); // the batch failed half-way
        assert_eq!(pool.bytes(), (0, 0));
        let mut grown = pool.take(MB);
        grown.resize(3 * MB + 1, 1); // written past its class: reallocated to no class
        drop(pool.finish(grown));
        assert_eq!(pool.bytes(), (0, 0), "counted as taken, not kept");
    }

    #[test]
    fn idle_spares_go_and_release_frees_all() {
        let pool = MessageBuffers::new(64 * MB);
        drop(batch(&pool, MB, 1));
        std::thread::sleep(Duration::from_millis(30));
        drop(batch(&pool, 2 * MB, 1));
        pool.trim(Duration::from_millis(20));
        assert_eq!(
            pool.bytes().0,
            2 * MB as u64,
            "only the older one was idle long enough"
        );
        pool.release();
        assert_eq!(pool.bytes(), (0, 0));
    }

    #[test]
    fn the_path_keeps_to_its_share_spares_first() {
        // A share of 8 MB: 4 MB in flight leave room for 4 MB of spares.
        let pool = MessageBuffers::within(64 * MB, 8 * MB as u64);
        let a = batch(&pool, 2 * MB, 1);
        let b = batch(&pool, 2 * MB, 1);
        drop(batch(&pool, 3 * MB, 1));
        assert_eq!(
            pool.bytes().0,
            3 * MB as u64,
            "kept: 4 MB in flight leave room"
        );
        let class = size_class(2 * MB + 1); // a class of its own: 2.5 MB
        drop(batch(&pool, 2 * MB + 1, 1));
        let flying = pool.in_flight();
        assert_eq!(flying, 4 * MB as u64);
        assert_eq!(
            pool.bytes().0,
            class as u64,
            "spares within what the batches in flight leave, the oldest let go"
        );
        assert!(pool.may_read_ahead(), "below the share");
        // 7 MB in flight and 1 MB of spares pass nothing; 9 MB in flight is past the share:
        // no reading ahead, and the spares are gone.
        let c = batch(&pool, 3 * MB, 1);
        assert!(pool.may_read_ahead());
        assert!(pool.bytes().0 + pool.in_flight() <= 8 * MB as u64);
        let d = batch(&pool, 2 * MB, 1);
        assert!(!pool.may_read_ahead(), "past the share");
        drop((a, b));
        assert!(pool.may_read_ahead(), "room again once batches are sent");
        drop((c, d));
        assert!(pool.bytes().0 <= 8 * MB as u64);
    }

    #[tokio::test]
    async fn the_batch_a_client_waits_for_never_waits() {
        let pool = Arc::new(MessageBuffers::within(64 * MB, MB as u64));
        let held = batch(&pool, 2 * MB, 1); // past the share
        let next = Arc::new(AtomicU64::new(5));
        let n = next.clone();
        // Batch 5 is the one the client waits for: it goes at once.
        tokio::time::timeout(
            Duration::from_secs(1),
            pool.wait_to_read_ahead(|| 5 <= n.load(Relaxed)),
        )
        .await
        .expect("the next batch is not held up");
        // Batch 6 waits until the bytes in flight are sent, or until it is next.
        let waiting = {
            let (pool, n) = (pool.clone(), next.clone());
            tokio::spawn(async move { pool.wait_to_read_ahead(|| 6 <= n.load(Relaxed)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "read-ahead waits past the share");
        next.store(6, Relaxed); // batch 5 was sent: 6 is next
        tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .expect("goes once it is next")
            .unwrap();
        drop(held);
        assert!(pool.may_read_ahead());
    }
}
