//! The quick soak CI runs: the proxy and four workers as real processes, a workload through
//! the proxy, and `kill -9` of every worker and the proxy in turn (~1.5 s apart), each restarted on
//! its ports (a decoder restarting under the same id). No request may hang, no KV byte may
//! differ, no page may stay taken, and requests must succeed again once the chaos stops.
//! The long run is `kvbridge demo --duration 30m --chaos` (see docs/reliability.md).

use kvbridge_sim::cli::{CostArgs, ModelArgs};
use kvbridge_sim::soak::{self, SoakOptions};
use std::time::Duration;

fn options(chaos: bool, duration: Duration) -> SoakOptions {
    SoakOptions {
        engine_cmd: vec![env!("CARGO_BIN_EXE_kvbridge-sim-engine").into()],
        proxy_cmd: vec![env!("CARGO_BIN_EXE_kvbridge-sim-proxy").into()],
        prefillers: 2,
        decoders: 2,
        duration,
        max_requests: u64::MAX,
        chaos,
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
        },
        progress: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_kills_lose_nothing_and_hang_nothing() {
    let s = soak::run(options(true, Duration::from_secs(12)))
        .await
        .expect("the soak runs");
    println!("{}", s.table());
    assert_eq!(s.hangs, 0, "{s:#?}");
    assert_eq!(s.kv_mismatches, 0, "{s:#?}");
    assert_eq!(s.outputs_mismatched, 0, "{s:#?}");
    assert_eq!(s.pages_leaked, 0, "{s:#?}");
    assert!(s.quiesced, "{s:#?}");
    assert!(
        s.kills >= 5,
        "chaos must have killed every process once: {s:#?}"
    );
    assert_eq!(s.restarts, s.kills, "{s:#?}");
    assert!(s.ok > 0 && s.outputs_compared > 0, "{s:#?}");
    assert!(s.passed(), "{}", s.table());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_chaos_every_request_succeeds() {
    let s = soak::run(options(false, Duration::from_secs(4)))
        .await
        .expect("the soak runs");
    assert_eq!(s.failed, 0, "{}", s.table());
    assert_eq!(s.kills, 0);
    assert!(s.passed(), "{}", s.table());
}
