//! Which samples a stream serves, in which order: a seeded permutation of the epoch,
//! sharded across DDP ranks, cut into batches, resumable from any batch.

use crate::permutation::Permutation;
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
        let mut rng = SplitMix64(epoch_key(seed, epoch));
        rng.next();
        for i in (1..order.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// A job spread over `nodes` nodes, a daemon each: the part of each epoch node `node`'s ranks
/// read, so each node's cache keeps serving the same part. The dataset's granules (aligned runs
/// of `granule` samples, which its source reads together) are dealt once per run, by the seed
/// alone, to `partitions` canonical partitions; node m reads the partitions c with
/// c % nodes == m, interleaved in turn, each shuffled within itself every epoch by (seed,
/// epoch, c). A partition's sequence for an epoch is the same whatever the number of nodes, as
/// long as `partitions` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NodeSplit {
    pub nodes: u32,
    pub node: u32,
    pub partitions: u32,
    pub granule: u64,
    /// Thousandths of the granules that change partition each epoch (Q): a seeded choice
    /// by (seed, epoch), each taking the place of the next one chosen, so every partition
    /// keeps its size. 0: each partition keeps its granules for the run.
    pub swap_per_mille: u32,
    /// An epoch begun on another number of nodes: (those nodes, the samples of its part each
    /// had consumed). Each partition's consumed samples follow from that alone (a node reads
    /// its partitions in turn), so this node reads what is left of its partitions, and
    /// positions (`start_sample`) count from there. None: the epoch from its start.
    pub resumed: Option<(u32, u64)>,
}

/// Partitions when a request names none: a multiple of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48,
/// 64 and 96 nodes.
pub const DEFAULT_PARTITIONS: u32 = 192;

/// The most partitions a request may ask for (each is a list the daemon makes).
pub const MAX_PARTITIONS: u32 = 65_536;

impl NodeSplit {
    fn check(&self) -> Result<()> {
        if self.nodes == 0 || self.node >= self.nodes {
            bail!(
                "node {} is out of range for nodes {} (nodes are 0..{})",
                self.node,
                self.nodes,
                self.nodes
            );
        }
        if self.partitions > MAX_PARTITIONS {
            bail!(
                "partitions ({}) may be at most {MAX_PARTITIONS}",
                self.partitions
            );
        }
        if self.partitions == 0 || !self.partitions.is_multiple_of(self.nodes) {
            bail!(
                "partitions ({}) must be a multiple of nodes ({})",
                self.partitions,
                self.nodes
            );
        }
        if let Some((before, _)) = self.resumed {
            if before == 0 || !self.partitions.is_multiple_of(before) {
                bail!(
                    "the epoch was begun on {before} nodes: partitions ({}) must be a multiple of that too",
                    self.partitions
                );
            }
        }
        Ok(())
    }
}

/// The granules of an `n`-sample dataset each partition holds in `epoch`, in the order they
/// were dealt: a permutation of the granules by the seed alone (in order when not shuffled),
/// dealt in turn; then, with `swap_per_mille`, that share of them chosen by (seed, epoch), each
/// moved into the place of the next one chosen.
fn dealt(n: u64, seed: u64, epoch: u64, shuffle: bool, split: &NodeSplit) -> Vec<Vec<u64>> {
    let granules = n.div_ceil(split.granule.max(1));
    let order = epoch_order(granules, seed ^ 0xA076_1D64_78BD_642F, 0, shuffle);
    let parts_n = split.partitions as usize;
    let mut parts = vec![vec![]; parts_n];
    for (k, &g) in order.iter().enumerate() {
        parts[k % parts_n].push(g);
    }
    let swapped = granules * split.swap_per_mille.min(1000) as u64 / 1000;
    if swapped > 1 && shuffle {
        // Where each granule was dealt: (partition, index), from the deal's own arithmetic.
        let mut place = vec![(0usize, 0usize); granules as usize];
        for (k, &g) in order.iter().enumerate() {
            place[g as usize] = (k % parts_n, k / parts_n);
        }
        let chosen = epoch_order(granules, seed ^ 0x5A5A_C3C3_9696_0F0F, epoch, true);
        let chosen = &chosen[..swapped as usize];
        for (i, &g) in chosen.iter().enumerate() {
            let (p, at) = place[chosen[(i + 1) % chosen.len()] as usize];
            parts[p][at] = g;
        }
    }
    parts
}

/// Partition `c`'s samples for the epoch, in its order.
fn partition_sequence(
    n: u64,
    granules: &[u64],
    seed: u64,
    epoch: u64,
    shuffle: bool,
    c: u32,
    granule: u64,
) -> Vec<u64> {
    let g = granule.max(1);
    let samples: Vec<u64> = granules
        .iter()
        .flat_map(|&k| k * g..((k + 1) * g).min(n))
        .collect();
    let mix = (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    epoch_order(samples.len() as u64, seed ^ mix, epoch, shuffle)
        .into_iter()
        .map(|i| samples[i as usize])
        .collect()
}

/// Node `split.node`'s order for the epoch (its partitions' sequences interleaved in turn),
/// and the length every node's order is padded to (the longest node's), so that every rank
/// takes the same number of steps.
pub fn node_order(
    n: u64,
    seed: u64,
    epoch: u64,
    shuffle: bool,
    split: &NodeSplit,
) -> (Vec<u64>, u64) {
    let parts = dealt(n, seed, epoch, shuffle, split);
    let g = split.granule.max(1);
    let sizes: Vec<u64> = parts
        .iter()
        .map(|granules| granules.iter().map(|&k| ((k + 1) * g).min(n) - k * g).sum())
        .collect();
    let of_node = |m: u32, nodes: u32| (m..split.partitions).step_by(nodes as usize);
    // Samples of each partition consumed before (an epoch resumed on other nodes): a node's
    // first `used` samples, its partitions taken in turn as below.
    let mut consumed = vec![0; parts.len()];
    if let Some((before, used)) = split.resumed {
        for m in 0..before {
            let theirs: Vec<u32> = of_node(m, before).collect();
            let lens: Vec<u64> = theirs.iter().map(|&c| sizes[c as usize]).collect();
            for (&c, taken) in theirs.iter().zip(taken_in_turn(&lens, used)) {
                consumed[c as usize] = taken;
            }
        }
    }
    let longest = (0..split.nodes)
        .map(|m| {
            of_node(m, split.nodes)
                .map(|c| sizes[c as usize] - consumed[c as usize])
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    let mine: Vec<Vec<u64>> = of_node(split.node, split.nodes)
        .map(|c| {
            let mut seq = partition_sequence(n, &parts[c as usize], seed, epoch, shuffle, c, g);
            seq.drain(..consumed[c as usize] as usize);
            seq
        })
        .collect();
    let most = mine.iter().map(Vec::len).max().unwrap_or(0);
    let mut order = Vec::with_capacity(mine.iter().map(Vec::len).sum());
    for i in 0..most {
        order.extend(mine.iter().filter_map(|p| p.get(i)));
    }
    (order, longest)
}

/// The granules of node `split.node`'s part of the epoch, in order: its partitions' granules,
/// without ordering their samples (`node_order` without the resume).
pub fn node_granules(n: u64, seed: u64, epoch: u64, shuffle: bool, split: &NodeSplit) -> Vec<u64> {
    let parts = dealt(n, seed, epoch, shuffle, split);
    let mut granules: Vec<u64> = (split.node..split.partitions)
        .step_by(split.nodes as usize)
        .flat_map(|c| parts[c as usize].iter().copied())
        .collect();
    granules.sort_unstable();
    granules
}

/// How many of each list's items the first `used` items of the lists taken in turn hold (one
/// from each list that has one left, round after round), for lists of `lens` items.
fn taken_in_turn(lens: &[u64], used: u64) -> Vec<u64> {
    let mut taken = vec![0; lens.len()];
    let mut left = used;
    let mut sorted: Vec<u64> = lens.to_vec();
    sorted.sort_unstable();
    // Whole rounds first, in steps up to the next list's end.
    let mut round = 0;
    for (k, &end) in sorted.iter().enumerate() {
        let active = (lens.len() - k) as u64;
        let rounds = (end - round).min(left / active);
        round += rounds;
        left -= rounds * active;
        if round < end {
            break;
        }
    }
    for (t, &len) in taken.iter_mut().zip(lens) {
        *t = round.min(len);
    }
    // Then the part of the next round: the first lists with an item left, in order.
    for (t, &len) in taken.iter_mut().zip(lens) {
        if left == 0 {
            break;
        }
        if len > round {
            *t += 1;
            left -= 1;
        }
    }
    taken
}

/// The form of an epoch's order, named in requests and in a client's resume state: every
/// seed's order differs between forms, so a checkpoint resumes on the form it was taken on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OrderForm {
    /// A Fisher-Yates shuffle by SplitMix64 (`epoch_order`), listed in full to be read: 8 bytes
    /// a sample while a plan is built. Requests that name no form (clients before forms).
    #[default]
    V1,
    /// A Feistel bijection keyed by (seed, epoch) (`permutation::Permutation`): any position's
    /// sample, and any sample's position, computed when asked, so a stream's plan and the
    /// memory tier's view of its future hold a few bytes whatever the dataset's size. A job
    /// over several nodes reads the same node order as under V1 (listed).
    V2,
}

impl OrderForm {
    /// The form a request's `order_version` names: 0 (not named) and 1 are V1.
    pub fn from_version(v: u32) -> Result<OrderForm> {
        match v {
            0 | 1 => Ok(OrderForm::V1),
            2 => Ok(OrderForm::V2),
            _ => bail!(
                "order_version {v} is unknown to this daemon: it serves orders 1 and 2 (a newer client asked; ask for 2, or upgrade the daemon)"
            ),
        }
    }

    pub fn version(self) -> u32 {
        match self {
            OrderForm::V1 => 1,
            OrderForm::V2 => 2,
        }
    }

    /// Whether the whole epoch's order of `req` (no node split) is computed, not listed.
    pub fn computed(self, split: Option<&NodeSplit>, shuffle: bool) -> bool {
        self == OrderForm::V2 && split.is_none() && shuffle
    }

    /// The form an order is made in: V1 where both forms give the same order (a node's part,
    /// an unshuffled epoch), so streams asking in either share one.
    pub fn effective(self, split: Option<&NodeSplit>, shuffle: bool) -> OrderForm {
        match self.computed(split, shuffle) {
            true => OrderForm::V2,
            false => OrderForm::V1,
        }
    }
}

/// The key of an epoch's order, in either form: a pure function of (seed, epoch).
pub fn epoch_key(seed: u64, epoch: u64) -> u64 {
    seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03)
}

/// Correlated orders (opt-in, form 2): the jobs of a cohort read one base permutation (by
/// `cohort_seed`), each reshuffled inside windows of `window` positions by the job's own seed.
/// Each job's order is as uniform as the base and a pure function of (cohort seed, seed,
/// epoch); jobs of a cohort read the same samples in each window, so one read serves them all
/// within it. Not independent of the other jobs' orders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Correlated {
    pub cohort_seed: u64,
    pub window: u64,
}

/// An epoch's computed order (form 2, no node split): the seeded permutation, or a cohort's
/// base permutation reshuffled within windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochOrder {
    base: Permutation,
    /// (the job's key, the window) for correlated orders.
    windows: Option<(u64, u64)>,
}

impl EpochOrder {
    pub fn new(n: u64, seed: u64, epoch: u64, correlated: Option<Correlated>) -> EpochOrder {
        match correlated {
            None => EpochOrder {
                base: Permutation::new(n, epoch_key(seed, epoch)),
                windows: None,
            },
            Some(c) => EpochOrder {
                base: Permutation::new(n, epoch_key(c.cohort_seed, epoch)),
                windows: Some((epoch_key(seed, epoch), c.window.max(1))),
            },
        }
    }

    /// Window `w`'s own permutation (of its positions, the last window shorter).
    fn window(&self, key: u64, size: u64, w: u64) -> (u64, Permutation) {
        let start = w * size;
        let len = size.min(self.base.len() - start);
        let mixed = key ^ (w + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (start, Permutation::new(len, mixed))
    }

    /// The sample at position `p` (p < n).
    pub fn at(&self, p: u64) -> u64 {
        match self.windows {
            None => self.base.at(p),
            Some((key, size)) => {
                let (start, perm) = self.window(key, size, p / size);
                self.base.at(start + perm.at(p - start))
            }
        }
    }

    /// Where sample `s` comes (s < n): `at`'s inverse.
    pub fn position(&self, s: u64) -> u64 {
        let q = self.base.position(s);
        match self.windows {
            None => q,
            Some((key, size)) => {
                let (start, perm) = self.window(key, size, q / size);
                start + perm.position(q - start)
            }
        }
    }
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
///
/// A shard's batches are computed from their index: its full batches are the steps
/// `start_step + worker + k * workers` below the last round, then the last round's batch if it
/// has one. What a plan holds is the epoch's order: computed (V2 without a node split: a few
/// bytes) or this shard's samples listed batch after batch (8 bytes a sample).
#[derive(Debug, Clone)]
pub struct Plan {
    order: Positions,
    /// Samples of the order (`real`) and the length it is padded to (`num_samples`: the longest
    /// node's part, or `real`).
    real: u64,
    num_samples: u64,
    start_sample: u64,
    start_step: u64,
    workers: u64,
    worker: u64,
    batch: u64,
    /// The rank's first position in each round (`rank * batch`), and samples per round.
    offset: u64,
    round: u64,
    /// The shard's full batches, and its last round's batch (position, length), if it has one.
    full: u64,
    last: Option<(u64, u64)>,
    pub num_batches: u64,
    pub start_batch: u64,
    /// The dataset's samples, and the node's part of them it reads (None: all).
    pub dataset_samples: u64,
    pub split: Option<NodeSplit>,
    pub order_form: OrderForm,
    pub correlated: Option<Correlated>,
}

/// Where a plan's samples come from.
#[derive(Debug, Clone)]
enum Positions {
    /// Not shuffled: position p is sample p.
    Identity,
    /// The epoch's order, computed.
    Computed(EpochOrder),
    /// This shard's samples, batch after batch (full batches of `batch` samples, then the last).
    Listed(Vec<u64>),
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
    /// A job over several nodes: the node's part of the epoch (`NodeSplit`), which its ranks
    /// share out as the ranks of a job on one node would (the ranks numbered node by node, as
    /// torchrun numbers them); `start_sample` is then a position in the node's part. None:
    /// the whole epoch's order.
    pub split: Option<NodeSplit>,
    pub order: OrderForm,
    /// Correlated orders (form 2 only): the cohort's base order, reshuffled within windows.
    pub correlated: Option<Correlated>,
}

impl PlanRequest {
    /// One rank's shuffled epoch `epoch` of `num_samples` samples by `seed`, from its start, in
    /// batches of `batch_size`, in order form 1 on one node; other requests by struct update.
    pub fn epoch(num_samples: u64, batch_size: u32, seed: u64, epoch: u64) -> PlanRequest {
        PlanRequest {
            num_samples,
            batch_size,
            seed,
            epoch,
            rank: 0,
            world_size: 1,
            worker: 0,
            num_workers: 1,
            start_sample: 0,
            start_step: 0,
            start_batch: 0,
            shuffle: true,
            drop_last: false,
            even_batches: false,
            split: None,
            order: OrderForm::V1,
            correlated: None,
        }
    }
}

impl Plan {
    /// About the bytes a plan for `req` holds, known before it is built (at least what it
    /// will hold): its shard's samples when they are listed.
    pub fn bytes_for(req: &PlanRequest) -> u64 {
        let fixed = std::mem::size_of::<Plan>() as u64;
        if !Plan::listed(req) {
            return fixed;
        }
        let shards = req.world_size.max(1) as u64 * req.num_workers.max(1) as u64;
        let nodes = req.split.map_or(1, |s| s.nodes.max(1) as u64);
        let batch = req.batch_size.max(1) as u64;
        let samples = (req.num_samples / nodes).div_ceil(shards) + batch;
        fixed + samples.saturating_mul(8)
    }

    /// Whether a plan for `req` lists its samples: a node's part, or a shuffled epoch in form 1.
    pub fn listed(req: &PlanRequest) -> bool {
        req.split.is_some() || (req.shuffle && req.order == OrderForm::V1)
    }

    /// Bytes building a plan for `req` takes while it is built: the whole order listed (twice
    /// for a node's part), nothing when it is computed.
    pub fn building_bytes(req: &PlanRequest) -> u64 {
        if !Plan::listed(req) {
            return 0;
        }
        req.num_samples
            .saturating_mul(if req.split.is_some() { 16 } else { 8 })
    }

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
        if let Some(c) = req.correlated {
            if !req.order.computed(req.split.as_ref(), req.shuffle) {
                bail!("correlated orders (window {}) are of order form 2, shuffled, on one node: ask for order_version 2 without nodes", c.window);
            }
            if c.window == 0 {
                bail!("a correlated order's window must be at least 1 sample");
            }
        }
        // The order the ranks share out: the epoch's, or the node's part of it (the samples
        // it holds, `real`, padded to the longest node's part, `n`); the ranks of the node.
        let (order, pad, real, n, world, rank) = match &req.split {
            None => {
                let n = req.num_samples;
                let order = if !req.shuffle {
                    Positions::Identity
                } else if req.order == OrderForm::V2 {
                    Positions::Computed(EpochOrder::new(n, req.seed, req.epoch, req.correlated))
                } else {
                    Positions::Listed(epoch_order(n, req.seed, req.epoch, true))
                };
                (order, vec![], n, n, world, req.rank as u64)
            }
            Some(split) => {
                split.check()?;
                let nodes = split.nodes as u64;
                if !world.is_multiple_of(nodes) {
                    bail!("world_size {world} is not a multiple of nodes {nodes}");
                }
                let local = world / nodes;
                if req.rank as u64 / local != split.node as u64 {
                    bail!(
                        "rank {} is on node {} of {nodes} with {local} ranks a node (ranks numbered node by node), not node {}",
                        req.rank,
                        req.rank as u64 / local,
                        split.node
                    );
                }
                let (order, n) =
                    node_order(req.num_samples, req.seed, req.epoch, req.shuffle, split);
                let real = order.len() as u64;
                // A node of an epoch resumed here whose part was wholly consumed before takes
                // the same steps as the others, all of them padding from its part.
                let pad = match split.resumed {
                    Some(_) if real == 0 && n > 0 => {
                        let whole = NodeSplit {
                            resumed: None,
                            ..*split
                        };
                        node_order(req.num_samples, req.seed, req.epoch, req.shuffle, &whole).0
                    }
                    _ => vec![],
                };
                if real == 0 && n > 0 && pad.is_empty() {
                    bail!(
                        "node {} of {nodes} holds none of the dataset's {} granules of {} samples: too few granules for every node to hold some (use fewer nodes, or a dataset of smaller granules, such as smaller HDF5 chunks)",
                        split.node,
                        req.num_samples.div_ceil(split.granule.max(1)),
                        split.granule
                    );
                }
                (
                    Positions::Listed(order),
                    pad,
                    real,
                    n,
                    local,
                    req.rank as u64 % local,
                )
            }
        };
        if req.start_sample > n {
            bail!(
                "start_sample {} is past the end of the epoch ({n} samples)",
                req.start_sample
            );
        }
        let b = req.batch_size as u64;
        let worker = req.worker as u64;
        let round = world * b;
        let rest = n - req.start_sample;
        let full_rounds = rest / round;
        let tail = rest % round;
        let first = req.start_step + worker;
        let full = match full_rounds > first {
            true => (full_rounds - first).div_ceil(workers),
            false => 0,
        };
        let from_last = req.start_sample + full_rounds * round;
        let mine =
            |step: u64| step >= req.start_step && (step - req.start_step) % workers == worker;
        let last = match tail > 0 && mine(full_rounds) {
            false => None,
            true if req.even_batches => {
                let m = tail.div_ceil(world);
                (!(req.drop_last && m < b)).then_some((from_last + rank * m, m))
            }
            true => {
                let from = rank * b;
                let len = tail.saturating_sub(from).min(b);
                (!(req.drop_last && len < b)).then_some((from_last + from, len))
            }
        }
        .filter(|&(_, len)| len > 0);
        let num_batches = full + last.is_some() as u64;
        if req.start_batch > num_batches {
            bail!(
                "start_batch {} is past the end of the epoch ({num_batches} batches for this shard)",
                req.start_batch
            );
        }
        let mut plan = Plan {
            order: Positions::Identity,
            real,
            num_samples: n,
            start_sample: req.start_sample,
            start_step: req.start_step,
            workers,
            worker,
            batch: b,
            offset: rank * b,
            round,
            full,
            last,
            num_batches,
            start_batch: req.start_batch,
            dataset_samples: req.num_samples,
            split: req.split,
            order_form: req.order,
            correlated: req.correlated,
        };
        plan.order = match order {
            Positions::Listed(listed) => {
                // Position p of the order, wrapping to its start for padding (to `pad`'s
                // when the order is empty).
                let at = |p: u64| match real {
                    0 => pad[(p % pad.len() as u64) as usize],
                    _ => listed[(p % real) as usize],
                };
                let mut samples = Vec::with_capacity((full * b + b) as usize);
                for k in 0..num_batches {
                    let (from, len) = plan.span(k);
                    samples.extend((from..from + len).map(at));
                }
                Positions::Listed(samples)
            }
            computed => computed,
        };
        Ok(plan)
    }

    /// Batch `b`'s positions in the order: (first, count).
    fn span(&self, b: u64) -> (u64, u64) {
        debug_assert!(b < self.num_batches, "batch {b} of {}", self.num_batches);
        match b < self.full {
            true => (
                self.start_sample + self.step(b) * self.round + self.offset,
                self.batch,
            ),
            false => self.last.expect("a batch of the plan"),
        }
    }

    /// The rank's loader step of batch `b`.
    pub fn step(&self, b: u64) -> u64 {
        match b < self.full {
            true => self.start_step + self.worker + b * self.workers,
            false => (self.num_samples - self.start_sample) / self.round,
        }
    }

    /// How many samples at the end of batch `b` are padding.
    pub fn padding(&self, b: u64) -> u32 {
        let (from, len) = self.span(b);
        (from + len).saturating_sub(self.real.max(from)) as u32
    }

    /// Sample indices of batch `b`.
    pub fn batch(&self, b: u64) -> std::borrow::Cow<'_, [u64]> {
        let (from, len) = self.span(b);
        // Positions past the order's end are padding from its start.
        let wrap = |p: u64| {
            if p < self.real {
                p
            } else {
                p % self.real.max(1)
            }
        };
        match &self.order {
            Positions::Listed(samples) => {
                let at = (b * self.batch) as usize;
                std::borrow::Cow::Borrowed(&samples[at..at + len as usize])
            }
            Positions::Identity => (from..from + len).map(wrap).collect(),
            Positions::Computed(perm) => (from..from + len).map(|p| perm.at(wrap(p))).collect(),
        }
    }

    /// `num_samples` samples in order, in batches of `batch_size`, from batch `start_batch`
    /// (for tests of what reads plans).
    #[cfg(test)]
    pub fn sequential(num_samples: u64, batch_size: u32, start_batch: u64) -> Plan {
        Plan::new(PlanRequest {
            start_batch,
            shuffle: false,
            order: OrderForm::V2,
            ..PlanRequest::epoch(num_samples, batch_size, 0, 0)
        })
        .expect("a valid plan")
    }

    /// Samples this stream will serve, from start_batch on.
    pub fn remaining_samples(&self) -> u64 {
        let full = self.full.saturating_sub(self.start_batch) * self.batch;
        let last = match (self.last, self.start_batch <= self.full) {
            (Some((_, len)), true) => len,
            _ => 0,
        };
        full + last
    }

    /// Samples in the epoch's order.
    pub fn num_samples(&self) -> u64 {
        self.num_samples
    }

    /// Where the stream starts in the epoch's order: the positions before it, in its share, it
    /// will not read this epoch.
    pub fn start_position(&self) -> u64 {
        match self.start_batch < self.num_batches {
            true => {
                (self.start_sample + self.step(self.start_batch) * self.round).min(self.num_samples)
            }
            false => self.num_samples,
        }
    }

    /// Where the job stands in the epoch's order once every rank has taken the step of batch
    /// `b`: the `start_sample` that resumes right after it.
    pub fn resume_sample(&self, b: u64) -> u64 {
        (self.start_sample + (self.step(b) + 1) * self.round).min(self.num_samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(n: u64, bs: u32, rank: u32, ws: u32) -> PlanRequest {
        PlanRequest {
            rank,
            world_size: ws,
            ..PlanRequest::epoch(n, bs, 7, 0)
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
                all.extend_from_slice(&p.batch(b));
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
            rank,
            world_size: ws,
            worker,
            num_workers: nw,
            even_batches: true,
            ..PlanRequest::epoch(n, bs, 3, 1)
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
                    out.push((rank, p.step(b), p.batch(b).to_vec()));
                }
            }
        }
        out.sort();
        out
    }

    /// A V2 plan is a V1 plan's positions read through the computed order: the same batches
    /// at the same steps, padding and resume positions, on every shape tried (ranks, workers,
    /// resumes, padding, drop_last), and so the same exactness.
    #[test]
    fn computed_orders_shard_and_resume_as_listed_ones_do() {
        let n = 103;
        let v1 = epoch_order(n, 3, 1, true);
        let mut position_v1 = vec![0; n as usize];
        for (p, &s) in v1.iter().enumerate() {
            position_v1[s as usize] = p as u64;
        }
        let perm = crate::permutation::Permutation::new(n, epoch_key(3, 1));
        let mut tried = 0;
        for (ws, nw, bs) in [(1, 1, 8), (2, 3, 8), (3, 2, 5), (4, 1, 1), (2, 2, 200)] {
            for (start_sample, start_step) in [(0, 0), (16, 0), (30, 2), (103, 0)] {
                for (even_batches, drop_last) in
                    [(true, false), (true, true), (false, false), (false, true)]
                {
                    for rank in 0..ws {
                        for worker in 0..nw {
                            let req = PlanRequest {
                                start_sample,
                                start_step,
                                even_batches,
                                drop_last,
                                ..plan(n, bs, rank, ws, worker, nw)
                            };
                            let (Ok(a), Ok(b)) = (
                                Plan::new(req),
                                Plan::new(PlanRequest {
                                    order: OrderForm::V2,
                                    ..req
                                }),
                            ) else {
                                continue;
                            };
                            tried += 1;
                            assert_eq!(a.num_batches, b.num_batches);
                            assert_eq!(a.remaining_samples(), b.remaining_samples());
                            assert_eq!(a.start_position(), b.start_position());
                            for k in 0..a.num_batches {
                                assert_eq!(
                                    (a.step(k), a.padding(k), a.resume_sample(k)),
                                    (b.step(k), b.padding(k), b.resume_sample(k))
                                );
                                let through: Vec<u64> = a
                                    .batch(k)
                                    .iter()
                                    .map(|&s| perm.at(position_v1[s as usize]))
                                    .collect();
                                assert_eq!(through, b.batch(k).to_vec());
                            }
                        }
                    }
                }
            }
        }
        assert!(tried > 300, "{tried} plans compared");
    }

    /// Correlated orders: each job's a permutation with its inverse; the cohort's jobs read the
    /// same samples in every window (the base's), in orders that differ at nearly every
    /// position; a plan serves the order's positions as an unshuffled plan of the same shape
    /// serves its own.
    #[test]
    fn correlated_orders_share_each_window_and_shard_as_plans_do() {
        let (n, window) = (10_000u64, 200u64);
        let c = Correlated {
            cohort_seed: 7,
            window,
        };
        let jobs: Vec<EpochOrder> = [1, 2]
            .iter()
            .map(|&s| EpochOrder::new(n, s, 3, Some(c)))
            .collect();
        let base = EpochOrder::new(n, 7, 3, None);
        for order in &jobs {
            let mut seen = vec![false; n as usize];
            for p in 0..n {
                let s = order.at(p);
                assert!(!seen[s as usize], "{s} twice");
                seen[s as usize] = true;
                assert_eq!(order.position(s), p);
                // In the window the base has it in.
                assert_eq!(base.position(s) / window, p / window);
            }
        }
        let differ = (0..n).filter(|&p| jobs[0].at(p) != jobs[1].at(p)).count();
        assert!(
            differ as f64 >= 0.95 * n as f64,
            "{differ} of {n} positions differ"
        );
        // Plans: positions of an unshuffled plan of the same shape, read through the order.
        for (ws, nw, bs, start_sample) in [(2, 2, 8, 0), (3, 1, 5, 40), (1, 3, 64, 999)] {
            for rank in 0..ws {
                for worker in 0..nw {
                    let shape = PlanRequest {
                        start_sample,
                        order: OrderForm::V2,
                        ..plan(n, bs, rank, ws, worker, nw)
                    };
                    let plain = Plan::new(PlanRequest {
                        shuffle: false,
                        ..shape
                    })
                    .unwrap();
                    let p = Plan::new(PlanRequest {
                        seed: 1,
                        epoch: 3,
                        correlated: Some(c),
                        ..shape
                    })
                    .unwrap();
                    assert_eq!(p.num_batches, plain.num_batches);
                    for b in 0..p.num_batches {
                        let through: Vec<u64> =
                            plain.batch(b).iter().map(|&q| jobs[0].at(q)).collect();
                        assert_eq!(p.batch(b).to_vec(), through);
                    }
                }
            }
        }
        // Refused where it is not computed, or without a window.
        for bad in [
            PlanRequest {
                correlated: Some(c),
                ..plan(100, 8, 0, 1, 0, 1)
            },
            PlanRequest {
                correlated: Some(Correlated {
                    cohort_seed: 7,
                    window: 0,
                }),
                order: OrderForm::V2,
                ..plan(100, 8, 0, 1, 0, 1)
            },
        ] {
            assert!(Plan::new(bad).is_err());
        }
    }

    #[test]
    fn computed_plans_hold_a_few_bytes_at_any_size() {
        let req = PlanRequest {
            order: OrderForm::V2,
            ..plan(10_000_000_000, 1, 0, 1, 0, 1)
        };
        assert!(Plan::bytes_for(&req) < 512 && Plan::building_bytes(&req) == 0);
        let p = Plan::new(req).unwrap();
        assert_eq!(p.num_batches, 10_000_000_000);
        let mut seen: Vec<u64> = (0..1000).flat_map(|b| p.batch(b).to_vec()).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 1000);
        assert_eq!(p.resume_sample(9_999_999_999), 10_000_000_000);
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
            split: None,
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
            split: None,
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
        assert!((0..p.num_batches).all(|b| p.step(b) % 3 == 2));
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
        assert_eq!(p.step(0), 5);
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

    /// Every rank's plan of a job on `nodes` nodes of `local` ranks each: (rank, its samples
    /// less padding, its steps).
    fn on_nodes(
        n: u64,
        nodes: u32,
        local: u32,
        partitions: u32,
        epoch: u64,
        swap: u32,
    ) -> Vec<(u32, Vec<u64>, u64)> {
        let world = nodes * local;
        (0..world)
            .map(|rank| {
                let p = Plan::new(PlanRequest {
                    rank,
                    epoch,
                    split: Some(NodeSplit {
                        nodes,
                        node: rank / local,
                        partitions,
                        granule: 7,
                        swap_per_mille: swap,
                        resumed: None,
                    }),
                    ..plan(n, 16, rank, world, 0, 1)
                })
                .unwrap();
                let mut mine = vec![];
                for b in 0..p.num_batches {
                    let batch = p.batch(b);
                    mine.extend(&batch[..batch.len() - p.padding(b) as usize]);
                }
                (rank, mine, p.num_batches)
            })
            .collect()
    }

    /// The samples (less padding) every rank of `nodes` nodes of 2 ranks serves, taking steps
    /// `steps` (all: None) of the epoch from `start_sample`, resumed from `resumed`; and the
    /// `start_sample` that resumes after them (every rank's last batch's `resume_sample`).
    fn part_of_epoch(
        n: u64,
        (granule, partitions): (u64, u32),
        nodes: u32,
        start_sample: u64,
        resumed: Option<(u32, u64)>,
        steps: Option<u64>,
    ) -> (Vec<u64>, u64) {
        let (local, mut seen, mut next) = (2, vec![], None);
        for rank in 0..nodes * local {
            let p = Plan::new(PlanRequest {
                rank,
                start_sample,
                split: Some(NodeSplit {
                    nodes,
                    node: rank / local,
                    partitions,
                    granule,
                    swap_per_mille: 100,
                    resumed,
                }),
                ..plan(n, 16, rank, nodes * local, 0, 1)
            })
            .unwrap();
            let upto = steps.map_or(p.num_batches, |t| t.min(p.num_batches));
            for b in 0..upto {
                let batch = p.batch(b);
                seen.extend(&batch[..batch.len() - p.padding(b) as usize]);
            }
            if upto > 0 {
                let at = p.resume_sample(upto - 1);
                assert!(
                    next.is_none_or(|x| x == at),
                    "ranks agree on where to resume"
                );
                next = Some(at);
            }
        }
        (seen, next.unwrap_or(start_sample))
    }

    #[test]
    fn an_epoch_begun_on_some_nodes_ends_on_others_every_sample_once() {
        let n = 1003;
        // Small granules (parts nearly equal), and large ones (parts a granule apart, so a
        // checkpoint late in the epoch finds some old nodes done and others not, and some new
        // nodes with nothing left).
        for (shape, steps_tried) in [((7u64, 24u32), 0..10), ((100, 12), 0..20)] {
            for (before, after) in [(4, 2), (2, 4), (4, 1), (1, 3), (3, 4), (2, 2), (6, 4)] {
                if !shape.1.is_multiple_of(before) || !shape.1.is_multiple_of(after) {
                    continue;
                }
                for steps in steps_tried.clone() {
                    let (mut seen, used) = part_of_epoch(n, shape, before, 0, None, Some(steps));
                    // Resumed on `after` nodes: two steps, then (another restart on the same
                    // nodes, from the position they reached) the rest of the epoch.
                    let resumed = Some((before, used));
                    let (more, at) = part_of_epoch(n, shape, after, 0, resumed, Some(2));
                    seen.extend(more);
                    let (rest, _) = part_of_epoch(n, shape, after, at, resumed, None);
                    seen.extend(rest);
                    seen.sort();
                    assert_eq!(
                        seen,
                        (0..n).collect::<Vec<_>>(),
                        "granules {shape:?}: {steps} steps on {before} nodes, the rest on {after}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_nodes_granules_are_those_its_order_reads() {
        let n = 1003;
        for nodes in [1, 2, 4] {
            for node in 0..nodes {
                let split = NodeSplit {
                    nodes,
                    node,
                    partitions: 8,
                    granule: 7,
                    swap_per_mille: 250,
                    resumed: None,
                };
                let (order, _) = node_order(n, 3, 2, true, &split);
                let mut from_order: Vec<u64> = order.iter().map(|&i| i / 7).collect();
                from_order.sort_unstable();
                from_order.dedup();
                assert_eq!(
                    node_granules(n, 3, 2, true, &split),
                    from_order,
                    "node {node} of {nodes}"
                );
            }
        }
    }

    #[test]
    fn taking_lists_in_turn_counts_each_lists_share() {
        assert_eq!(taken_in_turn(&[3, 1, 2], 0), vec![0, 0, 0]);
        assert_eq!(taken_in_turn(&[3, 1, 2], 2), vec![1, 1, 0]);
        assert_eq!(taken_in_turn(&[3, 1, 2], 4), vec![2, 1, 1]);
        assert_eq!(taken_in_turn(&[3, 1, 2], 5), vec![2, 1, 2]);
        assert_eq!(taken_in_turn(&[3, 1, 2], 6), vec![3, 1, 2]);
        assert_eq!(
            taken_in_turn(&[3, 1, 2], 60),
            vec![3, 1, 2],
            "padding past the end"
        );
        assert_eq!(taken_in_turn(&[2, 2, 0, 2], 5), vec![2, 2, 0, 1]);
        assert_eq!(taken_in_turn(&[], 5), Vec::<u64>::new());
    }

    #[test]
    fn nodes_read_each_sample_once_an_epoch_with_equal_steps() {
        let n = 1003;
        for nodes in [1, 2, 4] {
            for epoch in 0..2 {
                let ranks = on_nodes(n, nodes, 2, 8, epoch, if epoch == 0 { 0 } else { 100 });
                let mut seen: Vec<u64> = ranks.iter().flat_map(|r| r.1.clone()).collect();
                seen.sort();
                assert_eq!(
                    seen,
                    (0..n).collect::<Vec<_>>(),
                    "{nodes} nodes, epoch {epoch}"
                );
                let steps: Vec<u64> = ranks.iter().map(|r| r.2).collect();
                assert!(
                    steps.iter().all(|&s| s == steps[0]),
                    "{nodes} nodes: steps {steps:?}"
                );
            }
        }
    }

    #[test]
    fn a_share_of_granules_changes_partition_each_epoch() {
        let n = 7000;
        let part = |epoch, swap| -> std::collections::BTreeSet<u64> {
            let split = NodeSplit {
                nodes: 4,
                node: 2,
                partitions: 8,
                granule: 7,
                swap_per_mille: swap,
                resumed: None,
            };
            node_order(n, 5, epoch, true, &split)
                .0
                .into_iter()
                .collect()
        };
        let (base, e1, e2) = (part(1, 0), part(1, 100), part(2, 100));
        assert_eq!(
            base,
            part(2, 0),
            "without a swap, the same part every epoch"
        );
        // Q = 10%: about 10% of the node's part comes from elsewhere each epoch (a chosen
        // granule leaves and another comes, each with probability about Q).
        for e in [&e1, &e2] {
            let moved = e.difference(&base).count() as f64 / base.len() as f64;
            assert!((0.05..0.15).contains(&moved), "{moved}");
            assert!(e.len() as f64 / base.len() as f64 > 0.9);
        }
        assert_ne!(e1, e2, "a new choice each epoch");
        // Exactly once over the nodes still.
        let mut all: Vec<u64> = (0..4)
            .flat_map(|node| {
                let split = NodeSplit {
                    nodes: 4,
                    node,
                    partitions: 8,
                    granule: 7,
                    swap_per_mille: 100,
                    resumed: None,
                };
                node_order(n, 5, 3, true, &split).0
            })
            .collect();
        all.sort();
        assert_eq!(all, (0..n).collect::<Vec<_>>());
    }

    #[test]
    fn a_nodes_part_is_whole_granules_kept_across_epochs() {
        let n = 1003;
        let part = |epoch| {
            let (order, _) = node_order(
                n,
                5,
                epoch,
                true,
                &NodeSplit {
                    nodes: 4,
                    node: 1,
                    partitions: 8,
                    granule: 7,
                    swap_per_mille: 0,
                    resumed: None,
                },
            );
            order
        };
        let (e0, e1) = (part(0), part(1));
        assert_ne!(e0, e1, "shuffled anew each epoch");
        let sorted = |mut v: Vec<u64>| {
            v.sort();
            v
        };
        assert_eq!(
            sorted(e0.clone()),
            sorted(e1),
            "the same samples every epoch"
        );
        // Whole granules: a granule's samples are all on this node or none.
        let granules: std::collections::BTreeSet<u64> = e0.iter().map(|s| s / 7).collect();
        let whole: usize = granules
            .iter()
            .map(|g| ((g + 1) * 7).min(n) as usize - (g * 7) as usize)
            .sum();
        assert_eq!(whole, e0.len());
        // About a quarter of the dataset.
        assert!((200..=300).contains(&e0.len()), "{}", e0.len());
    }

    #[test]
    fn each_partitions_sequence_is_the_same_on_any_number_of_nodes() {
        let (n, parts) = (1003, 8u32);
        // Partition c's sequence, as node c % nodes reads it (every nodes-th... of its turns).
        let sequence = |nodes: u32, c: u32| -> Vec<u64> {
            let split = NodeSplit {
                nodes,
                node: c % nodes,
                partitions: parts,
                granule: 7,
                swap_per_mille: 0,
                resumed: None,
            };
            let dealt = dealt(n, 9, 3, true, &split);
            let members: std::collections::HashSet<u64> = dealt[c as usize]
                .iter()
                .flat_map(|&g| g * 7..((g + 1) * 7).min(n))
                .collect();
            let (order, _) = node_order(n, 9, 3, true, &split);
            order.into_iter().filter(|s| members.contains(s)).collect()
        };
        for c in 0..parts {
            let one = sequence(1, c);
            assert!(!one.is_empty());
            assert_eq!(sequence(2, c), one, "partition {c} on 2 nodes");
            assert_eq!(sequence(4, c), one, "partition {c} on 4 nodes");
        }
    }

    #[test]
    fn a_split_that_does_not_hold_is_refused_with_why() {
        let err = |split: NodeSplit, rank: u32, world: u32| {
            format!(
                "{:#}",
                Plan::new(PlanRequest {
                    split: Some(split),
                    ..plan(100, 4, rank, world, 0, 1)
                })
                .unwrap_err()
            )
        };
        let s = |nodes, node, partitions| NodeSplit {
            nodes,
            node,
            partitions,
            granule: 1,
            swap_per_mille: 0,
            resumed: None,
        };
        assert!(err(s(3, 0, 64), 0, 3).contains("multiple of nodes"));
        assert!(err(s(1, 0, 4_000_000_000), 0, 1).contains("at most 65536"));
        // The default suits 3 and 6 nodes as well as 2, 4 and 8.
        for nodes in [1, 2, 3, 4, 6, 8] {
            assert!(DEFAULT_PARTITIONS.is_multiple_of(nodes));
        }
        assert!(err(s(2, 2, 64), 0, 2).contains("out of range"));
        assert!(err(s(2, 1, 64), 0, 4).contains("rank 0 is on node 0"));
        assert!(err(s(2, 0, 64), 0, 3).contains("world_size 3 is not a multiple"));
    }
}
