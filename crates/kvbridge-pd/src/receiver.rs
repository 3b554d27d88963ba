//! The receiver (decoder side) of one rank: a listening [`Channel`], one registered paged
//! buffer, the [`PageAllocator`] that owns its pages, and a driver task that answers
//! senders, applies deadlines, and reacts to sessions going down.

use crate::alloc::{
    AllocReq, Counters, EndReason, Event, Owner, PageAllocator, ReqError, ReqState,
};
use crate::error::{PdError, PdStep, Result};
use crate::layout::KvSpec;
use crate::msg::PdMsg;
use crate::outcome::{Outcome, OutcomeSink};
use kvbridge::{Channel, ChannelConfig, Grant, PeerEvent, PeerId, Region};
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
        let channel = Channel::new(cfg.channel.clone())
            .await
            .map_err(|e| PdError::Config(e.to_string()))?;
        // Subscribe before anyone can connect: no session change is missed.
        let events = channel.peer_events();
        if let Err(e) = channel.register(&region, Grant::AllPeers) {
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

    /// Waits until every chunk of `req_id` has landed, up to `deadline`.
    pub async fn wait_complete(&self, req_id: &str, deadline: Duration) -> Result<()> {
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            match self.lock().state(req_id) {
                Some(ReqState::Complete) => return Ok(()),
                Some(ReqState::Retrieving) => {
                    return Err(PdError::Invalid {
                        req_id: req_id.into(),
                        step: PdStep::Retrieve,
                        detail: "already being retrieved".into(),
                    })
                }
                _ => {}
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
    /// consumed it in place). Fails naming the request when it is not complete.
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
            while let Some(b) = rx.recv().await {
                // Bounded by the channel's op deadline; a failure means the session is going
                // down, and the allocator learns that from the peer event.
                if let Err(e) = ch.notify(&peer, &b).await {
                    tracing::debug!(%peer, error = %e, "PD reply not delivered");
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
            Event::Granted(g) => {
                let Some(peer) = PeerId::new(g.owner.peer.clone()) else {
                    continue;
                };
                let msg = PdMsg::AllocOk {
                    call: g.call,
                    req_id: g.req_id,
                    region: inner.region.id().0,
                    page_bytes: inner.page_bytes,
                    pages: g.slots.iter().map(|s| s.page).collect(),
                    held: g.slots.iter().map(|s| s.held).collect(),
                };
                send(inner, &peer, &msg);
            }
            Event::Refused {
                req_id,
                owner,
                call,
                refusal,
            } => {
                let Some(peer) = PeerId::new(owner.peer.clone()) else {
                    continue;
                };
                let never_fits = match refusal {
                    crate::alloc::Refusal::NeverFits { needed, total } => Some((needed, total)),
                    _ => None,
                };
                let msg = PdMsg::AllocErr {
                    call,
                    req_id,
                    reason: refusal.to_string(),
                    never_fits,
                    page_bytes: inner.page_bytes,
                };
                send(inner, &peer, &msg);
            }
            Event::Fence { req_id, owner } => {
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
            Event::Ended {
                req_id,
                owner,
                reason,
            } => {
                tracing::info!(%req_id, sender = %owner, ?reason, "request ended before it completed");
                let why = match reason {
                    EndReason::OwnerDown => Some(format!("sender {owner} failed mid-transfer")),
                    EndReason::Expired => Some(format!(
                        "sender {owner} did not finish within the receiver's TTL"
                    )),
                    _ => None,
                };
                if let Some(reason) = why {
                    inner.failures.emit(Outcome::KvFailed {
                        req_id,
                        rank: inner.rank,
                        reason,
                    });
                }
            }
            Event::ExpiredUnretrieved { req_id } => {
                tracing::warn!(%req_id, "complete KV was not retrieved within the TTL; pages returned");
            }
        }
    }
    inner.changed.notify_waiters();
    inner.wake.notify_one();
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
        } => {
            let bad = if spec != inner.spec {
                Some(format!(
                    "incompatible KV spec: receiver {}, sender {spec}",
                    inner.spec
                ))
            } else if inner.spec.chunks_for(tokens) != keys.len() as u64 {
                Some(format!(
                    "{} keys for {tokens} tokens of {} per chunk",
                    keys.len(),
                    inner.spec.chunk_tokens
                ))
            } else if incarnation != session_incarnation {
                Some(format!(
                    "sender claims incarnation {incarnation:016x}, its session has {session_incarnation:016x}"
                ))
            } else if !owner_live(inner, &peer, incarnation).await {
                Some(format!(
                    "sender incarnation {incarnation:016x} has no live session"
                ))
            } else {
                None
            };
            if let Some(reason) = bad {
                // Refusals that are not the allocator's: answer directly.
                let msg = PdMsg::AllocErr {
                    call,
                    req_id,
                    reason,
                    never_fits: None,
                    page_bytes: inner.page_bytes,
                };
                send(inner, &peer, &msg);
                return;
            }
            lock(&inner.alloc).alloc(
                now,
                AllocReq {
                    req_id,
                    owner: owner(&peer, incarnation),
                    call,
                    keys,
                    tokens,
                },
            )
        }
        PdMsg::Finish {
            call,
            req_id,
            incarnation,
        } => {
            let r = lock(&inner.alloc).complete(now, &req_id, &owner(&peer, incarnation));
            let reply = match r {
                Ok(()) => PdMsg::FinishOk { call, req_id },
                Err(e) => PdMsg::FinishErr {
                    call,
                    req_id,
                    reason: match e {
                        ReqError::Unknown => {
                            "the receiver no longer holds the request (cancelled or expired)"
                                .to_string()
                        }
                        e => e.to_string(),
                    },
                },
            };
            send(inner, &peer, &reply);
            Vec::new()
        }
        PdMsg::Cancel {
            req_id,
            incarnation,
        } => lock(&inner.alloc)
            .sender_cancel(now, &req_id, &owner(&peer, incarnation))
            .unwrap_or_default(),
        PdMsg::FenceAck {
            req_id,
            incarnation,
        } => lock(&inner.alloc).fence_acked(now, &req_id, &owner(&peer, incarnation)),
        other => {
            tracing::warn!(%peer, msg = ?other, "unexpected PD message on a receiver");
            Vec::new()
        }
    };
    apply(inner, ev);
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
            _ = inner.wake.notified() => {}
        }
    }
}
