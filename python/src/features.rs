//! What this build of the extension carries.

/// Whether this build carries kvbridge's UCX transport (the cargo feature `ucx`).
pub(crate) const UCX_BUILT: bool = cfg!(feature = "ucx");
