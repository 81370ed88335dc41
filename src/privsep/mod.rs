//! Privilege separation, after OpenSSH's monitor: the users' files are parsed where a crafted
//! one can do no harm to anyone but its author.
//!
//! - **larderd** (serving): tiers, streams, rings, gRPC; once started it holds no capability
//!   (CapEff 0) and parses no file of a user's dataset. It checks everything a reader hands it.
//! - **the launcher** (`launcher`): forked from larderd before it starts a thread, the only
//!   process that keeps CAP_SETUID and CAP_SETGID; it parses no data, and only starts readers
//!   and access checks, each in a child switched wholly to a user (never root).
//! - **readers** (`reader`): one per dataset a user added, running as that user, no
//!   capability, NO_NEW_PRIVS; they open the files with the user's own rights, read and decode
//!   them, and hand the records back in sealed memfds over a socket (`wire`). The daemon's
//!   side (`remote`) checks every length, offset and record, and outlives any reader.
//!
//! Without the capabilities (a daemon run as a plain user) there is no launcher: the daemon
//! reads only its own user's datasets and the config's, in its own process, as before.
//!
//! The threat model is in docs/admin.md ("Threat model").

pub mod caps;
pub mod launcher;
pub mod reader;
pub mod remote;
pub mod wire;

use std::sync::OnceLock;

static LAUNCHER: OnceLock<launcher::Launcher> = OnceLock::new();

/// The launcher, when this daemon started one.
pub fn launcher() -> Option<&'static launcher::Launcher> {
    LAUNCHER.get()
}

/// At the start of larderd, before any thread: when the process may switch users, forks the
/// launcher, hands the access checks to it, and drops every capability of this process.
/// Returns whether a launcher runs.
pub fn separate() -> anyhow::Result<bool> {
    if !caps::can_switch_users() {
        return Ok(false);
    }
    // Capabilities are each thread's: a thread started before this one drops them would keep
    // them (and a fork beside it could inherit a lock it holds).
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    anyhow::ensure!(
        threads == 1,
        "{threads} threads before the launcher is forked; larderd must start it first"
    );
    let _ = LAUNCHER.set(launcher::Launcher::start()?);
    crate::access::set_checker(Box::new(|id, files| {
        launcher()
            .ok_or_else(|| "no launcher".to_string())?
            .check(&id.into(), files)
            .map_err(|e| format!("{e:#}"))
    }));
    caps::drop_all()?;
    Ok(true)
}
