//! The engine below a one-sided backend that a single owner drives (UCX's worker, owned by
//! its thread, `ucx_thread.rs`), in the shape of NIXL's backend API (`backend_engine.h`):
//! an engine exports a local region as descriptor bytes
//! (`registerMem` + `getPublicData`), imports a peer's (`loadRemoteMD`), resolves a batch to
//! posted operations (`prepXfer` + `postXfer`), completes it asynchronously (`checkXfer`), and
//! revokes (`deregisterMem`, `unloadMD`).
//!
//! One-sided means the initiator checks every range against what the peer announced; the
//! target's CPU takes no part in a transfer (TCP, two-sided, validates on the receiving side:
//! `transport/tcp/`). A batch is complete only once its bytes are in place *at the peer*, so
//! a notification sent after [`OneSidedEngine::test`] returned `true` follows every write of the
//! batch.
//!
//! The data path does not drive an engine: it drives the backend that owns one, through
//! [`super::one_sided::OneSided`] (post a batch, complete it).
//!
//! Every method that names a peer names it in its error, and nothing here waits without a
//! deadline: [`OneSidedEngine::wait`] and [`OneSidedEngine::release`] take one, [`OneSidedEngine::test`] never
//! waits.

use crate::dir::Dir;
use crate::region::Region;
use kvbridge_proto::RegionId;
use std::time::{Duration, Instant};
use thiserror::Error;

/// One range of a one-sided batch: `len` bytes at `local_offset` of the local region
/// `local`, to or from `remote_offset` of the peer's region `remote`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RangeOp {
    /// A region this side exported to the backend.
    pub(crate) local: RegionId,
    /// Offset in it.
    pub(crate) local_offset: u64,
    /// A region of the peer, imported.
    pub(crate) remote: RegionId,
    /// Offset in it.
    pub(crate) remote_offset: u64,
    /// Bytes.
    pub(crate) len: u64,
}

/// The steps of a one-sided backend, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OneSidedStep {
    /// Registering a local region and packing its descriptor.
    Export,
    /// Reaching a peer from its address.
    Connect,
    /// Importing a peer's region descriptor.
    Import,
    /// Posting a batch.
    Post,
    /// Completing a batch.
    Complete,
    /// Dropping the use of a peer's region.
    Release,
    /// Unregistering a local region.
    Revoke,
    /// Leaving a peer.
    Disconnect,
}

impl std::fmt::Display for OneSidedStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OneSidedStep::Export => "export",
            OneSidedStep::Connect => "connect",
            OneSidedStep::Import => "import",
            OneSidedStep::Post => "post",
            OneSidedStep::Complete => "complete",
            OneSidedStep::Release => "release",
            OneSidedStep::Revoke => "revoke",
            OneSidedStep::Disconnect => "disconnect",
        })
    }
}

/// Why a one-sided step failed, grouped by cause.
#[derive(Debug, Error)]
#[non_exhaustive]
pub(crate) enum OneSidedError {
    // ---- the peer sent something unusable ----
    /// Bytes the peer sent (address, descriptor) were refused before the backend used them.
    #[error("peer {peer}, {step}: malformed bytes: {detail}")]
    Malformed {
        /// The peer.
        peer: String,
        /// Where.
        step: OneSidedStep,
        /// What was wrong.
        detail: String,
    },

    // ---- the batch does not fit what was announced ----
    /// A range names a region that is not (or no longer) exported or imported.
    #[error("peer {peer}, {step}: {side} region {region} is not known")]
    UnknownRegion {
        /// The peer.
        peer: String,
        /// Where.
        step: OneSidedStep,
        /// `local` or `remote`.
        side: &'static str,
        /// The region.
        region: RegionId,
    },
    /// A range lies outside its region.
    #[error("peer {peer}, {step}: bytes {offset}..+{len} lie outside {side} region {region} of {size} bytes")]
    OutOfBounds {
        /// The peer.
        peer: String,
        /// Where.
        step: OneSidedStep,
        /// `local` or `remote`.
        side: &'static str,
        /// The region.
        region: RegionId,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        size: u64,
    },
    /// The peer is not connected on this backend.
    #[error("peer {peer}, {step}: not connected")]
    NotConnected {
        /// The peer.
        peer: String,
        /// Where.
        step: OneSidedStep,
    },

    // ---- the transfer failed ----
    /// The backend failed the step (unreachable, reset or killed peer, refused access).
    #[error("peer {peer}, {step}: {detail}")]
    Failed {
        /// The peer, or `local` for a step that concerns no peer.
        peer: String,
        /// Where.
        step: OneSidedStep,
        /// The backend's own error.
        detail: String,
    },
    /// The step did not complete by its deadline. What it posted stays owned by the backend
    /// (its memory registered) until the backend ends it.
    #[error("peer {peer}, {step}: no completion within {waited:?}")]
    Deadline {
        /// The peer.
        peer: String,
        /// Where.
        step: OneSidedStep,
        /// How long the call waited.
        waited: Duration,
    },
}

/// A one-sided backend: one per channel, owned and driven by one thread or task.
// The blocking forms (`connect`, `wait`, `release`, `disconnect`) serve `ucx.rs`'s tests;
// `UcxThread` drives the backend's non-blocking forms of the same steps.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) trait OneSidedEngine {
    /// A batch posted and not yet completed.
    type Posted;

    /// Registers `region` and returns the descriptor bytes a peer imports to reach it. The
    /// backend keeps the region's memory mapped until [`OneSidedEngine::revoke`] and every
    /// operation using it ended; peers may write it at any time until then.
    fn export(&mut self, region: &Region) -> Result<Vec<u8>, OneSidedError>;

    /// This side's address, which a peer passes to [`OneSidedEngine::connect`].
    fn address(&self) -> Vec<u8>;

    /// Reaches `peer` from the bytes of its [`OneSidedEngine::address`].
    fn connect(&mut self, peer: &str, address: &[u8]) -> Result<(), OneSidedError>;

    /// Imports `peer`'s region `id` from the descriptor bytes its [`OneSidedEngine::export`] gave.
    fn import(&mut self, peer: &str, id: RegionId, descriptor: &[u8]) -> Result<(), OneSidedError>;

    /// Checks every range against both regions, then posts the batch (`Write`: local →
    /// peer; `Read`: peer → local). Nothing is posted when a range does not fit.
    fn post(
        &mut self,
        peer: &str,
        dir: Dir,
        ops: &[RangeOp],
    ) -> Result<Self::Posted, OneSidedError>;

    /// Makes progress and tells, without waiting, whether `posted` completed at the peer.
    fn test(&mut self, posted: &mut Self::Posted) -> Result<bool, OneSidedError>;

    /// Waits for `posted` until `deadline`; at the deadline the batch is abandoned to the
    /// backend (see [`OneSidedError::Deadline`]).
    fn wait(&mut self, posted: Self::Posted, deadline: Instant) -> Result<(), OneSidedError>;

    /// Ends this side's use of `peer`'s region `id`: later batches naming it are refused.
    /// Returns once every batch posted with it ended or at `deadline`.
    fn release(&mut self, peer: &str, id: RegionId, deadline: Instant)
        -> Result<(), OneSidedError>;

    /// Unregisters local region `id`: peers can no longer reach it once the backend's
    /// operations on it ended.
    fn revoke(&mut self, id: RegionId) -> Result<(), OneSidedError>;

    /// Leaves `peer`: flushes what was posted to it and drops its imported regions, at most
    /// until `deadline`.
    fn disconnect(&mut self, peer: &str, deadline: Instant) -> Result<(), OneSidedError>;
}
