//! A prefiller that dies after answering the prefill, before every rank's KV outcome: the
//! request ends at once with 502 `prefiller_lost` (counted in /metrics), not after
//! `kv_ready_timeout`. Over real sockets: the proxy, a prefiller double (HTTP, and a ZMTP PUSH
//! connection to the outcome port) and a decoder double. "Dies" is what a `kill -9` does to
//! them: the HTTP listener and the outcome connection close (FIN) and nothing answers.
//!
//! The proxy learns of the death either way a real one does: the outcome connection closing
//! (this prefiller's, known from the outcomes it delivered before), or health checks
//! ejecting the prefiller.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
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
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Upper bound for any single wait in these tests.
const T: Duration = Duration::from_secs(10);
/// The proxy's `kv_ready_timeout`: a request that waits it out takes at least this long.
const KV_READY_TIMEOUT: Duration = Duration::from_secs(20);

/// A prefiller double. It answers every prefill; a prompt with `@die` gets its answer and
/// then no outcome: the double dies (`die`) right after answering.
struct Prefiller {
    addr: SocketAddr,
    healthy: Arc<AtomicBool>,
    push: Arc<tokio::sync::Mutex<Option<zeromq::PushSocket>>>,
    died: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct PState {
    healthy: Arc<AtomicBool>,
    push: Arc<tokio::sync::Mutex<Option<zeromq::PushSocket>>>,
    died: Arc<tokio::sync::Notify>,
}

async fn phealth(State(st): State<PState>) -> StatusCode {
    if st.healthy.load(Relaxed) {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn prefill(State(st): State<PState>, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let text = String::from_utf8_lossy(&body);
    let spec = &v["kv_transfer_params"]["disagg_spec"];
    let id = spec["req_id"].as_str().unwrap_or_default().to_string();
    let ranks = spec["receiver_init_port"].as_array().map_or(1, Vec::len) as u32;
    if text.contains("@die") {
        // The answer goes out; the KV's outcomes never will.
        st.died.notify_one();
    } else if let Some(s) = st.push.lock().await.as_mut() {
        for rank in 0..ranks {
            let msg = Notif::KvReady {
                req_id: id.clone(),
                rank,
                chunks: 1,
                bytes: 64,
            };
            s.send(ZmqMessage::from(notif::encode(&msg))).await.unwrap();
        }
    }
    let r = json!({"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": " first", "finish_reason": "length"}]});
    ([("content-type", "application/json")], r.to_string()).into_response()
}

impl Prefiller {
    async fn start() -> Prefiller {
        let st = PState {
            healthy: Arc::new(AtomicBool::new(true)),
            push: Default::default(),
            died: Default::default(),
        };
        let app = Router::new()
            .route("/v1/completions", post(prefill))
            .route("/health", get(phealth))
            .with_state(st.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Prefiller {
            addr,
            healthy: st.healthy,
            push: st.push,
            died: st.died,
            task,
        }
    }

    async fn connect_outcomes(&self, to: SocketAddr) {
        let mut s = zeromq::PushSocket::new();
        tokio::time::timeout(T, s.connect(&format!("tcp://{to}")))
            .await
            .unwrap()
            .unwrap();
        *self.push.lock().await = Some(s);
    }

    /// What `kill -9` leaves: the HTTP server gone, the outcome connection closed.
    async fn kill(&self) {
        self.task.abort();
        self.healthy.store(false, Relaxed);
        if let Some(s) = self.push.lock().await.take() {
            let _ = s.close().await;
        }
    }
}

async fn decoder() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let app = Router::new()
        .route(
            "/v1/completions",
            post(|| async {
                let r = json!({"id": "cmpl-d", "object": "text_completion", "created": 2, "model": "m",
                    "choices": [{"index": 0, "text": " d0", "finish_reason": "length"}]});
                ([("content-type", "application/json")], r.to_string())
            }),
        )
        .route("/health", get(|| async { StatusCode::OK }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    (
        addr,
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        }),
    )
}

struct Env {
    proxy: RunningProxy,
    p: Prefiller,
    _d: tokio::task::JoinHandle<()>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// `health_interval`: zero leaves the outcome connection as the only sign of death.
async fn env(health_interval: Duration) -> Env {
    let p = Prefiller::start().await;
    let (daddr, d) = decoder().await;
    let cfg = Config {
        host: "127.0.0.1".into(),
        port: 0,
        proxy_host: "127.0.0.1".into(),
        proxy_port: 0,
        flow: Flow::Lmcache,
        kv_ready_timeout: KV_READY_TIMEOUT,
        prefill_timeout: Duration::from_secs(5),
        decode_timeout: Duration::from_secs(5),
        health_interval,
        health_timeout: Duration::from_millis(500),
        health_kv_ports: Some(false),
        unhealthy_after: 2,
        queue_timeout: Duration::ZERO,
        prefillers: vec![WorkerAddr {
            host: "127.0.0.1".into(),
            port: p.addr.port(),
        }],
        decoders: vec![DecoderConfig {
            host: "127.0.0.1".into(),
            port: daddr.port(),
            init_ports: vec![7300, 7301],
            alloc_ports: vec![7400, 7401],
            max_requests: 0,
            kv_capacity_tokens: 0,
        }],
        ..Config::default()
    };
    let proxy = server::start(cfg).await.unwrap();
    p.connect_outcomes(proxy.notify_addr().expect("lmcache flow"))
        .await;
    Env {
        proxy,
        p,
        _d: d,
        client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
    }
}

impl Env {
    async fn send(&self, method: &str, path: &str, body: Value) -> (StatusCode, Value, String) {
        let body = if body.is_null() {
            Bytes::new()
        } else {
            Bytes::from(body.to_string())
        };
        let req = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.proxy.http_addr()))
            .header("content-type", "application/json")
            .body(Full::new(body))
            .unwrap();
        let resp = tokio::time::timeout(KV_READY_TIMEOUT + T, self.client.request(req))
            .await
            .expect("the proxy answers")
            .unwrap();
        let status = resp.status();
        let b = tokio::time::timeout(T, resp.into_body().collect())
            .await
            .unwrap()
            .unwrap()
            .to_bytes();
        let text = String::from_utf8_lossy(&b).to_string();
        (
            status,
            serde_json::from_slice(&b).unwrap_or(Value::Null),
            text,
        )
    }

    async fn complete(&self, prompt: &str) -> (StatusCode, Value, String) {
        let v = json!({"model": "m", "prompt": prompt, "max_tokens": 3});
        self.send("POST", "/v1/completions", v).await
    }

    async fn metric(&self, name: &str) -> Option<f64> {
        let (_, _, m) = self.send("GET", "/metrics", Value::Null).await;
        m.lines().find_map(|l| {
            l.strip_prefix(name)
                .and_then(|r| r.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
    }
}

/// Sends a `@die` request; the prefiller dies right after answering it. Returns how long the
/// request took and its answer.
async fn request_whose_prefiller_dies(e: &Env) -> (Duration, StatusCode, Value, String) {
    let t = Instant::now();
    let req = e.complete("@die");
    tokio::pin!(req);
    let died = e.p.died.notified();
    tokio::pin!(died);
    let answer = tokio::select! {
        a = &mut req => panic!("answered before the prefiller died: {a:?}"),
        () = &mut died => {
            // Its prefill answer is on the way back; then the process is gone.
            tokio::time::sleep(Duration::from_millis(50)).await;
            e.p.kill().await;
            req.await
        }
    };
    (t.elapsed(), answer.0, answer.1, answer.2)
}

fn assert_lost(el: Duration, status: StatusCode, v: &Value, text: &str) {
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{text}");
    assert_eq!(v["error"]["code"], "prefiller_lost", "{text}");
    assert_eq!(
        v["error"]["message"], "the prefiller holding the KV cache was lost",
        "{text}"
    );
    assert!(
        el < Duration::from_secs(5),
        "took {el:?} (kv_ready_timeout {KV_READY_TIMEOUT:?})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefiller_whose_outcome_connection_closes_fails_its_waits_at_once() {
    let e = env(Duration::ZERO).await;
    // Its outcomes for this request tell the proxy whose connection it is.
    let (s, _, text) = e.complete("warm").await;
    assert_eq!(s, StatusCode::OK, "{text}");
    let (el, status, v, text) = request_whose_prefiller_dies(&e).await;
    assert_lost(el, status, &v, &text);
    assert_eq!(
        e.metric("kvbridge_proxy_kv_waits_prefiller_lost_total")
            .await,
        Some(1.0)
    );
    assert_eq!(
        e.metric("kvbridge_proxy_requests_total{outcome=\"prefiller_lost\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(e.metric("kvbridge_proxy_kv_waits_pending").await, Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefiller_ejected_by_health_checks_fails_its_waits_at_once() {
    let e = env(Duration::from_millis(100)).await;
    // No outcome ever came on its connection: only the health checks can tell.
    let (el, status, v, text) = request_whose_prefiller_dies(&e).await;
    assert_lost(el, status, &v, &text);
    assert_eq!(
        e.metric("kvbridge_proxy_kv_waits_prefiller_lost_total")
            .await,
        Some(1.0)
    );
}
