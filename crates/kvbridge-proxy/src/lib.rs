//! OpenAI-compatible disaggregation proxy: routes each request to a prefiller and a decoder,
//! moves it across (LMCache or vLLM NIXL flow), and answers errors instead of hanging.
//!
//! Start it with [`cli::run`] (`kvbridge proxy`) or, in-process, with [`server::start`].

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod body;
mod busy_poll;
pub mod cli;
pub mod config;
pub mod decoder_loads;
mod from_args;
#[doc(hidden)]
pub mod fuzzing;
pub mod kv_events_sub;
pub mod kvwait;
mod listener;
mod logprob_merge;
pub mod metrics;
pub mod notif;
pub mod outcome_port;
pub mod pool;
mod reply;
mod request;
mod rewrite;
mod router_form;
pub mod routing;
pub mod server;
mod sglang_body;
pub mod tokenize;
