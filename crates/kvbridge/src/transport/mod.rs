//! How bytes reach the peer. `tcp/` is the two-sided path over the session's data
//! connections; it completes batches through the data path's table of waiting batches
//! (`datapath/pending.rs`) and never calls back into the data path itself. `one_sided.rs` is
//! the seam of the one-sided backends (export and import a region, post a batch, complete it
//! asynchronously, revoke); `ucx.rs` implements it over UCX (feature `ucx`).

// Only UCX implements the seam yet, and the engine does not drive it yet.
#[allow(dead_code)]
pub(crate) mod one_sided;
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
