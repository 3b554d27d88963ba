//! The reference engine's prefix cache and its KV events over real ZMQ-over-TCP: what a
//! prefill computes is published as `BlockStored` and reaches the proxy's index; a prompt
//! whose chunks are cached is charged only for the rest; eviction publishes `BlockRemoved`;
//! a restarted engine starts a fresh sequence led by `AllBlocksCleared`; and a decoder that
//! received a prompt's KV prefills a longer prompt over it locally.

use std::sync::Arc;
use std::time::Duration;

use kvbridge::proto::kv_events::{
    decode_batch, split_message, DecodeLimits, KvEvent, KvEventBatch,
};
use kvbridge::proto::zmtp::{frame, PullEvent, PullLimits, PullSession};
use kvbridge_pd::{Dtype, KvLayout, KvSpec};
use kvbridge_proxy::kv_events_sub::{self, SubLimits, SubStats};
use kvbridge_proxy::routing::kv_index::KvIndex;
use kvbridge_sim::client::Client;
use kvbridge_sim::cost::CostModel;
use kvbridge_sim::engine::{self, EngineConfig, Role, RunningEngine};
use kvbridge_sim::model::Model;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const T: Duration = Duration::from_secs(10);
const CHUNK: usize = 16;

fn small() -> Model {
    Model {
        name: "sim-test".into(),
        spec: KvSpec {
            chunk_tokens: CHUNK as u32,
            ..KvSpec::new(
                KvLayout::Standard {
                    layers: 2,
                    kv_heads: 2,
                    head_dim: 32,
                },
                Dtype::Bf16,
            )
        },
        world_size: 1,
    }
}

async fn engine_at(role: Role, cache_tokens: u64, events: &str) -> RunningEngine {
    let mut c = EngineConfig::new(role, small());
    c.cost = CostModel::FREE;
    c.buffer_bytes = 16 << 20;
    c.prefix_cache_tokens = cache_tokens;
    c.kv_events_endpoint = Some(events.to_string());
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    engine::start(c, l).await.unwrap()
}

fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (seed * 7919 + i * 31) % 4900)
        .collect()
}

async fn complete(e: &RunningEngine, tokens: &[u32]) {
    let url = format!("http://{}/v1/completions", e.http_addr());
    let body = json!({"model": "sim-test", "prompt": tokens, "max_tokens": 2});
    Client::new()
        .generate(&url, &body, T)
        .await
        .expect("the engine answers");
}

/// A bare ZMQ SUB (our ZMTP code) that hands every `(sequence, batch)` to the test.
struct RawSub {
    stream: TcpStream,
    session: PullSession,
    buf: Vec<u8>,
    pending: std::collections::VecDeque<(u64, KvEventBatch)>,
}

impl RawSub {
    async fn connect(addr: std::net::SocketAddr) -> RawSub {
        let mut session = PullSession::with_socket_types(
            PullLimits {
                max_frame: 1 << 20,
                max_frames: 3,
            },
            "SUB",
            b"PUB",
        );
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(&session.start()).await.unwrap();
        let mut buf = vec![0u8; 64 * 1024];
        while !session.established() {
            let n = tokio::time::timeout(T, stream.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert!(n > 0, "the publisher closed during the handshake");
            for ev in session.feed(&buf[..n]).unwrap() {
                if let PullEvent::Send(b) = ev {
                    stream.write_all(&b).await.unwrap();
                }
            }
        }
        stream.write_all(&frame(0, &[1u8])).await.unwrap();
        RawSub {
            stream,
            session,
            buf,
            pending: Default::default(),
        }
    }

    async fn next(&mut self) -> (u64, KvEventBatch) {
        loop {
            if let Some(b) = self.pending.pop_front() {
                return b;
            }
            let n = tokio::time::timeout(T, self.stream.read(&mut self.buf))
                .await
                .expect("a batch within the deadline")
                .unwrap();
            assert!(n > 0, "the publisher closed");
            for ev in self.session.feed(&self.buf[..n]).unwrap() {
                if let PullEvent::Message(frames) = ev {
                    let (_, seq, payload) = split_message(&frames).unwrap();
                    let b = decode_batch(payload, &DecodeLimits::default()).unwrap();
                    self.pending.push_back((seq, b));
                }
            }
        }
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

/// The engine publishes only on a change, and only to subscriptions it has taken in: each
/// test waits until the publisher counted both subscribers before the first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_chunks_reach_the_proxy_and_cached_ones_are_not_charged() {
    let e = engine_at(Role::Both, 1 << 20, "tcp://127.0.0.1:0").await;
    let addr = e.kv_events_addr().expect("publishing");
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(
        vec![(0, format!("tcp://{addr}"))],
        Vec::new(),
        index.clone(),
        SubLimits {
            retry: Duration::from_millis(20),
            ..SubLimits::default()
        },
    );
    let mut raw = RawSub::connect(addr).await;
    assert!(e.wait_kv_subscribers(2, T).await, "both subscribed");
    let p = prompt(1, 2 * CHUNK + 5);
    complete(&e, &p).await;
    let (seq, first) = raw.next().await;
    assert_eq!(seq, 0, "a new engine's sequence starts at 0");
    assert_eq!(
        first.events.first(),
        Some(&KvEvent::AllBlocksCleared),
        "a new engine's first batch clears whatever an earlier one reported"
    );
    let KvEvent::BlockStored(s) = &first.events[1] else {
        panic!("{first:?}");
    };
    assert_eq!(s.block_hashes.len(), 2, "whole chunks only");
    assert_eq!(s.token_ids, p[..2 * CHUNK]);
    assert_eq!(s.block_size, CHUNK as u32);
    until(
        &subs.stats,
        "the proxy's index holds the prompt's chunks",
        || index.matched_tokens(0, &p) == 2 * CHUNK,
    )
    .await;
    let before = e.stats();
    assert_eq!(before.prefill_tokens_computed, p.len() as u64);
    // Again, and longer: only what the cache does not hold is computed.
    let longer = [p.clone(), prompt(2, CHUNK)].concat();
    complete(&e, &longer).await;
    let after = e.stats();
    assert_eq!(
        after.prefill_tokens_computed - before.prefill_tokens_computed,
        (longer.len() - 2 * CHUNK) as u64
    );
    assert_eq!(
        after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens,
        2 * CHUNK as u64
    );
    let (seq, b) = raw.next().await;
    assert_eq!(seq, 1);
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!("{b:?}");
    };
    assert_eq!(s.block_hashes.len(), 1, "the one new whole chunk");
    assert_eq!(
        s.parent_block_hash.as_ref(),
        first.events.get(1).and_then(|e| match e {
            KvEvent::BlockStored(f) => f.block_hashes.last(),
            _ => None,
        }),
        "chained to the chunks stored before"
    );
    until(&subs.stats, "the index follows", || {
        index.matched_tokens(0, &longer) == 3 * CHUNK
    })
    .await;
    e.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_publishes_block_removed_and_a_restart_a_fresh_sequence() {
    // Room for two chunks.
    let e = engine_at(Role::Both, 2 * CHUNK as u64, "tcp://127.0.0.1:0").await;
    let addr = e.kv_events_addr().unwrap();
    let index = Arc::new(KvIndex::new(1, 1000));
    let subs = kv_events_sub::spawn(
        vec![(0, format!("tcp://{addr}"))],
        Vec::new(),
        index.clone(),
        SubLimits {
            retry: Duration::from_millis(20),
            ..SubLimits::default()
        },
    );
    let mut raw = RawSub::connect(addr).await;
    assert!(e.wait_kv_subscribers(2, T).await, "both subscribed");
    let a = prompt(3, 2 * CHUNK);
    let b = prompt(4, 2 * CHUNK);
    complete(&e, &a).await;
    let (_, stored_a) = raw.next().await;
    let KvEvent::BlockStored(sa) = &stored_a.events[1] else {
        panic!("{stored_a:?}");
    };
    until(&subs.stats, "a held", || {
        index.matched_tokens(0, &a) == 2 * CHUNK
    })
    .await;
    complete(&e, &b).await;
    let (seq, evicted) = raw.next().await;
    assert_eq!(seq, 1);
    let removed: Vec<_> = evicted
        .events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) => Some(r.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    let mut want = sa.block_hashes.clone();
    want.reverse(); // the tail goes first
    assert_eq!(removed, want, "{evicted:?}");
    until(&subs.stats, "a evicted, b held", || {
        index.matched_tokens(0, &a) == 0 && index.matched_tokens(0, &b) == 2 * CHUNK
    })
    .await;
    assert_eq!(e.stats().prefix_cache_chunks, 2);
    // A reset (vLLM's POST /reset_prefix_cache) clears everything, on the same sequence.
    let url = format!("http://{}/reset_prefix_cache", e.http_addr());
    let r = reqwest_free_post(&url).await;
    assert_eq!(r, 200);
    let (seq, cleared) = raw.next().await;
    assert_eq!((seq, cleared.events), (2, vec![KvEvent::AllBlocksCleared]));
    until(&subs.stats, "b cleared", || {
        index.matched_tokens(0, &b) == 0
    })
    .await;
    // A restart on the same port: the sequence starts over with AllBlocksCleared.
    e.shutdown().await;
    drop(raw);
    // The old publisher's port is free once its accept task has been dropped (aborted with
    // the engine): bind again until it is, within the deadline.
    let deadline = tokio::time::Instant::now() + T;
    let e = loop {
        let mut c = EngineConfig::new(Role::Both, small());
        c.cost = CostModel::FREE;
        c.buffer_bytes = 16 << 20;
        c.prefix_cache_tokens = 2 * CHUNK as u64;
        c.kv_events_endpoint = Some(format!("tcp://{addr}"));
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        match engine::start(c, l).await {
            Ok(e) => break e,
            Err(err) if tokio::time::Instant::now() < deadline => {
                let _ = err;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(err) => panic!("restarting on {addr}: {err}"),
        }
    };
    let mut raw = RawSub::connect(addr).await;
    assert!(e.wait_kv_subscribers(2, T).await, "both subscribed again");
    complete(&e, &b).await;
    let (seq, first) = raw.next().await;
    assert_eq!(seq, 0, "a fresh sequence");
    assert_eq!(first.events[0], KvEvent::AllBlocksCleared);
    until(&subs.stats, "the restarted engine's chunks", || {
        index.matched_tokens(0, &b) == 2 * CHUNK
    })
    .await;
    e.shutdown().await;
}

/// A POST with an empty body over a plain TCP connection; the status code.
async fn reqwest_free_post(url: &str) -> u16 {
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_once('/').unwrap();
    let mut s = TcpStream::connect(host).await.unwrap();
    s.write_all(
        format!("POST /{path} HTTP/1.1\r\nhost: {host}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(T, s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let head = String::from_utf8_lossy(&out);
    head.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

/// A decoder that received a prompt's KV holds it: a longer prompt sent to it alone (no
/// KV announced) is prefilled locally over the cached chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_that_received_a_prefix_prefills_over_it_locally() {
    let m = small();
    let c = kvbridge_sim::demo::Cluster::start(1, 1, &m, CostModel::FREE, 16 << 20)
        .await
        .unwrap();
    let client = Client::new();
    let p = prompt(5, 3 * CHUNK);
    let body = json!({"model": "sim-test", "prompt": p, "max_tokens": 2});
    client
        .generate(&format!("{}/v1/completions", c.proxy_url()), &body, T)
        .await
        .unwrap();
    c.quiesce(T).await.unwrap();
    let d = &c.decoders[0];
    let s = d.stats();
    assert_eq!(
        s.kv_requests_received, 1,
        "the KV came through the PD layer"
    );
    assert_eq!(s.prefix_cache_chunks, 3, "and is cached");
    assert_eq!(s.prefill_tokens_computed, 0);
    let longer = [p.clone(), prompt(6, 10)].concat();
    let body = json!({"model": "sim-test", "prompt": longer, "max_tokens": 2});
    let alone = client
        .generate(
            &format!("http://{}/v1/completions", d.http_addr()),
            &body,
            T,
        )
        .await
        .unwrap();
    let reference = client
        .generate(&format!("{}/v1/completions", c.colocated_url()), &body, T)
        .await
        .unwrap();
    assert_eq!(
        alone.text, reference.text,
        "the cached state is the prompt's"
    );
    let s = d.stats();
    assert_eq!(s.local_prefills, 1);
    assert_eq!(s.prefill_tokens_computed, 10, "only the uncached tail");
    assert_eq!(s.prefix_cache_hit_tokens, 3 * CHUNK as u64);
    c.shutdown().await;
}
