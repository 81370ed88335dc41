//! A record of the memory tier's lookups, for the benchmarks that set a policy beside the
//! offline optimum on the very requests it saw (benches/jobs.py). larderd writes one when
//! started with `LARDER_TRACE=FILE`: 16 bytes a lookup, little-endian: the dataset id (u32),
//! the outcome (u32: 0 a miss, read from a lower tier; 1 a hit; 2 joined a read of the same
//! sample already in flight), the sample index (u64). A benchmarking aid: the file is the
//! daemon user's, created afresh (never through a symlink), and off unless asked for.

use crate::sync::Locked;
use crate::tiers::eviction::Key;
use anyhow::{Context, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Mutex;

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Miss = 0,
    Hit = 1,
    Joined = 2,
}

pub struct Trace {
    out: Mutex<BufWriter<File>>,
}

impl Trace {
    /// A new trace in `path` (replacing a file there, never following a link).
    pub fn create(path: &Path) -> Result<Trace> {
        let _ = std::fs::remove_file(path);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
            .with_context(|| format!("creating the lookup trace {}", path.display()))?;
        Ok(Trace {
            out: Mutex::new(BufWriter::with_capacity(1 << 16, file)),
        })
    }

    pub fn record(&self, key: Key, outcome: Outcome) {
        let mut rec = [0u8; 16];
        rec[..4].copy_from_slice(&key.0.to_le_bytes());
        rec[4..8].copy_from_slice(&(outcome as u32).to_le_bytes());
        rec[8..].copy_from_slice(&key.1.to_le_bytes());
        let mut out = self.out.locked();
        if let Err(e) = out.write_all(&rec) {
            tracing::warn!("writing the lookup trace: {e}");
        }
    }

    pub fn flush(&self) {
        let mut out = self.out.locked();
        if let Err(e) = out.flush() {
            tracing::warn!("writing the lookup trace: {e}");
        }
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        self.flush();
    }
}
