//! The envelope around the bytes a peer sends us for UCX: its worker address and its packed
//! region descriptors (base, length, remote key).
//!
//! UCX parses worker addresses and remote keys without checking them against their length, so
//! truncated or corrupted bytes handed to `ucp_ep_create` or `ucp_ep_rkey_unpack` can read out
//! of bounds. Every such blob therefore travels in this envelope (magic, version, kind, length,
//! FNV-1a checksum) and is checked here before UCX sees it. The checksum catches accidents
//! (truncation, corruption, the wrong field), not a hostile peer: the bytes must come from a
//! peer that already authenticated.

use thiserror::Error;

const MAGIC: [u8; 4] = *b"KVUX";
const VERSION: u8 = 1;
const HEADER: usize = 12;
const TRAILER: usize = 8;
/// Worker addresses are a few hundred bytes and remote keys less; anything larger is refused.
pub const MAX_PAYLOAD: usize = 64 << 10;

/// What an envelope carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// A UCX worker address (`ucp_worker_get_address`).
    WorkerAddress = 1,
    /// A region descriptor: base address, length, packed remote key (`ucp_rkey_pack`).
    Region = 2,
}

/// Why an envelope was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum WireError {
    /// Fewer bytes than the header, trailer, or declared length need.
    #[error("truncated: {got} bytes, {need} needed")]
    Truncated {
        /// Bytes received.
        got: usize,
        /// Bytes the header says there should be (at least).
        need: usize,
    },
    /// Bytes after the declared end.
    #[error("{0} trailing bytes after the envelope")]
    Trailing(usize),
    /// Not our magic.
    #[error("not a kvbridge UCX envelope (bad magic)")]
    Magic,
    /// A version this build does not speak.
    #[error("envelope version {0} unsupported (this build speaks {VERSION})")]
    Version(u8),
    /// Another kind of blob than the step expects.
    #[error("envelope holds kind {got}, expected {expected}")]
    Kind {
        /// Kind byte found.
        got: u8,
        /// Kind byte expected.
        expected: u8,
    },
    /// Declared payload above [`MAX_PAYLOAD`].
    #[error("declared payload of {0} bytes exceeds the limit")]
    TooLarge(usize),
    /// Checksum mismatch.
    #[error("checksum mismatch")]
    Checksum,
    /// A region descriptor shorter than its fixed fields, or an empty key.
    #[error("region descriptor malformed")]
    Descriptor,
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Wraps `payload` in an envelope of `kind`. Panics only on payloads above [`MAX_PAYLOAD`],
/// which UCX does not produce.
pub fn seal(kind: Kind, payload: &[u8]) -> Vec<u8> {
    assert!(
        payload.len() <= MAX_PAYLOAD,
        "UCX blob above the envelope limit"
    );
    let mut out = Vec::with_capacity(HEADER + payload.len() + TRAILER);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(kind as u8);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(payload);
    let sum = fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Checks an envelope of `kind` and returns its payload.
pub fn open(kind: Kind, bytes: &[u8]) -> Result<&[u8], WireError> {
    if bytes.len() < HEADER + TRAILER {
        return Err(WireError::Truncated {
            got: bytes.len(),
            need: HEADER + TRAILER,
        });
    }
    if bytes[0..4] != MAGIC {
        return Err(WireError::Magic);
    }
    if bytes[4] != VERSION {
        return Err(WireError::Version(bytes[4]));
    }
    if bytes[5] != kind as u8 {
        return Err(WireError::Kind {
            got: bytes[5],
            expected: kind as u8,
        });
    }
    let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(WireError::TooLarge(len));
    }
    let end = HEADER + len;
    if bytes.len() < end + TRAILER {
        return Err(WireError::Truncated {
            got: bytes.len(),
            need: end + TRAILER,
        });
    }
    if bytes.len() > end + TRAILER {
        return Err(WireError::Trailing(bytes.len() - end - TRAILER));
    }
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&bytes[end..end + TRAILER]);
    if fnv1a(&bytes[..end]) != u64::from_le_bytes(sum) {
        return Err(WireError::Checksum);
    }
    Ok(&bytes[HEADER..end])
}

/// A peer's registered region as it announced it: where it lies in the peer's address space,
/// how long it is, and the packed remote key that lets our endpoint reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionDescriptor {
    /// The region's start in the owner's address space.
    pub base: u64,
    /// The region's length in bytes.
    pub len: u64,
    /// The packed remote key (`ucp_rkey_pack`).
    pub rkey: Vec<u8>,
}

impl RegionDescriptor {
    /// The descriptor in its envelope, ready to send to a peer.
    pub fn encode(&self) -> Vec<u8> {
        let mut payload = Vec::with_capacity(16 + self.rkey.len());
        payload.extend_from_slice(&self.base.to_le_bytes());
        payload.extend_from_slice(&self.len.to_le_bytes());
        payload.extend_from_slice(&self.rkey);
        seal(Kind::Region, &payload)
    }

    /// Checks and decodes the envelope a peer sent.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let p = open(Kind::Region, bytes)?;
        if p.len() <= 16 {
            return Err(WireError::Descriptor);
        }
        let mut w = [0u8; 8];
        w.copy_from_slice(&p[0..8]);
        let base = u64::from_le_bytes(w);
        w.copy_from_slice(&p[8..16]);
        let len = u64::from_le_bytes(w);
        if base.checked_add(len).is_none() {
            return Err(WireError::Descriptor);
        }
        Ok(Self {
            base,
            len,
            rkey: p[16..].to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_truncation_refused() {
        let d = RegionDescriptor {
            base: 0x7f00_0000_1000,
            len: 4096,
            rkey: vec![1, 2, 3, 4, 5],
        };
        let bytes = d.encode();
        assert_eq!(RegionDescriptor::decode(&bytes).unwrap(), d);
        for cut in 0..bytes.len() {
            assert!(
                RegionDescriptor::decode(&bytes[..cut]).is_err(),
                "cut at {cut} accepted"
            );
        }
        let mut long = bytes.clone();
        long.push(0);
        assert_eq!(RegionDescriptor::decode(&long), Err(WireError::Trailing(1)));
    }

    #[test]
    fn every_single_bit_flip_refused() {
        let bytes = seal(Kind::WorkerAddress, &[7u8; 300]);
        for i in 0..bytes.len() * 8 {
            let mut b = bytes.clone();
            b[i / 8] ^= 1 << (i % 8);
            assert!(
                open(Kind::WorkerAddress, &b).is_err(),
                "flip of bit {i} accepted"
            );
        }
    }

    #[test]
    fn kinds_do_not_mix() {
        let bytes = seal(Kind::WorkerAddress, &[1, 2, 3]);
        assert_eq!(
            open(Kind::Region, &bytes),
            Err(WireError::Kind {
                got: 1,
                expected: 2
            })
        );
    }
}
