//! Per-sample cost of each tier and of the work around it:
//! `cargo bench --bench tiers` (end-to-end throughput: `larder bench DATASET`).

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use larder::fields::Value;
use larder::pipeline::{FieldOp, Preprocess, Resize};
use larder::sampler::epoch_order;
use larder::source::{Hdf5Field, Hdf5Source, RawSource};
use larder::tiers::memory::{MemoryTier, ENTRY_OVERHEAD};
use larder::tiers::orders::OrderKey;
use larder::tiers::scratch::{ScratchSpace, ScratchTier};
use std::hint::black_box;

const SAMPLE: usize = 3 * 64 * 64;

fn memory(c: &mut Criterion) {
    let tier = MemoryTier::new(1 << 30);
    for i in 0..10_000 {
        tier.insert((0, i), Bytes::from(vec![1u8; SAMPLE]), SAMPLE as u64);
    }
    let mut g = c.benchmark_group("memory");
    g.throughput(Throughput::Bytes(SAMPLE as u64));
    let mut i = 0;
    g.bench_function("get hit 12 KiB", |b| {
        b.iter(|| {
            i = (i + 7919) % 10_000;
            black_box(tier.get(&(0, i)))
        })
    });
    g.finish();
}

/// The next-use policy's cost per lookup (a hit, or a miss and the insert that follows, with
/// its eviction) at a million samples, a tier holding a quarter of them, and `streams` streams
/// on `orders` orders (a job's ranks share one), each reporting its position every batch of
/// 64 as the daemon's streams do.
fn policy(c: &mut Criterion) {
    const N: u64 = 1_000_000;
    const BATCH: u64 = 64;
    let mut g = c.benchmark_group("next-use policy");
    g.sample_size(20);
    for (streams, orders) in [(8u64, 8u64), (64, 8), (64, 64)] {
        let tier = MemoryTier::new(N / 4 * (1 + ENTRY_OVERHEAD));
        let key = |seed| OrderKey {
            dataset: 0,
            num_samples: N,
            seed,
            epoch: 0,
            shuffle: true,
            split: None,
            form: larder::sampler::OrderForm::V1,
            correlated: None,
        };
        let perms: Vec<Vec<u64>> = (0..orders).map(|o| epoch_order(N, o, 0, true)).collect();
        // Streams start spread over the epoch, as jobs begun at different times are.
        let mut at: Vec<u64> = (0..streams).map(|s| s * N / streams / 2).collect();
        for s in 0..streams {
            tier.stream_opened(s, key(s % orders), at[s as usize]);
        }
        let one = Bytes::from_static(&[1]);
        let mut s = 0u64;
        let mut lookup = || {
            s = (s + 1) % streams;
            let p = &mut at[s as usize];
            *p = (*p + 1) % N;
            if p.is_multiple_of(BATCH) {
                tier.stream_at(s, *p + BATCH);
            }
            let sample = perms[(s % orders) as usize][*p as usize];
            if tier.get(&(0, sample)).is_none() {
                tier.insert((0, sample), one.clone(), 1);
            }
        };
        for _ in 0..N / 2 {
            lookup();
        }
        let name = format!("lookup, 1M samples, {streams} streams on {orders} orders");
        g.bench_function(&name, |b| b.iter(&mut lookup));
        let snap = tier.snapshot();
        eprintln!(
            "{name}: policy bookkeeping {} MiB beyond the entries ({} entries)",
            snap.policy_bytes >> 20,
            snap.entries
        );
    }
    g.finish();
}

fn scratch(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let space = ScratchSpace::open(dir.path(), Some(1 << 30)).unwrap();
    let tier = ScratchTier::open(&space, "bench", 1, 10_000, SAMPLE as u64, 64 << 20).unwrap();
    let data = vec![3u8; SAMPLE];
    for i in 0..10_000 {
        tier.write(i, &data);
    }
    let mut g = c.benchmark_group("scratch");
    g.throughput(Throughput::Bytes(SAMPLE as u64));
    let mut i = 0;
    g.bench_function("read 12 KiB (page cache, checksum checked)", |b| {
        b.iter(|| {
            i = (i + 7919) % 10_000;
            black_box(tier.read(i))
        })
    });
    g.finish();
    // Records are appended: each round writes 1,000 into a fresh tier.
    let mut g = c.benchmark_group("scratch");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(1000 * SAMPLE as u64));
    g.bench_function("write 1000 x 12 KiB", |b| {
        b.iter_batched(
            || {
                let dir = tempfile::tempdir().unwrap();
                let space = ScratchSpace::open(dir.path(), Some(1 << 30)).unwrap();
                let tier =
                    ScratchTier::open(&space, "w", 1, 1000, SAMPLE as u64, 64 << 20).unwrap();
                (dir, tier)
            },
            |(dir, tier)| {
                for i in 0..1000 {
                    black_box(tier.write(i, &data));
                }
                (dir, tier)
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn raw(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.h5");
    larder::synthetic::make_dataset(&path, 2000, &[3, 64, 64]).unwrap();
    let fields = [
        Hdf5Field::new("image", "images"),
        Hdf5Field::new("label", "labels"),
    ];
    let src = Hdf5Source::open(&path, &fields).unwrap();
    let mut g = c.benchmark_group("raw");
    g.throughput(Throughput::Bytes(SAMPLE as u64));
    let mut i = 0;
    g.bench_function("hdf5 read one 12 KiB sample", |b| {
        b.iter(|| {
            i = (i + 797) % 2000;
            black_box(src.read(i).unwrap())
        })
    });
    g.throughput(Throughput::Bytes(256 * SAMPLE as u64));
    g.bench_function("hdf5 read 256 samples at once", |b| {
        b.iter(|| black_box(src.read_range(1024, 256).unwrap()))
    });
    g.finish();
}

fn preprocess(c: &mut Criterion) {
    // A 500x375 photo's size (ImageNet's most common), smooth with some texture.
    let img = image::RgbImage::from_fn(500, 375, |x, y| {
        image::Rgb([x as u8, y as u8, ((x * 7 + y * 13) % 251) as u8])
    });
    let mut jpeg = std::io::Cursor::new(vec![]);
    img.write_to(&mut jpeg, image::ImageFormat::Jpeg).unwrap();
    let jpeg = jpeg.into_inner();
    let pipeline = |keep_crop| Preprocess::Images {
        ops: vec![FieldOp::rgb()],
        resize: Resize {
            shorter: 256,
            max_size: None,
            square: false,
            keep_crop,
        },
    };
    let mut g = c.benchmark_group("preprocess");
    g.throughput(Throughput::Elements(1));
    for (name, p) in [
        (
            "jpeg 500x375 -> decode whole, resize 256 (exact)",
            pipeline(None),
        ),
        (
            "jpeg 500x375 -> decode the crop's region, kept at 224 (region)",
            pipeline(Some(224)),
        ),
    ] {
        g.bench_function(name, |b| {
            b.iter_batched(
                || vec![Value::new(vec![jpeg.len() as u32], jpeg.clone())],
                |j| black_box(p.apply(j, &Default::default()).unwrap()),
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

fn sampler(c: &mut Criterion) {
    let mut g = c.benchmark_group("sampler");
    g.throughput(Throughput::Elements(1_000_000));
    g.bench_function("epoch order of 1M samples", |b| {
        b.iter(|| black_box(epoch_order(1_000_000, 42, 3, true)))
    });
    g.finish();
}

criterion_group!(benches, memory, policy, scratch, raw, preprocess, sampler);
criterion_main!(benches);
