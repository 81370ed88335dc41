//! Helpers the integration tests share: the synthetic HDF5 dataset `larder::demo` writes, and
//! checks of what the daemon served from it.
#![allow(dead_code)] // each test binary uses its own subset

use larder::client::connect;
use larder::proto::{Batch, GetStatsRequest, Stats};
use larder::server::Daemon;
use larder::synthetic::{expected_label, expected_sample};

pub const SHAPE: [usize; 3] = [2, 4, 4];
pub const SAMPLE_BYTES: usize = 32;

pub async fn stats(d: &Daemon) -> Stats {
    let mut c = connect(&d.client_addr()).await.unwrap();
    c.get_stats(GetStatsRequest {}).await.unwrap().into_inner()
}

pub fn hits(s: &Stats, tier: &str) -> u64 {
    s.tiers.iter().find(|t| t.tier == tier).unwrap().hits
}

pub fn bytes_read(s: &Stats, tier: &str) -> u64 {
    s.tiers.iter().find(|t| t.tier == tier).unwrap().bytes
}

pub fn ids(batches: &[Batch]) -> Vec<u64> {
    batches.iter().flat_map(|b| b.sample_ids.clone()).collect()
}

/// Every sample's bytes and label are the ones in the HDF5 file, and the shape is [B, 2, 4, 4].
pub fn check_contents(batches: &[Batch]) {
    for b in batches {
        let n = b.sample_ids.len();
        assert_eq!(b.shape, vec![n as u32, 2, 4, 4]);
        assert_eq!(b.data.len(), n * SAMPLE_BYTES);
        for (k, &id) in b.sample_ids.iter().enumerate() {
            let got = &b.data[k * SAMPLE_BYTES..(k + 1) * SAMPLE_BYTES];
            assert_eq!(got, &expected_sample(id, SAMPLE_BYTES)[..], "sample {id}");
            assert_eq!(b.labels[k], expected_label(id));
        }
    }
}

/// Every sample of an `n`-sample dataset exactly once, with its bytes and label.
pub fn check_epoch(batches: &[Batch], n: u64) {
    check_contents(batches);
    let mut ids = ids(batches);
    ids.sort_unstable();
    assert_eq!(ids, (0..n).collect::<Vec<_>>());
}

/// larderd, the installed program, started on `config` (its log dropped); returns once it has
/// made its Unix socket `socket` (at most 20 s).
pub fn spawn_larderd(config: &std::path::Path, socket: &std::path::Path) -> std::process::Child {
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_larderd"))
        .arg("--config")
        .arg(config)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !socket.exists() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "larderd did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child
}
