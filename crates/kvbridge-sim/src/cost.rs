//! The cost model: how long prefill and decode take, so TTFT and throughput mean something.

use std::time::Duration;

/// Prefill throughput and decode latency of the simulated accelerator.
///
/// An 8B model on one H100-class accelerator prefills roughly 10-20 k tokens/s and decodes
/// one token every ~8-12 ms at small batch. The defaults keep that shape (prefill about
/// 1000x faster per token than decode) but run 2-4x faster, so `kvbridge demo` finishes in
/// well under a minute on 2 cores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Prompt tokens per second of prefill (one prefill at a time per engine, as on one
    /// accelerator). 0 or less: as fast as the CPU goes.
    pub prefill_tokens_per_s: f64,
    /// Time per generated token (decodes of different requests run side by side, as in a
    /// batch).
    pub decode_per_token: Duration,
    /// Prompt tokens the accelerator prefills in one step (chunked prefill). A step's KV
    /// exists only when the step ends; it then moves in pages of the KV spec's
    /// `chunk_tokens`, so a step larger than a page lets the decoder take in the first pages
    /// of the last step while the rest still land. 0, or less than a page: one page per
    /// step. Rounded down to whole pages.
    pub prefill_step_tokens: u32,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 40_000.0,
            decode_per_token: Duration::from_millis(4),
            prefill_step_tokens: 0,
        }
    }
}

impl CostModel {
    /// No simulated cost at all (tests of correctness only).
    pub const FREE: CostModel = CostModel {
        prefill_tokens_per_s: 0.0,
        decode_per_token: Duration::ZERO,
        prefill_step_tokens: 0,
    };

    /// Pages of `page_tokens` tokens in one prefill step (at least 1).
    pub fn pages_per_step(&self, page_tokens: u32) -> usize {
        (self.prefill_step_tokens / page_tokens.max(1)).max(1) as usize
    }

    /// Simulated time to prefill `tokens` tokens.
    pub fn prefill_time(&self, tokens: u64) -> Duration {
        if self.prefill_tokens_per_s > 0.0 && self.prefill_tokens_per_s.is_finite() {
            Duration::from_secs_f64(tokens as f64 / self.prefill_tokens_per_s)
        } else {
            Duration::ZERO
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_whole_pages_and_at_least_one() {
        let step = |t| CostModel {
            prefill_step_tokens: t,
            ..CostModel::default()
        };
        assert_eq!(step(0).pages_per_step(256), 1);
        assert_eq!(step(100).pages_per_step(256), 1, "less than a page");
        assert_eq!(step(256).pages_per_step(128), 2);
        assert_eq!(step(300).pages_per_step(128), 2, "rounded down");
        assert_eq!(
            step(256).pages_per_step(0),
            256,
            "a zero page counts as one token"
        );
    }
}
