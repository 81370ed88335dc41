//! Buffers for batches that go in gRPC messages (the bytes path: TCP clients, and Unix-socket
//! clients without a ring), reused from batch to batch. A batch of ImageNet-size samples is
//! tens of MB; a fresh buffer each time costs the kernel a page fault per 4 KiB and the
//! allocator an munmap when it is freed, which took more of the daemon's time than copying the
//! samples. A buffer comes back for reuse once gRPC has encoded (and dropped) its batch.

use bytes::{Bytes, BytesMut};
use std::sync::Mutex;

/// Bytes of spare message buffers the daemon keeps for reuse.
pub const MESSAGE_BUFFERS_KEPT: usize = 256 << 20;

/// The daemon's spare message buffers.
pub struct MessageBuffers {
    /// Empty handles on the allocations of earlier batches, with their sizes: each shares its
    /// allocation with its batch until that batch is dropped, and then reclaims it.
    spare: Mutex<Vec<(BytesMut, usize)>>,
    /// Bytes the spares may keep allocated at most (a memory cost outside the tiers' budget).
    keep_bytes: usize,
}

impl MessageBuffers {
    pub fn new(keep_bytes: usize) -> MessageBuffers {
        MessageBuffers {
            spare: Mutex::new(Vec::new()),
            keep_bytes,
        }
    }

    /// An empty buffer with room for `len` bytes: the allocation of an earlier batch that is
    /// gone (reclaimed: no page faults), else new memory. Write the batch into it and hand it
    /// to `finish`.
    pub fn take(&self, len: usize) -> BytesMut {
        let mut spare = self.lock();
        // Oldest first: the batches longest sent are the likeliest to be gone.
        for i in 0..spare.len() {
            if spare[i].1 >= len && spare[i].0.try_reclaim(len) {
                return spare.remove(i).0;
            }
        }
        BytesMut::with_capacity(len)
    }

    /// The batch written into `buf`, for a message; `buf`'s allocation is kept for a later
    /// batch (the oldest spares are let go past the byte limit).
    pub fn finish(&self, mut buf: BytesMut) -> Bytes {
        let len = buf.len();
        let batch = buf.split().freeze();
        let mut spare = self.lock();
        spare.push((buf, len));
        let mut kept: usize = spare.iter().map(|(_, n)| n).sum();
        while kept > self.keep_bytes {
            kept -= spare.remove(0).1;
        }
        batch
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(BytesMut, usize)>> {
        self.spare.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_s_allocation_is_reused_once_the_batch_is_dropped() {
        let pool = MessageBuffers::new(1 << 20);
        let mut buf = pool.take(1000);
        buf.extend_from_slice(&[7; 1000]);
        let first = pool.finish(buf);
        let at = first.as_ptr();
        // Still in use: the next batch gets other memory, and the first keeps its bytes.
        let mut buf = pool.take(1000);
        assert_ne!(buf.as_ptr(), at);
        buf.extend_from_slice(&[8; 1000]);
        let second = pool.finish(buf);
        assert!(first.iter().all(|&b| b == 7) && second.iter().all(|&b| b == 8));
        let second_at = second.as_ptr();
        drop(first);
        drop(second);
        // Gone: the next batches reuse their memory, the oldest first.
        assert_eq!(pool.take(600).as_ptr(), at);
        assert_eq!(pool.take(1000).as_ptr(), second_at);
    }

    #[test]
    fn spares_are_kept_up_to_the_byte_limit() {
        let pool = MessageBuffers::new(2500);
        let batches: Vec<Bytes> = (0..4)
            .map(|_| {
                let mut buf = pool.take(1000);
                buf.resize(1000, 1);
                pool.finish(buf)
            })
            .collect();
        assert_eq!(pool.lock().len(), 2);
        // The newest two are kept, and reused once their batches are gone; a third batch gets
        // new memory.
        let kept = [batches[2].as_ptr(), batches[3].as_ptr()];
        drop(batches);
        let (a, b, c) = (pool.take(1000), pool.take(1000), pool.take(1000));
        assert!(kept.contains(&a.as_ptr()) && kept.contains(&b.as_ptr()));
        assert!(!kept.contains(&c.as_ptr()));
    }
}
