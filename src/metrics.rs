//! Counters that show where the bottleneck is: per-tier hits and bytes, client stall time.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Where a sample was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Memory = 0,
    Scratch = 1,
    Raw = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Memory, Tier::Scratch, Tier::Raw];

    pub fn name(self) -> &'static str {
        match self {
            Tier::Memory => "memory",
            Tier::Scratch => "scratch",
            Tier::Raw => "raw",
        }
    }
}

/// Lookups and the bytes read for them, by the tier that served them: the daemon's, and each
/// dataset's.
#[derive(Debug, Default)]
pub struct TierCounters {
    hits: [AtomicU64; 3],
    bytes: [AtomicU64; 3],
}

impl TierCounters {
    pub fn record(&self, tier: Tier, bytes: u64) {
        self.hits[tier as usize].fetch_add(1, Relaxed);
        self.bytes[tier as usize].fetch_add(bytes, Relaxed);
    }

    pub fn hits(&self, tier: Tier) -> u64 {
        self.hits[tier as usize].load(Relaxed)
    }

    /// One entry per tier, as `Stats` carries them.
    pub fn to_proto(&self) -> Vec<crate::proto::TierStats> {
        Tier::ALL
            .iter()
            .map(|&t| crate::proto::TierStats {
                tier: t.name().to_string(),
                hits: self.hits(t),
                bytes: self.bytes[t as usize].load(Relaxed),
            })
            .collect()
    }
}

pub struct Metrics {
    started: Instant,
    lookups: TierCounters,
    coalesced: AtomicU64,
    stall_nanos: AtomicU64,
    batches: AtomicU64,
    samples: AtomicU64,
    bytes_served: AtomicU64,
    active_streams: AtomicU32,
    machine_available: AtomicU64,
    /// Batches delivered in a shared-memory slot, and batches sent in the message because the
    /// stream's ring had no free slot large enough.
    shm_batches: AtomicU64,
    shm_fallbacks: AtomicU64,
    /// Samples read ahead into the scratch tier for a node's next epoch, and the raw bytes read.
    prefetched: AtomicU64,
    prefetched_bytes: AtomicU64,
    /// Batches by how long they kept their stream's sender waiting (`WAIT_BOUNDS`, then
    /// longer), and the sum of those waits.
    waits: [AtomicU64; WAIT_BOUNDS.len() + 1],
    wait_sum_nanos: AtomicU64,
}

/// The batch-wait histogram's upper bounds, in seconds (tf.data's guide calls input not the
/// bottleneck under 50 us).
pub const WAIT_BOUNDS: [f64; 9] = [0.00005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            started: Instant::now(),
            lookups: TierCounters::default(),
            coalesced: AtomicU64::new(0),
            stall_nanos: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            bytes_served: AtomicU64::new(0),
            active_streams: AtomicU32::new(0),
            machine_available: AtomicU64::new(0),
            shm_batches: AtomicU64::new(0),
            shm_fallbacks: AtomicU64::new(0),
            prefetched: AtomicU64::new(0),
            prefetched_bytes: AtomicU64::new(0),
            waits: Default::default(),
            wait_sum_nanos: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn record_hit(&self, tier: Tier, bytes: u64) {
        self.lookups.record(tier, bytes);
    }

    pub fn record_coalesced(&self) {
        self.coalesced.fetch_add(1, Relaxed);
    }

    pub fn record_stall(&self, d: Duration) {
        self.stall_nanos.fetch_add(d.as_nanos() as u64, Relaxed);
    }

    /// A batch kept its stream's sender waiting `d` (zero: it was ready).
    pub fn record_batch_wait(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let bucket = WAIT_BOUNDS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(WAIT_BOUNDS.len());
        self.waits[bucket].fetch_add(1, Relaxed);
        self.wait_sum_nanos.fetch_add(d.as_nanos() as u64, Relaxed);
    }

    /// `samples` read ahead for a node's next epoch, `bytes` of raw storage read for them.
    pub fn record_prefetch(&self, samples: u64, bytes: u64) {
        self.prefetched.fetch_add(samples, Relaxed);
        self.prefetched_bytes.fetch_add(bytes, Relaxed);
    }

    pub fn record_batch(&self, samples: u64, bytes: u64) {
        self.batches.fetch_add(1, Relaxed);
        self.samples.fetch_add(samples, Relaxed);
        self.bytes_served.fetch_add(bytes, Relaxed);
    }

    /// A batch went out in a shared-memory slot (`true`) or in the message for want of one.
    pub fn record_shm(&self, in_slot: bool) {
        let c = if in_slot {
            &self.shm_batches
        } else {
            &self.shm_fallbacks
        };
        c.fetch_add(1, Relaxed);
    }

    pub fn stream_opened(&self) {
        self.active_streams.fetch_add(1, Relaxed);
    }

    pub fn stream_closed(&self) {
        self.active_streams.fetch_sub(1, Relaxed);
    }

    pub fn set_machine_available(&self, bytes: u64) {
        self.machine_available.store(bytes, Relaxed);
    }

    pub fn hits(&self, tier: Tier) -> u64 {
        self.lookups.hits(tier)
    }

    /// Counters as the Stats message (memory-tier fields are filled by the caller).
    pub fn to_proto(&self) -> crate::proto::Stats {
        let tiers = self.lookups.to_proto();
        let lookups: u64 = Tier::ALL.iter().map(|&t| self.hits(t)).sum();
        let hit_rate = if lookups == 0 {
            0.0
        } else {
            self.hits(Tier::Memory) as f64 / lookups as f64
        };
        crate::proto::Stats {
            tiers,
            hit_rate,
            client_stall_seconds: self.stall_nanos.load(Relaxed) as f64 / 1e9,
            batches_served: self.batches.load(Relaxed),
            samples_served: self.samples.load(Relaxed),
            bytes_served: self.bytes_served.load(Relaxed),
            active_streams: self.active_streams.load(Relaxed),
            coalesced_fetches: self.coalesced.load(Relaxed),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            machine_available_bytes: self.machine_available.load(Relaxed),
            shm_batches: self.shm_batches.load(Relaxed),
            shm_fallbacks: self.shm_fallbacks.load(Relaxed),
            prefetched_samples: self.prefetched.load(Relaxed),
            prefetched_raw_bytes: self.prefetched_bytes.load(Relaxed),
            object_gets: crate::objects::GETS.load(Relaxed),
            object_bytes: crate::objects::GOT_BYTES.load(Relaxed),
            batch_wait_bounds: WAIT_BOUNDS.to_vec(),
            batch_wait_counts: self
                .waits
                .iter()
                .scan(0, |sum, c| {
                    *sum += c.load(Relaxed);
                    Some(*sum)
                })
                .collect(),
            batch_wait_sum_seconds: self.wait_sum_nanos.load(Relaxed) as f64 / 1e9,
            ..Default::default()
        }
    }
}
