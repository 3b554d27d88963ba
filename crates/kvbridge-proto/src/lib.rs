//! Sans-IO wire protocol of kvbridge.
//!
//! This crate holds everything two kvbridge peers must agree on — frames, messages and the
//! handshake state machines of both roles — and nothing that touches a socket, a thread or a
//! clock. Time is passed in by the caller; messages are passed in and out as values. That is
//! what makes every ordering of events testable and the seed's race impossible to reintroduce:
//! the [`handshake::ListenerSession`] holds any data-path message that arrives before its data
//! connection is bound, by construction, instead of looking up state that another thread
//! fills "soon".
//!
//! * [`frame`]: length-prefixed frames with a magic, a version and a hard size limit.
//! * [`msg`]: the messages (msgpack bodies with named fields, see `docs/protocol.md`).
//! * [`handshake`]: the initiator and listener state machines.
//! * [`ids`]: peer, region, session and incarnation identifiers, and grant tokens.
//! * [`auth`]: the shared secret and HMAC challenge/response proofs.
//! * [`zmtp`]: ZMTP 3.0 NULL framing and the receiving side of a PULL or SUB/PUB connection.
//! * [`kv_events`]: vLLM's KV-events batches (what an engine stored and evicted), bounded.
//! * [`outcome_tag`]: the HMAC tag that authenticates a KV outcome.
//! * [`ucx_link`]: the UCX negotiation of a session (worker address and remote keys).

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod auth;
pub mod frame;
pub mod handshake;
pub mod ids;
pub mod kv_events;
pub mod msg;
pub mod outcome_tag;
pub mod route;
pub mod same_host;
pub mod ucx_link;
pub mod zmtp;

pub use frame::{FrameError, FrameHeader, FRAME_HEADER_LEN, PROTOCOL_VERSION};
pub use ids::{GrantToken, Incarnation, PeerId, RegionId, SessionToken};
