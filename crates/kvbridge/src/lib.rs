//! kvbridge: moves KV cache between the prefill and decode workers of a disaggregated LLM
//! deployment.
//!
//! This crate is the engine: it drives the sans-IO state machines of [`kvbridge_proto`] over
//! real (or simulated) sockets, owns registered memory [`Region`]s, and offers the
//! [`Channel`] API — lazy, idempotent `connect`, one-sided batched `write` and `read`,
//! ordered `notify`, and `close` — with a deadline on every wait and a typed [`Error`] naming
//! the peer and the step on every failure.
//!
//! ```no_run
//! # async fn demo() -> kvbridge::Result<()> {
//! use kvbridge::{Channel, ChannelConfig, Grant, Op, Region};
//! let decoder = Channel::new(ChannelConfig::new("decode-0", Some("127.0.0.1:0"))).await?;
//! let kv = Region::alloc(64 << 20, 16 << 10)?;
//! decoder.register(&kv, Grant::AllPeers)?;
//!
//! let prefiller = Channel::new(ChannelConfig::new("prefill-0", None)).await?;
//! let staging = Region::alloc(16 << 10, 16 << 10)?;
//! prefiller.register(&staging, Grant::AllPeers)?;
//! let peer = prefiller.connect(&decoder.local_addr().unwrap().to_string()).await?;
//! prefiller.write(&peer, &[Op::page(&staging, 0, kv.id(), 7, 16 << 10)]).await?;
//! prefiller.notify(&peer, b"request 42 ready").await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]
// Every unsafe block says what makes it sound; registered memory is never lent as a reference
// (`peer_memory`).
#![deny(clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn)]

mod accept;
mod channel;
mod cmd;
pub mod config;
mod core;
mod data_threads;
mod datapath;
pub mod digest;
mod dir;
mod error;
mod events;
mod fast_lane;
#[doc(hidden)]
pub mod fuzzing;
mod grant;
mod handshake_slots;
mod in_flight;
mod landing;
pub mod net;
mod notify_queues;
pub mod peer_memory;
mod pidfd;
mod random;
mod refusals;
mod region;
mod session;
mod stream_copy;
mod test_hooks;
pub mod thread_pool;
mod tls;
mod transport;
mod wire;
mod writer_queue;

pub use channel::{Channel, Op, PeerLink, QueuedNotify};
pub use config::{ChannelConfig, Deadlines, Limits, Pem, TlsConfig, Transport};
pub use error::{Error, Result};
pub use events::{Notification, PeerEvent, Stats};
pub use grant::{new_grant_token, Access, ClosedGrant, Grant, Permission, WindowDrain, WindowId};
pub use kvbridge_proto as proto;
pub use kvbridge_proto::handshake::Step;
pub use kvbridge_proto::{GrantToken, Incarnation, PeerId, RegionId};
pub use region::{shared_huge_pages, Region};
/// Tests' injected delays: public only with the `test-hooks` feature (see its docs).
#[cfg(feature = "test-hooks")]
pub use test_hooks::TestHooks;
pub use transport::cma::{cma_available, CmaStatus};
pub use transport::shm::host_id;
