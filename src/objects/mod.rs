//! Raw storage in an object store: a dataset whose path is `s3://BUCKET/PREFIX` (S3, or a
//! server that speaks its API: MinIO, Ceph RGW, SeaweedFS) is read in byte ranges, one ranged
//! GET per read its source makes (a granule at a time where the source reads granules).
//!
//! Only the serving daemon talks to the store: it holds the admin's credentials (from the
//! environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT`,
//! `AWS_ALLOW_HTTP`; under systemd an `EnvironmentFile`), and it may reach the network. A
//! reader, which parses the bytes and has no network, asks the daemon for each list and range
//! on a channel of its own (`privsep::fetch`), which answers only within the dataset's prefix.
//!
//! Each object is read as it was listed: every GET carries the listed ETag (`If-Match`), so an
//! object replaced since is a "changed" error for its dataset, never a mix of two versions.

mod s3;

use anyhow::{ensure, Context, Result};
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::OnceLock;

/// The schemes a dataset's path may have, read as object storage.
pub const SCHEMES: &[&str] = &["s3"];

/// The most bytes one GET asks for (a WebDataset granule's span); a longer read is several.
pub const MOST_GET_BYTES: u64 = 64 << 20;

/// Objects a listing may hold.
pub const MOST_OBJECTS: usize = 10_000_000;

/// Ranged GETs made and the bytes they brought, since the daemon started (only the serving
/// daemon fetches, so these are the node's).
pub static GETS: AtomicU64 = AtomicU64::new(0);
pub static GOT_BYTES: AtomicU64 = AtomicU64::new(0);

/// The scheme of a path written as a URL (`SCHEME://...`), if it is one.
pub fn scheme_of(path: &Path) -> Option<&str> {
    let s = path.to_str()?;
    let (scheme, _) = s.split_once("://")?;
    (!scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '+'))
    .then_some(scheme)
}

/// Whether `path` names objects in an object store larder reads (`s3://...`).
pub fn is_url(path: &Path) -> bool {
    scheme_of(path).is_some_and(|s| SCHEMES.contains(&s))
}

/// Where objects are: a bucket, and a key (one object) or a prefix (a folder of them); for a
/// dataset's pattern, only the keys of that folder that start with `only` (the pattern's part
/// before its first `{`, `*` or `?`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub bucket: String,
    pub key: String,
    pub only: Option<String>,
}

impl Location {
    /// `s3://BUCKET/KEY` split; the key may be empty (the whole bucket). Refuses what is no
    /// object name: an empty bucket, `.` or `..` segments, empty segments.
    pub fn parse(path: &Path) -> Result<Location> {
        let s = path.to_str().context("a URL that is not UTF-8")?;
        let rest = s
            .strip_prefix("s3://")
            .with_context(|| format!("{s}: only s3:// URLs are read"))?;
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        ensure!(
            !bucket.is_empty()
                && bucket.len() <= 255
                && bucket
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c)),
            "{s}: {bucket:?} is not a bucket name"
        );
        let key = key.trim_end_matches('/');
        ensure!(
            key.is_empty()
                || key
                    .split('/')
                    .all(|p| !p.is_empty() && p != "." && p != ".."),
            "{s}: the key {key:?} has an empty, `.` or `..` part"
        );
        Ok(Location {
            bucket: bucket.to_string(),
            key: key.to_string(),
            only: None,
        })
    }

    /// The location a dataset's path reaches: the path itself, or for a pattern (a brace
    /// range, a glob) exactly the keys that start with its part before the first `{`, `*` or
    /// `?` (in the folder that part is in).
    pub fn scope_of(path: &Path) -> Result<Location> {
        let s = path.to_str().context("a URL that is not UTF-8")?;
        let Some(at) = s.find(['{', '*', '?']) else {
            return Location::parse(path);
        };
        let (folder, _) = s[..at]
            .rsplit_once('/')
            .context("a pattern without a bucket")?;
        let mut scope = Location::parse(Path::new(folder))?;
        let fixed = s[..at].strip_prefix("s3://").unwrap_or(&s[..at]);
        let (_, only) = fixed.split_once('/').unwrap_or((fixed, ""));
        scope.only = Some(only.to_string());
        Ok(scope)
    }

    /// Whether a listing of `key` may be asked within this location: the location, an object
    /// or prefix under it, or (for a pattern) its folder, whose listing is cut to the keys it
    /// holds.
    pub fn lists(&self, key: &str) -> bool {
        self.holds(key) || (self.only.is_some() && key == self.key)
    }

    /// The URL of the object `key` in this location's bucket.
    pub fn url_of(&self, key: &str) -> String {
        format!("s3://{}/{key}", self.bucket)
    }

    /// Whether `key` is this location's object or lies under its prefix (and, for a
    /// pattern, starts as it does).
    pub fn holds(&self, key: &str) -> bool {
        let under = self.key.is_empty()
            || key == self.key
            || key
                .strip_prefix(&self.key)
                .is_some_and(|rest| rest.starts_with('/'));
        under
            && self
                .only
                .as_ref()
                .is_none_or(|only| key.starts_with(only.as_str()))
    }
}

/// An object as listed: its key, size and version (ETag).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Object {
    pub bucket: String,
    pub key: String,
    pub size: u64,
    pub etag: Option<String>,
}

impl Object {
    pub fn url(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.key)
    }
}

/// What reads objects: the store itself (in the serving daemon) or the daemon, asked on a
/// reader's channel.
pub trait Fetch: Send + Sync {
    /// The objects at `at`: the one object its key names, else those under it as a folder
    /// (sorted by key).
    fn list(&self, at: &Location) -> Result<Vec<Object>>;
    /// Bytes `offset..offset + len` of `object`, as it was listed (a changed object is an
    /// error of kind `Changed`).
    fn get(&self, object: &Object, offset: u64, len: u64) -> Result<Vec<u8>>;
}

static FETCH: OnceLock<Box<dyn Fetch>> = OnceLock::new();

/// Reads objects through `fetch` from now on (a reader: its channel to the daemon). Only the
/// first call counts.
pub fn install(fetch: Box<dyn Fetch>) {
    let _ = FETCH.set(fetch);
}

/// What this process reads objects with: its channel where one was installed, else the
/// store, with the credentials of this process's environment.
pub fn fetcher() -> &'static dyn Fetch {
    FETCH.get_or_init(|| Box::new(s3::S3::default())).as_ref()
}

/// The error of an object that is no longer as it was listed.
pub fn changed(object: &Object, why: &str) -> anyhow::Error {
    crate::error::Error::new(
        crate::error::Kind::Changed,
        format!(
            "{} changed since the daemon listed it ({why}); the dataset is not served until \
             it is opened again",
            object.url()
        ),
    )
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_split_into_bucket_and_key() {
        let l = Location::parse(Path::new("s3://data/imagenet/train/")).unwrap();
        assert_eq!(
            (l.bucket.as_str(), l.key.as_str()),
            ("data", "imagenet/train")
        );
        assert!(l.holds("imagenet/train/a.tar"));
        assert!(l.holds("imagenet/train"));
        assert!(
            !l.holds("imagenet/train2/a.tar"),
            "a sibling is not under it"
        );
        assert!(!l.holds("imagenet/a.tar"));
        let whole = Location::parse(Path::new("s3://data")).unwrap();
        assert!(whole.key.is_empty() && whole.holds("anything"));
        for bad in [
            "s3:///key",
            "s3://b/a/../c",
            "s3://b/a//c",
            "s3://b a/k",
            "gs://b/k",
        ] {
            assert!(Location::parse(Path::new(bad)).is_err(), "{bad}");
        }
        let scope = |p: &str| Location::scope_of(Path::new(p)).unwrap();
        let wds = scope("s3://data/wds/train-{000..009}.tar");
        assert_eq!(
            (wds.key.as_str(), wds.only.as_deref()),
            ("wds", Some("wds/train-"))
        );
        assert!(wds.holds("wds/train-003.tar"));
        assert!(
            !wds.holds("wds/val-000.tar"),
            "exactly the pattern's prefix"
        );
        assert!(!wds.holds("wds"), "the folder itself is no object of it");
        assert!(wds.lists("wds") && !wds.lists("other"));
        let pq = scope("s3://data/pq/train-?.parquet");
        assert_eq!(pq.only.as_deref(), Some("pq/train-"));
        assert_eq!(scope("s3://data/pq").key, "pq");
        assert!(scope("s3://data/pq").only.is_none());
        assert!(is_url(Path::new("s3://b/k")));
        assert!(!is_url(Path::new("/data/s3://b")));
        assert!(
            !is_url(Path::new("gs://b/k")),
            "read as a URL, not an object store larder reads"
        );
        assert_eq!(scheme_of(Path::new("gs://b/k")), Some("gs"));
    }
}
