//! The batches of one session waiting for their outcome, and the room they hold under the
//! per-peer limit on bytes in flight.
//!
//! It sits below everything that completes a batch: the data path enters a batch here before
//! its first frame is queued, and the TCP reader (an acknowledgement), the TCP writer and the
//! direct copy (a batch copied without the data connection) take it out and complete it. None
//! of them calls back into the data path.

use crate::error::{Error, Result};
use crate::region::LocalSlice;
use kvbridge_proto::handshake::Step;
use kvbridge_proto::PeerId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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
    _room: Option<OwnedSemaphorePermit>,
}

#[derive(Default)]
struct Table {
    map: HashMap<u64, Entry>,
    /// Payload bytes of the batches in `map`.
    bytes: u64,
    /// Set when the session ended: no new batch may wait after that.
    closed: Option<Error>,
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
                    _room: room,
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

    /// Removes a waiting batch; its room under the per-peer limit is released.
    pub(crate) fn take(&self, id: u64) -> Option<Waiting> {
        let mut t = self.table.lock().expect("pending poisoned");
        let e = t.map.remove(&id)?;
        t.bytes -= e.bytes;
        Some(e.waiting)
    }

    /// Why the session ended, once it did.
    pub(crate) fn closed(&self) -> Option<Error> {
        self.table.lock().expect("pending poisoned").closed.clone()
    }

    /// Fails every waiting batch and refuses new ones. Called by the session only after the
    /// reader and writer tasks have stopped.
    pub(crate) fn drain(&self, err: &Error) {
        let waiting: Vec<Waiting> = {
            let mut t = self.table.lock().expect("pending poisoned");
            t.closed.get_or_insert_with(|| err.clone());
            t.bytes = 0;
            t.map.drain().map(|(_, e)| e.waiting).collect()
        };
        // Callers waiting for room wake up and find the session closed.
        self.room.close();
        for w in waiting {
            w.complete(Err(err.clone()));
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

/// A batch queued on its connection whose outcome is still to come
/// (`DataPath::submit`).
pub(crate) struct Submitted {
    pub(crate) rx: oneshot::Receiver<Result<()>>,
    pub(crate) until: tokio::time::Instant,
    pub(crate) deadline: Duration,
    pub(crate) step: Step,
    pub(crate) peer: PeerId,
    pub(crate) abort: AbortHandle,
}

impl Submitted {
    /// The batch's outcome, within the deadline it was submitted under. Past it, the
    /// session is torn down (so nothing of the batch can land later) and the outcome is
    /// `Timeout`.
    pub(crate) async fn outcome(mut self) -> Result<()> {
        match tokio::time::timeout_at(self.until, &mut self.rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::lost(self.peer.as_str(), self.step, "session ended")),
            Err(_) => Err(self.abort_after_timeout().await),
        }
    }

    /// Past the deadline: asks the session to tear down, and returns once it drained us
    /// (after that nothing of this batch can land any more).
    pub(crate) async fn abort_after_timeout(self) -> Error {
        let err = Error::Timeout {
            peer: self.peer.to_string(),
            step: self.step,
            after: self.deadline,
        };
        self.abort.abort(err.clone());
        match tokio::time::timeout(Duration::from_secs(30), self.rx).await {
            Ok(Ok(Err(e))) if e != err => e,
            _ => err,
        }
    }
}
