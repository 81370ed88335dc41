//! What every eviction policy must do, run against each (add a new policy to `policies`).

use super::{Eviction, NextUse, StaleLru};
use crate::tiers::memory::{cost_of, MemoryTier};
use bytes::Bytes;

/// A policy's name and how to make one.
type Policy = (&'static str, fn() -> Box<dyn Eviction>);

fn policies() -> Vec<Policy> {
    vec![
        ("stale_lru", || Box::new(StaleLru::new())),
        ("next_use", || Box::new(NextUse::new())),
    ]
}

fn sample(n: usize) -> Bytes {
    Bytes::from(vec![7u8; n])
}

/// Runs `check` on a fresh tier of `budget` bytes for every policy, with and without streams.
fn each(budget: u64, check: impl Fn(&str, &MemoryTier)) {
    for (name, make) in policies() {
        for streaming in [0, 1_000_000] {
            let tier = MemoryTier::with_policy(budget, make());
            tier.set_streaming_samples(streaming);
            check(&format!("{name}, {streaming} samples streaming"), &tier);
        }
    }
}

#[test]
fn never_exceeds_its_budget_nor_keeps_what_cannot_fit() {
    each(10 * cost_of(100), |policy, tier| {
        for i in 0..100 {
            tier.insert((0, i), sample(100), 1);
            let s = tier.snapshot();
            assert!(s.bytes <= s.budget, "{policy}");
        }
        assert!(tier.snapshot().entries <= 10, "{policy}");
        assert!(
            !tier.insert((0, 1000), sample(100_000), 1),
            "{policy}: larger than the budget"
        );
    });
}

#[test]
fn what_it_holds_comes_back_whole_and_counts_add_up() {
    each(5 * cost_of(100), |policy, tier| {
        let mut kept = vec![];
        for i in 0..20u64 {
            let data = Bytes::from(vec![i as u8; 100]);
            if tier.insert((1, i), data, 40) {
                kept.push(i);
            }
            // Some lookups in between, as streams do.
            tier.get(&(1, i / 2));
        }
        let s = tier.snapshot();
        let held: Vec<u64> = (0..20).filter(|&i| tier.peek(&(1, i)).is_some()).collect();
        assert_eq!(s.entries, held.len() as u64, "{policy}");
        assert_eq!(s.bytes, held.len() as u64 * cost_of(100), "{policy}");
        assert_eq!(s.disk_bytes, held.len() as u64 * 40, "{policy}");
        for i in held {
            assert!(kept.contains(&i), "{policy}: holds {i}, never kept");
            assert!(
                tier.get(&(1, i)).unwrap().iter().all(|&b| b == i as u8),
                "{policy}"
            );
        }
    });
}

#[test]
fn shrinking_the_limit_evicts_down_to_it_and_restoring_stops_at_the_budget() {
    each(10 * cost_of(10), |policy, tier| {
        for i in 0..10 {
            assert!(tier.insert((0, i), sample(10), 1), "{policy}: room for all");
        }
        tier.set_limit(3 * cost_of(10));
        let s = tier.snapshot();
        assert_eq!((s.entries, s.evicted), (3, 7), "{policy}");
        tier.set_limit(0);
        assert_eq!(tier.snapshot().entries, 0, "{policy}");
        tier.set_limit(u64::MAX);
        assert_eq!(tier.snapshot().limit, tier.snapshot().budget, "{policy}");
    });
}
