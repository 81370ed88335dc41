//! Keeps the memory tier within what the machine can spare: its available memory is read
//! every interval, and the tier's limit lowered (and the spare message buffers and the
//! allocator's freed pages given back) before the machine would swap.

use super::memory::MemoryTier;
use std::time::Duration;

/// The limit the memory tier should have so that the machine keeps `floor` bytes available:
/// it may grow only into memory above the floor, and shrinks by however far below it the
/// machine has fallen.
pub fn limit_for(budget: u64, held: u64, available: u64, floor: u64) -> u64 {
    if available >= floor {
        budget.min(held.saturating_add(available - floor))
    } else {
        held.saturating_sub(floor - available)
    }
}

/// Watches the machine's available memory and keeps the tier within it, forever.
pub async fn watch_available_memory(
    tier: std::sync::Arc<MemoryTier>,
    floor: u64,
    interval: Duration,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    release_buffers: impl Fn(),
) {
    let mut sys = sysinfo::System::new();
    let mut ticker = tokio::time::interval(interval);
    let mut short = false;
    loop {
        ticker.tick().await;
        sys.refresh_memory();
        let available = sys.available_memory();
        metrics.set_machine_available(available);
        let snap = tier.snapshot();
        let limit = limit_for(snap.budget, snap.bytes, available, floor);
        if available < floor && !short {
            tracing::warn!(
                available,
                floor,
                held = snap.bytes,
                new_limit = limit,
                "machine is short of memory; the memory tier is giving memory back"
            );
        } else if available >= floor && short {
            tracing::info!(available, floor, "machine memory recovered");
        }
        short = available < floor;
        if short {
            // Spare buffers first: they cost a page fault per 4 KiB to make again, a sample
            // costs a read and a decode.
            release_buffers();
        }
        tier.set_limit(limit);
        if short {
            // What the tier let go, back to the machine now rather than at the allocator's
            // leisure.
            crate::alloc::give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limit_follows_available_memory() {
        // Plenty available: the budget.
        assert_eq!(limit_for(100, 10, 1000, 100), 100);
        // Close to the floor: may only grow into what is above it.
        assert_eq!(limit_for(100, 10, 120, 100), 30);
        // Below the floor: give back the deficit.
        assert_eq!(limit_for(100, 50, 80, 100), 30);
        assert_eq!(limit_for(100, 5, 0, 100), 0);
    }
}
