//! What the process-level tests share: a soak of small-model engines as real processes.

use kvbridge_sim::cli::{CostArgs, ModelArgs};
use kvbridge_sim::soak::SoakOptions;
use std::time::Duration;

/// 2P2D of this crate's engine and proxy binaries, a small model, no chaos, 30 s; tests
/// change what they are about.
pub fn soak_options() -> SoakOptions {
    SoakOptions {
        engine_cmd: vec![env!("CARGO_BIN_EXE_kvbridge-sim-engine").into()],
        proxy_cmd: vec![env!("CARGO_BIN_EXE_kvbridge-sim-proxy").into()],
        prefillers: 2,
        decoders: 2,
        duration: Duration::from_secs(30),
        max_requests: u64::MAX,
        chaos: false,
        chaos_interval: Duration::from_millis(1500),
        chaos_proxy: true,
        concurrency: 4,
        prompt_tokens: (40, 300),
        output_tokens: (4, 12),
        request_timeout: Duration::from_secs(20),
        kv_ready_timeout: Duration::from_secs(4),
        compare_every: 5,
        buffer_mib: 64,
        kv_ttl: Duration::from_secs(4),
        seed: 7,
        model: ModelArgs {
            model: "sim-soak".into(),
            layers: 4,
            kv_heads: 2,
            head_dim: 64,
            latent_dim: 0,
            dtype: "bf16".into(),
            chunk_tokens: 32,
            tp: 1,
        },
        cost: CostArgs {
            prefill_tokens_per_s: 20_000.0,
            decode_ms_per_token: 1.0,
            prefill_step_tokens: 0,
        },
        routing: kvbridge_proxy::routing::RoutingPolicy::LeastLoaded,
        progress: false,
    }
}
