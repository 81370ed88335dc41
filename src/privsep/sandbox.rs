//! The sandbox every process that parses a user's file puts itself in, after the launcher has
//! made it that user with no capability and NO_NEW_PRIVS:
//!
//! - **seccomp** (`restrict_syscalls`): an allow-list of the system calls reading files,
//!   decoding them and answering over an open socket take. No new socket, no exec, no fork,
//!   no namespace, no ptrace, no executable mapping, no signal to another process. Anything
//!   else fails with ENOSYS, as on a kernel without the call (libc falls back where it can).
//!   x86_64 only; on another architecture the process goes on without the filter, and says so.
//! - **Landlock** (`restrict_files`): once a reader has opened its dataset, it may open
//!   nothing but the dataset's files (read only), bind or connect no TCP port, and signal or
//!   reach no abstract socket outside itself. Seccomp cannot look at paths; Landlock can. The
//!   rules are as strict as the kernel's Landlock ABI allows (this machine's kernel, 6.18,
//!   has ABI 7); where Landlock is absent (before 5.13, or not enabled at boot) the reader
//!   goes on with its uid's rights and the seccomp filter alone, and says so once.

use anyhow::{ensure, Result};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// A BPF instruction (struct sock_filter).
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

/// A BPF program (struct sock_fprog).
#[repr(C)]
struct Program {
    len: u16,
    filter: *const Insn,
}

const LD_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const JEQ: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const RET: u16 = 0x06; // BPF_RET | BPF_K
const AND: u16 = 0x54; // BPF_ALU | BPF_AND | BPF_K

const RET_ALLOW: u32 = 0x7fff_0000;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;

/// Offsets in struct seccomp_data.
const NR: u32 = 0;
const ARCH: u32 = 4;
/// The low 32 bits of argument `i` (little-endian).
const fn arg(i: u32) -> u32 {
    16 + 8 * i
}

fn stmt(code: u16, k: u32) -> Insn {
    Insn {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> Insn {
    Insn { code, jt, jf, k }
}

/// A system call allowed only when `(argument & mask) == value`; otherwise EPERM.
struct Checked {
    nr: i64,
    arg: u32,
    mask: u32,
    value: u32,
}

/// The new namespaces clone may make (CLONE_NEW*), none of which a reader needs.
const CLONE_NAMESPACES: u32 = 0x0002_0000 // NEWNS
    | 0x0000_0080 // NEWTIME
    | 0x0200_0000 // NEWCGROUP
    | 0x0400_0000 // NEWUTS
    | 0x0800_0000 // NEWIPC
    | 0x1000_0000 // NEWUSER
    | 0x2000_0000 // NEWPID
    | 0x4000_0000; // NEWNET
const CLONE_THREAD: u32 = 0x0001_0000;
const PROT_EXEC: u32 = 0x4;

#[cfg(target_arch = "x86_64")]
mod calls {
    pub const AUDIT_ARCH: u32 = 0xc000_003e;

    /// What reading, decoding and answering take: files opened read-only by path (Landlock
    /// limits which), memory, threads, time, and messages on the sockets the process holds.
    pub const ALLOWED: &[i64] = &[
        libc::SYS_read,
        libc::SYS_readv,
        libc::SYS_pread64,
        libc::SYS_preadv,
        libc::SYS_preadv2,
        libc::SYS_write,
        libc::SYS_writev,
        libc::SYS_pwrite64,
        libc::SYS_lseek,
        libc::SYS_close,
        libc::SYS_close_range,
        libc::SYS_open,
        libc::SYS_openat,
        libc::SYS_openat2,
        libc::SYS_stat,
        libc::SYS_fstat,
        libc::SYS_lstat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_access,
        libc::SYS_faccessat,
        libc::SYS_faccessat2,
        libc::SYS_readlink,
        libc::SYS_readlinkat,
        libc::SYS_getdents64,
        libc::SYS_getcwd,
        libc::SYS_fcntl,
        libc::SYS_flock,
        libc::SYS_fadvise64,
        libc::SYS_dup,
        libc::SYS_ftruncate,
        libc::SYS_memfd_create,
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_madvise,
        libc::SYS_brk,
        libc::SYS_sendmsg,
        libc::SYS_recvmsg,
        libc::SYS_sendto,
        libc::SYS_recvfrom,
        libc::SYS_poll,
        libc::SYS_ppoll,
        libc::SYS_futex,
        libc::SYS_set_robust_list,
        libc::SYS_rseq,
        libc::SYS_set_tid_address,
        libc::SYS_sched_yield,
        libc::SYS_sched_getaffinity,
        libc::SYS_nanosleep,
        libc::SYS_clock_nanosleep,
        libc::SYS_clock_gettime,
        libc::SYS_clock_getres,
        libc::SYS_gettimeofday,
        libc::SYS_getrandom,
        libc::SYS_rt_sigaction,
        libc::SYS_rt_sigprocmask,
        libc::SYS_rt_sigreturn,
        libc::SYS_sigaltstack,
        libc::SYS_restart_syscall,
        libc::SYS_getpid,
        libc::SYS_gettid,
        libc::SYS_getppid,
        libc::SYS_getuid,
        libc::SYS_geteuid,
        libc::SYS_getgid,
        libc::SYS_getegid,
        libc::SYS_getresuid,
        libc::SYS_getresgid,
        libc::SYS_getgroups,
        libc::SYS_uname,
        libc::SYS_sysinfo,
        libc::SYS_getrlimit,
        libc::SYS_prlimit64,
        libc::SYS_exit,
        libc::SYS_exit_group,
        // Landlock only takes rights away: the reader installs this filter first and holds
        // itself to its dataset's files after its walk.
        libc::SYS_landlock_create_ruleset,
        libc::SYS_landlock_add_rule,
        libc::SYS_landlock_restrict_self,
    ];
}

/// Installs the seccomp allow-list on this process. Call while it has one thread (the filter
/// is each thread's, inherited by threads started after). Returns false where there is no
/// filter for this architecture.
pub fn restrict_syscalls() -> Result<bool> {
    #[cfg(not(target_arch = "x86_64"))]
    {
        eprintln!("larder: no seccomp filter on this architecture; readers run without one");
        Ok(false)
    }
    #[cfg(target_arch = "x86_64")]
    {
        let program = filter(std::process::id());
        let fprog = Program {
            len: program.len() as u16,
            filter: program.as_ptr(),
        };
        // SAFETY: the kernel copies the program; `program` outlives the call.
        let rc = unsafe {
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER as libc::c_ulong,
                &fprog as *const Program,
                0,
                0,
            )
        };
        ensure!(rc == 0, "seccomp: {}", std::io::Error::last_os_error());
        Ok(true)
    }
}

/// The filter's program, for process `pid` (the one process signals may go to).
#[cfg(target_arch = "x86_64")]
fn filter(pid: u32) -> Vec<Insn> {
    let checked = [
        // Threads only: no fork, no new namespace.
        Checked {
            nr: libc::SYS_clone,
            arg: 0,
            mask: CLONE_NAMESPACES | CLONE_THREAD,
            value: CLONE_THREAD,
        },
        // Memory, never executable.
        Checked {
            nr: libc::SYS_mmap,
            arg: 2,
            mask: PROT_EXEC,
            value: 0,
        },
        Checked {
            nr: libc::SYS_mprotect,
            arg: 2,
            mask: PROT_EXEC,
            value: 0,
        },
        // Signals to a thread of this process (abort raises one), to no other.
        Checked {
            nr: libc::SYS_tgkill,
            arg: 0,
            mask: u32::MAX,
            value: pid,
        },
        // Naming a thread.
        Checked {
            nr: libc::SYS_prctl,
            arg: 0,
            mask: u32::MAX,
            value: libc::PR_SET_NAME as u32,
        },
    ];
    let mut p = vec![
        stmt(LD_ABS, ARCH),
        jump(JEQ, calls::AUDIT_ARCH, 1, 0),
        stmt(RET, RET_KILL_PROCESS),
        stmt(LD_ABS, NR),
    ];
    // clone3 passes its flags in memory a filter cannot read: "no such call" makes libc
    // fall back to clone, whose flags it can.
    p.push(jump(JEQ, libc::SYS_clone3 as u32, 0, 1));
    p.push(stmt(RET, RET_ERRNO | libc::ENOSYS as u32));
    for c in &checked {
        // Not this call: skip the block (5 instructions), A still holds the number.
        p.push(jump(JEQ, c.nr as u32, 0, 5));
        p.push(stmt(LD_ABS, arg(c.arg)));
        p.push(stmt(AND, c.mask));
        p.push(jump(JEQ, c.value, 0, 1));
        p.push(stmt(RET, RET_ALLOW));
        p.push(stmt(RET, RET_ERRNO | libc::EPERM as u32));
    }
    for &nr in calls::ALLOWED {
        p.push(jump(JEQ, nr as u32, 0, 1));
        p.push(stmt(RET, RET_ALLOW));
    }
    // Everything else, the x32 ABI's calls included (their numbers carry bit 30, and match
    // nothing above).
    p.push(stmt(RET, RET_ERRNO | libc::ENOSYS as u32));
    p
}

/// Landlock's file system rights (include/uapi/linux/landlock.h), by the ABI that added them.
const FS_READ_FILE: u64 = 1 << 2;
const FS_READ_DIR: u64 = 1 << 3;
/// Every right of ABI 1: execute, write, read, read a folder, remove and make each kind.
const FS_ABI1: u64 = (1 << 13) - 1;
const FS_REFER: u64 = 1 << 13; // ABI 2
const FS_TRUNCATE: u64 = 1 << 14; // ABI 3
const FS_IOCTL_DEV: u64 = 1 << 15; // ABI 5
const NET_TCP: u64 = 0b11; // bind and connect, ABI 4
const SCOPED: u64 = 0b11; // abstract unix sockets and signals, ABI 6

const SYS_LANDLOCK_CREATE_RULESET: libc::c_long = 444;
const SYS_LANDLOCK_ADD_RULE: libc::c_long = 445;
const SYS_LANDLOCK_RESTRICT_SELF: libc::c_long = 446;
const CREATE_RULESET_VERSION: u32 = 1;
const RULE_PATH_BENEATH: u32 = 1;

#[repr(C)]
struct RulesetAttr {
    handled_access_fs: u64,
    handled_access_net: u64,
    scoped: u64,
}

#[repr(C, packed)]
struct PathBeneath {
    allowed_access: u64,
    parent_fd: i32,
}

/// The kernel's Landlock ABI version; None where it has no Landlock.
pub fn landlock_abi() -> Option<u32> {
    // SAFETY: the version query takes no attribute.
    let v = unsafe {
        libc::syscall(
            SYS_LANDLOCK_CREATE_RULESET,
            std::ptr::null::<RulesetAttr>(),
            0usize,
            CREATE_RULESET_VERSION,
        )
    };
    (v > 0).then_some(v as u32)
}

/// How far `restrict_files` went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Landlocked {
    /// Restricted at this ABI.
    Abi(u32),
    /// The kernel has no Landlock: nothing done.
    Unsupported,
}

/// Lets this thread (and the threads it starts after) open nothing but `paths` for reading:
/// a folder with what is beneath it, a file alone. Writing, executing, making or removing
/// anything, TCP and (where the ABI has them) signals and abstract sockets beyond this
/// process are refused. Call before starting other threads: Landlock binds each thread.
pub fn restrict_files(paths: &[PathBuf]) -> Result<Landlocked> {
    let Some(abi) = landlock_abi() else {
        return Ok(Landlocked::Unsupported);
    };
    let mut fs = FS_ABI1;
    if abi >= 2 {
        fs |= FS_REFER;
    }
    if abi >= 3 {
        fs |= FS_TRUNCATE;
    }
    if abi >= 5 {
        fs |= FS_IOCTL_DEV;
    }
    let attr = RulesetAttr {
        handled_access_fs: fs,
        handled_access_net: if abi >= 4 { NET_TCP } else { 0 },
        scoped: if abi >= 6 { SCOPED } else { 0 },
    };
    // The attribute's size tells the kernel which of its fields this ABI knows.
    let size = match abi {
        1..=3 => 8,
        4..=5 => 16,
        _ => std::mem::size_of::<RulesetAttr>(),
    };
    // SAFETY: `attr` is valid for `size` bytes.
    let fd = unsafe { libc::syscall(SYS_LANDLOCK_CREATE_RULESET, &attr, size, 0u32) };
    ensure!(
        fd >= 0,
        "landlock_create_ruleset: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a new descriptor, ours.
    let ruleset = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    for path in paths {
        allow_beneath(&ruleset, path)?;
    }
    // SAFETY: a ruleset descriptor; the process has NO_NEW_PRIVS.
    let rc = unsafe { libc::syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset.as_raw_fd(), 0u32) };
    ensure!(
        rc == 0,
        "landlock_restrict_self: {}",
        std::io::Error::last_os_error()
    );
    Ok(Landlocked::Abi(abi))
}

/// Adds a rule letting the process read `path` (beneath it, for a folder). A path it cannot
/// reach (not there, behind a folder its uid may not search, a magic link) gets no rule:
/// reading it fails anyway, as a bad sample.
fn allow_beneath(ruleset: &OwnedFd, path: &Path) -> Result<()> {
    let Ok(fd) = crate::access::open_no_magiclinks(path, libc::O_PATH) else {
        return Ok(());
    };
    // SAFETY: stat is a plain C struct: all zero is a valid value (fstat fills it).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    ensure!(
        // SAFETY: fstat fills `st`, ours, from a descriptor of ours.
        unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0,
        "{}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
    let rule = PathBeneath {
        allowed_access: if is_dir {
            FS_READ_FILE | FS_READ_DIR
        } else {
            FS_READ_FILE
        },
        parent_fd: fd.as_raw_fd(),
    };
    // SAFETY: `rule` is a valid path-beneath attribute.
    let rc = unsafe {
        libc::syscall(
            SYS_LANDLOCK_ADD_RULE,
            ruleset.as_raw_fd(),
            RULE_PATH_BENEATH,
            &rule as *const PathBeneath,
            0u32,
        )
    };
    ensure!(
        rc == 0,
        "landlock_add_rule {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    Ok(())
}

/// The paths a reader of a source with these `files` (and `root`) is held to: each file
/// itself when there are few, else each folder a file is in (with what a link among the
/// files points to), and the root. `links`: which of the files are links, when the walk noted
/// them (None: each file is looked at).
pub fn rules_for(
    root: &Path,
    files: &[PathBuf],
    links: Option<&[PathBuf]>,
    alive: &mut dyn FnMut(),
) -> Vec<PathBuf> {
    const EACH_FILE_UP_TO: usize = 64;
    // Objects are not files: a reader of them reads through its channel and may open none.
    if crate::objects::is_url(root) {
        return vec![];
    }
    let mut out: Vec<PathBuf> = vec![root.to_path_buf()];
    if files.len() <= EACH_FILE_UP_TO {
        out.extend(files.iter().cloned());
    } else {
        let mut folders = std::collections::BTreeSet::new();
        let target_of = |f: &Path| {
            std::fs::canonicalize(f).ok().and_then(|t| {
                let dir = if t.is_dir() { Some(t.clone()) } else { None };
                dir.or_else(|| t.parent().map(Path::to_path_buf))
            })
        };
        let mut last: Option<&Path> = None;
        for (i, f) in files.iter().enumerate() {
            // A folder of a million files takes a few seconds: the caller says it is alive.
            if i % 4096 == 0 {
                alive();
            }
            // A folder's files come together in a sorted walk: each folder inserted once.
            if let Some(parent) = f.parent().filter(|p| last != Some(*p)) {
                folders.insert(parent.to_path_buf());
                last = Some(parent);
            }
            if links.is_none()
                && std::fs::symlink_metadata(f).is_ok_and(|m| m.file_type().is_symlink())
            {
                folders.extend(target_of(f));
            }
        }
        for (i, link) in links.unwrap_or_default().iter().enumerate() {
            if i % 4096 == 0 {
                alive();
            }
            folders.extend(target_of(link));
        }
        out.extend(folders);
    }
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` in a forked child (a filter or a Landlock domain binds a process for good);
    /// true when it exited 0.
    fn in_child(f: impl FnOnce() -> bool) -> bool {
        // SAFETY: the child runs `f` and exits; test threads beside it are not touched.
        match unsafe { libc::fork() } {
            0 => {
                let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(false);
                // SAFETY: ends the child without the test harness's handlers.
                unsafe { libc::_exit(if ok { 0 } else { 1 }) }
            }
            pid => {
                let mut status = 0;
                // SAFETY: waits for our child.
                unsafe { libc::waitpid(pid, &mut status, 0) };
                libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
            }
        }
    }

    fn no_new_privs() {
        // SAFETY: prctl with integer arguments.
        assert_eq!(
            // SAFETY: prctl with integer arguments.
            unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) },
            0
        );
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_filter_lets_a_reader_read_and_think_and_refuses_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a");
        std::fs::write(&file, b"hello").unwrap();
        assert!(in_child(|| {
            no_new_privs();
            assert!(restrict_syscalls().unwrap());
            assert_eq!(crate::privsep::caps::status_line("Seccomp").unwrap(), "2");
            // Reading, threads, memfds and messages on a socket held already.
            assert_eq!(std::fs::read(&file).unwrap(), b"hello");
            let t = std::thread::spawn(|| std::fs::read_dir("/").map(|d| d.count()).unwrap());
            assert!(t.join().unwrap() > 0);
            assert!(crate::privsep::wire::sealed_memfd("t", b"x").is_ok());
            let v: Vec<u64> = (0..1_000_000).collect();
            assert_eq!(v.iter().sum::<u64>(), 499_999_500_000);
            // No new socket, no exec, no fork, no executable memory, no signal to another.
            // SAFETY: each call either fails (as asserted) or is harmless.
            unsafe {
                assert_eq!(libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0), -1);
                assert!(std::process::Command::new("/bin/true").status().is_err());
                assert_eq!(libc::fork(), -1);
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_EXEC,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert_eq!(p, libc::MAP_FAILED);
                assert_eq!(libc::kill(1, 0), -1);
                assert_eq!(libc::unshare(libc::CLONE_NEWUSER), -1);
            }
            true
        }));
    }

    #[test]
    fn landlock_holds_a_process_to_its_dataset() {
        if landlock_abi().is_none() {
            eprintln!("no Landlock in this kernel: nothing to check");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("in"), b"in").unwrap();
        std::fs::write(dir.path().join("out"), b"out").unwrap();
        // A link in the dataset to a file beside it: its folder is among the rules.
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::write(elsewhere.join("linked"), b"linked").unwrap();
        std::os::unix::fs::symlink(elsewhere.join("linked"), data.join("link")).unwrap();
        let files: Vec<PathBuf> = (0..100)
            .map(|_| data.join("in"))
            .chain([data.join("link")])
            .collect();
        let rules = rules_for(&data, &files, None, &mut || {});
        assert!(rules.contains(&elsewhere), "{rules:?}");
        // In the order a reader takes: its seccomp filter first, then Landlock after its walk.
        assert!(in_child(|| {
            no_new_privs();
            restrict_syscalls().unwrap();
            assert!(matches!(
                restrict_files(&rules).unwrap(),
                Landlocked::Abi(_)
            ));
            assert_eq!(std::fs::read(data.join("in")).unwrap(), b"in");
            assert_eq!(std::fs::read(data.join("link")).unwrap(), b"linked");
            assert!(std::fs::read(dir.path().join("out")).is_err());
            assert!(std::fs::read("/etc/passwd").is_err());
            assert!(std::fs::write(data.join("new"), b"x").is_err());
            true
        }));
    }
}
