//! Who may read what, tried as other real users would: users made for the test, a daemon
//! running as root on a Unix socket every user can reach, the `larder` CLI run as each user.
//! Needs root (it adds users and groups): ignored by a plain `cargo test`, run by
//! scripts/test as root, as CI is.

mod common;

use larder::synthetic::make_dataset;
use std::os::unix::fs::{chown, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// Users and a group made for the test, removed when dropped.
struct Users {
    names: Vec<String>,
    group: String,
}

impl Users {
    /// `alice` and `bob` (bob in group `ml`), with names unique to this run.
    fn make() -> Users {
        // Unique to this process and this call: the tests run side by side.
        static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{}x{call}", std::process::id());
        let group = format!("lt{tag}ml");
        let names = vec![format!("lt{tag}alice"), format!("lt{tag}bob")];
        run("groupadd", &[&group]);
        for (k, n) in names.iter().enumerate() {
            let mut args = vec!["-M", "-N", "-g", "nogroup", "-s", "/usr/sbin/nologin"];
            if k == 1 {
                args.extend(["-G", &group]);
            }
            args.push(n);
            run("useradd", &args);
        }
        Users { names, group }
    }

    fn uid(&self, k: usize) -> u32 {
        id("-u", &self.names[k])
    }
}

impl Drop for Users {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("userdel").arg(n).status();
        }
        let _ = Command::new("groupdel").arg(&self.group).status();
    }
}

fn run(cmd: &str, args: &[&str]) {
    let status = Command::new(cmd).args(args).status().unwrap();
    assert!(status.success(), "{cmd} {args:?}");
}

fn id(flag: &str, name: &str) -> u32 {
    let out = Command::new("id").args([flag, name]).output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// `larder ARGS` run as user `uid` (in group nogroup) against the daemon at `socket`.
fn larder_as(uid: u32, socket: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_larder"))
        .arg("--addr")
        .arg(format!("unix:{}", socket.display()))
        .args(args)
        .uid(uid)
        .gid(id("-g", "nobody"))
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

struct Larderd(Child);

impl Drop for Larderd {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn set_mode(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
#[ignore = "adds users and groups: needs root (scripts/test runs it as root)"]
fn each_user_reads_through_larder_only_what_they_could_read_themselves() {
    assert_eq!(unsafe { libc::geteuid() }, 0, "run as root");
    let users = Users::make();
    let (alice, bob) = (users.uid(0), users.uid(1));
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    set_mode(root, 0o755);
    // Root's files: one every user may read, one only root, one root's but granted to a group.
    let data = |name: &str, mode: u32| -> PathBuf {
        let p = root.join(name);
        make_dataset(&p, 40, &[2, 4, 4]).unwrap();
        set_mode(&p, mode);
        p
    };
    let public = data("public.h5", 0o644);
    let secret = data("secret.h5", 0o600);
    let granted = data("granted.h5", 0o600);
    // Alice's own file, 0600 in her 0700 home.
    let home = root.join("alice");
    std::fs::create_dir(&home).unwrap();
    let own = home.join("own.h5");
    make_dataset(&own, 40, &[2, 4, 4]).unwrap();
    chown(&home, Some(alice), None).unwrap();
    chown(&own, Some(alice), None).unwrap();
    set_mode(&home, 0o700);
    set_mode(&own, 0o600);

    let socket = root.join("larder.sock");
    let config = root.join("larder.toml");
    let table = |name: &str, path: &Path, extra: &str| {
        format!("[[dataset]]\nname = \"{name}\"\npath = {path:?}\nlabels = \"labels\"\n{extra}\n")
    };
    std::fs::write(
        &config,
        format!(
            "unix_socket = {socket:?}\nunix_socket_mode = 0o666\n[scratch]\ndir = {:?}\n{}{}{}{}",
            root.join("scratch"),
            table("public", &public, ""),
            table("secret", &secret, ""),
            table(
                "granted",
                &granted,
                &format!("allow = [\"group:{}\"]", users.group)
            ),
            table("alice-own", &own, ""),
        ),
    )
    .unwrap();
    let _daemon = Larderd(common::spawn_larderd(&config, &socket));

    // larderd listens first and opens its datasets after: wait until root sees all four.
    let started = Instant::now();
    loop {
        let all = text(&larder_as(0, &socket, &["datasets"]));
        if ["public", "secret", "granted", "alice-own"]
            .iter()
            .all(|n| all.contains(n))
        {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "{all}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // What each user is shown.
    let listed = |uid| {
        let o = larder_as(uid, &socket, &["datasets"]);
        assert!(o.status.success(), "{}", text(&o));
        text(&o)
    };
    let a = listed(alice);
    assert!(a.contains("public") && a.contains("alice-own"), "{a}");
    assert!(!a.contains("secret") && !a.contains("granted"), "{a}");
    let b = listed(bob);
    assert!(b.contains("public") && b.contains("granted"), "{b}");
    assert!(!b.contains("secret") && !b.contains("alice-own"), "{b}");

    // Streams, warms and bad-sample lists: allowed ones work, the others are denied by name.
    let stream = |uid, name: &str| larder_as(uid, &socket, &["bench", name, "--epochs", "1"]);
    let ok = |o: Output| assert!(o.status.success(), "{}", text(&o));
    // PERMISSION_DENIED from the daemon; `bench` first looks the dataset up in the list,
    // which does not show it.
    let denied = |o: Output, name: &str| {
        assert!(!o.status.success(), "{}", text(&o));
        let t = text(&o);
        assert!(
            (t.contains("may not read dataset") && t.contains(name))
                || t.contains(&format!("no dataset \"{name}\" that you may read")),
            "{t}"
        );
    };
    ok(stream(alice, "public"));
    ok(stream(alice, "alice-own"));
    ok(stream(bob, "granted"));
    denied(stream(alice, "secret"), "secret");
    denied(stream(alice, "granted"), "granted");
    denied(stream(bob, "alice-own"), "alice-own");
    denied(larder_as(bob, &socket, &["warm", "alice-own"]), "alice-own");
    denied(larder_as(alice, &socket, &["bad", "secret"]), "secret");
    // Root's stream of its own file filled the tiers; alice still gets nothing of it.
    ok(stream(0, "secret"));
    denied(stream(alice, "secret"), "secret");

    // Both users at once, many times over: no check leaks one user's identity into another's.
    let threads: Vec<_> = (0..4)
        .map(|k| {
            let socket = socket.clone();
            std::thread::spawn(move || {
                let (uid, mine, theirs) = if k % 2 == 0 {
                    (alice, "alice-own", "granted")
                } else {
                    (bob, "granted", "alice-own")
                };
                for _ in 0..3 {
                    let o = larder_as(uid, &socket, &["bench", mine, "--epochs", "1"]);
                    assert!(o.status.success(), "{}", text(&o));
                    let o = larder_as(uid, &socket, &["bench", theirs, "--epochs", "1"]);
                    assert!(!o.status.success(), "{}", text(&o));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }

    // A right taken away takes effect at the next stream.
    set_mode(&public, 0o600);
    denied(stream(alice, "public"), "public");
    assert!(!listed(alice).contains("public"));
    set_mode(&public, 0o644);
    ok(stream(alice, "public"));
}

/// What a check as another user costs per file (a measurement, printed; no assertion on
/// time): `cargo test --release --test access -- --ignored --nocapture check_cost`.
#[test]
#[ignore = "adds users and groups: needs root (scripts/test runs it as root)"]
fn check_cost() {
    use larder::access::{check, Caller, Guard, Identity};
    assert_eq!(unsafe { libc::geteuid() }, 0, "run as root");
    let users = Users::make();
    let dir = tempfile::tempdir().unwrap();
    set_mode(dir.path(), 0o755);
    let files: std::sync::Arc<[PathBuf]> = (0..20_000)
        .map(|i| {
            let p = dir.path().join(format!("{i}.jpg"));
            std::fs::write(&p, b"x").unwrap();
            p
        })
        .collect::<Vec<_>>()
        .into();
    let who = Caller::Local(std::sync::Arc::new(Identity::of_user(
        users.uid(0),
        id("-g", "nobody"),
        None,
    )));
    let guard = Guard {
        allow: vec![],
        tcp: false,
    };
    for _ in 0..2 {
        let started = Instant::now();
        check(&guard, &who, &files).unwrap();
        let per = started.elapsed().as_secs_f64() / files.len() as f64;
        println!(
            "a check as another user: {:.2} us a file ({} files)",
            per * 1e6,
            files.len()
        );
    }
}
