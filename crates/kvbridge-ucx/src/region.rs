//! Registered memory: a range of this process's memory mapped into UCX (`ucp_mem_map`), so
//! that peers can write and read it one-sided and local operations can use it zero-copy.

use std::ptr;
use std::sync::Arc;

use kvbridge_ucx_sys as sys;

use crate::context::{Context, ContextInner};
use crate::error::{Error, Result, Step};
use crate::status::check;
use crate::wire::RegionDescriptor;

pub(crate) struct RegionInner {
    ctx: Arc<ContextInner>,
    pub(crate) memh: sys::ucp_mem_h,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
    /// Whether `ptr` is our own anonymous mapping, unmapped after UCX let go of it.
    owned: bool,
}

// SAFETY: the memory is reached only through raw-pointer copies (`write`/`read`) and by UCX;
// the memory handle is usable from any thread (context created with `mt_workers_shared`).
unsafe impl Send for RegionInner {}
// SAFETY: as for `Send`; no method hands out a reference into the memory.
unsafe impl Sync for RegionInner {}

impl Drop for RegionInner {
    fn drop(&mut self) {
        // SAFETY: `memh` came from `ucp_mem_map` on this context and is unmapped once. Every
        // in-flight operation on this memory holds an `Arc` of this inner (see
        // `worker::InFlight`), so none can still be running.
        unsafe { sys::ucp_mem_unmap(self.ctx.handle, self.memh) };
        if self.owned {
            // Quarantine, not `munmap`: UCX 1.13's tcp and shared-memory transports do not
            // check a remote key against the target's registrations, so a peer's write
            // through a stale key still lands at this address (on an unmapped range the
            // target process dies of SIGSEGV; on reused memory it corrupts it). The range
            // stays reserved for the life of the process and its pages are dropped: a late
            // write lands in fresh zero pages that nothing else uses.
            // SAFETY: `ptr`/`len` are the private anonymous mapping `alloc` made; dropping its
            // pages affects no other memory.
            unsafe { libc::madvise(self.ptr.cast(), self.len, libc::MADV_DONTNEED) };
        }
    }
}

/// Memory registered with a UCX context. Clones share the registration; it is unmapped
/// (`ucp_mem_unmap`) when the last clone is dropped *and* every operation that uses it has
/// ended, including operations whose wait passed its deadline.
///
/// Registered memory is never lent as a Rust reference: peers write it concurrently, so it
/// is read and written by copies only.
#[derive(Clone)]
pub struct MemRegion {
    pub(crate) inner: Arc<RegionInner>,
}

impl std::fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRegion")
            .field("base", &self.inner.ptr)
            .field("len", &self.inner.len)
            .finish()
    }
}

impl MemRegion {
    /// Allocates `len` zeroed bytes (an anonymous private mapping) and registers them.
    ///
    /// When the region is unmapped its address range is not returned to the system but kept
    /// reserved, its pages dropped: UCX's tcp and shared-memory transports do not refuse a
    /// write through a stale remote key (RDMA hardware does), so the range must never hold
    /// other data or be unmapped. Revoking a region from peers is the protocol's job.
    pub fn alloc(ctx: &Context, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::OutOfRange {
                step: Step::Alloc,
                what: "local region",
                offset: 0,
                len: 0,
                size: 0,
            });
        }
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Os {
                step: Step::Alloc,
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: `p` is a live mapping of `len` bytes that this region owns from here on
        // (and unmaps on failure below).
        match unsafe { Self::map(ctx, p.cast(), len, true) } {
            Ok(r) => Ok(r),
            Err(e) => {
                // SAFETY: the mapping above, which nothing else refers to.
                unsafe { libc::munmap(p, len) };
                Err(e)
            }
        }
    }

    /// Registers existing memory (`ucp_mem_map` of `ptr..ptr+len`).
    ///
    /// # Safety
    /// `ptr..ptr+len` must stay mapped, readable and writable until the last clone of the
    /// returned region is dropped and every operation using it has ended (the region's
    /// drop, which may run inside `Worker` calls or its drop). Peers may write it at any time
    /// while it is registered.
    pub unsafe fn map_existing(ctx: &Context, ptr: *mut u8, len: usize) -> Result<Self> {
        // SAFETY: forwarded from this function's contract.
        unsafe { Self::map(ctx, ptr, len, false) }
    }

    unsafe fn map(ctx: &Context, ptr: *mut u8, len: usize, owned: bool) -> Result<Self> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH)
                as u64,
            address: ptr.cast(),
            length: len,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = ptr::null_mut();
        // SAFETY: the caller guarantees the memory; `params` and `memh` are valid for the call.
        let code = unsafe { sys::ucp_mem_map(ctx.inner.handle, &params, &mut memh) };
        check(code).map_err(|status| Error::Ucx {
            step: Step::MemMap,
            status,
        })?;
        Ok(Self {
            inner: Arc::new(RegionInner {
                ctx: ctx.inner.clone(),
                memh,
                ptr,
                len,
                owned,
            }),
        })
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty (never: a region has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    pub(crate) fn check_range(&self, step: Step, offset: u64, len: u64) -> Result<()> {
        let size = self.inner.len as u64;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::OutOfRange {
                step,
                what: "local region",
                offset,
                len,
                size,
            }),
        }
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(Step::Put, offset as u64, src.len() as u64)?;
        // SAFETY: the range is inside the registered memory (checked above), which is alive
        // while `self` is; the source is a distinct Rust slice.
        unsafe { ptr::copy_nonoverlapping(src.as_ptr(), self.inner.ptr.add(offset), src.len()) };
        Ok(())
    }

    /// Copies bytes of the region at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(Step::Get, offset as u64, dst.len() as u64)?;
        // SAFETY: as in `write`, reading instead.
        unsafe {
            ptr::copy_nonoverlapping(self.inner.ptr.add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// The descriptor a peer needs to reach this region (base, length, packed remote key), in
    /// its envelope: send it to the peer, which passes it to `Worker::unpack_rkey`.
    pub fn descriptor(&self) -> Result<Vec<u8>> {
        let mut buf: *mut std::ffi::c_void = ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: `memh` is live on this context; `buf`/`size` are valid out-pointers.
        let code = unsafe {
            sys::ucp_rkey_pack(self.inner.ctx.handle, self.inner.memh, &mut buf, &mut size)
        };
        check(code).map_err(|status| Error::Ucx {
            step: Step::RkeyPack,
            status,
        })?;
        // SAFETY: UCX returned `size` bytes at `buf`, valid until released just below.
        let rkey = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
        // SAFETY: `buf` came from `ucp_rkey_pack` and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(RegionDescriptor {
            base: self.inner.ptr as u64,
            len: self.inner.len as u64,
            rkey,
        }
        .encode())
    }
}
