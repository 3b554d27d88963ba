//! A prefiller and a decoder process killed mid-load under each routing policy: every
//! request ends, within its deadline, with the colocated engine's answer or a clear error;
//! once the proxy has ejected them, requests for the prefixes they held succeed on the
//! others. Cache-aware policies prefer the worker that holds a prompt's prefix, so the dead
//! workers are the ones the policy wants most.

// Shared with the other proxied tests; this one starts its engines as processes.
#[allow(dead_code)]
mod proxied;

use kvbridge_proxy::config::{Config as ProxyConfig, KvEventsConfig};
use kvbridge_proxy::routing::RoutingPolicy;
use kvbridge_sim::client::{Client, ClientError};
use kvbridge_sim::cost::CostModel;
use kvbridge_sim::engine::{self, EngineConfig, Role};
use proxied::{
    answers_equal_colocated, decoder_at, engine_process, http_port as port, ports, prefiller_at,
    small_model, wait_ejected,
};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::process::Child;

const DEADLINE: Duration = Duration::from_secs(15);
const PREFILL_TOKENS_PER_S: f64 = 8000.0;
const DECODE_MS: u64 = 10;

/// An engine process of the test model with `extra` flags, publishing its KV events when
/// `events`; returns it and its address line.
async fn worker(extra: &[&str], events: bool) -> (Child, Value) {
    let mut flags = extra.to_vec();
    if events {
        flags.extend(["--kv-events-endpoint", "tcp://127.0.0.1:0"]);
    }
    engine_process(
        "sim-kill-routed",
        DECODE_MS,
        PREFILL_TOKENS_PER_S,
        &flags,
        DEADLINE,
    )
    .await
}

fn events_endpoint(v: &Value) -> String {
    format!(
        "tcp://{}",
        v["kv_events"].as_str().expect("kv_events address")
    )
}

/// Request `i`: one of 4 shared prefixes of 768 tokens (ids), then 64 tokens of its own;
/// streamed or not in pairs. The first request of a prefix is prefilled the PD way under
/// every policy (its 832 uncached tokens are over the decider's 512); later ones may go to a
/// decoder alone.
fn body(i: u64) -> Value {
    let p = i % 4;
    let prompt: Vec<u32> = (0..768u32)
        .map(|k| (p as u32 * 997 + k * 13) % 4000)
        .chain((0..64u32).map(|k| (i as u32 * 31 + k * 7) % 4000))
        .collect();
    json!({"prompt": prompt, "max_tokens": 60, "stream": i & 2 == 0})
}

/// Whether the proxy's `/metrics` shows `label` ejected.
async fn kill_mid_load(policy: RoutingPolicy) {
    let events = policy == RoutingPolicy::KvEvents;
    let m = small_model("sim-kill-routed");
    let mut cost = CostModel::FREE;
    cost.prefill_tokens_per_s = PREFILL_TOKENS_PER_S;
    cost.decode_per_token = Duration::from_millis(DECODE_MS);
    let mut c = EngineConfig::new(Role::Both, m);
    c.cost = cost;
    let colocated = engine::start(
        c,
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind"),
    )
    .await
    .expect("colocated");
    let (mut pa, vpa) = worker(
        &["--role", "prefill", "--proxy-endpoint-from-stdin"],
        events,
    )
    .await;
    let (mut pb, vpb) = worker(
        &["--role", "prefill", "--proxy-endpoint-from-stdin"],
        events,
    )
    .await;
    let (mut da, vda) = worker(&["--role", "decode"], events).await;
    let (_db, vdb) = worker(&["--role", "decode"], events).await;
    let decoder = |v: &Value| decoder_at(port(v), ports(v, "init_ports"), ports(v, "alloc_ports"));
    let kv_events = if events {
        KvEventsConfig {
            prefiller_endpoints: vec![events_endpoint(&vpa), events_endpoint(&vpb)],
            decoder_endpoints: vec![events_endpoint(&vda), events_endpoint(&vdb)],
            ..KvEventsConfig::default()
        }
    } else {
        KvEventsConfig::default()
    };
    let proxy = kvbridge_proxy::server::start(ProxyConfig {
        port: 0,
        proxy_port: 0,
        prefillers: vec![prefiller_at(port(&vpa)), prefiller_at(port(&vpb))],
        decoders: vec![decoder(&vda), decoder(&vdb)],
        routing: policy,
        kv_events,
        kv_ready_timeout: Duration::from_secs(3),
        prefill_timeout: Duration::from_secs(10),
        decode_timeout: Duration::from_secs(5),
        health_interval: Duration::from_millis(100),
        unhealthy_after: 1,
        ..ProxyConfig::default()
    })
    .await
    .expect("proxy");
    let ep = format!("tcp://{}\n", proxy.notify_addr().expect("lmcache flow"));
    for c in [&mut pa, &mut pb] {
        let mut stdin = c.stdin.take().expect("stdin piped");
        stdin.write_all(ep.as_bytes()).await.expect("endpoint sent");
    }
    let client = Client::new();
    let url = format!("http://{}/v1/completions", proxy.http_addr());
    let col_url = format!("http://{}/v1/completions", colocated.http_addr());
    let finished = Arc::new(AtomicUsize::new(0));
    let n = 24u64;
    let batch: Vec<_> = (0..n)
        .map(|i| {
            let (client, url, finished) = (client.clone(), url.clone(), finished.clone());
            tokio::spawn(async move {
                let t = Instant::now();
                let r = client.generate(&url, &body(i), DEADLINE).await;
                finished.fetch_add(1, Ordering::SeqCst);
                (i, r, t.elapsed())
            })
        })
        .collect();
    // Kill prefiller A and decoder A once each has taken a request (conditions with a
    // deadline; the decoders count the decode requests they got, the prefillers their
    // prefills).
    let requests_at = |p: u16| {
        let client = client.clone();
        async move {
            let v = client
                .get_json(&format!("http://127.0.0.1:{p}/health"), DEADLINE)
                .await
                .expect("worker health");
            v["stats"]["requests"].as_u64().unwrap_or(0)
        }
    };
    let until = Instant::now() + DEADLINE;
    loop {
        if requests_at(port(&vpa)).await >= 1 && requests_at(port(&vda)).await >= 1 {
            break;
        }
        assert!(
            Instant::now() < until,
            "{policy:?}: A workers got no request"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    pa.start_kill().expect("kill prefiller A");
    da.start_kill().expect("kill decoder A");
    let done_at_kill = finished.load(Ordering::SeqCst);
    let _ = pa.wait().await;
    let _ = da.wait().await;
    assert!(
        (done_at_kill as u64) < n,
        "{policy:?}: the workers were killed after the load ended"
    );
    let (mut ok, mut failed) = (0, 0);
    for h in batch {
        let (i, r, took) = h.await.expect("request task");
        assert!(took < DEADLINE, "{policy:?}: request {i} took {took:?}");
        match r {
            Ok(ans) => {
                let want = client
                    .generate(&col_url, &body(i), DEADLINE)
                    .await
                    .expect("colocated");
                assert_eq!(ans.text, want.text, "{policy:?}: request {i}");
                ok += 1;
            }
            Err(ClientError::Status { status, body, .. }) => {
                assert!(
                    matches!(status, 502..=504),
                    "{policy:?}: request {i}: {status} {body}"
                );
                assert!(
                    [
                        "prefill_failed",
                        "prefiller_lost",
                        "kv_transfer_failed",
                        "kv_ready_timeout",
                        "kv_receiver_unreachable",
                        "no_healthy_worker",
                        "decode_failed",
                        "decode_timeout",
                    ]
                    .iter()
                    .any(|c| body.contains(c)),
                    "{policy:?}: request {i}: unclear error {body}"
                );
                failed += 1;
            }
            Err(ClientError::Answer { detail, .. }) => {
                assert!(
                    [
                        "decoder_stream_failed",
                        "decode_failed",
                        "decode_timeout",
                        "prefiller_lost",
                        "kv_transfer_failed",
                        "kv_ready_timeout",
                    ]
                    .iter()
                    .any(|c| detail.contains(c)),
                    "{policy:?}: request {i}: unclear stream error {detail}"
                );
                failed += 1;
            }
            Err(e) => panic!("{policy:?}: request {i}: {e}"),
        }
    }
    assert_eq!(ok + failed, n, "{policy:?}");
    // 60 tokens at 10 ms: decoder A held a request mid-decode when it was killed.
    assert!(
        failed >= 1,
        "{policy:?}: the kill hit no request in flight ({ok} ok)"
    );
    // Once both are ejected (health checks every 100 ms), every prefix is served by the
    // survivors, whatever the policy knew of the dead workers' caches.
    let metrics = format!("http://{}/metrics", proxy.http_addr());
    let dead = [
        format!("127.0.0.1:{}", port(&vpa)),
        format!("127.0.0.1:{}", port(&vda)),
    ];
    wait_ejected(&client, &metrics, &dead, DEADLINE).await;
    answers_equal_colocated(
        &client,
        &url,
        &col_url,
        (100..108u64).map(body),
        DEADLINE,
        &format!("{policy:?}, after the kill"),
    )
    .await;
    let _ = pb.start_kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_loaded_survives_a_killed_prefiller_and_decoder() {
    kill_mid_load(RoutingPolicy::LeastLoaded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_aware_survives_a_killed_prefiller_and_decoder() {
    kill_mid_load(RoutingPolicy::CacheAware).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_survives_a_killed_prefiller_and_decoder() {
    kill_mid_load(RoutingPolicy::KvEvents).await;
}
