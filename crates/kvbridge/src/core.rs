//! The core task, the single owner of the channel's directory of sessions: which session
//! serves which peer, which token belongs to which session, who is waiting for which dial.
//! Callers, the acceptor and session tasks talk to it by message ([`CoreCmd`]). A token is
//! entered before the `Welcome` that reveals it is sent, so a data connection can never
//! arrive for a session the directory does not know yet.

use crate::cmd::{CoreCmd, PeerHandle, SessionCmd};
use crate::error::{Error, Result};
use crate::events::{PeerEvent, Stats};
use crate::handshake_slots::{slot_for, Slot, UnderWay};
use crate::net::Stream;
use crate::session::{refuse, run_initiator, run_listener, SessionEnv};
use kvbridge_proto::msg::{ErrorCode, Message};
use kvbridge_proto::{Incarnation, PeerId, SessionToken};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// A caller of `connect` waiting for its session.
type ConnectReply = oneshot::Sender<Result<PeerHandle>>;

struct SessionEntry {
    peer: Option<PeerId>,
    /// (Listener) The control connection's source address.
    source: Option<SocketAddr>,
    addr: Option<String>,
    token: Option<SessionToken>,
    ctl: mpsc::UnboundedSender<SessionCmd>,
    up: Option<PeerHandle>,
    /// (Listener) Its handshake slot went to another source's `Hello`: it is ending, and
    /// holds no slot any more.
    displaced: bool,
    task: Option<JoinHandle<()>>,
}

pub(crate) struct Core {
    env: SessionEnv,
    events: tokio::sync::broadcast::Sender<PeerEvent>,
    next_id: u64,
    sessions: HashMap<u64, SessionEntry>,
    /// Established sessions only: a handshaking one never owns its claimed peer id.
    by_peer: HashMap<PeerId, u64>,
    /// Old session → established sessions of the same peer waiting for it to be down
    /// before they are published.
    up_after: HashMap<u64, Vec<(u64, PeerHandle)>>,
    tokens: HashMap<SessionToken, u64>,
    /// Address → (dialling session, callers waiting for it).
    dials: HashMap<String, (u64, Vec<ConnectReply>)>,
    by_addr: HashMap<String, u64>,
    ended: u64,
    refused: u64,
    displaced: u64,
    tls_refused: u64,
    auth_failed: u64,
    closing: Option<Vec<oneshot::Sender<()>>>,
    /// Callers of `disconnect` waiting for a session to be torn down.
    disconnecting: HashMap<u64, Vec<oneshot::Sender<Result<()>>>>,
}

impl Drop for Core {
    /// The core ends when the channel closes or is dropped: sessions that did not finish
    /// within the close deadline are stopped, so no task or socket outlives the channel.
    fn drop(&mut self) {
        for s in self.sessions.values_mut() {
            if let Some(t) = s.task.take() {
                t.abort();
            }
        }
    }
}

impl Core {
    pub(crate) fn new(env: SessionEnv, events: tokio::sync::broadcast::Sender<PeerEvent>) -> Self {
        Core {
            env,
            events,
            next_id: 1,
            sessions: HashMap::new(),
            by_peer: HashMap::new(),
            up_after: HashMap::new(),
            tokens: HashMap::new(),
            dials: HashMap::new(),
            by_addr: HashMap::new(),
            ended: 0,
            refused: 0,
            displaced: 0,
            tls_refused: 0,
            auth_failed: 0,
            closing: None,
            disconnecting: HashMap::new(),
        }
    }

    pub(crate) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<CoreCmd>) {
        while let Some(cmd) = rx.recv().await {
            self.handle(cmd);
            if let Some(waiters) = &mut self.closing {
                if self.sessions.is_empty() {
                    for w in waiters.drain(..) {
                        let _ = w.send(());
                    }
                }
            }
        }
    }

    fn spawn_session(
        &mut self,
        peer: Option<PeerId>,
        addr: Option<String>,
        token: Option<SessionToken>,
    ) -> (
        u64,
        mpsc::UnboundedSender<SessionCmd>,
        mpsc::UnboundedReceiver<SessionCmd>,
    ) {
        let id = self.next_id;
        self.next_id += 1;
        let (tx, rx) = mpsc::unbounded_channel();
        self.sessions.insert(
            id,
            SessionEntry {
                peer,
                source: None,
                addr,
                token,
                ctl: tx.clone(),
                up: None,
                displaced: false,
                task: None,
            },
        );
        (id, tx, rx)
    }

    /// Our batches the channel's UCX worker carried (0 without one).
    fn ucx_batches(&self) -> u64 {
        #[cfg(feature = "ucx")]
        if let Some(u) = &self.env.ucx {
            return u.batches();
        }
        0
    }

    /// The handshakes holding a slot (not established, not displaced), oldest first.
    fn under_way(&self) -> Vec<UnderWay> {
        let mut v: Vec<UnderWay> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.up.is_none() && !s.displaced)
            .map(|(id, s)| UnderWay {
                id: *id,
                source: s.source.map(|a| a.ip()),
            })
            .collect();
        // Session ids grow with time.
        v.sort_unstable_by_key(|h| h.id);
        v
    }

    /// Whether a `Hello` from `from` gets a handshake slot (`handshake_slots`): a free
    /// one, or one another source's handshake gives up (it is told to end here). `Err`:
    /// why not.
    fn take_slot(&mut self, from: SocketAddr) -> std::result::Result<(), String> {
        let limits = &self.env.config.limits;
        let slot = slot_for(
            &self.under_way(),
            from.ip(),
            limits.max_concurrent_handshakes,
            limits.max_handshakes_per_source,
        );
        match slot {
            Slot::Free => Ok(()),
            Slot::Refused(why) => Err(why),
            Slot::TakenFrom(id) => {
                let s = self.sessions.get_mut(&id).expect("a handshake under way");
                s.displaced = true;
                self.displaced += 1;
                let victim = s.source.expect("only a listener's handshake is taken");
                let _ = s.ctl.send(SessionCmd::SlotTaken {
                    from: victim,
                    by: from,
                });
                if let Some(suppressed) = crate::refusals::HANDSHAKE_LIMIT.allow() {
                    tracing::warn!(%from, %victim, suppressed,
                        "handshake slots full; the oldest handshake of the source holding most \
                         gave its slot to this Hello");
                }
                Ok(())
            }
        }
    }

    fn set_task(&mut self, id: u64, task: JoinHandle<()>) {
        if let Some(s) = self.sessions.get_mut(&id) {
            s.task = Some(task);
        }
    }

    /// A newer session of `peer` arrived: the old one fails with the right error.
    fn replace_old(&mut self, peer: &PeerId, new_id: u64, new_inc: Incarnation) {
        if let Some(old_id) = self.by_peer.get(peer).copied() {
            if old_id == new_id {
                return;
            }
            if let Some(old) = self.sessions.get(&old_id) {
                let err = match &old.up {
                    Some(h) if h.incarnation != new_inc => Error::PeerRestarted {
                        peer: peer.to_string(),
                        old: h.incarnation,
                        new: new_inc,
                    },
                    _ => Error::SessionReplaced {
                        peer: peer.to_string(),
                    },
                };
                let _ = old.ctl.send(SessionCmd::Replace(err));
            }
        }
    }

    /// Publishes an established session: lookups, dial waiters and `PeerEvent::Up` see it.
    fn publish(&mut self, id: u64, handle: PeerHandle) {
        let Some(s) = self.sessions.get_mut(&id) else {
            return;
        };
        s.up = Some(handle.clone());
        s.peer = Some(handle.peer_id.clone());
        let _ = self.events.send(PeerEvent::Up {
            peer: handle.peer_id.clone(),
            incarnation: handle.incarnation,
        });
        let addr = s.addr.clone();
        self.by_peer.insert(handle.peer_id.clone(), id);
        if let Some(addr) = addr {
            self.by_addr.insert(addr.clone(), id);
            if let Some((_, waiters)) = self.dials.remove(&addr) {
                for w in waiters {
                    let _ = w.send(Ok(handle.clone()));
                }
            }
        }
    }

    /// One command, by kind; each kind is a step of its own below.
    fn handle(&mut self, cmd: CoreCmd) {
        match cmd {
            CoreCmd::Connect { addr, reply } => self.connect(addr, reply),
            CoreCmd::Lookup { peer, reply } => {
                let h = self
                    .by_peer
                    .get(&peer)
                    .and_then(|id| self.sessions.get(id))
                    .and_then(|s| s.up.clone());
                let _ = reply.send(h);
            }
            CoreCmd::Incoming {
                stream,
                first,
                from,
            } => self.incoming(stream, *first, from),
            CoreCmd::ShmIncoming { stream, hello } => {
                // Only a live session's token opens anything; the session itself waits for
                // the peer to authenticate before it passes a descriptor.
                if let Some(s) = self
                    .tokens
                    .get(&hello.token)
                    .and_then(|id| self.sessions.get(id))
                {
                    let _ = s.ctl.send(SessionCmd::ShmConn(stream, hello.peer_id));
                }
            }
            CoreCmd::SessionUp { id, handle } => self.session_up(id, handle),
            CoreCmd::SessionDown { id, error } => self.session_down(id, error),
            CoreCmd::TlsRefused => self.tls_refused += 1,
            CoreCmd::EndMappers {
                region,
                except,
                after,
            } => {
                // Only the session owns what its peer mapped: each decides for itself.
                for (id, s) in &self.sessions {
                    if Some(*id) != except {
                        let _ = s.ctl.send(SessionCmd::EndIfMapping { region, after });
                    }
                }
            }
            CoreCmd::MemChanged => {
                for s in self.sessions.values() {
                    let _ = s.ctl.send(SessionCmd::MemChanged);
                }
            }
            CoreCmd::Disconnect {
                peer,
                reason,
                reply,
            } => self.disconnect(peer, reason, reply),
            CoreCmd::Stats { reply } => self.stats(reply),
            CoreCmd::Close { reply } => {
                for s in self.sessions.values() {
                    let _ = s.ctl.send(SessionCmd::Close);
                }
                self.closing.get_or_insert_with(Vec::new).push(reply);
            }
        }
    }

    /// A caller asks for a session to `addr`: the live one, else joins the dial in
    /// progress, else starts one.
    fn connect(&mut self, addr: String, reply: oneshot::Sender<Result<PeerHandle>>) {
        if self.closing.is_some() {
            let _ = reply.send(Err(Error::Closed));
            return;
        }
        if let Some(h) = self
            .by_addr
            .get(&addr)
            .and_then(|id| self.sessions.get(id))
            .and_then(|s| s.up.clone())
        {
            let _ = reply.send(Ok(h));
            return;
        }
        if let Some((_, waiters)) = self.dials.get_mut(&addr) {
            waiters.push(reply);
            return;
        }
        let (id, tx, rx) = self.spawn_session(None, Some(addr.clone()), None);
        self.dials.insert(addr.clone(), (id, vec![reply]));
        let task = tokio::spawn(run_initiator(self.env.clone(), id, addr, rx, tx));
        self.set_task(id, task);
    }

    /// An accepted connection's first frame: a `Hello` starts a listener session (within
    /// the handshake quotas), a `DataHello` goes to the session its token names.
    fn incoming(&mut self, stream: Stream, first: Message, from: SocketAddr) {
        if self.closing.is_some() {
            tokio::spawn(refuse(stream, ErrorCode::ShuttingDown, "channel closing"));
            return;
        }
        let no_slot = match &first {
            Message::Hello(_) => self.take_slot(from).err(),
            _ => None,
        };
        match first {
            Message::Hello(_) if no_slot.is_some() => {
                self.refused += 1;
                let msg = no_slot.expect("checked");
                if let Some(suppressed) = crate::refusals::HANDSHAKE_LIMIT.allow() {
                    tracing::warn!(%from, suppressed, "{msg}; Hello refused");
                }
                tokio::spawn(async move { refuse(stream, ErrorCode::LimitExceeded, &msg).await });
            }
            Message::Hello(hello) => {
                let mut t = [0u8; 16];
                crate::random::rand_bytes(&mut t);
                let token = SessionToken(t);
                let peer = hello.peer_id.clone();
                // The peer id is only a claim until the session is established
                // (version, compat and proof checked): it neither replaces the
                // peer's live session nor enters `by_peer` before that (SessionUp).
                let (id, tx, rx) = self.spawn_session(Some(peer), None, Some(token));
                if let Some(s) = self.sessions.get_mut(&id) {
                    s.source = Some(from);
                }
                // Entered before the Welcome that reveals it goes out.
                self.tokens.insert(token, id);
                let task = tokio::spawn(run_listener(
                    self.env.clone(),
                    id,
                    stream,
                    hello,
                    token,
                    rx,
                    tx,
                ));
                self.set_task(id, task);
            }
            Message::DataHello(dh) => {
                match self
                    .tokens
                    .get(&dh.token)
                    .and_then(|id| self.sessions.get(id))
                {
                    Some(s) => {
                        // A session tearing down closed its queue: its token still
                        // names it until it is down, but it binds nothing more.
                        if let Err(mpsc::error::SendError(SessionCmd::DataConn(stream, ..))) = s
                            .ctl
                            .send(SessionCmd::DataConn(stream, dh.peer_id, dh.stream))
                        {
                            tokio::spawn(refuse(
                                stream,
                                ErrorCode::UnknownSession,
                                "the session for this token has ended",
                            ));
                        }
                    }
                    None => {
                        tokio::spawn(refuse(
                            stream,
                            ErrorCode::UnknownSession,
                            "no session for this token",
                        ));
                    }
                }
            }
            _ => {}
        }
    }

    /// A session is established: it is published, or waits until the peer's older one is
    /// down.
    fn session_up(&mut self, id: u64, handle: PeerHandle) {
        if !self.sessions.contains_key(&id) {
            return;
        }
        // An established session replaces the peer's older one. It is published only
        // once the older one is down, so that layers above see the old incarnation's
        // `Down` before the new one's `Up`, and never two sessions of one peer.
        if let Some(old) = self.by_peer.get(&handle.peer_id).copied() {
            if old != id && self.sessions.contains_key(&old) {
                self.replace_old(&handle.peer_id, id, handle.incarnation);
                self.up_after.entry(old).or_default().push((id, handle));
                return;
            }
        }
        self.publish(id, handle);
    }

    /// A session ended: it leaves the directory, its callers learn why, and sessions that
    /// replace it are published.
    fn session_down(&mut self, id: u64, error: Error) {
        let Some(s) = self.sessions.remove(&id) else {
            return;
        };
        self.ended += 1;
        if let Error::Unauthenticated { peer, step, detail } = &error {
            self.auth_failed += 1;
            if let Some(suppressed) = crate::refusals::AUTH_FAILED.allow() {
                let from = s.source.map(|a| a.to_string());
                tracing::warn!(
                    %peer,
                    from = from.as_deref().unwrap_or("(we dialled)"),
                    %step,
                    suppressed,
                    "authentication failed: {detail}"
                );
            }
        }
        for w in self.disconnecting.remove(&id).unwrap_or_default() {
            let _ = w.send(Ok(()));
        }
        if let Some(h) = &s.up {
            let _ = self.events.send(PeerEvent::Down {
                peer: h.peer_id.clone(),
                incarnation: h.incarnation,
                error: error.clone(),
            });
        }
        if let Some(p) = &s.peer {
            if self.by_peer.get(p) == Some(&id) {
                self.by_peer.remove(p);
            }
        }
        if let Some(t) = &s.token {
            self.tokens.remove(t);
        }
        // Sessions that replace this one are published now, in the order they came up
        // (a later one replaces an earlier one the same way).
        for (new, handle) in self.up_after.remove(&id).unwrap_or_default() {
            self.session_up(new, handle);
        }
        if let Some(addr) = &s.addr {
            if self.by_addr.get(addr) == Some(&id) {
                self.by_addr.remove(addr);
            }
            if self.dials.get(addr).is_some_and(|(d, _)| *d == id) {
                if let Some((_, waiters)) = self.dials.remove(addr) {
                    for w in waiters {
                        let _ = w.send(Err(error.clone()));
                    }
                }
            }
        }
    }

    /// Ends the session of `peer` for `reason`; `reply` is answered once it is down.
    fn disconnect(&mut self, peer: PeerId, reason: String, reply: oneshot::Sender<Result<()>>) {
        match self.by_peer.get(&peer).copied() {
            Some(id) if self.sessions.contains_key(&id) => {
                let err = Error::Disconnected {
                    peer: peer.to_string(),
                    reason,
                };
                let _ = self.sessions[&id].ctl.send(SessionCmd::Abort(err));
                self.disconnecting.entry(id).or_default().push(reply);
            }
            _ => {
                let _ = reply.send(Err(Error::UnknownPeer {
                    peer: peer.to_string(),
                }));
            }
        }
    }

    /// The channel's counters, summed over its sessions.
    fn stats(&self, reply: oneshot::Sender<Stats>) {
        let notes = self.env.notifications.snapshot();
        let established: Vec<&PeerHandle> = self
            .sessions
            .values()
            .filter_map(|s| s.up.as_ref())
            .collect();
        let _ = reply.send(Stats {
            sessions: self.sessions.len(),
            established: established.len(),
            dialing: self.dials.len(),
            tokens: self.tokens.len(),
            batches_in_flight: established.iter().map(|h| h.data.in_flight()).sum(),
            bytes_in_flight: established.iter().map(|h| h.data.bytes_in_flight()).sum(),
            in_flight_refused: self.env.in_flight_refused.load(Ordering::Relaxed),
            peer_bytes_in_flight: established.iter().map(|h| h.data.incoming().held()).sum(),
            late_answers_discarded: self.env.late_answers.load(Ordering::Relaxed),
            access_denied: self.env.table.denied(),
            shm_batches: self.env.direct_copies.shm.load(Ordering::Relaxed),
            cma_batches: self.env.direct_copies.cma.load(Ordering::Relaxed),
            ucx_batches: self.ucx_batches(),
            frames_fast_lane: self.env.frames_fast_lane.load(Ordering::Relaxed),
            batches_waiting_for_room: established.iter().map(|h| h.data.waiting_for_room()).sum(),
            sessions_ended: self.ended,
            handshakes_refused: self.refused,
            handshakes_displaced: self.displaced,
            tls_refused: self.tls_refused,
            auth_failed: self.auth_failed,
            notifications_queued: notes.queued,
            notify_bytes_queued: notes.bytes,
            notify_bytes_peak: notes.peak,
            notify_paused: notes.paused,
            notify_pauses: notes.pauses,
            notify_timeouts: notes.timeouts,
        });
    }
}
