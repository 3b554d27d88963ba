//! `Transfer::prepare_finish`: the receiver's confirmation asked for ahead of the writes.
//! The receiver answers at once but completes the request only when its last chunk's note
//! arrives; a chunk never handed over, or a sender lost before the end, still ends the
//! request as failed, with every page back.

mod common;
use common::*;
use kvbridge_pd::{Outcome, OutcomeSink};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_finish_completes_the_request_only_when_its_last_chunk_lands() {
    let rx = receiver(8, |_| {}).await;
    let (sink, mut outcomes) = queue();
    let tx = sender("prefill-0", sink).await;
    let mut t = tx
        .begin(&disagg("early", &rx), &tokens(1, 40))
        .await
        .unwrap();
    assert_eq!(t.chunks(), 3);
    t.prepare_finish().await.unwrap();
    let data: Vec<Vec<u8>> = (0..3)
        .map(|i| kv(1, i, t.chunk_bytes(i) as usize))
        .collect();
    for (i, d) in data.iter().enumerate().take(2) {
        t.send_chunk(i as u64, d).await.unwrap();
    }
    // The second chunk's note follows the early finish on the session: once it is in,
    // the receiver has answered the finish, and must not have completed the request.
    assert!(
        eventually(5 * S, || rx.chunks_landed("early")
            == Some(vec![true, true, false]))
        .await,
        "{:?}",
        rx.chunks_landed("early")
    );
    assert!(
        !rx.is_complete("early"),
        "complete before its last chunk landed"
    );
    t.send_chunk(2, &data[2]).await.unwrap();
    let s = t.finish().await.unwrap();
    assert_eq!(s.chunks, 3);
    assert!(matches!(
        outcomes.recv().await,
        Some(Outcome::KvReady { ref req_id, chunks: 3, .. }) if req_id == "early"
    ));
    rx.wait_complete("early", 5 * S).await.unwrap();
    assert_eq!(rx.retrieve("early", S).await.unwrap(), data);
    let c = rx.counters();
    assert_eq!((c.free, c.leaked), (8, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_skipped_after_an_early_finish_fails_the_transfer_and_frees_its_pages() {
    let rx = receiver(8, |_| {}).await;
    let (sink, mut outcomes) = queue();
    let tx = sender("prefill-0", sink).await;
    let mut t = tx.begin(&disagg("gap", &rx), &tokens(2, 40)).await.unwrap();
    t.prepare_finish().await.unwrap();
    for i in [0u64, 2] {
        t.send_chunk(i, &kv(2, i, t.chunk_bytes(i) as usize))
            .await
            .unwrap();
    }
    let err = t.finish().await.unwrap_err();
    assert!(err.to_string().contains("chunk 1"), "{err}");
    assert!(matches!(
        outcomes.recv().await,
        Some(Outcome::KvFailed { ref req_id, .. }) if req_id == "gap"
    ));
    assert!(
        eventually(5 * S, || rx.counters().free == 8).await,
        "{:?}",
        rx.counters()
    );
    assert!(!rx.is_complete("gap"));
    assert_eq!(rx.counters().leaked, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_lost_after_an_early_finish_leaves_a_failed_request_and_no_page() {
    let (failures, mut reported) = queue();
    let rx = receiver(8, |c| c.failure_outcomes = failures).await;
    // A killed process reports nothing itself.
    let tx = sender("prefill-0", OutcomeSink::None).await;
    let mut t = tx
        .begin(&disagg("lost", &rx), &tokens(3, 32))
        .await
        .unwrap();
    t.prepare_finish().await.unwrap();
    t.send_chunk(0, &kv(3, 0, t.chunk_bytes(0) as usize))
        .await
        .unwrap();
    assert!(
        eventually(5 * S, || rx.chunks_landed("lost")
            == Some(vec![true, false]))
        .await
    );
    tx.close().await; // the process dies: its sessions end
    std::mem::forget(t); // ...without running any of its cleanup
    assert!(
        eventually(5 * S, || rx.counters().free == 8).await,
        "{:?}",
        rx.counters()
    );
    assert_eq!(rx.counters().leaked, 0);
    assert!(!rx.is_complete("lost"));
    match reported.recv().await {
        Some(Outcome::KvFailed { req_id, reason, .. }) => {
            assert_eq!(req_id, "lost");
            assert!(reason.contains("prefill-0"), "{reason}");
        }
        o => panic!("expected KvFailed, got {o:?}"),
    }
}
