//! Who is asking, and what they may read.
//!
//! **Who.** On the Unix socket the kernel says who the peer is when it connects (SO_PEERCRED:
//! uid, gid, pid; SO_PEERGROUPS: the process's supplementary groups, the ones its own reads are
//! checked with). Over TCP there is no identity: a TCP client is anonymous and sees only
//! datasets marked `tcp = true`.
//!
//! **The rule.** A local client may list, plan, warm and stream a dataset if its entry grants
//! it (`allow = ["all", "user:alice", "group:ml"]`), or if it could read the dataset's raw files
//! itself: the kernel's answer for that user, groups and ACLs included, got by checking every
//! file as them (`faccessat2(R_OK, AT_EACCESS)` on a thread switched to their file-system
//! identity). Everyone else gets PERMISSION_DENIED naming the dataset, and ListDatasets shows
//! them only what they may read. The tiers hold one copy of each sample for everyone: the
//! check is what keeps a cached sample from reaching a user who could not read its file.
//!
//! **Proofs.** A check passed is a proof for (user and groups, dataset), good for at most [`PROOF_TTL`]
//! and while the dataset's root keeps its status-change time: a stream reuses it when it opens
//! and checks again whenever its proof is older, so a chmod that takes a user's right away ends
//! their streams and refuses their next within that bound (at once when it is the root's).
//!
//! **Switching identity.** Like Samba and the NFS servers: on a thread of its own, with raw
//! system calls that change only the calling thread (glibc's `setgroups` changes every thread
//! of the process): the groups, then fsgid, then fsuid; the check; then back. The thread is
//! one made for the check and ended after it, so no other work ever runs under a switched
//! identity. Never to uid 0: root and the daemon's own user have the daemon's own rights. A
//! daemon that cannot switch (not root, no CAP_SETUID/CAP_SETGID) checks only its own user's
//! requests this way and denies other users what `allow` does not grant.

use crate::sync::Locked;
pub mod connection;
pub mod local_authority;
pub mod path_list;
mod switch;

/// The daemon's effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Root or the daemon's own user: who reads files as the daemon itself, pays as the config
/// does, and is told why datasets are not served.
pub fn is_admin_uid(uid: u32) -> bool {
    uid == 0 || uid == euid()
}

pub use switch::{as_user, open_no_magiclinks};

use crate::error::{quote, Error, Kind};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a passed check stands before it is made again.
pub const PROOF_TTL: Duration = Duration::from_secs(60);

/// A local user, as the kernel and the group database say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub uid: u32,
    /// The process's group (SO_PEERCRED).
    pub gid: u32,
    /// Every group of the user: the process's, the user's primary one and their
    /// supplementary ones.
    pub groups: Vec<u32>,
    pub pid: Option<i32>,
}

impl Identity {
    /// The identity of the process at the other end of Unix socket `fd`, as the kernel says:
    /// its uid, gid and pid (SO_PEERCRED) and its groups (SO_PEERGROUPS).
    pub fn of_socket(fd: std::os::fd::RawFd) -> io::Result<Identity> {
        let mut cred = libc::ucred {
            pid: 0,
            uid: 0,
            gid: 0,
        };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: `cred` is a ucred and `len` its size.
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut groups = vec![cred.gid];
        groups.extend(peer_groups(fd)?);
        groups.sort_unstable();
        groups.dedup();
        Ok(Identity {
            uid: cred.uid,
            gid: cred.gid,
            groups,
            pid: (cred.pid > 0).then_some(cred.pid),
        })
    }

    /// The identity of user `uid` in their primary group (with their groups added).
    pub fn of_user_primary(uid: u32) -> Identity {
        // A uid the password database does not know: group nogroup.
        let gid = user_name(uid).map_or(65534, |(_, gid)| gid);
        Identity::of_user(uid, gid, None)
    }

    /// The identity of user `uid` in group `gid` (with the user's groups added).
    pub fn of_user(uid: u32, gid: u32, pid: Option<i32>) -> Identity {
        let mut groups = vec![gid];
        if let Some((name, primary)) = user_name(uid) {
            groups.extend(group_list(&name, primary));
        }
        groups.sort_unstable();
        groups.dedup();
        Identity {
            uid,
            gid,
            groups,
            pid,
        }
    }
}

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A process on this machine, over the Unix socket.
    Local(Arc<Identity>),
    /// A client over TCP: no identity.
    Tcp,
}

impl Caller {
    /// The caller of a request: local when it came over the Unix socket.
    pub fn of<T>(request: &tonic::Request<T>) -> Caller {
        request
            .extensions()
            .get::<connection::PeerInfo>()
            .map_or(Caller::Tcp, |p| Caller::Local(p.0.clone()))
    }

    /// The process that asked, as rings know their owners (None over TCP).
    pub fn peer(&self) -> Option<crate::peer::Peer> {
        match self {
            Caller::Local(id) => Some(crate::peer::Peer {
                pid: id.pid,
                uid: id.uid,
            }),
            Caller::Tcp => None,
        }
    }

    /// Root or the daemon's own user, over the Unix socket: who sees why datasets are not
    /// served.
    pub fn is_admin(&self) -> bool {
        matches!(self, Caller::Local(id) if is_admin_uid(id.uid))
    }

    /// Names the caller in logs and messages.
    pub fn describe(&self) -> String {
        match self {
            Caller::Local(id) => format!("uid {}", id.uid),
            Caller::Tcp => "a TCP client".to_string(),
        }
    }
}

/// Access checks passed lately, by (user, groups, dataset id), with the status-change time of the
/// dataset's file or folder then: listings, streams, plans and warms reuse one younger than
/// [`PROOF_TTL`] whose time has not moved (a chmod or chown of the root moves it) rather than
/// check every file again (a million-file folder, each rank and worker of a job at each epoch's
/// start). A chmod of a file inside a folder takes effect within `PROOF_TTL`.
#[derive(Default)]
pub struct Proofs(Mutex<HashMap<ProofKey, Proof>>);

/// Who passed a check, with the groups they had (two processes of one user may hold different
/// groups), and for which dataset.
type ProofKey = (u32, u32, Vec<u32>, u32);

/// When a check passed, and the status-change time of the dataset's root then.
type Proof = (Instant, Option<i128>);

fn proof_key(who: &Identity, id: u32) -> ProofKey {
    (who.uid, who.gid, who.groups.clone(), id)
}

impl Proofs {
    /// Whether `who` passed the check for dataset `id`, whose root is `root`, less than
    /// PROOF_TTL ago and with the root's ctime as it is now.
    pub fn fresh(&self, who: &Caller, id: u32, root: Option<&Path>) -> bool {
        self.made(who, id, root).is_some()
    }

    /// When the check `fresh` reuses was made. A root the daemon cannot look at (no ctime to
    /// compare) has no proof reused: a chmod of it could not be seen.
    pub fn made(&self, who: &Caller, id: u32, root: Option<&Path>) -> Option<Instant> {
        let Caller::Local(who) = who else {
            return None;
        };
        let now = match root {
            Some(r) => Some(ctime_of(r)?),
            None => None,
        };
        let proofs = self.0.locked();
        proofs
            .get(&proof_key(who, id))
            .filter(|(at, ctime)| at.elapsed() < PROOF_TTL && *ctime == now)
            .map(|(at, _)| *at)
    }

    /// Notes that `who` passed the check for dataset `id`, whose root is `root` (None: a root
    /// the daemon does not look at, a user's own; the proof then stands its time alone), now.
    pub fn record(&self, who: &Caller, id: u32, root: Option<&Path>) {
        if let Caller::Local(who) = who {
            let ctime = root.and_then(ctime_of);
            let mut proofs = self.0.locked();
            proofs.retain(|_, (at, _)| at.elapsed() < PROOF_TTL);
            proofs.insert(proof_key(who, id), (Instant::now(), ctime));
        }
    }
}

/// The status-change time of `path`, in nanoseconds.
pub fn ctime_of(path: &Path) -> Option<i128> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128)
}

/// One grant of a dataset's `allow` list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Grant {
    /// Every local user.
    All,
    User(u32),
    Group(u32),
}

impl Grant {
    /// Parses "all", "user:NAME" (or a uid) or "group:NAME" (or a gid).
    pub fn parse(s: &str) -> Result<Grant, String> {
        if s == "all" {
            return Ok(Grant::All);
        }
        let (kind, name) = s.split_once(':').ok_or_else(|| {
            format!(
                "{} is not \"all\", \"user:NAME\" or \"group:NAME\"",
                quote(s)
            )
        })?;
        match kind {
            "user" => name
                .parse()
                .ok()
                .or_else(|| uid_of(name))
                .map(Grant::User)
                .ok_or_else(|| format!("no user {} on this machine", quote(name))),
            "group" => name
                .parse()
                .ok()
                .or_else(|| gid_of(name))
                .map(Grant::Group)
                .ok_or_else(|| format!("no group {} on this machine", quote(name))),
            _ => Err(format!(
                "{} is not \"all\", \"user:NAME\" or \"group:NAME\"",
                quote(s)
            )),
        }
    }

    /// Whether this grant covers `id`.
    pub fn grants(&self, id: &Identity) -> bool {
        match self {
            Grant::All => true,
            Grant::User(uid) => id.uid == *uid,
            Grant::Group(gid) => id.groups.contains(gid),
        }
    }
}

/// What a dataset's access depends on: its grants, whether TCP clients may have it, and the
/// files a user must be able to read to have it without a grant.
pub struct Guard {
    pub allow: Vec<Grant>,
    pub tcp: bool,
}

/// Why a caller may not have a dataset.
pub fn denied(dataset: &str, who: &Caller, why: &str) -> Error {
    Error::new(
        Kind::Denied,
        format!(
            "{} may not read dataset {}: {why}",
            who.describe(),
            quote(dataset)
        ),
    )
}

/// What `guard` decides for `who` without looking at any file: TCP callers, grants, root and
/// the daemon's own user; None when the files must be checked as the caller.
pub fn decide(guard: &Guard, who: &Caller) -> Option<Result<(), String>> {
    let id = match who {
        Caller::Tcp if guard.tcp => return Some(Ok(())),
        Caller::Tcp => {
            return Some(Err(
                "over TCP only datasets marked tcp = true are served (TCP has no identity); \
                 use the daemon's Unix socket"
                    .into(),
            ))
        }
        Caller::Local(id) => id,
    };
    if guard.allow.iter().any(|g| g.grants(id)) {
        return Some(Ok(()));
    }
    if is_admin_uid(id.uid) {
        // Root, or the daemon's own user: what the daemon reads with its own rights is what
        // they could read (the daemon as root reads anything; as user larder, only larder's).
        return Some(Ok(()));
    }
    None
}

/// The files a user must be able to read to have a dataset.
#[derive(Clone, Debug)]
pub enum Files {
    /// As a list (a dataset the daemon opened, or an object store's location).
    List(Arc<[PathBuf]>),
    /// As a sealed memfd of NUL-ended paths: a reader's walk, kept as it came (the daemon
    /// never makes a list of it) and handed to each check as it is.
    Sealed(Arc<std::os::fd::OwnedFd>),
}

impl Files {
    /// The list, read from the memfd if it is one.
    pub fn to_list(&self) -> Result<Arc<[PathBuf]>, String> {
        match self {
            Files::List(l) => Ok(l.clone()),
            Files::Sealed(fd) => {
                use std::os::unix::fs::FileExt;
                let file = std::fs::File::from(
                    fd.try_clone()
                        .map_err(|e| format!("reading a dataset's file list: {e}"))?,
                );
                let len = file.metadata().map_err(|e| e.to_string())?.len();
                let mut bytes = vec![0u8; len as usize];
                file.read_exact_at(&mut bytes, 0)
                    .map_err(|e| format!("reading a dataset's file list: {e}"))?;
                path_list::paths_of(&bytes)
                    .map(Into::into)
                    .map_err(|e| format!("reading a dataset's file list: {e}"))
            }
        }
    }
}

/// Checks files as a user in a process of its own (the launcher's): None when they may read
/// them all, Some(why) when not; Err when the check could not run.
pub type Checker = Box<dyn Fn(&Identity, &Files) -> Result<Option<String>, String> + Send + Sync>;

static CHECKER: std::sync::OnceLock<Checker> = std::sync::OnceLock::new();

/// Hands every access check from now on to `checker` (a daemon without capabilities).
pub fn set_checker(checker: Checker) {
    let _ = CHECKER.set(checker);
}

/// Whether `who` may have a dataset guarded by `guard` whose raw files are `files` (checked
/// as the caller: in a process switched to them when the launcher runs, else on a thread of
/// its own; call from a blocking context). Err says why not.
pub fn check(guard: &Guard, who: &Caller, files: &Files) -> Result<(), String> {
    if let Some(decided) = decide(guard, who) {
        return decided;
    }
    let Caller::Local(id) = who else {
        unreachable!("decide answers for TCP callers")
    };
    let url = match files {
        Files::List(l) => l.iter().find(|f| crate::objects::is_url(f)),
        Files::Sealed(_) => None,
    };
    if let Some(url) = url {
        // No user's rights reach an object store: the daemon reads it with its credentials.
        return Err(format!(
            "{} is in an object store, read with the daemon's credentials: only the users \
             its `allow` grants may read it",
            url.display()
        ));
    }
    if let Some(checker) = CHECKER.get() {
        return match checker(id, files) {
            Ok(None) => Ok(()),
            Ok(Some(why)) => Err(why),
            Err(e) => Err(format!("the access check as uid {} failed: {e}", id.uid)),
        };
    }
    let (id, files) = (id.clone(), files.to_list()?);
    let outcome = std::thread::spawn(move || as_user(&id, || first_unreadable(&files)))
        .join()
        .map_err(|_| "the access check failed".to_string())?;
    match outcome {
        Ok(None) => Ok(()),
        Ok(Some((p, e))) => Err(unreadable(&p, &e)),
        Err(e) => Err(format!(
            "the daemon cannot check files as another user ({e}): run it as root or with \
             CAP_SETUID and CAP_SETGID, or grant the dataset with allow = [...]"
        )),
    }
}

fn unreadable(path: &Path, e: &io::Error) -> String {
    format!("cannot read {}: {e}", path.display())
}

/// Why this process may not read the first of `files` it may not read (None: it may read them
/// all): what a check run as the user in a process of its own answers.
pub fn first_unreadable_text(files: &[PathBuf]) -> Option<String> {
    first_unreadable(files).map(|(p, e)| unreadable(&p, &e))
}

/// Why this thread may not read `path`, if it may not (`first_unreadable_text` for one file).
pub fn unreadable_text(path: &Path) -> Option<String> {
    may_read(path).err().map(|e| unreadable(path, &e))
}

/// The first of `files` this thread may not read, with why.
fn first_unreadable(files: &[PathBuf]) -> Option<(PathBuf, io::Error)> {
    files
        .iter()
        .find_map(|p| may_read(p).err().map(|e| (p.clone(), e)))
}

/// Whether this thread's file-system identity may read `path` (the kernel's answer: mode,
/// groups, ACLs, every directory on the way). faccessat2 with AT_EACCESS checks with the
/// thread's fsuid and fsgid; called directly, as glibc would emulate it by hand on a kernel
/// without it, with the wrong ids.
fn may_read(path: &Path) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a NUL-terminated path; plain integer arguments.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_faccessat2,
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::R_OK,
            libc::AT_EACCESS,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A user's entry in the password database, looked up by `lookup` (getpwuid_r or
/// getpwnam_r, with the buffers they fill): (name, uid, primary gid).
fn passwd_entry(
    lookup: impl FnOnce(
        *mut libc::passwd,
        *mut libc::c_char,
        usize,
        *mut *mut libc::passwd,
    ) -> libc::c_int,
) -> Option<(CString, u32, u32)> {
    let mut buf = vec![0u8; 16384];
    // SAFETY: passwd is a plain C struct of integers and pointers: all zero is a valid value (getpwnam_r fills it).
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut out = std::ptr::null_mut();
    let rc = lookup(&mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut out);
    if rc != 0 || out.is_null() {
        return None;
    }
    // SAFETY: pw_name points into `buf`, NUL-terminated.
    let name = unsafe { CStr::from_ptr(pwd.pw_name) }.to_owned();
    Some((name, pwd.pw_uid, pwd.pw_gid))
}

/// The user's name and primary group.
fn user_name(uid: u32) -> Option<(CString, u32)> {
    // SAFETY: getpwuid_r writes into the entry and the buffer (of the length given).
    passwd_entry(|pwd, buf, len, out| unsafe { libc::getpwuid_r(uid, pwd, buf, len, out) })
        .map(|(name, _, gid)| (name, gid))
}

/// The supplementary groups of the process at the other end of Unix socket `fd`, as the kernel
/// holds them (SO_PEERGROUPS, Linux 4.13).
fn peer_groups(fd: std::os::fd::RawFd) -> io::Result<Vec<u32>> {
    let mut groups = vec![0u32; 64];
    loop {
        let mut len = (groups.len() * 4) as libc::socklen_t;
        // SAFETY: `groups` holds `len` bytes; the kernel writes at most that many and says how
        // many it needs when they are too few (ERANGE).
        let rc = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let err = io::Error::last_os_error();
        if rc == 0 {
            groups.truncate(len as usize / 4);
            return Ok(groups);
        }
        if err.raw_os_error() != Some(libc::ERANGE) || len as usize / 4 <= groups.len() {
            return Err(err);
        }
        groups.resize(len as usize / 4, 0);
    }
}

/// The groups of user `name` whose primary group is `gid`.
fn group_list(name: &CStr, gid: u32) -> Vec<u32> {
    let mut n: libc::c_int = 64;
    loop {
        let mut groups = vec![0u32; n as usize];
        let asked = n;
        // SAFETY: `groups` holds `n` gids; getgrouplist writes at most that many and says how
        // many it needs.
        let rc = unsafe { libc::getgrouplist(name.as_ptr(), gid, groups.as_mut_ptr(), &mut n) };
        if rc >= 0 {
            groups.truncate(n as usize);
            return groups;
        }
        if n <= asked {
            return vec![gid];
        }
    }
}

/// User `uid`'s name in the password database.
pub fn name_of_user(uid: u32) -> Option<String> {
    user_name(uid).map(|(n, _)| n.to_string_lossy().into_owned())
}

/// The uid of user `name` in the password database.
pub fn uid_of(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    // SAFETY: getpwnam_r reads the NUL-terminated name, writes into the entry and the buffer.
    passwd_entry(|pwd, buf, len, out| unsafe { libc::getpwnam_r(c.as_ptr(), pwd, buf, len, out) })
        .map(|(_, uid, _)| uid)
}

fn gid_of(name: &str) -> Option<u32> {
    let c = CString::new(name).ok()?;
    let mut buf = vec![0u8; 16384];
    // SAFETY: group is a plain C struct of integers and pointers: all zero is a valid value (getgrnam_r fills it).
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut out = std::ptr::null_mut();
    // SAFETY: getgrnam_r writes into `grp` and `buf` (of the length given).
    let rc = unsafe {
        libc::getgrnam_r(
            c.as_ptr(),
            &mut grp,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut out,
        )
    };
    (rc == 0 && !out.is_null()).then_some(grp.gr_gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_socket_peer_has_the_kernels_groups() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let id = Identity::of_socket(std::os::fd::AsRawFd::as_raw_fd(&a)).unwrap();
        // SAFETY: plain getters of this process's credentials.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let mut mine = vec![0 as libc::gid_t; 256];
        // SAFETY: `mine` holds 256 gids.
        let n = unsafe { libc::getgroups(256, mine.as_mut_ptr()) };
        mine.truncate(n.max(0) as usize);
        mine.push(gid);
        mine.sort_unstable();
        mine.dedup();
        assert_eq!(
            (id.uid, id.gid, id.pid),
            (uid, gid, Some(std::process::id() as i32))
        );
        assert_eq!(
            id.groups, mine,
            "the process's groups, not the group database's"
        );
    }

    #[test]
    fn grants_parse_and_match() {
        assert_eq!(Grant::parse("all"), Ok(Grant::All));
        assert_eq!(Grant::parse("user:0"), Ok(Grant::User(0)));
        assert_eq!(Grant::parse("user:root"), Ok(Grant::User(0)));
        assert_eq!(Grant::parse("group:root"), Ok(Grant::Group(0)));
        assert!(Grant::parse("user:no-such-user-here").is_err());
        assert!(Grant::parse("everyone").is_err());
        let id = Identity {
            uid: 1234,
            gid: 50,
            groups: vec![50, 60],
            pid: None,
        };
        assert!(Grant::Group(60).grants(&id));
        assert!(!Grant::Group(70).grants(&id));
        assert!(Grant::User(1234).grants(&id));
    }

    #[test]
    fn tcp_callers_get_only_tcp_datasets() {
        let open = Guard {
            allow: vec![],
            tcp: true,
        };
        let closed = Guard {
            allow: vec![Grant::All],
            tcp: false,
        };
        let none = Files::List(Arc::from(vec![]));
        assert!(check(&open, &Caller::Tcp, &none).is_ok());
        assert!(check(&closed, &Caller::Tcp, &none).is_err());
    }

    #[test]
    fn the_daemons_own_user_has_its_own_rights() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let me = Caller::Local(Arc::new(Identity::of_user(
            crate::access::euid(),
            // SAFETY: getegid has no preconditions and cannot fail.
            unsafe { libc::getegid() },
            None,
        )));
        let guard = Guard {
            allow: vec![],
            tcp: false,
        };
        assert!(check(&guard, &me, &Files::List(Arc::from(vec![file.clone()]))).is_ok());
        // Checked as a thread of this process would read it.
        let missing = dir.path().join("missing");
        let (p, e) = first_unreadable(&[file, missing.clone()]).unwrap();
        assert_eq!(p, missing);
        assert!(unreadable(&p, &e).contains("cannot read"));
    }

    #[test]
    fn an_object_stores_dataset_is_read_by_those_allow_grants_alone() {
        let url = Files::List(Arc::from(vec![PathBuf::from("s3://data/train")]));
        let someone = Caller::Local(Arc::new(Identity {
            uid: 54321,
            gid: 54321,
            groups: vec![54321],
            pid: None,
        }));
        let ungranted = Guard {
            allow: vec![],
            tcp: false,
        };
        let why = check(&ungranted, &someone, &url).unwrap_err();
        assert!(
            why.contains("object store") && why.contains("allow"),
            "{why}"
        );
        let granted = Guard {
            allow: vec![Grant::User(54321)],
            tcp: false,
        };
        assert!(check(&granted, &someone, &url).is_ok());
    }
}
