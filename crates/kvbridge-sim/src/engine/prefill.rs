//! The mock accelerator's prefill, the same for every role: a prompt computed one step of
//! whole pages at a time, each step's KV existing no earlier than the cost model allows,
//! the chunks the prefix cache holds free.

use super::error::SimError;
use super::state::{lock, Inner};
use super::tp_push::fill_parts;
use crate::chunk_memory::ChunkSlot;
use crate::model::SeqState;
use crate::timeline::TARGET as TL;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Hands chunk `index`'s bytes to one rank's sender task.
pub(super) type ChunkTx = mpsc::Sender<ChunkMsg>;

/// A chunk's index and bytes.
pub(super) type ChunkMsg = (u64, ChunkSlot);

/// Longest wait for a free chunk slot: slots come back as transfers return, each bounded by
/// the PD sender's step deadline.
const CHUNK_MEMORY_WAIT: Duration = Duration::from_secs(60);

/// Prefills `tokens` on the simulated accelerator, one step (of whole pages) at a time; the
/// pages of every rank go to `send[rank]` as soon as their step ends.
///
/// The leading chunks the prefix cache holds cost nothing in the cost model: a local
/// prefill starts after them; a prefill that sends its KV still produces their bytes (a
/// real engine copies them out of its cache) but they are ready at once. The chunks
/// computed are stored in the cache.
pub(super) async fn prefill(
    s: &Arc<Inner>,
    tokens: &[u32],
    send: Option<&[ChunkTx]>,
) -> Result<SeqState, SimError> {
    let _accel = s.accel.lock().await;
    let start = tokio::time::Instant::now();
    let model = s.model.clone();
    let c = model.spec.chunk_tokens.max(1) as usize;
    let keys = s.cache_keys(tokens);
    let hit = lock(&s.prefix_cache).lookup(&keys);
    let cached = hit.chunks * c;
    s.counts
        .prefill_tokens_computed
        .fetch_add((tokens.len() - cached) as u64, Relaxed);
    s.counts
        .prefix_cache_hit_tokens
        .fetch_add(cached as u64, Relaxed);
    // Per prefill, for attributing prefill tokens to routing (`RUST_LOG=kvbridge::prefix=debug`).
    tracing::debug!(target: "kvbridge::prefix", engine = Arc::as_ptr(s) as usize,
        role = ?s.cfg.role, tokens = tokens.len(), last = tokens.last().copied(), cached, sending = send.is_some(), "prefill");
    // Without a transfer, the cached chunks need not be produced at all.
    let (skip, mut state) = match (send, hit.state) {
        (None, Some(st)) => (cached, st),
        _ => (0, model.start()),
    };
    let pages = tokens.len().div_ceil(c);
    let per_step = s.cfg.cost.pages_per_step(model.spec.chunk_tokens);
    let mut done = skip as u64;
    // The state after each whole chunk computed past the cached ones, for the cache.
    let mut computed: Vec<SeqState> = Vec::new();
    // This step's pages, computed but not yet existing for the cost model: one slot per rank.
    let mut step: Vec<(u64, Vec<ChunkSlot>)> = Vec::with_capacity(per_step);
    for (j, part) in tokens[skip..].chunks(c).enumerate() {
        let i = skip / c + j;
        if step.is_empty() {
            jit_wait(s, start, (tokens.len(), cached), i, c, per_step).await;
        }
        let (m, part_v) = (model.clone(), part.to_vec());
        // Sending: every rank's KV is computed straight into its registered chunk memory,
        // and moved from there. Colocated: into this thread's scratch buffers.
        let mut slots = Vec::new();
        if send.is_some() {
            for (mem, spec) in s.chunk_memory.iter().zip(&s.lane_specs) {
                let len = spec.chunk_bytes(part.len() as u32) as usize;
                let slot = mem
                    .take(len, CHUNK_MEMORY_WAIT)
                    .await
                    .map_err(|e| SimError::Internal(e.to_string()))?;
                slots.push(slot);
            }
        }
        // At the lowest priority (see `background`): on 2 cores the transfer of the previous
        // chunk and its notifications ran 10-20% faster in the demo (docs/engine.md).
        let computing = Instant::now();
        // Parts to cut out of the decoder's split, when lanes are not whole ranks.
        let parts = s.cfg.push.clone().filter(|_| !s.cfg.lanes_are_ranks());
        let (st, chunks) = crate::background::run("kvb-prefill", move || {
            let mut st = state;
            let p = m.prefixes(st.prefix, &part_v);
            if slots.is_empty() {
                m.compute_and_absorb(&mut st, &p);
            } else if let Some(plan) = &parts {
                fill_parts(&m, plan, &mut st, &p, &slots)?;
            } else {
                let mut rows: Vec<Vec<u8>> = vec![Vec::new(); slots.len()];
                let mut outs: Vec<_> = slots
                    .iter()
                    .zip(rows.iter_mut())
                    .map(|(s, r)| s.sink(r))
                    .collect();
                m.fill_and_absorb(&mut st, &mut outs, &p);
            }
            Ok::<_, SimError>((st, slots))
        })
        .await
        .map_err(|e| SimError::Internal(format!("prefill task: {e}")))??;
        let per_token = computing.elapsed().as_nanos() * 1000 / part.len().max(1) as u128;
        s.fill_ps_per_token.store(per_token as u64, Relaxed);
        state = st;
        done += part.len() as u64;
        if i >= hit.chunks && part.len() == c {
            computed.push(state);
        }
        let stage = if send.is_some() {
            "prefill.chunk_computed"
        } else {
            "local.chunk_computed"
        };
        tracing::debug!(target: TL, stage, chunk = i);
        step.push((i as u64, chunks));
        if step.len() < per_step && i + 1 < pages {
            continue;
        }
        // The cost model: this step's KV exists no earlier than the accelerator would have it.
        let charged = done.saturating_sub(cached as u64);
        tokio::time::sleep_until(start + s.cfg.cost.prefill_time(charged)).await;
        for (i, chunks) in step.drain(..) {
            let stage = if send.is_some() {
                "prefill.chunk_ready"
            } else {
                "local.chunk_ready"
            };
            tracing::debug!(target: TL, stage, chunk = i);
            if let Some(send) = send {
                for (tx, chunk) in send.iter().zip(chunks) {
                    // A rank whose transfer failed has reported KvFailed and stopped listening.
                    let _ = tx.send((i, chunk)).await;
                }
            }
        }
    }
    s.cache_chunks(tokens, &keys, hit.chunks, &computed);
    Ok(state)
}

/// Waits until the mock accelerator should start computing the step that begins with chunk
/// `first`: the cost model's time for the step's KV to exist, less the time its tokens take
/// to compute (at the last chunk's rate, with a quarter and a timer tick to spare).
///
/// A real accelerator computes KV in its own memory and takes nothing from the host; this
/// one fills host memory, and a step computed as soon as the previous one was handed over
/// filled the next chunk while the previous chunk was being transferred, two streams through
/// the same memory on a 2-core host. Computed as late as the step allows, it overlaps the
/// cost model's wait instead. Both the disaggregated and the colocated prefill wait the
/// same, and the step's KV exists no later than before unless a compute runs more than a
/// quarter over the last one's.
/// `tokens` is the prompt's length and how many of its leading tokens were cached (not
/// charged).
async fn jit_wait(
    s: &Inner,
    start: tokio::time::Instant,
    (tokens, cached): (usize, usize),
    first: usize,
    chunk_tokens: usize,
    per_step: usize,
) {
    let end = ((first + per_step) * chunk_tokens).min(tokens);
    let step_tokens = (end - first * chunk_tokens) as u64;
    let ready = start + s.cfg.cost.prefill_time(end.saturating_sub(cached) as u64);
    let at = compute_start(ready, s.fill_ps_per_token.load(Relaxed), step_tokens);
    // Only a wait in the future: a zero-length timer still waits for the next tick.
    if let Some(at) = at.filter(|at| *at > tokio::time::Instant::now()) {
        tokio::time::sleep_until(at).await;
    }
}

/// When to start computing a step of `step_tokens` tokens whose KV the cost model has exist
/// at `ready`, at `ps_per_token` picoseconds per token (the last chunk's rate): early by that
/// time, a quarter more and a timer tick (tokio's timers fire on 1 ms ticks). `None`, to
/// start at once, while the rate is not known.
fn compute_start(
    ready: tokio::time::Instant,
    ps_per_token: u64,
    step_tokens: u64,
) -> Option<tokio::time::Instant> {
    if ps_per_token == 0 {
        return None;
    }
    let compute = Duration::from_nanos(ps_per_token.saturating_mul(step_tokens) / 1000);
    ready.checked_sub(compute * 5 / 4 + Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_computed_as_late_as_its_ready_time_allows() {
        let ready = tokio::time::Instant::now() + Duration::from_secs(1);
        // The rate not known yet: at once.
        assert_eq!(compute_start(ready, 0, 256), None);
        // 4 µs per token, 256 tokens: 1.024 ms of compute, started 1.28 ms + a tick early.
        let at = compute_start(ready, 4_000_000, 256).unwrap();
        assert_eq!(
            ready - at,
            Duration::from_micros(1280) + Duration::from_millis(1)
        );
        // Twice the tokens, twice the compute.
        let at2 = compute_start(ready, 4_000_000, 512).unwrap();
        assert_eq!(at - at2, Duration::from_micros(1280));
        // A step that cannot be computed in time starts at once (before now).
        let soon = tokio::time::Instant::now() + Duration::from_micros(100);
        let late = compute_start(soon, 4_000_000, 256).unwrap();
        assert!(late < tokio::time::Instant::now());
    }
}
