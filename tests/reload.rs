//! Datasets while larderd runs: one that does not open is served once it can be, a SIGHUP
//! reload adds and removes datasets while a stream runs to its end unharmed, and a file
//! replaced under the daemon is served as it is now, never as it was.

mod common;

use larder::client::{collect_batches, connect, Client};
use larder::proto::StreamBatchesRequest;
use larder::synthetic::make_dataset;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};
use tonic::Code;

struct Larderd {
    child: Child,
    socket: PathBuf,
}

impl Drop for Larderd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Larderd {
    async fn client(&self) -> Client {
        connect(&format!("unix:{}", self.socket.display()))
            .await
            .unwrap()
    }

    fn hangup(&self) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success());
    }
}

fn write_config(dir: &Path, names: &[&str]) {
    let mut text = format!(
        "unix_socket = {:?}\n[scratch]\nenabled = false\n",
        dir.join("larder.sock")
    );
    for n in names {
        text += &format!("[[dataset]]\nname = \"{n}\"\npath = \"{n}.h5\"\nlabels = \"labels\"\n");
    }
    std::fs::write(dir.join("larder.toml"), text).unwrap();
}

fn start(dir: &Path) -> Larderd {
    let socket = dir.join("larder.sock");
    let child = common::spawn_larderd(&dir.join("larder.toml"), &socket);
    Larderd { child, socket }
}

fn req(name: &str, batch_size: u32) -> StreamBatchesRequest {
    StreamBatchesRequest {
        dataset: name.into(),
        batch_size,
        world_size: 1,
        ..Default::default()
    }
}

/// Streams dataset `name` until it serves (up to `within`); its batches.
async fn served_within(d: &Larderd, name: &str, within: Duration) -> Vec<larder::proto::Batch> {
    let started = Instant::now();
    loop {
        match collect_batches(&mut d.client().await, req(name, 10)).await {
            Ok(b) => return b,
            Err(e) if started.elapsed() < within => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{name} not served after {within:?}: {e:#}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datasets_come_and_go_while_streams_run() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    make_dataset(&p.join("a.h5"), 300, &[2, 4, 4]).unwrap();
    write_config(p, &["a", "b"]);
    let d = start(p);

    // b's file is missing: reported, then served once it appears.
    // larderd listens first and opens its datasets after: wait for "a" to be served.
    common::check_epoch(&served_within(&d, "a", Duration::from_secs(20)).await, 300);
    let status = d
        .client()
        .await
        .stream_batches(req("b", 10))
        .await
        .expect_err("b does not open");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(status.message().contains("b.h5"), "{status:?}");
    // The admin sees it listed, with why.
    let listed = Command::new(env!("CARGO_BIN_EXE_larder"))
        .arg("--addr")
        .arg(format!("unix:{}", d.socket.display()))
        .arg("datasets")
        .output()
        .unwrap();
    let listed = String::from_utf8_lossy(&listed.stdout);
    let line = listed
        .lines()
        .find(|l| l.starts_with("b "))
        .unwrap_or_default();
    assert!(
        line.contains("unavailable: ") && line.contains("b.h5"),
        "{listed}"
    );
    make_dataset(&p.join("b.h5"), 50, &[2, 4, 4]).unwrap();
    common::check_epoch(&served_within(&d, "b", Duration::from_secs(25)).await, 50);

    // A stream of a runs while a reload removes a and adds c: it ends whole.
    let mut slow = d.client().await;
    let mut stream = slow.stream_batches(req("a", 1)).await.unwrap().into_inner();
    let mut got = vec![stream.message().await.unwrap().unwrap()];
    make_dataset(&p.join("c.h5"), 30, &[2, 4, 4]).unwrap();
    write_config(p, &["b", "c"]);
    d.hangup();
    common::check_epoch(&served_within(&d, "c", Duration::from_secs(10)).await, 30);
    while let Some(b) = stream.message().await.unwrap() {
        got.push(b);
    }
    common::check_epoch(&got, 300);
    let status = d
        .client()
        .await
        .stream_batches(req("a", 10))
        .await
        .expect_err("a is gone");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");

    // b replaced by a file of 70 samples: served as it is now, never the 50 of before.
    make_dataset(&p.join("b.new.h5"), 70, &[2, 4, 4]).unwrap();
    std::fs::rename(p.join("b.new.h5"), p.join("b.h5")).unwrap();
    let started = Instant::now();
    loop {
        match collect_batches(&mut d.client().await, req("b", 10)).await {
            Ok(b) if common::ids(&b).len() == 70 => {
                common::check_epoch(&b, 70);
                break;
            }
            Ok(b) => panic!("served {} samples of the old file", common::ids(&b).len()),
            Err(e) => {
                assert!(
                    format!("{e:#}").contains("changed since the daemon opened it"),
                    "{e:#}"
                );
                assert!(started.elapsed() < Duration::from_secs(25), "not reopened");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_folder_that_gains_and_loses_files_is_served_as_it_is_now() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let cls = p.join("pics/cls");
    std::fs::create_dir_all(&cls).unwrap();
    let image = |name: &str, shade: u8| {
        image::RgbImage::from_pixel(8, 8, image::Rgb([shade, 0, 0]))
            .save(cls.join(name))
            .unwrap()
    };
    for k in 0..4 {
        image(&format!("{k}.png"), k * 10);
    }
    std::fs::write(
        p.join("larder.toml"),
        format!(
            "unix_socket = {:?}\n[scratch]\nenabled = false\n[[dataset]]\nname = \"pics\"\n\
             kind = \"images\"\npath = \"pics\"\nresize = 8\ncrop = 8\n",
            p.join("larder.sock")
        ),
    )
    .unwrap();
    let d = start(p);
    assert_eq!(pics_epoch(&d).await, vec![0, 10, 20, 30]);
    image("4.png", 40);
    image("5.png", 50);
    std::fs::remove_file(cls.join("1.png")).unwrap();
    // The next epoch: exactly the files there now, at once (the folder is walked again).
    assert_eq!(pics_epoch(&d).await, vec![0, 20, 30, 40, 50]);
}

/// The red of each sample of an epoch of "pics", sorted: which files the epoch held.
async fn pics_epoch(d: &Larderd) -> Vec<u8> {
    let req = StreamBatchesRequest {
        fields: vec!["image".into()],
        layout_version: 1,
        ..req("pics", 2)
    };
    let b = collect_batches(&mut d.client().await, req).await.unwrap();
    let mut reds: Vec<u8> = b
        .iter()
        .flat_map(|b| {
            b.fields[0]
                .data
                .chunks(3 * 64)
                .map(|s| s[0])
                .collect::<Vec<_>>()
        })
        .collect();
    reds.sort_unstable();
    reds
}
