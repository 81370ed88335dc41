//! LMDB environments (`kind = "lmdb"`), as BasicSR keeps super-resolution data: a folder such as
//! `DIV2K_train_HR_sub.lmdb` holding `data.mdb`, its main database mapping each key
//! (`0001_s001`) to an encoded image (PNG or JPEG bytes), and `meta_info.txt` listing the keys in
//! order (`0001_s001.png (480,480,3) 1`). Further environments give paired fields matched by key
//! (a low-resolution `..._LR_bicubic_X4_sub.lmdb` beside the high-resolution one).
//!
//! The data file is read here, not through the LMDB library: its B+tree is walked once at open
//! with positioned reads, recording where each value lies, and a sample is then one read of its
//! value's bytes. Nothing is mapped, no lock file is opened or made, nothing is written (what
//! `MDB_RDONLY | MDB_NOLOCK` promises), and a forged file is an error naming it, never a crash:
//! every page number, offset and size is checked against the file.
//!
//! The file format (LMDB 0.9, data version 1; 64-bit): two meta pages, the one with the larger
//! transaction id current; pages of `psize` bytes with a 16-byte header (page number, flags,
//! lower and upper bounds of the free space, or an overflow run's page count); branch and leaf
//! pages hold 2-byte offsets to nodes (8-byte header: data size or child page, flags, key size;
//! then the key and, in a leaf, the value or the first page of its overflow run).

use super::{file_version, read_capped, Format, Opened, Provenance, RawSample, RawSource, Stamp};
use crate::config::keys::keys_of;
use crate::config::{DatasetConfig, Limits, TrainCrop};
use crate::fields::{Schema, Value};
use crate::pipeline::Preprocess;
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// LMDB environments (`kind = "lmdb"`).
pub struct Lmdb;

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetKeys {
    /// The file listing the keys in order (default: `meta_info.txt` in the first field's
    /// environment, when there; else key order).
    #[serde(default)]
    meta_info: Option<PathBuf>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FieldKeys {
    /// The field's environment, relative to the dataset's path (default: the path itself).
    #[serde(default)]
    lmdb: Option<PathBuf>,
}

impl Format for Lmdb {
    fn name(&self) -> &'static str {
        "lmdb"
    }

    fn reads_objects(&self) -> std::result::Result<(), String> {
        Err(
            "LMDB is read by following its B-tree's pages at random offsets of data.mdb (a \
             request to the store each), which an object store serves slowly: keep it on a \
             local or shared filesystem"
                .into(),
        )
    }

    fn recognizes(&self, path: &Path) -> bool {
        (path.is_dir() && path.join("data.mdb").is_file())
            || (path.is_file() && path.extension().is_some_and(|e| e == "mdb"))
    }

    fn dataset_keys(&self) -> Vec<&'static str> {
        keys_of::<DatasetKeys>()
    }

    fn field_keys(&self) -> Vec<&'static str> {
        keys_of::<FieldKeys>()
    }

    fn check(&self, c: &DatasetConfig) -> Result<()> {
        let _: DatasetKeys = super::dataset_options(self, c)?;
        for f in &c.fields {
            let _: FieldKeys = super::field_options(self, f)?;
        }
        super::check_crop_fits(self, c)
    }

    fn default_crop(&self) -> Option<u32> {
        None
    }

    fn default_train_crop(&self) -> TrainCrop {
        TrainCrop::Random
    }

    fn open(&self, c: &DatasetConfig, limits: &Limits) -> Result<Opened> {
        let keys: DatasetKeys = super::dataset_options(self, c)?;
        let mut fields = c.fields.clone();
        if fields.is_empty() {
            fields.push(crate::config::FieldConfig::named("image"));
        }
        let envs: Vec<(String, PathBuf)> = fields
            .iter()
            .map(|f| {
                let k: FieldKeys = super::field_options(self, f)?;
                Ok((f.name.clone(), c.path.join(k.lmdb.unwrap_or_default())))
            })
            .collect::<Result<_>>()?;
        let meta_info = keys.meta_info.map(|m| c.path.join(m));
        let mut source = LmdbSource::open(&c.path, &envs, meta_info.as_deref())?;
        source.max_value_bytes = limits.max_sample_bytes;
        let resize = super::resize_of(self, c);
        let reference = fields[0].name.clone();
        let (mut ops, mut specs) = (vec![], vec![]);
        for f in &fields {
            let (op, spec) =
                super::images::image_field(c, f, Some(&reference), &resize, "an LMDB dataset")?;
            ops.push(op);
            specs.push(spec);
        }
        Ok(Opened {
            source: Box::new(source),
            preprocess: Preprocess::Images { ops, resize },
            schema: Schema::new(specs)?,
            format: &Lmdb,
        })
    }
}

const MAGIC: u32 = 0xBEEF_C0DE;
const DATA_VERSION: u32 = 1;
const PAGE_HEADER: usize = 16;
const NODE_HEADER: usize = 8;
const P_BRANCH: u16 = 0x01;
const P_LEAF: u16 = 0x02;
const P_OVERFLOW: u16 = 0x04;
const P_META: u16 = 0x08;
const P_LEAF2: u16 = 0x20;
const F_BIGDATA: u16 = 0x01;
const F_SUBDATA: u16 = 0x02;
const F_DUPDATA: u16 = 0x04;
/// Database flags that give keys several values (never how BasicSR writes).
const MDB_DUPSORT: u16 = 0x04;
/// No root page: an empty database.
const P_INVALID: u64 = u64::MAX;
/// Deeper than any real tree (a 4 KiB page holds at least two keys).
const MAX_DEPTH: u16 = 64;

fn bytes<const N: usize>(b: &[u8], at: usize) -> Result<[u8; N]> {
    b.get(at..at + N)
        .and_then(|s| s.try_into().ok())
        .with_context(|| format!("{N} bytes at {at} are past the page's end"))
}

fn u16_at(b: &[u8], at: usize) -> Result<u16> {
    Ok(u16::from_le_bytes(bytes(b, at)?))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32> {
    Ok(u32::from_le_bytes(bytes(b, at)?))
}

fn u64_at(b: &[u8], at: usize) -> Result<u64> {
    Ok(u64::from_le_bytes(bytes(b, at)?))
}

/// What a meta page says of the main database.
#[derive(Debug, Clone, Copy)]
struct Meta {
    psize: u64,
    txnid: u64,
    flags: u16,
    depth: u16,
    entries: u64,
    root: u64,
}

impl Meta {
    /// The meta page at the start of `page` (its header included), if it is one.
    fn parse(page: &[u8]) -> Result<Meta> {
        ensure!(
            u16_at(page, 10)? & P_META != 0,
            "not an LMDB data file (no meta page)"
        );
        ensure!(
            u32_at(page, 16)? == MAGIC,
            "not an LMDB data file (bad magic)"
        );
        let version = u32_at(page, 20)?;
        ensure!(
            version == DATA_VERSION,
            "LMDB data version {version}; larder reads version {DATA_VERSION} (LMDB 0.9)"
        );
        // The free database's first word holds the page size; the main database follows it.
        Ok(Meta {
            psize: u32_at(page, 40)? as u64,
            flags: u16_at(page, 88 + 4)?,
            depth: u16_at(page, 88 + 6)?,
            entries: u64_at(page, 88 + 32)?,
            root: u64_at(page, 88 + 40)?,
            txnid: u64_at(page, 144)?,
        })
    }
}

/// Where one value lies in a data file.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    key: Vec<u8>,
    at: u64,
    len: u64,
}

/// Every key of the main database of the data file `file` (`size` bytes), in key order, with
/// where its value lies.
fn entries(file: &std::fs::File, size: u64) -> Result<Vec<Entry>> {
    let read = |at: u64, len: usize| -> Result<Vec<u8>> {
        let end = at.checked_add(len as u64).filter(|&e| e <= size);
        ensure!(
            end.is_some(),
            "{len} bytes at {at} are past the file's end ({size} bytes)"
        );
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, at)?;
        Ok(buf)
    };
    let first = Meta::parse(&read(0, 152.min(size as usize))?)?;
    let psize = first.psize;
    ensure!(
        psize.is_power_of_two() && (512..=65536).contains(&psize),
        "a page size of {psize} bytes is not one LMDB makes"
    );
    let meta = match read(psize, 152).and_then(|p| Meta::parse(&p)) {
        Ok(second) if second.txnid > first.txnid => second,
        _ => first,
    };
    ensure!(
        meta.flags & MDB_DUPSORT == 0,
        "its main database keeps several values per key (MDB_DUPSORT); larder reads one value per key"
    );
    let mut out = vec![];
    if meta.root == P_INVALID {
        return Ok(out);
    }
    ensure!(
        (1..=MAX_DEPTH).contains(&meta.depth),
        "a tree {} levels deep",
        meta.depth
    );
    let pages = size / psize;
    let ps = psize as usize;
    // Depth first, children in order: the cursor's order, the keys' sorted order.
    let mut stack = vec![(meta.root, 1u16)];
    let mut visited = std::collections::HashSet::new();
    // Keys copied so far: a forged tree whose nodes share one key many times is refused
    // before they take more than the file itself.
    let mut key_bytes = 0u64;
    while let Some((pgno, level)) = stack.pop() {
        ensure!(visited.insert(pgno), "its tree reaches page {pgno} twice");
        ensure!(
            pgno < pages,
            "page {pgno} is past the file's end ({pages} pages)"
        );
        let page = read(pgno * psize, ps)?;
        let what = || format!("page {pgno}");
        ensure!(
            u64_at(&page, 0)? == pgno,
            "page {pgno} says it is page {}",
            u64_at(&page, 0)?
        );
        let flags = u16_at(&page, 10)?;
        let (lower, upper) = (u16_at(&page, 12)? as usize, u16_at(&page, 14)? as usize);
        ensure!(
            lower >= PAGE_HEADER
                && lower <= upper
                && upper <= ps
                && (lower - PAGE_HEADER).is_multiple_of(2),
            "page {pgno}: free space {lower}..{upper} is not within the page"
        );
        let node = |i: usize| -> Result<usize> {
            let ptr = u16_at(&page, PAGE_HEADER + 2 * i)? as usize;
            ensure!(
                ptr >= upper && ptr + NODE_HEADER <= ps,
                "node {i} at {ptr} is outside the page's nodes"
            );
            Ok(ptr)
        };
        let n = (lower - PAGE_HEADER) / 2;
        if flags & P_BRANCH != 0 {
            ensure!(
                level < meta.depth && n > 0,
                "page {pgno}: a branch at level {level} of {}",
                meta.depth
            );
            for i in (0..n).rev() {
                let ptr = node(i).with_context(what)?;
                let lo = u16_at(&page, ptr)? as u64;
                let hi = u16_at(&page, ptr + 2)? as u64;
                let top = u16_at(&page, ptr + 4)? as u64;
                stack.push((lo | hi << 16 | top << 32, level + 1));
            }
        } else if flags & P_LEAF != 0 && flags & P_LEAF2 == 0 {
            ensure!(
                level == meta.depth,
                "page {pgno}: a leaf at level {level} of {}",
                meta.depth
            );
            for i in 0..n {
                let ptr = node(i).with_context(what)?;
                let len = u16_at(&page, ptr)? as u64 | (u16_at(&page, ptr + 2)? as u64) << 16;
                let nflags = u16_at(&page, ptr + 4)?;
                let ksize = u16_at(&page, ptr + 6)? as usize;
                let key_at = ptr + NODE_HEADER;
                key_bytes += ksize as u64 + NODE_HEADER as u64;
                ensure!(
                    key_bytes <= size && (out.len() as u64) < meta.entries,
                    "its tree holds more than its meta page's {} entries, or keys larger than the file",
                    meta.entries
                );
                let key = page
                    .get(key_at..key_at + ksize)
                    .with_context(|| format!("page {pgno}: node {i}'s key is past the page's end"))?
                    .to_vec();
                ensure!(
                    nflags & (F_SUBDATA | F_DUPDATA) == 0,
                    "key {:?} holds a named database or several values; larder reads one value per key",
                    String::from_utf8_lossy(&key)
                );
                let at = if nflags & F_BIGDATA != 0 {
                    let first = u64_at(&page, key_at + ksize)
                        .with_context(|| format!("page {pgno}: node {i}'s overflow page"))?;
                    ensure!(
                        first < pages,
                        "an overflow page {first} past the file's end"
                    );
                    let head = read(first * psize, PAGE_HEADER)?;
                    let run = u32_at(&head, 12)? as u64;
                    ensure!(
                        u64_at(&head, 0)? == first
                            && u16_at(&head, 10)? & P_OVERFLOW != 0
                            && len + PAGE_HEADER as u64 <= run.saturating_mul(psize)
                            && first.saturating_add(run) <= pages,
                        "key {:?}: its {len}-byte value's overflow pages at {first} are not a run of the file's",
                        String::from_utf8_lossy(&key)
                    );
                    first * psize + PAGE_HEADER as u64
                } else {
                    ensure!(
                        key_at + ksize + len as usize <= ps,
                        "page {pgno}: node {i}'s value is past the page's end"
                    );
                    pgno * psize + (key_at + ksize) as u64
                };
                out.push(Entry { key, at, len });
            }
        } else {
            bail!("page {pgno} is neither a branch nor a leaf (flags {flags:#x})");
        }
    }
    ensure!(
        out.len() as u64 == meta.entries,
        "its meta page counts {} entries; its tree holds {}",
        meta.entries,
        out.len()
    );
    Ok(out)
}

/// An environment's data file: `data.mdb` in its folder, or the file itself (`MDB_NOSUBDIR`).
fn data_file(env: &Path) -> PathBuf {
    if env.is_dir() {
        env.join("data.mdb")
    } else {
        env.to_path_buf()
    }
}

/// The keys `meta_info.txt` lists, in its order: each line's text before its first dot, as
/// BasicSR reads them.
fn meta_keys(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.split('.').next().unwrap_or(l).to_string())
        .collect()
}

/// An open data file: its path, the file and its stamp at open.
struct Env {
    path: PathBuf,
    file: std::fs::File,
    stamp: Stamp,
}

pub struct LmdbSource {
    path: PathBuf,
    envs: Vec<Env>,
    names: Vec<String>,
    keys: Vec<String>,
    /// Each sample's values, (offset, size) per field in field order.
    values: Vec<(u64, u64)>,
    /// Where the order came from (a meta_info file, or the keys' order).
    order: String,
    /// Each field's environment (an index into `envs`).
    env_of: Vec<usize>,
    access: Arc<[PathBuf]>,
    max_value_bytes: u64,
}

impl LmdbSource {
    /// The dataset at `path` of fields `envs` (name, environment), in the order `meta_info`
    /// lists (default: the first environment's `meta_info.txt`, else key order).
    fn open(path: &Path, envs: &[(String, PathBuf)], meta_info: Option<&Path>) -> Result<Self> {
        let mut opened: Vec<Env> = vec![];
        let mut indexes: Vec<HashMap<Vec<u8>, (u64, u64)>> = vec![];
        let mut first_keys = vec![];
        let mut access = vec![path.to_path_buf()];
        // One environment serving several fields is read once.
        let mut env_of = vec![];
        for (name, env) in envs {
            let data = data_file(env);
            if let Some(k) = opened.iter().position(|e| e.path == data) {
                env_of.push(k);
                continue;
            }
            let file = crate::access::open_no_magiclinks(&data, libc::O_NONBLOCK)
                .with_context(|| format!("field {name:?}: opening {}", data.display()))?;
            let m = file.metadata()?;
            ensure!(m.is_file(), "{} is not a regular file", data.display());
            let all = entries(&file, m.len())
                .with_context(|| format!("field {name:?}: reading {}", data.display()))?;
            super::found(1);
            if opened.is_empty() {
                first_keys = all.iter().map(|e| e.key.clone()).collect();
            }
            indexes.push(all.into_iter().map(|e| (e.key, (e.at, e.len))).collect());
            if env.as_path() != data {
                access.push(env.clone());
            }
            access.push(data.clone());
            env_of.push(opened.len());
            opened.push(Env {
                path: data,
                file,
                stamp: Stamp::of_metadata(&m),
            });
        }
        let meta_info = meta_info.map(Path::to_path_buf).or_else(|| {
            let m = envs[0].1.join("meta_info.txt");
            (envs[0].1.is_dir() && m.is_file()).then_some(m)
        });
        let (keys, order): (Vec<Vec<u8>>, String) = match &meta_info {
            Some(m) => {
                let text =
                    read_capped(m, 1 << 30).with_context(|| format!("reading {}", m.display()))?;
                let text = String::from_utf8(text)
                    .with_context(|| format!("{} is not UTF-8 text", m.display()))?;
                access.push(m.clone());
                (
                    meta_keys(&text)
                        .into_iter()
                        .map(String::into_bytes)
                        .collect(),
                    format!("order of {}", m.display()),
                )
            }
            None => (first_keys, "key order".into()),
        };
        ensure!(!keys.is_empty(), "{}: no samples", path.display());
        let mut values = Vec::with_capacity(keys.len() * envs.len());
        for key in &keys {
            for ((name, env), &k) in envs.iter().zip(&env_of) {
                let v = indexes[k].get(key).with_context(|| {
                    format!(
                        "field {name:?}: {} has no key {:?}{}",
                        env.display(),
                        String::from_utf8_lossy(key),
                        match &meta_info {
                            Some(m) => format!(" (listed in {})", m.display()),
                            None => " (a key of the first field's environment)".into(),
                        }
                    )
                })?;
                values.push(*v);
            }
        }
        access.dedup();
        Ok(LmdbSource {
            path: path.to_path_buf(),
            envs: opened,
            names: envs.iter().map(|(n, _)| n.clone()).collect(),
            keys: keys
                .into_iter()
                .map(|k| String::from_utf8_lossy(&k).into_owned())
                .collect(),
            values,
            order,
            env_of,
            access: access.into(),
            max_value_bytes: u64::MAX,
        })
    }

    /// The value of sample `index`'s field `k`.
    fn value(&self, index: usize, k: usize) -> Result<Value> {
        let (at, len) = self.values[index * self.names.len() + k];
        ensure!(
            len <= self.max_value_bytes,
            "field {:?}: its value takes {len} bytes, over the {} a sample may",
            self.names[k],
            self.max_value_bytes
        );
        let mut data = vec![0u8; len as usize];
        self.envs[self.env_of[k]]
            .file
            .read_exact_at(&mut data, at)
            .with_context(|| format!("field {:?}", self.names[k]))?;
        Ok(Value::new(vec![], data))
    }
}

impl RawSource for LmdbSource {
    fn len(&self) -> u64 {
        self.keys.len() as u64
    }

    fn read_range(&self, start: u64, count: u64) -> Result<Vec<RawSample>> {
        let end = super::range_end(start, count, self.len())?;
        let out = (start as usize..end as usize)
            .map(|i| {
                (0..self.names.len())
                    .map(|k| self.value(i, k))
                    .collect::<Result<RawSample>>()
                    .with_context(|| format!("key {:?}", self.keys[i]))
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| self.changed().map_or(e, super::changed_error))?;
        if let Some(why) = self.changed() {
            return Err(super::changed_error(why));
        }
        Ok(out)
    }

    fn disk_bytes(&self) -> u64 {
        self.values.iter().map(|v| v.1).sum()
    }

    fn disk_bytes_each(&self) -> Option<u64> {
        None
    }

    fn disk_bytes_of(&self, index: u64) -> u64 {
        let n = self.names.len();
        self.values
            .get(index as usize * n..(index as usize + 1) * n)
            .map_or(0, |v| v.iter().map(|v| v.1).sum())
    }

    fn describe(&self) -> String {
        let envs: Vec<String> = self
            .envs
            .iter()
            .map(|e| e.path.display().to_string())
            .collect();
        format!(
            "lmdb:{}#{} ({}; {})",
            self.path.display(),
            self.names.join(","),
            envs.join(", "),
            self.order
        )
    }

    fn sample_name(&self, index: u64) -> String {
        self.keys.get(index as usize).map_or_else(
            || format!("sample {index}"),
            |k| format!("key {k:?} of {}", self.path.display()),
        )
    }
}

impl Provenance for LmdbSource {
    fn version(&self) -> String {
        let v: Vec<String> = self.envs.iter().map(|e| file_version(&e.path)).collect();
        v.join("|")
    }

    fn changed(&self) -> Option<String> {
        self.envs.iter().find_map(|e| e.stamp.changed(&e.path))
    }

    fn files(&self) -> crate::access::Files {
        crate::access::Files::List(self.access.clone())
    }

    fn root(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PS: usize = 4096;

    fn put16(p: &mut [u8], at: usize, v: u16) {
        p[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn put64(p: &mut [u8], at: usize, v: u64) {
        p[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    /// A page `pgno` of `flags` whose nodes are `nodes` (each its 8-byte header's four words
    /// and what follows the header), packed down from the page's end as LMDB packs them.
    fn page(pgno: usize, flags: u16, nodes: &[([u16; 4], Vec<u8>)]) -> Vec<u8> {
        let mut p = vec![0u8; PS];
        put64(&mut p, 0, pgno as u64);
        put16(&mut p, 10, flags);
        let mut upper = PS;
        for (i, (words, rest)) in nodes.iter().enumerate() {
            upper -= (NODE_HEADER + rest.len() + 1) & !1;
            for (j, w) in words.iter().enumerate() {
                put16(&mut p, upper + 2 * j, *w);
            }
            p[upper + NODE_HEADER..upper + NODE_HEADER + rest.len()].copy_from_slice(rest);
            put16(&mut p, PAGE_HEADER + 2 * i, upper as u16);
        }
        put16(&mut p, 12, (PAGE_HEADER + 2 * nodes.len()) as u16);
        put16(&mut p, 14, upper as u16);
        p
    }

    /// An LMDB 0.9 data file holding `kv` (sorted by key): meta pages 0 and 1 (the second
    /// current), leaves of at most `per_leaf` nodes, values over 1 KiB in overflow runs, and a
    /// branch above the leaves when there are several.
    fn build(kv: &[(Vec<u8>, Vec<u8>)], per_leaf: usize) -> Vec<u8> {
        let mut pages: Vec<Vec<u8>> = vec![vec![], vec![]];
        let mut leaves = vec![];
        for chunk in kv.chunks(per_leaf) {
            let pgno = pages.len();
            pages.push(vec![]);
            let mut nodes = vec![];
            for (k, v) in chunk {
                let len = [v.len() as u16, (v.len() >> 16) as u16];
                let mut rest = k.clone();
                if v.len() > 1024 {
                    let first = pages.len();
                    let run = (v.len() + PAGE_HEADER).div_ceil(PS);
                    let mut data = vec![0u8; run * PS];
                    put64(&mut data, 0, first as u64);
                    put16(&mut data, 10, P_OVERFLOW);
                    data[12..16].copy_from_slice(&(run as u32).to_le_bytes());
                    data[PAGE_HEADER..PAGE_HEADER + v.len()].copy_from_slice(v);
                    pages.extend(data.chunks(PS).map(<[u8]>::to_vec));
                    rest.extend((first as u64).to_le_bytes());
                    nodes.push(([len[0], len[1], F_BIGDATA, k.len() as u16], rest));
                } else {
                    rest.extend(v);
                    nodes.push(([len[0], len[1], 0, k.len() as u16], rest));
                }
            }
            pages[pgno] = page(pgno, P_LEAF, &nodes);
            leaves.push((pgno, chunk[0].0.clone()));
        }
        let (root, depth) = if leaves.len() == 1 {
            (leaves[0].0, 1)
        } else {
            let pgno = pages.len();
            let nodes: Vec<([u16; 4], Vec<u8>)> = leaves
                .iter()
                .enumerate()
                .map(|(i, (child, key))| {
                    // A branch's first key is empty.
                    let key = if i == 0 { vec![] } else { key.clone() };
                    let words = [*child as u16, (*child >> 16) as u16, 0, key.len() as u16];
                    (words, key)
                })
                .collect();
            pages.push(page(pgno, P_BRANCH, &nodes));
            (pgno, 2)
        };
        for (m, txnid) in [(0usize, 0u64), (1, 1)] {
            let mut p = vec![0u8; PS];
            put64(&mut p, 0, m as u64);
            put16(&mut p, 10, P_META);
            p[16..20].copy_from_slice(&MAGIC.to_le_bytes());
            p[20..24].copy_from_slice(&DATA_VERSION.to_le_bytes());
            p[40..44].copy_from_slice(&(PS as u32).to_le_bytes());
            put64(&mut p, 88 + 40, P_INVALID);
            if txnid == 1 {
                put16(&mut p, 88 + 6, depth);
                put64(&mut p, 88 + 32, kv.len() as u64);
                put64(&mut p, 88 + 40, root as u64);
            }
            put64(&mut p, 136, pages.len() as u64 - 1);
            put64(&mut p, 144, txnid);
            pages[m] = p;
        }
        pages.concat()
    }

    fn kv(n: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        (0..n)
            .map(|i| {
                let len = if i % 3 == 0 { 5000 + i } else { 40 + i };
                (
                    format!("{:04}_s{:03}", i / 10, i % 10).into_bytes(),
                    (0..len).map(|b| (b * 7 + i) as u8).collect(),
                )
            })
            .collect()
    }

    fn read_all(bytes: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let dir = tempfile::tempdir()?;
        let p = dir.path().join("data.mdb");
        std::fs::write(&p, bytes)?;
        let f = std::fs::File::open(&p)?;
        entries(&f, bytes.len() as u64)?
            .into_iter()
            .map(|e| {
                let mut v = vec![0; e.len as usize];
                f.read_exact_at(&mut v, e.at)?;
                Ok((e.key, v))
            })
            .collect()
    }

    #[test]
    fn a_tree_is_read_in_key_order_with_overflow_values() {
        let want = kv(40);
        assert_eq!(read_all(&build(&want, 40)).unwrap(), want, "one leaf");
        assert_eq!(
            read_all(&build(&want, 6)).unwrap(),
            want,
            "a branch over leaves"
        );
    }

    #[test]
    fn forged_files_are_errors_naming_what_is_wrong() {
        let good = build(&kv(12), 4);
        let err = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            format!("{:#}", read_all(&b).unwrap_err())
        };
        assert!(err(&|b| b[16] ^= 1).contains("bad magic"));
        assert!(err(&|b| b[20] = 2).contains("data version 2"));
        assert!(err(&|b| b.truncate(3 * PS)).contains("past the file's end"));
        // The root made to point at itself.
        let root = u64::from_le_bytes(good[PS + 128..PS + 136].try_into().unwrap()) as usize;
        assert!(err(&|b| put16(b, root * PS + PS - 8, root as u16)).contains("twice"));
        assert!(err(&|b| put64(b, PS + 120, 99)).contains("counts 99 entries"));
        assert!(err(&|b| put16(b, PS + 92, MDB_DUPSORT)).contains("MDB_DUPSORT"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// Any bytes changed anywhere: an error, or entries that lie within the file; never a
        /// panic or a read past its end.
        #[test]
        fn altered_files_never_panic(edits in proptest::collection::vec((0usize..40 * PS, any::<u8>()), 1..8)) {
            let mut b = build(&kv(30), 5);
            for (at, v) in edits {
                let at = at % b.len();
                b[at] = v;
            }
            let _ = read_all(&b);
        }
    }

    #[test]
    fn meta_info_lines_give_keys_as_basicsr_reads_them() {
        assert_eq!(
            meta_keys("0001_s001.png (480,480,3) 1\n\n0001_s002.png (480,480,3) 1\n"),
            ["0001_s001", "0001_s002"]
        );
    }
}
