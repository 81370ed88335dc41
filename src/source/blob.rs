//! A source's file, read by position: a local file (opened with this thread's rights, never
//! through a magic link) or an object in an object store (each read one ranged GET). The
//! sources whose readers take byte ranges read through this, and so read either.

use super::{file_version, Stamp};
use crate::objects::{self, Location, Object};
use crate::sync::Locked;
use anyhow::{ensure, Context, Result};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub enum Blob {
    Local {
        path: PathBuf,
        file: std::fs::File,
        stamp: Stamp,
    },
    Object {
        object: Object,
        /// Why it no longer reads as listed, once a GET said so.
        changed: Mutex<Option<String>>,
        /// Why the last GET that failed for want of the store failed (taken by `unavailable`):
        /// what a parser that keeps only an error's text (Parquet's) lost.
        unavailable: Mutex<Option<String>>,
    },
}

impl Blob {
    /// The regular file at `path`, opened without blocking (a FIFO would wait for a writer).
    pub fn open(path: &Path) -> Result<Blob> {
        let file = crate::access::open_no_magiclinks(path, libc::O_NONBLOCK)
            .with_context(|| format!("opening {}", path.display()))?;
        let m = file.metadata()?;
        ensure!(m.is_file(), "{} is not a regular file", path.display());
        Ok(Blob::Local {
            path: path.to_path_buf(),
            file,
            stamp: Stamp::of_metadata(&m),
        })
    }

    /// The objects at `url` (one object, or those under a prefix), sorted by key.
    pub fn list(url: &Path) -> Result<Vec<Blob>> {
        Ok(objects_at(url)?.into_iter().map(Blob::of_object).collect())
    }

    pub(super) fn of_object(object: Object) -> Blob {
        Blob::Object {
            object,
            changed: Mutex::default(),
            unavailable: Mutex::default(),
        }
    }

    /// Its path, or its URL.
    pub fn path(&self) -> PathBuf {
        match self {
            Blob::Local { path, .. } => path.clone(),
            Blob::Object { object, .. } => PathBuf::from(object.url()),
        }
    }

    /// Its name within its folder or prefix.
    pub fn name(&self) -> String {
        match self {
            Blob::Local { path, .. } => path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned(),
            Blob::Object { object, .. } => object
                .key
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_string(),
        }
    }

    /// Its size when opened or listed.
    pub fn size(&self) -> u64 {
        match self {
            Blob::Local { stamp, .. } => stamp.size(),
            Blob::Object { object, .. } => object.size,
        }
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        match self {
            Blob::Local { file, .. } => file.read_exact_at(buf, offset),
            Blob::Object {
                object,
                changed,
                unavailable,
            } => {
                // A long read is several GETs, each within what one may ask.
                let mut done = 0usize;
                while done < buf.len() {
                    let n = (buf.len() - done).min(objects::MOST_GET_BYTES as usize);
                    let at = offset + done as u64;
                    match objects::fetcher().get(object, at, n as u64) {
                        Ok(bytes) => buf[done..done + n].copy_from_slice(&bytes),
                        Err(e) => {
                            use crate::error::Kind;
                            let kind = crate::error::Error::kind_of(&e);
                            let slot = match kind {
                                Kind::Changed => Some(changed),
                                Kind::Reader => Some(unavailable),
                                _ => None,
                            };
                            if let Some(slot) = slot {
                                *slot.locked() = Some(format!("{e:#}"));
                            }
                            // The kind travels inside: a store that did not answer ends the
                            // stream rather than costing the sample.
                            let typed = crate::error::Error::new(kind, format!("{e:#}"));
                            return Err(std::io::Error::other(typed));
                        }
                    }
                    done += n;
                }
                Ok(())
            }
        }
    }

    /// All its bytes, if it holds at most `max` of them.
    pub fn read_all(&self, max: u64) -> Result<Vec<u8>> {
        let size = self.size();
        ensure!(
            size <= max,
            "{} takes {size} bytes, over the {max} it may",
            self.path().display()
        );
        let mut bytes = vec![0u8; size as usize];
        self.read_exact_at(&mut bytes, 0)?;
        Ok(bytes)
    }

    /// Reads what there is of `buf.len()` bytes at `offset` (fewer at its end).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        match self {
            Blob::Local { file, .. } => file.read_at(buf, offset),
            Blob::Object { .. } => {
                let n = (buf.len() as u64).min(self.size().saturating_sub(offset)) as usize;
                self.read_exact_at(&mut buf[..n], offset)?;
                Ok(n)
            }
        }
    }

    /// Why a read of it failed for want of the store since last asked, if one did (taken).
    pub fn unavailable(&self) -> Option<String> {
        match self {
            Blob::Local { .. } => None,
            Blob::Object { unavailable, .. } => unavailable.locked().take(),
        }
    }

    /// Why it no longer reads as it did when opened or listed, if it does not.
    pub fn changed(&self) -> Option<String> {
        match self {
            Blob::Local { path, stamp, .. } => stamp.changed(path),
            Blob::Object { changed, .. } => changed.locked().clone(),
        }
    }

    /// What identifies its contents, as a string (part of the scratch tier's fingerprint).
    pub fn version(&self) -> String {
        match self {
            Blob::Local { path, .. } => file_version(path),
            Blob::Object { object, .. } => format!(
                "{}:{}:{}",
                object.url(),
                object.size,
                object.etag.as_deref().unwrap_or("")
            ),
        }
    }
}

/// The objects at `url` (one object, or those under a prefix), as listed, sorted by key.
pub fn objects_at(url: &Path) -> Result<Vec<Object>> {
    let at = Location::parse(url)?;
    objects::fetcher()
        .list(&at)
        .with_context(|| format!("listing {}", url.display()))
}
