//! A request's prompt tokens from a worker's `/tokenize` (`--kv-events-tokenize http`):
//! which worker is asked, and what the request's routing key becomes with the answer or
//! without it ([`crate::tokenize`] is the client).

use std::sync::atomic::Ordering::Relaxed;

use axum::http::HeaderValue;

use super::app::{App, TL};
use crate::request::{Api, ReqDoc};
use crate::routing::prompt_key::PromptKey;
use crate::tokenize::{self, TokenizeError, TokenizeMode};

impl App {
    /// Whether this proxy asks `/tokenize` for prompts without token ids: `http` mode, and a
    /// pool that routes by KV events (a pool without endpoints routes least-loaded).
    pub(crate) fn tokenizes(&self) -> bool {
        self.cfg.kv_events.tokenize == TokenizeMode::Http
            && (self.prefill.router.index.is_some() || self.decode.router.index.is_some())
    }

    /// Fills `prompt.tokens` with the token ids a worker computes for the request's text
    /// prompt or chat messages, when [`App::tokenizes`] and the request gave none; on any
    /// failure leaves them unknown (the request ranks by load alone), counted by reason.
    pub(crate) async fn tokenize_prompt(
        &self,
        api: Api,
        doc: &ReqDoc<'_>,
        auth: Option<&HeaderValue>,
        rid: &HeaderValue,
        prompt: &mut PromptKey,
    ) {
        if prompt.tokens.is_some() || !self.tokenizes() {
            return;
        }
        let stats = &self.tokenize_stats;
        let t0 = std::time::Instant::now();
        let (r, first) = tokenize::counted(stats, async {
            let body = tokenize::request_body(api, doc).ok_or(TokenizeError::Unsupported)?;
            let (worker, uri) = self.tokenize_worker().ok_or(TokenizeError::NoWorker)?;
            let k = &self.cfg.kv_events;
            tokenize::call(
                &self.client,
                &worker,
                uri,
                auth,
                Some(rid),
                body,
                k.tokenize_deadline(),
                k.tokenize_max_reply_bytes,
            )
            .await
        })
        .await;
        let id = rid.to_str().unwrap_or("?");
        match r {
            Ok(tokens) => {
                let took_us = t0.elapsed().as_micros() as u64;
                tracing::debug!(target: TL, stage = "proxy.tokenized", id, tokens = tokens.len(), took_us);
                prompt.tokens = Some(tokens);
            }
            // The first failure of each reason is worth an operator's eye (a worker without
            // `/tokenize`, a deadline too short); the rest are counted.
            Err(e) if first => {
                tracing::warn!(request_id = id, "routed by load alone (first such failure; the rest are counted in kvbridge_proxy_tokenize_total): {e}");
            }
            Err(e) => {
                tracing::debug!(request_id = id, "routed by load alone: {e}");
            }
        }
    }

    /// The next worker to ask: every healthy decoder and prefiller in turn (every worker
    /// serves the same model).
    fn tokenize_worker(&self) -> Option<(String, axum::http::Uri)> {
        let all: Vec<_> = self
            .decode
            .workers
            .iter()
            .chain(self.prefill.workers.iter())
            .filter(|w| w.is_healthy())
            .collect();
        if all.is_empty() {
            return None;
        }
        let w = all[self.tokenize_turn.fetch_add(1, Relaxed) as usize % all.len()];
        let uri = format!("{}/tokenize", w.base).parse().ok()?;
        Some((w.label.clone(), uri))
    }
}
