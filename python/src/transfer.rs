//! `Transfer`: a batch submitted without waiting, to poll or wait for later.

use crate::call::{Outcome, SIGNAL_POLL};
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::task::AbortHandle;

/// Where a submitted batch stands; the runtime's task fills it once.
#[derive(Default)]
pub(crate) struct Slot {
    result: Mutex<Option<Result<(), Outcome>>>,
    done: Condvar,
}

impl Slot {
    pub(crate) fn finish(&self, r: Result<(), Outcome>) {
        let mut slot = self.result.lock().unwrap_or_else(|p| p.into_inner());
        // The first outcome stands: a cancel that won the race is not overwritten.
        if slot.is_none() {
            *slot = Some(r);
        }
        drop(slot);
        self.done.notify_all();
    }

    fn get(&self) -> Option<Result<(), Outcome>> {
        self.result
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// A write or read batch submitted with ``Channel.submit_*``: it runs in the background
/// while Python goes on. ``poll()`` never blocks; ``wait()`` blocks (GIL released) and
/// raises the batch's error. Dropping a Transfer does not cancel the batch; ``cancel()``
/// does.
#[pyclass(frozen, module = "kvbridge._native")]
pub(crate) struct Transfer {
    slot: Arc<Slot>,
    abort: AbortHandle,
    what: String,
}

impl Transfer {
    pub(crate) fn new(slot: Arc<Slot>, abort: AbortHandle, what: String) -> Self {
        Self { slot, abort, what }
    }
}

#[pymethods]
impl Transfer {
    /// ``"PROC"`` while the batch is in flight, ``"DONE"`` once every byte landed,
    /// ``"ERR"`` once it failed (see ``.error``). Never blocks.
    fn poll(&self) -> &'static str {
        match self.slot.get() {
            None => "PROC",
            Some(Ok(())) => "DONE",
            Some(Err(_)) => "ERR",
        }
    }

    /// Waits until the batch ends (at most ``timeout`` seconds; ``None`` waits for the
    /// engine's op deadline) and raises its error if it failed. The GIL is released while
    /// waiting; Ctrl-C interrupts the wait (not the batch). Raises the builtin
    /// ``TimeoutError`` when ``timeout`` passes first (the batch goes on).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = match timeout {
            Some(t) if !(t.is_finite() && t >= 0.0) => {
                return Err(crate::errors::invalid(
                    py,
                    format!("timeout {t} is not >= 0"),
                ))
            }
            Some(t) => Some(Instant::now() + Duration::from_secs_f64(t.min(1e9))),
            None => None,
        };
        loop {
            let slot = self.slot.clone();
            let slice = deadline.map_or(SIGNAL_POLL, |d| {
                SIGNAL_POLL.min(d.saturating_duration_since(Instant::now()))
            });
            let r = py.allow_threads(move || {
                let guard = slot.result.lock().unwrap_or_else(|p| p.into_inner());
                let (guard, _) = slot
                    .done
                    .wait_timeout_while(guard, slice, |r| r.is_none())
                    .unwrap_or_else(|p| p.into_inner());
                guard.clone()
            });
            match r {
                Some(Ok(())) => return Ok(()),
                Some(Err(e)) => return Err(e.to_py(py)),
                None => {}
            }
            py.check_signals()?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(PyTimeoutError::new_err(format!(
                    "{} still in flight after {}s",
                    self.what,
                    timeout.unwrap_or_default()
                )));
            }
        }
    }

    /// The batch's error once it failed (a ``kvbridge.KvbridgeError``), else ``None``.
    #[getter]
    fn error(&self, py: Python<'_>) -> Option<PyObject> {
        match self.slot.get() {
            Some(Err(e)) => Some(e.to_py(py).into_value(py).into_any()),
            _ => None,
        }
    }

    /// Whether the batch ended (done or failed).
    #[getter]
    fn done(&self) -> bool {
        self.slot.get().is_some()
    }

    /// Gives up on the batch: the engine drops it (bytes may or may not have landed) and
    /// ``wait()`` raises ``kvbridge.LocalError``. No effect once it ended.
    fn cancel(&self) {
        self.abort.abort();
        self.slot
            .finish(Err(Outcome::Engine(kvbridge::Error::Local(format!(
                "{} cancelled",
                self.what
            )))));
    }

    fn __repr__(&self) -> String {
        format!("<kvbridge.Transfer {} {}>", self.what, self.poll())
    }
}
