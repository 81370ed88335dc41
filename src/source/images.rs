//! Image folders: the files of the first image field (in class subfolders, or flat), and for
//! each further image field the file of the same relative name (any image extension) in that
//! field's folder: `images/` and `masks/`, or `lr/` and `hr/`.

use super::{file_version_of, read_capped, Format, Opened, Provenance, RawSample, RawSource};
use crate::config::keys::keys_of;
use crate::config::{DatasetConfig, FieldConfig, ImageMode, Limits, TrainCrop};
use crate::fields::{Pairing, Resample, Schema, Value};
use crate::pipeline::{FieldOp, Preprocess, Resize};
use crate::sync::Locked;
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// File extensions read as images.
const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// Folders of images (`kind = "images"`): class subfolders or flat, JPEG and PNG, optionally
/// with paired folders (masks, low-/high-res pairs); granule: one sample.
pub struct Images;

/// The crop of image folders when `crop` is not set.
pub const DEFAULT_IMAGE_CROP: u32 = 224;

/// Where an image folder's field comes from when it is not a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldFrom {
    /// The index of the file's class subfolder among the sorted class names (int64 scalar).
    Class,
}

/// The keys of a `[[dataset]]` table only image folders read: none.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetKeys {}

/// The keys of a `[[dataset.field]]` table only image folders read.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FieldKeys {
    /// The folder (relative to the dataset's path) whose files give this field, matched by
    /// relative path without extension with the first image field's files. Default ".".
    #[serde(default)]
    folder: Option<PathBuf>,
    /// A field that is not a file: "class" (the class label).
    #[serde(default)]
    from: Option<FieldFrom>,
}

/// A field of an image folder: its table, and where its values come from.
#[derive(Debug, Clone)]
pub struct ImageField {
    pub config: FieldConfig,
    /// The folder of its files, relative to the dataset's (None: the dataset's own).
    pub folder: Option<PathBuf>,
    /// A field that is not a file (the class label).
    pub from: Option<FieldFrom>,
}

impl ImageField {
    /// An image field `name` of the dataset's own folder.
    pub fn named(name: &str) -> ImageField {
        ImageField {
            config: FieldConfig::named(name),
            folder: None,
            from: None,
        }
    }

    /// Field `name`: the class of each file.
    pub fn class(name: &str) -> ImageField {
        ImageField {
            from: Some(FieldFrom::Class),
            ..ImageField::named(name)
        }
    }
}

impl std::ops::Deref for ImageField {
    type Target = FieldConfig;
    fn deref(&self) -> &FieldConfig {
        &self.config
    }
}

impl Images {
    /// The fields to serve: the `[[dataset.field]]` tables, or the image and its class.
    fn fields(&self, c: &DatasetConfig) -> Result<Vec<ImageField>> {
        let _: DatasetKeys = super::dataset_options(self, c)?;
        if c.fields.is_empty() {
            return Ok(vec![ImageField::named("image"), ImageField::class("label")]);
        }
        c.fields
            .iter()
            .map(|f| {
                let k: FieldKeys = super::field_options(self, f)?;
                Ok(ImageField {
                    config: f.clone(),
                    folder: k.folder,
                    from: k.from,
                })
            })
            .collect()
    }
}

impl Format for Images {
    fn name(&self) -> &'static str {
        "images"
    }

    fn reads_objects(&self) -> std::result::Result<(), String> {
        Ok(())
    }

    fn recognizes(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn dataset_keys(&self) -> Vec<&'static str> {
        keys_of::<DatasetKeys>()
    }

    fn field_keys(&self) -> Vec<&'static str> {
        keys_of::<FieldKeys>()
    }

    fn check(&self, c: &DatasetConfig) -> Result<()> {
        super::check_crop_fits(self, c)?;
        self.fields(c).map(drop)
    }

    fn default_crop(&self) -> Option<u32> {
        Some(DEFAULT_IMAGE_CROP)
    }

    fn default_train_crop(&self) -> TrainCrop {
        TrainCrop::RandomResized
    }

    fn open(&self, c: &DatasetConfig, limits: &Limits) -> Result<Opened> {
        open_dataset(c, limits)
    }
}

/// What one raw field of an image folder is.
enum Column {
    /// One file per sample.
    Files(Vec<PathBuf>),
    /// The sample's class index.
    Class,
}

pub struct ImageFolderSource {
    root: PathBuf,
    columns: Vec<Column>,
    /// Class of each sample (0 when the folder has no classes).
    labels: Vec<i64>,
    /// Bytes each sample's files take.
    sizes: Vec<u64>,
    pub classes: Vec<String>,
    disk_bytes: u64,
    version: String,
    /// Largest file read whole (limits.max_sample_bytes): a larger one, or anything but a
    /// regular file (a FIFO, /dev/zero behind a symlink), is a bad sample, never read.
    pub max_file_bytes: u64,
    /// The folders whose entries make the samples (the image folder, its class folders), with
    /// their modification times when walked: a file added, removed or renamed there moves it.
    folders: Vec<(PathBuf, Option<std::time::SystemTime>)>,
    /// What a user must be able to read to have the dataset: the folder, the folders walked
    /// (a folder searchable but not listable hides its names) and every file; built once.
    files: std::sync::Arc<[PathBuf]>,
    /// An image folder in an object store: its images as listed, by sample.
    listed: Option<Listed>,
}

/// The images of a folder in an object store, as listed: a GET each, of the version listed.
struct Listed {
    bucket: String,
    /// Each sample's image: key, size, ETag (the bucket kept once).
    images: Vec<(String, u64, Option<String>)>,
    /// Why an image no longer reads as listed, once a GET said so.
    changed: std::sync::Mutex<Option<String>>,
}

impl Listed {
    /// The image of sample `i`, whole, if it holds at most `max` bytes.
    fn read(&self, i: usize, max: u64) -> Result<Vec<u8>> {
        let (key, size, etag) = &self.images[i];
        super::Blob::of_object(crate::objects::Object {
            bucket: self.bucket.clone(),
            key: key.clone(),
            size: *size,
            etag: etag.clone(),
        })
        .read_all(max)
    }
}

/// The root, the folders walked and every file of `columns`.
fn access_files(
    root: &Path,
    folders: &[(PathBuf, Option<std::time::SystemTime>)],
    columns: &[Column],
) -> std::sync::Arc<[PathBuf]> {
    let mut files = vec![root.to_path_buf()];
    files.extend(folders.iter().map(|(d, _)| d.clone()));
    for c in columns {
        if let Column::Files(paths) = c {
            files.extend(paths.iter().cloned());
        }
    }
    files.into()
}

/// A folder's modification time now.
fn folder_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    std::fs::metadata(dir).and_then(|m| m.modified()).ok()
}

/// A folder's entry: its path, and whether it is (or links to) a folder or a file.
struct Entry {
    path: PathBuf,
    dir: bool,
    file: bool,
    /// Where the path's last part (its name) starts in its bytes.
    name_at: usize,
}

fn name_bytes(e: &Entry) -> &[u8] {
    &e.path.as_os_str().as_encoded_bytes()[e.name_at..]
}

fn is_image(e: &Entry) -> bool {
    e.file
        && e.path.extension().is_some_and(|x| {
            IMAGE_EXTENSIONS.contains(&x.to_string_lossy().to_lowercase().as_str())
        })
}

/// A folder's entries, sorted by path. Their types come from the listing itself (no stat a
/// file, which a folder of a million images would pay a million times); a symbolic link, or a
/// file system that does not say, is followed with a stat, as `Path::is_dir` would.
fn sorted_entries(dir: &Path) -> Result<Vec<Entry>> {
    let mut entries: Vec<Entry> = std::fs::read_dir(dir)
        .with_context(|| format!("reading folder {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| {
            let path = e.path();
            let (dir, file) = match e.file_type() {
                Ok(t) if !t.is_symlink() => (t.is_dir(), t.is_file()),
                _ => std::fs::metadata(&path).map_or((false, false), |m| (m.is_dir(), m.is_file())),
            };
            let name_at = path.as_os_str().len() - e.file_name().len();
            Entry {
                path,
                dir,
                file,
                name_at,
            }
        })
        .collect();
    super::found(entries.len() as u64);
    // One folder's entries: by their names' bytes, which is their paths' order (and cheaper to
    // compare).
    entries.sort_unstable_by(|a, b| name_bytes(a).cmp(name_bytes(b)));
    Ok(entries)
}

/// `rel` without its extension, the key files of paired folders are matched by.
fn stem_key(rel: &Path) -> PathBuf {
    rel.with_extension("")
}

impl ImageFolderSource {
    /// Opens the folder at `root` for `fields` (image fields have no `from`; the first of them
    /// names the samples).
    pub fn open(root: &Path, fields: &[ImageField]) -> Result<ImageFolderSource> {
        let primary = fields
            .iter()
            .find(|f| f.from.is_none())
            .with_context(|| format!("image folder {}: no image field", root.display()))?;
        let primary_dir = root.join(primary.folder.as_deref().unwrap_or(Path::new(".")));
        let entries = sorted_entries(&primary_dir)
            .with_context(|| format!("image folder of field {:?}", primary.name))?;
        let class_dirs: Vec<&PathBuf> = entries.iter().filter(|e| e.dir).map(|e| &e.path).collect();
        let mut folders = vec![(primary_dir.clone(), folder_mtime(&primary_dir))];
        let wants_class = fields.iter().any(|f| f.from == Some(FieldFrom::Class));
        // Relative paths of the samples, and their classes.
        let (mut rels, mut labels, mut classes) = (vec![], vec![], vec![]);
        // Class subfolders when a field wants the class or the folder holds no images itself;
        // else the images in the folder.
        let by_class = wants_class || !entries.iter().any(is_image);
        if by_class {
            ensure!(
                !class_dirs.is_empty(),
                "image folder {} has no class subfolders{}",
                primary_dir.display(),
                if wants_class {
                    " (a field has from = \"class\")"
                } else {
                    ""
                }
            );
            for (label, dir) in class_dirs.iter().enumerate() {
                let class = dir.file_name().unwrap_or_default().to_owned();
                classes.push(class.to_string_lossy().into_owned());
                folders.push((dir.to_path_buf(), folder_mtime(dir)));
                for e in sorted_entries(dir)?.into_iter().filter(is_image) {
                    rels.push(Path::new(&class).join(e.path.file_name().unwrap_or_default()));
                    labels.push(label as i64);
                }
            }
        } else {
            for e in entries.iter().filter(|e| is_image(e)) {
                rels.push(PathBuf::from(e.path.file_name().unwrap_or_default()));
                labels.push(0);
            }
        }
        ensure!(
            !rels.is_empty(),
            "image folder {} has no .jpg, .jpeg or .png files{}",
            primary_dir.display(),
            if classes.is_empty() {
                ""
            } else {
                " in its class subfolders"
            }
        );
        let mut columns = vec![];
        for f in fields {
            if f.from == Some(FieldFrom::Class) {
                columns.push(Column::Class);
                continue;
            }
            let dir = root.join(f.folder.as_deref().unwrap_or(Path::new(".")));
            if std::ptr::eq(f, primary) {
                columns.push(Column::Files(rels.iter().map(|r| dir.join(r)).collect()));
                continue;
            }
            columns.push(Column::Files(paired_files(&dir, &f.name, &rels)?));
        }
        // A fixed hash (not DefaultHasher, whose output may change between builds): the scratch
        // tier finds its shards again by it after an upgrade.
        let mut hash = 0u128;
        let mut sizes = vec![0u64; rels.len()];
        for c in &columns {
            if let Column::Files(files) = c {
                for (i, path) in files.iter().enumerate() {
                    // One stat a file: its version (size and stamps) and its size.
                    let meta = std::fs::metadata(path).ok();
                    let v = file_version_of(path, meta.as_ref());
                    hash = crate::fingerprint::fingerprint(&[&hash.to_le_bytes(), v.as_bytes()]);
                    sizes[i] += meta.map_or(0, |m| m.len());
                }
            }
        }
        let version = format!("{}:{}:{:032x}", root.display(), rels.len(), hash);
        let files = access_files(root, &folders, &columns);
        Ok(ImageFolderSource {
            root: root.to_path_buf(),
            disk_bytes: sizes.iter().sum(),
            columns,
            labels,
            sizes,
            classes,
            version,
            max_file_bytes: u64::MAX,
            files,
            folders,
            listed: None,
        })
    }

    /// Opens the image folder at the object store's prefix `root` for `fields` (one image
    /// field, and the class): its objects listed once, class subfolders (or the images right
    /// under it) as a local folder's; each image read later in one GET.
    pub fn open_objects(root: &Path, fields: &[ImageField]) -> Result<ImageFolderSource> {
        let images: Vec<&ImageField> = fields.iter().filter(|f| f.from.is_none()).collect();
        ensure!(
            images.len() == 1 && images[0].folder.is_none(),
            "image folder {}: an image folder in an object store serves one image field (and \
             the class); paired folders are read from a local or shared filesystem",
            root.display()
        );
        let at = crate::objects::Location::parse(root)?;
        let listed = crate::objects::fetcher()
            .list(&at)
            .with_context(|| format!("listing {}", root.display()))?;
        super::found(listed.len() as u64);
        let rel_of = |key: &str| -> Option<String> {
            let rel = match at.key.is_empty() {
                true => key,
                false => key.strip_prefix(&at.key)?.strip_prefix('/')?,
            };
            let ext = rel.rsplit_once('.')?.1.to_lowercase();
            IMAGE_EXTENSIONS
                .contains(&ext.as_str())
                .then(|| rel.to_string())
        };
        // (class or "", object), in key order: the images right under it, and one level down.
        let mut top = vec![];
        let mut by_class: std::collections::BTreeMap<String, Vec<&crate::objects::Object>> =
            Default::default();
        for o in &listed {
            let Some(rel) = rel_of(&o.key) else { continue };
            match rel.split_once('/') {
                None => top.push(o),
                Some((class, name)) if !name.contains('/') => {
                    by_class.entry(class.to_string()).or_default().push(o)
                }
                Some(_) => {}
            }
        }
        let wants_class = fields.iter().any(|f| f.from == Some(FieldFrom::Class));
        let (mut chosen, mut labels, mut classes) = (vec![], vec![], vec![]);
        if wants_class || top.is_empty() {
            ensure!(
                !by_class.is_empty(),
                "image folder {} has no class subfolders of images",
                root.display()
            );
            for (label, (class, objects)) in by_class.into_iter().enumerate() {
                classes.push(class);
                for o in objects {
                    chosen.push(o);
                    labels.push(label as i64);
                }
            }
        } else {
            labels = vec![0; top.len()];
            chosen = top;
        }
        let mut hash = 0u128;
        for o in &chosen {
            let v = format!("{}:{}:{}", o.url(), o.size, o.etag.as_deref().unwrap_or(""));
            hash = crate::fingerprint::fingerprint(&[&hash.to_le_bytes(), v.as_bytes()]);
        }
        let sizes: Vec<u64> = chosen.iter().map(|o| o.size).collect();
        let columns = fields
            .iter()
            .map(|f| match f.from {
                Some(FieldFrom::Class) => Column::Class,
                _ => Column::Files(chosen.iter().map(|o| PathBuf::from(o.url())).collect()),
            })
            .collect();
        Ok(ImageFolderSource {
            root: root.to_path_buf(),
            disk_bytes: sizes.iter().sum(),
            version: format!("{}:{}:{:032x}", root.display(), chosen.len(), hash),
            listed: Some(Listed {
                bucket: at.bucket.clone(),
                images: chosen
                    .iter()
                    .map(|o| (o.key.clone(), o.size, o.etag.clone()))
                    .collect(),
                changed: Default::default(),
            }),
            columns,
            labels,
            sizes,
            classes,
            max_file_bytes: u64::MAX,
            files: vec![root.to_path_buf()].into(),
            folders: vec![],
        })
    }

    fn primary_file(&self, index: u64) -> Option<&Path> {
        self.columns.iter().find_map(|c| match c {
            Column::Files(f) => f.get(index as usize).map(PathBuf::as_path),
            Column::Class => None,
        })
    }
}

impl RawSource for ImageFolderSource {
    fn len(&self) -> u64 {
        self.labels.len() as u64
    }

    fn read_range(&self, start: u64, count: u64) -> Result<Vec<RawSample>> {
        (start..start + count)
            .map(|i| {
                ensure!(i < self.len(), "sample {i} is out of range");
                self.columns
                    .iter()
                    .map(|c| match c {
                        Column::Class => Ok(Value::int64(self.labels[i as usize])),
                        Column::Files(files) => {
                            let path = &files[i as usize];
                            let bytes = match &self.listed {
                                Some(l) => {
                                    l.read(i as usize, self.max_file_bytes).inspect_err(|e| {
                                        if crate::error::Error::kind_of(e)
                                            == crate::error::Kind::Changed
                                        {
                                            *l.changed.locked() = Some(format!("{e:#}"));
                                        }
                                    })
                                }
                                None => read_capped(path, self.max_file_bytes),
                            }
                            .with_context(|| format!("reading {}", path.display()))?;
                            Ok(Value::new(vec![bytes.len() as u32], bytes))
                        }
                    })
                    .collect()
            })
            .collect()
    }

    fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    fn disk_bytes_each(&self) -> Option<u64> {
        None
    }

    fn disk_bytes_of(&self, index: u64) -> u64 {
        self.sizes.get(index as usize).copied().unwrap_or(0)
    }

    fn describe(&self) -> String {
        format!("images:{}", self.root.display())
    }

    fn sample_name(&self, index: u64) -> String {
        match self.primary_file(index) {
            Some(p) => format!("sample {index} ({})", p.display()),
            None => format!("sample {index}"),
        }
    }
}

impl Provenance for ImageFolderSource {
    fn version(&self) -> String {
        self.version.clone()
    }

    fn files(&self) -> crate::access::Files {
        crate::access::Files::List(self.files.clone())
    }

    fn root(&self) -> &Path {
        &self.root
    }

    fn changed(&self) -> Option<String> {
        if let Some(l) = &self.listed {
            return l.changed.locked().clone();
        }
        self.folders
            .iter()
            .find(|(dir, mtime)| folder_mtime(dir) != *mtime)
            .map(|(dir, _)| {
                format!(
                    "{} changed since the daemon walked it (images added, removed or renamed)",
                    dir.display()
                )
            })
    }
}

/// The files of a paired field's folder `dir` partnering the samples `rels` (matched by
/// relative path without extension), for field `field`. The folder is walked once, each
/// directory at most once however symlinks lead back to it.
fn paired_files(dir: &Path, field: &str, rels: &[PathBuf]) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::MetadataExt;
    let mut by_stem: HashMap<PathBuf, PathBuf> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    let mut pending = vec![dir.to_path_buf()];
    // A paired folder holds about one file per sample: a walk that meets far more (`folder =
    // "/"`, say) stops rather than list the machine.
    let most = rels.len().saturating_mul(4).saturating_add(10_000);
    let mut entries = 0usize;
    while let Some(d) = pending.pop() {
        // A directory reached again (a symlink to itself or an ancestor) is walked once.
        let Ok(meta) = std::fs::metadata(&d) else {
            continue;
        };
        if !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        let listed =
            sorted_entries(&d).with_context(|| format!("image folder of field {field:?}"))?;
        entries += listed.len();
        ensure!(
            entries <= most,
            "field {field:?}: {} holds over {most} entries for {} samples; name the folder of this field's files",
            dir.display(),
            rels.len()
        );
        for e in listed {
            if e.dir {
                pending.push(e.path);
            } else if is_image(&e) {
                let rel = e.path.strip_prefix(dir).unwrap_or(&e.path);
                by_stem.entry(stem_key(rel)).or_insert(e.path.clone());
            }
        }
    }
    let mut files = Vec::with_capacity(rels.len());
    let mut missing = vec![];
    for r in rels {
        match by_stem.get(&stem_key(r)) {
            Some(p) => files.push(p.clone()),
            None => missing.push(r.display().to_string()),
        }
    }
    if !missing.is_empty() {
        bail!(
            "field {field:?}: {} of {} files have no partner in {} (matched by name without extension), e.g. {}",
            missing.len(),
            rels.len(),
            dir.display(),
            missing.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
        );
    }
    Ok(files)
}

/// An image folder as its `[[dataset]]` table describes it: each image field decoded by its
/// mode and kept resized, paired fields at their scale.
fn open_dataset(c: &DatasetConfig, limits: &Limits) -> Result<Opened> {
    let fields = Images.fields(c)?;
    let resize = super::resize_of(&Images, c);
    let mut source = match crate::objects::is_url(&c.path) {
        true => ImageFolderSource::open_objects(&c.path, &fields)?,
        false => ImageFolderSource::open(&c.path, &fields)?,
    };
    source.max_file_bytes = limits.max_sample_bytes;
    tracing::info!(dataset = %c.name, classes = source.classes.len(), images = source.len(), "image folder opened");
    let reference = fields
        .iter()
        .find(|f| f.from.is_none())
        .map(|f| f.name.clone());
    let mut ops = vec![];
    let mut specs = vec![];
    for f in &fields {
        if f.from.is_some() {
            ops.push(FieldOp::Keep);
            specs.push(FieldOp::Keep.field(&f.name, &resize));
            continue;
        }
        let (op, spec) = image_field(c, f, reference.as_deref(), &resize, "an image folder")?;
        ops.push(op);
        specs.push(spec);
    }
    Ok(Opened {
        source: Box::new(source),
        preprocess: Preprocess::Images { ops, resize },
        schema: Schema::new(specs)?,
        format: &Images,
    })
}

/// How image field `f` of dataset `c` is decoded and what it serves: by its mode, at the size
/// kept, paired with `reference` (the first image field, the scale-1 reference of the spatial
/// group; `kind` names the source in the error when a field pairs with another).
pub(super) fn image_field(
    c: &DatasetConfig,
    f: &FieldConfig,
    reference: Option<&str>,
    resize: &Resize,
    kind: &str,
) -> Result<(FieldOp, crate::fields::FieldSpec)> {
    let mode = f.mode.unwrap_or(ImageMode::Rgb);
    let resample = f.resample.unwrap_or(match mode {
        ImageMode::Index => Resample::Nearest,
        _ => c.interpolation.unwrap_or(Resample::Linear),
    });
    let is_reference = reference == Some(f.name.as_str());
    let scale = match &f.pair {
        Some(_) if is_reference => bail!(
            "field {:?} is the reference image; pair the others with it",
            f.name
        ),
        Some(p) if Some(p.with.as_str()) != reference => bail!(
            "field {:?} pairs with {:?}; in {kind} every image field pairs with the first one, {:?}",
            f.name,
            p.with,
            reference.unwrap_or("")
        ),
        Some(p) => p.scale,
        None => 1,
    };
    let op = FieldOp::Decode {
        mode,
        scale,
        resample,
        upright: false,
    };
    let mut spec = op.field(&f.name, resize);
    if !is_reference {
        spec.pair = Some(Pairing {
            with: reference.unwrap_or_default().to_string(),
            scale,
        });
    }
    Ok((op, spec))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn classified() -> Vec<ImageField> {
        vec![ImageField::named("image"), ImageField::class("label")]
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
        let src = ImageFolderSource::open(dir.path(), &classified()).unwrap();
        assert_eq!(src.classes, vec!["cat", "dog"]);
        assert_eq!(src.len(), 3);
        let s = src.read(1).unwrap();
        assert_eq!(s[0].data, b"a.JPG");
        assert_eq!(s[1], Value::int64(1));
        assert_eq!(src.disk_bytes_of(2), 5);
        assert!(src.sample_name(1).contains("dog/a.JPG"));
        let empty = tempfile::tempdir().unwrap();
        let err = format!(
            "{:#}",
            ImageFolderSource::open(empty.path(), &classified())
                .err()
                .unwrap()
        );
        assert!(err.contains("no class subfolders"), "{err}");
    }

    /// Fields "image" from images/ and "mask" from masks/.
    fn image_and_mask() -> Vec<ImageField> {
        vec![
            ImageField {
                folder: Some("images".into()),
                ..ImageField::named("image")
            },
            ImageField {
                folder: Some("masks".into()),
                ..ImageField::named("mask")
            },
        ]
    }

    #[test]
    fn a_symlink_loop_in_a_paired_folder_is_walked_once() {
        // masks/x -> masks and masks/y -> masks: a walk that follows them without
        // remembering where it has been never ends (and grows without bound).
        let dir = tempfile::tempdir().unwrap();
        for folder in ["images", "masks"] {
            std::fs::create_dir(dir.path().join(folder)).unwrap();
        }
        std::fs::write(dir.path().join("images/a.jpg"), "i").unwrap();
        std::fs::write(dir.path().join("masks/a.png"), "m").unwrap();
        std::os::unix::fs::symlink(".", dir.path().join("masks/x")).unwrap();
        std::os::unix::fs::symlink(".", dir.path().join("masks/y")).unwrap();
        let fields = image_and_mask();
        let (tx, rx) = std::sync::mpsc::channel();
        let root = dir.path().to_path_buf();
        std::thread::spawn(move || {
            let _ = tx.send(ImageFolderSource::open(&root, &fields).map(|s| s.read(0)));
        });
        let read = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("opening the folder finishes");
        let s = read.unwrap().unwrap();
        assert_eq!((&s[0].data[..], &s[1].data[..]), (&b"i"[..], &b"m"[..]));
    }

    #[test]
    fn paired_folders_match_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for (folder, names) in [
            ("images", ["a.jpg", "b.jpg"]),
            ("masks", ["b.png", "a.png"]),
        ] {
            std::fs::create_dir(dir.path().join(folder)).unwrap();
            for n in names {
                std::fs::write(dir.path().join(folder).join(n), format!("{folder}/{n}")).unwrap();
            }
        }
        let fields = image_and_mask();
        let src = ImageFolderSource::open(dir.path(), &fields).unwrap();
        assert_eq!(src.len(), 2);
        let s = src.read(1).unwrap();
        assert_eq!(
            (&s[0].data[..], &s[1].data[..]),
            (&b"images/b.jpg"[..], &b"masks/b.png"[..])
        );
        std::fs::remove_file(dir.path().join("masks/a.png")).unwrap();
        let err = format!(
            "{:#}",
            ImageFolderSource::open(dir.path(), &fields).err().unwrap()
        );
        assert!(
            err.contains("field \"mask\": 1 of 2 files have no partner"),
            "{err}"
        );
        assert!(err.contains("a.jpg"), "{err}");
        let mut with_class = fields.clone();
        with_class.push(classified().pop().unwrap());
        std::fs::write(dir.path().join("masks/a.png"), "x").unwrap();
        let err = format!(
            "{:#}",
            ImageFolderSource::open(dir.path(), &with_class)
                .err()
                .unwrap()
        );
        assert!(err.contains("no class subfolders"), "{err}");
    }
}
