//! A prefiller or decoder process killed during a run: its in-flight requests get clear
//! errors within their deadlines, later requests succeed on the other worker, and the
//! surviving decoders' pages all come back (none leaked).

mod proxied;

use kvbridge_proxy::config::Config as ProxyConfig;
use kvbridge_sim::client::{Client, ClientError};
use kvbridge_sim::cost::CostModel;
use kvbridge_sim::engine::{self, EngineConfig, Role};
use kvbridge_sim::model::{self, Model};
use proxied::{
    answers_equal_colocated, decoder_at, decoder_of, engine_process, http_port as port, ports,
    prefiller_at, prefiller_for, small_model, wait_ejected,
};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::process::Child;

const DEADLINE: Duration = Duration::from_secs(15);

fn model() -> Model {
    small_model("sim-kill")
}

const PREFILL_TOKENS_PER_S: f64 = 4000.0;

/// Starts a prefiller process; returns it and its HTTP port (it waits for the proxy's
/// endpoint on stdin).
async fn prefiller() -> (Child, u16) {
    let (c, v) = worker(&["--role", "prefill", "--proxy-endpoint-from-stdin"], 1).await;
    (c, port(&v))
}

/// Starts an engine process with the test model and `extra` flags; returns it and its
/// address line.
async fn worker(extra: &[&str], decode_ms: u64) -> (Child, Value) {
    engine_process("sim-kill", decode_ms, PREFILL_TOKENS_PER_S, extra, DEADLINE).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_prefiller_fails_its_requests_cleanly_and_leaks_no_page() {
    let m = model();
    let mut cost = CostModel::FREE;
    cost.prefill_tokens_per_s = PREFILL_TOKENS_PER_S;
    cost.decode_per_token = Duration::from_millis(1);
    let mk = |role| {
        let mut c = EngineConfig::new(role, m.clone());
        c.cost = cost;
        c.buffer_bytes = 64 << 20;
        c
    };
    let dec = engine::start(
        mk(Role::Decode),
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind"),
    )
    .await
    .expect("decoder");
    let colocated = engine::start(
        mk(Role::Both),
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind"),
    )
    .await
    .expect("colocated");
    let (mut a, pa) = prefiller().await;
    let (mut b, pb) = prefiller().await;
    let proxy = kvbridge_proxy::server::start(ProxyConfig {
        port: 0,
        proxy_port: 0,
        prefillers: vec![prefiller_at(pa), prefiller_at(pb)],
        decoders: vec![decoder_of(&dec)],
        kv_ready_timeout: Duration::from_secs(3),
        prefill_timeout: Duration::from_secs(10),
        decode_timeout: Duration::from_secs(10),
        ..ProxyConfig::default()
    })
    .await
    .expect("proxy");
    let ep = format!("tcp://{}\n", proxy.notify_addr().expect("lmcache flow"));
    for c in [&mut a, &mut b] {
        let mut stdin = c.stdin.take().expect("stdin piped");
        stdin.write_all(ep.as_bytes()).await.expect("endpoint sent");
    }
    let client = Client::new();
    let url = format!("http://{}/v1/completions", proxy.http_addr());
    let body = |i: u64| json!({"prompt": model::random_prompt(500 + i, 400), "max_tokens": 4, "stream": i.is_multiple_of(2)});
    // 8 requests of 400 tokens (100 ms of prefill each) spread over both prefillers.
    let batch: Vec<_> = (0..8u64)
        .map(|i| {
            let (client, url, body) = (client.clone(), url.clone(), body(i));
            tokio::spawn(async move {
                let t = Instant::now();
                (i, client.generate(&url, &body, DEADLINE).await, t.elapsed())
            })
        })
        .collect();
    // Kill prefiller A once it is working on a request (a condition with a deadline).
    let health = format!("http://127.0.0.1:{pa}/health");
    let until = Instant::now() + DEADLINE;
    loop {
        let v = client
            .get_json(&health, DEADLINE)
            .await
            .expect("A is healthy");
        if v["stats"]["requests"].as_u64().unwrap_or(0) >= 1 {
            break;
        }
        assert!(Instant::now() < until, "prefiller A got no request");
        tokio::task::yield_now().await;
    }
    a.start_kill().expect("kill A");
    let _ = a.wait().await;
    let col_url = format!("http://{}/v1/completions", colocated.http_addr());
    let (mut ok, mut failed) = (0, 0);
    for h in batch {
        let (i, r, took) = h.await.expect("request task");
        assert!(took < DEADLINE, "request {i} took {took:?}");
        match r {
            Ok(ans) => {
                let want = client
                    .generate(&col_url, &body(i), DEADLINE)
                    .await
                    .expect("colocated");
                assert_eq!(ans.text, want.text, "request {i}");
                ok += 1;
            }
            Err(ClientError::Status { status, body, .. }) => {
                assert!(matches!(status, 502..=504), "request {i}: {status} {body}");
                assert!(
                    [
                        "prefill_failed",
                        "kv_transfer_failed",
                        "kv_ready_timeout",
                        "no_healthy_worker"
                    ]
                    .iter()
                    .any(|c| body.contains(c)),
                    "request {i}: unclear error {body}"
                );
                failed += 1;
            }
            Err(e) => panic!("request {i}: {e}"),
        }
    }
    assert!(failed >= 1, "A was killed with work in flight ({ok} ok)");
    // Later requests succeed on B (A's refused connection ejects it).
    for i in 100..104u64 {
        let ans = client
            .generate(&url, &body(i), DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("after the kill, request {i}: {e}"));
        let want = client
            .generate(&col_url, &body(i), DEADLINE)
            .await
            .expect("colocated");
        assert_eq!(ans.text, want.text, "request {i}");
    }
    // Every page comes back: the killed sender's session ended, so its requests were released.
    dec.quiesce(DEADLINE).await.expect("verifications settle");
    let until = Instant::now() + DEADLINE;
    loop {
        let st = dec.stats();
        assert_eq!(st.pages_leaked, 0, "{st:?}");
        assert_eq!(st.kv_mismatches, 0, "{st:?}");
        if st.pages_free == st.pages_total {
            break;
        }
        assert!(Instant::now() < until, "pages not returned: {st:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = b.start_kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_decoder_fails_its_streams_cleanly_and_the_rest_succeed() {
    let m = model();
    let mut cost = CostModel::FREE;
    cost.decode_per_token = Duration::from_millis(20);
    let mk = |role| {
        let mut c = EngineConfig::new(role, m.clone());
        c.cost = cost;
        c.buffer_bytes = 64 << 20;
        c
    };
    let (mut a, va) = worker(&["--role", "decode"], 20).await;
    let (_b, vb) = worker(&["--role", "decode"], 20).await;
    let colocated = engine::start(
        mk(Role::Both),
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind"),
    )
    .await
    .expect("colocated");
    let pl = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let decoder = |v: &Value| decoder_at(port(v), ports(v, "init_ports"), ports(v, "alloc_ports"));
    let proxy = kvbridge_proxy::server::start(ProxyConfig {
        port: 0,
        proxy_port: 0,
        prefillers: vec![prefiller_at(pl.local_addr().expect("addr").port())],
        decoders: vec![decoder(&va), decoder(&vb)],
        kv_ready_timeout: Duration::from_secs(3),
        prefill_timeout: Duration::from_secs(10),
        decode_timeout: Duration::from_secs(5),
        health_interval: Duration::from_millis(100),
        unhealthy_after: 1,
        ..ProxyConfig::default()
    })
    .await
    .expect("proxy");
    let _prefiller = prefiller_for(mk(Role::Prefill), pl, &proxy).await;
    let client = Client::new();
    let url = format!("http://{}/v1/completions", proxy.http_addr());
    let col_url = format!("http://{}/v1/completions", colocated.http_addr());
    // Streamed and non-streamed requests, in pairs: s s n n s s ... 50 tokens at 20 ms:
    // each lasts ~1 s, so the requests A holds are all mid-decode when it is killed.
    let body = |i: u64| json!({"prompt": model::random_prompt(900 + i, 100), "max_tokens": 50, "stream": i & 2 == 0});
    let ha = format!("http://127.0.0.1:{}/health", port(&va));
    let hb = format!("http://127.0.0.1:{}/health", port(&vb));
    let requests_at = |h: String| {
        let client = client.clone();
        async move {
            let v = client.get_json(&h, DEADLINE).await.expect("decoder health");
            v["stats"]["requests"].as_u64().expect("requests")
        }
    };
    // One request at a time, each sent once the previous one reached its decoder (so we
    // know which), until A holds a streamed and a non-streamed one.
    let mut batch = Vec::new();
    let mut on_a = Vec::new();
    let (mut seen_a, mut seen_b) = (requests_at(ha.clone()).await, requests_at(hb.clone()).await);
    for i in 0..8u64 {
        let (client, url, b) = (client.clone(), url.clone(), body(i));
        batch.push(tokio::spawn(async move {
            let t = Instant::now();
            (i, client.generate(&url, &b, DEADLINE).await, t.elapsed())
        }));
        let until = Instant::now() + DEADLINE;
        loop {
            let (a_now, b_now) = (requests_at(ha.clone()).await, requests_at(hb.clone()).await);
            if a_now > seen_a {
                on_a.push(i);
                (seen_a, seen_b) = (a_now, b_now);
                break;
            }
            if b_now > seen_b {
                (seen_a, seen_b) = (a_now, b_now);
                break;
            }
            assert!(Instant::now() < until, "request {i} reached no decoder");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let streamed = |i: &u64| body(*i)["stream"] == true;
        if on_a.iter().any(streamed) && !on_a.iter().all(streamed) {
            break;
        }
    }
    let streamed = |i: u64| body(i)["stream"] == true;
    assert!(
        on_a.iter().any(|&i| streamed(i)) && !on_a.iter().all(|&i| streamed(i)),
        "A got no mix of streamed and non-streamed requests: {on_a:?}"
    );
    a.start_kill().expect("kill A");
    let _ = a.wait().await;
    let (mut ok, mut failed) = (0, 0);
    for h in batch {
        let (i, r, took) = h.await.expect("request task");
        assert!(took < DEADLINE, "request {i} took {took:?}");
        match r {
            Ok(ans) => {
                assert!(!on_a.contains(&i), "request {i} on the killed A succeeded");
                let want = client
                    .generate(&col_url, &body(i), DEADLINE)
                    .await
                    .expect("colocated");
                assert_eq!(ans.text, want.text, "request {i}");
                ok += 1;
            }
            Err(ClientError::Answer { detail, .. }) => {
                // A stream that broke: an SSE `error` event, mid-stream or (a completion
                // whose first token went out on `KvReady`) before the decoder answered.
                assert!(streamed(i), "request {i} is not streamed: {detail}");
                assert!(
                    ["decoder_stream_failed", "decode_failed", "decode_timeout"]
                        .iter()
                        .any(|c| detail.contains(c)),
                    "request {i}: {detail}"
                );
                failed += 1;
            }
            Err(ClientError::Status { status, body, .. }) if !streamed(i) => {
                // Non-streamed: a 502 naming the decode failure.
                assert_eq!(status, 502, "request {i}: {body}");
                assert!(body.contains("decode_failed"), "request {i}: {body}");
                failed += 1;
            }
            Err(e) => panic!("request {i}: {e}"),
        }
    }
    assert_eq!(failed, on_a.len(), "every request A held failed ({ok} ok)");
    // Once the proxy has ejected A (a condition with a deadline), requests succeed on B.
    let metrics = format!("http://{}/metrics", proxy.http_addr());
    wait_ejected(
        &client,
        &metrics,
        &[format!("127.0.0.1:{}", port(&va))],
        DEADLINE,
    )
    .await;
    answers_equal_colocated(
        &client,
        &url,
        &col_url,
        (100..104u64).map(body),
        DEADLINE,
        "after the kill",
    )
    .await;
    // B returned every page and saw no mismatch.
    let hb = format!("http://127.0.0.1:{}/health", port(&vb));
    let until = Instant::now() + DEADLINE;
    loop {
        let v = client.get_json(&hb, DEADLINE).await.expect("B is healthy");
        let st = &v["stats"];
        assert_eq!(st["pages_leaked"], 0, "{st}");
        assert_eq!(st["kv_mismatches"], 0, "{st}");
        if st["pages_free"] == st["pages_total"] && st["in_flight"] == 0 {
            break;
        }
        assert!(Instant::now() < until, "B's pages not returned: {st}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
