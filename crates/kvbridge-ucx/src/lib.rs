//! One-sided transfers over UCX, for kvbridge's transports: the shape of NIXL's one-sided
//! backend (`backend_engine.h`) in safe Rust.
//!
//! - [`Context`]: the UCX library instance (RMA and event-fd wake-up), with the transports
//!   it may use ([`ContextConfig`]: `UCX_TLS`, `UCX_NET_DEVICES`).
//! - [`Worker`]: one per channel, driven by one owner. It waits on its event fd
//!   (`ucp_worker_get_efd` + `ucp_worker_arm`) when nothing is ready, so an idle worker costs
//!   no CPU; the fd can be registered with an event loop instead.
//! - [`MemRegion`]: memory registered with `ucp_mem_map`; its [`MemRegion::descriptor`]
//!   (base, length, packed remote key) is what a peer needs to reach it.
//! - Endpoints ([`Worker::connect`] from a peer's [`Worker::address`]) and remote keys
//!   ([`Worker::unpack_rkey`] of a peer's descriptor) are handles owned by the worker.
//! - [`Worker::post_put`] / [`Worker::post_get`] (`ucp_put_nbx`/`ucp_get_nbx` with completion
//!   callbacks), [`Worker::wait`], [`Worker::flush`] (`ucp_ep_flush_nbx`): every wait has a
//!   deadline, and every failure is an [`Error`] naming the peer, the step and UCX's status.
//! - A region is unmapped only after the last operation using it ended, also when its
//!   caller stopped waiting at a deadline.
//!
//! Peers' worker addresses and descriptors travel in a checked envelope ([`wire`]): UCX does
//! not bound-check them, so truncated or corrupted bytes are refused before UCX sees them.
//!
//! UCX authenticates no peer, and over transports that emulate remote memory access (UCX
//! 1.13's tcp and shared memory) a worker's process copies to and from whatever address a
//! peer names: whoever reaches a worker reaches its whole memory. [`reach`] says who can,
//! for a given `UCX_TLS`.
//!
//! Everything but [`wire`] and [`reach`] needs the `ucx` feature (and `libucx-dev` at build time).
//!
//! ```no_run
//! # #[cfg(feature = "ucx")]
//! # fn demo() -> kvbridge_ucx::Result<()> {
//! use std::time::{Duration, Instant};
//! use kvbridge_ucx::{Context, ContextConfig, MemRegion, Worker};
//! let ctx = Context::new(&ContextConfig::with_tls("tcp"))?;
//! let mut worker = Worker::new(&ctx)?;
//! let staging = MemRegion::alloc(&ctx, 1 << 20)?;
//! # let (peer_address, peer_region): (Vec<u8>, Vec<u8>) = (vec![], vec![]);
//! // `peer_address` and `peer_region` came from the peer's `address()` and `descriptor()`.
//! let ep = worker.connect("decode-0", &peer_address)?;
//! let rkey = worker.unpack_rkey(ep, &peer_region)?;
//! let deadline = Instant::now() + Duration::from_secs(5);
//! worker.put(rkey, 0, &staging, 0, 1 << 20, deadline)?;
//! worker.flush(ep, deadline)?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]
// The overview above names the API of the `ucx` feature; without it only `wire` exists.
#![cfg_attr(not(feature = "ucx"), allow(rustdoc::broken_intra_doc_links))]
// Every unsafe block says what makes it sound; registered memory is never lent as a reference.
#![deny(clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn)]

pub mod reach;
pub mod wire;

mod busy;
#[cfg(feature = "ucx")]
pub use busy::wait_readable;
pub use busy::{armed_wait, ArmedWait, BusyBackoff, BUSY_FIRST_SLEEP, BUSY_MAX_SLEEP, BUSY_SPINS};

#[cfg(feature = "ucx")]
mod context;
#[cfg(feature = "ucx")]
mod error;
#[cfg(feature = "ucx")]
mod region;
#[cfg(feature = "ucx")]
mod status;
#[cfg(feature = "ucx")]
mod worker;

#[cfg(feature = "ucx")]
pub use context::{Context, ContextConfig};
#[cfg(feature = "ucx")]
pub use error::{Error, Result, Status, Step};
#[cfg(feature = "ucx")]
pub use region::MemRegion;
#[cfg(feature = "ucx")]
pub use worker::{EpId, OpId, Prefer, RkeyId, Worker};
