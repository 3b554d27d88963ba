//! Drives the UCX negotiation's two machines against each other under every interleaving of
//! message deliveries, the listener's grants and revokes, and the initiator driver's answers
//! (endpoint created or not, keys unpacked or not, releases finished), exhaustively; and
//! under arbitrary peer messages (property test).
//!
//! What must hold in every ordering: no machine fails; the listener revokes a region (unmaps
//! its key) only when the initiator's driver no longer holds that key; every region handed to
//! `export` comes back exactly once as `Revoked`; once everything is delivered, the initiator
//! holds the key of every region the listener still grants (or UCX is off); and the
//! initiator settles (its session starts) exactly once, and when it settles finished and on
//! UCX, it holds the key of every region the listener had granted when it sent `UcxSync`.
//! The initiator's settle deadline may pass at any point (one branch per run).
//!
//! The host identities of both sides vary too: the initiator's `Connect` says `same_host`
//! exactly when it knows its own identity and the listener's offer names the same one, and
//! a host claim changes nothing else in what the initiator does (property test).

use kvbridge_proto::ids::Blob;
use kvbridge_proto::msg::{Message, Ready, ShmRevoke, UcxAddress, UcxDecline, UcxRegion};
use kvbridge_proto::ucx_link::{Output, UcxExport, UcxImport};
use kvbridge_proto::RegionId;
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(10);

fn region(tag: u8) -> UcxRegion {
    UcxRegion {
        id: RegionId([tag; 16]),
        base: 0x10_0000 * u64::from(tag),
        len: 1 << 16,
        rkey: Blob(vec![tag; 24]),
    }
}

/// What the listener's driver does, in this order, interleaved with everything else.
#[derive(Debug, Clone, Copy)]
enum Grant {
    Export(u8),
    Revoke(u8),
}

/// Both machines, their drivers' state, and the messages in flight.
#[derive(Clone)]
struct Pair {
    imp: UcxImport,
    exp: UcxExport,
    to_listener: VecDeque<Message>,
    to_initiator: VecDeque<Message>,
    script: VecDeque<Grant>,
    /// The initiator's driver is creating an endpoint.
    connecting: bool,
    /// Keys the initiator's driver holds (unpacked, not dropped).
    keys: BTreeSet<RegionId>,
    /// Releases asked of the initiator's driver and not finished.
    releasing: BTreeSet<RegionId>,
    /// `Revoked` outputs per region.
    revoked: BTreeMap<RegionId, u32>,
    exported: BTreeSet<RegionId>,
    fell_back: bool,
    /// One unpack may fail in this run (a branch).
    unpack_failure_left: bool,
    /// The initiator's settle deadline may pass once in this run (a branch).
    timeout_left: bool,
    /// Keys whose unpack failed (the region goes over TCP).
    unusable: BTreeSet<RegionId>,
    /// The regions the listener had sent keys of when its `UcxSync` went out.
    at_sync: Option<BTreeSet<RegionId>>,
    /// The initiator was handed the listener's `UcxSync`.
    sync_delivered: bool,
    /// Keys sent by the listener and not revoked.
    sent_keys: BTreeSet<RegionId>,
    /// `Settled` outputs: whether each was unfinished.
    settled: Vec<bool>,
    /// What the initiator's `Connect` must say.
    same_host: bool,
    now: Instant,
    violations: Vec<String>,
}

/// Host identities of (the listener, the initiator), and whether they make one host.
const HOSTS: [(Option<&str>, Option<&str>, bool); 5] = [
    (Some("boot-a/net/pid"), Some("boot-a/net/pid"), true),
    (Some("boot-b/net/pid"), Some("boot-a/net/pid"), false),
    (None, Some("boot-a/net/pid"), false),
    (Some("boot-a/net/pid"), None, false),
    (None, None, false),
];

impl Pair {
    fn new(script: &[Grant]) -> Pair {
        Pair::on_hosts(script, HOSTS[0])
    }

    fn on_hosts(script: &[Grant], hosts: (Option<&str>, Option<&str>, bool)) -> Pair {
        let now = Instant::now();
        let (listener, initiator, same_host) = hosts;
        let mut p = Pair {
            imp: UcxImport::on_host(initiator.map(str::to_string)),
            exp: UcxExport::new(
                Blob(vec![7; 40]),
                listener.map(str::to_string),
                Some(4242),
                DEADLINE,
                now,
            ),
            to_listener: VecDeque::new(),
            to_initiator: VecDeque::new(),
            script: script.iter().copied().collect(),
            connecting: false,
            keys: BTreeSet::new(),
            releasing: BTreeSet::new(),
            revoked: BTreeMap::new(),
            exported: BTreeSet::new(),
            fell_back: false,
            unpack_failure_left: true,
            timeout_left: true,
            unusable: BTreeSet::new(),
            at_sync: None,
            sync_delivered: false,
            sent_keys: BTreeSet::new(),
            settled: Vec::new(),
            same_host,
            now,
            violations: Vec::new(),
        };
        p.imp.welcomed(true, DEADLINE, now);
        p.pump();
        p
    }

    /// Carries out every output: messages into the queues, driver work into its state.
    fn pump(&mut self) {
        while let Some(o) = self.exp.poll_output() {
            match o {
                Output::Send(m) => {
                    match &m {
                        Message::UcxMap(r) => {
                            self.sent_keys.insert(r.id);
                        }
                        Message::UcxSync(_) => self.at_sync = Some(self.sent_keys.clone()),
                        _ => {}
                    }
                    self.to_initiator.push_back(m)
                }
                Output::Revoked { id } => {
                    self.sent_keys.remove(&id);
                    if self.keys.contains(&id) {
                        self.violations
                            .push(format!("{id:?} revoked while the initiator holds its key"));
                    }
                    *self.revoked.entry(id).or_default() += 1;
                }
                Output::Fallback { .. } => self.fell_back = true,
                Output::Failed(e) => self.violations.push(format!("listener failed: {e}")),
                other => self.violations.push(format!("listener output {other:?}")),
            }
        }
        while let Some(o) = self.imp.poll_output() {
            match o {
                Output::Send(m) => self.to_listener.push_back(m),
                Output::Connect { same_host, pid, .. } => {
                    if same_host != self.same_host {
                        self.violations.push(format!(
                            "Connect says same_host {same_host}, the hosts say {}",
                            self.same_host
                        ));
                    }
                    // The listener's process is named exactly where its host is this one.
                    if pid != self.same_host.then_some(4242) {
                        self.violations.push(format!(
                            "Connect names process {pid:?} with same_host {}",
                            self.same_host
                        ));
                    }
                    self.connecting = true
                }
                Output::Import(r) => {
                    self.keys.insert(r.id);
                }
                Output::Release { id } => {
                    self.releasing.insert(id);
                }
                Output::Synced => {}
                Output::Settled { unfinished } => {
                    self.settled.push(unfinished.is_some());
                    if !self.fell_back && unfinished.is_none() && !self.sync_delivered {
                        self.violations
                            .push("settled on UCX before the listener's UcxSync".into());
                    }
                    if let (false, None, Some(at_sync)) =
                        (self.fell_back, &unfinished, &self.at_sync)
                    {
                        // Unmaps follow the `UcxSync` on the wire: none was handled yet.
                        let missing: Vec<_> = at_sync
                            .iter()
                            .filter(|id| !self.keys.contains(id) && !self.unusable.contains(id))
                            .collect();
                        if !missing.is_empty() {
                            self.violations
                                .push(format!("settled without the keys of {missing:?}"));
                        }
                    }
                }
                Output::Fallback { .. } => self.fell_back = true,
                Output::Failed(e) => self.violations.push(format!("initiator failed: {e}")),
                other => self.violations.push(format!("initiator output {other:?}")),
            }
        }
    }

    /// Every step that can happen next, each applied to its own copy.
    fn successors(&self) -> Vec<Pair> {
        let mut next = Vec::new();
        let mut step = |f: &dyn Fn(&mut Pair)| {
            let mut p = self.clone();
            f(&mut p);
            p.pump();
            next.push(p);
        };
        if !self.to_listener.is_empty() {
            step(&|p| {
                let m = p.to_listener.pop_front().unwrap();
                p.exp.handle_message(m);
            });
        }
        if !self.to_initiator.is_empty() {
            step(&|p| {
                let m = p.to_initiator.pop_front().unwrap();
                p.sync_delivered |= matches!(m, Message::UcxSync(_));
                p.imp.handle_message(m);
            });
        }
        if let Some(&g) = self.script.front() {
            step(&|p| {
                p.script.pop_front();
                match g {
                    Grant::Export(t) => {
                        p.exported.insert(region(t).id);
                        p.exp.export(region(t));
                    }
                    Grant::Revoke(t) => p.exp.revoke(region(t).id, p.now),
                }
            });
        }
        if self.connecting {
            step(&|p| {
                p.connecting = false;
                p.imp.connected();
            });
            step(&|p| {
                p.connecting = false;
                p.imp.connect_failed("no transport".into());
            });
        }
        for &id in &self.releasing {
            step(&|p| {
                p.releasing.remove(&id);
                p.keys.remove(&id);
                p.imp.released(id);
            });
        }
        if self.unpack_failure_left {
            for &id in self.keys.difference(&self.releasing) {
                step(&|p| {
                    p.unpack_failure_left = false;
                    p.keys.remove(&id);
                    p.unusable.insert(id);
                    p.imp.import_failed(id);
                });
            }
        }
        if let (true, Some(at)) = (self.timeout_left, self.imp.poll_timeout()) {
            step(&|p| {
                p.timeout_left = false;
                p.imp.handle_timeout(at);
            });
        }
        next
    }

    /// Checks the end of one ordering: then closes the session and checks the books.
    fn check_end(mut self) -> Result<(), String> {
        if let Some(v) = self.violations.first() {
            return Err(v.clone());
        }
        if self.settled.len() != 1 {
            return Err(format!("settled {} times, not once", self.settled.len()));
        }
        let granted: BTreeSet<RegionId> = self
            .exported
            .iter()
            .filter(|id| !self.revoked.contains_key(id))
            .copied()
            .collect();
        if !self.fell_back {
            for id in &granted {
                if !self.keys.contains(id) && self.imp.usable(id) {
                    return Err(format!("{id:?} usable without a key held"));
                }
            }
            let usable: BTreeSet<RegionId> = granted
                .iter()
                .filter(|id| self.imp.usable(id))
                .copied()
                .collect();
            if usable != self.keys {
                return Err(format!("keys held {:?}, usable {usable:?}", self.keys));
            }
        }
        if self.exp.poll_timeout().is_some() && !self.fell_back {
            return Err("a deadline is still armed with nothing in flight".into());
        }
        // The session ends: the initiator's endpoint goes with it, then every key is revoked.
        self.keys.clear();
        self.exp.close();
        self.pump();
        for id in &self.exported {
            if self.revoked.get(id) != Some(&1) {
                return Err(format!(
                    "{id:?} revoked {:?} times, not once",
                    self.revoked.get(id)
                ));
            }
        }
        Ok(())
    }
}

/// Explores every ordering depth first; returns how many complete orderings there were.
fn explore(script: &[Grant]) -> u64 {
    explore_from(Pair::new(script), script)
}

fn explore_from(start: Pair, script: &[Grant]) -> u64 {
    let mut stack = vec![start];
    let mut ends = 0u64;
    while let Some(p) = stack.pop() {
        if let Some(v) = p.violations.first() {
            panic!("{v} (script {script:?})");
        }
        let next = p.successors();
        if next.is_empty() {
            if let Err(e) = p.check_end() {
                panic!("{e} (script {script:?})");
            }
            ends += 1;
        } else {
            stack.extend(next);
        }
        assert!(ends < 5_000_000, "the exploration is not bounded");
    }
    ends
}

#[test]
fn every_ordering_of_grants_keys_and_revokes_is_safe() {
    use Grant::*;
    let scripts: &[&[Grant]] = &[
        &[Export(1)],
        &[Export(1), Revoke(1)],
        &[Export(1), Export(2), Revoke(1)],
        &[Export(1), Revoke(1), Export(2), Revoke(2)],
        &[Revoke(1), Export(1), Revoke(1)],
    ];
    let mut total = 0;
    for s in scripts {
        total += explore(s);
    }
    println!("{total} complete orderings explored");
    assert!(
        total > 1000,
        "only {total} orderings: the exploration is too narrow"
    );
}

#[test]
fn every_ordering_connects_same_host_exactly_when_both_name_one_host() {
    use Grant::*;
    let script: &[Grant] = &[Export(1), Revoke(1)];
    for hosts in HOSTS {
        let ends = explore_from(Pair::on_hosts(script, hosts), script);
        assert!(ends > 10, "{hosts:?}: only {ends} orderings");
    }
}

#[test]
fn a_listener_without_an_answer_falls_back_and_still_revokes_everything() {
    let t0 = Instant::now();
    let mut exp = UcxExport::new(Blob(vec![1; 8]), None, None, DEADLINE, t0);
    exp.export(region(1));
    exp.handle_timeout(t0 + DEADLINE);
    exp.close();
    let out: Vec<_> = std::iter::from_fn(|| exp.poll_output()).collect();
    assert!(out.iter().any(|o| matches!(o, Output::Fallback { .. })));
    assert_eq!(
        out.iter()
            .filter(|o| matches!(o, Output::Revoked { .. }))
            .count(),
        1
    );
}

fn any_message() -> impl Strategy<Value = Message> {
    let id = any::<u8>().prop_map(|t| RegionId([t % 3; 16]));
    prop_oneof![
        (
            proptest::collection::vec(any::<u8>(), 0..80),
            proptest::option::of(prop_oneof![Just(OUR_HOST.to_string()), ".{0,12}"]),
        )
            .prop_map(|(b, host)| Message::UcxOffer(UcxAddress {
                address: Blob(b),
                host,
                pid: None
            })),
        Just(Message::UcxAccept(Ready {})),
        ".{0,20}".prop_map(|reason| Message::UcxDecline(UcxDecline { reason })),
        (
            id.clone(),
            any::<u64>(),
            any::<u64>(),
            proptest::collection::vec(any::<u8>(), 0..40)
        )
            .prop_map(|(id, base, len, k)| Message::UcxMap(UcxRegion {
                id,
                base,
                len,
                rkey: Blob(k),
            })),
        Just(Message::UcxSync(Ready {})),
        id.clone()
            .prop_map(|id| Message::UcxUnmap(ShmRevoke { id })),
        id.prop_map(|id| Message::UcxUnmapped(ShmRevoke { id })),
        Just(Message::Ready(Ready {})),
    ]
}

proptest! {
    /// Whatever a peer sends: no panic, at most one `Failed`, nothing but revokes after it.
    #[test]
    fn arbitrary_peer_messages_end_in_at_most_one_failure(
        to_imp in proptest::collection::vec(any_message(), 0..24),
        to_exp in proptest::collection::vec(any_message(), 0..24),
    ) {
        let t0 = Instant::now();
        let mut imp = UcxImport::new();
        imp.welcomed(true, DEADLINE, t0);
        let mut exp = UcxExport::new(Blob(vec![1; 8]), None, None, DEADLINE, t0);
        exp.export(region(1));
        let mut outs = Vec::new();
        for (i, m) in to_imp.into_iter().enumerate() {
            imp.handle_message(m);
            if i % 3 == 0 { imp.connected(); }
            if i % 5 == 4 { imp.handle_timeout(t0 + DEADLINE); }
            outs.extend(std::iter::from_fn(|| imp.poll_output()));
        }
        let failed = outs.iter().filter(|o| matches!(o, Output::Failed(_))).count();
        prop_assert!(failed <= 1);
        let settled = outs.iter().filter(|o| matches!(o, Output::Settled { .. })).count();
        prop_assert!(settled <= 1, "settled {} times: {:?}", settled, outs);
        if let Some(at) = outs.iter().position(|o| matches!(o, Output::Failed(_))) {
            prop_assert_eq!(at + 1, outs.len(), "outputs after the failure: {:?}", &outs[at..]);
        }
        let mut outs = Vec::new();
        for (i, m) in to_exp.into_iter().enumerate() {
            exp.handle_message(m);
            if i % 4 == 0 { exp.revoke(region(1).id, t0); }
            exp.handle_timeout(t0 + DEADLINE * (i as u32 % 2));
            outs.extend(std::iter::from_fn(|| exp.poll_output()));
        }
        exp.close();
        outs.extend(std::iter::from_fn(|| exp.poll_output()));
        let failed = outs.iter().filter(|o| matches!(o, Output::Failed(_))).count();
        prop_assert!(failed <= 1);
        if let Some(at) = outs.iter().position(|o| matches!(o, Output::Failed(_))) {
            let only_revokes = outs[at + 1..].iter().all(|o| matches!(o, Output::Revoked { .. }));
            prop_assert!(only_revokes);
        }
        let revoked = outs.iter().filter(|o| matches!(o, Output::Revoked { .. })).count();
        prop_assert_eq!(revoked, 1, "region 1 revoked {} times: {:?}", revoked, outs);
    }
}

/// The initiator's host identity in [`a_host_claim_changes_only_the_connect_preference`].
const OUR_HOST: &str = "boot-a/net:[1]/pid:[2]";

/// What an initiator's driver sees, with the `same_host` of every `Connect` taken out.
fn without_host(outs: &[Output]) -> Vec<Output> {
    outs.iter()
        .map(|o| match o {
            Output::Connect { address, .. } => Output::Connect {
                address: address.clone(),
                same_host: false,
                pid: None,
            },
            o => o.clone(),
        })
        .collect()
}

proptest! {
    /// Whatever a listener sends: an initiator that knows its host and one that does not do
    /// the same but for `Connect`'s `same_host`, which is true exactly for an offer naming
    /// the initiator's host.
    #[test]
    fn a_host_claim_changes_only_the_connect_preference(
        to_imp in proptest::collection::vec(any_message(), 0..24),
    ) {
        let t0 = Instant::now();
        let mut ours = UcxImport::on_host(Some(OUR_HOST.to_string()));
        let mut unknown = UcxImport::new();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for (i, m) in to_imp.into_iter().enumerate() {
            let named = match &m {
                Message::UcxOffer(o) => o.host.as_deref() == Some(OUR_HOST),
                _ => false,
            };
            let before = a.len();
            for (imp, outs) in [(&mut ours, &mut a), (&mut unknown, &mut b)] {
                if i == 0 {
                    imp.welcomed(true, DEADLINE, t0);
                }
                imp.handle_message(m.clone());
                outs.extend(std::iter::from_fn(|| imp.poll_output()));
                if i % 3 == 0 { imp.connected(); }
                if i % 5 == 4 { imp.handle_timeout(t0 + DEADLINE); }
                outs.extend(std::iter::from_fn(|| imp.poll_output()));
            }
            // A `Connect` comes only from the offer just handled.
            for o in &a[before..] {
                if let Output::Connect { same_host, .. } = o {
                    prop_assert_eq!(*same_host, named, "offer {:?}", m);
                }
            }
        }
        prop_assert_eq!(without_host(&a), without_host(&b));
        for o in &b {
            if let Output::Connect { same_host, .. } = o {
                prop_assert!(!same_host, "same_host without a host of our own");
            }
        }
    }
}
