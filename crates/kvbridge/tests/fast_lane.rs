//! Small frames (notifications, acknowledgements) skip an idle data connection's writer:
//! the task or thread that issues one writes it to the socket itself. That they never pass
//! a payload being written is `direct_copy.rs`'s TCP case; the order rule itself is unit
//! tested in `writer_queue.rs`.

mod common;
use common::*;
use kvbridge::Transport;
use std::time::Duration;

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
        ps.frames_fast_lane >= 1,
        "no notification skipped the writer: {ps:?}"
    );
    assert!(
        ds.frames_fast_lane >= 1,
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
