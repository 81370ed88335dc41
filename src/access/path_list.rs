//! Lists of paths as they travel between processes (a reader's walk, an access check's files)
//! and as the daemon keeps them.

/// A list of paths, front-coded: each the length of the part it shares with the one before
/// (LEB128), then the rest of its bytes, then a NUL. A walk's paths come sorted, so each costs
/// about its name: a folder of a million files takes a third of the bytes of the paths
/// written out, and what the daemon keeps of a reader's walk is this.
pub fn path_list<'a>(paths: impl IntoIterator<Item = &'a std::path::PathBuf>) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let mut list = Vec::new();
    let mut before: &[u8] = &[];
    for p in paths {
        let p = p.as_os_str().as_bytes();
        let shared = before.iter().zip(p).take_while(|(a, b)| a == b).count();
        let mut n = shared as u64;
        loop {
            let byte = (n & 0x7f) as u8;
            n >>= 7;
            list.push(if n == 0 { byte } else { byte | 0x80 });
            if n == 0 {
                break;
            }
        }
        list.extend_from_slice(&p[shared..]);
        list.push(0);
        before = p;
    }
    list
}

/// The paths of a `path_list` (empty ones left out). A list that does not parse, or whose
/// paths would take more than 128 times its own bytes (a forged list's prefixes, repeated), is
/// refused.
pub fn paths_of(list: &[u8]) -> std::io::Result<Vec<std::path::PathBuf>> {
    let most = list.len().saturating_mul(128).saturating_add(1 << 20);
    let mut out = vec![];
    each_path(list, most, &mut |p| {
        out.push(p.to_path_buf());
        None::<()>
    })?;
    Ok(out)
}

/// Each path of a `path_list` in turn, holding only the one before (what a check of every
/// file needs, whatever the list's size), until `f` returns something, which is returned;
/// refused past `most` bytes of paths in all.
pub fn each_path<T>(
    list: &[u8],
    most: usize,
    f: &mut dyn FnMut(&std::path::Path) -> Option<T>,
) -> std::io::Result<Option<T>> {
    use std::os::unix::ffi::OsStrExt;
    let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
    let (mut before, mut total, mut at) = (Vec::<u8>::new(), 0usize, 0usize);
    while at < list.len() {
        let (mut shared, mut shift) = (0usize, 0u32);
        loop {
            let &byte = list.get(at).ok_or_else(|| bad("a path list cut short"))?;
            at += 1;
            if shift > 56 {
                return Err(bad("a path list's length does not parse"));
            }
            shared |= ((byte & 0x7f) as usize) << shift;
            shift += 7;
            if byte & 0x80 == 0 {
                break;
            }
        }
        let end = list[at..]
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| bad("a path list cut short"))?;
        if shared > before.len() {
            return Err(bad("a path list shares more than the path before it"));
        }
        before.truncate(shared);
        before.extend_from_slice(&list[at..at + end]);
        at += end + 1;
        total += before.len();
        if total > most {
            return Err(bad("a path list's paths take too many bytes"));
        }
        if !before.is_empty() {
            if let Some(found) = f(std::path::Path::new(std::ffi::OsStr::from_bytes(&before))) {
                return Ok(Some(found));
            }
        }
    }
    Ok(None)
}
