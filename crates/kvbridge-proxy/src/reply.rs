//! What the proxy answers a client with, below the routes and the streamed body that both
//! build it: a flow's [`Reply`], the error in OpenAI's shape ([`ApiError`]) with the generic
//! message a client is told of a server-side failure, and the [`Track`] that counts the
//! request until it is answered.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use hyper::body::Incoming;
use serde_json::json;

use crate::logprob_merge::SseMerge;
use crate::metrics::{Metrics, Outcome};
use crate::pool::{PickError, Role, Slot};

/// The header that carries a request's id, to the workers and back to the client.
pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// What a client is told of a server-side failure with error code `code`. The detail (which
/// worker, its address, its error text) names internal parts of the deployment: it goes to
/// the proxy's log under the request id, not to the client.
pub(crate) fn public_message(code: &str) -> &'static str {
    match code {
        "no_healthy_worker" => "no healthy worker can take this request now",
        "decoder_unavailable" => "no decoder could be reached for this request",
        "prefill_failed" => "the prefill failed",
        "prefill_timeout" => "the prefill did not finish in time",
        "kv_transfer_failed" => "the KV cache transfer failed",
        "kv_ready_timeout" => "the KV cache did not arrive in time",
        "prefiller_lost" => "the prefiller holding the KV cache was lost",
        "decode_failed" | "decoder_stream_failed" => "the decode failed",
        "decode_timeout" => "the decoder did not answer in time",
        "upstream_failed" => "a worker failed",
        "upstream_timeout" => "a worker did not answer in time",
        "shutting_down" => "the proxy is shutting down",
        _ => "the request failed inside the proxy",
    }
}

/// A decode request still out: resolves to the decoder's answer (a stream) or its failure.
pub(crate) type PendingDecode = Pin<Box<dyn Future<Output = Result<Reply, ApiError>> + Send>>;

/// Counts one request: in flight while alive, its outcome and duration when dropped.
pub(crate) struct Track {
    pub metrics: Arc<Metrics>,
    pub outcome: Outcome,
    pub t0: Instant,
    pub rid: HeaderValue,
}

impl Track {
    pub(crate) fn new(metrics: Arc<Metrics>, rid: HeaderValue) -> Track {
        metrics.in_flight.fetch_add(1, Relaxed);
        Track {
            metrics,
            outcome: Outcome::Cancelled,
            t0: Instant::now(),
            rid,
        }
    }

    /// The request id as text, for logs.
    pub fn rid(&self) -> &str {
        self.rid.to_str().unwrap_or("?")
    }
}

impl Drop for Track {
    fn drop(&mut self) {
        self.metrics.count_request(self.outcome);
        self.metrics.request.observe(self.t0.elapsed());
        self.metrics.in_flight.fetch_sub(1, Relaxed);
    }
}

/// An answer in OpenAI's error shape.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    kind: &'static str,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) outcome: Outcome,
    /// A worker's 4xx body passed on as it was.
    raw: Option<Box<(Bytes, Option<HeaderValue>)>>,
}

impl ApiError {
    /// A worker's 4xx answer passed on to the client as it was.
    pub(crate) fn with_raw(mut self, body: Bytes, content_type: Option<HeaderValue>) -> Self {
        self.raw = Some(Box::new((body, content_type)));
        self
    }

    /// Message, code and outcome: what an SSE `error` event says of it.
    pub(crate) fn parts(self) -> (String, &'static str, Outcome) {
        (self.message, self.code, self.outcome)
    }

    pub(crate) fn new(
        status: StatusCode,
        code: &'static str,
        outcome: Outcome,
        message: impl Into<String>,
    ) -> Self {
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        ApiError {
            status,
            kind,
            code,
            message: message.into(),
            outcome,
            raw: None,
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            Outcome::BadRequest,
            message,
        )
    }

    /// The prefiller's answer is not the JSON it should be (`why`: the parser's error).
    pub(crate) fn prefill_invalid_json(why: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "prefill_failed",
            Outcome::PrefillError,
            format!("the prefiller answered invalid JSON: {why}"),
        )
    }

    pub(crate) fn into_response(self, rid: &HeaderValue) -> Response {
        let mut resp = match self.raw {
            Some(raw) => {
                let (body, ct) = *raw;
                let mut r = Response::new(Body::from(body));
                if let Some(ct) = ct {
                    r.headers_mut().insert(CONTENT_TYPE, ct);
                }
                r
            }
            None => {
                // A server error's detail names internal parts (worker addresses, their
                // error text): the client gets a generic message, the log the detail.
                let message = if self.status.is_server_error() {
                    public_message(self.code)
                } else {
                    self.message.as_str()
                };
                let v = json!({"error": {"message": message, "type": self.kind, "param": null, "code": self.code}});
                let mut r = Response::new(Body::from(v.to_string()));
                r.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                r
            }
        };
        *resp.status_mut() = self.status;
        resp.headers_mut().insert(X_REQUEST_ID, rid.clone());
        resp
    }
}

/// What a flow produced.
pub(crate) enum Reply {
    /// A whole body, ready to send.
    Full {
        content_type: HeaderValue,
        body: Bytes,
    },
    /// The first token, sent now, and the decode still to answer (its stream follows the
    /// first token; see `first_token_on_kv_ready`).
    Pending { first: Bytes, decode: PendingDecode },
    /// The decoder's stream, with an optional first chunk in front, and its SSE events
    /// merged with the prefill's input logprobs where asked (sglang flow, `/generate`).
    Stream {
        content_type: HeaderValue,
        body: Incoming,
        prefix: Option<Bytes>,
        slot: Slot,
        decode_start: Instant,
        merge: Option<SseMerge>,
    },
}

/// The error of a request no worker of `role` could be picked for.
pub(crate) fn pick_error(role: Role, e: PickError) -> ApiError {
    match e {
        PickError::NoHealthy => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_healthy_worker",
            Outcome::NoWorker,
            format!("no healthy {} worker", role.as_str()),
        ),
        PickError::Full => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "admission_full",
            Outcome::AdmissionFull,
            format!("every {} worker is at its admission limit; retry later", role.as_str()),
        ),
        PickError::TooLarge { tokens, capacity } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "prompt_exceeds_kv_capacity",
            Outcome::BadRequest,
            format!("the prompt (about {tokens} tokens) exceeds the KV capacity of every decoder ({capacity} tokens)"),
        ),
    }
}
