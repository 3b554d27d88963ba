//! One range of a direct copy, below the copies that take it (`cma.rs`) and the split of a
//! copy over threads (`split_copy.rs`).

/// One range of a direct copy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    /// Address on the peer's side: in this process for a mapping, in the peer's address
    /// space for cross-memory attach.
    pub(crate) remote: usize,
    /// Address of the local range (checked against its region, held in use).
    pub(crate) local: *mut u8,
    /// Bytes.
    pub(crate) len: usize,
}
