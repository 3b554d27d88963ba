//! The prompts a pool's `kv-events` policy sent to each worker to prefill and that are still
//! on it: blocks the worker will hold once it has prefilled them, before its KV events can
//! say so. A decoder on the PD path does not count the prompt here
//! ([`crate::pool::Slot::kv_from_prefiller`]): its KV comes when the prefiller is done, out
//! of the order in which the decoder prefills its own requests.
//!
//! An engine publishes a prompt's blocks when its prefill ends, and the proxy hears of them
//! after that. Until then a request that shares the prompt's new prefix (the next turn of a
//! chat, a document asked about twice at once) saw no worker holding it and went wherever
//! the load term sent it, so the prefix was computed twice, on two workers. An engine
//! prefills one prompt at a time in the order they came, so a request sent to the worker
//! whose queue holds its prefix finds that prefix cached when its turn comes.
//!
//! Blocks are known by the same content chain as [`super::kv_index`] (a block's hash chains
//! its parent's and its tokens), whole blocks of the workers' reported block size. Each
//! routed prompt holds its blocks until its slot is released ([`RoutedPrompt`], dropped with
//! the slot); by then the worker's own events report what it kept. A worker's entries are
//! dropped with its reported view ([`RoutedPrefixes::forget`]); a prompt routed before that
//! removes nothing of the entries added after it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::kv_index::{chain, ROOT};

#[derive(Debug, Default)]
struct WorkerRouted {
    /// Bumped by `forget`: a prompt added under an older generation removes nothing.
    generation: u64,
    /// Content hashes of the blocks of the prompts on the worker, with how many hold each.
    blocks: HashMap<u64, u32>,
}

/// Every worker's routed prompts, for one pool.
#[derive(Debug)]
pub struct RoutedPrefixes {
    workers: Vec<Mutex<WorkerRouted>>,
}

impl RoutedPrefixes {
    /// No prompt on any of `workers` workers.
    pub fn new(workers: usize) -> RoutedPrefixes {
        RoutedPrefixes {
            workers: (0..workers).map(|_| Mutex::default()).collect(),
        }
    }

    fn worker(&self, w: usize) -> Option<MutexGuard<'_, WorkerRouted>> {
        self.workers
            .get(w)
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Notes that `tokens` (whole blocks of `block_size`) went to worker `w`; the blocks are
    /// counted until the returned handle is dropped.
    pub fn add(
        self: &Arc<Self>,
        w: usize,
        tokens: &[u32],
        block_size: u32,
    ) -> Option<RoutedPrompt> {
        if block_size == 0 || tokens.len() < block_size as usize {
            return None;
        }
        let mut b = self.worker(w)?;
        let mut parent = ROOT;
        let hashes: Vec<u64> = tokens
            .chunks_exact(block_size as usize)
            .map(|block| {
                parent = chain(parent, block);
                *b.blocks.entry(parent).or_insert(0) += 1;
                parent
            })
            .collect();
        Some(RoutedPrompt {
            prefixes: self.clone(),
            worker: w,
            generation: b.generation,
            hashes,
        })
    }

    /// How many tokens at the start of `tokens` (whole blocks of `block_size`) the prompts
    /// on worker `w` cover.
    pub fn matched_tokens(&self, w: usize, tokens: &[u32], block_size: u32) -> usize {
        let Some(b) = self.worker(w) else {
            return 0;
        };
        if block_size == 0 || b.blocks.is_empty() {
            return 0;
        }
        let mut parent = ROOT;
        let mut matched = 0;
        for block in tokens.chunks_exact(block_size as usize) {
            parent = chain(parent, block);
            if !b.blocks.contains_key(&parent) {
                break;
            }
            matched += block.len();
        }
        matched
    }

    /// Drops what is known of worker `w`'s prompts (its view was dropped: ejected, restarted).
    pub fn forget(&self, w: usize) {
        if let Some(mut b) = self.worker(w) {
            b.generation += 1;
            b.blocks.clear();
        }
    }

    /// Blocks counted on worker `w` (distinct).
    pub fn blocks(&self, w: usize) -> usize {
        self.worker(w).map_or(0, |b| b.blocks.len())
    }
}

/// A prompt routed to a worker: its blocks count as the worker's until this is dropped.
#[derive(Debug)]
pub struct RoutedPrompt {
    prefixes: Arc<RoutedPrefixes>,
    worker: usize,
    generation: u64,
    hashes: Vec<u64>,
}

impl Drop for RoutedPrompt {
    fn drop(&mut self) {
        let Some(mut b) = self.prefixes.worker(self.worker) else {
            return;
        };
        if b.generation != self.generation {
            return;
        }
        for h in &self.hashes {
            if let Some(n) = b.blocks.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    b.blocks.remove(h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_routed_prompt_covers_its_whole_blocks_until_dropped() {
        let r = Arc::new(RoutedPrefixes::new(2));
        assert_eq!(r.matched_tokens(0, &[1, 2, 3, 4], 2), 0);
        let a = r.add(0, &[1, 2, 3, 4, 5], 2).expect("added");
        assert_eq!(r.matched_tokens(0, &[1, 2, 3, 4, 9, 9], 2), 4);
        assert_eq!(r.matched_tokens(0, &[1, 2, 9, 9], 2), 2, "a prefix only");
        assert_eq!(
            r.matched_tokens(0, &[3, 4], 2),
            0,
            "a block is its whole prefix"
        );
        assert_eq!(r.matched_tokens(1, &[1, 2], 2), 0, "per worker");
        // Two prompts share [1, 2]: it stays until both are gone.
        let b = r.add(0, &[1, 2, 7, 8], 2).expect("added");
        drop(a);
        assert_eq!(r.matched_tokens(0, &[1, 2, 3, 4], 2), 2);
        assert_eq!(r.matched_tokens(0, &[1, 2, 7, 8], 2), 4);
        drop(b);
        assert_eq!(r.matched_tokens(0, &[1, 2], 2), 0);
        assert_eq!(r.blocks(0), 0);
        assert!(r.add(0, &[1], 2).is_none(), "no whole block");
        assert!(r.add(5, &[1, 2], 2).is_none(), "no such worker");
        assert!(r.add(0, &[1, 2], 0).is_none(), "no block size");
    }

    #[test]
    fn forget_drops_a_workers_prompts_and_older_handles_remove_nothing() {
        let r = Arc::new(RoutedPrefixes::new(1));
        let old = r.add(0, &[1, 2], 2).expect("added");
        r.forget(0);
        assert_eq!(r.matched_tokens(0, &[1, 2], 2), 0);
        let new = r.add(0, &[1, 2], 2).expect("added");
        drop(old);
        assert_eq!(
            r.matched_tokens(0, &[1, 2], 2),
            2,
            "a prompt routed before forget leaves the newer one"
        );
        drop(new);
        assert_eq!(r.matched_tokens(0, &[1, 2], 2), 0);
    }
}
