//! WebDataset shards (`kind = "webdataset"`): uncompressed tar files, in a folder or named by a
//! brace pattern (`train-{000000..000099}.tar`), in order. A sample is the consecutive members
//! sharing a key (the path up to the basename's first dot); each extension is a field: `jpg`,
//! `jpeg`, `png`, `webp` and `*.png`-like compound ones (`seg.png`) images through the image
//! pipeline, `cls` a decimal integer served as int64, `npy` a NumPy array served as stored;
//! others (`json`, `txt`) are left out and listed. Members whose basename starts with `__` are
//! skipped, as WebDataset skips them.
//!
//! Each shard's tar headers (PAX and GNU long names included) are read once at open into an
//! index of member offsets. With a scratch tier, a miss reads its granule, the whole shard (or
//! an aligned part of at most 32 MiB when the shard is larger), in one sequential read and
//! preprocesses it into the scratch tier, so a shuffled epoch reads each shard once; without
//! one, a sample's members by position. A shard cut short serves the samples complete before
//! the cut, and says where it was cut.

use super::npy::Header;
use super::{Blob, Format, Opened, Provenance, RawSample, RawSource};
use crate::config::keys::keys_of;
use crate::config::{DatasetConfig, ImageMode, Limits, TrainCrop};
use crate::fields::{FieldSpec, Resample, Schema, Value};
use crate::pipeline::{FieldOp, Parse, Preprocess};
use crate::sync::Locked;
use anyhow::{ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// WebDataset tar shards (`kind = "webdataset"`).
pub struct WebDataset;

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetKeys {}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FieldKeys {
    /// The member extension the field is read from (default: the field's name).
    #[serde(default)]
    ext: Option<String>,
}

/// What a field's members are.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Image,
    Class,
    Array,
}

fn kind_of(ext: &str) -> Option<Kind> {
    let last = ext.rsplit('.').next().unwrap_or(ext);
    match last {
        "jpg" | "jpeg" | "png" | "webp" => Some(Kind::Image),
        "cls" | "cls2" | "index" => Some(Kind::Class),
        "npy" => Some(Kind::Array),
        _ => None,
    }
}

impl Format for WebDataset {
    fn name(&self) -> &'static str {
        "webdataset"
    }

    fn reads_objects(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    fn recognizes(&self, path: &Path) -> bool {
        path.is_file()
            && path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("tar"))
    }

    fn dataset_keys(&self) -> Vec<&'static str> {
        keys_of::<DatasetKeys>()
    }

    fn field_keys(&self) -> Vec<&'static str> {
        keys_of::<FieldKeys>()
    }

    fn check(&self, c: &DatasetConfig) -> Result<()> {
        super::check_unpaired::<DatasetKeys, FieldKeys>(self, c)
    }

    fn default_crop(&self) -> Option<u32> {
        None
    }

    fn default_train_crop(&self) -> TrainCrop {
        TrainCrop::RandomResized
    }

    fn open(&self, c: &DatasetConfig, limits: &Limits) -> Result<Opened> {
        let wanted: Vec<(String, String, Option<ImageMode>)> = c
            .fields
            .iter()
            .map(|f| {
                let k: FieldKeys = super::field_options(self, f)?;
                Ok((
                    f.name.clone(),
                    k.ext.unwrap_or_else(|| f.name.clone()),
                    f.mode,
                ))
            })
            .collect::<Result<_>>()?;
        let mut source = WdsSource::open(&c.path, &wanted)?;
        source.max_value_bytes = limits.max_sample_bytes;
        let resize = super::resize_of(self, c);
        let (mut ops, mut specs) = (vec![], vec![]);
        for f in &source.fields {
            match f.kind {
                Kind::Image => {
                    let mode = f.mode.unwrap_or(ImageMode::Rgb);
                    let resample = match mode {
                        ImageMode::Index => Resample::Nearest,
                        _ => c.interpolation.unwrap_or(Resample::Linear),
                    };
                    let op = FieldOp::Decode {
                        mode,
                        scale: 1,
                        resample,
                        upright: false,
                    };
                    specs.push(op.field(&f.name, &resize));
                    ops.push(op);
                }
                Kind::Class => {
                    let op = FieldOp::Parse(Parse::Int64Text);
                    specs.push(op.field(&f.name, &resize));
                    ops.push(op);
                }
                Kind::Array => {
                    let h = f
                        .header
                        .as_ref()
                        .context("an array field without its header")?;
                    let dims: Vec<u32> = h.shape.iter().map(|&d| d as u32).collect();
                    specs.push(FieldSpec::fixed(&f.name, h.dtype, &dims));
                    ops.push(FieldOp::Keep);
                }
            }
        }
        Ok(Opened {
            source: Box::new(source),
            preprocess: Preprocess::Images { ops, resize },
            schema: Schema::new(specs)?,
            format: &WebDataset,
        })
    }
}

/// `prefix{000..099}suffix`'s names, zero-padded as the pattern's first bound is.
fn expand_braces(pattern: &str) -> Result<Option<Vec<String>>> {
    let Some((head, rest)) = pattern.split_once('{') else {
        return Ok(None);
    };
    let (range, tail) = rest.split_once('}').context("a `{` without its `}`")?;
    let (a, b) = range
        .split_once("..")
        .context("a brace pattern is {FIRST..LAST}")?;
    let (from, to): (u64, u64) = (a.parse()?, b.parse()?);
    ensure!(from <= to && to - from < 1_000_000, "the range {{{range}}}");
    Ok(Some(
        (from..=to)
            .map(|k| format!("{head}{k:0width$}{tail}", width = a.len()))
            .collect(),
    ))
}

/// Refuses a compressed shard by its name.
fn not_compressed(name: &str) -> Result<()> {
    let lower = name.to_lowercase();
    ensure!(
        !(lower.ends_with(".tar.gz") || lower.ends_with(".tgz")),
        "{name} is compressed: larder reads uncompressed shards (members read by position); \
         unpack it with gunzip"
    );
    Ok(())
}

/// The shards at `path`, opened: a brace pattern, a folder's (or prefix's) `.tar` files, or
/// one file (or object); sorted.
fn shards(path: &Path) -> Result<Vec<Blob>> {
    let text = path.to_string_lossy();
    let remote = crate::objects::is_url(path);
    let one = |name: &Path| -> Result<Blob> {
        not_compressed(&name.to_string_lossy())?;
        if !remote {
            return Blob::open(name);
        }
        let mut listed = Blob::list(name)?;
        ensure!(
            listed.len() == 1 && listed[0].path() == name,
            "{}: no such object",
            name.display()
        );
        Ok(listed.remove(0))
    };
    if let Some(names) = expand_braces(&text)? {
        return names.iter().map(|n| one(Path::new(n))).collect();
    }
    let mut out = vec![];
    if remote {
        // The objects right under the prefix, as a folder's files (not its subfolders').
        for blob in Blob::list(path)? {
            if blob.path().parent() != Some(path) && blob.path() != path {
                continue;
            }
            let name = blob.name();
            if name.to_lowercase().ends_with(".tar") {
                out.push(blob);
            } else {
                not_compressed(&blob.path().to_string_lossy())?;
            }
        }
    } else if path.is_dir() {
        for e in std::fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
            let p = e?.path();
            let name = p
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_lowercase();
            if name.ends_with(".tar") {
                out.push(Blob::open(&p)?);
            } else {
                not_compressed(&p.to_string_lossy())?;
            }
        }
    } else {
        out.push(one(path)?);
    }
    out.sort_by_key(|b| b.path());
    ensure!(!out.is_empty(), "{}: no .tar shards", path.display());
    Ok(out)
}

/// A member: its path in the tar, and where its bytes are.
struct Member {
    name: String,
    at: u64,
    size: u64,
}

/// Parses an octal (or base-256) number field of a tar header.
fn number(field: &[u8]) -> Result<u64> {
    if field.first().is_some_and(|b| b & 0x80 != 0) {
        let mut v = 0u64;
        for &b in &field[1..] {
            v = v.checked_shl(8).context("a size over 2^64")? | b as u64;
        }
        return Ok(v);
    }
    let text: String = field
        .iter()
        .take_while(|&&b| b != 0)
        .map(|&b| b as char)
        .collect();
    let text = text.trim();
    if text.is_empty() {
        return Ok(0);
    }
    u64::from_str_radix(text, 8).with_context(|| format!("a tar number {text:?}"))
}

fn text_of(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// Each shard's members, read a few shards at once (an object store answers each read after
/// a round trip; a local disk does not mind).
fn scan(shards: &[Blob]) -> Vec<Result<(Vec<Member>, Option<String>)>> {
    const AT_ONCE: usize = 8;
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out: Vec<std::sync::Mutex<Option<Result<_>>>> =
        shards.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..AT_ONCE.min(shards.len()) {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(shard) = shards.get(k) else { return };
                let listed = members(shard, shard.size());
                *out[k].locked() = Some(listed);
            });
        }
    });
    out.into_iter()
        .map(|m| {
            m.into_inner()
                .unwrap_or_else(|e| e.into_inner())
                .unwrap_or_else(|| Err(anyhow::anyhow!("not read")))
        })
        .collect()
}

/// Bytes read at a time while a shard's headers are read.
const HEADER_WINDOW: u64 = 4096;

/// The regular-file members of the tar `file` (of `size` bytes), and where it was cut short,
/// if it was.
fn members(file: &Blob, size: u64) -> Result<(Vec<Member>, Option<String>)> {
    let mut out = vec![];
    let mut at = 0u64;
    let (mut long_name, mut pax_path): (Option<String>, Option<String>) = (None, None);
    let mut pax_size: Option<u64> = None;
    let mut header = [0u8; 512];
    // Headers are read a window at a time: a small member's header, its data and the next
    // header come in one read (one GET for an object), a large member's data is skipped.
    let mut window: (u64, Vec<u8>) = (0, vec![]);
    loop {
        if at + 512 > size {
            let cut = (at < size).then(|| format!("cut short in a header at byte {at}"));
            return Ok((out, cut));
        }
        let (from, bytes) = &window;
        match at
            .checked_sub(*from)
            .and_then(|a| bytes.get(a as usize..a as usize + 512))
        {
            Some(h) => header.copy_from_slice(h),
            None => {
                let mut bytes = vec![0u8; HEADER_WINDOW.min(size - at) as usize];
                file.read_exact_at(&mut bytes, at)?;
                header.copy_from_slice(&bytes[..512]);
                window = (at, bytes);
            }
        }
        if header.iter().all(|&b| b == 0) {
            return Ok((out, None));
        }
        let sum: u64 = header
            .iter()
            .enumerate()
            .map(|(i, &b)| {
                if (148..156).contains(&i) {
                    32
                } else {
                    b as u64
                }
            })
            .sum();
        ensure!(
            number(&header[148..156])? == sum,
            "a tar header at byte {at} fails its checksum"
        );
        let kind = header[156];
        let mut len = number(&header[124..136])?;
        if let Some(s) = pax_size.take() {
            len = s;
        }
        let data = at + 512;
        // A forged size near 2^64 must neither wrap nor pass for one that fits the file.
        let next = len
            .div_ceil(512)
            .checked_mul(512)
            .and_then(|padded| data.checked_add(padded))
            .context("a member size over 2^64")?;
        if data.checked_add(len).is_none_or(|end| end > size) {
            let name = pax_path
                .or(long_name)
                .unwrap_or_else(|| text_of(&header[..100]));
            return Ok((out, Some(format!("cut short in member {name:?}"))));
        }
        match kind {
            b'x' | b'L' => {
                ensure!(len <= 1 << 20, "an extended header of {len} bytes");
                let mut buf = vec![0u8; len as usize];
                file.read_exact_at(&mut buf, data)?;
                if kind == b'L' {
                    long_name = Some(text_of(&buf));
                } else {
                    // Records "LEN key=value\n".
                    for rec in String::from_utf8_lossy(&buf).split('\n') {
                        if let Some((_, kv)) = rec.split_once(' ') {
                            if let Some(p) = kv.strip_prefix("path=") {
                                pax_path = Some(p.to_string());
                            } else if let Some(s) = kv.strip_prefix("size=") {
                                pax_size = s.parse().ok();
                            }
                        }
                    }
                }
            }
            b'0' | 0 | b'7' => {
                let mut name = text_of(&header[..100]);
                if &header[257..262] == b"ustar" {
                    let prefix = text_of(&header[345..500]);
                    if !prefix.is_empty() {
                        name = format!("{prefix}/{name}");
                    }
                }
                let name = pax_path.take().or(long_name.take()).unwrap_or(name);
                out.push(Member {
                    name,
                    at: data,
                    size: len,
                });
            }
            _ => {
                pax_path = None;
                long_name = None;
            }
        }
        at = next;
    }
}

/// The key and extension of a member's path: up to and after the basename's first dot.
fn key_and_ext(name: &str) -> Option<(String, String)> {
    let (dir, base) = name.rsplit_once('/').map_or(("", name), |(d, b)| (d, b));
    if base.starts_with("__") {
        return None;
    }
    let (stem, ext) = base.split_once('.')?;
    let key = if dir.is_empty() {
        stem.to_string()
    } else {
        format!("{dir}/{stem}")
    };
    Some((key, ext.to_lowercase()))
}

struct Field {
    name: String,
    ext: String,
    kind: Kind,
    mode: Option<ImageMode>,
    /// An array field's header (its first sample's): every sample's must match.
    header: Option<Header>,
}

/// A member of a sample: its extension, and where its bytes are (offset, size).
type Placed = (String, u64, u64);

/// A sample: its shard, its key, and each field's member (offset, size), if it has one.
struct Sample {
    shard: usize,
    key: String,
    members: Vec<Option<(u64, u64)>>,
}

pub struct WdsSource {
    path: PathBuf,
    root: PathBuf,
    shards: Vec<Blob>,
    fields: Vec<Field>,
    samples: Vec<Sample>,
    access: Arc<[PathBuf]>,
    /// Left out (extensions), and the shards cut short.
    skipped: Vec<String>,
    cut: Vec<String>,
    max_value_bytes: u64,
    /// Samples read together on a miss (see `granule_of`).
    granule: u64,
}

/// Bytes a granule may span in a shard: read in one sequential read, and preprocessed whole
/// into the scratch tier.
const GRANULE_BYTES: u64 = 32 << 20;

/// The granule of shards holding `counts` samples each, `bytes` bytes of samples in all: the
/// largest divisor of the shards' common count whose samples span at most `GRANULE_BYTES` on
/// average (the whole shard when it is that small), so granules never straddle shards. 1 when
/// the shards (all but the last, which may be short) do not hold the same count.
fn granule_of(counts: &[u64], bytes: u64) -> u64 {
    let Some((&first, rest)) = counts.split_first() else {
        return 1;
    };
    let uniform = match rest.split_last() {
        Some((&last, middle)) => middle.iter().all(|&c| c == first) && last <= first,
        None => true,
    };
    let total: u64 = counts.iter().sum();
    if !uniform || first == 0 || total == 0 {
        return 1;
    }
    let per_sample = (bytes / total).max(1);
    let most = (GRANULE_BYTES / per_sample).max(1);
    (1..=first.min(most))
        .rev()
        .find(|k| first % k == 0)
        .unwrap_or(1)
}

impl WdsSource {
    fn open(path: &Path, wanted: &[(String, String, Option<ImageMode>)]) -> Result<WdsSource> {
        let shards = shards(path)?;
        // Each shard's samples: shard, key, then (extension, at, size) of its members.
        let mut grouped: Vec<(usize, String, Vec<Placed>)> = vec![];
        let mut cut = vec![];
        for (k, (shard, listed)) in shards.iter().zip(scan(&shards)).enumerate() {
            let p = shard.path();
            let (members, cut_at) = listed.with_context(|| format!("reading {}", p.display()))?;
            let first_of_shard = grouped.len();
            for member in members {
                let Some((key, ext)) = key_and_ext(&member.name) else {
                    continue;
                };
                match grouped.last_mut() {
                    Some((s, last, fields)) if *s == k && *last == key => {
                        fields.push((ext, member.at, member.size))
                    }
                    _ => grouped.push((k, key, vec![(ext, member.at, member.size)])),
                }
            }
            if let Some(why) = cut_at {
                // The sample the cut fell in may lack members: it is left out.
                if grouped.len() > first_of_shard {
                    grouped.pop();
                }
                tracing::warn!(shard = %p.display(), "{why}: its complete samples are served");
                cut.push(format!("{}: {why}", p.display()));
            }
        }
        ensure!(
            !grouped.is_empty(),
            "{}: no samples in its shards",
            path.display()
        );
        let first = &grouped[0].2;
        let mut skipped = vec![];
        let mut fields: Vec<Field> = if wanted.is_empty() {
            let mut f = vec![];
            for (ext, _, _) in first {
                match kind_of(ext) {
                    Some(kind) => f.push(Field {
                        name: ext.clone(),
                        ext: ext.clone(),
                        kind,
                        mode: None,
                        header: None,
                    }),
                    None => skipped.push(ext.clone()),
                }
            }
            f
        } else {
            wanted
                .iter()
                .map(|(name, ext, mode)| {
                    let kind = kind_of(ext).with_context(|| {
                        format!("field {name:?}: `.{ext}` members are not served (text and json are not)")
                    })?;
                    Ok(Field {
                        name: name.clone(),
                        ext: ext.to_lowercase(),
                        kind,
                        mode: *mode,
                        header: None,
                    })
                })
                .collect::<Result<_>>()?
        };
        ensure!(
            !fields.is_empty(),
            "{}: no member larder serves in the first sample (left out: {})",
            path.display(),
            skipped.join(", ")
        );
        let samples: Vec<Sample> = grouped
            .into_iter()
            .map(|(shard, key, members)| Sample {
                shard,
                key,
                members: fields
                    .iter()
                    .map(|f| {
                        members
                            .iter()
                            .find(|(e, _, _)| *e == f.ext)
                            .map(|&(_, at, size)| (at, size))
                    })
                    .collect(),
            })
            .collect();
        // An array field's shape: its first sample's header.
        for (k, f) in fields.iter_mut().enumerate() {
            if f.kind == Kind::Array {
                let s = samples
                    .iter()
                    .find(|s| s.members[k].is_some())
                    .context("an array field no sample has")?;
                let (at, size) = s.members[k].unwrap_or_default();
                let mut head = vec![0u8; size.min(65536 + 12) as usize];
                shards[s.shard].read_exact_at(&mut head, at)?;
                f.header =
                    Some(Header::parse(&head).with_context(|| format!("{}.{}", s.key, f.ext))?);
            }
        }
        let root = if path.to_string_lossy().contains('{') {
            path.parent().unwrap_or(Path::new(".")).to_path_buf()
        } else {
            path.to_path_buf()
        };
        let mut access = vec![root.clone()];
        if !crate::objects::is_url(path) {
            access.extend(shards.iter().map(Blob::path));
        }
        access.dedup();
        let mut counts = vec![0u64; shards.len()];
        for s in &samples {
            counts[s.shard] += 1;
        }
        let bytes = samples
            .iter()
            .flat_map(|s| s.members.iter().flatten().map(|m| m.1))
            .sum();
        let granule = granule_of(&counts, bytes);
        Ok(WdsSource {
            path: path.to_path_buf(),
            root,
            shards,
            fields,
            samples,
            access: access.into(),
            skipped,
            cut,
            max_value_bytes: u64::MAX,
            granule,
        })
    }

    /// The bytes samples `start..end` span in their shard, read in one sequential read, when
    /// there are several, all in one shard, within `GRANULE_BYTES`: (shard, offset, bytes).
    fn span(&self, start: u64, end: u64) -> Option<(usize, u64, Vec<u8>)> {
        let samples = self.samples.get(start as usize..end as usize)?;
        let shard = samples.first()?.shard;
        if samples.len() < 2 || samples.iter().any(|s| s.shard != shard) {
            return None;
        }
        let members = || samples.iter().flat_map(|s| s.members.iter().flatten());
        let from = members().map(|m| m.0).min()?;
        let to = members().map(|m| m.0 + m.1).max()?;
        if to - from > 2 * GRANULE_BYTES {
            return None;
        }
        let mut data = vec![0u8; (to - from) as usize];
        // Any failure (a shard cut since): each sample read alone says what it is.
        self.shards[shard].read_exact_at(&mut data, from).ok()?;
        Some((shard, from, data))
    }

    fn value(&self, s: &Sample, k: usize, span: Option<&(usize, u64, Vec<u8>)>) -> Result<Value> {
        let f = &self.fields[k];
        let (at, size) = s.members[k].with_context(|| format!("no .{} member", f.ext))?;
        ensure!(
            size <= self.max_value_bytes,
            "its .{} member takes {size} bytes, over the {} a sample may",
            f.ext,
            self.max_value_bytes
        );
        let within = span
            .filter(|(shard, _, _)| *shard == s.shard)
            .and_then(|(_, from, data)| {
                let a = (at - from) as usize;
                data.get(a..a + size as usize)
            });
        let data = match within {
            Some(bytes) => bytes.to_vec(),
            None => {
                let mut data = vec![0u8; size as usize];
                self.shards[s.shard].read_exact_at(&mut data, at)?;
                data
            }
        };
        if f.kind != Kind::Array {
            return Ok(Value::new(vec![], data));
        }
        let want = f.header.as_ref().context("no header")?;
        let h = Header::parse(&data)?;
        ensure!(
            h.dtype == want.dtype && h.shape == want.shape && !h.boolean,
            "its .npy is {:?} {:?}, not the field's {:?} {:?}",
            h.dtype,
            h.shape,
            want.dtype,
            want.shape
        );
        let bytes = h.row_bytes().unwrap_or(0) * h.shape.first().copied().unwrap_or(0);
        let body = data
            .get(h.data_offset as usize..(h.data_offset + bytes) as usize)
            .context("its .npy is cut short")?;
        let dims = h.shape.iter().map(|&d| d as u32).collect();
        Ok(Value::new(dims, body.to_vec()))
    }
}

impl RawSource for WdsSource {
    fn len(&self) -> u64 {
        self.samples.len() as u64
    }

    fn read_range(&self, start: u64, count: u64) -> Result<Vec<RawSample>> {
        let end = super::range_end(start, count, self.len())?;
        let span = self.span(start, end);
        let out = (start..end)
            .map(|i| {
                let s = &self.samples[i as usize];
                (0..self.fields.len())
                    .map(|k| self.value(s, k, span.as_ref()))
                    .collect::<Result<RawSample>>()
                    .with_context(|| {
                        format!(
                            "sample {:?} of {}",
                            s.key,
                            self.shards[s.shard].path().display()
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()
            .map_err(|e| self.changed().map_or(e, super::changed_error))?;
        if let Some(why) = self.changed() {
            return Err(super::changed_error(why));
        }
        Ok(out)
    }

    fn read_granule(&self) -> u64 {
        self.granule
    }

    fn disk_bytes(&self) -> u64 {
        self.samples
            .iter()
            .flat_map(|s| s.members.iter().flatten().map(|m| m.1))
            .sum()
    }

    fn disk_bytes_each(&self) -> Option<u64> {
        None
    }

    fn disk_bytes_of(&self, index: u64) -> u64 {
        self.samples
            .get(index as usize)
            .map_or(0, |s| s.members.iter().flatten().map(|m| m.1).sum())
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.fields.iter().map(|f| f.name.as_str()).collect();
        let mut d = format!("webdataset:{}#{}", self.path.display(), names.join(","));
        if !self.skipped.is_empty() {
            d.push_str(&format!(" (left out: {})", self.skipped.join(", ")));
        }
        if !self.cut.is_empty() {
            d.push_str(&format!(" (cut short: {})", self.cut.join("; ")));
        }
        d
    }

    fn sample_name(&self, index: u64) -> String {
        self.samples.get(index as usize).map_or_else(
            || format!("sample {index}"),
            |s| format!("{} of {}", s.key, self.shards[s.shard].path().display()),
        )
    }
}

impl Provenance for WdsSource {
    fn version(&self) -> String {
        let v: Vec<String> = self.shards.iter().map(Blob::version).collect();
        v.join("|")
    }

    fn changed(&self) -> Option<String> {
        self.shards.iter().find_map(Blob::changed)
    }

    fn files(&self) -> crate::access::Files {
        crate::access::Files::List(self.access.clone())
    }

    fn root(&self) -> &Path {
        &self.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ustar header for `name` of `size` bytes (base-256 when over the octal field).
    fn header(name: &str, size: u64) -> [u8; 512] {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..107].copy_from_slice(b"0000644");
        if size < 0o77777777777 {
            h[124..135].copy_from_slice(format!("{size:011o}").as_bytes());
        } else {
            h[124] = 0x80;
            h[128..136].copy_from_slice(&size.to_be_bytes());
        }
        h[156] = b'0';
        h[257..263].copy_from_slice(b"ustar\0");
        h[148..156].copy_from_slice(b"        ");
        let sum: u64 = h.iter().map(|&b| b as u64).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        h
    }

    #[test]
    fn forged_member_sizes_are_a_cut_shard_never_a_wrap() {
        for size in [u64::MAX, u64::MAX - 511, 1 << 62, 4096] {
            let mut tar = header("s0.cls", 1).to_vec();
            tar.extend_from_slice(&[b'7'; 512]);
            tar.extend_from_slice(&header("s1.cls", size));
            tar.extend_from_slice(&[b'3'; 512]);
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("s.tar");
            std::fs::write(&path, &tar).unwrap();
            match members(&Blob::open(&path).unwrap(), tar.len() as u64) {
                Ok((m, cut)) => {
                    assert_eq!(m.len(), 1, "{size}: only the member that fits");
                    assert!(cut.is_some_and(|c| c.contains("s1.cls")), "{size}");
                }
                Err(e) => assert!(format!("{e:#}").contains("2^64"), "{size}: {e:#}"),
            }
        }
    }

    #[test]
    fn granules_are_whole_shards_or_aligned_parts_of_them() {
        // Shards of 10 samples (the last of 3): a shard a granule while it is small.
        assert_eq!(granule_of(&[10, 10, 3], 23 * 1000), 10);
        // 10,000 samples of 100 kB a shard (1 GB): parts of at most 32 MiB that divide it.
        assert_eq!(granule_of(&[10_000, 10_000], 20_000 * 100_000), 250);
        // Shards of different counts (a cut one in the middle): sample by sample.
        assert_eq!(granule_of(&[10, 7, 10], 27 * 1000), 1);
        assert_eq!(granule_of(&[], 0), 1);
        assert_eq!(granule_of(&[5], 5000), 5);
    }

    #[test]
    fn keys_extensions_and_braces_as_webdataset_reads_them() {
        assert_eq!(
            key_and_ext("a/b/s0001.seg.PNG"),
            Some(("a/b/s0001".into(), "seg.png".into()))
        );
        assert_eq!(key_and_ext("__meta__.json"), None);
        assert_eq!(kind_of("seg.png"), Some(Kind::Image));
        assert_eq!(kind_of("json"), None);
        assert_eq!(
            expand_braces("d/train-{008..010}.tar").unwrap().unwrap(),
            vec!["d/train-008.tar", "d/train-009.tar", "d/train-010.tar"]
        );
        assert!(expand_braces("x{3..1}").is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// A shard's bytes changed anywhere: members that lie within the file, in order, or an
        /// error; never a panic or a member past the end.
        #[test]
        fn altered_shards_list_members_within_the_file(
            edits in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 1..8),
            cut in 512usize..4096,
        ) {
            let mut tar = vec![];
            for (i, (name, body)) in [("s0.jpg", 700usize), ("s0.cls", 1), ("s1.jpg", 300), ("s1.cls", 2)]
                .into_iter()
                .enumerate()
            {
                tar.extend_from_slice(&header(name, body as u64));
                tar.extend(std::iter::repeat_n(b'a' + i as u8, body.div_ceil(512) * 512));
            }
            tar.extend_from_slice(&[0u8; 1024]);
            for (at, v) in edits {
                let at = at % tar.len();
                tar[at] = v;
            }
            tar.truncate(cut.min(tar.len()));
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("s.tar");
            std::fs::write(&path, &tar).unwrap();
            if let Ok((members, _)) = members(&Blob::open(&path).unwrap(), tar.len() as u64) {
                let mut end = 0;
                for m in &members {
                    proptest::prop_assert!(m.at >= end && m.at.checked_add(m.size).is_some_and(|e| e <= tar.len() as u64),
                        "{} at {} of {} bytes in a file of {}", m.name, m.at, m.size, tar.len());
                    end = m.at + m.size;
                }
            }
        }
    }
}
