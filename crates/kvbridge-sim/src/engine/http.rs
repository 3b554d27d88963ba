//! The engine's HTTP routes: OpenAI generation (the prompt's state got as the engine's
//! role says), models, health, Prometheus metrics, tokenize and the prefix cache's reset.

use super::claim::find_kv;
use super::config::Role;
use super::error::SimError;
use super::prefill::prefill;
use super::receive::receive;
use super::request::{chat_tokens, parse, parse_json, prompt_tokens, Api, GenRequest};
use super::respond::respond;
use super::send::prefill_and_send;
use super::state::Inner;
use crate::model::SeqState;
use crate::prefix_cache::PrefixCache;
use crate::timeline::TARGET as TL;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// The routes, each served with the engine's state.
pub(super) fn router(s: Arc<Inner>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .with_state(s)
}

async fn completions(State(s): State<Arc<Inner>>, body: Bytes) -> Response {
    serve_gen(s, Api::Completions, body).await
}

async fn chat(State(s): State<Arc<Inner>>, body: Bytes) -> Response {
    serve_gen(s, Api::Chat, body).await
}

async fn serve_gen(s: Arc<Inner>, api: Api, body: Bytes) -> Response {
    s.counts.requests.fetch_add(1, Relaxed);
    let stage = match s.cfg.role {
        Role::Prefill => "prefill.received",
        Role::Decode => "decode.received",
        Role::Both => "local.received",
    };
    tracing::debug!(target: TL, stage);
    let r = async {
        let m = parse_json(&body)?;
        let req = parse(api, &m, s.cfg.max_tokens_limit)?;
        s.counts
            .prompt_tokens
            .fetch_add(req.tokens.len() as u64, Relaxed);
        let state = prompt_state(&s, &req).await?;
        Ok::<_, SimError>(respond(s.clone(), req, state).await)
    }
    .await;
    match r {
        Ok(resp) => resp,
        Err(e) => {
            s.counts.errors.fetch_add(1, Relaxed);
            tracing::warn!(role = ?s.cfg.role, "request failed: {e}");
            e.into_response()
        }
    }
}

/// The state after the prompt: prefilled here (and sent), or received.
async fn prompt_state(s: &Arc<Inner>, req: &GenRequest) -> Result<SeqState, SimError> {
    match (s.cfg.role, &req.disagg) {
        (Role::Prefill, Some(ds)) => prefill_and_send(s, &req.tokens, ds).await,
        (Role::Decode, _) => match find_kv(s, req)? {
            Some((claim, m)) => receive(s, &req.tokens, claim, m).await,
            None => {
                s.counts.local_prefills.fetch_add(1, Relaxed);
                prefill(s, &req.tokens, None).await
            }
        },
        _ => prefill(s, &req.tokens, None).await,
    }
}

async fn models(State(s): State<Arc<Inner>>) -> Response {
    axum::Json(
        json!({"object": "list", "data": [{"id": s.model.name, "object": "model",
        "created": 0, "owned_by": "kvbridge-sim"}]}),
    )
    .into_response()
}

async fn health(State(s): State<Arc<Inner>>) -> Response {
    let stats = s.stats();
    axum::Json(json!({"status": "ok", "stats": stats})).into_response()
}

async fn metrics(State(s): State<Arc<Inner>>) -> Response {
    let v = serde_json::to_value(s.stats()).unwrap_or(Value::Null);
    let mut out = String::new();
    if let Value::Object(m) = v {
        for (k, v) in m {
            if let Some(x) = v.as_f64() {
                out.push_str(&format!("kvbridge_sim_{k} {x}\n"));
            }
        }
    }
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    (h, out).into_response()
}

async fn reset_prefix_cache(State(s): State<Arc<Inner>>) -> Response {
    s.update_cache(PrefixCache::clear);
    StatusCode::OK.into_response()
}

async fn tokenize(State(s): State<Arc<Inner>>, body: Bytes) -> Response {
    let r = (|| {
        let m = parse_json(&body)?;
        let tokens = if m.contains_key("messages") {
            chat_tokens(
                m.get("messages"),
                m.get("continue_final_message")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            )?
        } else {
            prompt_tokens(m.get("prompt"))?
        };
        Ok::<_, SimError>(tokens)
    })();
    match r {
        Ok(tokens) => axum::Json(json!({"count": tokens.len(), "tokens": tokens,
            "max_model_len": s.cfg.buffer_bytes / s.model.spec.bytes_per_token().max(1)}))
        .into_response(),
        Err(e) => e.into_response(),
    }
}
