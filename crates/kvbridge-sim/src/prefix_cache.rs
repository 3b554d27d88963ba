//! The reference engine's prefix cache: the sequence state after each whole KV chunk of the
//! prompts it computed or received, keyed by the chunk's chain hash (the PD layer's
//! [`kvbridge_pd::chunk_keys`] of rank 0: model, world size, layout, dtype and every token
//! up to the chunk's end), evicted least recently used beyond a budget of chunks.
//!
//! A prompt whose first `k` chunks are held starts its prefill after them (the cost model
//! counts only the tokens after). Only whole chunks are kept, as vLLM keeps only full
//! blocks. What the cache stores and evicts is recorded as vLLM's KV events
//! (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`, block hash = the chunk's key,
//! block size = the chunk's tokens), taken with [`PrefixCache::take_events`] and published
//! by the engine (`crate::kv_events_pub`).
//!
//! Eviction order follows vLLM's: a prompt's chunks are touched last to first, so its first
//! chunk is the most recent and, of an unused prompt, the tail goes first (a chunk evicted
//! before its successors would leave them unreachable, since a lookup walks from the first
//! chunk).
//!
//! Sans-IO: no clock, no lock, no socket; the engine owns one behind a mutex.

use std::collections::hash_map::Entry as Held;
use std::collections::{BTreeMap, HashMap};

use kvbridge::proto::kv_events::{BlockHash, BlockRemoved, BlockStored, KvEvent};

use crate::model::SeqState;

/// Default budget, tokens: 512 chunks of the demo's 256 tokens (16 GiB of the demo model's
/// KV on a real accelerator: the order of what an 80 GB accelerator keeps for an 8B model).
pub const DEFAULT_PREFIX_CACHE_TOKENS: u64 = 131_072;

/// The medium the reference engine reports its blocks on.
const MEDIUM: &str = "GPU";

#[derive(Debug, Clone, Copy)]
struct Entry {
    state: SeqState,
    tick: u64,
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    /// Leading chunks held.
    pub chunks: usize,
    /// The state after the last of them (`None` when none is held).
    pub state: Option<SeqState>,
}

/// One chunk to store: its key, its tokens, the state after it.
#[derive(Debug, Clone)]
pub struct NewChunk<'a> {
    /// The chunk's chain key.
    pub key: u64,
    /// Its tokens (exactly `chunk_tokens`).
    pub tokens: &'a [u32],
    /// The sequence state after its last token.
    pub state: SeqState,
}

/// An LRU cache of chunk states under a budget; see the module docs.
#[derive(Debug)]
pub struct PrefixCache {
    chunk_tokens: u32,
    capacity: usize,
    entries: HashMap<u64, Entry>,
    /// Tick to key, oldest first.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    events: Vec<KvEvent>,
}

impl PrefixCache {
    /// A cache of chunks of `chunk_tokens` tokens holding at most `budget_tokens` tokens
    /// (rounded down to whole chunks; 0 keeps nothing).
    pub fn new(chunk_tokens: u32, budget_tokens: u64) -> PrefixCache {
        let chunk_tokens = chunk_tokens.max(1);
        PrefixCache {
            chunk_tokens,
            capacity: usize::try_from(budget_tokens / chunk_tokens as u64).unwrap_or(usize::MAX),
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            events: Vec::new(),
        }
    }

    /// Chunks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Most chunks held.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn touch(&mut self, key: u64) {
        if let Some(e) = self.entries.get_mut(&key) {
            self.lru.remove(&e.tick);
            self.tick += 1;
            e.tick = self.tick;
            self.lru.insert(self.tick, key);
        }
    }

    /// The leading chunks of a prompt whose chunk keys are `keys` (whole chunks only) that
    /// are held, and the state after them; touches them, last to first.
    pub fn lookup(&mut self, keys: &[u64]) -> Hit {
        let n = keys
            .iter()
            .take_while(|k| self.entries.contains_key(k))
            .count();
        for &k in keys[..n].iter().rev() {
            self.touch(k);
        }
        Hit {
            chunks: n,
            state: n
                .checked_sub(1)
                .and_then(|i| self.entries.get(&keys[i]))
                .map(|e| e.state),
        }
    }

    /// Stores `chunks`, consecutive chunks of one prompt, the first following `parent` (the
    /// key of the chunk before it; `None`: the prompt's start). Chunks already held are
    /// touched, not stored again; each run of new ones is one `BlockStored`. Then evicts the
    /// least recently used chunks beyond the budget (`BlockRemoved`). Chunks that are not
    /// exactly `chunk_tokens` long are left out, and so is every chunk after them.
    pub fn insert(&mut self, parent: Option<u64>, chunks: &[NewChunk<'_>]) {
        if self.capacity == 0 {
            return;
        }
        let whole = chunks
            .iter()
            .take_while(|c| c.tokens.len() == self.chunk_tokens as usize)
            .count();
        let chunks = &chunks[..whole];
        let mut prev = parent;
        let mut run: Option<BlockStored> = None;
        for c in chunks {
            match self.entries.entry(c.key) {
                Held::Occupied(_) => {
                    if let Some(r) = run.take() {
                        self.events.push(KvEvent::BlockStored(r));
                    }
                }
                Held::Vacant(v) => {
                    v.insert(Entry {
                        state: c.state,
                        tick: 0,
                    });
                    let r = run.get_or_insert_with(|| BlockStored {
                        block_hashes: Vec::new(),
                        parent_block_hash: prev.map(hash),
                        token_ids: Vec::new(),
                        block_size: self.chunk_tokens,
                        lora_id: None,
                        medium: Some(MEDIUM.into()),
                        lora_name: None,
                        group_idx: None,
                    });
                    r.block_hashes.push(hash(c.key));
                    r.token_ids.extend_from_slice(c.tokens);
                }
            }
            prev = Some(c.key);
        }
        if let Some(r) = run {
            self.events.push(KvEvent::BlockStored(r));
        }
        // The prompt's chunks, last to first: its first chunk is the most recent.
        for c in chunks.iter().rev() {
            self.touch(c.key);
        }
        let mut evicted = Vec::new();
        while self.entries.len() > self.capacity {
            let Some((_, key)) = self.lru.pop_first() else {
                break;
            };
            self.entries.remove(&key);
            evicted.push(hash(key));
        }
        if !evicted.is_empty() {
            self.events.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: evicted,
                medium: Some(MEDIUM.into()),
                group_idx: None,
            }));
        }
    }

    /// Drops every chunk (`AllBlocksCleared`): a reset, or an engine that starts empty.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.lru.clear();
        self.events.clear();
        self.events.push(KvEvent::AllBlocksCleared);
    }

    /// The events recorded since the last call, in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}

fn hash(key: u64) -> BlockHash {
    BlockHash::Int(key.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(n: u64) -> SeqState {
        SeqState {
            prefix: n,
            digest: n * 7,
            len: n * 2,
        }
    }

    fn chunk(key: u64, tokens: &[u32]) -> NewChunk<'_> {
        NewChunk {
            key,
            tokens,
            state: st(key),
        }
    }

    fn stored(e: &KvEvent) -> &BlockStored {
        match e {
            KvEvent::BlockStored(s) => s,
            other => panic!("expected BlockStored, got {other:?}"),
        }
    }

    #[test]
    fn a_lookup_finds_the_leading_chunks_and_the_state_after_them() {
        let mut c = PrefixCache::new(2, 100);
        assert_eq!(
            c.lookup(&[1, 2]),
            Hit {
                chunks: 0,
                state: None
            }
        );
        c.insert(None, &[chunk(1, &[10, 11]), chunk(2, &[12, 13])]);
        assert_eq!(
            c.lookup(&[1, 2, 3]),
            Hit {
                chunks: 2,
                state: Some(st(2))
            }
        );
        assert_eq!(
            c.lookup(&[2]).chunks,
            1,
            "keys are chained: the caller's to give"
        );
        assert_eq!(c.lookup(&[9, 1]).chunks, 0, "a prefix only");
        let ev = c.take_events();
        assert_eq!(ev.len(), 1, "one run, one event: {ev:?}");
        let s = stored(&ev[0]);
        assert_eq!(s.block_hashes, vec![BlockHash::Int(1), BlockHash::Int(2)]);
        assert_eq!(s.parent_block_hash, None);
        assert_eq!(s.token_ids, vec![10, 11, 12, 13]);
        assert_eq!(s.block_size, 2);
        assert!(c.take_events().is_empty(), "taken once");
    }

    #[test]
    fn held_chunks_are_not_stored_again_and_runs_name_their_parent() {
        let mut c = PrefixCache::new(2, 100);
        c.insert(None, &[chunk(1, &[1, 1])]);
        c.take_events();
        c.insert(
            None,
            &[chunk(1, &[1, 1]), chunk(2, &[2, 2]), chunk(3, &[3, 3])],
        );
        let ev = c.take_events();
        assert_eq!(ev.len(), 1);
        let s = stored(&ev[0]);
        assert_eq!(s.block_hashes, vec![BlockHash::Int(2), BlockHash::Int(3)]);
        assert_eq!(s.parent_block_hash, Some(BlockHash::Int(1)));
        assert_eq!(s.token_ids, vec![2, 2, 3, 3]);
        // A run after a held chunk, from a parent given by the caller.
        c.insert(Some(3), &[chunk(4, &[4, 4])]);
        let s = c.take_events();
        assert_eq!(stored(&s[0]).parent_block_hash, Some(BlockHash::Int(3)));
        // A partial chunk and what follows it are not kept.
        c.insert(Some(4), &[chunk(5, &[5]), chunk(6, &[6, 6])]);
        assert!(c.take_events().is_empty());
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn the_least_recently_used_go_first_tail_before_head() {
        let mut c = PrefixCache::new(1, 3);
        assert_eq!(c.capacity(), 3);
        c.insert(None, &[chunk(1, &[1]), chunk(2, &[2])]);
        c.insert(None, &[chunk(7, &[7])]);
        c.take_events();
        // Prompt [1, 2] used again: 7 is now the least recent.
        assert_eq!(c.lookup(&[1, 2]).chunks, 2);
        c.insert(None, &[chunk(8, &[8])]);
        let ev = c.take_events();
        assert_eq!(
            ev.last(),
            Some(&KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHash::Int(7)],
                medium: Some("GPU".into()),
                group_idx: None,
            }))
        );
        // Of the unused prompt [1, 2], its tail goes before its head.
        c.insert(None, &[chunk(9, &[9])]);
        let ev = c.take_events();
        assert!(
            matches!(ev.last(), Some(KvEvent::BlockRemoved(r)) if r.block_hashes == vec![BlockHash::Int(2)]),
            "{ev:?}"
        );
        assert_eq!(c.lookup(&[1, 2]).chunks, 1);
        assert_eq!(c.len(), 3);
    }

    #[test]
    fn a_zero_budget_keeps_nothing_and_clear_says_so() {
        let mut c = PrefixCache::new(4, 3);
        assert_eq!(c.capacity(), 0, "less than a chunk");
        c.insert(None, &[chunk(1, &[1, 2, 3, 4])]);
        assert!(c.is_empty());
        assert!(c.take_events().is_empty());
        let mut c = PrefixCache::new(1, 10);
        c.insert(None, &[chunk(1, &[1])]);
        c.clear();
        assert_eq!(c.take_events(), vec![KvEvent::AllBlocksCleared]);
        assert_eq!(c.lookup(&[1]).chunks, 0);
    }
}
