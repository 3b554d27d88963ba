//! What the tests that put real engines behind a real proxy share: the proxy's view of them.

use kvbridge_proxy::config::{DecoderConfig, WorkerAddr};
use kvbridge_sim::engine::RunningEngine;

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
