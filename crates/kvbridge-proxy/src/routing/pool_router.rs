//! A pool's routing state: its policy ([`super::policy`]) and what the policy knows of the
//! workers' caches (the KV-events index and its subscribers, or the approximate trees).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use super::kv_index::KvIndex;
use super::policy::{
    cache_aware, kv_events, least_loaded, CacheAwareParams, Candidate, KvEventsWeights, Role,
    RoutingPolicy,
};
use super::prefix_tree::PrefixTrees;
use super::prompt_key::{estimated_tokens_of_pieces, PromptKey};
use super::routed_prefixes::{RoutedPrefixes, RoutedPrompt};
use crate::config::Config;
use crate::kv_events_sub::{KvEventsSubscribers, SubLimits};

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
            r.routed = Some(Arc::new(RoutedPrefixes::new(workers)));
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
    /// The prompts routed to each worker and still on it (`kv-events`): what it will hold
    /// before its events say so.
    pub routed: Option<Arc<RoutedPrefixes>>,
    /// The leading tokens every token-id prompt routed in this pool started with, and
    /// whether two of them differed (`kv-events`: what a cold worker is counted as holding,
    /// [`kv_events`]); `None` before the first.
    pub common: std::sync::Mutex<Option<(Vec<u32>, bool)>>,
    /// The KV-events subscribers feeding `index` (stopped when dropped).
    pub subscribers: Option<KvEventsSubscribers>,
    /// Routing decisions made: `[policy][matched]`, where `matched` is whether the chosen
    /// worker held part of the prompt.
    pub decisions: [[AtomicU64; 2]; 3],
}

/// A worker chosen by a pool's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chosen {
    /// Its index in the pool.
    pub index: usize,
    /// The prompt's leading tokens it holds, as the policy knows (`kv-events`: exact, whole
    /// blocks; `cache-aware`: whole pieces of the prompt as sent, in estimated tokens;
    /// `least-loaded`: 0), measured before this request is noted as routed to it.
    pub cached_tokens: u64,
}

const POLICIES: [RoutingPolicy; 3] = [
    RoutingPolicy::LeastLoaded,
    RoutingPolicy::CacheAware,
    RoutingPolicy::KvEvents,
];

/// Appends `kvbridge_proxy_routing_decisions_total{role,policy,matched}` of `pools`
/// (`(role, router)`).
pub fn render_decisions(out: &mut String, pools: &[(&str, &PoolRouter)]) {
    out.push_str(
        "# HELP kvbridge_proxy_routing_decisions_total Workers chosen, by pool, policy and          whether the chosen worker held part of the prompt.
         # TYPE kvbridge_proxy_routing_decisions_total counter
",
    );
    for (role, r) in pools {
        for (p, row) in POLICIES.iter().zip(&r.decisions) {
            for (m, v) in ["false", "true"].iter().zip(row) {
                let _ = writeln!(
                    out,
                    "kvbridge_proxy_routing_decisions_total{{role=\"{role}\",policy=\"{}\",matched=\"{m}\"}} {}",
                    p.as_str(),
                    v.load(Relaxed)
                );
            }
        }
    }
}

impl PoolRouter {
    /// Chooses among `cands` (workers that admit the request) for `prompt`.
    pub fn choose(&self, cands: &[Candidate], prompt: &PromptKey) -> Option<usize> {
        self.choose_scored(cands, prompt).map(|c| c.index)
    }

    /// [`PoolRouter::choose`], with what the chosen worker holds of the prompt; counts the
    /// decision.
    pub fn choose_scored(&self, cands: &[Candidate], prompt: &PromptKey) -> Option<Chosen> {
        let (chosen, policy) = self.score(cands, prompt);
        self.count(chosen, policy)
    }

    /// The least-loaded of `cands`, for a request routed without its prompt (nothing in the
    /// proxy needed it: least-loaded routing, decider off); counts the decision, unmatched,
    /// so that every choice shows in `/metrics` whatever the policy.
    pub fn choose_unkeyed(&self, cands: &[Candidate]) -> Option<Chosen> {
        let c = least_loaded(cands).map(|index| Chosen {
            index,
            cached_tokens: 0,
        });
        self.count(c, self.policy)
    }

    /// The choice [`PoolRouter::choose_scored`] makes, and the policy that made it (a pool
    /// without a view of the caches falls back to least-loaded), without counting it.
    pub fn score(
        &self,
        cands: &[Candidate],
        prompt: &PromptKey,
    ) -> (Option<Chosen>, RoutingPolicy) {
        match self.policy {
            RoutingPolicy::LeastLoaded => (
                least_loaded(cands).map(|index| Chosen {
                    index,
                    cached_tokens: 0,
                }),
                RoutingPolicy::LeastLoaded,
            ),
            RoutingPolicy::KvEvents => {
                let (Some(index), Some(tokens)) = (&self.index, &prompt.tokens) else {
                    let c = least_loaded(cands).map(|index| Chosen {
                        index,
                        cached_tokens: 0,
                    });
                    return (c, RoutingPolicy::KvEvents);
                };
                let block_size = index.block_size().unwrap_or(0);
                let scored: Vec<Candidate> = cands
                    .iter()
                    .map(|c| {
                        let reported = index.matched_tokens(c.index, tokens);
                        let queued = self
                            .routed
                            .as_ref()
                            .map_or(0, |r| r.matched_tokens(c.index, tokens, block_size));
                        Candidate {
                            matched: reported.max(queued) as u64,
                            cached: index.blocks(c.index) as u64,
                            ..*c
                        }
                    })
                    .collect();
                let common = self.common_prefix(tokens, block_size);
                let best = kv_events(&scored, tokens.len() as u64, common, &self.weights);
                tracing::debug!(target: "kvbridge::route", prompt = tokens.len(), common,
                    cands = ?scored.iter().map(|c| (c.index, c.matched, c.load(), c.cached)).collect::<Vec<_>>(),
                    chosen = ?best, "kv-events");
                (
                    best.map(|i| Chosen {
                        index: i,
                        cached_tokens: scored
                            .iter()
                            .find(|c| c.index == i)
                            .map_or(0, |c| c.matched),
                    }),
                    RoutingPolicy::KvEvents,
                )
            }
            RoutingPolicy::CacheAware => {
                let Some(trees) = &self.trees else {
                    let c = least_loaded(cands).map(|index| Chosen {
                        index,
                        cached_tokens: 0,
                    });
                    return (c, RoutingPolicy::CacheAware);
                };
                let scored: Vec<Candidate> = cands
                    .iter()
                    .map(|c| Candidate {
                        matched: trees.matched(c.index, &prompt.pieces) as u64,
                        cached: trees.size(c.index) as u64,
                        ..*c
                    })
                    .collect();
                let best = cache_aware(&scored, prompt.pieces.len() as u64, &self.params);
                (
                    best.map(|i| Chosen {
                        index: i,
                        cached_tokens: scored
                            .iter()
                            .find(|c| c.index == i)
                            .map_or(0, |c| estimated_tokens_of_pieces(c.matched)),
                    }),
                    RoutingPolicy::CacheAware,
                )
            }
        }
    }

    fn count(&self, c: Option<Chosen>, policy: RoutingPolicy) -> Option<Chosen> {
        if let Some(c) = &c {
            let p = POLICIES.iter().position(|x| *x == policy).unwrap_or(0);
            self.decisions[p][(c.cached_tokens > 0) as usize].fetch_add(1, Relaxed);
        }
        c
    }

    /// Routing decisions counted under `policy`, `matched` or not.
    pub fn decisions(&self, policy: RoutingPolicy, matched: bool) -> u64 {
        let p = POLICIES.iter().position(|x| *x == policy).unwrap_or(0);
        self.decisions[p][matched as usize].load(Relaxed)
    }

    /// The leading tokens of `tokens` (whole blocks of `block_size`) that every prompt
    /// routed so far started with; 0 before any, and while every prompt was this same one
    /// (a prompt repeated is no prefix that all prompts share: counted as held by a cold
    /// worker, it sent the repeats away from the worker holding them).
    fn common_prefix(&self, tokens: &[u32], block_size: u32) -> u64 {
        let common = self.common.lock().unwrap_or_else(|p| p.into_inner());
        let Some((c, differed)) = common.as_ref() else {
            return 0;
        };
        let n = c.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        if !differed && n == c.len() && n == tokens.len() {
            return 0;
        }
        match block_size as usize {
            0 => 0,
            b => (n / b * b) as u64,
        }
    }

    /// Notes that `prompt` went to worker `w`; under `kv-events`, its whole blocks count as
    /// `w`'s until the returned handle is dropped (with the request's slot).
    pub fn routed(&self, w: usize, prompt: &PromptKey) -> Option<RoutedPrompt> {
        if let Some(t) = &self.trees {
            t.insert(w, &prompt.pieces);
        }
        if let (Some(_), Some(tokens)) = (&self.index, &prompt.tokens) {
            let mut common = self.common.lock().unwrap_or_else(|p| p.into_inner());
            match common.as_mut() {
                None => *common = Some((tokens.clone(), false)),
                Some((c, differed)) => {
                    let n = c.iter().zip(tokens).take_while(|(a, b)| a == b).count();
                    *differed |= n < c.len() || n < tokens.len();
                    c.truncate(n);
                }
            }
        }
        let (routed, index, tokens) = (
            self.routed.as_ref()?,
            self.index.as_ref()?,
            prompt.tokens.as_ref()?,
        );
        routed.add(w, tokens, index.block_size()?)
    }

    /// Forgets what is known of worker `w`'s cache (it was ejected: it may restart empty).
    pub fn forget(&self, w: usize) {
        if let Some(i) = &self.index {
            i.forget(w);
        }
        if let Some(r) = &self.routed {
            r.forget(w);
        }
        if let Some(t) = &self.trees {
            t.forget(w);
        }
    }
}
