//! The process's capabilities: whether it may switch users, and dropping every one.

use anyhow::{ensure, Result};

#[repr(C)]
struct Header {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const VERSION_3: u32 = 0x2008_0522;
const CAP_SETGID: u32 = 6;
const CAP_SETUID: u32 = 7;

fn get() -> Result<[Data; 2]> {
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget fills two Data structs for version 3.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut h, d.as_mut_ptr()) };
    ensure!(rc == 0, "capget: {}", std::io::Error::last_os_error());
    Ok(d)
}

/// Whether this process may switch to other users (CAP_SETUID and CAP_SETGID permitted).
pub fn can_switch_users() -> bool {
    get().is_ok_and(|d| {
        let want = (1 << CAP_SETUID) | (1 << CAP_SETGID);
        d[0].permitted & want == want
    })
}

/// Drops every capability of this process (effective, permitted, inheritable and ambient) for
/// good, and lets no exec gain any (NO_NEW_PRIVS).
pub fn drop_all() -> Result<()> {
    // SAFETY: prctl calls with integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        );
        // Root keeps no capability across a later change of uid either.
        libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0);
    }
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let d = [Data::default(); 2];
    // SAFETY: capset reads two Data structs for version 3.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) };
    ensure!(rc == 0, "capset: {}", std::io::Error::last_os_error());
    // SAFETY: prctl with integer arguments.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    ensure!(rc == 0, "no_new_privs: {}", std::io::Error::last_os_error());
    let now = get()?;
    ensure!(
        now.iter()
            .all(|d| d.effective | d.permitted | d.inheritable == 0),
        "capabilities left after dropping them"
    );
    Ok(())
}

/// A line of /proc/self/status ("CapEff", "NoNewPrivs", "Seccomp"), for checks and logs.
pub fn status_line(key: &str) -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}

/// Keeps CAP_SETUID and CAP_SETGID alone (effective and permitted), none inheritable or
/// ambient: what the launcher needs of whatever the process was started with (root has all).
pub fn keep_only_user_switching() -> Result<()> {
    // SAFETY: prctl with integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let keep = (1 << CAP_SETUID) | (1 << CAP_SETGID);
    let d = [
        Data {
            effective: keep,
            permitted: keep,
            inheritable: 0,
        },
        Data::default(),
    ];
    // SAFETY: capset reads two Data structs for version 3.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) };
    ensure!(rc == 0, "capset: {}", std::io::Error::last_os_error());
    Ok(())
}

/// Keeps CAP_SETUID and CAP_SETGID (effective, permitted, inheritable) and raises them in the
/// ambient set, so that they survive an exec of an executable without file capabilities (the
/// launcher's, re-executed, for a daemon that is not root).
pub fn raise_user_switching_ambient() -> Result<()> {
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let keep = (1 << CAP_SETUID) | (1 << CAP_SETGID);
    let d = [
        Data {
            effective: keep,
            permitted: keep,
            inheritable: keep,
        },
        Data::default(),
    ];
    // SAFETY: capset reads two Data structs for version 3.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut h, d.as_ptr()) };
    ensure!(rc == 0, "capset: {}", std::io::Error::last_os_error());
    for cap in [CAP_SETUID, CAP_SETGID] {
        // SAFETY: prctl with integer arguments.
        let rc = unsafe {
            libc::prctl(
                libc::PR_CAP_AMBIENT,
                libc::PR_CAP_AMBIENT_RAISE,
                cap as libc::c_ulong,
                0,
                0,
            )
        };
        ensure!(
            rc == 0,
            "raising capability {cap} in the ambient set: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Becomes `uid` in `gid` with `groups`, keeping CAP_SETUID and CAP_SETGID alone (effective
/// and permitted): a daemon started as root (a container's way) ends as a systemd unit with
/// `User=` and `AmbientCapabilities=CAP_SETUID CAP_SETGID` starts it. Whatever else root held
/// is gone; the bounding set stays as it was given (dropping from it takes CAP_SETPCAP, which
/// a container keeps from its processes).
pub fn become_user(uid: u32, gid: u32, groups: &[u32]) -> Result<()> {
    ensure!(
        can_switch_users(),
        "switching to uid {uid} needs CAP_SETUID and CAP_SETGID (the DaemonSet adds them)"
    );
    // Started with all of root's (a host, not a container): the bounding set keeps the two
    // alone, so that no later exec or switch back to uid 0 regains the rest. Without
    // CAP_SETPCAP (a container's bounding set is already two) each drop is refused: left so.
    let last = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(40);
    for cap in (0..=last).filter(|&c| c != CAP_SETUID && c != CAP_SETGID) {
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
    }
    // SAFETY: prctl, setgroups, setresgid and setresuid with valid arguments (the group list
    // outlives the call); checked below by what the kernel then says.
    unsafe {
        ensure!(
            libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) == 0,
            "keepcaps: {}",
            std::io::Error::last_os_error()
        );
        ensure!(
            libc::setgroups(groups.len(), groups.as_ptr()) == 0,
            "setgroups: {}",
            std::io::Error::last_os_error()
        );
        ensure!(
            libc::setresgid(gid, gid, gid) == 0,
            "setresgid({gid}): {}",
            std::io::Error::last_os_error()
        );
        ensure!(
            libc::setresuid(uid, uid, uid) == 0,
            "setresuid({uid}): {}",
            std::io::Error::last_os_error()
        );
        libc::prctl(libc::PR_SET_KEEPCAPS, 0, 0, 0, 0);
        ensure!(
            libc::geteuid() == uid && libc::getegid() == gid,
            "the switch to uid {uid} did not hold"
        );
    }
    keep_only_user_switching()?;
    ensure!(
        can_switch_users(),
        "uid {uid} kept no CAP_SETUID and CAP_SETGID"
    );
    Ok(())
}
