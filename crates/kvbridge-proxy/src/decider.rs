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
//! 3. else disaggregate (`uncached_above_threshold`).
//!
//! Under `least-loaded` routing the proxy knows nothing of the decoders' caches and, unless
//! the thresholds are given, always disaggregates (`no_cache_view`). Sans-IO: the counters
//! are atomics, rendered into `/metrics` as
//! `kvbridge_proxy_disaggregation_decisions_total{decision,reason}`.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Deserialize;

/// Default `min_uncached_tokens`: measured with `kvbridge demo --workload shared-prefix`
/// (docs/proxy.md, "Disaggregation decider").
pub const DEFAULT_MIN_UNCACHED_TOKENS: u64 = 512;

/// Default `decoder_cached_fraction`.
pub const DEFAULT_DECODER_CACHED_FRACTION: f64 = 0.8;

/// The decider's thresholds (`[disaggregation]` in the config file).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeciderParams {
    /// Prompts with fewer uncached tokens than this are prefilled by their decoder.
    pub min_uncached_tokens: u64,
    /// A decoder that holds at least this fraction of the prompt prefills it (above 1: never).
    pub decoder_cached_fraction: f64,
}

impl Default for DeciderParams {
    fn default() -> Self {
        DeciderParams {
            min_uncached_tokens: DEFAULT_MIN_UNCACHED_TOKENS,
            decoder_cached_fraction: DEFAULT_DECODER_CACHED_FRACTION,
        }
    }
}

impl DeciderParams {
    /// Parameters that always disaggregate.
    pub const ALWAYS: DeciderParams = DeciderParams {
        min_uncached_tokens: 0,
        decoder_cached_fraction: f64::INFINITY,
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
    /// Rule 3.
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
            Reason::UncachedAboveThreshold => "uncached_above_threshold",
            Reason::NoCacheView => "no_cache_view",
        }
    }
}

/// The rule of the module docs for a prompt of `prompt` tokens of which the chosen decoder
/// holds the first `cached`.
pub fn decide(prompt: u64, cached: u64, p: &DeciderParams) -> (Decision, Reason) {
    let cached = cached.min(prompt);
    let uncached = prompt - cached;
    if uncached < p.min_uncached_tokens {
        return (Decision::DecodeOnly, Reason::UncachedBelowThreshold);
    }
    if cached > 0 && cached as f64 >= p.decoder_cached_fraction * prompt as f64 {
        return (Decision::DecodeOnly, Reason::DecoderHoldsPrefix);
    }
    (Decision::Disaggregate, Reason::UncachedAboveThreshold)
}

const PAIRS: [(Decision, Reason); 4] = [
    (Decision::DecodeOnly, Reason::UncachedBelowThreshold),
    (Decision::DecodeOnly, Reason::DecoderHoldsPrefix),
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

    /// Decides for a prompt of `prompt` tokens of which the chosen decoder holds `cached`,
    /// and counts the decision.
    pub fn decide(&self, prompt: u64, cached: u64) -> Decision {
        let (d, r) = match &self.params {
            Some(p) => decide(prompt, cached, p),
            None => (Decision::Disaggregate, Reason::NoCacheView),
        };
        if let Some(i) = PAIRS.iter().position(|x| *x == (d, r)) {
            self.counts[i].fetch_add(1, Relaxed);
        }
        d
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
        min_uncached_tokens: 100,
        decoder_cached_fraction: 0.75,
    };

    #[test]
    fn the_decisions_follow_the_documented_rule() {
        use Decision::*;
        use Reason::*;
        // Rule 1, at the boundary: below decodes alone, at the threshold does not.
        assert_eq!(decide(99, 0, &P), (DecodeOnly, UncachedBelowThreshold));
        assert_eq!(decide(100, 0, &P), (Disaggregate, UncachedAboveThreshold));
        assert_eq!(
            decide(1000, 901, &P),
            (DecodeOnly, UncachedBelowThreshold),
            "99 uncached"
        );
        // Rule 2, at the boundary: 750 of 1000 held is enough, 749 is not.
        assert_eq!(decide(1000, 750, &P), (DecodeOnly, DecoderHoldsPrefix));
        assert_eq!(
            decide(1000, 749, &P),
            (Disaggregate, UncachedAboveThreshold)
        );
        // A fraction of 0 still needs something held.
        let zero = DeciderParams {
            decoder_cached_fraction: 0.0,
            ..P
        };
        assert_eq!(
            decide(1000, 0, &zero),
            (Disaggregate, UncachedAboveThreshold)
        );
        assert_eq!(decide(1000, 1, &zero), (DecodeOnly, DecoderHoldsPrefix));
        // More held than the prompt (an estimate) counts as the whole prompt.
        assert_eq!(decide(500, 9000, &P), (DecodeOnly, UncachedBelowThreshold));
        // ALWAYS never decodes alone.
        for (prompt, cached) in [(0, 0), (1, 1), (1000, 1000), (10, 0)] {
            assert_eq!(
                decide(prompt, cached, &DeciderParams::ALWAYS).0,
                Disaggregate
            );
        }
    }

    #[test]
    fn every_decision_is_counted_with_its_reason() {
        let d = Decider::new(Some(P));
        assert_eq!(d.decide(10, 0), Decision::DecodeOnly);
        assert_eq!(d.decide(1000, 800), Decision::DecodeOnly);
        assert_eq!(d.decide(1000, 0), Decision::Disaggregate);
        assert_eq!(d.decide(1000, 0), Decision::Disaggregate);
        let off = Decider::new(None);
        assert_eq!(off.decide(1, 1), Decision::Disaggregate);
        assert_eq!(off.count(Decision::Disaggregate, Reason::NoCacheView), 1);
        let mut s = String::new();
        d.render(&mut s);
        for line in [
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"decode_only\",reason=\"uncached_below_threshold\"} 1\n",
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"decode_only\",reason=\"decoder_holds_prefix\"} 1\n",
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"disaggregate\",reason=\"uncached_above_threshold\"} 2\n",
            "kvbridge_proxy_disaggregation_decisions_total{decision=\"disaggregate\",reason=\"no_cache_view\"} 0\n",
        ] {
            assert!(s.contains(line), "{line} in {s}");
        }
    }
}
