//! A batch queued on its connection whose outcome is still to come: its outcome under its
//! deadline, and what ends it otherwise (the session's end past the deadline; a cancel when
//! its caller stops waiting, `cancel.rs`).

use super::cancel::CancelOnDrop;
use super::pending::AbortHandle;
use crate::error::{Error, Result};
use kvbridge_proto::handshake::Step;
use kvbridge_proto::PeerId;
use std::time::Duration;
use tokio::sync::oneshot;

/// A batch queued on its connection whose outcome is still to come
/// (`DataPath::submit`).
pub(crate) struct Submitted {
    pub(crate) rx: oneshot::Receiver<Result<()>>,
    pub(crate) until: tokio::time::Instant,
    pub(crate) deadline: Duration,
    pub(crate) step: Step,
    pub(crate) peer: PeerId,
    pub(crate) abort: AbortHandle,
    /// (A write or read) Cancels the batch when this is dropped before its outcome came.
    pub(crate) cancel: Option<CancelOnDrop>,
}

impl Submitted {
    /// The batch's outcome, within the deadline it was submitted under. Past it, the
    /// session is torn down (so nothing of the batch can land later) and the outcome is
    /// `Timeout`. Dropped before, a write or read is cancelled (`cancel.rs`).
    pub(crate) async fn outcome(mut self) -> Result<()> {
        let r = match tokio::time::timeout_at(self.until, &mut self.rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::lost(self.peer.as_str(), self.step, "session ended")),
            Err(_) => return Err(self.abort_after_timeout().await),
        };
        if let Some(c) = self.cancel.take() {
            c.disarm();
        }
        r
    }

    /// Past the deadline: asks the session to tear down, and returns once it drained us
    /// (after that nothing of this batch can land any more).
    pub(crate) async fn abort_after_timeout(mut self) -> Error {
        let err = Error::Timeout {
            peer: self.peer.to_string(),
            step: self.step,
            after: self.deadline,
        };
        self.abort.abort(err.clone());
        let r = match tokio::time::timeout(Duration::from_secs(30), &mut self.rx).await {
            Ok(Ok(Err(e))) if e != err => e,
            _ => err,
        };
        if let Some(c) = self.cancel.take() {
            c.disarm();
        }
        r
    }
}
