//! End to end through the proxy with every worker a real process (`kvbridge-sim-engine`,
//! `kvbridge-sim-proxy`): 50 requests (completions and chat, streamed and not) whose
//! disaggregated outputs must each equal the colocated engine's, in the topologies users run:
//! 1P2D, 2P1D, tensor parallel 2, and the MLA layout. No chaos: every request must succeed,
//! no KV byte may differ and every page must come back.

mod common;

use kvbridge_sim::cli::{CostArgs, ModelArgs};
use kvbridge_sim::soak::{self, SoakOptions};
use std::time::Duration;

const REQUESTS: u64 = 50;

fn options(prefillers: u32, decoders: u32, tp: u32, latent_dim: u32) -> SoakOptions {
    let base = common::soak_options();
    SoakOptions {
        prefillers,
        decoders,
        // An upper bound: the run ends after its 50 requests.
        duration: Duration::from_secs(120),
        max_requests: REQUESTS,
        prompt_tokens: (1, 150),
        output_tokens: (2, 10),
        kv_ready_timeout: Duration::from_secs(10),
        compare_every: 1,
        buffer_mib: 32,
        kv_ttl: Duration::from_secs(10),
        seed: 11 + u64::from(prefillers * 7 + decoders * 3 + tp + latent_dim),
        model: ModelArgs {
            latent_dim,
            tp,
            ..base.model.clone()
        },
        cost: CostArgs {
            prefill_tokens_per_s: 50_000.0,
            decode_ms_per_token: 0.5,
            // Two 32-token pages per prefill step: a step's pages move together.
            prefill_step_tokens: 64,
        },
        ..base
    }
}

async fn check(o: SoakOptions) {
    let s = soak::run(o)
        .await
        .expect("the processes start and the run ends");
    println!("{}", s.table());
    assert_eq!(s.requests, REQUESTS, "{s:#?}");
    assert_eq!(s.ok, REQUESTS, "every request succeeds: {s:#?}");
    assert_eq!(s.failed, 0, "{s:#?}");
    assert_eq!(s.hangs, 0, "{s:#?}");
    // Every workload answer and every recovery answer was compared with the colocated one.
    assert!(s.outputs_compared >= REQUESTS, "{s:#?}");
    assert_eq!(s.outputs_mismatched, 0, "{s:#?}");
    assert_eq!(s.kv_mismatches, 0, "{s:#?}");
    assert_eq!(s.pages_leaked, 0, "{s:#?}");
    assert!(s.quiesced, "every page came back: {s:#?}");
    assert!(s.errors.is_empty(), "{s:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_prefiller_two_decoders_as_processes() {
    check(options(1, 2, 1, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_prefillers_one_decoder_as_processes() {
    check(options(2, 1, 1, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_parallel_two_ranks_as_processes() {
    check(options(1, 1, 2, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_layout_as_processes() {
    check(options(1, 1, 1, 64)).await;
}
