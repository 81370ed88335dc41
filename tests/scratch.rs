//! The scratch tier end to end: warming with progress, restarts, resuming, corrupt and truncated
//! records, a full budget, a full disk, and image folders preprocessed on the worker pool.

mod common;

use common::{bytes_read, check_epoch, hits, stats, SAMPLE_BYTES, SHAPE};
use larder::client::{collect_batches, connect};
use larder::config::Config;
use larder::fields::Value;
use larder::fields::{DType, FieldSpec, Resample};
use larder::pipeline::{Crop, FieldOp, Pipeline, Preprocess, Resize, Spatial};
use larder::proto::{Batch, StreamBatchesRequest, WarmProgress, WarmRequest};
use larder::server::Daemon;
use larder::synthetic::make_dataset;
use std::os::unix::fs::FileExt;
use std::path::Path;
use tonic::Code;

/// A daemon serving the HDF5 file `dir/train.h5` with its scratch tier in `scratch`.
async fn start(dir: &Path, scratch: &Path, scratch_extra: &str, memory_budget: u64) -> Daemon {
    let config = Config::parse(&format!(
        r#"
        listen = "127.0.0.1:0"
        [scratch]
        dir = {scratch:?}
        shard_bytes = 8192
        {scratch_extra}
        [memory]
        budget_bytes = {memory_budget}
        [[dataset]]
        name = "train"
        tcp = true
        path = {path:?}
        labels = "labels"
        "#,
        path = dir.join("train.h5"),
    ))
    .unwrap();
    Daemon::start(config).await.unwrap()
}

fn dataset(n: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    make_dataset(&dir.path().join("train.h5"), n, &SHAPE).unwrap();
    dir
}

async fn warm(d: &Daemon) -> Result<Vec<WarmProgress>, tonic::Status> {
    let mut c = connect(&d.client_addr()).await.unwrap();
    let mut stream = c
        .warm(WarmRequest {
            dataset: "train".into(),
        })
        .await?
        .into_inner();
    let mut all = vec![];
    while let Some(p) = stream.message().await? {
        all.push(p);
    }
    Ok(all)
}

async fn full_epoch(d: &Daemon, epoch: u64) -> Vec<Batch> {
    let mut c = connect(&d.client_addr()).await.unwrap();
    let req = StreamBatchesRequest {
        dataset: "train".into(),
        batch_size: 16,
        seed: 4,
        epoch,
        ..Default::default()
    };
    collect_batches(&mut c, req).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warmed_dataset_survives_a_restart_without_preprocessing_again() {
    let n = 700;
    let dir = dataset(n);
    let scratch = dir.path().join("scratch");
    let d = start(dir.path(), &scratch, "", 1 << 20).await;
    let progress = warm(&d).await.unwrap();
    let last = progress.last().unwrap();
    assert_eq!(
        (last.done, last.total, last.written, last.present),
        (n, n, n, 0)
    );
    assert!(
        progress.windows(2).all(|w| w[0].done <= w[1].done),
        "progress only grows"
    );
    // The memory tier is primed as well: the first epoch finds part of it there.
    let primed = stats(&d).await;
    assert!(primed.memory_entries > 0 && primed.memory_bytes <= primed.memory_budget_bytes);
    check_epoch(&full_epoch(&d, 0).await, n);
    let s = stats(&d).await;
    assert_eq!(hits(&s, "raw"), 0);
    assert!(hits(&s, "memory") >= primed.memory_entries / 2, "{s:?}");
    // Warming again finds everything there.
    let again = warm(&d).await.unwrap();
    assert_eq!(again.last().unwrap().present, n);
    assert_eq!(again.last().unwrap().written, 0);
    d.shutdown().await.unwrap();

    let d = start(dir.path(), &scratch, "", 1 << 20).await;
    check_epoch(&full_epoch(&d, 0).await, n);
    let s = stats(&d).await;
    assert_eq!(hits(&s, "raw"), 0, "nothing preprocessed again");
    assert_eq!(hits(&s, "scratch"), n);
    assert!(s.scratch_bytes <= s.scratch_budget_bytes);
    assert!(s.scratch_bytes >= n * (SAMPLE_BYTES as u64 + 8));
    d.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_warm_resumes_where_it_stopped() {
    let n = 3000;
    let dir = dataset(n);
    let scratch = dir.path().join("scratch");
    let d = start(dir.path(), &scratch, "", 0).await;
    {
        let mut c = connect(&d.client_addr()).await.unwrap();
        let mut stream = c
            .warm(WarmRequest {
                dataset: "train".into(),
            })
            .await
            .unwrap()
            .into_inner();
        let first = stream.message().await.unwrap().unwrap();
        assert!(first.done > 0 && first.done < n, "{first:?}");
        // Dropping the call interrupts the warm.
    }
    let last = *warm(&d).await.unwrap().last().unwrap();
    assert_eq!(last.done, n);
    assert_eq!(last.written + last.present, n);
    assert!(
        last.present >= 256,
        "the first run's work was kept: {last:?}"
    );
    check_epoch(&full_epoch(&d, 0).await, n);
    let s = stats(&d).await;
    assert_eq!(hits(&s, "raw"), 0);
    assert_eq!(hits(&s, "scratch"), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_and_truncated_records_are_refetched_never_served() {
    let n = 500;
    let dir = dataset(n);
    let scratch = dir.path().join("scratch");
    // No memory tier: every lookup goes to scratch.
    let d = start(dir.path(), &scratch, "", 0).await;
    warm(&d).await.unwrap();
    let tier = d
        .store
        .scratch_of(&d.catalog.get("train").unwrap())
        .unwrap();
    let (path, payload, _) = tier.locate(123).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xFF, 0xFF], payload + 5).unwrap();

    check_epoch(&full_epoch(&d, 0).await, n);
    let s = stats(&d).await;
    assert_eq!(s.scratch_corrupt_records, 1);
    assert_eq!(hits(&s, "raw"), 1, "only the corrupt record is refetched");
    check_epoch(&full_epoch(&d, 1).await, n);
    let s = stats(&d).await;
    assert_eq!(
        (s.scratch_corrupt_records, hits(&s, "raw")),
        (1, 1),
        "and it was rewritten"
    );

    // Truncate a shard while the daemon is down: its index entries (at its end) are gone, so
    // its records are refetched, and nothing cut off is served.
    let (path, payload, _) = tier.locate(n - 1).unwrap();
    d.shutdown().await.unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(payload + 3)
        .unwrap();
    let d = start(dir.path(), &scratch, "", 0).await;
    check_epoch(&full_epoch(&d, 0).await, n);
    let s = stats(&d).await;
    let refetched = hits(&s, "raw");
    assert!(
        refetched >= 1,
        "the cut shard's records came from raw storage"
    );
    assert!(hits(&s, "scratch") >= n / 2, "the other shards still serve");
    check_epoch(&full_epoch(&d, 1).await, n);
    assert_eq!(
        hits(&stats(&d).await, "raw"),
        refetched,
        "and were written again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_scratch_budget_degrades_to_raw_and_warm_says_so() {
    let n = 1000;
    let dir = dataset(n);
    let scratch = dir.path().join("scratch");
    // Room for two 8 KiB shards out of five.
    let d = start(dir.path(), &scratch, "budget_bytes = 16384", 0).await;
    let status = warm(&d).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(
        status.message().contains("stopped taking samples"),
        "{}",
        status.message()
    );
    check_epoch(&full_epoch(&d, 0).await, n);
    let s = stats(&d).await;
    assert!(s.scratch_bytes <= 16384, "{}", s.scratch_bytes);
    assert!(hits(&s, "scratch") > 0 && hits(&s, "raw") > 0, "{s:?}");
    assert_eq!(hits(&s, "scratch") + hits(&s, "raw"), n);
}

/// Mounts a tmpfs, so it needs root: ignored by a plain `cargo test`, run by scripts/test
/// (`--ignored`) when it is root, and then a mount that fails is a failure, not a pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "mounts a tmpfs: needs root (scripts/test runs it as root)"]
async fn a_full_disk_degrades_to_raw_with_a_clear_reason() {
    let n = 4000;
    let dir = dataset(n);
    let scratch = dir.path().join("small-disk");
    std::fs::create_dir(&scratch).unwrap();
    // A real 64 KiB file system: the dataset's 160 KiB of records do not fit.
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
        .arg(&scratch)
        .status()
        .is_ok_and(|s| s.success());
    assert!(mounted, "mounting a 64 KiB tmpfs on {}", scratch.display());
    let d = start(dir.path(), &scratch, "budget_bytes = 1000000000", 0).await;
    check_epoch(&full_epoch(&d, 0).await, n);
    let s = stats(&d).await;
    assert!(
        s.scratch_paused.contains("scratch disk is full"),
        "{:?}",
        s.scratch_paused
    );
    // Granules read before the disk filled served some of their samples from scratch.
    assert_eq!(hits(&s, "scratch") + hits(&s, "raw"), n);
    check_epoch(&full_epoch(&d, 1).await, n);
    let s = stats(&d).await;
    assert!(hits(&s, "scratch") > 0, "what fitted is served: {s:?}");
    assert_eq!(hits(&s, "scratch") + hits(&s, "raw"), 2 * n);
    d.shutdown().await.unwrap();
    let _ = std::process::Command::new("umount").arg(&scratch).status();
}

/// Writes `count` images per class, of varying sizes and both formats.
fn image_folder(root: &Path, classes: &[&str], count: u32) -> Vec<(std::path::PathBuf, i64)> {
    let mut files = vec![];
    for (label, class) in classes.iter().enumerate() {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..count {
            let (w, h) = (20 + 3 * i, 18 + 5 * (label as u32));
            let img = image::RgbImage::from_fn(w, h, |x, y| {
                image::Rgb([(x * 9) as u8, (y * 13) as u8, (label as u32 * 80 + i) as u8])
            });
            let ext = if i % 2 == 0 { "png" } else { "jpg" };
            let path = root.join(class).join(format!("img{i:03}.{ext}"));
            img.save(&path).unwrap();
            files.push((path, label as i64));
        }
    }
    files
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_folders_are_decoded_resized_and_cropped_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("images");
    let files = image_folder(&root, &["cat", "dog", "emu"], 5);
    let config = Config::parse(&format!(
        r#"
        listen = "127.0.0.1:0"
        preprocess_workers = 2
        [scratch]
        dir = {scratch:?}
        [[dataset]]
        name = "pets"
        tcp = true
        kind = "images"
        path = {root:?}
        resize = 16
        crop = 12
        "#,
        scratch = dir.path().join("scratch"),
    ))
    .unwrap();
    let d = Daemon::start(config).await.unwrap();
    // An eval-only dataset: each image kept at its 12x12 eval crop (decode = "region").
    let p = Preprocess::Images {
        ops: vec![FieldOp::rgb()],
        resize: Resize {
            shorter: 16,
            max_size: None,
            square: false,
            keep_crop: Some(12),
        },
    };
    // Batches carry the center 12x12 of the image kept at shorter side 16.
    let center = Pipeline {
        crop: Crop::Center,
        flip: false,
        size: Some((12, 12)),
        spatial: vec![Some(Spatial {
            scale: 1,
            resample: Resample::Linear,
        })],
        reference: 0,
    };
    let mut c = connect(&d.client_addr()).await.unwrap();
    // Bytes the memory tier charges for every sample: its record (the kept image's H and W as
    // u32s, its pixels, its label), by its allocation, and the entry's bookkeeping.
    let mut kept_bytes = 0u64;
    for epoch in 0..2 {
        let req = StreamBatchesRequest {
            dataset: "pets".into(),
            batch_size: 4,
            seed: 1,
            epoch,
            ..Default::default()
        };
        let batches = collect_batches(&mut c, req).await.unwrap();
        let mut seen = vec![];
        for b in &batches {
            assert_eq!(&b.shape[1..], &[3, 12, 12]);
            for (k, &id) in b.sample_ids.iter().enumerate() {
                let (path, label) = &files[id as usize];
                let file = std::fs::read(path).unwrap();
                let kept = p
                    .apply(
                        vec![Value::new(vec![file.len() as u32], file)],
                        &Default::default(),
                    )
                    .unwrap();
                let dims = &kept[0].dims;
                if epoch == 0 {
                    kept_bytes += larder::tiers::memory::cost_of(16 + kept[0].data.len());
                }
                let cut = center.cut(0, 0, id, (dims[1], dims[2]));
                let spec = FieldSpec::new("image", DType::Uint8, vec![Some(3), None, None]);
                let mut want = vec![0u8; 432];
                center
                    .apply(0, &spec, dims, &kept[0].data, &cut, &mut want)
                    .unwrap();
                assert_eq!(
                    &b.data[k * 432..(k + 1) * 432],
                    &want[..],
                    "{}",
                    path.display()
                );
                assert_eq!(b.labels[k], *label);
                seen.push(id);
            }
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..15).collect::<Vec<_>>());
    }
    let s = stats(&d).await;
    assert_eq!(hits(&s, "raw"), 15, "each image decoded once");
    assert_eq!(hits(&s, "memory"), 15);
    let raw_bytes: u64 = files
        .iter()
        .map(|(f, _)| std::fs::metadata(f).unwrap().len())
        .sum();
    // The raw tier gave each file and its class label (8 bytes).
    assert_eq!(bytes_read(&s, "raw"), raw_bytes + 15 * 8);
    let expected = kept_bytes as f64 / raw_bytes as f64;
    assert!(
        (s.measured_expansion_factor - expected).abs() < 1e-9,
        "{} vs {expected}",
        s.measured_expansion_factor
    );

    // A file that is not an image is skipped (and listed), by default...
    std::fs::write(root.join("dog/img999.jpg"), b"garbage").unwrap();
    let config = |on_error: &str| {
        Config::parse(&format!(
            "listen = \"127.0.0.1:0\"\n[scratch]\nenabled = false\n[[dataset]]\nname = \"pets\"\ntcp = true\nkind = \"images\"\npath = {root:?}\nresize = 16\ncrop = 12\non_error = {on_error:?}\n"
        ))
        .unwrap()
    };
    let req = StreamBatchesRequest {
        dataset: "pets".into(),
        batch_size: 16,
        sequential: true,
        ..Default::default()
    };
    let d2 = Daemon::start(config("skip")).await.unwrap();
    let mut c2 = connect(&d2.client_addr()).await.unwrap();
    let batches = collect_batches(&mut c2, req.clone()).await.unwrap();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].sample_ids.len(), 15, "sample 10 left out");
    assert!(!batches[0].sample_ids.contains(&10));
    assert_eq!(batches[0].shape, vec![15, 3, 12, 12]);
    assert_eq!(stats(&d2).await.bad_samples, 1);
    let bad = c2
        .list_bad_samples(larder::proto::ListBadSamplesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .samples;
    assert_eq!(bad.len(), 1);
    assert_eq!((bad[0].dataset.as_str(), bad[0].index), ("pets", 10));
    assert!(bad[0].error.contains("img999.jpg"), "{}", bad[0].error);
    // ...and fails the stream with a message naming it under on_error = "fail".
    let d2 = Daemon::start(config("fail")).await.unwrap();
    let mut c2 = connect(&d2.client_addr()).await.unwrap();
    let err = collect_batches(&mut c2, req).await.unwrap_err();
    let status = err.downcast_ref::<tonic::Status>().expect("a gRPC status");
    assert_eq!(status.code(), Code::DataLoss);
    assert!(
        status.message().contains("preprocessing sample 10"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("decoding image"),
        "{}",
        status.message()
    );
    let warm = c2
        .warm(WarmRequest {
            dataset: "pets".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(warm.code(), Code::FailedPrecondition);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_of_a_dataset_no_longer_configured_are_kept_until_needed() {
    let dir = dataset(100);
    let scratch = dir.path().join("scratch");
    let d = start(dir.path(), &scratch, "", 0).await;
    warm(&d).await.unwrap();
    let folder = d
        .store
        .scratch_of(&d.catalog.get("train").unwrap())
        .unwrap()
        .dir()
        .to_path_buf();
    assert!(folder.exists());
    d.shutdown().await.unwrap();
    // Taken out of the config for a while: kept, and counted against the scratch budget.
    let without = Config::parse(&format!(
        "listen = \"127.0.0.1:0\"\n[scratch]\ndir = {scratch:?}\n"
    ))
    .unwrap();
    let d = Daemon::start(without).await.unwrap();
    assert!(folder.exists(), "kept while nothing needs its space");
    let kept = stats(&d).await.scratch_bytes;
    assert!(kept > 0, "counted against the budget");
    d.shutdown().await.unwrap();
    // Back in the config: served warm from the same shards.
    let d = start(dir.path(), &scratch, "", 0).await;
    check_epoch(&full_epoch(&d, 0).await, 100);
    assert_eq!(
        hits(&stats(&d).await, "scratch"),
        100,
        "served from its old shards"
    );
    assert_eq!(stats(&d).await.scratch_bytes, kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warming_while_clients_stream_is_safe() {
    let n = 3000;
    let dir = dataset(n);
    let scratch = dir.path().join("scratch");
    let d = start(dir.path(), &scratch, "", 0).await;
    let (progress, a, b) = tokio::join!(warm(&d), full_epoch(&d, 0), full_epoch(&d, 1));
    assert_eq!(progress.unwrap().last().unwrap().done, n);
    check_epoch(&a, n);
    check_epoch(&b, n);
    let s = stats(&d).await;
    assert_eq!(
        s.scratch_corrupt_records, 0,
        "no reader saw a record half written"
    );
    check_epoch(&full_epoch(&d, 2).await, n);
    assert_eq!(hits(&stats(&d).await, "scratch") - hits(&s, "scratch"), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_made_again_with_the_same_size_and_mtime_never_finds_the_old_shards() {
    let n = 100;
    let dir = dataset(n);
    let scratch = dir.path().join("scratch");
    let path = dir.path().join("train.h5");
    let d = start(dir.path(), &scratch, "", 0).await;
    warm(&d).await.unwrap();
    d.shutdown().await.unwrap();
    // Another file in its place: the same size and mtime (touch -d), other pixels.
    let other = dir.path().join("other.h5");
    make_dataset(&other, n, &SHAPE).unwrap();
    {
        let f = hdf5::File::open_rw(&other).unwrap();
        let images = f.dataset("images").unwrap();
        let data: Vec<u8> = images.read_raw::<u8>().unwrap();
        let flipped: Vec<u8> = data.iter().map(|b| 255 - b).collect();
        images.write_raw(&flipped).unwrap();
    }
    let old = std::fs::metadata(&path).unwrap();
    assert_eq!(std::fs::metadata(&other).unwrap().len(), old.len());
    std::fs::File::options()
        .write(true)
        .open(&other)
        .unwrap()
        .set_modified(old.modified().unwrap())
        .unwrap();
    std::fs::rename(&other, &path).unwrap();
    let d = start(dir.path(), &scratch, "", 0).await;
    let batches = full_epoch(&d, 0).await;
    for b in &batches {
        for (k, &id) in b.sample_ids.iter().enumerate() {
            let got = &b.data[k * SAMPLE_BYTES..(k + 1) * SAMPLE_BYTES];
            let want: Vec<u8> = larder::synthetic::expected_sample(id, SAMPLE_BYTES)
                .iter()
                .map(|b| 255 - b)
                .collect();
            assert_eq!(got, &want[..], "sample {id}: the new file's bytes");
        }
    }
    check_epoch_ids(&batches, n);
}

fn check_epoch_ids(batches: &[Batch], n: u64) {
    let mut ids: Vec<u64> = batches.iter().flat_map(|b| b.sample_ids.clone()).collect();
    ids.sort_unstable();
    assert_eq!(ids, (0..n).collect::<Vec<_>>());
}

/// Records read from a scratch tier the page cache does not hold, as a shuffled epoch reads
/// them, each exactly as written: through one `pread` per record (how the tier reads) and
/// through the mapping (its checksum over the mapped pages). It drops the page cache, so root
/// only (scripts/test runs it as root, as CI does). Each pass's rate is printed beside
/// (`--release --nocapture` for figures; benches/RESULTS.md, "Measurements in the tests").
#[test]
#[ignore = "drops the page cache: needs root (scripts/test runs it as root)"]
fn cold_scratch_reads() {
    use larder::tiers::scratch::{ScratchSpace, ScratchTier};
    use std::time::Instant;
    assert_eq!(larder::access::euid(), 0, "run as root");
    // On the disk (not tmpfs): /var/tmp.
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let (n, size) = (1200u64, 262_144usize); // records of a 3x256x341 image
    let space = ScratchSpace::open(dir.path(), None).unwrap();
    let tier = ScratchTier::open(&space, "cold", 1, n, size as u64, 64 << 20).unwrap();
    for i in 0..n {
        assert!(tier.write(i, &vec![(i % 251) as u8; size]));
    }
    let drop_caches = || {
        // SAFETY: sync has no arguments and no memory effects.
        unsafe { libc::sync() };
        std::fs::write("/proc/sys/vm/drop_caches", "3").unwrap();
    };
    let mut order: Vec<u64> = (0..n).collect();
    let mut x = 12345u64;
    for k in (1..order.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        order.swap(k, (x >> 33) as usize % (k + 1));
    }
    drop(tier);
    // Each pass on a tier opened afresh (pages a mapping has touched stay in memory while it
    // lives, whatever the page cache is told), the page cache dropped first.
    let pass = |mapped: bool| {
        let tier = ScratchTier::open(&space, "cold", 1, n, size as u64, 64 << 20).unwrap();
        drop_caches();
        let t = Instant::now();
        for &i in &order {
            if mapped {
                assert!(tier.contains(i)); // through the mapping: checksum over the mapped pages
            } else {
                let record = tier.read(i).unwrap();
                assert!(
                    record.len() == size && record.iter().all(|&b| b == (i % 251) as u8),
                    "record {i} read cold is not what was written"
                );
            }
        }
        n as f64 / t.elapsed().as_secs_f64()
    };
    for round in 0..3 {
        let read = pass(false);
        let mapped = pass(true);
        println!(
            "round {round}: cold records of {size} bytes: mapped {mapped:.0}/s, one pread {read:.0}/s ({:.1}x)",
            read / mapped
        );
    }
}
