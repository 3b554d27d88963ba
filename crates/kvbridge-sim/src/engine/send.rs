//! Prefill role: a prompt's KV sent to the decoder while it is computed: the announcement,
//! and per rank a task that begins the transfer, writes the chunks as they come and
//! finishes it.

use super::error::SimError;
use super::prefill::{prefill, ChunkMsg};
use super::state::Inner;
use crate::announce::{self, Announcement};
use crate::model::{self, SeqState};
use crate::timeline::TARGET as TL;
use kvbridge_pd::{DisaggSpec, Outcome, PdError, PdSender};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};

/// Prefill role: starts the prefill at once and, while the accelerator computes, announces
/// the transfer to the decoder and begins it on every rank (the allocation round trip); each
/// rank task writes chunks as they come (after its `begin`) and finishes once the
/// announcement was acknowledged, so `KvReady` still always follows it. Setup costs the
/// first token nothing unless it outlasts the first chunk's compute.
///
/// A failed announcement or `begin` fails the request (500) as soon as it is known; every
/// rank reports `KvFailed` (its `begin`, `finish` or cancel does).
pub(super) async fn prefill_and_send(
    s: &Arc<Inner>,
    tokens: &[u32],
    ds: &DisaggSpec,
) -> Result<SeqState, SimError> {
    tracing::debug!(target: TL, stage = "prefill.setup", id = %ds.req_id);
    let Some(port) = ds.receiver_alloc_port.first() else {
        let e = SimError::BadRequest(
            "`disagg_spec.receiver_alloc_port` is empty: the reference decoder learns the request id on it".into(),
        );
        // Every sending rank (one per lane) owes the proxy an outcome.
        for r in 0..s.senders.len() as u32 {
            s.outcomes.emit(Outcome::KvFailed {
                req_id: ds.req_id.clone(),
                rank: r,
                reason: e.to_string(),
            });
        }
        s.counts
            .kv_transfers_failed
            .fetch_add(s.senders.len() as u64, Relaxed);
        return Err(e);
    };
    let a = Announcement {
        req_id: ds.req_id.clone(),
        key: model::tokens_key(tokens),
        tokens: tokens.len() as u64,
    };
    let addr = format!("{}:{port}", ds.receiver_host);
    // The announcement's result, for the rank tasks (they finish only after an `ok`).
    let (ann_tx, ann_rx) = tokio::sync::watch::channel(None::<bool>);
    let tokens_arc: Arc<[u32]> = Arc::from(tokens);
    let mut txs = Vec::with_capacity(s.senders.len());
    let mut begun = Vec::with_capacity(s.senders.len());
    for sender in &s.senders {
        let (tx, rx) =
            mpsc::channel::<ChunkMsg>(s.cfg.cost.pages_per_step(s.model.spec.chunk_tokens).max(2));
        let (btx, brx) = oneshot::channel::<Result<(), PdError>>();
        txs.push(tx);
        begun.push(brx);
        s.work_started();
        tokio::spawn(rank_sender(
            s.clone(),
            RankJob {
                sender: sender.clone(),
                spec: ds.clone(),
                tokens: tokens_arc.clone(),
                chunks: rx,
                begun: btx,
                announced: ann_rx.clone(),
            },
        ));
    }
    let setup = async {
        tracing::debug!(target: TL, stage = "prefill.announce", id = %ds.req_id);
        let r = announce::announce(&addr, &a, s.cfg.announce_timeout).await;
        let _ = ann_tx.send(Some(r.is_ok()));
        r?;
        tracing::debug!(target: TL, stage = "prefill.announced", id = %ds.req_id);
        for b in begun {
            match b.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(SimError::Kv(e)),
                Err(_) => return Err(SimError::Internal("a rank task ended early".into())),
            }
        }
        tracing::debug!(target: TL, stage = "prefill.allocated", id = %ds.req_id);
        Ok::<(), SimError>(())
    };
    // Owns the chunk queues: they close (the rank tasks finish) when the prefill ends.
    let work = async move { prefill(s, tokens, Some(&txs)).await };
    tokio::pin!(setup, work);
    let mut set_up = false;
    let state = loop {
        tokio::select! {
            r = &mut setup, if !set_up => {
                // On failure the prefill stops here; the rank tasks see their chunk queue
                // close and report KvFailed.
                r?;
                set_up = true;
            }
            st = &mut work => break st,
        }
    };
    if !set_up {
        setup.await?;
    }
    state
}

/// What one rank task needs.
struct RankJob {
    sender: Arc<PdSender>,
    spec: DisaggSpec,
    tokens: Arc<[u32]>,
    /// The prefill's chunks, in order; closed after the last (or when the request failed).
    chunks: mpsc::Receiver<ChunkMsg>,
    /// The result of `begin`.
    begun: oneshot::Sender<Result<(), PdError>>,
    /// The announcement's result (`None` until known).
    announced: tokio::sync::watch::Receiver<Option<bool>>,
}

/// Begins the transfer, writes one rank's chunks as they come, then finishes (`KvReady`),
/// or fails (`KvFailed`).
async fn rank_sender(s: Arc<Inner>, job: RankJob) {
    rank_sender_inner(&s, job).await;
    s.work_done();
}

async fn rank_sender_inner(s: &Inner, job: RankJob) {
    let RankJob {
        sender,
        spec,
        tokens,
        chunks: mut rx,
        begun,
        mut announced,
    } = job;
    let mut t = match sender.begin(&spec, &tokens).await {
        Ok(t) => {
            let _ = begun.send(Ok(()));
            t
        }
        Err(e) => {
            // `begin` reported KvFailed.
            s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
            let _ = begun.send(Err(e));
            return;
        }
    };
    // The receiver's confirmation is asked for now, and comes back while the prefill runs
    // (`prepare_finish`): the finish after the last write waits for nothing.
    if t.prepare_finish().await.is_err() {
        s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
        return;
    }
    while let Some((i, data)) = rx.recv().await {
        // A write the receiver's held copy or MLA send-once spares is no operation.
        let writes = t.needs(i);
        s.busy.enter();
        s.write_busy.enter();
        let r = t.send_chunk_from(i, data.region(), data.offset()).await;
        // The transfer returned: nothing reads the slot any more, it may be reused.
        drop(data);
        s.write_busy.leave();
        s.busy.leave();
        tracing::debug!(target: TL, stage = "sender.chunk_landed", id = t.req_id(), chunk = i);
        if let Err(e) = r {
            tracing::warn!(req_id = t.req_id(), chunk = i, "KV write failed: {e}");
            s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
            return;
        }
        s.counts.kv_writes.fetch_add(u64::from(writes), Relaxed);
    }
    if !told_decoder(s, &mut announced).await {
        s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
        t.cancel("the decoder was not told about the transfer (announcement failed)")
            .await;
        return;
    }
    let id = t.req_id().to_string();
    s.busy.enter();
    let began = Instant::now();
    let r = t.finish().await;
    s.counts
        .kv_finish_ns
        .fetch_add(began.elapsed().as_nanos() as u64, Relaxed);
    s.counts.kv_finishes.fetch_add(1, Relaxed);
    s.busy.leave();
    tracing::debug!(target: TL, stage = "sender.finished", id = %id);
    match r {
        Ok(sum) => {
            s.counts.kv_transfers_ok.fetch_add(1, Relaxed);
            s.counts.kv_bytes_sent.fetch_add(sum.bytes, Relaxed);
        }
        Err(e) => {
            tracing::warn!(req_id = %id, "KV transfer failed at finish: {e}");
            s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
        }
    }
}

/// Whether the decoder acknowledged the announcement of the transfer: `KvReady` comes only
/// after that (long done by then: it started with the prefill). A sender gone without an
/// answer counts as a failure.
async fn told_decoder(
    s: &Inner,
    announced: &mut tokio::sync::watch::Receiver<Option<bool>>,
) -> bool {
    tokio::time::timeout(s.cfg.announce_timeout, announced.wait_for(Option::is_some))
        .await
        .ok()
        .and_then(|r| r.ok().and_then(|v| *v))
        .unwrap_or(false)
}
