//! Keeps the datasets served current while the daemon runs: a reloaded config (SIGHUP) adds,
//! removes and reopens datasets; every [`RECHECK`] the datasets that did not open are tried
//! again and those whose files changed are opened again. Open streams keep the dataset they
//! started with and finish as it was.

use super::shutdown::Shutdown;
use crate::catalog::{Catalog, Changes, Dataset, Job, OpenWith};
use crate::config::{DatasetConfig, Limits};
use crate::error::{quote, Error, Kind};
use crate::store::Store;
use crate::sync::Locked;
use crate::user_datasets::{Entry, Registry};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often datasets that did not open are tried again, and files checked for changes (a
/// stream also checks its dataset's files when it opens and after every read).
pub const RECHECK: Duration = Duration::from_secs(10);

/// The catalog, the store and the config's dataset tables, kept in line.
#[derive(Clone)]
pub struct Datasets {
    catalog: Arc<Catalog>,
    store: Arc<Store>,
    /// The `[[dataset]]` tables of the config last loaded.
    configs: Arc<Mutex<Vec<DatasetConfig>>>,
    /// The datasets users added, served beside the config's.
    registry: Arc<Registry>,
    limits: Limits,
    /// The memory tier's budget and the expansion factor, for each dataset's capacity plan.
    plan: (u64, f64),
    /// What opens need: the limits, the footprint account, whether there is a scratch tier.
    open_with: OpenWith,
    /// One plan at a time (quick: what to open; the opens run apart): many streams asking at
    /// once for a changed dataset plan once each, in turn, not all at once.
    planning: Arc<tokio::sync::Mutex<()>>,
}

impl Datasets {
    pub fn new(
        catalog: Arc<Catalog>,
        store: Arc<Store>,
        configs: Vec<DatasetConfig>,
        registry: Arc<Registry>,
        limits: Limits,
        plan: (u64, f64),
        account: Arc<crate::footprint::Footprint>,
    ) -> Datasets {
        let open_with = OpenWith {
            limits,
            account,
            scratch: store.has_scratch(),
        };
        Datasets {
            catalog,
            store,
            configs: Arc::new(Mutex::new(configs)),
            registry,
            limits,
            plan,
            open_with,
            planning: Default::default(),
        }
    }

    /// The datasets served.
    pub fn catalog(&self) -> &Arc<Catalog> {
        &self.catalog
    }

    /// Serves the datasets of `configs` from now on (a reloaded config): new ones are opened,
    /// changed ones reopened, removed ones stop taking new streams.
    pub async fn reload(&self, configs: Vec<DatasetConfig>) {
        *self.configs.locked() = configs;
        self.start_opens().await;
    }

    /// The account what datasets and streams take of the daemon's memory is charged to.
    pub fn account(&self) -> &Arc<crate::footprint::Footprint> {
        &self.open_with.account
    }

    /// The datasets users added.
    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Adds (or, with `replace`, replaces) a user's dataset and opens it: Err with why when it
    /// does not open, and then nothing is kept (a replaced one comes back as it was). Runs to
    /// its end as a task of its own, so a client that goes away midway leaves nothing half
    /// done; the state file is written only once the dataset has opened.
    pub async fn add(&self, entry: Entry, replace: bool) -> Result<Arc<Dataset>, Error> {
        let this = self.clone();
        tokio::spawn(async move { this.add_now(entry, replace).await })
            .await
            .map_err(|e| Error::new(Kind::Internal, format!("adding the dataset failed: {e}")))?
    }

    async fn add_now(&self, entry: Entry, replace: bool) -> Result<Arc<Dataset>, Error> {
        let name = entry.name.clone();
        let before =
            self.registry
                .put(entry.clone(), self.limits.max_datasets_per_user, replace)?;
        self.reconcile_for(&name).await;
        let failed = match self.catalog.get(&name) {
            Some(ds) => match self.registry.save() {
                Ok(()) => return Ok(ds),
                Err(e) => e,
            },
            None => {
                let why = self
                    .catalog
                    .failed(&name)
                    .unwrap_or_else(|| "it did not open".into());
                Error::new(
                    Kind::Precondition,
                    format!("dataset {} does not open: {why}", quote(&name)),
                )
            }
        };
        // Back to what was there before the call.
        self.registry.restore(&entry, before);
        self.reconcile_for(&name).await;
        Err(failed)
    }

    /// Removes a user's dataset (`by` its owner, or anyone's by an `admin`): open streams
    /// finish, new ones are refused.
    pub async fn remove(&self, name: &str, by: u32, admin: bool) -> Result<(), Error> {
        self.registry.remove(name, by, admin)?;
        self.start_opens().await;
        Ok(())
    }

    /// Brings the catalog in line with the config, the datasets users added and the files on
    /// disk, and waits until each of them has been tried (opened, or found not to open).
    pub async fn reconcile(&self) {
        self.start_opens().await;
        self.catalog.opened(|_| true).await;
    }

    /// `reconcile`, waiting only for dataset `name`: no one waits on another's open.
    pub async fn reconcile_for(&self, name: &str) {
        self.start_opens().await;
        self.catalog.opened(|n| n == name).await;
    }

    /// Starts opening what needs opening, each open a task of its own outside the catalog's
    /// lock (a reader that takes long, or a stopped one, holds up its own dataset only), and
    /// drops what is gone; waits for none of the opens.
    async fn start_opens(&self) {
        let _one = self.planning.lock().await;
        let mut configs = self.configs.locked().clone();
        configs.extend(self.registry.configs());
        // Looking at each served dataset's files (has it changed?) is blocking work.
        let catalog = self.catalog.clone();
        let planned = tokio::task::spawn_blocking(move || catalog.plan(&configs)).await;
        let (changes, jobs) = match planned {
            Ok(planned) => planned,
            Err(e) => return tracing::error!("reopening datasets failed: {e}"),
        };
        self.apply(changes);
        for job in jobs {
            let this = self.clone();
            tokio::spawn(async move { this.open(job).await });
        }
    }

    /// Opens `job` and publishes what came of it (a panic in the open is its failure).
    async fn open(&self, job: Job) {
        let (j, with) = (job.clone(), self.open_with.clone());
        let opened = tokio::spawn(async move { crate::catalog::open_dataset(&j, &with).await })
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("opening it failed ({e}; see the log)")));
        // The store serves it (its scratch tier attached) before any request can find it.
        if let Ok(ds) = &opened {
            self.store.add(ds);
            log_capacity_plan(ds, self.plan);
        }
        let changes = self.catalog.publish(job, opened);
        for id in changes.dropped {
            self.store.forget(id);
        }
    }

    /// The store serves the datasets opened and lets go of those dropped.
    fn apply(&self, changes: Changes) {
        for id in changes.dropped {
            self.store.forget(id);
        }
        for ds in &changes.opened {
            self.store.add(ds);
            log_capacity_plan(ds, self.plan);
        }
    }

    /// Opens the datasets now, then every RECHECK asks the readers whether their datasets'
    /// files changed and reopens what needs it, until the daemon stops. Waits on no open.
    pub async fn keep_current(self, mut stop: Shutdown) {
        self.start_opens().await;
        let mut ticker = tokio::time::interval(RECHECK);
        ticker.tick().await;
        loop {
            tokio::select! {
                _ = ticker.tick() => {
                    for ds in self.catalog.all() {
                        if ds.source.prepared().is_some() {
                            // Each its own task: a slow reader answers for its dataset alone.
                            tokio::spawn(async move {
                                if let Some(p) = ds.source.prepared() {
                                    p.recheck().await;
                                }
                            });
                        }
                    }
                    self.start_opens().await;
                }
                _ = stop.stopped() => return,
            }
        }
    }
}

/// Logs how much of `ds` the memory budget holds, planning with the expansion factor.
fn log_capacity_plan(ds: &Dataset, (budget, expansion_factor): (u64, f64)) {
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
