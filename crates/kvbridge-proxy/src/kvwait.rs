//! KV-ready waits: one task owns every pending request id.
//!
//! Registration, forgetting and incoming outcomes all travel through one FIFO channel to the
//! owner task. A request registers *before* its prefill is sent, so its registration is always
//! ahead of any outcome the prefill can cause: an outcome can never arrive before its waiter.
//! Outcomes for ids nobody waits for (late, duplicate or foreign) are counted and dropped.
//!
//! A wait is bound to the prefiller its prefill went to. The KV sits on that prefiller until
//! every rank reported, so when the proxy learns the prefiller is gone (ejected, or an
//! outcome connection of it closed) its waits fail at once with
//! [`KvOutcome::PrefillerLost`] instead of waiting out `kv_ready_timeout`. Which prefiller
//! an outcome connection belongs to is learnt from the success outcomes it delivers (only a
//! sender reports success; a decoder's receiver may report failures on a connection of its
//! own); a connection that delivered for two prefillers tells nothing.

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
    /// The prefiller holding the KV is gone before every rank reported.
    PrefillerLost {
        /// The prefiller's index in its pool.
        prefiller: usize,
        /// How the proxy learnt it.
        how: Loss,
    },
}

/// How the proxy learnt that a prefiller is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Its health checks failed, or it refused a connection: it was ejected.
    Ejected,
    /// An outcome connection of one of its ranks closed.
    OutcomeConnClosed,
}

enum Event {
    Register {
        id: Arc<str>,
        ranks: u32,
        tx: oneshot::Sender<KvOutcome>,
    },
    Forget(Arc<str>),
    /// The prefill of `id` goes to a prefiller: its index, and its ejection count when it
    /// was picked (`None`: to none, for now).
    Bind {
        id: Arc<str>,
        prefiller: Option<(usize, u64)>,
    },
    Outcome {
        msg: Notif,
        conn: Option<u64>,
    },
    /// `prefiller` was ejected, for the `ejections`-th time.
    Ejected {
        prefiller: usize,
        ejections: u64,
    },
    /// An outcome connection ended; `lost`: by the peer (not closed by the proxy).
    ConnEnded {
        conn: u64,
        lost: bool,
    },
}

struct Entry {
    ranks: u32,
    seen: u64,
    anonymous: u32,
    /// The prefiller and its ejection count when it was picked.
    prefiller: Option<(usize, u64)>,
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

    /// What binds this wait to the prefiller its prefill goes to.
    pub fn binding(&self) -> Binding {
        Binding {
            id: self.id.clone(),
            tx: self.tx.clone(),
        }
    }
}

/// Binds a wait to the prefiller its prefill goes to ([`KvWait::binding`]).
pub struct Binding {
    id: Arc<str>,
    tx: mpsc::UnboundedSender<Event>,
}

impl Binding {
    /// The prefill goes to prefiller `prefiller` (its index in its pool), ejected
    /// `ejections` times when it was picked. Call it before sending the prefill.
    pub fn bind(&self, prefiller: usize, ejections: u64) {
        let _ = self.tx.send(Event::Bind {
            id: self.id.clone(),
            prefiller: Some((prefiller, ejections)),
        });
    }

    /// The prefill did not reach the prefiller bound last (it goes to another one next):
    /// losing that one no longer concerns the wait. Call it before the ejection it causes.
    pub fn unbind(&self) {
        let _ = self.tx.send(Event::Bind {
            id: self.id.clone(),
            prefiller: None,
        });
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
        let _ = self.tx.send(Event::Outcome { msg, conn: None });
    }

    /// Hands one outcome message received on outcome connection `conn` to the owner task.
    pub fn deliver_on(&self, conn: u64, msg: Notif) {
        let _ = self.tx.send(Event::Outcome {
            msg,
            conn: Some(conn),
        });
    }

    /// Prefiller `prefiller` was ejected, for the `ejections`-th time: the waits bound to it
    /// before that fail.
    pub fn prefiller_ejected(&self, prefiller: usize, ejections: u64) {
        let _ = self.tx.send(Event::Ejected {
            prefiller,
            ejections,
        });
    }

    /// Outcome connection `conn` ended; `by_peer`: the peer closed it or it broke (not the
    /// proxy's eviction). The waits bound to the prefiller it belonged to then fail.
    pub fn conn_ended(&self, conn: u64, by_peer: bool) {
        let _ = self.tx.send(Event::ConnEnded {
            conn,
            lost: by_peer,
        });
    }
}

/// Fails every wait bound to `prefiller` (at an ejection count below `before`, if given).
fn lose(
    map: &mut HashMap<Arc<str>, Entry>,
    metrics: &Metrics,
    prefiller: usize,
    before: Option<u64>,
    how: Loss,
) {
    let lost: Vec<Arc<str>> = map
        .iter()
        .filter(|(_, e)| {
            e.prefiller
                .is_some_and(|(p, n)| p == prefiller && before.is_none_or(|b| n < b))
        })
        .map(|(id, _)| id.clone())
        .collect();
    for id in lost {
        if let Some(e) = map.remove(&id) {
            metrics.kv_waits_prefiller_lost.fetch_add(1, Relaxed);
            tracing::warn!(req_id = %id, prefiller, ?how, "KV wait failed: its prefiller is gone");
            let _ = e.tx.send(KvOutcome::PrefillerLost { prefiller, how });
        }
    }
}

async fn own(mut rx: mpsc::UnboundedReceiver<Event>, metrics: Arc<Metrics>) {
    let mut map: HashMap<Arc<str>, Entry> = HashMap::new();
    // The latest ejection count of each prefiller, and the prefiller of each outcome
    // connection (learnt from the waits its outcomes resolved).
    let mut ejected: HashMap<usize, u64> = HashMap::new();
    // `None`: it delivered for more than one prefiller.
    let mut conns: HashMap<u64, Option<usize>> = HashMap::new();
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
                        prefiller: None,
                        tx,
                    },
                );
            }
            Event::Forget(id) => {
                map.remove(&id);
            }
            Event::Bind { id, prefiller } => {
                if let Some(e) = map.get_mut(&id) {
                    e.prefiller = prefiller;
                }
                // Ejected between its pick and this: lost already.
                if let Some((p, n)) = prefiller {
                    if let Some(&latest) = ejected.get(&p).filter(|&&l| l > n) {
                        lose(&mut map, &metrics, p, Some(latest), Loss::Ejected);
                    }
                }
            }
            Event::Ejected {
                prefiller,
                ejections,
            } => {
                let n = ejected.entry(prefiller).or_default();
                *n = (*n).max(ejections);
                lose(
                    &mut map,
                    &metrics,
                    prefiller,
                    Some(ejections),
                    Loss::Ejected,
                );
            }
            Event::ConnEnded { conn, lost } => {
                if let (Some(Some(p)), true) = (conns.remove(&conn), lost) {
                    lose(&mut map, &metrics, p, None, Loss::OutcomeConnClosed);
                }
            }
            Event::Outcome { msg, conn } => {
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
                let success = !matches!(msg, Notif::KvFailed { .. });
                if let (Some(c), Some((p, _)), true) = (conn, e.prefiller, success) {
                    let whose = conns.entry(c).or_insert(Some(p));
                    if *whose != Some(p) {
                        *whose = None;
                    }
                }
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
