//! The daemon's side of a reader: a dataset read in a reader process running as its owner (see
//! `reader`), seen by the rest of the daemon as a `Source` whose samples come prepared.
//! Everything a reader says is checked before it is used: lengths and offsets against the
//! memfd that holds the bytes, each record against the dataset's schema and the sample limit,
//! what it is against what it was when first opened.
//!
//! Nothing shared waits on a reader: its answers are received by a task of its own on the
//! runtime, requests are awaited there (no thread parked on its socket, no lock held across the
//! wait), and a send to a reader that does not read fails at once. A reader is alive while it
//! answers or says so (`Alive`); one silent for `protocol::SILENT_WITHIN` with requests to
//! answer (stopped, wedged), one that crashes or lies costs its dataset's streams an error
//! naming the dataset (UNAVAILABLE), and is started again on the next request, no sooner than a
//! backoff that doubles with each failure in a row (1 s to 30 s). The daemon and every other
//! dataset go on.

use super::launcher::{Launcher, User};
use super::protocol::{self, Kind, Outcome, Sizes};
use super::wire;
use crate::config::{DatasetConfig, Limits};
use crate::error::{Error, Kind as ErrorKind};
use crate::footprint::{Charge, Footprint, Payer};
use crate::objects::Location;
use crate::pipeline::Preprocess;
use crate::source::{Format, Opened, Prepared, Provenance, RawSample, RawSource};
use crate::sync::Locked;
use anyhow::{anyhow, bail, ensure, Context, Result};
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// How long a reader that says it is alive may take over a request without answering any of
/// it (a decoder looping on a crafted file) before it is taken for wedged: a `Load` between
/// two of its samples, an `Open` in all (a large folder is walked and its files looked at).
const LOAD_STALL: Duration = Duration::from_secs(120);
const OPEN_WITHIN: Duration = Duration::from_secs(1800);
/// The most bytes of records one `Samples` answer may hold.
const MOST_ANSWER_BYTES: u64 = 256 << 20;
/// Restarts after failures in a row wait this long, doubling, up to `MOST_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MOST_BACKOFF: Duration = Duration::from_secs(30);

/// Answers to one request received ahead of its waiter.
const ANSWERS_QUEUED: usize = 16;
/// The most `Alive`s a second a reader may send, and answers to requests no one waits for any
/// more (given up on) it may send in all: past either it is flooding, and is failed.
const MOST_ALIVE_A_SECOND: u32 = 20;
const MOST_UNWANTED: u32 = 1024;

/// Readers that failed, since the daemon started.
pub static READER_FAILURES: AtomicU64 = AtomicU64::new(0);

/// A request waiting for its answers: where they go (a few at a time: a reader whose answers
/// are not taken yet waits), and how long it may go without one.
struct Waiter {
    tx: mpsc::Sender<wire::Message>,
    /// When it was sent or last answered.
    since: Instant,
    within: Duration,
}

/// One reader process: its socket, and the answers its requests wait for.
struct Connection {
    channel: wire::Channel,
    pending: Mutex<HashMap<u64, Waiter>>,
    next: AtomicU64,
    /// When anything last came from it.
    heard: Mutex<Instant>,
    /// Files its open has found so far (its `Alive`s say).
    found: Arc<AtomicU64>,
    /// Why it no longer serves, once it does not.
    dead: Mutex<Option<String>>,
    /// The reader process's lifeline (see `launcher::Child`): let go when it fails, which
    /// kills the process, stopped or not.
    lifeline: Mutex<Option<OwnedFd>>,
}

/// Why a request got no answer: the reader said why not (`FAILED`), or it failed.
#[derive(Debug)]
enum Failure {
    Refused(String),
    Dead(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused(why) | Failure::Dead(why) => f.write_str(why),
        }
    }
}

/// The answers to one request, as they come.
struct Reply<'a> {
    conn: &'a Connection,
    rx: mpsc::Receiver<wire::Message>,
}

impl Reply<'_> {
    /// The next answer (never `FAILED`: that is `Failure::Refused`).
    async fn next(&mut self) -> Result<wire::Message, Failure> {
        match self.rx.recv().await {
            Some(m) if m.kind == wire::FAILED => Err(Failure::Refused(m.failure())),
            Some(m) => Ok(m),
            None => Err(Failure::Dead(
                self.conn
                    .dead()
                    .unwrap_or_else(|| "the reader ended".into()),
            )),
        }
    }
}

/// What a reader sends beyond what it is asked: `Alive`s this second, answers no one waits for.
#[derive(Default)]
struct Flood {
    second: Option<Instant>,
    alives: u32,
    unwanted: u32,
}

impl Flood {
    fn alive(&mut self) -> Result<(), String> {
        if self
            .second
            .is_none_or(|s| s.elapsed() >= Duration::from_secs(1))
        {
            (self.second, self.alives) = (Some(Instant::now()), 0);
        }
        self.alives += 1;
        if self.alives > MOST_ALIVE_A_SECOND {
            return Err(format!(
                "the reader says it is alive over {MOST_ALIVE_A_SECOND} times a second"
            ));
        }
        Ok(())
    }

    fn unwanted(&mut self) -> Result<(), String> {
        self.unwanted += 1;
        if self.unwanted > MOST_UNWANTED {
            return Err(format!(
                "the reader sent over {MOST_UNWANTED} answers no request waits for"
            ));
        }
        Ok(())
    }
}

impl Connection {
    /// The reader at the other end of `sock`, its answers received by a task of its own on the
    /// runtime of the caller.
    fn over(
        sock: OwnedFd,
        lifeline: Option<OwnedFd>,
        found: Arc<AtomicU64>,
    ) -> Result<Arc<Connection>> {
        let c = Arc::new(Connection {
            lifeline: Mutex::new(lifeline),
            channel: wire::Channel::new(sock)?,
            pending: Mutex::default(),
            next: AtomicU64::new(1),
            heard: Mutex::new(Instant::now()),
            found,
            dead: Mutex::default(),
        });
        tokio::spawn(c.clone().receive());
        Ok(c)
    }

    /// Receives the reader's answers until it fails or closes, handing each to its request,
    /// and watches for silence, stalls and floods.
    async fn receive(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        let mut flood = Flood::default();
        loop {
            tokio::select! {
                got = self.channel.recv() => match got {
                    Ok(Some(m)) => {
                        if let Err(why) = self.route(m, &mut flood).await {
                            return self.fail(&why);
                        }
                    }
                    Ok(None) => return self.fail("the reader process ended (it crashed or was killed)"),
                    Err(e) => return self.fail(&format!("the reader sent what is not a message: {e:#}")),
                },
                _ = tick.tick() => {
                    if self.dead().is_some() {
                        return;
                    }
                    if let Some(why) = self.stuck() {
                        return self.fail(&why);
                    }
                }
            }
        }
    }

    /// Hands `m` to the request it answers (waiting while that request's answers are not
    /// taken: the reader then waits too).
    async fn route(&self, m: wire::Message, flood: &mut Flood) -> Result<(), String> {
        *self.heard.locked() = Instant::now();
        if m.id == 0 {
            return match Kind::try_from(m.kind) {
                Ok(Kind::Alive) => {
                    flood.alive()?;
                    let found = protocol::read_alive(&m.payload).map_err(|e| format!("{e:#}"))?;
                    self.found.store(found, Relaxed);
                    Ok(())
                }
                _ => Err(format!(
                    "the reader sent a message of kind {} unasked",
                    m.kind
                )),
            };
        }
        if m.id >= self.next.load(Relaxed) {
            return Err(format!(
                "the reader answered request {} that was not asked",
                m.id
            ));
        }
        let kind = Kind::try_from(m.kind).ok();
        let last = m.kind == wire::FAILED
            || matches!(
                kind,
                Some(Kind::Hello | Kind::Opened | Kind::Done | Kind::Checked)
            );
        // An answer moves its request on: samples answered (not an empty answer), or its end.
        let progress = match kind {
            Some(Kind::Samples) => m.payload.get(..4).is_some_and(|n| n != [0; 4]),
            _ => true,
        };
        let id = m.id;
        let tx = {
            let mut pending = self.pending.locked();
            // A request given up on (its waiter gone) gets no more: what comes for it is
            // dropped.
            let Some(w) = pending.get_mut(&id) else {
                return flood.unwanted();
            };
            if progress {
                w.since = Instant::now();
            }
            let tx = w.tx.clone();
            if last {
                pending.remove(&id);
            }
            tx
        };
        if tx.send(m).await.is_err() {
            self.pending.locked().remove(&id);
        }
        Ok(())
    }

    /// Why the reader is taken for stuck, if it is: silent too long with requests to answer,
    /// or a request without an answer too long.
    fn stuck(&self) -> Option<String> {
        let pending = self.pending.locked();
        if pending.is_empty() {
            return None;
        }
        let silent = self.heard.locked().elapsed();
        if silent > protocol::SILENT_WITHIN {
            return Some(format!(
                "the reader has said nothing for {} s (stopped, or stuck in a system call)",
                silent.as_secs()
            ));
        }
        pending
            .values()
            .find(|w| w.since.elapsed() > w.within)
            .map(|w| {
                format!(
                    "the reader answered nothing of a request for {} s (wedged)",
                    w.within.as_secs()
                )
            })
    }

    /// Marks the reader failed: every request waiting and to come gets `why`, and its socket
    /// is shut (the reader sees it closed and ends).
    fn fail(&self, why: &str) {
        let mut dead = self.dead.locked();
        if dead.is_none() {
            *dead = Some(why.to_string());
            READER_FAILURES.fetch_add(1, Relaxed);
        }
        drop(dead);
        self.pending.locked().clear();
        self.channel.shutdown();
        // The process is killed, whatever it does (a reader taken over ignores its socket).
        drop(self.lifeline.locked().take());
    }

    fn dead(&self) -> Option<String> {
        self.dead.locked().clone()
    }

    /// Sends a request with `fds` beside it; its answers come through the reply. Err when the
    /// reader has failed or does not take the request.
    fn call(
        &self,
        kind: Kind,
        payload: &[u8],
        fds: &[RawFd],
        within: Duration,
    ) -> Result<Reply<'_>, Failure> {
        if let Some(why) = self.dead() {
            return Err(Failure::Dead(why));
        }
        let id = self.next.fetch_add(1, Relaxed);
        let (tx, rx) = mpsc::channel(ANSWERS_QUEUED);
        let waiter = Waiter {
            tx,
            since: Instant::now(),
            within,
        };
        {
            let mut pending = self.pending.locked();
            // A reader that owed nothing may have been quiet: its silence counts from now.
            // (Requests while it owes answers do not move it: a stopped reader is found
            // however often it is asked.)
            if pending.is_empty() {
                *self.heard.locked() = Instant::now();
            }
            pending.insert(id, waiter);
        }
        if let Err(e) = self.channel.send(kind.into(), id, payload, fds) {
            self.fail(&format!("sending to the reader: {e:#}"));
            return Err(Failure::Dead(self.dead().unwrap_or_default()));
        }
        Ok(Reply { conn: self, rx })
    }

    /// One request, one answer of kind `want`.
    async fn ask(
        &self,
        kind: Kind,
        payload: &[u8],
        fds: &[RawFd],
        want: Kind,
        within: Duration,
    ) -> Result<wire::Message, Failure> {
        let mut reply = self.call(kind, payload, fds, within)?;
        let m = reply.next().await?;
        self.expect(&m, want)?;
        Ok(m)
    }

    /// Fails the reader unless `m` is of kind `want`.
    fn expect(&self, m: &wire::Message, want: Kind) -> Result<(), Failure> {
        if Kind::try_from(m.kind).ok() == Some(want) {
            return Ok(());
        }
        self.fail(&format!(
            "the reader answered with kind {} where {want:?} was due",
            m.kind
        ));
        Err(Failure::Dead(self.dead().unwrap_or_default()))
    }
}

/// The samples a load asks for: its ranges (sorted, apart), and where each range's samples
/// start in the answer's order.
struct Asked {
    ranges: Vec<(u64, u64)>,
    offsets: Vec<usize>,
}

impl Asked {
    /// `ranges` of a dataset of `len` samples: sorted, apart, within it, at most a load.
    fn new(ranges: &[(u64, u64)], len: u64) -> Result<Asked> {
        let mut offsets = Vec::with_capacity(ranges.len());
        let (mut total, mut end) = (0u64, 0u64);
        for &(start, count) in ranges {
            ensure!(
                count > 0 && start >= end && start.checked_add(count).is_some_and(|e| e <= len),
                "samples {start}..+{count} of {len}"
            );
            offsets.push(total as usize);
            total += count;
            end = start + count;
        }
        ensure!(
            (1..=protocol::MOST_LOAD_SAMPLES).contains(&total),
            "a load of {total} samples"
        );
        Ok(Asked {
            ranges: ranges.to_vec(),
            offsets,
        })
    }

    fn len(&self) -> u64 {
        self.ranges.iter().map(|r| r.1).sum()
    }

    /// Where sample `i` comes in the answer, if it was asked.
    fn position(&self, i: u64) -> Option<usize> {
        let k = self
            .ranges
            .partition_point(|&(s, _)| s <= i)
            .checked_sub(1)?;
        let (start, count) = self.ranges[k];
        (i < start + count).then(|| self.offsets[k] + (i - start) as usize)
    }
}

/// Why a `Samples` answer was not taken: it does not hold (the reader lied), or holding it
/// is over its owner's share.
enum Taken {
    Lied(anyhow::Error),
    Refused(String),
}

/// Each sample's bytes on disk, as its reader said.
enum SampleSizes {
    Each(u64),
    PerSample(Box<[u32]>),
}

/// A dataset read by readers running as its owner (or as `reader_user`).
pub struct RemoteSource {
    name: String,
    /// Where a new reader comes from after a failure (None: nowhere; the tests' readers).
    launcher: Option<&'static Launcher>,
    user: User,
    /// The request that opens it (its table and the limits).
    open_request: protocol::Open,
    /// Where its objects are, for a dataset in an object store: each reader gets a channel
    /// to them that reaches no further.
    objects: Option<Location>,
    meta: protocol::Opened,
    sizes: SampleSizes,
    /// Its files, as walked before any was parsed (the reader's sealed memfd of them, kept as
    /// it came): what a new reader is held to, and what users are checked against.
    walk: Arc<OwnedFd>,
    /// For a dataset in an object store, its location, which users are checked against
    /// instead (only `allow` grants it).
    url: Option<PathBuf>,
    /// Where it is: its path, or for a pattern the folder the pattern is in (the daemon's
    /// knowledge, not the reader's).
    root: PathBuf,
    max_sample_bytes: u64,
    /// The threads its owner's readers may decode on at once, all their datasets together
    /// (`slots_of`), and how many that is.
    slots: Arc<tokio::sync::Semaphore>,
    slots_each: u32,
    state: Mutex<State>,
    /// Why its files no longer read as they did when it was opened, once a reader said so.
    changed: Mutex<Option<String>>,
    /// A `Check` is being asked of its reader (one at a time).
    checking: std::sync::atomic::AtomicBool,
    /// What its sizes and walk take of the daemon's memory, charged to its owner.
    _charges: Vec<Charge>,
    /// Where what its reader's answers take while held is charged, and to whom.
    account: Arc<Footprint>,
    payer: Payer,
}

/// The reader serving now, and the failures in a row before it.
struct State {
    reader: Option<Arc<Connection>>,
    failures: u32,
    retry_at: Option<Instant>,
    /// A reader is being started (outside the lock); requests meanwhile are told so.
    restarting: bool,
}

impl Drop for RemoteSource {
    fn drop(&mut self) {
        if let Some(r) = self.state.locked().reader.take() {
            r.fail("its dataset is no longer served");
        }
    }
}

/// How long to wait before starting a reader again after `failures` failures in a row.
fn backoff(failures: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1 << failures.clamp(1, 6).saturating_sub(1))
        .min(MOST_BACKOFF)
}

/// The loads in flight at once to the readers of a user's datasets, all of them together (or
/// to one config dataset's reader): two per core, so the threads one user's readers decode on
/// never outnumber another's by more than that (the kernel shares the cores between threads),
/// no user's loads wait for another's, and one config dataset's reader (which a crafted file
/// may have wedged) holds up no other's.
fn slots_of(key: String) -> Arc<tokio::sync::Semaphore> {
    static SLOTS: std::sync::OnceLock<Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>> =
        std::sync::OnceLock::new();
    let per_user = slots_each() as usize;
    let mut slots = SLOTS.get_or_init(Mutex::default).locked();
    slots.retain(|_, s| Arc::strong_count(s) > 1);
    slots
        .entry(key)
        .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(per_user)))
        .clone()
}

/// Two per core (see `slots_of`).
fn slots_each() -> u32 {
    2 * std::thread::available_parallelism().map_or(2, |n| n.get()) as u32
}

/// Opens dataset `c` in a new reader running as `user`, counting in `found` the files its
/// open finds, and charging what it takes of the daemon's memory (each sample's size, its
/// files) to `payer` in `account` before it is allocated.
pub async fn open(
    launcher: &'static Launcher,
    user: User,
    c: &DatasetConfig,
    limits: &Limits,
    found: Arc<AtomicU64>,
    (account, payer): (&Arc<Footprint>, Payer),
) -> Result<Opened> {
    let reader = start(launcher, &user, found).await?;
    let opened = from_reader(
        Some(launcher),
        user,
        c,
        limits,
        reader.clone(),
        (account, payer),
    )
    .await;
    // A reader whose dataset did not open is done with (its process ends).
    opened.inspect_err(|e| reader.fail(&format!("its dataset did not open: {e:#}")))
}

/// A new reader for `user`, greeted.
async fn start(
    launcher: &'static Launcher,
    user: &User,
    found: Arc<AtomicU64>,
) -> Result<Arc<Connection>> {
    let u = user.clone();
    let child = tokio::task::spawn_blocking(move || launcher.spawn_reader(&u))
        .await
        .context("starting a reader")??;
    let reader = Connection::over(child.sock, Some(child.lifeline), found)?;
    greet(reader.clone())
        .await
        .inspect_err(|e| reader.fail(&format!("it did not greet: {e:#}")))
}

/// `reader`, once it has said it speaks this protocol.
async fn greet(reader: Arc<Connection>) -> Result<Arc<Connection>> {
    let m = reader
        .ask(
            Kind::Hello,
            &protocol::hello(),
            &[],
            Kind::Hello,
            LOAD_STALL,
        )
        .await
        .map_err(|e| anyhow!("{e}"))?;
    protocol::check_hello(&m.payload).inspect_err(|e| reader.fail(&format!("{e:#}")))?;
    Ok(reader)
}

/// Opens dataset `c` in `reader`, the first reader of its dataset.
async fn from_reader(
    launcher: Option<&'static Launcher>,
    user: User,
    c: &DatasetConfig,
    limits: &Limits,
    reader: Arc<Connection>,
    charge_to: (&Arc<Footprint>, Payer),
) -> Result<Opened> {
    let objects = crate::objects::is_url(&c.path)
        .then(|| Location::scope_of(&c.path))
        .transpose()?;
    let open_request = protocol::Open {
        table: toml::to_string(&c.to_table()?)?,
        limits: toml::to_string(limits)?,
        walk: false,
        objects: objects.is_some(),
    };
    let what = format!("dataset {:?}", c.name);
    let (meta, sizes, walk, charges) = open_in(
        &reader,
        &open_request,
        None,
        objects.as_ref(),
        limits,
        Some((charge_to.0, charge_to.1, &what)),
    )
    .await?;
    // Who may have it follows from what it is, which the daemon knows: its files as walked
    // before any was parsed, or for an object store its location (which only `allow` grants),
    // never what a reader (one a crafted file took over) says later.
    let url = objects.is_some().then(|| c.path.clone());
    let root = match crate::source::walk::is_pattern(&c.path) {
        true => c.path.parent().map(PathBuf::from).unwrap_or_default(),
        false => c.path.clone(),
    };
    let format = crate::source::format_named(&meta.kind)?;
    let schema = meta.schema.clone();
    let preprocess = Preprocess::Elsewhere(meta.preprocess.clone());
    let source = RemoteSource {
        name: c.name.clone(),
        launcher,
        slots_each: slots_each(),
        slots: slots_of(match charge_to.1 {
            Payer::User(uid) => format!("uid {uid}"),
            Payer::Config | Payer::Tcp => format!("dataset {}", c.name),
        }),
        user,
        open_request,
        objects,
        meta,
        sizes,
        walk,
        url,
        root,
        max_sample_bytes: limits.max_sample_bytes,
        state: Mutex::new(State {
            reader: Some(reader),
            failures: 0,
            retry_at: None,
            restarting: false,
        }),
        changed: Mutex::default(),
        checking: Default::default(),
        _charges: charges,
        account: charge_to.0.clone(),
        payer: charge_to.1,
    };
    Ok(Opened {
        source: Box::new(source),
        preprocess,
        schema,
        format: format as &dyn Format,
    })
}

/// What a dataset's open charges: to whom, and the dataset's name for the message.
type ChargeTo<'a> = (&'a Arc<Footprint>, Payer, &'a str);

/// Opens the dataset in `reader`, handing it `walk` when the daemon has one: what it is, each
/// sample's bytes on disk, and its files as walked; with `charge_to`, what they take of the
/// daemon's memory is charged before they are read in.
async fn open_in(
    reader: &Connection,
    request: &protocol::Open,
    walk: Option<&Arc<OwnedFd>>,
    objects: Option<&Location>,
    limits: &Limits,
    charge_to: Option<ChargeTo<'_>>,
) -> Result<(protocol::Opened, SampleSizes, Arc<OwnedFd>, Vec<Charge>)> {
    let mut charges = vec![];
    let mut charge = |bytes: u64, what: String| -> Result<()> {
        if let Some((account, payer, name)) = charge_to {
            charges.push(account.charge(payer, bytes, &format!("{name}: {what}"))?);
        }
        Ok(())
    };
    let mut raw: Vec<RawFd> = vec![];
    if let Some(walk) = walk {
        raw.push(walk.as_raw_fd());
    }
    // A dataset in an object store: the reader's end of a channel to its objects goes with
    // the request, the daemon's is served until the reader closes it.
    let mut channel = None;
    if let Some(scope) = objects {
        let (ours, theirs) = wire::pair()?;
        super::fetch::serve(ours, scope.clone())?;
        raw.push(theirs.as_raw_fd());
        channel = Some(theirs);
    }
    let request = protocol::Open {
        table: request.table.clone(),
        limits: request.limits.clone(),
        walk: walk.is_some(),
        objects: request.objects,
    };
    let failed = |e: Failure| anyhow!("{e}");
    let mut reply = reader
        .call(Kind::Open, &request.write(), &raw, OPEN_WITHIN)
        .map_err(failed)?;
    drop(channel);
    let mut m = reply.next().await.map_err(failed)?;
    let walk = match walk {
        Some(w) => w.clone(),
        None => {
            reader.expect(&m, Kind::Walked).map_err(failed)?;
            ensure!(m.fds.len() == 1, "a walk without its list");
            let list = m.fds.pop().expect("one");
            // Kept as it came (sealed: it cannot change), never read here: charged by its
            // length, checked before anything of it is touched.
            let len = wire::sealed_len(&list, protocol::MOST_WALK_BYTES)?;
            charge(len, format!("its list of files ({len} bytes)"))?;
            m = reply.next().await.map_err(failed)?;
            Arc::new(list)
        }
    };
    reader.expect(&m, Kind::Opened).map_err(failed)?;
    let meta = protocol::Opened::read(&m.payload)?;
    ensure!(
        (1..=protocol::MOST_LOAD_SAMPLES).contains(&meta.granule),
        "a granule of {}",
        meta.granule
    );
    ensure!(meta.len <= 1 << 40, "{} samples", meta.len);
    if let Some(bytes) = meta.schema.fixed_record_bytes() {
        ensure!(bytes <= limits.max_sample_bytes, "samples of {bytes} bytes");
    }
    // A sample's bytes on disk weigh its place in the memory tier: at most a sample's limit.
    let sizes = match meta.sizes {
        Sizes::Each(n) => SampleSizes::Each(n.min(limits.max_sample_bytes)),
        Sizes::PerSample => {
            let want = meta.len.checked_mul(4).context("sizes past any memfd")?;
            charge(want, format!("the sizes of its {} samples", meta.len))?;
            // Mapped, not read whole: only the bytes taken below are copied.
            let map = wire::map_sealed(m.fd().context("no sizes beside the answer")?, want)?;
            let bulk: &[u8] = map.as_deref().unwrap_or(&[]);
            ensure!(
                bulk.len() as u64 == want,
                "sizes for {} samples",
                bulk.len() / 4
            );
            let most = limits.max_sample_bytes.min(u32::MAX as u64) as u32;
            SampleSizes::PerSample(
                bulk.chunks_exact(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()).min(most))
                    .collect(),
            )
        }
    };
    Ok((meta, sizes, walk, charges))
}

impl RemoteSource {
    /// The reader serving now, started (again) if there is none and the backoff allows. The
    /// start runs outside the lock: requests meanwhile are told the reader is starting.
    async fn reader(&self) -> Result<Arc<Connection>> {
        let launcher = {
            let mut state = self.state.locked();
            if let Some(r) = &state.reader {
                match r.dead() {
                    None => return Ok(r.clone()),
                    Some(why) => {
                        state.reader = None;
                        state.failures += 1;
                        let wait = backoff(state.failures);
                        state.retry_at = Some(Instant::now() + wait);
                        tracing::warn!(dataset = %self.name, uid = self.user.uid, "reader failed: {why}; started again in {} s at the earliest", wait.as_secs());
                        return Err(self.unavailable(&why));
                    }
                }
            }
            if state.restarting {
                return Err(self.unavailable("its reader is being started again"));
            }
            if let Some(at) = state.retry_at.filter(|at| Instant::now() < *at) {
                let left = at.saturating_duration_since(Instant::now()).as_secs() + 1;
                return Err(self.unavailable(&format!(
                    "its reader failed; it is started again in {left} s"
                )));
            }
            let launcher = self.launcher.ok_or_else(|| {
                self.unavailable("its reader failed, and none is started again here")
            })?;
            state.restarting = true;
            launcher
        };
        let limits = Limits {
            max_sample_bytes: self.max_sample_bytes,
            ..Limits::default()
        };
        // The new reader is given the walk: it opens no file but those, and walks nothing.
        let started = async {
            let r = start(launcher, &self.user, Arc::default()).await?;
            let opened = open_in(
                &r,
                &self.open_request,
                Some(&self.walk),
                self.objects.as_ref(),
                &limits,
                None,
            )
            .await;
            match opened {
                Ok((meta, ..)) => Ok((r, meta)),
                Err(e) => {
                    r.fail(&format!("its dataset did not open again: {e:#}"));
                    Err(e)
                }
            }
        }
        .await;
        let mut state = self.state.locked();
        state.restarting = false;
        let failed = |state: &mut State| {
            state.failures += 1;
            state.retry_at = Some(Instant::now() + backoff(state.failures));
        };
        match started {
            Ok((r, meta)) if meta == self.meta => {
                state.reader = Some(r.clone());
                Ok(r)
            }
            Ok((r, _)) => {
                r.fail("it finds other data than the dataset opened");
                failed(&mut state);
                let why = format!(
                    "dataset {:?} changed since it was opened (its reader, started again, finds other data); it is opened again",
                    self.name
                );
                *self.changed.locked() = Some(why.clone());
                Err(Error::new(ErrorKind::Changed, why).into())
            }
            Err(e) => {
                failed(&mut state);
                Err(self.unavailable(&format!("its reader does not start: {e:#}")))
            }
        }
    }

    fn unavailable(&self, why: &str) -> anyhow::Error {
        Error::new(
            ErrorKind::Reader,
            format!("dataset {:?} is not served now: {why}", self.name),
        )
        .into()
    }

    /// Samples `start..start + count` from the reader: each its record (checked against the
    /// schema and the limit) or why not, and the raw bytes read.
    async fn load_now(&self, ranges: &[(u64, u64)]) -> Result<crate::source::Loaded> {
        let asked = Asked::new(ranges, self.meta.len)?;
        let count = asked.len();
        let reader = self.reader().await?;
        // Slots of the owner's, held while the reader works for this load (one per thread it
        // may decode on): no thread of the daemon waits. A load is granted at most half the
        // owner's slots (the cores), so a stream's next load is already with the reader while
        // the daemon takes the answer to this one, and the reader's threads never wait for it.
        let threads = (ranges.len() as u32).clamp(1, (self.slots_each / 2).max(1));
        let _slots = self
            .slots
            .acquire_many(threads)
            .await
            .context("the daemon is stopping")?;
        let load = protocol::Load {
            threads,
            ranges: ranges.to_vec(),
        };
        let mut held = vec![];
        let answered = async {
            let mut reply = reader.call(Kind::Load, &load.write(), &[], LOAD_STALL)?;
            let mut records: Vec<Option<Result<Vec<u8>>>> = (0..count).map(|_| None).collect();
            loop {
                let m = reply.next().await?;
                let lied = |e: anyhow::Error| {
                    reader.fail(&format!("the reader's answer does not hold: {e:#}"));
                    Failure::Dead(format!("its reader sent what does not hold ({e:#})"))
                };
                match Kind::try_from(m.kind) {
                    Ok(Kind::Samples) => {
                        match self.take_samples(&m, &asked, &mut records) {
                            Ok(charge) => held.push(charge),
                            // Over the owner's share: the load fails, the reader is not to
                            // blame (its answers may be honest and large).
                            Err(Taken::Refused(e)) => return Err(Failure::Refused(e)),
                            Err(Taken::Lied(e)) => return Err(lied(e)),
                        }
                    }
                    Ok(Kind::Done) => {
                        let done = (|| {
                            let (raw, n) = protocol::read_done(&m.payload)?;
                            ensure!(n == count, "{n} samples for {count} asked");
                            let all = records.into_iter().collect::<Option<Vec<_>>>();
                            Ok((all.context("a load done without all its samples")?, raw))
                        })();
                        return done.map_err(lied);
                    }
                    _ => {
                        reader.expect(&m, Kind::Done)?;
                    }
                }
            }
        }
        .await;
        match answered {
            Ok((records, raw_bytes)) => {
                self.state.locked().failures = 0;
                Ok(crate::source::Loaded {
                    records,
                    raw_bytes,
                    held,
                })
            }
            // The reader's own failure to answer: the stream ends, no sample is to blame.
            Err(Failure::Refused(why)) => {
                Err(self.unavailable(&format!("its reader failed a read: {why}")))
            }
            // Seen at the next request, which starts the reader again after the backoff.
            Err(Failure::Dead(why)) => Err(self.unavailable(&why)),
        }
    }

    /// The samples of a `Samples` answer into `records` (of the samples from `start`), each
    /// checked against the schema and the limit (in the message after its table, or in the
    /// memfd beside it), charged to the owner before they are copied.
    fn take_samples(
        &self,
        m: &wire::Message,
        asked: &Asked,
        records: &mut [Option<Result<Vec<u8>>>],
    ) -> Result<Charge, Taken> {
        let (table, mut rest) = protocol::read_samples(&m.payload).map_err(Taken::Lied)?;
        (|| {
            ensure!(!table.is_empty(), "an answer of no samples");
            Ok(())
        })()
        .map_err(Taken::Lied)?;
        let bytes: u64 = table
            .iter()
            .map(|(_, o)| match o {
                Outcome::Record { len, .. } => *len,
                Outcome::Bad(why) | Outcome::Changed(why) => why.len() as u64,
            })
            .fold(0u64, u64::saturating_add);
        let charge = self
            .account
            .charge(
                self.payer,
                bytes,
                &format!("dataset {:?}: samples its reader answered", self.name),
            )
            .map_err(|e| Taken::Refused(e.to_string()))?;
        (|| {
            let most = (table.len() as u64)
                .saturating_mul(self.max_sample_bytes)
                .min(MOST_ANSWER_BYTES);
            // Records in a sealed memfd are read out with pread, each into its own allocation
            // (one copy, no mapping to fault in and tear down); inline ones are in the message.
            let file = match m.fd() {
                Some(fd) => {
                    rest.end()?;
                    let len = wire::sealed_len(fd, most)?;
                    Some((std::fs::File::from(fd.try_clone()?), len))
                }
                None => None,
            };
            let inline: &[u8] = rest.rest();
            let total = file.as_ref().map_or(inline.len() as u64, |(_, len)| *len);
            for (i, outcome) in table {
                let slot = asked
                    .position(i)
                    .and_then(|k| records.get_mut(k))
                    .with_context(|| format!("sample {i}, which was not asked"))?;
                ensure!(slot.is_none(), "sample {i} answered twice");
                *slot = Some(match outcome {
                    Outcome::Record { at, len } => {
                        ensure!(len <= self.max_sample_bytes, "a record of {len} bytes");
                        let end = at
                            .checked_add(len)
                            .filter(|&e| e <= total)
                            .context("a record past the end of the answer's records")?;
                        let record = match &file {
                            Some((f, _)) => {
                                let mut record = vec![0u8; len as usize];
                                std::os::unix::fs::FileExt::read_exact_at(f, &mut record, at)
                                    .context("reading a record from the answer's memfd")?;
                                record
                            }
                            None => inline[at as usize..end as usize].to_vec(),
                        };
                        self.meta
                            .schema
                            .decode(&record)
                            .context("a record that does not fit the dataset's fields")?;
                        Ok(record)
                    }
                    Outcome::Bad(why) => Err(anyhow!("{why}")),
                    Outcome::Changed(why) => {
                        *self.changed.locked() = Some(why.clone());
                        Err(Error::new(ErrorKind::Changed, why).into())
                    }
                });
            }
            Ok(())
        })()
        .map_err(Taken::Lied)?;
        Ok(charge)
    }

    /// Asks the reader serving now whether the dataset's files still read as they did (an
    /// image folder with files added, a file rewritten), and notes its answer for `changed`.
    /// Does nothing while no reader serves (a new one compares what it finds at its start).
    pub async fn recheck(&self) {
        let Some(reader) = self.state.locked().reader.clone() else {
            return;
        };
        // One at a time: a reader slow to answer is not asked again meanwhile.
        if self.checking.swap(true, Relaxed) {
            return;
        }
        struct Done<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.store(false, Relaxed);
            }
        }
        let _done = Done(&self.checking);
        if let Ok(m) = reader
            .ask(Kind::Check, &[], &[], Kind::Checked, LOAD_STALL)
            .await
        {
            match protocol::read_checked(&m.payload) {
                Ok(Some(why)) => *self.changed.locked() = Some(why),
                Ok(None) => {}
                Err(e) => reader.fail(&format!("the reader's answer does not hold: {e:#}")),
            }
        }
    }
}

impl Prepared for RemoteSource {
    fn down(&self) -> Option<String> {
        let state = self.state.locked();
        if let Some(why) = state.reader.as_ref().and_then(|r| r.dead()) {
            return Some(format!("its reader failed: {why}"));
        }
        if state.restarting {
            return Some("its reader is being started again".into());
        }
        state
            .retry_at
            .filter(|at| Instant::now() < *at)
            .map(|_| "its reader failed; it is started again after a backoff".into())
    }

    fn load<'a>(
        &'a self,
        ranges: &'a [(u64, u64)],
    ) -> BoxFuture<'a, Result<crate::source::Loaded>> {
        Box::pin(self.load_now(ranges))
    }

    fn recheck(&self) -> BoxFuture<'_, ()> {
        Box::pin(RemoteSource::recheck(self))
    }
}

impl RawSource for RemoteSource {
    fn len(&self) -> u64 {
        self.meta.len
    }

    fn read_range(&self, _start: u64, _count: u64) -> Result<Vec<RawSample>> {
        bail!(
            "dataset {:?} is read by its reader (see `prepared`)",
            self.name
        )
    }

    fn read_granule(&self) -> u64 {
        self.meta.granule
    }

    fn disk_bytes(&self) -> u64 {
        self.meta.disk_bytes
    }

    fn disk_bytes_each(&self) -> Option<u64> {
        match &self.sizes {
            SampleSizes::Each(n) => Some(*n),
            SampleSizes::PerSample(_) => None,
        }
    }

    fn disk_bytes_of(&self, index: u64) -> u64 {
        match &self.sizes {
            SampleSizes::Each(n) => *n,
            SampleSizes::PerSample(s) => s.get(index as usize).map_or(0, |&n| n as u64),
        }
    }

    fn describe(&self) -> String {
        self.meta.describe.clone()
    }

    fn prepared(&self) -> Option<&dyn Prepared> {
        Some(self)
    }
}

impl Provenance for RemoteSource {
    fn version(&self) -> String {
        self.meta.version.clone()
    }

    /// What a reader found changed, or the owner's groups changed (one taken out of a group
    /// reads no more through larder than they could themselves: the dataset is opened again,
    /// in a reader with their groups as they are). Never waits on a reader.
    fn changed(&self) -> Option<String> {
        let now = crate::access::Identity::of_user_primary(self.user.uid);
        if (now.gid, &now.groups) != (self.user.gid, &self.user.groups) {
            return Some(format!(
                "the groups of its owner (uid {}) changed",
                self.user.uid
            ));
        }
        self.changed.locked().clone()
    }

    fn files(&self) -> crate::access::Files {
        match &self.url {
            Some(url) => crate::access::Files::List(Arc::from(vec![url.clone()])),
            None => crate::access::Files::Sealed(self.walk.clone()),
        }
    }

    fn root(&self) -> &Path {
        &self.root
    }
}

#[cfg(test)]
mod tests;
