//! Proxy configuration: built from the command line, an optional TOML file, and defaults
//! (in that order of precedence).

use std::time::Duration;

use serde::Deserialize;

use crate::routing::decider::DeciderParams;
use crate::routing::policy::{CacheAwareParams, KvEventsWeights, RoutingPolicy};
use crate::tokenize::TokenizeMode;

/// How a request crosses from prefill to decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Flow {
    /// LMCache PD: the prefill carries a `disagg_spec`; prefiller ranks push outcomes to the
    /// proxy's ZMQ PULL socket; the decode starts when every rank reported ready.
    Lmcache,
    /// vLLM NIXL connector: the prefill response's `kv_transfer_params` go into the decode
    /// request; no notification socket.
    Vllm,
    /// SGLang PD (what SGLang's own router does): the same body, with `bootstrap_host`,
    /// `bootstrap_port` and `bootstrap_room` added, goes to a prefill and a decode server at
    /// once; the decode server's answer is the answer.
    Sglang,
}

/// The shared secret that authenticates KV outcomes (`KVBRIDGE_SECRET`, `--secret`). Its
/// `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(std::sync::Arc<[u8]>);

impl Secret {
    /// A secret from bytes; `None` when empty.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<Secret> {
        let b: Vec<u8> = bytes.into();
        (!b.is_empty()).then(|| Secret(b.into()))
    }

    /// The secret's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl std::str::FromStr for Secret {
    type Err = String;
    fn from_str(s: &str) -> Result<Secret, String> {
        Secret::new(s.as_bytes()).ok_or_else(|| "the secret is empty".to_string())
    }
}

/// A prefiller's bootstrap port on the command line: a port number, or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootstrapPort(pub Option<u16>);

impl std::str::FromStr for BootstrapPort {
    type Err = String;
    fn from_str(s: &str) -> Result<BootstrapPort, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("none") {
            return Ok(BootstrapPort(None));
        }
        match s.parse::<u16>() {
            Ok(p) if p > 0 => Ok(BootstrapPort(Some(p))),
            _ => Err(format!(
                "bootstrap port {s:?} is not a port number (1-65535) or `none`"
            )),
        }
    }
}

/// An HTTP worker (prefiller or decoder).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerAddr {
    /// Host name or IP address.
    pub host: String,
    /// HTTP port.
    pub port: u16,
}

/// A decoder: its HTTP address, its KV receiver ports (one per rank) and its admission limits.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecoderConfig {
    /// Host name or IP address (also the `receiver_host` of the `disagg_spec`).
    pub host: String,
    /// HTTP port.
    pub port: u16,
    /// KV receiver init (handshake) port of each rank.
    #[serde(default)]
    pub init_ports: Vec<u16>,
    /// KV receiver alloc port of each rank.
    #[serde(default)]
    pub alloc_ports: Vec<u16>,
    /// Most requests admitted to this decoder at once (0: no limit).
    #[serde(default)]
    pub max_requests: u32,
    /// Most prompt tokens (estimated) admitted to this decoder at once: its KV buffer capacity
    /// (0: no limit).
    #[serde(default)]
    pub kv_capacity_tokens: u64,
}

impl DecoderConfig {
    /// Number of ranks whose outcome the proxy waits for.
    pub fn ranks(&self) -> u32 {
        self.init_ports.len().max(1) as u32
    }
}

/// Limits of the outcome port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutcomePortLimits {
    /// Most connections served at once.
    pub max_conns: usize,
    /// Deadline for a new connection's greeting and `READY`.
    pub handshake: Duration,
    /// Deadline for a frame, from its first byte to its last.
    pub frame: Duration,
    /// Largest frame body (an outcome message).
    pub max_frame: usize,
    /// Most frames in one message.
    pub max_frames: usize,
}

impl Default for OutcomePortLimits {
    fn default() -> Self {
        OutcomePortLimits {
            max_conns: 1024,
            handshake: Duration::from_secs(5),
            frame: Duration::from_secs(5),
            max_frame: crate::notif::MAX_MESSAGE_BYTES,
            max_frames: 16,
        }
    }
}

/// Limits of the HTTP listener against clients that hold connections without finishing
/// their requests (slowloris).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Most client connections open at once; more are closed as soon as accepted.
    pub max_conns: usize,
    /// Deadline for a request's headers, from the connection's first byte (or from the end
    /// of the previous request on a kept-alive connection).
    pub header_timeout: Duration,
    /// Deadline for a request's whole body, once its headers are in (408 after).
    pub body_timeout: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_conns: 4096,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
        }
    }
}

/// Everything the proxy needs to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// HTTP listen host.
    pub host: String,
    /// HTTP listen port (0 picks a free one).
    pub port: u16,
    /// Prefill workers.
    pub prefillers: Vec<WorkerAddr>,
    /// Decode workers.
    pub decoders: Vec<DecoderConfig>,
    /// sglang flow: each prefiller's bootstrap port (SGLang's
    /// `--disaggregation-bootstrap-port`), in the order of `prefillers`; `None` sends
    /// `bootstrap_port: null` as SGLang's router does for a prefill given without one. Empty:
    /// `None` for every prefiller.
    pub prefiller_bootstrap_ports: Vec<Option<u16>>,
    /// Host of the notification PULL socket (lmcache flow).
    pub proxy_host: String,
    /// Port of the notification PULL socket (0 picks a free one).
    pub proxy_port: u16,
    /// Request flow.
    pub flow: Flow,
    /// Deadline for all ranks' KV-ready outcomes, counted from the end of the prefill.
    pub kv_ready_timeout: Duration,
    /// Deadline for the prefill request (whole response).
    pub prefill_timeout: Duration,
    /// Deadline for the decoder's response head, a non-streamed body, and each gap between
    /// streamed chunks.
    pub decode_timeout: Duration,
    /// Deadline for opening a TCP connection to a worker.
    pub connect_timeout: Duration,
    /// Interval of active health checks (`GET /health`); zero disables them.
    pub health_interval: Duration,
    /// Deadline of one health check.
    pub health_timeout: Duration,
    /// Whether a decoder's health check also opens a TCP connection to each of its KV init
    /// ports (every rank): its HTTP endpoint can answer while its KV receiver is gone, and
    /// every prefill sent its way would then fail at the handshake. `None` fits the flow
    /// ([`Config::probes_kv_ports`]): on in the lmcache flow, off in the vllm flow, whose
    /// NIXL decoders have no KV init port.
    pub health_kv_ports: Option<bool>,
    /// The shared secret: with one, a KV outcome counts only with a valid tag (the PD sender
    /// adds it under the same secret); without one, any well-formed outcome counts,
    /// LMCache's untagged `ProxyNotif` included.
    pub secret: Option<Secret>,
    /// Limits of the outcome port (connections, deadlines, frame sizes).
    pub outcome_port: OutcomePortLimits,
    /// Limits of the HTTP listener (connections, header and body deadlines).
    pub http_limits: HttpLimits,
    /// Consecutive failed checks that eject a worker.
    pub unhealthy_after: u32,
    /// Consecutive passed checks that re-admit an ejected worker.
    pub healthy_after: u32,
    /// Most requests waiting for an admission slot; more are answered 429 at once.
    pub max_queue: usize,
    /// Longest wait for an admission slot before answering 429.
    pub queue_timeout: Duration,
    /// Largest request body accepted; a larger one is answered 413 `request_too_large`.
    pub max_body_bytes: usize,
    /// Longest a backend call is awaited by polling instead of sleeping, while it belongs to
    /// the only request in flight (see `--busy-poll-us`); zero turns polling off.
    pub busy_poll: Duration,
    /// lmcache flow: send the decode request only once every rank reported `KvReady` (true,
    /// the default), or as soon as the prefill answered (false: the decode request overlaps
    /// the KV's tail, and the decoder's answer is passed on only after every rank's
    /// `KvReady`; see `--decode-after-kv-ready` in docs/proxy.md). The default stays the
    /// old order because with the other one a decoder is contacted for KV that may never
    /// come (it must wait for its KV with a deadline, as the reference engine does).
    pub decode_after_kv_ready: bool,
    /// lmcache flow, streamed completions with a text prompt: send the prefill's first token
    /// to the client as soon as every rank reported `KvReady` (true, the default), ahead of
    /// the decoder's stream, rather than with the decoder's first answer (false). The client
    /// then does not wait for the decoder's first step over the KV; a decoder failure after
    /// that first token is an SSE `error` event, as any failure mid-stream.
    pub first_token_on_kv_ready: bool,
    /// How each pool chooses among the workers that admit a request.
    pub routing: RoutingPolicy,
    /// `kv-events`: where the workers publish and the cost's weights.
    pub kv_events: KvEventsConfig,
    /// `cache-aware`: SGLang router's thresholds.
    pub cache_aware: CacheAwareParams,
    /// The disaggregation decider's thresholds as given (flags or `[disaggregation]`);
    /// see [`Config::decider`].
    pub disaggregation: DisaggregationConfig,
}

/// `[disaggregation]`: the decider's thresholds ([`crate::routing::decider`]); unset ones take
/// their defaults.
#[derive(Debug, Clone, Copy, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DisaggregationConfig {
    /// Prompts with fewer uncached tokens go to their decoder alone.
    pub min_uncached_tokens: Option<u64>,
    /// A decoder holding at least this fraction of the prompt prefills it.
    pub decoder_cached_fraction: Option<f64>,
    /// Whether a decoder that would finish the prefill before the prefiller's queue lets
    /// it start prefills it.
    pub compare_queues: Option<bool>,
}

/// `[kv_events]`: the workers' KV-events endpoints (vLLM `--kv-events-config` `endpoint`,
/// the reference engine's `--kv-events-endpoint`) and the `kv-events` cost's weights.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// One PUB endpoint per prefiller (`tcp://host:port`), in order; none: the prefill
    /// pool routes least-loaded.
    pub prefiller_endpoints: Vec<String>,
    /// One PUB endpoint per decoder; none: the decode pool routes least-loaded.
    pub decoder_endpoints: Vec<String>,
    /// The topic subscribed to (vLLM's `topic`, empty by default: every topic).
    pub topic: String,
    /// Cost of a prompt token to prefill.
    pub prefill_weight: f64,
    /// Cost of a token of load.
    pub load_weight: f64,
    /// Most blocks the index keeps per worker.
    pub max_blocks_per_worker: usize,
    /// Whether a text prompt or chat's token ids come from a worker's `POST /tokenize`
    /// (`http`) or are not known (`off`: such requests rank by load alone).
    pub tokenize: TokenizeMode,
    /// Deadline of one `/tokenize` call, seconds.
    pub tokenize_timeout: f64,
    /// Largest `/tokenize` reply read, bytes.
    pub tokenize_max_reply_bytes: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        let w = KvEventsWeights::default();
        KvEventsConfig {
            prefiller_endpoints: Vec::new(),
            decoder_endpoints: Vec::new(),
            topic: String::new(),
            prefill_weight: w.prefill_weight,
            load_weight: w.load_weight,
            max_blocks_per_worker: 1 << 22,
            tokenize: TokenizeMode::Off,
            tokenize_timeout: crate::tokenize::DEFAULT_TIMEOUT.as_secs_f64(),
            tokenize_max_reply_bytes: crate::tokenize::DEFAULT_MAX_REPLY_BYTES,
        }
    }
}

impl KvEventsConfig {
    /// The deadline of one `/tokenize` call.
    pub fn tokenize_deadline(&self) -> Duration {
        Duration::try_from_secs_f64(self.tokenize_timeout).unwrap_or(Duration::ZERO)
    }

    /// The cost's weights.
    pub fn weights(&self) -> KvEventsWeights {
        KvEventsWeights {
            prefill_weight: self.prefill_weight,
            load_weight: self.load_weight,
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            host: "127.0.0.1".into(),
            port: 8000,
            prefillers: Vec::new(),
            decoders: Vec::new(),
            prefiller_bootstrap_ports: Vec::new(),
            proxy_host: "127.0.0.1".into(),
            proxy_port: 8500,
            flow: Flow::Lmcache,
            kv_ready_timeout: Duration::from_secs(60),
            prefill_timeout: Duration::from_secs(300),
            decode_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(3),
            health_interval: Duration::from_secs(2),
            health_timeout: Duration::from_secs(1),
            health_kv_ports: None,
            secret: None,
            outcome_port: Default::default(),
            http_limits: HttpLimits::default(),
            unhealthy_after: 2,
            healthy_after: 1,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(10),
            max_body_bytes: 8 << 20,
            busy_poll: Duration::from_micros(100),
            decode_after_kv_ready: true,
            first_token_on_kv_ready: true,
            routing: RoutingPolicy::default(),
            kv_events: KvEventsConfig::default(),
            cache_aware: CacheAwareParams::default(),
            disaggregation: DisaggregationConfig::default(),
        }
    }
}

impl Config {
    /// The decider's parameters: those given, the rest defaulted; `None` (always
    /// disaggregate) under `least-loaded` routing when none is given, since that policy
    /// has no view of the decoders' caches.
    pub fn decider(&self) -> Option<DeciderParams> {
        let g = &self.disaggregation;
        // An SGLang decode server cannot prefill a request alone: it waits for KV from the
        // prefill server named in the request's bootstrap fields.
        if self.flow == Flow::Sglang {
            return None;
        }
        if self.routing == RoutingPolicy::LeastLoaded
            && g.min_uncached_tokens.is_none()
            && g.decoder_cached_fraction.is_none()
            && g.compare_queues.is_none()
        {
            return None;
        }
        let d = DeciderParams::default();
        Some(DeciderParams {
            weights: if self.routing == RoutingPolicy::KvEvents {
                self.kv_events.weights()
            } else {
                d.weights
            },
            min_uncached_tokens: g.min_uncached_tokens.unwrap_or(d.min_uncached_tokens),
            decoder_cached_fraction: g
                .decoder_cached_fraction
                .unwrap_or(d.decoder_cached_fraction),
            compare_queues: g.compare_queues.unwrap_or(d.compare_queues),
        })
    }
}

impl Config {
    /// Whether decoders' health checks probe their KV init ports: as configured, else only
    /// in the lmcache flow (a vLLM NIXL decoder listens on no KV init port, so probing one
    /// would eject every decoder after `unhealthy_after` checks).
    pub fn probes_kv_ports(&self) -> bool {
        // An SGLang decode server has no KV port of its own to probe; its prefillers'
        // bootstrap ports are ([`Config::probes_bootstrap_ports`]).
        self.flow != Flow::Sglang && self.health_kv_ports.unwrap_or(self.flow == Flow::Lmcache)
    }

    /// sglang flow: whether a prefiller's health check also opens a TCP connection to its
    /// bootstrap port (where one is configured): as configured, else on. A prefill server
    /// whose bootstrap server is gone answers `/health` while every decode sent its requests
    /// fails to reach it.
    pub fn probes_bootstrap_ports(&self) -> bool {
        self.flow == Flow::Sglang && self.health_kv_ports.unwrap_or(true)
    }

    /// sglang flow: prefiller `idx`'s bootstrap port, `None` when not configured.
    pub fn bootstrap_port(&self, idx: usize) -> Option<u16> {
        self.prefiller_bootstrap_ports.get(idx).copied().flatten()
    }

    /// Checks that the configuration can run; the error names the offending setting.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.prefillers.is_empty() {
            anyhow::bail!("no prefiller configured");
        }
        for (what, eps, n) in [
            (
                "prefiller",
                &self.kv_events.prefiller_endpoints,
                self.prefillers.len(),
            ),
            (
                "decoder",
                &self.kv_events.decoder_endpoints,
                self.decoders.len(),
            ),
        ] {
            if !eps.is_empty() && eps.len() != n {
                anyhow::bail!(
                    "{} KV-events endpoints for {n} {what}s: give one per {what}, in order (--{what}-kv-events-endpoint)",
                    eps.len()
                );
            }
        }
        let (k, c) = (&self.kv_events, &self.cache_aware);
        for (name, v) in [
            ("kv_events.prefill_weight", k.prefill_weight),
            ("kv_events.load_weight", k.load_weight),
            ("cache_aware.cache_threshold", c.cache_threshold),
            ("cache_aware.balance_rel_threshold", c.balance_rel_threshold),
            (
                "disaggregation.decoder_cached_fraction",
                self.disaggregation.decoder_cached_fraction.unwrap_or(0.0),
            ),
        ] {
            if !v.is_finite() || v < 0.0 {
                anyhow::bail!("{name} must be a finite number of at least 0, not {v}");
            }
        }
        if !k.tokenize_timeout.is_finite()
            || k.tokenize_timeout <= 0.0
            || k.tokenize_timeout > 3600.0
        {
            anyhow::bail!(
                "kv_events.tokenize_timeout must be a number of seconds above 0 and at most 3600, not {}",
                k.tokenize_timeout
            );
        }
        if k.tokenize_max_reply_bytes < 1024 {
            anyhow::bail!(
                "kv_events.tokenize_max_reply_bytes must be at least 1024, not {}",
                k.tokenize_max_reply_bytes
            );
        }
        if self.decoders.is_empty() {
            anyhow::bail!("no decoder configured");
        }
        for w in self
            .prefillers
            .iter()
            .map(|p| (&p.host, p.port))
            .chain(self.decoders.iter().map(|d| (&d.host, d.port)))
        {
            if w.0.is_empty() || w.0.contains(['/', ' ', '@', '?', '#']) {
                anyhow::bail!("bad worker host {:?}", w.0);
            }
        }
        if !self.prefiller_bootstrap_ports.is_empty()
            && self.prefiller_bootstrap_ports.len() != self.prefillers.len()
        {
            anyhow::bail!(
                "{} bootstrap ports for {} prefillers: give one for all, or one per prefiller, in order (--prefiller-bootstrap-port)",
                self.prefiller_bootstrap_ports.len(),
                self.prefillers.len()
            );
        }
        if self.flow != Flow::Sglang && self.prefiller_bootstrap_ports.iter().any(Option::is_some) {
            anyhow::bail!("prefiller bootstrap ports are for --flow sglang only");
        }
        if self.flow == Flow::Lmcache {
            for dc in &self.decoders {
                if dc.init_ports.is_empty() || dc.init_ports.len() != dc.alloc_ports.len() {
                    anyhow::bail!(
                        "decoder {}:{} has {} init ports and {} alloc ports; the lmcache flow needs one of each per rank",
                        dc.host,
                        dc.port,
                        dc.init_ports.len(),
                        dc.alloc_ports.len()
                    );
                }
                if dc.init_ports.len() > crate::kvwait::MAX_RANKS as usize {
                    anyhow::bail!("at most {} ranks per decoder", crate::kvwait::MAX_RANKS);
                }
            }
        }
        if self.http_limits.max_conns == 0
            || self.http_limits.header_timeout.is_zero()
            || self.http_limits.body_timeout.is_zero()
        {
            anyhow::bail!("--max-connections, --header-timeout and --body-timeout must be above 0");
        }
        if self.unhealthy_after == 0 || self.healthy_after == 0 {
            anyhow::bail!("--unhealthy-after and --healthy-after must be at least 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::ProxyArgs;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: ProxyArgs,
    }

    fn parse(args: &[&str]) -> anyhow::Result<Config> {
        let t = T::try_parse_from(std::iter::once("proxy").chain(args.iter().copied()))?;
        Config::from_args(&t.a)
    }

    /// Writes `text` to `name` in a fresh folder of the temporary directory named after `tag`
    /// and this process; the folder (to remove after the test) and the file.
    fn config_file(tag: &str, name: &str, text: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        (dir, p)
    }
    #[test]
    fn defaults_match_lmcache_example_deployment() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.port, 8000);
        assert_eq!(c.proxy_port, 8500);
        assert_eq!(
            c.prefillers,
            vec![WorkerAddr {
                host: "localhost".into(),
                port: 8100
            }]
        );
        assert_eq!(c.decoders[0].port, 8200);
        assert_eq!(c.decoders[0].init_ports, vec![8300]);
        assert_eq!(c.decoders[0].alloc_ports, vec![8400]);
        assert_eq!(c.flow, Flow::Lmcache);
        assert_eq!(c.kv_ready_timeout, Duration::from_secs(60));
    }

    #[test]
    fn comma_and_space_lists_and_num_workers() {
        let c = parse(&[
            "--prefiller-host",
            "a,b",
            "--prefiller-port",
            "1",
            "--decoder-host",
            "d",
            "--decoder-port",
            "5",
            "6",
            "--decoder-init-port",
            "7300,7301",
            "--decoder-alloc-port",
            "7400",
            "7401",
            "--kv-ready-timeout",
            "0.5",
            "--flow",
            "vllm",
        ])
        .unwrap();
        assert_eq!(c.prefillers.len(), 2);
        assert_eq!(
            c.prefillers[1],
            WorkerAddr {
                host: "b".into(),
                port: 1
            }
        );
        assert_eq!(c.decoders.len(), 2);
        assert_eq!(c.decoders[1].port, 6);
        assert_eq!(c.decoders[1].ranks(), 2);
        assert_eq!(c.kv_ready_timeout, Duration::from_millis(500));
        assert_eq!(c.flow, Flow::Vllm);
        let c = parse(&["--prefiller-port", "8100", "--num-prefillers", "3"]).unwrap();
        assert_eq!(
            c.prefillers.iter().map(|p| p.port).collect::<Vec<_>>(),
            vec![8100, 8101, 8102]
        );
    }

    #[test]
    fn kv_port_probes_fit_the_flow_unless_set() {
        assert!(parse(&[]).unwrap().probes_kv_ports(), "lmcache: on");
        assert!(
            !parse(&["--flow", "vllm"]).unwrap().probes_kv_ports(),
            "vllm: off"
        );
        let on = parse(&["--flow", "vllm", "--health-kv-ports", "true"]).unwrap();
        assert!(on.probes_kv_ports(), "asked for");
        let off = parse(&["--health-kv-ports", "false"]).unwrap();
        assert!(!off.probes_kv_ports());
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let e = parse(&["--prefiller-host", "a,b,c", "--prefiller-port", "1,2"]).unwrap_err();
        assert!(
            e.to_string().contains("--prefiller-host has 3 entries"),
            "{e}"
        );
        let e = parse(&["--decoder-init-port", "1,2", "--decoder-alloc-port", "3"]).unwrap_err();
        assert!(
            e.to_string().contains("2 init ports and 1 alloc ports"),
            "{e}"
        );
        let e = parse(&["--kv-ready-timeout=-1"]).unwrap_err();
        assert!(e.to_string().contains("kv-ready-timeout"), "{e}");
        assert!(parse(&["--flow", "bogus"]).is_err());
        assert!(parse(&["--config", "/nonexistent/kvbridge.toml"]).is_err());
    }

    #[test]
    fn toml_file_with_per_decoder_ranks_and_flag_override() {
        let (dir, p) = config_file(
            "kvbridge-proxy-cfg",
            "proxy.toml",
            r#"
port = 9000
flow = "lmcache"
kv_ready_timeout = 5
health_kv_ports = false
first_token_on_kv_ready = false
[[prefiller]]
host = "p1"
port = 8100
[[decoder]]
host = "d1"
port = 8200
init_ports = [7300, 7301]
alloc_ports = [7400, 7401]
kv_capacity_tokens = 100000
"#,
        );
        let ps = p.to_str().unwrap();
        let c = parse(&["--config", ps, "--port", "9001"]).unwrap();
        assert_eq!(c.port, 9001);
        assert_eq!(c.kv_ready_timeout, Duration::from_secs(5));
        assert_eq!(c.prefillers[0].host, "p1");
        assert_eq!(c.decoders[0].ranks(), 2);
        assert_eq!(c.decoders[0].kv_capacity_tokens, 100000);
        assert!(!c.probes_kv_ports());
        let c = parse(&["--config", ps, "--health-kv-ports", "true"]).unwrap();
        assert!(c.probes_kv_ports(), "the flag wins over the file");
        assert!(!c.first_token_on_kv_ready, "the file's setting");
        let c = parse(&["--config", ps, "--first-token-on-kv-ready", "true"]).unwrap();
        assert!(c.first_token_on_kv_ready, "the flag wins over the file");
        assert!(parse(&[]).unwrap().first_token_on_kv_ready, "on by default");
        std::fs::write(&p, "bogus_key = 1\n").unwrap();
        let e = parse(&["--config", ps]).unwrap_err();
        assert!(e.to_string().contains("bogus_key"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn sglang_workers_as_sglang_router_or_these_flags_or_the_file_give_them() {
        // SGLang router's own form.
        let c = parse(&[
            "--flow",
            "sglang",
            "--prefill",
            "http://10.0.0.1:30000",
            "8998",
            "--prefill",
            "http://10.0.0.2:30000",
            "--decode",
            "http://10.0.0.3:30001",
            "--decode",
            "http://10.0.0.4:30001",
        ])
        .unwrap();
        assert_eq!(c.flow, Flow::Sglang);
        assert_eq!(c.prefillers[1].host, "10.0.0.2");
        assert_eq!(c.prefillers[1].port, 30000);
        assert_eq!(
            (c.bootstrap_port(0), c.bootstrap_port(1)),
            (Some(8998), None)
        );
        assert_eq!(c.decoders.len(), 2);
        assert_eq!(c.decoders[1].host, "10.0.0.4");
        assert!(
            c.decider().is_none(),
            "an SGLang decode server cannot prefill alone"
        );
        assert!(
            !c.probes_kv_ports(),
            "an SGLang decoder has no KV init port"
        );
        assert!(c.probes_bootstrap_ports());
        // These flags: one bootstrap port for all, or one per prefiller.
        let c = parse(&[
            "--flow",
            "sglang",
            "--prefiller-port",
            "1,2",
            "--prefiller-bootstrap-port",
            "8998",
        ])
        .unwrap();
        assert_eq!(c.prefiller_bootstrap_ports, [Some(8998), Some(8998)]);
        let c = parse(&[
            "--flow",
            "sglang",
            "--prefiller-port",
            "1,2",
            "--prefiller-bootstrap-port",
            "none,9000",
            "--health-kv-ports",
            "false",
        ])
        .unwrap();
        assert_eq!(c.prefiller_bootstrap_ports, [None, Some(9000)]);
        assert!(!c.probes_bootstrap_ports(), "turned off");
        for (args, want) in [
            (
                &[
                    "--flow",
                    "sglang",
                    "--prefiller-port",
                    "1,2,3",
                    "--prefiller-bootstrap-port",
                    "1,2",
                ][..],
                "2 bootstrap ports for 3 prefillers",
            ),
            (
                &["--prefiller-bootstrap-port", "8998"][..],
                "--flow sglang only",
            ),
            (
                &[
                    "--flow",
                    "sglang",
                    "--prefill",
                    "http://a:1",
                    "--prefiller-port",
                    "2",
                ][..],
                "not both",
            ),
            (
                &[
                    "--flow",
                    "sglang",
                    "--decode",
                    "http://a:1",
                    "--decoder-host",
                    "b",
                ][..],
                "not both",
            ),
            (&["--flow", "sglang", "--prefill", "a:1"][..], "takes a URL"),
            (
                &["--flow", "sglang", "--decode", "https://a:1"][..],
                "http://host:port",
            ),
            (
                &["--flow", "sglang", "--prefill", "http://a:1", "70000"][..],
                "not a port number",
            ),
        ] {
            let e = parse(args).unwrap_err();
            assert!(e.to_string().contains(want), "{args:?}: {e}");
        }
        // The file: a bootstrap port per `[[prefiller]]`.
        let (dir, p) = config_file("kvbridge-proxy-sglang", "s.toml", "flow = \"sglang\"\n[[prefiller]]\nhost = \"p1\"\nport = 30000\nbootstrap_port = 8998\n[[prefiller]]\nhost = \"p2\"\nport = 30000\n[[decoder]]\nhost = \"d1\"\nport = 30001\n");
        let c = parse(&["--config", p.to_str().unwrap()]).unwrap();
        assert_eq!(c.flow, Flow::Sglang);
        assert_eq!(c.prefiller_bootstrap_ports, [Some(8998), None]);
        assert_eq!(c.decoders[0].host, "d1");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_deciders_rule_3_takes_the_kv_events_weights_only_under_kv_events() {
        let kv = parse(&[
            "--routing",
            "kv-events",
            "--kv-events-prefill-weight",
            "3",
            "--kv-events-load-weight",
            "0.5",
        ])
        .unwrap();
        let w = kv.decider().expect("a decider").weights;
        assert_eq!((w.prefill_weight, w.load_weight), (3.0, 0.5));
        let ca = parse(&[
            "--routing",
            "cache-aware",
            "--kv-events-prefill-weight",
            "3",
        ])
        .unwrap();
        assert_eq!(
            ca.decider().expect("a decider").weights,
            crate::routing::policy::KvEventsWeights::EQUAL,
            "no cost formula: tokens of work alone"
        );
    }

    #[test]
    fn routing_from_flags_and_toml() {
        assert_eq!(parse(&[]).unwrap().routing, RoutingPolicy::LeastLoaded);
        let c = parse(&[
            "--routing",
            "kv-events",
            "--prefiller-port",
            "1,2",
            "--prefiller-kv-events-endpoint",
            "tcp://a:5557,tcp://b:5557",
            "--kv-events-prefill-weight",
            "3",
            "--balance-abs-threshold",
            "8",
        ])
        .unwrap();
        assert_eq!(c.routing, RoutingPolicy::KvEvents);
        assert_eq!(
            c.kv_events.prefiller_endpoints,
            ["tcp://a:5557", "tcp://b:5557"]
        );
        assert_eq!(c.kv_events.weights().prefill_weight, 3.0);
        assert_eq!(c.kv_events.load_weight, 1.0);
        assert_eq!(c.cache_aware.balance_abs_threshold, 8);
        assert_eq!(c.cache_aware.cache_threshold, 0.3);
        let e = parse(&[
            "--prefiller-port",
            "1,2",
            "--prefiller-kv-events-endpoint",
            "x:1",
        ])
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("1 KV-events endpoints for 2 prefillers"),
            "{e}"
        );
        let e = parse(&["--cache-threshold", "NaN"]).unwrap_err();
        assert!(e.to_string().contains("cache_aware.cache_threshold"), "{e}");

        let (dir, p) = config_file("kvbridge-proxy-routing", "r.toml", "routing = \"cache-aware\"\n[cache_aware]\ncache_threshold = 0.5\n[kv_events]\ndecoder_endpoints = [\"tcp://d:1\"]\nload_weight = 0.5\n");
        let c = parse(&["--config", p.to_str().unwrap()]).unwrap();
        assert_eq!(c.routing, RoutingPolicy::CacheAware);
        assert_eq!(c.cache_aware.cache_threshold, 0.5);
        assert_eq!(c.cache_aware.balance_rel_threshold, 1.5);
        assert_eq!(c.kv_events.decoder_endpoints, ["tcp://d:1"]);
        assert_eq!(c.kv_events.load_weight, 0.5);
        let c = parse(&["--config", p.to_str().unwrap(), "--routing", "least-loaded"]).unwrap();
        assert_eq!(c.routing, RoutingPolicy::LeastLoaded, "the flag wins");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tokenize_from_flags_and_toml() {
        let c = parse(&[]).unwrap();
        assert_eq!(c.kv_events.tokenize, TokenizeMode::Off, "off by default");
        assert_eq!(
            c.kv_events.tokenize_deadline(),
            crate::tokenize::DEFAULT_TIMEOUT
        );
        let c = parse(&[
            "--kv-events-tokenize",
            "http",
            "--kv-events-tokenize-timeout",
            "0.05",
            "--kv-events-tokenize-max-reply-bytes",
            "4096",
        ])
        .unwrap();
        assert_eq!(c.kv_events.tokenize, TokenizeMode::Http);
        assert_eq!(c.kv_events.tokenize_deadline(), Duration::from_millis(50));
        assert_eq!(c.kv_events.tokenize_max_reply_bytes, 4096);
        for (flag, v, want) in [
            ("--kv-events-tokenize-timeout", "0", "tokenize_timeout"),
            ("--kv-events-tokenize-timeout", "NaN", "tokenize_timeout"),
            (
                "--kv-events-tokenize-max-reply-bytes",
                "10",
                "max_reply_bytes",
            ),
        ] {
            let e = parse(&[flag, v]).unwrap_err();
            assert!(e.to_string().contains(want), "{flag} {v}: {e}");
        }
        assert!(parse(&["--kv-events-tokenize", "yes"]).is_err());

        let (dir, p) = config_file(
            "kvbridge-proxy-tokenize",
            "t.toml",
            "[kv_events]\ntokenize = \"http\"\ntokenize_timeout = 1.5\n",
        );
        let ps = p.to_str().unwrap();
        let c = parse(&["--config", ps]).unwrap();
        assert_eq!(c.kv_events.tokenize, TokenizeMode::Http);
        assert_eq!(c.kv_events.tokenize_deadline(), Duration::from_millis(1500));
        let c = parse(&["--config", ps, "--kv-events-tokenize", "off"]).unwrap();
        assert_eq!(c.kv_events.tokenize, TokenizeMode::Off, "the flag wins");
        std::fs::write(&p, "[kv_events]\ntokenize = \"sometimes\"\n").unwrap();
        assert!(parse(&["--config", ps]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
