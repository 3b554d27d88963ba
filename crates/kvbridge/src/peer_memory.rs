//! Registered memory is touched through raw ranges, never through references.
//!
//! A registered region is granted to peers, and a peer may write a range of it (over TCP, or
//! with a memcpy into shared memory) while this process reads it, reads into it or sends from
//! it: a peer that breaks the transfer contract, or a hostile one. A Rust reference to those
//! bytes (`&[u8]`, `&mut [u8]`, and so an `IoSlice`) promises the compiler that no one else
//! writes them while it lives; formed over memory a peer can write, it would be undefined
//! behaviour that a remote peer triggers. So payload bytes in registered memory are handed to
//! the kernel as raw `iovec`s (`readv`, `writev`), or copied with `ptr::copy_nonoverlapping`
//! to or from a buffer this process owns where a stream needs a `&[u8]` (TLS, the simulated
//! network). A racing peer can then make the bytes wrong, which it could do anyway, but it
//! cannot make the program's behaviour undefined.

use std::io;
use std::marker::PhantomData;
use std::os::fd::RawFd;

/// Linux refuses `readv` and `writev` with more than this many buffers.
pub(crate) const IOV_MAX: usize = 1024;

/// A byte range that another party may write at any time, valid for `'a`: a raw `iovec`,
/// so a slice of ranges is passed to `readv`/`writev` as it is. Its API yields no reference
/// to the bytes, only copies:
///
/// ```compile_fail
/// fn lend<'a>(r: &'a kvbridge::peer_memory::PeerRange<'a>) -> &'a [u8] {
///     r
/// }
/// ```
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct PeerRange<'a> {
    iov: libc::iovec,
    _valid: PhantomData<&'a mut [u8]>,
}

// SAFETY: a range is a pointer and a length. Every access through it is a system call or a
// raw copy, which are as sound on one thread as on another, and `new`'s contract keeps the
// memory allocated for `'a` wherever the range goes.
unsafe impl Send for PeerRange<'_> {}
// SAFETY: as for `Send`: `&PeerRange` gives no access beyond what a copy of it gives.
unsafe impl Sync for PeerRange<'_> {}

impl std::fmt::Debug for PeerRange<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerRange")
            .field("ptr", &self.iov.iov_base)
            .field("len", &self.iov.iov_len)
            .finish()
    }
}

impl<'a> PeerRange<'a> {
    /// The `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr + len` stays allocated, readable and writable, for `'a`, and no Rust
    /// reference to any of it lives during `'a`.
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize) -> PeerRange<'a> {
        PeerRange {
            iov: libc::iovec {
                iov_base: ptr.cast(),
                iov_len: len,
            },
            _valid: PhantomData,
        }
    }

    /// A buffer this process owns, borrowed exclusively for `'a`.
    pub fn owned(buf: &'a mut [u8]) -> PeerRange<'a> {
        // SAFETY: the exclusive borrow keeps the buffer allocated for `'a` and excludes every
        // other reference to it meanwhile.
        unsafe { PeerRange::new(buf.as_mut_ptr(), buf.len()) }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.iov.iov_len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.iov.iov_len == 0
    }

    /// Drops its first `n` bytes (at most its length).
    fn advance(&mut self, n: usize) {
        let n = n.min(self.iov.iov_len);
        // SAFETY: `n` is at most the length, so the pointer stays inside (or one past) the
        // range `new` was given.
        self.iov.iov_base = unsafe { self.iov.iov_base.cast::<u8>().add(n) }.cast();
        self.iov.iov_len -= n;
    }

    /// Its first `n` bytes (all of it if shorter).
    pub(crate) fn prefix(mut self, n: usize) -> PeerRange<'a> {
        self.iov.iov_len = self.iov.iov_len.min(n);
        self
    }

    /// Copies `src` into the range at `offset`.
    ///
    /// # Panics
    /// When `offset + src.len()` exceeds the range (a bug of the caller).
    pub fn copy_from(&self, offset: usize, src: &[u8]) {
        assert!(
            offset
                .checked_add(src.len())
                .is_some_and(|e| e <= self.len()),
            "copy of {} bytes at {offset} past a range of {}",
            src.len(),
            self.len()
        );
        // SAFETY: the destination lies inside the range (checked above), valid and writable
        // for `'a` (`new`); `src` is a live reference, so it is not part of this range (no
        // reference to the range lives, by `new`'s contract): the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.iov.iov_base.cast::<u8>().add(offset),
                src.len(),
            )
        }
    }

    /// Copies the range's bytes at `offset` into `dst`.
    ///
    /// # Panics
    /// When `offset + dst.len()` exceeds the range (a bug of the caller).
    pub fn copy_to(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset
                .checked_add(dst.len())
                .is_some_and(|e| e <= self.len()),
            "copy of {} bytes at {offset} past a range of {}",
            dst.len(),
            self.len()
        );
        // SAFETY: as in `copy_from`, with the roles swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.iov.iov_base.cast::<u8>().add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        }
    }
}

/// Drops the first `n` bytes of `bufs`, and every range that becomes empty (as
/// `IoSliceMut::advance_slices`).
pub(crate) fn advance(bufs: &mut &mut [PeerRange<'_>], mut n: usize) {
    let mut skip = 0;
    for b in bufs.iter() {
        match n.checked_sub(b.len()) {
            Some(rest) => n = rest,
            None => break,
        }
        skip += 1;
    }
    *bufs = &mut std::mem::take(bufs)[skip..];
    if let Some(first) = bufs.first_mut() {
        first.advance(n);
    } else {
        assert!(n == 0, "advancing past the end of the ranges");
    }
}

/// One `readv` into (at most [`IOV_MAX`] of) `bufs`.
pub(crate) fn readv(fd: RawFd, bufs: &[PeerRange<'_>]) -> io::Result<usize> {
    let n = bufs.len().min(IOV_MAX);
    // SAFETY: `PeerRange` is a transparent `iovec`, and each one is writable memory for its
    // lifetime (`PeerRange::new`), which outlives this call. An invalid `fd` is an error.
    let r = unsafe { libc::readv(fd, bufs.as_ptr().cast(), n as libc::c_int) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// One `writev` from (at most [`IOV_MAX`] of) `bufs`.
pub(crate) fn writev(fd: RawFd, bufs: &[PeerRange<'_>]) -> io::Result<usize> {
    let n = bufs.len().min(IOV_MAX);
    // SAFETY: `PeerRange` is a transparent `iovec`, and each one is readable memory for its
    // lifetime (`PeerRange::new`), which outlives this call. An invalid `fd` is an error.
    let r = unsafe { libc::writev(fd, bufs.as_ptr().cast(), n as libc::c_int) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// The bytes of `bufs`, up to `max`, copied into one owned buffer (for a stream that
/// writes only from a `&[u8]`).
pub(crate) fn gather(bufs: &[PeerRange<'_>], max: usize) -> Vec<u8> {
    let total: usize = bufs.iter().map(PeerRange::len).sum();
    let mut out = vec![0u8; total.min(max)];
    let mut at = 0;
    for b in bufs {
        if at == out.len() {
            break;
        }
        let n = b.len().min(out.len() - at);
        b.copy_to(0, &mut out[at..at + n]);
        at += n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advancing_drops_whole_ranges_then_cuts_the_first() {
        let (mut a, mut b, mut c) = ([0u8; 4], [0u8; 3], [0u8; 5]);
        let mut v = [
            PeerRange::owned(&mut a),
            PeerRange::owned(&mut b),
            PeerRange::owned(&mut c),
        ];
        let mut s: &mut [PeerRange<'_>] = &mut v;
        advance(&mut s, 0);
        assert_eq!(s.len(), 3);
        advance(&mut s, 5);
        assert_eq!((s.len(), s[0].len()), (2, 2));
        advance(&mut s, 2);
        assert_eq!((s.len(), s[0].len()), (1, 5));
        advance(&mut s, 5);
        assert!(s.is_empty());
    }

    #[test]
    fn gathering_takes_the_ranges_in_order_up_to_the_cap() {
        let (mut a, mut b) = ([1u8, 2, 3], [4u8, 5]);
        let v = [PeerRange::owned(&mut a), PeerRange::owned(&mut b)];
        assert_eq!(gather(&v, 100), [1, 2, 3, 4, 5]);
        assert_eq!(gather(&v, 4), [1, 2, 3, 4]);
        assert_eq!(gather(&v[..1], 100), [1, 2, 3]);
        assert_eq!(v[1].prefix(1).len(), 1);
    }

    #[test]
    fn copies_stay_inside_the_range() {
        let mut buf = [0u8; 8];
        let r = PeerRange::owned(&mut buf);
        r.copy_from(2, &[1, 2, 3]);
        let mut out = [0u8; 4];
        r.copy_to(1, &mut out);
        assert_eq!(out, [0, 1, 2, 3]);
        let past =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.copy_from(6, &[1, 2, 3])));
        assert!(past.is_err());
        assert_eq!(buf, [0, 0, 1, 2, 3, 0, 0, 0]);
    }
}
