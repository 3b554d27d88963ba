//! Prefill and decode between different TP sizes ([`EngineConfig::push`]): the prefill's
//! KV, computed in the decoder's split, cut into the plan's parts; and on the decoder, the
//! parts of a chunk placed into each rank's chunk.
//!
//! The model's KV is defined per rank of one split, so the reference engine computes it in
//! the decoder's split (the colocated engine runs that split too); each part then holds
//! exactly the bytes the prefiller rank that sends it holds for those heads, which
//! [`PushPlan::part_of_decoder_chunk`] and [`PushPlan::pack`] agree on (`push_plan`'s
//! property test).
//!
//! [`EngineConfig::push`]: super::config::EngineConfig::push

use super::error::SimError;
use crate::chunk_memory::ChunkSlot;
use crate::model::{Model, SeqState};
use kvbridge_pd::PushPlan;

/// Computes one chunk (`prefixes`, one per token) in the decoder's split, absorbs it into
/// `state`, and writes each part of it into its lane's slot (`slots[lane]`).
pub(super) fn fill_parts(
    m: &Model,
    plan: &PushPlan,
    state: &mut SeqState,
    prefixes: &[u64],
    slots: &[ChunkSlot],
) -> Result<(), SimError> {
    let t = prefixes.len() as u64;
    let len = m.spec.chunk_bytes(t as u32) as usize;
    let mut chunks: Vec<Vec<u8>> = (0..m.world_size).map(|_| vec![0u8; len]).collect();
    let mut outs: Vec<&mut [u8]> = chunks.iter_mut().map(Vec::as_mut_slice).collect();
    m.fill_and_absorb(state, &mut outs, prefixes);
    let mut packed = Vec::new();
    for (part, slot) in plan.parts().iter().zip(slots) {
        packed.resize(plan.part_bytes(part, t) as usize, 0);
        let chunk = &chunks[part.decoder_rank as usize];
        plan.part_of_decoder_chunk(part, t, chunk, &mut packed)
            .map_err(|e| SimError::Internal(format!("packing lane {}: {e}", part.lane)))?;
        slot.write_at(0, &packed);
    }
    Ok(())
}

/// Every decoder rank's chunk of `t` tokens, placed from the parts that landed
/// (`parts[lane]`).
pub(super) fn place_parts(
    plan: &PushPlan,
    t: u64,
    parts: &[&[u8]],
) -> Result<Vec<Vec<u8>>, SimError> {
    (0..plan.decoder().tp_size)
        .map(|d| {
            let refs: Vec<&[u8]> = plan
                .parts_into(d)
                .iter()
                .map(|p| parts.get(p.lane as usize).copied().unwrap_or_default())
                .collect();
            let mut out = vec![0u8; plan.decoder_chunk_bytes(t) as usize];
            plan.unpack(d, t, &refs, &mut out)
                .map_err(|e| SimError::Internal(format!("placing decoder rank {d}: {e}")))?;
            Ok(out)
        })
        .collect()
}
