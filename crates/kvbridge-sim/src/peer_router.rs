//! `kvbridge demo --peer-router CMD`: the demo's workload through another project's router
//! (SGLang router's `cache_aware`, for one) in front of colocated reference engines, so that
//! its figures sit beside the kvbridge proxy's policies, measured the same way.
//!
//! The demo starts `--prefillers + --decoders` colocated engines (the same count, cost model
//! and prefix cache as the PD cluster's engines), then runs `CMD` under `sh -c` in its own
//! process group with `WORKER_URLS` (space-separated `http://127.0.0.1:PORT`),
//! `ROUTER_PORT` and `METRICS_PORT` (two free loopback ports) in its environment. The router
//! is ready when `GET /v1/models` through it answers (that needs a registered worker; its
//! `/health` can answer before). The workload then goes to it with each prompt as text (the
//! token ids' words, which the engines tokenize back to the same ids), since routers that
//! keep a text tree take no token-id prompts. The router's process group is killed at the
//! end, on every path.

use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;
use tokio::net::TcpListener;

use crate::client::Client;
use crate::demo::{self, DemoArgs, WorkItem};
use crate::engine::{self, EngineConfig, Role, RunningEngine};
use crate::model;
use crate::prompt_format;

/// The longest the router may take to answer its first `GET /v1/models`.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// What a run through a peer router gave (the demo's field names where they mean the same).
#[derive(Debug, Clone, Serialize)]
pub struct PeerSummary {
    /// The command that started the router.
    pub peer_router: String,
    /// Workload requests sent.
    pub requests: u64,
    /// Answered in full.
    pub ok: u64,
    /// Failed (error status, SSE error, timeout).
    pub failed: u64,
    /// First errors seen (at most 5).
    pub errors: Vec<String>,
    /// Prompt tokens of the workload, summed.
    pub prompt_tokens: u64,
    /// [`demo::DemoSummary::shared_prompt_tokens`].
    pub shared_prompt_tokens: u64,
    /// [`demo::DemoSummary::shared_fraction`].
    pub shared_fraction: f64,
    /// [`demo::DemoSummary::routable_shared_fraction`].
    pub routable_shared_fraction: f64,
    /// Prompt tokens the engines computed (past their prefix caches).
    pub prefill_tokens_computed: u64,
    /// [`demo::DemoSummary::prefill_tokens_spared_fraction`].
    pub prefill_tokens_spared_fraction: f64,
    /// KV bytes moved between engines: none, they are colocated.
    pub kv_bytes_moved: u64,
    /// TTFT of the workload's streamed requests, p50, ms.
    pub ttft_p50_ms: f64,
    /// TTFT p99, ms.
    pub ttft_p99_ms: f64,
    /// Seconds the workload took.
    pub wall_s: f64,
    /// Colocated engines behind the router.
    pub engines: u32,
    /// Every engine's prefix cache, tokens.
    pub prefix_cache_tokens: u64,
}

impl PeerSummary {
    /// Every request answered.
    pub fn passed(&self) -> bool {
        self.failed == 0 && self.ok == self.requests
    }

    /// The human-readable summary.
    pub fn table(&self) -> String {
        let mut t = format!(
            "peer router: {}\n{} colocated engines, prefix cache {} tokens each\n\
             requests {} ok {} failed {}\n\
             TTFT p50 {:.1} ms, p99 {:.1} ms; wall {:.2} s\n\
             prompt tokens {} (shared {:.1}%), prefill tokens computed {}\n",
            self.peer_router,
            self.engines,
            self.prefix_cache_tokens,
            self.requests,
            self.ok,
            self.failed,
            self.ttft_p50_ms,
            self.ttft_p99_ms,
            self.wall_s,
            self.prompt_tokens,
            self.shared_fraction * 100.0,
            self.prefill_tokens_computed,
        );
        for e in &self.errors {
            t.push_str(&format!("error: {e}\n"));
        }
        t
    }
}

/// Why a peer-router run could not measure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// An engine or a port could not be set up.
    #[error("peer router: setting up {step}: {detail}")]
    Setup {
        /// What was being set up.
        step: &'static str,
        /// The cause.
        detail: String,
    },
    /// The router's command exited before it was ready.
    #[error("peer router `{cmd}` exited before it was ready ({status})")]
    Exited {
        /// The command.
        cmd: String,
        /// Its exit status.
        status: String,
    },
    /// The router did not answer `GET /v1/models` in time.
    #[error("peer router `{cmd}` did not answer GET /v1/models within {after:?}: {last}")]
    NotReady {
        /// The command.
        cmd: String,
        /// The deadline.
        after: Duration,
        /// The last error seen.
        last: String,
    },
}

/// The router's process group, killed when dropped.
struct RouterProcess {
    child: tokio::process::Child,
}

impl RouterProcess {
    fn kill(&mut self) {
        if let Some(pid) = self.child.id() {
            // SAFETY: kill(2) with a negative pid signals the process group this child leads
            // (it was spawned with process_group(0)); no memory is touched.
            unsafe {
                libc::kill(-(pid as i32), libc::SIGKILL);
            }
        }
    }
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn free_port() -> Result<u16, PeerError> {
    let l = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| setup("a free port", e))?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| setup("a free port", e))
}

fn setup(step: &'static str, e: impl std::fmt::Display) -> PeerError {
    PeerError::Setup {
        step,
        detail: e.to_string(),
    }
}

/// The workload request with its token-id prompt given as the ids' words.
pub fn as_text(w: &WorkItem) -> WorkItem {
    let mut body = w.body.clone();
    if let Some(Value::Array(ids)) = body.get("prompt") {
        // A value that is no id has no word (`u32::MAX` is past the vocabulary): "?".
        let ids: Vec<u32> = ids
            .iter()
            .map(|v| v.as_u64().map_or(u32::MAX, |i| i as u32))
            .collect();
        body["prompt"] = Value::String(prompt_format::words(&ids));
    }
    WorkItem { path: w.path, body }
}

/// Runs `args`' workload through the router `cmd` starts (module docs).
pub async fn run(args: DemoArgs, cmd: &str) -> anyhow::Result<PeerSummary> {
    if args.tp_flags_given() || args.mla {
        anyhow::bail!(
            "--prefill-tp, --decode-tp and --mla apply to the in-process demo, not to --peer-router"
        );
    }
    let model = args.model.build()?;
    let cost = args.cost.build()?;
    let output = demo::range(&args.output_tokens, "--output-tokens")?;
    if args.workload != demo::Workload::SharedPrefix {
        anyhow::bail!("--peer-router runs the shared-prefix workload (--workload shared-prefix)");
    }
    let deadline = Duration::from_secs_f64(args.request_timeout.max(0.001));
    let n_engines = args.prefillers.unwrap_or(demo::SHARED_PREFIX_POOL)
        + args.decoders.unwrap_or(demo::SHARED_PREFIX_POOL);
    let cache = args
        .prefix_cache_tokens
        .unwrap_or(demo::SHARED_PREFIX_CACHE_TOKENS);
    let mut engines: Vec<RunningEngine> = Vec::new();
    for _ in 0..n_engines {
        let mut c = EngineConfig::new(Role::Both, model.clone());
        c.cost = cost;
        c.prefix_cache_tokens = cache;
        let l = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| setup("an engine's listener", e))?;
        engines.push(
            engine::start(c, l)
                .await
                .map_err(|e| setup("an engine", e))?,
        );
    }
    let result = drive(&args, cmd, &engines, &model, output, deadline).await;
    let computed: u64 = engines
        .iter()
        .map(|e| e.stats().prefill_tokens_computed)
        .sum();
    for e in engines {
        e.shutdown().await;
    }
    let mut s = result?;
    s.prefill_tokens_computed = computed;
    s.prefill_tokens_spared_fraction = demo::spared_fraction(s.prompt_tokens, computed);
    s.engines = n_engines;
    s.prefix_cache_tokens = cache;
    Ok(s)
}

async fn drive(
    args: &DemoArgs,
    cmd: &str,
    engines: &[RunningEngine],
    model: &model::Model,
    output: (u32, u32),
    deadline: Duration,
) -> anyhow::Result<PeerSummary> {
    let urls: Vec<String> = engines
        .iter()
        .map(|e| format!("http://{}", e.http_addr()))
        .collect();
    let (port, metrics_port) = (free_port().await?, free_port().await?);
    let child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .env("WORKER_URLS", urls.join(" "))
        .env("ROUTER_PORT", port.to_string())
        .env("METRICS_PORT", metrics_port.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| setup("the router's command", e))?;
    let mut router = RouterProcess { child };
    let client = Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        if let Ok(Some(status)) = router.child.try_wait() {
            return Err(PeerError::Exited {
                cmd: cmd.into(),
                status: status.to_string(),
            }
            .into());
        }
        match client
            .get_text(&format!("{base}/v1/models"), Duration::from_secs(2))
            .await
        {
            Ok(_) => break,
            Err(e) if t0.elapsed() > READY_TIMEOUT => {
                return Err(PeerError::NotReady {
                    cmd: cmd.into(),
                    after: READY_TIMEOUT,
                    last: e.to_string(),
                }
                .into())
            }
            Err(_) => {}
        }
    }
    let work: Vec<WorkItem> =
        demo::shared_prefix_workload(args.requests, args.seed, output, &model.name)
            .iter()
            .map(as_text)
            .collect();
    let prompt_tokens: u64 = work.iter().map(|w| demo::prompt_ids(w).len() as u64).sum();
    let (shared, _) = demo::shared_tokens(&work, model.spec.chunk_tokens);
    let routable = demo::routable_tokens(&work, model.spec.chunk_tokens);
    let t = Instant::now();
    let results = demo::send_all(&client, &base, &work, args.concurrency, deadline).await;
    let wall_s = t.elapsed().as_secs_f64();
    router.kill();
    let _ = tokio::time::timeout(Duration::from_secs(5), router.child.wait()).await;
    let (mut ttft, mut errors, mut ok) = (Vec::new(), Vec::new(), 0u64);
    for (i, r) in &results {
        match r {
            Ok(a) => {
                ok += 1;
                ttft.push(a.ttft.as_secs_f64() * 1e3);
            }
            Err(e) if errors.len() < 5 => errors.push(format!("request {i}: {e}")),
            Err(_) => {}
        }
    }
    let n = work.len() as u64;
    Ok(PeerSummary {
        peer_router: cmd.into(),
        requests: n,
        ok,
        failed: n - ok,
        errors,
        prompt_tokens,
        shared_prompt_tokens: shared,
        shared_fraction: if prompt_tokens > 0 {
            shared as f64 / prompt_tokens as f64
        } else {
            0.0
        },
        routable_shared_fraction: routable.fraction(),
        prefill_tokens_computed: 0,
        prefill_tokens_spared_fraction: 0.0,
        kv_bytes_moved: 0,
        ttft_p50_ms: demo::pct(&mut ttft, 0.5),
        ttft_p99_ms: demo::pct(&mut ttft, 0.99),
        wall_s,
        engines: 0,
        prefix_cache_tokens: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_prompts_tokenize_to_the_same_ids() {
        let work = demo::shared_prefix_workload(6, 3, (2, 4), "m");
        for w in &work {
            let t = as_text(w);
            assert!(t.body["prompt"].is_string());
            assert_eq!(demo::prompt_ids(&t), demo::prompt_ids(w));
        }
    }
}
