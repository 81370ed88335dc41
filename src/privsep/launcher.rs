//! The launcher: the one process that may switch users. It is forked from larderd before the
//! daemon starts a thread, keeps CAP_SETUID and CAP_SETGID, and does two things for the daemon,
//! each in a child process it forks and switches wholly (groups, gid, uid) to a user, with
//! every capability dropped and NO_NEW_PRIVS set before the child does anything:
//!
//! - **a reader** for a user's dataset (see `reader`): its socket goes back to the daemon;
//! - **an access check**: may this user read these files (the kernel's answer, `faccessat2`)?
//!
//! Each child puts itself under the seccomp filter of `sandbox` as soon as it is that user.
//! The launcher parses nothing but its own small requests; it never reads a dataset's files;
//! it never switches to uid 0. It ends when the daemon does (its socket closes; PR_SET_PDEATHSIG).

use super::wire::{self, Reader, Writer};
use anyhow::{bail, ensure, Context, Result};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Mutex;

const SPAWN_READER: u8 = 1;
const CHECK: u8 = 2;
const RECOGNIZE: u8 = 3;
const FAILED: u8 = 255;

/// How long an access check or a kind's recognition may take (a user may stop the child that
/// runs as them, or a file system may hang): past it the launcher gives up on the child.
const CHILD_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// A user, as the launcher switches to them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl From<&crate::access::Identity> for User {
    fn from(id: &crate::access::Identity) -> User {
        User {
            uid: id.uid,
            gid: id.gid,
            groups: id.groups.clone(),
        }
    }
}

impl User {
    fn write(&self, w: &mut Writer) {
        w.u32(self.uid).u32(self.gid).u32(self.groups.len() as u32);
        for g in &self.groups {
            w.u32(*g);
        }
    }

    fn read(r: &mut Reader) -> Result<User> {
        let (uid, gid) = (r.u32()?, r.u32()?);
        let n = r.count(4)?;
        ensure!(n <= 65536, "{n} groups");
        let groups = (0..n).map(|_| r.u32()).collect::<Result<_>>()?;
        Ok(User { uid, gid, groups })
    }
}

/// The daemon's end of the launcher.
pub struct Launcher {
    sock: Mutex<OwnedFd>,
    next: std::sync::atomic::AtomicU64,
}

impl Launcher {
    /// Forks the launcher. Call before any other thread exists: the child runs on in a copy of
    /// this process, and a lock another thread held at the fork would stay held there.
    pub fn start() -> Result<Launcher> {
        let (ours, theirs) = wire::pair()?;
        // SAFETY: the process is single-threaded here (the caller's promise); the child only
        // runs `serve`, which forks and exits.
        match unsafe { libc::fork() } {
            -1 => bail!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                drop(ours);
                // SAFETY: prctl and signal with integer arguments.
                unsafe {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
                    // Children are reaped by the kernel: the launcher waits for none.
                    libc::signal(libc::SIGCHLD, libc::SIG_IGN);
                }
                close_all_but(&[theirs.as_raw_fd()]);
                if let Err(e) = super::caps::keep_only_user_switching() {
                    eprintln!("larder launcher: {e:#}");
                    // SAFETY: ends the launcher without the daemon's exit handlers.
                    unsafe { libc::_exit(1) }
                }
                serve(theirs.as_raw_fd());
                // SAFETY: ends the launcher without running the daemon's exit handlers.
                unsafe { libc::_exit(0) }
            }
            _ => Ok(Launcher {
                sock: Mutex::new(ours),
                next: std::sync::atomic::AtomicU64::new(1),
            }),
        }
    }

    fn call(&self, kind: u8, payload: &[u8], fd: Option<RawFd>) -> Result<wire::Message> {
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sock = self.sock.lock().unwrap_or_else(|e| e.into_inner());
        wire::send(sock.as_raw_fd(), kind, id, payload, fd)?;
        let answer = match wire::recv(sock.as_raw_fd()) {
            Ok(Some(answer)) if answer.id == id => answer,
            // The launcher gone, or an answer to another request: the daemon cannot vouch for
            // any check from here on; it ends, and its service manager starts it again.
            other => {
                tracing::error!(
                    "the launcher has ended or answers out of turn ({:?}): stopping",
                    other.map(|m| m.map(|m| (m.kind, m.id)))
                );
                std::process::exit(70);
            }
        };
        if answer.kind == FAILED {
            bail!("{}", String::from_utf8_lossy(&answer.payload));
        }
        ensure!(answer.kind == kind, "the launcher answered {}", answer.kind);
        Ok(answer)
    }

    /// A new reader process running as `user`: the daemon's end of its socket.
    pub fn spawn_reader(&self, user: &User) -> Result<OwnedFd> {
        let mut w = Writer::default();
        user.write(&mut w);
        self.call(SPAWN_READER, &w.0, None)?
            .fd
            .context("the launcher sent no reader socket")
    }

    /// The kind of source `path` is, looked at as `user`.
    pub fn recognize(&self, user: &User, path: &std::path::Path) -> Result<String> {
        use std::os::unix::ffi::OsStrExt;
        let mut w = Writer::default();
        user.write(&mut w);
        w.bytes(path.as_os_str().as_bytes());
        let answer = self.call(RECOGNIZE, &w.0, None)?;
        Ok(String::from_utf8_lossy(&answer.payload).into_owned())
    }

    /// Whether `user` may read every one of `files`: None if so, else the first that they may
    /// not, with why.
    pub fn check(&self, user: &User, files: &[PathBuf]) -> Result<Option<String>> {
        let memfd = wire::sealed_memfd("larder-check", &wire::path_list(files))?;
        let mut w = Writer::default();
        user.write(&mut w);
        let answer = self.call(CHECK, &w.0, Some(memfd.as_raw_fd()))?;
        let why = String::from_utf8_lossy(&answer.payload).into_owned();
        Ok((!why.is_empty()).then_some(why))
    }
}

/// The launcher's loop: one request at a time, until the daemon's end closes.
fn serve(sock: RawFd) {
    loop {
        let message = match wire::recv(sock) {
            Ok(Some(m)) => m,
            _ => return,
        };
        let answer = match message.kind {
            SPAWN_READER => spawn_reader(&message).map(|fd| (Vec::new(), Some(fd))),
            CHECK => check(&message).map(|why| (why.into_bytes(), None)),
            RECOGNIZE => recognize(&message).map(|kind| (kind.into_bytes(), None)),
            k => Err(anyhow::anyhow!("unknown request {k}")),
        };
        let sent = match answer {
            Ok((payload, fd)) => wire::send(
                sock,
                message.kind,
                message.id,
                &payload,
                fd.as_ref().map(|f| f.as_raw_fd()),
            ),
            Err(e) => wire::send(sock, FAILED, message.id, format!("{e:#}").as_bytes(), None),
        };
        if sent.is_err() {
            return;
        }
    }
}

/// Becomes `user` for good: groups, gid, uid, then no capability and NO_NEW_PRIVS. For a child
/// the launcher has just forked (single-threaded: `setgroups` and friends change the process).
fn become_user(user: &User) -> Result<()> {
    ensure!(user.uid != 0 && user.gid != 0, "never to root");
    // SAFETY: plain system calls on this single-threaded process.
    unsafe {
        ensure!(
            libc::setgroups(user.groups.len(), user.groups.as_ptr()) == 0,
            "setgroups: {}",
            std::io::Error::last_os_error()
        );
        ensure!(
            libc::setresgid(user.gid, user.gid, user.gid) == 0,
            "setresgid: {}",
            std::io::Error::last_os_error()
        );
        ensure!(
            libc::setresuid(user.uid, user.uid, user.uid) == 0,
            "setresuid: {}",
            std::io::Error::last_os_error()
        );
        ensure!(
            libc::geteuid() == user.uid && libc::getegid() == user.gid,
            "the switch did not hold"
        );
    }
    super::caps::drop_all()?;
    // The parent-death signal is cleared by the switch: set it now, and end at once if the
    // launcher has gone meanwhile.
    let parent = std::os::unix::process::parent_id();
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    ensure!(
        std::os::unix::process::parent_id() == parent && parent != 1,
        "the launcher has ended"
    );
    Ok(())
}

/// Closes every descriptor of this process but 0, 1, 2 and `keep`: a child of the launcher
/// holds nothing of the launcher's or the daemon's.
fn close_all_but(keep: &[RawFd]) {
    let mut keep: Vec<u32> = keep.iter().map(|&f| f as u32).filter(|&f| f > 2).collect();
    keep.sort_unstable();
    let mut from = 3u32;
    for k in keep.iter().copied().chain([u32::MAX]) {
        if k > from {
            let to = k.saturating_sub(1).max(from);
            // SAFETY: close_range closes descriptors, no memory is touched.
            let rc = unsafe { libc::syscall(libc::SYS_close_range, from, to, 0) };
            if rc != 0 {
                // Kernels before 5.9: one by one, as far as the descriptor limit goes.
                for fd in from..to.min(1 << 20) {
                    // SAFETY: closing a descriptor number this process may not even hold.
                    unsafe { libc::close(fd as RawFd) };
                }
            }
        }
        from = k.saturating_add(1);
    }
}

/// Reads a child's answer from `read_end` until it closes, for at most CHILD_WITHIN.
fn answer_within(read_end: OwnedFd, what: &str) -> Result<String> {
    let deadline = std::time::Instant::now() + CHILD_WITHIN;
    let mut out = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        ensure!(
            !left.is_zero(),
            "the {what} did not answer within {} s",
            CHILD_WITHIN.as_secs()
        );
        let mut p = libc::pollfd {
            fd: read_end.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll on one pollfd.
        let n = unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as i32) };
        if n <= 0 {
            continue;
        }
        let mut buf = [0u8; 4096];
        // SAFETY: reads into `buf`.
        let got = unsafe { libc::read(read_end.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if got <= 0 {
            return Ok(String::from_utf8_lossy(&out).into_owned());
        }
        out.extend_from_slice(&buf[..got as usize]);
        ensure!(out.len() <= 1 << 16, "the {what} answered too much");
    }
}

/// Runs `f` in a child switched to `user`, its answer read back within CHILD_WITHIN: Ok(Ok) what
/// it found, Ok(Err) why not (sent as "1" or "0" and the text: nothing at all is a child that
/// died).
fn as_child(
    user: &User,
    what: &str,
    keep: &[RawFd],
    f: impl FnOnce() -> Result<String, String>,
) -> Result<Result<String, String>> {
    let mut pipe = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two descriptors.
    ensure!(
        unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } == 0,
        "pipe: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: both are new descriptors, ours.
    let (read_end, write_end): (OwnedFd, OwnedFd) = unsafe {
        use std::os::fd::FromRawFd;
        (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1]))
    };
    // SAFETY: the launcher is single-threaded.
    match unsafe { libc::fork() } {
        -1 => bail!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            drop(read_end);
            let mut keep = keep.to_vec();
            keep.push(write_end.as_raw_fd());
            close_all_but(&keep);
            let text = match become_user(user)
                .and_then(|()| super::sandbox::restrict_syscalls().map(drop))
                .map_err(|e| format!("the {what} could not run as uid {}: {e:#}", user.uid))
            {
                Ok(()) => match f() {
                    Ok(found) => format!("1{found}"),
                    Err(why) => format!("0{why}"),
                },
                Err(why) => format!("0{why}"),
            };
            let file = std::fs::File::from(write_end);
            let _ = std::io::Write::write_all(&mut &file, text.as_bytes());
            // SAFETY: ends the child without the daemon's exit handlers.
            unsafe { libc::_exit(0) }
        }
        _ => {
            drop(write_end);
            let text = answer_within(read_end, what)?;
            match text.split_at_checked(1) {
                Some(("1", found)) => Ok(Ok(found.to_string())),
                Some(("0", why)) if !why.is_empty() => Ok(Err(why.to_string())),
                _ => bail!("the {what} ended without an answer"),
            }
        }
    }
}

/// The kind of source the request's path is, recognised as its user.
fn recognize(m: &wire::Message) -> Result<String> {
    let mut r = Reader::new(&m.payload);
    let user = User::read(&mut r)?;
    let path =
        PathBuf::from(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(r.bytes()?));
    r.end()?;
    as_child(&user, "recognition of a path", &[], || {
        // It looks at this path alone (a link in it is followed once, here).
        super::sandbox::restrict_files(std::slice::from_ref(&path))
            .map_err(|e| format!("{e:#}"))?;
        crate::source::recognize(&path)
            .map(|f| f.name().to_string())
            .map_err(|e| format!("{e:#}"))
    })?
    .map_err(|why| anyhow::anyhow!("{why}"))
}

/// Forks a reader as the request's user; returns the daemon's end of its socket.
fn spawn_reader(m: &wire::Message) -> Result<OwnedFd> {
    let mut r = Reader::new(&m.payload);
    let user = User::read(&mut r)?;
    r.end()?;
    ensure!(user.uid != 0, "no reader runs as root");
    let (daemon_end, reader_end) = wire::pair()?;
    // SAFETY: the launcher is single-threaded.
    match unsafe { libc::fork() } {
        -1 => bail!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            drop(daemon_end);
            close_all_but(&[reader_end.as_raw_fd()]);
            let code = match become_user(&user) {
                Ok(()) => {
                    super::reader::serve(reader_end);
                    0
                }
                Err(e) => {
                    eprintln!("larder reader: {e:#}");
                    1
                }
            };
            // SAFETY: ends the child without the daemon's exit handlers.
            unsafe { libc::_exit(code) }
        }
        _ => Ok(daemon_end),
    }
}

/// Checks the request's files as its user in a child; returns "" when they may read them all,
/// else why not.
fn check(m: &wire::Message) -> Result<String> {
    let mut r = Reader::new(&m.payload);
    let user = User::read(&mut r)?;
    r.end()?;
    let list = m.fd.as_ref().context("no file list")?;
    let readable = as_child(&user, "access check", &[list.as_raw_fd()], || {
        let list = wire::read_sealed(list, 1 << 30)
            .map_err(|e| format!("the check could not read its file list: {e:#}"))?;
        match crate::access::first_unreadable_text(&wire::paths_of(&list)) {
            None => Ok(String::new()),
            Some(why) => Err(why),
        }
    })?;
    match readable {
        Ok(nothing) if nothing.is_empty() => Ok(String::new()),
        Ok(_) => bail!("the access check ended without an answer"),
        Err(why) => Ok(why),
    }
}
