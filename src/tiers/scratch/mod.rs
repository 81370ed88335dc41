//! The scratch tier: preprocessed samples packed in shard files on fast local disk; index
//! entries read through a memory map, records with one `pread` each. The disk's budget is
//! `space`'s, the file format `shard`'s.
//!
//! Layout: `<scratch dir>/<dataset>-<fingerprint>/shard-NNNNNN.bin`. The fingerprint covers the
//! raw data's version (path, size, mtime), the preprocessing and the fields, so changed data is
//! never served from old shards (their folder is kept, idle, until its space is needed). Records have any size (a
//! sample's record, see `fields`). A shard file is allocated whole when created (a full disk
//! fails there, not on a read of a mapped hole) and filled from both ends: records from the
//! front, their index entries from the back.
//!
//! A record's payload is written before its entry, and a reader finds it only through the
//! in-memory index, which is set after both: a record is never seen half written. An entry of
//! zeros is absent (a crash between reserving and writing leaves such a hole, which is skipped);
//! an entry or payload whose checksum fails, or that a truncated file cut off, is corrupt: never
//! served, counted, and refetched from raw storage, which appends a new copy. A restarted daemon
//! rebuilds its index from the entries alone, without reading the records, and serves every
//! valid record it finds; the last entry of a sample wins.

use crate::sync::Locked;
mod shard;
mod space;

use self::shard::*;
pub use self::shard::{ENTRY_BYTES, MAX_SHARD_BYTES};
use self::space::private_dir;
pub use self::space::{ScratchSnapshot, ScratchSpace};
use crate::fingerprint::Fingerprint;
use anyhow::{Context, Result};
use bytes::Bytes;
use memmap2::Mmap;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};

/// One dataset's shards.
pub struct ScratchTier {
    space: Arc<ScratchSpace>,
    dir: PathBuf,
    fingerprint: Fingerprint,
    len: u64,
    /// Size of a new shard (capped by what the rest of the dataset needs).
    shard_bytes: u64,
    /// Bytes of a record, as expected before any is written.
    record_estimate: u64,
    /// Every shard, by number (None: removed to make room).
    shards: RwLock<Vec<Option<Arc<Shard>>>>,
    /// When a stream last read or wrote a record (`ScratchSpace::now`).
    last_used: AtomicU64,
    /// The number of the shard being filled (u64::MAX: none), kept apart from the appender's
    /// lock so that another dataset's writer making room never waits on this one's.
    filling: AtomicU64,
    /// Per sample: 0 if absent, else (shard number + 1) << 32 | entry number.
    index: Vec<AtomicU64>,
    /// Records stored and their payload bytes (for sizing new shards).
    stored: AtomicU64,
    stored_bytes: AtomicU64,
    appender: Mutex<Appender>,
}

impl ScratchTier {
    /// Opens a dataset's shards (indexing the records they hold) for `len` samples whose records
    /// take about `record_estimate` bytes each.
    pub fn open(
        space: &Arc<ScratchSpace>,
        dataset: &str,
        fingerprint: Fingerprint,
        len: u64,
        record_estimate: u64,
        shard_bytes: u64,
    ) -> Result<ScratchTier> {
        let dir = space.root.join(folder_name(dataset, fingerprint));
        space.reclaim(&dir);
        private_dir(&dir).with_context(|| format!("creating scratch folder {}", dir.display()))?;
        let tier = ScratchTier {
            space: space.clone(),
            dir,
            fingerprint,
            len,
            shard_bytes: shard_bytes.clamp(HEADER_BYTES + ENTRY_BYTES + 1, MAX_SHARD_BYTES),
            record_estimate: record_estimate.max(1),
            shards: RwLock::new(vec![]),
            last_used: AtomicU64::new(space.now()),
            filling: AtomicU64::new(u64::MAX),
            index: (0..len).map(|_| AtomicU64::new(0)).collect(),
            stored: AtomicU64::new(0),
            stored_bytes: AtomicU64::new(0),
            appender: Mutex::new(Appender {
                shard: None,
                tail: 0,
                slot: 0,
            }),
        };
        // Shards are numbered in the order they were made; some may have been removed to make
        // room (a gap), and the last one is the one to go on filling.
        // Only names the tier would have made (`shard-000001.bin`, not `shard-1.bin`).
        let mut numbers: Vec<u64> = tier
            .shard_files()
            .iter()
            .filter_map(|p| shard_number(p).filter(|&n| *p == tier.shard_path(n)))
            .collect();
        numbers.sort_unstable();
        let (mut found, mut records) = (0, 0);
        for number in numbers {
            let Some((shard, count, (tail, slot))) = tier.open_existing(number) else {
                continue;
            };
            space.used.fetch_add(shard.capacity, Relaxed);
            let shard = Arc::new(shard);
            let mut shards = tier.shards.write().unwrap();
            shards.resize(number as usize, None);
            shards.push(Some(shard.clone()));
            drop(shards);
            tier.filling.store(number, Relaxed);
            *tier.appender.locked() = Appender {
                shard: Some(shard),
                tail,
                slot,
            };
            records += count;
            found += 1;
        }
        let held = tier.index.iter().filter(|l| l.load(Relaxed) != 0).count();
        tier.stored.store(held as u64, Relaxed);
        tracing::info!(dataset, dir = %tier.dir.display(), shards = found, records, samples = held, "scratch tier opened");
        Ok(tier)
    }

    fn shard_path(&self, s: u64) -> PathBuf {
        self.dir.join(format!("shard-{s:06}.bin"))
    }

    fn header(&self, number: u64, capacity: u64) -> [u8; HEADER_BYTES as usize] {
        header(self.fingerprint, number, capacity)
    }

    /// Opens shard `number` if its file exists, whole, with the right header, and indexes its
    /// entries: (shard, records found, (first free payload byte, first free entry)). A file
    /// with a wrong header or size is removed.
    fn open_existing(&self, number: u64) -> Option<(Shard, u64, (u64, u64))> {
        let path = self.shard_path(number);
        let file = OpenOptions::new().read(true).write(true).open(&path).ok()?;
        let mut header = [0u8; HEADER_BYTES as usize];
        let len = file.metadata().ok()?.len();
        let read = file.read_exact_at(&mut header, 0);
        let capacity = u64::from_le_bytes(header[32..40].try_into().unwrap());
        if read.is_err() || header != self.header(number, capacity) || capacity != len {
            tracing::warn!(path = %path.display(), len, "scratch shard has a bad header or was cut short; removing it (its samples will be refetched)");
            let _ = std::fs::remove_file(&path);
            return None;
        }
        // SAFETY: the daemon owns its scratch folder; a file cut short behind its back is caught
        // by the length check before every read.
        let map = unsafe { Mmap::map(&file) }.ok()?;
        random_access(&map, &file);
        let shard = Shard {
            number,
            file,
            map,
            capacity,
        };
        let (mut data_end, mut slot, mut holes, mut records) = (HEADER_BYTES, 0u64, 0u64, 0u64);
        let mut last = None;
        while ENTRY_BYTES * (slot + 1) + data_end <= capacity && holes <= MAX_HOLES {
            let pos = entry_pos(capacity, slot) as usize;
            match Entry::decode(&shard.map[pos..pos + ENTRY_BYTES as usize]) {
                None => holes += 1,
                Some(Err(())) => {
                    holes = 0;
                    self.space.corrupt.fetch_add(1, Relaxed);
                    tracing::warn!(path = %path.display(), slot, "corrupt scratch index entry; skipping it");
                }
                Some(Ok(e)) => {
                    holes = 0;
                    let end = e.offset as u64 + e.len as u64;
                    if e.sample < self.len
                        && e.offset as u64 >= HEADER_BYTES
                        && end <= entry_pos(capacity, slot)
                    {
                        self.index[e.sample as usize].store(pack(number, slot), Relaxed);
                        self.stored_bytes.fetch_add(e.len as u64, Relaxed);
                        data_end = data_end.max(end);
                        records += 1;
                        last = Some(slot);
                    }
                }
            }
            slot += 1;
        }
        Some((shard, records, (data_end, last.map_or(0, |s| s + 1))))
    }

    /// Creates shard `number` of `capacity` bytes, all its blocks allocated.
    fn create(&self, number: u64, capacity: u64) -> Result<Shard> {
        let path = self.shard_path(number);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        let result = allocate(&file, capacity)
            .and_then(|()| file.write_all_at(&self.header(number, capacity), 0));
        if let Err(e) = result {
            let _ = std::fs::remove_file(&path);
            return Err(anyhow::anyhow!(io_failure(e, &path)));
        }
        // SAFETY: as in open_existing.
        let map =
            unsafe { Mmap::map(&file) }.with_context(|| format!("mapping {}", path.display()))?;
        random_access(&map, &file);
        Ok(Shard {
            number,
            file,
            map,
            capacity,
        })
    }

    /// Bytes a new shard gets: the configured size, or what the samples not yet stored need if
    /// that is less, and at least room for a record of `need` bytes.
    fn new_shard_capacity(&self, need: u64) -> u64 {
        let stored = self.stored.load(Relaxed);
        let per_record = match stored {
            0 => self.record_estimate,
            n => self.stored_bytes.load(Relaxed) / n,
        } + ENTRY_BYTES;
        let rest = HEADER_BYTES + self.len.saturating_sub(stored).max(1) * per_record;
        self.shard_bytes
            .min(rest)
            .max(HEADER_BYTES + need + ENTRY_BYTES)
    }

    /// Room for a record of `len` bytes: (shard, payload offset, entry number); a new shard is
    /// created when the one being filled is full. None when the budget or the disk is full.
    fn reserve(&self, len: u64) -> Option<(Arc<Shard>, u64, u64)> {
        if HEADER_BYTES + len + ENTRY_BYTES > MAX_SHARD_BYTES {
            return None;
        }
        let mut a = self.appender.locked();
        if !a.has_room(len) {
            let capacity = self.new_shard_capacity(len);
            if !self.space.reserve(capacity, self) {
                return None;
            }
            let mut shards = self.shards.write().unwrap_or_else(|e| e.into_inner());
            let number = shards.len() as u64;
            match self.create(number, capacity) {
                Ok(shard) => {
                    let shard = Arc::new(shard);
                    shards.push(Some(shard.clone()));
                    self.filling.store(number, Relaxed);
                    *a = Appender {
                        shard: Some(shard),
                        tail: HEADER_BYTES,
                        slot: 0,
                    };
                }
                Err(e) => {
                    self.space.used.fetch_sub(capacity, Relaxed);
                    self.space.pause_writes(e.to_string());
                    return None;
                }
            }
        }
        let shard = a.shard.clone()?;
        let (offset, slot) = (a.tail, a.slot);
        a.tail += len;
        a.slot += 1;
        Some((shard, offset, slot))
    }

    fn shard(&self, number: u64) -> Option<Arc<Shard>> {
        self.shards
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(number as usize)
            .cloned()
            .flatten()
    }

    /// Where the payload of `index` lies in `shard` (entry `slot`) and its checksum, or why the
    /// record is corrupt.
    fn entry(&self, shard: &Shard, slot: u64, index: u64) -> Result<(u64, u64, u32), &'static str> {
        // Reading a mapped page past the end of the file would fault: check the file first.
        let file_len = shard.file.metadata().map(|m| m.len()).unwrap_or(0);
        let pos = entry_pos(shard.capacity, slot);
        if pos + ENTRY_BYTES > file_len {
            return Err("truncated");
        }
        let e = match Entry::decode(&shard.map[pos as usize..(pos + ENTRY_BYTES) as usize]) {
            None => return Err("index entry gone"),
            Some(Err(())) => return Err("index entry checksum mismatch"),
            Some(Ok(e)) => e,
        };
        let (start, end) = (e.offset as u64, e.offset as u64 + e.len as u64);
        if e.sample != index || start < HEADER_BYTES || end > pos {
            return Err("index entry names another record");
        }
        if end > file_len {
            return Err("truncated");
        }
        Ok((start, end, e.crc))
    }

    /// The payload of `index` in `shard` at entry `slot`, as mapped, or why it is corrupt.
    fn record<'a>(
        &self,
        shard: &'a Shard,
        slot: u64,
        index: u64,
    ) -> Result<&'a [u8], &'static str> {
        let (start, end, crc) = self.entry(shard, slot, index)?;
        let payload = &shard.map[start as usize..end as usize];
        if checksum(index, payload) != crc {
            return Err("checksum mismatch");
        }
        Ok(payload)
    }

    /// The payload of `index` in `shard` at entry `slot`, read with one `pread` into a buffer
    /// of its own (a record read through the mapping would fault in one 4 KiB page at a time:
    /// tens of disk reads for an image's record once the page cache no longer holds it), or
    /// why it is corrupt.
    fn read_record(&self, shard: &Shard, slot: u64, index: u64) -> Result<Vec<u8>, &'static str> {
        use std::os::unix::fs::FileExt;
        let (start, end, crc) = self.entry(shard, slot, index)?;
        let mut payload = vec![0u8; (end - start) as usize];
        crate::alloc::prefault(&mut payload);
        shard
            .file
            .read_exact_at(&mut payload, start)
            .map_err(|_| "truncated")?;
        if checksum(index, &payload) != crc {
            return Err("checksum mismatch");
        }
        Ok(payload)
    }

    /// Looks the sample up with `get` (a record as mapped, or read): None if absent. A corrupt
    /// record is counted, logged and forgotten, so that it is refetched.
    fn lookup<T>(
        &self,
        index: u64,
        get: impl FnOnce(&Self, &Shard, u64) -> Result<T, &'static str>,
    ) -> Option<T> {
        let loc = self.index.get(index as usize)?.load(Ordering::Acquire);
        if loc == 0 {
            return None;
        }
        let (number, slot) = unpack(loc);
        let Some(shard) = self.shard(number) else {
            // Written into a shard removed to make room while the write was under way.
            if self.index[index as usize]
                .compare_exchange(loc, 0, Relaxed, Relaxed)
                .is_ok()
            {
                self.stored.fetch_sub(1, Relaxed);
            }
            return None;
        };
        match get(self, &shard, slot) {
            Ok(found) => Some(found),
            Err(why) => {
                // Forget it, unless a fresh copy was written meanwhile.
                if self.index[index as usize]
                    .compare_exchange(loc, 0, Relaxed, Relaxed)
                    .is_ok()
                {
                    self.stored.fetch_sub(1, Relaxed);
                    self.space.corrupt.fetch_add(1, Relaxed);
                    tracing::warn!(dir = %self.dir.display(), index, why, "corrupt scratch record; refetching from raw storage");
                }
                None
            }
        }
    }

    /// The sample's record, if the tier holds a valid copy: one read of the disk.
    pub fn read(&self, index: u64) -> Option<Bytes> {
        self.last_used.store(self.space.now(), Relaxed);
        self.lookup(index, |t, shard, slot| t.read_record(shard, slot, index))
            .map(Bytes::from)
    }

    /// Removes the oldest shard but the one being filled, to give its space to another
    /// dataset: its records are forgotten first, then its file is removed and its bytes given
    /// back. A crash in between leaves a whole shard whose records are found again; a read that
    /// found the shard before goes on reading the removed file's blocks, which stay until it is
    /// closed: no read ever sees another record's bytes. False when there is no such shard.
    pub fn evict_oldest_shard(&self) -> bool {
        let victim = {
            let mut shards = self.shards.write().unwrap_or_else(|e| e.into_inner());
            // Read under the shards' lock, which a new shard is made under.
            let filling = self.filling.load(Relaxed);
            let found = shards
                .iter_mut()
                .find(|s| s.as_ref().is_some_and(|s| s.number != filling));
            match found {
                Some(slot) => slot.take(),
                None => None,
            }
        };
        let Some(shard) = victim else {
            return false;
        };
        let forgotten = self.forget_shard(shard.number);
        self.remove_shard_file(&shard);
        tracing::info!(dir = %self.dir.display(), shard = shard.number, records = forgotten, bytes = shard.capacity, "scratch shard removed to make room for another dataset");
        true
    }

    /// Forgets every record of shard `number`; how many there were.
    fn forget_shard(&self, number: u64) -> u64 {
        let mut forgotten = 0;
        for loc in self.index.iter() {
            let l = loc.load(Ordering::Acquire);
            if l != 0
                && unpack(l).0 == number
                && loc.compare_exchange(l, 0, Relaxed, Relaxed).is_ok()
            {
                forgotten += 1;
            }
        }
        self.stored.fetch_sub(forgotten, Relaxed);
        forgotten
    }

    /// Removes `shard`'s file and gives its bytes back to the budget.
    fn remove_shard_file(&self, shard: &Shard) {
        let _ = std::fs::remove_file(self.shard_path(shard.number));
        let _ = self
            .space
            .used
            .fetch_update(Relaxed, Relaxed, |u| Some(u.saturating_sub(shard.capacity)));
    }

    /// Whether the tier holds a valid copy of the sample.
    pub fn contains(&self, index: u64) -> bool {
        self.lookup(index, |t, shard, slot| {
            t.record(shard, slot, index).map(|_| ())
        })
        .is_some()
    }

    /// Whether a write would be taken now: writes are not paused and the budget has room for
    /// another shard or the shard being filled has room.
    pub fn accepts_writes(&self, _index: u64) -> bool {
        if self.space.writes_paused() {
            return false;
        }
        let room = self.appender.locked().has_room(self.record_estimate);
        room || self.space.used.load(Relaxed) + self.new_shard_capacity(self.record_estimate)
            <= self.space.budget
    }

    /// Stores a sample's record. Returns whether it was written; a full budget or disk is not
    /// an error: the sample is still served, from the other tiers.
    pub fn write(&self, index: u64, data: &[u8]) -> bool {
        if index >= self.len || self.space.writes_paused() {
            return false;
        }
        self.last_used.store(self.space.now(), Relaxed);
        let Some((shard, offset, slot)) = self.reserve(data.len() as u64) else {
            return false;
        };
        let entry = Entry {
            sample: index,
            offset: offset as u32,
            len: data.len() as u32,
            crc: checksum(index, data),
        };
        let written = shard.file.write_all_at(data, offset).and_then(|()| {
            shard
                .file
                .write_all_at(&entry.encode(), entry_pos(shard.capacity, slot))
        });
        if let Err(e) = written {
            self.space
                .pause_writes(io_failure(e, &self.shard_path(shard.number)));
            return false;
        }
        if self.index[index as usize].swap(pack(shard.number, slot), Ordering::Release) == 0 {
            self.stored.fetch_add(1, Relaxed);
        }
        self.stored_bytes.fetch_add(data.len() as u64, Relaxed);
        true
    }

    /// The folder holding this dataset's shards.
    pub fn fingerprint(&self) -> Fingerprint {
        self.fingerprint
    }

    /// Whether this tier's folder is that of a dataset named `name`.
    pub fn name_matches(&self, name: &str) -> bool {
        self.dir
            .file_name()
            .is_some_and(|f| f.to_string_lossy() == folder_name(name, self.fingerprint))
    }

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
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.retain(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("shard-"))
        });
        files.sort();
        files
    }

    /// Where the record of sample `index` lives now: (file, byte offset of its payload, byte
    /// offset of its index entry).
    pub fn locate(&self, index: u64) -> Option<(PathBuf, u64, u64)> {
        let loc = self.index.get(index as usize)?.load(Relaxed);
        if loc == 0 {
            return None;
        }
        let (number, slot) = unpack(loc);
        let shard = self.shard(number)?;
        let pos = entry_pos(shard.capacity, slot) as usize;
        let e = Entry::decode(&shard.map[pos..pos + ENTRY_BYTES as usize])?.ok()?;
        Some((self.shard_path(number), e.offset as u64, pos as u64))
    }
}

/// The folder of a dataset's shards: its name (made safe for a path) and its fingerprint.
fn folder_name(dataset: &str, fingerprint: Fingerprint) -> String {
    // A user's dataset USER/NAME keeps its '/' apart as '@' (no other character becomes one):
    // the config's names hold no '/', and a user's fingerprint holds their uid.
    let safe: String = dataset
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else if c == '/' {
                '@'
            } else {
                '_'
            }
        })
        .collect();
    format!("{safe}-{fingerprint:032x}")
}

/// Says what a failed scratch write means, a full disk above all.
fn io_failure(e: std::io::Error, path: &Path) -> String {
    if e.kind() == std::io::ErrorKind::StorageFull {
        format!("the scratch disk is full ({})", path.display())
    } else {
        format!("writing {}: {e}", path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Bytes of a shard of 4 records of 16 bytes.
    const SHARD4: u64 = HEADER_BYTES + 4 * (16 + ENTRY_BYTES);

    fn tier(space: &Arc<ScratchSpace>, fp: Fingerprint) -> ScratchTier {
        // 10 samples of 16 bytes, 4 records per shard: shards of 4, 4 and 2 records.
        ScratchTier::open(space, "ds", fp, 10, 16, SHARD4).unwrap()
    }

    fn sample(i: u64) -> Vec<u8> {
        (0..16).map(|o| (i * 16 + o) as u8).collect()
    }

    #[test]
    fn shards_of_another_format_version_are_never_read() {
        let dir = tempfile::tempdir().unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = tier(&space, 1);
        for i in 0..10 {
            assert!(t.write(i, &sample(i)));
        }
        let files = t.shard_files();
        drop(t);
        // The same shard with the magic of format 2 (64-bit fingerprints), every other byte
        // as it was: not read, removed, and its samples fetched again.
        let first = &files[0];
        let mut bytes = std::fs::read(first).unwrap();
        bytes[0..8].copy_from_slice(b"LARDSHD2");
        std::fs::write(first, &bytes).unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = tier(&space, 1);
        assert!((0..4).all(|i| t.read(i).is_none()), "format 2's records");
        assert!(!first.exists(), "removed");
        assert!((4..10).all(|i| t.read(i).unwrap() == sample(i)));
        assert!(t.write(0, &sample(0)));
        assert_eq!(t.read(0).unwrap(), sample(0));
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
        assert_eq!(
            used,
            3 * HEADER_BYTES + 10 * (16 + ENTRY_BYTES),
            "the last shard is sized to fit"
        );
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

        // A new version of the data: nothing stale is served; the old shards are kept, idle,
        // until their space is needed.
        std::fs::write(
            dir.path().join("notes-0123456789abcdef0123456789abcdef"),
            "not ours",
        )
        .unwrap();
        let small = HEADER_BYTES + 12 * (16 + ENTRY_BYTES);
        let space = ScratchSpace::open(dir.path(), Some(used + small)).unwrap();
        let t2 = tier(&space, 2);
        space.keep_unused([t2.dir()]);
        assert!(t2.read(0).is_none());
        let old = dir.path().join(folder_name("ds", 1));
        assert!(old.exists(), "kept while there is room");
        assert_eq!(space.snapshot().used, used, "counted against the budget");
        for i in 0..10 {
            assert!(t2.write(i, &sample(i)), "room made for sample {i}");
        }
        assert!(!old.exists(), "removed when its space was needed");
        assert!(dir
            .path()
            .join("notes-0123456789abcdef0123456789abcdef")
            .exists());
        // A dataset no longer served: its folder idle, and taken back if it comes back.
        space.retire(t2.dir());
        let back = tier(&space, 2);
        assert_eq!(back.read(3).unwrap(), sample(3));
        assert!(space.snapshot().used <= used + small);
    }

    #[test]
    fn records_of_any_size_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let record = |i: u64| vec![i as u8; (i * i % 37) as usize];
        let t = ScratchTier::open(&space, "v", 1, 50, 20, 300).unwrap();
        for i in (0..50).rev() {
            assert!(t.write(i, &record(i)), "record {i}");
        }
        assert!(t.shard_files().len() > 3);
        assert!((0..50).all(|i| t.read(i).unwrap() == record(i)));
        drop(t);
        let t = ScratchTier::open(&space, "v", 1, 50, 20, 300).unwrap();
        assert!((0..50).all(|i| t.read(i).unwrap() == record(i)));
        // A rewrite appends a new copy; the last one wins, after a restart too.
        assert!(t.write(7, b"seven"));
        assert_eq!(t.read(7).unwrap(), &b"seven"[..]);
        drop(t);
        let t = ScratchTier::open(&space, "v", 1, 50, 20, 300).unwrap();
        assert_eq!(t.read(7).unwrap(), &b"seven"[..]);
    }

    #[test]
    fn a_crash_between_reserving_and_writing_leaves_a_hole_that_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = ScratchTier::open(&space, "c", 1, 10, 16, 4096).unwrap();
        for i in 0..10 {
            t.write(i, &sample(i));
        }
        // As if the writer of sample 4 had died before writing its entry.
        let (path, _, entry) = t.locate(4).unwrap();
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0; ENTRY_BYTES as usize], entry).unwrap();
        drop(t);
        let t = ScratchTier::open(&space, "c", 1, 10, 16, 4096).unwrap();
        assert!(t.read(4).is_none(), "the hole is absent");
        assert!((0..10)
            .filter(|&i| i != 4)
            .all(|i| t.read(i).unwrap() == sample(i)));
        assert!(t.write(4, &sample(4)));
        assert_eq!(t.read(4).unwrap(), sample(4));
        assert_eq!(space.snapshot().corrupt, 0);
    }

    #[test]
    fn corrupt_and_truncated_records_are_never_served() {
        let dir = tempfile::tempdir().unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = tier(&space, 1);
        for i in 0..10 {
            t.write(i, &sample(i));
        }
        let (path, payload, _) = t.locate(5).unwrap();
        let f = OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all_at(&[0xAA], payload + 3).unwrap();
        assert!(t.read(5).is_none());
        assert_eq!(space.snapshot().corrupt, 1);
        assert!(!t.contains(5), "forgotten, so it is refetched");
        assert!(
            t.write(5, &sample(5)),
            "a refetched sample is written again"
        );
        assert_eq!(t.read(5).unwrap(), sample(5));
        // A corrupt index entry.
        let (path, _, entry) = t.locate(2).unwrap();
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&[0x55], entry + 9)
            .unwrap();
        assert!(t.read(2).is_none());
        assert_eq!(space.snapshot().corrupt, 2);
        // Cut the last shard short: its records are gone, never misread.
        let (path, payload, _) = t.locate(9).unwrap();
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(payload + 4)
            .unwrap();
        assert!(t.read(9).is_none());
        assert_eq!(space.snapshot().corrupt, 3);
        drop(t);
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let t = tier(&space, 1);
        assert!(t.read(9).is_none(), "a cut shard is removed at start");
        assert_eq!(t.read(0).unwrap(), sample(0));
    }

    #[test]
    fn a_full_budget_stops_writes_without_failing() {
        let dir = tempfile::tempdir().unwrap();
        // Room for the first shard only.
        let space = ScratchSpace::open(dir.path(), Some(SHARD4)).unwrap();
        let t = tier(&space, 1);
        for i in 0..4 {
            assert!(t.write(i, &sample(i)));
        }
        assert!(!t.accepts_writes(4));
        assert!(!t.write(4, &sample(4)));
        assert!(t.read(4).is_none());
        assert!(space.snapshot().used <= space.snapshot().budget);
    }

    /// Two datasets: "a" filled the budget and has gone quiet; "b" needs room.
    fn quiet_a_and_b(
        dir: &Path,
        quiet: Duration,
    ) -> (Arc<ScratchSpace>, Arc<ScratchTier>, Arc<ScratchTier>) {
        // Room for three shards of 4 records.
        let space = ScratchSpace::with_quiet_after(dir, 3 * SHARD4, quiet);
        let a = Arc::new(ScratchTier::open(&space, "a", 1, 10, 16, SHARD4).unwrap());
        space.register(&a);
        for i in 0..10 {
            assert!(a.write(i, &sample(i)));
        }
        let b = Arc::new(ScratchTier::open(&space, "b", 2, 10, 16, SHARD4).unwrap());
        space.register(&b);
        (space, a, b)
    }

    #[test]
    fn a_quiet_dataset_gives_its_oldest_shards_to_another_and_every_byte_read_is_right() {
        let dir = tempfile::tempdir().unwrap();
        let (space, a, b) = quiet_a_and_b(dir.path(), Duration::ZERO);
        for i in 0..8 {
            assert!(b.write(i, &sample(100 + i)), "b takes a's oldest shards");
        }
        // a gave up its two full shards (samples 0-7), oldest first, and kept the one it was
        // filling (8, 9).
        assert!(space.snapshot().used <= 3 * SHARD4);
        for i in 0..8 {
            assert_eq!(b.read(i).unwrap(), sample(100 + i));
            assert!(a.read(i).is_none(), "sample {i} of a is gone");
        }
        for i in 8..10 {
            assert_eq!(a.read(i).unwrap(), sample(i));
        }
        assert_eq!(a.shard_files().len(), 1);
        // A restart finds the same: a's remaining shard (after a gap), b's two.
        drop((a, b));
        let space = ScratchSpace::open(dir.path(), Some(3 * SHARD4)).unwrap();
        let a = ScratchTier::open(&space, "a", 1, 10, 16, SHARD4).unwrap();
        let b = ScratchTier::open(&space, "b", 2, 10, 16, SHARD4).unwrap();
        let on_disk: u64 = (a.shard_files().iter().chain(&b.shard_files()))
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum();
        assert_eq!(space.snapshot().used, on_disk);
        assert!(on_disk <= 3 * SHARD4);
        for i in 0..10 {
            assert_eq!(a.read(i), (i >= 8).then(|| sample(i).into()));
            assert_eq!(b.read(i), (i < 8).then(|| sample(100 + i).into()));
        }
        // a goes on filling after its gap: a new shard, numbered after the last.
        assert!(!a.write(0, &sample(0)), "no room: b is not quiet yet");
    }

    #[test]
    fn a_dataset_in_use_keeps_its_shards() {
        let dir = tempfile::tempdir().unwrap();
        let (_space, a, b) = quiet_a_and_b(dir.path(), Duration::from_secs(3600));
        assert!(!b.write(0, &sample(100)), "a was used just now: b waits");
        for i in 0..10 {
            assert_eq!(a.read(i).unwrap(), sample(i));
        }
    }

    #[test]
    fn a_crash_during_eviction_loses_nothing_that_is_not_refetched_and_serves_no_wrong_byte() {
        let dir = tempfile::tempdir().unwrap();
        let (_space, a, _b) = quiet_a_and_b(dir.path(), Duration::ZERO);
        // The crash between forgetting shard 0's records and removing its file: the next
        // daemon finds the whole shard and serves its records again.
        let victim = a.shards.write().unwrap()[0].take().unwrap();
        assert_eq!(a.forget_shard(0), 4);
        assert!(a.read(0).is_none());
        drop((a, _b, _space));
        let space = ScratchSpace::open(dir.path(), Some(3 * SHARD4)).unwrap();
        let a = ScratchTier::open(&space, "a", 1, 10, 16, SHARD4).unwrap();
        for i in 0..10 {
            assert_eq!(a.read(i).unwrap(), sample(i), "sample {i}");
        }
        // The crash just after the file went: its records are gone (refetched from raw
        // storage), every other one is served as written.
        a.remove_shard_file(&victim);
        drop(a);
        let a = ScratchTier::open(&space, "a", 1, 10, 16, SHARD4).unwrap();
        for i in 0..10 {
            assert_eq!(a.read(i), (i >= 4).then(|| sample(i).into()), "sample {i}");
        }
    }

    #[test]
    fn a_read_of_a_shard_being_removed_gets_its_own_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let (_space, a, _b) = quiet_a_and_b(dir.path(), Duration::ZERO);
        // A reader that found shard 0 before it went keeps reading the removed file.
        let shard = a.shard(0).unwrap();
        assert!(a.evict_oldest_shard());
        assert!(!a.shard_files().iter().any(|p| shard_number(p) == Some(0)));
        assert_eq!(a.read_record(&shard, 0, 0).unwrap(), sample(0));
    }

    #[test]
    fn a_restarted_tier_goes_on_filling_its_last_shard() {
        let dir = tempfile::tempdir().unwrap();
        // The budget holds the one shard: after a restart, its free room is all there is.
        let space = ScratchSpace::open(dir.path(), Some(SHARD4)).unwrap();
        let t = tier(&space, 1);
        assert!(t.write(0, &sample(0)) && t.write(1, &sample(1)));
        drop(t);
        let space = ScratchSpace::open(dir.path(), Some(SHARD4)).unwrap();
        let t = tier(&space, 1);
        assert!(t.accepts_writes(2));
        assert!(t.write(2, &sample(2)) && t.write(3, &sample(3)));
        assert!(!t.accepts_writes(4));
        assert_eq!(t.shard_files().len(), 1);
        assert!((0..4).all(|i| t.read(i).unwrap() == sample(i)));
    }

    #[test]
    fn the_index_takes_under_one_percent_of_small_samples() {
        // 3x32x32 uint8 images with an int64 label, in 1 MiB shards.
        let dir = tempfile::tempdir().unwrap();
        let space = ScratchSpace::open(dir.path(), Some(1 << 30)).unwrap();
        let (n, record) = (2000u64, 3 * 32 * 32 + 8);
        let t = ScratchTier::open(&space, "cifar", 1, n, record, 1 << 20).unwrap();
        for i in 0..n {
            assert!(t.write(i, &vec![i as u8; record as usize]));
        }
        let files: u64 = t
            .shard_files()
            .iter()
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum();
        let overhead = (files - n * record) as f64 / (n * record) as f64;
        assert!(overhead < 0.01, "{:.3}%", overhead * 100.0);
    }
}
