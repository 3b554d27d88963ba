//! Decode role: which received PD request holds a prompt's KV, and one decode request's
//! hold on it.

use super::error::SimError;
use super::request::{Api, GenRequest, HANDOFF_KEY};
use super::state::{lock, Inner};
use crate::model;
use crate::timeline::TARGET as TL;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// Decode role: the PD request holding this prompt's KV, and how many of the request's
/// tokens it covers (a completion's decode prompt is the prefill prompt plus the first
/// token; a chat's is the prefill prompt itself), claimed for this request.
///
/// With a handoff id (`kv_transfer_params.lmcache.pd_handoff_id`) the request is taken by
/// id, and only if its chunk keys, which its sender computed over the tokens it sent the KV
/// of ([`kvbridge_pd::chunk_keys`]: model, world size, rank, dtype, layout and every token
/// up to each chunk's end), equal the keys of this decode prompt's tokens on every
/// receiving rank: the id alone is the client's word, the keys prove the KV is this
/// prompt's. Without an id, with one this decoder does not hold, or with one whose keys
/// differ, the announcement table is searched by the prompt's key ([`crate::announce`]). Either way the request
/// need not be complete: its chunks are waited for, each with the retrieve deadline, and a
/// transfer that ends before its last chunk lands fails the decode at once
/// (`kv_transfer_failed`). A request is claimed once; a second decode naming it is refused.
pub(super) fn find_kv(
    s: &Arc<Inner>,
    req: &GenRequest,
) -> Result<Option<(Claim, usize)>, SimError> {
    let n = req.tokens.len();
    let order = match req.api {
        Api::Completions => [n.saturating_sub(1), n],
        Api::Chat => [n, n.saturating_sub(1)],
    };
    let ranks = s.cfg.receiving_ranks();
    if let Some(id) = &req.handoff {
        if let Some(why) = s.receivers.first().and_then(|rx| rx.ended(id)) {
            s.counts.kv_retrieve_failed.fetch_add(1, Relaxed);
            return Err(SimError::KvEnded(format!(
                "the KV transfer of request {id} ended before it completed: {why}"
            )));
        }
        let held: Option<Vec<Vec<u64>>> =
            s.receivers[..ranks].iter().map(|rx| rx.keys(id)).collect();
        if let Some(held) = held {
            for m in order {
                if m == 0 {
                    continue;
                }
                let matches = held.iter().enumerate().all(|(r, keys)| {
                    let want = kvbridge_pd::chunk_keys(
                        &s.model.name,
                        s.model.world_size,
                        r as u32,
                        &s.model.spec,
                        &req.tokens[..m],
                    );
                    want.len() == keys.len() && want.iter().zip(keys).all(|(w, k)| w.hash == *k)
                });
                if matches {
                    let c = claim(s, id)?;
                    s.announced.remove(model::tokens_key(&req.tokens[..m]), id);
                    tracing::debug!(target: TL, stage = "decode.kv_by_id", id = %id);
                    return Ok(Some((c, m)));
                }
            }
            // The id names KV that is not this prompt's (or not of this model: the keys
            // name it): the id is not trusted, and the request is looked up as if it had
            // come without one.
            tracing::warn!(req_id = %id, "`kv_transfer_params.{HANDOFF_KEY}` names KV whose chunk keys are not this prompt's; ignoring it");
        }
        // Not held here (or not this prompt's): fall back to the announcement.
    }
    for m in order {
        if m == 0 {
            continue;
        }
        let key = model::tokens_key(&req.tokens[..m]);
        for id in s.announced.candidates(key, m as u64) {
            // A request whose pages are held (still landing or complete) can be claimed:
            // its chunks are waited for. One that ended is skipped (its announcement goes).
            let held = s.receivers[..ranks]
                .iter()
                .all(|rx| rx.chunks_landed(&id).is_some());
            if held {
                if let Ok(c) = claim(s, &id) {
                    s.announced.remove(key, &id);
                    return Ok(Some((c, m)));
                }
            }
            if s.receivers[0].ended(&id).is_some() {
                s.announced.remove(key, &id);
            }
        }
    }
    Ok(None)
}

/// Decode role: marks request `id`'s KV as taken by one decode request (until the returned
/// [`Claim`] is dropped).
fn claim(s: &Arc<Inner>, id: &str) -> Result<Claim, SimError> {
    if lock(&s.claimed).insert(id.to_string()) {
        Ok(Claim {
            s: s.clone(),
            id: id.to_string(),
            armed: true,
        })
    } else {
        Err(SimError::BadRequest(format!(
            "the KV of request {id} is already taken by another decode request"
        )))
    }
}

/// Decode role: one decode request's hold on a PD request's KV. Whatever ends the decode
/// request, the id is unclaimed when this drops. Dropped while still armed (the decode
/// failed, or its future was dropped because the client went away or the proxy gave up),
/// it also cancels the PD request on every receiving rank, so its pages return now (once no
/// write can land in them) rather than when the receiver's TTL runs out.
pub(super) struct Claim {
    s: Arc<Inner>,
    pub(super) id: String,
    armed: bool,
}

impl Claim {
    /// The PD request's pages have been released by their owner: nothing to cancel.
    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.armed {
            for rx in &self.s.receivers[..self.s.cfg.receiving_ranks()] {
                // An error is a request the receiver no longer holds: nothing to return.
                let _ = rx.cancel(&self.id);
            }
            tracing::debug!(req_id = %self.id, "decode request ended before its KV was released: cancelled");
        }
        lock(&self.s.claimed).remove(&self.id);
    }
}
