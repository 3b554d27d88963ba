//! Reused KV chunk buffers.
//!
//! Why: a chunk of the default model is 8 MiB per rank, and the engines made one for every
//! chunk prefilled, verified or decoded, then freed it on another thread. Allocators keep
//! much of such memory (a 10-minute soak's demo process grew 110 -> 258 MiB with mimalloc,
//! in steps with glibc's arenas). A real engine computes KV into memory it owns for good;
//! so do these: prefill chunks come from a small per-engine pool, and computations that
//! only look at a chunk use a per-thread scratch buffer ([`crate::model::Model::with_chunks`]).

use std::ops::Deref;
use std::sync::{Arc, Mutex};

/// A pool of byte buffers; keeps at most `keep` free ones.
#[derive(Debug)]
pub struct BufPool {
    free: Mutex<Vec<Vec<u8>>>,
    keep: usize,
}

/// A buffer of the pool, `len` bytes long; goes back to the pool when dropped.
#[derive(Debug)]
pub struct PooledBuf {
    buf: Vec<u8>,
    len: usize,
    pool: Arc<BufPool>,
}

impl BufPool {
    /// A pool that keeps at most `keep` free buffers.
    pub fn new(keep: usize) -> Arc<BufPool> {
        Arc::new(BufPool {
            free: Mutex::new(Vec::new()),
            keep,
        })
    }

    /// A buffer of `len` bytes (contents unspecified: the caller overwrites all of them).
    pub fn take(self: &Arc<Self>, len: usize) -> PooledBuf {
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            let i = free.iter().position(|b| b.capacity() >= len);
            i.map(|i| free.swap_remove(i))
        };
        let mut buf = reused.unwrap_or_default();
        if buf.len() < len {
            buf.resize(len, 0);
        }
        PooledBuf {
            buf,
            len,
            pool: self.clone(),
        }
    }

    /// Free buffers held now.
    pub fn free_count(&self) -> usize {
        self.free.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl PooledBuf {
    /// The buffer's bytes, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.len() < self.pool.keep {
            free.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_and_the_pool_stays_bounded() {
        let pool = BufPool::new(2);
        let mut a = pool.take(100);
        a.as_mut_slice().fill(7);
        let ptr = a.as_ptr();
        drop(a);
        assert_eq!(pool.free_count(), 1);
        // A shorter buffer reuses the same memory and is exactly as long as asked.
        let b = pool.take(60);
        assert_eq!(b.as_ptr(), ptr);
        assert_eq!(b.len(), 60);
        drop(b);
        // Three taken at once: only two come back to be kept.
        let bufs: Vec<_> = (0..3).map(|_| pool.take(100)).collect();
        drop(bufs);
        assert_eq!(pool.free_count(), 2);
        // A longer one than any kept grows one of them.
        let c = pool.take(1000);
        assert_eq!(c.len(), 1000);
    }
}
