//! The datasets the daemon serves, opened from the config.

use crate::config::{DatasetConfig, ScratchConfig, SourceKind};
use crate::preprocess::Preprocess;
use crate::scratch::{fnv1a, ScratchSpace, ScratchTier};
use crate::source::{Hdf5Source, ImageFolderSource, RawSource};
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct Dataset {
    /// Small integer id used in cache keys.
    pub id: u32,
    pub name: String,
    pub source: Box<dyn RawSource>,
    pub preprocess: Preprocess,
    /// Shape of one preprocessed sample.
    pub shape: Vec<u32>,
    /// Bytes of one preprocessed sample.
    pub sample_bytes: u64,
    /// The dataset's scratch shards, unless the scratch tier is off or could not be opened.
    pub scratch: Option<ScratchTier>,
}

impl Dataset {
    pub fn new(id: u32, name: &str, source: Box<dyn RawSource>, preprocess: Preprocess) -> Dataset {
        let shape = preprocess.shape();
        Dataset {
            id,
            name: name.to_string(),
            source,
            sample_bytes: preprocess.sample_bytes(),
            preprocess,
            shape,
            scratch: None,
        }
    }

    /// Identifies the raw data and its preprocessing: scratch shards of another fingerprint
    /// are out of date.
    pub fn fingerprint(&self) -> u64 {
        fnv1a(&[
            self.source.version().as_bytes(),
            self.preprocess.describe().as_bytes(),
            &self.len().to_le_bytes(),
        ])
    }

    pub fn len(&self) -> u64 {
        self.source.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn label(&self, index: u64) -> Option<i64> {
        self.source.labels().map(|l| l[index as usize])
    }

    /// Preprocesses the raw bytes of sample `index` (blocking).
    pub fn prepare(&self, index: u64, raw: Vec<u8>) -> Result<Vec<u8>> {
        self.preprocess
            .apply(raw)
            .with_context(|| format!("preprocessing sample {index} of dataset {:?}", self.name))
    }

    pub fn info(&self) -> crate::proto::DatasetInfo {
        crate::proto::DatasetInfo {
            name: self.name.clone(),
            num_samples: self.len(),
            sample_shape: self.shape.clone(),
            has_labels: self.source.labels().is_some(),
            source: self.source.describe(),
            sample_bytes: self.sample_bytes,
        }
    }
}

#[derive(Default)]
pub struct Catalog {
    datasets: BTreeMap<String, Arc<Dataset>>,
    pub scratch: Option<Arc<ScratchSpace>>,
}

impl Catalog {
    /// Opens every dataset (an error names the one that failed) and, if enabled, the scratch tier.
    /// A scratch directory that cannot be used is logged, and the daemon serves without it.
    pub fn open(configs: &[DatasetConfig], scratch: &ScratchConfig) -> Result<Catalog> {
        let mut catalog = Catalog::default();
        if scratch.enabled {
            match ScratchSpace::open(&scratch.dir, scratch.budget_bytes) {
                Ok(space) => catalog.scratch = Some(space),
                Err(e) => tracing::error!("scratch tier disabled: {e:#}"),
            }
        }
        for (id, c) in configs.iter().enumerate() {
            let dataset = open_dataset(id as u32, c)
                .with_context(|| format!("opening dataset {:?}", c.name))?;
            catalog.add(dataset, scratch.shard_bytes);
        }
        if let Some(space) = &catalog.scratch {
            space.remove_unused(
                catalog
                    .iter()
                    .filter_map(|d| d.scratch.as_ref().map(|t| t.dir())),
            );
        }
        Ok(catalog)
    }

    /// Adds a dataset, opening its scratch shards if the catalog has a scratch tier.
    pub fn add(&mut self, mut dataset: Dataset, shard_bytes: u64) {
        if let Some(space) = &self.scratch {
            let opened = ScratchTier::open(
                space,
                &dataset.name,
                dataset.fingerprint(),
                dataset.sample_bytes,
                dataset.len(),
                shard_bytes,
            );
            match opened {
                Ok(tier) => dataset.scratch = Some(tier),
                Err(e) => {
                    tracing::error!(dataset = %dataset.name, "no scratch tier for this dataset: {e:#}")
                }
            }
        }
        self.datasets
            .insert(dataset.name.clone(), Arc::new(dataset));
    }

    pub fn get(&self, name: &str) -> Option<Arc<Dataset>> {
        self.datasets.get(name).cloned()
    }

    pub fn names(&self) -> Vec<&str> {
        self.datasets.keys().map(String::as_str).collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Dataset>> {
        self.datasets.values()
    }
}

fn open_dataset(id: u32, c: &DatasetConfig) -> Result<Dataset> {
    Ok(match c.kind {
        SourceKind::Hdf5 => {
            let source = Hdf5Source::open(&c.path, &c.samples, c.labels.as_deref())?;
            let shape = source.sample_shape().unwrap_or_default().to_vec();
            Dataset::new(
                id,
                &c.name,
                Box::new(source),
                Preprocess::Identity { shape },
            )
        }
        SourceKind::Images => {
            let source = ImageFolderSource::open(&c.path)?;
            tracing::info!(dataset = %c.name, classes = source.classes.len(), images = source.len(), "image folder opened");
            let preprocess = Preprocess::Image {
                resize: c.resize,
                crop: c.crop,
            };
            Dataset::new(id, &c.name, Box::new(source), preprocess)
        }
    })
}
