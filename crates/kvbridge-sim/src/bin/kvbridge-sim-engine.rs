//! `kvbridge-sim-engine`: the reference engine alone (the same as `kvbridge engine`), so this
//! crate's tests can run engines as real processes.
#![forbid(unsafe_code)]

use clap::Parser;

/// The reference engine (a deterministic mock LLM over the PD layer).
#[derive(Debug, Parser)]
#[command(name = "kvbridge-sim-engine", version)]
struct Args {
    #[command(flatten)]
    engine: kvbridge_sim::cli::EngineArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvbridge_sim::cli::run_engine(Args::parse().engine).await
}
