//! The daemon's TOML configuration: the daemon's own tables here, a dataset's in `dataset`,
//! and the key lists docs/config.md is checked against in `keys`.

mod dataset;
pub mod keys;

pub use dataset::{
    DatasetConfig, DecodeMode, FieldConfig, ImageMode, OnError, PairConfig, TrainConfig, TrainCrop,
};

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
    /// The user the config's own datasets are read as, in readers, where the daemon can switch
    /// users: a dedicated unprivileged user (`larder-reader` in the shipped config), never root
    /// or the daemon's own. Unset: they are read in the daemon's process, with its rights.
    #[serde(default)]
    pub reader_user: Option<String>,
    /// The datasets, each a `[[dataset]]` table (see `DatasetConfig`).
    #[serde(default, rename = "dataset", deserialize_with = "dataset::tables")]
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
    /// weighed by bytes; the default) or "stale_lru" (a fixed working set,
    /// kept to compare).
    #[serde(default)]
    pub policy: crate::tiers::eviction::PolicyName,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
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
    /// Most bytes of the daemon's memory all datasets and streams may take outside the cache
    /// together (each sample's size, file lists, the scratch tier's index, streams' plans
    /// and orders); taken off the memory tier's budget as they grow. Default: half of
    /// `memory.budget_bytes`, and at least 64 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub footprint_bytes: Option<u64>,
    /// Most of those bytes one user's datasets and streams may take (the config's own
    /// datasets count against `footprint_bytes` alone). An add or a stream that would pass it
    /// is refused, saying what it would cost. Default: an eighth of `memory.budget_bytes`, and
    /// at least 16 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_footprint_bytes: Option<u64>,
    /// Most connections one user may hold open on the Unix socket at once (rings included);
    /// one more is closed at once, and logged. Default 256.
    #[serde(default = "default_connections_per_user")]
    pub connections_per_user: u32,
    /// Seconds a connection that has asked nothing (no gRPC call, no ring) is kept open.
    /// Default 30.
    #[serde(default = "default_idle_connection_seconds")]
    pub idle_connection_seconds: u64,
    /// Streams' plans one user may have built at once (a plan is built off the async
    /// threads, a core's work while it lasts; more wait their turn). Default 1.
    #[serde(default = "default_plans_per_user")]
    pub plans_per_user: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_image_pixels: default_max_image_pixels(),
            max_sample_bytes: default_max_sample_bytes(),
            max_batch_bytes: default_max_batch_bytes(),
            max_datasets_per_user: default_max_datasets_per_user(),
            footprint_bytes: None,
            user_footprint_bytes: None,
            connections_per_user: default_connections_per_user(),
            idle_connection_seconds: default_idle_connection_seconds(),
            plans_per_user: default_plans_per_user(),
        }
    }
}

/// The least the footprint account allows by default, however small the memory budget (a
/// daemon configured to cache nothing still opens datasets).
const FOOTPRINT_FLOOR: u64 = 64 << 20;

fn default_connections_per_user() -> u32 {
    256
}

fn default_idle_connection_seconds() -> u64 {
    30
}

fn default_plans_per_user() -> u32 {
    1
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
    /// Bytes one user's rings may take together (a ring that would pass it is refused, and
    /// the client falls back to batches in the message). Default: a quarter of the rings'
    /// budget (`budget_bytes`, or half the memory budget if that is less).
    #[serde(default)]
    pub user_bytes: Option<u64>,
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
pub(crate) fn default_true() -> bool {
    true
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

impl Config {
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config file {}", path.display()))?;
        let mut config =
            Config::parse(&text).with_context(|| format!("in config file {}", path.display()))?;
        // Relative dataset and scratch paths are relative to the config file.
        let base = path.parent().unwrap_or(Path::new("."));
        for d in &mut config.datasets {
            if d.path.is_relative() && crate::objects::scheme_of(&d.path).is_none() {
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

    /// The footprint account's limits for a memory `budget`: all charges, one user's.
    pub fn footprint_limits(&self, budget: u64) -> (u64, u64) {
        let total = self
            .limits
            .footprint_bytes
            .unwrap_or((budget / 2).max(FOOTPRINT_FLOOR));
        let user = self
            .limits
            .user_footprint_bytes
            .unwrap_or((budget / 8).max(FOOTPRINT_FLOOR / 4));
        (total, user.min(total))
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
        let d = &c.datasets[0];
        assert_eq!(d.kind, None, "the kind its path is recognised as");
        assert_eq!(d.options.get("labels").and_then(|v| v.as_str()), Some("y"));
        assert_eq!(d.options.len(), 2, "samples and labels are the kind's keys");
        assert_eq!(c.memory.expansion_factor, 2.0);
        assert_eq!(c.scratch.budget_bytes, Some(5000));
        let i = &c.datasets[1];
        assert_eq!(i.kind.as_deref(), Some("images"));
        assert_eq!((i.resize, i.crop_size(Some(224))), (256, Some(200)));
        assert_eq!(d.crop_size(None), None, "arrays as stored");
        assert_eq!(i.on_error, OnError::Skip);
        assert!(i.train.is_none());
    }

    #[test]
    fn object_storage_urls_only_s3_and_only_in_the_admins_config() {
        let parse = |url: &str| {
            Config::parse(&format!(
                "listen=\"a\"\n[[dataset]]\nname=\"d\"\nkind=\"webdataset\"\npath=\"{url}\"\n"
            ))
        };
        let c = parse("s3://bucket/train").unwrap();
        assert_eq!(c.datasets[0].path, Path::new("s3://bucket/train"));
        for url in ["gs://b/p", "https://host/data.h5"] {
            let err = format!("{:#}", parse(url).unwrap_err());
            assert!(
                err.contains("over S3's API") && err.contains("not "),
                "{url}: {err}"
            );
        }
        // A user's own dataset is read with their rights; an object store's credentials are
        // the daemon's.
        for url in ["s3://bucket/train", "gs://b/p"] {
            let err =
                crate::user_datasets::parse_table("d", &format!("path = \"{url}\"")).unwrap_err();
            assert!(format!("{err:#}").contains("credentials"), "{url}: {err:#}");
        }
        // A local path with "://" inside a folder's name is a path.
        assert!(crate::objects::scheme_of(Path::new("/data/a://b")).is_none());
    }

    #[test]
    fn crop_pct_and_interpolation_as_timm_gives_them() {
        let base = "listen=\"a\"\n[[dataset]]\nname=\"i\"\nkind=\"images\"\npath=\"p\"\n";
        let c = Config::parse(&format!(
            "{base}crop=224\ncrop_pct=0.875\ninterpolation=\"bicubic\""
        ))
        .unwrap();
        assert_eq!(c.datasets[0].kept_size(Some(224)), 256);
        assert_eq!(
            c.datasets[0].interpolation,
            Some(crate::fields::Resample::Cubic)
        );
        let c = Config::parse(&format!("{base}crop=224\ncrop_pct=0.95")).unwrap();
        assert_eq!(
            c.datasets[0].kept_size(Some(224)),
            235,
            "timm: floor(224 / 0.95)"
        );
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
        let base = "listen=\"a\"\n[[dataset]]\nname=\"i\"\nkind=\"images\"\npath=\"p\"\n";
        let c = Config::parse(&format!(
            "{base}on_error=\"fail\"\n[dataset.train]\nflip=false"
        ))
        .unwrap();
        let t = c.datasets[0].train.as_ref().unwrap();
        assert_eq!((t.crop, t.scale, t.flip), (None, [0.08, 1.0], false));
        assert_eq!(c.datasets[0].on_error, OnError::Fail);
        for (bad, says) in [
            ("[dataset.train]\nscale=[0.5, 0.1]", "smallest first"),
            ("[dataset.train]\nratio=[0, 1]", "positive"),
            ("[dataset.train]\ncrop=\"sideways\"", "unknown variant"),
        ] {
            let err = format!("{:#}", Config::parse(&format!("{base}{bad}")).unwrap_err());
            assert!(err.contains(says), "{bad}: {err}");
        }
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
        let f = &c.datasets[0].fields;
        assert_eq!(f.len(), 3);
        assert_eq!(f[1].pair.as_ref().unwrap().scale, 4);
        assert_eq!(
            f[2].options.get("dtype").and_then(|v| v.as_str()),
            Some("int64"),
            "the kind's key, kept for it"
        );
        assert!(Config::parse("listen=\"a\"\n[[dataset]]\nname=\"i\"\npath=\"p\"\n[[dataset.field]]\nname=\"x\"\npair={with=1}").is_err());
    }

    #[test]
    fn the_shipped_example_config_is_valid() {
        let text = include_str!("../../deploy/larder.toml");
        let c = Config::parse(text).unwrap();
        assert_eq!(
            c.unix_socket.as_deref(),
            Some(Path::new("/run/larder/larder.sock"))
        );
        assert_eq!(c.datasets.len(), 2);
    }
}
