//! The sender (prefiller side) of one rank.
//!
//! For each request with a [`DisaggSpec`] the sender connects lazily to the receiver rank,
//! reserves pages for the whole request, moves chunks as the engine hands them over one at
//! a time, and reports exactly one [`Outcome`] per request: `KvReady` after the receiver
//! confirmed that every chunk landed, `KvFailed` on any failure, cancel, or when a
//! [`Transfer`] is dropped unfinished.
//!
//! Push mode ([`TransferMode::Push`]) writes each chunk into its page and then tells the
//! receiver it landed (`Written`, so the decoder can consume it before the request is
//! complete). Pull mode ([`TransferMode::Pull`]) offers each chunk in registered memory
//! ([`Transfer::offer_chunk`]); the receiver reads it and answers `Pulled`. Offered memory
//! belongs to the receiver until that answer ([`Transfer::wait_pulled`]), until
//! [`Transfer::finish`] returned, or until [`Transfer::cancel`] returned (which waits for
//! the receiver's `CancelAck`, or disconnects a receiver that does not answer): the engine
//! must not reuse it earlier.

pub use crate::config::TransferMode;
use crate::error::{PdError, PdStep, Result};
use crate::key::chunk_keys;
use crate::layout::KvSpec;
use crate::msg::PdMsg;
use crate::outcome::{Outcome, OutcomeSink};
use crate::timeline::TIMELINE;
use kvbridge::{Channel, ChannelConfig, Grant, Op, PeerId, Region, RegionId};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, Notify, Semaphore};
use tokio::task::JoinHandle;

/// Where a request's KV goes: what the proxy puts into `kv_transfer_params.disagg_spec`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisaggSpec {
    /// The request id outcomes are reported under.
    pub req_id: String,
    /// The decoder's host.
    pub receiver_host: String,
    /// The decoder's channel port, one per rank (`pd_peer_init_port`).
    pub receiver_init_port: Vec<u16>,
    /// LMCache's allocation port per rank. Accepted for compatibility; kvbridge allocates
    /// over the channel, so it is not used.
    #[serde(default)]
    pub receiver_alloc_port: Vec<u16>,
}

/// Configuration of one sender rank.
#[derive(Debug, Clone)]
pub struct SenderConfig {
    /// The channel (peer id, deadlines).
    pub channel: ChannelConfig,
    /// This rank.
    pub rank: u32,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// Model name (part of every chunk key).
    pub model: String,
    /// Layout, dtype, chunk size.
    pub spec: KvSpec,
    /// Chunks of staging memory for [`Transfer::send_chunk`] (copies in flight at once).
    pub staging_chunks: usize,
    /// How long to wait for pages (should exceed the receiver's allocation wait).
    pub alloc_deadline: Duration,
    /// Deadline of every other step (connect, write, finish, staging slot).
    pub step_deadline: Duration,
    /// Where outcomes go.
    pub outcomes: OutcomeSink,
    /// MLA only (the KV is identical on every rank): rank 0 sends the KV once, to decoder
    /// rank 0, for all ranks; every other rank writes nothing and reports
    /// `KvReady{bytes: 0, sent_by: Some(0)}` (its KV is ready when rank 0's is: the proxy
    /// still needs rank 0's own outcome). The decoder shares rank 0's copy across its ranks.
    pub mla_send_once: bool,
    /// Push (write) or pull (the receiver reads); see the module docs.
    pub mode: TransferMode,
}

impl SenderConfig {
    /// Defaults: 2 staging chunks, 15 s allocation deadline, 30 s per step, no outcomes.
    pub fn new(
        channel: ChannelConfig,
        rank: u32,
        world_size: u32,
        model: &str,
        spec: KvSpec,
    ) -> Self {
        Self {
            channel,
            rank,
            world_size,
            model: model.to_string(),
            spec,
            staging_chunks: 2,
            alloc_deadline: Duration::from_secs(15),
            step_deadline: Duration::from_secs(30),
            outcomes: OutcomeSink::None,
            mla_send_once: false,
            mode: TransferMode::Push,
        }
    }
}

/// Per transfer, shared with the dispatcher (which fences it and routes pull answers).
#[derive(Default)]
struct Shared {
    /// Held across every write: a fence takes it, so no write is in flight once it holds.
    state: tokio::sync::Mutex<Option<String>>,
    /// Pull: the receiver's answers.
    pull: Mutex<PullState>,
    /// Woken on every pull answer.
    answered: Notify,
}

/// Pull mode: what the receiver answered.
#[derive(Default)]
struct PullState {
    /// Per offered chunk: `Pulled` (Ok) or `PullErr` (the reason).
    answers: HashMap<u64, std::result::Result<(), String>>,
    /// The receiver acknowledged our cancel: no read of the request is in flight.
    cancel_acked: bool,
}

/// A call waiting for its answer. Only the peer it went to, answering for its request, may
/// complete it: call ids restart with every sender process, so an answer meant for another
/// (a grant a receiver deferred for this sender's previous incarnation, say) must not pass
/// for ours.
struct Call {
    peer: PeerId,
    req_id: String,
    answer: oneshot::Sender<PdMsg>,
}

/// The waiter of call `call` when `peer` may answer it for `req_id`; a mismatch leaves the
/// call waiting.
fn take_call(
    inner: &Inner,
    call: u64,
    peer: &PeerId,
    req_id: &str,
) -> Option<oneshot::Sender<PdMsg>> {
    let mut calls = lock(&inner.calls);
    match calls.get(&call) {
        Some(c) if c.peer == *peer && c.req_id == req_id => calls.remove(&call).map(|c| c.answer),
        Some(c) => {
            tracing::warn!(
                %peer, call, req_id, expected_peer = %c.peer, expected_req = %c.req_id,
                "dropping an answer to a call that is not this peer's or this request's"
            );
            None
        }
        None => None,
    }
}

struct Inner {
    channel: Channel,
    cfg: SenderConfig,
    staging: Region,
    free_slots: Mutex<Vec<usize>>,
    slots: Semaphore,
    calls: Mutex<HashMap<u64, Call>>,
    transfers: Mutex<HashMap<(PeerId, String), Arc<Shared>>>,
    next_call: AtomicU64,
}

/// One sender rank.
pub struct PdSender {
    inner: Arc<Inner>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for PdSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdSender")
            .field("rank", &self.inner.cfg.rank)
            .finish()
    }
}

impl Drop for PdSender {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl PdSender {
    /// Creates the channel and staging memory and starts the dispatcher.
    pub async fn start(cfg: SenderConfig) -> Result<PdSender> {
        cfg.spec.validate().map_err(PdError::Config)?;
        if cfg.mla_send_once && !cfg.spec.layout.is_mla() {
            return Err(PdError::Config(format!(
                "mla_send_once needs the MLA layout (identical KV on every rank), not {}",
                cfg.spec.layout
            )));
        }
        if cfg.rank >= cfg.world_size.max(1) {
            return Err(PdError::Config(format!(
                "rank {} outside a world of {} ranks",
                cfg.rank, cfg.world_size
            )));
        }
        let page = cfg.spec.page_bytes() as usize;
        let n = cfg.staging_chunks.max(1);
        let mut channel_cfg = cfg.channel.clone();
        // Peers whose chunk keys differ refuse each other at the handshake.
        channel_cfg.compat = crate::key::with_key_scheme(&channel_cfg.compat);
        let channel = Channel::new(channel_cfg)
            .await
            .map_err(|e| PdError::Config(e.to_string()))?;
        let staging = Region::alloc(page * n, page).map_err(|e| PdError::Config(e.to_string()))?;
        channel
            .register(&staging, Grant::AllPeers)
            .map_err(|e| PdError::Config(e.to_string()))?;
        let inner = Arc::new(Inner {
            channel,
            cfg,
            staging,
            free_slots: Mutex::new((0..n).collect()),
            slots: Semaphore::new(n),
            calls: Mutex::new(HashMap::new()),
            transfers: Mutex::new(HashMap::new()),
            next_call: AtomicU64::new(1),
        });
        let task = tokio::spawn(dispatch(inner.clone()));
        Ok(PdSender { inner, task })
    }

    /// The channel (to register engine memory for [`Transfer::send_chunk_from`]).
    pub fn channel(&self) -> &Channel {
        &self.inner.channel
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.inner.cfg.rank
    }

    /// Whether this rank only reports and leaves sending to rank 0 (`mla_send_once` with
    /// more than one rank).
    pub fn follows(&self) -> bool {
        let c = &self.inner.cfg;
        c.mla_send_once && c.world_size > 1 && c.rank != 0
    }

    /// Transfers the sender tracks: begun and not yet finished, cancelled or dropped. A
    /// `begin` that failed leaves none behind.
    pub fn in_flight(&self) -> usize {
        lock(&self.inner.transfers).len()
    }

    /// Registers engine memory so chunks can be written (push) or offered (pull) from it
    /// without a copy. Register it before the first request to a receiver: the grant of a
    /// region registered while a session is up reaches the receiver over the channel's
    /// control connection, not ordered with the offers (a pull receiver waits for it, up to
    /// the channel's op deadline, before it fails the read).
    pub fn register(&self, region: &Region) -> Result<()> {
        self.inner
            .channel
            .register(region, Grant::AllPeers)
            .map_err(|e| PdError::Config(e.to_string()))
    }

    /// Starts a request: connects (lazily), reserves pages for all its chunks on the
    /// receiver, and returns the transfer to hand chunks to. On failure the `KvFailed`
    /// outcome has been sent and the error says why.
    pub async fn begin(&self, spec: &DisaggSpec, tokens: &[u32]) -> Result<Transfer> {
        let r = self.begin_inner(spec, tokens).await;
        if let Err(e) = &r {
            self.inner.cfg.outcomes.emit(Outcome::KvFailed {
                req_id: spec.req_id.clone(),
                rank: self.inner.cfg.rank,
                reason: e.to_string(),
            });
        }
        r
    }

    async fn begin_inner(&self, ds: &DisaggSpec, tokens: &[u32]) -> Result<Transfer> {
        let cfg = &self.inner.cfg;
        let n_tokens = tokens.len() as u64;
        let chunks = cfg.spec.chunks_for(n_tokens);
        let addr = receiver_addr(cfg, ds)?;
        let mut t = Transfer::new(self.inner.clone(), ds.req_id.clone(), n_tokens);
        if self.follows() {
            // Rank 0 sends the (identical) KV for every rank: nothing to write here.
            t.sent = vec![true; chunks as usize];
            t.skipped = chunks;
            t.sent_by = Some(0);
            return Ok(t);
        }
        if chunks == 0 {
            // Nothing to move; finish() reports KvReady with 0 chunks.
            return Ok(t);
        }
        match t.reserve(&addr, tokens, chunks).await {
            Ok(()) => Ok(t),
            Err(e) => {
                // `begin` reports the failure: dropping the transfer must not again.
                t.done = true;
                Err(e)
            }
        }
    }

    /// Closes the channel: sessions end (receivers release unfinished requests) and the
    /// dispatcher stops.
    pub async fn close(&self) {
        self.inner.channel.close().await;
        self.task.abort();
    }
}

/// The receiver rank's channel address, from the request's `disagg_spec`.
fn receiver_addr(cfg: &SenderConfig, ds: &DisaggSpec) -> Result<String> {
    let port = ds
        .receiver_init_port
        .get(cfg.rank as usize)
        .ok_or_else(|| PdError::Invalid {
            req_id: ds.req_id.clone(),
            step: PdStep::Connect,
            detail: format!(
                "disagg_spec has {} init ports, none for rank {}",
                ds.receiver_init_port.len(),
                cfg.rank
            ),
        })?;
    Ok(format!("{}:{port}", ds.receiver_host))
}

/// A request's refusal by the receiver's allocator, as the error `begin` returns.
fn alloc_refused(
    req_id: String,
    peer: &PeerId,
    reason: String,
    never_fits: Option<(u64, u64)>,
    page_bytes: u64,
) -> PdError {
    match never_fits {
        Some((needed, total)) => PdError::NeverFits {
            req_id,
            peer: peer.to_string(),
            needed_pages: needed,
            total_pages: total,
            needed_bytes: needed.saturating_mul(page_bytes),
            total_bytes: total.saturating_mul(page_bytes),
        },
        None => PdError::Refused {
            req_id,
            peer: peer.to_string(),
            step: PdStep::Alloc,
            reason,
        },
    }
}

/// One request on one rank, between [`PdSender::begin`] and [`Transfer::finish`].
/// Dropping it unfinished reports `KvFailed` and releases the receiver's pages.
pub struct Transfer {
    inner: Arc<Inner>,
    shared: Arc<Shared>,
    req_id: String,
    /// The session with the receiver (and so the receiver), once connected: writes and
    /// notes skip the channel's per-call lookup, and none of them reaches a later session.
    link: Option<kvbridge::PeerLink>,
    region: RegionId,
    page_bytes: u64,
    pages: Vec<u32>,
    /// Per chunk: written, or held by the receiver already.
    sent: Vec<bool>,
    tokens: u64,
    bytes: u64,
    skipped: u64,
    /// Set when another rank sends this rank's KV (MLA send-once).
    sent_by: Option<u32>,
    done: bool,
    /// Pull mode.
    pull: bool,
    /// Pull: per chunk, offered to the receiver.
    offered: Vec<bool>,
    /// Pull: the regions offered from (kept alive until every read of them resolved).
    regions: Vec<Region>,
    /// Push: the confirmation asked for ahead of the writes ([`Transfer::prepare_finish`]),
    /// collected by [`Transfer::finish`].
    early: Option<EarlyFinish>,
}

/// A `FinishWhenLanded` sent ahead of the writes.
struct EarlyFinish {
    /// Its call id (an entry in the sender's calls until answered or forgotten).
    call: u64,
    /// The receiver's answer.
    answer: oneshot::Receiver<PdMsg>,
    /// The notification itself, until the receiver confirmed it arrived.
    queued: kvbridge::QueuedNotify,
}

impl std::fmt::Debug for Transfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transfer")
            .field("req_id", &self.req_id)
            .field("chunks", &self.pages.len())
            .field("done", &self.done)
            .finish()
    }
}

/// What a finished transfer moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Chunks of the request.
    pub chunks: u64,
    /// Chunks skipped because the receiver held them.
    pub skipped: u64,
    /// Bytes written.
    pub bytes: u64,
    /// Set when another rank sent this rank's KV (MLA send-once): that rank.
    pub sent_by: Option<u32>,
}

/// Opening a transfer: the steps of [`PdSender::begin`].
impl Transfer {
    /// A transfer of `tokens` tokens, with no session and no pages yet.
    fn new(inner: Arc<Inner>, req_id: String, tokens: u64) -> Transfer {
        let page_bytes = inner.cfg.spec.page_bytes();
        let pull = inner.cfg.mode == TransferMode::Pull;
        Transfer {
            inner,
            shared: Arc::new(Shared::default()),
            req_id,
            link: None,
            region: RegionId([0; 16]),
            page_bytes,
            pages: Vec::new(),
            sent: Vec::new(),
            tokens,
            bytes: 0,
            skipped: 0,
            sent_by: None,
            done: false,
            pull,
            offered: Vec::new(),
            regions: Vec::new(),
            early: None,
        }
    }

    /// Connects to the receiver at `addr` and reserves its pages for the request's `chunks`
    /// chunks. When the receiver may have granted them and the answer is not taken, it is
    /// told to let go.
    async fn reserve(&mut self, addr: &str, tokens: &[u32], chunks: u64) -> Result<()> {
        let (peer, link) = self.connect(addr).await?;
        // Known to the dispatcher before the receiver can answer, so a fence always finds it.
        lock(&self.inner.transfers)
            .insert((peer.clone(), self.req_id.clone()), self.shared.clone());
        self.link = Some(link);
        let msg = self.alloc_msg(tokens);
        let deadline = self.inner.cfg.alloc_deadline;
        let taken = match self.call(PdStep::Alloc, msg, deadline).await {
            Ok(reply) => self.take_grant(&peer, reply, chunks).await,
            Err(e) => {
                // The receiver may still grant later: tell it to let go (it also drops a
                // waiting allocation). Ordered after nothing, since nothing was written.
                self.cancel_on_receiver().await;
                Err(e)
            }
        };
        if taken.is_err() {
            // A transfer that never began is no longer the dispatcher's to find.
            lock(&self.inner.transfers).remove(&(peer, self.req_id.clone()));
        }
        taken
    }

    /// Connects to the receiver at `addr` within the step deadline, and takes the session
    /// that every call of this transfer goes over (they fail once it ends).
    async fn connect(&self, addr: &str) -> Result<(PeerId, kvbridge::PeerLink)> {
        let inner = &self.inner;
        let deadline = inner.cfg.step_deadline;
        let peer = match tokio::time::timeout(deadline, inner.channel.connect(addr)).await {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                return Err(PdError::Transfer {
                    req_id: self.req_id.clone(),
                    peer: addr.to_string(),
                    step: PdStep::Connect,
                    source: Box::new(e),
                })
            }
            Err(_) => {
                return Err(PdError::Timeout {
                    req_id: self.req_id.clone(),
                    peer: addr.to_string(),
                    step: PdStep::Connect,
                    after: deadline,
                })
            }
        };
        let link = inner
            .channel
            .link(&peer)
            .await
            .map_err(|e| PdError::Transfer {
                req_id: self.req_id.clone(),
                peer: peer.to_string(),
                step: PdStep::Connect,
                source: Box::new(e),
            })?;
        Ok((peer, link))
    }

    /// The allocation request: a key per chunk, by which the receiver finds the chunks it
    /// holds already (its call id is set by [`Transfer::call`]).
    fn alloc_msg(&self, tokens: &[u32]) -> PdMsg {
        let cfg = &self.inner.cfg;
        let keys: Vec<u64> = chunk_keys(&cfg.model, cfg.world_size, cfg.rank, &cfg.spec, tokens)
            .into_iter()
            .map(|k| k.hash)
            .collect();
        PdMsg::Alloc {
            call: 0,
            req_id: self.req_id.clone(),
            incarnation: self.inner.channel.incarnation().0,
            spec: cfg.spec,
            keys,
            tokens: self.tokens,
            pull: self.pull,
        }
    }

    /// Takes the receiver's answer to the allocation: a grant of one page per chunk (some
    /// held already) becomes this transfer's; anything else is the error, and a grant that
    /// is not taken is let go on the receiver.
    async fn take_grant(&mut self, peer: &PeerId, reply: PdMsg, chunks: u64) -> Result<()> {
        let want_bytes = self.inner.cfg.spec.page_bytes();
        match reply {
            PdMsg::AllocOk {
                region,
                page_bytes,
                pages,
                held,
                ..
            } => {
                if page_bytes != want_bytes
                    || pages.len() as u64 != chunks
                    || held.len() as u64 != chunks
                {
                    self.cancel_on_receiver().await;
                    return Err(PdError::Protocol {
                        peer: peer.to_string(),
                        detail: format!(
                            "grant of {} pages of {page_bytes} bytes for {chunks} chunks of {want_bytes}",
                            pages.len(),
                        ),
                    });
                }
                self.region = RegionId(region);
                self.offered = vec![false; pages.len()];
                self.pages = pages;
                self.skipped = held.iter().filter(|h| **h).count() as u64;
                self.sent = held;
                Ok(())
            }
            PdMsg::AllocErr {
                reason,
                never_fits,
                page_bytes,
                ..
            } => {
                let req_id = self.req_id.clone();
                Err(alloc_refused(req_id, peer, reason, never_fits, page_bytes))
            }
            other => {
                self.cancel_on_receiver().await;
                Err(PdError::Protocol {
                    peer: peer.to_string(),
                    detail: format!("unexpected answer to an allocation: {other:?}"),
                })
            }
        }
    }
}

impl Transfer {
    /// The request id.
    pub fn req_id(&self) -> &str {
        &self.req_id
    }

    /// Chunks of the request.
    pub fn chunks(&self) -> u64 {
        self.inner.cfg.spec.chunks_for(self.tokens)
    }

    /// Whether chunk `index` must still be sent (false when the receiver already holds it,
    /// or when another rank sends it: MLA send-once).
    pub fn needs(&self, index: u64) -> bool {
        self.sent.get(index as usize).is_some_and(|s| !s)
    }

    /// Bytes of chunk `index` (the last one is usually partial).
    pub fn chunk_bytes(&self, index: u64) -> u64 {
        self.inner.cfg.spec.chunk_bytes_at(index, self.tokens)
    }

    /// One request/response over notify, correlated by call id, under `deadline`.
    async fn call(&self, step: PdStep, mut msg: PdMsg, deadline: Duration) -> Result<PdMsg> {
        let inner = &self.inner;
        let link = self.link(step)?;
        let peer = link.peer().clone();
        let call = inner.next_call.fetch_add(1, Ordering::Relaxed);
        match &mut msg {
            PdMsg::Alloc { call: c, .. } | PdMsg::Finish { call: c, .. } => *c = call,
            _ => {}
        }
        let (tx, rx) = oneshot::channel();
        lock(&inner.calls).insert(
            call,
            Call {
                peer: peer.clone(),
                req_id: self.req_id.clone(),
                answer: tx,
            },
        );
        let run = async {
            link.notify(&msg.encode())
                .await
                .map_err(|e| PdError::Transfer {
                    req_id: self.req_id.clone(),
                    peer: peer.to_string(),
                    step,
                    source: Box::new(e),
                })?;
            rx.await.map_err(|_| PdError::Cancelled {
                req_id: self.req_id.clone(),
                step,
                reason: "the sender is closing".into(),
            })
        };
        let r = tokio::time::timeout(deadline, run).await;
        lock(&inner.calls).remove(&call);
        match r {
            Ok(r) => r,
            Err(_) => Err(PdError::Timeout {
                req_id: self.req_id.clone(),
                peer: peer.to_string(),
                step,
                after: deadline,
            }),
        }
    }

    fn invalid(&self, step: PdStep, detail: impl Into<String>) -> PdError {
        PdError::Invalid {
            req_id: self.req_id.clone(),
            step,
            detail: detail.into(),
        }
    }

    fn check_chunk(&self, index: u64, len: usize) -> Result<()> {
        if self.done {
            return Err(self.invalid(PdStep::Write, "the transfer has already ended"));
        }
        if index >= self.chunks() {
            return Err(self.invalid(
                PdStep::Write,
                format!("chunk {index} of a request with {} chunks", self.chunks()),
            ));
        }
        let want = self.chunk_bytes(index);
        if len as u64 != want {
            return Err(self.invalid(
                PdStep::Write,
                format!("chunk {index} has {len} bytes, its layout needs {want}"),
            ));
        }
        Ok(())
    }

    /// Copies chunk `index` into staging memory and moves it to its page on the receiver
    /// (skipped when the receiver holds it already): writes it (push) or offers it and waits
    /// until the receiver read it (pull). Returns when it has landed. Any failure ends the
    /// transfer with `KvFailed`.
    pub async fn send_chunk(&mut self, index: u64, data: &[u8]) -> Result<()> {
        let r = self.send_chunk_inner(index, data).await;
        self.fail_on_err(r).await
    }

    async fn send_chunk_inner(&mut self, index: u64, data: &[u8]) -> Result<()> {
        self.check_chunk(index, data.len())?;
        if !self.needs(index) {
            return Ok(());
        }
        let inner = self.inner.clone();
        let deadline = inner.cfg.step_deadline;
        let permit = tokio::time::timeout(deadline, inner.slots.acquire())
            .await
            .map_err(|_| PdError::Timeout {
                req_id: self.req_id.clone(),
                peer: "local staging".into(),
                step: PdStep::Write,
                after: deadline,
            })?
            .map_err(|_| self.invalid(PdStep::Write, "the sender is closing"))?;
        let slot = lock(&inner.free_slots)
            .pop()
            .ok_or_else(|| self.invalid(PdStep::Write, "no staging slot despite a permit"))?;
        let page = inner.cfg.spec.page_bytes() as usize;
        let r = match inner.staging.write_at(slot * page, data) {
            Ok(()) if self.pull => {
                let r = async {
                    self.offer_inner(index, &inner.staging, slot * page).await?;
                    self.wait_pulled_inner(index).await
                }
                .await;
                // On failure the cancel (CancelAck, or the receiver disconnected) completes
                // before the slot can be reused: no read of it can still be served.
                self.fail_on_err(r).await
            }
            Ok(()) => {
                self.write_op(index, &inner.staging, slot * page, data.len())
                    .await
            }
            Err(e) => Err(self.invalid(PdStep::Write, e.to_string())),
        };
        lock(&inner.free_slots).push(slot);
        drop(permit);
        r
    }

    /// Moves chunk `index` straight from `region` (registered with
    /// [`PdSender::register`]) at `offset`: no copy. Push: writes it; pull: offers it and
    /// waits until the receiver read it. Returns when it has landed.
    pub async fn send_chunk_from(
        &mut self,
        index: u64,
        region: &Region,
        offset: usize,
    ) -> Result<()> {
        let r = async {
            let len = self.chunk_bytes(index) as usize;
            self.check_chunk(index, len)?;
            if !self.needs(index) {
                return Ok(());
            }
            if self.pull {
                self.offer_inner(index, region, offset).await?;
                return self.wait_pulled_inner(index).await;
            }
            self.write_op(index, region, offset, len).await
        }
        .await;
        self.fail_on_err(r).await
    }

    /// Pull mode: offers chunk `index`, held in `region` (registered with
    /// [`PdSender::register`]) at `offset`, and returns once the receiver has the offer; the
    /// receiver reads it when it can. The memory is the receiver's until
    /// [`Transfer::wait_pulled`] for that chunk, [`Transfer::finish`] or
    /// [`Transfer::cancel`] returned (also after a failure: the failed call returns only
    /// once no read of it can be served). In push mode this is
    /// [`Transfer::send_chunk_from`] (it returns once the chunk landed).
    pub async fn offer_chunk(&mut self, index: u64, region: &Region, offset: usize) -> Result<()> {
        if !self.pull {
            return self.send_chunk_from(index, region, offset).await;
        }
        let r = async {
            let len = self.chunk_bytes(index) as usize;
            self.check_chunk(index, len)?;
            if !self.needs(index) {
                return Ok(());
            }
            self.offer_inner(index, region, offset).await
        }
        .await;
        self.fail_on_err(r).await
    }

    async fn offer_inner(&mut self, index: u64, region: &Region, offset: usize) -> Result<()> {
        let len = self.chunk_bytes(index);
        if self.offered.get(index as usize) != Some(&false) {
            return Err(self.invalid(PdStep::Pull, format!("chunk {index} was offered already")));
        }
        if !region.contains(offset as u64, len) {
            return Err(self.invalid(
                PdStep::Pull,
                format!(
                    "chunk {index} of {len} bytes at {offset} lies outside the region of {} bytes",
                    region.len()
                ),
            ));
        }
        if let Some(why) = self.shared.state.lock().await.as_ref() {
            return Err(PdError::Cancelled {
                req_id: self.req_id.clone(),
                step: PdStep::Pull,
                reason: why.clone(),
            });
        }
        let peer = self.link(PdStep::Pull)?.peer().clone();
        let msg = PdMsg::Offer {
            req_id: self.req_id.clone(),
            incarnation: self.inner.channel.incarnation().0,
            index,
            region: region.id().0,
            offset: offset as u64,
            len,
        };
        // From here on the receiver may read it (even if the notify reports a failure).
        self.offered[index as usize] = true;
        if !self.regions.iter().any(|r| r.id() == region.id()) {
            self.regions.push(region.clone());
        }
        self.link(PdStep::Pull)?
            .notify(&msg.encode())
            .await
            .map_err(|e| PdError::Transfer {
                req_id: self.req_id.clone(),
                peer: peer.to_string(),
                step: PdStep::Pull,
                source: Box::new(e),
            })
    }

    /// The session with the receiver (set in `begin`); `step` names the call that needs it.
    fn link(&self, step: PdStep) -> Result<&kvbridge::PeerLink> {
        self.link
            .as_ref()
            .ok_or_else(|| self.invalid(step, "no session"))
    }

    /// The receiver, once connected.
    fn peer(&self) -> Option<&PeerId> {
        self.link.as_ref().map(kvbridge::PeerLink::peer)
    }

    /// Pull mode: waits (up to the step deadline) until the receiver has read chunk
    /// `index`; its memory may then be reused. A failed read fails the transfer
    /// (`KvFailed`). Returns at once for a chunk the receiver held already, and in push mode.
    pub async fn wait_pulled(&mut self, index: u64) -> Result<()> {
        if !self.pull || !self.needs(index) {
            return Ok(());
        }
        let r = self.wait_pulled_inner(index).await;
        self.fail_on_err(r).await
    }

    async fn wait_pulled_inner(&mut self, index: u64) -> Result<()> {
        if self.offered.get(index as usize) != Some(&true) {
            return Err(self.invalid(PdStep::Pull, format!("chunk {index} was not offered")));
        }
        let d = self.inner.cfg.step_deadline;
        let until = tokio::time::Instant::now() + d;
        loop {
            let answered = self.shared.answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            let a = lock(&self.shared.pull).answers.get(&index).cloned();
            match a {
                Some(Ok(())) => {
                    self.sent[index as usize] = true;
                    self.bytes += self.chunk_bytes(index);
                    return Ok(());
                }
                Some(Err(reason)) => {
                    return Err(PdError::Refused {
                        req_id: self.req_id.clone(),
                        peer: self.peer_name(),
                        step: PdStep::Pull,
                        reason,
                    })
                }
                None => {}
            }
            if tokio::time::timeout_at(until, answered).await.is_err() {
                return Err(PdError::Timeout {
                    req_id: self.req_id.clone(),
                    peer: self.peer_name(),
                    step: PdStep::Pull,
                    after: d,
                });
            }
        }
    }

    /// Pull: offered chunks the receiver has not answered yet (a read may be in flight).
    fn unanswered(&self) -> bool {
        let st = lock(&self.shared.pull);
        self.offered
            .iter()
            .enumerate()
            .any(|(i, o)| *o && !st.answers.contains_key(&(i as u64)))
    }

    async fn write_op(
        &mut self,
        index: u64,
        local: &Region,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let peer = self.link(PdStep::Write)?.peer().clone();
        let page = *self
            .pages
            .get(index as usize)
            .ok_or_else(|| self.invalid(PdStep::Write, "no page for the chunk"))?;
        let op = Op {
            local: local.clone(),
            local_offset: offset,
            remote: self.region,
            remote_offset: page as u64 * self.page_bytes,
            len,
        };
        // Held across the write: a fence waits for it, then no further write starts.
        let state = self.shared.state.lock().await;
        if let Some(why) = state.as_ref() {
            return Err(PdError::Cancelled {
                req_id: self.req_id.clone(),
                step: PdStep::Write,
                reason: why.clone(),
            });
        }
        self.link(PdStep::Write)?
            .write(&[op])
            .await
            .map_err(|e| self.write_failed(&peer, e))?;
        drop(state);
        tracing::debug!(target: TIMELINE, stage = "sender.write_done", id = %self.req_id, chunk = index);
        self.sent[index as usize] = true;
        self.bytes += len as u64;
        // Ordered after the write: the decoder may consume the chunk from now on. Posted
        // with no acknowledgement: the transfer's last answer (to `Finish`, which follows
        // the notes on the session, or the early finish's completion on the last note)
        // says they all arrived, a session lost meanwhile fails the next write or the
        // finish, and an acknowledgement per chunk cost the receiver a send and this
        // side a wake-up on the cores that copy the next chunk.
        let note = PdMsg::Written {
            req_id: self.req_id.clone(),
            incarnation: self.inner.channel.incarnation().0,
            index,
        };
        self.link(PdStep::Write)?
            .notify_posted(&note.encode())
            .await
            .map_err(|e| self.write_failed(&peer, e))?;
        Ok(())
    }

    fn write_failed(&self, peer: &PeerId, e: kvbridge::Error) -> PdError {
        PdError::Transfer {
            req_id: self.req_id.clone(),
            peer: peer.to_string(),
            step: PdStep::Write,
            source: Box::new(e),
        }
    }

    /// Push: asks the receiver for its confirmation of the whole transfer now, ahead of
    /// the writes, so that the round trip runs while prefill produces and writes the
    /// chunks instead of after the last write; [`Transfer::finish`] then only collects the
    /// answer. The receiver answers at once (if it still holds the request) and completes
    /// the request by itself when the last chunk's write lands: the note saying so follows
    /// each write on the session. `finish` does not wait for the notes to arrive (they
    /// are posted with no confirmation): were the session to fail before they do, the
    /// receiver ends the request as failed and reports `KvFailed` for it, and a decoder
    /// waiting for it gets a clear error. Every earlier failure is what it was: a fence or
    /// a lost session fails the next write, and `finish`.
    ///
    /// Does nothing in pull mode (the receiver reads, and knows when it is done), when
    /// nothing is left to send, or when called again.
    pub async fn prepare_finish(&mut self) -> Result<()> {
        let r = self.prepare_finish_inner().await;
        self.fail_on_err(r).await
    }

    async fn prepare_finish_inner(&mut self) -> Result<()> {
        if self.pull || self.done || self.early.is_some() || self.sent.iter().all(|s| *s) {
            return Ok(());
        }
        let Some(peer) = self.peer().cloned() else {
            return Ok(());
        };
        let call = self.inner.next_call.fetch_add(1, Ordering::Relaxed);
        let msg = PdMsg::FinishWhenLanded {
            call,
            req_id: self.req_id.clone(),
            incarnation: self.inner.channel.incarnation().0,
        };
        let link = self.link(PdStep::Finish)?;
        let (tx, answer) = oneshot::channel();
        lock(&self.inner.calls).insert(
            call,
            Call {
                peer: peer.clone(),
                req_id: self.req_id.clone(),
                answer: tx,
            },
        );
        let queued = link.notify_queued(&msg.encode()).await;
        match queued {
            Ok(queued) => {
                self.early = Some(EarlyFinish {
                    call,
                    answer,
                    queued,
                });
                Ok(())
            }
            Err(e) => {
                lock(&self.inner.calls).remove(&call);
                Err(PdError::Transfer {
                    req_id: self.req_id.clone(),
                    peer: peer.to_string(),
                    step: PdStep::Finish,
                    source: Box::new(e),
                })
            }
        }
    }

    /// Tells the receiver every chunk landed, waits for its confirmation, and reports
    /// `KvReady`. Fails (with `KvFailed`) when a chunk was not handed over. After
    /// [`Transfer::prepare_finish`] the confirmation was asked for already, and this
    /// collects it.
    pub async fn finish(mut self) -> Result<Summary> {
        let r = self.finish_inner().await;
        let r = self.fail_on_err(r).await;
        if let Ok(s) = &r {
            self.done = true;
            self.forget();
            self.inner.cfg.outcomes.emit(Outcome::KvReady {
                req_id: self.req_id.clone(),
                rank: self.inner.cfg.rank,
                chunks: s.chunks,
                bytes: s.bytes,
                sent_by: s.sent_by,
            });
        }
        r
    }

    async fn finish_inner(&mut self) -> Result<Summary> {
        if self.done {
            return Err(self.invalid(PdStep::Finish, "the transfer has already ended"));
        }
        let handed = |i: usize| self.sent[i] || self.offered.get(i) == Some(&true);
        if let Some(i) = (0..self.sent.len()).find(|&i| !handed(i)) {
            return Err(self.invalid(
                PdStep::Finish,
                format!("chunk {i} of {} was never handed over", self.sent.len()),
            ));
        }
        // Pull: the receiver answers finish only once it read every offered chunk.
        let pulled_late: u64 = (0..self.sent.len())
            .filter(|&i| !self.sent[i])
            .map(|i| self.chunk_bytes(i as u64))
            .sum();
        let summary = Summary {
            chunks: self.chunks(),
            skipped: self.skipped,
            bytes: self.bytes + pulled_late,
            sent_by: self.sent_by,
        };
        let Some(peer) = self.peer().cloned() else {
            return Ok(summary); // an empty prompt: nothing was allocated
        };
        if let Some(early) = self.early.take() {
            let answer = self.collect_early(&peer, early).await?;
            return self.finish_result(answer, summary);
        }
        let msg = PdMsg::Finish {
            call: 0,
            req_id: self.req_id.clone(),
            incarnation: self.inner.channel.incarnation().0,
        };
        // `Finish` follows the `Written` notes on the session (notifications keep their
        // order, and the receiver handles them in order), so its answer also says that
        // every note arrived; a note lost with the session fails the call.
        let answer = self
            .call(PdStep::Finish, msg, self.inner.cfg.step_deadline)
            .await?;
        self.finish_result(answer, summary)
    }

    /// Waits for the answer to an early finish, and for the confirmation of the
    /// `FinishWhenLanded` itself, under the step deadline.
    async fn collect_early(&mut self, peer: &PeerId, early: EarlyFinish) -> Result<PdMsg> {
        let EarlyFinish {
            call,
            answer,
            queued,
        } = early;
        let deadline = self.inner.cfg.step_deadline;
        let confirmed = async {
            queued
                .delivered()
                .await
                .map_err(|e| self.write_failed(peer, e))
        };
        let answered = async {
            answer.await.map_err(|_| PdError::Cancelled {
                req_id: self.req_id.clone(),
                step: PdStep::Finish,
                reason: "the sender is closing".into(),
            })
        };
        let r = tokio::time::timeout(deadline, async {
            let (c, a) = tokio::join!(confirmed, answered);
            c.and(a)
        })
        .await;
        lock(&self.inner.calls).remove(&call);
        r.unwrap_or_else(|_| {
            Err(PdError::Timeout {
                req_id: self.req_id.clone(),
                peer: peer.to_string(),
                step: PdStep::Finish,
                after: deadline,
            })
        })
    }

    /// The transfer's result from the receiver's answer to its finish.
    fn finish_result(&self, answer: PdMsg, summary: Summary) -> Result<Summary> {
        match answer {
            PdMsg::FinishOk { .. } => Ok(summary),
            PdMsg::FinishErr { reason, .. } => Err(PdError::Refused {
                req_id: self.req_id.clone(),
                peer: self.peer_name(),
                step: PdStep::Finish,
                reason,
            }),
            other => Err(PdError::Protocol {
                peer: self.peer_name(),
                detail: format!("unexpected answer to finish: {other:?}"),
            }),
        }
    }

    fn peer_name(&self) -> String {
        self.peer().map(|p| p.to_string()).unwrap_or_default()
    }

    /// Gives the request up: reports `KvFailed` with `reason` and releases the receiver's
    /// pages.
    pub async fn cancel(mut self, reason: &str) {
        if !self.done {
            let e = PdError::Cancelled {
                req_id: self.req_id.clone(),
                step: PdStep::Cancel,
                reason: reason.to_string(),
            };
            let _ = self.fail_on_err::<()>(Err(e)).await;
        }
    }

    /// On error: ends the transfer, releases the receiver's pages and reports `KvFailed`
    /// (once).
    async fn fail_on_err<T>(&mut self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            if !self.done {
                self.done = true;
                self.cancel_on_receiver().await;
                self.forget();
                self.inner.cfg.outcomes.emit(Outcome::KvFailed {
                    req_id: self.req_id.clone(),
                    rank: self.inner.cfg.rank,
                    reason: e.to_string(),
                });
            }
        }
        r
    }

    fn forget(&self) {
        if let Some(e) = &self.early {
            lock(&self.inner.calls).remove(&e.call);
        }
        if let Some(p) = self.peer() {
            lock(&self.inner.transfers).remove(&(p.clone(), self.req_id.clone()));
        }
    }

    /// Push: best effort, bounded (the receiver also releases on its TTL or when our
    /// session ends). Pull with a chunk offered and not answered: returns only once no read
    /// of the request can be served any more (the receiver's `CancelAck`, or, when it does
    /// not answer within the step deadline, our session with it torn down).
    async fn cancel_on_receiver(&self) {
        let Some(peer) = self.peer() else { return };
        if self.pull && self.unanswered() {
            pull_cancel(&self.inner, &self.shared, peer, &self.req_id).await;
            return;
        }
        let msg = PdMsg::Cancel {
            req_id: self.req_id.clone(),
            incarnation: self.inner.channel.incarnation().0,
            pull: self.pull,
        };
        let d = self.inner.cfg.step_deadline;
        if let Some(l) = &self.link {
            // On this session only: when it ended, the receiver let go of the request anyway.
            let _ = tokio::time::timeout(d, l.notify(&msg.encode())).await;
        }
    }
}

/// Pull: cancels `req_id` on `peer` and returns once none of the receiver's reads of it can
/// be served: on its `CancelAck` (or once every offered chunk was answered), or after
/// disconnecting a receiver that does not answer within the step deadline
/// ([`Channel::disconnect`] returns once the session is torn down).
async fn pull_cancel(inner: &Arc<Inner>, shared: &Arc<Shared>, peer: &PeerId, req_id: &str) {
    let d = inner.cfg.step_deadline;
    let until = tokio::time::Instant::now() + d;
    let msg = PdMsg::Cancel {
        req_id: req_id.to_string(),
        incarnation: inner.channel.incarnation().0,
        pull: true,
    };
    let sent = tokio::time::timeout_at(until, inner.channel.notify(peer, &msg.encode())).await;
    if matches!(sent, Ok(Ok(()))) {
        loop {
            let answered = shared.answered.notified();
            tokio::pin!(answered);
            answered.as_mut().enable();
            if lock(&shared.pull).cancel_acked {
                return;
            }
            if tokio::time::timeout_at(until, answered).await.is_err() {
                break;
            }
        }
    }
    let reason = format!("request {req_id}: no cancel acknowledgement within {d:?}");
    tracing::warn!(%peer, req_id, "receiver did not acknowledge a pull cancel; disconnecting it");
    if let Err(e) = inner.channel.disconnect(peer, &reason).await {
        // Gone already, or going: either way its reads of us are over once the session ends.
        tracing::warn!(%peer, req_id, error = %e, "disconnecting a silent receiver failed");
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let rt = tokio::runtime::Handle::try_current().ok();
        // Pull with reads possibly in flight: the cancel task below forgets the transfer
        // once none can be served (without a runtime nothing can wait: forget now).
        let pull_pending = self.pull && self.unanswered() && rt.is_some();
        if !pull_pending {
            self.forget();
        }
        let reason = format!(
            "request {}: transfer dropped before finish (engine aborted the request)",
            self.req_id
        );
        self.inner.cfg.outcomes.emit(Outcome::KvFailed {
            req_id: self.req_id.clone(),
            rank: self.inner.cfg.rank,
            reason,
        });
        if let (Some(peer), Some(rt)) = (self.peer().cloned(), rt) {
            if pull_pending {
                // Reads of the offered memory may be in flight: the task owns the regions
                // (they stay valid) until none can be served any more.
                let (inner, shared) = (self.inner.clone(), self.shared.clone());
                let regions = std::mem::take(&mut self.regions);
                let req_id = self.req_id.clone();
                rt.spawn(async move {
                    pull_cancel(&inner, &shared, &peer, &req_id).await;
                    lock(&inner.transfers).remove(&(peer, req_id));
                    drop(regions);
                });
                return;
            }
            let ch = self.inner.channel.clone();
            let msg = PdMsg::Cancel {
                req_id: self.req_id.clone(),
                incarnation: ch.incarnation().0,
                pull: self.pull,
            };
            let d = self.inner.cfg.step_deadline;
            rt.spawn(async move {
                let _ = tokio::time::timeout(d, ch.notify(&peer, &msg.encode())).await;
            });
        }
    }
}

/// Routes the receivers' answers to their calls and serves fences.
async fn dispatch(inner: Arc<Inner>) {
    while let Some(n) = inner.channel.recv_notification().await {
        let msg = match PdMsg::decode(&n.data) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(peer = %n.peer, error = %e, "dropping a malformed PD message");
                continue;
            }
        };
        match msg {
            PdMsg::AllocOk {
                call, ref req_id, ..
            } => {
                let waiter = take_call(&inner, call, &n.peer, req_id);
                let orphan = match waiter {
                    Some(w) => w.send(msg.clone()).is_err(),
                    None => true,
                };
                if orphan {
                    // Nobody waits any more (the call passed its deadline): let go of the
                    // pages. Nothing was written for this grant.
                    let cancel = PdMsg::Cancel {
                        req_id: req_id.clone(),
                        incarnation: inner.channel.incarnation().0,
                        pull: inner.cfg.mode == TransferMode::Pull,
                    };
                    let ch = inner.channel.clone();
                    let d = inner.cfg.step_deadline;
                    tokio::spawn(async move {
                        let _ = tokio::time::timeout(d, ch.notify(&n.peer, &cancel.encode())).await;
                    });
                }
            }
            PdMsg::AllocErr {
                call, ref req_id, ..
            }
            | PdMsg::FinishOk {
                call, ref req_id, ..
            }
            | PdMsg::FinishErr {
                call, ref req_id, ..
            } => {
                if let Some(w) = take_call(&inner, call, &n.peer, req_id) {
                    let _ = w.send(msg);
                }
            }
            PdMsg::Pulled { req_id, index } => {
                pull_answer(&inner, &n.peer, &req_id, |st| {
                    st.answers.insert(index, Ok(()));
                });
            }
            PdMsg::PullErr {
                req_id,
                index,
                reason,
            } => {
                pull_answer(&inner, &n.peer, &req_id, |st| {
                    st.answers.insert(index, Err(reason));
                });
            }
            PdMsg::CancelAck { req_id } => {
                pull_answer(&inner, &n.peer, &req_id, |st| st.cancel_acked = true);
            }
            PdMsg::Fence { req_id } => {
                let shared = lock(&inner.transfers)
                    .get(&(n.peer.clone(), req_id.clone()))
                    .cloned();
                let inner = inner.clone();
                tokio::spawn(async move {
                    if let Some(s) = shared {
                        // Waits for a write in flight (bounded by its own deadline), then no
                        // write of this request starts again.
                        let mut st = s.state.lock().await;
                        st.get_or_insert_with(|| "cancelled by the receiver".to_string());
                    }
                    let ack = PdMsg::FenceAck {
                        req_id,
                        incarnation: inner.channel.incarnation().0,
                    };
                    let d = inner.cfg.step_deadline;
                    let _ =
                        tokio::time::timeout(d, inner.channel.notify(&n.peer, &ack.encode())).await;
                });
            }
            other => {
                tracing::warn!(peer = %n.peer, msg = ?other, "unexpected PD message on a sender");
            }
        }
    }
}

/// Records a pull answer for the transfer it belongs to (none: it ended, nothing waits).
fn pull_answer(inner: &Arc<Inner>, peer: &PeerId, req_id: &str, f: impl FnOnce(&mut PullState)) {
    let shared = lock(&inner.transfers)
        .get(&(peer.clone(), req_id.to_string()))
        .cloned();
    if let Some(s) = shared {
        f(&mut lock(&s.pull));
        s.answered.notify_waiters();
    }
}
