//! Privilege separation, after OpenSSH's monitor: the users' files are parsed where a crafted
//! one can do no harm to anyone but its author.
//!
//! - **larderd** (serving): tiers, streams, rings, gRPC; once started it holds no capability
//!   (CapEff 0) and parses no file of a user's dataset. It checks everything a reader hands it.
//! - **the launcher** (`launcher`): larderd's own executable run again (`exec`, `child`) with an
//!   empty environment before the daemon starts a thread, the only process that keeps
//!   CAP_SETUID and CAP_SETGID; it parses no data, and only starts readers, access checks and
//!   recognitions, each a fresh run of the same executable switched wholly to a user (never
//!   root).
//! - **readers** (`reader`): one per dataset a user added, running as that user, no
//!   capability, NO_NEW_PRIVS, a seccomp filter and Landlock rules (`sandbox`); they open the files with the user's own rights, read and decode
//!   them, and hand the records back in sealed memfds over a socket (`wire`). The daemon's
//!   side (`remote`) checks every length, offset and record, and outlives any reader.
//!
//! The config's own datasets are read by readers too, as `reader_user` (a dedicated
//! unprivileged user) when the config names one; else in the daemon's process.
//!
//! Without the capabilities (a daemon run as a plain user) there is no launcher: the daemon
//! reads only its own user's datasets and the config's, in its own process.
//!
//! The threat model is in docs/admin.md ("Threat model").

pub mod caps;
pub mod child;
pub mod exec;
pub mod fetch;
pub mod launcher;
pub mod protocol;
pub mod reader;
pub mod remote;
pub mod sandbox;
pub mod wire;

use std::sync::OnceLock;

static LAUNCHER: OnceLock<launcher::Launcher> = OnceLock::new();
static CONFIG_READER: OnceLock<launcher::User> = OnceLock::new();

/// The launcher, when this daemon started one.
pub fn launcher() -> Option<&'static launcher::Launcher> {
    LAUNCHER.get()
}

/// The user the config's datasets are read as (`reader_user`), once set.
pub fn config_reader() -> Option<&'static launcher::User> {
    CONFIG_READER.get()
}

/// Sets the user the config's datasets are read as, by name: one the password database knows,
/// neither root nor the daemon's own user (who could reach the daemon's memory and scratch
/// tier). Only where a launcher runs; set once (a reload keeps the first).
pub fn set_config_reader(name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        launcher().is_some(),
        "reader_user = {name:?} needs a daemon that may switch users (CAP_SETUID and \
         CAP_SETGID): under systemd the unit's AmbientCapabilities give them; in a container \
         (where a user other than root gets none) start larderd as root with --user NAME and \
         only those two capabilities (deploy/k8s/daemonset.yaml)"
    );
    let uid = crate::access::uid_of(name)
        .ok_or_else(|| anyhow::anyhow!("reader_user: no user {name:?} on this machine"))?;
    // SAFETY: getuid has no arguments.
    let own = unsafe { libc::getuid() };
    anyhow::ensure!(
        uid != 0 && uid != own,
        "reader_user = {name:?} is uid {uid}: it must be neither root nor the daemon's own user"
    );
    let user: launcher::User = (&crate::access::Identity::of_user_primary(uid)).into();
    anyhow::ensure!(user.gid != 0, "reader_user = {name:?}: its group is root's");
    let _ = CONFIG_READER.set(user);
    Ok(())
}

/// At the start of larderd started as root with `--user NAME` (a container's start; systemd
/// starts it as its user instead): becomes user `name` with its groups, keeping only the
/// capabilities the launcher needs (see `caps::become_user`). Before any thread.
pub fn start_as(name: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        crate::access::euid() == 0,
        "--user {name:?} is for a larderd started as root (uid {} here): start it as root with \
         only CAP_SETUID and CAP_SETGID (deploy/k8s/daemonset.yaml), or as {name:?} under \
         systemd without --user",
        crate::access::euid()
    );
    let uid =
        crate::access::uid_of(name).ok_or_else(|| anyhow::anyhow!("--user: no user {name:?}"))?;
    anyhow::ensure!(
        uid != 0,
        "--user {name:?} is root: name the daemon's own user"
    );
    let id = crate::access::Identity::of_user_primary(uid);
    caps::become_user(uid, id.gid, &id.groups)
        .map_err(|e| e.context(format!("becoming user {name:?} (uid {uid})")))
}

/// At the start of larderd, before any thread: when the process may switch users, starts the
/// launcher (a fresh run of this executable, with an empty environment), hands the access
/// checks to it, and drops every capability of this process. Returns whether a launcher runs.
pub fn separate() -> anyhow::Result<bool> {
    if !caps::can_switch_users() {
        return Ok(false);
    }
    // Capabilities are each thread's: a thread started before this one drops them would keep
    // them (and a fork beside it could inherit a lock it holds).
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    anyhow::ensure!(
        threads == 1,
        "{threads} threads before the launcher is started; larderd must start it first"
    );
    let exe = exec::own_executable()?;
    let _ = LAUNCHER.set(launcher::Launcher::start(&exe)?);
    drop(exe);
    crate::access::set_checker(Box::new(|id, files| {
        launcher()
            .ok_or_else(|| "no launcher".to_string())?
            .check(&id.into(), files)
            .map_err(|e| format!("{e:#}"))
    }));
    caps::drop_all()?;
    Ok(true)
}
