//! An approximate radix tree of the prompts routed to each worker, for workers that publish
//! nothing about their cache (the `cache-aware` policy).
//!
//! Approximate in two ways, both of which only blur the match, never break routing: a prompt
//! is cut into [`CHUNK_BYTES`]-byte pieces and a piece is known by the hash chain of every
//! piece up to it (so a match is a whole number of pieces, and two prompts that share a
//! prefix share the pieces of it, as radix-tree paths share nodes); and it is what the
//! proxy *sent*, not what the worker still holds: each worker's pieces are evicted least
//! recently used beyond a budget, standing in for the engine's own eviction.

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Mutex;

/// Bytes per piece of a prompt.
pub const CHUNK_BYTES: usize = 32;

/// The chain hashes of `prompt`'s whole pieces, in order.
pub fn pieces(prompt: &[u8]) -> Vec<u64> {
    let mut parent = 0u64;
    prompt
        .chunks_exact(CHUNK_BYTES)
        .map(|c| {
            let mut h = DefaultHasher::new();
            parent.hash(&mut h);
            c.hash(&mut h);
            parent = h.finish();
            parent
        })
        .collect()
}

#[derive(Debug, Default)]
struct Tree {
    /// Piece to the tick it was last routed at.
    last_used: HashMap<u64, u64>,
    /// (tick, piece), oldest first: the eviction order.
    by_age: BTreeSet<(u64, u64)>,
}

/// Every worker's routed pieces.
#[derive(Debug)]
pub struct PrefixTrees {
    trees: Vec<Mutex<Tree>>,
    tick: std::sync::atomic::AtomicU64,
    /// Most pieces kept per worker.
    pub max_pieces: usize,
}

impl PrefixTrees {
    /// Empty trees for `workers` workers.
    pub fn new(workers: usize, max_pieces: usize) -> PrefixTrees {
        PrefixTrees {
            trees: (0..workers).map(|_| Mutex::default()).collect(),
            tick: Default::default(),
            max_pieces: max_pieces.max(1),
        }
    }

    fn tree(&self, w: usize) -> Option<std::sync::MutexGuard<'_, Tree>> {
        self.trees
            .get(w)
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Leading pieces of `pieces` routed to worker `w` and not evicted since.
    pub fn matched(&self, w: usize, pieces: &[u64]) -> usize {
        self.tree(w).map_or(0, |t| {
            pieces
                .iter()
                .take_while(|p| t.last_used.contains_key(p))
                .count()
        })
    }

    /// Pieces held for worker `w`.
    pub fn size(&self, w: usize) -> usize {
        self.tree(w).map_or(0, |t| t.last_used.len())
    }

    /// Records that `pieces` went to worker `w`, evicting its least recently used beyond
    /// [`PrefixTrees::max_pieces`].
    pub fn insert(&self, w: usize, pieces: &[u64]) {
        let Some(mut t) = self.tree(w) else {
            return;
        };
        // One tick per piece, the later pieces older: they go first, being worth nothing
        // without the pieces before them.
        let n = pieces.len() as u64;
        let first = self.tick.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        for (i, &p) in pieces.iter().enumerate() {
            let tick = first + (n - 1 - i as u64);
            if let Some(old) = t.last_used.insert(p, tick) {
                t.by_age.remove(&(old, p));
            }
            t.by_age.insert((tick, p));
        }
        while t.last_used.len() > self.max_pieces {
            let Some((_, p)) = t.by_age.pop_first() else {
                break;
            };
            t.last_used.remove(&p);
        }
    }

    /// Forgets worker `w` (ejected or restarted: its cache is gone).
    pub fn forget(&self, w: usize) {
        if let Some(mut t) = self.tree(w) {
            t.last_used.clear();
            t.by_age.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefixes_share_pieces_and_eviction_is_lru() {
        let a = [b'a'; 96];
        let mut b = a;
        b[40] = b'b';
        let (pa, pb) = (pieces(&a), pieces(&b));
        assert_eq!(pa.len(), 3);
        assert_eq!(pa[0], pb[0]);
        assert_ne!(pa[1], pb[1]);
        assert_ne!(pa[2], pb[2], "a piece is its whole prefix");
        assert!(pieces(&a[..31]).is_empty());

        let t = PrefixTrees::new(2, 4);
        t.insert(0, &pa);
        assert_eq!(t.matched(0, &pa), 3);
        assert_eq!(t.matched(0, &pb), 1);
        assert_eq!(t.matched(1, &pa), 0);
        // pa[0] used again, then two more pieces: the budget of 4 evicts the least recently
        // used, pa[2] (a prompt's last piece is older than its first).
        t.insert(0, &pa[..1]);
        t.insert(0, &pb[1..]);
        assert_eq!(t.size(0), 4);
        assert_eq!(t.matched(0, &pa), 2);
        assert_eq!(t.matched(0, &pb), 3);
        t.forget(0);
        assert_eq!(t.size(0), 0);
    }
}
