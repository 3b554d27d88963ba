//! PD configuration: a TOML file, then environment variables, then command-line overrides.
//!
//! Keys are LMCache's names where the setting means the same (`pd_role`, `pd_buffer_size`,
//! `pd_peer_host`, `pd_peer_init_port`, `pd_peer_alloc_port`, `pd_proxy_host`,
//! `pd_proxy_port`, `chunk_size`, `pd_allocation_timeout_sec`); the short kvbridge names
//! (`role`, `buffer_size`, ...) are accepted as aliases. Environment: `KVBRIDGE_PD_<KEY>`
//! or `LMCACHE_<KEY>` (upper case, e.g. `LMCACHE_PD_BUFFER_SIZE=1073741824`). Command line:
//! `--pd-set key=value` (repeatable). Later sources win. Values are TOML scalars; a comma
//! list (`7001,7002`) is a list; a port list may also be a single number.

use crate::error::PdError;
use crate::layout::{Dtype, KvLayout, KvSpec, DEFAULT_CHUNK_TOKENS};
use serde::{Deserialize, Deserializer};
use std::time::Duration;

/// How chunks move from the sender to the receiver.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum TransferMode {
    /// The sender writes each chunk into the page the receiver reserved (one-sided write).
    #[default]
    Push,
    /// The sender offers each chunk in its registered memory; the receiver reads it into
    /// its page (one-sided read) and says when the sender may reuse that memory.
    Pull,
}

impl std::fmt::Display for TransferMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransferMode::Push => "push",
            TransferMode::Pull => "pull",
        })
    }
}

impl std::str::FromStr for TransferMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "push" => Ok(TransferMode::Push),
            "pull" => Ok(TransferMode::Pull),
            o => Err(format!("transfer mode {o:?}: expected push or pull")),
        }
    }
}

/// Which side of the PD pair this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Prefiller: writes KV.
    Sender,
    /// Decoder: holds the paged buffer.
    Receiver,
}

fn one_or_many<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u16>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(u16),
        Many(Vec<u16>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(p) => vec![p],
        OneOrMany::Many(v) => v,
    })
}

/// The PD settings of one process.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct PdConfig {
    /// `sender` or `receiver`.
    #[serde(alias = "role")]
    pub pd_role: Option<Role>,
    /// Receiver buffer size in bytes.
    #[serde(alias = "buffer_size")]
    pub pd_buffer_size: u64,
    /// Receiver host (sender side) or bind host (receiver side).
    #[serde(alias = "peer_host")]
    pub pd_peer_host: String,
    /// Receiver channel port per rank.
    #[serde(alias = "peer_init_port", deserialize_with = "one_or_many")]
    pub pd_peer_init_port: Vec<u16>,
    /// LMCache's allocation port per rank (accepted; kvbridge allocates over the channel).
    #[serde(alias = "peer_alloc_port", deserialize_with = "one_or_many")]
    pub pd_peer_alloc_port: Vec<u16>,
    /// The proxy's ZMQ PULL host.
    #[serde(alias = "proxy_host")]
    pub pd_proxy_host: Option<String>,
    /// The proxy's ZMQ PULL port.
    #[serde(alias = "proxy_port")]
    pub pd_proxy_port: Option<u16>,
    /// Tokens per chunk.
    #[serde(alias = "chunk_tokens")]
    pub chunk_size: u32,
    /// How long an allocation may wait for pages, in seconds.
    #[serde(alias = "alloc_timeout_sec")]
    pub pd_allocation_timeout_sec: f64,
    /// TTL of a request's pages, in seconds.
    pub ttl_sec: f64,
    /// Model name (part of chunk keys).
    pub model: String,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// This process's rank.
    pub rank: u32,
    /// Layers.
    pub layers: u32,
    /// KV heads per rank (standard layout).
    pub kv_heads: u32,
    /// Head dimension (standard layout).
    pub head_dim: u32,
    /// Latent dimension; set (> 0) for an MLA layout.
    pub latent_dim: u32,
    /// `fp32`, `fp16`, `bf16` or `fp8`.
    pub dtype: String,
    /// MLA only: rank 0 sends the KV once for all ranks ([`crate::SenderConfig::mla_send_once`]).
    pub mla_send_once: bool,
    /// Receiver: seconds a sender may take to acknowledge a fence before it is disconnected.
    pub fence_timeout_sec: f64,
    /// Sender: `push` (write into the receiver's pages) or `pull` (the receiver reads).
    #[serde(alias = "transfer_mode")]
    pub pd_transfer_mode: TransferMode,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            pd_role: None,
            pd_buffer_size: 1 << 30,
            pd_peer_host: "127.0.0.1".into(),
            pd_peer_init_port: Vec::new(),
            pd_peer_alloc_port: Vec::new(),
            pd_proxy_host: None,
            pd_proxy_port: None,
            chunk_size: DEFAULT_CHUNK_TOKENS,
            pd_allocation_timeout_sec: 10.0,
            ttl_sec: 60.0,
            model: "model".into(),
            world_size: 1,
            rank: 0,
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            latent_dim: 0,
            dtype: "bf16".into(),
            mla_send_once: false,
            fence_timeout_sec: 10.0,
            pd_transfer_mode: TransferMode::Push,
        }
    }
}

/// Command-line overrides (flatten into a clap parser).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PdConfigArgs {
    /// PD config file (TOML).
    #[arg(long = "pd-config")]
    pub pd_config: Option<std::path::PathBuf>,
    /// Override one PD setting, `key=value` (LMCache names accepted); repeatable.
    #[arg(long = "pd-set", value_name = "KEY=VALUE")]
    pub pd_set: Vec<String>,
}

/// A string from the environment or the command line as a TOML value.
fn parse_value(v: &str) -> toml::Value {
    let v = v.trim();
    if v.contains(',') {
        return toml::Value::Array(v.split(',').map(parse_value).collect());
    }
    if let Ok(i) = v.parse::<i64>() {
        return toml::Value::Integer(i);
    }
    if let Ok(f) = v.parse::<f64>() {
        return toml::Value::Float(f);
    }
    match v {
        "true" | "True" => toml::Value::Boolean(true),
        "false" | "False" => toml::Value::Boolean(false),
        _ => toml::Value::String(v.to_string()),
    }
}

impl PdConfig {
    /// Builds the configuration from a TOML text, environment pairs and `key=value`
    /// overrides, in that order of precedence (later wins).
    pub fn from_sources(
        toml_text: Option<&str>,
        env: impl IntoIterator<Item = (String, String)>,
        overrides: &[String],
    ) -> Result<PdConfig, PdError> {
        let mut table: toml::Table = match toml_text {
            Some(t) => toml::from_str(t).map_err(|e| PdError::Config(format!("PD config: {e}")))?,
            None => toml::Table::new(),
        };
        for (k, v) in env {
            let key = if let Some(k) = k.strip_prefix("KVBRIDGE_PD_") {
                k.to_ascii_lowercase()
            } else if let Some(k) = k.strip_prefix("LMCACHE_") {
                k.to_ascii_lowercase()
            } else {
                continue;
            };
            table.insert(key, parse_value(&v));
        }
        for o in overrides {
            let (k, v) = o
                .split_once('=')
                .ok_or_else(|| PdError::Config(format!("--pd-set {o:?}: expected key=value")))?;
            table.insert(k.trim().to_string(), parse_value(v));
        }
        PdConfig::deserialize(toml::Value::Table(table))
            .map_err(|e| PdError::Config(format!("PD config: {e}")))
    }

    /// Reads the file named by `args` (if any), this process's environment and the `--pd-set`
    /// overrides.
    pub fn load(args: &PdConfigArgs) -> Result<PdConfig, PdError> {
        let text = match &args.pd_config {
            Some(p) => Some(std::fs::read_to_string(p).map_err(|e| {
                PdError::Config(format!("cannot read PD config {}: {e}", p.display()))
            })?),
            None => None,
        };
        PdConfig::from_sources(text.as_deref(), std::env::vars(), &args.pd_set)
    }

    /// The KV spec these settings describe.
    pub fn spec(&self) -> Result<KvSpec, PdError> {
        let dtype: Dtype = self.dtype.parse().map_err(PdError::Config)?;
        let layout =
            KvLayout::from_dims(self.layers, self.kv_heads, self.head_dim, self.latent_dim);
        let spec = KvSpec {
            layout,
            dtype,
            chunk_tokens: self.chunk_size,
        };
        spec.validate().map_err(PdError::Config)?;
        Ok(spec)
    }

    /// The allocation wait.
    pub fn alloc_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.pd_allocation_timeout_sec.clamp(0.0, 1e6))
    }

    /// The TTL.
    pub fn ttl(&self) -> Duration {
        Duration::from_secs_f64(self.ttl_sec.clamp(0.0, 1e6))
    }

    /// The fence acknowledgement deadline.
    pub fn fence_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.fence_timeout_sec.clamp(0.0, 1e6))
    }

    /// The proxy's `tcp://host:port`, when both are set.
    pub fn proxy_endpoint(&self) -> Option<String> {
        match (&self.pd_proxy_host, self.pd_proxy_port) {
            (Some(h), Some(p)) => Some(format!("tcp://{h}:{p}")),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_then_env_then_cli() {
        let file = r#"
            pd_role = "receiver"
            pd_buffer_size = 2048
            pd_peer_init_port = [7001, 7002]
            chunk_size = 128
            enable_pd = true  # other LMCache keys are ignored
        "#;
        let env = vec![
            ("LMCACHE_PD_BUFFER_SIZE".to_string(), "4096".to_string()),
            ("KVBRIDGE_PD_PROXY_HOST".to_string(), "10.0.0.1".to_string()),
            ("HOME".to_string(), "/root".to_string()),
        ];
        let c = PdConfig::from_sources(
            Some(file),
            env,
            &[
                "pd_proxy_port=7500".into(),
                "pd_peer_alloc_port=7100".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.pd_role, Some(Role::Receiver));
        assert_eq!(c.pd_buffer_size, 4096);
        assert_eq!(c.pd_peer_init_port, vec![7001, 7002]);
        assert_eq!(c.pd_peer_alloc_port, vec![7100]);
        assert_eq!(c.chunk_size, 128);
        assert_eq!(c.proxy_endpoint().as_deref(), Some("tcp://10.0.0.1:7500"));
        assert_eq!(c.spec().unwrap().chunk_tokens, 128);
    }

    #[test]
    fn short_aliases_lists_and_errors() {
        let c = PdConfig::from_sources(
            None,
            vec![("KVBRIDGE_PD_PEER_INIT_PORT".into(), "1,2,3".into())],
            &[
                "role=sender".into(),
                "latent_dim=576".into(),
                "dtype=fp8".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.pd_peer_init_port, vec![1, 2, 3]);
        assert_eq!(c.pd_role, Some(Role::Sender));
        assert!(c.spec().unwrap().layout.is_mla());
        assert!(PdConfig::from_sources(None, vec![], &["nonsense".into()]).is_err());
        assert!(PdConfig::from_sources(None, vec![], &["pd_role=both".into()]).is_err());
        assert!(PdConfig::from_sources(Some("pd_buffer_size = "), vec![], &[]).is_err());
        let c = PdConfig::from_sources(None, vec![], &["dtype=int4".into()]).unwrap();
        assert!(c.spec().is_err());
        let c = PdConfig::from_sources(Some("pd_transfer_mode = \"pull\""), vec![], &[]).unwrap();
        assert_eq!(c.pd_transfer_mode, TransferMode::Pull);
        let c = PdConfig::from_sources(
            None,
            vec![("KVBRIDGE_PD_TRANSFER_MODE".into(), "pull".into())],
            &[],
        )
        .unwrap();
        assert_eq!(c.pd_transfer_mode, TransferMode::Pull);
        assert!(
            PdConfig::from_sources(None, vec![], &["pd_transfer_mode=sideways".into()]).is_err()
        );
    }
}
