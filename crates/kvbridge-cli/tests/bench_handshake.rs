//! `kvbridge bench handshake --tls` end to end: the TLS listener process reads its
//! certificate and key from `KVBRIDGE_TLS_CERT`/`KVBRIDGE_TLS_KEY` files, the initiators
//! trust it, and both sides of the comparison report samples.

mod common;
use std::process::Command;

#[test]
fn bench_handshake_with_tls_reports_both_sides() {
    let v = common::run_json(
        Command::new(env!("CARGO_BIN_EXE_kvbridge"))
            .args(["bench", "handshake", "--tls", "--peers", "3", "--json"])
            .env_remove("KVBRIDGE_TLS_CA"),
    );
    assert_eq!(v["samples"], 3, "{v}");
    assert_eq!(v["tls"]["samples"], 3, "{v}");
    assert!(
        v["tls"]["p50_ms"].as_f64().is_some_and(|ms| ms > 0.0),
        "{v}"
    );
}
