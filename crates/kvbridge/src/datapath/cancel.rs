//! A write or read whose caller stops waiting for it (its future is dropped: an aborted
//! task, a timeout around the call, a `select!` that took another branch) is cancelled, and
//! the drop returns only once nothing of it can touch its memory any more:
//!
//! * a read's destinations receive no byte after the drop returned: the batch leaves the
//!   table of waiting batches, so the peer's late answer is read past and dropped
//!   (`Pending::land`), and a copy into the destinations under way (the TCP reader filling
//!   them, the writer copying a mapped region into them) is waited for;
//! * a write's sources are not read after the drop returned: a write not sent yet is never
//!   sent, one being sent or copied is waited for. Bytes already sent may still land at
//!   the peer: the peer's memory is the peer's to protect (closing its windows waits for
//!   writes under way there, `Channel::close_window`).
//!
//! The wait blocks the dropping thread (a drop cannot await); on a multi-thread runtime
//! the thread is lent first (`block_in_place`), so the runtime's other tasks, the reader and
//! writer among them where they are tasks, go on meanwhile. Where the thread cannot wait (a
//! current-thread runtime whose task the copy is), or a claim outlives its bound, the
//! session ends instead: that is the one way left to stop a copy.

use super::pending::{AbortHandle, Pending};
use crate::error::Error;
use kvbridge_proto::handshake::Step;
use kvbridge_proto::PeerId;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

/// How much longer than the batch's deadline a cancel waits for a claim: every reader's and
/// writer's step on a batch's memory is bounded by the op deadline, so a claim held longer
/// means something is stuck.
const CLAIM_GRACE: Duration = Duration::from_secs(1);

/// Cancels the batches `ids` of `pending` when dropped armed (the caller stopped waiting
/// before the outcome came).
pub(crate) struct CancelOnDrop {
    pending: Arc<Pending>,
    abort: AbortHandle,
    peer: PeerId,
    step: Step,
    ids: Range<u64>,
    deadline: Duration,
    until: tokio::time::Instant,
    armed: bool,
}

impl CancelOnDrop {
    /// Armed for the batches `ids`, entered under `deadline` (passing at `until`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        pending: Arc<Pending>,
        abort: AbortHandle,
        peer: PeerId,
        step: Step,
        ids: Range<u64>,
        deadline: Duration,
        until: tokio::time::Instant,
    ) -> Self {
        Self {
            pending,
            abort,
            peer,
            step,
            ids,
            deadline,
            until,
            armed: true,
        }
    }

    /// The outcome came (or the session ended and drained the batches): nothing to cancel.
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }

    /// Ends the session with `err`: the one way left to stop what a cancel could not wait
    /// for.
    fn end_session(&self, err: Error) {
        tracing::warn!(peer = %self.peer, error = %err, "cancelled batch: ending the session");
        self.abort.abort(err);
    }

    /// A tombstone keeps the cancelled batch's room under the per-peer limit until its
    /// answer comes; the answer must come by the batch's own deadline, as it would have had
    /// to without the cancel, or the session ends with `Timeout` (so the room is not held
    /// for ever by a peer that never answers).
    fn watch_late(&self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (pending, abort, ids, until) = (
            self.pending.clone(),
            self.abort.clone(),
            self.ids.clone(),
            self.until,
        );
        let err = Error::Timeout {
            peer: self.peer.to_string(),
            step: self.step,
            after: self.deadline,
        };
        rt.spawn(async move {
            tokio::time::sleep_until(until).await;
            if pending.late_left(ids) {
                abort.abort(err);
            }
        });
    }
}

/// How the dropping thread may wait for a claim.
enum Wait {
    /// Lend the thread to the runtime first.
    LendThread,
    /// Block right here.
    Block,
    /// Not at all: the copy needs this very thread to go on.
    Cannot,
}

fn how_to_wait(claimers_on_own_threads: bool) -> Wait {
    use tokio::runtime::RuntimeFlavor;
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        // A panic in a drop while unwinding aborts the process: block_in_place (which
        // panics where it may not be called) only when not unwinding.
        Ok(RuntimeFlavor::MultiThread) if !std::thread::panicking() => Wait::LendThread,
        Ok(RuntimeFlavor::MultiThread) | Err(_) => Wait::Block,
        Ok(_) if claimers_on_own_threads => Wait::Block,
        Ok(_) => Wait::Cannot,
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let cancelled = self.pending.cancel(self.ids.clone());
        if cancelled.late {
            self.watch_late();
        }
        if cancelled.claimed.is_empty() {
            return;
        }
        let ids: Vec<u64> = cancelled.claimed.iter().map(|(id, _)| *id).collect();
        let own = cancelled.claimed.iter().all(|(_, own)| *own);
        let limit = self.deadline + CLAIM_GRACE;
        let pending = &self.pending;
        let released = match how_to_wait(own) {
            Wait::LendThread => {
                let lent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    tokio::task::block_in_place(|| pending.wait_released(&ids, limit))
                }));
                // block_in_place refuses a LocalSet; block where the copy runs elsewhere.
                match lent {
                    Ok(r) => r,
                    Err(_) if own => pending.wait_released(&ids, limit),
                    Err(_) => false,
                }
            }
            Wait::Block => pending.wait_released(&ids, limit),
            Wait::Cannot => false,
        };
        if !released {
            self.end_session(Error::Disconnected {
                peer: self.peer.to_string(),
                reason: format!(
                    "a cancelled batch's copy ({}) could not be waited for",
                    self.step
                ),
            });
        }
    }
}

/// Ends the session when dropped armed: for a batch posted on a backend that completes it
/// elsewhere (UCX's worker), which nothing here can call back once posted. UCX's
/// `ucp_request_cancel` does not promise that an RMA operation under way stops, so a caller
/// that stops waiting for such a batch ends the session (docs/ucx.md).
pub(crate) struct EndSessionOnDrop {
    abort: AbortHandle,
    peer: PeerId,
    step: Step,
    armed: bool,
}

impl EndSessionOnDrop {
    /// Armed for a batch of step `step` to `peer`.
    pub(crate) fn new(abort: AbortHandle, peer: PeerId, step: Step) -> Self {
        Self {
            abort,
            peer,
            step,
            armed: true,
        }
    }

    /// The batch completed: nothing to end.
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for EndSessionOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let err = Error::Disconnected {
                peer: self.peer.to_string(),
                reason: format!(
                    "a {} batch posted on UCX was cancelled: a posted operation cannot be \
                     called back",
                    self.step
                ),
            };
            tracing::warn!(peer = %self.peer, error = %err, "cancelled batch: ending the session");
            self.abort.abort(err);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::pending::{Landing, Waiting};
    use crate::datapath::{DataPath, PeerFeatures};
    use crate::dir::Dir;
    use crate::region::{LocalSlice, Region};
    use crate::transport::one_sided::{BatchRef, OneSided, Posted};
    use kvbridge_proto::msg::OpDesc;
    use kvbridge_proto::route::Offer;
    use std::sync::atomic::AtomicU64;
    use std::sync::Mutex;
    use tokio::sync::oneshot;

    /// An abort handle that records the errors the session was asked to end with.
    fn recording() -> (AbortHandle, Arc<Mutex<Vec<Error>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        (AbortHandle::new(move |e| s.lock().unwrap().push(e)), seen)
    }

    /// A read entered, sent, and taken for landing by a reader that runs as a task
    /// (`own_thread` false): its claim is held by the returned value.
    fn landing(p: &Pending, r: &Region) {
        let (tx, _rx) = oneshot::channel();
        let dest = LocalSlice {
            region: r.begin_write(),
            offset: 0,
            len: 4096,
        };
        p.enter(1, Waiting::Read(vec![dest], tx), 4096, None)
            .unwrap();
        drop(p.claim_to_send(1, false));
    }

    fn guard(p: &Arc<Pending>, abort: AbortHandle) -> CancelOnDrop {
        CancelOnDrop::new(
            p.clone(),
            abort,
            PeerId::new("peer").unwrap(),
            Step::Read,
            1..2,
            Duration::from_secs(5),
            tokio::time::Instant::now() + Duration::from_secs(5),
        )
    }

    /// The drop of a cancelled read returns only once the copy into its destinations that
    /// was under way ended; the session goes on.
    #[test]
    fn a_cancel_returns_only_after_the_copy_under_way() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        let p = Arc::new(Pending::new(PeerId::new("peer").unwrap(), 1 << 20));
        let r = Region::alloc(4096, 4096).unwrap();
        landing(&p, &r);
        let copied = Arc::new(AtomicU64::new(0));
        let (abort, seen) = recording();
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let copier = {
            let (p, copied) = (p.clone(), copied.clone());
            std::thread::spawn(move || {
                let Landing::Live((dests, _done, claim)) = p.land(1, false) else {
                    panic!("the read is waiting")
                };
                started_tx.send(()).unwrap();
                // The copy: still under way when the cancel comes.
                std::thread::sleep(Duration::from_millis(200));
                copied.store(1, std::sync::atomic::Ordering::SeqCst);
                drop(dests);
                drop(claim);
            })
        };
        started_rx.recv().unwrap();
        let g = guard(&p, abort);
        rt.block_on(async move { tokio::spawn(async move { drop(g) }).await.unwrap() });
        assert_eq!(
            copied.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "the cancel returned while the copy ran"
        );
        assert!(seen.lock().unwrap().is_empty(), "the session was ended");
        copier.join().unwrap();
    }

    /// On a current-thread runtime, whose one thread a reader task needs to finish its
    /// copy, the drop cannot wait: the session ends instead.
    #[test]
    fn a_cancel_that_cannot_wait_ends_the_session() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let p = Arc::new(Pending::new(PeerId::new("peer").unwrap(), 1 << 20));
        let r = Region::alloc(4096, 4096).unwrap();
        landing(&p, &r);
        let Landing::Live((_dests, _done, _claim)) = p.land(1, false) else {
            panic!("the read is waiting")
        };
        let (abort, seen) = recording();
        let g = guard(&p, abort);
        rt.block_on(async move { drop(g) });
        let seen = seen.lock().unwrap();
        assert!(
            matches!(seen.as_slice(), [Error::Disconnected { .. }]),
            "{seen:?}"
        );
    }

    /// A backend whose batches never complete (as a UCX get stalled at the peer); counts
    /// the batches posted.
    struct Stalled(AtomicU64);

    impl OneSided for Stalled {
        fn name(&self) -> &'static str {
            "stalled"
        }

        fn offer(&self, _dir: Dir, _descs: &[OpDesc]) -> Offer {
            Offer {
                covers: true,
                copies_in_caller: false,
            }
        }

        fn reaches_any(&self) -> bool {
            true
        }

        fn post<'a>(&'a self, _b: BatchRef<'a>) -> Posted<'a> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Posted::Pending(Box::pin(std::future::pending()))
        }
    }

    /// A batch posted on a backend that completes it elsewhere cannot be called back: its
    /// cancel ends the session (UCX's fallback).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_batch_posted_elsewhere_ends_the_session() {
        let (abort, seen) = recording();
        let stalled = Arc::new(Stalled(AtomicU64::new(0)));
        let (path, _rxs) = DataPath::new(
            PeerId::new("peer").unwrap(),
            abort,
            1 << 20,
            1,
            vec![stalled.clone()],
            Arc::new(AtomicU64::new(0)),
            PeerFeatures::default(),
        );
        let local = Region::alloc(4096, 4096).unwrap();
        let task = {
            let (path, local) = (path.clone(), local.clone());
            tokio::spawn(async move {
                let dest = LocalSlice {
                    region: local.begin_write(),
                    offset: 0,
                    len: 4096,
                };
                let desc = OpDesc {
                    region: kvbridge_proto::RegionId([1; 16]),
                    offset: 0,
                    len: 4096,
                };
                path.transfer(
                    Dir::Read,
                    Duration::from_secs(30),
                    vec![desc],
                    vec![dest],
                    None,
                )
                .await
            })
        };
        let t = std::time::Instant::now();
        while stalled.0.load(std::sync::atomic::Ordering::SeqCst) == 0
            && t.elapsed() < Duration::from_secs(5)
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(seen.lock().unwrap().is_empty(), "ended before the cancel");
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        let seen = seen.lock().unwrap();
        assert!(
            matches!(seen.as_slice(), [Error::Disconnected { reason, .. }] if reason.contains("UCX")),
            "{seen:?}"
        );
    }
}
