//! KV-ready waits: one task owns every pending request id.
//!
//! Registration, forgetting and incoming outcomes all travel through one FIFO channel to the
//! owner task. A request registers *before* its prefill is sent, so its registration is always
//! ahead of any outcome the prefill can cause: an outcome can never arrive before its waiter.
//! Outcomes for ids nobody waits for (late, duplicate or foreign) are counted and dropped.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
use crate::notif::Notif;

/// The most ranks one request may have (the rank set is a 64-bit mask).
pub const MAX_RANKS: u32 = 64;

/// The final outcome of one request's KV transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvOutcome {
    /// Every rank reported success.
    Ready,
    /// One rank reported failure.
    Failed {
        /// The failing rank.
        rank: u32,
        /// Its reason.
        reason: String,
    },
}

enum Event {
    Register {
        id: Arc<str>,
        ranks: u32,
        tx: oneshot::Sender<KvOutcome>,
    },
    Forget(Arc<str>),
    Outcome(Notif),
}

struct Entry {
    ranks: u32,
    seen: u64,
    anonymous: u32,
    tx: oneshot::Sender<KvOutcome>,
}

/// Handle to the owner task of all KV-ready waits. Cheap to clone.
#[derive(Clone)]
pub struct KvWaiters {
    tx: mpsc::UnboundedSender<Event>,
}

/// One registered wait. Dropping it forgets the request id (exactly once).
pub struct KvWait {
    rx: oneshot::Receiver<KvOutcome>,
    id: Arc<str>,
    tx: mpsc::UnboundedSender<Event>,
}

impl KvWait {
    /// Waits for the outcome. `None` means the owner task is gone (the proxy is shutting down).
    /// Cancel-safe: it may be polled again after a `select!` dropped it.
    pub async fn outcome(&mut self) -> Option<KvOutcome> {
        (&mut self.rx).await.ok()
    }

    /// The request id this wait is registered under.
    pub fn id(&self) -> &str {
        &self.id
    }
}

impl Drop for KvWait {
    fn drop(&mut self) {
        let _ = self.tx.send(Event::Forget(self.id.clone()));
    }
}

impl KvWaiters {
    /// Starts the owner task; it ends when every handle and wait is dropped.
    pub fn spawn(metrics: Arc<Metrics>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(own(rx, metrics));
        KvWaiters { tx }
    }

    /// Registers a wait for `ranks` outcomes of request `id`. Call it before sending the prefill.
    pub fn register(&self, id: &str, ranks: u32) -> KvWait {
        let (otx, orx) = oneshot::channel();
        let id: Arc<str> = Arc::from(id);
        let _ = self.tx.send(Event::Register {
            id: id.clone(),
            ranks,
            tx: otx,
        });
        KvWait {
            rx: orx,
            id,
            tx: self.tx.clone(),
        }
    }

    /// Hands one received outcome message to the owner task.
    pub fn deliver(&self, msg: Notif) {
        let _ = self.tx.send(Event::Outcome(msg));
    }
}

async fn own(mut rx: mpsc::UnboundedReceiver<Event>, metrics: Arc<Metrics>) {
    let mut map: HashMap<Arc<str>, Entry> = HashMap::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Register { id, ranks, tx } => {
                let ranks = ranks.clamp(1, MAX_RANKS);
                map.insert(
                    id,
                    Entry {
                        ranks,
                        seen: 0,
                        anonymous: 0,
                        tx,
                    },
                );
            }
            Event::Forget(id) => {
                map.remove(&id);
            }
            Event::Outcome(msg) => {
                let k = match &msg {
                    Notif::ProxyNotif { .. } => 0,
                    Notif::KvReady { .. } => 1,
                    Notif::KvFailed { .. } => 2,
                };
                metrics.kv_outcomes[k].fetch_add(1, Relaxed);
                let key = msg.req_id().to_owned();
                let Some(e) = map.get_mut(key.as_str()) else {
                    metrics.kv_outcomes_unknown.fetch_add(1, Relaxed);
                    tracing::debug!(
                        req_id = msg.req_id(),
                        kind = msg.kind(),
                        "outcome for unknown request id dropped"
                    );
                    continue;
                };
                let done = match msg {
                    Notif::ProxyNotif { .. } => {
                        e.anonymous += 1;
                        None
                    }
                    Notif::KvReady { rank, .. } if rank < e.ranks => {
                        e.seen |= 1u64 << rank;
                        None
                    }
                    Notif::KvReady { rank, req_id, .. } => {
                        tracing::warn!(%req_id, rank, ranks = e.ranks, "KvReady from a rank out of range");
                        metrics.kv_outcomes_unknown.fetch_add(1, Relaxed);
                        None
                    }
                    Notif::KvFailed { rank, reason, .. } => {
                        Some(KvOutcome::Failed { rank, reason })
                    }
                };
                let done = done.or_else(|| {
                    (e.seen.count_ones() + e.anonymous >= e.ranks).then_some(KvOutcome::Ready)
                });
                if let Some(out) = done {
                    if let Some(e) = map.remove(key.as_str()) {
                        let _ = e.tx.send(out);
                    }
                }
            }
        }
        metrics.kv_waits_pending.store(map.len() as i64, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const T: Duration = Duration::from_secs(5);

    async fn pending(m: &Metrics, want: i64) {
        // The gauge is written by the owner task after each event; give it a bounded moment.
        let deadline = tokio::time::Instant::now() + T;
        while m.kv_waits_pending.load(Relaxed) != want {
            assert!(
                tokio::time::Instant::now() < deadline,
                "kv_waits_pending stuck at {}",
                m.kv_waits_pending.load(Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test]
    async fn ready_after_every_rank_and_duplicates_do_not_count_twice() {
        let m = Arc::new(Metrics::default());
        let w = KvWaiters::spawn(m.clone());
        let mut wait = w.register("r", 3);
        let ready = |rank| Notif::KvReady {
            req_id: "r".into(),
            rank,
            chunks: 1,
            bytes: 1,
        };
        w.deliver(ready(0));
        w.deliver(ready(0));
        w.deliver(ready(2));
        assert!(
            tokio::time::timeout(Duration::from_millis(30), wait.outcome())
                .await
                .is_err(),
            "rank 1 is missing"
        );
        w.deliver(ready(1));
        assert_eq!(
            tokio::time::timeout(T, wait.outcome()).await.unwrap(),
            Some(KvOutcome::Ready)
        );
        pending(&m, 0).await;
    }

    #[tokio::test]
    async fn resolved_and_dropped_waits_leave_nothing_behind() {
        let m = Arc::new(Metrics::default());
        let w = KvWaiters::spawn(m.clone());
        let mut a = w.register("a", 1);
        let b = w.register("b", 1);
        pending(&m, 2).await;
        w.deliver(Notif::ProxyNotif { req_id: "a".into() });
        assert_eq!(
            tokio::time::timeout(T, a.outcome()).await.unwrap(),
            Some(KvOutcome::Ready)
        );
        pending(&m, 1).await;
        drop(b);
        pending(&m, 0).await;
        drop(a);
        w.deliver(Notif::ProxyNotif { req_id: "a".into() });
        w.deliver(Notif::ProxyNotif {
            req_id: "zzz".into(),
        });
        let deadline = tokio::time::Instant::now() + T;
        while m.kv_outcomes_unknown.load(Relaxed) != 2 {
            assert!(tokio::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        pending(&m, 0).await;
    }

    #[tokio::test]
    async fn one_failed_rank_fails_at_once() {
        let m = Arc::new(Metrics::default());
        let w = KvWaiters::spawn(m.clone());
        let mut wait = w.register("r", 8);
        w.deliver(Notif::KvReady {
            req_id: "r".into(),
            rank: 0,
            chunks: 1,
            bytes: 1,
        });
        w.deliver(Notif::KvFailed {
            req_id: "r".into(),
            rank: 5,
            reason: "buffer full".into(),
        });
        assert_eq!(
            tokio::time::timeout(T, wait.outcome()).await.unwrap(),
            Some(KvOutcome::Failed {
                rank: 5,
                reason: "buffer full".into()
            })
        );
        pending(&m, 0).await;
    }
}
