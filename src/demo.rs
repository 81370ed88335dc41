//! `larder demo`: makes a small HDF5 dataset, starts the daemon, runs training clients against it
//! over gRPC and prints throughput and hit rates (its data: `synthetic`).

use crate::cli_text::format_stats;
use crate::client::{collect_batches, connect};
use crate::config::Config;
use crate::proto::{GetStatsRequest, ListDatasetsRequest, StreamBatchesRequest};
use crate::server::Daemon;
use crate::synthetic::{make_dataset, make_segmentation, make_super_resolution};
use crate::tiers::memory::cost_of;
use anyhow::{ensure, Context, Result};
use std::path::Path;
use std::time::Instant;

/// Fields as one line, e.g. `lr uint8 [3, 16, 16], hr uint8 [3, 64, 64] (pairs with lr x4)`.
pub fn describe_fields(fields: &[crate::proto::FieldInfo]) -> String {
    fields
        .iter()
        .map(|f| {
            let dims: Vec<String> = f
                .shape
                .iter()
                .map(|&d| if d < 0 { "*".into() } else { d.to_string() })
                .collect();
            let pair = if f.paired_with.is_empty() {
                String::new()
            } else {
                format!(
                    " (pairs with {} x{}, {})",
                    f.paired_with, f.scale, f.resample
                )
            };
            format!("{} {} [{}]{pair}", f.name, f.dtype, dims.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

pub struct DemoOptions {
    pub samples: u64,
    pub clients: u32,
    pub epochs: u64,
    pub batch_size: u32,
    /// Memory budget as a fraction of the dataset's in-memory size.
    pub cache_fraction: f64,
}

/// The message path's share of the demo daemon's memory budget.
const MESSAGE_BYTES: u64 = 16 << 20;

/// The demo's config: the classification set, a super-resolution pair and a segmentation
/// folder, on a TCP port the system picks.
fn demo_config(dir: &Path, path: &Path, sr: &Path, seg: &Path, budget: u64) -> Result<Config> {
    // The tier gets `budget`; the message path's share comes on top of it.
    let with_messages = budget + MESSAGE_BYTES;
    Config::parse(&format!(
        r#"
        listen = "127.0.0.1:0"
        [scratch]
        dir = {scratch:?}
        [memory]
        budget_bytes = {with_messages}
        message_bytes = {MESSAGE_BYTES}
        [[dataset]]
        name = "demo"
        tcp = true
        path = {path:?}
        samples = "images"
        labels = "labels"

        # Super-resolution: low-res inputs and high-res targets, paired at scale 4.
        [[dataset]]
        name = "sr"
        tcp = true
        path = {sr:?}
        [[dataset.field]]
        name = "lr"
        [[dataset.field]]
        name = "hr"
        pair = {{ with = "lr", scale = 4 }}

        # Segmentation: images/ and masks/ matched by file name; masks keep their class ids.
        [[dataset]]
        name = "seg"
        tcp = true
        kind = "images"
        path = {seg:?}
        resize = 32
        crop = 32
        [[dataset.field]]
        name = "image"
        folder = "images"
        [[dataset.field]]
        name = "mask"
        folder = "masks"
        mode = "index"
        "#,
        scratch = dir.join("scratch"),
        path = path,
    ))
}

pub async fn run(opts: DemoOptions) -> Result<()> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let shape = [3usize, 32, 32];
    let sample_bytes: usize = shape.iter().product();
    let path = dir.path().join("demo.h5");
    make_dataset(&path, opts.samples, &shape)?;
    // A sample's record is its image and its label.
    let budget =
        (opts.samples as f64 * cost_of(sample_bytes + 8) as f64 * opts.cache_fraction) as u64;
    println!(
        "demo: {} samples of {:?} uint8 in {} ({} bytes), memory budget {} bytes ({:.0}% of the dataset)",
        opts.samples,
        shape,
        path.display(),
        opts.samples as usize * sample_bytes,
        budget,
        opts.cache_fraction * 100.0
    );
    let sr = dir.path().join("sr.h5");
    make_super_resolution(&sr, 256)?;
    let seg = dir.path().join("seg");
    make_segmentation(&seg, 64)?;
    let config = demo_config(dir.path(), &path, &sr, &seg, budget)?;
    let daemon = Daemon::start(config).await?;
    let addr = daemon.client_addr();
    println!(
        "demo: larderd listening on {addr}; {} clients, {} epochs, batch size {}",
        opts.clients, opts.epochs, opts.batch_size
    );

    let mut client = connect(&addr).await?;
    let list = client
        .list_datasets(ListDatasetsRequest {})
        .await?
        .into_inner();
    println!("demo: datasets served:");
    for d in &list.datasets {
        println!(
            "  {:<6} {:>6} samples: {}",
            d.name,
            d.num_samples,
            describe_fields(&d.fields)
        );
    }
    println!(
        "\ndemo: classification, {} concurrent clients (the memory tier holds {:.0}% of it):",
        opts.clients,
        opts.cache_fraction * 100.0
    );
    run_epochs(&addr, "demo", opts.clients, opts.epochs, opts.batch_size).await?;
    for d in list.datasets.iter().filter(|d| d.name != "demo") {
        show_one_epoch(&mut client, d).await?;
    }
    daemon.shutdown().await
}

/// Streams one epoch of dataset `d`, checks every sample came once, and shows a batch's fields.
async fn show_one_epoch(
    client: &mut crate::proto::larder_client::LarderClient<tonic::transport::Channel>,
    d: &crate::proto::DatasetInfo,
) -> Result<()> {
    let req = StreamBatchesRequest {
        dataset: d.name.clone(),
        batch_size: 16,
        layout_version: 1,
        ..Default::default()
    };
    let batches = collect_batches(client, req).await?;
    let mut seen: Vec<u64> = batches.iter().flat_map(|b| b.sample_ids.clone()).collect();
    seen.sort_unstable();
    ensure!(
        seen.iter().copied().eq(0..d.num_samples),
        "{}: not every sample exactly once",
        d.name
    );
    println!(
        "\ndemo: {}, one epoch, every sample exactly once: ok; a batch holds",
        d.name
    );
    for f in &batches[0].fields {
        println!("  {:<6} {:<8} {:?}", f.name, f.dtype, f.shape);
    }
    Ok(())
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
    // The dataset's size, from the daemon's plan of a whole epoch: its error, if any, says
    // why the dataset is not for this user (not served, not readable by them, not open yet).
    let whole = StreamBatchesRequest {
        dataset: dataset.into(),
        batch_size: 1,
        world_size: 1,
        // Typed fields: any dataset's plan, not only one of a uint8 array and a label.
        layout_version: 1,
        // The computed order: a plan of any size costs the daemon a few bytes.
        order_version: 2,
        ..Default::default()
    };
    let started = Instant::now();
    let n = loop {
        match stats_client.plan_stream(whole.clone()).await {
            Ok(plan) => break plan.into_inner().num_samples,
            Err(s) if crate::client::being_opened(&s) && started.elapsed().as_secs() < 60 => {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(s) => return Err(anyhow::Error::new(s).context(format!("dataset {dataset:?}"))),
        }
    };
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
                layout_version: 1,
                // The computed order: a stream starts in the same time at any size.
                order_version: 2,
                ..Default::default()
            };
            jobs.push(tokio::spawn(async move {
                let mut client = connect(&addr).await?;
                collect_batches(&mut client, req).await
            }));
        }
        let mut bytes = 0usize;
        let mut delivered = 0u64;
        let mut bad = None;
        for job in jobs {
            let batches = job.await.context("client task panicked")??;
            let mut seen: Vec<u64> = batches.iter().flat_map(|b| b.sample_ids.clone()).collect();
            bytes += batches
                .iter()
                .flat_map(|b| &b.fields)
                .map(|f| f.data.len())
                .sum::<usize>();
            seen.sort_unstable();
            delivered += seen.len() as u64;
            if !seen.iter().copied().eq(0..n) {
                // Samples whose files do not read or decode are skipped: every other one once.
                let skipped = match &bad {
                    Some(b) => b,
                    None => bad.insert(bad_samples(&mut stats_client, dataset).await?),
                };
                ensure!(
                    seen.iter()
                        .copied()
                        .eq((0..n).filter(|i| !skipped.contains(i))),
                    "a client did not get every sample exactly once"
                );
            }
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
        let samples = delivered;
        let skipped = bad.map_or(String::new(), |b| {
            format!(" ({} bad samples skipped)", b.len())
        });
        println!(
            "epoch {epoch}: {samples} samples{skipped} in {secs:.2}s = {:.0} samples/s, {:.1} MB/s; memory hit rate {:.1}%; every sample exactly once per client: ok",
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

/// The samples of `dataset` the daemon skips as bad.
async fn bad_samples(client: &mut crate::client::Client, dataset: &str) -> Result<Vec<u64>> {
    let list = client
        .list_bad_samples(crate::proto::ListBadSamplesRequest {
            dataset: dataset.into(),
        })
        .await?
        .into_inner();
    Ok(list.samples.iter().map(|s| s.index).collect())
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
