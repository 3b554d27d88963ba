//! The crate's error: which step failed, toward which peer, and why, grouped by cause.

use std::fmt;
use std::time::Duration;

use thiserror::Error;

use crate::wire::WireError;

/// The step of the UCX life cycle an error comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// Reading or modifying the UCX configuration (`ucp_config_read`/`modify`).
    Config,
    /// Creating the UCX context (`ucp_init`).
    Init,
    /// Creating a worker (`ucp_worker_create`).
    WorkerCreate,
    /// Reading the worker's address (`ucp_worker_get_address`).
    WorkerAddress,
    /// Reading the worker's event fd (`ucp_worker_get_efd`).
    EventFd,
    /// Arming the worker's event fd (`ucp_worker_arm`) or waiting on it.
    Wait,
    /// Creating an endpoint from a peer's worker address (`ucp_ep_create`).
    EpCreate,
    /// Closing an endpoint (`ucp_ep_close_nbx`).
    EpClose,
    /// Allocating the memory of a region.
    Alloc,
    /// Registering memory with UCX (`ucp_mem_map`).
    MemMap,
    /// Packing a region's remote key (`ucp_rkey_pack`).
    RkeyPack,
    /// Unpacking a peer's remote key (`ucp_ep_rkey_unpack`).
    RkeyUnpack,
    /// A one-sided write (`ucp_put_nbx`).
    Put,
    /// A one-sided read (`ucp_get_nbx`).
    Get,
    /// Waiting until every operation issued on an endpoint completed remotely
    /// (`ucp_ep_flush_nbx`).
    Flush,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::Config => "config",
            Step::Init => "init",
            Step::WorkerCreate => "worker_create",
            Step::WorkerAddress => "worker_address",
            Step::EventFd => "event_fd",
            Step::Wait => "wait",
            Step::EpCreate => "ep_create",
            Step::EpClose => "ep_close",
            Step::Alloc => "alloc",
            Step::MemMap => "mem_map",
            Step::RkeyPack => "rkey_pack",
            Step::RkeyUnpack => "rkey_unpack",
            Step::Put => "put",
            Step::Get => "get",
            Step::Flush => "flush",
        })
    }
}

/// A UCX status code with its text (`ucs_status_string`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The `ucs_status_t` value (negative: an error).
    pub code: i32,
    /// UCX's description of it.
    pub text: String,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.text, self.code)
    }
}

/// Everything that can fail in this crate.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// UCX refused a local step (context, worker, memory registration, key packing).
    #[error("{step}: UCX: {status}")]
    Ucx {
        /// The step.
        step: Step,
        /// UCX's status.
        status: Status,
    },
    /// An operation toward a peer failed in UCX: the peer is unreachable, reset, killed, or
    /// refused the access.
    #[error("{step} to peer {peer}: UCX: {status}")]
    Peer {
        /// The peer's name, as given to `Worker::connect`.
        peer: String,
        /// The step.
        step: Step,
        /// UCX's status.
        status: Status,
    },
    /// An operation toward a peer did not complete by its deadline. The operation stays
    /// owned by the worker until UCX ends it; the memory it touches stays registered until
    /// then.
    #[error("{step} to peer {peer}: no completion within {waited:?}")]
    Deadline {
        /// The peer's name.
        peer: String,
        /// The step.
        step: Step,
        /// How long the call waited.
        waited: Duration,
    },
    /// Bytes a peer sent for UCX (worker address, region descriptor) are malformed; UCX never
    /// saw them.
    #[error("{step} to peer {peer}: malformed bytes: {reason}")]
    Malformed {
        /// The peer's name.
        peer: String,
        /// The step.
        step: Step,
        /// What the envelope check found.
        reason: WireError,
    },
    /// The caller asked for bytes outside a region.
    #[error("{step}: bytes {offset}..+{len} lie outside the {what} of {size} bytes")]
    OutOfRange {
        /// The step.
        step: Step,
        /// Which region: `local region` or `remote region`.
        what: &'static str,
        /// Offset asked for.
        offset: u64,
        /// Length asked for.
        len: u64,
        /// The region's length.
        size: u64,
    },
    /// A handle (endpoint, remote key, operation) that this worker does not hold (closed,
    /// already waited for, or from another worker).
    #[error("{step}: {what} {id} is not open on this worker")]
    NotOpen {
        /// The step.
        step: Step,
        /// `endpoint`, `remote key` or `operation`.
        what: &'static str,
        /// The handle's number.
        id: u64,
    },
    /// A system call failed (allocation, `poll`).
    #[error("{step}: {source}")]
    Os {
        /// The step.
        step: Step,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// This crate's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;
