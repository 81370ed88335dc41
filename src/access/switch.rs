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
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened, owned by nothing else.
    Ok(unsafe { std::fs::File::from_raw_fd(fd as libc::c_int) })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let before = (thread_groups().unwrap(), unsafe {
            libc::setfsuid(u32::MAX)
        });
        let caught = std::panic::catch_unwind(|| {
            as_user(&nobody, || {
                assert_eq!(unsafe { libc::setfsuid(u32::MAX) }, 65534);
                panic!("while switched")
            })
        });
        assert!(caught.is_err());
        let after = (thread_groups().unwrap(), unsafe {
            libc::setfsuid(u32::MAX)
        });
        assert_eq!(before, after);
    }
}
