//! `kvbridge bench notify`: the control path's latency. A second process echoes every
//! notification back on the sender's session, and every byte on a plain loopback socket;
//! samples alternate between the two, so both see the same machine.
//!
//! Three figures per sample: the raw socket's ping-pong (64 bytes there and back), a
//! notification's reply (notify, then the peer's echoed notification received: what a PD
//! call such as `finish` costs at least), and a notification's delivery (`notify` returns
//! once the peer's reader acknowledged it).

use super::peer::PeerProcess;
use super::sample::quantile;
use anyhow::{Context, Result};
use kvbridge::{Channel, ChannelConfig};
use serde::Serialize;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Flags of `kvbridge bench notify`.
#[derive(Debug, clap::Args)]
pub struct NotifyArgs {
    /// Samples of each kind.
    #[arg(long, default_value_t = 2000)]
    pub samples: usize,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One figure's distribution, µs.
#[derive(Debug, Serialize)]
pub struct Latency {
    /// Median, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
}

impl Latency {
    fn of(v: &[f64]) -> Latency {
        Latency {
            p50_us: quantile(v.to_vec(), 0.5),
            p99_us: quantile(v.to_vec(), 0.99),
        }
    }
}

/// The result.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Samples of each kind.
    pub samples: usize,
    /// Raw loopback TCP, 64 bytes there and back.
    pub tcp_round_trip: Latency,
    /// A notification and the peer's echoed notification back.
    pub notify_reply: Latency,
    /// `notify` until the peer acknowledged it.
    pub notify_delivered: Latency,
    /// `notify_reply` median over `tcp_round_trip` median.
    pub reply_vs_tcp: f64,
    /// `notify_delivered` median over `tcp_round_trip` median.
    pub delivered_vs_tcp: f64,
    /// Frames of this side's channel written past its data writer (`Stats::frames_fast_lane`;
    /// `frames_direct` in the JSON, the key the bench has always written).
    #[serde(rename = "frames_direct")]
    pub frames_fast_lane: u64,
}

impl Report {
    /// The human summary.
    pub fn table(&self) -> String {
        let row = |name: &str, l: &Latency, ratio: Option<f64>| {
            format!(
                "  {name:<34} p50 {:>7.1} µs  p99 {:>7.1} µs{}\n",
                l.p50_us,
                l.p99_us,
                ratio.map_or(String::new(), |r| format!("  ({r:.2}x raw TCP)"))
            )
        };
        format!(
            "kvbridge bench notify: {} samples each, alternated, peer in a second process\n{}{}{}  frames past the writer: {}",
            self.samples,
            row("raw loopback TCP round trip", &self.tcp_round_trip, None),
            row("notification and reply", &self.notify_reply, Some(self.reply_vs_tcp)),
            row(
                "notification delivered (acked)",
                &self.notify_delivered,
                Some(self.delivered_vs_tcp)
            ),
            self.frames_fast_lane
        )
    }
}

/// How long one sample may take before the benchmark gives up.
const SAMPLE_DEADLINE: Duration = Duration::from_secs(5);

/// Runs the benchmark.
pub async fn run(args: NotifyArgs) -> Result<Report> {
    let peer = PeerProcess::start_echo()?;
    let mut sock =
        std::net::TcpStream::connect(&peer.sink).context("cannot reach the echo sink")?;
    sock.set_nodelay(true)?;
    sock.set_read_timeout(Some(SAMPLE_DEADLINE))?;
    let ch = Channel::new(ChannelConfig::new("bench-notify", None)).await?;
    let p = ch.connect(&peer.addr).await?;
    let link = ch.link(&p).await?;
    let n = args.samples.max(1);
    let (mut tcp, mut reply, mut delivered) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let msg = [7u8; 64];
    let mut back = [0u8; 64];
    for _ in 0..n {
        let t = Instant::now();
        sock.write_all(&msg)?;
        sock.read_exact(&mut back)?;
        tcp.push(t.elapsed().as_secs_f64() * 1e6);

        let t = Instant::now();
        let q = link.notify_queued(&msg).await?;
        tokio::time::timeout(SAMPLE_DEADLINE, ch.recv_notification())
            .await
            .context("no echo within the deadline")?
            .context("the channel closed")?;
        reply.push(t.elapsed().as_secs_f64() * 1e6);
        q.delivered().await?;

        let t = Instant::now();
        link.notify(&msg).await?;
        delivered.push(t.elapsed().as_secs_f64() * 1e6);
        // Its echo, so the next sample starts with nothing in flight.
        tokio::time::timeout(SAMPLE_DEADLINE, ch.recv_notification())
            .await
            .context("no echo within the deadline")?
            .context("the channel closed")?;
    }
    let frames_fast_lane = ch.stats().await?.frames_fast_lane;
    ch.close().await;
    let (tcp, reply, delivered) = (
        Latency::of(&tcp),
        Latency::of(&reply),
        Latency::of(&delivered),
    );
    Ok(Report {
        samples: n,
        reply_vs_tcp: reply.p50_us / tcp.p50_us,
        delivered_vs_tcp: delivered.p50_us / tcp.p50_us,
        tcp_round_trip: tcp,
        notify_reply: reply,
        notify_delivered: delivered,
        frames_fast_lane,
    })
}
