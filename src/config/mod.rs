//! The daemon's TOML configuration.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Default in-memory expansion factor: N bytes on disk take about K*N bytes in memory.
pub const DEFAULT_EXPANSION_FACTOR: f64 = 2.5;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// TCP address to listen on, e.g. "127.0.0.1:7878" (default: none). TCP clients have no
    /// identity and get only datasets marked `tcp = true`.
    #[serde(default)]
    pub listen: Option<String>,
    /// Unix socket path to listen on.
    #[serde(default)]
    pub unix_socket: Option<PathBuf>,
    /// Permissions of the Unix socket; connecting needs write permission. Default 0o660: the
    /// daemon's user and group (`larder` under the unit) may connect; 0o666 lets every user.
    #[serde(default = "default_socket_mode")]
    pub unix_socket_mode: u32,
    #[serde(default)]
    pub memory: MemoryConfig,
    #[serde(default)]
    pub scratch: ScratchConfig,
    #[serde(default)]
    pub shm: ShmConfig,
    #[serde(default)]
    pub limits: Limits,
    /// Threads that read raw samples and preprocess them. Default: the number of CPUs.
    #[serde(default)]
    pub preprocess_workers: Option<usize>,
    /// Batches each stream prepares ahead of its client.
    #[serde(default = "default_prefetch_batches")]
    pub prefetch_batches: usize,
    /// Largest batch a client may ask for.
    #[serde(default = "default_max_batch_size")]
    pub max_batch_size: u32,
    /// Where the daemon keeps what must outlive it: the datasets users added. Default:
    /// systemd's `$STATE_DIRECTORY` (the unit's StateDirectory); without either, added
    /// datasets last until the daemon stops.
    #[serde(default)]
    pub state_dir: Option<PathBuf>,
    #[serde(default, rename = "dataset")]
    pub datasets: Vec<DatasetConfig>,
    /// The Prometheus endpoint.
    #[serde(default)]
    pub metrics: MetricsConfig,
}

/// `[metrics]`: the Prometheus endpoint.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address to serve `/metrics` on, e.g. "127.0.0.1:9464" (default: none, off). What it
    /// shows (dataset names, each open stream's user id and process) is for the machine's
    /// admins: keep it on localhost or behind the lab's network rules.
    #[serde(default)]
    pub listen: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryConfig {
    /// Byte budget of the memory tier. Takes precedence over `budget_fraction`.
    #[serde(default)]
    pub budget_bytes: Option<u64>,
    /// Budget as a fraction of the machine's total memory (used when budget_bytes is absent).
    #[serde(default = "default_budget_fraction")]
    pub budget_fraction: f64,
    /// In-memory expansion factor K used for capacity planning (between 2 and 3 in practice).
    #[serde(default = "default_expansion_factor")]
    pub expansion_factor: f64,
    /// The cache shrinks whenever the machine's available memory falls below this floor.
    /// Default: 10% of total memory.
    #[serde(default)]
    pub min_available_bytes: Option<u64>,
    /// How often to check the machine's available memory, in milliseconds.
    #[serde(default = "default_watch_interval_ms")]
    pub watch_interval_ms: u64,
    /// Bytes of spare message buffers (for batches sent in gRPC messages) kept for reuse; they
    /// are freed when unused for 10 s and first when the machine runs short.
    #[serde(default = "default_message_buffers_bytes")]
    pub message_buffers_bytes: usize,
    /// Bytes of the budget held back from the memory tier for the message path: the spare
    /// message buffers and the batches on their way to clients in gRPC messages. A stream
    /// reads ahead into messages only while the path holds less than this (its next batch is
    /// never held up). The allocator's freed pages count in it too: past it they are given
    /// back to the kernel. Default: a quarter of the budget, at most 256 MiB.
    #[serde(default)]
    pub message_bytes: Option<u64>,
    /// Which sample the tier lets go: "next_use" (the soonest any open stream reads it next,
    /// weighed by bytes; the default) or "stale_lru" (the fixed working set of earlier rounds,
    /// kept to compare).
    #[serde(default)]
    pub policy: crate::tiers::memory::PolicyName,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            budget_bytes: None,
            budget_fraction: default_budget_fraction(),
            expansion_factor: default_expansion_factor(),
            min_available_bytes: None,
            watch_interval_ms: default_watch_interval_ms(),
            message_buffers_bytes: default_message_buffers_bytes(),
            message_bytes: None,
            policy: Default::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScratchConfig {
    /// Where the scratch tier keeps its shard files; on fast local disk.
    #[serde(default = "default_scratch_dir")]
    pub dir: PathBuf,
    /// Bytes the shard files may take in all. Default: 80% of the disk's free space at start.
    #[serde(default)]
    pub budget_bytes: Option<u64>,
    /// Size of one shard file.
    #[serde(default = "default_shard_bytes")]
    pub shard_bytes: u64,
    /// Set to false to serve from memory and raw storage only.
    #[serde(default = "default_true")]
    pub enabled: bool,
}

impl Default for ScratchConfig {
    fn default() -> Self {
        ScratchConfig {
            dir: default_scratch_dir(),
            budget_bytes: None,
            shard_bytes: default_shard_bytes(),
            enabled: true,
        }
    }
}

/// What one sample may cost, whatever its files say: a sample over a limit is a bad sample
/// (skipped, or the stream's error under `on_error = "fail"`), never decoded whole and never
/// kept in a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Most pixels (width x height, from the file's header, before any decoding) an image may
    /// have. Default 89,478,485, Pillow's `Image.MAX_IMAGE_PIXELS` (a 0.25 GiB RGB image):
    /// a 776-byte JPEG can claim 30000 x 30000.
    #[serde(default = "default_max_image_pixels")]
    pub max_image_pixels: u64,
    /// Most bytes one sample may take: its raw files as read, and its record as kept in the
    /// tiers. Default 64 MiB (a 3 x 4096 x 4096 uint8 image is 48 MiB).
    #[serde(default = "default_max_sample_bytes")]
    pub max_sample_bytes: u64,
    /// Most bytes one batch may take in a gRPC message. A request whose fixed-size batches
    /// would be larger is refused at once; a batch that grows over it through variable-length
    /// fields ends its stream with INVALID_ARGUMENT (ask for a smaller batch_size). Default
    /// 256 MiB.
    #[serde(default = "default_max_batch_bytes")]
    pub max_batch_bytes: u64,
    /// Most datasets one user may add (`larder add`). Default 32.
    #[serde(default = "default_max_datasets_per_user")]
    pub max_datasets_per_user: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_image_pixels: default_max_image_pixels(),
            max_sample_bytes: default_max_sample_bytes(),
            max_batch_bytes: default_max_batch_bytes(),
            max_datasets_per_user: default_max_datasets_per_user(),
        }
    }
}

fn default_max_image_pixels() -> u64 {
    89_478_485
}

fn default_max_sample_bytes() -> u64 {
    64 << 20
}

fn default_max_datasets_per_user() -> u32 {
    32
}

fn default_max_batch_bytes() -> u64 {
    256 << 20
}

/// Shared-memory rings: batches for clients on the Unix socket, written into memory they map.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShmConfig {
    /// Bytes all clients' rings may take together; a ring that would go over it is refused
    /// (the Python client then falls back to batches in the message). Default: 1/8 of the
    /// machine's memory.
    #[serde(default)]
    pub budget_bytes: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// An HDF5 file: each field is an HDF5 dataset [N, ...] (or a variable-length [N] one).
    Hdf5,
    /// A folder of images (class subfolders, or flat), optionally with paired folders.
    Images,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    /// Name clients ask for.
    pub name: String,
    #[serde(default = "default_kind")]
    pub kind: SourceKind,
    /// The HDF5 file, or the image folder.
    pub path: PathBuf,
    /// Shorthand, HDF5: the dataset served as field "image" (default "images" when no
    /// `[[dataset.field]]` is given).
    #[serde(default)]
    pub samples: Option<String>,
    /// Shorthand, HDF5: an integer dataset [N] served as field "label", as int64.
    #[serde(default)]
    pub labels: Option<String>,
    /// Images: kept (in the tiers) with the shorter side resized to this many pixels, the
    /// longer in proportion (0: kept at their own size). Every crop is cut from that.
    #[serde(default = "default_resize")]
    pub resize: u32,
    /// Images: `resize` as timm gives it, the share of the kept image the eval crop keeps:
    /// the shorter side is kept at floor(crop / crop_pct) (0.875: 256 for a crop of 224). Takes
    /// precedence over `resize`.
    #[serde(default)]
    pub crop_pct: Option<f64>,
    /// Images: how the image fields are resampled when resized and cut: "linear" or "bilinear"
    /// (default, antialiased when shrinking) or "cubic"/"bicubic" (PIL's and timm's
    /// `interpolation="bicubic"`). Index masks are always resampled by the nearest pixel.
    #[serde(default)]
    pub interpolation: Option<crate::fields::Resample>,
    /// Images: ...and the longer side at most this many pixels (torchvision's `max_size`).
    #[serde(default)]
    pub max_size: Option<u32>,
    /// Images: kept at resize x resize instead, whatever their aspect ratio.
    #[serde(default)]
    pub square: bool,
    /// Batches carry crop x crop pixels (of the first image field; paired ones at their
    /// scale): the center for the eval pipeline, a random box for the train one. 0: no crop,
    /// images as kept (their H and W vary by sample). Default 224 for image folders; HDF5
    /// arrays are served at their stored size unless this is set.
    #[serde(default)]
    pub crop: Option<u32>,
    /// The train pipeline, which streams ask for with pipeline = "train": random crops and
    /// flips, drawn per sample from (seed, epoch, sample id). Absent: the dataset has only the
    /// eval pipeline.
    #[serde(default)]
    pub train: Option<TrainConfig>,
    /// What a sample whose files do not read or decode does: "skip" (default: it is left out
    /// of its batch, logged once, counted and listed) or "fail" (the stream ends with an error).
    #[serde(default)]
    pub on_error: OnError,
    /// The sample's fields, in order. Without any, the shorthand above applies.
    #[serde(default, rename = "field")]
    pub fields: Vec<FieldConfig>,
    /// Who may have the dataset without being able to read its files themselves: "all" (every
    /// local user), "user:NAME", "group:NAME". Everyone else needs read access to its files
    /// (checked as them). Default: nobody beyond that.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Whether TCP clients (which have no identity) may have the dataset. Default false.
    #[serde(default)]
    pub tcp: bool,
    /// The user who added the dataset (`larder add`), whose rights its files are read with;
    /// None for the config's datasets, read with the daemon's. Never read from a table.
    #[serde(skip)]
    pub owner: Option<u32>,
}

impl DatasetConfig {
    /// Checks the table on its own (the config's and `larder add`'s datasets alike).
    pub fn validate(&self) -> Result<()> {
        let crop = self.crop_size();
        if let Some(p) = self.crop_pct {
            if !(p > 0.0 && p <= 1.0) || crop.unwrap_or(0) == 0 {
                bail!(
                    "dataset {:?}: crop_pct = {p} needs a crop and a value in (0, 1]",
                    self.name
                );
            }
        }
        if self.kind == SourceKind::Images
            && self.kept_size() != 0
            && crop.is_some_and(|c| self.kept_size() < c)
        {
            bail!(
                "dataset {:?}: need crop <= resize (crop = {}, resize = {})",
                self.name,
                crop.unwrap_or(0),
                self.kept_size()
            );
        }
        if self.kind == SourceKind::Hdf5 && (self.max_size.is_some() || self.square) {
            bail!(
                "dataset {:?}: max_size and square are for image folders",
                self.name
            );
        }
        if let Some(t) = &self.train {
            let [s0, s1] = t.scale;
            let [r0, r1] = t.ratio;
            if !(0.0 < s0 && s0 <= s1 && s1 <= 1.0) {
                bail!("dataset {:?}: train.scale = [{s0}, {s1}] must be within (0, 1], smallest first", self.name);
            }
            if !(0.0 < r0 && r0 <= r1 && r1.is_finite()) {
                bail!(
                    "dataset {:?}: train.ratio = [{r0}, {r1}] must be positive, smallest first",
                    self.name
                );
            }
            if t.crop_kind(self.kind) == TrainCrop::RandomResized && crop.is_none() {
                bail!("dataset {:?}: a random_resized train crop needs `crop` (the size boxes are resized to)", self.name);
            }
        }
        if !self.fields.is_empty() && (self.samples.is_some() || self.labels.is_some()) {
            bail!(
                "dataset {:?}: give either `samples`/`labels` or [[dataset.field]] tables, not both",
                self.name
            );
        }
        Ok(())
    }
}

/// The train pipeline of a dataset (see `pipeline::augment`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// "random_resized" (torchvision's RandomResizedCrop; default for image folders) or
    /// "random" (a random crop of the image padded by `padding`; default for HDF5 arrays).
    #[serde(default)]
    pub crop: Option<TrainCrop>,
    /// random_resized: the range of the box's area, as a fraction of the image's.
    #[serde(default = "default_crop_scale")]
    pub scale: [f64; 2],
    /// random_resized: the range of the box's aspect ratio (width / height).
    #[serde(default = "default_crop_ratio")]
    pub ratio: [f64; 2],
    /// random: zeros added on each side before cropping (4 in the CIFAR recipe).
    #[serde(default)]
    pub padding: u32,
    /// Mirror left to right half of the time.
    #[serde(default = "default_true")]
    pub flip: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainCrop {
    RandomResized,
    Random,
}

/// What a sample that does not read or decode does to its stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Left out of its batch; logged once, counted in the stats and listed by `larder bad`.
    #[default]
    Skip,
    /// The stream ends with an error naming the file.
    Fail,
}

/// Where an image folder's field comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FieldFrom {
    /// The index of the file's class subfolder among the sorted class names (int64 scalar).
    Class,
}

/// How an image file is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageMode {
    /// uint8 [3, H, W].
    Rgb,
    /// uint8 [1, H, W].
    Gray,
    /// uint8 [H, W]: palette indices of a palette PNG, or the values of a greyscale one (class
    /// ids of a segmentation mask), never blended when resized.
    Index,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairConfig {
    /// The field this one is paired with.
    pub with: String,
    /// This field's H and W are `scale` times those of `with`.
    #[serde(default = "default_scale")]
    pub scale: u32,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldConfig {
    /// Name clients see.
    pub name: String,
    /// HDF5: the dataset in the file (default: the field's name).
    #[serde(default)]
    pub hdf5: Option<String>,
    /// HDF5: read the values as this dtype (HDF5 converts once, when the sample is first read);
    /// default: as stored.
    #[serde(default)]
    pub dtype: Option<crate::fields::DType>,
    /// Images: the folder (relative to the dataset's path) whose files give this field, matched
    /// by relative path without extension with the first image field's files. Default ".".
    #[serde(default)]
    pub folder: Option<PathBuf>,
    /// Images: how files are decoded (default rgb).
    #[serde(default)]
    pub mode: Option<ImageMode>,
    /// Images: a field that is not a file (the class label).
    #[serde(default)]
    pub from: Option<FieldFrom>,
    /// Spatial pairing: this field is resized, cropped and flipped with `with`.
    #[serde(default)]
    pub pair: Option<PairConfig>,
    /// How the field is resampled when resized: nearest or linear (default: linear for images
    /// and float fields, nearest for integer ids and index masks).
    #[serde(default)]
    pub resample: Option<crate::fields::Resample>,
}

impl FieldConfig {
    pub fn named(name: &str) -> FieldConfig {
        FieldConfig {
            name: name.to_string(),
            hdf5: None,
            dtype: None,
            folder: None,
            mode: None,
            from: None,
            pair: None,
            resample: None,
        }
    }
}

impl TrainConfig {
    /// The crop asked for, or the kind's default.
    pub fn crop_kind(&self, kind: SourceKind) -> TrainCrop {
        self.crop.unwrap_or(match kind {
            SourceKind::Images => TrainCrop::RandomResized,
            SourceKind::Hdf5 => TrainCrop::Random,
        })
    }
}

impl DatasetConfig {
    /// The shorter side images are kept at: `resize`, or floor(crop / crop_pct) when
    /// `crop_pct` is set.
    pub fn kept_size(&self) -> u32 {
        match (self.crop_pct, self.crop_size()) {
            (Some(p), Some(c)) if p > 0.0 => (c as f64 / p).floor() as u32,
            _ => self.resize,
        }
    }

    /// The side of the crop batches carry: None for no crop.
    pub fn crop_size(&self) -> Option<u32> {
        match (self.crop, self.kind) {
            (Some(0), _) | (None, SourceKind::Hdf5) => None,
            (Some(c), _) => Some(c),
            (None, SourceKind::Images) => Some(DEFAULT_IMAGE_CROP),
        }
    }

    /// The fields to serve: the `[[dataset.field]]` tables, or what the shorthand means.
    pub fn field_configs(&self) -> Vec<FieldConfig> {
        if !self.fields.is_empty() {
            return self.fields.clone();
        }
        let image = FieldConfig::named("image");
        let label = FieldConfig::named("label");
        match self.kind {
            SourceKind::Hdf5 => {
                let mut fields = vec![FieldConfig {
                    hdf5: Some(self.samples.clone().unwrap_or_else(|| "images".into())),
                    ..image
                }];
                if let Some(labels) = &self.labels {
                    fields.push(FieldConfig {
                        hdf5: Some(labels.clone()),
                        dtype: Some(crate::fields::DType::Int64),
                        ..label
                    });
                }
                fields
            }
            SourceKind::Images => vec![
                image,
                FieldConfig {
                    from: Some(FieldFrom::Class),
                    ..label
                },
            ],
        }
    }
}

fn default_scratch_dir() -> PathBuf {
    PathBuf::from("/var/cache/larder")
}
fn default_socket_mode() -> u32 {
    0o660
}
fn default_shard_bytes() -> u64 {
    256 << 20
}
fn default_true() -> bool {
    true
}
fn default_kind() -> SourceKind {
    SourceKind::Hdf5
}
fn default_resize() -> u32 {
    256
}
/// The crop of image folders when `crop` is not set.
pub const DEFAULT_IMAGE_CROP: u32 = 224;
fn default_crop_scale() -> [f64; 2] {
    [0.08, 1.0]
}
fn default_crop_ratio() -> [f64; 2] {
    [3.0 / 4.0, 4.0 / 3.0]
}
fn default_message_buffers_bytes() -> usize {
    32 << 20
}
fn default_prefetch_batches() -> usize {
    4
}
fn default_max_batch_size() -> u32 {
    4096
}
fn default_budget_fraction() -> f64 {
    0.25
}
fn default_expansion_factor() -> f64 {
    DEFAULT_EXPANSION_FACTOR
}
fn default_watch_interval_ms() -> u64 {
    1000
}
fn default_scale() -> u32 {
    1
}

impl Config {
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        let mut config =
            Config::parse(&text).with_context(|| format!("in config file {}", path.display()))?;
        // Relative dataset and scratch paths are relative to the config file.
        let base = path.parent().unwrap_or(Path::new("."));
        for d in &mut config.datasets {
            if d.path.is_relative() {
                d.path = base.join(&d.path);
            }
        }
        if config.scratch.dir.is_relative() {
            config.scratch.dir = base.join(&config.scratch.dir);
        }
        if let Some(d) = config.state_dir.as_mut().filter(|d| d.is_relative()) {
            *d = base.join(&*d);
        }
        Ok(config)
    }

    pub fn parse(text: &str) -> Result<Config> {
        let config: Config = toml::from_str(text).context("parsing TOML")?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<()> {
        if self.listen.is_none() && self.unix_socket.is_none() {
            bail!("set `listen` (TCP address) or `unix_socket` (path), or both");
        }
        let m = &self.memory;
        if !(1.0..=10.0).contains(&m.expansion_factor) {
            bail!(
                "memory.expansion_factor = {} is out of range (expected about 2 to 3)",
                m.expansion_factor
            );
        }
        if !(m.budget_fraction > 0.0 && m.budget_fraction <= 0.9) {
            bail!(
                "memory.budget_fraction = {} must be in (0, 0.9]",
                m.budget_fraction
            );
        }
        if self.prefetch_batches == 0 {
            bail!("prefetch_batches must be at least 1");
        }
        if self.unix_socket_mode > 0o777 {
            bail!(
                "unix_socket_mode {:o} is not a permission mode",
                self.unix_socket_mode
            );
        }
        if self.scratch.shard_bytes < 4096 {
            bail!("scratch.shard_bytes must be at least 4096");
        }
        if self.preprocess_workers == Some(0) {
            bail!("preprocess_workers must be at least 1");
        }
        if self.max_batch_size == 0 {
            bail!("max_batch_size must be at least 1");
        }
        let mut names = std::collections::HashSet::new();
        for d in &self.datasets {
            if d.name.is_empty() {
                bail!("a [[dataset]] has an empty name");
            }
            if !names.insert(d.name.as_str()) {
                bail!("dataset name {:?} is declared twice", d.name);
            }
            if d.name.contains('/') {
                bail!(
                    "dataset name {:?}: a '/' is for datasets users add (USER/NAME)",
                    d.name
                );
            }
            d.validate()?;
        }
        Ok(())
    }

    /// Where the daemon keeps its state: `state_dir`, else systemd's `$STATE_DIRECTORY`;
    /// None: the datasets users add last until the daemon stops.
    pub fn state_dir(&self) -> Option<PathBuf> {
        self.state_dir.clone().or_else(|| {
            // systemd joins several directories with ':'; the unit names one.
            std::env::var("STATE_DIRECTORY")
                .ok()
                .and_then(|d| d.split(':').next().map(PathBuf::from))
                .filter(|d| d.is_absolute())
        })
    }

    /// The memory tier's byte budget on a machine with `total_memory` bytes.
    pub fn budget_bytes(&self, total_memory: u64) -> u64 {
        self.memory
            .budget_bytes
            .unwrap_or((total_memory as f64 * self.memory.budget_fraction) as u64)
    }

    /// Bytes of the memory budget the message path may take (see `MemoryConfig::message_bytes`).
    pub fn message_bytes(&self, budget: u64) -> u64 {
        self.memory
            .message_bytes
            .unwrap_or((budget / 4).min(256 << 20))
            .min(budget)
    }

    /// Bytes all shared-memory rings may take together.
    pub fn shm_budget_bytes(&self, total_memory: u64) -> u64 {
        self.shm.budget_bytes.unwrap_or(total_memory / 8)
    }

    /// Available-memory floor below which the cache gives memory back.
    pub fn min_available_bytes(&self, total_memory: u64) -> u64 {
        self.memory.min_available_bytes.unwrap_or(total_memory / 10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_full_config() {
        let c = Config::parse(
            r#"
            listen = "127.0.0.1:7878"
            unix_socket = "/run/larder/larder.sock"
            [scratch]
            dir = "/scratch/larder"
            budget_bytes = 5000
            [memory]
            budget_bytes = 1000
            expansion_factor = 2.0
            [[dataset]]
            name = "cifar"
            path = "/data/cifar.h5"
            samples = "x"
            labels = "y"
            [[dataset]]
            name = "imagenet"
            kind = "images"
            path = "/data/imagenet/train"
            crop = 200
            "#,
        )
        .unwrap();
        assert_eq!(c.budget_bytes(1 << 30), 1000);
        assert_eq!(c.datasets[0].labels.as_deref(), Some("y"));
        let fields = c.datasets[0].field_configs();
        assert_eq!(fields.len(), 2);
        assert_eq!(fields[0].hdf5.as_deref(), Some("x"));
        assert_eq!(fields[1].name, "label");
        assert_eq!(c.memory.expansion_factor, 2.0);
        assert_eq!(c.scratch.budget_bytes, Some(5000));
        assert_eq!(c.datasets[1].kind, SourceKind::Images);
        assert_eq!(
            (c.datasets[1].resize, c.datasets[1].crop_size()),
            (256, Some(200))
        );
        assert_eq!(c.datasets[0].crop_size(), None, "HDF5 arrays as stored");
        assert_eq!(c.datasets[1].on_error, OnError::Skip);
        assert!(c.datasets[1].train.is_none());
    }

    #[test]
    fn crop_pct_and_interpolation_as_timm_gives_them() {
        let base = "listen=\"a\"\n[[dataset]]\nname=\"i\"\nkind=\"images\"\npath=\"p\"\n";
        let c = Config::parse(&format!(
            "{base}crop=224\ncrop_pct=0.875\ninterpolation=\"bicubic\""
        ))
        .unwrap();
        assert_eq!(c.datasets[0].kept_size(), 256);
        assert_eq!(
            c.datasets[0].interpolation,
            Some(crate::fields::Resample::Cubic)
        );
        let c = Config::parse(&format!("{base}crop=224\ncrop_pct=0.95")).unwrap();
        assert_eq!(c.datasets[0].kept_size(), 235, "timm: floor(224 / 0.95)");
        let c = Config::parse(&format!("{base}interpolation=\"bilinear\"")).unwrap();
        assert_eq!(
            c.datasets[0].interpolation,
            Some(crate::fields::Resample::Linear),
            "torchvision's and timm's name"
        );
        for bad in ["crop_pct=1.5", "crop_pct=0", "crop=0\ncrop_pct=0.9"] {
            let err = format!("{:#}", Config::parse(&format!("{base}{bad}")).unwrap_err());
            assert!(err.contains("crop_pct"), "{bad}: {err}");
        }
        assert!(Config::parse(&format!("{base}interpolation=\"lanczos\"")).is_err());
    }

    #[test]
    fn defaults_and_errors() {
        let c = Config::parse("listen = \"127.0.0.1:1\"").unwrap();
        assert_eq!(c.memory.expansion_factor, DEFAULT_EXPANSION_FACTOR);
        assert_eq!(c.budget_bytes(1000), 250);
        assert!(Config::parse("").is_err());
        assert!(Config::parse("listen = \"x\"\nbogus = 1").is_err());
        let dup = "listen=\"a\"\n[[dataset]]\nname=\"a\"\npath=\"p\"\n[[dataset]]\nname=\"a\"\npath=\"q\"";
        let err = format!("{:#}", Config::parse(dup).unwrap_err());
        assert!(err.contains("declared twice"), "{err}");
        let crop = "listen=\"a\"\n[[dataset]]\nname=\"i\"\nkind=\"images\"\npath=\"p\"\nresize=100\ncrop=120";
        let err = format!("{:#}", Config::parse(crop).unwrap_err());
        assert!(err.contains("crop <= resize"), "{err}");
        let base = "listen=\"a\"\n[[dataset]]\nname=\"i\"\nkind=\"images\"\npath=\"p\"\n";
        let c = Config::parse(&format!(
            "{base}on_error=\"fail\"\n[dataset.train]\nflip=false"
        ))
        .unwrap();
        let t = c.datasets[0].train.as_ref().unwrap();
        assert_eq!(
            (t.crop_kind(SourceKind::Images), t.scale, t.flip),
            (TrainCrop::RandomResized, [0.08, 1.0], false)
        );
        assert_eq!(c.datasets[0].on_error, OnError::Fail);
        assert_eq!(c.datasets[0].crop_size(), Some(224));
        for (bad, says) in [
            ("[dataset.train]\nscale=[0.5, 0.1]", "smallest first"),
            ("[dataset.train]\nratio=[0, 1]", "positive"),
            ("crop=0\n[dataset.train]", "needs `crop`"),
            ("[dataset.train]\ncrop=\"sideways\"", "unknown variant"),
        ] {
            let err = format!("{:#}", Config::parse(&format!("{base}{bad}")).unwrap_err());
            assert!(err.contains(says), "{bad}: {err}");
        }
        let both = "listen=\"a\"\n[[dataset]]\nname=\"i\"\npath=\"p\"\nlabels=\"y\"\n[[dataset.field]]\nname=\"x\"";
        let err = format!("{:#}", Config::parse(both).unwrap_err());
        assert!(err.contains("not both"), "{err}");
    }

    #[test]
    fn fields_are_tables_with_pairs() {
        let c = Config::parse(
            r#"
            listen = "127.0.0.1:1"
            [[dataset]]
            name = "sr"
            path = "sr.h5"
            [[dataset.field]]
            name = "lr"
            [[dataset.field]]
            name = "hr"
            pair = { with = "lr", scale = 4 }
            [[dataset.field]]
            name = "label"
            hdf5 = "labels"
            dtype = "int64"
            "#,
        )
        .unwrap();
        let f = c.datasets[0].field_configs();
        assert_eq!(f.len(), 3);
        assert_eq!(f[1].pair.as_ref().unwrap().scale, 4);
        assert_eq!(f[2].dtype, Some(crate::fields::DType::Int64));
        assert!(Config::parse("listen=\"a\"\n[[dataset]]\nname=\"i\"\npath=\"p\"\n[[dataset.field]]\nname=\"x\"\nbogus=1").is_err());
    }

    #[test]
    fn the_shipped_example_config_is_valid() {
        let text = include_str!("../deploy/larder.toml");
        let c = Config::parse(text).unwrap();
        assert_eq!(
            c.unix_socket.as_deref(),
            Some(Path::new("/run/larder/larder.sock"))
        );
        assert_eq!(c.datasets.len(), 2);
    }
}
