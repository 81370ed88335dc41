//! The daemon's counters for Prometheus: an HTTP endpoint (`[metrics] listen`, off by default)
//! serving the text exposition at `/metrics`. Each scrape renders what `GetStats` answers (the
//! tiers, the memory account, the rings, the pool) and the streams open now, one series per
//! stream, labelled `dataset`, `rank`, `run` (the client's user and process), `name` (the job's
//! name as its client gave it) and `stream` (not `job`, which Prometheus keeps for its own
//! scrape job and renames), so the labels are bounded by the streams open at the time. The
//! exposition is `metrics-exporter-prometheus`'s classic text format, with a HELP line for
//! every family (`promtool check metrics` accepts it); the batch-wait histogram, kept by the
//! daemon, is written after it in the same format.

use crate::proto::Stats;
use crate::proto::StreamInfo;
use anyhow::{Context, Result};
use metrics::{counter, describe_counter, describe_gauge, gauge, Unit};
use metrics_exporter_prometheus::PrometheusBuilder;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// What a scrape reads: the daemon's stats and its open streams, as of now.
pub type Snapshot = Arc<dyn Fn() -> (Stats, Vec<StreamInfo>) + Send + Sync>;

/// Most scrapes served at once (the rest wait their turn).
const MAX_CONNECTIONS: usize = 8;
/// The longest one scrape may take, its request and its answer together.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest request read.
const MAX_REQUEST: usize = 8192;

/// The exposition of `stats` and `streams`.
pub fn render(stats: &Stats, streams: &[StreamInfo]) -> String {
    // A recorder of its own per scrape: a stream that closed leaves no series behind.
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || record(stats, streams));
    let mut text = handle.render();
    histogram(&mut text, stats);
    text
}

/// The batch-wait histogram, from the daemon's cumulative buckets (the recorder's histograms
/// hold the values recorded into it, and this one is rebuilt each scrape).
fn histogram(out: &mut String, s: &Stats) {
    use std::fmt::Write;
    if s.batch_wait_counts.len() != s.batch_wait_bounds.len() + 1 {
        return;
    }
    let name = "larder_batch_wait_seconds";
    let _ = writeln!(
        out,
        "# HELP {name} How long each batch kept its stream's sender waiting (0 when it was ready).\n# TYPE {name} histogram"
    );
    for (bound, count) in s.batch_wait_bounds.iter().zip(&s.batch_wait_counts) {
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
    }
    let total = s.batch_wait_counts.last().copied().unwrap_or(0);
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {total}");
    let _ = writeln!(out, "{name}_sum {}", s.batch_wait_sum_seconds);
    let _ = writeln!(out, "{name}_count {total}\n");
}

fn record(s: &Stats, streams: &[StreamInfo]) {
    describe_counter!(
        "larder_lookups_total",
        "Sample lookups, by the tier that served them (memory, scratch, raw)."
    );
    describe_counter!(
        "larder_tier_read_bytes_total",
        Unit::Bytes,
        "Bytes read from each tier to serve lookups."
    );
    for t in &s.tiers {
        counter!("larder_lookups_total", "tier" => t.tier.clone()).absolute(t.hits);
        counter!("larder_tier_read_bytes_total", "tier" => t.tier.clone()).absolute(t.bytes);
    }
    describe_counter!(
        "larder_dataset_lookups_total",
        "Sample lookups of each dataset, by the tier that served them (since the dataset opened)."
    );
    describe_counter!(
        "larder_dataset_read_bytes_total",
        Unit::Bytes,
        "Bytes read from each tier for each dataset's lookups (since the dataset opened)."
    );
    describe_gauge!(
        "larder_dataset_bad_samples",
        Unit::Count,
        "Samples of each dataset skipped because their files do not read or decode."
    );
    for d in &s.datasets {
        for t in &d.tiers {
            let labels = [("dataset", d.dataset.clone()), ("tier", t.tier.clone())];
            counter!("larder_dataset_lookups_total", &labels).absolute(t.hits);
            counter!("larder_dataset_read_bytes_total", &labels).absolute(t.bytes);
        }
        gauge!("larder_dataset_bad_samples", "dataset" => d.dataset.clone())
            .set(d.bad_samples as f64);
    }
    let c = |name: &'static str, help: &'static str, v: u64| {
        describe_counter!(name, help);
        counter!(name).absolute(v);
    };
    c(
        "larder_coalesced_lookups_total",
        "Lookups that joined a read of the same sample already in flight.",
        s.coalesced_fetches,
    );
    c(
        "larder_memory_admissions_declined_total",
        "Samples the memory tier's policy kept out.",
        s.admissions_declined,
    );
    c(
        "larder_object_gets_total",
        "Ranged GETs made to object stores (datasets at s3:// URLs).",
        s.object_gets,
    );
    c(
        "larder_object_read_bytes_total",
        "Bytes those GETs brought.",
        s.object_bytes,
    );
    c(
        "larder_batches_served_total",
        "Batches sent to clients.",
        s.batches_served,
    );
    c(
        "larder_samples_served_total",
        "Samples sent to clients.",
        s.samples_served,
    );
    c(
        "larder_served_bytes_total",
        "Bytes of batches sent to clients.",
        s.bytes_served,
    );
    c(
        "larder_shm_batches_total",
        "Batches delivered in shared-memory slots.",
        s.shm_batches,
    );
    c(
        "larder_shm_fallbacks_total",
        "Batches sent in the message because the stream's ring had no free slot.",
        s.shm_fallbacks,
    );
    let g = |name: &'static str, unit: Unit, help: &'static str, v: f64| {
        describe_gauge!(name, unit, help);
        gauge!(name).set(v);
    };
    // Seconds are floats; the `metrics` API's counters are integers: cumulative seconds go as
    // gauges.
    g(
        "larder_client_wait_seconds",
        Unit::Seconds,
        "Time clients' streams have waited for a batch that was not ready, all streams since start.",
        s.client_stall_seconds,
    );
    g(
        "larder_memory_bytes",
        Unit::Bytes,
        "Bytes the memory tier holds.",
        s.memory_bytes as f64,
    );
    g(
        "larder_memory_limit_bytes",
        Unit::Bytes,
        "The memory tier's limit now: its budget less the rings, the message path's share and the streams' futures, lower while the machine is short.",
        s.memory_budget_bytes as f64,
    );
    g(
        "larder_memory_budget_bytes",
        Unit::Bytes,
        "The memory budget the admin set, which the tier, the rings, the message path and the streams' futures share.",
        s.memory_configured_budget_bytes as f64,
    );
    g(
        "larder_message_budget_bytes",
        Unit::Bytes,
        "The message path's share of the memory budget (spare message buffers and batches in flight).",
        s.message_budget_bytes as f64,
    );
    g(
        "larder_message_spare_bytes",
        Unit::Bytes,
        "Spare message buffers kept for reuse.",
        s.message_buffer_spare_bytes as f64,
    );
    g(
        "larder_message_in_flight_bytes",
        Unit::Bytes,
        "Bytes of batches on their way to clients in gRPC messages (being assembled, packed, encoded).",
        s.message_buffer_in_flight_bytes as f64,
    );
    g(
        "larder_memory_entries",
        Unit::Count,
        "Samples the memory tier holds.",
        s.memory_entries as f64,
    );
    g(
        "larder_memory_hit_ratio",
        Unit::Count,
        "Memory-tier hits over the lookups that did not join a read in flight.",
        s.hit_rate,
    );
    g(
        "larder_memory_expansion_factor",
        Unit::Count,
        "Bytes in memory per byte in raw storage, measured over the samples held.",
        s.measured_expansion_factor,
    );
    g(
        "larder_memory_policy_bytes",
        Unit::Bytes,
        "Bytes of the eviction policy's bookkeeping (the open streams' futures).",
        s.memory_policy_bytes as f64,
    );
    g(
        "larder_memory_policy_cpu_seconds",
        Unit::Seconds,
        "CPU time the eviction policy has spent deciding.",
        s.memory_policy_seconds,
    );
    g(
        "larder_scratch_bytes",
        Unit::Bytes,
        "Bytes the scratch tier's shard files take.",
        s.scratch_bytes as f64,
    );
    g(
        "larder_scratch_budget_bytes",
        Unit::Bytes,
        "The scratch tier's budget.",
        s.scratch_budget_bytes as f64,
    );
    g(
        "larder_scratch_corrupt_records",
        Unit::Count,
        "Scratch records found corrupt (and refetched).",
        s.scratch_corrupt_records as f64,
    );
    g(
        "larder_bad_samples",
        Unit::Count,
        "Samples skipped because their files do not read or decode.",
        s.bad_samples as f64,
    );
    g(
        "larder_shm_rings",
        Unit::Count,
        "Shared-memory rings open.",
        s.shm_rings as f64,
    );
    g(
        "larder_footprint_bytes",
        Unit::Bytes,
        "What datasets and streams take of the daemon's memory outside the cache (sizes, file lists, scratch indexes, plans, orders), charged to their users.",
        s.footprint_bytes as f64,
    );
    g(
        "larder_footprint_limit_bytes",
        Unit::Bytes,
        "The most datasets and streams may take outside the cache (limits.footprint_bytes).",
        s.footprint_limit_bytes as f64,
    );
    g(
        "larder_shm_bytes",
        Unit::Bytes,
        "Bytes the shared-memory rings take.",
        s.shm_bytes as f64,
    );
    g(
        "larder_machine_available_bytes",
        Unit::Bytes,
        "The machine's available memory, as last seen.",
        s.machine_available_bytes as f64,
    );
    g(
        "larder_resident_bytes",
        Unit::Bytes,
        "What the kernel says the daemon holds.",
        s.resident_bytes as f64,
    );
    g(
        "larder_anonymous_ceiling_bytes",
        Unit::Bytes,
        "The anonymous memory the daemon should stay under.",
        s.anonymous_ceiling_bytes as f64,
    );
    g(
        "larder_streams_open",
        Unit::Count,
        "Streams open now.",
        streams.len() as f64,
    );
    g(
        "larder_pool_busy_ratio",
        Unit::Count,
        "The preprocessing pool's busy share over the last 10 s.",
        s.pool_busy,
    );
    g(
        "larder_pool_threads",
        Unit::Count,
        "Threads in the preprocessing pool.",
        s.pool_threads as f64,
    );
    describe_gauge!(
        "larder_stream_samples",
        Unit::Count,
        "Samples an open stream has sent (labels: dataset, rank, run = the client's user:pid, name = the job's name as its client gave it, stream)."
    );
    describe_gauge!(
        "larder_stream_bytes_per_second",
        Unit::Count,
        "Bytes an open stream has sent per second since it opened."
    );
    describe_gauge!(
        "larder_stream_wait_seconds",
        Unit::Seconds,
        "Time an open stream's client waited for batches (its loop's wait in next() when the client reports it, else the daemon's)."
    );
    describe_gauge!(
        "larder_stream_open_seconds",
        Unit::Seconds,
        "How long an open stream has been open."
    );
    describe_gauge!(
        "larder_stream_wait_ratio",
        Unit::Count,
        "The share of the job's step time spent waiting for batches (the client's measure over its last seconds, else the daemon's)."
    );
    describe_gauge!(
        "larder_stream_verdict",
        Unit::Count,
        "1 for an open stream's verdict (input-bound, balanced, compute-bound, starting) and cause."
    );
    describe_gauge!(
        "larder_stream_recent_samples",
        Unit::Count,
        "Samples an open stream got from each tier over the last 10 s."
    );
    describe_gauge!(
        "larder_stream_ready_batches",
        Unit::Count,
        "Batches assembled ahead of an open stream's client."
    );
    for st in streams {
        let labels = |extra: &[(&'static str, String)]| {
            let mut l = vec![
                ("dataset", st.dataset.clone()),
                ("rank", st.rank.to_string()),
                ("run", format!("{}:{}", st.user, st.pid)),
                ("name", st.job.clone()),
                ("stream", st.id.to_string()),
            ];
            l.extend_from_slice(extra);
            l
        };
        let base = labels(&[]);
        gauge!("larder_stream_samples", &base).set(st.samples as f64);
        gauge!("larder_stream_bytes_per_second", &base).set(st.bytes_per_second);
        gauge!("larder_stream_wait_seconds", &base).set(st.wait_seconds);
        gauge!("larder_stream_open_seconds", &base).set(st.open_seconds);
        gauge!("larder_stream_wait_ratio", &base).set(st.wait_ratio);
        gauge!("larder_stream_ready_batches", &base).set(st.ready_batches as f64);
        let verdict = labels(&[("verdict", st.verdict.clone()), ("cause", st.cause.clone())]);
        gauge!("larder_stream_verdict", &verdict).set(1.0);
        for (tier, n) in [
            ("memory", st.memory_samples),
            ("scratch", st.scratch_samples),
            ("raw", st.raw_samples),
        ] {
            gauge!(
                "larder_stream_recent_samples",
                &labels(&[("tier", tier.into())])
            )
            .set(n as f64);
        }
    }
}

/// Serves `/metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, snapshot: Snapshot) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let conn = match listener.accept().await {
            Ok((conn, _)) => conn,
            Err(e) => {
                // Out of descriptors, say: wait rather than spin.
                tracing::debug!("metrics endpoint: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Full: this connection is closed at once (the accept loop never waits on a slow one).
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(conn);
            continue;
        };
        let snapshot = snapshot.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(SCRAPE_TIMEOUT, answer(conn, snapshot)).await {
                Ok(Err(e)) => tracing::debug!("metrics request: {e:#}"),
                Err(_) => tracing::debug!("metrics request too slow; closed"),
                Ok(Ok(())) => {}
            }
        });
    }
}

/// Reads one request (bounded in size and time) and answers it.
async fn answer(mut conn: TcpStream, snapshot: Snapshot) -> Result<()> {
    let mut request = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    let read = async {
        while !request.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await?;
            if n == 0 || request.len() + n > MAX_REQUEST {
                break;
            }
            request.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    read.await.context("reading the request")?;
    let line = request.split(|&b| b == b'\r').next().unwrap_or_default();
    let (status, body, kind) = if line.starts_with(b"GET /metrics ") || line == b"GET /metrics" {
        let (stats, streams) = snapshot();
        (
            "200 OK",
            render(&stats, &streams),
            "text/plain; version=0.0.4",
        )
    } else if line.starts_with(b"GET ") {
        (
            "404 Not Found",
            "larder serves /metrics\n".to_string(),
            "text/plain",
        )
    } else {
        (
            "405 Method Not Allowed",
            "GET /metrics\n".to_string(),
            "text/plain",
        )
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body.as_bytes()).await?;
    conn.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_has_help_and_a_type_and_stream_labels_are_not_job() {
        let stats = Stats {
            tiers: vec![crate::proto::TierStats {
                tier: "memory".into(),
                hits: 7,
                bytes: 70,
            }],
            memory_bytes: 1000,
            hit_rate: 0.5,
            ..Default::default()
        };
        let text = render(&stats, &[]);
        assert!(
            text.contains("larder_lookups_total{tier=\"memory\"} 7"),
            "{text}"
        );
        assert!(text.contains("larder_memory_bytes 1000"), "{text}");
        for line in text.lines().filter(|l| l.starts_with("# TYPE")) {
            let name = line.split_whitespace().nth(2).unwrap();
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} has no help"
            );
        }
        assert!(!text.contains("job="));
    }
}
