//! The calls to the workers: one POST read whole, and the error a worker's failure answer
//! becomes.

use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::{HeaderValue, Method, Request, StatusCode, Uri};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use serde_json::Value;

use super::app::App;
use super::ctx::Ctx;
use crate::metrics::Outcome;
use crate::pool::Role;
use crate::reply::{ApiError, X_REQUEST_ID};

/// Largest worker response read whole (prefill answers, non-streamed decodes, errors).
pub(crate) const MAX_UPSTREAM_BODY: usize = 64 << 20;

/// Failure of one call to a worker.
pub(crate) enum CallError {
    Connect(String),
    Other(String),
}

impl App {
    /// The POST of `body` to `uri` with the request's id and the client's authorization.
    pub(crate) fn request(&self, uri: Uri, ctx: &Ctx<'_>, body: Bytes) -> Request<Full<Bytes>> {
        let mut r = Request::new(Full::new(body));
        *r.method_mut() = Method::POST;
        *r.uri_mut() = uri;
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(X_REQUEST_ID, ctx.rid.clone());
        if let Some(a) = ctx.auth {
            h.insert(AUTHORIZATION, a.clone());
        }
        r
    }

    /// POSTs `body` and reads the whole answer (the caller bounds it with a deadline).
    pub(crate) async fn call(
        &self,
        uri: Uri,
        ctx: &Ctx<'_>,
        body: Bytes,
    ) -> Result<(StatusCode, Option<HeaderValue>, Bytes), CallError> {
        let req = self.request(uri, ctx, body);
        let _awaiting = self.awaiting_backend();
        let resp = self.client.request(req).await.map_err(|e| {
            if e.is_connect() {
                CallError::Connect(format!("{e}: {}", source_chain(&e)))
            } else {
                CallError::Other(format!("{e}: {}", source_chain(&e)))
            }
        })?;
        let (parts, body) = resp.into_parts();
        let b = Limited::new(body, MAX_UPSTREAM_BODY)
            .collect()
            .await
            .map_err(|e| CallError::Other(format!("reading the answer: {e}")))?
            .to_bytes();
        Ok((parts.status, parts.headers.get(CONTENT_TYPE).cloned(), b))
    }
}

/// The causes of an error, outermost first, joined by `: `.
pub(crate) fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = String::new();
    let mut cur = e.source();
    while let Some(c) = cur {
        if !s.is_empty() {
            s.push_str(": ");
        }
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A worker answered with an error status: 4xx is passed on as it was (the request's
/// fault), anything else becomes a 502 carrying the worker's error.
pub(crate) fn upstream_status(
    status: StatusCode,
    ct: Option<HeaderValue>,
    b: Bytes,
    label: &str,
    role: Role,
) -> ApiError {
    let outcome = if role == Role::Prefill {
        Outcome::PrefillError
    } else {
        Outcome::DecodeError
    };
    if status.is_client_error() {
        let e = ApiError::new(status, "rejected", Outcome::Rejected, excerpt(&b));
        return e.with_raw(b, ct);
    }
    let code = if role == Role::Prefill {
        "prefill_failed"
    } else {
        "decode_failed"
    };
    let detail = error_message(&b);
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        code,
        outcome,
        format!(
            "{} {label} answered {status}: {detail}",
            role.as_str()
                .replace("prefill", "prefiller")
                .replace("decode", "decoder")
        ),
    )
}

/// A worker's error body's message (OpenAI's `error.message`, or a bare `message` or
/// `detail`), else an excerpt of the body.
pub(crate) fn error_message(b: &[u8]) -> String {
    serde_json::from_slice::<Value>(b)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| excerpt(b))
}

/// A worker's error body's `error.code`, if any.
pub(crate) fn error_code(b: &[u8]) -> Option<String> {
    let v = serde_json::from_slice::<Value>(b).ok()?;
    v.pointer("/error/code")?.as_str().map(str::to_string)
}

/// The start of a body, as text.
fn excerpt(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(512)]);
    s.trim().to_string()
}
