//! Sample lookup through the tiers: memory -> scratch -> raw source + preprocess, filling the
//! tiers on the way. Concurrent requests for one sample share one fetch; disk reads and
//! preprocessing run on the preprocessing pool (`workers.rs`). A sample whose files do not read or
//! decode is, by the dataset's `on_error`, skipped (recorded once and not tried again while the
//! daemon runs) or an error.

use crate::catalog::Dataset;
use crate::error::{Error, Kind};
use crate::metrics::{Metrics, Tier};
use crate::sampler::{node_granules, NodeSplit};
use crate::sync::Locked;
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

/// What a batch of misses of a dataset a reader prepares came to: each sample's bytes and the
/// tier it came from (None: skipped as bad), or the sample's error; or why none could be had
/// (the reader failed).
type Batched = Result<Arc<HashMap<u64, SampleResult>>, Arc<anyhow::Error>>;
type SampleResult = Result<Option<(Bytes, Tier)>, Arc<anyhow::Error>>;

/// Samples of a dataset a reader prepares, read in one request: each its record or why not,
/// and the raw bytes read; or why none could be had.
type Read = Shared<BoxFuture<'static, Result<Arc<Part>, Arc<anyhow::Error>>>>;

struct Part {
    records: Vec<(u64, Result<Bytes, Arc<anyhow::Error>>)>,
    raw_bytes: u64,
}

/// A range being read from a dataset's reader: (dataset, (first sample, samples)).
type Reading = (u32, (u64, u64));

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
    /// The ranges of datasets readers prepare being read now, by (dataset, range): a call
    /// whose misses are in one waits for that read rather than reading the range again.
    reading: Mutex<HashMap<Reading, Read>>,
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
            reading: Mutex::default(),
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
        self.scratch.locked()
    }

    /// The preprocessed bytes of sample `index` of `ds`; None when the sample is skipped because
    /// its files do not read or decode (on_error = "skip").
    pub async fn get(self: &Arc<Self>, ds: &Arc<Dataset>, index: u64) -> Result<Option<Bytes>> {
        let mut got = self.get_many(ds, &[index]).await?;
        Ok(got.pop().flatten().map(|(data, _)| data))
    }

    /// The preprocessed bytes of samples `indices` of `ds`, in order, each with the tier it came
    /// from (for a sample another stream was already fetching, the tier that fetch read); None
    /// for a sample skipped because its files do not read or decode (on_error = "skip").
    ///
    /// Each miss is one fetch however many streams want it, and runs as a task of its own (it
    /// finishes, and fills the tiers, even if every stream waiting on it goes away). A dataset
    /// read in this process reads each miss on the pool; for one a reader prepares, the misses
    /// of one call are one request to the reader (across granules) and one placement into the
    /// tiers (`fetch_prepared`).
    pub async fn get_many(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        indices: &[u64],
    ) -> Result<Vec<Option<(Bytes, Tier)>>> {
        let mut waits: Vec<Option<Fetch>> = Vec::with_capacity(indices.len());
        let mut ready: Vec<Option<Option<(Bytes, Tier)>>> = vec![None; indices.len()];
        let mut misses: Vec<u64> = vec![];
        {
            let mut inflight = self.inflight.locked();
            for (k, &index) in indices.iter().enumerate() {
                let key = (ds.id, index);
                // A fetch that finished between a miss and the lock has filled the memory
                // tier before leaving `inflight`: the tier is looked at under the lock.
                if let Some(data) = self.memory.get(&key) {
                    self.record_hit(ds, Tier::Memory, data.len() as u64);
                    self.traced(key, Outcome::Hit);
                    ready[k] = Some(Some((data, Tier::Memory)));
                    waits.push(None);
                    continue;
                }
                if ds.is_bad(index) {
                    ready[k] = Some(None);
                    waits.push(None);
                    continue;
                }
                if let Some(f) = inflight.get(&key) {
                    if !misses.contains(&index) {
                        self.metrics.record_coalesced();
                        self.traced(key, Outcome::Joined);
                    }
                    waits.push(Some(f.clone()));
                    continue;
                }
                self.traced(key, Outcome::Miss);
                misses.push(index);
                let f = match ds.source.prepared() {
                    // Placed below, once every miss of the call is known.
                    Some(_) => None,
                    None => {
                        let task = tokio::spawn(self.clone().fetch(ds.clone(), index));
                        let f = async move {
                            task.await.unwrap_or_else(|e| {
                                Err(Arc::new(anyhow!("fetch task failed: {e}")))
                            })
                        }
                        .boxed()
                        .shared();
                        inflight.insert(key, f.clone());
                        Some(f)
                    }
                };
                waits.push(f);
            }
            if ds.source.prepared().is_some() && !misses.is_empty() {
                // One task for the call's misses; each miss's fetch is its part of it.
                let task = tokio::spawn(self.clone().fetch_prepared(ds.clone(), misses.clone()));
                let batch = async move {
                    task.await
                        .unwrap_or_else(|e| Err(Arc::new(anyhow!("fetch task failed: {e}"))))
                }
                .boxed()
                .shared();
                for &index in &misses {
                    let f = batch
                        .clone()
                        .map(move |b: Batched| match b {
                            Ok(m) => m.get(&index).cloned().unwrap_or_else(|| {
                                Err(Arc::new(anyhow!("sample {index} not fetched")))
                            }),
                            Err(e) => Err(e),
                        })
                        .boxed()
                        .shared();
                    inflight.insert((ds.id, index), f);
                }
                for (k, &index) in indices.iter().enumerate() {
                    if ready[k].is_none() && waits[k].is_none() {
                        waits[k] = inflight.get(&(ds.id, index)).cloned();
                    }
                }
            }
        }
        let mut out = Vec::with_capacity(indices.len());
        for (k, wait) in waits.into_iter().enumerate() {
            let got = match wait {
                // The shared error, as an error of the same kind for this caller.
                Some(f) => f.await.map_err(|e| {
                    anyhow::Error::from(Error::new(Error::kind_of(&e), format!("{e:#}")))
                })?,
                None => ready[k].take().expect("ready or waited for"),
            };
            out.push(got);
        }
        Ok(out)
    }

    /// Samples `misses` of `ds` (a dataset a reader prepares): those in the scratch tier read
    /// from it (one job on the pool), the rest asked of the reader in one request (whole
    /// granules where the scratch tier takes them, so a shuffled epoch reads each granule
    /// once), awaited here; then placed: every record read written to the scratch tier, the
    /// asked ones offered to the memory tier, the bad ones marked.
    async fn fetch_prepared(self: Arc<Self>, ds: Arc<Dataset>, misses: Vec<u64>) -> Batched {
        /// Takes the misses out of `inflight` however the fetch ends (a panic included), after
        /// the memory tier has them.
        struct Done<'a>(&'a Store, u32, &'a [u64]);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                let mut inflight = self.0.inflight.locked();
                for &i in self.2 {
                    inflight.remove(&(self.1, i));
                }
            }
        }
        let _done = Done(&self, ds.id, &misses);
        let mut out: HashMap<u64, SampleResult> = HashMap::with_capacity(misses.len());
        let scratch = self.scratch_of(&ds);
        let mut rest = misses.clone();
        if let Some(s) = scratch.clone() {
            let held: Vec<u64> = rest.iter().copied().filter(|&i| s.contains(i)).collect();
            if !held.is_empty() {
                let read = self
                    .workers
                    .run_for(tenant(&ds), move || {
                        held.into_iter().map(|i| (i, s.read(i))).collect::<Vec<_>>()
                    })
                    .await
                    .map_err(Arc::new)?;
                for (i, data) in read {
                    // A corrupt record (counted) is read again from the reader below.
                    if let Some(data) = data {
                        let n = data.len() as u64;
                        self.record_hit(&ds, Tier::Scratch, n);
                        self.memory
                            .insert((ds.id, i), data.clone(), ds.source.disk_bytes_of(i));
                        out.insert(i, Ok(Some((data, Tier::Scratch))));
                    }
                }
                rest.retain(|i| !out.contains_key(i));
            }
        }
        if rest.is_empty() {
            return Ok(Arc::new(out));
        }
        let ranges = ranges_for(&ds, scratch.as_deref(), &rest);
        let wanted: std::collections::HashSet<u64> = rest.iter().copied().collect();
        // A range another call is reading already (a granule its misses are in too) is waited
        // for, not read again; the rest in loads of at most LOAD_SAMPLES samples (a larger
        // granule alone), each read as a task of its own and shared while it runs.
        // Looked up and registered under one hold of the lock: two calls missing the same
        // granule at once read it once.
        let (mut parts, mut fresh) = (vec![], vec![]);
        {
            let mut reading = self.reading.locked();
            for &r in &ranges {
                match reading.get(&(ds.id, r)) {
                    Some(f) if !parts.iter().any(|(g, _): &(Read, bool)| g.ptr_eq(f)) => {
                        parts.push((f.clone(), false))
                    }
                    Some(_) => {}
                    None => fresh.push(r),
                }
            }
            for part in chunks(&fresh, LOAD_SAMPLES) {
                let read = self.read_part(&ds, scratch.clone(), part.clone());
                for &r in &part {
                    reading.insert((ds.id, r), read.clone());
                }
                parts.push((read, true));
            }
        }
        for (read, ours) in parts {
            let part = read.await?;
            if ours {
                self.record_raw(&ds, part.raw_bytes, &part.records, &wanted);
            }
            for (i, record) in &part.records {
                if !wanted.contains(i) || out.contains_key(i) {
                    continue;
                }
                let got = match record {
                    Ok(data) => {
                        self.memory
                            .insert((ds.id, *i), data.clone(), ds.source.disk_bytes_of(*i));
                        // Read by another call's request: as a scratch hit would have been.
                        if !ours {
                            self.record_hit(&ds, Tier::Scratch, data.len() as u64);
                        }
                        Ok(Some((
                            data.clone(),
                            if ours { Tier::Raw } else { Tier::Scratch },
                        )))
                    }
                    // The sample's own files failed: skipped, or the stream's error.
                    Err(bad) if ds.skips(bad) => {
                        ds.mark_bad(*i, bad);
                        Ok(None)
                    }
                    Err(e) => Err(Arc::new(sample_error(e).into())),
                };
                out.insert(*i, got);
            }
        }
        Ok(Arc::new(out))
    }

    /// Samples of `part` of `ds` read from its reader as a task of its own, to be shared
    /// (the caller registers it under `reading`, whose lock it holds; the task lets the ranges
    /// go when it ends): its records written to `scratch` (on the pool) before it is done, what
    /// holding them is charged kept until then.
    fn read_part(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        scratch: Option<Arc<ScratchTier>>,
        part: Vec<(u64, u64)>,
    ) -> Read {
        let (store, ds2, ranges) = (self.clone(), ds.clone(), part.clone());
        let task = tokio::spawn(async move {
            /// Lets the part's ranges go from `reading` however the read ends.
            struct Done<'a>(&'a Store, u32, &'a [(u64, u64)]);
            impl Drop for Done<'_> {
                fn drop(&mut self) {
                    let mut reading = self.0.reading.locked();
                    for &r in self.2 {
                        reading.remove(&(self.1, r));
                    }
                }
            }
            let _done = Done(&store, ds2.id, &ranges);
            let loaded = ds2
                .load_prepared(&ranges)
                .await
                .map_err(|e| Arc::new(anyhow::Error::from(sample_error(&e))))?;
            let records: Vec<(u64, Result<Bytes, Arc<anyhow::Error>>)> = ranges
                .iter()
                .flat_map(|&(s, c)| s..s + c)
                .zip(loaded.records)
                .map(|(i, r)| (i, r.map(Bytes::from).map_err(Arc::new)))
                .collect();
            // Every record read to the scratch tier (a granule's other samples are scratch
            // hits when their turn comes); what holding them is charged lasts until then.
            if let Some(scratch) = scratch {
                let written: Vec<(u64, Bytes)> = records
                    .iter()
                    .filter_map(|(i, r)| Some((*i, r.as_ref().ok()?.clone())))
                    .collect();
                let held = loaded.held;
                let _ = store
                    .workers
                    .run_for(tenant(&ds2), move || {
                        for (i, d) in written {
                            if !scratch.contains(i) && !scratch.write(i, &d) {
                                break; // the budget or the disk is full
                            }
                        }
                        drop(held);
                    })
                    .await;
            }
            Ok(Arc::new(Part {
                records,
                raw_bytes: loaded.raw_bytes,
            }))
        });
        let read: Read = async move {
            task.await
                .unwrap_or_else(|e| Err(Arc::new(anyhow!("a reader's read failed: {e}"))))
        }
        .boxed()
        .shared();
        read
    }

    /// Counts the raw bytes of a part read for `ds` against the samples of it a stream asked
    /// for (`wanted`), spread evenly.
    fn record_raw(
        &self,
        ds: &Dataset,
        raw_bytes: u64,
        records: &[(u64, Result<Bytes, Arc<anyhow::Error>>)],
        wanted: &std::collections::HashSet<u64>,
    ) {
        let asked: Vec<&(u64, _)> = records
            .iter()
            .filter(|(i, r)| wanted.contains(i) && r.is_ok())
            .collect();
        let share = raw_bytes / asked.len().max(1) as u64;
        for _ in asked {
            self.record_hit(ds, Tier::Raw, share);
        }
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
        self.inflight.locked().remove(&key);
        result
    }

    /// The sample through the scratch and raw tiers, on the worker pool (a dataset read in
    /// this process). The outer error is the daemon's (the pool); the inner one the sample's
    /// (its files do not read or decode).
    async fn load(
        self: &Arc<Self>,
        ds: &Arc<Dataset>,
        index: u64,
    ) -> Result<Result<(Bytes, Tier, u64)>> {
        let (ds, locks, scratch) = (ds.clone(), self.granule_locks.clone(), self.scratch_of(ds));
        self.workers
            .run_for(tenant(&ds), move || {
                load_blocking(&ds, scratch.as_deref(), &locks, index)
            })
            .await
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
        let loaded = ds.load_prepared(&[(start, count)]).await?;
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
            let mut started = self.prefetches.locked();
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
    locks[stripe].locked()
}

/// The most samples one request to a reader asks for (a granule larger than that alone).
const LOAD_SAMPLES: u64 = 1024;

/// `ranges` in parts of at most `most` samples each (a larger range alone).
fn chunks(ranges: &[(u64, u64)], most: u64) -> Vec<Vec<(u64, u64)>> {
    let mut out: Vec<Vec<(u64, u64)>> = vec![];
    let mut held = 0;
    for &r in ranges {
        match out.last_mut() {
            Some(part) if held + r.1 <= most => {
                part.push(r);
                held += r.1;
            }
            _ => {
                out.push(vec![r]);
                held = r.1;
            }
        }
    }
    out
}

/// The ranges of samples to ask a reader for, for the misses `rest` (sorted or not) of `ds`:
/// the whole granules they are in where the scratch tier takes the others, else the misses
/// alone (runs of neighbours as one range).
fn ranges_for(ds: &Dataset, scratch: Option<&ScratchTier>, rest: &[u64]) -> Vec<(u64, u64)> {
    let granule = ds.source.read_granule().max(1);
    let whole = granule > 1 && scratch.is_some_and(|s| rest.iter().all(|&i| s.accepts_writes(i)));
    let mut starts: Vec<(u64, u64)> = rest
        .iter()
        .map(|&i| match whole {
            true => {
                let start = i / granule * granule;
                (start, granule.min(ds.len() - start))
            }
            false => (i, 1),
        })
        .collect();
    starts.sort_unstable();
    starts.dedup();
    let mut ranges: Vec<(u64, u64)> = vec![];
    for (start, count) in starts {
        match ranges.last_mut() {
            Some((s, c)) if *s + *c == start => *c += count,
            _ => ranges.push((start, count)),
        }
    }
    ranges
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_are_parts_of_at_most_so_many_samples() {
        let parts = chunks(&[(0, 3), (5, 2), (9, 10), (30, 1)], 5);
        assert_eq!(
            parts,
            vec![vec![(0, 3), (5, 2)], vec![(9, 10)], vec![(30, 1)]]
        );
        let parts = chunks(&[(0, 1), (2, 1), (4, 1), (6, 4)], 3);
        assert_eq!(parts, vec![vec![(0, 1), (2, 1), (4, 1)], vec![(6, 4)]]);
    }
}
