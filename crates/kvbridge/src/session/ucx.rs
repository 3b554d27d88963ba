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
//!   the session goes on over TCP), unpacks each key, and hands the data path a
//!   [`UcxRoute`] that names the regions its batches may reach over UCX. An unmap removes
//!   the region from the route, flushes what was posted on it and destroys the key before
//!   answering.
//!
//! A fallback is logged with its reason on both sides; a failed machine ends the session.

use super::{std_now, Machine, Session};
use crate::config::{ChannelConfig, Transport};
use crate::error::{Error, Result};
use crate::region::RegionExport;
use crate::transport::ucx_route::{UcxChannel, UcxRoute};
use kvbridge_proto::handshake::Step;
use kvbridge_proto::ids::Blob;
use kvbridge_proto::msg::{Message, UcxRegion};
use kvbridge_proto::ucx_link::{Output, UcxError, UcxExport, UcxImport};
use kvbridge_proto::RegionId;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

/// Starts the channel's UCX worker when its transport is UCX.
pub(crate) fn start_thread(config: &ChannelConfig, name: &str) -> Result<Option<Arc<UcxChannel>>> {
    if config.transport != Transport::Ucx {
        return Ok(None);
    }
    UcxChannel::start(name, config.hooks.ucx_tls.as_deref())
        .map(|c| Some(Arc::new(c)))
        .map_err(|e| Error::Local(format!("transport ucx: cannot start a UCX worker: {e}")))
}

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

/// A session's UCX state.
#[derive(Default)]
pub(super) struct UcxLink {
    link: Option<Link>,
    /// (Listener) Regions exported to the peer and not yet revoked, each counted as an
    /// export of the region until the peer answered its unmap (so `Channel::deregister`
    /// waits for it) or the session ended.
    exported: HashMap<RegionId, RegionExport>,
    /// (Listener) The grants changed (or the session was just established): compare.
    grants_changed: bool,
    /// (Initiator) The route the data path uses.
    route: Option<Arc<UcxRoute>>,
}

impl UcxLink {
    /// An initiator on a UCX channel waits for an offer; a listener starts its machine once
    /// the session is established.
    pub(super) fn new(ucx: bool, initiator: bool) -> Self {
        Self {
            link: (ucx && initiator).then(|| Link::Import(UcxImport::new())),
            ..Self::default()
        }
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
            Link::Import(_) => None,
        }
    }

    /// Time passed.
    pub(super) fn handle_timeout(&mut self, now: Instant) {
        if let Some(Link::Export(m)) = self.link.as_mut() {
            m.handle_timeout(now);
        }
    }
}

impl Session {
    /// (Listener) The session is established: offer UCX to an initiator that takes it.
    pub(super) fn ucx_established(&mut self) {
        let Some(ch) = self.env.ucx.as_ref() else {
            return;
        };
        let Machine::Listen(m) = &self.machine else {
            return;
        };
        if !m.peer_takes_ucx() || self.ucx.link.is_some() {
            return;
        }
        let address = Blob(ch.thread().address().to_vec());
        let timeout = self.env.config.deadlines.handshake_step;
        self.ucx.link = Some(Link::Export(UcxExport::new(address, timeout, std_now())));
        self.ucx.grants_changed = true;
    }

    /// The regions granted to the peer changed.
    pub(super) fn ucx_grants_changed(&mut self) {
        if matches!(self.ucx.link, Some(Link::Export(_))) {
            self.ucx.grants_changed = true;
        }
    }

    /// Whether `m` is for this session's UCX machine (a UCX message in a session without
    /// one goes to the handshake machine, which refuses it as unexpected).
    pub(super) fn ucx_takes(&self, m: &Message) -> bool {
        self.ucx.link.is_some() && is_ucx(m)
    }

    /// A UCX message from the peer.
    pub(super) fn ucx_message(&mut self, m: Message) {
        match self.ucx.link.as_mut() {
            Some(Link::Export(x)) => x.handle_message(m),
            Some(Link::Import(x)) => x.handle_message(m),
            None => {}
        }
    }

    /// Carries out what the machine asked for; returns an error when the session must end.
    pub(super) async fn ucx_pump(&mut self) -> Option<Error> {
        if std::mem::take(&mut self.ucx.grants_changed) {
            self.ucx_sync_grants().await;
        }
        while let Some(o) = self.ucx.poll_output() {
            if let Some(e) = self.ucx_do(o).await {
                return Some(e);
            }
        }
        None
    }

    /// (Listener) Exports the regions newly granted to the peer, revokes those withdrawn.
    async fn ucx_sync_grants(&mut self) {
        let (Some(ch), Some(peer)) = (self.env.ucx.clone(), self.peer_id.clone()) else {
            return;
        };
        let granted = self.env.table.ucx_for(&peer);
        let now = std_now();
        let live: HashSet<RegionId> = granted.iter().map(|r| r.id()).collect();
        let gone: Vec<RegionId> = (self.ucx.exported.keys())
            .filter(|id| !live.contains(id))
            .copied()
            .collect();
        for id in gone {
            if let Some(Link::Export(x)) = self.ucx.link.as_mut() {
                x.revoke(id, now);
            }
        }
        for r in granted {
            if self.ucx.exported.contains_key(&r.id()) || r.is_detached() {
                continue;
            }
            match ch.export_for_session(&r).await {
                Ok(rkey) => {
                    self.ucx.exported.insert(r.id(), r.begin_export());
                    if let Some(Link::Export(x)) = self.ucx.link.as_mut() {
                        x.export(UcxRegion {
                            id: r.id(),
                            base: r.as_ptr() as u64,
                            len: r.len() as u64,
                            rkey: Blob(rkey),
                        });
                    }
                }
                Err(e) => {
                    tracing::warn!(peer = %self.peer_name, region = %r.id(), error = %e,
                        "region not registered with UCX; the peer reaches it over TCP");
                }
            }
        }
    }

    async fn ucx_do(&mut self, o: Output) -> Option<Error> {
        let ch = self.env.ucx.clone()?;
        let deadline = Instant::now() + self.env.config.deadlines.op;
        match o {
            Output::Send(m) => {
                if let Err(e) = self.send(&m).await {
                    return Some(e);
                }
            }
            Output::Connect { address } => {
                let peer = self.peer_name.clone();
                let r = ch.thread().connect(&peer, &address.0).await;
                let Some(Link::Import(x)) = self.ucx.link.as_mut() else {
                    return None;
                };
                match r {
                    Ok(()) => {
                        let route = Arc::new(UcxRoute::new(ch.clone(), peer));
                        if let Some(d) = &self.data {
                            d.path.set_ucx(route.clone());
                        }
                        self.ucx.route = Some(route);
                        x.connected();
                    }
                    Err(e) => x.connect_failed(e.to_string()),
                }
            }
            Output::Import(r) => {
                let peer = self.peer_name.clone();
                let res = ch.thread().import(&peer, r.id, &r.rkey.0).await;
                match res {
                    Ok(()) => {
                        if let Some(route) = &self.ucx.route {
                            route.add(r.id, r.len);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(peer = %self.peer_name, region = %r.id, error = %e,
                            "UCX key not usable; the region goes over TCP");
                        if let Some(Link::Import(x)) = self.ucx.link.as_mut() {
                            x.import_failed(r.id);
                        }
                    }
                }
            }
            Output::Synced => {}
            Output::Release { id } => {
                if let Some(route) = &self.ucx.route {
                    route.remove(id);
                }
                let peer = self.peer_name.clone();
                if let Err(e) = ch.thread().release(&peer, id, deadline).await {
                    // The key stays unusable here; the listener unmaps once we answer.
                    tracing::warn!(peer = %self.peer_name, region = %id, error = %e, "UCX release");
                }
                if let Some(Link::Import(x)) = self.ucx.link.as_mut() {
                    x.released(id);
                }
            }
            Output::Revoked { id } => {
                ch.unexport_for_session(id).await;
                if let Some(e) = self.ucx.exported.remove(&id) {
                    e.confirmed();
                }
            }
            Output::Fallback { reason } => {
                tracing::warn!(peer = %self.peer_name, %reason, "UCX not used with this peer; using TCP");
            }
            Output::Failed(e) => return Some(self.ucx_error(e)),
        }
        None
    }

    fn ucx_error(&self, e: UcxError) -> Error {
        match e {
            UcxError::UnmapTimeout { region, after } => Error::UnmapTimeout {
                peer: self.peer_name.clone(),
                step: Step::Established,
                region,
                after,
            },
            e => Error::PeerMisbehaved {
                peer: self.peer_name.clone(),
                step: Step::Established,
                detail: format!("UCX negotiation: {e}"),
            },
        }
    }

    /// The session ends: the listener lets every registration of it go, the initiator
    /// closes its endpoint (within the close deadline).
    pub(super) async fn ucx_close(&mut self) {
        let Some(ch) = self.env.ucx.clone() else {
            return;
        };
        match self.ucx.link.as_mut() {
            Some(Link::Export(x)) => {
                x.close();
                while let Some(o) = x.poll_output() {
                    if let Output::Revoked { id } = o {
                        ch.unexport_for_session(id).await;
                        if let Some(e) = self.ucx.exported.remove(&id) {
                            e.confirmed();
                        }
                    }
                }
            }
            Some(Link::Import(_)) if self.ucx.route.is_some() => {
                let deadline = Instant::now() + self.env.config.deadlines.close;
                let peer = self.peer_name.clone();
                if let Err(e) = ch.thread().disconnect(&peer, deadline).await {
                    tracing::debug!(peer = %self.peer_name, error = %e, "UCX disconnect");
                }
            }
            _ => {}
        }
        // Every export came back as `Revoked` above; the peer's endpoint is gone with the
        // session.
        for (_, e) in self.ucx.exported.drain() {
            e.confirmed();
        }
        self.ucx.link = None;
    }
}
