//! What an engine is told to be: its role and its settings.

use crate::cost::CostModel;
use crate::model::Model;
use crate::prefix_cache::DEFAULT_PREFIX_CACHE_TOKENS;
use kvbridge_pd::{PdConfig, TransferMode};
use serde::Serialize;
use std::time::Duration;

/// Which part of disaggregated serving this engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefills and sends KV through the PD layer.
    Prefill,
    /// Receives KV through the PD layer and decodes.
    Decode,
    /// Colocated: prefills and decodes itself, no transfer (the reference output).
    Both,
}

/// Everything an engine needs to start.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Role.
    pub role: Role,
    /// The model (name, KV spec per rank, world size).
    pub model: Model,
    /// Simulated speed.
    pub cost: CostModel,
    /// Host the PD receivers and announce listeners bind to (decode).
    pub bind_host: String,
    /// PD receiver (channel) port per rank (decode); missing or 0 picks a free port.
    pub init_ports: Vec<u16>,
    /// Announce port per rank (decode; the proxy's `--decoder-alloc-port`); missing or 0
    /// picks a free port.
    pub alloc_ports: Vec<u16>,
    /// Receive buffer per rank, bytes (decode).
    pub buffer_bytes: u64,
    /// The proxy's ZMQ PULL endpoint, `tcp://host:port` (prefill); `None`: outcomes dropped.
    pub proxy_endpoint: Option<String>,
    /// Deadline to retrieve a request's KV once announced (decode).
    pub retrieve_timeout: Duration,
    /// Deadline of one announcement (prefill).
    pub announce_timeout: Duration,
    /// Largest `max_tokens` accepted.
    pub max_tokens_limit: u32,
    /// TTL of a received request's pages (decode): KV that no decode request claims returns
    /// to the buffer after this long.
    pub kv_ttl: Duration,
    /// MLA only: prefiller rank 0 sends the (identical) KV once, to decoder rank 0; the
    /// decoder reads rank 0's copy for every rank (`mla_send_once`). Both roles must agree.
    pub mla_send_once: bool,
    /// Decode: how long a sender may take to acknowledge a fence before it is disconnected
    /// (`fence_timeout_sec`).
    pub fence_timeout: Duration,
    /// Prefill: push (write into the decoder's pages) or pull (the decoder reads)
    /// (`pd_transfer_mode`).
    pub transfer_mode: TransferMode,
    /// Tokens the prefix cache keeps (whole chunks; 0: no cache). See
    /// [`crate::prefix_cache`].
    pub prefix_cache_tokens: u64,
    /// Where to publish KV events (vLLM's `--kv-events-config` `endpoint`:
    /// `tcp://*:5557`, `tcp://127.0.0.1:0`); `None`: not published.
    pub kv_events_endpoint: Option<String>,
    /// The KV events' topic (vLLM's `topic`, empty by default).
    pub kv_events_topic: String,
}

impl EngineConfig {
    /// Defaults for `role` and `model`: free ports, 1 GiB buffer per rank, default cost.
    pub fn new(role: Role, model: Model) -> Self {
        Self {
            role,
            model,
            cost: CostModel::default(),
            bind_host: "127.0.0.1".into(),
            init_ports: Vec::new(),
            alloc_ports: Vec::new(),
            buffer_bytes: 1 << 30,
            proxy_endpoint: None,
            retrieve_timeout: Duration::from_secs(10),
            announce_timeout: Duration::from_secs(5),
            max_tokens_limit: 4096,
            kv_ttl: Duration::from_secs(60),
            mla_send_once: false,
            fence_timeout: Duration::from_secs(10),
            transfer_mode: TransferMode::Push,
            prefix_cache_tokens: DEFAULT_PREFIX_CACHE_TOKENS,
            kv_events_endpoint: None,
            kv_events_topic: String::new(),
        }
        .with_pd_env()
    }

    /// Takes the PD settings the engine passes to the PD layer (`mla_send_once`,
    /// `fence_timeout_sec`, `pd_transfer_mode`) from `pd`.
    pub fn apply_pd(&mut self, pd: &PdConfig) {
        self.mla_send_once = pd.mla_send_once;
        self.fence_timeout = pd.fence_timeout();
        self.transfer_mode = pd.pd_transfer_mode;
    }

    /// The PD settings of the environment (`KVBRIDGE_PD_*`, `LMCACHE_*`), when set; a bad
    /// value is logged and ignored here (`kvbridge engine` loads and checks them strictly).
    fn with_pd_env(mut self) -> Self {
        let env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with("KVBRIDGE_PD_") || k.starts_with("LMCACHE_"))
            .collect();
        if env.is_empty() {
            return self;
        }
        match PdConfig::from_sources(None, env, &[]) {
            Ok(pd) => self.apply_pd(&pd),
            Err(e) => tracing::warn!("ignoring the PD environment: {e}"),
        }
        self
    }

    /// Decoder ranks that hold KV: all of them, or only rank 0 with MLA send-once.
    pub(super) fn receiving_ranks(&self) -> usize {
        if self.mla_send_once && self.model.spec.layout.is_mla() {
            1
        } else {
            self.model.world_size as usize
        }
    }
}
