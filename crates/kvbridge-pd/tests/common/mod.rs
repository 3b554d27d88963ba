//! Helpers for the PD integration tests (included with `mod common;`).
#![allow(dead_code)]

use kvbridge::ChannelConfig;
use kvbridge_pd::{
    DisaggSpec, Dtype, KvLayout, KvSpec, Outcome, OutcomeSink, PdReceiver, PdSender,
    ReceiverConfig, SenderConfig,
};
use std::time::Duration;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv};

/// 2 layers × 2 × 2 heads × 16 dims × fp16 = 256 bytes per token; 16-token chunks (4 KiB).
pub fn spec() -> KvSpec {
    KvSpec {
        chunk_tokens: 16,
        ..KvSpec::new(
            KvLayout::Standard {
                layers: 2,
                kv_heads: 2,
                head_dim: 16,
            },
            Dtype::Fp16,
        )
    }
}

pub const S: Duration = Duration::from_secs(1);

pub fn channel(name: &str, listen: bool) -> ChannelConfig {
    let mut c = ChannelConfig::new(name, listen.then_some("127.0.0.1:0"));
    c.deadlines.op = Duration::from_secs(5);
    // What the PD sender and receiver add: raw channels of these tests talk to them.
    c.compat = kvbridge_pd::with_key_scheme(&c.compat);
    c
}

pub async fn receiver(pages: u64, tweak: impl FnOnce(&mut ReceiverConfig)) -> PdReceiver {
    let s = spec();
    let mut cfg = ReceiverConfig::new(channel("decode-0", true), 0, s, pages * s.page_bytes());
    cfg.alloc_timeout = 3 * S;
    cfg.ttl = 10 * S;
    tweak(&mut cfg);
    PdReceiver::start(cfg).await.unwrap()
}

pub async fn sender(name: &str, outcomes: OutcomeSink) -> PdSender {
    sender_with(name, outcomes, |_| {}).await
}

pub async fn sender_with(
    name: &str,
    outcomes: OutcomeSink,
    tweak: impl FnOnce(&mut SenderConfig),
) -> PdSender {
    let mut cfg = SenderConfig::new(channel(name, false), 0, 1, "test-model", spec());
    cfg.outcomes = outcomes;
    cfg.alloc_deadline = 5 * S;
    cfg.step_deadline = 5 * S;
    tweak(&mut cfg);
    PdSender::start(cfg).await.unwrap()
}

/// A pull-mode sender; `read_delay` holds every read the receiver makes of it in flight.
pub async fn pull_sender(
    name: &str,
    outcomes: OutcomeSink,
    read_delay: Option<Duration>,
) -> PdSender {
    sender_with(name, outcomes, |c| {
        c.mode = kvbridge_pd::TransferMode::Pull;
        c.channel.hooks.read_serve_delay = read_delay;
    })
    .await
}

/// Waits (up to 5 s) until `ch` has a batch in flight.
pub async fn batch_in_flight(ch: &kvbridge::Channel) -> bool {
    let until = tokio::time::Instant::now() + 5 * S;
    while tokio::time::Instant::now() < until {
        if ch.stats().await.unwrap().batches_in_flight > 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

pub fn queue() -> (OutcomeSink, mpsc::UnboundedReceiver<Outcome>) {
    let (tx, rx) = mpsc::unbounded_channel();
    (OutcomeSink::Queue(tx), rx)
}

pub fn disagg(req_id: &str, rx: &PdReceiver) -> DisaggSpec {
    DisaggSpec {
        req_id: req_id.into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: vec![rx.local_addr().unwrap().port()],
        receiver_alloc_port: vec![],
    }
}

/// Prompt tokens, distinct per request (no accidental prefix sharing).
pub fn tokens(req: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| req * 1_000_003 + i).collect()
}

/// The KV bytes of chunk `i` of request `req`: position-unique.
pub fn kv(req: u32, i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|b| {
            let mut x = (req as u64) << 40 ^ i << 20 ^ b as u64;
            x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            (x >> 56) as u8
        })
        .collect()
}

/// Polls `f` every 5 ms until it holds or `deadline` passes.
pub async fn eventually(deadline: Duration, mut f: impl FnMut() -> bool) -> bool {
    let until = tokio::time::Instant::now() + deadline;
    loop {
        if f() {
            return true;
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A ZMQ PULL socket on 127.0.0.1 (the proxy's side); returns it and its `tcp://` address.
pub async fn pull() -> (zeromq::PullSocket, String) {
    let mut s = zeromq::PullSocket::new();
    let ep = s.bind("tcp://127.0.0.1:0").await.unwrap();
    (s, ep.to_string())
}

/// The next outcome on a PULL socket, or `None` when `deadline` passes first.
pub async fn next_outcome(s: &mut zeromq::PullSocket, deadline: Duration) -> Option<Outcome> {
    let m = tokio::time::timeout(deadline, s.recv()).await.ok()?.ok()?;
    let bytes: Vec<u8> = m.into_vec().into_iter().flat_map(|b| b.to_vec()).collect();
    Some(Outcome::decode(&bytes).expect("outcome decodes"))
}
