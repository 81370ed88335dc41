//! NumPy arrays (`kind = "npy"`): a folder of `.npy` files, each [N, ...] a field named by its
//! stem; one `.npy` file; or one `.npz` archive, each member a field. Sample i of a field is
//! row i of its array, served as stored (its dtype and the rest of its shape).
//!
//! Rows are read with `pread` from where the array's data starts (members stored in an `.npz`
//! are read the same way, in place). Not memory-mapped: a file cut short while mapped would
//! kill the process that reads it with SIGBUS, and the page cache serves a `pread` about as
//! fast. Compressed members (`savez_compressed`) are inflated once, at open, into the reader's
//! memory, within `limits.max_inflated_bytes`; the tiers keep their rows from there.

use super::{Blob, Format, Opened, Provenance, RawSample, RawSource};
use crate::config::keys::keys_of;
use crate::config::{DatasetConfig, FieldConfig, Limits, TrainCrop};
use crate::fields::{DType, FieldSpec, Schema, Value};
use crate::pipeline::Preprocess;
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// NumPy `.npy` files and `.npz` archives (`kind = "npy"`).
pub struct Npy;

/// The keys of a `[[dataset.field]]` table only this kind reads.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FieldKeys {
    /// The array: a `.npy` file's stem in the folder, or a member's name in the `.npz`
    /// (default: the field's name).
    #[serde(default)]
    array: Option<String>,
}

/// No dataset keys beyond those every kind reads.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetKeys {}

/// Most bytes of compressed members inflated at open, in all (a larger archive: save it with
/// `np.savez`, which stores members as they are, and they are read in place).
const MAX_INFLATED_BYTES: u64 = 1 << 30;
/// Bytes of samples read together on a miss (every field's rows): enough that a read's fixed
/// cost (a seek; an object store's round trip, about 10 ms) is small beside it.
const GRANULE_BYTES: u64 = 4 << 20;

impl Format for Npy {
    fn name(&self) -> &'static str {
        "npy"
    }

    fn reads_objects(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    fn recognizes(&self, path: &Path) -> bool {
        let ext = |p: &Path, e: &str| p.extension().is_some_and(|x| x.eq_ignore_ascii_case(e));
        if path.is_file() {
            return ext(path, "npy") || ext(path, "npz");
        }
        // A folder with .npy files in it (an image folder has none).
        std::fs::read_dir(path).is_ok_and(|d| {
            d.flatten()
                .take(10_000)
                .any(|e| ext(&e.path(), "npy") && e.path().is_file())
        })
    }

    fn dataset_keys(&self) -> Vec<&'static str> {
        keys_of::<DatasetKeys>()
    }

    fn field_keys(&self) -> Vec<&'static str> {
        keys_of::<FieldKeys>()
    }

    fn check(&self, c: &DatasetConfig) -> Result<()> {
        ensure!(
            c.max_size.is_none() && !c.square,
            "max_size and square are for image fields; NumPy arrays are served as stored"
        );
        let _: DatasetKeys = super::dataset_options(self, c)?;
        for f in &c.fields {
            ensure!(
                f.mode.is_none(),
                "field {:?}: `mode` is for image fields",
                f.name
            );
            let _: FieldKeys = super::field_options(self, f)?;
        }
        Ok(())
    }

    fn default_crop(&self) -> Option<u32> {
        None
    }

    fn default_train_crop(&self) -> TrainCrop {
        TrainCrop::Random
    }

    fn open(&self, c: &DatasetConfig, _: &Limits) -> Result<Opened> {
        let wanted: Vec<(FieldConfig, String)> = c
            .fields
            .iter()
            .map(|f| {
                let k: FieldKeys = super::field_options(self, f)?;
                Ok((f.clone(), k.array.unwrap_or_else(|| f.name.clone())))
            })
            .collect::<Result<_>>()?;
        let source = NpySource::open(&c.path, &wanted)?;
        let schema = Schema::new(source.specs.clone())?;
        Ok(Opened {
            source: Box::new(source),
            preprocess: Preprocess::Identity,
            schema,
            format: &Npy,
        })
    }
}

/// An array's header: what a row is, and where the data starts.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub dtype: DType,
    /// Stored as numpy bools: served as uint8 0/1.
    pub boolean: bool,
    /// The whole shape, N first.
    pub shape: Vec<u64>,
    /// Bytes from the start of the .npy data to its first row.
    pub data_offset: u64,
}

impl Header {
    /// Parses the header at the start of `head` (the first bytes of a `.npy`; at most 64 KiB
    /// are looked at, as numpy itself allows no larger header).
    pub fn parse(head: &[u8]) -> Result<Header> {
        ensure!(
            head.len() >= 10 && head.starts_with(b"\x93NUMPY"),
            "not a .npy array (no \\x93NUMPY magic)"
        );
        let (len, start) = match head[6] {
            1 => (u16::from_le_bytes([head[8], head[9]]) as usize, 10),
            2 | 3 => {
                ensure!(head.len() >= 12, "header cut short");
                (
                    u32::from_le_bytes([head[8], head[9], head[10], head[11]]) as usize,
                    12,
                )
            }
            v => bail!(".npy format version {v} is not one larder reads (1, 2, 3)"),
        };
        ensure!(len <= 65536, "a {len}-byte .npy header");
        let text = head
            .get(start..start + len)
            .context(".npy header cut short")?;
        let text = std::str::from_utf8(text).context(".npy header is not text")?;
        let value = |key: &str| -> Result<&str> {
            let at = text
                .find(&format!("'{key}'"))
                .with_context(|| format!(".npy header has no '{key}'"))?;
            let rest = text[at + key.len() + 2..].trim_start();
            Ok(rest
                .strip_prefix(':')
                .context("malformed header")?
                .trim_start())
        };
        let descr = value("descr")?;
        let descr = descr
            .strip_prefix('\'')
            .and_then(|d| d.split('\'').next())
            .context("'descr' is not a simple dtype (structured arrays are not served)")?;
        let (dtype, boolean) = dtype_of(descr)?;
        ensure!(
            value("fortran_order")?.starts_with("False"),
            "a Fortran-ordered array: save it C-ordered (np.ascontiguousarray)"
        );
        let shape = value("shape")?;
        let shape = shape
            .strip_prefix('(')
            .and_then(|s| s.split(')').next())
            .context("malformed 'shape'")?;
        let shape: Vec<u64> = shape
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.trim_end_matches('L').parse::<u64>())
            .collect::<Result<_, _>>()
            .context("malformed 'shape'")?;
        ensure!(
            !shape.is_empty(),
            "a 0-d array has no rows: an array [N, ...] is one field of N samples"
        );
        ensure!(
            shape[1..].iter().all(|&d| d <= u32::MAX as u64),
            "a dimension over 2^32"
        );
        Ok(Header {
            dtype,
            boolean,
            shape,
            data_offset: (start + len) as u64,
        })
    }

    /// Bytes of one row; None when that overflows.
    pub fn row_bytes(&self) -> Option<u64> {
        self.shape[1..]
            .iter()
            .try_fold(self.dtype.size() as u64, |a, &d| a.checked_mul(d))
    }
}

/// The dtype of a numpy `descr` (little-endian or single-byte numbers only).
fn dtype_of(descr: &str) -> Result<(DType, bool)> {
    let (order, code) = descr.split_at_checked(1).context("empty 'descr'")?;
    let t = match code {
        "u1" => DType::Uint8,
        "i1" => DType::Int8,
        "b1" => return Ok((DType::Uint8, true)),
        "u2" => DType::Uint16,
        "i2" => DType::Int16,
        "u4" => DType::Uint32,
        "i4" => DType::Int32,
        "u8" => DType::Uint64,
        "i8" => DType::Int64,
        "f2" => DType::Float16,
        "f4" => DType::Float32,
        "f8" => DType::Float64,
        _ => bail!("dtype {descr:?} is not one larder serves (numbers and bools)"),
    };
    let little = cfg!(target_endian = "little");
    ensure!(
        order == "|" || (order == "<" && little) || (order == ">" && !little),
        "dtype {descr:?} is in the other byte order: save it as {}{code} (arr.astype('<{code}'))",
        if little { "<" } else { ">" }
    );
    Ok((t, false))
}

/// Where one field's rows are.
enum Rows {
    /// In a file, from this byte offset.
    File { file: Arc<Blob>, offset: u64 },
    /// Inflated at open (a compressed `.npz` member).
    Memory(Arc<[u8]>),
}

struct Field {
    /// The file or member it is read from, for messages.
    origin: String,
    header: Header,
    row_bytes: u64,
    rows: Rows,
}

impl Field {
    /// Rows `start..start + count`, as one read.
    fn read(&self, start: u64, count: u64) -> Result<Vec<u8>> {
        let (at, n) = (start * self.row_bytes, count * self.row_bytes);
        match &self.rows {
            Rows::File { file, offset } => {
                let mut buf = vec![0u8; n as usize];
                file.read_exact_at(&mut buf, offset + at).with_context(|| {
                    format!("reading rows {start}..+{count} of {}", self.origin)
                })?;
                Ok(buf)
            }
            Rows::Memory(data) => Ok(data[at as usize..(at + n) as usize].to_vec()),
        }
    }
}

/// A dataset of NumPy arrays sharing their first dimension.
pub struct NpySource {
    path: PathBuf,
    fields: Vec<Field>,
    specs: Vec<FieldSpec>,
    len: u64,
    granule: u64,
    /// Each file read, as opened: a read from one that changed since is refused.
    blobs: Vec<Arc<Blob>>,
    /// Its files are objects in an object store.
    remote: bool,
    files: Arc<[PathBuf]>,
}

/// An array found at open: its name, its file, where its .npy bytes start in it and how they
/// are stored.
struct Found {
    name: String,
    file: Arc<Blob>,
    /// Offset of the .npy bytes in the file (0 for a .npy file).
    at: u64,
    /// A compressed member: (compressed bytes, inflated size).
    deflated: Option<(u64, u64)>,
}

impl NpySource {
    /// Opens the arrays at `path` (a folder of .npy files, a .npy file or a .npz archive) named
    /// by `wanted` (field, array name); every array when `wanted` is empty.
    pub fn open(path: &Path, wanted: &[(FieldConfig, String)]) -> Result<NpySource> {
        let is_npy = |p: &Path| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("npy"));
        let stem = |p: &Path| p.file_stem().unwrap_or_default().to_string_lossy().into();
        let whole = |file: Blob| Found {
            name: stem(&file.path()),
            file: Arc::new(file),
            at: 0,
            deflated: None,
        };
        let found = if crate::objects::is_url(path) {
            // One object, or the .npy objects right under the prefix.
            let listed = Blob::list(path)?;
            match &listed[..] {
                [one] if one.path() == path => match path
                    .extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("npz"))
                {
                    true => zip_members(Arc::new(listed.into_iter().next().unwrap()))?,
                    false => listed.into_iter().map(whole).collect(),
                },
                _ => listed
                    .into_iter()
                    .filter(|b| is_npy(&b.path()) && b.path().parent() == Some(path))
                    .map(whole)
                    .collect(),
            }
        } else if path.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
                .with_context(|| format!("reading folder {}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| is_npy(p))
                .collect();
            entries.sort();
            entries
                .iter()
                .map(|p| Blob::open(p).map(whole))
                .collect::<Result<_>>()?
        } else if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("npz"))
        {
            zip_members(Arc::new(Blob::open(path)?))?
        } else {
            vec![whole(Blob::open(path)?)]
        };
        ensure!(!found.is_empty(), "{}: no .npy arrays", path.display());
        let chosen: Vec<(String, &Found)> = if wanted.is_empty() {
            found.iter().map(|f| (f.name.clone(), f)).collect()
        } else {
            wanted
                .iter()
                .map(|(f, array)| {
                    let a = found.iter().find(|x| &x.name == array).with_context(|| {
                        format!(
                            "field {:?}: no array {array:?} in {} (it has: {})",
                            f.name,
                            path.display(),
                            found
                                .iter()
                                .map(|x| x.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    })?;
                    Ok((f.name.clone(), a))
                })
                .collect::<Result<_>>()?
        };
        let mut inflated_total = 0u64;
        let mut fields = vec![];
        let mut specs = vec![];
        let mut blobs: Vec<Arc<Blob>> = vec![];
        let mut len: Option<(u64, String)> = None;
        for (name, a) in chosen {
            let file = a.file.clone();
            let origin = if a.at > 0 || a.deflated.is_some() {
                format!("{}:{}", path.display(), a.name)
            } else {
                file.path().display().to_string()
            };
            if !blobs.iter().any(|b| Arc::ptr_eq(b, &file)) {
                blobs.push(file.clone());
            }
            let (header, rows, stored) = match a.deflated {
                None => {
                    let mut head =
                        vec![0u8; (65536 + 12).min(file.size().saturating_sub(a.at)) as usize];
                    file.read_exact_at(&mut head, a.at)
                        .with_context(|| format!("reading {origin}"))?;
                    let header = Header::parse(&head).with_context(|| origin.clone())?;
                    let offset = a.at + header.data_offset;
                    let stored = file.size().saturating_sub(offset);
                    (header, Rows::File { file, offset }, stored)
                }
                Some((compressed, size)) => {
                    inflated_total = inflated_total.saturating_add(size);
                    ensure!(
                        inflated_total <= MAX_INFLATED_BYTES,
                        "{}: its compressed members inflate to over {} bytes; save it with \
                         np.savez (members stored, read in place) instead",
                        path.display(),
                        MAX_INFLATED_BYTES
                    );
                    let data = inflate(&file, a.at, compressed, size)
                        .with_context(|| format!("inflating {origin}"))?;
                    let header = Header::parse(&data).with_context(|| origin.clone())?;
                    let body: Arc<[u8]> = data[header.data_offset as usize..].into();
                    let n = body.len() as u64;
                    (header, Rows::Memory(body), n)
                }
            };
            let row_bytes = header
                .row_bytes()
                .with_context(|| format!("{origin}: its rows are too large"))?;
            let n = header.shape[0];
            ensure!(
                n.checked_mul(row_bytes).is_some_and(|b| b <= stored),
                "{origin}: {n} rows of {row_bytes} bytes, but {stored} bytes of data (cut short?)"
            );
            match &len {
                None => len = Some((n, name.clone())),
                Some((m, first)) => ensure!(
                    *m == n,
                    "fields {first:?} and {name:?} differ in length: {m} and {n} rows (every \
                     array is [N, ...] with the same N)"
                ),
            }
            let dims: Vec<u32> = header.shape[1..].iter().map(|&d| d as u32).collect();
            specs.push(FieldSpec::fixed(&name, header.dtype, &dims));
            fields.push(Field {
                origin,
                header,
                row_bytes,
                rows,
            });
        }
        let len = len.map_or(0, |(n, _)| n);
        let row: u64 = fields.iter().map(|f| f.row_bytes).sum();
        let granule = (GRANULE_BYTES / row.max(1)).clamp(1, super::MAX_GRANULE);
        let mut files: Vec<PathBuf> = vec![path.to_path_buf()];
        if !crate::objects::is_url(path) {
            files.extend(blobs.iter().map(|b| b.path()));
        }
        files.dedup();
        Ok(NpySource {
            path: path.to_path_buf(),
            fields,
            specs,
            len,
            granule,
            blobs,
            remote: crate::objects::is_url(path),
            files: files.into(),
        })
    }
}

/// A compressed member's bytes, inflated: exactly `size` of them, or an error.
fn inflate(file: &Blob, at: u64, compressed: u64, size: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut raw = vec![0u8; usize::try_from(compressed)?];
    file.read_exact_at(&mut raw, at)?;
    let mut out = Vec::with_capacity(usize::try_from(size)?);
    flate2::read::DeflateDecoder::new(&raw[..])
        .take(size + 1)
        .read_to_end(&mut out)?;
    ensure!(
        out.len() as u64 == size,
        "inflated to {} bytes, not the {size} its header says",
        out.len()
    );
    Ok(out)
}

fn le16(b: &[u8], at: usize) -> Result<u64> {
    Ok(u16::from_le_bytes(
        b.get(at..at + 2)
            .context("zip record cut short")?
            .try_into()?,
    ) as u64)
}

fn le32(b: &[u8], at: usize) -> Result<u64> {
    Ok(u32::from_le_bytes(
        b.get(at..at + 4)
            .context("zip record cut short")?
            .try_into()?,
    ) as u64)
}

fn le64(b: &[u8], at: usize) -> Result<u64> {
    Ok(u64::from_le_bytes(
        b.get(at..at + 8)
            .context("zip record cut short")?
            .try_into()?,
    ))
}

/// The `.npy` members of the zip archive `file` (what `np.savez` writes): each one's name
/// (without `.npy`), and where its bytes start.
fn zip_members(file: Arc<Blob>) -> Result<Vec<Found>> {
    let path = file.path();
    let size = file.size();
    // The end-of-central-directory record: in the last 64 KiB + 22 bytes (its comment).
    let tail_len = size.min(65536 + 22);
    let mut tail = vec![0u8; tail_len as usize];
    file.read_exact_at(&mut tail, size - tail_len)?;
    let eocd = (0..tail.len().saturating_sub(21))
        .rev()
        .find(|&i| tail[i..].starts_with(b"PK\x05\x06"))
        .with_context(|| format!("{} is not a zip archive (.npz)", path.display()))?;
    let mut entries = le16(&tail, eocd + 10)?;
    let mut cd_size = le32(&tail, eocd + 12)?;
    let mut cd_offset = le32(&tail, eocd + 16)?;
    // Zip64: its locator sits just before the record.
    if (entries == 0xffff || cd_size == 0xffff_ffff || cd_offset == 0xffff_ffff) && eocd >= 20 {
        let loc = eocd - 20;
        ensure!(
            tail[loc..].starts_with(b"PK\x06\x07"),
            "zip64 locator missing"
        );
        let at = le64(&tail, loc + 8)?;
        let mut rec = [0u8; 56];
        file.read_exact_at(&mut rec, at)?;
        ensure!(rec.starts_with(b"PK\x06\x06"), "zip64 record missing");
        entries = le64(&rec, 32)?;
        cd_size = le64(&rec, 40)?;
        cd_offset = le64(&rec, 48)?;
    }
    ensure!(
        cd_offset.checked_add(cd_size).is_some_and(|e| e <= size) && cd_size <= 64 << 20,
        "zip central directory out of the file"
    );
    let mut cd = vec![0u8; cd_size as usize];
    file.read_exact_at(&mut cd, cd_offset)?;
    let mut out = vec![];
    let mut p = 0usize;
    for _ in 0..entries.min(1 << 16) {
        ensure!(
            cd.get(p..p + 4) == Some(b"PK\x01\x02"),
            "zip entry malformed"
        );
        let method = le16(&cd, p + 10)?;
        let mut compressed = le32(&cd, p + 20)?;
        let mut uncompressed = le32(&cd, p + 24)?;
        let (name_len, extra_len, comment_len) = (
            le16(&cd, p + 28)? as usize,
            le16(&cd, p + 30)? as usize,
            le16(&cd, p + 32)? as usize,
        );
        let mut local = le32(&cd, p + 42)?;
        let name = cd
            .get(p + 46..p + 46 + name_len)
            .context("zip entry cut short")?;
        let name = String::from_utf8_lossy(name).into_owned();
        // Zip64 sizes and offset, in this order, for those saturated above.
        let extra = cd
            .get(p + 46 + name_len..p + 46 + name_len + extra_len)
            .context("zip entry cut short")?;
        let mut e = 0;
        while e + 4 <= extra.len() {
            let (id, len) = (le16(extra, e)?, le16(extra, e + 2)? as usize);
            if id == 1 {
                let mut q = e + 4;
                for v in [&mut uncompressed, &mut compressed, &mut local] {
                    if *v == 0xffff_ffff {
                        *v = le64(extra, q)?;
                        q += 8;
                    }
                }
            }
            e += 4 + len;
        }
        p += 46 + name_len + extra_len + comment_len;
        let Some(stem) = name.strip_suffix(".npy") else {
            continue;
        };
        // The member's bytes start after its local header (whose name and extra lengths may
        // differ from the central directory's).
        let mut lh = [0u8; 30];
        file.read_exact_at(&mut lh, local)
            .context("zip local header out of the file")?;
        ensure!(lh.starts_with(b"PK\x03\x04"), "zip local header malformed");
        let at = local + 30 + le16(&lh, 26)? + le16(&lh, 28)?;
        ensure!(
            at.checked_add(compressed).is_some_and(|e| e <= size),
            "member {name} runs past the end of the archive"
        );
        let deflated = match method {
            0 => None,
            8 => Some((compressed, uncompressed)),
            m => bail!("member {name}: zip method {m} (larder reads stored and deflated members)"),
        };
        out.push(Found {
            name: stem.to_string(),
            file: file.clone(),
            at,
            deflated,
        });
    }
    Ok(out)
}

impl RawSource for NpySource {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_range(&self, start: u64, count: u64) -> Result<Vec<RawSample>> {
        ensure!(
            start.checked_add(count).is_some_and(|end| end <= self.len),
            "samples {start}..{} are out of range (dataset has {})",
            start.saturating_add(count),
            self.len
        );
        let mut samples: Vec<RawSample> = (0..count)
            .map(|_| Vec::with_capacity(self.fields.len()))
            .collect();
        // Objects' fields at once: each read is a round trip to the store.
        let blocks: Vec<Result<Vec<u8>>> = if self.remote && self.fields.len() > 1 {
            std::thread::scope(|s| {
                let reads: Vec<_> = (self.fields.iter())
                    .map(|f| s.spawn(move || f.read(start, count)))
                    .collect();
                reads
                    .into_iter()
                    .map(|r| {
                        r.join()
                            .unwrap_or_else(|_| Err(anyhow::anyhow!("a read failed")))
                    })
                    .collect()
            })
        } else {
            self.fields.iter().map(|f| f.read(start, count)).collect()
        };
        for (f, block) in self.fields.iter().zip(blocks) {
            let block = block.map_err(|e| self.changed().map_or(e, super::changed_error))?;
            let dims: Vec<u32> = f.header.shape[1..].iter().map(|&d| d as u32).collect();
            for (i, sample) in samples.iter_mut().enumerate() {
                let r = f.row_bytes as usize;
                let mut data = block[i * r..(i + 1) * r].to_vec();
                if f.header.boolean {
                    data.iter_mut().for_each(|b| *b = (*b != 0) as u8);
                }
                sample.push(Value::new(dims.clone(), data));
            }
        }
        if let Some(why) = self.changed() {
            return Err(super::changed_error(why));
        }
        Ok(samples)
    }

    fn read_granule(&self) -> u64 {
        self.granule
    }

    fn disk_bytes(&self) -> u64 {
        self.len * self.fields.iter().map(|f| f.row_bytes).sum::<u64>()
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.specs.iter().map(|f| f.name.as_str()).collect();
        format!("npy:{}#{}", self.path.display(), names.join(","))
    }
}

impl Provenance for NpySource {
    fn version(&self) -> String {
        let mut v: Vec<String> = self.blobs.iter().map(|b| b.version()).collect();
        v.extend(self.fields.iter().map(|f| f.origin.clone()));
        v.join("|")
    }

    fn changed(&self) -> Option<String> {
        self.blobs.iter().find_map(|b| b.changed())
    }

    fn files(&self) -> crate::access::Files {
        crate::access::Files::List(self.files.clone())
    }

    fn root(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A .npy file's bytes, as numpy writes them (version 1, the header padded to 64 bytes).
    pub fn npy(descr: &str, shape: &[u64], data: &[u8]) -> Vec<u8> {
        let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
        let shape = if dims.len() == 1 {
            format!("({},)", dims[0])
        } else {
            format!("({})", dims.join(", "))
        };
        let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(h.len() as u16).to_le_bytes());
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn headers_parse_as_numpy_writes_them_and_odd_ones_are_refused() {
        let h = Header::parse(&npy("<f4", &[10, 3, 2], &[])).unwrap();
        assert_eq!(h.dtype, DType::Float32);
        assert_eq!(h.shape, vec![10, 3, 2]);
        assert_eq!(h.data_offset % 64, 0);
        assert_eq!(h.row_bytes(), Some(24));
        let h = Header::parse(&npy("|b1", &[5], &[])).unwrap();
        assert!(h.boolean && h.dtype == DType::Uint8 && h.shape == vec![5]);
        for (descr, says) in [
            (">f4", "other byte order"),
            ("<c8", "not one larder serves"),
            ("|O", "not one larder serves"),
        ] {
            let e = format!("{:#}", Header::parse(&npy(descr, &[2], &[])).unwrap_err());
            assert!(e.contains(says), "{descr}: {e}");
        }
        let mut fortran = npy("<f4", &[2, 2], &[]);
        let at = fortran.windows(5).position(|w| w == b"False").unwrap();
        fortran[at..at + 5].copy_from_slice(b"True ");
        assert!(format!("{:#}", Header::parse(&fortran).unwrap_err()).contains("Fortran"));
        assert!(Header::parse(b"\x93NUMPY\x01\x00\xff\xff{").is_err());
        assert!(Header::parse(b"PK\x03\x04").is_err());
    }

    #[test]
    fn a_folder_of_arrays_reads_row_by_row() {
        let dir = tempfile::tempdir().unwrap();
        let x: Vec<u8> = (0..4 * 2 * 3).map(|i| i as u8).collect();
        std::fs::write(dir.path().join("x.npy"), npy("|u1", &[4, 2, 3], &x)).unwrap();
        let y: Vec<u8> = [7i64, 8, 9, 10]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::write(dir.path().join("y.npy"), npy("<i8", &[4], &y)).unwrap();
        assert!(Npy.recognizes(dir.path()));
        let s = NpySource::open(dir.path(), &[]).unwrap();
        assert_eq!(s.len(), 4);
        let r = s.read_range(1, 2).unwrap();
        assert_eq!(r[0][0], Value::new(vec![2, 3], x[6..12].to_vec()));
        assert_eq!(r[1][1], Value::int64(9));
        // Cut short: refused at open, naming the file.
        std::fs::write(dir.path().join("y.npy"), &npy("<i8", &[4], &y)[..80]).unwrap();
        let e = format!("{:#}", NpySource::open(dir.path(), &[]).err().unwrap());
        assert!(e.contains("y.npy") && e.contains("cut short"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2048))]
        /// Any header bytes changed, cut or grown: a header whose rows and data offset are
        /// what it says, or an error; never a panic.
        #[test]
        fn altered_headers_parse_or_fail(
            edits in proptest::collection::vec((0usize..200, proptest::prelude::any::<u8>()), 0..8),
            cut in 0usize..200,
            descr in proptest::sample::select(vec!["<u1", "<f4", "|b1", ">i8", "<f2", "<c8"]),
            shape in proptest::collection::vec(0u64..1000, 1..4),
        ) {
            let mut b = npy(descr, &shape, &[]);
            for (at, v) in edits {
                let at = at % b.len();
                b[at] = v;
            }
            b.truncate(cut.max(1).min(b.len()));
            if let Ok(h) = Header::parse(&b) {
                proptest::prop_assert!(h.data_offset as usize <= b.len().max(64 * 1024 + 12));
                proptest::prop_assert!(!h.shape.is_empty());
            }
        }
    }
}
