//! Raw storage: where samples come from before preprocessing. A source reads a sample's raw
//! fields, one value each (an array as stored, or an encoded image file).
//!
//! Each kind of source is a [`Format`] in a file of its own, listed once in [`FORMATS`]: its
//! name, how it recognises a path, the keys of its table, its defaults and its open. Nothing
//! else in the daemon names a kind.

mod blob;
mod files;
mod hdf5;
mod hf;
mod images;
mod lmdb;
mod npy;
mod owner;
mod parquet;
pub mod walk;
mod webdataset;

pub use self::blob::Blob;
pub use self::files::{file_version, file_version_of, read_capped, Stamp};
pub use self::hdf5::{write_hdf5, Hdf5Field, Hdf5Source, MAX_GRANULE};
pub use self::images::{ImageField, ImageFolderSource};

use crate::config::keys::keys_of;
use crate::config::{Config, DatasetConfig, FieldConfig, Limits, TrainCrop};
use crate::fields::Schema;
use crate::pipeline::Preprocess;
use anyhow::{bail, ensure, Context, Result};
use serde::de::DeserializeOwned;
use std::path::Path;

/// Every kind of source the daemon reads, in the order a path is offered to them.
pub static FORMATS: &[&dyn Format] = &[
    &npy::Npy,
    &hf::Hf,
    &parquet::Parquet,
    &webdataset::WebDataset,
    &lmdb::Lmdb,
    &images::Images,
    &hdf5::Hdf5,
];

/// A kind of source: what a `[[dataset]]` table with `kind = NAME` is read by.
pub trait Format: Sync {
    /// Its name in `kind = "..."`.
    fn name(&self) -> &'static str;
    /// Whether `path` is a dataset of this kind by its shape alone (a folder, a file's
    /// extension or first bytes), looked at with the caller's rights.
    fn recognizes(&self, path: &Path) -> bool;
    /// The keys a `[[dataset]]` table of this kind may hold beyond those every kind reads.
    fn dataset_keys(&self) -> Vec<&'static str>;
    /// The keys its `[[dataset.field]]` tables may hold beyond those every kind reads.
    fn field_keys(&self) -> Vec<&'static str>;
    /// Checks the table's keys of this kind and the rules this kind adds.
    fn check(&self, c: &DatasetConfig) -> Result<()>;
    /// The crop batches carry when the table gives none (None: samples as stored).
    fn default_crop(&self) -> Option<u32>;
    /// The train pipeline's crop when `[dataset.train]` names none.
    fn default_train_crop(&self) -> TrainCrop;
    /// Opens the dataset (with its owner's rights: see `open`).
    fn open(&self, c: &DatasetConfig, limits: &Limits) -> Result<Opened>;
    /// Whether its datasets may be in an object store (`s3://...`), read in byte ranges
    /// through [`Blob`]; Err says why not.
    fn reads_objects(&self) -> std::result::Result<(), String> {
        Err(format!(
            "kind {} reads local files only (a local or shared filesystem: NFS, Lustre)",
            self.name()
        ))
    }
}

/// The format named `kind`.
pub fn format_named(kind: &str) -> Result<&'static dyn Format> {
    FORMATS
        .iter()
        .copied()
        .find(|f| f.name() == kind)
        .with_context(|| {
            format!(
                "kind {kind:?} is not one larder reads (it reads: {})",
                kinds().join(", ")
            )
        })
}

/// Every kind's name.
pub fn kinds() -> Vec<&'static str> {
    FORMATS.iter().map(|f| f.name()).collect()
}

/// The format that recognises `path` (looked at with this thread's rights).
pub fn recognize(path: &Path) -> Result<&'static dyn Format> {
    if crate::objects::is_url(path) {
        bail!(
            "{}: give `kind` for a dataset in an object store (one of: {})",
            path.display(),
            FORMATS
                .iter()
                .filter(|f| f.reads_objects().is_ok())
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    match std::fs::metadata(path) {
        Err(e) => bail!("{}: {e}", path.display()),
        Ok(_) => FORMATS
            .iter()
            .copied()
            .find(|f| f.recognizes(path))
            .with_context(|| {
                format!(
                    "{} is no dataset larder recognises; give `kind` (one of: {})",
                    path.display(),
                    kinds().join(", ")
                )
            }),
    }
}

/// The format of dataset `c`: its `kind`, else the one that recognises its path.
pub fn format_of(c: &DatasetConfig) -> Result<&'static dyn Format> {
    match &c.kind {
        Some(kind) => format_named(kind),
        None => recognize(&c.path),
    }
    .with_context(|| format!("dataset {:?}", c.name))
}

/// The size dataset `c`'s images are kept at, read as `format` (its default crop when the
/// table gives none).
fn resize_of(format: &dyn Format, c: &DatasetConfig) -> crate::pipeline::Resize {
    let crop = c.crop_size(format.default_crop());
    crate::pipeline::Resize {
        shorter: c.kept_size(crop),
        max_size: c.max_size,
        square: c.square,
        // Served only at its eval crop: kept at it.
        keep_crop: crop
            .filter(|_| c.train.is_none() && c.decode == crate::config::DecodeMode::Region),
    }
}

/// The end of samples `start..start + count` of a source of `len` samples, if they lie in it.
fn range_end(start: u64, count: u64, len: u64) -> Result<u64> {
    start
        .checked_add(count)
        .filter(|&end| end <= len)
        .with_context(|| format!("samples {start}..+{count} of {len}"))
}

/// Checks that the crop `c` asks for fits in the size `format`'s images are kept at.
fn check_crop_fits(format: &dyn Format, c: &DatasetConfig) -> Result<()> {
    let crop = c.crop_size(format.default_crop());
    let kept = c.kept_size(crop);
    ensure!(
        kept == 0 || crop.is_none_or(|c| kept >= c),
        "need crop <= resize (crop = {}, resize = {kept})",
        crop.unwrap_or(0)
    );
    Ok(())
}

/// Checks a kind whose fields stand alone (columns, members): its dataset keys read as `D`,
/// each field's as `F`, no field paired, and the crop within the size kept.
fn check_unpaired<D: DeserializeOwned, F: DeserializeOwned>(
    format: &dyn Format,
    c: &DatasetConfig,
) -> Result<()> {
    let _: D = dataset_options(format, c)?;
    for f in &c.fields {
        let _: F = field_options(format, f)?;
        ensure!(
            f.pair.is_none(),
            "field {:?}: `pair` is not read for kind {}",
            f.name,
            format.name()
        );
    }
    check_crop_fits(format, c)
}

/// Checks dataset `c` whole, for `format`: the keys every kind reads, then the kind's own.
pub fn check_with(format: &dyn Format, c: &DatasetConfig) -> Result<()> {
    c.validate()?;
    let crop = c.crop_size(format.default_crop());
    let context = || format!("dataset {:?} (kind {})", c.name, format.name());
    if crate::objects::is_url(&c.path) {
        if let Err(why) = format.reads_objects() {
            bail!(
                "dataset {:?}: {} is in an object store: {why}",
                c.name,
                c.path.display()
            );
        }
    }
    if c.crop_pct.is_some() && crop.is_none() {
        bail!("dataset {:?}: crop_pct needs a crop", c.name);
    }
    if let Some(t) = &c.train {
        let kind = t.crop.unwrap_or(format.default_train_crop());
        if kind == TrainCrop::RandomResized && crop.is_none() {
            bail!("dataset {:?}: a random_resized train crop needs `crop` (the size boxes are resized to)", c.name);
        }
    }
    format.check(c).with_context(context)
}

/// Checks dataset `c` as far as its table alone allows: whole when it gives `kind`; else the
/// keys every kind reads, and that each other key is one some kind reads (the rest is checked
/// when it is opened, as the kind its path is recognised as).
pub fn check(c: &DatasetConfig) -> Result<()> {
    if let Some(kind) = &c.kind {
        let format = format_named(kind).with_context(|| format!("dataset {:?}", c.name))?;
        return check_with(format, c);
    }
    c.validate()?;
    let known = |key: &str, keys: fn(&dyn Format) -> Vec<&'static str>| {
        FORMATS.iter().any(|f| keys(*f).contains(&key))
    };
    if let Some(key) = c.options.keys().find(|k| !known(k, |f| f.dataset_keys())) {
        bail!("dataset {:?}: unknown key `{key}`", c.name);
    }
    for f in &c.fields {
        if let Some(key) = f.options.keys().find(|k| !known(k, |f| f.field_keys())) {
            bail!(
                "dataset {:?}, field {:?}: unknown key `{key}`",
                c.name,
                f.name
            );
        }
    }
    Ok(())
}

/// Checks every dataset of a config as far as its table alone allows (see `check`).
pub fn check_config(config: &Config) -> Result<()> {
    config.datasets.iter().try_for_each(check)
}

/// The kind-specific keys of a table, read as `T` (unknown keys refused, naming the keys every
/// kind reads and those of this kind).
pub fn options<T: DeserializeOwned>(
    table: &toml::Table,
    every: Vec<&'static str>,
    own: Vec<&'static str>,
) -> Result<T> {
    if let Some(key) = table.keys().find(|k| !own.contains(&k.as_str())) {
        let owners: Vec<&str> = FORMATS
            .iter()
            .filter(|f| {
                f.dataset_keys().contains(&key.as_str()) || f.field_keys().contains(&key.as_str())
            })
            .map(|f| f.name())
            .collect();
        let hint = if owners.is_empty() {
            String::new()
        } else {
            format!(" (it is for kind {})", owners.join(", "))
        };
        bail!(
            "unknown key `{key}`{hint}; this table takes {}",
            every
                .iter()
                .chain(&own)
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(toml::Value::Table(table.clone()).try_into()?)
}

/// The kind-specific keys of dataset table `c`, read as `T`.
pub fn dataset_options<T: DeserializeOwned>(format: &dyn Format, c: &DatasetConfig) -> Result<T> {
    options(
        &c.options,
        keys_of::<DatasetConfig>(),
        format.dataset_keys(),
    )
}

/// The kind-specific keys of field table `f`, read as `T`.
pub fn field_options<T: DeserializeOwned>(format: &dyn Format, f: &FieldConfig) -> Result<T> {
    options(&f.options, keys_of::<FieldConfig>(), format.field_keys())
        .with_context(|| format!("field {:?}", f.name))
}

/// A dataset's source opened from its config table, with what its samples are (the schema)
/// and how they are made ready before the tiers keep them.
pub struct Opened {
    pub source: Box<dyn Source>,
    pub preprocess: Preprocess,
    pub schema: Schema,
    /// The kind it was opened as.
    pub format: &'static dyn Format,
}

/// Opens the dataset `c` describes, by its format, with its owner's rights (a dataset a user
/// added: see `owner`), else the daemon's.
pub fn open(c: &DatasetConfig, limits: &Limits) -> Result<Opened> {
    let open_format = || {
        let format = format_of(c)?;
        check_with(format, c)?;
        format.open(c, limits)
    };
    match owner::reader(c.owner) {
        Some(id) => owner::open(id, open_format),
        None => open_format(),
    }
}

/// The identity a dataset owned by `owner` is read as, when it is not the daemon's own (root's
/// and the daemon's user's datasets are read with the daemon's rights).
pub fn owner_identity(owner: Option<u32>) -> Option<std::sync::Arc<crate::access::Identity>> {
    owner::reader(owner)
}

/// The kind `path` is read as, looked at with the rights of user `uid` (None: the daemon's).
pub fn recognize_as(uid: Option<u32>, path: &Path) -> Result<&'static str> {
    match owner::reader(uid) {
        Some(id) => owner::run(&id, || recognize(path).map(|f| f.name())),
        None => recognize(path).map(|f| f.name()),
    }
}

pub use crate::fields::RawSample;

/// The error of a read from a file that changed under the daemon (kind `Changed`).
fn changed_error(why: String) -> anyhow::Error {
    crate::error::Error::new(crate::error::Kind::Changed, why).into()
}

thread_local! {
    /// Files found so far by the open running on this thread (see [`with_progress`]).
    static PROGRESS: std::cell::RefCell<Option<std::sync::Arc<std::sync::atomic::AtomicU64>>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `open` (a dataset's open, on this thread), counting in `found` the files its walk
/// finds, so a client told the dataset is being opened hears how far it got.
pub fn with_progress<T>(
    found: &std::sync::Arc<std::sync::atomic::AtomicU64>,
    open: impl FnOnce() -> T,
) -> T {
    /// Clears the thread's counter however the open ends (a panic included).
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            PROGRESS.with(|p| *p.borrow_mut() = None);
        }
    }
    PROGRESS.with(|p| *p.borrow_mut() = Some(found.clone()));
    let _clear = Clear;
    open()
}

/// Notes `n` more files found by the open running on this thread.
fn found(n: u64) {
    PROGRESS.with(|p| {
        if let Some(c) = &*p.borrow() {
            c.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        }
    });
}

/// The raw samples `start..start + count` of `source`, each its fields or why not: read as one
/// range, else (a range that does not read whole: a file in it that does not) one by one, each
/// with its own error. A failure of a reader itself (`Kind::Reader`) is the whole range's. What
/// the daemon (for a dataset it reads itself) and a reader process both do on a miss; each then
/// turns every sample into its record with `pipeline::prepare`.
pub fn read_each(
    source: &dyn RawSource,
    start: u64,
    count: u64,
) -> Result<Vec<(u64, Result<RawSample>)>> {
    use crate::error::{Error, Kind};
    let mut raw: Vec<(u64, Result<RawSample>)> = match source.read_range(start, count) {
        Ok(all) => (start..).zip(all.into_iter().map(Ok)).collect(),
        Err(e) if Error::kind_of(&e) == Kind::Reader => return Err(e),
        Err(_) => (start..start + count)
            .map(|i| (i, source.read(i)))
            .collect(),
    };
    let reader_failed =
        |r: &Result<RawSample>| matches!(r, Err(e) if Error::kind_of(e) == Kind::Reader);
    if let Some(k) = raw.iter().position(|(_, r)| reader_failed(r)) {
        if let (_, Err(e)) = raw.swap_remove(k) {
            return Err(e);
        }
    }
    Ok(raw)
}

/// Reading a dataset of raw samples on long-term storage: what the store asks of a source.
pub trait RawSource: Send + Sync {
    /// Number of samples.
    fn len(&self) -> u64;
    /// The raw fields of samples `start..start + count`.
    fn read_range(&self, start: u64, count: u64) -> Result<Vec<RawSample>>;
    /// The raw fields of sample `index`.
    fn read(&self, index: u64) -> Result<RawSample> {
        self.read_range(index, 1)?
            .pop()
            .ok_or_else(|| anyhow::anyhow!("sample {index} read as nothing"))
    }
    /// Samples that are read about as cheaply together, as an aligned range, as one alone (the
    /// source's granule): on a miss the store reads the whole range and fills the scratch tier
    /// with it, so a shuffled cold epoch reads raw storage in ranges rather than sample by
    /// sample.
    fn read_granule(&self) -> u64 {
        1
    }
    /// Bytes the raw data takes on disk (for capacity planning).
    fn disk_bytes(&self) -> u64;
    /// Bytes sample `index` takes on disk (for the measured expansion factor).
    fn disk_bytes_of(&self, _index: u64) -> u64 {
        self.disk_bytes() / self.len().max(1)
    }
    /// The bytes every sample takes on disk, when all take the same (known without looking at
    /// each: a source whose `disk_bytes_of` varies says None).
    fn disk_bytes_each(&self) -> Option<u64> {
        Some(self.disk_bytes() / self.len().max(1))
    }
    /// Human-readable description, e.g. "hdf5:/data/x.h5#images,labels".
    fn describe(&self) -> String;
    /// Names sample `index` in messages (its file, for image folders).
    fn sample_name(&self, index: u64) -> String {
        format!("sample {index}")
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The source as one whose samples come read and preprocessed (a reader process's), if
    /// it is one: the store asks it for records rather than raw fields.
    fn prepared(&self) -> Option<&dyn Prepared> {
        None
    }
}

/// Samples read and prepared: each its record or why not, the raw bytes read for them, and
/// what holding them is charged (a reader's answers, in the daemon until they are placed in the
/// tiers).
#[derive(Debug)]
pub struct Loaded {
    pub records: Vec<Result<Vec<u8>>>,
    pub raw_bytes: u64,
    pub held: Vec<crate::footprint::Charge>,
}

/// A source whose samples come read and preprocessed from elsewhere (a reader process),
/// awaited on the async runtime: no thread waits for them.
pub trait Prepared: Send + Sync {
    /// Records of the samples of `ranges` (start, count), in order: each its record or why
    /// not, with the raw bytes read. Err: none of them could be had (the reader failed), for
    /// the stream to end with, never a bad sample.
    fn load<'a>(
        &'a self,
        ranges: &'a [(u64, u64)],
    ) -> futures::future::BoxFuture<'a, Result<Loaded>>;

    /// Looks again at whether its files read as they did (what `Provenance::changed` then
    /// says), where that takes asking elsewhere.
    fn recheck(&self) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// Why none of its samples can be had now (its reader failed and has not started again),
    /// if so: for the health service. None while a reader serves or can be started.
    fn down(&self) -> Option<String> {
        None
    }
}

/// Where a source's samples come from, for the scratch tier (which version of the data its
/// shards hold), for change detection and for access checks.
pub trait Provenance: Send + Sync {
    /// Changes whenever the raw data may have changed (path, size, modification time), so the
    /// scratch tier can tell its shards are out of date.
    fn version(&self) -> String;
    /// Why the source's files can no longer be read as they were when it was opened
    /// (truncated, rewritten or replaced), if they can't: checked at each stream's start and
    /// after reads, so a changed file is never served as what it held (HDF5 reads a file cut
    /// short as zeros).
    fn changed(&self) -> Option<String> {
        None
    }
    /// The files (and folders) a user must be able to read to be served this source without
    /// a grant: checked as that user (see `access`). Built once, at open: a check must not
    /// allocate a million paths per request.
    fn files(&self) -> crate::access::Files;
    /// The file or folder the source is: its status-change time stamps access checks (a chmod
    /// or chown of it changes that time, and no user can set it).
    fn root(&self) -> &Path;
}

/// A source as the catalog holds it: read, and traced back to its files.
pub trait Source: RawSource + Provenance {}

impl<T: RawSource + Provenance> Source for T {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error `check_config` gives for one dataset table (after `kind = "..."`).
    fn error_of(kind: &str, table: &str) -> String {
        let text =
            format!("listen=\"a\"\n[[dataset]]\nname=\"d\"\npath=\"p\"\nkind=\"{kind}\"\n{table}");
        match Config::parse(&text) {
            Err(e) => format!("{e:#}"),
            Ok(c) => check_config(&c).map_or_else(|e| format!("{e:#}"), |()| String::new()),
        }
    }

    #[test]
    fn each_kind_checks_its_own_keys() {
        assert_eq!(error_of("hdf5", "samples=\"x\"\nlabels=\"y\""), "");
        assert_eq!(
            error_of("images", "[[dataset.field]]\nname=\"m\"\nfolder=\"masks\""),
            ""
        );
        for (kind, table, says) in [
            (
                "hdf5",
                "max_size=300",
                "max_size and square are for image fields",
            ),
            (
                "hdf5",
                "labels=\"y\"\n[[dataset.field]]\nname=\"x\"",
                "not both",
            ),
            ("hdf5", "bogus=1", "unknown key `bogus`; this table takes"),
            (
                "images",
                "samples=\"x\"",
                "unknown key `samples` (it is for kind hdf5)",
            ),
            (
                "images",
                "[[dataset.field]]\nname=\"x\"\nhdf5=\"x\"",
                "field \"x\": unknown key `hdf5` (it is for kind hdf5)",
            ),
            (
                "hdf5",
                "[[dataset.field]]\nname=\"x\"\nfrom=\"class\"",
                "(it is for kind images)",
            ),
            (
                "hdf5",
                "[[dataset.field]]\nname=\"x\"\nmode=\"rgb\"",
                "`mode` is for image fields",
            ),
            ("images", "resize=100\ncrop=120", "crop <= resize"),
            ("images", "crop=0\n[dataset.train]", "needs `crop`"),
            ("images", "crop=0\ncrop_pct=0.9", "crop_pct"),
            (
                "tfrecord",
                "",
                "kind \"tfrecord\" is not one larder reads (it reads: npy, hf, parquet, webdataset, lmdb, images, hdf5)",
            ),
            (
                "npy",
                "[[dataset.field]]\nname=\"x\"\ncolumn=\"y\"",
                "(it is for kind hf, parquet)",
            ),
            (
                "hf",
                "[[dataset.field]]\nname=\"x\"\narray=\"y\"",
                "(it is for kind npy)",
            ),
            ("npy", "square=true", "NumPy arrays are served as stored"),
        ] {
            let err = error_of(kind, table);
            assert!(err.contains(says), "{kind} {table:?}: {err:?}");
        }
        // HDF5's train crop is a padded random crop, which needs no crop size.
        assert_eq!(error_of("hdf5", "[dataset.train]\npadding=4"), "");
        // Without `kind`: a key no kind reads is refused at once, the rest when it is opened.
        let untyped = |table: &str| {
            let c = Config::parse(&format!(
                "listen=\"a\"\n[[dataset]]\nname=\"d\"\npath=\"p\"\n{table}"
            ));
            check_config(&c.unwrap()).map_or_else(|e| format!("{e:#}"), |()| String::new())
        };
        assert_eq!(untyped("samples=\"x\""), "");
        assert!(untyped("bogus=1").contains("unknown key `bogus`"));
        assert!(untyped("[[dataset.field]]\nname=\"x\"\nbogus=1").contains("unknown key `bogus`"));
    }

    #[test]
    fn kinds_are_recognised_by_the_path() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(recognize(dir.path()).unwrap().name(), "images");
        for (file, kind) in [
            ("x.npy", "npy"),
            ("state.json", "hf"),
            ("dataset_dict.json", "hf"),
        ] {
            let sub = dir.path().join(kind).join(file);
            std::fs::create_dir_all(sub.parent().unwrap()).unwrap();
            std::fs::write(&sub, b"").unwrap();
            assert_eq!(
                recognize(sub.parent().unwrap()).unwrap().name(),
                kind,
                "{file}"
            );
            std::fs::remove_file(&sub).unwrap();
        }
        let env = dir.path().join("train.lmdb");
        std::fs::create_dir(&env).unwrap();
        std::fs::write(env.join("data.mdb"), b"").unwrap();
        assert_eq!(recognize(&env).unwrap().name(), "lmdb", "by its data.mdb");
        let npz = dir.path().join("a.npz");
        std::fs::write(&npz, b"").unwrap();
        assert_eq!(recognize(&npz).unwrap().name(), "npy");
        std::fs::remove_file(&npz).unwrap();
        let h5 = dir.path().join("data.bin");
        write_hdf5(&h5, "x", &[1, 1], &[7], None).unwrap();
        assert_eq!(recognize(&h5).unwrap().name(), "hdf5", "by its signature");
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "hello").unwrap();
        let err = format!("{:#}", recognize(&text).err().unwrap());
        assert!(
            err.contains("no dataset larder recognises; give `kind`"),
            "{err}"
        );
        let err = format!("{:#}", recognize(&dir.path().join("gone")).err().unwrap());
        assert!(err.contains("No such file"), "{err}");
    }

    #[test]
    fn the_shipped_example_config_checks() {
        let c = Config::parse(include_str!("../../deploy/larder.toml")).unwrap();
        check_config(&c).unwrap();
    }

    #[test]
    fn the_kubernetes_config_map_holds_a_config_that_checks() {
        let yaml = include_str!("../../deploy/k8s/configmap.yaml");
        let (_, block) = yaml.split_once("larder.toml: |\n").unwrap();
        let toml: String = block
            .lines()
            .map(|l| l.strip_prefix("    ").unwrap_or(l))
            .map(|l| format!("{l}\n"))
            .collect();
        let c = Config::parse(&toml).unwrap();
        check_config(&c).unwrap();
        assert_eq!(c.datasets.len(), 1);
    }
}

/// docs/config.md lists every key the config structs and the formats read, and no other.
#[cfg(test)]
mod docs {
    use super::FORMATS;
    use crate::config::keys::key_paths;
    use crate::config::{Config, DatasetConfig, FieldConfig};
    use std::collections::BTreeSet;

    #[test]
    fn docs_config_md_lists_every_key() {
        let mut read: BTreeSet<String> = key_paths::<Config>("").into_iter().collect();
        read.extend(key_paths::<DatasetConfig>("dataset."));
        read.extend(key_paths::<FieldConfig>("dataset.field."));
        for f in FORMATS {
            read.extend(f.dataset_keys().iter().map(|k| format!("dataset.{k}")));
            read.extend(f.field_keys().iter().map(|k| format!("dataset.field.{k}")));
        }
        // Tables are documented by their keys (a table given as a value, `pair`, has a row).
        let tables: BTreeSet<String> = read
            .iter()
            .filter(|k| read.iter().any(|o| o.starts_with(&format!("{k}."))))
            .filter(|k| k.as_str() != "dataset.field.pair")
            .cloned()
            .collect();
        let read: BTreeSet<String> = read.difference(&tables).cloned().collect();
        let text = include_str!("../../docs/config.md");
        let documented: BTreeSet<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .map(str::to_string)
            .collect();
        let missing: Vec<_> = read.difference(&documented).collect();
        let stale: Vec<_> = documented.difference(&read).collect();
        assert!(
            missing.is_empty() && stale.is_empty(),
            "docs/config.md lacks {missing:?} and lists keys nothing reads: {stale:?}"
        );
    }
}
