//! Running engine futures on the runtime for Python callers: blocking (GIL released, woken
//! every [`SIGNAL_POLL`] to let Python run its signal handlers), or as an asyncio future.

use crate::completer;
use crate::errors;
use crate::runtime;
use pyo3::prelude::*;
use pyo3::types::PyCFunction;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::AbortHandle;

/// How often a blocked caller wakes to check for signals (Ctrl-C).
pub(crate) const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// What an engine future yields: its value, or the engine's error.
pub(crate) type EngineResult<T> = Result<T, Outcome>;

/// Why a future failed: an engine error, or a check of the binding made inside it (one
/// that needs the engine's answer first, such as a remote page's range).
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    Engine(kvbridge::Error),
    Invalid { peer: String, message: String },
}

impl From<kvbridge::Error> for Outcome {
    fn from(e: kvbridge::Error) -> Self {
        Outcome::Engine(e)
    }
}

impl Outcome {
    pub(crate) fn to_py(&self, py: Python<'_>) -> PyErr {
        match self {
            Outcome::Engine(e) => errors::to_py(py, e),
            Outcome::Invalid { peer, message } => errors::make(
                py,
                "InvalidOp",
                format!("invalid op for peer {peer}: {message}"),
                Some(peer),
                None,
                None,
            ),
        }
    }
}

fn runtime(py: Python<'_>) -> PyResult<tokio::runtime::Handle> {
    runtime::handle()
        .map_err(|e| errors::local(py, format!("cannot start kvbridge's runtime: {e}")))
}

/// Runs `fut` on the runtime and waits for it with the GIL released. A signal handler that
/// raises (KeyboardInterrupt) cancels the future, which drops it on the runtime: the engine
/// gives up on the batch (its bytes may or may not have landed), and the channel stays
/// usable.
pub(crate) fn block_on<T, F>(py: Python<'_>, fut: F) -> PyResult<T>
where
    T: Send + 'static,
    F: Future<Output = EngineResult<T>> + Send + 'static,
{
    block_on_with(py, fut, drop)
}

/// [`block_on`], handing a value the future produced to `undelivered` when the caller was
/// interrupted before it could return it (a received notification goes back to its queue).
pub(crate) fn block_on_with<T, F>(
    py: Python<'_>,
    fut: F,
    undelivered: impl FnOnce(T),
) -> PyResult<T>
where
    T: Send + 'static,
    F: Future<Output = EngineResult<T>> + Send + 'static,
{
    if EXITING.load(Ordering::SeqCst) {
        return Err(exiting(py));
    }
    let _waiting = Waiting::enter();
    let (tx, rx) = mpsc::sync_channel(1);
    let task = runtime(py)?.spawn(async move {
        let _ = tx.send(fut.await);
    });
    let mut rx = rx;
    loop {
        let (got, back) = py.allow_threads(move || (rx.recv_timeout(SIGNAL_POLL), rx));
        rx = back;
        match got {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => return Err(e.to_py(py)),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if EXITING.load(Ordering::SeqCst) {
                    task.abort();
                    return Err(exiting(py));
                }
                if let Err(e) = py.check_signals() {
                    task.abort();
                    // The task stops at its next await, or finishes the step it is in: wait
                    // for either, so that a value it took is not lost.
                    let late = py.allow_threads(move || rx.recv_timeout(ABORT_GRACE));
                    if let Ok(Ok(v)) = late {
                        undelivered(v);
                    }
                    return Err(e);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(errors::local(py, "kvbridge task ended without an answer"))
            }
        }
    }
}

/// Set once the interpreter runs its exit hooks: blocking calls then end with `Closed`.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Callers inside [`block_on_with`], on any thread.
static WAITING: AtomicUsize = AtomicUsize::new(0);

/// Counts a caller in [`WAITING`] while it waits.
struct Waiting;

impl Waiting {
    fn enter() -> Waiting {
        WAITING.fetch_add(1, Ordering::SeqCst);
        Waiting
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::SeqCst);
    }
}

fn exiting(py: Python<'_>) -> PyErr {
    errors::make(
        py,
        "Closed",
        "kvbridge: the interpreter is exiting".to_string(),
        None,
        None,
        None,
    )
}

/// The interpreter's exit hook (registered with `atexit` by `kvbridge/__init__.py`): ends
/// every blocking call, and waits up to `timeout` seconds, with the GIL released, until no
/// thread is inside one.
///
/// Why: a daemon thread still blocked in a call when the interpreter finalizes is ended by
/// the interpreter as it takes the GIL back at its next signal check; that forced unwind
/// through Rust frames aborts the whole process ("FATAL: exception not rethrown"). Ended
/// here, the call returns `Closed` to Python first, and the thread leaves Rust for good.
#[pyfunction]
#[pyo3(signature = (timeout=2.0))]
pub(crate) fn _at_exit(py: Python<'_>, timeout: f64) {
    EXITING.store(true, Ordering::SeqCst);
    completer::stop();
    let until = Instant::now() + Duration::from_secs_f64(timeout.clamp(0.0, 60.0));
    py.allow_threads(|| {
        while WAITING.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
    });
}

/// How long an interrupted caller waits for its cancelled task to stop.
const ABORT_GRACE: Duration = Duration::from_secs(1);

/// Runs `fut` on the runtime with no signal checks and no cancellation: for steps that must
/// finish once begun (close), each bounded by its own deadline.
pub(crate) fn block_on_uninterrupted<T, F>(py: Python<'_>, fut: F) -> PyResult<T>
where
    T: Send + 'static,
    F: Future<Output = T> + Send + 'static,
{
    let (tx, rx) = mpsc::sync_channel(1);
    runtime(py)?.spawn(async move {
        let _ = tx.send(fut.await);
    });
    py.allow_threads(move || rx.recv())
        .map_err(|_| errors::local(py, "kvbridge task ended without an answer"))
}

/// Converts a future's value to a Python object, with the GIL held.
pub(crate) type Convert<T> = fn(Python<'_>, T) -> PyResult<PyObject>;

/// Runs `fut` on the runtime and returns an asyncio future of the running loop that it
/// completes (through `loop.call_soon_threadsafe`). Cancelling the asyncio future cancels
/// `fut`.
pub(crate) fn awaitable<'py, T, F>(
    py: Python<'py>,
    fut: F,
    convert: Convert<T>,
) -> PyResult<Bound<'py, PyAny>>
where
    T: Send + 'static,
    F: Future<Output = EngineResult<T>> + Send + 'static,
{
    awaitable_with(py, fut, convert, drop)
}

/// [`awaitable`], handing a value the future produced to `undelivered` when the asyncio
/// future was cancelled (or its loop closed) before the value could be set on it.
pub(crate) fn awaitable_with<'py, T, F, U>(
    py: Python<'py>,
    fut: F,
    convert: Convert<T>,
    undelivered: U,
) -> PyResult<Bound<'py, PyAny>>
where
    T: Send + 'static,
    F: Future<Output = EngineResult<T>> + Send + 'static,
    U: FnOnce(T) + Send + 'static,
{
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let py_future = event_loop.call_method0("create_future")?;
    let loop_ref = event_loop.clone().unbind();
    let future_ref = py_future.clone().unbind();
    let task = runtime(py)?.spawn(async move {
        let result = fut.await;
        // never on this (runtime) thread: see `completer`
        completer::run(Box::new(move |py| {
            let pending = Mutex::new(Some((result, undelivered)));
            // Runs on the loop's thread, where the future's state cannot change under it.
            let complete = PyCFunction::new_closure(py, None, None, move |args, _| {
                let py = args.py();
                let taken = pending.lock().ok().and_then(|mut p| p.take());
                let Some((result, undelivered)) = taken else {
                    return Ok(());
                };
                let future = future_ref.bind(py);
                if future.call_method0("done")?.is_truthy()? {
                    if let Ok(v) = result {
                        undelivered(v);
                    }
                    return Ok(());
                }
                match result.map_err(|e| e.to_py(py)).and_then(|v| convert(py, v)) {
                    Ok(v) => future.call_method1("set_result", (v,))?,
                    Err(e) => future.call_method1("set_exception", (e.into_value(py),))?,
                };
                PyResult::Ok(())
            });
            match complete {
                Ok(f) => {
                    if loop_ref
                        .call_method1(py, "call_soon_threadsafe", (f.clone(),))
                        .is_err()
                    {
                        // The loop is closed: nobody waits any more; hand the value back.
                        if let Err(e) = f.call0() {
                            e.write_unraisable(py, None);
                        }
                    }
                }
                Err(e) => e.write_unraisable(py, None),
            }
        }));
    });
    let abort = task.abort_handle();
    let on_done = PyCFunction::new_closure(py, None, None, move |args, _kwargs| -> PyResult<()> {
        let fut = args.get_item(0)?;
        if fut.call_method0("cancelled")?.is_truthy()? {
            abort.abort();
        }
        Ok(())
    })?;
    py_future.call_method1("add_done_callback", (on_done,))?;
    Ok(py_future)
}

/// Spawns `fut` on the runtime for a [`crate::transfer::Transfer`] to poll.
pub(crate) fn spawn<F>(py: Python<'_>, fut: F) -> PyResult<AbortHandle>
where
    F: Future<Output = ()> + Send + 'static,
{
    Ok(runtime(py)?.spawn(fut).abort_handle())
}
