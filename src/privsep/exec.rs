//! Starting the daemon's own children from its own executable, after OpenSSH's re-executed
//! privsep children: a fresh address space (its own ASLR, no heap of the parent's), an empty
//! environment (the daemon's credentials stay in the daemon), and one descriptor beside stdio,
//! its socket, as descriptor [`CHILD_FD`]. The executable is the daemon's own, held open from
//! its start (`own_executable`): a child started after a package upgrade runs the code its
//! daemon runs. `larderd --larder-child ROLE` is such a child (`child` runs it).

use super::wire::kinds;
use anyhow::{ensure, Result};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// The argument that makes larderd one of its own children.
pub const CHILD_ARG: &str = "--larder-child";

/// The descriptor a child's socket is.
pub const CHILD_FD: RawFd = 3;

/// How long an access check or a kind's recognition may take (a user may stop the child that
/// runs as them, or a file system may hang): past it the daemon gives up on the child, and
/// the child ends itself (an alarm) if it can.
pub const CHILD_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

kinds! {
    /// What a child is.
    pub enum Role {
        Launcher = 1,
        Reader = 2,
        Check = 3,
        Recognize = 4,
    }
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Launcher => "launcher",
            Role::Reader => "reader",
            Role::Check => "check",
            Role::Recognize => "recognize",
        }
    }
}

/// A child's arguments (made before a fork: the child allocates nothing before its exec).
pub fn argv(role: Role) -> Vec<CString> {
    ["larderd", CHILD_ARG, role.name()]
        .iter()
        .map(|a| CString::new(*a).expect("no NUL"))
        .collect()
}

/// This process's executable, held open (O_PATH): what its children are started from, the
/// file it was started from even once a newer one has replaced it on disk.
pub fn own_executable() -> Result<OwnedFd> {
    let path = c"/proc/self/exe";
    // SAFETY: a NUL-terminated path; the descriptor returned is new and ours.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) };
    ensure!(
        fd >= 0,
        "opening the daemon's own executable: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a new descriptor, ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// In a child just forked: makes `sock` its descriptor CHILD_FD, closes every other (stdio
/// too, with `quiet`: then /dev/null, so a child taken over writes nothing into the daemon's
/// log), and executes `exe` with `argv` and no environment. Returns only why it could not.
pub fn exec(exe: &OwnedFd, sock: &OwnedFd, argv: &[CString], quiet: bool) -> anyhow::Error {
    if quiet {
        // SAFETY: open a NUL-terminated path; dup2 onto the standard descriptors.
        unsafe {
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
            if null >= 0 {
                for std_fd in 0..3 {
                    libc::dup2(null, std_fd);
                }
            }
        }
    }
    // The executable's descriptor out of the socket's way (a close-on-exec copy above it).
    let mut exe_fd = exe.as_raw_fd();
    if exe_fd == CHILD_FD {
        // SAFETY: fcntl on a descriptor this process holds.
        exe_fd = unsafe { libc::fcntl(exe_fd, libc::F_DUPFD_CLOEXEC, CHILD_FD + 1) };
        if exe_fd < 0 {
            return anyhow::anyhow!("moving a descriptor: {}", std::io::Error::last_os_error());
        }
    }
    // SAFETY: dup2 and fcntl on descriptors this process holds.
    let placed = unsafe {
        if sock.as_raw_fd() == CHILD_FD {
            libc::fcntl(CHILD_FD, libc::F_SETFD, 0)
        } else {
            // dup2's copy is not close-on-exec.
            libc::dup2(sock.as_raw_fd(), CHILD_FD)
        }
    };
    if placed < 0 {
        return anyhow::anyhow!("placing the socket: {}", std::io::Error::last_os_error());
    }
    // The executable's descriptor is close-on-exec: it goes with the exec.
    close_all_but(&[CHILD_FD, exe_fd]);
    let mut args: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    args.push(std::ptr::null());
    let env: [*const libc::c_char; 1] = [std::ptr::null()];
    // SAFETY: execveat with the executable's descriptor, an empty path (AT_EMPTY_PATH), and
    // NULL-terminated arrays of NUL-terminated strings that live until the call returns.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            exe_fd,
            c"".as_ptr(),
            args.as_ptr(),
            env.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    anyhow::anyhow!("execveat: {}", std::io::Error::last_os_error())
}

/// Closes every descriptor of this process but 0, 1, 2 and `keep`: a child holds nothing of
/// the launcher's or the daemon's.
pub fn close_all_but(keep: &[RawFd]) {
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
                for fd in from..=to.min(1 << 20) {
                    // SAFETY: closing a descriptor number this process may not even hold.
                    unsafe { libc::close(fd as RawFd) };
                }
            }
        }
        from = k.saturating_add(1);
    }
}
