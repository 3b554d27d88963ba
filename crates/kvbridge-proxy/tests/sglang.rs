//! `--flow sglang` over real sockets: the proxy in front of stub SGLang servers.
//!
//! The stubs stand in for SGLang's prefill and decode servers in PD mode (the real SGLang
//! 1P1D comes later, with kvbridge's SGLang transfer backend). They follow the wire
//! behaviour SGLang's servers show its router: each takes the same body with
//! `bootstrap_host`, `bootstrap_port` and `bootstrap_room`; the prefill server "sends the KV"
//! of each room (here: marks it in a table both stubs share) and answers; the decode server
//! answers only once the KV of every room of its body arrived, however long that takes, as
//! SGLang's decode waits for a prefill that has died. Each stub records what it received.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvbridge_proxy::config::{Config, DecoderConfig, Flow, WorkerAddr};
use kvbridge_proxy::metrics::Outcome;
use kvbridge_proxy::server::{self, RunningProxy};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Notify};

mod common;
use common::{Answer, ChanBody};

/// Upper bound of any wait in these tests.
const T: Duration = Duration::from_secs(10);

/// How long a decode stub waits for its KV before it gives up (SGLang's decode waits
/// minutes): far beyond every deadline the proxy is given here.
const DECODE_KV_WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------- stubs

/// The KV "moved" so far: each room the prefill stubs finished, shared with the decode
/// stubs.
/// stubs; `false` for a room whose transfer failed (and the decode was told).
#[derive(Default)]
struct Kv {
    rooms: Mutex<HashMap<u64, bool>>,
    moved: Notify,
}

impl Kv {
    fn put(&self, rooms: &[u64]) {
        self.set(rooms, true)
    }

    fn fail(&self, rooms: &[u64]) {
        self.set(rooms, false)
    }

    fn set(&self, rooms: &[u64], ok: bool) {
        let mut m = self.rooms.lock().unwrap();
        for r in rooms {
            m.insert(*r, ok);
        }
        drop(m);
        self.moved.notify_waiters();
    }

    /// Waits until every room's KV moved (`true`), or one's transfer failed or
    /// [`DECODE_KV_WAIT`] passed (`false`).
    async fn wait(&self, rooms: &[u64]) -> bool {
        let state = || {
            let m = self.rooms.lock().unwrap();
            if rooms.iter().any(|r| m.get(r) == Some(&false)) {
                return Some(false);
            }
            rooms.iter().all(|r| m.contains_key(r)).then_some(true)
        };
        tokio::time::timeout(DECODE_KV_WAIT, async {
            loop {
                let moved = self.moved.notified();
                if let Some(ok) = state() {
                    return ok;
                }
                moved.await;
            }
        })
        .await
        .unwrap_or(false)
    }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    /// Answers (a prefill after `delay`; a decode once its KV moved).
    Ok { delay: Duration },
    /// A prefill that fails with a 500 after `delay`, its KV never sent and the decode never
    /// told (it waits on, as SGLang's decode does over NIXL, sglang#36033).
    Fail { delay: Duration },
    /// A prefill whose transfer fails at once (the decode is told, and fails), its 500
    /// answer `delay` later.
    FailKv { delay: Duration },
    /// Never answers (a decode's stream: its head once the KV moved, then nothing).
    Hang,
    /// Answers 200 with a body that is not what was asked (hostile).
    Garbage,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Prefill,
    Decode,
}

struct SState {
    kind: Kind,
    mode: Mutex<Mode>,
    kv: Arc<Kv>,
    /// Every request: path and body.
    seen: Mutex<Vec<(String, Value)>>,
    /// Decode requests whose client went away before the stub had answered.
    cancelled: AtomicU64,
    healthy: AtomicBool,
    health_calls: AtomicU64,
}

struct Stub {
    addr: SocketAddr,
    st: Arc<SState>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Stub {
    async fn start(kind: Kind, kv: Arc<Kv>) -> Stub {
        let st = Arc::new(SState {
            kind,
            mode: Mutex::new(Mode::Ok {
                delay: Duration::ZERO,
            }),
            kv,
            seen: Mutex::new(Vec::new()),
            cancelled: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            health_calls: AtomicU64::new(0),
        });
        let app = Router::new()
            .route("/generate", post(serve))
            .route("/v1/completions", post(serve))
            .route("/v1/chat/completions", post(serve))
            .route("/health", get(health))
            .with_state(st.clone());
        // Bound before anything is sent to it: no readiness wait needed.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Stub { addr, st, task }
    }

    fn set(&self, m: Mode) {
        *self.st.mode.lock().unwrap() = m;
    }

    fn seen(&self) -> Vec<(String, Value)> {
        self.st.seen.lock().unwrap().clone()
    }
}

async fn health(State(st): State<Arc<SState>>) -> StatusCode {
    st.health_calls.fetch_add(1, Relaxed);
    if st.healthy.load(Relaxed) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// The rooms of a body: one, or one per prompt.
fn rooms_of(v: &Value) -> Vec<u64> {
    match &v["bootstrap_room"] {
        Value::Array(a) => a.iter().filter_map(Value::as_u64).collect(),
        r => r.as_u64().into_iter().collect(),
    }
}

/// Counts a decode request as cancelled when dropped before it answered.
struct CancelGuard(Arc<SState>, bool);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.1 {
            self.0.cancelled.fetch_add(1, Relaxed);
        }
    }
}

/// Input logprobs the stubs report: the prefill's for the prompt, the decode's its own one.
fn input_lp(kind: Kind) -> Value {
    match kind {
        Kind::Prefill => json!([[-1.0, 11, null], [-2.0, 12, null]]),
        Kind::Decode => json!([[-3.0, 13, null]]),
    }
}

/// One answer event (or the whole answer) of `path` for prompt `i`.
fn answer_item(kind: Kind, path: &str, v: &Value, i: usize, text: &str) -> Value {
    match path {
        "/generate" => {
            let mut meta = json!({"id": format!("r{i}"), "finish_reason": null});
            if v["return_logprob"] == json!(true) {
                meta["input_token_logprobs"] = input_lp(kind);
            }
            json!({"text": text, "index": i, "meta_info": meta})
        }
        "/v1/chat/completions" => {
            json!({"id": "chatcmpl-x", "object": "chat.completion", "choices": [{"index": i,
            "message": {"role": "assistant", "content": text}, "finish_reason": "length"}]})
        }
        _ => json!({"id": "cmpl-x", "object": "text_completion", "choices": [{"index": i,
            "text": text, "finish_reason": "length"}]}),
    }
}

async fn serve(State(st): State<Arc<SState>>, uri: Uri, body: Bytes) -> Response {
    let path = uri.path().to_string();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    st.seen.lock().unwrap().push((path.clone(), v.clone()));
    let mode = *st.mode.lock().unwrap();
    let rooms = rooms_of(&v);
    let stream = v["stream"] == json!(true);
    let batch = v["bootstrap_room"].is_array();
    match (st.kind, mode) {
        (_, Mode::Hang) if !stream || st.kind == Kind::Prefill => {
            let _g = CancelGuard(st.clone(), false);
            std::future::pending::<()>().await;
            unreachable!()
        }
        (Kind::Prefill, Mode::Fail { delay }) => {
            tokio::time::sleep(delay).await;
            return (StatusCode::INTERNAL_SERVER_ERROR, "prefill exploded").into_response();
        }
        (Kind::Prefill, Mode::FailKv { delay }) => {
            st.kv.fail(&rooms);
            tokio::time::sleep(delay).await;
            return (StatusCode::INTERNAL_SERVER_ERROR, "prefill exploded").into_response();
        }
        (_, Mode::Garbage) => {
            // A prefill that moved the KV, then answered nonsense.
            if st.kind == Kind::Prefill {
                st.kv.put(&rooms);
            }
            return (
                [("content-type", "application/json")],
                "{\"meta_info\": [1, 2",
            )
                .into_response();
        }
        (Kind::Prefill, Mode::Ok { delay }) => {
            tokio::time::sleep(delay).await;
            st.kv.put(&rooms);
            let item = answer_item(Kind::Prefill, &path, &v, 0, "P");
            if stream {
                // SGLang's prefill server streams too when asked: its one event.
                return sse(format!("data: {item}\n\ndata: [DONE]\n\n"));
            }
            let body = if batch {
                Value::Array(
                    (0..rooms.len())
                        .map(|i| answer_item(Kind::Prefill, &path, &v, i, "P"))
                        .collect(),
                )
            } else {
                item
            };
            return ([("content-type", "application/json")], body.to_string()).into_response();
        }
        _ => {}
    }
    // A decode: it answers once its KV moved.
    let (st2, kv) = (st.clone(), st.kv.clone());
    if stream && mode == Mode::Hang {
        // A hung stream sends its head once the prefill is done (so that the proxy has the
        // prefill's answer before it), then nothing.
        kv.wait(&rooms).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if stream {
        let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(8);
        tokio::spawn(async move {
            let hang = *st2.mode.lock().unwrap() == Mode::Hang;
            let work = async {
                if hang || !kv.wait(&rooms).await {
                    std::future::pending::<()>().await;
                }
                for (k, text) in ["de", "code"].iter().enumerate() {
                    let item = answer_item(Kind::Decode, &path, &v, 0, text);
                    let ev = format!("data: {}\n\n", json!({"k": k, "item": item}));
                    let ev = if path == "/generate" {
                        format!("data: {item}\n\n")
                    } else {
                        ev
                    };
                    if tx.send(Ok(Bytes::from(ev))).await.is_err() {
                        return false;
                    }
                }
                let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
                true
            };
            tokio::select! {
                _ = work => {}
                _ = tx.closed() => { st2.cancelled.fetch_add(1, Relaxed); }
            }
        });
        let body = Body::new(ChanBody(rx));
        return Response::builder()
            .header("content-type", "text/event-stream")
            .body(body)
            .unwrap();
    }
    let mut guard = CancelGuard(st.clone(), false);
    if !kv.wait(&rooms).await {
        return (StatusCode::INTERNAL_SERVER_ERROR, "KV never came").into_response();
    }
    guard.1 = true;
    let body = if batch {
        Value::Array(
            (0..rooms.len())
                .map(|i| answer_item(Kind::Decode, &path, &v, i, "decoded"))
                .collect(),
        )
    } else {
        answer_item(Kind::Decode, &path, &v, 0, "decoded")
    };
    ([("content-type", "application/json")], body.to_string()).into_response()
}

fn sse(s: String) -> Response {
    ([("content-type", "text/event-stream")], s).into_response()
}

// ---------------------------------------------------------------- harness

struct Env {
    proxy: RunningProxy,
    p: Vec<Stub>,
    d: Vec<Stub>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// The bootstrap port of prefill stub `i`: 8998 for the first, none for the others.
fn bport(i: usize) -> Option<u16> {
    (i == 0).then_some(8998)
}

async fn env(np: usize, nd: usize, tweak: impl FnOnce(&mut Config)) -> Env {
    let kv = Arc::new(Kv::default());
    let mut p = Vec::new();
    let mut d = Vec::new();
    for _ in 0..np {
        p.push(Stub::start(Kind::Prefill, kv.clone()).await);
    }
    for _ in 0..nd {
        d.push(Stub::start(Kind::Decode, kv.clone()).await);
    }
    let mut cfg = Config {
        host: "127.0.0.1".into(),
        port: 0,
        flow: Flow::Sglang,
        prefill_timeout: Duration::from_secs(5),
        decode_timeout: Duration::from_secs(5),
        health_interval: Duration::ZERO,
        queue_timeout: Duration::ZERO,
        ..Config::default()
    };
    cfg.prefillers = p
        .iter()
        .map(|x| WorkerAddr {
            host: "127.0.0.1".into(),
            port: x.addr.port(),
        })
        .collect();
    cfg.prefiller_bootstrap_ports = (0..np).map(bport).collect();
    cfg.decoders = d
        .iter()
        .map(|x| DecoderConfig {
            host: "127.0.0.1".into(),
            port: x.addr.port(),
            init_ports: Vec::new(),
            alloc_ports: Vec::new(),
            max_requests: 0,
            kv_capacity_tokens: 0,
        })
        .collect();
    tweak(&mut cfg);
    let proxy = server::start(cfg).await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    Env {
        proxy,
        p,
        d,
        client,
    }
}

impl Env {
    async fn send(&self, path: &str, body: Bytes) -> Answer {
        let req = hyper::Request::post(format!("http://{}{path}", self.proxy.http_addr()))
            .header("content-type", "application/json")
            .body(Full::new(body))
            .unwrap();
        common::fetch(&self.client, req, T).await
    }

    async fn post(&self, path: &str, v: Value) -> Answer {
        self.send(path, Bytes::from(v.to_string())).await
    }

    async fn metrics(&self) -> String {
        let req = hyper::Request::get(format!("http://{}/metrics", self.proxy.http_addr()))
            .body(Full::new(Bytes::new()))
            .unwrap();
        common::fetch(&self.client, req, T).await.text()
    }

    /// Every body the stubs of `pool` received, with the stub's index.
    fn bodies(pool: &[Stub]) -> Vec<(usize, String, Value)> {
        pool.iter()
            .enumerate()
            .flat_map(|(i, s)| s.seen().into_iter().map(move |(p, v)| (i, p, v)))
            .collect()
    }
}

/// Waits, up to [`T`], for `cond` to hold.
async fn until(mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < T, "the condition did not come to hold");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn counter(metrics: &str, line_start: &str) -> u64 {
    metrics
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in /metrics"))
}

/// The data payloads of an SSE body.
fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
        .collect()
}

// ---------------------------------------------------------------- tests

#[tokio::test]
async fn both_servers_get_the_same_body_with_the_prefillers_bootstrap_fields() {
    let e = env(2, 2, |_| {}).await;
    let cases = [
        (
            "/v1/completions",
            json!({"model": "m", "prompt": "hi", "max_tokens": 4}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/generate",
            json!({"text": "hi", "sampling_params": {"max_new_tokens": 4}}),
        ),
    ];
    let mut sent = 0;
    for (path, body) in &cases {
        for stream in [false, true] {
            for _ in 0..3 {
                let mut b = body.clone();
                b["stream"] = json!(stream);
                b["bootstrap_room"] = json!(1); // a client's own room is replaced
                let a = e.post(path, b).await;
                assert_eq!(a.status, StatusCode::OK, "{path}: {}", a.text());
                if stream {
                    assert!(a.text().ends_with("data: [DONE]\n\n"), "{}", a.text());
                } else {
                    assert!(
                        a.text().contains("decoded"),
                        "the decode's answer: {}",
                        a.text()
                    );
                }
                sent += 1;
            }
        }
    }
    let (ps, ds) = (Env::bodies(&e.p), Env::bodies(&e.d));
    assert_eq!(
        (ps.len(), ds.len()),
        (sent, sent),
        "each request to one of each"
    );
    let mut rooms = Vec::new();
    for (pi, ppath, pv) in &ps {
        let room = pv["bootstrap_room"].as_u64().expect("one room, a number");
        assert!(room <= i64::MAX as u64, "63 bits");
        assert_ne!(room, 1, "the client's room was replaced");
        let (_, dpath, dv) = ds
            .iter()
            .find(|(_, _, dv)| dv["bootstrap_room"] == pv["bootstrap_room"])
            .expect("the decode with the same room");
        assert_eq!(ppath, dpath);
        assert_eq!(pv, dv, "the same body to both");
        assert_eq!(pv["bootstrap_host"], "127.0.0.1", "the prefiller's host");
        assert_eq!(
            pv["bootstrap_port"],
            json!(bport(*pi)),
            "prefiller {pi}'s port"
        );
        rooms.push(room);
    }
    rooms.sort_unstable();
    rooms.dedup();
    assert_eq!(rooms.len(), sent, "a fresh room per request");
    let used: Vec<usize> = ps.iter().map(|(i, _, _)| *i).collect();
    assert!(
        used.contains(&0) && used.contains(&1),
        "both prefillers used: {used:?}"
    );
    let m = e.metrics().await;
    assert_eq!(e.proxy.metrics().requests(Outcome::Ok), sent as u64, "{m}");
}

#[tokio::test]
async fn a_batch_gets_a_room_per_prompt() {
    let e = env(1, 1, |_| {}).await;
    for (path, body, n) in [
        ("/v1/completions", json!({"prompt": ["a", "b", "c"]}), 3),
        ("/v1/completions", json!({"prompt": [1, 2, 3]}), 0),
        ("/generate", json!({"text": ["a", "b"]}), 2),
        ("/generate", json!({"input_ids": [[1], [2], [3], [4]]}), 4),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
            2,
        ),
    ] {
        let a = e.post(path, body.clone()).await;
        assert_eq!(a.status, StatusCode::OK, "{path} {body}: {}", a.text());
        let (_, v) = e.d[0].seen().pop().unwrap();
        if n == 0 {
            assert!(
                v["bootstrap_room"].is_u64(),
                "token ids are one prompt: {v}"
            );
            continue;
        }
        let rooms = rooms_of(&v);
        let mut distinct = rooms.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!((rooms.len(), distinct.len()), (n, n), "{v}");
        assert_eq!(v["bootstrap_host"], json!(vec!["127.0.0.1"; n]));
        assert_eq!(v["bootstrap_port"], json!(vec![8998; n]));
        assert_eq!(e.p[0].seen().pop().unwrap().1, v, "the same body to both");
    }
}

#[tokio::test]
async fn a_stream_passes_through_as_the_decoder_sent_it() {
    let e = env(1, 1, |_| {}).await;
    e.p[0].set(Mode::Ok {
        delay: Duration::from_millis(30),
    });
    for path in ["/v1/completions", "/generate"] {
        let body = if path == "/generate" {
            json!({"text": "hi", "stream": true})
        } else {
            json!({"prompt": "hi", "stream": true})
        };
        let a = e.post(path, body.clone()).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
        let want: String = ["de", "code"]
            .iter()
            .enumerate()
            .map(|(k, t)| {
                let item = answer_item(Kind::Decode, path, &body, 0, t);
                if path == "/generate" {
                    format!("data: {item}\n\n")
                } else {
                    format!("data: {}\n\n", json!({"k": k, "item": item}))
                }
            })
            .chain(["data: [DONE]\n\n".to_string()])
            .collect();
        assert_eq!(a.text(), want, "byte for byte");
    }
}

#[tokio::test]
async fn a_failing_prefill_ends_the_request_at_once_and_cancels_the_decode() {
    let e = env(1, 1, |c| {
        c.prefill_timeout = Duration::from_secs(30);
        c.decode_timeout = Duration::from_secs(30);
    })
    .await;
    e.p[0].set(Mode::Fail {
        delay: Duration::from_millis(50),
    });
    for (i, stream) in [false, true].into_iter().enumerate() {
        let a = e
            .post("/v1/completions", json!({"prompt": "hi", "stream": stream}))
            .await;
        assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
        assert_eq!(a.code(), "prefill_failed");
        assert!(
            a.took < Duration::from_secs(3),
            "at once, not at a deadline: {:?}",
            a.took
        );
        // The decode's connection closed: the server would otherwise wait for the KV.
        until(|| e.d[0].st.cancelled.load(Relaxed) == i as u64 + 1).await;
    }
    let m = e.metrics().await;
    assert_eq!(
        counter(&m, "kvbridge_proxy_decodes_cancelled_total"),
        2,
        "{m}"
    );
    assert_eq!(
        counter(
            &m,
            "kvbridge_proxy_requests_total{outcome=\"prefill_error\"}"
        ),
        2
    );
}

#[tokio::test]
async fn a_decode_that_fails_because_its_prefill_did_is_the_prefills_failure() {
    let e = env(1, 1, |_| {}).await;
    e.p[0].set(Mode::FailKv {
        delay: Duration::from_millis(20),
    });
    let a = e.post("/generate", json!({"text": "hi"})).await;
    assert_eq!(a.status, StatusCode::BAD_GATEWAY, "{}", a.text());
    assert_eq!(
        a.code(),
        "prefill_failed",
        "not the decoder's 500 that came first"
    );
    assert_eq!(e.proxy.metrics().requests(Outcome::PrefillError), 1);
}

#[tokio::test]
async fn a_hung_prefill_ends_at_the_prefill_deadline() {
    let e = env(1, 1, |c| {
        c.prefill_timeout = Duration::from_millis(300);
        c.decode_timeout = Duration::from_secs(30);
    })
    .await;
    e.p[0].set(Mode::Hang);
    let a = e.post("/generate", json!({"text": "hi"})).await;
    assert_eq!(a.status, StatusCode::GATEWAY_TIMEOUT, "{}", a.text());
    assert_eq!(a.code(), "prefill_timeout");
    assert!(
        a.took >= Duration::from_millis(300) && a.took < Duration::from_secs(3),
        "{:?}",
        a.took
    );
    until(|| e.d[0].st.cancelled.load(Relaxed) == 1).await;
    until(|| e.p[0].st.cancelled.load(Relaxed) == 1).await;
}

#[tokio::test]
async fn a_hung_decode_ends_at_the_decode_deadline() {
    let e = env(1, 1, |c| {
        c.decode_timeout = Duration::from_millis(300);
    })
    .await;
    e.d[0].set(Mode::Hang);
    for stream in [false, true] {
        let a = e
            .post(
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "x"}], "stream": stream}),
            )
            .await;
        assert_eq!(
            a.status,
            StatusCode::GATEWAY_TIMEOUT,
            "stream {stream}: {}",
            a.text()
        );
        assert_eq!(a.code(), "decode_timeout");
        assert!(
            a.took >= Duration::from_millis(300) && a.took < Duration::from_secs(3),
            "{:?}",
            a.took
        );
    }
    assert_eq!(e.proxy.metrics().requests(Outcome::DecodeError), 2);
}

#[tokio::test]
async fn input_logprobs_of_the_prefill_come_first_on_generate() {
    let e = env(1, 1, |_| {}).await;
    let mut want = input_lp(Kind::Prefill).as_array().unwrap().clone();
    want.extend(input_lp(Kind::Decode).as_array().unwrap().iter().cloned());
    let want = Value::Array(want);
    let a = e
        .post("/generate", json!({"text": "hi", "return_logprob": true}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.json()["meta_info"]["input_token_logprobs"], want);
    assert_eq!(a.json()["text"], "decoded");

    let a = e
        .post(
            "/generate",
            json!({"text": ["a", "b"], "return_logprob": true}),
        )
        .await;
    for i in 0..2 {
        assert_eq!(
            a.json()[i]["meta_info"]["input_token_logprobs"],
            want,
            "item {i}"
        );
    }

    let a = e
        .post(
            "/generate",
            json!({"text": "hi", "return_logprob": true, "stream": true}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let ev = events(&a.body);
    assert_eq!(ev.len(), 3, "{}", a.text());
    for x in &ev[..2] {
        let v: Value = serde_json::from_str(x).unwrap();
        assert_eq!(v["meta_info"]["input_token_logprobs"], want);
    }
    assert_eq!(ev[2], "[DONE]");

    // Not asked, or not `/generate`: the decode's own, untouched.
    let a = e
        .post("/generate", json!({"text": "hi", "return_logprob": false}))
        .await;
    assert!(a.json()["meta_info"].get("input_token_logprobs").is_none());
    let a = e
        .post(
            "/v1/completions",
            json!({"prompt": "hi", "return_logprob": true}),
        )
        .await;
    assert_eq!(a.json()["choices"][0]["text"], "decoded");
}

#[tokio::test]
async fn malformed_bodies_and_hostile_answers_are_clear_errors() {
    let e = env(1, 1, |c| c.max_body_bytes = 4096).await;
    for (path, body, status, want) in [
        ("/generate", "nope", 400, "not a JSON object"),
        (
            "/generate",
            "{\"sampling_params\":{}}",
            400,
            "`text`, `input_ids`",
        ),
        ("/v1/completions", "{\"prompt\":[]}", 400, "empty array"),
        ("/generate", "{\"text\":[]}", 400, "empty array"),
        (
            "/v1/chat/completions",
            "{\"messages\":[{}],\"n\":0}",
            400,
            "`n`",
        ),
        (
            "/v1/chat/completions",
            "{\"messages\":[{}],\"n\":100000}",
            400,
            "at most",
        ),
        (
            "/generate",
            "{\"text\":\"hi\",\"stream\":\"yes\"}",
            400,
            "boolean",
        ),
    ] {
        let a = e.send(path, Bytes::from(body)).await;
        assert_eq!(a.status.as_u16(), status, "{body}: {}", a.text());
        assert!(
            a.json()["error"]["message"]
                .as_str()
                .unwrap()
                .contains(want),
            "{body}: {}",
            a.text()
        );
    }
    let big = format!("{{\"text\":\"{}\"}}", "x".repeat(8192));
    let a = e.send("/generate", Bytes::from(big)).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(
        Env::bodies(&e.p).is_empty() && Env::bodies(&e.d).is_empty(),
        "none sent on"
    );

    // A decode answer that is not JSON, with logprobs to merge: passed on as it came.
    e.d[0].set(Mode::Garbage);
    let a = e
        .post("/generate", json!({"text": "hi", "return_logprob": true}))
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.text(), "{\"meta_info\": [1, 2");
    // A prefill answer that is not JSON: nothing to merge, no panic.
    e.d[0].set(Mode::Ok {
        delay: Duration::ZERO,
    });
    e.p[0].set(Mode::Garbage);
    let a = e
        .post("/generate", json!({"text": "hi", "return_logprob": true}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(
        a.json()["meta_info"]["input_token_logprobs"],
        input_lp(Kind::Decode)
    );
}

#[tokio::test]
async fn a_refused_prefiller_is_ejected_and_the_request_starts_over_with_a_new_room() {
    let mut dead = 0;
    let e = env(1, 1, |c| {
        // A prefiller first in the rotation that refuses connections.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        dead = l.local_addr().unwrap().port();
        drop(l);
        c.prefillers.insert(
            0,
            WorkerAddr {
                host: "127.0.0.1".into(),
                port: dead,
            },
        );
        c.prefiller_bootstrap_ports.insert(0, Some(1));
    })
    .await;
    // Ties go round the pool: in three requests the dead one is tried once, then ejected.
    for _ in 0..3 {
        let a = e.post("/v1/completions", json!({"prompt": "hi"})).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    let m = e.metrics().await;
    assert_eq!(
        counter(&m, "kvbridge_proxy_prefiller_retries_total"),
        1,
        "{m}"
    );
    let healthy =
        format!("kvbridge_proxy_worker_healthy{{role=\"prefill\",worker=\"127.0.0.1:{dead}\"}}");
    assert_eq!(counter(&m, &healthy), 0, "{m}");
    // The attempt with the dead prefiller's room was cancelled on the decoder (if it got
    // there at all); every answered one carried the live prefiller's fields.
    let ds = Env::bodies(&e.d);
    let to_dead = ds
        .iter()
        .filter(|(_, _, v)| v["bootstrap_port"] == json!(1))
        .count();
    until(|| e.d[0].st.cancelled.load(Relaxed) == to_dead as u64).await;
    let ps = Env::bodies(&e.p);
    let live: Vec<_> = ds
        .iter()
        .filter(|(_, _, v)| v["bootstrap_port"] == json!(8998))
        .collect();
    assert_eq!(live.len(), 3, "{ds:?}");
    for (_, _, v) in live {
        assert!(
            ps.iter().any(|(_, _, p)| p == v),
            "its prefill had the same body"
        );
    }
}

#[tokio::test]
async fn a_refused_decoder_is_ejected_and_the_same_body_goes_to_the_next() {
    let mut dead = 0;
    let e = env(1, 1, |c| {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        dead = l.local_addr().unwrap().port();
        drop(l);
        let mut d = c.decoders[0].clone();
        d.port = dead;
        c.decoders.insert(0, d);
    })
    .await;
    for stream in [false, true, false] {
        let a = e
            .post("/v1/completions", json!({"prompt": "hi", "stream": stream}))
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    }
    let (ps, ds) = (Env::bodies(&e.p), Env::bodies(&e.d));
    assert_eq!((ps.len(), ds.len()), (3, 3));
    for (_, _, v) in &ds {
        assert!(
            ps.iter().any(|(_, _, p)| p == v),
            "the prefill's body, room and all"
        );
    }
    let m = e.metrics().await;
    let healthy =
        format!("kvbridge_proxy_worker_healthy{{role=\"decode\",worker=\"127.0.0.1:{dead}\"}}");
    assert_eq!(counter(&m, &healthy), 0, "{m}");
}

#[tokio::test]
async fn health_checks_probe_each_prefillers_bootstrap_port() {
    // The first prefiller's bootstrap port: open, then closed.
    let boot = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let bp = boot.local_addr().unwrap().port();
    let accept = tokio::spawn(async move {
        loop {
            let _ = boot.accept().await;
        }
    });
    let e = env(1, 1, |c| {
        c.prefiller_bootstrap_ports = vec![Some(bp)];
        c.health_interval = Duration::from_millis(20);
        c.health_timeout = Duration::from_millis(200);
        c.unhealthy_after = 1;
    })
    .await;
    until(|| {
        e.p[0].st.health_calls.load(Relaxed) >= 2 && e.d[0].st.health_calls.load(Relaxed) >= 2
    })
    .await;
    let a = e.post("/generate", json!({"text": "hi"})).await;
    assert_eq!(
        a.status,
        StatusCode::OK,
        "healthy while its bootstrap port answers"
    );
    accept.abort();
    let _ = accept.await;
    let t0 = Instant::now();
    loop {
        let a = e.post("/generate", json!({"text": "hi"})).await;
        if a.status == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(a.code(), "no_healthy_worker");
            break;
        }
        assert!(t0.elapsed() < T, "never ejected");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn generate_is_not_served_by_the_other_flows() {
    let e = env(1, 1, |c| {
        c.flow = Flow::Vllm;
        c.prefiller_bootstrap_ports.clear();
    })
    .await;
    let a = e.post("/generate", json!({"text": "hi"})).await;
    assert_eq!(a.status, StatusCode::NOT_FOUND);
}
