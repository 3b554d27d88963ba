//! The bounded decoder of a `KVEventBatch` payload.

use super::event::{
    BlockHash, BlockRemoved, BlockStored, DecodeLimits, KvEvent, KvEventBatch, KvEventsError,
};
use rmp::Marker;

/// Most fields in one event (vLLM 0.32.0's `BlockStored` has 14).
const MAX_FIELDS: u64 = 64;

/// Decodes one payload (the third frame of a KV-events message).
pub fn decode_batch(payload: &[u8], limits: &DecodeLimits) -> Result<KvEventBatch, KvEventsError> {
    if payload.len() > limits.max_payload {
        return Err(KvEventsError::PayloadTooLarge {
            len: payload.len(),
            max: limits.max_payload,
        });
    }
    let mut r = Reader {
        buf: payload,
        limits,
    };
    let n = r.array("the batch", 16)?;
    if n < 2 {
        return Err(KvEventsError::MissingField("events"));
    }
    let ts = r.float("ts")?;
    let count = r.array("events", limits.max_events as u64)?;
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        events.push(r.event()?);
    }
    let data_parallel_rank = if n >= 3 {
        r.opt_int("data_parallel_rank")?
            .map(|v| {
                i64::try_from(v).map_err(|_| KvEventsError::Type {
                    what: "data_parallel_rank",
                })
            })
            .transpose()?
    } else {
        None
    };
    for _ in 3..n {
        r.skip(1)?;
    }
    if !r.buf.is_empty() {
        return Err(KvEventsError::TrailingBytes(r.buf.len()));
    }
    Ok(KvEventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// One msgpack value's head.
enum Head<'a> {
    Nil,
    Bool,
    Int(i128),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u64),
    Map(u64),
    Ext,
}

/// The fields of an event, as far as this decoder keeps them.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<BlockHash>>,
    parent_block_hash: Option<BlockHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    group_idx: Option<i64>,
}

/// Positional fields of the array form, in vLLM's declaration order.
const STORED_ORDER: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
];
const REMOVED_ORDER: &[&str] = &["block_hashes", "medium", "group_idx"];

struct Reader<'a> {
    buf: &'a [u8],
    limits: &'a DecodeLimits,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], KvEventsError> {
        if n > self.buf.len() as u64 {
            return Err(KvEventsError::Truncated);
        }
        let (a, b) = self.buf.split_at(n as usize);
        self.buf = b;
        Ok(a)
    }

    fn be(&mut self, n: u64) -> Result<u64, KvEventsError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn head(&mut self) -> Result<Head<'a>, KvEventsError> {
        let b = self.take(1)?[0];
        Ok(match Marker::from_u8(b) {
            Marker::FixPos(v) => Head::Int(v.into()),
            Marker::FixNeg(v) => Head::Int(v.into()),
            Marker::Null => Head::Nil,
            Marker::True | Marker::False => Head::Bool,
            Marker::U8 => Head::Int(self.be(1)?.into()),
            Marker::U16 => Head::Int(self.be(2)?.into()),
            Marker::U32 => Head::Int(self.be(4)?.into()),
            Marker::U64 => Head::Int(self.be(8)?.into()),
            Marker::I8 => Head::Int((self.be(1)? as u8 as i8).into()),
            Marker::I16 => Head::Int((self.be(2)? as u16 as i16).into()),
            Marker::I32 => Head::Int((self.be(4)? as u32 as i32).into()),
            Marker::I64 => Head::Int((self.be(8)? as i64).into()),
            Marker::F32 => Head::Float(f32::from_bits(self.be(4)? as u32).into()),
            Marker::F64 => Head::Float(f64::from_bits(self.be(8)?)),
            Marker::FixStr(n) => Head::Str(self.take(n.into())?),
            Marker::Str8 => {
                let n = self.be(1)?;
                Head::Str(self.take(n)?)
            }
            Marker::Str16 => {
                let n = self.be(2)?;
                Head::Str(self.take(n)?)
            }
            Marker::Str32 => {
                let n = self.be(4)?;
                Head::Str(self.take(n)?)
            }
            Marker::Bin8 => {
                let n = self.be(1)?;
                Head::Bin(self.take(n)?)
            }
            Marker::Bin16 => {
                let n = self.be(2)?;
                Head::Bin(self.take(n)?)
            }
            Marker::Bin32 => {
                let n = self.be(4)?;
                Head::Bin(self.take(n)?)
            }
            Marker::FixArray(n) => Head::Array(n.into()),
            Marker::Array16 => Head::Array(self.be(2)?),
            Marker::Array32 => Head::Array(self.be(4)?),
            Marker::FixMap(n) => Head::Map(n.into()),
            Marker::Map16 => Head::Map(self.be(2)?),
            Marker::Map32 => Head::Map(self.be(4)?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = self.be(1)?;
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = self.be(2)?;
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.be(4)?;
                self.ext(n)?
            }
            Marker::Reserved => return Err(KvEventsError::Type { what: "a value" }),
        })
    }

    fn ext(&mut self, n: u64) -> Result<Head<'a>, KvEventsError> {
        self.take(1 + n)?;
        Ok(Head::Ext)
    }

    /// An array head of at most `max` elements, each of which needs at least a byte.
    fn array(&mut self, what: &'static str, max: u64) -> Result<usize, KvEventsError> {
        match self.head()? {
            Head::Array(n) => self.count(what, n, max),
            _ => Err(KvEventsError::Type { what }),
        }
    }

    fn count(&self, what: &'static str, n: u64, max: u64) -> Result<usize, KvEventsError> {
        if n > max {
            return Err(KvEventsError::TooMany { what, len: n, max });
        }
        if n > self.buf.len() as u64 {
            return Err(KvEventsError::Truncated);
        }
        Ok(n as usize)
    }

    /// Skips one value whose head is at the cursor, at nesting `depth`.
    fn skip(&mut self, depth: usize) -> Result<(), KvEventsError> {
        if depth > self.limits.max_depth {
            return Err(KvEventsError::TooDeep);
        }
        let n = match self.head()? {
            Head::Array(n) => n,
            Head::Map(n) => n.saturating_mul(2),
            _ => return Ok(()),
        };
        if n > self.buf.len() as u64 {
            return Err(KvEventsError::Truncated);
        }
        for _ in 0..n {
            self.skip(depth + 1)?;
        }
        Ok(())
    }

    fn float(&mut self, what: &'static str) -> Result<f64, KvEventsError> {
        match self.head()? {
            Head::Float(v) => Ok(v),
            Head::Int(v) => Ok(v as f64),
            _ => Err(KvEventsError::Type { what }),
        }
    }

    fn opt_int(&mut self, what: &'static str) -> Result<Option<i128>, KvEventsError> {
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Int(v) => Ok(Some(v)),
            _ => Err(KvEventsError::Type { what }),
        }
    }

    fn opt_i64(&mut self, what: &'static str) -> Result<Option<i64>, KvEventsError> {
        self.opt_int(what)?
            .map(|v| i64::try_from(v).map_err(|_| KvEventsError::Type { what }))
            .transpose()
    }

    fn str(&mut self, what: &'static str) -> Result<&'a str, KvEventsError> {
        match self.head()? {
            Head::Str(s) => self.utf8(what, s),
            _ => Err(KvEventsError::Type { what }),
        }
    }

    fn utf8(&self, what: &'static str, s: &'a [u8]) -> Result<&'a str, KvEventsError> {
        if s.len() > self.limits.max_str {
            return Err(KvEventsError::TooMany {
                what,
                len: s.len() as u64,
                max: self.limits.max_str as u64,
            });
        }
        std::str::from_utf8(s).map_err(|_| KvEventsError::Type { what })
    }

    fn opt_str(&mut self, what: &'static str) -> Result<Option<String>, KvEventsError> {
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Str(s) => Ok(Some(self.utf8(what, s)?.to_string())),
            _ => Err(KvEventsError::Type { what }),
        }
    }

    fn hash_of(&self, h: Head<'a>, what: &'static str) -> Result<BlockHash, KvEventsError> {
        match h {
            Head::Int(v) => Ok(BlockHash::Int(v)),
            Head::Bin(b) if b.len() <= self.limits.max_hash_bytes => {
                Ok(BlockHash::Bytes(b.to_vec()))
            }
            Head::Bin(b) => Err(KvEventsError::TooMany {
                what: "bytes in a block hash",
                len: b.len() as u64,
                max: self.limits.max_hash_bytes as u64,
            }),
            _ => Err(KvEventsError::Type { what }),
        }
    }

    fn hashes(&mut self) -> Result<Vec<BlockHash>, KvEventsError> {
        let n = self.array("block_hashes", self.limits.max_blocks as u64)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let h = self.head()?;
            out.push(self.hash_of(h, "a block hash")?);
        }
        Ok(out)
    }

    fn tokens(&mut self) -> Result<Vec<u32>, KvEventsError> {
        let n = self.array("token_ids", self.limits.max_tokens as u64)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            match self.head()? {
                Head::Int(v) => out.push(
                    u32::try_from(v).map_err(|_| KvEventsError::Type { what: "a token id" })?,
                ),
                _ => return Err(KvEventsError::Type { what: "a token id" }),
            }
        }
        Ok(out)
    }

    /// Reads the value of field `name` into `f` (skipping fields this decoder does not keep).
    fn field(&mut self, name: &str, f: &mut Fields) -> Result<(), KvEventsError> {
        match name {
            "block_hashes" => f.block_hashes = Some(self.hashes()?),
            "parent_block_hash" => {
                f.parent_block_hash = match self.head()? {
                    Head::Nil => None,
                    h => Some(self.hash_of(h, "parent_block_hash")?),
                }
            }
            "token_ids" => f.token_ids = Some(self.tokens()?),
            "block_size" => {
                f.block_size = Some(
                    self.opt_int("block_size")?
                        .and_then(|v| u32::try_from(v).ok())
                        .ok_or(KvEventsError::Type { what: "block_size" })?,
                )
            }
            "lora_id" => f.lora_id = self.opt_i64("lora_id")?,
            "medium" => f.medium = self.opt_str("medium")?,
            "lora_name" => f.lora_name = self.opt_str("lora_name")?,
            "group_idx" => f.group_idx = self.opt_i64("group_idx")?,
            _ => self.skip(2)?,
        }
        Ok(())
    }

    fn event(&mut self) -> Result<KvEvent, KvEventsError> {
        let mut f = Fields::default();
        let tag = match self.head()? {
            Head::Map(n) => {
                let n = self.count("fields in an event", n, MAX_FIELDS)?;
                let mut tag = None;
                for _ in 0..n {
                    let key = self.str("an event field name")?;
                    if key == "type" {
                        tag = Some(self.str("an event type")?);
                    } else {
                        self.field(key, &mut f)?;
                    }
                }
                tag.ok_or(KvEventsError::MissingField("type"))?
            }
            Head::Array(n) => {
                let n = self.count("fields in an event", n, MAX_FIELDS)?;
                if n == 0 {
                    return Err(KvEventsError::MissingField("type"));
                }
                let tag = self.str("an event type")?;
                let order = match tag {
                    "BlockStored" => STORED_ORDER,
                    "BlockRemoved" => REMOVED_ORDER,
                    _ => &[],
                };
                for i in 1..n {
                    match order.get(i - 1) {
                        Some(name) => self.field(name, &mut f)?,
                        None => self.skip(2)?,
                    }
                }
                tag
            }
            _ => return Err(KvEventsError::Type { what: "an event" }),
        };
        match tag {
            "BlockStored" => {
                let block_hashes = f
                    .block_hashes
                    .ok_or(KvEventsError::MissingField("block_hashes"))?;
                let token_ids = f
                    .token_ids
                    .ok_or(KvEventsError::MissingField("token_ids"))?;
                let block_size = f
                    .block_size
                    .ok_or(KvEventsError::MissingField("block_size"))?;
                if block_hashes.len() as u64 * u64::from(block_size) != token_ids.len() as u64 {
                    return Err(KvEventsError::TokenCount {
                        blocks: block_hashes.len(),
                        block_size,
                        tokens: token_ids.len(),
                    });
                }
                Ok(KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash: f.parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id: f.lora_id,
                    medium: f.medium,
                    lora_name: f.lora_name,
                    group_idx: f.group_idx,
                }))
            }
            "BlockRemoved" => Ok(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: f
                    .block_hashes
                    .ok_or(KvEventsError::MissingField("block_hashes"))?,
                medium: f.medium,
                group_idx: f.group_idx,
            })),
            "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
            other => Err(KvEventsError::UnknownEvent(
                other.chars().take(64).collect(),
            )),
        }
    }
}
