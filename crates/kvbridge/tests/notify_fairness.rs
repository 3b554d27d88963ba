//! A peer that holds the shared secret floods notifications while another peer sends a few:
//! the flood waits in its own bounded queue, the honest peer's notifications still get room,
//! the application's receives take from the two in turn, and the bytes queued never pass the
//! channel's cap (`Limits::max_notify_bytes_queued`).
//!
//! The assertions count receives, never time: each phase waits for a state the channel's
//! stats show (the flood paused, the honest notes queued) before the next receive.

mod common;
use common::*;
use kvbridge::proto::auth::Secret;
use kvbridge::{Channel, Stats};
use std::time::{Duration, Instant};

const SECRET: &str = "the-cluster-secret-both-peers-hold";
const FLOOD_NOTE: usize = 64 << 10;
const CAP: u64 = 1 << 20;
/// Flood notes that fill the smaller of the two caps.
const FLOOD_QUEUED: usize = (CAP / FLOOD_NOTE as u64) as usize;
const HONEST_NOTES: usize = 5;

fn secret() -> Option<Secret> {
    Secret::new(SECRET.as_bytes().to_vec())
}

/// Waits (at most 10 s) until the channel's stats satisfy `cond`.
async fn until_stats(ch: &Channel, what: &str, cond: impl Fn(&Stats) -> bool) -> Stats {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let s = ch.stats().await.unwrap();
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < until, "never {what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn recv(ch: &Channel) -> kvbridge::Notification {
    tokio::time::timeout(Duration::from_secs(10), ch.recv_notification())
        .await
        .expect("no notification within 10 s")
        .expect("the channel closed")
}

/// `per_peer` and `total`: the channel's caps on one peer's and on all queued bytes. With
/// the total the smaller, the flood alone fills it and waits for room in it beside the
/// honest peer, which must be given the first room a receive frees; with the peer's cap the
/// smaller, the flood fills only its own queue.
async fn a_flood_leaves_the_honest_peer_its_turns(per_peer: u64, total: u64) {
    let (dec, _kv) = listener(
        "decode-0",
        |c| {
            c.secret = secret();
            c.limits.max_notify_len = FLOOD_NOTE;
            c.limits.max_notify_bytes_per_peer = per_peer;
            c.limits.max_notify_bytes_queued = total;
        },
        4096,
        4096,
    )
    .await;
    let (flood, _) = initiator("flood", |c| c.secret = secret(), 4096, 4096).await;
    let (honest, _) = initiator("honest", |c| c.secret = secret(), 4096, 4096).await;
    let flooded = flood
        .link(&flood.connect(&addr(&dec)).await.unwrap())
        .await
        .unwrap();
    let honest_link = honest
        .link(&honest.connect(&addr(&dec)).await.unwrap())
        .await
        .unwrap();

    // The attacker: posted notes of the largest size, as fast as its sockets take them.
    let flooders: Vec<_> = (0..4)
        .map(|_| {
            let l = flooded.clone();
            let note = vec![0xF1; FLOOD_NOTE];
            tokio::spawn(async move { while l.notify_posted(&note).await.is_ok() {} })
        })
        .collect();
    // Its queue full, its connection paused.
    until_stats(&dec, "the flood filled its queue", |s| {
        s.notifications_queued == FLOOD_QUEUED && s.notify_paused == 1
    })
    .await;

    let mut sent = Vec::new();
    for i in 0..HONEST_NOTES {
        sent.push(honest_link.notify_queued(&[i as u8; 10]).await.unwrap());
    }
    let mut taken = 0;
    if total < per_peer {
        // No room left at all: the honest reader waits too. One receive frees room, and it
        // goes to the honest peer (it holds nothing, the flood the whole total), which fits
        // all five of its notes into it where the flood's next does not fit.
        until_stats(&dec, "the honest peer waited for room", |s| {
            s.notify_paused == 2
        })
        .await;
        assert_eq!(recv(&dec).await.peer.as_str(), "flood");
        taken = 1;
    }
    for q in sent {
        tokio::time::timeout(Duration::from_secs(10), q.delivered())
            .await
            .expect("the honest peer is locked out by the flood")
            .expect("an honest notification failed");
    }
    until_stats(&dec, "the honest notes were queued", |s| {
        s.notifications_queued == FLOOD_QUEUED - taken + HONEST_NOTES
    })
    .await;

    // The peers take turns: every other receive is the honest peer's, in its order.
    let mut receives = 0;
    let mut next = 0u8;
    while usize::from(next) < HONEST_NOTES {
        let n = recv(&dec).await;
        receives += 1;
        if n.peer.as_str() == "honest" {
            assert_eq!(n.data, [next; 10], "honest notes out of order");
            next += 1;
            assert!(
                receives <= 2 * usize::from(next),
                "honest note {} came at receive {receives}: the flood went first",
                next - 1
            );
        }
    }
    let s = dec.stats().await.unwrap();
    assert!(s.notify_bytes_peak <= total, "{s:?}");
    assert!(s.notify_pauses >= 1, "{s:?}");
    for f in flooders {
        f.abort();
    }
    flood.close().await;
    honest.close().await;
    dec.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_that_fills_the_channel_leaves_the_honest_peer_its_turns() {
    a_flood_leaves_the_honest_peer_its_turns(2 * CAP, CAP).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_that_fills_its_own_queue_leaves_the_honest_peer_its_turns() {
    a_flood_leaves_the_honest_peer_its_turns(CAP, 2 * CAP).await
}

/// The bounds are checked when the channel is made: a notification of the largest size must
/// fit a queue.
#[tokio::test]
async fn queue_bounds_below_the_largest_notification_are_refused() {
    let mut c = kvbridge::ChannelConfig::new("decode-0", None);
    c.limits.max_notify_bytes_queued = c.limits.max_notify_len as u64 - 1;
    let e = Channel::new(c)
        .await
        .expect_err("a cap no notification fits");
    assert!(e.to_string().contains("max_notify_bytes_queued"), "{e}");
}
