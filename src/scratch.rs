//! The scratch tier: preprocessed samples packed in shard files on fast local disk, read through
//! memory maps.
//!
//! Layout: `<scratch dir>/<dataset>-<fingerprint>/shard-NNNNNN.bin`. The fingerprint covers the
//! raw data's version (path, size, mtime) and the preprocessing, so changed data is never served
//! from old shards: their folder is removed at start. A shard file is a 64-byte header followed by
//! fixed-size records, one per sample, at known offsets:
//!
//! ```text
//! header: "LARDSHD1" | fingerprint u64 | sample_bytes u64 | first_index u64 | records u64 | 0...
//! record: magic u32 "LRD1" | crc32(index u64 LE ++ payload) u32 | payload [sample_bytes]
//! ```
//!
//! A record of zeros is absent (shard files are allocated whole when created). A record with a wrong magic or checksum,
//! or cut off by a truncated file, is corrupt: never served, counted, and refetched from raw
//! storage (which rewrites it). A restarted daemon serves every valid record it finds.

use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use memmap2::Mmap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

const FILE_MAGIC: &[u8; 8] = b"LARDSHD1";
const HEADER_BYTES: u64 = 64;
const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"LRD1");
const RECORD_HEADER: u64 = 8;
/// After a write failure, how long the tier waits before trying to write again.
const RETRY_WRITES_AFTER: Duration = Duration::from_secs(60);

/// Stable 64-bit FNV-1a, for fingerprints that survive daemon upgrades.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The scratch disk, shared by all datasets: its byte budget and its health.
pub struct ScratchSpace {
    root: PathBuf,
    budget: u64,
    used: AtomicU64,
    corrupt: AtomicU64,
    budget_full_logged: AtomicBool,
    /// Why writing stopped, and until when.
    paused: Mutex<Option<(String, Instant)>>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScratchSnapshot {
    pub used: u64,
    pub budget: u64,
    pub corrupt: u64,
    /// Why the tier is not writing now, if it is not.
    pub paused: Option<String>,
}

impl ScratchSpace {
    /// Opens (creating) the scratch directory. `budget`: bytes all shard files may take; None
    /// takes 80% of the disk's free space now.
    pub fn open(root: &Path, budget: Option<u64>) -> Result<Arc<ScratchSpace>> {
        std::fs::create_dir_all(root)
            .with_context(|| format!("creating scratch directory {}", root.display()))?;
        let budget = match budget {
            Some(b) => b,
            None => {
                let free = fs4::available_space(root)
                    .with_context(|| format!("reading free space of {}", root.display()))?;
                free / 10 * 8
            }
        };
        Ok(Arc::new(ScratchSpace {
            root: root.to_path_buf(),
            budget,
            used: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            budget_full_logged: AtomicBool::new(false),
            paused: Mutex::new(None),
        }))
    }

    /// Removes the shard folders (`<name>-<16 hex digits>`) no dataset uses: those of older
    /// versions of a dataset, or of datasets no longer configured. Other files are left alone.
    pub fn remove_unused<'a>(&self, in_use: impl IntoIterator<Item = &'a Path>) {
        let in_use: Vec<&Path> = in_use.into_iter().collect();
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((_, hex)) = name.rsplit_once('-') else {
                continue;
            };
            let ours =
                hex.len() == 16 && hex.chars().all(|c| c.is_ascii_hexdigit()) && path.is_dir();
            if ours && !in_use.contains(&path.as_path()) {
                tracing::info!(path = %path.display(), "removing scratch shards no configured dataset uses");
                let _ = std::fs::remove_dir_all(&path);
            }
        }
    }

    pub fn snapshot(&self) -> ScratchSnapshot {
        let paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        ScratchSnapshot {
            used: self.used.load(Relaxed),
            budget: self.budget,
            corrupt: self.corrupt.load(Relaxed),
            paused: paused
                .as_ref()
                .filter(|(_, until)| Instant::now() < *until)
                .map(|(why, _)| why.clone()),
        }
    }

    fn writes_paused(&self) -> bool {
        let paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        paused
            .as_ref()
            .is_some_and(|(_, until)| Instant::now() < *until)
    }

    /// Stops writing for a while after a failure (a full disk, most often), with one clear log line.
    fn pause_writes(&self, why: String) {
        let mut paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        tracing::error!(
            "scratch tier stops writing for {}s: {why}; samples are served from memory and raw storage",
            RETRY_WRITES_AFTER.as_secs()
        );
        *paused = Some((why, Instant::now() + RETRY_WRITES_AFTER));
    }

    /// Takes `bytes` of the budget, or says why not.
    fn reserve(&self, bytes: u64) -> bool {
        let ok = self
            .used
            .fetch_update(Relaxed, Relaxed, |used| {
                (used + bytes <= self.budget).then_some(used + bytes)
            })
            .is_ok();
        if !ok && !self.budget_full_logged.swap(true, Relaxed) {
            tracing::warn!(
                budget = self.budget,
                used = self.used.load(Relaxed),
                "scratch budget is full; further samples are served from memory and raw storage"
            );
        }
        ok
    }
}

struct Shard {
    file: File,
    map: Mmap,
    first: u64,
    /// Readers never see a record half written (warming writes beside the streams' fetches).
    records: RwLock<()>,
}

/// One dataset's shards.
pub struct ScratchTier {
    space: Arc<ScratchSpace>,
    dir: PathBuf,
    fingerprint: u64,
    sample_bytes: u64,
    records_per_shard: u64,
    len: u64,
    shards: Vec<Mutex<Option<Arc<Shard>>>>,
}

/// What a record slot holds.
enum Record<'a> {
    Absent,
    Corrupt(&'static str),
    Valid(&'a [u8]),
}

impl ScratchTier {
    /// Opens a dataset's shards, removing shards of other versions of the dataset.
    pub fn open(
        space: &Arc<ScratchSpace>,
        dataset: &str,
        fingerprint: u64,
        sample_bytes: u64,
        len: u64,
        shard_bytes: u64,
    ) -> Result<ScratchTier> {
        ensure!(sample_bytes > 0, "samples of 0 bytes cannot be stored");
        let safe: String = dataset
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let dir = space.root.join(format!("{safe}-{fingerprint:016x}"));
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("creating scratch folder {}", dir.display()))?;
        let record_bytes = RECORD_HEADER + sample_bytes;
        let records_per_shard = ((shard_bytes - HEADER_BYTES) / record_bytes).max(1);
        let num_shards = len.div_ceil(records_per_shard);
        let tier = ScratchTier {
            space: space.clone(),
            dir,
            fingerprint,
            sample_bytes,
            records_per_shard,
            len,
            shards: (0..num_shards).map(|_| Mutex::new(None)).collect(),
        };
        let mut found = 0;
        for s in 0..num_shards {
            if let Some(shard) = tier.open_existing(s) {
                space.used.fetch_add(shard.map.len() as u64, Relaxed);
                *tier.shards[s as usize].lock().unwrap() = Some(Arc::new(shard));
                found += 1;
            }
        }
        tracing::info!(dataset, dir = %tier.dir.display(), shards = num_shards, found, "scratch tier opened");
        Ok(tier)
    }

    fn shard_path(&self, s: u64) -> PathBuf {
        self.dir.join(format!("shard-{s:06}.bin"))
    }

    /// Records in shard `s`, and its size in bytes.
    fn shard_extent(&self, s: u64) -> (u64, u64) {
        let first = s * self.records_per_shard;
        let records = self.records_per_shard.min(self.len - first);
        (
            records,
            HEADER_BYTES + records * (RECORD_HEADER + self.sample_bytes),
        )
    }

    fn header(&self, s: u64) -> [u8; HEADER_BYTES as usize] {
        let (records, _) = self.shard_extent(s);
        let mut h = [0u8; HEADER_BYTES as usize];
        h[0..8].copy_from_slice(FILE_MAGIC);
        for (i, v) in [
            self.fingerprint,
            self.sample_bytes,
            s * self.records_per_shard,
            records,
        ]
        .iter()
        .enumerate()
        {
            h[8 + 8 * i..16 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        h
    }

    /// Opens shard `s` if its file exists with the right header; a file with a wrong header is
    /// removed, a short one extended (its missing records read as absent).
    fn open_existing(&self, s: u64) -> Option<Shard> {
        let path = self.shard_path(s);
        let file = OpenOptions::new().read(true).write(true).open(&path).ok()?;
        let (_, size) = self.shard_extent(s);
        let mut header = [0u8; HEADER_BYTES as usize];
        if file.read_exact_at(&mut header, 0).is_err() || header != self.header(s) {
            tracing::warn!(path = %path.display(), "scratch shard has a bad header; removing it");
            let _ = std::fs::remove_file(&path);
            return None;
        }
        let len = file.metadata().ok()?.len();
        if len != size {
            tracing::warn!(path = %path.display(), len, expected = size, "scratch shard has the wrong size; its missing records will be refetched");
            file.set_len(size.min(len)).ok()?;
        }
        // Allocate every block now: a hole in a mapped file on a full disk (tmpfs above all)
        // faults when read instead of failing cleanly.
        if let Err(e) = allocate(&file, size) {
            self.space.pause_writes(io_failure(e, &path));
            return None;
        }
        // SAFETY: the daemon owns its scratch folder; a file cut short behind its back is caught
        // by the length check before every read.
        let map = unsafe { Mmap::map(&file) }.ok()?;
        Some(Shard {
            file,
            map,
            first: s * self.records_per_shard,
            records: RwLock::new(()),
        })
    }

    /// Creates shard `s` with all its blocks allocated (so a full disk fails here, not later).
    fn create(&self, s: u64) -> Result<Shard> {
        let path = self.shard_path(s);
        let (_, size) = self.shard_extent(s);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let result = file
            .write_all_at(&self.header(s), 0)
            .and_then(|()| allocate(&file, size));
        if let Err(e) = result {
            let _ = std::fs::remove_file(&path);
            return Err(anyhow::anyhow!(io_failure(e, &path)));
        }
        // SAFETY: as in open_existing.
        let map =
            unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        Ok(Shard {
            file,
            map,
            first: s * self.records_per_shard,
            records: RwLock::new(()),
        })
    }

    fn shard(&self, index: u64, create: bool) -> Option<Arc<Shard>> {
        if index >= self.len {
            return None;
        }
        let s = index / self.records_per_shard;
        let mut slot = self.shards[s as usize]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if slot.is_none() && create {
            let (_, size) = self.shard_extent(s);
            if !self.space.reserve(size) {
                return None;
            }
            match self.create(s) {
                Ok(shard) => *slot = Some(Arc::new(shard)),
                Err(e) => {
                    self.space.used.fetch_sub(size, Relaxed);
                    self.space.pause_writes(e.to_string());
                }
            }
        }
        slot.clone()
    }

    fn offset(&self, shard: &Shard, index: u64) -> u64 {
        HEADER_BYTES + (index - shard.first) * (RECORD_HEADER + self.sample_bytes)
    }

    fn record<'a>(&self, shard: &'a Shard, index: u64) -> Record<'a> {
        let off = self.offset(shard, index);
        let end = off + RECORD_HEADER + self.sample_bytes;
        // Reading a mapped page past the end of the file would fault: check the file first.
        let file_len = shard.file.metadata().map(|m| m.len()).unwrap_or(0);
        if end > file_len || end > shard.map.len() as u64 {
            return Record::Corrupt("truncated");
        }
        let rec = &shard.map[off as usize..end as usize];
        let magic = u32::from_le_bytes(rec[0..4].try_into().unwrap());
        let crc = u32::from_le_bytes(rec[4..8].try_into().unwrap());
        let payload = &rec[RECORD_HEADER as usize..];
        if magic == 0 && crc == 0 {
            return Record::Absent;
        }
        if magic != RECORD_MAGIC {
            return Record::Corrupt("bad record magic");
        }
        if crc != checksum(index, payload) {
            return Record::Corrupt("checksum mismatch");
        }
        Record::Valid(payload)
    }

    /// The sample, if the tier holds a valid copy. Corrupt records are counted and logged.
    pub fn read(&self, index: u64) -> Option<Bytes> {
        let shard = self.shard(index, false)?;
        let _reading = shard.records.read().unwrap_or_else(|e| e.into_inner());
        match self.record(&shard, index) {
            Record::Valid(payload) => Some(Bytes::copy_from_slice(payload)),
            Record::Absent => None,
            Record::Corrupt(why) => {
                self.space.corrupt.fetch_add(1, Relaxed);
                tracing::warn!(dir = %self.dir.display(), index, why, "corrupt scratch record; refetching from raw storage");
                None
            }
        }
    }

    /// Whether the tier holds a valid copy of the sample.
    pub fn contains(&self, index: u64) -> bool {
        self.shard(index, false).is_some_and(|s| {
            let _reading = s.records.read().unwrap_or_else(|e| e.into_inner());
            matches!(self.record(&s, index), Record::Valid(_))
        })
    }

    /// Whether a write of sample `index` would be taken now: writes are not paused, and its
    /// shard exists or fits in the budget (it is created).
    pub fn accepts_writes(&self, index: u64) -> bool {
        !self.space.writes_paused() && self.shard(index, true).is_some()
    }

    /// Stores a sample. Returns whether it was written; a full budget or disk is not an error:
    /// the sample is still served, from the other tiers.
    pub fn write(&self, index: u64, data: &[u8]) -> bool {
        if data.len() as u64 != self.sample_bytes || self.space.writes_paused() {
            return false;
        }
        let Some(shard) = self.shard(index, true) else {
            return false;
        };
        let mut rec = Vec::with_capacity((RECORD_HEADER + self.sample_bytes) as usize);
        rec.extend_from_slice(&RECORD_MAGIC.to_le_bytes());
        rec.extend_from_slice(&checksum(index, data).to_le_bytes());
        rec.extend_from_slice(data);
        let written = {
            let _writing = shard.records.write().unwrap_or_else(|e| e.into_inner());
            shard.file.write_all_at(&rec, self.offset(&shard, index))
        };
        match written {
            Ok(()) => true,
            Err(e) => {
                let (path, _) = self.locate(index);
                self.space.pause_writes(io_failure(e, &path));
                false
            }
        }
    }

    /// The folder holding this dataset's shards.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The shard files, for tests and tools.
    pub fn shard_files(&self) -> Vec<PathBuf> {
        (0..self.shards.len() as u64)
            .map(|s| self.shard_path(s))
            .filter(|p| p.exists())
            .collect()
    }

    /// Where record `index` lives: (file, byte offset of its payload).
    pub fn locate(&self, index: u64) -> (PathBuf, u64) {
        let s = index / self.records_per_shard;
        let first = s * self.records_per_shard;
        let off = HEADER_BYTES + (index - first) * (RECORD_HEADER + self.sample_bytes);
        (self.shard_path(s), off + RECORD_HEADER)
    }
}

/// Gives `file` all the blocks of `size` bytes, and that length. (fs4's allocate alone leaves the
/// length short when the blocks a file already has cover `size`.)
fn allocate(file: &File, size: u64) -> std::io::Result<()> {
    fs4::FileExt::allocate(file, size)?;
    if file.metadata()?.len() < size {
        file.set_len(size)?;
    }
    Ok(())
}

/// Says what a failed scratch write means, a full disk above all.
fn io_failure(e: std::io::Error, path: &Path) -> String {
    if e.kind() == std::io::ErrorKind::StorageFull {
        format!("the scratch disk is full ({})", path.display())
    } else {
        format!("writing {}: {e}", path.display())
    }
}

fn checksum(index: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&index.to_le_bytes());
    h.update(payload);
    h.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(space: &Arc<ScratchSpace>, fp: u64) -> ScratchTier {
        // 10 samples of 16 bytes, 4 records per shard: shards of 4, 4 and 2 records.
        ScratchTier::open(space, "ds", fp, 16, 10, HEADER_BYTES + 4 * 24).unwrap()
    }

    fn sample(i: u64) -> Vec<u8> {
        (0..16).map(|o| (i * 16 + o) as u8).collect()
    }

    #[test]
    fn stores_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = tier(&space, 1);
        assert!(t.read(3).is_none());
        for i in 0..10 {
            assert!(t.write(i, &sample(i)));
        }
        assert_eq!(t.read(9).unwrap(), sample(9));
        assert_eq!(t.shard_files().len(), 3);
        let used = space.snapshot().used;
        assert_eq!(used, 3 * HEADER_BYTES + 10 * 24);
        drop(t);

        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = tier(&space, 1);
        assert_eq!(
            space.snapshot().used,
            used,
            "existing shards count against the budget"
        );
        assert!((0..10).all(|i| t.read(i).unwrap() == sample(i)));
        drop(t);

        // A new version of the data: old shards are removed, nothing stale is served.
        std::fs::write(dir.path().join("notes-0123456789abcdef"), "not ours").unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = tier(&space, 2);
        space.remove_unused([t.dir()]);
        assert!(t.read(0).is_none());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            2,
            "ours and the stray file"
        );
        space.remove_unused([]);
        assert!(!t.dir().exists(), "a dataset no longer configured");
        assert!(dir.path().join("notes-0123456789abcdef").exists());
    }

    #[test]
    fn corrupt_and_truncated_records_are_never_served() {
        let dir = tempfile::tempdir().unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = tier(&space, 1);
        for i in 0..10 {
            t.write(i, &sample(i));
        }
        let (path, off) = t.locate(5);
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0xAA], off + 3).unwrap();
        assert!(t.read(5).is_none());
        assert_eq!(space.snapshot().corrupt, 1);
        assert!(t.write(5, &sample(5)), "a refetched sample overwrites it");
        assert_eq!(t.read(5).unwrap(), sample(5));
        // Cut the last shard in the middle of its second record.
        let (path, off) = t.locate(9);
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(off + 4)
            .unwrap();
        assert_eq!(t.read(8).unwrap(), sample(8));
        assert!(t.read(9).is_none());
        assert_eq!(space.snapshot().corrupt, 2);
    }

    #[test]
    fn a_full_budget_stops_writes_without_failing() {
        let dir = tempfile::tempdir().unwrap();
        // Room for the first shard only.
        let space = ScratchSpace::open(dir.path(), Some(HEADER_BYTES + 4 * 24)).unwrap();
        let t = tier(&space, 1);
        assert!(t.write(0, &sample(0)));
        assert!(!t.write(4, &sample(4)));
        assert!(t.read(4).is_none());
        assert!(!t.write(1, &[1, 2, 3]), "wrong size");
        assert!(space.snapshot().used <= space.snapshot().budget);
    }

    #[test]
    fn fingerprints_are_stable() {
        assert_eq!(fnv1a(&[b"a", b"bc"]), fnv1a(&[b"a", b"bc"]));
        assert_ne!(fnv1a(&[b"a", b"bc"]), fnv1a(&[b"ab", b"c"]));
    }
}
