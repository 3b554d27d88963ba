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
//!
//! Its files, each importing only from those below it:
//! - `http.rs`: the routes; a generation request's prompt state got as the role says;
//! - `respond.rs`: the answer, generated from that state (JSON or server-sent events);
//! - `send.rs`: the prefill role's KV transfer (the announcement, one task per rank);
//! - `receive.rs`: the decode role's intake of KV as it lands, and its verification;
//! - `claim.rs`: which received request holds a prompt's KV, and a decode request's hold on
//!   it;
//! - `prefill.rs`: the mock accelerator's prefill, step by step under the cost model;
//! - `tp_push.rs`: between different TP sizes, the KV cut into the push's parts and placed
//!   back into the decoder's ranks;
//! - `cache.rs`: the engine's use of the prefix cache, and the KV events it publishes;
//! - `request.rs`: an OpenAI generation request, parsed;
//! - `state.rs`: `Inner`, the state all of them share;
//! - `stats.rs`, `config.rs`, `error.rs`: the counters, the settings, the errors.

mod cache;
mod claim;
mod config;
mod error;
mod http;
mod prefill;
mod receive;
mod request;
mod respond;
mod send;
mod state;
mod stats;
mod tp_push;

pub use config::{EngineConfig, Role};
pub use error::SimError;
pub use request::{chat_tokens, HANDOFF_KEY};
pub use stats::EngineStats;

use crate::announce::{self, Announced};
use crate::chunk_memory::ChunkMemory;
use crate::kv_events_pub::{KvEventsPublisher, PubLimits};
use crate::prefix_cache::PrefixCache;
use kvbridge::ChannelConfig;
use kvbridge_pd::{OutcomeSink, PdReceiver, PdSender, ReceiverConfig, SenderConfig, ZmqPusher};
use receive::start_consumer;
use state::Inner;
use stats::{BusyClock, Counts};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

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
    cfg.check_push().map_err(SimError::Start)?;
    let http_addr = listener
        .local_addr()
        .map_err(|e| SimError::Start(e.to_string()))?;
    let outcomes = match &cfg.proxy_endpoint {
        Some(ep) => OutcomeSink::Zmq(ZmqPusher::spawn(ep.clone(), Duration::from_secs(5))),
        None => OutcomeSink::None,
    };
    let mut tasks = Vec::new();
    let announced = Announced::default();
    let id = format!("{:?}-{}", cfg.role, http_addr.port()).to_lowercase();
    let (mut senders, mut chunk_memory) = (Vec::new(), Vec::new());
    let mut ranks = DecodeRanks::default();
    match cfg.role {
        Role::Prefill => (senders, chunk_memory) = start_senders(&cfg, &id, &outcomes).await?,
        Role::Decode => ranks = start_receivers(&cfg, &id, &announced).await?,
        Role::Both => {}
    }
    let DecodeRanks {
        receivers,
        init_ports,
        alloc_ports,
        announce_tasks,
    } = ranks;
    tasks.extend(announce_tasks);
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
    let lane_specs = cfg.lanes().into_iter().map(|l| l.2).collect();
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
        lane_specs,
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
    let router = http::router(inner.clone());
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

/// A prefiller's ranks: one PD sender each, with the chunk memory its steps are computed
/// into registered with it.
async fn start_senders(
    cfg: &EngineConfig,
    id: &str,
    outcomes: &OutcomeSink,
) -> Result<(Vec<Arc<PdSender>>, Vec<Arc<ChunkMemory>>), SimError> {
    let (mut senders, mut chunk_memory) = (Vec::new(), Vec::new());
    for (rank, world, spec, name) in cfg.lanes() {
        let mut sc = SenderConfig::new(
            ChannelConfig::new(format!("sim-{id}-{name}"), None),
            rank,
            world,
            &cfg.model.name,
            spec,
        );
        sc.outcomes = outcomes.clone();
        sc.mla_send_once = cfg.mla_send_once;
        sc.mode = cfg.transfer_mode;
        let sender = PdSender::start(sc).await?;
        // Per rank: the pages of one step being computed, and as many of the step
        // before moving or queued for the sender (at least 4 pages).
        let per_step = cfg.cost.pages_per_step(cfg.model.spec.chunk_tokens);
        let mem = ChunkMemory::new(spec.page_bytes() as usize, (2 * per_step).max(4))
            .map_err(|e| SimError::Start(e.to_string()))?;
        sender
            .register(mem.region())
            .map_err(|e| SimError::Start(format!("registering chunk memory: {e}")))?;
        chunk_memory.push(mem);
        senders.push(Arc::new(sender));
    }
    Ok((senders, chunk_memory))
}

/// A decoder's ranks, in rank order.
#[derive(Default)]
struct DecodeRanks {
    receivers: Vec<PdReceiver>,
    /// The port each receiver listens on.
    init_ports: Vec<u16>,
    /// The port each rank's announcements are served on, by `announce_tasks`.
    alloc_ports: Vec<u16>,
    announce_tasks: Vec<JoinHandle<()>>,
}

/// A decoder's ranks: one PD receiver each on its init port, and its announce port served.
async fn start_receivers(
    cfg: &EngineConfig,
    id: &str,
    announced: &Announced,
) -> Result<DecodeRanks, SimError> {
    let mut r = DecodeRanks::default();
    for (rank, _, spec, name) in cfg.lanes() {
        let port = cfg.init_ports.get(rank as usize).copied().unwrap_or(0);
        let listen = format!("{}:{port}", cfg.bind_host);
        let mut rc = ReceiverConfig::new(
            ChannelConfig::new(format!("sim-{id}-{name}"), Some(&listen)),
            rank,
            spec,
            cfg.buffer_bytes,
        );
        rc.ttl = cfg.kv_ttl;
        rc.fence_timeout = cfg.fence_timeout;
        let rx = PdReceiver::start(rc).await?;
        r.init_ports
            .push(rx.local_addr().map(|a| a.port()).unwrap_or(0));
        r.receivers.push(rx);
        let aport = cfg.alloc_ports.get(rank as usize).copied().unwrap_or(0);
        let l = TcpListener::bind((cfg.bind_host.as_str(), aport))
            .await
            .map_err(|e| {
                SimError::Start(format!(
                    "cannot listen on {}:{aport} (announce port of rank {rank}): {e}",
                    cfg.bind_host
                ))
            })?;
        r.alloc_ports
            .push(l.local_addr().map(|a| a.port()).unwrap_or(0));
        r.announce_tasks
            .push(tokio::spawn(announce::serve(l, announced.clone())));
    }
    Ok(r)
}
