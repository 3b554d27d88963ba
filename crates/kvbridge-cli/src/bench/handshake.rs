//! `kvbridge bench handshake`: connect plus the first 4 KiB write, over fresh initiators;
//! with `--tls`, the same against a second listener process that requires TLS on the control
//! connection (a self-signed certificate generated for the run), samples interleaved so both
//! see the same machine. With `--transport ucx` both sides run UCX (`UCX_TLS` passes
//! through) and a sample is connect, the UCX negotiation until the peer's region is imported,
//! and the first 4 KiB write over UCX: what NIXL's metadata exchange plus first write is.
//! Each sample's page is read back and compared outside the timing.

use super::peer::PeerProcess;
use super::sample::{median, quantile};
use anyhow::{Context, Result};
use kvbridge::{Channel, ChannelConfig, Grant, Op, Pem, Region, TlsConfig};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// Flags of `kvbridge bench handshake`.
#[derive(Debug, clap::Args)]
pub struct HandshakeArgs {
    /// Fresh initiators (samples), per side.
    #[arg(long, default_value_t = 200)]
    pub peers: usize,
    /// Also measure with TLS on the control connection, side by side in the same run.
    #[arg(long)]
    pub tls: bool,
    /// Transport of both sides: auto, tcp or ucx (the write waits for UCX to carry the
    /// session). Unset: what `KVBRIDGE_TRANSPORT` says, as for any channel.
    #[arg(long)]
    pub transport: Option<String>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One side's figures.
#[derive(Debug, Serialize)]
pub struct Side {
    /// Number of samples.
    pub samples: usize,
    /// Median of connect + first 4 KiB write, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
}

impl Side {
    fn of(samples: Vec<f64>) -> Side {
        Side {
            samples: samples.len(),
            p50_ms: median(samples.clone()),
            p99_ms: quantile(samples, 0.99),
        }
    }
}

/// The result: plaintext figures at the top level (as before `--tls`), TLS beside them.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Plaintext control connection.
    #[serde(flatten)]
    pub plain: Side,
    /// TLS on the control connection (`--tls`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<Side>,
}

impl Report {
    /// The human summary.
    pub fn table(&self) -> String {
        let p = &self.plain;
        let mut s = format!(
            "connect + first 4 KiB write over {} fresh initiators: p50 {:.3} ms, p99 {:.3} ms",
            p.samples, p.p50_ms, p.p99_ms
        );
        if let Some(t) = &self.tls {
            s += &format!(
                "\n  with TLS on the control connection:              p50 {:.3} ms, p99 {:.3} ms \
                 (p50 +{:.3} ms, {:.2}x)",
                t.p50_ms,
                t.p99_ms,
                t.p50_ms - p.p50_ms,
                t.p50_ms / p.p50_ms
            );
        }
        s
    }
}

/// A self-signed certificate for 127.0.0.1 in a private temporary folder, removed on drop.
pub(super) struct TempCert {
    pub(super) dir: PathBuf,
    pub(super) cert_pem: String,
}

impl TempCert {
    pub(super) fn new() -> Result<TempCert> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let c = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()])?;
        let dir = std::env::temp_dir().join(format!(
            "kvbridge-bench-tls-{}-{}",
            std::process::id(),
            // Only to make the name unique: a stale folder of an earlier process that had
            // the same pid must not be reused.
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let t = TempCert {
            dir,
            cert_pem: c.cert.pem(),
        };
        std::fs::write(t.dir.join("cert.pem"), &t.cert_pem)?;
        let mut key = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(t.dir.join("key.pem"))?;
        std::io::Write::write_all(&mut key, c.key_pair.serialize_pem().as_bytes())?;
        Ok(t)
    }
}

impl Drop for TempCert {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How long the UCX negotiation of one sample may take before the run fails.
const UCX_READY_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

/// One sample: a fresh initiator connects and writes its first page (over UCX, once UCX
/// carries the session, with `transport` ucx). The page is read back and checked after the
/// timing.
async fn sample(
    i: usize,
    peer: &PeerProcess,
    tls: Option<TlsConfig>,
    transport: Option<kvbridge::Transport>,
) -> Result<f64> {
    let mut cfg = ChannelConfig::new(format!("bench-initiator-{i}"), None);
    cfg.tls = tls;
    if let Some(t) = transport {
        cfg.transport = t;
    }
    let transport = cfg.transport;
    let ch = Channel::new(cfg).await?;
    let r = Region::alloc(2 * 4096, 4096)?;
    let page: Vec<u8> = (0..4096).map(|k| (k * 13 + i * 7 + 1) as u8).collect();
    r.write_at(0, &page)?;
    ch.register(&r, Grant::AllPeers)?;
    let remote_page = (i % 256) as u64;
    let t = Instant::now();
    let p = ch.connect(&peer.addr).await?;
    if transport == kvbridge::Transport::Ucx {
        // The UCX negotiation follows the session's establishment; poll without sleeping
        // (a timer tick is a millisecond), giving the CPU away between looks.
        let until = Instant::now() + UCX_READY_BOUND;
        while ch.peer_transport(&p).await? != transport {
            anyhow::ensure!(
                Instant::now() < until,
                "sample {i}: UCX did not carry the session within {UCX_READY_BOUND:?}"
            );
            std::thread::yield_now();
            tokio::task::yield_now().await;
        }
    }
    ch.write(&p, &[Op::page(&r, 0, peer.region, remote_page, 4096)])
        .await?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    ch.read(&p, &[Op::page(&r, 1, peer.region, remote_page, 4096)])
        .await?;
    let mut back = vec![0u8; 4096];
    r.read_at(4096, &mut back)?;
    anyhow::ensure!(back == page, "sample {i}: the page read back differs");
    ch.close().await;
    Ok(ms)
}

/// Runs the benchmark.
pub async fn run(args: HandshakeArgs) -> Result<Report> {
    const NO_TLS: [&str; 4] = [
        "KVBRIDGE_TLS_CERT",
        "KVBRIDGE_TLS_KEY",
        "KVBRIDGE_TLS_CA",
        "KVBRIDGE_TLS_SERVER_NAME",
    ];
    let transport = match &args.transport {
        None => None,
        Some(name) => Some(
            kvbridge::Transport::parse(name)
                .filter(|t| *t != kvbridge::Transport::Shm)
                .ok_or_else(|| anyhow::anyhow!("transport {name:?}: auto, tcp or ucx"))?,
        ),
    };
    // The listener's channel takes its transport from the environment.
    let transport_env: Vec<(&str, &std::ffi::OsStr)> = transport
        .map(|t| ("KVBRIDGE_TRANSPORT", std::ffi::OsStr::new(t.name())))
        .into_iter()
        .collect();
    let plain_peer = PeerProcess::start_with(1 << 20, 4096, &transport_env, &NO_TLS)?;
    let tls = match args.tls {
        true => {
            let cert = TempCert::new().context("cannot write the bench certificate")?;
            let (c, k) = (cert.dir.join("cert.pem"), cert.dir.join("key.pem"));
            let mut env = vec![
                ("KVBRIDGE_TLS_CERT", c.as_os_str()),
                ("KVBRIDGE_TLS_KEY", k.as_os_str()),
            ];
            env.extend(transport_env.iter().copied());
            let peer = PeerProcess::start_with(1 << 20, 4096, &env, &NO_TLS[2..])?;
            let config = TlsConfig {
                trusted: Some(Pem::Text(cert.cert_pem.clone())),
                ..TlsConfig::default()
            };
            Some((peer, config, cert))
        }
        false => None,
    };
    let n = args.peers.max(1);
    let (mut plain, mut with_tls) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        plain.push(sample(i, &plain_peer, None, transport).await?);
        if let Some((peer, config, _)) = &tls {
            with_tls.push(sample(i, peer, Some(config.clone()), transport).await?);
        }
    }
    Ok(Report {
        plain: Side::of(plain),
        tls: tls.map(|_| Side::of(with_tls)),
    })
}
