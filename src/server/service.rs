//! The gRPC handlers: validation, the datasets, stats, warming, and opening streams. Handlers
//! hold shared state only.

use super::admission::admit;
use super::batch_stream::{MeteredStream, Producer, Selection};
use super::buffers::MessageBuffers;
use super::layout::slot_offsets;
use super::reload::Datasets;
use super::shm::{Peer, Ring, Rings};
use super::shutdown::{shutting_down, Shutdown};
use crate::access::{Caller, Proofs};
use crate::catalog::{Catalog, Dataset, PipelineKind};
use crate::config::Config;
use crate::error::{bad_request, precondition, quote, Error, Kind};
use crate::input_bound::ClientReport;
use crate::open_streams::{StreamSpec, Streams};
use crate::proto::larder_server::Larder;
use crate::proto::{
    AddDatasetRequest, AddDatasetResponse, ApiVersion, BadSample, Batch, DaemonInfo, DatasetInfo,
    GetInfoRequest, GetStatsRequest, ListBadSamplesRequest, ListBadSamplesResponse,
    ListDatasetsRequest, ListDatasetsResponse, ListStreamsRequest, ListStreamsResponse,
    RemoveDatasetRequest, RemoveDatasetResponse, ReportInputRequest, SourceKindRequest,
    SourceKindResponse, Stats, StreamBatchesRequest, StreamInfo, StreamPlan, UnavailableDataset,
    VariableLayout, WarmProgress, WarmRequest,
};
use crate::sampler::{Correlated, NodeSplit, OrderForm, Plan, PlanRequest, DEFAULT_PARTITIONS};
use crate::store::{no_scratch, Store};
use futures::Stream;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

/// The oldest client API the daemon serves in full: clients of API 1 (before GetInfo) use no
/// call or field the daemon has since dropped.
const MIN_CLIENT_API_VERSION: u32 = 1;

#[derive(Clone)]
pub struct Service {
    catalog: Arc<Catalog>,
    store: Arc<Store>,
    prefetch_batches: usize,
    max_batch_size: u32,
    expansion_factor: f64,
    /// Shared-memory rings of clients on the Unix socket.
    rings: Arc<Rings>,
    /// Buffers for batches sent in messages, reused between batches.
    buffers: Arc<MessageBuffers>,
    /// The open streams.
    streams: Arc<Streams>,
    /// Access checks passed lately, which ListDatasets reuses.
    proofs: Arc<Proofs>,
    /// Reopens datasets whose files changed.
    datasets: Datasets,
    /// Becomes true when the daemon shuts down: open streams end with UNAVAILABLE.
    shutdown: Shutdown,
    /// Streams' plans, charged to who opens them and built in their turn.
    planning: Arc<super::planning::Planning>,
}

impl Service {
    pub fn new(
        store: Arc<Store>,
        rings: Arc<Rings>,
        buffers: Arc<MessageBuffers>,
        streams: Arc<Streams>,
        datasets: Datasets,
        config: &Config,
        shutdown: Shutdown,
    ) -> Service {
        Service {
            planning: Arc::new(super::planning::Planning::new(
                datasets.account().clone(),
                config.limits.plans_per_user,
            )),
            catalog: datasets.catalog().clone(),
            datasets,
            shutdown,
            proofs: Default::default(),
            rings,
            buffers,
            streams,
            store,
            prefetch_batches: config.prefetch_batches,
            max_batch_size: config.max_batch_size,
            expansion_factor: config.memory.expansion_factor,
        }
    }

    /// The registry of open streams.
    pub fn streams(&self) -> Arc<Streams> {
        self.streams.clone()
    }

    /// A stream as `ListStreams` and `ReportInput` show it, judged (see `input_bound`) with the
    /// pool's busy share `pool_busy`.
    fn stream_info(&self, s: &crate::open_streams::StreamSnapshot, pool_busy: f64) -> StreamInfo {
        let open = s.open.as_secs_f64();
        // Without a fresh report from the client, the daemon's own measure, over the client
        // process's streams of the last minute (a job's epochs are streams of their own).
        let (run_open, run_wait) = self.streams.run_totals(s.spec.peer);
        let daemon = (s.open + run_open, s.stalled + run_wait);
        let j = crate::input_bound::judge(&s.spec.dataset, s.report, daemon, s.mix, pool_busy);
        let per_second = |n: u64| if open > 0.0 { n as f64 / open } else { 0.0 };
        StreamInfo {
            id: s.id,
            dataset: s.spec.dataset.clone(),
            user: s.spec.peer.map_or_else(
                || "tcp".to_string(),
                |p| crate::access::name_of_user(p.uid).unwrap_or_else(|| p.uid.to_string()),
            ),
            pid: s.spec.peer.and_then(|p| p.pid).unwrap_or(0),
            rank: s.spec.rank,
            world_size: s.spec.world_size.max(1),
            epoch: s.spec.epoch,
            batches: s.batches,
            num_batches: s.spec.plan.num_batches,
            samples: s.samples,
            open_seconds: open,
            wait_seconds: s.report.map_or(s.stalled, |r| r.wait).as_secs_f64(),
            wait_ratio: j.wait_ratio,
            verdict: j.verdict.to_string(),
            shm: s.spec.shm,
            job: s.job.clone(),
            measured_by_client: j.measured_by_client,
            samples_per_second: per_second(s.samples),
            bytes_per_second: per_second(s.bytes),
            memory_samples: s.mix[0],
            scratch_samples: s.mix[1],
            raw_samples: s.mix[2],
            cause: j.cause.to_string(),
            advice: j.advice,
            ready_batches: s.ready,
            input_bound_above: crate::input_bound::INPUT_BOUND,
            compute_bound_below: crate::input_bound::COMPUTE_BOUND,
        }
    }

    /// The open streams `shown` picks, as `ListStreams` answers (the others counted), with
    /// the pool's busy share.
    pub fn streams_view(
        &self,
        shown: impl Fn(&crate::open_streams::StreamSnapshot) -> bool,
    ) -> ListStreamsResponse {
        let pool_busy = self.store.pool_busy(crate::input_bound::WINDOW);
        let mut response = ListStreamsResponse {
            pool_busy,
            ..Default::default()
        };
        for s in self.streams.snapshot() {
            if shown(&s) {
                response.streams.push(self.stream_info(&s, pool_busy));
            } else {
                response.others += 1;
            }
        }
        response
    }

    /// Whether `who` may read `ds`, as listings show it: a recent proof, else a check made now
    /// (which is recorded; a proof is renewed only by a check made now, never by its reuse).
    async fn may_read(&self, ds: &Arc<Dataset>, who: &Caller) -> bool {
        let root = stamped_root(ds);
        if self.proofs.fresh(who, ds.id, root) {
            return true;
        }
        let ok = admit(ds, who).await.is_ok();
        if ok {
            self.proofs.record(who, ds.id, root);
        }
        ok
    }

    /// The daemon's counters and its memory in one account, as of now (what GetStats answers
    /// and what the exporter reads).
    pub fn stats(&self) -> Stats {
        let (mem, scratch) = self.store.stats();
        let (shm_rings, shm_bytes, shm_budget_bytes) = self.rings.snapshot();
        let (spare, in_flight) = (self.buffers.bytes().0, self.buffers.in_flight());
        let process = crate::alloc::footprint();
        let allocator_free = crate::alloc::free_bytes();
        let account = self.datasets.account();
        let (footprint, (footprint_limit, user_footprint_limit)) =
            (account.total(), account.limits());
        Stats {
            footprint_bytes: footprint,
            footprint_limit_bytes: footprint_limit,
            user_footprint_limit_bytes: user_footprint_limit,
            memory_bytes: mem.bytes,
            memory_budget_bytes: mem.limit,
            memory_entries: mem.entries,
            admissions_declined: mem.declined,
            memory_policy: mem.policy.to_string(),
            memory_policy_bytes: mem.policy_bytes,
            memory_policy_seconds: mem.policy_seconds,
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
            shm_rings,
            shm_bytes,
            shm_budget_bytes,
            bad_samples: self.catalog.all().iter().map(|d| d.bad_count()).sum(),
            message_buffer_spare_bytes: spare,
            message_buffer_in_flight_bytes: in_flight,
            accounted_bytes: mem.bytes + shm_bytes + spare + in_flight + footprint,
            resident_bytes: process.resident,
            anonymous_bytes: process.anonymous,
            shared_bytes: process.shared,
            allocator_free_bytes: allocator_free,
            // The budget holds the tier and the message path's share; the path may pass its
            // share by the batches streams' clients wait for.
            anonymous_ceiling_bytes: mem.budget.max(footprint)
                + (spare + in_flight).saturating_sub(self.buffers.cap())
                + allocator_free
                + crate::alloc::UNACCOUNTED_ALLOWANCE,
            pool_busy: self.store.pool_busy(crate::input_bound::WINDOW),
            memory_configured_budget_bytes: mem.budget,
            message_budget_bytes: self.buffers.cap(),
            datasets: self
                .catalog
                .all()
                .iter()
                .map(|d| crate::proto::DatasetStats {
                    dataset: d.name.clone(),
                    tiers: d.lookups.to_proto(),
                    bad_samples: d.bad_count(),
                })
                .collect(),
            pool_threads: self.store.pool_threads() as u32,
            ..self.store.metrics.to_proto()
        }
    }

    /// The dataset a request names, as its files are now: one whose files changed since it
    /// was opened (an HDF5 file rewritten, images added or removed) is opened again first, so
    /// every epoch starts on the data as it is.
    async fn dataset(&self, name: &str, who: &Caller) -> Result<Arc<Dataset>, Status> {
        let ds = self.named(name, who)?;
        if ds.source.changed().is_none() {
            return Ok(ds);
        }
        drop(ds); // the old version closes once nothing holds it
        self.datasets.reconcile_for(name).await;
        let ds = self.named(name, who)?;
        if let Some(why) = ds.source.changed() {
            return Err(
                Error::new(Kind::Changed, format!("dataset {}: {why}", quote(name))).into(),
            );
        }
        Ok(ds)
    }

    /// Whether `who` added dataset `name` (`larder add`): they are told why it does not open.
    /// Dataset `name` as `who` may know of it: Some(true) served, Some(false) listed to them
    /// but not served now (being opened, its open failed, or its reader failed and has not
    /// started again), None: no dataset of that name they may see (the same rule as
    /// ListDatasets).
    pub(super) async fn dataset_serving(&self, who: &Caller, name: &str) -> Option<bool> {
        if let Some(ds) = self.catalog.get(name) {
            if !self.may_read(&ds, who).await {
                return None;
            }
            // A user's dataset whose reader failed is not served until it starts again.
            let down = ds.source.prepared().and_then(|p| p.down());
            return Some(down.is_none());
        }
        let listed = self.catalog.unavailable().iter().any(|(n, _)| n == name);
        (listed && (who.is_admin() || self.owns(who, name))).then_some(false)
    }

    /// Told when the daemon shuts down.
    pub(super) fn shutdown(&self) -> Shutdown {
        self.shutdown.clone()
    }

    fn owns(&self, who: &Caller, name: &str) -> bool {
        let Caller::Local(id) = who else {
            return false;
        };
        self.datasets
            .registry()
            .get(name)
            .is_some_and(|e| e.owner == id.uid)
    }

    /// Whether `who` added dataset `name` or its `allow` grants them.
    fn shared_with(&self, who: &Caller, name: &str) -> bool {
        let Caller::Local(id) = who else {
            return false;
        };
        let Some(entry) = self.datasets.registry().get(name) else {
            return false;
        };
        entry.owner == id.uid
            || crate::user_datasets::parse(&entry).is_ok_and(|c| {
                c.allow
                    .iter()
                    .filter_map(|g| crate::access::Grant::parse(g).ok())
                    .any(|g| g.grants(id))
            })
    }

    /// The dataset a request names, if `who` may have it: a proof younger than `PROOF_TTL`
    /// whose root has not changed (a job's ranks and workers starting an epoch together check
    /// once), else checked now, as them.
    async fn admitted(&self, name: &str, who: &Caller) -> Result<Arc<Dataset>, Status> {
        Ok(self.admitted_since(name, who).await?.0)
    }

    /// `admitted`, and when the check it rests on was made (a stream checks again a
    /// `PROOF_TTL` after it, not after its own start).
    async fn admitted_since(
        &self,
        name: &str,
        who: &Caller,
    ) -> Result<(Arc<Dataset>, std::time::Instant), Status> {
        let ds = self.dataset(name, who).await?;
        let root = stamped_root(&ds);
        if let Some(at) = self.proofs.made(who, ds.id, root) {
            return Ok((ds, at));
        }
        let at = std::time::Instant::now();
        admit(&ds, who).await?;
        self.proofs.record(who, ds.id, root);
        Ok((ds, at))
    }

    /// The dataset served as `name`. Why one did not open (paths, sizes, file names) is said
    /// to root and the daemon's own user only; others are told to ask them.
    fn named(&self, name: &str, who: &Caller) -> Result<Arc<Dataset>, Status> {
        self.catalog.get(name).ok_or_else(|| {
            // Whether another user's dataset exists, opens or fails is for them, and those
            // they share it with, to know.
            let hidden = name.contains('/') && !(who.is_admin() || self.shared_with(who, name));
            if let Some(found) = self.catalog.opening(name).filter(|_| !hidden) {
                let progress = match found {
                    0 => String::new(),
                    k => format!(", {k} files found so far"),
                };
                return Error::new(
                    Kind::Opening,
                    format!(
                        "dataset {} is being opened (the daemon just started{progress}); retry shortly",
                        quote(name)
                    ),
                )
                .into();
            }
            if let Some(why) = self.catalog.failed(name).filter(|_| !hidden) {
                let why = match who.is_admin() || self.owns(who, name) {
                    true => why,
                    false => "the daemon's log, or `larder datasets` as root, says why".into(),
                };
                return Error::new(
                    Kind::Precondition,
                    format!(
                        "dataset {} did not open, so it is not served: {why}",
                        quote(name)
                    ),
                )
                .into();
            }
            Error::new(
                Kind::UnknownDataset,
                format!(
                    "unknown dataset {}; `larder datasets` lists those you may read",
                    quote(name)
                ),
            )
            .into()
        })
    }

    /// The ring a stream asks to be delivered in, if any: only over the Unix socket, and only
    /// one that the asking process made.
    fn ring(
        &self,
        req: &StreamBatchesRequest,
        sel: &Selection,
        peer: Option<Peer>,
    ) -> Result<Option<Arc<Ring>>, Status> {
        if req.shm_ring.is_empty() {
            return Ok(None);
        }
        if sel.legacy.is_some() {
            return Err(bad_request("shared memory needs layout_version 1"));
        }
        let peer = peer.ok_or_else(|| {
            precondition(
                "shared memory is for clients on the daemon's Unix socket; over TCP, batches come in the message",
            )
        })?;
        let ring = self.rings.get(&req.shm_ring, peer).map_err(|_| {
            Status::from(Error::new(
                Kind::Denied,
                "no shared-memory ring with this token belongs to this process (rings live as long as the connection that made them)",
            ))
        })?;
        if let Some(&k) = req.held_slots.iter().find(|&&k| k >= ring.slots) {
            return Err(bad_request(format!(
                "held slot {k} is not in the ring ({} slots)",
                ring.slots
            )));
        }
        Ok(Some(ring))
    }

    /// The plan `req` asks of `ds` for `who`, charged to them (with the epoch's order when
    /// `with_order`), built in their turn off the async threads; with the fields it selects.
    async fn plan(
        &self,
        ds: Arc<Dataset>,
        req: &StreamBatchesRequest,
        who: &Caller,
        with_order: bool,
    ) -> Result<(Arc<Dataset>, Plan, Selection, super::planning::Costs), Status> {
        let (sel, request) = self.plan_request(&ds, req)?;
        let (plan, costs) = self
            .planning
            .build(who, (ds.id, &ds.name), request, with_order)
            .await?;
        Ok((ds, plan, sel, costs))
    }

    /// What `req` asks of `ds`, checked: the fields it selects and the plan's request.
    fn plan_request(
        &self,
        ds: &Dataset,
        req: &StreamBatchesRequest,
    ) -> Result<(Selection, PlanRequest), Status> {
        let layout = VariableLayout::try_from(req.variable_layout).map_err(|_| {
            bad_request(format!(
                "variable_layout {} is unknown",
                req.variable_layout
            ))
        })?;
        let mut sel =
            Selection::new(&ds.served, &req.fields, layout, req.layout_version).map_err(|e| {
                let kind = if req.layout_version == 0 && req.fields.is_empty() {
                    Kind::Precondition
                } else {
                    Kind::BadRequest
                };
                Status::from(Error::new(kind, format!("dataset {:?}: {e}", ds.name)))
            })?;
        let kind = match req.pipeline.as_str() {
            "" | "eval" => PipelineKind::Eval,
            "train" => PipelineKind::Train,
            other => {
                return Err(bad_request(format!(
                    "pipeline {} is unknown: ask for \"train\" or \"eval\"",
                    quote(other)
                )))
            }
        };
        sel.pipeline = ds.pipeline(kind).map_err(precondition)?.cloned();
        (sel.seed, sel.epoch) = (req.augment_seed.unwrap_or(req.seed), req.epoch);
        if req.batch_size > self.max_batch_size {
            return Err(bad_request(format!(
                "batch_size {} is larger than the daemon's max_batch_size {}",
                req.batch_size, self.max_batch_size
            )));
        }
        let fixed: Option<u64> = sel
            .fields
            .iter()
            .map(|&f| ds.served.fields[f].fixed_bytes())
            .sum();
        let batch_bytes = req.batch_size as u64 * fixed.unwrap_or(0);
        let max = ds.limits.max_batch_bytes;
        if batch_bytes > max {
            return Err(bad_request(format!(
                "batch_size {} makes batches of {batch_bytes} bytes; the limit is {max} (limits.max_batch_bytes)",
                req.batch_size
            )));
        }
        let request = PlanRequest {
            num_samples: ds.len(),
            batch_size: req.batch_size,
            seed: req.seed,
            epoch: req.epoch,
            rank: req.rank,
            world_size: req.world_size,
            worker: req.worker,
            num_workers: req.num_workers,
            start_sample: req.start_sample,
            start_step: req.start_step,
            start_batch: req.start_batch,
            shuffle: !req.sequential,
            drop_last: req.drop_last,
            even_batches: req.even_batches,
            split: (req.nodes > 0).then(|| NodeSplit {
                nodes: req.nodes,
                node: req.node,
                partitions: if req.partitions == 0 {
                    DEFAULT_PARTITIONS
                } else {
                    req.partitions
                },
                granule: ds.source.read_granule(),
                swap_per_mille: (req.swap.clamp(0.0, 1.0) * 1000.0).round() as u32,
                resumed: (req.resumed_nodes > 0 && req.resumed_nodes != req.nodes)
                    .then_some((req.resumed_nodes, req.resumed_sample)),
            }),
            order: OrderForm::from_version(req.order_version)
                .map_err(|e| bad_request(format!("{e:#}")))?,
            correlated: match (req.window, req.cohort_seed) {
                (0, None) => None,
                (window, Some(cohort_seed)) if window > 0 => Some(Correlated {
                    cohort_seed,
                    window,
                }),
                _ => {
                    return Err(bad_request(
                        "a correlated order names both its window (samples, at least 1) and its cohort_seed",
                    ))
                }
            },
        };
        Ok((sel, request))
    }
}

/// The file or folder whose status-change time stamps `ds`'s access proofs: the config's
/// datasets' (the admin's paths); None for a dataset a user added, whose path the daemon does
/// not look at on its async threads (it may be a file system its user controls).
fn stamped_root(ds: &Dataset) -> Option<&std::path::Path> {
    ds.owner.is_none().then(|| ds.source.root())
}

/// The identity of a caller on the Unix socket: datasets are `what` (added, removed) only
/// there; TCP has no identity.
fn local<'a>(who: &'a Caller, what: &str) -> Result<&'a Arc<crate::access::Identity>, Status> {
    match who {
        Caller::Local(id) => Ok(id),
        Caller::Tcp => Err(Error::new(
            Kind::Denied,
            format!("datasets are {what} over the daemon's Unix socket (TCP has no identity)"),
        )
        .into()),
    }
}

type BatchStream = Pin<Box<dyn Stream<Item = Result<Batch, Status>> + Send>>;

#[tonic::async_trait]
impl Larder for Service {
    async fn get_info(
        &self,
        _request: Request<GetInfoRequest>,
    ) -> Result<Response<DaemonInfo>, Status> {
        Ok(Response::new(DaemonInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            api_version: ApiVersion::Current as u32,
            min_client_api_version: MIN_CLIENT_API_VERSION,
            kinds: crate::source::kinds()
                .into_iter()
                .map(String::from)
                .collect(),
        }))
    }

    async fn list_datasets(
        &self,
        request: Request<ListDatasetsRequest>,
    ) -> Result<Response<ListDatasetsResponse>, Status> {
        let who = Caller::of(&request);
        let mut datasets: Vec<DatasetInfo> = vec![];
        for ds in self.catalog.all() {
            if self.may_read(&ds, &who).await {
                datasets.push(ds.info());
            }
        }
        // The admin's view: root and the daemon's own user also see what is not served; a
        // user sees their own added datasets that are not.
        let unavailable = self
            .catalog
            .unavailable()
            .into_iter()
            .filter(|(name, _)| who.is_admin() || self.owns(&who, name))
            .map(|(name, reason)| UnavailableDataset { name, reason })
            .collect();
        Ok(Response::new(ListDatasetsResponse {
            datasets,
            unavailable,
        }))
    }

    async fn list_bad_samples(
        &self,
        request: Request<ListBadSamplesRequest>,
    ) -> Result<Response<ListBadSamplesResponse>, Status> {
        let who = Caller::of(&request);
        let name = request.into_inner().dataset;
        let datasets: Vec<Arc<Dataset>> = if name.is_empty() {
            let mut mine = vec![];
            for ds in self.catalog.all() {
                if admit(&ds, &who).await.is_ok() {
                    mine.push(ds.clone());
                }
            }
            mine
        } else {
            let ds = self.named(&name, &who)?;
            admit(&ds, &who).await?;
            vec![ds]
        };
        let samples = datasets
            .iter()
            .flat_map(|d| {
                d.bad_samples().into_iter().map(|(index, error)| BadSample {
                    dataset: d.name.clone(),
                    index,
                    error,
                })
            })
            .collect();
        Ok(Response::new(ListBadSamplesResponse { samples }))
    }

    async fn add_dataset(
        &self,
        request: Request<AddDatasetRequest>,
    ) -> Result<Response<AddDatasetResponse>, Status> {
        let who = Caller::of(&request);
        let id = local(&who, "added")?;
        let r = request.into_inner();
        if r.table.len() > crate::user_datasets::MAX_TABLE_BYTES {
            return Err(bad_request(format!(
                "the dataset's table takes {} bytes, over the {} one may",
                r.table.len(),
                crate::user_datasets::MAX_TABLE_BYTES
            )));
        }
        if !crate::user_datasets::valid_name(&r.name) {
            return Err(bad_request(format!(
                "dataset name {}: 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'",
                quote(&r.name)
            )));
        }
        let user = crate::access::name_of_user(id.uid).unwrap_or_else(|| id.uid.to_string());
        let name = format!("{user}/{}", r.name);
        crate::user_datasets::parse_table(&name, &r.table)
            .map_err(|e| bad_request(format!("dataset {}: {e:#}", quote(&name))))?;
        let entry = crate::user_datasets::Entry {
            name: name.clone(),
            owner: id.uid,
            table: r.table,
        };
        let ds = self.datasets.add(entry, r.replace).await?;
        tracing::info!(dataset = %name, caller = %who.describe(), "dataset added");
        Ok(Response::new(AddDatasetResponse {
            dataset: Some(ds.info()),
        }))
    }

    async fn remove_dataset(
        &self,
        request: Request<RemoveDatasetRequest>,
    ) -> Result<Response<RemoveDatasetResponse>, Status> {
        let who = Caller::of(&request);
        let id = local(&who, "removed")?;
        let name = request.into_inner().name;
        self.datasets.remove(&name, id.uid, who.is_admin()).await?;
        tracing::info!(dataset = %name, caller = %who.describe(), "dataset removed");
        Ok(Response::new(RemoveDatasetResponse {}))
    }

    async fn list_streams(
        &self,
        request: Request<ListStreamsRequest>,
    ) -> Result<Response<ListStreamsResponse>, Status> {
        let who = Caller::of(&request);
        let mine = |s: &crate::open_streams::StreamSnapshot| match (&who, s.spec.peer) {
            (w, _) if w.is_admin() => true,
            (Caller::Local(id), Some(p)) => p.uid == id.uid,
            _ => false,
        };
        Ok(Response::new(self.streams_view(mine)))
    }

    async fn report_input(
        &self,
        request: Request<ReportInputRequest>,
    ) -> Result<Response<StreamInfo>, Status> {
        let peer = Caller::of(&request).peer();
        let r = request.into_inner();
        let seconds = |s: f64| {
            if s.is_finite() && s > 0.0 {
                Duration::from_secs_f64(s.min(1e9))
            } else {
                Duration::ZERO
            }
        };
        let report = ClientReport {
            batches: r.batches,
            wait: seconds(r.wait_seconds),
            step: seconds(r.step_seconds),
            window_wait: seconds(r.window_wait_seconds),
            window_step: seconds(r.window_step_seconds),
        };
        let s = self.streams.report(r.stream_id, peer, &r.job, report)?;
        let pool_busy = self.store.pool_busy(crate::input_bound::WINDOW);
        Ok(Response::new(self.stream_info(&s, pool_busy)))
    }

    async fn source_kind(
        &self,
        request: Request<SourceKindRequest>,
    ) -> Result<Response<SourceKindResponse>, Status> {
        let who = Caller::of(&request);
        let id = local(&who, "asked about")?;
        let path = std::path::PathBuf::from(request.into_inner().path);
        if !path.is_absolute() {
            return Err(bad_request(format!(
                "path {} is not absolute",
                path.display()
            )));
        }
        // Looked at as the caller (a child as them, two of theirs at once at most): a path
        // they cannot see names no kind for them.
        static TURNS: std::sync::OnceLock<crate::turns::Turns> = std::sync::OnceLock::new();
        let _turn = TURNS
            .get_or_init(|| crate::turns::Turns::new(2))
            .take(id.uid as u64)
            .await;
        let id = id.clone();
        let found = tokio::task::spawn_blocking(move || match crate::privsep::launcher() {
            Some(l) if !crate::access::is_admin_uid(id.uid) => {
                l.recognize(&id.as_ref().into(), &path)
            }
            _ => crate::source::recognize_as((id.uid != 0).then_some(id.uid), &path)
                .map(str::to_string),
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        let (kind, reason) = match found {
            Ok(kind) => (kind, String::new()),
            Err(e) => (String::new(), format!("{e:#}")),
        };
        Ok(Response::new(SourceKindResponse {
            kind,
            reason,
            kinds: crate::source::kinds()
                .iter()
                .map(|k| k.to_string())
                .collect(),
        }))
    }

    async fn get_stats(
        &self,
        request: Request<GetStatsRequest>,
    ) -> Result<Response<Stats>, Status> {
        let who = Caller::of(&request);
        let mut stats = self.stats();
        // Per dataset only what the caller may read (as `ListDatasets` shows them); the
        // daemon-wide totals for everyone.
        if !who.is_admin() {
            let mut shown = Vec::with_capacity(stats.datasets.len());
            for d in std::mem::take(&mut stats.datasets) {
                match self.catalog.get(&d.dataset) {
                    Some(ds) if self.may_read(&ds, &who).await => shown.push(d),
                    _ => {}
                }
            }
            stats.datasets = shown;
        }
        Ok(Response::new(stats))
    }

    type WarmStream = Pin<Box<dyn Stream<Item = Result<WarmProgress, Status>> + Send>>;

    async fn warm(
        &self,
        request: Request<WarmRequest>,
    ) -> Result<Response<Self::WarmStream>, Status> {
        let who = Caller::of(&request);
        let ds = self.admitted(&request.into_inner().dataset, &who).await?;
        if self.store.scratch_of(&ds).is_none() {
            return Err(no_scratch(&ds).into());
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
                    _ = shutdown.stopped() => {
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
                    let _ = tx.send(Err(crate::error::status(&e))).await;
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn plan_stream(
        &self,
        request: Request<StreamBatchesRequest>,
    ) -> Result<Response<StreamPlan>, Status> {
        let who = Caller::of(&request);
        let req = request.into_inner();
        let ds = self.admitted(&req.dataset, &who).await?;
        let (ds, plan, sel, _costs) = self.plan(ds, &req, &who, false).await?;
        let sizes: Option<Vec<usize>> = sel
            .fields
            .iter()
            .map(|&f| {
                let bytes = ds.served.fields[f].fixed_bytes()?;
                Some(req.batch_size as usize * bytes as usize)
            })
            .collect();
        Ok(Response::new(StreamPlan {
            num_batches: plan.num_batches - plan.start_batch,
            num_samples: plan.remaining_samples(),
            slot_bytes: sizes.map_or(0, |s| slot_offsets(s).1 as u64),
            prefetch_batches: self.prefetch_batches as u32,
        }))
    }

    type StreamBatchesStream = BatchStream;

    async fn stream_batches(
        &self,
        request: Request<StreamBatchesRequest>,
    ) -> Result<Response<BatchStream>, Status> {
        let who = Caller::of(&request);
        let peer = who.peer();
        let req = request.into_inner();
        let (ds, checked) = self.admitted_since(&req.dataset, &who).await?;
        let (ds, plan, sel, costs) = self.plan(ds, &req, &who, true).await?;
        let ring = self.ring(&req, &sel, peer)?;
        tracing::info!(
            dataset = %ds.name, batch_size = req.batch_size, seed = req.seed, epoch = req.epoch,
            rank = req.rank, world_size = req.world_size, start_batch = req.start_batch,
            batches = plan.num_batches, shm = ring.is_some(), "stream opened"
        );
        if let Some(split) = plan.split {
            self.store
                .prefetch_next_epoch(&ds, split, req.seed, req.epoch, !req.sequential);
        }
        let plan = Arc::new(plan);
        let handle = self.streams.open(StreamSpec {
            peer,
            dataset: ds.name.clone(),
            dataset_id: ds.id,
            plan: plan.clone(),
            batch_size: req.batch_size,
            seed: req.seed,
            epoch: req.epoch,
            shuffle: !req.sequential,
            rank: req.rank,
            world_size: req.world_size,
            shm: ring.is_some(),
        });
        let (tx, rx) = mpsc::channel(1);
        let producer = Producer {
            store: self.store.clone(),
            ds,
            plan,
            sel: Arc::new(sel),
            ring,
            held_slots: req.held_slots,
            buffers: self.buffers.clone(),
            prefetch: self.prefetch_batches,
            shutdown: self.shutdown.clone(),
            who,
            checked,
            catalog: self.catalog.clone(),
            cursor: handle.cursor(),
            _costs: costs,
        };
        tokio::spawn(producer.run(tx));
        let metered = MeteredStream::new(rx, handle);
        Ok(Response::new(Box::pin(metered)))
    }
}

fn to_proto(p: crate::store::WarmProgress) -> WarmProgress {
    WarmProgress {
        done: p.done,
        total: p.total,
        written: p.written,
        present: p.present,
        bad: p.bad,
    }
}
