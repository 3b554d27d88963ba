//! What the tests that put real engines behind a real proxy share: the proxy's view of them.

use kvbridge_pd::{Dtype, KvLayout, KvSpec};
use kvbridge_proxy::config::{DecoderConfig, WorkerAddr};
use kvbridge_proxy::server::RunningProxy;
use kvbridge_sim::engine::{self, EngineConfig, RunningEngine};
use kvbridge_sim::model::Model;

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
