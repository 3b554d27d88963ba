//! What the tests that put real engines behind a real proxy share: the proxy's view of them,
//! and engines as processes of their own (for tests that `kill -9` them).

use kvbridge_pd::{Dtype, KvLayout, KvSpec};
use kvbridge_proxy::config::{DecoderConfig, WorkerAddr};
use kvbridge_proxy::server::RunningProxy;
use kvbridge_sim::client::Client;
use kvbridge_sim::engine::{self, EngineConfig, RunningEngine};
use kvbridge_sim::model::Model;
use serde_json::Value;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A small model named `name`: 4 layers, 2 KV heads of 64, bf16, 32-token chunks, TP=1
/// (the engine binary's `--layers 4 --kv-heads 2 --head-dim 64 --chunk-tokens 32`).
pub fn small_model(name: &str) -> Model {
    Model {
        name: name.into(),
        spec: KvSpec {
            chunk_tokens: 32,
            ..KvSpec::new(
                KvLayout::Standard {
                    layers: 4,
                    kv_heads: 2,
                    head_dim: 64,
                },
                Dtype::Bf16,
            )
        },
        world_size: 1,
    }
}

/// A prefiller listening on 127.0.0.1:`port`.
pub fn prefiller_at(port: u16) -> WorkerAddr {
    WorkerAddr {
        host: "127.0.0.1".into(),
        port,
    }
}

/// A decoder on 127.0.0.1 with its HTTP port and KV ports, with no admission limits.
pub fn decoder_at(http_port: u16, init_ports: Vec<u16>, alloc_ports: Vec<u16>) -> DecoderConfig {
    DecoderConfig {
        host: "127.0.0.1".into(),
        port: http_port,
        init_ports,
        alloc_ports,
        max_requests: 0,
        kv_capacity_tokens: 0,
    }
}

/// An in-process decoder engine, as [`decoder_at`].
pub fn decoder_of(e: &RunningEngine) -> DecoderConfig {
    decoder_at(
        e.http_addr().port(),
        e.init_ports().to_vec(),
        e.alloc_ports().to_vec(),
    )
}

/// Starts an in-process prefiller on `l` (the address the proxy was given) that reports its
/// outcomes to `proxy`'s notification socket.
pub async fn prefiller_for(
    mut c: EngineConfig,
    l: tokio::net::TcpListener,
    proxy: &RunningProxy,
) -> RunningEngine {
    c.proxy_endpoint = Some(format!(
        "tcp://{}",
        proxy.notify_addr().expect("lmcache flow")
    ));
    engine::start(c, l).await.expect("prefiller starts")
}

/// An engine process (`kvbridge-sim-engine`) of [`small_model`] named `name`, decoding a token
/// every `decode_ms`, prefilling `prefill_tokens_per_s`, with `extra` flags; returns it and
/// the JSON line of its addresses, which it must print within `deadline`.
pub async fn engine_process(
    name: &str,
    decode_ms: u64,
    prefill_tokens_per_s: f64,
    extra: &[&str],
    deadline: Duration,
) -> (Child, Value) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbridge-sim-engine"))
        .args(extra)
        .args(["--buffer-mib", "64", "--model", name])
        .args(["--layers", "4", "--kv-heads", "2", "--head-dim", "64"])
        .args(["--chunk-tokens", "32"])
        .args(["--decode-ms-per-token", &decode_ms.to_string()])
        .args(["--prefill-tokens-per-s", &prefill_tokens_per_s.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("engine binary starts");
    let out = child.stdout.take().expect("stdout piped");
    let mut line = String::new();
    tokio::time::timeout(deadline, BufReader::new(out).read_line(&mut line))
        .await
        .expect("engine prints its addresses in time")
        .expect("reads stdout");
    (child, serde_json::from_str(&line).expect("one JSON line"))
}

/// The HTTP port in an engine's address line.
pub fn http_port(v: &Value) -> u16 {
    let a: std::net::SocketAddr = v["http"].as_str().expect("http").parse().expect("addr");
    a.port()
}

/// The ports listed under `key` (`init_ports`, `alloc_ports`) in an engine's address line.
pub fn ports(v: &Value, key: &str) -> Vec<u16> {
    v[key]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| p.as_u64().expect("port") as u16)
        .collect()
}

/// Waits until the proxy's `/metrics` at `metrics_url` shows every worker of `workers`
/// (`host:port`) unhealthy, for at most `deadline`.
pub async fn wait_ejected(
    client: &Client,
    metrics_url: &str,
    workers: &[String],
    deadline: Duration,
) {
    let until = Instant::now() + deadline;
    loop {
        let text = client
            .get_text(metrics_url, deadline)
            .await
            .expect("metrics");
        let ejected = |w: &String| {
            let label = format!("worker=\"{w}\"");
            text.lines().any(|l| {
                l.starts_with("kvbridge_proxy_worker_healthy{")
                    && l.contains(&label)
                    && l.ends_with(" 0")
            })
        };
        if workers.iter().all(ejected) {
            return;
        }
        assert!(Instant::now() < until, "{workers:?} not ejected:\n{text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends each body through the proxy at `url` and to the colocated engine at `colocated`;
/// every answer must succeed and equal the colocated one. `what` names the case in failures.
pub async fn answers_equal_colocated(
    client: &Client,
    url: &str,
    colocated: &str,
    bodies: impl IntoIterator<Item = Value>,
    deadline: Duration,
    what: &str,
) {
    for (i, body) in bodies.into_iter().enumerate() {
        let ans = client
            .generate(url, &body, deadline)
            .await
            .unwrap_or_else(|e| panic!("{what}: request {i}: {e}"));
        let want = client
            .generate(colocated, &body, deadline)
            .await
            .expect("colocated");
        assert_eq!(ans.text, want.text, "{what}: request {i}");
    }
}
