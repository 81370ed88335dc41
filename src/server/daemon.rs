//! The daemon: opens the datasets, owns the tiers and serves the service on TCP and/or a Unix
//! socket until it is asked to stop.

use super::buffers::{MessageBuffers, SPARE_IDLE};
use super::health::HealthService;
use super::held_messages::CountedBody;
use super::reload::Datasets;
use super::service::Service;
use super::shm::{self, Rings};
use super::shutdown::{self, Shutdown, Trigger};
use crate::catalog::Catalog;
use crate::config::Config;
use crate::footprint::Footprint;
use crate::metrics::Metrics;
use crate::open_streams::Streams;
use crate::proto::health::health_server::HealthServer;
use crate::proto::larder_server::LarderServer;
use crate::store::Store;
use crate::tiers::memory::MemoryTier;
use crate::tiers::scratch::ScratchSpace;
use crate::user_datasets::Registry;
use anyhow::{Context, Result};
use futures::Stream;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tonic::body::Body;

/// A running daemon.
pub struct Daemon {
    /// The TCP address it listens on (with the real port when the config asked for port 0).
    pub tcp_addr: Option<SocketAddr>,
    pub unix_socket: Option<PathBuf>,
    pub catalog: Arc<Catalog>,
    pub store: Arc<Store>,
    /// Where it serves Prometheus's `/metrics` (`[metrics] listen`), and the task serving it.
    pub metrics_addr: Option<SocketAddr>,
    exporter: Option<JoinHandle<()>>,
    shutdown: Trigger,
    servers: Vec<JoinHandle<Result<()>>>,
    /// The memory watcher and the task that frees idle message buffers.
    watcher: JoinHandle<()>,
    trimmer: JoinHandle<()>,
    /// The datasets kept current (reload, retry, reopen), and the task that rechecks them.
    datasets: Datasets,
    keeper: JoinHandle<()>,
}

impl Daemon {
    /// Starts serving and returns once the config's datasets have been opened (or found not
    /// to open): tests and tools that stream at once.
    pub async fn start(config: Config) -> Result<Daemon> {
        let daemon = Daemon::listen(config).await?;
        daemon.datasets.reconcile().await;
        Ok(daemon)
    }

    /// Listens at once and opens the config's datasets in the background: a stream for one
    /// not open yet gets UNAVAILABLE ("being opened"), which clients retry. larderd does this,
    /// so a large image folder being walked keeps no one from the others.
    pub async fn listen(config: Config) -> Result<Daemon> {
        let catalog = Catalog::default();
        let mut sys = sysinfo::System::new();
        sys.refresh_memory();
        let total = sys.total_memory();
        let budget = config.budget_bytes(total);
        let floor = config.min_available_bytes(total);

        let metrics = Arc::new(Metrics::default());
        metrics.set_machine_available(sys.available_memory());
        let memory = Arc::new(MemoryTier::named(budget, config.memory.policy));
        let workers = config
            .preprocess_workers
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
        let scratch = &config.scratch;
        // A scratch tier configured and not usable stops the start: serving without it would
        // turn every epoch past the memory tier into a cold one, with a line in a log as the
        // only sign.
        let space = match scratch.enabled {
            false => None,
            true => Some(
                ScratchSpace::open(&scratch.dir, scratch.budget_bytes).with_context(|| {
                    format!(
                        "the scratch tier at {} (as uid {}): make the folder writable by the \
                         daemon's user (under the systemd unit, whose file system is read-only \
                         but for /var/cache/larder, a drop-in with ReadWritePaths={}: see \
                         docs/admin.md), or set [scratch] enabled = false",
                        scratch.dir.display(),
                        crate::access::euid(),
                        scratch.dir.display()
                    )
                })?,
            ),
        };
        let store = Store::new(
            memory.clone(),
            space,
            scratch.shard_bytes,
            metrics.clone(),
            workers,
        )?;
        // Every shard folder counts as idle until its dataset opens and takes it back.
        store.keep_unused_scratch();
        let streams = Streams::new(memory.clone(), metrics.clone());
        // The message path's share comes off the memory tier's: both stay within the budget.
        let message_bytes = config.message_bytes(budget);
        memory.hold_back(message_bytes);
        let buffers = Arc::new(MessageBuffers::within(
            config.memory.message_buffers_bytes,
            message_bytes,
        ));
        let release = {
            let buffers = buffers.clone();
            move || buffers.release()
        };
        let watcher = tokio::spawn(crate::tiers::watcher::watch_available_memory(
            memory.clone(),
            floor,
            Duration::from_millis(config.memory.watch_interval_ms.max(10)),
            metrics,
            release,
        ));
        let trimmer = tokio::spawn(trim_idle_buffers(buffers.clone()));
        // Every lookup recorded, for a benchmark that asked (see tiers/trace.rs).
        if let Some(path) = std::env::var_os("LARDER_TRACE") {
            store.trace_to(crate::tiers::trace::Trace::create(path.as_ref())?);
            tracing::info!(path = ?path, "recording every memory-tier lookup");
        }
        let catalog = Arc::new(catalog);
        let (shutdown, shutdown_rx) = shutdown::channel();
        tracing::info!(
            budget_bytes = budget,
            message_bytes,
            expansion_factor = config.memory.expansion_factor,
            "memory tier budget"
        );
        let state_dir = config.state_dir();
        if state_dir.is_none() {
            tracing::warn!("no state_dir: datasets users add are kept until the daemon stops");
        }
        let registry = Arc::new(Registry::load(state_dir.as_deref()));
        // What datasets and streams take outside the cache, inside the same budget.
        let (footprint_total, footprint_user) = config.footprint_limits(budget);
        let account = Footprint::new(footprint_total, footprint_user, Some(memory.clone()));
        let datasets = Datasets::new(
            catalog.clone(),
            store.clone(),
            config.datasets.clone(),
            registry.clone(),
            config.limits,
            (budget, config.memory.expansion_factor),
            account,
        );
        catalog.expect(&config.datasets);
        catalog.expect(&registry.configs());
        let keeper = tokio::spawn(datasets.clone().keep_current(shutdown.subscribe()));
        // The rings' bytes come off the memory tier's share: both stay within its budget.
        let rings = Rings::within(
            config.shm_budget_bytes(total),
            config.shm.user_bytes,
            memory.clone(),
        );
        let service = Service::new(
            store.clone(),
            rings.clone(),
            buffers.clone(),
            streams,
            datasets.clone(),
            &config,
            shutdown_rx,
        );
        let mut servers = vec![];
        let mut tcp_addr = None;
        let mut metrics_addr = None;
        let exporter = match &config.metrics.listen {
            Some(listen) => {
                let listener = tokio::net::TcpListener::bind(listen)
                    .await
                    .with_context(|| format!("listening for Prometheus on {listen}"))?;
                let addr = listener.local_addr()?;
                metrics_addr = Some(addr);
                let service = service.clone();
                let snapshot: crate::prometheus_metrics::Snapshot =
                    Arc::new(move || (service.stats(), service.streams_view(|_| true).streams));
                tracing::info!(%addr, "serving Prometheus metrics at /metrics");
                Some(tokio::spawn(crate::prometheus_metrics::serve(
                    listener, snapshot,
                )))
            }
            None => None,
        };

        if let Some(listen) = &config.listen {
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("listening on {listen}"))?;
            let addr = listener.local_addr()?;
            tcp_addr = Some(addr);
            let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
            servers.push(spawn_server(&service, &buffers, incoming, &shutdown, "TCP"));
            tracing::info!(%addr, "listening on TCP");
        }
        if let Some(path) = &config.unix_socket {
            let listener = bind_unix(path, config.unix_socket_mode)?;
            let connections = Connections {
                per_user: crate::access::connection::PerUser::new(
                    config.limits.connections_per_user,
                ),
                idle: Duration::from_secs(config.limits.idle_connection_seconds.max(1)),
            };
            let incoming = route_unix(listener, rings, connections, shutdown.subscribe());
            servers.push(spawn_server(
                &service,
                &buffers,
                incoming,
                &shutdown,
                "Unix socket",
            ));
            tracing::info!(path = %path.display(), "listening on Unix socket");
        }
        Ok(Daemon {
            tcp_addr,
            metrics_addr,
            exporter,
            unix_socket: config.unix_socket.clone(),
            catalog,
            store,
            shutdown,
            servers,
            watcher,
            trimmer,
            datasets,
            keeper,
        })
    }

    /// The handle that reloads the datasets (larderd calls it on SIGHUP).
    pub fn datasets(&self) -> Datasets {
        self.datasets.clone()
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
        self.shutdown.fire();
        self.wait().await
    }

    /// Waits until the servers stop (after `shutdown`, or when one fails).
    pub async fn wait(self) -> Result<()> {
        for s in self.servers {
            s.await.context("server task panicked")??;
        }
        self.watcher.abort();
        self.trimmer.abort();
        self.keeper.abort();
        if let Some(e) = &self.exporter {
            e.abort();
        }
        self.store.flush_trace();
        if let Some(p) = &self.unix_socket {
            let _ = std::fs::remove_file(p);
        }
        Ok(())
    }

    /// A handle that asks the daemon to shut down.
    pub fn shutdown_handle(&self) -> Trigger {
        self.shutdown.clone()
    }
}

/// Serves `service` on the connections `incoming` yields until the daemon shuts down, counting
/// the encoded messages in flight in `buffers`.
fn spawn_server<I, IO, IE>(
    service: &Service,
    buffers: &MessageBuffers,
    incoming: I,
    shutdown: &Trigger,
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
    // Encoded messages count in the daemon's memory until hyper has sent them.
    let encoded = buffers.encoded_counter();
    let count_sent = tower::util::MapResponseLayer::new(move |r: http::Response<Body>| {
        let encoded = encoded.clone();
        r.map(|body| Body::new(CountedBody::new(body, encoded)))
    });
    // Reflection in both versions clients speak (grpcurl and grpcio-reflection ask v1alpha).
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::DESCRIPTORS)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .expect("the descriptors compiled in are valid");
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .expect("the descriptors compiled in are valid");
    // A connection that asks something is no longer idle (see `access::connection`).
    let asked = tower::util::MapRequestLayer::new(|r: http::Request<Body>| {
        if let Some(p) = r.extensions().get::<crate::access::connection::PeerInfo>() {
            p.asked();
        }
        r
    });
    let router = tonic::transport::Server::builder()
        // A connection's calls at once: a client's streams and calls fit; a flood waits.
        .max_concurrent_streams(MAX_CALLS_PER_CONNECTION)
        .layer(asked)
        .layer(count_sent)
        .add_service(LarderServer::new(service.clone()).max_encoding_message_size(usize::MAX))
        .add_service(HealthServer::new(HealthService::new(service.clone())))
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let mut stop = shutdown.subscribe();
    tokio::spawn(async move {
        router
            .serve_with_incoming_shutdown(incoming, async move { stop.stopped().await })
            .await
            .with_context(|| format!("{transport} server failed"))
    })
}

/// The calls one connection may have in flight at once (HTTP/2 streams).
const MAX_CALLS_PER_CONNECTION: u32 = 128;

/// What one user's connections may hold: how many at once, and how long one that asks
/// nothing stays open.
struct Connections {
    per_user: Arc<crate::access::connection::PerUser>,
    idle: Duration,
}

/// The gRPC connections of a Unix listener: a connection that starts with a ring request is
/// served as one (shared memory for its process) and never reaches gRPC. A user's connection
/// past their limit is closed at once.
fn route_unix(
    listener: tokio::net::UnixListener,
    rings: Arc<Rings>,
    connections: Connections,
    mut stop: Shutdown,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<crate::access::connection::PeerStream>>
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        // Out of descriptors, usually: wait rather than spin.
                        tracing::warn!("accepting on the Unix socket: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                _ = stop.stopped() => return,
            };
            let Some(uid) = stream.peer_cred().ok().map(|c| c.uid()) else {
                continue;
            };
            let Some(held) = connections.per_user.admit(uid) else {
                tracing::warn!(
                    uid,
                    "a connection past the user's limit (limits.connections_per_user): closed"
                );
                continue;
            };
            let (tx, rings, stop, idle) =
                (tx.clone(), rings.clone(), stop.clone(), connections.idle);
            tokio::spawn(async move {
                match shm::is_ring_request(&stream).await {
                    Ok(true) => rings.serve(stream, stop).await,
                    Ok(false) => {
                        match crate::access::connection::PeerStream::new(stream, held, idle) {
                            Ok(stream) => {
                                let _ = tx.send(Ok(stream)).await;
                            }
                            Err(e) => {
                                tracing::warn!("who is at the other end of a connection: {e}")
                            }
                        }
                    }
                    Err(_) => {} // closed or silent before saying anything
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Keeps the message path and the allocator's freed pages within the path's share of the
/// memory budget, and an idle daemon holding none of either:
/// - every `alloc::PURGE_CHECK` it reads the pages the allocator holds freed, and gives them
///   back to the kernel when they, the spare buffers and the bytes in flight pass the share
///   (`$LARDER_PURGE_MS` sets the interval, 0 leaves them to the allocator's decay alone);
/// - every second it has the C libraries' allocator (HDF5's, libjpeg's) give back what they
///   freed;
/// - every `SPARE_IDLE` / 4 it frees the spares unused for `SPARE_IDLE`.
async fn trim_idle_buffers(buffers: Arc<MessageBuffers>) {
    let purge = match std::env::var("LARDER_PURGE_MS")
        .ok()
        .map(|v| v.parse::<u64>())
    {
        Some(Ok(0)) => None,
        Some(Ok(ms)) => Some(Duration::from_millis(ms)),
        _ => Some(crate::alloc::PURGE_CHECK),
    };
    let tick = purge.unwrap_or(Duration::from_secs(1));
    let mut ticker = tokio::time::interval(tick);
    let per = |every: Duration| (every.as_millis() / tick.as_millis().max(1)).max(1) as u64;
    let (trim_every, c_every) = (per(SPARE_IDLE / 4), per(Duration::from_secs(1)));
    let mut ticks = 0u64;
    loop {
        ticker.tick().await;
        ticks += 1;
        if purge.is_some() {
            let held = buffers.bytes().0 + buffers.in_flight() + crate::alloc::free_bytes();
            if held > buffers.cap() {
                crate::alloc::give_back();
            }
        }
        if ticks.is_multiple_of(c_every) {
            crate::alloc::trim_c_heap();
        }
        if ticks.is_multiple_of(trim_every) {
            let before = buffers.bytes().0;
            buffers.trim(SPARE_IDLE);
            if buffers.bytes().0 < before {
                crate::alloc::give_back();
            }
        }
    }
}

fn bind_unix(path: &std::path::Path, mode: u32) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| {
            format!(
                "creating the socket's folder {} (as uid {}; set unix_socket in the config to \
                 a path in a folder the daemon may write)",
                dir.display(),
                crate::access::euid()
            )
        })?;
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
    // Bound under a temporary name, given its mode, then renamed into place: the socket
    // appears at `path` with its mode already set (a client never meets it half made).
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let bound = path.with_file_name(format!(".{name}.{}", std::process::id()));
    let _ = std::fs::remove_file(&bound);
    let listener = tokio::net::UnixListener::bind(&bound).map_err(|e| {
        let who = crate::access::euid();
        let fix = match e.kind() {
            std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem => {
                format!(
                    ": the daemon (uid {who}) may not create files in {}; make that folder \
                     writable by it, or set unix_socket in the config to a path in a folder it \
                     may write (the package's unit has systemd make /run/larder for it)",
                    path.parent().unwrap_or(path).display()
                )
            }
            _ => String::new(),
        };
        anyhow::anyhow!(e).context(format!("listening on Unix socket {}{fix}", path.display()))
    })?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&bound, std::fs::Permissions::from_mode(mode))
        .and_then(|()| std::fs::rename(&bound, path))
        .with_context(|| format!("setting the mode of {}", path.display()))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&bound);
        })?;
    Ok(listener)
}
