//! A write into a region the peer mapped for us (shared memory, or cross-memory attach) is
//! copied by the task that issued it, not handed to the data writer thread and back. The
//! writer queue used to give two promises for free, and the direct copy must keep both: a
//! notification issued while the copy runs (from any task) arrives after its last byte, and
//! a session that ends returns only once no byte of the copy can land any more.

mod common;
use common::*;
use kvbridge::{Channel, Op, PeerId, Region, Transport};
use std::time::{Duration, Instant};

/// Large enough that the copy runs for milliseconds, long after a notification's round trip;
/// larger than `INLINE_COPY_MAX`, so the writing task lends its thread first.
const LEN: usize = 64 << 20;
/// At most `INLINE_COPY_MAX`: copied right in the writing task (still a couple of ms).
const INLINE: usize = 16 << 20;

async fn pair(t: Carrier) -> (Channel, Region, Channel, Region, PeerId) {
    let (dec, kv) = listener("decode-0", |c| t.apply(c), LEN, LEN).await;
    let (pre, src) = initiator("prefill-0", |c| t.apply(c), LEN, LEN).await;
    fill(&src, 11);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    (dec, kv, pre, src, peer)
}

/// Waits (at most 10 s) until the first bytes of `kv` are no longer zero: the copy into it
/// started (a forward copy; it runs for milliseconds more).
async fn copy_started(kv: &Region) {
    let until = Instant::now() + Duration::from_secs(10);
    let mut b = [0u8; 64];
    loop {
        kv.read_at(0, &mut b).unwrap();
        if b != [0u8; 64] {
            return;
        }
        assert!(Instant::now() < until, "the write never started");
        tokio::task::yield_now().await;
    }
}

/// Whether the last page of the first `len` bytes of `kv` equals the source's.
fn landed(src: &Region, kv: &Region, len: usize) -> bool {
    let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
    src.read_at(len - 4096, &mut a).unwrap();
    kv.read_at(len - 4096, &mut b).unwrap();
    a == b
}

fn last_page_landed(src: &Region, kv: &Region) -> bool {
    landed(src, kv, LEN)
}

/// One task writes a batch of `len` bytes; another notifies while it is being copied (or,
/// over TCP, sent). The notification must reach the peer only after the batch's last byte.
async fn a_notification_issued_during_a_write_follows_it(t: Carrier, len: usize) {
    let (dec, kv, pre, src, peer) = pair(t).await;
    let write = tokio::spawn({
        let (pre, src, peer, kv) = (pre.clone(), src.clone(), peer.clone(), kv.id());
        async move { pre.write(&peer, &[Op::page(&src, 0, kv, 0, len)]).await }
    });
    copy_started(&kv).await;
    let queued = pre.notify_queued(&peer, b"after").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), dec.recv_notification())
        .await
        .expect("no notification")
        .unwrap();
    assert_eq!(n.data, b"after");
    assert!(
        landed(&src, &kv, len),
        "the notification arrived before the write it followed had landed"
    );
    write.await.unwrap().unwrap();
    queued.delivered().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_issued_during_a_direct_write_follows_it_shm() {
    a_notification_issued_during_a_write_follows_it(Transport::Shm.into(), LEN).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_issued_during_a_direct_write_follows_it_shm_inline() {
    a_notification_issued_during_a_write_follows_it(Transport::Shm.into(), INLINE).await
}

/// Over TCP the payload is the data writer's, and a notification may skip an idle writer
/// (`writer_queue`): it must not skip one that is still sending the payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_issued_during_a_tcp_write_follows_it() {
    a_notification_issued_during_a_write_follows_it(Transport::Tcp.into(), LEN).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_issued_during_a_direct_write_follows_it_cma() {
    a_notification_issued_during_a_write_follows_it(Carrier::cma(), LEN).await
}

/// Over UCX the write is posted on the channel's worker; the notification goes over the
/// control path and must wait until the worker's flush said every byte is in place.
#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_issued_during_a_ucx_write_follows_it_tcp() {
    a_notification_issued_during_a_write_follows_it(Carrier::ucx("tcp"), LEN).await
}

#[cfg(feature = "ucx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notification_issued_during_a_ucx_write_follows_it_sm() {
    a_notification_issued_during_a_write_follows_it(Carrier::ucx("sm,self"), LEN).await
}

/// `disconnect` during a direct copy returns only once the copy is over: nothing of it
/// lands afterwards. The write itself either completed before the session ended or fails
/// typed, naming the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_during_a_direct_write_returns_after_its_last_byte() {
    let (_dec, kv, pre, src, peer) = pair(Transport::Shm.into()).await;
    let write = tokio::spawn({
        let (pre, src, peer, kv) = (pre.clone(), src.clone(), peer.clone(), kv.id());
        async move { pre.write(&peer, &[Op::page(&src, 0, kv, 0, LEN)]).await }
    });
    copy_started(&kv).await;
    pre.disconnect(&peer, "test").await.unwrap();
    // The copy either ran to its end before the session let go of the mapping, or it was
    // refused whole: no half-copied tail still moving.
    let landed = last_page_landed(&src, &kv);
    let mut snapshot = vec![0u8; 4096];
    kv.read_at(LEN - 4096, &mut snapshot).unwrap();
    match tokio::time::timeout(Duration::from_secs(10), write)
        .await
        .expect("the write hung after disconnect")
        .unwrap()
    {
        Ok(()) => assert!(landed, "an acknowledged write had not landed"),
        Err(e) => assert!(e.to_string().contains("decode-0"), "untyped: {e}"),
    }
    let mut again = vec![0u8; 4096];
    kv.read_at(LEN - 4096, &mut again).unwrap();
    assert_eq!(snapshot, again, "bytes landed after disconnect returned");
    assert!(pre
        .write(&peer, &[Op::page(&src, 0, kv.id(), 0, 4096)])
        .await
        .is_err());
}

/// A current-thread runtime cannot lend its only thread to a copy: the write goes through
/// the data writer thread as before, and lands.
#[tokio::test(flavor = "current_thread")]
async fn a_current_thread_runtime_still_writes_into_mapped_memory() {
    let (_dec, kv, pre, src, peer) = pair(Transport::Shm.into()).await;
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 0, LEN)])
        .await
        .unwrap();
    assert!(last_page_landed(&src, &kv));
}
