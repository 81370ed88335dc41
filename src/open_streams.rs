//! The registry of open streams: for each, who opened it, on which dataset, its plan, where it
//! is, what it has been served and how long its client has waited for batches. A stream is
//! registered when it opens and leaves when its handle is dropped (the client got the whole
//! epoch, went away, or the daemon stopped it). The eviction policy (every stream's future),
//! the access checks of running streams, the stats, `ListStreams` and the Prometheus
//! exposition read it here.

use crate::error::{Error, Kind};
use crate::input_bound::{ClientReport, Recent, TierMix};
use crate::metrics::Metrics;
use crate::peer::Peer;
use crate::sampler::Plan;
use crate::sync::Locked;
use crate::tiers::memory::MemoryTier;
use crate::tiers::orders::OrderKey;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a stream is, fixed when it opens.
#[derive(Debug, Clone)]
pub struct StreamSpec {
    /// The process that opened it, on the Unix socket (None over TCP).
    pub peer: Option<Peer>,
    pub dataset: String,
    /// The dataset's id (the memory tier's keys are (id, sample)).
    pub dataset_id: u32,
    /// Its plan: the epoch's order and its batches, the ones it serves being
    /// `plan.start_batch..plan.num_batches`. With `next_batch`, every sample the stream will
    /// still ask for, in order (what a next-use eviction policy reads).
    pub plan: Arc<Plan>,
    pub batch_size: u32,
    pub seed: u64,
    pub epoch: u64,
    pub shuffle: bool,
    pub rank: u32,
    pub world_size: u32,
    /// Delivered in a shared-memory ring (else in the messages).
    pub shm: bool,
}

impl StreamSpec {
    /// How the logs name it.
    pub fn name(&self) -> String {
        format!(
            "{} rank {}/{} epoch {}",
            self.dataset,
            self.rank,
            self.world_size.max(1),
            self.epoch
        )
    }
}

/// A stream's registration: its spec and its counters so far.
#[derive(Debug)]
pub struct StreamState {
    /// Unique among the streams this daemon has opened.
    pub id: u64,
    pub spec: StreamSpec,
    pub opened: Instant,
    /// The batch the client gets next.
    next_batch: AtomicU64,
    batches: AtomicU64,
    samples: AtomicU64,
    bytes: AtomicU64,
    /// Time the client waited for a batch that was not ready.
    stall_nanos: AtomicU64,
    /// Batches assembled so far (less `batches`: those ready ahead of the client).
    assembled: AtomicU64,
    /// What carries over from the client process's previous stream on the same dataset and
    /// rank (its previous epoch): the job's name, the client's last report, where the samples
    /// came from lately.
    line: Mutex<Line>,
}

/// A job's view of one dataset, epoch after epoch: kept a minute after its last stream closed.
#[derive(Debug, Clone, Default)]
struct Line {
    /// The job's name, as its client gave it.
    job: String,
    /// The client's last report of its loop's wait and step, and when it came.
    report: Option<(ClientReport, Instant)>,
    /// Where the samples came from lately: memory, scratch, raw.
    mix: Arc<Recent<3>>,
    /// When its last stream closed.
    closed: Option<Instant>,
}

/// A line's key: the client process (uid, pid), the dataset's id, the rank.
type LineKey = (u32, i32, u32, u32);

/// A stream's state as of now.
#[derive(Debug, Clone)]
pub struct StreamSnapshot {
    pub id: u64,
    pub spec: StreamSpec,
    pub open: Duration,
    pub next_batch: u64,
    pub batches: u64,
    pub samples: u64,
    pub bytes: u64,
    pub stalled: Duration,
    /// Batches ready ahead of the client.
    pub ready: u64,
    /// Where its samples came from over `input_bound::WINDOW`.
    pub mix: TierMix,
    /// The job's name, as the client gave it (empty until it reports).
    pub job: String,
    /// The client's report, while fresh (`input_bound::REPORT_FRESH`).
    pub report: Option<ClientReport>,
}

/// The open streams.
pub struct Streams {
    /// Told how many samples the open streams look up an epoch together (its policy's hint).
    memory: Arc<MemoryTier>,
    /// The daemon-wide counters the streams add to.
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    open: Mutex<BTreeMap<u64, Arc<StreamState>>>,
    /// Per client process (uid, pid): the time its closed streams were open and waited, so a
    /// job's verdict spans its epochs (each a stream of its own), kept a minute after its last.
    runs: Mutex<std::collections::HashMap<(u32, i32), RunTotals>>,
    /// The lines of streams that closed lately (see `Line`).
    lines: Mutex<std::collections::HashMap<LineKey, Line>>,
}

/// A client process's closed streams, together.
#[derive(Debug, Clone, Copy)]
pub struct RunTotals {
    pub open: Duration,
    pub waited: Duration,
    pub last: Instant,
}

/// How long a run's closed streams count after its last one closed.
const RUN_MEMORY: Duration = Duration::from_secs(60);

impl Streams {
    pub fn new(memory: Arc<MemoryTier>, metrics: Arc<Metrics>) -> Arc<Streams> {
        Arc::new(Streams {
            memory,
            metrics,
            next_id: AtomicU64::new(1),
            open: Mutex::new(BTreeMap::new()),
            runs: Mutex::new(Default::default()),
            lines: Mutex::new(Default::default()),
        })
    }

    /// Registers a stream; it stays registered while the handle lives.
    pub fn open(self: &Arc<Self>, spec: StreamSpec) -> StreamHandle {
        let id = self.next_id.fetch_add(1, Relaxed);
        self.metrics.stream_opened();
        // The job's previous epoch on this dataset, if it closed within the last minute.
        let mut line = self.take_line(line_key(&spec)).unwrap_or_default();
        line.closed = None;
        let state = Arc::new(StreamState {
            id,
            next_batch: AtomicU64::new(spec.plan.start_batch),
            spec,
            opened: Instant::now(),
            batches: AtomicU64::new(0),
            samples: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            stall_nanos: AtomicU64::new(0),
            assembled: AtomicU64::new(0),
            line: Mutex::new(line),
        });
        // Its future, to the memory tier's policy, before it reads anything.
        let plan = &state.spec.plan;
        let order = OrderKey {
            dataset: state.spec.dataset_id,
            num_samples: plan.dataset_samples,
            seed: state.spec.seed,
            epoch: state.spec.epoch,
            shuffle: state.spec.shuffle,
            split: plan.split,
            form: plan
                .order_form
                .effective(plan.split.as_ref(), state.spec.shuffle),
            correlated: plan.correlated,
        };
        self.memory.stream_opened(id, order, plan.start_position());
        let mut open = self.lock();
        open.insert(id, state.clone());
        // Told under the lock, so the last hint is the latest sum.
        self.memory.set_streaming_samples(samples_of(&open));
        drop(open);
        StreamHandle {
            streams: self.clone(),
            state,
        }
    }

    /// Samples per epoch the open streams look up together.
    pub fn streaming_samples(&self) -> u64 {
        samples_of(&self.lock())
    }

    /// Every open stream, oldest first.
    pub fn snapshot(&self) -> Vec<StreamSnapshot> {
        self.lock().values().map(|s| s.snapshot()).collect()
    }

    /// The client `peer` reports how its loop spends its time on stream `id`, under the job
    /// name `job`. Only the process that opened the stream may (another user's, or another
    /// process's, report is refused as if the stream were not there). The stream as of now.
    pub fn report(
        &self,
        id: u64,
        peer: Option<Peer>,
        job: &str,
        report: ClientReport,
    ) -> Result<StreamSnapshot, Error> {
        let state = self.lock().get(&id).cloned();
        // Over TCP nobody is known, so nobody may report (a TCP client could name any TCP
        // stream's id).
        let same = |p: Option<Peer>| match (p, peer) {
            (Some(a), Some(b)) => a.uid == b.uid && a.pid.is_some() && a.pid == b.pid,
            _ => false,
        };
        let Some(state) = state.filter(|s| same(s.spec.peer)) else {
            // (Told apart from a stream that is there but someone else's by nothing.)
            return Err(Error::new(
                Kind::UnknownStream,
                format!("no open stream {id} of this process"),
            ));
        };
        // A name for humans: printable (no control characters, no bidirectional or invisible
        // formatting that would rearrange a terminal's line), at most 64 characters.
        let job: String = job
            .chars()
            .filter(|&c| !c.is_control() && !invisible(c))
            .take(64)
            .collect();
        let mut line = state.line();
        // The first name stays: a name that changed at every report would make a new series
        // in Prometheus each time.
        if line.job.is_empty() {
            line.job = job;
        }
        line.report = Some((report, Instant::now()));
        drop(line);
        Ok(state.snapshot())
    }

    /// The line `key` left by a stream that closed within the last minute.
    fn take_line(&self, key: Option<LineKey>) -> Option<Line> {
        let mut lines = self.lines.locked();
        forget_old(&mut lines);
        lines.remove(&key?)
    }

    /// The closed streams' totals of the client process `peer` (zero if none lately).
    pub fn run_totals(&self, peer: Option<Peer>) -> (Duration, Duration) {
        let Some(p) = peer else {
            return Default::default();
        };
        let mut runs = self.runs.locked();
        runs.retain(|_, r| r.last.elapsed() < RUN_MEMORY);
        runs.get(&(p.uid, p.pid.unwrap_or(0)))
            .map_or_else(Default::default, |r| (r.open, r.waited))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<StreamState>>> {
        self.open.locked()
    }
}

/// Unicode's formatting characters that reorder or hide text (bidirectional controls,
/// zero-width marks, the byte-order mark).
fn invisible(c: char) -> bool {
    matches!(
        c,
        '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{206f}' | '\u{feff}'
    )
}

/// At most this many lines are kept for streams that closed (the oldest go first).
const MAX_LINES: usize = 4096;

/// Drops the lines whose last stream closed more than `RUN_MEMORY` ago.
fn forget_old(lines: &mut std::collections::HashMap<LineKey, Line>) {
    lines.retain(|_, l| l.closed.is_some_and(|t| t.elapsed() < RUN_MEMORY));
}

/// The line a stream of `spec` continues (none over TCP: no process to follow).
fn line_key(spec: &StreamSpec) -> Option<LineKey> {
    let p = spec.peer?;
    Some((p.uid, p.pid.unwrap_or(0), spec.dataset_id, spec.rank))
}

/// Samples the streams `open` will look up this epoch, together.
fn samples_of(open: &BTreeMap<u64, Arc<StreamState>>) -> u64 {
    open.values().map(|s| s.spec.plan.remaining_samples()).sum()
}

impl StreamState {
    fn line(&self) -> std::sync::MutexGuard<'_, Line> {
        self.line.locked()
    }

    fn snapshot(&self) -> StreamSnapshot {
        let line = self.line().clone();
        StreamSnapshot {
            id: self.id,
            spec: self.spec.clone(),
            open: self.opened.elapsed(),
            next_batch: self.next_batch.load(Relaxed),
            batches: self.batches.load(Relaxed),
            samples: self.samples.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            stalled: Duration::from_nanos(self.stall_nanos.load(Relaxed)),
            ready: self
                .assembled
                .load(Relaxed)
                .saturating_sub(self.batches.load(Relaxed)),
            mix: line.mix.sum(crate::input_bound::WINDOW).0,
            report: line
                .report
                .filter(|r| r.1.elapsed() < crate::input_bound::REPORT_FRESH)
                .map(|r| r.0),
            job: line.job,
        }
    }
}

/// An open stream's registration.
pub struct StreamHandle {
    streams: Arc<Streams>,
    state: Arc<StreamState>,
}

impl StreamHandle {
    pub fn spec(&self) -> &StreamSpec {
        &self.state.spec
    }

    /// The stream's id.
    pub fn id(&self) -> u64 {
        self.state.id
    }

    /// Batch `index`, of `samples` samples and `bytes` bytes, went to the client.
    pub fn record_batch(&self, index: u64, samples: u64, bytes: u64) {
        let s = &self.state;
        s.next_batch.store(index + 1, Relaxed);
        s.batches.fetch_add(1, Relaxed);
        s.samples.fetch_add(samples, Relaxed);
        s.bytes.fetch_add(bytes, Relaxed);
        self.streams.metrics.record_batch(samples, bytes);
    }

    /// The stream's sender got a batch after waiting `d` for it (zero: it was ready).
    pub fn record_batch_wait(&self, d: Duration) {
        self.streams.metrics.record_batch_wait(d);
    }

    /// The client waited `d` for a batch that was not ready.
    pub fn record_stall(&self, d: Duration) {
        self.state
            .stall_nanos
            .fetch_add(d.as_nanos() as u64, Relaxed);
        self.streams.metrics.record_stall(d);
    }

    pub fn snapshot(&self) -> StreamSnapshot {
        self.state.snapshot()
    }

    /// What the stream's producer tells the memory tier's policy as it reads ahead.
    pub fn cursor(&self) -> Cursor {
        Cursor {
            memory: self.streams.memory.clone(),
            state: self.state.clone(),
        }
    }
}

/// Where a stream reads: its producer reports each batch as it starts reading it, so the
/// memory tier's policy knows where the stream is in its order and how fast it goes.
#[derive(Clone)]
pub struct Cursor {
    memory: Arc<MemoryTier>,
    state: Arc<StreamState>,
}

impl Cursor {
    /// The stream starts reading batch `b` of `plan`.
    pub fn reading(&self, plan: &Plan, b: u64) {
        self.memory.stream_at(self.state.id, plan.resume_sample(b));
    }

    /// A batch is assembled, its samples from memory, scratch and raw, so many each.
    pub fn fetched(&self, mix: TierMix) {
        self.state.assembled.fetch_add(1, Relaxed);
        let recent = self.state.line().mix.clone();
        recent.add(mix);
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        let streams = &self.streams;
        // The memory tier keeps the staleness window of the last open: a closing stream is
        // usually followed by its next epoch.
        streams.lock().remove(&self.state.id);
        streams.metrics.stream_closed();
        let s = self.state.snapshot();
        // Finished: it served its epoch to the end (a stream opened at its end served nothing
        // and leaves no next epoch to expect).
        let finished = s.batches > 0 && s.next_batch >= s.spec.plan.num_batches;
        streams.memory.stream_closed(s.id, finished);
        if let Some(key) = line_key(&s.spec) {
            let mut line = self.state.line().clone();
            line.closed = Some(Instant::now());
            let mut lines = streams.lines.locked();
            if lines.len() >= MAX_LINES {
                forget_old(&mut lines);
                if lines.len() >= MAX_LINES {
                    let oldest = lines.iter().min_by_key(|(_, l)| l.closed).map(|(k, _)| *k);
                    if let Some(k) = oldest {
                        lines.remove(&k);
                    }
                }
            }
            lines.insert(key, line);
        }
        if let Some(p) = s.spec.peer {
            let mut runs = streams.runs.locked();
            let run = runs
                .entry((p.uid, p.pid.unwrap_or(0)))
                .or_insert(RunTotals {
                    open: Duration::ZERO,
                    waited: Duration::ZERO,
                    last: Instant::now(),
                });
            run.open += s.open;
            run.waited += s.stalled;
            run.last = Instant::now();
        }
        let (open, stalled) = (s.open.as_secs_f64(), s.stalled.as_secs_f64());
        tracing::info!(
            stream = %s.spec.name(),
            open_seconds = open,
            stall_seconds = stalled,
            "stream closed; the client waited on larder {:.0}% of the time",
            if open > 0.0 { stalled / open * 100.0 } else { 0.0 }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_registered_while_its_handle_lives() {
        let metrics = Arc::new(Metrics::default());
        let streams = Streams::new(Arc::new(MemoryTier::new(1 << 20)), metrics.clone());
        // Batches of 10 from batch 2: `samples` left to look up.
        let spec = |dataset: &str, samples: u64| StreamSpec {
            peer: None,
            dataset: dataset.into(),
            dataset_id: 0,
            plan: Arc::new(Plan::sequential(samples + 20, 10, 2)),
            batch_size: 10,
            seed: 0,
            epoch: 0,
            shuffle: false,
            rank: 0,
            world_size: 1,
            shm: false,
        };
        let a = streams.open(spec("a", 100));
        let b = streams.open(spec("b", 50));
        assert_eq!(streams.streaming_samples(), 150);
        a.record_batch(2, 8, 800);
        a.record_stall(Duration::from_millis(5));
        let open = streams.snapshot();
        assert_eq!(open.len(), 2);
        assert_eq!(open[0].spec.dataset, "a");
        assert_eq!((open[0].next_batch, open[0].batches), (3, 1));
        assert_eq!((open[0].samples, open[0].bytes), (8, 800));
        assert_eq!(open[0].stalled, Duration::from_millis(5));
        assert_eq!(open[1].next_batch, 2, "b has served nothing yet");
        assert_eq!(metrics.to_proto().active_streams, 2);
        drop(a);
        let open = streams.snapshot();
        assert_eq!((open.len(), open[0].spec.dataset.as_str()), (1, "b"));
        assert_eq!(streams.streaming_samples(), 50);
        drop(b);
        assert!(streams.snapshot().is_empty());
        assert_eq!(metrics.to_proto().active_streams, 0);
        assert_eq!(metrics.to_proto().batches_served, 1);
    }

    #[test]
    fn only_the_opening_process_reports_and_the_next_epoch_carries_the_job_on() {
        let metrics = Arc::new(Metrics::default());
        let streams = Streams::new(Arc::new(MemoryTier::new(1 << 20)), metrics);
        let me = Peer {
            uid: 1000,
            pid: Some(42),
        };
        let spec = |epoch| StreamSpec {
            peer: Some(me),
            dataset: "a".into(),
            dataset_id: 3,
            plan: Arc::new(Plan::sequential(100, 10, 0)),
            batch_size: 10,
            seed: 0,
            epoch,
            shuffle: false,
            rank: 0,
            world_size: 1,
            shm: false,
        };
        let report = ClientReport {
            batches: 5,
            window_wait: Duration::from_secs(3),
            window_step: Duration::from_secs(1),
            ..Default::default()
        };
        let a = streams.open(spec(0));
        let id = a.id();
        for other in [
            Some(Peer {
                uid: 1000,
                pid: Some(43),
            }),
            Some(Peer {
                uid: 1001,
                pid: Some(42),
            }),
            None,
        ] {
            let e = streams.report(id, other, "forged", report).unwrap_err();
            assert_eq!(e.kind(), Kind::UnknownStream);
        }
        assert!(streams.report(id + 1, Some(me), "job", report).is_err());
        assert_eq!(streams.snapshot()[0].job, "");
        let s = streams
            .report(id, Some(me), "job\u{1b}[2J\u{202e}", report)
            .unwrap();
        assert_eq!(s.job, "job[2J", "no control characters reach a terminal");
        let s = streams.report(id, Some(me), "renamed", report).unwrap();
        assert_eq!(s.job, "job[2J", "the first name stays");
        a.cursor().fetched([1, 2, 3]);
        drop(a);
        // The next epoch of the same process, dataset and rank goes on from there.
        let b = streams.open(spec(1));
        let s = b.snapshot();
        assert_eq!((s.job.as_str(), s.mix), ("job[2J", [1, 2, 3]));
        assert_eq!(s.report.map(|r| r.batches), Some(5));
    }
}
