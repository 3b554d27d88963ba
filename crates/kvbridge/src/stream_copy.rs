//! Copies of large payloads into memory the copying thread will not read again: streaming
//! (non-temporal) stores.
//!
//! A KV chunk copied into a peer's receive buffer is read later by its decoder, not by the
//! thread that copied it. An ordinary copy first reads every destination line into the cache
//! (a read for ownership: memory traffic that carries nothing) and then leaves the lines
//! there, evicting what the host's other work had cached. Streaming stores write whole lines
//! straight to memory. Measured on a 2-core AMD EPYC VM (C, blocks copied into a 512 MiB
//! destination, best of 3), glibc 2.36's `memcpy` against AVX2 streaming stores:
//!
//! | block | cached source | source cold (1 GiB) |
//! |---|---|---|
//! | 64 KiB | 29 → 39 GiB/s | 20 → 23 GiB/s |
//! | 1 MiB | 25 → 37 GiB/s | 18 → 25 GiB/s |
//! | 8 MiB | 25 → 38 GiB/s | 18 → 25 GiB/s |
//!
//! glibc switches to streaming stores only past three quarters of the cache a thread shares
//! (about 12 MiB there), because a general `memcpy`'s caller often reads the destination
//! next; a transfer engine's caller does not. Below [`STREAM_MIN`] the ordinary copy is kept:
//! a small destination (a notification's payload, a page of a short prompt) is cheap to keep
//! cached and may well be read soon.

/// Smallest copy that uses streaming stores.
pub(crate) const STREAM_MIN: usize = 64 << 10;

/// Copies `len` bytes from `src` to `dst`, with streaming stores when the copy is at least
/// [`STREAM_MIN`] bytes and the CPU has them (x86-64 with AVX2), else with an ordinary copy.
/// Every byte is in place, and ordered before any later store of this thread, on return.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: both ranges valid for `len` bytes, not overlapping.
pub(crate) unsafe fn copy(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_MIN && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the caller's contract; AVX2 was detected just above.
        unsafe { stream_avx2(src, dst, len) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Streaming-store copy: an ordinary copy up to the first 32-byte aligned destination
/// address, 32-byte streaming stores for the body, a store fence, then an ordinary copy of
/// what is left.
///
/// # Safety
/// As [`copy`], and the CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn stream_avx2(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};
    let head = dst.align_offset(32).min(len);
    // SAFETY: every pointer below stays inside the two ranges the caller vouched for
    // (offsets only grow up to `len`); stores through `d` are 32-byte aligned; AVX2 is
    // there (the caller's contract).
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, head);
        let (mut s, mut d, mut n) = (src.add(head), dst.add(head), len - head);
        // Four lines' worth of loads in flight per step.
        while n >= 128 {
            let a = _mm256_loadu_si256(s.cast::<__m256i>());
            let b = _mm256_loadu_si256(s.add(32).cast::<__m256i>());
            let c = _mm256_loadu_si256(s.add(64).cast::<__m256i>());
            let e = _mm256_loadu_si256(s.add(96).cast::<__m256i>());
            _mm256_stream_si256(d.cast::<__m256i>(), a);
            _mm256_stream_si256(d.add(32).cast::<__m256i>(), b);
            _mm256_stream_si256(d.add(64).cast::<__m256i>(), c);
            _mm256_stream_si256(d.add(96).cast::<__m256i>(), e);
            (s, d, n) = (s.add(128), d.add(128), n - 128);
        }
        while n >= 32 {
            _mm256_stream_si256(d.cast::<__m256i>(), _mm256_loadu_si256(s.cast::<__m256i>()));
            (s, d, n) = (s.add(32), d.add(32), n - 32);
        }
        // Streaming stores are weakly ordered: without the fence, the store that tells the
        // peer the bytes landed (a notification, a completion) could become visible first.
        _mm_sfence();
        std::ptr::copy_nonoverlapping(s, d, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Copies `len` bytes between offsets `so` and `dso` of two buffers with `f`, and checks
    /// the copy and that no byte around the destination range changed.
    fn check(f: unsafe fn(*const u8, *mut u8, usize), len: usize, so: usize, dso: usize) {
        let src = pattern(len + so + 64, 7);
        let mut dst = pattern(len + dso + 64, 200);
        let before = dst.clone();
        // SAFETY: both ranges are inside their own vectors.
        unsafe { f(src.as_ptr().add(so), dst.as_mut_ptr().add(dso), len) };
        assert_eq!(
            &dst[dso..dso + len],
            &src[so..so + len],
            "len {len} so {so} dso {dso}"
        );
        assert_eq!(
            &dst[..dso],
            &before[..dso],
            "before the range: len {len} dso {dso}"
        );
        assert_eq!(
            &dst[dso + len..],
            &before[dso + len..],
            "after: len {len} dso {dso}"
        );
    }

    #[test]
    fn streaming_copies_every_length_and_alignment_exactly() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            for len in (0..=300).chain([4095, 4096, 4097, 65_535, 65_536, 65_537]) {
                for so in [0, 1, 7, 31, 32, 33] {
                    for dso in [0, 1, 16, 31, 32, 63] {
                        check(stream_avx2, len, so, dso);
                    }
                }
            }
            return;
        }
        eprintln!("no AVX2 here: the streaming path is not used on this CPU");
    }

    #[test]
    fn copy_is_exact_below_and_above_the_streaming_size() {
        for len in [
            0,
            1,
            100,
            STREAM_MIN - 1,
            STREAM_MIN,
            STREAM_MIN + 1,
            (1 << 20) + 13,
        ] {
            for (so, dso) in [(0, 0), (3, 5), (32, 1)] {
                check(copy, len, so, dso);
            }
        }
    }
}
