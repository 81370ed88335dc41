//! HDF5 files: each field is an HDF5 dataset [N, ...] of any numeric type, or a variable-length
//! one-dimensional dataset [N] (clips of different lengths), read as stored.

use super::{file_version, Format, Opened, Provenance, RawSample, RawSource, Stamp};
use crate::config::keys::keys_of;
use crate::config::{DatasetConfig, FieldConfig, Limits, TrainCrop};
use crate::fields::{DType, FieldSpec, Pairing, Schema, Value};
use crate::pipeline::Preprocess;
use anyhow::{bail, ensure, Context, Result};
use hdf5::types::{FloatSize, IntSize, TypeDescriptor, VarLenArray};
use hdf5::{Hyperslab, SliceOrIndex};
use std::path::{Path, PathBuf};

/// HDF5 files (`kind = "hdf5"`): each field an HDF5 dataset [N, ...] (or a variable-length
/// [N] one) of one file, served as stored; granule: a chunk, or 1 MiB of a contiguous
/// dataset.
pub struct Hdf5;

/// The keys of a `[[dataset]]` table only HDF5 reads: the shorthand for an image and a label.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetKeys {
    /// The HDF5 dataset served as field "image" (default "images" when no `[[dataset.field]]`
    /// is given).
    #[serde(default)]
    samples: Option<String>,
    /// An integer HDF5 dataset [N] served as field "label", as int64.
    #[serde(default)]
    labels: Option<String>,
}

/// The keys of a `[[dataset.field]]` table only HDF5 reads.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FieldKeys {
    /// The HDF5 dataset in the file (default: the field's name).
    #[serde(default)]
    hdf5: Option<String>,
    /// Read the values as this dtype (HDF5 converts once, when the sample is first read);
    /// default: as stored.
    #[serde(default)]
    dtype: Option<DType>,
}

/// A field of an HDF5 dataset: its table, and the HDF5 dataset it is read from.
#[derive(Debug, Clone)]
pub struct Hdf5Field {
    pub config: FieldConfig,
    /// The HDF5 dataset in the file (default: the field's name).
    pub hdf5: Option<String>,
    /// The dtype values are read as (None: as stored).
    pub dtype: Option<DType>,
}

impl Hdf5Field {
    /// Field `name`, read from HDF5 dataset `hdf5`.
    pub fn new(name: &str, hdf5: &str) -> Hdf5Field {
        Hdf5Field {
            config: FieldConfig::named(name),
            hdf5: Some(hdf5.to_string()),
            dtype: None,
        }
    }
}

impl std::ops::Deref for Hdf5Field {
    type Target = FieldConfig;
    fn deref(&self) -> &FieldConfig {
        &self.config
    }
}

impl Hdf5 {
    /// The fields to serve: the `[[dataset.field]]` tables, or what the shorthand means.
    fn fields(&self, c: &DatasetConfig) -> Result<Vec<Hdf5Field>> {
        let keys: DatasetKeys = super::dataset_options(self, c)?;
        if c.fields.is_empty() {
            let mut fields = vec![Hdf5Field::new(
                "image",
                keys.samples.as_deref().unwrap_or("images"),
            )];
            if let Some(labels) = &keys.labels {
                fields.push(Hdf5Field {
                    dtype: Some(DType::Int64),
                    ..Hdf5Field::new("label", labels)
                });
            }
            return Ok(fields);
        }
        ensure!(
            keys.samples.is_none() && keys.labels.is_none(),
            "give either `samples`/`labels` or [[dataset.field]] tables, not both"
        );
        c.fields
            .iter()
            .map(|f| {
                ensure!(
                    f.mode.is_none(),
                    "field {:?}: `mode` is for image fields",
                    f.name
                );
                let k: FieldKeys = super::field_options(self, f)?;
                Ok(Hdf5Field {
                    config: f.clone(),
                    hdf5: k.hdf5,
                    dtype: k.dtype,
                })
            })
            .collect()
    }
}

impl Format for Hdf5 {
    fn name(&self) -> &'static str {
        "hdf5"
    }

    fn reads_objects(&self) -> std::result::Result<(), String> {
        Err(
            "HDF5 is read by libhdf5 through its POSIX file driver (chunk indexes walked and \
             read in place); its read-only S3 driver is not used: keep HDF5 on a local or \
             shared filesystem (NFS, Lustre)"
                .into(),
        )
    }

    fn recognizes(&self, path: &Path) -> bool {
        // The HDF5 signature, at offset 0 (a file with a user block has it at 512, 1024, ...).
        use std::io::Read;
        let mut head = [0u8; 8];
        path.is_file()
            && std::fs::File::open(path)
                .and_then(|mut f| f.read_exact(&mut head))
                .is_ok()
            && head == *b"\x89HDF\r\n\x1a\n"
            || path
                .extension()
                .is_some_and(|e| ["h5", "hdf5", "hdf"].contains(&e.to_string_lossy().as_ref()))
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
            "max_size and square are for image fields; HDF5 arrays are served as stored"
        );
        self.fields(c).map(drop)
    }

    fn default_crop(&self) -> Option<u32> {
        None
    }

    fn default_train_crop(&self) -> TrainCrop {
        TrainCrop::Random
    }

    fn open(&self, c: &DatasetConfig, _: &Limits) -> Result<Opened> {
        open_dataset(c)
    }
}

/// One field: an HDF5 dataset and how to read it.
struct Field {
    /// The HDF5 dataset's name in the file.
    hdf5: String,
    dataset: hdf5::Dataset,
    /// The type values are read as (the stored one unless the config asks for another).
    dtype: DType,
    /// Stored as HDF5 booleans (h5py's numpy bool): read as bool, served as uint8 0/1.
    boolean: bool,
    /// A variable-length dataset [N]: each value is one clip of its own length.
    varlen: bool,
    /// Dims of one value (fixed fields).
    dims: Vec<u32>,
    /// Small fields (labels and other few-byte values) are read whole at open and served from
    /// memory: a range read then costs one HDF5 read, of the large fields, not one per field.
    column: Option<Vec<u8>>,
}

/// Fields of at most this many bytes per sample, and this many in all, are kept in memory.
const COLUMN_VALUE_BYTES: u64 = 64;
const COLUMN_TOTAL_BYTES: u64 = 16 << 20;

/// An HDF5 file whose datasets [N, ...] are the fields of N samples.
pub struct Hdf5Source {
    path: PathBuf,
    fields: Vec<Field>,
    /// What the fields are, as served.
    specs: Vec<FieldSpec>,
    len: u64,
    disk_bytes: u64,
    granule: u64,
    /// The file as opened: reads from a file that no longer has it are refused.
    stamp: Stamp,
}

/// Bytes of a contiguous HDF5 dataset read together on a miss.
const CONTIGUOUS_GRANULE_BYTES: u64 = 1 << 20;
/// Most samples read together on a miss.
pub const MAX_GRANULE: u64 = 256;

/// The dtype a numeric HDF5 type is served as, or None for types larder does not serve.
fn numeric(t: &TypeDescriptor) -> Option<DType> {
    Some(match t {
        TypeDescriptor::Unsigned(IntSize::U1) | TypeDescriptor::Boolean => DType::Uint8,
        TypeDescriptor::Unsigned(IntSize::U2) => DType::Uint16,
        TypeDescriptor::Unsigned(IntSize::U4) => DType::Uint32,
        TypeDescriptor::Unsigned(IntSize::U8) => DType::Uint64,
        TypeDescriptor::Integer(IntSize::U1) => DType::Int8,
        TypeDescriptor::Integer(IntSize::U2) => DType::Int16,
        TypeDescriptor::Integer(IntSize::U4) => DType::Int32,
        TypeDescriptor::Integer(IntSize::U8) => DType::Int64,
        TypeDescriptor::Float(FloatSize::U2) => DType::Float16,
        TypeDescriptor::Float(FloatSize::U4) => DType::Float32,
        TypeDescriptor::Float(FloatSize::U8) => DType::Float64,
        _ => return None,
    })
}

impl Hdf5Source {
    /// Opens `path` and the HDF5 datasets of `fields`. Errors name the file, the field and the
    /// HDF5 dataset.
    pub fn open(path: &Path, fields: &[Hdf5Field]) -> Result<Hdf5Source> {
        // larderd only reads, and takes no HDF5 file lock: on long-term storage without flock
        // (many NFS and Lustre mounts) the lock fails every open, and one held by any process
        // that has the file open (or inherited its descriptor) would keep the dataset from
        // being served. A rewritten file changes size or mtime, which the scratch tier notices.
        // Opened first as a descriptor, by this thread's identity (a registered dataset's
        // owner's: see `owner`), refusing magic links; HDF5, which opens by path, is handed
        // that descriptor's /proc/self/fd link, so what it opens is the file checked here
        // whatever the path leads to by then.
        let what = || format!("opening HDF5 file {}", path.display());
        let held = crate::access::open_no_magiclinks(path, libc::O_NONBLOCK | libc::O_NOCTTY)
            .with_context(what)?;
        // A FIFO or a device would block HDF5's open (and HDF5's one lock with it, for every
        // dataset) or never end.
        let meta = held.metadata().with_context(what)?;
        ensure!(meta.is_file(), "{} is not a regular file", path.display());
        let stamp = Stamp::of_metadata(&meta);
        let file = {
            use std::os::fd::AsRawFd;
            hdf5::File::with_options()
                .with_fapl(|p| p.file_locking(false))
                .open(format!("/proc/self/fd/{}", held.as_raw_fd()))
                .with_context(what)?
        };
        drop(held);
        ensure!(
            !fields.is_empty(),
            "no fields to serve from {}",
            path.display()
        );
        let mut opened: Vec<Field> = vec![];
        let mut specs = vec![];
        let mut len: Option<(u64, &str)> = None;
        let mut any_varlen = false;
        for fc in fields {
            let (field, spec, n) = open_field(&file, path, fc)?;
            match len {
                None => len = Some((n, &fc.name)),
                Some((m, first)) => ensure!(
                    m == n,
                    "fields {first:?} and {:?} of {} differ in length: {m} and {n} samples \
                     (every field's dataset is [N, ...] with the same N)",
                    fc.name,
                    path.display()
                ),
            }
            any_varlen |= field.varlen;
            specs.push(spec);
            opened.push(field);
        }
        let len = len.map_or(0, |(n, _)| n);
        // Variable-length data lives in the file's heap, which storage_size does not count.
        let disk_bytes = if any_varlen {
            std::fs::metadata(path).map_or(0, |m| m.len())
        } else {
            opened.iter().map(|f| f.dataset.storage_size()).sum()
        };
        let granule = granule(&opened);
        Ok(Hdf5Source {
            path: path.to_path_buf(),
            fields: opened,
            specs,
            len,
            disk_bytes,
            granule,
            stamp,
        })
    }

    /// The fields as served (HDF5 data is served as stored).
    pub fn fields(&self) -> &[FieldSpec] {
        &self.specs
    }
}

impl RawSource for Hdf5Source {
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
        for f in &self.fields {
            let values = f
                .read(start as usize, (start + count) as usize)
                .map_err(|e| self.changed().map_or(e, super::changed_error))
                .with_context(|| {
                    format!(
                        "reading samples {start}..{} of {}#{}",
                        start + count,
                        self.path.display(),
                        f.hdf5
                    )
                })?;
            for (sample, v) in samples.iter_mut().zip(values) {
                sample.push(v);
            }
        }
        // HDF5 reads what lies past the end of a truncated file as zeros, without an error:
        // what was read counts only if the file is still the one opened.
        if let Some(why) = self.changed() {
            return Err(super::changed_error(why));
        }
        Ok(samples)
    }

    fn read_granule(&self) -> u64 {
        self.granule
    }

    fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.fields.iter().map(|f| f.hdf5.as_str()).collect();
        format!("hdf5:{}#{}", self.path.display(), names.join(","))
    }
}

impl Provenance for Hdf5Source {
    fn version(&self) -> String {
        let names: Vec<&str> = self.fields.iter().map(|f| f.hdf5.as_str()).collect();
        format!("{}#{}", file_version(&self.path), names.join(","))
    }

    fn changed(&self) -> Option<String> {
        self.stamp.changed(&self.path)
    }

    fn files(&self) -> crate::access::Files {
        crate::access::Files::List(std::sync::Arc::from(vec![self.path.clone()]))
    }

    fn root(&self) -> &Path {
        &self.path
    }
}

/// The bytes of a slice of plain numbers.
fn bytes_of<T: Copy>(values: &[T]) -> Vec<u8> {
    // SAFETY: T is a plain number type (the H5Type numbers below): any bytes are valid u8.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
    .to_vec()
}

impl Field {
    /// Values `start..end`, one per sample.
    fn read(&self, start: usize, end: usize) -> Result<Vec<Value>> {
        if self.varlen {
            return self.read_varlen(start, end);
        }
        let per = self
            .dims
            .iter()
            .fold(self.dtype.size(), |a, &d| a.saturating_mul(d as usize));
        let block;
        let data = match &self.column {
            Some(column) => &column[start * per..end * per],
            None => {
                block = self.read_block(start, end)?;
                &block[..]
            }
        };
        ensure!(
            data.len() == per * (end - start),
            "read {} bytes for {} samples",
            data.len(),
            end - start
        );
        Ok((0..end - start)
            .map(|i| Value::new(self.dims.clone(), data[i * per..(i + 1) * per].to_vec()))
            .collect())
    }

    /// The bytes of values `start..end`, in one hyperslab read.
    fn read_block(&self, start: usize, end: usize) -> Result<Vec<u8>> {
        let mut sel = vec![SliceOrIndex::from(start..end)];
        sel.extend(self.dims.iter().map(|_| SliceOrIndex::from(..)));
        let sel = Hyperslab::from(sel);
        let ds = &self.dataset;
        macro_rules! block {
            ($t:ty) => {{
                let a = ds.read_slice::<$t, _, ndarray::IxDyn>(sel)?;
                bytes_of(a.as_slice().context("non-contiguous read")?)
            }};
        }
        let data = match self.dtype {
            DType::Uint8 if self.boolean => block!(bool),
            DType::Uint8 => {
                ds.read_slice::<u8, _, ndarray::IxDyn>(sel)?
                    .into_raw_vec_and_offset()
                    .0
            }
            DType::Int8 => block!(i8),
            DType::Uint16 => block!(u16),
            DType::Int16 => block!(i16),
            DType::Uint32 => block!(u32),
            DType::Int32 => block!(i32),
            DType::Uint64 => block!(u64),
            DType::Int64 => block!(i64),
            DType::Float16 => block!(half::f16),
            DType::Float32 => block!(f32),
            DType::Float64 => block!(f64),
        };
        Ok(data)
    }

    fn read_varlen(&self, start: usize, end: usize) -> Result<Vec<Value>> {
        let ds = &self.dataset;
        macro_rules! clips {
            ($t:ty) => {
                ds.read_slice_1d::<VarLenArray<$t>, _>(start..end)?
                    .iter()
                    .map(|v| Value::new(vec![v.len() as u32], bytes_of(v.as_slice())))
                    .collect()
            };
        }
        Ok(match self.dtype {
            DType::Uint8 if self.boolean => clips!(bool),
            DType::Uint8 => clips!(u8),
            DType::Int8 => clips!(i8),
            DType::Uint16 => clips!(u16),
            DType::Int16 => clips!(i16),
            DType::Uint32 => clips!(u32),
            DType::Int32 => clips!(i32),
            DType::Uint64 => clips!(u64),
            DType::Int64 => clips!(i64),
            DType::Float16 => clips!(half::f16),
            DType::Float32 => clips!(f32),
            DType::Float64 => clips!(f64),
        })
    }
}

/// Opens the HDF5 dataset of field `fc` in `file`: its reader, its spec and its length.
fn open_field(file: &hdf5::File, path: &Path, fc: &Hdf5Field) -> Result<(Field, FieldSpec, u64)> {
    let name = fc.hdf5.as_deref().unwrap_or(&fc.name);
    let what = || {
        format!(
            "field {:?} (HDF5 dataset {name:?} in {})",
            fc.name,
            path.display()
        )
    };
    let missing = || {
        format!(
            "{}: no such dataset; the file has: {}",
            what(),
            file.member_names().unwrap_or_default().join(", ")
        )
    };
    // The links are looked at before the dataset is opened: opening follows them (an external
    // link to a FIFO would block HDF5's open, and its one lock, for every dataset).
    if !own_links(file, name).with_context(what)? {
        bail!(missing());
    }
    let dataset = file.dataset(name).with_context(missing)?;
    own_storage(&dataset).with_context(what)?;
    let stored = dataset
        .dtype()
        .and_then(|t| t.to_descriptor())
        .with_context(|| format!("{}: reading its type", what()))?;
    let shape = dataset.shape();
    ensure!(!shape.is_empty(), "{}: a scalar, expected [N, ...]", what());
    let n = shape[0] as u64;
    let (base, varlen) = match &stored {
        TypeDescriptor::VarLenArray(inner) => (inner.as_ref(), true),
        t => (t, false),
    };
    let Some(stored_dtype) = numeric(base) else {
        bail!(
            "{}: holds HDF5 type {stored:?}; larder serves numeric arrays (integers, \
             floats, booleans) and variable-length arrays of them, not strings, \
             compound or reference types",
            what()
        );
    };
    if varlen {
        ensure!(
            shape.len() == 1,
            "{}: a variable-length dataset must be one-dimensional [N], not {shape:?}",
            what()
        );
    }
    let dtype = fc.dtype.unwrap_or(stored_dtype);
    let boolean = matches!(base, TypeDescriptor::Boolean) && fc.dtype.is_none();
    let dims = shape[1..]
        .iter()
        .map(|&d| u32::try_from(d).context("dimension too large"))
        .collect::<Result<Vec<_>>>()?;
    let mut spec = if varlen {
        FieldSpec::new(&fc.name, dtype, vec![None])
    } else {
        FieldSpec::fixed(&fc.name, dtype, &dims)
    };
    if let Some(p) = &fc.pair {
        spec.pair = Some(Pairing {
            with: p.with.clone(),
            scale: p.scale,
        });
    }
    if let Some(r) = fc.resample {
        spec.resample = r;
    }
    let mut field = Field {
        hdf5: name.to_string(),
        dataset,
        dtype,
        boolean,
        varlen,
        dims,
        column: None,
    };
    let value_bytes = spec.fixed_bytes().unwrap_or(u64::MAX);
    if value_bytes <= COLUMN_VALUE_BYTES && value_bytes.saturating_mul(n) <= COLUMN_TOTAL_BYTES {
        let all = field
            .read_block(0, n as usize)
            .with_context(|| format!("{}: reading its values", what()))?;
        field.column = Some(all);
    }
    Ok((field, spec, n))
}

/// Refuses a field whose data lives outside this file: reached through a soft or external
/// link (here, before anything follows them), stored in external raw files, or a virtual
/// dataset mapping others (`own_storage`, once opened). The daemon reads them with its own
/// rights, so a file a user writes could otherwise point it at files the user may not read
/// (the access check looks at this file only). Ok(false): there is no such link.
fn own_links(file: &hdf5::File, name: &str) -> Result<bool> {
    use hdf5::{IndexType, IterationOrder, LinkType};
    let parts: Vec<&str> = name.split('/').filter(|p| !p.is_empty()).collect();
    let mut group: hdf5::Group = (**file).clone();
    for (k, part) in parts.iter().enumerate() {
        let kind = group.find_link(IndexType::Name, IterationOrder::Native, |n, info| {
            Ok((n == *part).then_some(info.link_type))
        })?;
        if kind.is_none() {
            return Ok(false);
        }
        ensure!(
            kind == Some(LinkType::Hard),
            "reached through a {} link ({part:?}); larder reads only data stored in the file itself",
            match kind {
                Some(LinkType::Soft) => "soft",
                _ => "external",
            }
        );
        if k + 1 < parts.len() {
            group = group.group(part)?;
        }
    }
    Ok(true)
}

fn own_storage(dataset: &hdf5::Dataset) -> Result<()> {
    let dcpl = dataset.dcpl()?;
    ensure!(
        dcpl.external().is_empty(),
        "stored in external raw files; larder reads only data stored in the file itself"
    );
    ensure!(
        dcpl.layout() != hdf5::dataset::Layout::Virtual,
        "a virtual dataset (it maps other files); larder reads only data stored in the file itself"
    );
    Ok(())
}

/// Samples read about as cheaply together as one alone: reading one sample of a chunked
/// dataset reads (and decompresses) its whole chunk, so the smallest any field asks for.
fn granule(fields: &[Field]) -> u64 {
    fields
        .iter()
        .map(|f| match f.dataset.chunk() {
            Some(chunk) => chunk[0] as u64,
            None if f.varlen => MAX_GRANULE,
            None => {
                let bytes = crate::fields::bytes_of(f.dtype.size(), &f.dims) as u64;
                CONTIGUOUS_GRANULE_BYTES / bytes.max(1)
            }
        })
        .min()
        .unwrap_or(1)
        .clamp(1, MAX_GRANULE)
}

/// An HDF5 dataset as its `[[dataset]]` table describes it: arrays served as stored.
fn open_dataset(c: &DatasetConfig) -> Result<Opened> {
    let fields = Hdf5.fields(c)?;
    let source = Hdf5Source::open(&c.path, &fields)?;
    let label = source.fields().iter().find(|f| f.name == "label");
    let labels = (c.fields.is_empty())
        .then(|| fields.get(1).and_then(|f| f.hdf5.clone()))
        .flatten();
    if let (Some(labels), Some(label)) = (&labels, label) {
        ensure!(
            label.shape.is_empty(),
            "label dataset {labels:?} has shape {:?} per sample; `labels` takes one class \
             id per sample: declare it as a [[dataset.field]] (a mask, say) instead",
            label
                .shape
                .iter()
                .map(|d| d.unwrap_or(0))
                .collect::<Vec<_>>()
        );
    }
    let schema = Schema::new(source.fields().to_vec())?;
    Ok(Opened {
        source: Box::new(source),
        preprocess: Preprocess::Identity,
        schema,
        format: &Hdf5,
    })
}

/// Writes a uint8 HDF5 dataset `samples` shaped [N, shape...] and, if given, int64 `labels`.
/// Used by `larder demo`, the tests and the benchmarks to make real input files.
pub fn write_hdf5(
    path: &Path,
    samples: &str,
    shape: &[usize],
    data: &[u8],
    labels: Option<(&str, &[i64])>,
) -> Result<()> {
    let file = hdf5::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let array = ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), data.to_vec())
        .context("data does not match the shape")?;
    file.new_dataset_builder()
        .with_data(&array)
        .create(samples)
        .with_context(|| format!("writing dataset {samples:?}"))?;
    if let Some((name, labels)) = labels {
        file.new_dataset_builder()
            .with_data(labels)
            .create(name)
            .with_context(|| format!("writing dataset {name:?}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(names: &[(&str, &str)]) -> Vec<Hdf5Field> {
        names
            .iter()
            .map(|(name, hdf5)| Hdf5Field::new(name, hdf5))
            .collect()
    }

    #[test]
    fn reads_ranges_of_every_field_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.h5");
        let data: Vec<u8> = (0..5 * 2 * 3).map(|i| i as u8).collect();
        let labels: Vec<i64> = vec![10, 11, 12, 13, 14];
        write_hdf5(&path, "x", &[5, 2, 3], &data, Some(("y", &labels))).unwrap();
        let src = Hdf5Source::open(&path, &fields(&[("image", "x"), ("label", "y")])).unwrap();
        assert_eq!(src.len(), 5);
        assert_eq!(
            src.fields()[0],
            FieldSpec::fixed("image", DType::Uint8, &[2, 3])
        );
        assert_eq!(
            src.fields()[1],
            FieldSpec::fixed("label", DType::Int64, &[])
        );
        let s = src.read(1).unwrap();
        assert_eq!(s[0], Value::new(vec![2, 3], data[6..12].to_vec()));
        assert_eq!(s[1], Value::int64(11));
        let r = src.read_range(1, 2).unwrap();
        assert_eq!(r[1][0].data, data[12..18].to_vec());
        assert_eq!(r[1][1], Value::int64(12));
        assert!(src.read_range(4, 2).is_err());
        assert!(src.read(5).is_err());
        assert!(src.disk_bytes() >= 30 + 40);
    }

    #[test]
    fn any_numeric_type_and_variable_lengths() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.h5");
        let file = hdf5::File::create(&path).unwrap();
        let flow = ndarray::Array3::<f32>::from_shape_fn((3, 2, 2), |(i, j, k)| {
            (i * 4 + j * 2 + k) as f32 * 0.5
        });
        file.new_dataset_builder()
            .with_data(&flow)
            .create("flow")
            .unwrap();
        let half = ndarray::Array2::<half::f16>::from_shape_fn((3, 2), |(i, j)| {
            half::f16::from_f32((i + j) as f32)
        });
        file.new_dataset_builder()
            .with_data(&half)
            .create("h")
            .unwrap();
        let clips: Vec<VarLenArray<i16>> = (0..3)
            .map(|i| {
                VarLenArray::from_slice(&(0..i * 2 + 1).map(|v| v as i16 - 3).collect::<Vec<_>>())
            })
            .collect();
        file.new_dataset_builder()
            .with_data(&clips)
            .create("clip")
            .unwrap();
        file.new_dataset_builder()
            .with_data(&[true, false, true])
            .create("ok")
            .unwrap();
        drop(file);
        let src = Hdf5Source::open(
            &path,
            &fields(&[("flow", "flow"), ("h", "h"), ("clip", "clip"), ("ok", "ok")]),
        )
        .unwrap();
        assert_eq!(
            src.fields()[2],
            FieldSpec::new("clip", DType::Int16, vec![None])
        );
        assert_eq!(src.fields()[1].dtype, DType::Float16);
        assert_eq!(src.fields()[3].dtype, DType::Uint8);
        let s = src.read_range(0, 3).unwrap();
        assert_eq!(s[2][0].data, bytes_of(&[4.0f32, 4.5, 5.0, 5.5]));
        assert_eq!(
            s[2][1].data,
            bytes_of(&[half::f16::from_f32(2.0), half::f16::from_f32(3.0)])
        );
        assert_eq!(
            s[2][2],
            Value::new(vec![5], bytes_of(&[-3i16, -2, -1, 0, 1]))
        );
        assert_eq!(s[0][2], Value::new(vec![1], bytes_of(&[-3i16])));
        assert_eq!(
            (s[0][3].data.clone(), s[1][3].data.clone()),
            (vec![1], vec![0])
        );
    }

    #[test]
    fn errors_name_the_field_and_dataset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.h5");
        let file = hdf5::File::create(&path).unwrap();
        file.new_dataset_builder()
            .with_data(&ndarray::Array2::<u8>::zeros((4, 3)))
            .create("b")
            .unwrap();
        file.new_dataset_builder()
            .with_data(&[1i32, 2, 3])
            .create("short")
            .unwrap();
        let names: Vec<hdf5::types::VarLenUnicode> =
            (0..4).map(|i| format!("n{i}").parse().unwrap()).collect();
        file.new_dataset_builder()
            .with_data(&names)
            .create("names")
            .unwrap();
        drop(file);
        let err = format!(
            "{:#}",
            Hdf5Source::open(&path, &fields(&[("image", "b"), ("label", "short")]))
                .err()
                .unwrap()
        );
        assert!(err.contains("fields \"image\" and \"label\""), "{err}");
        assert!(err.contains("4 and 3 samples"), "{err}");
        let err = format!(
            "{:#}",
            Hdf5Source::open(&path, &fields(&[("name", "names")]))
                .err()
                .unwrap()
        );
        assert!(
            err.contains("field \"name\" (HDF5 dataset \"names\""),
            "{err}"
        );
        assert!(err.contains("not strings"), "{err}");
        let err = format!(
            "{:#}",
            Hdf5Source::open(&path, &fields(&[("image", "nope")]))
                .err()
                .unwrap()
        );
        assert!(err.contains("\"nope\""), "{err}");
        assert!(err.contains("the file has: b, names, short"), "{err}");
    }

    #[test]
    fn opens_a_file_another_process_holds_locked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.h5");
        write_hdf5(&path, "x", &[2, 3], &[1; 6], None).unwrap();
        let held = std::fs::File::open(&path).unwrap();
        held.lock().unwrap(); // flock, as HDF5 takes it
        let src = Hdf5Source::open(&path, &fields(&[("image", "x")])).unwrap();
        assert_eq!(src.read(1).unwrap()[0].data, vec![1; 3]);
    }

    #[test]
    fn granules_follow_the_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.h5");
        let granule = |name: &str| {
            Hdf5Source::open(&path, &fields(&[("x", name)]))
                .unwrap()
                .read_granule()
        };
        // Contiguous, 64 KiB samples: 1 MiB at a time.
        write_hdf5(&path, "big", &[40, 1 << 16], &vec![0; 40 << 16], None).unwrap();
        assert_eq!(granule("big"), 16);
        // Contiguous, tiny samples: capped.
        write_hdf5(&path, "small", &[1000, 4], &[0; 4000], None).unwrap();
        assert_eq!(granule("small"), MAX_GRANULE);
        // Chunked: one chunk.
        let file = hdf5::File::create(&path).unwrap();
        file.new_dataset::<u8>()
            .chunk([10, 4])
            .shape([1000, 4])
            .create("chunked")
            .unwrap();
        drop(file);
        assert_eq!(granule("chunked"), 10);
    }
}
