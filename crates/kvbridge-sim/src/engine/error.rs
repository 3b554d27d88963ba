//! The engine's errors, and the OpenAI-shaped answer each becomes.

use crate::announce;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvbridge_pd::PdError;
use serde_json::json;

/// Errors of the engine; each becomes an OpenAI-shaped error answer.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The request is malformed (400).
    #[error("{0}")]
    BadRequest(String),
    /// The decoder could not be told about the transfer (500 `kv_announce_failed`; 503
    /// `kv_receiver_unreachable` when it could not be reached at all, which tells a proxy
    /// that no KV moved and the request may go to another decoder).
    #[error(transparent)]
    Announce(#[from] announce::AnnounceError),
    /// The PD layer failed (500).
    #[error(transparent)]
    Kv(#[from] PdError),
    /// Decode: the KV transfer this decode request was handed ended before it completed
    /// (500 `kv_transfer_failed`).
    #[error("{0}")]
    KvEnded(String),
    /// Starting the engine failed.
    #[error("engine start: {0}")]
    Start(String),
    /// A worker task ended abnormally (500).
    #[error("internal: {0}")]
    Internal(String),
}

impl SimError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            SimError::BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
            SimError::Announce(announce::AnnounceError::Unreachable { .. }) => {
                (StatusCode::SERVICE_UNAVAILABLE, "kv_receiver_unreachable")
            }
            SimError::Announce(_) => (StatusCode::INTERNAL_SERVER_ERROR, "kv_announce_failed"),
            SimError::Kv(_) | SimError::KvEnded(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "kv_transfer_failed")
            }
            SimError::Start(_) | SimError::Internal(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "internal")
            }
        }
    }
}

impl IntoResponse for SimError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        let body = json!({"error": {"message": self.to_string(), "type": kind, "code": code}});
        (status, axum::Json(body)).into_response()
    }
}
