//! Hostile and careless input, tried as another local user would: ring requests whose sizes
//! overflow, handshakes left half-open, datasets that do not open, files truncated while
//! served, images whose headers lie or claim billions of pixels, files that are not files.
//! Each test failed on the daemon before its fix.

mod common;

use common::check_contents;
use larder::client::{collect_batches, connect, Client};
use larder::config::Config;
use larder::proto::{GetStatsRequest, ListBadSamplesRequest, StreamBatchesRequest};
use larder::server::Daemon;
use larder::synthetic::make_dataset;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};
use tonic::Code;

/// larderd, the installed program, on a Unix socket in `dir` with `extra` config lines; killed
/// when dropped.
struct Larderd {
    child: Child,
    socket: PathBuf,
}

impl Larderd {
    fn start(dir: &Path, extra: &str) -> Larderd {
        make_dataset(&dir.join("train.h5"), 64, &[3, 8, 8]).unwrap();
        let socket = dir.join("larder.sock");
        let config = dir.join("larder.toml");
        std::fs::write(
            &config,
            format!(
                "unix_socket = {socket:?}\n{extra}\n[scratch]\nenabled = false\n\
                 [[dataset]]\nname = \"train\"\npath = \"train.h5\"\nlabels = \"labels\"\n"
            ),
        )
        .unwrap();
        let child = common::spawn_larderd(&config, &socket);
        Larderd { child, socket }
    }

    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id()))
            .unwrap()
            .count()
    }

    /// CPU seconds the daemon has used (user + system), from /proc/PID/stat.
    fn cpu_seconds(&self) -> f64 {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap();
        let after_name = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after_name.split(' ').collect();
        let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
        // SAFETY: sysconf with a constant name has no memory effects.
        ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
    }

    async fn client(&self) -> Client {
        connect(&format!("unix:{}", self.socket.display()))
            .await
            .unwrap()
    }

    fn ring(&self, slots: u32, slot_bytes: u64) -> (UnixStream, u32, String) {
        ring(&self.socket, slots, slot_bytes)
    }
}

/// A raw ring request on `socket`; the connection, the reply's status (0: made, 2: over the
/// budget) and its message.
fn ring(socket: &Path, slots: u32, slot_bytes: u64) -> (UnixStream, u32, String) {
    let mut s = UnixStream::connect(socket).unwrap();
    let mut req = b"LARDRING".to_vec();
    req.extend_from_slice(&1u32.to_le_bytes());
    req.extend_from_slice(&slots.to_le_bytes());
    req.extend_from_slice(&slot_bytes.to_le_bytes());
    s.write_all(&req).unwrap();
    let mut head = [0u8; 56];
    s.read_exact(&mut head).unwrap();
    let status = u32::from_le_bytes(head[..4].try_into().unwrap());
    let len = u32::from_le_bytes(head[4..8].try_into().unwrap()) as usize;
    let mut msg = vec![0u8; len];
    s.read_exact(&mut msg).unwrap();
    (s, status, String::from_utf8_lossy(&msg).into_owned())
}

impl Drop for Larderd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_sizes_that_overflow_are_refused_and_the_budget_holds() {
    let dir = tempfile::tempdir().unwrap();
    let budget: u64 = 1 << 20;
    // One user (this test's) may take the whole budget here (root or not): the budget is
    // what is tried.
    let d = Larderd::start(
        dir.path(),
        &format!("[shm]\nbudget_bytes = {budget}\nuser_bytes = {budget}"),
    );
    // A slot size whose round-up to whole pages wraps (it was accepted, slots of 0 bytes).
    for slot_bytes in [u64::MAX, u64::MAX - 4095, 1 << 63] {
        let (_s, status, msg) = d.ring(1, slot_bytes);
        assert_eq!(status, 2, "RESOURCE_EXHAUSTED for {slot_bytes}: {msg}");
        assert!(msg.contains("shm.budget_bytes"), "{msg}");
    }
    // The budget full, then sizes chosen so that used + size wraps around 2^64, raced against
    // small requests from other threads: never more rings than the budget holds.
    let (held, status, msg) = d.ring(3, 256 << 10);
    assert_eq!(status, 0, "{msg}");
    let used = 4096 + 3 * (256 << 10);
    let wrap = u64::MAX - used + 1 + 4096;
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let socket = d.socket.clone();
            std::thread::spawn(move || {
                let mut kept = vec![];
                for _ in 0..50 {
                    let size = if t % 2 == 0 { wrap } else { 4096 };
                    let (s, status, _) = ring(&socket, 1, size);
                    if status == 0 {
                        kept.push(s);
                    }
                }
                kept
            })
        })
        .collect();
    let kept: Vec<UnixStream> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let stats = d
        .client()
        .await
        .get_stats(GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        stats.shm_bytes <= budget,
        "{} bytes in rings over a budget of {budget}",
        stats.shm_bytes
    );
    assert!(
        kept.len() <= ((budget - used) / 8192) as usize,
        "{}",
        kept.len()
    );
    drop((held, kept));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_handshakes_are_closed_at_once_and_cost_no_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let d = Larderd::start(dir.path(), "");
    // One stream first, so the daemon's runtime and workers are up.
    let batches = collect_batches(
        &mut d.client().await,
        StreamBatchesRequest {
            dataset: "train".into(),
            batch_size: 16,
            world_size: 1,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(batches.len(), 4);
    std::thread::sleep(Duration::from_millis(300));
    let before = d.fds();
    // 500 clients say the first half of the ring magic and hang up.
    for _ in 0..500 {
        let mut s = UnixStream::connect(&d.socket).unwrap();
        s.write_all(b"LARD").unwrap();
    }
    let waited = Instant::now();
    while d.fds() > before + 4 && waited.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        d.fds() <= before + 4,
        "{} descriptors 5 s after the clients left, {before} before",
        d.fds()
    );
    // 200 that say it and stay: waiting for the rest of the magic costs (almost) nothing.
    let held: Vec<UnixStream> = (0..200)
        .map(|_| {
            let mut s = UnixStream::connect(&d.socket).unwrap();
            s.write_all(b"LARD").unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let cpu = d.cpu_seconds();
    std::thread::sleep(Duration::from_secs(2));
    let used = d.cpu_seconds() - cpu;
    assert!(
        used < 0.2,
        "{used:.2} CPU seconds in 2 s for 200 silent handshakes"
    );
    drop(held);
}

/// A daemon (in this process) serving `datasets`, TOML tables, with `extra` top-level lines, on
/// a Unix socket (this test's user, root in CI, sees why a dataset does not open).
async fn daemon(dir: &Path, extra: &str, datasets: &str) -> Daemon {
    let config = Config::parse(&format!(
        "unix_socket = {:?}\nmax_batch_size = 1000\n{extra}\n[scratch]\nenabled = false\n\
         dir = {:?}\n[memory]\nbudget_bytes = 1000\n{datasets}",
        dir.join("larder.sock"),
        dir.join("scratch")
    ))
    .unwrap();
    Daemon::start(config).await.unwrap()
}

fn req(dataset: &str, batch_size: u32) -> StreamBatchesRequest {
    StreamBatchesRequest {
        dataset: dataset.into(),
        batch_size,
        world_size: 1,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dataset_that_does_not_open_is_reported_and_the_others_served() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    make_dataset(&p.join("good.h5"), 40, &[2, 4, 4]).unwrap();
    make_dataset(&p.join("cut.h5"), 40, &[2, 4, 4]).unwrap();
    let cut = std::fs::read(p.join("cut.h5")).unwrap();
    std::fs::write(p.join("cut.h5"), &cut[..cut.len() / 3]).unwrap();
    let file = hdf5::File::create(p.join("strings.h5")).unwrap();
    let names: Vec<hdf5::types::VarLenUnicode> =
        ["a", "b"].iter().map(|s| s.parse().unwrap()).collect();
    file.new_dataset_builder()
        .with_data(&names)
        .create("images")
        .unwrap();
    drop(file);
    // A shape claiming 10 GB a sample, in a file of a few KB (chunks never written).
    let file = hdf5::File::create(p.join("huge.h5")).unwrap();
    file.new_dataset::<u8>()
        .chunk((1, 1000, 1000))
        .shape((10, 100_000, 100_000))
        .create("images")
        .unwrap();
    drop(file);
    let table = |name: &str| {
        format!(
            "[[dataset]]\nname = \"{name}\"\ntcp = true\npath = {:?}\n",
            p.join(format!("{name}.h5"))
        )
    };
    // Files whose data lies elsewhere (another user's file, as far as the check knows): an
    // external link, and external raw storage.
    let file = hdf5::File::create(p.join("linked.h5")).unwrap();
    file.link_external(p.join("good.h5").to_str().unwrap(), "images", "images")
        .unwrap();
    drop(file);
    std::fs::write(p.join("raw.bin"), vec![7u8; 40 * 32]).unwrap();
    let file = hdf5::File::create(p.join("efl.h5")).unwrap();
    file.new_dataset::<u8>()
        .shape((40, 2, 4, 4))
        .external(p.join("raw.bin").to_str().unwrap(), 0, 40 * 32)
        .create("images")
        .unwrap();
    drop(file);
    // A FIFO where the file should be: HDF5 would wait for a writer forever, holding its lock.
    let fifo = std::ffi::CString::new(p.join("fifo.h5").to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    // An external link to a FIFO: following it would block HDF5's open (and its one lock).
    let file = hdf5::File::create(p.join("tofifo.h5")).unwrap();
    file.link_external(p.join("fifo.h5").to_str().unwrap(), "images", "images")
        .unwrap();
    drop(file);
    let tables = [
        "good", "cut", "strings", "missing", "huge", "fifo", "linked", "efl", "tofifo",
    ]
    .map(table)
    .concat();
    let d = daemon(p, "listen = \"127.0.0.1:0\"", &tables).await;
    let unix = format!("unix:{}", d.unix_socket.as_ref().unwrap().display());
    let mut c = connect(&unix).await.unwrap();
    let batches = collect_batches(&mut c, req("good", 8)).await.unwrap();
    assert_eq!(
        batches.iter().map(|b| b.sample_ids.len()).sum::<usize>(),
        40
    );
    for (name, why) in [
        ("cut", "cut.h5"),
        ("strings", "images"),
        ("missing", "missing.h5"),
        ("huge", "limits.max_sample_bytes"),
        ("fifo", "not a regular file"),
        ("linked", "external link"),
        ("efl", "external raw files"),
        ("tofifo", "external link"),
    ] {
        let status = c.stream_batches(req(name, 8)).await.expect_err("refused");
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        assert!(status.message().contains("did not open"), "{status:?}");
        assert!(status.message().contains(why), "{status:?}");
    }
    // Why (paths, sizes) is for root and the daemon's user: a TCP client is not told.
    let mut tcp = connect(&d.client_addr()).await.unwrap();
    let status = tcp
        .stream_batches(req("missing", 8))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(!status.message().contains("missing.h5"), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hdf5_file_truncated_while_served_is_never_served_as_zeros() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("train.h5");
    make_dataset(&path, 1500, &[2, 4, 4]).unwrap();
    let tables = format!(
        "[[dataset]]\nname = \"train\"\ntcp = true\npath = {path:?}\nlabels = \"labels\"\n"
    );
    let d = daemon(dir.path(), "", &tables).await;
    let mut c = connect(&d.client_addr()).await.unwrap();
    let first = collect_batches(&mut c, req("train", 100)).await.unwrap();
    common::check_epoch(&first, 1500);

    // Cut mid-stream: what came before the cut is right, and the stream then fails, saying so.
    let mut stream = c
        .stream_batches(req("train", 10))
        .await
        .unwrap()
        .into_inner();
    let mut got = vec![stream.message().await.unwrap().unwrap()];
    let bytes = std::fs::read(&path).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(bytes.len() as u64 / 3)
        .unwrap();
    let end = loop {
        match stream.message().await {
            Ok(Some(b)) => got.push(b),
            Ok(None) => panic!("the stream ended as if the file were whole"),
            Err(status) => break status,
        }
    };
    check_contents(&got);
    assert_eq!(end.code(), Code::FailedPrecondition, "{end:?}");
    assert!(
        end.message().contains("changed since the daemon opened it"),
        "{end:?}"
    );
    assert!(end.message().contains("size went from"), "{end:?}");
    // The next stream opens the file again, freshly, as it is now (HDF5 refuses it whole:
    // "truncated file"), and says so; until the ended stream's tasks have let go of the old
    // version, it says that instead.
    let started = Instant::now();
    let status = loop {
        let status = c
            .stream_batches(req("train", 10))
            .await
            .expect_err("refused");
        assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
        let waiting = status.message().contains("once the streams still reading");
        if !waiting || started.elapsed() > Duration::from_secs(10) {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.message().contains("truncated file"), "{status:?}");
    let bad = c
        .list_bad_samples(ListBadSamplesRequest {
            dataset: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(bad.samples.is_empty(), "a changed file blames no sample");
}

/// A JPEG of `w` x `h` grey-and-colour gradient pixels.
fn jpeg(w: usize, h: usize) -> Vec<u8> {
    let px: Vec<u8> = (0..w * h * 3).map(|i| (i % 251) as u8).collect();
    let image = turbojpeg::Image {
        pixels: &px[..],
        width: w,
        pitch: w * 3,
        height: h,
        format: turbojpeg::PixelFormat::RGB,
    };
    turbojpeg::compress(image, 90, turbojpeg::Subsamp::Sub2x2)
        .unwrap()
        .to_vec()
}

/// `jpeg` with the size in its frame header (SOF0) replaced: a header that lies.
fn lying(jpeg: &[u8], w: u16, h: u16) -> Vec<u8> {
    let mut out = jpeg.to_vec();
    let sof = out.windows(2).position(|m| m == [0xFF, 0xC0]).unwrap();
    out[sof + 5..sof + 7].copy_from_slice(&h.to_be_bytes());
    out[sof + 7..sof + 9].copy_from_slice(&w.to_be_bytes());
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lying_headers_bombs_and_files_that_are_not_files_are_bad_samples() {
    let dir = tempfile::tempdir().unwrap();
    let cls = dir.path().join("pics/cls");
    std::fs::create_dir_all(&cls).unwrap();
    for i in 0..6 {
        std::fs::write(cls.join(format!("good{i}.jpg")), jpeg(16, 16)).unwrap();
    }
    let small = jpeg(16, 16);
    // Served as a solid grey image before.
    std::fs::write(cls.join("lies.jpg"), lying(&small, 16, 2000)).unwrap();
    // 10000 x 10000 from a few hundred bytes: 860 MiB of daemon before.
    let bomb = lying(&small, 10000, 10000);
    assert!(bomb.len() < 1000);
    std::fs::write(cls.join("bomb.jpg"), &bomb).unwrap();
    // Over the sample limit once decoded (48 KiB as stored, the limit 40 KiB).
    std::fs::write(cls.join("big.jpg"), jpeg(128, 128)).unwrap();
    // Not regular files: a device behind a symlink, and a FIFO nobody writes to.
    std::os::unix::fs::symlink("/dev/zero", cls.join("zero.jpg")).unwrap();
    let fifo = std::ffi::CString::new(cls.join("fifo.jpg").to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
    let tables = format!(
        "[[dataset]]\nname = \"pics\"\ntcp = true\nkind = \"images\"\nresize = 0\ncrop = 0\npath = {:?}\n",
        dir.path().join("pics")
    );
    let d = daemon(dir.path(), "[limits]\nmax_sample_bytes = 40000", &tables).await;
    let mut c = connect(&d.client_addr()).await.unwrap();
    let epoch = tokio::time::timeout(
        Duration::from_secs(30),
        collect_batches(
            &mut c,
            StreamBatchesRequest {
                fields: vec!["image".into()],
                layout_version: 1,
                ..req("pics", 1)
            },
        ),
    )
    .await
    .expect("the epoch ends")
    .unwrap();
    let bad = c
        .list_bad_samples(ListBadSamplesRequest {
            dataset: "pics".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .samples;
    let served: Vec<u64> = epoch.iter().flat_map(|b| b.sample_ids.clone()).collect();
    assert_eq!(
        served.len(),
        6,
        "the six good images, {served:?}; bad: {bad:?}"
    );
    for b in epoch.iter().filter(|b| !b.sample_ids.is_empty()) {
        assert_eq!(b.fields[0].shape, vec![1, 3, 16, 16]);
    }
    let why = |file: &str| -> String {
        bad.iter()
            .find(|s| s.error.contains(file))
            .unwrap_or_else(|| panic!("{file} not bad: {bad:?}"))
            .error
            .clone()
    };
    assert!(
        why("lies.jpg").contains("premature end"),
        "{}",
        why("lies.jpg")
    );
    assert!(
        why("bomb.jpg").contains("max_image_pixels"),
        "{}",
        why("bomb.jpg")
    );
    assert!(
        why("big.jpg").contains("max_sample_bytes"),
        "{}",
        why("big.jpg")
    );
    // The device and the FIFO are not image files, so never samples (and a file that turns
    // into one after the walk is opened without blocking and refused as not a regular file).
    assert_eq!(bad.len(), 3, "{bad:?}");
    let stats = connect(&d.client_addr())
        .await
        .unwrap()
        .get_stats(GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        stats.memory_bytes < 1 << 20,
        "no bad sample in the memory tier: {} bytes",
        stats.memory_bytes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_the_message_limit_through_variable_fields_is_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clips.h5");
    let file = hdf5::File::create(&path).unwrap();
    let clips: Vec<hdf5::types::VarLenArray<i16>> = (0..100)
        .map(|i| hdf5::types::VarLenArray::from_slice(&vec![i as i16; 10_000]))
        .collect();
    file.new_dataset_builder()
        .with_data(&clips)
        .create("clip")
        .unwrap();
    drop(file);
    let tables = format!(
        "[[dataset]]\nname = \"clips\"\ntcp = true\npath = {path:?}\n\
         [[dataset.field]]\nname = \"clip\"\nhdf5 = \"clip\"\n"
    );
    // 20 KB a clip, 1 MB a message: a batch of 20 fits, one of 80 does not.
    let d = daemon(dir.path(), "[limits]\nmax_batch_bytes = 1000000", &tables).await;
    let mut c = connect(&d.client_addr()).await.unwrap();
    let clip = |batch_size| StreamBatchesRequest {
        fields: vec!["clip".into()],
        layout_version: 1,
        ..req("clips", batch_size)
    };
    let fits = collect_batches(&mut c, clip(20)).await.unwrap();
    assert_eq!(fits.len(), 5);
    let err = collect_batches(&mut c, clip(80)).await.unwrap_err();
    let status = err
        .chain()
        .find_map(|e| e.downcast_ref::<tonic::Status>())
        .unwrap_or_else(|| panic!("{err:#}"));
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().contains("ask for a smaller batch_size"),
        "{status:?}"
    );
}
