//! `kvbridge bench digest`: what the integrity digest (`kvbridge::digest`) costs.
//!
//! (a) The candidates' throughput on one thread, at each `--hash-sizes` block size, beside
//! a `memcpy` of the same blocks: XXH3-64 (the chosen one), CRC32C (SSE4.2 where the CPU
//! has it), BLAKE3 keyed, and HMAC-SHA256, each over a buffer of `--hash-bytes` cycled
//! block by block, so that blocks come from memory as landed KV does, not from L1.
//!
//! (b) The goal figure: loads of `--blocks` blocks of `--block-size` bytes read from a peer
//! process over each of `--transports` (one batch of one op per block), unchecked, and
//! checked: the same read, then every block digested and compared with the digest the
//! peer's bytes had when written (computed once before the timing, as a sender would). The
//! two alternate within each round (which goes first alternates too), `--rounds` rounds of
//! `--iters` loads each; medians and spread over the rounds, and the ratio checked /
//! unchecked per round. After every measurement each block is compared with what was
//! written, outside the timing: a load that did not happen fails the run.

use super::peer::PeerProcess;
use super::sample::{median, parse_size};
use anyhow::Result;
use kvbridge::{Channel, ChannelConfig, Grant, Op, Region, RegionId};
use serde::Serialize;
use std::time::{Duration, Instant};

/// Flags of `kvbridge bench digest`.
#[derive(Debug, clap::Args)]
pub struct DigestArgs {
    /// Block sizes of the hash throughput table (K/M/G suffixes allowed).
    #[arg(long, value_delimiter = ',', default_value = "4K,64K,1M")]
    pub hash_sizes: Vec<String>,
    /// Bytes each hash measurement cycles through.
    #[arg(long, default_value = "64M")]
    pub hash_bytes: String,
    /// Transports of the load comparison: tcp, shm, cma, ucx (ucx needs a build with the
    /// `kvbridge` crate's `ucx` feature); none skips it.
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm,cma")]
    pub transports: Vec<String>,
    /// Blocks per load (one op each).
    #[arg(long, default_value_t = 32)]
    pub blocks: usize,
    /// Block size of the loads.
    #[arg(long, default_value = "1M")]
    pub block_size: String,
    /// Loads per measurement.
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Rounds: each measures unchecked and checked loads, alternated.
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Repetitions of each hash measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One candidate at one block size.
#[derive(Debug, Serialize)]
pub struct HashRow {
    /// `xxh3-64`, `crc32c`, `blake3-keyed`, `hmac-sha256` or `memcpy`.
    pub algorithm: String,
    /// Block size in bytes.
    pub block_size: u64,
    /// GiB/s on one thread, median over the repetitions.
    pub gib_per_s: f64,
    /// Lowest and highest repetition.
    pub gib_per_s_range: [f64; 2],
}

/// A figure over the rounds: median and spread.
#[derive(Debug, Serialize)]
pub struct Spread {
    /// Median.
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    fn of(v: &[f64]) -> Spread {
        Spread {
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            median: median(v.to_vec()),
        }
    }
}

/// One transport's loads.
#[derive(Debug, Serialize)]
pub struct LoadRow {
    /// tcp, shm, cma or ucx.
    pub transport: String,
    /// Unchecked loads: ms per load, over the rounds.
    pub unchecked_ms: Spread,
    /// Checked loads (read, then every block digested and compared): ms per load.
    pub checked_ms: Spread,
    /// `checked / unchecked` of each round.
    pub ratio: Spread,
    /// `median(checked) / median(unchecked)`.
    pub ratio_of_medians: f64,
    /// Unchecked GiB/s at the median.
    pub unchecked_gib_per_s: f64,
    /// Checked GiB/s at the median.
    pub checked_gib_per_s: f64,
}

/// The result.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The engine's digest (`kvbridge::digest::ALGORITHM`).
    pub algorithm: String,
    /// The hash table.
    pub hash: Vec<HashRow>,
    /// Blocks per load.
    pub blocks: usize,
    /// Bytes per block.
    pub block_size: u64,
    /// Loads per measurement.
    pub iters: usize,
    /// Rounds.
    pub rounds: usize,
    /// One row per transport.
    pub loads: Vec<LoadRow>,
}

const GIB: f64 = (1u64 << 30) as f64;

impl Report {
    /// The human summary.
    pub fn table(&self) -> String {
        let mut s = format!(
            "kvbridge bench digest: the engine's digest is {}\n(a) one thread, GiB/s, median \
             (min-max) of the repetitions\n",
            self.algorithm
        );
        s += &format!(
            "{:<14} {:>9} {:>9} {:>17}\n",
            "hash", "block", "GiB/s", "(min-max)"
        );
        for r in &self.hash {
            s += &format!(
                "{:<14} {:>9} {:>9.2} {:>17}\n",
                r.algorithm,
                r.block_size,
                r.gib_per_s,
                format!("({:.2}-{:.2})", r.gib_per_s_range[0], r.gib_per_s_range[1])
            );
        }
        s += &format!(
            "(b) loads of {} x {} bytes from a peer process, {} loads per measurement, {} \
             rounds alternated; ms per load, median (min-max) over the rounds\n",
            self.blocks, self.block_size, self.iters, self.rounds
        );
        s += &format!(
            "{:<6} {:>9} {:>17} {:>9} {:>17} {:>7} {:>17} {:>8} {:>8}\n",
            "",
            "unchecked",
            "(min-max)",
            "checked",
            "(min-max)",
            "ratio",
            "(min-max)",
            "GiB/s",
            "chk GiB/s"
        );
        let range = |x: &Spread| format!("({:.2}-{:.2})", x.min, x.max);
        let ratio = |x: &Spread| format!("({:.3}-{:.3})", x.min, x.max);
        for r in &self.loads {
            s += &format!(
                "{:<6} {:>9.2} {:>17} {:>9.2} {:>17} {:>7.3} {:>17} {:>8.2} {:>8.2}\n",
                r.transport,
                r.unchecked_ms.median,
                range(&r.unchecked_ms),
                r.checked_ms.median,
                range(&r.checked_ms),
                r.ratio.median,
                ratio(&r.ratio),
                r.unchecked_gib_per_s,
                r.checked_gib_per_s
            );
        }
        s
    }
}

/// Runs the benchmark.
pub async fn run(args: DigestArgs) -> Result<Report> {
    let sizes = sizes(&args.hash_sizes)?;
    let hash_bytes = parse_size(&args.hash_bytes).map_err(anyhow::Error::msg)? as usize;
    let hash = hash_table(&sizes, hash_bytes, args.reps.max(1))?;
    let block = parse_size(&args.block_size).map_err(anyhow::Error::msg)? as usize;
    anyhow::ensure!(block > 0, "a block size of 0");
    let mut loads = Vec::new();
    for t in args.transports.iter().filter(|t| t.as_str() != "none") {
        loads.push(load_row(&args, t, block).await?);
    }
    Ok(Report {
        algorithm: kvbridge::digest::ALGORITHM.into(),
        hash,
        blocks: args.blocks.max(1),
        block_size: block as u64,
        iters: args.iters.max(1),
        rounds: args.rounds.max(1),
        loads,
    })
}

fn sizes(v: &[String]) -> Result<Vec<u64>> {
    v.iter()
        .map(|s| parse_size(s))
        .collect::<Result<_, _>>()
        .map_err(anyhow::Error::msg)
}

/// A candidate: its name and what it does to one block (`dst`: memcpy's destination).
type Candidate = (&'static str, fn(&[u8], &mut [u8]) -> u64);

fn candidates() -> Vec<Candidate> {
    use hmac::Mac;
    const KEY: [u8; 32] = [0x42; 32];
    vec![
        ("memcpy", |b, dst| {
            dst[..b.len()].copy_from_slice(b);
            dst[0] as u64
        }),
        ("xxh3-64", |b, _| kvbridge::digest::digest(b)),
        ("crc32c", |b, _| crc32c::crc32c(b) as u64),
        ("blake3-keyed", |b, _| {
            let h = blake3::keyed_hash(&KEY, b);
            u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or_default())
        }),
        ("hmac-sha256", |b, _| {
            let mut m = <hmac::Hmac<sha2::Sha256>>::new_from_slice(&KEY).expect("any key");
            m.update(b);
            let t = m.finalize().into_bytes();
            u64::from_le_bytes(t[..8].try_into().unwrap_or_default())
        }),
    ]
}

/// Every candidate at every size: the blocks of a `total`-byte buffer in turn, `reps` times.
fn hash_table(sizes: &[u64], total: usize, reps: usize) -> Result<Vec<HashRow>> {
    let total = total.max(sizes.iter().copied().max().unwrap_or(0) as usize);
    let src: Vec<u8> = (0..total).map(|i| (i * 31 + 7) as u8).collect();
    let mut dst = vec![1u8; total];
    let mut rows = Vec::new();
    for &size in sizes {
        let b = size as usize;
        anyhow::ensure!(b > 0, "a hash block size of 0");
        for (name, f) in candidates() {
            let mut v = Vec::with_capacity(reps);
            let mut sink = 0u64;
            for _ in 0..reps {
                let t = Instant::now();
                for at in (0..=total - b).step_by(b) {
                    sink ^= f(&src[at..at + b], &mut dst[at..at + b]);
                }
                v.push((total / b * b) as f64 / GIB / t.elapsed().as_secs_f64());
            }
            std::hint::black_box(sink);
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            rows.push(HashRow {
                algorithm: name.into(),
                block_size: size,
                gib_per_s: median(v.clone()),
                gib_per_s_range: [lo, v.iter().copied().fold(lo, f64::max)],
            });
        }
    }
    Ok(rows)
}

/// How long a UCX session may take to import the peer's regions.
const UCX_READY_BOUND: Duration = Duration::from_secs(30);

/// A session to a fresh peer process over `transport`, the peer's region holding the
/// pattern, and the blocks' digests as written.
struct Loads {
    ch: Channel,
    peer: kvbridge::PeerId,
    remote: RegionId,
    local: Region,
    expected: Vec<u64>,
    ops: Vec<Op>,
    _peer_process: PeerProcess,
}

async fn connect(transport: &str, n: usize, block: usize) -> Result<Loads> {
    let memfd_off = [("KVBRIDGE_REGION_MEMFD", std::ffi::OsStr::new("0"))];
    let ucx_on = [("KVBRIDGE_TRANSPORT", std::ffi::OsStr::new("ucx"))];
    let (page, bytes) = (block.min(4096), n * block);
    let (p, t) = match transport {
        "cma" => (
            PeerProcess::start_with(bytes, page, &memfd_off, &[])?,
            kvbridge::Transport::Auto,
        ),
        "ucx" => (
            PeerProcess::start_with(bytes, page, &ucx_on, &[])?,
            kvbridge::Transport::Ucx,
        ),
        "tcp" | "shm" => (
            PeerProcess::start_with(bytes, page, &[], &["KVBRIDGE_TRANSPORT"])?,
            kvbridge::Transport::parse(transport).unwrap_or_default(),
        ),
        other => anyhow::bail!("transport {other:?}: tcp, shm, cma or ucx"),
    };
    let mut cfg = ChannelConfig::new("bench-digest", None);
    cfg.transport = t;
    let ch = Channel::new(cfg).await?;
    let local = Region::alloc(bytes, page)?;
    ch.register(&local, Grant::AllPeers)?;
    let peer = ch.connect(&p.addr).await?;
    if transport == "cma" {
        if let kvbridge::CmaStatus::Off(why) = ch.peer_cma(&peer).await? {
            anyhow::bail!("the session does not use cma: {why}");
        }
    } else {
        let until = Instant::now() + UCX_READY_BOUND;
        while ch.peer_transport(&peer).await? != t && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        anyhow::ensure!(
            ch.peer_transport(&peer).await? == t,
            "the session does not use {transport}"
        );
    }
    let ops: Vec<Op> = (0..n)
        .map(|i| Op {
            local: local.clone(),
            local_offset: i * block,
            remote: p.region,
            remote_offset: (i * block) as u64,
            len: block,
        })
        .collect();
    // The sender's side: the blocks written into the peer, and their digests as written.
    let pattern: Vec<u8> = (0..bytes).map(|i| (i * 7 + 3) as u8).collect();
    local.write_at(0, &pattern)?;
    ch.write(&peer, &ops).await?;
    let expected = pattern
        .chunks(block)
        .map(kvbridge::digest::digest)
        .collect();
    local.write_at(0, &vec![0u8; bytes])?;
    Ok(Loads {
        ch,
        peer,
        remote: p.region,
        local,
        expected,
        ops,
        _peer_process: p,
    })
}

impl Loads {
    /// `iters` loads, each checked or not; ms per load.
    async fn measure(&self, iters: usize, checked: bool, block: usize) -> Result<f64> {
        let t = Instant::now();
        for _ in 0..iters {
            self.ch.read(&self.peer, &self.ops).await?;
            if checked {
                // SAFETY: the read has completed and no other transfer targets the local
                // region, whose memory lives as long as `self.local`.
                let landed = unsafe {
                    std::slice::from_raw_parts(self.local.as_ptr(), self.expected.len() * block)
                };
                for (i, (b, want)) in landed.chunks(block).zip(&self.expected).enumerate() {
                    anyhow::ensure!(
                        kvbridge::digest::digest(b) == *want,
                        "block {i} failed its check"
                    );
                }
            }
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / iters as f64;
        self.verify_and_clear(block)?;
        Ok(ms)
    }

    /// Every block as written (outside the timing), then the local region zeroed.
    fn verify_and_clear(&self, block: usize) -> Result<()> {
        let mut got = vec![0u8; self.expected.len() * block];
        self.local.read_at(0, &mut got)?;
        for (i, want) in self.expected.iter().enumerate() {
            let b = &got[i * block..(i + 1) * block];
            anyhow::ensure!(
                kvbridge::digest::digest(b) == *want && b[1] == ((i * block + 1) * 7 + 3) as u8,
                "block {i} of region {} differs after a load",
                self.remote
            );
        }
        self.local.write_at(0, &vec![0u8; got.len()])?;
        Ok(())
    }
}

/// One transport's rounds against its own peer process.
async fn load_row(args: &DigestArgs, transport: &str, block: usize) -> Result<LoadRow> {
    let n = args.blocks.max(1);
    let l = connect(transport, n, block).await?;
    let iters = args.iters.max(1);
    // One untimed load of each: first touch and warm-up.
    l.measure(1, false, block).await?;
    l.measure(1, true, block).await?;
    let (mut u, mut c, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..args.rounds.max(1) {
        let (a, b) = if round % 2 == 0 {
            let a = l.measure(iters, false, block).await?;
            (a, l.measure(iters, true, block).await?)
        } else {
            let b = l.measure(iters, true, block).await?;
            (l.measure(iters, false, block).await?, b)
        };
        u.push(a);
        c.push(b);
        r.push(b / a);
    }
    l.ch.close().await;
    let (um, cm) = (median(u.clone()), median(c.clone()));
    let gib = |ms: f64| (n * block) as f64 / GIB / (ms / 1e3);
    Ok(LoadRow {
        transport: transport.into(),
        unchecked_ms: Spread::of(&u),
        checked_ms: Spread::of(&c),
        ratio: Spread::of(&r),
        ratio_of_medians: cm / um,
        unchecked_gib_per_s: gib(um),
        checked_gib_per_s: gib(cm),
    })
}
