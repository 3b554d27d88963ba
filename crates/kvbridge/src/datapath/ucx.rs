//! Batches carried by UCX: a batch whose every region the peer's UCX route covers
//! (`transport/ucx_route.rs`) is posted on the channel's UCX worker instead of the TCP data
//! connections. It holds a ticket in the data path's `order` until its bytes are in place
//! at the peer (a write batch completes only after a flush), so a notification issued
//! meanwhile waits for it ([`DataPath::wait_earlier`]).

use super::DataPath;
use crate::dir::Dir;
use crate::error::{Error, Result};
use crate::region::LocalSlice;
use crate::transport::one_sided::OneSidedError;
use crate::transport::ucx_route::UcxRoute;
use kvbridge_proto::handshake::Step;
use kvbridge_proto::msg::{ErrorCode, OpDesc};
use std::sync::Arc;
use std::time::Duration;

impl DataPath {
    /// From now on, batches whose regions `route` covers go over UCX.
    pub(crate) fn set_ucx(&self, route: Arc<UcxRoute>) {
        let _ = self.ucx.set(route);
    }

    /// Whether some of the peer's regions are reached over UCX.
    pub(crate) fn over_ucx(&self) -> bool {
        self.ucx.get().is_some_and(|r| r.regions() > 0)
    }

    /// Moves a batch of `bytes` over UCX when the peer's route covers every region it
    /// names; gives it back (nothing done) when not, or when the route lost a region in
    /// between (it then goes over TCP).
    pub(super) async fn transfer_ucx(
        &self,
        dir: Dir,
        deadline: Duration,
        bytes: u64,
        descs: Vec<OpDesc>,
        locals: Vec<LocalSlice>,
    ) -> std::result::Result<Result<()>, (Vec<OpDesc>, Vec<LocalSlice>)> {
        let Some(route) = self.ucx.get().filter(|r| r.covers(&descs)) else {
            return Err((descs, locals));
        };
        let step = match dir {
            Dir::Write => Step::Write,
            Dir::Read => Step::Read,
        };
        let until = tokio::time::Instant::now() + deadline;
        let room = match self
            .pending
            .acquire_room(step, deadline, until, bytes)
            .await
        {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        let _ticket = self.ticket(1);
        if let Some(e) = self.pending.closed() {
            return Ok(Err(e));
        }
        // A mark on the session's timeline (`session::TIMELINE`, above this layer).
        let t = std::time::Instant::now();
        let r = route.transfer(dir, &descs, &locals, until.into_std()).await;
        tracing::debug!(target: "kvbridge::timeline", peer = %self.peer, ?dir, bytes,
            took_us = t.elapsed().as_micros() as u64, ok = r.is_ok(), "ucx batch");
        drop(room);
        match r {
            Ok(()) => Ok(Ok(())),
            // Unmapped by the peer between the check and the post: nothing was posted.
            Err(OneSidedError::UnknownRegion { side: "remote", .. }) => Err((descs, locals)),
            Err(e) => {
                let err = ucx_error(self.peer.as_str(), step, deadline, e);
                // Some operations of the batch may still land: end the session, as a TCP
                // batch that failed after it was sent does.
                self.abort.abort(err.clone());
                Ok(Err(err))
            }
        }
    }
}

/// The engine's error for a UCX batch that failed.
fn ucx_error(peer: &str, step: Step, after: Duration, e: OneSidedError) -> Error {
    match e {
        OneSidedError::Deadline { .. } => Error::Timeout {
            peer: peer.to_string(),
            step,
            after,
        },
        OneSidedError::OutOfBounds { .. } | OneSidedError::UnknownRegion { .. } => {
            Error::Rejected {
                peer: peer.to_string(),
                step,
                code: ErrorCode::OutOfBounds,
                message: format!("UCX: {e}"),
            }
        }
        e => Error::lost(peer, step, format!("UCX: {e}")),
    }
}
