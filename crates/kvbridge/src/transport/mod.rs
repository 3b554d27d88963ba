//! How bytes reach the peer. `one_sided.rs` is the seam every one-sided backend sits behind
//! (post a batch, complete it), as the data path drives it; the backends are listed below,
//! one file each: `same_host.rs` (shared memory and cross-memory attach, made of `shm.rs`,
//! `cma.rs` and `split_copy.rs`) and `ucx_route.rs` (UCX, feature `ucx`, made of
//! `ucx_thread.rs` and `ucx.rs`, the engine behind `one_sided_engine.rs`). `tcp/` is the
//! two-sided path over the session's data connections; it completes batches through the
//! data path's table of waiting batches (`datapath/pending.rs`) and never calls back into
//! the data path itself.

pub(crate) mod cma;
// Without UCX no backend completes a batch elsewhere: `Posted::Pending`, `FailedMayLand`,
// the batch's deadline and the backend's name serve `ucx_route.rs` (and `loopback.rs`).
#[cfg_attr(not(feature = "ucx"), allow(dead_code))]
pub(crate) mod one_sided;
// Only the UCX backend drives an engine of its own so far.
#[cfg(feature = "ucx")]
pub(crate) mod one_sided_engine;
pub(crate) mod piece;
// Only the UCX route merges ranges so far.
#[cfg(feature = "ucx")]
pub(crate) mod range_merge;
pub(crate) mod shm;
pub(crate) mod split_copy;
pub(crate) mod tcp;

// The one-sided backends, one line each.
#[cfg(test)]
pub(crate) mod loopback;
pub(crate) mod same_host;
#[cfg(feature = "ucx")]
pub(crate) mod ucx;
#[cfg(feature = "ucx")]
pub(crate) mod ucx_route;
#[cfg(feature = "ucx")]
pub(crate) mod ucx_thread;
