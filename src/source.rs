//! Raw storage: where samples come from before preprocessing.

use anyhow::{bail, ensure, Context, Result};
use hdf5::types::{IntSize, TypeDescriptor};
use hdf5::{Hyperslab, SliceOrIndex};
use std::path::{Path, PathBuf};

/// A dataset of raw samples on long-term storage, read one sample or one range at a time.
pub trait RawSource: Send + Sync {
    /// Number of samples.
    fn len(&self) -> u64;
    /// Shape of one raw sample.
    fn sample_shape(&self) -> &[u32];
    /// Labels of all samples, if the dataset has them.
    fn labels(&self) -> Option<&[i64]>;
    /// Raw bytes of samples `start..start + count`, concatenated.
    fn read(&self, start: u64, count: u64) -> Result<Vec<u8>>;
    /// Bytes the raw data takes on disk (for capacity planning).
    fn disk_bytes(&self) -> u64;
    /// Human-readable description, e.g. "hdf5:/data/x.h5#images".
    fn describe(&self) -> String;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A uint8 HDF5 dataset shaped [N, ...] with an optional integer label dataset shaped [N].
pub struct Hdf5Source {
    path: PathBuf,
    name: String,
    dataset: hdf5::Dataset,
    len: u64,
    shape: Vec<u32>,
    labels: Option<Vec<i64>>,
    disk_bytes: u64,
}

impl Hdf5Source {
    pub fn open(path: &Path, samples: &str, labels: Option<&str>) -> Result<Hdf5Source> {
        let file = hdf5::File::open(path)
            .with_context(|| format!("opening HDF5 file {}", path.display()))?;
        let dataset = file
            .dataset(samples)
            .with_context(|| format!("opening dataset {samples:?} in {}", path.display()))?;
        let dtype = dataset
            .dtype()
            .and_then(|t| t.to_descriptor())
            .with_context(|| format!("reading the type of {samples:?}"))?;
        if dtype != TypeDescriptor::Unsigned(IntSize::U1) {
            bail!(
                "dataset {samples:?} in {} holds {dtype:?}; larder serves uint8 samples \
                 (convert on the client's GPU instead)",
                path.display()
            );
        }
        let full_shape = dataset.shape();
        ensure!(
            full_shape.len() >= 2,
            "dataset {samples:?} has shape {full_shape:?}; expected [N, ...] with at least one sample dimension"
        );
        let len = full_shape[0] as u64;
        let shape = full_shape[1..]
            .iter()
            .map(|&d| u32::try_from(d).context("sample dimension too large"))
            .collect::<Result<Vec<_>>>()?;
        let labels = match labels {
            None => None,
            Some(name) => {
                let ds = file
                    .dataset(name)
                    .with_context(|| format!("opening label dataset {name:?}"))?;
                let labels = ds
                    .read_raw::<i64>()
                    .with_context(|| format!("reading label dataset {name:?} as integers"))?;
                ensure!(
                    labels.len() as u64 == len,
                    "label dataset {name:?} has {} entries but {samples:?} has {len} samples",
                    labels.len()
                );
                Some(labels)
            }
        };
        let disk_bytes = dataset.storage_size();
        Ok(Hdf5Source {
            path: path.to_path_buf(),
            name: samples.to_string(),
            dataset,
            len,
            shape,
            labels,
            disk_bytes,
        })
    }
}

impl RawSource for Hdf5Source {
    fn len(&self) -> u64 {
        self.len
    }

    fn sample_shape(&self) -> &[u32] {
        &self.shape
    }

    fn labels(&self) -> Option<&[i64]> {
        self.labels.as_deref()
    }

    fn read(&self, start: u64, count: u64) -> Result<Vec<u8>> {
        ensure!(
            start.checked_add(count).is_some_and(|end| end <= self.len),
            "samples {start}..{} are out of range (dataset has {})",
            start.saturating_add(count),
            self.len
        );
        let (start, end) = (start as usize, (start + count) as usize);
        let mut sel = vec![SliceOrIndex::from(start..end)];
        sel.extend(self.shape.iter().map(|_| SliceOrIndex::from(..)));
        let array = self
            .dataset
            .read_slice::<u8, _, ndarray::IxDyn>(Hyperslab::from(sel))
            .with_context(|| {
                format!(
                    "reading samples {start}..{end} of {}#{}",
                    self.path.display(),
                    self.name
                )
            })?;
        let (data, _) = array.into_raw_vec_and_offset();
        Ok(data)
    }

    fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    fn describe(&self) -> String {
        format!("hdf5:{}#{}", self.path.display(), self.name)
    }
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

    #[test]
    fn reads_ranges_and_labels_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.h5");
        let data: Vec<u8> = (0..5 * 2 * 3).map(|i| i as u8).collect();
        let labels: Vec<i64> = vec![10, 11, 12, 13, 14];
        write_hdf5(&path, "x", &[5, 2, 3], &data, Some(("y", &labels))).unwrap();
        let src = Hdf5Source::open(&path, "x", Some("y")).unwrap();
        assert_eq!(src.len(), 5);
        assert_eq!(src.sample_shape(), &[2, 3]);
        assert_eq!(src.labels().unwrap(), &labels[..]);
        assert_eq!(src.read(1, 2).unwrap(), data[6..18].to_vec());
        assert!(src.read(4, 2).is_err());
        assert!(src.disk_bytes() >= 30);
    }

    #[test]
    fn rejects_non_uint8_and_bad_labels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.h5");
        let file = hdf5::File::create(&path).unwrap();
        let floats = ndarray::Array2::<f32>::zeros((4, 3));
        file.new_dataset_builder()
            .with_data(&floats)
            .create("f")
            .unwrap();
        let bytes = ndarray::Array2::<u8>::zeros((4, 3));
        file.new_dataset_builder()
            .with_data(&bytes)
            .create("b")
            .unwrap();
        file.new_dataset_builder()
            .with_data(&[1i32, 2, 3])
            .create("short")
            .unwrap();
        drop(file);
        let err = format!("{:#}", Hdf5Source::open(&path, "f", None).err().unwrap());
        assert!(err.contains("uint8"), "{err}");
        let err = format!(
            "{:#}",
            Hdf5Source::open(&path, "b", Some("short")).err().unwrap()
        );
        assert!(err.contains("3 entries"), "{err}");
        let err = format!("{:#}", Hdf5Source::open(&path, "nope", None).err().unwrap());
        assert!(err.contains("nope"), "{err}");
    }
}
