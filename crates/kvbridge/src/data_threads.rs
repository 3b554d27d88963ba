//! A small pool of threads for data connections.
//!
//! Each data connection runs its reader and writer on threads that block in the kernel. A
//! new thread costs tens to hundreds of microseconds on a loaded host, which would dominate
//! a handshake that otherwise takes well under a millisecond, so finished threads park here
//! (at most [`MAX_IDLE`], for at most [`IDLE_FOR`]) and the next connection reuses them.

use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

/// Most threads kept parked.
pub(crate) const MAX_IDLE: usize = 64;
/// How long a parked thread waits for work before it exits.
pub(crate) const IDLE_FOR: Duration = Duration::from_secs(60);

type Job = Box<dyn FnOnce() + Send + 'static>;

struct Parked {
    id: u64,
    tx: mpsc::Sender<Job>,
}

static IDLE: Mutex<Vec<Parked>> = Mutex::new(Vec::new());
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Runs `job` on a parked thread, or on a new one.
pub(crate) fn run(name: &str, job: Job) -> std::io::Result<()> {
    let mut job = job;
    loop {
        let parked = IDLE.lock().expect("data thread pool poisoned").pop();
        match parked {
            // A parked thread that is no longer in the list always receives what was sent
            // to it (see `park`), so a successful send is a job that will run.
            Some(p) => match p.tx.send(job) {
                Ok(()) => return Ok(()),
                Err(mpsc::SendError(j)) => job = j,
            },
            None => break,
        }
    }
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || worker(job))
        .map(|_| ())
}

fn worker(first: Job) {
    let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (tx, rx) = mpsc::channel::<Job>();
    let mut job = Some(first);
    while let Some(j) = job.take() {
        j();
        job = park(id, &tx, &rx);
    }
}

/// Parks the thread until a job arrives or it has idled long enough (`None`: exit).
fn park(id: u64, tx: &mpsc::Sender<Job>, rx: &mpsc::Receiver<Job>) -> Option<Job> {
    {
        let mut idle = IDLE.lock().expect("data thread pool poisoned");
        if idle.len() >= MAX_IDLE {
            return None;
        }
        idle.push(Parked { id, tx: tx.clone() });
    }
    if let Ok(j) = rx.recv_timeout(IDLE_FOR) {
        return Some(j);
    }
    // Timed out. If we are still listed, unlist and exit; if someone took us off the list in
    // the meantime, their job is on its way: wait for it.
    let still_listed = {
        let mut idle = IDLE.lock().expect("data thread pool poisoned");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_are_reused() {
        let (tx, rx) = mpsc::channel();
        let mut ids = std::collections::HashSet::new();
        for _ in 0..20 {
            let tx = tx.clone();
            run(
                "test",
                Box::new(move || {
                    tx.send(std::thread::current().id()).unwrap();
                }),
            )
            .unwrap();
            ids.insert(rx.recv().unwrap());
            // Wait until the worker has parked itself, so the next job can find it.
            for _ in 0..100_000 {
                if !IDLE.lock().unwrap().is_empty() {
                    break;
                }
                std::thread::yield_now();
            }
        }
        assert!(ids.len() <= 2, "20 jobs ran on {} threads", ids.len());
    }
}
