//! The direction of a copy: the vocabulary every transport shares, below all of them.

/// Direction of a copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    /// Local → peer.
    Write,
    /// Peer → local.
    Read,
}
