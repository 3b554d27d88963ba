//! Outcome messages that prefiller ranks push to the proxy's ZMQ PULL socket.
//!
//! The wire shape is msgpack in msgspec's tagged-struct form: a map whose `"type"` key names
//! the message and whose other keys are the fields, e.g.
//! `{"type": "KvReady", "req_id": "r1", "rank": 0, "chunks": 4, "bytes": 1048576}`.
//! LMCache's plain `ProxyNotif{req_id}` (one rank finished) is accepted too. The PD layer can
//! use [`encode`] to produce exactly what [`decode`] reads.

use serde::{Deserialize, Serialize};

/// One rank's outcome for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Notif {
    /// LMCache's notification: one prefiller rank has written all KV of `req_id`.
    /// It names no rank; the proxy counts it as one rank's success.
    #[serde(alias = "NixlProxyNotif")]
    ProxyNotif {
        /// The request id the proxy put into the `disagg_spec`.
        req_id: String,
    },
    /// A rank has written all KV chunks of `req_id` to the decoder.
    KvReady {
        /// The request id the proxy put into the `disagg_spec`.
        req_id: String,
        /// The tensor-parallel rank that finished.
        rank: u32,
        /// Number of KV chunks written by this rank.
        #[serde(default)]
        chunks: u64,
        /// Number of bytes written by this rank.
        #[serde(default)]
        bytes: u64,
    },
    /// A rank could not transfer the KV of `req_id`; the request fails at once.
    KvFailed {
        /// The request id the proxy put into the `disagg_spec`.
        req_id: String,
        /// The tensor-parallel rank that failed.
        rank: u32,
        /// Human-readable cause, passed on to the client in the 502 answer.
        #[serde(default)]
        reason: String,
    },
}

impl Notif {
    /// The request id this outcome is about.
    pub fn req_id(&self) -> &str {
        match self {
            Notif::ProxyNotif { req_id }
            | Notif::KvReady { req_id, .. }
            | Notif::KvFailed { req_id, .. } => req_id,
        }
    }

    /// Short name of the message type, as used in metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Notif::ProxyNotif { .. } => "ProxyNotif",
            Notif::KvReady { .. } => "KvReady",
            Notif::KvFailed { .. } => "KvFailed",
        }
    }
}

/// Why a message could not be decoded.
#[derive(Debug)]
pub struct DecodeError(String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed outcome message: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Largest message accepted; outcome messages are tiny, anything bigger is garbage.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Decodes one msgpack outcome message.
pub fn decode(bytes: &[u8]) -> Result<Notif, DecodeError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(DecodeError(format!("{} bytes is too large", bytes.len())));
    }
    rmp_serde::from_slice(bytes).map_err(|e| DecodeError(e.to_string()))
}

/// Decodes one outcome message and its `tag` entry, if any (the PD sender adds one under a
/// shared secret; see [`authentic`]).
pub fn decode_tagged(bytes: &[u8]) -> Result<(Notif, Option<String>), DecodeError> {
    #[derive(Deserialize)]
    struct Tag {
        #[serde(default)]
        tag: Option<String>,
    }
    let msg = decode(bytes)?;
    // The same bytes again, for one key: a map that decoded above decodes here.
    let tag = rmp_serde::from_slice::<Tag>(bytes)
        .map_err(|e| DecodeError(e.to_string()))?
        .tag;
    Ok((msg, tag))
}

/// Whether `tag` authenticates `msg` under `secret`: the HMAC of its kind, rank (0 for
/// `ProxyNotif`) and request id (`kvbridge_proto::outcome_tag`), compared in constant time.
pub fn authentic(msg: &Notif, tag: Option<&str>, secret: &[u8]) -> bool {
    let rank = match msg {
        Notif::ProxyNotif { .. } => 0,
        Notif::KvReady { rank, .. } | Notif::KvFailed { rank, .. } => *rank,
    };
    tag.is_some_and(|t| {
        kvbridge_proto::outcome_tag::verify_outcome_tag(secret, msg.kind(), rank, msg.req_id(), t)
    })
}

/// Encodes one outcome message in the tagged map shape that [`decode`] reads.
pub fn encode(msg: &Notif) -> Vec<u8> {
    // Serialising a plain enum of strings and integers into a Vec cannot fail.
    rmp_serde::to_vec_named(msg).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(out: &mut Vec<u8>, v: &str) {
        assert!(v.len() < 32);
        out.push(0xa0 | v.len() as u8);
        out.extend_from_slice(v.as_bytes());
    }

    /// Bytes as msgspec writes `ProxyNotif(req_id="abc")` with `tag=True`.
    #[test]
    fn decodes_lmcache_proxy_notif() {
        let mut b = vec![0x82];
        s(&mut b, "type");
        s(&mut b, "ProxyNotif");
        s(&mut b, "req_id");
        s(&mut b, "abc");
        assert_eq!(
            decode(&b).unwrap(),
            Notif::ProxyNotif {
                req_id: "abc".into()
            }
        );
        // The NIXL backend's name for the same message.
        let mut b = vec![0x82];
        s(&mut b, "type");
        s(&mut b, "NixlProxyNotif");
        s(&mut b, "req_id");
        s(&mut b, "x");
        assert_eq!(decode(&b).unwrap().req_id(), "x");
    }

    #[test]
    fn decodes_kv_ready_with_fields_in_any_order_and_extra_keys() {
        let mut b = vec![0x86];
        s(&mut b, "rank");
        b.push(3);
        s(&mut b, "extra");
        b.push(0xc0);
        s(&mut b, "req_id");
        s(&mut b, "r-1");
        s(&mut b, "type");
        s(&mut b, "KvReady");
        s(&mut b, "bytes");
        b.extend_from_slice(&[0xce, 0, 1, 0, 0]); // u32 65536
        s(&mut b, "chunks");
        b.push(4);
        assert_eq!(
            decode(&b).unwrap(),
            Notif::KvReady {
                req_id: "r-1".into(),
                rank: 3,
                chunks: 4,
                bytes: 65536
            }
        );
    }

    #[test]
    fn round_trips_every_variant() {
        for m in [
            Notif::ProxyNotif { req_id: "a".into() },
            Notif::KvReady {
                req_id: "b".into(),
                rank: 7,
                chunks: 9,
                bytes: 1 << 40,
            },
            Notif::KvFailed {
                req_id: "c".into(),
                rank: 1,
                reason: "alloc failed".into(),
            },
        ] {
            let bytes = encode(&m);
            assert_eq!(bytes[0] & 0xf0, 0x80, "a map, not an array");
            assert_eq!(decode(&bytes).unwrap(), m);
        }
    }

    /// The bytes the PD sender writes for `KvReady{req_id: "kvb-00", rank: 1, chunks: 4,
    /// bytes: 1048576}` under the secret `secret` (kvbridge-pd's
    /// `tagged_outcomes_keep_their_shape` pins the same tag).
    #[test]
    fn tagged_outcomes_are_authentic_only_under_their_secret() {
        let mut b = vec![0x86];
        s(&mut b, "type");
        s(&mut b, "KvReady");
        s(&mut b, "req_id");
        s(&mut b, "kvb-00");
        s(&mut b, "rank");
        b.push(1);
        s(&mut b, "chunks");
        b.push(4);
        s(&mut b, "bytes");
        b.extend_from_slice(&[0xce, 0, 0x10, 0, 0]);
        s(&mut b, "tag");
        let tag = "c3d132555ac9569aaa46fc7fdb2d7b5ab3bffc257ae9a40dba9368fd2e11838c";
        b.extend_from_slice(&[0xd9, 64]);
        b.extend_from_slice(tag.as_bytes());
        let (m, t) = decode_tagged(&b).unwrap();
        assert_eq!(t.as_deref(), Some(tag));
        assert!(authentic(&m, t.as_deref(), b"secret"));
        assert!(!authentic(&m, t.as_deref(), b"other"));
        assert!(!authentic(&m, None, b"secret"));
        let forged = Notif::KvFailed {
            req_id: "kvb-00".into(),
            rank: 1,
            reason: String::new(),
        };
        assert!(
            !authentic(&forged, t.as_deref(), b"secret"),
            "kind is bound"
        );
        let (plain, none) = decode_tagged(&encode(&m)).unwrap();
        assert_eq!((plain, none), (m, None));
    }

    #[test]
    fn rejects_garbage_unknown_tags_and_missing_fields() {
        assert!(decode(b"").is_err());
        assert!(decode(b"\xff\xff").is_err());
        let mut b = vec![0x82];
        s(&mut b, "type");
        s(&mut b, "Bogus");
        s(&mut b, "req_id");
        s(&mut b, "a");
        assert!(decode(&b).is_err());
        let mut b = vec![0x82];
        s(&mut b, "type");
        s(&mut b, "KvFailed");
        s(&mut b, "req_id");
        s(&mut b, "a");
        assert!(decode(&b).is_err(), "KvFailed without a rank");
        assert!(decode(&vec![0u8; MAX_MESSAGE_BYTES + 1]).is_err());
    }
}
