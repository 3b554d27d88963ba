//! End-to-end tests over real sockets: the proxy in front of prefiller and decoder doubles.
//!
//! The doubles choose their behaviour from markers in the request body (`@p500`, `@kvfail`,
//! ...), so one pool of doubles serves requests that each fail in their own way.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvbridge_proxy::config::{Config, DecoderConfig, Flow, WorkerAddr};
use kvbridge_proxy::notif::{self, Notif};
use kvbridge_proxy::server::{self, RunningProxy};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};
use zeromq::{Socket, SocketSend, ZmqMessage};

mod common;
use common::{Answer, ChanBody};

/// Upper bound for any single wait in these tests.
const T: Duration = Duration::from_secs(10);

/// The alloc port a decoder is given to be one the prefiller double cannot reach (`@unreach`).
const UNREACHABLE_PORT: u16 = 7999;

// ---------------------------------------------------------------- doubles

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Prefill,
    Decode,
}

struct DState {
    kind: Kind,
    healthy: AtomicBool,
    hold: Notify,
    push: tokio::sync::Mutex<Option<zeromq::PushSocket>>,
    seen: Mutex<Vec<(HeaderMap, Value)>>,
    calls: AtomicU64,
    /// `GET /health` calls answered.
    health_calls: AtomicU64,
}

struct Double {
    addr: SocketAddr,
    st: Arc<DState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Double {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Double {
    async fn start(kind: Kind) -> Double {
        let st = Arc::new(DState {
            kind,
            healthy: AtomicBool::new(true),
            hold: Notify::new(),
            push: tokio::sync::Mutex::new(None),
            seen: Mutex::new(Vec::new()),
            calls: AtomicU64::new(0),
            health_calls: AtomicU64::new(0),
        });
        let app = Router::new()
            .route("/v1/completions", post(openai))
            .route("/v1/chat/completions", post(openai))
            .route("/health", get(dhealth))
            .route(
                "/v1/models",
                get(|| async {
                    (
                        [("content-type", "application/json")],
                        json!({"object": "list", "data": [{"id": "double-model"}]}).to_string(),
                    )
                }),
            )
            .with_state(st.clone());
        // Bound before anything is sent to it: no readiness wait needed.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Double { addr, st, task }
    }

    async fn connect_notify(&self, addr: SocketAddr) {
        let mut s = zeromq::PushSocket::new();
        tokio::time::timeout(T, s.connect(&format!("tcp://{addr}")))
            .await
            .unwrap()
            .unwrap();
        *self.st.push.lock().await = Some(s);
    }

    fn last(&self) -> (HeaderMap, Value) {
        self.st
            .seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("the double saw no request")
    }
}

/// A decoder double's KV init port: a listener that accepts and drops connections, which
/// can be closed (connections refused) and opened again on the same port.
struct KvPort {
    port: u16,
    task: Option<tokio::task::JoinHandle<()>>,
    /// Connections accepted so far.
    accepted: Arc<AtomicU64>,
}

impl KvPort {
    async fn open() -> KvPort {
        let mut k = KvPort {
            port: 0,
            task: None,
            accepted: Arc::new(AtomicU64::new(0)),
        };
        k.listen().await;
        k
    }

    async fn listen(&mut self) {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        // Our closed listener's accepted connections may linger in TIME_WAIT on the port.
        sock.set_reuseaddr(true).unwrap();
        sock.bind(SocketAddr::from(([127, 0, 0, 1], self.port)))
            .unwrap();
        let l = sock.listen(16).unwrap();
        self.port = l.local_addr().unwrap().port();
        let accepted = self.accepted.clone();
        self.task = Some(tokio::spawn(async move {
            while let Ok((c, _)) = l.accept().await {
                accepted.fetch_add(1, Relaxed);
                drop(c);
            }
        }));
    }

    /// Closes the listener; returns once the port refuses connections.
    async fn close(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
            let _ = t.await;
        }
    }
}

impl Drop for KvPort {
    fn drop(&mut self) {
        if let Some(t) = &self.task {
            t.abort();
        }
    }
}

async fn dhealth(State(st): State<Arc<DState>>) -> StatusCode {
    st.health_calls.fetch_add(1, Relaxed);
    if st.healthy.load(Relaxed) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn push(st: &DState, msg: Notif) {
    if let Some(s) = st.push.lock().await.as_mut() {
        s.send(ZmqMessage::from(notif::encode(&msg))).await.unwrap();
    }
}

fn err_json(status: StatusCode, msg: &str) -> Response {
    (
        status,
        [("content-type", "application/json")],
        json!({"error": {"message": msg, "type": "x"}}).to_string(),
    )
        .into_response()
}

async fn openai(
    State(st): State<Arc<DState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    st.calls.fetch_add(1, Relaxed);
    let text = String::from_utf8_lossy(&body).to_string();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    {
        let mut seen = st.seen.lock().unwrap();
        if seen.len() >= 64 {
            seen.remove(0);
        }
        seen.push((headers, v.clone()));
    }
    let chat = uri.path().contains("chat");
    let has = |m: &str| text.contains(m);
    if st.kind == Kind::Prefill {
        if has("@p500") {
            return err_json(StatusCode::INTERNAL_SERVER_ERROR, "prefill exploded");
        }
        if has("@p400") {
            return err_json(StatusCode::BAD_REQUEST, "prompt too long for this model");
        }
        let spec = v.pointer("/kv_transfer_params/disagg_spec");
        if let Some(spec) = spec {
            let id = spec["req_id"].as_str().unwrap_or_default().to_string();
            let ranks = spec["receiver_init_port"]
                .as_array()
                .map(|a| a.len())
                .unwrap_or(1) as u32;
            let cut = spec["receiver_alloc_port"][0].as_u64() == Some(UNREACHABLE_PORT.into());
            if (has("@unreach") && cut) || has("@kvfail500") {
                for r in 0..ranks {
                    push(
                        &st,
                        Notif::KvFailed {
                            req_id: id.clone(),
                            rank: r,
                            reason: "connect: connection refused".into(),
                        },
                    )
                    .await;
                }
                // The answer follows the outcome, as a real prefiller's may.
                tokio::time::sleep(Duration::from_millis(20)).await;
                if has("@kvfail500") {
                    return err_json(StatusCode::INTERNAL_SERVER_ERROR, "prefill exploded");
                }
                let e = json!({"error": {"message": "announcing: the decoder is unreachable",
                    "type": "server_error", "code": "kv_receiver_unreachable"}});
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [("content-type", "application/json")],
                    e.to_string(),
                )
                    .into_response();
            }
            if has("@kvfail") || has("@kvslowfail") {
                push(
                    &st,
                    Notif::KvReady {
                        req_id: id.clone(),
                        rank: 0,
                        chunks: 1,
                        bytes: 1,
                    },
                )
                .await;
                push(
                    &st,
                    Notif::KvFailed {
                        req_id: id,
                        rank: ranks - 1,
                        reason: "receiver buffer full".into(),
                    },
                )
                .await;
                if has("@kvslowfail") {
                    tokio::time::sleep(Duration::from_secs(8)).await;
                }
            } else if has("@late") {
                let st2 = st.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    for r in 0..ranks {
                        push(
                            &st2,
                            Notif::KvReady {
                                req_id: id.clone(),
                                rank: r,
                                chunks: 2,
                                bytes: 64,
                            },
                        )
                        .await;
                    }
                });
            } else if has("@plain") {
                for _ in 0..ranks {
                    push(&st, Notif::ProxyNotif { req_id: id.clone() }).await;
                }
            } else if !has("@nonotify") && !has("@dready") && !has("@dfail") {
                for r in 0..ranks {
                    push(
                        &st,
                        Notif::KvReady {
                            req_id: id.clone(),
                            rank: r,
                            chunks: 2,
                            bytes: 64,
                        },
                    )
                    .await;
                }
            }
        }
        let msg = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": " first"}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": " first", "finish_reason": "length"})
        };
        let r = json!({"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "double-model",
            "choices": [msg], "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "engine-p", "remote_block_ids": [1, 2, 3]}});
        return ([("content-type", "application/json")], r.to_string()).into_response();
    }
    // Decoder.
    if has("@dhold") {
        // Answers only once the test says so (`hold.notify_one`).
        let _ = tokio::time::timeout(T, st.hold.notified()).await;
    }
    if has("@dready") || has("@dfail") {
        // The KV's outcome comes only once the decode request is here: it was sent first.
        let id = v
            .pointer("/kv_transfer_params/lmcache.pd_handoff_id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if has("@dready") {
            for r in 0..2 {
                push(
                    &st,
                    Notif::KvReady {
                        req_id: id.clone(),
                        rank: r,
                        chunks: 2,
                        bytes: 64,
                    },
                )
                .await;
            }
        } else {
            push(
                &st,
                Notif::KvFailed {
                    req_id: id,
                    rank: 1,
                    reason: "sender cancelled mid-transfer".into(),
                },
            )
            .await;
            // A decoder whose KV never comes: only its own deadline would end this.
            tokio::time::sleep(T).await;
            return err_json(StatusCode::INTERNAL_SERVER_ERROR, "KV never arrived");
        }
    }
    if has("@d500") {
        return err_json(StatusCode::INTERNAL_SERVER_ERROR, "decoder exploded");
    }
    if has("@slow") {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let chunk = move |i: usize| {
        let c = if chat {
            json!({"index": 0, "delta": {"content": format!(" d{i}")}, "finish_reason": null})
        } else {
            json!({"index": 0, "text": format!(" d{i}"), "finish_reason": null})
        };
        Bytes::from(format!(
            "data: {}\n\n",
            json!({"id": "cmpl-d", "choices": [c]})
        ))
    };
    if !stream {
        if has("@die") {
            // Announce a longer body than is sent, then close: a truncated answer.
            let (tx, rx) = mpsc::channel(4);
            tokio::spawn(async move {
                let _ = tx.send(Ok(Bytes::from_static(b"{\"choices\": ["))).await;
                let _ = tx.send(Err(std::io::Error::other("decoder died"))).await;
            });
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::new(ChanBody::<std::io::Error>(rx)))
                .unwrap();
        }
        let c = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": " d0 d1"}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": " d0 d1", "finish_reason": "length"})
        };
        let r = json!({"id": "cmpl-d", "object": "text_completion", "created": 2, "model": "double-model",
            "choices": [c], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}});
        return ([("content-type", "application/json")], r.to_string()).into_response();
    }
    let (tx, rx) = mpsc::channel(16);
    let (die, hold, drip) = (has("@die"), has("@hold"), has("@drip"));
    let st2 = st.clone();
    tokio::spawn(async move {
        let n = if drip { 10 } else { 3 };
        for i in 0..n {
            if tx.send(Ok(chunk(i))).await.is_err() {
                return;
            }
            if i == 0 && hold {
                let _ = tokio::time::timeout(T, st2.hold.notified()).await;
            }
            if drip {
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            if i == 1 && die {
                // Let the chunks already sent reach the wire, then break the connection.
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = tx.send(Err(std::io::Error::other("decoder died"))).await;
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::new(ChanBody::<std::io::Error>(rx)))
        .unwrap()
}

// ---------------------------------------------------------------- harness

struct Env {
    proxy: RunningProxy,
    p: Vec<Double>,
    d: Vec<Double>,
    client: Client<HttpConnector, Full<Bytes>>,
}

fn base_config(flow: Flow) -> Config {
    Config {
        host: "127.0.0.1".into(),
        port: 0,
        proxy_host: "127.0.0.1".into(),
        proxy_port: 0,
        flow,
        kv_ready_timeout: Duration::from_millis(300),
        prefill_timeout: Duration::from_secs(5),
        decode_timeout: Duration::from_secs(5),
        health_interval: Duration::ZERO,
        queue_timeout: Duration::ZERO,
        ..Config::default()
    }
}

async fn env(flow: Flow, np: usize, nd: usize, tweak: impl FnOnce(&mut Config)) -> Env {
    let mut p = Vec::new();
    let mut d = Vec::new();
    for _ in 0..np {
        p.push(Double::start(Kind::Prefill).await);
    }
    for _ in 0..nd {
        d.push(Double::start(Kind::Decode).await);
    }
    let mut cfg = base_config(flow);
    cfg.prefillers = p
        .iter()
        .map(|x| WorkerAddr {
            host: "127.0.0.1".into(),
            port: x.addr.port(),
        })
        .collect();
    cfg.decoders = d
        .iter()
        .map(|x| DecoderConfig {
            host: "127.0.0.1".into(),
            port: x.addr.port(),
            init_ports: vec![7300, 7301],
            alloc_ports: vec![7400, 7401],
            max_requests: 0,
            kv_capacity_tokens: 0,
        })
        .collect();
    tweak(&mut cfg);
    // The proxy closes a kept-alive connection once it has idled for its header deadline, as
    // HTTP/1.1 allows; a request sent on that connection at that moment meets the close
    // (`IncompleteMessage`). Where a test shortens the deadline below its own waits, the
    // harness opens a connection per request rather than race that close.
    let mut client = Client::builder(TokioExecutor::new());
    if cfg.http_limits.header_timeout < T {
        client.pool_max_idle_per_host(0);
    }
    let proxy = server::start(cfg).await.unwrap();
    if let Some(n) = proxy.notify_addr() {
        // Decoders too: some doubles report the KV's outcome once the decode request is in.
        for x in p.iter().chain(&d) {
            x.connect_notify(n).await;
        }
    }
    let client = client.build(HttpConnector::new());
    Env {
        proxy,
        p,
        d,
        client,
    }
}

impl Env {
    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.proxy.http_addr())
    }

    async fn send(&self, method: &str, path: &str, body: Bytes, rid: Option<&str>) -> Answer {
        let mut b = hyper::Request::builder()
            .method(method)
            .uri(self.url(path))
            .header("content-type", "application/json");
        if let Some(r) = rid {
            b = b.header("x-request-id", r);
        }
        common::fetch(&self.client, b.body(Full::new(body)).unwrap(), T).await
    }

    async fn post(&self, path: &str, v: Value) -> Answer {
        self.send("POST", path, Bytes::from(v.to_string()), None)
            .await
    }

    async fn metrics(&self) -> String {
        self.send("GET", "/metrics", Bytes::new(), None)
            .await
            .text()
    }

    /// Polls `/metrics` until the sample `name` reads `want` (the guards of a finished stream
    /// are released just after its last byte, so the gauges settle a moment later).
    async fn settle(&self, name: &str, want: f64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = self.metrics().await;
            let got = sample(&m, name);
            if got == Some(want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{name} = {got:?}, want {want}\n{m}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn settled(&self) {
        for n in [
            "kvbridge_proxy_in_flight",
            "kvbridge_proxy_admission_slots_taken",
            "kvbridge_proxy_prefill_slots_taken",
            "kvbridge_proxy_kv_waits_pending",
            "kvbridge_proxy_admission_queue",
        ] {
            self.settle(n, 0.0).await;
        }
    }
}

fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|r| r.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

fn completion(prompt: &str, stream: bool) -> Value {
    json!({"model": "double-model", "prompt": prompt, "max_tokens": 3, "stream": stream})
}

fn chat(content: &str, stream: bool) -> Value {
    json!({"model": "double-model", "messages": [{"role": "user", "content": content}], "max_tokens": 3, "stream": stream})
}

/// A port with nothing listening on it.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

// ---------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lmcache_success_non_streamed_and_streamed() {
    let e = env(Flow::Lmcache, 1, 1, |_| {}).await;
    let a = e
        .send(
            "POST",
            "/v1/completions",
            Bytes::from(completion("hello", false).to_string()),
            Some("client-42"),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.headers["x-request-id"], "client-42");
    let v = a.json();
    assert_eq!(
        v["choices"][0]["text"], " first d0 d1",
        "first token, then the decoder's"
    );
    assert_eq!(v["usage"]["completion_tokens"], 3);

    let (ph, pv) = e.p[0].last();
    assert_eq!(ph["x-request-id"], "client-42");
    assert_eq!(pv["max_tokens"], 1);
    assert_eq!(pv["stream"], false);
    let spec = &pv["kv_transfer_params"]["disagg_spec"];
    assert!(
        spec["req_id"]
            .as_str()
            .is_some_and(|s| s.starts_with("kvb-")),
        "{pv}"
    );
    assert_eq!(spec["receiver_host"], "127.0.0.1");
    assert_eq!(spec["receiver_init_port"], json!([7300, 7301]));
    assert_eq!(spec["receiver_alloc_port"], json!([7400, 7401]));
    let (dh, dv) = e.d[0].last();
    assert_eq!(dh["x-request-id"], "client-42");
    assert_eq!(dv["prompt"], "hello first");
    assert_eq!(dv["max_tokens"], 2);
    // The PD request id goes to the decoder too, under LMCache's own key (LMCache reads a
    // `disagg_spec` as a prefill order, so the decode request carries none).
    assert_eq!(
        dv["kv_transfer_params"],
        json!({"lmcache.pd_handoff_id": spec["req_id"]}),
        "{dv}"
    );

    // Streamed: the first token comes first, then the decoder's chunks and [DONE].
    let a = e
        .post("/v1/completions", completion("hello @late", true))
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.headers["content-type"], "text/event-stream");
    let t = a.text();
    let (f, d0, done) = (
        t.find("\" first\"").unwrap(),
        t.find(" d0").unwrap(),
        t.find("[DONE]").unwrap(),
    );
    assert!(f < d0 && d0 < done, "{t}");
    assert!(!t.contains("event: error"));

    // Chat, with LMCache's plain ProxyNotif outcomes: the prefill's first token comes first,
    // and the decoder continues it (a last assistant message, `continue_final_message`).
    let a = e
        .post("/v1/chat/completions", chat("hi @plain", true))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let t = a.text();
    assert!(t.contains(" d2") && t.ends_with("data: [DONE]\n\n"), "{t}");
    assert!(
        t.find("\" first\"").unwrap() < t.find(" d0").unwrap(),
        "{t}"
    );
    let (_, dv) = e.d[0].last();
    assert_eq!(dv["messages"][0]["content"], "hi @plain");
    assert_eq!(
        dv["messages"][1],
        json!({"role": "assistant", "content": " first"})
    );
    assert_eq!(dv["continue_final_message"], true);
    assert_eq!(dv["add_generation_prompt"], false);
    assert_eq!(dv["max_tokens"], 2);
    let (_, pv) = e.p[0].last();
    assert_eq!(
        dv["kv_transfer_params"]["lmcache.pd_handoff_id"],
        pv["kv_transfer_params"]["disagg_spec"]["req_id"]
    );

    // max_tokens == 1: the prefill's token is the whole answer.
    let a = e
        .post("/v1/completions", json!({"prompt": "x", "max_tokens": 1}))
        .await;
    assert_eq!(a.json()["choices"][0]["text"], " first");
    assert!(a.json().get("kv_transfer_params").is_none());
    let a = e
        .post(
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 5, "max_completion_tokens": 1, "stream": true}),
        )
        .await;
    assert!(
        a.text().contains("\"finish_reason\":\"length\"") && a.text().ends_with("data: [DONE]\n\n"),
        "{}",
        a.text()
    );

    e.settled().await;
    let m = e.metrics().await;
    assert_eq!(
        sample(&m, "kvbridge_proxy_requests_total{outcome=\"ok\"}"),
        Some(5.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "kvbridge_proxy_kv_wait_seconds_count"),
        Some(5.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "kvbridge_proxy_kv_outcomes_total{type=\"ProxyNotif\"}"),
        Some(2.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_flow_passes_kv_transfer_params_from_prefill_to_decode() {
    let e = env(Flow::Vllm, 2, 2, |_| {}).await;
    assert!(e.proxy.notify_addr().is_none());
    for stream in [false, true] {
        let a = e.post("/v1/completions", completion("hello", stream)).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        if stream {
            assert!(
                a.text().contains(" d2") && a.text().ends_with("data: [DONE]\n\n"),
                "{}",
                a.text()
            );
        } else {
            assert_eq!(a.json()["choices"][0]["text"], " d0 d1");
        }
    }
    let a = e.post("/v1/chat/completions", chat("hi", false)).await;
    assert_eq!(a.json()["choices"][0]["message"]["content"], " d0 d1");
    // Least loaded with ties spread: both prefillers and both decoders were used.
    assert!(e.p.iter().all(|p| p.st.calls.load(Relaxed) > 0));
    assert!(e.d.iter().all(|d| d.st.calls.load(Relaxed) > 0));
    let (_, pv) =
        e.p.iter()
            .max_by_key(|p| p.st.calls.load(Relaxed))
            .unwrap()
            .last();
    assert_eq!(pv["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(pv["max_tokens"], 1);
    let (_, dv) =
        e.d.iter()
            .max_by_key(|d| d.st.calls.load(Relaxed))
            .unwrap()
            .last();
    assert_eq!(dv["kv_transfer_params"]["remote_engine_id"], "engine-p");
    assert_eq!(
        dv["max_tokens"], 3,
        "the decoder gets the original max_tokens"
    );
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_outcome_never_arrives_gives_504_within_the_deadline() {
    let e = env(Flow::Lmcache, 1, 1, |c| {
        c.kv_ready_timeout = Duration::from_millis(300)
    })
    .await;
    for stream in [false, true] {
        let t = Instant::now();
        let a = e
            .post("/v1/completions", completion("@nonotify", stream))
            .await;
        let el = t.elapsed();
        assert_eq!(a.status, StatusCode::GATEWAY_TIMEOUT, "{}", a.text());
        assert_eq!(a.code(), "kv_ready_timeout");
        assert!(
            el >= Duration::from_millis(300) && el < Duration::from_secs(3),
            "{el:?}"
        );
    }
    assert_eq!(e.d[0].st.calls.load(Relaxed), 0, "no decode without KV");
    e.settled().await;
    let m = e.metrics().await;
    assert_eq!(
        sample(&m, "kvbridge_proxy_requests_total{outcome=\"kv_timeout\"}"),
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefiller_error_gives_502_and_its_4xx_passes_through() {
    let e = env(Flow::Lmcache, 1, 1, |_| {}).await;
    let a = e.post("/v1/completions", completion("@p500", false)).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert_eq!(a.code(), "prefill_failed");
    // The worker's error text stays in the proxy's log; the client gets a generic message.
    assert_eq!(
        a.json()["error"]["message"],
        "the prefill failed",
        "{}",
        a.text()
    );
    assert!(!a.text().contains("exploded"), "{}", a.text());
    let a = e.post("/v1/completions", completion("@p400", true)).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(a.text().contains("prompt too long"));
    assert_eq!(e.d[0].st.calls.load(Relaxed), 0);
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_failed_gives_502_at_once() {
    let e = env(Flow::Lmcache, 1, 1, |c| {
        c.kv_ready_timeout = Duration::from_secs(20)
    })
    .await;
    // The failure arrives after the prefill answered, and while the prefill still runs.
    for marker in ["@kvfail", "@kvslowfail"] {
        let t = Instant::now();
        let a = e.post("/v1/completions", completion(marker, true)).await;
        assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
        assert_eq!(a.code(), "kv_transfer_failed");
        assert_eq!(a.json()["error"]["message"], "the KV cache transfer failed");
        assert!(!a.text().contains("buffer full"), "{}", a.text());
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{marker}: {:?}",
            t.elapsed()
        );
    }
    assert_eq!(e.d[0].st.calls.load(Relaxed), 0);
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_the_prefiller_cannot_reach_has_the_request_moved_to_another() {
    // Decoder 0's KV ports are out of the prefiller's reach; its HTTP answers.
    let e = env(Flow::Lmcache, 1, 2, |c| {
        c.decoders[0].alloc_ports = vec![UNREACHABLE_PORT, UNREACHABLE_PORT + 1]
    })
    .await;
    // Ties spread round-robin, so decoder 0 is picked within two requests. Its prefill
    // reports `KvFailed` on every rank first and answers `kv_receiver_unreachable` 20 ms
    // later: the proxy waits for that answer and starts the request over on decoder 1.
    for stream in [false, true, false, true] {
        let a = e
            .post("/v1/completions", completion("@unreach", stream))
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    assert_eq!(
        e.d[0].st.calls.load(Relaxed),
        0,
        "no decode reached decoder 0"
    );
    assert_eq!(e.d[1].st.calls.load(Relaxed), 4);
    let prefills = e.p[0].st.calls.load(Relaxed);
    assert!(prefills >= 5, "one prefill per attempt: {prefills}");
    let m = e.metrics().await;
    assert_eq!(
        sample(&m, "kvbridge_proxy_decoder_retries_total"),
        Some((prefills - 4) as f64),
        "{m}"
    );
    assert_eq!(
        sample(&m, "kvbridge_proxy_requests_total{outcome=\"ok\"}"),
        Some(4.0),
        "{m}"
    );
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_failed_then_another_prefill_error_stays_kv_transfer_failed() {
    let e = env(Flow::Lmcache, 1, 2, |_| {}).await;
    let a = e
        .post("/v1/completions", completion("@kvfail500", false))
        .await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
    assert_eq!(a.code(), "kv_transfer_failed", "{}", a.text());
    assert_eq!(e.p[0].st.calls.load(Relaxed), 1, "not retried");
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_goes_out_before_kv_ready_and_its_answer_waits_for_it() {
    // `@dready`: no outcome until the decoder has the decode request (it reports then).
    let e = env(Flow::Lmcache, 1, 1, |c| {
        c.kv_ready_timeout = Duration::from_secs(5);
        c.decode_after_kv_ready = false;
    })
    .await;
    let a = e
        .post("/v1/completions", completion("@dready", false))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.json()["choices"][0]["text"], " first d0 d1");
    let (_, dv) = e.d[0].last();
    assert!(
        dv.pointer("/kv_transfer_params/lmcache.pd_handoff_id")
            .and_then(Value::as_str)
            .is_some_and(|id| id.starts_with("kvb-")),
        "{dv}"
    );
    let a = e.post("/v1/completions", completion("@dready", true)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert!(
        a.text().contains(" first") && a.text().ends_with("data: [DONE]\n\n"),
        "{}",
        a.text()
    );
    let a = e.post("/v1/chat/completions", chat("@dready", true)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert!(
        a.text().contains(" d2") && a.text().ends_with("data: [DONE]\n\n"),
        "{}",
        a.text()
    );
    assert_eq!(e.d[0].st.calls.load(Relaxed), 3);
    e.settled().await;
    let m = e.metrics().await;
    assert_eq!(
        sample(&m, "kvbridge_proxy_kv_wait_seconds_count"),
        Some(3.0),
        "{m}"
    );

    // The old order (the default): the decode waits for outcomes that only the decode
    // would cause, so the KV wait times out and the decoder is never called.
    let e = env(Flow::Lmcache, 1, 1, |c| {
        c.kv_ready_timeout = Duration::from_millis(300)
    })
    .await;
    let a = e.post("/v1/completions", completion("@dready", true)).await;
    assert_eq!(a.code(), "kv_ready_timeout", "{}", a.text());
    assert_eq!(e.d[0].st.calls.load(Relaxed), 0);
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_failed_after_the_decode_was_sent_gives_502_at_once() {
    // `@dfail`: the decoder is called, a rank reports KvFailed, the decoder never
    // answers (its KV will not come). The client gets the typed error at once, and the
    // dropped decode frees every slot.
    let e = env(Flow::Lmcache, 1, 1, |c| {
        c.kv_ready_timeout = Duration::from_secs(20);
        c.decode_after_kv_ready = false;
    })
    .await;
    for (path, body) in [
        ("/v1/completions", completion("@dfail", true)),
        ("/v1/completions", completion("@dfail", false)),
        ("/v1/chat/completions", chat("@dfail", true)),
    ] {
        let t = Instant::now();
        let a = e.post(path, body).await;
        assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
        assert_eq!(a.code(), "kv_transfer_failed");
        assert!(!a.text().contains("sender cancelled"), "{}", a.text());
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
    assert_eq!(e.d[0].st.calls.load(Relaxed), 3);
    e.settled().await;
    // And a KV that never comes after the decode was sent: the KV deadline still holds.
    let e = env(Flow::Lmcache, 1, 1, |c| {
        c.kv_ready_timeout = Duration::from_millis(300);
        c.decode_after_kv_ready = false;
    })
    .await;
    let t = Instant::now();
    let a = e
        .post("/v1/completions", completion("@nonotify", true))
        .await;
    assert_eq!(a.code(), "kv_ready_timeout", "{}", a.text());
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_dies_mid_stream_gives_an_sse_error_event() {
    let e = env(Flow::Vllm, 1, 1, |_| {}).await;
    let a = e.post("/v1/completions", completion("@die", true)).await;
    assert_eq!(a.status, StatusCode::OK);
    let t = a.text();
    assert!(t.contains(" d0") && t.contains(" d1"), "{t}");
    let ev = t
        .find("event: error\ndata: ")
        .unwrap_or_else(|| panic!("no error event: {t}"));
    let data: Value = serde_json::from_str(t[ev + 18..].lines().next().unwrap()).unwrap();
    assert_eq!(data["error"]["code"], "decoder_stream_failed");
    assert!(!t.contains("[DONE]"));
    // Not streamed: the truncated answer becomes a 502.
    let a = e.post("/v1/completions", completion("@die", false)).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
    let a = e.post("/v1/completions", completion("@d500", true)).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY);
    assert_eq!(
        a.json()["error"]["message"],
        "the decode failed",
        "{}",
        a.text()
    );
    e.settled().await;
    let m = e.metrics().await;
    assert_eq!(
        sample(
            &m,
            "kvbridge_proxy_requests_total{outcome=\"decode_error\"}"
        ),
        Some(3.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_down_gives_503() {
    let e = env(Flow::Vllm, 0, 0, |c| {
        c.prefillers = vec![
            WorkerAddr {
                host: "127.0.0.1".into(),
                port: closed_port()
            };
            2
        ];
        c.prefillers[1].port = closed_port();
        c.decoders = vec![DecoderConfig {
            host: "127.0.0.1".into(),
            port: closed_port(),
            init_ports: vec![],
            alloc_ports: vec![],
            max_requests: 0,
            kv_capacity_tokens: 0,
        }];
    })
    .await;
    // Both prefillers refuse: each is ejected, then there is none left.
    let a = e.post("/v1/completions", completion("x", false)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text());
    assert_eq!(a.code(), "no_healthy_worker");
    let h = e.send("GET", "/health", Bytes::new(), None).await;
    assert_eq!(h.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(h.json()["prefillers_healthy"], 0);
    e.settled().await;

    // Prefillers up, the only decoder down: 503 once it refuses, then at once.
    let p = Double::start(Kind::Prefill).await;
    let e2 = env(Flow::Vllm, 0, 0, |c| {
        c.prefillers = vec![WorkerAddr {
            host: "127.0.0.1".into(),
            port: p.addr.port(),
        }];
        c.decoders = vec![DecoderConfig {
            host: "127.0.0.1".into(),
            port: closed_port(),
            init_ports: vec![],
            alloc_ports: vec![],
            max_requests: 0,
            kv_capacity_tokens: 0,
        }];
    })
    .await;
    let a = e2.post("/v1/completions", completion("x", true)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(a.code(), "decoder_unavailable");
    let a = e2.post("/v1/completions", completion("x", true)).await;
    assert_eq!(a.code(), "no_healthy_worker");
    assert_eq!(
        p.st.calls.load(Relaxed),
        1,
        "no prefill once no decoder is healthy"
    );
    e2.settled().await;
}

/// One prefiller and one decoder, whose ranks' KV init ports are `kv`, health-checked every
/// 20 ms (2 checks eject, 2 re-admit), then `tweak`; with the decoder's health metric name.
async fn checked_env(kv: &[KvPort], tweak: impl FnOnce(&mut Config)) -> (Env, String) {
    let e = env(Flow::Vllm, 1, 1, |c| {
        c.health_interval = Duration::from_millis(20);
        c.unhealthy_after = 2;
        c.healthy_after = 2;
        c.decoders[0].init_ports = kv.iter().map(|k| k.port).collect();
        c.health_kv_ports = Some(true);
        tweak(c);
    })
    .await;
    let name = format!(
        "kvbridge_proxy_worker_healthy{{role=\"decode\",worker=\"127.0.0.1:{}\"}}",
        e.d[0].addr.port()
    );
    (e, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_eject_and_readmit_workers() {
    let kv = [KvPort::open().await, KvPort::open().await];
    let (e, name) = checked_env(&kv, |_| {}).await;
    e.d[0].st.healthy.store(false, Relaxed);
    e.settle(&name, 0.0).await;
    let a = e.post("/v1/completions", completion("x", false)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    e.d[0].st.healthy.store(true, Relaxed);
    e.settle(&name, 1.0).await;
    let a = e.post("/v1/completions", completion("x", false)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
}

/// A decoder whose HTTP endpoint answers but whose KV receiver is gone would fail every
/// prefill sent its way at the handshake: the health check connects to every rank's KV init
/// port too, and ejects it; it comes back once the port accepts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_whose_kv_port_refuses_is_ejected_though_its_http_answers() {
    let mut kv = [KvPort::open().await, KvPort::open().await];
    let (e, name) = checked_env(&kv, |_| {}).await;
    let until = Instant::now() + T;
    while kv[1].accepted.load(Relaxed) == 0 {
        assert!(Instant::now() < until, "the KV port was never probed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    e.settle(&name, 1.0).await;
    // Rank 1's KV listener dies; the decoder's HTTP still answers 200.
    kv[1].close().await;
    e.settle(&name, 0.0).await;
    assert!(
        e.d[0].st.healthy.load(Relaxed),
        "HTTP health was never touched"
    );
    let a = e.post("/v1/completions", completion("x", false)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{}", a.text());
    assert_eq!(a.code(), "no_healthy_worker");
    kv[1].listen().await;
    e.settle(&name, 1.0).await;
    let a = e.post("/v1/completions", completion("x", false)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
}

/// `health_kv_ports = false` leaves the KV ports alone (a proxy that cannot reach them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_port_checks_can_be_switched_off() {
    let kv = [KvPort::open().await];
    let (e, name) = checked_env(&kv, |c| c.health_kv_ports = Some(false)).await;
    // An ejection and a re-admission: health checks ran, and passed without the KV port.
    e.d[0].st.healthy.store(false, Relaxed);
    e.settle(&name, 0.0).await;
    e.d[0].st.healthy.store(true, Relaxed);
    e.settle(&name, 1.0).await;
    assert_eq!(kv[0].accepted.load(Relaxed), 0, "the KV port was probed");
}

/// vLLM's NIXL decoders have no KV init port (the configured default, 8300, has nothing
/// behind it): in the vllm flow the health check is the decoder's HTTP health alone, so
/// decoders stay admitted well past the ejection threshold (2 failed checks) and requests
/// still succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_flow_keeps_decoders_without_kv_ports_past_the_ejection_threshold() {
    let e = env(Flow::Vllm, 1, 2, |c| {
        c.health_interval = Duration::from_millis(20);
        c.unhealthy_after = 2;
        for d in &mut c.decoders {
            d.init_ports = vec![closed_port()];
        }
    })
    .await;
    // Five times the ejection threshold of checks on every decoder.
    let until = Instant::now() + T;
    while e.d.iter().any(|d| d.st.health_calls.load(Relaxed) < 10) {
        assert!(
            Instant::now() < until,
            "the decoders were not health-checked"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let m = e.metrics().await;
    for d in &e.d {
        let name = format!(
            "kvbridge_proxy_worker_healthy{{role=\"decode\",worker=\"127.0.0.1:{}\"}}",
            d.addr.port()
        );
        assert_eq!(sample(&m, &name), Some(1.0), "{m}");
    }
    for _ in 0..4 {
        let a = e.post("/v1/completions", completion("x", false)).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admission_full_gives_429_and_a_queued_request_gets_the_freed_slot() {
    let e = env(Flow::Vllm, 1, 1, |c| {
        c.decoders[0].max_requests = 1;
        c.max_queue = 1;
        c.queue_timeout = Duration::from_secs(5);
    })
    .await;
    // Request 1 holds the only slot: its stream pauses after the first chunk.
    let req = hyper::Request::post(e.url("/v1/completions"))
        .body(Full::new(Bytes::from(
            completion("@hold", true).to_string(),
        )))
        .unwrap();
    let resp = tokio::time::timeout(T, e.client.request(req))
        .await
        .unwrap()
        .unwrap();
    let mut body = resp.into_body();
    let first = tokio::time::timeout(T, body.frame())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(String::from_utf8_lossy(first.data_ref().unwrap()).contains(" d0"));
    // Request 2 queues; request 3 finds the queue full.
    let e = Arc::new(e);
    let e2 = e.clone();
    let queued = tokio::spawn(async move {
        e2.post("/v1/completions", completion("q", false))
            .await
            .status
    });
    e.settle("kvbridge_proxy_admission_queue", 1.0).await;
    let a = e.post("/v1/completions", completion("x", false)).await;
    assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(a.code(), "admission_full");
    // Free the slot: the queued request goes through.
    e.d[0].st.hold.notify_waiters();
    assert!(rest_of(body).await.ends_with("data: [DONE]\n\n"));
    assert_eq!(
        tokio::time::timeout(T, queued).await.unwrap().unwrap(),
        StatusCode::OK
    );
    e.settled().await;
}

/// Sends a streamed completion to a decoder that holds its answer (`@dhold`), reads the
/// first frame while it holds, then lets it answer: returns that frame's text and the rest.
async fn first_while_the_decoder_holds(e: &Env, prompt: &str) -> (String, String) {
    let req = hyper::Request::post(e.url("/v1/completions"))
        .body(Full::new(Bytes::from(completion(prompt, true).to_string())))
        .unwrap();
    let resp = tokio::time::timeout(T, e.client.request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let first = tokio::time::timeout(T, body.frame())
        .await
        .expect("no first frame while the decoder holds its answer")
        .unwrap()
        .unwrap();
    let first = String::from_utf8_lossy(first.data_ref().unwrap()).to_string();
    e.d[0].st.hold.notify_one();
    (first, rest_of(body).await)
}

/// The rest of a streamed answer, as text.
async fn rest_of(body: hyper::body::Incoming) -> String {
    let rest = tokio::time::timeout(T, body.collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    String::from_utf8_lossy(&rest).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_completions_first_token_goes_out_on_kv_ready_before_the_decoder_answers() {
    let e = env(Flow::Lmcache, 1, 1, |_| {}).await;
    // The decoder holds its answer until told: the first token (the prefill's) still comes.
    let (first, rest) = first_while_the_decoder_holds(&e, "@dhold").await;
    assert!(first.contains(" first"), "{first}");
    assert!(
        rest.contains(" d0") && rest.ends_with("data: [DONE]\n\n"),
        "{rest}"
    );
    // A decoder that fails after that first token: an SSE error event ends the stream.
    let (first, rest) = first_while_the_decoder_holds(&e, "@dhold @d500").await;
    assert!(first.contains(" first"), "{first}");
    assert!(
        rest.starts_with("event: error\ndata: ")
            && rest.contains("the decode failed")
            && !rest.contains("exploded"),
        "{rest}"
    );
    e.settled().await;
    let m = e.metrics().await;
    assert_eq!(
        sample(
            &m,
            "kvbridge_proxy_requests_total{outcome=\"decode_error\"}"
        ),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_first_token_on_kv_ready_off_a_decoder_error_is_a_502() {
    let e = env(Flow::Lmcache, 1, 1, |c| c.first_token_on_kv_ready = false).await;
    let a = e.post("/v1/completions", completion("@d500", true)).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
    assert_eq!(
        a.json()["error"]["message"],
        "the decode failed",
        "{}",
        a.text()
    );
    // A chat then goes to the decoder as it came: the decoder makes its first token.
    let a = e.post("/v1/chat/completions", chat("hi", true)).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let (_, dv) = e.d[0].last();
    assert_eq!(dv["messages"].as_array().map(Vec::len), Some(1), "{dv}");
    assert!(dv.get("continue_final_message").is_none(), "{dv}");
    assert_eq!(dv["max_tokens"], 3);
    e.settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_shaped_errors() {
    let e = env(Flow::Lmcache, 1, 1, |c| {
        c.decoders[0].kv_capacity_tokens = 1000;
    })
    .await;
    for (body, code) in [
        ("not json", 400),
        ("[1,2]", 400),
        (r#"{"model":"m"}"#, 400),
        (r#"{"prompt":"x","stream":"yes"}"#, 400),
        (r#"{"prompt":"x","max_tokens":0}"#, 400),
        (r#"{"prompt":"x","max_tokens":-3}"#, 400),
    ] {
        let a = e
            .send("POST", "/v1/completions", Bytes::from(body), None)
            .await;
        assert_eq!(a.status.as_u16(), code, "{body}: {}", a.text());
        assert_eq!(a.json()["error"]["type"], "invalid_request_error", "{body}");
    }
    let a = e
        .post("/v1/chat/completions", json!({"messages": []}))
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    let big = "x".repeat(8000);
    let a = e.post("/v1/completions", completion(&big, false)).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(a.code(), "prompt_exceeds_kv_capacity");
    let a = e.send("GET", "/nope", Bytes::new(), None).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
    assert_eq!(a.code(), "not_found");
    let a = e.send("GET", "/v1/models", Bytes::new(), None).await;
    assert_eq!(a.json()["data"][0]["id"], "double-model");
    assert_eq!(
        e.send("GET", "/health", Bytes::new(), None).await.status,
        StatusCode::OK
    );
    assert_eq!(e.p[0].st.calls.load(Relaxed), 0);
    e.settled().await;
}

/// 10 chunks 3 ms apart: with Nagle's algorithm on either hop, small writes wait for delayed
/// ACKs (about 40 ms each on loopback) and the stream takes several times longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_has_no_nagle_stall() {
    let e = env(Flow::Vllm, 1, 1, |_| {}).await;
    let _ = e.post("/v1/completions", completion("warm", true)).await;
    let t = Instant::now();
    let a = e.post("/v1/completions", completion("@drip", true)).await;
    assert!(a.text().contains(" d9"));
    assert!(
        t.elapsed() < Duration::from_millis(250),
        "{:?}",
        t.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_requests_with_random_failures_leave_nothing_behind() {
    let e = Arc::new(
        env(Flow::Lmcache, 2, 2, |c| {
            // Long enough that an `@late` outcome (sent 50 ms after the prefill answer) makes
            // it on a machine loaded well past its cores (a 100 ms deadline did not, under a
            // load average of 15); short enough that the `@nonotify` tenth of the requests
            // ends in a few seconds at 32 at a time.
            c.kv_ready_timeout = Duration::from_millis(1000);
            c.decoders.iter_mut().for_each(|d| d.max_requests = 12);
            c.max_queue = 16;
            c.queue_timeout = Duration::from_millis(500);
        })
        .await,
    );
    const MODES: [&str; 10] = [
        "ok",
        "@late",
        "@plain",
        "@p500",
        "@kvfail",
        "@nonotify",
        "@die",
        "@d500",
        "@slow",
        "cancel",
    ];
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let sem = Arc::new(tokio::sync::Semaphore::new(32));
    let mut tasks = Vec::new();
    let t0 = Instant::now();
    for i in 0..1000 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let mode = MODES[(seed % MODES.len() as u64) as usize];
        let stream = seed >> 32 & 1 == 1;
        let permit = sem.clone().acquire_owned().await.unwrap();
        let e = e.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let marker = if mode == "cancel" { "@slow" } else { mode };
            let body = completion(&format!("req {i} {marker}"), stream);
            if mode == "cancel" {
                // The client gives up while the decoder is still working.
                let r = tokio::time::timeout(
                    Duration::from_millis(20),
                    e.post("/v1/completions", body),
                )
                .await;
                return (
                    mode,
                    stream,
                    r.map(|a| a.status.as_u16()).unwrap_or(0),
                    false,
                );
            }
            let a = e.post("/v1/completions", body).await;
            (
                mode,
                stream,
                a.status.as_u16(),
                a.text().contains("event: error"),
            )
        }));
    }
    let mut by_status = std::collections::BTreeMap::new();
    let mut gave_up = 0;
    for t in tasks {
        let (mode, stream, status, sse_err) = tokio::time::timeout(T, t).await.unwrap().unwrap();
        *by_status.entry(status).or_insert(0) += 1;
        gave_up += (status == 0) as u32;
        let want: &[u16] = match mode {
            "ok" | "@late" | "@plain" | "@slow" => &[200, 429],
            // A stream's first token went out once the KV was confirmed: the decoder's
            // failure after it is an SSE error event.
            "@d500" if stream => &[200, 429],
            "@p500" | "@kvfail" | "@d500" => &[502, 429],
            "@nonotify" => &[504, 429],
            "@die" => &[200, 502, 429],
            _ => &[0, 200, 429],
        };
        assert!(want.contains(&status), "{mode}: {status}");
        let mid_stream = mode == "@die" || (mode == "@d500" && stream);
        assert_eq!(sse_err, mid_stream && status == 200, "{mode}");
    }
    assert!(
        by_status.get(&200).copied().unwrap_or(0) > 300,
        "{by_status:?}"
    );
    e.settled().await;
    let m = e.metrics().await;
    let total: f64 = m
        .lines()
        .filter(|l| l.starts_with("kvbridge_proxy_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    // A client that gave up before the proxy read its request was never a request to it (on
    // a loaded machine that happens within the 20 ms); every other one is counted once.
    assert!(
        total <= 1000.0 && total >= 1000.0 - f64::from(gave_up),
        "{total} counted, {gave_up} gave up\n{m}"
    );
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    eprintln!("1000 requests in {:?}: {by_status:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_flow_retries_a_refused_decoder_on_another() {
    let d = Double::start(Kind::Decode).await;
    let e = env(Flow::Vllm, 1, 0, |c| {
        let dc = |port| DecoderConfig {
            host: "127.0.0.1".into(),
            port,
            init_ports: vec![],
            alloc_ports: vec![],
            max_requests: 0,
            kv_capacity_tokens: 0,
        };
        c.decoders = vec![dc(closed_port()), dc(d.addr.port())];
    })
    .await;
    // Ties spread round-robin, so the refusing decoder is picked within two requests; each
    // request still succeeds on the other one.
    for stream in [false, true, false, true] {
        let a = e.post("/v1/completions", completion("hello", stream)).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    assert_eq!(d.st.calls.load(Relaxed), 4);
    assert_eq!(e.p[0].st.calls.load(Relaxed), 4, "one prefill per request");
    e.settled().await;
    let m = e.metrics().await;
    assert_eq!(
        sample(&m, "kvbridge_proxy_requests_total{outcome=\"ok\"}"),
        Some(4.0),
        "{m}"
    );
    let h = e.send("GET", "/health", Bytes::new(), None).await;
    assert_eq!(
        h.json()["decoders_healthy"],
        1,
        "the refusing decoder is ejected"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_gets_413_and_is_counted() {
    let e = env(Flow::Vllm, 1, 1, |c| c.max_body_bytes = 4096).await;
    let ok = completion(&"x".repeat(3000), false);
    let a = e.post("/v1/completions", ok).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let big = completion(&"x".repeat(5000), false);
    let a = e.post("/v1/completions", big.clone()).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE, "{}", a.text());
    assert_eq!(a.code(), "request_too_large");
    assert_eq!(a.json()["error"]["type"], "invalid_request_error");
    assert!(
        a.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("4096 bytes")),
        "{}",
        a.text()
    );
    // Without a content-length (chunked): refused once the limit is crossed.
    let (tx, rx) = mpsc::channel(4);
    let body = big.to_string().into_bytes();
    tokio::spawn(async move {
        for c in body.chunks(1000) {
            if tx.send(Ok(Bytes::copy_from_slice(c))).await.is_err() {
                return;
            }
        }
    });
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let req = hyper::Request::post(e.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(ChanBody::<std::io::Error>(rx))
        .unwrap();
    let resp = tokio::time::timeout(T, client.request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    let m = e.metrics().await;
    assert_eq!(
        sample(&m, "kvbridge_proxy_body_too_large_total"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "kvbridge_proxy_requests_total{outcome=\"bad_request\"}"),
        Some(2.0),
        "{m}"
    );
    assert_eq!(
        e.p[0].st.calls.load(Relaxed),
        1,
        "nothing refused reached a worker"
    );
    e.settled().await;
}

// ---------------------------------------------------------------- the HTTP listener's limits

/// Reads from `r` until the proxy closes the connection (end of stream or an error); what
/// it sent before.
async fn read_to_close(mut r: tokio::net::tcp::OwnedReadHalf) -> Vec<u8> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while let Ok(n @ 1..) = r.read(&mut buf).await {
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// Writes `head` and then `filler` bytes one at a time, `gap` apart (at most 400 bytes), until
/// a write fails.
fn dribble(
    mut w: tokio::net::tcp::OwnedWriteHalf,
    head: &'static [u8],
    gap: Duration,
) -> tokio::task::JoinHandle<()> {
    use tokio::io::AsyncWriteExt;
    tokio::spawn(async move {
        if w.write_all(head).await.is_err() {
            return;
        }
        for _ in 0..400 {
            if w.write_all(b"a").await.is_err() {
                return;
            }
            tokio::time::sleep(gap).await;
        }
    })
}

/// Slowloris: a client that sends its headers a byte at a time holds its connection only
/// until the header deadline, while another client is served as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_dribbling_its_headers_is_dropped_within_the_deadline_while_another_is_served() {
    let deadline = Duration::from_millis(500);
    let e = env(Flow::Vllm, 1, 1, |c| {
        c.http_limits.header_timeout = deadline
    })
    .await;
    let t0 = Instant::now();
    let (r, w) = tokio::net::TcpStream::connect(e.proxy.http_addr())
        .await
        .unwrap()
        .into_split();
    let writer = dribble(
        w,
        b"POST /v1/completions HTTP/1.1\r\nX-Slow: ",
        Duration::from_millis(20),
    );
    let closed = tokio::spawn(async move {
        read_to_close(r).await;
        t0.elapsed()
    });
    let a = e.post("/v1/completions", completion("x", false)).await;
    let served = t0.elapsed();
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let dropped = tokio::time::timeout(T, closed)
        .await
        .expect("the dribbling client was never dropped")
        .unwrap();
    eprintln!("other client served after {served:?}; dribbler dropped after {dropped:?}");
    // Answered before the dribbler's deadline: served while the dribbler held its connection,
    // not after it was dropped.
    assert!(
        served < deadline,
        "the other client was answered only after {served:?}"
    );
    assert!(
        dropped >= deadline && dropped < deadline + Duration::from_millis(1500),
        "dropped after {dropped:?}"
    );
    writer.abort();
    e.settled().await;
}

/// A kept-alive connection left idle after its answer is closed at the header deadline: an
/// idle client holds its connection no longer than a dribbling one. (A client that reuses
/// such a connection just as the deadline passes meets the close.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kept_alive_connection_is_closed_at_the_header_deadline() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = Duration::from_millis(500);
    let e = env(Flow::Vllm, 1, 1, |c| {
        c.http_limits.header_timeout = deadline
    })
    .await;
    let (mut r, mut w) = tokio::net::TcpStream::connect(e.proxy.http_addr())
        .await
        .unwrap()
        .into_split();
    w.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    // The whole answer: its head, then as many bytes as its Content-Length says.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let (head, answered) = loop {
        let n = tokio::time::timeout(T, r.read(&mut buf))
            .await
            .expect("no answer")
            .unwrap();
        assert!(
            n > 0,
            "closed unanswered: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
        let Some(end) = got.windows(4).position(|x| x == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        if got.len() >= end + 4 + len {
            break (head, Instant::now());
        }
    };
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(
        !head.contains("connection: close"),
        "not kept alive: {head}"
    );
    let rest = tokio::time::timeout(T, read_to_close(r))
        .await
        .expect("the idle connection was kept");
    let idle = answered.elapsed();
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    assert!(
        idle < deadline + Duration::from_millis(1500),
        "closed after {idle:?} idle"
    );
    drop(w);
    e.settled().await;
}

/// A request whose body does not arrive within the body deadline is answered 408.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_dribbled_past_its_deadline_gets_408() {
    let e = env(Flow::Vllm, 1, 1, |c| {
        c.http_limits.body_timeout = Duration::from_millis(300)
    })
    .await;
    let t0 = Instant::now();
    let (r, w) = tokio::net::TcpStream::connect(e.proxy.http_addr())
        .await
        .unwrap()
        .into_split();
    let writer = dribble(
        w,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 300\r\n\r\n",
        Duration::from_millis(20),
    );
    let got = tokio::time::timeout(T, read_to_close(r))
        .await
        .expect("no answer to the slow body");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_timeout"), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    writer.abort();
    assert_eq!(e.d[0].st.calls.load(Relaxed), 0);
    e.settled().await;
}

/// Connections beyond the cap are closed as soon as accepted, and counted; the slots come
/// back when their holders leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_closed_at_once_and_counted() {
    let e = env(Flow::Vllm, 1, 1, |c| c.http_limits.max_conns = 4).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(
            tokio::net::TcpStream::connect(e.proxy.http_addr())
                .await
                .unwrap(),
        );
    }
    let (r, _w) = tokio::net::TcpStream::connect(e.proxy.http_addr())
        .await
        .unwrap()
        .into_split();
    tokio::time::timeout(T, read_to_close(r))
        .await
        .expect("a connection over the cap was kept");
    assert_eq!(e.proxy.metrics().http_conns_refused.load(Relaxed), 1);
    drop(held);
    let until = Instant::now() + T;
    loop {
        let req = hyper::Request::post(e.url("/v1/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(completion("x", false).to_string())))
            .unwrap();
        match tokio::time::timeout(T, e.client.request(req)).await {
            Ok(Ok(r)) if r.status() == StatusCode::OK => break,
            other => assert!(Instant::now() < until, "no slot came back: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    e.settled().await;
}

/// Server errors tell the client a code and a generic message; which worker failed (its
/// address) and its error text stay in the proxy's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_body_names_no_worker_address() {
    let dead = closed_port();
    let e = env(Flow::Vllm, 1, 0, |c| {
        c.decoders = vec![DecoderConfig {
            host: "127.0.0.1".into(),
            port: dead,
            init_ports: vec![],
            alloc_ports: vec![],
            max_requests: 0,
            kv_capacity_tokens: 0,
        }];
    })
    .await;
    let prefiller = e.p[0].addr.port().to_string();
    let a = e.post("/v1/completions", completion("@p500", false)).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
    let b = e.post("/v1/completions", completion("x", false)).await;
    assert_eq!(b.status, StatusCode::SERVICE_UNAVAILABLE, "{}", b.text());
    assert_eq!(b.code(), "decoder_unavailable");
    for x in [&a, &b] {
        let t = x.text();
        for secret in [
            "127.0.0.1",
            &prefiller,
            &dead.to_string(),
            "exploded",
            "refused",
        ] {
            assert!(!t.contains(secret), "{secret:?} in {t}");
        }
    }
    e.settled().await;
}

/// Request ids the proxy makes are 128 random bits: seeing some (a client gets its own back)
/// tells nothing of the others, e.g. the ids a forged outcome would need.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_128_random_bits() {
    let e = env(Flow::Vllm, 1, 1, |_| {}).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let a = e.post("/v1/completions", completion("x", false)).await;
        let id = a.headers["x-request-id"].to_str().unwrap().to_string();
        let hex = id.strip_prefix("kvb-").unwrap_or_else(|| panic!("{id}"));
        assert!(
            hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
            "{id}"
        );
        ids.push(hex.to_string());
    }
    // Independent draws: no shared prefix of 8 hex digits (the old ids shared all but a
    // counter).
    for (i, a) in ids.iter().enumerate() {
        for b in &ids[i + 1..] {
            assert_ne!(a[..8], b[..8], "{ids:?}");
        }
    }
    e.settled().await;
}

/// Under `cache-aware`, requests sharing a long prefix go to one prefiller and one decoder
/// (the pools are balanced, so the prefix match decides), and every request succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_keeps_a_shared_prefix_on_one_worker() {
    use kvbridge_proxy::routing::RoutingPolicy;
    let e = env(Flow::Lmcache, 2, 2, |c| {
        c.routing = RoutingPolicy::CacheAware;
        // Every request the PD way, so that both pools route it.
        c.disaggregation.min_uncached_tokens = Some(0);
        c.disaggregation.decoder_cached_fraction = Some(2.0);
    })
    .await;
    let doc = "a shared document ".repeat(20);
    for i in 0..6 {
        let a = e
            .send(
                "POST",
                "/v1/completions",
                Bytes::from(completion(&format!("{doc} question {i}"), false).to_string()),
                None,
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    let calls =
        |ds: &[Double]| -> Vec<u64> { ds.iter().map(|d| d.st.calls.load(Relaxed)).collect() };
    let (p, d) = (calls(&e.p), calls(&e.d));
    assert!(p.contains(&6) && p.contains(&0), "prefillers {p:?}");
    assert!(d.contains(&6) && d.contains(&0), "decoders {d:?}");
}

/// The decider: under `cache-aware` a short prompt goes to a decoder alone (no prefill),
/// a long one the PD way, a long one whose prefix the decoder was sent before alone again;
/// each decision is counted in `/metrics` with its reason, and routing decisions per policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decider_sends_short_or_cached_prompts_to_the_decoder_alone() {
    use kvbridge_proxy::routing::RoutingPolicy;
    let e = env(Flow::Lmcache, 1, 1, |c| {
        c.routing = RoutingPolicy::CacheAware;
        c.disaggregation.min_uncached_tokens = Some(100);
        c.disaggregation.decoder_cached_fraction = Some(0.75);
    })
    .await;
    let calls = |ds: &[Double]| -> u64 { ds.iter().map(|d| d.st.calls.load(Relaxed)).sum() };
    let send = |text: String| {
        let e = &e;
        async move {
            let a = e
                .send(
                    "POST",
                    "/v1/completions",
                    Bytes::from(completion(&text, false).to_string()),
                    None,
                )
                .await;
            assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        }
    };
    // About 10 tokens (bytes / 4): below 100 uncached.
    send("a short question".into()).await;
    assert_eq!((calls(&e.p), calls(&e.d)), (0, 1), "decoder alone");
    // About 500 tokens, none cached: the PD way.
    let doc = "a long shared document ".repeat(90);
    send(format!("{doc} first")).await;
    assert_eq!((calls(&e.p), calls(&e.d)), (1, 2), "prefill and decode");
    // The same document and a longer question (about 120 tokens): the decoder's tree holds
    // 512 of about 630 tokens, over 75%.
    send(format!("{doc} {}", "second question ".repeat(30))).await;
    assert_eq!((calls(&e.p), calls(&e.d)), (1, 3), "decoder alone again");
    let m = e.send("GET", "/metrics", Bytes::new(), None).await.text();
    for line in [
        "kvbridge_proxy_disaggregation_decisions_total{decision=\"decode_only\",reason=\"uncached_below_threshold\"} 1\n",
        "kvbridge_proxy_disaggregation_decisions_total{decision=\"disaggregate\",reason=\"uncached_above_threshold\"} 1\n",
        "kvbridge_proxy_disaggregation_decisions_total{decision=\"decode_only\",reason=\"decoder_holds_prefix\"} 1\n",
        "kvbridge_proxy_routing_decisions_total{role=\"decode\",policy=\"cache-aware\",matched=\"true\"} 1\n",
        "kvbridge_proxy_routing_decisions_total{role=\"decode\",policy=\"cache-aware\",matched=\"false\"} 2\n",
        "kvbridge_proxy_routing_decisions_total{role=\"prefill\",policy=\"cache-aware\",matched=\"false\"} 1\n",
    ] {
        assert!(m.contains(line), "{line} in\n{m}");
    }
    e.settled().await;
}
