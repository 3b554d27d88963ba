//! Pull mode (the receiver reads each chunk from the sender's registered memory) and the
//! receiver's in-place, per-chunk borrows, end to end over real loopback sockets.

mod common;
use common::*;
use kvbridge::{Channel, Grant, Region};
use kvbridge_pd::msg::PdMsg;
use kvbridge_pd::{Outcome, OutcomeSink, PdError};
use std::sync::Arc;
use std::time::Duration;

/// Pull, a prompt shorter than one chunk (staged copy) and a multi-chunk prompt with a
/// partial last chunk offered straight from registered memory: outcomes arrive and the KV is
/// byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_short_and_multi_chunk_kv_is_exact() {
    let rx = receiver(8, |_| {}).await;
    let (sink, mut outcomes) = queue();
    let tx = pull_sender("prefill-0", sink, None).await;

    // Short: one partial chunk, through staging.
    let toks = tokens(1, 10);
    let mut t = tx.begin(&disagg("short", &rx), &toks).await.unwrap();
    let data = kv(1, 0, t.chunk_bytes(0) as usize);
    t.send_chunk(0, &data).await.unwrap();
    let s = t.finish().await.unwrap();
    assert_eq!((s.chunks, s.bytes), (1, data.len() as u64));
    assert!(matches!(
        outcomes.recv().await.unwrap(),
        Outcome::KvReady { ref req_id, chunks: 1, .. } if req_id == "short"
    ));
    assert_eq!(rx.retrieve("short", S).await.unwrap(), vec![data]);

    // Multi-chunk: 4 full chunks and a partial one, offered from engine memory, all before
    // any is waited for; finish is answered once the receiver read them all.
    let toks = tokens(2, 4 * 16 + 5);
    let page = spec().page_bytes() as usize;
    let mem = Region::alloc(page * 5, page).unwrap();
    tx.register(&mem).unwrap();
    let mut t = tx.begin(&disagg("multi", &rx), &toks).await.unwrap();
    let mut want = Vec::new();
    for i in 0..t.chunks() {
        let d = kv(2, i, t.chunk_bytes(i) as usize);
        mem.write_at(i as usize * page, &d).unwrap();
        want.push(d);
    }
    for i in 0..t.chunks() {
        t.offer_chunk(i, &mem, i as usize * page).await.unwrap();
    }
    t.wait_pulled(0).await.unwrap();
    let s = t.finish().await.unwrap();
    let total: u64 = want.iter().map(|d| d.len() as u64).sum();
    assert_eq!((s.chunks, s.bytes), (5, total));
    assert!(matches!(
        outcomes.recv().await.unwrap(),
        Outcome::KvReady { ref req_id, chunks: 5, bytes, .. } if req_id == "multi" && bytes == total
    ));
    // In place, chunk by chunk, then released.
    for (i, w) in want.iter().enumerate() {
        assert!(rx
            .with_chunk("multi", i as u64, |b| b == w.as_slice())
            .unwrap());
    }
    rx.release("multi").unwrap();
    let c = rx.counters();
    assert_eq!((c.free, c.pinned, c.leaked), (8, 0, 0));
}

/// Push mode: each chunk can be borrowed in place as soon as it landed, before the request is
/// complete; a borrowed page outlives the request's release and only then returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_chunks_are_borrowed_as_they_land_and_pinned_until_dropped() {
    let rx = Arc::new(receiver(3, |_| {}).await);
    let tx = sender("prefill-0", OutcomeSink::None).await;
    let toks = tokens(5, 40);
    let mut t = tx.begin(&disagg("r", &rx), &toks).await.unwrap();
    let d0 = kv(5, 0, t.chunk_bytes(0) as usize);
    t.send_chunk(0, &d0).await.unwrap();
    // Chunk 0 has landed (the sender's note is ordered after its write); chunk 1 has not.
    let c0 = rx.chunk("r", 0, S).await.unwrap();
    assert_eq!(c0.to_vec(), d0);
    assert_eq!(rx.chunks_landed("r"), Some(vec![true, false, false]));
    assert!(!rx.is_complete("r"));
    assert!(matches!(
        rx.borrow_chunk("r", 1),
        Err(PdError::Invalid { .. })
    ));
    assert!(matches!(
        rx.borrow_chunk("r", 9),
        Err(PdError::Invalid { .. })
    ));
    // A waiter for chunk 2 wakes when it lands.
    let rx2 = rx.clone();
    let waiter = tokio::spawn(async move { rx2.chunk("r", 2, 5 * S).await.map(|c| c.to_vec()) });
    for i in 1..3 {
        t.send_chunk(i, &kv(5, i, t.chunk_bytes(i) as usize))
            .await
            .unwrap();
    }
    assert_eq!(waiter.await.unwrap().unwrap(), kv(5, 2, 8 * 256));
    t.finish().await.unwrap();
    assert!(rx.is_complete("r"));
    // Released while chunk 0 is still borrowed: its page drains, the others return.
    rx.release("r").unwrap();
    let c = rx.counters();
    assert_eq!((c.free, c.quarantined, c.pinned, c.leaked), (2, 1, 1, 0));
    // A new request needing all 3 pages waits for the reader.
    let tx2 = sender("prefill-1", OutcomeSink::None).await;
    let rx3 = rx.clone();
    let next = tokio::spawn(async move {
        let t = tx2.begin(&disagg("next", &rx3), &tokens(6, 48)).await;
        t.map(|t| t.chunks())
    });
    assert!(eventually(5 * S, || rx.counters().waiting == 1).await);
    assert_eq!(c0.to_vec(), d0, "the borrowed bytes are untouched");
    drop(c0);
    assert_eq!(next.await.unwrap().unwrap(), 3);
    assert_eq!(rx.counters().leaked, 0);
}

/// Pull: the decoder cancels a request while the receiver's read of one of its chunks is held
/// in flight (the sender serves reads after 2 s, a window a loaded 2-core machine does not miss). That page is not freed, and a request
/// that needs every page waits, until the read resolved; the sender hears `PullErr` and
/// reports `KvFailed` once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_cancel_never_frees_a_page_a_read_can_land_in() {
    let rx = Arc::new(receiver(2, |_| {}).await);
    let (sink, mut outcomes) = queue();
    let tx = pull_sender("prefill-a", sink, Some(2 * S)).await;
    // Engine memory is registered before the session exists (see `PdSender::register`).
    let page = spec().page_bytes() as usize;
    let mem = Region::alloc(page * 2, page).unwrap();
    tx.register(&mem).unwrap();
    let mut a = tx.begin(&disagg("A", &rx), &tokens(10, 32)).await.unwrap();
    a.offer_chunk(0, &mem, 0).await.unwrap();
    // The receiver's read of chunk 0 has started (its page is pinned) and is held.
    assert!(eventually(5 * S, || rx.counters().pinned == 1).await);
    assert!(batch_in_flight(rx.channel()).await, "{:?}", rx.counters());
    rx.cancel("A").unwrap();
    // Chunk 1's page is free at once; chunk 0's drains while the read is in flight.
    let c = rx.counters();
    assert_eq!((c.free, c.quarantined, c.pinned), (1, 1, 1), "{c:?}");
    let tx_b = sender("prefill-b", OutcomeSink::None).await;
    let rx2 = rx.clone();
    let b = tokio::spawn(async move { tx_b.begin(&disagg("B", &rx2), &tokens(11, 32)).await });
    assert!(eventually(5 * S, || rx.counters().waiting == 1).await);
    // While the read is still in flight, B has not got the page.
    if rx.channel().stats().await.unwrap().batches_in_flight > 0 {
        assert_eq!(rx.counters().waiting, 1);
        assert_eq!(rx.counters().pinned, 1);
    }
    let err = a.wait_pulled(0).await.unwrap_err();
    assert!(err.to_string().contains("ended"), "{err}");
    let b = b.await.unwrap().unwrap();
    assert_eq!(b.chunks(), 2);
    assert!(
        matches!(outcomes.recv().await.unwrap(), Outcome::KvFailed { ref req_id, .. } if req_id == "A")
    );
    drop(a);
    assert!(outcomes.try_recv().is_err(), "exactly one outcome");
    assert_eq!(rx.counters().leaked, 0);
}

/// Pull: the sender cancels while the receiver's read is held in flight. `cancel` returns
/// only after the receiver's `CancelAck`, i.e. after the read resolved; the session stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_cancel_waits_for_cancel_ack() {
    let rx = receiver(4, |_| {}).await;
    let (sink, mut outcomes) = queue();
    // Reads are served after 2 s: a window in which a loaded machine still sees the pin.
    let tx = pull_sender("prefill-0", sink, Some(2 * S)).await;
    // Engine memory is registered before the session exists (see `PdSender::register`).
    let page = spec().page_bytes() as usize;
    let mem = Region::alloc(page * 2, page).unwrap();
    tx.register(&mem).unwrap();
    let mut t = tx.begin(&disagg("c", &rx), &tokens(4, 32)).await.unwrap();
    t.offer_chunk(0, &mem, 0).await.unwrap();
    assert!(eventually(5 * S, || rx.counters().pinned == 1).await);
    t.cancel("engine aborted").await;
    // The receiver's read has resolved (its CancelAck follows that), nothing is pinned.
    let c = rx.counters();
    assert_eq!((c.pinned, c.free), (0, 4), "{c:?}");
    assert_eq!(rx.counters().leaked, 0);
    assert_eq!(
        tx.channel().stats().await.unwrap().established,
        1,
        "not disconnected"
    );
    assert!(
        matches!(outcomes.recv().await.unwrap(), Outcome::KvFailed { ref reason, .. } if reason.contains("engine aborted"))
    );
    assert!(outcomes.try_recv().is_err());
}

/// Pull: a receiver that never acknowledges a cancel (hand-driven: it grants, then ignores
/// everything) is disconnected after the step deadline; `cancel` returns once the session is
/// torn down, so none of its reads can be served any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_cancel_disconnects_a_silent_receiver() {
    let s = spec();
    let silent = Channel::new(channel("decode-silent", true)).await.unwrap();
    let buf = Region::alloc(s.page_bytes() as usize * 2, s.page_bytes() as usize).unwrap();
    silent.register(&buf, Grant::AllPeers).unwrap();
    let addr = silent.local_addr().unwrap();
    let (sink, mut outcomes) = queue();
    let tx = sender_with("prefill-0", sink, |c| {
        c.mode = kvbridge_pd::TransferMode::Pull;
        c.step_deadline = Duration::from_millis(500);
    })
    .await;
    let ds = kvbridge_pd::DisaggSpec {
        req_id: "s".into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: vec![addr.port()],
        receiver_alloc_port: vec![],
    };
    let silent2 = silent.clone();
    let region = buf.id().0;
    let grant = tokio::spawn(async move {
        let n = silent2.recv_notification().await.unwrap();
        let PdMsg::Alloc { call, req_id, .. } = PdMsg::decode(&n.data).unwrap() else {
            panic!("expected Alloc");
        };
        let ok = PdMsg::AllocOk {
            call,
            req_id,
            region,
            page_bytes: s.page_bytes(),
            pages: vec![0, 1],
            held: vec![false, false],
        };
        silent2.notify(&n.peer, &ok.encode()).await.unwrap();
        // Then: the offer and the cancel arrive, and are ignored.
        let mut seen = Vec::new();
        while let Some(n) = silent2.recv_notification().await {
            seen.push(PdMsg::decode(&n.data).unwrap());
            if matches!(seen.last(), Some(PdMsg::Cancel { pull: true, .. })) {
                return seen;
            }
        }
        seen
    });
    let mem = Region::alloc(s.page_bytes() as usize * 2, s.page_bytes() as usize).unwrap();
    tx.register(&mem).unwrap();
    let mut t = tx.begin(&ds, &tokens(7, 32)).await.unwrap();
    t.offer_chunk(0, &mem, 0).await.unwrap();
    t.cancel("give up").await;
    let seen = grant.await.unwrap();
    assert!(matches!(seen[0], PdMsg::Offer { index: 0, .. }), "{seen:?}");
    assert_eq!(
        tx.channel().stats().await.unwrap().established,
        0,
        "disconnected"
    );
    assert!(matches!(
        outcomes.recv().await.unwrap(),
        Outcome::KvFailed { .. }
    ));
    assert!(outcomes.try_recv().is_err());
}

/// Pull: the sender is killed while the receiver's read is in flight and another chunk was
/// never offered. The receiver's pages return (the pinned one once the read failed), and the
/// proxy side gets `KvFailed` from the receiver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_killed_mid_pull() {
    let (failures, mut proxy) = queue();
    let rx = receiver(4, |c| c.failure_outcomes = failures).await;
    // The read is held far longer than the test runs: the kill, not the delay, ends it, so
    // a slow machine cannot miss the window in which the page is pinned.
    let tx = pull_sender("prefill-0", OutcomeSink::None, Some(30 * S)).await;
    // Engine memory is registered before the session exists (see `PdSender::register`).
    let page = spec().page_bytes() as usize;
    let mem = Region::alloc(page * 3, page).unwrap();
    tx.register(&mem).unwrap();
    let mut t = tx
        .begin(&disagg("doomed", &rx), &tokens(3, 48))
        .await
        .unwrap();
    t.offer_chunk(0, &mem, 0).await.unwrap();
    assert!(eventually(5 * S, || rx.counters().pinned == 1).await);
    tx.close().await; // the process dies: its sessions end
    std::mem::forget(t); // ...without running any of its cleanup
    assert!(
        eventually(5 * S, || rx.counters().free == 4).await,
        "{:?}",
        rx.counters()
    );
    let c = rx.counters();
    assert_eq!((c.leaked, c.pinned, c.requests), (0, 0, 0));
    match proxy.recv().await.unwrap() {
        Outcome::KvFailed { req_id, reason, .. } => {
            assert_eq!(req_id, "doomed");
            assert!(reason.contains("prefill-0"), "{reason}");
        }
        o => panic!("{o:?}"),
    }
}

/// Pull: dropping an unfinished transfer with a read in flight reports `KvFailed` at once
/// (once), and the cancel it starts lets the receiver's pages return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_pull_transfer_fails_once_and_releases() {
    let rx = receiver(4, |_| {}).await;
    let (sink, mut outcomes) = queue();
    let tx = pull_sender("prefill-0", sink, Some(Duration::from_millis(200))).await;
    // Engine memory is registered before the session exists (see `PdSender::register`).
    let page = spec().page_bytes() as usize;
    let mem = Region::alloc(page * 2, page).unwrap();
    tx.register(&mem).unwrap();
    let mut t = tx.begin(&disagg("d", &rx), &tokens(8, 32)).await.unwrap();
    t.offer_chunk(0, &mem, 0).await.unwrap();
    drop(t);
    assert!(
        matches!(outcomes.recv().await.unwrap(), Outcome::KvFailed { ref req_id, .. } if req_id == "d")
    );
    assert!(
        eventually(5 * S, || rx.counters().free == 4).await,
        "{:?}",
        rx.counters()
    );
    assert_eq!(rx.counters().leaked, 0);
    assert!(outcomes.try_recv().is_err());
}
