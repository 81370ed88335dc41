//! The footprint account: the daemon's memory that grows with datasets and streams outside the
//! cache (each sample's size as a reader says it, file lists, the scratch tier's index, streams'
//! plans), counted in one place, inside the memory budget (the memory tier leaves room for
//! what is counted), each byte charged to someone:
//!
//! - a user, for the datasets they add and the streams they open, up to their share
//!   (`limits.user_footprint_bytes`);
//! - the config, for the admin's datasets (the admin sized them: no share, only the total).
//!
//! All charges together stay within `limits.footprint_bytes` (by default half the memory
//! budget), so the cache always keeps the rest. A charge is asked for before anything large is
//! allocated, and one that does not fit is refused with what it would cost and the limit that
//! stops it (RESOURCE_EXHAUSTED); nothing is allocated then. Cached samples are not charged to
//! anyone: they are one shared tier, kept by the open streams' next use.

use crate::error::{Error, Kind};
use crate::sync::Locked;
use crate::tiers::memory::MemoryTier;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Who pays for a charge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Payer {
    /// A local user, by uid.
    User(u32),
    /// The config's own datasets.
    Config,
    /// Clients over TCP (anonymous: one share for them all).
    Tcp,
}

impl Payer {
    /// The payer for what `uid` asks for: root and the daemon's own user pay as the config.
    pub fn of_uid(uid: Option<u32>) -> Payer {
        match uid {
            Some(u) if !crate::access::is_admin_uid(u) => Payer::User(u),
            _ => Payer::Config,
        }
    }

    fn describe(&self) -> String {
        match self {
            Payer::User(uid) => match crate::access::name_of_user(*uid) {
                Some(name) => format!("user {name} (uid {uid})"),
                None => format!("uid {uid}"),
            },
            Payer::Config => "the config's datasets".to_string(),
            Payer::Tcp => "clients over TCP".to_string(),
        }
    }
}

/// The account.
pub struct Footprint {
    /// Bytes all charges may take together.
    total_limit: u64,
    /// Bytes one user's charges may take together.
    user_limit: u64,
    state: Mutex<State>,
    /// Told the total after every change, to leave it room.
    memory: Option<Arc<MemoryTier>>,
}

#[derive(Default)]
struct State {
    total: u64,
    by_payer: HashMap<Payer, u64>,
}

/// Bytes charged, given back when dropped.
pub struct Charge {
    account: Arc<Footprint>,
    payer: Payer,
    bytes: u64,
}

impl Charge {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.account.release(self.payer, self.bytes);
    }
}

impl std::fmt::Debug for Charge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Charge({:?}, {} bytes)", self.payer, self.bytes)
    }
}

/// Bytes as a person reads them ("1.5 GB").
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "kB", "MB", "GB", "TB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1000.0 && u < UNITS.len() - 1 {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} bytes")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

impl Footprint {
    /// An account of at most `total_limit` bytes, `user_limit` for each user, whose total
    /// `memory` (the memory tier) leaves room for.
    pub fn new(total_limit: u64, user_limit: u64, memory: Option<Arc<MemoryTier>>) -> Arc<Self> {
        Arc::new(Footprint {
            total_limit,
            user_limit,
            state: Mutex::default(),
            memory,
        })
    }

    /// An account without limits (tests, tools).
    pub fn unlimited() -> Arc<Self> {
        Footprint::new(u64::MAX, u64::MAX, None)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.locked()
    }

    /// Charges `bytes` to `payer` for `what` (e.g. "dataset \"alice/x\": the scratch tier's
    /// index of 134,217,728 samples"), or says why not: over the payer's share, or over all
    /// charges' limit.
    pub fn charge(self: &Arc<Self>, payer: Payer, bytes: u64, what: &str) -> Result<Charge, Error> {
        let mut state = self.lock();
        let mine = state.by_payer.get(&payer).copied().unwrap_or(0);
        let over_share =
            payer != Payer::Config && mine.checked_add(bytes).is_none_or(|n| n > self.user_limit);
        if over_share {
            return Err(Error::new(
                Kind::Exhausted,
                format!(
                    "{what} would take {} of the daemon's memory; {} has {} of {} \
                     (limits.user_footprint_bytes) in use already: remove a dataset or end \
                     a stream, or ask the admin for a larger share",
                    human(bytes),
                    payer.describe(),
                    human(mine),
                    human(self.user_limit)
                ),
            ));
        }
        if state
            .total
            .checked_add(bytes)
            .is_none_or(|n| n > self.total_limit)
        {
            return Err(Error::new(
                Kind::Exhausted,
                format!(
                    "{what} would take {} of the daemon's memory; its datasets and streams \
                     hold {} of the {} they may (limits.footprint_bytes)",
                    human(bytes),
                    human(state.total),
                    human(self.total_limit)
                ),
            ));
        }
        state.total += bytes;
        *state.by_payer.entry(payer).or_default() += bytes;
        // Told under the lock: two changes reach the tier in the order they were made.
        self.tell(state.total);
        drop(state);
        Ok(Charge {
            account: self.clone(),
            payer,
            bytes,
        })
    }

    fn release(&self, payer: Payer, bytes: u64) {
        let mut state = self.lock();
        state.total -= bytes;
        if let Some(n) = state.by_payer.get_mut(&payer) {
            *n -= bytes;
            if *n == 0 {
                state.by_payer.remove(&payer);
            }
        }
        self.tell(state.total);
    }

    fn tell(&self, total: u64) {
        if let Some(m) = &self.memory {
            m.set_footprint(total);
        }
    }

    /// Bytes charged in all.
    pub fn total(&self) -> u64 {
        self.lock().total
    }

    /// Bytes charged to `payer`.
    pub fn of(&self, payer: Payer) -> u64 {
        self.lock().by_payer.get(&payer).copied().unwrap_or(0)
    }

    /// The limits: (all charges, one user's).
    pub fn limits(&self) -> (u64, u64) {
        (self.total_limit, self.user_limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_stay_within_each_users_share_and_the_total_and_come_back() {
        let memory = Arc::new(MemoryTier::new(1000));
        let account = Footprint::new(500, 300, Some(memory.clone()));
        let a = account.charge(Payer::User(1), 200, "a").unwrap();
        assert_eq!(memory.snapshot().limit, 800, "the tier leaves room");
        let e = account
            .charge(Payer::User(1), 101, "dataset x")
            .unwrap_err();
        let said = format!("{e}");
        assert!(said.contains("dataset x would take 101 bytes"), "{said}");
        assert!(said.contains("limits.user_footprint_bytes"), "{said}");
        let _b = account.charge(Payer::User(2), 250, "b").unwrap();
        // The config has no share, but the total holds for it too.
        let e = account.charge(Payer::Config, 51, "c").unwrap_err();
        assert!(format!("{e}").contains("limits.footprint_bytes"), "{e}");
        let _c = account.charge(Payer::Config, 50, "c").unwrap();
        drop(a);
        assert_eq!((account.total(), account.of(Payer::User(1))), (300, 0));
        assert_eq!(memory.snapshot().limit, 700);
        assert!(account.charge(Payer::User(1), u64::MAX, "huge").is_err());
    }
}
