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

/// Between different TP sizes: one write per chunk and part of the push, the bytes written
/// exactly what the decoder ranks hold, every part checked byte for byte in the warm-up
/// (MLA: once per decoder rank, never once per prefiller rank).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_tp_differ_write_exactly_what_the_decoder_needs() {
    let chunks = 7; // 100 tokens in chunks of 16
    for (extra, parts) in [
        (&["--prefill-tp", "1", "--decode-tp", "2"][..], 2),
        (&["--prefill-tp", "2", "--decode-tp", "1"][..], 2),
        (&["--prefill-tp", "2", "--decode-tp", "4"][..], 4),
        (
            &["--prefill-tp", "2", "--decode-tp", "4", "--mode", "pull"][..],
            4,
        ),
        (
            &["--layout", "mla", "--prefill-tp", "2", "--decode-tp", "4"][..],
            4,
        ),
    ] {
        // 2 KV heads per rank at --tp 2: 4 in all.
        let mut flags = vec!["--tp", "2"];
        flags.extend_from_slice(extra);
        let a = args(&flags);
        let r = measure(&a).await.unwrap();
        let d = a.decode_tp.unwrap() as u64;
        let mla = a.spec().layout.is_mla();
        // The decoder ranks' KV: 4 heads in all split over d ranks, or the latent on each.
        let needed = if mla {
            d * a.spec().prompt_bytes(100)
        } else {
            2 * a.spec().prompt_bytes(100)
        };
        assert_eq!(r.kv_bytes_per_rep, 4 * needed, "{extra:?}");
        assert_eq!(r.bytes_per_rep, r.kv_bytes_per_rep, "{extra:?}");
        assert_eq!(r.bytes_per_request, needed, "{extra:?}");
        assert_eq!(r.ops_per_request, chunks * parts, "{extra:?}");
    }
    // Heads that do not split over a side's ranks are refused, naming both layouts.
    let e = measure(&args(&["--tp", "2", "--prefill-tp", "3"]))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("do not split") && e.contains("tp rank 0 of 3"),
        "{e}"
    );
}
