//! Shared helpers of the sources: reading a file whole within a cap, and telling whether a
//! file or folder changed since it was opened.

use anyhow::{ensure, Result};
use std::path::Path;

/// The bytes of the regular file at `path`, if it holds at most `max` of them. Opened without
/// blocking (a FIFO would wait for a writer), checked before it is read, read through a cap
/// (it may grow meanwhile).
pub fn read_capped(path: &Path, max: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    // By this thread's identity (a registered dataset's owner's), never through a magic link.
    let file = crate::access::open_no_magiclinks(path, libc::O_NONBLOCK | libc::O_NOCTTY)?;
    let meta = file.metadata()?;
    ensure!(meta.is_file(), "not a regular file");
    ensure!(
        meta.len() <= max,
        "the file takes {} bytes, over the {max} a sample may (limits.max_sample_bytes)",
        meta.len()
    );
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    ensure!(
        bytes.len() as u64 <= max,
        "the file grew over the {max} bytes a sample may (limits.max_sample_bytes) while read"
    );
    Ok(bytes)
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

    /// The file's size when stamped.
    pub fn size(&self) -> u64 {
        self.len
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
pub fn file_version(path: &Path) -> String {
    file_version_of(path, std::fs::metadata(path).ok().as_ref())
}

/// `file_version` from a status already taken (None: the file could not be stat'ed).
pub fn file_version_of(path: &Path, meta: Option<&std::fs::Metadata>) -> String {
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
