//! `kvbridge demo --prefill-tp P --decode-tp D [--mla]`: KV pushed between different TP
//! sizes, byte-verified on every decoder rank, outputs equal to the colocated engine's, one
//! write per chunk and part, and the bytes moved exactly those the decoder ranks hold.

use clap::Parser;
use kvbridge_sim::demo::{self, DemoArgs, DemoSummary};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    demo: DemoArgs,
}

/// A small run (2 layers, 4 KV heads of 32 in all, 16-token chunks, free compute).
fn args(extra: &[&str]) -> DemoArgs {
    let mut a = vec![
        "demo",
        "--requests",
        "6",
        "--concurrency",
        "2",
        "--compare",
        "3",
        "--ttft-samples",
        "2",
        "--ceiling-reps",
        "0",
        "--prompt-tokens",
        "5..60",
        "--output-tokens",
        "2..6",
        "--chunk-tokens",
        "16",
        "--layers",
        "2",
        "--kv-heads",
        "4",
        "--head-dim",
        "32",
        "--buffer-mib",
        "16",
        "--prefill-tokens-per-s",
        "0",
        "--decode-ms-per-token",
        "0",
        "--json",
    ];
    a.extend_from_slice(extra);
    Cli::parse_from(a).demo
}

async fn run(extra: &[&str]) -> DemoSummary {
    demo::run(args(extra)).await.expect("the demo runs")
}

/// What every shape must show: a pass (outputs equal the colocated engine's, no failure,
/// no leak), no mismatched chunk, `parts` writes per chunk, and exactly the bytes needed.
fn check(s: &DemoSummary, tp: (u32, u32), parts: u64) {
    let t = s.table();
    assert!(s.passed(), "{t}");
    assert_eq!(s.kv_mismatches, 0, "{t}");
    assert!(s.outputs_match_colocated, "{t}");
    assert_eq!((s.prefill_tp, s.decode_tp), tp, "{t}");
    assert_eq!(s.kv_parts_per_chunk, parts, "{t}");
    assert!(s.kv_requests_pushed > 0, "{t}");
    assert_eq!(s.kv_writes, s.kv_chunks_pushed * parts, "{t}");
    assert!(s.kv_bytes_exact, "{t}");
    assert_eq!(s.kv_bytes, s.kv_bytes_needed, "{t}");
}

/// 1 -> 2: one prefiller rank feeds both decoder ranks, each its half of the heads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp_1_to_decode_tp_2() {
    let s = run(&["--prefill-tp", "1", "--decode-tp", "2"]).await;
    check(&s, (1, 2), 2);
}

/// 2 -> 1: two prefiller ranks fill one decoder rank's chunk, each its own heads; the chunk
/// counts only once both parts landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp_2_to_decode_tp_1() {
    let s = run(&["--prefill-tp", "2", "--decode-tp", "1"]).await;
    check(&s, (2, 1), 2);
}

/// 2 -> 4, push and pull.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_tp_2_to_decode_tp_4() {
    for mode in ["push", "pull"] {
        let s = run(&[
            "--prefill-tp",
            "2",
            "--decode-tp",
            "4",
            "--transfer-mode",
            mode,
        ])
        .await;
        check(&s, (2, 4), 4);
    }
}

/// MLA between different TP sizes: each decoder rank gets the latent once, from one
/// prefiller rank (4 parts per chunk for 4 decoder ranks, not 8), and 2 -> 1 moves it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_between_tp_sizes_sends_once_per_decoder_rank() {
    let s = run(&[
        "--mla",
        "--latent-dim",
        "64",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "4",
    ])
    .await;
    check(&s, (2, 4), 4);
    let s = run(&[
        "--mla",
        "--latent-dim",
        "64",
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
    ])
    .await;
    check(&s, (2, 1), 1);
}

/// Heads that do not split over one side's ranks are refused at start, naming both
/// layouts; nothing runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_not_divisible_refused_at_start_naming_both_layouts() {
    let e = demo::run(args(&["--prefill-tp", "3", "--decode-tp", "2"]))
        .await
        .expect_err("4 heads do not split over 3 ranks");
    let e = e.to_string();
    assert!(e.contains("do not split"), "{e}");
    assert!(
        e.contains("tp rank 0 of 3") && e.contains("tp rank 0 of 2"),
        "{e}"
    );
}
