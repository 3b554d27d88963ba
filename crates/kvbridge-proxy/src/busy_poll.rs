//! Adaptive busy polling: while the proxy's only request waits for a backend, its one-thread
//! runtime polls its sockets instead of sleeping, for at most a short window.
//!
//! Why: a request through the proxy makes two backend round trips (prefill, then decode), and
//! each time the proxy has nothing else to do it blocks in `epoll_wait`. Waking a blocked
//! thread on an idle core costs tens of microseconds on a virtual machine (the core was
//! halted; measured here: a direct request to a backend takes 96 µs at one connection, of
//! which most is two such wake-ups), so two extra wake-ups are most of what a proxy adds at
//! low load. Kernels and hypervisors answer the same problem the same way (KVM's
//! `halt_poll_ns`, `SO_BUSY_POLL`): poll briefly before sleeping.
//!
//! The cost is bounded and only paid when it is likely to buy something:
//! - the runtime spins only while exactly one request is in flight (at higher load there is
//!   other work to run, and spinning would take CPU from it and from the backends), only
//!   while that request awaits a backend's answer, and ends as soon as the answer arrives;
//! - the window adapts, as KVM's halt polling does: every answer that arrives within the
//!   configured window grows it back towards that maximum, every slower one halves it, down
//!   to zero. Backends that take milliseconds (a real prefill) or a machine so loaded that
//!   answers come late turn polling off after a few calls; fast answers turn it back on.
//!
//! Time spent spinning is counted in `kvbridge_proxy_busy_poll_seconds_total`.
//!
//! It needs the one-thread runtime (`--threads 1`, the default): there the spinning task's
//! `yield_now` makes the runtime poll the I/O driver with a zero timeout between polls. On a
//! work-stealing runtime it is not started.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The busy-polling state of one proxy.
#[derive(Debug)]
pub(crate) struct BusyPoll {
    /// The configured window: the most one call is polled for.
    max_ns: u64,
    /// The window now, adapted to how fast answers come (see the module's doc).
    window_ns: AtomicU64,
    /// Backend calls in flight that asked for polling.
    awaiting: AtomicUsize,
    start: Notify,
    /// Nanoseconds spent spinning, for the metric.
    spun_ns: AtomicU64,
}

/// Windows shorter than this are not worth a spin: the window drops to zero.
const MIN_WINDOW_NS: u64 = 5_000;

/// A backend call in flight; dropping it (answer arrived, or the call failed or was
/// cancelled) ends the wait it registered and adapts the window to how long it took.
#[must_use]
pub(crate) struct Awaiting(Option<(Arc<BusyPoll>, Instant)>);

impl Drop for Awaiting {
    fn drop(&mut self) {
        if let Some((bp, t0)) = self.0.take() {
            bp.awaiting.fetch_sub(1, Relaxed);
            bp.adapt(t0.elapsed());
        }
    }
}

impl BusyPoll {
    /// Polls for at most `window` per backend call.
    pub fn new(window: Duration) -> Arc<BusyPoll> {
        let max_ns = window.as_nanos().min(u64::MAX as u128) as u64;
        Arc::new(BusyPoll {
            max_ns,
            window_ns: AtomicU64::new(max_ns),
            awaiting: AtomicUsize::new(0),
            start: Notify::new(),
            spun_ns: AtomicU64::new(0),
        })
    }

    /// Seconds spent spinning so far.
    pub fn spun_secs(&self) -> f64 {
        self.spun_ns.load(Relaxed) as f64 / 1e9
    }

    /// The window now.
    pub fn window(&self) -> Duration {
        Duration::from_nanos(self.window_ns.load(Relaxed))
    }

    /// Registers a backend call about to be sent while `requests_in_flight` requests are
    /// being served; spinning starts only when that is the one request and the window is
    /// open. (A call made while the window is closed still times its answer, which is what
    /// opens the window again.)
    pub fn awaiting(self: &Arc<Self>, requests_in_flight: i64) -> Awaiting {
        if requests_in_flight > 1 {
            return Awaiting(None);
        }
        self.awaiting.fetch_add(1, Relaxed);
        if self.window_ns.load(Relaxed) > 0 {
            self.start.notify_one();
        }
        Awaiting(Some((self.clone(), Instant::now())))
    }

    /// An answer took `took`: within the configured window, polling pays, so the window
    /// doubles (from at least a quarter of the maximum) up to the maximum; slower, it
    /// halves, and closes below [`MIN_WINDOW_NS`].
    fn adapt(&self, took: Duration) {
        let cur = self.window_ns.load(Relaxed);
        let next = if took.as_nanos() <= self.max_ns as u128 {
            cur.saturating_mul(2).max(self.max_ns / 4).min(self.max_ns)
        } else if cur / 2 < MIN_WINDOW_NS {
            0
        } else {
            cur / 2
        };
        self.window_ns.store(next, Relaxed);
    }

    /// The spinning task: runs until aborted with the proxy's other tasks.
    pub async fn run(self: Arc<Self>) {
        loop {
            self.start.notified().await;
            let t0 = Instant::now();
            let until = t0 + self.window();
            // A stale permit from a call that already ended finds nothing awaited.
            while self.awaiting.load(Relaxed) > 0 && Instant::now() < until {
                // The backend may have been woken on this very core (the scheduler likes
                // the waker's core): give it the core at once instead of holding it until
                // the scheduler preempts the spin.
                std::thread::yield_now();
                tokio::task::yield_now().await;
            }
            self.spun_ns
                .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits (yielding, so the spinner runs) until the spinner has recorded a spin.
    async fn until_spun(bp: &BusyPoll, before: f64) {
        let t0 = Instant::now();
        while bp.spun_secs() == before {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the spinner never stopped"
            );
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn no_spinning_while_other_requests_are_in_flight() {
        let bp = BusyPoll::new(Duration::from_secs(60));
        let a = bp.awaiting(2);
        assert!(a.0.is_none());
        assert_eq!(bp.awaiting.load(Relaxed), 0);
    }

    #[tokio::test]
    async fn spinning_ends_when_the_answer_arrives() {
        // A window far longer than the test's patience: only the end of the call stops it.
        let bp = BusyPoll::new(Duration::from_secs(60));
        let task = tokio::spawn(bp.clone().run());
        let a = bp.awaiting(1);
        assert_eq!(bp.awaiting.load(Relaxed), 1);
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        drop(a);
        assert_eq!(bp.awaiting.load(Relaxed), 0);
        until_spun(&bp, 0.0).await;
        task.abort();
    }

    #[test]
    fn the_window_closes_for_slow_backends_and_reopens_for_fast_ones() {
        let bp = BusyPoll::new(Duration::from_micros(100));
        let max = Duration::from_micros(100);
        assert_eq!(bp.window(), max);
        // Prefill-like answers (milliseconds): the window halves each time, then closes.
        for _ in 0..6 {
            bp.adapt(Duration::from_millis(20));
        }
        assert_eq!(bp.window(), Duration::ZERO);
        // A closed window still times calls (and starts no spin); a fast answer opens it
        // again to a quarter, more fast answers to the whole window.
        let a = bp.awaiting(1);
        assert!(a.0.is_some());
        drop(a);
        assert_eq!(bp.window(), max / 4);
        bp.adapt(Duration::from_micros(40));
        assert_eq!(bp.window(), max / 2);
        bp.adapt(Duration::from_micros(40));
        assert_eq!(bp.window(), max);
        bp.adapt(Duration::from_micros(40));
        assert_eq!(bp.window(), max);
    }

    #[tokio::test]
    async fn spinning_gives_up_after_the_window() {
        let bp = BusyPoll::new(Duration::from_millis(20));
        let task = tokio::spawn(bp.clone().run());
        let long = bp.awaiting(1);
        until_spun(&bp, 0.0).await;
        assert!(bp.spun_secs() >= 0.020);
        drop(long);
        task.abort();
    }
}
