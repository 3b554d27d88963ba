//! The one thread of the binding that takes the GIL for the engine: it completes asyncio
//! futures (and hands back what their cancelled callers left).
//!
//! The runtime's worker threads never wait for the GIL. A process's Python code can hold the
//! GIL for long stretches (an engine loop in a C call); a runtime worker waiting for it
//! would stall every task queued behind it on that worker: handshakes the process serves to
//! its peers, reads' completions, deadlines. vLLM CPU leaves one core for transfers, where
//! the runtime has a single worker. Completions wait here instead, in order, and nothing
//! else does.

use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;

/// Set once the interpreter runs its exit hooks: the GIL is then not taken from here.
static STOPPED: AtomicBool = AtomicBool::new(false);

/// Called from the interpreter's exit hook: jobs after it never take the GIL (their
/// futures never complete; nobody waits for them any more).
pub(crate) fn stop() {
    STOPPED.store(true, Ordering::SeqCst);
}

/// Work that needs the GIL.
pub(crate) type Job = Box<dyn FnOnce(Python<'_>) + Send>;

/// The completer's queue and the process it was started in: a child made by `fork` inherits
/// the queue without the thread, so it starts its own.
static QUEUE: Mutex<Option<(u32, mpsc::Sender<Job>)>> = Mutex::new(None);

/// Runs `job` with the GIL on the completer thread (started on first use). A job the
/// thread cannot take (it could not be started) is dropped: its future stays pending,
/// which its caller's own timeout or cancellation ends.
pub(crate) fn run(job: Job) {
    let pid = std::process::id();
    let mut slot = QUEUE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((owner, tx)) = slot.as_ref() {
        if *owner == pid {
            match tx.send(job) {
                Ok(()) => return,
                Err(mpsc::SendError(back)) => return start(&mut slot, pid, back),
            }
        }
    }
    start(&mut slot, pid, job);
}

fn start(slot: &mut Option<(u32, mpsc::Sender<Job>)>, pid: u32, job: Job) {
    let (tx, rx) = mpsc::channel::<Job>();
    let spawned = std::thread::Builder::new()
        .name("kvbridge-py".into())
        .spawn(move || {
            for job in rx {
                if STOPPED.load(Ordering::SeqCst) {
                    // the interpreter is finalizing: taking the GIL now could abort the
                    // process; the job's references are leaked
                    std::mem::forget(job);
                    continue;
                }
                Python::with_gil(job);
            }
        });
    if spawned.is_ok() && tx.send(job).is_ok() {
        *slot = Some((pid, tx));
    }
}
