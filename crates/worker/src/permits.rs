//! The worker's concurrency limit: how many deliveries may be in flight at once.
//!
//! Only the consume loop takes permits and only the delivery tasks give them back, so this is
//! an atomic count and a [`Notify`] for the loop to sleep on, rather than a general semaphore:
//! tokio's takes a lock on every release to look for waiters, once per message here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// The permits of one worker, shared by its sessions: handlers of a lost connection still hold
/// theirs until they finish.
#[derive(Debug)]
pub(crate) struct Permits {
    free: AtomicUsize,
    /// Notified when a permit is given back while none was free.
    freed: Notify,
}

/// One delivery's place in flight, given back when dropped.
#[derive(Debug)]
pub(crate) struct Permit(Arc<Permits>);

impl Permits {
    /// The largest limit (tokio's semaphore's, which the setting was first checked against).
    pub(crate) const MAX: usize = usize::MAX >> 3;

    pub(crate) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            free: AtomicUsize::new(limit),
            freed: Notify::new(),
        })
    }

    /// A permit if one is free.
    pub(crate) fn try_take(self: &Arc<Self>) -> Option<Permit> {
        self.free
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| n.checked_sub(1))
            .ok()
            .map(|_| Permit(Arc::clone(self)))
    }

    /// Waits for a free permit. Cancel-safe: dropping the future takes nothing.
    pub(crate) async fn take(self: &Arc<Self>) -> Permit {
        loop {
            if let Some(p) = self.try_take() {
                return p;
            }
            // A release between the check above and this wait is not lost: `notify_one` keeps
            // a wake-up for the next waiter when there is none yet.
            self.freed.notified().await;
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.0.free.fetch_add(1, Ordering::Release) == 0 {
            self.0.freed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn no_more_than_the_limit() {
        let permits = Permits::new(2);
        let a = permits.try_take().expect("first");
        let _b = permits.try_take().expect("second");
        assert!(permits.try_take().is_none());
        drop(a);
        assert!(permits.try_take().is_some());
    }

    #[tokio::test]
    async fn a_waiter_wakes_when_a_permit_comes_back() {
        let permits = Permits::new(1);
        let held = permits.try_take().expect("the only one");
        let waiter = tokio::spawn({
            let permits = Arc::clone(&permits);
            async move { permits.take().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "no permit free yet");
        drop(held);
        let got = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .expect("no panic");
        assert!(permits.try_take().is_none(), "the waiter holds it");
        drop(got);
        assert!(permits.try_take().is_some());
    }

    #[tokio::test]
    async fn a_release_before_the_wait_is_not_lost() {
        let permits = Permits::new(1);
        let held = permits.try_take().expect("the only one");
        assert!(permits.try_take().is_none());
        // Given back after the loop found none free but before it sleeps: that sleep must end.
        drop(held);
        tokio::time::timeout(Duration::from_secs(5), permits.freed.notified())
            .await
            .expect("the wake-up was kept");
        assert!(permits.try_take().is_some());
    }
}
