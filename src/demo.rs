//! `larder demo`: makes a small HDF5 dataset, starts the daemon, runs training clients against it
//! over gRPC and prints throughput and hit rates. Also the synthetic data the tests check against.

use crate::client::{collect_batches, connect};
use crate::config::Config;
use crate::memory::ENTRY_OVERHEAD;
use crate::metrics::format_stats;
use crate::proto::{GetStatsRequest, ListDatasetsRequest, StreamBatchesRequest};
use crate::server::Daemon;
use anyhow::{ensure, Context, Result};
use std::path::Path;
use std::time::Instant;

/// Byte `offset` of synthetic sample `index`: every sample differs, and so does every byte.
pub fn sample_byte(index: u64, offset: usize) -> u8 {
    (index.wrapping_mul(131).wrapping_add(offset as u64 * 7) % 251) as u8
}

pub fn expected_sample(index: u64, len: usize) -> Vec<u8> {
    (0..len).map(|o| sample_byte(index, o)).collect()
}

pub fn expected_label(index: u64) -> i64 {
    (index % 10) as i64
}

/// Writes `n` synthetic uint8 samples of `shape` to `path` as datasets "images" and "labels".
pub fn make_dataset(path: &Path, n: u64, shape: &[usize]) -> Result<()> {
    let len: usize = shape.iter().product();
    let mut data = Vec::with_capacity(n as usize * len);
    for i in 0..n {
        data.extend((0..len).map(|o| sample_byte(i, o)));
    }
    let labels: Vec<i64> = (0..n).map(expected_label).collect();
    let mut full_shape = vec![n as usize];
    full_shape.extend_from_slice(shape);
    crate::source::write_hdf5(
        path,
        "images",
        &full_shape,
        &data,
        Some(("labels", &labels)),
    )
}

pub struct DemoOptions {
    pub samples: u64,
    pub clients: u32,
    pub epochs: u64,
    pub batch_size: u32,
    /// Memory budget as a fraction of the dataset's in-memory size.
    pub cache_fraction: f64,
}

pub async fn run(opts: DemoOptions) -> Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let shape = [3usize, 32, 32];
    let sample_bytes: usize = shape.iter().product();
    let path = dir.path().join("demo.h5");
    make_dataset(&path, opts.samples, &shape)?;
    let budget = (opts.samples as f64
        * (sample_bytes as u64 + ENTRY_OVERHEAD) as f64
        * opts.cache_fraction) as u64;
    println!(
        "demo: {} samples of {:?} uint8 in {} ({} bytes), memory budget {} bytes ({:.0}% of the dataset)",
        opts.samples,
        shape,
        path.display(),
        opts.samples as usize * sample_bytes,
        budget,
        opts.cache_fraction * 100.0
    );
    let config = Config::parse(&format!(
        r#"
        listen = "127.0.0.1:0"
        [scratch]
        dir = {scratch:?}
        [memory]
        budget_bytes = {budget}
        [[dataset]]
        name = "demo"
        path = {path:?}
        samples = "images"
        labels = "labels"
        "#,
        scratch = dir.path().join("scratch"),
        path = path,
    ))?;
    let daemon = Daemon::start(config).await?;
    let addr = daemon.client_addr();
    println!(
        "demo: larderd listening on {addr}; {} clients, {} epochs, batch size {}",
        opts.clients, opts.epochs, opts.batch_size
    );

    run_epochs(&addr, "demo", opts.clients, opts.epochs, opts.batch_size).await?;
    daemon.shutdown().await
}

/// Runs `epochs` epochs of `dataset` with `clients` concurrent training clients (each its own
/// seed, each the whole epoch) against the daemon at `addr`, checking that every client gets
/// every sample exactly once; prints throughput and memory hit rate per epoch, then the stats.
pub async fn run_epochs(
    addr: &str,
    dataset: &str,
    clients: u32,
    epochs: u64,
    batch_size: u32,
) -> Result<()> {
    let mut stats_client = connect(addr).await?;
    let n = stats_client
        .list_datasets(ListDatasetsRequest {})
        .await?
        .into_inner()
        .datasets
        .into_iter()
        .find(|d| d.name == dataset)
        .with_context(|| format!("the daemon does not serve a dataset {dataset:?}"))?
        .num_samples;
    // Hit rates per epoch are differences of the daemon's counters, which earlier clients moved.
    let (mut prev_mem, mut prev_all) = tier_hits(
        &stats_client
            .get_stats(GetStatsRequest {})
            .await?
            .into_inner(),
    );
    for epoch in 0..epochs {
        let started = Instant::now();
        let mut jobs = vec![];
        for c in 0..clients {
            let addr = addr.to_string();
            let req = StreamBatchesRequest {
                dataset: dataset.into(),
                batch_size,
                seed: 1000 + c as u64,
                epoch,
                world_size: 1,
                ..Default::default()
            };
            jobs.push(tokio::spawn(async move {
                let mut client = connect(&addr).await?;
                collect_batches(&mut client, req).await
            }));
        }
        let mut bytes = 0usize;
        for job in jobs {
            let batches = job.await.context("client task panicked")??;
            let mut seen: Vec<u64> = batches.iter().flat_map(|b| b.sample_ids.clone()).collect();
            bytes += batches.iter().map(|b| b.data.len()).sum::<usize>();
            seen.sort_unstable();
            ensure!(
                seen.iter().copied().eq(0..n),
                "a client did not get every sample exactly once"
            );
        }
        let secs = started.elapsed().as_secs_f64();
        let (mem, all) = tier_hits(
            &stats_client
                .get_stats(GetStatsRequest {})
                .await?
                .into_inner(),
        );
        let hit_rate = (mem - prev_mem) as f64 / (all - prev_all).max(1) as f64;
        (prev_mem, prev_all) = (mem, all);
        let samples = n * clients as u64;
        println!(
            "epoch {epoch}: {samples} samples in {secs:.2}s = {:.0} samples/s, {:.1} MB/s; memory hit rate {:.1}%; every sample exactly once per client: ok",
            samples as f64 / secs,
            bytes as f64 / secs / 1e6,
            hit_rate * 100.0
        );
    }
    let stats = stats_client
        .get_stats(GetStatsRequest {})
        .await?
        .into_inner();
    println!("\n{}", format_stats(&stats));
    Ok(())
}

/// (memory-tier hits, all lookups) so far.
fn tier_hits(stats: &crate::proto::Stats) -> (u64, u64) {
    let hits = |tier: &str| {
        stats
            .tiers
            .iter()
            .filter(|t| t.tier == tier)
            .map(|t| t.hits)
            .sum()
    };
    (hits("memory"), stats.tiers.iter().map(|t| t.hits).sum())
}
