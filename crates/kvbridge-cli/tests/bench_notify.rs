//! `kvbridge bench notify` end to end: the echoing peer process answers every notification
//! and every raw ping, and the notifications took the fast lane past the data writer.

mod common;
use std::process::Command;

#[test]
fn bench_notify_reports_the_three_latencies() {
    let v = common::run_json(
        Command::new(env!("CARGO_BIN_EXE_kvbridge"))
            .args(["bench", "notify", "--samples", "20", "--json"])
            .env("KVBRIDGE_DATA_THREADS", "1"),
    );
    assert_eq!(v["samples"], 20, "{v}");
    for k in ["tcp_round_trip", "notify_reply", "notify_delivered"] {
        assert!(
            v[k]["p50_us"].as_f64().is_some_and(|us| us > 0.0),
            "{k}: {v}"
        );
    }
    assert!(
        v["frames_direct"].as_u64().is_some_and(|n| n > 0),
        "no notification skipped the writer: {v}"
    );
}
