//! The datasets users added (`larder add`), kept across restarts in the daemon's state
//! directory. Each belongs to the user who added it and is named `USER/NAME`: a name under
//! another user's prefix cannot be had, so names are never taken over, and none clashes with
//! the config's (which hold no '/'). Only the owner (or root, or the daemon's own user)
//! replaces or removes one. The table is the config's `[[dataset]]` table, parsed and
//! checked by the same code; the daemon reads its files with the owner's rights.

use crate::config::DatasetConfig;
use crate::error::{quote, Error, Kind};
use crate::sync::Locked;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The file, in the state directory, that holds the added datasets.
pub const FILE: &str = "datasets.toml";

/// Most bytes of one added dataset's table (a config's table is a few hundred).
pub const MAX_TABLE_BYTES: usize = 16 << 10;

/// One added dataset as kept on disk.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// `USER/NAME`.
    pub name: String,
    /// Who added it: the files are read with their rights.
    pub owner: u32,
    /// The dataset's table, as TOML (without its name).
    pub table: String,
}

#[derive(Default, Serialize, Deserialize)]
struct OnDisk {
    #[serde(default, rename = "dataset")]
    datasets: Vec<Entry>,
}

/// The added datasets, and where they are kept.
pub struct Registry {
    /// The state directory (None: nothing is kept across restarts, for tests and tools).
    dir: Option<PathBuf>,
    entries: Mutex<Vec<Entry>>,
}

impl Registry {
    /// The datasets kept in `dir` (none when it holds no file yet). A file that does not parse
    /// is logged and moved aside for the admin (`datasets.toml.unreadable-TIME`), never fatal
    /// and never overwritten.
    pub fn load(dir: Option<&Path>) -> Registry {
        let entries = match dir.map(|d| d.join(FILE)) {
            Some(path) => match std::fs::read_to_string(&path) {
                Ok(text) => match toml::from_str::<OnDisk>(&text) {
                    Ok(d) => d.datasets,
                    Err(e) => {
                        // Kept aside for the admin, not overwritten by the next add.
                        let moved = std::fs::rename(&path, aside(&path));
                        tracing::error!(file = %path.display(), moved = moved.is_ok(), "the added datasets do not parse, so none is served; the file is kept aside: {e}");
                        vec![]
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![],
                Err(e) => {
                    let moved = std::fs::rename(&path, aside(&path));
                    tracing::error!(file = %path.display(), moved = moved.is_ok(), "the added datasets do not read, so none is served; the file is kept aside: {e}");
                    vec![]
                }
            },
            None => vec![],
        };
        Registry {
            dir: dir.map(Path::to_path_buf),
            entries: Mutex::new(entries),
        }
    }

    /// The added datasets' tables, each with its name and owner (one that no longer parses,
    /// after an upgrade say, is logged and left out).
    pub fn configs(&self) -> Vec<DatasetConfig> {
        self.lock()
            .iter()
            .filter_map(|e| match parse(e) {
                Ok(c) => Some(c),
                Err(err) => {
                    tracing::error!(dataset = %e.name, "an added dataset's table does not parse: {err}");
                    None
                }
            })
            .collect()
    }

    /// The entry named `name`.
    pub fn get(&self, name: &str) -> Option<Entry> {
        self.lock().iter().find(|e| e.name == name).cloned()
    }

    /// Adds `entry` in memory (`save` writes the file): Err if the name is taken and not
    /// `replace`d, or another user's, or the owner has `max_per_user` entries. Returns the
    /// entry it replaced.
    pub fn put(
        &self,
        entry: Entry,
        max_per_user: u32,
        replace: bool,
    ) -> Result<Option<Entry>, Error> {
        let mut entries = self.lock();
        match entries.iter_mut().find(|e| e.name == entry.name) {
            Some(e) if e.owner != entry.owner => Err(Error::new(
                Kind::Denied,
                format!("dataset {} belongs to another user", quote(&entry.name)),
            )),
            Some(_) if !replace => Err(Error::new(
                Kind::Exists,
                format!(
                    "dataset {} exists: remove it first (larder rm), or replace it",
                    quote(&entry.name)
                ),
            )),
            Some(e) => Ok(Some(std::mem::replace(e, entry))),
            None => {
                let theirs = entries.iter().filter(|e| e.owner == entry.owner).count();
                if theirs >= max_per_user as usize {
                    return Err(Error::new(
                        Kind::Exhausted,
                        format!(
                            "you have {theirs} datasets added, the most one user may \
                             (limits.max_datasets_per_user): remove one first (larder rm)"
                        ),
                    ));
                }
                entries.push(entry);
                Ok(None)
            }
        }
    }

    /// Takes back `tried` (put by a call whose dataset did not open): the entry it replaced,
    /// `before`, comes back, unless another call has put another entry of that name since.
    pub fn restore(&self, tried: &Entry, before: Option<Entry>) {
        let mut entries = self.lock();
        let Some(at) = entries.iter().position(|e| e == tried) else {
            return;
        };
        match before {
            Some(b) => entries[at] = b,
            None => drop(entries.remove(at)),
        }
    }

    /// Writes the entries as they are to the state file.
    pub fn save(&self) -> Result<(), Error> {
        let entries = self.lock();
        self.write(&entries)
    }

    /// Removes the entry `name` (its owner's, or anyone's for an admin) and writes the file.
    pub fn remove(&self, name: &str, by: u32, admin: bool) -> Result<Entry, Error> {
        let mut entries = self.lock();
        // Another user's dataset is answered as none at all: its name is not theirs to learn.
        let unknown = || {
            Error::new(
                Kind::UnknownDataset,
                format!("you added no dataset {}", quote(name)),
            )
        };
        let at = entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(unknown)?;
        if entries[at].owner != by && !admin {
            return Err(unknown());
        }
        let mut next = entries.clone();
        let gone = next.remove(at);
        self.write(&next)?;
        *entries = next;
        Ok(gone)
    }

    /// Writes `entries` to the state file: a file beside it, synced, renamed over it (a crash
    /// leaves the old list or the new one, never half of one).
    fn write(&self, entries: &[Entry]) -> Result<(), Error> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let text = toml::to_string(&OnDisk {
            datasets: entries.to_vec(),
        })
        .map_err(|e| Error::new(Kind::Internal, format!("writing the added datasets: {e}")))?;
        let failed = |e: std::io::Error| {
            Error::new(
                Kind::Precondition,
                format!(
                    "the daemon cannot keep added datasets in {} ({e}): set state_dir in its \
                     config to a folder it may write",
                    dir.display()
                ),
            )
        };
        {
            use std::os::unix::fs::DirBuilderExt;
            let mut b = std::fs::DirBuilder::new();
            b.recursive(true).mode(0o700).create(dir).map_err(failed)?;
        }
        // A name of its own, made here (never a file or link someone left there), readable by
        // the daemon alone: it lists every user's paths.
        let tmp = dir.join(format!("{FILE}.{}.tmp", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)
                .map_err(failed)?;
            f.write_all(text.as_bytes()).map_err(failed)?;
            f.sync_all().map_err(failed)?;
        }
        std::fs::rename(&tmp, dir.join(FILE)).map_err(failed)?;
        // The rename itself outlives a crash once the folder is synced.
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(failed)?;
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.locked()
    }
}

/// Where a state file that does not read is kept for the admin: `datasets.toml.unreadable-TIME`.
fn aside(path: &Path) -> PathBuf {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    path.with_extension(format!("toml.unreadable-{now}"))
}

/// The dataset table of `entry`, named and owned.
pub fn parse(entry: &Entry) -> anyhow::Result<DatasetConfig> {
    let mut c = parse_table(&entry.name, &entry.table)?;
    c.owner = Some(entry.owner);
    Ok(c)
}

/// A table a user sent for dataset `name`, as the config's `[[dataset]]` tables are read,
/// with what a user's table may not do refused: a relative path (relative to what?), `tcp`
/// (TCP clients have no identity; the owner's rights are not theirs to lend).
pub fn parse_table(name: &str, table: &str) -> anyhow::Result<DatasetConfig> {
    let mut value: toml::Table = toml::from_str(table)?;
    anyhow::ensure!(
        !value.contains_key("name"),
        "the table names no dataset: its name is given apart"
    );
    value.insert("name".into(), toml::Value::String(name.into()));
    if let Some(path) = value.get("path").and_then(|p| p.as_str()) {
        anyhow::ensure!(
            crate::objects::scheme_of(Path::new(path)).is_none(),
            "path {path}: a dataset in object storage is the admin's to add (in the daemon's \
             config): it is read with the daemon's credentials, not yours"
        );
    }
    let c = DatasetConfig::from_table(value)?;
    anyhow::ensure!(
        c.path.is_absolute(),
        "path {} is not absolute",
        c.path.display()
    );
    anyhow::ensure!(
        !c.tcp,
        "tcp = true is for the admin's datasets (TCP clients have no identity)"
    );
    // Without `kind`, the rest is checked when it is opened (as the kind its path is
    // recognised as, looked at with the owner's rights).
    crate::source::check(&c)?;
    Ok(c)
}

/// Whether `name` may be the NAME of `USER/NAME`: 1 to 64 letters, digits, '.', '_' or '-',
/// not starting with '.'.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, owner: u32) -> Entry {
        Entry {
            name: name.into(),
            owner,
            table: "path = \"/data/x.h5\"\nlabels = \"labels\"\n".into(),
        }
    }

    #[test]
    fn entries_persist_belong_to_their_owner_and_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let r = Registry::load(Some(dir.path()));
        r.put(entry("alice/a", 1001), 2, false).unwrap();
        r.put(entry("alice/b", 1001), 2, false).unwrap();
        r.save().unwrap();
        let e = r.put(entry("alice/c", 1001), 2, false).unwrap_err();
        assert_eq!(e.kind(), Kind::Exhausted);
        let e = r.put(entry("alice/a", 1002), 2, true).unwrap_err();
        assert_eq!(e.kind(), Kind::Denied, "another user cannot replace it");
        let e = r.put(entry("alice/a", 1001), 2, false).unwrap_err();
        assert_eq!(e.kind(), Kind::Exists, "nor its owner without replace");
        // A replacement that did not open gives the old entry back.
        let mut tried = entry("alice/a", 1001);
        tried.table = "path = \"/data/y.h5\"\n".into();
        let before = r.put(tried.clone(), 2, true).unwrap();
        r.restore(&tried, before);
        assert_eq!(r.get("alice/a"), Some(entry("alice/a", 1001)));
        let e = r.remove("alice/a", 1002, false).unwrap_err();
        assert_eq!(
            e.kind(),
            Kind::UnknownDataset,
            "nor remove it (nor learn it exists)"
        );
        let again = Registry::load(Some(dir.path()));
        let names: Vec<_> = again
            .configs()
            .into_iter()
            .map(|c| (c.name, c.owner))
            .collect();
        assert_eq!(
            names,
            [
                ("alice/a".to_string(), Some(1001)),
                ("alice/b".to_string(), Some(1001))
            ]
        );
        again.remove("alice/a", 1001, false).unwrap();
        again.remove("alice/b", 0, true).unwrap();
        assert!(Registry::load(Some(dir.path())).configs().is_empty());
    }

    #[test]
    fn tables_are_checked_as_the_configs_are() {
        assert!(parse_table("u/x", "path = \"/d/x.h5\"").is_ok());
        for bad in [
            "path = \"x.h5\"",
            "path = \"/d/x.h5\"\ntcp = true",
            "path = \"/d/x.h5\"\nname = \"other\"",
            "path = \"/d/x.h5\"\nowner = 0",
            "path = \"/d/x.h5\"\nkind = \"images\"\ncrop = 300\nresize = 256",
            "not toml",
        ] {
            assert!(parse_table("u/x", bad).is_err(), "{bad}");
        }
        assert!(valid_name("cifar-10_v2.1"));
        for bad in ["", ".hidden", "a/b", "a b", &"x".repeat(65)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
