//! Shutdown as its own type: every part that must stop when the daemon stops (the servers,
//! the Unix-socket router, ring connections, streams, warms) holds a [`Shutdown`] and awaits
//! [`Shutdown::stopped`]; the daemon and the binary's signal handler hold the [`Trigger`].

use crate::error::{Error, Kind};
use tokio::sync::watch;
use tonic::Status;

/// Starts the daemon's shutdown.
#[derive(Clone)]
pub struct Trigger(watch::Sender<bool>);

/// Told when the daemon shuts down.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// A trigger and what it tells.
pub fn channel() -> (Trigger, Shutdown) {
    let (tx, rx) = watch::channel(false);
    (Trigger(tx), Shutdown(rx))
}

impl Trigger {
    /// Shuts the daemon down (once; later calls do nothing more).
    pub fn fire(&self) {
        let _ = self.0.send(true);
    }

    /// One more listener.
    pub fn subscribe(&self) -> Shutdown {
        Shutdown(self.0.subscribe())
    }
}

impl Shutdown {
    /// Resolves once the daemon is shutting down (at once if it already is).
    pub async fn stopped(&mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }

    pub fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }
}

/// What a stream or warm cut short by the shutdown ends with.
pub fn shutting_down() -> Status {
    Error::new(
        Kind::ShuttingDown,
        "larderd is shutting down; reconnect and resume from the next batch",
    )
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_listener_hears_it_even_late() {
        let (trigger, mut early) = channel();
        assert!(!early.is_stopped());
        let waiting = tokio::spawn(async move { early.stopped().await });
        trigger.fire();
        waiting.await.unwrap();
        let mut late = trigger.subscribe();
        assert!(late.is_stopped());
        late.stopped().await;
    }
}
