//! Shared-memory rings: batches for clients on the same host, written once into memory the
//! client maps, with gRPC kept as the control plane.
//!
//! A client connects to the daemon's Unix socket and, instead of HTTP/2, sends a ring request
//! (`MAGIC`, version, slots, slot bytes). The daemon makes an anonymous memfd (no name anywhere
//! in the filesystem that another user could open), seals its size, maps it and sends its
//! descriptor back over that same connection (SCM_RIGHTS) with a random token. The client names
//! the token in StreamBatches on a gRPC connection of the same process (same pid and uid, from
//! SO_PEERCRED on both sockets); batches then come in the ring's slots. The ring lives as long as
//! the connection that made it: when the client closes it, or dies, the daemon unmaps and closes
//! its side and the kernel frees the memory once the client's mapping is gone too. Nothing is
//! left behind by a crash of either side.
//!
//! Layout: a header of `HEADER_BYTES` (u64 magic, u32 slots, u32 zero, u64 slot bytes; at byte
//! 40 a u64 the client writes: the index of the next batch it waits for; at byte 64 one u32 state
//! per slot), then the slots, each `slot_bytes` (a multiple of 4096) long.
//! A slot's state is 0 when free and 1 when it is the daemon's or the client's. The daemon claims
//! a free slot (0 -> 1), writes a batch into it and sends the Batch naming it; the slot is then
//! the client's until the client stores 0, once it is done with every array that views it. A
//! stream that starts on a ring frees every slot except those the client says it still holds.
//! One stream at a time uses a ring; the next waits until the previous one has stopped writing.
//!
//! The ring is the stream's backpressure (its messages are too small for HTTP/2's): a batch
//! waits for a free slot while the client is still reading earlier batches. When the client
//! already waits for that very batch and holds every slot (it keeps batches alive), the batch
//! goes in the message instead, so a client never deadlocks the stream.

use super::shutdown::Shutdown;
pub use crate::peer::Peer;
use crate::sync::Locked;
use crate::tiers::memory::MemoryTier;
use anyhow::{bail, Context, Result};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::UnixStream;
use tokio::sync::OwnedMutexGuard;

/// First bytes of a ring request on the Unix socket (an HTTP/2 client starts with "PRI * HT").
pub const MAGIC: &[u8; 8] = b"LARDRING";
/// The ring protocol's version.
const VERSION: u32 = 1;
/// Bytes of the ring's header: the layout and one state word per slot.
pub const HEADER_BYTES: u64 = 4096;
/// Offset of the client's word: the next batch it waits for.
const CLIENT_NEXT_AT: usize = 40;
/// Offset of the first slot state word in the header.
const STATES_AT: usize = 64;
/// Most slots a ring may have (their state words fill the header).
pub const MAX_SLOTS: u32 = ((HEADER_BYTES as usize - STATES_AT) / 4) as u32;
/// Bytes of a ring request: magic, version, slots, slot bytes.
const REQUEST_BYTES: usize = 24;
/// A connection that says nothing for this long is closed.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a stream may not use the ring it names.
#[derive(Debug, PartialEq, Eq)]
pub enum Denied {
    /// No ring has this token, or it belongs to another process.
    NotYours,
}

/// The rings open now, bounded together by a byte budget, and each user's by a share of it.
pub struct Rings {
    /// Bytes all rings may take together.
    budget: u64,
    /// Bytes one user's rings may take together.
    user_budget: u64,
    /// Bytes the open rings take (shared with each ring, which gives its bytes back on drop).
    used: Arc<RingBytes>,
    /// Open rings by token.
    open: Mutex<HashMap<[u8; 16], Arc<Ring>>>,
}

/// One client's ring of slots.
pub struct Ring {
    /// The daemon's mapping of the memfd.
    map: memmap2::MmapRaw,
    pub slots: u32,
    pub slot_bytes: u64,
    /// The process that made it: only streams from that process may use it.
    owner: Peer,
    /// Held by the stream writing into the ring; the next stream waits for it.
    lease: Arc<tokio::sync::Mutex<()>>,
    /// The connection that made it has closed: no batch waits for a slot any more.
    closed: std::sync::atomic::AtomicBool,
    /// The budget's counter, given back to on drop.
    used: Arc<RingBytes>,
}

/// Bytes the open rings take. The memory tier hears of every change and leaves them room: it
/// and the rings stay within the memory budget together.
#[derive(Default)]
pub struct RingBytes {
    bytes: AtomicU64,
    memory: Option<Arc<MemoryTier>>,
    /// Bytes each user's rings take.
    by_user: Mutex<HashMap<u32, u64>>,
}

impl RingBytes {
    fn load(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }

    /// Adds `size` for `uid` unless their rings would pass `user_budget` (Err(Some(theirs)))
    /// or all rings `budget` (Err(None)).
    fn reserve_for(
        &self,
        uid: u32,
        size: u64,
        (budget, user_budget): (u64, u64),
    ) -> Result<(), Option<u64>> {
        let mut by_user = self.by_user.locked();
        let theirs = by_user.get(&uid).copied().unwrap_or(0);
        // Root and the daemon's own user are the admin: the budget alone holds for them.
        let admin = crate::footprint::Payer::of_uid(Some(uid)) == crate::footprint::Payer::Config;
        if !admin && theirs.checked_add(size).is_none_or(|n| n > user_budget) {
            return Err(Some(theirs));
        }
        self.reserve(size, budget).map_err(|_| None)?;
        *by_user.entry(uid).or_default() += size;
        Ok(())
    }

    /// Gives back `size` of `uid`'s.
    fn release_for(&self, uid: u32, size: u64) {
        let mut by_user = self.by_user.locked();
        if let Some(n) = by_user.get_mut(&uid) {
            *n = n.saturating_sub(size);
            if *n == 0 {
                by_user.remove(&uid);
            }
        }
        drop(by_user);
        self.release(size);
    }

    /// Adds `size` unless the total would pass `budget`; else the total now.
    fn reserve(&self, size: u64, budget: u64) -> Result<(), u64> {
        let mut used = self.load();
        loop {
            if used.checked_add(size).is_none_or(|total| total > budget) {
                return Err(used);
            }
            match self.bytes.compare_exchange(
                used,
                used + size,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => used = now,
            }
        }
        self.tell();
        Ok(())
    }

    fn release(&self, size: u64) {
        self.bytes.fetch_sub(size, Ordering::AcqRel);
        self.tell();
    }

    fn tell(&self) {
        if let Some(m) = &self.memory {
            m.reserve_from(&self.bytes);
        }
    }
}

/// A slot claimed by the daemon: freed again when dropped, unless handed to the client.
pub struct Slot {
    ring: Arc<Ring>,
    index: u32,
    handed_over: bool,
}

impl Rings {
    /// Rings within `budget` bytes (any one user's too), outside any memory tier's.
    pub fn new(budget: u64) -> Arc<Rings> {
        Rings::make(budget, budget, None)
    }

    /// Rings within `budget` bytes and half the memory tier's budget, each user's (but root's
    /// and the daemon's own) within `user_budget` (default: a quarter of that), whose bytes
    /// `memory` leaves room for (its
    /// limit is its budget less what the rings take): however many rings clients open, the
    /// tier keeps at least half its budget, and no user's rings leave another none.
    pub fn within(budget: u64, user_budget: Option<u64>, memory: Arc<MemoryTier>) -> Arc<Rings> {
        let budget = budget.min(memory.snapshot().budget / 2);
        Rings::make(budget, user_budget.unwrap_or(budget / 4), Some(memory))
    }

    fn make(budget: u64, user_budget: u64, memory: Option<Arc<MemoryTier>>) -> Arc<Rings> {
        Arc::new(Rings {
            budget,
            user_budget: user_budget.min(budget),
            used: Arc::new(RingBytes {
                bytes: AtomicU64::new(0),
                memory,
                by_user: Mutex::default(),
            }),
            open: Mutex::new(HashMap::new()),
        })
    }

    /// (rings open, bytes they take, budget).
    pub fn snapshot(&self) -> (u32, u64, u64) {
        let n = self.open.locked().len() as u32;
        (n, self.used.load(), self.budget)
    }

    /// The ring with this token, if `peer` is the process that made it.
    pub fn get(&self, token: &[u8], peer: Peer) -> Result<Arc<Ring>, Denied> {
        let token: [u8; 16] = token.try_into().map_err(|_| Denied::NotYours)?;
        let open = self.open.locked();
        let ring = open.get(&token).ok_or(Denied::NotYours)?;
        if ring.owner != peer || peer.pid.is_none() {
            return Err(Denied::NotYours);
        }
        Ok(ring.clone())
    }

    /// Makes a ring of `slots` slots of at least `slot_bytes` each for `owner`, within the
    /// budget; returns it, its token and the memfd to hand over.
    fn create(
        &self,
        owner: Peer,
        slots: u32,
        slot_bytes: u64,
    ) -> Result<(Arc<Ring>, [u8; 16], OwnedFd), Refusal> {
        if slots == 0 || slots > MAX_SLOTS {
            return Err(Refusal::BadRequest(format!(
                "a ring has 1 to {MAX_SLOTS} slots, not {slots}"
            )));
        }
        if slot_bytes == 0 {
            return Err(Refusal::BadRequest("slots of 0 bytes".into()));
        }
        // Whole pages, in checked arithmetic: a client picks both numbers.
        let size = ring_bytes(slots, slot_bytes).filter(|&s| s <= self.budget);
        let Some(size) = size else {
            return Err(Refusal::Exhausted(format!(
                "a ring of {slots} slots of {slot_bytes} bytes is larger than the daemon's {} \
                 bytes for shared memory (shm.budget_bytes)",
                self.budget
            )));
        };
        let slot_bytes = (size - HEADER_BYTES) / slots as u64;
        // Reserve the bytes, or say how far over the user's share or the budget this would go.
        match self
            .used
            .reserve_for(owner.uid, size, (self.budget, self.user_budget))
        {
            Ok(()) => {}
            Err(Some(theirs)) => {
                return Err(Refusal::Exhausted(format!(
                    "a ring of {slots} slots of {slot_bytes} bytes ({size} bytes) does not fit: \
                     uid {}'s rings take {theirs} of the {} bytes one user's may \
                     (shm.user_bytes)",
                    owner.uid, self.user_budget
                )))
            }
            Err(None) => {
                return Err(Refusal::Exhausted(format!(
                    "a ring of {slots} slots of {slot_bytes} bytes ({size} bytes) does not fit: \
                     rings take {} of the daemon's {} bytes for shared memory (shm.budget_bytes, \
                     or half of memory.budget_bytes if that is less)",
                    self.used.load(),
                    self.budget
                )))
            }
        }
        let reserved = Reservation {
            used: self.used.clone(),
            uid: owner.uid,
            size,
        };
        let fd = memfd(size).map_err(|e| Refusal::Failed(format!("{e:#}")))?;
        let map = memmap2::MmapOptions::new()
            .len(size as usize)
            .map_raw(fd.as_raw_fd())
            .map_err(|e| Refusal::Failed(format!("mapping the ring: {e}")))?;
        std::mem::forget(reserved); // the ring gives the bytes back when dropped
        let ring = Arc::new(Ring {
            map,
            slots,
            slot_bytes,
            owner,
            lease: Arc::new(tokio::sync::Mutex::new(())),
            closed: Default::default(),
            used: self.used.clone(),
        });
        ring.write_header();
        let token = random_token().map_err(|e| Refusal::Failed(format!("{e}")))?;
        self.open.locked().insert(token, ring.clone());
        Ok((ring, token, fd))
    }

    /// Serves one ring connection: makes the ring asked for, hands it over, and keeps it until
    /// the client closes the connection (or dies) or the daemon stops.
    pub async fn serve(self: Arc<Self>, mut stream: UnixStream, mut stop: Shutdown) {
        let peer = match stream.peer_cred() {
            Ok(cred) => Peer::from(cred),
            Err(e) => {
                tracing::warn!("ring connection without peer credentials: {e}");
                return;
            }
        };
        let mut req = [0u8; REQUEST_BYTES];
        match tokio::time::timeout(HELLO_TIMEOUT, stream.read_exact(&mut req)).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
        let version = u32::from_le_bytes(req[8..12].try_into().unwrap());
        let slots = u32::from_le_bytes(req[12..16].try_into().unwrap());
        let slot_bytes = u64::from_le_bytes(req[16..24].try_into().unwrap());
        let made = if version != VERSION {
            Err(Refusal::BadRequest(format!(
                "ring protocol version {version}; this daemon speaks {VERSION}"
            )))
        } else if peer.pid.is_none() {
            // A ring is its process's alone, and the kernel names no process in another pid
            // namespace (a job's container beside larderd's): its streams could never use the
            // ring. Refused at once, so that the client takes batches in messages.
            Err(Refusal::Failed(
                "the client is in another pid namespace than larderd (a container): shared \
                 memory is for processes the daemon can name; batches come in messages"
                    .into(),
            ))
        } else {
            self.create(peer, slots, slot_bytes)
        };
        let (ring, token) = match made {
            Ok((ring, token, fd)) => {
                let reply = reply(0, &ring, &token, "");
                if let Err(e) = send_with_fd(&stream, &reply, fd.as_raw_fd()).await {
                    tracing::warn!("handing a ring over failed: {e}");
                    self.open.locked().remove(&token);
                    return;
                }
                (ring, token)
            }
            Err(refusal) => {
                let (code, msg) = refusal.code_and_message();
                tracing::info!(uid = peer.uid, "ring refused: {msg}");
                let _ = send_with_fd(&stream, &reply_error(code, &msg), -1).await;
                return;
            }
        };
        tracing::debug!(uid = peer.uid, pid = ?peer.pid, slots = ring.slots, slot_bytes = ring.slot_bytes, "ring opened");
        drop(ring);
        // The ring is the client's while this connection is open.
        let mut buf = [0u8; 64];
        loop {
            tokio::select! {
                read = stream.read(&mut buf) => match read {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {} // nothing is expected; ignore
                },
                _ = stop.stopped() => break,
            }
        }
        if let Some(ring) = self.open.locked().remove(&token) {
            ring.closed.store(true, Ordering::Release);
        }
        tracing::debug!(uid = peer.uid, "ring closed");
    }
}

/// Bytes of a ring of `slots` slots of at least `slot_bytes` each, rounded up to whole pages;
/// None when that does not fit in a u64.
fn ring_bytes(slots: u32, slot_bytes: u64) -> Option<u64> {
    slot_bytes
        .checked_next_multiple_of(4096)?
        .checked_mul(slots as u64)?
        .checked_add(HEADER_BYTES)
}

/// Whether a new Unix-socket connection asks for a ring (else it is gRPC). Waits for its first
/// bytes; errors when it closes or stays silent.
pub async fn is_ring_request(stream: &UnixStream) -> io::Result<bool> {
    let peek = async {
        let mut buf = [0u8; 8];
        let mut wait = Duration::from_millis(1);
        loop {
            stream.readable().await?;
            let n = match stream.try_io(Interest::READABLE, || peek(stream.as_raw_fd(), &mut buf)) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            if buf[..n] != MAGIC[..n] {
                return Ok(false);
            }
            if n == MAGIC.len() {
                return Ok(true);
            }
            // A prefix of the magic so far. Peeking leaves it queued, so the socket stays
            // readable and a close behind it is never read: ask the kernel whether the peer
            // hung up, and wait for the rest of the magic ever longer (a client sends the
            // request in one write; only a slow or hostile one gets here).
            if hung_up(stream.as_raw_fd()) {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_millis(200));
        }
    };
    tokio::time::timeout(HELLO_TIMEOUT, peek)
        .await
        .unwrap_or_else(|_| Err(io::Error::from(io::ErrorKind::TimedOut)))
}

impl Ring {
    fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    fn state(&self, k: u32) -> &AtomicU32 {
        assert!(k < self.slots);
        // SAFETY: the header is inside the mapping, 4-byte aligned (page-aligned base), and
        // lives as long as self; the words are only accessed atomically by the daemon.
        unsafe { &*(self.base().add(STATES_AT + 4 * k as usize) as *const AtomicU32) }
    }

    fn write_header(&self) {
        let mut h = [0u8; 24];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&self.slots.to_le_bytes());
        h[16..24].copy_from_slice(&self.slot_bytes.to_le_bytes());
        // SAFETY: the mapping is at least HEADER_BYTES long and nobody else has it yet.
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), self.base(), h.len()) };
    }

    fn client_next(&self) -> &AtomicU64 {
        // SAFETY: as for `state`; 8-byte aligned.
        unsafe { &*(self.base().add(CLIENT_NEXT_AT) as *const AtomicU64) }
    }

    /// Waits until no other stream uses the ring, then frees every slot but `held` (the slots
    /// the client still has batches in); the stream starts at batch `start`. The ring is this
    /// stream's while the guard lives.
    pub async fn begin_stream(self: &Arc<Self>, held: &[u32], start: u64) -> OwnedMutexGuard<()> {
        let guard = self.lease.clone().lock_owned().await;
        self.client_next().store(start, Ordering::Release);
        for k in 0..self.slots {
            let v = held.contains(&k) as u32;
            self.state(k).store(v, Ordering::Release);
        }
        guard
    }

    /// A slot for batch `b`: waits while the client holds every slot and is still reading
    /// batches before `b`; None when it holds them all and waits for `b` itself.
    pub async fn claim_for(self: &Arc<Self>, b: u64) -> Option<Slot> {
        loop {
            if let Some(slot) = self.claim() {
                return Some(slot);
            }
            if self.client_next().load(Ordering::Acquire) >= b
                || self.closed.load(Ordering::Acquire)
            {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A free slot, claimed for the caller; None when the client holds them all. The lowest
    /// free one: a stream touches only as many slots as it keeps in use at once, not every
    /// slot in turn (a slot's first use costs a page fault per 4 KiB of it, 3-5% of a cold
    /// epoch's CPU when all ten were used in turn), and the slot written is the one most
    /// recently read, still in the caches.
    pub fn claim(self: &Arc<Self>) -> Option<Slot> {
        for k in 0..self.slots {
            if self
                .state(k)
                .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                return Some(Slot {
                    ring: self.clone(),
                    index: k,
                    handed_over: false,
                });
            }
        }
        None
    }

    /// Bytes the ring takes.
    pub fn size(&self) -> u64 {
        HEADER_BYTES + self.slots as u64 * self.slot_bytes
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        self.used.release_for(self.owner.uid, self.size());
    }
}

impl Slot {
    pub fn index(&self) -> u32 {
        self.index
    }

    /// Bytes a batch may take in the slot.
    pub fn capacity(&self) -> usize {
        self.ring.slot_bytes as usize
    }

    /// The slot's bytes, for the daemon to write a batch into. Nothing else in the daemon writes
    /// them while this Slot lives (the client could, into its own data only).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.ring.slot_bytes as usize;
        let at = HEADER_BYTES as usize + self.index as usize * len;
        // SAFETY: the range lies inside the mapping, which lives as long as the Arc'd ring; the
        // claim (0 -> 1) made this the only daemon-side writer of the slot.
        unsafe { std::slice::from_raw_parts_mut(self.ring.base().add(at), len) }
    }

    /// The batch in the slot went to the client: the slot stays taken until it frees it.
    pub fn hand_over(mut self) {
        self.handed_over = true;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if !self.handed_over {
            self.ring.state(self.index).store(0, Ordering::Release);
        }
    }
}

/// Bytes reserved in the budget, given back unless the ring took them over.
struct Reservation {
    used: Arc<RingBytes>,
    uid: u32,
    size: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.used.release_for(self.uid, self.size);
    }
}

/// Why a ring was not made.
enum Refusal {
    BadRequest(String),
    Exhausted(String),
    Failed(String),
}

impl Refusal {
    /// The code in the reply (the client maps it to a gRPC status) and the message.
    fn code_and_message(self) -> (u32, String) {
        match self {
            Refusal::BadRequest(m) => (1, m),
            Refusal::Exhausted(m) => (2, m),
            Refusal::Failed(m) => (3, m),
        }
    }
}

/// The reply to a ring request: u32 status, u32 message length, u64 ring bytes, u64 header
/// bytes, u64 slot bytes, u32 slots, u32 zero, 16-byte token, then the message.
fn reply(status: u32, ring: &Ring, token: &[u8; 16], msg: &str) -> Vec<u8> {
    let mut r = Vec::with_capacity(56 + msg.len());
    r.extend_from_slice(&status.to_le_bytes());
    r.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    r.extend_from_slice(&ring.size().to_le_bytes());
    r.extend_from_slice(&HEADER_BYTES.to_le_bytes());
    r.extend_from_slice(&ring.slot_bytes.to_le_bytes());
    r.extend_from_slice(&ring.slots.to_le_bytes());
    r.extend_from_slice(&0u32.to_le_bytes());
    r.extend_from_slice(token);
    r.extend_from_slice(msg.as_bytes());
    r
}

fn reply_error(status: u32, msg: &str) -> Vec<u8> {
    let mut r = vec![0u8; 56];
    r[..4].copy_from_slice(&status.to_le_bytes());
    r[4..8].copy_from_slice(&(msg.len() as u32).to_le_bytes());
    r.extend_from_slice(msg.as_bytes());
    r
}

/// An anonymous, close-on-exec memfd of `size` bytes whose size is sealed, so the client can
/// neither shrink it under the daemon's mapping nor grow it.
fn memfd(size: u64) -> Result<OwnedFd> {
    // SAFETY: plain syscalls on a descriptor this function owns.
    unsafe {
        let fd = libc::memfd_create(
            c"larder-ring".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error()).context("memfd_create");
        }
        let fd = OwnedFd::from_raw_fd(fd);
        if libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) != 0 {
            return Err(io::Error::last_os_error()).context("sizing the ring's memfd");
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
            bail!("sealing the ring's memfd: {}", io::Error::last_os_error());
        }
        Ok(fd)
    }
}

fn random_token() -> io::Result<[u8; 16]> {
    let mut t = [0u8; 16];
    // SAFETY: getrandom writes at most t.len() bytes into t.
    let n = unsafe { libc::getrandom(t.as_mut_ptr().cast(), t.len(), 0) };
    if n != t.len() as isize {
        return Err(io::Error::last_os_error());
    }
    Ok(t)
}

/// Sends `data` on `stream`, with descriptor `fd` attached (SCM_RIGHTS) unless it is negative.
async fn send_with_fd(stream: &UnixStream, data: &[u8], fd: RawFd) -> io::Result<()> {
    loop {
        stream.writable().await?;
        match stream.try_io(Interest::WRITABLE, || sendmsg(stream.as_raw_fd(), data, fd)) {
            Ok(n) if n == data.len() => return Ok(()),
            Ok(_) => return Err(io::Error::new(io::ErrorKind::WriteZero, "short write")),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Whether the peer of `sock` has closed its end (or the connection is gone).
fn hung_up(sock: RawFd) -> bool {
    let mut fd = libc::pollfd {
        fd: sock,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd, valid for the call; a zero timeout never blocks.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

fn peek(sock: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: recv writes at most buf.len() bytes into buf.
    let n = unsafe { libc::recv(sock, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_PEEK) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

fn sendmsg(sock: RawFd, data: &[u8], fd: RawFd) -> io::Result<usize> {
    // SAFETY: the message header points at live buffers of the sizes given; the control buffer
    // is large enough and aligned (u64 array) for one descriptor.
    unsafe {
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        let mut control = [0u64; 8];
        if fd >= 0 {
            let space = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as usize;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut RawFd, fd);
        }
        let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL);
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Peer {
        Peer {
            pid: Some(std::process::id() as i32),
            // SAFETY: getuid has no preconditions and cannot fail.
            uid: unsafe { libc::getuid() },
        }
    }

    #[test]
    fn one_users_rings_stay_within_their_share_and_leave_the_others_room() {
        let rings = Rings::make(HEADER_BYTES + 16 * 4096, HEADER_BYTES + 8 * 4096, None);
        let bob = Peer {
            pid: Some(2),
            uid: 5002,
        };
        let alice = Peer {
            pid: Some(1),
            uid: 5001,
        };
        // Bob asks for the whole budget: over his share, refused, naming the key.
        match rings.create(bob, 16, 4096) {
            Err(Refusal::Exhausted(why)) => assert!(why.contains("shm.user_bytes"), "{why}"),
            _ => panic!("bob's ring the size of the budget was granted"),
        }
        let (b, bt, _) = rings.create(bob, 8, 4096).ok().unwrap();
        assert!(rings.create(bob, 1, 4096).is_err(), "his share is taken");
        let (a, at, _) = rings
            .create(alice, 7, 4096)
            .ok()
            .expect("alice's ring is granted");
        for t in [bt, at] {
            rings.open.locked().remove(&t);
        }
        drop(b);
        drop(a);
        assert_eq!(rings.snapshot().1, 0);
        assert!(rings.used.by_user.locked().is_empty());
    }

    #[test]
    fn rings_stay_within_the_budget_and_give_their_bytes_back() {
        let rings = Rings::new(HEADER_BYTES + 4 * 8192);
        let (ring, token, _fd) = rings.create(me(), 4, 8000).ok().unwrap();
        assert_eq!(ring.slot_bytes, 8192, "slots are whole pages");
        assert_eq!(rings.snapshot().1, ring.size());
        assert!(matches!(
            rings.create(me(), 1, 1),
            Err(Refusal::Exhausted(_))
        ));
        assert!(rings.get(&token, me()).is_ok());
        let other = Peer {
            pid: Some(1),
            uid: me().uid,
        };
        assert_eq!(rings.get(&token, other).err(), Some(Denied::NotYours));
        assert_eq!(rings.get(&[0; 16], me()).err(), Some(Denied::NotYours));
        rings.open.locked().remove(&token);
        drop(ring);
        assert_eq!(rings.snapshot(), (0, 0, HEADER_BYTES + 4 * 8192));
        assert!(rings.create(me(), 0, 1).is_err());
        assert!(rings.create(me(), MAX_SLOTS + 1, 1).is_err());
    }

    #[tokio::test]
    async fn slots_are_claimed_once_and_freed_unless_handed_over() {
        let rings = Rings::new(1 << 20);
        let (ring, _, fd) = rings.create(me(), 2, 4096).ok().unwrap();
        // The client's view of the same memory.
        let client = memmap2::MmapOptions::new()
            .len(ring.size() as usize)
            .map_raw(fd.as_raw_fd())
            .unwrap();
        let _lease = ring.begin_stream(&[], 0).await;
        let mut a = ring.claim().unwrap();
        let b = ring.claim().unwrap();
        assert!(ring.claim().is_none(), "two slots, both taken");
        a.bytes_mut()[..3].copy_from_slice(b"abc");
        let slot0 =
            // SAFETY: the client's mapping holds the header and two slots: 3 bytes from the first slot's start are in it.
            unsafe { std::slice::from_raw_parts(client.as_ptr().add(HEADER_BYTES as usize), 3) };
        assert_eq!(slot0, b"abc", "the client sees what the daemon wrote");
        drop(b); // never sent: free again
        let c = ring.claim().unwrap();
        assert_eq!(c.index(), 1);
        a.hand_over();
        c.hand_over();
        assert!(ring.claim().is_none(), "the client holds both");
        // The client frees slot 0 by storing 0 in its state word.
        // SAFETY: STATES_AT is in the mapping's header, aligned for a u32: the word the client stores to free a slot.
        unsafe { (client.as_mut_ptr().add(STATES_AT) as *mut u32).write_volatile(0) };
        assert_eq!(ring.claim().unwrap().index(), 0);
        drop(_lease);
        // A new stream frees what the client does not hold.
        let _lease = ring.begin_stream(&[1], 5).await;
        let a = ring.claim_for(5).await.unwrap();
        assert_eq!(a.index(), 0);
        // Slot 1 is the client's; batch 6 waits while the client has not taken batch 5 yet...
        let wait = tokio::time::timeout(Duration::from_millis(30), ring.claim_for(6)).await;
        assert!(wait.is_err(), "backpressure: batch 6 waits for a slot");
        // ...and goes in the message once the client waits for it with every slot held.
        a.hand_over();
        // SAFETY: CLIENT_NEXT_AT is in the mapping's header, aligned for a u64: the word the client stores its next batch in.
        unsafe { (client.as_mut_ptr().add(CLIENT_NEXT_AT) as *mut u64).write_volatile(6) };
        assert!(ring.claim_for(6).await.is_none());
    }
}
