//! The decoder takes a decode request's KV by the handoff id the proxy sends
//! (`kv_transfer_params.lmcache.pd_handoff_id`), before that KV has finished landing (the
//! proxy's decode-before-`KvReady` order): it waits for the chunks, answers exactly as the
//! colocated engine does once they land, fails at once with `kv_transfer_failed` when the
//! transfer ends early, and refuses an id whose KV is another prompt's. A PD sender driven by
//! the test plays the prefiller, so the order of events is the test's, not a race's.

use kvbridge::ChannelConfig;
use kvbridge_pd::{DisaggSpec, Dtype, KvLayout, KvSpec, PdSender, SenderConfig, Transfer};
use kvbridge_sim::client::{Client, ClientError};
use kvbridge_sim::cost::CostModel;
use kvbridge_sim::engine::{self, EngineConfig, Role, RunningEngine};
use kvbridge_sim::model::{self, Model};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// Upper bound for any single wait in these tests.
const T: Duration = Duration::from_secs(10);

fn small() -> Model {
    Model {
        name: "sim-test".into(),
        spec: KvSpec {
            chunk_tokens: 16,
            ..KvSpec::new(
                KvLayout::Standard {
                    layers: 4,
                    kv_heads: 2,
                    head_dim: 32,
                },
                Dtype::Bf16,
            )
        },
        world_size: 1,
    }
}

async fn engine(role: Role, m: &Model) -> RunningEngine {
    let mut c = EngineConfig::new(role, m.clone());
    c.cost = CostModel::FREE;
    c.buffer_bytes = 16 << 20;
    // The bound the "at once" checks below must beat by far.
    c.retrieve_timeout = T;
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    engine::start(c, l).await.unwrap()
}

struct Setup {
    m: Model,
    dec: RunningEngine,
    col: RunningEngine,
    sender: PdSender,
}

async fn setup() -> Setup {
    let m = small();
    let dec = engine(Role::Decode, &m).await;
    let col = engine(Role::Both, &m).await;
    let sender = PdSender::start(SenderConfig::new(
        ChannelConfig::new("handoff-test-sender", None),
        0,
        1,
        &m.name,
        m.spec,
    ))
    .await
    .unwrap();
    Setup {
        m,
        dec,
        col,
        sender,
    }
}

impl Setup {
    async fn begin(&self, id: &str, tokens: &[u32]) -> Transfer {
        let spec = DisaggSpec {
            req_id: id.into(),
            receiver_host: "127.0.0.1".into(),
            receiver_init_port: self.dec.init_ports().to_vec(),
            receiver_alloc_port: self.dec.alloc_ports().to_vec(),
        };
        self.sender.begin(&spec, tokens).await.unwrap()
    }

    /// Chunk `i` of `tokens`' KV, as the model says it must be.
    fn chunk(&self, tokens: &[u32], i: usize) -> Vec<u8> {
        let p = self.m.prefixes(self.m.start().prefix, tokens);
        let c = self.m.spec.chunk_tokens as usize;
        let part = &p[i * c..((i + 1) * c).min(p.len())];
        let mut buf = vec![0u8; self.m.spec.chunk_bytes(part.len() as u32) as usize];
        self.m.fill_chunk(0, part, &mut buf);
        buf
    }

    /// Sends `body` to the decoder in the background and returns once the decoder has it.
    fn decode(&self, body: Value) -> tokio::task::JoinHandle<Result<String, ClientError>> {
        let url = format!("http://{}/v1/chat/completions", self.dec.http_addr());
        tokio::spawn(async move { Client::new().generate(&url, &body, T).await.map(|a| a.text) })
    }

    /// Waits (bounded) until the decoder has received `n` requests.
    async fn decoder_received(&self, n: u64) {
        until(T, "the decoder never got the request", || {
            self.dec.stats().requests >= n
        })
        .await;
    }

    /// Every transfer and verification over, every page back.
    async fn settled(&self) {
        self.dec.quiesce(T).await.unwrap();
        let until = Instant::now() + T;
        loop {
            let st = self.dec.stats();
            assert_eq!(st.pages_leaked, 0, "{st:?}");
            if st.pages_free == st.pages_total {
                break;
            }
            assert!(Instant::now() < until, "pages not returned: {st:?}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Polls `done` every millisecond; fails the test with `what` once `limit` has passed.
async fn until(limit: Duration, what: &str, done: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < limit, "{what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn chat(content: &str, id: Option<&str>) -> Value {
    let mut b = json!({"model": "sim-test", "stream": true, "max_tokens": 6,
        "messages": [{"role": "user", "content": content}]});
    if let Some(id) = id {
        b["kv_transfer_params"] = json!({"lmcache.pd_handoff_id": id});
    }
    b
}

fn chat_tokens(content: &str) -> Vec<u32> {
    model::tokenize(&model::chat_prompt(&[(
        "user".to_string(),
        content.to_string(),
    )]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_that_lands_after_the_decode_request_gives_the_colocated_output() {
    let s = setup().await;
    let text = model::random_prompt(7, 40);
    let tokens = chat_tokens(&text);
    assert!(tokens.len() > 32, "three chunks");
    let mut t = s.begin("handoff-late", &tokens).await;
    // The decode request is in before a single chunk has landed.
    let answer = s.decode(chat(&text, Some("handoff-late")));
    s.decoder_received(1).await;
    for i in 0..t.chunks() {
        t.send_chunk(i, &s.chunk(&tokens, i as usize))
            .await
            .unwrap();
    }
    t.finish().await.unwrap();
    let got = tokio::time::timeout(T, answer)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let url = format!("http://{}/v1/chat/completions", s.col.http_addr());
    let want = Client::new()
        .generate(&url, &chat(&text, None), T)
        .await
        .unwrap()
        .text;
    assert_eq!(got, want);
    s.settled().await;
    let st = s.dec.stats();
    assert_eq!(st.local_prefills, 0, "{st:?}");
    assert_eq!(st.kv_requests_received, 1, "{st:?}");
    assert_eq!(st.kv_mismatches, 0, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_that_fails_after_the_decode_request_gives_a_clear_error_at_once() {
    let s = setup().await;
    let text = model::random_prompt(8, 40);
    let tokens = chat_tokens(&text);
    let mut t = s.begin("handoff-fails", &tokens).await;
    t.send_chunk(0, &s.chunk(&tokens, 0)).await.unwrap();
    let answer = s.decode(chat(&text, Some("handoff-fails")));
    s.decoder_received(1).await;
    let t0 = Instant::now();
    t.cancel("the test's prefiller gives up").await;
    let r = tokio::time::timeout(T, answer).await.unwrap().unwrap();
    match r {
        Err(ClientError::Status { status, body, .. }) => {
            assert_eq!(status, 500, "{body}");
            assert!(body.contains("kv_transfer_failed"), "{body}");
            assert!(body.contains("handoff-fails"), "{body}");
        }
        other => panic!("expected a 500 kv_transfer_failed, got {other:?}"),
    }
    // Not the retrieve deadline (T): the end of the transfer ended the wait.
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    s.settled().await;
    let st = s.dec.stats();
    assert_eq!(st.local_prefills, 0, "no silent local prefill: {st:?}");
    assert_eq!(st.kv_retrieve_failed, 1, "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handoff_id_whose_kv_is_another_prompts_is_not_used() {
    let s = setup().await;
    let (a, b) = (model::random_prompt(9, 20), model::random_prompt(10, 20));
    let tokens = chat_tokens(&a);
    let mut t = s.begin("handoff-a", &tokens).await;
    for i in 0..t.chunks() {
        t.send_chunk(i, &s.chunk(&tokens, i as usize))
            .await
            .unwrap();
    }
    t.finish().await.unwrap();
    let col = |content: &str| {
        let url = format!("http://{}/v1/chat/completions", s.col.http_addr());
        let body = chat(content, None);
        async move { Client::new().generate(&url, &body, T).await.unwrap().text }
    };
    // Prompt b naming a's KV: the chunk keys over b's tokens differ from a's, so the id is
    // not trusted: b finds no KV of its own and is prefilled locally (counted), right.
    let got = tokio::time::timeout(T, s.decode(chat(&b, Some("handoff-a"))))
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(got, col(&b).await);
    assert_eq!(s.dec.stats().local_prefills, 1);
    assert_eq!(s.dec.stats().kv_requests_received, 0);
    // a's own decode still gets a's KV.
    let got = tokio::time::timeout(T, s.decode(chat(&a, Some("handoff-a"))))
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(got, col(&a).await);
    s.settled().await;
    let st = s.dec.stats();
    assert_eq!(st.kv_requests_received, 1, "{st:?}");
    assert_eq!(st.kv_mismatches, 0, "{st:?}");
}

/// A decode request that goes away while it waits for its KV (its client hung up) gives
/// the pages back at once, not when the receiver's TTL (60 s) runs out, and the transfer is
/// ended for the sender too: nobody is left to read that KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_request_whose_client_hangs_up_returns_the_pages_at_once() {
    let s = setup().await;
    let text = model::random_prompt(11, 40);
    let tokens = chat_tokens(&text);
    let mut t = s.begin("handoff-dropped", &tokens).await;
    assert!(t.chunks() >= 3);
    t.send_chunk(0, &s.chunk(&tokens, 0)).await.unwrap();
    let answer = s.decode(chat(&text, Some("handoff-dropped")));
    // The decoder has claimed the KV and waits for chunk 1.
    until(T, "the decoder never claimed the KV", || {
        s.dec.stats().kv_requests_received >= 1
    })
    .await;
    assert!(s.dec.stats().pages_free < s.dec.stats().pages_total);
    // The client hangs up: its connection closes.
    answer.abort();
    let _ = answer.await;
    let all_free = || {
        let st = s.dec.stats();
        st.pages_free == st.pages_total
    };
    until(
        Duration::from_secs(5),
        "pages still held after the client left",
        all_free,
    )
    .await;
    // The sender is told: its next chunk finds the request cancelled.
    let e = t.send_chunk(1, &s.chunk(&tokens, 1)).await.unwrap_err();
    assert!(e.to_string().contains("handoff-dropped"), "{e}");
    s.settled().await;
    let st = s.dec.stats();
    assert_eq!(st.pages_leaked, 0, "{st:?}");
}
