//! Per-image cost of the image pipeline, on a real photo (tests/fixtures/parrots.jpg, also
//! upscaled to the ImageNet-typical 500x375 and re-encoded at quality 90):
//! `cargo bench --bench pipeline`. Decoding and resizing happen once per image, before the
//! tiers; the crop (eval: copied; train: resampled) and flip at every batch.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use larder::fields::{DType, FieldSpec, Resample, Value};
use larder::pipeline::decode::decode;
use larder::pipeline::planes::resize_interleaved;
use larder::pipeline::{Crop, FieldOp, Pipeline, Preprocess, Resize, Spatial};
use std::hint::black_box;

const PARROTS: &[u8] = include_bytes!("../tests/fixtures/parrots.jpg");

/// The photo at 500x375, as a JPEG of quality 90.
fn photo_500x375() -> Vec<u8> {
    let p = decode(PARROTS, false, u64::MAX, |_, _| None).unwrap();
    let big = resize_interleaved(
        &p.data,
        (p.width, p.height),
        3,
        (500, 375),
        Resample::Linear,
    )
    .unwrap();
    let image = turbojpeg::Image {
        pixels: &big[..],
        width: 500,
        pitch: 1500,
        height: 375,
        format: turbojpeg::PixelFormat::RGB,
    };
    turbojpeg::compress(image, 90, turbojpeg::Subsamp::Sub2x2)
        .unwrap()
        .to_vec()
}

fn pipeline(c: &mut Criterion) {
    let jpeg = photo_500x375();
    let mut g = c.benchmark_group("image");
    g.throughput(Throughput::Elements(1));
    g.bench_function("decode 500x375 JPEG (libjpeg-turbo)", |b| {
        b.iter(|| black_box(decode(&jpeg, false, u64::MAX, |_, _| None).unwrap()))
    });
    g.bench_function("decode 500x375 JPEG at 1/2 (DCT scaling)", |b| {
        b.iter(|| black_box(decode(&jpeg, false, u64::MAX, |_, _| Some(180)).unwrap()))
    });
    g.bench_function("decode 500x375 JPEG (image crate, before)", |b| {
        b.iter(|| black_box(image::load_from_memory(&jpeg).unwrap().to_rgb8()))
    });
    let px = decode(&jpeg, false, u64::MAX, |_, _| None).unwrap();
    g.bench_function("resize 500x375 -> 341x256 RGB (SIMD, antialiased)", |b| {
        b.iter(|| {
            black_box(
                resize_interleaved(&px.data, (500, 375), 3, (341, 256), Resample::Linear).unwrap(),
            )
        })
    });
    let img = image::RgbImage::from_raw(500, 375, px.data.clone()).unwrap();
    g.bench_function("resize 500x375 -> 341x256 RGB (image crate, before)", |b| {
        b.iter(|| {
            black_box(image::imageops::resize(
                &img,
                341,
                256,
                image::imageops::FilterType::Triangle,
            ))
        })
    });
    let kept = Preprocess::Images {
        ops: vec![FieldOp::rgb()],
        resize: Resize {
            shorter: 256,
            max_size: None,
            square: false,
            keep_crop: None,
        },
    };
    g.bench_function("preprocess: decode + resize 256 + planes", |b| {
        b.iter(|| {
            black_box(
                kept.apply(
                    vec![Value::new(vec![jpeg.len() as u32], jpeg.clone())],
                    &Default::default(),
                )
                .unwrap(),
            )
        })
    });
    // The JPEGs of a folder (benches/images.py passes its own), one after another: what the
    // preprocessing pool does per image of that folder.
    if let Some(dir) = std::env::var_os("LARDER_BENCH_JPEGS") {
        let files = jpegs_under(std::path::Path::new(&dir));
        assert!(!files.is_empty(), "no .jpg files under {dir:?}");
        let mut next = files.iter().cycle();
        g.bench_function(
            "preprocess: decode + resize 256 + planes, the folder's JPEGs",
            |b| {
                b.iter(|| {
                    let file = next.next().unwrap();
                    let raw = vec![Value::new(vec![file.len() as u32], file.clone())];
                    black_box(kept.apply(raw, &Default::default()).unwrap())
                })
            },
        );
    }
    // The planes the tiers keep of the photo: what preprocessing gives.
    let raw = vec![Value::new(vec![jpeg.len() as u32], jpeg.clone())];
    let planes = kept.apply(raw, &Default::default()).unwrap().remove(0).data;
    let spec = FieldSpec::new("image", DType::Uint8, vec![Some(3), None, None]);
    let dims = [3, 256, 341];
    let spatial = vec![Some(Spatial {
        scale: 1,
        resample: Resample::Linear,
    })];
    let eval = Pipeline {
        crop: Crop::Center,
        flip: false,
        size: Some((224, 224)),
        spatial: spatial.clone(),
        reference: 0,
    };
    let train = Pipeline {
        crop: Crop::RandomResized {
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
        },
        flip: true,
        ..eval.clone()
    };
    let mut out = vec![0u8; 3 * 224 * 224];
    let mut id = 0;
    for (name, p) in [
        ("eval: center crop 224 (copied)", &eval),
        ("train: random-resized crop 224 + flip", &train),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                id += 1;
                let cut = p.cut(1, 0, id, (256, 341));
                p.apply(0, &spec, &dims, &planes, &cut, &mut out).unwrap();
                black_box(&out);
            })
        });
    }
    g.finish();
}

/// The bytes of every .jpg file under `dir`, in path order.
fn jpegs_under(dir: &std::path::Path) -> Vec<Vec<u8>> {
    let mut paths = vec![];
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else if p.extension().is_some_and(|x| x == "jpg") {
                paths.push(p);
            }
        }
    }
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

criterion_group!(benches, pipeline);
criterion_main!(benches);
