//! Dropping a worker ends as soon as nothing is left to send: it progresses until idle,
//! then waits on its armed event fd briefly, instead of sleeping a fixed number of quiet
//! rounds. (What the drain protects, the wireup replies UCX owes its peers, is exercised by
//! the engine's `tests/access_modes.rs` over UCX, where UCX 1.13 aborted the process in
//! `ucp_worker_destroy` when one was still queued.)
#![cfg(feature = "ucx")]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvbridge_ucx::{Context, ContextConfig, Worker};

#[test]
fn ucx_child() {
    child_entry();
}

/// Far less than the 20 ms the drop used to sleep at the least; the fastest of several
/// drops counts, so that a loaded host's scheduling does not.
const FAST: Duration = Duration::from_millis(10);

fn fastest(mut drops: Vec<Duration>) -> Duration {
    drops.sort();
    drops[0]
}

#[test]
fn dropping_an_idle_worker_is_quick() {
    for tls in TLS_VARIANTS {
        let ctx = Context::new(&ContextConfig::with_tls(tls)).expect("context");
        let drops: Vec<Duration> = (0..5)
            .map(|_| {
                let w = Worker::new(&ctx).expect("worker");
                let at = Instant::now();
                drop(w);
                at.elapsed()
            })
            .collect();
        eprintln!("{tls}: idle worker dropped in {drops:?}");
        assert!(fastest(drops.clone()) < FAST, "{tls}: {drops:?}");
    }
}

#[test]
fn dropping_a_worker_with_a_connected_idle_endpoint_is_quick() {
    for tls in TLS_VARIANTS {
        let target = Target::thread(tls);
        let drops: Vec<Duration> = (0..5)
            .map(|_| {
                let mut me = Initiator::to(tls, &target);
                me.worker
                    .put(me.rkey, 0, &me.local, 0, 4096, deadline(20))
                    .unwrap();
                me.worker.flush(me.ep, deadline(20)).unwrap();
                let at = Instant::now();
                drop(me.worker);
                at.elapsed()
            })
            .collect();
        eprintln!("{tls}: worker with a connected endpoint dropped in {drops:?}");
        assert!(fastest(drops.clone()) < FAST, "{tls}: {drops:?}");
    }
}
