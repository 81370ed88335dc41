//! larder: the command-line client.

use anyhow::Result;
use clap::{Parser, Subcommand};
use larder::client::connect;
use larder::proto::{
    AddDatasetRequest, GetStatsRequest, ListBadSamplesRequest, ListDatasetsRequest,
    RemoveDatasetRequest, WarmRequest,
};
use std::path::PathBuf;

#[derive(Parser)]
#[command(version, about = "larder command-line client")]
struct Args {
    /// Daemon address: unix:/path/to/socket or http://HOST:PORT.
    #[arg(
        long,
        global = true,
        env = "LARDER_ADDR",
        default_value = larder::client::DEFAULT_ADDR
    )]
    addr: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the datasets you may read (with who added them), and those not served now that
    /// are yours to know about (all of them for root and the daemon's user).
    Datasets,
    /// Add a dataset of your own, named USER/NAME, kept across daemon restarts; the daemon
    /// reads its files with your rights (only what you can read yourself).
    Add(AddArgs),
    /// Remove a dataset you added (by its full name, USER/NAME).
    Rm { name: String },
    /// Show per-tier hits, bytes, memory use and client stall time.
    Stats,
    /// The streams open now, refreshed every second (`q` or Ctrl-C quits): per stream its dataset,
    /// user and process, rank, progress, samples/s, how long its client waits for batches and
    /// the verdict (input-bound, balanced, compute-bound); yours in detail, others' counted.
    Top {
        /// Print one frame and exit (for scripts).
        #[arg(long)]
        once: bool,
    },
    /// List the samples skipped because their files do not read or decode, with why.
    Bad {
        /// Only this dataset's (default: every dataset's).
        dataset: Option<String>,
    },
    /// Preprocess a dataset into the daemon's scratch tier now (resumes where an earlier warm
    /// stopped); ends with the files that do not read or decode.
    Warm {
        /// Dataset name, as `larder datasets` lists it.
        dataset: String,
    },
    /// Measure the running daemon: stream whole epochs with concurrent clients, print throughput,
    /// hit rates and stall time (checks every client gets every sample exactly once).
    Bench {
        /// Dataset name, as `larder datasets` lists it.
        dataset: String,
        /// Concurrent clients, each streaming whole epochs with its own seed.
        #[arg(long, default_value_t = 2)]
        clients: u32,
        #[arg(long, default_value_t = 3)]
        epochs: u64,
        #[arg(long, default_value_t = 256)]
        batch_size: u32,
    },
    /// Write the manual pages of larder (larder.1, one larder-COMMAND.1 a command) and of
    /// larder.toml (larder.toml.5) to DIR (scripts/package puts them in the package).
    #[command(hide = true)]
    Man { dir: PathBuf },
    /// Make a small dataset, start a daemon, run training clients, print throughput and hit rates.
    Demo {
        /// Samples in the demo dataset (uint8 3x32x32 each).
        #[arg(long, default_value_t = 4096)]
        samples: u64,
        /// Concurrent training clients.
        #[arg(long, default_value_t = 2)]
        clients: u32,
        #[arg(long, default_value_t = 3)]
        epochs: u64,
        #[arg(long, default_value_t = 64)]
        batch_size: u32,
        /// Memory budget as a fraction of the dataset.
        #[arg(long, default_value_t = 0.5)]
        cache_fraction: f64,
    },
}

#[derive(clap::Args)]
struct AddArgs {
    /// NAME: the dataset becomes USER/NAME (letters, digits, '.', '_', '-').
    name: String,
    /// The dataset's file or folder, read as the first of these that fits: a `.npy`/`.npz`
    /// file or a folder with `.npy` files as npy; a folder with `state.json` or
    /// `dataset_dict.json` (`save_to_disk`) as hf; a `.parquet` file as parquet; a `.tar` file
    /// as webdataset; an `.mdb` file or a folder with `data.mdb` as lmdb; any other folder as
    /// images (class subfolders of JPEG/PNG files); a file with the HDF5 signature or an
    /// `.h5`/`.hdf5`/`.hdf` name as hdf5. `--kind` for the rest.
    path: PathBuf,
    /// The source's kind: hdf5, images, npy, hf, parquet, webdataset or lmdb (default: the
    /// kind the daemon recognises the path as).
    #[arg(long)]
    kind: Option<String>,
    /// HDF5: the dataset served as field "image" (default "images").
    #[arg(long)]
    samples: Option<String>,
    /// HDF5: an integer dataset [N] served as field "label".
    #[arg(long)]
    labels: Option<String>,
    /// Images: keep them with the shorter side resized to this (default 256).
    #[arg(long)]
    resize: Option<u32>,
    /// Batches carry crop x crop pixels (images: default 224; 0: whole images).
    #[arg(long)]
    crop: Option<u32>,
    /// Add the train pipeline: random-resized crops and flips (images), random crops and flips
    /// (HDF5; --padding adds zeros around first).
    #[arg(long)]
    train: bool,
    #[arg(long, requires = "train")]
    padding: Option<u32>,
    /// Whom else to let read it through larder: "all", "user:NAME", "group:NAME" (repeat).
    #[arg(long)]
    allow: Vec<String>,
    /// Any other key of the config's [[dataset]] table, as TOML: --set 'on_error = "fail"'.
    #[arg(long)]
    set: Vec<String>,
    /// Replace your dataset of that name.
    #[arg(long)]
    replace: bool,
}

impl AddArgs {
    /// The dataset's table, as the config's [[dataset]] tables are written.
    fn table(&self) -> Result<String> {
        use toml::Value;
        // A URL goes as written: the daemon says why it does not read it.
        let path = match larder::objects::scheme_of(&self.path) {
            Some(_) => self.path.clone(),
            None => std::path::absolute(&self.path)?,
        };
        let mut t = toml::Table::new();
        t.insert(
            "path".into(),
            Value::String(path.to_string_lossy().into_owned()),
        );
        // Without --kind, the daemon reads the path as the kind it recognises it as.
        if let Some(kind) = &self.kind {
            t.insert("kind".into(), Value::String(kind.clone()));
        }
        for (key, v) in [("samples", &self.samples), ("labels", &self.labels)] {
            if let Some(v) = v {
                t.insert(key.into(), Value::String(v.clone()));
            }
        }
        for (key, v) in [("resize", self.resize), ("crop", self.crop)] {
            if let Some(v) = v {
                t.insert(key.into(), Value::Integer(v.into()));
            }
        }
        if !self.allow.is_empty() {
            let allow = self.allow.iter().map(|a| Value::String(a.clone()));
            t.insert("allow".into(), Value::Array(allow.collect()));
        }
        if self.train {
            let mut train = toml::Table::new();
            if let Some(p) = self.padding {
                train.insert("padding".into(), Value::Integer(p.into()));
            }
            t.insert("train".into(), Value::Table(train));
        }
        for s in &self.set {
            let more: toml::Table =
                toml::from_str(s).map_err(|e| anyhow::anyhow!("--set {s:?} is not TOML: {e}"))?;
            t.extend(more);
        }
        Ok(toml::to_string(&t)?)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    larder::init_logging("warn");
    let args = Args::parse();
    match args.command {
        Command::Man { dir } => {
            use clap::CommandFactory;
            std::fs::create_dir_all(&dir)?;
            clap_mangen::generate_to(Args::command().name("larder"), &dir)?;
            let page =
                larder::manpage::config_page(larder::manpage::CONFIG_MD, env!("CARGO_PKG_VERSION"));
            std::fs::write(dir.join("larder.toml.5"), page)?;
        }
        Command::Datasets => {
            let mut client = connect(&args.addr).await?;
            let list = client
                .list_datasets(ListDatasetsRequest {})
                .await?
                .into_inner();
            println!(
                "{:<24} {:<10} {:>10}  fields; source",
                "name", "owner", "samples"
            );
            for d in list.datasets {
                let owner = if d.owner.is_empty() { "-" } else { &d.owner };
                println!(
                    "{:<24} {:<10} {:>10}  {}; {}",
                    d.name,
                    owner,
                    d.num_samples,
                    larder::demo::describe_fields(&d.fields),
                    d.source
                );
            }
            for u in list.unavailable {
                println!(
                    "{:<24} {:<10} {:>10}  unavailable: {}",
                    u.name, "", "-", u.reason
                );
            }
        }
        Command::Add(add) => {
            let mut client = connect(&args.addr).await?;
            let ds = client
                .add_dataset(AddDatasetRequest {
                    name: add.name.clone(),
                    table: add.table()?,
                    replace: add.replace,
                })
                .await?
                .into_inner()
                .dataset
                .unwrap_or_default();
            println!(
                "added {}: {} samples, {}; {}",
                ds.name,
                ds.num_samples,
                larder::demo::describe_fields(&ds.fields),
                ds.source
            );
        }
        Command::Rm { name } => {
            let mut client = connect(&args.addr).await?;
            client
                .remove_dataset(RemoveDatasetRequest { name: name.clone() })
                .await?;
            println!("removed {name}");
        }
        Command::Stats => {
            let mut client = connect(&args.addr).await?;
            let stats = client.get_stats(GetStatsRequest {}).await?.into_inner();
            println!("{}", larder::cli_text::format_stats(&stats));
        }
        Command::Top { once } => {
            let mut client = connect(&args.addr).await?;
            let mut last: std::collections::HashMap<u64, (f64, u64)> = Default::default();
            // In a terminal, keys come one at a time (no Enter) and unechoed: `q` quits.
            let _raw = (!once).then(RawTerminal::enter).flatten();
            let mut stdin = tokio::io::stdin();
            let mut key = [0u8; 1];
            loop {
                let stats = client.get_stats(GetStatsRequest {}).await?.into_inner();
                let streams = client
                    .list_streams(larder::proto::ListStreamsRequest {})
                    .await?
                    .into_inner();
                let frame = larder::cli_text::format_top(&stats, &streams, &mut last);
                if once {
                    print!("{frame}");
                    break;
                }
                // Clear the screen and draw the frame from its top left corner.
                print!("\x1b[2J\x1b[H{frame}");
                use std::io::Write;
                std::io::stdout().flush()?;
                use tokio::io::AsyncReadExt;
                tokio::select! {
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                    _ = tokio::signal::ctrl_c() => break,
                    read = stdin.read(&mut key) => match read {
                        Ok(1) if matches!(key[0], b'q' | b'Q') => break,
                        Ok(0) | Err(_) => tokio::time::sleep(std::time::Duration::from_secs(1)).await,
                        _ => {}
                    },
                }
            }
        }
        Command::Bad { dataset } => {
            let n = bad(&args.addr, dataset.as_deref().unwrap_or("")).await?;
            if n == 0 {
                println!("no bad samples");
            }
        }
        Command::Warm { dataset } => warm(&args.addr, &dataset).await?,
        Command::Bench {
            dataset,
            clients,
            epochs,
            batch_size,
        } => larder::demo::run_epochs(&args.addr, &dataset, clients, epochs, batch_size).await?,
        Command::Demo {
            samples,
            clients,
            epochs,
            batch_size,
            cache_fraction,
        } => {
            larder::demo::run(larder::demo::DemoOptions {
                samples,
                clients,
                epochs,
                batch_size,
                cache_fraction,
            })
            .await?
        }
    }
    Ok(())
}

async fn warm(addr: &str, dataset: &str) -> Result<()> {
    let mut client = connect(addr).await?;
    let mut stream = client
        .warm(WarmRequest {
            dataset: dataset.to_string(),
        })
        .await?
        .into_inner();
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {pos}/{len} samples ({per_sec}, eta {eta})",
        )?
        .progress_chars("=> "),
    );
    bar.set_message(format!("warming {dataset}"));
    let mut last = None;
    while let Some(p) = stream.message().await? {
        bar.set_length(p.total);
        bar.set_position(p.done);
        last = Some(p);
    }
    bar.finish();
    if let Some(p) = last {
        println!(
            "{dataset}: {} samples in the scratch tier ({} preprocessed now, {} already there); {} bad",
            p.written + p.present,
            p.written,
            p.present,
            p.bad
        );
    }
    bad(addr, dataset).await?;
    Ok(())
}

/// Prints the bad samples of `dataset` ("" for all), one per line; returns how many.
async fn bad(addr: &str, dataset: &str) -> Result<usize> {
    let mut client = connect(addr).await?;
    let samples = client
        .list_bad_samples(ListBadSamplesRequest {
            dataset: dataset.to_string(),
        })
        .await?
        .into_inner()
        .samples;
    for s in &samples {
        println!("bad: {} sample {}: {}", s.dataset, s.index, s.error);
    }
    Ok(samples.len())
}

/// The terminal on stdin in non-canonical mode without echo while this lives (None when stdin
/// is not a terminal); restored on drop.
struct RawTerminal {
    saved: libc::termios,
}

impl RawTerminal {
    fn enter() -> Option<RawTerminal> {
        // SAFETY: isatty and tcgetattr read the descriptor's state into `saved`.
        unsafe {
            if libc::isatty(0) != 1 {
                return None;
            }
            let mut saved: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut saved) != 0 {
                return None;
            }
            let mut raw = saved;
            raw.c_lflag &= !(libc::ICANON | libc::ECHO);
            raw.c_cc[libc::VMIN] = 1;
            raw.c_cc[libc::VTIME] = 0;
            (libc::tcsetattr(0, libc::TCSANOW, &raw) == 0).then_some(RawTerminal { saved })
        }
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: puts back the state read in `enter`.
        unsafe {
            libc::tcsetattr(0, libc::TCSANOW, &self.saved);
        }
    }
}
