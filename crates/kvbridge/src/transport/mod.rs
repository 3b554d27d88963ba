//! How bytes reach the peer. `tcp/` is the two-sided path over the session's data
//! connections; it completes batches through the data path's table of waiting batches
//! (`datapath/pending.rs`) and never calls back into the data path itself. `one_sided.rs` is
//! the seam of the one-sided backends (export and import a region, post a batch, complete it
//! asynchronously, revoke). `shm_one_sided.rs` (shared memory: a peer's memfd mapped here),
//! `cma_one_sided.rs` (cross-memory attach: a peer's memory by address) and `ucx.rs` (UCX,
//! feature `ucx`) implement it; `shm.rs` and `cma.rs` are what the first two are made of,
//! and what the sessions' direct copies use (`datapath/direct.rs`).

pub(crate) mod cma;
// The engine's direct copies use the tables these two are made of, not the backends
// themselves: the seam's single owner would serialise copies that callers' threads now
// run side by side (`datapath/direct.rs`).
#[allow(dead_code)]
pub(crate) mod cma_one_sided;
// The engine does not drive the seam's methods yet (UCX runs behind its own thread).
#[allow(dead_code)]
pub(crate) mod one_sided;
pub(crate) mod piece;
// Only the UCX route merges ranges so far.
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
pub(crate) mod range_merge;
pub(crate) mod shm;
#[allow(dead_code)]
pub(crate) mod shm_one_sided;
pub(crate) mod split_copy;
pub(crate) mod tcp;
// Parts of the seam (wait, test, wakeups) serve the backend's own tests only.
#[cfg(feature = "ucx")]
#[allow(dead_code)]
pub(crate) mod ucx;
#[cfg(feature = "ucx")]
pub(crate) mod ucx_route;
#[cfg(feature = "ucx")]
#[allow(dead_code)]
pub(crate) mod ucx_thread;
