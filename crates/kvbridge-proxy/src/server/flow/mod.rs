//! One request's way through the workers: its body checked and parsed, a decoder admitted,
//! the decider's choice between the decoder alone and the PD way, then the configured flow
//! (`vllm`: KV pulled by the decoder; `lmcache`: KV pushed by the prefiller, its outcome
//! awaited here; `sglang`: both sent the same body at once, paired by a bootstrap room).

mod lmcache;
mod sglang;
mod vllm;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::extract::rejection::BytesRejection;
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use bytes::Bytes;

use super::app::{App, TL};
use super::ctx::Ctx;
use crate::config::Flow;
use crate::metrics::Outcome;
use crate::pool::Role;
use crate::reply::{pick_error, ApiError, Reply, Track};
use crate::request::{Api, ReqDoc};
use crate::rewrite::vllm_decode_body;
use crate::routing::decider::{Decision, Facts, PrefillerView};

impl App {
    /// Runs the request of `api` with `body` to its reply.
    pub(crate) async fn flow(
        self: &Arc<Self>,
        api: Api,
        headers: &HeaderMap,
        body: Result<Bytes, BytesRejection>,
        rid: &HeaderValue,
        track: &Track,
    ) -> Result<Reply, ApiError> {
        let body = body.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                self.metrics.body_too_large.fetch_add(1, Relaxed);
                return ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request_too_large",
                    Outcome::BadRequest,
                    format!(
                        "the request body is larger than this proxy's limit of {} bytes (--max-body-bytes)",
                        self.cfg.max_body_bytes
                    ),
                );
            }
            if crate::listener::body_timed_out(&r) {
                return ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    Outcome::BadRequest,
                    format!(
                        "the request body did not arrive within {:?} (--body-timeout)",
                        self.cfg.http_limits.body_timeout
                    ),
                );
            }
            ApiError::new(
                r.status(),
                "invalid_body",
                Outcome::BadRequest,
                r.body_text(),
            )
        })?;
        let doc = ReqDoc::parse(api, &body).map_err(ApiError::bad_request)?;
        let tokens = (body.len() as u64 / 4).max(1);
        let mut prompt = (self.cfg.routing != crate::routing::RoutingPolicy::LeastLoaded
            || self.decider.active())
        .then(|| crate::routing::prompt_key::PromptKey::from_raw(doc.prompt_raw()));
        let auth = headers.get(AUTHORIZATION);
        if let Some(p) = prompt.as_mut() {
            self.tokenize_prompt(api, &doc, auth, rid, p).await;
        }
        // The decoder is admitted first: its KV buffer is the scarce resource.
        let mut dslot = self
            .decode
            .pick_for(
                tokens,
                self.cfg.max_queue,
                self.cfg.queue_timeout,
                &self.metrics.admission_queue,
                prompt.as_ref(),
            )
            .await
            .map_err(|e| pick_error(Role::Decode, e))?;
        let ctx = Ctx {
            api,
            rid,
            auth,
            tokens,
            stream: doc.stream,
            prompt,
        };
        let prompt_tokens = ctx.prompt.as_ref().map_or(
            tokens,
            crate::routing::prompt_key::PromptKey::estimated_tokens,
        );
        // Where the PD path would prefill, for a decider that weighs the queues.
        let prefiller = if self.decider.compares_queues() {
            self.prefill
                .peek_for(tokens, ctx.prompt.as_ref())
                .map(|p| PrefillerView {
                    cached: p.cached_tokens,
                    load: p.load,
                })
        } else {
            None
        };
        let facts = Facts {
            prompt: prompt_tokens,
            decoder_cached: dslot.cached_tokens(),
            decoder_load: dslot.load_of_others(),
            prefiller,
        };
        let decision = self.decider.decide(&facts);
        tracing::debug!(target: "kvbridge::route", id = track.rid(), decoder = dslot.index(),
            prompt = facts.prompt, decoder_cached = facts.decoder_cached,
            decoder_load = facts.decoder_load,
            prefiller = ?facts.prefiller.map(|p| (p.cached, p.load)),
            decision = decision.as_str(), "decided");
        if decision == Decision::DecodeOnly {
            // The decoder prefills the prompt itself: the request goes to it as it came.
            tracing::debug!(target: TL, stage = "proxy.decode_only", id = track.rid());
            let dbody = Bytes::from(vllm_decode_body(&doc, None));
            return self.decode(&ctx, dbody, dslot, true).await;
        }
        dslot.kv_from_prefiller();
        match self.cfg.flow {
            Flow::Vllm => self.vllm(&ctx, &doc, dslot).await,
            Flow::Lmcache => self.lmcache(&ctx, &doc, dslot).await,
            Flow::Sglang => self.sglang(&ctx, &doc, dslot).await,
        }
    }
}
