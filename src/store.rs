//! Sample lookup through the tiers: memory -> raw source, filling the tiers on the way.
//! Concurrent requests for one sample share one fetch.

use crate::catalog::Dataset;
use crate::memory::{Key, MemoryTier};
use crate::metrics::{Metrics, Tier};
use anyhow::{anyhow, Context, Result};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

type Fetch = Shared<BoxFuture<'static, Result<Bytes, Arc<anyhow::Error>>>>;

pub struct Store {
    pub memory: Arc<MemoryTier>,
    pub metrics: Arc<Metrics>,
    inflight: Mutex<HashMap<Key, Fetch>>,
    /// Samples per epoch of all open streams together.
    streaming_samples: AtomicU64,
}

impl Store {
    pub fn new(memory: Arc<MemoryTier>, metrics: Arc<Metrics>) -> Arc<Store> {
        Arc::new(Store {
            memory,
            metrics,
            inflight: Mutex::new(HashMap::new()),
            streaming_samples: AtomicU64::new(0),
        })
    }

    /// The preprocessed bytes of sample `index` of `ds`.
    pub async fn get(self: &Arc<Self>, ds: &Arc<Dataset>, index: u64) -> Result<Bytes> {
        let key = (ds.id, index);
        if let Some(data) = self.memory.get(&key) {
            self.metrics.record_hit(Tier::Memory, data.len() as u64);
            return Ok(data);
        }
        let fetch = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            match inflight.get(&key) {
                Some(f) => {
                    self.metrics.record_coalesced();
                    f.clone()
                }
                None => {
                    // A fetch that finished between our miss and taking the lock has filled
                    // the memory tier before leaving `inflight`: look again.
                    if let Some(data) = self.memory.peek(&key) {
                        self.metrics.record_hit(Tier::Memory, data.len() as u64);
                        return Ok(data);
                    }
                    let f = self.clone().fetch(ds.clone(), index).boxed().shared();
                    inflight.insert(key, f.clone());
                    f
                }
            }
        };
        fetch.await.map_err(|e| anyhow!("{e:#}"))
    }

    async fn fetch(
        self: Arc<Self>,
        ds: Arc<Dataset>,
        index: u64,
    ) -> Result<Bytes, Arc<anyhow::Error>> {
        let key = (ds.id, index);
        let result = self.fetch_raw(ds, index).await;
        if let Ok(data) = &result {
            self.memory.insert(key, data.clone());
        }
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        result.map_err(Arc::new)
    }

    async fn fetch_raw(&self, ds: Arc<Dataset>, index: u64) -> Result<Bytes> {
        let name = ds.name.clone();
        let data = tokio::task::spawn_blocking(move || ds.source.read(index, 1))
            .await
            .context("raw read task failed")?
            .with_context(|| format!("fetching sample {index} of dataset {name:?}"))?;
        self.metrics.record_hit(Tier::Raw, data.len() as u64);
        Ok(Bytes::from(data))
    }

    /// Registers a stream that will look up `samples` samples per epoch, so that the memory
    /// tier knows how long an entry in use may go between two lookups.
    pub fn open_stream(self: &Arc<Self>, samples: u64) -> StreamGuard {
        let total = self.streaming_samples.fetch_add(samples, Ordering::SeqCst) + samples;
        self.memory.set_stale_after(2 * total);
        self.metrics.stream_opened();
        StreamGuard {
            store: self.clone(),
            samples,
        }
    }
}

/// Keeps a stream registered while it lives.
pub struct StreamGuard {
    store: Arc<Store>,
    samples: u64,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        // The memory tier keeps the staleness window of the last open: a closing stream is
        // usually followed by its next epoch.
        self.store
            .streaming_samples
            .fetch_sub(self.samples, Ordering::SeqCst);
        self.store.metrics.stream_closed();
    }
}
