//! `kvbridge bench grant` end to end: the peer process serves a plain region and its
//! windowed twin, the reads under the token are served (every read is checked byte for byte
//! inside the benchmark, so a refused or empty one fails the run), and both figures come
//! back for each block size.

mod common;
use std::process::Command;

#[test]
fn bench_grant_reads_both_regions_and_reports_both() {
    let v = common::run_json(Command::new(env!("CARGO_BIN_EXE_kvbridge")).args([
        "bench",
        "grant",
        "--blocks",
        "8",
        "--block-sizes",
        "4K,64K",
        "--iters",
        "5",
        "--reps",
        "2",
        "--json",
    ]));
    let rows = v["results"].as_array().expect("results");
    assert_eq!(rows.len(), 2, "{v}");
    for r in rows {
        for k in ["plain_us", "token_us", "ratio"] {
            assert!(r[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {v}");
        }
    }
}
