//! How many writes are still landing through something (a write window): the count, the
//! guard each write holds until it ends, and a wait for the count to reach zero.
//!
//! Below both its users: the grants (`crate::grant`) open and close windows and wait for
//! them to drain; the region guards (`crate::region::RegionUse`) carry the holds of the
//! transfer they guard.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The writes landing through one window.
#[derive(Default)]
pub(crate) struct Landing {
    count: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl Landing {
    /// Writes landing now.
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Waits until no write is landing. Missing no wake-up: the waiter is enabled before
    /// the count is read.
    pub(crate) async fn drained(&self) {
        loop {
            let n = self.idle.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            n.await;
        }
    }
}

/// One write counted in a [`Landing`] until it drops.
pub(crate) struct LandingHold(Arc<Landing>);

impl LandingHold {
    pub(crate) fn new(l: &Arc<Landing>) -> Self {
        l.count.fetch_add(1, Ordering::AcqRel);
        LandingHold(l.clone())
    }
}

impl Clone for LandingHold {
    fn clone(&self) -> Self {
        LandingHold::new(&self.0)
    }
}

impl Drop for LandingHold {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}
