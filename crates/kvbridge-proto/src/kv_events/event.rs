//! The events and batches of vLLM's KV-events messages, and why one could not be decoded.

/// A block hash as vLLM publishes it (`ExternalBlockHash = bytes | int`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockHash {
    /// An integer hash (any msgpack integer, signed or not).
    Int(i128),
    /// A byte-string hash (sha256 hashing gives 32 bytes).
    Bytes(Vec<u8>),
}

/// Blocks an engine stored: `block_hashes[i]` holds `token_ids[i * block_size ..][..
/// block_size]`, and the first block follows `parent_block_hash` (none: the prompt's start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStored {
    /// The stored blocks, in prompt order.
    pub block_hashes: Vec<BlockHash>,
    /// The block before the first one, if any.
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens of all the blocks, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated LoRA id.
    pub lora_id: Option<i64>,
    /// Where the blocks live (`GPU`, `CPU`, `STORAGE`).
    pub medium: Option<String>,
    /// LoRA adapter name, part of the block hash when set.
    pub lora_name: Option<String>,
    /// KV cache group (hybrid models).
    pub group_idx: Option<i64>,
}

/// Blocks an engine evicted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRemoved {
    /// The evicted blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Where they lived.
    pub medium: Option<String>,
    /// KV cache group.
    pub group_idx: Option<i64>,
}

/// One KV cache event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks stored.
    BlockStored(BlockStored),
    /// Blocks removed.
    BlockRemoved(BlockRemoved),
    /// Every block of the engine dropped (a cache reset).
    AllBlocksCleared,
}

/// One published batch.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Publisher's wall-clock time, seconds.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// The publisher's data-parallel rank, when set.
    pub data_parallel_rank: Option<i64>,
}

/// Most of what a decoded payload may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest payload, bytes.
    pub max_payload: usize,
    /// Most events in one batch.
    pub max_events: usize,
    /// Most block hashes in one event.
    pub max_blocks: usize,
    /// Most token ids in one event.
    pub max_tokens: usize,
    /// Longest byte-string hash.
    pub max_hash_bytes: usize,
    /// Longest string field (`medium`, `lora_name`, a key).
    pub max_str: usize,
    /// Deepest nesting of a field this decoder skips (`extra_keys` and unknown fields).
    pub max_depth: usize,
}

impl Default for DecodeLimits {
    /// Room for what vLLM sends in one scheduler step of a large batch.
    fn default() -> Self {
        DecodeLimits {
            max_payload: 16 << 20,
            max_events: 65_536,
            max_blocks: 65_536,
            max_tokens: 1 << 20,
            max_hash_bytes: 64,
            max_str: 1024,
            max_depth: 16,
        }
    }
}

/// Why a payload is not an acceptable `KVEventBatch`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KvEventsError {
    /// The payload is larger than [`DecodeLimits::max_payload`].
    PayloadTooLarge {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The bytes end inside a value (or a length announces more than is left).
    Truncated,
    /// Bytes left after the batch.
    TrailingBytes(usize),
    /// A value of the wrong msgpack type where `what` was expected.
    Type {
        /// The field or element expected.
        what: &'static str,
    },
    /// A count or size over its limit.
    TooMany {
        /// What was counted.
        what: &'static str,
        /// The announced count.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Nesting deeper than [`DecodeLimits::max_depth`].
    TooDeep,
    /// An event tag that is none of the three.
    UnknownEvent(String),
    /// A required field is missing from an event.
    MissingField(&'static str),
    /// A `BlockStored` whose `token_ids` are not `block_size` per block.
    TokenCount {
        /// Blocks in the event.
        blocks: usize,
        /// Its block size.
        block_size: u32,
        /// Token ids given.
        tokens: usize,
    },
    /// A multipart message that is not `[topic, 8-byte sequence, payload]`.
    Envelope,
}

impl std::fmt::Display for KvEventsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvEventsError::PayloadTooLarge { len, max } => {
                write!(
                    f,
                    "a KV-events payload of {len} bytes, at most {max} accepted"
                )
            }
            KvEventsError::Truncated => write!(f, "the KV-events payload ends inside a value"),
            KvEventsError::TrailingBytes(n) => {
                write!(f, "{n} bytes after the KV-events batch")
            }
            KvEventsError::Type { what } => write!(f, "{what} has the wrong msgpack type"),
            KvEventsError::TooMany { what, len, max } => {
                write!(f, "{len} {what} announced, at most {max} accepted")
            }
            KvEventsError::TooDeep => write!(f, "the KV-events payload nests too deep"),
            KvEventsError::UnknownEvent(t) => write!(f, "unknown KV event type {t:?}"),
            KvEventsError::MissingField(n) => write!(f, "a KV event lacks its field {n}"),
            KvEventsError::TokenCount {
                blocks,
                block_size,
                tokens,
            } => write!(
                f,
                "BlockStored of {blocks} blocks of {block_size} tokens carries {tokens} token ids"
            ),
            KvEventsError::Envelope => write!(
                f,
                "a KV-events message is not [topic, 8-byte sequence, payload]"
            ),
        }
    }
}

impl std::error::Error for KvEventsError {}
