//! Raw storage: where samples come from before preprocessing. A source reads a sample's raw
//! fields, one value each (an array as stored, or an encoded image file).

mod hdf5;
mod images;
mod owner;

pub use self::hdf5::{write_hdf5, Hdf5Source, MAX_GRANULE};
pub use self::images::ImageFolderSource;

use crate::config::{DatasetConfig, Limits, SourceKind};
use crate::fields::Schema;
use crate::pipeline::Preprocess;
use anyhow::Result;
use std::path::Path;

/// A dataset's source opened from its config table, with what its samples are (the schema)
/// and how they are made ready before the tiers keep them.
pub struct Opened {
    pub source: Box<dyn RawSource>,
    pub preprocess: Preprocess,
    pub schema: Schema,
}

/// Opens the dataset `c` describes, by its format: each format opens itself (a new one is its
/// own file and a line here).
pub fn open(c: &DatasetConfig, limits: &Limits) -> Result<Opened> {
    match owner::reader(c.owner) {
        // A dataset a user added: opened and read with their rights.
        Some(id) => owner::open(id, || open_format(c, limits)),
        None => open_format(c, limits),
    }
}

fn open_format(c: &DatasetConfig, limits: &Limits) -> Result<Opened> {
    match c.kind {
        SourceKind::Hdf5 => hdf5::open_dataset(c),
        SourceKind::Images => images::open_dataset(c, limits),
    }
}

pub use crate::fields::RawSample;

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

/// A dataset of raw samples on long-term storage.
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
    /// Samples that are read about as cheaply together, as an aligned range, as one alone: on
    /// a miss the store reads the whole range and fills the scratch tier with it, so a shuffled
    /// cold epoch reads raw storage in ranges rather than sample by sample.
    fn read_granule(&self) -> u64 {
        1
    }
    /// Bytes the raw data takes on disk (for capacity planning).
    fn disk_bytes(&self) -> u64;
    /// Bytes sample `index` takes on disk (for the measured expansion factor).
    fn disk_bytes_of(&self, _index: u64) -> u64 {
        self.disk_bytes() / self.len().max(1)
    }
    /// Human-readable description, e.g. "hdf5:/data/x.h5#images,labels".
    fn describe(&self) -> String;
    /// Names sample `index` in messages (its file, for image folders).
    fn sample_name(&self, index: u64) -> String {
        format!("sample {index}")
    }
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
    /// a grant: checked as that user (see `access`).
    /// (Built once, at open: a check must not allocate a million paths per request.)
    fn files(&self) -> std::sync::Arc<[std::path::PathBuf]>;
    /// The file or folder the source is: its status-change time stamps access checks (a chmod
    /// or chown of it changes that time, and no user can set it).
    fn root(&self) -> &Path;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What identifies a file's contents without reading them: device, inode, birth time, size
/// and modification time. A file truncated or written in place changes size or mtime; one
/// replaced (renamed over, or deleted and made again, even on a reused inode number) changes
/// inode or birth time, which no user can set. Not the status-change time: a chmod changes
/// it, and access to a file changes without its contents (see `access`). A writer of the file
/// who writes it in place and then sets its mtime back (`touch -d`) is not noticed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    dev: u64,
    ino: u64,
    btime_ns: Option<i128>,
    len: u64,
    mtime_ns: i128,
}

impl Stamp {
    /// The stamp of the file at `path` now (symlinks followed, as opening does).
    pub fn of(path: &Path) -> std::io::Result<Stamp> {
        Ok(Stamp::of_metadata(&std::fs::metadata(path)?))
    }

    /// The stamp of the file `m` describes.
    pub fn of_metadata(m: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        let ns = |s: i64, n: i64| s as i128 * 1_000_000_000 + n as i128;
        let btime_ns = m
            .created()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos() as i128);
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            btime_ns,
            len: m.len(),
            mtime_ns: ns(m.mtime(), m.mtime_nsec()),
        }
    }

    /// Why the file at `path` no longer has this stamp, if it does not.
    pub fn changed(&self, path: &Path) -> Option<String> {
        let why = match Stamp::of(path) {
            Err(e) => format!("it no longer opens ({e})"),
            Ok(now) if now == *self => return None,
            Ok(now) if now.len != self.len => {
                format!("its size went from {} to {} bytes", self.len, now.len)
            }
            Ok(now) if (now.dev, now.ino, now.btime_ns) != (self.dev, self.ino, self.btime_ns) => {
                "it was replaced by another file".to_string()
            }
            Ok(_) => "it was written to (its modification time moved)".to_string(),
        };
        Some(format!(
            "{} changed since the daemon opened it: {why}; the dataset is not served until it is \
             opened again",
            path.display()
        ))
    }
}

/// Path, size, modification time and birth time of a file, as a version string (part of the
/// scratch tier's fingerprint). The birth time is what a user cannot forge: a file deleted and
/// made again with the same size and mtime (`touch -d`), even on the same inode number, has
/// another one, so it never finds the shards of the file it replaced.
fn file_version(path: &Path) -> String {
    let meta = std::fs::metadata(path).ok();
    let len = meta.as_ref().map_or(0, |m| m.len());
    let nanos = |t: std::io::Result<std::time::SystemTime>| {
        t.ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos())
    };
    let mtime = meta.as_ref().map_or(0, |m| nanos(m.modified()));
    let btime = meta.as_ref().map_or(0, |m| nanos(m.created()));
    format!("{}:{len}:{mtime}:{btime}", path.display())
}
