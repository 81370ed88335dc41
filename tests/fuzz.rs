//! A fuzz harness for what parses untrusted bytes: the shared-memory ring handshake, the
//! scratch tier's shard files, the image decoders with their limits, and the config. Each
//! target mutates valid inputs (bit flips, interesting values such as 0xFFFF in a size field,
//! truncations, insertions, splices) and random bytes, and checks what must hold for any input:
//! no panic, no hang, nothing over a limit, nothing wrong served.
//!
//! CI runs each target for its default number of cases (about 45 s of CPU in all, with the
//! debug build: a few hundred thousand inputs). Longer runs scale every target, e.g. a
//! hundred times (about an hour on 2 cores):
//!
//!     LARDER_FUZZ_SCALE=100 cargo test --release --test fuzz
//!
//! proptest shrinks a failing input to a small one and prints it; a crash found becomes a
//! test of its own (the `found_*` tests at the end).

use larder::config::{Config, ImageMode, Limits};
use larder::fields::Resample;
use larder::pipeline::decode::decode;
use larder::pipeline::{FieldOp, Preprocess, Resize};
use larder::server::shm::{self, Rings, HEADER_BYTES, MAGIC};
use larder::server::shutdown;
use larder::tiers::scratch::{ScratchSpace, ScratchTier};
use proptest::prelude::*;
use std::io::Cursor;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Cases per target: `default` (about 10 s of the debug build on this 2-core machine) times
/// LARDER_FUZZ_SCALE (default 1).
fn config(default: u32) -> ProptestConfig {
    let scale: f64 = std::env::var("LARDER_FUZZ_SCALE")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(1.0);
    let cases = (default as f64 * scale).max(1.0) as u32;
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// One change to a byte string.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(prop::sample::Index, u8),
    /// An interesting value (0, all ones, a sign bit, a large size) written big- or
    /// little-endian at a position: sizes in headers are where parsers go wrong.
    Interesting(prop::sample::Index, u64, u8, bool),
    Truncate(prop::sample::Index),
    Insert(prop::sample::Index, Vec<u8>),
    Remove(prop::sample::Index, usize),
    /// A copy of one part of the input over another.
    Splice(prop::sample::Index, prop::sample::Index, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting = prop::sample::select(vec![
        0u64,
        1,
        0x7F,
        0x80,
        0xFF,
        0x7FFF,
        0x8000,
        0xFFFF,
        0x7FFF_FFFF,
        0xFFFF_FFFF,
        u64::MAX,
        1 << 63,
        30000,
    ]);
    prop_oneof![
        (any::<prop::sample::Index>(), 1..=255u8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (
            any::<prop::sample::Index>(),
            interesting,
            1..=8u8,
            any::<bool>()
        )
            .prop_map(|(i, v, w, be)| Mutation::Interesting(i, v, w, be)),
        any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        (
            any::<prop::sample::Index>(),
            prop::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<prop::sample::Index>(), 1..64usize).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (
            any::<prop::sample::Index>(),
            any::<prop::sample::Index>(),
            1..64usize
        )
            .prop_map(|(a, b, n)| Mutation::Splice(a, b, n)),
    ]
}

fn mutate(mut v: Vec<u8>, ops: &[Mutation]) -> Vec<u8> {
    for op in ops {
        if v.is_empty() {
            break;
        }
        let len = v.len();
        match op {
            Mutation::Flip(i, b) => v[i.index(len)] ^= b,
            Mutation::Interesting(i, value, width, be) => {
                let at = i.index(len);
                let w = (*width as usize).min(len - at);
                let bytes = if *be {
                    value.to_be_bytes()[8 - w..].to_vec()
                } else {
                    value.to_le_bytes()[..w].to_vec()
                };
                v[at..at + w].copy_from_slice(&bytes);
            }
            Mutation::Truncate(i) => v.truncate(i.index(len)),
            Mutation::Insert(i, bytes) => {
                let at = i.index(len);
                v.splice(at..at, bytes.iter().copied());
            }
            Mutation::Remove(i, n) => {
                let at = i.index(len);
                v.drain(at..(at + n).min(len));
            }
            Mutation::Splice(from, to, n) => {
                let (a, b) = (from.index(len), to.index(len));
                let n = (*n).min(len - a).min(len - b);
                let part = v[a..a + n].to_vec();
                v[b..b + n].copy_from_slice(&part);
            }
        }
    }
    v
}

/// A valid input, mutated 1 to 6 times; or, one case in eight, random bytes.
fn inputs(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        7 => (
            prop::sample::select(seeds),
            prop::collection::vec(mutation(), 1..6)
        )
            .prop_map(|(seed, ops)| mutate(seed, &ops)),
        1 => prop::collection::vec(any::<u8>(), 0..512),
    ]
}

// ---- images ---------------------------------------------------------------------------

fn gradient(w: usize, h: usize, c: usize) -> Vec<u8> {
    (0..w * h * c).map(|i| (i * 7 % 251) as u8).collect()
}

fn jpeg(w: usize, h: usize, grey: bool, sub: turbojpeg::Subsamp) -> Vec<u8> {
    let c = if grey { 1 } else { 3 };
    let px = gradient(w, h, c);
    let image = turbojpeg::Image {
        pixels: &px[..],
        width: w,
        pitch: w * c,
        height: h,
        format: if grey {
            turbojpeg::PixelFormat::GRAY
        } else {
            turbojpeg::PixelFormat::RGB
        },
    };
    turbojpeg::compress(image, 80, sub).unwrap().to_vec()
}

fn png(w: u32, h: u32, color: png::ColorType, depth: png::BitDepth, palette: bool) -> Vec<u8> {
    let mut out = vec![];
    {
        let mut e = png::Encoder::new(Cursor::new(&mut out), w, h);
        e.set_color(color);
        e.set_depth(depth);
        if palette {
            e.set_palette((0..48u8).collect::<Vec<_>>());
        }
        let mut writer = e.write_header().unwrap();
        let bits = depth as usize
            * match color {
                png::ColorType::Rgb => 3,
                png::ColorType::Rgba => 4,
                _ => 1,
            };
        let row = (w as usize * bits).div_ceil(8);
        let data: Vec<u8> = (0..row * h as usize)
            .map(|i| if palette { (i % 16) as u8 } else { i as u8 })
            .collect();
        writer.write_image_data(&data).unwrap();
    }
    out
}

fn image_seeds() -> Vec<Vec<u8>> {
    vec![
        jpeg(24, 16, false, turbojpeg::Subsamp::Sub2x2),
        jpeg(17, 9, false, turbojpeg::Subsamp::None),
        jpeg(16, 16, true, turbojpeg::Subsamp::Gray),
        png(12, 8, png::ColorType::Rgb, png::BitDepth::Eight, false),
        png(9, 7, png::ColorType::Rgba, png::BitDepth::Sixteen, false),
        png(10, 6, png::ColorType::Indexed, png::BitDepth::Four, true),
        png(8, 8, png::ColorType::Grayscale, png::BitDepth::Eight, false),
    ]
}

/// The pixel limit the image targets run under: small, so lying headers trip it.
const MAX_PIXELS: u64 = 1 << 16;

proptest! {
    #![proptest_config(config(300_000))]

    /// Any bytes: an error, or pixels within the limit that fill exactly their buffer.
    #[test]
    fn image_decoding_stays_within_its_limits(
        file in inputs(image_seeds()),
        grey in any::<bool>(),
        at_least in prop::option::of(1..64u32),
    ) {
        if let Ok(px) = decode(&file, grey, MAX_PIXELS, |_, _| at_least) {
            prop_assert!(px.width as u64 * px.height as u64 <= MAX_PIXELS);
            prop_assert!(px.channels == 1 || px.channels == 3);
            prop_assert_eq!(
                px.data.len(),
                px.width as usize * px.height as usize * px.channels as usize
            );
        }
    }

    /// The preprocessing of an image folder's sample (an image and an index mask, resized
    /// together): an error, or values of the sizes the resize rule gives.
    #[test]
    fn image_preprocessing_stays_within_its_limits(
        image in inputs(image_seeds()),
        mask in inputs(image_seeds()),
        shorter in prop::sample::select(vec![0u32, 8, 20]),
    ) {
        let p = Preprocess::Images {
            ops: vec![
                FieldOp::rgb(),
                FieldOp::Decode { mode: ImageMode::Index, scale: 1, resample: Resample::Nearest, upright: false },
            ],
            resize: Resize { shorter, max_size: None, square: false, keep_crop: None },
        };
        let limits = Limits { max_image_pixels: MAX_PIXELS, ..Limits::default() };
        let raw = vec![
            larder::fields::Value::new(vec![image.len() as u32], image),
            larder::fields::Value::new(vec![mask.len() as u32], mask),
        ];
        if let Ok(values) = p.apply(raw, &limits) {
            prop_assert_eq!(values.len(), 2);
            let (img, m) = (&values[0], &values[1]);
            prop_assert_eq!(&img.dims[1..], &m.dims[..], "the mask follows the image");
            let n: u64 = img.dims.iter().map(|&d| d as u64).product();
            prop_assert_eq!(n, img.data.len() as u64);
        }
    }

    /// An image kept at its eval crop, a JPEG decoded by region through libjpeg (the C shim
    /// and its longjmp errors): whatever the file holds, an error or crop x crop pixels (or the
    /// image whole, where it is kept smaller than the crop).
    #[test]
    fn images_kept_at_their_crop_stay_within_their_limits(
        image in inputs(image_seeds()),
        (shorter, crop) in prop::sample::select(vec![(8u32, 8u32), (20, 16), (20, 24)]),
    ) {
        let p = Preprocess::Images {
            ops: vec![FieldOp::rgb()],
            resize: Resize { shorter, max_size: None, square: false, keep_crop: Some(crop) },
        };
        let limits = Limits { max_image_pixels: MAX_PIXELS, ..Limits::default() };
        let raw = vec![larder::fields::Value::new(vec![image.len() as u32], image)];
        if let Ok(values) = p.apply(raw, &limits) {
            let v = &values[0];
            let n: u64 = v.dims.iter().map(|&d| d as u64).product();
            prop_assert_eq!(n, v.data.len() as u64);
            if crop <= shorter {
                prop_assert_eq!(&v.dims[..], &[3, crop, crop][..]);
            }
        }
    }

    /// An image turned upright by its EXIF orientation (Hugging Face images): whatever the
    /// EXIF segment holds, an error or a value whose dims match its bytes.
    #[test]
    fn images_turned_upright_stay_within_their_limits(
        image in inputs(image_seeds()),
        shorter in prop::sample::select(vec![0u32, 8, 20]),
    ) {
        let p = Preprocess::Images {
            ops: vec![FieldOp::Decode {
                mode: ImageMode::Rgb,
                scale: 1,
                resample: Resample::Linear,
                upright: true,
            }],
            resize: Resize { shorter, max_size: None, square: false, keep_crop: None },
        };
        let limits = Limits { max_image_pixels: MAX_PIXELS, ..Limits::default() };
        let raw = vec![larder::fields::Value::new(vec![image.len() as u32], image)];
        if let Ok(values) = p.apply(raw, &limits) {
            let n: u64 = values[0].dims.iter().map(|&d| d as u64).product();
            prop_assert_eq!(n, values[0].data.len() as u64);
        }
    }
}

// ---- records -------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(200_000))]

    /// A record as the tiers keep it (variable dims in a header, then each field's bytes),
    /// any bytes: its fields, each exactly its dims' bytes and together the whole record, or
    /// an error.
    #[test]
    fn records_split_into_their_fields_or_fail(
        record in inputs(vec![record_seed()]),
    ) {
        let schema = record_schema();
        if let Ok(views) = schema.decode(&record) {
            let mut total = 4 * 3; // three variable dims in the header
            for (f, v) in schema.fields.iter().zip(&views) {
                prop_assert_eq!(v.data.len(), larder::fields::bytes_of(f.dtype.size(), &v.dims));
                total += v.data.len();
            }
            prop_assert_eq!(total, record.len());
        }
    }
}

/// An image [3, H, W] uint8, a clip [T] int16 and a label: two variable dims and one.
fn record_schema() -> larder::fields::Schema {
    use larder::fields::{DType, FieldSpec, Schema};
    Schema::new(vec![
        FieldSpec::new("image", DType::Uint8, vec![Some(3), None, None]),
        FieldSpec::new("clip", DType::Int16, vec![None]),
        FieldSpec::fixed("label", DType::Int64, &[]),
    ])
    .unwrap()
}

fn record_seed() -> Vec<u8> {
    use larder::fields::Value;
    record_schema()
        .encode(&[
            Value::new(vec![3, 4, 5], (0..60).collect()),
            Value::new(vec![7], (0..14).collect()),
            Value::int64(9),
        ])
        .unwrap()
}

// ---- config ---------------------------------------------------------------------------

const CONFIG: &str = r#"
listen = "127.0.0.1:7878"
unix_socket = "/run/larder/larder.sock"
unix_socket_mode = 438
max_batch_size = 1024
prefetch_batches = 4
[memory]
budget_bytes = 1000000
expansion_factor = 2.5
[scratch]
dir = "/var/cache/larder"
shard_bytes = 1048576
[shm]
budget_bytes = 16000000
[limits]
max_image_pixels = 1000000
max_sample_bytes = 1000000
[[dataset]]
name = "train"
path = "/data/train.h5"
labels = "labels"
on_error = "skip"
[[dataset]]
name = "pics"
kind = "images"
path = "/data/pics"
resize = 256
crop = 224
[dataset.train]
flip = true
scale = [0.08, 1.0]
[[dataset.field]]
name = "image"
[[dataset.field]]
name = "mask"
folder = "masks"
mode = "index"
pair = { with = "image", scale = 1 }
"#;

proptest! {
    #![proptest_config(config(200_000))]

    /// Any text: a config or an error, never a panic (the config is an admin's file today and
    /// a user's dataset table once users register datasets).
    #[test]
    fn config_parsing_never_panics(text in inputs(vec![CONFIG.as_bytes().to_vec()])) {
        let _ = Config::parse(&String::from_utf8_lossy(&text));
    }
}

#[test]
fn the_config_seed_is_valid() {
    Config::parse(CONFIG).unwrap();
}

// ---- the ring handshake ---------------------------------------------------------------

fn ring_request(slots: u32, slot_bytes: u64) -> Vec<u8> {
    let mut r = MAGIC.to_vec();
    r.extend_from_slice(&1u32.to_le_bytes());
    r.extend_from_slice(&slots.to_le_bytes());
    r.extend_from_slice(&slot_bytes.to_le_bytes());
    r
}

/// The budget of the handshake target's rings.
const RING_BUDGET: u64 = HEADER_BYTES + 16 * 4096;

/// Sends `bytes` as a new Unix-socket connection would, closes its side, and checks the
/// daemon's answer: no answer, or a refusal, or a ring within the budget with at least the
/// slot bytes asked for; and once the client is gone, no ring left open.
async fn handshake(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let rings = Rings::new(RING_BUDGET);
    let (trigger, stop) = shutdown::channel();
    let (mut client, server) = tokio::net::UnixStream::pair().unwrap();
    let daemon = {
        let rings = rings.clone();
        tokio::spawn(async move {
            if let Ok(true) = shm::is_ring_request(&server).await {
                rings.serve(server, stop).await;
            }
        })
    };
    let _ = client.write_all(&bytes).await;
    let _ = client.shutdown().await;
    let mut reply = vec![];
    let read = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut reply));
    prop_assert!(read.await.is_ok(), "the daemon left the handshake hanging");
    if reply.len() >= 56 {
        let status = u32::from_le_bytes(reply[..4].try_into().unwrap());
        let asked = bytes
            .get(16..24)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()));
        if status == 0 {
            let size = u64::from_le_bytes(reply[8..16].try_into().unwrap());
            let slot_bytes = u64::from_le_bytes(reply[24..32].try_into().unwrap());
            prop_assert!(size <= RING_BUDGET, "a ring of {size} over the budget");
            prop_assert!(slot_bytes >= asked.unwrap_or(0), "slots smaller than asked");
            prop_assert!(slot_bytes > 0);
        }
    } else {
        prop_assert!(reply.is_empty(), "a short reply: {reply:?}");
    }
    drop(client);
    let ended = tokio::time::timeout(Duration::from_secs(5), daemon).await;
    prop_assert!(ended.is_ok(), "the ring's connection outlived its client");
    prop_assert_eq!(rings.snapshot().1, 0, "a ring's bytes outlived its client");
    drop(trigger);
    Ok(())
}

proptest! {
    #![proptest_config(config(100_000))]

    #[test]
    fn ring_handshakes_stay_within_the_budget(
        bytes in inputs(vec![
            ring_request(4, 4096),
            ring_request(1, 1),
            ring_request(16, 4096),
            ring_request(1, u64::MAX),
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec(),
        ]),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(handshake(bytes))?;
    }
}

// ---- scratch shards -------------------------------------------------------------------

fn record(i: u64) -> Vec<u8> {
    (0..(i * 37 % 200 + 1))
        .map(|o| (i * 31 + o * 7) as u8)
        .collect()
}

/// Shard files of 30 records, written once: (file name, bytes) for each.
fn shard_seed() -> &'static [(String, Vec<u8>)] {
    static SEED: std::sync::OnceLock<Vec<(String, Vec<u8>)>> = std::sync::OnceLock::new();
    SEED.get_or_init(write_shards)
}

fn write_shards() -> Vec<(String, Vec<u8>)> {
    let dir = tempfile::tempdir().unwrap();
    let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
    let tier = ScratchTier::open(&space, "ds", 7, 30, 100, 2048).unwrap();
    for i in 0..30 {
        assert!(tier.write(i, &record(i)));
    }
    let files: Vec<_> = tier
        .shard_files()
        .into_iter()
        .map(|p| {
            let name = p
                .strip_prefix(dir.path())
                .unwrap()
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    assert!(files.len() >= 3, "several shards");
    files
}

proptest! {
    #![proptest_config(config(8_000))]

    /// One shard file changed on disk (a bad sector, a crash, someone else's write): a
    /// restarted daemon serves each record as written or not at all, never other bytes.
    #[test]
    fn scratch_shards_serve_what_was_written_or_nothing(
        which in any::<prop::sample::Index>(),
        ops in prop::collection::vec(mutation(), 1..6),
    ) {
        let seed = shard_seed();
        let dir = tempfile::tempdir().unwrap();
        let hit = which.index(seed.len());
        for (k, (name, bytes)) in seed.iter().enumerate() {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let bytes = if k == hit { mutate(bytes.clone(), &ops) } else { bytes.clone() };
            std::fs::write(&path, bytes).unwrap();
        }
        let space = ScratchSpace::open(dir.path(), Some(1 << 20)).unwrap();
        let tier = ScratchTier::open(&space, "ds", 7, 30, 100, 2048).unwrap();
        for i in 0..30 {
            if let Some(got) = tier.read(i) {
                prop_assert_eq!(&got[..], &record(i)[..], "record {} served wrong", i);
            }
        }
    }
}
