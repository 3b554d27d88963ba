//! `kvbridge bench transfer`: kvbridge writes against the same-run ceiling of their
//! transport: a plain loopback socket stream for tcp and ucx, an in-process memcpy for shm
//! and cma. With `--data-tls` (tcp only) the same writes run over TLS on the control and data
//! connections too, side by side with plaintext in the same run. After every measurement the
//! span it wrote is read back from the peer and compared byte by byte (outside the timing);
//! a mismatch fails the run.

use super::peer::PeerProcess;
use super::sample::{median, parse_size};
use anyhow::Result;
use kvbridge::{Channel, ChannelConfig, Grant, Op, Region};
use serde::Serialize;
use std::io::{Read, Write};
use std::time::Instant;

/// Flags of `kvbridge bench transfer`.
#[derive(Debug, clap::Args)]
pub struct TransferArgs {
    /// Transport to measure: tcp; shm (the peer's region mapped into this process); cma
    /// (the peer's region in memory that cannot be mapped — private memory, as
    /// `Region::from_raw` memory is — copied with process_vm_writev); or ucx (both processes
    /// with `KVBRIDGE_TRANSPORT=ucx`, UCX's transports as `UCX_TLS` says; needs a build with
    /// the `kvbridge` crate's `ucx` feature).
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
    /// With `--sessions N`: N peer processes, one per session, so that the target side runs
    /// N channels too (over UCX: a worker and its owner thread per session on both sides,
    /// where one peer would serve every session from its one worker).
    #[arg(long)]
    pub peer_per_session: bool,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// tcp only: also measure with TLS on the control and data connections
    /// (`TlsConfig::data`), against a second peer process serving a fresh self-signed
    /// certificate. Per block size and repetition the socket ceiling, plaintext kvbridge
    /// and TLS kvbridge alternate.
    #[arg(long)]
    pub data_tls: bool,
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
    /// kvbridge write throughput, lowest and highest repetition.
    pub gib_per_s_range: [f64; 2],
    /// With `--data-tls`: throughput with TLS on the data connections, median.
    pub tls_gib_per_s: Option<f64>,
    /// With `--data-tls`: lowest and highest repetition with TLS.
    pub tls_gib_per_s_range: Option<[f64; 2]>,
    /// With `--data-tls`: `tls_gib_per_s / gib_per_s`.
    pub tls_ratio: Option<f64>,
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
    /// ucx only: the `UCX_TLS` both processes ran with (`(default)` when unset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ucx_tls: Option<String>,
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
        peer_per_session: false,
        reps,
        json: true,
        data_tls: false,
    })
    .await?;
    r.results
        .first()
        .map(|row| row.gib_per_s)
        .ok_or_else(|| anyhow::anyhow!("bench transfer measured nothing"))
}

/// What the flags ask for, checked: the transport, the block sizes and the window of
/// in-flight batches that the regions must hold.
struct Plan {
    transport: kvbridge::Transport,
    /// `--transport cma`: the default transport against a peer whose region cannot be mapped.
    cma: bool,
    shm: bool,
    ucx: bool,
    blocks: Vec<u64>,
    total: u64,
    inflight: usize,
    sessions: usize,
    /// Bytes of every region: one window of in-flight batches of the largest block.
    window: usize,
    page: usize,
}

impl Plan {
    fn of(args: &TransferArgs) -> Result<Plan> {
        let cma = args.transport == "cma";
        let transport = if cma {
            kvbridge::Transport::Auto
        } else {
            kvbridge::Transport::parse(&args.transport)
                .filter(|t| *t != kvbridge::Transport::Auto)
                .ok_or_else(|| {
                    anyhow::anyhow!("transport {:?}: tcp, shm, cma or ucx", args.transport)
                })?
        };
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
        Ok(Plan {
            transport,
            cma,
            shm: transport == kvbridge::Transport::Shm,
            ucx: transport == kvbridge::Transport::Ucx,
            blocks,
            total,
            inflight,
            sessions,
            window,
            page: 4096,
        })
    }

    /// The peer processes: one, or one per session with `--peer-per-session`.
    fn start_peers(&self, args: &TransferArgs) -> Result<Vec<PeerProcess>> {
        // For cma the peer's region is private memory: like caller memory, no peer can map it.
        let memfd_off = [("KVBRIDGE_REGION_MEMFD", std::ffi::OsStr::new("0"))];
        // The peer's channel offers UCX only with the transport set; UCX_TLS passes through.
        let ucx_on = [("KVBRIDGE_TRANSPORT", std::ffi::OsStr::new("ucx"))];
        let (window, page) = (self.window, self.page);
        let start_peer = || {
            if self.cma {
                PeerProcess::start_with(window, page, &memfd_off, &[])
            } else if self.ucx {
                PeerProcess::start_with(window, page, &ucx_on, &[])
            } else {
                PeerProcess::start_with(window, page, &[], &["KVBRIDGE_TRANSPORT"])
            }
        };
        let n = if args.peer_per_session {
            self.sessions
        } else {
            1
        };
        (0..n).map(|_| start_peer()).collect()
    }

    /// The memcpy ceiling's destination: memory of the same kind as the peer's region, none
    /// where the ceiling is a socket. For cma it is plain heap memory, the buffer returned
    /// beside it, which the caller keeps for as long as it uses the region.
    fn memcpy_destination(&self) -> Result<(Vec<u8>, Option<Region>)> {
        if self.shm {
            Ok((Vec::new(), Some(Region::alloc(self.window, self.page)?)))
        } else if self.cma {
            let mut raw = vec![1u8; self.window];
            // SAFETY: the buffer's heap memory stays where it is when the Vec moves, and the
            // caller keeps the Vec until after every use of the region; only the ceiling's
            // memcpy touches it.
            let r = unsafe { Region::from_raw(raw.as_mut_ptr(), self.window, self.page)? };
            Ok((raw, Some(r)))
        } else {
            Ok((Vec::new(), None))
        }
    }
}

/// The sessions of a run, one per `--sessions`, each with its channel.
type Links = std::sync::Arc<Vec<(Channel, kvbridge::PeerId)>>;

/// With `--data-tls`: a second peer serving `cert`, and sessions that trust it.
async fn tls_sessions(
    plan: &Plan,
    args: &TransferArgs,
    cert: &super::handshake::TempCert,
    local: &Region,
    check: &Region,
) -> Result<(PeerProcess, Links)> {
    let (c, k) = (cert.dir.join("cert.pem"), cert.dir.join("key.pem"));
    let env = [
        ("KVBRIDGE_TLS_CERT", c.as_os_str()),
        ("KVBRIDGE_TLS_KEY", k.as_os_str()),
        ("KVBRIDGE_TLS_DATA", std::ffi::OsStr::new("1")),
    ];
    let p = PeerProcess::start_with(plan.window, plan.page, &env, &["KVBRIDGE_TLS_CA"])?;
    let config = kvbridge::TlsConfig {
        trusted: Some(kvbridge::Pem::Text(cert.cert_pem.clone())),
        data: true,
        ..kvbridge::TlsConfig::default()
    };
    let l = connect_sessions(
        plan.sessions,
        plan.transport,
        false,
        &args.transport,
        local,
        check,
        std::slice::from_ref(&p.addr),
        Some(config),
    )
    .await?;
    Ok((p, std::sync::Arc::new(l)))
}

/// What one block size's measurements run against.
struct Bench<'a> {
    args: &'a TransferArgs,
    plan: &'a Plan,
    peer: &'a PeerProcess,
    links: &'a Links,
    regions: &'a [kvbridge::RegionId],
    local: &'a Region,
    check: &'a Region,
    memcpy_dst: Option<&'a Region>,
    tls: Option<&'a (PeerProcess, Links)>,
}

impl Bench<'_> {
    /// `--reps` measurements at `block`, the ceiling first and ours second each time, side
    /// by side; `measurement` numbers each one's payload.
    async fn block(&self, block: u64, measurement: &mut u64) -> Result<Row> {
        let (args, plan) = (self.args, self.plan);
        let block_us = block as usize;
        let per_window = if args.same_offsets {
            args.batch.min(plan.window / block_us).max(1)
        } else {
            (plan.window / block_us).max(1)
        };
        let mut ours = Vec::new();
        let mut with_tls = Vec::new();
        let mut ceil = Vec::new();
        for _ in 0..args.reps.max(1) {
            // A payload of its own per measurement, so a write that did not land is seen.
            *measurement += 1;
            fill(self.local, plan.window, *measurement)?;
            // Ceiling first and ours second, alternating per repetition, side by side.
            let l = self.local.clone();
            let (total, sessions) = (plan.total, plan.sessions);
            if let Some(dst) = self.memcpy_dst {
                let (dst, span) = (dst.clone(), per_window * block_us);
                ceil.push(
                    tokio::task::spawn_blocking(move || {
                        memcpy_ceiling(&l, &dst, block_us, total, span)
                    })
                    .await?,
                );
            } else {
                let sink = self.peer.sink.clone();
                ceil.push(
                    tokio::task::spawn_blocking(move || {
                        ceiling(&sink, block_us, total, &l, sessions)
                    })
                    .await??,
                );
            }
            let shape = Shape {
                block,
                batch: args.batch,
                per_window,
                inflight: plan.inflight,
                total,
            };
            ours.push(write_all(self.links, self.local, self.regions, &shape).await?);
            verify(self.links, self.local, self.check, self.regions, &shape).await?;
            if let Some((p, tls_links)) = self.tls {
                let tls_regions = vec![p.region; sessions];
                with_tls.push(write_all(tls_links, self.local, &tls_regions, &shape).await?);
                verify(tls_links, self.local, self.check, &tls_regions, &shape).await?;
            }
        }
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            [lo, v.iter().copied().fold(lo, f64::max)]
        };
        let (g, g_range, c) = (median(ours.clone()), range(&ours), median(ceil));
        let t = (!with_tls.is_empty()).then(|| median(with_tls.clone()));
        Ok(Row {
            block_size: block,
            gib_per_s: g,
            ceiling_gib_per_s: c,
            ratio: g / c,
            gib_per_s_range: g_range,
            tls_gib_per_s: t,
            tls_gib_per_s_range: t.map(|_| range(&with_tls)),
            tls_ratio: t.map(|t| t / g),
        })
    }
}

/// Runs the benchmark.
pub async fn run(args: TransferArgs) -> Result<Report> {
    let plan = Plan::of(&args)?;
    let peers = plan.start_peers(&args)?;
    // The region each session writes: its own peer's with --peer-per-session.
    let regions: Vec<kvbridge::RegionId> = (0..plan.sessions)
        .map(|i| peers[i % peers.len()].region)
        .collect();
    let addrs: Vec<String> = peers.iter().map(|p| p.addr.clone()).collect();
    let local = Region::alloc(plan.window, plan.page)?;
    // Where the read-back of each measurement lands.
    let check = Region::alloc(plan.window, plan.page)?;
    // `_raw_dst` backs the cma destination region: bound first, so dropped after it.
    let (_raw_dst, memcpy_dst) = plan.memcpy_destination()?;
    fill(&local, plan.window, 0)?;
    let links = std::sync::Arc::new(
        connect_sessions(
            plan.sessions,
            plan.transport,
            plan.cma,
            &args.transport,
            &local,
            &check,
            &addrs,
            None,
        )
        .await?,
    );
    let tls_cert = if args.data_tls {
        anyhow::ensure!(
            plan.transport == kvbridge::Transport::Tcp && !plan.cma,
            "--data-tls measures TLS on TCP data connections: use --transport tcp"
        );
        anyhow::ensure!(
            !args.peer_per_session,
            "--data-tls runs against one peer: leave out --peer-per-session"
        );
        Some(super::handshake::TempCert::new()?)
    } else {
        None
    };
    let tls_peer = match &tls_cert {
        Some(cert) => Some(tls_sessions(&plan, &args, cert, &local, &check).await?),
        None => None,
    };

    let bench = Bench {
        args: &args,
        plan: &plan,
        peer: &peers[0],
        links: &links,
        regions: &regions,
        local: &local,
        check: &check,
        memcpy_dst: memcpy_dst.as_ref(),
        tls: tls_peer.as_ref(),
    };
    let mut rows = Vec::new();
    let mut measurement = 0u64;
    for &block in &plan.blocks {
        rows.push(bench.block(block, &mut measurement).await?);
    }
    for (ch, _) in links.iter() {
        ch.close().await;
    }
    if let Some((_, l)) = &tls_peer {
        for (ch, _) in l.iter() {
            ch.close().await;
        }
    }
    Ok(Report {
        transport: args.transport,
        sessions: plan.sessions,
        ceiling: if plan.shm || plan.cma {
            "memcpy"
        } else {
            "socket"
        }
        .into(),
        ucx_tls: plan
            .ucx
            .then(|| std::env::var("UCX_TLS").unwrap_or_else(|_| "(default)".into())),
        pattern: if args.same_offsets {
            "same-offsets"
        } else {
            "scatter"
        }
        .into(),
        results: rows,
    })
}

/// One channel per session (a channel holds one session per peer), session `i` connected to
/// the peer at `addrs[i % addrs.len()]` over `transport`, with `tls` when set.
#[allow(clippy::too_many_arguments)]
async fn connect_sessions(
    sessions: usize,
    transport: kvbridge::Transport,
    cma: bool,
    name: &str,
    local: &Region,
    check: &Region,
    addrs: &[String],
    tls: Option<kvbridge::TlsConfig>,
) -> Result<Vec<(Channel, kvbridge::PeerId)>> {
    let mut links = Vec::with_capacity(sessions);
    for i in 0..sessions {
        let id = if sessions == 1 {
            "bench-initiator".to_string()
        } else {
            format!("bench-initiator-{i}")
        };
        let mut cfg = ChannelConfig::new(&id, None);
        cfg.transport = transport;
        cfg.tls = tls.clone();
        let ch = Channel::new(cfg).await?;
        ch.register(local, Grant::AllPeers)?;
        ch.register(check, Grant::AllPeers)?;
        let target = ch.connect(&addrs[i % addrs.len()]).await?;
        if cma {
            match ch.peer_cma(&target).await? {
                kvbridge::CmaStatus::Active => {}
                kvbridge::CmaStatus::Off(why) => {
                    anyhow::bail!("the session does not use cma: {why}")
                }
            }
        } else {
            if transport == kvbridge::Transport::Ucx {
                // The UCX negotiation follows the session's establishment.
                let until = Instant::now() + UCX_READY_BOUND;
                while ch.peer_transport(&target).await? != transport && Instant::now() < until {
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                }
            }
            anyhow::ensure!(
                ch.peer_transport(&target).await? == transport,
                "the session does not use {name}"
            );
        }
        links.push((ch, target));
    }
    Ok(links)
}

/// How long a UCX session may take to import the peer's regions before the run fails.
const UCX_READY_BOUND: std::time::Duration = std::time::Duration::from_secs(30);

/// Byte `at` of measurement `seed`'s payload: non-zero and different per measurement, so no
/// layer can take a shortcut on zero pages and a write that did not land is seen.
fn payload_byte(at: usize, seed: u64) -> u8 {
    (at.wrapping_mul(31) as u64 + 7 + seed.wrapping_mul(101)) as u8
}

/// Writes measurement `seed`'s payload into the first `len` bytes of `region`, a piece at a
/// time: a copy of the whole window would be one more gigabyte of fresh memory, which on a
/// virtual machine that hands free memory back to its host costs seconds to fault.
fn fill(region: &Region, len: usize, seed: u64) -> Result<()> {
    const PIECE: usize = 4 << 20;
    let mut piece = vec![0u8; PIECE.min(len)];
    for at in (0..len).step_by(PIECE) {
        let p = &mut piece[..PIECE.min(len - at)];
        for (k, b) in p.iter_mut().enumerate() {
            *b = payload_byte(at + k, seed);
        }
        region.write_at(at, p)?;
    }
    Ok(())
}

/// Reads back the span of the peers' regions that `shape`'s writes covered, into `check`
/// (zeroed first), and compares every byte with `local`'s payload: over the first session
/// when every session wrote the same region, else each block from the region of the session
/// that wrote it last (`regions[i]`: session `i`'s).
async fn verify(
    links: &[(Channel, kvbridge::PeerId)],
    local: &Region,
    check: &Region,
    regions: &[kvbridge::RegionId],
    shape: &Shape,
) -> Result<()> {
    let block = shape.block as usize;
    let written_blocks = (shape.total.div_ceil(shape.block * shape.batch as u64) as usize
        * shape.batch)
        .min(shape.per_window);
    let span = written_blocks * block;
    const PIECE: usize = 4 << 20;
    let zero = vec![0u8; PIECE.min(span.max(1))];
    for at in (0..span).step_by(PIECE) {
        check.write_at(at, &zero[..PIECE.min(span - at)])?;
    }
    if regions.iter().all(|r| *r == regions[0]) {
        let (ch, peer) = &links[0];
        let ops: Vec<Op> = (0..span)
            .step_by(PIECE)
            .map(|at| Op {
                local: check.clone(),
                local_offset: at,
                remote: regions[0],
                remote_offset: at as u64,
                len: PIECE.min(span - at),
            })
            .collect();
        for batch in ops.chunks(16) {
            ch.read(peer, batch).await?;
        }
    } else {
        // Replays `write_all`'s slots and split: the session that wrote each slot last.
        let batches = shape.total.div_ceil(shape.block * shape.batch as u64) as usize;
        let part = shape.batch.div_ceil(links.len());
        let mut owner = vec![0usize; shape.per_window];
        for slot in 0..batches * shape.batch {
            owner[slot % shape.per_window] = (slot % shape.batch) / part;
        }
        for (i, (ch, peer)) in links.iter().enumerate() {
            let ops: Vec<Op> = (0..written_blocks)
                .filter(|&b| owner[b] == i)
                .map(|b| Op {
                    local: check.clone(),
                    local_offset: b * block,
                    remote: regions[i],
                    remote_offset: (b * block) as u64,
                    len: block,
                })
                .collect();
            for batch in ops.chunks(16) {
                ch.read(peer, batch).await?;
            }
        }
    }
    let (mut want, mut got) = (vec![0u8; PIECE], vec![0u8; PIECE]);
    for at in (0..span).step_by(PIECE) {
        let n = PIECE.min(span - at);
        local.read_at(at, &mut want[..n])?;
        check.read_at(at, &mut got[..n])?;
        if let Some(k) = (0..n).find(|&k| want[k] != got[k]) {
            anyhow::bail!(
                "byte {} of the peer's region differs after {} B blocks: wrote {}, read back {}",
                at + k,
                shape.block,
                want[k],
                got[k]
            );
        }
    }
    Ok(())
}

/// What one measurement writes.
struct Shape {
    block: u64,
    batch: usize,
    /// Distinct block slots the ops cycle through.
    per_window: usize,
    inflight: usize,
    total: u64,
}

/// Writes `shape.total` bytes to the peers behind `links`, `inflight` batches at a time
/// (each split over the sessions, session `i`'s part to `regions[i]`); GiB/s. Any failed
/// write fails the run.
async fn write_all(
    links: &std::sync::Arc<Vec<(Channel, kvbridge::PeerId)>>,
    local: &Region,
    regions: &[kvbridge::RegionId],
    shape: &Shape,
) -> Result<f64> {
    let block_us = shape.block as usize;
    let batches = shape.total.div_ceil(shape.block * shape.batch as u64) as usize;
    let t = Instant::now();
    let mut next = 0usize;
    let mut slot = 0usize;
    let mut joins = tokio::task::JoinSet::new();
    while next < batches || !joins.is_empty() {
        while next < batches && joins.len() < shape.inflight {
            let ops: Vec<Op> = (0..shape.batch)
                .map(|_| {
                    let i = slot % shape.per_window;
                    slot += 1;
                    Op {
                        local: local.clone(),
                        local_offset: i * block_us,
                        remote: regions[0],
                        remote_offset: (i * block_us) as u64,
                        len: block_us,
                    }
                })
                .collect();
            let (links, regions) = (links.clone(), regions.to_vec());
            joins.spawn(async move {
                if let [(ch, target)] = &links[..] {
                    return Ok(ch.write(target, &ops).await?);
                }
                // Contiguous parts, one per session, written concurrently.
                let part = ops.len().div_ceil(links.len());
                let mut parts = tokio::task::JoinSet::new();
                for (i, ops) in ops.chunks(part).enumerate() {
                    let links = links.clone();
                    let ops: Vec<Op> = ops
                        .iter()
                        .map(|op| Op {
                            remote: regions[i],
                            ..op.clone()
                        })
                        .collect();
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
    let bytes = batches as u64 * shape.block * shape.batch as u64;
    Ok(bytes as f64 / GIB / t.elapsed().as_secs_f64())
}

/// Prints the report as a table.
pub fn print_table(r: &Report, batch: usize) {
    println!(
        "kvbridge bench transfer ({}, {} pattern, {} session(s), ceiling {}), batch {batch}, medians (min-max)",
        r.transport, r.pattern, r.sessions, r.ceiling
    );
    let tls = r.results.iter().any(|row| row.tls_gib_per_s.is_some());
    print!(
        "{:>10} {:>12} {:>13} {:>14} {:>7}",
        "block", "GiB/s", "(min-max)", "ceiling GiB/s", "ratio"
    );
    if tls {
        print!(
            " {:>12} {:>13} {:>9}",
            "TLS GiB/s", "(min-max)", "TLS/plain"
        );
    }
    println!();
    for row in &r.results {
        let [lo, hi] = row.gib_per_s_range;
        print!(
            "{:>10} {:>12.2} {:>13} {:>14.2} {:>7.2}",
            row.block_size,
            row.gib_per_s,
            format!("({lo:.2}-{hi:.2})"),
            row.ceiling_gib_per_s,
            row.ratio
        );
        if let (Some(t), Some([lo, hi]), Some(q)) =
            (row.tls_gib_per_s, row.tls_gib_per_s_range, row.tls_ratio)
        {
            print!(" {t:>12.2} {:>13} {q:>9.2}", format!("({lo:.2}-{hi:.2})"));
        }
        println!();
    }
}
