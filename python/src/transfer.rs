//! `Transfer`: a batch submitted without waiting, to poll or wait for later.

use crate::call::{Outcome, Settle, SIGNAL_POLL};
use crate::runtime;
use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::task::AbortHandle;

/// Where a submitted batch stands; the runtime's task fills it once.
#[derive(Default)]
pub(crate) struct Slot {
    state: Mutex<State>,
    done: Condvar,
}

#[derive(Default)]
struct State {
    result: Option<Result<(), Outcome>>,
    /// The batch's task let go of its future: it completed, or an abort took effect (and,
    /// for a batch that did not run to its end, what its drop cannot wait for ended: a UCX
    /// session's teardown). A same-host copy runs inside the task's poll
    /// (`block_in_place`), where an abort cannot reach it; it has ended by the time this is
    /// set.
    stopped: bool,
    /// The batch's future ran to its end (its outcome is the engine's).
    ran_to_end: bool,
}

impl Slot {
    pub(crate) fn finish(&self, r: Result<(), Outcome>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // The first outcome stands: a cancel that won the race is not overwritten.
        if state.result.is_none() {
            state.result = Some(r);
        }
        drop(state);
        self.done.notify_all();
    }

    /// The batch's future ended with `r`: [`Slot::finish`], and it ran to its end.
    pub(crate) fn ran(&self, r: Result<(), Outcome>) {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ran_to_end = true;
        self.finish(r);
    }

    fn ran_to_end(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .ran_to_end
    }

    fn stop(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stopped = true;
        self.done.notify_all();
    }

    fn get(&self) -> Option<Result<(), Outcome>> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .result
            .clone()
    }
}

/// Moved into a batch's task: marks its [`Slot`] stopped when the task's future is dropped,
/// whether it ran to the end, was aborted between polls, or never ran; for a batch that did
/// not run to its end, only after its `settle` (a UCX session's teardown) ended.
pub(crate) struct StopGuard {
    slot: Arc<Slot>,
    settle: Option<Settle>,
}

impl StopGuard {
    pub(crate) fn new(slot: Arc<Slot>, settle: Settle) -> Self {
        Self {
            slot,
            settle: Some(settle),
        }
    }
}

impl Drop for StopGuard {
    fn drop(&mut self) {
        let settle = self.settle.take();
        match settle.filter(|_| !self.slot.ran_to_end()) {
            Some(settle) => match runtime::handle() {
                Ok(rt) => {
                    let slot = self.slot.clone();
                    rt.spawn(async move {
                        settle().await;
                        slot.stop();
                    });
                }
                Err(_) => self.slot.stop(),
            },
            None => self.slot.stop(),
        }
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
                let guard = slot.state.lock().unwrap_or_else(|p| p.into_inner());
                let (guard, _) = slot
                    .done
                    .wait_timeout_while(guard, slice, |s| s.result.is_none())
                    .unwrap_or_else(|p| p.into_inner());
                guard.result.clone()
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
    /// ``wait()`` raises ``kvbridge.LocalError``; no effect on the outcome once it ended.
    /// Returns once the engine let go of the batch, within ``timeout`` seconds: ``True``
    /// when it did. Then no byte of a read lands in its destinations any more (a copy into
    /// them under way when it was cancelled has ended; the peer's late answer over TCP is
    /// read past and dropped, counted in ``stats()["late_answers_discarded"]``), and a
    /// write's sources are not read any more (bytes of it already sent may still land at
    /// the peer). The session goes on. Over UCX, whose posted operations cannot be called
    /// back, the cancel ends the session instead (``kvbridge.Disconnected`` for what else
    /// was in flight on it) and returns once that session's teardown ended: by then no
    /// posted operation of it reads or writes memory any more. ``False``: ``timeout``
    /// passed first (a copy of it, or the teardown, still runs).
    #[pyo3(signature = (timeout=5.0))]
    fn cancel(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        if !(timeout.is_finite() && timeout >= 0.0) {
            return Err(crate::errors::invalid(
                py,
                format!("timeout {timeout} is not >= 0"),
            ));
        }
        self.abort.abort();
        self.slot
            .finish(Err(Outcome::Engine(kvbridge::Error::Local(format!(
                "{} cancelled",
                self.what
            )))));
        let slot = self.slot.clone();
        let limit = Duration::from_secs_f64(timeout.min(1e9));
        Ok(py.allow_threads(move || {
            let guard = slot.state.lock().unwrap_or_else(|p| p.into_inner());
            let (guard, _) = slot
                .done
                .wait_timeout_while(guard, limit, |s| !s.stopped)
                .unwrap_or_else(|p| p.into_inner());
            guard.stopped
        }))
    }

    fn __repr__(&self) -> String {
        format!("<kvbridge.Transfer {} {}>", self.what, self.poll())
    }
}
