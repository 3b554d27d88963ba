//! Command-line entry points of `kvbridge proxy`.

use std::path::PathBuf;

use crate::config::{Config, Flow};

/// Flags of `kvbridge proxy`. Lists take commas or several values (`--decoder-init-port
/// 8300,8301` or `--decoder-init-port 8300 8301`). Flags win over `--config`, which wins over
/// the defaults shown.
#[derive(Debug, Default, clap::Args)]
pub struct ProxyArgs {
    /// TOML configuration file (same keys as the flags, with `_`; workers as `[[prefiller]]`
    /// and `[[decoder]]` tables, see docs/proxy.md).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// HTTP listen host [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// HTTP listen port [default: 8000].
    #[arg(long)]
    pub port: Option<u16>,
    /// Prefiller hosts (one for all ports, or one per port) [default: localhost].
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prefiller_host: Option<Vec<String>>,
    /// Prefiller HTTP ports [default: 8100].
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prefiller_port: Option<Vec<u16>>,
    /// Decoder hosts (one for all ports, or one per port) [default: localhost].
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub decoder_host: Option<Vec<String>>,
    /// Decoder HTTP ports [default: 8200].
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub decoder_port: Option<Vec<u16>>,
    /// KV receiver init port of each rank, same for every decoder [default: 8300].
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub decoder_init_port: Option<Vec<u16>>,
    /// KV receiver alloc port of each rank, same for every decoder [default: 8400].
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub decoder_alloc_port: Option<Vec<u16>>,
    /// sglang flow: bootstrap port of each prefiller (SGLang's
    /// `--disaggregation-bootstrap-port`), one for all or one per prefiller in order; `none`
    /// for one without (it gets `bootstrap_port: null`, as from SGLang's router) [default:
    /// none].
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prefiller_bootstrap_port: Option<Vec<crate::config::BootstrapPort>>,
    /// SGLang router's form of a prefill server, once per server: `--prefill URL
    /// [BOOTSTRAP_PORT]` (`http://host:port`; the port a number or `none`). Not with
    /// --prefiller-host/--prefiller-port.
    #[arg(long, num_args = 1..=2, value_names = ["URL", "BOOTSTRAP_PORT"], action = clap::ArgAction::Append)]
    pub prefill: Option<Vec<String>>,
    /// SGLang router's form of a decode server, once per server: `--decode URL`. Not with
    /// --decoder-host/--decoder-port.
    #[arg(long, num_args = 1.., action = clap::ArgAction::Append)]
    pub decode: Option<Vec<String>>,
    /// Number of prefillers; expands a single --prefiller-port into consecutive ports.
    #[arg(long)]
    pub num_prefillers: Option<usize>,
    /// Number of decoders; expands a single --decoder-port into consecutive ports.
    #[arg(long)]
    pub num_decoders: Option<usize>,
    /// Host of the ZMQ PULL socket that receives KV outcomes [default: 127.0.0.1].
    #[arg(long)]
    pub proxy_host: Option<String>,
    /// Port of the ZMQ PULL socket that receives KV outcomes [default: 8500].
    #[arg(long)]
    pub proxy_port: Option<u16>,
    /// Request flow: `lmcache`, `vllm` (NIXL), or `sglang` (SGLang's PD servers, as SGLang's
    /// router talks to them) [default: lmcache].
    #[arg(long, value_enum)]
    pub flow: Option<Flow>,
    /// Seconds to wait for every rank's KV-ready outcome after the prefill (504 after)
    /// [default: 60].
    #[arg(long)]
    pub kv_ready_timeout: Option<f64>,
    /// Seconds allowed for the prefill request [default: 300].
    #[arg(long)]
    pub prefill_timeout: Option<f64>,
    /// Seconds allowed for the decoder's response head, a non-streamed answer, and each gap
    /// between streamed chunks [default: 300].
    #[arg(long)]
    pub decode_timeout: Option<f64>,
    /// Seconds allowed to open a connection to a worker [default: 3].
    #[arg(long)]
    pub connect_timeout: Option<f64>,
    /// Seconds between health checks of each worker; 0 disables them [default: 2].
    #[arg(long)]
    pub health_interval: Option<f64>,
    /// Seconds allowed for one health check [default: 1].
    #[arg(long)]
    pub health_timeout: Option<f64>,
    /// Whether a decoder's health check also connects to each of its KV init ports (`true`
    /// or `false`) [default: true in the lmcache flow, false in the vllm flow, whose NIXL
    /// decoders have no KV init port].
    #[arg(long)]
    pub health_kv_ports: Option<bool>,
    /// Shared secret: with one, a KV outcome counts only with a valid tag (kvbridge's PD
    /// senders add it under the same `KVBRIDGE_SECRET`), and untagged ones (LMCache's
    /// `ProxyNotif`) are refused and counted. Prefer the environment to the flag (a flag
    /// shows in the process list).
    #[arg(long, env = "KVBRIDGE_SECRET", hide_env_values = true)]
    pub secret: Option<crate::config::Secret>,
    /// Most client connections open at once; more are closed as soon as accepted
    /// [default: 4096].
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds a client has to send a request's headers [default: 10].
    #[arg(long)]
    pub header_timeout: Option<f64>,
    /// Seconds a client has to send a request's body once its headers are in (408 after)
    /// [default: 30].
    #[arg(long)]
    pub body_timeout: Option<f64>,
    /// Consecutive failed checks that eject a worker [default: 2].
    #[arg(long)]
    pub unhealthy_after: Option<u32>,
    /// Consecutive passed checks that re-admit a worker [default: 1].
    #[arg(long)]
    pub healthy_after: Option<u32>,
    /// Most requests admitted to one decoder at once; 0 = no limit [default: 0].
    #[arg(long)]
    pub decoder_max_requests: Option<u32>,
    /// KV capacity of one decoder in prompt tokens (estimated as bytes/4); 0 = no limit
    /// [default: 0].
    #[arg(long)]
    pub decoder_kv_capacity: Option<u64>,
    /// How each pool chooses among the workers that admit a request (docs/proxy.md,
    /// "Routing") [default: least-loaded].
    #[arg(long, value_enum)]
    pub routing: Option<crate::routing::RoutingPolicy>,
    /// KV-events PUB endpoint of each prefiller, in order (`tcp://host:port`, vLLM's
    /// `--kv-events-config` `endpoint`); with `--routing kv-events`.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub prefiller_kv_events_endpoint: Option<Vec<String>>,
    /// KV-events PUB endpoint of each decoder, in order.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub decoder_kv_events_endpoint: Option<Vec<String>>,
    /// KV-events topic to subscribe to [default: "" (every topic)].
    #[arg(long)]
    pub kv_events_topic: Option<String>,
    /// `kv-events` cost of a prompt token to prefill, against a token of load; the
    /// disaggregation decider's rule 3 weighs with it too [default: 2].
    #[arg(long)]
    pub kv_events_prefill_weight: Option<f64>,
    /// `kv-events` cost of a token of load (rule 3 too) [default: 1].
    #[arg(long)]
    pub kv_events_load_weight: Option<f64>,
    /// `kv-events`: where the token ids of a text prompt or a chat's messages come from:
    /// `http` asks a healthy worker's `POST /tokenize` (vLLM's OpenAI server) before
    /// routing; `off` ranks such requests by load alone. A failed call routes by load
    /// (`kvbridge_proxy_tokenize_total{result}`) [default: off].
    #[arg(long, value_enum)]
    pub kv_events_tokenize: Option<crate::tokenize::TokenizeMode>,
    /// Seconds one `/tokenize` call may take, reply read in full [default: 0.25].
    #[arg(long)]
    pub kv_events_tokenize_timeout: Option<f64>,
    /// Largest `/tokenize` reply read, bytes; a larger one routes by load [default:
    /// 16777216].
    #[arg(long)]
    pub kv_events_tokenize_max_reply_bytes: Option<usize>,
    /// `cache-aware`: fraction of the prompt a prefix match must exceed [default: 0.3].
    #[arg(long)]
    pub cache_threshold: Option<f64>,
    /// `cache-aware`: requests in flight by which the busiest worker must exceed the idlest
    /// to route by load [default: 64].
    #[arg(long)]
    pub balance_abs_threshold: Option<u64>,
    /// `cache-aware`: ratio by which the busiest worker must exceed the idlest to route by
    /// load [default: 1.5].
    #[arg(long)]
    pub balance_rel_threshold: Option<f64>,
    /// Decider: a prompt with fewer tokens than this not held by its decoder goes to the
    /// decoder alone, which prefills it (docs/proxy.md, "Disaggregation decider")
    /// [default: 512 under cache-aware and kv-events; least-loaded always disaggregates
    /// unless a decider flag is given].
    #[arg(long)]
    pub disaggregate_min_uncached_tokens: Option<u64>,
    /// Decider: a decoder that holds at least this fraction of the prompt prefills it
    /// (above 1: never) [default: 0.8].
    #[arg(long)]
    pub disaggregate_decoder_cached_fraction: Option<f64>,
    /// Decider: a decoder that would finish the prompt's prefill before the prefiller's
    /// queue lets it start prefills it (`true`/`false`) [default: true].
    #[arg(long)]
    pub disaggregate_compare_queues: Option<bool>,
    /// Most requests waiting for admission; more get 429 at once [default: 1024].
    #[arg(long)]
    pub max_queue: Option<usize>,
    /// Seconds a request may wait for admission before 429 [default: 10].
    #[arg(long)]
    pub queue_timeout: Option<f64>,
    /// Largest request body in bytes; larger ones get 413 `request_too_large` [default:
    /// 8388608].
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Threads that serve requests. 1 (the default) runs everything on one thread, so a
    /// request is never handed between threads (the lowest latency and CPU per request; one
    /// core serves well over 10,000 requests per second); more use a work-stealing pool.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: u16,
    /// Microseconds the proxy polls its sockets instead of sleeping while the only request
    /// in flight awaits a backend (a sleeping thread costs tens of microseconds to wake on an
    /// idle machine, twice per request); 0 turns it off. One-thread runtime only [default:
    /// 100].
    #[arg(long)]
    pub busy_poll_us: Option<u64>,
    /// lmcache flow: send the decode request only after every rank's `KvReady` (true), or
    /// as soon as the prefill answered, overlapping the KV's tail, with the decoder's answer
    /// passed on only after every `KvReady` (false: faster, for decoders that wait for
    /// their KV with a deadline) [default: true].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub decode_after_kv_ready: Option<bool>,
    /// lmcache flow: whether a streamed completion's first token (the prefill's) goes to the
    /// client as soon as every rank reported `KvReady`, ahead of the decoder's stream
    /// (`true` or `false`) [default: true].
    #[arg(long)]
    pub first_token_on_kv_ready: Option<bool>,
}

/// Builds the proxy's runtime (see [`ProxyArgs::threads`]) and runs the proxy on it until
/// SIGINT or SIGTERM.
pub fn main(args: ProxyArgs) -> anyhow::Result<()> {
    let rt = if args.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(args.threads as usize)
            .enable_all()
            .build()?
    };
    rt.block_on(run(args))
}

/// Runs the proxy until SIGINT or SIGTERM. Once bound, it prints its addresses as one JSON
/// line on stdout, `{"http": "host:port", "notify": "host:port" | null}`, so a parent that
/// asked for port 0 learns the ports without guessing.
pub async fn run(args: ProxyArgs) -> anyhow::Result<()> {
    let cfg = Config::from_args(&args)?;
    let proxy = crate::server::start(cfg).await?;
    println!(
        "{}",
        serde_json::json!({"http": proxy.http_addr().to_string(),
            "notify": proxy.notify_addr().map(|a| a.to_string())})
    );
    tracing::info!(
        http = %proxy.http_addr(),
        notify = ?proxy.notify_addr(),
        "kvbridge proxy listening"
    );
    shutdown_signal().await;
    tracing::info!("shutting down");
    proxy.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
