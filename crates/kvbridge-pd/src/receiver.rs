//! The receiver (decoder side) of one rank: a listening [`Channel`], one registered paged
//! buffer, the [`PageAllocator`] that owns its pages, and a driver task that answers
//! senders, applies deadlines, and reacts to sessions going down.

use crate::alloc::{
    AllocReq, Allocation, Counters, EndReason, Event, Owner, PageAllocator, ReadTicket, Refusal,
    ReqError, ReqState,
};
use crate::error::{PdError, PdStep, Result};
use crate::layout::KvSpec;
use crate::msg::PdMsg;
use crate::outcome::{Outcome, OutcomeSink};
use crate::windows::{Landing, PageWindows};
use kvbridge::{Channel, ChannelConfig, Grant, Op, PeerEvent, PeerId, PeerLink, Region, RegionId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{broadcast, mpsc, Notify};
use tokio::task::JoinHandle;

/// Configuration of one receiver rank.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// The channel (peer id, listen address, deadlines, test hooks).
    pub channel: ChannelConfig,
    /// This rank.
    pub rank: u32,
    /// Layout, dtype and chunk size (senders must match).
    pub spec: KvSpec,
    /// Buffer size in bytes (whole pages of one full chunk each are used).
    pub buffer_bytes: u64,
    /// How long an allocation that does not fit now may wait for pages.
    pub alloc_timeout: Duration,
    /// How long a request may hold pages without completing, and a complete one without
    /// being retrieved.
    pub ttl: Duration,
    /// Where to report requests whose sender failed or went silent (`KvFailed` on the
    /// sender's behalf). Off ([`OutcomeSink::None`]) by default: a live sender reports its
    /// own failures, and the proxy takes the first outcome per rank.
    pub failure_outcomes: OutcomeSink,
    /// Whether same-host senders may map the buffer (shared memory) or copy into it by
    /// address (cross-memory attach). On (the default), they are as fast as the host
    /// allows, and they reach the whole buffer: only senders over TCP are held to the pages
    /// reserved for their requests. Off, every sender goes over TCP and is held to them.
    pub direct_copies: bool,
    /// How long a sender may take to acknowledge a fence. A sender whose session is up but
    /// that does not answer (stuck, or broken) is then disconnected: once
    /// [`Channel::disconnect`] returns none of its writes can land, so its quarantined pages
    /// return (and its other unfinished requests end). Without this bound a silent but
    /// connected sender would hold its pages until its session died.
    pub fence_timeout: Duration,
}

impl ReceiverConfig {
    /// Defaults: 10 s allocation wait, 60 s TTL, no failure reports.
    pub fn new(channel: ChannelConfig, rank: u32, spec: KvSpec, buffer_bytes: u64) -> Self {
        Self {
            channel,
            rank,
            spec,
            buffer_bytes,
            alloc_timeout: Duration::from_secs(10),
            ttl: Duration::from_secs(60),
            failure_outcomes: OutcomeSink::None,
            direct_copies: true,
            fence_timeout: Duration::from_secs(10),
        }
    }
}

struct Inner {
    channel: Channel,
    region: Region,
    spec: KvSpec,
    page_bytes: u64,
    rank: u32,
    alloc: Mutex<PageAllocator>,
    /// Woken on every allocator change (retrieve waits) and to re-arm the driver's timer.
    changed: Notify,
    wake: Notify,
    outbox: Mutex<HashMap<PeerId, mpsc::UnboundedSender<Vec<u8>>>>,
    live: Mutex<HashMap<PeerId, u64>>,
    failures: OutcomeSink,
    fence_timeout: Duration,
    /// Events from places that must not send (a [`ChunkRef`] dropped anywhere): the driver
    /// applies them.
    deferred: Mutex<Vec<Event>>,
    /// Granted requests, for consumers that start as chunks land.
    granted: broadcast::Sender<GrantedRequest>,
    /// Requests that ended before they completed, most recent last (at most
    /// [`ENDED_KEPT`]), with why: a reader waiting for one of their chunks fails at once
    /// instead of at its deadline. Written only by [`apply`], under no other lock.
    ended: Mutex<EndedLog>,
    /// Which pages each sender may write (crate::windows).
    windows: Mutex<PageWindows>,
}

/// How many ended requests [`PdReceiver::wait_chunk`] remembers. A reader starts waiting
/// within moments of the grant; a thousand later failures are far beyond that.
pub const ENDED_KEPT: usize = 1024;

/// The bounded record of requests that ended before they completed.
#[derive(Default)]
struct EndedLog {
    order: std::collections::VecDeque<String>,
    why: HashMap<String, String>,
}

impl EndedLog {
    fn insert(&mut self, req_id: String, why: String) {
        if self.why.insert(req_id.clone(), why).is_none() {
            self.order.push_back(req_id);
        }
        while self.order.len() > ENDED_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.why.remove(&old);
            }
        }
    }

    /// A new grant under the same id starts afresh.
    fn forget(&mut self, req_id: &str) {
        if self.why.remove(req_id).is_some() {
            self.order.retain(|r| r != req_id);
        }
    }
}

/// A request whose pages were just reserved ([`PdReceiver::granted_requests`]): its chunks
/// land from now on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantedRequest {
    /// The request.
    pub req_id: String,
    /// Its prompt tokens.
    pub tokens: u64,
    /// Its chunks.
    pub chunks: u64,
}

/// One receiver rank. Dropping it stops the driver; call [`PdReceiver::close`] to end
/// sessions cleanly.
pub struct PdReceiver {
    inner: Arc<Inner>,
    task: JoinHandle<()>,
}

impl std::fmt::Debug for PdReceiver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PdReceiver")
            .field("rank", &self.inner.rank)
            .field("addr", &self.inner.channel.local_addr())
            .finish()
    }
}

impl Drop for PdReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PdReceiver {
    /// Binds the channel, allocates and registers the buffer, and starts the driver.
    pub async fn start(cfg: ReceiverConfig) -> Result<PdReceiver> {
        cfg.spec.validate().map_err(PdError::Config)?;
        if cfg.channel.listen_addr.is_none() {
            return Err(PdError::Config(
                "a PD receiver needs a listen address".into(),
            ));
        }
        let page_bytes = cfg.spec.page_bytes();
        let pages = cfg.spec.pages_in(cfg.buffer_bytes);
        if pages == 0 || pages > u32::MAX as u64 {
            return Err(PdError::Config(format!(
                "a buffer of {} bytes holds {pages} pages of {page_bytes} bytes ({}); need 1 to {}",
                cfg.buffer_bytes,
                cfg.spec,
                u32::MAX
            )));
        }
        let len = usize::try_from(pages * page_bytes)
            .map_err(|_| PdError::Config("buffer larger than the address space".into()))?;
        // The buffer first: when it cannot be had, nothing is bound yet (no port to release).
        let region =
            Region::alloc(len, page_bytes as usize).map_err(|e| PdError::Config(e.to_string()))?;
        let mut channel_cfg = cfg.channel.clone();
        // Peers whose chunk keys differ refuse each other at the handshake.
        channel_cfg.compat = crate::key::with_key_scheme(&channel_cfg.compat);
        let channel = Channel::new(channel_cfg)
            .await
            .map_err(|e| PdError::Config(e.to_string()))?;
        // Subscribe before anyone can connect: no session change is missed.
        let events = channel.peer_events();
        // Senders write only the pages reserved for their live push requests, and read
        // nothing (pull mode reads *their* memory).
        let grant = Grant::AllPeers.write_only().writes_in_windows();
        let grant = if cfg.direct_copies {
            grant.with_direct_copies()
        } else {
            grant
        };
        if let Err(e) = channel.register(&region, grant) {
            channel.close().await;
            return Err(PdError::Config(e.to_string()));
        }
        let inner = Arc::new(Inner {
            channel,
            region,
            spec: cfg.spec,
            page_bytes,
            rank: cfg.rank,
            alloc: Mutex::new(PageAllocator::new(pages as u32, cfg.alloc_timeout, cfg.ttl)),
            changed: Notify::new(),
            wake: Notify::new(),
            outbox: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
            failures: cfg.failure_outcomes,
            fence_timeout: cfg.fence_timeout,
            deferred: Mutex::new(Vec::new()),
            granted: broadcast::channel(1024).0,
            ended: Mutex::new(EndedLog::default()),
            windows: Mutex::new(PageWindows::default()),
        });
        let task = tokio::spawn(drive(inner.clone(), events));
        Ok(PdReceiver { inner, task })
    }

    /// The address senders connect to (`pd_peer_init_port`).
    pub fn local_addr(&self) -> Option<std::net::SocketAddr> {
        self.inner.channel.local_addr()
    }

    /// The channel (for stats and tests).
    pub fn channel(&self) -> &Channel {
        &self.inner.channel
    }

    /// Page counters; `leaked` must stay 0.
    pub fn counters(&self) -> Counters {
        self.lock().counters()
    }

    /// Page size in bytes (one full chunk).
    pub fn page_bytes(&self) -> u64 {
        self.inner.page_bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PageAllocator> {
        lock(&self.inner.alloc)
    }

    /// Waits until every chunk of `req_id` has landed, up to `deadline`. A request that
    /// ended before it completed fails the wait at once, naming why.
    pub async fn wait_complete(&self, req_id: &str, deadline: Duration) -> Result<()> {
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let state = self.lock().state(req_id);
            match state {
                Some(ReqState::Complete) => return Ok(()),
                Some(ReqState::Retrieving) => {
                    return Err(PdError::Invalid {
                        req_id: req_id.into(),
                        step: PdStep::Retrieve,
                        detail: "already being retrieved".into(),
                    })
                }
                Some(_) => {}
                None => {
                    if let Some(why) = self.ended(req_id) {
                        return Err(self.ended_error(req_id, why));
                    }
                }
            }
            if tokio::time::timeout_at(until, changed).await.is_err() {
                return Err(PdError::Timeout {
                    req_id: req_id.into(),
                    peer: "any sender".into(),
                    step: PdStep::Retrieve,
                    after: deadline,
                });
            }
        }
    }

    /// Waits (up to `deadline`) until `req_id` is complete, copies its KV out (one buffer
    /// per chunk, each exactly as long as that chunk) and returns its pages.
    pub async fn retrieve(&self, req_id: &str, deadline: Duration) -> Result<Vec<Vec<u8>>> {
        self.wait_complete(req_id, deadline).await?;
        let invalid = |e: ReqError| PdError::Invalid {
            req_id: req_id.into(),
            step: PdStep::Retrieve,
            detail: e.to_string(),
        };
        let (pages, tokens) = {
            let mut a = self.lock();
            let pages = a.begin_retrieve(req_id).map_err(invalid)?;
            (pages, a.tokens(req_id).unwrap_or(0))
        };
        let spec = self.inner.spec;
        let mut out = Vec::with_capacity(pages.len());
        let mut result = Ok(());
        for (i, p) in pages.iter().enumerate() {
            let mut buf = vec![0u8; spec.chunk_bytes_at(i as u64, tokens) as usize];
            if let Err(e) = self
                .inner
                .region
                .read_at(*p as usize * self.inner.page_bytes as usize, &mut buf)
            {
                result = Err(PdError::Invalid {
                    req_id: req_id.into(),
                    step: PdStep::Retrieve,
                    detail: e.to_string(),
                });
                break;
            }
            out.push(buf);
        }
        let ev = self
            .lock()
            .end_retrieve(Instant::now(), req_id)
            .map_err(invalid)?;
        apply(&self.inner, ev);
        result.map(|()| out)
    }

    /// Returns the pages of a complete request without copying its KV out (the decoder
    /// consumed it in place). Fails naming the request when it is not complete. A sender
    /// that asked for its finish ahead of the writes (`Transfer::prepare_finish`) reports
    /// `KvReady` once its last write landed; the request completes when this receiver reads
    /// that write's note, a moment later: wait for it first ([`PdReceiver::wait_complete`]).
    pub fn release(&self, req_id: &str) -> Result<()> {
        let invalid = |e: ReqError| PdError::Invalid {
            req_id: req_id.into(),
            step: PdStep::Retrieve,
            detail: e.to_string(),
        };
        let ev = {
            let mut a = self.lock();
            a.begin_retrieve(req_id).map_err(invalid)?;
            a.end_retrieve(Instant::now(), req_id).map_err(invalid)?
        };
        apply(&self.inner, ev);
        Ok(())
    }

    /// Requests granted from now on, as they are granted: a decoder can start consuming a
    /// request's chunks as they land ([`PdReceiver::chunk`]), before its decode request
    /// arrives. A subscriber that falls more than 1024 grants behind misses some (it sees
    /// `Lagged`) and must handle those requests when it meets them.
    pub fn granted_requests(&self) -> broadcast::Receiver<GrantedRequest> {
        self.inner.granted.subscribe()
    }

    /// Whether every chunk of `req_id` has landed (it is complete or being retrieved).
    pub fn is_complete(&self, req_id: &str) -> bool {
        matches!(
            self.lock().state(req_id),
            Some(ReqState::Complete | ReqState::Retrieving)
        )
    }

    /// The chunk key hashes of a live request, in order, as its sender computed them over
    /// the request's tokens ([`crate::chunk_keys`]): a decoder that is told a request id by
    /// an untrusted party can check, by computing the keys over its own prompt, that the KV
    /// is its prompt's before it waits for or uses any of it. `None` when the receiver holds
    /// no such request.
    pub fn keys(&self, req_id: &str) -> Option<Vec<u64>> {
        self.lock().keys(req_id).map(<[u64]>::to_vec)
    }

    /// Why `req_id` ended before it completed, if it did recently (see [`ENDED_KEPT`]) and
    /// no new request took its id since.
    pub fn ended(&self, req_id: &str) -> Option<String> {
        lock(&self.inner.ended).why.get(req_id).cloned()
    }

    fn ended_error(&self, req_id: &str, why: String) -> PdError {
        PdError::Refused {
            req_id: req_id.into(),
            peer: format!("receiver rank {}", self.inner.rank),
            step: PdStep::Retrieve,
            reason: format!("the request ended {why}"),
        }
    }

    /// Per chunk of a live request: whether it has landed and can be borrowed
    /// ([`PdReceiver::borrow_chunk`]). `None` when the receiver holds no such request.
    pub fn chunks_landed(&self, req_id: &str) -> Option<Vec<bool>> {
        self.lock().landed(req_id).map(<[bool]>::to_vec)
    }

    /// Waits until chunk `index` of `req_id` has landed, up to `deadline`. A request the
    /// receiver does not hold (yet) is waited for: its allocation may still come. A request
    /// that ended before it completed (its sender cancelled or failed, a fence, the TTL)
    /// fails the wait at once, naming why, rather than at the deadline.
    pub async fn wait_chunk(&self, req_id: &str, index: u64, deadline: Duration) -> Result<()> {
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let landed = self.lock().landed(req_id).map(<[bool]>::to_vec);
            if landed.is_none() {
                // Checked after the allocator: `apply` records the end before it wakes us.
                if let Some(why) = self.ended(req_id) {
                    return Err(
                        self.ended_error(req_id, format!("before chunk {index} landed: {why}"))
                    );
                }
            }
            if let Some(l) = landed {
                match l.get(index as usize) {
                    Some(true) => return Ok(()),
                    Some(false) => {}
                    None => {
                        return Err(PdError::Invalid {
                            req_id: req_id.into(),
                            step: PdStep::Retrieve,
                            detail: format!("chunk {index} of a request with {} chunks", l.len()),
                        })
                    }
                }
            }
            if tokio::time::timeout_at(until, changed).await.is_err() {
                return Err(PdError::Timeout {
                    req_id: req_id.into(),
                    peer: "any sender".into(),
                    step: PdStep::Retrieve,
                    after: deadline,
                });
            }
        }
    }

    /// Borrows chunk `index` of `req_id` in place, without copying: the returned
    /// [`ChunkRef`] holds exactly the chunk's bytes. The chunk must have landed (see
    /// [`PdReceiver::wait_chunk`]); the request need not be complete. Its page is pinned
    /// until the `ChunkRef` is dropped: whatever happens to the request meanwhile (release,
    /// cancel, TTL, sender failure), the page is not handed out again under the reader.
    pub fn borrow_chunk(&self, req_id: &str, index: u64) -> Result<ChunkRef> {
        let invalid = |e: ReqError| PdError::Invalid {
            req_id: req_id.into(),
            step: PdStep::Retrieve,
            detail: format!("chunk {index}: {e}"),
        };
        let mut a = self.lock();
        let tokens = a.tokens(req_id).ok_or_else(|| invalid(ReqError::Unknown))?;
        let page = a.pin_chunk(req_id, index).map_err(invalid)?;
        drop(a);
        let len = self.inner.spec.chunk_bytes_at(index, tokens) as usize;
        Ok(ChunkRef::new(self.inner.clone(), page, len))
    }

    /// Waits (up to `deadline`) for chunk `index` of `req_id` to land, then borrows it
    /// ([`PdReceiver::borrow_chunk`]).
    pub async fn chunk(&self, req_id: &str, index: u64, deadline: Duration) -> Result<ChunkRef> {
        self.wait_chunk(req_id, index, deadline).await?;
        self.borrow_chunk(req_id, index)
    }

    /// Runs `f` over a copy of chunk `index` of `req_id`; see [`PdReceiver::borrow_chunk`]
    /// (and [`ChunkRef`] for why it is a copy).
    pub fn with_chunk<R>(&self, req_id: &str, index: u64, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        let c = self.borrow_chunk(req_id, index)?;
        Ok(f(&c.to_vec()))
    }

    /// Borrows the chunk whose key hash is `key` (see [`crate::chunk_keys`]) if the buffer
    /// holds it filled (by any complete request), as `len` bytes (the chunk's length, which
    /// the caller knows from the layout: [`KvSpec::chunk_bytes_at`]). `None` when it is not
    /// held or `len` exceeds a page.
    pub fn borrow_key(&self, key: u64, len: usize) -> Option<ChunkRef> {
        if len as u64 > self.inner.page_bytes {
            return None;
        }
        let page = self.lock().pin_key(key)?;
        Some(ChunkRef::new(self.inner.clone(), page, len))
    }

    /// Cancels a request on the decoder side (abort): a waiting allocation is refused, a
    /// request being written is fenced (its pages return once no write can land), a
    /// complete one is released.
    pub fn cancel(&self, req_id: &str) -> Result<()> {
        let ev = self
            .lock()
            .cancel(Instant::now(), req_id)
            .map_err(|e| PdError::Invalid {
                req_id: req_id.into(),
                step: PdStep::Cancel,
                detail: e.to_string(),
            })?;
        apply(&self.inner, ev);
        Ok(())
    }

    /// Closes the channel (sessions end, so every quarantine resolves) and stops the driver.
    pub async fn close(&self) {
        self.inner.channel.close().await;
        self.task.abort();
    }
}

/// A chunk held in place in the receive buffer ([`PdReceiver::borrow_chunk`]). Its page is
/// pinned while the `ChunkRef` lives, so it is never handed to another request (nor read
/// into) under the reader; dropping it unpins the page (a page whose request ended
/// meanwhile returns then). It may be sent to another thread and outlive the
/// [`PdReceiver`].
///
/// The guarantee covers the PD protocol: senders only write pages granted to them, and a
/// chunk is borrowable only once its write (or read) landed. A peer that writes into the
/// buffer anyway is not prevented by the PD layer, so a `ChunkRef` never lends the bytes as
/// a `&[u8]` (which a racing write would make undefined behaviour): they are copied out
/// ([`ChunkRef::copy_into`], [`ChunkRef::to_vec`]), or taken as a raw pointer
/// ([`ChunkRef::as_ptr`]) by code that copies them itself (a DMA to the accelerator).
///
/// ```compile_fail
/// // A `ChunkRef` lends no reference to the receive buffer.
/// fn lend(c: &kvbridge_pd::ChunkRef) -> &[u8] {
///     c
/// }
/// ```
pub struct ChunkRef {
    inner: Arc<Inner>,
    page: u32,
    len: usize,
}

impl ChunkRef {
    fn new(inner: Arc<Inner>, page: u32, len: usize) -> ChunkRef {
        ChunkRef { inner, page, len }
    }

    /// The page holding the chunk.
    pub fn page(&self) -> u32 {
        self.page
    }

    /// The chunk's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the chunk is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn offset(&self) -> usize {
        self.page as usize * self.inner.page_bytes as usize
    }

    /// Replaces the contents of `out` with a copy of the chunk's bytes (keeping its
    /// capacity: a buffer reused across chunks allocates once).
    pub fn copy_into(&self, out: &mut Vec<u8>) {
        out.clear();
        out.resize(self.len, 0);
        self.inner
            .region
            .read_at(self.offset(), out)
            .expect("a pinned chunk lies inside the buffer (checked when borrowed)");
    }

    /// A copy of the chunk's bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.copy_into(&mut v);
        v
    }

    /// The address of the chunk's first byte, valid (for [`ChunkRef::len`] bytes) while
    /// `self` lives. Read it only with raw copies (`ptr::copy_nonoverlapping`, a DMA): a
    /// peer may write the page meanwhile (see the type's docs), so a `&[u8]` made from it
    /// would be unsound.
    pub fn as_ptr(&self) -> *const u8 {
        self.inner
            .region
            .as_ptr()
            .wrapping_add(self.offset())
            .cast_const()
    }
}

impl std::fmt::Debug for ChunkRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkRef")
            .field("page", &self.page)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for ChunkRef {
    fn drop(&mut self) {
        let ev = lock(&self.inner.alloc).unpin(Instant::now(), self.page);
        if !ev.is_empty() {
            // May run on any thread, inside a runtime or not: the driver sends.
            lock(&self.inner.deferred).extend(ev);
            self.inner.wake.notify_one();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the allocator half-updated in a way we
    // could repair; keep serving with what is there.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Sends `msg` to `peer` in order with everything sent to it before.
fn send(inner: &Arc<Inner>, peer: &PeerId, msg: &PdMsg) {
    let mut out = lock(&inner.outbox);
    let tx = out.entry(peer.clone()).or_insert_with(|| {
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let ch = inner.channel.clone();
        let peer = peer.clone();
        tokio::spawn(async move {
            // The peer's session, looked up once rather than per message (a round trip
            // through the channel's core task). When it failed, the message goes to the
            // peer's current session, as a lookup per message would have sent it.
            let mut link: Option<PeerLink> = None;
            while let Some(b) = rx.recv().await {
                for _attempt in 0..2 {
                    let l = match &link {
                        Some(l) => l.clone(),
                        None => match ch.link(&peer).await {
                            Ok(l) => link.insert(l).clone(),
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "PD reply not sent");
                                break;
                            }
                        },
                    };
                    // Queued in order, confirmed on the side: a message whose confirmation
                    // is slow (its acknowledgement stuck behind a large write on the
                    // connection) must not hold up the next one: a `Fence` waiting behind
                    // an `AllocOk`'s confirmation let the sender write one more chunk into
                    // a cancelled request's pages. Bounded by the channel's op deadline; a
                    // failure means the session is going down, and the allocator learns
                    // that from the peer event.
                    match l.notify_queued(&b).await {
                        Ok(q) => {
                            let peer = peer.clone();
                            tokio::spawn(async move {
                                if let Err(e) = q.delivered().await {
                                    tracing::debug!(%peer, error = %e, "PD reply not delivered");
                                }
                            });
                            break;
                        }
                        Err(e) => {
                            tracing::debug!(%peer, error = %e, "PD reply not sent on its session");
                            link = None;
                        }
                    }
                }
            }
        });
        tx
    });
    let _ = tx.send(msg.encode());
}

/// Acts on the allocator's events.
fn apply(inner: &Arc<Inner>, events: Vec<Event>) {
    for ev in events {
        match ev {
            Event::Granted(g) => granted(inner, g),
            Event::Refused {
                req_id,
                owner,
                call,
                refusal,
            } => refused(inner, req_id, &owner, call, refusal),
            Event::Fence { req_id, owner } => fence(inner, req_id, owner),
            Event::Ended {
                req_id,
                owner,
                reason,
            } => ended(inner, req_id, &owner, reason),
            Event::ExpiredUnretrieved { req_id } => {
                tracing::warn!(%req_id, "complete KV was not retrieved within the TTL; pages returned");
            }
            Event::Completed {
                req_id,
                owner,
                call,
            } => {
                lock(&inner.windows).completed(&inner.channel, &req_id);
                send_to_owner(inner, &owner, &PdMsg::FinishOk { call, req_id });
            }
            Event::Accepted {
                req_id,
                owner,
                call,
            } => send_to_owner(inner, &owner, &PdMsg::FinishOk { call, req_id }),
            Event::FinishRefused {
                req_id,
                owner,
                call,
                reason,
            } => {
                let msg = PdMsg::FinishErr {
                    call,
                    req_id,
                    reason,
                };
                send_to_owner(inner, &owner, &msg);
            }
            Event::Stop { req_id, owner } => {
                // Pull: nothing of the sender can land; the fence only tells it to stop
                // offering (its FenceAck finds no quarantine).
                send_to_owner(inner, &owner, &PdMsg::Fence { req_id });
            }
            Event::CancelAcked { req_id, owner } => {
                send_to_owner(inner, &owner, &PdMsg::CancelAck { req_id });
            }
        }
    }
    inner.changed.notify_waiters();
    inner.wake.notify_one();
}

/// Sends `msg` to the sender that owns a request ([`send`]); an owner that names no valid
/// peer gets nothing (owners are made from peers' ids, so none should).
fn send_to_owner(inner: &Arc<Inner>, owner: &Owner, msg: &PdMsg) {
    if let Some(peer) = PeerId::new(owner.peer.clone()) {
        send(inner, &peer, msg);
    }
}

/// A grant: the request starts afresh (no longer ended), consumers waiting for grants hear
/// of it, and its sender gets its pages once the writes of their previous holders ended.
fn granted(inner: &Arc<Inner>, g: Allocation) {
    lock(&inner.ended).forget(&g.req_id);
    let Some(peer) = PeerId::new(g.owner.peer.clone()) else {
        return;
    };
    announce_grant(inner, &g);
    let landing = open_windows(inner, &g, &peer);
    let msg = PdMsg::AllocOk {
        call: g.call,
        req_id: g.req_id,
        region: inner.region.id().0,
        page_bytes: inner.page_bytes,
        pages: g.slots.iter().map(|s| s.page).collect(),
        held: g.slots.iter().map(|s| s.held).collect(),
    };
    if landing.is_empty() {
        send(inner, &peer, &msg);
    } else {
        tokio::spawn(grant_after_landing(inner.clone(), peer, msg, landing));
    }
}

/// Tells [`PdReceiver::granted_requests`] subscribers, if any, of a grant (the allocator is
/// not asked for the tokens when nobody listens).
fn announce_grant(inner: &Arc<Inner>, g: &Allocation) {
    if inner.granted.receiver_count() > 0 {
        let tokens = lock(&inner.alloc).tokens(&g.req_id).unwrap_or(0);
        let _ = inner.granted.send(GrantedRequest {
            req_id: g.req_id.clone(),
            tokens,
            chunks: g.slots.len() as u64,
        });
    }
}

/// Tells the owner of a waiting allocation that the allocator refused it; a request that
/// can never fit says how many pages it needed of how many there are.
fn refused(inner: &Arc<Inner>, req_id: String, owner: &Owner, call: u64, refusal: Refusal) {
    let never_fits = match refusal {
        Refusal::NeverFits { needed, total } => Some((needed, total)),
        _ => None,
    };
    let msg = PdMsg::AllocErr {
        call,
        req_id,
        reason: refusal.to_string(),
        never_fits,
        page_bytes: inner.page_bytes,
    };
    send_to_owner(inner, owner, &msg);
}

/// Asks the owner to stop writing a request whose pages are quarantined, and disconnects
/// it if it does not acknowledge in time ([`fence_deadline`]).
fn fence(inner: &Arc<Inner>, req_id: String, owner: Owner) {
    if let Some(peer) = PeerId::new(owner.peer.clone()) {
        send(
            inner,
            &peer,
            &PdMsg::Fence {
                req_id: req_id.clone(),
            },
        );
        tokio::spawn(fence_deadline(inner.clone(), peer, owner, req_id));
    }
}

/// Records a request that ended before it completed (a reader waiting for its chunks fails
/// at once), and reports `KvFailed` on the sender's behalf when the sender cannot.
fn ended(inner: &Arc<Inner>, req_id: String, owner: &Owner, reason: EndReason) {
    tracing::info!(%req_id, sender = %owner, ?reason, "request ended before it completed");
    let (what, failure) = ended_why(owner, &reason);
    lock(&inner.ended).insert(req_id.clone(), what);
    if let Some(reason) = failure {
        inner.failures.emit(Outcome::KvFailed {
            req_id,
            rank: inner.rank,
            reason,
        });
    }
}

/// Why a request ended, for its readers; and for the failure report, only when its sender
/// failed or went silent (a live sender reports its own outcome).
fn ended_why(owner: &Owner, reason: &EndReason) -> (String, Option<String>) {
    let what = match reason {
        EndReason::Cancelled => "cancelled on the receiver".to_string(),
        EndReason::SenderCancelled => format!("sender {owner} cancelled it"),
        EndReason::Expired => format!("sender {owner} did not finish within the TTL"),
        EndReason::OwnerDown => format!("sender {owner} failed mid-transfer"),
    };
    let failure = match reason {
        EndReason::OwnerDown => Some(format!("sender {owner} failed mid-transfer")),
        EndReason::Expired => Some(format!(
            "sender {owner} did not finish within the receiver's TTL"
        )),
        _ => None,
    };
    (what, failure)
}

/// Opens the write windows of a granted push request for its sender (a pull request's
/// sender writes nothing); returns the previous holders' writes still landing on its pages.
fn open_windows(inner: &Arc<Inner>, g: &Allocation, peer: &PeerId) -> Landing {
    if lock(&inner.alloc).is_pull(&g.req_id) != Some(false) {
        return Vec::new();
    }
    let pages: Vec<u32> = g.slots.iter().filter(|s| !s.held).map(|s| s.page).collect();
    let claimed = lock(&inner.windows).claim(
        &inner.channel,
        inner.region.id(),
        inner.page_bytes,
        &g.req_id,
        peer,
        &pages,
    );
    claimed.unwrap_or_else(|e| {
        // Cannot happen (the buffer is registered with windows and the pages are in it);
        // the sender's writes are then refused, and its request fails, loudly.
        tracing::error!(%peer, req_id = %g.req_id, error = %e, "write windows not opened");
        Vec::new()
    })
}

/// Sends a grant once the writes of the pages' previous holders ended. Each is bounded by
/// the channel's payload deadline; a holder still landing past the op deadline is
/// disconnected, which returns only once none of its writes can land.
async fn grant_after_landing(inner: Arc<Inner>, peer: PeerId, msg: PdMsg, landing: Landing) {
    let limit = inner.channel.config().deadlines.op;
    for (holder, d) in landing {
        if tokio::time::timeout(limit, d.drained()).await.is_err() {
            tracing::warn!(%holder, "writes into pages being granted to another request did not end in time; disconnecting their sender");
            let _ = inner
                .channel
                .disconnect(&holder, "its writes into released pages did not end")
                .await;
        }
    }
    send(&inner, &peer, &msg);
}

/// Disconnects a sender that has not acknowledged a fence within `fence_timeout` (and is
/// still the session that owns the quarantined pages); the pages return once the session is
/// torn down.
async fn fence_deadline(inner: Arc<Inner>, peer: PeerId, owner: Owner, req_id: String) {
    tokio::time::sleep(inner.fence_timeout).await;
    if !lock(&inner.alloc).fence_pending(&req_id, &owner) {
        return;
    }
    // Only the session that owns the pages: a restarted sender's pages were freed by Down.
    match inner.channel.peer_incarnation(&peer).await {
        Ok(i) if i.0 == owner.incarnation => {}
        _ => return,
    }
    let reason = format!(
        "request {req_id}: no fence acknowledgement within {:?}",
        inner.fence_timeout
    );
    tracing::warn!(%peer, %req_id, "sender did not acknowledge a fence; disconnecting it");
    match inner.channel.disconnect(&peer, &reason).await {
        // Torn down: nothing of that session can land any more (the Down event will say the
        // same; owner_down is idempotent).
        Ok(()) => peer_down(&inner, &peer, owner.incarnation).await,
        Err(e) => {
            // The session is going down anyway (or was gone): its Down event frees the pages.
            tracing::warn!(%peer, %req_id, error = %e, "disconnecting a silent sender failed");
        }
    }
}

/// Is the owner's session the live one? Asks the channel when the event has not been seen
/// yet (a notification can overtake the `Up` event).
async fn owner_live(inner: &Arc<Inner>, peer: &PeerId, incarnation: u64) -> bool {
    if lock(&inner.live).get(peer) == Some(&incarnation) {
        return true;
    }
    match inner.channel.peer_incarnation(peer).await {
        Ok(i) if i.0 == incarnation => {
            lock(&inner.live).insert(peer.clone(), incarnation);
            true
        }
        _ => false,
    }
}

fn owner(peer: &PeerId, incarnation: u64) -> Owner {
    Owner {
        peer: peer.to_string(),
        incarnation,
    }
}

/// Acts on one message of a sender, then on the allocator's events it caused ([`apply`]).
/// `session_incarnation` is the sender's incarnation as its session established it; a
/// message that claims another one comes from a stale or confused sender.
async fn handle(inner: &Arc<Inner>, peer: PeerId, session_incarnation: u64, data: &[u8]) {
    let msg = match PdMsg::decode(data) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "dropping a malformed PD message");
            return;
        }
    };
    let now = Instant::now();
    let ev = match msg {
        PdMsg::Alloc {
            call,
            req_id,
            incarnation,
            spec,
            keys,
            tokens,
            pull,
        } => {
            let req = AllocReq {
                req_id,
                owner: owner(&peer, incarnation),
                call,
                keys,
                tokens,
                pull,
            };
            let refusal = alloc_refusal(inner, &peer, session_incarnation, spec, &req).await;
            if let Some(reason) = refusal {
                // Refusals that are not the allocator's: answer directly.
                let msg = PdMsg::AllocErr {
                    call,
                    req_id: req.req_id,
                    reason,
                    never_fits: None,
                    page_bytes: inner.page_bytes,
                };
                send(inner, &peer, &msg);
                return;
            }
            lock(&inner.alloc).alloc(now, req)
        }
        PdMsg::Offer {
            req_id,
            incarnation,
            index,
            region,
            offset,
            len,
        } => {
            offer(
                inner,
                &peer,
                session_incarnation,
                Offered {
                    req_id,
                    incarnation,
                    index,
                    region,
                    offset,
                    len,
                },
            )
            .await;
            Vec::new()
        }
        other => to_allocator(inner, &peer, now, other),
    };
    apply(inner, ev);
}

/// Passes a message about a request the receiver holds (or held) to the allocator, which
/// acts on it at once; returns the events to apply.
fn to_allocator(inner: &Arc<Inner>, peer: &PeerId, now: Instant, msg: PdMsg) -> Vec<Event> {
    match msg {
        PdMsg::Finish {
            call,
            req_id,
            incarnation,
        } => {
            let r = lock(&inner.alloc).finish(now, &req_id, &owner(peer, incarnation), call);
            finish_answer(inner, peer, call, req_id, r)
        }
        PdMsg::FinishWhenLanded {
            call,
            req_id,
            incarnation,
        } => {
            let r = lock(&inner.alloc).finish_when_landed(
                now,
                &req_id,
                &owner(peer, incarnation),
                call,
            );
            finish_answer(inner, peer, call, req_id, r)
        }
        PdMsg::Cancel {
            req_id,
            incarnation,
            pull: false,
        } => lock(&inner.alloc)
            .sender_cancel(now, &req_id, &owner(peer, incarnation))
            .unwrap_or_default(),
        PdMsg::Cancel {
            req_id,
            incarnation,
            pull: true,
        } => lock(&inner.alloc).pull_cancel(now, &req_id, &owner(peer, incarnation)),
        PdMsg::Written {
            req_id,
            incarnation,
            index,
        } => {
            written(inner, peer, now, &req_id, incarnation, index);
            Vec::new()
        }
        PdMsg::FenceAck {
            req_id,
            incarnation,
        } => lock(&inner.alloc).fence_acked(now, &req_id, &owner(peer, incarnation)),
        other => {
            tracing::warn!(%peer, msg = ?other, "unexpected PD message on a receiver");
            Vec::new()
        }
    }
}

/// Why an allocation is refused before the allocator sees it, if it is: a KV spec or a key
/// count this receiver cannot take, or a sender that is not the live session it claims to be.
async fn alloc_refusal(
    inner: &Arc<Inner>,
    peer: &PeerId,
    session_incarnation: u64,
    spec: KvSpec,
    req: &AllocReq,
) -> Option<String> {
    let (incarnation, tokens) = (req.owner.incarnation, req.tokens);
    if spec != inner.spec {
        Some(format!(
            "incompatible KV spec: receiver {}, sender {spec}",
            inner.spec
        ))
    } else if inner.spec.chunks_for(tokens) != req.keys.len() as u64 {
        Some(format!(
            "{} keys for {tokens} tokens of {} per chunk",
            req.keys.len(),
            inner.spec.chunk_tokens
        ))
    } else if incarnation != session_incarnation {
        Some(format!(
            "sender claims incarnation {incarnation:016x}, its session has {session_incarnation:016x}"
        ))
    } else if !owner_live(inner, peer, incarnation).await {
        Some(format!(
            "sender incarnation {incarnation:016x} has no live session"
        ))
    } else {
        None
    }
}

/// Push: the sender's note that chunk `index` landed. The chunk becomes readable and the
/// sender's window on its page closes (on all its pages once the request is complete).
fn written(
    inner: &Arc<Inner>,
    peer: &PeerId,
    now: Instant,
    req_id: &str,
    incarnation: u64,
    index: u64,
) {
    tracing::debug!(target: crate::timeline::TIMELINE, stage = "receiver.written", id = %req_id, chunk = index);
    let mut alloc = lock(&inner.alloc);
    match alloc.chunk_written(now, req_id, &owner(peer, incarnation), index) {
        Ok(()) => {
            // Its sender writes that page no more; a request it completed, none.
            let page = alloc
                .slots(req_id)
                .and_then(|s| s.get(index as usize))
                .map(|s| s.page);
            let complete = alloc.state(req_id) == Some(ReqState::Complete);
            drop(alloc);
            let mut w = lock(&inner.windows);
            if complete {
                w.completed(&inner.channel, req_id);
            } else if let Some(page) = page {
                w.landed(&inner.channel, req_id, page);
            }
        }
        // Late (the request ended) or confused: nothing becomes readable.
        Err(e) => {
            tracing::debug!(%peer, %req_id, index, error = %e, "chunk-written note ignored")
        }
    }
}

/// The allocator's events for a `finish` or `finish_when_landed` call, or, when it refused the
/// call, a `FinishErr` sent to the sender.
fn finish_answer(
    inner: &Arc<Inner>,
    peer: &PeerId,
    call: u64,
    req_id: String,
    r: std::result::Result<Vec<Event>, ReqError>,
) -> Vec<Event> {
    match r {
        Ok(ev) => ev,
        Err(e) => {
            let reason = match e {
                ReqError::Unknown => {
                    "the receiver no longer holds the request (cancelled or expired)".to_string()
                }
                e => e.to_string(),
            };
            let msg = PdMsg::FinishErr {
                call,
                req_id,
                reason,
            };
            send(inner, peer, &msg);
            Vec::new()
        }
    }
}

/// A chunk a pull sender offered.
struct Offered {
    req_id: String,
    incarnation: u64,
    index: u64,
    region: [u8; 16],
    offset: u64,
    len: u64,
}

/// Pull mode: starts reading an offered chunk into its page, or answers `PullErr` at once.
async fn offer(inner: &Arc<Inner>, peer: &PeerId, session_incarnation: u64, o: Offered) {
    let refuse = |reason: String| {
        send(
            inner,
            peer,
            &PdMsg::PullErr {
                req_id: o.req_id.clone(),
                index: o.index,
                reason,
            },
        )
    };
    if o.incarnation != session_incarnation {
        return refuse(format!(
            "sender claims incarnation {:016x}, its session has {session_incarnation:016x}",
            o.incarnation
        ));
    }
    if !owner_live(inner, peer, o.incarnation).await {
        return refuse(format!(
            "sender incarnation {:016x} has no live session",
            o.incarnation
        ));
    }
    let who = owner(peer, o.incarnation);
    let ticket = {
        let mut a = lock(&inner.alloc);
        let want = a
            .tokens(&o.req_id)
            .map(|t| inner.spec.chunk_bytes_at(o.index, t));
        match want {
            Some(w) if w != o.len => Err(format!(
                "chunk {} offered with {} bytes, its layout needs {w}",
                o.index, o.len
            )),
            _ => a.begin_read(&o.req_id, &who, o.index).map_err(|e| match e {
                ReqError::Unknown => {
                    "the receiver no longer holds the request (cancelled or expired)".to_string()
                }
                e => format!("chunk {}: request is not readable: {e}", o.index),
            }),
        }
    };
    match ticket {
        Ok(t) => {
            tokio::spawn(read_chunk(
                inner.clone(),
                peer.clone(),
                t,
                RegionId(o.region),
                o.offset,
                o.len as usize,
            ));
        }
        Err(reason) => refuse(reason),
    }
}

/// Reads one offered chunk into its (pinned) page; answers `Pulled` or `PullErr` once the
/// read resolved (nothing of it can land any more), then applies what that unblocks.
async fn read_chunk(
    inner: Arc<Inner>,
    peer: PeerId,
    t: ReadTicket,
    remote: RegionId,
    offset: u64,
    len: usize,
) {
    let op = Op {
        local: inner.region.clone(),
        local_offset: t.page as usize * inner.page_bytes as usize,
        remote,
        remote_offset: offset,
        len,
    };
    let r = read_granted(&inner, &peer, op).await;
    let (pulled, ev) = lock(&inner.alloc).end_read(Instant::now(), &t, r.is_ok());
    let reply = match (&r, pulled) {
        (Ok(()), true) => PdMsg::Pulled {
            req_id: t.req_id.clone(),
            index: t.index,
        },
        (Ok(()), false) => PdMsg::PullErr {
            req_id: t.req_id.clone(),
            index: t.index,
            reason: "the request ended while its chunk was read".into(),
        },
        (Err(e), _) => PdMsg::PullErr {
            req_id: t.req_id.clone(),
            index: t.index,
            reason: format!("reading chunk {} from {peer} failed: {e}", t.index),
        },
    };
    // Before what the read unblocks (a deferred FinishOk comes after every Pulled).
    send(&inner, &peer, &reply);
    apply(&inner, ev);
}

/// Reads `op` from `peer`. The sender's region grants reach us over its control connection,
/// not ordered with its notifications, so an offer can overtake the grant of a region the
/// sender registered just before: a read refused locally for an unknown region (nothing was
/// sent, nothing can land) is retried, with backoff, until the grant arrives or the
/// channel's op deadline passes. The read itself is bounded by that deadline too (on it the
/// session is aborted and drained first).
async fn read_granted(inner: &Arc<Inner>, peer: &PeerId, op: Op) -> kvbridge::Result<()> {
    let deadline = inner.channel.config().deadlines.op;
    let until = tokio::time::Instant::now() + deadline;
    let mut backoff = Duration::from_micros(500);
    loop {
        match inner.channel.read(peer, std::slice::from_ref(&op)).await {
            Err(e @ kvbridge::Error::InvalidOp { .. }) => {
                let known = inner
                    .channel
                    .peer_regions(peer)
                    .await
                    .map(|rs| rs.iter().any(|r| r.id == op.remote))
                    .unwrap_or(true);
                if known || tokio::time::Instant::now() + backoff > until {
                    return Err(e);
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

async fn peer_down(inner: &Arc<Inner>, peer: &PeerId, incarnation: u64) {
    {
        let mut live = lock(&inner.live);
        if live.get(peer) == Some(&incarnation) {
            live.remove(peer);
        }
    }
    lock(&inner.outbox).remove(peer);
    let ev = lock(&inner.alloc).owner_down(Instant::now(), &owner(peer, incarnation));
    apply(inner, ev);
}

/// After missed events: every owner whose session is not the live one is down.
async fn resync(inner: &Arc<Inner>) {
    let owners = lock(&inner.alloc).owners();
    for o in owners {
        let Some(peer) = PeerId::new(o.peer.clone()) else {
            continue;
        };
        let live =
            matches!(inner.channel.peer_incarnation(&peer).await, Ok(i) if i.0 == o.incarnation);
        if !live {
            peer_down(inner, &peer, o.incarnation).await;
        }
    }
}

async fn drive(inner: Arc<Inner>, mut events: broadcast::Receiver<PeerEvent>) {
    loop {
        let next = lock(&inner.alloc).next_deadline();
        let sleep = async {
            match next {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            n = inner.channel.recv_notification() => match n {
                Some(n) => handle(&inner, n.peer, n.incarnation.0, &n.data).await,
                None => return,
            },
            e = events.recv() => match e {
                Ok(PeerEvent::Up { peer, incarnation }) => {
                    lock(&inner.live).insert(peer, incarnation.0);
                }
                Ok(PeerEvent::Down { peer, incarnation, error }) => {
                    tracing::info!(%peer, %error, "sender session down; releasing its pages");
                    peer_down(&inner, &peer, incarnation.0).await;
                }
                Err(broadcast::error::RecvError::Lagged(_)) => resync(&inner).await,
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = sleep => {
                let ev = lock(&inner.alloc).tick(Instant::now());
                apply(&inner, ev);
            }
            _ = inner.wake.notified() => {
                let ev = std::mem::take(&mut *lock(&inner.deferred));
                if !ev.is_empty() {
                    apply(&inner, ev);
                }
            }
        }
    }
}
