//! The proxy reads each decoder's KV load counters off its `/metrics` (KvbridgeConnector's
//! `vllm:kvbridge_*` series) and shows them, per decoder, on its own `/metrics`: a silent
//! recompute on one decoder is seen at the proxy. Decoder doubles serve a `/metrics` text the
//! test sets; a missing, malformed, huge or hanging one shows as unknown and never holds up
//! the proxy.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvbridge_proxy::config::{Config, DecoderConfig, Flow, WorkerAddr};
use kvbridge_proxy::decoder_loads::MAX_METRICS_BYTES;
use kvbridge_proxy::server::{self, RunningProxy};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

/// Upper bound for any single wait in these tests.
const T: Duration = Duration::from_secs(10);

/// What a double's `/metrics` does.
#[derive(Clone)]
enum Metrics {
    /// Answers 200 with this text.
    Text(String),
    /// Answers with this status and no body.
    Status(StatusCode),
    /// Never answers.
    Hang,
}

struct DState {
    metrics: Mutex<Metrics>,
    /// `GET /health` calls answered.
    health_calls: AtomicU64,
    /// `GET /metrics` calls received.
    metrics_calls: AtomicU64,
    /// Bytes of `/metrics` bodies written (the endless double).
    metrics_bytes: AtomicU64,
}

/// A worker double: `/health` answers 200, `/metrics` as set.
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

async fn metrics(State(st): State<Arc<DState>>) -> Response {
    st.metrics_calls.fetch_add(1, Relaxed);
    let m = st.metrics.lock().unwrap().clone();
    match m {
        Metrics::Text(t) => t.into_response(),
        Metrics::Status(s) => s.into_response(),
        Metrics::Hang => std::future::pending().await,
    }
}

async fn health(State(st): State<Arc<DState>>) -> StatusCode {
    st.health_calls.fetch_add(1, Relaxed);
    StatusCode::OK
}

impl Double {
    async fn start(m: Metrics) -> Double {
        let st = Arc::new(DState {
            metrics: Mutex::new(m),
            health_calls: AtomicU64::new(0),
            metrics_calls: AtomicU64::new(0),
            metrics_bytes: AtomicU64::new(0),
        });
        let app = Router::new()
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .with_state(st.clone());
        // Bound before anything is sent to it: no readiness wait needed.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Double { addr, st, task }
    }

    /// A decoder whose `/metrics` body has no length and never ends: connector lines, sent
    /// for as long as the reader reads (raw HTTP/1.1, the body delimited by the close).
    async fn endless() -> Double {
        let st = Arc::new(DState {
            metrics: Mutex::new(Metrics::Hang),
            health_calls: AtomicU64::new(0),
            metrics_calls: AtomicU64::new(0),
            metrics_bytes: AtomicU64::new(0),
        });
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let st2 = st.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((c, _)) = l.accept().await else { return };
                tokio::spawn(endless_conn(c, st2.clone()));
            }
        });
        Double { addr, st, task }
    }

    fn set(&self, m: Metrics) {
        *self.st.metrics.lock().unwrap() = m;
    }

    fn label(&self) -> String {
        format!("127.0.0.1:{}", self.addr.port())
    }
}

/// One connection of [`Double::endless`]: `/health` answered 200 (kept alive), `/metrics`
/// answered with a body that never ends.
async fn endless_conn(c: tokio::net::TcpStream, st: Arc<DState>) {
    let (r, mut w) = c.into_split();
    let mut r = BufReader::new(r);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).await.unwrap_or(0) == 0 {
            return;
        }
        let path = line.split(' ').nth(1).unwrap_or("").to_string();
        // The rest of the head.
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).await.unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
        }
        if path != "/metrics" {
            st.health_calls.fetch_add(1, Relaxed);
            let ok = w
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await;
            if ok.is_err() {
                return;
            }
            continue;
        }
        st.metrics_calls.fetch_add(1, Relaxed);
        if w.write_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
            .await
            .is_err()
        {
            return;
        }
        let chunk = "vllm:kvbridge_loads_ok_total{engine=\"0\"} 1\n".repeat(1024);
        while w.write_all(chunk.as_bytes()).await.is_ok() {
            st.metrics_bytes.fetch_add(chunk.len() as u64, Relaxed);
        }
        return;
    }
}

/// A KvbridgeConnector decoder's `/metrics` with two engines, among other vLLM series:
/// `ok` loads, `recomputed` prompts, `failed` loads (two causes) and `checked` loads, each
/// split over the engines.
fn connector_text(ok: u64, recomputed: u64, failed: u64, checked: u64) -> String {
    let e = |engine: u32| format!("engine=\"{engine}\",model_name=\"/models/Qwen \\\"3\\\"\"");
    let (e0, e1) = (e(0), e(1));
    format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{{e0}}} 0.0\n\
         # HELP vllm:kvbridge_loads_ok_total Decoder loads of a prompt's KV from a prefiller that completed.\n\
         # TYPE vllm:kvbridge_loads_ok_total counter\n\
         vllm:kvbridge_loads_ok_total{{{e0}}} {}.0\n\
         vllm:kvbridge_loads_ok_total{{{e1}}} {}.0\n\
         vllm:kvbridge_loads_ok_created{{{e0}}} 1.765e+09\n\
         vllm:kvbridge_loads_recomputed_total{{{e0}}} 0.0\n\
         vllm:kvbridge_loads_recomputed_total{{{e1}}} {recomputed}.0\n\
         vllm:kvbridge_loads_checked_total{{{e0}}} {checked}.0\n\
         vllm:kvbridge_loads_checked_total{{{e1}}} 0.0\n\
         vllm:kvbridge_load_failures_total{{cause=\"timeout\",{e0}}} {}.0\n\
         vllm:kvbridge_load_failures_total{{cause=\"integrity\",{e1}}} {}.0\n\
         vllm:kvbridge_load_failures_total{{cause=\"other\",{e1}}} 0.0\n\
         vllm:kvbridge_bytes_read_total{{{e0}}} 1.2e+07\n",
        ok / 2,
        ok - ok / 2,
        failed / 2,
        failed - failed / 2,
    )
}

struct Env {
    proxy: RunningProxy,
    d: Vec<Double>,
    _p: Double,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// Decoder doubles serving these `/metrics`.
async fn doubles(decoders: Vec<Metrics>) -> Vec<Double> {
    let mut d = Vec::new();
    for m in decoders {
        d.push(Double::start(m).await);
    }
    d
}

/// A proxy of `flow` health-checking every 20 ms, in front of one prefiller and decoders `d`.
async fn env(flow: Flow, d: Vec<Double>) -> Env {
    let p = Double::start(Metrics::Status(StatusCode::NOT_FOUND)).await;
    let cfg = Config {
        host: "127.0.0.1".into(),
        port: 0,
        proxy_host: "127.0.0.1".into(),
        proxy_port: 0,
        flow,
        health_interval: Duration::from_millis(20),
        health_timeout: Duration::from_millis(200),
        health_kv_ports: Some(false),
        prefillers: vec![WorkerAddr {
            host: "127.0.0.1".into(),
            port: p.addr.port(),
        }],
        decoders: d
            .iter()
            .map(|x| DecoderConfig {
                host: "127.0.0.1".into(),
                port: x.addr.port(),
                init_ports: vec![7300],
                alloc_ports: vec![7400],
                max_requests: 0,
                kv_capacity_tokens: 0,
            })
            .collect(),
        ..Config::default()
    };
    let proxy = server::start(cfg).await.unwrap();
    let client = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    Env {
        proxy,
        d,
        _p: p,
        client,
    }
}

impl Env {
    async fn get(&self, path: &str) -> (StatusCode, String) {
        let uri = format!("http://{}{path}", self.proxy.http_addr());
        let req = hyper::Request::get(uri)
            .body(Full::new(Bytes::new()))
            .unwrap();
        let resp = tokio::time::timeout(T, self.client.request(req))
            .await
            .expect("the proxy answers at once")
            .unwrap();
        let status = resp.status();
        let body = tokio::time::timeout(T, resp.into_body().collect())
            .await
            .unwrap()
            .unwrap()
            .to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    async fn metrics(&self) -> String {
        self.get("/metrics").await.1
    }

    /// Polls the proxy's `/metrics` until `want` holds of it (the scrape runs every 20 ms).
    async fn until(&self, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + T;
        loop {
            let m = self.metrics().await;
            if want(&m) {
                return m;
            }
            assert!(Instant::now() < deadline, "never: {what}\n{m}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The value of the sample `name{labels}` in a `/metrics` text.
fn sample(m: &str, series: &str) -> Option<f64> {
    m.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|r| r.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

fn loads(d: &Double, outcome: &str) -> String {
    format!(
        "kvbridge_proxy_decoder_kv_loads_total{{worker=\"{}\",outcome=\"{outcome}\"}}",
        d.label()
    )
}

fn known(d: &Double) -> String {
    format!(
        "kvbridge_proxy_decoder_kv_loads_known{{worker=\"{}\"}}",
        d.label()
    )
}

/// Every figure of decoder `d` as the proxy shows it: known, loaded, recomputed, failed,
/// checked.
fn figures(m: &str, d: &Double) -> [Option<f64>; 5] {
    [
        sample(m, &known(d)),
        sample(m, &loads(d, "loaded")),
        sample(m, &loads(d, "recomputed")),
        sample(m, &loads(d, "failed")),
        sample(m, &loads(d, "checked")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_decoders_loads_and_recomputes_are_shown_and_follow_its_counters() {
    let d = doubles(vec![
        Metrics::Text(connector_text(7, 0, 3, 5)),
        Metrics::Status(StatusCode::NOT_FOUND),
    ])
    .await;
    let e = env(Flow::Vllm, d).await;
    let (d0, d1) = (&e.d[0], &e.d[1]);
    let m = e
        .until("decoder 0's figures", |m| figures(m, d0)[0] == Some(1.0))
        .await;
    assert_eq!(
        figures(&m, d0),
        [Some(1.0), Some(7.0), Some(0.0), Some(3.0), Some(5.0)],
        "summed over engines and causes\n{m}"
    );
    assert_eq!(
        figures(&m, d1),
        [Some(0.0), None, None, None, None],
        "a decoder without /metrics is unknown, not zero\n{m}"
    );
    assert!(m.contains("# TYPE kvbridge_proxy_decoder_kv_loads_total counter\n"));

    // The decoder computes a prompt itself: the proxy shows it at its next scrape.
    d0.set(Metrics::Text(connector_text(9, 1, 3, 6)));
    let m = e
        .until("the recompute", |m| figures(m, d0)[2] == Some(1.0))
        .await;
    assert_eq!(
        figures(&m, d0),
        [Some(1.0), Some(9.0), Some(1.0), Some(3.0), Some(6.0)],
        "{m}"
    );

    // The other decoder comes up with the connector: now both are known, apart.
    d1.set(Metrics::Text(connector_text(2, 0, 0, 0)));
    let m = e
        .until("decoder 1's figures", |m| figures(m, d1)[0] == Some(1.0))
        .await;
    assert_eq!(figures(&m, d1)[1], Some(2.0), "{m}");
    assert_eq!(figures(&m, d0)[1], Some(9.0), "{m}");

    // A `/metrics` that cannot be read any more drops the old figures: unknown, not stale.
    d0.set(Metrics::Text(
        "vllm:kvbridge_loads_ok_total{engine=\"0\"} NaN\n".into(),
    ));
    let m = e
        .until("decoder 0 unknown", |m| figures(m, d0)[0] == Some(0.0))
        .await;
    assert_eq!(figures(&m, d0), [Some(0.0), None, None, None, None], "{m}");
    assert_eq!(figures(&m, d1)[1], Some(2.0), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_hanging_or_foreign_metrics_is_unknown_and_holds_nothing_up() {
    let huge = format!(
        "{}# {}\n",
        connector_text(1, 0, 0, 0),
        "x".repeat(MAX_METRICS_BYTES)
    );
    let mut d = doubles(vec![
        Metrics::Text(connector_text(4, 1, 0, 0)),
        Metrics::Text(huge),
        Metrics::Hang,
        Metrics::Text("vllm:num_requests_running 1\n".into()),
    ])
    .await;
    d.push(Double::endless().await);
    let e = env(Flow::Vllm, d).await;
    // Once every decoder was scraped twice, decoder 0 is known and the rest are not.
    e.until("two scrapes of every decoder", |_| {
        e.d.iter().all(|d| d.st.metrics_calls.load(Relaxed) >= 2)
    })
    .await;
    let m = e
        .until("decoder 0's figures", |m| {
            figures(m, &e.d[0])[1] == Some(4.0)
        })
        .await;
    for d in &e.d[1..] {
        assert_eq!(figures(&m, d), [Some(0.0), None, None, None, None], "{m}");
    }
    // Every decoder still passes its health checks, and the proxy answers at once.
    for d in &e.d {
        let h = format!(
            "kvbridge_proxy_worker_healthy{{role=\"decode\",worker=\"{}\"}}",
            d.label()
        );
        assert_eq!(sample(&m, &h), Some(1.0), "{m}");
    }
    // The endless body was cut at the cap: what the double wrote per scrape is the cap and
    // what the sockets' buffers hold, not all that the deadline allowed.
    let endless = &e.d[4].st;
    let per_scrape = endless.metrics_bytes.load(Relaxed) / endless.metrics_calls.load(Relaxed);
    assert!(
        per_scrape < 4 * MAX_METRICS_BYTES as u64,
        "{per_scrape} bytes per scrape"
    );
    let t0 = Instant::now();
    let (status, body) = e.get("/health").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(t0.elapsed() < Duration::from_secs(1));
    // The huge one turns readable: now it is known.
    e.d[1].set(Metrics::Text(connector_text(1, 0, 0, 0)));
    e.until("decoder 1's figures", |m| {
        figures(m, &e.d[1])[1] == Some(1.0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lmcache_flow_scrapes_no_decoder() {
    let d = doubles(vec![Metrics::Text(connector_text(4, 1, 0, 0))]).await;
    let e = env(Flow::Lmcache, d).await;
    let d = &e.d[0];
    e.until("three health checks of the decoder", |_| {
        d.st.health_calls.load(Relaxed) >= 3
    })
    .await;
    assert_eq!(d.st.metrics_calls.load(Relaxed), 0);
    let m = e.metrics().await;
    assert!(!m.contains("kvbridge_proxy_decoder_kv_loads"), "{m}");
}
