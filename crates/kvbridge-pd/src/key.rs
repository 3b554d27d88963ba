//! Chunk keys: which KV a chunk holds.
//!
//! A key names the model, the world size, the rank, the dtype, the KV layout and the token
//! ids of the chunk *and of every chunk before it*, through a hash chain: chunk `i`'s hash
//! covers chunk `i - 1`'s hash and its own tokens. Two prompts with an equal prefix therefore
//! have equal keys for the chunks of that prefix, and a chunk's key changes when anything
//! before it changes (as attention KV does).
//!
//! The hash is SHA-256, fixed by this crate so that every process and build computes the
//! same keys. The chain carries the full 256-bit digest from chunk to chunk; a key is its
//! first 64 bits (the width of a key on the wire, [`crate::msg::PdMsg`]). What that buys, against
//! someone who chooses prompts (an HTTP client) or keys (a sender):
//! - making a prompt whose key equals *another* prompt's key (a second preimage) costs
//!   about 2^64 SHA-256 computations, where the FNV-1a chain used before could be solved
//!   for far cheaper;
//! - two prompts of one's own with one equal key (a birthday collision) still cost about
//!   2^32, but the collision stays in that one chunk: the chunks after it differ, because
//!   the chain carries 256 bits, not the 64 of the key;
//! - nothing stops a *sender* (any holder of the shared secret) from announcing any key it
//!   likes for any KV: the receiver indexes what senders claim (docs/threat-model.md).
//!
//! Peers that compute keys differently must not share a buffer: [`with_key_scheme`] names
//! the scheme in the channel's [`Compat`], so an older peer (FNV keys) and a newer one
//! refuse each other at the handshake with [`kvbridge::Error::Incompatible`].

use crate::layout::{Dtype, KvSpec};
use kvbridge::proto::msg::Compat;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
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
    /// The first 64 bits of the hash chain over the layout and every token up to the end
    /// of this chunk.
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

/// The chunk-key scheme, as named in the channel's [`Compat`] description.
pub const KEY_SCHEME: &str = "kvbridge-pd chunk keys sha256/v2";

/// `compat` with the chunk-key scheme added (unchanged if it is there already): the
/// handshake compares compat hashes, so peers whose keys differ refuse each other with a
/// typed [`kvbridge::Error::Incompatible`] naming both descriptions, instead of sharing a
/// buffer whose keys do not match. [`crate::PdSender`] and [`crate::PdReceiver`] apply it to
/// their channels; a raw [`kvbridge::Channel`] that talks to them must too.
pub fn with_key_scheme(compat: &Compat) -> Compat {
    if compat.description.contains(KEY_SCHEME) {
        return compat.clone();
    }
    let mut h = Sha256::new();
    h.update(b"kvbridge-pd/compat");
    h.update(compat.hash.to_le_bytes());
    h.update(KEY_SCHEME.as_bytes());
    let d: [u8; 32] = h.finalize().into();
    let mut hash = [0u8; 8];
    hash.copy_from_slice(&d[..8]);
    Compat {
        hash: u64::from_le_bytes(hash),
        description: if compat.description.is_empty() {
            KEY_SCHEME.to_string()
        } else {
            format!("{}; {KEY_SCHEME}", compat.description)
        },
    }
}

/// Feeds a byte string with its length first, so that fields cannot run into each other.
fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// The chain's seed: everything but the tokens.
fn seed(model: &str, world_size: u32, rank: u32, spec: &KvSpec) -> [u8; 32] {
    let mut h = Sha256::new();
    field(&mut h, b"kvbridge-pd/chunk-keys/sha256/v2");
    field(&mut h, model.as_bytes());
    h.update(world_size.to_le_bytes());
    h.update(rank.to_le_bytes());
    field(&mut h, spec.dtype.name().as_bytes());
    let shape = spec.layout.shape(0);
    h.update((shape.len() as u64).to_le_bytes());
    for d in shape {
        h.update(d.to_le_bytes());
    }
    h.update(spec.chunk_tokens.to_le_bytes());
    h.finalize().into()
}

/// The chain's next link: the previous digest, then this chunk's token count and tokens.
fn link(prev: &[u8; 32], tokens: &[u32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(prev);
    h.update((tokens.len() as u32).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// A key: the first 64 bits of a link.
fn key_of(link: &[u8; 32]) -> u64 {
    let mut k = [0u8; 8];
    k.copy_from_slice(&link[..8]);
    u64::from_le_bytes(k)
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
            prev = link(&prev, c);
            ChunkKey {
                model: model.to_string(),
                world_size,
                rank,
                dtype: spec.dtype,
                hash: key_of(&prev),
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

    /// The scheme before SHA-256 (FNV-1a with a 64-bit finaliser, chained through the
    /// 64-bit key), kept here to show what it let a client engineer.
    fn fnv_keys(
        model: &str,
        world_size: u32,
        rank: u32,
        spec: &KvSpec,
        tokens: &[u32],
    ) -> Vec<u64> {
        const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
        const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
        fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
            for &b in bytes {
                h ^= b as u64;
                h = h.wrapping_mul(FNV_PRIME);
            }
            h
        }
        fn finish(mut x: u64) -> u64 {
            x ^= x >> 33;
            x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
            x ^= x >> 33;
            x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
            x ^ (x >> 33)
        }
        let mut h = fnv(FNV_OFFSET, b"kvbridge-pd/v1");
        h = fnv(h, &(model.len() as u64).to_le_bytes());
        h = fnv(h, model.as_bytes());
        h = fnv(h, &world_size.to_le_bytes());
        h = fnv(h, &rank.to_le_bytes());
        h = fnv(h, spec.dtype.name().as_bytes());
        for d in spec.layout.shape(0) {
            h = fnv(h, &d.to_le_bytes());
        }
        let mut prev = fnv(h, &spec.chunk_tokens.to_le_bytes());
        tokens
            .chunks(spec.chunk_tokens as usize)
            .map(|c| {
                let mut h = fnv(FNV_OFFSET, &prev.to_le_bytes());
                h = fnv(h, &(c.len() as u32).to_le_bytes());
                for t in c {
                    h = fnv(h, &t.to_le_bytes());
                }
                prev = finish(h);
                prev
            })
            .collect()
    }

    /// The last two tokens (low 32 bits first) of two 4-token chunks `[1, 2, x, y]` whose
    /// FNV keys (model "m", world 1, rank 0, [`spec`]) are equal: 0xaedb5eb4039a4d04.
    const COLLIDING_A: u64 = 0xa887_039c_d909_91fc;
    const COLLIDING_B: u64 = 0x87e1_9a4b_f103_a971;

    /// Two prompts that collide under the FNV chain: found by a Pollard-rho search over the
    /// last two tokens of a 4-token chunk (7.4 * 10^9 chunk hashes, about 3 minutes on one
    /// core); the collision then carries over to every chunk after it. Under SHA-256
    /// neither collides.
    #[test]
    fn prompts_engineered_to_collide_under_fnv_do_not_collide() {
        let (a, b) = (COLLIDING_A, COLLIDING_B);
        let tail = [5u32, 6, 7, 8, 9, 10, 11, 12];
        let prompt = |x: u64| {
            let mut p = vec![1u32, 2, x as u32, (x >> 32) as u32];
            p.extend_from_slice(&tail);
            p
        };
        let (pa, pb) = (prompt(a), prompt(b));
        assert_ne!(pa, pb);
        let (fa, fb) = (
            fnv_keys("m", 1, 0, &spec(), &pa),
            fnv_keys("m", 1, 0, &spec(), &pb),
        );
        assert_eq!(fa.len(), 3);
        assert_eq!(fa, fb, "the FNV chain collides on every chunk");
        let (ka, kb) = (
            chunk_keys("m", 1, 0, &spec(), &pa),
            chunk_keys("m", 1, 0, &spec(), &pb),
        );
        for i in 0..3 {
            assert_ne!(ka[i], kb[i], "chunk {i}");
        }
    }

    /// A collision of one key does not carry over to the chunks after it: the chain runs on
    /// the full digest. Shown by forcing one: two different chains whose first links share
    /// their first 64 bits give different keys from the next chunk on.
    #[test]
    fn a_collision_of_one_key_stays_in_its_chunk() {
        let mut x = [7u8; 32];
        let mut y = x;
        y[31] ^= 1; // equal first 64 bits (the key), different chain
        assert_eq!(key_of(&x), key_of(&y));
        for t in [[1u32, 2, 3, 4], [5, 6, 7, 8]] {
            x = link(&x, &t);
            y = link(&y, &t);
            assert_ne!(key_of(&x), key_of(&y));
        }
    }

    #[test]
    fn the_key_scheme_is_named_once_in_compat() {
        let plain = Compat::default();
        let ours = with_key_scheme(&plain);
        assert_ne!(
            ours.hash, plain.hash,
            "an older peer's compat differs from ours"
        );
        assert_eq!(ours.description, KEY_SCHEME);
        assert_eq!(with_key_scheme(&ours), ours, "applied twice: unchanged");
        let custom = Compat {
            hash: 42,
            description: "llama".into(),
        };
        let c = with_key_scheme(&custom);
        assert_eq!(c.description, format!("llama; {KEY_SCHEME}"));
        assert_ne!(c.hash, ours.hash);
        assert_ne!(c.hash, 42);
    }

    #[test]
    fn keys_are_stable_across_builds() {
        // Pinned: a change here breaks dedup between old and new processes.
        let t: Vec<u32> = (0..4).collect();
        let k = chunk_keys("m", 1, 0, &spec(), &t);
        assert_eq!(k.len(), 1);
        let again = chunk_keys("m", 1, 0, &spec(), &t);
        assert_eq!(k, again);
        // The same value computed independently (Python's hashlib, the scheme as
        // docs/pd.md describes it).
        assert_eq!(k[0].hash, 0xcf16_8412_7e8c_ff3b);
        assert_eq!(chunk_keys("m", 1, 0, &spec(), &[]).len(), 0);
    }
}
