//! Hugging Face datasets as `save_to_disk` writes them (`kind = "hf"`): a folder with
//! `state.json` and Arrow IPC *stream* files (`data-0000k-of-0000n.arrow`), or a `DatasetDict`
//! folder (`dataset_dict.json`, a subfolder per split), or the library's cache folder
//! (`NAME-SPLIT(-0000k-of-0000n).arrow`). Columns are fields: `Image()` columns (a struct of
//! the file's bytes and a path) through the image pipeline; numbers (ClassLabel is int64) as
//! scalars of their type; lists of numbers (`Sequence`, `Array2D`...) as arrays of their type,
//! their shape from the row. Other columns (text, audio, nested) are left out and listed.
//!
//! A stream file has no footer: its message headers are scanned once at open (a few bytes
//! each; bodies are skipped), then a record batch is read and decoded when its rows are
//! asked for. The granule is the record batch (at most `MAX_GRANULE` rows of it).

use super::{Blob, Format, Opened, Provenance, RawSample, RawSource};
use crate::config::keys::keys_of;
use crate::config::{DatasetConfig, ImageMode, Limits, TrainCrop};
use crate::fields::{DType, FieldSpec, Resample, Schema, Value};
use crate::objects::Object;
use crate::pipeline::{FieldOp, Preprocess};
use anyhow::{bail, ensure, Context, Result};
use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef};
use arrow_schema::DataType;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Hugging Face `save_to_disk` folders and cache folders (`kind = "hf"`).
pub struct Hf;

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetKeys {
    /// The split of a `DatasetDict` or a cache folder (default: "train").
    #[serde(default)]
    split: Option<String>,
}

/// The keys of a `[[dataset.field]]` table of a columnar kind (hf, parquet).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FieldKeys {
    /// The column (default: the field's name).
    #[serde(default)]
    pub(super) column: Option<String>,
}

impl Format for Hf {
    fn name(&self) -> &'static str {
        "hf"
    }

    fn recognizes(&self, path: &Path) -> bool {
        path.join("state.json").is_file() || path.join("dataset_dict.json").is_file()
    }

    fn reads_objects(&self) -> std::result::Result<(), String> {
        Ok(())
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
        let keys: DatasetKeys = super::dataset_options(self, c)?;
        let files = arrow_files(&c.path, keys.split.as_deref().unwrap_or("train"))?;
        let wanted = wanted_columns(self, c)?;
        let mut source = HfSource::open(&c.path, files, &wanted)?;
        source.max_value_bytes = limits.max_sample_bytes;
        opened(c, &source.columns.clone(), Box::new(source), &Hf)
    }
}

/// The columns `c`'s `[[dataset.field]]` tables name: (field, column), in their order.
pub(super) fn wanted_columns(
    format: &dyn Format,
    c: &DatasetConfig,
) -> Result<Vec<(crate::config::FieldConfig, String)>> {
    c.fields
        .iter()
        .map(|f| {
            let k: FieldKeys = super::field_options(format, f)?;
            Ok((f.clone(), k.column.unwrap_or_else(|| f.name.clone())))
        })
        .collect()
}

/// A columnar dataset (hf, parquet) opened: its columns as fields, images through the image
/// pipeline, numbers kept as read.
pub(super) fn opened(
    c: &DatasetConfig,
    columns: &[Column],
    source: Box<dyn super::Source>,
    format: &'static dyn Format,
) -> Result<Opened> {
    let resize = super::resize_of(format, c);
    let mut ops = vec![];
    let mut specs = vec![];
    for col in columns {
        match &col.kind {
            Kind::Image => {
                let mode = col.mode.unwrap_or(ImageMode::Rgb);
                let resample = match mode {
                    ImageMode::Index => Resample::Nearest,
                    _ => c.interpolation.unwrap_or(Resample::Linear),
                };
                // As `datasets` decodes: JPEGs turned upright by their EXIF orientation.
                let op = FieldOp::Decode {
                    mode,
                    scale: 1,
                    resample,
                    upright: true,
                };
                specs.push(op.field(&col.field, &resize));
                ops.push(op);
            }
            Kind::Numbers { dtype, dims } => {
                specs.push(FieldSpec::new(&col.field, *dtype, dims.clone()));
                ops.push(FieldOp::Keep);
            }
        }
    }
    let any_image = columns.iter().any(|c| matches!(c.kind, Kind::Image));
    let preprocess = if any_image {
        Preprocess::Images { ops, resize }
    } else {
        Preprocess::Identity
    };
    Ok(Opened {
        source,
        preprocess,
        schema: Schema::new(specs)?,
        format,
    })
}

/// A column left out, and why.
pub(super) type LeftOut = (String, String);

/// The columns of `schema` served as fields: those `wanted` names (field, column), or every
/// one larder serves, with those left out and why. Shapes the `huggingface` metadata declares
/// (ArrayND features) fix a list column's dims.
pub(super) fn columns_of(
    path: &Path,
    schema: &arrow_schema::Schema,
    wanted: &[(crate::config::FieldConfig, String)],
) -> Result<(Vec<Column>, Vec<LeftOut>)> {
    let declared = declared_shapes(schema);
    let mut columns = vec![];
    let mut skipped = vec![];
    if wanted.is_empty() {
        for (index, f) in schema.fields().iter().enumerate() {
            match kind_of(f) {
                Ok(kind) => columns.push(Column {
                    field: f.name().clone(),
                    index,
                    kind,
                    mode: None,
                }),
                Err(why) => skipped.push((f.name().clone(), why)),
            }
        }
    } else {
        for (fc, name) in wanted {
            let (index, f) = schema.column_with_name(name).with_context(|| {
                format!(
                    "field {:?}: no column {name:?} (columns: {})",
                    fc.name,
                    schema
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            })?;
            let kind = kind_of(f)
                .map_err(|why| anyhow::anyhow!("field {:?}: column {name:?} is {why}", fc.name))?;
            ensure!(
                fc.mode.is_none() || matches!(kind, Kind::Image),
                "field {:?}: `mode` is for image columns",
                fc.name
            );
            columns.push(Column {
                field: fc.name.clone(),
                index,
                kind,
                mode: fc.mode,
            });
        }
    }
    ensure!(
        !columns.is_empty(),
        "{}: no column larder serves (left out: {})",
        path.display(),
        skipped
            .iter()
            .map(|(c, why)| format!("{c}: {why}"))
            .collect::<Vec<_>>()
            .join("; ")
    );
    if !skipped.is_empty() {
        tracing::info!(dataset = %path.display(), ?skipped, "columns left out");
    }
    for c in &mut columns {
        if let (Kind::Numbers { dims, .. }, Some(shape)) = (&mut c.kind, declared.get(&c.field)) {
            if shape.len() == dims.len() {
                *dims = shape.iter().map(|&d| Some(d)).collect();
            }
        }
    }
    Ok((columns, skipped))
}

/// The shapes the `huggingface` schema metadata declares for ArrayND features, by column.
fn declared_shapes(schema: &arrow_schema::Schema) -> std::collections::HashMap<String, Vec<u32>> {
    let mut out = std::collections::HashMap::new();
    let Some(meta) = schema.metadata().get("huggingface") else {
        return out;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(meta) else {
        return out;
    };
    if let Some(features) = v["info"]["features"].as_object() {
        for (name, f) in features {
            if let Ok(shape) = serde_json::from_value::<Vec<u32>>(f["shape"].clone()) {
                out.insert(name.clone(), shape);
            }
        }
    }
    out
}

/// A dataset's folder: on a filesystem, or a prefix of objects (listed once).
enum Folder {
    Local(PathBuf),
    Objects(PathBuf, Vec<Object>),
}

/// An object's URL, as a path.
fn path_of(o: &Object) -> PathBuf {
    PathBuf::from(o.url())
}

impl Folder {
    fn at(path: &Path) -> Result<Folder> {
        Ok(match crate::objects::is_url(path) {
            true => Folder::Objects(path.to_path_buf(), super::blob::objects_at(path)?),
            false => Folder::Local(path.to_path_buf()),
        })
    }

    fn path(&self) -> &Path {
        match self {
            Folder::Local(p) | Folder::Objects(p, _) => p,
        }
    }

    fn has(&self, name: &str) -> bool {
        match self {
            Folder::Local(p) => p.join(name).is_file(),
            Folder::Objects(p, objects) => objects.iter().any(|o| path_of(o) == p.join(name)),
        }
    }

    /// The file `name`, opened.
    fn open(&self, name: &str) -> Result<Blob> {
        match self {
            Folder::Local(p) => Blob::open(&p.join(name)),
            Folder::Objects(p, objects) => {
                let want = p.join(name);
                let o = objects
                    .iter()
                    .find(|o| path_of(o) == want)
                    .with_context(|| format!("{}: no such object", want.display()))?;
                Ok(Blob::of_object(o.clone()))
            }
        }
    }

    /// The bytes of the small file `name` (a JSON description), at most `max`.
    fn read(&self, name: &str, max: u64) -> Result<Vec<u8>> {
        match self {
            Folder::Local(p) => super::read_capped(&p.join(name), max),
            Folder::Objects(..) => self.open(name)?.read_all(max),
        }
    }

    /// The names of the files right in it.
    fn names(&self) -> Result<Vec<String>> {
        Ok(match self {
            Folder::Local(p) => std::fs::read_dir(p)
                .with_context(|| format!("reading folder {}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect(),
            Folder::Objects(p, objects) => objects
                .iter()
                .map(path_of)
                .filter(|o| o.parent() == Some(p))
                .filter_map(|o| Some(o.file_name()?.to_string_lossy().into_owned()))
                .collect(),
        })
    }

    /// Its subfolder `name`.
    fn sub(self, name: &str) -> Folder {
        match self {
            Folder::Local(p) => Folder::Local(p.join(name)),
            Folder::Objects(p, objects) => {
                let p = p.join(name);
                let objects = objects
                    .into_iter()
                    .filter(|o| path_of(o).starts_with(&p))
                    .collect();
                Folder::Objects(p, objects)
            }
        }
    }
}

/// The Arrow files of the dataset at `path`, in order, opened.
fn arrow_files(path: &Path, split: &str) -> Result<Vec<Blob>> {
    arrow_files_in(Folder::at(path)?, split)
}

fn arrow_files_in(folder: Folder, split: &str) -> Result<Vec<Blob>> {
    let path = folder.path().to_path_buf();
    if folder.has("dataset_dict.json") {
        let dict: serde_json::Value =
            serde_json::from_slice(&folder.read("dataset_dict.json", 1 << 20)?)
                .context("dataset_dict.json")?;
        let splits: Vec<&str> = dict["splits"]
            .as_array()
            .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
            .unwrap_or_default();
        ensure!(
            splits.contains(&split),
            "{}: no split {split:?} (it has: {}); give `split`",
            path.display(),
            splits.join(", ")
        );
        ensure!(!split.contains('/') && split != "..", "split {split:?}");
        return arrow_files_in(folder.sub(split), split);
    }
    if folder.has("state.json") {
        let state: serde_json::Value =
            serde_json::from_slice(&folder.read("state.json", 1 << 20)?).context("state.json")?;
        let files: Vec<Blob> = state["_data_files"]
            .as_array()
            .context("state.json has no _data_files")?
            .iter()
            .map(|f| {
                let name = f["filename"]
                    .as_str()
                    .context("a data file without a filename")?;
                ensure!(
                    !name.contains('/') && name.ends_with(".arrow"),
                    "data file {name:?}"
                );
                folder.open(name)
            })
            .collect::<Result<_>>()?;
        ensure!(!files.is_empty(), "{}: no data files", path.display());
        return Ok(files);
    }
    // The library's cache folder: NAME-SPLIT.arrow or NAME-SPLIT-0000k-of-0000n.arrow.
    let mut names: Vec<String> = folder
        .names()?
        .into_iter()
        .filter(|name| {
            let Some(stem) = name.strip_suffix(".arrow") else {
                return false;
            };
            let shard = stem
                .rsplit_once("-of-")
                .and_then(|(a, _)| a.rsplit_once('-'));
            let base = shard.map_or(stem, |(b, _)| b);
            base.ends_with(&format!("-{split}"))
        })
        .collect();
    names.sort();
    ensure!(
        !names.is_empty(),
        "{}: no state.json or dataset_dict.json, and no cache files of split {split:?}",
        path.display()
    );
    names.iter().map(|n| folder.open(n)).collect()
}

/// What a column is served as.
#[derive(Debug, Clone)]
pub(super) enum Kind {
    /// `Image()`: the file's bytes, decoded by the image pipeline.
    Image,
    /// Numbers: a scalar, or lists of them with these dims (None: varies by row).
    Numbers {
        dtype: DType,
        dims: Vec<Option<u32>>,
    },
}

#[derive(Clone)]
pub(super) struct Column {
    pub(super) field: String,
    /// Its index in the files' schema.
    pub(super) index: usize,
    pub(super) kind: Kind,
    pub(super) mode: Option<ImageMode>,
}

/// A record batch: which file, where its message is, and its rows.
struct Batch {
    file: usize,
    meta_at: u64,
    meta_len: u64,
    body_at: u64,
    body_len: u64,
    first_row: u64,
    rows: u64,
    /// Each array's (length, null count), depth first, as the header lists them.
    nodes: Vec<(u64, u64)>,
    /// Each buffer's (offset in the body, length), depth first.
    buffers: Vec<(u64, u64)>,
    /// The body's buffers are compressed (LZ4/ZSTD): read only whole.
    compressed: bool,
}

pub struct HfSource {
    path: PathBuf,
    files: Vec<Blob>,
    schema: arrow_schema::SchemaRef,
    columns: Vec<Column>,
    batches: Vec<Batch>,
    len: u64,
    granule: u64,
    access: Arc<[PathBuf]>,
    /// Left out: (column, why).
    skipped: Vec<(String, String)>,
    /// Where each served column's values are in a batch, when a row can be read alone.
    direct: Option<Vec<Direct>>,
    max_value_bytes: u64,
}

/// What column `field` is served as, or why it is left out. An `ArrayND` column's shape is
/// in its extension metadata (`[[2, 3], "float32"]`): its dims are fixed from there.
pub(super) fn kind_of(field: &arrow_schema::Field) -> Result<Kind, String> {
    let mut kind = kind_of_type(field.data_type())?;
    if let (Kind::Numbers { dims, .. }, Some(meta)) =
        (&mut kind, field.metadata().get("ARROW:extension:metadata"))
    {
        let shape: Option<Vec<u32>> = serde_json::from_str::<serde_json::Value>(meta)
            .ok()
            .and_then(|v| v.get(0).cloned())
            .and_then(|v| serde_json::from_value(v).ok());
        if let Some(shape) = shape.filter(|s| s.len() == dims.len()) {
            *dims = shape.into_iter().map(Some).collect();
        }
    }
    Ok(kind)
}

/// What a column of type `t` is served as, or why it is left out.
fn kind_of_type(t: &DataType) -> Result<Kind, String> {
    let scalar = |t: &DataType| -> Option<DType> {
        Some(match t {
            DataType::Boolean | DataType::UInt8 => DType::Uint8,
            DataType::Int8 => DType::Int8,
            DataType::UInt16 => DType::Uint16,
            DataType::Int16 => DType::Int16,
            DataType::UInt32 => DType::Uint32,
            DataType::Int32 => DType::Int32,
            DataType::UInt64 => DType::Uint64,
            DataType::Int64 => DType::Int64,
            DataType::Float16 => DType::Float16,
            DataType::Float32 => DType::Float32,
            DataType::Float64 => DType::Float64,
            _ => return None,
        })
    };
    if let DataType::Struct(f) = t {
        let bytes = f.iter().find(|f| f.name() == "bytes");
        if bytes.is_some_and(|b| matches!(b.data_type(), DataType::Binary | DataType::LargeBinary))
        {
            return Ok(Kind::Image);
        }
        return Err("a struct that is not an image".into());
    }
    let mut dims = vec![];
    let mut t = t;
    loop {
        match t {
            DataType::List(f) | DataType::LargeList(f) => {
                dims.push(None);
                t = f.data_type();
            }
            DataType::FixedSizeList(f, n) => {
                dims.push(Some(*n as u32));
                t = f.data_type();
            }
            _ => break,
        }
    }
    match scalar(t) {
        Some(dtype) if dims.len() <= 6 => Ok(Kind::Numbers { dtype, dims }),
        Some(_) => Err("lists nested over 6 deep".into()),
        None => Err(format!(
            "{t} values (text, audio and the like are not served)"
        )),
    }
}

impl HfSource {
    fn open(
        path: &Path,
        files: Vec<Blob>,
        wanted: &[(crate::config::FieldConfig, String)],
    ) -> Result<HfSource> {
        let paths: Vec<PathBuf> = files.iter().map(Blob::path).collect();
        let mut batches = vec![];
        let mut schema: Option<arrow_schema::SchemaRef> = None;
        let mut len = 0u64;
        for (k, (p, file)) in paths.iter().zip(&files).enumerate() {
            let s = scan(file, file.size(), k, &mut len, &mut batches)
                .with_context(|| format!("reading Arrow stream {}", p.display()))?;
            match &schema {
                None => schema = Some(Arc::new(s)),
                Some(first) => ensure!(
                    first.fields() == s.fields(),
                    "{} has other columns than {}",
                    p.display(),
                    paths[0].display()
                ),
            }
        }
        let schema = schema.context("no Arrow files")?;
        let (columns, skipped) = columns_of(path, &schema, wanted)?;
        // Images whose other fields are plain numbers are read a row at a time, straight from
        // the batch's buffers (a decoded image is far larger than its bytes: a granule of a
        // whole batch would decode 100 for one). Else rows of a batch, up to the largest share
        // of it the store may ask for at once.
        let direct = direct_layout(&schema, &columns, &batches);
        let most = batches.iter().map(|b| b.rows).max().unwrap_or(1);
        let granule = if direct.is_some() {
            1
        } else {
            (1..=most.min(super::MAX_GRANULE))
                .rev()
                .find(|g| most % g == 0)
                .unwrap_or(1)
        };
        let mut access = vec![path.to_path_buf()];
        if !crate::objects::is_url(path) {
            access.extend(paths.iter().cloned());
        }
        Ok(HfSource {
            path: path.to_path_buf(),
            files,
            schema,
            columns,
            batches,
            len,
            granule,
            access: access.into(),
            skipped,
            direct,
            max_value_bytes: u64::MAX,
        })
    }

    /// Record batch `b`, its columns decoded (only those served).
    fn batch(&self, b: &Batch) -> Result<arrow_array::RecordBatch> {
        let file = &self.files[b.file];
        let max = self.max_value_bytes.saturating_mul(super::MAX_GRANULE);
        ensure!(
            b.body_len <= max && b.meta_len <= 16 << 20,
            "a record batch of {} bytes",
            b.body_len
        );
        let mut meta = vec![0u8; b.meta_len as usize];
        file.read_exact_at(&mut meta, b.meta_at)?;
        let message = arrow_ipc::root_as_message(&meta)
            .map_err(|e| anyhow::anyhow!("a record batch's header: {e}"))?;
        let rb = message
            .header_as_record_batch()
            .context("not a record batch")?;
        // arrow's reader slices the body where the header says, and panics past its end: each
        // buffer is checked to lie within it first.
        for buffer in rb.buffers().into_iter().flatten() {
            let end = (buffer.offset() as u64).checked_add(buffer.length() as u64);
            ensure!(
                buffer.offset() >= 0
                    && buffer.length() >= 0
                    && end.is_some_and(|e| e <= b.body_len),
                "a record batch's buffer at {} of {} bytes, past its body of {}",
                buffer.offset(),
                buffer.length(),
                b.body_len
            );
        }
        let mut body = vec![0u8; b.body_len as usize];
        file.read_exact_at(&mut body, b.body_at)?;
        let projection: Vec<usize> = self.columns.iter().map(|c| c.index).collect();
        // Anything else arrow's decoder does not check of a forged file is that batch's error,
        // not a crash of the process reading it.
        let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            arrow_ipc::reader::read_record_batch(
                &arrow_buffer::Buffer::from(body),
                rb,
                self.schema.clone(),
                &Default::default(),
                Some(&projection),
                &message.version(),
            )
        }))
        .map_err(|_| {
            anyhow::anyhow!("a record batch arrow's reader does not decode (it panicked)")
        })??;
        ensure!(
            decoded.num_rows() as u64 == b.rows,
            "rows differ from the header's"
        );
        Ok(decoded)
    }
}

/// Scans the Arrow stream in `file`: its schema, and each record batch's place (appended to
/// `batches`, numbered from `len` on).
fn scan(
    file: &Blob,
    size: u64,
    index: usize,
    len: &mut u64,
    batches: &mut Vec<Batch>,
) -> Result<arrow_schema::Schema> {
    let mut at = 0u64;
    let mut schema = None;
    loop {
        let mut word = [0u8; 4];
        if at + 4 > size {
            break;
        }
        file.read_exact_at(&mut word, at)?;
        at += 4;
        let mut meta_len = u32::from_le_bytes(word) as u64;
        if meta_len == 0xffff_ffff {
            file.read_exact_at(&mut word, at)?;
            at += 4;
            meta_len = u32::from_le_bytes(word) as u64;
        }
        if meta_len == 0 {
            break;
        }
        ensure!(
            meta_len <= 16 << 20 && at + meta_len <= size,
            "a message header of {meta_len} bytes at {at}"
        );
        let mut meta = vec![0u8; meta_len as usize];
        file.read_exact_at(&mut meta, at)?;
        let message = arrow_ipc::root_as_message(&meta)
            .map_err(|e| anyhow::anyhow!("a message header at {at}: {e}"))?;
        let body_len = u64::try_from(message.bodyLength()).context("a negative body length")?;
        let body_at = at + meta_len;
        ensure!(
            body_at.checked_add(body_len).is_some_and(|e| e <= size),
            "a message body runs past the end of the file"
        );
        match message.header_type() {
            arrow_ipc::MessageHeader::Schema => {
                ensure!(schema.is_none(), "a second schema");
                let s = message.header_as_schema().context("a schema")?;
                schema = Some(arrow_ipc::convert::try_fb_to_schema(s)?);
            }
            arrow_ipc::MessageHeader::RecordBatch => {
                ensure!(schema.is_some(), "a record batch before the schema");
                let rb = message.header_as_record_batch().context("a record batch")?;
                let rows = u64::try_from(rb.length()).context("a negative row count")?;
                let nodes = rb
                    .nodes()
                    .map(|n| {
                        n.iter()
                            .map(|n| (n.length().max(0) as u64, n.null_count().max(0) as u64))
                            .collect()
                    })
                    .unwrap_or_default();
                let buffers = rb
                    .buffers()
                    .map(|b| {
                        b.iter()
                            .map(|b| (b.offset().max(0) as u64, b.length().max(0) as u64))
                            .collect()
                    })
                    .unwrap_or_default();
                if rows > 0 {
                    batches.push(Batch {
                        nodes,
                        buffers,
                        compressed: rb.compression().is_some(),
                        file: index,
                        meta_at: at,
                        meta_len,
                        body_at,
                        body_len,
                        first_row: *len,
                        rows,
                    });
                    *len += rows;
                }
            }
            arrow_ipc::MessageHeader::DictionaryBatch => {
                bail!("dictionary-encoded columns are not read (save_to_disk writes none)")
            }
            other => bail!("an unexpected {other:?} message"),
        }
        at = body_at + body_len;
    }
    schema.context("no schema")
}

/// How many buffers and array nodes a column of type `t` has in a record batch (depth first);
/// None for types whose count this does not know (unions, views, run-end encoding).
fn layout_of(t: &DataType) -> Option<(usize, usize)> {
    Some(match t {
        DataType::Null => (0, 1),
        DataType::Binary | DataType::Utf8 | DataType::LargeBinary | DataType::LargeUtf8 => (3, 1),
        DataType::Boolean | DataType::FixedSizeBinary(_) => (2, 1),
        DataType::List(f) | DataType::LargeList(f) | DataType::Map(f, _) => {
            let (b, n) = layout_of(f.data_type())?;
            (2 + b, 1 + n)
        }
        DataType::FixedSizeList(f, _) => {
            let (b, n) = layout_of(f.data_type())?;
            (1 + b, 1 + n)
        }
        DataType::Struct(fs) => fs.iter().try_fold((1, 1), |(b, n), f| {
            layout_of(f.data_type()).map(|(x, y)| (b + x, n + y))
        })?,
        t if t.primitive_width().is_some() => (2, 1),
        _ => return None,
    })
}

/// Where a served column's values are in every batch (indices into its nodes and buffers).
#[derive(Debug, Clone)]
enum Direct {
    /// An image: the struct's node and validity, the `bytes` child's node, validity, offsets
    /// (4 or 8 bytes each) and data.
    Image {
        node: usize,
        validity: usize,
        bytes_node: usize,
        bytes_validity: usize,
        offsets: usize,
        data: usize,
        wide: bool,
    },
    /// A scalar of `size` bytes (a bool: one bit).
    Scalar {
        node: usize,
        validity: usize,
        values: usize,
        size: usize,
        boolean: bool,
    },
}

/// The direct layout of `columns`, when every one is an image or a plain scalar, there is an
/// image among them, and every batch is uncompressed with the buffers the schema implies.
fn direct_layout(
    schema: &arrow_schema::Schema,
    columns: &[Column],
    batches: &[Batch],
) -> Option<Vec<Direct>> {
    if !columns.iter().any(|c| matches!(c.kind, Kind::Image)) {
        return None;
    }
    // Each top-level field's first buffer and node.
    let mut starts = vec![];
    let (mut b, mut n) = (0, 0);
    for f in schema.fields() {
        starts.push((b, n));
        let (x, y) = layout_of(f.data_type())?;
        b += x;
        n += y;
    }
    if batches
        .iter()
        .any(|batch| batch.compressed || batch.buffers.len() != b || batch.nodes.len() != n)
    {
        return None;
    }
    columns
        .iter()
        .map(|c| {
            let (b, n) = starts[c.index];
            let t = schema.field(c.index).data_type();
            match (&c.kind, t) {
                (Kind::Image, DataType::Struct(fs)) => {
                    // The `bytes` child's place among the struct's children.
                    let (mut cb, mut cn) = (b + 1, n + 1);
                    for f in fs.iter() {
                        if f.name() == "bytes" {
                            return Some(Direct::Image {
                                node: n,
                                validity: b,
                                bytes_node: cn,
                                bytes_validity: cb,
                                offsets: cb + 1,
                                data: cb + 2,
                                wide: matches!(f.data_type(), DataType::LargeBinary),
                            });
                        }
                        let (x, y) = layout_of(f.data_type())?;
                        cb += x;
                        cn += y;
                    }
                    None
                }
                (Kind::Numbers { dtype, dims }, t) if dims.is_empty() => Some(Direct::Scalar {
                    node: n,
                    validity: b,
                    values: b + 1,
                    size: dtype.size(),
                    boolean: matches!(t, DataType::Boolean),
                }),
                _ => None,
            }
        })
        .collect()
}

impl Direct {
    /// Row `row` of batch `b` of `file`, read alone.
    fn read(&self, file: &Blob, b: &Batch, row: u64, max: u64) -> Result<Value> {
        // The bytes `at..at + len` of buffer `k`, checked against it.
        let read = |k: usize, at: u64, len: u64| -> Result<Vec<u8>> {
            let (offset, size) = *b.buffers.get(k).context("no such buffer")?;
            ensure!(
                at.checked_add(len).is_some_and(|e| e <= size)
                    && offset.checked_add(size).is_some_and(|e| e <= b.body_len),
                "bytes {at}..+{len} of a {size}-byte buffer"
            );
            let mut buf = vec![0u8; usize::try_from(len)?];
            file.read_exact_at(&mut buf, b.body_at + offset + at)?;
            Ok(buf)
        };
        // Whether the value is there: no nulls in the array, or its validity bit set.
        let valid = |node: usize, validity: usize| -> Result<bool> {
            let (_, nulls) = *b.nodes.get(node).context("no such node")?;
            if nulls == 0 || b.buffers.get(validity).is_some_and(|v| v.1 == 0) {
                return Ok(true);
            }
            Ok(read(validity, row / 8, 1)?[0] >> (row % 8) & 1 == 1)
        };
        match *self {
            Direct::Image {
                node,
                validity,
                bytes_node,
                bytes_validity,
                offsets,
                data,
                wide,
            } => {
                ensure!(valid(node, validity)?, "the value is missing (null)");
                ensure!(
                    valid(bytes_node, bytes_validity)?,
                    "the image is stored as a path only, not its bytes"
                );
                let w = if wide { 8 } else { 4 };
                let o = read(offsets, row * w, 2 * w)?;
                let (from, to) = if wide {
                    (
                        u64::from_le_bytes(o[..8].try_into()?),
                        u64::from_le_bytes(o[8..].try_into()?),
                    )
                } else {
                    (
                        u32::from_le_bytes(o[..4].try_into()?) as u64,
                        u32::from_le_bytes(o[4..].try_into()?) as u64,
                    )
                };
                ensure!(from <= to, "image offsets out of order");
                ensure!(
                    to - from <= max,
                    "an image of {} bytes, over the {max} a sample may (limits.max_sample_bytes)",
                    to - from
                );
                Ok(Value::new(vec![], read(data, from, to - from)?))
            }
            Direct::Scalar {
                node,
                validity,
                values,
                size,
                boolean,
            } => {
                ensure!(valid(node, validity)?, "the value is missing (null)");
                if boolean {
                    let byte = read(values, row / 8, 1)?[0];
                    return Ok(Value::new(vec![], vec![byte >> (row % 8) & 1]));
                }
                Ok(Value::new(
                    vec![],
                    read(values, row * size as u64, size as u64)?,
                ))
            }
        }
    }
}

/// Row `row` of `array`, as larder serves the column's kind.
pub(super) fn value_of(array: &ArrayRef, row: usize, kind: &Kind) -> Result<Value> {
    ensure!(!array.is_null(row), "the value is missing (null)");
    match kind {
        Kind::Image => {
            let s = array.as_struct();
            let bytes = s.column_by_name("bytes").context("no bytes")?;
            ensure!(
                !bytes.is_null(row),
                "the image is stored as a path only, not its bytes"
            );
            let data = match bytes.data_type() {
                DataType::Binary => bytes.as_binary::<i32>().value(row).to_vec(),
                _ => bytes.as_binary::<i64>().value(row).to_vec(),
            };
            Ok(Value::new(vec![], data))
        }
        Kind::Numbers { dtype, .. } => {
            let mut dims = vec![];
            let leaf = flatten(array.slice(row, 1), &mut dims)?;
            let data = leaf_bytes(&leaf, *dtype)?;
            Ok(Value::new(dims, data))
        }
    }
}

/// The numbers under `a` (one row, or the rows of a level below), with each list level's
/// length pushed to `dims` (every list of a level the same length).
fn flatten(a: ArrayRef, dims: &mut Vec<u32>) -> Result<ArrayRef> {
    ensure!(a.null_count() == 0, "a value is missing (null)");
    let (offsets, values): (Vec<usize>, ArrayRef) = match a.data_type() {
        DataType::List(_) => {
            let l = a.as_list::<i32>();
            (
                l.offsets().iter().map(|&o| o as usize).collect(),
                l.values().clone(),
            )
        }
        DataType::LargeList(_) => {
            let l = a.as_list::<i64>();
            (
                l.offsets().iter().map(|&o| o as usize).collect(),
                l.values().clone(),
            )
        }
        DataType::FixedSizeList(_, n) => {
            let l = a.as_fixed_size_list();
            let n = *n as usize;
            let start = l.offset();
            (
                (0..=l.len()).map(|i| (start + i) * n).collect(),
                l.values().clone(),
            )
        }
        _ => return Ok(a),
    };
    let lens: Vec<usize> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
    let first = lens.first().copied().unwrap_or(0);
    ensure!(
        lens.iter().all(|&l| l == first),
        "rows of a list differ in length ({} and {first}): not an array",
        lens.iter().find(|&&l| l != first).unwrap_or(&0)
    );
    dims.push(u32::try_from(first)?);
    let (lo, hi) = (offsets[0], *offsets.last().unwrap_or(&0));
    ensure!(hi <= values.len() && lo <= hi, "list offsets out of range");
    flatten(values.slice(lo, hi - lo), dims)
}

/// The bytes of a leaf array of numbers, as `dtype` (bools as 0/1).
fn leaf_bytes(a: &ArrayRef, dtype: DType) -> Result<Vec<u8>> {
    ensure!(a.null_count() == 0, "a value is missing (null)");
    if let DataType::Boolean = a.data_type() {
        let b = a.as_boolean();
        return Ok((0..b.len()).map(|i| b.value(i) as u8).collect());
    }
    let data = a.to_data();
    let size = dtype.size();
    ensure!(
        data.data_type().primitive_width() == Some(size),
        "a {} column read as {dtype:?}",
        data.data_type()
    );
    let buf = data.buffers().first().context("no values")?;
    let (from, n) = (data.offset() * size, data.len() * size);
    Ok(buf
        .as_slice()
        .get(from..from + n)
        .context("values out of range")?
        .to_vec())
}

impl RawSource for HfSource {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_range(&self, start: u64, count: u64) -> Result<Vec<RawSample>> {
        let end = super::range_end(start, count, self.len)?;
        let mut out = Vec::with_capacity(count as usize);
        if let Some(direct) = &self.direct {
            for i in start..end {
                let k = self.batches.partition_point(|b| b.first_row + b.rows <= i);
                let b = &self.batches[k];
                let file = &self.files[b.file];
                let sample = direct
                    .iter()
                    .zip(&self.columns)
                    .map(|(d, c)| {
                        d.read(file, b, i - b.first_row, self.max_value_bytes)
                            .with_context(|| format!("column {:?} of row {i}", c.field))
                    })
                    .collect::<Result<RawSample>>()
                    .map_err(|e| self.changed().map_or(e, super::changed_error))?;
                out.push(sample);
            }
            if let Some(why) = self.changed() {
                return Err(super::changed_error(why));
            }
            return Ok(out);
        }
        let first = self
            .batches
            .partition_point(|b| b.first_row + b.rows <= start);
        for b in &self.batches[first..] {
            if b.first_row >= end {
                break;
            }
            let decoded = self
                .batch(b)
                .map_err(|e| self.changed().map_or(e, super::changed_error))
                .with_context(|| format!("reading {}", self.files[b.file].path().display()))?;
            let (lo, hi) = (start.max(b.first_row), end.min(b.first_row + b.rows));
            for i in lo..hi {
                let row = (i - b.first_row) as usize;
                let sample = self
                    .columns
                    .iter()
                    .enumerate()
                    .map(|(k, c)| {
                        value_of(decoded.column(k), row, &c.kind)
                            .with_context(|| format!("column {:?} of row {i}", c.field))
                    })
                    .collect::<Result<RawSample>>()?;
                out.push(sample);
            }
        }
        if let Some(why) = self.changed() {
            return Err(super::changed_error(why));
        }
        Ok(out)
    }

    fn read_granule(&self) -> u64 {
        self.granule
    }

    fn disk_bytes(&self) -> u64 {
        self.batches.iter().map(|b| b.body_len).sum()
    }

    fn disk_bytes_each(&self) -> Option<u64> {
        None
    }

    fn disk_bytes_of(&self, index: u64) -> u64 {
        let k = self
            .batches
            .partition_point(|b| b.first_row + b.rows <= index);
        self.batches
            .get(k)
            .map_or(0, |b| b.body_len / b.rows.max(1))
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.columns.iter().map(|c| c.field.as_str()).collect();
        let mut d = format!("hf:{}#{}", self.path.display(), names.join(","));
        if self.direct.is_some() {
            d.push_str(" (a row at a time)");
        }
        if !self.skipped.is_empty() {
            let left: Vec<String> = self
                .skipped
                .iter()
                .map(|(c, why)| format!("{c} ({why})"))
                .collect();
            d.push_str(&format!(" (left out: {})", left.join(", ")));
        }
        d
    }
}

impl Provenance for HfSource {
    fn version(&self) -> String {
        let v: Vec<String> = self.files.iter().map(Blob::version).collect();
        v.join("|")
    }

    fn changed(&self) -> Option<String> {
        self.files.iter().find_map(Blob::changed)
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
    use crate::config::{DatasetConfig, Limits};
    use arrow_array::{ArrayRef, Float32Array, Int64Array, ListArray, RecordBatch};
    use arrow_buffer::OffsetBuffer;
    use arrow_schema::{DataType, Field, Schema};
    use std::sync::Arc;

    /// An Arrow IPC stream of `rows` rows (a list of floats of 1 to 3 values, an int64 label),
    /// in record batches of 7, as `datasets` writes its data files.
    fn stream(rows: usize) -> Vec<u8> {
        let item = Arc::new(Field::new("item", DataType::Float32, true));
        let schema = Arc::new(Schema::new(vec![
            Field::new("x", DataType::List(item.clone()), false),
            Field::new("label", DataType::Int64, false),
        ]));
        let mut out = vec![];
        let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut out, &schema).unwrap();
        for start in (0..rows).step_by(7) {
            let n = 7.min(rows - start);
            let lens: Vec<usize> = (start..start + n).map(|i| 1 + i % 3).collect();
            let values: Vec<f32> = (0..lens.iter().sum::<usize>()).map(|v| v as f32).collect();
            let x = ListArray::new(
                item.clone(),
                OffsetBuffer::from_lengths(lens),
                Arc::new(Float32Array::from(values)),
                None,
            );
            let label = Int64Array::from_iter_values((start..start + n).map(|i| i as i64));
            let columns: Vec<ArrayRef> = vec![Arc::new(x), Arc::new(label)];
            w.write(&RecordBatch::try_new(schema.clone(), columns).unwrap())
                .unwrap();
        }
        w.finish().unwrap();
        drop(w);
        out
    }

    /// Opens a `save_to_disk` folder whose data file is `data` and reads every row: the rows,
    /// or the first error.
    fn read_all(data: &[u8]) -> anyhow::Result<u64> {
        let dir = tempfile::tempdir()?;
        std::fs::write(
            dir.path().join("state.json"),
            r#"{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}"#,
        )?;
        std::fs::write(dir.path().join("data-00000-of-00001.arrow"), data)?;
        let table: toml::Table = toml::from_str(&format!(
            "name = \"t\"\nkind = \"hf\"\npath = {:?}\n",
            dir.path()
        ))?;
        let opened = crate::source::open(&DatasetConfig::from_table(table)?, &Limits::default())?;
        let n = opened.source.len();
        for start in (0..n).step_by(5) {
            opened.source.read_range(start, 5.min(n - start))?;
        }
        Ok(n)
    }

    #[test]
    fn the_seed_stream_reads_whole() {
        assert_eq!(read_all(&stream(30)).unwrap(), 30);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]
        /// A data file's bytes changed anywhere or cut: its rows, or an error; never a panic
        /// or a read past its end.
        #[test]
        fn altered_data_files_read_or_fail(
            edits in proptest::collection::vec((0usize..8192, proptest::prelude::any::<u8>()), 1..8),
            cut in 0usize..8192,
        ) {
            let mut b = stream(30);
            for (at, v) in edits {
                let at = at % b.len();
                b[at] = v;
            }
            if cut < b.len() && cut % 2 == 0 {
                b.truncate(cut);
            }
            let _ = read_all(&b);
        }
    }
}
