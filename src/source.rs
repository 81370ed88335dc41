//! Raw storage: where samples come from before preprocessing.

use anyhow::{bail, ensure, Context, Result};
use hdf5::types::{IntSize, TypeDescriptor};
use hdf5::{Hyperslab, SliceOrIndex};
use std::path::{Path, PathBuf};

/// A dataset of raw samples on long-term storage.
pub trait RawSource: Send + Sync {
    /// Number of samples.
    fn len(&self) -> u64;
    /// Shape of one raw sample when every sample has the same uint8 shape (HDF5), else None.
    fn sample_shape(&self) -> Option<&[u32]>;
    /// Labels of all samples, if the dataset has them.
    fn labels(&self) -> Option<&[i64]>;
    /// Raw bytes of sample `index` (a uint8 array, or an encoded image file).
    fn read(&self, index: u64) -> Result<Vec<u8>>;
    /// Raw bytes of samples `start..start + count`, one Vec each; sources that can read a
    /// range at once faster than one by one override this.
    fn read_range(&self, start: u64, count: u64) -> Result<Vec<Vec<u8>>> {
        (start..start + count).map(|i| self.read(i)).collect()
    }
    /// Samples that are read about as cheaply together, as an aligned range, as one alone: on
    /// a miss the store reads the whole range and fills the scratch tier with it, so a shuffled
    /// cold epoch reads raw storage in ranges rather than sample by sample.
    fn read_granule(&self) -> u64 {
        1
    }
    /// Bytes the raw data takes on disk (for capacity planning).
    fn disk_bytes(&self) -> u64;
    /// Bytes sample `index` takes on disk (for the measured expansion factor).
    fn disk_bytes_of(&self, _index: u64) -> u64 {
        self.disk_bytes() / self.len().max(1)
    }
    /// Human-readable description, e.g. "hdf5:/data/x.h5#images".
    fn describe(&self) -> String;
    /// Changes whenever the raw data may have changed (path, size, modification time), so the
    /// scratch tier can tell its shards are out of date.
    fn version(&self) -> String;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Path, size and modification time of a file, as a version string.
fn file_version(path: &Path) -> String {
    let meta = std::fs::metadata(path).ok();
    let len = meta.as_ref().map_or(0, |m| m.len());
    let mtime = meta
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!("{}:{len}:{mtime}", path.display())
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
    /// Bytes of one sample.
    sample_bytes: usize,
    granule: u64,
}

/// Bytes of a contiguous HDF5 dataset read together on a miss.
const CONTIGUOUS_GRANULE_BYTES: u64 = 1 << 20;
/// Most samples read together on a miss.
pub const MAX_GRANULE: u64 = 256;

impl Hdf5Source {
    pub fn open(path: &Path, samples: &str, labels: Option<&str>) -> Result<Hdf5Source> {
        // larderd only reads, and takes no HDF5 file lock: on long-term storage without flock
        // (many NFS and Lustre mounts) the lock fails every open, and one held by any process
        // that has the file open (or inherited its descriptor) would keep the dataset from
        // being served. A rewritten file changes size or mtime, which the scratch tier notices.
        let file = hdf5::File::with_options()
            .with_fapl(|p| p.file_locking(false))
            .open(path)
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
        // Reading one sample of a chunked dataset reads (and decompresses) its whole chunk.
        let sample_bytes = shape.iter().map(|&d| d as usize).product::<usize>().max(1);
        let granule = match dataset.chunk() {
            Some(chunk) => chunk[0] as u64,
            None => CONTIGUOUS_GRANULE_BYTES / sample_bytes as u64,
        }
        .clamp(1, MAX_GRANULE);
        Ok(Hdf5Source {
            path: path.to_path_buf(),
            name: samples.to_string(),
            dataset,
            len,
            shape,
            labels,
            disk_bytes,
            sample_bytes,
            granule,
        })
    }
}

impl RawSource for Hdf5Source {
    fn len(&self) -> u64 {
        self.len
    }

    fn sample_shape(&self) -> Option<&[u32]> {
        Some(&self.shape)
    }

    fn labels(&self) -> Option<&[i64]> {
        self.labels.as_deref()
    }

    fn read(&self, index: u64) -> Result<Vec<u8>> {
        self.read_block(index, 1)
    }

    fn read_range(&self, start: u64, count: u64) -> Result<Vec<Vec<u8>>> {
        let block = self.read_block(start, count)?;
        Ok(block
            .chunks(self.sample_bytes)
            .map(<[u8]>::to_vec)
            .collect())
    }

    fn read_granule(&self) -> u64 {
        self.granule
    }

    fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    fn describe(&self) -> String {
        format!("hdf5:{}#{}", self.path.display(), self.name)
    }

    fn version(&self) -> String {
        format!("{}#{}", file_version(&self.path), self.name)
    }
}

impl Hdf5Source {
    /// Samples `start..start + count`, concatenated, in one hyperslab read.
    fn read_block(&self, start: u64, count: u64) -> Result<Vec<u8>> {
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
}

/// File extensions read as images.
const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// A folder with one subfolder per class holding JPEG/PNG files: the label of an image is the
/// index of its class among the sorted class names; samples are ordered by class, then file name.
pub struct ImageFolderSource {
    root: PathBuf,
    files: Vec<PathBuf>,
    sizes: Vec<u64>,
    labels: Vec<i64>,
    pub classes: Vec<String>,
    disk_bytes: u64,
    version: String,
}

impl ImageFolderSource {
    pub fn open(root: &Path) -> Result<ImageFolderSource> {
        let entries = std::fs::read_dir(root)
            .with_context(|| format!("reading image folder {}", root.display()))?;
        let mut class_dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_dir())
            .collect();
        class_dirs.sort();
        ensure!(
            !class_dirs.is_empty(),
            "image folder {} has no class subfolders",
            root.display()
        );
        let (mut files, mut sizes, mut labels, mut classes) = (vec![], vec![], vec![], vec![]);
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        for (label, dir) in class_dirs.iter().enumerate() {
            classes.push(
                dir.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned(),
            );
            let mut images: Vec<PathBuf> = std::fs::read_dir(dir)
                .with_context(|| format!("reading class folder {}", dir.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.extension().is_some_and(|e| {
                        IMAGE_EXTENSIONS.contains(&e.to_string_lossy().to_lowercase().as_str())
                    })
                })
                .collect();
            images.sort();
            for path in images {
                let version = file_version(&path);
                std::hash::Hash::hash(&version, &mut hasher);
                sizes.push(std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0));
                files.push(path);
                labels.push(label as i64);
            }
        }
        ensure!(
            !files.is_empty(),
            "image folder {} has no .jpg, .jpeg or .png files in its class subfolders",
            root.display()
        );
        let version = format!(
            "{}:{}:{:016x}",
            root.display(),
            files.len(),
            std::hash::Hasher::finish(&hasher)
        );
        Ok(ImageFolderSource {
            root: root.to_path_buf(),
            disk_bytes: sizes.iter().sum(),
            files,
            sizes,
            labels,
            classes,
            version,
        })
    }
}

impl RawSource for ImageFolderSource {
    fn len(&self) -> u64 {
        self.files.len() as u64
    }

    fn sample_shape(&self) -> Option<&[u32]> {
        None
    }

    fn labels(&self) -> Option<&[i64]> {
        Some(&self.labels)
    }

    fn read(&self, index: u64) -> Result<Vec<u8>> {
        let path = self
            .files
            .get(index as usize)
            .with_context(|| format!("sample {index} is out of range"))?;
        std::fs::read(path).with_context(|| format!("reading {}", path.display()))
    }

    fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    fn disk_bytes_of(&self, index: u64) -> u64 {
        self.sizes.get(index as usize).copied().unwrap_or(0)
    }

    fn describe(&self) -> String {
        format!("images:{}", self.root.display())
    }

    fn version(&self) -> String {
        self.version.clone()
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
        assert_eq!(src.sample_shape(), Some(&[2, 3][..]));
        assert_eq!(src.labels().unwrap(), &labels[..]);
        assert_eq!(src.read(1).unwrap(), data[6..12].to_vec());
        assert_eq!(
            src.read_range(1, 2).unwrap(),
            vec![data[6..12].to_vec(), data[12..18].to_vec()]
        );
        assert!(src.read_range(4, 2).is_err());
        assert!(src.read(5).is_err());
        assert!(src.disk_bytes() >= 30);
    }

    #[test]
    fn opens_a_file_another_process_holds_locked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.h5");
        write_hdf5(&path, "x", &[2, 3], &[1; 6], None).unwrap();
        let held = std::fs::File::open(&path).unwrap();
        held.lock().unwrap(); // flock, as HDF5 takes it
        let src = Hdf5Source::open(&path, "x", None).unwrap();
        assert_eq!(src.read(1).unwrap(), vec![1; 3]);
    }

    #[test]
    fn granules_follow_the_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.h5");
        // Contiguous, 64 KiB samples: 1 MiB at a time.
        write_hdf5(&path, "big", &[40, 1 << 16], &vec![0; 40 << 16], None).unwrap();
        assert_eq!(
            Hdf5Source::open(&path, "big", None).unwrap().read_granule(),
            16
        );
        // Contiguous, tiny samples: capped.
        write_hdf5(&path, "small", &[1000, 4], &[0; 4000], None).unwrap();
        assert_eq!(
            Hdf5Source::open(&path, "small", None)
                .unwrap()
                .read_granule(),
            MAX_GRANULE
        );
        // Chunked: one chunk.
        let file = hdf5::File::create(&path).unwrap();
        file.new_dataset::<u8>()
            .chunk([10, 4])
            .shape([1000, 4])
            .create("chunked")
            .unwrap();
        drop(file);
        assert_eq!(
            Hdf5Source::open(&path, "chunked", None)
                .unwrap()
                .read_granule(),
            10
        );
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

    #[test]
    fn image_folders_label_by_class() {
        let dir = tempfile::tempdir().unwrap();
        for (class, names) in [("dog", &["b.png", "a.JPG"][..]), ("cat", &["z.jpeg"][..])] {
            std::fs::create_dir(dir.path().join(class)).unwrap();
            for n in names {
                std::fs::write(dir.path().join(class).join(n), n.as_bytes()).unwrap();
            }
        }
        std::fs::write(dir.path().join("dog/notes.txt"), "skip me").unwrap();
        let src = ImageFolderSource::open(dir.path()).unwrap();
        assert_eq!(src.classes, vec!["cat", "dog"]);
        assert_eq!(src.len(), 3);
        assert_eq!(src.labels().unwrap(), &[0, 1, 1]);
        assert_eq!(src.read(1).unwrap(), b"a.JPG");
        assert_eq!(src.disk_bytes_of(2), 5);
        let empty = tempfile::tempdir().unwrap();
        let err = format!("{:#}", ImageFolderSource::open(empty.path()).err().unwrap());
        assert!(err.contains("no class subfolders"), "{err}");
    }
}
