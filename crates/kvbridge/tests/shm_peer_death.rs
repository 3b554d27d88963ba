//! A peer that dies with shared-memory frames of ours unread resets its end of the unix
//! socket instead of closing it cleanly. Dying unmapped everything it had, so the listener
//! must take the reset as the peer's word, as it takes a clean close. It used to detach the
//! region instead, and a detached region is cut loose from its memfd: every *other* peer's
//! mapping then pointed at memory the listener no longer read, and their writes, acknowledged,
//! landed nowhere (zeros where a decoder expected KV).

mod common;
use common::*;
use kvbridge::proto::msg::*;
use kvbridge::proto::PeerId;
use kvbridge::{Op, Transport};
use std::time::{Duration, Instant};

const PAGE: usize = 4096;

/// Handshakes by hand, connects the offered shared-memory socket and proves the token, then
/// waits until the listener's `ShmMap` frames wait unread on it. Returns every connection,
/// to be dropped at once like a killed process's.
async fn hostile_peer_with_unread_shm_frames(
    target: &str,
) -> (
    tokio::net::TcpStream,
    tokio::net::TcpStream,
    tokio::net::UnixStream,
) {
    let (ctl, w) = hello(target, "dies-unread").await;
    let me = PeerId::new("dies-unread").unwrap();
    let offer = w
        .shm
        .clone()
        .expect("a listener on this host offers shared memory");
    let mut data = tokio::net::TcpStream::connect(target).await.unwrap();
    let hello = Message::DataHello(DataHello {
        token: w.token,
        peer_id: me,
        stream: 0,
    });
    send_frame(&mut data, &hello).await;
    let addr = {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(offer.socket.as_bytes()).unwrap()
    };
    let s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut s = tokio::net::UnixStream::from_std(s).unwrap();
    {
        use tokio::io::AsyncWriteExt;
        s.write_all(&hello.to_frame().unwrap()).await.unwrap();
    }
    // The listener maps its region for us once the token is proven: wait (with a deadline)
    // until its frames are here, without reading them.
    tokio::time::timeout(Duration::from_secs(5), s.readable())
        .await
        .expect("the listener sends its ShmMap")
        .unwrap();
    (ctl, data, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_dying_with_shm_frames_unread_does_not_cut_other_peers_loose() {
    let (dec, kv) = listener("decode-0", |_| {}, 16 * PAGE, PAGE).await;
    // A well-behaved prefiller maps the region first.
    let (pre, src) = initiator("prefill-0", |_| {}, 16 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, Transport::Shm).await;

    // Another peer dies with the listener's frames unread: its end resets.
    let conns = hostile_peer_with_unread_shm_frames(&addr(&dec)).await;
    drop(conns);
    // The listener forgets it and is left with the one export of the live prefiller.
    let until = Instant::now() + Duration::from_secs(10);
    while kv.exports() != 1 {
        assert!(Instant::now() < until, "exports {}", kv.exports());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // The live prefiller's writes still land where the listener reads.
    fill(&src, 0x5eed);
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 3, 4 * PAGE)])
        .await
        .unwrap();
    let (mut want, mut got) = (vec![0u8; 4 * PAGE], vec![0u8; 4 * PAGE]);
    src.read_at(0, &mut want).unwrap();
    kv.read_at(12 * PAGE, &mut got).unwrap();
    assert!(
        got == want,
        "the write landed outside the listener's memory"
    );
}
