//! The `kvbridge` command.

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
    Proxy(kvbridge_proxy::cli::ProxyArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.cmd {
        Cmd::Proxy(args) => rt.block_on(kvbridge_proxy::cli::run(args)),
    }
}
