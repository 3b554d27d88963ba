//! A pool's routing state: its policy ([`crate::routing`]) and what the policy knows of the
//! workers' caches (the KV-events index and its subscribers, or the approximate trees).

use std::sync::Arc;

use crate::kv_events_sub::KvEventsSubscribers;
use crate::kv_index::KvIndex;
use crate::prefix_tree::{pieces, PrefixTrees};
use crate::routing::{
    cache_aware, kv_events, least_loaded, CacheAwareParams, Candidate, KvEventsWeights,
    RoutingPolicy,
};

/// What a policy needs of a request's prompt.
#[derive(Debug, Clone, Default)]
pub struct PromptKey {
    /// The prompt's token ids, when the request gives them (a completion's `prompt` array):
    /// what `kv-events` matches. Without them, `kv-events` ranks by load alone.
    pub tokens: Option<Vec<u32>>,
    /// Pieces of the prompt's text (`messages` or `prompt` as sent): what `cache-aware`
    /// matches.
    pub pieces: Vec<u64>,
}

impl PromptKey {
    /// The key of a prompt given as raw JSON (`messages` or `prompt`).
    pub fn from_raw(raw: Option<&str>) -> PromptKey {
        let Some(raw) = raw else {
            return PromptKey::default();
        };
        PromptKey {
            tokens: serde_json::from_str::<Vec<u32>>(raw).ok(),
            pieces: pieces(raw.as_bytes()),
        }
    }
}

/// A pool's policy and cache knowledge.
#[derive(Debug, Default)]
pub struct PoolRouter {
    /// The policy.
    pub policy: RoutingPolicy,
    /// `kv-events` weights.
    pub weights: KvEventsWeights,
    /// `cache-aware` thresholds.
    pub params: CacheAwareParams,
    /// The workers' reported blocks (`kv-events`).
    pub index: Option<Arc<KvIndex>>,
    /// The routed prompts (`cache-aware`).
    pub trees: Option<PrefixTrees>,
    /// The KV-events subscribers feeding `index` (stopped when dropped).
    pub subscribers: Option<KvEventsSubscribers>,
}

impl PoolRouter {
    /// Chooses among `cands` (workers that admit the request) for `prompt`.
    pub fn choose(&self, cands: &[Candidate], prompt: &PromptKey) -> Option<usize> {
        match self.policy {
            RoutingPolicy::LeastLoaded => least_loaded(cands),
            RoutingPolicy::KvEvents => {
                let (Some(index), Some(tokens)) = (&self.index, &prompt.tokens) else {
                    return least_loaded(cands);
                };
                let scored: Vec<Candidate> = cands
                    .iter()
                    .map(|c| Candidate {
                        matched: index.matched_tokens(c.index, tokens) as u64,
                        ..*c
                    })
                    .collect();
                kv_events(&scored, tokens.len() as u64, &self.weights)
            }
            RoutingPolicy::CacheAware => {
                let Some(trees) = &self.trees else {
                    return least_loaded(cands);
                };
                let scored: Vec<Candidate> = cands
                    .iter()
                    .map(|c| Candidate {
                        matched: trees.matched(c.index, &prompt.pieces) as u64,
                        cached: trees.size(c.index) as u64,
                        ..*c
                    })
                    .collect();
                cache_aware(&scored, prompt.pieces.len() as u64, &self.params)
            }
        }
    }

    /// Notes that `prompt` went to worker `w`.
    pub fn routed(&self, w: usize, prompt: &PromptKey) {
        if let Some(t) = &self.trees {
            t.insert(w, &prompt.pieces);
        }
    }

    /// Forgets what is known of worker `w`'s cache (it was ejected: it may restart empty).
    pub fn forget(&self, w: usize) {
        if let Some(i) = &self.index {
            i.forget(w);
        }
        if let Some(t) = &self.trees {
            t.forget(w);
        }
    }
}
