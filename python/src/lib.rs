//! `kvbridge._native`: the Python binding of the kvbridge engine (PyO3, abi3).
//!
//! One tokio runtime per process runs every channel's tasks (`runtime`); Python threads
//! submit futures to it and wait with the GIL released (`call`), either blocking (waking
//! every 100 ms to let Python handle signals), as an asyncio future, or as a `Transfer` to
//! poll. The runtime's threads never take the GIL: asyncio futures are completed by one
//! thread of their own (`completer`).

mod buffer;
mod call;
mod channel;
mod completer;
mod digest;
mod errors;
mod features;
mod grants;
mod read_plan;
mod runtime;
mod transfer;

use pyo3::prelude::*;

use features::UCX_BUILT;

/// A fresh grant token (16 random bytes) for ``Channel.open_window(..., token=...)`` and the
/// ``token=`` of transfers. Hand it to the peers that are to use it out of band (e.g. in a
/// request's transfer parameters, as ``token.hex()``), and keep it out of logs: whoever
/// holds it (and can reach the channel) may use it until its windows close.
#[pyfunction]
fn new_grant_token(py: Python<'_>) -> Bound<'_, pyo3::types::PyBytes> {
    pyo3::types::PyBytes::new(py, &kvbridge::new_grant_token().to_bytes())
}

/// The native part of the `kvbridge` package; import `kvbridge` instead.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<channel::PyChannel>()?;
    m.add_class::<channel::PyRegionInfo>()?;
    m.add_class::<transfer::Transfer>()?;
    m.add_class::<read_plan::PyReadPlanner>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    let transports: &[&str] = if UCX_BUILT {
        &["auto", "tcp", "shm", "ucx"]
    } else {
        &["auto", "tcp", "shm"]
    };
    m.add("TRANSPORTS", pyo3::types::PyTuple::new(m.py(), transports)?)?;
    m.add_function(wrap_pyfunction!(call::_at_exit, m)?)?;
    m.add_function(wrap_pyfunction!(new_grant_token, m)?)?;
    m.add_function(wrap_pyfunction!(digest::digest, m)?)?;
    m.add_function(wrap_pyfunction!(digest::digest_ranges, m)?)?;
    m.add("DIGEST_ALGORITHM", kvbridge::digest::ALGORITHM)?;
    Ok(())
}
