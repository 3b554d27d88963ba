//! `kvbridge bench handshake`: connect plus the first 4 KiB write, over fresh initiators.

use super::peer::PeerProcess;
use super::{median, quantile};
use anyhow::Result;
use kvbridge::{Channel, ChannelConfig, Grant, Op, Region};
use serde::Serialize;
use std::time::Instant;

/// Flags of `kvbridge bench handshake`.
#[derive(Debug, clap::Args)]
pub struct HandshakeArgs {
    /// Fresh initiators (samples).
    #[arg(long, default_value_t = 200)]
    pub peers: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The result.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Number of samples.
    pub samples: usize,
    /// Median of connect + first 4 KiB write, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
}

/// Runs the benchmark.
pub async fn run(args: HandshakeArgs) -> Result<Report> {
    let peer = PeerProcess::start(1 << 20, 4096)?;
    let mut samples = Vec::with_capacity(args.peers);
    for i in 0..args.peers.max(1) {
        let ch = Channel::new(ChannelConfig::new(format!("bench-initiator-{i}"), None)).await?;
        let r = Region::alloc(4096, 4096)?;
        r.write_at(0, &[i as u8; 4096])?;
        ch.register(&r, Grant::AllPeers)?;
        let t = Instant::now();
        let p = ch.connect(&peer.addr).await?;
        ch.write(&p, &[Op::page(&r, 0, peer.region, (i % 256) as u64, 4096)])
            .await?;
        samples.push(t.elapsed().as_secs_f64() * 1e3);
        ch.close().await;
    }
    Ok(Report {
        samples: samples.len(),
        p50_ms: median(samples.clone()),
        p99_ms: quantile(samples, 0.99),
    })
}
