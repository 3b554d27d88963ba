//! The PD layer of kvbridge: moves a request's KV cache from a prefiller rank to a decoder
//! rank over a [`kvbridge::Channel`], and tells the proxy the outcome.
//!
//! - [`layout`]: KV layouts (standard and MLA), dtypes, chunk sizes — every byte count.
//! - [`key`]: chunk keys with a hash chain over the token ids (equal prefixes, equal keys).
//! - [`alloc`]: the receiver's paged buffer as a sans-IO allocator (whole-request
//!   reservation, immediate refusal of what can never fit, deadlines, quarantine of pages a
//!   write may still land in, TTL, counters).
//! - [`receiver`] / [`sender`]: the two ends, push or pull mode ([`TransferMode`]); the
//!   receiver lends landed chunks in place ([`PdReceiver::borrow_chunk`]).
//! - [`outcome`]: `KvReady` / `KvFailed` / `ProxyNotif` as msgpack over ZMQ PUSH.
//! - [`config`]: TOML + environment + CLI settings, LMCache names accepted.
//! - [`tp_layout`] / [`rank_map`] / [`read_plan`]: translation between different TP sizes,
//!   block sizes and block orders — the layout both sides exchange, which prefiller ranks
//!   each decoder rank reads, and the fewest ranged reads that move exactly its heads.
//! - [`push_plan`]: the push between different TP sizes — every prefiller rank writes each
//!   decoder rank that needs its heads exactly those heads, one write per chunk and part.
//! - [`mod@bench`]: `kvbridge bench pd` (PD layer against a raw channel, same run).
//!
//! ```no_run
//! # async fn demo() -> kvbridge_pd::Result<()> {
//! use kvbridge::ChannelConfig;
//! use kvbridge_pd::{DisaggSpec, KvSpec, PdReceiver, PdSender, ReceiverConfig, SenderConfig};
//! let spec = KvSpec::llama_8b();
//! let rx = PdReceiver::start(ReceiverConfig::new(
//!     ChannelConfig::new("decode-0", Some("127.0.0.1:0")), 0, spec, 1 << 30)).await?;
//! let tx = PdSender::start(SenderConfig::new(
//!     ChannelConfig::new("prefill-0", None), 0, 1, "llama-8b", spec)).await?;
//! let ds = DisaggSpec {
//!     req_id: "r1".into(),
//!     receiver_host: "127.0.0.1".into(),
//!     receiver_init_port: vec![rx.local_addr().unwrap().port()],
//!     receiver_alloc_port: vec![],
//! };
//! let tokens: Vec<u32> = (0..300).collect();
//! let mut t = tx.begin(&ds, &tokens).await?;
//! for i in 0..t.chunks() {
//!     let kv = vec![0u8; t.chunk_bytes(i) as usize]; // from the engine, as prefill goes
//!     t.send_chunk(i, &kv).await?;
//! }
//! t.finish().await?; // KvReady goes to the proxy
//! let kv = rx.retrieve("r1", std::time::Duration::from_secs(5)).await?;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod alloc;
pub mod bench;
pub mod config;
mod error;
pub mod key;
pub mod layout;
pub mod msg;
pub mod outcome;
pub mod push_plan;
pub mod rank_map;
pub mod read_plan;
pub mod receiver;
pub mod sender;
mod timeline;
pub mod tp_layout;
mod windows;
mod zmtp_push;

pub use alloc::Counters;
pub use config::{PdConfig, PdConfigArgs, Role, TransferMode};
pub use error::{PdError, PdStep, Result};
pub use key::{chunk_keys, with_key_scheme, ChunkKey, KEY_SCHEME};
pub use layout::{Dtype, KvLayout, KvSpec, DEFAULT_CHUNK_TOKENS};
pub use outcome::{Outcome, OutcomeSink, ZmqPusher};
pub use push_plan::{PushError, PushPart, PushPlan};
pub use rank_map::{head_sources, readers_of, source_ranks, HeadSource};
pub use read_plan::{PlanError, RangeRead, ReadPlan, ReadPlanner, Side};
pub use receiver::{ChunkRef, GrantedRequest, PdReceiver, ReceiverConfig};
pub use sender::{DisaggSpec, PdSender, SenderConfig, Summary, Transfer};
pub use timeline::TIMELINE;
pub use tp_layout::{BlockDim, LayoutError, LayoutProblem, Mismatch, TpLayout, Translation};
