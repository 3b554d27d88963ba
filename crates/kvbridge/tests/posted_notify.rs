//! Notifications posted with no acknowledgement (`Channel::notify_posted`): delivered in
//! order behind the writes before them, never acknowledged by a peer that honours them, and
//! sent as ordinary notifications to a peer that predates them (whose acknowledgement is
//! then taken without complaint).

mod common;
use common::*;
use kvbridge::proto::ids::Blob;
use kvbridge::proto::msg::{Ack, Message, Notify};
use kvbridge::proto::PeerId;
use kvbridge::{Op, Transport};
use std::time::Duration;

const PAGE: usize = 16 << 10;

async fn next_notification(ch: &kvbridge::Channel) -> kvbridge::Notification {
    tokio::time::timeout(Duration::from_secs(5), ch.recv_notification())
        .await
        .expect("a posted notification arrives")
        .expect("the channel is open")
}

/// Each posted note follows its write (the page has landed when the note arrives), the
/// receiver sends no acknowledgement at all, and once the session ended a post fails typed.
async fn posted_notes_follow_their_writes_unacknowledged(t: Carrier) {
    let (dec, kv) = listener("decode-0", |c| t.apply(c), 8 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", |c| t.apply(c), 8 * PAGE, PAGE).await;
    fill(&src, 5);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    let link = pre.link(&peer).await.unwrap();
    for i in 0..8usize {
        link.write(&[Op::page(&src, i, kv.id(), 7 - i as u64, PAGE)])
            .await
            .unwrap();
        link.notify_posted(&[i as u8]).await.unwrap();
    }
    for i in 0..8usize {
        let n = next_notification(&dec).await;
        assert_eq!(n.data, [i as u8], "posted notes out of order");
        let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
        src.read_at(i * PAGE, &mut a).unwrap();
        kv.read_at((7 - i) * PAGE, &mut b).unwrap();
        assert!(a == b, "note {i} arrived before its write landed");
    }
    // An acknowledged notification after them still gets its acknowledgement, so the
    // session is intact: had the receiver acknowledged the posted notes, this side would
    // have met acknowledgements of batches it never entered, called the peer misbehaving,
    // and ended the session. (Which frames the receiver sent is `an_unacked_notify_...`
    // below, on the wire.)
    link.notify(b"acked").await.unwrap();
    assert_eq!(next_notification(&dec).await.data, b"acked");

    pre.disconnect(&peer, "test").await.unwrap();
    let e = link
        .notify_posted(b"stale")
        .await
        .expect_err("a post on an ended session succeeded");
    assert!(e.to_string().contains("decode-0"), "untyped: {e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posted_notes_follow_their_writes_unacknowledged_tcp() {
    posted_notes_follow_their_writes_unacknowledged(Transport::Tcp.into()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn posted_notes_follow_their_writes_unacknowledged_shm() {
    posted_notes_follow_their_writes_unacknowledged(Transport::Shm.into()).await
}

/// A peer sends an unacknowledged notification, then an ordinary one: both are delivered
/// in order, and the only acknowledgement on the wire is the second one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacked_notify_from_a_peer_gets_no_ack() {
    let (dec, _kv) = listener("decode-0", |_| {}, 4 * PAGE, PAGE).await;
    let (_ctl, mut data, _) = handshake_saying(&addr(&dec), "by-hand", true).await;
    for (id, unacked) in [(1, true), (2, false)] {
        let m = Message::Notify(Notify {
            id,
            data: Blob(vec![id as u8]),
            unacked,
        });
        send_frame(&mut data, &m).await;
    }
    assert_eq!(next_notification(&dec).await.data, [1]);
    assert_eq!(next_notification(&dec).await.data, [2]);
    match recv_frame(&mut data).await {
        Some(Message::NotifyAck(Ack { id: 2, error: None })) => {}
        other => panic!("expected only the second note's acknowledgement, got {other:?}"),
    }
}

/// To a peer whose `Hello` did not say it honours them, a post is an ordinary notification,
/// and that peer's acknowledgement of it does not end the session; to one that did, it is
/// marked unacknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_to_an_older_peer_is_an_ordinary_notify() {
    let (dec, _kv) = listener("decode-0", |_| {}, 4 * PAGE, PAGE).await;
    for (name, honours) in [("older", false), ("newer", true)] {
        let (_ctl, mut data, _) = handshake_saying(&addr(&dec), name, honours).await;
        let peer = PeerId::new(name).unwrap();
        dec.notify_posted(&peer, b"one").await.unwrap();
        let Some(Message::Notify(n)) = recv_frame(&mut data).await else {
            panic!("no notification reached {name}")
        };
        assert_eq!(n.data.0, b"one");
        assert_eq!(n.unacked, honours, "{name}: {n:?}");
        if !honours {
            let ack = Message::NotifyAck(Ack {
                id: n.id,
                error: None,
            });
            send_frame(&mut data, &ack).await;
        }
        // The session is still up: an ordinary notification goes through and is confirmed.
        let dec2 = dec.clone();
        let p2 = peer.clone();
        let confirmed = tokio::spawn(async move { dec2.notify(&p2, b"two").await });
        let Some(Message::Notify(n)) = recv_frame(&mut data).await else {
            panic!("{name}'s session ended after the post")
        };
        assert!(!n.unacked);
        send_frame(
            &mut data,
            &Message::NotifyAck(Ack {
                id: n.id,
                error: None,
            }),
        )
        .await;
        confirmed.await.unwrap().unwrap();
    }
}
