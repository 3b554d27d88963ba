//! `kvbridge bench transfer`: kvbridge writes against the same-run ceiling of their
//! transport: a plain loopback socket stream for tcp, an in-process memcpy for shm.

use super::peer::PeerProcess;
use super::{median, parse_size};
use anyhow::Result;
use kvbridge::{Channel, ChannelConfig, Grant, Op, Region};
use serde::Serialize;
use std::io::{Read, Write};
use std::time::Instant;

/// Flags of `kvbridge bench transfer`.
#[derive(Debug, clap::Args)]
pub struct TransferArgs {
    /// Transport to measure: tcp, or shm (the peer's region mapped into this process).
    #[arg(long, default_value = "tcp")]
    pub transport: String,
    /// Write every batch to the same `batch` offsets (Mooncake's `transfer_engine_bench`
    /// pattern: a working set of batch × block, cache-hot for small blocks) instead of
    /// cycling through the whole region.
    #[arg(long)]
    pub same_offsets: bool,
    /// Block sizes in bytes (K/M/G suffixes allowed), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "16384,262144,4194304")]
    pub block_sizes: Vec<String>,
    /// Ops per batch.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Bytes moved per measurement.
    #[arg(long, default_value = "1G")]
    pub total: String,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 2)]
    pub inflight: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One row of the result.
#[derive(Debug, Serialize)]
pub struct Row {
    /// Block (op) size in bytes.
    pub block_size: u64,
    /// kvbridge write throughput, median.
    pub gib_per_s: f64,
    /// The transport's ceiling at the same block size, median: a plain loopback socket
    /// stream (tcp) or a memcpy between two regions in this process (shm).
    pub ceiling_gib_per_s: f64,
    /// `gib_per_s / ceiling_gib_per_s`.
    pub ratio: f64,
}

/// The whole result.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Transport measured.
    pub transport: String,
    /// What the ceiling is: `socket` or `memcpy`.
    pub ceiling: String,
    /// `scatter` (cycling through the region) or `same-offsets`.
    pub pattern: String,
    /// One row per block size.
    pub results: Vec<Row>,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Streams `total` bytes in `block`-sized writes to the peer's sink, from the same memory
/// kvbridge sends from; GiB/s.
fn ceiling(sink: &str, block: usize, total: u64, region: &Region) -> Result<f64> {
    // SAFETY: no transfer touches the region while the ceiling runs.
    let buf = unsafe { std::slice::from_raw_parts(region.as_ptr(), region.len()) };
    let mut s = std::net::TcpStream::connect(sink)?;
    s.set_nodelay(true)?;
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&(block as u64).to_le_bytes());
    h[8..].copy_from_slice(&total.to_le_bytes());
    s.write_all(&h)?;
    let t = Instant::now();
    let mut sent = 0u64;
    let mut off = 0usize;
    while sent < total {
        let n = block.min((total - sent) as usize);
        if off + n > buf.len() {
            off = 0;
        }
        s.write_all(&buf[off..off + n])?;
        off += n;
        sent += n as u64;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    Ok(total as f64 / GIB / t.elapsed().as_secs_f64())
}

/// Copies `total` bytes in `block`-sized memcpys from `src` to `dst` with the benchmark's
/// access pattern (cycling through `window` bytes, or the first `batch` blocks); GiB/s.
fn memcpy_ceiling(src: &Region, dst: &Region, block: usize, total: u64, window: usize) -> f64 {
    let t = Instant::now();
    let mut sent = 0u64;
    let mut off = 0usize;
    while sent < total {
        let n = block.min((total - sent) as usize);
        if off + n > window.min(src.len()).min(dst.len()) {
            off = 0;
        }
        // SAFETY: both ranges are in bounds (checked above) of two distinct regions that no
        // transfer touches while the ceiling runs.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(off), dst.as_ptr().add(off), n) };
        off += n;
        sent += n as u64;
    }
    total as f64 / GIB / t.elapsed().as_secs_f64()
}

/// Runs the benchmark.
pub async fn run(args: TransferArgs) -> Result<Report> {
    let transport = kvbridge::Transport::parse(&args.transport)
        .filter(|t| *t != kvbridge::Transport::Auto)
        .ok_or_else(|| anyhow::anyhow!("transport {:?}: tcp or shm", args.transport))?;
    let shm = transport == kvbridge::Transport::Shm;
    let blocks: Vec<u64> = args
        .block_sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    let total = parse_size(&args.total).map_err(anyhow::Error::msg)?;
    let inflight = args.inflight.max(1);
    // One window of in-flight batches per block size must fit the regions.
    let window = blocks
        .iter()
        .map(|&b| b as usize * args.batch * inflight)
        .max()
        .unwrap_or(0)
        .clamp(1 << 20, 1 << 30);
    let page = 4096;
    let peer = PeerProcess::start(window, page)?;
    let mut cfg = ChannelConfig::new("bench-initiator", None);
    cfg.transport = transport;
    let ch = Channel::new(cfg).await?;
    let local = Region::alloc(window, page)?;
    // The memcpy ceiling's destination: memory of the same kind as the peer's region.
    let memcpy_dst = if shm {
        Some(Region::alloc(window, page)?)
    } else {
        None
    };
    // Non-zero payload, so no layer can take a shortcut on zero pages.
    let pattern: Vec<u8> = (0..window).map(|i| (i * 31 + 7) as u8).collect();
    local.write_at(0, &pattern)?;
    ch.register(&local, Grant::AllPeers)?;
    let target = ch.connect(&peer.addr).await?;
    anyhow::ensure!(
        ch.peer_transport(&target).await? == transport,
        "the session does not use {}",
        args.transport
    );

    let mut rows = Vec::new();
    for &block in &blocks {
        let block_us = block as usize;
        let per_window = if args.same_offsets {
            args.batch.min(window / block_us).max(1)
        } else {
            (window / block_us).max(1)
        };
        let mut ours = Vec::new();
        let mut ceil = Vec::new();
        for _ in 0..args.reps.max(1) {
            // Ceiling first and ours second, alternating per repetition, side by side.
            let l = local.clone();
            if let Some(dst) = &memcpy_dst {
                let (dst, span) = (dst.clone(), per_window * block_us);
                ceil.push(
                    tokio::task::spawn_blocking(move || {
                        memcpy_ceiling(&l, &dst, block_us, total, span)
                    })
                    .await?,
                );
            } else {
                let sink = peer.sink.clone();
                ceil.push(
                    tokio::task::spawn_blocking(move || ceiling(&sink, block_us, total, &l))
                        .await??,
                );
            }
            let batches = total.div_ceil(block * args.batch as u64) as usize;
            let t = Instant::now();
            let mut next = 0usize;
            let mut slot = 0usize;
            let mut joins = tokio::task::JoinSet::new();
            while next < batches || !joins.is_empty() {
                while next < batches && joins.len() < inflight {
                    let ops: Vec<Op> = (0..args.batch)
                        .map(|_| {
                            let i = slot % per_window;
                            slot += 1;
                            Op {
                                local: local.clone(),
                                local_offset: i * block_us,
                                remote: peer.region,
                                remote_offset: (i * block_us) as u64,
                                len: block_us,
                            }
                        })
                        .collect();
                    let ch = ch.clone();
                    let target = target.clone();
                    joins.spawn(async move { ch.write(&target, &ops).await });
                    next += 1;
                }
                if let Some(r) = joins.join_next().await {
                    r??;
                }
            }
            let bytes = batches as u64 * block * args.batch as u64;
            ours.push(bytes as f64 / GIB / t.elapsed().as_secs_f64());
        }
        let (g, c) = (median(ours), median(ceil));
        rows.push(Row {
            block_size: block,
            gib_per_s: g,
            ceiling_gib_per_s: c,
            ratio: g / c,
        });
    }
    ch.close().await;
    Ok(Report {
        transport: args.transport,
        ceiling: if shm { "memcpy" } else { "socket" }.into(),
        pattern: if args.same_offsets {
            "same-offsets"
        } else {
            "scatter"
        }
        .into(),
        results: rows,
    })
}

/// Prints the report as a table.
pub fn print_table(r: &Report, batch: usize) {
    println!(
        "kvbridge bench transfer ({}, {} pattern, ceiling {}), batch {batch}, medians",
        r.transport, r.pattern, r.ceiling
    );
    println!(
        "{:>10} {:>12} {:>14} {:>7}",
        "block", "GiB/s", "ceiling GiB/s", "ratio"
    );
    for row in &r.results {
        println!(
            "{:>10} {:>12.2} {:>14.2} {:>7.2}",
            row.block_size, row.gib_per_s, row.ceiling_gib_per_s, row.ratio
        );
    }
}
