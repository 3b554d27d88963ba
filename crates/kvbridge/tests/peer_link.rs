//! A `PeerLink` is one session: its calls skip the channel's lookup, and once the session
//! ends they fail typed, also after the peer reconnected (a new session is a new link), so
//! nothing meant for one session lands in the next.

mod common;
use common::*;
use kvbridge::{Op, Transport};
use std::time::Duration;

const PAGE: usize = 16 << 10;

async fn a_link_is_bound_to_its_session(t: Carrier) {
    let (dec, kv) = listener("decode-0", |c| t.apply(c), 8 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", |c| t.apply(c), 8 * PAGE, PAGE).await;
    fill(&src, 3);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    let link = pre.link(&peer).await.unwrap();
    assert_eq!(link.peer(), &peer);

    // Writes and notifications through the link behave as the channel's.
    link.write(&[Op::page(&src, 1, kv.id(), 5, PAGE)])
        .await
        .unwrap();
    link.notify(b"one").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), dec.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.data, b"one");
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    src.read_at(PAGE, &mut a).unwrap();
    kv.read_at(5 * PAGE, &mut b).unwrap();
    assert!(a == b, "the linked write did not land");
    let mut back = vec![0u8; PAGE];
    let dst = src.clone();
    link.read(&[Op::page(&dst, 7, kv.id(), 5, PAGE)])
        .await
        .unwrap();
    dst.read_at(7 * PAGE, &mut back).unwrap();
    assert!(back == a, "the linked read did not return the page");

    // The session ends, and the peer is reached again on a new one.
    pre.disconnect(&peer, "test").await.unwrap();
    let again = pre.connect(&addr(&dec)).await.unwrap();
    assert_eq!(again, peer);
    for r in [
        link.write(&[Op::page(&src, 2, kv.id(), 6, PAGE)]).await,
        link.notify(b"stale").await,
    ] {
        let e = r.expect_err("a link outlived its session");
        assert!(e.to_string().contains("decode-0"), "untyped: {e}");
    }
    // Nothing of the stale link reached the new session.
    kv.read_at(6 * PAGE, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0), "a stale link's write landed");
    let fresh = pre.link(&peer).await.unwrap();
    fresh.notify(b"two").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), dec.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.data, b"two", "the stale notification arrived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_is_bound_to_its_session_tcp() {
    a_link_is_bound_to_its_session(Transport::Tcp.into()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_is_bound_to_its_session_shm() {
    a_link_is_bound_to_its_session(Transport::Shm.into()).await
}
