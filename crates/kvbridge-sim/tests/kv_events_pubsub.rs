//! The reference engine's KV-events publisher and the proxy's subscriber over real sockets:
//! stored and removed blocks reach the proxy's index; a sequence gap and a restarted
//! publisher drop the worker's view instead of leaving it stale; and both ends talk to
//! pyzmq (when python3 with pyzmq and msgspec is at hand).

use std::sync::Arc;
use std::time::Duration;

use kvbridge::proto::kv_events::{BlockHash, BlockRemoved, BlockStored, KvEvent, KvEventBatch};
use kvbridge_proxy::kv_events_sub::{self, SubLimits, SubStats};
use kvbridge_proxy::routing::kv_index::KvIndex;
use kvbridge_sim::kv_events_pub::{KvEventsPublisher, PubLimits};

const T: Duration = Duration::from_secs(10);

fn limits() -> SubLimits {
    SubLimits {
        retry: Duration::from_millis(20),
        ..SubLimits::default()
    }
}

fn stored(hash: i128, parent: Option<i128>, tokens: &[u32]) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash::Int(hash)],
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size: tokens.len() as u32,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            group_idx: None,
        })],
        data_parallel_rank: None,
    }
}

fn removed(hash: i128) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Int(hash)],
            medium: Some("GPU".into()),
            group_idx: None,
        })],
        data_parallel_rank: None,
    }
}

/// Waits, up to `T`, until `cond` holds, re-checking after each change the subscribers note.
async fn until(stats: &SubStats, what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let changed = stats.changed.notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if cond() {
            return;
        }
        if tokio::time::timeout_at(deadline, changed).await.is_err() {
            panic!("within {T:?}: {what}");
        }
    }
}

async fn publisher(addr: &str) -> KvEventsPublisher {
    KvEventsPublisher::bind(addr, "kv", PubLimits::default())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_and_removed_blocks_reach_the_index() {
    let p = publisher("127.0.0.1:0").await;
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(
        vec![(0, format!("tcp://{}", p.local_addr()))],
        b"kv".to_vec(),
        index.clone(),
        limits(),
    );
    assert!(p.wait_subscribed(1, T).await);
    p.publish(&stored(7, None, &[1, 2]));
    p.publish(&stored(8, Some(7), &[3, 4]));
    until(&subs.stats, "two blocks", || {
        index.matched_tokens(0, &[1, 2, 3, 4]) == 4
    })
    .await;
    p.publish(&removed(8));
    until(&subs.stats, "one block left", || {
        index.matched_tokens(0, &[1, 2, 3, 4]) == 2
    })
    .await;
    assert_eq!(
        subs.stats.gaps.load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_gap_drops_the_workers_view() {
    let p = publisher("127.0.0.1:0").await;
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(
        vec![(0, p.local_addr().to_string())],
        vec![],
        index.clone(),
        limits(),
    );
    assert!(p.wait_subscribed(1, T).await);
    p.publish(&stored(7, None, &[1, 2]));
    until(&subs.stats, "block 7", || {
        index.matched_tokens(0, &[1, 2]) == 2
    })
    .await;
    // One batch lost on the way (it could have removed block 7).
    p.skip_sequence(1);
    p.publish(&stored(9, None, &[5, 6]));
    until(&subs.stats, "the gap", || {
        subs.stats.gaps.load(std::sync::atomic::Ordering::Relaxed) == 1
    })
    .await;
    assert_eq!(index.matched_tokens(0, &[1, 2]), 0, "not trusted stale");
    assert_eq!(
        index.matched_tokens(0, &[5, 6]),
        2,
        "rebuilt from the gap on"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_has_its_blocks_cleared() {
    let p = publisher("127.0.0.1:0").await;
    let addr = p.local_addr().to_string();
    let index = Arc::new(KvIndex::new(2, 1000));
    let other = publisher("127.0.0.1:0").await;
    let subs = kv_events_sub::spawn(
        vec![(0, addr.clone()), (1, other.local_addr().to_string())],
        vec![],
        index.clone(),
        limits(),
    );
    assert!(p.wait_subscribed(1, T).await);
    assert!(other.wait_subscribed(1, T).await);
    p.publish(&stored(7, None, &[1, 2]));
    other.publish(&stored(7, None, &[1, 2]));
    until(&subs.stats, "both hold it", || {
        index.matched_tokens(0, &[1, 2]) == 2 && index.matched_tokens(1, &[1, 2]) == 2
    })
    .await;
    drop(p);
    until(&subs.stats, "worker 0 forgotten", || {
        index.matched_tokens(0, &[1, 2]) == 0
    })
    .await;
    assert_eq!(index.matched_tokens(1, &[1, 2]), 2, "the other worker kept");
    // The worker comes back on its port (its sequence starts at 0 again).
    let p = publisher(&addr).await;
    assert!(p.wait_subscribed(1, T).await);
    p.publish(&stored(9, None, &[5, 6]));
    until(&subs.stats, "the new blocks", || {
        index.matched_tokens(0, &[5, 6]) == 2
    })
    .await;
    assert_eq!(index.matched_tokens(0, &[1, 2]), 0);
}

/// A subscriber that sends garbage instead of a greeting, and one that never greets, do not
/// stop the publisher from serving a real one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_subscribers_do_not_stop_the_publisher() {
    use tokio::io::AsyncWriteExt;
    let p = KvEventsPublisher::bind(
        "127.0.0.1:0",
        "",
        PubLimits {
            handshake_timeout: Duration::from_millis(200),
            ..PubLimits::default()
        },
    )
    .await
    .unwrap();
    let mut junk = tokio::net::TcpStream::connect(p.local_addr())
        .await
        .unwrap();
    junk.write_all(&[0xAB; 64]).await.unwrap();
    let _silent = tokio::net::TcpStream::connect(p.local_addr())
        .await
        .unwrap();
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(
        vec![(0, p.local_addr().to_string())],
        vec![],
        index.clone(),
        limits(),
    );
    assert!(p.wait_subscribed(1, T).await);
    p.publish(&stored(7, None, &[1, 2]));
    until(&subs.stats, "block 7", || {
        index.matched_tokens(0, &[1, 2]) == 2
    })
    .await;
}

/// A publisher that is not one (it answers garbage) costs the subscriber a retry, not a hang
/// or a panic, and leaves the worker's view empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_publisher_is_refused() {
    use tokio::io::AsyncWriteExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let server = tokio::spawn(async move {
        for _ in 0..3 {
            let (mut s, _) = l.accept().await.unwrap();
            let _ = s.write_all(&[0xFF; 64]).await;
            let mut long = vec![0x02];
            long.extend_from_slice(&(1u64 << 50).to_be_bytes());
            let _ = s.write_all(&long).await;
        }
    });
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(vec![(0, addr)], vec![], index.clone(), limits());
    until(&subs.stats, "three refusals", || {
        subs.stats
            .disconnects
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 3
    })
    .await;
    assert_eq!(index.blocks(0), 0);
    server.abort();
}

fn pyzmq_ready() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import zmq, msgspec"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn pyzmq_peer(args: &[&str]) -> Option<tokio::process::Child> {
    if !pyzmq_ready() {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with pyzmq and msgspec is required in CI (scripts/setup.sh installs them)"
        );
        eprintln!("SKIPPED: python3 with pyzmq and msgspec not found");
        return None;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/kv_events_zmq_peer.py"
    );
    Some(
        tokio::process::Command::new("python3")
            .arg(script)
            .args(args)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 starts"),
    )
}

async fn first_line(child: &mut tokio::process::Child) -> String {
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    tokio::time::timeout(T, lines.next_line())
        .await
        .expect("the peer prints within the deadline")
        .unwrap()
        .expect("a line")
}

/// libzmq's PUB (pyzmq) publishing msgspec batches reaches our SUB and the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_pub_to_our_sub() {
    let Some(mut child) = pyzmq_peer(&["pub"]) else {
        return;
    };
    let port = first_line(&mut child).await;
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(
        vec![(0, format!("tcp://127.0.0.1:{}", port.trim()))],
        b"kv".to_vec(),
        index.clone(),
        limits(),
    );
    until(&subs.stats, "pyzmq's block", || {
        index.matched_tokens(0, &[1, 2]) == 2
    })
    .await;
}

/// libzmq's PUB bound to an `ipc://` endpoint (how a vLLM worker publishes without listening
/// on every interface) reaches our SUB over the Unix socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_pub_on_ipc_to_our_sub() {
    let dir = std::env::temp_dir().join(format!("kvbridge-kv-events-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ep = format!("ipc://{}", dir.join("pub.sock").display());
    let Some(mut child) = pyzmq_peer(&["pub", &ep]) else {
        return;
    };
    assert_eq!(first_line(&mut child).await.trim(), ep);
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(vec![(0, ep)], b"kv".to_vec(), index.clone(), limits());
    until(&subs.stats, "pyzmq's block over ipc", || {
        index.matched_tokens(0, &[1, 2]) == 2
    })
    .await;
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Our PUB reaches libzmq's SUB (pyzmq), which reads the batch with msgspec.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_pub_to_pyzmq_sub() {
    let p = publisher("127.0.0.1:0").await;
    let port = p.local_addr().port().to_string();
    let Some(mut child) = pyzmq_peer(&["sub", &port]) else {
        return;
    };
    assert!(p.wait_subscribed(1, T).await, "pyzmq subscribed");
    p.publish(&stored(7, None, &[1, 2]));
    let line = first_line(&mut child).await;
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v[0], "kv");
    assert_eq!(v[1], 0);
    assert_eq!(v[2][1][0]["type"], "BlockStored");
    assert_eq!(v[2][1][0]["block_hashes"][0], 7);
    assert_eq!(v[2][1][0]["token_ids"], serde_json::json!([1, 2]));
}

/// A `kv-events` pool renders its subscribers' counters and each worker's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_events_pool_renders_its_counters() {
    use kvbridge_proxy::pool::{Pool, Role};
    use kvbridge_proxy::routing::pool_router::PoolRouter;
    let p = publisher("127.0.0.1:0").await;
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(
        vec![(0, p.local_addr().to_string())],
        vec![],
        index.clone(),
        limits(),
    );
    assert!(p.wait_subscribed(1, T).await);
    p.publish(&stored(7, None, &[1, 2]));
    until(&subs.stats, "block 7", || index.blocks(0) == 1).await;
    let pool = Pool::routed(
        Role::Prefill,
        [("h".to_string(), 1, 0, 0)],
        2,
        1,
        PoolRouter {
            policy: kvbridge_proxy::routing::RoutingPolicy::KvEvents,
            index: Some(index),
            subscribers: Some(subs),
            ..Default::default()
        },
    );
    let mut out = String::new();
    pool.render(&mut out);
    for line in [
        "kvbridge_proxy_kv_events_batches_total{role=\"prefill\"} 1",
        "kvbridge_proxy_kv_events_connects_total{role=\"prefill\"} 1",
        "kvbridge_proxy_kv_events_gaps_total{role=\"prefill\"} 0",
        "kvbridge_proxy_kv_events_blocks{role=\"prefill\",worker=\"h:1\"} 1",
        "# TYPE kvbridge_proxy_kv_events_gaps_total counter",
    ] {
        assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
    }
}
