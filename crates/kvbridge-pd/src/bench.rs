//! `kvbridge bench pd`: prefiller ranks to decoder ranks over real loopback sockets.
//!
//! Each request's KV is written chunk by chunk through the PD sender's zero-copy path
//! ([`crate::Transfer::send_chunk_from`]), then finished (the finish asked for right after
//! `begin`, [`crate::Transfer::prepare_finish`], as the reference engine does); the proxy side (an in-process
//! outcome queue) timestamps every outcome. The same run measures a raw
//! [`kvbridge::Channel`] writing the same bytes with the same page size and batch shape
//! (one chunk per batch, the same requests in flight), so the PD layer's overhead is
//! `1 - kv / channel`. Repetitions alternate raw and PD; medians are reported.
//!
//! With `--tp N` there are N prefiller and N decoder ranks, one channel per rank pair;
//! `--mla-send-once` (MLA only) lets rank 0 send for every rank. With `--prefill-tp P
//! --decode-tp D` the model's `--kv-heads × --tp` KV heads split over P prefiller and D
//! decoder ranks, and each part of the push ([`crate::push_plan`]: the heads one prefiller
//! rank sends one decoder rank) has its own sender, receiver and channel, its chunks packed
//! in the prefiller's memory (one write per chunk and part).

use crate::error::{PdError, PdStep, Result};
use crate::layout::{Dtype, KvLayout, KvSpec};
use crate::outcome::{Outcome, OutcomeSink};
use crate::push_plan::PushPlan;
use crate::receiver::{PdReceiver, ReceiverConfig};
use crate::sender::{DisaggSpec, PdSender, SenderConfig, TransferMode};
use crate::tp_layout::{TpLayout, Translation};
use kvbridge::{Channel, ChannelConfig, Grant, Op, PeerId, Region};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Which KV layout the benchmark moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BenchLayout {
    /// `(layers, 2, tokens, kv_heads, head_dim)`.
    Standard,
    /// `(layers, 1, tokens, latent_dim)`.
    Mla,
}

/// Flags of `kvbridge bench pd`.
#[derive(Debug, Clone, clap::Args)]
pub struct PdBenchArgs {
    /// Requests per repetition.
    #[arg(long, default_value_t = 8)]
    pub requests: usize,
    /// Prompt tokens per request.
    #[arg(long, default_value_t = 4096)]
    pub tokens: u64,
    /// Tokens per chunk (one receive-buffer page, one write batch).
    #[arg(long, default_value_t = 256)]
    pub chunk_tokens: u32,
    /// KV layout.
    #[arg(long, value_enum, default_value_t = BenchLayout::Standard)]
    pub layout: BenchLayout,
    /// Layers (default 32 for standard, 61 for MLA).
    #[arg(long)]
    pub layers: Option<u32>,
    /// KV heads per rank (standard).
    #[arg(long, default_value_t = 8)]
    pub kv_heads: u32,
    /// Head dimension (standard).
    #[arg(long, default_value_t = 128)]
    pub head_dim: u32,
    /// Latent dimension including the rope part (MLA).
    #[arg(long, default_value_t = 576)]
    pub latent_dim: u32,
    /// Element type (fp32, fp16, bf16, fp8).
    #[arg(long, default_value = "bf16")]
    pub dtype: Dtype,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Tensor-parallel ranks (one prefiller and one decoder rank each).
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// MLA only: rank 0 sends the KV once for all ranks; the others only report.
    #[arg(long)]
    pub mla_send_once: bool,
    /// Prefiller ranks, when they differ from the decoder's (default `--tp`): the
    /// `--kv-heads × --tp` KV heads split over each side, one sender and receiver per part
    /// of the push.
    #[arg(long)]
    pub prefill_tp: Option<u32>,
    /// Decoder ranks (default `--tp`); see `--prefill-tp`.
    #[arg(long)]
    pub decode_tp: Option<u32>,
    /// push: the prefiller writes each chunk; pull: it offers each chunk and the decoder
    /// reads it (the raw reference stays a channel write of the same bytes).
    #[arg(long, value_enum, default_value_t = TransferMode::Push)]
    pub mode: TransferMode,
    /// Repetitions (raw channel and PD alternate); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Deadline of each request (and of each raw batch).
    #[arg(long, default_value_t = 60)]
    pub deadline_s: u64,
    /// Print exactly `{"kv_gib_per_s", "channel_gib_per_s", "overhead",
    /// "tail_latency_p50_ms"}` instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl PdBenchArgs {
    /// The KV spec the flags describe.
    pub fn spec(&self) -> KvSpec {
        let layout = match self.layout {
            BenchLayout::Standard => KvLayout::Standard {
                layers: self.layers.unwrap_or(32),
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
            },
            BenchLayout::Mla => KvLayout::Mla {
                layers: self.layers.unwrap_or(61),
                latent_dim: self.latent_dim,
            },
        };
        KvSpec {
            chunk_tokens: self.chunk_tokens,
            ..KvSpec::new(layout, self.dtype)
        }
    }

    /// With `--prefill-tp` or `--decode-tp`: the push between the two sides, checked as
    /// two engines check each other at their first handshake.
    pub fn push_plan(&self) -> Result<Option<PushPlan>> {
        if self.prefill_tp.is_none() && self.decode_tp.is_none() {
            return Ok(None);
        }
        let spec = self.spec();
        let (layers, heads, dim, mla) = match spec.layout {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            } => (layers, kv_heads.saturating_mul(self.tp), head_dim, false),
            KvLayout::Mla { layers, latent_dim } => (layers, 1, latent_dim, true),
        };
        let side = |tp: u32| TpLayout {
            model: "bench-model".into(),
            layers,
            total_kv_heads: heads,
            head_dim: dim,
            mla,
            dtype: spec.dtype,
            block_tokens: spec.chunk_tokens,
            block_order: TpLayout::CHUNK_ORDER.to_vec(),
            tp_rank: 0,
            tp_size: tp,
        };
        let p = side(self.prefill_tp.unwrap_or(self.tp));
        let d = side(self.decode_tp.unwrap_or(self.tp));
        let t = Translation::new(&p, &d).map_err(|e| cfg_err("--prefill-tp/--decode-tp", e))?;
        Ok(Some(
            PushPlan::new(&t).map_err(|e| cfg_err("--prefill-tp/--decode-tp", e))?,
        ))
    }
}

/// One sender and receiver pair: a TP rank (as many on both sides), or a part of a push
/// between different TP sizes. Its chunks are its spec's; `engine` holds one request's.
struct Lane {
    rank: u32,
    world: u32,
    spec: KvSpec,
    engine: Region,
}

/// The lanes of a run and the engine memory each sends from (one request's KV, the same
/// for every request: keys differ by token ids, so nothing is deduplicated).
fn lanes(args: &PdBenchArgs, plan: Option<&PushPlan>) -> Result<Vec<Lane>> {
    let spec = args.spec();
    let specs: Vec<KvSpec> = match plan {
        None => vec![spec; args.tp as usize],
        Some(plan) => plan
            .parts()
            .iter()
            .map(|p| plan.part_spec(p, spec))
            .collect(),
    };
    let world = specs.len() as u32;
    let chunks = spec.chunks_for(args.tokens) as usize;
    let mut lanes = Vec::with_capacity(specs.len());
    for (rank, spec) in specs.into_iter().enumerate() {
        let page = spec.page_bytes() as usize;
        let engine = Region::alloc(chunks * page, page).map_err(|e| cfg_err("engine memory", e))?;
        let pattern: Vec<u8> = (0..page).map(|i| ((i + rank) * 131 % 251) as u8).collect();
        for c in 0..chunks {
            let mut p = pattern.clone();
            let n = p.len().min(8);
            p[..n].copy_from_slice(&(c as u64).to_le_bytes()[..n]);
            engine
                .write_at(c * page, &p)
                .map_err(|e| cfg_err("engine memory", e))?;
        }
        lanes.push(Lane {
            rank: rank as u32,
            world,
            spec,
            engine,
        });
    }
    Ok(lanes)
}

/// What `--json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PdBenchJson {
    /// KV moved through the PD layer per second (median over repetitions).
    pub kv_gib_per_s: f64,
    /// A raw channel writing the same bytes, same page size and batch shape (median).
    pub channel_gib_per_s: f64,
    /// `1 - kv_gib_per_s / channel_gib_per_s`.
    pub overhead: f64,
    /// Median over requests and writing ranks of the time from the last chunk handed over
    /// to the rank's outcome, in milliseconds (median over repetitions).
    pub tail_latency_p50_ms: f64,
}

/// The whole result.
#[derive(Debug, Clone, Serialize)]
pub struct PdBenchReport {
    /// The `--json` figures.
    pub summary: PdBenchJson,
    /// 99th percentile of the same latency (median over repetitions).
    pub tail_latency_p99_ms: f64,
    /// Median over repetitions of the PD wall time of one repetition, in milliseconds.
    pub pd_wall_ms: f64,
    /// Bytes written by all ranks in one repetition (PD).
    pub bytes_per_rep: u64,
    /// KV bytes the decoder ranks need in one repetition (tp × requests × prompt bytes).
    pub kv_bytes_per_rep: u64,
    /// The spec moved.
    pub spec: String,
    /// Ranks (`--tp`).
    pub tp: u32,
    /// Prefiller ranks (`--prefill-tp`, default `--tp`).
    pub prefill_tp: u32,
    /// Decoder ranks (`--decode-tp`, default `--tp`).
    pub decode_tp: u32,
    /// Chunk writes (or offers) per request: one per chunk and writing lane (a rank, or a
    /// part of the push between different TP sizes).
    pub ops_per_request: u64,
    /// Bytes written per request (PD), all lanes.
    pub bytes_per_request: u64,
    /// Whether MLA send-once was on.
    pub mla_send_once: bool,
    /// Push or pull.
    pub mode: TransferMode,
}

impl std::fmt::Display for PdBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.summary;
        writeln!(
            f,
            "PD bench: {} tp={} ({} -> {}) send-once={} mode={}",
            self.spec, self.tp, self.prefill_tp, self.decode_tp, self.mla_send_once, self.mode
        )?;
        writeln!(
            f,
            "  KV through PD     {:8.3} GiB/s   (wall {:.1} ms per repetition)",
            s.kv_gib_per_s, self.pd_wall_ms
        )?;
        writeln!(f, "  raw channel       {:8.3} GiB/s", s.channel_gib_per_s)?;
        writeln!(f, "  overhead          {:8.2} %", s.overhead * 100.0)?;
        writeln!(
            f,
            "  last chunk -> outcome  p50 {:.3} ms  p99 {:.3} ms",
            s.tail_latency_p50_ms, self.tail_latency_p99_ms
        )?;
        writeln!(
            f,
            "  bytes written per repetition {} (KV the decoder ranks need: {})",
            self.bytes_per_rep, self.kv_bytes_per_rep
        )?;
        writeln!(
            f,
            "  per request  {} writes, {} bytes",
            self.ops_per_request, self.bytes_per_request
        )
    }
}

const GIB: f64 = (1u64 << 30) as f64;

fn cfg_err(what: &str, e: impl std::fmt::Display) -> PdError {
    PdError::Config(format!("bench pd: {what}: {e}"))
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Distinct tokens per request and rank-independent (equal prompts on every rank), so no
/// chunk is deduplicated across requests.
fn tokens_of(req: usize, n: u64) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (req as u32).wrapping_mul(1_000_003).wrapping_add(i))
        .collect()
}

/// Outcomes by (request, rank), with their arrival time at the proxy side.
type Outcomes = Arc<Mutex<HashMap<(String, u32), (Instant, Outcome)>>>;

/// The PD side: senders, receivers, the outcome collector.
struct PdSide {
    senders: Vec<Arc<PdSender>>,
    receivers: Vec<Arc<PdReceiver>>,
    ports: Vec<u16>,
    outcomes: Outcomes,
}

/// One raw channel pair, for a lane that writes: the source, its peer, the destination
/// buffer and channel, and the lane's chunks (spec and engine memory).
struct RawPair {
    src: Channel,
    peer: PeerId,
    buf: Region,
    dst: Channel,
    spec: KvSpec,
    engine: Region,
}

/// The raw side: one channel pair per lane that writes.
struct RawSide {
    pairs: Vec<RawPair>,
}

/// Runs the benchmark and prints its result (a table, or the `--json` object).
pub async fn run(args: PdBenchArgs) -> Result<PdBenchReport> {
    let r = measure(&args).await?;
    if args.json {
        let s = serde_json::to_string(&r.summary).map_err(|e| cfg_err("json", e))?;
        println!("{s}");
    } else {
        print!("{r}");
    }
    Ok(r)
}

/// Runs the benchmark and returns its result without printing.
pub async fn measure(args: &PdBenchArgs) -> Result<PdBenchReport> {
    let spec = args.spec();
    spec.validate().map_err(|e| cfg_err("spec", e))?;
    if args.requests == 0 || args.tokens == 0 || args.concurrency == 0 || args.tp == 0 {
        return Err(cfg_err(
            "flags",
            "requests, tokens, concurrency and tp must be > 0",
        ));
    }
    if args.mla_send_once && !spec.layout.is_mla() {
        return Err(cfg_err("flags", "--mla-send-once needs --layout mla"));
    }
    let plan = args.push_plan()?;
    if args.mla_send_once && plan.is_some() {
        return Err(cfg_err(
            "flags",
            "--mla-send-once is for equal TP sizes; between different ones each decoder rank \
             gets the latent once from one prefiller rank already",
        ));
    }
    let lanes = lanes(args, plan.as_ref())?;
    let chunks = spec.chunks_for(args.tokens);
    let conc = args.concurrency.min(args.requests);
    let deadline = Duration::from_secs(args.deadline_s.max(1));

    let pd = pd_side(args, &lanes, conc, chunks, deadline).await?;
    // The lanes that write: all, or rank 0 alone with send-once.
    let writers = if args.mla_send_once {
        &lanes[..1]
    } else {
        &lanes[..]
    };
    let raw = raw_side(writers, conc, chunks).await?;
    let run = Run {
        pd: &pd,
        lanes: &lanes,
        tokens: args.tokens,
        deadline,
    };

    // Warm-up: one request through PD, retrieved and checked byte for byte on every rank
    // that received; one raw batch per pair.
    run.pd_rep(1, 1, usize::MAX / 2, true).await?;
    raw_rep(&raw, args.tokens, 1, 1, deadline).await?;

    let (mut kv, mut ch, mut p50, mut p99, mut wall) = (vec![], vec![], vec![], vec![], vec![]);
    let mut bytes = 0;
    let raw_bytes: u64 = writers
        .iter()
        .map(|l| l.spec.prompt_bytes(args.tokens) * args.requests as u64)
        .sum();
    for rep in 0..args.reps.max(1) {
        let raw_s = raw_rep(&raw, args.tokens, args.requests, conc, deadline).await?;
        ch.push(raw_bytes as f64 / GIB / raw_s);
        let base = rep * args.requests;
        let (secs, written, mut lat) = run.pd_rep(args.requests, conc, base, false).await?;
        bytes = written;
        kv.push(written as f64 / GIB / secs);
        wall.push(secs * 1e3);
        p50.push(percentile(&mut lat, 0.5));
        p99.push(percentile(&mut lat, 0.99));
    }
    let (kv, ch) = (median(&mut kv), median(&mut ch));
    for s in &pd.senders {
        s.close().await;
    }
    for r in &pd.receivers {
        r.close().await;
    }
    for pair in &raw.pairs {
        pair.src.close().await;
        pair.dst.close().await;
    }
    let needed_per_request = match &plan {
        Some(p) => p.decoder_bytes(args.tokens),
        None => args.tp as u64 * spec.prompt_bytes(args.tokens),
    };
    Ok(PdBenchReport {
        summary: PdBenchJson {
            kv_gib_per_s: kv,
            channel_gib_per_s: ch,
            overhead: if ch > 0.0 { 1.0 - kv / ch } else { 0.0 },
            tail_latency_p50_ms: median(&mut p50),
        },
        tail_latency_p99_ms: median(&mut p99),
        pd_wall_ms: median(&mut wall),
        bytes_per_rep: bytes,
        kv_bytes_per_rep: needed_per_request * args.requests as u64,
        spec: spec.to_string(),
        tp: args.tp,
        prefill_tp: plan.as_ref().map_or(args.tp, |p| p.prefiller().tp_size),
        decode_tp: plan.as_ref().map_or(args.tp, |p| p.decoder().tp_size),
        ops_per_request: chunks * writers.len() as u64,
        bytes_per_request: bytes / args.requests as u64,
        mla_send_once: args.mla_send_once,
        mode: args.mode,
    })
}

async fn pd_side(
    args: &PdBenchArgs,
    lanes: &[Lane],
    conc: usize,
    chunks: u64,
    deadline: Duration,
) -> Result<PdSide> {
    let (otx, mut orx) = mpsc::unbounded_channel::<Outcome>();
    let outcomes: Outcomes = Arc::default();
    let sink = outcomes.clone();
    tokio::spawn(async move {
        while let Some(o) = orx.recv().await {
            let now = Instant::now();
            let rank = match &o {
                Outcome::KvReady { rank, .. } | Outcome::KvFailed { rank, .. } => *rank,
                Outcome::ProxyNotif { .. } => 0,
            };
            let mut m = sink.lock().unwrap_or_else(|p| p.into_inner());
            m.insert((o.req_id().to_string(), rank), (now, o));
        }
    });
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    let mut ports = Vec::new();
    for lane in lanes {
        let (rank, spec) = (lane.rank, lane.spec);
        let mut ch = ChannelConfig::new(format!("bench-decode-{rank}"), Some("127.0.0.1:0"));
        ch.deadlines.op = deadline;
        let mut rc = ReceiverConfig::new(ch, rank, spec, conc as u64 * chunks * spec.page_bytes());
        rc.alloc_timeout = deadline;
        rc.ttl = deadline * 2;
        let rx = PdReceiver::start(rc).await?;
        ports.push(
            rx.local_addr()
                .ok_or_else(|| cfg_err("receiver", "no listen address"))?
                .port(),
        );
        receivers.push(Arc::new(rx));
        let mut ch = ChannelConfig::new(format!("bench-prefill-{rank}"), None);
        ch.deadlines.op = deadline;
        let mut sc = SenderConfig::new(ch, rank, lane.world, "bench-model", spec);
        sc.outcomes = OutcomeSink::Queue(otx.clone());
        sc.alloc_deadline = deadline;
        sc.step_deadline = deadline;
        sc.mla_send_once = args.mla_send_once;
        sc.mode = args.mode;
        let tx = PdSender::start(sc).await?;
        tx.register(&lane.engine)?;
        senders.push(Arc::new(tx));
    }
    Ok(PdSide {
        senders,
        receivers,
        ports,
        outcomes,
    })
}

async fn raw_side(writers: &[Lane], conc: usize, chunks: u64) -> Result<RawSide> {
    let mut pairs = Vec::new();
    for lane in writers {
        let w = lane.rank;
        let page = lane.spec.page_bytes() as usize;
        let dst = Channel::new(ChannelConfig::new(
            format!("bench-raw-dst-{w}"),
            Some("127.0.0.1:0"),
        ))
        .await
        .map_err(|e| cfg_err("raw channel", e))?;
        let buf = Region::alloc(conc * chunks as usize * page, page)
            .map_err(|e| cfg_err("raw buffer", e))?;
        dst.register(&buf, Grant::AllPeers)
            .map_err(|e| cfg_err("raw buffer", e))?;
        let src = Channel::new(ChannelConfig::new(format!("bench-raw-src-{w}"), None))
            .await
            .map_err(|e| cfg_err("raw channel", e))?;
        src.register(&lane.engine, Grant::AllPeers)
            .map_err(|e| cfg_err("raw engine memory", e))?;
        let addr = dst
            .local_addr()
            .ok_or_else(|| cfg_err("raw channel", "no listen address"))?;
        let peer = src
            .connect(&addr.to_string())
            .await
            .map_err(|e| cfg_err("raw connect", e))?;
        pairs.push(RawPair {
            src,
            peer,
            buf,
            dst,
            spec: lane.spec,
            engine: lane.engine.clone(),
        });
    }
    Ok(RawSide { pairs })
}

/// `requests` raw requests, `conc` at a time: each writes its chunks one batch of one chunk
/// at a time into its slot of the destination buffer. Returns the wall time in seconds.
async fn raw_rep(
    raw: &RawSide,
    tokens: u64,
    requests: usize,
    conc: usize,
    deadline: Duration,
) -> Result<f64> {
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for pair in &raw.pairs {
        // Every pair moves `requests` requests, as every PD rank does.
        let next = Arc::new(AtomicUsize::new(0));
        for slot in 0..conc {
            let (src, peer, remote) = (pair.src.clone(), pair.peer.clone(), pair.buf.id());
            let next = next.clone();
            let (engine, spec) = (pair.engine.clone(), pair.spec);
            tasks.spawn(async move {
                let page = spec.page_bytes();
                let chunks = spec.chunks_for(tokens);
                loop {
                    let r = next.fetch_add(1, Ordering::Relaxed);
                    if r >= requests {
                        return Ok(());
                    }
                    for i in 0..chunks {
                        let op = Op {
                            local: engine.clone(),
                            local_offset: (i * page) as usize,
                            remote,
                            remote_offset: (slot as u64 * chunks + i) * page,
                            len: spec.chunk_bytes_at(i, tokens) as usize,
                        };
                        match tokio::time::timeout(deadline, src.write(&peer, &[op])).await {
                            Ok(Ok(())) => {}
                            Ok(Err(e)) => {
                                return Err(PdError::Transfer {
                                    req_id: format!("raw-{r}"),
                                    peer: peer.to_string(),
                                    step: PdStep::Write,
                                    source: Box::new(e),
                                })
                            }
                            Err(_) => {
                                return Err(PdError::Timeout {
                                    req_id: format!("raw-{r}"),
                                    peer: peer.to_string(),
                                    step: PdStep::Write,
                                    after: deadline,
                                })
                            }
                        }
                    }
                }
            });
        }
    }
    join_all(tasks).await?;
    Ok(started.elapsed().as_secs_f64())
}

async fn join_all(mut tasks: tokio::task::JoinSet<Result<()>>) -> Result<()> {
    let mut first = Ok(());
    while let Some(r) = tasks.join_next().await {
        let r = r.unwrap_or_else(|e| Err(cfg_err("task", e)));
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// What one PD repetition runs on.
struct Run<'a> {
    pd: &'a PdSide,
    lanes: &'a [Lane],
    tokens: u64,
    deadline: Duration,
}

/// When each request's last chunk was handed to each lane's sender.
type Handed = Arc<Mutex<HashMap<(String, u32), Instant>>>;

impl Run<'_> {
    /// `requests` PD requests numbered from `base`, `conc` at a time, every lane
    /// concurrently. With `check`, each decoder lane that received a request copies it out
    /// and compares it with its engine's bytes (warm-up only); otherwise pages are released
    /// in place. Returns (wall seconds, bytes written, per request and lane latency in ms).
    async fn pd_rep(
        &self,
        requests: usize,
        conc: usize,
        base: usize,
        check: bool,
    ) -> Result<(f64, u64, Vec<f64>)> {
        let (pd, deadline) = (self.pd, self.deadline);
        // Send-once: only decoder rank 0 receives (its sender is the one that writes).
        let holders = if pd.senders.iter().any(|s| s.follows()) {
            1
        } else {
            pd.receivers.len()
        };
        let next = Arc::new(AtomicUsize::new(0));
        let handed: Handed = Arc::default();
        let written = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..conc {
            let next = next.clone();
            let senders = pd.senders.clone();
            let receivers: Vec<_> = pd.receivers[..holders].to_vec();
            let engines: Vec<(Region, KvSpec)> = self
                .lanes
                .iter()
                .map(|l| (l.engine.clone(), l.spec))
                .collect();
            let ports = pd.ports.clone();
            let handed = handed.clone();
            let written = written.clone();
            let tokens = self.tokens;
            tasks.spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= requests {
                        return Ok(());
                    }
                    let req = base + n;
                    let ds = DisaggSpec {
                        req_id: format!("bench-{req}"),
                        receiver_host: "127.0.0.1".into(),
                        receiver_init_port: ports.clone(),
                        receiver_alloc_port: vec![],
                    };
                    let toks = Arc::new(tokens_of(req, tokens));
                    let mut ranks = tokio::task::JoinSet::new();
                    for (tx, (engine, spec)) in senders.iter().zip(&engines) {
                        let lane = LaneSend {
                            tx: tx.clone(),
                            ds: ds.clone(),
                            tokens: toks.clone(),
                            engine: engine.clone(),
                            page: spec.page_bytes() as usize,
                        };
                        ranks.spawn(lane.send(handed.clone(), written.clone(), deadline));
                    }
                    join_all(ranks).await?;
                    for (rx, (engine, spec)) in receivers.iter().zip(&engines) {
                        if check {
                            let got = rx.retrieve(&ds.req_id, deadline).await?;
                            check_kv(&ds.req_id, &got, engine, *spec)?;
                        } else {
                            // The decoder consumes the KV in place: pages return. After an
                            // early finish the request completes when the receiver reads
                            // the last chunk's note, a one-way trip after `KvReady`.
                            rx.wait_complete(&ds.req_id, deadline).await?;
                            rx.release(&ds.req_id)?;
                        }
                    }
                }
            });
        }
        join_all(tasks).await?;
        let secs = started.elapsed().as_secs_f64();
        let handed = handed.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let lat = self.latencies(handed).await?;
        Ok((secs, written.load(Ordering::Relaxed) as u64, lat))
    }

    /// Every outcome must be `KvReady`; latency from the last chunk handed over.
    async fn latencies(&self, handed: HashMap<(String, u32), Instant>) -> Result<Vec<f64>> {
        let mut lat = Vec::new();
        let until = tokio::time::Instant::now() + self.deadline;
        for ((req_id, rank), t0) in handed {
            let got = loop {
                let o = self
                    .pd
                    .outcomes
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&(req_id.clone(), rank));
                if let Some(o) = o {
                    break o;
                }
                if tokio::time::Instant::now() >= until {
                    return Err(PdError::Timeout {
                        req_id,
                        peer: "outcome queue".into(),
                        step: PdStep::Finish,
                        after: self.deadline,
                    });
                }
                tokio::task::yield_now().await;
            };
            match got.1 {
                // Send-once followers report at once; only ranks that wrote count.
                Outcome::KvReady {
                    sent_by: Some(_), ..
                } => {}
                Outcome::KvReady { .. } => {
                    lat.push(got.0.saturating_duration_since(t0).as_secs_f64() * 1e3)
                }
                other => {
                    return Err(PdError::Invalid {
                        req_id,
                        step: PdStep::Finish,
                        detail: format!("rank {rank} reported {other:?}"),
                    })
                }
            }
        }
        Ok(lat)
    }
}

/// One request on one lane: begin, every chunk from the lane's engine memory, finish.
struct LaneSend {
    tx: Arc<PdSender>,
    ds: DisaggSpec,
    tokens: Arc<Vec<u32>>,
    engine: Region,
    page: usize,
}

impl LaneSend {
    async fn send(
        self,
        handed: Handed,
        written: Arc<AtomicUsize>,
        deadline: Duration,
    ) -> Result<()> {
        let LaneSend {
            tx,
            ds,
            tokens,
            engine,
            page,
        } = self;
        let fut = async {
            let mut t = tx.begin(&ds, &tokens).await?;
            // As the reference engine does: the confirmation's round trip runs during the
            // writes (push; a no-op for pull).
            t.prepare_finish().await?;
            let n = t.chunks();
            for i in 0..n {
                if i + 1 == n {
                    let mut h = handed.lock().unwrap_or_else(|p| p.into_inner());
                    h.insert((ds.req_id.clone(), tx.rank()), Instant::now());
                }
                // Push: written (returns once landed). Pull: offered; the decoder reads it
                // while later chunks are offered, and finish waits until every chunk was
                // read.
                t.offer_chunk(i, &engine, i as usize * page).await?;
            }
            let s = t.finish().await?;
            written.fetch_add(s.bytes as usize, Ordering::Relaxed);
            Ok::<(), PdError>(())
        };
        match tokio::time::timeout(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(PdError::Timeout {
                req_id: ds.req_id.clone(),
                peer: "receiver".into(),
                step: PdStep::Finish,
                after: deadline,
            }),
        }
    }
}

/// Compares retrieved chunks with the engine's bytes.
fn check_kv(req_id: &str, got: &[Vec<u8>], engine: &Region, spec: KvSpec) -> Result<()> {
    let page = spec.page_bytes() as usize;
    for (i, c) in got.iter().enumerate() {
        let mut want = vec![0u8; c.len()];
        engine
            .read_at(i * page, &mut want)
            .map_err(|e| cfg_err("engine memory", e))?;
        if *c != want {
            return Err(PdError::Invalid {
                req_id: req_id.into(),
                step: PdStep::Retrieve,
                detail: format!("chunk {i} differs from what the prefiller sent"),
            });
        }
    }
    Ok(())
}
