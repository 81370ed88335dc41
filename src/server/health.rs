//! The standard gRPC health service (grpc.health.v1), for Kubernetes probes, load balancers
//! and `grpc_health_probe`. The server ("" or `larder.v1.Larder`) is SERVING from the moment
//! it listens and NOT_SERVING once the daemon is shutting down (open streams drain meanwhile).
//! A dataset's name is a service too: SERVING while it is served, NOT_SERVING while it is being
//! opened, failed to open, or its reader failed and has not started again; answered only to
//! callers who may list it (TCP callers: datasets with `tcp = true`), NOT_FOUND to others, as
//! for a name that does not exist.

use super::service::Service;
use crate::access::Caller;
use crate::proto::health::health_check_response::ServingStatus;
use crate::proto::health::health_server::Health;
use crate::proto::health::{HealthCheckRequest, HealthCheckResponse};
use futures::Stream;
use std::pin::Pin;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// The name the whole service answers to, besides "".
const SERVICE: &str = "larder.v1.Larder";

/// How often a Watch looks at a dataset's status again.
const WATCH_INTERVAL: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct HealthService {
    service: Service,
}

impl HealthService {
    pub fn new(service: Service) -> HealthService {
        HealthService { service }
    }

    /// The status of `name` as `who` may know it (None: no such service for them).
    async fn status(&self, who: &Caller, name: &str) -> Option<ServingStatus> {
        let up = !self.service.shutdown().is_stopped();
        let serving = if name.is_empty() || name == SERVICE {
            true
        } else {
            self.service.dataset_serving(who, name).await?
        };
        Some(if up && serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        })
    }
}

fn answer(status: ServingStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status as i32,
    }
}

type Statuses = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for HealthService {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let who = Caller::of(&request);
        let name = request.into_inner().service;
        match self.status(&who, &name).await {
            Some(s) => Ok(Response::new(answer(s))),
            None => Err(Status::not_found(format!(
                "no service or dataset {name:?} that you may see"
            ))),
        }
    }

    type WatchStream = Statuses;

    /// The status now, then each change; ends after NOT_SERVING at shutdown (so the server's
    /// drain is not held open by watchers).
    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Statuses>, Status> {
        let who = Caller::of(&request);
        let name = request.into_inner().service;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let this = self.clone();
        let mut stop = self.service.shutdown();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let status = this
                    .status(&who, &name)
                    .await
                    .unwrap_or(ServingStatus::ServiceUnknown);
                if last != Some(status) {
                    if tx.send(Ok(answer(status))).await.is_err() {
                        return;
                    }
                    last = Some(status);
                }
                if stop.is_stopped() {
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(WATCH_INTERVAL) => {}
                    _ = stop.stopped() => {}
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}
