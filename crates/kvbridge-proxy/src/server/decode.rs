//! The decode step: the request to the admitted decoder, its answer read whole or passed on
//! as a stream, and another decoder when one refuses the connection.

use std::time::Instant;

use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderValue, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Limited};

use super::app::App;
use super::ctx::Ctx;
use super::upstream::{source_chain, upstream_status, CallError, MAX_UPSTREAM_BODY};
use crate::metrics::Outcome;
use crate::pool::{Role, Slot};
use crate::reply::{ApiError, Reply};

/// How one attempt on a decoder failed.
enum DecodeFail {
    /// The decoder refused the connection; its slot comes back for a retry elsewhere.
    Refused(Slot, String),
    /// Any other failure: the answer to give.
    Api(ApiError),
}

impl App {
    /// Sends the decode request to the admitted decoder and returns its answer or stream.
    /// With `retry`, a decoder that refuses the connection is ejected and the request goes to
    /// the least loaded other healthy decoder that admits it, each at most once, all within
    /// one `--decode-timeout` from the first attempt.
    pub(crate) async fn decode(
        &self,
        ctx: &Ctx<'_>,
        body: Bytes,
        mut slot: Slot,
        retry: bool,
    ) -> Result<Reply, ApiError> {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + self.cfg.decode_timeout;
        let mut tried = Vec::new();
        loop {
            let failed = match self
                .decode_once(ctx, body.clone(), slot, start, deadline)
                .await
            {
                Ok(r) => return Ok(r),
                Err(DecodeFail::Api(e)) => return Err(e),
                Err(DecodeFail::Refused(s, e)) => {
                    tracing::warn!(request_id = ctx.rid(), worker = %s.worker().label, "decoder unreachable: {e}");
                    let err = self.decoder_down(s.index(), &s.worker().label, e);
                    tried.push(s.index());
                    drop(s);
                    err
                }
            };
            if !retry || tokio::time::Instant::now() >= deadline {
                return Err(failed);
            }
            slot = match self.decode.try_pick(ctx.tokens, &tried) {
                Ok(s) => s,
                Err(_) => return Err(failed),
            };
        }
    }

    /// One attempt of [`App::decode`] on `slot`'s decoder.
    async fn decode_once(
        &self,
        ctx: &Ctx<'_>,
        body: Bytes,
        slot: Slot,
        start: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Reply, DecodeFail> {
        let timeout = self.cfg.decode_timeout;
        let label = &slot.worker().label;
        let timed_out = || {
            DecodeFail::Api(ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "decode_timeout",
                Outcome::DecodeError,
                format!("decoder {label} did not answer within {timeout:?}"),
            ))
        };
        let failed = |e: String| {
            DecodeFail::Api(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "decode_failed",
                Outcome::DecodeError,
                format!("decoder {label}: {e}"),
            ))
        };
        let uri = self.uri(Role::Decode, slot.index(), ctx.api);
        if !ctx.stream {
            return match tokio::time::timeout_at(deadline, self.call(uri, ctx, body)).await {
                Err(_) => Err(timed_out()),
                Ok(Err(CallError::Connect(e))) => Err(DecodeFail::Refused(slot, e)),
                Ok(Err(CallError::Other(e))) => Err(failed(e)),
                Ok(Ok((status, ct, b))) => {
                    self.metrics.decode.observe(start.elapsed());
                    if status.is_success() {
                        Ok(Reply::Full {
                            content_type: ct
                                .unwrap_or(HeaderValue::from_static("application/json")),
                            body: b,
                        })
                    } else {
                        Err(DecodeFail::Api(upstream_status(
                            status,
                            ct,
                            b,
                            label,
                            Role::Decode,
                        )))
                    }
                }
            };
        }
        let req = self.request(uri, ctx, body);
        let awaiting = self.awaiting_backend();
        let resp = match tokio::time::timeout_at(deadline, self.client.request(req)).await {
            Err(_) => return Err(timed_out()),
            Ok(Err(e)) if e.is_connect() => {
                let e = format!("{e}: {}", source_chain(&e));
                return Err(DecodeFail::Refused(slot, e));
            }
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Ok(Ok(r)) => r,
        };
        drop(awaiting);
        let (parts, body) = resp.into_parts();
        let ct = parts.headers.get(CONTENT_TYPE).cloned();
        if !parts.status.is_success() {
            let b = match tokio::time::timeout_at(
                deadline,
                Limited::new(body, MAX_UPSTREAM_BODY).collect(),
            )
            .await
            {
                Ok(Ok(c)) => c.to_bytes(),
                _ => Bytes::new(),
            };
            return Err(DecodeFail::Api(upstream_status(
                parts.status,
                ct,
                b,
                label,
                Role::Decode,
            )));
        }
        Ok(Reply::Stream {
            content_type: ct.unwrap_or(HeaderValue::from_static("text/event-stream")),
            body,
            prefix: None,
            slot,
            decode_start: start,
            merge: None,
        })
    }

    /// Ejects decoder `index` at once (passively) and returns the error to give if no other
    /// decoder takes the request.
    pub(crate) fn decoder_down(&self, index: usize, label: &str, e: String) -> ApiError {
        self.decode.report(index, false, true);
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "decoder_unavailable",
            Outcome::NoWorker,
            format!("decoder {label} is unreachable: {e}"),
        )
    }
}
