//! Acting as another user on one thread: the file-system identity (fsuid, fsgid and the
//! supplementary groups) switched with raw system calls, which change only the calling thread
//! (glibc's `setgroups` changes every thread of the process), and switched back however the
//! work ends. What Samba and the NFS servers do for each client's opens.
//!
//! The switch lives exactly as long as one synchronous call: no `.await`, no other work on
//! the thread meanwhile. Switching back is done by a guard, also when the work panics; a
//! thread that cannot be switched back (which the kernel has no reason to refuse: the daemon
//! keeps its capabilities) would go on reading with a user's rights, so the process aborts
//! instead. Never to uid 0: root's and the daemon's own requests use the daemon's rights.

use super::Identity;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Runs `f` with this thread's file-system identity switched to `id` (groups, fsgid, fsuid),
/// then switches back. Err when the switch does not take (no CAP_SETUID/CAP_SETGID) or `id` is
/// root; `f` has not run then.
pub fn as_user<T>(id: &Identity, f: impl FnOnce() -> T) -> io::Result<T> {
    if id.uid == 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "never switching to root",
        ));
    }
    let old_groups = thread_groups()?;
    // SAFETY: setfsuid/setfsgid(-1) change nothing and return the current ids.
    let (old_uid, old_gid) = unsafe { (libc::setfsuid(u32::MAX), libc::setfsgid(u32::MAX)) };
    // From here on the thread may be partly switched: the guard switches it back.
    let _back = Restore {
        uid: old_uid as u32,
        gid: old_gid as u32,
        groups: old_groups,
    };
    set_groups(&id.groups)?;
    // SAFETY: plain syscalls on this thread's credentials.
    unsafe {
        libc::setfsgid(id.gid);
        libc::setfsuid(id.uid);
    }
    // setfsuid says nothing when it fails: read the ids back.
    // SAFETY: setfsuid and setfsgid of -1 change nothing and return the thread's ids.
    let now = unsafe { (libc::setfsuid(u32::MAX), libc::setfsgid(u32::MAX)) };
    if now != (id.uid as i32, id.gid as i32) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the file-system identity did not switch",
        ));
    }
    Ok(f())
}

/// Switches a thread back to the daemon's identity when dropped, or ends the process.
struct Restore {
    uid: u32,
    gid: u32,
    groups: Vec<u32>,
}

impl Drop for Restore {
    fn drop(&mut self) {
        // SAFETY: plain syscalls on this thread's credentials (fsuid first: back to the
        // daemon's uid brings back the capabilities that setting the groups may need).
        unsafe {
            libc::setfsuid(self.uid);
            libc::setfsgid(self.gid);
        }
        let groups = set_groups(&self.groups);
        // SAFETY: setfsuid and setfsgid of -1 change nothing and return the thread's ids.
        let ids = unsafe { (libc::setfsuid(u32::MAX), libc::setfsgid(u32::MAX)) };
        if groups.is_err() || ids != (self.uid as i32, self.gid as i32) {
            eprintln!("larderd: a thread could not switch back to the daemon's identity; stopping");
            std::process::abort();
        }
    }
}

/// This thread's supplementary groups.
fn thread_groups() -> io::Result<Vec<u32>> {
    // SAFETY: a size query, then a buffer of that size.
    let n = unsafe { libc::getgroups(0, std::ptr::null_mut()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut groups = vec![0u32; n as usize];
    // SAFETY: a buffer of `n` gids.
    let n = unsafe { libc::getgroups(n, groups.as_mut_ptr()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    groups.truncate(n as usize);
    Ok(groups)
}

/// Sets this thread's supplementary groups only (the raw system call: glibc's wrapper sets
/// every thread's).
fn set_groups(groups: &[u32]) -> io::Result<()> {
    // SAFETY: a pointer to `groups.len()` gids.
    let rc = unsafe { libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Opens `path` for reading (with `flags` added) as this thread's identity may, refusing
/// "magic links" on the way (`/proc/self/fd/N`, `/proc/PID/root`...): through one, a user
/// would reach a file the daemon holds open that they could not reach by its path (one inside
/// another user's 0700 home). Ordinary symlinks are followed, each component checked with the
/// thread's identity as any open would.
pub fn open_no_magiclinks(path: &Path, flags: libc::c_int) -> io::Result<std::fs::File> {
    use std::os::fd::FromRawFd;
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: open_how is plain integers; all zero is a valid value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_CLOEXEC | flags) as u64;
    how.resolve = libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: a NUL-terminated path and an open_how of the size given.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        // A seccomp filter that cannot read openat2's flags answers ENOSYS (systemd's
        // RestrictSUIDSGID=, which the unit sets): resolved a component at a time instead.
        if e.raw_os_error() == Some(libc::ENOSYS) {
            return open_walking(path, flags);
        }
        return Err(e);
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd as libc::c_int) })
}

/// The most symbolic links one open follows (the kernel's own limit).
const MOST_LINKS: u32 = 40;

/// `open_no_magiclinks` without openat2: `path` resolved a component at a time (each opened
/// `O_PATH | O_NOFOLLOW` from the folder before it, with the thread's identity), each symbolic
/// link followed by its target's text, except one on procfs (the file system of every magic
/// link): that is refused with ELOOP as openat2 refuses it, but for procfs's plain links
/// (`self`, `thread-self`, `mounts`, `net`). The last component is opened with `O_NOFOLLOW`:
/// swapped for a link after it was looked at, it is refused, not followed.
fn open_walking(path: &Path, flags: libc::c_int) -> io::Result<std::fs::File> {
    use std::collections::VecDeque;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let open_at = |dir: libc::c_int, name: &[u8], flags: libc::c_int| -> io::Result<OwnedFd> {
        let c = CString::new(name)?;
        // SAFETY: a NUL-terminated name and a descriptor of ours (or AT_FDCWD).
        let fd = unsafe { libc::openat(dir, c.as_ptr(), flags | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just opened, owned by nothing else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    let stat_of = |fd: &OwnedFd| -> io::Result<libc::stat> {
        // SAFETY: a descriptor of ours and a stat struct to fill.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat fills `st`, ours, from a descriptor of ours.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(st)
    };
    // procfs's device, where /proc is mounted (no magic link exists where it is not).
    let proc_dev = std::fs::metadata("/proc").ok().map(|m| {
        use std::os::unix::fs::MetadataExt;
        m.dev()
    });
    let path_flags = libc::O_PATH | libc::O_NOFOLLOW;
    let components = |p: &[u8]| -> Vec<Vec<u8>> {
        let mut out = vec![];
        if p.starts_with(b"/") {
            out.push(b"/".to_vec());
        }
        out.extend(
            p.split(|&b| b == b'/')
                .filter(|c| !c.is_empty() && *c != b".")
                .map(<[u8]>::to_vec),
        );
        out
    };
    let mut pending: VecDeque<Vec<u8>> = components(path.as_os_str().as_bytes()).into();
    let mut dir = open_at(libc::AT_FDCWD, b".", libc::O_PATH | libc::O_DIRECTORY)?;
    let mut links = 0;
    while let Some(name) = pending.pop_front() {
        if name == b"/" {
            dir = open_at(libc::AT_FDCWD, b"/", libc::O_PATH | libc::O_DIRECTORY)?;
            continue;
        }
        let fd = open_at(dir.as_raw_fd(), &name, path_flags)?;
        let st = stat_of(&fd)?;
        if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
            links += 1;
            let plain = [&b"self"[..], b"thread-self", b"mounts", b"net"].contains(&&name[..]);
            if links > MOST_LINKS || (Some(st.st_dev) == proc_dev && !plain) {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            let mut target = vec![0u8; libc::PATH_MAX as usize];
            // SAFETY: an O_PATH descriptor of the link itself (empty name: the link), and a
            // buffer of the length given.
            let n = unsafe {
                libc::readlinkat(
                    fd.as_raw_fd(),
                    c"".as_ptr(),
                    target.as_mut_ptr().cast(),
                    target.len(),
                )
            };
            if n < 0 {
                return Err(io::Error::last_os_error());
            }
            target.truncate(n as usize);
            for c in components(&target).into_iter().rev() {
                pending.push_front(c);
            }
            continue;
        }
        if pending.is_empty() {
            if flags & libc::O_PATH != 0 {
                return Ok(std::fs::File::from(fd));
            }
            let file = open_at(
                dir.as_raw_fd(),
                &name,
                libc::O_RDONLY | libc::O_NOFOLLOW | flags,
            )?;
            return Ok(std::fs::File::from(file));
        }
        dir = fd;
    }
    // The path named a folder by "/" or ".": that folder.
    let last = if flags & libc::O_PATH != 0 {
        dir
    } else {
        open_at(dir.as_raw_fd(), b".", libc::O_RDONLY | flags)?
    };
    Ok(std::fs::File::from(last))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The walk that stands in for openat2 where a filter refuses it: what openat2 opens, it
    /// opens (the same file); what openat2 refuses, it refuses.
    #[test]
    fn the_walk_without_openat2_opens_and_refuses_as_openat2_does() {
        use std::os::unix::fs::{symlink, MetadataExt};
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("a/b")).unwrap();
        std::fs::write(d.join("a/b/f"), b"f").unwrap();
        symlink("b/f", d.join("a/rel")).unwrap();
        symlink(d.join("a/b"), d.join("abs")).unwrap();
        symlink("../rel", d.join("a/b/up")).unwrap();
        symlink("loop2", d.join("loop1")).unwrap();
        symlink("loop1", d.join("loop2")).unwrap();
        let held = std::fs::File::open(d.join("a/b/f")).unwrap();
        use std::os::fd::AsRawFd;
        symlink(
            format!("/proc/self/fd/{}", held.as_raw_fd()),
            d.join("magic"),
        )
        .unwrap();
        symlink("/proc/self/cwd", d.join("cwd")).unwrap();
        let inode = std::fs::metadata(d.join("a/b/f")).unwrap().ino();
        for p in [
            d.join("a/b/f"),
            d.join("a/rel"),
            d.join("abs/f"),
            d.join("a/b/up"),
            d.join("a/./b/../b/f"),
        ] {
            let walked = open_walking(&p, 0).unwrap();
            assert_eq!(walked.metadata().unwrap().ino(), inode, "{}", p.display());
            assert_eq!(
                open_no_magiclinks(&p, 0).unwrap().metadata().unwrap().ino(),
                inode
            );
        }
        // procfs's plain links are followed; its magic ones, and loops, refused.
        assert!(open_walking(Path::new("/proc/self/status"), 0).is_ok());
        for p in [d.join("magic"), d.join("cwd/x"), d.join("loop1")] {
            let e = open_walking(&p, 0).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{}: {e}", p.display());
        }
        assert_eq!(
            open_walking(&d.join("a/nope"), 0).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        // A folder, and O_PATH.
        assert!(open_walking(&d.join("abs"), libc::O_DIRECTORY).is_ok());
        assert!(open_walking(&d.join("a/rel"), libc::O_PATH).is_ok());
    }

    #[test]
    fn magic_links_are_refused_and_plain_files_open() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(open_no_magiclinks(&file, 0).is_ok());
        let held = std::fs::File::open(&file).unwrap();
        use std::os::fd::AsRawFd;
        let magic = dir.path().join("magic");
        std::os::unix::fs::symlink(format!("/proc/self/fd/{}", held.as_raw_fd()), &magic).unwrap();
        assert!(std::fs::read(&magic).is_ok(), "a plain open follows it");
        let e = open_no_magiclinks(&magic, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        let plain = dir.path().join("plain");
        std::os::unix::fs::symlink(&file, &plain).unwrap();
        assert!(
            open_no_magiclinks(&plain, 0).is_ok(),
            "ordinary symlinks are followed"
        );
    }

    #[test]
    fn never_to_root_and_back_after_a_panic() {
        let root = Identity {
            uid: 0,
            gid: 0,
            groups: vec![0],
            pid: None,
        };
        assert!(as_user(&root, || ()).is_err());
        // As root (CI), a panic while switched leaves the thread as it was.
        if crate::access::euid() != 0 {
            return;
        }
        let nobody = Identity {
            uid: 65534,
            gid: 65534,
            groups: vec![65534],
            pid: None,
        };
        // SAFETY: setfsuid of -1 changes nothing and returns the thread's fsuid.
        let before = (thread_groups().unwrap(), unsafe {
            libc::setfsuid(u32::MAX)
        });
        let caught = std::panic::catch_unwind(|| {
            as_user(&nobody, || {
                // SAFETY: setfsuid of -1 changes nothing and returns the thread's fsuid.
                assert_eq!(unsafe { libc::setfsuid(u32::MAX) }, 65534);
                panic!("while switched")
            })
        });
        assert!(caught.is_err());
        // SAFETY: setfsuid of -1 changes nothing and returns the thread's fsuid.
        let after = (thread_groups().unwrap(), unsafe {
            libc::setfsuid(u32::MAX)
        });
        assert_eq!(before, after);
    }
}
