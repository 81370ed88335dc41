//! The S3 client the serving daemon reads objects with: `object_store`'s, one per bucket,
//! configured from the environment, its requests run on a small runtime of its own so that a
//! reading thread of any kind (the pool, a reader's channel) can wait on them.

use super::{Fetch, Location, Object, GETS, GOT_BYTES};
use crate::sync::Locked;
use anyhow::{ensure, Context, Result};
use futures::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as Key;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};
use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, OnceLock};

/// The store of each bucket read so far, and the runtime their requests run on.
#[derive(Default)]
pub struct S3 {
    buckets: Mutex<HashMap<String, Arc<AmazonS3>>>,
    runtime: OnceLock<tokio::runtime::Runtime>,
}

impl S3 {
    fn bucket(&self, name: &str) -> Result<Arc<AmazonS3>> {
        let mut buckets = self.buckets.locked();
        if let Some(b) = buckets.get(name) {
            return Ok(b.clone());
        }
        // TLS for https endpoints, with ring (the process's one provider).
        let _ = rustls::crypto::ring::default_provider().install_default();
        // Retries within about the time a reader's answer is waited for.
        let retry = object_store::RetryConfig {
            max_retries: 4,
            retry_timeout: std::time::Duration::from_secs(6),
            ..Default::default()
        };
        // A request answers within the time a reader's answer is waited for (8 s); the rest
        // of the client's settings are the environment's (AWS_ALLOW_HTTP among them).
        use object_store::aws::AmazonS3ConfigKey::Client;
        use object_store::ClientConfigKey::{ConnectTimeout, Timeout};
        let store = AmazonS3Builder::from_env()
            .with_config(Client(ConnectTimeout), "2s")
            .with_config(Client(Timeout), "6s")
            .with_bucket_name(name)
            .with_retry(retry)
            .build()
            .with_context(|| format!("the S3 client for bucket {name:?} (AWS_* settings)"))?;
        let store = Arc::new(store);
        buckets.insert(name.to_string(), store.clone());
        Ok(store)
    }

    /// Runs `f` on the client's runtime and waits for it, from any thread (a tokio worker's
    /// included: the wait blocks the thread, never a runtime inside a runtime).
    fn run<T: Send + 'static>(
        &self,
        f: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T> {
        let rt = self.runtime.get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("larder-s3")
                .enable_all()
                .build()
                .expect("a runtime for the S3 client")
        });
        futures::executor::block_on(rt.spawn(f)).context("an S3 request's task")
    }
}

fn listed(bucket: &str, m: object_store::ObjectMeta) -> Object {
    Object {
        bucket: bucket.to_string(),
        key: m.location.to_string(),
        size: m.size,
        etag: m.e_tag,
    }
}

impl Fetch for S3 {
    fn list(&self, at: &Location) -> Result<Vec<Object>> {
        let store = self.bucket(&at.bucket)?;
        let (bucket, key) = (at.bucket.clone(), at.key.clone());
        let url = at.url_of(&at.key);
        self.run(async move {
            if !key.is_empty() {
                match store.head(&Key::parse(key.as_str())?).await {
                    Ok(m) => return Ok(vec![listed(&bucket, m)]),
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(anyhow::Error::new(e).context(format!("HEAD {url}"))),
                }
            }
            let prefix = (!key.is_empty())
                .then(|| Key::parse(key.as_str()))
                .transpose()?;
            let mut listing = store.list(prefix.as_ref());
            let mut out = vec![];
            while let Some(m) = listing.next().await {
                let m = m.with_context(|| format!("listing {url}"))?;
                out.push(listed(&bucket, m));
                ensure!(
                    out.len() <= super::MOST_OBJECTS,
                    "{url}: over {} objects",
                    super::MOST_OBJECTS
                );
            }
            out.sort_by(|a, b| a.key.cmp(&b.key));
            ensure!(!out.is_empty(), "{url}: no such object or prefix");
            Ok(out)
        })?
    }

    fn get(&self, object: &Object, offset: u64, len: u64) -> Result<Vec<u8>> {
        ensure!(
            len <= super::MOST_GET_BYTES,
            "a read of {len} bytes is over the {} one GET may ask",
            super::MOST_GET_BYTES
        );
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= object.size)
            .with_context(|| {
                format!(
                    "bytes {offset}..+{len} of {}, which has {}",
                    object.url(),
                    object.size
                )
            })?;
        if len == 0 {
            return Ok(vec![]);
        }
        let store = self.bucket(&object.bucket)?;
        let options = GetOptions {
            range: Some(GetRange::Bounded(offset..end)),
            if_match: object.etag.clone(),
            ..Default::default()
        };
        // As listed: parsed, never re-encoded (an encoded key names another object).
        let key = Key::parse(object.key.as_str())
            .with_context(|| format!("{}: not an object name", object.url()))?;
        let got = self.run(async move {
            let r = store.get_opts(&key, options).await?;
            r.bytes().await
        })?;
        // The kind of each failure: the object changed, or the store did not answer.
        GETS.fetch_add(1, Relaxed);
        let bytes = match got {
            Ok(b) => b,
            Err(object_store::Error::Precondition { .. }) => {
                return Err(super::changed(object, "its ETag is not the one listed"))
            }
            Err(object_store::Error::NotFound { .. }) => {
                return Err(super::changed(object, "it is gone"))
            }
            // Not the sample's fault: the stream ends (UNAVAILABLE) and the client resumes.
            Err(e) => {
                return Err(crate::error::Error::new(
                    crate::error::Kind::Reader,
                    format!(
                        "the object store did not serve {} bytes {offset}..{end}: {e}",
                        object.url()
                    ),
                )
                .into())
            }
        };
        GOT_BYTES.fetch_add(bytes.len() as u64, Relaxed);
        ensure!(
            bytes.len() as u64 == len,
            "GET {} bytes {offset}..{end} brought {} bytes",
            object.url(),
            bytes.len()
        );
        Ok(bytes.to_vec())
    }
}
