//! Command-line arguments of `kvbridge engine` and the model and cost flags `kvbridge demo`
//! shares with it.

use crate::cost::CostModel;
use crate::engine::{self, EngineConfig, Role};
use crate::model::Model;
use kvbridge_pd::{Dtype, KvLayout, KvSpec};
use std::time::Duration;

/// The model's shape. Defaults: an 8B-class model's layer shape (8 KV heads of 128, bf16)
/// with 8 instead of 32 layers, so that the demo's KV (32 KiB per token) moves through the
/// whole system on 2 cores in well under a minute.
#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Model name (served by `/v1/models`; part of PD chunk keys).
    #[arg(long, default_value = "kvbridge-sim-8b")]
    pub model: String,
    /// Transformer layers.
    #[arg(long, default_value_t = 8)]
    pub layers: u32,
    /// KV heads per rank (standard layout).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: u32,
    /// Head dimension (standard layout).
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
    /// MLA latent dimension; when set (> 0) the layout is MLA `(layers, 1, tokens, latent)`.
    #[arg(long, default_value_t = 0)]
    pub latent_dim: u32,
    /// fp32, fp16, bf16 or fp8.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Tokens per KV chunk (one receive-buffer page).
    #[arg(long, default_value_t = 256)]
    pub chunk_tokens: u32,
    /// Tensor-parallel ranks (one PD sender or receiver each).
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
}

impl ModelArgs {
    /// The model these flags describe.
    pub fn build(&self) -> anyhow::Result<Model> {
        let dtype: Dtype = self.dtype.parse().map_err(anyhow::Error::msg)?;
        let layout =
            KvLayout::from_dims(self.layers, self.kv_heads, self.head_dim, self.latent_dim);
        let spec = KvSpec {
            chunk_tokens: self.chunk_tokens,
            ..KvSpec::new(layout, dtype)
        };
        spec.validate().map_err(anyhow::Error::msg)?;
        if self.tp == 0 {
            anyhow::bail!("--tp must be at least 1");
        }
        Ok(Model {
            name: self.model.clone(),
            spec,
            world_size: self.tp,
        })
    }
}

/// The cost model's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct CostArgs {
    /// Prefill speed, prompt tokens per second (0: as fast as the CPU goes).
    #[arg(long, default_value_t = CostModel::default().prefill_tokens_per_s)]
    pub prefill_tokens_per_s: f64,
    /// Decode time per generated token, milliseconds.
    #[arg(long, default_value_t = CostModel::default().decode_per_token.as_secs_f64() * 1e3)]
    pub decode_ms_per_token: f64,
    /// Prompt tokens prefilled per step (chunked prefill): a step's KV exists when the step
    /// ends, then moves in pages of `--chunk-tokens`. 0: one page per step.
    #[arg(long, default_value_t = CostModel::default().prefill_step_tokens)]
    pub prefill_step_tokens: u32,
}

impl CostArgs {
    /// The cost model these flags describe.
    pub fn build(&self) -> anyhow::Result<CostModel> {
        if !self.decode_ms_per_token.is_finite()
            || !(0.0..=60_000.0).contains(&self.decode_ms_per_token)
        {
            anyhow::bail!("--decode-ms-per-token must be between 0 and 60000");
        }
        if !self.prefill_tokens_per_s.is_finite() || self.prefill_tokens_per_s < 0.0 {
            anyhow::bail!("--prefill-tokens-per-s must be a non-negative number");
        }
        Ok(CostModel {
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            decode_per_token: Duration::from_secs_f64(self.decode_ms_per_token / 1e3),
            prefill_step_tokens: self.prefill_step_tokens,
        })
    }
}

/// `kvbridge engine`: the reference engine (a deterministic mock LLM; see docs/engine.md).
#[derive(Debug, Clone, clap::Args)]
pub struct EngineArgs {
    /// prefill, decode or both (colocated).
    #[arg(long, value_enum, default_value = "both")]
    pub role: Role,
    /// HTTP host.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// HTTP port (0 picks a free one; the addresses are printed as one JSON line).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Decode: PD receiver port per rank (comma list; 0 picks a free one).
    #[arg(long, value_delimiter = ',')]
    pub init_port: Vec<u16>,
    /// Decode: announce port per rank (comma list; the proxy's `--decoder-alloc-port`).
    #[arg(long, value_delimiter = ',')]
    pub alloc_port: Vec<u16>,
    /// Decode: receive buffer per rank, MiB.
    #[arg(long, default_value_t = 1024)]
    pub buffer_mib: u64,
    /// Decode: seconds before received KV that no decode request claims returns to the buffer.
    #[arg(long, default_value_t = 60.0)]
    pub kv_ttl_sec: f64,
    /// Prefill: the proxy's ZMQ PULL host (outcomes go there).
    #[arg(long)]
    pub proxy_host: Option<String>,
    /// Prefill: the proxy's ZMQ PULL port.
    #[arg(long)]
    pub proxy_port: Option<u16>,
    /// Prefill: read the proxy's ZMQ endpoint (`tcp://host:port`) as one line from stdin
    /// after the addresses are printed (a parent that starts the proxy after its workers).
    #[arg(long)]
    pub proxy_endpoint_from_stdin: bool,
    /// The model.
    #[command(flatten)]
    pub model: ModelArgs,
    /// The cost model.
    #[command(flatten)]
    pub cost: CostArgs,
    /// PD settings passed to the PD layer (`--pd-set pd_transfer_mode=pull`, ...).
    #[command(flatten)]
    pub pd: kvbridge_pd::PdConfigArgs,
    /// The engine's own settings file (TOML: `prefix_cache_tokens`, `kv_events_endpoint`,
    /// `kv_events_topic`); flags win over it.
    #[arg(long)]
    pub config: Option<std::path::PathBuf>,
    /// Tokens the prefix cache keeps, whole chunks, least recently used evicted (0: no
    /// cache) [default: 131072].
    #[arg(long)]
    pub prefix_cache_tokens: Option<u64>,
    /// Publish the prefix cache's KV events (vLLM's format) on this ZMQ PUB endpoint,
    /// `tcp://*:5557` as vLLM's `--kv-events-config` `endpoint` (port 0 picks a free one;
    /// the address is printed as `kv_events`).
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// The KV events' topic (vLLM's `topic`) [default: empty].
    #[arg(long)]
    pub kv_events_topic: Option<String>,
}

/// The engine's settings file (`--config`).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineFile {
    prefix_cache_tokens: Option<u64>,
    kv_events_endpoint: Option<String>,
    kv_events_topic: Option<String>,
}

impl EngineArgs {
    /// The engine configuration these flags describe.
    pub fn config(&self) -> anyhow::Result<EngineConfig> {
        let mut c = EngineConfig::new(self.role, self.model.build()?);
        c.apply_pd(&kvbridge_pd::PdConfig::load(&self.pd)?);
        c.cost = self.cost.build()?;
        c.bind_host = self.host.clone();
        c.init_ports = self.init_port.clone();
        c.alloc_ports = self.alloc_port.clone();
        c.buffer_bytes = self.buffer_mib.saturating_mul(1 << 20);
        if !(self.kv_ttl_sec > 0.0 && self.kv_ttl_sec.is_finite()) {
            anyhow::bail!("--kv-ttl-sec must be a positive number of seconds");
        }
        c.kv_ttl = Duration::from_secs_f64(self.kv_ttl_sec);
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
                toml::from_str::<EngineFile>(&text)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
            }
            None => EngineFile::default(),
        };
        if let Some(t) = self.prefix_cache_tokens.or(file.prefix_cache_tokens) {
            c.prefix_cache_tokens = t;
        }
        c.kv_events_endpoint = self.kv_events_endpoint.clone().or(file.kv_events_endpoint);
        if let Some(t) = self.kv_events_topic.clone().or(file.kv_events_topic) {
            c.kv_events_topic = t;
        }
        c.proxy_endpoint = match (&self.proxy_host, self.proxy_port) {
            (Some(h), Some(p)) => Some(format!("tcp://{h}:{p}")),
            (None, None) => None,
            _ => anyhow::bail!("give both --proxy-host and --proxy-port, or neither"),
        };
        if self.role == Role::Prefill && c.proxy_endpoint.is_none() {
            tracing::warn!("prefill without --proxy-host/--proxy-port: KV outcomes are dropped");
        }
        Ok(c)
    }
}

/// Runs `kvbridge engine` until Ctrl-C: binds, prints `{"http", "init_ports",
/// "alloc_ports"}` as one line on stdout, serves.
pub async fn run_engine(args: EngineArgs) -> anyhow::Result<()> {
    let mut cfg = args.config()?;
    let l = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", args.host, args.port))?;
    let http = l.local_addr()?;
    let e = if args.proxy_endpoint_from_stdin {
        // The HTTP port and the KV-events publisher are bound (requests queue, subscribers
        // connect) before the endpoint is known, so a proxy can be given both first.
        let publisher = match &cfg.kv_events_endpoint {
            Some(ep) => Some(
                crate::kv_events_pub::KvEventsPublisher::bind(
                    ep,
                    &cfg.kv_events_topic,
                    crate::kv_events_pub::PubLimits::default(),
                )
                .await
                .map_err(|e| anyhow::anyhow!("KV events endpoint {ep}: {e}"))?,
            ),
            None => None,
        };
        println!(
            "{}",
            serde_json::json!({"http": http.to_string(), "role": args.role,
                "init_ports": [], "alloc_ports": [],
                "kv_events": publisher.as_ref().map(|p| format!("tcp://{}", p.local_addr()))})
        );
        let mut line = String::new();
        let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
        tokio::time::timeout(
            Duration::from_secs(60),
            tokio::io::AsyncBufReadExt::read_line(&mut stdin, &mut line),
        )
        .await
        .map_err(|_| anyhow::anyhow!("no proxy endpoint on stdin within 60 s"))??;
        let ep = line.trim();
        if !ep.starts_with("tcp://") {
            anyhow::bail!("expected tcp://host:port on stdin, got {ep:?}");
        }
        cfg.proxy_endpoint = Some(ep.to_string());
        engine::start_with_publisher(cfg, l, publisher).await?
    } else {
        let e = engine::start(cfg, l).await?;
        println!(
            "{}",
            serde_json::json!({"http": e.http_addr().to_string(), "role": args.role,
                "init_ports": e.init_ports(), "alloc_ports": e.alloc_ports(),
                "kv_events": e.kv_events_addr().map(|a| format!("tcp://{a}"))})
        );
        e
    };
    tokio::signal::ctrl_c().await?;
    e.shutdown().await;
    Ok(())
}
