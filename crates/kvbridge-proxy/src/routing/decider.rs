//! The disaggregation decider: per request, whether the chosen decoder prefills the prompt
//! itself (the request goes to it alone, as it came) or the prompt goes the PD way (a
//! prefiller computes it and the KV moves to the decoder).
//!
//! The rule, with `prompt` the prompt's tokens and `cached` the leading tokens of it that
//! the chosen decoder holds (its KV events under `kv-events`, the approximate tree of the
//! prompts routed to it under `cache-aware`), and `uncached = prompt - cached`:
//! 1. `uncached < min_uncached_tokens`: decode alone (`uncached_below_threshold`): so little
//!    to compute that moving KV costs more than computing it where it is needed;
//! 2. else `cached > 0` and `cached >= decoder_cached_fraction * prompt`: decode alone
//!    (`decoder_holds_prefix`): the decoder already holds most of the prompt;
//! 3. else, when the prefiller the routing policy would choose is known and
//!    `compare_queues` is on: decode alone (`prefillers_queued`) when the decoder would start
//!    the prompt's prefill sooner and finish it first, weighed as the routing cost weighs:
//!    `load_weight * decoder_load + prefill_weight * uncached <
//!    load_weight * prefiller_load + prefill_weight * (prompt - prefiller_cached)`, both loads
//!    [`super::policy::Candidate::load`] without this request (a decoder's load counts only
//!    the prompts it prefills itself). The weights ([`DeciderParams::weights`]) are the
//!    `kv-events` cost's under `kv-events` (2 and 1 by default: the decoder computes again
//!    what the prefiller holds, so it must finish well before the prefiller's queue lets the
//!    prompt start), 1 and 1 under the other policies (tokens of work alone). The PD path's
//!    prefill waits for every prefill queued on its prefiller (one engine computes one
//!    prefill at a time); under a burst the prefillers' queues, not the transfer, made the
//!    PD path's TTFT tail;
//! 4. else disaggregate (`uncached_above_threshold`).
//!
//! Under `least-loaded` routing the proxy knows nothing of the decoders' caches and, unless
//! the thresholds are given, always disaggregates (`no_cache_view`). Sans-IO: the counters
//! are atomics, rendered into `/metrics` as
//! `kvbridge_proxy_disaggregation_decisions_total{decision,reason}`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Deserialize;

use super::policy::KvEventsWeights;

/// Default `min_uncached_tokens`: measured with `kvbridge demo --workload shared-prefix`
/// under kv-events (docs/proxy.md, "The decider's threshold"): 128 to 2048 within each
/// other's noise, 512 tied for the lowest TTFT p50.
pub const DEFAULT_MIN_UNCACHED_TOKENS: u64 = 512;

/// Default `decoder_cached_fraction`.
pub const DEFAULT_DECODER_CACHED_FRACTION: f64 = 0.8;

/// The decider's thresholds (`[disaggregation]` in the config file).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeciderParams {
    /// Rule 3's weights of a token to prefill and a token of load: the `kv-events` cost's
    /// under `kv-events` routing ([`KvEventsWeights`]), [`KvEventsWeights::EQUAL`] under the other
    /// policies, which have no cost formula.
    #[serde(skip)]
    pub weights: KvEventsWeights,
    /// Prompts with fewer uncached tokens than this are prefilled by their decoder.
    pub min_uncached_tokens: u64,
    /// A decoder that holds at least this fraction of the prompt prefills it (above 1: never).
    pub decoder_cached_fraction: f64,
    /// Rule 3: a decoder that would finish the prompt's prefill before the prefiller's
    /// queue lets it start prefills it.
    pub compare_queues: bool,
}

impl Default for DeciderParams {
    fn default() -> Self {
        DeciderParams {
            weights: KvEventsWeights::EQUAL,
            min_uncached_tokens: DEFAULT_MIN_UNCACHED_TOKENS,
            decoder_cached_fraction: DEFAULT_DECODER_CACHED_FRACTION,
            compare_queues: true,
        }
    }
}

impl DeciderParams {
    /// Parameters that always disaggregate.
    pub const ALWAYS: DeciderParams = DeciderParams {
        weights: KvEventsWeights::EQUAL,
        min_uncached_tokens: 0,
        decoder_cached_fraction: f64::INFINITY,
        compare_queues: false,
    };
}

/// Where a request goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// To the decoder alone, which prefills it.
    DecodeOnly,
    /// Prefiller, KV transfer, decoder.
    Disaggregate,
}

impl Decision {
    /// The label value in `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::DecodeOnly => "decode_only",
            Decision::Disaggregate => "disaggregate",
        }
    }
}

/// Why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Rule 1: few uncached tokens.
    UncachedBelowThreshold,
    /// Rule 2: the decoder holds most of the prompt.
    DecoderHoldsPrefix,
    /// Rule 3: the prefillers' queue is longer than the decoder's own work.
    PrefillersQueued,
    /// Rule 4.
    UncachedAboveThreshold,
    /// The routing policy has no view of the decoders' caches and no threshold was given.
    NoCacheView,
}

impl Reason {
    /// The label value in `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::UncachedBelowThreshold => "uncached_below_threshold",
            Reason::DecoderHoldsPrefix => "decoder_holds_prefix",
            Reason::PrefillersQueued => "prefillers_queued",
            Reason::UncachedAboveThreshold => "uncached_above_threshold",
            Reason::NoCacheView => "no_cache_view",
        }
    }
}

/// What the decider weighs for one request, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Facts {
    /// The prompt's tokens.
    pub prompt: u64,
    /// Its leading tokens the chosen decoder holds.
    pub decoder_cached: u64,
    /// The chosen decoder's load without this request.
    pub decoder_load: u64,
    /// The prefiller the routing policy would choose now, when known.
    pub prefiller: Option<PrefillerView>,
}

/// The prefiller a request would go to on the PD path, as the proxy sees it when deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillerView {
    /// The prompt's leading tokens it holds.
    pub cached: u64,
    /// Its load without this request.
    pub load: u64,
}

/// The rule of the module docs.
pub fn decide(f: &Facts, p: &DeciderParams) -> (Decision, Reason) {
    let prompt = f.prompt;
    let cached = f.decoder_cached.min(prompt);
    let uncached = prompt - cached;
    if uncached < p.min_uncached_tokens {
        return (Decision::DecodeOnly, Reason::UncachedBelowThreshold);
    }
    if cached > 0 && cached as f64 >= p.decoder_cached_fraction * prompt as f64 {
        return (Decision::DecodeOnly, Reason::DecoderHoldsPrefix);
    }
    if let (true, Some(pv)) = (p.compare_queues, f.prefiller) {
        let w = &p.weights;
        let remote = w.load_weight * pv.load as f64
            + w.prefill_weight * (prompt - pv.cached.min(prompt)) as f64;
        let local = w.load_weight * f.decoder_load as f64 + w.prefill_weight * uncached as f64;
        if local < remote {
            return (Decision::DecodeOnly, Reason::PrefillersQueued);
        }
    }
    (Decision::Disaggregate, Reason::UncachedAboveThreshold)
}

const PAIRS: [(Decision, Reason); 5] = [
    (Decision::DecodeOnly, Reason::UncachedBelowThreshold),
    (Decision::DecodeOnly, Reason::DecoderHoldsPrefix),
    (Decision::DecodeOnly, Reason::PrefillersQueued),
    (Decision::Disaggregate, Reason::UncachedAboveThreshold),
    (Decision::Disaggregate, Reason::NoCacheView),
];

/// The decider of a proxy: its parameters (`None`: no cache view, always disaggregate) and
/// its counters.
#[derive(Debug, Default)]
pub struct Decider {
    params: Option<DeciderParams>,
    counts: [AtomicU64; PAIRS.len()],
}

impl Decider {
    /// A decider with `params`, or one that always disaggregates (`None`).
    pub fn new(params: Option<DeciderParams>) -> Decider {
        Decider {
            params,
            counts: Default::default(),
        }
    }

    /// Whether it can decide for decode alone at all.
    pub fn active(&self) -> bool {
        self.params.is_some()
    }

    /// Whether it weighs the prefillers' queues (rule 3), so the caller should find the
    /// prefiller the request would go to before deciding.
    pub fn compares_queues(&self) -> bool {
        self.params.is_some_and(|p| p.compare_queues)
    }

    /// Decides for a request with `facts`, and counts the decision.
    pub fn decide(&self, facts: &Facts) -> Decision {
        let (d, r) = match &self.params {
            Some(p) => decide(facts, p),
            None => (Decision::Disaggregate, Reason::NoCacheView),
        };
        if let Some(i) = PAIRS.iter().position(|x| *x == (d, r)) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        d
    }

    /// Requests sent to a decoder alone so far, for any reason.
    pub fn decode_only_total(&self) -> u64 {
        PAIRS
            .iter()
            .zip(&self.counts)
            .filter(|((d, _), _)| *d == Decision::DecodeOnly)
            .map(|(_, c)| c.load(Relaxed))
            .sum()
    }

    /// Decisions so far with this decision and reason.
    pub fn count(&self, d: Decision, r: Reason) -> u64 {
        PAIRS
            .iter()
            .position(|x| *x == (d, r))
            .map_or(0, |i| self.counts[i].load(Relaxed))
    }

    /// Appends `kvbridge_proxy_disaggregation_decisions_total`.
    pub fn render(&self, out: &mut String) {
        out.push_str(
            "# HELP kvbridge_proxy_disaggregation_decisions_total Requests sent to a decoder \
             alone or the PD way, by reason.\n\
             # TYPE kvbridge_proxy_disaggregation_decisions_total counter\n",
        );
        for (i, (d, r)) in PAIRS.iter().enumerate() {
            let _ = writeln!(
                out,
                "kvbridge_proxy_disaggregation_decisions_total{{decision=\"{}\",reason=\"{}\"}} {}",
                d.as_str(),
                r.as_str(),
                self.counts[i].load(Relaxed)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: DeciderParams = DeciderParams {
        weights: KvEventsWeights::EQUAL,
        min_uncached_tokens: 100,
        decoder_cached_fraction: 0.75,
        compare_queues: true,
    };

    /// Facts without a view of the prefillers.
    fn f(prompt: u64, decoder_cached: u64) -> Facts {
        Facts {
            prompt,
            decoder_cached,
            ..Facts::default()
        }
    }

    #[test]
    fn the_decisions_follow_the_documented_rule() {
        use Decision::*;
        use Reason::*;
        // Rule 1, at the boundary: below decodes alone, at the threshold does not.
        assert_eq!(decide(&f(99, 0), &P), (DecodeOnly, UncachedBelowThreshold));
        assert_eq!(
            decide(&f(100, 0), &P),
            (Disaggregate, UncachedAboveThreshold)
        );
        assert_eq!(
            decide(&f(1000, 901), &P),
            (DecodeOnly, UncachedBelowThreshold),
            "99 uncached"
        );
        // Rule 2, at the boundary: 750 of 1000 held is enough, 749 is not.
        assert_eq!(decide(&f(1000, 750), &P), (DecodeOnly, DecoderHoldsPrefix));
        assert_eq!(
            decide(&f(1000, 749), &P),
            (Disaggregate, UncachedAboveThreshold)
        );
        // A fraction of 0 still needs something held.
        let zero = DeciderParams {
            decoder_cached_fraction: 0.0,
            ..P
        };
        assert_eq!(
            decide(&f(1000, 0), &zero),
            (Disaggregate, UncachedAboveThreshold)
        );
        assert_eq!(decide(&f(1000, 1), &zero), (DecodeOnly, DecoderHoldsPrefix));
        // More held than the prompt (an estimate) counts as the whole prompt.
        assert_eq!(
            decide(&f(500, 9000), &P),
            (DecodeOnly, UncachedBelowThreshold)
        );
        // Rule 3, at the boundary: the decoder (load 300, 800 uncached: 1100) against the
        // prefiller (load 200, holding 100 of 1000: 1100, a tie) takes the PD path; one token
        // more queued on the prefiller sends the request to the decoder alone.
        let queued = |decoder_load, load, cached| Facts {
            prompt: 1000,
            decoder_cached: 200,
            decoder_load,
            prefiller: Some(PrefillerView { cached, load }),
        };
        assert_eq!(
            decide(&queued(300, 200, 100), &P),
            (Disaggregate, UncachedAboveThreshold)
        );
        assert_eq!(
            decide(&queued(300, 201, 100), &P),
            (DecodeOnly, PrefillersQueued)
        );
        // What the prefiller holds counts for it: 900 held makes its 1000 queued worth it.
        assert_eq!(
            decide(&queued(300, 1000, 900), &P),
            (Disaggregate, UncachedAboveThreshold)
        );
        // Off, or without a view of the prefillers, the queues are not weighed.
        let off = DeciderParams {
            compare_queues: false,
            ..P
        };
        assert_eq!(
            decide(&queued(300, 5000, 0), &off),
            (Disaggregate, UncachedAboveThreshold)
        );
        assert_eq!(
            decide(&queued(300, 5000, 0), &P),
            (DecodeOnly, PrefillersQueued)
        );
        // Rules 1 and 2 come first: a decoder past its threshold decodes alone whatever
        // the queues say.
        let mut busy = queued(1_000_000, 0, 1000);
        busy.decoder_cached = 950;
        assert_eq!(decide(&busy, &P), (DecodeOnly, UncachedBelowThreshold));
        // ALWAYS never decodes alone.
        for (prompt, cached) in [(0, 0), (1, 1), (1000, 1000), (10, 0)] {
            assert_eq!(
                decide(&f(prompt, cached), &DeciderParams::ALWAYS).0,
                Disaggregate
            );
        }
    }

    #[test]
    fn rule_3_weighs_the_paths_with_the_routing_cost_weights() {
        use Decision::*;
        use Reason::*;
        // A second question on a 3164-token document: the prefiller holds 2816 of it but
        // has 2931 tokens queued; the decoder holds the 512-token system prompt, 256 queued.
        let doc = Facts {
            prompt: 3164,
            decoder_cached: 512,
            decoder_load: 256,
            prefiller: Some(PrefillerView {
                cached: 2816,
                load: 2931,
            }),
        };
        // In tokens of work alone the decoder starts and ends sooner (256 + 2652 < 2931 +
        // 348) and computes the document again.
        assert_eq!(decide(&doc, &P), (DecodeOnly, PrefillersQueued));
        // A token to prefill weighing 2 queued: 2 * 2652 + 256 > 2 * 348 + 2931.
        let w2 = DeciderParams {
            weights: KvEventsWeights {
                prefill_weight: 2.0,
                load_weight: 1.0,
            },
            ..P
        };
        assert_eq!(decide(&doc, &w2), (Disaggregate, UncachedAboveThreshold));
        // With a longer queue the decoder still wins: 2 * 348 + 6000 > 2 * 2652 + 256.
        let mut queued = doc;
        queued.prefiller = Some(PrefillerView {
            cached: 2816,
            load: 6000,
        });
        assert_eq!(decide(&queued, &w2), (DecodeOnly, PrefillersQueued));
        // Rules 1 and 2 do not weigh anything.
        assert_eq!(
            decide(&f(1000, 950), &w2),
            (DecodeOnly, UncachedBelowThreshold)
        );
    }

    #[test]
    fn every_decision_is_counted_with_its_reason() {
        let d = Decider::new(Some(P));
        assert_eq!(d.decide(&f(10, 0)), Decision::DecodeOnly);
        assert_eq!(d.decide(&f(1000, 800)), Decision::DecodeOnly);
        assert_eq!(d.decide(&f(1000, 0)), Decision::Disaggregate);
        assert_eq!(d.decide(&f(1000, 0)), Decision::Disaggregate);
        let queued = Facts {
            prompt: 1000,
            decoder_load: 0,
            prefiller: Some(PrefillerView {
                cached: 0,
                load: 4000,
            }),
            ..Facts::default()
        };
        assert_eq!(d.decide(&queued), Decision::DecodeOnly);
        assert_eq!(d.decode_only_total(), 3);
        assert!(d.compares_queues());
        let off = Decider::new(None);
        assert!(!off.compares_queues());
        assert_eq!(off.decide(&f(1, 1)), Decision::Disaggregate);
        assert_eq!(off.count(Decision::Disaggregate, Reason::NoCacheView), 1);
        let mut s = String::new();
        d.render(&mut s);
        for line in [
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"decode_only\",reason=\"uncached_below_threshold\"} 1\n",
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"decode_only\",reason=\"decoder_holds_prefix\"} 1\n",
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"decode_only\",reason=\"prefillers_queued\"} 1\n",
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"disaggregate\",reason=\"uncached_above_threshold\"} 2\n",
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"disaggregate\",reason=\"no_cache_view\"} 0\n",
        ] {
            assert!(s.contains(line), "{line} in {s}");
        }
    }
}
