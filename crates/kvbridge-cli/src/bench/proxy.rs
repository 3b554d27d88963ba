//! `kvbridge bench proxy`: reruns `bench/proxy.sh` (this proxy in the vllm flow against the
//! peer routers that are installed, all in front of the same mock backends) several times and
//! prints the median of each figure.

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
    /// Runs in which wrk reported errors or non-2xx answers.
    pub runs_with_errors: u32,
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
    super::median(v.to_vec())
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
        let mut child = Command::new("bash")
            .arg(&script)
            .env("DUR", args.dur.to_string())
            .env("ROUTERS", routers.join(" "))
            .env("KVBRIDGE", &exe)
            .env("RESULTS", &results)
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", script.display()))?;
        let deadline = Instant::now() + per_run;
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break s;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{} did not finish within {per_run:?}", script.display());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        if !status.success() {
            bail!("{} failed: {status}", script.display());
        }
    }
    let text = std::fs::read_to_string(&results).context("reading the script's results")?;
    let _ = std::fs::remove_file(&results);
    parse(&text, args.runs, args.dur)
}

fn parse(text: &str, runs: u32, dur_s: u32) -> Result<ProxyBench> {
    type Cols = [Vec<f64>; 6];
    let mut by: BTreeMap<String, (usize, Cols, u32)> = BTreeMap::new();
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
        let e = by
            .entry(f[0].to_string())
            .or_insert((i, Default::default(), 0));
        for (c, idx) in [1, 2, 3, 4, 5, 6].into_iter().enumerate() {
            if let Ok(v) = f[idx].parse::<f64>() {
                e.1[c].push(v);
            }
        }
        e.2 += (f[7].trim() != "none") as u32;
    }
    if by.is_empty() {
        bail!("the script reported no result");
    }
    let mut rows: Vec<(usize, ProxyRow)> = by
        .into_iter()
        .map(|(name, (first, c, errs))| {
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
                    runs_with_errors: errs,
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
         | proxy | CPU per request | rps at 16 conns | vs best peer | p50 at 1 conn (added) | RSS | streamed 8 tokens | runs with errors |\n\
         |---|---|---|---|---|---|---|---|\n",
        b.runs, b.dur_s, b.direct_p50_ms
    );
    for r in &b.rows {
        let ratio = if best_peer.is_nan() {
            "-".to_string()
        } else {
            format!("{:.2}x", r.rps / best_peer)
        };
        s.push_str(&format!(
            "| {} | {:.1} us | {:.0} | {} | {:.3} ms (+{:.3}) | {:.1} MB | {:.1} ms | {} |\n",
            r.name,
            r.cpu_us,
            r.rps,
            ratio,
            r.p50_ms,
            r.added_ms,
            r.rss_mb,
            r.stream_ms,
            r.runs_with_errors
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
                 sglang-router\t160\t5000\t0.5\t0.48\t91\t28\tNon-2xx 3\n\
                 kvbridge\t45\t14000\t0.25\t0.23\t13.5\t29\tnone\n\
                 garbage\n";
        let b = parse(t, 3, 3).unwrap();
        assert_eq!(b.rows.len(), 2);
        assert_eq!(b.rows[0].name, "kvbridge");
        assert_eq!(b.rows[0].cpu_us, 45.0);
        assert_eq!(b.rows[0].rps, 14000.0);
        assert_eq!(b.rows[1].runs_with_errors, 1);
        assert_eq!(b.direct_p50_ms, 0.02);
        let s = table(&b);
        assert!(s.contains("| kvbridge | 45.0 us | 14000 | 2.80x |"), "{s}");
        assert!(parse("", 1, 1).is_err());
    }
}
