//! `kvbridge bench transfer` as a user runs it (two processes, real sockets): the report's
//! shape with one and with several sessions, and a clear error for impossible flags. No
//! figure is checked here; performance lives in the benchmark itself.

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args([
            "bench", "transfer", "--total", "4M", "--reps", "1", "--json",
        ])
        .args(args)
        .output()
        .expect("run kvbridge bench transfer")
}

fn report(args: &[&str]) -> serde_json::Value {
    let out = bench(args);
    assert!(
        out.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON report")
}

#[test]
fn one_session_and_several_sessions_report_every_block_size() {
    for sessions in ["1", "3"] {
        let r = report(&[
            "--sessions",
            sessions,
            "--same-offsets",
            "--batch",
            "8",
            "--block-sizes",
            "4096,65536",
        ]);
        assert_eq!(r["sessions"].to_string(), sessions, "{r}");
        let rows = r["results"].as_array().expect("results");
        assert_eq!(rows.len(), 2, "{r}");
        for row in rows {
            assert!(row["gib_per_s"].as_f64().unwrap() > 0.0, "{r}");
            assert!(row["ceiling_gib_per_s"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
}

#[test]
fn more_sessions_than_ops_per_batch_is_a_clear_error() {
    let out = bench(&["--sessions", "9", "--batch", "8"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--sessions 9 exceeds --batch 8"), "{err}");
}

/// `--transport cma` measures the peer's unmappable memory against a memcpy; where this
/// host does not permit process_vm_writev between the two processes it says why instead.
#[test]
fn cma_reports_against_memcpy_or_says_why_not() {
    let out = bench(&[
        "--transport",
        "cma",
        "--batch",
        "8",
        "--block-sizes",
        "65536",
    ]);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("the session does not use cma: "), "{err}");
        eprintln!("cma not permitted here: {err}");
        return;
    }
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON report");
    assert_eq!(r["transport"], "cma", "{r}");
    assert_eq!(r["ceiling"], "memcpy", "{r}");
    let rows = r["results"].as_array().expect("results");
    assert_eq!(rows.len(), 1, "{r}");
    assert!(rows[0]["gib_per_s"].as_f64().unwrap() > 0.0, "{r}");
}
