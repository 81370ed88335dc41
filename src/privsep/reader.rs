//! A reader: the process that reads and decodes one user's dataset, as that user, with no
//! capability and NO_NEW_PRIVS (the launcher made it so), started afresh from the daemon's
//! executable (`child`) with nothing of the daemon's: no environment, no memory, one socket.
//! It opens the dataset's files with the user's own rights, reads and preprocesses the samples
//! the daemon asks for, and hands back their records in sealed memfds. A crafted file that
//! takes it over gets a process running as its own author, held to the dataset's files,
//! holding nothing of anyone else's.
//!
//! It speaks the reader protocol (`protocol`): `Hello`, then `Open` (walking the dataset
//! before parsing any of it when the daemon sent no walk, and holding itself to the walk's
//! files before its first byte is parsed), then `Load`s and `Check`s, answered by a few
//! threads at once, and an `Alive` every half second from a thread of its own.
//!
//! Every answer is checked by the daemon (`remote`) before anything of it is used.

use super::protocol::{self, Kind, Load, Opened, Outcome, Sizes};
use super::wire::{self, Writer};
use crate::config::{DatasetConfig, Limits};
use crate::source::Opened as OpenedSource;
use crate::sync::Locked;
use anyhow::{ensure, Context, Result};
use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// The most bytes of an answer sent in the message itself (a SOCK_SEQPACKET message must fit
/// the socket's send buffer, about 208 KiB by default).
const INLINE_MAX: usize = 128 << 10;

/// A `Samples` answer is sent once it holds this many samples or bytes of records: few
/// messages for small records, and for large ones answers the daemon takes while the rest of
/// the load is decoded.
const SAMPLES_AT_ONCE: usize = 1024;
const BYTES_AT_ONCE: usize = 2 << 20;

/// The dataset a reader has open.
struct Open {
    opened: OpenedSource,
    limits: Limits,
}

/// Ends the reader without the daemon's exit handlers.
fn end(code: i32) -> ! {
    // SAFETY: _exit ends the process at once.
    unsafe { libc::_exit(code) }
}

/// The reader's life, on `sock` (its one descriptor beside stdio): under its seccomp filter
/// first, then the conversation. It ends when the socket closes, whatever its threads are doing.
pub fn serve(sock: OwnedFd) -> ! {
    let fd = sock.as_raw_fd();
    if let Err(e) = super::sandbox::restrict_syscalls() {
        eprintln!("larder reader: {e:#}");
        end(1);
    }
    let hello = match wire::recv(fd) {
        Ok(Some(m)) => m,
        _ => end(0),
    };
    answer(fd, &hello, || {
        ensure!(
            Kind::try_from(hello.kind)? == Kind::Hello,
            "the first request must be Hello"
        );
        protocol::check_hello(&hello.payload)?;
        Ok((Kind::Hello, protocol::hello(), None))
    });
    let Ok(Some(m)) = wire::recv(fd) else { end(0) };
    let found = Arc::new(AtomicU64::new(0));
    let mut opened = None;
    answer(fd, &m, || {
        ensure!(
            Kind::try_from(m.kind)? == Kind::Open,
            "the second request must open the dataset"
        );
        let (ds, answer) = open_dataset(fd, &m, &found)?;
        opened = Some(Arc::new(ds));
        Ok(answer)
    });
    // A reader whose dataset did not open has nothing more to do.
    let Some(ds) = opened else { end(0) };
    let work = Arc::new(Work::default());
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(16));
    for _ in 0..threads {
        let (ds, work) = (ds.clone(), work.clone());
        std::thread::spawn(move || work.serve(fd, &ds));
    }
    while let Ok(Some(m)) = wire::recv(fd) {
        match Kind::try_from(m.kind) {
            Ok(Kind::Load) => match Load::read(&m.payload, ds.opened.source.len()) {
                Ok(load) => work.push(m.id, load),
                Err(e) => fail(fd, m.id, &e),
            },
            Ok(Kind::Check) => {
                let changed = ds.opened.source.changed();
                send(
                    fd,
                    Kind::Checked,
                    m.id,
                    &protocol::checked(changed.as_deref()),
                    None,
                );
            }
            Ok(k) => fail(fd, m.id, &anyhow::anyhow!("a request of kind {k:?}")),
            Err(e) => fail(fd, m.id, &e),
        }
    }
    drop(sock);
    end(0)
}

/// An answer: its kind, payload, and the memfd beside it.
type Answer = (Kind, Vec<u8>, Option<OwnedFd>);

/// Sends a message; a socket that no longer takes one ends the reader (the daemon has closed
/// it, or given up on this reader).
fn send(fd: RawFd, kind: Kind, id: u64, payload: &[u8], memfd: Option<&OwnedFd>) {
    let fds: Vec<RawFd> = memfd.iter().map(|f| f.as_raw_fd()).collect();
    if wire::send(fd, kind.into(), id, payload, &fds).is_err() {
        end(0);
    }
}

fn fail(fd: RawFd, id: u64, e: &anyhow::Error) {
    if wire::send(fd, wire::FAILED, id, format!("{e:#}").as_bytes(), &[]).is_err() {
        end(0);
    }
}

/// Sends what `f` gives as the answer to `m`, or its error.
fn answer(fd: RawFd, m: &wire::Message, f: impl FnOnce() -> Result<Answer>) {
    match f() {
        Ok((kind, payload, memfd)) => send(fd, kind, m.id, &payload, memfd.as_ref()),
        Err(e) => fail(fd, m.id, &e),
    }
}

/// Opens the dataset of an `Open` request: walks it first when the request brought no walk
/// (saying what it found in `Walked`, before any file is parsed), holds this process to the
/// walk's files, starts the thread that says it is alive, then opens it.
fn open_dataset(fd: RawFd, m: &wire::Message, found: &Arc<AtomicU64>) -> Result<(Open, Answer)> {
    let request = protocol::Open::read(&m.payload)?;
    let table: toml::Table = toml::from_str(&request.table).context("the dataset's table")?;
    let limits: Limits = toml::from_str(&request.limits).context("the limits")?;
    let mut c = DatasetConfig::from_table(table)?;
    let mut fds = m.fds.iter();
    let (walk, links) = match request.walk {
        true => {
            let list = fds.next().context("no walk beside the request")?;
            let walk = wire::paths_of(&wire::read_sealed(list, protocol::MOST_WALK_BYTES)?)
                .context("the walk beside the request")?;
            (walk, None)
        }
        false => {
            let mut said = Instant::now();
            let (walk, links) = crate::source::walk::walk_noting_links(&c.path, &mut |n| {
                found.store(n, Relaxed);
                if said.elapsed() >= protocol::ALIVE_EVERY {
                    send(fd, Kind::Alive, 0, &protocol::alive(n), None);
                    said = Instant::now();
                }
            })?;
            let memfd = wire::sealed_memfd("larder-walk", &wire::path_list(walk.iter()))?;
            send(fd, Kind::Walked, m.id, &[], Some(&memfd));
            (walk, Some(links))
        }
    };
    // A dataset in an object store is read through the channel the daemon sent with the
    // request: this process has no network and no credentials.
    if request.objects {
        let channel = fds
            .next()
            .context("no objects channel beside the request")?;
        let channel = super::fetch::Channel::new(channel.try_clone()?);
        crate::objects::install(Box::new(channel));
    }
    // From here on the reader may open the walk's files and nothing else: before the first
    // byte of any of them is parsed. (Threads started after are held as this one is.)
    let root = match crate::source::walk::is_pattern(&c.path) {
        true => c.path.parent().map(PathBuf::from).unwrap_or_default(),
        false => c.path.clone(),
    };
    let mut said = Instant::now();
    let rules = super::sandbox::rules_for(&root, &walk, links.as_deref(), &mut || {
        if said.elapsed() >= protocol::ALIVE_EVERY {
            send(
                fd,
                Kind::Alive,
                0,
                &protocol::alive(found.load(Relaxed)),
                None,
            );
            said = Instant::now();
        }
    });
    if super::sandbox::restrict_files(&rules)
        .context("holding the reader to the dataset's files")?
        == super::sandbox::Landlocked::Unsupported
    {
        eprintln!("larder reader: this kernel has no Landlock; the reader is held by its uid and seccomp alone");
    }
    let alive = found.clone();
    std::thread::spawn(move || loop {
        std::thread::sleep(protocol::ALIVE_EVERY);
        send(
            fd,
            Kind::Alive,
            0,
            &protocol::alive(alive.load(Relaxed)),
            None,
        );
    });
    // Read as this process is: the owner (the daemon set it, the launcher switched to it).
    c.owner = None;
    let opened = crate::source::with_progress(found, || crate::source::open(&c, &limits))?;
    let s = &opened.source;
    // One number when every sample takes the same (looked at without a list of them: a
    // dataset of 10^8 samples costs this process nothing for it), else four bytes each.
    let each = s.disk_bytes_each().or_else(|| {
        let first = if s.len() == 0 { 0 } else { s.disk_bytes_of(0) };
        (1..s.len())
            .all(|i| s.disk_bytes_of(i) == first)
            .then_some(first)
    });
    let (sizes, memfd) = match each {
        Some(n) => (Sizes::Each(n), None),
        None => {
            let bytes: Vec<u8> = (0..s.len())
                .flat_map(|i| (s.disk_bytes_of(i).min(u32::MAX as u64) as u32).to_le_bytes())
                .collect();
            (
                Sizes::PerSample,
                Some(wire::sealed_memfd("larder-sizes", &bytes)?),
            )
        }
    };
    let answer = Opened {
        kind: opened.format.name().to_string(),
        len: s.len(),
        granule: s.read_granule(),
        disk_bytes: s.disk_bytes(),
        describe: s.describe(),
        version: s.version(),
        root: s.root().to_path_buf(),
        preprocess: opened.preprocess.describe(),
        schema: opened.schema.clone(),
        sizes,
    };
    Ok((
        Open { opened, limits },
        (Kind::Opened, answer.write(), memfd),
    ))
}

/// The loads asked for and not yet answered, taken by the reader's threads: each range by one
/// thread, no more threads on one load than it grants.
#[derive(Default)]
struct Work {
    queue: Mutex<VecDeque<Arc<Job>>>,
    ready: Condvar,
}

/// One `Load`: its ranges not yet taken, the threads on it, what is left to answer, and what
/// its threads have answered and not yet sent.
struct Job {
    id: u64,
    threads: u32,
    state: Mutex<JobState>,
}

struct JobState {
    ranges: VecDeque<(u64, u64)>,
    busy: u32,
    /// Ranges not yet answered (taken or not).
    left: usize,
    raw_bytes: u64,
    samples: u64,
    out: Outbox,
}

/// Samples answered and not sent yet: their table, and their records (in the message while
/// they fit, else in a memfd they are written to as they come: one answer for many samples,
/// each record copied once).
#[derive(Default)]
struct Outbox {
    table: Vec<(u64, Outcome)>,
    inline: Vec<u8>,
    memfd: Option<std::fs::File>,
    len: u64,
}

impl Outbox {
    fn add(&mut self, i: u64, prepared: Result<Vec<u8>>) -> Result<()> {
        let outcome = match prepared {
            Ok(record) => {
                let at = self.len;
                if self.memfd.is_none() && self.inline.len() + record.len() > INLINE_MAX {
                    let file = std::fs::File::from(wire::memfd("larder-records")?);
                    std::os::unix::fs::FileExt::write_all_at(&file, &self.inline, 0)?;
                    self.inline = vec![];
                    self.memfd = Some(file);
                }
                match &self.memfd {
                    Some(f) => std::os::unix::fs::FileExt::write_all_at(f, &record, at)?,
                    None => self.inline.extend_from_slice(&record),
                }
                self.len += record.len() as u64;
                Outcome::Record {
                    at,
                    len: record.len() as u64,
                }
            }
            Err(e) if crate::error::Error::kind_of(&e) == crate::error::Kind::Changed => {
                Outcome::Changed(format!("{e:#}"))
            }
            Err(e) => Outcome::Bad(format!("{e:#}")),
        };
        self.table.push((i, outcome));
        Ok(())
    }

    fn full(&self) -> bool {
        self.table.len() >= SAMPLES_AT_ONCE || self.len as usize >= BYTES_AT_ONCE
    }

    /// Sends what it holds as one `Samples` answer to request `id`.
    fn send(self, fd: RawFd, id: u64) {
        if self.table.is_empty() {
            return;
        }
        let mut w = Writer::default();
        protocol::write_samples(&mut w, &self.table);
        let sealed = self.memfd.map(|f| wire::seal(f.into()));
        match sealed {
            None => {
                w.0.extend_from_slice(&self.inline);
                send(fd, Kind::Samples, id, &w.0, None)
            }
            Some(Ok(memfd)) => send(fd, Kind::Samples, id, &w.0, Some(&memfd)),
            Some(Err(e)) => fail(fd, id, &e),
        }
    }
}

impl Work {
    fn push(&self, id: u64, load: Load) {
        let job = Arc::new(Job {
            id,
            threads: load.threads,
            state: Mutex::new(JobState {
                left: load.ranges.len(),
                ranges: load.ranges.into(),
                busy: 0,
                raw_bytes: 0,
                samples: 0,
                out: Outbox::default(),
            }),
        });
        self.queue.locked().push_back(job);
        self.ready.notify_all();
    }

    /// The next range some load lets one more thread take, oldest load first.
    fn take(&self) -> (Arc<Job>, (u64, u64)) {
        let mut q = self.queue.locked();
        loop {
            q.retain(|j| !j.state.locked().ranges.is_empty());
            for job in q.iter() {
                let mut s = job.state.locked();
                if s.busy < job.threads {
                    if let Some(range) = s.ranges.pop_front() {
                        s.busy += 1;
                        drop(s);
                        return (job.clone(), range);
                    }
                }
            }
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn serve(&self, fd: RawFd, ds: &Open) {
        loop {
            let (job, (start, count)) = self.take();
            let raw_bytes = load(fd, &job, ds, start, count);
            let mut s = job.state.locked();
            s.busy -= 1;
            s.left -= 1;
            s.raw_bytes += raw_bytes;
            let finished = s.left == 0;
            let (raw, n) = (s.raw_bytes, s.samples);
            let out = finished.then(|| std::mem::take(&mut s.out));
            drop(s);
            if let Some(out) = out {
                out.send(fd, job.id);
                send(fd, Kind::Done, job.id, &protocol::done(raw, n), None);
            }
            // A thread freed: a load held back by its grant may go on.
            self.ready.notify_all();
        }
    }
}

/// Samples `start..start + count` of `job`, read (as one range when it reads) and
/// preprocessed, into the job's outbox (sent whenever it is full); returns the raw bytes read.
/// A failure of the whole range (an object store that does not answer) is the request's:
/// `FAILED`, and the daemon ends its streams.
fn load(fd: RawFd, job: &Job, ds: &Open, start: u64, count: u64) -> u64 {
    let s = &ds.opened.source;
    let raw = match crate::source::read_each(s.as_ref(), start, count) {
        Ok(raw) => raw,
        Err(e) => {
            fail(fd, job.id, &e);
            return 0;
        }
    };
    let raw_bytes: u64 = raw
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .map(crate::fields::raw_bytes)
        .sum();
    for (i, sample) in raw {
        let prepared = sample
            .with_context(|| format!("reading {}", s.sample_name(i)))
            .and_then(|raw| {
                crate::pipeline::prepare(&ds.opened.preprocess, &ds.opened.schema, &ds.limits, raw)
                    .with_context(|| format!("preprocessing {}", s.sample_name(i)))
            });
        let mut st = job.state.locked();
        st.samples += 1;
        if let Err(e) = st.out.add(i, prepared) {
            drop(st);
            fail(fd, job.id, &e);
            return 0;
        }
        if st.out.full() {
            let out = std::mem::take(&mut st.out);
            drop(st);
            out.send(fd, job.id);
        }
    }
    raw_bytes
}
