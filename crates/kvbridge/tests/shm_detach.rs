//! A peer that is alive but does not confirm unmapping a region gets the region *detached*:
//! its bytes move to fresh memory at the same address, so that peer's copies land in the
//! memfd the listener no longer reads. A detach cuts every other peer's mapping of the
//! region loose too, so before it the listener must stop every other peer's copies into the
//! region (they unmap it and go over TCP, or their sessions end): a write of theirs either
//! lands where the listener reads, or fails with a typed error, and is never acknowledged
//! and lost. It used to detach at once, and the other peers' acknowledged writes vanished.

mod common;
use common::*;
use kvbridge::proto::msg::*;
use kvbridge::proto::PeerId;
use kvbridge::{Channel, Error, Op, PeerEvent, Region, Transport};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PAGE: usize = 4096;
const PAGES: usize = 64;

/// Waits (at most 10 s) until `cond` holds.
async fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < until, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Writes page after page into `kv` (each write a fresh pattern, in a page of its own
/// within a cycle) until `stop` says so; returns the last attempt per remote page: its seed
/// and whether it was acknowledged. A failed write must be typed, and is allowed.
async fn write_pages(
    ch: &Channel,
    peer: &PeerId,
    src: &Region,
    kv: &Region,
    stop: impl FnMut(usize) -> bool,
) -> HashMap<usize, (u64, bool)> {
    write_spread(ch, peer, src, kv, PAGES, stop).await
}

/// [`write_pages`] over the first `pages` pages of `kv`, spread across them (write `i` goes
/// to page `i * 7919 % pages`).
async fn write_spread(
    ch: &Channel,
    peer: &PeerId,
    src: &Region,
    kv: &Region,
    pages: usize,
    mut stop: impl FnMut(usize) -> bool,
) -> HashMap<usize, (u64, bool)> {
    let mut last = HashMap::new();
    let mut buf = vec![0u8; PAGE];
    let mut i = 0usize;
    let until = Instant::now() + Duration::from_secs(20);
    while !stop(i) {
        assert!(Instant::now() < until, "writes did not finish in time");
        let page = i * 7919 % pages;
        let seed = 0xde7ac4 ^ ((i as u64) << 8);
        pattern(&mut buf, seed, 0);
        let local = i % PAGES;
        src.write_at(local * PAGE, &buf).unwrap();
        let r = ch
            .write(peer, &[Op::page(src, local, kv.id(), page as u64, PAGE)])
            .await;
        if let Err(e) = &r {
            // Typed: it names the peer (and says why); never a silent success.
            assert!(
                e.to_string().contains("decode-0"),
                "an untyped failure: {e}"
            );
        }
        last.insert(page, (seed, r.is_ok()));
        i += 1;
        tokio::task::yield_now().await;
    }
    last
}

/// A flag set (by a thread of its own, polling every millisecond for at most 20 s) once
/// `r` is detached.
fn watch_detached(r: &Region) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let (f, r) = (flag.clone(), r.clone());
    std::thread::spawn(move || {
        let until = Instant::now() + Duration::from_secs(20);
        while !r.is_detached() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        f.store(r.is_detached(), Ordering::Release);
    });
    flag
}

/// Every acknowledged write is where the listener reads.
fn assert_landed(kv: &Region, last: &HashMap<usize, (u64, bool)>) {
    let (mut want, mut got) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    let mut lost = Vec::new();
    for (&page, &(seed, ok)) in last {
        if !ok {
            continue;
        }
        pattern(&mut want, seed, 0);
        kv.read_at(page * PAGE, &mut got).unwrap();
        if got != want {
            lost.push(page);
        }
    }
    lost.sort_unstable();
    assert!(
        lost.is_empty(),
        "acknowledged writes lost (pages {lost:?}): they landed in memory the listener no longer reads"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_whose_session_ends_does_not_cut_other_peers_loose() {
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            c.deadlines.close = Duration::from_millis(300);
            c.deadlines.op = Duration::from_secs(5);
        },
        PAGES * PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator("prefill-0", |_| {}, PAGES * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, Transport::Shm).await;

    // A maps the region too, and will never confirm an unmap.
    let (ctl, data, shm) = peer_leaving_shm_frames_unread(&addr(&dec), "silent").await;
    wait_until("both peers mapped the region", || kv.exports() == 2).await;

    // A's session ends (its control and data connections close), while its shared-memory
    // connection stays open and unread: the listener cannot know that A stopped copying,
    // and detaches the region after the close deadline. B writes all along.
    drop((ctl, data));
    let mut after = None;
    let last = write_pages(&pre, &peer, &src, &kv, |i| {
        if kv.is_detached() && after.is_none() {
            after = Some(i);
        }
        // Keep writing well past the detach.
        after.is_some_and(|a| i >= a + 3 * PAGES)
    })
    .await;
    assert!(!kv.is_shared(), "a detached region is not offered any more");
    assert_landed(&kv, &last);
    wait_until("A's export is finished", || kv.exports() == 0).await;

    // B unmapped the region (its writes go over TCP now), and so does a new session of B:
    // the detached region is no longer exported.
    assert_transport(&pre, &peer, Transport::Tcp).await;
    pre.disconnect(&peer, "reconnect after the detach")
        .await
        .unwrap();
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, Transport::Tcp).await;
    assert_eq!(kv.exports(), 0);
    let last = write_pages(&pre, &peer, &src, &kv, |i| i >= PAGES).await;
    assert!(last.values().all(|&(_, ok)| ok), "writes over TCP failed");
    assert_landed(&kv, &last);
    drop(shm);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregister_with_a_silent_peer_ends_its_session_and_spares_the_others() {
    let op = Duration::from_secs(1);
    let (dec, gone) = listener(
        "decode-0",
        |c| {
            c.deadlines.close = Duration::from_millis(300);
            c.deadlines.op = op;
        },
        PAGES * PAGE,
        PAGE,
    )
    .await;
    let kv = Region::alloc(PAGES * PAGE, PAGE).unwrap();
    dec.register(&kv, kvbridge::Grant::AllPeers).unwrap();
    let mut events = dec.peer_events();

    let (pre, src) = initiator("prefill-0", |_| {}, PAGES * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, Transport::Shm).await;
    let (mut ctl, _data, shm) = peer_leaving_shm_frames_unread(&addr(&dec), "silent").await;
    wait_until("both peers mapped both regions", || {
        gone.exports() == 2 && kv.exports() == 2
    })
    .await;

    // B confirms the unmap at once; A never does: its session must end, with a typed
    // error naming it, the step and the region.
    let t = Instant::now();
    dec.deregister(gone.id()).await.unwrap();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(10), "deregister took {took:?}");
    let down = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let PeerEvent::Down { peer, error, .. } = events.recv().await.unwrap() {
                if peer.as_str() == "silent" {
                    return error;
                }
            }
        }
    })
    .await
    .expect("the silent peer's session ended");
    match &down {
        Error::UnmapTimeout { peer, region, .. } => {
            assert_eq!(peer, "silent");
            assert_eq!(*region, gone.id());
        }
        other => panic!("the silent peer's session ended with {other}"),
    }
    assert!(
        gone.is_detached(),
        "A may still copy into the deregistered region"
    );
    wait_until("A's export of the deregistered region is finished", || {
        gone.exports() == 0
    })
    .await;
    // A hears why.
    let bye = loop {
        match recv_frame(&mut ctl).await {
            Some(Message::Bye(b)) => break b,
            Some(_) => continue,
            None => panic!("no Bye for the silent peer"),
        }
    };
    assert_eq!(bye.code, ErrorCode::Timeout, "{}", bye.message);
    assert!(bye.message.contains("unmapping region"), "{}", bye.message);

    // B's session lives on, and its writes into the other region land (A mapped that one
    // too, so it was detached safely when A's session ended).
    assert!(
        pre.peer_incarnation(&peer).await.is_ok(),
        "B's session ended"
    );
    wait_until("A's exports are finished", || kv.exports() == 0).await;
    let last = write_pages(&pre, &peer, &src, &kv, |i| i >= 2 * PAGES).await;
    assert!(last.values().all(|&(_, ok)| ok), "B's writes failed");
    assert_landed(&kv, &last);
    drop(shm);
}

/// A detach copies the region while peers on other hosts keep writing into it over TCP: a
/// write that lands on a page the copy already passed would be acknowledged and lost, so
/// writers are held back during the copy. The region is large, so that the copy takes a
/// while, and the writes go to its first pages, which the copy passes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_writes_during_a_detach_land_where_the_listener_reads() {
    const BIG: usize = 256 << 20;
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            c.deadlines.close = Duration::from_millis(300);
            c.deadlines.op = Duration::from_secs(5);
        },
        BIG,
        PAGE,
    )
    .await;
    let (tcp, src) = initiator(
        "prefill-tcp",
        |c| c.transport = Transport::Tcp,
        PAGES * PAGE,
        PAGE,
    )
    .await;
    let peer = tcp.connect(&addr(&dec)).await.unwrap();
    assert_transport(&tcp, &peer, Transport::Tcp).await;
    let (ctl, data, shm) = peer_leaving_shm_frames_unread(&addr(&dec), "silent").await;
    wait_until("the silent peer mapped the region", || kv.exports() == 1).await;

    drop((ctl, data));
    // Watched from a thread of its own: asking the region blocks while a detach copies it,
    // and the writes must go on meanwhile.
    // Writing stops as soon as the region is detached, so that most pages keep the write
    // that was last before or during the copy (later ones would overwrite a lost write).
    let detached = watch_detached(&kv);
    let last = write_pages(&tcp, &peer, &src, &kv, |_| detached.load(Ordering::Acquire)).await;
    assert!(
        last.values().all(|&(_, ok)| ok),
        "TCP writes failed during the detach"
    );
    assert_landed(&kv, &last);
    drop(shm);
}
