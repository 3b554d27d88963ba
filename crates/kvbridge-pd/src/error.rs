//! Errors of the PD layer. Each names the request, the peer where one is involved, and the
//! step that failed.

use std::fmt;
use std::time::Duration;
use thiserror::Error;

/// Steps of a transfer, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PdStep {
    /// Connecting to the receiver.
    Connect,
    /// Asking the receiver for pages.
    Alloc,
    /// Writing a chunk.
    Write,
    /// Telling the receiver every chunk landed.
    Finish,
    /// Cancelling.
    Cancel,
    /// Waiting for or copying out a request's KV on the receiver.
    Retrieve,
    /// Pull mode: reading the sender's pages.
    Pull,
}

impl fmt::Display for PdStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PdStep::Connect => "connect",
            PdStep::Alloc => "alloc",
            PdStep::Write => "write",
            PdStep::Finish => "finish",
            PdStep::Cancel => "cancel",
            PdStep::Retrieve => "retrieve",
            PdStep::Pull => "pull",
        })
    }
}

/// Result alias.
pub type Result<T, E = PdError> = std::result::Result<T, E>;

/// Everything that can go wrong in the PD layer.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PdError {
    /// The request needs more pages than the receiver's whole buffer.
    #[error("request {req_id} (peer {peer}): needs {needed_pages} pages ({needed_bytes} bytes) but the receiver's whole buffer has {total_pages} pages ({total_bytes} bytes); it can never fit")]
    NeverFits {
        /// The request.
        req_id: String,
        /// The receiver.
        peer: String,
        /// Pages needed.
        needed_pages: u64,
        /// Pages in the buffer.
        total_pages: u64,
        /// Bytes needed.
        needed_bytes: u64,
        /// Bytes in the buffer.
        total_bytes: u64,
    },
    /// The receiver refused (timeout waiting for pages, duplicate id, incompatible spec, ...).
    #[error("request {req_id}: peer {peer} refused step {step}: {reason}")]
    Refused {
        /// The request.
        req_id: String,
        /// The peer.
        peer: String,
        /// The step.
        step: PdStep,
        /// The peer's reason.
        reason: String,
    },
    /// The transfer layer failed.
    #[error("request {req_id}: step {step} with peer {peer} failed: {source}")]
    Transfer {
        /// The request.
        req_id: String,
        /// The peer (or its address before the session exists).
        peer: String,
        /// The step.
        step: PdStep,
        /// The transfer layer's error.
        source: Box<kvbridge::Error>,
    },
    /// A step passed its deadline.
    #[error("request {req_id}: step {step} with peer {peer} passed its deadline of {after:?}")]
    Timeout {
        /// The request.
        req_id: String,
        /// The peer.
        peer: String,
        /// The step.
        step: PdStep,
        /// The deadline.
        after: Duration,
    },
    /// The request was cancelled (by the receiver, the sender, or dropped unfinished).
    #[error("request {req_id}: cancelled at step {step}: {reason}")]
    Cancelled {
        /// The request.
        req_id: String,
        /// The step.
        step: PdStep,
        /// Why.
        reason: String,
    },
    /// A caller mistake (bad chunk index or size, unknown request, ...).
    #[error("request {req_id}: step {step}: {detail}")]
    Invalid {
        /// The request.
        req_id: String,
        /// The step.
        step: PdStep,
        /// What is wrong.
        detail: String,
    },
    /// A peer sent something we cannot use.
    #[error("peer {peer} broke the PD protocol: {detail}")]
    Protocol {
        /// The peer.
        peer: String,
        /// What.
        detail: String,
    },
    /// Configuration or local setup failed.
    #[error("{0}")]
    Config(String),
}
