//! Admission: whether a caller may have a dataset now (see `access` for the rule), for the
//! handlers when a request comes and for streams while they run. A check that reads files runs
//! in a child as the caller, two of a user's at once at most (more wait their turn on the
//! runtime); a check that failed stands for [`DENIAL_TTL`] for the same user, dataset and
//! root stamp, so asking again and again costs no more children.

use crate::access::{self, Caller};
use crate::catalog::Dataset;
use crate::sync::Locked;
use crate::turns::Turns;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tonic::Status;

/// A user's access checks running at once.
const CHECKS_PER_USER: usize = 2;

/// How long a failed check stands (unless the dataset's root changes: a chmod moves its ctime).
pub const DENIAL_TTL: Duration = Duration::from_secs(5);

/// Who was denied which dataset, with the root's status-change time then.
type DenialKey = (u32, u32, Vec<u32>, u32, Option<i128>);

fn denials() -> &'static Mutex<HashMap<DenialKey, (Instant, String)>> {
    static DENIALS: OnceLock<Mutex<HashMap<DenialKey, (Instant, String)>>> = OnceLock::new();
    DENIALS.get_or_init(Mutex::default)
}

fn turns() -> &'static Turns {
    static TURNS: OnceLock<Turns> = OnceLock::new();
    TURNS.get_or_init(|| Turns::new(CHECKS_PER_USER))
}

/// Whether `who` may have `ds` now: its grants, or its files checked as them (off the async
/// runtime, in their turn); PERMISSION_DENIED naming the dataset and why.
pub async fn admit(ds: &Arc<Dataset>, who: &Caller) -> Result<(), Status> {
    let denied = |why: String| -> Status {
        tracing::info!(dataset = %ds.name, caller = %who.describe(), "denied: {why}");
        access::denied(&ds.name, who, &why).into()
    };
    if let Some(decided) = access::decide(&ds.guard, who) {
        return decided.map_err(denied);
    }
    let Caller::Local(id) = who else {
        unreachable!("decide answers for TCP callers")
    };
    let key = (
        id.uid,
        id.gid,
        id.groups.clone(),
        ds.id,
        // A user's dataset's path is not looked at here (it may be a file system its user
        // controls): its denials stand their time alone.
        ds.owner
            .is_none()
            .then(|| access::ctime_of(ds.source.root()))
            .flatten(),
    );
    {
        let mut denials = denials().locked();
        denials.retain(|_, (at, _)| at.elapsed() < DENIAL_TTL);
        if let Some((_, why)) = denials.get(&key) {
            return Err(denied(why.clone()));
        }
    }
    let _turn = turns().take(id.uid as u64).await;
    let (d, w) = (ds.clone(), who.clone());
    let outcome =
        tokio::task::spawn_blocking(move || access::check(&d.guard, &w, &d.source.files()))
            .await
            .unwrap_or_else(|e| Err(format!("the access check failed: {e}")));
    outcome.map_err(|why| {
        let mut denials = denials().locked();
        denials.insert(key, (Instant::now(), why.clone()));
        denied(why)
    })
}
