//! The launcher: the one process that may switch users. larderd starts it first thing, before
//! any thread and before its config is read, as a fresh run of its own executable (`child`)
//! with an empty environment: it holds nothing of the daemon's (no credential, no memory),
//! only CAP_SETUID and CAP_SETGID, and its socket to the daemon.
//!
//! It does one thing, at once, for each request: forks a child, switches it wholly (groups,
//! gid, uid) to a user, drops every capability, sets NO_NEW_PRIVS, and executes the daemon's
//! own executable again in it (held open since the daemon started, so a child after an
//! upgrade runs the daemon's code, not the new one) with an empty environment and one
//! descriptor: its socket, whose other end goes back to the daemon. The daemon then speaks to
//! the child itself, and waits for it on its own time: the launcher waits for no child, so no
//! user's child (stopped, or on a hung file system) holds anyone else's up. Each child's parent
//! is a nanny of its own (no capability), which ends when the daemon lets go of the child's
//! lifeline, and the kernel then kills the child, stopped or not. Children are:
//!
//! - **a reader** for a dataset (see `reader`);
//! - **an access check**: may this user read these files (the kernel's answer, `faccessat2`)?
//! - **a recognition**: what kind of dataset is this path, looked at as this user?
//!
//! It never switches to uid 0 or a user whose group is root's, and strips group 0 and the
//! daemon's own group from a child's supplementary groups. It
//! ends when the daemon does (its socket closes; PR_SET_PDEATHSIG), and its children with it.

use super::exec::{Role, CHILD_WITHIN};
use super::wire::{self, kinds, Reader, Writer};
use crate::sync::Locked;
use anyhow::{bail, ensure, Result};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

kinds! {
    /// The launcher's requests.
    enum Request {
        /// A child of a role, as a user: answered with the daemon's end of its socket.
        Spawn = 1,
    }
}

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
    /// Starts the launcher: forks, and runs the daemon's executable `exe` again in the child
    /// as the launcher, with an empty environment and CAP_SETUID and CAP_SETGID (ambient, so
    /// they survive the exec for a daemon that is not root). Call before any other thread
    /// exists: the child runs on in a copy of this process until its exec.
    pub fn start(exe: &OwnedFd) -> Result<Launcher> {
        let (ours, theirs) = wire::pair()?;
        // Made before the fork (the process is single-threaded: the child may allocate, but
        // no lock another thread held is left locked in it).
        let argv = super::exec::argv(Role::Launcher);
        // SAFETY: the process is single-threaded here (the caller's promise); the child only
        // sets up its descriptors and capabilities and executes.
        match unsafe { libc::fork() } {
            -1 => bail!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                // SAFETY: prctl with integer arguments.
                unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
                let why = match super::caps::raise_user_switching_ambient() {
                    Ok(()) => super::exec::exec(exe, &theirs, &argv, false),
                    Err(e) => e,
                };
                eprintln!("larder: the launcher does not start: {why:#?}");
                // SAFETY: ends the child without the daemon's exit handlers.
                unsafe { libc::_exit(1) }
            }
            _ => Ok(Launcher {
                sock: Mutex::new(ours),
                next: std::sync::atomic::AtomicU64::new(1),
            }),
        }
    }

    /// A new child of `role` running as `user`. Quick (two forks in the launcher's children):
    /// the launcher waits for nothing else. An error of the launcher's own (a failed fork, a
    /// descriptor table full) is this request's; a launcher gone or out of turn ends the daemon.
    pub fn spawn(&self, role: Role, user: &User) -> Result<Child> {
        let mut w = Writer::default();
        w.u8(role as u8);
        user.write(&mut w);
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sock = self.sock.locked();
        wire::send(sock.as_raw_fd(), Request::Spawn.into(), id, &w.0, &[])?;
        let mut answer = match wire::recv(sock.as_raw_fd()) {
            Ok(Some(answer)) if answer.id == id => answer,
            // The answer came, but not whole (the daemon's descriptors ran out): this child is
            // not had, and the next request is answered in turn.
            Err(e) => bail!("starting a {role:?}: {e:#}"),
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
        drop(sock);
        if answer.kind == wire::FAILED {
            bail!("{}", answer.failure());
        }
        ensure!(
            answer.kind == u8::from(Request::Spawn) && answer.fds.len() == 2,
            "the launcher answered {}",
            answer.kind
        );
        let lifeline = answer.fds.pop().expect("two");
        let sock = answer.fds.pop().expect("two");
        Ok(Child { sock, lifeline })
    }

    /// A new reader process running as `user`.
    pub fn spawn_reader(&self, user: &User) -> Result<Child> {
        self.spawn(Role::Reader, user)
    }

    /// The kind of source `path` is, looked at as `user` (blocking, at most CHILD_WITHIN).
    pub fn recognize(&self, user: &User, path: &std::path::Path) -> Result<String> {
        use std::os::unix::ffi::OsStrExt;
        let child = self.spawn(Role::Recognize, user)?;
        let mut w = Writer::default();
        w.bytes(path.as_os_str().as_bytes());
        let found = ask_child(&child.sock, &w.0, &[], "recognition of a path", user.uid)?;
        found.map_err(|why| anyhow::anyhow!("{why}"))
    }

    /// Whether `user` may read every one of `files` (blocking, at most CHILD_WITHIN): None if
    /// so, else the first that they may not, with why.
    pub fn check(&self, user: &User, files: &crate::access::Files) -> Result<Option<String>> {
        use crate::access::Files;
        // A list made into a memfd here; a reader's walk handed on as it came.
        let made;
        let memfd = match files {
            Files::List(list) => {
                made = wire::sealed_memfd("larder-check", &wire::path_list(list.iter()))?;
                &made
            }
            Files::Sealed(fd) => fd.as_ref(),
        };
        let child = self.spawn(Role::Check, user)?;
        let found = ask_child(
            &child.sock,
            &[],
            &[memfd.as_raw_fd()],
            "access check",
            user.uid,
        )?;
        Ok(found.err())
    }
}

/// A child of the launcher's as the daemon holds it: its socket, and its lifeline. The child's
/// parent is a nanny (a process of the launcher's, with no capability) that waits on the
/// lifeline's other end and ends when it closes: the kernel then kills the child
/// (PR_SET_PDEATHSIG), whatever it is doing, stopped by its user included. Dropping the
/// `Child` (or its lifeline) ends the child.
pub struct Child {
    pub sock: OwnedFd,
    pub lifeline: OwnedFd,
}

/// Sends a short-lived child its one request and waits for its answer, at most CHILD_WITHIN
/// (on the calling thread: the child is this caller's alone). Ok(Ok) what it found, Ok(Err)
/// why not.
fn ask_child(
    sock: &OwnedFd,
    payload: &[u8],
    fds: &[RawFd],
    what: &str,
    uid: u32,
) -> Result<Result<String, String>> {
    wire::send(sock.as_raw_fd(), 1, 1, payload, fds)?;
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let deadline = std::time::Instant::now() + CHILD_WITHIN;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        ensure!(
            !left.is_zero(),
            "the {what} as uid {uid} did not answer within {} s",
            CHILD_WITHIN.as_secs()
        );
        // SAFETY: poll on one pollfd.
        let n = unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as i32) };
        if n > 0 {
            break;
        }
    }
    match wire::recv(sock.as_raw_fd())? {
        Some(m) if m.kind == 1 => Ok(Ok(String::from_utf8_lossy(&m.payload).into_owned())),
        Some(m) if m.kind == wire::FAILED => Ok(Err(m.failure())),
        _ => bail!("the {what} as uid {uid} ended without an answer"),
    }
}

/// The launcher's life (in its own process, started by `Launcher::start`): keeps CAP_SETUID
/// and CAP_SETGID alone, then serves the daemon's requests on `sock` until it closes.
pub fn serve(sock: OwnedFd) -> ! {
    // SAFETY: signal with integer arguments: children are reaped by the kernel.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_IGN) };
    let kept = super::caps::keep_only_user_switching().and_then(|()| {
        // Nothing it executes gains a privilege by the exec (a setuid-root file, file
        // capabilities): what a taken-over launcher could reach stays its two capabilities.
        // SAFETY: prctl with integer arguments.
        let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
        ensure!(rc == 0, "no_new_privs: {}", std::io::Error::last_os_error());
        ensure!(
            super::caps::can_switch_users(),
            "the launcher has not CAP_SETUID and CAP_SETGID (give them to larderd: the unit's \
             AmbientCapabilities, or start it as root)"
        );
        Ok(())
    });
    // The executable children are started from: this one, which is the daemon's.
    let exe = kept.and_then(|()| super::exec::own_executable());
    let exe = match exe {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("larder launcher: {e:#}");
            // SAFETY: ends the launcher.
            unsafe { libc::_exit(1) }
        }
    };
    // SAFETY: getgid has no arguments.
    let own_group = unsafe { libc::getgid() };
    let fd = sock.as_raw_fd();
    loop {
        let message = match wire::recv(fd) {
            Ok(Some(m)) => m,
            // SAFETY: ends the launcher (the daemon is gone).
            _ => unsafe { libc::_exit(0) },
        };
        let answer = match Request::try_from(message.kind) {
            Ok(Request::Spawn) => spawn(&message, &exe, own_group),
            Err(e) => Err(e),
        };
        let sent = match answer {
            Ok((sock, lifeline)) => wire::send(
                fd,
                message.kind,
                message.id,
                &[],
                &[sock.as_raw_fd(), lifeline.as_raw_fd()],
            ),
            Err(e) => wire::send(
                fd,
                wire::FAILED,
                message.id,
                format!("{e:#}").as_bytes(),
                &[],
            ),
        };
        if sent.is_err() {
            // SAFETY: ends the launcher.
            unsafe { libc::_exit(0) }
        }
    }
}

/// Starts a child as the request's user, of the request's role, under a nanny of its own;
/// returns the daemon's ends of the child's socket and of its lifeline.
fn spawn(m: &wire::Message, exe: &OwnedFd, own_group: u32) -> Result<(OwnedFd, OwnedFd)> {
    let mut r = Reader::new(&m.payload);
    let role = Role::try_from(r.u8()?)?;
    ensure!(role != Role::Launcher, "a second launcher");
    let user = User::read(&mut r)?;
    r.end()?;
    let user = without_privileged_groups(user, own_group)?;
    let (daemon_end, child_end) = wire::pair()?;
    let (lifeline, held) = wire::pair()?;
    let argv = super::exec::argv(role);
    // SAFETY: the launcher is single-threaded.
    match unsafe { libc::fork() } {
        -1 => bail!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            drop(daemon_end);
            drop(lifeline);
            nanny(&user, exe, child_end, held, &argv, role)
        }
        _ => Ok((daemon_end, lifeline)),
    }
}

/// The nanny of one child: forks it (it becomes the user and executes `exe`), then drops every
/// capability and waits until the daemon closes the lifeline (`held`'s other end), or dies,
/// and ends, and with it the child (its parent-death signal is SIGKILL, which the kernel sends
/// as from the nanny: hence the nanny's effective uid is the child's).
fn nanny(
    user: &User,
    exe: &OwnedFd,
    child_end: OwnedFd,
    held: OwnedFd,
    argv: &[std::ffi::CString],
    role: Role,
) -> ! {
    let end = |code| -> ! {
        // SAFETY: ends the nanny without the launcher's exit handlers.
        unsafe { libc::_exit(code) }
    };
    let launcher = std::os::unix::process::parent_id();
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
    if std::os::unix::process::parent_id() != launcher {
        end(0);
    }
    // SAFETY: the nanny is single-threaded.
    match unsafe { libc::fork() } {
        -1 => end(1),
        0 => {
            drop(held);
            let why = match become_user(user) {
                Ok(()) => super::exec::exec(exe, &child_end, argv, true),
                Err(e) => e,
            };
            eprintln!(
                "larder: a {role:?} as uid {} does not start: {why:#?}",
                user.uid
            );
            end(1)
        }
        _ => {}
    }
    drop(child_end);
    // The nanny acts as the user (effective uid) to be allowed to kill the child when it
    // ends (the parent-death signal is checked as from it), and stays the launcher's user
    // (real and saved uid) so that the user cannot signal it (stop it, and so keep the child).
    // SAFETY: plain system calls on this single-threaded process.
    let own = unsafe { libc::getuid() };
    // SAFETY: setresuid with ids of this process's own, on this single-threaded process.
    if unsafe { libc::setresuid(own, user.uid, own) } != 0 || super::caps::drop_all().is_err() {
        end(1);
    }
    super::exec::close_all_but(&[held.as_raw_fd()]);
    let mut byte = [0u8; 1];
    loop {
        // SAFETY: reads into `byte`.
        let n = unsafe { libc::read(held.as_raw_fd(), byte.as_mut_ptr().cast(), 1) };
        if n == 0
            || (n < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted)
        {
            end(0);
        }
    }
}

/// `user` without group 0 and the daemon's own group among their supplementary groups (a
/// child holds neither's rights, whatever the group database says); refused if they are root
/// or their primary group is root's.
fn without_privileged_groups(mut user: User, own_group: u32) -> Result<User> {
    ensure!(user.uid != 0, "no child runs as root");
    ensure!(
        user.gid != 0,
        "uid {}'s group is root's (gid 0): larder starts no reader or check in it",
        user.uid
    );
    user.groups
        .retain(|&g| g != 0 && (g != own_group || g == user.gid));
    Ok(user)
}

/// Becomes `user` for good: groups, gid, uid, then no capability and NO_NEW_PRIVS. For a child
/// the launcher has just forked (single-threaded: `setgroups` and friends change the process).
fn become_user(user: &User) -> Result<()> {
    ensure!(user.uid != 0 && user.gid != 0, "never to root");
    ensure!(!user.groups.contains(&0), "never in group 0");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_never_holds_root_s_group_or_the_daemon_s() {
        let user = User {
            uid: 1000,
            gid: 1000,
            groups: vec![0, 27, 999, 1000],
        };
        let kept = without_privileged_groups(user.clone(), 999).unwrap();
        assert_eq!(kept.groups, vec![27, 1000]);
        for (uid, gid) in [(0, 1000), (1000, 0)] {
            let u = User {
                uid,
                gid,
                ..user.clone()
            };
            assert!(without_privileged_groups(u, 999).is_err(), "{uid}:{gid}");
        }
        // Their own primary group stays theirs, whoever else is in it.
        let u = User { gid: 999, ..user };
        assert_eq!(
            without_privileged_groups(u, 999).unwrap().groups,
            vec![27, 999, 1000]
        );
    }
}
