//! Which way a session's bytes take: the one decision behind every batch and every data
//! connection, sans-IO so that each case is a row of a table test
//! (`tests/route_choices.rs`).
//!
//! A session reaches the peer's regions through zero or more one-sided backends (a mapping
//! of the peer's memory, cross-memory attach, a UCX endpoint; each says what it can do for
//! a batch in an [`Offer`]) and always through its two-sided TCP data connections. For one
//! batch, [`ways`] lists what to try, in order: a backend may still give the batch back when
//! it posts it (a region revoked in between), and the next way is tried; TCP comes last and
//! never gives a batch back.

/// What one one-sided backend of a session can do for one batch, known before posting it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Offer {
    /// The backend may reach every region the batch names. `false` when it knows it does
    /// not (it then never sees the batch); `true` may still end in the batch given back.
    pub covers: bool,
    /// The backend copies the batch on the calling thread inside `post` (a same-host copy)
    /// rather than handing it to an agent that completes it elsewhere (a UCX worker).
    pub copies_in_caller: bool,
}

/// What the data path knows of one batch and of where it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Batch {
    /// A read (the peer's memory into ours) rather than a write.
    pub read: bool,
    /// The session stripes its TCP batches over more than one data connection.
    pub striped: bool,
    /// The calling task runs on a runtime with other threads, which go on with the
    /// runtime's tasks while this one copies.
    pub caller_may_copy: bool,
    /// The batch names a grant token: only the peer, doing the copy itself, can check the
    /// ops against that token's windows and record who used it.
    pub grant: bool,
}

/// One way to try for a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// The session's one-sided backend at this index of the offers.
    OneSided(usize),
    /// The session's TCP data connections (the writer thread of connection 0 still copies a
    /// batch whose regions are mapped, in order with its frames, unless it names a grant
    /// token).
    TwoSided,
}

/// The ways to try for `batch`, in order, given each one-sided backend's `offers` (in the
/// order the session got them); the last is always [`Way::TwoSided`].
///
/// * A backend that completes elsewhere (UCX) comes first: the session negotiated it for
///   exactly these regions because the operator asked for that transport.
/// * A backend that copies in the caller's task comes next, for writes only, on a runtime
///   with other threads (a current-thread runtime would stall every other task of the
///   process for the copy), and only on an unstriped session (a session that maps the
///   peer's memory opens one data connection, [`data_connections`]). Reads and the writes
///   it declines go to connection 0's writer, which copies them in order with its frames.
/// * A batch that names a grant token goes over TCP only, whatever the offers: a one-sided
///   way would copy without the peer seeing the token (nothing checked, no use recorded).
///   Connection 0's writer does not copy it either ([`Way::TwoSided`]).
/// * TCP takes the rest.
pub fn ways(batch: Batch, offers: &[Offer]) -> impl Iterator<Item = Way> + '_ {
    let one_sided = !batch.grant;
    let elsewhere = offers
        .iter()
        .enumerate()
        .filter(move |(_, o)| one_sided && o.covers && !o.copies_in_caller);
    let caller_copies = one_sided && !batch.read && !batch.striped && batch.caller_may_copy;
    let in_caller = offers
        .iter()
        .enumerate()
        .filter(move |(_, o)| caller_copies && o.covers && o.copies_in_caller);
    elsewhere
        .chain(in_caller)
        .map(|(i, _)| Way::OneSided(i))
        .chain(std::iter::once(Way::TwoSided))
}

/// Data connections an initiator opens for a session: one when the session maps the
/// peer's memory (the copies carry the data, connection 0 only the frames), else the
/// configured number clamped to `1..=max`.
pub fn data_connections(maps_peer_memory: bool, configured: usize, max: usize) -> usize {
    if maps_peer_memory {
        1
    } else {
        configured.clamp(1, max.max(1))
    }
}
