//! The Channel API: the endpoint ([`Channel`]), its per-session link ([`PeerLink`]), the ops
//! of a batch ([`Op`]). A call finds its session through the core task (`core.rs`) and
//! runs on that session's data path; the acceptor (`accept.rs`) hands incoming connections
//! to the core.

use crate::accept::{accept_loop, shm_accept_loop};
use crate::cmd::{CoreCmd, PeerHandle};
use crate::config::ChannelConfig;
use crate::core::Core;
use crate::error::{Error, Result};
use crate::events::{Notification, PeerEvent, Stats};
use crate::grant::{Access, ClosedGrant, Permission, RegionTable, WindowDrain, WindowId};
use crate::net::Listener;
use crate::region::LocalSlice;
use crate::region::Region;
use crate::session::SessionEnv;
use crate::tls::Tls;
use kvbridge_proto::auth::{Keyring, Secret};
use kvbridge_proto::handshake::{LocalIdentity, Step};
use kvbridge_proto::msg::{OpDesc, RegionInfo};
use kvbridge_proto::{GrantToken, Incarnation, PeerId, RegionId};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// One op of a batch: `len` bytes between a local registered region and a peer's region.
/// For a write the bytes go local → remote; for a read remote → local.
#[derive(Debug, Clone)]
pub struct Op {
    /// Local registered region.
    pub local: Region,
    /// Byte offset in the local region.
    pub local_offset: usize,
    /// The peer's region.
    pub remote: RegionId,
    /// Byte offset in the peer's region.
    pub remote_offset: u64,
    /// Length in bytes.
    pub len: usize,
}

impl Op {
    /// An op by page index: local page `local_page` ↔ remote page `remote_page`, one page of
    /// `page_size` bytes (the remote address is base + index × page size). An index so large
    /// that its offset overflows saturates, so the op fails the bounds check with a typed
    /// error instead of wrapping around to another page.
    pub fn page(
        local: &Region,
        local_page: usize,
        remote: RegionId,
        remote_page: u64,
        page_size: usize,
    ) -> Op {
        Op {
            local: local.clone(),
            local_offset: local_page.saturating_mul(page_size),
            remote,
            remote_offset: remote_page.saturating_mul(page_size as u64),
            len: page_size,
        }
    }
}

/// A notification queued for its peer whose delivery is still to be confirmed
/// ([`Channel::notify_queued`]). Dropping it gives up on the confirmation, not on the
/// notification.
#[must_use = "a failed delivery is only known by awaiting `delivered`"]
pub struct QueuedNotify(crate::datapath::Submitted);

impl QueuedNotify {
    /// Returns once the peer received the notification; fails as [`Channel::notify`] does
    /// (the session ended, or the op deadline counted from the queueing passed).
    pub async fn delivered(self) -> Result<()> {
        self.0.outcome().await
    }
}

impl std::fmt::Debug for QueuedNotify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("QueuedNotify")
    }
}

/// One session with a peer ([`Channel::link`]). Its calls are [`Channel`]'s, without the
/// directory lookup each of those makes first (a round trip through the channel's core
/// task, which a loaded runtime may take a tenth of a millisecond to schedule): for a run
/// of writes and notifications to one peer, such as a request's KV chunks.
///
/// It stays bound to the session it was taken on. Once that session ends, every call fails
/// typed (as batches in flight on it do), also after the peer reconnected: a new session is
/// a new link, so nothing meant for one session lands in the next.
#[derive(Clone)]
pub struct PeerLink {
    channel: Channel,
    handle: PeerHandle,
}

impl PeerLink {
    /// The peer.
    pub fn peer(&self) -> &PeerId {
        &self.handle.peer_id
    }

    /// [`Channel::write`] on this session.
    pub async fn write(&self, ops: &[Op]) -> Result<()> {
        self.channel.write_on(&self.handle, ops, None).await
    }

    /// [`Channel::read`] on this session.
    pub async fn read(&self, ops: &[Op]) -> Result<()> {
        self.channel.read_on(&self.handle, ops, None).await
    }

    /// [`Channel::write_with_grant`] on this session.
    pub async fn write_with_grant(&self, token: GrantToken, ops: &[Op]) -> Result<()> {
        self.channel.write_on(&self.handle, ops, Some(token)).await
    }

    /// [`Channel::read_with_grant`] on this session.
    pub async fn read_with_grant(&self, token: GrantToken, ops: &[Op]) -> Result<()> {
        self.channel.read_on(&self.handle, ops, Some(token)).await
    }

    /// [`Channel::notify`] on this session.
    pub async fn notify(&self, data: &[u8]) -> Result<()> {
        self.notify_queued(data).await?.delivered().await
    }

    /// [`Channel::notify_queued`] on this session.
    pub async fn notify_queued(&self, data: &[u8]) -> Result<QueuedNotify> {
        self.channel.notify_queued_on(&self.handle, data).await
    }

    /// [`Channel::notify_posted`] on this session.
    pub async fn notify_posted(&self, data: &[u8]) -> Result<()> {
        self.channel.notify_posted_on(&self.handle, data).await
    }
}

impl std::fmt::Debug for PeerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerLink")
            .field("peer", &self.handle.peer_id)
            .finish_non_exhaustive()
    }
}

struct Inner {
    local: LocalIdentity,
    config: Arc<ChannelConfig>,
    table: Arc<RegionTable>,
    core: mpsc::UnboundedSender<CoreCmd>,
    /// The peers' notifications, taken in turn (`notify_queues`).
    notifications: crate::notify_queues::Outlet,
    local_addr: Option<SocketAddr>,
    tasks: std::sync::Mutex<Vec<JoinHandle<()>>>,
    events: tokio::sync::broadcast::Sender<PeerEvent>,
    /// The name of our unix socket, when we offer shared memory.
    shm_socket: Option<String>,
    /// The channel's UCX worker, when the transport is UCX.
    #[cfg(feature = "ucx")]
    ucx: Option<Arc<crate::transport::ucx_route::UcxChannel>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in self.tasks.lock().expect("tasks poisoned").drain(..) {
            t.abort();
        }
    }
}

/// A kvbridge endpoint: accepts sessions (when it listens), dials peers lazily, and moves
/// bytes between registered regions with one-sided batched writes and reads.
///
/// Cloning is cheap; clones share the endpoint.
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel")
            .field("peer_id", &self.inner.local.peer_id)
            .field("incarnation", &self.inner.local.incarnation)
            .field("local_addr", &self.inner.local_addr)
            .finish()
    }
}

/// The configured secret and the peers' keys (`ChannelConfig::peer_keys`, else the file
/// `KVBRIDGE_PEER_KEYS` names), each refused when shorter than [`Secret::MIN_LEN`].
fn checked_keys(config: &ChannelConfig) -> Result<Option<Keyring>> {
    if let Some(s) = &config.secret {
        if s.len() < Secret::MIN_LEN {
            return Err(Error::Local(format!(
                "the shared secret (ChannelConfig::secret / KVBRIDGE_SECRET) is {} bytes; \
                 at least {} are required (e.g. `openssl rand -hex 16`)",
                s.len(),
                Secret::MIN_LEN
            )));
        }
    }
    let peer_keys = match (&config.peer_keys, std::env::var_os("KVBRIDGE_PEER_KEYS")) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| Error::Local(format!("KVBRIDGE_PEER_KEYS={path:?}: {e}")))?;
            Some(
                Keyring::parse(&text)
                    .map_err(|e| Error::Local(format!("KVBRIDGE_PEER_KEYS={path:?}: {e}")))?,
            )
        }
        (None, None) => None,
    };
    if let Some((id, len)) = peer_keys.as_ref().and_then(Keyring::shortest) {
        if len < Secret::MIN_LEN {
            return Err(Error::Local(format!(
                "the key of peer {id} (ChannelConfig::peer_keys / KVBRIDGE_PEER_KEYS) is \
                 {len} bytes; at least {} are required",
                Secret::MIN_LEN
            )));
        }
    }
    checked_own_key(config, peer_keys.is_some())?;
    Ok(peer_keys)
}

/// The channel's own key (`ChannelConfig::peer_key`), refused when it is short, when it is
/// the shared secret (every holder of the secret would hold it: it binds nothing), or when
/// the channel listens without a secret or a keyring (the key proves this side to others
/// while its listener would take any peer unauthenticated).
fn checked_own_key(config: &ChannelConfig, keyring: bool) -> Result<()> {
    let Some(k) = &config.peer_key else {
        return Ok(());
    };
    const NAME: &str = "this channel's own key (ChannelConfig::peer_key / KVBRIDGE_PEER_KEY)";
    if k.len() < Secret::MIN_LEN {
        return Err(Error::Local(format!(
            "{NAME} is {} bytes; at least {} are required",
            k.len(),
            Secret::MIN_LEN
        )));
    }
    if config.secret.as_ref() == Some(k) {
        return Err(Error::Local(format!(
            "{NAME} is the shared secret (ChannelConfig::secret / KVBRIDGE_SECRET): every \
             holder of the secret holds it, so it binds this side's id to nothing; give the \
             id a key of its own"
        )));
    }
    if config.listen_addr.is_some() && config.secret.is_none() && !keyring {
        return Err(Error::Local(format!(
            "{NAME} is set on a listening channel without a shared secret \
             (ChannelConfig::secret / KVBRIDGE_SECRET) or a keyring (KVBRIDGE_PEER_KEYS): \
             its listener would take any peer unauthenticated; set KVBRIDGE_SECRET"
        )));
    }
    Ok(())
}

/// The bounds of the notification queues, refused when a notification of the largest size
/// could never fit them.
fn notify_caps(limits: &crate::config::Limits) -> Result<crate::notify_queues::Caps> {
    let max = limits.max_notify_len as u64;
    for (name, value) in [
        (
            "max_notify_bytes_per_peer",
            limits.max_notify_bytes_per_peer,
        ),
        ("max_notify_bytes_queued", limits.max_notify_bytes_queued),
    ] {
        if value < max {
            return Err(Error::Local(format!(
                "Limits::{name} is {value} bytes, below max_notify_len ({max}): a \
                 notification of the largest size could never be queued"
            )));
        }
    }
    if limits.max_notifications_per_peer == 0 {
        return Err(Error::Local(
            "Limits::max_notifications_per_peer is 0: no notification could be queued".into(),
        ));
    }
    Ok(crate::notify_queues::Caps {
        per_peer: limits.max_notifications_per_peer,
        per_peer_bytes: limits.max_notify_bytes_per_peer,
        total_bytes: limits.max_notify_bytes_queued,
    })
}

/// The unix socket a listener offers shared memory on, and its offer: on real sockets,
/// unless TCP is forced or test hooks hold the batches this listener applies (they exist on
/// TCP only), and where the socket binds.
fn shm_listener(
    listener: Option<&Listener>,
    config: &ChannelConfig,
) -> Option<(tokio::net::UnixListener, kvbridge_proto::msg::ShmOffer)> {
    let tcp_hooks =
        config.hooks.write_apply_delay.is_some() || config.hooks.read_serve_delay.is_some();
    match (listener, config.transport, crate::transport::shm::host_id()) {
        (Some(Listener::Tokio(_)), t, Some(host))
            if matches!(
                t,
                crate::config::Transport::Auto | crate::config::Transport::Shm
            ) && !tcp_hooks =>
        {
            let name = crate::transport::shm::socket_name();
            match crate::transport::shm::bind(&name) {
                Ok(l) => Some((
                    l,
                    kvbridge_proto::msg::ShmOffer {
                        host,
                        pid: std::process::id(),
                        socket: name,
                        cma: config.cma,
                    },
                )),
                Err(e) => {
                    tracing::warn!(error = %e, "no unix socket for shared memory; TCP only");
                    None
                }
            }
        }
        _ => None,
    }
}

impl Channel {
    /// Creates a channel; binds its listener first when `listen_addr` is set, so that
    /// [`Channel::local_addr`] is valid as soon as this returns.
    pub async fn new(config: ChannelConfig) -> Result<Channel> {
        let peer_id = PeerId::new(config.peer_id.clone())
            .ok_or_else(|| Error::Local(format!("invalid peer id {:?}", config.peer_id)))?;
        let peer_keys = checked_keys(&config)?;
        #[cfg(not(feature = "ucx"))]
        if config.transport == crate::config::Transport::Ucx {
            return Err(Error::Local(
                "transport ucx (KVBRIDGE_TRANSPORT=ucx): this build has no UCX (build the \
                 kvbridge crate with its `ucx` feature)"
                    .into(),
            ));
        }
        #[cfg(feature = "ucx")]
        let ucx = crate::session::ucx::start_thread(&config, peer_id.as_str()).await?;
        let local = LocalIdentity {
            peer_id,
            incarnation: Incarnation(crate::random::rand_u64()),
            compat: config.compat.clone(),
            secret: config.secret.clone(),
            peer_keys,
            peer_key: config.peer_key.clone(),
        };
        let tls = match &config.tls {
            Some(t) => {
                if config.net != crate::net::Net::Tokio {
                    return Err(Error::Local("TLS needs real sockets".into()));
                }
                Some(Arc::new(Tls::new(t, config.listen_addr.is_some())?))
            }
            None => None,
        };
        let config = Arc::new(config);
        let listener = match &config.listen_addr {
            Some(a) => Some(
                config
                    .net
                    .bind(a)
                    .await
                    .map_err(|e| Error::Local(format!("cannot listen on {a}: {e}")))?,
            ),
            None => None,
        };
        let local_addr = listener.as_ref().and_then(|l| l.local_addr().ok());
        let authenticates = local.authenticates();
        if let Some(w) = local_addr.and_then(|a| exposure_warning(a, authenticates)) {
            tracing::warn!("{w}");
        }
        let (core_tx, core_rx) = mpsc::unbounded_channel();
        let (notif_tx, notif_rx) = crate::notify_queues::queues(notify_caps(&config.limits)?);
        let table = Arc::new(RegionTable::default());
        let (events, _) = tokio::sync::broadcast::channel(1024);
        let shm = shm_listener(listener.as_ref(), &config);
        let shm_socket = shm.as_ref().map(|(_, o)| o.socket.clone());
        let env = SessionEnv {
            local: local.clone(),
            config: config.clone(),
            table: table.clone(),
            core: core_tx.clone(),
            notifications: notif_tx,
            shm_offer: shm.as_ref().map(|(_, o)| o.clone()),
            tls: tls.clone(),
            in_flight_refused: Arc::new(AtomicU64::new(0)),
            late_answers: Arc::new(AtomicU64::new(0)),
            direct_copies: Default::default(),
            frames_fast_lane: Default::default(),
            #[cfg(feature = "ucx")]
            ucx: ucx.clone(),
        };
        let mut tasks = vec![tokio::spawn(Core::new(env, events.clone()).run(core_rx))];
        if let Some((l, _)) = shm {
            tasks.push(tokio::spawn(shm_accept_loop(
                l,
                config.clone(),
                core_tx.clone(),
            )));
        }
        if let Some(l) = listener {
            tasks.push(tokio::spawn(accept_loop(
                l,
                config.clone(),
                core_tx.clone(),
                tls,
            )));
        }
        Ok(Channel {
            inner: Arc::new(Inner {
                local,
                config,
                table,
                core: core_tx,
                notifications: notif_rx,
                local_addr,
                tasks: std::sync::Mutex::new(tasks),
                events,
                shm_socket,
                #[cfg(feature = "ucx")]
                ucx,
            }),
        })
    }

    /// The name of the listener's unix socket in the abstract namespace, when it offers
    /// shared memory. Not a secret from local users (`/proc/net/unix` lists it); tests use
    /// it to play a local attacker.
    #[doc(hidden)]
    pub fn shm_socket_name(&self) -> Option<String> {
        self.inner.shm_socket.clone()
    }

    /// The address the channel listens on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.local_addr
    }

    /// This side's peer id.
    pub fn peer_id(&self) -> &PeerId {
        &self.inner.local.peer_id
    }

    /// This channel's incarnation (random per start).
    pub fn incarnation(&self) -> Incarnation {
        self.inner.local.incarnation
    }

    /// The configuration.
    pub fn config(&self) -> &ChannelConfig {
        &self.inner.config
    }

    /// Registers a region and grants it to peers; established peers learn of it at once.
    /// `grant` is a [`Grant`](crate::Grant) (read-write) or a [`Permission`] with an access
    /// mode (`Grant::AllPeers.read_only()`); a mode other than read-write keeps the region
    /// off shared memory and cross-memory attach (crate::grant explains why).
    pub fn register(&self, region: &Region, grant: impl Into<Permission>) -> Result<()> {
        self.inner.table.insert(region.clone(), grant.into())?;
        let _ = self.inner.core.send(CoreCmd::MemChanged);
        Ok(())
    }

    /// Opens `len` bytes at `offset` of a region registered with
    /// [`Permission::writes_in_windows`] to `peer`'s writes (crate::grant explains where
    /// windows hold). Cheap: a table insert, no message to the peer. The same as
    /// [`Channel::open_peer_window`] with [`Access::WriteOnly`].
    pub fn open_window(
        &self,
        region: RegionId,
        peer: &PeerId,
        offset: u64,
        len: u64,
    ) -> Result<WindowId> {
        self.open_peer_window(region, peer, offset, len, Access::WriteOnly)
    }

    /// Opens `len` bytes at `offset` of a region whose grant confines reads
    /// ([`Permission::reads_in_windows`]) and/or writes ([`Permission::writes_in_windows`])
    /// to windows, to `peer`'s ops of `access` (`ReadOnly`: its reads, `WriteOnly`: its
    /// writes, `ReadWrite`: both). Fails (`Error::Local`) when the region confines neither
    /// direction `access` names, when the range is empty or outside the region, or when it
    /// overlaps a window open to the same peer on that region.
    pub fn open_peer_window(
        &self,
        region: RegionId,
        peer: &PeerId,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<WindowId> {
        self.inner
            .table
            .open_peer_window(&region, peer, offset, len, access)
    }

    /// [`Channel::open_peer_window`] for whoever names `token` in a batch
    /// ([`Channel::read_with_grant`]) rather than for one peer: for an owner that does not
    /// know yet which peer will read a request's bytes (mint the token per request with
    /// [`crate::new_grant_token`] and hand it over out of band). Any authenticated peer that
    /// holds the token reaches the window until it closes; [`Channel::token_users`] says
    /// which did. Refuses the all-zero token.
    pub fn open_token_window(
        &self,
        region: RegionId,
        token: &GrantToken,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<WindowId> {
        self.inner
            .table
            .open_token_window(&region, token, offset, len, access)
    }

    /// Opens one window per `(offset, len)` of `ranges` on `region` to `peer`'s ops of
    /// `access`, as [`Channel::open_peer_window`] does for one, all or none (one table lock
    /// for all of them: what an owner that opens the pages of an allocation together wants).
    /// The ids in the order of `ranges`. Fails (`Error::Local`, nothing opened) when any
    /// range would fail alone, or when two of the ranges overlap.
    pub fn open_peer_windows(
        &self,
        region: RegionId,
        peer: &PeerId,
        ranges: &[(u64, u64)],
        access: Access,
    ) -> Result<Vec<WindowId>> {
        self.inner
            .table
            .open_peer_windows(&region, peer, ranges, access)
    }

    /// [`Channel::open_peer_windows`] for whoever names `token` in a batch, as
    /// [`Channel::open_token_window`] does for one range.
    pub fn open_token_windows(
        &self,
        region: RegionId,
        token: &GrantToken,
        ranges: &[(u64, u64)],
        access: Access,
    ) -> Result<Vec<WindowId>> {
        self.inner
            .table
            .open_token_windows(&region, token, ranges, access)
    }

    /// Closes a window: no op passes it from now on. The returned [`WindowDrain`] waits for
    /// the ops that passed it before and may still be running (writes landing, read
    /// responses being sent); give the bytes to anyone else only once it is drained. `None`
    /// when the window is not open (closed before, or its region deregistered). Closing a
    /// token's last window forgets its users.
    pub fn close_window(&self, id: WindowId) -> Option<WindowDrain> {
        self.inner.table.close_window(id)
    }

    /// Closes each window of `ids` under one table lock, as [`Channel::close_window`] does
    /// for one: the drain of each in the order of `ids`, `None` for one that is not open.
    pub fn close_windows(&self, ids: &[WindowId]) -> Vec<Option<WindowDrain>> {
        self.inner.table.close_windows(ids)
    }

    /// Closes every window open to `token`, on every region, at once, and says who used it
    /// ([`ClosedGrant::users`]: complete, since every op admitted before the close
    /// recorded its peer first). `None` when no window of it is open.
    pub fn close_token(&self, token: &GrantToken) -> Option<ClosedGrant> {
        self.inner.table.close_token(token)
    }

    /// The peers whose batches naming `token` were admitted through its windows (at least
    /// one op of the batch inside them, every op of it allowed), by their authenticated
    /// session ids, in id order; empty when no window of the token is open. A peer is
    /// recorded when its batch passed the grant checks, before any byte moved, so one whose
    /// transfer then failed is listed too. For an application that takes a request's
    /// "done" only from the peers that read under its grant.
    pub fn token_users(&self, token: &GrantToken) -> Vec<PeerId> {
        self.inner.table.token_users(token)
    }

    /// Removes a region. New transfers can no longer find it; this waits (within the op
    /// deadline) until no transfer touches it and every peer that mapped it (shared memory)
    /// confirmed unmapping it, or that copies into it by address (cross-memory attach)
    /// confirmed it stopped, so its memory is never written afterwards.
    ///
    /// A peer that does not confirm an unmap in time is not trusted with the region any
    /// longer: its session ends with [`Error::UnmapTimeout`] (its batches in flight fail; it
    /// may reconnect), that session's teardown waits (close deadline) for the peer to close
    /// its shared-memory connection, and when it does not, the region is *detached*: its
    /// bytes move to fresh memory at the same address, out of that peer's reach (do not
    /// write the region locally meanwhile). So with a silent peer this returns after the op
    /// deadline plus that teardown, about `op + control_write + close` at most. Caller
    /// memory cannot be moved: when a peer that knew its address does not confirm, this
    /// fails, and the caller must keep the memory alive while that peer lives
    /// ([`Region::is_tainted`]).
    pub async fn deregister(&self, id: RegionId) -> Result<()> {
        let region = self
            .inner
            .table
            .remove(&id)
            .ok_or_else(|| Error::Local(format!("region {id} is not registered")))?;
        let _ = self.inner.core.send(CoreCmd::MemChanged);
        // Its UCX registration goes once no session grants it (after the running operations).
        #[cfg(feature = "ucx")]
        if let Some(u) = &self.inner.ucx {
            u.deregistered(id).await;
        }
        let limit = self.inner.config.deadlines.op;
        if tokio::time::timeout(limit, region.quiesce()).await.is_ok() {
            return Ok(());
        }
        if region.exports() > 0 && !region.is_detached() {
            // Its pages are about to be replaced at the same address: no UCX operation may
            // start on the old registration.
            #[cfg(feature = "ucx")]
            if let Some(u) = &self.inner.ucx {
                u.revoke_now(id).await;
            }
            // Peers that mapped the region did not confirm unmapping it in time: end their
            // sessions, then cut the region loose from the memory they can still reach.
            crate::session::detach_region(
                &region,
                &self.inner.core,
                &self.inner.config,
                None,
                false,
            )
            .await?;
        }
        if region.in_use() > 0 {
            return Err(Error::Local(format!(
                "region {id} still in use by {} transfers after {limit:?}",
                region.in_use()
            )));
        }
        if region.cma_exports() > 0 {
            return Err(Error::Local(format!(
                "region {id}: {} peers did not confirm within {limit:?} that they stopped \
                 copying into it (cross-memory attach); keep its memory alive",
                region.cma_exports()
            )));
        }
        Ok(())
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> CoreCmd) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.inner.core.send(make(tx)).map_err(|_| Error::Closed)?;
        rx.await.map_err(|_| Error::Closed)
    }

    /// Connects to the listener at `addr` (`host:port`) and returns its peer id. Lazy and
    /// idempotent: an established session is reused, and concurrent callers share one
    /// handshake.
    pub async fn connect(&self, addr: &str) -> Result<PeerId> {
        if self
            .inner
            .config
            .tls
            .as_ref()
            .is_some_and(|t| t.trusted.is_none())
        {
            return Err(Error::Local(format!(
                "TLS is on but no certificate to trust is set (KVBRIDGE_TLS_CA): cannot dial {addr}"
            )));
        }
        let addr = addr.to_string();
        let h = self.ask(|reply| CoreCmd::Connect { addr, reply }).await??;
        Ok(h.peer_id)
    }

    async fn handle(&self, peer: &PeerId) -> Result<PeerHandle> {
        let peer = peer.clone();
        let p2 = peer.clone();
        self.ask(|reply| CoreCmd::Lookup { peer, reply })
            .await?
            .ok_or(Error::UnknownPeer {
                peer: p2.to_string(),
            })
    }

    /// Checks a batch against the peer's regions and our limits; returns its op headers,
    /// its local ranges (held in use; `writes`: the batch writes into them) and its payload
    /// bytes.
    fn prepare(
        &self,
        h: &PeerHandle,
        ops: &[Op],
        writes: bool,
    ) -> Result<(Vec<OpDesc>, Vec<LocalSlice>, u64)> {
        let limits = &self.inner.config.limits;
        let invalid = |detail: String| Error::InvalidOp {
            peer: h.peer_id.to_string(),
            detail,
        };
        if ops.len() > limits.max_ops_per_batch {
            return Err(invalid(format!(
                "{} ops in one batch, limit {}",
                ops.len(),
                limits.max_ops_per_batch
            )));
        }
        let remote = h.remote.read().expect("remote regions poisoned");
        let mut descs = Vec::with_capacity(ops.len());
        let mut slices = Vec::with_capacity(ops.len());
        let mut total = 0u64;
        for (i, op) in ops.iter().enumerate() {
            if !op.local.contains(op.local_offset as u64, op.len as u64) {
                return Err(invalid(format!(
                    "op {i}: {} bytes at local offset {} outside local region {} of {} bytes",
                    op.len,
                    op.local_offset,
                    op.local.id(),
                    op.local.len()
                )));
            }
            let Some(r) = remote.get(&op.remote) else {
                return Err(invalid(format!(
                    "op {i}: region {} is not granted by the peer",
                    op.remote
                )));
            };
            let d = OpDesc {
                region: op.remote,
                offset: op.remote_offset,
                len: op.len as u64,
            };
            if !d.in_bounds(r.len) {
                return Err(invalid(format!(
                    "op {i}: {} bytes at remote offset {} outside region {} of {} bytes",
                    op.len, op.remote_offset, op.remote, r.len
                )));
            }
            total += op.len as u64;
            descs.push(d);
            slices.push(LocalSlice {
                region: if writes {
                    op.local.begin_write()
                } else {
                    op.local.begin_use()
                },
                offset: op.local_offset,
                len: op.len,
            });
        }
        if total > limits.max_batch_bytes {
            return Err(invalid(format!(
                "batch of {total} bytes, limit {}",
                limits.max_batch_bytes
            )));
        }
        if total > limits.max_bytes_in_flight_per_peer {
            return Err(invalid(format!(
                "batch of {total} bytes can never fit the limit of {} bytes in flight per peer",
                limits.max_bytes_in_flight_per_peer
            )));
        }
        Ok((descs, slices, total))
    }

    /// Writes every op's local bytes into the peer's regions; returns when the whole batch
    /// has landed (or failed, with a typed error naming the peer and the step).
    pub async fn write(&self, peer: &PeerId, ops: &[Op]) -> Result<()> {
        let h = self.handle(peer).await?;
        self.write_on(&h, ops, None).await
    }

    /// [`Channel::write`] naming `token`: the peer admits an op on a region whose writes it
    /// confines to windows when the op lies inside the windows open to that token (or to
    /// us), and records us as a user of the token. Goes over TCP (only the peer can check
    /// a token), also where shared memory or UCX reach the region. A peer whose build
    /// predates grant tokens fails the call with [`Error::Incompatible`] before anything
    /// is sent.
    pub async fn write_with_grant(
        &self,
        peer: &PeerId,
        token: GrantToken,
        ops: &[Op],
    ) -> Result<()> {
        let h = self.handle(peer).await?;
        self.write_on(&h, ops, Some(token)).await
    }

    async fn write_on(&self, h: &PeerHandle, ops: &[Op], grant: Option<GrantToken>) -> Result<()> {
        let (descs, sources, _) = self.prepare(h, ops, false)?;
        h.data
            .transfer(
                crate::dir::Dir::Write,
                self.inner.config.deadlines.op,
                descs,
                sources,
                grant,
            )
            .await
    }

    /// Reads every op's remote bytes into the local regions; returns when all have landed.
    pub async fn read(&self, peer: &PeerId, ops: &[Op]) -> Result<()> {
        let h = self.handle(peer).await?;
        self.read_on(&h, ops, None).await
    }

    /// [`Channel::read`] naming `token` (see [`Channel::write_with_grant`]): reads of a
    /// region whose reads the peer confines to windows
    /// ([`Permission::reads_in_windows`]) are served when they lie inside the windows open
    /// to that token (or to us).
    pub async fn read_with_grant(
        &self,
        peer: &PeerId,
        token: GrantToken,
        ops: &[Op],
    ) -> Result<()> {
        let h = self.handle(peer).await?;
        self.read_on(&h, ops, Some(token)).await
    }

    async fn read_on(&self, h: &PeerHandle, ops: &[Op], grant: Option<GrantToken>) -> Result<()> {
        let limit = self.inner.config.deadlines.op;
        // A local region being detached from shared memory is being copied: bytes read into
        // it now would be lost, so the batch waits for the copy to end.
        let (descs, dests) = loop {
            let (descs, dests, _) = self.prepare(h, ops, true)?;
            match dests
                .iter()
                .map(|d| d.region.region())
                .find(|r| r.detaching())
            {
                Some(r) => {
                    let r = r.clone();
                    drop(dests);
                    r.wait_not_detaching(limit).await;
                }
                None => break (descs, dests),
            }
        };
        h.data
            .transfer(
                crate::dir::Dir::Read,
                self.inner.config.deadlines.op,
                descs,
                dests,
                grant,
            )
            .await
    }

    /// Sends a small message to the peer's application. It is delivered after every write
    /// this channel issued to that peer before it; returns once the peer received it.
    pub async fn notify(&self, peer: &PeerId, data: &[u8]) -> Result<()> {
        self.notify_queued(peer, data).await?.delivered().await
    }

    /// [`Channel::notify`] without waiting for the peer: returns once the notification is
    /// queued behind every write issued to that peer before it (a write or notification
    /// issued after this returns follows it; with several data connections, once those
    /// writes completed), with its confirmation still to come
    /// ([`QueuedNotify::delivered`], under the channel's op deadline counted from now). A
    /// sender that notifies after each of a run of writes thus pays no round trip per
    /// write, and learns of a failure at the latest when it awaits the confirmation.
    pub async fn notify_queued(&self, peer: &PeerId, data: &[u8]) -> Result<QueuedNotify> {
        let h = self.handle(peer).await?;
        self.notify_queued_on(&h, data).await
    }

    /// [`Channel::notify_queued`] with no confirmation at all: the peer sends no
    /// acknowledgement, so neither side pays a send and a wake-up for one. For a
    /// notification that a later answer on the same session confirms anyway (frames are
    /// handled in order, so an answer to a later request means this one was delivered),
    /// such as a chunk's "written" ahead of the transfer's final round trip. A session that
    /// ends before the peer read it loses it; the later request then fails with the
    /// session. With a peer that predates this, it is an ordinary notification whose
    /// confirmation nobody awaits.
    pub async fn notify_posted(&self, peer: &PeerId, data: &[u8]) -> Result<()> {
        let h = self.handle(peer).await?;
        self.notify_posted_on(&h, data).await
    }

    async fn notify_posted_on(&self, h: &PeerHandle, data: &[u8]) -> Result<()> {
        self.check_notify_len(h, data)?;
        h.data.wait_earlier(self.inner.config.deadlines.op).await?;
        h.data
            .notify_posted(self.inner.config.deadlines.op, data.to_vec())
            .await
    }

    fn check_notify_len(&self, h: &PeerHandle, data: &[u8]) -> Result<()> {
        if data.len() > self.inner.config.limits.max_notify_len {
            return Err(Error::InvalidOp {
                peer: h.peer_id.to_string(),
                detail: format!(
                    "notification of {} bytes, limit {}",
                    data.len(),
                    self.inner.config.limits.max_notify_len
                ),
            });
        }
        Ok(())
    }

    async fn notify_queued_on(&self, h: &PeerHandle, data: &[u8]) -> Result<QueuedNotify> {
        self.check_notify_len(h, data)?;
        let data = data.to_vec();
        // With several data connections (or a direct copy running), earlier writes may
        // still be in flight: the notification leaves only once they all completed.
        h.data.wait_earlier(self.inner.config.deadlines.op).await?;
        let submitted = h.data.notify(self.inner.config.deadlines.op, data).await?;
        Ok(QueuedNotify(submitted))
    }

    /// The current session with a connected `peer`, looked up once: see [`PeerLink`].
    pub async fn link(&self, peer: &PeerId) -> Result<PeerLink> {
        Ok(PeerLink {
            channel: self.clone(),
            handle: self.handle(peer).await?,
        })
    }

    /// Ends the session with `peer` from our side (the peer hears a `Bye` with `reason`).
    /// Returns once the session is torn down: no byte of it lands after that. Batches in
    /// flight on it fail with [`Error::Disconnected`].
    pub async fn disconnect(&self, peer: &PeerId, reason: &str) -> Result<()> {
        let limit = self.inner.config.deadlines.close;
        let (peer, reason) = (peer.clone(), reason.to_string());
        let p = peer.to_string();
        match tokio::time::timeout(
            limit,
            self.ask(|reply| CoreCmd::Disconnect {
                peer,
                reason,
                reply,
            }),
        )
        .await
        {
            Ok(r) => r?,
            Err(_) => Err(Error::Timeout {
                peer: p,
                step: Step::Close,
                after: limit,
            }),
        }
    }

    /// Subscribes to session ups and downs (from now on; a slow subscriber that falls more
    /// than 1024 events behind sees `Lagged`).
    pub fn peer_events(&self) -> tokio::sync::broadcast::Receiver<PeerEvent> {
        self.inner.events.subscribe()
    }

    /// The next notification from any peer; `None` once the channel is closed (and every
    /// notification received before was taken).
    ///
    /// Each peer's notifications wait in a queue of their own, and the peers take turns:
    /// with `n` peers holding notifications, each one's next is returned within `n` calls,
    /// however many another peer sent (`Limits::max_notifications_per_peer` explains the
    /// bounds). Cancel-safe: a call dropped before it returned took nothing.
    pub async fn recv_notification(&self) -> Option<Notification> {
        self.inner.notifications.take().await
    }

    /// The regions a connected peer grants us.
    pub async fn peer_regions(&self, peer: &PeerId) -> Result<Vec<RegionInfo>> {
        let h = self.handle(peer).await?;
        let map = h.remote.read().expect("remote regions poisoned");
        let mut v: Vec<RegionInfo> = map.values().cloned().collect();
        v.sort_by_key(|r| r.id);
        Ok(v)
    }

    /// Which transport carries our batches to a connected peer: [`crate::config::Transport::Shm`]
    /// when it mapped at least one of the peer's regions for us (batches naming only mapped
    /// regions are copied; others go over TCP), [`crate::config::Transport::Ucx`] when it imported
    /// at least one of the peer's regions over UCX, else [`crate::config::Transport::Tcp`].
    pub async fn peer_transport(&self, peer: &PeerId) -> Result<crate::config::Transport> {
        let h = self.handle(peer).await?;
        #[cfg(feature = "ucx")]
        if h.data.carried_by("ucx") {
            return Ok(crate::config::Transport::Ucx);
        }
        Ok(match &h.shm {
            Some(s) if s.len() > 0 => crate::config::Transport::Shm,
            _ => crate::config::Transport::Tcp,
        })
    }

    /// Whether cross-memory attach carries our batches to a connected peer's regions that
    /// cannot be mapped (its caller memory), or why not (then TCP carries them).
    pub async fn peer_cma(&self, peer: &PeerId) -> Result<crate::transport::cma::CmaStatus> {
        let h = self.handle(peer).await?;
        Ok(match &h.shm {
            Some(s) => s.cma_status(),
            None => crate::transport::cma::CmaStatus::Off(
                "no shared-memory connection to the peer (not on this host, or TCP forced)".into(),
            ),
        })
    }

    /// The incarnation of a connected peer.
    pub async fn peer_incarnation(&self, peer: &PeerId) -> Result<Incarnation> {
        Ok(self.handle(peer).await?.incarnation)
    }

    /// What the channel holds right now.
    pub async fn stats(&self) -> Result<Stats> {
        self.ask(|reply| CoreCmd::Stats { reply }).await
    }

    /// Closes every session (work in flight fails with [`Error::Closed`]) and stops
    /// accepting. Bounded by the close deadline.
    pub async fn close(&self) {
        let limit = self.inner.config.deadlines.close;
        // The core answers once every session has said Bye and torn down.
        let _ = tokio::time::timeout(limit, self.ask(|reply| CoreCmd::Close { reply })).await;
        let tasks: Vec<JoinHandle<()>> = self
            .inner
            .tasks
            .lock()
            .expect("tasks poisoned")
            .drain(..)
            .collect();
        for t in &tasks {
            t.abort();
        }
        // The listening sockets belong to the accept tasks: an aborted task drops them only
        // when the runtime next polls it. Waiting for that frees the port before close
        // returns, so a restart on the same address can bind it at once.
        let until = tokio::time::Instant::now() + limit;
        for t in tasks {
            let _ = tokio::time::timeout_at(until, t).await;
        }
    }
}

/// What to warn about when a listener is reachable beyond this host without a secret:
/// every peer that reaches it may then read and write every region granted to all peers.
fn exposure_warning(addr: SocketAddr, secret: bool) -> Option<String> {
    (!secret && !addr.ip().is_loopback()).then(|| {
        format!(
            "listening on {addr}, beyond this host, without a shared secret: any peer that \
             reaches this address may read and write every region granted to all peers; \
             set KVBRIDGE_SECRET (and TLS), or listen on a loopback address"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listener_beyond_loopback_without_a_secret_is_warned_about() {
        let open: SocketAddr = "0.0.0.0:8300".parse().unwrap();
        let w = exposure_warning(open, false).expect("a warning");
        assert!(
            w.contains("0.0.0.0:8300") && w.contains("KVBRIDGE_SECRET"),
            "{w}"
        );
        assert_eq!(exposure_warning(open, true), None);
        assert_eq!(
            exposure_warning("127.0.0.1:1".parse().unwrap(), false),
            None
        );
        assert_eq!(exposure_warning("[::1]:1".parse().unwrap(), false), None);
    }
}
