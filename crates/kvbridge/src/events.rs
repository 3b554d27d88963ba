//! What the channel tells its users: notifications from peers, changes in the set of live
//! sessions, and the counts it keeps. Plain data, below every task that produces it.

use crate::error::Error;
use kvbridge_proto::{Incarnation, PeerId};

/// What the channel holds right now; a failed handshake must leave all of it at zero.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Session tasks alive (handshaking or established).
    pub sessions: usize,
    /// Established sessions.
    pub established: usize,
    /// Dials waiting for a handshake.
    pub dialing: usize,
    /// Data-connection tokens outstanding.
    pub tokens: usize,
    /// Batches waiting for completion across all sessions.
    pub batches_in_flight: usize,
    /// Payload bytes of those batches (each peer's share is bounded by
    /// `Limits::max_bytes_in_flight_per_peer`).
    pub bytes_in_flight: u64,
    /// Our batches waiting for room under `Limits::max_bytes_in_flight_per_peer` (not sent
    /// yet: backpressure).
    pub batches_waiting_for_room: usize,
    /// Peer batches refused because they would pass `Limits::max_bytes_in_flight_per_peer`
    /// (each ended its session).
    pub in_flight_refused: u64,
    /// Payload bytes of the peers' batches this side accepted and has not completed yet (a
    /// write being read in, a read's answer not sent yet).
    pub peer_bytes_in_flight: u64,
    /// Answers to our batches cancelled after they were sent (their callers stopped
    /// waiting), read past and dropped when they came: a read's bytes never land once its
    /// cancel returned. A slow peer is not a hostile one, so these end no session.
    pub late_answers_discarded: u64,
    /// Peer batches refused with `AccessDenied`: an op in a direction its region's grant
    /// does not give, or outside the windows open to the peer and to the grant token the
    /// batch names (each ended its session; the first of each peer is logged at WARN).
    pub access_denied: u64,
    /// Sessions that ended since the channel started.
    pub sessions_ended: u64,
    /// Handshakes refused because `max_concurrent_handshakes` were already under way (and
    /// none could be taken from a source holding more), or their source's
    /// `max_handshakes_per_source`.
    pub handshakes_refused: u64,
    /// Handshakes under way that gave their slot to a `Hello` from a source holding fewer
    /// (each ended with [`crate::Error::HandshakeSlotTaken`]).
    pub handshakes_displaced: u64,
    /// Sessions that ended because authentication failed: a peer that could not prove it
    /// knows the shared secret (or sent no proof), a listener that could not, or one side
    /// requiring authentication that the other does not do. Each is logged at WARN with the
    /// peer's address (rate-limited).
    pub auth_failed: u64,
    /// Connections refused on TLS grounds: a failed TLS handshake, a plaintext `Hello` on a
    /// listener that requires TLS, a plaintext `DataHello` on one that requires it on data
    /// connections too, a TLS ClientHello on one that does not speak TLS.
    pub tls_refused: u64,
    /// Our batches copied into (or out of) mapped shared memory instead of going over TCP.
    pub shm_batches: u64,
    /// Our batches copied with cross-memory attach (at least one op; the others into mapped
    /// shared memory) instead of going over TCP.
    pub cma_batches: u64,
    /// Our batches carried by UCX (puts and gets on the channel's UCX worker) instead of
    /// going over TCP; always 0 in a build without the `ucx` feature.
    pub ucx_batches: u64,
    /// Peers' notifications received and not yet taken by the application.
    pub notifications_queued: usize,
    /// Their bytes (with room set aside for notifications being confirmed): never more than
    /// `Limits::max_notify_bytes_queued`.
    pub notify_bytes_queued: u64,
    /// The most bytes `notify_bytes_queued` ever reached.
    pub notify_bytes_peak: u64,
    /// Peers' data connections paused now, each with a notification waiting for room in
    /// its peer's queue (backpressure: `Limits::max_notifications_per_peer`).
    pub notify_paused: usize,
    /// Times a peer's notification had to wait for room since the channel started.
    pub notify_pauses: u64,
    /// Sessions ended because a peer's notification found no room within the op deadline
    /// (each with `Timeout` at step `Notify`).
    pub notify_timeouts: u64,
    /// Notifications and acknowledgements written to an idle data connection by the task
    /// or thread that issued them, skipping the connection's writer (one thread wake-up
    /// less per message on data threads).
    pub frames_fast_lane: u64,
}

/// A change in the set of live sessions, for layers that hold state per peer (the PD
/// receiver releases a sender's reservations when its session goes down).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerEvent {
    /// A session is established.
    Up {
        /// The peer.
        peer: PeerId,
        /// Its incarnation.
        incarnation: Incarnation,
    },
    /// An established session ended. It is sent only after the session's data tasks have
    /// stopped: no batch of that session, in either direction, can land or be served after
    /// a subscriber sees this event.
    Down {
        /// The peer.
        peer: PeerId,
        /// The incarnation that session had.
        incarnation: Incarnation,
        /// Why it ended.
        error: Error,
    },
}

/// An application message from a peer, delivered after every write that peer issued before
/// it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sender.
    pub peer: PeerId,
    /// The sender's incarnation, as its session established it (not as the message claims).
    pub incarnation: Incarnation,
    /// The bytes.
    pub data: Vec<u8>,
}
