//! The datasets the daemon serves, opened from the config.

use crate::config::DatasetConfig;
use crate::source::{Hdf5Source, RawSource};
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct Dataset {
    /// Small integer id used in cache keys.
    pub id: u32,
    pub name: String,
    pub source: Box<dyn RawSource>,
    /// Shape of one preprocessed sample.
    pub shape: Vec<u32>,
    /// Bytes of one preprocessed sample.
    pub sample_bytes: u64,
}

impl Dataset {
    pub fn new(id: u32, name: &str, source: Box<dyn RawSource>) -> Dataset {
        let shape = source.sample_shape().to_vec();
        let sample_bytes = shape.iter().map(|&d| d as u64).product();
        Dataset {
            id,
            name: name.to_string(),
            source,
            shape,
            sample_bytes,
        }
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
}

impl Catalog {
    pub fn open(configs: &[DatasetConfig]) -> Result<Catalog> {
        let mut catalog = Catalog::default();
        for (id, c) in configs.iter().enumerate() {
            let source = Hdf5Source::open(&c.path, &c.samples, c.labels.as_deref())
                .with_context(|| format!("opening dataset {:?}", c.name))?;
            catalog.add(Dataset::new(id as u32, &c.name, Box::new(source)));
        }
        Ok(catalog)
    }

    pub fn add(&mut self, dataset: Dataset) {
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
