//! The processes larderd starts from its own executable (see `exec`): `larderd --larder-child
//! ROLE`. `run_if_child`, first thing in `main`, runs such a child and never returns. Its roles:
//! the launcher, a reader, and two that answer one request and end: an access check and a
//! recognition.

use super::exec::{Role, CHILD_ARG, CHILD_FD, CHILD_WITHIN};
use super::wire;
use anyhow::{bail, Context, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

/// Runs this process as the child its arguments name, if they name one: never returns then.
/// Call first thing in `main`, before anything reads the environment or starts a thread.
pub fn run_if_child() {
    let mut args = std::env::args_os().skip(1);
    if args.next().as_deref() != Some(std::ffi::OsStr::new(CHILD_ARG)) {
        return;
    }
    let role = args.next().unwrap_or_default();
    let role = [Role::Launcher, Role::Reader, Role::Check, Role::Recognize]
        .into_iter()
        .find(|r| role == r.name());
    // SAFETY: the launcher started this child with its socket at CHILD_FD, owned by nothing
    // else here.
    let sock = unsafe { OwnedFd::from_raw_fd(CHILD_FD) };
    match role {
        Some(Role::Launcher) => super::launcher::serve(sock),
        Some(Role::Reader) => super::reader::serve(sock),
        Some(Role::Check) => short_lived(sock, check),
        Some(Role::Recognize) => short_lived(sock, recognize),
        None => {
            eprintln!("larderd: {CHILD_ARG} takes launcher, reader, check or recognize");
            std::process::exit(2)
        }
    }
}

/// A child that answers one request with `f` and ends: within `CHILD_WITHIN` (an alarm ends
/// it past that, should it hang), under the seccomp filter from its first request on.
fn short_lived(sock: OwnedFd, f: fn(&wire::Message) -> Result<String>) -> ! {
    let fd = sock.as_raw_fd();
    // SAFETY: alarm with an integer argument.
    unsafe { libc::alarm(CHILD_WITHIN.as_secs() as u32 + 1) };
    let answer = super::sandbox::restrict_syscalls()
        .and_then(|_| wire::recv(fd)?.context("no request"))
        .and_then(|m| f(&m));
    let _ = match answer {
        Ok(found) => wire::send(fd, 1, 1, found.as_bytes(), &[]),
        Err(e) => wire::send(fd, wire::FAILED, 1, format!("{e:#}").as_bytes(), &[]),
    };
    // SAFETY: ends the child.
    unsafe { libc::_exit(0) }
}

/// An access check: whether this process (the user) may read every file of the list in the
/// request's memfd: "" if so, else fails with the first it may not, and why.
fn check(m: &wire::Message) -> Result<String> {
    let list = m.fd().context("no file list")?;
    let list =
        wire::read_sealed(list, 1 << 34).context("the check could not read its file list")?;
    // Checked as the list is read, one path held at a time: a list of any size costs this
    // process (another user's) its own bytes only.
    match wire::each_path(&list, usize::MAX, &mut crate::access::unreadable_text)? {
        None => Ok(String::new()),
        Some(why) => bail!("{why}"),
    }
}

/// The kind of source the request's path is, looked at as this process (the user), held to
/// that path alone (a link in it is followed once, here).
fn recognize(m: &wire::Message) -> Result<String> {
    use std::os::unix::ffi::OsStrExt;
    let mut r = wire::Reader::new(&m.payload);
    let path = PathBuf::from(std::ffi::OsStr::from_bytes(r.bytes()?));
    r.end()?;
    super::sandbox::restrict_files(std::slice::from_ref(&path))?;
    Ok(crate::source::recognize(&path)?.name().to_string())
}
