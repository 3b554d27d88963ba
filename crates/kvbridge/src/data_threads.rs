//! The threads of data connections.
//!
//! Each data connection runs its reader and writer on threads that block in the kernel. A
//! new thread costs tens to hundreds of microseconds on a loaded host, which would dominate
//! a handshake that otherwise takes well under a millisecond, so finished threads park in a
//! [`ThreadPool`] (at most [`MAX_IDLE`], for at most [`IDLE_FOR`]) and the next connection
//! reuses them.

use std::time::Duration;

use crate::thread_pool::{Job, ThreadPool};

/// Most threads kept parked.
pub(crate) const MAX_IDLE: usize = 64;
/// How long a parked thread waits for work before it exits.
pub(crate) const IDLE_FOR: Duration = Duration::from_secs(60);

static DATA_THREADS: ThreadPool = ThreadPool::new(MAX_IDLE, IDLE_FOR, || {});

/// Runs `job` on a parked data thread, or on a new one.
pub(crate) fn run(name: &str, job: Job) -> std::io::Result<()> {
    DATA_THREADS.run(name, job)
}
