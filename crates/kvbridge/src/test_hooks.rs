//! The test hooks: delays and failures a test injects into a channel to reproduce an
//! ordering or a fault ([`TestHooks`]).

use std::time::Duration;

/// Injected delays for tests that reproduce orderings (the seed's race, stalled peers).
/// Production code leaves them at their default (no delay).
///
/// Public only with the crate's `test-hooks` feature, which its own tests, the PD crate's
/// tests and the `kvbridge` command (`bench peer --welcome-delay-ms`, a stalled listener
/// for the process tests) turn on: a build without it, as the Python package's, can
/// neither name nor set them, so no deployment stalls its channel by a stray setting.
#[derive(Debug, Clone, Default)]
pub struct TestHooks {
    /// Listener: delay between receiving a data connection and binding it to its session.
    pub listener_bind_delay: Option<Duration>,
    /// Initiator: delay between opening its data connection and binding it to its session.
    pub initiator_bind_delay: Option<Duration>,
    /// Listener: delay before answering a `Hello` (a slow listener mid-handshake).
    pub listener_welcome_delay: Option<Duration>,
    /// Delay before applying each incoming write batch (writes held in flight). This and
    /// `read_serve_delay` act on batches the listener applies, i.e. over TCP: a listener
    /// with either set offers no shared memory.
    pub write_apply_delay: Option<Duration>,
    /// Delay before serving each incoming read batch (reads held in flight).
    pub read_serve_delay: Option<Duration>,
    /// Initiator: delay, on the writer of the data connection, between taking a queued
    /// batch whose regions the peer mapped for us (a read, say) and copying it: a copy under
    /// way when the batch is cancelled.
    pub direct_copy_delay: Option<Duration>,
    /// Counts the batches `direct_copy_delay` held (a test learns that a copy is under way).
    pub direct_copies_delayed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Initiator: the cross-memory-attach probe fails with `EPERM`, as where the kernel
    /// does not permit it (tests the fallback to TCP on hosts where it would work).
    pub cma_deny: bool,
    /// The UCX transports of this channel's worker, instead of what `UCX_TLS` says (tests
    /// run UCX over tcp and over shared memory side by side in one process).
    #[cfg(feature = "ucx")]
    pub ucx_tls: Option<String>,
}
