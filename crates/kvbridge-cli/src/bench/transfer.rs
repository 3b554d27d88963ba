//! `kvbridge bench transfer`: kvbridge writes against the same-run ceiling of their
//! transport: a plain loopback socket stream for tcp, an in-process memcpy for shm and cma.

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
    /// Transport to measure: tcp; shm (the peer's region mapped into this process); or cma
    /// (the peer's region in memory that cannot be mapped — private memory, as
    /// `Region::from_raw` memory is — copied with process_vm_writev).
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
    /// Sessions (TCP data connections) to the peer, from as many channels: each batch's ops
    /// are split into this many contiguous parts written concurrently, one per session, and
    /// the batch ends when every part has landed. The socket ceiling then streams over as
    /// many connections in parallel. Mooncake's benchmark opens one connection per block.
    #[arg(long, default_value_t = 1)]
    pub sessions: usize,
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
    /// Sessions each batch was split over (and parallel streams of the socket ceiling).
    pub sessions: usize,
    /// What the ceiling is: `socket` or `memcpy`.
    pub ceiling: String,
    /// `scatter` (cycling through the region) or `same-offsets`.
    pub pattern: String,
    /// One row per block size.
    pub results: Vec<Row>,
}

const GIB: f64 = (1u64 << 30) as f64;

/// Streams `total` bytes in `block`-sized writes to the peer's sink over `streams`
/// connections in parallel (one thread each, `total / streams` bytes each), from the same
/// memory kvbridge sends from; GiB/s.
fn ceiling(sink: &str, block: usize, total: u64, region: &Region, streams: usize) -> Result<f64> {
    let streams = streams.max(1);
    let per = total / streams as u64;
    let t = Instant::now();
    std::thread::scope(|sc| {
        let runs: Vec<_> = (0..streams)
            .map(|_| sc.spawn(|| stream_to_sink(sink, block, per, region)))
            .collect();
        runs.into_iter().try_for_each(|h| {
            h.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("ceiling thread panicked")))
        })
    })?;
    Ok((per * streams as u64) as f64 / GIB / t.elapsed().as_secs_f64())
}

/// One ceiling stream: `total` bytes in `block`-sized writes, then the sink's one-byte ack.
fn stream_to_sink(sink: &str, block: usize, total: u64, region: &Region) -> Result<()> {
    // SAFETY: no transfer touches the region while the ceiling runs; streams only read it.
    let buf = unsafe { std::slice::from_raw_parts(region.as_ptr(), region.len()) };
    let mut s = std::net::TcpStream::connect(sink)?;
    s.set_nodelay(true)?;
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&(block as u64).to_le_bytes());
    h[8..].copy_from_slice(&total.to_le_bytes());
    s.write_all(&h)?;
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
    Ok(())
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

/// `kvbridge bench transfer --transport shm --block-sizes <page> --reps <reps>` with its
/// other defaults: kvbridge's GiB/s (median), the reference for the demo's KV rate.
pub async fn at_page_size(page: u64, reps: usize) -> Result<f64> {
    let r = run(TransferArgs {
        transport: "shm".into(),
        same_offsets: false,
        block_sizes: vec![page.to_string()],
        batch: 128,
        total: "1G".into(),
        inflight: 2,
        sessions: 1,
        reps,
        json: true,
    })
    .await?;
    r.results
        .first()
        .map(|row| row.gib_per_s)
        .ok_or_else(|| anyhow::anyhow!("bench transfer measured nothing"))
}

/// Runs the benchmark.
pub async fn run(args: TransferArgs) -> Result<Report> {
    let cma = args.transport == "cma";
    let transport = if cma {
        kvbridge::Transport::Auto
    } else {
        kvbridge::Transport::parse(&args.transport)
            .filter(|t| *t != kvbridge::Transport::Auto)
            .ok_or_else(|| anyhow::anyhow!("transport {:?}: tcp, shm or cma", args.transport))?
    };
    let shm = transport == kvbridge::Transport::Shm;
    let blocks: Vec<u64> = args
        .block_sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    let total = parse_size(&args.total).map_err(anyhow::Error::msg)?;
    let inflight = args.inflight.max(1);
    let sessions = args.sessions.max(1);
    anyhow::ensure!(
        sessions <= args.batch.max(1),
        "--sessions {sessions} exceeds --batch {}: every session needs an op of each batch",
        args.batch
    );
    // One window of in-flight batches per block size must fit the regions.
    let window = blocks
        .iter()
        .map(|&b| b as usize * args.batch * inflight)
        .max()
        .unwrap_or(0)
        .clamp(1 << 20, 1 << 30);
    let page = 4096;
    // For cma the peer's region is private memory: like caller memory, no peer can map it.
    let memfd_off = [("KVBRIDGE_REGION_MEMFD", std::ffi::OsStr::new("0"))];
    let peer = if cma {
        PeerProcess::start_with(window, page, &memfd_off, &[])?
    } else {
        PeerProcess::start(window, page)?
    };
    let local = Region::alloc(window, page)?;
    // The memcpy ceiling's destination: memory of the same kind as the peer's region
    // (for cma plain heap memory, kept alive by `_raw_dst` for the whole run).
    let mut _raw_dst: Vec<u8> = Vec::new();
    let memcpy_dst = if shm {
        Some(Region::alloc(window, page)?)
    } else if cma {
        _raw_dst = vec![1u8; window];
        // SAFETY: the buffer lives until the end of `run`, after every use of the region;
        // only the ceiling's memcpy touches it.
        Some(unsafe { Region::from_raw(_raw_dst.as_mut_ptr(), window, page)? })
    } else {
        None
    };
    // Non-zero payload, so no layer can take a shortcut on zero pages. Written a piece at
    // a time: a copy of the whole window would be one more gigabyte of fresh memory, which
    // on a virtual machine that hands free memory back to its host costs seconds to fault.
    const PIECE: usize = 4 << 20;
    let mut pattern = vec![0u8; PIECE.min(window)];
    for at in (0..window).step_by(PIECE) {
        let piece = &mut pattern[..PIECE.min(window - at)];
        for (k, b) in piece.iter_mut().enumerate() {
            *b = ((at + k) * 31 + 7) as u8;
        }
        local.write_at(at, piece)?;
    }
    // One channel per session: a channel holds one session per peer.
    let mut links = Vec::with_capacity(sessions);
    for i in 0..sessions {
        let name = if sessions == 1 {
            "bench-initiator".to_string()
        } else {
            format!("bench-initiator-{i}")
        };
        let mut cfg = ChannelConfig::new(&name, None);
        cfg.transport = transport;
        let ch = Channel::new(cfg).await?;
        ch.register(&local, Grant::AllPeers)?;
        let target = ch.connect(&peer.addr).await?;
        if cma {
            match ch.peer_cma(&target).await? {
                kvbridge::CmaStatus::Active => {}
                kvbridge::CmaStatus::Off(why) => {
                    anyhow::bail!("the session does not use cma: {why}")
                }
            }
        } else {
            anyhow::ensure!(
                ch.peer_transport(&target).await? == transport,
                "the session does not use {}",
                args.transport
            );
        }
        links.push((ch, target));
    }
    let links = std::sync::Arc::new(links);

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
                    tokio::task::spawn_blocking(move || {
                        ceiling(&sink, block_us, total, &l, sessions)
                    })
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
                    let links = links.clone();
                    joins.spawn(async move {
                        if let [(ch, target)] = &links[..] {
                            return Ok(ch.write(target, &ops).await?);
                        }
                        // Contiguous parts, one per session, written concurrently.
                        let part = ops.len().div_ceil(links.len());
                        let mut parts = tokio::task::JoinSet::new();
                        for (i, ops) in ops.chunks(part).enumerate() {
                            let (links, ops) = (links.clone(), ops.to_vec());
                            parts.spawn(async move {
                                let (ch, target) = &links[i];
                                ch.write(target, &ops).await
                            });
                        }
                        while let Some(r) = parts.join_next().await {
                            r.map_err(|e| anyhow::anyhow!("write task: {e}"))??;
                        }
                        anyhow::Ok(())
                    });
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
    for (ch, _) in links.iter() {
        ch.close().await;
    }
    Ok(Report {
        transport: args.transport,
        sessions,
        ceiling: if shm || cma { "memcpy" } else { "socket" }.into(),
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
        "kvbridge bench transfer ({}, {} pattern, {} session(s), ceiling {}), batch {batch}, medians",
        r.transport, r.pattern, r.sessions, r.ceiling
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
