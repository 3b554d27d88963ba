//! Tensor parallelism: one channel per rank pair, every rank's outcome at the proxy, and
//! MLA send-once.

mod common;
use common::*;
use kvbridge_pd::{
    DisaggSpec, Dtype, KvLayout, KvSpec, Outcome, OutcomeSink, PdError, PdReceiver, PdSender,
    ReceiverConfig, SenderConfig, ZmqPusher,
};
use std::collections::BTreeMap;

fn mla() -> KvSpec {
    KvSpec {
        chunk_tokens: 16,
        ..KvSpec::new(
            KvLayout::Mla {
                layers: 2,
                latent_dim: 64,
            },
            Dtype::Bf16,
        )
    }
}

/// `n` decoder ranks and `n` prefiller ranks (rank r → rank r), outcomes over ZMQ PUSH to
/// `endpoint`.
async fn ranks(
    n: u32,
    spec: KvSpec,
    send_once: bool,
    endpoint: &str,
) -> (Vec<PdReceiver>, Vec<PdSender>) {
    let mut rxs = Vec::new();
    let mut txs = Vec::new();
    for r in 0..n {
        let mut rc = ReceiverConfig::new(
            channel(&format!("decode-{r}"), true),
            r,
            spec,
            8 * spec.page_bytes(),
        );
        rc.alloc_timeout = 3 * S;
        rc.ttl = 10 * S;
        rxs.push(PdReceiver::start(rc).await.unwrap());
        let mut sc = SenderConfig::new(channel(&format!("prefill-{r}"), false), r, n, "m", spec);
        sc.outcomes = OutcomeSink::Zmq(ZmqPusher::spawn(endpoint.to_string(), 5 * S));
        sc.alloc_deadline = 5 * S;
        sc.step_deadline = 5 * S;
        sc.mla_send_once = send_once;
        txs.push(PdSender::start(sc).await.unwrap());
    }
    (rxs, txs)
}

fn disagg_all(req_id: &str, rxs: &[PdReceiver]) -> DisaggSpec {
    DisaggSpec {
        req_id: req_id.into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: rxs.iter().map(|r| r.local_addr().unwrap().port()).collect(),
        receiver_alloc_port: vec![],
    }
}

/// Collects one outcome per rank from the PULL socket (fails on a duplicate or a timeout).
async fn outcomes_by_rank(pull: &mut zeromq::PullSocket, n: u32) -> BTreeMap<u32, Outcome> {
    let mut got = BTreeMap::new();
    while got.len() < n as usize {
        let o = next_outcome(pull, 5 * S)
            .await
            .unwrap_or_else(|| panic!("only {} of {n} outcomes: {got:?}", got.len()));
        let rank = match &o {
            Outcome::KvReady { rank, .. } | Outcome::KvFailed { rank, .. } => *rank,
            other => panic!("unexpected {other:?}"),
        };
        assert!(
            got.insert(rank, o).is_none(),
            "two outcomes for rank {rank}"
        );
    }
    got
}

/// N = 2: each prefiller rank writes its own KV to its decoder rank over its own channel; the
/// proxy's PULL sees both ranks' `KvReady`; both decoder ranks hold byte-exact KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_ranks_each_report_and_kv_is_exact_on_both() {
    let (mut proxy, ep) = pull().await;
    let s = spec();
    let (rxs, txs) = ranks(2, s, false, &ep).await;
    let ds = disagg_all("tp", &rxs);
    let toks = tokens(7, 40); // 3 chunks, the last partial
    let mut sent = Vec::new();
    for (r, tx) in txs.iter().enumerate() {
        let mut t = tx.begin(&ds, &toks).await.unwrap();
        let mut kvs = Vec::new();
        for i in 0..t.chunks() {
            // Rank-specific KV: a mix-up between ranks shows.
            let data = kv(100 + r as u32, i, t.chunk_bytes(i) as usize);
            t.send_chunk(i, &data).await.unwrap();
            kvs.push(data);
        }
        t.finish().await.unwrap();
        sent.push(kvs);
    }
    let got = outcomes_by_rank(&mut proxy, 2).await;
    for r in 0..2u32 {
        assert_eq!(
            got[&r],
            Outcome::KvReady {
                req_id: "tp".into(),
                rank: r,
                chunks: 3,
                bytes: 40 * s.bytes_per_token(),
                sent_by: None,
            }
        );
    }
    for (r, rx) in rxs.iter().enumerate() {
        assert_eq!(rx.retrieve("tp", S).await.unwrap(), sent[r], "rank {r}");
        let c = rx.counters();
        assert_eq!((c.free, c.leaked), (8, 0), "rank {r}");
        // One session per rank pair: decoder rank r saw only prefiller rank r.
        assert_eq!(rx.channel().stats().await.unwrap().established, 1);
    }
}

/// MLA send-once with N = 2: rank 0 writes once (to decoder rank 0); rank 1 writes nothing
/// and its outcome says rank 0 sent for it. A standard layout refuses the option.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mla_send_once_rank0_sends_others_report() {
    let (mut proxy, ep) = pull().await;
    let s = mla();
    let (rxs, txs) = ranks(2, s, true, &ep).await;
    assert!(!txs[0].follows() && txs[1].follows());
    let ds = disagg_all("once", &rxs);
    let toks = tokens(9, 20);
    let mut kvs = Vec::new();
    for tx in &txs {
        let mut t = tx.begin(&ds, &toks).await.unwrap();
        for i in 0..t.chunks() {
            // Identical KV on every rank (MLA).
            let data = kv(9, i, t.chunk_bytes(i) as usize);
            t.send_chunk(i, &data).await.unwrap();
            if tx.rank() == 0 {
                kvs.push(data);
            }
        }
        let sum = t.finish().await.unwrap();
        let expect = if tx.rank() == 0 {
            (20 * s.bytes_per_token(), None)
        } else {
            (0, Some(0))
        };
        assert_eq!((sum.bytes, sum.sent_by), expect);
    }
    let got = outcomes_by_rank(&mut proxy, 2).await;
    assert!(matches!(
        &got[&0],
        Outcome::KvReady { bytes, sent_by: None, .. } if *bytes == 20 * s.bytes_per_token()
    ));
    assert_eq!(
        got[&1],
        Outcome::KvReady {
            req_id: "once".into(),
            rank: 1,
            chunks: 2,
            bytes: 0,
            sent_by: Some(0),
        }
    );
    assert_eq!(rxs[0].retrieve("once", S).await.unwrap(), kvs);
    // Decoder rank 1 got nothing and was never contacted.
    assert_eq!(rxs[1].counters().requests, 0);
    assert_eq!(rxs[1].channel().stats().await.unwrap().established, 0);

    let mut sc = SenderConfig::new(channel("p", false), 0, 2, "m", spec());
    sc.mla_send_once = true;
    let err = PdSender::start(sc).await.unwrap_err();
    assert!(
        matches!(&err, PdError::Config(m) if m.contains("MLA")),
        "{err}"
    );
}
