//! The proxy's view of each worker's prefix cache, built from the worker's KV events
//! (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, `kvbridge_proto::kv_events`).
//!
//! An engine names its blocks by hashes the proxy cannot recompute (vLLM's depend on its
//! hash function, LoRA, multimodal and salt keys; the reference engine's on its model and
//! layout). So the index keys blocks by *content*: a block's content hash chains its parent's
//! content hash and its tokens, both of which a `BlockStored` carries. A prompt's tokens chain
//! the same way, so "the first k blocks of this prompt are held by worker w" is k lookups.
//! A block whose parent the index does not hold cannot be placed and is left out (it can only
//! make a worker look colder than it is, never warmer). Blocks stored with a LoRA name chain
//! from a seed of that name, so they never match a request, which this proxy hashes without
//! one.
//!
//! Never trusted stale: the sequence number of every batch must follow the previous one. A
//! gap (batches lost: a slow subscriber, a dropped connection) or a sequence that goes back
//! (a restarted publisher) drops everything known of that worker before the batch is applied;
//! so does a new connection, an undecodable batch ([`KvIndex::forget`]) and a worker that
//! grows past [`KvIndex::max_blocks`]. Each worker's state has one owner, its mutex; the
//! subscriber of that worker is its only writer.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;

use kvbridge_proto::kv_events::{BlockHash, KvEvent, KvEventBatch};

/// Content hash of the empty prefix without a LoRA.
pub(crate) const ROOT: u64 = 0x6b76_6272_6964_6765;

/// The content hash of a block: its parent's and its tokens.
pub fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

fn root(lora_name: Option<&str>) -> u64 {
    match lora_name {
        None => ROOT,
        Some(n) => {
            let mut h = DefaultHasher::new();
            ROOT.hash(&mut h);
            n.hash(&mut h);
            h.finish()
        }
    }
}

/// What applying a batch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The batch followed the previous one (or was the first).
    InOrder,
    /// Batches were missed: the worker's view was dropped, then the batch applied.
    Gap {
        /// The sequence number expected.
        expected: u64,
        /// The one received.
        got: u64,
    },
    /// The sequence went back (the publisher restarted): dropped, then applied.
    Restarted,
    /// The worker's view grew past the limit and was dropped.
    Overflow,
}

#[derive(Debug, Default)]
struct WorkerBlocks {
    last_seq: Option<u64>,
    block_size: Option<u32>,
    /// Engine hash to (content hash, media bit mask).
    by_engine: HashMap<BlockHash, (u64, u8)>,
    /// Content hashes held, with how many engine blocks hold each.
    held: HashMap<u64, u32>,
}

impl WorkerBlocks {
    fn clear(&mut self) {
        self.last_seq = None;
        self.block_size = None;
        self.by_engine.clear();
        self.held.clear();
    }

    fn medium_bit(medium: Option<&str>) -> u8 {
        match medium {
            None | Some("GPU") => 1,
            Some("CPU") => 2,
            Some("STORAGE") => 4,
            Some(_) => 8,
        }
    }

    fn apply(&mut self, e: &KvEvent) {
        match e {
            KvEvent::BlockStored(s) => {
                if s.block_size == 0 {
                    return;
                }
                // A worker that changes its block size (a new configuration) starts over.
                if self.block_size.is_some_and(|b| b != s.block_size) {
                    self.by_engine.clear();
                    self.held.clear();
                }
                self.block_size = Some(s.block_size);
                let mut parent = match &s.parent_block_hash {
                    None => root(s.lora_name.as_deref()),
                    Some(p) => match self.by_engine.get(p) {
                        Some(&(c, _)) => c,
                        None => return,
                    },
                };
                let bit = Self::medium_bit(s.medium.as_deref());
                for (h, toks) in s
                    .block_hashes
                    .iter()
                    .zip(s.token_ids.chunks(s.block_size as usize))
                {
                    let c = chain(parent, toks);
                    let entry = self.by_engine.entry(h.clone()).or_insert((c, 0));
                    if entry.1 == 0 {
                        *self.held.entry(c).or_insert(0) += 1;
                    }
                    entry.1 |= bit;
                    parent = entry.0;
                }
            }
            KvEvent::BlockRemoved(r) => {
                let bit = Self::medium_bit(r.medium.as_deref());
                for h in &r.block_hashes {
                    let Some(entry) = self.by_engine.get_mut(h) else {
                        continue;
                    };
                    entry.1 &= !bit;
                    if entry.1 == 0 {
                        let c = entry.0;
                        self.by_engine.remove(h);
                        if let Some(n) = self.held.get_mut(&c) {
                            *n -= 1;
                            if *n == 0 {
                                self.held.remove(&c);
                            }
                        }
                    }
                }
            }
            KvEvent::AllBlocksCleared => {
                self.by_engine.clear();
                self.held.clear();
            }
        }
    }
}

/// Every worker's blocks, for one pool.
#[derive(Debug)]
pub struct KvIndex {
    workers: Vec<Mutex<WorkerBlocks>>,
    /// Most blocks kept per worker; a worker that announces more is dropped (a publisher
    /// cannot grow the proxy's memory without bound).
    pub max_blocks: usize,
}

impl KvIndex {
    /// An empty index of `workers` workers.
    pub fn new(workers: usize, max_blocks: usize) -> KvIndex {
        KvIndex {
            workers: (0..workers).map(|_| Mutex::default()).collect(),
            max_blocks,
        }
    }

    fn worker(&self, w: usize) -> Option<std::sync::MutexGuard<'_, WorkerBlocks>> {
        self.workers
            .get(w)
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Applies batch number `seq` of worker `w`.
    pub fn apply(&self, w: usize, seq: u64, batch: &KvEventBatch) -> Applied {
        let Some(mut b) = self.worker(w) else {
            return Applied::InOrder;
        };
        let outcome = match b.last_seq {
            None => Applied::InOrder,
            Some(last) if seq == last.wrapping_add(1) => Applied::InOrder,
            Some(last) if seq > last => Applied::Gap {
                expected: last + 1,
                got: seq,
            },
            Some(_) => Applied::Restarted,
        };
        if outcome != Applied::InOrder {
            b.clear();
        }
        b.last_seq = Some(seq);
        for e in &batch.events {
            b.apply(e);
        }
        if b.by_engine.len() > self.max_blocks {
            b.clear();
            return Applied::Overflow;
        }
        outcome
    }

    /// Drops everything known of worker `w` (a new connection, an undecodable batch, a
    /// worker ejected or restarted): the next batch starts its view afresh.
    pub fn forget(&self, w: usize) {
        if let Some(mut b) = self.worker(w) {
            b.clear();
        }
    }

    /// Blocks held by worker `w` now.
    pub fn blocks(&self, w: usize) -> usize {
        self.worker(w).map_or(0, |b| b.by_engine.len())
    }

    /// The block size the workers report (the first worker's that has published one).
    pub fn block_size(&self) -> Option<u32> {
        (0..self.workers.len()).find_map(|w| self.worker(w).and_then(|b| b.block_size))
    }

    /// How many tokens at the start of `tokens` worker `w` holds (whole blocks; 0 when the
    /// worker has published nothing yet).
    pub fn matched_tokens(&self, w: usize, tokens: &[u32]) -> usize {
        let Some(b) = self.worker(w) else {
            return 0;
        };
        let Some(bs) = b.block_size else {
            return 0;
        };
        let mut parent = ROOT;
        let mut matched = 0;
        for block in tokens.chunks_exact(bs as usize) {
            parent = chain(parent, block);
            if !b.held.contains_key(&parent) {
                break;
            }
            matched += block.len();
        }
        matched
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_proto::kv_events::{BlockRemoved, BlockStored};

    fn stored(hashes: &[i128], parent: Option<i128>, tokens: &[u32]) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size: 2,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            group_idx: None,
        })
    }

    fn removed(hashes: &[i128]) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
            medium: Some("GPU".into()),
            group_idx: None,
        })
    }

    fn batch(events: Vec<KvEvent>) -> KvEventBatch {
        KvEventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: None,
        }
    }

    #[test]
    fn stored_blocks_match_a_prompts_prefix_until_removed() {
        let ix = KvIndex::new(2, 100);
        assert_eq!(ix.matched_tokens(0, &[1, 2, 3, 4]), 0, "nothing published");
        // Engine hashes are opaque: 11, 12 hold [1, 2], [3, 4]; 13 follows 12 in a later event.
        ix.apply(0, 0, &batch(vec![stored(&[11, 12], None, &[1, 2, 3, 4])]));
        ix.apply(0, 1, &batch(vec![stored(&[13], Some(12), &[5, 6])]));
        assert_eq!(ix.matched_tokens(0, &[1, 2, 3, 4, 5, 6, 7]), 6);
        assert_eq!(ix.matched_tokens(0, &[1, 2, 9, 9, 5, 6]), 2, "prefix only");
        assert_eq!(
            ix.matched_tokens(0, &[3, 4]),
            0,
            "a block is its whole prefix"
        );
        assert_eq!(ix.matched_tokens(1, &[1, 2]), 0, "per worker");
        ix.apply(0, 2, &batch(vec![removed(&[12])]));
        assert_eq!(ix.matched_tokens(0, &[1, 2, 3, 4, 5, 6]), 2);
        // A block whose parent is unknown cannot be placed.
        ix.apply(0, 3, &batch(vec![stored(&[20], Some(99), &[7, 8])]));
        assert_eq!(ix.blocks(0), 2);
        ix.apply(0, 4, &batch(vec![KvEvent::AllBlocksCleared]));
        assert_eq!(ix.matched_tokens(0, &[1, 2]), 0);
    }

    #[test]
    fn a_gap_or_a_restart_drops_the_view_before_applying() {
        let ix = KvIndex::new(1, 100);
        assert_eq!(
            ix.apply(0, 5, &batch(vec![stored(&[1], None, &[1, 2])])),
            Applied::InOrder,
            "the first batch sets the sequence"
        );
        assert_eq!(
            ix.apply(0, 6, &batch(vec![stored(&[2], None, &[3, 4])])),
            Applied::InOrder
        );
        assert_eq!(ix.blocks(0), 2);
        // Batch 7 lost: a removal of [1, 2] the proxy never saw; [1, 2] must not be trusted.
        assert_eq!(
            ix.apply(0, 8, &batch(vec![stored(&[3], None, &[5, 6])])),
            Applied::Gap {
                expected: 7,
                got: 8
            }
        );
        assert_eq!(ix.matched_tokens(0, &[1, 2]), 0);
        assert_eq!(ix.matched_tokens(0, &[5, 6]), 2);
        // The worker restarted: its counter is back at 0 and its cache empty.
        assert_eq!(
            ix.apply(0, 0, &batch(vec![stored(&[4], None, &[7, 8])])),
            Applied::Restarted
        );
        assert_eq!(ix.matched_tokens(0, &[5, 6]), 0);
        assert_eq!(ix.matched_tokens(0, &[7, 8]), 2);
        ix.forget(0);
        assert_eq!(ix.matched_tokens(0, &[7, 8]), 0);
        assert_eq!(
            ix.apply(0, 42, &batch(vec![])),
            Applied::InOrder,
            "after forget, any sequence starts afresh"
        );
    }

    #[test]
    fn media_and_limits() {
        let ix = KvIndex::new(1, 3);
        let mut cpu = stored(&[1], None, &[1, 2]);
        if let KvEvent::BlockStored(s) = &mut cpu {
            s.medium = Some("CPU".into());
        }
        ix.apply(0, 0, &batch(vec![stored(&[1], None, &[1, 2]), cpu]));
        ix.apply(0, 1, &batch(vec![removed(&[1])]));
        assert_eq!(ix.matched_tokens(0, &[1, 2]), 2, "still on the CPU tier");
        let mut lora = stored(&[5], None, &[3, 4]);
        if let KvEvent::BlockStored(s) = &mut lora {
            s.lora_name = Some("a".into());
        }
        ix.apply(0, 2, &batch(vec![lora]));
        assert_eq!(ix.matched_tokens(0, &[3, 4]), 0, "LoRA blocks never match");
        assert_eq!(
            ix.apply(
                0,
                3,
                &batch(vec![stored(&[6, 7, 8], None, &[1, 1, 2, 2, 3, 3])])
            ),
            Applied::Overflow
        );
        assert_eq!(ix.blocks(0), 0);
    }
}
