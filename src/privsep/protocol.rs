//! The reader protocol, version [`VERSION`]: what the daemon asks a reader and what a reader
//! answers, every message typed (one enum of kinds, one struct per payload) and every field a
//! reader sends read through the checked [`wire::Reader`].
//!
//! A conversation:
//! - `Hello` both ways first: the protocol version (a reader of another version is refused).
//! - `Open` (the dataset's table and the limits; the walk when the daemon has one, in a memfd;
//!   an objects channel for a dataset in an object store). A reader given no walk walks the
//!   dataset before it parses any of it and says what it found (`Walked`), then holds itself to
//!   those files (Landlock), opens the dataset and answers `Opened`.
//! - `Load` (ranges of samples, and how many threads it may decode them on): answered sample by
//!   sample, in `Samples` messages as they are ready, then `Done`.
//! - `Check`: do the dataset's files still read as they did (`Checked`: why not, or nothing)?
//! - `Alive`, from the reader every [`ALIVE_EVERY`], under id 0: a reader that is working but
//!   has nothing to answer yet is not taken for stuck; one silent for [`SILENT_WITHIN`] is.
//! - Any request may be answered `wire::FAILED` with why.

use super::wire::{self, kinds, Reader, Writer};
use crate::fields::{FieldSpec, Schema};
use anyhow::{bail, ensure, Context, Result};
use std::path::PathBuf;
use std::time::Duration;

/// The protocol's version: a reader and its daemon must speak the same (they are the same
/// executable, held open by the daemon from its start, so they do).
pub const VERSION: u32 = 2;

/// How often a reader says it is alive.
pub const ALIVE_EVERY: Duration = Duration::from_millis(500);

/// How long a reader with requests to answer may be silent (no answer, no `Alive`) before it
/// is taken for stuck (stopped, or wedged in a system call).
pub const SILENT_WITHIN: Duration = Duration::from_secs(4);

/// The most samples one `Load` asks for, and so the largest granule a reader's dataset may
/// have.
pub const MOST_LOAD_SAMPLES: u64 = 1 << 16;

/// The most bytes of a walk (NUL-ended paths), wherever it goes: to a reader started again, to
/// an access check.
pub const MOST_WALK_BYTES: u64 = 16 << 30;

kinds! {
    /// The kinds of message on a reader's socket.
    pub enum Kind {
        /// Both ways, first: the protocol version.
        Hello = 1,
        /// Daemon: a dataset to open.
        Open = 2,
        /// Reader: the dataset's files, walked before any was parsed.
        Walked = 3,
        /// Reader: what the dataset is, the answer to `Open`.
        Opened = 4,
        /// Daemon: samples to read and prepare.
        Load = 5,
        /// Reader: some of a `Load`'s samples.
        Samples = 6,
        /// Reader: a `Load` answered whole.
        Done = 7,
        /// Reader: alive (id 0), with the files its open has found so far.
        Alive = 8,
        /// Daemon: do the dataset's files still read as they did?
        Check = 9,
        /// Reader: the answer to `Check`.
        Checked = 10,
    }
}

/// The most bytes of a text a reader sends (why a sample is bad, what a dataset is): longer
/// ones are cut there.
pub const MOST_TEXT_BYTES: usize = 1024;

/// `text`, cut to at most MOST_TEXT_BYTES (at a character's boundary).
fn short(text: &str) -> String {
    let mut end = text.len().min(MOST_TEXT_BYTES);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// `Hello`'s payload.
pub fn hello() -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(VERSION);
    w.0
}

/// Checks a `Hello`'s payload: the other side's version is this one's.
pub fn check_hello(payload: &[u8]) -> Result<()> {
    let mut r = Reader::new(payload);
    let v = r.u32()?;
    r.end()?;
    ensure!(
        v == VERSION,
        "the reader speaks protocol version {v}, the daemon {VERSION}"
    );
    Ok(())
}

/// `Open`'s payload (its descriptors: the walk's memfd when `walk`, then the objects channel
/// when `objects`).
pub struct Open {
    /// The dataset's table, as TOML.
    pub table: String,
    /// The limits, as TOML.
    pub limits: String,
    pub walk: bool,
    pub objects: bool,
}

impl Open {
    pub fn write(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.str(&self.table)
            .str(&self.limits)
            .u8(self.walk as u8)
            .u8(self.objects as u8);
        w.0
    }

    pub fn read(payload: &[u8]) -> Result<Open> {
        let mut r = Reader::new(payload);
        let flag = |r: &mut Reader| -> Result<bool> {
            match r.u8()? {
                0 => Ok(false),
                1 => Ok(true),
                k => bail!("a flag of {k}"),
            }
        };
        let open = Open {
            table: r.str()?.to_string(),
            limits: r.str()?.to_string(),
            walk: flag(&mut r)?,
            objects: flag(&mut r)?,
        };
        r.end()?;
        Ok(open)
    }
}

/// How many bytes each sample takes on disk, as a reader says: one number when every sample
/// takes the same, else one per sample (in a memfd beside `Opened`).
#[derive(Debug, Clone, PartialEq)]
pub enum Sizes {
    Each(u64),
    PerSample,
}

/// `Opened`'s payload: what the dataset is.
#[derive(Debug, Clone, PartialEq)]
pub struct Opened {
    pub kind: String,
    pub len: u64,
    pub granule: u64,
    pub disk_bytes: u64,
    pub describe: String,
    pub version: String,
    pub root: PathBuf,
    pub preprocess: String,
    pub schema: Schema,
    pub sizes: Sizes,
}

impl Opened {
    pub fn write(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.str(&self.kind)
            .u64(self.len)
            .u64(self.granule)
            .u64(self.disk_bytes)
            .str(&self.describe)
            .str(&self.version)
            .str(&self.root.to_string_lossy())
            .str(&self.preprocess);
        write_schema(&mut w, &self.schema);
        match self.sizes {
            Sizes::Each(n) => w.u8(0).u64(n),
            Sizes::PerSample => w.u8(1),
        };
        w.0
    }

    pub fn read(payload: &[u8]) -> Result<Opened> {
        let mut r = Reader::new(payload);
        let opened = Opened {
            kind: short(r.str()?),
            len: r.u64()?,
            granule: r.u64()?,
            disk_bytes: r.u64()?,
            describe: short(r.str()?),
            version: short(r.str()?),
            root: PathBuf::from(short(r.str()?)),
            preprocess: short(r.str()?),
            schema: read_schema(&mut r)?,
            sizes: match r.u8()? {
                0 => Sizes::Each(r.u64()?),
                1 => Sizes::PerSample,
                k => bail!("sizes of form {k}"),
            },
        };
        r.end()?;
        Ok(opened)
    }
}

/// `Load`'s payload: ranges of samples (start, count), and the threads the reader may decode
/// them on.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    pub threads: u32,
    pub ranges: Vec<(u64, u64)>,
}

impl Load {
    pub fn write(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(self.threads).u32(self.ranges.len() as u32);
        for &(start, count) in &self.ranges {
            w.u64(start).u64(count);
        }
        w.0
    }

    /// Reads a `Load` of a dataset of `len` samples: every range within it, and at most
    /// [`MOST_LOAD_SAMPLES`] in all.
    pub fn read(payload: &[u8], len: u64) -> Result<Load> {
        let mut r = Reader::new(payload);
        let threads = r.u32()?.clamp(1, 64);
        let n = r.count(16)?;
        let mut ranges = Vec::with_capacity(n);
        let mut total = 0u64;
        for _ in 0..n {
            let (start, count) = (r.u64()?, r.u64()?);
            ensure!(
                count > 0 && start.checked_add(count).is_some_and(|e| e <= len),
                "samples {start}..+{count} of {len}"
            );
            total += count;
            ranges.push((start, count));
        }
        r.end()?;
        ensure!(
            (1..=MOST_LOAD_SAMPLES).contains(&total),
            "a load of {total} samples"
        );
        Ok(Load { threads, ranges })
    }

    /// The samples asked for, in order.
    pub fn samples(&self) -> impl Iterator<Item = u64> + '_ {
        self.ranges.iter().flat_map(|&(s, c)| s..s + c)
    }
}

/// A sample's outcome in a `Samples` answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Its record: offset and length in the answer's records.
    Record { at: u64, len: u64 },
    /// Its files do not read or decode: why.
    Bad(String),
    /// The dataset's files changed under the reader: why.
    Changed(String),
}

/// The table of a `Samples` answer: each sample's index and outcome (the records follow the
/// table in the message, or are in the memfd beside it).
pub fn write_samples(w: &mut Writer, samples: &[(u64, Outcome)]) {
    w.u32(samples.len() as u32);
    for (i, o) in samples {
        w.u64(*i);
        match o {
            Outcome::Record { at, len } => w.u8(0).u64(*at).u64(*len),
            Outcome::Bad(why) => w.u8(1).str(why),
            Outcome::Changed(why) => w.u8(2).str(why),
        };
    }
}

/// Reads the table of a `Samples` answer; returns it and the reader at the records.
pub fn read_samples<'a>(payload: &'a [u8]) -> Result<(Vec<(u64, Outcome)>, Reader<'a>)> {
    let mut r = Reader::new(payload);
    let n = r.count(9)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let i = r.u64()?;
        let o = match r.u8()? {
            0 => Outcome::Record {
                at: r.u64()?,
                len: r.u64()?,
            },
            1 => Outcome::Bad(short(r.str()?)),
            2 => Outcome::Changed(short(r.str()?)),
            k => bail!("a sample outcome {k}"),
        };
        out.push((i, o));
    }
    Ok((out, r))
}

/// `Done`'s payload: the raw bytes read, and the samples answered.
pub fn done(raw_bytes: u64, samples: u64) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(raw_bytes).u64(samples);
    w.0
}

pub fn read_done(payload: &[u8]) -> Result<(u64, u64)> {
    let mut r = Reader::new(payload);
    let d = (r.u64()?, r.u64()?);
    r.end()?;
    Ok(d)
}

/// `Alive`'s payload: the files found so far by an open.
pub fn alive(found: u64) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(found);
    w.0
}

pub fn read_alive(payload: &[u8]) -> Result<u64> {
    let mut r = Reader::new(payload);
    let found = r.u64()?;
    r.end()?;
    Ok(found)
}

/// `Checked`'s payload: why the files no longer read as they did, or nothing.
pub fn checked(changed: Option<&str>) -> Vec<u8> {
    let mut w = Writer::default();
    match changed {
        Some(why) => w.u8(1).str(why),
        None => w.u8(0),
    };
    w.0
}

pub fn read_checked(payload: &[u8]) -> Result<Option<String>> {
    let mut r = Reader::new(payload);
    let changed = match r.u8()? {
        0 => None,
        1 => Some(short(r.str()?)),
        k => bail!("a check's answer of form {k}"),
    };
    r.end()?;
    Ok(changed)
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
    ensure!(n <= 1024, "{n} fields");
    let mut fields = Vec::with_capacity(n);
    for _ in 0..n {
        let name = r.str()?.to_string();
        let dtype = r.str()?;
        let dtype = DType::ALL
            .into_iter()
            .find(|d| d.name() == dtype)
            .with_context(|| format!("dtype {dtype:?}"))?;
        let dims = r.count(1)?;
        ensure!(dims <= 8, "{dims} dims");
        let shape = (0..dims)
            .map(|_| Ok(if r.u8()? == 1 { Some(r.u32()?) } else { None }))
            .collect::<Result<Vec<_>>>()?;
        ensure!(
            shape.iter().flatten().all(|&d| d <= 1 << 24),
            "field {name:?}: a dim over 2^24"
        );
        let mut spec = FieldSpec::new(&name, dtype, shape);
        if r.u8()? == 1 {
            let with = r.str()?.to_string();
            let scale = r.u32()?;
            ensure!(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fields::DType;

    #[test]
    fn every_payload_reads_back_as_written() {
        let schema = Schema::new(vec![FieldSpec::fixed("x", DType::Uint8, &[4])]).unwrap();
        let opened = Opened {
            kind: "npy".into(),
            len: 9,
            granule: 3,
            disk_bytes: 36,
            describe: "d".into(),
            version: "v".into(),
            root: "/r".into(),
            preprocess: "Identity".into(),
            schema,
            sizes: Sizes::Each(4),
        };
        assert_eq!(Opened::read(&opened.write()).unwrap(), opened);
        let load = Load {
            threads: 2,
            ranges: vec![(0, 3), (6, 3)],
        };
        assert_eq!(Load::read(&load.write(), 9).unwrap(), load);
        assert_eq!(load.samples().collect::<Vec<_>>(), [0, 1, 2, 6, 7, 8]);
        assert!(Load::read(&load.write(), 8).is_err(), "past the end");
        let samples = vec![
            (0, Outcome::Record { at: 0, len: 4 }),
            (1, Outcome::Bad("b".into())),
            (2, Outcome::Changed("c".into())),
        ];
        let mut w = Writer::default();
        write_samples(&mut w, &samples);
        w.0.extend_from_slice(b"abcd");
        let (back, mut rest) = read_samples(&w.0).unwrap();
        assert_eq!(back, samples);
        assert_eq!(rest.rest(), b"abcd");
        assert_eq!(read_done(&done(5, 6)).unwrap(), (5, 6));
        assert_eq!(
            read_checked(&checked(Some("x"))).unwrap().as_deref(),
            Some("x")
        );
        check_hello(&hello()).unwrap();
        let mut other = Writer::default();
        other.u32(1);
        assert!(check_hello(&other.0).is_err());
    }
}
