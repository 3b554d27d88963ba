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
    let frame = Message::WriteBatch(Batch { id: 1, ops })
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
