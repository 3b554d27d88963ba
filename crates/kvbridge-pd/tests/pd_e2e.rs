//! Issue 3, tests 1-5, end to end over real loopback sockets.

mod common;
use common::*;
use kvbridge_pd::{Outcome, OutcomeSink, PdError, ZmqPusher};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Test 4: a prompt shorter than one chunk: its outcome arrives (over ZMQ) and its KV is
/// byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompt_outcome_arrives_and_kv_is_exact() {
    let rx = receiver(8, |_| {}).await;
    let (mut proxy, ep) = pull().await;
    let tx = sender("prefill-0", OutcomeSink::Zmq(ZmqPusher::spawn(ep, 5 * S))).await;
    let toks = tokens(1, 10);
    let mut t = tx.begin(&disagg("short", &rx), &toks).await.unwrap();
    assert_eq!(t.chunks(), 1);
    let len = t.chunk_bytes(0) as usize;
    assert_eq!(len, 10 * 256);
    let data = kv(1, 0, len);
    t.send_chunk(0, &data).await.unwrap();
    let s = t.finish().await.unwrap();
    assert_eq!((s.chunks, s.bytes), (1, len as u64));
    assert_eq!(
        next_outcome(&mut proxy, 5 * S).await,
        Some(Outcome::KvReady {
            req_id: "short".into(),
            rank: 0,
            chunks: 1,
            bytes: len as u64,
            sent_by: None,
        })
    );
    let got = rx.retrieve("short", S).await.unwrap();
    assert_eq!(got, vec![data]);
    let c = rx.counters();
    assert_eq!((c.free, c.leaked), (8, 0));
}

/// Test 2: a request larger than the whole buffer fails in under 100 ms, naming both sizes;
/// the proxy gets `KvFailed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_larger_than_buffer_fails_fast_naming_sizes() {
    let rx = receiver(4, |c| c.alloc_timeout = 30 * S).await;
    let (sink, mut outcomes) = queue();
    let tx = sender("prefill-0", sink).await;
    // Warm the session so the measurement is the refusal, not the handshake.
    tx.channel()
        .connect(&rx.local_addr().unwrap().to_string())
        .await
        .unwrap();
    let started = Instant::now();
    let err = tx
        .begin(&disagg("huge", &rx), &tokens(2, 7 * 16))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_millis(100), "took {took:?}");
    assert!(
        matches!(
            err,
            PdError::NeverFits {
                needed_pages: 7,
                total_pages: 4,
                ..
            }
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("7 pages") && msg.contains("4 pages"), "{msg}");
    match outcomes.recv().await.unwrap() {
        Outcome::KvFailed {
            req_id,
            rank,
            reason,
        } => {
            assert_eq!((req_id.as_str(), rank), ("huge", 0));
            assert!(reason.contains("7 pages"), "{reason}");
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(rx.counters().free, 4);
}

/// Test 1: LMCache's three-way deadlock. The buffer is nearly full; 8 concurrent requests
/// with chunked prefill need more pages than are free; the decoder only frees pages when the
/// proxy has seen a request's outcome. Every request gets exactly one outcome within its
/// deadlines and no page leaks — first when the hog is released, then when it never is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_three_way_deadlock_when_buffer_nearly_full() {
    for release_hog in [true, false] {
        let alloc_wait = if release_hog { 5 * S } else { S / 2 };
        let rx = Arc::new(receiver(20, |c| c.alloc_timeout = alloc_wait).await);
        let (sink, mut outcomes) = queue();
        let tx = Arc::new(sender("prefill-0", sink).await);
        // The hog: 17 of 20 pages, complete, not yet retrieved.
        let mut hog = tx
            .begin(&disagg("hog", &rx), &tokens(99, 17 * 16))
            .await
            .unwrap();
        for i in 0..hog.chunks() {
            let d = kv(99, i, hog.chunk_bytes(i) as usize);
            hog.send_chunk(i, &d).await.unwrap();
        }
        hog.finish().await.unwrap();
        assert!(matches!(
            outcomes.recv().await,
            Some(Outcome::KvReady { .. })
        ));

        let started = Instant::now();
        let mut tasks = Vec::new();
        for r in 0..8u32 {
            let (tx, rx) = (tx.clone(), rx.clone());
            tasks.push(tokio::spawn(async move {
                // 3 to 4 chunks each; the last partial.
                let n = 40 + 7 * r as usize;
                let mut t = tx
                    .begin(&disagg(&format!("r{r}"), &rx), &tokens(r, n))
                    .await?;
                for i in 0..t.chunks() {
                    tokio::task::yield_now().await; // prefill of the next chunk
                    let d = kv(r, i, t.chunk_bytes(i) as usize);
                    t.send_chunk(i, &d).await?;
                }
                t.finish().await
            }));
        }
        // The decoder: retrieves a request once the proxy saw its KvReady; the hog after the
        // first outcome of the batch (when `release_hog`), or never.
        let mut seen = std::collections::HashMap::new();
        let deadline = alloc_wait + 5 * S;
        let mut hog_out = false;
        while seen.len() < 8 {
            let o = tokio::time::timeout(deadline, outcomes.recv())
                .await
                .expect("an outcome within the deadline")
                .unwrap();
            if let Outcome::KvReady { req_id, chunks, .. } = &o {
                let got = rx.retrieve(req_id, S).await.unwrap();
                assert_eq!(got.len() as u64, *chunks);
                let r: u32 = req_id[1..].parse().unwrap();
                for (i, c) in got.iter().enumerate() {
                    assert_eq!(c, &kv(r, i as u64, c.len()), "{req_id} chunk {i}");
                }
            }
            assert!(
                seen.insert(o.req_id().to_string(), o).is_none(),
                "one outcome each"
            );
            if release_hog && !hog_out {
                rx.retrieve("hog", S).await.unwrap();
                hog_out = true;
            }
        }
        if release_hog && !hog_out {
            rx.retrieve("hog", S).await.unwrap();
        }
        for t in tasks {
            let _ = t.await.unwrap();
        }
        assert!(
            started.elapsed() < deadline + S,
            "took {:?}",
            started.elapsed()
        );
        let ready = seen
            .values()
            .filter(|o| matches!(o, Outcome::KvReady { .. }))
            .count();
        if release_hog {
            assert_eq!(ready, 8, "{seen:?}");
        } else {
            // Three pages free: at most a few fit; the rest fail cleanly at their deadline.
            assert!(ready < 8, "{seen:?}");
            for o in seen.values() {
                if let Outcome::KvFailed { reason, .. } = o {
                    assert!(reason.contains("pages"), "{reason}");
                }
            }
            rx.retrieve("hog", S).await.unwrap();
        }
        assert!(outcomes.try_recv().is_err(), "no second outcome");
        let c = rx.counters();
        assert_eq!(
            (c.free, c.leaked, c.requests, c.waiting),
            (20, 0, 0, 0),
            "{c:?}"
        );
    }
}

/// The environment variable that makes [`sender_child_process`] the killed sender of
/// [`sender_killed_mid_transfer`]: the receiver's port.
const CHILD_RX_PORT: &str = "KVBRIDGE_PD_TEST_CHILD_RX_PORT";
/// The line the child prints once its two chunks have landed.
const CHILD_SENT: &str = "kvbridge-pd-test-child: 2 chunks sent";

/// Test 3: the sender is killed mid-transfer: a child process (this test binary, running
/// [`sender_child_process`]) sends 2 of 4 chunks and is killed with SIGKILL, so no `Bye`,
/// no cancel and no cleanup of its own reach the receiver, only what the kernel does with
/// a dead process's sockets. Its pages on the receiver return within the TTL, and the
/// proxy side gets `KvFailed` naming the sender (the receiver reports for the dead sender);
/// when the receiver does not report, no outcome arrives at all (the proxy's own deadline
/// answers: `kvbridge-proxy/tests/e2e.rs::kv_outcome_never_arrives_gives_504_within_the_deadline`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sender_killed_mid_transfer() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    for receiver_reports in [true, false] {
        let (mut proxy, ep) = pull().await;
        let ttl = 4 * S;
        let rx = receiver(8, |c| {
            c.ttl = ttl;
            if receiver_reports {
                c.failure_outcomes = OutcomeSink::Zmq(ZmqPusher::spawn(ep.clone(), 5 * S));
            }
        })
        .await;
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sender_child_process",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_RX_PORT, rx.local_addr().unwrap().port().to_string())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the sender process starts");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let sent = tokio::time::timeout(20 * S, async {
            while let Some(l) = lines.next_line().await.unwrap() {
                if l.contains(CHILD_SENT) {
                    return true;
                }
            }
            false
        })
        .await;
        assert_eq!(sent, Ok(true), "the sender process sent its 2 chunks");
        assert_eq!(rx.counters().reserved, 4);
        child.start_kill().expect("SIGKILL");
        let killed = Instant::now();
        let status = child.wait().await.unwrap();
        assert!(!status.success(), "killed, not exited: {status}");
        // The death is noticed well before the TTL would return the pages (the request
        // began a few milliseconds before the kill).
        let noticed = ttl / 2;
        assert!(
            eventually(noticed, || rx.counters().free == 8).await,
            "pages not back within {noticed:?} of the death: {:?}",
            rx.counters()
        );
        assert_eq!(rx.counters().leaked, 0);
        if receiver_reports {
            match next_outcome(&mut proxy, ttl).await {
                Some(Outcome::KvFailed {
                    req_id,
                    rank,
                    reason,
                }) => {
                    assert_eq!((req_id.as_str(), rank), ("doomed", 0));
                    assert!(reason.contains("prefill-0"), "{reason}");
                }
                o => panic!("expected KvFailed, got {o:?}"),
            }
            // Reported on the sender's death, not at the TTL.
            assert!(killed.elapsed() < noticed, "took {:?}", killed.elapsed());
        } else {
            assert_eq!(next_outcome(&mut proxy, S).await, None, "no outcome at all");
        }
        rx.close().await;
    }
}

/// The killed sender of [`sender_killed_mid_transfer`], run as a child process of it (and
/// skipped otherwise): begins request "doomed" of 4 chunks, sends 2, says so, and waits to
/// be killed (at most 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of sender_killed_mid_transfer"]
async fn sender_child_process() {
    let Ok(port) = std::env::var(CHILD_RX_PORT) else {
        return;
    };
    let tx = sender("prefill-0", OutcomeSink::None).await;
    let spec = kvbridge_pd::DisaggSpec {
        req_id: "doomed".into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: vec![port.parse().unwrap()],
        receiver_alloc_port: vec![],
    };
    let mut t = tx.begin(&spec, &tokens(3, 64)).await.unwrap();
    for i in 0..2 {
        let d = kv(3, i, t.chunk_bytes(i) as usize);
        t.send_chunk(i, &d).await.unwrap();
    }
    println!("{CHILD_SENT}");
    tokio::time::sleep(30 * S).await;
    panic!("not killed within 30 s");
}

/// Test 5: a page is never handed to a new request while a write of a cancelled request into
/// it can still land. The receiver holds every incoming write for 2 s (a window a loaded 2-core machine does not miss); request A is
/// cancelled on the decoder while its write is held; request B (another sender) must wait
/// until A's write has landed and A's sender confirmed the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_page_reuse_while_cancelled_write_in_flight() {
    let rx = Arc::new(
        receiver(2, |c| {
            c.channel.hooks.write_apply_delay = Some(2 * S);
        })
        .await,
    );
    let (sink_a, mut out_a) = queue();
    let tx_a = sender("prefill-a", sink_a).await;
    let tx_b = sender("prefill-b", OutcomeSink::None).await;
    let mut a = tx_a
        .begin(&disagg("A", &rx), &tokens(10, 32))
        .await
        .unwrap();
    let len = a.chunk_bytes(0) as usize;
    let a_task = tokio::spawn(async move {
        let r0 = a.send_chunk(0, &kv(10, 0, len)).await;
        let r1 = a.send_chunk(1, &kv(10, 1, len)).await;
        (r0, r1)
    });
    // A's first write is on its way and held by the receiver.
    let ch = tx_a.channel().clone();
    let mut in_flight = false;
    for _ in 0..200 {
        if ch.stats().await.unwrap().batches_in_flight > 0 {
            in_flight = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(in_flight);
    rx.cancel("A").unwrap();
    assert_eq!(rx.counters().quarantined, 2);
    let b_started = Instant::now();
    let rx2 = rx.clone();
    let b_task = tokio::spawn(async move {
        let mut b = tx_b
            .begin(&disagg("B", &rx2), &tokens(11, 32))
            .await
            .unwrap();
        let granted = b_started.elapsed();
        for i in 0..2 {
            b.send_chunk(i, &kv(11, i, len)).await.unwrap();
        }
        b.finish().await.unwrap();
        granted
    });
    // B waits: its allocation is queued while A's pages are quarantined.
    assert!(
        eventually(2 * S, || rx.counters().waiting == 1).await,
        "{:?}",
        rx.counters()
    );
    assert_eq!(rx.counters().quarantined, 2);
    let (r0, r1) = a_task.await.unwrap();
    assert!(r0.is_ok(), "A's first write landed: {r0:?}");
    assert!(matches!(r1, Err(PdError::Cancelled { .. })), "{r1:?}");
    match out_a.recv().await {
        Some(Outcome::KvFailed { req_id, .. }) => assert_eq!(req_id, "A"),
        o => panic!("{o:?}"),
    }
    let granted = b_task.await.unwrap();
    assert!(
        granted >= Duration::from_millis(1500),
        "B granted after {granted:?}"
    );
    let got = rx.retrieve("B", S).await.unwrap();
    assert_eq!(got, vec![kv(11, 0, len), kv(11, 1, len)]);
    let c = rx.counters();
    assert_eq!((c.free, c.leaked, c.quarantined), (2, 0, 0), "{c:?}");
}

/// Chunks the receiver already holds are not sent again: two requests share a prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_prefix_chunks_are_not_resent() {
    let rx = receiver(8, |_| {}).await;
    let (sink, _o) = queue();
    let tx = sender("prefill-0", sink).await;
    let base = tokens(5, 40);
    let mut a = tx.begin(&disagg("a", &rx), &base).await.unwrap();
    for i in 0..a.chunks() {
        a.send_chunk(i, &kv(5, i, a.chunk_bytes(i) as usize))
            .await
            .unwrap();
    }
    a.finish().await.unwrap();
    let mut longer = base.clone();
    longer.extend(tokens(6, 30));
    let mut b = tx.begin(&disagg("b", &rx), &longer).await.unwrap();
    assert_eq!(b.chunks(), 5);
    // The two full chunks of the shared prefix are held; the third was partial in `a`.
    assert_eq!(
        (0..5).map(|i| b.needs(i)).collect::<Vec<_>>(),
        [false, false, true, true, true]
    );
    for i in 0..b.chunks() {
        let d = if i < 2 {
            kv(5, i, 4096)
        } else {
            kv(6, i, b.chunk_bytes(i) as usize)
        };
        b.send_chunk(i, &d).await.unwrap();
    }
    let s = b.finish().await.unwrap();
    assert_eq!(s.skipped, 2);
    let got = rx.retrieve("b", S).await.unwrap();
    assert_eq!(got[0], kv(5, 0, 4096));
    rx.retrieve("a", S).await.unwrap();
    let c = rx.counters();
    assert_eq!((c.free, c.leaked), (8, 0));
}

/// Misuse fails the transfer once, with `KvFailed`, and returns its pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_chunk_size_fails_once_and_rolls_back() {
    let rx = receiver(4, |_| {}).await;
    let (sink, mut outcomes) = queue();
    let tx = sender("prefill-0", sink).await;
    let mut t = tx.begin(&disagg("bad", &rx), &tokens(7, 20)).await.unwrap();
    let e = t.send_chunk(0, &[0u8; 3]).await.unwrap_err();
    assert!(e.to_string().contains("3 bytes"), "{e}");
    assert!(t.send_chunk(0, &kv(7, 0, 4096)).await.is_err());
    drop(t);
    assert!(matches!(
        outcomes.recv().await,
        Some(Outcome::KvFailed { .. })
    ));
    assert!(eventually(2 * S, || rx.counters().free == 4).await);
    assert!(outcomes.try_recv().is_err(), "exactly one outcome");
    // Dropping an unfinished transfer reports too.
    let t = tx
        .begin(&disagg("dropped", &rx), &tokens(8, 20))
        .await
        .unwrap();
    drop(t);
    assert!(
        matches!(outcomes.recv().await, Some(Outcome::KvFailed { req_id, .. }) if req_id == "dropped")
    );
    assert!(eventually(2 * S, || rx.counters().free == 4).await);
}
