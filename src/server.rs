//! The gRPC service and the daemon that runs it on TCP and/or a Unix socket.

use crate::catalog::{Catalog, Dataset};
use crate::config::Config;
use crate::memory::{self, MemoryTier};
use crate::metrics::Metrics;
use crate::proto::larder_server::{Larder, LarderServer};
use crate::proto::{
    Batch, DatasetInfo, GetStatsRequest, ListDatasetsRequest, ListDatasetsResponse, Stats,
    StreamBatchesRequest, WarmProgress, WarmRequest,
};
use crate::sampler::{Plan, PlanRequest};
use crate::store::Store;
use anyhow::{Context, Result};
use bytes::BytesMut;
use futures::{Stream, StreamExt};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tonic::{Request, Response, Status};

/// Largest batch, in bytes, one message may carry.
pub const MAX_BATCH_BYTES: u64 = 256 << 20;

#[derive(Clone)]
pub struct Service {
    catalog: Arc<Catalog>,
    store: Arc<Store>,
    prefetch_batches: usize,
    max_batch_size: u32,
    expansion_factor: f64,
    /// Becomes true when the daemon shuts down: open streams end with UNAVAILABLE.
    shutdown: watch::Receiver<bool>,
}

impl Service {
    pub fn new(
        catalog: Arc<Catalog>,
        store: Arc<Store>,
        config: &Config,
        shutdown: watch::Receiver<bool>,
    ) -> Service {
        Service {
            shutdown,
            catalog,
            store,
            prefetch_batches: config.prefetch_batches,
            max_batch_size: config.max_batch_size,
            expansion_factor: config.memory.expansion_factor,
        }
    }

    fn dataset(&self, name: &str) -> Result<Arc<Dataset>, Status> {
        self.catalog.get(name).ok_or_else(|| {
            Status::not_found(format!(
                "unknown dataset {name:?}; this daemon serves: {}",
                self.catalog.names().join(", ")
            ))
        })
    }

    fn plan(&self, req: &StreamBatchesRequest) -> Result<(Arc<Dataset>, Plan), Status> {
        let ds = self.dataset(&req.dataset)?;
        if req.batch_size > self.max_batch_size {
            return Err(Status::invalid_argument(format!(
                "batch_size {} is larger than the daemon's max_batch_size {}",
                req.batch_size, self.max_batch_size
            )));
        }
        let batch_bytes = req.batch_size as u64 * ds.sample_bytes;
        if batch_bytes > MAX_BATCH_BYTES {
            return Err(Status::invalid_argument(format!(
                "batch_size {} makes batches of {batch_bytes} bytes; the limit is {MAX_BATCH_BYTES}",
                req.batch_size
            )));
        }
        let plan = Plan::new(PlanRequest {
            num_samples: ds.len(),
            batch_size: req.batch_size,
            seed: req.seed,
            epoch: req.epoch,
            rank: req.rank,
            world_size: req.world_size,
            start_batch: req.start_batch,
            shuffle: !req.sequential,
            drop_last: req.drop_last,
        })
        .map_err(|e| Status::invalid_argument(format!("{e:#}")))?;
        Ok((ds, plan))
    }
}

/// Reads the samples of batch `b` through the store and packs them into one uint8 tensor.
async fn assemble(store: &Arc<Store>, ds: &Arc<Dataset>, plan: &Plan, b: u64) -> Result<Batch> {
    let ids = plan.batch(b);
    let samples = futures::future::try_join_all(ids.iter().map(|&i| store.get(ds, i))).await?;
    let mut data = BytesMut::with_capacity(ids.len() * ds.sample_bytes as usize);
    for (s, &i) in samples.iter().zip(ids) {
        anyhow::ensure!(
            s.len() as u64 == ds.sample_bytes,
            "sample {i} of {:?} has {} bytes, expected {}",
            ds.name,
            s.len(),
            ds.sample_bytes
        );
        data.extend_from_slice(s);
    }
    let mut shape = vec![ids.len() as u32];
    shape.extend_from_slice(&ds.shape);
    let labels = match ds.source.labels() {
        Some(_) => ids.iter().filter_map(|&i| ds.label(i)).collect(),
        None => vec![],
    };
    Ok(Batch {
        batch_index: b,
        num_batches: plan.num_batches,
        shape,
        data: data.freeze(),
        labels,
        sample_ids: ids.to_vec(),
    })
}

type BatchStream = Pin<Box<dyn Stream<Item = Result<Batch, Status>> + Send>>;

#[tonic::async_trait]
impl Larder for Service {
    async fn list_datasets(
        &self,
        _: Request<ListDatasetsRequest>,
    ) -> Result<Response<ListDatasetsResponse>, Status> {
        let datasets: Vec<DatasetInfo> = self.catalog.iter().map(|d| d.info()).collect();
        Ok(Response::new(ListDatasetsResponse { datasets }))
    }

    async fn get_stats(&self, _: Request<GetStatsRequest>) -> Result<Response<Stats>, Status> {
        let mem = self.store.memory.snapshot();
        let scratch = self
            .catalog
            .scratch
            .as_ref()
            .map(|s| s.snapshot())
            .unwrap_or_default();
        Ok(Response::new(Stats {
            memory_bytes: mem.bytes,
            memory_budget_bytes: mem.limit,
            memory_entries: mem.entries,
            admissions_declined: mem.declined,
            measured_expansion_factor: if mem.disk_bytes == 0 {
                0.0
            } else {
                mem.bytes as f64 / mem.disk_bytes as f64
            },
            planned_expansion_factor: self.expansion_factor,
            scratch_bytes: scratch.used,
            scratch_budget_bytes: scratch.budget,
            scratch_corrupt_records: scratch.corrupt,
            scratch_paused: scratch.paused.unwrap_or_default(),
            ..self.store.metrics.to_proto()
        }))
    }

    type WarmStream = Pin<Box<dyn Stream<Item = Result<WarmProgress, Status>> + Send>>;

    async fn warm(
        &self,
        request: Request<WarmRequest>,
    ) -> Result<Response<Self::WarmStream>, Status> {
        let ds = self.dataset(&request.into_inner().dataset)?;
        if ds.scratch.is_none() {
            return Err(Status::failed_precondition(format!(
                "dataset {:?} has no scratch tier (scratch.enabled is false or its directory is unusable; see the daemon's log)",
                ds.name
            )));
        }
        let (progress_tx, mut progress_rx) = mpsc::channel(16);
        let (tx, rx) = mpsc::channel(16);
        let store = self.store.clone();
        let mut shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            tracing::info!(dataset = %ds.name, "warming the scratch tier");
            let warm = store.warm(&ds, progress_tx);
            tokio::pin!(warm);
            // Forward progress until warming ends; its result goes last.
            let result = loop {
                tokio::select! {
                    result = &mut warm => break result,
                    _ = until_stopped(&mut shutdown) => {
                        let _ = tx.send(Err(shutting_down())).await;
                        return;
                    }
                    Some(p) = progress_rx.recv() => {
                        if tx.send(Ok(to_proto(p))).await.is_err() {
                            tracing::info!(dataset = %ds.name, "warm cancelled by the client");
                            return;
                        }
                    }
                }
            };
            while let Ok(p) = progress_rx.try_recv() {
                let _ = tx.send(Ok(to_proto(p))).await;
            }
            match result {
                Ok(p) => {
                    tracing::info!(dataset = %ds.name, written = p.written, present = p.present, "scratch tier warm");
                    let _ = tx.send(Ok(to_proto(p))).await;
                }
                Err(e) => {
                    tracing::warn!(dataset = %ds.name, "warming failed: {e:#}");
                    let _ = tx
                        .send(Err(Status::resource_exhausted(format!("{e:#}"))))
                        .await;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    type StreamBatchesStream = BatchStream;

    async fn stream_batches(
        &self,
        request: Request<StreamBatchesRequest>,
    ) -> Result<Response<BatchStream>, Status> {
        let req = request.into_inner();
        let (ds, plan) = self.plan(&req)?;
        tracing::info!(
            dataset = %ds.name, batch_size = req.batch_size, seed = req.seed, epoch = req.epoch,
            rank = req.rank, world_size = req.world_size, start_batch = req.start_batch,
            batches = plan.num_batches, "stream opened"
        );
        let guard = self.store.open_stream(plan.remaining_samples());
        let (plan_start, plan_end) = (plan.start_batch, plan.num_batches);
        let store = self.store.clone();
        let prefetch = self.prefetch_batches;
        let shutdown = self.shutdown.clone();
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            let _guard = guard;
            let started = Instant::now();
            let plan = Arc::new(plan);
            // Assemble up to `prefetch` batches ahead of the client, in order.
            let mut batches = futures::stream::iter(plan.start_batch..plan.num_batches)
                .map(|b| {
                    let (store, ds, plan) = (store.clone(), ds.clone(), plan.clone());
                    async move { assemble(&store, &ds, &plan, b).await }
                })
                .buffered(prefetch);
            let mut shutdown = shutdown;
            loop {
                let result = tokio::select! {
                    next = batches.next() => match next {
                        Some(result) => result,
                        None => break,
                    },
                    _ = until_stopped(&mut shutdown) => {
                        let _ = tx.send(Err(shutting_down())).await;
                        return;
                    }
                };
                let failed = result.is_err();
                let item = result.map_err(|e| {
                    tracing::error!(dataset = %ds.name, "stream failed: {e:#}");
                    Status::internal(format!("{e:#}"))
                });
                if tx.send(item).await.is_err() {
                    tracing::info!(dataset = %ds.name, "client went away; stream closed");
                    return;
                }
                if failed {
                    return;
                }
            }
            tracing::info!(dataset = %ds.name, seconds = started.elapsed().as_secs_f64(), "stream finished");
        });
        let metered = MeteredStream {
            rx,
            metrics: self.store.metrics.clone(),
            waiting_since: None,
            next_batch: plan_start,
            num_batches: plan_end,
            stalled: Duration::ZERO,
            opened: Instant::now(),
            name: format!(
                "{} rank {}/{} epoch {}",
                req.dataset,
                req.rank,
                req.world_size.max(1),
                req.epoch
            ),
        };
        Ok(Response::new(Box::pin(metered)))
    }
}

fn shutting_down() -> Status {
    Status::unavailable("larderd is shutting down; reconnect and resume from the next batch")
}

fn to_proto(p: crate::store::WarmProgress) -> WarmProgress {
    WarmProgress {
        done: p.done,
        total: p.total,
        written: p.written,
        present: p.present,
    }
}

/// Counts the time the outgoing stream waits for a batch that is not ready (client stall),
/// and the batches it hands on.
struct MeteredStream {
    rx: mpsc::Receiver<Result<Batch, Status>>,
    metrics: Arc<Metrics>,
    waiting_since: Option<Instant>,
    /// The batch the client gets next, and the end of the epoch: a stream that ends before it
    /// ends with an error, never as if the epoch were complete.
    next_batch: u64,
    num_batches: u64,
    /// This stream's stall time so far, logged when it closes.
    stalled: Duration,
    opened: Instant,
    name: String,
}

impl Drop for MeteredStream {
    fn drop(&mut self) {
        let open = self.opened.elapsed().as_secs_f64();
        let stalled = self.stalled.as_secs_f64();
        tracing::info!(
            stream = %self.name,
            open_seconds = open,
            stall_seconds = stalled,
            "stream closed; the client waited on larder {:.0}% of the time",
            if open > 0.0 { stalled / open * 100.0 } else { 0.0 }
        );
    }
}

impl Stream for MeteredStream {
    type Item = Result<Batch, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        match self.rx.poll_recv(cx) {
            Poll::Pending => {
                self.waiting_since.get_or_insert_with(Instant::now);
                Poll::Pending
            }
            Poll::Ready(item) => {
                if let Some(since) = self.waiting_since.take() {
                    let waited = since.elapsed();
                    self.stalled += waited;
                    self.metrics.record_stall(waited);
                }
                match &item {
                    Some(Ok(b)) => {
                        self.next_batch = b.batch_index + 1;
                        self.metrics
                            .record_batch(b.sample_ids.len() as u64, b.data.len() as u64);
                    }
                    Some(Err(_)) => self.next_batch = self.num_batches, // the error says why
                    None if self.next_batch < self.num_batches => {
                        let missing = self.next_batch;
                        self.next_batch = self.num_batches;
                        tracing::error!(stream = %self.name, batch = missing, "stream producer stopped early");
                        return Poll::Ready(Some(Err(Status::internal(format!(
                            "larderd stopped this stream before batch {missing} of {}; resume from it",
                            self.num_batches
                        )))));
                    }
                    None => {}
                }
                Poll::Ready(item)
            }
        }
    }
}

/// A running daemon.
pub struct Daemon {
    /// The TCP address it listens on (with the real port when the config asked for port 0).
    pub tcp_addr: Option<SocketAddr>,
    pub unix_socket: Option<PathBuf>,
    pub catalog: Arc<Catalog>,
    pub store: Arc<Store>,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<Result<()>>>,
    watcher: JoinHandle<()>,
}

impl Daemon {
    /// Opens the datasets and starts serving.
    pub async fn start(config: Config) -> Result<Daemon> {
        let catalog = Catalog::open(&config.datasets, &config.scratch)?;
        Daemon::start_with_catalog(config, catalog).await
    }

    pub async fn start_with_catalog(config: Config, catalog: Catalog) -> Result<Daemon> {
        let mut sys = sysinfo::System::new();
        sys.refresh_memory();
        let total = sys.total_memory();
        let budget = config.budget_bytes(total);
        let floor = config.min_available_bytes(total);
        log_capacity_plan(&catalog, budget, config.memory.expansion_factor);

        let metrics = Arc::new(Metrics::default());
        metrics.set_machine_available(sys.available_memory());
        let memory = Arc::new(MemoryTier::new(budget));
        let workers = config
            .preprocess_workers
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
        let store = Store::new(memory.clone(), metrics.clone(), workers);
        let watcher = tokio::spawn(memory::watch_available_memory(
            memory,
            floor,
            Duration::from_millis(config.memory.watch_interval_ms.max(10)),
            metrics,
        ));
        let catalog = Arc::new(catalog);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let service = Service::new(catalog.clone(), store.clone(), &config, shutdown_rx);
        let mut servers = vec![];
        let mut tcp_addr = None;

        if let Some(listen) = &config.listen {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("listening on {listen}"))?;
            let addr = listener.local_addr()?;
            tcp_addr = Some(addr);
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            servers.push(spawn_server(&service, incoming, &shutdown, "TCP"));
            tracing::info!(%addr, "listening on TCP");
        }
        if let Some(path) = &config.unix_socket {
            let listener = bind_unix(path, config.unix_socket_mode)?;
            let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
            servers.push(spawn_server(&service, incoming, &shutdown, "Unix socket"));
            tracing::info!(path = %path.display(), "listening on Unix socket");
        }
        Ok(Daemon {
            tcp_addr,
            unix_socket: config.unix_socket.clone(),
            catalog,
            store,
            shutdown,
            servers,
            watcher,
        })
    }

    /// The address a client should connect to: TCP if it listens there, else the Unix socket.
    pub fn client_addr(&self) -> String {
        match (&self.tcp_addr, &self.unix_socket) {
            (Some(a), _) => format!("http://{a}"),
            (None, Some(p)) => format!("unix:{}", p.display()),
            (None, None) => unreachable!("the config requires a listener"),
        }
    }

    /// Stops accepting, lets open streams end, and waits for the servers.
    pub async fn shutdown(self) -> Result<()> {
        let _ = self.shutdown.send(true);
        self.wait().await
    }

    /// Waits until the servers stop (after `shutdown`, or when one fails).
    pub async fn wait(self) -> Result<()> {
        for s in self.servers {
            s.await.context("server task panicked")??;
        }
        self.watcher.abort();
        if let Some(p) = &self.unix_socket {
            let _ = std::fs::remove_file(p);
        }
        Ok(())
    }

    /// A handle that asks the daemon to shut down.
    pub fn shutdown_handle(&self) -> watch::Sender<bool> {
        self.shutdown.clone()
    }
}

/// Serves `service` on the connections `incoming` yields until the daemon shuts down.
fn spawn_server<I, IO, IE>(
    service: &Service,
    incoming: I,
    shutdown: &watch::Sender<bool>,
    transport: &'static str,
) -> JoinHandle<Result<()>>
where
    I: Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IO::ConnectInfo: Clone + Send + Sync + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    let router = tonic::transport::Server::builder()
        .add_service(LarderServer::new(service.clone()).max_encoding_message_size(usize::MAX));
    let mut stop = shutdown.subscribe();
    tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(incoming, async move { until_stopped(&mut stop).await })
            .await
            .with_context(|| format!("{transport} server failed"))
    })
}

/// Resolves once the daemon is shutting down.
async fn until_stopped(rx: &mut watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

fn bind_unix(path: &std::path::Path, mode: u32) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating socket directory {}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        anyhow::ensure!(
            meta.file_type().is_socket(),
            "{} exists and is not a socket; refusing to replace it",
            path.display()
        );
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            anyhow::bail!("another daemon is already listening on {}", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("listening on Unix socket {}", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))?;
    Ok(listener)
}

/// Logs, per dataset, how much of it the memory budget holds, planning with the expansion factor.
fn log_capacity_plan(catalog: &Catalog, budget: u64, expansion_factor: f64) {
    tracing::info!(
        budget_bytes = budget,
        expansion_factor,
        "memory tier budget"
    );
    for ds in catalog.iter() {
        let disk = ds.source.disk_bytes();
        let planned = (disk as f64 * expansion_factor) as u64;
        let fraction = if planned == 0 {
            1.0
        } else {
            (budget as f64 / planned as f64).min(1.0)
        };
        tracing::info!(
            dataset = %ds.name,
            samples = ds.len(),
            disk_bytes = disk,
            planned_memory_bytes = planned,
            "capacity plan: the memory tier holds about {:.0}% of this dataset",
            fraction * 100.0
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metered(rx: mpsc::Receiver<Result<Batch, Status>>, start: u64, end: u64) -> MeteredStream {
        MeteredStream {
            rx,
            metrics: Arc::new(Metrics::default()),
            waiting_since: None,
            next_batch: start,
            num_batches: end,
            stalled: Duration::ZERO,
            opened: Instant::now(),
            name: "test".into(),
        }
    }

    fn batch(i: u64) -> Result<Batch, Status> {
        Ok(Batch {
            batch_index: i,
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn a_stream_cut_short_ends_with_an_error_not_as_complete() {
        let (tx, rx) = mpsc::channel(4);
        tx.send(batch(2)).await.unwrap();
        drop(tx); // the producer is gone after batch 2 of 5
        let items: Vec<_> = metered(rx, 2, 5).collect().await;
        assert_eq!(items.len(), 2);
        let err = items[1].as_ref().unwrap_err();
        assert_eq!(err.code(), tonic::Code::Internal);
        assert!(
            err.message().contains("before batch 3 of 5"),
            "{}",
            err.message()
        );

        let (tx, rx) = mpsc::channel(4);
        tx.send(batch(3)).await.unwrap();
        tx.send(batch(4)).await.unwrap();
        drop(tx);
        let items: Vec<_> = metered(rx, 3, 5).collect().await;
        assert!(
            items.iter().all(|i| i.is_ok()),
            "a complete stream ends cleanly"
        );
    }
}
