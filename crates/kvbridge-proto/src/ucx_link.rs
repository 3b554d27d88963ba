//! The UCX negotiation of one session, as two sans-IO state machines.
//!
//! ```text
//! initiator (UcxImport)                          listener (UcxExport)
//! Hello{ucx: true}                         --->
//!                                          <--- Welcome{ucx: true} (the listener has a worker)
//! welcomed(true): the initiator holds its session's start until the negotiation settles
//!              ... handshake, proof, Ready: the session is established ...
//!                                          <--- UcxOffer{address, host}
//! Output::Connect{address, same_host, pid}: the driver creates its endpoint, then
//!   connected()      -> UcxAccept          ---> the held UcxMap of every region granted, UcxSync
//!   connect_failed() -> UcxDecline{reason} ---> Output::Fallback{reason}: TCP for the session
//!                                          <--- UcxMap{id, base, len, rkey} (now or at any later grant)
//! Output::Import{region}                   <--- UcxSync (the regions granted so far are all sent)
//! Output::Synced, Output::Settled: the session starts, every granted region reachable over UCX
//!                                          <--- UcxUnmap{id}  (the listener deregisters)
//! Output::Release{id}: the driver ends every operation on the region and drops its key, then
//!   released(id)     -> UcxUnmapped{id}    ---> Output::Revoked{id}: unmap this session's key
//! ```
//!
//! The rules the machines keep, whatever order events come in:
//! - **A key goes only to a peer that proved itself and accepted.** The listener starts its
//!   machine once the handshake established the session (so after the proof, with a secret),
//!   and holds every region until the initiator accepted; the initiator fails the session on a
//!   `UcxMap` before its own `UcxAccept` went out.
//! - **A key is revoked only once the peer stopped using it.** Every region handed to
//!   [`UcxExport::export`] comes back exactly once as [`Output::Revoked`]: at once when the
//!   peer never received its key, after the peer's `UcxUnmapped` when it did, and at the end of
//!   the session otherwise (then the peer's endpoint is gone with the session; the driver
//!   registers memory once per session and region, so unmapping a key revokes exactly that
//!   peer's access). An `UcxUnmapped` that does not come within the deadline fails the session.
//! - **No answer is not a hang.** An offer not answered within the deadline falls back to TCP;
//!   an unmap not acknowledged within it fails the session.
//! - **A session starts with its transport settled.** The initiator emits [`Output::Settled`]
//!   exactly once: when the listener's `Welcome` offered no UCX, after the first `UcxSync`
//!   (every region granted so far is imported), after a fallback, or at its deadline (then
//!   with the reason, and declining first when no offer came). Its driver reports the session
//!   up only then, so the first batch already takes the transport the session will keep.
//! - Every blob a peer sends is bounded ([`MAX_UCX_BLOB`]) and checked before it reaches UCX;
//!   `kvbridge-ucx` checks its envelope again.
//! - **A host claim buys a lane preference, nothing else.** The offer names the listener's
//!   host identity; [`Output::Connect`] says `same_host` only when the initiator knows its
//!   own and the two are equal (as the shared-memory offer is checked), and that flag is the
//!   only output the claim changes. Its driver then asks UCX for an endpoint that may use
//!   shared-memory transports, which cannot report a dead peer: a peer lying about its host
//!   gets at worst an endpoint whose failure shows at the operation deadlines.
//!
//! A failed machine sends a `Bye` naming the cause, emits exactly one [`Output::Failed`], then
//! the [`Output::Revoked`] of every region still exported, and nothing after that.

use crate::ids::{Blob, RegionId};
use crate::msg::{
    ErrorCode, Message, Ready, Reject, ShmRevoke, UcxAddress, UcxDecline, UcxRegion, MAX_UCX_BLOB,
    MAX_UCX_REASON_LEN,
};
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};
use thiserror::Error;

/// The steps of the negotiation, named in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UcxStep {
    /// The listener's offer and the initiator's answer.
    Offer,
    /// A region's remote key.
    Map,
    /// Ending the use of a region's key.
    Unmap,
}

/// Why a UCX negotiation failed. The driver ends the session with it.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum UcxError {
    /// The peer sent a message its state cannot serve (a key before the accept, a second
    /// offer, an unmap of a region it was never given).
    #[error("UCX {step:?}: unexpected {message} from the peer")]
    Unexpected {
        /// Where the negotiation was.
        step: UcxStep,
        /// The message's name.
        message: &'static str,
    },
    /// The peer sent a message that breaks a limit or does not describe a usable region.
    #[error("UCX {step:?}: {what}")]
    Malformed {
        /// Where the negotiation was.
        step: UcxStep,
        /// What was wrong, naming the values.
        what: String,
    },
    /// The peer did not confirm within the deadline that it stopped using a region's key.
    #[error("UCX Unmap: the peer did not release region {region:?} within {after:?}")]
    UnmapTimeout {
        /// The region.
        region: RegionId,
        /// The deadline that passed.
        after: Duration,
    },
}

impl UcxError {
    /// The step that failed.
    pub fn step(&self) -> UcxStep {
        match self {
            UcxError::Unexpected { step, .. } | UcxError::Malformed { step, .. } => *step,
            UcxError::UnmapTimeout { .. } => UcxStep::Unmap,
        }
    }

    /// The code the peer is told.
    pub fn code(&self) -> ErrorCode {
        match self {
            UcxError::Unexpected { .. } => ErrorCode::UnexpectedMessage,
            UcxError::Malformed { .. } => ErrorCode::Malformed,
            UcxError::UnmapTimeout { .. } => ErrorCode::Timeout,
        }
    }
}

/// What a machine asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send this message on the session's control connection.
    Send(Message),
    /// (Initiator) Create an endpoint to this worker address, then call
    /// [`UcxImport::connected`] or [`UcxImport::connect_failed`].
    Connect {
        /// The listener's enveloped worker address.
        address: Blob,
        /// The listener named this host as its own (equal host identities): the endpoint may
        /// prefer shared-memory transports over peer-failure detection.
        same_host: bool,
        /// With `same_host`, the process id the listener gave ([`UcxAddress::pid`]): the
        /// process to watch, since an endpoint without failure detection cannot say it died.
        pid: Option<u32>,
    },
    /// (Initiator) Unpack this region's key on the endpoint; operations on the region may use
    /// UCX from now on (or TCP, when the unpack fails: [`UcxImport::import_failed`]).
    Import(UcxRegion),
    /// (Initiator) The regions the listener granted so far have all been offered: one granted
    /// without a key goes over TCP.
    Synced,
    /// (Initiator) The negotiation settled (emitted once): the driver may report the session
    /// up. `unfinished` says why it settled before its end (the deadline passed).
    Settled {
        /// Why the negotiation settled unfinished, if it did.
        unfinished: Option<String>,
    },
    /// (Initiator) End every operation on this region, drop its key, then call
    /// [`UcxImport::released`].
    Release {
        /// The region.
        id: RegionId,
    },
    /// (Listener) The peer can no longer reach this region through this session: unmap the
    /// session's registration of it.
    Revoked {
        /// The region.
        id: RegionId,
    },
    /// UCX is off for this session (logged with the reason on both sides); everything goes
    /// over TCP.
    Fallback {
        /// Why.
        reason: String,
    },
    /// The negotiation failed; the driver ends the session.
    Failed(UcxError),
}

/// Checks a peer's blob against the limit.
fn check_blob(b: &Blob, what: &str, step: UcxStep) -> Result<(), UcxError> {
    if b.0.is_empty() || b.0.len() > MAX_UCX_BLOB {
        return Err(UcxError::Malformed {
            step,
            what: format!(
                "{what} of {} bytes (must be 1 to {MAX_UCX_BLOB})",
                b.0.len()
            ),
        });
    }
    Ok(())
}

/// Keeps a reason within what the wire accepts, cutting at a character boundary.
fn bounded(mut reason: String) -> String {
    if reason.len() > MAX_UCX_REASON_LEN {
        let mut cut = MAX_UCX_REASON_LEN;
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
    }
    reason
}

/// The part both machines share: the outputs and the single failure.
#[derive(Debug, Clone, Default)]
struct Core {
    out: VecDeque<Output>,
    failed: bool,
}

impl Core {
    fn send(&mut self, m: Message) {
        self.out.push_back(Output::Send(m));
    }

    /// Tells the peer why, then emits the one `Failed`.
    fn fail(&mut self, err: UcxError) {
        if self.failed {
            return;
        }
        self.failed = true;
        self.send(Message::Bye(Reject {
            code: err.code(),
            message: err.to_string(),
        }));
        self.out.push_back(Output::Failed(err));
    }
}

/// Where the listener's negotiation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExportState {
    /// Offer sent, no answer yet; until this deadline.
    Offered(Instant),
    /// The initiator accepted: keys go out.
    Connected,
    /// UCX is off for the session (declined, unanswered, or the session ended).
    Off,
}

/// A region handed to [`UcxExport::export`] and not yet revoked.
#[derive(Debug, Clone)]
struct Export {
    region: UcxRegion,
    /// Its `UcxMap` went out (the peer may hold the key).
    sent: bool,
    /// Its `UcxUnmap` went out; the acknowledgement is due by then.
    unmapping: Option<Instant>,
}

/// The listener's side: offers its worker address and the keys of the regions it grants.
#[derive(Debug, Clone)]
pub struct UcxExport {
    core: Core,
    state: ExportState,
    timeout: Duration,
    exports: BTreeMap<RegionId, Export>,
}

impl UcxExport {
    /// Starts the negotiation of an established session whose initiator said
    /// [`crate::msg::Hello::ucx`]: the first output sends `address` (this listener's
    /// enveloped worker address), `host` (this host's identity, when known) and, with the
    /// host, `pid` (this process). `timeout` bounds the wait for the answer and for each
    /// unmap.
    pub fn new(
        address: Blob,
        host: Option<String>,
        pid: Option<u32>,
        timeout: Duration,
        now: Instant,
    ) -> Self {
        let mut core = Core::default();
        let pid = pid.filter(|_| host.is_some());
        core.send(Message::UcxOffer(UcxAddress { address, host, pid }));
        UcxExport {
            core,
            state: ExportState::Offered(now + timeout),
            timeout,
            exports: BTreeMap::new(),
        }
    }

    /// Grants `region` (registered for this session) to the peer over UCX: its key goes out
    /// now if the peer accepted, or once it does. Every region handed here comes back once as
    /// [`Output::Revoked`]. A region already exported is left as it is.
    pub fn export(&mut self, region: UcxRegion) {
        if self.core.failed || self.exports.contains_key(&region.id) {
            return;
        }
        let mut e = Export {
            region,
            sent: false,
            unmapping: None,
        };
        if self.state == ExportState::Connected {
            self.core.send(Message::UcxMap(e.region.clone()));
            e.sent = true;
        }
        self.exports.insert(e.region.id, e);
    }

    /// Ends the peer's access to region `id`: at once when it never had the key, after its
    /// `UcxUnmapped` when it had.
    pub fn revoke(&mut self, id: RegionId, now: Instant) {
        if self.core.failed {
            return;
        }
        let Some(e) = self.exports.get_mut(&id) else {
            return;
        };
        if !e.sent {
            self.exports.remove(&id);
            self.core.out.push_back(Output::Revoked { id });
        } else if e.unmapping.is_none() {
            e.unmapping = Some(now + self.timeout);
            self.core.send(Message::UcxUnmap(ShmRevoke { id }));
        }
    }

    /// A UCX message from the peer (any other is unexpected).
    pub fn handle_message(&mut self, m: Message) {
        if self.core.failed {
            return;
        }
        match (self.state, m) {
            (ExportState::Offered(_), Message::UcxAccept(_)) => {
                self.state = ExportState::Connected;
                for e in self.exports.values_mut() {
                    self.core
                        .out
                        .push_back(Output::Send(Message::UcxMap(e.region.clone())));
                    e.sent = true;
                }
                self.core.send(Message::UcxSync(Ready {}));
            }
            (ExportState::Offered(_), Message::UcxDecline(d)) => {
                self.state = ExportState::Off;
                self.core.out.push_back(Output::Fallback {
                    reason: format!("the peer declined UCX: {}", d.reason),
                });
            }
            // An answer after the offer's deadline: the session already fell back to TCP.
            (ExportState::Off, Message::UcxAccept(_) | Message::UcxDecline(_)) => {}
            (_, Message::UcxUnmapped(r)) => match self.exports.get(&r.id) {
                Some(e) if e.unmapping.is_some() => {
                    self.exports.remove(&r.id);
                    self.core.out.push_back(Output::Revoked { id: r.id });
                }
                _ => self.core.fail(UcxError::Unexpected {
                    step: UcxStep::Unmap,
                    message: "UcxUnmapped",
                }),
            },
            (state, m) => self.core.fail(UcxError::Unexpected {
                step: if state == ExportState::Connected {
                    UcxStep::Map
                } else {
                    UcxStep::Offer
                },
                message: m.name(),
            }),
        }
        self.after_failure();
    }

    /// The earliest deadline, if any: the driver calls [`UcxExport::handle_timeout`] then.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.core.failed {
            return None;
        }
        let offer = match self.state {
            ExportState::Offered(at) => Some(at),
            _ => None,
        };
        let unmap = self.exports.values().filter_map(|e| e.unmapping).min();
        offer.into_iter().chain(unmap).min()
    }

    /// Time passed: an unanswered offer falls back to TCP; an unacknowledged unmap fails.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.core.failed {
            return;
        }
        if let ExportState::Offered(at) = self.state {
            if now >= at {
                self.state = ExportState::Off;
                self.core.out.push_back(Output::Fallback {
                    reason: format!(
                        "the peer did not answer the UCX offer within {:?}",
                        self.timeout
                    ),
                });
            }
        }
        let late = self
            .exports
            .values()
            .find(|e| e.unmapping.is_some_and(|at| now >= at))
            .map(|e| e.region.id);
        if let Some(region) = late {
            self.core.fail(UcxError::UnmapTimeout {
                region,
                after: self.timeout,
            });
            self.after_failure();
        }
    }

    /// The session ends (for any reason): every region still exported is revoked.
    pub fn close(&mut self) {
        self.state = ExportState::Off;
        for (id, _) in std::mem::take(&mut self.exports) {
            self.core.out.push_back(Output::Revoked { id });
        }
    }

    /// After the one `Failed`: the session ends, so every key is revoked.
    fn after_failure(&mut self) {
        if self.core.failed {
            self.close();
        }
    }
}

/// The driver-facing calls both machines share, over their `core`.
macro_rules! machine_io {
    ($ty:ident) => {
        impl $ty {
            /// The next thing to do.
            pub fn poll_output(&mut self) -> Option<Output> {
                self.core.out.pop_front()
            }

            /// Whether the machine failed (the session must end).
            pub fn is_failed(&self) -> bool {
                self.core.failed
            }
        }
    };
}

machine_io!(UcxExport);
machine_io!(UcxImport);

/// Where the initiator's negotiation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ImportState {
    /// No `Welcome` yet: any UCX message is unexpected.
    Unwelcomed,
    /// No offer yet (a listener without UCX never sends one).
    Waiting,
    /// Creating the endpoint.
    Connecting,
    /// Accepted: keys may come.
    Connected,
    /// UCX is off for the session.
    Off,
    /// We declined before the offer came: the one offer still in flight is dropped.
    DeclinedEarly,
}

/// What the initiator holds of a region's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Import {
    /// Unpacked: operations may use it.
    Live,
    /// The unpack failed: the region goes over TCP.
    Unusable,
    /// `Release` asked; `released` not called yet.
    Releasing,
}

/// The initiator's side: connects to the listener's worker and takes its keys.
#[derive(Debug, Clone)]
pub struct UcxImport {
    core: Core,
    state: ImportState,
    imports: BTreeMap<RegionId, Import>,
    /// Until [`Output::Settled`] went out: the deadline by which it goes out anyway, and the
    /// time it allowed.
    settle_by: Option<(Instant, Duration)>,
    /// [`Output::Settled`] went out.
    settled: bool,
    /// This host's identity, when known: an offer naming it comes from this host.
    host: Option<String>,
}

impl Default for UcxImport {
    fn default() -> Self {
        Self::new()
    }
}

impl UcxImport {
    /// The machine of an initiator that said [`crate::msg::Hello::ucx`]; it learns from the
    /// listener's `Welcome` whether an offer follows ([`UcxImport::welcomed`]).
    /// It knows no host identity of its own, so it never takes a listener for a same-host
    /// one ([`UcxImport::on_host`]).
    pub fn new() -> Self {
        Self::on_host(None)
    }

    /// [`UcxImport::new`] on the host whose identity is `host`: an offer naming the same
    /// (non-empty) identity gets [`Output::Connect`] with `same_host`.
    pub fn on_host(host: Option<String>) -> Self {
        UcxImport {
            core: Core::default(),
            state: ImportState::Unwelcomed,
            imports: BTreeMap::new(),
            settle_by: None,
            settled: false,
            host: host.filter(|h| !h.is_empty()),
        }
    }

    /// The listener's `Welcome` said whether it offers UCX ([`crate::msg::Welcome::ucx`]).
    /// Without an offer the negotiation settles at once (TCP) and any UCX message is
    /// unexpected; with one it must settle by `now + timeout`.
    pub fn welcomed(&mut self, offers: bool, timeout: Duration, now: Instant) {
        if self.core.failed || self.state != ImportState::Unwelcomed {
            return;
        }
        if offers {
            self.state = ImportState::Waiting;
            self.settle_by = Some((now + timeout, timeout));
        } else {
            self.state = ImportState::Off;
            self.settle(None);
        }
    }

    /// Whether the negotiation settled ([`Output::Settled`] went out).
    pub fn is_settled(&self) -> bool {
        self.settled
    }

    fn settle(&mut self, unfinished: Option<String>) {
        if !self.settled && !self.core.failed {
            self.settled = true;
            self.settle_by = None;
            self.core.out.push_back(Output::Settled { unfinished });
        }
    }

    /// The deadline by which the negotiation settles, if it has not yet.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.settle_by
            .filter(|_| !self.core.failed)
            .map(|(at, _)| at)
    }

    /// Time passed: a negotiation not settled by its deadline settles now; without an offer
    /// yet (or while the endpoint is being created) it declines and falls back to TCP.
    pub fn handle_timeout(&mut self, now: Instant) {
        let Some((_, timeout)) = self
            .settle_by
            .filter(|(at, _)| now >= *at && !self.core.failed)
        else {
            return;
        };
        match self.state {
            ImportState::Waiting | ImportState::Connecting => {
                let early = self.state == ImportState::Waiting;
                self.decline(format!(
                    "the UCX negotiation did not reach an endpoint within {timeout:?}"
                ));
                if early {
                    self.state = ImportState::DeclinedEarly;
                }
                self.settle(None);
            }
            _ => self.settle(Some(format!(
                "the listener's UCX keys did not all come within {timeout:?}; regions without \
                 one go over TCP"
            ))),
        }
    }

    /// The endpoint to the offered address exists: accept.
    pub fn connected(&mut self) {
        if !self.core.failed && self.state == ImportState::Connecting {
            self.state = ImportState::Connected;
            self.core.send(Message::UcxAccept(Ready {}));
        }
    }

    /// The endpoint could not be created (or UCX is unusable here): decline, use TCP.
    pub fn connect_failed(&mut self, reason: String) {
        if !self.core.failed && self.state == ImportState::Connecting {
            self.decline(reason);
        }
    }

    fn decline(&mut self, reason: String) {
        self.state = ImportState::Off;
        let reason = bounded(reason);
        self.core.send(Message::UcxDecline(UcxDecline {
            reason: reason.clone(),
        }));
        self.core.out.push_back(Output::Fallback { reason });
        self.settle(None);
    }

    /// A region's key could not be unpacked: the region goes over TCP.
    pub fn import_failed(&mut self, id: RegionId) {
        if let Some(i @ Import::Live) = self.imports.get_mut(&id) {
            *i = Import::Unusable;
        }
    }

    /// Every operation on region `id` ended and its key is dropped: acknowledge the unmap.
    pub fn released(&mut self, id: RegionId) {
        if !self.core.failed && self.imports.get(&id) == Some(&Import::Releasing) {
            self.imports.remove(&id);
            self.core.send(Message::UcxUnmapped(ShmRevoke { id }));
        }
    }

    /// Whether operations on region `id` may use UCX now.
    pub fn usable(&self, id: &RegionId) -> bool {
        !self.core.failed && self.imports.get(id) == Some(&Import::Live)
    }

    /// A UCX message from the peer (any other is unexpected).
    pub fn handle_message(&mut self, m: Message) {
        if self.core.failed {
            return;
        }
        match (self.state, m) {
            (ImportState::Waiting, Message::UcxOffer(o)) => {
                match check_blob(&o.address, "worker address", UcxStep::Offer) {
                    Ok(()) => {
                        self.state = ImportState::Connecting;
                        let same_host = self.host.is_some() && o.host == self.host;
                        self.core.out.push_back(Output::Connect {
                            address: o.address,
                            same_host,
                            pid: o.pid.filter(|_| same_host),
                        });
                    }
                    Err(e) => self.decline(e.to_string()),
                }
            }
            // The offer that crossed our early decline: the listener falls back on the decline.
            (ImportState::DeclinedEarly, Message::UcxOffer(_)) => self.state = ImportState::Off,
            (ImportState::Connected, Message::UcxMap(r)) => self.on_map(r),
            (ImportState::Connected, Message::UcxSync(_)) => {
                self.core.out.push_back(Output::Synced);
                self.settle(None);
            }
            (_, Message::UcxUnmap(r)) => match self.imports.get(&r.id) {
                Some(Import::Live) => {
                    self.imports.insert(r.id, Import::Releasing);
                    self.core.out.push_back(Output::Release { id: r.id });
                }
                Some(Import::Unusable) => {
                    self.imports.remove(&r.id);
                    self.core.send(Message::UcxUnmapped(ShmRevoke { id: r.id }));
                }
                Some(Import::Releasing) | None => self.core.fail(UcxError::Unexpected {
                    step: UcxStep::Unmap,
                    message: "UcxUnmap",
                }),
            },
            (state, m) => self.core.fail(UcxError::Unexpected {
                step: if state == ImportState::Connected {
                    UcxStep::Map
                } else {
                    UcxStep::Offer
                },
                message: m.name(),
            }),
        }
    }

    fn on_map(&mut self, r: UcxRegion) {
        let checked = check_blob(&r.rkey, "remote key", UcxStep::Map).and_then(|()| {
            if r.len == 0 || r.base.checked_add(r.len).is_none() {
                return Err(UcxError::Malformed {
                    step: UcxStep::Map,
                    what: format!(
                        "region {:?} at {:#x} of {} bytes is empty or wraps",
                        r.id, r.base, r.len
                    ),
                });
            }
            if self.imports.contains_key(&r.id) {
                return Err(UcxError::Malformed {
                    step: UcxStep::Map,
                    what: format!("region {:?} offered twice", r.id),
                });
            }
            Ok(())
        });
        match checked {
            Ok(()) => {
                self.imports.insert(r.id, Import::Live);
                self.core.out.push_back(Output::Import(r));
            }
            Err(e) => self.core.fail(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(tag: u8) -> UcxRegion {
        UcxRegion {
            id: RegionId([tag; 16]),
            base: 0x1000 * u64::from(tag),
            len: 4096,
            rkey: Blob(vec![tag; 32]),
        }
    }

    /// An initiator whose listener's `Welcome` said an offer follows.
    fn welcomed_import() -> UcxImport {
        let mut m = UcxImport::new();
        m.welcomed(true, Duration::from_secs(5), Instant::now());
        m
    }

    fn drain_import(m: &mut UcxImport) -> Vec<Output> {
        std::iter::from_fn(|| m.poll_output()).collect()
    }

    fn connected_import() -> UcxImport {
        let mut m = welcomed_import();
        m.handle_message(Message::UcxOffer(UcxAddress {
            address: Blob(vec![1; 64]),
            host: None,
            pid: None,
        }));
        m.connected();
        drain_import(&mut m);
        m
    }

    fn settled(out: &[Output]) -> Vec<Option<String>> {
        out.iter()
            .filter_map(|o| match o {
                Output::Settled { unfinished } => Some(unfinished.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn without_an_offer_in_the_welcome_it_settles_at_once_and_refuses_offers() {
        let mut m = UcxImport::new();
        m.welcomed(false, Duration::from_secs(5), Instant::now());
        assert!(m.is_settled());
        assert_eq!(settled(&drain_import(&mut m)), vec![None]);
        assert_eq!(m.poll_timeout(), None);
        m.handle_message(Message::UcxOffer(UcxAddress {
            address: Blob(vec![1; 8]),
            host: None,
            pid: None,
        }));
        assert!(m.is_failed(), "an offer the Welcome did not announce");
    }

    #[test]
    fn a_ucx_message_before_the_welcome_fails() {
        let mut m = UcxImport::new();
        m.handle_message(Message::UcxOffer(UcxAddress {
            address: Blob(vec![1; 8]),
            host: None,
            pid: None,
        }));
        assert!(m.is_failed());
    }

    #[test]
    fn it_settles_once_every_key_granted_so_far_is_imported() {
        let mut m = connected_import();
        assert!(!m.is_settled());
        m.handle_message(Message::UcxMap(region(1)));
        assert!(!m.is_settled(), "settled before the UcxSync");
        m.handle_message(Message::UcxSync(Ready {}));
        let out = drain_import(&mut m);
        assert!(matches!(out[0], Output::Import(_)), "{out:?}");
        assert_eq!(settled(&out), vec![None]);
        assert!(m.usable(&RegionId([1; 16])));
        // A second sync (or a key granted later) does not settle it again.
        m.handle_message(Message::UcxMap(region(2)));
        m.handle_message(Message::UcxSync(Ready {}));
        assert!(settled(&drain_import(&mut m)).is_empty());
        assert_eq!(m.poll_timeout(), None);
    }

    #[test]
    fn no_offer_by_the_deadline_declines_then_drops_the_crossing_offer() {
        let t0 = Instant::now();
        let mut m = UcxImport::new();
        m.welcomed(true, Duration::from_secs(5), t0);
        assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        m.handle_timeout(t0 + Duration::from_secs(4));
        assert!(!m.is_settled());
        m.handle_timeout(t0 + Duration::from_secs(5));
        let out = drain_import(&mut m);
        assert!(
            matches!(&out[0], Output::Send(Message::UcxDecline(d)) if d.reason.contains("5s")),
            "{out:?}"
        );
        assert!(matches!(out[1], Output::Fallback { .. }));
        assert_eq!(settled(&out), vec![None]);
        let offer = Message::UcxOffer(UcxAddress {
            address: Blob(vec![1; 8]),
            host: None,
            pid: None,
        });
        m.handle_message(offer.clone());
        assert!(!m.is_failed(), "the offer that crossed the decline");
        assert!(drain_import(&mut m).is_empty());
        m.handle_message(offer);
        assert!(m.is_failed(), "a second offer");
    }

    #[test]
    fn keys_late_past_the_deadline_settle_it_unfinished_and_still_import() {
        let t0 = Instant::now();
        let mut m = UcxImport::new();
        m.welcomed(true, Duration::from_secs(5), t0);
        m.handle_message(Message::UcxOffer(UcxAddress {
            address: Blob(vec![1; 8]),
            host: None,
            pid: None,
        }));
        m.connected();
        drain_import(&mut m);
        m.handle_timeout(t0 + Duration::from_secs(5));
        let s = settled(&drain_import(&mut m));
        assert!(matches!(&s[..], [Some(why)] if why.contains("5s")), "{s:?}");
        m.handle_message(Message::UcxMap(region(1)));
        m.handle_message(Message::UcxSync(Ready {}));
        assert!(settled(&drain_import(&mut m)).is_empty());
        assert!(m.usable(&RegionId([1; 16])));
    }

    #[test]
    fn a_key_before_the_accept_fails_the_session() {
        let mut m = welcomed_import();
        m.handle_message(Message::UcxMap(region(1)));
        let out = drain_import(&mut m);
        assert!(matches!(
            out.last(),
            Some(Output::Failed(UcxError::Unexpected {
                step: UcxStep::Offer,
                message: "UcxMap"
            }))
        ));
        assert!(matches!(out[0], Output::Send(Message::Bye(_))));
    }

    #[test]
    fn oversized_empty_or_wrapping_blobs_are_refused() {
        // An offer with an oversized address is declined, not handed to UCX.
        let mut m = welcomed_import();
        m.handle_message(Message::UcxOffer(UcxAddress {
            address: Blob(vec![0; MAX_UCX_BLOB + 1]),
            host: None,
            pid: None,
        }));
        let out = drain_import(&mut m);
        assert!(
            matches!(out[0], Output::Send(Message::UcxDecline(_))),
            "{out:?}"
        );
        assert!(matches!(out[1], Output::Fallback { .. }));
        assert!(!m.is_failed());

        for bad in [
            UcxRegion {
                rkey: Blob(vec![]),
                ..region(1)
            },
            UcxRegion {
                rkey: Blob(vec![0; MAX_UCX_BLOB + 1]),
                ..region(1)
            },
            UcxRegion {
                len: 0,
                ..region(1)
            },
            UcxRegion {
                base: u64::MAX - 10,
                ..region(1)
            },
        ] {
            let mut m = connected_import();
            m.handle_message(Message::UcxMap(bad));
            let out = drain_import(&mut m);
            assert!(
                matches!(out.last(), Some(Output::Failed(UcxError::Malformed { .. }))),
                "{out:?}"
            );
            assert!(!m.usable(&RegionId([1; 16])));
        }
    }

    #[test]
    fn a_region_offered_twice_or_unmapped_unknown_fails() {
        let mut m = connected_import();
        m.handle_message(Message::UcxMap(region(1)));
        m.handle_message(Message::UcxMap(region(1)));
        assert!(m.is_failed());

        let mut m = connected_import();
        m.handle_message(Message::UcxUnmap(ShmRevoke {
            id: RegionId([9; 16]),
        }));
        assert!(m.is_failed());
    }

    #[test]
    fn an_unusable_key_is_acknowledged_at_once() {
        let mut m = connected_import();
        m.handle_message(Message::UcxMap(region(1)));
        drain_import(&mut m);
        m.import_failed(RegionId([1; 16]));
        assert!(!m.usable(&RegionId([1; 16])));
        m.handle_message(Message::UcxUnmap(ShmRevoke {
            id: RegionId([1; 16]),
        }));
        assert_eq!(
            drain_import(&mut m),
            vec![Output::Send(Message::UcxUnmapped(ShmRevoke {
                id: RegionId([1; 16])
            }))]
        );
    }

    #[test]
    fn an_unanswered_offer_falls_back_and_a_late_answer_is_ignored() {
        let t0 = Instant::now();
        let mut m = UcxExport::new(Blob(vec![1; 8]), None, None, Duration::from_secs(5), t0);
        m.export(region(1));
        assert_eq!(m.poll_timeout(), Some(t0 + Duration::from_secs(5)));
        m.handle_timeout(t0 + Duration::from_secs(5));
        let out: Vec<_> = std::iter::from_fn(|| m.poll_output()).collect();
        assert!(
            matches!(out.last(), Some(Output::Fallback { .. })),
            "{out:?}"
        );
        m.handle_message(Message::UcxAccept(Ready {}));
        assert!(m.poll_output().is_none(), "no key after the fallback");
        m.revoke(RegionId([1; 16]), t0);
        assert_eq!(
            m.poll_output(),
            Some(Output::Revoked {
                id: RegionId([1; 16])
            })
        );
    }

    #[test]
    fn an_unacknowledged_unmap_fails_the_session_and_revokes_every_key() {
        let t0 = Instant::now();
        let mut m = UcxExport::new(Blob(vec![1; 8]), None, None, Duration::from_secs(5), t0);
        m.export(region(1));
        m.export(region(2));
        m.handle_message(Message::UcxAccept(Ready {}));
        m.revoke(RegionId([1; 16]), t0);
        while m.poll_output().is_some() {}
        m.handle_timeout(t0 + Duration::from_secs(4));
        assert!(!m.is_failed());
        m.handle_timeout(t0 + Duration::from_secs(5));
        let out: Vec<_> = std::iter::from_fn(|| m.poll_output()).collect();
        assert!(matches!(out[0], Output::Send(Message::Bye(_))));
        assert!(matches!(
            out[1],
            Output::Failed(UcxError::UnmapTimeout { .. })
        ));
        let revoked: Vec<_> = out[2..].to_vec();
        assert_eq!(
            revoked,
            vec![
                Output::Revoked {
                    id: RegionId([1; 16])
                },
                Output::Revoked {
                    id: RegionId([2; 16])
                }
            ]
        );
        assert_eq!(m.poll_timeout(), None);
    }

    #[test]
    fn a_long_decline_reason_is_cut_to_the_wire_limit() {
        let mut m = welcomed_import();
        m.handle_message(Message::UcxOffer(UcxAddress {
            address: Blob(vec![1; 8]),
            host: None,
            pid: None,
        }));
        assert!(matches!(m.poll_output(), Some(Output::Connect { .. })));
        m.connect_failed("é".repeat(MAX_UCX_REASON_LEN));
        match m.poll_output() {
            Some(Output::Send(Message::UcxDecline(d))) => {
                assert!(d.reason.len() <= MAX_UCX_REASON_LEN);
                let body = Message::UcxDecline(d).encode_body().unwrap();
                assert!(Message::decode(&body).is_ok());
            }
            other => panic!("{other:?}"),
        }
    }
}
