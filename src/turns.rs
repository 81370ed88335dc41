//! Turns per user: at most so many of one user's blocking jobs of a kind (access checks,
//! plans, recognitions) at once, the rest waiting on the async runtime (no thread waits). A user
//! who floods the daemon waits behind their own requests; other users' go on.

use crate::sync::Locked;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub struct Turns {
    each: usize,
    by_user: Mutex<HashMap<u64, Arc<Semaphore>>>,
}

impl Turns {
    /// `each` turns per user.
    pub fn new(each: usize) -> Turns {
        Turns {
            each: each.max(1),
            by_user: Mutex::default(),
        }
    }

    /// One of `user`'s turns, once free (held until dropped).
    pub async fn take(&self, user: u64) -> OwnedSemaphorePermit {
        let turns = {
            let mut by_user = self.by_user.locked();
            // Users with no turn taken and none waiting are forgotten.
            by_user.retain(|_, s| Arc::strong_count(s) > 1 || s.available_permits() < self.each);
            by_user
                .entry(user)
                .or_insert_with(|| Arc::new(Semaphore::new(self.each)))
                .clone()
        };
        turns.acquire_owned().await.expect("never closed")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_users_turns_leave_anothers_free() {
        let turns = Turns::new(2);
        let a1 = turns.take(1).await;
        let _a2 = turns.take(1).await;
        let waiting = tokio::time::timeout(std::time::Duration::from_millis(50), turns.take(1));
        assert!(waiting.await.is_err(), "a third of user 1's waits");
        let _b = tokio::time::timeout(std::time::Duration::from_millis(50), turns.take(2))
            .await
            .expect("user 2's turn is free");
        drop(a1);
        let _a3 = tokio::time::timeout(std::time::Duration::from_millis(50), turns.take(1))
            .await
            .expect("freed");
    }
}
