//! A reader: the process that reads and decodes one user's dataset, as that user, with no
//! capability and NO_NEW_PRIVS (the launcher made it so). It opens the dataset's files with
//! the user's own rights, reads and preprocesses the samples the daemon asks for, and hands
//! back their records in a sealed memfd. A crafted file that takes it over gets a process
//! running as its own author, holding nothing of anyone else's.
//!
//! Requests (kind, then payload), each answered under the same id:
//! - `OPEN`: the dataset's table and the limits, as TOML. Answer: what it is (`Meta`), the
//!   files of its access check and each sample's bytes on disk in a memfd.
//! - `LOAD`: start, count. Answer: per sample its record (offset and length) or why not (a bad
//!   sample, or files that changed), and the raw bytes read; the records follow the table in
//!   the message when they fit, else they are in a memfd beside it.
//!
//! Every answer is checked by the daemon (`remote`) before anything of it is used.

use super::wire::{self, Writer};
use crate::config::{DatasetConfig, Limits};
use crate::fields::{FieldSpec, Schema};
use crate::source::Opened;
use anyhow::{bail, ensure, Context, Result};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

pub const OPEN: u8 = 1;
pub const LOAD: u8 = 2;
pub const FAILED: u8 = 255;

/// The most bytes of an answer sent in the message itself (a SOCK_SEQPACKET message must fit
/// the socket's send buffer, about 208 KiB by default).
const INLINE_MAX: usize = 128 << 10;

/// A sample's outcome in a `LOAD` answer.
pub const SAMPLE_OK: u8 = 0;
pub const SAMPLE_BAD: u8 = 1;
pub const SAMPLE_CHANGED: u8 = 2;

/// An answer: its payload, and the memfd beside it.
type Answer = (Vec<u8>, Option<OwnedFd>);

/// The dataset a reader has open.
struct Open {
    opened: Opened,
    limits: Limits,
}

/// The reader's loop. It first puts itself under its seccomp filter, then opens the dataset on
/// its one thread (the first request must be `OPEN`) and holds itself to the dataset's files
/// (Landlock binds the threads started after). Then requests come from `sock` until the daemon
/// closes it, taken by a few threads at once (a SOCK_SEQPACKET socket hands each message whole
/// to one of them), so a cold epoch decodes on every core the daemon's pool has. The process
/// ends when the socket closes, whatever its threads are doing.
pub fn serve(sock: OwnedFd) {
    let fd = sock.as_raw_fd();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(16));
    if let Err(e) = super::sandbox::restrict_syscalls() {
        eprintln!("larder reader: {e:#}");
        // SAFETY: ends the reader without the daemon's exit handlers.
        unsafe { libc::_exit(1) }
    }
    let Ok(Some(m)) = wire::recv(fd) else {
        // SAFETY: as above.
        unsafe { libc::_exit(0) }
    };
    let mut opened = None;
    answer(fd, &m, || {
        ensure!(m.kind == OPEN, "the first request must open the dataset");
        let (ds, answer) = open_dataset(&m)?;
        opened = Some(Arc::new(ds));
        Ok(answer)
    });
    let Some(ds) = opened else {
        // SAFETY: as above: a reader whose dataset did not open has nothing more to do.
        unsafe { libc::_exit(0) }
    };
    let work = move |ds: Arc<Open>| {
        while let Ok(Some(m)) = wire::recv(fd) {
            match m.kind {
                LOAD => answer(fd, &m, || load(&ds, &m)),
                _ => answer(fd, &m, || bail!("unknown request {}", m.kind)),
            }
        }
        // SAFETY: ends the reader (and its threads) without the daemon's exit handlers.
        unsafe { libc::_exit(0) }
    };
    for _ in 1..threads {
        let ds = ds.clone();
        std::thread::spawn(move || work(ds));
    }
    work(ds);
    drop(sock);
}

/// Sends what `f` gives as the answer to `m`, or its error.
fn answer(fd: RawFd, m: &wire::Message, f: impl FnOnce() -> Result<Answer>) {
    let sent = match f() {
        Ok((payload, memfd)) => wire::send(
            fd,
            m.kind,
            m.id,
            &payload,
            memfd.as_ref().map(|f| f.as_raw_fd()),
        ),
        Err(e) => wire::send(fd, FAILED, m.id, format!("{e:#}").as_bytes(), None),
    };
    if let Err(e) = sent {
        let _ = wire::send(
            fd,
            FAILED,
            m.id,
            format!("sending the answer: {e:#}").as_bytes(),
            None,
        );
    }
}

fn open_dataset(m: &wire::Message) -> Result<(Open, Answer)> {
    let mut r = wire::Reader::new(&m.payload);
    let table: toml::Table = toml::from_str(r.str()?).context("the dataset's table")?;
    let limits: Limits = toml::from_str(r.str()?).context("the limits")?;
    r.end()?;
    let mut c = DatasetConfig::from_table(table)?;
    // A dataset in an object store is read through the channel the daemon sent with the
    // request: this process has no network and no credentials.
    if let Some(fd) = &m.fd {
        let channel = super::fetch::Channel::new(fd.try_clone()?);
        crate::objects::install(Box::new(channel));
    }
    // Read as this process is: the owner (the daemon set it, the launcher switched to it).
    c.owner = None;
    let opened = crate::source::open(&c, &limits)?;
    let s = &opened.source;
    // From here on the reader may open the dataset's files and nothing else.
    let rules = super::sandbox::rules_for(s.root(), &s.files());
    if super::sandbox::restrict_files(&rules)
        .context("holding the reader to the dataset's files")?
        == super::sandbox::Landlocked::Unsupported
    {
        eprintln!("larder reader: this kernel has no Landlock; the reader is held by its uid and seccomp alone");
    }
    let mut w = Writer::default();
    w.str(opened.format.name())
        .u64(s.len())
        .u64(s.read_granule())
        .u64(s.disk_bytes())
        .str(&s.describe())
        .str(&s.version())
        .str(&s.root().to_string_lossy())
        .str(&opened.preprocess.describe());
    write_schema(&mut w, &opened.schema);
    // The bulk: each sample's bytes on disk, then the access check's files.
    let mut bulk = Vec::with_capacity(s.len() as usize * 8);
    for i in 0..s.len() {
        bulk.extend_from_slice(&s.disk_bytes_of(i).to_le_bytes());
    }
    bulk.extend_from_slice(&wire::path_list(s.files().iter()));
    let memfd = wire::sealed_memfd("larder-meta", &bulk)?;
    Ok((Open { opened, limits }, (w.0, Some(memfd))))
}

/// Samples `start..start + count`, read (as one range when it reads) and preprocessed.
fn load(ds: &Open, m: &wire::Message) -> Result<Answer> {
    let mut r = wire::Reader::new(&m.payload);
    let (start, count) = (r.u64()?, r.u64()?);
    r.end()?;
    let s = &ds.opened.source;
    anyhow::ensure!(
        count > 0 && count <= crate::source::MAX_GRANULE && start.saturating_add(count) <= s.len(),
        "samples {start}..+{count} of {}",
        s.len()
    );
    let raw: Vec<(u64, Result<crate::fields::RawSample>)> = match s.read_range(start, count) {
        Ok(all) => (start..).zip(all.into_iter().map(Ok)).collect(),
        Err(_) => (start..start + count).map(|i| (i, s.read(i))).collect(),
    };
    // An object store that did not answer is no sample's fault: the whole request fails, and
    // with it the stream (the daemon says the dataset is not served now).
    if let Some(e) = raw.iter().find_map(|(_, r)| {
        r.as_ref()
            .err()
            .filter(|e| crate::error::Error::kind_of(e) == crate::error::Kind::Reader)
    }) {
        bail!("{e:#}");
    }
    let mut records = Vec::new();
    let mut w = Writer::default();
    let raw_bytes: u64 = raw
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .map(crate::fields::raw_bytes)
        .sum();
    w.u64(raw_bytes).u32(raw.len() as u32);
    for (i, sample) in raw {
        let prepared = sample
            .with_context(|| format!("reading {}", s.sample_name(i)))
            .and_then(|raw| {
                crate::pipeline::prepare(&ds.opened.preprocess, &ds.opened.schema, &ds.limits, raw)
                    .with_context(|| format!("preprocessing {}", s.sample_name(i)))
            });
        match prepared {
            Ok(record) => {
                w.u8(SAMPLE_OK)
                    .u64(records.len() as u64)
                    .u64(record.len() as u64);
                records.extend_from_slice(&record);
            }
            Err(e) => {
                let changed = crate::error::Error::kind_of(&e) == crate::error::Kind::Changed;
                w.u8(if changed { SAMPLE_CHANGED } else { SAMPLE_BAD })
                    .str(&format!("{e:#}"));
            }
        }
    }
    // Records that fit go in the message itself, after the table; more in a sealed memfd.
    if w.0.len() + records.len() <= INLINE_MAX {
        w.0.extend_from_slice(&records);
        return Ok((w.0, None));
    }
    let memfd = wire::sealed_memfd("larder-records", &records)?;
    Ok((w.0, Some(memfd)))
}

/// A schema as a reader sends it.
pub fn write_schema(w: &mut Writer, schema: &Schema) {
    w.u32(schema.fields.len() as u32);
    for f in &schema.fields {
        w.str(&f.name).str(f.dtype.name()).u32(f.shape.len() as u32);
        for d in &f.shape {
            match d {
                Some(d) => w.u8(1).u32(*d),
                None => w.u8(0),
            };
        }
        match &f.pair {
            Some(p) => w.u8(1).str(&p.with).u32(p.scale),
            None => w.u8(0),
        };
        w.str(f.resample.name());
    }
}

/// A schema as the daemon reads it from a reader (every name and number checked).
pub fn read_schema(r: &mut wire::Reader) -> Result<Schema> {
    use crate::fields::{DType, Pairing, Resample};
    let n = r.count(8)?;
    anyhow::ensure!(n <= 1024, "{n} fields");
    let mut fields = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str()?.to_string();
        let dtype = r.str()?;
        let dtype = DType::ALL
            .into_iter()
            .find(|d| d.name() == dtype)
            .with_context(|| format!("dtype {dtype:?}"))?;
        let dims = r.count(1)?;
        anyhow::ensure!(dims <= 8, "{dims} dims");
        let shape = (0..dims)
            .map(|_| Ok(if r.u8()? == 1 { Some(r.u32()?) } else { None }))
            .collect::<Result<Vec<_>>>()?;
        anyhow::ensure!(
            shape.iter().flatten().all(|&d| d <= 1 << 24),
            "field {name:?}: a dim over 2^24"
        );
        let mut spec = FieldSpec::new(&name, dtype, shape);
        if r.u8()? == 1 {
            let with = r.str()?.to_string();
            let scale = r.u32()?;
            anyhow::ensure!(
                (1..=64).contains(&scale),
                "field {name:?}: a pair scale of {scale}"
            );
            spec.pair = Some(Pairing { with, scale });
        }
        spec.resample = match r.str()? {
            "nearest" => Resample::Nearest,
            "linear" => Resample::Linear,
            "cubic" => Resample::Cubic,
            other => bail!("resample {other:?}"),
        };
        fields.push(spec);
    }
    Schema::new(fields)
}
