//! Several TCP data connections per session (`ChannelConfig::data_connections`): a batch is
//! split by bytes over them; losing one fails the batch and ends the session; notifications
//! still follow the writes before them; a stranger cannot add a connection, nor can the
//! session's own peer add one that is not allowed.

mod common;
use common::*;
use kvbridge::proto::msg::{DataHello, ErrorCode, Message};
use kvbridge::proto::{PeerId, SessionToken};
use kvbridge::{Op, PeerEvent, Region, Transport};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MIB: usize = 1 << 20;

fn striped(n: usize) -> impl Fn(&mut kvbridge::ChannelConfig) + Copy {
    move |c| {
        c.transport = Transport::Tcp;
        c.data_connections = n;
    }
}

fn bytes(r: &Region, off: usize, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    r.read_at(off, &mut b).unwrap();
    b
}

/// One 24 MiB op and a few odd-sized ones in one batch (the split cuts ops), written and
/// read back byte-exact over 3 connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_batch_over_three_connections_is_byte_exact() {
    let (dec, kv) = listener("decode-0", striped(3), 64 * MIB, 4096).await;
    let (pre, src) = initiator("prefill-0", striped(3), 32 * MIB, 4096).await;
    fill(&src, 7);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let ops = vec![
        Op {
            local: src.clone(),
            local_offset: 0,
            remote: kv.id(),
            remote_offset: 40 * MIB as u64,
            len: 24 * MIB,
        },
        Op {
            local: src.clone(),
            local_offset: 24 * MIB,
            remote: kv.id(),
            remote_offset: 3,
            len: 5 * MIB + 13,
        },
        Op {
            local: src.clone(),
            local_offset: 30 * MIB,
            remote: kv.id(),
            remote_offset: 20 * MIB as u64,
            len: 777,
        },
    ];
    pre.write(&peer, &ops).await.unwrap();
    assert!(bytes(&src, 0, 24 * MIB) == bytes(&kv, 40 * MIB, 24 * MIB));
    assert!(bytes(&src, 24 * MIB, 5 * MIB + 13) == bytes(&kv, 3, 5 * MIB + 13));
    assert!(bytes(&src, 30 * MIB, 777) == bytes(&kv, 20 * MIB, 777));

    let back = Region::alloc(32 * MIB, 4096).unwrap();
    pre.register(&back, kvbridge::Grant::AllPeers).unwrap();
    let rops: Vec<Op> = ops
        .iter()
        .map(|o| Op {
            local: back.clone(),
            ..o.clone()
        })
        .collect();
    pre.read(&peer, &rops).await.unwrap();
    for o in &ops {
        assert!(bytes(&src, o.local_offset, o.len) == bytes(&back, o.local_offset, o.len));
    }
    assert_eq!(pre.stats().await.unwrap().batches_in_flight, 0);
}

/// A notification issued while a striped write is in flight arrives after all of it. Data
/// connection 1 is held back by a gated relay after its first MiB: were the notification
/// sent before that part completed, it would arrive while the gate is still shut (the test
/// looks for it for a moment before opening the gate; correct code passes either way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_after_striped_writes_arrives_after_the_data() {
    let (dec, kv) = listener("decode-0", striped(3), 64 * MIB, 4096).await;
    let (pre, src) = initiator("prefill-0", striped(3), 48 * MIB, 4096).await;
    fill(&src, 9);
    let (gate, gate_rx) = tokio::sync::watch::channel(false);
    let via = relay_with(addr(&dec), 2, MIB, Hold::Until(gate_rx)).await;
    let peer = pre.connect(&via).await.unwrap();
    let ops = vec![Op {
        local: src.clone(),
        local_offset: 0,
        remote: kv.id(),
        remote_offset: 0,
        len: 48 * MIB,
    }];
    let (p2, peer2) = (pre.clone(), peer.clone());
    let write = tokio::spawn(async move { p2.write(&peer2, &ops).await });
    wait_in_flight(&pre).await;
    let (p3, peer3) = (pre.clone(), peer.clone());
    let notify = tokio::spawn(async move { p3.notify(&peer3, b"done").await });
    if let Ok(n) = tokio::time::timeout(Duration::from_millis(300), dec.recv_notification()).await {
        panic!("notification {n:?} arrived while part of the write was held back");
    }
    gate.send(true).unwrap();
    let n = tokio::time::timeout(Duration::from_secs(30), dec.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.data, b"done");
    // The notification's arrival means every byte of the write is in place.
    assert!(bytes(&src, 0, 48 * MIB) == bytes(&kv, 0, 48 * MIB));
    write.await.unwrap().unwrap();
    notify.await.unwrap().unwrap();
}

/// What the relay does to its victim connection after `after` bytes from the client.
enum Hold {
    /// Cuts it.
    Cut,
    /// Holds its client-to-server bytes until the flag is set.
    Until(tokio::sync::watch::Receiver<bool>),
}

async fn relay(target: String, victim: usize, cut_after: usize) -> String {
    relay_with(target, victim, cut_after, Hold::Cut).await
}

/// Forwards connections to `target`; the `victim`-th connection (0 = control, 1 = data
/// connection 0, ...) is cut or held once `cut_after` bytes went from client to server.
async fn relay_with(target: String, victim: usize, cut_after: usize, hold: Hold) -> String {
    let hold = Arc::new(std::sync::Mutex::new(Some(hold)));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap().to_string();
    let count = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        loop {
            let Ok((c, _)) = l.accept().await else { return };
            let i = count.fetch_add(1, Ordering::Relaxed);
            let s = TcpStream::connect(&target).await.unwrap();
            let mut hold = if i == victim {
                hold.lock().unwrap().take()
            } else {
                None
            };
            tokio::spawn(async move {
                let (mut cr, mut cw) = c.into_split();
                let (mut sr, mut sw) = s.into_split();
                let up = async {
                    let mut buf = vec![0u8; 64 << 10];
                    let mut sent = 0usize;
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let first = if hold.is_some() {
                            n.min(cut_after - sent)
                        } else {
                            n
                        };
                        if sw.write_all(&buf[..first]).await.is_err() {
                            return;
                        }
                        sent += first;
                        if hold.is_some() && sent >= cut_after {
                            match hold.take() {
                                Some(Hold::Until(mut open)) => {
                                    let _ = open.wait_for(|o| *o).await;
                                }
                                _ => return,
                            }
                        }
                        if sw.write_all(&buf[first..n]).await.is_err() {
                            return;
                        }
                        sent += n - first;
                    }
                };
                let down = tokio::io::copy(&mut sr, &mut cw);
                tokio::select! {
                    _ = up => {}
                    _ = down => {}
                }
                // Dropping all four halves closes both sockets.
            });
        }
    });
    a
}

/// Data connection 1 of 3 dies 2 MiB into its part of a 48 MiB write: the write fails with a
/// typed error naming the peer, the session ends on both sides, and once the listener
/// reports it down, nothing of the batch lands any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_one_connection_fails_the_batch_and_ends_the_session() {
    let (dec, kv) = listener("decode-0", striped(3), 64 * MIB, 4096).await;
    let (pre, src) = initiator("prefill-0", striped(3), 48 * MIB, 4096).await;
    fill(&src, 11);
    let mut events = dec.peer_events();
    // Connection 2 is data connection 1 (0 is control, 1 is data connection 0).
    let via = relay(addr(&dec), 2, 2 * MIB).await;
    let peer = pre.connect(&via).await.unwrap();
    let ops = vec![Op {
        local: src.clone(),
        local_offset: 0,
        remote: kv.id(),
        remote_offset: 0,
        len: 48 * MIB,
    }];
    let err = pre.write(&peer, &ops).await.unwrap_err();
    assert!(
        matches!(
            err,
            kvbridge::Error::ConnectionLost { .. }
                | kvbridge::Error::Rejected { .. }
                | kvbridge::Error::PeerClosed { .. }
                | kvbridge::Error::Timeout { .. }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("decode-0"), "{err}");
    // The session is gone on our side: nothing of it is left.
    assert!(pre.peer_transport(&peer).await.is_err());
    assert_eq!(pre.stats().await.unwrap().batches_in_flight, 0);
    // And on the listener's: after Down, no byte of that session can land.
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("listener never saw the session end")
            .unwrap()
        {
            PeerEvent::Down { .. } => break,
            _ => continue,
        }
    }
    let after_down = bytes(&kv, 0, 48 * MIB);
    // A fresh session still works, and the region did not change meanwhile.
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    pre.notify(&peer, b"x").await.unwrap();
    assert!(after_down == bytes(&kv, 0, 48 * MIB));
}

/// A data connection with a token no session holds, claiming to be an extra stream, is
/// refused; the established striped session is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_token_extra_data_connection_is_refused() {
    let (dec, kv) = listener("decode-0", striped(3), 4 * MIB, 4096).await;
    let (pre, src) = initiator("prefill-0", striped(3), 4 * MIB, 4096).await;
    fill(&src, 5);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    for stream in [1u32, 2, 3, 1000] {
        let mut s = TcpStream::connect(addr(&dec)).await.unwrap();
        send_frame(
            &mut s,
            &Message::DataHello(DataHello {
                token: SessionToken([0xAB; 16]),
                peer_id: PeerId::new("prefill-0").unwrap(),
                stream,
            }),
        )
        .await;
        match recv_frame(&mut s).await {
            Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::UnknownSession),
            other => panic!("stream {stream}: expected a refusal, got {other:?}"),
        }
    }
    let ops = vec![Op {
        local: src.clone(),
        local_offset: 0,
        remote: kv.id(),
        remote_offset: 0,
        len: 4 * MIB,
    }];
    pre.write(&peer, &ops).await.unwrap();
    assert!(bytes(&src, 0, 4 * MIB) == bytes(&kv, 0, 4 * MIB));
}

fn data_hello(token: SessionToken, name: &str, stream: u32) -> Message {
    Message::DataHello(DataHello {
        token,
        peer_id: PeerId::new(name).unwrap(),
        stream,
    })
}

/// Opens a data connection with `hello`; returns the listener's answer: `Some(Reject)`, or
/// `None` when it kept the connection (nothing within 300 ms) — then the connection too.
async fn extra(target: &str, hello: &Message) -> (Option<Message>, TcpStream) {
    let mut s = TcpStream::connect(target).await.unwrap();
    send_frame(&mut s, hello).await;
    let mut h = [0u8; 8];
    match tokio::time::timeout(Duration::from_millis(300), s.peek(&mut h)).await {
        Err(_) => (None, s),
        Ok(_) => (recv_frame(&mut s).await, s),
    }
}

/// Extra data connections that prove the right token but are not allowed: an index of 16
/// or more, an index already bound (0 or an extra one), another peer's id. Each is refused
/// with `Reject{UnknownSession}` and serves nothing; the session goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_token_extra_connections_that_are_not_allowed_are_refused() {
    let (dec, kv) = listener("decode-0", striped(3), 4 * MIB, 4096).await;
    let target = addr(&dec);
    let (mut ctl, _data, token) = handshake_as(&target, "by-hand").await;
    // Stream 1 is allowed: kept, not refused.
    let (answer, _one) = extra(&target, &data_hello(token, "by-hand", 1)).await;
    assert!(answer.is_none(), "stream 1 refused: {answer:?}");
    let refused = [
        data_hello(token, "by-hand", 16),
        data_hello(token, "by-hand", u32::MAX),
        data_hello(token, "by-hand", 0),
        data_hello(token, "by-hand", 1),
        data_hello(token, "someone-else", 2),
    ];
    for h in &refused {
        let (answer, mut s) = extra(&target, h).await;
        match answer {
            Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::UnknownSession, "{h:?}"),
            other => panic!("{h:?}: expected a refusal, got {other:?}"),
        }
        // Whatever comes after the refusal lands nowhere.
        let batch = Message::WriteBatch(kvbridge::proto::msg::Batch {
            id: 7,
            ops: vec![kvbridge::proto::msg::OpDesc {
                region: kv.id(),
                offset: 0,
                len: 4096,
            }],
            grant: None,
        });
        let _ = s.write_all(&batch.to_frame().unwrap()).await;
        let _ = s.write_all(&[0xEE; 4096]).await;
    }
    // The session is unaffected: it still answers on its control connection (a MemInfo
    // when a region is registered), and nothing was written.
    let r = Region::alloc(4096, 4096).unwrap();
    dec.register(&r, kvbridge::Grant::AllPeers).unwrap();
    assert!(matches!(
        recv_frame(&mut ctl).await,
        Some(Message::MemInfo(_))
    ));
    assert_eq!(dec.stats().await.unwrap().established, 1);
    assert!(
        bytes(&kv, 0, 4096).iter().all(|&b| b == 0),
        "a refused connection wrote"
    );
}

/// An extra data connection that arrives while its session is tearing down (it proves a
/// token that the listener still knows) gets a typed refusal, not a silent close. The
/// session is held in its teardown by a peer that does not close its shared-memory
/// connection (the listener waits the close deadline for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extra_connection_to_a_session_tearing_down_is_refused() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| c.deadlines.close = Duration::from_secs(3),
        MIB,
        4096,
    )
    .await;
    let target = addr(&dec);
    let (mut ctl, w) = hello(&target, "by-hand").await;
    let mut data = TcpStream::connect(&target).await.unwrap();
    send_frame(&mut data, &data_hello(w.token, "by-hand", 0)).await;
    let offer = w
        .shm
        .clone()
        .expect("a listener on this host offers shared memory");
    let shm = {
        use std::os::linux::net::SocketAddrExt;
        let a =
            std::os::unix::net::SocketAddr::from_abstract_name(offer.socket.as_bytes()).unwrap();
        let s = std::os::unix::net::UnixStream::connect_addr(&a).unwrap();
        s.set_nonblocking(true).unwrap();
        let mut s = tokio::net::UnixStream::from_std(s).unwrap();
        s.write_all(&data_hello(w.token, "by-hand", 0).to_frame().unwrap())
            .await
            .unwrap();
        s
    };
    until_ready(&mut ctl).await;
    tokio::time::timeout(Duration::from_secs(5), shm.readable())
        .await
        .expect("the listener maps its region for us")
        .unwrap();

    // The listener ends the session; its Bye says the teardown has begun.
    let peer = PeerId::new("by-hand").unwrap();
    let d = {
        let dec = dec.clone();
        tokio::spawn(async move { dec.disconnect(&peer, "test").await })
    };
    loop {
        match recv_frame(&mut ctl).await {
            Some(Message::Bye(_)) => break,
            Some(_) => continue,
            None => panic!("no Bye"),
        }
    }
    for stream in [1u32, 0] {
        let t = std::time::Instant::now();
        let (answer, _s) = extra(&target, &data_hello(w.token, "by-hand", stream)).await;
        match answer {
            Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::UnknownSession),
            other => panic!(
                "stream {stream}: expected a refusal, got {other:?} after {:?}",
                t.elapsed()
            ),
        }
    }
    // (`disconnect` itself may report a timeout: the teardown waits the whole close
    // deadline for this peer's shared-memory close.)
    let _ = d.await.unwrap();
    drop(shm);
}
