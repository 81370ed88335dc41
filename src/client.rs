//! Connecting to larderd from Rust (the CLI, the demo, the tests).

use crate::proto::larder_client::LarderClient;
use crate::proto::{Batch, StreamBatchesRequest};
use anyhow::{Context, Result};
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

pub type Client = LarderClient<Channel>;

/// Where clients look for the daemon unless told otherwise ($LARDER_ADDR, --addr): the Unix
/// socket of the systemd unit, where the daemon knows who is asking and batches can come in
/// shared memory.
pub const DEFAULT_ADDR: &str = "unix:/run/larder/larder.sock";

/// Connects to `addr`: "http://host:port", "host:port", or "unix:/path/to/socket".
pub async fn connect(addr: &str) -> Result<Client> {
    let channel = channel(addr).await?;
    Ok(LarderClient::new(channel).max_decoding_message_size(usize::MAX))
}

/// A channel to the daemon at `addr` (as `connect` takes it), for any of its services.
pub async fn channel(addr: &str) -> Result<tonic::transport::Channel> {
    let channel = if let Some(path) = addr.strip_prefix("unix:") {
        let path = std::path::PathBuf::from(path);
        Endpoint::try_from("http://localhost")?
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }))
            .await
    } else {
        let url = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        Endpoint::from_shared(url.clone())
            .with_context(|| format!("bad daemon address {addr:?}"))?
            .connect()
            .await
    }
    .with_context(|| {
        format!(
            "connecting to larderd at {addr}: no larder daemon there; is larderd running? \
             (systemctl status larderd; set LARDER_ADDR or --addr for another address)"
        )
    })?;
    Ok(channel)
}

/// Streams one request to its end and returns its batches.
/// A dataset still being opened (the daemon just started) is waited for, up to a minute.
pub async fn collect_batches(client: &mut Client, req: StreamBatchesRequest) -> Result<Vec<Batch>> {
    let started = std::time::Instant::now();
    let mut stream = loop {
        match client.stream_batches(req.clone()).await {
            Ok(s) => break s.into_inner(),
            Err(s) if being_opened(&s) && started.elapsed().as_secs() < 60 => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(s) => return Err(anyhow::Error::new(s).context("StreamBatches")),
        }
    };
    let mut batches = vec![];
    while let Some(b) = stream.message().await.context("reading the batch stream")? {
        batches.push(b);
    }
    Ok(batches)
}

/// Whether `status` says the dataset is still being opened (retry shortly).
pub fn being_opened(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable && status.message().contains("is being opened")
}
