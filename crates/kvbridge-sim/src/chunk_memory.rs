//! The prefiller's chunk memory: registered slots each rank's KV chunk is computed into and
//! sent from.
//!
//! Why: an engine computes KV into memory it owns for good and the transfer engine moves it
//! from there. Allocating an 8 MiB buffer per chunk and rank, then copying it into the PD
//! sender's staging region, cost twice: the allocator kept much of that memory (a soak's
//! demo process grew ~15 MiB a minute) and the staging copy doubled the time of the last
//! chunk, which the first token waits for. Each slot is held by one chunk from its compute
//! until its transfer returned ([`kvbridge_pd::Transfer::send_chunk_from`] returns once the
//! chunk landed, or was pulled, or failed with nothing of it still moving), so no transfer
//! ever reads a slot that is being overwritten.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvbridge::Region;

/// One rank's chunk memory: `slots` slots of one chunk each, in one registered region.
pub struct ChunkMemory {
    region: Region,
    slot_bytes: usize,
    free: Mutex<Vec<usize>>,
    permits: Arc<tokio::sync::Semaphore>,
}

/// Why no slot was had.
#[derive(Debug, thiserror::Error)]
pub enum ChunkMemoryError {
    /// The chunk is larger than a slot.
    #[error("a chunk of {len} bytes does not fit a slot of {slot} bytes")]
    TooLarge {
        /// The chunk's size.
        len: usize,
        /// A slot's size.
        slot: usize,
    },
    /// Every slot stayed taken for the whole wait.
    #[error("no free chunk memory within {0:?}")]
    Timeout(Duration),
    /// The region could not be allocated.
    #[error("chunk memory: {0}")]
    Alloc(kvbridge::Error),
}

impl ChunkMemory {
    /// `slots` slots of `slot_bytes` each (a whole page each, so a slot is page-aligned).
    pub fn new(slot_bytes: usize, slots: usize) -> Result<Arc<ChunkMemory>, ChunkMemoryError> {
        let region =
            Region::alloc(slot_bytes * slots, slot_bytes).map_err(ChunkMemoryError::Alloc)?;
        Ok(Arc::new(ChunkMemory {
            region,
            slot_bytes,
            free: Mutex::new((0..slots).collect()),
            permits: Arc::new(tokio::sync::Semaphore::new(slots)),
        }))
    }

    /// The region to register with the sender.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Slots free now.
    pub fn free_slots(&self) -> usize {
        self.permits.available_permits()
    }

    /// A free slot for a chunk of `len` bytes, waiting at most `wait` for one.
    pub async fn take(
        self: &Arc<Self>,
        len: usize,
        wait: Duration,
    ) -> Result<ChunkSlot, ChunkMemoryError> {
        if len > self.slot_bytes {
            return Err(ChunkMemoryError::TooLarge {
                len,
                slot: self.slot_bytes,
            });
        }
        let permit = tokio::time::timeout(wait, self.permits.clone().acquire_owned())
            .await
            .map_err(|_| ChunkMemoryError::Timeout(wait))?
            .map_err(|_| ChunkMemoryError::Timeout(wait))?;
        let idx = self
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .expect("a permit stands for a free slot");
        Ok(ChunkSlot {
            mem: self.clone(),
            idx,
            len,
            _permit: permit,
        })
    }
}

/// One chunk's slot, held exclusively until dropped (after the chunk's transfer returned).
pub struct ChunkSlot {
    mem: Arc<ChunkMemory>,
    idx: usize,
    len: usize,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl ChunkSlot {
    /// The registered region the slot lies in.
    pub fn region(&self) -> &Region {
        &self.mem.region
    }

    /// The slot's offset in [`ChunkSlot::region`].
    pub fn offset(&self) -> usize {
        self.idx * self.mem.slot_bytes
    }

    /// The chunk's bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `offset + len` lies inside the region (`take` checked `len <= slot_bytes`,
        // `idx < slots`); the region lives as long as `mem`, which we hold; the slot is ours
        // alone, and no transfer of the protocol writes into the sender's own memory (pull
        // receivers only read it). This trusts the peers: the memory is granted to every
        // authenticated peer, read and write (docs/threat-model.md).
        unsafe { std::slice::from_raw_parts(self.mem.region.as_ptr().add(self.offset()), self.len) }
    }

    /// The chunk's bytes, to compute into.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; and no transfer reads the slot now: it is handed to a sender
        // only once filled, and comes back (is dropped) only once that transfer returned.
        unsafe {
            std::slice::from_raw_parts_mut(self.mem.region.as_ptr().add(self.offset()), self.len)
        }
    }
}

impl Drop for ChunkSlot {
    fn drop(&mut self) {
        self.mem
            .free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(self.idx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn slots_are_exclusive_reused_and_bounded() {
        let mem = ChunkMemory::new(4096, 2).unwrap();
        let mut a = mem.take(4096, Duration::from_secs(1)).await.unwrap();
        let b = mem.take(100, Duration::from_secs(1)).await.unwrap();
        assert_ne!(a.offset(), b.offset());
        a.bytes_mut().fill(7);
        assert!(a.bytes().iter().all(|&x| x == 7));
        assert_eq!(b.bytes().len(), 100);
        // Both taken: a third waits, and gives up at its deadline.
        assert!(matches!(
            mem.take(10, Duration::from_millis(20)).await,
            Err(ChunkMemoryError::Timeout(_))
        ));
        let off = a.offset();
        drop(a);
        let c = mem.take(10, Duration::from_secs(1)).await.unwrap();
        assert_eq!(c.offset(), off);
        assert!(matches!(
            mem.take(4097, Duration::from_secs(1)).await,
            Err(ChunkMemoryError::TooLarge { .. })
        ));
    }
}
