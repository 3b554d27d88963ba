//! The answer to a generation request: tokens generated from the prompt's state at the cost
//! model's decode speed, as one JSON body or as server-sent events.

use super::config::Role;
use super::request::{Api, GenRequest};
use super::state::Inner;
use crate::model::{self, SeqState};
use crate::timeline::TARGET as TL;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Generates the answer: the first token comes with the prefill, each later one costs the
/// decode time per token.
pub(super) async fn respond(s: Arc<Inner>, req: GenRequest, state: SeqState) -> Response {
    let id = match req.api {
        Api::Completions => format!("cmpl-sim-{}", s.seq.fetch_add(1, Relaxed)),
        Api::Chat => format!("chatcmpl-sim-{}", s.seq.fetch_add(1, Relaxed)),
    };
    let created = unix_now();
    let name = s.model.name.clone();
    let prompt_len = req.tokens.len();
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let n = req.max_tokens;
    let gen = tokio::spawn({
        let s = s.clone();
        async move {
            let mut st = state;
            let start = tokio::time::Instant::now();
            for i in 0..n {
                if i > 0 {
                    tokio::time::sleep_until(start + s.cfg.cost.decode_per_token * i).await;
                }
                let tok = s.model.next_token(&st);
                s.counts.generated_tokens.fetch_add(1, Relaxed);
                if i == 0 {
                    let stage = match s.cfg.role {
                        Role::Prefill => "prefill.first_token",
                        Role::Decode => "decode.first_token",
                        Role::Both => "local.first_token",
                    };
                    tracing::debug!(target: TL, stage);
                }
                if tx.send(model::token_text(tok)).await.is_err() {
                    return; // the client went away
                }
                if i + 1 < n {
                    let m = s.model.clone();
                    st = match tokio::task::spawn_blocking(move || {
                        m.extend(&mut st, tok);
                        st
                    })
                    .await
                    {
                        Ok(st) => st,
                        Err(_) => return,
                    };
                }
            }
        }
    });
    if !req.stream {
        let mut text = String::new();
        let mut count = 0u32;
        while let Some(t) = rx.recv().await {
            text.push_str(&t);
            count += 1;
        }
        let _ = gen.await;
        let usage = json!({"prompt_tokens": prompt_len, "completion_tokens": count,
            "total_tokens": prompt_len + count as usize});
        let body = match req.api {
            Api::Completions => json!({"id": id, "object": "text_completion", "created": created,
                "model": name, "choices": [{"index": 0, "text": text, "logprobs": null,
                "finish_reason": "length"}], "usage": usage}),
            Api::Chat => json!({"id": id, "object": "chat.completion", "created": created,
                "model": name, "choices": [{"index": 0, "message": {"role": "assistant",
                "content": text}, "logprobs": null, "finish_reason": "length"}], "usage": usage}),
        };
        return axum::Json(body).into_response();
    }
    let api = req.api;
    let (btx, brx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let event = |v: Value| Ok(Bytes::from(format!("data: {v}\n\n")));
        if api == Api::Chat {
            let v = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                "model": name, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null}]});
            if btx.send(event(v)).await.is_err() {
                return;
            }
        }
        let mut sent = 0u32;
        while let Some(t) = rx.recv().await {
            sent += 1;
            let finish = if sent == n {
                json!("length")
            } else {
                Value::Null
            };
            let v = match api {
                Api::Completions => {
                    json!({"id": id, "object": "text_completion", "created": created,
                    "model": name, "choices": [{"index": 0, "text": t, "logprobs": null,
                    "finish_reason": finish}]})
                }
                Api::Chat => {
                    json!({"id": id, "object": "chat.completion.chunk", "created": created,
                    "model": name, "choices": [{"index": 0, "delta": {"content": t},
                    "logprobs": null, "finish_reason": finish}]})
                }
            };
            if btx.send(event(v)).await.is_err() {
                return;
            }
        }
        let _ = btx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let stream = futures_util::stream::unfold(brx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}
