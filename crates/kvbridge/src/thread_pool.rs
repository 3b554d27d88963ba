//! A small pool of threads that park between jobs.
//!
//! A new thread costs tens to hundreds of microseconds on a loaded or virtual host (measured
//! here: 50-200 µs from spawn to first instruction), which dominates work that otherwise
//! takes well under a millisecond: a data connection's handshake, or a job on the path to a
//! request's first token. A [`ThreadPool`] keeps finished threads parked (at most
//! `max_idle`, each for at most `idle_for`) and hands the next job to one of them.
//!
//! Pools are meant to be `static`s. A thread's setup (`on_start`, such as lowering its CPU
//! priority) runs once, when it is spawned, so jobs that need different setups take
//! different pools: a thread whose priority was lowered cannot raise it again unprivileged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

/// A job for a [`ThreadPool`].
pub type Job = Box<dyn FnOnce() + Send + 'static>;

struct Parked {
    id: u64,
    tx: mpsc::Sender<Job>,
}

/// Threads that park between jobs (see the module docs).
pub struct ThreadPool {
    idle: Mutex<Vec<Parked>>,
    next_id: AtomicU64,
    max_idle: usize,
    idle_for: Duration,
    on_start: fn(),
}

impl ThreadPool {
    /// A pool that keeps at most `max_idle` threads parked, each for at most `idle_for`;
    /// every thread it spawns runs `on_start` first.
    pub const fn new(max_idle: usize, idle_for: Duration, on_start: fn()) -> ThreadPool {
        ThreadPool {
            idle: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            max_idle,
            idle_for,
            on_start,
        }
    }

    /// Runs `job` on a parked thread, or on a new one named `name`. Fails only when no
    /// thread could be spawned.
    pub fn run(&'static self, name: &str, job: Job) -> std::io::Result<()> {
        let mut job = job;
        loop {
            let parked = self.idle_list().pop();
            match parked {
                // A parked thread that is no longer in the list always receives what was
                // sent to it (see `park`), so a successful send is a job that will run.
                Some(p) => match p.tx.send(job) {
                    Ok(()) => return Ok(()),
                    Err(mpsc::SendError(j)) => job = j,
                },
                None => break,
            }
        }
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || self.worker(job))
            .map(|_| ())
    }

    /// Threads parked now.
    pub fn parked(&self) -> usize {
        self.idle_list().len()
    }

    fn idle_list(&self) -> std::sync::MutexGuard<'_, Vec<Parked>> {
        // The list stays consistent under a panic (pushes and removals only).
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn worker(&self, first: Job) {
        (self.on_start)();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel::<Job>();
        let mut job = Some(first);
        while let Some(j) = job.take() {
            j();
            job = self.park(id, &tx, &rx);
        }
    }

    /// Parks the thread until a job arrives or it has idled long enough (`None`: exit).
    fn park(&self, id: u64, tx: &mpsc::Sender<Job>, rx: &mpsc::Receiver<Job>) -> Option<Job> {
        {
            let mut idle = self.idle_list();
            if idle.len() >= self.max_idle {
                return None;
            }
            idle.push(Parked { id, tx: tx.clone() });
        }
        if let Ok(j) = rx.recv_timeout(self.idle_for) {
            return Some(j);
        }
        // Timed out. If we are still listed, unlist and exit; if someone took us off the
        // list in the meantime, their job is on its way: wait for it.
        let still_listed = {
            let mut idle = self.idle_list();
            match idle.iter().position(|p| p.id == id) {
                Some(i) => {
                    idle.swap_remove(i);
                    true
                }
                None => false,
            }
        };
        if still_listed {
            rx.try_recv().ok()
        } else {
            rx.recv().ok()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static STARTED: AtomicU64 = AtomicU64::new(0);
    static POOL: ThreadPool = ThreadPool::new(4, Duration::from_secs(60), || {
        STARTED.fetch_add(1, Ordering::Relaxed);
    });

    #[test]
    fn threads_are_reused_and_set_up_once() {
        let (tx, rx) = mpsc::channel();
        let mut ids = std::collections::HashSet::new();
        for _ in 0..20 {
            let tx = tx.clone();
            POOL.run(
                "test",
                Box::new(move || {
                    tx.send(std::thread::current().id()).unwrap();
                }),
            )
            .unwrap();
            ids.insert(rx.recv().unwrap());
            // Wait until the worker has parked itself, so the next job can find it.
            for _ in 0..100_000 {
                if POOL.parked() > 0 {
                    break;
                }
                std::thread::yield_now();
            }
        }
        assert!(ids.len() <= 2, "20 jobs ran on {} threads", ids.len());
        assert_eq!(STARTED.load(Ordering::Relaxed), ids.len() as u64);
    }

    #[test]
    fn an_idle_thread_exits_after_its_time() {
        static SHORT: ThreadPool = ThreadPool::new(4, Duration::from_millis(200), || {});
        let (tx, rx) = mpsc::channel();
        SHORT
            .run("test-short", Box::new(move || tx.send(()).unwrap()))
            .unwrap();
        rx.recv().unwrap();
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while SHORT.parked() == 0 && std::time::Instant::now() < until {
            std::thread::yield_now();
        }
        // Parked, then gone once its 200 ms passed (a bounded wait).
        while SHORT.parked() > 0 {
            assert!(std::time::Instant::now() < until, "still parked");
            std::thread::yield_now();
        }
    }
}
