//! Parquet files (`kind = "parquet"`): a folder (every `.parquet` file beneath it), one file, or
//! a glob of files (`data/train-*.parquet`), in sorted order, as the Hugging Face hub lays a
//! split out. Columns follow the rules of `kind = "hf"` (the `huggingface` schema metadata's
//! shapes honoured): images through the image pipeline, numbers and lists of numbers as typed
//! arrays, the rest left out and listed.
//!
//! The footers are read once at open (with the page index, where the writer left one). A miss
//! reads the rows asked for of one row group, decoding only the columns served; images are read
//! a row at a time (with a page index only the pages holding that row), other data a row group
//! (at most `MAX_GRANULE` rows of it) at a time.

use super::hf::{columns_of, opened, value_of, Column, Kind};
use super::{Blob, Format, Opened, Provenance, RawSample, RawSource};
use crate::config::keys::keys_of;
use crate::config::{DatasetConfig, Limits, TrainCrop};
use anyhow::{ensure, Context, Result};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelector,
};
use parquet::arrow::ProjectionMask;
use parquet::file::metadata::PageIndexPolicy;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Parquet files (`kind = "parquet"`).
pub struct Parquet;

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetKeys {}

impl Format for Parquet {
    fn name(&self) -> &'static str {
        "parquet"
    }

    fn reads_objects(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    fn recognizes(&self, path: &Path) -> bool {
        path.is_file()
            && path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
    }

    fn dataset_keys(&self) -> Vec<&'static str> {
        keys_of::<DatasetKeys>()
    }

    fn field_keys(&self) -> Vec<&'static str> {
        keys_of::<super::hf::FieldKeys>()
    }

    fn check(&self, c: &DatasetConfig) -> Result<()> {
        super::check_unpaired::<DatasetKeys, super::hf::FieldKeys>(self, c)
    }

    fn default_crop(&self) -> Option<u32> {
        None
    }

    fn default_train_crop(&self) -> TrainCrop {
        TrainCrop::RandomResized
    }

    fn open(&self, c: &DatasetConfig, limits: &Limits) -> Result<Opened> {
        let wanted = super::hf::wanted_columns(self, c)?;
        let mut source = ParquetSource::open(&c.path, &wanted)?;
        source.max_value_bytes = limits.max_sample_bytes;
        let columns = source.columns.clone();
        opened(c, &columns, Box::new(source), &Parquet)
    }
}

/// Whether `name` matches `pattern`, whose `*` stands for any run of characters.
fn matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else {
                return false;
            };
            (0..=tail.len()).any(|k| tail.is_char_boundary(k) && matches(rest, &tail[k..]))
        }
    }
}

/// The `.parquet` files at `path` (a file, a folder walked whole, or a glob in the last part of
/// the path; or the same of objects), opened and sorted.
fn parquet_files(path: &Path) -> Result<Vec<Blob>> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let is_parquet = |p: &Path| {
        p.extension()
            .is_some_and(|x| x.eq_ignore_ascii_case("parquet"))
    };
    let mut files = vec![];
    if crate::objects::is_url(path) {
        let (at, glob) = match name.contains('*') {
            true => (path.parent().unwrap_or(path), Some(name.as_ref())),
            false => (path, None),
        };
        for blob in Blob::list(at)? {
            let wanted = match glob {
                Some(g) => matches(g, &blob.name()) && blob.path().parent() == Some(at),
                None => is_parquet(&blob.path()) || blob.path() == path,
            };
            if wanted {
                files.push(blob);
            }
        }
    } else if name.contains('*') {
        let dir = path.parent().unwrap_or(Path::new("."));
        for e in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
            let p = e?.path();
            if p.is_file() && matches(&name, &p.file_name().unwrap_or_default().to_string_lossy()) {
                files.push(Blob::open(&p)?);
            }
        }
    } else if path.is_dir() {
        let mut dirs = vec![path.to_path_buf()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
                let e = e?;
                let p = e.path();
                if e.file_type()?.is_dir() {
                    dirs.push(p);
                } else if is_parquet(&p) {
                    files.push(Blob::open(&p)?);
                }
            }
            ensure!(files.len() <= 1 << 20, "over a million files");
        }
    } else {
        files.push(Blob::open(path)?);
    }
    files.sort_by_key(Blob::path);
    ensure!(!files.is_empty(), "{}: no .parquet files", path.display());
    Ok(files)
}

/// A file read by position (`pread`, or a ranged GET), so that readers on several threads
/// share no offset (a cloned descriptor shares its file position: two threads seeking it
/// would read each other's bytes).
#[derive(Clone)]
struct At(Arc<Blob>);

/// A reader of `At` from a position on.
struct AtFrom(Arc<Blob>, u64);

impl std::io::Read for AtFrom {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.0.read_at(buf, self.1)?;
        self.1 += n as u64;
        Ok(n)
    }
}

impl parquet::file::reader::Length for At {
    fn len(&self) -> u64 {
        self.0.size()
    }
}

impl parquet::file::reader::ChunkReader for At {
    type T = std::io::BufReader<AtFrom>;

    /// Buffered: the page headers are decoded a few bytes a read, each a GET of an object.
    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        Ok(std::io::BufReader::with_capacity(
            64 << 10,
            AtFrom(self.0.clone(), start),
        ))
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<bytes::Bytes> {
        let mut buf = vec![0u8; length];
        self.0
            .read_exact_at(&mut buf, start)
            .map_err(|e| parquet::errors::ParquetError::External(Box::new(e)))?;
        Ok(buf.into())
    }
}

/// A row group: its file, its index there, and its rows.
struct Group {
    file: usize,
    index: usize,
    first_row: u64,
    rows: u64,
    bytes: u64,
}

struct File {
    path: PathBuf,
    file: At,
    meta: ArrowReaderMetadata,
}

pub struct ParquetSource {
    path: PathBuf,
    /// The file or folder it is: a glob's folder.
    root: PathBuf,
    files: Vec<File>,
    columns: Vec<Column>,
    groups: Vec<Group>,
    len: u64,
    granule: u64,
    access: Arc<[PathBuf]>,
    skipped: Vec<(String, String)>,
    max_value_bytes: u64,
}

impl ParquetSource {
    fn open(path: &Path, wanted: &[(crate::config::FieldConfig, String)]) -> Result<ParquetSource> {
        let blobs = parquet_files(path)?;
        let paths: Vec<PathBuf> = blobs.iter().map(Blob::path).collect();
        let mut files = vec![];
        let mut groups = vec![];
        let mut len = 0u64;
        for (k, (p, blob)) in paths.iter().zip(blobs).enumerate() {
            let file = At(Arc::new(blob));
            let meta = ArrowReaderMetadata::load(
                &file,
                ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional),
            )
            .with_context(|| format!("reading the footer of {}", p.display()))?;
            if let Some(first) = files.first() {
                let first: &File = first;
                ensure!(
                    first.meta.schema().fields() == meta.schema().fields(),
                    "{} has other columns than {}",
                    p.display(),
                    first.path.display()
                );
            }
            for (index, rg) in meta.metadata().row_groups().iter().enumerate() {
                let rows = u64::try_from(rg.num_rows()).context("a negative row count")?;
                if rows > 0 {
                    groups.push(Group {
                        file: k,
                        index,
                        first_row: len,
                        rows,
                        bytes: u64::try_from(rg.compressed_size()).unwrap_or(0),
                    });
                    len += rows;
                }
            }
            files.push(File {
                path: p.clone(),
                file,
                meta,
            });
        }
        let schema = files[0].meta.schema().clone();
        let (columns, skipped) = columns_of(path, &schema, wanted)?;
        let images = columns.iter().any(|c| matches!(c.kind, Kind::Image));
        let most = groups.iter().map(|g| g.rows).max().unwrap_or(1);
        let granule = if images {
            1
        } else {
            (1..=most.min(super::MAX_GRANULE))
                .rev()
                .find(|g| most % g == 0)
                .unwrap_or(1)
        };
        let root = if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().contains('*'))
        {
            path.parent().unwrap_or(Path::new(".")).to_path_buf()
        } else {
            path.to_path_buf()
        };
        let mut access = vec![root.clone()];
        if !crate::objects::is_url(path) {
            access.extend(paths.iter().cloned());
        }
        access.dedup();
        Ok(ParquetSource {
            path: path.to_path_buf(),
            root,
            files,
            columns,
            groups,
            len,
            granule,
            access: access.into(),
            skipped,
            max_value_bytes: u64::MAX,
        })
    }

    /// Rows `lo..hi` (within the group) of group `g`, the served columns only.
    fn rows(&self, g: &Group, lo: u64, hi: u64) -> Result<Vec<arrow_array::RecordBatch>> {
        let f = &self.files[g.file];
        let mask = ProjectionMask::roots(
            f.meta.metadata().file_metadata().schema_descr(),
            self.columns.iter().map(|c| c.index),
        );
        let selection = RowSelection::from(vec![
            RowSelector::skip(lo as usize),
            RowSelector::select((hi - lo) as usize),
        ]);
        let reader =
            ParquetRecordBatchReaderBuilder::new_with_metadata(f.file.clone(), f.meta.clone())
                .with_row_groups(vec![g.index])
                .with_projection(mask)
                .with_row_selection(selection)
                .with_batch_size((hi - lo) as usize)
                .build()?;
        Ok(reader.collect::<Result<Vec<_>, _>>()?)
    }
}

impl RawSource for ParquetSource {
    fn len(&self) -> u64 {
        self.len
    }

    fn read_range(&self, start: u64, count: u64) -> Result<Vec<RawSample>> {
        let end = super::range_end(start, count, self.len)?;
        let mut out = Vec::with_capacity(count as usize);
        let first = self
            .groups
            .partition_point(|g| g.first_row + g.rows <= start);
        for g in &self.groups[first..] {
            if g.first_row >= end {
                break;
            }
            let (lo, hi) = (start.max(g.first_row), end.min(g.first_row + g.rows));
            let file = &self.files[g.file].file.0;
            let batches = self
                .rows(g, lo - g.first_row, hi - g.first_row)
                .map_err(|e| match file.unavailable() {
                    // The parquet reader keeps only an error's text: the store's failure,
                    // noted by the file, is no sample's fault.
                    Some(why) => crate::error::Error::new(crate::error::Kind::Reader, why).into(),
                    None => self.changed().map_or(e, super::changed_error),
                })
                .with_context(|| format!("reading {}", self.files[g.file].path.display()))?;
            let mut i = lo;
            for b in &batches {
                for row in 0..b.num_rows() {
                    let sample = self
                        .columns
                        .iter()
                        .enumerate()
                        .map(|(k, c)| {
                            let v = value_of(b.column(k), row, &c.kind)
                                .with_context(|| format!("column {:?} of row {i}", c.field))?;
                            ensure!(
                                v.data.len() as u64 <= self.max_value_bytes,
                                "column {:?} of row {i}: {} bytes, over the {} a sample may",
                                c.field,
                                v.data.len(),
                                self.max_value_bytes
                            );
                            Ok(v)
                        })
                        .collect::<Result<RawSample>>()?;
                    out.push(sample);
                    i += 1;
                }
            }
            ensure!(
                i == hi,
                "row group {} gave {} rows for {}",
                g.index,
                i - lo,
                hi - lo
            );
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
        self.groups.iter().map(|g| g.bytes).sum()
    }

    fn disk_bytes_each(&self) -> Option<u64> {
        None
    }

    fn disk_bytes_of(&self, index: u64) -> u64 {
        let k = self
            .groups
            .partition_point(|g| g.first_row + g.rows <= index);
        self.groups.get(k).map_or(0, |g| g.bytes / g.rows.max(1))
    }

    fn describe(&self) -> String {
        let names: Vec<&str> = self.columns.iter().map(|c| c.field.as_str()).collect();
        let mut d = format!("parquet:{}#{}", self.path.display(), names.join(","));
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

impl Provenance for ParquetSource {
    fn version(&self) -> String {
        let v: Vec<String> = self.files.iter().map(|f| f.file.0.version()).collect();
        v.join("|")
    }

    fn changed(&self) -> Option<String> {
        self.files.iter().find_map(|f| f.file.0.changed())
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

    #[test]
    fn globs_match_as_a_shell_would_in_one_folder() {
        assert!(matches("train-*.parquet", "train-00000-of-00002.parquet"));
        assert!(!matches("train-*.parquet", "test-00000-of-00002.parquet"));
        assert!(matches("*", "x"));
        assert!(matches("a*b*c", "aXXbYc"));
        assert!(!matches("a*b*c", "aXXbY"));
    }
}
