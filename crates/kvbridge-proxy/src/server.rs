//! The HTTP front: routes, the two request flows, and the calls to the workers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE};
use axum::http::Uri;
use axum::http::{HeaderMap, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::body::{Finish, ProxyBody};
use crate::busy_poll::{Awaiting, BusyPoll};
use crate::config::{Config, Flow};
use crate::kvwait::{Binding, KvOutcome, KvWait, KvWaiters, Loss};
use crate::metrics::{Metrics, Outcome};
use crate::pool::{PickError, Pool, Role, Slot};
use crate::reply::{ApiError, Reply, Track, X_REQUEST_ID};
use crate::request::{Api, PrefillAnswer, ReqDoc};

/// lmcache flow, decode before `KvReady`: how long a decoder's error waits for the KV's
/// outcome, so that a decoder failing because its transfer did is reported as the transfer's
/// failure (`kv_transfer_failed`). Both learn of it within a millisecond or so of each other.
const KV_OUTCOME_GRACE: Duration = Duration::from_millis(100);

/// `tracing` target of the per-request timeline marks (`kvbridge demo --timeline`).
const TL: &str = "kvbridge::timeline";

/// Largest worker response read whole (prefill answers, non-streamed decodes, errors).
const MAX_UPSTREAM_BODY: usize = 64 << 20;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A running proxy: its bound addresses and the handle to stop it. Dropping it stops every
/// task of the proxy at once; [`RunningProxy::shutdown`] lets requests in flight finish first.
pub struct RunningProxy {
    http_addr: SocketAddr,
    notify_addr: Option<SocketAddr>,
    app: Arc<App>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
    tasks: Vec<JoinHandle<()>>,
}

impl RunningProxy {
    /// Address of the HTTP server.
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// Address of the notification PULL socket (lmcache flow only).
    pub fn notify_addr(&self) -> Option<SocketAddr> {
        self.notify_addr
    }

    /// The proxy's live metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.app.metrics
    }

    /// The disaggregation decider and its counts.
    pub fn decider(&self) -> &crate::decider::Decider {
        &self.app.decider
    }

    /// Stops accepting, lets requests in flight finish (at most 30 s), then stops every task.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(mut h) = self.server.take() {
            if tokio::time::timeout(Duration::from_secs(30), &mut h)
                .await
                .is_err()
            {
                h.abort();
            }
        }
    }
}

impl Drop for RunningProxy {
    fn drop(&mut self) {
        if let Some(h) = &self.server {
            h.abort();
        }
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Shared state of all requests.
pub(crate) struct App {
    cfg: Config,
    client: HttpClient,
    prefill: Arc<Pool>,
    decode: Arc<Pool>,
    waiters: Option<KvWaiters>,
    metrics: Arc<Metrics>,
    /// Per worker, the URIs of both APIs (completions, chat), parsed once.
    prefill_uris: Vec<[Uri; 2]>,
    decode_uris: Vec<[Uri; 2]>,
    /// Polls for backend answers at low load (one-thread runtime only).
    busy_poll: Option<Arc<BusyPoll>>,
    /// Whether a request goes to its decoder alone or the PD way.
    decider: crate::decider::Decider,
}

fn api_uris(pool: &Pool) -> anyhow::Result<Vec<[Uri; 2]>> {
    pool.workers
        .iter()
        .map(|w| {
            let u = |api: Api| {
                format!("{}{}", w.base, api.path())
                    .parse::<Uri>()
                    .map_err(|e| anyhow::anyhow!("bad worker address {}: {e}", w.label))
            };
            Ok([u(Api::Completions)?, u(Api::Chat)?])
        })
        .collect()
}

/// Binds the HTTP listener (and, in the lmcache flow, the notification socket), starts the
/// health checks, and serves in the background. Everything is bound when this returns.
pub async fn start(cfg: Config) -> anyhow::Result<RunningProxy> {
    cfg.validate()?;
    let metrics = Arc::new(Metrics::default());
    let mut tasks = Vec::new();
    let (waiters, notify_addr) = if cfg.flow == Flow::Lmcache {
        let w = KvWaiters::spawn(metrics.clone());
        let (addr, t) = crate::outcome_port::bind(
            &cfg.proxy_host,
            cfg.proxy_port,
            w.clone(),
            metrics.clone(),
            cfg.secret.clone(),
            cfg.outcome_port,
        )
        .await?;
        tasks.push(t);
        (Some(w), Some(addr))
    } else {
        (None, None)
    };
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", cfg.host, cfg.port))?;
    let http_addr = listener.local_addr()?;

    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(cfg.connect_timeout));
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_timer(TokioTimer::new())
        .build(conn);
    let (ua, ha) = (cfg.unhealthy_after, cfg.healthy_after);
    let prefill = Pool::routed(
        Role::Prefill,
        cfg.prefillers
            .iter()
            .map(|w| (w.host.clone(), w.port, 0, 0)),
        ua,
        ha,
        crate::router::for_pool(&cfg, Role::Prefill),
    );
    let decode = Pool::routed(
        Role::Decode,
        cfg.decoders
            .iter()
            .map(|d| (d.host.clone(), d.port, d.max_requests, d.kv_capacity_tokens)),
        ua,
        ha,
        crate::router::for_pool(&cfg, Role::Decode),
    );
    let (prefill_uris, decode_uris) = (api_uris(&prefill)?, api_uris(&decode)?);
    let one_thread = tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::CurrentThread;
    let busy_poll = (one_thread && !cfg.busy_poll.is_zero()).then(|| BusyPoll::new(cfg.busy_poll));
    if let Some(bp) = &busy_poll {
        tasks.push(tokio::spawn(bp.clone().run()));
    }
    let decider = crate::decider::Decider::new(cfg.decider());
    let app = Arc::new(App {
        decider,
        cfg,
        client,
        prefill,
        decode,
        waiters,
        metrics,
        prefill_uris,
        decode_uris,
        busy_poll,
    });
    if !app.cfg.health_interval.is_zero() {
        for idx in 0..app.prefill.workers.len() {
            let pool = app.prefill.clone();
            tasks.push(tokio::spawn(health_loop(
                app.clone(),
                pool,
                idx,
                Vec::new(),
            )));
        }
        for (idx, d) in app.cfg.decoders.iter().enumerate() {
            let kv = if app.cfg.probes_kv_ports() {
                d.init_ports
                    .iter()
                    .map(|p| format!("{}:{p}", d.host))
                    .collect()
            } else {
                Vec::new()
            };
            let pool = app.decode.clone();
            tasks.push(tokio::spawn(health_loop(app.clone(), pool, idx, kv)));
        }
    }
    let router = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(app.cfg.max_body_bytes))
        .with_state(app.clone());
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let server = tokio::spawn(crate::listener::serve(
        listener,
        router,
        app.cfg.http_limits,
        app.metrics.clone(),
        stop_rx,
    ));
    Ok(RunningProxy {
        http_addr,
        notify_addr,
        app,
        stop: Some(stop_tx),
        server: Some(server),
        tasks,
    })
}

/// Checks worker `idx` every `health_interval`: `GET /health` must answer 2xx, then each of
/// `kv` (`host:port`, a decoder's KV init ports) must accept a TCP connection, all within
/// `health_timeout`. The probe connection is closed before it sends a byte, which a kvbridge
/// listener drops without a word.
async fn health_loop(app: Arc<App>, pool: Arc<Pool>, idx: usize, kv: Vec<String>) {
    let mut tick = tokio::time::interval(app.cfg.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let uri = format!("{}/health", pool.workers[idx].base);
    loop {
        tick.tick().await;
        let started = pool.check_started(idx);
        let req = Request::get(&uri).body(Full::new(Bytes::new()));
        let Ok(req) = req else { return };
        let check = async {
            let resp = match app.client.request(req).await {
                Ok(r) => r,
                Err(e) => return Err(format!("GET /health: {e}")),
            };
            let status = resp.status();
            let _ = Limited::new(resp.into_body(), 1 << 16).collect().await;
            if !status.is_success() {
                return Err(format!("GET /health answered {status}"));
            }
            for a in &kv {
                if let Err(e) = tokio::net::TcpStream::connect(a).await {
                    return Err(format!("KV port {a}: {e}"));
                }
            }
            Ok(())
        };
        let r = match tokio::time::timeout(app.cfg.health_timeout, check).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {:?}", app.cfg.health_timeout)),
        };
        let changed = pool.report_check(idx, r.is_ok(), started);
        if changed && r.is_err() && pool.role == Role::Prefill {
            app.prefiller_ejected(idx);
        }
        let worker = &pool.workers[idx].label;
        match r {
            Err(why) if changed => {
                tracing::warn!(%worker, "health check failed, worker ejected: {why}")
            }
            Err(why) => tracing::debug!(%worker, "health check failed: {why}"),
            Ok(()) if changed => {
                tracing::info!(%worker, "health checks pass again, worker re-admitted")
            }
            Ok(()) => {}
        }
    }
}

fn pick_error(role: Role, e: PickError) -> ApiError {
    match e {
        PickError::NoHealthy => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_healthy_worker",
            Outcome::NoWorker,
            format!("no healthy {} worker", role.as_str()),
        ),
        PickError::Full => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "admission_full",
            Outcome::AdmissionFull,
            format!("every {} worker is at its admission limit; retry later", role.as_str()),
        ),
        PickError::TooLarge { tokens, capacity } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "prompt_exceeds_kv_capacity",
            Outcome::BadRequest,
            format!("the prompt (about {tokens} tokens) exceeds the KV capacity of every decoder ({capacity} tokens)"),
        ),
    }
}

async fn completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.serve(Api::Completions, headers, body).await
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    app.serve(Api::Chat, headers, body).await
}

async fn not_found(method: Method, uri: axum::http::Uri) -> Response {
    let v = json!({"error": {"message": format!("no route for {method} {}", uri.path()), "type": "invalid_request_error", "param": null, "code": "not_found"}});
    (
        StatusCode::NOT_FOUND,
        [(CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let (p, d) = (app.prefill.healthy_count(), app.decode.healthy_count());
    let ok = p > 0 && d > 0;
    let v = json!({"status": if ok {"ok"} else {"unavailable"}, "prefillers_healthy": p, "decoders_healthy": d});
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, [(CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

async fn metrics_text(State(app): State<Arc<App>>) -> Response {
    let mut s = String::with_capacity(8192);
    app.metrics.render(&mut s);
    app.prefill.render(&mut s);
    app.decode.render(&mut s);
    let slots: u64 = app.decode.workers.iter().map(|w| w.inflight()).sum();
    let pslots: u64 = app.prefill.workers.iter().map(|w| w.inflight()).sum();
    use std::fmt::Write as _;
    app.decider.render(&mut s);
    crate::router::render_decisions(
        &mut s,
        &[
            ("prefill", &app.prefill.router),
            ("decode", &app.decode.router),
        ],
    );
    let spun = app.busy_poll.as_ref().map_or(0.0, |b| b.spun_secs());
    let _ = writeln!(
        s,
        "# HELP kvbridge_proxy_busy_poll_seconds_total Time spent polling for backend answers \
         instead of sleeping (--busy-poll-us).\n\
         # TYPE kvbridge_proxy_busy_poll_seconds_total counter\n\
         kvbridge_proxy_busy_poll_seconds_total {spun}"
    );
    let _ = writeln!(
        s,
        "# HELP kvbridge_proxy_admission_slots_taken Decoder admission slots held now.\n\
         # TYPE kvbridge_proxy_admission_slots_taken gauge\nkvbridge_proxy_admission_slots_taken {slots}\n\
         # HELP kvbridge_proxy_prefill_slots_taken Prefill requests in flight now.\n\
         # TYPE kvbridge_proxy_prefill_slots_taken gauge\nkvbridge_proxy_prefill_slots_taken {pslots}"
    );
    ([(CONTENT_TYPE, "text/plain; version=0.0.4")], s).into_response()
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    let rid = app.request_id(&headers);
    let Some(w) = app
        .decode
        .workers
        .iter()
        .chain(app.prefill.workers.iter())
        .find(|w| w.is_healthy())
    else {
        return pick_error(Role::Decode, PickError::NoHealthy).into_response(&rid);
    };
    let uri = format!("{}/v1/models", w.base);
    let r = async {
        let req = Request::get(uri)
            .header(X_REQUEST_ID, rid.clone())
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = app.client.request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let b = Limited::new(body, MAX_UPSTREAM_BODY)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok::<_, String>((parts.status, parts.headers.get(CONTENT_TYPE).cloned(), b))
    };
    let r = tokio::time::timeout(app.cfg.decode_timeout, r).await;
    if let Ok(Err(e)) = &r {
        tracing::warn!(request_id = ?rid, worker = %w.label, "GET /v1/models: {e}");
    } else if r.is_err() {
        tracing::warn!(request_id = ?rid, worker = %w.label, "GET /v1/models timed out");
    }
    match r {
        Ok(Ok((status, ct, b))) => {
            let mut resp = Response::new(Body::from(b));
            *resp.status_mut() = status;
            if let Some(ct) = ct {
                resp.headers_mut().insert(CONTENT_TYPE, ct);
            }
            resp
        }
        Ok(Err(e)) => ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_failed",
            Outcome::DecodeError,
            format!("worker {}: {e}", w.label),
        )
        .into_response(&rid),
        Err(_) => ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_timeout",
            Outcome::DecodeError,
            format!("worker {} timed out", w.label),
        )
        .into_response(&rid),
    }
}

/// Failure of one call to a worker.
enum CallError {
    Connect(String),
    Other(String),
}

fn excerpt(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(&b[..b.len().min(512)]);
    s.trim().to_string()
}

/// The prefill request: the client's body with `max_tokens` (and `max_completion_tokens`)
/// 1, `stream` false, no `stream_options`, and the flow's `kv_transfer_params`.
pub(crate) fn prefill_body(doc: &ReqDoc<'_>, kv: &[u8]) -> Vec<u8> {
    let mct: Option<&[u8]> = doc.has("max_completion_tokens").then_some(b"1");
    doc.with(&[
        ("max_tokens", Some(b"1")),
        ("max_completion_tokens", mct),
        ("stream", Some(b"false")),
        ("stream_options", None),
        ("kv_transfer_params", Some(kv)),
    ])
}

/// `kv_transfer_params` of the vLLM flow's prefill request.
pub(crate) const VLLM_PREFILL_KV: &[u8] = br#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The vLLM flow's decode request: the client's body with the prefill answer's
/// `kv_transfer_params` (removed when the answer had none).
pub(crate) fn vllm_decode_body(doc: &ReqDoc<'_>, kv: Option<&[u8]>) -> Vec<u8> {
    doc.with(&[("kv_transfer_params", kv)])
}

/// The LMCache flow's decode request. `first`: the prefill's first token, which the decode
/// then continues from with one token less to make: a completion with a text prompt gets it
/// appended to its prompt; a chat ([`chat_continues`]) gets it as a last assistant message
/// with `continue_final_message: true` and `add_generation_prompt: false` (vLLM's and
/// SGLang's way to continue a reply). The PD request id goes along as
/// `kv_transfer_params: {"lmcache.pd_handoff_id": id}` (the key LMCache's own proxy uses),
/// so a decoder can find the KV by id.
pub(crate) fn lmcache_decode_body(
    doc: &ReqDoc<'_>,
    api: Api,
    first: Option<&str>,
    pd_id: &str,
) -> Vec<u8> {
    let kv = serde_json::to_vec(&json!({ "lmcache.pd_handoff_id": pd_id })).unwrap_or_default();
    let Some(first) = first else {
        return doc.with(&[("kv_transfer_params", Some(&kv))]);
    };
    let prompt = match api {
        Api::Completions => doc.prompt_text().map(|mut p| {
            p.push_str(first);
            serde_json::to_vec(&p).unwrap_or_default()
        }),
        Api::Chat => None,
    };
    let messages = match api {
        Api::Chat => chat_messages(doc).map(|mut m| {
            m.push(json!({"role": "assistant", "content": first}));
            serde_json::to_vec(&m).unwrap_or_default()
        }),
        Api::Completions => None,
    };
    // Both limits are at least 2 here: one token is already made.
    let less = |key: &str| {
        doc.int(key)
            .map(|m| m.saturating_sub(1).max(1).to_string().into_bytes())
    };
    let (mt, mct) = (less("max_tokens"), less("max_completion_tokens"));
    let mut set: Vec<(&str, Option<&[u8]>)> = vec![("kv_transfer_params", Some(&kv))];
    if let Some(p) = &prompt {
        set.push(("prompt", Some(p)));
    }
    if let Some(m) = &messages {
        set.push(("messages", Some(m)));
        set.push(("continue_final_message", Some(b"true")));
        set.push(("add_generation_prompt", Some(b"false")));
    }
    if let Some(m) = &mt {
        set.push(("max_tokens", Some(m)));
    }
    if let Some(m) = &mct {
        set.push(("max_completion_tokens", Some(m)));
    }
    doc.with(&set)
}

/// A chat's `messages`, when they are an array.
fn chat_messages(doc: &ReqDoc<'_>) -> Option<Vec<Value>> {
    serde_json::from_str(doc.get("messages")?.get()).ok()
}

/// Whether a chat's decode can continue from the prefill's first token: its messages parse,
/// it asks for more than one token, and it does not continue a reply of its own already
/// (`continue_final_message`, or no `add_generation_prompt`).
pub(crate) fn chat_continues(doc: &ReqDoc<'_>) -> bool {
    let flag = |key: &str| doc.get(key).map(|v| v.get().trim());
    chat_messages(doc).is_some()
        && doc.max_tokens != Some(1)
        && matches!(
            flag("continue_final_message"),
            None | Some("false") | Some("null")
        )
        && matches!(
            flag("add_generation_prompt"),
            None | Some("true") | Some("null")
        )
}

/// Where an attempt on a decoder ended.
/// How one attempt of the LMCache flow failed.
enum LmcacheFail {
    /// The prefiller could not reach this decoder at all (no KV moved): the request may go
    /// to another decoder. Its admission slot was given back.
    ReceiverUnreachable(String),
    /// Any other failure: the answer to give.
    Api(ApiError),
}

impl From<ApiError> for LmcacheFail {
    fn from(e: ApiError) -> Self {
        LmcacheFail::Api(e)
    }
}

/// The error code with which a prefiller says it could not reach the decoder named in the
/// request's `disagg_spec` at all (connection refused, reset or timed out): no KV moved.
pub(crate) const KV_RECEIVER_UNREACHABLE: &str = "kv_receiver_unreachable";

enum DecodeFail {
    /// The decoder refused the connection; its slot comes back for a retry elsewhere.
    Refused(Slot, String),
    /// Any other failure: the answer to give.
    Api(ApiError),
}

/// A fresh request id: `kvb-` and 128 random bits in hex. Unguessable, so that no one who
/// sees some ids (a client gets its own back) can name another request's id, e.g. in a
/// forged outcome.
pub(crate) fn random_id() -> String {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        // The OS source failing is not seen on Linux past early boot. `RandomState` is
        // keyed from the same source at start; its SipHash of a counter is still not
        // guessable from outside.
        use std::hash::{BuildHasher, Hasher};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Relaxed);
        for (i, half) in b.chunks_mut(8).enumerate() {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(n);
            h.write_usize(i);
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    let mut s = String::with_capacity(36);
    s.push_str("kvb-");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

impl App {
    fn next_id(&self) -> String {
        random_id()
    }

    fn request_id(&self, headers: &HeaderMap) -> HeaderValue {
        match headers.get(X_REQUEST_ID) {
            Some(v) if !v.is_empty() && v.len() <= 256 && v.to_str().is_ok() => v.clone(),
            _ => HeaderValue::from_str(&self.next_id()).unwrap_or(HeaderValue::from_static("kvb")),
        }
    }

    fn uri(&self, role: Role, idx: usize, api: Api) -> Uri {
        let uris = match role {
            Role::Prefill => &self.prefill_uris,
            Role::Decode => &self.decode_uris,
        };
        uris[idx][(api == Api::Chat) as usize].clone()
    }

    async fn serve(
        self: Arc<Self>,
        api: Api,
        headers: HeaderMap,
        body: Result<Bytes, BytesRejection>,
    ) -> Response {
        let rid = self.request_id(&headers);
        let mut track = Track::new(self.metrics.clone(), rid.clone());
        tracing::debug!(target: TL, stage = "proxy.received", id = track.rid());
        match self.flow(api, &headers, body, &rid, &track).await {
            Ok(Reply::Full { content_type, body }) => {
                self.metrics.ttft.observe(track.t0.elapsed());
                track.outcome = Outcome::Ok;
                tracing::debug!(request_id = track.rid(), "answered");
                let mut r = Response::new(Body::from(body));
                r.headers_mut().insert(CONTENT_TYPE, content_type);
                r.headers_mut().insert(X_REQUEST_ID, rid);
                r
            }
            Ok(Reply::Stream {
                content_type,
                body,
                prefix,
                slot,
                decode_start,
            }) => {
                let fin = Finish {
                    track,
                    slot: Some(slot),
                    decode_start,
                };
                let body = ProxyBody::new(body, prefix, self.cfg.decode_timeout, fin);
                let mut r = Response::new(Body::new(body));
                r.headers_mut().insert(CONTENT_TYPE, content_type);
                r.headers_mut()
                    .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                r.headers_mut().insert(X_REQUEST_ID, rid);
                r
            }
            Ok(Reply::Pending { first, decode }) => {
                let body = ProxyBody::pending(first, decode, self.cfg.decode_timeout, track);
                let mut r = Response::new(Body::new(body));
                r.headers_mut()
                    .insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
                r.headers_mut()
                    .insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                r.headers_mut().insert(X_REQUEST_ID, rid);
                r
            }
            Err(e) => {
                track.outcome = e.outcome;
                if e.status.is_server_error() || e.status == StatusCode::TOO_MANY_REQUESTS {
                    tracing::warn!(
                        request_id = track.rid(),
                        status = e.status.as_u16(),
                        code = e.code,
                        "{}",
                        e.message
                    );
                } else {
                    tracing::debug!(
                        request_id = track.rid(),
                        status = e.status.as_u16(),
                        code = e.code,
                        "{}",
                        e.message
                    );
                }
                e.into_response(&rid)
            }
        }
    }

    async fn flow(
        self: &Arc<Self>,
        api: Api,
        headers: &HeaderMap,
        body: Result<Bytes, BytesRejection>,
        rid: &HeaderValue,
        track: &Track,
    ) -> Result<Reply, ApiError> {
        let body = body.map_err(|r| {
            if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                self.metrics.body_too_large.fetch_add(1, Relaxed);
                return ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "request_too_large",
                    Outcome::BadRequest,
                    format!(
                        "the request body is larger than this proxy's limit of {} bytes (--max-body-bytes)",
                        self.cfg.max_body_bytes
                    ),
                );
            }
            if crate::listener::body_timed_out(&r) {
                return ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "request_timeout",
                    Outcome::BadRequest,
                    format!(
                        "the request body did not arrive within {:?} (--body-timeout)",
                        self.cfg.http_limits.body_timeout
                    ),
                );
            }
            ApiError::new(
                r.status(),
                "invalid_body",
                Outcome::BadRequest,
                r.body_text(),
            )
        })?;
        let doc = ReqDoc::parse(api, &body).map_err(ApiError::bad_request)?;
        let tokens = (body.len() as u64 / 4).max(1);
        let prompt = (self.cfg.routing != crate::routing::RoutingPolicy::LeastLoaded
            || self.decider.active())
        .then(|| crate::router::PromptKey::from_raw(doc.prompt_raw()));
        // The decoder is admitted first: its KV buffer is the scarce resource.
        let dslot = self
            .decode
            .pick_for(
                tokens,
                self.cfg.max_queue,
                self.cfg.queue_timeout,
                &self.metrics.admission_queue,
                prompt.as_ref(),
            )
            .await
            .map_err(|e| pick_error(Role::Decode, e))?;
        let auth = headers.get(AUTHORIZATION);
        let ctx = Ctx {
            api,
            rid,
            auth,
            tokens,
            stream: doc.stream,
            t0: track.t0,
            prompt,
        };
        let prompt_tokens = ctx
            .prompt
            .as_ref()
            .map_or(tokens, crate::router::PromptKey::estimated_tokens);
        if self.decider.decide(prompt_tokens, dslot.cached_tokens())
            == crate::decider::Decision::DecodeOnly
        {
            // The decoder prefills the prompt itself: the request goes to it as it came.
            tracing::debug!(target: TL, stage = "proxy.decode_only", id = track.rid());
            let dbody = Bytes::from(vllm_decode_body(&doc, None));
            return self.decode(&ctx, dbody, dslot, true).await;
        }
        match self.cfg.flow {
            Flow::Vllm => self.vllm(&ctx, &doc, dslot).await,
            Flow::Lmcache => self.lmcache(&ctx, &doc, dslot).await,
        }
    }

    /// vLLM NIXL flow: the prefill answer's `kv_transfer_params` go into the decode request.
    async fn vllm(&self, ctx: &Ctx<'_>, doc: &ReqDoc<'_>, dslot: Slot) -> Result<Reply, ApiError> {
        let pbody = Bytes::from(prefill_body(doc, VLLM_PREFILL_KV));
        let answer = self.prefill(ctx, pbody, None).await?;
        let kv = serde_json::from_slice::<PrefillAnswer>(&answer).map_err(|e| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "prefill_failed",
                Outcome::PrefillError,
                format!("the prefiller answered invalid JSON: {e}"),
            )
        })?;
        let kv = kv.kv_transfer_params.map(|r| r.get().as_bytes());
        let dbody = Bytes::from(vllm_decode_body(doc, kv));
        // The KV waits on the prefiller until a decoder reads it: any decoder will do, so a
        // refused connection is retried on another one.
        self.decode(ctx, dbody, dslot, true).await
    }

    /// LMCache flow: prefill with a `disagg_spec`, wait for every rank's outcome, then decode.
    /// A prefiller that answers `kv_receiver_unreachable` (it could not reach the chosen
    /// decoder at all, so no KV moved) has that decoder ejected, and the request starts over
    /// on the least loaded other healthy decoder that admits it, each decoder at most once.
    async fn lmcache(
        self: &Arc<Self>,
        ctx: &Ctx<'_>,
        doc: &ReqDoc<'_>,
        mut dslot: Slot,
    ) -> Result<Reply, ApiError> {
        let mut tried = Vec::new();
        loop {
            let (index, label) = (dslot.index(), dslot.worker().label.clone());
            let detail = match self.lmcache_once(ctx, doc, dslot).await {
                Ok(r) => return Ok(r),
                Err(LmcacheFail::Api(e)) => return Err(e),
                Err(LmcacheFail::ReceiverUnreachable(detail)) => detail,
            };
            tracing::warn!(request_id = ctx.rid(), worker = %label, "the prefiller cannot reach this decoder: {detail}");
            let err = self.decoder_down(index, &label, format!("from the prefiller: {detail}"));
            tried.push(index);
            dslot = match self.decode.try_pick(ctx.tokens, &tried) {
                Ok(s) => s,
                Err(_) => return Err(err),
            };
            self.metrics.decoder_retries.fetch_add(1, Relaxed);
        }
    }

    /// One attempt of [`App::lmcache`] with `dslot`'s decoder.
    async fn lmcache_once(
        self: &Arc<Self>,
        ctx: &Ctx<'_>,
        doc: &ReqDoc<'_>,
        dslot: Slot,
    ) -> Result<Reply, LmcacheFail> {
        let Some(waiters) = &self.waiters else {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                Outcome::PrefillError,
                "no notification socket",
            )
            .into());
        };
        let dc = &self.cfg.decoders[dslot.index()];
        let id = self.next_id();
        // Registered before the prefill is sent, so no outcome can arrive before its waiter.
        let mut wait = waiters.register(&id, dc.ranks());
        tracing::debug!(request_id = ctx.rid(), kv_req_id = %id, decoder = %dslot.worker().label, "lmcache prefill");
        let spec = json!({"ret_first_tok": true, "disagg_spec": {"req_id": id, "receiver_host": dc.host,
            "receiver_init_port": dc.init_ports, "receiver_alloc_port": dc.alloc_ports}});
        let spec = serde_json::to_vec(&spec).unwrap_or_default();
        let pbody = Bytes::from(prefill_body(doc, &spec));
        tracing::debug!(target: TL, stage = "proxy.prefill_sent", id = %id);
        let prefill = self.prefill(ctx, pbody, Some(wait.binding()));
        tokio::pin!(prefill);
        let mut ready = false;
        let kv_failed = |rank: u32, reason: String| {
            ApiError::new(
                StatusCode::BAD_GATEWAY,
                "kv_transfer_failed",
                Outcome::KvFailed,
                format!("KV transfer of request {id} failed on rank {rank}: {reason}"),
            )
        };
        let gone = || {
            ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                Outcome::KvTimeout,
                "the proxy is shutting down",
            )
        };
        let unreachable = |r: Result<Bytes, ApiError>| match r {
            Err(e) if e.code == KV_RECEIVER_UNREACHABLE => {
                Err(LmcacheFail::ReceiverUnreachable(e.message))
            }
            r => r.map_err(LmcacheFail::Api),
        };
        let answer = loop {
            tokio::select! {
                r = &mut prefill => break unreachable(r)?,
                o = wait.outcome(), if !ready => match o {
                    Some(KvOutcome::Ready) => {
                        tracing::debug!(target: TL, stage = "proxy.kv_ready", id = %id);
                        ready = true
                    }
                    Some(KvOutcome::PrefillerLost { prefiller, how }) => {
                        return Err(self.prefiller_lost(&id, prefiller, how).into())
                    }
                    Some(KvOutcome::Failed { rank, reason }) => {
                        // A prefiller that cannot reach the decoder reports KvFailed and
                        // answers `kv_receiver_unreachable` at about the same time, in
                        // either order: give its answer a moment to say which it is.
                        // Any other answer leaves the outcome as it was: `KvFailed`.
                        if let Ok(Err(e)) =
                            tokio::time::timeout(KV_OUTCOME_GRACE, prefill.as_mut()).await
                        {
                            if e.code == KV_RECEIVER_UNREACHABLE {
                                return Err(LmcacheFail::ReceiverUnreachable(e.message));
                            }
                        }
                        return Err(kv_failed(rank, reason).into());
                    }
                    None => return Err(gone().into()),
                },
            }
        };
        tracing::debug!(target: TL, stage = "proxy.prefill_answered", id = %id);
        let t = Instant::now();
        // Counted from the end of the prefill, in both orders.
        let kv_deadline = tokio::time::Instant::now() + self.cfg.kv_ready_timeout;
        let kv_timeout = || {
            ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "kv_ready_timeout",
                Outcome::KvTimeout,
                format!(
                    "KV of request {id} was not ready on all {} ranks within {:?}",
                    dc.ranks(),
                    self.cfg.kv_ready_timeout
                ),
            )
        };
        // Waits for the rest of the ranks' outcomes, up to the deadline.
        let kv_outcome = async |wait: &mut KvWait| -> Result<(), ApiError> {
            match tokio::time::timeout_at(kv_deadline, wait.outcome()).await {
                Ok(Some(KvOutcome::Ready)) => {
                    tracing::debug!(target: TL, stage = "proxy.kv_ready", id = %id);
                    self.metrics.kv_wait.observe(t.elapsed());
                    Ok(())
                }
                Ok(Some(KvOutcome::Failed { rank, reason })) => Err(kv_failed(rank, reason)),
                Ok(Some(KvOutcome::PrefillerLost { prefiller, how })) => {
                    Err(self.prefiller_lost(&id, prefiller, how))
                }
                Ok(None) => Err(gone()),
                Err(_) => Err(kv_timeout()),
            }
        };
        if ready {
            // Every rank reported before the prefill answered.
            self.metrics.kv_wait.observe(t.elapsed());
        }
        // Completions with a text prompt continue from the prefill's first token, so their
        // decode needs the prefill's answer; with `max_tokens: 1` that answer is the whole
        // answer (still given only once the KV is confirmed, as before).
        let mut prefix = None;
        // A chat continues from the prefill's token only to send that token early: with
        // `first_token_on_kv_ready` off it goes to the decoder as it came.
        if ctx.api == Api::Chat && self.cfg.first_token_on_kv_ready && chat_continues(doc) {
            let first = serde_json::from_slice::<Value>(&answer)
                .ok()
                .and_then(|pv| {
                    let f = pv
                        .pointer("/choices/0/message/content")?
                        .as_str()?
                        .to_string();
                    Some((f, pv))
                });
            // An answer without a text first token: the decoder makes the whole answer.
            prefix = first.filter(|(f, _)| !f.is_empty());
        }
        if ctx.api == Api::Completions && doc.prompt_text().is_some() {
            let pv: Value = serde_json::from_slice(&answer).map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "prefill_failed",
                    Outcome::PrefillError,
                    format!("the prefiller answered invalid JSON: {e}"),
                )
            })?;
            if let Some(first) = pv.pointer("/choices/0/text").and_then(Value::as_str) {
                if doc.max_tokens == Some(1) {
                    if !ready {
                        kv_outcome(&mut wait).await?;
                    }
                    return Ok(answer_from_prefill(pv.clone(), first, ctx.stream));
                }
                prefix = Some(first.to_string()).zip(Some(pv));
            }
        }
        if self.cfg.decode_after_kv_ready && !ready {
            kv_outcome(&mut wait).await?;
            ready = true;
        }
        let first = prefix.as_ref().map(|(f, _)| f.as_str());
        let dbody = Bytes::from(lmcache_decode_body(doc, ctx.api, first, &id));
        // The streamed first token: sent ahead of the decoder's stream.
        let first_sse = prefix
            .as_ref()
            .filter(|_| ctx.stream)
            .map(|(f, pv)| match ctx.api {
                Api::Completions => first_chunk(pv, f, None),
                Api::Chat => first_chat_chunk(pv, f),
            });
        tracing::debug!(target: TL, stage = "proxy.decode_sent", id = %id);
        // The KV sits on this decoder: no other one can take the request over. A task of its
        // own, so that the answer can start before the decoder's does (below); dropped, it
        // is aborted, which closes the decoder connection as dropping the call did.
        let mut decode = {
            let (app, owned) = (self.clone(), ctx.to_owned());
            AbortOnDrop(tokio::spawn(async move {
                app.decode(&owned.ctx(), dbody, dslot, false).await
            }))
        };
        let joined = |r: Result<Result<Reply, ApiError>, tokio::task::JoinError>| {
            r.unwrap_or_else(|e| {
                Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    Outcome::DecodeError,
                    format!("the decode task ended: {e}"),
                ))
            })
        };
        // Decode before `KvReady`: the request goes out now, while the KV's tail is still
        // landing (the decoder waits for its KV with its own deadline, and fails at once
        // when the transfer ends early). Its answer is passed on only once every rank
        // reported `KvReady`, so the client sees exactly what it saw before: a `KvFailed`
        // still becomes `kv_transfer_failed` (the decode is dropped, which closes its
        // connection), a missing outcome `kv_ready_timeout`.
        let mut reply = None;
        while reply.is_none() || !ready {
            if ready && self.cfg.first_token_on_kv_ready {
                if let Some(first) = first_sse.clone() {
                    // Every rank confirmed the KV and the first token is in hand: the
                    // client gets it now, not after the decoder's first step over that KV
                    // (its digest of the last chunk in the reference engine, a forward
                    // pass on a real one). The decoder's stream follows; its failure from
                    // here on is an SSE `error` event, as any failure mid-stream.
                    tracing::debug!(target: TL, stage = "proxy.first_token_sent", id = %id);
                    return Ok(Reply::Pending {
                        first,
                        decode: Box::pin(async move { joined((&mut decode.0).await) }),
                    });
                }
            }
            tokio::select! {
                r = &mut decode.0, if reply.is_none() => match joined(r) {
                    Ok(r) => reply = Some(r),
                    Err(e) if ready => return Err(e.into()),
                    Err(e) => {
                        // The decoder failing because its KV did (it learns of it from the
                        // PD layer at about the time the proxy does) is the KV's failure:
                        // give the outcome a moment to say so.
                        let grace = (tokio::time::Instant::now() + KV_OUTCOME_GRACE).min(kv_deadline);
                        return match tokio::time::timeout_at(grace, wait.outcome()).await {
                            Ok(Some(KvOutcome::Failed { rank, reason })) => Err(kv_failed(rank, reason).into()),
                            _ => Err(e.into()),
                        };
                    }
                },
                r = kv_outcome(&mut wait), if !ready => {
                    r?;
                    ready = true;
                }
            }
        }
        drop(wait);
        let reply = reply.ok_or_else(gone)?;
        tracing::debug!(target: TL, stage = "proxy.decode_answered", id = %id);
        match (reply, prefix) {
            (Reply::Full { content_type, body }, Some((first, _))) => Ok(Reply::Full {
                content_type,
                body: prepend_first(body, &first),
            }),
            (
                Reply::Stream {
                    content_type,
                    body,
                    slot,
                    decode_start,
                    ..
                },
                _,
            ) => Ok(Reply::Stream {
                content_type,
                body,
                prefix: first_sse,
                slot,
                decode_start,
            }),
            (r, _) => Ok(r),
        }
    }

    /// A prefiller was ejected: the KV waits bound to it fail now.
    fn prefiller_ejected(&self, idx: usize) {
        if let (Some(w), Some(p)) = (&self.waiters, self.prefill.workers.get(idx)) {
            w.prefiller_ejected(idx, p.ejections());
        }
    }

    /// The error of a request whose prefiller was lost while its KV waited there.
    fn prefiller_lost(&self, id: &str, prefiller: usize, how: Loss) -> ApiError {
        let label = self
            .prefill
            .workers
            .get(prefiller)
            .map_or("?", |w| w.label.as_str());
        let how = match how {
            Loss::Ejected => "it was ejected",
            Loss::OutcomeConnClosed => "its outcome connection closed",
        };
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "prefiller_lost",
            Outcome::PrefillerLost,
            format!(
                "KV of request {id}: prefiller {label} was lost ({how}) before every rank reported"
            ),
        )
    }

    /// Sends the prefill to the healthy prefiller the routing policy chooses; a refused connection ejects
    /// that prefiller and tries the next. Returns the prefiller's whole answer. `bind`: the
    /// KV wait learns which prefiller it depends on before the prefill is sent.
    async fn prefill(
        &self,
        ctx: &Ctx<'_>,
        body: Bytes,
        bind: Option<Binding>,
    ) -> Result<Bytes, ApiError> {
        let mut tried = Vec::new();
        loop {
            let slot = self
                .prefill
                .try_pick_for(ctx.tokens, &tried, ctx.prompt.as_ref())
                .map_err(|e| pick_error(Role::Prefill, e))?;
            let w = slot.worker();
            if let Some(b) = &bind {
                b.bind(slot.index(), slot.ejections_at_pick());
            }
            let t = Instant::now();
            let uri = self.uri(Role::Prefill, slot.index(), ctx.api);
            let r =
                tokio::time::timeout(self.cfg.prefill_timeout, self.call(uri, ctx, body.clone()))
                    .await;
            match r {
                Err(_) => {
                    return Err(ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "prefill_timeout",
                        Outcome::PrefillError,
                        format!(
                            "prefiller {} did not answer within {:?}",
                            w.label, self.cfg.prefill_timeout
                        ),
                    ))
                }
                Ok(Err(CallError::Connect(e))) => {
                    if let Some(b) = &bind {
                        b.unbind();
                    }
                    if self.prefill.report(slot.index(), false, true) {
                        self.prefiller_ejected(slot.index());
                    }
                    tracing::warn!(request_id = ctx.rid(), worker = %w.label, "prefiller unreachable: {e}");
                    tried.push(slot.index());
                }
                Ok(Err(CallError::Other(e))) => {
                    return Err(ApiError::new(
                        StatusCode::BAD_GATEWAY,
                        "prefill_failed",
                        Outcome::PrefillError,
                        format!("prefiller {}: {e}", w.label),
                    ))
                }
                Ok(Ok((status, ct, b))) => {
                    self.metrics.prefill.observe(t.elapsed());
                    if status.is_success() {
                        return Ok(b);
                    }
                    if status == StatusCode::SERVICE_UNAVAILABLE
                        && error_code(&b).as_deref() == Some(KV_RECEIVER_UNREACHABLE)
                    {
                        return Err(ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            KV_RECEIVER_UNREACHABLE,
                            Outcome::PrefillError,
                            format!("prefiller {}: {}", w.label, error_message(&b)),
                        ));
                    }
                    return Err(upstream_status(status, ct, b, &w.label, Role::Prefill));
                }
            }
        }
    }

    /// Sends the decode request to the admitted decoder and returns its answer or stream.
    /// With `retry`, a decoder that refuses the connection is ejected and the request goes to
    /// the least loaded other healthy decoder that admits it, each at most once, all within
    /// one `--decode-timeout` from the first attempt.
    async fn decode(
        &self,
        ctx: &Ctx<'_>,
        body: Bytes,
        mut slot: Slot,
        retry: bool,
    ) -> Result<Reply, ApiError> {
        let start = Instant::now();
        let deadline = tokio::time::Instant::now() + self.cfg.decode_timeout;
        let mut tried = Vec::new();
        loop {
            let failed = match self
                .decode_once(ctx, body.clone(), slot, start, deadline)
                .await
            {
                Ok(r) => return Ok(r),
                Err(DecodeFail::Api(e)) => return Err(e),
                Err(DecodeFail::Refused(s, e)) => {
                    tracing::warn!(request_id = ctx.rid(), worker = %s.worker().label, "decoder unreachable: {e}");
                    let err = self.decoder_down(s.index(), &s.worker().label, e);
                    tried.push(s.index());
                    drop(s);
                    err
                }
            };
            if !retry || tokio::time::Instant::now() >= deadline {
                return Err(failed);
            }
            slot = match self.decode.try_pick(ctx.tokens, &tried) {
                Ok(s) => s,
                Err(_) => return Err(failed),
            };
        }
    }

    /// One attempt of [`App::decode`] on `slot`'s decoder.
    async fn decode_once(
        &self,
        ctx: &Ctx<'_>,
        body: Bytes,
        slot: Slot,
        start: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Reply, DecodeFail> {
        let timeout = self.cfg.decode_timeout;
        let label = &slot.worker().label;
        let timed_out = || {
            DecodeFail::Api(ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "decode_timeout",
                Outcome::DecodeError,
                format!("decoder {label} did not answer within {timeout:?}"),
            ))
        };
        let failed = |e: String| {
            DecodeFail::Api(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "decode_failed",
                Outcome::DecodeError,
                format!("decoder {label}: {e}"),
            ))
        };
        let uri = self.uri(Role::Decode, slot.index(), ctx.api);
        if !ctx.stream {
            return match tokio::time::timeout_at(deadline, self.call(uri, ctx, body)).await {
                Err(_) => Err(timed_out()),
                Ok(Err(CallError::Connect(e))) => Err(DecodeFail::Refused(slot, e)),
                Ok(Err(CallError::Other(e))) => Err(failed(e)),
                Ok(Ok((status, ct, b))) => {
                    self.metrics.decode.observe(start.elapsed());
                    if status.is_success() {
                        Ok(Reply::Full {
                            content_type: ct
                                .unwrap_or(HeaderValue::from_static("application/json")),
                            body: b,
                        })
                    } else {
                        Err(DecodeFail::Api(upstream_status(
                            status,
                            ct,
                            b,
                            label,
                            Role::Decode,
                        )))
                    }
                }
            };
        }
        let req = self.request(uri, ctx, body);
        let awaiting = self.awaiting_backend();
        let resp = match tokio::time::timeout_at(deadline, self.client.request(req)).await {
            Err(_) => return Err(timed_out()),
            Ok(Err(e)) if e.is_connect() => {
                let e = format!("{e}: {}", source_chain(&e));
                return Err(DecodeFail::Refused(slot, e));
            }
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Ok(Ok(r)) => r,
        };
        drop(awaiting);
        let (parts, body) = resp.into_parts();
        let ct = parts.headers.get(CONTENT_TYPE).cloned();
        if !parts.status.is_success() {
            let b = match tokio::time::timeout_at(
                deadline,
                Limited::new(body, MAX_UPSTREAM_BODY).collect(),
            )
            .await
            {
                Ok(Ok(c)) => c.to_bytes(),
                _ => Bytes::new(),
            };
            return Err(DecodeFail::Api(upstream_status(
                parts.status,
                ct,
                b,
                label,
                Role::Decode,
            )));
        }
        Ok(Reply::Stream {
            content_type: ct.unwrap_or(HeaderValue::from_static("text/event-stream")),
            body,
            prefix: None,
            slot,
            decode_start: start,
        })
    }

    /// Ejects decoder `index` at once (passively) and returns the error to give if no other
    /// decoder takes the request.
    fn decoder_down(&self, index: usize, label: &str, e: String) -> ApiError {
        self.decode.report(index, false, true);
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "decoder_unavailable",
            Outcome::NoWorker,
            format!("decoder {label} is unreachable: {e}"),
        )
    }

    /// Marks a backend call in flight, so that the runtime polls for its answer if it belongs
    /// to the only request being served (see [`crate::busy_poll`]).
    fn awaiting_backend(&self) -> Option<Awaiting> {
        let bp = self.busy_poll.as_ref()?;
        Some(bp.awaiting(self.metrics.in_flight.load(Relaxed)))
    }

    fn request(&self, uri: Uri, ctx: &Ctx<'_>, body: Bytes) -> Request<Full<Bytes>> {
        let mut r = Request::new(Full::new(body));
        *r.method_mut() = Method::POST;
        *r.uri_mut() = uri;
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(X_REQUEST_ID, ctx.rid.clone());
        if let Some(a) = ctx.auth {
            h.insert(AUTHORIZATION, a.clone());
        }
        r
    }

    /// POSTs `body` and reads the whole answer (the caller bounds it with a deadline).
    async fn call(
        &self,
        uri: Uri,
        ctx: &Ctx<'_>,
        body: Bytes,
    ) -> Result<(StatusCode, Option<HeaderValue>, Bytes), CallError> {
        let req = self.request(uri, ctx, body);
        let _awaiting = self.awaiting_backend();
        let resp = self.client.request(req).await.map_err(|e| {
            if e.is_connect() {
                CallError::Connect(format!("{e}: {}", source_chain(&e)))
            } else {
                CallError::Other(format!("{e}: {}", source_chain(&e)))
            }
        })?;
        let (parts, body) = resp.into_parts();
        let b = Limited::new(body, MAX_UPSTREAM_BODY)
            .collect()
            .await
            .map_err(|e| CallError::Other(format!("reading the answer: {e}")))?
            .to_bytes();
        Ok((parts.status, parts.headers.get(CONTENT_TYPE).cloned(), b))
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = String::new();
    let mut cur = e.source();
    while let Some(c) = cur {
        if !s.is_empty() {
            s.push_str(": ");
        }
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A worker answered with an error status: 4xx is passed on as it was (the request's
/// fault), anything else becomes a 502 carrying the worker's error.
fn upstream_status(
    status: StatusCode,
    ct: Option<HeaderValue>,
    b: Bytes,
    label: &str,
    role: Role,
) -> ApiError {
    let outcome = if role == Role::Prefill {
        Outcome::PrefillError
    } else {
        Outcome::DecodeError
    };
    if status.is_client_error() {
        let e = ApiError::new(status, "rejected", Outcome::Rejected, excerpt(&b));
        return e.with_raw(b, ct);
    }
    let code = if role == Role::Prefill {
        "prefill_failed"
    } else {
        "decode_failed"
    };
    let detail = error_message(&b);
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        code,
        outcome,
        format!(
            "{} {label} answered {status}: {detail}",
            role.as_str()
                .replace("prefill", "prefiller")
                .replace("decode", "decoder")
        ),
    )
}

/// A worker's error body's message (OpenAI's `error.message`, or a bare `message` or
/// `detail`), else an excerpt of the body.
fn error_message(b: &[u8]) -> String {
    serde_json::from_slice::<Value>(b)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("message"))
                .or_else(|| v.get("detail"))
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| excerpt(b))
}

/// A worker's error body's `error.code`, if any.
fn error_code(b: &[u8]) -> Option<String> {
    let v = serde_json::from_slice::<Value>(b).ok()?;
    v.pointer("/error/code")?.as_str().map(str::to_string)
}

/// Request facts every step needs.
struct Ctx<'a> {
    api: Api,
    rid: &'a HeaderValue,
    auth: Option<&'a HeaderValue>,
    tokens: u64,
    stream: bool,
    #[allow(dead_code)]
    t0: Instant,
    /// What the routing policy matches (none under `least-loaded`).
    prompt: Option<crate::router::PromptKey>,
}

impl Ctx<'_> {
    fn rid(&self) -> &str {
        self.rid.to_str().unwrap_or("?")
    }

    fn to_owned(&self) -> OwnedCtx {
        OwnedCtx {
            api: self.api,
            rid: self.rid.clone(),
            auth: self.auth.cloned(),
            tokens: self.tokens,
            stream: self.stream,
            t0: self.t0,
        }
    }
}

/// A [`Ctx`] that owns its headers, for a step that runs as a task of its own.
struct OwnedCtx {
    api: Api,
    rid: HeaderValue,
    auth: Option<HeaderValue>,
    tokens: u64,
    stream: bool,
    t0: Instant,
}

impl OwnedCtx {
    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            api: self.api,
            rid: &self.rid,
            auth: self.auth.as_ref(),
            tokens: self.tokens,
            stream: self.stream,
            t0: self.t0,
            // Only decodes run from an owned context, on a decoder already chosen.
            prompt: None,
        }
    }
}

/// A task that is aborted when this handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The SSE chunk that carries the prefill's first token.
fn first_chunk(pv: &Value, first: &str, finish: Option<&str>) -> Bytes {
    let v = json!({"id": pv.get("id"), "object": "text_completion", "created": pv.get("created"),
        "model": pv.get("model"), "choices": [{"index": 0, "text": first, "logprobs": null, "finish_reason": finish}]});
    Bytes::from(format!("data: {v}\n\n"))
}

/// The chat SSE chunk that carries the prefill's first token (with the reply's role).
fn first_chat_chunk(pv: &Value, first: &str) -> Bytes {
    let v = json!({"id": pv.get("id"), "object": "chat.completion.chunk", "created": pv.get("created"),
        "model": pv.get("model"), "choices": [{"index": 0, "delta": {"role": "assistant", "content": first},
        "logprobs": null, "finish_reason": null}]});
    Bytes::from(format!("data: {v}\n\n"))
}

/// `max_tokens == 1`: the prefill's answer is the whole answer.
fn answer_from_prefill(mut pv: Value, first: &str, stream: bool) -> Reply {
    if stream {
        let mut b = first_chunk(&pv, first, Some("length")).to_vec();
        b.extend_from_slice(b"data: [DONE]\n\n");
        return Reply::Full {
            content_type: HeaderValue::from_static("text/event-stream"),
            body: Bytes::from(b),
        };
    }
    if let Some(m) = pv.as_object_mut() {
        m.remove("kv_transfer_params");
    }
    Reply::Full {
        content_type: HeaderValue::from_static("application/json"),
        body: Bytes::from(pv.to_string()),
    }
}

/// Puts the prefill's first token in front of a non-streamed completion or chat reply.
fn prepend_first(body: Bytes, first: &str) -> Bytes {
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    for at in ["/choices/0/text", "/choices/0/message/content"] {
        if let Some(t) = v.pointer_mut(at) {
            if let Some(s) = t.as_str() {
                *t = Value::String(format!("{first}{s}"));
            }
        }
    }
    if let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) {
        if let Some(c) = u.get("completion_tokens").and_then(Value::as_u64) {
            u.insert("completion_tokens".into(), json!(c + 1));
        }
        if let Some(p) = u.get("prompt_tokens").and_then(Value::as_u64) {
            u.insert("prompt_tokens".into(), json!(p.saturating_sub(1)));
        }
    }
    Bytes::from(v.to_string())
}
