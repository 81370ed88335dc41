//! larder: the command-line client.

use anyhow::Result;
use clap::{Parser, Subcommand};
use larder::client::connect;
use larder::proto::{GetStatsRequest, ListBadSamplesRequest, ListDatasetsRequest, WarmRequest};

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
    /// List the datasets the daemon serves.
    Datasets,
    /// Show per-tier hits, bytes, memory use and client stall time.
    Stats,
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

#[tokio::main]
async fn main() -> Result<()> {
    larder::init_logging("warn");
    let args = Args::parse();
    match args.command {
        Command::Datasets => {
            let mut client = connect(&args.addr).await?;
            let list = client
                .list_datasets(ListDatasetsRequest {})
                .await?
                .into_inner();
            println!("{:<20} {:>10}  fields; source", "name", "samples");
            for d in list.datasets {
                println!(
                    "{:<20} {:>10}  {}; {}",
                    d.name,
                    d.num_samples,
                    larder::demo::describe_fields(&d.fields),
                    d.source
                );
            }
            for u in list.unavailable {
                println!("{:<20} {:>10}  unavailable: {}", u.name, "-", u.reason);
            }
        }
        Command::Stats => {
            let mut client = connect(&args.addr).await?;
            let stats = client.get_stats(GetStatsRequest {}).await?.into_inner();
            println!("{}", larder::metrics::format_stats(&stats));
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
