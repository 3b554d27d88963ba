//! A proxy benchmark that saw failed requests fails loudly and reports no throughput:
//! `bench/proxy.sh` and `kvbridge bench proxy`, run against backends that answer 503 to
//! every request the proxy sends them (tests/python/failing_backend.py; the direct baseline
//! passes, so the failure is the proxy measurement's). Skipped, with a note, without `wrk`
//! and `python3` (required in CI).

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

fn tools_ready() -> bool {
    ["wrk", "python3", "curl"].iter().all(|t| {
        Command::new("sh")
            .args(["-c", &format!("command -v {t}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// Runs `cmd` to its end within `limit` (killed past it), with its output.
fn run_within(mut cmd: Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn with_failing_backends(cmd: &mut Command, work: &Path) {
    cmd.env("MOCK", format!("{ROOT}/tests/python/failing_backend.py"))
        .env("KVBRIDGE", env!("CARGO_BIN_EXE_kvbridge"))
        .env("BENCH_DIR", work)
        .env("ROUTERS", "")
        .env("DUR", "1")
        .env_remove("RESULTS");
}

fn assert_failed_without_figures(out: &Output) {
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(!out.status.success(), "exit 0\n{stdout}\n{stderr}");
    assert!(
        stderr.contains("FAILED: kvbridge") && stderr.contains("Non-2xx"),
        "the proxy's failed requests are named\n{stderr}"
    );
    for figure in ["rps", "| kvbridge", "us |"] {
        assert!(!stdout.contains(figure), "a figure was printed\n{stdout}");
    }
}

#[test]
fn a_proxy_benchmark_that_saw_failed_requests_fails_and_prints_no_throughput() {
    if !tools_ready() {
        assert!(
            std::env::var_os("CI").is_none(),
            "wrk, curl and python3 are required in CI"
        );
        eprintln!("SKIPPED: wrk, curl or python3 not found (apt-get install -y wrk)");
        return;
    }
    let work = std::env::temp_dir().join(format!("kvbridge-bench-fail-{}", std::process::id()));
    let mut script = Command::new("bash");
    script.arg(format!("{ROOT}/bench/proxy.sh"));
    with_failing_backends(&mut script, &work);
    assert_failed_without_figures(&run_within(script, Duration::from_secs(120)));

    let mut bench = Command::new(env!("CARGO_BIN_EXE_kvbridge"));
    bench.args([
        "bench",
        "proxy",
        "--runs",
        "2",
        "--dur",
        "1",
        "--routers",
        "",
    ]);
    with_failing_backends(&mut bench, &work);
    let out = run_within(bench, Duration::from_secs(120));
    assert_failed_without_figures(&out);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("run 1 of 2 failed"),
        "the first failed run ends the benchmark"
    );
    let _ = std::fs::remove_dir_all(&work);
}
