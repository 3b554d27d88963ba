//! A peer that speaks the protocol by hand and then breaks it: every bad op header ends its
//! session with a typed error, and no byte lands outside the target region.

mod common;
use common::*;
use kvbridge::proto::frame::FrameHeader;
use kvbridge::proto::msg::*;
use kvbridge::proto::{PeerId, RegionId};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PAGE: usize = 4096;

async fn expect_rejected_write(bad: OpDesc, expected: ErrorCode) {
    expect_rejected_batch(vec![bad], expected).await
}

/// A write batch of `ops` (region `[0; 16]` means the listener's region) is refused with
/// `expected`, nothing lands, and the session ends.
async fn expect_rejected_batch(ops: Vec<OpDesc>, expected: ErrorCode) {
    let (dec, kv) = listener("decode-0", |_| {}, 4 * PAGE, PAGE).await;
    // Guard bytes around the region must stay zero; the region itself too.
    let (mut ctl, mut data) = handshake(&addr(&dec)).await;
    let ops = ops
        .into_iter()
        .map(|bad| OpDesc {
            region: if bad.region == RegionId([0; 16]) {
                kv.id()
            } else {
                bad.region
            },
            ..bad
        })
        .collect();
    let frame = Message::WriteBatch(Batch {
        id: 1,
        ops,
        grant: None,
    })
    .to_frame()
    .unwrap();
    data.write_all(&frame).await.unwrap();
    let _ = data.write_all(&vec![0xAB; 2 * PAGE]).await;
    match recv_frame(&mut data).await {
        Some(Message::WriteAck(a)) => {
            assert_eq!(a.id, 1);
            assert_eq!(a.error.expect("error ack").code, expected);
        }
        m => panic!("expected an error ack, got {m:?}"),
    }
    // The session is over: both connections end, and the listener holds nothing for it.
    let mut b = [0u8; 1];
    assert!(matches!(
        tokio::time::timeout(Duration::from_secs(5), data.read(&mut b)).await,
        Ok(Ok(0)) | Ok(Err(_))
    ));
    let mut seen_end = false;
    for _ in 0..10 {
        match tokio::time::timeout(Duration::from_secs(5), ctl.read(&mut [0u8; 256])).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                seen_end = true;
                break;
            }
            Ok(Ok(_)) => continue, // a Bye/Reject frame before the close
            Err(_) => break,
        }
    }
    assert!(seen_end, "control connection not closed");
    let mut all = vec![0u8; kv.len()];
    kv.read_at(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 0), "bytes landed in the region");
    for _ in 0..100 {
        if dec.stats().await.unwrap().sessions == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "listener kept the hostile session: {:?}",
        dec.stats().await.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_past_the_end_of_a_region_is_refused() {
    expect_rejected_write(
        OpDesc {
            region: RegionId([0; 16]),
            offset: 3 * PAGE as u64 + 1,
            len: PAGE as u64,
        },
        ErrorCode::OutOfBounds,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_with_overflowing_offset_is_refused() {
    expect_rejected_write(
        OpDesc {
            region: RegionId([0; 16]),
            offset: u64::MAX - 10,
            len: 100,
        },
        ErrorCode::OutOfBounds,
    )
    .await;
}

/// Two ops of one write batch over the same bytes (found by the `op_validation` fuzz
/// target): refused, since the payload would be read into two overlapping mutable slices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_ops_in_one_write_batch_are_refused() {
    let op = |offset: u64| OpDesc {
        region: RegionId([0; 16]),
        offset,
        len: PAGE as u64,
    };
    expect_rejected_batch(vec![op(0), op(PAGE as u64 / 2)], ErrorCode::OutOfBounds).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_to_an_unknown_region_is_refused() {
    expect_rejected_write(
        OpDesc {
            region: RegionId([5; 16]),
            offset: 0,
            len: 16,
        },
        ErrorCode::UnknownRegion,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn region_not_granted_to_the_peer_is_invisible() {
    let dec = kvbridge::Channel::new(kvbridge::ChannelConfig::new(
        "decode-0",
        Some("127.0.0.1:0"),
    ))
    .await
    .unwrap();
    let secret = kvbridge::Region::alloc(PAGE, PAGE).unwrap();
    dec.register(
        &secret,
        kvbridge::Grant::Peers(vec![PeerId::new("someone-else").unwrap()]),
    )
    .unwrap();
    let (_ctl, mut data) = handshake(&addr(&dec)).await;
    let frame = Message::WriteBatch(Batch {
        id: 9,
        ops: vec![OpDesc {
            region: secret.id(),
            offset: 0,
            len: 8,
        }],
        grant: None,
    })
    .to_frame()
    .unwrap();
    data.write_all(&frame).await.unwrap();
    let _ = data.write_all(&[1u8; 8]).await;
    match recv_frame(&mut data).await {
        Some(Message::WriteAck(a)) => assert_eq!(a.error.unwrap().code, ErrorCode::UnknownRegion),
        m => panic!("{m:?}"),
    }
    let mut b = [0u8; 8];
    secret.read_at(0, &mut b).unwrap();
    assert_eq!(b, [0u8; 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_and_garbage_are_refused_without_a_panic() {
    let (dec, _kv) = listener("decode-0", |c| c.limits.max_frame_len = 1024, PAGE, PAGE).await;
    // Oversized frame header.
    let mut s = TcpStream::connect(addr(&dec)).await.unwrap();
    s.write_all(&FrameHeader::encode(1 << 30)).await.unwrap();
    match recv_frame(&mut s).await {
        Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::LimitExceeded),
        m => panic!("{m:?}"),
    }
    // Not kvbridge at all.
    let mut s = TcpStream::connect(addr(&dec)).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    match recv_frame(&mut s).await {
        Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::Malformed),
        m => panic!("{m:?}"),
    }
    // A data connection with a made-up token.
    let mut s = TcpStream::connect(addr(&dec)).await.unwrap();
    send_frame(
        &mut s,
        &Message::DataHello(DataHello {
            token: kvbridge::proto::SessionToken([3; 16]),
            peer_id: PeerId::new("x").unwrap(),
            stream: 0,
        }),
    )
    .await;
    match recv_frame(&mut s).await {
        Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::UnknownSession),
        m => panic!("{m:?}"),
    }
    // The listener still serves well-behaved peers.
    let (pre, _) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    pre.connect(&addr(&dec)).await.unwrap();
}

/// Test both data-path drivers: a thread blocked in the kernel and a tokio task.
/// `partial_frame`: stall inside a frame header instead of inside a payload.
async fn stalled_peer_is_dropped(threads: bool, partial_frame: bool) {
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            c.deadlines.op = Duration::from_millis(300);
            c.data_threads = threads;
        },
        4 * PAGE,
        PAGE,
    )
    .await;
    let (_ctl, mut data) = handshake(&addr(&dec)).await;
    let frame = Message::WriteBatch(Batch {
        id: 1,
        ops: vec![OpDesc {
            region: kv.id(),
            offset: 0,
            len: PAGE as u64,
        }],
        grant: None,
    })
    .to_frame()
    .unwrap();
    if partial_frame {
        data.write_all(&frame[..5]).await.unwrap(); // then nothing more
    } else {
        data.write_all(&frame).await.unwrap();
        data.write_all(&[7u8; 100]).await.unwrap(); // then nothing more
    }
    let t = std::time::Instant::now();
    while (kv.in_use() > 0 || dec.stats().await.unwrap().sessions > 0)
        && t.elapsed() < Duration::from_secs(5)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(kv.in_use(), 0, "a stalled payload still holds the region");
    assert_eq!(
        dec.stats().await.unwrap().sessions,
        0,
        "stalled session kept"
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    // Deregistration is not held hostage either.
    tokio::time::timeout(Duration::from_secs(1), dec.deregister(kv.id()))
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_payload_hits_its_deadline_on_data_threads() {
    stalled_peer_is_dropped(true, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_inside_a_frame_hits_its_deadline_on_data_threads() {
    stalled_peer_is_dropped(true, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stall_inside_a_frame_hits_its_deadline_on_data_tasks() {
    stalled_peer_is_dropped(false, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_payload_hits_its_deadline_on_data_tasks() {
    stalled_peer_is_dropped(false, false).await
}

/// Connections that never send a first frame are bounded: past
/// `max_unidentified_connections`, a new one is closed at once (long before the first-frame
/// deadline); once the silent ones go, a real peer connects again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_beyond_the_limit_are_closed_at_once() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| {
            c.limits.max_unidentified_connections = 2;
            c.deadlines.first_frame = Duration::from_secs(60);
        },
        4 * PAGE,
        PAGE,
    )
    .await;
    let a = addr(&dec);
    let silent: Vec<TcpStream> = vec![
        TcpStream::connect(&a).await.unwrap(),
        TcpStream::connect(&a).await.unwrap(),
    ];
    let mut third = TcpStream::connect(&a).await.unwrap();
    let r = tokio::time::timeout(Duration::from_secs(10), third.read(&mut [0u8; 16])).await;
    assert!(
        matches!(r, Ok(Ok(0)) | Ok(Err(_))),
        "the connection past the limit must be closed, got {r:?}"
    );
    drop(silent);
    let (ini, _src) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    let t = std::time::Instant::now();
    loop {
        match ini.connect(&a).await {
            Ok(_) => break,
            Err(_) if t.elapsed() < Duration::from_secs(10) => tokio::task::yield_now().await,
            Err(e) => panic!("no connection once the silent peers left: {e}"),
        }
    }
}

/// A peer that asks for a read and never takes the answer (while its control connection
/// stays up) must not pin the region: the response's write has the op deadline, and its
/// expiry ends the session. Both data-path drivers.
async fn unread_read_response_ends_the_session(threads: bool) {
    const LEN: usize = 64 << 20;
    let op = Duration::from_millis(500);
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            c.deadlines.op = op;
            // Silence on the control connection must not be what ends the session.
            c.deadlines.peer_silence = Duration::from_secs(120);
            c.data_threads = threads;
        },
        LEN,
        PAGE,
    )
    .await;
    let (_ctl, mut data) = handshake(&addr(&dec)).await;
    let batch = Message::ReadBatch(Batch {
        id: 1,
        ops: vec![OpDesc {
            region: kv.id(),
            offset: 0,
            len: LEN as u64,
        }],
        grant: None,
    });
    data.write_all(&batch.to_frame().unwrap()).await.unwrap();
    // Far more than the socket buffers hold; then nothing is read.
    let t = std::time::Instant::now();
    while (kv.in_use() > 0 || dec.stats().await.unwrap().sessions > 0)
        && t.elapsed() < Duration::from_secs(10)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        kv.in_use(),
        0,
        "an unread read response still holds the region"
    );
    assert_eq!(
        dec.stats().await.unwrap().sessions,
        0,
        "the session was kept"
    );
    assert!(
        t.elapsed() < op + Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
    tokio::time::timeout(Duration::from_secs(1), dec.deregister(kv.id()))
        .await
        .unwrap()
        .unwrap();
    drop(data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_reads_its_read_response_loses_its_session_on_data_threads() {
    unread_read_response_ends_the_session(true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_never_reads_its_read_response_loses_its_session_on_data_tasks() {
    unread_read_response_ends_the_session(false).await
}

/// Before authentication a connection may announce only a small first frame: a `Hello` or
/// `DataHello` never needs more than a few KiB, whatever `max_frame_len` allows later. One
/// that announces more is refused with `LimitExceeded` before its body is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_frame_larger_than_a_hello_needs_is_refused() {
    let (dec, _kv) = listener("decode-0", |_| {}, PAGE, PAGE).await;
    for announced in [64 << 10, 16 << 20] {
        let mut s = TcpStream::connect(addr(&dec)).await.unwrap();
        s.write_all(&FrameHeader::encode(announced)).await.unwrap();
        match recv_frame(&mut s).await {
            Some(Message::Reject(r)) => {
                assert_eq!(
                    r.code,
                    ErrorCode::LimitExceeded,
                    "{announced}: {}",
                    r.message
                )
            }
            m => panic!("{announced}: {m:?}"),
        }
    }
    // A Hello whose compat description is far longer than any real one: refused the same
    // way, though it is a well-formed message.
    let mut s = TcpStream::connect(addr(&dec)).await.unwrap();
    let hello = Message::Hello(Hello {
        version: 1,
        peer_id: PeerId::new("prefill-0").unwrap(),
        incarnation: kvbridge::proto::Incarnation(1),
        compat: Compat {
            hash: 0,
            description: "x".repeat(100_000),
        },
        auth: None,
        unacked_notify: false,
        host_after_proof: false,
        data_proof: false,
        data_connections: 0,
        ucx: false,
        grant_tokens: false,
    });
    send_frame(&mut s, &hello).await;
    match recv_frame(&mut s).await {
        Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::LimitExceeded, "{}", r.message),
        m => panic!("{m:?}"),
    }
    assert_eq!(dec.stats().await.unwrap().sessions, 0);
    // Real peers still get in.
    let (pre, _) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    pre.connect(&addr(&dec)).await.unwrap();
}

/// Opens a control connection from `source` (a loopback address of its own) and sends a
/// `Hello` as `name`, then nothing more: a handshake that holds its slot until the step
/// deadline. Returns the connection once the listener answered with a `Welcome`.
async fn stalled_hello_from(target: &str, source: &str, name: &str) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let mut s = sock.connect(target.parse().unwrap()).await.unwrap();
    send_frame(
        &mut s,
        &Message::Hello(Hello {
            version: 1,
            peer_id: PeerId::new(name).unwrap(),
            incarnation: kvbridge::proto::Incarnation(1),
            compat: Compat::default(),
            auth: None,
            unacked_notify: false,
            host_after_proof: false,
            data_proof: false,
            data_connections: 0,
            ucx: false,
            grant_tokens: false,
        }),
    )
    .await;
    s
}

/// Handshake slots are shared fairly between sources: Hellos that never finish, all from
/// one host, fill that host's quota and no more, so a peer on another host still gets in
/// at once (`Stats::handshakes_refused` counts the refused ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_hellos_from_one_host_do_not_lock_out_another() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| {
            c.limits.max_concurrent_handshakes = 8;
            c.limits.max_handshakes_per_source = 4;
            c.deadlines.handshake_step = Duration::from_secs(60);
        },
        PAGE,
        PAGE,
    )
    .await;
    let a = addr(&dec);
    let mut stalled = Vec::new();
    for i in 0..12 {
        stalled.push(stalled_hello_from(&a, "127.0.0.2", &format!("flood-{i}")).await);
    }
    // Every Hello was answered (a Welcome or a refusal) before the real peer comes.
    for s in &mut stalled {
        assert!(recv_frame(s).await.is_some(), "a Hello was not answered");
    }
    let s = dec.stats().await.unwrap();
    assert_eq!(s.sessions, 4, "{s:?}");
    assert_eq!(s.handshakes_refused, 8, "{s:?}");
    let (pre, _) = initiator(
        "prefill-0",
        |c| c.deadlines.handshake_step = Duration::from_secs(2),
        PAGE,
        PAGE,
    )
    .await;
    tokio::time::timeout(Duration::from_secs(5), pre.connect(&a))
        .await
        .expect("the real peer hangs")
        .expect("the real peer is locked out");
    drop(stalled);
}

/// Hellos that never finish from four hosts, each within its per-source quota, take every
/// handshake slot: a peer from a fifth host still completes its handshake within its
/// deadline, because a `Hello` from a source holding fewer slots takes the oldest slot of
/// the source holding most.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_hellos_from_four_hosts_do_not_lock_out_a_fifth() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| {
            c.limits.max_concurrent_handshakes = 8;
            c.limits.max_handshakes_per_source = 2;
            c.deadlines.handshake_step = Duration::from_secs(60);
        },
        PAGE,
        PAGE,
    )
    .await;
    let a = addr(&dec);
    let mut stalled = Vec::new();
    for host in 2..=5 {
        for i in 0..2 {
            let source = format!("127.0.0.{host}");
            let mut s = stalled_hello_from(&a, &source, &format!("flood-{host}-{i}")).await;
            // Each Hello is read on its own task: waiting for its Welcome before the next
            // is sent makes the listener's "oldest" the order they were sent in.
            match recv_frame(&mut s).await {
                Some(Message::Welcome(_)) => {}
                m => panic!("a stalled Hello within the quotas was not welcomed: {m:?}"),
            }
            stalled.push(s);
        }
    }
    let s = dec.stats().await.unwrap();
    assert_eq!((s.sessions, s.handshakes_refused), (8, 0), "{s:?}");
    let (pre, _) = initiator(
        "prefill-0",
        |c| c.deadlines.handshake_step = Duration::from_secs(2),
        PAGE,
        PAGE,
    )
    .await;
    tokio::time::timeout(Duration::from_secs(5), pre.connect(&a))
        .await
        .expect("the real peer hangs")
        .expect("the real peer is locked out");
    // The slot came from the oldest handshake of the sources holding most (all four held
    // two): the first one from 127.0.0.2, told why (a `Bye`, as for any session the
    // listener ends), naming itself, its address and step.
    let first = stalled.first_mut().unwrap();
    let reject = loop {
        match recv_frame(first).await {
            Some(Message::Bye(r)) => break r,
            Some(_) => continue,
            None => panic!("the displaced handshake was closed without a word"),
        }
    };
    assert_eq!(reject.code, ErrorCode::LimitExceeded, "{}", reject.message);
    for part in ["flood-2-0", "127.0.0.2", "127.0.0.1", "step"] {
        assert!(reject.message.contains(part), "{part}: {}", reject.message);
    }
    let s = dec.stats().await.unwrap();
    assert_eq!(
        (s.handshakes_displaced, s.handshakes_refused),
        (1, 0),
        "{s:?}"
    );
    drop(stalled);
}
