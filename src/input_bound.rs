//! Is a job input-bound, and if so, why? The client measures, per stream, the time its loop
//! waited in `next()` for a batch and the time it spent elsewhere between batches (its step),
//! and reports both over its last seconds; the daemon knows where the stream's samples came
//! from lately and how busy its preprocessing pool is. This module turns the two into a verdict,
//! a cause and the fix that fits it. What reads it: `ListStreams` (so `larder top`), the
//! client's own `stats()`, and the Prometheus exposition.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Above this share of its step time waiting for batches, a job is input-bound.
pub const INPUT_BOUND: f64 = 0.20;
/// Below this share it is compute-bound (in between: balanced).
pub const COMPUTE_BOUND: f64 = 0.05;
/// How far back the daemon's side looks (the tier mix of a stream's samples, the pool's use).
pub const WINDOW: Duration = Duration::from_secs(10);
/// A client's report counts this long; after it, the daemon's own measure is used.
pub const REPORT_FRESH: Duration = Duration::from_secs(5);
/// The pool is saturated above this share of its threads' time.
const POOL_SATURATED: f64 = 0.85;
/// A lower tier is the cause when at least this share of the window's samples came from it.
const LOWER_TIER_SHARE: f64 = 0.2;

/// Counters over the last seconds: one bucket per second, `N` values each, 16 seconds kept.
/// Adding is lock-free; a bucket is cleared by the first add of a new second (a race there may
/// lose an add at a second's edge, which a share over ten seconds does not feel).
pub struct Recent<const N: usize> {
    start: Instant,
    /// Per bucket: the second it holds (since `start`, plus one; 0 = empty) and its values.
    buckets: [(AtomicU64, [AtomicU64; N]); 16],
}

impl<const N: usize> std::fmt::Debug for Recent<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Recent({:?})", self.sum(WINDOW).0)
    }
}

impl<const N: usize> Default for Recent<N> {
    fn default() -> Self {
        Recent {
            start: Instant::now(),
            buckets: std::array::from_fn(|_| {
                (
                    AtomicU64::new(0),
                    std::array::from_fn(|_| AtomicU64::new(0)),
                )
            }),
        }
    }
}

impl<const N: usize> Recent<N> {
    /// Adds `values` to this second's bucket.
    pub fn add(&self, values: [u64; N]) {
        let second = self.start.elapsed().as_secs() + 1;
        let (tag, counts) = &self.buckets[(second % 16) as usize];
        let was = tag.load(Relaxed);
        if was != second && tag.compare_exchange(was, second, Relaxed, Relaxed).is_ok() {
            for c in counts {
                c.store(0, Relaxed);
            }
        }
        for (c, v) in counts.iter().zip(values) {
            c.fetch_add(v, Relaxed);
        }
    }

    /// The sums over the last `window` (whole seconds, this one included), and the time they
    /// span (less than `window` while this is younger).
    pub fn sum(&self, window: Duration) -> ([u64; N], Duration) {
        let now = self.start.elapsed();
        let second = now.as_secs() + 1;
        let seconds = window.as_secs().clamp(1, 15);
        let mut out = [0u64; N];
        for (tag, counts) in &self.buckets {
            let t = tag.load(Relaxed);
            if t != 0 && t + seconds > second {
                for (o, c) in out.iter_mut().zip(counts) {
                    *o += c.load(Relaxed);
                }
            }
        }
        // The whole seconds before this one, and this one so far.
        let span = now.min(
            Duration::from_secs(seconds - 1) + Duration::from_nanos(now.subsec_nanos().into()),
        );
        (out, span)
    }
}

/// What the client said of a stream: its loop's wait for batches and its step between them,
/// in total and over its last seconds (a window that spans the job's epochs).
#[derive(Debug, Clone, Copy, Default)]
pub struct ClientReport {
    pub batches: u64,
    pub wait: Duration,
    pub step: Duration,
    pub window_wait: Duration,
    pub window_step: Duration,
}

/// Where a stream's samples came from over the window: memory, scratch, raw.
pub type TierMix = [u64; 3];

/// A stream's verdict and what it rests on.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    /// The share of step time spent waiting for batches (0..=1).
    pub wait_ratio: f64,
    /// Whether `wait_ratio` is the client's measure (else the daemon's: the time the stream's
    /// sender waited for a batch, over the time open).
    pub measured_by_client: bool,
    pub verdict: &'static str,
    /// Why batches are late, when the job is input-bound or balanced: "raw reads",
    /// "preprocessing", "scratch reads" or "delivery"; empty otherwise.
    pub cause: &'static str,
    /// The fix that fits the cause, in words, naming the dataset.
    pub advice: String,
}

/// The verdict by the wait's share of step time, over `seconds` of it ("starting" under one
/// second).
pub fn verdict(seconds: f64, wait_ratio: f64) -> &'static str {
    if seconds < 1.0 {
        "starting"
    } else if wait_ratio > INPUT_BOUND {
        "input-bound"
    } else if wait_ratio >= COMPUTE_BOUND {
        "balanced"
    } else {
        "compute-bound"
    }
}

/// Judges a stream. `report`: the client's, if fresh; else `daemon` = (time the job's streams
/// have been open, time they kept their sender waiting). `mix`: where the stream's samples came
/// from over the window; `pool_busy`: the preprocessing pool's busy share over it.
pub fn judge(
    dataset: &str,
    report: Option<ClientReport>,
    daemon: (Duration, Duration),
    mix: TierMix,
    pool_busy: f64,
) -> Judgement {
    let (seconds, wait_ratio, measured_by_client) = match report {
        Some(r) => {
            let total = (r.window_wait + r.window_step).as_secs_f64();
            let ratio = if total > 0.0 {
                r.window_wait.as_secs_f64() / total
            } else {
                0.0
            };
            (total, ratio, true)
        }
        None => {
            let (open, waited) = (daemon.0.as_secs_f64(), daemon.1.as_secs_f64());
            let ratio = if open > 0.0 { waited / open } else { 0.0 };
            (open, ratio.min(1.0), false)
        }
    };
    let verdict = verdict(seconds, wait_ratio);
    let (cause, advice) = if matches!(verdict, "input-bound" | "balanced") {
        cause(dataset, mix, pool_busy)
    } else {
        ("", String::new())
    };
    Judgement {
        wait_ratio,
        measured_by_client,
        verdict,
        cause,
        advice,
    }
}

/// Why a waiting stream's batches are late, and what fixes it. Samples decoded from raw files
/// with the pool saturated: "preprocessing"; with the pool not saturated: "raw reads" (the
/// files themselves are slow); from the scratch tier: "scratch reads"; from memory: "delivery"
/// (the batches are ready in memory and still late: the daemon or the transport is short of
/// CPU).
pub fn cause(dataset: &str, mix: TierMix, pool_busy: f64) -> (&'static str, String) {
    if mix.iter().sum::<u64>() == 0 {
        return (
            "stalled",
            format!(
                "no batch of {dataset:?} was assembled for this stream in the last 10 s: its reads are very slow or stuck (see the daemon's log, `larder bad`, the disk)"
            ),
        );
    }
    let total = mix.iter().sum::<u64>() as f64;
    let (scratch, raw) = (mix[1] as f64 / total, mix[2] as f64 / total);
    if raw >= LOWER_TIER_SHARE && pool_busy >= POOL_SATURATED {
        (
            "preprocessing",
            format!(
                "the preprocessing pool is saturated reading and preparing {dataset:?}: run `larder warm {dataset}` before the job so epochs read preprocessed samples, or raise `preprocess_workers` if cores are free"
            ),
        )
    } else if raw >= LOWER_TIER_SHARE {
        (
            "raw reads",
            format!(
                "{:.0}% of the samples come from the raw files: run `larder warm {dataset}` to preprocess them into the scratch tier ahead of the job",
                raw * 100.0
            ),
        )
    } else if scratch >= LOWER_TIER_SHARE {
        (
            "scratch reads",
            format!(
                "{:.0}% of the samples come from the scratch tier: a larger `[memory] budget_bytes` keeps more of {dataset:?} in memory",
                scratch * 100.0
            ),
        )
    } else {
        (
            "delivery",
            "the samples are in memory and still late: use the Unix socket (shared-memory rings), keep `prefetch` at 2 or more and the DataLoader's `num_workers` at 0, and check that the daemon is not short of CPU".to_string(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(wait_ms: u64, step_ms: u64) -> Option<ClientReport> {
        Some(ClientReport {
            batches: 10,
            wait: Duration::from_millis(wait_ms),
            step: Duration::from_millis(step_ms),
            window_wait: Duration::from_millis(wait_ms),
            window_step: Duration::from_millis(step_ms),
        })
    }

    #[test]
    fn the_clients_measure_decides_the_verdict() {
        let none = (Duration::ZERO, Duration::ZERO);
        let j = judge("d", report(3000, 1000), none, [0, 0, 100], 0.2);
        assert_eq!((j.verdict, j.cause), ("input-bound", "raw reads"));
        assert!(j.measured_by_client);
        assert!((j.wait_ratio - 0.75).abs() < 1e-9);
        assert!(j.advice.contains("larder warm d"), "{}", j.advice);
        let j = judge("d", report(100, 9900), none, [0, 0, 100], 0.2);
        assert_eq!(
            (j.verdict, j.cause, j.advice.as_str()),
            ("compute-bound", "", "")
        );
        let j = judge("d", report(1000, 9000), none, [100, 0, 0], 0.2);
        assert_eq!((j.verdict, j.cause), ("balanced", "delivery"));
        let j = judge("d", report(100, 200), none, [0, 0, 100], 0.2);
        assert_eq!(j.verdict, "starting", "under a second measured");
    }

    #[test]
    fn without_a_report_the_daemons_measure_decides() {
        let d = (Duration::from_secs(10), Duration::from_secs(5));
        let j = judge("d", None, d, [10, 90, 0], 0.0);
        assert_eq!((j.verdict, j.cause), ("input-bound", "scratch reads"));
        assert!(!j.measured_by_client);
        assert!(j.advice.contains("budget_bytes"));
    }

    #[test]
    fn a_saturated_pool_decoding_raw_files_is_named() {
        assert_eq!(cause("d", [0, 0, 10], 0.95).0, "preprocessing");
        assert_eq!(cause("d", [0, 0, 10], 0.5).0, "raw reads");
        assert_eq!(
            cause("d", [90, 0, 10], 0.95).0,
            "delivery",
            "10% raw is not the cause"
        );
        assert_eq!(
            cause("d", [0, 0, 0], 0.0).0,
            "stalled",
            "nothing assembled in the window"
        );
    }

    #[test]
    fn recent_counts_only_the_window() {
        let r = Recent::<2>::default();
        r.add([1, 2]);
        r.add([3, 4]);
        let (sum, span) = r.sum(WINDOW);
        assert_eq!(sum, [4, 6]);
        assert!(span <= Duration::from_secs(1));
        // A bucket 12 seconds old counts in a 15-second window, not in a 10-second one.
        let Some(start) = Instant::now().checked_sub(Duration::from_secs(30)) else {
            return;
        };
        let r = Recent::<1> {
            start,
            ..Default::default()
        };
        r.add([4]);
        let now = r.start.elapsed().as_secs() + 1;
        let old = &r.buckets[((now - 12) % 16) as usize];
        old.0.store(now - 12, Relaxed);
        old.1[0].store(100, Relaxed);
        assert_eq!(r.sum(WINDOW).0, [4]);
        assert_eq!(r.sum(Duration::from_secs(15)).0, [104]);
    }
}
