//! Decode role: a request's KV taken in as it lands (digested in place, chunk by chunk),
//! continued over the decode prompt, then verified off the path to the first token and
//! released.

use super::claim::Claim;
use super::error::SimError;
use super::state::{lock, Consumed, Inner};
use super::tp_push::place_parts;
use crate::model::{Model, SeqState};
use crate::timeline::TARGET as TL;
use kvbridge_pd::ChunkRef;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// Decode role: starts digesting request `id`'s KV as its chunks land (once per request).
pub(super) fn start_consumer(s: &Arc<Inner>, id: String, tokens: u64) {
    let mut c = lock(&s.consumers);
    // Forget consumers of requests the buffer no longer holds (their decode never came).
    c.retain(|k, h| !h.is_finished() || s.receivers[0].chunks_landed(k).is_some());
    if c.contains_key(&id) {
        return;
    }
    let h = tokio::spawn(consume(s.clone(), id.clone(), tokens));
    c.insert(id, h);
}

/// Decode role: the digest of request `id`'s KV (every rank), computed chunk by chunk, in
/// place, as each chunk lands on every receiving rank. Each chunk waits at most the
/// retrieve deadline. The pages stay held until the request's release.
async fn consume(s: Arc<Inner>, id: String, tokens: u64) -> Result<Consumed, SimError> {
    let model = s.model.clone();
    let n = model.spec.chunks_for(tokens);
    let ranks = s.cfg.receiving_ranks();
    let mut state = model.start();
    let mut digests = Vec::with_capacity(n as usize);
    let mut bytes = 0u64;
    for i in 0..n {
        let mut held: Vec<ChunkRef> = Vec::with_capacity(ranks);
        for rx in &s.receivers[..ranks] {
            held.push(rx.chunk(&id, i, s.cfg.retrieve_timeout).await?);
        }
        tracing::debug!(target: TL, stage = "decode.chunk_landed", id = %id, chunk = i);
        let t = model.spec.tokens_in_chunk(i, tokens) as usize;
        let (m, ws) = (model.clone(), model.world_size as usize);
        // Parts to place into the decoder's ranks, when lanes are not whole ranks.
        let parts = s.cfg.push.clone().filter(|_| !s.cfg.lanes_are_ranks());
        // The last chunk's digest is on the path to the first token and the prefill is over:
        // use two cores for it, unless it is short (a second thread costs ~0.1 ms to start
        // here, more than it saves on fewer than 64 tokens: 2 MiB in the demo). Earlier
        // chunks leave the other core to the prefiller.
        let threads = if i + 1 == n && t >= 64 { 2 } else { 1 };
        // The simulated accelerator's work: at the lowest priority, as the prefill's.
        let (st, d, b) = crate::background::run("kvb-absorb", move || {
            let mut st = state;
            // The bytes are copied out of the receive buffer before they are hashed: a peer
            // may write the pages meanwhile (`ChunkRef` says why). Into pooled buffers, so a
            // chunk allocates nothing once the pool is warm.
            let mut copies = crate::model::scratch_take();
            copies.resize_with(copies.len().max(held.len()), Vec::new);
            for (c, out) in held.iter().zip(copies.iter_mut()) {
                c.copy_into(out);
            }
            let k = held.len();
            drop(held);
            let placed = match &parts {
                Some(plan) => {
                    let lanes: Vec<&[u8]> = copies[..k].iter().map(Vec::as_slice).collect();
                    place_parts(plan, t as u64, &lanes)?
                }
                None => Vec::new(),
            };
            // MLA send-once: rank 0's copy stands for every rank (the KV is identical).
            let refs: Vec<&[u8]> = if placed.is_empty() {
                (0..ws).map(|r| copies[r.min(k - 1)].as_slice()).collect()
            } else {
                placed.iter().map(Vec::as_slice).collect()
            };
            let b = refs.iter().map(|c| c.len() as u64).sum::<u64>();
            let d = m.absorb_kv_par(&mut st, &refs, t, threads);
            drop(refs);
            crate::model::scratch_give_back(copies);
            Ok::<_, SimError>((st, d, b))
        })
        .await
        .map_err(|e| SimError::Internal(format!("decode task: {e}")))??;
        state = st;
        digests.push(d);
        bytes += b;
        tracing::debug!(target: TL, stage = "decode.chunk_digested", id = %id, chunk = i);
    }
    let c = &s.counts;
    c.kv_requests_consumed.fetch_add(1, Relaxed);
    c.kv_chunks_consumed.fetch_add(n, Relaxed);
    c.kv_bytes_needed.fetch_add(
        model.spec.prompt_bytes(tokens) * s.cfg.decoding_ranks() as u64,
        Relaxed,
    );
    Ok(Consumed {
        state,
        digests,
        bytes,
    })
}

/// Decode role: request `id`'s KV, digested as it landed (or now, if its grant was missed),
/// continued over `tokens[m..]`; every chunk is then verified in place, off the path to the
/// first token, and the pages are released. `claim` is the request's hold on `id`: dropped
/// armed (a failure here, or this future dropped) it cancels the request.
pub(super) async fn receive(
    s: &Arc<Inner>,
    tokens: &[u32],
    mut claim: Claim,
    m: usize,
) -> Result<SeqState, SimError> {
    let id = claim.id.clone();
    let id = id.as_str();
    s.counts.kv_requests_received.fetch_add(1, Relaxed);
    tracing::debug!(target: TL, stage = "decode.kv_found", id);
    let t0 = Instant::now();
    let ranks = s.cfg.receiving_ranks();
    let consumer = lock(&s.consumers).remove(id);
    let consumed = match consumer {
        Some(h) => h
            .await
            .map_err(|e| SimError::Internal(format!("decode task: {e}")))
            .and_then(|r| r),
        None => consume(s.clone(), id.to_string(), m as u64).await,
    };
    let Consumed {
        state: kv,
        digests,
        bytes,
    } = match checked_kv(consumed, id, m) {
        Ok(kv) => kv,
        Err(e) => {
            drop(claim); // armed: cancels the request on every rank, and unclaims it
            s.counts.kv_retrieve_failed.fetch_add(1, Relaxed);
            return Err(e);
        }
    };
    // On the path to the first token: only the prompt's prefix hashes and the token after
    // it, if any (a completion's decode prompt ends with the prefill's first token: one
    // token's KV, tens of microseconds); the KV's digest is done. Cheap enough to do here
    // rather than pay a hop to a blocking thread.
    let model = &s.model;
    let prefixes = model.prefixes(model.start().prefix, &tokens[..m]);
    let mut state = kv;
    if let Some(&p) = prefixes.last() {
        state.prefix = p;
    }
    for &t in &tokens[m..] {
        model.extend(&mut state, t);
    }
    s.counts
        .kv_load_ns
        .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
    tracing::debug!(target: TL, stage = "decode.kv_loaded", id);
    // Off the path: the pages return once the request is complete (the KV was read when
    // it was digested; nothing reads it again). The decode may have started before the
    // sender's `finish` (every chunk had landed, which is all it reads). A transfer that
    // ended instead has had its pages returned by the receiver.
    s.work_started();
    let (s2, id2) = (s.clone(), id.to_string());
    let received: Vec<u32> = tokens[..m].to_vec();
    tokio::spawn(async move {
        for rx in &s2.receivers[..ranks] {
            let r = match rx.wait_complete(&id2, s2.cfg.retrieve_timeout).await {
                Ok(()) => rx.release(&id2),
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                tracing::warn!(req_id = %id2, "releasing received KV: {e}");
            }
        }
        claim.disarm();
        drop(claim);
        // Then every chunk is checked (a real decoder would not do this; here it proves the
        // transfer): the digest of each position's KV as the decoder read it against the
        // digest of the KV the model says the prompt must have, generated in registers. A
        // pass of compute and no memory traffic (comparing the pages themselves was a second
        // read of every byte beside the transfers). At the lowest CPU priority: on a small
        // host it would otherwise take a core from the first token's way to the client.
        let s3 = s2.clone();
        let r = crate::background::run("kvb-verify", move || {
            check_received(&s3.model, &prefixes, &digests)
        })
        .await;
        match r {
            Ok((chunks, mismatches, states)) => {
                if !states.is_empty() {
                    let keys = s2.cache_keys(&received);
                    s2.cache_chunks(&received, &keys, 0, &states);
                    tracing::debug!(target: "kvbridge::prefix", engine = Arc::as_ptr(&s2) as usize,
                        tokens = received.len(), last = received.last().copied(), chunks = states.len(), "received");
                }
                s2.counts.kv_chunks_received.fetch_add(chunks, Relaxed);
                s2.counts.kv_bytes_received.fetch_add(bytes, Relaxed);
                if mismatches > 0 {
                    tracing::error!(
                        req_id = %id2,
                        mismatches,
                        "received KV differs from the expected KV"
                    );
                    s2.counts.kv_mismatches.fetch_add(mismatches, Relaxed);
                }
            }
            Err(e) => {
                tracing::error!(req_id = %id2, "verification task failed: {e}");
                s2.counts.kv_mismatches.fetch_add(1, Relaxed);
            }
        }
        s2.work_done();
    });
    Ok(state)
}

/// The KV consumed for request `id`, checked to hold the decode prompt's `m` tokens; a
/// transfer that ended under us is said in the engine's own terms.
fn checked_kv(
    consumed: Result<Consumed, SimError>,
    id: &str,
    m: usize,
) -> Result<Consumed, SimError> {
    match consumed {
        Ok(c) if c.state.len == m as u64 => Ok(c),
        Ok(c) => Err(SimError::Internal(format!(
            "request {id} holds KV of {} tokens, the decode prompt has {m}",
            c.state.len
        ))),
        Err(SimError::Kv(pd)) => Err(SimError::KvEnded(format!(
            "the KV of request {id} did not arrive: {pd}"
        ))),
        Err(e) => Err(e),
    }
}

/// Checks every chunk of a received prompt: the digest of each position's KV as the decoder
/// read it (`digests`, per chunk and rank) against the digest of the KV the model says the
/// prompt (`prefixes`) must have. The chunks checked, the mismatches, and, when none, the
/// state after each whole chunk, for the prefix cache (KV received whole and right is KV
/// held).
fn check_received(
    model: &Model,
    prefixes: &[u64],
    digests: &[Vec<Vec<u64>>],
) -> (u64, u64, Vec<SeqState>) {
    let c = model.spec.chunk_tokens.max(1) as usize;
    let (mut chunks, mut mismatches) = (0u64, 0u64);
    for (i, p) in prefixes.chunks(c).enumerate() {
        for r in 0..model.world_size {
            chunks += 1;
            let held = digests.get(i).and_then(|d| d.get(r as usize));
            if !held.is_some_and(|h| model.digests_match(r, p, h)) {
                mismatches += 1;
            }
        }
    }
    let mut states = Vec::new();
    if mismatches == 0 {
        let mut st = model.start();
        for (p, d) in prefixes.chunks_exact(c).zip(digests) {
            model.chain_digests(&mut st, d, c);
            if let Some(&last) = p.last() {
                st.prefix = last;
            }
            states.push(st);
        }
    }
    (chunks, mismatches, states)
}
