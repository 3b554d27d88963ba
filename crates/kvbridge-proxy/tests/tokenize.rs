//! The `/tokenize` client over real sockets: against a raw TCP stub that answers what a
//! broken or hostile worker would (every reply a typed error within the deadline, never a
//! panic), and in the proxy: `--routing kv-events` with `--kv-events-tokenize http` sends a
//! chat to the decoder whose KV events hold its tokens, and still serves it, ranked by load
//! and counted by reason, when the call fails.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::http::HeaderValue;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvbridge_proto::kv_events::{
    encode_batch, message, BlockHash, BlockStored, KvEvent, KvEventBatch,
};
use kvbridge_proxy::config::{Config, DecoderConfig, Flow, WorkerAddr};
use kvbridge_proxy::routing::RoutingPolicy;
use kvbridge_proxy::tokenize::{call, HttpClient, TokenizeError, TokenizeMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Upper bound for any single wait in these tests.
const T: Duration = Duration::from_secs(10);

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

// ---------------------------------------------------------------- the client alone

/// What the stub does with each connection.
#[derive(Clone)]
enum Script {
    /// Writes these bytes, then closes.
    Bytes(Vec<u8>),
    /// Writes the head of a chunked reply, then `[` chunks for ever.
    EndlessChunks,
    /// Writes a head, then nothing, holding the connection.
    HeadThenSilence,
    /// Closes as soon as the request is read.
    Close,
}

/// A raw TCP server: reads one request per connection (headers and `Content-Length` body),
/// keeps it, and follows its script.
async fn stub(script: Script) -> (SocketAddr, Arc<std::sync::Mutex<Vec<Vec<u8>>>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let script = script.clone();
            let seen = seen2.clone();
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let Ok(Ok(n)) = tokio::time::timeout(T, s.read(&mut buf)).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    req.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&req).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if req.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                seen.lock().unwrap().push(req);
                match script {
                    Script::Bytes(b) => {
                        let _ = s.write_all(&b).await;
                        let _ = s.shutdown().await;
                    }
                    Script::EndlessChunks => {
                        let head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                                    transfer-encoding: chunked\r\n\r\n";
                        if s.write_all(head.as_bytes()).await.is_err() {
                            return;
                        }
                        let chunk = format!("1000\r\n{}\r\n", "[".repeat(0x1000));
                        let t0 = Instant::now();
                        while t0.elapsed() < T {
                            if s.write_all(chunk.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                    }
                    Script::HeadThenSilence => {
                        let head = "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"tokens\":[";
                        let _ = s.write_all(head.as_bytes()).await;
                        tokio::time::sleep(T).await;
                    }
                    Script::Close => {}
                }
            });
        }
    });
    (addr, seen)
}

fn reply(status: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

const DEADLINE: Duration = Duration::from_millis(500);
const LIMIT: usize = 64 * 1024;

async fn ask(addr: SocketAddr) -> (Result<Vec<u32>, TokenizeError>, Duration) {
    let t0 = Instant::now();
    let auth = HeaderValue::from_static("Bearer k");
    let r = call(
        &client(),
        "w0",
        format!("http://{addr}/tokenize").parse().unwrap(),
        Some(&auth),
        Some(&HeaderValue::from_static("req-7")),
        br#"{"model":"m","prompt":"a b"}"#.to_vec(),
        DEADLINE,
        LIMIT,
    )
    .await;
    (r, t0.elapsed())
}

#[tokio::test]
async fn a_valid_reply_gives_its_token_ids_and_the_request_carries_body_and_auth() {
    let (addr, seen) = stub(Script::Bytes(reply(
        "200 OK",
        br#"{"count":3,"max_model_len":1024,"tokens":[5,0,4294967295],"token_strs":null}"#,
    )))
    .await;
    let (r, _) = ask(addr).await;
    assert_eq!(r, Ok(vec![5, 0, u32::MAX]));
    let req = String::from_utf8(seen.lock().unwrap()[0].clone()).unwrap();
    assert!(req.starts_with("POST /tokenize HTTP/1.1\r\n"), "{req}");
    assert!(
        req.to_ascii_lowercase().contains("authorization: bearer k"),
        "{req}"
    );
    assert!(
        req.to_ascii_lowercase().contains("x-request-id: req-7"),
        "{req}"
    );
    assert!(req.ends_with(r#"{"model":"m","prompt":"a b"}"#), "{req}");
}

#[tokio::test]
async fn hostile_replies_are_typed_errors_within_the_deadline() {
    let deep = format!(
        "{{\"tokens\":{}1{}}}",
        "[".repeat(50_000),
        "]".repeat(50_000)
    );
    let many: String = (0..LIMIT).map(|_| "1,").collect();
    let cases: Vec<(&str, Script, &str)> = vec![
        (
            "500",
            Script::Bytes(reply("500 Internal Server Error", b"{}")),
            "status",
        ),
        (
            "404",
            Script::Bytes(reply("404 Not Found", b"{\"detail\":\"Not Found\"}")),
            "status",
        ),
        (
            "negative id",
            Script::Bytes(reply("200 OK", br#"{"tokens":[1,-1]}"#)),
            "malformed",
        ),
        (
            "id over u32",
            Script::Bytes(reply("200 OK", br#"{"tokens":[4294967296]}"#)),
            "malformed",
        ),
        (
            "no tokens",
            Script::Bytes(reply("200 OK", br#"{"count":2}"#)),
            "malformed",
        ),
        (
            "not JSON",
            Script::Bytes(reply("200 OK", b"<html>no</html>")),
            "malformed",
        ),
        (
            "nested",
            Script::Bytes(reply("200 OK", deep.as_bytes())),
            "too_large",
        ),
        (
            "deep within the limit",
            Script::Bytes(reply(
                "200 OK",
                format!("{{\"tokens\":{}", "[".repeat(30_000)).as_bytes(),
            )),
            "malformed",
        ),
        (
            "declared too large",
            Script::Bytes(b"HTTP/1.1 200 OK\r\ncontent-length: 999999999\r\n\r\n{".to_vec()),
            "too_large",
        ),
        (
            "too many tokens",
            Script::Bytes(reply(
                "200 OK",
                format!("{{\"tokens\":[{many}1]}}").as_bytes(),
            )),
            "too_large",
        ),
        ("endless chunks", Script::EndlessChunks, "too_large"),
        (
            "short body",
            Script::Bytes(
                b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{\"tokens\":[1]}".to_vec(),
            ),
            "unreachable",
        ),
        (
            "not HTTP",
            Script::Bytes(b"SSH-2.0-OpenSSH\r\n\r\n".to_vec()),
            "unreachable",
        ),
        ("closed", Script::Close, "unreachable"),
        ("silent", Script::HeadThenSilence, "timeout"),
    ];
    for (name, script, want) in cases {
        let (addr, _) = stub(script).await;
        let (r, took) = ask(addr).await;
        let e = r.expect_err(name);
        assert_eq!(e.reason(), want, "{name}: {e}");
        assert!(
            e.to_string().contains("w0"),
            "{name}: names the worker: {e}"
        );
        assert!(
            took < DEADLINE + Duration::from_millis(400),
            "{name}: took {took:?}"
        );
    }
    // A port nothing listens on.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    let (r, _) = ask(addr).await;
    assert_eq!(r.unwrap_err().reason(), "unreachable");
}

// ---------------------------------------------------------------- in the proxy

/// A worker double: `/health`, both OpenAI APIs (answering at once, counted) and
/// `/tokenize`, which answers `TOKENS` unless the prompt names another reply.
struct Worker {
    addr: SocketAddr,
    calls: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The tokens every `/tokenize` reply gives (two blocks of 4 and a partial one).
const TOKENS: [u32; 10] = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20];
const BLOCK: u32 = 4;

async fn tokenize_double(body: Bytes) -> Response {
    let text = String::from_utf8_lossy(&body);
    if text.contains("@malformed") {
        return (StatusCode::OK, r#"{"tokens":[1,"x"]}"#).into_response();
    }
    if text.contains("@slow") {
        tokio::time::sleep(T).await;
    }
    if text.contains("@500") {
        return (StatusCode::INTERNAL_SERVER_ERROR, "{}").into_response();
    }
    let v = serde_json::json!({"count": TOKENS.len(), "max_model_len": 1024, "tokens": TOKENS});
    (StatusCode::OK, v.to_string()).into_response()
}

async fn openai(State(calls): State<Arc<AtomicU64>>) -> Response {
    calls.fetch_add(1, Relaxed);
    let v = serde_json::json!({"id": "x", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]});
    (StatusCode::OK, v.to_string()).into_response()
}

impl Worker {
    async fn start() -> Worker {
        let calls = Arc::new(AtomicU64::new(0));
        let app = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/tokenize", post(tokenize_double))
            .route("/v1/chat/completions", post(openai))
            .route("/v1/completions", post(openai))
            .with_state(calls.clone());
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Worker { addr, calls, task }
    }
}

/// A KV-events publisher saying it holds `TOKENS`' two whole blocks.
async fn publisher() -> (zeromq::PubSocket, String) {
    let mut s = zeromq::PubSocket::new();
    let ep = s.bind("tcp://127.0.0.1:0").await.unwrap();
    let port = match ep {
        zeromq::Endpoint::Tcp(_, p) => p,
        e => panic!("{e:?}"),
    };
    (s, format!("tcp://127.0.0.1:{port}"))
}

async fn publish(s: &mut zeromq::PubSocket, seq: u64) {
    let batch = KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash::Int(1), BlockHash::Int(2)],
            parent_block_hash: None,
            token_ids: TOKENS[..8].to_vec(),
            block_size: BLOCK,
            lora_id: None,
            medium: None,
            lora_name: None,
            group_idx: None,
        })],
        data_parallel_rank: None,
    };
    let frames = message(b"", seq, encode_batch(&batch));
    let mut m = ZmqMessage::from(Bytes::from(frames[0].clone()));
    for f in &frames[1..] {
        m.push_back(Bytes::from(f.clone()));
    }
    let _ = tokio::time::timeout(T, s.send(m)).await;
}

struct Env {
    proxy: kvbridge_proxy::server::RunningProxy,
    decoders: Vec<Worker>,
    _prefiller: Worker,
    _pubs: (zeromq::PubSocket, zeromq::PubSocket),
}

/// A proxy routing by KV events over two decoders, whose second reports holding `TOKENS`'
/// blocks; every request goes to its decoder alone (the decider's threshold is above any
/// prompt).
async fn env(mode: TokenizeMode) -> Env {
    let prefiller = Worker::start().await;
    let decoders = vec![Worker::start().await, Worker::start().await];
    let (p0, e0) = publisher().await;
    let (mut p1, e1) = publisher().await;
    let cfg = Config {
        host: "127.0.0.1".into(),
        port: 0,
        flow: Flow::Vllm,
        health_interval: Duration::ZERO,
        queue_timeout: Duration::ZERO,
        prefill_timeout: T,
        decode_timeout: T,
        routing: RoutingPolicy::KvEvents,
        prefillers: vec![WorkerAddr {
            host: "127.0.0.1".into(),
            port: prefiller.addr.port(),
        }],
        decoders: decoders
            .iter()
            .map(|d| DecoderConfig {
                host: "127.0.0.1".into(),
                port: d.addr.port(),
                init_ports: vec![],
                alloc_ports: vec![],
                max_requests: 0,
                kv_capacity_tokens: 0,
            })
            .collect(),
        ..Config::default()
    };
    let mut cfg = cfg;
    cfg.kv_events.decoder_endpoints = vec![e0, e1];
    cfg.kv_events.tokenize = mode;
    cfg.kv_events.tokenize_timeout = 0.3;
    cfg.disaggregation.min_uncached_tokens = Some(1 << 30);
    let proxy = kvbridge_proxy::server::start(cfg).await.unwrap();
    let url = format!("http://{}/metrics", proxy.http_addr());
    // Publish until the proxy's index holds decoder 1's blocks (a PUB drops what it sends
    // before the subscriber is in).
    let held = format!(
        "kvbridge_proxy_kv_events_blocks{{role=\"decode\",worker=\"127.0.0.1:{}\"}}",
        decoders[1].addr.port()
    );
    let t0 = Instant::now();
    let mut seq = 0;
    loop {
        publish(&mut p1, seq).await;
        seq += 1;
        let m = get_text(&url).await;
        if sample(&m, &held) == 2.0 {
            break;
        }
        assert!(
            t0.elapsed() < T,
            "the proxy never indexed decoder 1's blocks:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Env {
        proxy,
        decoders,
        _prefiller: prefiller,
        _pubs: (p0, p1),
    }
}

async fn get_text(url: &str) -> String {
    let r = tokio::time::timeout(T, client().get(url.parse().unwrap()))
        .await
        .unwrap()
        .unwrap();
    let b = r.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&b).to_string()
}

fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)
                .map(|v| v.trim().parse().unwrap_or(-1.0))
        })
        .unwrap_or(-1.0)
}

impl Env {
    async fn chat(&self, content: &str) -> StatusCode {
        let body = serde_json::json!({"model": "m", "max_tokens": 4,
            "messages": [{"role": "system", "content": "a long shared document"},
                         {"role": "user", "content": content}]});
        let req = hyper::Request::post(format!(
            "http://{}/v1/chat/completions",
            self.proxy.http_addr()
        ))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
        let r = tokio::time::timeout(T, client().request(req))
            .await
            .expect("answered within the deadline")
            .unwrap();
        r.status()
    }

    async fn metrics(&self) -> String {
        get_text(&format!("http://{}/metrics", self.proxy.http_addr())).await
    }

    fn calls(&self) -> Vec<u64> {
        self.decoders
            .iter()
            .map(|d| d.calls.load(Relaxed))
            .collect()
    }
}

const MATCHED: &str =
    "kvbridge_proxy_routing_decisions_total{role=\"decode\",policy=\"kv-events\",matched=\"true\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenized_chat_goes_to_the_decoder_holding_its_blocks() {
    let e = env(TokenizeMode::Http).await;
    for i in 0..4 {
        assert_eq!(e.chat(&format!("question {i}")).await, StatusCode::OK);
    }
    let m = e.metrics().await;
    assert_eq!(e.calls(), vec![0, 4], "{m}");
    assert_eq!(sample(&m, MATCHED), 4.0, "{m}");
    assert_eq!(
        sample(&m, "kvbridge_proxy_tokenize_total{result=\"ok\"}"),
        4.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tokenize_a_chat_matches_nothing() {
    let e = env(TokenizeMode::Off).await;
    for i in 0..4 {
        assert_eq!(e.chat(&format!("question {i}")).await, StatusCode::OK);
    }
    let m = e.metrics().await;
    assert_eq!(sample(&m, MATCHED), 0.0, "{m}");
    assert_eq!(
        sample(&m, "kvbridge_proxy_tokenize_total{result=\"ok\"}"),
        0.0
    );
    assert!(e.calls()[0] > 0, "spread by load: {:?}", e.calls());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_tokenize_still_serves_the_request_by_load_and_counts_why() {
    let e = env(TokenizeMode::Http).await;
    let t0 = Instant::now();
    for (marker, reason) in [
        ("@malformed", "malformed"),
        ("@500", "status"),
        ("@slow", "timeout"),
    ] {
        assert_eq!(e.chat(marker).await, StatusCode::OK, "{marker}");
        let m = e.metrics().await;
        let n = format!("kvbridge_proxy_tokenize_total{{result=\"{reason}\"}}");
        assert_eq!(sample(&m, &n), 1.0, "{marker}:\n{m}");
    }
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let m = e.metrics().await;
    assert_eq!(sample(&m, MATCHED), 0.0, "{m}");
    assert_eq!(e.calls().iter().sum::<u64>(), 3);
}
