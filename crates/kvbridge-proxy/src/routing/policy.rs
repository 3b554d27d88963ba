//! Routing policies: which of the workers that admit a request gets it.
//!
//! * `least-loaded`: the lowest load, `load(w) = pending_prefill(w) + 256 * inflight(w)`:
//!   the prompt tokens the worker still has to prefill for the requests on it (each one's
//!   estimated prompt tokens less the leading tokens the policy knew it held when it was
//!   chosen) plus a fixed cost per request. A prompt the worker holds is not work: counting
//!   it made the worker that holds a prefix look busy and lose the requests that share it.
//! * `kv-events`: the lowest cost
//!   `cost(w) = prefill_weight * (prompt_tokens - cached_tokens(w)) + load_weight * load(w)`,
//!   where `cached_tokens(w)` is the prompt's leading tokens that worker `w` reported holding
//!   in its KV events ([`super::kv_index`]). Both terms are in tokens; by default (weights
//!   2 and 1) a token to prefill costs twice a token already queued: it delays its own
//!   request, and it is load for every request that comes after it on that worker. With
//!   `prefill_weight = 0` it is `least-loaded`. A worker that has reported no block (cold)
//!   is counted as holding the prefix every routed prompt shares; equal costs go to the
//!   worker holding more of the prompt, then the fewest blocks ([`kv_events`]).
//! * `cache-aware`: SGLang router's `cache_aware` rule over an approximate tree of the
//!   prompts routed ([`super::prefix_tree`]). When the pool is imbalanced (the most and the
//!   fewest requests in flight differ by more than `balance_abs_threshold` *and* the most is
//!   over `balance_rel_threshold` times the fewest), the worker with the fewest requests;
//!   else, when the best prefix match covers more than `cache_threshold` of the prompt, the
//!   worker with that match; else the worker whose tree is smallest (the most room).
//!
//! Ties go to the first candidate, in the pool's rotating order.

use serde::Deserialize;

/// Whether a pool serves prefill or decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Prefill workers.
    Prefill,
    /// Decode workers.
    Decode,
}

impl Role {
    /// Label value used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// A routing policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum RoutingPolicy {
    /// The lowest load.
    #[default]
    LeastLoaded,
    /// Approximate prefix match of the routed prompts, with a load-balance guard.
    CacheAware,
    /// Blocks the workers report holding (vLLM KV events) against their load.
    KvEvents,
}

impl RoutingPolicy {
    /// The name used in flags, TOML and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingPolicy::LeastLoaded => "least-loaded",
            RoutingPolicy::CacheAware => "cache-aware",
            RoutingPolicy::KvEvents => "kv-events",
        }
    }
}

/// Weights of the `kv-events` cost.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsWeights {
    /// Cost of a prompt token the worker must prefill.
    pub prefill_weight: f64,
    /// Cost of a token of load on the worker.
    pub load_weight: f64,
}

/// Default `prefill_weight`: a token computed costs its request's wait once and is load for
/// every request queued after it on that worker; measured with `kvbridge demo --workload
/// shared-prefix` (docs/proxy.md, "Routing benchmark": 1, 1.5, 2 and 3 side by side).
pub const DEFAULT_PREFILL_WEIGHT: f64 = 2.0;

impl KvEventsWeights {
    /// A token to prefill and a token of load weigh the same: tokens of work alone (the
    /// decider's rule 3 under the policies that have no cost formula).
    pub const EQUAL: KvEventsWeights = KvEventsWeights {
        prefill_weight: 1.0,
        load_weight: 1.0,
    };
}

impl Default for KvEventsWeights {
    fn default() -> Self {
        KvEventsWeights {
            prefill_weight: DEFAULT_PREFILL_WEIGHT,
            load_weight: 1.0,
        }
    }
}

/// Thresholds of the `cache-aware` rule (SGLang router's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheAwareParams {
    /// Fraction of the prompt a match must exceed to decide.
    pub cache_threshold: f64,
    /// Requests in flight by which the busiest worker must exceed the idlest to be
    /// imbalanced.
    pub balance_abs_threshold: u64,
    /// Ratio by which the busiest worker must exceed the idlest to be imbalanced.
    pub balance_rel_threshold: f64,
    /// Pieces of routed prompts kept per worker.
    pub max_tree_pieces: usize,
}

impl Default for CacheAwareParams {
    fn default() -> Self {
        CacheAwareParams {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            max_tree_pieces: 1 << 20,
        }
    }
}

/// A worker that admits the request, as a policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The worker's index in its pool.
    pub index: usize,
    /// Requests on it now.
    pub inflight: u64,
    /// Prompt tokens it has to prefill for the requests on it now (their estimated prompt
    /// tokens less what it held of each when chosen).
    pub pending_prefill: u64,
    /// The prompt's leading tokens (`kv-events`) or pieces (`cache-aware`) it holds.
    pub matched: u64,
    /// What it holds in all (`cache-aware`: pieces in its tree).
    pub cached: u64,
}

impl Candidate {
    /// `pending_prefill + 256 * inflight`.
    pub fn load(&self) -> u64 {
        self.pending_prefill
            .saturating_add(self.inflight.saturating_mul(256))
    }
}

fn first_min_by<F: Fn(&Candidate) -> f64>(cands: &[Candidate], f: F) -> Option<usize> {
    let mut best: Option<(f64, usize)> = None;
    for c in cands {
        let v = f(c);
        if best.is_none_or(|(b, _)| v < b) {
            best = Some((v, c.index));
        }
    }
    best.map(|(_, i)| i)
}

/// `least-loaded`.
pub fn least_loaded(cands: &[Candidate]) -> Option<usize> {
    first_min_by(cands, |c| c.load() as f64)
}

/// `kv-events` for a prompt of `prompt_tokens` tokens: `matched` is the prompt's leading
/// tokens each candidate holds, `cached` the blocks it holds in all, and `common` the
/// leading tokens of the prompt that every prompt this pool routed starts with (whole
/// blocks: a system prompt).
///
/// A cold worker (no block reported) is counted as holding `common`: it computes that once,
/// on its first request, and holds it after. Counted against it every time, it made every
/// warm worker cheaper by that prefix whenever loads were equal, so with requests one at a
/// time the first worker of a pool got all of them while the others stayed cold, their
/// caches unused and its own evicting.
///
/// Equal costs go to the candidate holding more of the prompt: it computes fewer tokens for
/// the same cost (with equal weights and 256-token blocks, a worker one block ahead with one
/// request more in flight ties, and often: going to the other computed that block twice).
/// Then to the one holding the fewest blocks (the most room), then to the first.
pub fn kv_events(
    cands: &[Candidate],
    prompt_tokens: u64,
    common: u64,
    w: &KvEventsWeights,
) -> Option<usize> {
    // (cost, leading tokens held, blocks held, index) of the best so far.
    let mut best: Option<(f64, u64, u64, usize)> = None;
    for c in cands {
        let matched = if c.cached == 0 {
            c.matched.max(common)
        } else {
            c.matched
        };
        let v = w.prefill_weight * prompt_tokens.saturating_sub(matched) as f64
            + w.load_weight * c.load() as f64;
        let better = best.is_none_or(|(b, m, r, _)| {
            v < b || (v == b && (matched > m || (matched == m && c.cached < r)))
        });
        if better {
            best = Some((v, matched, c.cached, c.index));
        }
    }
    best.map(|(.., i)| i)
}

/// `cache-aware` for a prompt of `prompt_pieces` pieces.
pub fn cache_aware(cands: &[Candidate], prompt_pieces: u64, p: &CacheAwareParams) -> Option<usize> {
    let max = cands.iter().map(|c| c.inflight).max()?;
    let min = cands.iter().map(|c| c.inflight).min()?;
    if max - min > p.balance_abs_threshold && max as f64 > min as f64 * p.balance_rel_threshold {
        return first_min_by(cands, |c| c.inflight as f64);
    }
    let best = first_min_by(cands, |c| -(c.matched as f64))?;
    let matched = cands
        .iter()
        .find(|c| c.index == best)
        .map_or(0, |c| c.matched);
    if prompt_pieces > 0 && matched as f64 / prompt_pieces as f64 > p.cache_threshold {
        return Some(best);
    }
    first_min_by(cands, |c| c.cached as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The figures in the comments add up as written with equal weights.
    const EQUAL: KvEventsWeights = KvEventsWeights::EQUAL;

    fn c(index: usize, inflight: u64, pending: u64, matched: u64, cached: u64) -> Candidate {
        Candidate {
            index,
            inflight,
            pending_prefill: pending,
            matched,
            cached,
        }
    }

    #[test]
    fn kv_events_trades_cached_tokens_against_load() {
        let w = EQUAL;
        // Worker 1 holds 900 of 1000 tokens but has 500 tokens queued: 100 + 756 < 1000 + 0.
        let cands = [c(0, 0, 0, 0, 0), c(1, 1, 500, 900, 0)];
        assert_eq!(kv_events(&cands, 1000, 0, &w), Some(1));
        // With 2000 queued it is not worth it: 100 + 2256 > 1000.
        let cands = [c(0, 0, 0, 0, 0), c(1, 1, 2000, 900, 0)];
        assert_eq!(kv_events(&cands, 1000, 0, &w), Some(0));
        // Prefill weight 0 is least-loaded.
        let ll = KvEventsWeights {
            prefill_weight: 0.0,
            load_weight: 1.0,
        };
        let cands = [c(0, 1, 10, 0, 0), c(1, 1, 20, 1000, 0)];
        assert_eq!(kv_events(&cands, 1000, 0, &ll), least_loaded(&cands));
        assert_eq!(least_loaded(&cands), Some(0));
        assert_eq!(kv_events(&[], 10, 0, &w), None);
        // Ties: the fewest blocks, then the first candidate.
        let cands = [c(3, 0, 0, 0, 0), c(1, 0, 0, 0, 0)];
        assert_eq!(kv_events(&cands, 10, 0, &w), Some(3));
        let cands = [c(3, 0, 0, 4, 9), c(1, 0, 0, 4, 5)];
        assert_eq!(kv_events(&cands, 10, 0, &w), Some(1));
    }

    #[test]
    fn kv_events_breaks_equal_costs_toward_the_worker_holding_more_of_the_prompt() {
        let w = EQUAL;
        // The next turn of a chat (1255 tokens, 256-token blocks): worker 1 holds one block
        // more of it (1024) and has one request more in flight. 231 + 512 = 487 + 256: the
        // holder computes 256 tokens fewer, though it has more blocks in all.
        let cands = [c(0, 1, 0, 768, 19), c(1, 2, 0, 1024, 34)];
        assert_eq!(kv_events(&cands, 1255, 512, &w), Some(1));
        let cands = [c(1, 2, 0, 1024, 34), c(0, 1, 0, 768, 19)];
        assert_eq!(kv_events(&cands, 1255, 512, &w), Some(1), "in either order");
        // Holding as much, the fewest blocks; a cold worker counts as holding the common
        // prefix, so among workers holding only that it is the cold one.
        let cands = [c(0, 0, 0, 512, 19), c(1, 0, 0, 0, 0)];
        assert_eq!(kv_events(&cands, 1255, 512, &w), Some(1));
    }

    #[test]
    fn the_default_weights_count_a_token_to_prefill_twice() {
        let w = KvEventsWeights::default();
        assert_eq!((w.prefill_weight, w.load_weight), (2.0, 1.0));
        // Worker 1 holds 900 of 1000 tokens with 1500 queued: 2 * 100 + 1756 < 2 * 1000,
        // where with equal weights the idle worker won (100 + 1756 > 1000).
        let cands = [c(0, 0, 0, 0, 0), c(1, 1, 1500, 900, 0)];
        assert_eq!(kv_events(&cands, 1000, 0, &w), Some(1));
        assert_eq!(kv_events(&cands, 1000, 0, &EQUAL), Some(0));
    }

    #[test]
    fn kv_events_counts_a_cold_worker_as_holding_the_common_prefix() {
        let w = EQUAL;
        // Worker 0 holds the 512-token system prompt every prompt starts with (40 blocks in
        // all); worker 1 has reported nothing. Both idle: the cold one gets the new prompt
        // (it computes the system prompt once), not the warm one, every time.
        let cands = [c(0, 0, 0, 512, 40), c(1, 0, 0, 0, 0)];
        assert_eq!(kv_events(&cands, 3000, 512, &w), Some(1));
        assert_eq!(
            kv_events(&cands, 3000, 0, &w),
            Some(0),
            "without a common prefix the warm one is cheaper"
        );
        // A prefix beyond the common one still wins: worker 0 holds a document too.
        let cands = [c(0, 0, 0, 2560, 40), c(1, 0, 0, 0, 0)];
        assert_eq!(kv_events(&cands, 3000, 512, &w), Some(0));
        // Load still counts against a cold worker.
        let cands = [c(0, 0, 0, 512, 40), c(1, 1, 100, 0, 0)];
        assert_eq!(kv_events(&cands, 3000, 512, &w), Some(0));
    }

    #[test]
    fn cache_aware_follows_sglangs_rule() {
        let p = CacheAwareParams {
            cache_threshold: 0.5,
            balance_abs_threshold: 4,
            balance_rel_threshold: 2.0,
            ..Default::default()
        };
        // Balanced, a match over the threshold: the match.
        let cands = [c(0, 1, 0, 0, 0), c(1, 2, 0, 6, 50)];
        assert_eq!(cache_aware(&cands, 10, &p), Some(1));
        // A match at the threshold does not decide: the smallest tree.
        let cands = [c(0, 1, 0, 5, 50), c(1, 2, 0, 0, 10)];
        assert_eq!(cache_aware(&cands, 10, &p), Some(1));
        // Imbalanced (10 - 1 > 4 and 10 > 2 * 1): the fewest requests, match or not.
        let cands = [c(0, 1, 0, 0, 0), c(1, 10, 0, 10, 0)];
        assert_eq!(cache_aware(&cands, 10, &p), Some(0));
        // Over the absolute threshold but not the relative one: still balanced.
        let cands = [c(0, 6, 0, 0, 0), c(1, 11, 0, 10, 0)];
        assert_eq!(cache_aware(&cands, 10, &p), Some(1));
        // A prompt shorter than a piece matches nothing: the smallest tree.
        let cands = [c(0, 0, 0, 0, 9), c(1, 0, 0, 0, 3)];
        assert_eq!(cache_aware(&cands, 0, &p), Some(1));
        assert_eq!(cache_aware(&[], 10, &p), None);
    }
}
