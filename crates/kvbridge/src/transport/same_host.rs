//! The same-host backend: the one place that decides whether a batch is copied straight
//! into or out of the peer's memory (shared memory, or cross-memory attach once the probe
//! passed for this peer, `cma.rs`) instead of going over TCP, and that copies it. A batch may
//! mix both ways, region by region (`ShmPeer::resolve`). Two callers, both through the
//! one-sided seam ([`OneSided`]): the data path, for a write copied by the task that issued
//! it ([`OneSided::post`]); and the TCP writer, for a batch queued on its connection (reads,
//! and writes on a current-thread runtime), in order with its frames
//! ([`OneSided::run_queued`]).

use crate::dir::Dir;
use crate::error::Error;
use crate::region::LocalSlice;
use crate::transport::cma::CopyError;
use crate::transport::one_sided::{BatchRef, OneSided, Outcome, Posted, RunQueued};
use crate::transport::shm::{Remote, ShmFail, ShmPeer};
use kvbridge_proto::handshake::Step;
use kvbridge_proto::msg::{ErrorCode, OpDesc};
use kvbridge_proto::route::Offer;
use kvbridge_proto::PeerId;
use std::sync::Arc;

/// Largest write copied in the calling task without lending its thread first: about 2 ms of
/// memcpy at 8 GiB/s. Lending the thread costs a thread wake-up (measured: a default demo's
/// KV rate fell from 5.2 to 4.3 GiB/s, medians of 4 runs each, when its 8 MiB chunks were
/// copied with `block_in_place`).
pub(crate) const INLINE_COPY_MAX: u64 = 16 << 20;

/// A session's way to the peer's regions that this side reaches directly.
#[derive(Clone)]
pub(crate) struct SameHostRoute {
    peer: PeerId,
    shm: Arc<ShmPeer>,
}

/// How a direct copy runs on the calling thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyOn {
    /// Right here.
    ThisThread,
    /// After lending the thread to the runtime (`block_in_place`), so the runtime's other
    /// tasks move on meanwhile.
    LentThread,
}

impl SameHostRoute {
    /// The route to `peer`'s regions that `shm` reaches.
    pub(crate) fn new(peer: PeerId, shm: Arc<ShmPeer>) -> Self {
        Self { peer, shm }
    }

    /// Copies a batch whose regions resolved to `maps`, on the thread `on` says.
    fn copy(
        &self,
        dir: Dir,
        descs: &[OpDesc],
        maps: &[Arc<Remote>],
        locals: &[LocalSlice],
        on: CopyOn,
    ) -> Result<(), ShmFail> {
        let copy = || self.shm.copy_batch(dir, descs, maps, locals);
        match on {
            CopyOn::ThisThread => copy(),
            CopyOn::LentThread => tokio::task::block_in_place(copy),
        }
    }
}

impl OneSided for SameHostRoute {
    fn name(&self) -> &'static str {
        "same-host"
    }

    /// Whether the regions are mapped is looked up in `post`, with no await before the copy
    /// (a region revoked in between then sends the batch over TCP): here it is only said
    /// that the copy runs in the caller.
    fn offer(&self, _dir: Dir, _descs: &[OpDesc]) -> Offer {
        Offer {
            covers: true,
            copies_in_caller: true,
        }
    }

    fn reaches_any(&self) -> bool {
        self.shm.len() > 0
    }

    /// Copies the batch right in the task when it is at most [`INLINE_COPY_MAX`] bytes (a
    /// millisecond or two of the worker's time, less than lending the thread would cost),
    /// after lending the thread (`block_in_place`) when larger, so the runtime's other tasks
    /// move on meanwhile. The batch is complete when this returns.
    fn post<'a>(&'a self, b: BatchRef<'a>) -> Posted<'a> {
        let Some(maps) = self.shm.resolve(b.descs) else {
            return Posted::Ended(Outcome::GivenBack);
        };
        let on = if b.bytes <= INLINE_COPY_MAX {
            CopyOn::ThisThread
        } else {
            CopyOn::LentThread
        };
        Posted::Ended(match self.copy(b.dir, b.descs, &maps, b.locals, on) {
            Ok(()) => Outcome::Done,
            Err(ShmFail::Revoked(_)) if self.shm.ended() => Outcome::SessionEnded,
            Err(f) => Outcome::Failed(direct_error(&self.peer, b.dir, f)),
        })
    }

    /// Copies the batch on the calling thread (the writer's, which may be a data thread
    /// outside the runtime) when every region `descs` names is mapped; sends it over TCP
    /// otherwise. The regions are resolved with no await before the copy, so a region
    /// revoked in between (detached, say) is either still copied under its read lock (the
    /// revocation waits for the copy) or sends the batch over TCP. A region revoked because
    /// the session's shared-memory side ended is a lost connection.
    fn run_queued(
        &self,
        dir: Dir,
        descs: &[OpDesc],
        locals: &mut dyn FnMut() -> Option<Vec<LocalSlice>>,
    ) -> RunQueued {
        let Some(maps) = self.shm.resolve(descs) else {
            return RunQueued::NotHere;
        };
        let Some(locals) = locals() else {
            return RunQueued::AlreadyEnded;
        };
        let r = self.copy(dir, descs, &maps, &locals, CopyOn::ThisThread);
        drop(locals);
        RunQueued::Done(r.map_err(|f| match f {
            // Revoked because the session's shared-memory side ended (the peer closed or
            // died), not by the peer's choice: a lost connection, whoever asks.
            ShmFail::Revoked(r) if self.shm.ended() => Error::lost(
                self.peer.as_str(),
                step_of(dir),
                format!("region {r}: the session's shared-memory connection ended"),
            ),
            f => direct_error(&self.peer, dir, f),
        }))
    }
}

/// The step a direct copy in `dir` is part of.
fn step_of(dir: Dir) -> Step {
    match dir {
        Dir::Write => Step::Write,
        Dir::Read => Step::Read,
    }
}

/// The error of a direct copy that failed.
fn direct_error(peer: &PeerId, dir: Dir, f: ShmFail) -> Error {
    let step = step_of(dir);
    let (code, region, what) = match f {
        ShmFail::Revoked(r) => (
            ErrorCode::UnknownRegion,
            r,
            "was revoked by the peer (direct copy)".to_string(),
        ),
        ShmFail::OutOfBounds(r) => (
            ErrorCode::OutOfBounds,
            r,
            "does not fit what the peer announced (direct copy)".to_string(),
        ),
        ShmFail::Cma(r, CopyError::PeerGone) => {
            return Error::lost(
                peer.as_str(),
                step,
                format!("region {r}: the peer process exited (cross-memory attach)"),
            )
        }
        ShmFail::Cma(r, e) => (
            ErrorCode::Internal,
            r,
            format!("could not be copied with cross-memory attach: {e}"),
        ),
    };
    Error::Rejected {
        peer: peer.to_string(),
        step,
        code,
        message: format!("region {region} {what}"),
    }
}
