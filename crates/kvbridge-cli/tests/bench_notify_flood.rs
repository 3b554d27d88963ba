//! `kvbridge bench notify-flood` end to end: three processes (the echoing listener, this
//! honest peer, a flooder started for each flooded phase and stopped after it), every round
//! trip answered, the flooder's notes counted.

mod common;
use std::process::Command;

#[test]
fn bench_notify_flood_reports_both_phases_of_each_run() {
    let v = common::run_json(Command::new(env!("CARGO_BIN_EXE_kvbridge")).args([
        "bench",
        "notify-flood",
        "--samples",
        "20",
        "--runs",
        "2",
        "--flood-warmup",
        "64",
        "--json",
    ]));
    assert_eq!(v["samples"], 20, "{v}");
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2, "{v}");
    for r in runs {
        for phase in ["quiet", "flooded"] {
            assert!(
                r[phase]["p99_us"].as_f64().is_some_and(|us| us > 0.0),
                "{phase}: {v}"
            );
        }
        assert!(
            r["flood_notes_per_s"].as_f64().is_some_and(|n| n >= 0.0),
            "{v}"
        );
    }
    assert!(v["p99_ratio"]["median"].as_f64().is_some(), "{v}");
}
