//! Drives an initiator and a listener session against each other under every ordering of
//! message deliveries and data-connection bindings (exhaustively), and under arbitrary event
//! sequences (property test).

use kvbridge_proto::auth::{DataKey, Keyring, Secret};
use kvbridge_proto::handshake::{
    Established, HandshakeError, Initiator, ListenerSession, LocalIdentity, Output, Step,
};
use kvbridge_proto::msg::{
    Compat, Hello, HostOffer, MemInfo, MemKind, Message, Ready, RegionInfo, Reject, ShmOffer,
};
use kvbridge_proto::msg::{ErrorCode, Ping};
use kvbridge_proto::{Incarnation, PeerId, RegionId, SessionToken};
use proptest::prelude::*;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

const STEP: Duration = Duration::from_secs(10);

fn ident(name: &str, inc: u64, hash: u64) -> LocalIdentity {
    LocalIdentity {
        peer_id: PeerId::new(name).unwrap(),
        incarnation: Incarnation(inc),
        compat: Compat {
            hash,
            description: format!("layout-{hash}"),
        },
        secret: None,
        peer_keys: None,
        peer_key: None,
    }
}

fn with_secret(mut id: LocalIdentity, secret: Option<&str>) -> LocalIdentity {
    id.secret = secret.map(|s| Secret::new(s.as_bytes().to_vec()).unwrap());
    id
}

fn mem(tag: u8) -> MemInfo {
    MemInfo {
        regions: vec![RegionInfo {
            id: RegionId([tag; 16]),
            len: 1 << 20,
            page_size: 4096,
            kind: MemKind::Cpu,
        }],
    }
}

/// Both machines and the messages in flight between them.
#[derive(Clone)]
struct Pair {
    init: Initiator,
    listen: Option<ListenerSession>,
    to_listener: VecDeque<Message>,
    to_initiator: VecDeque<Message>,
    welcomed: bool,
    init_bound: bool,
    listen_bound: bool,
    init_ready: Option<Established>,
    listen_ready: Option<Established>,
    failures: Vec<HandshakeError>,
    now: Instant,
    listener_secret: Option<&'static str>,
    listener_keys: Option<Keyring>,
    /// The data-connection key the initiator's `Welcomed` carried.
    init_data_key: Option<DataKey>,
}

impl Pair {
    fn new(now: Instant) -> Self {
        Self::with_secrets(now, None, None)
    }

    fn with_secrets(
        now: Instant,
        initiator_secret: Option<&'static str>,
        listener_secret: Option<&'static str>,
    ) -> Self {
        Self::dialing(
            now,
            with_secret(ident("prefill-0", 1, 42), initiator_secret),
            listener_secret,
        )
    }

    /// "prefill-0" as `me` dials "decode-0", which holds `listener_secret`.
    fn dialing(now: Instant, me: LocalIdentity, listener_secret: Option<&'static str>) -> Self {
        let mut p = Pair {
            init: Initiator::new(me, STEP, now, [1; 32]),
            listen: None,
            to_listener: VecDeque::new(),
            to_initiator: VecDeque::new(),
            welcomed: false,
            init_bound: false,
            listen_bound: false,
            init_ready: None,
            listen_ready: None,
            failures: vec![],
            now,
            listener_secret,
            listener_keys: None,
            init_data_key: None,
        };
        p.drain();
        p
    }

    /// A listener with a keyring (and optionally the shared secret).
    fn with_keys(
        now: Instant,
        initiator_secret: Option<&'static str>,
        listener_secret: Option<&'static str>,
        keys: Keyring,
    ) -> Self {
        let mut p = Self::with_secrets(now, initiator_secret, listener_secret);
        p.listener_keys = Some(keys);
        p
    }

    fn drain(&mut self) {
        while let Some(o) = self.init.poll_output() {
            match o {
                Output::Send(m) => self.to_listener.push_back(m),
                Output::Welcomed { data_key, .. } => {
                    self.welcomed = true;
                    self.init_data_key = data_key;
                    self.init.provide_mem_info(mem(1), self.now);
                }
                Output::Ready(e) => self.init_ready = Some(e),
                Output::PeerMemInfo(_) => {}
                Output::Failed(e) => self.failures.push(e),
            }
        }
        if let Some(l) = self.listen.as_mut() {
            while let Some(o) = l.poll_output() {
                match o {
                    Output::Send(m) => self.to_initiator.push_back(m),
                    Output::Ready(e) => self.listen_ready = Some(e),
                    Output::Failed(e) => self.failures.push(e),
                    Output::Welcomed { .. } | Output::PeerMemInfo(_) => {
                        panic!("listener emitted an initiator output")
                    }
                }
            }
        }
    }

    /// The events possible now.
    fn choices(&self) -> Vec<u8> {
        let mut c = vec![];
        if !self.to_listener.is_empty() {
            c.push(0);
        }
        if !self.to_initiator.is_empty() {
            c.push(1);
        }
        // The data connection exists once the initiator has its token.
        if self.welcomed && !self.init_bound {
            c.push(2);
        }
        // The driver binds only once the listener may (the peer authenticated).
        if self.welcomed && !self.listen_bound && self.listen.as_ref().is_some_and(|l| l.may_bind())
        {
            c.push(3);
        }
        c
    }

    fn apply(&mut self, choice: u8) {
        let now = self.now;
        match choice {
            0 => {
                let m = self.to_listener.pop_front().unwrap();
                match (&mut self.listen, m) {
                    (None, Message::Hello(h)) => {
                        let mut me = with_secret(ident("decode-0", 2, 42), self.listener_secret);
                        me.peer_keys = self.listener_keys.clone();
                        self.listen = Some(ListenerSession::accept(
                            h,
                            &me,
                            SessionToken([9; 16]),
                            mem(2),
                            STEP,
                            now,
                            [2; 32],
                        ))
                    }
                    (Some(l), m) => l.handle_message(m, now),
                    (None, m) => panic!("first message was {}", m.name()),
                }
            }
            1 => {
                let m = self.to_initiator.pop_front().unwrap();
                self.init.handle_message(m, now);
            }
            2 => {
                self.init_bound = true;
                self.init.data_bound(now);
            }
            3 => {
                self.listen_bound = true;
                self.listen.as_mut().unwrap().data_bound(now);
            }
            _ => unreachable!(),
        }
        self.drain();
    }
}

fn explore(p: Pair, terminals: &mut usize) {
    explore_expecting(p, terminals, true)
}

/// Explores every ordering; `succeed` says whether every ordering must establish (else every
/// ordering must fail on both sides with `Unauthenticated` and nothing established).
fn explore_expecting(p: Pair, terminals: &mut usize, succeed: bool) {
    let choices = p.choices();
    if choices.is_empty() && !succeed {
        *terminals += 1;
        assert!(
            p.init_ready.is_none() && p.listen_ready.is_none(),
            "established without auth"
        );
        assert!(
            p.failures
                .iter()
                .any(|f| matches!(f, HandshakeError::Unauthenticated { .. })),
            "failures: {:?}",
            p.failures
        );
        assert!(
            !p.listen_bound,
            "data connection bound for an unauthenticated peer"
        );
        return;
    }
    if choices.is_empty() {
        *terminals += 1;
        assert!(p.failures.is_empty(), "failures: {:?}", p.failures);
        let i = p.init_ready.as_ref().expect("initiator established");
        let l = p.listen_ready.as_ref().expect("listener established");
        assert_eq!(i.regions, mem(2), "initiator sees the listener's grant");
        assert_eq!(l.regions, mem(1), "listener sees the initiator's grant");
        assert_eq!(i.peer_id.as_str(), "decode-0");
        assert_eq!(l.peer_id.as_str(), "prefill-0");
        // Both sides derived the same data-connection key (from the same key), or neither.
        assert_eq!(
            p.init_data_key.as_ref(),
            p.listen.as_ref().unwrap().data_key(),
            "the two sides' data-connection keys differ"
        );
        return;
    }
    for c in choices {
        let mut q = p.clone();
        q.apply(c);
        // Neither side may declare the session live before its own data connection is bound.
        if q.init_ready.is_some() {
            assert!(
                q.init_bound,
                "initiator ready before its data connection was bound"
            );
        }
        if q.listen_ready.is_some() {
            assert!(
                q.listen_bound,
                "listener ready before its data connection was bound"
            );
        }
        explore_expecting(q, terminals, succeed);
    }
}

#[test]
fn every_ordering_establishes_with_matching_secrets() {
    let mut terminals = 0;
    explore(
        Pair::with_secrets(Instant::now(), Some("s3cret"), Some("s3cret")),
        &mut terminals,
    );
    assert!(terminals >= 10);
}

#[test]
fn wrong_or_missing_secret_never_establishes_nor_binds() {
    for (i, l) in [
        (Some("wrong"), Some("s3cret")),
        (None, Some("s3cret")),
        (Some("s3cret"), None),
    ] {
        let mut terminals = 0;
        explore_expecting(
            Pair::with_secrets(Instant::now(), i, l),
            &mut terminals,
            false,
        );
        assert!(terminals >= 1, "{i:?}/{l:?}");
    }
}

fn ring(ids: &[(&str, &str)]) -> Keyring {
    let mut k = Keyring::new();
    for (id, key) in ids {
        k.insert(
            PeerId::new(*id).unwrap(),
            Secret::new(key.as_bytes().to_vec()).unwrap(),
        );
    }
    k
}

/// With a keyring, "prefill-0" establishes with its own key only (under every ordering), the
/// shared secret keeps working for ids the ring does not hold, and neither another id's key
/// nor the shared secret lets a peer claim an id of the ring.
#[test]
fn per_peer_keys_bind_the_claimed_id_under_every_ordering() {
    let keys = || {
        ring(&[
            ("prefill-0", "key-of-prefill-0"),
            ("prefill-1", "key-of-prefill-1"),
        ])
    };
    for shared in [None, Some("shared-secret")] {
        let mut terminals = 0;
        explore(
            Pair::with_keys(Instant::now(), Some("key-of-prefill-0"), shared, keys()),
            &mut terminals,
        );
        assert!(terminals >= 10);
    }
    for (claim_with, shared) in [
        (Some("key-of-prefill-1"), None),
        (Some("key-of-prefill-1"), Some("shared-secret")),
        (Some("shared-secret"), Some("shared-secret")),
        (None, Some("shared-secret")),
    ] {
        let mut terminals = 0;
        explore_expecting(
            Pair::with_keys(Instant::now(), claim_with, shared, keys()),
            &mut terminals,
            false,
        );
        assert!(terminals >= 1, "{claim_with:?}/{shared:?}");
    }
    // An id outside the ring: the shared secret does for it; without one nothing does.
    let others = || ring(&[("prefill-1", "key-of-prefill-1")]);
    let mut terminals = 0;
    explore(
        Pair::with_keys(
            Instant::now(),
            Some("shared-secret"),
            Some("shared-secret"),
            others(),
        ),
        &mut terminals,
    );
    for claim_with in [Some("key-of-prefill-1"), Some("anything-at-all"), None] {
        explore_expecting(
            Pair::with_keys(Instant::now(), claim_with, None, others()),
            &mut terminals,
            false,
        );
    }
}

fn with_own_key(mut id: LocalIdentity, key: &str) -> LocalIdentity {
    id.peer_key = Secret::new(key.as_bytes().to_vec());
    id
}

/// "prefill-0" holding its own key (`peer_key`) beside the shared secret: it establishes,
/// under every ordering, with a listener whose ring binds its id to that key (with or
/// without the shared secret there) and with one that binds nothing and takes the shared
/// secret; both sides derive the same data key each time.
#[test]
fn an_own_key_dials_both_a_binding_listener_and_a_shared_one_under_every_ordering() {
    let own = || {
        with_own_key(
            with_secret(ident("prefill-0", 1, 42), Some("shared-secret")),
            "key-of-prefill-0",
        )
    };
    let binding = || ring(&[("prefill-0", "key-of-prefill-0")]);
    let others = || ring(&[("prefill-1", "key-of-prefill-1")]);
    for (shared, keys) in [
        (Some("shared-secret"), Some(binding())),
        (None, Some(binding())),
        (Some("shared-secret"), None),
        (Some("shared-secret"), Some(others())),
    ] {
        let mut p = Pair::dialing(Instant::now(), own(), shared);
        p.listener_keys = keys.clone();
        let mut terminals = 0;
        explore(p, &mut terminals);
        assert!(terminals >= 10, "{shared:?}/{keys:?}");
    }
    // Without the shared secret the own key is all it has: a listener that binds its id
    // takes it.
    let alone = || with_own_key(ident("prefill-0", 1, 42), "key-of-prefill-0");
    let mut p = Pair::dialing(Instant::now(), alone(), None);
    p.listener_keys = Some(binding());
    let mut terminals = 0;
    explore(p, &mut terminals);
    assert!(terminals >= 10);
}

/// What an own key does not open: a listener whose ring binds "prefill-0" refuses an
/// impostor claiming it with the shared secret, with the shared secret plus a wrong own
/// key, or with another id's key as its own, under every ordering (nothing established,
/// no data connection bound); an own key alone does not pass a listener that takes only
/// the shared secret, or one whose ring binds the id to another key.
#[test]
fn an_own_key_opens_only_the_listeners_that_bind_it_under_every_ordering() {
    let binding = || Some(ring(&[("prefill-0", "key-of-prefill-0")]));
    let claim = |own: Option<&str>, secret: Option<&str>| {
        let id = with_secret(ident("prefill-0", 1, 42), secret);
        match own {
            Some(k) => with_own_key(id, k),
            None => id,
        }
    };
    for (own, secret, listener_secret, keys) in [
        // impostors holding the shared secret, claiming the bound id
        (
            None,
            Some("shared-secret"),
            Some("shared-secret"),
            binding(),
        ),
        (
            Some("not-prefill-0s-key"),
            Some("shared-secret"),
            Some("shared-secret"),
            binding(),
        ),
        (
            Some("key-of-prefill-1"),
            Some("shared-secret"),
            Some("shared-secret"),
            binding(),
        ),
        // the real key, where the listener does not take it
        (Some("key-of-prefill-0"), None, Some("shared-secret"), None),
        (
            Some("key-of-prefill-0"),
            Some("shared-secret"),
            Some("shared-secret"),
            Some(ring(&[("prefill-0", "another-key-of-p0")])),
        ),
    ] {
        let mut p = Pair::dialing(Instant::now(), claim(own, secret), listener_secret);
        p.listener_keys = keys.clone();
        let mut terminals = 0;
        explore_expecting(p, &mut terminals, false);
        assert!(
            terminals >= 1,
            "{own:?}/{secret:?}/{listener_secret:?}/{keys:?}"
        );
    }
}

/// The listener's answers to a peer claiming an id of the ring with a wrong key, and to one
/// claiming an id it has no key for, look alike (a `Welcome` with a proof of the same size,
/// then the same words naming the claimed id): the ring is no oracle for which ids exist.
#[test]
fn a_keyring_does_not_tell_which_ids_it_holds() {
    let words = |name: &str| {
        let mut me = ident("decode-0", 2, 42);
        me.peer_keys = Some(ring(&[("prefill-0", "key-of-prefill-0")]));
        let mut init = Initiator::new(
            with_secret(ident(name, 1, 42), Some("a-wrong-key")),
            STEP,
            Instant::now(),
            [1; 32],
        );
        let Some(Output::Send(Message::Hello(h))) = init.poll_output() else {
            panic!("no hello")
        };
        let now = Instant::now();
        let mut l =
            ListenerSession::accept(h, &me, SessionToken([9; 16]), mem(2), STEP, now, [2; 32]);
        let Some(Output::Send(Message::Welcome(w))) = l.poll_output() else {
            panic!("no welcome")
        };
        let proof_len = w.auth.and_then(|a| a.response).map(|r| r.0.len());
        l.handle_message(
            Message::Proof(kvbridge_proto::msg::Auth {
                challenge: None,
                response: Some(kvbridge_proto::ids::Blob(vec![7; 32])),
            }),
            now,
        );
        let failed = std::iter::from_fn(|| l.poll_output()).find_map(|o| match o {
            Output::Failed(HandshakeError::Unauthenticated { step, detail }) => {
                Some((step, detail))
            }
            _ => None,
        });
        let (step, detail) = failed.expect("the wrong proof was not refused");
        (proof_len, step, detail.replace(name, "<id>"))
    };
    let known = words("prefill-0");
    let unknown = words("prefill-9");
    assert_eq!(known, unknown);
    assert_eq!(known.0, Some(32));
    assert!(
        known.2.contains("<id>"),
        "the error names the claimed id: {}",
        known.2
    );
}

#[test]
fn every_ordering_of_bind_and_messages_establishes() {
    let mut terminals = 0;
    explore(Pair::new(Instant::now()), &mut terminals);
    // Enough distinct orderings to be sure the seed's (MemInfo before bind) is among them.
    assert!(terminals >= 10, "only {terminals} orderings explored");
}

#[test]
fn seed_order_memory_info_before_listener_bind_is_held_not_failed() {
    let mut p = Pair::new(Instant::now());
    p.apply(0); // Hello
    p.apply(1); // Welcome -> initiator sends MemInfo at once
    p.apply(2); // initiator binds its data connection
    p.apply(0); // MemInfo reaches the listener before it bound the data connection
    assert!(p.failures.is_empty());
    assert!(
        p.to_initiator.is_empty(),
        "listener answered MemInfo before binding"
    );
    assert_eq!(p.listen.as_ref().unwrap().step(), Step::DataBind);
    p.apply(3); // bind, after any delay
    while !p.choices().is_empty() {
        let c = p.choices()[0];
        p.apply(c);
    }
    assert!(p.init_ready.is_some() && p.listen_ready.is_some());
}

/// A region registered after the initiator's `MemInfo` went out but before `Ready` reaches
/// the listener once the session is established (it used to be dropped).
#[test]
fn memory_registered_mid_handshake_reaches_the_peer() {
    let mut p = Pair::new(Instant::now());
    p.apply(0); // Hello
    p.apply(1); // Welcome -> initiator sends MemInfo(1), awaits Ready
    p.init.provide_mem_info(mem(7), p.now); // a region registered now
    p.drain();
    p.apply(2);
    while !p.choices().is_empty() {
        let c = p.choices()[0];
        if c == 0 && p.init_ready.is_some() {
            break;
        }
        p.apply(c);
    }
    assert!(p.init_ready.is_some() && p.failures.is_empty());
    let late: Vec<_> = p
        .to_listener
        .iter()
        .filter(|m| matches!(m, Message::MemInfo(mi) if *mi == mem(7)))
        .collect();
    assert_eq!(
        late.len(),
        1,
        "the update is sent once the session is established"
    );
}

#[test]
fn incompatible_peers_fail_fast_naming_both_values() {
    let now = Instant::now();
    let mut init = Initiator::new(ident("p", 1, 7), STEP, now, [0; 32]);
    let Some(Output::Send(Message::Hello(h))) = init.poll_output() else {
        panic!("no hello")
    };
    let mut l = ListenerSession::accept(
        h,
        &ident("d", 2, 8),
        SessionToken([0; 16]),
        mem(2),
        STEP,
        now,
        [0; 32],
    );
    let Some(Output::Send(Message::Reject(r))) = l.poll_output() else {
        panic!("no reject")
    };
    assert_eq!(r.code, ErrorCode::Incompatible);
    assert!(r.message.contains("0000000000000008") && r.message.contains("0000000000000007"));
    assert!(matches!(
        l.poll_output(),
        Some(Output::Failed(HandshakeError::Incompatible { .. }))
    ));
    init.handle_message(Message::Reject(r), now);
    match init.poll_output() {
        Some(Output::Failed(HandshakeError::Rejected {
            step,
            code,
            message,
        })) => {
            assert_eq!(step, Step::Welcome);
            assert_eq!(code, ErrorCode::Incompatible);
            assert!(message.contains("layout-7") && message.contains("layout-8"));
        }
        o => panic!("unexpected {o:?}"),
    }
}

fn offer() -> ShmOffer {
    ShmOffer {
        host: "boot-id/net:1/pid:2".into(),
        pid: 4242,
        socket: "kvbridge-secret-name".into(),
        cma: true,
    }
}

/// Runs a handshake between `init` and a listener with `listener_secret` that has a
/// shared-memory offer, and returns every message the listener sent with, for each,
/// whether the initiator had proven itself (`may_bind`) when it went out; and the offer
/// the initiator was welcomed with.
fn listener_words(
    init: &mut Initiator,
    listener_secret: Option<&str>,
) -> (Vec<(Message, bool)>, Option<ShmOffer>) {
    let now = Instant::now();
    let mut words = vec![];
    let mut welcomed_with = None;
    let Some(Output::Send(Message::Hello(h))) = init.poll_output() else {
        panic!("no Hello")
    };
    let mut l = ListenerSession::accept_with_shm(
        h,
        &with_secret(ident("decode-0", 2, 42), listener_secret),
        SessionToken([9; 16]),
        mem(2),
        STEP,
        now,
        [2; 32],
        Some(offer()),
    );
    for _ in 0..8 {
        while let Some(o) = l.poll_output() {
            if let Output::Send(m) = o {
                words.push((m.clone(), l.may_bind()));
                init.handle_message(m, now);
            }
        }
        while let Some(o) = init.poll_output() {
            match o {
                Output::Send(m) => l.handle_message(m, now),
                Output::Welcomed { shm, .. } => {
                    welcomed_with = shm;
                    init.provide_mem_info(mem(1), now);
                }
                Output::Failed(e) => panic!("{e}"),
                _ => {}
            }
        }
    }
    (words, welcomed_with)
}

/// With a secret, the listener tells nothing about its host (pid, boot id, namespaces,
/// socket name) before the initiator's proof: the `Welcome` carries no offer, a `HostOffer`
/// after the proof does. Without a secret the `Welcome` carries it as before.
#[test]
fn the_host_offer_comes_only_after_the_initiators_proof() {
    let mut init = Initiator::new(
        with_secret(ident("prefill-0", 1, 42), Some("s3cret-of-the-cluster")),
        STEP,
        Instant::now(),
        [1; 32],
    );
    let (words, welcomed_with) = listener_words(&mut init, Some("s3cret-of-the-cluster"));
    let Some((Message::Welcome(w), _)) = words.first() else {
        panic!("{words:?}")
    };
    assert_eq!(
        w.shm, None,
        "the Welcome told an unauthenticated peer about the host"
    );
    assert!(w.host_after_proof);
    let host: Vec<_> = words
        .iter()
        .filter(|(m, _)| matches!(m, Message::HostOffer(_)))
        .collect();
    assert_eq!(host.len(), 1, "{words:?}");
    assert!(host[0].1, "HostOffer before the proof checked out");
    assert_eq!(welcomed_with, Some(offer()));

    let mut init = Initiator::new(ident("prefill-0", 1, 42), STEP, Instant::now(), [1; 32]);
    let (words, welcomed_with) = listener_words(&mut init, None);
    let Some((Message::Welcome(w), _)) = words.first() else {
        panic!("{words:?}")
    };
    assert_eq!(w.shm, Some(offer()));
    assert!(!w.host_after_proof);
    assert_eq!(welcomed_with, Some(offer()));
}

/// An initiator that predates data-connection proofs (and the host offer: its `Hello` has
/// neither flag) would have its data connections bound by a token seen in the clear: a
/// listener with a secret refuses it with a typed `Unauthenticated` that says why, before
/// telling it anything about its host.
#[test]
fn an_older_initiator_is_refused_by_a_listener_with_a_secret_saying_why() {
    let now = Instant::now();
    let secret = Some("s3cret-of-the-cluster");
    let mut init = Initiator::new(
        with_secret(ident("prefill-0", 1, 42), secret),
        STEP,
        now,
        [1; 32],
    );
    let Some(Output::Send(Message::Hello(mut h))) = init.poll_output() else {
        panic!()
    };
    assert!(h.data_proof && h.host_after_proof);
    h.host_after_proof = false;
    h.data_proof = false;
    let mut l = ListenerSession::accept_with_shm(
        h,
        &with_secret(ident("decode-0", 2, 42), secret),
        SessionToken([9; 16]),
        mem(2),
        STEP,
        now,
        [2; 32],
        Some(offer()),
    );
    match l.poll_output() {
        Some(Output::Send(Message::Reject(r))) => {
            assert_eq!(r.code, ErrorCode::Unauthenticated);
            assert!(r.message.contains("predates"), "{}", r.message);
        }
        o => panic!("{o:?}"),
    }
    assert!(matches!(
        l.poll_output(),
        Some(Output::Failed(HandshakeError::Unauthenticated { .. }))
    ));
    assert!(l.data_key().is_none());
}

/// Both sides derive the same data-connection key from the authentication exchange, and
/// the listener's is there only once the initiator proved itself.
#[test]
fn both_sides_derive_the_same_data_key_after_the_proof() {
    let now = Instant::now();
    let secret = Some("s3cret-of-the-cluster");
    let mut init = Initiator::declaring(
        with_secret(ident("prefill-0", 1, 42), secret),
        STEP,
        now,
        [1; 32],
        3,
    );
    let Some(Output::Send(Message::Hello(h))) = init.poll_output() else {
        panic!()
    };
    assert_eq!(h.data_connections, 3);
    let mut l = ListenerSession::accept(
        h,
        &with_secret(ident("decode-0", 2, 42), secret),
        SessionToken([9; 16]),
        mem(2),
        STEP,
        now,
        [2; 32],
    );
    assert_eq!(l.declared_data_connections(), Some(3));
    let Some(Output::Send(Message::Welcome(w))) = l.poll_output() else {
        panic!()
    };
    assert!(w.data_proof);
    assert!(l.data_key().is_none(), "a key before the proof");
    init.handle_message(Message::Welcome(w), now);
    let Some(Output::Send(proof @ Message::Proof(_))) = init.poll_output() else {
        panic!()
    };
    l.handle_message(proof, now);
    let Some(Output::Send(Message::HostOffer(h))) = l.poll_output() else {
        panic!()
    };
    init.handle_message(Message::HostOffer(h), now);
    let Some(Output::Welcomed {
        data_key: Some(k), ..
    }) = init.poll_output()
    else {
        panic!("no data key")
    };
    assert_eq!(l.data_key(), Some(&k));
}

/// Both sides say they honour grant tokens, and each learns it of the other; a peer that
/// predates them (the flag absent, so false) is known as one.
#[test]
fn grant_tokens_are_announced_both_ways() {
    let now = Instant::now();
    for peer_knows in [true, false] {
        let mut init = Initiator::new(ident("p", 1, 0), STEP, now, [0; 32]);
        let Some(Output::Send(Message::Hello(mut h))) = init.poll_output() else {
            panic!("no Hello")
        };
        assert!(h.grant_tokens, "this build honours grant tokens");
        h.grant_tokens = peer_knows;
        let mut l = ListenerSession::accept(
            h,
            &ident("d", 2, 0),
            SessionToken([0; 16]),
            mem(2),
            STEP,
            now,
            [0; 32],
        );
        assert_eq!(l.peer_grant_tokens(), peer_knows);
        let Some(Output::Send(Message::Welcome(mut w))) = l.poll_output() else {
            panic!("no Welcome")
        };
        assert!(w.grant_tokens);
        assert!(!init.peer_grant_tokens(), "not known before the Welcome");
        w.grant_tokens = peer_knows;
        init.handle_message(Message::Welcome(w), now);
        assert_eq!(init.peer_grant_tokens(), peer_knows);
    }
}

#[test]
fn version_mismatch_names_both_versions() {
    let now = Instant::now();
    let h = Hello {
        version: 99,
        peer_id: PeerId::new("p").unwrap(),
        incarnation: Incarnation(1),
        compat: Compat::default(),
        auth: None,
        unacked_notify: false,
        host_after_proof: false,
        data_proof: false,
        data_connections: 0,
        ucx: false,
        grant_tokens: false,
    };
    let mut l = ListenerSession::accept(
        h,
        &ident("d", 2, 0),
        SessionToken([0; 16]),
        mem(2),
        STEP,
        now,
        [0; 32],
    );
    let Some(Output::Send(Message::Reject(r))) = l.poll_output() else {
        panic!()
    };
    assert_eq!(r.code, ErrorCode::UnsupportedVersion);
    assert!(r.message.contains("ours 1") && r.message.contains("theirs 99"));
}

#[test]
fn each_step_has_a_deadline() {
    let t0 = Instant::now();
    let mut init = Initiator::new(ident("p", 1, 0), STEP, t0, [0; 32]);
    init.poll_output();
    assert_eq!(init.poll_timeout(), Some(t0 + STEP));
    init.handle_timeout(t0 + STEP - Duration::from_millis(1));
    assert!(!init.is_failed());
    init.handle_timeout(t0 + STEP);
    // Tells the listener why, then fails naming the step.
    assert!(matches!(
        init.poll_output(),
        Some(Output::Send(Message::Reject(_)))
    ));
    assert_eq!(
        init.poll_output(),
        Some(Output::Failed(HandshakeError::Timeout {
            step: Step::Welcome,
            after: STEP
        }))
    );
    assert_eq!(init.poll_output(), None);
    assert_eq!(init.poll_timeout(), None);
}

#[test]
fn listener_unbound_deadline_names_data_bind() {
    let t0 = Instant::now();
    let mut p = Pair::new(t0);
    p.apply(0);
    let l = p.listen.as_mut().unwrap();
    l.handle_timeout(t0 + STEP);
    let mut failed = None;
    while let Some(o) = l.poll_output() {
        if let Output::Failed(e) = o {
            failed = Some(e);
        }
    }
    assert_eq!(
        failed,
        Some(HandshakeError::Timeout {
            step: Step::DataBind,
            after: STEP
        })
    );
}

fn any_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        Just(Message::Hello(Hello {
            version: 1,
            peer_id: PeerId::new("x").unwrap(),
            incarnation: Incarnation(3),
            compat: Compat {
                hash: 42,
                description: String::new()
            },
            auth: None,
            unacked_notify: true,
            host_after_proof: false,
            data_proof: false,
            data_connections: 0,
            ucx: false,
            grant_tokens: false,
        })),
        Just(Message::MemInfo(mem(5))),
        Just(Message::HostOffer(HostOffer::default())),
        Just(Message::Ready(Ready {})),
        Just(Message::Ping(Ping { nonce: 1 })),
        Just(Message::Pong(Ping { nonce: 1 })),
        Just(Message::Reject(Reject {
            code: ErrorCode::Internal,
            message: "x".into()
        })),
        Just(Message::Bye(Reject {
            code: ErrorCode::ShuttingDown,
            message: "bye".into()
        })),
    ]
}

#[derive(Debug, Clone)]
enum Ev {
    Msg(Message),
    Bind,
    Time(u64),
    Provide,
}

fn any_event() -> impl Strategy<Value = Ev> {
    prop_oneof![
        4 => any_message().prop_map(Ev::Msg),
        1 => Just(Ev::Bind),
        1 => (0u64..30_000).prop_map(Ev::Time),
        1 => Just(Ev::Provide),
    ]
}

fn check_outputs(outs: &[Output]) {
    // Exactly zero or one Failed, and nothing after it.
    if let Some(pos) = outs.iter().position(|o| matches!(o, Output::Failed(_))) {
        assert_eq!(pos, outs.len() - 1, "output after Failed: {outs:?}");
    }
    let readies = outs
        .iter()
        .filter(|o| matches!(o, Output::Ready(_)))
        .count();
    assert!(readies <= 1, "ready twice: {outs:?}");
}

proptest! {
    #[test]
    fn state_machines_stay_defined_under_arbitrary_events(evs in proptest::collection::vec(any_event(), 0..40)) {
        let t0 = Instant::now();
        let mut init = Initiator::new(ident("p", 1, 42), STEP, t0, [0; 32]);
        let mut l = ListenerSession::accept(
            Hello { version: 1, peer_id: PeerId::new("p").unwrap(), incarnation: Incarnation(1),
                    compat: Compat { hash: 42, description: String::new() }, auth: None,
                    unacked_notify: true, host_after_proof: true, data_proof: false, data_connections: 0, ucx: false,
                    grant_tokens: false },
            &ident("d", 2, 42), SessionToken([1; 16]), mem(2), STEP, t0, [0; 32]);
        let (mut io, mut lo) = (vec![], vec![]);
        let mut now = t0;
        for ev in evs {
            match ev {
                Ev::Msg(m) => { init.handle_message(m.clone(), now); l.handle_message(m, now); }
                Ev::Bind => { init.data_bound(now); l.data_bound(now); }
                Ev::Time(ms) => { now += Duration::from_millis(ms); init.handle_timeout(now); l.handle_timeout(now); }
                Ev::Provide => init.provide_mem_info(mem(1), now),
            }
            while let Some(o) = init.poll_output() { io.push(o); }
            while let Some(o) = l.poll_output() { lo.push(o); }
            // A machine that is not failed and not established always has a deadline.
            if !init.is_failed() && !init.is_established() { prop_assert!(init.poll_timeout().is_some()); }
            if !l.is_failed() && !l.is_established() { prop_assert!(l.poll_timeout().is_some()); }
        }
        check_outputs(&io);
        check_outputs(&lo);
    }
}
