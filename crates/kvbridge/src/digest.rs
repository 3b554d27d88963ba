//! The integrity digest of a block of KV: computed where the bytes are written (a
//! prefiller's save, an LMCache sender), carried in the transfer's own messages, and
//! compared where they land, so that bytes changed on the way (a flipped bit in memory, a
//! faulty NIC or copy) fail that load instead of being decoded from.
//!
//! The hash is XXH3-64 (seed 0): of the candidates `kvbridge bench digest` measures beside
//! `memcpy` (XXH3-64, CRC32C with SSE4.2, BLAKE3 keyed, HMAC-SHA256), it is the fastest at
//! 4 KiB to 1 MiB on the hosts measured (docs/results/digest-*.txt), which is what lets a
//! checked load cost close to an unchecked one. It is not a MAC: it finds accidental
//! corruption, not a peer that changes the bytes and the digest together (against that
//! peer, authentication of the session, `KVBRIDGE_SECRET`, is the defence; docs/threat-model.md).
//!
//! The value is part of the wire of whoever carries it (the LMCache channel's messages, the
//! vLLM connector's): changing the hash means a new [`ALGORITHM`] name, and peers that
//! compare digests must agree on it.

/// The hash's name as reports and messages give it.
pub const ALGORITHM: &str = "xxh3-64";

/// XXH3-64 with seed 0 of `bytes`; equal bytes give equal digests on every host and build.
pub fn digest(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors_of_xxh3_64() {
        // XXH3_64bits(seed 0) reference values (xxHash's own test vectors).
        assert_eq!(digest(b""), 0x2D06_8005_38D3_94C2);
        assert_eq!(digest(b"a"), 0xE6C6_32B6_1E96_4E1F);
    }

    #[test]
    fn one_flipped_bit_changes_it() {
        let mut block = vec![0x5Au8; 1 << 20];
        let clean = digest(&block);
        for at in [0, 4095, 1 << 19, (1 << 20) - 1] {
            block[at] ^= 1;
            assert_ne!(digest(&block), clean, "bit 0 of byte {at}");
            block[at] ^= 1;
        }
        assert_eq!(digest(&block), clean);
    }
}
