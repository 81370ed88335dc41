//! Datasets users added (`larder add`) are read with their owner's rights, not the daemon's:
//! every open, walk and read of their files runs on a thread switched to the owner's
//! file-system identity for that call (see `access::as_user`), so a registered dataset gives
//! its owner no byte they could not read themselves (a symlink in their folder to another
//! user's file, or to /etc/shadow, is refused by the kernel as it would refuse them), and a
//! 0600 file under a 0700 home reads while the daemon runs as its own user.

use super::{Opened, Provenance, RawSample, RawSource, Source};
use crate::access::{as_user, Identity};
use anyhow::{anyhow, Result};
use std::path::Path;
use std::sync::Arc;

/// The identity the files of a dataset owned by `owner` are read with: None (the daemon's own)
/// for root and the daemon's own user, else the owner with their groups.
pub fn reader(owner: Option<u32>) -> Option<Arc<Identity>> {
    let uid = owner?;
    if crate::access::is_admin_uid(uid) {
        return None;
    }
    Some(Arc::new(Identity::of_user_primary(uid)))
}

/// Runs `f` as `owner`; Err when the daemon cannot switch to them.
pub(super) fn run<T>(owner: &Identity, f: impl FnOnce() -> Result<T>) -> Result<T> {
    as_user(owner, f).map_err(|e| {
        anyhow!(
            "the daemon cannot read files as uid {} ({e}): it needs CAP_SETUID and CAP_SETGID \
             (root, or the unit's capabilities) to serve datasets users added",
            owner.uid
        )
    })?
}

/// Opens a dataset with `open` as `owner`, and reads it as them from then on.
pub fn open(owner: Arc<Identity>, open: impl FnOnce() -> Result<Opened>) -> Result<Opened> {
    let opened = run(&owner, open)?;
    Ok(Opened {
        source: Box::new(AsOwner {
            inner: opened.source,
            owner,
        }),
        ..opened
    })
}

/// A source whose file accesses run as its owner.
struct AsOwner {
    inner: Box<dyn Source>,
    owner: Arc<Identity>,
}

impl RawSource for AsOwner {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn read_range(&self, start: u64, count: u64) -> Result<Vec<RawSample>> {
        run(&self.owner, || self.inner.read_range(start, count))
    }

    fn read(&self, index: u64) -> Result<RawSample> {
        run(&self.owner, || self.inner.read(index))
    }

    fn read_granule(&self) -> u64 {
        self.inner.read_granule()
    }

    fn disk_bytes(&self) -> u64 {
        self.inner.disk_bytes()
    }

    fn disk_bytes_of(&self, index: u64) -> u64 {
        self.inner.disk_bytes_of(index)
    }

    fn disk_bytes_each(&self) -> Option<u64> {
        self.inner.disk_bytes_each()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn sample_name(&self, index: u64) -> String {
        self.inner.sample_name(index)
    }
}

impl Provenance for AsOwner {
    fn version(&self) -> String {
        run(&self.owner, || Ok(self.inner.version())).unwrap_or_else(|e| format!("{e}"))
    }

    fn changed(&self) -> Option<String> {
        // The owner's groups as they are now: one taken out of a group reads no more through
        // larder than they could themselves (the dataset is opened again as they are).
        let now = Identity::of_user_primary(self.owner.uid);
        if (now.gid, &now.groups) != (self.owner.gid, &self.owner.groups) {
            return Some(format!(
                "the groups of its owner (uid {}) changed",
                self.owner.uid
            ));
        }
        run(&self.owner, || Ok(self.inner.changed())).unwrap_or_else(|e| Some(format!("{e:#}")))
    }

    fn files(&self) -> crate::access::Files {
        self.inner.files()
    }

    fn root(&self) -> &Path {
        self.inner.root()
    }
}
