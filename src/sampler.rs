//! Which samples a stream serves, in which order: a seeded permutation of the epoch,
//! sharded across DDP ranks, cut into batches, resumable from any batch.

use anyhow::{bail, Result};

/// SplitMix64: a small, well-mixed generator; the order must depend on nothing but the seed.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in 0..bound (bound > 0), without modulo bias.
    fn below(&mut self, bound: u64) -> u64 {
        let zone = u64::MAX - (u64::MAX % bound);
        loop {
            let x = self.next();
            if x < zone {
                return x % bound;
            }
        }
    }
}

/// The order in which one epoch visits all `n` samples: a pure function of (seed, epoch).
pub fn epoch_order(n: u64, seed: u64, epoch: u64, shuffle: bool) -> Vec<u64> {
    let mut order: Vec<u64> = (0..n).collect();
    if shuffle {
        let mut rng = SplitMix64(seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
        rng.next();
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// What one stream serves: one shard's batches of one epoch.
///
/// The sharding rule, the one place it is written (clients ask, never re-derive it): from
/// `start_sample` on, the epoch's order is cut into global batches of `batch_size`, taken in
/// rounds of `world_size`, one per rank: round t is every rank's loader step t, global batch
/// `t * world_size + r` is rank r's. A rank's DataLoader workers take its steps in turn from
/// `start_step` (worker k of K takes the steps t with (t - start_step) % K == k), as DataLoader
/// hands out their batches, so a resumed loader goes on in the same order. So once every
/// rank has taken T steps, the job has consumed exactly the first `T * world_size * batch_size`
/// samples of the order, whatever the number of workers: that position (`resume_sample`) resumes
/// the epoch on any number of ranks and workers with exactly the samples not yet seen.
///
/// The last round, when the rest does not fill it: with `even_batches` every rank gets a batch of
/// the same size, ceil(rest / world_size), padded with samples from the start of the order (as
/// `DistributedSampler(drop_last=False)` pads), so every rank takes the same number of steps; with
/// `drop_last` as well it is dropped. Without `even_batches` the rest is cut into batches of
/// `batch_size` for the first ranks, the last one short (dropped with `drop_last`).
#[derive(Debug, Clone)]
pub struct Plan {
    /// This shard's samples for the epoch, batch after batch.
    samples: Vec<u64>,
    /// Where each batch starts in `samples`, and where the last ends.
    bounds: Vec<usize>,
    /// The rank's loader step of each batch.
    pub steps: Vec<u64>,
    /// How many of each batch's samples, at its end, are padding (positions past the epoch's
    /// end, wrapped to its start) rather than the epoch's own.
    padding: Vec<u32>,
    pub num_batches: u64,
    pub start_batch: u64,
    /// For `resume_sample`: samples in the epoch, where this plan started, samples per round.
    num_samples: u64,
    start_sample: u64,
    round: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct PlanRequest {
    pub num_samples: u64,
    pub batch_size: u32,
    pub seed: u64,
    pub epoch: u64,
    pub rank: u32,
    pub world_size: u32,
    /// The DataLoader worker of the rank serving this shard, of `num_workers` (0 is taken as 1).
    pub worker: u32,
    pub num_workers: u32,
    /// Resume: the job has consumed this many samples of the epoch's order.
    pub start_sample: u64,
    /// Resume: skip the rank's loader steps before this one.
    pub start_step: u64,
    /// Resume: skip this many batches of this shard (after the two above).
    pub start_batch: u64,
    pub shuffle: bool,
    pub drop_last: bool,
    pub even_batches: bool,
}

impl Plan {
    pub fn new(req: PlanRequest) -> Result<Plan> {
        let world = req.world_size.max(1) as u64;
        let workers = req.num_workers.max(1) as u64;
        if req.batch_size == 0 {
            bail!("batch_size must be at least 1");
        }
        if req.rank as u64 >= world {
            bail!(
                "rank {} is out of range for world_size {world} (ranks are 0..{world})",
                req.rank
            );
        }
        if req.worker as u64 >= workers {
            bail!(
                "worker {} is out of range for num_workers {workers}",
                req.worker
            );
        }
        let n = req.num_samples;
        if req.start_sample > n {
            bail!(
                "start_sample {} is past the end of the epoch ({n} samples)",
                req.start_sample
            );
        }
        let order = epoch_order(n, req.seed, req.epoch, req.shuffle);
        let b = req.batch_size as u64;
        let (rank, worker) = (req.rank as u64, req.worker as u64);
        let round = world * b;
        let rest = n - req.start_sample;
        let full_rounds = rest / round;
        let tail = rest % round;
        let mut samples = vec![];
        let mut bounds = vec![0];
        let mut steps = vec![];
        let mut padding = vec![];
        // Position p of the order, wrapping to its start for padding.
        let at = |p: u64| order[(p % n.max(1)) as usize];
        let mut push = |step: u64, from: u64, len: u64| {
            if step >= req.start_step && (step - req.start_step) % workers == worker && len > 0 {
                samples.extend((from..from + len).map(at));
                bounds.push(samples.len());
                steps.push(step);
                padding.push((from + len).saturating_sub(n.max(from)) as u32);
            }
        };
        for t in 0..full_rounds {
            push(t, req.start_sample + t * round + rank * b, b);
        }
        let last = req.start_sample + full_rounds * round;
        if tail > 0 {
            if req.even_batches {
                let m = tail.div_ceil(world);
                if !(req.drop_last && m < b) {
                    push(full_rounds, last + rank * m, m);
                }
            } else {
                let from = rank * b;
                let len = tail.saturating_sub(from).min(b);
                if !(req.drop_last && len < b) {
                    push(full_rounds, last + from, len);
                }
            }
        }
        let num_batches = steps.len() as u64;
        if req.start_batch > num_batches {
            bail!(
                "start_batch {} is past the end of the epoch ({num_batches} batches for this shard)",
                req.start_batch
            );
        }
        Ok(Plan {
            samples,
            bounds,
            steps,
            padding,
            num_batches,
            start_batch: req.start_batch,
            num_samples: n,
            start_sample: req.start_sample,
            round,
        })
    }

    /// How many samples at the end of batch `b` are padding.
    pub fn padding(&self, b: u64) -> u32 {
        self.padding[b as usize]
    }

    /// Sample indices of batch `b`.
    pub fn batch(&self, b: u64) -> &[u64] {
        &self.samples[self.bounds[b as usize]..self.bounds[b as usize + 1]]
    }

    /// `num_samples` samples in order, in batches of `batch_size`, from batch `start_batch`
    /// (for tests of what reads plans).
    #[cfg(test)]
    pub fn sequential(num_samples: u64, batch_size: u32, start_batch: u64) -> Plan {
        Plan::new(PlanRequest {
            num_samples,
            batch_size,
            seed: 0,
            epoch: 0,
            rank: 0,
            world_size: 1,
            worker: 0,
            num_workers: 1,
            start_sample: 0,
            start_step: 0,
            start_batch,
            shuffle: false,
            drop_last: false,
            even_batches: false,
        })
        .expect("a valid plan")
    }

    /// Samples this stream will serve, from start_batch on.
    pub fn remaining_samples(&self) -> u64 {
        (self.samples.len() - self.bounds[self.start_batch as usize]) as u64
    }

    /// Samples in the epoch's order.
    pub fn num_samples(&self) -> u64 {
        self.num_samples
    }

    /// Where the stream starts in the epoch's order: the positions before it, in its share, it
    /// will not read this epoch.
    pub fn start_position(&self) -> u64 {
        match self.steps.get(self.start_batch as usize) {
            Some(&step) => (self.start_sample + step * self.round).min(self.num_samples),
            None => self.num_samples,
        }
    }

    /// Where the job stands in the epoch's order once every rank has taken the step of batch
    /// `b`: the `start_sample` that resumes right after it.
    pub fn resume_sample(&self, b: u64) -> u64 {
        let step = self.steps[b as usize];
        (self.start_sample + (step + 1) * self.round).min(self.num_samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(n: u64, bs: u32, rank: u32, ws: u32) -> PlanRequest {
        PlanRequest {
            num_samples: n,
            batch_size: bs,
            seed: 7,
            epoch: 0,
            rank,
            world_size: ws,
            worker: 0,
            num_workers: 1,
            start_sample: 0,
            start_step: 0,
            start_batch: 0,
            shuffle: true,
            drop_last: false,
            even_batches: false,
        }
    }

    #[test]
    fn orders_are_permutations_that_depend_on_seed_and_epoch() {
        let a = epoch_order(1000, 1, 0, true);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_eq!(a, epoch_order(1000, 1, 0, true));
        assert_ne!(a, epoch_order(1000, 1, 1, true));
        assert_ne!(a, epoch_order(1000, 2, 0, true));
        assert_eq!(epoch_order(5, 1, 0, false), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn ranks_partition_the_epoch() {
        let mut all = vec![];
        for rank in 0..3 {
            let p = Plan::new(req(100, 8, rank, 3)).unwrap();
            for b in 0..p.num_batches {
                all.extend_from_slice(p.batch(b));
            }
        }
        all.sort();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn batches_resume_and_drop_last() {
        let p = Plan::new(req(10, 4, 0, 1)).unwrap();
        assert_eq!(p.num_batches, 3);
        assert_eq!(p.batch(2).len(), 2);
        assert_eq!(p.remaining_samples(), 10);
        let dl = Plan::new(PlanRequest {
            drop_last: true,
            start_batch: 1,
            ..req(10, 4, 0, 1)
        })
        .unwrap();
        assert_eq!((dl.num_batches, dl.remaining_samples()), (2, 4));
        assert!(Plan::new(PlanRequest {
            start_batch: 4,
            ..req(10, 4, 0, 1)
        })
        .is_err());
        assert!(Plan::new(req(10, 0, 0, 1)).is_err());
        assert!(Plan::new(req(10, 4, 2, 2)).is_err());
        assert!(Plan::new(req(10, 4, 0, 0)).is_ok(), "world_size 0 means 1");
    }
}

#[cfg(test)]
mod sharding_tests {
    use super::*;

    fn plan(n: u64, bs: u32, rank: u32, ws: u32, worker: u32, nw: u32) -> PlanRequest {
        PlanRequest {
            num_samples: n,
            batch_size: bs,
            seed: 3,
            epoch: 1,
            rank,
            world_size: ws,
            worker,
            num_workers: nw,
            start_sample: 0,
            start_step: 0,
            start_batch: 0,
            shuffle: true,
            drop_last: false,
            even_batches: true,
        }
    }

    /// Every batch of every shard, as (rank, step, samples).
    fn all(req: PlanRequest) -> Vec<(u32, u64, Vec<u64>)> {
        let mut out = vec![];
        for rank in 0..req.world_size.max(1) {
            for worker in 0..req.num_workers.max(1) {
                let p = Plan::new(PlanRequest {
                    rank,
                    worker,
                    ..req
                })
                .unwrap();
                for b in 0..p.num_batches {
                    out.push((rank, p.steps[b as usize], p.batch(b).to_vec()));
                }
            }
        }
        out.sort();
        out
    }

    #[test]
    fn padding_is_marked_so_that_evaluation_counts_every_sample_once() {
        // 101 samples, 2 ranks, batches of 8, with 1 and 3 DataLoader workers.
        for nw in [1, 3] {
            let mut real = vec![];
            let mut batches_per_rank = [0u64; 2];
            for rank in 0..2 {
                for worker in 0..nw {
                    let p = Plan::new(plan(101, 8, rank, 2, worker, nw)).unwrap();
                    batches_per_rank[rank as usize] += p.num_batches;
                    for b in 0..p.num_batches {
                        let batch = p.batch(b);
                        let pad = p.padding(b) as usize;
                        assert!(pad <= batch.len());
                        real.extend_from_slice(&batch[..batch.len() - pad]);
                    }
                }
            }
            assert_eq!(
                batches_per_rank[0], batches_per_rank[1],
                "equal batch counts"
            );
            real.sort_unstable();
            assert_eq!(
                real,
                (0..101).collect::<Vec<_>>(),
                "{nw} workers: each once"
            );
        }
        // No padding without even_batches, nor when the rounds come out even.
        let p = Plan::new(PlanRequest {
            even_batches: false,
            ..plan(101, 8, 1, 2, 0, 1)
        })
        .unwrap();
        assert!((0..p.num_batches).all(|b| p.padding(b) == 0));
        let p = Plan::new(plan(96, 8, 1, 2, 0, 1)).unwrap();
        assert!((0..p.num_batches).all(|b| p.padding(b) == 0));
    }

    #[test]
    fn even_batches_give_every_rank_the_same_steps_padding_like_distributed_sampler() {
        // 103 samples, 4 ranks, batches of 10: 2 full rounds (80), then 23 left: 4 batches of 6,
        // one sample repeated.
        let batches = all(plan(103, 10, 0, 4, 0, 1));
        for r in 0..4 {
            let sizes: Vec<usize> = batches
                .iter()
                .filter(|b| b.0 == r)
                .map(|b| b.2.len())
                .collect();
            assert_eq!(sizes, vec![10, 10, 6], "rank {r}");
        }
        let mut ids: Vec<u64> = batches.iter().flat_map(|b| b.2.clone()).collect();
        ids.sort();
        let mut unique = ids.clone();
        unique.dedup();
        assert_eq!(unique, (0..103).collect::<Vec<_>>(), "every sample");
        assert_eq!(ids.len(), 104, "one padding sample");
        // drop_last drops the short round on every rank alike.
        let dropped = all(PlanRequest {
            drop_last: true,
            ..plan(103, 10, 0, 4, 0, 1)
        });
        assert_eq!(dropped.len(), 8);
        // Without even_batches the rest goes to the first ranks in whole batches.
        let uneven = all(PlanRequest {
            even_batches: false,
            ..plan(103, 10, 0, 4, 0, 1)
        });
        let sizes: Vec<usize> = uneven
            .iter()
            .filter(|b| b.1 == 2)
            .map(|b| b.2.len())
            .collect();
        assert_eq!(sizes, vec![10, 10, 3]);
    }

    #[test]
    fn workers_split_a_ranks_steps_and_the_union_is_the_epoch() {
        let one = all(plan(1000, 16, 0, 2, 0, 1));
        let three = all(plan(1000, 16, 0, 2, 0, 3));
        assert_eq!(
            one, three,
            "the same batches at the same steps, however many workers"
        );
        let p = Plan::new(plan(1000, 16, 1, 2, 2, 3)).unwrap();
        assert!((0..p.num_batches).all(|b| p.steps[b as usize] % 3 == 2));
    }

    #[test]
    fn resuming_on_other_ranks_and_workers_serves_exactly_the_rest() {
        let n = 997;
        // Two ranks with two workers each take 7 steps...
        let before = all(plan(n, 12, 0, 2, 0, 2));
        let seen: Vec<u64> = before
            .iter()
            .filter(|b| b.1 < 7)
            .flat_map(|b| b.2.clone())
            .collect();
        let p = Plan::new(plan(n, 12, 0, 2, 0, 1)).unwrap();
        let resume = p.resume_sample(6);
        assert_eq!(resume, 7 * 2 * 12);
        // ...then the job goes on with three ranks of one worker.
        let after = all(PlanRequest {
            start_sample: resume,
            ..plan(n, 12, 0, 3, 0, 1)
        });
        let mut ids: Vec<u64> = seen
            .iter()
            .copied()
            .chain(after.iter().flat_map(|b| b.2.clone()))
            .collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids, (0..n).collect::<Vec<_>>(), "every sample, none lost");
        let rest: usize = after.iter().map(|b| b.2.len()).sum();
        assert!(
            rest >= n as usize - seen.len() && rest < n as usize - seen.len() + 3,
            "padding only"
        );
        // start_step skips a rank's first steps.
        let p = Plan::new(PlanRequest {
            start_step: 5,
            ..plan(n, 12, 1, 2, 0, 1)
        })
        .unwrap();
        assert_eq!(p.steps[0], 5);
        assert_eq!(p.resume_sample(p.num_batches - 1), n);
        assert!(Plan::new(PlanRequest {
            start_sample: n + 1,
            ..plan(n, 12, 0, 1, 0, 1)
        })
        .is_err());
        assert!(
            Plan::new(plan(n, 12, 0, 1, 1, 1)).is_err(),
            "worker out of range"
        );
    }
}
