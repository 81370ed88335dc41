//! The daemon's side of a reader against fake readers that speak the protocol, honestly and
//! not: every lie is refused with the dataset named, silence is found in seconds, and a reader
//! that works long but says it is alive is waited for.

use super::*;
use crate::fields::{DType, FieldSpec, Schema};
use crate::privsep::wire::Writer;

/// What a fake reader answers to a `Load` of samples 0..2 (after an honest `Open`).
#[derive(Clone, Copy)]
enum Lie {
    Honest,
    PastTheEnd,
    NotTheSchema,
    Unsealed,
    WrongCount,
    Twice,
    NotAsked,
    Silent,
    Gone,
    /// Answers with no samples, again and again, and never ends the load.
    Empty,
    /// Says it is alive a hundred times over.
    Chatty,
    /// Says it is alive every half second, and answers after `SLOW`.
    Slow,
}

const SLOW: Duration = Duration::from_secs(6);

/// An honest `Opened`: two samples of one uint8 [4] field.
fn honest_opened() -> protocol::Opened {
    protocol::Opened {
        kind: "hdf5".into(),
        len: 2,
        granule: 1,
        disk_bytes: 8,
        describe: "fake".into(),
        version: "v1".into(),
        root: "/fake".into(),
        preprocess: "Identity".into(),
        schema: Schema::new(vec![FieldSpec::fixed("x", DType::Uint8, &[4])]).unwrap(),
        sizes: Sizes::Each(4),
    }
}

fn send(fd: RawFd, kind: Kind, id: u64, payload: &[u8], memfd: Option<&OwnedFd>) {
    let fds: Vec<RawFd> = memfd.iter().map(|f| f.as_raw_fd()).collect();
    let _ = wire::send(fd, kind.into(), id, payload, &fds);
}

/// A `Samples` answer for `samples` of `n` bytes each, records in a memfd.
fn samples(samples: &[(u64, u64, u64)], record_bytes: usize, sealed: bool) -> (Vec<u8>, OwnedFd) {
    let table: Vec<(u64, Outcome)> = samples
        .iter()
        .map(|&(i, at, len)| (i, Outcome::Record { at, len }))
        .collect();
    let mut w = Writer::default();
    protocol::write_samples(&mut w, &table);
    let memfd = match sealed {
        true => wire::sealed_memfd("r", &vec![7u8; record_bytes]).unwrap(),
        false => {
            let f = tempfile::tempfile().unwrap();
            std::io::Write::write_all(&mut &f, &vec![7u8; record_bytes]).unwrap();
            OwnedFd::from(f)
        }
    };
    (w.0, memfd)
}

/// The reader's end of a fake reader that opens honestly and answers loads with `lie`.
fn fake(lie: Lie, opened: protocol::Opened) -> OwnedFd {
    let (daemon_end, reader_end) = wire::pair().unwrap();
    std::thread::spawn(move || {
        let fd = reader_end.as_raw_fd();
        while let Ok(Some(m)) = wire::recv(fd) {
            match Kind::try_from(m.kind).unwrap() {
                Kind::Hello => send(fd, Kind::Hello, m.id, &protocol::hello(), None),
                Kind::Open => {
                    let list = wire::path_list([PathBuf::from("/fake")].iter());
                    let walk = wire::sealed_memfd("w", &list).unwrap();
                    send(fd, Kind::Walked, m.id, &[], Some(&walk));
                    send(fd, Kind::Opened, m.id, &opened.write(), None);
                }
                Kind::Load => {
                    let honest = [(0, 0, 4), (1, 4, 4)];
                    let (table, memfd) = match lie {
                        Lie::Honest | Lie::Slow => samples(&honest, 8, true),
                        Lie::PastTheEnd => samples(&honest, 6, true),
                        Lie::NotTheSchema => samples(&[(0, 0, 3), (1, 3, 5)], 8, true),
                        Lie::Unsealed => samples(&honest, 8, false),
                        Lie::WrongCount => samples(&honest[..1], 4, true),
                        Lie::Twice => samples(&[(0, 0, 4), (0, 4, 4)], 8, true),
                        Lie::NotAsked => {
                            send(fd, Kind::Done, m.id + 1000, &protocol::done(8, 2), None);
                            continue;
                        }
                        Lie::Silent => continue,
                        Lie::Gone => return,
                        Lie::Empty => {
                            let mut w = Writer::default();
                            protocol::write_samples(&mut w, &[]);
                            send(fd, Kind::Samples, m.id, &w.0, None);
                            continue;
                        }
                        Lie::Chatty => {
                            for _ in 0..100 {
                                send(fd, Kind::Alive, 0, &protocol::alive(0), None);
                            }
                            continue;
                        }
                    };
                    if let Lie::Slow = lie {
                        let began = Instant::now();
                        while began.elapsed() < SLOW {
                            std::thread::sleep(protocol::ALIVE_EVERY);
                            send(fd, Kind::Alive, 0, &protocol::alive(0), None);
                        }
                    }
                    send(fd, Kind::Samples, m.id, &table, Some(&memfd));
                    let n = match lie {
                        Lie::WrongCount => 1,
                        _ => 2,
                    };
                    send(fd, Kind::Done, m.id, &protocol::done(8, n), None);
                }
                _ => {}
            }
        }
    });
    daemon_end
}

/// A dataset at `path` of two samples of one uint8 [4] field, read by a fake reader.
async fn opened_by(lie: Lie, path: &str, opened: protocol::Opened) -> Result<Opened> {
    let table = format!("name = \"u/x\"\npath = \"{path}\"");
    let c = DatasetConfig::from_table(toml::from_str(&table).unwrap()).unwrap();
    let user = User {
        uid: 1000,
        gid: 1000,
        groups: vec![],
    };
    let reader = greet(Connection::over(fake(lie, opened), None, Arc::default())?).await?;
    from_reader(
        None,
        user,
        &c,
        &Limits::default(),
        reader,
        (&Footprint::unlimited(), Payer::Config),
    )
    .await
}

/// The error a load of samples 0..2 from a reader that lies with `lie` ends in.
async fn lied_to(lie: Lie) -> anyhow::Error {
    let opened = opened_by(lie, "/fake", honest_opened()).await.unwrap();
    let p = opened.source.prepared().unwrap();
    let started = Instant::now();
    let err = p.load(&[(0, 2)]).await.unwrap_err();
    assert!(started.elapsed() < protocol::SILENT_WITHIN + Duration::from_secs(2));
    assert_eq!(Error::kind_of(&err), ErrorKind::Reader, "{err:#}");
    assert!(
        format!("{err:#}").contains("\"u/x\" is not served now"),
        "{err:#}"
    );
    // The reader is done with: the next request says so at once.
    let again = p.load(&[(0, 1)]).await.unwrap_err();
    assert_eq!(Error::kind_of(&again), ErrorKind::Reader, "{again:#}");
    err
}

#[tokio::test]
async fn a_reader_that_lies_or_fails_costs_its_dataset_a_clear_error() {
    for (lie, says) in [
        (Lie::PastTheEnd, "past the end of the answer's records"),
        (Lie::NotTheSchema, "does not fit the dataset's fields"),
        (Lie::Unsealed, "not sealed"),
        (Lie::WrongCount, "1 samples for 2 asked"),
        (Lie::Twice, "answered twice"),
        (Lie::NotAsked, "not asked"),
        (Lie::Gone, "the reader process ended"),
        (Lie::Empty, "an answer of no samples"),
        (Lie::Chatty, "alive over 20 times a second"),
    ] {
        let err = format!("{:#}", lied_to(lie).await);
        assert!(err.contains(says), "{says}: {err}");
    }
}

#[tokio::test]
async fn a_silent_reader_is_found_in_seconds_and_a_working_one_is_waited_for() {
    let err = format!("{:#}", lied_to(Lie::Silent).await);
    assert!(err.contains("has said nothing for"), "{err}");
    // Longer than the silence allowed, but alive all along: answered.
    let opened = opened_by(Lie::Slow, "/fake", honest_opened())
        .await
        .unwrap();
    let loaded = opened
        .source
        .prepared()
        .unwrap()
        .load(&[(0, 2)])
        .await
        .unwrap();
    assert_eq!(loaded.raw_bytes, 8);
    assert!(loaded
        .records
        .iter()
        .all(|r| r.as_ref().unwrap() == &vec![7u8; 4]));
}

#[tokio::test]
async fn access_follows_the_walk_before_parsing_or_the_object_stores_path() {
    // The files users are checked against are those walked before any was parsed.
    let opened = opened_by(Lie::Honest, "/fake", honest_opened())
        .await
        .unwrap();
    let files = opened.source.files();
    assert!(
        matches!(files, crate::access::Files::Sealed(_)),
        "kept as it came"
    );
    assert_eq!(&files.to_list().unwrap()[..], &[PathBuf::from("/fake")]);
    assert_eq!(opened.source.disk_bytes_of(1), 4);
    // The reader says its files are /fake (which a user might read); the dataset is in an
    // object store, so access is checked against its URL, which only `allow` grants.
    let opened = opened_by(Lie::Honest, "s3://data/train", honest_opened())
        .await
        .unwrap();
    assert_eq!(
        &opened.source.files().to_list().unwrap()[..],
        &[PathBuf::from("s3://data/train")]
    );
}

#[tokio::test]
async fn an_open_over_its_owners_share_is_refused_before_its_sizes_are_read() {
    let table = "name = \"u/x\"\npath = \"/fake\"";
    let c = DatasetConfig::from_table(toml::from_str(table).unwrap()).unwrap();
    let user = User {
        uid: 1000,
        gid: 1000,
        groups: vec![],
    };
    // Sizes per sample for 2^30 samples: 4 GiB the reader asks the daemon to hold.
    let huge = protocol::Opened {
        len: 1 << 30,
        sizes: Sizes::PerSample,
        ..honest_opened()
    };
    let reader = greet(Connection::over(fake(Lie::Honest, huge), None, Arc::default()).unwrap())
        .await
        .unwrap();
    let account = Footprint::new(1 << 40, 1 << 20, None);
    let err = from_reader(
        None,
        user,
        &c,
        &Limits::default(),
        reader,
        (&account, Payer::User(1000)),
    )
    .await
    .err()
    .unwrap();
    let said = format!("{err:#}");
    assert!(
        said.contains("the sizes of its 1073741824 samples"),
        "{said}"
    );
    assert!(said.contains("limits.user_footprint_bytes"), "{said}");
    assert_eq!(account.total(), 0, "nothing is left charged");
}

#[tokio::test]
async fn what_a_readers_answers_take_is_charged_to_its_owner_while_held() {
    let table = "name = \"u/x\"\npath = \"/fake\"";
    let c = DatasetConfig::from_table(toml::from_str(table).unwrap()).unwrap();
    let user = User {
        uid: 1000,
        gid: 1000,
        groups: vec![],
    };
    let reader =
        greet(Connection::over(fake(Lie::Honest, honest_opened()), None, Arc::default()).unwrap())
            .await
            .unwrap();
    // A share that holds the walk (6 bytes) and one sample's record, not two.
    let account = Footprint::new(1 << 40, 10, None);
    let opened = from_reader(
        None,
        user,
        &c,
        &Limits::default(),
        reader,
        (&account, Payer::User(1000)),
    )
    .await
    .unwrap();
    let p = opened.source.prepared().unwrap();
    let err = format!("{:#}", p.load(&[(0, 2)]).await.unwrap_err());
    assert!(err.contains("limits.user_footprint_bytes"), "{err}");
    let one = p.load(&[(0, 1)]).await;
    // The fake answers two samples to any load: refused as not asked, or over the share.
    assert!(one.is_err());
    drop(opened);
    assert_eq!(account.total(), 0, "every charge comes back");
}

#[tokio::test]
async fn a_reader_of_another_version_is_refused() {
    let (daemon_end, reader_end) = wire::pair().unwrap();
    std::thread::spawn(move || {
        let fd = reader_end.as_raw_fd();
        if let Ok(Some(m)) = wire::recv(fd) {
            let mut w = Writer::default();
            w.u32(protocol::VERSION + 1);
            send(fd, Kind::Hello, m.id, &w.0, None);
        }
        std::thread::sleep(Duration::from_secs(1));
    });
    let err = greet(Connection::over(daemon_end, None, Arc::default()).unwrap())
        .await
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("protocol version"), "{err:#}");
}

/// Honest bytes cut short and with some bytes changed: hostile answers that get past the
/// first checks.
fn mutated(honest: Vec<u8>) -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
    use proptest::prelude::*;
    let n = honest.len();
    (
        proptest::collection::vec((0..n.max(1), any::<u8>()), 0..6),
        0..=n + 8,
        proptest::collection::vec(any::<u8>(), 0..8),
    )
        .prop_map(move |(flips, keep, tail)| {
            let mut b = honest.clone();
            for (i, v) in flips {
                if i < b.len() {
                    b[i] = v;
                }
            }
            b.truncate(keep);
            if keep > n {
                b.extend(tail);
            }
            b
        })
}

/// An honest `Samples` payload for samples 0..2, records inline.
fn honest_samples() -> Vec<u8> {
    let mut w = Writer::default();
    protocol::write_samples(
        &mut w,
        &[
            (0, Outcome::Record { at: 0, len: 4 }),
            (1, Outcome::Record { at: 4, len: 4 }),
        ],
    );
    w.0.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    w.0
}

/// A dataset opened from an `Opened` payload `opened`, whose reader answers every load with
/// `load` (inline) and `Done`.
fn with_answers(opened: Vec<u8>, load: Vec<u8>) -> Result<Opened> {
    let (daemon_end, reader_end) = wire::pair().unwrap();
    std::thread::spawn(move || {
        let fd = reader_end.as_raw_fd();
        while let Ok(Some(m)) = wire::recv(fd) {
            match Kind::try_from(m.kind).unwrap() {
                Kind::Hello => send(fd, Kind::Hello, m.id, &protocol::hello(), None),
                Kind::Open => {
                    let walk = wire::sealed_memfd("w", b"/fake\0").unwrap();
                    send(fd, Kind::Walked, m.id, &[], Some(&walk));
                    send(fd, Kind::Opened, m.id, &opened, None);
                }
                _ => {
                    send(fd, Kind::Samples, m.id, &load, None);
                    send(fd, Kind::Done, m.id, &protocol::done(8, 2), None);
                }
            }
        }
    });
    let opened = runtime().block_on(async {
        let reader = greet(Connection::over(daemon_end, None, Arc::default())?).await?;
        let table = "name = \"u/x\"\npath = \"/fake\"";
        let c = DatasetConfig::from_table(toml::from_str(table).unwrap()).unwrap();
        let user = User {
            uid: 1000,
            gid: 1000,
            groups: vec![],
        };
        from_reader(
            None,
            user,
            &c,
            &Limits::default(),
            reader,
            (&Footprint::unlimited(), Payer::Config),
        )
        .await
    });
    opened
}

/// One runtime for the property tests, whose readers' tasks it drives while they last.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    })
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(96))]

    /// Whatever a reader answers to `Load`, the daemon serves a sample only as the fields
    /// say it is (four bytes), else a clear error; it never panics or reads out of bounds.
    #[test]
    fn hostile_load_answers_are_refused_or_exact(payload in mutated(honest_samples())) {
        let opened = with_answers(honest_opened().write(), payload).unwrap();
        let p = opened.source.prepared().unwrap();
        match runtime().block_on(p.load(&[(0, 2)])) {
            Ok(loaded) => {
                proptest::prop_assert_eq!(loaded.records.len(), 2);
                for r in loaded.records.into_iter().flatten() {
                    proptest::prop_assert_eq!(r.len(), 4);
                }
            }
            Err(e) => {
                let said = format!("{e:#}");
                proptest::prop_assert!(said.contains("u/x"), "{}", said);
            }
        }
    }

    /// Whatever a reader answers to `Open`, the dataset opens as something consistent or
    /// not at all.
    #[test]
    fn hostile_open_answers_are_refused_or_consistent(payload in mutated(honest_opened().write())) {
        if let Ok(opened) = with_answers(payload, honest_samples()) {
            let s = &opened.source;
            proptest::prop_assert!(s.len() <= 1 << 40);
            for i in 0..s.len().min(4) {
                let _ = s.disk_bytes_of(i);
            }
        }
    }
}

#[test]
fn a_loads_ranges_are_sorted_apart_and_each_sample_found_in_the_answers_order() {
    let asked = Asked::new(&[(2, 3), (10, 1), (20, 2)], 30).unwrap();
    assert_eq!(asked.len(), 6);
    let at: Vec<_> = [2, 4, 10, 20, 21, 5, 9, 22, 0]
        .iter()
        .map(|&i| asked.position(i))
        .collect();
    assert_eq!(
        at,
        [
            Some(0),
            Some(2),
            Some(3),
            Some(4),
            Some(5),
            None,
            None,
            None,
            None
        ]
    );
    for bad in [
        &[(3, 2), (4, 1)][..],
        &[(5, 1), (2, 1)],
        &[(28, 3)],
        &[(0, 0)],
        &[],
    ] {
        assert!(Asked::new(bad, 30).is_err(), "{bad:?}");
    }
}

/// A walk kept as it came reads back whole, each path of the front-coded list.
#[test]
fn a_sealed_walk_lists_every_path_it_holds() {
    let walked = [
        PathBuf::from("/data"),
        PathBuf::from("/data/a/x_1.jpg"),
        PathBuf::from("/data/a/x_2.jpg"),
        PathBuf::from("/data/b"),
    ];
    let fd = wire::sealed_memfd("w", &wire::path_list(walked.iter())).unwrap();
    let files = crate::access::Files::Sealed(Arc::new(fd));
    assert_eq!(&files.to_list().unwrap()[..], &walked[..]);
}
