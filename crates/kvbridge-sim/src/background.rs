//! Work that must not compete with the transfer engine and the request path: the decoder's
//! check of the KV it received against the KV the model says it must be (a real decoder would
//! not do it at all; here it proves every byte that crossed), and the CPU work that stands in
//! for the accelerator (the prefill's KV compute, the decoder's digest of the KV it holds),
//! which on a real deployment takes no host core from the transfer. Such work runs on a
//! thread of its own at the lowest CPU priority (nice 19), so a waking transfer or network
//! thread preempts it at once instead of waiting out its time slice, yet it is never starved
//! outright: the scheduler still gives it a small share, and all of it when a core is idle.
//! The threads park between jobs ([`kvbridge::thread_pool`]): a new thread took 50-200 µs to
//! start here, on the path to a first token for the decoder's digest of the last chunk.

use std::fmt;
use std::time::Duration;

use kvbridge::thread_pool::ThreadPool;

/// Why a background job gave no result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackgroundError(String);

impl fmt::Display for BackgroundError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BackgroundError {}

/// Threads at the lowest priority, parked between jobs (set up once, when spawned).
static LOW_PRIORITY: ThreadPool = ThreadPool::new(16, Duration::from_secs(30), lowest_priority);

/// Runs `f` on a thread at the lowest CPU priority (a parked one, or a new one named `name`)
/// and waits for its result.
pub async fn run<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, BackgroundError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    LOW_PRIORITY
        .run(
            name,
            Box::new(move || {
                let _ = tx.send(f());
            }),
        )
        .map_err(|e| BackgroundError(format!("starting thread {name}: {e}")))?;
    rx.await
        .map_err(|_| BackgroundError(format!("thread {name} panicked")))
}

/// Lowers the calling thread (only it: on Linux a thread id names one thread) to nice 19.
/// Best effort: where it is refused the work runs at normal priority.
fn lowest_priority() {
    // SAFETY: plain system calls on the calling thread's own id.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn runs_at_nice_19_and_returns_the_result() {
        // SAFETY: reads the calling thread's own priority.
        let own = || unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
        let before = own();
        let nice = run("test-bg", own).await.unwrap();
        assert_eq!(nice, 19);
        // The caller's own thread is untouched.
        assert_eq!(own(), before);
    }

    #[tokio::test]
    async fn a_panic_is_an_error() {
        let r = run("test-bg-panic", || -> u32 { panic!("boom") }).await;
        assert!(r.unwrap_err().to_string().contains("panicked"));
    }
}
