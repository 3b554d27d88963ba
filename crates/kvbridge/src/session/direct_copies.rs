//! The same-host sub-protocol of a session: shared memory and cross-memory attach.
//!
//! The listener offers its regions over a unix socket (`ShmOffer` in the handshake, then
//! `ShmMap`/`ShmSync`/`ShmUnmap` with the memfd passed by `SCM_RIGHTS`); the initiator maps
//! them and copies into them directly, and (when both allow it) first reads a canary by
//! cross-memory attach so that regions without a memfd are reached by address (the probe's
//! rules are `kvbridge_proto::same_host`'s machines, driven here). Revoking a
//! region waits for the peer's word that no copy into it runs. The session task owns all of
//! this state ([`ShmState`]) and lends it what it needs of the session for each step
//! ([`ShmRound`]).

use crate::cmd::CoreCmd;
use crate::config::{ChannelConfig, Transport};
use crate::error::{Error, Result};
use crate::grant::RegionTable;
use crate::region::{AbandonedExport, Region, RegionExport};
use crate::transport::cma::CmaStatus;
use crate::transport::shm::{DirectCopyCounters, FdReader, Mapping, ShmPeer};
use kvbridge_proto::handshake::{Established, Step};
use kvbridge_proto::msg::{DataHello, Message, Ready, RegionInfo, ShmOffer, ShmRegion, ShmRevoke};
use kvbridge_proto::same_host::{CmaOffer, CmaProber, OfferOutput, ProberOutput};
use kvbridge_proto::{PeerId, RegionId, SessionToken};
use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What the same-host sub-protocol needs of its session for one step: the session lends
/// these for the call, and [`ShmState`] keeps none of them.
pub(super) struct ShmRound<'a> {
    /// This session's id (`SessionCmd::EndIfMapping` spares the calling session).
    pub(super) session: u64,
    /// The peer's name, for errors and logs.
    pub(super) peer: &'a str,
    /// The peer, once known.
    pub(super) peer_id: Option<&'a PeerId>,
    /// This side's peer id (presented on the shared-memory connection).
    pub(super) me: &'a PeerId,
    /// (Listener) Whether the peer authenticated, so that its connections may be served.
    pub(super) may_bind: bool,
    pub(super) config: &'a ChannelConfig,
    /// The channel's grants.
    pub(super) table: &'a RegionTable,
    /// The channel core (a detach asks it to end the sessions that still map a region).
    pub(super) core: &'a mpsc::UnboundedSender<CoreCmd>,
    /// The channel's counts of direct copies.
    pub(super) counters: &'a Arc<DirectCopyCounters>,
    /// The peer's regions, as its latest `MemInfo` announced them.
    pub(super) remote: &'a RwLock<HashMap<RegionId, RegionInfo>>,
}

impl ShmRound<'_> {
    /// The lengths of the peer's regions (every offer is checked against them).
    fn remote_lengths(&self) -> Vec<(RegionId, u64)> {
        let map = self.remote.read().expect("remote regions poisoned");
        map.values().map(|r| (r.id, r.len)).collect()
    }
}

/// A session's shared-memory state.
#[derive(Default)]
pub(super) struct ShmState {
    /// (Listener) A shared-memory connection waiting for the peer to authenticate.
    pub(super) parked: Option<tokio::net::UnixStream>,
    /// (Listener) The bound shared-memory connection.
    pub(super) conn: Option<Arc<tokio::net::UnixStream>>,
    /// (Listener) Frames from the peer on it, read by `reader`.
    pub(super) rx: Option<mpsc::Receiver<std::io::Result<Option<Message>>>>,
    /// (Either) The task reading the shared-memory connection.
    pub(super) reader: Option<JoinHandle<()>>,
    /// (Listener) Regions the peer mapped.
    pub(super) exports: HashMap<RegionId, RegionExport>,
    /// (Listener) Regions the peer was asked to unmap and has not confirmed yet.
    pub(super) revoking: HashMap<RegionId, RegionExport>,
    /// (Initiator) The listener's regions we mapped.
    pub(super) peer: Option<Arc<ShmPeer>>,
    /// (Initiator) Set once the listener offered every region it grants us.
    pub(super) synced: Option<tokio::sync::watch::Receiver<bool>>,
    /// (Initiator) The established session, held until shared memory is synced (or its
    /// deadline passed).
    pub(super) pending_ready: Option<(Established, Instant)>,
    /// (Listener) Where cross-memory attach stands with the peer (the probe's machine,
    /// made when the connection is bound).
    pub(super) cma: Option<CmaOffer>,
    /// (Listener) The canary the peer is asked to read; kept for the whole session, so
    /// its address never names freed memory while the peer may still read it.
    pub(super) canary: Option<Box<[u8; CANARY_LEN]>>,
}

/// Bytes of the cross-memory-attach canary.
const CANARY_LEN: usize = 32;

impl ShmState {
    /// (Initiator) Uses the listener's shared-memory offer when the configuration allows it
    /// and the listener is on this host; fails the session when shm is required and cannot
    /// be had.
    pub(super) fn start(
        &mut self,
        cx: &ShmRound<'_>,
        offer: Option<ShmOffer>,
        token: SessionToken,
    ) -> Result<()> {
        let want = cx.config.transport;
        if matches!(want, Transport::Tcp | Transport::Ucx)
            || !matches!(cx.config.net, crate::net::Net::Tokio)
        {
            return Ok(());
        }
        let ours = crate::transport::shm::host_id();
        let usable = match (&offer, &ours) {
            (Some(o), Some(h)) if &o.host == h => Ok(o.clone()),
            (None, _) => Err("the listener offers no shared memory".to_string()),
            (Some(o), _) => Err(format!("the listener is on host {}", o.host)),
        };
        let offer = match usable {
            Ok(o) => o,
            Err(why) if want == Transport::Shm => {
                return Err(Error::Incompatible {
                    peer: cx.peer.to_string(),
                    step: Step::Welcome,
                    ours: format!("transport shm on host {}", ours.unwrap_or_default()),
                    theirs: why,
                })
            }
            Err(why) => {
                tracing::debug!(peer = %cx.peer, "shared memory not used: {why}");
                return Ok(());
            }
        };
        let cma_status = if !cx.config.cma {
            CmaStatus::Off("disabled by configuration (KVBRIDGE_CMA=0)".into())
        } else if !offer.cma {
            CmaStatus::Off(
                "the listener offers no cross-memory attach (off there, or an older version)"
                    .into(),
            )
        } else {
            CmaStatus::Off("the probe has not completed".into())
        };
        let ask = cx.config.cma && offer.cma;
        let deny = cx.config.hooks.cma_deny;
        let peer = Arc::new(ShmPeer::new(cx.counters.clone(), cma_status));
        peer.set_max_mapped(cx.config.limits.max_shm_mapped_per_peer);
        peer.announce(cx.remote_lengths());
        let wait = cx.config.deadlines.handshake_step;
        let (synced_tx, synced_rx) = tokio::sync::watch::channel(false);
        self.peer = Some(peer.clone());
        self.synced = Some(synced_rx);
        let me = cx.me.clone();
        let limit = cx.config.deadlines.connect;
        let max = cx.config.limits.max_frame_len;
        let name = cx.peer.to_string();
        self.reader = Some(tokio::spawn(async move {
            let mut conn = None;
            let r = async {
                let pid = offer.pid;
                let s = conn.insert(connect_shm(offer, token, me, limit).await?);
                let cma = ask.then(|| CmaAsk {
                    pid,
                    uid: crate::transport::shm::peer_uid(s),
                    deny,
                    peer: name.clone(),
                });
                initiator_shm(s, max, wait, &peer, synced_tx, cma).await
            }
            .await;
            if let Err(e) = r {
                tracing::warn!(peer = %name, error = %e, "shared memory connection ended; TCP carries the data");
            }
            // The listener takes the end of this connection as our word that no copy into
            // its regions runs or will start: stop them all before it ends (the connection
            // is closed only after, when `conn` drops).
            let p = peer.clone();
            let _ = tokio::task::spawn_blocking(move || p.revoke_all()).await;
            drop(conn);
        }));
        Ok(())
    }

    /// (Listener) Binds an authenticated shared-memory connection.
    pub(super) fn bind(&mut self, cx: &ShmRound<'_>, s: tokio::net::UnixStream) {
        let s = Arc::new(s);
        let (tx, rx) = mpsc::channel(64);
        let r = s.clone();
        let max = cx.config.limits.max_frame_len;
        self.reader = Some(tokio::spawn(async move {
            // The initiator passes no descriptor.
            let mut fr = FdReader::new(max, 0);
            loop {
                let m = fr.next(&r).await;
                let stop = !matches!(m, Ok(Some(_)));
                if tx.send(m).await.is_err() || stop {
                    return;
                }
            }
        }));
        self.conn = Some(s);
        self.rx = Some(rx);
    }

    /// (Listener) Offers the peer every shared region granted to it that it has not mapped,
    /// and asks it to unmap those no longer granted.
    pub(super) async fn sync_exports(&mut self, cx: &ShmRound<'_>) -> Result<()> {
        let (Some(conn), Some(peer)) = (self.conn.clone(), cx.peer_id) else {
            return Ok(());
        };
        if !cx.may_bind {
            return Ok(());
        }
        let cma = self.cma.as_ref().is_some_and(CmaOffer::cma_on);
        let granted = cx.table.direct_copy_regions_for(peer, cma);
        let lost = |e| Error::lost(cx.peer, Step::Established, e);
        let gone: Vec<RegionId> = self
            .exports
            .keys()
            .filter(|id| !granted.iter().any(|r| r.id() == **id))
            .copied()
            .collect();
        for id in gone {
            let ex = self.exports.remove(&id).expect("listed");
            self.revoking.insert(id, ex);
            crate::transport::shm::send_frame(&conn, &Message::ShmUnmap(ShmRevoke { id }), None)
                .await
                .map_err(lost)?;
        }
        for r in granted {
            if self.exports.contains_key(&r.id()) || self.revoking.contains_key(&r.id()) {
                continue;
            }
            let m = crate::transport::shm::map_msg(r.id(), r.len() as u64);
            // The export is counted before the descriptor leaves.
            let ex = r.begin_export();
            let Some(fd) = r.memfd() else {
                ex.confirmed();
                if cma && r.wants_cma() {
                    // Counted before the address leaves (cma.rs, *Safety of unmapping*).
                    let ex = r.begin_cma_export();
                    let m = crate::transport::shm::cma_map_msg(
                        r.id(),
                        r.len() as u64,
                        r.as_ptr() as u64,
                    );
                    let sent = crate::transport::shm::send_frame(&conn, &m, None).await;
                    self.exports.insert(r.id(), ex);
                    sent.map_err(lost)?;
                }
                continue;
            };
            let sent = crate::transport::shm::send_frame(&conn, &m, Some(fd.as_raw_fd())).await;
            drop(fd);
            self.exports.insert(r.id(), ex);
            sent.map_err(lost)?;
        }
        // No sync while the probe is open: the one after its verdict covers the regions
        // offered by address (`kvbridge_proto::same_host`).
        if self.cma.as_ref().is_some_and(|c| !c.may_sync()) {
            return Ok(());
        }
        crate::transport::shm::send_frame(&conn, &Message::ShmSync(Ready {}), None)
            .await
            .map_err(lost)
    }

    /// (Listener) A message of the cross-memory-attach probe (`CmaAsk`, `CmaProbed`): the
    /// machine decides, this carries out what it asks (a canary, its address to the peer,
    /// the verdict logged and the exports synced again).
    async fn on_probe(&mut self, cx: &ShmRound<'_>, m: Message) -> Result<()> {
        let Some(conn) = self.conn.clone() else {
            return Ok(());
        };
        let offer = self.cma.get_or_insert_with(|| CmaOffer::new(cx.config.cma));
        offer.handle_message(m);
        let mut resync = false;
        while let Some(o) = offer.poll_output() {
            match o {
                OfferOutput::MakeCanary => {
                    let mut c = Box::new([0u8; CANARY_LEN]);
                    crate::random::rand_bytes(&mut c[..]);
                    offer.canary(c.as_ptr() as u64, c.to_vec());
                    self.canary = Some(c);
                }
                OfferOutput::Send(m) => crate::transport::shm::send_frame(&conn, &m, None)
                    .await
                    .map_err(|e| Error::lost(cx.peer, Step::Established, e))?,
                OfferOutput::Verdict {
                    on,
                    why,
                    read_failed,
                } => {
                    match (on, why) {
                        (false, Some(why)) if read_failed => {
                            crate::transport::cma::log_refused(cx.peer, &why)
                        }
                        (false, why) => {
                            tracing::warn!(peer = %cx.peer, "cross-memory attach not used: {}", why.unwrap_or_default())
                        }
                        (true, _) => {}
                    }
                    resync = true;
                }
                OfferOutput::Failed(e) => {
                    return Err(Error::PeerMisbehaved {
                        peer: cx.peer.to_string(),
                        step: Step::Established,
                        detail: e.to_string(),
                    })
                }
            }
        }
        if resync {
            self.sync_exports(cx).await?;
        }
        Ok(())
    }

    /// (Listener) A frame on the shared-memory connection.
    pub(super) async fn on_frame(
        &mut self,
        cx: &ShmRound<'_>,
        m: Option<std::io::Result<Option<Message>>>,
    ) -> Result<()> {
        match m {
            Some(Ok(Some(m @ (Message::CmaAsk(_) | Message::CmaProbed(_))))) => {
                self.on_probe(cx, m).await
            }
            Some(Ok(Some(Message::ShmUnmapped(ShmRevoke { id })))) => {
                if let Some(ex) = self.revoking.remove(&id) {
                    ex.confirmed();
                }
                Ok(())
            }
            Some(Ok(Some(other))) => Err(Error::PeerMisbehaved {
                peer: cx.peer.to_string(),
                step: Step::Established,
                detail: format!("{} on the shared-memory connection", other.name()),
            }),
            // The peer closed it: it does so only once nothing of ours is mapped any more. A
            // reset is a close too: the peer's end closed with frames of ours unread (a
            // process killed between our ShmSync and its read gives that).
            Some(Err(e)) if closed_by_peer(&e) => {
                self.confirm_all();
                self.rx = None;
                self.conn = None;
                Ok(())
            }
            Some(Ok(None)) => {
                self.confirm_all();
                self.rx = None;
                self.conn = None;
                Ok(())
            }
            Some(Err(e)) => Err(Error::lost(cx.peer, Step::Established, e)),
            None => {
                self.rx = None;
                Ok(())
            }
        }
    }

    pub(super) fn confirm_all(&mut self) {
        for (_, ex) in self.exports.drain().chain(self.revoking.drain()) {
            ex.confirmed();
        }
    }

    /// Teardown of shared memory, after the data tasks stopped. (Listener) waits, within the
    /// close deadline, for the peer to close the connection — its word that nothing of ours
    /// is mapped any more; the regions of exports it did not confirm are detached, safely
    /// for the other peers that map them ([`detach_region`]). (Initiator) revokes every
    /// mapping, which waits for the direct copies still running (callers copy their writes
    /// themselves, through `DataPath`'s one-sided backends) and refuses new ones, then ends
    /// the connection task; our mappings go with the last handle.
    pub(super) async fn end(&mut self, cx: &ShmRound<'_>) {
        if let Some(p) = self.peer.clone() {
            let _ = tokio::task::spawn_blocking(move || p.revoke_all()).await;
        }
        if let Some(mut rx) = self.rx.take() {
            let limit = cx.config.deadlines.close;
            let wait = async {
                loop {
                    match rx.recv().await {
                        Some(Ok(Some(Message::ShmUnmapped(ShmRevoke { id })))) => {
                            if let Some(ex) = self.revoking.remove(&id) {
                                ex.confirmed();
                            }
                        }
                        Some(Ok(Some(_))) => {}
                        Some(Ok(None)) => return true,
                        Some(Err(e)) if closed_by_peer(&e) => return true,
                        Some(Err(_)) | None => return false,
                    }
                }
            };
            if let Ok(true) = tokio::time::timeout(limit, wait).await {
                self.confirm_all();
            }
        }
        if self.exports.is_empty() && self.revoking.is_empty() {
            self.confirm_all();
        }
        // Whatever is left was not confirmed: the peer may still copy into those regions.
        // Every one is abandoned first, so that no detach below waits for another of ours.
        let left: Vec<AbandonedExport> = self
            .exports
            .drain()
            .chain(self.revoking.drain())
            .filter_map(|(_, ex)| ex.abandon())
            .collect();
        for ab in left {
            tracing::warn!(peer = %cx.peer, region = %ab.region().id(),
                "the peer did not confirm unmapping a region before its session ended; detaching the region");
            match detach_region(ab.region(), cx.core, cx.config, Some(cx.session), true).await {
                Ok(()) => ab.finish(),
                // Dropping it tries the bare detach once more.
                Err(e) => {
                    tracing::error!(peer = %cx.peer, error = %e, "region not detached")
                }
            }
        }
        self.conn = None;
        if let Some(h) = self.reader.take() {
            h.abort();
            let _ = h.await;
        }
    }
}

/// Detaches a shared region that a peer may still copy into (it did not confirm unmapping
/// it), without losing a write of any *other* peer.
///
/// A detach copies the region's bytes to fresh memory at the same address; every mapping
/// of the memfd, the other peers' included, reaches only the old pages from then on. So
/// first no peer may be copying into the region on behalf of a live session:
///
/// 1. The region is withdrawn from shared memory, for good: nobody maps it any more, and
///    peers reach it over TCP (also after they reconnect).
/// 2. (`ask_first`) Every session re-syncs its exports, which asks each peer that maps the
///    region to unmap it (`ShmUnmap`); a peer confirms only once no copy of its runs or can
///    start (its later batches on that region go over TCP). This waits for the op deadline.
/// 3. Sessions whose peer still did not confirm are ended ([`SessionCmd::EndIfMapping`](crate::cmd::SessionCmd::EndIfMapping),
///    [`Error::UnmapTimeout`]); each session's teardown waits for its peer to close the
///    shared-memory connection, and abandons the export when it does not. This waits for
///    as long as such a teardown takes.
/// 4. The region is detached with writers over TCP held back ([`Region::detach_quiesced`]).
///
/// Exports that were abandoned (here or by other sessions) are not waited for: their peers
/// are the silent ones, and their copies are what the detach cuts loose. `except` is the
/// calling session, which is tearing down and answers no command.
pub(crate) async fn detach_region(
    region: &Region,
    core: &mpsc::UnboundedSender<CoreCmd>,
    config: &ChannelConfig,
    except: Option<u64>,
    ask_first: bool,
) -> Result<()> {
    let d = &config.deadlines;
    region.withdraw();
    if ask_first && region.live_exports() > 0 {
        let _ = core.send(CoreCmd::MemChanged);
        let _ = tokio::time::timeout(d.op, region.wait_for(|r| r.live_exports() == 0)).await;
    }
    if region.live_exports() > 0 {
        let _ = core.send(CoreCmd::EndMappers {
            region: region.id(),
            except,
            after: d.op,
        });
        // An ended session's teardown: its Bye, a brief flush, then up to the close
        // deadline for the peer's close (or it abandons the export, which ends this wait).
        let limit = d.control_write + d.close + Duration::from_secs(1);
        let ended = region.wait_for(|r| r.live_exports() == 0);
        if tokio::time::timeout(limit, ended).await.is_err() {
            tracing::error!(region = %region.id(), live = region.live_exports(),
                "peers still map the region after their sessions were ended; detaching it anyway");
        }
    }
    region.detach_quiesced(d.op).await
}

/// (Initiator) Connects the shared-memory connection and proves the session token. The
/// caller owns it, and closes it only after every mapping is revoked (the listener takes the
/// close as our word that nothing of its is mapped any more).
async fn connect_shm(
    offer: ShmOffer,
    token: SessionToken,
    me: PeerId,
    limit: Duration,
) -> std::io::Result<tokio::net::UnixStream> {
    let s = tokio::time::timeout(
        limit,
        crate::transport::shm::connect(&offer.socket, offer.pid),
    )
    .await
    .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    let hello = Message::DataHello(DataHello {
        token,
        peer_id: me,
        stream: 0,
    });
    crate::transport::shm::send_frame(&s, &hello, None).await?;
    Ok(s)
}

/// (Initiator) What it needs to ask for cross-memory attach.
struct CmaAsk {
    /// The listener's pid (checked against the unix socket's credentials).
    pid: u32,
    /// The listener's user, for the reason when the kernel refuses.
    uid: Option<u32>,
    /// Test hook: fail the probe as the kernel would without permission.
    deny: bool,
    /// For the log.
    peer: String,
}

/// (Initiator) Serves the shared-memory connection: maps what the listener offers, unmaps
/// what it revokes, and (with `cma`) probes cross-memory attach first.
async fn initiator_shm(
    s: &tokio::net::UnixStream,
    max: u32,
    wait: Duration,
    peer: &Arc<ShmPeer>,
    synced: tokio::sync::watch::Sender<bool>,
    cma: Option<CmaAsk>,
) -> std::io::Result<()> {
    // One descriptor per `ShmMap`, none with anything else.
    let mut fr = FdReader::new(max, 1);
    // With `cma`, the first `ShmSync` (the listener bound this connection to the session:
    // a frame sent before that could be read by its acceptor and lost) is answered with
    // `CmaAsk`, and the probe must be answered before a `ShmSync` is the last word: the
    // listener sends none between its canary and our answer, and the one after covers the
    // regions it offers by address.
    let mut prober = CmaProber::new(cma.is_some());
    while let Some(m) = fr.next(s).await? {
        match m {
            m @ (Message::CmaProbe(_) | Message::ShmSync(_)) => {
                prober.handle_message(m);
                while let Some(o) = prober.poll_output() {
                    match o {
                        ProberOutput::Send(m) => {
                            crate::transport::shm::send_frame(s, &m, None).await?
                        }
                        ProberOutput::ReadCanary { addr, len } => {
                            // The machine asks only with `cma` set.
                            let read = match &cma {
                                Some(ask) => read_canary(ask, peer, addr, len as usize),
                                None => Err("cross-memory attach not asked for".into()),
                            };
                            prober.probed(read);
                        }
                        ProberOutput::Synced => {
                            let _ = synced.send(true);
                        }
                        ProberOutput::Failed(e) => {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::InvalidData,
                                e.to_string(),
                            ))
                        }
                    }
                }
            }
            Message::ShmMap(ShmRegion {
                id,
                len,
                addr: Some(addr),
            }) => {
                if !peer.insert_cma(id, addr, len) {
                    tracing::debug!(region = %id, "region offered by address, cross-memory attach not usable; TCP carries it");
                }
            }
            Message::ShmMap(r) => {
                let fd = fr.take_fd().ok_or_else(|| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        "ShmMap without a descriptor",
                    )
                })?;
                match peer.admit_map(r.id, r.len, wait).await {
                    Ok(()) => match Mapping::map(&fd, r.len) {
                        Ok(m) => peer.insert(r.id, m),
                        // Not fatal: this region goes over TCP.
                        Err(e) => {
                            tracing::warn!(region = %r.id, error = %e, "cannot map region; TCP carries it")
                        }
                    },
                    Err(e @ crate::transport::shm::MapRefused::LongerThanAnnounced { .. }) => {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            e.to_string(),
                        ))
                    }
                    Err(e) => tracing::warn!(region = %r.id, error = %e, "TCP carries the region"),
                }
            }
            Message::ShmUnmap(ShmRevoke { id }) => {
                let p = peer.clone();
                // Waits for a copy in progress (bounded by one op's memcpy).
                let _ = tokio::task::spawn_blocking(move || p.revoke(&id)).await;
                crate::transport::shm::send_frame(s, &crate::transport::shm::unmapped(id), None)
                    .await?;
            }
            Message::Reject(rj) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    format!("{}: {}", rj.code, rj.message),
                ))
            }
            other => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("{} on the shared-memory connection", other.name()),
                ))
            }
        }
    }
    Ok(())
}

/// (Initiator) Reads the listener's canary by cross-memory attach, and records what that
/// means for the copies into its regions.
fn read_canary(
    ask: &CmaAsk,
    peer: &ShmPeer,
    addr: u64,
    len: usize,
) -> std::result::Result<Vec<u8>, String> {
    let read = if ask.deny {
        Err(crate::transport::cma::describe(
            &std::io::Error::from_raw_os_error(libc::EPERM),
            ask.uid,
        ))
    } else {
        crate::transport::cma::probe(ask.pid, addr, len, ask.uid)
    };
    match &read {
        Ok(_) => peer.enable_cma(ask.pid),
        Err(why) => {
            crate::transport::cma::log_refused(&ask.peer, why);
            peer.set_cma_status(CmaStatus::Off(why.clone()));
        }
    }
    read
}

/// Whether an error on the shared-memory connection means the peer closed its end (which it
/// does only after unmapping everything of ours, or by dying, which unmaps too).
fn closed_by_peer(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
    )
}
