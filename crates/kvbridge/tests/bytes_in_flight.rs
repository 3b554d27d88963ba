//! The per-peer limit on bytes in flight (`Limits::max_bytes_in_flight_per_peer`): our own
//! batches wait for room (and one that can never fit fails at once), and a peer's batch that
//! would pass our limit is refused with `LimitExceeded`, ends its session and is counted.

mod common;
use common::*;
use kvbridge::proto::msg::*;
use kvbridge::proto::{Incarnation, PeerId, RegionId, SessionToken};
use kvbridge::{Error, Op, Transport};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const PAGE: usize = 4096;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_larger_than_the_limit_fails_at_once_and_the_session_goes_on() {
    let (dec, kv) = listener("decode-0", |_| {}, 4 * PAGE, PAGE).await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| c.limits.max_bytes_in_flight_per_peer = 2 * PAGE as u64,
        4 * PAGE,
        PAGE,
    )
    .await;
    fill(&src, 5);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let three: Vec<Op> = (0..3)
        .map(|i| Op::page(&src, i, kv.id(), i as u64, PAGE))
        .collect();
    match pre.write(&peer, &three).await {
        Err(Error::InvalidOp { peer: p, detail }) => {
            assert_eq!(p, "decode-0");
            assert!(detail.contains("in flight per peer"), "{detail}");
        }
        r => panic!("expected InvalidOp, got {r:?}"),
    }
    // Nothing was sent, the session is intact, and a batch at the limit goes through.
    assert_eq!(pre.stats().await.unwrap().established, 1);
    pre.write(&peer, &three[..2]).await.unwrap();
    pre.read(&peer, &three[..2]).await.unwrap();
    assert_eq!(pre.stats().await.unwrap().bytes_in_flight, 0);
}

/// A listener spoken by hand: accepts one session from a kvbridge initiator and grants it
/// `region` (4 pages). Returns (control, data).
async fn raw_listener_session(l: &TcpListener, region: RegionId) -> (TcpStream, TcpStream) {
    let (mut ctl, _) = l.accept().await.unwrap();
    let Some(Message::Hello(h)) = recv_frame(&mut ctl).await else {
        panic!("no hello")
    };
    send_frame(
        &mut ctl,
        &Message::Welcome(Welcome {
            version: 1,
            peer_id: PeerId::new("raw-decoder").unwrap(),
            incarnation: Incarnation(7),
            token: SessionToken([9; 16]),
            compat: h.compat,
            auth: None,
            shm: None,
            unacked_notify: false,
            host_after_proof: false,
            data_proof: false,
            ucx: false,
            grant_tokens: false,
        }),
    )
    .await;
    assert!(matches!(
        recv_frame(&mut ctl).await,
        Some(Message::MemInfo(_))
    ));
    let (mut data, _) = l.accept().await.unwrap();
    assert!(matches!(
        recv_frame(&mut data).await,
        Some(Message::DataHello(_))
    ));
    let regions = vec![RegionInfo {
        id: region,
        len: 4 * PAGE as u64,
        page_size: PAGE as u64,
        kind: MemKind::Cpu,
    }];
    send_frame(&mut ctl, &Message::MemInfo(MemInfo { regions })).await;
    send_frame(&mut ctl, &Message::Ready(Ready {})).await;
    (ctl, data)
}

/// Reads one write batch and its payload off the data connection; returns its id.
async fn recv_write(data: &mut TcpStream) -> u64 {
    let Some(Message::WriteBatch(b)) = recv_frame(data).await else {
        panic!("expected a write batch")
    };
    let mut payload = vec![0u8; b.payload_len().unwrap() as usize];
    data.read_exact(&mut payload).await.unwrap();
    b.id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_batches_wait_for_room_and_are_sent_once_a_completion_makes_it() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap().to_string();
    let (pre, src) = initiator(
        "prefill-0",
        |c| {
            c.limits.max_bytes_in_flight_per_peer = PAGE as u64;
            c.transport = Transport::Tcp;
        },
        2 * PAGE,
        PAGE,
    )
    .await;
    let remote = RegionId([3; 16]);
    let (peer, (_ctl, mut data)) = tokio::join!(
        async { pre.connect(&at).await.unwrap() },
        raw_listener_session(&l, remote)
    );
    let write = |page: usize| {
        let (pre, src, peer) = (pre.clone(), src.clone(), peer.clone());
        tokio::spawn(async move {
            pre.write(&peer, &[Op::page(&src, page, remote, page as u64, PAGE)])
                .await
        })
    };
    // A: sent, and left unanswered.
    let a = write(0);
    let a_id = recv_write(&mut data).await;
    // B: no room until A completes.
    let b = write(1);
    let t = std::time::Instant::now();
    while pre.stats().await.unwrap().batches_waiting_for_room == 0
        && t.elapsed() < Duration::from_secs(5)
    {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let s = pre.stats().await.unwrap();
    assert_eq!(
        (
            s.batches_waiting_for_room,
            s.batches_in_flight,
            s.bytes_in_flight
        ),
        (1, 1, PAGE as u64),
        "{s:?}"
    );
    // B is waiting, so not a byte of it is on the data connection.
    let mut probe = [0u8; 1];
    assert_eq!(
        data.try_read(&mut probe).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "a batch was sent past the limit"
    );
    // A's completion makes room: B goes out, and both writes succeed.
    let ack = |id| Message::WriteAck(Ack { id, error: None });
    send_frame(&mut data, &ack(a_id)).await;
    a.await.unwrap().unwrap();
    let b_id = recv_write(&mut data).await;
    send_frame(&mut data, &ack(b_id)).await;
    b.await.unwrap().unwrap();
    let s = pre.stats().await.unwrap();
    assert_eq!((s.batches_waiting_for_room, s.bytes_in_flight), (0, 0));
}

/// Waits (at most 5 s) until `ch` holds no session.
async fn wait_no_session(ch: &kvbridge::Channel) {
    let t = std::time::Instant::now();
    while ch.stats().await.unwrap().sessions > 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(ch.stats().await.unwrap().sessions, 0, "session kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_write_past_our_limit_is_refused_and_counted() {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.limits.max_bytes_in_flight_per_peer = 2 * PAGE as u64,
        4 * PAGE,
        PAGE,
    )
    .await;
    let (_ctl, mut data) = handshake(&addr(&dec)).await;
    let batch = Message::WriteBatch(Batch {
        id: 1,
        ops: vec![OpDesc {
            region: kv.id(),
            offset: 0,
            len: 3 * PAGE as u64,
        }],
        grant: None,
    });
    send_frame(&mut data, &batch).await;
    let _ = data.write_all(&vec![0xAB; 3 * PAGE]).await;
    match recv_frame(&mut data).await {
        Some(Message::WriteAck(Ack {
            id: 1,
            error: Some(r),
        })) => {
            assert_eq!(r.code, ErrorCode::LimitExceeded);
            assert!(
                r.message.contains("bytes in flight per peer"),
                "{}",
                r.message
            );
        }
        m => panic!("expected an error ack, got {m:?}"),
    }
    // Counted before the refusal went out; the session ends and nothing landed.
    assert_eq!(dec.stats().await.unwrap().in_flight_refused, 1);
    wait_no_session(&dec).await;
    let mut all = vec![0u8; kv.len()];
    kv.read_at(0, &mut all).unwrap();
    assert!(all.iter().all(|&b| b == 0), "bytes landed in the region");
    assert_eq!(kv.in_use(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_piles_up_reads_it_does_not_take_is_refused_and_counted() {
    // Each read is larger than any socket buffer on loopback, so the first response stays
    // in flight while the peer does not read it; the second read would pass the limit.
    const READ: usize = 64 << 20;
    let (dec, kv) = listener(
        "decode-0",
        |c| c.limits.max_bytes_in_flight_per_peer = 100 << 20,
        2 * READ,
        PAGE,
    )
    .await;
    let (_ctl, mut data) = handshake(&addr(&dec)).await;
    for (id, offset) in [(1, 0), (2, READ as u64)] {
        let read = Message::ReadBatch(Batch {
            id,
            ops: vec![OpDesc {
                region: kv.id(),
                offset,
                len: READ as u64,
            }],
            grant: None,
        });
        send_frame(&mut data, &read).await;
    }
    // Now take what comes until the listener closes the connection.
    let mut sink = vec![0u8; 1 << 20];
    let drained = tokio::time::timeout(Duration::from_secs(10), async {
        while matches!(data.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
    assert!(drained.is_ok(), "the listener neither refused nor closed");
    assert_eq!(dec.stats().await.unwrap().in_flight_refused, 1);
    wait_no_session(&dec).await;
    assert_eq!(kv.in_use(), 0);
}
