//! Running engine futures on the runtime for Python callers: blocking (GIL released, woken
//! every [`SIGNAL_POLL`] to let Python run its signal handlers), or as an asyncio future
//! (`kvbridge._call.Call`) whose cancel waits until the engine let go of the call.

use crate::completer;
use crate::errors;
use crate::runtime;
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::PyCFunction;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
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

/// How much longer than the op deadline a cancelled awaitable waits for the engine to let go
/// of its call: the engine's own wait for a copy under way is bounded by the op deadline and
/// one second more (`datapath/cancel.rs`), after which it ends the session itself.
pub(crate) const LET_GO_GRACE: Duration = Duration::from_secs(2);

/// What a cancelled awaitable names, and does, when the engine has not let go of its call
/// within `limit` (`kvbridge/_call.py`).
pub(crate) struct Stuck {
    /// The call, for the message (``"read of 4 pages with peer decode-0"``).
    pub(crate) what: String,
    pub(crate) peer: Option<String>,
    pub(crate) step: &'static str,
    pub(crate) limit: Duration,
    /// Ends the session with the peer, where the call touches memory.
    pub(crate) end: Option<Box<dyn Fn() + Send + Sync>>,
    /// Runs once the task let go of a call it did not finish, before the Call hears of it:
    /// what the engine's drop cannot wait for (a UCX session's teardown).
    pub(crate) settle: Option<Settle>,
}

/// An async step after a cancelled call's drop ([`Stuck::settle`]).
pub(crate) type Settle = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// `kvbridge._call.Call`, the asyncio future the awaitables are.
static CALL: GILOnceCell<Py<PyAny>> = GILOnceCell::new();

/// Runs `fut` on the runtime and returns a `kvbridge._call.Call` (an asyncio future of the
/// running loop) that it completes through `loop.call_soon_threadsafe`. Cancelling the
/// Call aborts the task and cancels the Call only once the task let go of `fut` (or ends it
/// after `stuck.limit`).
pub(crate) fn awaitable<'py, T, F>(
    py: Python<'py>,
    fut: F,
    convert: Convert<T>,
    stuck: Stuck,
) -> PyResult<Bound<'py, PyAny>>
where
    T: Send + 'static,
    F: Future<Output = EngineResult<T>> + Send + 'static,
{
    awaitable_with(py, fut, convert, drop, stuck)
}

/// [`awaitable`], handing a value the future produced to `undelivered` when the Call was
/// cancelled (or its loop closed) before the value could be set on it.
pub(crate) fn awaitable_with<'py, T, F, U>(
    py: Python<'py>,
    fut: F,
    convert: Convert<T>,
    undelivered: U,
    stuck: Stuck,
) -> PyResult<Bound<'py, PyAny>>
where
    T: Send + 'static,
    F: Future<Output = EngineResult<T>> + Send + 'static,
    U: FnOnce(T) + Send + 'static,
{
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let rt = runtime(py)?;
    // Set right after the spawn, before Python can see the Call (and so cancel it).
    let abort_slot = Arc::new(OnceLock::<AbortHandle>::new());
    let aborts = abort_slot.clone();
    let abort = PyCFunction::new_closure(py, None, None, move |_args, _kwargs| {
        if let Some(a) = aborts.get() {
            a.abort();
        }
    })?;
    let end = match stuck.end {
        Some(end) => {
            PyCFunction::new_closure(py, None, None, move |_args, _kwargs| end())?.into_any()
        }
        None => py.None().into_bound(py),
    };
    let class = CALL.get_or_try_init(py, || {
        py.import("kvbridge._call")?
            .getattr("Call")
            .map(Bound::unbind)
    })?;
    let call = class.bind(py).call1((
        &event_loop,
        abort,
        end,
        stuck.limit.as_secs_f64(),
        stuck.what,
        stuck.peer,
        stuck.step,
    ))?;
    let loop_ref = event_loop.clone().unbind();
    let call_ref = call.clone().unbind();
    let finished = Arc::new(AtomicBool::new(false));
    let let_go = LetGo {
        call: Some((loop_ref.clone_ref(py), call_ref.clone_ref(py))),
        finished: finished.clone(),
        settle: stuck.settle,
    };
    let body = async move {
        let result = fut.await;
        finished.store(true, Ordering::SeqCst);
        // never on this (runtime) thread: see `completer`
        completer::run(Box::new(move |py| {
            complete(py, loop_ref, call_ref, result, convert, undelivered)
        }));
    };
    let task = rt.spawn(Then::new(body, let_go));
    let _ = abort_slot.set(task.abort_handle());
    Ok(call)
}

/// Hands `result` to the Call on its loop's thread, where its state cannot change under it:
/// sets it, unless the Call is done or cancelling (then `undelivered` takes the value).
fn complete<T, U>(
    py: Python<'_>,
    loop_ref: Py<PyAny>,
    call_ref: Py<PyAny>,
    result: EngineResult<T>,
    convert: Convert<T>,
    undelivered: U,
) where
    T: Send + 'static,
    U: FnOnce(T) + Send + 'static,
{
    // The Call goes with the outcome, so that running the closure lets go of it: a closure
    // freed by Python later drops what it holds outside any call into this module, where
    // PyO3 defers the decrement to its next call.
    let pending = Mutex::new(Some((result, undelivered, call_ref)));
    let complete = PyCFunction::new_closure(py, None, None, move |args, _| {
        let py = args.py();
        let taken = pending.lock().ok().and_then(|mut p| p.take());
        let Some((result, undelivered, call_ref)) = taken else {
            return Ok(());
        };
        let call = call_ref.bind(py);
        if !call.call_method0("_kvb_wants_outcome")?.is_truthy()? {
            if let Ok(v) = result {
                undelivered(v);
            }
            return Ok(());
        }
        match result.map_err(|e| e.to_py(py)).and_then(|v| convert(py, v)) {
            Ok(v) => call.call_method1("set_result", (v,))?,
            Err(e) => call.call_method1("set_exception", (e.into_value(py),))?,
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
}

/// Moved into an awaitable's task after its future ([`Then`]): tells the Call, on its loop,
/// that the task let go of the future (it ended, or its abort took effect), after the
/// outcome, if any, was handed over; for a call that did not finish, after its `settle`.
struct LetGo {
    /// The Call's loop and the Call.
    call: Option<(Py<PyAny>, Py<PyAny>)>,
    /// The future ran to its end.
    finished: Arc<AtomicBool>,
    settle: Option<Settle>,
}

impl Drop for LetGo {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return;
        };
        let settle = self.settle.take();
        match settle.filter(|_| !self.finished.load(Ordering::SeqCst)) {
            Some(settle) => match runtime::handle() {
                Ok(rt) => {
                    rt.spawn(async move {
                        settle().await;
                        released(call);
                    });
                }
                Err(_) => released(call),
            },
            None => released(call),
        }
    }
}

/// Tells the Call `call` (with its loop) that its task let go of it.
fn released((loop_ref, call_ref): (Py<PyAny>, Py<PyAny>)) {
    // never on the runtime's thread: see `completer`
    completer::run(Box::new(move |py| {
        let posted = call_ref
            .getattr(py, "_kvb_released")
            .and_then(|f| loop_ref.call_method1(py, "call_soon_threadsafe", (f,)));
        // An error here is a closed loop: nobody waits for the Call any more.
        drop(posted);
    }));
}

/// A future that drops `after` once its inner future was dropped: right after it completed,
/// or when the task running it is aborted or dropped before (even if never polled). Fields
/// drop in declaration order, so `after` sees the inner future's drop, and what that drop
/// waited for (a cancelled batch's copy under way), done.
pub(crate) struct Then<F, G> {
    fut: Pin<Box<F>>,
    _after: G,
}

impl<F, G> Then<F, G> {
    pub(crate) fn new(fut: F, after: G) -> Self {
        Self {
            fut: Box::pin(fut),
            _after: after,
        }
    }
}

impl<F: Future, G: Unpin> Future for Then<F, G> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        self.get_mut().fut.as_mut().poll(cx)
    }
}

/// Spawns `fut` on the runtime for a [`crate::transfer::Transfer`] to poll.
pub(crate) fn spawn<F>(py: Python<'_>, fut: F) -> PyResult<AbortHandle>
where
    F: Future<Output = ()> + Send + 'static,
{
    Ok(runtime(py)?.spawn(fut).abort_handle())
}
