//! The datasets the daemon serves, opened from the config.

use crate::access::{Grant, Guard};
use crate::config::{DatasetConfig, Limits, OnError, TrainCrop};
use crate::error::Kind;
use crate::fields::Schema;
use crate::fingerprint::{fingerprint, Fingerprint};
use crate::pipeline::{Crop, Pipeline, Preprocess, Spatial};
use crate::source::{Format, RawSample, Source};
use crate::sync::Locked;
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};

pub struct Dataset {
    /// Small integer id used in cache keys.
    pub id: u32,
    pub name: String,
    /// The kind of its source ("hdf5", "images", ...).
    pub kind: &'static str,
    pub source: Box<dyn Source>,
    pub preprocess: Preprocess,
    /// The fields of every sample: what preprocessing makes and the tiers keep.
    pub schema: Schema,
    /// The fields streams serve: the eval and the train pipeline cut samples to these shapes.
    pub served: Schema,
    /// How a stream's samples are cut from the stored ones: the eval pipeline (None: served as
    /// stored) and the train one (None: the dataset has none).
    pub eval: Option<Pipeline>,
    pub train: Option<Pipeline>,
    /// What a sample that fails to read or decode does to a stream.
    pub on_error: OnError,
    /// What one sample may cost (pixels, bytes); over them it is a bad sample.
    pub limits: Limits,
    /// Who may have it besides those who can read its files (see `access`).
    pub guard: Guard,
    /// The user who added it (`larder add`), whose rights its files are read with; None for
    /// the config's datasets.
    pub owner: Option<u32>,
    /// Samples that failed to read or decode (skipped), by index: why, the file named.
    bad: Mutex<BTreeMap<u64, String>>,
    /// Its lookups and the bytes read for them, by the tier that served them (memory, scratch,
    /// raw), since it was opened.
    pub lookups: crate::metrics::TierCounters,
    /// What it takes of the daemon's memory outside the cache (its scratch tier's index),
    /// charged to its owner (the config, for the config's).
    pub charges: Vec<crate::footprint::Charge>,
}

/// A stream's choice of pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipelineKind {
    Eval,
    Train,
}

impl Dataset {
    pub fn new(
        id: u32,
        name: &str,
        source: Box<dyn Source>,
        preprocess: Preprocess,
        schema: Schema,
    ) -> Dataset {
        Dataset {
            id,
            name: name.to_string(),
            kind: "",
            source,
            preprocess,
            served: schema.clone(),
            schema,
            eval: None,
            train: None,
            on_error: OnError::Skip,
            limits: Limits::default(),
            guard: Guard {
                allow: vec![],
                tcp: false,
            },
            owner: None,
            bad: Mutex::new(BTreeMap::new()),
            lookups: Default::default(),
            charges: vec![],
        }
    }

    /// The dataset with these pipelines (which must serve the same shapes).
    pub fn with_pipelines(
        mut self,
        eval: Option<Pipeline>,
        train: Option<Pipeline>,
    ) -> Result<Dataset> {
        if let Some(p) = &eval {
            self.served = p.served(&self.schema)?;
        }
        if let Some(t) = &train {
            let served = t.served(&self.schema)?;
            ensure!(
                served == self.served,
                "the train pipeline serves {}, the eval one {}",
                served.describe(),
                self.served.describe()
            );
        }
        (self.eval, self.train) = (eval, train);
        Ok(self)
    }

    /// The pipeline a stream asked for (None: samples as stored).
    pub fn pipeline(&self, kind: PipelineKind) -> Result<Option<&Pipeline>, String> {
        match kind {
            PipelineKind::Eval => Ok(self.eval.as_ref()),
            PipelineKind::Train => match &self.train {
                Some(t) => Ok(Some(t)),
                None => Err(format!(
                    "dataset {:?} has no train pipeline: add a [dataset.train] table to its config (random crops and flips), or ask for pipeline \"eval\"",
                    self.name
                )),
            },
        }
    }

    /// Records sample `index` as bad; true the first time (when it is logged).
    pub fn mark_bad(&self, index: u64, why: &anyhow::Error) -> bool {
        let mut bad = self.bad.locked();
        if bad.contains_key(&index) {
            return false;
        }
        let why = format!("{why:#}");
        tracing::warn!(dataset = %self.name, sample = index, "skipping a sample that does not read or decode: {why}");
        bad.insert(index, why);
        true
    }

    pub fn is_bad(&self, index: u64) -> bool {
        self.bad.locked().contains_key(&index)
    }

    /// How many samples have been skipped so far.
    pub fn bad_count(&self) -> u64 {
        self.bad.locked().len() as u64
    }

    /// The samples skipped so far: (index, why).
    pub fn bad_samples(&self) -> Vec<(u64, String)> {
        let bad = self.bad.locked();
        bad.iter().map(|(&i, w)| (i, w.clone())).collect()
    }

    /// Identifies the raw data, its preprocessing and the fields: scratch shards of another
    /// fingerprint are out of date.
    ///
    /// A user's dataset's fingerprint holds their uid: two users who add the same files keep
    /// scratch shards apart (one may be able to list a folder whose files only the other can
    /// read; the shards would hand the second what only the first could read).
    pub fn fingerprint(&self) -> Fingerprint {
        let owner = self.owner.map(|uid| uid.to_le_bytes());
        let (version, preprocess, schema) = (
            self.source.version(),
            self.preprocess.describe(),
            self.schema.describe(),
        );
        let mut parts: Vec<&[u8]> =
            vec![version.as_bytes(), preprocess.as_bytes(), schema.as_bytes()];
        let len = self.len().to_le_bytes();
        parts.push(&len);
        if let Some(o) = &owner {
            parts.push(o);
        }
        fingerprint(&parts)
    }

    pub fn len(&self) -> u64 {
        self.source.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Preprocesses the raw fields of sample `index` into its record (blocking). A sample
    /// whose files or record are over `limits.max_sample_bytes` is an error (a bad sample).
    pub fn prepare(&self, index: u64, raw: RawSample) -> Result<Vec<u8>> {
        crate::pipeline::prepare(&self.preprocess, &self.schema, &self.limits, raw).with_context(
            || {
                format!(
                    "preprocessing {} of dataset {:?}",
                    self.source.sample_name(index),
                    self.name
                )
            },
        )
    }

    /// Samples `start..start + count` from raw storage (`source::read_each`: the range, else
    /// one by one), each prepared (its record, or why not), with the raw bytes read (blocking:
    /// a source read in this process; a reader's samples are awaited through
    /// `source.prepared()`). Err: a reader failed.
    pub fn load_range(&self, start: u64, count: u64) -> Result<crate::source::Loaded> {
        let raw = crate::source::read_each(self.source.as_ref(), start, count)?;
        let raw_bytes = raw
            .iter()
            .filter_map(|(_, r)| r.as_ref().ok())
            .map(crate::fields::raw_bytes)
            .sum();
        let records = raw
            .into_iter()
            .map(|(i, r)| {
                r.with_context(|| {
                    format!(
                        "reading {} of dataset {:?}",
                        self.source.sample_name(i),
                        self.name
                    )
                })
                .and_then(|r| self.prepare(i, r))
            })
            .collect();
        Ok(crate::source::Loaded {
            records,
            raw_bytes,
            held: vec![],
        })
    }

    /// Sample `index` from raw storage, prepared, with the raw bytes read (blocking, as
    /// `load_range`).
    pub fn load(&self, index: u64) -> Result<(Vec<u8>, u64)> {
        let raw = self.source.read(index).with_context(|| {
            format!(
                "reading {} of dataset {:?}",
                self.source.sample_name(index),
                self.name
            )
        })?;
        let bytes = crate::fields::raw_bytes(&raw);
        Ok((self.prepare(index, raw)?, bytes))
    }

    /// Samples of `ranges` (start, count) from the reader that prepares them (a dataset whose
    /// source is `prepared`), awaited: each its record or why not (the sample's failure named
    /// with the dataset), in order, with the raw bytes read.
    pub async fn load_prepared(&self, ranges: &[(u64, u64)]) -> Result<crate::source::Loaded> {
        let p = self
            .source
            .prepared()
            .context("a dataset read in the daemon awaited as one a reader prepares")?;
        let mut loaded = p.load(ranges).await?;
        let name = &self.name;
        loaded.records = std::mem::take(&mut loaded.records)
            .into_iter()
            .map(|r| r.with_context(|| format!("dataset {name:?}")))
            .collect();
        Ok(loaded)
    }

    /// Whether a sample that failed with `e` is skipped (else the stream fails): under
    /// `on_error = "skip"`, unless the dataset's files changed under the daemon (then no
    /// sample is to blame, and the stream says so).
    pub fn skips(&self, e: &anyhow::Error) -> bool {
        self.on_error == OnError::Skip
            && !matches!(
                crate::error::Error::kind_of(e),
                Kind::Changed | Kind::Reader
            )
    }

    /// Bytes of a record: exact when every field is fixed, else the raw data's average size
    /// (a guess, for sizing scratch shards).
    pub fn record_bytes_estimate(&self) -> u64 {
        self.schema
            .fixed_record_bytes()
            .unwrap_or_else(|| self.source.disk_bytes() / self.len().max(1))
            .max(1)
    }

    pub fn info(&self) -> crate::proto::DatasetInfo {
        let first = &self.served.fields[0];
        let fields = self
            .served
            .fields
            .iter()
            .map(|f| crate::proto::FieldInfo {
                name: f.name.clone(),
                dtype: f.dtype.name().to_string(),
                shape: f.shape_i64(),
                paired_with: f.pair.as_ref().map(|p| p.with.clone()).unwrap_or_default(),
                scale: f.pair.as_ref().map_or(0, |p| p.scale),
                resample: f.resample.name().to_string(),
            })
            .collect();
        crate::proto::DatasetInfo {
            name: self.name.clone(),
            num_samples: self.len(),
            sample_shape: first.shape.iter().map(|d| d.unwrap_or(0)).collect(),
            has_labels: self.served.field("label").is_some(),
            source: self.source.describe(),
            sample_bytes: self.served.fixed_record_bytes().unwrap_or(0),
            fields,
            has_train_pipeline: self.train.is_some(),
            bad_samples: self.bad_count(),
            owner: self
                .owner
                .map(|uid| crate::access::name_of_user(uid).unwrap_or_else(|| uid.to_string()))
                .unwrap_or_default(),
            kind: self.kind.to_string(),
        }
    }
}

/// The datasets served, changing while the daemon runs: a config reloaded adds, removes and
/// reopens datasets; one that did not open is tried again; one whose files changed is opened
/// again. Streams hold the `Arc<Dataset>` they started with, so a dataset removed or replaced
/// finishes its open streams as it was.
#[derive(Default)]
pub struct Catalog {
    state: RwLock<State>,
    /// The id the next dataset opened gets: never reused, so the tiers never mix an old
    /// version's samples with a new one's (their keys hold the id).
    next_id: AtomicU32,
}

#[derive(Default)]
struct State {
    /// The datasets served, by name.
    served: BTreeMap<String, Served>,
    /// The datasets of the config that do not open, by name (the others are served).
    failed: BTreeMap<String, Failed>,
    /// Versions of datasets whose files changed that streams still read, by name: the file
    /// is opened again only once they are gone, because HDF5 shares one open file (its caches
    /// included) between every open of the same inode, and a fresh open is what checks that
    /// the file is whole.
    closing: BTreeMap<String, std::sync::Weak<Dataset>>,
    /// The datasets of the config not tried yet (the daemon listens before it opens them).
    opening: std::collections::BTreeSet<String>,
    /// Files found so far by the open of each dataset being opened now.
    progress: BTreeMap<String, Arc<std::sync::atomic::AtomicU64>>,
    /// The opens running now, by name: no other reconcile opens the same dataset meanwhile,
    /// and what waits for one subscribes (it is done when the sender is dropped).
    running: BTreeMap<String, tokio::sync::watch::Sender<()>>,
}

/// A dataset to open: planned under the catalog's lock, opened outside it (it may take a
/// reader seconds, or a walk of a large folder), and published under it again.
#[derive(Clone)]
pub struct Job {
    pub config: DatasetConfig,
    /// Its table as text (a reload that changes it reopens it).
    text: String,
    /// Why it is opened again, if it was served.
    why: String,
    pub id: u32,
    /// Files its open has found so far.
    pub found: Arc<std::sync::atomic::AtomicU64>,
}

struct Served {
    dataset: Arc<Dataset>,
    /// The table it was opened from, as text: a reload that changes it reopens it.
    config: String,
}

struct Failed {
    /// Why it is not served: the error of its last open.
    why: String,
}

/// What a reconcile did: the datasets opened (new, or replacing `replaced`), and those gone.
#[derive(Default)]
pub struct Changes {
    pub opened: Vec<Arc<Dataset>>,
    /// Ids of datasets replaced or removed: their scratch tiers are to be let go.
    pub dropped: Vec<u32>,
}

impl Catalog {
    /// Plans bringing the datasets served in line with `configs`: stops serving those no longer
    /// listed (in the changes returned), and returns the datasets to open: new ones, those that
    /// failed before, those whose table or files changed. Each is marked running until it is
    /// published, so no other reconcile opens it meanwhile. Quick: it opens nothing.
    pub fn plan(&self, configs: &[DatasetConfig]) -> (Changes, Vec<Job>) {
        let mut changes = Changes::default();
        let mut jobs = vec![];
        let wanted: BTreeMap<&str, &DatasetConfig> =
            configs.iter().map(|c| (c.name.as_str(), c)).collect();
        {
            let mut state = self.write();
            let gone: Vec<String> = state
                .served
                .keys()
                .filter(|n| !wanted.contains_key(n.as_str()))
                .cloned()
                .collect();
            for name in gone {
                let s = state.served.remove(&name).expect("listed");
                tracing::info!(dataset = %name, "no longer in the config: not served to new streams");
                changes.dropped.push(s.dataset.id);
            }
            state.failed.retain(|n, _| wanted.contains_key(n.as_str()));
            state.opening.retain(|n| wanted.contains_key(n.as_str()));
        }
        for c in configs {
            let text = format!("{c:?}");
            let stale = {
                let state = self.read();
                if state.running.contains_key(&c.name) {
                    continue;
                }
                match state.served.get(&c.name) {
                    Some(s) if s.config != text => {
                        Some("its table in the config changed".to_string())
                    }
                    Some(s) => s.dataset.source.changed(),
                    None => Some(String::new()),
                }
            };
            let Some(why) = stale else {
                continue;
            };
            if !self.closed(c, &mut changes) {
                continue;
            }
            let mut state = self.write();
            if state.running.contains_key(&c.name) {
                continue;
            }
            let found = Arc::new(std::sync::atomic::AtomicU64::new(0));
            state.progress.insert(c.name.clone(), found.clone());
            state
                .running
                .insert(c.name.clone(), tokio::sync::watch::channel(()).0);
            jobs.push(Job {
                config: c.clone(),
                text,
                why,
                id: self.next_id.fetch_add(1, Ordering::Relaxed),
                found,
            });
        }
        (changes, jobs)
    }

    /// Serves what the open of `job` gave (or records why it did not open), and lets what
    /// waits for it go on: the changes to the datasets served.
    pub fn publish(&self, job: Job, opened: Result<Dataset>) -> Changes {
        let mut changes = Changes::default();
        let c = &job.config;
        let mut state = self.write();
        state.progress.remove(&c.name);
        state.running.remove(&c.name);
        match opened {
            Ok(ds) => {
                if !job.why.is_empty() {
                    tracing::info!(dataset = %c.name, "opened again: {}", job.why);
                }
                let ds = Arc::new(ds);
                state.failed.remove(&c.name);
                state.opening.remove(&c.name);
                let old = state.served.insert(
                    c.name.clone(),
                    Served {
                        dataset: ds.clone(),
                        config: job.text,
                    },
                );
                changes.dropped.extend(old.map(|o| o.dataset.id));
                changes.opened.push(ds);
            }
            Err(e) => {
                let why = format!("{e:#}");
                let before = state.failed.get(&c.name).map(|f| f.why.clone());
                if before.as_deref() != Some(why.as_str()) {
                    tracing::error!(dataset = %c.name, "not serving the dataset: it does not open: {why}");
                }
                state.opening.remove(&c.name);
                if let Some(old) = state.served.remove(&c.name) {
                    changes.dropped.push(old.dataset.id);
                }
                state.failed.insert(c.name.clone(), Failed { why });
            }
        }
        changes
    }

    /// Waits until no dataset `wanted` names is being opened.
    pub async fn opened(&self, wanted: impl Fn(&str) -> bool) {
        let waits: Vec<_> = self
            .read()
            .running
            .iter()
            .filter(|(n, _)| wanted(n))
            .map(|(_, tx)| tx.subscribe())
            .collect();
        for mut rx in waits {
            // Err once the sender is dropped: the open is published.
            while rx.changed().await.is_ok() {}
        }
    }

    /// Whether dataset `name` may be opened now: no version of it whose files changed is
    /// still read. A served one whose files changed is taken out of service (new streams wait
    /// for it to open again) and, while streams still hold it, left to close.
    fn closed(&self, c: &DatasetConfig, changes: &mut Changes) -> bool {
        let name = c.name.as_str();
        let mut state = self.write();
        let changed = state
            .served
            .get(name)
            .is_some_and(|s| s.dataset.source.changed().is_some());
        if changed {
            let old = state.served.remove(name).expect("served");
            changes.dropped.push(old.dataset.id);
            state
                .closing
                .insert(name.to_string(), Arc::downgrade(&old.dataset));
            drop(old);
        }
        let open = state
            .closing
            .get(name)
            .is_some_and(|w| w.strong_count() > 0);
        if open {
            let why = "its files changed; it opens again once the streams still reading the \
                       old version end"
                .to_string();
            state.failed.insert(name.to_string(), Failed { why });
            return false;
        }
        state.closing.remove(name);
        true
    }

    /// Notes the datasets of `configs` as being opened: until a reconcile has tried them,
    /// their streams get UNAVAILABLE rather than NOT_FOUND.
    pub fn expect(&self, configs: &[DatasetConfig]) {
        let mut state = self.write();
        for c in configs {
            if !state.served.contains_key(&c.name) {
                state.opening.insert(c.name.clone());
            }
        }
    }

    /// Whether dataset `name` of the config is still to be opened for the first time, and if
    /// so how many files its open has found so far.
    pub fn opening(&self, name: &str) -> Option<u64> {
        let state = self.read();
        state.opening.contains(name).then(|| {
            state
                .progress
                .get(name)
                .map_or(0, |f| f.load(Ordering::Relaxed))
        })
    }

    /// The config's datasets not served now, with why: being opened, or the error of their
    /// last open.
    pub fn unavailable(&self) -> Vec<(String, String)> {
        let state = self.read();
        let opening = state.opening.iter().map(|n| {
            let found = state.progress.get(n).map(|f| f.load(Ordering::Relaxed));
            let why = match found {
                Some(k) if k > 0 => format!("being opened ({k} files found so far)"),
                _ => "being opened".to_string(),
            };
            (n.clone(), why)
        });
        let failed = state.failed.iter().map(|(n, f)| (n.clone(), f.why.clone()));
        opening.chain(failed).collect()
    }

    /// Why dataset `name` of the config is not served, if it did not open.
    pub fn failed(&self, name: &str) -> Option<String> {
        self.read().failed.get(name).map(|f| f.why.clone())
    }

    pub fn get(&self, name: &str) -> Option<Arc<Dataset>> {
        self.read().served.get(name).map(|s| s.dataset.clone())
    }

    /// The datasets served now.
    pub fn all(&self) -> Vec<Arc<Dataset>> {
        self.read()
            .served
            .values()
            .map(|s| s.dataset.clone())
            .collect()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// What an open needs beside the dataset's table: the limits, the account its memory is
/// charged to, and whether the store keeps a scratch tier (whose index it charges).
#[derive(Clone)]
pub struct OpenWith {
    pub limits: Limits,
    pub account: Arc<crate::footprint::Footprint>,
    pub scratch: bool,
}

/// Bytes of the scratch tier's index for each sample.
const SCRATCH_INDEX_BYTES: u64 = 8;

/// Opens the dataset of `job` (outside the catalog's lock): in a reader when a launcher runs
/// (as its owner, or as `reader_user` for the config's), else in this process on a blocking
/// thread (a user's with their rights on the reading thread: see `source::open`). What it
/// takes of the daemon's memory is charged to its owner (the config, for the config's) before
/// it is allocated: over their share, it does not open, and says why.
pub async fn open_dataset(job: &Job, with: &OpenWith) -> Result<Dataset> {
    let (id, c, limits) = (job.id, &job.config, with.limits);
    let payer = crate::footprint::Payer::of_uid(c.owner);
    let found = job.found.clone();
    let remote = match (
        crate::privsep::launcher(),
        crate::source::owner_identity(c.owner),
        crate::privsep::config_reader(),
    ) {
        (Some(launcher), Some(id), _) => Some((launcher, id.as_ref().into())),
        (Some(launcher), None, Some(reader)) => Some((launcher, reader.clone())),
        _ => None,
    };
    let opened = match remote {
        Some((launcher, user)) => {
            // Two of a user's datasets open at once (a reader each): a user adding many at
            // once waits for their own.
            static OPENS: std::sync::OnceLock<crate::turns::Turns> = std::sync::OnceLock::new();
            let _turn = OPENS
                .get_or_init(|| crate::turns::Turns::new(2))
                .take(user.uid as u64)
                .await;
            let charge_to = (&with.account, payer);
            crate::privsep::remote::open(launcher, user, c, &limits, found, charge_to).await?
        }
        None => {
            let c = c.clone();
            tokio::task::spawn_blocking(move || {
                // A panic in a source's open (a parser's bug on a file a user wrote) is that
                // dataset's failure, not every dataset's after it.
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    crate::source::with_progress(&found, || crate::source::open(&c, &limits))
                }))
                .unwrap_or_else(|_| {
                    Err(anyhow::anyhow!("opening it failed (a panic; see the log)"))
                })
            })
            .await
            .context("opening it failed")??
        }
    };
    // A file can claim any shape: one whose every sample is over the limit would have each
    // read allocate it (HDF5 reads into a buffer of the claimed size) and fail.
    if let Some(bytes) = opened.schema.fixed_record_bytes() {
        ensure!(
            bytes <= limits.max_sample_bytes,
            "its samples ({}) take {bytes} bytes each, over the {} a sample may \
             (limits.max_sample_bytes)",
            opened.schema.describe(),
            limits.max_sample_bytes
        );
    }
    let mut dataset = Dataset::new(id, &c.name, opened.source, opened.preprocess, opened.schema);
    if with.scratch {
        let n = dataset.len();
        let what = format!(
            "dataset {:?}: the scratch tier's index of its {n} samples",
            c.name
        );
        let bytes = n.saturating_mul(SCRATCH_INDEX_BYTES);
        dataset
            .charges
            .push(with.account.charge(payer, bytes, &what)?);
    }
    dataset.kind = opened.format.name();
    dataset.on_error = c.on_error;
    dataset.limits = limits;
    let mut allow: Vec<Grant> = c
        .allow
        .iter()
        .map(|g| Grant::parse(g))
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("allow: {e}"))?;
    // A dataset a user added is theirs; `allow` is whom else they share it with.
    allow.extend(c.owner.map(Grant::User));
    dataset.guard = Guard { allow, tcp: c.tcp };
    dataset.owner = c.owner;
    let (eval, train) = pipelines(c, opened.format, &dataset.schema)?;
    dataset.with_pipelines(eval, train)
}

/// The eval and train pipelines the config asks for, on the stored fields `stored`: the box is
/// drawn in the first field with H and W (an image folder's first image) and applied to the
/// fields paired with it.
fn pipelines(
    c: &DatasetConfig,
    format: &dyn Format,
    stored: &Schema,
) -> Result<(Option<Pipeline>, Option<Pipeline>)> {
    let size = c.crop_size(format.default_crop()).map(|s| (s, s));
    if size.is_none() && c.train.is_none() {
        return Ok((None, None));
    }
    let (reference, spec) = stored
        .fields
        .iter()
        .enumerate()
        .find(|(_, f)| f.shape.len() >= 2)
        .context("crop and [dataset.train] need a field with H and W (at least 2 dims); this dataset has none")?;
    let mut spatial = vec![None; stored.fields.len()];
    for (i, f) in stored.fields.iter().enumerate() {
        let scale = match &f.pair {
            _ if i == reference => 1,
            Some(p) if p.with == spec.name => p.scale,
            Some(p) => bail!(
                "field {:?} pairs with {:?}; crops are drawn in {:?}, so pair fields with it",
                f.name,
                p.with,
                spec.name
            ),
            None => continue,
        };
        spatial[i] = Some(Spatial {
            scale,
            resample: f.resample,
        });
    }
    let eval = size.map(|size| Pipeline {
        crop: Crop::Center,
        flip: false,
        size: Some(size),
        spatial: spatial.clone(),
        reference,
    });
    let train = c.train.as_ref().map(|t| Pipeline {
        crop: match t.crop.unwrap_or(format.default_train_crop()) {
            TrainCrop::RandomResized => Crop::RandomResized {
                scale: (t.scale[0], t.scale[1]),
                ratio: (t.ratio[0], t.ratio[1]),
            },
            TrainCrop::Random => Crop::Random { padding: t.padding },
        },
        flip: t.flip,
        size,
        spatial,
        reference,
    });
    Ok((eval, train))
}
