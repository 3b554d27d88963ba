//! Small frames (notifications, acknowledgements) skip an idle data connection's writer:
//! the task or thread that issues one writes it to the socket itself. They still never pass
//! anything queued or being written before them.

mod common;
use common::*;
use kvbridge::{Op, Transport};
use std::time::Duration;

const LEN: usize = 64 << 20;

/// On data threads, a notification on an idle connection and the peer's acknowledgement
/// of it are both written by their issuers.
async fn notifications_and_their_acks_skip_idle_writers(t: Carrier) {
    let (dec, _kv) = listener("decode-0", |c| t.apply(c), 1 << 20, 4096).await;
    let (pre, _src) = initiator("prefill-0", |c| t.apply(c), 1 << 20, 4096).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    for i in 0..4u8 {
        pre.notify(&peer, &[i]).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), dec.recv_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.data, [i]);
    }
    let (ps, ds) = (pre.stats().await.unwrap(), dec.stats().await.unwrap());
    assert!(
        ps.frames_direct >= 1,
        "no notification skipped the writer: {ps:?}"
    );
    assert!(
        ds.frames_direct >= 1,
        "no acknowledgement skipped the writer: {ds:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_and_their_acks_skip_idle_writers_tcp() {
    notifications_and_their_acks_skip_idle_writers(Transport::Tcp.into()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_and_their_acks_skip_idle_writers_shm() {
    notifications_and_their_acks_skip_idle_writers(Transport::Shm.into()).await
}

/// A notification issued while a large TCP write is on its way out (its payload held by
/// the writer) must wait for it: it reaches the peer only after the write's last byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_issued_during_a_tcp_write_follows_it() {
    let t: Carrier = Transport::Tcp.into();
    let (dec, kv) = listener("decode-0", |c| t.apply(c), LEN, LEN).await;
    let (pre, src) = initiator("prefill-0", |c| t.apply(c), LEN, LEN).await;
    fill(&src, 13);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    let write = tokio::spawn({
        let (pre, src, peer, kv) = (pre.clone(), src.clone(), peer.clone(), kv.id());
        async move { pre.write(&peer, &[Op::page(&src, 0, kv, 0, LEN)]).await }
    });
    wait_in_flight(&pre).await;
    let queued = pre.notify_queued(&peer, b"after").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), dec.recv_notification())
        .await
        .expect("no notification")
        .unwrap();
    assert_eq!(n.data, b"after");
    let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
    src.read_at(LEN - 4096, &mut a).unwrap();
    kv.read_at(LEN - 4096, &mut b).unwrap();
    assert!(
        a == b,
        "the notification arrived before the write it followed had landed"
    );
    write.await.unwrap().unwrap();
    queued.delivered().await.unwrap();
}
