//! OpenAI-compatible disaggregation proxy (placeholder until the proxy issue lands).

/// Command-line entry points of `kvbridge proxy`.
pub mod cli {
    /// Flags of `kvbridge proxy`.
    #[derive(Debug, clap::Args)]
    pub struct ProxyArgs {}

    /// Runs the proxy until it is shut down.
    pub async fn run(_args: ProxyArgs) -> anyhow::Result<()> {
        anyhow::bail!("kvbridge proxy is not built yet")
    }
}
