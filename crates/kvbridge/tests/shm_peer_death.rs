//! A peer that dies with shared-memory frames of ours unread resets its end of the unix
//! socket instead of closing it cleanly. Dying unmapped everything it had, so the listener
//! must take the reset as the peer's word, as it takes a clean close. It used to detach the
//! region instead, and a detached region is cut loose from its memfd: every *other* peer's
//! mapping then pointed at memory the listener no longer read, and their writes, acknowledged,
//! landed nowhere (zeros where a decoder expected KV).

mod common;
use common::*;
use kvbridge::{Op, Transport};
use std::time::{Duration, Instant};

const PAGE: usize = 4096;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_dying_with_shm_frames_unread_does_not_cut_other_peers_loose() {
    let (dec, kv) = listener("decode-0", |_| {}, 16 * PAGE, PAGE).await;
    // A well-behaved prefiller maps the region first.
    let (pre, src) = initiator("prefill-0", |_| {}, 16 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, Transport::Shm).await;

    // Another peer dies with the listener's frames unread: its end resets.
    let conns = peer_leaving_shm_frames_unread(&addr(&dec), "dies-unread").await;
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
