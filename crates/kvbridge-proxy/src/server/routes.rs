//! The HTTP routes: the APIs a request flows through (SGLang's `/generate` too under `--flow
//! sglang`), `/v1/models` passed on to a worker,
//! `/health` and `/metrics`; and the flow's [`Reply`] becoming the response.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::json;

use super::app::{App, TL};
use super::upstream::MAX_UPSTREAM_BODY;
use crate::body::{Finish, ProxyBody};
use crate::metrics::Outcome;
use crate::pool::{PickError, Role};
use crate::reply::{pick_error, ApiError, Reply, Track, X_REQUEST_ID};
use crate::request::Api;

/// The proxy's routes over `app`.
pub(crate) fn router(app: Arc<App>) -> Router {
    let max_body = app.cfg.max_body_bytes;
    let mut r = Router::new();
    if app.cfg.flow == crate::config::Flow::Sglang {
        r = r.route("/generate", post(generate));
    }
    r.route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(max_body))
        .with_state(app)
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.serve(Api::Completions, headers, body).await
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.serve(Api::Chat, headers, body).await
}

async fn generate(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.serve(Api::Generate, headers, body).await
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Response {
    let v = json!({"error": {"message": format!("no route for {method} {}", uri.path()), "type": "invalid_request_error", "param": null, "code": "not_found"}});
    (
        StatusCode::NOT_FOUND,
        [(CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let (p, d) = (app.prefill.healthy_count(), app.decode.healthy_count());
    let ok = p > 0 && d > 0;
    let v = json!({"status": if ok {"ok"} else {"unavailable"}, "prefillers_healthy": p, "decoders_healthy": d});
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, [(CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let mut s = String::with_capacity(8192);
    app.metrics.render(&mut s);
    app.prefill.render(&mut s);
    app.decode.render(&mut s);
    app.decoder_loads.render(&mut s);
    let slots: u64 = app.decode.workers.iter().map(|w| w.inflight()).sum();
    let pslots: u64 = app.prefill.workers.iter().map(|w| w.inflight()).sum();
    use std::fmt::Write as _;
    app.decider.render(&mut s);
    app.tokenize_stats.render(&mut s);
    crate::routing::pool_router::render_decisions(
        &mut s,
        &[
            ("prefill", &app.prefill.router),
            ("decode", &app.decode.router),
        ],
    );
    let spun = app.busy_poll.as_ref().map_or(0.0, |b| b.spun_secs());
    let _ = writeln!(
        s,
        "# HELP kvbridge_proxy_busy_poll_seconds_total Time spent polling for backend answers \
         instead of sleeping (--busy-poll-us).\n\
         # TYPE kvbridge_proxy_busy_poll_seconds_total counter\n\
         kvbridge_proxy_busy_poll_seconds_total {spun}"
    );
    let _ = writeln!(
        s,
        "# HELP kvbridge_proxy_admission_slots_taken Decoder admission slots held now.\n\
         # TYPE kvbridge_proxy_admission_slots_taken gauge\nkvbridge_proxy_admission_slots_taken {slots}\n\
         # HELP kvbridge_proxy_prefill_slots_taken Prefill requests in flight now.\n\
         # TYPE kvbridge_proxy_prefill_slots_taken gauge\nkvbridge_proxy_prefill_slots_taken {pslots}"
    );
    ([(CONTENT_TYPE, "text/plain; version=0.0.4")], s).into_response()
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let rid = app.request_id(&headers);
    let Some(w) = app
        .decode
        .workers
        .iter()
        .chain(app.prefill.workers.iter())
        .find(|w| w.is_healthy())
    else {
        return pick_error(Role::Decode, PickError::NoHealthy).into_response(&rid);
    };
    let uri = format!("{}/v1/models", w.base);
    let r = async {
        let req = Request::get(uri)
            .header(X_REQUEST_ID, rid.clone())
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = app.client.request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let b = Limited::new(body, MAX_UPSTREAM_BODY)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((parts.status, parts.headers.get(CONTENT_TYPE).cloned(), b))
    };
    let r = tokio::time::timeout(app.cfg.decode_timeout, r).await;
    if let Ok(Err(e)) = &r {
        tracing::warn!(request_id = ?rid, worker = %w.label, "GET /v1/models: {e}");
    } else if r.is_err() {
        tracing::warn!(request_id = ?rid, worker = %w.label, "GET /v1/models timed out");
    }
    match r {
        Ok(Ok((status, ct, b))) => {
            let mut resp = Response::new(Body::from(b));
            *resp.status_mut() = status;
            if let Some(ct) = ct {
                resp.headers_mut().insert(CONTENT_TYPE, ct);
            }
            resp
        }
        Ok(Err(e)) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_failed",
            Outcome::DecodeError,
            format!("worker {}: {e}", w.label),
        )
        .into_response(&rid),
        Err(_) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_timeout",
            Outcome::DecodeError,
            format!("worker {} timed out", w.label),
        )
        .into_response(&rid),
    }
}

impl App {
    /// Answers one request of `api`: runs its flow and turns the reply or error into the
    /// response, counting it.
    async fn serve(
        self: Arc<Self>,
        api: Api,
        headers: HeaderMap,
        body: Result<Bytes, BytesRejection>,
    ) -> Response {
        let rid = self.request_id(&headers);
        let mut track = Track::new(self.metrics.clone(), rid.clone());
        tracing::debug!(target: TL, stage = "proxy.received", id = track.rid());
        match self.flow(api, &headers, body, &rid, &track).await {
            Ok(Reply::Full { content_type, body }) => {
                self.metrics.ttft.observe(track.t0.elapsed());
                track.outcome = Outcome::Ok;
                tracing::debug!(request_id = track.rid(), "answered");
                let mut r = Response::new(Body::from(body));
                r.headers_mut().insert(CONTENT_TYPE, content_type);
                r.headers_mut().insert(X_REQUEST_ID, rid);
                r
            }
            Ok(Reply::Stream {
                content_type,
                body,
                prefix,
                slot,
                decode_start,
                merge,
            }) => {
                let fin = Finish {
                    track,
                    slot: Some(slot),
                    decode_start,
                };
                let body = ProxyBody::new(body, prefix, self.cfg.decode_timeout, fin, merge);
                let mut r = Response::new(Body::new(body));
                r.headers_mut().insert(CONTENT_TYPE, content_type);
                r.headers_mut()
                    .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                r.headers_mut().insert(X_REQUEST_ID, rid);
                r
            }
            Ok(Reply::Pending { first, decode }) => {
                let body = ProxyBody::pending(first, decode, self.cfg.decode_timeout, track);
                let mut r = Response::new(Body::new(body));
                r.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
                r.headers_mut()
                    .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                r.headers_mut().insert(X_REQUEST_ID, rid);
                r
            }
            Err(e) => {
                track.outcome = e.outcome;
                if e.status.is_server_error() || e.status == StatusCode::TOO_MANY_REQUESTS {
                    tracing::warn!(
                        request_id = track.rid(),
                        status = e.status.as_u16(),
                        code = e.code,
                        "{}",
                        e.message
                    );
                } else {
                    tracing::debug!(
                        request_id = track.rid(),
                        status = e.status.as_u16(),
                        code = e.code,
                        "{}",
                        e.message
                    );
                }
                e.into_response(&rid)
            }
        }
    }
}
