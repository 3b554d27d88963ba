//! The batches of one session waiting for their outcome, and the room they hold under the
//! per-peer limit on bytes in flight.
//!
//! It sits below everything that completes a batch: the data path enters a batch here before
//! its first frame is queued, and the TCP reader (an acknowledgement), the TCP writer and the
//! direct copy (a batch copied without the data connection) take it out and complete it. None
//! of them calls back into the data path.
//!
//! A batch whose caller stopped waiting is cancelled here ([`Pending::cancel`]): it leaves
//! the table, so nothing completes it any more. A reader or writer that works on a batch's
//! memory (fills a read's destinations, sends or copies a write's sources) holds a [`Claim`]
//! on it meanwhile, and a cancel waits for the claims on its batch to drop
//! ([`Pending::wait_released`]). A batch cancelled after it went on the wire leaves a
//! tombstone behind: the peer's late answer to it is recognised, its payload read and
//! dropped ([`Landing::Late`]), and the tombstone keeps the batch's room under the per-peer
//! limit until then (the peer still counts the batch). Batch ids are never reused within a
//! session, so a tombstone names one batch only.

use crate::error::{Error, Result};
use crate::region::LocalSlice;
use kvbridge_proto::handshake::Step;
use kvbridge_proto::PeerId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

/// Who waits for a batch, and what its completion needs.
pub(crate) enum Waiting {
    Write(oneshot::Sender<Result<()>>),
    /// A read: its destinations, held in use until the bytes are in.
    Read(Vec<LocalSlice>, oneshot::Sender<Result<()>>),
    Notify(oneshot::Sender<Result<()>>),
}

impl Waiting {
    /// Tells the waiter the batch's outcome.
    pub(crate) fn complete(self, r: Result<()>) {
        let tx = match self {
            Waiting::Write(tx) | Waiting::Notify(tx) | Waiting::Read(_, tx) => tx,
        };
        let _ = tx.send(r);
    }

    /// A read's destinations (`None` for the others), and the waiter.
    pub(crate) fn into_parts(self) -> (Option<Vec<LocalSlice>>, oneshot::Sender<Result<()>>) {
        match self {
            Waiting::Write(tx) | Waiting::Notify(tx) => (None, tx),
            Waiting::Read(dests, tx) => (Some(dests), tx),
        }
    }
}

/// A batch waiting for completion, with the room it holds under the per-peer limit.
struct Entry {
    waiting: Waiting,
    bytes: u64,
    room: Option<OwnedSemaphorePermit>,
    /// Its request is (being) written on the connection: the peer may answer it.
    sent: bool,
}

/// A batch cancelled after it was sent, whose answer may still come.
struct Late {
    /// A read (its answer carries `bytes` of payload) or a write (its acknowledgement none).
    read: bool,
    bytes: u64,
    /// Its room under the per-peer limit, held until the answer came.
    _room: Option<OwnedSemaphorePermit>,
}

#[derive(Default)]
struct Table {
    map: HashMap<u64, Entry>,
    /// Payload bytes of the batches in `map`.
    bytes: u64,
    /// Set when the session ended: no new batch may wait after that.
    closed: Option<Error>,
    /// Batches cancelled after they were sent, by id.
    late: HashMap<u64, Late>,
    /// Batches whose memory a reader or writer works on now ([`Claim`]), with how many
    /// claims each has: a read is claimed by the writer sending its request and by the
    /// reader landing its answer, and the answer can come before the writer let go.
    claimed: HashMap<u64, Claims>,
    /// Cancels waiting for claims to drop ([`Pending::wait_released`]): a claim that drops
    /// while none waits wakes nobody (no system call on the data path).
    waiters: usize,
    /// Batches the peer refused with a refusal after which it ends the session, each with
    /// that refusal ([`Pending::complete_at_end`]).
    at_end: Vec<(Waiting, Error)>,
}

/// The claims on one batch's memory held now.
#[derive(Debug, Clone, Copy, Default)]
struct Claims {
    /// Claims held.
    held: u32,
    /// Of those, claims held by runtime tasks rather than by threads of their own.
    on_tasks: u32,
}

impl Table {
    /// One more claim on batch `id`.
    fn claim(&mut self, id: u64, own_thread: bool) {
        let c = self.claimed.entry(id).or_default();
        c.held += 1;
        c.on_tasks += u32::from(!own_thread);
    }
}

/// A reader or writer working on a batch's memory: a cancel of the batch waits until every
/// claim on it dropped.
pub(crate) struct Claim<'a> {
    pending: &'a Pending,
    id: u64,
    own_thread: bool,
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut t = self.pending.table.lock().expect("pending poisoned");
        if let Some(c) = t.claimed.get_mut(&self.id) {
            c.held -= 1;
            c.on_tasks -= u32::from(!self.own_thread);
            if c.held == 0 {
                t.claimed.remove(&self.id);
            }
        }
        let wake = t.waiters > 0;
        drop(t);
        if wake {
            self.pending.released.notify_all();
        }
    }
}

/// What an answer's id names ([`Pending::take`], [`Pending::land`]).
pub(crate) enum Landing<T> {
    /// A batch waiting for it.
    Live(T),
    /// A batch cancelled after it was sent: the answer is dropped; a read's brings `bytes`
    /// of payload to read past.
    Late { bytes: u64 },
    /// No batch of ours, or one of the other direction: the peer broke the protocol.
    Unknown,
}

/// What cancelling a batch left to do ([`Pending::cancel`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Cancelled {
    /// Batches a reader or writer works on now, with whether it runs on a thread of its
    /// own: the cancel is over once their claims dropped.
    pub(crate) claimed: Vec<(u64, bool)>,
    /// Some batch was already sent: its answer may still come (a tombstone waits for it).
    pub(crate) late: bool,
}

/// The per-peer limit on bytes in flight counts in units of this many bytes (a semaphore
/// permit each), rounded up per batch: 64 GiB is 2^26 permits.
const ROOM_UNIT: u64 = 1024;

/// Permits of the room semaphore that `bytes` take.
pub(crate) fn room_units(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(ROOM_UNIT)).unwrap_or(u32::MAX)
}

/// One session's waiting batches, by id, and the room for new ones.
pub(crate) struct Pending {
    peer: PeerId,
    table: Mutex<Table>,
    /// Room for our own batches under `Limits::max_bytes_in_flight_per_peer` (FIFO: a
    /// large batch is not starved by small ones). Closed when the session ends.
    room: Arc<Semaphore>,
    /// Our batches waiting for room under the limit (backpressure, visible in stats).
    waiting_for_room: AtomicUsize,
    /// Signalled whenever a [`Claim`] drops.
    released: Condvar,
}

impl Pending {
    /// An empty table for `peer`'s session, with room for `max_in_flight` bytes.
    pub(crate) fn new(peer: PeerId, max_in_flight: u64) -> Self {
        let units = (room_units(max_in_flight) as usize).min(Semaphore::MAX_PERMITS);
        Self {
            peer,
            table: Mutex::new(Table::default()),
            room: Arc::new(Semaphore::new(units)),
            waiting_for_room: AtomicUsize::new(0),
            released: Condvar::new(),
        }
    }

    /// Enters every batch of `entries` (id, waiter, payload bytes, room held) under one
    /// lock, or none of them when the session ended (its error).
    pub(crate) fn enter_all(
        &self,
        entries: impl IntoIterator<Item = (u64, Waiting, u64, Option<OwnedSemaphorePermit>)>,
    ) -> Result<()> {
        let mut t = self.table.lock().expect("pending poisoned");
        if let Some(e) = &t.closed {
            return Err(e.clone());
        }
        for (id, waiting, bytes, room) in entries {
            t.bytes += bytes;
            t.map.insert(
                id,
                Entry {
                    waiting,
                    bytes,
                    room,
                    sent: false,
                },
            );
        }
        Ok(())
    }

    /// Enters one batch ([`Pending::enter_all`]).
    pub(crate) fn enter(
        &self,
        id: u64,
        waiting: Waiting,
        bytes: u64,
        room: Option<OwnedSemaphorePermit>,
    ) -> Result<()> {
        self.enter_all([(id, waiting, bytes, room)])
    }

    /// Takes the batch an acknowledgement (`WriteAck`, `NotifyAck`) names out of the table;
    /// its room under the per-peer limit is released. A write cancelled after it was sent is
    /// [`Landing::Late`] (its tombstone goes).
    pub(crate) fn take(&self, id: u64) -> Landing<Waiting> {
        let mut t = self.table.lock().expect("pending poisoned");
        if let Some(e) = t.map.remove(&id) {
            t.bytes -= e.bytes;
            return Landing::Live(e.waiting);
        }
        match t.late.get(&id) {
            Some(l) if !l.read => {
                t.late.remove(&id);
                Landing::Late { bytes: 0 }
            }
            _ => Landing::Unknown,
        }
    }

    /// Takes the read a `ReadResp` names out of the table, with a claim on its destinations
    /// held while the payload is read into them (`own_thread`: the reader runs on a thread
    /// of its own). A read cancelled after it was sent is [`Landing::Late`] (its tombstone
    /// goes); an id that names no read of ours, or a write, is [`Landing::Unknown`].
    pub(crate) fn land(
        &self,
        id: u64,
        own_thread: bool,
    ) -> Landing<(Vec<LocalSlice>, oneshot::Sender<Result<()>>, Claim<'_>)> {
        let mut t = self.table.lock().expect("pending poisoned");
        if matches!(t.map.get(&id), Some(e) if matches!(e.waiting, Waiting::Read(..))) {
            let e = t.map.remove(&id).expect("looked up");
            t.bytes -= e.bytes;
            t.claim(id, own_thread);
            let Waiting::Read(dests, tx) = e.waiting else {
                unreachable!("matched a read")
            };
            let claim = Claim {
                pending: self,
                id,
                own_thread,
            };
            return Landing::Live((dests, tx, claim));
        }
        match t.late.get(&id) {
            Some(l) if l.read => {
                let bytes = l.bytes;
                t.late.remove(&id);
                Landing::Late { bytes }
            }
            _ => Landing::Unknown,
        }
    }

    /// Takes a batch out of the table to run it right here (a direct copy in the writer),
    /// with a claim on its memory held while it runs; `None` when it already ended or was
    /// cancelled (nothing to run).
    pub(crate) fn take_claimed(&self, id: u64, own_thread: bool) -> Option<(Waiting, Claim<'_>)> {
        let mut t = self.table.lock().expect("pending poisoned");
        let e = t.map.remove(&id)?;
        t.bytes -= e.bytes;
        t.claim(id, own_thread);
        Some((
            e.waiting,
            Claim {
                pending: self,
                id,
                own_thread,
            },
        ))
    }

    /// Marks a batch sent and claims its memory while its request (a read's ops, a write's
    /// ops and payload) is written on the connection; `None` when it ended or was cancelled
    /// before (nothing is sent).
    pub(crate) fn claim_to_send(&self, id: u64, own_thread: bool) -> Option<Claim<'_>> {
        let mut t = self.table.lock().expect("pending poisoned");
        t.map.get_mut(&id)?.sent = true;
        t.claim(id, own_thread);
        Some(Claim {
            pending: self,
            id,
            own_thread,
        })
    }

    /// Cancels the batches `ids` whose caller stopped waiting: each leaves the table (its
    /// waiter is dropped unanswered), with a tombstone when it was sent (its room stays
    /// held by it until the answer came). Never waits: what it returns says which claims
    /// the cancel must wait for ([`Pending::wait_released`]).
    pub(crate) fn cancel(&self, ids: impl IntoIterator<Item = u64>) -> Cancelled {
        let mut t = self.table.lock().expect("pending poisoned");
        let mut out = Cancelled::default();
        for id in ids {
            if let Some(e) = t.map.remove(&id) {
                t.bytes -= e.bytes;
                if e.sent {
                    let read = matches!(e.waiting, Waiting::Read(..));
                    t.late.insert(
                        id,
                        Late {
                            read,
                            bytes: e.bytes,
                            _room: e.room,
                        },
                    );
                    out.late = true;
                }
            }
            if let Some(c) = t.claimed.get(&id) {
                out.claimed.push((id, c.on_tasks == 0));
            }
        }
        out
    }

    /// Waits (blocking this thread, at most `limit`) until no claim on `ids` is held;
    /// whether none is.
    pub(crate) fn wait_released(&self, ids: &[u64], limit: Duration) -> bool {
        let mut t = self.table.lock().expect("pending poisoned");
        t.waiters += 1;
        let (mut t, _) = self
            .released
            .wait_timeout_while(t, limit, |t| ids.iter().any(|i| t.claimed.contains_key(i)))
            .expect("pending poisoned");
        t.waiters -= 1;
        !ids.iter().any(|i| t.claimed.contains_key(i))
    }

    /// Whether any of `ids` is still a tombstone (its answer has not come).
    pub(crate) fn late_left(&self, ids: impl IntoIterator<Item = u64>) -> bool {
        let t = self.table.lock().expect("pending poisoned");
        ids.into_iter().any(|i| t.late.contains_key(&i))
    }

    /// Why the session ended, once it did.
    pub(crate) fn closed(&self) -> Option<Error> {
        self.table.lock().expect("pending poisoned").closed.clone()
    }

    /// Completes `w` with `err` once the session is down ([`Pending::drain`]) rather than
    /// now: for a batch the peer refused with a refusal after which it ends the session. Its
    /// caller, told at once, could dial again before the session is down and be handed the
    /// ending session; told at the end, it finds nothing of the session left, as the
    /// callers of the batches a session's end fails do.
    pub(crate) fn complete_at_end(&self, w: Waiting, err: Error) {
        let mut t = self.table.lock().expect("pending poisoned");
        if t.closed.is_some() {
            drop(t);
            w.complete(Err(err));
            return;
        }
        t.at_end.push((w, err));
    }

    /// Fails every waiting batch and refuses new ones. Called by the session only after the
    /// reader and writer tasks have stopped.
    pub(crate) fn drain(&self, err: &Error) {
        let (waiting, at_end): (Vec<Waiting>, Vec<(Waiting, Error)>) = {
            let mut t = self.table.lock().expect("pending poisoned");
            t.closed.get_or_insert_with(|| err.clone());
            t.bytes = 0;
            // No answer comes any more: the tombstones' room goes back (and the semaphore
            // closes below).
            t.late.clear();
            let at_end = std::mem::take(&mut t.at_end);
            (t.map.drain().map(|(_, e)| e.waiting).collect(), at_end)
        };
        // Callers waiting for room wake up and find the session closed.
        self.room.close();
        for w in waiting {
            w.complete(Err(err.clone()));
        }
        for (w, own) in at_end {
            w.complete(Err(own));
        }
    }

    /// Batches waiting for completion.
    pub(crate) fn len(&self) -> usize {
        self.table.lock().expect("pending poisoned").map.len()
    }

    /// Payload bytes of the batches waiting for completion.
    pub(crate) fn bytes(&self) -> u64 {
        self.table.lock().expect("pending poisoned").bytes
    }

    /// Our batches waiting for room under the per-peer limit (not sent yet).
    pub(crate) fn waiting_for_room(&self) -> usize {
        self.waiting_for_room.load(Ordering::Relaxed)
    }

    /// Waits (until `until`, in submission order) for room for `bytes` payload bytes under
    /// the per-peer limit on bytes in flight. `None` when `bytes` is 0, or when the session
    /// ended (the caller finds out why when it enters its batch).
    pub(crate) async fn acquire_room(
        &self,
        step: Step,
        deadline: Duration,
        until: tokio::time::Instant,
        bytes: u64,
    ) -> Result<Option<OwnedSemaphorePermit>> {
        if bytes == 0 {
            return Ok(None);
        }
        let units = room_units(bytes);
        let acquire = self.room.clone().acquire_many_owned(units);
        // Counted while waiting, also when the caller drops this future.
        struct Counted<'a>(&'a AtomicUsize);
        impl Drop for Counted<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.waiting_for_room.fetch_add(1, Ordering::Relaxed);
        let counted = Counted(&self.waiting_for_room);
        let got = tokio::time::timeout_at(until, acquire).await;
        drop(counted);
        match got {
            Ok(Ok(p)) => Ok(Some(p)),
            // Closed: the session ended; `closed` says why when the batch is entered.
            Ok(Err(_)) => Ok(None),
            Err(_) => Err(Error::Timeout {
                peer: self.peer.to_string(),
                step,
                after: deadline,
            }),
        }
    }
}

/// Asks the session that owns a data path to tear down (a batch passed its deadline, or one
/// part of a striped batch failed). The session makes it; the data path holds nothing else of
/// the session.
#[derive(Clone)]
pub(crate) struct AbortHandle(Arc<dyn Fn(Error) + Send + Sync>);

impl AbortHandle {
    /// A handle that calls `abort` with the error the session is to end with.
    pub(crate) fn new(abort: impl Fn(Error) + Send + Sync + 'static) -> Self {
        Self(Arc::new(abort))
    }

    /// Asks the session to end with `err` (it may have ended already).
    pub(crate) fn abort(&self, err: Error) {
        (self.0)(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;

    fn pending() -> Arc<Pending> {
        Arc::new(Pending::new(PeerId::new("peer").unwrap(), 1 << 20))
    }

    fn read(r: &Region) -> (Waiting, oneshot::Receiver<Result<()>>) {
        let (tx, rx) = oneshot::channel();
        let dest = LocalSlice {
            region: r.begin_write(),
            offset: 0,
            len: 4096,
        };
        (Waiting::Read(vec![dest], tx), rx)
    }

    fn write() -> (Waiting, oneshot::Receiver<Result<()>>) {
        let (tx, rx) = oneshot::channel();
        (Waiting::Write(tx), rx)
    }

    #[test]
    fn a_batch_cancelled_before_it_was_sent_is_never_sent_and_leaves_nothing() {
        let p = pending();
        let r = Region::alloc(4096, 4096).unwrap();
        let (w, _rx) = read(&r);
        p.enter(1, w, 4096, None).unwrap();
        assert_eq!(p.cancel([1]), Cancelled::default());
        assert!(p.claim_to_send(1, true).is_none(), "sent after its cancel");
        assert!(matches!(p.land(1, true), Landing::Unknown));
        assert_eq!((p.len(), p.bytes()), (0, 0));
        assert_eq!(r.in_use(), 0, "the destinations are still held");
    }

    #[test]
    fn the_answer_to_a_read_cancelled_after_it_was_sent_is_recognised_once() {
        let p = pending();
        let r = Region::alloc(4096, 4096).unwrap();
        let (w, mut rx) = read(&r);
        p.enter(7, w, 4096, None).unwrap();
        drop(p.claim_to_send(7, true).expect("not cancelled"));
        let c = p.cancel([7]);
        assert_eq!(
            c,
            Cancelled {
                claimed: vec![],
                late: true
            }
        );
        assert_eq!(r.in_use(), 0, "the destinations are still held");
        assert!(p.late_left([7]));
        // The waiter is gone unanswered (its caller stopped waiting).
        assert!(rx.try_recv().is_err());
        assert!(matches!(p.land(7, true), Landing::Late { bytes: 4096 }));
        assert!(!p.late_left([7]));
        // A second answer for it is the peer's mistake.
        assert!(matches!(p.land(7, true), Landing::Unknown));
    }

    #[test]
    fn the_acknowledgement_of_a_write_cancelled_after_it_was_sent_is_recognised() {
        let p = pending();
        let (w, _rx) = write();
        p.enter(3, w, 100, None).unwrap();
        drop(p.claim_to_send(3, false));
        assert!(p.cancel([3]).late);
        // Not as a read's answer: the peer mixed them up.
        assert!(matches!(p.land(3, true), Landing::Unknown));
        assert!(matches!(p.take(3), Landing::Late { bytes: 0 }));
        assert!(matches!(p.take(3), Landing::Unknown));
    }

    #[test]
    fn a_read_landing_before_its_sender_let_go_stays_claimed_until_both_did() {
        // The answer can come while the writer still holds the claim it sent the request
        // under: the writer's drop must not release the reader's claim, or a cancel returns
        // while the reader still fills the destinations.
        let p = pending();
        let r = Region::alloc(4096, 4096).unwrap();
        let (w, _rx) = read(&r);
        p.enter(9, w, 4096, None).unwrap();
        let sending = p.claim_to_send(9, true).expect("not cancelled");
        let Landing::Live((_dests, _done, landing)) = p.land(9, false) else {
            panic!("the read is waiting");
        };
        let c = p.cancel([9]);
        assert_eq!(
            c.claimed,
            vec![(9, false)],
            "a task holds one of the claims"
        );
        drop(sending);
        assert!(
            !p.wait_released(&[9], Duration::from_millis(20)),
            "the sender's drop released the reader's claim"
        );
        assert_eq!(p.cancel([9]).claimed, vec![(9, false)]);
        drop(landing);
        assert!(p.wait_released(&[9], Duration::from_millis(20)));
        assert!(p.cancel([9]).claimed.is_empty());
    }

    #[test]
    fn a_cancel_names_the_claims_it_must_wait_for_and_they_release_it() {
        let p = pending();
        let r = Region::alloc(4096, 4096).unwrap();
        let (w, _rx) = read(&r);
        p.enter(5, w, 4096, None).unwrap();
        drop(p.claim_to_send(5, true));
        let Landing::Live((dests, _done, claim)) = p.land(5, false) else {
            panic!("the read is waiting");
        };
        let c = p.cancel([5]);
        assert_eq!(c.claimed, vec![(5, false)]);
        assert!(
            !c.late,
            "taken for landing: no answer of it is left to come"
        );
        assert!(!p.wait_released(&[5], Duration::from_millis(20)));
        let waiter = {
            let p = p.clone();
            std::thread::spawn(move || p.wait_released(&[5], Duration::from_secs(10)))
        };
        drop(dests);
        drop(claim);
        assert!(
            waiter.join().unwrap(),
            "the claim's drop did not wake the cancel"
        );
    }

    #[test]
    fn the_room_of_a_cancelled_batch_comes_back_with_its_answer_or_the_sessions_end() {
        let p = Pending::new(PeerId::new("peer").unwrap(), 4096);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let room = |p: &Pending| {
            rt.block_on(p.acquire_room(
                Step::Read,
                Duration::from_millis(10),
                tokio::time::Instant::now() + Duration::from_millis(10),
                4096,
            ))
        };
        for end in ["answer", "drain"] {
            let r = Region::alloc(4096, 4096).unwrap();
            let held = room(&p).unwrap();
            assert!(held.is_some());
            let (w, _rx) = read(&r);
            p.enter(9, w, 4096, held).unwrap();
            drop(p.claim_to_send(9, true));
            assert!(p.cancel([9]).late);
            assert!(
                room(&p).is_err(),
                "the cancelled read's room was given back early"
            );
            if end == "answer" {
                assert!(matches!(p.land(9, true), Landing::Late { .. }));
                assert!(room(&p).unwrap().is_some(), "its answer gave no room back");
            } else {
                p.drain(&Error::Closed);
                assert!(!p.late_left([9]));
            }
        }
    }

    #[test]
    fn a_refusal_that_ends_the_session_is_told_only_once_the_session_is_down() {
        let p = pending();
        let (w, mut rx) = write();
        p.enter(1, w, 4096, None).unwrap();
        let (other, mut other_rx) = write();
        p.enter(2, other, 4096, None).unwrap();
        let Landing::Live(w) = p.take(1) else {
            panic!("batch 1 is waiting")
        };
        let refusal = Error::Local("refused".into());
        p.complete_at_end(w, refusal);
        assert!(rx.try_recv().is_err(), "told before the session was down");
        p.drain(&Error::Closed);
        assert!(matches!(rx.try_recv(), Ok(Err(Error::Local(m))) if m == "refused"));
        assert!(matches!(other_rx.try_recv(), Ok(Err(Error::Closed))));
        // After the end, a refusal is told at once.
        let (w, mut rx) = write();
        p.complete_at_end(w, Error::Local("late".into()));
        assert!(matches!(rx.try_recv(), Ok(Err(Error::Local(m))) if m == "late"));
    }
}
