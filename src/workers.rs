//! The preprocessing pool: a fixed number of threads that read raw files, decode and resize.
//! Jobs are queued per tenant (a user's datasets are theirs; each of the config's datasets is
//! its own), and the threads take them tenant by tenant in turn, first come first served within
//! one: a user with a thousand jobs queued delays another's next job by one job, not a
//! thousand. A thread goes from one job straight to the next (no permit to give back through
//! the async runtime between two samples), which keeps every core busy during a cold epoch.

use crate::sync::Locked;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use tokio::sync::oneshot;

type Job = Box<dyn FnOnce() + Send>;

/// The pool. Dropping the last handle lets the threads finish the queued jobs and exit.
pub struct Workers {
    shared: Arc<Shared>,
    threads: usize,
}

struct Shared {
    /// Jobs not started yet, oldest first; `closed` once the pool is dropped.
    queue: Mutex<Queue>,
    /// Signalled when a job is queued or the pool closes.
    ready: Condvar,
    /// Nanoseconds the threads spent on jobs, per second lately (the pool's busy share).
    busy: crate::input_bound::Recent<1>,
}

/// Whose a job is: the pool shares its threads between tenants in turn.
pub type Tenant = u64;

#[derive(Default)]
struct Queue {
    /// Each tenant's jobs not started yet, oldest first (no empty queue kept).
    jobs: BTreeMap<Tenant, VecDeque<Job>>,
    /// The tenant served last: the next job is the next tenant's.
    last: Option<Tenant>,
    closed: bool,
}

impl Queue {
    /// The next job, from the tenant after the one served last.
    fn next(&mut self) -> Option<Job> {
        let tenant = match self.last {
            Some(last) => self
                .jobs
                .range(last.saturating_add(1)..)
                .next()
                .or_else(|| self.jobs.iter().next())
                .map(|(t, _)| *t)?,
            None => *self.jobs.keys().next()?,
        };
        let queue = self.jobs.get_mut(&tenant)?;
        let job = queue.pop_front();
        if queue.is_empty() {
            self.jobs.remove(&tenant);
        }
        self.last = Some(tenant);
        job
    }
}

impl Workers {
    /// Starts `threads` (at least 1) threads named `larder-prep-N`.
    pub fn new(threads: usize) -> std::io::Result<Workers> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
            busy: Default::default(),
        });
        for n in 0..threads {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("larder-prep-{n}"))
                .spawn(move || shared.work())?;
        }
        Ok(Workers { shared, threads })
    }

    /// Threads in the pool.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// The share of the threads' time spent on jobs over the last `window` (0..=1).
    pub fn busy_share(&self, window: std::time::Duration) -> f64 {
        let ([nanos], span) = self.shared.busy.sum(window);
        let span = span.max(std::time::Duration::from_secs(1)).as_nanos() as f64;
        (nanos as f64 / (span * self.threads as f64)).min(1.0)
    }

    /// Runs `f` on the pool as the daemon's own work (tenant 0); its result, or an error if
    /// the job panicked.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> anyhow::Result<T> {
        self.run_for(0, f).await
    }

    /// Runs `f` on the pool in `tenant`'s turn; its result, or an error if the job panicked.
    pub async fn run_for<T: Send + 'static>(
        &self,
        tenant: Tenant,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> anyhow::Result<T> {
        let (tx, rx) = oneshot::channel();
        self.shared.push(
            tenant,
            Box::new(move || {
                // A waiter that went away no longer wants the result.
                let _ = tx.send(f());
            }),
        );
        rx.await
            .map_err(|_| anyhow::anyhow!("a preprocessing job panicked (see the daemon's log)"))
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.locked()
    }

    fn push(&self, tenant: Tenant, job: Job) {
        self.lock().jobs.entry(tenant).or_default().push_back(job);
        self.ready.notify_one();
    }

    fn work(&self) {
        loop {
            let job = {
                let mut q = self.lock();
                loop {
                    if let Some(job) = q.next() {
                        break job;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            // A panicking job drops its result sender (its waiter gets the error) and the
            // thread goes on with the next job.
            let began = std::time::Instant::now();
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
            self.busy.add([began.elapsed().as_nanos() as u64]);
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn runs_jobs_on_its_threads_at_most_n_at_once() {
        let pool = Arc::new(Workers::new(2).unwrap());
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let jobs = (0..16).map(|i| {
            let (pool, running, most) = (pool.clone(), running.clone(), most.clone());
            async move {
                pool.run(move || {
                    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    running.fetch_sub(1, Ordering::SeqCst);
                    let name = std::thread::current().name().unwrap_or("").to_string();
                    (i, name)
                })
                .await
                .unwrap()
            }
        });
        let done = futures::future::join_all(jobs).await;
        assert_eq!(
            done.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            (0..16).collect::<Vec<_>>()
        );
        assert!(done.iter().all(|(_, n)| n.starts_with("larder-prep-")));
        assert_eq!(most.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn tenants_take_the_threads_in_turn() {
        // One thread, held while a flood of one tenant's jobs and one job of another's queue:
        // the other's runs second, not after the flood.
        let pool = Arc::new(Workers::new(1).unwrap());
        let order = Arc::new(std::sync::Mutex::new(vec![]));
        let (hold, held) = std::sync::mpsc::channel::<()>();
        let blocker = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.run_for(1, move || held.recv().unwrap()).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let mut jobs = vec![];
        for (tenant, k) in (0..20).map(|k| (1, k)).chain([(2, 100)]) {
            let (pool, order) = (pool.clone(), order.clone());
            jobs.push(tokio::spawn(async move {
                pool.run_for(tenant, move || order.locked().push(k)).await
            }));
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        hold.send(()).unwrap();
        blocker.await.unwrap().unwrap();
        for j in jobs {
            j.await.unwrap().unwrap();
        }
        let order = order.locked();
        let at = order.iter().position(|&k| k == 100).unwrap();
        assert!(at <= 1, "the other tenant's job ran {at}th: {order:?}");
    }

    #[tokio::test]
    async fn a_panicking_job_is_an_error_and_the_pool_goes_on() {
        let pool = Workers::new(1).unwrap();
        let err = pool.run(|| panic!("boom")).await.unwrap_err();
        assert!(err.to_string().contains("panicked"), "{err}");
        assert_eq!(pool.run(|| 7).await.unwrap(), 7);
    }
}
