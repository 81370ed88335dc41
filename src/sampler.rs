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

/// What one stream serves.
#[derive(Debug, Clone)]
pub struct Plan {
    /// This rank's samples for the epoch, in order.
    pub samples: Vec<u64>,
    pub batch_size: usize,
    pub num_batches: u64,
    pub start_batch: u64,
}

#[derive(Debug, Clone, Copy)]
pub struct PlanRequest {
    pub num_samples: u64,
    pub batch_size: u32,
    pub seed: u64,
    pub epoch: u64,
    pub rank: u32,
    pub world_size: u32,
    pub start_batch: u64,
    pub shuffle: bool,
    pub drop_last: bool,
}

impl Plan {
    /// Rank r of w gets positions r, r+w, r+2w, ... of the epoch's order, so the ranks together
    /// cover every sample exactly once (shards differ in size by at most one sample).
    pub fn new(req: PlanRequest) -> Result<Plan> {
        let world_size = req.world_size.max(1);
        if req.batch_size == 0 {
            bail!("batch_size must be at least 1");
        }
        if req.rank >= world_size {
            bail!(
                "rank {} is out of range for world_size {world_size} (ranks are 0..{world_size})",
                req.rank
            );
        }
        let order = epoch_order(req.num_samples, req.seed, req.epoch, req.shuffle);
        let samples: Vec<u64> = order
            .into_iter()
            .skip(req.rank as usize)
            .step_by(world_size as usize)
            .collect();
        let batch_size = req.batch_size as usize;
        let len = samples.len() as u64;
        let bs = batch_size as u64;
        let num_batches = if req.drop_last {
            len / bs
        } else {
            len.div_ceil(bs)
        };
        if req.start_batch > num_batches {
            bail!(
                "start_batch {} is past the end of the epoch ({num_batches} batches for this rank)",
                req.start_batch
            );
        }
        Ok(Plan {
            samples,
            batch_size,
            num_batches,
            start_batch: req.start_batch,
        })
    }

    /// Sample indices of batch `b`.
    pub fn batch(&self, b: u64) -> &[u64] {
        let start = b as usize * self.batch_size;
        let end = (start + self.batch_size).min(self.samples.len());
        &self.samples[start..end]
    }

    /// Samples this stream will serve, from start_batch on.
    pub fn remaining_samples(&self) -> u64 {
        (self.start_batch..self.num_batches)
            .map(|b| self.batch(b).len() as u64)
            .sum()
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
            start_batch: 0,
            shuffle: true,
            drop_last: false,
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
