//! KV layouts and every byte-size computation of the PD layer.
//!
//! A KV *chunk* is `chunk_tokens` consecutive tokens of one request on one rank, laid out as
//! `(layers, 2, tokens, kv_heads, head_dim)` for ordinary attention or
//! `(layers, 1, tokens, latent_dim)` for MLA. The last chunk of a prompt is usually partial.
//! One receive-buffer page holds one full chunk. Nothing else in the crate multiplies
//! dimensions: ask a [`KvSpec`].

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float.
    Fp32,
    /// 16-bit float.
    Fp16,
    /// bfloat16.
    Bf16,
    /// 8-bit float (e4m3 or e5m2; the PD layer only moves bytes).
    Fp8,
}

impl Dtype {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            Dtype::Fp32 => 4,
            Dtype::Fp16 | Dtype::Bf16 => 2,
            Dtype::Fp8 => 1,
        }
    }

    /// The lowercase name (`fp32`, `fp16`, `bf16`, `fp8`).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::Fp32 => "fp32",
            Dtype::Fp16 => "fp16",
            Dtype::Bf16 => "bf16",
            Dtype::Fp8 => "fp8",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Dtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "float32" | "float" => Ok(Dtype::Fp32),
            "fp16" | "float16" | "half" => Ok(Dtype::Fp16),
            "bf16" | "bfloat16" => Ok(Dtype::Bf16),
            "fp8" | "float8" | "fp8_e4m3" | "fp8_e5m2" => Ok(Dtype::Fp8),
            other => Err(format!(
                "unknown dtype {other:?} (expected fp32, fp16, bf16 or fp8)"
            )),
        }
    }
}

/// The shape of one rank's KV cache, without the token dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum KvLayout {
    /// Ordinary attention: `(layers, 2, tokens, kv_heads, head_dim)` (K and V).
    Standard {
        /// Transformer layers.
        layers: u32,
        /// KV heads on this rank.
        kv_heads: u32,
        /// Head dimension.
        head_dim: u32,
    },
    /// Multi-head latent attention: `(layers, 1, tokens, latent_dim)`, identical on every
    /// tensor-parallel rank.
    Mla {
        /// Transformer layers.
        layers: u32,
        /// Latent dimension (including the rope part).
        latent_dim: u32,
    },
}

impl KvLayout {
    /// The layout that configuration-style dimensions describe: MLA when `latent_dim` is
    /// set (> 0), standard attention otherwise.
    pub fn from_dims(layers: u32, kv_heads: u32, head_dim: u32, latent_dim: u32) -> KvLayout {
        if latent_dim > 0 {
            KvLayout::Mla { layers, latent_dim }
        } else {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            }
        }
    }

    /// An 8B-class model: 32 layers, 8 KV heads, head dim 128.
    pub const LLAMA_8B: KvLayout = KvLayout::Standard {
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
    };

    /// Elements per token.
    pub const fn elems_per_token(&self) -> u64 {
        match *self {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            } => layers as u64 * 2 * kv_heads as u64 * head_dim as u64,
            KvLayout::Mla { layers, latent_dim } => layers as u64 * latent_dim as u64,
        }
    }

    /// Whether this is MLA (the same KV on every rank).
    pub const fn is_mla(&self) -> bool {
        matches!(self, KvLayout::Mla { .. })
    }

    /// The tensor shape of `tokens` tokens.
    pub fn shape(&self, tokens: u64) -> Vec<u64> {
        match *self {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            } => vec![layers as u64, 2, tokens, kv_heads as u64, head_dim as u64],
            KvLayout::Mla { layers, latent_dim } => {
                vec![layers as u64, 1, tokens, latent_dim as u64]
            }
        }
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            } => write!(f, "standard({layers}, 2, t, {kv_heads}, {head_dim})"),
            KvLayout::Mla { layers, latent_dim } => write!(f, "mla({layers}, 1, t, {latent_dim})"),
        }
    }
}

/// Default tokens per chunk (LMCache's `chunk_size`).
pub const DEFAULT_CHUNK_TOKENS: u32 = 256;

/// Layout, dtype and chunk size: everything both sides must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KvSpec {
    /// Tensor layout.
    pub layout: KvLayout,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens per full chunk (> 0).
    pub chunk_tokens: u32,
}

impl fmt::Display for KvSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} chunk {} tokens",
            self.layout, self.dtype, self.chunk_tokens
        )
    }
}

impl KvSpec {
    /// A spec with the default chunk size.
    pub const fn new(layout: KvLayout, dtype: Dtype) -> Self {
        Self {
            layout,
            dtype,
            chunk_tokens: DEFAULT_CHUNK_TOKENS,
        }
    }

    /// The benchmark default: [`KvLayout::LLAMA_8B`] in bf16 (128 KiB per token).
    pub const fn llama_8b() -> Self {
        Self::new(KvLayout::LLAMA_8B, Dtype::Bf16)
    }

    /// Checks that no dimension is zero and that a full chunk's size fits in memory.
    pub fn validate(&self) -> Result<(), String> {
        let zero = match self.layout {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            } => layers == 0 || kv_heads == 0 || head_dim == 0,
            KvLayout::Mla { layers, latent_dim } => layers == 0 || latent_dim == 0,
        };
        if zero || self.chunk_tokens == 0 {
            return Err(format!("KV spec {self} has a zero dimension"));
        }
        let dims: u128 = match self.layout {
            KvLayout::Standard {
                layers,
                kv_heads,
                head_dim,
            } => layers as u128 * 2 * kv_heads as u128 * head_dim as u128,
            KvLayout::Mla { layers, latent_dim } => layers as u128 * latent_dim as u128,
        };
        if dims * self.dtype.size() as u128 * self.chunk_tokens as u128 > 1 << 40 {
            return Err(format!("KV spec {self}: a chunk is larger than 1 TiB"));
        }
        Ok(())
    }

    /// Bytes of KV per token.
    pub const fn bytes_per_token(&self) -> u64 {
        self.layout.elems_per_token() * self.dtype.size()
    }

    /// Bytes of a chunk of `tokens` tokens.
    pub const fn chunk_bytes(&self, tokens: u32) -> u64 {
        self.bytes_per_token() * tokens as u64
    }

    /// Bytes of a full chunk: the receive buffer's page size.
    pub const fn page_bytes(&self) -> u64 {
        self.chunk_bytes(self.chunk_tokens)
    }

    /// Chunks of a prompt of `tokens` tokens (a partial last chunk counts; 0 tokens, 0 chunks).
    pub const fn chunks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.chunk_tokens as u64)
    }

    /// Tokens in chunk `index` of a prompt of `tokens` tokens (0 past the end).
    pub fn tokens_in_chunk(&self, index: u64, tokens: u64) -> u32 {
        let start = index.saturating_mul(self.chunk_tokens as u64);
        tokens.saturating_sub(start).min(self.chunk_tokens as u64) as u32
    }

    /// Tokens in the last chunk of a prompt of `tokens` tokens (0 for an empty prompt).
    pub fn last_chunk_tokens(&self, tokens: u64) -> u32 {
        match self.chunks_for(tokens) {
            0 => 0,
            n => self.tokens_in_chunk(n - 1, tokens),
        }
    }

    /// Bytes of chunk `index` of a prompt of `tokens` tokens.
    pub fn chunk_bytes_at(&self, index: u64, tokens: u64) -> u64 {
        self.chunk_bytes(self.tokens_in_chunk(index, tokens))
    }

    /// Bytes of KV of a whole prompt of `tokens` tokens.
    pub const fn prompt_bytes(&self, tokens: u64) -> u64 {
        self.bytes_per_token() * tokens
    }

    /// Pages of a receive buffer of `buffer_bytes` bytes (whole pages only).
    pub const fn pages_in(&self, buffer_bytes: u64) -> u64 {
        buffer_bytes / self.page_bytes()
    }

    /// The tensor shape of chunk `index` of a prompt of `tokens` tokens.
    pub fn chunk_shape(&self, index: u64, tokens: u64) -> Vec<u64> {
        self.layout
            .shape(self.tokens_in_chunk(index, tokens) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_8b_is_128_kib_per_token() {
        let s = KvSpec::llama_8b();
        assert_eq!(s.bytes_per_token(), 128 << 10);
        assert_eq!(s.page_bytes(), 32 << 20);
        assert_eq!(s.chunk_tokens, 256);
    }

    #[test]
    fn dtypes() {
        let l = KvLayout::Standard {
            layers: 2,
            kv_heads: 3,
            head_dim: 4,
        };
        for (d, sz) in [
            (Dtype::Fp32, 4),
            (Dtype::Fp16, 2),
            (Dtype::Bf16, 2),
            (Dtype::Fp8, 1),
        ] {
            assert_eq!(KvSpec::new(l, d).bytes_per_token(), 2 * 2 * 3 * 4 * sz);
            assert_eq!(d.name().parse::<Dtype>().unwrap(), d);
        }
        assert!("int4".parse::<Dtype>().is_err());
    }

    #[test]
    fn mla_has_one_latent_per_layer_and_token() {
        let s = KvSpec::new(
            KvLayout::Mla {
                layers: 61,
                latent_dim: 576,
            },
            Dtype::Bf16,
        );
        assert_eq!(s.bytes_per_token(), 61 * 576 * 2);
        assert_eq!(s.chunk_shape(0, 10), vec![61, 1, 10, 576]);
        assert!(s.layout.is_mla());
    }

    #[test]
    fn partial_last_chunk() {
        let s = KvSpec {
            chunk_tokens: 256,
            ..KvSpec::llama_8b()
        };
        assert_eq!(s.chunks_for(0), 0);
        assert_eq!(s.last_chunk_tokens(0), 0);
        assert_eq!(s.chunks_for(1), 1);
        assert_eq!(s.last_chunk_tokens(1), 1);
        assert_eq!(s.chunks_for(256), 1);
        assert_eq!(s.last_chunk_tokens(256), 256);
        assert_eq!(s.chunks_for(257), 2);
        assert_eq!(s.last_chunk_tokens(257), 1);
        assert_eq!(s.tokens_in_chunk(0, 257), 256);
        assert_eq!(s.tokens_in_chunk(2, 257), 0);
        assert_eq!(s.chunk_bytes_at(1, 257), 128 << 10);
        assert_eq!(s.chunk_shape(1, 300), vec![32, 2, 44, 8, 128]);
        // The chunks add up to the prompt.
        for tokens in [1u64, 255, 256, 257, 1000, 4096] {
            let sum: u64 = (0..s.chunks_for(tokens))
                .map(|i| s.chunk_bytes_at(i, tokens))
                .sum();
            assert_eq!(sum, s.prompt_bytes(tokens));
        }
    }

    #[test]
    fn validate_rejects_zero_and_huge() {
        let mut s = KvSpec::llama_8b();
        assert!(s.validate().is_ok());
        s.chunk_tokens = 0;
        assert!(s.validate().is_err());
        let s = KvSpec::new(
            KvLayout::Standard {
                layers: u32::MAX,
                kv_heads: u32::MAX,
                head_dim: u32::MAX,
            },
            Dtype::Fp32,
        );
        assert!(s.validate().is_err());
    }

    #[test]
    fn pages_in_buffer() {
        let s = KvSpec::llama_8b();
        assert_eq!(s.pages_in(1 << 30), 32);
        assert_eq!(s.pages_in((1 << 30) + 1), 32);
    }
}
