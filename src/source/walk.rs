//! A dataset's files as found on disk before any of them is parsed: what a reader is held to
//! (Landlock) and what a user must be able to read to have the dataset (the access check).
//! Only folders are listed and entries looked at (`stat`); no file is opened, so a crafted
//! file cannot have taken over the process that walks.
//!
//! - a file: itself;
//! - a folder: itself, and every folder and file beneath it (links followed, each folder
//!   entered once), as deep as [`MAX_DEPTH`] levels;
//! - a pattern (`{`, `*`, `?` or `[` in its last part): the folder it is in, walked as a folder;
//! - an object store's location: itself (no user's rights reach it).

use anyhow::{ensure, Context, Result};
use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// How deep beneath a dataset's folder the walk goes: what a reader may read beneath it is what
/// the walk found (an image folder's class folders and paired folders are two and three levels
/// down; this bounds the recursion, not the datasets).
pub const MAX_DEPTH: usize = 64;

/// The most entries a walk takes: a folder with more is refused (it would cost the daemon
/// its file list).
pub const MAX_ENTRIES: usize = 1 << 25;

/// Whether `path`'s last part is a pattern (a brace range or a glob).
pub fn is_pattern(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.to_string_lossy().contains(['{', '*', '?', '[']))
}

/// The dataset at `path`'s folders and files (see the module's rules), sorted; `progress` is
/// told the entries found so far after each (so a walk of a slow file system can say it is
/// alive between two entries).
pub fn walk(path: &Path, progress: &mut dyn FnMut(u64)) -> Result<Vec<PathBuf>> {
    Ok(walk_noting_links(path, progress)?.0)
}

/// `walk`, and the entries among them that are symbolic links (as their folders list them).
pub fn walk_noting_links(
    path: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    if crate::objects::is_url(path) {
        return Ok((vec![path.to_path_buf()], vec![]));
    }
    let (mut out, mut links) = (vec![], vec![]);
    let path = match is_pattern(path) {
        true => path.parent().unwrap_or(Path::new(".")),
        false => path,
    };
    let meta = std::fs::metadata(path).with_context(|| path.display().to_string())?;
    out.push(path.to_path_buf());
    if meta.is_dir() {
        let mut seen = HashSet::from([(meta.dev(), meta.ino())]);
        let mut found = Found {
            out: &mut out,
            links: &mut links,
            seen: &mut seen,
        };
        beneath(path, 1, &mut found, progress)?;
    }
    // Sorted by their bytes (any fixed order serves; comparing paths part by part is several
    // times slower over a million of them).
    for list in [&mut out, &mut links] {
        list.sort_unstable_by(|a, b| {
            a.as_os_str()
                .as_encoded_bytes()
                .cmp(b.as_os_str().as_encoded_bytes())
        });
        list.dedup();
    }
    Ok((out, links))
}

/// What a walk has found so far.
struct Found<'a> {
    out: &'a mut Vec<PathBuf>,
    links: &'a mut Vec<PathBuf>,
    seen: &'a mut HashSet<(u64, u64)>,
}

fn beneath(
    dir: &Path,
    depth: usize,
    found: &mut Found,
    progress: &mut dyn FnMut(u64),
) -> Result<()> {
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("reading folder {}", dir.display()))?;
    for e in entries {
        let e = e.with_context(|| format!("reading folder {}", dir.display()))?;
        let p = e.path();
        ensure!(
            found.out.len() < MAX_ENTRIES,
            "{} holds over {MAX_ENTRIES} files and folders",
            dir.display()
        );
        progress(found.out.len() as u64);
        // A file is listed as the folder says it is (no stat: a folder of a million images
        // would pay a million). Folders are looked at (each entered once), and links followed:
        // a link to a file the user may not read is refused when read (and by the access
        // check), not hidden.
        let kind = e.file_type().ok();
        if kind.is_some_and(|t| t.is_file()) {
            found.out.push(p);
            continue;
        }
        if kind.is_some_and(|t| t.is_symlink()) {
            found.links.push(p.clone());
        }
        found.out.push(p.clone());
        let Ok(meta) = std::fs::metadata(&p) else {
            continue;
        };
        if meta.is_dir() && depth < MAX_DEPTH && found.seen.insert((meta.dev(), meta.ino())) {
            beneath(&p, depth + 1, found, progress)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_walks_whole_each_folder_once_and_a_pattern_its_folder() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let deep = root.join("a/b/c/d/e");
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(root.join("a/one.jpg"), b"1").unwrap();
        std::fs::write(root.join("a/b/c/d/four.jpg"), b"4").unwrap();
        std::fs::write(deep.join("five.jpg"), b"5").unwrap();
        let too_deep = root.join(vec!["z"; MAX_DEPTH + 1].join("/"));
        std::fs::create_dir_all(&too_deep).unwrap();
        std::fs::write(too_deep.join("gone.jpg"), b"6").unwrap();
        // A loop of links is walked once.
        std::os::unix::fs::symlink(root, root.join("a/loop")).unwrap();
        let found = walk(root, &mut |_| {}).unwrap();
        let rel: Vec<_> = found
            .iter()
            .map(|p| p.strip_prefix(root).unwrap().to_string_lossy().into_owned())
            .collect();
        assert!(rel.contains(&"a/one.jpg".to_string()), "{rel:?}");
        assert!(rel.contains(&"a/b/c/d/e/five.jpg".to_string()), "{rel:?}");
        assert!(
            !rel.iter().any(|p| p.contains("gone")),
            "past the depth: {rel:?}"
        );
        assert!(!rel.iter().any(|p| p.starts_with("a/loop/")), "{rel:?}");
        let file = root.join("a/one.jpg");
        assert_eq!(walk(&file, &mut |_| {}).unwrap(), vec![file.clone()]);
        let pattern = root.join("a/{0..9}.tar");
        let found = walk(&pattern, &mut |_| {}).unwrap();
        assert_eq!(found[0], root.join("a"));
        assert!(found.contains(&file) && found.contains(&root.join("a/b/c/d/four.jpg")));
        assert!(walk(&root.join("missing"), &mut |_| {}).is_err());
    }
}
