//! A decoder the prefiller cannot reach (its KV ports refuse connections while its HTTP
//! endpoint still answers health checks) costs no request: the prefiller answers
//! `kv_receiver_unreachable` before any KV moves, and the proxy ejects that decoder and
//! starts the request over on another one. Real engines and a real proxy, in process.

// Its engines run in process: the process helpers go unused here.
#[allow(dead_code)]
mod proxied;

use kvbridge_proxy::config::Config as ProxyConfig;
use kvbridge_sim::client::Client;
use kvbridge_sim::cost::CostModel;
use kvbridge_sim::engine::{self, EngineConfig, Role, RunningEngine};
use kvbridge_sim::model::{self, Model};
use proxied::{decoder_at, decoder_of, prefiller_at, prefiller_for, small_model};
use serde_json::json;
use std::time::Duration;
use tokio::net::TcpListener;

const DEADLINE: Duration = Duration::from_secs(15);

fn model() -> Model {
    small_model("sim-retry")
}

async fn engine(c: EngineConfig) -> RunningEngine {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    engine::start(c, l).await.expect("engine starts")
}

/// A port nothing listens on (bound, then closed).
async fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    l.local_addr().expect("addr").port()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decoder_the_prefiller_cannot_reach_is_ejected_and_the_request_goes_to_another() {
    let m = model();
    let mk = |role| {
        let mut c = EngineConfig::new(role, m.clone());
        c.cost = CostModel::FREE;
        c.buffer_bytes = 16 << 20;
        c
    };
    let good = engine(mk(Role::Decode)).await;
    // Its HTTP answers (health checks pass), but its KV endpoints are gone.
    let cut = engine(mk(Role::Decode)).await;
    let colocated = engine(mk(Role::Both)).await;
    let pl = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let proxy = kvbridge_proxy::server::start(ProxyConfig {
        port: 0,
        proxy_port: 0,
        prefillers: vec![prefiller_at(pl.local_addr().expect("addr").port())],
        decoders: vec![
            decoder_at(
                cut.http_addr().port(),
                vec![closed_port().await],
                vec![closed_port().await],
            ),
            decoder_of(&good),
        ],
        kv_ready_timeout: Duration::from_secs(5),
        prefill_timeout: Duration::from_secs(10),
        decode_timeout: Duration::from_secs(10),
        // Health checks run all through the test (every 50 ms) but never eject by
        // themselves here, so the first request meets the cut decoder: it is ejected
        // passively, by that request. A check that then re-admitted it (its HTTP answers;
        // only its KV ports show it is cut) would send it a later request, a second retry.
        health_interval: Duration::from_millis(50),
        unhealthy_after: 1_000,
        ..ProxyConfig::default()
    })
    .await
    .expect("proxy");
    let _prefiller = prefiller_for(mk(Role::Prefill), pl, &proxy).await;
    let client = Client::new();
    let url = format!("http://{}/v1/completions", proxy.http_addr());
    let col_url = format!("http://{}/v1/completions", colocated.http_addr());
    // Ties spread round-robin: the cut decoder is picked within the first two requests.
    for i in 0..6u64 {
        let body = json!({"prompt": model::random_prompt(300 + i, 100), "max_tokens": 5, "stream": i % 2 == 1});
        let got = client
            .generate(&url, &body, DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
        let want = client
            .generate(&col_url, &body, DEADLINE)
            .await
            .expect("colocated");
        assert_eq!(got.text, want.text, "request {i}");
        if i == 1 {
            // The cut decoder has been met and ejected by now. An observation window, not
            // a wait for readiness: about six health checks run in it, and one that
            // re-admitted the decoder would hand it one of the next four requests.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    let health = client
        .get_json(&format!("http://{}/health", proxy.http_addr()), DEADLINE)
        .await
        .expect("proxy health");
    assert_eq!(health["decoders_healthy"], 1, "{health}");
    let metrics = client
        .get_text(&format!("http://{}/metrics", proxy.http_addr()), DEADLINE)
        .await
        .expect("proxy metrics");
    let retries = metrics
        .lines()
        .find_map(|l| l.strip_prefix("kvbridge_proxy_decoder_retries_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    // Exactly once: no health check re-admitted the cut decoder after its ejection.
    assert_eq!(retries, Some(1.0), "{metrics}");
    assert_eq!(cut.stats().requests, 0, "nothing reached the cut decoder");
    assert_eq!(good.stats().kv_requests_received, 6);
    good.quiesce(DEADLINE).await.expect("verifications settle");
    let st = good.stats();
    assert_eq!((st.kv_mismatches, st.pages_leaked), (0, 0), "{st:?}");
}
