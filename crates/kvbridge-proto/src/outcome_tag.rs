//! The tag that authenticates one KV outcome (PD sender to proxy) under the shared secret.
//!
//! An HMAC-SHA256 over the outcome's kind (`KvReady`, `KvFailed`, `ProxyNotif`), its rank
//! (0 for `ProxyNotif`, which names none) and its request id, each length-prefixed, in a
//! domain of its own so that no other kvbridge MAC can be replayed as one. It travels as 64
//! lowercase hex digits in the outcome's `tag` field. Without the secret, no one can make
//! the proxy count an outcome; a captured tag is good only for the same kind, rank and id
//! (which the proxy counts once).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Length of a tag in hex digits.
pub const TAG_HEX_LEN: usize = 64;

fn mac(secret: &[u8], kind: &str, rank: u32, req_id: &str) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(b"kvbridge/1 outcome tag\0");
    for part in [kind.as_bytes(), &rank.to_le_bytes(), req_id.as_bytes()] {
        m.update(&(part.len() as u32).to_le_bytes());
        m.update(part);
    }
    m
}

/// The tag of an outcome, as hex.
pub fn outcome_tag(secret: &[u8], kind: &str, rank: u32, req_id: &str) -> String {
    let bytes = mac(secret, kind, rank, req_id).finalize().into_bytes();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `tag` (hex) is the tag of this outcome; compared in constant time.
pub fn verify_outcome_tag(secret: &[u8], kind: &str, rank: u32, req_id: &str, tag: &str) -> bool {
    let t = tag.as_bytes();
    if t.len() != TAG_HEX_LEN {
        return false;
    }
    let mut raw = [0u8; TAG_HEX_LEN / 2];
    for (i, pair) in t.chunks(2).enumerate() {
        let hex = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        match (hex(pair[0]), hex(pair[1])) {
            (Some(h), Some(l)) => raw[i] = h << 4 | l,
            _ => return false,
        }
    }
    mac(secret, kind, rank, req_id).verify_slice(&raw).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned: the PD sender and the proxy must agree on these bytes.
    #[test]
    fn golden_tag() {
        let t = outcome_tag(b"secret", "KvReady", 1, "kvb-00");
        assert_eq!(t.len(), TAG_HEX_LEN);
        assert_eq!(t, GOLDEN);
        assert!(verify_outcome_tag(b"secret", "KvReady", 1, "kvb-00", &t));
    }

    const GOLDEN: &str = "c3d132555ac9569aaa46fc7fdb2d7b5ab3bffc257ae9a40dba9368fd2e11838c";

    #[test]
    fn any_change_breaks_the_tag() {
        let t = outcome_tag(b"secret", "KvReady", 1, "kvb-00");
        assert!(!verify_outcome_tag(b"secre7", "KvReady", 1, "kvb-00", &t));
        assert!(!verify_outcome_tag(b"secret", "KvFailed", 1, "kvb-00", &t));
        assert!(!verify_outcome_tag(b"secret", "KvReady", 0, "kvb-00", &t));
        assert!(!verify_outcome_tag(b"secret", "KvReady", 1, "kvb-01", &t));
        assert!(!verify_outcome_tag(
            b"secret",
            "KvReady",
            1,
            "kvb-00",
            &t[..63]
        ));
        assert!(!verify_outcome_tag(
            b"secret",
            "KvReady",
            1,
            "kvb-00",
            &t.to_uppercase()
        ));
        assert!(!verify_outcome_tag(
            b"secret",
            "KvReady",
            1,
            "kvb-00",
            &"zz".repeat(32)
        ));
        assert!(!verify_outcome_tag(b"secret", "KvReady", 1, "kvb-00", "é"));
    }
}
