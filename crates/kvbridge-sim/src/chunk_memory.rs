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

use crate::model::KvSink;

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

    /// The chunk's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the chunk is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `data` into the chunk at `offset`.
    ///
    /// # Panics
    /// When `offset + data.len()` exceeds the chunk (a bug of the caller).
    pub fn write_at(&self, offset: usize, data: &[u8]) {
        assert!(
            offset
                .checked_add(data.len())
                .is_some_and(|e| e <= self.len),
            "{} bytes at {offset} past a chunk of {}",
            data.len(),
            self.len
        );
        self.mem
            .region
            .write_at(self.offset() + offset, data)
            .expect("a slot lies inside the region");
    }

    /// A copy of the chunk's bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.mem
            .region
            .read_at(self.offset(), &mut v)
            .expect("a slot lies inside the region");
        v
    }

    /// The slot as a [`KvSink`] that computes each row into `row` and copies it in.
    pub fn sink<'a>(&'a self, row: &'a mut Vec<u8>) -> SlotSink<'a> {
        SlotSink { slot: self, row }
    }
}

/// A [`ChunkSlot`] computed into row by row ([`ChunkSlot::sink`]): each row is filled in an
/// owned buffer and copied into the registered memory, never touched through a reference
/// there (a peer granted the region may write it at any time; `kvbridge::peer_memory`).
pub struct SlotSink<'a> {
    slot: &'a ChunkSlot,
    row: &'a mut Vec<u8>,
}

impl KvSink for SlotSink<'_> {
    fn kv_len(&self) -> usize {
        self.slot.len
    }
    fn fill_row(
        &mut self,
        offset: usize,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> u64,
    ) -> u64 {
        self.row.resize(len, 0);
        let d = fill(&mut self.row[..]);
        self.slot.write_at(offset, &self.row[..]);
        d
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
        let a = mem.take(4096, Duration::from_secs(1)).await.unwrap();
        let b = mem.take(100, Duration::from_secs(1)).await.unwrap();
        assert_ne!(a.offset(), b.offset());
        a.write_at(0, &[7; 4096]);
        assert!(a.to_vec().iter().all(|&x| x == 7));
        assert_eq!(b.to_vec().len(), 100);
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
