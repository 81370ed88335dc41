//! What `larder stats` and `larder top` print: the daemon's counters and open streams as text
//! for people.

/// Stats as a table for people: where samples came from and where the time went.
pub fn format_stats(s: &crate::proto::Stats) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let lookups: u64 = s.tiers.iter().map(|t| t.hits).sum();
    let _ = writeln!(
        out,
        "{:<8} {:>12} {:>8} {:>16}",
        "tier", "hits", "share", "bytes read"
    );
    for t in &s.tiers {
        let share = if lookups == 0 {
            0.0
        } else {
            t.hits as f64 / lookups as f64 * 100.0
        };
        let _ = writeln!(
            out,
            "{:<8} {:>12} {:>7.1}% {:>16}",
            t.tier, t.hits, share, t.bytes
        );
    }
    let _ = writeln!(
        out,
        "memory tier: {} of {} bytes in {} samples ({} bytes a sample); hit rate {:.1}%; {} inserts declined to keep the working set",
        s.memory_bytes,
        s.memory_budget_bytes,
        s.memory_entries,
        s.memory_bytes.checked_div(s.memory_entries).unwrap_or(0),
        s.hit_rate * 100.0,
        s.admissions_declined
    );
    let _ = writeln!(
        out,
        "eviction policy: {}; {} bytes of open streams' futures; {:.3} s deciding",
        s.memory_policy, s.memory_policy_bytes, s.memory_policy_seconds
    );
    let _ = writeln!(
        out,
        "expansion factor: {:.2} measured in memory (planned {:.2})",
        s.measured_expansion_factor, s.planned_expansion_factor
    );
    let _ = writeln!(
        out,
        "scratch tier: {} of {} bytes; {} corrupt records refetched{}",
        s.scratch_bytes,
        s.scratch_budget_bytes,
        s.scratch_corrupt_records,
        if s.scratch_paused.is_empty() {
            String::new()
        } else {
            format!("; NOT WRITING: {}", s.scratch_paused)
        }
    );
    if s.prefetched_samples > 0 {
        let _ = writeln!(
            out,
            "read ahead for nodes' next epochs: {} samples, {} raw bytes",
            s.prefetched_samples, s.prefetched_raw_bytes
        );
    }
    if s.object_gets > 0 {
        let _ = writeln!(
            out,
            "object store: {} ranged GETs, {} bytes",
            s.object_gets, s.object_bytes
        );
    }
    let _ = writeln!(
        out,
        "datasets and streams outside the cache: {} of {} bytes (one user's share: {})",
        s.footprint_bytes, s.footprint_limit_bytes, s.user_footprint_limit_bytes
    );
    let _ = writeln!(
        out,
        "served: {} batches, {} samples, {} bytes; {} open streams; {} fetches shared between clients; {} bad samples skipped (larder bad)",
        s.batches_served, s.samples_served, s.bytes_served, s.active_streams, s.coalesced_fetches, s.bad_samples
    );
    let _ = writeln!(
        out,
        "shared memory: {} rings, {} of {} bytes; {} batches in slots, {} sent in messages for want of a free slot",
        s.shm_rings, s.shm_bytes, s.shm_budget_bytes, s.shm_batches, s.shm_fallbacks
    );
    for d in &s.datasets {
        let n = |tier: &str| {
            d.tiers
                .iter()
                .find(|t| t.tier == tier)
                .map_or(0, |t| t.hits)
        };
        let _ = writeln!(
            out,
            "dataset {}: lookups memory {}, scratch {}, raw {}; {} bad samples",
            d.dataset,
            n("memory"),
            n("scratch"),
            n("raw"),
            d.bad_samples
        );
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let _ = writeln!(
        out,
        "daemon memory: {:.1} MiB resident, {:.1} MiB anonymous (ceiling {:.1} MiB), {:.1} MiB shared; accounted {:.1} MiB of the {:.1} MiB budget = memory tier {:.1} + rings {:.1} + message buffers {:.1} spare + {:.1} in flight (their share {:.1}); {:.1} MiB freed, held by the allocator",
        mib(s.resident_bytes),
        mib(s.anonymous_bytes),
        mib(s.anonymous_ceiling_bytes),
        mib(s.shared_bytes),
        mib(s.accounted_bytes),
        mib(s.memory_configured_budget_bytes),
        mib(s.memory_bytes),
        mib(s.shm_bytes),
        mib(s.message_buffer_spare_bytes),
        mib(s.message_buffer_in_flight_bytes),
        mib(s.message_budget_bytes),
        mib(s.allocator_free_bytes),
    );
    let _ = write!(
        out,
        "client stall: {:.3}s waiting for batches (summed over streams) in {:.1}s uptime; machine memory available: {} bytes",
        s.client_stall_seconds, s.uptime_seconds, s.machine_available_bytes
    );
    out
}

/// One frame of `larder top`: the daemon's memory and tiers, then a row per stream (samples/s
/// since the last frame, from `last`: stream id -> (open seconds, samples) as last seen).
pub fn format_top(
    s: &crate::proto::Stats,
    streams: &crate::proto::ListStreamsResponse,
    last: &mut std::collections::HashMap<u64, (f64, u64)>,
) -> String {
    use std::fmt::Write;
    let mb = |b: u64| b as f64 / 1e6;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "larder: memory tier {:.0} of {:.0} MB ({} samples, hit rate {:.1}%), scratch {:.0} of {:.0} MB, rings {:.0} MB, pool {:.0}% busy of {} threads, machine {:.0} MB available",
        mb(s.memory_bytes),
        mb(s.memory_budget_bytes),
        s.memory_entries,
        s.hit_rate * 100.0,
        mb(s.scratch_bytes),
        mb(s.scratch_budget_bytes),
        mb(s.shm_bytes),
        streams.pool_busy * 100.0,
        s.pool_threads,
        mb(s.machine_available_bytes)
    );
    let _ = writeln!(
        out,
        "{:>5} {:<18} {:<10} {:<14} {:>5} {:>9} {:>9} {:>6} {:<13} {:<13} {:>11} {:>5}",
        "ID",
        "JOB",
        "USER",
        "DATASET",
        "RANK",
        "BATCHES",
        "SAMPLES/S",
        "WAIT%",
        "VERDICT",
        "CAUSE",
        "MEM/SCR/RAW",
        "READY"
    );
    let mut seen = std::collections::HashMap::new();
    let clip = |s: &str, n: usize| s.chars().take(n).collect::<String>();
    for st in &streams.streams {
        let (t0, n0) = last.get(&st.id).copied().unwrap_or((0.0, 0));
        let dt = st.open_seconds - t0;
        let rate = if dt > 0.0 {
            (st.samples - n0.min(st.samples)) as f64 / dt
        } else {
            0.0
        };
        seen.insert(st.id, (st.open_seconds, st.samples));
        let fetched = (st.memory_samples + st.scratch_samples + st.raw_samples).max(1) as f64;
        let pct = |n: u64| (n as f64 / fetched * 100.0).round() as u64;
        let job = if st.job.is_empty() {
            format!("pid {}", st.pid)
        } else {
            st.job.clone()
        };
        let _ = writeln!(
            out,
            "{:>5} {:<18} {:<10} {:<14} {:>5} {:>9} {:>9.0} {:>5.1}% {:<13} {:<13} {:>11} {:>5}",
            st.id,
            clip(&job, 18),
            clip(&st.user, 10),
            clip(&st.dataset, 14),
            format!("{}/{}", st.rank, st.world_size),
            format!("{}/{}", st.batches, st.num_batches),
            rate,
            st.wait_ratio * 100.0,
            st.verdict,
            if st.cause.is_empty() { "-" } else { &st.cause },
            format!(
                "{}/{}/{}",
                pct(st.memory_samples),
                pct(st.scratch_samples),
                pct(st.raw_samples)
            ),
            st.ready_batches
        );
    }
    // The advice for each input-bound job, once.
    let mut advised = std::collections::HashSet::new();
    for st in streams
        .streams
        .iter()
        .filter(|st| st.verdict == "input-bound")
    {
        if !st.advice.is_empty() && advised.insert((st.job.clone(), st.pid, st.advice.clone())) {
            let _ = writeln!(out, "  {} ({}): {}", st.job, st.dataset, st.advice);
        }
    }
    *last = seen;
    if streams.streams.is_empty() {
        let _ = writeln!(out, "(no stream of yours is open)");
    }
    if streams.others > 0 {
        let _ = writeln!(out, "and {} stream(s) of other users", streams.others);
    }
    out
}
