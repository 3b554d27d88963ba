//! A session's UCX negotiation: drives the sans-IO machines of `kvbridge_proto::ucx_link`
//! (the listener's [`UcxExport`], the initiator's [`UcxImport`]) over the control
//! connection, once the session is established, and carries out what they ask of the
//! channel's worker ([`UcxChannel`]).
//!
//! - Listener: once the handshake established the session (after the proof, with a secret)
//!   and the initiator said `ucx` in its `Hello`, it offers its worker address; the keys of
//!   the regions granted to the peer go out only after the peer accepted (the machine holds
//!   them). A grant withdrawn (deregistration, `Region::detach`) unmaps the peer's key; its
//!   registration is let go once the peer answered `UcxUnmapped`, or the session ended.
//! - Initiator: connects its worker's endpoint to the offered address (or declines, and
//!   the session goes on over TCP), preferring UCX's shared-memory transports when the offer
//!   names this host's identity (else peer-failure detection), unpacks each key, and hands the data path a
//!   [`UcxRoute`] that names the regions its batches may reach over UCX. An unmap removes
//!   the region from the route, flushes what was posted on it and destroys the key before
//!   answering. When the listener's `Welcome` announced an offer, the session is reported up
//!   only once the negotiation settled ([`UcxLink::hold_up`]): every region granted by
//!   then imported, or UCX off with the reason logged, or the deadline passed (logged), so
//!   the session's first batch already takes the transport it keeps.
//!
//! A fallback is logged with its reason on both sides; a failed machine ends the session.

use crate::cmd::PeerHandle;
use crate::config::{ChannelConfig, Transport};
use crate::datapath::DataPath;
use crate::error::{Error, Result};
use crate::grant::RegionTable;
use crate::pidfd::Pidfd;
use crate::region::RegionExport;
use crate::transport::ucx_route::{UcxChannel, UcxRoute};
use crate::transport::ucx_thread::Departure;
use kvbridge_proto::handshake::Step;
use kvbridge_proto::ids::Blob;
use kvbridge_proto::msg::{Message, UcxRegion};
use kvbridge_proto::ucx_link::{Output, UcxError, UcxExport, UcxImport};
use kvbridge_proto::PeerId;
use kvbridge_proto::RegionId;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Starts the channel's UCX worker when its transport is UCX, off the runtime's threads
/// (UCX's initialization takes milliseconds to seconds on a loaded host).
pub(crate) async fn start_thread(
    config: &ChannelConfig,
    name: &str,
) -> Result<Option<Arc<UcxChannel>>> {
    if config.transport != Transport::Ucx {
        return Ok(None);
    }
    let worker_tls = kvbridge_ucx::ContextConfig {
        tls: config.hooks.ucx_tls.clone(),
        net_devices: None,
    }
    .effective_tls();
    refuse_untrusted_reach(worker_tls.as_deref(), config.ucx_trusted_fabric)?;
    let (name, tls) = (name.to_string(), config.hooks.ucx_tls.clone());
    let started = tokio::task::spawn_blocking(move || UcxChannel::start(&name, tls.as_deref()))
        .await
        .map_err(|e| Error::Local(format!("transport ucx: starting the UCX worker: {e}")))?;
    started
        .map(|c| Some(Arc::new(c)))
        .map_err(|e| Error::Local(format!("transport ucx: cannot start a UCX worker: {e}")))
}

/// Refuses a UCX worker that processes of other users or hosts could reach (UCX checks no
/// peer, and its software RMA serves any address), unless the operator declared the fabric
/// trusted; `tls` is the worker's `UCX_TLS` (`None`: unset, every transport).
fn refuse_untrusted_reach(tls: Option<&str>, trusted_fabric: bool) -> Result<()> {
    let beyond = kvbridge_ucx::reach::beyond_this_user(tls);
    if beyond.is_empty() {
        return Ok(());
    }
    let shown = tls.map_or_else(|| "unset".to_string(), |t| format!("{t:?}"));
    if trusted_fabric {
        tracing::info!(
            "transport ucx: UCX_TLS={shown} opens {} to other users or hosts; every process \
             reaching them is trusted with this process's memory (KVBRIDGE_UCX_TRUSTED_FABRIC=1)",
            beyond.join(", ")
        );
        return Ok(());
    }
    Err(Error::Local(format!(
        "transport ucx: UCX_TLS={shown} opens {} to processes of other users or hosts, and \
         UCX authenticates none of them: any that reaches the worker reads and writes all of \
         this process's memory (docs/ucx.md, \"Who can reach a UCX worker\"). Set \
         UCX_TLS=posix,cma,self for peers on this host, or declare every process that can \
         reach these transports trusted with KVBRIDGE_UCX_TRUSTED_FABRIC=1 \
         (ChannelConfig::ucx_trusted_fabric)",
        beyond.join(", ")
    )))
}

/// How long a same-host listener whose control connection closed may take to be seen
/// exiting before its endpoint is closed as one that left alive: a killed process exits
/// within milliseconds of its sockets closing; a live one costs the teardown this much more.
const PEER_EXIT_WAIT: Duration = Duration::from_secs(1);

/// The session's timeline target (`session::TIMELINE`; this module sits below it).
const TIMELINE: &str = "kvbridge::timeline";

/// Whether a control message belongs to the UCX negotiation.
fn is_ucx(m: &Message) -> bool {
    matches!(
        m,
        Message::UcxOffer(_)
            | Message::UcxAccept(_)
            | Message::UcxDecline(_)
            | Message::UcxMap(_)
            | Message::UcxSync(_)
            | Message::UcxUnmap(_)
            | Message::UcxUnmapped(_)
    )
}

/// The machine of this session's role.
enum Link {
    Export(UcxExport),
    Import(UcxImport),
}

/// What the UCX negotiation needs of its session for one round.
pub(super) struct Round<'a> {
    /// The peer's name, for errors.
    pub(super) peer: &'a str,
    /// This session's id: with the peer's name, the key of its endpoint on the worker (a
    /// session that replaces another may connect before the old one closed its endpoint).
    pub(super) session: u64,
    /// The peer, once known.
    pub(super) peer_id: Option<&'a PeerId>,
    /// The channel's grants.
    pub(super) table: &'a RegionTable,
    /// The session's data path, once bound.
    pub(super) data: Option<&'a Arc<DataPath>>,
    /// Bounds a release's flush.
    pub(super) op: Duration,
}

impl Round<'_> {
    fn endpoint(&self) -> String {
        format!("{}#{}", self.peer, self.session)
    }
}

/// A session's UCX state.
pub(super) struct UcxLink {
    channel: Option<Arc<UcxChannel>>,
    link: Option<Link>,
    /// (Listener) Regions exported to the peer and not yet revoked, each counted as an
    /// export of the region until the peer answered its unmap (so `Channel::deregister`
    /// waits for it) or the session ended.
    exported: HashMap<RegionId, RegionExport>,
    /// (Listener) The grants changed (or the session was just established): compare.
    grants_changed: bool,
    /// (Initiator) The route the data path uses.
    route: Option<Arc<UcxRoute>>,
    /// (Initiator) The session's handle for the channel, held until the negotiation settled.
    held: Option<PeerHandle>,
    /// (Initiator) The negotiation settled with a handle held: the session reports it now.
    released: Option<PeerHandle>,
    /// The peer closed the control connection ([`UcxLink::peer_left`]).
    peer_left: bool,
    /// (Initiator) The listener's process, on this host: watched at teardown, since an
    /// endpoint to a same-host peer cannot report its death.
    peer_process: Option<Pidfd>,
}

impl UcxLink {
    /// The UCX state of a session on a channel with (`channel`) or without a worker. An
    /// initiator on a UCX channel waits for an offer from the start; a listener starts its
    /// machine once the session is established ([`UcxLink::established`]).
    ///
    /// An initiator knows its own host only with `shm_lanes` (`ChannelConfig::ucx_shm_lanes`):
    /// without it no listener counts as on the same host, and every endpoint keeps
    /// peer-failure detection.
    pub(super) fn new(channel: Option<Arc<UcxChannel>>, initiator: bool, shm_lanes: bool) -> Self {
        let own_host = || shm_lanes.then(crate::transport::shm::host_id).flatten();
        Self {
            link: (channel.is_some() && initiator)
                .then(|| Link::Import(UcxImport::on_host(own_host()))),
            channel,
            exported: HashMap::new(),
            grants_changed: false,
            route: None,
            held: None,
            released: None,
            peer_left: false,
            peer_process: None,
        }
    }

    /// The peer closed the control connection (end of stream or an error reading it): its
    /// side of the session is over (its teardown closes the connection last) or its process
    /// died. The endpoint's close at [`UcxLink::close`] then waits only where that orders
    /// something: UCX reports the peer's failure on the endpoint, or a read into our memory
    /// is in flight on it. An endpoint to a same-host peer has no failure detection, and its
    /// close to a dead peer would otherwise run to the close deadline.
    pub(super) fn peer_left(&mut self) {
        self.peer_left = true;
    }

    /// How the peer left: alive ([`Departure::Bye`]), by closing the control connection
    /// ([`Departure::Left`]), or dead ([`Departure::Died`]): a same-host listener whose
    /// process is seen exiting within [`PEER_EXIT_WAIT`] (or `close`, if shorter) of its
    /// connection closing. A killed process's sockets close before its pidfd turns
    /// readable, so a moment may pass between the two.
    async fn departure(&self, close: Duration) -> Departure {
        if !self.peer_left {
            return Departure::Bye;
        }
        match &self.peer_process {
            Some(p) if p.exits_within(PEER_EXIT_WAIT.min(close)).await => Departure::Died,
            _ => Departure::Left,
        }
    }

    /// (Initiator) The listener's `Welcome` said whether a UCX offer follows; the
    /// negotiation must settle within `timeout` of `now`.
    pub(super) fn welcomed(&mut self, offers: bool, timeout: Duration, now: Instant) {
        if let Some(Link::Import(m)) = self.link.as_mut() {
            m.welcomed(offers, timeout, now);
        }
    }

    /// (Initiator) The handshake established the session: gives `handle` back to report the
    /// session up now, or holds it until the UCX negotiation settled
    /// ([`UcxLink::take_released`]).
    pub(super) fn hold_up(&mut self, handle: PeerHandle) -> Option<PeerHandle> {
        // The offer can come before our side of the data connection is bound (the
        // handshake machine holds the `Ready`, not the UCX messages): the route joins the
        // data path here at the latest, before the channel learns of the session.
        if let Some(route) = &self.route {
            handle.data.add_one_sided(route.clone());
        }
        match self.link.as_ref() {
            Some(Link::Import(m)) if !m.is_settled() && !m.is_failed() => {
                self.held = Some(handle);
                None
            }
            _ => Some(handle),
        }
    }

    /// (Initiator) The handle held until the negotiation settled, once it has.
    pub(super) fn take_released(&mut self) -> Option<PeerHandle> {
        let handle = self.released.take()?;
        if let Some(route) = &self.route {
            handle.data.add_one_sided(route.clone());
        }
        Some(handle)
    }

    fn poll_output(&mut self) -> Option<Output> {
        match self.link.as_mut()? {
            Link::Export(m) => m.poll_output(),
            Link::Import(m) => m.poll_output(),
        }
    }

    /// The earliest deadline of the machine.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        match self.link.as_ref()? {
            Link::Export(m) => m.poll_timeout(),
            Link::Import(m) => m.poll_timeout(),
        }
    }

    /// Time passed.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        match self.link.as_mut() {
            Some(Link::Export(m)) => m.handle_timeout(now),
            Some(Link::Import(m)) => m.handle_timeout(now),
            None => {}
        }
    }

    /// (Listener) The session is established: offer UCX when the initiator takes it
    /// (`peer_takes_ucx`), answers bounded by `timeout`.
    pub(super) fn established(&mut self, peer_takes_ucx: bool, timeout: Duration) {
        let Some(ch) = self.channel.as_ref() else {
            return;
        };
        if !peer_takes_ucx || self.link.is_some() {
            return;
        }
        let address = Blob(ch.thread().address().to_vec());
        self.link = Some(Link::Export(UcxExport::new(
            address,
            crate::transport::shm::host_id(),
            Some(std::process::id()),
            timeout,
            Instant::now(),
        )));
        self.grants_changed = true;
    }

    /// The regions granted to the peer changed.
    pub(super) fn grants_changed(&mut self) {
        if matches!(self.link, Some(Link::Export(_))) {
            self.grants_changed = true;
        }
    }

    /// Whether `m` is for this session's UCX machine (a UCX message in a session without
    /// one goes to the handshake machine, which refuses it as unexpected).
    pub(super) fn takes(&self, m: &Message) -> bool {
        self.link.is_some() && is_ucx(m)
    }

    /// A UCX message from the peer.
    pub(super) fn handle_message(&mut self, m: Message) {
        match self.link.as_mut() {
            Some(Link::Export(x)) => x.handle_message(m),
            Some(Link::Import(x)) => x.handle_message(m),
            None => {}
        }
    }

    /// Carries out what the machine asked for. Returns the messages to send to the peer, in
    /// order, and the error that ends the session, if any (send the messages first: a
    /// failed machine's last one says why).
    pub(super) async fn pump(&mut self, s: &Round<'_>) -> (Vec<Message>, Option<Error>) {
        let mut send = Vec::new();
        let Some(ch) = self.channel.clone() else {
            return (send, None);
        };
        // The offer may be carried out before this side's data path is bound: hand the
        // route over once it is (the data path keeps the first one it gets).
        if let (Some(route), Some(d)) = (&self.route, s.data) {
            d.add_one_sided(route.clone());
        }
        if std::mem::take(&mut self.grants_changed) {
            self.sync_grants(&ch, s).await;
        }
        while let Some(o) = self.poll_output() {
            match o {
                Output::Send(m) => send.push(m),
                Output::Failed(e) => return (send, Some(ucx_error(s.peer, e))),
                o => self.carry_out(&ch, s, o).await,
            }
        }
        (send, None)
    }

    /// (Listener) Exports the regions newly granted to the peer, revokes those withdrawn.
    async fn sync_grants(&mut self, ch: &Arc<UcxChannel>, s: &Round<'_>) {
        let Some(peer) = s.peer_id else {
            return;
        };
        let granted = s.table.ucx_for(peer);
        let now = Instant::now();
        let live: HashSet<RegionId> = granted.iter().map(|r| r.id()).collect();
        let gone: Vec<RegionId> = (self.exported.keys())
            .filter(|id| !live.contains(id))
            .copied()
            .collect();
        for id in gone {
            if let Some(Link::Export(x)) = self.link.as_mut() {
                x.revoke(id, now);
            }
        }
        for r in granted {
            if self.exported.contains_key(&r.id()) || r.is_detached() {
                continue;
            }
            match timed(s, "ucx region exported", ch.export_for_session(&r)).await {
                Ok(rkey) => {
                    self.exported.insert(r.id(), r.begin_export());
                    if let Some(Link::Export(x)) = self.link.as_mut() {
                        x.export(UcxRegion {
                            id: r.id(),
                            base: r.as_ptr() as u64,
                            len: r.len() as u64,
                            rkey: Blob(rkey),
                        });
                    }
                }
                Err(e) => {
                    tracing::warn!(peer = %s.peer, region = %r.id(), error = %e,
                        "region not registered with UCX; the peer reaches it over TCP");
                }
            }
        }
    }

    async fn carry_out(&mut self, ch: &Arc<UcxChannel>, s: &Round<'_>, o: Output) {
        match o {
            Output::Connect {
                address,
                same_host,
                pid,
            } => {
                // Opened while the listener is known alive (it just sent its offer), so the
                // descriptor names that very process.
                self.peer_process = pid.and_then(Pidfd::open);
                // A listener on this host: an endpoint that may use UCX's shared-memory and
                // cross-memory-attach lanes, which cannot report a dead peer (its process is
                // watched instead, `peer_process`).
                tracing::debug!(peer = %s.peer, same_host, "UCX endpoint");
                let t = Instant::now();
                let r = ch
                    .thread()
                    .connect(&s.endpoint(), &address.0, same_host)
                    .await;
                tracing::debug!(target: TIMELINE, session = s.session, peer = %s.peer,
                    took_us = t.elapsed().as_micros() as u64, ok = r.is_ok(), "ucx endpoint");
                let Some(Link::Import(x)) = self.link.as_mut() else {
                    return;
                };
                match r {
                    Ok(()) => {
                        let route = Arc::new(UcxRoute::new(ch.clone(), s.endpoint()));
                        if let Some(d) = s.data {
                            d.add_one_sided(route.clone());
                        }
                        self.route = Some(route);
                        x.connected();
                    }
                    Err(e) => x.connect_failed(e.to_string()),
                }
            }
            Output::Import(r) => match timed(s, "ucx key imported", async {
                ch.thread().import(&s.endpoint(), r.id, &r.rkey.0).await
            })
            .await
            {
                Ok(()) => {
                    if let Some(route) = &self.route {
                        route.add(r.id, r.len);
                    }
                }
                Err(e) => {
                    tracing::warn!(peer = %s.peer, region = %r.id, error = %e,
                        "UCX key not usable; the region goes over TCP");
                    if let Some(Link::Import(x)) = self.link.as_mut() {
                        x.import_failed(r.id);
                    }
                }
            },
            Output::Release { id } => {
                if let Some(route) = &self.route {
                    route.remove(id);
                }
                let deadline = Instant::now() + s.op;
                if let Err(e) = ch.thread().release(&s.endpoint(), id, deadline).await {
                    // The key is unusable here either way; the listener unmaps once we answer.
                    tracing::warn!(peer = %s.peer, region = %id, error = %e, "UCX release");
                }
                if let Some(Link::Import(x)) = self.link.as_mut() {
                    x.released(id);
                }
            }
            Output::Revoked { id } => self.revoked(ch, id).await,
            Output::Fallback { reason } => {
                tracing::warn!(peer = %s.peer, %reason, "UCX not used with this peer; using TCP");
            }
            Output::Settled { unfinished } => {
                tracing::debug!(target: TIMELINE, session = s.session, peer = %s.peer, "ucx settled");
                if let Some(reason) = unfinished {
                    tracing::warn!(peer = %s.peer, %reason, "UCX negotiation unfinished; the session starts");
                }
                self.released = self.held.take();
            }
            Output::Synced | Output::Send(_) | Output::Failed(_) => {}
        }
    }

    /// (Listener) The peer can no longer reach region `id` through this session.
    async fn revoked(&mut self, ch: &Arc<UcxChannel>, id: RegionId) {
        ch.unexport_for_session(id).await;
        if let Some(e) = self.exported.remove(&id) {
            e.confirmed();
        }
    }

    /// The session ends: the listener lets every registration of it go, the initiator
    /// closes its endpoint (within `close`).
    pub(super) async fn close(&mut self, s: &Round<'_>, close: Duration) {
        let Some(ch) = self.channel.clone() else {
            return;
        };
        match self.link.as_mut() {
            Some(Link::Export(x)) => {
                x.close();
                let mut revoked = Vec::new();
                while let Some(o) = x.poll_output() {
                    if let Output::Revoked { id } = o {
                        revoked.push(id);
                    }
                }
                for id in revoked {
                    self.revoked(&ch, id).await;
                }
            }
            Some(Link::Import(_)) if self.route.is_some() => {
                let deadline = Instant::now() + close;
                let how = self.departure(close).await;
                tracing::debug!(peer = %s.peer, ?how, "UCX disconnect");
                if let Err(e) = ch.thread().disconnect(&s.endpoint(), deadline, how).await {
                    tracing::debug!(peer = %s.peer, error = %e, "UCX disconnect");
                }
            }
            _ => {}
        }
        // Every export came back as `Revoked` above; the peer's endpoint is gone with the
        // session.
        for (_, e) in self.exported.drain() {
            e.confirmed();
        }
        self.link = None;
    }
}

/// Runs `f`, marking on the session's timeline what it was (`what`) and how long it took.
async fn timed<T, E>(
    s: &Round<'_>,
    what: &'static str,
    f: impl std::future::Future<Output = std::result::Result<T, E>>,
) -> std::result::Result<T, E> {
    let t = Instant::now();
    let r = f.await;
    tracing::debug!(target: TIMELINE, session = s.session, peer = %s.peer,
        took_us = t.elapsed().as_micros() as u64, ok = r.is_ok(), "{what}");
    r
}

fn ucx_error(peer: &str, e: UcxError) -> Error {
    match e {
        UcxError::UnmapTimeout { region, after } => Error::UnmapTimeout {
            peer: peer.to_string(),
            step: Step::Established,
            region,
            after,
        },
        e => Error::PeerMisbehaved {
            peer: peer.to_string(),
            step: Step::Established,
            detail: format!("UCX negotiation: {e}"),
        },
    }
}

#[cfg(test)]
mod tests {
    //! The initiator's choice of lanes for a listener on its own host, with the channel's
    //! default configuration and two UCX workers of this process.

    use super::*;
    use crate::transport::ucx::{is_shared_memory, lane_transports};
    use kvbridge_proto::msg::UcxAddress;

    /// The lanes of the endpoint the initiator's machine (with or without its host
    /// identity, `shm_lanes`) connects to a listener that names this host.
    async fn lanes_to_a_same_host_listener(listener: &UcxChannel, shm_lanes: bool) -> Vec<String> {
        let tls = Some("sm,self,tcp");
        let initiator = Arc::new(UcxChannel::start("initiator", tls).unwrap());
        let mut link = UcxLink::new(Some(initiator.clone()), true, shm_lanes);
        let Some(Link::Import(m)) = link.link.as_mut() else {
            panic!("an initiator on a UCX channel runs the import machine");
        };
        m.welcomed(true, Duration::from_secs(5), Instant::now());
        // The listener names this host, as it does when it is on it.
        let host = crate::transport::shm::host_id().expect("this host's identity");
        m.handle_message(Message::UcxOffer(UcxAddress {
            address: Blob(listener.thread().address().to_vec()),
            host: Some(host),
            pid: None,
        }));
        let Some(Output::Connect {
            address, same_host, ..
        }) = m.poll_output()
        else {
            panic!("the offer was not answered with a connect");
        };
        assert_eq!(
            same_host, shm_lanes,
            "shm_lanes {shm_lanes}: same_host {same_host}"
        );
        let t = initiator.thread();
        t.connect("listener", &address.0, same_host).await.unwrap();
        let info = t.endpoint_info("listener").await.unwrap();
        let lanes = lane_transports(&info);
        eprintln!("shm_lanes {shm_lanes}, sm,self,tcp, listener on this host: {lanes:?}");
        lanes
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_default_config_takes_shared_memory_lanes_to_a_same_host_listener() {
        // Same-host lanes are the default (`KVBRIDGE_UCX_SHM_LANES=0` turns them off): a
        // listener on this host gets an endpoint over UCX's shared memory; without the
        // option one with peer-failure detection, which UCX 1.13 builds from tcp alone even
        // with shared memory in `UCX_TLS`.
        if std::env::var_os("KVBRIDGE_UCX_SHM_LANES").is_some() {
            eprintln!("KVBRIDGE_UCX_SHM_LANES is set: the default is not what this run has");
            return;
        }
        let config = ChannelConfig::new("initiator", None);
        assert!(config.ucx_shm_lanes, "same-host lanes off by default");
        let listener = UcxChannel::start("listener", Some("sm,self,tcp")).unwrap();
        let lanes = lanes_to_a_same_host_listener(&listener, config.ucx_shm_lanes).await;
        assert!(
            lanes.iter().any(|l| is_shared_memory(l)),
            "the default left a same-host endpoint on tcp: {lanes:?}"
        );
        let lanes = lanes_to_a_same_host_listener(&listener, false).await;
        assert!(
            lanes.iter().any(|l| l.starts_with("tcp/")),
            "no tcp lane with the option off: {lanes:?}"
        );
        assert!(
            !lanes.iter().any(|l| is_shared_memory(l)),
            "shared-memory lanes with the option off: {lanes:?}"
        );
    }
}
