//! The cross-memory-attach probe of the same-host sub-protocol, and when a sync is the last
//! word, as two sans-IO state machines.
//!
//! ```text
//! initiator (CmaProber)                           listener (CmaOffer)
//!                                           <--- ShmMap ... (regions by memfd), ShmSync
//! (asks, when both allow it)
//!   first ShmSync      -> CmaAsk            --->  Output::MakeCanary: the driver makes one and
//!                                                 calls canary(addr, bytes)
//!                                           <---  CmaProbe{addr, len}  (no ShmSync until answered)
//! Output::ReadCanary{addr, len}: the driver reads it by cross-memory attach, then
//!   probed(Ok(bytes) | Err(why)) -> CmaProbed ---> Output::Verdict{on}: the driver syncs again,
//!                                                 now offering unmappable regions by address
//!                                           <---  ShmMap{addr} ..., ShmSync
//! Output::Synced: every region the listener grants us is offered
//! ```
//!
//! The rules the machines keep, whatever order events come in:
//! - **No `ShmSync` is the last word while a probe is open.** The listener sends none between
//!   its canary and the answer ([`CmaOffer::may_sync`]); the initiator reports
//!   [`ProberOutput::Synced`] only for a `ShmSync` after it answered the probe, so the sync it
//!   waits for already covers the regions offered by address.
//! - **Addresses only after the canary came back.** The listener turns cross-memory attach on
//!   only when the echo is exactly its canary's bytes.
//! - **Nothing unasked.** A `CmaProbe` the initiator did not ask for, a second `CmaAsk`, a
//!   `CmaAsk` to a listener that did not offer it, or a `CmaProbed` without a probe fails the
//!   machine with a typed error; the driver ends the shared-memory connection (TCP carries
//!   the data) or the session.
//!
//! The machines hold no timer: the initiator's driver bounds its wait for `Synced` by the
//! handshake step (then TCP carries the data), and the listener's probe ends with its session.

use crate::msg::{CmaCanary, CmaEcho, Message, Ready};
use std::collections::VecDeque;
use thiserror::Error;

/// Most canary bytes the initiator reads, whatever the listener asks.
pub const MAX_CANARY_LEN: u32 = 4096;

/// Why a machine of the probe failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// The peer sent a message the machine's state cannot serve.
    #[error("cross-memory attach: unexpected {message} from the peer ({why})")]
    Unexpected {
        /// The message's name.
        message: &'static str,
        /// Why it does not fit.
        why: &'static str,
    },
}

/// Where the listener's probe stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CmaState {
    /// Not asked for.
    #[default]
    Idle,
    /// Asked; the canary is being made by the driver.
    Making,
    /// Canary sent, answer awaited.
    Probing,
    /// The peer read the canary: unmappable regions are offered by address.
    On,
    /// The probe failed: those regions go over TCP.
    Refused,
}

/// What the listener's machine asks of its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OfferOutput {
    /// Send this on the shared-memory connection.
    Send(Message),
    /// Make a fresh random canary, keep it for the session, and call [`CmaOffer::canary`].
    MakeCanary,
    /// The probe ended: `on` says whether unmappable regions are offered by address; the
    /// driver syncs its exports again ([`CmaOffer::may_sync`] allows it now).
    Verdict {
        /// Cross-memory attach is on with this peer.
        on: bool,
        /// Why not, when it is not.
        why: Option<String>,
        /// The peer said its read failed (a refusal of its kernel), rather than sending
        /// bytes that are not our canary (which names another process: suspicious).
        read_failed: bool,
    },
    /// The machine failed; nothing follows.
    Failed(ProbeError),
}

/// The listener's side of the probe.
#[derive(Debug, Clone)]
pub struct CmaOffer {
    offered: bool,
    state: CmaState,
    canary: Option<Vec<u8>>,
    out: VecDeque<OfferOutput>,
    failed: bool,
}

impl CmaOffer {
    /// A listener that offered cross-memory attach (`offered`) or not.
    pub fn new(offered: bool) -> Self {
        Self {
            offered,
            state: CmaState::Idle,
            canary: None,
            out: VecDeque::new(),
            failed: false,
        }
    }

    /// Where the probe stands.
    pub fn state(&self) -> CmaState {
        self.state
    }

    /// Whether a `ShmSync` may go out now: not while a probe is open.
    pub fn may_sync(&self) -> bool {
        !self.failed && !matches!(self.state, CmaState::Making | CmaState::Probing)
    }

    /// Whether unmappable regions are offered by address.
    pub fn cma_on(&self) -> bool {
        self.state == CmaState::On
    }

    fn fail(&mut self, message: &'static str, why: &'static str) {
        self.failed = true;
        self.out
            .push_back(OfferOutput::Failed(ProbeError::Unexpected { message, why }));
    }

    /// A message of the probe from the initiator (`CmaAsk`, `CmaProbed`); others are the
    /// driver's.
    pub fn handle_message(&mut self, m: Message) {
        if self.failed {
            return;
        }
        match m {
            Message::CmaAsk(_) if !self.offered => self.fail("CmaAsk", "not offered"),
            Message::CmaAsk(_) if self.state != CmaState::Idle => {
                self.fail("CmaAsk", "asked twice")
            }
            Message::CmaAsk(_) => {
                self.state = CmaState::Making;
                self.out.push_back(OfferOutput::MakeCanary);
            }
            Message::CmaProbed(_) if self.state != CmaState::Probing => {
                self.fail("CmaProbed", "no probe is open")
            }
            Message::CmaProbed(echo) => {
                let read_failed = echo.error.is_some();
                let (on, why) = match (echo.error, &self.canary) {
                    (None, Some(c)) if &echo.data.0 == c => (true, None),
                    (Some(why), _) => (false, Some(format!("the peer could not read our memory: {why}"))),
                    _ => (
                        false,
                        Some("the peer read other bytes than our canary (a different process with our pid?)".into()),
                    ),
                };
                self.state = if on { CmaState::On } else { CmaState::Refused };
                self.out.push_back(OfferOutput::Verdict {
                    on,
                    why,
                    read_failed,
                });
            }
            _ => {}
        }
    }

    /// The canary the driver made after [`OfferOutput::MakeCanary`]: `bytes` at `addr` in
    /// this process, kept alive for the whole session.
    pub fn canary(&mut self, addr: u64, bytes: Vec<u8>) {
        if self.failed || self.state != CmaState::Making {
            return;
        }
        let len = bytes.len() as u32;
        self.canary = Some(bytes);
        self.state = CmaState::Probing;
        self.out
            .push_back(OfferOutput::Send(Message::CmaProbe(CmaCanary {
                addr,
                len,
            })));
    }

    /// The next thing for the driver to do.
    pub fn poll_output(&mut self) -> Option<OfferOutput> {
        self.out.pop_front()
    }
}

/// Where the initiator's probe stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// Will ask at the first `ShmSync`.
    ToAsk,
    /// Asked; no canary yet.
    Asked,
    /// The driver is reading the canary.
    Reading,
    /// Answered, or never to be asked.
    Done,
}

/// What the initiator's machine asks of its driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProberOutput {
    /// Send this on the shared-memory connection.
    Send(Message),
    /// Read `len` bytes at `addr` of the listener's process, then call [`CmaProber::probed`].
    ReadCanary {
        /// Address in the listener's process.
        addr: u64,
        /// Bytes (at most [`MAX_CANARY_LEN`]).
        len: u32,
    },
    /// Every region the listener grants us is offered: the session may be reported up.
    Synced,
    /// The machine failed; nothing follows.
    Failed(ProbeError),
}

/// The initiator's side of the probe.
#[derive(Debug, Clone)]
pub struct CmaProber {
    probe: Probe,
    out: VecDeque<ProberOutput>,
    failed: bool,
}

impl CmaProber {
    /// An initiator that asks for cross-memory attach (`ask`: both sides allow it) or not.
    pub fn new(ask: bool) -> Self {
        Self {
            probe: if ask { Probe::ToAsk } else { Probe::Done },
            out: VecDeque::new(),
            failed: false,
        }
    }

    /// A message of the probe or a sync from the listener (`ShmSync`, `CmaProbe`); others are
    /// the driver's.
    pub fn handle_message(&mut self, m: Message) {
        if self.failed {
            return;
        }
        match (m, self.probe) {
            (Message::ShmSync(_), Probe::Done) => self.out.push_back(ProberOutput::Synced),
            // The first sync: the listener bound this connection to the session, so a frame
            // sent now reaches the session (one sent before could be read by its acceptor).
            (Message::ShmSync(_), Probe::ToAsk) => {
                self.probe = Probe::Asked;
                self.out
                    .push_back(ProberOutput::Send(Message::CmaAsk(Ready {})));
            }
            (Message::ShmSync(_), _) => {}
            (Message::CmaProbe(c), Probe::Asked) => {
                self.probe = Probe::Reading;
                self.out.push_back(ProberOutput::ReadCanary {
                    addr: c.addr,
                    len: c.len.min(MAX_CANARY_LEN),
                });
            }
            (Message::CmaProbe(_), _) => {
                self.failed = true;
                self.out
                    .push_back(ProberOutput::Failed(ProbeError::Unexpected {
                        message: "CmaProbe",
                        why: "not asked for",
                    }));
            }
            _ => {}
        }
    }

    /// What the driver read of the canary (`Err`: why it could not).
    pub fn probed(&mut self, read: Result<Vec<u8>, String>) {
        if self.failed || self.probe != Probe::Reading {
            return;
        }
        self.probe = Probe::Done;
        let echo = match read {
            Ok(data) => CmaEcho {
                data: crate::ids::Blob(data),
                error: None,
            },
            Err(why) => CmaEcho {
                data: crate::ids::Blob(Vec::new()),
                error: Some(why),
            },
        };
        self.out
            .push_back(ProberOutput::Send(Message::CmaProbed(echo)));
    }

    /// The next thing for the driver to do.
    pub fn poll_output(&mut self) -> Option<ProberOutput> {
        self.out.pop_front()
    }
}
