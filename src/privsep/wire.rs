//! The messages between the daemon, the launcher, the readers and the other children: one
//! message is one `SOCK_SEQPACKET` packet (so a message is never split or merged), `kind u8 |
//! id u64 | payload`, with at most [`MAX_FDS`] file descriptors beside it (`SCM_RIGHTS`: a
//! child's socket, a memfd of records, an objects channel). Each channel names its kinds in
//! one enum declared with [`kinds!`](crate::privsep::wire::kinds) (its `TryFrom<u8>` refuses
//! the rest); every channel answers a request it could not do with [`FAILED`]. Payloads are
//! built with [`Writer`] and read with [`Reader`], whose every read is checked: a message from
//! a process that may be hostile (a reader parses users' files) is never trusted for a length,
//! an offset or a count.
//!
//! The daemon's side of a channel to a child that may stop answering is [`Channel`]: async, on
//! the runtime (no thread parked on a socket), and sends that never block (a child that does
//! not read is a child that failed).

use anyhow::{bail, ensure, Context, Result};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The largest message: requests and answers are small; bulk bytes travel in a memfd.
pub const MAX_MESSAGE: usize = 1 << 20;

/// The most descriptors one message carries.
pub const MAX_FDS: usize = 2;

/// The kind of an answer that says why a request was not done (its payload: the text), on
/// every channel.
pub const FAILED: u8 = 255;

/// Declares a channel's message kinds: a `#[repr(u8)]` enum, `TryFrom<u8>` (an unknown byte is
/// an error naming the channel) and `From<Kind> for u8`. 255 is [`FAILED`] on every channel.
macro_rules! kinds {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($(#[$vm:meta])* $v:ident = $n:literal,)+ }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[repr(u8)]
        $vis enum $name {
            $($(#[$vm])* $v = $n,)+
        }

        impl TryFrom<u8> for $name {
            type Error = anyhow::Error;
            fn try_from(b: u8) -> anyhow::Result<$name> {
                match b {
                    $($n => Ok($name::$v),)+
                    other => anyhow::bail!("a message of kind {other}, which {} has not", stringify!($name)),
                }
            }
        }

        impl From<$name> for u8 {
            fn from(k: $name) -> u8 {
                k as u8
            }
        }
    };
}
pub(crate) use kinds;

/// One message.
#[derive(Debug)]
pub struct Message {
    pub kind: u8,
    pub id: u64,
    pub payload: Vec<u8>,
    /// The descriptors that came with it, in the order sent.
    pub fds: Vec<OwnedFd>,
}

impl Message {
    /// The first descriptor that came with it.
    pub fn fd(&self) -> Option<&OwnedFd> {
        self.fds.first()
    }

    /// The text of a `FAILED` answer.
    pub fn failure(&self) -> String {
        String::from_utf8_lossy(&self.payload).into_owned()
    }
}

/// Room for one control message with `MAX_FDS` descriptors, aligned as `cmsghdr` is.
#[repr(C, align(8))]
struct Control([u8; 64]);

/// Sends a message on `sock` (a SOCK_SEQPACKET socket), with `fds`; waits while the socket's
/// buffer is full.
pub fn send(sock: RawFd, kind: u8, id: u64, payload: &[u8], fds: &[RawFd]) -> Result<()> {
    send_flags(sock, kind, id, payload, fds, 0)
        .map_err(|e| anyhow::Error::new(e).context("sending a message"))
}

/// `send`, with `flags` added to MSG_NOSIGNAL (MSG_DONTWAIT: fail with WouldBlock rather than
/// wait).
fn send_flags(
    sock: RawFd,
    kind: u8,
    id: u64,
    payload: &[u8],
    fds: &[RawFd],
    flags: libc::c_int,
) -> std::io::Result<()> {
    if payload.len() + 9 > MAX_MESSAGE || fds.len() > MAX_FDS {
        return Err(std::io::Error::other(format!(
            "a message of {} bytes and {} descriptors is over the limit",
            payload.len(),
            fds.len()
        )));
    }
    let mut head = [0u8; 9];
    head[0] = kind;
    head[1..9].copy_from_slice(&id.to_le_bytes());
    let iov = [IoSlice::new(&head), IoSlice::new(payload)];
    let mut space = Control([0u8; 64]);
    let space = &mut space.0;
    // SAFETY: msghdr is plain data; its pointers point at `iov` and `space`, alive for the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = iov.len();
    if !fds.is_empty() {
        let bytes = std::mem::size_of_val(fds) as u32;
        // SAFETY: CMSG_SPACE is a size computation.
        let len = unsafe { libc::CMSG_SPACE(bytes) } as usize;
        msg.msg_control = space.as_mut_ptr().cast();
        msg.msg_controllen = len;
        // SAFETY: msg_control holds `len` bytes (at most 64: MAX_FDS descriptors), room for
        // one cmsghdr with the descriptors.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes) as usize;
            for (k, fd) in fds.iter().enumerate() {
                std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>().add(k), *fd);
            }
        }
    }
    loop {
        // SAFETY: `msg` is set up above; MSG_NOSIGNAL: a peer gone is an error, not SIGPIPE.
        let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | flags) };
        if n >= 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives a message from `sock`, waiting for one; Ok(None) when the other end has closed.
pub fn recv(sock: RawFd) -> Result<Option<Message>> {
    recv_flags(sock, 0).map_err(|e| e.context("receiving a message"))
}

/// `recv` with `flags` (MSG_DONTWAIT: an error of kind WouldBlock when none is there).
fn recv_flags(sock: RawFd, flags: libc::c_int) -> Result<Option<Message>> {
    // The next message's length, without taking it (MSG_TRUNC: its whole length, however
    // small the buffer): a buffer of that size, not of MAX_MESSAGE, for every message.
    let mut probe = [0u8; 1];
    let len = loop {
        // SAFETY: recv into a one-byte buffer; MSG_PEEK leaves the message (and its
        // descriptors) where it is.
        let n = unsafe {
            libc::recv(
                sock,
                probe.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_TRUNC | flags,
            )
        };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        // A peer that closed with messages of ours unread resets the connection: closed.
        if e.kind() == std::io::ErrorKind::ConnectionReset {
            return Ok(None);
        }
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e.into());
        }
    };
    let mut buf = vec![0u8; len.clamp(1, MAX_MESSAGE)];
    let mut space = Control([0u8; 64]);
    let space = &mut space.0;
    let mut iov = [IoSliceMut::new(&mut buf)];
    // SAFETY: as in `send_flags`.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = space.len();
    let n = loop {
        // SAFETY: `msg` points at live buffers; MSG_CMSG_CLOEXEC: received fds are not inherited.
        let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | flags) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e.into());
        }
    };
    // Every descriptor that came is owned (and so closed) whatever happens next.
    let mut fds = vec![];
    // SAFETY: the kernel filled msg_control; the CMSG macros walk it within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = (*c).cmsg_len - (data as usize - c as usize);
                for k in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(k));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    ensure!(
        msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) == 0,
        "a message over the limit"
    );
    ensure!(n >= 9, "a message of {n} bytes has no header");
    ensure!(
        fds.len() <= MAX_FDS,
        "a message with {} descriptors",
        fds.len()
    );
    buf.truncate(n);
    Ok(Some(Message {
        kind: buf[0],
        id: u64::from_le_bytes(buf[1..9].try_into().unwrap()),
        payload: buf.split_off(9),
        fds,
    }))
}

/// The daemon's end of a channel to a child process, on the async runtime: receiving waits
/// without a thread; sending never waits (a child whose socket is full is not reading, and
/// is taken for stuck).
pub struct Channel {
    fd: tokio::io::unix::AsyncFd<OwnedFd>,
}

impl Channel {
    /// `sock` (a SOCK_SEQPACKET socket) on the runtime of the caller.
    pub fn new(sock: OwnedFd) -> Result<Channel> {
        // SAFETY: an OwnedFd's descriptor is open, and the same, until it is dropped with the
        // AsyncFd that owns it.
        let fd = unsafe { tokio::io::unix::AsyncFd::register(sock) }
            .map_err(|e| anyhow::anyhow!("watching a child's socket: {e}"))?;
        Ok(Channel { fd })
    }

    /// Sends a message at once, or fails (the socket's buffer full: the child is not reading).
    pub fn send(&self, kind: u8, id: u64, payload: &[u8], fds: &[RawFd]) -> Result<()> {
        match send_flags(self.raw(), kind, id, payload, fds, libc::MSG_DONTWAIT) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                bail!("the child takes no more requests (its socket is full: it is not reading)")
            }
            Err(e) => Err(anyhow::Error::new(e).context("sending a message")),
        }
    }

    /// The next message; Ok(None) once the other end has closed.
    pub async fn recv(&self) -> Result<Option<Message>> {
        loop {
            let mut ready = self.fd.readable().await.context("waiting for a message")?;
            match recv_flags(self.raw(), libc::MSG_DONTWAIT) {
                Err(e)
                    if e.downcast_ref::<std::io::Error>()
                        .is_some_and(|e| e.kind() == std::io::ErrorKind::WouldBlock) =>
                {
                    ready.clear_ready();
                }
                got => return got.context("receiving a message"),
            }
        }
    }

    /// Closes both directions: the child sees its socket closed, and ends.
    pub fn shutdown(&self) {
        // SAFETY: shutdown on our own socket.
        unsafe { libc::shutdown(self.raw(), libc::SHUT_RDWR) };
    }

    fn raw(&self) -> RawFd {
        self.fd.get_ref().as_raw_fd()
    }
}

/// A connected pair of SOCK_SEQPACKET sockets, close-on-exec.
pub fn pair() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: socketpair writes two descriptors into `fds`.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    ensure!(rc == 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Builds a payload.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }
}

/// Reads a payload, every read checked against what is left.
pub struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(data: &'a [u8]) -> Reader<'a> {
        Reader { data }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        ensure!(
            n <= self.data.len(),
            "a message cut short ({n} bytes wanted, {} left)",
            self.data.len()
        );
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        Ok(head)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn str(&mut self) -> Result<&'a str> {
        std::str::from_utf8(self.bytes()?).context("a string that is not UTF-8")
    }
    /// A count of items of at least `item_bytes` each, no more than what is left could hold.
    pub fn count(&mut self, item_bytes: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        ensure!(
            n.saturating_mul(item_bytes.max(1)) <= self.data.len(),
            "a count of {n} that the message cannot hold"
        );
        Ok(n)
    }
    /// What is left of the payload, all of it.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.data)
    }

    /// Fails unless the whole payload was read.
    pub fn end(&self) -> Result<()> {
        if !self.data.is_empty() {
            bail!("{} bytes left over in a message", self.data.len());
        }
        Ok(())
    }
}

/// A new memfd that may be sealed (see `seal`).
pub fn memfd(name: &str) -> Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).unwrap_or_default();
    // SAFETY: memfd_create with a valid name.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    ensure!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor, ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `fd` (a memfd of `memfd`), sealed against writes and resizes, so that what its receiver
/// checked is what it reads.
pub fn seal(fd: OwnedFd) -> Result<OwnedFd> {
    let seals = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    // SAFETY: fcntl on our descriptor.
    let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) };
    ensure!(
        rc == 0,
        "sealing a memfd: {}",
        std::io::Error::last_os_error()
    );
    Ok(fd)
}

/// A memfd holding `data`, sealed against writes and resizes, so that what the receiver
/// checked is what it reads.
pub fn sealed_memfd(name: &str, data: &[u8]) -> Result<OwnedFd> {
    let file = std::fs::File::from(memfd(name)?);
    std::os::unix::fs::FileExt::write_all_at(&file, data, 0).context("writing a memfd")?;
    seal(file.into())
}

/// The length of a memfd another process sent, if it is sealed as `sealed_memfd` seals (its
/// sender can no longer change, grow or shrink it) and holds at most `max` bytes; nothing of
/// it is read.
pub fn sealed_len(fd: &OwnedFd, max: u64) -> Result<u64> {
    // SAFETY: fcntl on a descriptor we own.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    let want = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
    ensure!(
        seals >= 0 && seals & want == want,
        "a memfd that is not sealed"
    );
    // SAFETY: fstat fills `st`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    ensure!(
        // SAFETY: fstat fills `st`, ours, from a descriptor of ours.
        unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0,
        "fstat: {}",
        std::io::Error::last_os_error()
    );
    let len = st.st_size as u64;
    ensure!(
        len <= max,
        "a memfd of {len} bytes, over the {max} expected"
    );
    Ok(len)
}

/// A memfd another process sent, mapped read-only, if it is sealed as `sealed_memfd` seals (its
/// sender can no longer change, grow or shrink it) and holds at most `max` bytes. Only the
/// pages read are touched: a large sparse memfd costs nothing until read.
pub fn map_sealed(fd: &OwnedFd, max: u64) -> Result<Option<memmap2::Mmap>> {
    let len = sealed_len(fd, max)?;
    let file = std::fs::File::from(fd.try_clone()?);
    if len == 0 {
        return Ok(None);
    }
    // SAFETY: sealed against writes and size changes: the mapping's bytes and length hold.
    Ok(Some(unsafe { memmap2::Mmap::map(&file)? }))
}

/// The bytes of a memfd another process sent, if it is sealed as `sealed_memfd` seals: its
/// sender can no longer change them under the reader.
pub fn read_sealed(fd: &OwnedFd, max: u64) -> Result<Vec<u8>> {
    Ok(map_sealed(fd, max)?.map_or_else(Vec::new, |map| map.to_vec()))
}

/// Path lists (a walk, an access check's files): their format lives with the access checks
/// that read them.
pub use crate::access::path_list::{each_path, path_list, paths_of};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_lists_front_code_and_refuse_forgeries() {
        use std::path::PathBuf;
        let paths: Vec<PathBuf> = [
            "/data/a",
            "/data/a/n01/x_1.JPEG",
            "/data/a/n01/x_2.JPEG",
            "/data/b",
            "/other",
            "/other",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        let list = path_list(paths.iter());
        assert_eq!(paths_of(&list).unwrap(), paths);
        let long: Vec<PathBuf> = (0..1000)
            .map(|i| PathBuf::from(format!("/mnt/datasets/imagenet/train/n0144/n0144_{i}.JPEG")))
            .collect();
        let coded = path_list(long.iter());
        let plain: usize = long.iter().map(|p| p.as_os_str().len() + 1).sum();
        assert!(coded.len() * 2 < plain, "{} of {plain} bytes", coded.len());
        assert_eq!(paths_of(&coded).unwrap(), long);
        // Sharing more than the path before, cut short, or repeated prefixes past the bound.
        assert!(paths_of(b"\x05abc\0").is_err());
        assert!(paths_of(b"\x00abc").is_err());
        assert!(paths_of(b"\x80").is_err());
        let mut bomb = vec![0u8];
        bomb.extend(std::iter::repeat_n(b'x', 4096));
        bomb.push(0);
        for _ in 0..100_000 {
            bomb.extend_from_slice(&[0x80, 0x20, 0]);
        }
        assert!(paths_of(&bomb).is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]
        /// Any list's bytes changed: the paths it gave, within the bound, or an error; and any
        /// paths come back as they went.
        #[test]
        fn path_lists_round_trip_and_altered_ones_stay_bounded(
            names in proptest::collection::vec("[a-z/]{1,30}", 1..40),
            edits in proptest::collection::vec((0usize..2000, proptest::prelude::any::<u8>()), 0..6),
        ) {
            let mut paths: Vec<std::path::PathBuf> = names.iter().map(|n| format!("/d/{n}").into()).collect();
            paths.sort();
            let mut list = path_list(paths.iter());
            proptest::prop_assert_eq!(paths_of(&list).unwrap(), paths.clone());
            for (at, v) in edits {
                let at = at % list.len();
                list[at] = v;
            }
            if let Ok(back) = paths_of(&list) {
                let bytes: usize = back.iter().map(|p| p.as_os_str().len()).sum();
                proptest::prop_assert!(bytes <= list.len() * 128 + (1 << 20));
            }
        }
    }

    #[test]
    fn messages_and_descriptors_cross_whole() {
        let (a, b) = pair().unwrap();
        let memfd = sealed_memfd("t", b"records").unwrap();
        send(a.as_raw_fd(), 7, 42, b"hello", &[memfd.as_raw_fd()]).unwrap();
        let m = recv(b.as_raw_fd()).unwrap().unwrap();
        assert_eq!((m.kind, m.id, &m.payload[..]), (7, 42, &b"hello"[..]));
        assert_eq!(read_sealed(m.fd().unwrap(), 100).unwrap(), b"records");
        assert!(read_sealed(m.fd().unwrap(), 3).is_err(), "over the max");
        drop(a);
        assert!(recv(b.as_raw_fd()).unwrap().is_none(), "closed");
    }

    kinds! {
        /// A channel's kinds, for the test.
        enum Test {
            One = 1,
            Two = 2,
        }
    }

    #[test]
    fn kinds_are_typed_and_unknown_bytes_refused() {
        assert_eq!(Test::try_from(2).unwrap(), Test::Two);
        assert_eq!(u8::from(Test::One), 1);
        let e = Test::try_from(FAILED).unwrap_err();
        assert!(format!("{e}").contains("Test"), "{e}");
    }

    #[test]
    fn two_descriptors_and_a_message_of_any_size_up_to_the_limit_cross_whole() {
        let (a, b) = pair().unwrap();
        let (m1, m2) = (
            sealed_memfd("a", b"one").unwrap(),
            sealed_memfd("b", b"two").unwrap(),
        );
        // As large as a socket's send buffer takes whole (about 208 KiB by default).
        let big = vec![7u8; 128 << 10];
        send(a.as_raw_fd(), 1, 2, &big, &[m1.as_raw_fd(), m2.as_raw_fd()]).unwrap();
        send(a.as_raw_fd(), 3, 4, b"", &[]).unwrap();
        let m = recv(b.as_raw_fd()).unwrap().unwrap();
        assert_eq!((m.payload.len(), m.fds.len()), (big.len(), 2));
        assert_eq!(read_sealed(&m.fds[1], 10).unwrap(), b"two");
        let m = recv(b.as_raw_fd()).unwrap().unwrap();
        assert_eq!((m.kind, m.id, m.payload.len()), (3, 4, 0));
        assert!(send(a.as_raw_fd(), 1, 2, &vec![0u8; MAX_MESSAGE], &[]).is_err());
    }

    #[tokio::test]
    async fn a_channel_never_waits_to_send_and_waits_on_the_runtime_to_receive() {
        let (ours, theirs) = pair().unwrap();
        let ch = Channel::new(ours).unwrap();
        // Nobody reads the other end: sends fail once its buffer is full, never block.
        let mut failed = None;
        for i in 0..100_000u64 {
            if let Err(e) = ch.send(1, i, &[0u8; 4096], &[]) {
                failed = Some(e);
                break;
            }
        }
        let e = failed.expect("a full socket refuses at once");
        assert!(format!("{e}").contains("not reading"), "{e}");
        let t = std::thread::spawn(move || {
            send(theirs.as_raw_fd(), 9, 1, b"x", &[]).unwrap();
            theirs
        });
        let m = ch.recv().await.unwrap().unwrap();
        assert_eq!((m.kind, m.id), (9, 1));
        drop(t.join().unwrap());
        assert!(ch.recv().await.unwrap().is_none(), "closed");
    }

    #[test]
    fn unsealed_memfds_are_refused() {
        let file = tempfile::tempfile().unwrap();
        std::io::Write::write_all(&mut &file, b"x").unwrap();
        assert!(read_sealed(&OwnedFd::from(file), 10).is_err());
    }

    #[test]
    fn payload_reads_are_checked() {
        let mut w = Writer::default();
        w.u8(1).u32(2).u64(3).str("four");
        let mut r = Reader::new(&w.0);
        assert_eq!(
            (r.u8().unwrap(), r.u32().unwrap(), r.u64().unwrap()),
            (1, 2, 3)
        );
        assert_eq!(r.str().unwrap(), "four");
        r.end().unwrap();
        let mut r = Reader::new(&[9, 0, 0, 0, 1]);
        assert!(r.bytes().is_err(), "a length past the end");
        let mut r = Reader::new(&[255, 255, 255, 255]);
        assert!(r.count(8).is_err(), "a count the message cannot hold");
    }
}
