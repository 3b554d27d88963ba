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
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 40_000.0,
            decode_per_token: Duration::from_millis(4),
        }
    }
}

impl CostModel {
    /// No simulated cost at all (tests of correctness only).
    pub const FREE: CostModel = CostModel {
        prefill_tokens_per_s: 0.0,
        decode_per_token: Duration::ZERO,
    };

    /// Simulated time to prefill `tokens` tokens.
    pub fn prefill_time(&self, tokens: u64) -> Duration {
        if self.prefill_tokens_per_s > 0.0 && self.prefill_tokens_per_s.is_finite() {
            Duration::from_secs_f64(tokens as f64 / self.prefill_tokens_per_s)
        } else {
            Duration::ZERO
        }
    }
}
