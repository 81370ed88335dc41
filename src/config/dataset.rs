//! A dataset's table (`[[dataset]]` in the config, or what `larder add` sends): the keys every
//! kind of source reads are fields here; the keys only one kind reads are kept as written in
//! `options` (of the dataset and of each field), and that kind's format (`source::Format`)
//! reads and checks them.

use super::keys::keys_of;
use anyhow::{bail, Result};
use serde::{Deserialize, Deserializer, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    /// Name clients ask for.
    pub name: String,
    /// The kind of source: "hdf5", "images" (`larder datasets` and the `SourceKind` call list
    /// what the daemon reads). Default: the kind that recognises `path` (a folder: images; a
    /// file: hdf5).
    #[serde(default)]
    pub kind: Option<String>,
    /// The dataset's file or folder.
    pub path: PathBuf,
    /// Image fields: kept (in the tiers) with the shorter side resized to this many pixels,
    /// the longer in proportion (0: kept at their own size). Every crop is cut from that.
    #[serde(default = "default_resize")]
    pub resize: u32,
    /// Image fields: `resize` as timm gives it, the share of the kept image the eval crop
    /// keeps: the shorter side is kept at floor(crop / crop_pct) (0.875: 256 for a crop of
    /// 224). Takes precedence over `resize`.
    #[serde(default)]
    pub crop_pct: Option<f64>,
    /// Image fields: how they are resampled when resized and cut: "linear" or "bilinear"
    /// (default, antialiased when shrinking) or "cubic"/"bicubic" (PIL's and timm's
    /// `interpolation="bicubic"`). Index masks are always resampled by the nearest pixel.
    #[serde(default)]
    pub interpolation: Option<crate::fields::Resample>,
    /// Image fields: ...and the longer side at most this many pixels (torchvision's
    /// `max_size`).
    #[serde(default)]
    pub max_size: Option<u32>,
    /// Image fields: kept at resize x resize instead, whatever their aspect ratio.
    #[serde(default)]
    pub square: bool,
    /// Batches carry crop x crop pixels (of the first image field; paired ones at their
    /// scale): the center for the eval pipeline, a random box for the train one. 0: no crop,
    /// images as kept (their H and W vary by sample). Default: the kind's (224 for image
    /// folders; HDF5 arrays are served at their stored size).
    #[serde(default)]
    pub crop: Option<u32>,
    /// Image fields of a dataset without a train pipeline, served only at their eval crop:
    /// "region" (default) keeps each at crop x crop and decodes only the part of the file the
    /// crop covers (within a pixel value or so of "exact"); "exact" decodes whole and keeps the
    /// resized image, byte for byte as before.
    #[serde(default)]
    pub decode: DecodeMode,
    /// The train pipeline, which streams ask for with pipeline = "train": random crops and
    /// flips, drawn per sample from (seed, epoch, sample id). Absent: the dataset has only the
    /// eval pipeline.
    #[serde(default)]
    pub train: Option<TrainConfig>,
    /// What a sample whose files do not read or decode does: "skip" (default: it is left out
    /// of its batch, logged once, counted and listed) or "fail" (the stream ends with an error).
    #[serde(default)]
    pub on_error: OnError,
    /// The sample's fields, in order, each a `[[dataset.field]]` table. Without any, the
    /// kind's shorthand applies.
    #[serde(default, rename = "field", deserialize_with = "field_tables")]
    pub fields: Vec<FieldConfig>,
    /// Who may have the dataset without being able to read its files themselves: "all" (every
    /// local user), "user:NAME", "group:NAME". Everyone else needs read access to its files
    /// (checked as them). Default: nobody beyond that.
    #[serde(default)]
    pub allow: Vec<String>,
    /// Whether TCP clients (which have no identity) may have the dataset. Default false.
    #[serde(default)]
    pub tcp: bool,
    /// The keys only the dataset's kind reads, as the table gives them.
    #[serde(skip)]
    pub options: toml::Table,
    /// The user who added the dataset (`larder add`), whose rights its files are read with;
    /// None for the config's datasets, read with the daemon's. Never read from a table.
    #[serde(skip)]
    pub owner: Option<u32>,
}

/// The train pipeline of a dataset (see `pipeline::augment`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// "random_resized" (torchvision's RandomResizedCrop; the default for images) or "random"
    /// (a random crop of the image padded by `padding`; the default for arrays).
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
    #[serde(default = "super::default_true")]
    pub flip: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TrainCrop {
    RandomResized,
    Random,
}

/// What a sample that does not read or decode does to its stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    /// Left out of its batch; logged once, counted in the stats and listed by `larder bad`.
    #[default]
    Skip,
    /// The stream ends with an error naming the file.
    Fail,
}

/// What an eval-only dataset's images are kept and decoded as (`decode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DecodeMode {
    /// Kept at the eval crop; only the file's part under it decoded.
    #[default]
    Region,
    /// Decoded whole, kept at the resized size.
    Exact,
}

/// How an image is decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
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

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PairConfig {
    /// The field this one is paired with.
    pub with: String,
    /// This field's H and W are `scale` times those of `with`.
    #[serde(default = "default_scale")]
    pub scale: u32,
}

/// A `[[dataset.field]]` table: the keys every kind reads, and the kind's own in `options`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FieldConfig {
    /// Name clients see.
    pub name: String,
    /// Image fields: how files are decoded (default rgb).
    #[serde(default)]
    pub mode: Option<ImageMode>,
    /// Spatial pairing: this field is resized, cropped and flipped with `with`.
    #[serde(default)]
    pub pair: Option<PairConfig>,
    /// How the field is resampled when resized: nearest or linear (default: linear for images
    /// and float fields, nearest for integer ids and index masks).
    #[serde(default)]
    pub resample: Option<crate::fields::Resample>,
    /// The keys only the dataset's kind reads, as the table gives them.
    #[serde(skip)]
    pub options: toml::Table,
}

impl FieldConfig {
    pub fn named(name: &str) -> FieldConfig {
        FieldConfig {
            name: name.to_string(),
            mode: None,
            pair: None,
            resample: None,
            options: toml::Table::new(),
        }
    }

    /// The field with a key of its kind's set (as a table would give it).
    pub fn with(mut self, key: &str, value: impl Into<toml::Value>) -> FieldConfig {
        self.options.insert(key.to_string(), value.into());
        self
    }
}

/// Splits `table` into the keys struct `T` reads (returned as a table of their own) and the
/// rest (left in `table`).
fn split<'de, T: Deserialize<'de>>(table: &mut toml::Table) -> toml::Table {
    let keys = keys_of::<T>();
    let (own, rest): (toml::Table, toml::Table) = std::mem::take(table)
        .into_iter()
        .partition(|(k, _)| keys.contains(&k.as_str()));
    *table = rest;
    own
}

impl DatasetConfig {
    /// A dataset's table as TOML gives it: the keys every kind reads checked here, the rest
    /// kept for its kind.
    pub fn from_table(mut table: toml::Table) -> Result<DatasetConfig> {
        let own = split::<DatasetConfig>(&mut table);
        let mut c: DatasetConfig = toml::Value::Table(own).try_into()?;
        c.options = table;
        if let Some(scheme) = crate::objects::scheme_of(&c.path) {
            anyhow::ensure!(
                crate::objects::SCHEMES.contains(&scheme),
                "dataset {:?}: path {}: larder reads object storage over S3's API (s3://BUCKET/PREFIX; \
                 MinIO, Ceph RGW and the like too), not {scheme}://; put it there or on a local or \
                 shared filesystem (NFS, Lustre)",
                c.name,
                c.path.display()
            );
        }
        Ok(c)
    }

    /// The table this config was read from (the kind's keys back in place): what a reader
    /// process is sent to open the dataset as the daemon would.
    pub fn to_table(&self) -> Result<toml::Table> {
        let mut t = toml::Table::try_from(self)?;
        t.extend(self.options.clone());
        if let Some(toml::Value::Array(fields)) = t.get_mut("field") {
            for (table, f) in fields.iter_mut().zip(&self.fields) {
                if let toml::Value::Table(table) = table {
                    table.extend(f.options.clone());
                }
            }
        }
        Ok(t)
    }

    /// Checks what every kind's table must hold (its kind checks the rest: `source::check`).
    pub fn validate(&self) -> Result<()> {
        if let Some(p) = self.crop_pct {
            if !(p > 0.0 && p <= 1.0) || self.crop == Some(0) {
                bail!(
                    "dataset {:?}: crop_pct = {p} needs a crop and a value in (0, 1]",
                    self.name
                );
            }
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
        }
        Ok(())
    }

    /// The shorter side images are kept at: `resize`, or floor(crop / crop_pct) when
    /// `crop_pct` is set (`crop` being the crop batches carry, `crop_size`).
    pub fn kept_size(&self, crop: Option<u32>) -> u32 {
        match (self.crop_pct, crop) {
            (Some(p), Some(c)) if p > 0.0 => (c as f64 / p).floor() as u32,
            _ => self.resize,
        }
    }

    /// The side of the crop batches carry, given the kind's default: None for no crop.
    pub fn crop_size(&self, default: Option<u32>) -> Option<u32> {
        match self.crop.or(default) {
            Some(0) | None => None,
            Some(c) => Some(c),
        }
    }
}

/// `[[dataset]]` tables, each split by `DatasetConfig::from_table`.
pub(super) fn tables<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<DatasetConfig>, D::Error> {
    let tables = Vec::<toml::Table>::deserialize(d)?;
    tables
        .into_iter()
        .map(|t| DatasetConfig::from_table(t).map_err(serde::de::Error::custom))
        .collect()
}

/// `[[dataset.field]]` tables, the keys of the field's kind kept apart in `options`.
fn field_tables<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<FieldConfig>, D::Error> {
    let tables = Vec::<toml::Table>::deserialize(d)?;
    tables
        .into_iter()
        .map(|mut t| {
            let own = split::<FieldConfig>(&mut t);
            let mut f: FieldConfig = toml::Value::Table(own)
                .try_into()
                .map_err(serde::de::Error::custom)?;
            f.options = t;
            Ok(f)
        })
        .collect()
}

fn default_resize() -> u32 {
    256
}
fn default_crop_scale() -> [f64; 2] {
    [0.08, 1.0]
}
fn default_crop_ratio() -> [f64; 2] {
    [3.0 / 4.0, 4.0 / 3.0]
}
fn default_scale() -> u32 {
    1
}
