//! `kvbridge demo` itself, small: its flags reach the engines and its summary passes.

use clap::Parser;
use kvbridge_sim::demo::{self, DemoArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    demo: DemoArgs,
}

fn args(extra: &[&str]) -> DemoArgs {
    let mut a = vec![
        "demo",
        "--requests",
        "6",
        "--concurrency",
        "2",
        "--compare",
        "3",
        "--prompt-tokens",
        "5..60",
        "--output-tokens",
        "2..6",
        "--chunk-tokens",
        "16",
        "--layers",
        "2",
        "--kv-heads",
        "2",
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

/// `--transfer-mode pull`: the summary says pull and the run passes (outputs equal the
/// colocated engine's, no mismatch, no leak).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_mode_pull_runs_and_passes() {
    for mode in ["pull", "push"] {
        let s = demo::run(args(&["--transfer-mode", mode]))
            .await
            .expect("the demo runs");
        assert_eq!(s.transfer_mode, mode);
        assert!(s.setup.contains(mode), "{}", s.setup);
        assert!(s.passed(), "{mode}: {}", s.table());
        assert_eq!(s.kv_mismatches, 0);
    }
}

#[test]
fn transfer_mode_rejects_other_values() {
    let r = Cli::try_parse_from(["demo", "--transfer-mode", "sideways"]);
    assert!(r.is_err());
}
