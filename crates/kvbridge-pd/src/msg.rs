//! PD control messages between a sender and a receiver rank, carried by
//! [`kvbridge::Channel::notify`] (ordered after the writes before them) as msgpack.

use crate::layout::KvSpec;
use serde::{Deserialize, Serialize};

/// Largest control message we accept (an alloc of a 1M-token prompt at 16 tokens per chunk
/// is about 600 KiB of keys).
pub const MAX_MSG_BYTES: usize = 1 << 20;

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "t")]
pub enum PdMsg {
    /// Sender → receiver: reserve pages for every chunk of a request.
    Alloc {
        /// Correlation id of this call.
        call: u64,
        /// The request.
        req_id: String,
        /// The sender channel's incarnation (who owns the pages).
        incarnation: u64,
        /// Layout, dtype and chunk size; must equal the receiver's.
        spec: KvSpec,
        /// One key hash per chunk.
        keys: Vec<u64>,
        /// Prompt tokens.
        tokens: u64,
        /// Pull mode: the receiver reads each chunk from the sender's memory when offered
        /// (absent from older senders: push).
        #[serde(default)]
        pull: bool,
    },
    /// Receiver → sender: the pages.
    AllocOk {
        /// The call answered.
        call: u64,
        /// The request.
        req_id: String,
        /// The receiver's buffer region.
        region: [u8; 16],
        /// Page size in bytes.
        page_bytes: u64,
        /// One page per chunk.
        pages: Vec<u32>,
        /// Per chunk: already held by the receiver, do not send.
        held: Vec<bool>,
    },
    /// Receiver → sender: refused.
    AllocErr {
        /// The call answered.
        call: u64,
        /// The request.
        req_id: String,
        /// Why, for people.
        reason: String,
        /// Set when the request can never fit: (needed pages, total pages).
        never_fits: Option<(u64, u64)>,
        /// Page size in bytes.
        page_bytes: u64,
    },
    /// Sender → receiver: every chunk landed (ordered after the writes).
    Finish {
        /// Correlation id of this call.
        call: u64,
        /// The request.
        req_id: String,
        /// The sender channel's incarnation.
        incarnation: u64,
    },
    /// Sender → receiver, push mode: answer this finish now, and complete the request by
    /// yourself once every chunk has landed (the `Written` of the last one). Sent ahead of
    /// the writes, so its round trip runs while they do instead of after the last one. A
    /// new message rather than a field of `Finish`: a receiver that does not know it drops
    /// it as malformed (the sender's call then fails at its deadline) instead of completing
    /// the request before its chunks landed.
    FinishWhenLanded {
        /// Correlation id of this call.
        call: u64,
        /// The request.
        req_id: String,
        /// The sender channel's incarnation.
        incarnation: u64,
    },
    /// Receiver → sender: finish accepted; the KV is ready (after `FinishWhenLanded`: will
    /// be, once the last chunk's `Written` arrives).
    FinishOk {
        /// The call answered.
        call: u64,
        /// The request.
        req_id: String,
    },
    /// Receiver → sender: finish refused (the request was cancelled or expired meanwhile).
    FinishErr {
        /// The call answered.
        call: u64,
        /// The request.
        req_id: String,
        /// Why.
        reason: String,
    },
    /// Sender → receiver: the sender gave the request up; no further write of it follows,
    /// and every earlier one has landed (ordering of notify). For a pull request the
    /// receiver answers `CancelAck` once none of its reads is in flight.
    Cancel {
        /// The request.
        req_id: String,
        /// The sender channel's incarnation.
        incarnation: u64,
        /// The request is a pull request (absent from older senders: push).
        #[serde(default)]
        pull: bool,
    },
    /// Sender → receiver, push mode: chunk `index` landed (ordered after its write), so the
    /// decoder may consume it before the whole request is complete.
    Written {
        /// The request.
        req_id: String,
        /// The sender channel's incarnation.
        incarnation: u64,
        /// The chunk.
        index: u64,
    },
    /// Sender → receiver, pull mode: chunk `index` is ready in the sender's registered
    /// memory; the memory stays the receiver's until it answers `Pulled` or `PullErr`.
    Offer {
        /// The request.
        req_id: String,
        /// The sender channel's incarnation.
        incarnation: u64,
        /// The chunk.
        index: u64,
        /// The sender's region holding it.
        region: [u8; 16],
        /// Offset of the chunk in that region.
        offset: u64,
        /// Bytes of the chunk.
        len: u64,
    },
    /// Receiver → sender, pull mode: the read of chunk `index` landed; the sender may reuse
    /// that memory.
    Pulled {
        /// The request.
        req_id: String,
        /// The chunk.
        index: u64,
    },
    /// Receiver → sender, pull mode: chunk `index` was not (or not wholly) read, and no read
    /// of it is in flight any more; the sender may reuse that memory.
    PullErr {
        /// The request.
        req_id: String,
        /// The chunk.
        index: u64,
        /// Why, for people.
        reason: String,
    },
    /// Receiver → sender, pull mode: answer to `Cancel`: no read of the request is in flight
    /// or will start.
    CancelAck {
        /// The request.
        req_id: String,
    },
    /// Receiver → sender: stop writing the request and confirm with `FenceAck`.
    Fence {
        /// The request.
        req_id: String,
    },
    /// Sender → receiver: no write of the request will be issued any more, and every earlier
    /// one has landed.
    FenceAck {
        /// The request.
        req_id: String,
        /// The sender channel's incarnation.
        incarnation: u64,
    },
}

impl PdMsg {
    /// msgpack bytes.
    pub fn encode(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// Decodes a peer's bytes; never panics.
    pub fn decode(b: &[u8]) -> Result<PdMsg, String> {
        if b.len() > MAX_MSG_BYTES {
            return Err(format!("control message of {} bytes is too large", b.len()));
        }
        rmp_serde::from_slice(b).map_err(|e| format!("malformed control message: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvSpec;

    #[test]
    fn round_trip_and_garbage() {
        let m = PdMsg::Alloc {
            call: 1,
            req_id: "r".into(),
            incarnation: 9,
            spec: KvSpec::llama_8b(),
            keys: vec![1, 2, u64::MAX],
            tokens: 600,
            pull: true,
        };
        assert_eq!(PdMsg::decode(&m.encode()).unwrap(), m);
        let o = PdMsg::Offer {
            req_id: "r".into(),
            incarnation: 3,
            index: 2,
            region: [7; 16],
            offset: 1 << 40,
            len: 4096,
        };
        assert_eq!(PdMsg::decode(&o.encode()).unwrap(), o);
        // An older sender's messages (no `pull` field) still decode, as push.
        #[derive(serde::Serialize)]
        struct OldCancel<'a> {
            t: &'a str,
            req_id: &'a str,
            incarnation: u64,
        }
        let old = rmp_serde::to_vec_named(&OldCancel {
            t: "Cancel",
            req_id: "r",
            incarnation: 1,
        })
        .unwrap();
        assert_eq!(
            PdMsg::decode(&old).unwrap(),
            PdMsg::Cancel {
                req_id: "r".into(),
                incarnation: 1,
                pull: false
            }
        );
        assert!(PdMsg::decode(b"").is_err());
        assert!(PdMsg::decode(b"\x81\xa1t\xa3Bad").is_err());
        assert!(PdMsg::decode(&vec![0x90; MAX_MSG_BYTES + 1]).is_err());
    }
}
