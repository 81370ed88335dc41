//! The daemon's side of a reader: a dataset a user added, opened and read in a reader process
//! running as its owner (see `reader`), seen by the rest of the daemon as a `Source` whose
//! samples come prepared. Everything a reader says is checked before it is used: lengths and
//! offsets against the memfd that holds the bytes, each record against the dataset's schema
//! and the sample limit, what it is against what it was when first opened.
//!
//! A reader that crashes, hangs (no answer within [`ANSWER_WITHIN`]) or lies costs its
//! dataset's streams an error naming the dataset (UNAVAILABLE), and is started again on the
//! next request, no sooner than a backoff that doubles with each failure in a row (1 s to 30 s).
//! The daemon and every other dataset go on.

use super::launcher::{Launcher, User};
use super::reader::{self, FAILED, LOAD, OPEN, SAMPLE_BAD, SAMPLE_CHANGED, SAMPLE_OK};
use super::wire::{self, Writer};
use crate::config::{DatasetConfig, Limits};
use crate::error::{Error, Kind};
use crate::fields::Schema;
use crate::objects::Location;
use crate::pipeline::Preprocess;
use crate::source::{Format, Opened, Prepared, Provenance, RawSample, RawSource};
use anyhow::{anyhow, bail, ensure, Context, Result};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a reader has to answer a request before it is taken for hung, and how much longer
/// for each sample of it.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(8);
const PER_SAMPLE: Duration = Duration::from_millis(50);
/// The most bytes of records one answer may hold (a granule's).
const MOST_ANSWER_BYTES: u64 = 256 << 20;
/// The most bytes of what a dataset is (sizes and file names).
const MOST_META_BYTES: u64 = 1 << 30;
/// How long opening a dataset may take (a large folder is walked).
pub const OPEN_WITHIN: Duration = Duration::from_secs(600);
/// Restarts after failures in a row wait this long, doubling, up to `MOST_BACKOFF`.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MOST_BACKOFF: Duration = Duration::from_secs(30);

/// Readers that failed, since the daemon started.
pub static READER_FAILURES: AtomicU64 = AtomicU64::new(0);

/// One reader process: its socket, and the answers its requests wait for.
struct Connection {
    sock: OwnedFd,
    pending: Mutex<HashMap<u64, mpsc::Sender<wire::Message>>>,
    next: AtomicU64,
    /// Why it no longer serves, once it does not.
    dead: Mutex<Option<String>>,
}

impl Connection {
    /// A reader for `user`, from the launcher; its answers are read on a thread of its own.
    fn start(launcher: &Launcher, user: &User) -> Result<Arc<Connection>> {
        Connection::over(launcher.spawn_reader(user)?)
    }

    /// The reader at the other end of `sock`.
    fn over(sock: OwnedFd) -> Result<Arc<Connection>> {
        let c = Arc::new(Connection {
            sock,
            pending: Mutex::default(),
            next: AtomicU64::new(1),
            dead: Mutex::default(),
        });
        let weak = Arc::downgrade(&c);
        // The thread reads through a descriptor of its own: the connection's may be closed
        // (and its number reused by another socket) while the thread still waits on it; a
        // shutdown of either ends the wait.
        let own = c.sock.try_clone().context("a reader's socket")?;
        std::thread::Builder::new()
            .name("larder-reader-answers".into())
            .spawn(move || loop {
                let got = wire::recv(own.as_raw_fd());
                let Some(c) = weak.upgrade() else { return };
                let m = match got {
                    Ok(Some(m)) => m,
                    Ok(None) => {
                        return c.fail("the reader process ended (it crashed or was killed)")
                    }
                    Err(e) => {
                        return c.fail(&format!("the reader sent what is not a message: {e:#}"))
                    }
                };
                let waiting = c
                    .pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&m.id);
                match waiting {
                    Some(tx) => {
                        let _ = tx.send(m);
                    }
                    None => {
                        return c.fail(&format!(
                            "the reader answered request {} that was not asked",
                            m.id
                        ))
                    }
                }
            })
            .context("starting the thread that reads a reader's answers")?;
        Ok(c)
    }

    /// Marks the reader failed: every request waiting and to come gets `why`.
    fn fail(&self, why: &str) {
        let mut dead = self.dead.lock().unwrap_or_else(|e| e.into_inner());
        if dead.is_none() {
            *dead = Some(why.to_string());
            READER_FAILURES.fetch_add(1, Relaxed);
        }
        drop(dead);
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        // SAFETY: shutdown on our own socket; the reader sees it closed and ends.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
    }

    fn dead(&self) -> Option<String> {
        self.dead.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sends a request and waits for its answer; a reader's own error comes back as Err(Ok(why)),
    /// a failed reader as Err(Err(why)).
    fn call(
        &self,
        kind: u8,
        payload: &[u8],
        within: Duration,
    ) -> Result<wire::Message, Result<String, String>> {
        self.call_with(kind, payload, None, within)
    }

    /// `call`, with `fd` sent beside the request.
    fn call_with(
        &self,
        kind: u8,
        payload: &[u8],
        fd: Option<&OwnedFd>,
        within: Duration,
    ) -> Result<wire::Message, Result<String, String>> {
        if let Some(why) = self.dead() {
            return Err(Err(why));
        }
        let id = self.next.fetch_add(1, Relaxed);
        let (tx, rx) = mpsc::channel();
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, tx);
        let fd = fd.map(|f| f.as_raw_fd());
        if let Err(e) = wire::send(self.sock.as_raw_fd(), kind, id, payload, fd) {
            self.fail(&format!("sending to the reader: {e:#}"));
            return Err(Err(self.dead().unwrap_or_default()));
        }
        match rx.recv_timeout(within) {
            Ok(m) if m.kind == FAILED => Err(Ok(String::from_utf8_lossy(&m.payload).into_owned())),
            Ok(m) if m.kind == kind => Ok(m),
            Ok(m) => {
                self.fail(&format!(
                    "the reader answered a request of kind {kind} with kind {}",
                    m.kind
                ));
                Err(Err(self.dead().unwrap_or_default()))
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.fail(&format!(
                    "the reader did not answer within {} s",
                    within.as_secs()
                ));
                Err(Err(self.dead().unwrap_or_default()))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(Err(self
                .dead()
                .unwrap_or_else(|| "the reader ended".into()))),
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        // SAFETY: shutdown on our own socket: the answers' thread and the reader both end.
        unsafe { libc::shutdown(self.sock.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

/// What a reader says its dataset is.
#[derive(Debug, Clone, PartialEq)]
struct Meta {
    kind: String,
    len: u64,
    granule: u64,
    disk_bytes: u64,
    describe: String,
    version: String,
    root: PathBuf,
    preprocess: String,
    schema: Schema,
}

/// A user's dataset read by readers running as its owner.
pub struct RemoteSource {
    name: String,
    /// Where a new reader comes from after a failure (None: nowhere; the tests' readers).
    launcher: Option<&'static Launcher>,
    user: User,
    /// The request that opens it: its table and the limits, as TOML.
    open_request: Vec<u8>,
    /// Where its objects are, for a dataset in an object store: each reader gets a channel
    /// to them that reaches no further.
    objects: Option<Location>,
    meta: Meta,
    sizes: Vec<u64>,
    files: Arc<[PathBuf]>,
    max_sample_bytes: u64,
    state: Mutex<State>,
    /// Why its files no longer read as they did when it was opened, once a reader said so.
    changed: Mutex<Option<String>>,
}

/// The reader serving now, and the failures in a row before it.
struct State {
    reader: Option<Arc<Connection>>,
    failures: u32,
    retry_at: Option<Instant>,
    /// A reader is being started (outside the lock); requests meanwhile are told so.
    restarting: bool,
}

/// How long to wait before starting a reader again after `failures` failures in a row.
fn backoff(failures: u32) -> Duration {
    FIRST_BACKOFF
        .saturating_mul(1 << failures.clamp(1, 6).saturating_sub(1))
        .min(MOST_BACKOFF)
}

/// Opens dataset `c` (a user's) in a reader running as `user`.
pub fn open(
    launcher: &'static Launcher,
    user: User,
    c: &DatasetConfig,
    limits: &Limits,
) -> Result<Opened> {
    let mut w = Writer::default();
    w.str(&toml::to_string(&c.to_table()?)?)
        .str(&toml::to_string(limits)?);
    let open_request = w.0;
    let reader = Connection::start(launcher, &user)?;
    from_reader(Some(launcher), user, c, limits, open_request, reader)
}

/// Opens dataset `c` in `reader`, the first reader of its dataset.
fn from_reader(
    launcher: Option<&'static Launcher>,
    user: User,
    c: &DatasetConfig,
    limits: &Limits,
    open_request: Vec<u8>,
    reader: Arc<Connection>,
) -> Result<Opened> {
    let objects = crate::objects::is_url(&c.path)
        .then(|| Location::scope_of(&c.path))
        .transpose()?;
    let (meta, sizes, mut files) = open_in(&reader, &open_request, objects.as_ref(), limits)?;
    if objects.is_some() {
        // Who may have it follows from where it is, which the daemon knows: not from what a
        // reader (one a crafted object took over) says its files are.
        files = vec![c.path.clone()];
    }
    let format = crate::source::format_named(&meta.kind)?;
    let schema = meta.schema.clone();
    let preprocess = Preprocess::Elsewhere(meta.preprocess.clone());
    let source = RemoteSource {
        name: c.name.clone(),
        launcher,
        user,
        open_request,
        objects,
        meta,
        sizes,
        files: files.into(),
        max_sample_bytes: limits.max_sample_bytes,
        state: Mutex::new(State {
            reader: Some(reader),
            failures: 0,
            retry_at: None,
            restarting: false,
        }),
        changed: Mutex::default(),
    };
    Ok(Opened {
        source: Box::new(source),
        preprocess,
        schema,
        format: format as &dyn Format,
    })
}

/// Opens the dataset in `reader`: what it is, each sample's bytes on disk, its files.
fn open_in(
    reader: &Connection,
    request: &[u8],
    objects: Option<&Location>,
    limits: &Limits,
) -> Result<(Meta, Vec<u64>, Vec<PathBuf>)> {
    // A dataset in an object store: the reader's end of a channel to its objects goes with
    // the request, the daemon's is served until the reader closes it.
    let channel = match objects {
        Some(scope) => {
            let (ours, theirs) = wire::pair()?;
            super::fetch::serve(ours, scope.clone())?;
            Some(theirs)
        }
        None => None,
    };
    let m = reader
        .call_with(OPEN, request, channel.as_ref(), OPEN_WITHIN)
        .map_err(|e| match e {
            Ok(why) => anyhow!("{why}"),
            Err(why) => anyhow!("{why}"),
        })?;
    let mut r = wire::Reader::new(&m.payload);
    let meta = Meta {
        kind: r.str()?.to_string(),
        len: r.u64()?,
        granule: r.u64()?,
        disk_bytes: r.u64()?,
        describe: r.str()?.to_string(),
        version: r.str()?.to_string(),
        root: PathBuf::from(r.str()?),
        preprocess: r.str()?.to_string(),
        schema: reader::read_schema(&mut r)?,
    };
    r.end()?;
    ensure!(
        (1..=crate::source::MAX_GRANULE).contains(&meta.granule),
        "a granule of {}",
        meta.granule
    );
    ensure!(meta.len <= 1 << 32, "{} samples", meta.len);
    if let Some(bytes) = meta.schema.fixed_record_bytes() {
        ensure!(bytes <= limits.max_sample_bytes, "samples of {bytes} bytes");
    }
    // Mapped, not read whole: only the bytes taken below are copied.
    let map = wire::map_sealed(m.fd.as_ref().context("no metadata")?, MOST_META_BYTES)?;
    let bulk: &[u8] = map.as_deref().unwrap_or(&[]);
    let sizes_end = meta
        .len
        .checked_mul(8)
        .filter(|&n| n <= bulk.len() as u64)
        .context("sizes past the metadata's end")? as usize;
    // A sample's bytes on disk weigh its place in the memory tier: at most a sample's limit.
    let sizes = bulk[..sizes_end]
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()).min(limits.max_sample_bytes))
        .collect();
    let files = wire::paths_of(&bulk[sizes_end..]);
    Ok((meta, sizes, files))
}

impl RemoteSource {
    /// The reader serving now, started (again) if there is none and the backoff allows. The
    /// start runs outside the lock: requests meanwhile are told the reader is starting.
    fn reader(&self) -> Result<Arc<Connection>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
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
        let launcher = self
            .launcher
            .ok_or_else(|| self.unavailable("its reader failed, and none is started again here"))?;
        state.restarting = true;
        drop(state);
        let limits = Limits {
            max_sample_bytes: self.max_sample_bytes,
            ..Limits::default()
        };
        let started = Connection::start(launcher, &self.user).and_then(|r| {
            open_in(&r, &self.open_request, self.objects.as_ref(), &limits).map(|m| (r, m))
        });
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.restarting = false;
        let failed = |state: &mut State| {
            state.failures += 1;
            state.retry_at = Some(Instant::now() + backoff(state.failures));
        };
        match started {
            Ok((r, (meta, _, _))) if meta == self.meta => {
                state.reader = Some(r.clone());
                Ok(r)
            }
            Ok(_) => {
                failed(&mut state);
                let why = format!(
                    "dataset {:?} changed since it was opened (its reader, started again, finds other data); it is opened again",
                    self.name
                );
                *self.changed.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
                Err(Error::new(Kind::Changed, why).into())
            }
            Err(e) => {
                failed(&mut state);
                Err(self.unavailable(&format!("its reader does not start: {e:#}")))
            }
        }
    }

    fn unavailable(&self, why: &str) -> anyhow::Error {
        Error::new(
            Kind::Reader,
            format!("dataset {:?} is not served now: {why}", self.name),
        )
        .into()
    }

    /// The records of a `LOAD` answer, each checked against the schema and the limit: in the
    /// message after its table, or in the memfd beside it.
    fn records(&self, m: &wire::Message, count: u64) -> Result<(Vec<Result<Vec<u8>>>, u64)> {
        enum Outcome {
            Record(u64, u64),
            Failed(anyhow::Error),
        }
        let mut r = wire::Reader::new(&m.payload);
        let raw_bytes = r.u64()?;
        let n = r.u32()? as u64;
        ensure!(n == count, "{n} samples for {count} asked");
        let mut outcomes = Vec::with_capacity(n as usize);
        for _ in 0..n {
            outcomes.push(match r.u8()? {
                SAMPLE_OK => {
                    let (at, len) = (r.u64()?, r.u64()?);
                    ensure!(len <= self.max_sample_bytes, "a record of {len} bytes");
                    Outcome::Record(at, len)
                }
                SAMPLE_BAD => Outcome::Failed(anyhow!("{}", r.str()?)),
                SAMPLE_CHANGED => {
                    let why = r.str()?.to_string();
                    *self.changed.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
                    Outcome::Failed(Error::new(Kind::Changed, why).into())
                }
                k => bail!("a sample outcome {k}"),
            });
        }
        let most = count
            .saturating_mul(self.max_sample_bytes)
            .min(MOST_ANSWER_BYTES);
        let map = match &m.fd {
            Some(fd) => {
                r.end()?;
                wire::map_sealed(fd, most)?
            }
            None => None,
        };
        let bytes: &[u8] = match &map {
            Some(map) => map,
            None => r.rest(),
        };
        outcomes
            .into_iter()
            .map(|o| match o {
                Outcome::Record(at, len) => {
                    let end = at
                        .checked_add(len)
                        .filter(|&e| e <= bytes.len() as u64)
                        .context("a record past the end of the answer's records")?;
                    let record = bytes[at as usize..end as usize].to_vec();
                    self.meta
                        .schema
                        .decode(&record)
                        .context("a record that does not fit the dataset's fields")?;
                    Ok(Ok(record))
                }
                Outcome::Failed(e) => Ok(Err(e)),
            })
            .collect::<Result<Vec<_>>>()
            .map(|records| (records, raw_bytes))
    }
}

impl Prepared for RemoteSource {
    fn down(&self) -> Option<String> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
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

    fn load(&self, start: u64, count: u64) -> Result<(Vec<Result<Vec<u8>>>, u64)> {
        ensure!(
            count > 0 && start.checked_add(count).is_some_and(|e| e <= self.meta.len),
            "samples {start}..+{count} of {}",
            self.meta.len
        );
        let reader = self.reader()?;
        let mut w = Writer::default();
        w.u64(start).u64(count);
        let within = ANSWER_WITHIN + PER_SAMPLE * count.min(1 << 16) as u32;
        match reader.call(LOAD, &w.0, within) {
            Ok(m) => {
                let records = self.records(&m, count).map_err(|e| {
                    reader.fail(&format!("the reader's answer does not hold: {e:#}"));
                    self.unavailable(&format!("its reader sent what does not hold ({e:#})"))
                })?;
                self.state
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .failures = 0;
                Ok(records)
            }
            // The reader's own failure to answer: the stream ends, no sample is to blame.
            Err(Ok(why)) => Err(self.unavailable(&format!("its reader failed a read: {why}"))),
            Err(Err(why)) => {
                // Seen at the next request, which starts the reader again after the backoff.
                Err(self.unavailable(&why))
            }
        }
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

    fn disk_bytes_of(&self, index: u64) -> u64 {
        self.sizes.get(index as usize).copied().unwrap_or(0)
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
        self.changed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn files(&self) -> Arc<[PathBuf]> {
        self.files.clone()
    }

    fn root(&self) -> &Path {
        &self.meta.root
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fields::{DType, FieldSpec};

    /// What a lying reader answers to a `LOAD` of samples 0..2 (after an honest `OPEN`).
    enum Lie {
        PastTheEnd,
        NotTheSchema,
        Unsealed,
        WrongCount,
        NotAsked,
        Silent,
        Gone,
    }

    /// A dataset of two samples of one uint8 [4] field, read by a fake reader that lies.
    fn lied_to(lie: Lie) -> anyhow::Error {
        let (daemon_end, reader_end) = wire::pair().unwrap();
        std::thread::spawn(move || {
            let fd = reader_end.as_raw_fd();
            while let Ok(Some(m)) = wire::recv(fd) {
                if m.kind == OPEN {
                    let (payload, bulk) = honest_open();
                    let bulk = wire::sealed_memfd("m", &bulk.unwrap()).unwrap();
                    wire::send(fd, OPEN, m.id, &payload, Some(bulk.as_raw_fd())).unwrap();
                    continue;
                }
                let records = |n: usize| wire::sealed_memfd("r", &vec![7u8; n]).unwrap();
                let mut w = Writer::default();
                w.u64(8);
                let (id, memfd) = match lie {
                    Lie::PastTheEnd => {
                        w.u32(2)
                            .u8(SAMPLE_OK)
                            .u64(0)
                            .u64(4)
                            .u8(SAMPLE_OK)
                            .u64(4)
                            .u64(4);
                        (m.id, records(6))
                    }
                    Lie::NotTheSchema => {
                        w.u32(2)
                            .u8(SAMPLE_OK)
                            .u64(0)
                            .u64(3)
                            .u8(SAMPLE_OK)
                            .u64(3)
                            .u64(5);
                        (m.id, records(8))
                    }
                    Lie::Unsealed => {
                        w.u32(2)
                            .u8(SAMPLE_OK)
                            .u64(0)
                            .u64(4)
                            .u8(SAMPLE_OK)
                            .u64(4)
                            .u64(4);
                        (m.id, OwnedFd::from(tempfile::tempfile().unwrap()))
                    }
                    Lie::WrongCount => {
                        w.u32(1).u8(SAMPLE_OK).u64(0).u64(4);
                        (m.id, records(4))
                    }
                    Lie::NotAsked => {
                        w.u32(2)
                            .u8(SAMPLE_OK)
                            .u64(0)
                            .u64(4)
                            .u8(SAMPLE_OK)
                            .u64(4)
                            .u64(4);
                        (m.id + 1000, records(8))
                    }
                    Lie::Silent => continue,
                    Lie::Gone => return,
                };
                let _ = wire::send(fd, LOAD, id, &w.0, Some(memfd.as_raw_fd()));
            }
        });
        let table = "name = \"u/x\"\npath = \"/fake\"".to_string();
        let c = DatasetConfig::from_table(toml::from_str(&table).unwrap()).unwrap();
        let user = User {
            uid: 1000,
            gid: 1000,
            groups: vec![],
        };
        let opened = from_reader(
            None,
            user,
            &c,
            &Limits::default(),
            vec![],
            Connection::over(daemon_end).unwrap(),
        )
        .unwrap();
        let source = opened.source;
        let p = source.prepared().unwrap();
        let started = Instant::now();
        let err = p.load(0, 2).unwrap_err();
        assert!(started.elapsed() < ANSWER_WITHIN + Duration::from_secs(2));
        assert_eq!(Error::kind_of(&err), Kind::Reader, "{err:#}");
        assert!(
            format!("{err:#}").contains("\"u/x\" is not served now"),
            "{err:#}"
        );
        // The reader is done with: the next request says so at once.
        let again = p.load(0, 1).unwrap_err();
        assert_eq!(Error::kind_of(&again), Kind::Reader, "{again:#}");
        err
    }

    #[test]
    fn a_reader_that_lies_or_fails_costs_its_dataset_a_clear_error() {
        for (lie, says) in [
            (Lie::PastTheEnd, "past the end of the answer's records"),
            (Lie::NotTheSchema, "does not fit the dataset's fields"),
            (Lie::Unsealed, "not sealed"),
            (Lie::WrongCount, "1 samples for 2 asked"),
            (Lie::NotAsked, "not asked"),
            (Lie::Gone, "the reader process ended"),
        ] {
            let err = format!("{:#}", lied_to(lie));
            assert!(err.contains(says), "{says}: {err}");
        }
    }

    #[test]
    fn an_object_stores_access_follows_its_path_not_what_its_reader_says() {
        // The reader says its files are /fake (which a user might read); the dataset is in an
        // object store, so access is checked against its URL, which only `allow` grants.
        let opened = fake_reader_at("s3://data/train", honest_open(), honest_load()).unwrap();
        assert_eq!(
            &opened.source.files()[..],
            &[PathBuf::from("s3://data/train")]
        );
    }

    #[test]
    fn a_reader_that_hangs_is_given_up_on() {
        let err = format!("{:#}", lied_to(Lie::Silent));
        assert!(err.contains("did not answer within 8 s"), "{err}");
    }

    /// A fake reader answering `OPEN` with `open` and every `LOAD` with `load` (payload, and
    /// the bytes of the memfd beside it).
    type Answer = (Vec<u8>, Option<Vec<u8>>);

    fn fake_reader(open: Answer, load: Answer) -> Result<Opened> {
        fake_reader_at("/fake", open, load)
    }

    /// `fake_reader`, for a dataset at `path`.
    fn fake_reader_at(path: &str, open: Answer, load: Answer) -> Result<Opened> {
        let (daemon_end, reader_end) = wire::pair().unwrap();
        std::thread::spawn(move || {
            let fd = reader_end.as_raw_fd();
            while let Ok(Some(m)) = wire::recv(fd) {
                let (payload, bulk) = if m.kind == OPEN { &open } else { &load };
                let memfd = bulk.as_ref().map(|b| wire::sealed_memfd("f", b).unwrap());
                let _ = wire::send(
                    fd,
                    m.kind,
                    m.id,
                    payload,
                    memfd.as_ref().map(|f| f.as_raw_fd()),
                );
            }
        });
        let table = format!("name = \"u/x\"\npath = \"{path}\"");
        let c = DatasetConfig::from_table(toml::from_str(&table).unwrap()).unwrap();
        let user = User {
            uid: 1000,
            gid: 1000,
            groups: vec![],
        };
        from_reader(
            None,
            user,
            &c,
            &Limits::default(),
            vec![],
            Connection::over(daemon_end).unwrap(),
        )
    }

    /// An honest `OPEN` answer: two samples of one uint8 [4] field.
    fn honest_open() -> Answer {
        let schema = Schema::new(vec![FieldSpec::fixed("x", DType::Uint8, &[4])]).unwrap();
        let mut w = Writer::default();
        w.str("hdf5")
            .u64(2)
            .u64(1)
            .u64(8)
            .str("fake")
            .str("v1")
            .str("/fake")
            .str("Identity");
        reader::write_schema(&mut w, &schema);
        let mut bulk = [4u64.to_le_bytes(), 4u64.to_le_bytes()].concat();
        bulk.extend_from_slice(&wire::path_list([PathBuf::from("/fake")].iter()));
        (w.0, Some(bulk))
    }

    /// An honest `LOAD` answer for samples 0..2, records inline.
    fn honest_load() -> Answer {
        let mut w = Writer::default();
        w.u64(8)
            .u32(2)
            .u8(SAMPLE_OK)
            .u64(0)
            .u64(4)
            .u8(SAMPLE_OK)
            .u64(4)
            .u64(4);
        w.0.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        (w.0, None)
    }

    /// Honest bytes cut short and with some bytes changed: hostile answers that get past the
    /// first checks.
    fn mutated(honest: Vec<u8>) -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let n = honest.len();
        (
            proptest::collection::vec((0..n.max(1), any::<u8>()), 0..6),
            0..=n + 8,
            proptest::collection::vec(any::<u8>(), 0..8),
        )
            .prop_map(move |(flips, keep, tail)| {
                let mut b = honest.clone();
                for (i, v) in flips {
                    if i < b.len() {
                        b[i] = v;
                    }
                }
                b.truncate(keep);
                if keep > n {
                    b.extend(tail);
                }
                b
            })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]

        /// Whatever a reader answers to `LOAD`, the daemon serves a sample only as the fields
        /// say it is (four bytes), else a clear error; it never panics or reads out of bounds.
        #[test]
        fn hostile_load_answers_are_refused_or_exact(
            payload in mutated(honest_load().0),
            in_memfd in proptest::prelude::any::<bool>(),
        ) {
            let load = if in_memfd {
                // The records moved to a memfd: the table alone in the message.
                let n = payload.len().saturating_sub(8);
                (payload[..n].to_vec(), Some(payload[n..].to_vec()))
            } else {
                (payload, None)
            };
            let opened = fake_reader(honest_open(), load).unwrap();
            let p = opened.source.prepared().unwrap();
            match p.load(0, 2) {
                Ok((records, _raw)) => {
                    proptest::prop_assert_eq!(records.len(), 2);
                    for r in records.into_iter().flatten() {
                        proptest::prop_assert_eq!(r.len(), 4);
                    }
                }
                Err(e) => {
                    let said = format!("{e:#}");
                    proptest::prop_assert!(said.contains("u/x"), "{}", said);
                }
            }
        }

        /// Whatever a reader answers to `OPEN`, the dataset opens as something consistent or
        /// not at all.
        #[test]
        fn hostile_open_answers_are_refused_or_consistent(
            payload in mutated(honest_open().0),
            bulk in mutated(honest_open().1.unwrap()),
        ) {
            if let Ok(opened) = fake_reader((payload, Some(bulk)), honest_load()) {
                let s = &opened.source;
                proptest::prop_assert!(s.len() <= 1 << 40);
                for i in 0..s.len().min(4) {
                    let _ = s.disk_bytes_of(i);
                }
            }
        }
    }
}
