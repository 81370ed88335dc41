//! The scratch disk, shared by every dataset's tier: its byte budget, the shard folders no
//! dataset serves now (kept until their space is needed), and whether writing is paused after
//! a failure.

use super::ScratchTier;
use crate::sync::Locked;
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// After a write failure, how long the tier waits before trying to write again.
const RETRY_WRITES_AFTER: Duration = Duration::from_secs(60);

/// The scratch disk, shared by all datasets: its byte budget and its health.
pub struct ScratchSpace {
    pub(super) root: PathBuf,
    pub(super) budget: u64,
    pub(super) used: AtomicU64,
    pub(super) corrupt: AtomicU64,
    pub(super) budget_full_logged: AtomicBool,
    /// Why writing stopped, and until when.
    pub(super) paused: Mutex<Option<(String, Instant)>>,
    /// Shard folders no dataset serves now (removed from the config, or an older version),
    /// oldest first, with the bytes each counts in `used`: kept until their space is needed.
    pub(super) idle: Mutex<Vec<(PathBuf, u64)>>,
    /// The datasets' tiers, which give up their oldest shards to another dataset when nobody
    /// has read or written them for `quiet_after`.
    pub(super) tiers: Mutex<Vec<std::sync::Weak<ScratchTier>>>,
    pub(super) quiet_after: Duration,
    /// The clock tiers note their last use on.
    pub(super) started: Instant,
}

/// How long a dataset's tier must go unread and unwritten before another dataset may take its
/// shards' space.
const QUIET_AFTER: Duration = Duration::from_secs(120);

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
        private_dir(root)
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
            idle: Mutex::new(vec![]),
            tiers: Mutex::new(Vec::new()),
            quiet_after: QUIET_AFTER,
            started: Instant::now(),
        }))
    }

    /// A space like this one whose tiers count as quiet after `quiet` (for tests).
    #[cfg(test)]
    pub(super) fn with_quiet_after(root: &Path, budget: u64, quiet: Duration) -> Arc<ScratchSpace> {
        let space = ScratchSpace::open(root, Some(budget)).unwrap();
        let mut space = Arc::try_unwrap(space).ok().unwrap();
        space.quiet_after = quiet;
        Arc::new(space)
    }

    /// Counts `tier` among those whose shards may give way to another dataset's.
    pub fn register(&self, tier: &Arc<ScratchTier>) {
        let mut tiers = self.tiers.locked();
        tiers.retain(|t| t.strong_count() > 0);
        tiers.push(Arc::downgrade(tier));
    }

    /// No longer counts `tier` (its dataset is gone: its folder is idle, whole).
    pub fn deregister(&self, tier: &ScratchTier) {
        let mut tiers = self.tiers.locked();
        tiers.retain(|t| t.upgrade().is_some_and(|t| !std::ptr::eq(t.as_ref(), tier)));
    }

    /// Milliseconds since the space opened (tiers note their last use in it).
    pub(super) fn now(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Removes the oldest shard of the tier (other than `asking`) that has gone longest unread
    /// and unwritten, if that is longer than `quiet_after`; false when there is none.
    pub(super) fn evict_quiet(&self, asking: &ScratchTier) -> bool {
        let quiet = self.quiet_after.as_millis() as u64;
        let now = self.now();
        let tiers: Vec<Arc<ScratchTier>> = {
            let tiers = self.tiers.locked();
            tiers.iter().filter_map(|t| t.upgrade()).collect()
        };
        let mut quiet_tiers: Vec<&Arc<ScratchTier>> = tiers
            .iter()
            .filter(|t| !std::ptr::eq(t.as_ref(), asking))
            .filter(|t| now.saturating_sub(t.last_used.load(Relaxed)) >= quiet)
            .collect();
        quiet_tiers.sort_by_key(|t| t.last_used.load(Relaxed));
        quiet_tiers.iter().any(|t| t.evict_oldest_shard())
    }

    /// Keeps the shard folders (`<name>-<32 hex digits>`, or 16 for those of shard format 2,
    /// which no dataset reads) no dataset uses (those of older versions of a dataset, of
    /// datasets no longer configured, or not open now) as idle: they
    /// count against the budget and are removed, oldest first, when a dataset needs the space,
    /// so a dataset commented out for a day, or one on a share not mounted yet, finds its
    /// shards again. Other files are left alone.
    pub fn keep_unused<'a>(&self, in_use: impl IntoIterator<Item = &'a Path>) {
        let in_use: Vec<&Path> = in_use.into_iter().collect();
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return;
        };
        let mut found = vec![];
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((_, hex)) = name.rsplit_once('-') else {
                continue;
            };
            let ours = (hex.len() == 32 || hex.len() == 16)
                && hex.chars().all(|c| c.is_ascii_hexdigit())
                && path.is_dir();
            if ours && !in_use.contains(&path.as_path()) {
                let modified = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                found.push((modified, path));
            }
        }
        found.sort();
        for (_, path) in found {
            let bytes = self.idle_folder(&path);
            self.used.fetch_add(bytes, Relaxed);
        }
    }

    /// Counts the shard folder `dir` of a tier no dataset serves any more (its shards already
    /// count against the budget) as idle: kept until its space is needed.
    pub fn retire(&self, dir: &Path) {
        self.idle_folder(dir);
    }

    /// Adds `dir` to the idle folders; the bytes its files take.
    pub(super) fn idle_folder(&self, dir: &Path) -> u64 {
        let bytes: u64 = std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        let mut idle = self.idle.locked();
        if idle.iter().any(|(p, _)| p == dir) {
            return 0;
        }
        tracing::info!(path = %dir.display(), bytes, "scratch shards no dataset serves: kept until their space is needed");
        idle.push((dir.to_path_buf(), bytes));
        bytes
    }

    /// Takes a retired folder back into use (its dataset is served again): the bytes it
    /// counted as idle, which the tier opening it counts again as its shards.
    pub(super) fn reclaim(&self, dir: &Path) -> u64 {
        let mut idle = self.idle.locked();
        let Some(k) = idle.iter().position(|(p, _)| p == dir) else {
            return 0;
        };
        let (_, bytes) = idle.remove(k);
        let _ = self
            .used
            .fetch_update(Relaxed, Relaxed, |u| Some(u.saturating_sub(bytes)));
        bytes
    }

    /// Removes the oldest idle folder; false when there is none.
    pub(super) fn evict_idle(&self) -> bool {
        let oldest = {
            let mut idle = self.idle.locked();
            if idle.is_empty() {
                return false;
            }
            idle.remove(0)
        };
        let (path, bytes) = oldest;
        tracing::info!(path = %path.display(), bytes, "removing idle scratch shards to make room");
        let _ = std::fs::remove_dir_all(&path);
        let _ = self
            .used
            .fetch_update(Relaxed, Relaxed, |u| Some(u.saturating_sub(bytes)));
        true
    }

    pub fn snapshot(&self) -> ScratchSnapshot {
        let paused = self.paused.locked();
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

    pub(super) fn writes_paused(&self) -> bool {
        let paused = self.paused.locked();
        paused
            .as_ref()
            .is_some_and(|(_, until)| Instant::now() < *until)
    }

    /// Stops writing for a while after a failure (a full disk, most often), with one clear log line.
    pub(super) fn pause_writes(&self, why: String) {
        let mut paused = self.paused.locked();
        tracing::error!(
            "scratch tier stops writing for {}s: {why}; samples are served from memory and raw storage",
            RETRY_WRITES_AFTER.as_secs()
        );
        *paused = Some((why, Instant::now() + RETRY_WRITES_AFTER));
    }

    /// Takes `bytes` of the budget for `asking` (removing idle folders, oldest first, then the
    /// oldest shards of datasets nobody has used for a while, to make room), or says why not.
    pub(super) fn reserve(&self, bytes: u64, asking: &ScratchTier) -> bool {
        let take = || {
            self.used
                .fetch_update(Relaxed, Relaxed, |used| {
                    (used.saturating_add(bytes) <= self.budget).then_some(used + bytes)
                })
                .is_ok()
        };
        let mut ok = take();
        while !ok && (self.evict_idle() || self.evict_quiet(asking)) {
            ok = take();
        }
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

/// Makes `dir` (and its parents) readable by the daemon alone: the tier holds decoded samples
/// of files other users may not read, whatever the umask the daemon was started with.
pub(super) fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let mode = std::fs::metadata(dir)?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}
