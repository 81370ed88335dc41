//! Sample lookup through the tiers: memory -> scratch -> raw source + preprocess, filling the
//! tiers on the way. Concurrent requests for one sample share one fetch; disk reads and
//! preprocessing run on the preprocessing pool (`workers.rs`). A sample whose files do not read or
//! decode is, by the dataset's `on_error`, skipped (recorded once and not tried again while the
//! daemon runs) or an error.

use crate::catalog::Dataset;
use crate::error::{Error, Kind};
use crate::metrics::{Metrics, Tier};
use crate::sampler::{node_granules, NodeSplit};
use crate::tiers::eviction::Key;
use crate::tiers::memory::{MemorySnapshot, MemoryTier};
use crate::tiers::scratch::{ScratchSnapshot, ScratchSpace, ScratchTier};
use crate::tiers::trace::{Outcome, Trace};
use crate::workers::Workers;
use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use futures::StreamExt;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// A fetch in flight: the sample's bytes, or None for a sample skipped as bad.
type Fetch = Shared<BoxFuture<'static, Result<Option<(Bytes, Tier)>, Arc<anyhow::Error>>>>;

/// A granule of a dataset a reader prepares, being read: its records (each, or why not) and
/// the raw bytes read, or why none could be had (the reader failed).
type GranuleFetch = Shared<BoxFuture<'static, Result<Arc<Granule>, Arc<anyhow::Error>>>>;

/// A granule's records as a reader prepared them, charged to its owner while held.
struct Granule {
    start: u64,
    records: Vec<Result<Bytes, Arc<anyhow::Error>>>,
    raw_bytes: u64,
    _held: Vec<crate::footprint::Charge>,
}

pub struct Store {
    pub memory: Arc<MemoryTier>,
    /// The scratch tier's directory and budget (None: off, or its directory is unusable), the
    /// size of its shard files, and each dataset's shards by dataset id.
    scratch_space: Option<Arc<ScratchSpace>>,
    shard_bytes: u64,
    scratch: Mutex<HashMap<u32, Arc<ScratchTier>>>,
    pub metrics: Arc<Metrics>,
    inflight: Mutex<HashMap<Key, Fetch>>,
    /// Threads for the blocking work (disk reads, preprocessing).
    workers: Arc<Workers>,
    /// Striped by (dataset, granule): one worker reads a granule from raw storage while the
    /// others that need it wait, then find their samples in the scratch tier (a dataset read
    /// in this process).
    granule_locks: Arc<[Mutex<()>]>,
    /// The granules of datasets readers prepare being read now, by (dataset, first sample,
    /// samples):
    /// every sample of one is awaited from that one request (no lock held across the wait).
    granules: Mutex<HashMap<(u32, u64, u64), GranuleFetch>>,
    /// Every lookup, when a benchmark asked for it (`LARDER_TRACE`).
    trace: std::sync::OnceLock<Trace>,
    /// The next epochs of nodes' parts being read ahead, or read (`prefetch_next_epoch`).
    prefetches: Mutex<HashSet<Prefetch>>,
    /// Held by the read-ahead running now.
    prefetch_turn: tokio::sync::Semaphore,
}

/// A node's part of one epoch of a dataset, as read ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Prefetch {
    dataset: u32,
    split: NodeSplit,
    seed: u64,
    epoch: u64,
    shuffle: bool,
}

/// Parts remembered as read ahead; past this many the oldest are forgotten (a part read again
/// finds its samples in the scratch tier and reads nothing).
const PREFETCHES_KEPT: usize = 256;

const GRANULE_LOCKS: usize = 64;

impl Store {
    /// A store over `memory` with `workers` preprocessing threads.
    pub fn new(
        memory: Arc<MemoryTier>,
        scratch_space: Option<Arc<ScratchSpace>>,
        shard_bytes: u64,
        metrics: Arc<Metrics>,
        workers: usize,
    ) -> Result<Arc<Store>> {
        Ok(Arc::new(Store {
            memory,
            scratch_space,
            shard_bytes,
            scratch: Mutex::new(HashMap::new()),
            metrics,
            inflight: Mutex::new(HashMap::new()),
            workers: Arc::new(Workers::new(workers).context("starting the preprocessing threads")?),
            granule_locks: (0..GRANULE_LOCKS).map(|_| Mutex::new(())).collect(),
            granules: Mutex::default(),
            trace: std::sync::OnceLock::new(),
            prefetches: Mutex::new(HashSet::new()),
            prefetch_turn: tokio::sync::Semaphore::new(1),
        }))
    }

    /// Records every lookup in `trace` from now on.
    pub fn trace_to(&self, trace: Trace) {
        let _ = self.trace.set(trace);
    }

    /// Writes out the lookups recorded so far.
    pub fn flush_trace(&self) {
        if let Some(t) = self.trace.get() {
            t.flush();
        }
    }

    fn traced(&self, key: Key, outcome: Outcome) {
        if let Some(t) = self.trace.get() {
            t.record(key, outcome);
        }
    }

    /// Opens the scratch shards of `ds` (if the scratch tier is on): the store serves it now.
    /// A dataset reopened with the same data (same fingerprint) goes on with the tier its
    /// previous version had: one folder, one writer.
    pub fn add(&self, ds: &Dataset) {
        // A fixed-shape dataset's records are all one size: slabs for it from its first record.
        if let Some(len) = ds.schema.fixed_record_bytes() {
            self.memory.expect_size(len as usize);
        }
        let Some(space) = &self.scratch_space else {
            return;
        };
        let fingerprint = ds.fingerprint();
        let mut tiers = self.lock_scratch();
        let same = tiers
            .values()
            .find(|t| t.fingerprint() == fingerprint && t.name_matches(&ds.name))
            .cloned();
        if let Some(tier) = same {
            tiers.insert(ds.id, tier);
            return;
        }
        let opened = ScratchTier::open(
            space,
            &ds.name,
            fingerprint,
            ds.len(),
            ds.record_bytes_estimate(),
            self.shard_bytes,
        );
        match opened {
            Ok(tier) => {
                let tier = Arc::new(tier);
                space.register(&tier);
                tiers.insert(ds.id, tier);
            }
            Err(e) => {
                tracing::error!(dataset = %ds.name, "no scratch tier for this dataset: {e:#}")
            }
        }
    }

    /// Counts the shard folders no dataset serves now as idle: kept, and removed oldest first
    /// when a dataset needs their space.
    pub fn keep_unused_scratch(&self) {
        if let Some(space) = &self.scratch_space {
            let tiers: Vec<Arc<ScratchTier>> = self.lock_scratch().values().cloned().collect();
            space.keep_unused(tiers.iter().map(|t| t.dir()));
        }
    }

    /// Lets go of the scratch tier of dataset `id` (removed from the config, or replaced by a
    /// newer version): unless another id still uses it, its folder becomes idle, kept until
    /// its space is needed.
    pub fn forget(&self, id: u32) {
        let mut tiers = self.lock_scratch();
        let Some(tier) = tiers.remove(&id) else {
            return;
        };
        if !tiers.values().any(|t| Arc::ptr_eq(t, &tier)) {
            if let Some(space) = &self.scratch_space {
                space.deregister(&tier);
                space.retire(tier.dir());
            }
        }
    }

    /// Whether the store keeps a scratch tier.
    pub fn has_scratch(&self) -> bool {
        self.scratch_space.is_some()
    }

    /// The scratch shards of `ds`, if it has any.
    pub fn scratch_of(&self, ds: &Dataset) -> Option<Arc<ScratchTier>> {
        self.lock_scratch().get(&ds.id).cloned()
    }

    /// A lookup of `ds` served by `tier` with `bytes` read there: the daemon's counters and the
    /// dataset's.
    fn record_hit(&self, ds: &Dataset, tier: Tier, bytes: u64) {
        self.metrics.record_hit(tier, bytes);
        ds.lookups.record(tier, bytes);
    }

    /// The preprocessing pool's busy share over the last `window`.
    pub fn pool_busy(&self, window: std::time::Duration) -> f64 {
        self.workers.busy_share(window)
    }

    /// Threads in the preprocessing pool.
    pub fn pool_threads(&self) -> usize {
        self.workers.threads()
    }

    /// The tiers' state: the memory tier's and the scratch tier's.
    pub fn stats(&self) -> (MemorySnapshot, ScratchSnapshot) {
        let scratch = self.scratch_space.as_ref().map(|s| s.snapshot());
        (self.memory.snapshot(), scratch.unwrap_or_default())
    }

    fn lock_scratch(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<ScratchTier>>> {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The preprocessed bytes of sample `index` of `ds`; None when the sample is skipped because
    /// its files do not read or decode (on_error = "skip").
    pub async fn get(self: &Arc<Self>, ds: &Arc<Dataset>, index: u64) -> Result<Option<Bytes>> {
        Ok(self.get_from(ds, index).await?.map(|(data, _)| data))
    }

    /// As `get`, with the tier the bytes came from (for a sample another stream was already
    /// fetching, the tier that fetch read).
    pub async fn get_from(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        index: u64,
    ) -> Result<Option<(Bytes, Tier)>> {
        let key = (ds.id, index);
        if let Some(data) = self.memory.get(&key) {
            self.record_hit(ds, Tier::Memory, data.len() as u64);
            self.traced(key, Outcome::Hit);
            return Ok(Some((data, Tier::Memory)));
        }
        if ds.is_bad(index) {
            return Ok(None);
        }
        let fetch = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            match inflight.get(&key) {
                Some(f) => {
                    self.metrics.record_coalesced();
                    self.traced(key, Outcome::Joined);
                    f.clone()
                }
                None => {
                    // A fetch that finished between our miss and taking the lock has filled
                    // the memory tier before leaving `inflight`: look again.
                    if let Some(data) = self.memory.peek(&key) {
                        self.record_hit(ds, Tier::Memory, data.len() as u64);
                        self.traced(key, Outcome::Hit);
                        return Ok(Some((data, Tier::Memory)));
                    }
                    self.traced(key, Outcome::Miss);
                    // The fetch runs as its own task: it finishes (and fills the tiers) even if
                    // every client waiting on it goes away, so a preprocessing job already queued
                    // is never done for nothing.
                    let task = tokio::spawn(self.clone().fetch(ds.clone(), index));
                    let f = async move {
                        task.await
                            .unwrap_or_else(|e| Err(Arc::new(anyhow!("fetch task failed: {e}"))))
                    }
                    .boxed()
                    .shared();
                    inflight.insert(key, f.clone());
                    f
                }
            }
        };
        // The shared error, as an error of the same kind for this caller.
        fetch
            .await
            .map_err(|e| Error::new(Error::kind_of(&e), format!("{e:#}")).into())
    }

    async fn fetch(
        self: Arc<Self>,
        ds: Arc<Dataset>,
        index: u64,
    ) -> Result<Option<(Bytes, Tier)>, Arc<anyhow::Error>> {
        let key = (ds.id, index);
        let result = match self.load(&ds, index).await {
            Ok(Ok((data, tier, bytes_read))) => {
                self.record_hit(&ds, tier, bytes_read);
                self.memory
                    .insert(key, data.clone(), ds.source.disk_bytes_of(index));
                Ok(Some((data, tier)))
            }
            // The sample's own files failed: skipped, or the stream's error.
            Ok(Err(bad)) if ds.skips(&bad) => {
                ds.mark_bad(index, &bad);
                Ok(None)
            }
            Ok(Err(e)) => Err(Arc::new(sample_error(&e).into())),
            Err(e) => Err(Arc::new(e)),
        };
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        result
    }

    /// The sample through the scratch and raw tiers: on the worker pool for a dataset read in
    /// this process, awaited from its reader for one a reader prepares. The outer error is the
    /// daemon's (the pool, or the reader); the inner one the sample's (its files do not read
    /// or decode).
    async fn load(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        index: u64,
    ) -> Result<Result<(Bytes, Tier, u64)>> {
        if ds.source.prepared().is_some() {
            return self.load_prepared(ds, index).await;
        }
        let (ds, locks, scratch) = (ds.clone(), self.granule_locks.clone(), self.scratch_of(ds));
        self.workers
            .run_for(tenant(&ds), move || {
                load_blocking(&ds, scratch.as_deref(), &locks, index)
            })
            .await
    }

    /// Sample `index` of a dataset a reader prepares: from the scratch tier (a read on the
    /// pool), else with the rest of its granule from the reader, awaited here (the granule's
    /// other samples go to the scratch tier, so their own misses later are scratch hits).
    async fn load_prepared(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        index: u64,
    ) -> Result<Result<(Bytes, Tier, u64)>> {
        let scratch = self.scratch_of(ds);
        if let Some(s) = scratch.clone().filter(|s| s.contains(index)) {
            if let Some(data) = self
                .workers
                .run_for(tenant(ds), move || s.read(index))
                .await?
            {
                let n = data.len() as u64;
                return Ok(Ok((data, Tier::Scratch, n)));
            }
        }
        let granule = ds.source.read_granule().max(1);
        let (start, count) = match &scratch {
            Some(s) if granule > 1 && s.accepts_writes(index) => {
                let start = index / granule * granule;
                (start, granule.min(ds.len() - start))
            }
            _ => (index, 1),
        };
        let (fetch, first) = self.granule_fetch(ds, scratch, start, count);
        let g = fetch
            .await
            .map_err(|e| anyhow::Error::from(Error::new(Error::kind_of(&e), format!("{e:#}"))))?;
        let record = g.records[(index - g.start) as usize].clone();
        Ok(match record {
            // The sample that read the granule counts its raw bytes; the others of it would
            // have been scratch hits.
            Ok(data) if first => Ok((data, Tier::Raw, g.raw_bytes)),
            Ok(data) => {
                let n = data.len() as u64;
                Ok((data, Tier::Scratch, n))
            }
            Err(e) => Err(Error::new(Error::kind_of(&e), format!("{e:#}")).into()),
        })
    }

    /// The read of samples `start..start + count` of `ds` from its reader: the one in flight,
    /// or a new one (then true), whose records are written to `scratch` before it is done.
    fn granule_fetch(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        scratch: Option<Arc<ScratchTier>>,
        start: u64,
        count: u64,
    ) -> (GranuleFetch, bool) {
        let key = (ds.id, start, count);
        let mut granules = self.granules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = granules.get(&key) {
            return (f.clone(), false);
        }
        let (store, ds) = (self.clone(), ds.clone());
        let read = async move {
            let loaded = ds.load_prepared(start, count).await;
            let granule = match loaded {
                Ok(loaded) => {
                    let records: Vec<Result<Bytes, Arc<anyhow::Error>>> = loaded
                        .records
                        .into_iter()
                        .map(|r| r.map(Bytes::from).map_err(Arc::new))
                        .collect();
                    let granule = Arc::new(Granule {
                        start,
                        records,
                        raw_bytes: loaded.raw_bytes,
                        _held: loaded.held,
                    });
                    if let Some(scratch) = scratch {
                        let g = granule.clone();
                        let _ = store
                            .workers
                            .run_for(tenant(&ds), move || {
                                for (i, r) in (g.start..).zip(&g.records) {
                                    if let Ok(d) = r {
                                        if !scratch.contains(i) && !scratch.write(i, d) {
                                            break; // the budget or the disk is full
                                        }
                                    }
                                }
                            })
                            .await;
                    }
                    Ok(granule)
                }
                Err(e) => Err(Arc::new(e)),
            };
            store
                .granules
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&(ds.id, start, count));
            granule
        };
        // Its own task: it finishes (and fills the scratch tier) even if every waiter goes.
        let task = tokio::spawn(read);
        let f = async move {
            task.await
                .unwrap_or_else(|e| Err(Arc::new(anyhow!("a reader's read failed: {e}"))))
        }
        .boxed()
        .shared();
        granules.insert(key, f.clone());
        (f, true)
    }

    /// Preprocesses every sample of `ds` missing from its scratch tier into it, reporting
    /// progress; samples already there are skipped, so an interrupted warm resumes where it
    /// stopped. Stops early if `progress` is dropped (the client went away).
    pub async fn warm(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        progress: mpsc::Sender<WarmProgress>,
    ) -> Result<WarmProgress> {
        let scratch = self.scratch_of(ds).ok_or_else(|| no_scratch(ds))?;
        const CHUNK: u64 = 256;
        let total = ds.len();
        let mut state = WarmProgress {
            total,
            ..Default::default()
        };
        let mut chunks = futures::stream::iter((0..total).step_by(CHUNK as usize))
            .map(|start| {
                let (store, ds, scratch) = (self.clone(), ds.clone(), scratch.clone());
                async move {
                    let count = CHUNK.min(total - start);
                    store.warm_range(&ds, &scratch, start, count).await
                }
            })
            .buffer_unordered(self.workers.threads());
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk?;
            state.written += chunk.written;
            state.present += chunk.present;
            state.bad += chunk.bad;
            state.done += chunk.count;
            if progress.send(state).await.is_err() {
                anyhow::bail!(
                    "warming {:?} cancelled after {} of {total} samples",
                    ds.name,
                    state.done
                );
            }
        }
        Ok(state)
    }

    /// Warms samples `start..start + count` of `ds` into `scratch` (see `warm_chunk`): on the
    /// pool for a dataset read in this process; from its reader, awaited here, for one a
    /// reader prepares (the pool then only writes).
    async fn warm_range(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        scratch: &Arc<ScratchTier>,
        start: u64,
        count: u64,
    ) -> Result<Chunk> {
        let (ds, scratch, memory) = (ds.clone(), scratch.clone(), self.memory.clone());
        if ds.source.prepared().is_none() {
            return self
                .workers
                .run_for(tenant(&ds), move || {
                    warm_chunk(&ds, &scratch, &memory, start, count)
                })
                .await?;
        }
        let missing: Vec<u64> = (start..start + count)
            .filter(|&i| !scratch.contains(i))
            .collect();
        if missing.is_empty() {
            return Ok(Chunk::present(count));
        }
        let loaded = ds.load_prepared(start, count).await?;
        let raw_bytes = loaded.raw_bytes;
        let prepared = (start..)
            .zip(loaded.records)
            .filter(|(i, _)| missing.binary_search(i).is_ok())
            .collect();
        // What holding the records is charged lasts until they are placed.
        let held = loaded.held;
        self.workers
            .run_for(tenant(&ds), move || {
                let placed = place(&ds, &scratch, &memory, count, prepared, raw_bytes);
                drop(held);
                placed
            })
            .await?
    }
}

impl Store {
    /// Reads node `split.node`'s part of the epoch after `epoch` into the scratch tier ahead of
    /// need, while the current one streams: that part is known (a pure function of the seed,
    /// the epoch and the split), and with `swap` a share of it is new each epoch. The granules
    /// new to the part (the current epoch's streams read the others) and not wholly in the
    /// scratch tier are read in order, one at a time on the pool (the
    /// streams' own reads are never queued behind more than one), and offered to the memory
    /// tier as a warm's are. Once per part and epoch, whichever of the node's ranks opens a
    /// stream first; stops when the scratch tier stops taking samples. Without a scratch tier
    /// nothing is read: the memory tier holds what the open streams read soonest, and the
    /// next epoch is no open stream's yet.
    pub fn prefetch_next_epoch(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        split: NodeSplit,
        seed: u64,
        epoch: u64,
        shuffle: bool,
    ) {
        let Some(scratch) = self.scratch_of(ds) else {
            return;
        };
        let part = Prefetch {
            dataset: ds.id,
            split: NodeSplit {
                resumed: None,
                ..split
            },
            seed,
            epoch: epoch.wrapping_add(1),
            shuffle,
        };
        {
            let mut started = self.prefetches.lock().unwrap_or_else(|e| e.into_inner());
            if started.len() >= PREFETCHES_KEPT {
                started.clear();
            }
            if !started.insert(part) {
                return;
            }
        }
        let (store, ds) = (self.clone(), ds.clone());
        tokio::spawn(async move {
            // One read-ahead at a time, whatever the jobs: the streams' own reads are never
            // queued behind more than one granule of it.
            let Ok(_turn) = store.prefetch_turn.acquire().await else {
                return;
            };
            let ds2 = ds.clone();
            let Ok(new) = store.workers.run(move || new_granules(&ds2, &part)).await else {
                return;
            };
            let (n, g) = (ds.len(), part.split.granule.max(1));
            for k in new {
                // Stop once the dataset's scratch tier is retired or replaced (its dataset
                // removed or changed).
                if !store
                    .scratch_of(&ds)
                    .is_some_and(|s| Arc::ptr_eq(&s, &scratch))
                {
                    break;
                }
                let (start, count) = (k * g, g.min(n - k * g));
                if (start..start + count).all(|i| scratch.contains(i)) {
                    continue;
                }
                let read = match ds.source.prepared() {
                    Some(_) => store.warm_range(&ds, &scratch, start, count).await,
                    None => {
                        let (ds2, scratch2) = (ds.clone(), scratch.clone());
                        let (memory, locks) = (store.memory.clone(), store.granule_locks.clone());
                        store
                            .workers
                            .run_for(tenant(&ds), move || {
                                // The granule's lock, as a stream reading it takes: one raw
                                // read.
                                let _reading = granule_lock(&locks, ds2.id, k);
                                warm_chunk(&ds2, &scratch2, &memory, start, count)
                            })
                            .await
                            .and_then(|r| r)
                    }
                };
                match read {
                    Ok(chunk) => store
                        .metrics
                        .record_prefetch(chunk.written, chunk.raw_bytes),
                    Err(e) => {
                        tracing::info!(dataset = %ds.name, epoch = part.epoch, "read-ahead of the node's next epoch stopped: {e:#}");
                        break;
                    }
                }
            }
        });
    }
}

/// The granules new to a node's part in `part.epoch` (not in its part of the epoch before, which
/// that epoch's streams read), in order.
fn new_granules(ds: &Dataset, part: &Prefetch) -> Vec<u64> {
    let granules_of = |epoch| node_granules(ds.len(), part.seed, epoch, part.shuffle, &part.split);
    let now = granules_of(part.epoch.wrapping_sub(1));
    granules_of(part.epoch)
        .into_iter()
        .filter(|k| now.binary_search(k).is_err())
        .collect()
}

/// The lock of `dataset`'s granule `granule` (striped): one worker reads a granule from raw
/// storage while the others that need it wait.
fn granule_lock(locks: &[Mutex<()>], dataset: u32, granule: u64) -> std::sync::MutexGuard<'_, ()> {
    let stripe = (granule + 7 * dataset as u64) as usize % locks.len();
    locks[stripe].lock().unwrap_or_else(|e| e.into_inner())
}

/// Whose turn on the pool a job for `ds` takes: its owner's (a user's datasets share one
/// turn), or the dataset's own for the config's.
fn tenant(ds: &Dataset) -> crate::workers::Tenant {
    match ds.owner {
        Some(uid) => uid as u64,
        None => (1 << 32) | ds.id as u64,
    }
}

/// Why `ds` cannot be warmed.
pub fn no_scratch(ds: &Dataset) -> Error {
    Error::new(
        Kind::NoScratch,
        format!(
            "dataset {:?} has no scratch tier (scratch.enabled is false or its directory is unusable; see the daemon's log)",
            ds.name
        ),
    )
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WarmProgress {
    /// Samples looked at so far, of `total`.
    pub done: u64,
    pub total: u64,
    /// Samples preprocessed and written this time.
    pub written: u64,
    /// Samples that were already in the scratch tier.
    pub present: u64,
    /// Samples whose files do not read or decode (skipped, or the warm's error).
    pub bad: u64,
}

/// What warming a run of samples did.
struct Chunk {
    written: u64,
    present: u64,
    bad: u64,
    count: u64,
    /// Bytes read from raw storage.
    raw_bytes: u64,
}

impl Chunk {
    /// A run of `count` samples all in the scratch tier already.
    fn present(count: u64) -> Chunk {
        Chunk {
            written: 0,
            present: count,
            bad: 0,
            count,
            raw_bytes: 0,
        }
    }
}

/// Warms samples `start..start + count`. What it
/// preprocesses is offered to the memory tier too, whose policy keeps what it would have kept
/// had a stream read it (with no stream open, the most recent; with streams on the dataset,
/// what they read soonest), so the first epoch after a warm starts with the memory tier primed.
fn warm_chunk(
    ds: &Dataset,
    scratch: &ScratchTier,
    memory: &MemoryTier,
    start: u64,
    count: u64,
) -> Result<Chunk> {
    let missing: Vec<u64> = (start..start + count)
        .filter(|&i| !scratch.contains(i))
        .collect();
    if missing.is_empty() {
        return Ok(Chunk::present(count));
    }
    // One range read beats many single reads when most of the range is needed; a range with a
    // file that does not read is read sample by sample, to find which.
    let range = (missing.len() as u64 * 2 > count)
        .then(|| ds.load_range(start, count).ok())
        .flatten();
    let mut raw_bytes = 0;
    let prepared: Vec<(u64, Result<Vec<u8>>)> = match range {
        Some(loaded) => {
            raw_bytes = loaded.raw_bytes;
            (start..start + count)
                .zip(loaded.records)
                .filter(|(i, _)| missing.binary_search(i).is_ok())
                .collect()
        }
        None => missing
            .iter()
            .map(|&i| {
                let loaded = ds.load(i).map(|(d, bytes)| {
                    raw_bytes += bytes;
                    d
                });
                (i, loaded)
            })
            .collect(),
    };
    place(ds, scratch, memory, count, prepared, raw_bytes)
}

/// Writes the records `prepared` (of the samples missing among `count` of a range) to
/// `scratch`, offering each to the memory tier too; a sample that failed is marked bad (or is
/// the warm's error).
fn place(
    ds: &Dataset,
    scratch: &ScratchTier,
    memory: &MemoryTier,
    count: u64,
    prepared: Vec<(u64, Result<Vec<u8>>)>,
    raw_bytes: u64,
) -> Result<Chunk> {
    let (mut written, mut bad) = (0, 0);
    for (i, prepared) in prepared {
        let data = match prepared {
            Ok(d) => d,
            Err(e) if ds.skips(&e) => {
                ds.mark_bad(i, &e);
                bad += 1;
                continue;
            }
            Err(e) => return Err(sample_error(&e).into()),
        };
        let kept = scratch.write(i, &data);
        memory.insert((ds.id, i), Bytes::from(data), ds.source.disk_bytes_of(i));
        if !kept {
            return Err(Error::new(
                Kind::Exhausted,
                format!(
                    "the scratch tier stopped taking samples at sample {i} of {:?} (budget or disk full; see the daemon's log)",
                    ds.name
                ),
            )
            .into());
        }
        written += 1;
    }
    Ok(Chunk {
        written,
        present: count - written - bad,
        bad,
        count,
        raw_bytes,
    })
}

/// The sample from the scratch tier, or else from raw storage, preprocessed and written to the
/// scratch tier; with the tier it came from and the bytes read there.
fn load_blocking(
    ds: &Dataset,
    scratch: Option<&ScratchTier>,
    locks: &[Mutex<()>],
    index: u64,
) -> Result<(Bytes, Tier, u64)> {
    let from_scratch = |data: Bytes| {
        let n = data.len() as u64;
        Ok((data, Tier::Scratch, n))
    };
    if let Some(data) = scratch.and_then(|s| s.read(index)) {
        return from_scratch(data);
    }
    let granule = ds.source.read_granule();
    let (data, raw_bytes) = match scratch {
        Some(scratch) if granule > 1 && scratch.accepts_writes(index) => {
            let _reading = granule_lock(locks, ds.id, index / granule);
            // Filled while this worker waited? (`contains` first: a corrupt record was
            // counted once already.)
            let filled = scratch.contains(index).then(|| scratch.read(index));
            if let Some(data) = filled.flatten() {
                return from_scratch(data);
            }
            load_granule(ds, scratch, index)?
        }
        _ => load_one(ds, scratch, index)?,
    };
    Ok((Bytes::from(data), Tier::Raw, raw_bytes))
}

/// Sample `index` alone from raw storage, preprocessed (and written to `scratch`); with the
/// raw bytes read.
fn load_one(ds: &Dataset, scratch: Option<&ScratchTier>, index: u64) -> Result<(Vec<u8>, u64)> {
    let (data, raw_bytes) = ds.load(index)?;
    if let Some(scratch) = scratch {
        scratch.write(index, &data);
    }
    Ok((data, raw_bytes))
}

/// Sample `index`, read with the rest of its granule (the aligned range of samples the source
/// reads about as cheaply as one); the granule's samples missing from `scratch` are written
/// there, so their own misses later in a shuffled epoch are scratch hits. Returns the sample and
/// the raw bytes read.
fn load_granule(ds: &Dataset, scratch: &ScratchTier, index: u64) -> Result<(Vec<u8>, u64)> {
    let granule = ds.source.read_granule();
    let start = index / granule * granule;
    let count = granule.min(ds.len() - start);
    let (mut records, raw_bytes) = match ds.load_range(start, count) {
        Ok(loaded) => (loaded.records, loaded.raw_bytes),
        // A reader that failed fails the stream; any other range that does not read: this
        // sample alone (its own error, if it is one).
        Err(e) if Error::kind_of(&e) == Kind::Reader => return Err(e),
        Err(_) => return load_one(ds, Some(scratch), index),
    };
    let data = std::mem::replace(
        &mut records[(index - start) as usize],
        Err(anyhow::anyhow!("taken")),
    )?;
    scratch.write(index, &data);
    for (i, record) in (start..).zip(records) {
        if i == index || scratch.contains(i) {
            continue;
        }
        // A neighbour that fails to preprocess fails its own request later, not this one.
        let Ok(d) = record else {
            continue;
        };
        if !scratch.write(i, &d) {
            break; // the budget or the disk is full
        }
    }
    Ok((data, raw_bytes))
}

/// A sample's failure as the stream's error: its files do not read or decode (DATA_LOSS), or
/// the dataset's files changed under the daemon (kept as that).
fn sample_error(e: &anyhow::Error) -> Error {
    let kind = match Error::kind_of(e) {
        Kind::Changed => Kind::Changed,
        Kind::Reader => Kind::Reader,
        _ => Kind::SourceIo,
    };
    Error::new(kind, format!("{e:#}"))
}
