//! An idle worker sleeps on its event fd: with a connected endpoint and nothing in flight,
//! `wait_events` returns only on timeouts or UCX's own timers, never in a busy loop.
#![cfg(feature = "ucx")]

mod common;

use std::time::{Duration, Instant};

use common::*;

#[test]
fn idle_worker_sleeps_on_its_event_fd() {
    for tls in TLS_VARIANTS {
        let target = Target::thread(tls);
        let mut me = Initiator::to(tls, &target);
        me.worker
            .put(me.rkey, 0, &me.local, 0, 4096, deadline(20))
            .unwrap();
        me.worker.flush(me.ep, deadline(20)).unwrap();
        let window = Duration::from_secs(2);
        let started = Instant::now();
        let mut wakeups = 0u32;
        while started.elapsed() < window {
            me.worker.wait_events(Duration::from_millis(500)).unwrap();
            wakeups += 1;
        }
        eprintln!("{tls}: {wakeups} wake-ups of an idle worker in {window:?}");
        // 4 would be the timeouts alone; UCX's keepalive and timers add a few.
        assert!(
            wakeups < 200,
            "{tls}: {wakeups} wake-ups in {window:?}: a busy loop"
        );
    }
}
