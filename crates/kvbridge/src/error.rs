//! Errors, grouped by cause: the peer misbehaved, the peer is incompatible or refused, the
//! network or a deadline failed, or the caller misused the API. Every variant that concerns a
//! peer names it and the step that failed.

use kvbridge_proto::handshake::{HandshakeError, Step};
use kvbridge_proto::msg::ErrorCode;
use kvbridge_proto::Incarnation;
use std::time::Duration;
use thiserror::Error;

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in kvbridge's transfer layer.
///
/// New kinds of failure may be added: match with a wildcard arm.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    // ---- the peer misbehaved ----
    /// The peer broke the protocol (bad frame, unexpected message, op outside a region).
    #[error("peer {peer} misbehaved at step {step}: {detail}")]
    PeerMisbehaved {
        /// The peer (id, or address before its id is known).
        peer: String,
        /// Where.
        step: Step,
        /// What.
        detail: String,
    },

    // ---- the peer is incompatible or refused ----
    /// The peers cannot work together; names both sides' values.
    #[error("peer {peer} is incompatible at step {step}: ours {ours}, theirs {theirs}")]
    Incompatible {
        /// The peer.
        peer: String,
        /// Where.
        step: Step,
        /// Our value.
        ours: String,
        /// Their value.
        theirs: String,
    },
    /// Authentication failed: the peer could not prove it knows the shared secret, or one
    /// side requires authentication and the other does not do it.
    #[error("peer {peer}: authentication failed at step {step}: {detail}")]
    Unauthenticated {
        /// The peer.
        peer: String,
        /// Where.
        step: Step,
        /// What.
        detail: String,
    },
    /// The peer answered with a typed refusal.
    #[error("peer {peer} rejected step {step}: {code}: {message}")]
    Rejected {
        /// The peer.
        peer: String,
        /// Where.
        step: Step,
        /// The peer's code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
    /// The peer closed the session.
    #[error("peer {peer} closed the session: {code}: {message}")]
    PeerClosed {
        /// The peer.
        peer: String,
        /// The peer's code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },

    // ---- network and deadlines ----
    /// A step passed its deadline.
    #[error("peer {peer}: step {step} passed its deadline of {after:?}")]
    Timeout {
        /// The peer.
        peer: String,
        /// The step.
        step: Step,
        /// The deadline.
        after: Duration,
    },
    /// The connection broke.
    #[error("peer {peer}: connection lost at step {step}: {detail}")]
    ConnectionLost {
        /// The peer.
        peer: String,
        /// Where.
        step: Step,
        /// The I/O error.
        detail: String,
    },
    /// The peer restarted (same id, new incarnation); work on the old session failed.
    #[error("peer {peer} restarted (incarnation {old} -> {new}); work on the old session failed")]
    PeerRestarted {
        /// The peer.
        peer: String,
        /// The incarnation of the session that failed.
        old: Incarnation,
        /// The new incarnation.
        new: Incarnation,
    },
    /// The peer mapped one of our regions over shared memory and did not confirm unmapping
    /// it in time, while the region had to leave shared memory (it was deregistered, or
    /// another peer's mapping of it could not be revoked). The session was ended so that
    /// the region could be detached without a write of this peer landing in memory that is
    /// cut loose; the peer may reconnect (it then reaches the region over TCP).
    #[error("peer {peer}: step {step}: did not confirm unmapping region {region} within {after:?}; the session was ended so that the region could be detached from shared memory")]
    UnmapTimeout {
        /// The peer.
        peer: String,
        /// Where.
        step: Step,
        /// The region.
        region: kvbridge_proto::RegionId,
        /// How long the peer had to confirm.
        after: Duration,
    },
    /// (Listener) A handshake under way gave its slot to a `Hello` from a source address
    /// that held fewer of the listener's slots: all `max_concurrent_handshakes` were taken,
    /// and this was the oldest handshake of the source that held most (docs/protocol.md,
    /// *Handshake slots*). The peer is told with `Reject{LimitExceeded}`.
    #[error("peer {peer} (from {from}): handshake slot given up at step {step} to a Hello from {by}, a source holding fewer of the listener's handshake slots")]
    HandshakeSlotTaken {
        /// The peer, as its `Hello` named itself.
        peer: String,
        /// Its control connection's source address.
        from: String,
        /// Where its handshake was.
        step: Step,
        /// The source address of the `Hello` that took the slot.
        by: String,
    },
    /// A newer session of the same peer and incarnation replaced this one.
    #[error("peer {peer}: session replaced by a newer one")]
    SessionReplaced {
        /// The peer.
        peer: String,
    },

    // ---- local misuse ----
    /// No session with that peer.
    #[error("no session with peer {peer}: call connect first")]
    UnknownPeer {
        /// The peer.
        peer: String,
    },
    /// An op that can never succeed (unknown region, out of bounds, too large).
    #[error("invalid op for peer {peer}: {detail}")]
    InvalidOp {
        /// The peer.
        peer: String,
        /// What is wrong.
        detail: String,
    },
    /// The channel was closed locally.
    #[error("channel closed")]
    Closed,
    /// The session was ended locally: by `Channel::disconnect`, or by a cancelled batch
    /// that only the session's end could stop (a batch posted on UCX; `reason` says which).
    #[error("session with peer {peer} ended locally: {reason}")]
    Disconnected {
        /// The peer.
        peer: String,
        /// The reason given.
        reason: String,
    },
    /// Configuration or local resource problem (bind failed, allocation failed).
    #[error("{0}")]
    Local(String),
}

impl Error {
    /// Turns a state machine failure into an error naming the peer.
    pub(crate) fn from_handshake(peer: &str, step: Step, e: HandshakeError) -> Self {
        let peer = peer.to_string();
        match e {
            HandshakeError::Rejected {
                step,
                code,
                message,
            } => match code {
                ErrorCode::Unauthenticated => Error::Unauthenticated {
                    peer,
                    step,
                    detail: message,
                },
                ErrorCode::PeerRestarted | ErrorCode::SessionReplaced => Error::PeerClosed {
                    peer,
                    code,
                    message,
                },
                _ => Error::Rejected {
                    peer,
                    step,
                    code,
                    message,
                },
            },
            HandshakeError::VersionMismatch { ours, theirs } => Error::Incompatible {
                peer,
                step,
                ours: format!("protocol version {ours}"),
                theirs: format!("protocol version {theirs}"),
            },
            HandshakeError::Incompatible { ours, theirs } => Error::Incompatible {
                peer,
                step,
                ours: ours.to_string(),
                theirs: theirs.to_string(),
            },
            HandshakeError::Unexpected { step, got } => Error::PeerMisbehaved {
                peer,
                step,
                detail: format!("unexpected {got}"),
            },
            HandshakeError::Malformed { step, detail } => {
                Error::PeerMisbehaved { peer, step, detail }
            }
            HandshakeError::Timeout { step, after } => Error::Timeout { peer, step, after },
            HandshakeError::Unauthenticated { step, detail } => {
                Error::Unauthenticated { peer, step, detail }
            }
            HandshakeError::Closed { code, message } => Error::PeerClosed {
                peer,
                code,
                message,
            },
        }
    }

    /// The wire code that tells a peer about this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::PeerMisbehaved { .. } => ErrorCode::Malformed,
            Error::Incompatible { .. } => ErrorCode::Incompatible,
            Error::Unauthenticated { .. } => ErrorCode::Unauthenticated,
            Error::Rejected { code, .. } | Error::PeerClosed { code, .. } => *code,
            Error::Timeout { .. } | Error::UnmapTimeout { .. } => ErrorCode::Timeout,
            Error::ConnectionLost { .. } => ErrorCode::Internal,
            Error::PeerRestarted { .. } => ErrorCode::PeerRestarted,
            Error::SessionReplaced { .. } => ErrorCode::SessionReplaced,
            Error::UnknownPeer { .. } | Error::InvalidOp { .. } => ErrorCode::UnknownRegion,
            Error::HandshakeSlotTaken { .. } => ErrorCode::LimitExceeded,
            Error::Closed | Error::Disconnected { .. } => ErrorCode::ShuttingDown,
            Error::Local(_) => ErrorCode::Internal,
        }
    }

    pub(crate) fn lost(peer: &str, step: Step, e: impl std::fmt::Display) -> Self {
        Error::ConnectionLost {
            peer: peer.to_string(),
            step,
            detail: e.to_string(),
        }
    }
}
