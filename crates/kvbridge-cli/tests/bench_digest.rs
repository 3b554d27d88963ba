//! `kvbridge bench digest` end to end: the candidates' throughput table, and loads from a
//! peer process over TCP, shm and cma, unchecked and checked, each phase measured.

mod common;
use std::process::Command;

#[test]
fn bench_digest_reports_hashes_and_both_phases_per_transport() {
    let v = common::run_json(Command::new(env!("CARGO_BIN_EXE_kvbridge")).args([
        "bench",
        "digest",
        "--hash-sizes",
        "4K,64K",
        "--hash-bytes",
        "1M",
        "--reps",
        "1",
        "--blocks",
        "4",
        "--block-size",
        "64K",
        "--iters",
        "2",
        "--rounds",
        "2",
        "--json",
    ]));
    assert_eq!(v["algorithm"], "xxh3-64", "{v}");
    let hash = v["hash"].as_array().expect("hash rows");
    for name in ["memcpy", "xxh3-64", "crc32c", "blake3-keyed", "hmac-sha256"] {
        let rows: Vec<_> = hash.iter().filter(|r| r["algorithm"] == name).collect();
        assert_eq!(rows.len(), 2, "{name}: {v}");
        for r in rows {
            assert!(
                r["gib_per_s"].as_f64().is_some_and(|g| g > 0.0),
                "{name}: {v}"
            );
        }
    }
    let loads = v["loads"].as_array().expect("load rows");
    let transports: Vec<_> = loads.iter().map(|r| r["transport"].clone()).collect();
    assert_eq!(transports, ["tcp", "shm", "cma"], "{v}");
    for r in loads {
        for phase in ["unchecked_ms", "checked_ms"] {
            assert!(
                r[phase]["median"].as_f64().is_some_and(|ms| ms > 0.0),
                "{phase}: {v}"
            );
        }
        assert!(
            r["ratio"]["median"].as_f64().is_some_and(|x| x > 0.0),
            "{v}"
        );
    }
}
