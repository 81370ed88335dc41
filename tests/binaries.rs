//! The installed programs: larderd started from a TOML config on a Unix socket, the larder CLI
//! talking to it, a clean exit on SIGTERM, and a clear failure on a bad config.

mod common;

use larder::synthetic::make_dataset;
use std::process::Command;
use std::time::{Duration, Instant};

fn larder(addr: &str, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_larder"))
        .arg("--addr")
        .arg(addr)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A daemon killed when dropped (a failed assertion leaves none behind).
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn larderd_serves_the_cli_over_a_unix_socket_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    make_dataset(&dir.path().join("train.h5"), 64, &[3, 8, 8]).unwrap();
    let socket = dir.path().join("run/larder.sock");
    let config = dir.path().join("larder.toml");
    // And a dataset of typed fields: float32 rows of a NumPy array (`larder bench` plans any).
    let mut npy = b"\x93NUMPY\x01\x00".to_vec();
    let mut header = "{'descr': '<f4', 'fortran_order': False, 'shape': (50, 3), }".to_string();
    header.push_str(&" ".repeat(63 - (10 + header.len()) % 64));
    header.push('\n');
    npy.extend((header.len() as u16).to_le_bytes());
    npy.extend(header.as_bytes());
    npy.extend((0..150).flat_map(|i| (i as f32).to_le_bytes()));
    std::fs::write(dir.path().join("rows.npy"), npy).unwrap();
    std::fs::write(
        &config,
        format!(
            "unix_socket = {socket:?}\n[scratch]\ndir = \"scratch\"\n[memory]\nbudget_bytes = 100000\n\
             [[dataset]]\nname = \"train\"\npath = \"train.h5\"\nlabels = \"labels\"\n\
             [[dataset]]\nname = \"rows\"\npath = \"rows.npy\"\n"
        ),
    )
    .unwrap();
    let mut daemon = Killed(common::spawn_larderd(&config, &socket));
    let started = Instant::now();
    let addr = format!("unix:{}", socket.display());
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "the daemon's user and group may connect");

    // larderd listens first and opens its datasets after: each is listed once open.
    let mut datasets = larder(&addr, &["datasets"]);
    let open = |d: &str| d.contains("train.h5#images") && d.contains("rows.npy");
    while !open(&datasets) && started.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
        datasets = larder(&addr, &["datasets"]);
    }
    assert!(datasets.contains("train"), "{datasets}");
    assert!(datasets.contains("[3, 8, 8]"), "{datasets}");
    assert!(datasets.contains("train.h5#images"), "{datasets}");
    let stats = larder(&addr, &["stats"]);
    // The tier may hold the budget less the message path's share (a quarter of so small a
    // one) and the datasets' footprint (their scratch tier's indexes: 64 and 50 samples of 8
    // bytes).
    assert!(stats.contains("memory tier: 0 of 74088 bytes"), "{stats}");
    assert!(stats.contains("of the 0.1 MiB budget"), "{stats}");
    let warm = larder(&addr, &["warm", "train"]);
    assert!(
        warm.contains(
            "train: 64 samples in the scratch tier (64 preprocessed now, 0 already there)"
        ),
        "{warm}"
    );
    let warm = larder(&addr, &["warm", "train"]);
    assert!(
        warm.contains("(0 preprocessed now, 64 already there)"),
        "{warm}"
    );
    let stats = larder(&addr, &["stats"]);
    assert!(stats.contains("scratch tier: "), "{stats}");
    assert!(
        stats.contains("dataset train: lookups memory 0, scratch 0, raw 0; 0 bad samples"),
        "warming is no lookup: {stats}"
    );
    let bench = larder(
        &addr,
        &["bench", "train", "--epochs", "2", "--batch-size", "16"],
    );
    assert_eq!(
        bench
            .matches("every sample exactly once per client: ok")
            .count(),
        2,
        "{bench}"
    );
    assert!(bench.contains("epoch 1: 128 samples"), "{bench}");
    let typed = larder(
        &addr,
        &[
            "bench",
            "rows",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--clients",
            "1",
        ],
    );
    assert!(
        typed.contains("epoch 0: 50 samples") && typed.contains("exactly once per client: ok"),
        "{typed}"
    );

    let pid = daemon.0.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = daemon.0.wait().unwrap();
    assert!(status.success(), "larderd exited with {status}");
    assert!(!socket.exists(), "the socket is removed on exit");
}

#[test]
fn larderd_fails_clearly_on_a_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("larder.toml");
    // larderd started on `text` as its config: it stops, and says why on stderr.
    let refused = |text: &str| {
        std::fs::write(&config, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_larderd"))
            .arg("--config")
            .arg(&config)
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // A dataset that does not open is left out (tests/hostile.rs); a config that does not
    // parse stops larderd, naming the key.
    let err = refused("listen = \"127.0.0.1:0\"\n[limits]\nmax_image_pixel = 5\n");
    assert!(err.contains("max_image_pixel"), "{err}");
    assert!(err.contains("larder.toml"), "{err}");

    // A socket folder the daemon cannot make: the error names the folder and the key to set.
    std::fs::write(dir.path().join("a-file"), "").unwrap();
    let err = refused(&format!(
        "unix_socket = {:?}\nstate_dir = {:?}\n",
        dir.path().join("a-file/larder.sock"),
        dir.path().join("state")
    ));
    assert!(
        err.contains(&format!("{}", dir.path().join("a-file").display()))
            && err.contains("set unix_socket in the config"),
        "{err}"
    );

    // A scratch tier that cannot be made: the start stops, saying how to fix or turn it off.
    let err = refused(&format!(
        "unix_socket = {:?}\nstate_dir = {:?}\n[scratch]\ndir = {:?}\n",
        dir.path().join("s.sock"),
        dir.path().join("state"),
        dir.path().join("a-file/scratch")
    ));
    assert!(
        err.contains("a-file/scratch") && err.contains("ReadWritePaths"),
        "{err}"
    );

    let out = Command::new(env!("CARGO_BIN_EXE_larder"))
        .args(["--addr", "unix:/nonexistent/larder.sock", "stats"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("connecting to larderd at unix:/nonexistent/larder.sock"),
        "{err}"
    );
}

/// The README's first command, `larder demo` (with fewer samples and epochs): it makes its
/// datasets, starts a daemon, streams them and says every sample came exactly once.
#[test]
fn larder_demo_runs_end_to_end() {
    let out = Command::new(env!("CARGO_BIN_EXE_larder"))
        .args([
            "demo",
            "--samples",
            "512",
            "--clients",
            "2",
            "--epochs",
            "2",
            "--batch-size",
            "32",
        ])
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    assert_eq!(
        said.matches("every sample exactly once per client: ok")
            .count(),
        2,
        "{said}"
    );
    assert!(said.contains("epoch 1: 1024 samples"), "{said}");
    // The super-resolution pairs and the segmentation folder, one epoch each.
    assert_eq!(
        said.matches("one epoch, every sample exactly once: ok")
            .count(),
        2,
        "{said}"
    );
}

/// The manual pages: made from the same definitions as `--help` (and docs/config.md), each
/// long option of a command in its page, and rendered by man(1) without a warning where it
/// is installed.
#[test]
fn the_manual_pages_hold_what_help_says() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_larder"))
        .arg("man")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_larderd"))
        .arg("--man")
        .output()
        .unwrap();
    assert!(out.status.success());
    std::fs::write(dir.path().join("larderd.8"), &out.stdout).unwrap();
    for (page, help) in [
        ("larder-add.1", vec!["add", "--help"]),
        ("larder-bench.1", vec!["bench", "--help"]),
        ("larderd.8", vec!["--help"]),
    ] {
        let bin = if page == "larderd.8" {
            env!("CARGO_BIN_EXE_larderd")
        } else {
            env!("CARGO_BIN_EXE_larder")
        };
        let help = Command::new(bin).args(&help).output().unwrap();
        let help = String::from_utf8_lossy(&help.stdout).to_string();
        let roff = std::fs::read_to_string(dir.path().join(page)).unwrap();
        let options: Vec<&str> = help
            .split_whitespace()
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .map(|w| w.trim_end_matches(|c: char| !c.is_alphanumeric()))
            .collect();
        assert!(!options.is_empty(), "{help}");
        for o in options {
            assert!(roff.contains(&o.replace('-', "\\-")), "{page}: {o}");
        }
    }
    let config = std::fs::read_to_string(dir.path().join("larder.toml.5")).unwrap();
    assert!(config.contains("\\fBreader_user\\fR"), "{config}");
    let man = Command::new("man").arg("--version").output();
    if man.is_ok_and(|o| o.status.success()) {
        for page in ["larder.1", "larder-add.1", "larderd.8", "larder.toml.5"] {
            let out = Command::new("man")
                .args(["--warnings", "-l"])
                .arg(dir.path().join(page))
                .env("MANWIDTH", "80")
                .output()
                .unwrap();
            assert!(out.status.success(), "{page}");
            let warned = String::from_utf8_lossy(&out.stderr);
            assert!(warned.trim().is_empty(), "{page}: {warned}");
        }
    }
}
