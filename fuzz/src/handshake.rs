//! Target `handshake`: an initiator and a listener session (the sans-IO machines of
//! `kvbridge_proto::handshake`) wired to each other, driven by an arbitrary sequence of
//! events: deliveries, losses, duplicates and forgeries of messages (malformed ones too),
//! data-connection bindings (allowed or not), memory updates, closes, and time passing by
//! arbitrary amounts (monotonic).
//!
//! Checked after every event, for both machines:
//! * nothing panics; a failed (or closed) machine stays failed and emits nothing more; at
//!   most one `Failed`, always the last output; at most one `Ready`, one `Welcomed`;
//! * outputs only in legal states: `Ready` only once the machine's own data connection is
//!   bound (and, for the initiator, after it was welcomed and gave its memory); a peer's
//!   memory update only once established; the opening message only first;
//! * authentication: a side with a secret never becomes ready unless the other side has the
//!   same secret, and a listener never lets an unauthenticated peer bind;
//! * deadlines: a handshaking machine always has one, an established or failed machine none;
//!   a deadline is never set in the past; `handle_timeout` before the deadline changes
//!   nothing, at or after it fails the machine with `Timeout`.

use arbitrary::{Arbitrary, Unstructured};
use kvbridge_proto::auth::Secret;
use kvbridge_proto::handshake::{Initiator, ListenerSession, LocalIdentity, Output};
use kvbridge_proto::ids::Blob;
use kvbridge_proto::msg::{
    Ack, Auth, Batch, Compat, DataHello, ErrorCode, Hello, MemInfo, MemKind, Message, Notify,
    OpDesc, Ping, Ready, RegionInfo, Reject, Welcome,
};
use kvbridge_proto::{Incarnation, PeerId, RegionId, SessionToken};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Most events in one input.
const MAX_EVENTS: usize = 256;

const SECRETS: [&str; 2] = ["s3cret", "other"];

/// An arbitrary message: mostly well-formed with fuzzed fields, or raw msgpack bytes.
#[derive(Debug, Arbitrary)]
enum MsgSpec {
    Hello {
        version: u8,
        peer: u8,
        incarnation: u64,
        hash: bool,
        auth: Option<AuthSpec>,
    },
    Welcome {
        version: u8,
        peer: u8,
        token: [u8; 16],
        hash: bool,
        auth: Option<AuthSpec>,
    },
    Reject(u8),
    Bye(u8),
    MemInfo(Vec<(u8, u64, u64)>),
    Ready,
    Proof(AuthSpec),
    Ping(u64),
    Pong(u64),
    DataHello(u8),
    WriteBatch(u64, Vec<(u8, u64, u64)>),
    ReadBatch(u64),
    WriteAck(u64),
    Notify(u64, Vec<u8>),
    /// A message decoded from raw bytes (skipped when they do not decode).
    Raw(Vec<u8>),
    HostOffer,
}

#[derive(Debug, Arbitrary)]
struct AuthSpec {
    challenge: Option<Vec<u8>>,
    response: Option<Vec<u8>>,
}

#[derive(Debug, Arbitrary)]
enum Event {
    /// Deliver the next message in flight to the listener / initiator.
    ToListener,
    ToInitiator,
    /// Lose the next message in flight.
    DropToListener,
    DropToInitiator,
    /// Deliver the next message in flight twice.
    DupToListener,
    DupToInitiator,
    /// A forged or malformed message.
    InjectToListener(MsgSpec),
    InjectToInitiator(MsgSpec),
    /// The initiator's driver bound its data connection.
    BindInitiator,
    /// The listener's driver binds, as a correct driver does: only when `may_bind`.
    BindListener,
    /// A buggy or hostile driver binds the listener regardless.
    ForceBindListener,
    /// The initiator's driver hands over (new) memory information.
    Provide(u8),
    /// The listener's grant changed.
    UpdateGrant(u8),
    /// Time passes; both machines (or one) are told.
    Advance {
        millis: u32,
        initiator: bool,
        listener: bool,
    },
    CloseInitiator(u8),
    CloseListener(u8),
}

#[derive(Debug, Arbitrary)]
struct Setup {
    initiator_secret: Option<bool>,
    listener_secret: Option<bool>,
    /// Whether the listener's compatibility hash matches the initiator's.
    compatible: bool,
    step_millis: u16,
}

fn error_code(b: u8) -> ErrorCode {
    const CODES: [ErrorCode; 14] = [
        ErrorCode::UnsupportedVersion,
        ErrorCode::Incompatible,
        ErrorCode::UnexpectedMessage,
        ErrorCode::Malformed,
        ErrorCode::UnknownSession,
        ErrorCode::Timeout,
        ErrorCode::UnknownRegion,
        ErrorCode::OutOfBounds,
        ErrorCode::LimitExceeded,
        ErrorCode::PeerRestarted,
        ErrorCode::SessionReplaced,
        ErrorCode::Unauthenticated,
        ErrorCode::ShuttingDown,
        ErrorCode::Internal,
    ];
    CODES[usize::from(b) % CODES.len()]
}

/// A peer id from a selector: the two real ones, another valid one, the longest valid one,
/// or an empty one that only a decoder produces (a longer one does not decode).
fn peer(b: u8) -> PeerId {
    let s = match b % 5 {
        0 => "prefill-0".to_string(),
        1 => "decode-0".to_string(),
        2 => "intruder".to_string(),
        3 => String::new(),
        _ => "x".repeat(kvbridge_proto::ids::MAX_PEER_ID_LEN),
    };
    // PeerId::new refuses what is invalid; the wire does not, so go through msgpack.
    rmp_serde::from_slice(&rmp_serde::to_vec(&s).expect("a string encodes"))
        .expect("any string decodes as a peer id")
}

fn auth(a: AuthSpec) -> Auth {
    Auth {
        challenge: a.challenge.map(Blob),
        response: a.response.map(Blob),
    }
}

fn regions(v: Vec<(u8, u64, u64)>) -> MemInfo {
    MemInfo {
        regions: v
            .into_iter()
            .take(8)
            .map(|(id, len, page_size)| RegionInfo {
                id: RegionId([id; 16]),
                len,
                page_size,
                kind: MemKind::Cpu,
            })
            .collect(),
    }
}

fn mem(tag: u8) -> MemInfo {
    regions(vec![(tag, 1 << 20, 4096)])
}

fn message(spec: MsgSpec, hash: u64) -> Option<Message> {
    let compat = |ok: bool| Compat {
        hash: if ok { hash } else { hash ^ 1 },
        description: String::new(),
    };
    let reject = |c: u8| Reject {
        code: error_code(c),
        message: "forged".into(),
    };
    Some(match spec {
        MsgSpec::Hello {
            version,
            peer: p,
            incarnation,
            hash,
            auth: a,
        } => Message::Hello(Hello {
            version,
            peer_id: peer(p),
            incarnation: Incarnation(incarnation),
            compat: compat(hash),
            auth: a.map(auth),
            unacked_notify: incarnation % 2 == 0,
            host_after_proof: incarnation % 3 != 0,
            data_proof: incarnation % 5 != 0,
            data_connections: 0,
            ucx: false,
            grant_tokens: false,
        }),
        MsgSpec::Welcome {
            version,
            peer: p,
            token,
            hash,
            auth: a,
        } => Message::Welcome(Welcome {
            version,
            peer_id: peer(p),
            incarnation: Incarnation(7),
            token: SessionToken(token),
            compat: compat(hash),
            auth: a.map(auth),
            // The shared-memory offer only names a socket; the state machines pass it on.
            shm: None,
            unacked_notify: token[0] % 2 == 0,
            host_after_proof: token[1] % 2 == 0,
            data_proof: token[2] % 2 == 0,
            ucx: token[3] % 2 == 0,
            grant_tokens: token[4] % 2 == 0,
        }),
        MsgSpec::Reject(c) => Message::Reject(reject(c)),
        MsgSpec::Bye(c) => Message::Bye(reject(c)),
        MsgSpec::MemInfo(v) => Message::MemInfo(regions(v)),
        MsgSpec::Ready => Message::Ready(Ready {}),
        MsgSpec::Proof(a) => Message::Proof(auth(a)),
        MsgSpec::Ping(n) => Message::Ping(Ping { nonce: n }),
        MsgSpec::Pong(n) => Message::Pong(Ping { nonce: n }),
        MsgSpec::HostOffer => Message::HostOffer(Default::default()),
        MsgSpec::DataHello(p) => Message::DataHello(DataHello {
            token: SessionToken([p; 16]),
            peer_id: peer(p),
            stream: 0,
        }),
        MsgSpec::WriteBatch(id, ops) => Message::WriteBatch(Batch {
            id,
            ops: ops
                .into_iter()
                .take(8)
                .map(|(r, offset, len)| OpDesc {
                    region: RegionId([r; 16]),
                    offset,
                    len,
                })
                .collect(),
            grant: None,
        }),
        MsgSpec::ReadBatch(id) => Message::ReadBatch(Batch {
            id,
            ops: vec![],
            grant: None,
        }),
        MsgSpec::WriteAck(id) => Message::WriteAck(Ack { id, error: None }),
        MsgSpec::Notify(id, d) => Message::Notify(Notify {
            id,
            data: Blob(d),
            unacked: id % 2 == 1,
        }),
        MsgSpec::Raw(b) => Message::decode(&b).ok()?,
    })
}

/// What the harness knows about one machine, to judge its outputs.
#[derive(Default)]
struct Seen {
    outputs: usize,
    failed: bool,
    ready: bool,
    welcomed: bool,
    bound: bool,
    provided: bool,
}

fn identity(name: &str, inc: u64, hash: u64, secret: Option<bool>) -> LocalIdentity {
    LocalIdentity {
        peer_id: PeerId::new(name).unwrap(),
        incarnation: Incarnation(inc),
        compat: Compat {
            hash,
            description: format!("layout-{hash}"),
        },
        secret: secret.map(|s| Secret::new(SECRETS[usize::from(s)].as_bytes().to_vec()).unwrap()),
        peer_keys: None,
        peer_key: None,
    }
}

/// The target's body.
pub fn run(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(setup) = Setup::arbitrary(&mut u) else {
        return;
    };
    let step = Duration::from_millis(u64::from(setup.step_millis) + 1);
    let t0 = Instant::now();
    let mut now = t0;
    let hash = 42;
    let mut init = Initiator::new(
        identity("prefill-0", 1, hash, setup.initiator_secret),
        step,
        now,
        [1; 32],
    );
    let mut iseen = Seen::default();
    let mut to_listener = VecDeque::new();
    let mut to_initiator = VecDeque::new();
    drain_initiator(&mut init, &mut iseen, &mut to_listener, true);
    let listener_id = identity(
        "decode-0",
        2,
        if setup.compatible { hash } else { hash + 1 },
        setup.listener_secret,
    );
    // The listener session exists once a Hello reached the listener.
    let mut listen: Option<ListenerSession> = None;
    let mut lseen = Seen::default();
    let secrets_match = match (setup.initiator_secret, setup.listener_secret) {
        (None, None) => true,
        (Some(a), Some(b)) => a == b,
        _ => false,
    };

    for _ in 0..MAX_EVENTS {
        let Ok(ev) = Event::arbitrary(&mut u) else {
            break;
        };
        let mut to_l: Vec<Message> = Vec::new();
        let mut to_i: Vec<Message> = Vec::new();
        let (mut bind_init, mut bind_listen, mut force_bind) = (false, false, false);
        match ev {
            Event::ToListener => to_l.extend(to_listener.pop_front()),
            Event::ToInitiator => to_i.extend(to_initiator.pop_front()),
            Event::DropToListener => {
                to_listener.pop_front();
            }
            Event::DropToInitiator => {
                to_initiator.pop_front();
            }
            Event::DupToListener => {
                if let Some(m) = to_listener.pop_front() {
                    to_l.push(m.clone());
                    to_l.push(m);
                }
            }
            Event::DupToInitiator => {
                if let Some(m) = to_initiator.pop_front() {
                    to_i.push(m.clone());
                    to_i.push(m);
                }
            }
            Event::InjectToListener(s) => to_l.extend(message(s, hash)),
            Event::InjectToInitiator(s) => to_i.extend(message(s, hash)),
            Event::BindInitiator => bind_init = true,
            Event::BindListener => bind_listen = true,
            Event::ForceBindListener => force_bind = true,
            Event::Provide(tag) => {
                iseen.provided |= iseen.welcomed && !init.is_failed();
                let d = init.poll_timeout();
                init.provide_mem_info(mem(tag), now);
                check_deadline(d, init.poll_timeout(), now, step);
            }
            Event::UpdateGrant(tag) => {
                if let Some(l) = listen.as_mut() {
                    l.update_mem_info(mem(tag));
                }
            }
            Event::Advance {
                millis,
                initiator,
                listener,
            } => {
                now += Duration::from_millis(u64::from(millis));
                if initiator {
                    let d = init.poll_timeout();
                    let was_failed = init.is_failed();
                    init.handle_timeout(now);
                    check_timeout(d, now, was_failed, init.is_failed(), init.poll_timeout());
                }
                if let (true, Some(l)) = (listener, listen.as_mut()) {
                    let d = l.poll_timeout();
                    let was_failed = l.is_failed();
                    l.handle_timeout(now);
                    check_timeout(d, now, was_failed, l.is_failed(), l.poll_timeout());
                }
            }
            Event::CloseInitiator(c) => init.close(error_code(c), "closing".into()),
            Event::CloseListener(c) => {
                if let Some(l) = listen.as_mut() {
                    l.close(error_code(c), "closing".into())
                }
            }
        }
        for m in to_l {
            match (&mut listen, m) {
                (None, Message::Hello(h)) => {
                    listen = Some(ListenerSession::accept(
                        h,
                        &listener_id,
                        SessionToken([9; 16]),
                        mem(2),
                        step,
                        now,
                        [2; 32],
                    ));
                    let l = listen.as_mut().unwrap();
                    drain_listener(l, &mut lseen, &mut to_initiator, true);
                }
                (None, _) => {} // the driver refuses a first frame that is not a Hello
                (Some(l), m) => {
                    let d = l.poll_timeout();
                    l.handle_message(m, now);
                    check_deadline(d, l.poll_timeout(), now, step);
                }
            }
        }
        for m in to_i {
            let d = init.poll_timeout();
            init.handle_message(m, now);
            check_deadline(d, init.poll_timeout(), now, step);
        }
        if bind_init {
            if !init.is_failed() {
                iseen.bound = true;
            }
            let d = init.poll_timeout();
            init.data_bound(now);
            check_deadline(d, init.poll_timeout(), now, step);
        }
        if let Some(l) = listen.as_mut() {
            if (bind_listen && l.may_bind()) || force_bind {
                let allowed = l.may_bind();
                let failed_before = l.is_failed();
                let d = l.poll_timeout();
                l.data_bound(now);
                if !failed_before {
                    if allowed {
                        lseen.bound = true;
                    } else {
                        // Binding an unauthenticated peer must fail the session.
                        assert!(l.is_failed(), "listener bound a peer that may not bind");
                    }
                }
                check_deadline(d, l.poll_timeout(), now, step);
            }
        }
        drain_initiator(&mut init, &mut iseen, &mut to_listener, false);
        if let Some(l) = listen.as_mut() {
            drain_listener(l, &mut lseen, &mut to_initiator, false);
        }
        // Auth: nobody becomes ready with a peer that does not share its secret.
        if iseen.ready && setup.initiator_secret.is_some() {
            assert!(
                secrets_match,
                "initiator established with a listener lacking its secret"
            );
        }
        if lseen.ready && setup.listener_secret.is_some() {
            assert!(
                secrets_match,
                "listener established with an unauthenticated peer"
            );
        }
        check_machine(init.is_failed(), init.is_established(), init.poll_timeout());
        if let Some(l) = &listen {
            check_machine(l.is_failed(), l.is_established(), l.poll_timeout());
        }
        // Bounded queues: a message is consumed per delivery event, and each machine emits a
        // bounded number per event.
        to_listener.truncate(64);
        to_initiator.truncate(64);
    }
}

/// A machine that is handshaking has a deadline; an established or failed one has none.
fn check_machine(failed: bool, established: bool, deadline: Option<Instant>) {
    if failed || established {
        assert!(
            deadline.is_none(),
            "deadline on an ended or established machine"
        );
    } else {
        assert!(deadline.is_some(), "handshaking machine without a deadline");
    }
}

/// After a call at `now`, the deadline is gone, unchanged, or re-armed a whole step from
/// now: never set in the past.
fn check_deadline(before: Option<Instant>, after: Option<Instant>, now: Instant, step: Duration) {
    assert!(
        after.is_none() || after == before || after == Some(now + step),
        "deadline {after:?} set at {now:?} (before: {before:?}, step {step:?})"
    );
}

fn check_timeout(
    before: Option<Instant>,
    now: Instant,
    was_failed: bool,
    failed: bool,
    after: Option<Instant>,
) {
    if was_failed {
        assert!(failed, "a failed machine came back");
        return;
    }
    match before {
        Some(d) if now >= d => assert!(failed, "deadline passed without a timeout"),
        _ => {
            assert!(!failed, "timed out before its deadline");
            assert_eq!(
                before, after,
                "handle_timeout moved a deadline it did not reach"
            );
        }
    }
    if let Some(d) = after {
        assert!(d > now, "deadline in the past after handle_timeout");
    }
}

fn drain_initiator(
    m: &mut Initiator,
    seen: &mut Seen,
    to_listener: &mut VecDeque<Message>,
    first: bool,
) {
    let mut n = 0;
    while let Some(o) = m.poll_output() {
        n += 1;
        assert!(n < 64, "unbounded outputs");
        assert!(!seen.failed, "initiator output after Failed: {o:?}");
        match o {
            Output::Send(msg) => {
                if matches!(msg, Message::Hello(_)) {
                    assert!(first && seen.outputs == 0, "Hello not first");
                }
                if matches!(msg, Message::MemInfo(_)) {
                    assert!(
                        seen.welcomed,
                        "initiator sent memory before it was welcomed"
                    );
                }
                if matches!(msg, Message::Proof(_)) {
                    assert!(!seen.welcomed, "proof after Welcomed");
                }
                assert!(
                    !matches!(
                        msg,
                        Message::Welcome(_)
                            | Message::Ready(_)
                            | Message::DataHello(_)
                            | Message::HostOffer(_)
                    ),
                    "initiator sent a listener's message"
                );
                to_listener.push_back(msg);
            }
            Output::Welcomed { .. } => {
                assert!(!seen.welcomed, "welcomed twice");
                seen.welcomed = true;
            }
            Output::Ready(_) => {
                assert!(!seen.ready, "initiator ready twice");
                assert!(
                    seen.welcomed && seen.bound,
                    "initiator ready before bind/welcome"
                );
                assert!(seen.provided, "initiator ready before it sent its memory");
                seen.ready = true;
            }
            Output::PeerMemInfo(_) => assert!(seen.ready, "PeerMemInfo before Ready"),
            Output::Failed(e) => {
                seen.failed = true;
                assert!(!e.to_string().is_empty());
            }
        }
        seen.outputs += 1;
    }
    if seen.failed {
        assert!(
            m.is_failed(),
            "Failed emitted but the machine is not failed"
        );
    }
}

fn drain_listener(
    l: &mut ListenerSession,
    seen: &mut Seen,
    to_initiator: &mut VecDeque<Message>,
    first: bool,
) {
    let mut n = 0;
    while let Some(o) = l.poll_output() {
        n += 1;
        assert!(n < 64, "unbounded outputs");
        assert!(!seen.failed, "listener output after Failed: {o:?}");
        match o {
            Output::Send(msg) => {
                if matches!(msg, Message::Welcome(_)) {
                    assert!(first && seen.outputs == 0, "Welcome not first");
                }
                if matches!(msg, Message::MemInfo(_) | Message::Ready(_)) {
                    assert!(seen.ready, "listener served memory before its Ready");
                }
                // Nothing about the host before the initiator proved itself.
                if matches!(msg, Message::HostOffer(_)) {
                    assert!(l.may_bind(), "HostOffer before the initiator's proof");
                }
                assert!(
                    !matches!(
                        msg,
                        Message::Hello(_) | Message::Proof(_) | Message::DataHello(_)
                    ),
                    "listener sent an initiator's message"
                );
                to_initiator.push_back(msg);
            }
            Output::Welcomed { .. } => panic!("listener emitted Welcomed"),
            Output::Ready(_) => {
                assert!(!seen.ready, "listener ready twice");
                assert!(
                    seen.bound,
                    "listener ready before its data connection was bound"
                );
                seen.ready = true;
            }
            Output::PeerMemInfo(_) => assert!(seen.ready, "PeerMemInfo before Ready"),
            Output::Failed(e) => {
                seen.failed = true;
                assert!(!e.to_string().is_empty());
            }
        }
        seen.outputs += 1;
    }
    if seen.failed {
        assert!(l.is_failed());
    }
}
