//! `kvbridge-sim-proxy`: the proxy alone (the same as `kvbridge proxy`), so this crate's tests
//! can run it as a real process next to the engines (the soak kills and restarts it).
#![forbid(unsafe_code)]

use clap::Parser;

/// The PD proxy.
#[derive(Debug, Parser)]
#[command(name = "kvbridge-sim-proxy", version)]
struct Args {
    #[command(flatten)]
    proxy: kvbridge_proxy::cli::ProxyArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kvbridge_proxy::cli::run(Args::parse().proxy).await
}
