//! `bench pd` runs end to end on a tiny layout (figures are not checked, only accounting).

use clap::Parser;
use kvbridge_pd::bench::{measure, PdBenchArgs};

#[derive(Parser)]
struct W {
    #[command(flatten)]
    a: PdBenchArgs,
}

fn args(extra: &[&str]) -> PdBenchArgs {
    let base = [
        "bench",
        "--layers",
        "2",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--latent-dim",
        "32",
        "--chunk-tokens",
        "16",
        "--tokens",
        "100",
        "--requests",
        "4",
        "--reps",
        "1",
        "--deadline-s",
        "10",
    ];
    W::parse_from(base.iter().chain(extra)).a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standard_one_rank_accounts_every_byte() {
    let a = args(&[]);
    let per_req = a.spec().prompt_bytes(100);
    let r = measure(&a).await.unwrap();
    assert_eq!(r.bytes_per_rep, 4 * per_req);
    assert_eq!(r.kv_bytes_per_rep, 4 * per_req);
    let s = &r.summary;
    assert!(s.kv_gib_per_s > 0.0 && s.channel_gib_per_s > 0.0, "{r:?}");
    assert!(s.tail_latency_p50_ms.is_finite() && s.tail_latency_p50_ms >= 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_send_once_writes_once_for_two_ranks() {
    let a = args(&["--layout", "mla", "--tp", "2", "--mla-send-once"]);
    let per_req = a.spec().prompt_bytes(100);
    let r = measure(&a).await.unwrap();
    assert_eq!(r.bytes_per_rep, 4 * per_req);
    assert_eq!(r.kv_bytes_per_rep, 2 * 4 * per_req);
    let b = args(&["--layout", "mla", "--tp", "2"]);
    let r = measure(&b).await.unwrap();
    assert_eq!(r.bytes_per_rep, 2 * 4 * per_req);
    assert!(measure(&args(&["--tp", "2", "--mla-send-once"]))
        .await
        .is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_mode_accounts_every_byte_and_checks_the_kv() {
    let a = args(&["--mode", "pull", "--tp", "2"]);
    let per_req = a.spec().prompt_bytes(100);
    let r = measure(&a).await.unwrap();
    assert_eq!(r.mode, kvbridge_pd::TransferMode::Pull);
    assert_eq!(r.bytes_per_rep, 2 * 4 * per_req);
    assert!(r.summary.kv_gib_per_s > 0.0, "{r:?}");
}
