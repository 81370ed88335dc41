//! Who may read what, tried as other real users would: users made for the test, a daemon
//! running as root on a Unix socket every user can reach, the `larder` CLI run as each user.
//! Needs root (it adds users and groups): ignored by a plain `cargo test`, run by
//! scripts/test as root, as CI is.

mod common;

use larder::proto::health::health_check_response::ServingStatus::{NotServing, Serving};
use larder::synthetic::make_dataset;
use std::os::unix::fs::{chown, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// Users and a group made for the test, removed when dropped.
struct Users {
    names: Vec<String>,
    group: String,
    /// Users of the daemon's own (its user, a reader user), removed with the rest.
    extra: Vec<String>,
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
        Users {
            names,
            group,
            extra: vec![],
        }
    }

    /// One more user, named after the first with `suffix` (group nogroup, no login): the
    /// daemon's own user, or a reader user. Its name and uid.
    fn extra(&mut self, suffix: &str) -> (String, u32) {
        let name = format!("{}{suffix}", self.names[0]);
        run(
            "useradd",
            &[
                "-M",
                "-N",
                "-g",
                "nogroup",
                "-s",
                "/usr/sbin/nologin",
                &name,
            ],
        );
        self.extra.push(name.clone());
        let uid = id("-u", &name);
        (name, uid)
    }

    fn uid(&self, k: usize) -> u32 {
        id("-u", &self.names[k])
    }
}

impl Drop for Users {
    fn drop(&mut self) {
        for n in self.names.iter().chain(&self.extra) {
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

/// The health service's status of `service`, asked as root over `socket`.
fn health(socket: &Path, service: &str) -> i32 {
    use larder::proto::health::{health_client::HealthClient, HealthCheckRequest};
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let channel = larder::client::channel(&format!("unix:{}", socket.display()))
            .await
            .unwrap();
        let request = HealthCheckRequest {
            service: service.to_string(),
        };
        HealthClient::new(channel)
            .check(request)
            .await
            .unwrap()
            .into_inner()
            .status
    })
}

/// `larder ARGS` run as user `uid` against the daemon at `socket`, as a login would start it:
/// with the user's supplementary groups (the daemon takes a caller's groups from the kernel),
/// its group nogroup (so a group's rights come from the user's groups, not the process's).
fn larder_as(uid: u32, socket: &Path, args: &[&str]) -> Output {
    let mut c = Command::new("setpriv");
    if uid == 0 {
        c.args(["--reuid=0", "--regid=0", "--clear-groups"]);
    } else {
        c.args([
            format!("--reuid={uid}"),
            format!("--regid={}", id("-g", "nobody")),
            "--init-groups".to_string(),
        ]);
    }
    c.arg("--")
        .arg(env!("CARGO_BIN_EXE_larder"))
        .arg("--addr")
        .arg(format!("unix:{}", socket.display()))
        .args(args)
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
    assert_eq!(larder::access::euid(), 0, "run as root");
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
    // Alice's own file, 0640 in her 0750 home, both of group root: the serving daemon runs
    // as root without a capability (privsep), so it reads what root's group may, as the
    // daemon's own group would be given an admin's dataset; bob may not read it.
    let home = root.join("alice");
    std::fs::create_dir(&home).unwrap();
    let own = home.join("own.h5");
    make_dataset(&own, 40, &[2, 4, 4]).unwrap();
    chown(&home, Some(alice), Some(0)).unwrap();
    chown(&own, Some(alice), Some(0)).unwrap();
    set_mode(&home, 0o750);
    set_mode(&own, 0o640);

    // A folder every user may read: a NumPy array of 40 rows of 4 uint8, as numpy writes it.
    let arrays = root.join("arrays");
    std::fs::create_dir(&arrays).unwrap();
    let mut header = "{'descr': '|u1', 'fortran_order': False, 'shape': (40, 4), }".to_string();
    while !(10 + header.len() + 1).is_multiple_of(64) {
        header.push(' ');
    }
    header.push('\n');
    let mut npy = b"\x93NUMPY\x01\x00".to_vec();
    npy.extend_from_slice(&(header.len() as u16).to_le_bytes());
    npy.extend_from_slice(header.as_bytes());
    npy.extend((0..160).map(|i| i as u8));
    let array = arrays.join("x.npy");
    std::fs::write(&array, npy).unwrap();
    set_mode(&array, 0o644);
    set_mode(&arrays, 0o755);

    let socket = root.join("larder.sock");
    let config = root.join("larder.toml");
    let table = |name: &str, path: &Path, extra: &str| {
        format!("[[dataset]]\nname = \"{name}\"\npath = {path:?}\nlabels = \"labels\"\n{extra}\n")
    };
    std::fs::write(
        &config,
        format!(
            "unix_socket = {socket:?}\nunix_socket_mode = 0o666\n[scratch]\ndir = {:?}\n{}{}{}{}[[dataset]]\nname = \"arrays\"\npath = {arrays:?}\n",
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
        if ["public", "secret", "granted", "alice-own", "arrays"]
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
    // The groups are the calling process's, as the kernel holds them (SO_PEERGROUPS): a
    // process of bob's that dropped the group has no more of it through larder than by itself.
    let without_groups = Command::new("setpriv")
        .args([
            format!("--reuid={bob}"),
            format!("--regid={}", id("-g", "nobody")),
            "--clear-groups".to_string(),
            "--".to_string(),
        ])
        .arg(env!("CARGO_BIN_EXE_larder"))
        .arg("--addr")
        .arg(format!("unix:{}", socket.display()))
        .arg("datasets")
        .output()
        .unwrap();
    let b = text(&without_groups);
    assert!(b.contains("public") && !b.contains("granted"), "{b}");
    // `larder stats` per dataset: the same rule (root sees every dataset).
    let stats = |uid| text(&larder_as(uid, &socket, &["stats"]));
    let a = stats(alice);
    assert!(
        a.contains("dataset public:") && a.contains("dataset alice-own:"),
        "{a}"
    );
    assert!(
        !a.contains("dataset secret:") && !a.contains("dataset granted:"),
        "{a}"
    );
    assert!(stats(0).contains("dataset secret:"));

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

    // A check passed stands a minute while the dataset's root keeps its status-change time (the
    // threat model's staleness bound): a file inside a folder made unreadable is seen within
    // it, not at once; the folder's own mode at once.
    ok(stream(alice, "arrays"));
    set_mode(&array, 0o600);
    ok(stream(alice, "arrays"));
    set_mode(&arrays, 0o700);
    denied(stream(alice, "arrays"), "arrays");
    set_mode(&arrays, 0o755);
    set_mode(&array, 0o644);
    ok(stream(alice, "arrays"));
}

/// What a check as another user costs per file (a measurement, printed; no assertion on
/// time): `cargo test --release --test access -- --ignored --nocapture check_cost`.
#[test]
#[ignore = "adds users and groups: needs root (scripts/test runs it as root)"]
fn check_cost() {
    use larder::access::{check, Caller, Guard, Identity};
    assert_eq!(larder::access::euid(), 0, "run as root");
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
    let n = files.len();
    let files = larder::access::Files::List(files);
    for _ in 0..2 {
        let started = Instant::now();
        check(&guard, &who, &files).unwrap();
        let per = started.elapsed().as_secs_f64() / n as f64;
        println!(
            "a check as another user: {:.2} us a file ({} files)",
            per * 1e6,
            n
        );
    }
}

/// Makes `dir` (and its parents) owned by `uid` with `mode`.
fn own_dir(dir: &Path, uid: u32, mode: u32) {
    std::fs::create_dir_all(dir).unwrap();
    chown(dir, Some(uid), None).unwrap();
    set_mode(dir, mode);
}

/// A user's file: `bytes` written to `path`, owned by `uid` with `mode`.
fn own_file(path: &Path, uid: u32, mode: u32) {
    chown(path, Some(uid), None).unwrap();
    set_mode(path, mode);
}

/// Each thread's file-system uid and gid (the 4th field of Uid: and Gid: in its status).
fn thread_fs_ids(pid: u32) -> Vec<(u32, u32)> {
    let mut ids = vec![];
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(t.unwrap().path().join("status")).unwrap_or_default();
        let field = |key: &str| -> Option<u32> {
            let line = status.lines().find(|l| l.starts_with(key))?;
            line.split_whitespace().nth(4)?.parse().ok()
        };
        if let (Some(u), Some(g)) = (field("Uid:"), field("Gid:")) {
            ids.push((u, g));
        }
    }
    ids
}

/// The JPEG fixture in `dir` as `name`, owned by `uid` with `mode`.
fn jpeg(dir: &Path, name: &str, uid: u32, mode: u32) -> PathBuf {
    let p = dir.join(name);
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parrots.jpg"),
        &p,
    )
    .unwrap();
    own_file(&p, uid, mode);
    p
}

/// Waits until `larder datasets` as `uid` lists `name` (the daemon opens datasets after it
/// listens).
fn wait_listed(uid: u32, socket: &Path, name: &str) {
    let started = Instant::now();
    loop {
        let all = text(&larder_as(uid, socket, &["datasets"]));
        if all.contains(name) {
            return;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "{all}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
#[ignore = "adds users and groups: needs root (scripts/test runs it as root)"]
fn users_add_their_own_datasets_read_with_their_own_rights() {
    assert_eq!(larder::access::euid(), 0, "run as root");
    let mut users = Users::make();
    let (alice, bob) = (users.uid(0), users.uid(1));
    let (an, bn) = (users.names[0].clone(), users.names[1].clone());
    // The daemon's own user, as the unit makes it.
    let (_, larder) = users.extra("d");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    set_mode(root, 0o755);
    // Alice's HDF5 file, 0600 in her 0700 home; bob's home 0700.
    let ahome = root.join("alice");
    own_dir(&ahome, alice, 0o700);
    let own = ahome.join("own.h5");
    make_dataset(&own, 40, &[2, 4, 4]).unwrap();
    own_file(&own, alice, 0o600);
    let bhome = root.join("bob");
    own_dir(&bhome, bob, 0o700);
    // A file both may read, in a shared folder.
    let shared = root.join("shared.h5");
    make_dataset(&shared, 30, &[2, 4, 4]).unwrap();
    set_mode(&shared, 0o644);

    // The daemon runs as its own user with only CAP_SETUID and CAP_SETGID, as under the unit.
    let run_dir = root.join("run");
    own_dir(&run_dir, larder, 0o755);
    let (socket, state) = (run_dir.join("larder.sock"), root.join("state"));
    own_dir(&state, larder, 0o700);
    own_dir(&root.join("scratch"), larder, 0o700);
    let config = root.join("larder.toml");
    std::fs::write(
        &config,
        format!(
            "unix_socket = {socket:?}\nunix_socket_mode = 0o666\nstate_dir = {state:?}\n\
             [scratch]\ndir = {:?}\n",
            root.join("scratch")
        ),
    )
    .unwrap();
    set_mode(&config, 0o644);
    let start = || {
        let child = Command::new("setpriv")
            .args([
                &format!("--reuid={larder}"),
                &format!("--regid={}", id("-g", "nobody")),
                "--clear-groups",
                "--inh-caps=+setuid,+setgid",
                "--ambient-caps=+setuid,+setgid",
                "--",
                env!("CARGO_BIN_EXE_larderd"),
                "--config",
            ])
            .arg(&config)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while !socket.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "larderd did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Larderd(child)
    };
    let mut daemon = start();
    let ok = |o: Output| {
        assert!(o.status.success(), "{}", text(&o));
        text(&o)
    };
    let fails = |o: Output, want: &str| {
        let t = text(&o);
        assert!(!o.status.success() && t.contains(want), "{t}");
    };
    let own_s = own.to_str().unwrap();
    let mine = format!("{an}/own");

    // Alice adds her 0600 file: the daemon (user larder) reads it as her.
    let added = ok(larder_as(
        alice,
        &socket,
        &["add", "own", own_s, "--labels", "labels"],
    ));
    assert!(
        added.contains(&mine) && added.contains("40 samples"),
        "{added}"
    );
    ok(larder_as(
        alice,
        &socket,
        &["bench", &mine, "--epochs", "1"],
    ));
    let listed = ok(larder_as(alice, &socket, &["datasets"]));
    assert!(listed.contains(&mine) && listed.contains(&an), "{listed}");
    // Bob can neither see, stream, replace nor remove it; his own "own" is bob/own.
    assert!(!ok(larder_as(bob, &socket, &["datasets"])).contains(&mine));
    fails(
        larder_as(bob, &socket, &["bench", &mine, "--epochs", "1"]),
        &mine,
    );
    fails(
        larder_as(bob, &socket, &["rm", &mine]),
        "you added no dataset",
    );
    fails(
        larder_as(bob, &socket, &["add", "own", own_s, "--labels", "labels"]),
        "Permission denied",
    );
    // A file bob cannot read is refused to him at add.
    assert!(!ok(larder_as(bob, &socket, &["datasets"])).contains(&format!("{bn}/own")));
    // Alice shares it with bob's group: now he streams it.
    ok(larder_as(
        alice,
        &socket,
        &[
            "add",
            "own",
            own_s,
            "--labels",
            "labels",
            "--replace",
            "--allow",
            &format!("group:{}", users.group),
        ],
    ));
    ok(larder_as(bob, &socket, &["bench", &mine, "--epochs", "1"]));
    // The same file added by both users: each has their own name, both stream it.
    let shared_s = shared.to_str().unwrap();
    ok(larder_as(
        alice,
        &socket,
        &["add", "shared", shared_s, "--labels", "labels"],
    ));
    ok(larder_as(
        bob,
        &socket,
        &["add", "shared", shared_s, "--labels", "labels"],
    ));
    for (uid, name) in [(alice, &an), (bob, &bn)] {
        ok(larder_as(
            uid,
            &socket,
            &["bench", &format!("{name}/shared"), "--epochs", "1"],
        ));
    }
    // Both users at once: no worker thread keeps a user's identity afterwards.
    let threads: Vec<_> = [
        (alice, format!("{an}/shared")),
        (bob, format!("{bn}/shared")),
        (alice, mine.clone()),
        (bob, mine.clone()),
    ]
    .into_iter()
    .map(|(uid, name)| {
        let socket = socket.clone();
        std::thread::spawn(move || {
            for _ in 0..3 {
                let o = larder_as(uid, &socket, &["bench", &name, "--epochs", "1"]);
                assert!(o.status.success(), "{}", text(&o));
            }
        })
    })
    .collect();
    for t in threads {
        t.join().unwrap();
    }
    let nobody_gid = id("-g", "nobody");
    for ids in thread_fs_ids(daemon.0.id()) {
        assert_eq!(
            ids,
            (larder, nobody_gid),
            "a thread left with another identity"
        );
    }

    // Added datasets outlive the daemon.
    drop(daemon);
    std::fs::remove_file(&socket).ok();
    daemon = start();
    wait_listed(alice, &socket, &mine);
    ok(larder_as(
        alice,
        &socket,
        &["bench", &mine, "--epochs", "1"],
    ));
    // Removed: no new streams, and gone after a restart too.
    ok(larder_as(alice, &socket, &["rm", &mine]));
    fails(
        larder_as(alice, &socket, &["bench", &mine, "--epochs", "1"]),
        &mine,
    );
    drop(daemon);
    std::fs::remove_file(&socket).ok();
    let _daemon = start();
    wait_listed(bob, &socket, &format!("{bn}/shared"));
    assert!(!ok(larder_as(alice, &socket, &["datasets"])).contains(&mine));
}

#[test]
#[ignore = "adds users and groups: needs root (scripts/test runs it as root)"]
fn symlinks_in_a_users_dataset_serve_no_byte_they_could_not_read() {
    assert_eq!(larder::access::euid(), 0, "run as root");
    let users = Users::make();
    let (alice, bob) = (users.uid(0), users.uid(1));
    let an = users.names[0].clone();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    set_mode(root, 0o755);
    // Bob's home (0700): a 0600 JPEG, and a 0644 HDF5 file he adds (the daemon holds it open).
    let bhome = root.join("bob");
    own_dir(&bhome, bob, 0o700);
    let secret = jpeg(&bhome, "secret.jpg", bob, 0o600);
    jpeg(&bhome, "open.jpg", bob, 0o644);
    let bobs = bhome.join("b.h5");
    make_dataset(&bobs, 20, &[2, 4, 4]).unwrap();
    own_file(&bobs, bob, 0o644);
    // Root's own 0600 JPEG.
    let roots = jpeg(root, "root-only.jpg", 0, 0o600);
    // Alice's image folder: two good images, and links to everything above.
    let pics = root.join("alice").join("pics");
    own_dir(&root.join("alice"), alice, 0o700);
    own_dir(&pics, alice, 0o700);
    let class = pics.join("c");
    own_dir(&class, alice, 0o700);
    jpeg(&class, "good1.jpg", alice, 0o600);
    jpeg(&class, "good2.jpg", alice, 0o600);
    let link = |name: &str, to: &str| {
        let p = class.join(name);
        std::os::unix::fs::symlink(to, &p).unwrap();
        std::os::unix::fs::lchown(&p, Some(alice), None).unwrap();
    };
    link("abs.jpg", secret.to_str().unwrap());
    link("up.jpg", "../../../bob/secret.jpg");
    link("open.jpg", "../../../bob/open.jpg"); // through bob's 0700 home
    link("root.jpg", roots.to_str().unwrap());
    for fd in 3..48 {
        link(&format!("fd{fd:02}.jpg"), &format!("/proc/self/fd/{fd}"));
    }

    // A daemon as root: the strongest case (its own rights read anything).
    let socket = root.join("larder.sock");
    let config = root.join("larder.toml");
    std::fs::write(
        &config,
        format!(
            "unix_socket = {socket:?}\nunix_socket_mode = 0o666\nstate_dir = {:?}\n[scratch]\ndir = {:?}\n",
            root.join("state"),
            root.join("scratch")
        ),
    )
    .unwrap();
    let _daemon = Larderd(common::spawn_larderd(&config, &socket));
    let o = larder_as(
        bob,
        &socket,
        &["add", "b", bobs.to_str().unwrap(), "--labels", "labels"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let o = larder_as(
        alice,
        &socket,
        &[
            "add",
            "pics",
            pics.to_str().unwrap(),
            "--resize",
            "64",
            "--crop",
            "32",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let name = format!("{an}/pics");
    let o = larder_as(
        alice,
        &socket,
        &[
            "bench",
            &name,
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--clients",
            "1",
        ],
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    // Every link is a bad sample that was never read: refused at open (permission, or a magic
    // link), not a file that failed to decode.
    let bad = text(&larder_as(alice, &socket, &["bad", &name]));
    let lines: Vec<&str> = bad.lines().filter(|l| l.starts_with("bad:")).collect();
    // (Links whose target alice cannot even look at are no sample at all: the folder is
    // walked as her.)
    assert!(lines.iter().any(|l| l.contains("root.jpg")), "{bad}");
    for l in &lines {
        assert!(!l.contains("good"), "{l}");
        assert!(
            l.contains("Permission denied")
                || l.contains("Too many levels of symbolic links")
                || l.contains("No such file"),
            "read rather than refused: {l}"
        );
    }
    // The epoch served exactly the two good images.
    assert!(out.contains("epoch 0: 2 samples ("), "{out}\n{bad}");
}

/// A line of /proc/PID/status ("CapEff", "NoNewPrivs", "Uid").
fn status_of(pid: u32, key: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

/// The processes of the larderd binary running as `uid` (readers are forks of it).
fn larderd_processes_of(uid: u32) -> Vec<u32> {
    let exe = std::fs::canonicalize(env!("CARGO_BIN_EXE_larderd")).unwrap();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe))
        .filter(|pid| status_of(*pid, "Uid").split_whitespace().next() == Some(&uid.to_string()))
        .collect()
}

#[test]
#[ignore = "adds users and groups: needs root (scripts/test runs it as root)"]
fn a_users_files_are_parsed_by_a_reader_as_them_and_its_failure_is_theirs_alone() {
    assert_eq!(larder::access::euid(), 0, "run as root");
    let users = Users::make();
    let (alice, bob) = (users.uid(0), users.uid(1));
    let (an, bn) = (users.names[0].clone(), users.names[1].clone());
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    set_mode(root, 0o755);
    // Each user's file, 0600 in their 0700 home; samples of 12 KB, so that a memory tier of a
    // few samples makes every epoch read them from the reader (no scratch tier).
    let mut files = vec![];
    for (uid, name) in [(alice, "alice"), (bob, "bob")] {
        let home = root.join(name);
        own_dir(&home, uid, 0o700);
        let f = home.join("own.h5");
        make_dataset(&f, 64, &[3, 64, 64]).unwrap();
        own_file(&f, uid, 0o600);
        files.push(f);
    }
    let (socket, state) = (root.join("larder.sock"), root.join("state"));
    let config = root.join("larder.toml");
    std::fs::write(
        &config,
        format!(
            "unix_socket = {socket:?}\nunix_socket_mode = 0o666\nstate_dir = {state:?}\n\
             [scratch]\nenabled = false\n[memory]\nbudget_bytes = 400000\nmessage_bytes = 300000\n"
        ),
    )
    .unwrap();
    let daemon = Larderd(common::spawn_larderd(&config, &socket));
    let pid = daemon.0.id();
    // Readers left stopped by a failed assertion are ended with the test.
    struct Reap(Vec<u32>);
    impl Drop for Reap {
        fn drop(&mut self) {
            for uid in &self.0 {
                for p in larderd_processes_of(*uid) {
                    // SAFETY: kill with a pid and a signal number has no memory effects.
                    unsafe { libc::kill(p as i32, libc::SIGKILL) };
                }
            }
        }
    }
    let _reap = Reap(vec![alice, bob]);
    let ok = |o: Output| {
        assert!(o.status.success(), "{}", text(&o));
        text(&o)
    };
    let add = |uid, f: &Path| {
        ok(larder_as(
            uid,
            &socket,
            &["add", "own", f.to_str().unwrap(), "--labels", "labels"],
        ))
    };
    add(alice, &files[0]);
    add(bob, &files[1]);
    let (mine, theirs) = (format!("{an}/own"), format!("{bn}/own"));
    let bench = |uid, name: &str| {
        larder_as(
            uid,
            &socket,
            &[
                "bench",
                name,
                "--epochs",
                "1",
                "--batch-size",
                "8",
                "--clients",
                "1",
            ],
        )
    };
    ok(bench(alice, &mine));
    ok(bench(bob, &theirs));

    // The serving daemon holds no capability; the readers run as their owners with none.
    assert_eq!(status_of(pid, "CapEff"), "0000000000000000");
    assert_eq!(status_of(pid, "NoNewPrivs"), "1");
    let readers = larderd_processes_of(alice);
    assert_eq!(readers.len(), 1, "alice's reader: {readers:?}");
    let reader = readers[0];
    assert_eq!(status_of(reader, "CapEff"), "0000000000000000");
    assert_eq!(status_of(reader, "NoNewPrivs"), "1");
    // Under its seccomp filter (and Landlock rules, which /proc does not show).
    assert_eq!(status_of(reader, "Seccomp"), "2");
    let groups = status_of(reader, "Groups");
    assert!(!groups.split_whitespace().any(|g| g == "0"), "{groups}");
    // No thread of the daemon ever switches to a user any more, and none holds a capability
    // (capabilities are each thread's).
    assert!(thread_fs_ids(pid).iter().all(|&(u, _)| u == 0));
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        assert!(
            status.contains("CapEff:\t0000000000000000"),
            "thread {:?}: {status}",
            t.path()
        );
    }
    // The reader holds one socket, its own: nothing of the launcher's or the daemon's.
    let sockets = std::fs::read_dir(format!("/proc/{reader}/fd"))
        .unwrap()
        .flatten()
        .filter(|f| {
            std::fs::read_link(f.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
        })
        .count();
    assert_eq!(sockets, 1, "the reader's sockets");

    // The health service, as root asks it over the socket: both datasets SERVING.
    assert_eq!(health(&socket, &mine), Serving as i32);
    assert_eq!(health(&socket, &theirs), Serving as i32);

    // Alice's reader crashes: her stream ends with an error naming her dataset at once; bob
    // streams on; the daemon is the same process; after the backoff hers serves again.
    // (Rust's stack-overflow handler takes the first SIGSEGV that is sent rather than caused by
    // a fault, and puts the default action back: the second is the crash.)
    for _ in 0..2 {
        // SAFETY: kill with a pid and a signal number has no memory effects.
        unsafe { libc::kill(reader as i32, libc::SIGSEGV) };
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(larderd_processes_of(alice).is_empty(), "the reader crashed");
    // Health says so before any stream asks: hers NOT_SERVING, bob's SERVING.
    assert_eq!(health(&socket, &mine), NotServing as i32);
    assert_eq!(health(&socket, &theirs), Serving as i32);
    let started = Instant::now();
    let failed = bench(alice, &mine);
    let said = text(&failed);
    assert!(!failed.status.success(), "{said}");
    assert!(
        said.contains(&mine) && said.contains("not served now"),
        "{said}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    ok(bench(bob, &theirs));
    assert!(
        std::fs::metadata(format!("/proc/{pid}")).is_ok(),
        "the daemon lives"
    );
    let back = Instant::now();
    loop {
        let o = bench(alice, &mine);
        if o.status.success() {
            break;
        }
        assert!(back.elapsed() < Duration::from_secs(20), "{}", text(&o));
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(health(&socket, &mine), Serving as i32, "her reader is back");

    // Her reader hangs (stopped): her stream ends within 10 s, bob's does not notice.
    let readers = larderd_processes_of(alice);
    assert_eq!(readers.len(), 1, "a new reader: {readers:?}");
    // SAFETY: kill with a pid and a signal number has no memory effects.
    unsafe { libc::kill(readers[0] as i32, libc::SIGSTOP) };
    let started = Instant::now();
    let failed = bench(alice, &mine);
    let said = text(&failed);
    assert!(!failed.status.success(), "{said}");
    assert!(
        said.contains(&mine) && said.contains("not served now"),
        "{said}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(12),
        "{:?}",
        started.elapsed()
    );
    ok(bench(bob, &theirs));
    // The stopped reader, given up on, is killed (by its nanny's end): no process of hers is
    // left behind, stopped or not.
    let gone = Instant::now();
    while std::fs::metadata(format!("/proc/{}", readers[0])).is_ok() {
        assert!(
            gone.elapsed() < Duration::from_secs(10),
            "the stopped reader {} is still there",
            readers[0]
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        std::fs::metadata(format!("/proc/{pid}")).is_ok(),
        "the daemon lives"
    );
}

#[test]
#[ignore = "adds users and groups: needs root (scripts/test runs it as root)"]
fn the_configs_datasets_are_read_by_the_reader_user_never_by_the_daemon() {
    assert_eq!(larder::access::euid(), 0, "run as root");
    let mut users = Users::make();
    let alice = users.uid(0);
    let (reader_name, reader_uid) = users.extra("rd");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    set_mode(root, 0o755);
    // The admin's image folder, readable by all: two good images, and a link to a file only
    // root may read (as if swapped in after a check passed).
    let pics = root.join("pics");
    let class = pics.join("c");
    own_dir(&class, 0, 0o755);
    set_mode(&pics, 0o755);
    jpeg(&class, "good1.jpg", 0, 0o644);
    jpeg(&class, "good2.jpg", 0, 0o644);
    let secret = jpeg(root, "root-only.jpg", 0, 0o600);
    std::os::unix::fs::symlink(&secret, class.join("swapped.jpg")).unwrap();
    let socket = root.join("larder.sock");
    let config = root.join("larder.toml");
    let write_config = |reader: &str| {
        std::fs::write(
            &config,
            format!(
                "unix_socket = {socket:?}\nunix_socket_mode = 0o666\nreader_user = {reader:?}\n\
                 [scratch]\nenabled = false\n\
                 [[dataset]]\nname = \"pics\"\npath = {pics:?}\nresize = 64\ncrop = 32\nallow = [\"all\"]\n"
            ),
        )
        .unwrap();
    };
    // Never root, nor a user that is not there: the daemon does not start.
    for bad in ["root", "no-such-user-here"] {
        write_config(bad);
        let o = Command::new(env!("CARGO_BIN_EXE_larderd"))
            .arg("--config")
            .arg(&config)
            .output()
            .unwrap();
        assert!(!o.status.success());
        assert!(text(&o).contains("reader_user"), "{}", text(&o));
    }
    write_config(&reader_name);
    let daemon = Larderd(common::spawn_larderd(&config, &socket));
    wait_listed(alice, &socket, "pics");
    let o = larder_as(
        alice,
        &socket,
        &[
            "bench",
            "pics",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--clients",
            "1",
        ],
    );
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    // Only the two good images: the link was read with the reader user's rights, refused.
    assert!(out.contains("epoch 0: 2 samples ("), "{out}");
    let bad = text(&larder_as(alice, &socket, &["bad", "pics"]));
    assert!(
        bad.lines()
            .any(|l| l.contains("swapped.jpg") && l.contains("Permission denied")),
        "{bad}"
    );
    // Read by a reader as the dedicated user, sandboxed; the daemon holds no capability.
    let readers = larderd_processes_of(reader_uid);
    assert_eq!(readers.len(), 1, "{readers:?}");
    assert_eq!(status_of(readers[0], "CapEff"), "0000000000000000");
    assert_eq!(status_of(readers[0], "NoNewPrivs"), "1");
    assert_eq!(status_of(readers[0], "Seccomp"), "2");
    assert_eq!(status_of(daemon.0.id(), "CapEff"), "0000000000000000");
}

/// The DaemonSet's start, under Kubernetes' semantics: a container started as root with only
/// CAP_SETUID and CAP_SETGID in its bounding set, no inheritable or ambient capabilities, and
/// no new privileges (`allowPrivilegeEscalation: false`). larderd `--user` becomes its own
/// user keeping those two for its launcher, serves a user's own dataset through a reader as
/// her, and holds no capability itself; started as a user other than root the same way (what
/// the manifests did before), it stops and says how to start it.
#[test]
#[ignore = "adds users and groups: needs root (scripts/test runs it as root)"]
fn the_daemonsets_start_as_root_with_two_capabilities_serves_as_its_own_user() {
    assert_eq!(larder::access::euid(), 0, "run as root");
    let mut users = Users::make();
    let alice = users.uid(0);
    let an = users.names[0].clone();
    let (daemon_user, larder) = users.extra("d");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    set_mode(root, 0o755);
    let ahome = root.join("alice");
    own_dir(&ahome, alice, 0o700);
    let own = ahome.join("own.h5");
    make_dataset(&own, 24, &[2, 4, 4]).unwrap();
    own_file(&own, alice, 0o600);
    // The hostPath socket folder and the state folder, the daemon user's.
    let run_dir = root.join("run");
    own_dir(&run_dir, larder, 0o755);
    let (socket, state) = (run_dir.join("larder.sock"), root.join("state"));
    own_dir(&state, larder, 0o700);
    let config = root.join("larder.toml");
    std::fs::write(
        &config,
        format!(
            "unix_socket = {socket:?}\nunix_socket_mode = 0o666\nstate_dir = {state:?}\n\
             [scratch]\nenabled = false\n"
        ),
    )
    .unwrap();
    set_mode(&config, 0o644);
    // What a container runtime gives the container's first process.
    let as_kubernetes = |uid: u32, args: &[&str]| {
        let mut c = Command::new("setpriv");
        c.args([
            &format!("--reuid={uid}"),
            &format!("--regid={}", if uid == 0 { 0 } else { uid }),
            "--clear-groups",
            "--bounding-set=-all,+setuid,+setgid",
            "--inh-caps=-all",
            "--no-new-privs",
            "--",
            env!("CARGO_BIN_EXE_larderd"),
            "--config",
        ])
        .arg(&config)
        .args(args)
        .env_remove("RUST_BACKTRACE");
        c
    };

    // As the manifests ran it before: a user other than root, whose capabilities the exec
    // cleared. It stops, naming the way that works.
    std::fs::write(
        &config,
        format!(
            "unix_socket = {socket:?}\nunix_socket_mode = 0o666\nstate_dir = {state:?}\n\
             reader_user = \"nobody\"\n[scratch]\nenabled = false\n"
        ),
    )
    .unwrap();
    let o = as_kubernetes(larder, &[]).output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("--user"), "{}", text(&o));

    // As the DaemonSet runs it now.
    let child = as_kubernetes(0, &["--user", &daemon_user])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let daemon = Larderd(child);
    let started = Instant::now();
    while !socket.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "larderd did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = daemon.0.id();
    assert_eq!(
        status_of(pid, "Uid").split_whitespace().collect::<Vec<_>>(),
        vec![larder.to_string(); 4]
    );
    assert_eq!(status_of(pid, "CapEff"), "0000000000000000");
    assert_eq!(status_of(pid, "CapPrm"), "0000000000000000");
    assert_eq!(status_of(pid, "NoNewPrivs"), "1");
    // Its launcher: the daemon's user with the two capabilities, nothing else.
    let launchers: Vec<u32> = larderd_processes_of(larder)
        .into_iter()
        .filter(|p| *p != pid)
        .collect();
    assert_eq!(launchers.len(), 1, "{launchers:?}");
    assert_eq!(status_of(launchers[0], "CapEff"), "00000000000000c0");
    assert_eq!(status_of(launchers[0], "CapBnd"), "00000000000000c0");
    assert_eq!(status_of(launchers[0], "NoNewPrivs"), "1");

    let o = larder_as(
        alice,
        &socket,
        &["add", "own", own.to_str().unwrap(), "--labels", "labels"],
    );
    assert!(o.status.success(), "{}", text(&o));
    let mine = format!("{an}/own");
    let o = larder_as(
        alice,
        &socket,
        &[
            "bench",
            &mine,
            "--epochs",
            "1",
            "--batch-size",
            "5",
            "--clients",
            "1",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let out = text(&o);
    assert!(
        out.contains("epoch 0: 24 samples ") && out.contains("exactly once per client: ok"),
        "{out}"
    );
    // Her file was parsed by a reader as her, without any capability.
    let readers = larderd_processes_of(alice);
    assert_eq!(readers.len(), 1, "{readers:?}");
    assert_eq!(status_of(readers[0], "CapEff"), "0000000000000000");
    assert_eq!(status_of(readers[0], "NoNewPrivs"), "1");
    drop(daemon);

    // Started with all of root's (a host, not a container): the launcher keeps the two
    // capabilities and a bounding set of those two alone, so no exec and no switch back to uid
    // 0 regains the rest.
    let child = Command::new(env!("CARGO_BIN_EXE_larderd"))
        .arg("--config")
        .arg(&config)
        .args(["--user", &daemon_user])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let daemon = Larderd(child);
    let started = Instant::now();
    while larderd_processes_of(larder).len() < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "larderd did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let launcher = larderd_processes_of(larder)
        .into_iter()
        .find(|p| *p != daemon.0.id())
        .unwrap();
    // The launcher drops what it does not keep, then sets NO_NEW_PRIVS, as it starts: looked
    // at once it has.
    while status_of(launcher, "NoNewPrivs") != "1" {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the launcher never set NO_NEW_PRIVS"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status_of(launcher, "CapEff"), "00000000000000c0");
    assert_eq!(status_of(launcher, "CapBnd"), "00000000000000c0");
    assert_eq!(status_of(launcher, "NoNewPrivs"), "1");
    assert_eq!(status_of(daemon.0.id(), "CapBnd"), "00000000000000c0");
}
