//! Drives the cross-memory-attach probe's two machines against each other under every
//! interleaving of message deliveries, the listener's syncs (grants changing at any time),
//! the listener's driver making the canary and the initiator's driver reading it,
//! exhaustively, for every combination of what each side allows and what the read gives.
//!
//! What must hold in every ordering: no machine fails; no `ShmSync` leaves the listener while
//! a probe is open; the initiator reports `Synced` only for a sync sent after the listener's
//! verdict (when it asked), so the sync it waits for covers the regions offered by address;
//! and once everything is delivered the initiator is synced, and cross-memory attach is on
//! exactly when it was asked for and the canary read back right.

use kvbridge_proto::msg::{Message, Ready};
use kvbridge_proto::same_host::{CmaOffer, CmaProber, CmaState, OfferOutput, ProberOutput};
use std::collections::VecDeque;

const CANARY: [u8; 32] = [0xa5; 32];
const CANARY_ADDR: u64 = 0x7000_0000;

/// What the initiator's read of the canary gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    Canary,
    OtherBytes,
    Refused,
}

#[derive(Clone)]
struct Pair {
    offer: CmaOffer,
    prober: CmaProber,
    /// Listener → initiator, each `ShmSync` tagged with the listener's probe state when it
    /// left.
    to_initiator: VecDeque<(Message, CmaState)>,
    to_listener: VecDeque<Message>,
    /// The listener's driver was asked for a canary and has not made it yet.
    making: bool,
    /// The initiator's driver was asked to read the canary and has not yet.
    reading: bool,
    read: Read,
    /// Syncs the listener's driver may still start (grants changing).
    syncs_left: u32,
    /// Probe states of the syncs that made the initiator report `Synced`.
    synced_by: Vec<CmaState>,
    verdict: Option<bool>,
    violations: Vec<String>,
}

impl Pair {
    fn new(offered: bool, ask: bool, read: Read) -> Pair {
        let mut p = Pair {
            offer: CmaOffer::new(offered),
            prober: CmaProber::new(ask),
            to_initiator: VecDeque::new(),
            to_listener: VecDeque::new(),
            making: false,
            reading: false,
            read,
            syncs_left: 2,
            synced_by: Vec::new(),
            verdict: None,
            violations: Vec::new(),
        };
        // The connection is bound: the listener's first sync of its exports.
        p.sync();
        p
    }

    /// The listener's driver syncs its exports (the `ShmMap`s are the driver's, not the
    /// machine's; only the sync matters here), when the machine allows it.
    fn sync(&mut self) {
        if self.offer.may_sync() {
            self.to_initiator
                .push_back((Message::ShmSync(Ready {}), self.offer.state()));
        }
    }

    fn pump(&mut self) {
        while let Some(o) = self.offer.poll_output() {
            match o {
                OfferOutput::Send(m) => {
                    if matches!(m, Message::ShmSync(_)) && !self.offer.may_sync() {
                        self.violations.push("ShmSync while a probe is open".into());
                    }
                    self.to_initiator.push_back((m, self.offer.state()));
                }
                OfferOutput::MakeCanary => self.making = true,
                OfferOutput::Verdict { on, .. } => {
                    self.verdict = Some(on);
                    self.sync();
                }
                OfferOutput::Failed(e) => self.violations.push(format!("listener failed: {e}")),
            }
        }
        while let Some(o) = self.prober.poll_output() {
            match o {
                ProberOutput::Send(m) => self.to_listener.push_back(m),
                ProberOutput::ReadCanary { .. } => self.reading = true,
                ProberOutput::Synced => {}
                ProberOutput::Failed(e) => self.violations.push(format!("initiator failed: {e}")),
            }
        }
    }

    /// Every step that can happen next, applied to a copy.
    fn successors(&self) -> Vec<Pair> {
        let mut next = Vec::new();
        if !self.to_initiator.is_empty() {
            let mut p = self.clone();
            let (m, tag) = p.to_initiator.pop_front().expect("checked");
            p.prober.handle_message(m);
            // `Synced` is the first output of a sync when it comes.
            let mut kept = VecDeque::new();
            while let Some(o) = p.prober.poll_output() {
                if o == ProberOutput::Synced {
                    p.synced_by.push(tag);
                } else {
                    kept.push_back(o);
                }
            }
            for o in kept {
                match o {
                    ProberOutput::Send(m) => p.to_listener.push_back(m),
                    ProberOutput::ReadCanary { .. } => p.reading = true,
                    ProberOutput::Failed(e) => p.violations.push(format!("initiator failed: {e}")),
                    ProberOutput::Synced => unreachable!("taken above"),
                }
            }
            p.pump();
            next.push(p);
        }
        if !self.to_listener.is_empty() {
            let mut p = self.clone();
            let m = p.to_listener.pop_front().expect("checked");
            p.offer.handle_message(m);
            p.pump();
            next.push(p);
        }
        if self.making {
            let mut p = self.clone();
            p.making = false;
            p.offer.canary(CANARY_ADDR, CANARY.to_vec());
            p.pump();
            next.push(p);
        }
        if self.reading {
            let mut p = self.clone();
            p.reading = false;
            p.prober.probed(match p.read {
                Read::Canary => Ok(CANARY.to_vec()),
                Read::OtherBytes => Ok(vec![0; CANARY.len()]),
                Read::Refused => Err("not permitted".into()),
            });
            p.pump();
            next.push(p);
        }
        if self.syncs_left > 0 {
            let mut p = self.clone();
            p.syncs_left -= 1;
            p.sync();
            next.push(p);
        }
        next
    }

    fn idle(&self) -> bool {
        self.to_initiator.is_empty() && self.to_listener.is_empty() && !self.making && !self.reading
    }
}

/// Explores every ordering from `start`; returns the number of complete runs.
fn explore(start: Pair, offered: bool, ask: bool, read: Read) -> usize {
    let mut runs = 0;
    let mut stack = vec![start];
    while let Some(p) = stack.pop() {
        assert!(
            p.violations.is_empty(),
            "offered {offered}, ask {ask}, read {read:?}: {:?}",
            p.violations
        );
        for tag in &p.synced_by {
            // A sync answered while the probe was still to be asked or open does not count.
            if ask && !matches!(tag, CmaState::On | CmaState::Refused) {
                panic!("offered {offered}, ask {ask}, read {read:?}: Synced by a sync sent in state {tag:?}");
            }
        }
        let next = p.successors();
        if next.is_empty() || (p.idle() && p.syncs_left == 0) {
            assert!(p.idle(), "stuck with work left");
            runs += 1;
            assert!(
                !p.synced_by.is_empty(),
                "offered {offered}, ask {ask}, read {read:?}: never synced"
            );
            let on = ask && read == Read::Canary;
            assert_eq!(p.offer.cma_on(), on, "read {read:?}, ask {ask}");
            assert_eq!(p.verdict.is_some(), ask, "a verdict exactly when asked");
            continue;
        }
        stack.extend(next);
    }
    runs
}

#[test]
fn every_ordering_keeps_the_sync_after_the_verdict() {
    let mut total = 0;
    for (offered, ask) in [(false, false), (true, false), (true, true)] {
        for read in [Read::Canary, Read::OtherBytes, Read::Refused] {
            let runs = explore(Pair::new(offered, ask, read), offered, ask, read);
            assert!(runs > 0);
            total += runs;
        }
    }
    // Not a property: shows the exploration is not trivially small.
    assert!(total > 100, "{total} orderings");
}

/// Messages nobody asked for fail the machine with a typed error, and nothing follows.
#[test]
fn unasked_messages_fail_the_machine() {
    let probe = Message::CmaProbe(kvbridge_proto::msg::CmaCanary { addr: 1, len: 8 });
    let mut prober = CmaProber::new(false);
    prober.handle_message(probe.clone());
    assert!(matches!(
        prober.poll_output(),
        Some(ProberOutput::Failed(_))
    ));
    prober.handle_message(Message::ShmSync(Ready {}));
    assert_eq!(prober.poll_output(), None, "nothing after a failure");

    // Asked for, but the probe comes before the ask went out.
    let mut prober = CmaProber::new(true);
    prober.handle_message(probe);
    assert!(matches!(
        prober.poll_output(),
        Some(ProberOutput::Failed(_))
    ));

    let mut offer = CmaOffer::new(false);
    offer.handle_message(Message::CmaAsk(Ready {}));
    assert!(matches!(offer.poll_output(), Some(OfferOutput::Failed(_))));

    let mut offer = CmaOffer::new(true);
    offer.handle_message(Message::CmaAsk(Ready {}));
    assert_eq!(offer.poll_output(), Some(OfferOutput::MakeCanary));
    offer.handle_message(Message::CmaAsk(Ready {}));
    assert!(matches!(offer.poll_output(), Some(OfferOutput::Failed(_))));
    assert!(!offer.may_sync(), "a failed machine allows no sync");

    let mut offer = CmaOffer::new(true);
    offer.handle_message(Message::CmaProbed(kvbridge_proto::msg::CmaEcho {
        data: kvbridge_proto::ids::Blob(CANARY.to_vec()),
        error: None,
    }));
    assert!(matches!(offer.poll_output(), Some(OfferOutput::Failed(_))));
    assert!(!offer.cma_on());
}

/// The initiator reads at most `MAX_CANARY_LEN` bytes, whatever the listener asks.
#[test]
fn the_canary_read_is_bounded() {
    let mut prober = CmaProber::new(true);
    prober.handle_message(Message::ShmSync(Ready {}));
    assert!(matches!(
        prober.poll_output(),
        Some(ProberOutput::Send(Message::CmaAsk(_)))
    ));
    prober.handle_message(Message::CmaProbe(kvbridge_proto::msg::CmaCanary {
        addr: 1,
        len: u32::MAX,
    }));
    assert_eq!(
        prober.poll_output(),
        Some(ProberOutput::ReadCanary {
            addr: 1,
            len: kvbridge_proto::same_host::MAX_CANARY_LEN
        })
    );
}
