//! `kvbridge bench notify-flood`: an honest peer's notification round trip (notify, then the
//! peer's echo received: `bench notify`'s "notification and reply") with and without a
//! flooding peer at the same listener, phases alternated in one run so both see the same
//! machine.
//!
//! Three processes: the listener (`bench peer --echo`, which echoes the honest peer's
//! notifications and takes a flooder's without answering), this one (the honest peer), and,
//! for each flooded phase, a flooder (`bench flooder`): a peer that posts notifications of
//! `--flood-bytes` from `--flood-tasks` tasks as fast as its sockets take them, started
//! before the phase and stopped after it. A phase counts its samples only once the flooder
//! has posted `--flood-warmup` notes, enough to fill the listener's queue for it.
//!
//! The listener's application spends `--work-us` on each notification it takes (the honest
//! peer's too), so that it takes them more slowly than the flooder sends: the flood then
//! queues up at the listener, where one peer could hold up another. With a faster
//! application nothing queues and the flood costs only CPU. Busy (the default), that work
//! takes a core; with `--work-sleeps` it is spent asleep, so that on a host with few cores
//! the figures show the queueing rather than the application and the flooder taking the
//! CPU the honest peer's threads need.

use super::peer::PeerProcess;
use super::sample::{median, quantile};
use anyhow::{Context, Result};
use kvbridge::{Channel, ChannelConfig};
use serde::Serialize;
use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Flags of `kvbridge bench notify-flood`.
#[derive(Debug, clap::Args)]
pub struct NotifyFloodArgs {
    /// Round trips per phase.
    #[arg(long, default_value_t = 1000)]
    pub samples: usize,
    /// Pairs of phases (quiet, then flooded).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Size of each flood notification (at most the listener's `max_notify_len`, 1 MiB).
    #[arg(long, default_value_t = 1024)]
    pub flood_bytes: usize,
    /// Tasks of the flooder posting notifications at once.
    #[arg(long, default_value_t = 4)]
    pub flood_tasks: usize,
    /// Flood notes posted before a flooded phase starts counting.
    #[arg(long, default_value_t = 4096)]
    pub flood_warmup: u64,
    /// Run the flooder under `nice -n <N>`: on loopback its sending costs the cores the
    /// listener and the honest peer run on, which a flooder on another host would not.
    #[arg(long, default_value_t = 0)]
    pub flood_nice: i32,
    /// The listener application's work on each notification it takes (a busy wait), µs:
    /// while it is slower than the flood, the flood's notifications queue up at the
    /// listener, which is where one peer can hold up another.
    #[arg(long, default_value_t = 20)]
    pub work_us: u64,
    /// The listener application spends its work asleep (an application held up by
    /// something other than this host's CPU, such as a GPU) instead of busy: on a host with
    /// few cores a busy application and the flooder leave the honest peer's threads little
    /// CPU, which is not what is measured here.
    #[arg(long)]
    pub work_sleeps: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One phase's round trips, µs.
#[derive(Debug, Serialize)]
pub struct Phase {
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

impl Phase {
    fn of(v: &[f64]) -> Phase {
        Phase {
            p50_us: quantile(v.to_vec(), 0.5),
            p99_us: quantile(v.to_vec(), 0.99),
        }
    }
}

/// One pair of phases.
#[derive(Debug, Serialize)]
pub struct Run {
    /// No flooder.
    pub quiet: Phase,
    /// A flooder posting meanwhile.
    pub flooded: Phase,
    /// `flooded.p99_us / quiet.p99_us`.
    pub p99_ratio: f64,
    /// Flood notifications the flooder posted per second during the flooded phase.
    pub flood_notes_per_s: f64,
}

/// A figure over the runs: median and spread.
#[derive(Debug, Serialize)]
pub struct Spread {
    /// Median over the runs.
    pub median: f64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    fn of(v: Vec<f64>) -> Spread {
        Spread {
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
            median: median(v),
        }
    }
}

/// The result.
#[derive(Debug, Serialize)]
pub struct Report {
    /// Round trips per phase.
    pub samples: usize,
    /// Size of each flood notification.
    pub flood_bytes: usize,
    /// The flooder's niceness.
    pub flood_nice: i32,
    /// The listener application's work per notification, µs.
    pub work_us: u64,
    /// Whether it spends it asleep.
    pub work_sleeps: bool,
    /// Every run.
    pub runs: Vec<Run>,
    /// Quiet p50 over the runs, µs.
    pub quiet_p50_us: Spread,
    /// Quiet p99 over the runs, µs.
    pub quiet_p99_us: Spread,
    /// Flooded p50 over the runs, µs.
    pub flooded_p50_us: Spread,
    /// Flooded p99 over the runs, µs.
    pub flooded_p99_us: Spread,
    /// Flooded p99 over the same run's quiet p99.
    pub p99_ratio: Spread,
    /// Flood rate over the runs, notifications per second.
    pub flood_notes_per_s: Spread,
}

impl Report {
    /// The human summary.
    pub fn table(&self) -> String {
        let mut s = format!(
            "kvbridge bench notify-flood: {} round trips per phase, {} runs, flood notes of {} \
             bytes, flooder at nice {}, listener work {} µs per notification ({})\n",
            self.samples,
            self.runs.len(),
            self.flood_bytes,
            self.flood_nice,
            self.work_us,
            if self.work_sleeps { "asleep" } else { "busy" }
        );
        for (i, r) in self.runs.iter().enumerate() {
            s += &format!(
                "  run {i}: quiet p50 {:>8.1} p99 {:>8.1} µs | flooded p50 {:>8.1} p99 {:>8.1} \
                 µs | p99 {:.2}x | flood {:.0} notes/s\n",
                r.quiet.p50_us,
                r.quiet.p99_us,
                r.flooded.p50_us,
                r.flooded.p99_us,
                r.p99_ratio,
                r.flood_notes_per_s
            );
        }
        let row = |name: &str, x: &Spread| {
            format!(
                "  {name:<20} median {:>9.2}  (min {:.2}, max {:.2})\n",
                x.median, x.min, x.max
            )
        };
        s += &row("quiet p50 µs", &self.quiet_p50_us);
        s += &row("quiet p99 µs", &self.quiet_p99_us);
        s += &row("flooded p50 µs", &self.flooded_p50_us);
        s += &row("flooded p99 µs", &self.flooded_p99_us);
        s += &row("p99 flooded/quiet", &self.p99_ratio);
        s += &row("flood notes/s", &self.flood_notes_per_s);
        s
    }
}

/// How long one round trip may take before the benchmark gives up.
const SAMPLE_DEADLINE: Duration = Duration::from_secs(5);

/// Runs the benchmark.
pub async fn run(args: NotifyFloodArgs) -> Result<Report> {
    let work = Duration::from_micros(args.work_us);
    let peer = PeerProcess::start_echo_working(work, args.work_sleeps)?;
    let ch = Channel::new(ChannelConfig::new("bench-notify", None)).await?;
    let p = ch.connect(&peer.addr).await?;
    let link = ch.link(&p).await?;
    let n = args.samples.max(1);
    let mut runs = Vec::new();
    for _ in 0..args.runs.max(1) {
        let quiet = round_trips(&ch, &link, n).await?;
        let flooder = Flooder::start(&peer.addr, &args)?;
        let t = Instant::now();
        let flooded = round_trips(&ch, &link, n).await?;
        let elapsed = t.elapsed();
        let posted = flooder.stop()?;
        let (quiet, flooded) = (Phase::of(&quiet), Phase::of(&flooded));
        runs.push(Run {
            p99_ratio: flooded.p99_us / quiet.p99_us,
            quiet,
            flooded,
            flood_notes_per_s: posted.saturating_sub(args.flood_warmup) as f64
                / elapsed.as_secs_f64(),
        });
    }
    ch.close().await;
    let over = |f: fn(&Run) -> f64| Spread::of(runs.iter().map(f).collect());
    Ok(Report {
        samples: n,
        flood_bytes: args.flood_bytes,
        flood_nice: args.flood_nice,
        work_us: args.work_us,
        work_sleeps: args.work_sleeps,
        quiet_p50_us: over(|r| r.quiet.p50_us),
        quiet_p99_us: over(|r| r.quiet.p99_us),
        flooded_p50_us: over(|r| r.flooded.p50_us),
        flooded_p99_us: over(|r| r.flooded.p99_us),
        p99_ratio: over(|r| r.p99_ratio),
        flood_notes_per_s: over(|r| r.flood_notes_per_s),
        runs,
    })
}

/// `n` round trips: a notification, then the listener's echo of it received, µs each.
async fn round_trips(ch: &Channel, link: &kvbridge::PeerLink, n: usize) -> Result<Vec<f64>> {
    let msg = [7u8; 64];
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let q = link.notify_queued(&msg).await?;
        tokio::time::timeout(SAMPLE_DEADLINE, ch.recv_notification())
            .await
            .context("no echo within the deadline")?
            .context("the channel closed")?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
        q.delivered().await?;
    }
    Ok(v)
}

/// A started flooder process (`kvbridge bench flooder`).
struct Flooder {
    child: Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Flooder {
    /// Starts one against `addr` and waits until it has posted its warm-up notes.
    fn start(addr: &str, args: &NotifyFloodArgs) -> Result<Flooder> {
        let exe = std::env::current_exe()?;
        let mut cmd = if args.flood_nice != 0 {
            let mut c = Command::new("nice");
            c.args(["-n", &args.flood_nice.to_string()]).arg(exe);
            c
        } else {
            Command::new(exe)
        };
        let mut child = cmd
            .args(["bench", "flooder", "--addr", addr])
            .args(["--note-bytes", &args.flood_bytes.to_string()])
            .args(["--tasks", &args.flood_tasks.to_string()])
            .args(["--warmup", &args.flood_warmup.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start the flooder process")?;
        let mut out = std::io::BufReader::new(child.stdout.take().context("no stdout")?);
        let mut line = String::new();
        out.read_line(&mut line)?;
        anyhow::ensure!(line.trim() == "FLOODING", "the flooder said {line:?}");
        Ok(Flooder { child, out })
    }

    /// Stops it; how many notes it posted.
    fn stop(mut self) -> Result<u64> {
        drop(self.child.stdin.take());
        let mut line = String::new();
        self.out.read_line(&mut line)?;
        let _ = self.child.wait();
        line.trim()
            .strip_prefix("POSTED ")
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("the flooder said {line:?}"))
    }
}

impl Drop for Flooder {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Flags of the flooder process (`kvbridge bench flooder`, internal).
#[derive(Debug, clap::Args)]
pub struct FlooderArgs {
    /// The listener to flood.
    #[arg(long)]
    pub addr: String,
    /// Size of each notification.
    #[arg(long)]
    pub note_bytes: usize,
    /// Tasks posting at once.
    #[arg(long)]
    pub tasks: usize,
    /// Notes posted before it says `FLOODING`.
    #[arg(long)]
    pub warmup: u64,
}

/// The flooder: posts notifications to `addr` until its stdin closes, then prints
/// `POSTED <count>`. Its peer id starts with `flood`, so the echo listener does not answer.
pub async fn run_flooder(args: FlooderArgs) -> Result<()> {
    let ch = Channel::new(ChannelConfig::new("flood-0", None)).await?;
    let p = ch.connect(&args.addr).await?;
    let link = ch.link(&p).await?;
    let posted = Arc::new(AtomicU64::new(0));
    let warm = Arc::new(tokio::sync::Notify::new());
    for _ in 0..args.tasks.max(1) {
        let (link, posted, warm) = (link.clone(), posted.clone(), warm.clone());
        let note = vec![0xF1u8; args.note_bytes];
        let warmup = args.warmup;
        tokio::spawn(async move {
            while link.notify_posted(&note).await.is_ok() {
                if posted.fetch_add(1, Ordering::Relaxed) + 1 == warmup {
                    warm.notify_one();
                }
            }
        });
    }
    if args.warmup > 0 {
        warm.notified().await;
    }
    println!("FLOODING");
    std::io::stdout().flush()?;
    tokio::task::spawn_blocking(|| {
        let mut b = [0u8; 64];
        while matches!(std::io::Read::read(&mut std::io::stdin(), &mut b), Ok(n) if n > 0) {}
    })
    .await?;
    println!("POSTED {}", posted.load(Ordering::Relaxed));
    std::io::stdout().flush()?;
    ch.close().await;
    Ok(())
}
