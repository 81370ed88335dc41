//! The shard file format: a header, records from the front, their index entries from the back.
//!
//! ```text
//! header (64 bytes): "LARDSHD3" | fingerprint u128 | shard number u64 | capacity u64 | 0...
//! records:           payload bytes, back to back, from byte 64 on
//! entry k (24 bytes, at capacity - 24 (k + 1)):
//!     sample u64 | offset u32 | len u32 | crc32(sample LE ++ payload) u32 | crc32(the first 20 bytes) u32
//! ```
//!
//! An entry of zeros is absent; an entry or payload whose checksum fails is corrupt. A file of
//! another format version (another magic) is never read: its dataset's samples are fetched
//! again and written in this one.

use memmap2::Mmap;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

/// The header of shard `number` of the dataset with `fingerprint`, `capacity` bytes long.
pub(super) fn header(fingerprint: u128, number: u64, capacity: u64) -> [u8; HEADER_BYTES as usize] {
    let mut h = [0u8; HEADER_BYTES as usize];
    h[0..8].copy_from_slice(FILE_MAGIC);
    h[8..24].copy_from_slice(&fingerprint.to_le_bytes());
    h[24..32].copy_from_slice(&number.to_le_bytes());
    h[32..40].copy_from_slice(&capacity.to_le_bytes());
    h
}

pub(super) const FILE_MAGIC: &[u8; 8] = b"LARDSHD3";
pub(super) const HEADER_BYTES: u64 = 64;
/// Bytes of one index entry.
pub const ENTRY_BYTES: u64 = 24;
/// Zero entries in a row a restart scans past (holes left by writes a crash interrupted; at most
/// one per concurrent writer) before it takes the rest of the entry area as unused.
pub(super) const MAX_HOLES: u64 = 256;
/// The largest shard: entries address payloads with 32-bit offsets.
pub const MAX_SHARD_BYTES: u64 = u32::MAX as u64;
pub(super) struct Shard {
    pub(super) number: u64,
    pub(super) file: File,
    pub(super) map: Mmap,
    pub(super) capacity: u64,
}

/// Where the next record of the shard being filled goes.
pub(super) struct Appender {
    /// The shard being filled, if any.
    pub(super) shard: Option<Arc<Shard>>,
    /// Next free payload byte.
    pub(super) tail: u64,
    /// Next free entry.
    pub(super) slot: u64,
}

impl Appender {
    /// Whether a record of `len` bytes and its entry fit in the shard being filled.
    pub(super) fn has_room(&self, len: u64) -> bool {
        self.shard
            .as_ref()
            .is_some_and(|s| self.tail + len + ENTRY_BYTES * (self.slot + 1) <= s.capacity)
    }
}

/// An index entry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Entry {
    pub(super) sample: u64,
    pub(super) offset: u32,
    pub(super) len: u32,
    pub(super) crc: u32,
}

impl Entry {
    pub(super) fn encode(&self) -> [u8; ENTRY_BYTES as usize] {
        let mut e = [0u8; ENTRY_BYTES as usize];
        e[0..8].copy_from_slice(&self.sample.to_le_bytes());
        e[8..12].copy_from_slice(&self.offset.to_le_bytes());
        e[12..16].copy_from_slice(&self.len.to_le_bytes());
        e[16..20].copy_from_slice(&self.crc.to_le_bytes());
        let check = crc32fast::hash(&e[0..20]);
        e[20..24].copy_from_slice(&check.to_le_bytes());
        e
    }

    /// None for an absent entry (zeros), Err for a corrupt one.
    pub(super) fn decode(e: &[u8]) -> Option<Result<Entry, ()>> {
        if e.iter().all(|&b| b == 0) {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(e[i..i + 4].try_into().unwrap());
        if crc32fast::hash(&e[0..20]) != u32_at(20) {
            return Some(Err(()));
        }
        Some(Ok(Entry {
            sample: u64::from_le_bytes(e[0..8].try_into().unwrap()),
            offset: u32_at(8),
            len: u32_at(12),
            crc: u32_at(16),
        }))
    }
}

pub(super) fn entry_pos(capacity: u64, slot: u64) -> u64 {
    capacity - ENTRY_BYTES * (slot + 1)
}

pub(super) fn pack(shard: u64, slot: u64) -> u64 {
    (shard + 1) << 32 | slot
}

pub(super) fn unpack(loc: u64) -> (u64, u64) {
    ((loc >> 32) - 1, loc & 0xFFFF_FFFF)
}

/// The number of the shard file `path` (`shard-NNNNNN.bin`).
pub(super) fn shard_number(path: &Path) -> Option<u64> {
    let name = path.file_name()?.to_str()?;
    name.strip_prefix("shard-")?
        .strip_suffix(".bin")?
        .parse()
        .ok()
        .filter(|&n| n < 1 << 32)
}

/// Gives `file` all the blocks of `size` bytes, and that length. (fs4's allocate alone leaves the
/// length short when the blocks a file already has cover `size`.)
pub(super) fn allocate(file: &File, size: u64) -> std::io::Result<()> {
    fs4::FileExt::allocate(file, size)?;
    if file.metadata()?.len() < size {
        file.set_len(size)?;
    }
    Ok(())
}

pub(super) fn checksum(index: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&index.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// Records are read in shuffled order: no readahead, which would fill the page cache with the
/// neighbours of every record read (tenfold the reads when the data does not fit in memory),
/// through the mapping (index entries) or `pread` (records).
pub(super) fn random_access(map: &Mmap, file: &File) {
    use std::os::fd::AsRawFd;
    let _ = map.advise(memmap2::Advice::Random);
    // SAFETY: advice on a descriptor this tier holds open.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
}
