//! The engine's use of its prefix cache: the chunk keys of a prompt, the chunks stored as
//! they are computed or received, and the KV events each change publishes.

use super::state::{lock, Inner};
use crate::model::SeqState;
use crate::prefix_cache::{NewChunk, PrefixCache};
use std::time::{SystemTime, UNIX_EPOCH};

impl Inner {
    /// The chain keys of the whole chunks of `tokens` (rank 0's PD chunk keys).
    pub(super) fn cache_keys(&self, tokens: &[u32]) -> Vec<u64> {
        let c = self.model.spec.chunk_tokens.max(1) as usize;
        let whole = tokens.len() / c * c;
        kvbridge_pd::chunk_keys(
            &self.model.name,
            self.model.world_size,
            0,
            &self.model.spec,
            &tokens[..whole],
        )
        .into_iter()
        .map(|k| k.hash)
        .collect()
    }

    /// Changes the prefix cache with `f` and publishes what changed, as one batch.
    pub(super) fn update_cache(&self, f: impl FnOnce(&mut PrefixCache)) {
        let mut cache = lock(&self.prefix_cache);
        f(&mut cache);
        let events = cache.take_events();
        if let (Some(p), false) = (&self.kv_events, events.is_empty()) {
            let ts = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            p.publish(&kvbridge::proto::kv_events::KvEventBatch {
                ts,
                events,
                data_parallel_rank: None,
            });
        }
    }

    /// Stores the whole chunks of `tokens` after the first `from` (whose keys are `keys`),
    /// with `states[i]` the state after chunk `from + i`.
    pub(super) fn cache_chunks(
        &self,
        tokens: &[u32],
        keys: &[u64],
        from: usize,
        states: &[SeqState],
    ) {
        let c = self.model.spec.chunk_tokens.max(1) as usize;
        let chunks: Vec<NewChunk<'_>> = states
            .iter()
            .enumerate()
            .filter_map(|(i, st)| {
                let k = from + i;
                Some(NewChunk {
                    key: *keys.get(k)?,
                    tokens: tokens.get(k * c..(k + 1) * c)?,
                    state: *st,
                })
            })
            .collect();
        let parent = from.checked_sub(1).and_then(|i| keys.get(i).copied());
        self.update_cache(|cache| cache.insert(parent, &chunks));
    }
}
