//! Outcome messages duplicated, reordered, late or for nobody: the KV-ready waits still end
//! exactly once, with the right result, and the strays are counted, never crash anything.
//! (A dropped outcome is answered by the request's deadline: see
//! `e2e::kv_outcome_never_arrives_gives_504_within_the_deadline`.)
//!
//! The owner task handles events in order, so "this wait has not ended" is checked
//! deterministically: a probe wait registered and completed after the events in question
//! proves every earlier event was handled.

use kvbridge_proxy::kvwait::{KvOutcome, KvWait, KvWaiters};
use kvbridge_proxy::metrics::Metrics;
use kvbridge_proxy::notif::Notif;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

fn ready(id: &str, rank: u32) -> Notif {
    Notif::KvReady {
        req_id: id.into(),
        rank,
        chunks: 1,
        bytes: 1,
    }
}

fn failed(id: &str, rank: u32) -> Notif {
    Notif::KvFailed {
        req_id: id.into(),
        rank,
        reason: "test".into(),
    }
}

/// Waits until the owner task has handled everything sent before this call.
async fn barrier(w: &KvWaiters) {
    let mut probe = w.register("probe", 1);
    w.deliver(ready("probe", 0));
    let out = tokio::time::timeout(Duration::from_secs(5), probe.outcome())
        .await
        .expect("the owner task answers");
    assert_eq!(out, Some(KvOutcome::Ready));
}

/// The wait's outcome if it has one now.
async fn now(wait: &mut KvWait) -> Option<KvOutcome> {
    tokio::time::timeout(Duration::ZERO, wait.outcome())
        .await
        .ok()
        .flatten()
}

fn setup() -> (KvWaiters, Arc<Metrics>) {
    let m = Arc::new(Metrics::default());
    (KvWaiters::spawn(m.clone()), m)
}

#[tokio::test]
async fn duplicated_ready_of_one_rank_does_not_complete_a_two_rank_request() {
    let (w, m) = setup();
    let mut a = w.register("a", 2);
    w.deliver(ready("a", 0));
    w.deliver(ready("a", 0));
    barrier(&w).await;
    assert_eq!(now(&mut a).await, None, "rank 1 has not reported");
    w.deliver(ready("a", 1));
    barrier(&w).await;
    assert_eq!(now(&mut a).await, Some(KvOutcome::Ready));
    // A duplicate after the end is a stray: counted, dropped.
    let before = m.kv_outcomes_unknown.load(Relaxed);
    w.deliver(ready("a", 1));
    barrier(&w).await;
    assert_eq!(m.kv_outcomes_unknown.load(Relaxed), before + 1);
}

#[tokio::test]
async fn reordered_ranks_complete_and_a_late_failure_changes_nothing() {
    let (w, m) = setup();
    let mut a = w.register("a", 3);
    for r in [2, 0, 1] {
        w.deliver(ready("a", r));
    }
    barrier(&w).await;
    assert_eq!(now(&mut a).await, Some(KvOutcome::Ready));
    let before = m.kv_outcomes_unknown.load(Relaxed);
    w.deliver(failed("a", 1));
    barrier(&w).await;
    assert_eq!(m.kv_outcomes_unknown.load(Relaxed), before + 1);
}

#[tokio::test]
async fn a_failure_ends_the_wait_at_once_and_later_readies_are_strays() {
    let (w, m) = setup();
    let mut a = w.register("a", 2);
    w.deliver(ready("a", 0));
    w.deliver(failed("a", 1));
    w.deliver(ready("a", 1));
    barrier(&w).await;
    assert_eq!(
        now(&mut a).await,
        Some(KvOutcome::Failed {
            rank: 1,
            reason: "test".into()
        })
    );
    assert_eq!(m.kv_outcomes_unknown.load(Relaxed), 1);
}

#[tokio::test]
async fn outcomes_for_forgotten_or_foreign_ids_and_bad_ranks_are_counted_not_applied() {
    let (w, m) = setup();
    let a = w.register("gone", 1);
    drop(a); // the request ended (its deadline fired, say): the id is forgotten
    w.deliver(ready("gone", 0));
    w.deliver(ready("never-registered", 0));
    let mut b = w.register("b", 1);
    w.deliver(ready("b", 7)); // a rank the request does not have
    barrier(&w).await;
    assert_eq!(now(&mut b).await, None);
    assert_eq!(m.kv_outcomes_unknown.load(Relaxed), 3);
    w.deliver(ready("b", 0));
    barrier(&w).await;
    assert_eq!(now(&mut b).await, Some(KvOutcome::Ready));
    drop(b);
    barrier(&w).await;
    assert_eq!(
        m.kv_waits_pending.load(Relaxed),
        0,
        "no request id waits any more"
    );
}
