//! `kvbridge bench grant`: what the owner's check of a grant token costs a read. A second
//! process serves two regions of the same size and contents over TCP: one plain, one whose
//! reads are confined to windows, with one window per block open to a grant token (the
//! shape of a prefiller serving a request's scattered blocks). This side reads the same N
//! blocks from each, one batch of N ops at a time, the two alternating per repetition
//! (which goes first alternates too); the last read of each measurement is compared byte
//! for byte with the pattern (outside the timing), so a read that did not happen fails the
//! run.

use super::peer::PeerProcess;
use super::sample::{median, parse_size};
use anyhow::Result;
use kvbridge::{Channel, ChannelConfig, Grant, GrantToken, Op, PeerId, Region, RegionId};
use serde::Serialize;
use std::time::Instant;

/// Flags of `kvbridge bench grant`.
#[derive(Debug, clap::Args)]
pub struct GrantArgs {
    /// Blocks read per batch (each its own op, each inside its own window).
    #[arg(long, default_value_t = 64)]
    pub blocks: usize,
    /// Block sizes in bytes (K/M/G suffixes allowed), comma separated.
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M")]
    pub block_sizes: Vec<String>,
    /// Batches per measurement.
    #[arg(long, default_value_t = 200)]
    pub iters: usize,
    /// Repetitions (each measures both, alternated); medians are reported.
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One block size's figures.
#[derive(Debug, Serialize)]
pub struct Row {
    /// Block (op) size in bytes.
    pub block_size: u64,
    /// Plain reads: µs per batch, median over the repetitions.
    pub plain_us: f64,
    /// Plain reads: lowest and highest repetition.
    pub plain_us_range: [f64; 2],
    /// Reads under the token: µs per batch, median.
    pub token_us: f64,
    /// Reads under the token: lowest and highest repetition.
    pub token_us_range: [f64; 2],
    /// `token_us / plain_us`.
    pub ratio: f64,
    /// `(token_us - plain_us) / blocks`, ns: the check's cost per op, as far as the noise
    /// lets it show.
    pub per_op_ns: f64,
    /// Plain reads, GiB/s (median batch time).
    pub plain_gib_per_s: f64,
    /// Reads under the token, GiB/s (median batch time).
    pub token_gib_per_s: f64,
}

/// The result.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Blocks per batch, each in its own window.
    pub blocks: usize,
    /// Batches per measurement.
    pub iters: usize,
    /// Repetitions.
    pub reps: usize,
    /// One row per block size.
    pub results: Vec<Row>,
}

impl Report {
    /// The human summary.
    pub fn table(&self) -> String {
        let mut out = format!(
            "kvbridge bench grant: reads of {} blocks per batch over TCP, {} batches per \
             measurement, {} repetitions alternated; medians (min-max), peer in a second \
             process\n",
            self.blocks, self.iters, self.reps
        );
        out += &format!(
            "{:>9} {:>10} {:>17} {:>10} {:>17} {:>6} {:>10} {:>9} {:>9}\n",
            "block",
            "plain µs",
            "(min-max)",
            "token µs",
            "(min-max)",
            "ratio",
            "ns/op",
            "GiB/s",
            "tok GiB/s"
        );
        for r in &self.results {
            let range = |[lo, hi]: [f64; 2]| format!("({lo:.1}-{hi:.1})");
            out += &format!(
                "{:>9} {:>10.1} {:>17} {:>10.1} {:>17} {:>6.3} {:>10.1} {:>9.2} {:>9.2}\n",
                r.block_size,
                r.plain_us,
                range(r.plain_us_range),
                r.token_us,
                range(r.token_us_range),
                r.ratio,
                r.per_op_ns,
                r.plain_gib_per_s,
                r.token_gib_per_s
            );
        }
        out
    }
}

/// One side of the comparison: where to read, and under which token.
struct Side {
    region: RegionId,
    token: Option<GrantToken>,
}

/// Reads the `n` blocks of `block` bytes from `side`, `iters` times; µs per batch. The
/// blocks are read in a fixed scattered order (every seventh, wrapping), as a request's
/// blocks are scattered over the KV cache.
async fn measure(
    ch: &Channel,
    peer: &PeerId,
    local: &Region,
    side: &Side,
    (n, block, iters): (usize, usize, usize),
) -> Result<f64> {
    let ops: Vec<Op> = (0..n)
        .map(|i| Op {
            local: local.clone(),
            local_offset: i * block,
            remote: side.region,
            remote_offset: ((i * 7) % n * block) as u64,
            len: block,
        })
        .collect();
    let t = Instant::now();
    for _ in 0..iters {
        match side.token {
            Some(tok) => ch.read_with_grant(peer, tok, &ops).await?,
            None => ch.read(peer, &ops).await?,
        }
    }
    let us = t.elapsed().as_secs_f64() * 1e6 / iters as f64;
    // The last read is the pattern's blocks, in that order.
    let mut got = vec![0u8; n * block];
    local.read_at(0, &mut got)?;
    for i in 0..n {
        let src = (i * 7) % n * block;
        if let Some(k) = (0..block).find(|&k| got[i * block + k] != ((src + k) * 7 + 3) as u8) {
            anyhow::bail!(
                "block {i} byte {k} differs after a read{}",
                if side.token.is_some() {
                    " under the token"
                } else {
                    ""
                }
            );
        }
    }
    local.write_at(0, &vec![0u8; n * block])?;
    Ok(us)
}

/// The figures of one block size against its own peer process.
async fn block_row(args: &GrantArgs, block: u64) -> Result<Row> {
    let (n, b) = (args.blocks.max(1), block as usize);
    anyhow::ensure!(b > 0, "a block size of 0");
    let p = PeerProcess::start_granting(n * b, b.min(4096), b)?;
    let (region, token) = p
        .grant
        .ok_or_else(|| anyhow::anyhow!("the peer made no windowed region"))?;
    let mut cfg = ChannelConfig::new("bench-grant", None);
    cfg.transport = kvbridge::Transport::Tcp;
    let ch = Channel::new(cfg).await?;
    let local = Region::alloc(n * b, b.min(4096))?;
    ch.register(&local, Grant::AllPeers)?;
    let peer = ch.connect(&p.addr).await?;
    let plain = Side {
        region: p.region,
        token: None,
    };
    let granted = Side {
        region,
        token: Some(token),
    };
    let shape = (n, b, args.iters.max(1));
    // One untimed round of each: first-touch and connection warm-up.
    measure(&ch, &peer, &local, &plain, (n, b, 2)).await?;
    measure(&ch, &peer, &local, &granted, (n, b, 2)).await?;
    let (mut ps, mut ts) = (Vec::new(), Vec::new());
    for rep in 0..args.reps.max(1) {
        if rep % 2 == 0 {
            ps.push(measure(&ch, &peer, &local, &plain, shape).await?);
            ts.push(measure(&ch, &peer, &local, &granted, shape).await?);
        } else {
            ts.push(measure(&ch, &peer, &local, &granted, shape).await?);
            ps.push(measure(&ch, &peer, &local, &plain, shape).await?);
        }
    }
    ch.close().await;
    let range = |v: &[f64]| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        [lo, v.iter().copied().fold(lo, f64::max)]
    };
    let (pm, tm) = (median(ps.clone()), median(ts.clone()));
    let gib = |us: f64| (n * b) as f64 / (1u64 << 30) as f64 / (us / 1e6);
    Ok(Row {
        block_size: block,
        plain_us: pm,
        plain_us_range: range(&ps),
        token_us: tm,
        token_us_range: range(&ts),
        ratio: tm / pm,
        per_op_ns: (tm - pm) * 1e3 / n as f64,
        plain_gib_per_s: gib(pm),
        token_gib_per_s: gib(tm),
    })
}

/// Runs the benchmark.
pub async fn run(args: GrantArgs) -> Result<Report> {
    let blocks: Vec<u64> = args
        .block_sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)?;
    let mut results = Vec::new();
    for block in blocks {
        results.push(block_row(&args, block).await?);
    }
    Ok(Report {
        blocks: args.blocks.max(1),
        iters: args.iters.max(1),
        reps: args.reps.max(1),
        results,
    })
}
