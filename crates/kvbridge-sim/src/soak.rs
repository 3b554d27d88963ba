//! The soak: `kvbridge demo --duration 30m --chaos`.
//!
//! Unlike the plain demo, the proxy and every worker run as real child processes, so chaos is
//! a real `kill -9`: at random intervals one of them (every prefiller, decoder and the proxy in
//! turn, in a shuffled order) is killed, left down for a moment, and started again on the same ports (a decoder restarting
//! under the same id). A workload runs through the proxy the whole time, every request with
//! a deadline. The summary shows what a user must be able to rely on:
//!
//! - **no hang**: every request ended (answer or clear error) within its deadline;
//! - **no corruption**: the decoders' KV mismatch counters stay 0, and a sample of answers
//!   equals the colocated reference engine's answer for the same request;
//! - **no leak**: once the load stops, every live decoder's pages come back (within the KV
//!   TTL) and its `pages_leaked` counter is 0;
//! - **flat memory**: the resident size of every process that lived through the run, from
//!   after warm-up to the end of the workload (not after it: teardown frees memory and
//!   would hide growth);
//! - **recovery**: after the chaos stops, requests succeed again.
//!
//! One task (the supervisor, [`run`]'s own) owns every child process: it kills, restarts
//! and polls them; the workload tasks only know the proxy's fixed address.

use crate::cli::{CostArgs, ModelArgs};
use crate::client::{Client, ClientError};
use crate::cost::CostModel;
use crate::demo::{range, work_item, DemoArgs, WorkItem, Workload};
use crate::engine::{self, EngineConfig, Role};
use crate::model::{Model, SplitMix};
use crate::prompt_format::PromptFormat;
use crate::stable_ports::StablePorts;
use kvbridge_proxy::routing::RoutingPolicy;
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

/// How long a child process may take to print its addresses.
const START_DEADLINE: Duration = Duration::from_secs(30);
/// How often the supervisor polls every process's counters and memory.
const POLL_EVERY: Duration = Duration::from_secs(1);
/// How long a SIGKILLed process may take to be gone. Linux frees a process's memory before it
/// closes its files, so on a loaded host a decoder with a large buffer keeps its listening
/// ports for seconds after the signal; starting it again before it is reaped fails with
/// `EADDRINUSE`.
const EXIT_DEADLINE: Duration = Duration::from_secs(60);
/// Requests sent after the chaos stops; all must succeed.
const RECOVERY_REQUESTS: u64 = 8;
/// A workload never sends more than this many requests, whatever the duration.
const MAX_REQUESTS: u64 = 10_000_000;

/// What the soak runs.
#[derive(Debug, Clone)]
pub struct SoakOptions {
    /// The program (and leading arguments) that starts one engine, e.g. `kvbridge engine`.
    pub engine_cmd: Vec<OsString>,
    /// The program (and leading arguments) that starts the proxy, e.g. `kvbridge proxy`.
    pub proxy_cmd: Vec<OsString>,
    /// Prefill engines.
    pub prefillers: u32,
    /// Decode engines.
    pub decoders: u32,
    /// How long the workload runs (at most).
    pub duration: Duration,
    /// Requests the workload sends at most (it ends at whichever of this and `duration`
    /// comes first): a fixed workload for tests.
    pub max_requests: u64,
    /// Whether to kill and restart processes during the run.
    pub chaos: bool,
    /// Mean time between two kills (each is drawn from 0.5x to 1.5x of it).
    pub chaos_interval: Duration,
    /// Whether the proxy is among the processes chaos kills.
    pub chaos_proxy: bool,
    /// Requests in flight at once.
    pub concurrency: u32,
    /// Prompt length range, tokens.
    pub prompt_tokens: (u32, u32),
    /// Output length range, tokens.
    pub output_tokens: (u32, u32),
    /// A request's deadline at the client: a request still open after it is a hang.
    pub request_timeout: Duration,
    /// The proxy's KV-ready deadline (must be well under `request_timeout`).
    pub kv_ready_timeout: Duration,
    /// Every n-th successful request is replayed on the colocated engine and compared.
    pub compare_every: u64,
    /// Receive buffer per decoder rank, MiB.
    pub buffer_mib: u64,
    /// The decoders' KV TTL (unclaimed KV returns after it).
    pub kv_ttl: Duration,
    /// Workload and chaos seed.
    pub seed: u64,
    /// The model.
    pub model: ModelArgs,
    /// The cost model.
    pub cost: CostArgs,
    /// The proxy's routing policy. Under `cache-aware` and `kv-events` every engine keeps a
    /// prefix cache of [`SOAK_PREFIX_CACHE_TOKENS`]; under `kv-events` each also publishes its
    /// KV events on a port it keeps across restarts, so that a killed engine's restart is a
    /// gap in the proxy's stream, rebuilt while the chaos goes on.
    pub routing: RoutingPolicy,
    /// Whether to print progress on stderr.
    pub progress: bool,
}

/// The prefix cache of every engine of a soak that routes by cache: the shared-prefix
/// workload's (docs/proxy.md).
pub const SOAK_PREFIX_CACHE_TOKENS: u64 = 12_288;

/// Memory of one process over the run.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryTrack {
    /// The process (`demo` is the soak's own process: client and colocated engine).
    pub name: String,
    /// Resident size after warm-up, MiB.
    pub start_mib: f64,
    /// Resident size at the end, MiB.
    pub end_mib: f64,
    /// Largest resident size seen, MiB.
    pub max_mib: f64,
    /// Whether it was restarted after warm-up (then its growth says nothing).
    pub restarted: bool,
    /// Resident size over the run, MiB, evenly spaced from warm-up to the last poll (at most
    /// [`MEMORY_SAMPLES`] points): tells a plateau from a steady leak.
    pub samples_mib: Vec<f64>,
    /// Polls between two kept samples (doubles whenever the samples fill up).
    #[serde(skip)]
    stride: u32,
    /// Polls since the last kept sample.
    #[serde(skip)]
    since: u32,
}

/// Most points of [`MemoryTrack::samples_mib`].
pub const MEMORY_SAMPLES: usize = 32;

impl MemoryTrack {
    /// A track that starts (after warm-up) at `mib`.
    pub fn new(name: &str, mib: f64) -> MemoryTrack {
        MemoryTrack {
            name: name.to_string(),
            start_mib: mib,
            end_mib: mib,
            max_mib: mib,
            restarted: false,
            samples_mib: vec![mib],
            stride: 1,
            since: 0,
        }
    }

    /// Records one poll: the end and the maximum, and every `stride`-th poll as a sample;
    /// when the samples fill up, every other one is dropped and the stride doubles, so they
    /// stay evenly spaced over any length of run in bounded memory.
    pub fn record(&mut self, mib: f64) {
        self.end_mib = mib;
        self.max_mib = self.max_mib.max(mib);
        self.since += 1;
        if self.since < self.stride {
            return;
        }
        self.since = 0;
        if self.samples_mib.len() == MEMORY_SAMPLES {
            let kept: Vec<f64> = self.samples_mib.iter().copied().step_by(2).collect();
            self.samples_mib = kept;
            self.stride *= 2;
        }
        self.samples_mib.push(mib);
    }

    /// Flat: the end is within 30% (plus 32 MiB of slack for allocator and page-cache noise)
    /// of the size after warm-up.
    pub fn flat(&self) -> bool {
        self.restarted || self.end_mib <= self.start_mib * 1.3 + 32.0
    }
}

/// The soak's result.
#[derive(Debug, Clone, Serialize)]
pub struct SoakSummary {
    /// Wall time of the workload, s.
    pub duration_s: f64,
    /// Requests sent.
    pub requests: u64,
    /// Answered in full.
    pub ok: u64,
    /// Ended with a clear error (expected while processes are down).
    pub failed: u64,
    /// Still open at their deadline (must be 0).
    pub hangs: u64,
    /// Failures by kind (HTTP status and error code, `sse_error`, `connect`, ...).
    pub failures_by_kind: BTreeMap<String, u64>,
    /// The first failure of each kind, as the client saw it.
    pub failure_examples: BTreeMap<String, String>,
    /// Processes killed with SIGKILL.
    pub kills: u64,
    /// Processes started again.
    pub restarts: u64,
    /// Restarts that failed (the port was taken, the process did not come up).
    pub restart_failures: u64,
    /// The longest time from a SIGKILL to the process being reaped, ms: a restart waits for it.
    pub slowest_exit_ms: u64,
    /// KV chunks that differed from the expected KV, over every decoder incarnation (must be 0).
    pub kv_mismatches: u64,
    /// Answers replayed on the colocated engine.
    pub outputs_compared: u64,
    /// Of those, answers that differed (must be 0).
    pub outputs_mismatched: u64,
    /// Pages not back on the live decoders once the load stopped and the KV TTL passed, plus
    /// their `pages_leaked` counters (must be 0).
    pub pages_leaked: u64,
    /// Whether every decoder was idle with all pages free before the deadline.
    pub quiesced: bool,
    /// Under `kv-events` routing, KV-events batches the proxy applied since its last start,
    /// from its `/metrics` after the run (must be more than 0); `None` under other policies.
    pub kv_events_batches: Option<u64>,
    /// Of the proxy's views of a worker, those it dropped since its last start on a gap, a
    /// restarted worker's sequence, a lost connection or an undecodable message.
    pub kv_events_views_dropped: Option<u64>,
    /// Requests after the chaos stopped, and how many succeeded (must be all).
    pub recovery_ok: u64,
    /// The HTTP address of every process, by name; each keeps its ports across restarts.
    pub addresses: BTreeMap<String, String>,
    /// Memory of every process.
    pub memory: Vec<MemoryTrack>,
    /// Whether every process that lived through the run kept a flat memory.
    pub memory_flat: bool,
    /// First errors seen (at most 8).
    pub errors: Vec<String>,
    /// What ran.
    pub setup: String,
    /// The git commit the binary was built from (`-dirty`: with uncommitted changes to
    /// tracked files; `unknown`: built outside a git checkout).
    pub commit: String,
    /// The security and transport settings the workers ran with: whether `KVBRIDGE_SECRET`
    /// was set, whether TLS certificates were given, and `KVBRIDGE_TRANSPORT` (for UCX, its
    /// `UCX_TLS` and whether the fabric was declared trusted).
    pub environment: String,
}

/// The commit this binary was built from (see `build.rs`).
pub const BUILD_COMMIT: &str = env!("KVBRIDGE_GIT_COMMIT");

/// The security and transport settings a soak's workers inherit from its environment (never
/// the secret itself).
pub fn environment() -> String {
    let set = |v: &str| std::env::var_os(v).is_some_and(|s| !s.is_empty());
    format!(
        "secret {}, TLS {}, transport {}",
        if set("KVBRIDGE_SECRET") {
            "set"
        } else {
            "unset"
        },
        match (
            set("KVBRIDGE_TLS_CERT") || set("KVBRIDGE_TLS_CA"),
            std::env::var("KVBRIDGE_TLS_DATA").is_ok_and(|v| !v.is_empty() && v != "0"),
        ) {
            (true, true) => "on (control and data)",
            (true, false) => "on (control)",
            (false, _) => "off",
        },
        transport()
    )
}

/// `KVBRIDGE_TRANSPORT`, and for UCX the transports it ran on and whether the fabric was
/// declared trusted.
fn transport() -> String {
    let t = std::env::var("KVBRIDGE_TRANSPORT").unwrap_or_else(|_| "default".into());
    if t != "ucx" {
        return t;
    }
    format!(
        "ucx (UCX_TLS {}, fabric {})",
        std::env::var("UCX_TLS").unwrap_or_else(|_| "unset".into()),
        if std::env::var("KVBRIDGE_UCX_TRUSTED_FABRIC").is_ok_and(|v| v == "1") {
            "declared trusted"
        } else {
            "not declared trusted"
        }
    )
}

impl SoakSummary {
    /// No hang, no corruption, no leak, flat memory, recovered, and something succeeded.
    pub fn passed(&self) -> bool {
        self.hangs == 0
            && self.kv_mismatches == 0
            && self.outputs_mismatched == 0
            && self.pages_leaked == 0
            && self.quiesced
            && self.memory_flat
            && self.recovery_ok == RECOVERY_REQUESTS
            && self.restart_failures == 0
            && self.ok > 0
            && self.kv_events_batches != Some(0)
    }

    /// The human-readable summary.
    pub fn table(&self) -> String {
        let yes = |b: bool| if b { "yes" } else { "NO" };
        let mut s = format!(
            "kvbridge soak: {}\n\
             commit              {} ({})\n\
             requests            {} ok {} failed {} (clean errors)  hangs {}\n\
             failures by kind    {:?}\n\
             first of each kind  {:?}\n\
             chaos               {} kills, {} restarts, {} failed restarts, slowest exit {} ms\n\
             KV mismatches       {}\n\
             outputs = colocated {} of {} compared\n\
             leaked pages        {} (all returned: {})\n\
             recovery            {}/{} ok after the chaos\n\
             memory flat         {}\n",
            self.setup,
            self.commit,
            self.environment,
            self.requests,
            self.ok,
            self.failed,
            self.hangs,
            self.failures_by_kind,
            self.failure_examples,
            self.kills,
            self.restarts,
            self.restart_failures,
            self.slowest_exit_ms,
            self.kv_mismatches,
            self.outputs_compared - self.outputs_mismatched,
            self.outputs_compared,
            self.pages_leaked,
            yes(self.quiesced),
            self.recovery_ok,
            RECOVERY_REQUESTS,
            yes(self.memory_flat),
        );
        if let (Some(b), Some(d)) = (self.kv_events_batches, self.kv_events_views_dropped) {
            s.push_str(&format!(
                "KV events           {b} batches applied, {d} worker views dropped and \
                 rebuilt (the proxy's counters since its last start)\n"
            ));
        }
        for m in &self.memory {
            s.push_str(&format!(
                "  {:<12} RSS {:>7.1} MiB after warm-up -> {:>7.1} MiB at the end (max {:.1}){}\n",
                m.name,
                m.start_mib,
                m.end_mib,
                m.max_mib,
                if m.restarted { ", restarted" } else { "" }
            ));
            if !m.restarted && m.samples_mib.len() > 2 {
                let pts: Vec<String> = m.samples_mib.iter().map(|v| format!("{v:.0}")).collect();
                s.push_str(&format!("  {:<12} over the run: {}\n", "", pts.join(" ")));
            }
        }
        s.push_str(&if self.passed() {
            "PASS".to_string()
        } else {
            format!("FAIL {}", self.errors.join("; "))
        });
        s
    }
}

/// What a child process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Prefill,
    Decode,
    Proxy,
}

/// One child process slot: the process now running in it (if any), how to start it again,
/// and what was read from it.
struct Proc {
    name: String,
    kind: Kind,
    program: Vec<OsString>,
    /// Arguments that start it again on the same ports.
    restart_args: Vec<String>,
    child: Option<Child>,
    /// A killed process not reaped within [`EXIT_DEADLINE`]: it may still hold its ports, so
    /// the slot is not started again while it lives.
    exiting: Option<Child>,
    /// The HTTP address (engines: `/health` serves the counters).
    http: String,
    /// Mismatches of earlier incarnations.
    mismatches_banked: u64,
    /// Mismatches of the running incarnation, as last polled.
    mismatches_now: u64,
    /// The last counters polled (engines).
    last: Option<Value>,
    mem: Option<MemoryTrack>,
    /// Where the engine publishes its KV events (under `kv-events` routing).
    kv_events: Option<String>,
}

impl Proc {
    /// A slot whose process has just started and printed `addrs`.
    fn started(
        name: String,
        kind: Kind,
        program: &[OsString],
        restart_args: Vec<String>,
        child: Child,
        addrs: &Value,
    ) -> Proc {
        Proc {
            name,
            kind,
            program: program.to_vec(),
            restart_args,
            child: Some(child),
            exiting: None,
            http: addrs["http"].as_str().unwrap_or_default().to_string(),
            mismatches_banked: 0,
            mismatches_now: 0,
            last: (kind == Kind::Decode).then(|| addrs.clone()),
            mem: None,
            kv_events: addrs["kv_events"].as_str().map(str::to_string),
        }
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(|c| c.id())
    }
}

/// Starts `program args`, reads its one JSON line of addresses within [`START_DEADLINE`],
/// and keeps draining its stdout so it can never block on a full pipe.
async fn spawn(program: &[OsString], args: &[String]) -> anyhow::Result<(Child, Value)> {
    let (exe, lead) = program
        .split_first()
        .ok_or_else(|| anyhow::anyhow!("empty command"))?;
    let mut child = Command::new(exe)
        .args(lead)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start {exe:?}: {e}"))?;
    let mut err = child
        .stderr
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stderr"))?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    let mut out = BufReader::new(out);
    let mut line = String::new();
    match tokio::time::timeout(START_DEADLINE, out.read_line(&mut line)).await {
        Ok(Ok(n)) if n > 0 => {}
        Ok(Ok(_)) => {
            // Why it exited (a port taken in the meantime, say) is on its stderr: a panic's
            // message comes first and its backtrace after it, so both ends are kept.
            let mut why = Vec::new();
            let _ = tokio::time::timeout(
                Duration::from_secs(1),
                tokio::io::AsyncReadExt::read_to_end(
                    &mut tokio::io::AsyncReadExt::take(&mut err, 256 << 10),
                    &mut why,
                ),
            )
            .await;
            let why = ends_of(&why, 1200, 300);
            anyhow::bail!(
                "{exe:?} {args:?} exited before printing its addresses: {}",
                why.trim()
            )
        }
        Ok(Err(e)) => anyhow::bail!("reading {exe:?}'s addresses: {e}"),
        Err(_) => anyhow::bail!("{exe:?} printed no addresses within {START_DEADLINE:?}"),
    }
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut out, &mut tokio::io::sink()).await;
    });
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut err, &mut tokio::io::sink()).await;
    });
    let v: Value = serde_json::from_str(line.trim())
        .map_err(|e| anyhow::anyhow!("{exe:?} printed {line:?}, not its addresses: {e}"))?;
    Ok((child, v))
}

/// The ports named by `--port`, `--init-port` and `--alloc-port` in `args`
/// (the flags a worker binds).
fn ports_in(args: &[String]) -> Vec<u16> {
    args.windows(2)
        .filter(|w| {
            [
                "--port",
                "--init-port",
                "--alloc-port",
                "--kv-events-endpoint",
            ]
            .contains(&w[0].as_str())
        })
        .flat_map(|w| {
            // An endpoint is `tcp://host:port`: its port.
            let list = w[1].rsplit_once(':').map_or(w[1].as_str(), |(_, p)| p);
            list.split(',')
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u16>>()
        })
        .collect()
}

/// Sockets on this host whose local port is `port` (Linux `/proc/net/tcp`): their state and
/// the process holding each (`pid cmd`, where `/proc` lets us see it).
fn port_holders(port: u16) -> Vec<String> {
    let mut found = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            let p = local
                .rsplit(':')
                .next()
                .and_then(|h| u16::from_str_radix(h, 16).ok());
            if p == Some(port) {
                found.push((state.to_string(), inode.to_string()));
            }
        }
    }
    found
        .into_iter()
        .map(|(state, inode)| {
            let owner = socket_owner(&inode).unwrap_or_else(|| "no process".into());
            format!("state {state} ({owner})")
        })
        .collect()
}

/// The process with an open descriptor of socket `inode`.
fn socket_owner(inode: &str) -> Option<String> {
    let want = format!("socket:[{inode}]");
    for proc_dir in std::fs::read_dir("/proc").ok()?.flatten() {
        let pid = proc_dir.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) || inode == "0" {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(proc_dir.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|l| l.to_string_lossy() == want) {
                let cmd = std::fs::read(proc_dir.path().join("cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
                return Some(format!("pid {pid} {}", cmd.trim()));
            }
        }
    }
    None
}

/// The first `head` and the last `tail` bytes of `text` (all of it when short), as text.
fn ends_of(text: &[u8], head: usize, tail: usize) -> String {
    if text.len() <= head + tail {
        return String::from_utf8_lossy(text).into_owned();
    }
    format!(
        "{} [...] {}",
        String::from_utf8_lossy(&text[..head]),
        String::from_utf8_lossy(&text[text.len() - tail..])
    )
}

fn port_of(addr: &Value) -> anyhow::Result<u16> {
    let s = addr
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("no address in {addr}"))?;
    Ok(s.parse::<std::net::SocketAddr>()?.port())
}

fn ports_of(v: &Value) -> Vec<u16> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p.as_u64())
                .map(|p| p as u16)
                .collect()
        })
        .unwrap_or_default()
}

fn join(ports: &[u16]) -> String {
    ports
        .iter()
        .map(u16::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The engine flags that describe `m` and `c`, so every child runs the same model.
pub fn model_flags(m: &ModelArgs, c: &CostArgs) -> Vec<String> {
    [
        ("--model", m.model.clone()),
        ("--layers", m.layers.to_string()),
        ("--kv-heads", m.kv_heads.to_string()),
        ("--head-dim", m.head_dim.to_string()),
        ("--latent-dim", m.latent_dim.to_string()),
        ("--dtype", m.dtype.clone()),
        ("--chunk-tokens", m.chunk_tokens.to_string()),
        ("--tp", m.tp.to_string()),
        ("--prefill-tokens-per-s", c.prefill_tokens_per_s.to_string()),
        ("--decode-ms-per-token", c.decode_ms_per_token.to_string()),
        ("--prefill-step-tokens", c.prefill_step_tokens.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect()
}

/// Resident set size of `pid` in MiB (Linux), or `None`.
fn rss_mib(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// Tallies of the workload tasks.
#[derive(Debug, Default)]
struct Tally {
    requests: u64,
    ok: u64,
    hangs: u64,
    failures: BTreeMap<String, u64>,
    examples: BTreeMap<String, String>,
    compared: u64,
    mismatched: u64,
    errors: Vec<String>,
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        self.requests += o.requests;
        self.ok += o.ok;
        self.hangs += o.hangs;
        for (k, v) in o.failures {
            *self.failures.entry(k).or_default() += v;
        }
        for (k, v) in o.examples {
            self.examples.entry(k).or_insert(v);
        }
        self.compared += o.compared;
        self.mismatched += o.mismatched;
        for e in o.errors {
            if self.errors.len() < 8 {
                self.errors.push(e);
            }
        }
    }

    fn error(&mut self, e: String) {
        if self.errors.len() < 8 {
            self.errors.push(e);
        }
    }
}

/// What the workload tasks share (read only, plus the request counter).
struct Load {
    client: Client,
    proxy_url: String,
    colocated_url: String,
    next: AtomicU64,
    end: Instant,
    opts: SoakOptions,
    model_name: String,
}

fn failure_kind(e: &ClientError) -> String {
    match e {
        ClientError::Timeout { .. } => "hang".into(),
        ClientError::Transport { .. } => "connect".into(),
        ClientError::Status { status, body, .. } => {
            let code = serde_json::from_str::<Value>(body)
                .ok()
                .and_then(|v| v["error"]["code"].as_str().map(str::to_string));
            match code {
                Some(c) => format!("{status} {c}"),
                None => status.to_string(),
            }
        }
        ClientError::Answer { .. } => "sse_error".into(),
    }
}

/// Sends request `i` through the proxy and, for every `compare_every`-th success, through
/// the colocated engine too.
async fn one_request(load: &Load, i: u64, t: &mut Tally) -> Result<(), ClientError> {
    let mut r = SplitMix(load.opts.seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let w: WorkItem = work_item(
        i,
        &mut r,
        load.opts.prompt_tokens,
        load.opts.output_tokens,
        "",
        &load.model_name,
    );
    t.requests += 1;
    let deadline = load.opts.request_timeout;
    let a = load
        .client
        .generate(&format!("{}{}", load.proxy_url, w.path), &w.body, deadline)
        .await?;
    t.ok += 1;
    if load.opts.compare_every > 0 && t.ok.is_multiple_of(load.opts.compare_every) {
        let c = load
            .client
            .generate(
                &format!("{}{}", load.colocated_url, w.path),
                &w.body,
                deadline,
            )
            .await;
        t.compared += 1;
        match c {
            Ok(c) if c.text == a.text => {}
            Ok(c) => {
                t.mismatched += 1;
                t.error(format!(
                    "request {i}: output {:?} differs from colocated {:?}",
                    a.text.chars().take(40).collect::<String>(),
                    c.text.chars().take(40).collect::<String>()
                ));
            }
            Err(e) => {
                t.mismatched += 1;
                t.error(format!("request {i}: the colocated engine failed: {e}"));
            }
        }
    }
    Ok(())
}

/// One workload task: requests one after another until the end time.
async fn load_task(load: Arc<Load>) -> Tally {
    let mut t = Tally::default();
    loop {
        let i = load.next.fetch_add(1, Relaxed);
        if Instant::now() >= load.end || i >= load.opts.max_requests.min(MAX_REQUESTS) {
            break;
        }
        if let Err(e) = one_request(&load, i, &mut t).await {
            let kind = failure_kind(&e);
            if kind == "hang" {
                t.hangs += 1;
                t.error(format!("request {i} hung: {e}"));
            } else {
                *t.failures.entry(kind.clone()).or_default() += 1;
                t.examples.entry(kind.clone()).or_insert_with(|| {
                    let e = e.to_string();
                    e.chars().take(300).collect()
                });
                if !load.opts.chaos {
                    t.error(format!("request {i}: {e}"));
                }
            }
            if kind == "connect" {
                // The proxy is down: do not spin on refused connections.
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    t
}

/// Every child process and what the supervisor learned from them.
struct Supervisor {
    procs: Vec<Proc>,
    client: Client,
    kills: u64,
    restarts: u64,
    restart_failures: u64,
    slowest_exit: Duration,
    errors: Vec<String>,
    own: Option<MemoryTrack>,
    warm: bool,
    /// Set when the workload ends: memory is judged over the workload only (teardown and
    /// quiescence free memory and would hide growth).
    memory_frozen: bool,
}

impl Supervisor {
    fn error(&mut self, e: String) {
        if self.errors.len() < 8 {
            self.errors.push(e);
        }
    }

    /// Polls every live engine's counters and every process's memory.
    async fn poll(&mut self) {
        let deadline = POLL_EVERY;
        let client = &self.client;
        let reads = futures_util::future::join_all(self.procs.iter().map(|p| async move {
            if p.kind == Kind::Proxy || p.child.is_none() {
                return None;
            }
            client
                .get_json(&format!("http://{}/health", p.http), deadline)
                .await
                .ok()
        }))
        .await;
        for (p, v) in self.procs.iter_mut().zip(reads) {
            if let Some(v) = v.and_then(|v| v.get("stats").cloned()) {
                p.mismatches_now = v["kv_mismatches"].as_u64().unwrap_or(0);
                p.last = Some(v);
            }
        }
        if self.memory_frozen {
            return;
        }
        let warm = self.warm;
        for p in &mut self.procs {
            if let Some(mib) = p.pid().and_then(rss_mib) {
                track(&mut p.mem, &p.name, mib, warm);
            }
        }
        if let Some(mib) = rss_mib(std::process::id()) {
            track(&mut self.own, "demo", mib, warm);
        }
    }

    /// Kills process `i` with SIGKILL and reaps it (within [`EXIT_DEADLINE`]).
    async fn kill(&mut self, i: usize) {
        let p = &mut self.procs[i];
        if let Some(mut c) = p.child.take() {
            let _ = c.start_kill();
            let t = Instant::now();
            match tokio::time::timeout(EXIT_DEADLINE, c.wait()).await {
                Ok(_) => self.slowest_exit = self.slowest_exit.max(t.elapsed()),
                Err(_) => {
                    p.exiting = Some(c);
                    let e = format!("{} still alive {EXIT_DEADLINE:?} after SIGKILL", p.name);
                    self.error(e);
                }
            }
            let p = &mut self.procs[i];
            p.mismatches_banked += p.mismatches_now;
            p.mismatches_now = 0;
            p.last = None;
            if let Some(m) = &mut p.mem {
                m.restarted = true;
            }
            self.kills += 1;
        }
    }

    /// Starts process `i` again on its ports; retries a few times (a port can be briefly
    /// held by a connection of the killed process). Returns whether it runs; a failure is
    /// counted and logged, and the caller tries again later.
    async fn restart(&mut self, i: usize) -> bool {
        if self.procs[i].child.is_some() {
            return true;
        }
        if let Some(c) = &mut self.procs[i].exiting {
            if !matches!(c.try_wait(), Ok(Some(_))) {
                self.restart_failures += 1;
                let e = format!(
                    "{} not restarted: its killed process still runs",
                    self.procs[i].name
                );
                self.error(e);
                return false;
            }
            self.procs[i].exiting = None;
        }
        let mut last = String::new();
        for attempt in 0..10u32 {
            let p = &self.procs[i];
            match spawn(&p.program, &p.restart_args).await {
                Ok((c, _)) => {
                    self.procs[i].child = Some(c);
                    self.restarts += 1;
                    return true;
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(100 * (attempt as u64 + 1))).await;
        }
        self.restart_failures += 1;
        let name = self.procs[i].name.clone();
        // Whoever holds a port it could not bind is the cause: name them while they still do.
        let holders: Vec<String> = ports_in(&self.procs[i].restart_args)
            .into_iter()
            .flat_map(|p| {
                port_holders(p)
                    .into_iter()
                    .map(move |h| format!("{p}: {h}"))
            })
            .collect();
        self.error(format!(
            "{name} did not restart: {last}; holders of its ports now: {}",
            if holders.is_empty() {
                "none".into()
            } else {
                holders.join("; ")
            }
        ));
        false
    }

    /// Quiescence: every page back within `wait` (KV a killed proxy never asked for is
    /// unclaimed until the KV TTL), polling; when not, the decoders' states are an error.
    async fn quiesce(&mut self, wait: Duration) -> bool {
        let deadline = Instant::now() + wait;
        let quiesced = loop {
            self.poll().await;
            let (_, idle) = self.pages();
            if idle {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        if !quiesced {
            let states: Vec<String> = self
                .decoders()
                .map(|p| match &p.last {
                    Some(v) => format!(
                        "{}: {}/{} pages free, {} in flight, {} announced, {} leaked",
                        p.name,
                        v["pages_free"],
                        v["pages_total"],
                        v["in_flight"],
                        v["announced_pending"],
                        v["pages_leaked"]
                    ),
                    None => format!("{}: no counters", p.name),
                })
                .collect();
            self.error(format!(
                "decoders not idle with every page free {wait:?} after the load stopped: {}",
                states.join("; ")
            ));
        }
        quiesced
    }

    fn decoders(&self) -> impl Iterator<Item = &Proc> {
        self.procs.iter().filter(|p| p.kind == Kind::Decode)
    }

    /// Pages not free on the live decoders, plus their leak counters, as last polled; and
    /// whether every decoder is idle with every page free.
    fn pages(&self) -> (u64, bool) {
        let (mut held, mut idle) = (0, true);
        for p in self.decoders() {
            match &p.last {
                Some(v) => {
                    let total = v["pages_total"].as_u64().unwrap_or(0);
                    let free = v["pages_free"].as_u64().unwrap_or(0);
                    let leaked = v["pages_leaked"].as_u64().unwrap_or(0);
                    let busy = v["in_flight"].as_u64().unwrap_or(0);
                    held += total.saturating_sub(free) + leaked;
                    idle &= busy == 0 && free == total && leaked == 0;
                }
                None => idle = false,
            }
        }
        (held, idle)
    }
}

fn track(m: &mut Option<MemoryTrack>, name: &str, mib: f64, warm: bool) {
    match m {
        None if warm => *m = Some(MemoryTrack::new(name, mib)),
        None => {}
        Some(t) => {
            if t.restarted {
                // A new incarnation: its growth says nothing about the old one.
                return;
            }
            t.record(mib);
        }
    }
}

/// Starts the decoders, the prefillers and the proxy as child processes (in that order: each
/// prints the addresses the next needs), each on ports it can be restarted on (see
/// [`StablePorts`]).
async fn start_processes(o: &SoakOptions, flags: &[String]) -> anyhow::Result<Vec<Proc>> {
    // Soaks running at once (tests in one process, or several processes) start at different
    // points of the range, so they rarely probe the same ports.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut ports = StablePorts::new(o.seed ^ u64::from(std::process::id()) ^ now);
    let mut procs = Vec::new();
    // Under kv-events an engine's last port is its KV-events endpoint.
    let kv_events = o.routing == RoutingPolicy::KvEvents;
    let base = |role: &str, p: &[u16]| {
        let mut a = vec!["--role".to_string(), role.to_string()];
        a.extend(flags.iter().cloned());
        if o.routing != RoutingPolicy::LeastLoaded {
            a.extend([
                "--prefix-cache-tokens".into(),
                SOAK_PREFIX_CACHE_TOKENS.to_string(),
            ]);
        }
        if let (true, Some(port)) = (kv_events, p.last()) {
            a.extend([
                "--kv-events-endpoint".into(),
                format!("tcp://127.0.0.1:{port}"),
            ]);
        }
        a
    };
    let extra = usize::from(kv_events);
    // Every rank may receive, so a decoder gets one init and one alloc port per rank.
    let ranks = o.model.tp.max(1) as usize;
    for d in 0..o.decoders {
        let n = 1 + 2 * ranks + extra;
        let (child, v, args) = spawn_on(&o.engine_cmd, &mut ports, n, |p| {
            let mut args = base("decode", p);
            args.extend([
                "--buffer-mib".into(),
                o.buffer_mib.to_string(),
                "--kv-ttl-sec".into(),
                o.kv_ttl.as_secs_f64().to_string(),
                "--port".into(),
                p[0].to_string(),
                "--init-port".into(),
                join(&p[1..1 + ranks]),
                "--alloc-port".into(),
                join(&p[1 + ranks..1 + 2 * ranks]),
            ]);
            (args, Vec::new())
        })
        .await?;
        procs.push(Proc::started(
            format!("decoder-{d}"),
            Kind::Decode,
            &o.engine_cmd,
            args,
            child,
            &v,
        ));
    }
    for p in 0..o.prefillers {
        let (child, v, args) = spawn_on(&o.engine_cmd, &mut ports, 1 + extra, |p| {
            let mut args = base("prefill", p);
            args.extend(["--port".into(), p[0].to_string()]);
            // The proxy's address is not known yet: it comes on stdin at the first start,
            // and as flags at every restart.
            (args, vec!["--proxy-endpoint-from-stdin".into()])
        })
        .await?;
        procs.push(Proc::started(
            format!("prefiller-{p}"),
            Kind::Prefill,
            &o.engine_cmd,
            args,
            child,
            &v,
        ));
    }
    let toml = proxy_toml(o, &procs)?;
    let path = config_path();
    std::fs::write(&path, toml)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
    let (child, v, args) = spawn_on(&o.proxy_cmd, &mut ports, 2, |p| {
        let args = vec![
            "--config".to_string(),
            path.display().to_string(),
            "--port".into(),
            p[0].to_string(),
            "--proxy-port".into(),
            p[1].to_string(),
        ];
        (args, Vec::new())
    })
    .await?;
    let notify = port_of(&v["notify"])?;
    let endpoint = format!("tcp://127.0.0.1:{notify}\n");
    for p in procs.iter_mut().filter(|p| p.kind == Kind::Prefill) {
        if let Some(mut stdin) = p.child.as_mut().and_then(|c| c.stdin.take()) {
            stdin.write_all(endpoint.as_bytes()).await?;
            stdin.flush().await?;
        }
        p.restart_args.extend([
            "--proxy-host".into(),
            "127.0.0.1".into(),
            "--proxy-port".into(),
            notify.to_string(),
        ]);
    }
    procs.push(Proc::started(
        "proxy".into(),
        Kind::Proxy,
        &o.proxy_cmd,
        args,
        child,
        &v,
    ));
    Ok(procs)
}

/// Starts a process on `n` ports from `ports`; `args_for` gives, for those ports, the arguments
/// that start it again and those needed at the first start only. Another process on the host
/// may bind a port between the probe and the start, so a start that fails is tried again on
/// new ports, a few times. Returns the child, its addresses and its restart arguments.
async fn spawn_on(
    program: &[OsString],
    ports: &mut StablePorts,
    n: usize,
    args_for: impl Fn(&[u16]) -> (Vec<String>, Vec<String>),
) -> anyhow::Result<(Child, Value, Vec<String>)> {
    let mut last = None;
    for _ in 0..5 {
        let p = ports
            .take_n(n)
            .ok_or_else(|| anyhow::anyhow!("no {n} free ports below the ephemeral range"))?;
        let (restart, first_only) = args_for(&p);
        let mut args = restart.clone();
        args.extend(first_only);
        match spawn(program, &args).await {
            Ok((child, v)) => return Ok((child, v, restart)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no start attempted")))
}

fn config_path() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    std::env::temp_dir().join(format!(
        "kvbridge-soak-proxy-{}-{nanos}.toml",
        std::process::id()
    ))
}

/// The proxy's configuration: every worker with its own ports, and deadlines that end every
/// request well before the client's deadline.
fn proxy_toml(o: &SoakOptions, procs: &[Proc]) -> anyhow::Result<String> {
    let step = o.request_timeout.as_secs_f64() / 4.0;
    let mut s = format!(
        "host = \"127.0.0.1\"\nport = 0\nproxy_host = \"127.0.0.1\"\nproxy_port = 0\n\
         flow = \"lmcache\"\nkv_ready_timeout = {}\nprefill_timeout = {step}\n\
         decode_timeout = {step}\nconnect_timeout = 1\nhealth_interval = 0.5\n\
         health_timeout = 0.5\nqueue_timeout = {step}\nrouting = \"{}\"\n",
        o.kv_ready_timeout.as_secs_f64().min(step),
        o.routing.as_str()
    );
    for p in procs {
        let port = port_of(&Value::String(p.http.clone()))?;
        match p.kind {
            Kind::Prefill => s.push_str(&format!(
                "[[prefiller]]\nhost = \"127.0.0.1\"\nport = {port}\n"
            )),
            Kind::Decode => {
                let v = p.last.as_ref().cloned().unwrap_or_default();
                s.push_str(&format!(
                    "[[decoder]]\nhost = \"127.0.0.1\"\nport = {port}\ninit_ports = [{}]\nalloc_ports = [{}]\n",
                    join(&ports_of(&v["init_ports"])),
                    join(&ports_of(&v["alloc_ports"]))
                ))
            }
            Kind::Proxy => {}
        }
    }
    if o.routing == RoutingPolicy::KvEvents {
        let endpoints = |kind: Kind| -> anyhow::Result<String> {
            let list = procs
                .iter()
                .filter(|p| p.kind == kind)
                .map(|p| {
                    let e = p.kv_events.as_deref().ok_or_else(|| {
                        anyhow::anyhow!("{} printed no KV-events endpoint", p.name)
                    })?;
                    Ok(format!("\"{e}\""))
                })
                .collect::<anyhow::Result<Vec<_>>>()?;
            Ok(list.join(", "))
        };
        s.push_str(&format!(
            "[kv_events]\nprefiller_endpoints = [{}]\ndecoder_endpoints = [{}]\n",
            endpoints(Kind::Prefill)?,
            endpoints(Kind::Decode)?
        ));
    }
    Ok(s)
}

impl SoakOptions {
    /// The soak that `kvbridge demo --duration D [--chaos]` runs: `engine_cmd` and
    /// `proxy_cmd` start one engine and the proxy (for the `kvbridge` binary: itself with
    /// `engine` and `proxy`).
    pub fn from_demo_args(
        a: &DemoArgs,
        engine_cmd: Vec<OsString>,
        proxy_cmd: Vec<OsString>,
    ) -> anyhow::Result<SoakOptions> {
        if a.tp_flags_given() || a.mla {
            anyhow::bail!(
                "--prefill-tp, --decode-tp and --mla apply to the in-process demo, not to --duration"
            );
        }
        // The soak drives the random workload in token ids through the proxy. A flag asking
        // for something else is refused rather than left unused: a soak that ran other than
        // asked would prove something other than asked.
        let unsupported = [
            (a.workload != Workload::Random, "--workload"),
            (a.prompt_format != PromptFormat::Ids, "--prompt-format"),
            (a.peer_router.is_some(), "--peer-router"),
        ];
        if let Some((_, flag)) = unsupported.iter().find(|(set, _)| *set) {
            anyhow::bail!(
                "{flag} is not supported with --duration: the soak runs the random workload \
                 in token ids"
            );
        }
        let duration = parse_duration(a.duration.as_deref().unwrap_or("60s"))?;
        let secs = |v: f64, what: &str| {
            if v > 0.0 && v.is_finite() {
                Ok(Duration::from_secs_f64(v))
            } else {
                Err(anyhow::anyhow!(
                    "{what} must be a positive number of seconds"
                ))
            }
        };
        Ok(SoakOptions {
            max_requests: MAX_REQUESTS,
            engine_cmd,
            proxy_cmd,
            prefillers: a.prefillers.unwrap_or(2),
            decoders: a.decoders.unwrap_or(2),
            duration,
            chaos: a.chaos,
            chaos_interval: secs(a.chaos_interval, "--chaos-interval")?,
            chaos_proxy: !a.chaos_spare_proxy,
            concurrency: a.concurrency,
            prompt_tokens: range(&a.prompt_tokens, "--prompt-tokens")?,
            output_tokens: range(&a.output_tokens, "--output-tokens")?,
            request_timeout: secs(a.request_timeout, "--request-timeout")?,
            kv_ready_timeout: Duration::from_secs(10),
            compare_every: 10,
            buffer_mib: a.buffer_mib,
            kv_ttl: secs(a.kv_ttl_sec, "--kv-ttl-sec")?,
            seed: a.seed,
            model: a.model.clone(),
            cost: a.cost.clone(),
            routing: a.routing,
            progress: !a.json,
        })
    }
}

/// Runs the soak. The caller prints the summary and sets the exit status.
pub async fn run(o: SoakOptions) -> anyhow::Result<SoakSummary> {
    if o.prefillers == 0 || o.decoders == 0 {
        anyhow::bail!("at least one prefiller and one decoder are needed");
    }
    if o.request_timeout < Duration::from_secs(4) {
        anyhow::bail!("--request-timeout must be at least 4 s for a soak");
    }
    let model: Model = o.model.build()?;
    o.cost.build()?;
    let flags = model_flags(&o.model, &o.cost);
    let colocated = {
        let mut c = EngineConfig::new(Role::Both, model.clone());
        c.cost = CostModel::FREE;
        engine::start(c, tokio::net::TcpListener::bind("127.0.0.1:0").await?).await?
    };
    let procs = start_processes(&o, &flags).await?;
    let proxy_url = format!(
        "http://{}",
        procs.last().map(|p| p.http.clone()).unwrap_or_default()
    );
    let client = Client::new();
    let mut sup = Supervisor {
        procs,
        client: client.clone(),
        kills: 0,
        restarts: 0,
        restart_failures: 0,
        slowest_exit: Duration::ZERO,
        errors: Vec::new(),
        own: None,
        warm: false,
        memory_frozen: false,
    };
    let t0 = Instant::now();
    let load = Arc::new(Load {
        client: client.clone(),
        proxy_url: proxy_url.clone(),
        colocated_url: format!("http://{}", colocated.http_addr()),
        next: AtomicU64::new(0),
        end: t0 + o.duration,
        opts: o.clone(),
        model_name: model.name.clone(),
    });
    let tasks: Vec<_> = (0..o.concurrency.max(1))
        .map(|_| tokio::spawn(load_task(load.clone())))
        .collect();
    supervise(&o, &mut sup, &load, &tasks, t0).await;
    let mut tally = Tally::default();
    for t in tasks {
        match t.await {
            Ok(t) => tally.merge(t),
            Err(e) => tally.error(format!("a workload task failed: {e}")),
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    if o.progress {
        eprintln!();
    }
    // One last reading with the workload just ended, then memory is frozen.
    sup.poll().await;
    sup.memory_frozen = true;
    let recovery_ok = recover(&load, o.request_timeout, &mut tally).await;
    let quiesced = sup.quiesce(o.kv_ttl + Duration::from_secs(15)).await;
    let kv_events = match o.routing {
        RoutingPolicy::KvEvents => Some(kv_events_counts(&client, &proxy_url).await),
        _ => None,
    };
    let after = AfterLoad {
        wall,
        recovery_ok,
        quiesced,
        kv_events,
    };
    let summary = summarize(&o, &model, &sup, tally, after);
    for p in &mut sup.procs {
        if let Some(mut c) = p.child.take() {
            let _ = c.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(5), c.wait()).await;
        }
    }
    colocated.shutdown().await;
    Ok(summary)
}

/// The supervisor, until the end time or the workload's end: polls the processes, and
/// under `--chaos` kills each in turn (in a shuffled order) and restarts it after a random
/// downtime. A process still down at the end is restarted.
async fn supervise(
    o: &SoakOptions,
    sup: &mut Supervisor,
    load: &Load,
    tasks: &[tokio::task::JoinHandle<Tally>],
    t0: Instant,
) {
    let end = load.end;
    let warm_at = t0
        + (o.duration / 5)
            .max(Duration::from_secs(2))
            .min(o.duration / 2);
    let mut rng = SplitMix(o.seed ^ 0xc4a05);
    let jitter =
        |r: &mut SplitMix, d: Duration| d.mul_f64(0.5 + (r.next_u64() % 1000) as f64 / 1000.0);
    let mut next_kill = t0 + jitter(&mut rng, o.chaos_interval);
    let mut down: Option<(usize, Instant)> = None;
    let mut order: Vec<usize> = Vec::new();
    let mut next_poll = t0;
    loop {
        let now = Instant::now();
        if now >= end || tasks.iter().all(|t| t.is_finished()) {
            break;
        }
        if now >= next_poll {
            sup.warm = now >= warm_at;
            sup.poll().await;
            next_poll = now + POLL_EVERY;
            if o.progress {
                show_progress(o, t0, now, load, sup.kills);
            }
        }
        if let Some((i, at)) = down {
            if now >= at {
                if sup.restart(i).await {
                    down = None;
                    next_kill = Instant::now() + jitter(&mut rng, o.chaos_interval);
                } else {
                    // Counted as a failed restart; the run goes on, and so do the attempts,
                    // so one failure does not leave the rest of the run without the process.
                    down = Some((i, Instant::now() + Duration::from_secs(1)));
                }
            }
        } else if o.chaos && now >= next_kill {
            // Every process in turn, in a shuffled order: a short run still kills each
            // kind once (prefiller, decoder, proxy).
            if order.is_empty() {
                order = (0..sup.procs.len())
                    .filter(|&i| o.chaos_proxy || sup.procs[i].kind != Kind::Proxy)
                    .collect();
                for k in (1..order.len()).rev() {
                    order.swap(k, (rng.next_u64() % (k as u64 + 1)) as usize);
                }
            }
            let i = order.pop().unwrap_or(0);
            sup.kill(i).await;
            let downtime = Duration::from_millis(200 + rng.next_u64() % 1300);
            down = Some((i, Instant::now() + downtime));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if let Some((i, _)) = down {
        for _ in 0..5 {
            if sup.restart(i).await {
                break;
            }
        }
    }
}

/// The progress bar on stderr: time gone of `o.duration`, requests issued, kills.
fn show_progress(o: &SoakOptions, t0: Instant, now: Instant, load: &Load, kills: u64) {
    let done = now.duration_since(t0).as_secs_f64() / o.duration.as_secs_f64();
    let w = (30.0 * done.min(1.0)) as usize;
    eprint!(
        "\r[{}{}] {:.0}s  requests {}  kills {}",
        "#".repeat(w),
        " ".repeat(30 - w),
        now.duration_since(t0).as_secs_f64(),
        load.next.load(Relaxed).min(MAX_REQUESTS),
        kills
    );
    let _ = std::io::stderr().flush();
}

/// Recovery: with every process up again, requests succeed (the proxy re-admits a
/// restarted worker after its health checks pass, so allow a few attempts, within
/// `timeout`). How many did; hangs and compared outputs go into `tally`.
async fn recover(load: &Load, timeout: Duration, tally: &mut Tally) -> u64 {
    let recovery_deadline = Instant::now() + timeout;
    let mut recovery_ok = 0;
    let mut i = MAX_REQUESTS;
    while recovery_ok < RECOVERY_REQUESTS && Instant::now() < recovery_deadline {
        let mut t = Tally::default();
        match one_request(load, i, &mut t).await {
            Ok(()) => recovery_ok += 1,
            Err(ClientError::Timeout { .. }) => {
                tally.hangs += 1;
                tally.error(format!("recovery request {i} hung"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
        tally.compared += t.compared;
        tally.mismatched += t.mismatched;
        i += 1;
    }
    recovery_ok
}

/// The proxy's KV-events batches applied, and the views it dropped (gaps, restarts,
/// disconnects, undecodable batches), from its `/metrics`.
async fn kv_events_counts(client: &Client, proxy_url: &str) -> (u64, u64) {
    let text = client
        .get_text(&format!("{proxy_url}/metrics"), POLL_EVERY)
        .await
        .unwrap_or_default();
    let total = |name: &str| {
        let metric = format!("kvbridge_proxy_kv_events_{name}_total");
        crate::proxy_metrics::sum(&text, &metric, &[]) as u64
    };
    let dropped = ["gaps", "restarts", "disconnects", "bad"].map(total);
    (total("batches"), dropped.iter().sum())
}

/// What the run found once its workload ended.
struct AfterLoad {
    /// Seconds from the start to the workload's end.
    wall: f64,
    /// Recovery requests that succeeded ([`recover`]).
    recovery_ok: u64,
    /// Every page came back ([`Supervisor::quiesce`]).
    quiesced: bool,
    /// Under `kv-events` routing, the proxy's batches applied and views dropped.
    kv_events: Option<(u64, u64)>,
}

/// The run's summary from what the workload, the supervisor and the checks after it saw.
fn summarize(
    o: &SoakOptions,
    model: &Model,
    sup: &Supervisor,
    tally: Tally,
    after: AfterLoad,
) -> SoakSummary {
    let AfterLoad {
        wall,
        recovery_ok,
        quiesced,
        kv_events,
    } = after;
    let (pages_leaked, _) = sup.pages();
    let kv_mismatches = sup
        .procs
        .iter()
        .map(|p| p.mismatches_banked + p.mismatches_now)
        .sum();
    let mut memory: Vec<MemoryTrack> = sup.own.iter().cloned().collect();
    memory.extend(sup.procs.iter().filter_map(|p| p.mem.clone()));
    let memory_flat = memory.iter().all(MemoryTrack::flat);
    let addresses = sup
        .procs
        .iter()
        .map(|p| (p.name.clone(), p.http.clone()))
        .collect();
    let mut errors = tally.errors.clone();
    errors.extend(sup.errors.iter().cloned());
    errors.truncate(8);
    SoakSummary {
        duration_s: wall,
        requests: tally.requests,
        ok: tally.ok,
        failed: tally.requests - tally.ok - tally.hangs,
        hangs: tally.hangs,
        failures_by_kind: tally.failures,
        failure_examples: tally.examples,
        kills: sup.kills,
        restarts: sup.restarts,
        restart_failures: sup.restart_failures,
        slowest_exit_ms: sup.slowest_exit.as_millis() as u64,
        kv_mismatches,
        outputs_compared: tally.compared,
        outputs_mismatched: tally.mismatched,
        pages_leaked,
        quiesced,
        kv_events_batches: kv_events.map(|(batches, _)| batches),
        kv_events_views_dropped: kv_events.map(|(_, dropped)| dropped),
        recovery_ok,
        addresses,
        memory,
        memory_flat,
        errors,
        commit: BUILD_COMMIT.to_string(),
        environment: environment(),
        setup: setup_line(o, model),
    }
}

/// The summary's one-line description of the run's setup.
fn setup_line(o: &SoakOptions, model: &Model) -> String {
    format!(
        "{}P{}D as processes, {} for {}, chaos {} (every ~{:.1} s{}), {} in flight, model {}, \
         routing {}",
        o.prefillers,
        o.decoders,
        model.spec.layout,
        if o.max_requests < MAX_REQUESTS {
            format!("{} requests", o.max_requests)
        } else {
            format!("{:.0} s", o.duration.as_secs_f64())
        },
        if o.chaos { "on" } else { "off" },
        o.chaos_interval.as_secs_f64(),
        if o.chaos_proxy {
            ", proxy included"
        } else {
            ""
        },
        o.concurrency,
        model.name,
        o.routing.as_str()
    )
}

/// Parses a duration such as `90`, `90s`, `30m` or `1h`.
pub fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| anyhow::anyhow!("bad duration {s:?}: use e.g. 90s, 30m or 1h"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => anyhow::bail!("bad duration unit in {s:?}: use s, m or h"),
    };
    if !(secs > 0.0 && secs.is_finite() && secs <= 7.0 * 86400.0) {
        anyhow::bail!("duration {s:?} must be positive and at most a week");
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_refuse_nonsense() {
        assert_eq!(parse_duration("90").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("20s").unwrap(), Duration::from_secs(20));
        assert_eq!(parse_duration("30m").unwrap(), Duration::from_secs(1800));
        assert_eq!(parse_duration("1.5h").unwrap(), Duration::from_secs(5400));
        for bad in ["", "m", "-3s", "0", "10d", "1e9h"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn demo_flags_the_soak_does_not_run_are_refused_by_name() {
        #[derive(clap::Parser)]
        struct A {
            #[command(flatten)]
            d: DemoArgs,
        }
        let opts = |extra: &[&str]| {
            let argv = ["demo", "--duration", "10s"].iter().chain(extra);
            SoakOptions::from_demo_args(
                &<A as clap::Parser>::try_parse_from(argv).unwrap().d,
                vec![],
                vec![],
            )
        };
        assert!(opts(&[]).is_ok());
        assert!(opts(&["--routing", "kv-events", "--workload", "random"]).is_ok());
        for (flag, value) in [
            ("--workload", "shared-prefix"),
            ("--prompt-format", "text"),
            ("--peer-router", "true"),
        ] {
            let err = opts(&[flag, value]).expect_err(flag).to_string();
            assert!(err.starts_with(flag), "{flag}: {err}");
        }
    }

    #[test]
    fn memory_samples_stay_bounded_and_evenly_spaced() {
        let mut m = MemoryTrack::new("x", 0.0);
        for i in 1..=1000 {
            m.record(f64::from(i));
        }
        assert!(m.samples_mib.len() <= MEMORY_SAMPLES, "{:?}", m.samples_mib);
        assert!(
            m.samples_mib.len() >= MEMORY_SAMPLES / 2,
            "{:?}",
            m.samples_mib
        );
        assert_eq!(m.samples_mib[0], 0.0);
        let steps: Vec<f64> = m.samples_mib.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(steps.iter().all(|&d| d == steps[0]), "{:?}", m.samples_mib);
        assert!(*m.samples_mib.last().unwrap() > 1000.0 - steps[0] - 1.0);
        assert_eq!((m.end_mib, m.max_mib), (1000.0, 1000.0));
    }

    #[test]
    fn the_holder_of_a_port_is_named() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let held = port_holders(port);
        assert_eq!(held.len(), 1, "{held:?}");
        // State 0A is LISTEN; the holder is this test's process.
        assert!(held[0].starts_with("state 0A"), "{held:?}");
        assert!(
            held[0].contains(&format!("pid {} ", std::process::id())),
            "{held:?}"
        );
        drop(l);
        assert!(port_holders(port)
            .iter()
            .all(|h| !h.starts_with("state 0A")));
        let args: Vec<String> = ["--role", "decode", "--port", "1", "--init-port", "2,3"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(ports_in(&args), vec![1, 2, 3]);
    }

    #[test]
    fn a_long_stderr_keeps_its_first_and_last_bytes() {
        assert_eq!(ends_of(b"short", 3, 3), "short");
        let text = [
            b"thread 'main' panicked at x".as_slice(),
            &[b'.'; 5000],
            b"_start",
        ]
        .concat();
        let kept = ends_of(&text, 27, 6);
        assert_eq!(kept, "thread 'main' panicked at x [...] _start");
    }

    #[test]
    fn memory_is_flat_within_slack_and_restarts_are_not_judged() {
        let mut m = MemoryTrack::new("x", 100.0);
        m.record(150.0);
        assert!(m.flat());
        m.end_mib = 200.0;
        assert!(!m.flat());
        m.restarted = true;
        assert!(m.flat());
    }

    #[test]
    fn model_flags_round_trip_through_the_engine_parser() {
        use clap::Parser;
        #[derive(Parser)]
        struct A {
            #[command(flatten)]
            e: crate::cli::EngineArgs,
        }
        let m = ModelArgs {
            model: "m".into(),
            layers: 3,
            kv_heads: 2,
            head_dim: 16,
            latent_dim: 0,
            dtype: "fp16".into(),
            chunk_tokens: 64,
            tp: 2,
        };
        let c = CostArgs {
            prefill_tokens_per_s: 1234.5,
            decode_ms_per_token: 0.25,
            prefill_step_tokens: 192,
        };
        let mut argv = vec!["engine".to_string()];
        argv.extend(model_flags(&m, &c));
        let a = A::try_parse_from(argv).unwrap();
        assert_eq!(a.e.model.layers, 3);
        assert_eq!(a.e.model.tp, 2);
        assert_eq!(a.e.model.dtype, "fp16");
        assert_eq!(a.e.cost.decode_ms_per_token, 0.25);
        assert_eq!(a.e.cost.prefill_step_tokens, 192);
    }
}
