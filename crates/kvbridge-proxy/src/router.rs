//! A pool's routing state: its policy ([`crate::routing`]) and what the policy knows of the
//! workers' caches (the KV-events index and its subscribers, or the approximate trees).

use std::sync::Arc;

use crate::config::Config;
use crate::kv_events_sub::{KvEventsSubscribers, SubLimits};
use crate::kv_index::KvIndex;
use crate::pool::Role;
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

/// The router of the `role` pool under `cfg`: its trees (`cache-aware`), or its index and
/// the subscribers that feed it (`kv-events`, when the pool's endpoints are configured;
/// least-loaded without). Spawns the subscribers: call within the runtime.
pub fn for_pool(cfg: &Config, role: Role) -> PoolRouter {
    let (workers, endpoints) = match role {
        Role::Prefill => (cfg.prefillers.len(), &cfg.kv_events.prefiller_endpoints),
        Role::Decode => (cfg.decoders.len(), &cfg.kv_events.decoder_endpoints),
    };
    let mut r = PoolRouter {
        policy: cfg.routing,
        weights: cfg.kv_events.weights(),
        params: cfg.cache_aware,
        ..Default::default()
    };
    match cfg.routing {
        RoutingPolicy::LeastLoaded => {}
        RoutingPolicy::CacheAware => {
            r.trees = Some(PrefixTrees::new(workers, cfg.cache_aware.max_tree_pieces));
        }
        RoutingPolicy::KvEvents if endpoints.is_empty() => {
            tracing::warn!(
                role = role.as_str(),
                "--routing kv-events without KV-events endpoints: this pool routes least-loaded"
            );
            r.policy = RoutingPolicy::LeastLoaded;
        }
        RoutingPolicy::KvEvents => {
            let index = Arc::new(KvIndex::new(workers, cfg.kv_events.max_blocks_per_worker));
            r.subscribers = Some(crate::kv_events_sub::spawn(
                endpoints.iter().cloned().enumerate().collect(),
                cfg.kv_events.topic.as_bytes().to_vec(),
                index.clone(),
                SubLimits::default(),
            ));
            r.index = Some(index);
        }
    }
    r
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
