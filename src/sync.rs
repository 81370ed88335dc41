//! The one rule for the daemon's mutexes: a thread that panicked while holding one (a bug,
//! already logged by the panic) leaves data every other user of it can still read and fix up,
//! so its poison is ignored and the guard taken. Every `Mutex` is locked through
//! [`Locked::locked`]; clippy (`disallowed-methods` in clippy.toml) refuses `Mutex::lock`
//! elsewhere.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// A mutex locked by the crate's rule.
pub trait Locked<T> {
    /// The guard, poisoned or not.
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        #[allow(clippy::disallowed_methods)]
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
