//! vLLM's KV-events messages: what an engine reports of its prefix cache, as vLLM's
//! `--kv-events-config` publishes it (`vllm/distributed/kv_events.py`, checked against
//! vLLM 0.32.0).
//!
//! On the wire, a ZMQ PUB socket sends multipart messages `[topic, sequence, payload]`: the
//! sequence is an 8-byte big-endian counter that starts at 0 when the publisher starts, and
//! the payload a msgspec msgpack `KVEventBatch`. The batch is an array-like struct
//! `[ts, events, data_parallel_rank]` (a shorter `[ts, events]` is accepted too);
//! each event is a tagged struct, a map whose `type` key names it (`BlockStored`,
//! `BlockRemoved`, `AllBlocksCleared`) and whose other keys are its fields, defaults left
//! out. [`decode_batch`] also takes events in the array form (`[tag, field, ...]`) that
//! msgspec writes for `array_like` tagged structs. A block hash is an integer (Python's
//! builtin hash) or bytes (sha256 hashing).
//!
//! Decoding never trusts a length: every count and size is checked against
//! [`DecodeLimits`] and against the bytes actually left before anything is allocated, and
//! nesting is bounded, so a hostile publisher gets a typed [`KvEventsError`].

mod decode;
mod encode;
mod event;

pub use decode::decode_batch;
pub use encode::encode_batch;
pub use event::{
    BlockHash, BlockRemoved, BlockStored, DecodeLimits, KvEvent, KvEventBatch, KvEventsError,
};

/// A received multipart message split into its topic, sequence number and payload.
pub fn split_message(frames: &[Vec<u8>]) -> Result<(&[u8], u64, &[u8]), KvEventsError> {
    match frames {
        [topic, seq, payload] => {
            let seq: [u8; 8] = seq
                .as_slice()
                .try_into()
                .map_err(|_| KvEventsError::Envelope)?;
            Ok((topic, u64::from_be_bytes(seq), payload))
        }
        _ => Err(KvEventsError::Envelope),
    }
}

/// The multipart message `[topic, sequence, payload]` for one encoded batch.
pub fn message(topic: &[u8], seq: u64, payload: Vec<u8>) -> Vec<Vec<u8>> {
    vec![topic.to_vec(), seq.to_be_bytes().to_vec(), payload]
}
