//! Target `proxy_http`: arbitrary requests to the disaggregation proxy's OpenAI routes,
//! end to end through its real HTTP stack (`kvbridge_proxy::server::start` on loopback, in-process, one
//! thread): body limit, JSON parsing and the field checks of `/v1/completions` and
//! `/v1/chat/completions`, the request id header, the error answers.
//!
//! The proxy runs with one prefiller and one decoder that refuse connections, so a request
//! that passes parsing is answered `503 no_healthy_worker` without leaving the machine.
//!
//! Input: byte 0 picks the route (bits 0-1) and whether an `x-request-id` follows (bit 2,
//! then byte 1 is its length); the rest is the body. Checked: nothing panics; every answer is
//! an OpenAI-shaped JSON error carrying the request id; the status is what the documented
//! rules (`docs/proxy.md`, `server.rs`) give for that body: 413 over the body limit, 400 for
//! a body that is not a JSON object or breaks a field rule, 503 otherwise, 404 elsewhere.
//!
//! Same input format and seeds as `proxy_request`, which checks the parsing alone (and runs
//! far faster); this one keeps the body limit, the request id and the answer's shape covered.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use kvbridge_proxy::config::{Config, DecoderConfig, Flow, WorkerAddr};
use kvbridge_proxy::server::{start, RunningProxy};
use serde_json::Value;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The proxy's body limit in the harness (small, so that both sides of it are reached).
const MAX_BODY: usize = 2048;

struct Harness {
    rt: tokio::runtime::Runtime,
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    _proxy: RunningProxy,
}

fn harness() -> &'static Mutex<Harness> {
    static H: OnceLock<Mutex<Harness>> = OnceLock::new();
    H.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        // A port nothing listens on: bind, note it, close.
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let cfg = Config {
            port: 0,
            prefillers: vec![WorkerAddr {
                host: "127.0.0.1".into(),
                port: dead,
            }],
            decoders: vec![DecoderConfig {
                host: "127.0.0.1".into(),
                port: dead,
                init_ports: vec![],
                alloc_ports: vec![],
                max_requests: 0,
                kv_capacity_tokens: 0,
            }],
            flow: Flow::Vllm,
            health_interval: Duration::ZERO,
            connect_timeout: Duration::from_secs(1),
            prefill_timeout: Duration::from_secs(5),
            decode_timeout: Duration::from_secs(5),
            queue_timeout: Duration::from_millis(100),
            max_body_bytes: MAX_BODY,
            ..Config::default()
        };
        let proxy = rt.block_on(start(cfg)).expect("the proxy starts");
        let base = format!("http://{}", proxy.http_addr());
        let client = Client::builder(TokioExecutor::new()).build_http();
        Mutex::new(Harness {
            rt,
            client,
            base,
            _proxy: proxy,
        })
    })
}

/// What the documented rules give for `body` on a route: `Ok(())` when it passes parsing.
fn model(chat: bool, body: &[u8]) -> Result<(), StatusCode> {
    if body.len() > MAX_BODY {
        return Err(StatusCode::PAYLOAD_TOO_LARGE);
    }
    crate::proxy_request::model(chat, body)
        .map(|_| ())
        .map_err(|_| StatusCode::BAD_REQUEST)
}

/// The target's body.
pub fn run(data: &[u8]) {
    let [sel, rest @ ..] = data else {
        return;
    };
    let (rid, body) = if sel & 4 != 0 {
        let Some((&n, rest)) = rest.split_first() else {
            return;
        };
        let n = usize::from(n).min(rest.len());
        (Some(&rest[..n]), &rest[n..])
    } else {
        (None, rest)
    };
    let (path, route) = match sel & 3 {
        0 => ("/v1/completions", Some(false)),
        1 => ("/v1/chat/completions", Some(true)),
        2 => ("/v1/embeddings", None),
        _ => ("/v1/completions/extra", None),
    };
    let h = harness().lock().unwrap_or_else(|e| e.into_inner());
    let mut req = Request::builder()
        .method(Method::POST)
        .uri(format!("{}{path}", h.base))
        .header("content-type", "application/json");
    // A request id the client cannot even send is not a case for the proxy.
    let sent_rid = rid.and_then(|r| hyper::header::HeaderValue::from_bytes(r).ok());
    if let Some(v) = &sent_rid {
        req = req.header("x-request-id", v.clone());
    }
    let req = req
        .body(Full::new(Bytes::copy_from_slice(body)))
        .expect("a request builds");
    let (status, headers, answer) = h.rt.block_on(async {
        let resp = tokio::time::timeout(Duration::from_secs(10), h.client.request(req))
            .await
            .expect("the proxy answers within 10 s")
            .expect("the proxy answers");
        let (parts, b) = resp.into_parts();
        let b = b.collect().await.expect("the answer reads").to_bytes();
        (parts.status, parts.headers, b)
    });
    drop(h);

    let want = match route {
        None => Err(StatusCode::NOT_FOUND),
        Some(chat) => model(chat, body),
    };
    let want_status = want.err().unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    // A body beyond the model (see `proxy_request::beyond_the_model`): no status to expect.
    if !(route.is_some() && crate::proxy_request::beyond_the_model(body)) {
        assert_eq!(
            status,
            want_status,
            "{path} body {:?}: answer {:?}",
            String::from_utf8_lossy(body),
            String::from_utf8_lossy(&answer)
        );
    }
    let v: Value = serde_json::from_slice(&answer).expect("errors are JSON");
    let msg = v.pointer("/error/message").and_then(Value::as_str);
    assert!(msg.is_some_and(|m| !m.is_empty()), "no error message: {v}");
    assert!(v.pointer("/error/code").is_some_and(Value::is_string));
    if route.is_some() {
        if status == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(v.pointer("/error/code"), Some(&"no_healthy_worker".into()));
        }
        let got = headers.get("x-request-id").expect("a request id answers");
        // HTTP drops the whitespace around a field value: the proxy sees it trimmed.
        let sent = sent_rid.as_ref().map(|s| s.as_bytes().trim_ascii());
        match sent {
            // `HeaderValue::to_str`: visible ASCII and tabs only.
            Some(s)
                if !s.is_empty()
                    && s.len() <= 256
                    && s.iter().all(|&b| b == b'\t' || (0x20..0x7f).contains(&b)) =>
            {
                assert_eq!(got.as_bytes(), s, "the client's request id was not echoed")
            }
            _ => assert!(got.to_str().is_ok_and(|g| g.starts_with("kvb"))),
        }
    }
}
