//! Length-prefixed frames.
//!
//! Every frame on a control or data connection starts with an 8-byte header:
//!
//! ```text
//! offset 0  2 bytes  magic  b"KB"
//! offset 2  1 byte   version (PROTOCOL_VERSION)
//! offset 3  1 byte   flags (0; reserved)
//! offset 4  4 bytes  body length, little endian, at most the receiver's limit
//! ```
//!
//! The body is one msgpack-encoded [`crate::msg::Message`]. Some messages (a write batch, a
//! read response) announce a raw payload that follows the body on the same connection; its
//! length is part of the message, not of the frame, so the body limit stays small while
//! payloads go straight into registered memory.
//!
//! Decoding checks the header before it trusts the length (check, then parse): a wrong magic,
//! a foreign version or an oversized body is an error, never an allocation or a panic.

use thiserror::Error;

/// Version of the wire protocol spoken by this crate. Peers with another version are refused
/// with [`crate::msg::ErrorCode::UnsupportedVersion`] naming both values.
pub const PROTOCOL_VERSION: u8 = 1;

/// Length of the frame header in bytes.
pub const FRAME_HEADER_LEN: usize = 8;

/// Magic bytes that open every frame.
pub const MAGIC: [u8; 2] = *b"KB";

/// Default hard limit on a frame body (16 MiB): enough for a batch of 65,536 op headers.
pub const DEFAULT_MAX_FRAME_LEN: u32 = 16 << 20;

/// The parsed header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Protocol version the sender speaks.
    pub version: u8,
    /// Length of the msgpack body that follows.
    pub body_len: u32,
}

/// Why a frame could not be decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The first two bytes are not `KB`: the peer is not speaking kvbridge.
    #[error("bad frame magic {got:02x?} (expected \"KB\"): peer is not speaking kvbridge")]
    BadMagic {
        /// The two bytes received.
        got: [u8; 2],
    },
    /// The peer speaks another protocol version.
    #[error("peer speaks protocol version {got}, this side speaks {supported}")]
    UnsupportedVersion {
        /// Version in the received header.
        got: u8,
        /// Version this side speaks.
        supported: u8,
    },
    /// The flags byte has bits this version does not define.
    #[error("frame flags {0:#04x} are not defined in this protocol version")]
    BadFlags(u8),
    /// The announced body is larger than the receiver's limit.
    #[error("frame body of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Announced body length.
        len: u32,
        /// The receiver's limit.
        limit: u32,
    },
    /// The body is not a valid message.
    #[error("malformed message body: {0}")]
    Malformed(String),
    /// The stream ended inside a frame.
    #[error("connection closed inside a frame")]
    Truncated,
}

impl FrameHeader {
    /// Encodes a header for a body of `body_len` bytes in the current version.
    pub fn encode(body_len: u32) -> [u8; FRAME_HEADER_LEN] {
        let mut h = [0u8; FRAME_HEADER_LEN];
        h[0..2].copy_from_slice(&MAGIC);
        h[2] = PROTOCOL_VERSION;
        h[3] = 0;
        h[4..8].copy_from_slice(&body_len.to_le_bytes());
        h
    }

    /// Checks and parses a header; `max_body` is the receiver's body limit.
    pub fn decode(bytes: &[u8; FRAME_HEADER_LEN], max_body: u32) -> Result<Self, FrameError> {
        let magic = [bytes[0], bytes[1]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic { got: magic });
        }
        if bytes[2] != PROTOCOL_VERSION {
            return Err(FrameError::UnsupportedVersion {
                got: bytes[2],
                supported: PROTOCOL_VERSION,
            });
        }
        if bytes[3] != 0 {
            return Err(FrameError::BadFlags(bytes[3]));
        }
        let body_len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        if body_len > max_body {
            return Err(FrameError::TooLarge {
                len: body_len,
                limit: max_body,
            });
        }
        Ok(Self {
            version: bytes[2],
            body_len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{FrameDecoder, Message, Ping};

    #[test]
    fn header_round_trips() {
        let h = FrameHeader::encode(1234);
        assert_eq!(
            FrameHeader::decode(&h, 2000).unwrap(),
            FrameHeader {
                version: PROTOCOL_VERSION,
                body_len: 1234
            }
        );
    }

    #[test]
    fn header_checks_magic_version_flags_and_size() {
        let mut h = FrameHeader::encode(10);
        h[0] = b'X';
        assert!(matches!(
            FrameHeader::decode(&h, 100),
            Err(FrameError::BadMagic { .. })
        ));
        let mut h = FrameHeader::encode(10);
        h[2] = 9;
        assert_eq!(
            FrameHeader::decode(&h, 100),
            Err(FrameError::UnsupportedVersion {
                got: 9,
                supported: PROTOCOL_VERSION
            })
        );
        let mut h = FrameHeader::encode(10);
        h[3] = 1;
        assert_eq!(FrameHeader::decode(&h, 100), Err(FrameError::BadFlags(1)));
        let h = FrameHeader::encode(101);
        assert_eq!(
            FrameHeader::decode(&h, 100),
            Err(FrameError::TooLarge {
                len: 101,
                limit: 100
            })
        );
    }

    #[test]
    fn decoder_waits_for_whole_frame() {
        let bytes = Message::Ping(Ping { nonce: 7 }).to_frame().unwrap();
        let d = FrameDecoder::new(1024);
        for cut in 0..bytes.len() {
            assert!(d.decode(&bytes[..cut]).unwrap().is_none(), "cut at {cut}");
        }
        let (m, used) = d.decode(&bytes).unwrap().unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(m, Message::Ping(Ping { nonce: 7 }));
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use crate::ids::{Blob, GrantToken, Incarnation, PeerId, RegionId};
    use crate::msg::*;
    use proptest::prelude::*;

    fn op() -> impl Strategy<Value = OpDesc> {
        (any::<[u8; 16]>(), any::<u64>(), any::<u64>()).prop_map(|(r, offset, len)| OpDesc {
            region: RegionId(r),
            offset,
            len,
        })
    }

    fn message() -> impl Strategy<Value = Message> {
        prop_oneof![
            ("[a-z0-9/-]{1,40}", any::<u64>(), any::<u64>(), ".{0,40}").prop_map(|(p, i, h, d)| {
                Message::Hello(Hello {
                    version: PROTOCOL_VERSION,
                    peer_id: PeerId::new(p).unwrap(),
                    incarnation: Incarnation(i),
                    compat: Compat {
                        hash: h,
                        description: d,
                    },
                    auth: None,
                    unacked_notify: i % 2 == 0,
                    host_after_proof: false,
                    data_proof: false,
                    data_connections: 0,
                    ucx: false,
                    grant_tokens: i % 3 == 0,
                })
            }),
            (
                any::<u64>(),
                proptest::collection::vec(op(), 0..50),
                any::<Option<[u8; 16]>>()
            )
                .prop_map(|(id, ops, g)| Message::WriteBatch(Batch {
                    id,
                    ops,
                    grant: g.map(GrantToken::from_bytes),
                })),
            (
                any::<u64>(),
                proptest::collection::vec(op(), 0..50),
                any::<Option<[u8; 16]>>()
            )
                .prop_map(|(id, ops, g)| Message::ReadBatch(Batch {
                    id,
                    ops,
                    grant: g.map(GrantToken::from_bytes),
                })),
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300)).prop_map(|(id, d)| {
                Message::Notify(Notify {
                    id,
                    data: Blob(d),
                    unacked: id % 2 == 1,
                })
            }),
            (any::<u64>(), ".{0,30}").prop_map(|(id, m)| Message::WriteAck(Ack {
                id,
                error: Some(Reject {
                    code: ErrorCode::OutOfBounds,
                    message: m
                })
            })),
            any::<u64>().prop_map(|id| Message::ReadResp(Ack { id, error: None })),
            Just(Message::Ready(Ready {})),
        ]
    }

    proptest! {
        #[test]
        fn frames_round_trip(m in message()) {
            let bytes = m.to_frame().unwrap();
            let (back, used) = FrameDecoder::new(DEFAULT_MAX_FRAME_LEN).decode(&bytes).unwrap().unwrap();
            prop_assert_eq!(used, bytes.len());
            prop_assert_eq!(back, m);
        }

        #[test]
        fn decoder_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = FrameDecoder::new(1024).decode(&bytes);
        }

        #[test]
        fn decoder_never_panics_on_valid_header_with_garbage_body(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut bytes = FrameHeader::encode(body.len() as u32).to_vec();
            bytes.extend_from_slice(&body);
            let _ = FrameDecoder::new(1024).decode(&bytes);
        }
    }
}
