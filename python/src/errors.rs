//! kvbridge errors as Python exceptions (the classes live in `kvbridge/_errors.py`).

use kvbridge::proto::msg::ErrorCode;
use kvbridge::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyModule;

static ERRORS: GILOnceCell<Py<PyModule>> = GILOnceCell::new();

/// A kvbridge exception of class `class` (a name in `kvbridge._errors`).
pub(crate) fn make(
    py: Python<'_>,
    class: &str,
    message: String,
    peer: Option<&str>,
    step: Option<String>,
    code: Option<String>,
) -> PyErr {
    let module = match ERRORS.get_or_try_init(py, || {
        PyModule::import(py, "kvbridge._errors").map(Bound::unbind)
    }) {
        Ok(m) => m.bind(py),
        Err(e) => return e,
    };
    match module
        .getattr(class)
        .and_then(|cls| cls.call1((message, peer, step, code)))
    {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => PyRuntimeError::new_err(format!("kvbridge: cannot build {class}: {e}")),
    }
}

/// The Python exception for an engine error: its class mirrors the variant, `.peer` and
/// `.step` are set where the variant has them, and the message is the engine's (it names
/// both).
pub(crate) fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let step = |s: &kvbridge::Step| Some(s.to_string());
    let (class, peer, step, code): (&str, Option<&str>, Option<String>, Option<ErrorCode>) = match e
    {
        Error::PeerMisbehaved { peer, step: s, .. } => {
            ("PeerMisbehaved", Some(peer), step(s), None)
        }
        Error::Incompatible { peer, step: s, .. } => ("Incompatible", Some(peer), step(s), None),
        Error::Unauthenticated { peer, step: s, .. } => {
            ("Unauthenticated", Some(peer), step(s), None)
        }
        Error::Rejected {
            peer,
            step: s,
            code,
            ..
        } => {
            // A refusal whose code has its own class is raised as that class (a listener
            // refusing an incompatible initiator is `Incompatible` on both sides).
            let class = match code {
                ErrorCode::LimitExceeded => "LimitExceeded",
                ErrorCode::Incompatible | ErrorCode::UnsupportedVersion => "Incompatible",
                _ => "Rejected",
            };
            (class, Some(peer), step(s), Some(*code))
        }
        Error::PeerClosed { peer, code, .. } => ("PeerClosed", Some(peer), None, Some(*code)),
        Error::Timeout { peer, step: s, .. } => ("Timeout", Some(peer), step(s), None),
        Error::ConnectionLost { peer, step: s, .. } => {
            ("ConnectionLost", Some(peer), step(s), None)
        }
        Error::PeerRestarted { peer, .. } => ("PeerRestarted", Some(peer), None, None),
        Error::UnmapTimeout { peer, step: s, .. } => ("UnmapTimeout", Some(peer), step(s), None),
        Error::SessionReplaced { peer } => ("SessionReplaced", Some(peer), None, None),
        Error::UnknownPeer { peer } => ("UnknownPeer", Some(peer), None, None),
        Error::InvalidOp { peer, .. } => ("InvalidOp", Some(peer), None, None),
        Error::Closed => ("Closed", None, None, None),
        Error::Disconnected { peer, .. } => ("Disconnected", Some(peer), None, None),
        Error::Local(_) => ("LocalError", None, None, None),
        // A kind of failure newer than this binding: the base class, with the engine's
        // message.
        _ => ("KvbridgeError", None, None, None),
    };
    make(
        py,
        class,
        e.to_string(),
        peer,
        step,
        code.map(|c| c.to_string()),
    )
}

/// `InvalidOp` raised by the binding's own checks, before anything reaches the engine.
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    make(py, "InvalidOp", message.into(), None, None, None)
}

/// `Closed`: the channel was closed.
pub(crate) fn closed(py: Python<'_>) -> PyErr {
    make(py, "Closed", "channel closed".into(), None, None, None)
}

/// `LocalError`: a local resource failed.
pub(crate) fn local(py: Python<'_>, message: impl Into<String>) -> PyErr {
    make(py, "LocalError", message.into(), None, None, None)
}
