//! Outcome messages duplicated, reordered, late or for nobody: the KV-ready waits still end
//! exactly once, with the right result, and the strays are counted, never crash anything.
//! (A dropped outcome is answered by the request's deadline: see
//! `e2e::kv_outcome_never_arrives_gives_504_within_the_deadline`.)
//!
//! The owner task handles events in order, so "this wait has not ended" is checked
//! deterministically: a probe wait registered and completed after the events in question
//! proves every earlier event was handled.

use kvbridge_proxy::kvwait::{KvOutcome, KvWait, KvWaiters, Loss};
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

fn lost(prefiller: usize, how: Loss) -> Option<KvOutcome> {
    Some(KvOutcome::PrefillerLost { prefiller, how })
}

#[tokio::test]
async fn an_ejected_prefiller_fails_the_waits_bound_to_it_and_no_others() {
    let (w, m) = setup();
    let mut a = w.register("a", 2);
    a.binding().bind(0, 0);
    let mut b = w.register("b", 1);
    b.binding().bind(1, 0);
    let mut unbound = w.register("u", 1);
    w.deliver(ready("a", 0));
    w.prefiller_ejected(0, 1);
    barrier(&w).await;
    assert_eq!(now(&mut a).await, lost(0, Loss::Ejected));
    assert_eq!(now(&mut b).await, None, "another prefiller's wait");
    assert_eq!(now(&mut unbound).await, None, "a wait bound to none");
    assert_eq!(m.kv_waits_prefiller_lost.load(Relaxed), 1);
    // Its last rank's outcome, if it ever comes, is a stray.
    w.deliver(ready("a", 1));
    barrier(&w).await;
    assert_eq!(m.kv_outcomes_unknown.load(Relaxed), 1);
}

#[tokio::test]
async fn an_ejection_between_the_pick_and_the_binding_still_fails_the_wait() {
    let (w, _) = setup();
    let mut a = w.register("a", 1);
    // Picked at 0 ejections; the ejection is handled before the binding.
    w.prefiller_ejected(0, 1);
    a.binding().bind(0, 0);
    // Picked after that ejection (re-admitted since): not lost.
    let mut b = w.register("b", 1);
    b.binding().bind(0, 1);
    barrier(&w).await;
    assert_eq!(now(&mut a).await, lost(0, Loss::Ejected));
    assert_eq!(now(&mut b).await, None);
}

#[tokio::test]
async fn a_wait_that_moved_on_from_a_refusing_prefiller_survives_its_ejection() {
    let (w, _) = setup();
    let mut a = w.register("a", 1);
    let bind = a.binding();
    bind.bind(0, 0);
    // The prefiller refused the connection: unbound before the ejection it causes.
    bind.unbind();
    w.prefiller_ejected(0, 1);
    bind.bind(1, 0);
    barrier(&w).await;
    assert_eq!(now(&mut a).await, None);
    w.prefiller_ejected(1, 1);
    barrier(&w).await;
    assert_eq!(now(&mut a).await, lost(1, Loss::Ejected));
}

#[tokio::test]
async fn an_outcome_connection_closed_by_its_peer_fails_its_prefillers_waits() {
    let (w, m) = setup();
    // Connection 7 delivers an outcome for a wait on prefiller 0: it is prefiller 0's.
    let mut first = w.register("first", 1);
    first.binding().bind(0, 0);
    w.deliver_on(7, ready("first", 0));
    barrier(&w).await;
    assert_eq!(now(&mut first).await, Some(KvOutcome::Ready));
    let mut a = w.register("a", 1);
    a.binding().bind(0, 0);
    let mut b = w.register("b", 1);
    b.binding().bind(1, 0);
    // A connection that never delivered anything closing tells nothing.
    w.conn_ended(8, true);
    barrier(&w).await;
    assert_eq!(now(&mut a).await, None);
    w.conn_ended(7, true);
    barrier(&w).await;
    assert_eq!(now(&mut a).await, lost(0, Loss::OutcomeConnClosed));
    assert_eq!(now(&mut b).await, None, "another prefiller's wait");
    assert_eq!(m.kv_waits_prefiller_lost.load(Relaxed), 1);
}

#[tokio::test]
async fn an_outcome_connection_the_proxy_evicts_fails_nothing() {
    let (w, _) = setup();
    let first = w.register("first", 1);
    first.binding().bind(0, 0);
    w.deliver_on(7, ready("first", 0));
    let mut a = w.register("a", 1);
    a.binding().bind(0, 0);
    w.conn_ended(7, false);
    // Forgotten with the eviction: a later end of the same id tells nothing either.
    w.conn_ended(7, true);
    barrier(&w).await;
    assert_eq!(now(&mut a).await, None);
}

#[tokio::test]
async fn a_connection_that_reports_only_failures_or_for_two_prefillers_tells_nothing() {
    let (w, _) = setup();
    // Connection 5 (a decoder's receiver, say) reports a failure of prefiller 0's request.
    let f = w.register("f", 2);
    f.binding().bind(0, 0);
    w.deliver_on(5, failed("f", 1));
    // Connection 6 delivers successes for prefillers 0 and 1.
    for (id, p) in [("x", 0), ("y", 1)] {
        let mut x = w.register(id, 1);
        x.binding().bind(p, 0);
        w.deliver_on(6, ready(id, 0));
        barrier(&w).await;
        assert_eq!(now(&mut x).await, Some(KvOutcome::Ready));
    }
    let mut a = w.register("a", 1);
    a.binding().bind(0, 0);
    w.conn_ended(5, true);
    w.conn_ended(6, true);
    barrier(&w).await;
    assert_eq!(now(&mut a).await, None);
    drop(f);
}
