//! The crate's modules form layers: at every level of the module tree, the sibling modules
//! depend on each other without a cycle (a use anywhere inside a module counts as its own). A
//! module and its own submodules are one unit at their parent's level and may refer to each
//! other freely. Test code (`#[cfg(test)]` modules) is left out: a test may reach across.
//!
//! The check reads the source files themselves: every `crate::`, `super::` and `self::` path,
//! `use` groups included, resolved to the deepest module it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every module file under `src/` (binaries aside), by module path.
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    fn walk(dir: &Path, prefix: &Module, out: &mut BTreeMap<Module, PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if prefix.is_empty() && name == "bin" {
                    continue;
                }
                let mut m = prefix.clone();
                m.push(name);
                walk(&path, &m, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let mut m = prefix.clone();
                if name != "mod" && !(prefix.is_empty() && name == "lib") {
                    m.push(name);
                }
                out.insert(m, path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &Vec::new(), &mut out);
    // Modules declared `#[cfg(test)] mod name;` are test code.
    let tests: Vec<Module> = out
        .iter()
        .flat_map(|(m, file)| {
            let text = std::fs::read_to_string(file).unwrap();
            let words: Vec<&str> = text.split_whitespace().collect();
            words
                .windows(3)
                .filter(|w| w[0] == "#[cfg(test)]" && w[1] == "mod" && w[2].ends_with(';'))
                .map(|w| {
                    let mut t = m.clone();
                    t.push(w[2].trim_end_matches(';').to_string());
                    t
                })
                .collect::<Vec<_>>()
        })
        .collect();
    for t in tests {
        out.remove(&t);
    }
    out
}

/// The text of a Rust file without comments, string and char literals, and `#[cfg(test)]`
/// items (what follows the attribute, up to its closing brace or semicolon).
fn code_of(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if b[i] == b'r' && (b[i..].starts_with(b"r#\"") || b[i..].starts_with(b"r\"")) {
            let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            i += 2 + hashes;
            while i < b.len() && !b[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
            out.push_str("\"\"");
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if b[i] == b'\'' && i + 2 < b.len() && (b[i + 2] == b'\'' || b[i + 1] == b'\\') {
            // A char literal ('a', '\n', '\''); a lifetime has no closing quote.
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
        } else if b[i..].starts_with(b"#[cfg(test)]") {
            i += b"#[cfg(test)]".len();
            let mut depth = 0;
            while i < b.len() {
                match b[i] {
                    b'{' => depth += 1,
                    b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            i += 1;
                            break;
                        }
                    }
                    b';' if depth == 0 => {
                        i += 1;
                        break;
                    }
                    _ => {}
                }
                i += 1;
            }
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// The paths a file's code names from its crate: each as written, its first segment
/// `crate`, `super` or `self` (groups in braces expanded).
fn paths_in(code: &str) -> Vec<Vec<String>> {
    fn ident_at(s: &[u8], mut i: usize) -> (String, usize) {
        let start = i;
        while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == b'_') {
            i += 1;
        }
        (String::from_utf8_lossy(&s[start..i]).into_owned(), i)
    }
    fn skip_ws(s: &[u8], mut i: usize) -> usize {
        while i < s.len() && s[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    }
    /// Parses a path (with groups) from `i`, prefix `prefix`; pushes every leaf path.
    fn path(s: &[u8], mut i: usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) -> usize {
        let mut p = prefix;
        loop {
            i = skip_ws(s, i);
            if i < s.len() && s[i] == b'{' {
                i += 1;
                loop {
                    i = skip_ws(s, i);
                    if i >= s.len() {
                        return i;
                    }
                    if s[i] == b'}' {
                        return i + 1;
                    }
                    if s[i] == b',' {
                        i += 1;
                        continue;
                    }
                    i = path(s, i, p.clone(), out);
                    // Skip `as name` and anything up to the next separator.
                    while i < s.len() && s[i] != b',' && s[i] != b'}' {
                        i += 1;
                    }
                }
            }
            let (name, j) = ident_at(s, i);
            if name.is_empty() {
                out.push(p);
                return i;
            }
            p.push(name);
            i = skip_ws(s, j);
            if s[i..].starts_with(b"::") {
                i += 2;
            } else {
                out.push(p);
                return i;
            }
        }
    }
    let s = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let boundary = i == 0 || !(s[i - 1].is_ascii_alphanumeric() || s[i - 1] == b'_');
        let head = ["crate", "super", "self"]
            .into_iter()
            .find(|h| boundary && s[i..].starts_with(format!("{h}::").as_bytes()));
        match head {
            Some(h) => i = path(s, i + h.len() + 2, vec![h.to_string()], &mut out),
            None => i += 1,
        }
    }
    out
}

/// The deepest module `path` (as written in module `from`) names.
fn resolve(
    from: &Module,
    is_dir_module: bool,
    path: &[String],
    mods: &BTreeMap<Module, PathBuf>,
) -> Option<Module> {
    // `self` and `super` are relative to the module the file is; a file `a/b.rs` is module
    // a::b, and so is `a/b/mod.rs`.
    let _ = is_dir_module;
    let mut base: Module = Vec::new();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => rest = &path[1..],
        Some("self") | Some("super") => {
            base = from.clone();
            while let Some(seg) = rest.first() {
                match seg.as_str() {
                    "self" => rest = &rest[1..],
                    "super" => {
                        base.pop()?;
                        rest = &rest[1..];
                    }
                    _ => break,
                }
            }
        }
        _ => return None,
    }
    let mut m = base;
    let mut best = m.clone();
    for seg in rest {
        m.push(seg.clone());
        if mods.contains_key(&m) {
            best = m.clone();
        } else {
            break;
        }
    }
    Some(best)
}

#[test]
fn modules_form_layers_without_cycles() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mods = modules(&src);
    assert!(mods.len() > 20, "found the modules: {:?}", mods.keys());
    // Edges between siblings, at every level: parent -> (from child, to child, why).
    let mut levels: BTreeMap<Module, BTreeSet<(String, String, String)>> = BTreeMap::new();
    for (m, file) in &mods {
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        let dir_module = file.file_name().is_some_and(|n| n == "mod.rs");
        for p in paths_in(&code) {
            let Some(to) = resolve(m, dir_module, &p, &mods) else {
                continue;
            };
            let common = m.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == m.len() || common == to.len() {
                continue; // an ancestor and its descendant: one unit
            }
            levels.entry(m[..common].to_vec()).or_default().insert((
                m[common].clone(),
                to[common].clone(),
                format!("{} uses {}", m.join("::"), p.join("::")),
            ));
        }
    }
    let mut cycles = Vec::new();
    for (parent, edges) in &levels {
        let graph: BTreeMap<&str, BTreeSet<&str>> =
            edges.iter().fold(BTreeMap::new(), |mut g, (a, b, _)| {
                g.entry(a.as_str()).or_default().insert(b.as_str());
                g
            });
        // A cycle: some edge a -> b where a is reachable from b.
        for (a, b, why) in edges {
            let mut seen = BTreeSet::new();
            let mut todo = vec![b.as_str()];
            let mut back = false;
            while let Some(n) = todo.pop() {
                if n == a {
                    back = true;
                    break;
                }
                if seen.insert(n) {
                    todo.extend(graph.get(n).into_iter().flatten().copied());
                }
            }
            if back {
                let at = if parent.is_empty() {
                    "crate".to_string()
                } else {
                    parent.join("::")
                };
                cycles.push(format!("in {at}: {a} -> {b} ({why}) and back"));
            }
        }
    }
    assert!(cycles.is_empty(), "module cycles:\n{}", cycles.join("\n"));
}

#[test]
fn the_checker_reads_paths_and_groups() {
    let code = code_of(
        "use crate::{a::B, c::{d, e::F}};\n// crate::x::y\nlet s = \"crate::q\";\nsuper::g();\n\
         #[cfg(test)]\nmod tests { use crate::z; }\n",
    );
    let paths = paths_in(&code);
    let joined: Vec<String> = paths.iter().map(|p| p.join("::")).collect();
    assert_eq!(
        joined,
        ["crate::a::B", "crate::c::d", "crate::c::e::F", "super::g"]
    );
}
