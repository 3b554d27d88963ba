//! The prefill step: the request to the prefiller the routing policy picks, the next one
//! when a prefiller refuses the connection.

use std::time::Instant;

use axum::http::StatusCode;
use bytes::Bytes;

use super::app::App;
use super::ctx::Ctx;
use super::upstream::{error_code, error_message, upstream_status, CallError};
use crate::kvwait::Binding;
use crate::metrics::Outcome;
use crate::pool::Role;
use crate::reply::{pick_error, ApiError};

/// The error code with which a prefiller says it could not reach the decoder named in the
/// request's `disagg_spec` at all (connection refused, reset or timed out): no KV moved.
pub(crate) const KV_RECEIVER_UNREACHABLE: &str = "kv_receiver_unreachable";

impl App {
    /// Sends the prefill to the healthy prefiller the routing policy chooses; a refused connection ejects
    /// that prefiller and tries the next. Returns the prefiller's whole answer. `bind`: the
    /// KV wait learns which prefiller it depends on before the prefill is sent.
    pub(crate) async fn prefill(
        &self,
        ctx: &Ctx<'_>,
        body: Bytes,
        bind: Option<Binding>,
    ) -> Result<Bytes, ApiError> {
        let mut tried = Vec::new();
        loop {
            let slot = self
                .prefill
                .try_pick_for(ctx.tokens, &tried, ctx.prompt.as_ref())
                .map_err(|e| pick_error(Role::Prefill, e))?;
            let w = slot.worker();
            if let Some(b) = &bind {
                b.bind(slot.index(), slot.ejections_at_pick());
            }
            let t = Instant::now();
            let uri = self.uri(Role::Prefill, slot.index(), ctx.api);
            let r =
                tokio::time::timeout(self.cfg.prefill_timeout, self.call(uri, ctx, body.clone()))
                    .await;
            match r {
                Err(_) => {
                    return Err(ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "prefill_timeout",
                        Outcome::PrefillError,
                        format!(
                            "prefiller {} did not answer within {:?}",
                            w.label, self.cfg.prefill_timeout
                        ),
                    ))
                }
                Ok(Err(CallError::Connect(e))) => {
                    if let Some(b) = &bind {
                        b.unbind();
                    }
                    if self.prefill.report(slot.index(), false, true) {
                        self.prefiller_ejected(slot.index());
                    }
                    tracing::warn!(request_id = ctx.rid(), worker = %w.label, "prefiller unreachable: {e}");
                    tried.push(slot.index());
                }
                Ok(Err(CallError::Other(e))) => {
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        "prefill_failed",
                        Outcome::PrefillError,
                        format!("prefiller {}: {e}", w.label),
                    ))
                }
                Ok(Ok((status, ct, b))) => {
                    self.metrics.prefill.observe(t.elapsed());
                    if status.is_success() {
                        return Ok(b);
                    }
                    if status == StatusCode::SERVICE_UNAVAILABLE
                        && error_code(&b).as_deref() == Some(KV_RECEIVER_UNREACHABLE)
                    {
                        return Err(ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            KV_RECEIVER_UNREACHABLE,
                            Outcome::PrefillError,
                            format!("prefiller {}: {}", w.label, error_message(&b)),
                        ));
                    }
                    return Err(upstream_status(status, ct, b, &w.label, Role::Prefill));
                }
            }
        }
    }
}
