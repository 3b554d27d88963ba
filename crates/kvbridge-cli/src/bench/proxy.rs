//! `kvbridge bench proxy`: reruns `bench/proxy.sh` (this proxy in the vllm flow against the
//! peer routers that are installed, all in front of the same mock backends) several times and
//! prints the median of each figure. A run that saw any failed request fails the whole
//! benchmark, with no figure: it measured errors, not a proxy.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

/// Flags of `kvbridge bench proxy`.
#[derive(Debug, clap::Args)]
pub struct ProxyBenchArgs {
    /// Runs of the whole comparison; each figure is the median over runs.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub runs: u32,
    /// Seconds of load per measurement (wrk's duration).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=60))]
    pub dur: u32,
    /// Peer routers to compare with; by default those installed in
    /// $PEERS_DIR/venv (~/.cache/kvbridge-peers), among sglang and vllm.
    #[arg(long, value_delimiter = ',')]
    pub routers: Option<Vec<String>>,
    /// The benchmark script [default: bench/proxy.sh of this source tree].
    #[arg(long)]
    pub script: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Medians of one proxy's figures.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyRow {
    /// `kvbridge`, `sglang-router`, `vllm-router`.
    pub name: String,
    /// Proxy CPU time (user + system) per request at 16 connections, microseconds.
    pub cpu_us: f64,
    /// Requests per second at 16 connections.
    pub rps: f64,
    /// Median latency at 1 connection, milliseconds.
    pub p50_ms: f64,
    /// `p50_ms` minus the same figure against one backend directly.
    pub added_ms: f64,
    /// Resident memory after the load, MB.
    pub rss_mb: f64,
    /// A streamed answer of 8 tokens 2 ms apart, milliseconds (a Nagle stall adds ~40 ms).
    pub stream_ms: f64,
}

/// The whole comparison.
#[derive(Debug, Clone, Serialize)]
pub struct ProxyBench {
    /// Runs taken.
    pub runs: u32,
    /// Seconds of load per measurement.
    pub dur_s: u32,
    /// Median p50 at 1 connection against one backend directly, milliseconds.
    pub direct_p50_ms: f64,
    /// One row per proxy, kvbridge first.
    pub rows: Vec<ProxyRow>,
}

fn installed_routers() -> Vec<String> {
    let dir = std::env::var_os("PEERS_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvbridge-peers"))
        })
        .unwrap_or_default()
        .join("venv");
    let mut r = Vec::new();
    let sglang = std::fs::read_dir(dir.join("lib"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|py| py.path().join("site-packages/sglang_router").is_dir());
    if sglang {
        r.push("sglang".to_string());
    }
    if dir.join("bin/vllm-router").is_file() {
        r.push("vllm".to_string());
    }
    r
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    super::sample::median(v.to_vec())
}

/// Runs the comparison.
pub fn run(args: &ProxyBenchArgs) -> Result<ProxyBench> {
    let script = match &args.script {
        Some(s) => s.clone(),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/proxy.sh"),
    };
    if !script.is_file() {
        bail!(
            "no benchmark script at {} (pass --script)",
            script.display()
        );
    }
    let exe = std::env::current_exe().context("finding this kvbridge binary")?;
    let routers = args.routers.clone().unwrap_or_else(installed_routers);
    let results =
        std::env::temp_dir().join(format!("kvbridge-bench-proxy-{}.tsv", std::process::id()));
    let _ = std::fs::remove_file(&results);
    // The mock backends are built first, under their own limit: on a fresh machine the build
    // takes minutes, which the limit of a run below must not count.
    eprintln!("building the mock backends (once)");
    let build = Command::new("bash")
        .arg(&script)
        .arg("--build")
        .stdout(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {} --build", script.display()))?;
    let status = wait_within(build, BUILD_LIMIT, &script)?;
    if !status.success() {
        bail!("{} --build failed: {status}", script.display());
    }
    // Each run: 1 + 2 x dur seconds of load per proxy, plus starts, streams and a margin.
    let per_run = Duration::from_secs(60 + u64::from(args.dur) * 4 * (1 + routers.len() as u64));
    for i in 0..args.runs {
        eprintln!(
            "run {}/{} (routers: {})",
            i + 1,
            args.runs,
            if routers.is_empty() {
                "none".into()
            } else {
                routers.join(" ")
            }
        );
        let child = Command::new("bash")
            .arg(&script)
            .env("DUR", args.dur.to_string())
            .env("ROUTERS", routers.join(" "))
            .env("KVBRIDGE", &exe)
            .env("RESULTS", &results)
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", script.display()))?;
        let status = wait_within(child, per_run, &script)?;
        if !status.success() {
            let _ = std::fs::remove_file(&results);
            bail!(
                "run {} of {} failed ({status}; its reason is above): no figures are reported",
                i + 1,
                args.runs
            );
        }
    }
    let text = std::fs::read_to_string(&results).context("reading the script's results")?;
    let _ = std::fs::remove_file(&results);
    parse(&text, args.runs, args.dur)
}

/// Longest the mock backends' first build may take.
const BUILD_LIMIT: Duration = Duration::from_secs(30 * 60);

/// Waits for `child` (running `script`) at most `limit`; kills it past that.
fn wait_within(
    mut child: std::process::Child,
    limit: Duration,
    script: &std::path::Path,
) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{} did not finish within {limit:?}", script.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Medians of the script's result lines; a line that reports failed requests fails it all.
fn parse(text: &str, runs: u32, dur_s: u32) -> Result<ProxyBench> {
    type Cols = [Vec<f64>; 6];
    let mut by: BTreeMap<String, (usize, Cols)> = BTreeMap::new();
    let mut direct = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() < 8 {
            continue;
        }
        if f[0] == "direct" {
            direct.extend(f[3].parse::<f64>().ok());
            continue;
        }
        if f[7].trim() != "none" {
            bail!(
                "{} saw failed requests ({}): no figures are reported",
                f[0],
                f[7].trim()
            );
        }
        let e = by
            .entry(f[0].to_string())
            .or_insert((i, Default::default()));
        for (c, idx) in [1, 2, 3, 4, 5, 6].into_iter().enumerate() {
            if let Ok(v) = f[idx].parse::<f64>() {
                e.1[c].push(v);
            }
        }
    }
    if by.is_empty() {
        bail!("the script reported no result");
    }
    let mut rows: Vec<(usize, ProxyRow)> = by
        .into_iter()
        .map(|(name, (first, c))| {
            (
                first,
                ProxyRow {
                    name,
                    cpu_us: median(&c[0]),
                    rps: median(&c[1]),
                    p50_ms: median(&c[2]),
                    added_ms: median(&c[3]),
                    rss_mb: median(&c[4]),
                    stream_ms: median(&c[5]),
                },
            )
        })
        .collect();
    rows.sort_by_key(|(first, _)| *first);
    Ok(ProxyBench {
        runs,
        dur_s,
        direct_p50_ms: median(&direct),
        rows: rows.into_iter().map(|(_, r)| r).collect(),
    })
}

/// The comparison as a markdown table.
pub fn table(b: &ProxyBench) -> String {
    let best_peer = b
        .rows
        .iter()
        .filter(|r| r.name.ends_with("-router"))
        .map(|r| r.rps)
        .fold(f64::NAN, f64::max);
    let mut s = format!(
        "medians of {} runs, {} s of load each; direct backend p50 at 1 conn: {:.3} ms\n\n\
         every request of every run answered 2xx\n\n\
         | proxy | CPU per request | rps at 16 conns | vs best peer | p50 at 1 conn (added) | RSS | streamed 8 tokens |\n\
         |---|---|---|---|---|---|---|\n",
        b.runs, b.dur_s, b.direct_p50_ms
    );
    for r in &b.rows {
        let ratio = if best_peer.is_nan() {
            "-".to_string()
        } else {
            format!("{:.2}x", r.rps / best_peer)
        };
        s.push_str(&format!(
            "| {} | {:.1} us | {:.0} | {} | {:.3} ms (+{:.3}) | {:.1} MB | {:.1} ms |\n",
            r.name, r.cpu_us, r.rps, ratio, r.p50_ms, r.added_ms, r.rss_mb, r.stream_ms,
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_per_proxy_in_first_seen_order() {
        let t = "kvbridge\t40\t13000\t0.3\t0.28\t13\t30\tnone\n\
                 sglang-router\t150\t4000\t0.4\t0.38\t90\t27\tnone\n\
                 direct\t\t\t0.02\t\t\t26\tnone\n\
                 kvbridge\t50\t15000\t0.2\t0.18\t14\t31\tnone\n\
                 sglang-router\t160\t5000\t0.5\t0.48\t91\t28\tnone\n\
                 kvbridge\t45\t14000\t0.25\t0.23\t13.5\t29\tnone\n\
                 garbage\n";
        let b = parse(t, 3, 3).unwrap();
        assert_eq!(b.rows.len(), 2);
        assert_eq!(b.rows[0].name, "kvbridge");
        assert_eq!(b.rows[0].cpu_us, 45.0);
        assert_eq!(b.rows[0].rps, 14000.0);
        assert_eq!(b.rows[1].rps, 5000.0);
        assert_eq!(b.direct_p50_ms, 0.02);
        let s = table(&b);
        assert!(s.contains("| kvbridge | 45.0 us | 14000 | 2.80x |"), "{s}");
        assert!(parse("", 1, 1).is_err());
    }

    /// One line with failed requests fails the benchmark: no rows, no throughput.
    #[test]
    fn a_run_with_failed_requests_gives_no_figures() {
        let t = "kvbridge\t40\t13000\t0.3\t0.28\t13\t30\tnone\n\
                 kvbridge\t50\t35831\t0.2\t0.18\t14\t31\tNon-2xx or 3xx responses: 101321\n";
        let e = parse(t, 2, 3).unwrap_err().to_string();
        assert!(e.contains("failed requests") && e.contains("101321"), "{e}");
    }
}
