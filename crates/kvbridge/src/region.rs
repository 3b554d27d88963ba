//! Registered memory regions.
//!
//! A [`Region`] is memory that peers may address by (region id, byte offset, length) or by
//! page index. It either owns page-aligned memory ([`Region::alloc`]) or wraps memory the
//! caller owns ([`Region::from_raw`], `unsafe`). Remote writes land in a region while local
//! code may hold its own handle, exactly as with RDMA: the application must not touch a range
//! while a transfer into it is in flight.
//!
//! Each region counts the transfers that are touching it. Deregistration
//! ([`crate::Channel::deregister`]) removes the region from the table first, so no new
//! transfer can find it, then waits for that count to drop to zero: memory is never written
//! after `deregister` returns, and owned memory is freed only with the last handle.
//!
//! A shared region (memfd-backed) can be *detached* when a peer that mapped it does not
//! confirm unmapping it: its bytes move to fresh memory at the same address. The copy must
//! not race a write into the region, or that write would be lost, so the transfers that
//! write into a region are counted apart ([`Region::begin_write`]): a detach holds new ones
//! back, waits for those running, and only then copies. Local application writes are not
//! counted; as with transfers, the application must not write a range while the region may
//! be detached under it (see `Channel::deregister`).
//!
//! A peer may break that contract, so the engine never lends a region's bytes as a
//! reference: every access is a raw copy or a system call ([`crate::peer_memory`]), and a
//! racing peer can make the bytes wrong, never the program's behaviour undefined.

use crate::error::{Error, Result};
use crate::peer_memory::PeerRange;
use kvbridge_proto::msg::{MemKind, RegionInfo};
use kvbridge_proto::RegionId;
use std::alloc::Layout;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;

/// Alignment of owned regions (a page).
pub const REGION_ALIGN: usize = 4096;

/// Huge page size used for large owned regions.
const HUGE_PAGE: usize = 2 << 20;

/// A registered memory region. Cheap to clone (a reference-counted handle).
#[derive(Clone)]
pub struct Region {
    inner: Arc<RegionInner>,
}

struct RegionInner {
    id: RegionId,
    ptr: NonNull<u8>,
    len: usize,
    page_size: usize,
    /// Who frees the memory.
    backing: Backing,
    /// The memfd behind a shared mapping: whether peers may still map it, and whether the
    /// region's memory still is that memfd's pages.
    memfd: Mutex<ShmBacking>,
    in_use: AtomicUsize,
    /// Of `in_use`: transfers that write into the region. A detach waits for them.
    writing: AtomicUsize,
    /// Set while a detach waits for writers and copies: new writers wait until it is over.
    detaching: AtomicBool,
    /// One detach at a time (two peers may give up on the same region at once).
    detach_lock: tokio::sync::Mutex<()>,
    /// Held by the copy of a detach (the bare one included), so that two never overlap;
    /// `memfd` is not held meanwhile, so that readers of it do not wait for the copy.
    copy_lock: Mutex<()>,
    /// Peers that mapped the region and have not confirmed unmapping it (abandoned ones
    /// included, until the region is detached).
    exports: AtomicUsize,
    /// Peers that were told the region's address for cross-memory attach and have not
    /// confirmed they stopped copying (`cma.rs`, *Safety of unmapping*).
    cma_exports: AtomicUsize,
    /// A peer was told the address and never confirmed: its memory may still be written.
    tainted: AtomicBool,
    /// Of `exports`: peers given up on (they did not confirm in time); the region must be
    /// detached before they stop counting.
    abandoned: AtomicUsize,
    idle: Notify,
}

/// A region's memfd, for the shared-memory transport.
struct ShmBacking {
    /// The descriptor peers may map: `Some` while the region is offered to peers on this
    /// host; `None` for heap and caller memory, and once the region was withdrawn from
    /// shared memory (it is never offered again, so no new mapping can appear).
    fd: Option<OwnedFd>,
    /// Whether the region's memory still is the memfd's pages (peers' mappings reach it);
    /// false for heap and caller memory, and after [`Region::detach`].
    mapped: bool,
}

/// Who frees a region's memory.
enum Backing {
    /// `std::alloc` with this layout.
    Heap(Layout),
    /// A mapping of `len` bytes (memfd-backed, or detached anonymous memory).
    Mapped,
    /// The caller.
    Caller,
}

// SAFETY: the region is a raw byte buffer that this crate touches only through raw copies
// and system calls, never through a reference (`crate::peer_memory`), so access from any
// thread, racing or not, is no undefined behaviour; the bookkeeping fields are atomics or
// behind locks; and the memory stays allocated until the last handle drops (`Drop`).
unsafe impl Send for RegionInner {}
// SAFETY: as for `Send`: a shared `RegionInner` offers nothing beyond raw access and atomics.
unsafe impl Sync for RegionInner {}

impl Drop for RegionInner {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: allocated in `Region::alloc` with this layout; last handle is gone.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: mapped in `Region::alloc` (or remapped by `detach`) with this length;
            // the last handle is gone.
            Backing::Mapped => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.len);
            },
            Backing::Caller => {}
        }
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("id", &self.inner.id)
            .field("len", &self.inner.len)
            .field("page_size", &self.inner.page_size)
            .field("owned", &!matches!(self.inner.backing, Backing::Caller))
            .field("shared", &self.is_shared())
            .finish()
    }
}

fn new_region_id() -> RegionId {
    let mut b = [0u8; 16];
    crate::random::rand_bytes(&mut b);
    RegionId(b)
}

impl Region {
    /// Allocates `len` bytes of page-aligned, zeroed memory and touches every page, so that
    /// the first transfer into it does not pay for page faults.
    ///
    /// The memory is a shared mapping of a sealed memfd, so that a peer on the same host can
    /// map it (the shared-memory transport); where memfds are unavailable it falls back to
    /// private memory. Large regions are asked to use huge pages (`MADV_HUGEPAGE`), which
    /// shared memory gets only where the kernel's `shmem_enabled` allows it.
    pub fn alloc(len: usize, page_size: usize) -> Result<Region> {
        if len == 0 || page_size == 0 {
            return Err(Error::Local(
                "region length and page size must be > 0".into(),
            ));
        }
        // Every page is touched below: asking for more than the machine can give would end
        // in the OOM killer (a memfd or an overcommitted mapping succeeds at first), so it
        // is refused here with the sizes named.
        if let Some(avail) = available_memory() {
            if len as u64 > avail {
                return Err(Error::Local(format!(
                    "could not allocate a region of {len} bytes: only {avail} bytes of memory are available"
                )));
            }
        }
        if std::env::var("KVBRIDGE_REGION_MEMFD").is_ok_and(|v| v == "0") {
            return Self::alloc_private(len, page_size);
        }
        match memfd(len) {
            Ok(fd) => Self::alloc_memfd(fd, len, page_size),
            Err(e) => {
                tracing::debug!(error = %e, "memfd unavailable; region in private memory");
                Self::alloc_private(len, page_size)
            }
        }
    }

    fn alloc_memfd(fd: OwnedFd, len: usize, page_size: usize) -> Result<Region> {
        // SAFETY: a fresh shared mapping of our own sealed memfd of `len` bytes.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Local(format!(
                "could not map a region of {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        let ptr = NonNull::new(p.cast::<u8>()).expect("mmap never returns null on success");
        if len >= HUGE_PAGE {
            // SAFETY: the range is our mapping; the advice is a hint and may fail.
            unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        }
        prefault(ptr, len);
        Ok(Self::wrap(ptr, len, page_size, Backing::Mapped, Some(fd)))
    }

    fn alloc_private(len: usize, page_size: usize) -> Result<Region> {
        // Large regions are aligned to a huge page and asked to use them: a KV buffer is
        // gigabytes written at random pages, and with 4 KiB pages the copies into it spend
        // their time in TLB misses.
        let align = if len >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            REGION_ALIGN
        };
        let layout = Layout::from_size_align(len, align)
            .map_err(|e| Error::Local(format!("bad region layout: {e}")))?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::Local(format!("could not allocate a region of {len} bytes")))?;
        if align == HUGE_PAGE {
            // SAFETY: the range is our allocation; the advice is a hint and may fail.
            unsafe {
                libc::madvise(
                    ptr.as_ptr().cast(),
                    len & !(HUGE_PAGE - 1),
                    libc::MADV_HUGEPAGE,
                )
            };
        }
        prefault(ptr, len);
        Ok(Self::wrap(ptr, len, page_size, Backing::Heap(layout), None))
    }

    fn wrap(
        ptr: NonNull<u8>,
        len: usize,
        page_size: usize,
        backing: Backing,
        memfd: Option<OwnedFd>,
    ) -> Region {
        let mapped = memfd.is_some();
        Region {
            inner: Arc::new(RegionInner {
                id: new_region_id(),
                ptr,
                len,
                page_size,
                backing,
                memfd: Mutex::new(ShmBacking { fd: memfd, mapped }),
                in_use: AtomicUsize::new(0),
                writing: AtomicUsize::new(0),
                detaching: AtomicBool::new(false),
                detach_lock: tokio::sync::Mutex::new(()),
                copy_lock: Mutex::new(()),
                exports: AtomicUsize::new(0),
                cma_exports: AtomicUsize::new(0),
                tainted: AtomicBool::new(false),
                abandoned: AtomicUsize::new(0),
                idle: Notify::new(),
            }),
        }
    }

    /// Wraps memory the caller owns.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, and stay valid until the region is
    /// deregistered from every channel it was registered with *and* every handle is dropped.
    /// The caller must not access a range while a transfer into or out of it is in flight.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, page_size: usize) -> Result<Region> {
        let ptr = NonNull::new(ptr).ok_or_else(|| Error::Local("null region pointer".into()))?;
        if len == 0 || page_size == 0 {
            return Err(Error::Local(
                "region length and page size must be > 0".into(),
            ));
        }
        Ok(Self::wrap(ptr, len, page_size, Backing::Caller, None))
    }

    /// Whether peers on this host may map the region (it is memfd-backed, and was neither
    /// withdrawn from shared memory nor detached). Peers reach a region that is not shared
    /// over TCP.
    pub fn is_shared(&self) -> bool {
        self.backing().fd.is_some()
    }

    /// Whether the region was detached from its memfd (a peer that mapped it did not
    /// confirm unmapping it in time: its bytes were moved to fresh memory at the same
    /// address): peers' old mappings no longer reach its memory, and it is not shared any
    /// more.
    pub fn is_detached(&self) -> bool {
        !self.backing().mapped && matches!(self.inner.backing, Backing::Mapped)
    }

    fn backing(&self) -> std::sync::MutexGuard<'_, ShmBacking> {
        self.inner.memfd.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A duplicate of the region's memfd, while it is offered (a duplicate, so that a
    /// concurrent [`Region::withdraw`] or [`Region::detach`] cannot close it under the
    /// caller).
    pub(crate) fn memfd(&self) -> Option<OwnedFd> {
        let g = self.backing();
        g.fd.as_ref().and_then(|fd| fd.try_clone().ok())
    }

    /// Stops offering the region over shared memory, for good: no peer maps it from now on
    /// (sessions that export it ask their peer to unmap it at their next sync), and it is
    /// reached over TCP. Mappings peers already hold still reach its memory until they are
    /// confirmed gone or the region is detached.
    pub(crate) fn withdraw(&self) {
        self.backing().fd = None;
    }

    /// Marks the region as mapped by a peer until the guard is released.
    pub(crate) fn begin_export(&self) -> RegionExport {
        self.inner.exports.fetch_add(1, Ordering::SeqCst);
        RegionExport {
            region: Some(self.clone()),
            cma: false,
        }
    }

    /// Marks the region's address as known to a peer for cross-memory attach until the
    /// guard is confirmed. Counted before the address leaves.
    pub(crate) fn begin_cma_export(&self) -> RegionExport {
        self.inner.cma_exports.fetch_add(1, Ordering::AcqRel);
        RegionExport {
            region: Some(self.clone()),
            cma: true,
        }
    }

    /// Peers that may copy into the region with cross-memory attach (they know its address
    /// and have not confirmed they stopped).
    pub fn cma_exports(&self) -> usize {
        self.inner.cma_exports.load(Ordering::Acquire)
    }

    /// Whether a peer that knew the region's address for cross-memory attach never
    /// confirmed that it stopped copying: the memory may still be written by it and must
    /// not be freed or reused while that peer lives.
    pub fn is_tainted(&self) -> bool {
        self.inner.tainted.load(Ordering::Acquire)
    }

    /// Whether the region is one that cross-memory attach may carry: its memory is not a
    /// memfd peers can map (caller memory, or private memory).
    ///
    /// Not while its memory still is a memfd's pages, even withdrawn: a detach may be about
    /// to copy them away, and a copy by address is not held back by the detach's gate.
    pub(crate) fn wants_cma(&self) -> bool {
        !self.backing().mapped
    }

    /// Peers that mapped the region and have not confirmed unmapping it.
    pub fn exports(&self) -> usize {
        self.inner.exports.load(Ordering::Acquire)
    }

    /// Exports whose peer may still confirm (not abandoned): peers that may still be
    /// copying into the region on behalf of a live session.
    pub(crate) fn live_exports(&self) -> usize {
        // Finishing an abandoned export lowers `abandoned` before `exports`, and `exports`
        // is read first here: a race can only over-count live exports (a waiter then waits
        // for the next wake-up), never hide one.
        let ex = self.inner.exports.load(Ordering::SeqCst);
        let ab = self.inner.abandoned.load(Ordering::SeqCst);
        ex.saturating_sub(ab)
    }

    /// Cuts the region loose from its memfd: its bytes are copied to fresh anonymous memory
    /// that replaces the shared mapping at the same address, so copies a peer may still make
    /// into the memfd land in pages this process no longer uses. The region keeps working
    /// (over TCP from then on; it is withdrawn from shared memory too). A no-op for regions
    /// that are not memfd-backed or already detached.
    ///
    /// Nothing may write into the region meanwhile, or the write is lost: this is the bare
    /// copy, for a caller that excluded writers ([`Region::detach_quiesced`] does), or that
    /// has no choice (a session task dropped without its teardown).
    pub(crate) fn detach(&self) -> Result<()> {
        let _copy = self
            .inner
            .copy_lock
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        {
            let mut g = self.backing();
            g.fd = None;
            if !g.mapped {
                return Ok(());
            }
        }
        let len = self.inner.len;
        // SAFETY: a fresh private anonymous mapping; the kernel picks the address.
        let tmp = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if tmp == libc::MAP_FAILED {
            return Err(Error::Local(format!(
                "cannot detach region {}: {}",
                self.id(),
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: both ranges are `len` bytes of live mappings that do not overlap; then
        // the anonymous pages move over the region's address atomically (MREMAP_FIXED
        // unmaps the shared mapping there), and `tmp` is gone. The system call itself, not
        // libc's `mremap`: in a build with the `ucx` feature, where UCX's memory hooks
        // (libucm) stand in for that symbol, a move to a fixed address failed with EINVAL
        // (found by a revoke test of the shared-memory backend; `tests/shm_detach.rs` checks
        // `is_detached` in that build), and the region stayed shared.
        let moved = unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr(), tmp.cast::<u8>(), len);
            libc::syscall(
                libc::SYS_mremap,
                tmp,
                len,
                len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                self.as_ptr().cast::<libc::c_void>(),
            ) as *mut libc::c_void
        };
        if moved == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: tmp is still our mapping when mremap failed.
            unsafe { libc::munmap(tmp, len) };
            return Err(Error::Local(format!(
                "cannot detach region {}: {e}",
                self.id()
            )));
        }
        self.backing().mapped = false;
        tracing::warn!(region = %self.id(), "region detached from its memfd: a peer did not confirm unmapping it");
        Ok(())
    }

    /// [`Region::detach`] with writers excluded: new transfers that write into the region
    /// wait ([`Region::wait_not_detaching`]) while the running ones finish (within
    /// `writers_limit`: a transfer's payload has the op deadline to arrive, so none runs
    /// longer), then the bytes are copied. Bytes a transfer wrote before the copy are
    /// carried by it; none is written during it.
    pub(crate) async fn detach_quiesced(&self, writers_limit: Duration) -> Result<()> {
        let _one = self.inner.detach_lock.lock().await;
        if !self.backing().mapped {
            return self.detach();
        }
        // SeqCst pairs with `begin_write`: either a writer sees the flag and backs off, or
        // the count below sees the writer.
        self.inner.detaching.store(true, Ordering::SeqCst);
        // Cleared however this ends (a task aborted mid-way included), and only once the
        // copy is over: the guard moves into the copy's thread below.
        let held = HoldingWriters(self.clone());
        let writers = self.wait_for(|r| r.inner.writing.load(Ordering::SeqCst) == 0);
        if tokio::time::timeout(writers_limit, writers).await.is_err() {
            tracing::error!(region = %self.id(), writing = self.inner.writing.load(Ordering::SeqCst),
                "transfers still write into the region after {writers_limit:?}; detaching it anyway");
        }
        // The copy of a large region takes a while: off the async workers.
        let me = self.clone();
        let r = tokio::task::spawn_blocking(move || {
            let r = me.detach();
            drop(held);
            r
        })
        .await
        .unwrap_or_else(|e| Err(Error::Local(format!("the detach copy failed: {e}"))));
        r
    }

    /// Whether a detach is holding writers back right now.
    pub(crate) fn detaching(&self) -> bool {
        self.inner.detaching.load(Ordering::SeqCst)
    }

    /// Waits (at most `limit`) until no detach holds writers back.
    pub(crate) async fn wait_not_detaching(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.wait_for(|r| !r.detaching())).await;
    }

    /// Resolves once `cond` holds; re-checked whenever a use, an export or a detach ends.
    pub(crate) async fn wait_for(&self, cond: impl Fn(&Region) -> bool) {
        loop {
            let idle = self.inner.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if cond(self) {
                return;
            }
            idle.await;
        }
    }

    /// The region's id, as peers address it.
    pub fn id(&self) -> RegionId {
        self.inner.id
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty (never: regions have a positive size).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Page size in bytes.
    pub fn page_size(&self) -> usize {
        self.inner.page_size
    }

    /// Number of whole pages.
    pub fn pages(&self) -> usize {
        self.inner.len / self.inner.page_size
    }

    /// Base address.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.ptr.as_ptr()
    }

    /// Whether `offset..offset+len` lies inside the region.
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset
            .checked_add(len)
            .is_some_and(|end| end <= self.inner.len as u64)
    }

    /// Copies `data` into the region at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<()> {
        if !self.contains(offset as u64, data.len() as u64) {
            return Err(Error::Local(format!(
                "write of {} bytes at {offset} is outside region {} of {} bytes",
                data.len(),
                self.id(),
                self.len()
            )));
        }
        // SAFETY: the range is inside the region (checked above), which stays allocated while
        // `self` lives. A raw copy, so a transfer racing it (against the module's contract)
        // leaves wrong bytes, not undefined behaviour. `data` is a live reference, and no
        // reference to a region's memory is ever formed (`crate::peer_memory`), so the two
        // do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.as_ptr().add(offset), data.len())
        };
        Ok(())
    }

    /// Copies `out.len()` bytes from the region at `offset`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<()> {
        if !self.contains(offset as u64, out.len() as u64) {
            return Err(Error::Local(format!(
                "read of {} bytes at {offset} is outside region {} of {} bytes",
                out.len(),
                self.id(),
                self.len()
            )));
        }
        // SAFETY: as in `write_at`, with the roles swapped: a peer writing the range meanwhile
        // leaves `out` with wrong bytes, never with a reference over memory it writes.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    /// The region's description for a peer.
    pub fn info(&self) -> RegionInfo {
        RegionInfo {
            id: self.id(),
            len: self.len() as u64,
            page_size: self.page_size() as u64,
            kind: MemKind::Cpu,
        }
    }

    /// Marks the region as touched by a transfer that only reads it, until the guard drops.
    pub(crate) fn begin_use(&self) -> RegionUse {
        self.inner.in_use.fetch_add(1, Ordering::AcqRel);
        RegionUse {
            region: self.clone(),
            writes: false,
            windows: Vec::new(),
        }
    }

    /// Marks the region as touched by a transfer that writes into it, until the guard
    /// drops. The caller checks [`Region::detaching`] after this and, when set, drops the
    /// guard and waits: a detach is copying the region, and a write now would be lost.
    pub(crate) fn begin_write(&self) -> RegionUse {
        self.inner.in_use.fetch_add(1, Ordering::AcqRel);
        self.inner.writing.fetch_add(1, Ordering::SeqCst);
        RegionUse {
            region: self.clone(),
            writes: true,
            windows: Vec::new(),
        }
    }

    /// Transfers touching the region right now.
    pub fn in_use(&self) -> usize {
        self.inner.in_use.load(Ordering::Acquire)
    }

    /// Waits until no transfer touches the region, no peer's mapping reaches its memory
    /// (every peer confirmed unmapping it, or it was detached), and no peer may copy into it
    /// with cross-memory attach.
    pub(crate) async fn quiesce(&self) {
        self.wait_for(|r| {
            r.in_use() == 0 && (r.exports() == 0 || !r.backing().mapped) && r.cma_exports() == 0
        })
        .await
    }
}

/// Clears [`Region::detaching`] when dropped, and wakes the writers it held back.
struct HoldingWriters(Region);

impl Drop for HoldingWriters {
    fn drop(&mut self) {
        self.0.inner.detaching.store(false, Ordering::SeqCst);
        self.0.inner.idle.notify_waiters();
    }
}

/// Prefaults a fresh mapping: zeroed memory is mapped lazily.
fn prefault(ptr: NonNull<u8>, len: usize) {
    for off in (0..len).step_by(REGION_ALIGN) {
        // SAFETY: off < len, inside the mapping.
        unsafe { ptr.as_ptr().add(off).write_volatile(0) };
    }
}

/// A peer's mapping of a region (or its knowledge of the region's address, for
/// cross-memory attach), counted until released.
pub(crate) struct RegionExport {
    region: Option<Region>,
    /// Cross-memory attach rather than a mapping.
    cma: bool,
}

impl RegionExport {
    /// The peer confirmed it unmapped the region (or stopped copying into it).
    pub(crate) fn confirmed(mut self) {
        if let Some(r) = self.region.take() {
            r.end_export(self.cma);
        }
    }

    /// The peer did not confirm in time: it no longer counts as live (detachers do not
    /// wait for it), but it keeps counting as an export until [`AbandonedExport::finish`],
    /// after the region was detached.
    ///
    /// An address given for cross-memory attach has nothing to detach: dropping the export
    /// keeps it counted and taints the region (see `Drop`), and this returns `None`.
    pub(crate) fn abandon(mut self) -> Option<AbandonedExport> {
        if self.cma {
            drop(self);
            return None;
        }
        let r = self
            .region
            .take()
            .expect("an export holds its region until released");
        r.inner.abandoned.fetch_add(1, Ordering::SeqCst);
        r.inner.idle.notify_waiters();
        Some(AbandonedExport { region: Some(r) })
    }
}

impl Drop for RegionExport {
    /// Released without confirmation or teardown (a session task dropped mid-way): the peer
    /// may still hold a mapping, so the region is detached at once, writers or not. Memory a
    /// peer reaches by address cannot be detached: the export stays counted (so
    /// `deregister` cannot report the region quiet) and the region is marked tainted.
    fn drop(&mut self) {
        if let Some(r) = self.region.take() {
            if self.cma {
                r.inner.tainted.store(true, Ordering::Release);
                tracing::error!(region = %r.id(), "a peer did not confirm it stopped copying into this region (cross-memory attach); its memory may still be written while that peer lives");
                return;
            }
            if let Err(e) = r.detach() {
                tracing::error!(error = %e, "region could not be detached");
            }
            r.end_export(false);
        }
    }
}

/// An export whose peer did not confirm unmapping the region: it stops counting once the
/// region is detached.
pub(crate) struct AbandonedExport {
    region: Option<Region>,
}

impl AbandonedExport {
    /// The abandoned region.
    pub(crate) fn region(&self) -> &Region {
        self.region.as_ref().expect("held until finished")
    }

    /// The region was detached (by whoever came first): the peer's mapping reaches nothing
    /// of ours any more.
    pub(crate) fn finish(mut self) {
        if let Some(r) = self.region.take() {
            r.end_abandoned();
        }
    }
}

impl Drop for AbandonedExport {
    /// Dropped before [`AbandonedExport::finish`] (a task aborted mid-detach): detach now.
    fn drop(&mut self) {
        if let Some(r) = self.region.take() {
            if let Err(e) = r.detach() {
                tracing::error!(error = %e, "region could not be detached");
            }
            r.end_abandoned();
        }
    }
}

impl Region {
    fn end_export(&self, cma: bool) {
        let c = if cma {
            &self.inner.cma_exports
        } else {
            &self.inner.exports
        };
        c.fetch_sub(1, Ordering::SeqCst);
        self.inner.idle.notify_waiters();
    }

    fn end_abandoned(&self) {
        // `abandoned` first, `exports` after (see `live_exports`).
        self.inner.abandoned.fetch_sub(1, Ordering::SeqCst);
        self.inner.exports.fetch_sub(1, Ordering::SeqCst);
        self.inner.idle.notify_waiters();
    }
}

/// Creates a sealed memfd of `len` bytes, a region's memory (it can neither shrink nor grow,
/// so a peer that maps it cannot be made to fault).
pub(crate) fn memfd(len: usize) -> io::Result<OwnedFd> {
    let name = c"kvbridge-region";
    // SAFETY: a valid C string; flags are constants.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fd is open; len fits off_t on 64-bit Linux.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: fd is an open memfd created with MFD_ALLOW_SEALING.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// A local range touched by a transfer; holds the region in use until dropped.
pub(crate) struct LocalSlice {
    pub(crate) region: RegionUse,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl LocalSlice {
    /// Start of the range.
    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: `offset + len` was checked against the region when the slice was made (in
        // `resolve`, or by the channel for local ranges), and the region stays allocated
        // while `self.region` holds it in use.
        unsafe { self.region.region().as_ptr().add(self.offset) }
    }

    /// The bytes, as a raw range: a peer may write them at the same time
    /// ([`crate::peer_memory`]).
    pub(crate) fn as_range(&self) -> PeerRange<'_> {
        // SAFETY: `offset + len` was checked against the region when the slice was made; the
        // region stays allocated (registered or in use) while `self` is borrowed; and no
        // reference to registered memory is ever formed (`peer_memory`).
        unsafe { PeerRange::new(self.ptr(), self.len) }
    }
}

/// Guard of one transfer touching a region.
pub(crate) struct RegionUse {
    region: Region,
    /// Whether the transfer writes into the region (counted in `writing`).
    writes: bool,
    /// The write windows the transfer lands in (`crate::grant`): each counts it until the
    /// guard drops, so closing a window can wait for the writes that passed it.
    windows: Vec<crate::landing::LandingHold>,
}

impl RegionUse {
    pub(crate) fn region(&self) -> &Region {
        &self.region
    }

    /// Another guard of the same kind on the same region (a batch split in parts).
    pub(crate) fn again(&self) -> RegionUse {
        let mut u = if self.writes {
            self.region.begin_write()
        } else {
            self.region.begin_use()
        };
        u.windows = self.windows.clone();
        u
    }

    /// Counts this transfer in `windows` until it ends.
    pub(crate) fn within(mut self, windows: Vec<crate::landing::LandingHold>) -> RegionUse {
        self.windows = windows;
        self
    }
}

impl Drop for RegionUse {
    fn drop(&mut self) {
        let mut idle = false;
        if self.writes {
            idle |= self.region.inner.writing.fetch_sub(1, Ordering::SeqCst) == 1;
        }
        idle |= self.region.inner.in_use.fetch_sub(1, Ordering::AcqRel) == 1;
        if idle {
            self.region.inner.idle.notify_waiters();
        }
    }
}

/// The kernel's policy for huge pages in shared memory, the setting chosen in
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` (`never`, `advise`, `always`,
/// `within_size`, ...); `None` where it cannot be read. Regions are memfds, which get huge
/// pages only where this is `advise` (they ask with `MADV_HUGEPAGE`) or broader: with
/// `never` every copy into a region walks 4 KiB pages. The reference engine's demo reports
/// it beside its KV rate (docs/engine.md: 21.0 against 15.7 GiB/s with `advise`, medians of
/// 6 alternated runs on a 2-core VM).
pub fn shared_huge_pages() -> Option<String> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    chosen_setting(&s)
}

/// The bracketed word of a sysfs choice list such as `always [never] deny`.
fn chosen_setting(list: &str) -> Option<String> {
    let start = list.find('[')? + 1;
    let len = list[start..].find(']')?;
    Some(list[start..start + len].to_string())
}

/// `MemAvailable` of `/proc/meminfo` in bytes (Linux); `None` where it cannot be read.
fn available_memory() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = s
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    #[test]
    fn chosen_setting_is_the_bracketed_word() {
        let list = "always within_size advise [never] deny force\n";
        assert_eq!(super::chosen_setting(list).as_deref(), Some("never"));
        assert_eq!(
            super::chosen_setting("[advise] never").as_deref(),
            Some("advise")
        );
        assert_eq!(super::chosen_setting("always never"), None);
        assert_eq!(super::chosen_setting("always [never"), None);
    }
}
