//! The peer handshake on real sockets: the seed's race, head-of-line blocking, rollback,
//! restarts and typed errors (properties 1-7 of docs/architecture.md).

mod common;
use common::*;
use kvbridge::proto::msg::{Compat, ErrorCode, Message};
use kvbridge::{Channel, ChannelConfig, Error, Op, PeerId, Step};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PAGE: usize = 4096;

/// Handshake with the given hooks, then check the first write lands byte-exact.
async fn first_write_lands(listener_delay: Option<Duration>, initiator_delay: Option<Duration>) {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.hooks.listener_bind_delay = listener_delay,
        16 * PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| c.hooks.initiator_bind_delay = initiator_delay,
        PAGE,
        PAGE,
    )
    .await;
    fill(&src, 77);
    let peer = pre
        .connect(&addr(&dec))
        .await
        .expect("handshake succeeds despite the delayed bind");
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 5, PAGE)])
        .await
        .unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    src.read_at(0, &mut a).unwrap();
    kv.read_at(5 * PAGE, &mut b).unwrap();
    assert!(a == b, "first write is not byte-exact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_race_listener_bind_delayed_10ms() {
    first_write_lands(Some(Duration::from_millis(10)), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_race_listener_bind_delayed_6s() {
    // Longer than the 5 s after which the upstream fix gave up.
    first_write_lands(Some(Duration::from_secs(6)), None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_race_initiator_bind_delayed_10ms() {
    first_write_lands(None, Some(Duration::from_millis(10))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_race_initiator_bind_delayed_6s() {
    first_write_lands(None, Some(Duration::from_secs(6))).await;
}

async fn handshake_many(target: &str, n: usize) -> Duration {
    let t = Instant::now();
    let joins: Vec<_> = (0..n)
        .map(|i| {
            let target = target.to_string();
            tokio::spawn(async move {
                let ch = Channel::new(ChannelConfig::new(format!("prefill-{i}"), None))
                    .await
                    .unwrap();
                ch.connect(&target).await.unwrap();
                ch
            })
        })
        .collect();
    let mut chans = vec![];
    for j in joins {
        chans.push(j.await.unwrap());
    }
    let took = t.elapsed();
    for c in chans {
        c.close().await;
    }
    took
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_initiators_are_not_blocked_by_a_stalled_peer() {
    let (dec, _kv) = listener("decode-0", |_| {}, PAGE, PAGE).await;
    let target = addr(&dec);
    let baseline = handshake_many(&target, 32).await;

    // One peer connects and says nothing; another stops in the middle of its Hello.
    let mut silent = tokio::net::TcpStream::connect(&target).await.unwrap();
    let mut half = tokio::net::TcpStream::connect(&target).await.unwrap();
    let hello = Message::Hello(kvbridge::proto::msg::Hello {
        version: 1,
        peer_id: PeerId::new("stalled").unwrap(),
        incarnation: kvbridge::Incarnation(1),
        compat: Compat::default(),
        auth: None,
        unacked_notify: false,
        host_after_proof: false,
        data_proof: false,
        data_connections: 0,
        ucx: false,
        grant_tokens: false,
    })
    .to_frame()
    .unwrap();
    half.write_all(&hello[..hello.len() / 2]).await.unwrap();

    let stalled = handshake_many(&target, 32).await;
    assert!(
        stalled <= baseline + Duration::from_secs(1),
        "32 handshakes took {stalled:?} with a stalled peer, {baseline:?} without"
    );
    // The stalled peers are dropped at their first-frame deadline, not kept forever.
    let mut buf = [0u8; 64];
    let r = tokio::time::timeout(Duration::from_secs(10), silent.read(&mut buf)).await;
    assert!(r.is_ok(), "silent peer never dropped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_listener_mid_handshake_then_restart_succeeds() {
    // The listener stalls before answering Hello; we kill it while the initiator waits.
    let (dec, _) = listener(
        "decode-0",
        |c| {
            c.hooks.listener_welcome_delay = Some(Duration::from_secs(60));
            c.deadlines.close = Duration::from_millis(100);
        },
        PAGE,
        PAGE,
    )
    .await;
    let port_addr = addr(&dec);
    let (pre, src) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    let p2 = pre.clone();
    let a2 = port_addr.clone();
    let connecting = tokio::spawn(async move { p2.connect(&a2).await });
    for _ in 0..1000 {
        if dec.stats().await.unwrap().sessions == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    dec.close().await;
    drop(dec);
    let err = tokio::time::timeout(Duration::from_secs(10), connecting)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(err, Error::ConnectionLost { .. } | Error::PeerClosed { .. }),
        "{err}"
    );
    // Rollback: nothing of the failed attempt is left on the initiator.
    let s = pre.stats().await.unwrap();
    assert_eq!((s.sessions, s.dialing, s.established), (0, 0, 0), "{s:?}");

    // Restart on the same address; the next connect starts clean and writes land.
    let mut c = ChannelConfig::new("decode-0", Some(&port_addr));
    c.deadlines = Default::default();
    let dec2 = Channel::new(c).await.unwrap();
    let kv2 = kvbridge::Region::alloc(PAGE, PAGE).unwrap();
    dec2.register(&kv2, kvbridge::Grant::AllPeers).unwrap();
    fill(&src, 3);
    let peer = pre.connect(&port_addr).await.unwrap();
    pre.write(&peer, &[Op::page(&src, 0, kv2.id(), 0, PAGE)])
        .await
        .unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    src.read_at(0, &mut a).unwrap();
    kv2.read_at(0, &mut b).unwrap();
    assert!(a == b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_peer_replaces_its_session_and_old_work_fails_peer_restarted() {
    let (dec, kv) = listener("decode-0", |_| {}, PAGE, PAGE).await;
    // The first incarnation of prefill-0 holds incoming writes in flight.
    let (old, old_region) = initiator(
        "prefill-0",
        |c| c.hooks.write_apply_delay = Some(Duration::from_secs(30)),
        PAGE,
        PAGE,
    )
    .await;
    old.connect(&addr(&dec)).await.unwrap();
    let p = PeerId::new("prefill-0").unwrap();
    let old_inc = dec.peer_incarnation(&p).await.unwrap();
    let d2 = dec.clone();
    let (kv2, rid) = (kv.clone(), old_region.id());
    let pending = tokio::spawn(async move {
        d2.write(
            &PeerId::new("prefill-0").unwrap(),
            &[Op::page(&kv2, 0, rid, 0, PAGE)],
        )
        .await
    });
    wait_in_flight(&dec).await;
    // prefill-0 restarts: same id, new incarnation.
    let mut events = dec.peer_events();
    let (new, _) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    new.connect(&addr(&dec)).await.unwrap();
    // Layers above learn of it: the old incarnation went down with PeerRestarted.
    let mut saw_down = false;
    while let Ok(Ok(ev)) = tokio::time::timeout(Duration::from_secs(5), events.recv()).await {
        if let kvbridge::PeerEvent::Down {
            incarnation, error, ..
        } = ev
        {
            assert_eq!(incarnation, old_inc);
            assert!(matches!(error, Error::PeerRestarted { .. }), "{error}");
            saw_down = true;
            break;
        }
    }
    assert!(saw_down, "no Down event for the replaced session");
    let err = tokio::time::timeout(Duration::from_secs(5), pending)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    match err {
        Error::PeerRestarted {
            peer,
            old: o,
            new: n,
        } => {
            assert_eq!(peer, "prefill-0");
            assert_eq!(o, old_inc);
            assert_eq!(n, new.incarnation());
        }
        e => panic!("expected PeerRestarted, got {e}"),
    }
    assert_eq!(dec.peer_incarnation(&p).await.unwrap(), new.incarnation());
    let s = dec.stats().await.unwrap();
    assert_eq!(s.established, 1, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incompatible_peers_get_a_typed_error_naming_both_values() {
    let compat = |h: u64, d: &str| Compat {
        hash: h,
        description: d.to_string(),
    };
    let (dec, _) = listener(
        "decode-0",
        |c| c.compat = compat(1, "bf16/32L/page16"),
        PAGE,
        PAGE,
    )
    .await;
    let (pre, _) = initiator(
        "prefill-0",
        |c| c.compat = compat(2, "fp8/32L/page16"),
        PAGE,
        PAGE,
    )
    .await;
    let e = pre.connect(&addr(&dec)).await.unwrap_err();
    match &e {
        Error::Rejected {
            peer,
            step,
            code,
            message,
        } => {
            assert_eq!(peer, &addr(&dec));
            assert_eq!(*step, Step::Welcome);
            assert_eq!(*code, ErrorCode::Incompatible);
            assert!(
                message.contains("bf16/32L/page16") && message.contains("fp8/32L/page16"),
                "{message}"
            );
        }
        e => panic!("expected a typed rejection, got {e}"),
    }
    let s = dec.stats().await.unwrap();
    assert_eq!(s.established, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_frame_version_gets_a_reject_naming_both_versions() {
    let (dec, _) = listener("decode-0", |_| {}, PAGE, PAGE).await;
    let mut s = tokio::net::TcpStream::connect(addr(&dec)).await.unwrap();
    let mut frame = Message::Ping(kvbridge::proto::msg::Ping { nonce: 1 })
        .to_frame()
        .unwrap();
    frame[2] = 9;
    s.write_all(&frame).await.unwrap();
    match recv_frame(&mut s).await.expect("a frame back") {
        Message::Reject(r) => {
            assert_eq!(r.code, ErrorCode::UnsupportedVersion);
            assert!(
                r.message.contains('9') && r.message.contains('1'),
                "{}",
                r.message
            );
        }
        m => panic!("expected Reject, got {m:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_listener_fails_within_the_connect_deadline() {
    // Bind then drop to get a port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (pre, _) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    let e = pre.connect(&format!("127.0.0.1:{port}")).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::ConnectionLost {
                step: Step::Connect,
                ..
            }
        ),
        "{e}"
    );
    let s = pre.stats().await.unwrap();
    assert_eq!((s.sessions, s.dialing), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_beyond_the_limit_are_refused_with_limit_exceeded() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| {
            c.limits.max_concurrent_handshakes = 2;
            c.hooks.listener_welcome_delay = Some(Duration::from_secs(30));
            c.deadlines.close = Duration::from_millis(100);
        },
        PAGE,
        PAGE,
    )
    .await;
    let target = addr(&dec);
    // Two slow handshakes occupy the listener...
    let mut pending = vec![];
    for i in 0..2 {
        let (pre, _) = initiator(&format!("slow-{i}"), |_| {}, PAGE, PAGE).await;
        let t = target.clone();
        pending.push(tokio::spawn(async move { pre.connect(&t).await }));
    }
    let t0 = Instant::now();
    while dec.stats().await.unwrap().sessions < 2 && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // ...so the third is refused at once, with a typed error.
    let (third, _) = initiator("third", |_| {}, PAGE, PAGE).await;
    let e = third.connect(&target).await.unwrap_err();
    assert!(
        matches!(
            &e,
            Error::Rejected {
                code: ErrorCode::LimitExceeded,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(dec.stats().await.unwrap().handshakes_refused, 1);
    dec.close().await;
    for p in pending {
        let _ = p.await;
    }
}
