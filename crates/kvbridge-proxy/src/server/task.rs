//! A task that belongs to one request: aborted when its guard is dropped (the request
//! failed, or its client went away), unless the request lets it run to its end.

use tokio::task::AbortHandle;

/// Aborts its task when dropped, unless [`Detachable::detach`]ed first.
pub(crate) struct Detachable(Option<AbortHandle>);

impl Detachable {
    /// The guard of `task` (whose `JoinHandle` the caller may drop or await).
    pub(crate) fn new(task: &tokio::task::JoinHandle<()>) -> Detachable {
        Detachable(Some(task.abort_handle()))
    }

    /// Lets the task run to its end on its own (its own deadline bounds it).
    pub(crate) fn detach(mut self) {
        self.0 = None;
    }
}

impl Drop for Detachable {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}
