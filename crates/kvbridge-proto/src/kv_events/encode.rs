//! The encoder of a `KVEventBatch` payload, byte for byte as vLLM 0.32.0's msgspec encoder
//! writes it: the batch as an array of all three fields (msgspec's `omit_defaults` leaves
//! array-like structs whole), events as maps led by their `type`, required fields always
//! written (`None` as nil) and defaulted ones only when set.

use super::event::{BlockHash, KvEvent, KvEventBatch};
use rmp::encode as w;

/// Encodes `batch` as a payload.
pub fn encode_batch(batch: &KvEventBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    // Writing to a Vec cannot fail, and every length below comes from a Rust collection
    // that `len_u32` clamps: the `let _`s drop infallible results.
    let _ = w::write_array_len(&mut out, 3);
    let _ = w::write_f64(&mut out, batch.ts);
    let _ = w::write_array_len(&mut out, len_u32(batch.events.len()));
    for e in &batch.events {
        event(&mut out, e);
    }
    opt_int(&mut out, batch.data_parallel_rank);
    out
}

fn len_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn key(out: &mut Vec<u8>, k: &str) {
    let _ = w::write_str(out, k);
}

fn int(out: &mut Vec<u8>, v: i128) {
    if let Ok(u) = u64::try_from(v) {
        let _ = w::write_uint(out, u);
    } else {
        let _ = w::write_sint(out, i64::try_from(v).unwrap_or(i64::MIN));
    }
}

fn hash(out: &mut Vec<u8>, h: &BlockHash) {
    match h {
        BlockHash::Int(v) => int(out, *v),
        BlockHash::Bytes(b) => {
            let _ = w::write_bin(out, b);
        }
    }
}

fn hashes(out: &mut Vec<u8>, hs: &[BlockHash]) {
    let _ = w::write_array_len(out, len_u32(hs.len()));
    for h in hs {
        hash(out, h);
    }
}

fn opt_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => {
            let _ = w::write_str(out, s);
        }
        None => {
            let _ = w::write_nil(out);
        }
    }
}

fn opt_int(out: &mut Vec<u8>, v: Option<i64>) {
    match v {
        Some(v) => int(out, v.into()),
        None => {
            let _ = w::write_nil(out);
        }
    }
}

fn event(out: &mut Vec<u8>, e: &KvEvent) {
    match e {
        KvEvent::BlockStored(s) => {
            let _ = w::write_map_len(out, 8 + u32::from(s.group_idx.is_some()));
            key(out, "type");
            key(out, "BlockStored");
            key(out, "block_hashes");
            hashes(out, &s.block_hashes);
            key(out, "parent_block_hash");
            match &s.parent_block_hash {
                Some(h) => hash(out, h),
                None => {
                    let _ = w::write_nil(out);
                }
            }
            key(out, "token_ids");
            let _ = w::write_array_len(out, len_u32(s.token_ids.len()));
            for &t in &s.token_ids {
                let _ = w::write_uint(out, t.into());
            }
            key(out, "block_size");
            let _ = w::write_uint(out, s.block_size.into());
            key(out, "lora_id");
            opt_int(out, s.lora_id);
            key(out, "medium");
            opt_str(out, s.medium.as_deref());
            key(out, "lora_name");
            opt_str(out, s.lora_name.as_deref());
            if let Some(g) = s.group_idx {
                key(out, "group_idx");
                int(out, g.into());
            }
        }
        KvEvent::BlockRemoved(r) => {
            let _ = w::write_map_len(out, 3 + u32::from(r.group_idx.is_some()));
            key(out, "type");
            key(out, "BlockRemoved");
            key(out, "block_hashes");
            hashes(out, &r.block_hashes);
            key(out, "medium");
            opt_str(out, r.medium.as_deref());
            if let Some(g) = r.group_idx {
                key(out, "group_idx");
                int(out, g.into());
            }
        }
        KvEvent::AllBlocksCleared => {
            let _ = w::write_map_len(out, 1);
            key(out, "type");
            key(out, "AllBlocksCleared");
        }
    }
}
