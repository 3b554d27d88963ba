//! The `kvbridge` command.
#![deny(clippy::undocumented_unsafe_blocks)]

mod bench;

/// mimalloc: the proxy allocates per request (headers, JSON bodies), and glibc malloc was the
/// largest user-space cost in its profile.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// kvbridge: KV-cache transfer for disaggregated prefill/decode serving.
#[derive(Debug, Parser)]
#[command(name = "kvbridge", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// OpenAI-compatible disaggregation proxy in front of prefill and decode pools.
    Proxy(Box<kvbridge_proxy::cli::ProxyArgs>),
    /// Reference engine: a deterministic mock LLM serving the OpenAI API over the PD layer.
    Engine(Box<kvbridge_sim::cli::EngineArgs>),
    /// The whole PD path on loopback: proxy, prefillers, decoders, a workload, a summary.
    Demo(Box<kvbridge_sim::demo::DemoArgs>),
    /// Benchmarks (two processes on loopback).
    #[command(subcommand)]
    Bench(BenchCmd),
}

#[derive(Debug, Subcommand)]
enum BenchCmd {
    /// One-sided writes against a plain loopback socket stream (the ceiling), same run.
    Transfer(bench::transfer::TransferArgs),
    /// Connect plus first 4 KiB write, over fresh initiators.
    Handshake(bench::handshake::HandshakeArgs),
    /// PD layer: prefiller to decoder ranks through the PD sender, against a raw channel.
    Pd(kvbridge_pd::bench::PdBenchArgs),
    /// The proxy against the installed peer routers (bench/proxy.sh, medians of runs).
    Proxy(bench::proxy::ProxyBenchArgs),
    /// Notification round trips against a raw loopback TCP ping-pong, same run.
    Notify(bench::notify::NotifyArgs),
    /// An honest peer's notification round trips with and without a flooding peer, same run.
    NotifyFlood(bench::notify_flood::NotifyFloodArgs),
    /// The flooding peer `bench notify-flood` starts (internal).
    #[command(hide = true)]
    Flooder(bench::notify_flood::FlooderArgs),
    /// Reads of N blocks with and without a grant-token window, side by side (TCP).
    Grant(bench::grant::GrantArgs),
    /// The integrity digest: candidates' throughput, and loads checked against unchecked.
    Digest(bench::digest::DigestArgs),
    /// The listener process the other benchmarks start (internal).
    #[command(hide = true)]
    Peer {
        /// Size of the region to register.
        #[arg(long)]
        region_bytes: usize,
        /// Page size of that region.
        #[arg(long, default_value_t = 4096)]
        page: usize,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: String,
        /// Test hook: stall this long before answering a Hello (a listener killed
        /// mid-handshake); prints `HELLO` once one has arrived.
        #[arg(long)]
        welcome_delay_ms: Option<u64>,
        /// Echo notifications and sink bytes back (`bench notify`).
        #[arg(long)]
        echo: bool,
        /// With --echo: busy-wait this long on each notification taken (`bench
        /// notify-flood`).
        #[arg(long, default_value_t = 0)]
        work_us: u64,
        /// With --work-us: sleep instead of a busy wait.
        #[arg(long)]
        work_sleeps: bool,
        /// Also a twin region whose reads are confined to windows, one grant-token window
        /// per this many bytes (`bench grant`).
        #[arg(long)]
        grant_windows: Option<usize>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    {
        use tracing_subscriber::prelude::*;
        let filter =
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
        let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
        let reg = tracing_subscriber::registry().with(fmt.with_filter(filter));
        // `kvbridge demo --timeline` records the per-request timeline marks (only then).
        match &cli.cmd {
            Cmd::Demo(a) if a.timeline => reg.with(kvbridge_sim::timeline::layer()).init(),
            _ => reg.init(),
        }
    }
    match cli.cmd {
        Cmd::Proxy(args) => kvbridge_proxy::cli::main(*args),
        Cmd::Engine(args) => rt()?.block_on(kvbridge_sim::cli::run_engine(*args)),
        Cmd::Demo(args) if args.duration.is_some() => {
            let exe = std::env::current_exe()?.into_os_string();
            let opts = kvbridge_sim::soak::SoakOptions::from_demo_args(
                &args,
                vec![exe.clone(), "engine".into()],
                vec![exe, "proxy".into()],
            )?;
            let s = rt()?.block_on(kvbridge_sim::soak::run(opts))?;
            verdict(args.json, &s, s.table(), s.passed())
        }
        Cmd::Demo(args) if args.peer_router.is_some() => {
            let cmd = args.peer_router.clone().unwrap_or_default();
            let json = args.json;
            let s = rt()?.block_on(kvbridge_sim::peer_router::run(*args, &cmd))?;
            verdict(json, &s, s.table(), s.passed())
        }
        Cmd::Demo(args) => {
            let json = args.json;
            let rt = rt()?;
            // The reference for the KV rate, on the quiet host before the workload.
            let reference = if args.ceiling_reps > 0 {
                let page = kvbridge_sim::demo::page_bytes(&args)?;
                Some(rt.block_on(bench::transfer::at_page_size(page, args.ceiling_reps))?)
            } else {
                None
            };
            let mut s = rt.block_on(kvbridge_sim::demo::run(*args))?;
            if let Some(gib) = reference {
                s.set_bench_transfer(gib);
            }
            verdict(json, &s, s.table(), s.passed())
        }
        Cmd::Bench(cmd) => bench(cmd),
    }
}

/// A runtime for one command, built on demand: the proxy builds its own (one thread by
/// default).
fn rt() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
}

/// `kvbridge bench …`.
fn bench(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Transfer(args) => {
            let (json, batch) = (args.json, args.batch);
            let r = rt()?.block_on(bench::transfer::run(args))?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                bench::transfer::print_table(&r, batch);
            }
            Ok(())
        }
        BenchCmd::Proxy(args) => {
            let b = bench::proxy::run(&args)?;
            if args.json {
                println!("{}", serde_json::to_string(&b)?);
            } else {
                print!("{}", bench::proxy::table(&b));
            }
            Ok(())
        }
        BenchCmd::Pd(args) => {
            rt()?.block_on(kvbridge_pd::bench::run(args))?;
            Ok(())
        }
        BenchCmd::Notify(args) => {
            let json = args.json;
            let r = rt()?.block_on(bench::notify::run(args))?;
            verdict(json, &r, r.table(), true)
        }
        BenchCmd::Grant(args) => {
            let json = args.json;
            let r = rt()?.block_on(bench::grant::run(args))?;
            verdict(json, &r, r.table(), true)
        }
        BenchCmd::Digest(args) => {
            let json = args.json;
            let r = rt()?.block_on(bench::digest::run(args))?;
            verdict(json, &r, r.table(), true)
        }
        BenchCmd::NotifyFlood(args) => {
            let json = args.json;
            let r = rt()?.block_on(bench::notify_flood::run(args))?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                print!("{}", r.table());
            }
            Ok(())
        }
        BenchCmd::Flooder(args) => rt()?.block_on(bench::notify_flood::run_flooder(args)),
        BenchCmd::Handshake(args) => {
            let json = args.json;
            let r = rt()?.block_on(bench::handshake::run(args))?;
            verdict(json, &r, r.table(), true)
        }
        BenchCmd::Peer {
            region_bytes,
            page,
            listen,
            welcome_delay_ms,
            echo,
            work_us,
            work_sleeps,
            grant_windows,
        } => rt()?.block_on(bench::peer::run(bench::peer::PeerOptions {
            region_bytes,
            page,
            listen,
            welcome_delay: welcome_delay_ms.map(std::time::Duration::from_millis),
            echo,
            work: std::time::Duration::from_micros(work_us),
            work_sleeps,
            grant_windows,
        })),
    }
}

/// Prints a run's summary (one JSON object, or its table) and exits non-zero when it failed.
fn verdict(json: bool, summary: &impl serde::Serialize, table: String, passed: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(summary)?);
    } else {
        println!("{table}");
    }
    if !passed {
        std::process::exit(1);
    }
    Ok(())
}
