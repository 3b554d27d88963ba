//! The reference engine of kvbridge and `kvbridge demo`.
//!
//! A deterministic stand-in for an LLM (a mock: no real model runs here) that serves the
//! OpenAI API and moves *real* KV through the PD layer, so that the whole disaggregated path
//! (proxy, prefiller, PD sender, channel, PD receiver, decoder) can run on one machine and be
//! checked byte for byte. See `docs/engine.md`.
//!
//! - [`model`]: tokenizer, KV of every position, next token from the KV held.
//! - [`cost`]: prefill and decode speed.
//! - [`prefix_cache`]: the engine's cache of prompt chunks (LRU), reported as KV events.
//! - [`engine`]: the server (`--role prefill|decode|both`).
//! - [`announce`]: how a decoder learns which PD request holds a prompt's KV.
//! - [`client`]: a small OpenAI client (demo, tests).
//! - [`demo`]: `kvbridge demo`.
//! - [`prompt_format`]: the shared-prefix workload as token ids, text or chats.
//! - [`proxy_metrics`]: counters read from the proxy's `/metrics`.
//! - [`peer_router`]: `kvbridge demo --peer-router CMD` (another router, same workload).
//! - [`soak`]: `kvbridge demo --duration D --chaos` (real processes, real `kill -9`).
//! - [`stable_ports`]: ports a killed worker can be restarted on.
//! - [`cli`]: `kvbridge engine` flags.
//! - [`timeline`]: per-request step marks (`kvbridge demo --timeline`).
//! - [`tp_shape`]: `kvbridge demo --prefill-tp P --decode-tp D [--mla]` (the push between
//!   different TP sizes).

#![warn(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod announce;
pub mod background;
pub mod chunk_memory;
pub mod cli;
pub mod client;
pub mod cost;
pub mod demo;
pub mod engine;
pub mod kv_events_pub;
pub mod model;
pub mod peer_router;
pub mod prefix_cache;
pub mod prompt_format;
pub mod proxy_metrics;
pub mod soak;
pub mod stable_ports;
pub mod timeline;
pub mod tp_shape;
