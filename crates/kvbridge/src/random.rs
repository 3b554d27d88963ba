//! Random bytes from the operating system, for tokens, canaries and incarnations.

/// Fills `buf` from the operating system's random source.
pub(crate) fn rand_bytes(buf: &mut [u8]) {
    getrandom::fill(buf).expect("the OS random source failed");
}

/// A random u64.
pub(crate) fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    rand_bytes(&mut b);
    u64::from_le_bytes(b)
}
