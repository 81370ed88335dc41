//! End-to-end tests: a real HDF5 file, a real daemon on a free port, real gRPC clients.

mod common;

use common::{bytes_read, check_contents, check_epoch, hits, ids, SAMPLE_BYTES, SHAPE};
use larder::client::{collect_batches, connect, Client};
use larder::config::Config;
use larder::proto::{Batch, ListDatasetsRequest, Stats, StreamBatchesRequest};
use larder::server::Daemon;
use larder::source::MAX_GRANULE;
use larder::synthetic::make_dataset;
use larder::tiers::memory::cost_of;
use std::collections::HashSet;
use std::time::Duration;
use tonic::Code;

struct Fixture {
    daemon: Daemon,
    _dir: tempfile::TempDir,
}

impl Fixture {
    async fn start(n: u64, budget: u64) -> Fixture {
        Fixture::start_with(n, &format!("budget_bytes = {budget}")).await
    }

    async fn start_with(n: u64, memory: &str) -> Fixture {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_env("LARDER_LOG"))
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.h5");
        make_dataset(&path, n, &SHAPE).unwrap();
        let config = Config::parse(&format!(
            r#"
            listen = "127.0.0.1:0"
            max_batch_size = 1000
            [scratch]
            dir = {scratch:?}
            [memory]
            {memory}
            watch_interval_ms = 20
            [[dataset]]
            name = "train"
            tcp = true
            path = {path:?}
            labels = "labels"
            "#,
            scratch = dir.path().join("scratch"),
        ))
        .unwrap();
        let daemon = Daemon::start(config).await.unwrap();
        Fixture { daemon, _dir: dir }
    }

    async fn client(&self) -> Client {
        connect(&self.daemon.client_addr()).await.unwrap()
    }

    async fn stats(&self) -> Stats {
        common::stats(&self.daemon).await
    }
}

fn req(batch_size: u32, seed: u64, epoch: u64) -> StreamBatchesRequest {
    StreamBatchesRequest {
        dataset: "train".into(),
        batch_size,
        seed,
        epoch,
        world_size: 1,
        ..Default::default()
    }
}

async fn epoch(f: &Fixture, r: StreamBatchesRequest) -> Vec<Batch> {
    collect_batches(&mut f.client().await, r).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_each_get_every_sample_exactly_once() {
    let f = Fixture::start(500, 1 << 30).await;
    let mut jobs = vec![];
    for seed in 0..3u64 {
        let addr = f.daemon.client_addr();
        jobs.push(tokio::spawn(async move {
            collect_batches(&mut connect(&addr).await.unwrap(), req(7, seed, 0))
                .await
                .unwrap()
        }));
    }
    let mut orders = vec![];
    for job in jobs {
        let batches = job.await.unwrap();
        assert_eq!(batches.len(), 72, "ceil(500 / 7)");
        assert_eq!(batches.last().unwrap().sample_ids.len(), 500 % 7);
        for (i, b) in batches.iter().enumerate() {
            assert_eq!((b.batch_index, b.num_batches), (i as u64, 72));
        }
        check_epoch(&batches, 500);
        orders.push(ids(&batches));
    }
    assert_ne!(orders[0], orders[1], "different seeds shuffle differently");
    assert_ne!(orders[0], (0..500).collect::<Vec<_>>(), "shuffled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_is_a_function_of_seed_and_epoch() {
    let f = Fixture::start(200, 1 << 30).await;
    let a = ids(&epoch(&f, req(16, 5, 0)).await);
    assert_eq!(a, ids(&epoch(&f, req(16, 5, 0)).await));
    assert_ne!(a, ids(&epoch(&f, req(16, 5, 1)).await));
    let sequential = StreamBatchesRequest {
        sequential: true,
        ..req(16, 5, 0)
    };
    assert_eq!(
        ids(&epoch(&f, sequential).await),
        (0..200).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_shard_the_epoch_without_overlap() {
    let f = Fixture::start(1003, 1 << 30).await;
    let world_size = 4;
    let mut jobs = vec![];
    for rank in 0..world_size {
        let addr = f.daemon.client_addr();
        let r = StreamBatchesRequest {
            rank,
            world_size,
            ..req(10, 9, 3)
        };
        jobs.push(tokio::spawn(async move {
            collect_batches(&mut connect(&addr).await.unwrap(), r)
                .await
                .unwrap()
        }));
    }
    let mut seen = HashSet::new();
    for job in jobs {
        let batches = job.await.unwrap();
        check_contents(&batches);
        let shard = ids(&batches);
        // Rounds of one batch per rank; the 3 left over go to rank 0.
        assert!((250..=253).contains(&shard.len()), "{}", shard.len());
        for id in shard {
            assert!(seen.insert(id), "sample {id} served to two ranks");
        }
    }
    assert_eq!(seen.len(), 1003);
    // even_batches: every rank the same number of batches, so a DDP loop never waits on a rank
    // that has run out; the short last round is padded, like DistributedSampler.
    let mut client = f.client().await;
    let mut seen = HashSet::new();
    for rank in 0..world_size {
        let r = StreamBatchesRequest {
            rank,
            world_size,
            even_batches: true,
            ..req(10, 9, 3)
        };
        let batches = collect_batches(&mut client, r).await.unwrap();
        check_contents(&batches);
        assert_eq!(batches.len(), 26, "25 full rounds and one of batches of 1");
        assert_eq!(batches.last().unwrap().sample_ids.len(), 1);
        assert_eq!(batches.last().unwrap().resume_sample, 1003);
        seen.extend(ids(&batches));
    }
    assert_eq!(seen.len(), 1003, "every sample, one of them twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_mid_epoch_serves_exactly_the_rest() {
    let f = Fixture::start(300, 1 << 30).await;
    let full = epoch(&f, req(8, 11, 2)).await;
    let resumed = epoch(
        &f,
        StreamBatchesRequest {
            start_batch: 20,
            ..req(8, 11, 2)
        },
    )
    .await;
    assert_eq!(resumed.len(), full.len() - 20);
    for (a, b) in full[20..].iter().zip(&resumed) {
        assert_ne!(a.stream_id, b.stream_id, "two streams");
        let b = larder::proto::Batch {
            stream_id: a.stream_id,
            ..b.clone()
        };
        assert_eq!(*a, b, "same batch index, ids, labels and bytes");
    }
    let mut together = ids(&full[..20]);
    together.extend(ids(&resumed));
    together.sort_unstable();
    assert_eq!(together, (0..300).collect::<Vec<_>>());
    // Resuming at the very end is an empty, successful stream.
    let end = epoch(
        &f,
        StreamBatchesRequest {
            start_batch: full.len() as u64,
            ..req(8, 11, 2)
        },
    )
    .await;
    assert!(end.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_tier_stays_within_its_budget_and_keeps_its_working_set() {
    let n = 1000u64;
    // A quarter of the samples (each its image and its int64 label, charged by its
    // allocation), and on top the message path's share and what the dataset and a stream
    // take outside the cache: the scratch tier's index, the stream's plan and its order.
    let tier = 250 * cost_of(SAMPLE_BYTES + 8);
    let share = 1 << 20;
    // (The daemon's streams name no order form: form 1, listed.)
    let plan = larder::sampler::Plan::bytes_for(&larder::sampler::PlanRequest::epoch(n, 25, 1, 0));
    // Building each epoch's plan takes 8 bytes a sample more, while it is built: the tier
    // gives that up then (and keeps a quarter of the samples still).
    let building = 8 * n;
    let budget = tier + share + 8 * n + plan + 4 * n + building;
    let f = Fixture::start_with(
        n,
        &format!("budget_bytes = {budget}\nmessage_bytes = {share}"),
    )
    .await;
    let mut before = f.stats().await;
    for e in 0..3 {
        let batches = epoch(&f, req(25, 1, e)).await;
        check_contents(&batches);
        let s = f.stats().await;
        assert!(
            s.memory_bytes <= tier + building,
            "{} > {}",
            s.memory_bytes,
            tier + building
        );
        // The limit: the budget less the message path's share, the streams' futures the
        // policy keeps (the epoch just served waits for its next one) and what the dataset and
        // streams take outside the cache (the scratch tier's index, the open plans).
        assert_eq!(s.message_budget_bytes, share);
        assert_eq!(
            s.memory_budget_bytes,
            budget - s.message_budget_bytes - s.memory_policy_bytes - s.footprint_bytes
        );
        assert!(
            s.footprint_bytes >= 8 * n,
            "the scratch index: {}",
            s.footprint_bytes
        );
        assert!(
            s.memory_policy_bytes < 3 * 8 * n,
            "{}",
            s.memory_policy_bytes
        );
        if e > 0 {
            let mem = hits(&s, "memory") - hits(&before, "memory");
            let rate = mem as f64 / n as f64;
            // A quarter of the dataset fits: the optimum is 25%, plain LRU would get ~5%.
            assert!(rate > 0.2, "epoch {e}: hit rate {rate}");
        }
        before = s;
    }
    assert_eq!(before.samples_served, 3 * n);
    assert_eq!(
        hits(&before, "memory") + hits(&before, "scratch") + hits(&before, "raw"),
        3 * n,
        "every lookup is counted in exactly one tier"
    );
    // A sample is its image and its int64 label.
    let record = SAMPLE_BYTES as u64 + 8;
    assert_eq!(
        bytes_read(&before, "raw"),
        n * record,
        "raw storage is read once; scratch serves the rest"
    );
    let expansion = before.measured_expansion_factor;
    let expected = cost_of(record as usize) as f64 / record as f64;
    assert!(
        (expansion - expected).abs() < 0.01,
        "{expansion} vs {expected}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gives_memory_back_when_the_machine_is_short() {
    // A floor above the machine's total memory: the machine always looks short.
    let f = Fixture::start_with(
        200,
        "budget_bytes = 1000000\nmin_available_bytes = 18446744073709551615",
    )
    .await;
    let batches = epoch(&f, req(20, 1, 0)).await;
    check_contents(&batches);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = f.stats().await;
    assert_eq!(
        s.memory_bytes, 0,
        "the tier holds nothing while memory is short"
    );
    assert_eq!(s.memory_budget_bytes, 0);
    assert_eq!(s.samples_served, 200, "and still serves, from raw storage");
    assert!(s.machine_available_bytes > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_asking_for_the_same_samples_share_one_fetch() {
    let f = Fixture::start(400, 1 << 30).await;
    let mut jobs = vec![];
    for _ in 0..4 {
        let addr = f.daemon.client_addr();
        jobs.push(tokio::spawn(async move {
            collect_batches(&mut connect(&addr).await.unwrap(), req(16, 3, 0))
                .await
                .unwrap()
        }));
    }
    for job in jobs {
        check_contents(&job.await.unwrap());
    }
    let s = f.stats().await;
    assert_eq!(
        bytes_read(&s, "raw"),
        400 * (SAMPLE_BYTES as u64 + 8),
        "each sample (image and label) read from raw storage once"
    );
    // Misses read whole granules (aligned ranges) and fill the scratch tier with them: raw
    // storage was read once per granule, and the granules' other samples came from scratch.
    assert_eq!(hits(&s, "raw"), 400u64.div_ceil(MAX_GRANULE));
    assert_eq!(s.samples_served, 1600);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_the_daemon_keeps_serving() {
    let f = Fixture::start(50, 1 << 30).await;
    let mut c = f.client().await;
    let cases = [
        (
            StreamBatchesRequest {
                dataset: "nope".into(),
                ..req(4, 0, 0)
            },
            Code::NotFound,
            "unknown dataset \"nope\"; `larder datasets` lists those you may read",
        ),
        (
            req(0, 0, 0),
            Code::InvalidArgument,
            "batch_size must be at least 1",
        ),
        (req(5000, 0, 0), Code::InvalidArgument, "max_batch_size"),
        (
            StreamBatchesRequest {
                rank: 2,
                world_size: 2,
                ..req(4, 0, 0)
            },
            Code::InvalidArgument,
            "rank 2 is out of range",
        ),
        (
            StreamBatchesRequest {
                start_batch: 14,
                ..req(4, 0, 0)
            },
            Code::InvalidArgument,
            "past the end of the epoch",
        ),
        // A 100 KB name is quoted short, not copied whole into a status larger than gRPC's
        // metadata limit (which came back as RESOURCE_EXHAUSTED).
        (
            StreamBatchesRequest {
                dataset: "x".repeat(100_000),
                ..req(4, 0, 0)
            },
            Code::NotFound,
            "(100000 bytes); `larder datasets` lists",
        ),
        (
            StreamBatchesRequest {
                pipeline: "p".repeat(100_000),
                ..req(4, 0, 0)
            },
            Code::InvalidArgument,
            "(100000 bytes) is unknown",
        ),
        (
            StreamBatchesRequest {
                fields: vec!["f".repeat(100_000)],
                ..req(4, 0, 0)
            },
            Code::InvalidArgument,
            "(100000 bytes); the dataset's fields are",
        ),
    ];
    for (r, code, text) in cases {
        let status = c.stream_batches(r).await.expect_err("an error status");
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(text), "{}", status.message());
    }
    let batches = epoch(&f, req(4, 0, 0)).await;
    assert_eq!(ids(&batches).len(), 50);
    let list = c
        .list_datasets(ListDatasetsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.datasets.len(), 1);
    let d = &list.datasets[0];
    assert_eq!(
        (d.num_samples, d.sample_bytes, d.has_labels),
        (50, 40, true)
    );
    assert_eq!(d.sample_shape, vec![2, 4, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_epoch_does_not_hurt_the_others() {
    let f = Fixture::start(2000, 1 << 30).await;
    let mut c = f.client().await;
    let mut stream = c.stream_batches(req(10, 0, 0)).await.unwrap().into_inner();
    stream.message().await.unwrap().unwrap();
    stream.message().await.unwrap().unwrap();
    drop(stream);
    drop(c);
    let batches = epoch(&f, req(100, 1, 0)).await;
    assert_eq!(ids(&batches).len(), 2000);
    for _ in 0..100 {
        if f.stats().await.active_streams == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the abandoned stream was never closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutting_down_ends_open_streams_with_unavailable() {
    let f = Fixture::start(5000, 1 << 30).await;
    let mut c = f.client().await;
    let mut stream = c.stream_batches(req(10, 0, 0)).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.batch_index, 0);
    let Fixture { daemon, _dir } = f;
    let stopping = tokio::spawn(daemon.shutdown());
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended as if the epoch were complete"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("resume"), "{}", status.message());
    drop(stream);
    drop(c);
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("the daemon stops promptly")
        .unwrap()
        .unwrap();
}
