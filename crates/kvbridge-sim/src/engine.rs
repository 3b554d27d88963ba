//! The reference engine: an OpenAI-compatible server around [`crate::model::Model`] that
//! moves real KV through the PD layer.
//!
//! - `prefill`: a request with `kv_transfer_params.disagg_spec` is prefilled chunk by chunk;
//!   each chunk goes to every rank's [`PdSender`] as soon as it exists (transfer overlaps
//!   prefill), and the senders report `KvReady`/`KvFailed` to the proxy over ZMQ.
//! - `decode`: runs one [`PdReceiver`] per rank. As soon as a request's pages are granted, a
//!   consumer digests each chunk in place as it lands (overlapping the transfer), so after
//!   the outcome only the last chunk's work remains. A decode request's KV is found by its
//!   prompt tokens (see [`crate::announce`]); generation continues from the KV *as
//!   received*, and every chunk is verified in place against the KV the model says it must
//!   be (mismatches are counted) before the pages are released.
//! - `both`: colocated, no transfer: the reference output.

use crate::announce::{self, Announced, Announcement};
use crate::chunk_memory::{ChunkMemory, ChunkSlot};
use crate::cost::CostModel;
use crate::kv_events_pub::{KvEventsPublisher, PubLimits};
use crate::model::{self, Model, SeqState};
use crate::prefix_cache::{NewChunk, PrefixCache, DEFAULT_PREFIX_CACHE_TOKENS};
use crate::timeline::TARGET as TL;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kvbridge::ChannelConfig;
use kvbridge_pd::{
    ChunkRef, Counters, DisaggSpec, Outcome, OutcomeSink, PdConfig, PdError, PdReceiver, PdSender,
    ReceiverConfig, SenderConfig, TransferMode, ZmqPusher,
};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Hands chunk `index`'s bytes to one rank's sender task.
type ChunkTx = mpsc::Sender<ChunkMsg>;

/// A chunk's index and bytes.
type ChunkMsg = (u64, ChunkSlot);

/// Longest wait for a free chunk slot: slots come back as transfers return, each bounded by
/// the PD sender's step deadline.
const CHUNK_MEMORY_WAIT: Duration = Duration::from_secs(60);

/// The `kv_transfer_params` key under which the proxy names the PD request holding a decode
/// request's KV (LMCache's own proxy uses the same key).
pub const HANDOFF_KEY: &str = "lmcache.pd_handoff_id";

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
    fn receiving_ranks(&self) -> usize {
        if self.mla_send_once && self.model.spec.layout.is_mla() {
            1
        } else {
            self.model.world_size as usize
        }
    }
}

/// Counters of one engine (also served as JSON at `/health` and as Prometheus text at
/// `/metrics`).
#[derive(Debug, Default)]
struct Counts {
    requests: AtomicU64,
    errors: AtomicU64,
    prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    kv_transfers_ok: AtomicU64,
    kv_transfers_failed: AtomicU64,
    kv_bytes_sent: AtomicU64,
    kv_requests_received: AtomicU64,
    kv_chunks_received: AtomicU64,
    kv_bytes_received: AtomicU64,
    kv_mismatches: AtomicU64,
    kv_retrieve_failed: AtomicU64,
    local_prefills: AtomicU64,
    prefill_tokens_computed: AtomicU64,
    prefix_cache_hit_tokens: AtomicU64,
    /// Rank transfers not yet finished, plus received KV not yet verified.
    in_flight: AtomicU64,
    kv_load_ns: AtomicU64,
    kv_finishes: AtomicU64,
    kv_finish_ns: AtomicU64,
}

/// Wall time during which at least one KV write or finish call was in progress (the union
/// of busy intervals, so concurrent transfers over one link are not counted twice).
#[derive(Debug, Default)]
struct BusyClock {
    state: std::sync::Mutex<(u32, Option<Instant>, Duration)>,
}

impl BusyClock {
    fn enter(&self) {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if g.0 == 0 {
            g.1 = Some(Instant::now());
        }
        g.0 += 1;
    }
    fn leave(&self) {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = g.0.saturating_sub(1);
        if g.0 == 0 {
            if let Some(t) = g.1.take() {
                g.2 += t.elapsed();
            }
        }
    }
    fn total(&self) -> Duration {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).2
    }
}

/// A snapshot of an engine's counters.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct EngineStats {
    /// The engine's role.
    pub role: Option<Role>,
    /// Generation requests answered or failed.
    pub requests: u64,
    /// Requests answered with an error.
    pub errors: u64,
    /// Prompt tokens seen.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Prefill: rank transfers that ended in `KvReady`.
    pub kv_transfers_ok: u64,
    /// Prefill: rank transfers that ended in `KvFailed`.
    pub kv_transfers_failed: u64,
    /// Prefill: KV bytes written to decoders.
    pub kv_bytes_sent: u64,
    /// Prefill: wall time during which at least one PD write or finish call was in progress
    /// (KV bytes over this is the transfer throughput).
    pub kv_send_busy_s: f64,
    /// Prefill: wall time during which at least one PD write call was in progress (the part
    /// of `kv_send_busy_s` that moved chunks; the rest waited for finishes).
    pub kv_write_busy_s: f64,
    /// Prefill: finish calls made (each waits for the receiver's confirmation).
    pub kv_finishes: u64,
    /// Prefill: time inside those finish calls, summed, seconds.
    pub kv_finish_s: f64,
    /// Decode: requests whose KV came through the PD layer.
    pub kv_requests_received: u64,
    /// Decode: KV chunks received and verified.
    pub kv_chunks_received: u64,
    /// Decode: KV bytes received.
    pub kv_bytes_received: u64,
    /// Decode: received chunks that differ from the KV the model says they must hold.
    pub kv_mismatches: u64,
    /// Decode: announced KV that could not be retrieved.
    pub kv_retrieve_failed: u64,
    /// Decode: requests prefilled locally because no KV was announced for them.
    pub local_prefills: u64,
    /// Prompt tokens prefilled here that the prefix cache did not hold (what the cost
    /// model charged).
    pub prefill_tokens_computed: u64,
    /// Prompt tokens of prefills here that the prefix cache held (not charged).
    pub prefix_cache_hit_tokens: u64,
    /// Chunks in the prefix cache now.
    pub prefix_cache_chunks: u64,
    /// Decode: pages of the receive buffers (all ranks).
    pub pages_total: u64,
    /// Decode: free pages.
    pub pages_free: u64,
    /// Decode: leaked pages (must be 0).
    pub pages_leaked: u64,
    /// Decode: announcements not yet claimed.
    pub announced_pending: u64,
    /// Rank transfers not finished plus received KV not yet verified.
    pub in_flight: u64,
    /// Decode: time from claiming a request's KV to its state being ready (copy out of the
    /// receive buffer and digest), summed over requests, seconds.
    pub kv_load_s: f64,
}

struct Inner {
    cfg: EngineConfig,
    model: Arc<Model>,
    senders: Vec<Arc<PdSender>>,
    receivers: Vec<PdReceiver>,
    outcomes: OutcomeSink,
    announced: Announced,
    /// The simulated accelerator: one prefill at a time.
    accel: tokio::sync::Mutex<()>,
    /// How long the mock accelerator took per token of the last chunk it computed, ps (0
    /// until known): the lead with which a prefill step's KV computation starts
    /// ([`jit_wait`]).
    fill_ps_per_token: AtomicU64,
    counts: Counts,
    busy: BusyClock,
    /// The same for write calls only.
    write_busy: BusyClock,
    /// Woken whenever `counts.in_flight` drops.
    settled: tokio::sync::Notify,
    seq: AtomicU64,
    /// Decode: per granted request, the task digesting its KV as it lands.
    /// Prefill: each sender rank's chunk memory (see [`crate::chunk_memory`]).
    chunk_memory: Vec<Arc<ChunkMemory>>,
    consumers: std::sync::Mutex<HashMap<String, JoinHandle<Result<Consumed, SimError>>>>,
    /// Decode: PD requests taken by a decode request, until their pages are released (so
    /// two decode requests naming one id cannot both read, and release, its pages).
    claimed: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Prompt chunks computed or received, and the events they make (one owner: this lock;
    /// events are published under it, so batches leave in the order of the changes).
    prefix_cache: std::sync::Mutex<PrefixCache>,
    /// Where the prefix cache's events go.
    kv_events: Option<KvEventsPublisher>,
}

impl Inner {
    fn work_started(&self) {
        self.counts.in_flight.fetch_add(1, Relaxed);
    }
    fn work_done(&self) {
        self.counts.in_flight.fetch_sub(1, Relaxed);
        self.settled.notify_waiters();
    }
}

impl Inner {
    /// The chain keys of the whole chunks of `tokens` (rank 0's PD chunk keys).
    fn cache_keys(&self, tokens: &[u32]) -> Vec<u64> {
        let c = self.model.spec.chunk_tokens.max(1) as usize;
        let whole = tokens.len() / c * c;
        kvbridge_pd::chunk_keys(
            &self.model.name,
            self.model.world_size,
            0,
            &self.model.spec,
            &tokens[..whole],
        )
        .into_iter()
        .map(|k| k.hash)
        .collect()
    }

    /// Changes the prefix cache with `f` and publishes what changed, as one batch.
    fn update_cache(&self, f: impl FnOnce(&mut PrefixCache)) {
        let mut cache = lock(&self.prefix_cache);
        f(&mut cache);
        let events = cache.take_events();
        if let (Some(p), false) = (&self.kv_events, events.is_empty()) {
            let ts = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            p.publish(&kvbridge::proto::kv_events::KvEventBatch {
                ts,
                events,
                data_parallel_rank: None,
            });
        }
    }

    /// Stores the whole chunks of `tokens` after the first `from` (whose keys are `keys`),
    /// with `states[i]` the state after chunk `from + i`.
    fn cache_chunks(&self, tokens: &[u32], keys: &[u64], from: usize, states: &[SeqState]) {
        let c = self.model.spec.chunk_tokens.max(1) as usize;
        let chunks: Vec<NewChunk<'_>> = states
            .iter()
            .enumerate()
            .filter_map(|(i, st)| {
                let k = from + i;
                Some(NewChunk {
                    key: *keys.get(k)?,
                    tokens: tokens.get(k * c..(k + 1) * c)?,
                    state: *st,
                })
            })
            .collect();
        let parent = from.checked_sub(1).and_then(|i| keys.get(i).copied());
        self.update_cache(|cache| cache.insert(parent, &chunks));
    }
}

impl Inner {
    fn stats(&self) -> EngineStats {
        let c = &self.counts;
        let mut pages = Counters::default();
        for r in &self.receivers {
            let x = r.counters();
            pages.total += x.total;
            pages.free += x.free;
            pages.leaked += x.leaked;
        }
        EngineStats {
            role: Some(self.cfg.role),
            requests: c.requests.load(Relaxed),
            errors: c.errors.load(Relaxed),
            prompt_tokens: c.prompt_tokens.load(Relaxed),
            generated_tokens: c.generated_tokens.load(Relaxed),
            kv_transfers_ok: c.kv_transfers_ok.load(Relaxed),
            kv_transfers_failed: c.kv_transfers_failed.load(Relaxed),
            kv_bytes_sent: c.kv_bytes_sent.load(Relaxed),
            kv_send_busy_s: self.busy.total().as_secs_f64(),
            kv_write_busy_s: self.write_busy.total().as_secs_f64(),
            kv_finishes: c.kv_finishes.load(Relaxed),
            kv_finish_s: c.kv_finish_ns.load(Relaxed) as f64 / 1e9,
            kv_requests_received: c.kv_requests_received.load(Relaxed),
            kv_chunks_received: c.kv_chunks_received.load(Relaxed),
            kv_bytes_received: c.kv_bytes_received.load(Relaxed),
            kv_mismatches: c.kv_mismatches.load(Relaxed),
            kv_retrieve_failed: c.kv_retrieve_failed.load(Relaxed),
            local_prefills: c.local_prefills.load(Relaxed),
            prefill_tokens_computed: c.prefill_tokens_computed.load(Relaxed),
            prefix_cache_hit_tokens: c.prefix_cache_hit_tokens.load(Relaxed),
            prefix_cache_chunks: lock(&self.prefix_cache).len() as u64,
            pages_total: pages.total,
            pages_free: pages.free,
            pages_leaked: pages.leaked,
            announced_pending: self.announced.len() as u64,
            in_flight: c.in_flight.load(Relaxed),
            kv_load_s: c.kv_load_ns.load(Relaxed) as f64 / 1e9,
        }
    }
}

/// Errors of the engine; each becomes an OpenAI-shaped error answer.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The request is malformed (400).
    #[error("{0}")]
    BadRequest(String),
    /// The decoder could not be told about the transfer (500 `kv_announce_failed`; 503
    /// `kv_receiver_unreachable` when it could not be reached at all, which tells a proxy
    /// that no KV moved and the request may go to another decoder).
    #[error(transparent)]
    Announce(#[from] announce::AnnounceError),
    /// The PD layer failed (500).
    #[error(transparent)]
    Kv(#[from] PdError),
    /// Decode: the KV transfer this decode request was handed ended before it completed
    /// (500 `kv_transfer_failed`).
    #[error("{0}")]
    KvEnded(String),
    /// Starting the engine failed.
    #[error("engine start: {0}")]
    Start(String),
    /// A worker task ended abnormally (500).
    #[error("internal: {0}")]
    Internal(String),
}

impl SimError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            SimError::BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
            SimError::Announce(announce::AnnounceError::Unreachable { .. }) => {
                (StatusCode::SERVICE_UNAVAILABLE, "kv_receiver_unreachable")
            }
            SimError::Announce(_) => (StatusCode::INTERNAL_SERVER_ERROR, "kv_announce_failed"),
            SimError::Kv(_) | SimError::KvEnded(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "kv_transfer_failed")
            }
            SimError::Start(_) | SimError::Internal(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "internal")
            }
        }
    }
}

impl IntoResponse for SimError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        let body = json!({"error": {"message": self.to_string(), "type": kind, "code": code}});
        (status, axum::Json(body)).into_response()
    }
}

/// A running engine. Dropping it stops the server and the PD layer's tasks.
pub struct RunningEngine {
    inner: Arc<Inner>,
    http_addr: SocketAddr,
    init_ports: Vec<u16>,
    alloc_ports: Vec<u16>,
    stop: Option<oneshot::Sender<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RunningEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningEngine")
            .field("role", &self.inner.cfg.role)
            .field("http_addr", &self.http_addr)
            .finish()
    }
}

impl Drop for RunningEngine {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl RunningEngine {
    /// The HTTP address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }
    /// The PD receiver port of each rank (decode; empty otherwise).
    pub fn init_ports(&self) -> &[u16] {
        &self.init_ports
    }
    /// The announce port of each rank (decode; the proxy's `--decoder-alloc-port`).
    pub fn alloc_ports(&self) -> &[u16] {
        &self.alloc_ports
    }
    /// The counters now.
    pub fn stats(&self) -> EngineStats {
        self.inner.stats()
    }
    /// Where KV events are published, when they are.
    pub fn kv_events_addr(&self) -> Option<SocketAddr> {
        self.inner.kv_events.as_ref().map(|p| p.local_addr())
    }
    /// Waits until `n` connections subscribed to the KV events, up to `timeout`; false when
    /// they did not (or nothing is published).
    pub async fn wait_kv_subscribers(&self, n: usize, timeout: Duration) -> bool {
        match &self.inner.kv_events {
            Some(p) => p.wait_subscribed(n, timeout).await,
            None => false,
        }
    }
    /// Empties the prefix cache (vLLM's `POST /reset_prefix_cache`): publishes
    /// `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self) {
        self.inner.update_cache(PrefixCache::clear);
    }
    /// Waits until no KV transfer is in flight and all received KV is verified, up to
    /// `deadline` (read the counters after this).
    pub async fn quiesce(&self, deadline: Duration) -> Result<(), SimError> {
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let woken = self.inner.settled.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let n = self.inner.counts.in_flight.load(Relaxed);
            if n == 0 {
                return Ok(());
            }
            if tokio::time::timeout_at(until, woken).await.is_err() {
                return Err(SimError::Internal(format!(
                    "{n} KV transfers or verifications still in flight after {deadline:?}"
                )));
            }
        }
    }

    /// Prefill: connects every rank's PD channel to the decoder rank of the same index at
    /// `host` (`init_ports[rank]`; the kvbridge handshake) now, instead of lazily on the
    /// first request, each within `deadline`, and returns how long each handshake took.
    /// Connecting is idempotent: a rank already connected answers at once.
    pub async fn connect_decoder(
        &self,
        host: &str,
        init_ports: &[u16],
        deadline: Duration,
    ) -> Result<Vec<Duration>, SimError> {
        let mut took = Vec::with_capacity(self.inner.senders.len());
        for sender in &self.inner.senders {
            if sender.follows() {
                continue; // MLA send-once: only rank 0 talks to the decoder
            }
            let rank = sender.rank();
            let port = init_ports.get(rank as usize).ok_or_else(|| {
                SimError::Start(format!("the decoder has no init port for rank {rank}"))
            })?;
            let addr = format!("{host}:{port}");
            let t = Instant::now();
            match tokio::time::timeout(deadline, sender.channel().connect(&addr)).await {
                Ok(Ok(_)) => took.push(t.elapsed()),
                Ok(Err(e)) => {
                    return Err(SimError::Start(format!(
                        "connecting rank {rank} to {addr}: {e}"
                    )))
                }
                Err(_) => {
                    return Err(SimError::Start(format!(
                        "connecting rank {rank} to {addr}: no handshake within {deadline:?}"
                    )))
                }
            }
        }
        Ok(took)
    }

    /// Stops serving and closes the PD layer's channels.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        for s in &self.inner.senders {
            s.close().await;
        }
        for r in &self.inner.receivers {
            r.close().await;
        }
    }
}

/// Starts an engine serving on `listener` (bind `127.0.0.1:0` and pass it in; the PD
/// receivers and announce listeners bind their own ports from the config). Everything is
/// bound when this returns.
pub async fn start(cfg: EngineConfig, listener: TcpListener) -> Result<RunningEngine, SimError> {
    start_with_publisher(cfg, listener, None).await
}

/// [`start`], publishing KV events on `publisher` (bound by the caller, so that its address
/// can be given to a proxy before the engine starts) instead of binding
/// [`EngineConfig::kv_events_endpoint`].
pub async fn start_with_publisher(
    cfg: EngineConfig,
    listener: TcpListener,
    publisher: Option<KvEventsPublisher>,
) -> Result<RunningEngine, SimError> {
    cfg.model
        .spec
        .validate()
        .map_err(|e| SimError::Start(format!("KV spec: {e}")))?;
    if cfg.model.world_size == 0 {
        return Err(SimError::Start("world size must be at least 1".into()));
    }
    let http_addr = listener
        .local_addr()
        .map_err(|e| SimError::Start(e.to_string()))?;
    let ws = cfg.model.world_size;
    let outcomes = match &cfg.proxy_endpoint {
        Some(ep) => OutcomeSink::Zmq(ZmqPusher::spawn(ep.clone(), Duration::from_secs(5))),
        None => OutcomeSink::None,
    };
    let mut tasks = Vec::new();
    let (mut senders, mut receivers, mut chunk_memory) = (Vec::new(), Vec::new(), Vec::new());
    let (mut init_ports, mut alloc_ports) = (Vec::new(), Vec::new());
    let announced = Announced::default();
    let id = format!("{:?}-{}", cfg.role, http_addr.port()).to_lowercase();
    match cfg.role {
        Role::Prefill => {
            for rank in 0..ws {
                let mut sc = SenderConfig::new(
                    ChannelConfig::new(format!("sim-{id}-r{rank}"), None),
                    rank,
                    ws,
                    &cfg.model.name,
                    cfg.model.spec,
                );
                sc.outcomes = outcomes.clone();
                sc.mla_send_once = cfg.mla_send_once;
                sc.mode = cfg.transfer_mode;
                let sender = PdSender::start(sc).await?;
                // Per rank: the pages of one step being computed, and as many of the step
                // before moving or queued for the sender (at least 4 pages).
                let per_step = cfg.cost.pages_per_step(cfg.model.spec.chunk_tokens);
                let mem =
                    ChunkMemory::new(cfg.model.spec.page_bytes() as usize, (2 * per_step).max(4))
                        .map_err(|e| SimError::Start(e.to_string()))?;
                sender
                    .register(mem.region())
                    .map_err(|e| SimError::Start(format!("registering chunk memory: {e}")))?;
                chunk_memory.push(mem);
                senders.push(Arc::new(sender));
            }
        }
        Role::Decode => {
            for rank in 0..ws {
                let port = cfg.init_ports.get(rank as usize).copied().unwrap_or(0);
                let listen = format!("{}:{port}", cfg.bind_host);
                let mut rc = ReceiverConfig::new(
                    ChannelConfig::new(format!("sim-{id}-r{rank}"), Some(&listen)),
                    rank,
                    cfg.model.spec,
                    cfg.buffer_bytes,
                );
                rc.ttl = cfg.kv_ttl;
                rc.fence_timeout = cfg.fence_timeout;
                let rx = PdReceiver::start(rc).await?;
                init_ports.push(rx.local_addr().map(|a| a.port()).unwrap_or(0));
                receivers.push(rx);
                let aport = cfg.alloc_ports.get(rank as usize).copied().unwrap_or(0);
                let l = TcpListener::bind((cfg.bind_host.as_str(), aport))
                    .await
                    .map_err(|e| {
                        SimError::Start(format!(
                            "cannot listen on {}:{aport} (announce port of rank {rank}): {e}",
                            cfg.bind_host
                        ))
                    })?;
                alloc_ports.push(l.local_addr().map(|a| a.port()).unwrap_or(0));
                tasks.push(tokio::spawn(announce::serve(l, announced.clone())));
            }
        }
        Role::Both => {}
    }
    let kv_events = match (publisher, &cfg.kv_events_endpoint) {
        (Some(p), _) => Some(p),
        (None, Some(ep)) => Some(
            KvEventsPublisher::bind(ep, &cfg.kv_events_topic, PubLimits::default())
                .await
                .map_err(|e| SimError::Start(format!("KV events endpoint {ep}: {e}")))?,
        ),
        (None, None) => None,
    };
    let mut prefix_cache = PrefixCache::new(cfg.model.spec.chunk_tokens, cfg.prefix_cache_tokens);
    // A new engine's first batch says that whatever an earlier one reported is gone.
    prefix_cache.clear();
    let inner = Arc::new(Inner {
        prefix_cache: std::sync::Mutex::new(prefix_cache),
        kv_events,
        model: Arc::new(cfg.model.clone()),
        cfg,
        senders,
        receivers,
        outcomes,
        announced,
        accel: tokio::sync::Mutex::new(()),
        fill_ps_per_token: AtomicU64::new(0),
        counts: Counts::default(),
        busy: BusyClock::default(),
        write_busy: BusyClock::default(),
        settled: tokio::sync::Notify::new(),
        seq: AtomicU64::new(0),
        chunk_memory,
        consumers: std::sync::Mutex::new(HashMap::new()),
        claimed: std::sync::Mutex::new(std::collections::HashSet::new()),
    });
    if let Some(rx0) = inner.receivers.first() {
        // Every granted request gets a consumer at once: its KV is digested as it lands.
        let mut granted = rx0.granted_requests();
        let s = inner.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                match granted.recv().await {
                    Ok(g) => start_consumer(&s, g.req_id, g.tokens),
                    // Missed grants are consumed when their decode request comes.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        }));
    }
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .with_state(inner.clone());
    let (stop, stopped) = oneshot::channel::<()>();
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tasks.push(tokio::spawn(async move {
        let r = axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await;
        if let Err(e) = r {
            tracing::warn!("engine server ended: {e}");
        }
    }));
    Ok(RunningEngine {
        inner,
        http_addr,
        init_ports,
        alloc_ports,
        stop: Some(stop),
        tasks,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

/// A parsed generation request.
struct GenRequest {
    api: Api,
    tokens: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    disagg: Option<DisaggSpec>,
    /// Decode: the PD request id the proxy named (`kv_transfer_params` key
    /// `lmcache.pd_handoff_id`), if any.
    handoff: Option<String>,
}

fn parse_json(body: &Bytes) -> Result<serde_json::Map<String, Value>, SimError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(SimError::BadRequest(
            "the body must be a JSON object".into(),
        )),
        Err(e) => Err(SimError::BadRequest(format!("the body is not JSON: {e}"))),
    }
}

fn prompt_tokens(v: Option<&Value>) -> Result<Vec<u32>, SimError> {
    match v {
        Some(Value::String(s)) => Ok(model::tokenize(s)),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(model::tokenize(a[0].as_str().unwrap_or("")))
        }
        Some(Value::Array(a)) if a.iter().all(Value::is_u64) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| SimError::BadRequest("token ids must fit in u32".into()))
            })
            .collect(),
        _ => Err(SimError::BadRequest(
            "`prompt` must be a string, a list of one string, or a list of token ids".into(),
        )),
    }
}

/// A chat's prompt tokens: the template over `messages` (see [`model::chat_prompt`]). With
/// `continue_final` (vLLM's `continue_final_message`), the last message must be the
/// assistant's, and the prompt ends with its content instead of a turn of its own, so the
/// answer continues it: the proxy's way to hand a decoder the prefill's first token.
fn chat_tokens(v: Option<&Value>, continue_final: bool) -> Result<Vec<u32>, SimError> {
    let Some(Value::Array(msgs)) = v else {
        return Err(SimError::BadRequest("`messages` must be an array".into()));
    };
    let mut parts = Vec::with_capacity(msgs.len());
    for m in msgs {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| SimError::BadRequest("every message needs a string `role`".into()))?;
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(ps)) => ps
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join(" "),
            Some(Value::Null) | None => String::new(),
            Some(_) => {
                return Err(SimError::BadRequest(
                    "message `content` must be a string or a list of text parts".into(),
                ))
            }
        };
        parts.push((role.to_string(), content));
    }
    if !continue_final {
        return Ok(model::tokenize(&model::chat_prompt(&parts)));
    }
    match parts.pop() {
        Some((role, content)) if role == "assistant" => {
            let mut text = model::chat_prompt(&parts);
            text.push_str(&content);
            Ok(model::tokenize(&text))
        }
        _ => Err(SimError::BadRequest(
            "`continue_final_message` needs a last message from the assistant".into(),
        )),
    }
}

fn parse(api: Api, m: &serde_json::Map<String, Value>, limit: u32) -> Result<GenRequest, SimError> {
    let tokens = match api {
        Api::Completions => prompt_tokens(m.get("prompt"))?,
        Api::Chat => {
            let cont = match m.get("continue_final_message") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(SimError::BadRequest(
                        "`continue_final_message` must be a boolean".into(),
                    ))
                }
            };
            chat_tokens(m.get("messages"), cont)?
        }
    };
    if tokens.is_empty() {
        return Err(SimError::BadRequest("the prompt is empty".into()));
    }
    let mut max_tokens = 16u64;
    let mut seen = false;
    for key in ["max_tokens", "max_completion_tokens"] {
        match m.get(key) {
            None | Some(Value::Null) => {}
            Some(v) => {
                let n = v.as_u64().filter(|n| *n >= 1).ok_or_else(|| {
                    SimError::BadRequest(format!("`{key}` must be a positive integer"))
                })?;
                max_tokens = if seen { max_tokens.min(n) } else { n };
                seen = true;
            }
        }
    }
    if max_tokens > limit as u64 {
        return Err(SimError::BadRequest(format!(
            "`max_tokens` is {max_tokens}, more than this engine's limit of {limit}"
        )));
    }
    let stream = match m.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(SimError::BadRequest("`stream` must be a boolean".into())),
    };
    let disagg = match m
        .get("kv_transfer_params")
        .and_then(|k| k.get("disagg_spec"))
    {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            serde_json::from_value::<DisaggSpec>(v.clone())
                .map_err(|e| SimError::BadRequest(format!("invalid `disagg_spec`: {e}")))?,
        ),
    };
    let handoff = match m.get("kv_transfer_params").and_then(|k| k.get(HANDOFF_KEY)) {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if !id.is_empty() && id.len() <= 256 => Some(id.clone()),
        Some(_) => {
            return Err(SimError::BadRequest(format!(
                "`kv_transfer_params.{HANDOFF_KEY}` must be a non-empty string of at most 256 bytes"
            )))
        }
    };
    Ok(GenRequest {
        api,
        tokens,
        max_tokens: max_tokens as u32,
        stream,
        disagg,
        handoff,
    })
}

async fn completions(State(s): State<Arc<Inner>>, body: Bytes) -> Response {
    serve_gen(s, Api::Completions, body).await
}

async fn chat(State(s): State<Arc<Inner>>, body: Bytes) -> Response {
    serve_gen(s, Api::Chat, body).await
}

async fn serve_gen(s: Arc<Inner>, api: Api, body: Bytes) -> Response {
    s.counts.requests.fetch_add(1, Relaxed);
    let stage = match s.cfg.role {
        Role::Prefill => "prefill.received",
        Role::Decode => "decode.received",
        Role::Both => "local.received",
    };
    tracing::debug!(target: TL, stage);
    let r = async {
        let m = parse_json(&body)?;
        let req = parse(api, &m, s.cfg.max_tokens_limit)?;
        s.counts
            .prompt_tokens
            .fetch_add(req.tokens.len() as u64, Relaxed);
        let state = prompt_state(&s, &req).await?;
        Ok::<_, SimError>(respond(s.clone(), req, state).await)
    }
    .await;
    match r {
        Ok(resp) => resp,
        Err(e) => {
            s.counts.errors.fetch_add(1, Relaxed);
            tracing::warn!(role = ?s.cfg.role, "request failed: {e}");
            e.into_response()
        }
    }
}

/// The state after the prompt: prefilled here (and sent), or received.
async fn prompt_state(s: &Arc<Inner>, req: &GenRequest) -> Result<SeqState, SimError> {
    match (s.cfg.role, &req.disagg) {
        (Role::Prefill, Some(ds)) => prefill_and_send(s, &req.tokens, ds).await,
        (Role::Decode, _) => match find_kv(s, req)? {
            Some((claim, m)) => receive(s, &req.tokens, claim, m).await,
            None => {
                s.counts.local_prefills.fetch_add(1, Relaxed);
                prefill(s, &req.tokens, None).await
            }
        },
        _ => prefill(s, &req.tokens, None).await,
    }
}

/// Prefills `tokens` on the simulated accelerator, one step (of whole pages) at a time; the
/// pages of every rank go to `send[rank]` as soon as their step ends.
///
/// The leading chunks the prefix cache holds cost nothing in the cost model: a local
/// prefill starts after them; a prefill that sends its KV still produces their bytes (a
/// real engine copies them out of its cache) but they are ready at once. The chunks
/// computed are stored in the cache.
async fn prefill(
    s: &Arc<Inner>,
    tokens: &[u32],
    send: Option<&[ChunkTx]>,
) -> Result<SeqState, SimError> {
    let _accel = s.accel.lock().await;
    let start = tokio::time::Instant::now();
    let model = s.model.clone();
    let c = model.spec.chunk_tokens.max(1) as usize;
    let keys = s.cache_keys(tokens);
    let hit = lock(&s.prefix_cache).lookup(&keys);
    let cached = hit.chunks * c;
    s.counts
        .prefill_tokens_computed
        .fetch_add((tokens.len() - cached) as u64, Relaxed);
    s.counts
        .prefix_cache_hit_tokens
        .fetch_add(cached as u64, Relaxed);
    // Without a transfer, the cached chunks need not be produced at all.
    let (skip, mut state) = match (send, hit.state) {
        (None, Some(st)) => (cached, st),
        _ => (0, model.start()),
    };
    let pages = tokens.len().div_ceil(c);
    let per_step = s.cfg.cost.pages_per_step(model.spec.chunk_tokens);
    let mut done = skip as u64;
    // The state after each whole chunk computed past the cached ones, for the cache.
    let mut computed: Vec<SeqState> = Vec::new();
    // This step's pages, computed but not yet existing for the cost model: one slot per rank.
    let mut step: Vec<(u64, Vec<ChunkSlot>)> = Vec::with_capacity(per_step);
    for (j, part) in tokens[skip..].chunks(c).enumerate() {
        let i = skip / c + j;
        if step.is_empty() {
            jit_wait(s, start, (tokens.len(), cached), i, c, per_step).await;
        }
        let (m, part_v) = (model.clone(), part.to_vec());
        // Sending: every rank's KV is computed straight into its registered chunk memory,
        // and moved from there. Colocated: into this thread's scratch buffers.
        let mut slots = Vec::new();
        if send.is_some() {
            let len = model.spec.chunk_bytes(part.len() as u32) as usize;
            for mem in &s.chunk_memory {
                let slot = mem
                    .take(len, CHUNK_MEMORY_WAIT)
                    .await
                    .map_err(|e| SimError::Internal(e.to_string()))?;
                slots.push(slot);
            }
        }
        // At the lowest priority (see `background`): on 2 cores the transfer of the previous
        // chunk and its notifications ran 10-20% faster in the demo (docs/engine.md).
        let computing = Instant::now();
        let (st, chunks) = crate::background::run("kvb-prefill", move || {
            let mut st = state;
            let p = m.prefixes(st.prefix, &part_v);
            if slots.is_empty() {
                m.compute_and_absorb(&mut st, &p);
            } else {
                let mut rows: Vec<Vec<u8>> = vec![Vec::new(); slots.len()];
                let mut outs: Vec<_> = slots
                    .iter()
                    .zip(rows.iter_mut())
                    .map(|(s, r)| s.sink(r))
                    .collect();
                m.fill_and_absorb(&mut st, &mut outs, &p);
            }
            (st, slots)
        })
        .await
        .map_err(|e| SimError::Internal(format!("prefill task: {e}")))?;
        let per_token = computing.elapsed().as_nanos() * 1000 / part.len().max(1) as u128;
        s.fill_ps_per_token.store(per_token as u64, Relaxed);
        state = st;
        done += part.len() as u64;
        if i >= hit.chunks && part.len() == c {
            computed.push(state);
        }
        let stage = if send.is_some() {
            "prefill.chunk_computed"
        } else {
            "local.chunk_computed"
        };
        tracing::debug!(target: TL, stage, chunk = i);
        step.push((i as u64, chunks));
        if step.len() < per_step && i + 1 < pages {
            continue;
        }
        // The cost model: this step's KV exists no earlier than the accelerator would have it.
        let charged = done.saturating_sub(cached as u64);
        tokio::time::sleep_until(start + s.cfg.cost.prefill_time(charged)).await;
        for (i, chunks) in step.drain(..) {
            let stage = if send.is_some() {
                "prefill.chunk_ready"
            } else {
                "local.chunk_ready"
            };
            tracing::debug!(target: TL, stage, chunk = i);
            if let Some(send) = send {
                for (tx, chunk) in send.iter().zip(chunks) {
                    // A rank whose transfer failed has reported KvFailed and stopped listening.
                    let _ = tx.send((i, chunk)).await;
                }
            }
        }
    }
    s.cache_chunks(tokens, &keys, hit.chunks, &computed);
    Ok(state)
}

/// Waits until the mock accelerator should start computing the step that begins with chunk
/// `first`: the cost model's time for the step's KV to exist, less the time its tokens take
/// to compute (at the last chunk's rate, with a quarter and a timer tick to spare).
///
/// A real accelerator computes KV in its own memory and takes nothing from the host; this
/// one fills host memory, and a step computed as soon as the previous one was handed over
/// filled the next chunk while the previous chunk was being transferred, two streams through
/// the same memory on a 2-core host. Computed as late as the step allows, it overlaps the
/// cost model's wait instead. Both the disaggregated and the colocated prefill wait the
/// same, and the step's KV exists no later than before unless a compute runs more than a
/// quarter over the last one's.
/// `tokens` is the prompt's length and how many of its leading tokens were cached (not
/// charged).
async fn jit_wait(
    s: &Inner,
    start: tokio::time::Instant,
    (tokens, cached): (usize, usize),
    first: usize,
    chunk_tokens: usize,
    per_step: usize,
) {
    let end = ((first + per_step) * chunk_tokens).min(tokens);
    let step_tokens = (end - first * chunk_tokens) as u64;
    let ready = start + s.cfg.cost.prefill_time(end.saturating_sub(cached) as u64);
    let at = compute_start(ready, s.fill_ps_per_token.load(Relaxed), step_tokens);
    // Only a wait in the future: a zero-length timer still waits for the next tick.
    if let Some(at) = at.filter(|at| *at > tokio::time::Instant::now()) {
        tokio::time::sleep_until(at).await;
    }
}

/// When to start computing a step of `step_tokens` tokens whose KV the cost model has exist
/// at `ready`, at `ps_per_token` picoseconds per token (the last chunk's rate): early by that
/// time, a quarter more and a timer tick (tokio's timers fire on 1 ms ticks). `None`, to
/// start at once, while the rate is not known.
fn compute_start(
    ready: tokio::time::Instant,
    ps_per_token: u64,
    step_tokens: u64,
) -> Option<tokio::time::Instant> {
    if ps_per_token == 0 {
        return None;
    }
    let compute = Duration::from_nanos(ps_per_token.saturating_mul(step_tokens) / 1000);
    ready.checked_sub(compute * 5 / 4 + Duration::from_millis(1))
}

/// Prefill role: starts the prefill at once and, while the accelerator computes, announces
/// the transfer to the decoder and begins it on every rank (the allocation round trip); each
/// rank task writes chunks as they come (after its `begin`) and finishes once the
/// announcement was acknowledged, so `KvReady` still always follows it. Setup costs the
/// first token nothing unless it outlasts the first chunk's compute.
///
/// A failed announcement or `begin` fails the request (500) as soon as it is known; every
/// rank reports `KvFailed` (its `begin`, `finish` or cancel does).
async fn prefill_and_send(
    s: &Arc<Inner>,
    tokens: &[u32],
    ds: &DisaggSpec,
) -> Result<SeqState, SimError> {
    tracing::debug!(target: TL, stage = "prefill.setup", id = %ds.req_id);
    let Some(port) = ds.receiver_alloc_port.first() else {
        let e = SimError::BadRequest(
            "`disagg_spec.receiver_alloc_port` is empty: the reference decoder learns the request id on it".into(),
        );
        for r in 0..s.model.world_size {
            s.outcomes.emit(Outcome::KvFailed {
                req_id: ds.req_id.clone(),
                rank: r,
                reason: e.to_string(),
            });
        }
        s.counts
            .kv_transfers_failed
            .fetch_add(s.model.world_size as u64, Relaxed);
        return Err(e);
    };
    let a = Announcement {
        req_id: ds.req_id.clone(),
        key: model::tokens_key(tokens),
        tokens: tokens.len() as u64,
    };
    let addr = format!("{}:{port}", ds.receiver_host);
    // The announcement's result, for the rank tasks (they finish only after an `ok`).
    let (ann_tx, ann_rx) = tokio::sync::watch::channel(None::<bool>);
    let tokens_arc: Arc<[u32]> = Arc::from(tokens);
    let mut txs = Vec::with_capacity(s.senders.len());
    let mut begun = Vec::with_capacity(s.senders.len());
    for sender in &s.senders {
        let (tx, rx) =
            mpsc::channel::<ChunkMsg>(s.cfg.cost.pages_per_step(s.model.spec.chunk_tokens).max(2));
        let (btx, brx) = oneshot::channel::<Result<(), PdError>>();
        txs.push(tx);
        begun.push(brx);
        s.work_started();
        tokio::spawn(rank_sender(
            s.clone(),
            RankJob {
                sender: sender.clone(),
                spec: ds.clone(),
                tokens: tokens_arc.clone(),
                chunks: rx,
                begun: btx,
                announced: ann_rx.clone(),
            },
        ));
    }
    let setup = async {
        tracing::debug!(target: TL, stage = "prefill.announce", id = %ds.req_id);
        let r = announce::announce(&addr, &a, s.cfg.announce_timeout).await;
        let _ = ann_tx.send(Some(r.is_ok()));
        r?;
        tracing::debug!(target: TL, stage = "prefill.announced", id = %ds.req_id);
        for b in begun {
            match b.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(SimError::Kv(e)),
                Err(_) => return Err(SimError::Internal("a rank task ended early".into())),
            }
        }
        tracing::debug!(target: TL, stage = "prefill.allocated", id = %ds.req_id);
        Ok::<(), SimError>(())
    };
    // Owns the chunk queues: they close (the rank tasks finish) when the prefill ends.
    let work = async move { prefill(s, tokens, Some(&txs)).await };
    tokio::pin!(setup, work);
    let mut set_up = false;
    let state = loop {
        tokio::select! {
            r = &mut setup, if !set_up => {
                // On failure the prefill stops here; the rank tasks see their chunk queue
                // close and report KvFailed.
                r?;
                set_up = true;
            }
            st = &mut work => break st,
        }
    };
    if !set_up {
        setup.await?;
    }
    state
}

/// What one rank task needs.
struct RankJob {
    sender: Arc<PdSender>,
    spec: DisaggSpec,
    tokens: Arc<[u32]>,
    /// The prefill's chunks, in order; closed after the last (or when the request failed).
    chunks: mpsc::Receiver<ChunkMsg>,
    /// The result of `begin`.
    begun: oneshot::Sender<Result<(), PdError>>,
    /// The announcement's result (`None` until known).
    announced: tokio::sync::watch::Receiver<Option<bool>>,
}

/// Begins the transfer, writes one rank's chunks as they come, then finishes (`KvReady`),
/// or fails (`KvFailed`).
async fn rank_sender(s: Arc<Inner>, job: RankJob) {
    rank_sender_inner(&s, job).await;
    s.work_done();
}

async fn rank_sender_inner(s: &Inner, job: RankJob) {
    let RankJob {
        sender,
        spec,
        tokens,
        chunks: mut rx,
        begun,
        mut announced,
    } = job;
    let mut t = match sender.begin(&spec, &tokens).await {
        Ok(t) => {
            let _ = begun.send(Ok(()));
            t
        }
        Err(e) => {
            // `begin` reported KvFailed.
            s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
            let _ = begun.send(Err(e));
            return;
        }
    };
    // The receiver's confirmation is asked for now, and comes back while the prefill runs
    // (`prepare_finish`): the finish after the last write waits for nothing.
    if t.prepare_finish().await.is_err() {
        s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
        return;
    }
    while let Some((i, data)) = rx.recv().await {
        s.busy.enter();
        s.write_busy.enter();
        let r = t.send_chunk_from(i, data.region(), data.offset()).await;
        // The transfer returned: nothing reads the slot any more, it may be reused.
        drop(data);
        s.write_busy.leave();
        s.busy.leave();
        tracing::debug!(target: TL, stage = "sender.chunk_landed", id = t.req_id(), chunk = i);
        if let Err(e) = r {
            tracing::warn!(req_id = t.req_id(), chunk = i, "KV write failed: {e}");
            s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
            return;
        }
    }
    if !told_decoder(s, &mut announced).await {
        s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
        t.cancel("the decoder was not told about the transfer (announcement failed)")
            .await;
        return;
    }
    let id = t.req_id().to_string();
    s.busy.enter();
    let began = Instant::now();
    let r = t.finish().await;
    s.counts
        .kv_finish_ns
        .fetch_add(began.elapsed().as_nanos() as u64, Relaxed);
    s.counts.kv_finishes.fetch_add(1, Relaxed);
    s.busy.leave();
    tracing::debug!(target: TL, stage = "sender.finished", id = %id);
    match r {
        Ok(sum) => {
            s.counts.kv_transfers_ok.fetch_add(1, Relaxed);
            s.counts.kv_bytes_sent.fetch_add(sum.bytes, Relaxed);
        }
        Err(e) => {
            tracing::warn!(req_id = %id, "KV transfer failed at finish: {e}");
            s.counts.kv_transfers_failed.fetch_add(1, Relaxed);
        }
    }
}

/// Whether the decoder acknowledged the announcement of the transfer: `KvReady` comes only
/// after that (long done by then: it started with the prefill). A sender gone without an
/// answer counts as a failure.
async fn told_decoder(
    s: &Inner,
    announced: &mut tokio::sync::watch::Receiver<Option<bool>>,
) -> bool {
    tokio::time::timeout(s.cfg.announce_timeout, announced.wait_for(Option::is_some))
        .await
        .ok()
        .and_then(|r| r.ok().and_then(|v| *v))
        .unwrap_or(false)
}

/// Decode role: the PD request holding this prompt's KV, and how many of the request's
/// tokens it covers (a completion's decode prompt is the prefill prompt plus the first
/// token; a chat's is the prefill prompt itself), claimed for this request.
///
/// With a handoff id (`kv_transfer_params.lmcache.pd_handoff_id`) the request is taken by
/// id, and only if its chunk keys, which its sender computed over the tokens it sent the KV
/// of ([`kvbridge_pd::chunk_keys`]: model, world size, rank, dtype, layout and every token
/// up to each chunk's end), equal the keys of this decode prompt's tokens on every
/// receiving rank: the id alone is the client's word, the keys prove the KV is this
/// prompt's. Without an id, with one this decoder does not hold, or with one whose keys
/// differ, the announcement table is searched by the prompt's key ([`crate::announce`]). Either way the request
/// need not be complete: its chunks are waited for, each with the retrieve deadline, and a
/// transfer that ends before its last chunk lands fails the decode at once
/// (`kv_transfer_failed`). A request is claimed once; a second decode naming it is refused.
fn find_kv(s: &Arc<Inner>, req: &GenRequest) -> Result<Option<(Claim, usize)>, SimError> {
    let n = req.tokens.len();
    let order = match req.api {
        Api::Completions => [n.saturating_sub(1), n],
        Api::Chat => [n, n.saturating_sub(1)],
    };
    let ranks = s.cfg.receiving_ranks();
    if let Some(id) = &req.handoff {
        if let Some(why) = s.receivers.first().and_then(|rx| rx.ended(id)) {
            s.counts.kv_retrieve_failed.fetch_add(1, Relaxed);
            return Err(SimError::KvEnded(format!(
                "the KV transfer of request {id} ended before it completed: {why}"
            )));
        }
        let held: Option<Vec<Vec<u64>>> =
            s.receivers[..ranks].iter().map(|rx| rx.keys(id)).collect();
        if let Some(held) = held {
            for m in order {
                if m == 0 {
                    continue;
                }
                let matches = held.iter().enumerate().all(|(r, keys)| {
                    let want = kvbridge_pd::chunk_keys(
                        &s.model.name,
                        s.model.world_size,
                        r as u32,
                        &s.model.spec,
                        &req.tokens[..m],
                    );
                    want.len() == keys.len() && want.iter().zip(keys).all(|(w, k)| w.hash == *k)
                });
                if matches {
                    let c = claim(s, id)?;
                    s.announced.remove(model::tokens_key(&req.tokens[..m]), id);
                    tracing::debug!(target: TL, stage = "decode.kv_by_id", id = %id);
                    return Ok(Some((c, m)));
                }
            }
            // The id names KV that is not this prompt's (or not of this model: the keys
            // name it): the id is not trusted, and the request is looked up as if it had
            // come without one.
            tracing::warn!(req_id = %id, "`kv_transfer_params.{HANDOFF_KEY}` names KV whose chunk keys are not this prompt's; ignoring it");
        }
        // Not held here (or not this prompt's): fall back to the announcement.
    }
    for m in order {
        if m == 0 {
            continue;
        }
        let key = model::tokens_key(&req.tokens[..m]);
        for id in s.announced.candidates(key, m as u64) {
            // A request whose pages are held (still landing or complete) can be claimed:
            // its chunks are waited for. One that ended is skipped (its announcement goes).
            let held = s.receivers[..ranks]
                .iter()
                .all(|rx| rx.chunks_landed(&id).is_some());
            if held {
                if let Ok(c) = claim(s, &id) {
                    s.announced.remove(key, &id);
                    return Ok(Some((c, m)));
                }
            }
            if s.receivers[0].ended(&id).is_some() {
                s.announced.remove(key, &id);
            }
        }
    }
    Ok(None)
}

/// Decode role: marks request `id`'s KV as taken by one decode request (until the returned
/// [`Claim`] is dropped).
fn claim(s: &Arc<Inner>, id: &str) -> Result<Claim, SimError> {
    if lock(&s.claimed).insert(id.to_string()) {
        Ok(Claim {
            s: s.clone(),
            id: id.to_string(),
            armed: true,
        })
    } else {
        Err(SimError::BadRequest(format!(
            "the KV of request {id} is already taken by another decode request"
        )))
    }
}

/// Decode role: one decode request's hold on a PD request's KV. Whatever ends the decode
/// request, the id is unclaimed when this drops. Dropped while still armed (the decode
/// failed, or its future was dropped because the client went away or the proxy gave up),
/// it also cancels the PD request on every receiving rank, so its pages return now (once no
/// write can land in them) rather than when the receiver's TTL runs out.
struct Claim {
    s: Arc<Inner>,
    id: String,
    armed: bool,
}

impl Claim {
    /// The PD request's pages have been released by their owner: nothing to cancel.
    fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.armed {
            for rx in &self.s.receivers[..self.s.cfg.receiving_ranks()] {
                // An error is a request the receiver no longer holds: nothing to return.
                let _ = rx.cancel(&self.id);
            }
            tracing::debug!(req_id = %self.id, "decode request ended before its KV was released: cancelled");
        }
        lock(&self.s.claimed).remove(&self.id);
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Decode role: starts digesting request `id`'s KV as its chunks land (once per request).
fn start_consumer(s: &Arc<Inner>, id: String, tokens: u64) {
    let mut c = lock(&s.consumers);
    // Forget consumers of requests the buffer no longer holds (their decode never came).
    c.retain(|k, h| !h.is_finished() || s.receivers[0].chunks_landed(k).is_some());
    if c.contains_key(&id) {
        return;
    }
    let h = tokio::spawn(consume(s.clone(), id.clone(), tokens));
    c.insert(id, h);
}

/// What a decoder took from a request's KV as it landed.
struct Consumed {
    /// The sequence state after the KV (its prefix hash is set once the prompt is known).
    state: SeqState,
    /// Per chunk, per world rank, the digest of each position's KV as it was read
    /// (`[chunk][rank][position]`): checked against the prompt's KV after the first token,
    /// without reading the pages again.
    digests: Vec<Vec<Vec<u64>>>,
    /// Bytes read, counted per world rank (an MLA chunk sent once counts for every rank).
    bytes: u64,
}

/// Decode role: the digest of request `id`'s KV (every rank), computed chunk by chunk, in
/// place, as each chunk lands on every receiving rank. Each chunk waits at most the
/// retrieve deadline. The pages stay held until the request's release.
async fn consume(s: Arc<Inner>, id: String, tokens: u64) -> Result<Consumed, SimError> {
    let model = s.model.clone();
    let n = model.spec.chunks_for(tokens);
    let ranks = s.cfg.receiving_ranks();
    let mut state = model.start();
    let mut digests = Vec::with_capacity(n as usize);
    let mut bytes = 0u64;
    for i in 0..n {
        let mut held: Vec<ChunkRef> = Vec::with_capacity(ranks);
        for rx in &s.receivers[..ranks] {
            held.push(rx.chunk(&id, i, s.cfg.retrieve_timeout).await?);
        }
        tracing::debug!(target: TL, stage = "decode.chunk_landed", id = %id, chunk = i);
        let t = model.spec.tokens_in_chunk(i, tokens) as usize;
        let (m, ws) = (model.clone(), model.world_size as usize);
        // The last chunk's digest is on the path to the first token and the prefill is over:
        // use two cores for it, unless it is short (a second thread costs ~0.1 ms to start
        // here, more than it saves on fewer than 64 tokens: 2 MiB in the demo). Earlier
        // chunks leave the other core to the prefiller.
        let threads = if i + 1 == n && t >= 64 { 2 } else { 1 };
        // The simulated accelerator's work: at the lowest priority, as the prefill's.
        let (st, d, b) = crate::background::run("kvb-absorb", move || {
            let mut st = state;
            // The bytes are copied out of the receive buffer before they are hashed: a peer
            // may write the pages meanwhile (`ChunkRef` says why). Into pooled buffers, so a
            // chunk allocates nothing once the pool is warm.
            let mut copies = crate::model::scratch_take();
            copies.resize_with(copies.len().max(held.len()), Vec::new);
            for (c, out) in held.iter().zip(copies.iter_mut()) {
                c.copy_into(out);
            }
            let k = held.len();
            drop(held);
            // MLA send-once: rank 0's copy stands for every rank (the KV is identical).
            let refs: Vec<&[u8]> = (0..ws).map(|r| copies[r.min(k - 1)].as_slice()).collect();
            let b = refs.iter().map(|c| c.len() as u64).sum::<u64>();
            let d = m.absorb_kv_par(&mut st, &refs, t, threads);
            drop(refs);
            crate::model::scratch_give_back(copies);
            (st, d, b)
        })
        .await
        .map_err(|e| SimError::Internal(format!("decode task: {e}")))?;
        state = st;
        digests.push(d);
        bytes += b;
        tracing::debug!(target: TL, stage = "decode.chunk_digested", id = %id, chunk = i);
    }
    Ok(Consumed {
        state,
        digests,
        bytes,
    })
}

/// Decode role: request `id`'s KV, digested as it landed (or now, if its grant was missed),
/// continued over `tokens[m..]`; every chunk is then verified in place, off the path to the
/// first token, and the pages are released. `claim` is the request's hold on `id`: dropped
/// armed (a failure here, or this future dropped) it cancels the request.
async fn receive(
    s: &Arc<Inner>,
    tokens: &[u32],
    mut claim: Claim,
    m: usize,
) -> Result<SeqState, SimError> {
    let id = claim.id.clone();
    let id = id.as_str();
    s.counts.kv_requests_received.fetch_add(1, Relaxed);
    tracing::debug!(target: TL, stage = "decode.kv_found", id);
    let t0 = Instant::now();
    let ranks = s.cfg.receiving_ranks();
    let consumer = lock(&s.consumers).remove(id);
    let consumed = match consumer {
        Some(h) => h
            .await
            .map_err(|e| SimError::Internal(format!("decode task: {e}")))
            .and_then(|r| r),
        None => consume(s.clone(), id.to_string(), m as u64).await,
    };
    let kv = match consumed {
        Ok(c) if c.state.len == m as u64 => Ok(c),
        Ok(c) => Err(SimError::Internal(format!(
            "request {id} holds KV of {} tokens, the decode prompt has {m}",
            c.state.len
        ))),
        Err(e) => Err(e),
    };
    let Consumed {
        state: kv,
        digests,
        bytes,
    } = match kv {
        Ok(kv) => kv,
        Err(e) => {
            drop(claim); // armed: cancels the request on every rank, and unclaims it
            s.counts.kv_retrieve_failed.fetch_add(1, Relaxed);
            // The transfer ended under us: say so in the engine's own terms.
            return Err(match e {
                SimError::Kv(pd) => {
                    SimError::KvEnded(format!("the KV of request {id} did not arrive: {pd}"))
                }
                e => e,
            });
        }
    };
    // On the path to the first token: only the prompt's prefix hashes and the token after
    // it, if any (a completion's decode prompt ends with the prefill's first token: one
    // token's KV, tens of microseconds); the KV's digest is done. Cheap enough to do here
    // rather than pay a hop to a blocking thread.
    let model = &s.model;
    let prefixes = model.prefixes(model.start().prefix, &tokens[..m]);
    let mut state = kv;
    if let Some(&p) = prefixes.last() {
        state.prefix = p;
    }
    for &t in &tokens[m..] {
        model.extend(&mut state, t);
    }
    s.counts
        .kv_load_ns
        .fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
    tracing::debug!(target: TL, stage = "decode.kv_loaded", id);
    // Off the path: the pages return once the request is complete (the KV was read when
    // it was digested; nothing reads it again). The decode may have started before the
    // sender's `finish` (every chunk had landed, which is all it reads). A transfer that
    // ended instead has had its pages returned by the receiver.
    s.work_started();
    let (s2, id2) = (s.clone(), id.to_string());
    let received: Vec<u32> = tokens[..m].to_vec();
    tokio::spawn(async move {
        for rx in &s2.receivers[..ranks] {
            let r = match rx.wait_complete(&id2, s2.cfg.retrieve_timeout).await {
                Ok(()) => rx.release(&id2),
                Err(e) => Err(e),
            };
            if let Err(e) = r {
                tracing::warn!(req_id = %id2, "releasing received KV: {e}");
            }
        }
        claim.disarm();
        drop(claim);
        // Then every chunk is checked (a real decoder would not do this; here it proves the
        // transfer): the digest of each position's KV as the decoder read it against the
        // digest of the KV the model says the prompt must have, generated in registers. A
        // pass of compute and no memory traffic (comparing the pages themselves was a second
        // read of every byte beside the transfers). At the lowest CPU priority: on a small
        // host it would otherwise take a core from the first token's way to the client.
        let s3 = s2.clone();
        let r = crate::background::run("kvb-verify", move || {
            let model = s3.model.clone();
            let c = model.spec.chunk_tokens.max(1) as usize;
            let (mut chunks, mut mismatches) = (0u64, 0u64);
            for (i, p) in prefixes.chunks(c).enumerate() {
                for r in 0..model.world_size {
                    chunks += 1;
                    let held = digests.get(i).and_then(|d| d.get(r as usize));
                    if !held.is_some_and(|h| model.digests_match(r, p, h)) {
                        mismatches += 1;
                    }
                }
            }
            // KV received whole and right is KV held: the state after each whole chunk,
            // from the digests already taken, for the prefix cache.
            let mut states = Vec::new();
            if mismatches == 0 {
                let mut st = model.start();
                for (p, d) in prefixes.chunks_exact(c).zip(&digests) {
                    model.chain_digests(&mut st, d, c);
                    if let Some(&last) = p.last() {
                        st.prefix = last;
                    }
                    states.push(st);
                }
            }
            (chunks, mismatches, states)
        })
        .await;
        match r {
            Ok((chunks, mismatches, states)) => {
                if !states.is_empty() {
                    let keys = s2.cache_keys(&received);
                    s2.cache_chunks(&received, &keys, 0, &states);
                }
                s2.counts.kv_chunks_received.fetch_add(chunks, Relaxed);
                s2.counts.kv_bytes_received.fetch_add(bytes, Relaxed);
                if mismatches > 0 {
                    tracing::error!(
                        req_id = %id2,
                        mismatches,
                        "received KV differs from the expected KV"
                    );
                    s2.counts.kv_mismatches.fetch_add(mismatches, Relaxed);
                }
            }
            Err(e) => {
                tracing::error!(req_id = %id2, "verification task failed: {e}");
                s2.counts.kv_mismatches.fetch_add(1, Relaxed);
            }
        }
        s2.work_done();
    });
    Ok(state)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Generates the answer: the first token comes with the prefill, each later one costs the
/// decode time per token.
async fn respond(s: Arc<Inner>, req: GenRequest, state: SeqState) -> Response {
    let id = match req.api {
        Api::Completions => format!("cmpl-sim-{}", s.seq.fetch_add(1, Relaxed)),
        Api::Chat => format!("chatcmpl-sim-{}", s.seq.fetch_add(1, Relaxed)),
    };
    let created = unix_now();
    let name = s.model.name.clone();
    let prompt_len = req.tokens.len();
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let n = req.max_tokens;
    let gen = tokio::spawn({
        let s = s.clone();
        async move {
            let mut st = state;
            let start = tokio::time::Instant::now();
            for i in 0..n {
                if i > 0 {
                    tokio::time::sleep_until(start + s.cfg.cost.decode_per_token * i).await;
                }
                let tok = s.model.next_token(&st);
                s.counts.generated_tokens.fetch_add(1, Relaxed);
                if i == 0 {
                    let stage = match s.cfg.role {
                        Role::Prefill => "prefill.first_token",
                        Role::Decode => "decode.first_token",
                        Role::Both => "local.first_token",
                    };
                    tracing::debug!(target: TL, stage);
                }
                if tx.send(model::token_text(tok)).await.is_err() {
                    return; // the client went away
                }
                if i + 1 < n {
                    let m = s.model.clone();
                    st = match tokio::task::spawn_blocking(move || {
                        m.extend(&mut st, tok);
                        st
                    })
                    .await
                    {
                        Ok(st) => st,
                        Err(_) => return,
                    };
                }
            }
        }
    });
    if !req.stream {
        let mut text = String::new();
        let mut count = 0u32;
        while let Some(t) = rx.recv().await {
            text.push_str(&t);
            count += 1;
        }
        let _ = gen.await;
        let usage = json!({"prompt_tokens": prompt_len, "completion_tokens": count,
            "total_tokens": prompt_len + count as usize});
        let body = match req.api {
            Api::Completions => json!({"id": id, "object": "text_completion", "created": created,
                "model": name, "choices": [{"index": 0, "text": text, "logprobs": null,
                "finish_reason": "length"}], "usage": usage}),
            Api::Chat => json!({"id": id, "object": "chat.completion", "created": created,
                "model": name, "choices": [{"index": 0, "message": {"role": "assistant",
                "content": text}, "logprobs": null, "finish_reason": "length"}], "usage": usage}),
        };
        return axum::Json(body).into_response();
    }
    let api = req.api;
    let (btx, brx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let event = |v: Value| Ok(Bytes::from(format!("data: {v}\n\n")));
        if api == Api::Chat {
            let v = json!({"id": id, "object": "chat.completion.chunk", "created": created,
                "model": name, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null}]});
            if btx.send(event(v)).await.is_err() {
                return;
            }
        }
        let mut sent = 0u32;
        while let Some(t) = rx.recv().await {
            sent += 1;
            let finish = if sent == n {
                json!("length")
            } else {
                Value::Null
            };
            let v = match api {
                Api::Completions => {
                    json!({"id": id, "object": "text_completion", "created": created,
                    "model": name, "choices": [{"index": 0, "text": t, "logprobs": null,
                    "finish_reason": finish}]})
                }
                Api::Chat => {
                    json!({"id": id, "object": "chat.completion.chunk", "created": created,
                    "model": name, "choices": [{"index": 0, "delta": {"content": t},
                    "logprobs": null, "finish_reason": finish}]})
                }
            };
            if btx.send(event(v)).await.is_err() {
                return;
            }
        }
        let _ = btx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let stream = futures_util::stream::unfold(brx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut r = Response::new(Body::from_stream(stream));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

async fn models(State(s): State<Arc<Inner>>) -> Response {
    axum::Json(
        json!({"object": "list", "data": [{"id": s.model.name, "object": "model",
        "created": 0, "owned_by": "kvbridge-sim"}]}),
    )
    .into_response()
}

async fn health(State(s): State<Arc<Inner>>) -> Response {
    let stats = s.stats();
    axum::Json(json!({"status": "ok", "stats": stats})).into_response()
}

async fn metrics(State(s): State<Arc<Inner>>) -> Response {
    let v = serde_json::to_value(s.stats()).unwrap_or(Value::Null);
    let mut out = String::new();
    if let Value::Object(m) = v {
        for (k, v) in m {
            if let Some(x) = v.as_f64() {
                out.push_str(&format!("kvbridge_sim_{k} {x}\n"));
            }
        }
    }
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    (h, out).into_response()
}

async fn reset_prefix_cache(State(s): State<Arc<Inner>>) -> Response {
    s.update_cache(PrefixCache::clear);
    StatusCode::OK.into_response()
}

async fn tokenize(State(s): State<Arc<Inner>>, body: Bytes) -> Response {
    let r = (|| {
        let m = parse_json(&body)?;
        let tokens = if m.contains_key("messages") {
            chat_tokens(
                m.get("messages"),
                m.get("continue_final_message")
                    .and_then(Value::as_bool)
                    .unwrap_or(false),
            )?
        } else {
            prompt_tokens(m.get("prompt"))?
        };
        Ok::<_, SimError>(tokens)
    })();
    match r {
        Ok(tokens) => axum::Json(json!({"count": tokens.len(), "tokens": tokens,
            "max_model_len": s.cfg.buffer_bytes / s.model.spec.bytes_per_token().max(1)}))
        .into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_computed_as_late_as_its_ready_time_allows() {
        let ready = tokio::time::Instant::now() + Duration::from_secs(1);
        // The rate not known yet: at once.
        assert_eq!(compute_start(ready, 0, 256), None);
        // 4 µs per token, 256 tokens: 1.024 ms of compute, started 1.28 ms + a tick early.
        let at = compute_start(ready, 4_000_000, 256).unwrap();
        assert_eq!(
            ready - at,
            Duration::from_micros(1280) + Duration::from_millis(1)
        );
        // Twice the tokens, twice the compute.
        let at2 = compute_start(ready, 4_000_000, 512).unwrap();
        assert_eq!(at - at2, Duration::from_micros(1280));
        // A step that cannot be computed in time starts at once (before now).
        let soon = tokio::time::Instant::now() + Duration::from_micros(100);
        let late = compute_start(soon, 4_000_000, 256).unwrap();
        assert!(late < tokio::time::Instant::now());
    }
}
