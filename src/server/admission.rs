//! Admission: whether a caller may have a dataset now (see `access` for the rule), for the
//! handlers when a request comes and for streams while they run.

use crate::access::{self, Caller};
use crate::catalog::Dataset;
use std::sync::Arc;
use tonic::Status;

/// Whether `who` may have `ds` now: its grants, or its files checked as them (off the async
/// runtime); PERMISSION_DENIED naming the dataset and why.
pub async fn admit(ds: &Arc<Dataset>, who: &Caller) -> Result<(), Status> {
    let (d, w) = (ds.clone(), who.clone());
    let outcome =
        tokio::task::spawn_blocking(move || access::check(&d.guard, &w, &d.source.files()))
            .await
            .unwrap_or_else(|e| Err(format!("the access check failed: {e}")));
    outcome.map_err(|why| {
        tracing::info!(dataset = %ds.name, caller = %who.describe(), "denied: {why}");
        access::denied(&ds.name, who, &why).into()
    })
}
