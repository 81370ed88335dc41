//! A reader's way to objects: it has no network and no credentials, so it asks the serving
//! daemon, on a socket of its own beside its requests' socket, to list objects and to GET byte
//! ranges of them. The daemon answers only within the dataset's location (a reader taken over
//! by a crafted file reaches no other bucket or prefix through the daemon's credentials) and
//! only up to `objects::MOST_GET_BYTES` a request. The bytes come back in a sealed memfd.
//!
//! Requests (kind, then payload): `LIST` bucket, key; `GET` bucket, key, size, ETag, offset,
//! length. An error is `FAILED`: whether the object changed, then why.

use super::wire::{self, kinds, Writer, FAILED};
use crate::error::Kind;
use crate::objects::{Fetch, Location, Object, MOST_GET_BYTES};
use crate::sync::Locked;
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};

kinds! {
    /// A reader's requests on its objects channel.
    enum Request {
        List = 1,
        Get = 2,
    }
}

/// What a `FAILED` answer says of the failure: the object changed, the store did not answer,
/// or else.
const CHANGED: u8 = 1;
const UNAVAILABLE: u8 = 2;

/// The most bytes of a listing's answer.
const MOST_LIST_BYTES: u64 = 2 << 30;

/// The reader's end. Its threads ask at once: each sends its request, and whichever is
/// waiting first receives the answers for all of them (no thread of its own, which would be
/// started before the reader's Landlock rules and escape them).
pub struct Channel {
    sock: OwnedFd,
    next: AtomicU64,
    inbox: Mutex<Inbox>,
    arrived: Condvar,
}

#[derive(Default)]
struct Inbox {
    /// A thread is receiving for everyone.
    receiving: bool,
    answers: HashMap<u64, wire::Message>,
    /// Why no answer will come, once the channel failed.
    closed: Option<String>,
}

impl Channel {
    pub fn new(sock: OwnedFd) -> Channel {
        Channel {
            sock,
            next: AtomicU64::new(1),
            inbox: Mutex::default(),
            arrived: Condvar::new(),
        }
    }

    /// Sends a request and waits for its answer: the answer's memfd, or the daemon's error.
    /// A channel that fails is no file's fault: its error is of kind `Reader` (the stream
    /// ends, no sample is counted bad).
    fn call(&self, kind: Request, payload: &[u8], max: u64) -> Result<Option<memmap2::Mmap>> {
        let unavailable = |e: anyhow::Error| -> anyhow::Error {
            crate::error::Error::new(Kind::Reader, format!("the objects' channel: {e:#}")).into()
        };
        let id = self.next.fetch_add(1, Relaxed);
        wire::send(self.sock.as_raw_fd(), kind.into(), id, payload, &[]).map_err(unavailable)?;
        let m = self.answer_to(id).map_err(unavailable)?;
        if m.kind == FAILED {
            let mut r = wire::Reader::new(&m.payload);
            let kind = match r.u8()? {
                CHANGED => Kind::Changed,
                UNAVAILABLE => Kind::Reader,
                _ => Kind::SourceIo,
            };
            let why = r.str()?.to_string();
            return Err(crate::error::Error::new(kind, why).into());
        }
        ensure!(
            m.kind == u8::from(kind),
            "an answer of kind {} to {kind:?}",
            m.kind
        );
        match m.fd() {
            Some(fd) => wire::map_sealed(fd, max).map_err(unavailable),
            None => Ok(None),
        }
    }

    /// The answer to request `id`, received by this thread or by another waiting.
    fn answer_to(&self, id: u64) -> Result<wire::Message> {
        let mut inbox = self.inbox.locked();
        loop {
            if let Some(m) = inbox.answers.remove(&id) {
                return Ok(m);
            }
            if let Some(why) = &inbox.closed {
                bail!("{why}");
            }
            if inbox.receiving {
                inbox = self.arrived.wait(inbox).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            inbox.receiving = true;
            drop(inbox);
            let got = wire::recv(self.sock.as_raw_fd());
            inbox = self.inbox.locked();
            inbox.receiving = false;
            match got {
                Ok(Some(m)) => {
                    inbox.answers.insert(m.id, m);
                }
                Ok(None) => inbox.closed = Some("the daemon closed the objects' channel".into()),
                Err(e) => inbox.closed = Some(format!("the objects' channel: {e:#}")),
            }
            self.arrived.notify_all();
        }
    }
}

fn write_object(w: &mut Writer, o: &Object) {
    w.str(&o.key).u64(o.size);
    match &o.etag {
        Some(e) => w.u8(1).str(e),
        None => w.u8(0),
    };
}

fn read_object(r: &mut wire::Reader, bucket: &str) -> Result<Object> {
    let key = r.str()?.to_string();
    let size = r.u64()?;
    let etag = match r.u8()? {
        1 => Some(r.str()?.to_string()),
        _ => None,
    };
    Ok(Object {
        bucket: bucket.to_string(),
        key,
        size,
        etag,
    })
}

impl Fetch for Channel {
    fn list(&self, at: &Location) -> Result<Vec<Object>> {
        let mut w = Writer::default();
        w.str(&at.bucket).str(&at.key);
        let map = self.call(Request::List, &w.0, MOST_LIST_BYTES)?;
        let bytes: &[u8] = map.as_deref().unwrap_or(&[]);
        let mut r = wire::Reader::new(bytes);
        let n = r.count(13)?;
        let out = (0..n)
            .map(|_| read_object(&mut r, &at.bucket))
            .collect::<Result<Vec<_>>>()?;
        r.end()?;
        Ok(out)
    }

    fn get(&self, object: &Object, offset: u64, len: u64) -> Result<Vec<u8>> {
        let mut w = Writer::default();
        w.str(&object.bucket);
        write_object(&mut w, object);
        w.u64(offset).u64(len);
        ensure!(len <= MOST_GET_BYTES, "a read of {len} bytes");
        let map = self.call(Request::Get, &w.0, len)?;
        let bytes = map.as_deref().unwrap_or(&[]);
        ensure!(
            bytes.len() as u64 == len,
            "the daemon sent {} bytes of {} for {len}",
            bytes.len(),
            object.url()
        );
        Ok(bytes.to_vec())
    }
}

/// The daemon's end of a reader's channel, served on a thread of its own until the reader
/// closes it: each request checked against `scope` (the dataset's location), then fetched.
pub fn serve(sock: OwnedFd, scope: Location) -> Result<()> {
    // Few answers queued unread: a reader that asks and never reads soon blocks the threads
    // answering it, and through them its further requests (each answer's memfd is the
    // daemon's memory until read).
    let small: libc::c_int = 4096;
    // SAFETY: setsockopt on our own socket with an int option.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&small as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let sock = Arc::new(sock);
    let scope = Arc::new(Scope {
        at: scope,
        listing: Mutex::default(),
    });
    std::thread::Builder::new()
        .name("larder-objects".into())
        .spawn(move || {
            let slots = Arc::new((Mutex::new(0usize), Condvar::new()));
            while let Ok(Some(m)) = wire::recv(sock.as_raw_fd()) {
                // At most AT_ONCE requests of a reader in flight: the next waits for a slot.
                {
                    let (busy, freed) = &*slots;
                    let mut n = busy.locked();
                    while *n >= AT_ONCE {
                        n = freed.wait(n).unwrap_or_else(|e| e.into_inner());
                    }
                    *n += 1;
                }
                let (sock, scope, slots) = (sock.clone(), scope.clone(), slots.clone());
                let spawned = std::thread::Builder::new()
                    .name("larder-object".into())
                    .spawn(move || {
                        reply(sock.as_raw_fd(), &m, &scope);
                        let (busy, freed) = &*slots;
                        *busy.locked() -= 1;
                        freed.notify_one();
                    });
                if spawned.is_err() {
                    return;
                }
            }
        })
        .context("starting the thread that serves a reader's objects")?;
    Ok(())
}

/// Requests of one reader answered at once (GETs wait on the store, not on the CPU).
const AT_ONCE: usize = 8;

/// Answers `m` on `fd`: the bytes in a sealed memfd, or why not.
fn reply(fd: std::os::fd::RawFd, m: &wire::Message, scope: &Scope) {
    let sent = match answer(m, scope) {
        Ok(bytes) => wire::sealed_memfd("larder-object", &bytes)
            .and_then(|f| wire::send(fd, m.kind, m.id, &[], &[f.as_raw_fd()])),
        Err(e) => Err(e),
    };
    if let Err(e) = sent {
        // What the daemon could not answer is no file's fault (a request outside the scope
        // comes from a reader that is not honest, whose stream may as well end).
        let kind = match crate::error::Error::kind_of(&e) {
            Kind::Changed => CHANGED,
            _ => UNAVAILABLE,
        };
        let mut w = Writer::default();
        w.u8(kind).str(&format!("{e:#}"));
        // A reader gone: nothing to tell.
        let _ = wire::send(fd, FAILED, m.id, &w.0, &[]);
    }
}

/// A reader's dataset's location, and its objects once listed (once per channel: a LIST is
/// answered from that listing, so a reader asking again and again costs no more listings).
struct Scope {
    at: Location,
    listing: Mutex<Option<Arc<Vec<Object>>>>,
}

impl Scope {
    /// The objects at `at` (within the scope): the one it names, else those under it.
    fn list(&self, at: &Location) -> Result<Vec<Object>> {
        let all = {
            let mut listing = self.listing.locked();
            match &*listing {
                Some(all) => all.clone(),
                None => {
                    let mut all = crate::objects::fetcher().list(&self.at)?;
                    all.retain(|o| self.at.holds(&o.key));
                    let all = Arc::new(all);
                    *listing = Some(all.clone());
                    all
                }
            }
        };
        if let Some(one) = all.iter().find(|o| o.key == at.key) {
            return Ok(vec![one.clone()]);
        }
        let under: Vec<Object> = all
            .iter()
            .filter(|o| at.key.is_empty() || at.holds(&o.key))
            .cloned()
            .collect();
        ensure!(
            !under.is_empty(),
            "{}: no such object or prefix",
            at.url_of(&at.key)
        );
        Ok(under)
    }
}

/// What request `m` asks, fetched, if `scope` holds it.
fn answer(m: &wire::Message, scope: &Scope) -> Result<Vec<u8>> {
    let (store, scope) = (scope, &scope.at);
    let mut r = wire::Reader::new(&m.payload);
    let bucket = r.str()?.to_string();
    let outside = |key: &str| {
        anyhow::anyhow!(
            "s3://{bucket}/{key} is outside the dataset's {}{}",
            scope.url_of(&scope.key),
            scope
                .only
                .as_ref()
                .map_or(String::new(), |o| format!(" (keys starting {o:?})"))
        )
    };
    let within = |key: &str| {
        if bucket == scope.bucket && scope.holds(key) {
            Ok(())
        } else {
            Err(outside(key))
        }
    };
    match Request::try_from(m.kind)? {
        Request::List => {
            let key = r.str()?.to_string();
            r.end()?;
            if bucket != scope.bucket || !scope.lists(&key) {
                return Err(outside(&key));
            }
            let at = Location {
                bucket,
                key,
                only: None,
            };
            let objects = store.list(&at)?;
            let mut w = Writer::default();
            w.u32(objects.len() as u32);
            for o in &objects {
                write_object(&mut w, o);
                ensure!(
                    w.0.len() as u64 <= MOST_LIST_BYTES,
                    "a listing over {MOST_LIST_BYTES} bytes"
                );
            }
            Ok(w.0)
        }
        Request::Get => {
            let object = read_object(&mut r, &bucket)?;
            let (offset, len) = (r.u64()?, r.u64()?);
            r.end()?;
            within(&object.key)?;
            crate::objects::fetcher().get(&object, offset, len)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `answer` says to a request of `kind` with `payload`, for the dataset at `scope`.
    fn asked(kind: u8, payload: &Writer, scope: &str) -> String {
        let m = wire::Message {
            kind,
            id: 1,
            payload: payload.0.clone(),
            fds: vec![],
        };
        let scope = Scope {
            at: Location::parse(std::path::Path::new(scope)).unwrap(),
            listing: Mutex::default(),
        };
        answer(&m, &scope).map_or_else(|e| format!("{e:#}"), |_| "answered".into())
    }

    #[test]
    fn a_reader_reaches_no_object_outside_its_dataset() {
        let get = |bucket: &str, key: &str| {
            let mut w = Writer::default();
            w.str(bucket);
            write_object(
                &mut w,
                &Object {
                    bucket: bucket.into(),
                    key: key.into(),
                    size: 10,
                    etag: None,
                },
            );
            w.u64(0).u64(10);
            w
        };
        let list = |bucket: &str, key: &str| {
            let mut w = Writer::default();
            w.str(bucket).str(key);
            w
        };
        for (kind, w) in [
            (Request::Get as u8, get("other", "train/a.tar")),
            (Request::Get as u8, get("data", "train2/a.tar")),
            (Request::Get as u8, get("data", "secrets/key")),
            (Request::List as u8, list("data", "")),
            (Request::List as u8, list("data", "train2")),
            (Request::List as u8, list("other", "train")),
        ] {
            let said = asked(kind, &w, "s3://data/train");
            assert!(
                said.contains("outside the dataset's s3://data/train"),
                "{said}"
            );
        }
        // A pattern's scope is exactly its prefix: a sibling in its folder is outside.
        let said = asked(
            Request::Get as u8,
            &get("data", "wds/val-000.tar"),
            "s3://data/wds/train-{000..009}.tar",
        );
        assert!(
            said.contains("outside") && said.contains("wds/train-"),
            "{said}"
        );
        let said = asked(
            Request::List as u8,
            &list("data", "other"),
            "s3://data/wds/train-{000..009}.tar",
        );
        assert!(said.contains("outside"), "{said}");
        // A request cut short, or of no kind, is refused before anything is fetched.
        let said = asked(
            Request::Get as u8,
            &list("data", "train/a.tar"),
            "s3://data/train",
        );
        assert!(said.contains("cut short"), "{said}");
        let said = asked(9, &list("data", "train"), "s3://data/train");
        assert!(said.contains("kind 9"), "{said}");
    }
}
