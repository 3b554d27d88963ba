//! The data connection of one session: one-sided writes and reads, notifications.
//!
//! Two tasks own the two halves of the connection. The *writer* sends frames in submission
//! order: batch headers followed by payloads taken straight from registered memory with
//! vectored writes (no staging copy). The *reader* serves the peer's batches, validating each
//! op header (region exists, granted to this peer, in bounds) before it reads a payload byte
//! straight into place, and completes our own batches when their acks arrive.
//!
//! A completion is signalled only by the reader (or by the session after both tasks have
//! stopped): when a caller learns that its batch ended, no byte of it can still land. A
//! batch that passes its deadline therefore ends the whole session — tearing down the
//! connection is the only way to be sure the peer's late bytes never arrive.

mod direct;
mod pending;

pub(crate) use direct::{Copied, CopyOn, DirectRoute};
pub(crate) use pending::{AbortHandle, Pending, Submitted, Waiting};

use crate::config::{Limits, TestHooks};
use crate::dir::Dir;
use crate::error::{Error, Result};
use crate::events::Notification;
use crate::grant::RegionTable;
use crate::in_flight::{InFlight, Refused, Reservation};
use crate::region::LocalSlice;
use crate::shm::ShmPeer;
use crate::wire::{read_data_frame, write_all_vectored, write_msg, ReadError};
use crate::writer_queue::Outgoing;
use crate::writer_queue::{self, Direct, WriterQueue, WriterRx};
use kvbridge_proto::handshake::Step;
use kvbridge_proto::ids::Blob;
use kvbridge_proto::msg::{Ack, Batch, ErrorCode, Message, Notify, OpDesc, Reject};
use kvbridge_proto::PeerId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};

use crate::net::{ReadHalf, WriteHalf};
use crate::peer_memory::PeerRange;

/// Largest direct write copied in the calling task without lending its thread first
/// ([`DataPath::write_direct`]): about 2 ms of memcpy at 8 GiB/s. Lending the thread costs a
/// thread wake-up (measured: a default demo's KV rate fell from 5.2 to 4.3 GiB/s, medians of
/// 4 runs each, when its 8 MiB chunks were copied with `block_in_place`).
pub(crate) const INLINE_COPY_MAX: u64 = 16 << 20;

/// Least bytes per part of a striped batch: smaller batches stay on one connection.
pub(crate) const MIN_PART: u64 = 256 << 10;

/// Shared by the session, its data tasks and the callers of write/read/notify.
pub(crate) struct DataPath {
    pub(crate) peer: PeerId,
    /// Our batches waiting for their outcome, and the room they hold.
    pending: Arc<Pending>,
    next_id: AtomicU64,
    /// Connection 0's writer queue: notifications, acks, unstriped batches.
    out: WriterQueue,
    /// (Striped initiator) The writer queues of connections 1..N.
    stripes: Vec<WriterQueue>,
    /// (Striped) Transfers entered and not yet ended, by ticket: a notification waits until
    /// none older than it is left, so it still follows every write issued before it.
    order: Mutex<std::collections::BTreeSet<u64>>,
    /// Signalled whenever a transfer leaves `order`.
    order_changed: tokio::sync::Notify,
    /// Asks the owning session to tear down (an op passed its deadline).
    abort: AbortHandle,
    /// Payload bytes of the peer's batches this side accepted and has not completed yet:
    /// the write being read in, read responses not yet sent. Added by the reader, released
    /// by the reader (writes) and the writer (read responses).
    incoming: Arc<InFlight>,
    /// The peer's regions this side reaches directly (shared memory, cross-memory attach):
    /// a write into them is copied by its caller ([`DataPath::write_direct`]).
    direct: Option<DirectRoute>,
    /// The peer honours unacknowledged notifications ([`DataPath::notify_posted`]).
    peer_unacked_notify: bool,
}

/// Removes a transfer's ticket from `order` when it ends, however it ends.
struct Ticket<'a> {
    path: &'a DataPath,
    id: u64,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        self.path
            .order
            .lock()
            .expect("order poisoned")
            .remove(&self.id);
        self.path.order_changed.notify_waiters();
    }
}

impl DataPath {
    /// A data path over `connections` (at least 1) connections; returns the writer queue of
    /// each, connection 0 first. `direct`: the peer's regions reachable directly, if any;
    /// `frames_direct`: the channel's count of frames that skipped a writer;
    /// `peer_unacked_notify`: the peer honours unacknowledged notifications.
    pub(crate) fn new(
        peer: PeerId,
        abort: AbortHandle,
        max_in_flight: u64,
        connections: usize,
        direct: Option<Arc<ShmPeer>>,
        frames_direct: Arc<AtomicU64>,
        peer_unacked_notify: bool,
    ) -> (Arc<Self>, Vec<WriterRx>) {
        let (out, rx) = writer_queue::channel(frames_direct.clone());
        let mut rxs = vec![rx];
        let mut stripes = Vec::new();
        for _ in 1..connections.max(1) {
            let (tx, rx) = writer_queue::channel(frames_direct.clone());
            stripes.push(tx);
            rxs.push(rx);
        }
        (
            Arc::new(Self {
                pending: Arc::new(Pending::new(peer.clone(), max_in_flight)),
                direct: direct.map(|shm| DirectRoute::new(peer.clone(), shm)),
                peer,
                next_id: AtomicU64::new(1),
                out,
                stripes,
                order: Mutex::new(Default::default()),
                order_changed: tokio::sync::Notify::new(),
                abort,
                incoming: InFlight::new(max_in_flight),
                peer_unacked_notify,
            }),
            rxs,
        )
    }

    /// Data connections this side stripes its batches over.
    pub(crate) fn connections(&self) -> usize {
        1 + self.stripes.len()
    }

    /// A sender to the writer queue of connection `i` (of those this path was made with).
    pub(crate) fn queue_of(&self, i: usize) -> WriterQueue {
        self.queue(i).clone()
    }

    /// The writer queue of connection `i`.
    fn queue(&self, i: usize) -> &WriterQueue {
        if i == 0 {
            &self.out
        } else {
            &self.stripes[i - 1]
        }
    }

    /// Runs a write (`Dir::Write`, `locals` are the sources) or a read (`locals` are the
    /// destinations) under `deadline`, split by bytes over the data connections when it is
    /// large enough. It completes when every part is acknowledged; when any part fails the
    /// session ends (so no byte of the batch lands later) and the batch fails with the first
    /// part's error.
    pub(crate) async fn transfer(
        &self,
        dir: Dir,
        deadline: Duration,
        descs: Vec<OpDesc>,
        locals: Vec<LocalSlice>,
    ) -> Result<()> {
        let step = match dir {
            Dir::Write => Step::Write,
            Dir::Read => Step::Read,
        };
        let bytes: u64 = descs.iter().map(|d| d.len).sum();
        let (descs, locals) = if dir == Dir::Write && self.stripes.is_empty() {
            match self.write_direct(deadline, bytes, descs, locals).await {
                Ok(r) => return r,
                Err(batch) => batch,
            }
        } else {
            (descs, locals)
        };
        if self.stripes.is_empty() {
            return match dir {
                Dir::Write => {
                    self.run(step, deadline, bytes, DataPath::write_waiting, |id| {
                        Outgoing::Write {
                            id,
                            descs,
                            sources: locals,
                        }
                    })
                    .await
                }
                Dir::Read => {
                    self.run(
                        step,
                        deadline,
                        bytes,
                        DataPath::read_waiting(locals),
                        |id| Outgoing::Read { id, descs },
                    )
                    .await
                }
            };
        }
        let until = tokio::time::Instant::now() + deadline;
        // Room for the whole batch under the per-peer limit first, as for one connection;
        // each part then holds its share, released when it completes.
        let mut room = self
            .pending
            .acquire_room(step, deadline, until, bytes)
            .await?;
        let parts = split(descs, locals, self.connections());
        // Ticket taken and entered under one lock: a notification that draws a later ticket
        // finds this transfer in `order`.
        let first = {
            let mut order = self.order.lock().expect("order poisoned");
            let first = self
                .next_id
                .fetch_add(parts.len() as u64, Ordering::Relaxed);
            order.insert(first);
            first
        };
        let _ticket = Ticket {
            path: self,
            id: first,
        };
        let mut rxs = Vec::with_capacity(parts.len());
        let mut sends = Vec::with_capacity(parts.len());
        let mut entries = Vec::with_capacity(parts.len());
        let last = parts.len() - 1;
        for (i, (descs, locals)) in parts.into_iter().enumerate() {
            let id = first + i as u64;
            let part_bytes: u64 = descs.iter().map(|d| d.len).sum();
            let part_room = if i == last {
                room.take()
            } else {
                let units = (pending::room_units(part_bytes) as usize)
                    .min(room.as_ref().map_or(0, |r| r.num_permits()));
                room.as_mut().and_then(|r| r.split(units))
            };
            let (tx, rx) = oneshot::channel();
            let (w, o) = match dir {
                Dir::Write => (
                    Waiting::Write(tx),
                    Outgoing::Write {
                        id,
                        descs,
                        sources: locals,
                    },
                ),
                Dir::Read => (Waiting::Read(locals, tx), Outgoing::Read { id, descs }),
            };
            entries.push((id, w, part_bytes, part_room));
            rxs.push(rx);
            sends.push((i, o));
        }
        // Every part is entered before any frame is queued.
        self.pending.enter_all(entries)?;
        let mut rxs = rxs;
        // Receivers that returned: a oneshot must not be polled again after that.
        let mut resolved = 0usize;
        let submit_and_wait = async {
            for (i, o) in sends {
                // A writer that is gone means the session is tearing down and drains us.
                let _ = self.queue(i).send(o).await;
            }
            let mut first_err = None;
            for rx in rxs.iter_mut() {
                let r = rx.await.unwrap_or_else(|_| {
                    Err(Error::lost(self.peer.as_str(), step, "session ended"))
                });
                resolved += 1;
                if let Err(e) = r {
                    first_err = Some(e);
                    break;
                }
            }
            first_err
        };
        let err = match tokio::time::timeout_at(until, submit_and_wait).await {
            Ok(None) => return Ok(()),
            Ok(Some(e)) => e,
            Err(_) => Error::Timeout {
                peer: self.peer.to_string(),
                step,
                after: deadline,
            },
        };
        // One part failed or ran late: end the session, then wait until every part has
        // ended (the session stops all data tasks before it drains), so nothing of this
        // batch can land after we return.
        self.abort.abort(err.clone());
        let all = async {
            for rx in rxs.iter_mut().skip(resolved) {
                let _ = rx.await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(30), all).await;
        Err(err)
    }

    /// Waits, within `deadline`, until every transfer entered in `order` before now ended
    /// (striped batches, and writes copied by their callers; a single connection carries
    /// the rest in order already). A transfer whose caller stopped waiting (its future
    /// dropped) leaves `order` then, so a notification is ordered only after the transfers
    /// still being awaited.
    pub(crate) async fn wait_earlier(&self, deadline: Duration) -> Result<()> {
        let me = {
            let _order = self.order.lock().expect("order poisoned");
            self.next_id.fetch_add(1, Ordering::Relaxed)
        };
        let wait = async {
            loop {
                let changed = self.order_changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                let older = self
                    .order
                    .lock()
                    .expect("order poisoned")
                    .first()
                    .is_some_and(|t| *t < me);
                if !older {
                    return;
                }
                changed.await;
            }
        };
        tokio::time::timeout(deadline, wait)
            .await
            .map_err(|_| Error::Timeout {
                peer: self.peer.to_string(),
                step: Step::Notify,
                after: deadline,
            })
    }

    /// Copies a write of `bytes` into the peer's regions on the calling thread, when every op's region
    /// is reachable directly and the runtime is a multi-thread one. That spares each write
    /// two thread hand-offs (to the writer thread and back), each a wake-up of tens of
    /// microseconds on a loaded host, on the path of every KV chunk. A batch of at most
    /// [`INLINE_COPY_MAX`] bytes is copied right in the task (a millisecond or two of the
    /// worker's time, less than lending the thread would cost); a larger one lends the
    /// thread first (`block_in_place`), so the runtime's other tasks move on meanwhile. Gives
    /// the batch back when it cannot (it is then queued for the writer thread).
    ///
    /// Ordering stays what the writer queue gives: the copy holds a ticket in `order`, so a
    /// notification issued meanwhile waits for it ([`DataPath::wait_earlier`]); and it
    /// holds the region's read lock, so a session that ends waits for it before it says
    /// that nothing of it lands any more (`ShmPeer::revoke_all`).
    async fn write_direct(
        &self,
        deadline: Duration,
        bytes: u64,
        descs: Vec<OpDesc>,
        sources: Vec<LocalSlice>,
    ) -> std::result::Result<Result<()>, (Vec<OpDesc>, Vec<LocalSlice>)> {
        // A current-thread runtime has no other thread to run its tasks meanwhile.
        let multi_thread = matches!(
            tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()),
            Ok(tokio::runtime::RuntimeFlavor::MultiThread)
        );
        let Some(direct) = self.direct.as_ref().filter(|_| multi_thread) else {
            return Err((descs, sources));
        };
        let until = tokio::time::Instant::now() + deadline;
        let room = match self
            .pending
            .acquire_room(Step::Write, deadline, until, bytes)
            .await
        {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        let id = {
            let mut order = self.order.lock().expect("order poisoned");
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            order.insert(id);
            id
        };
        let _ticket = Ticket { path: self, id };
        if let Some(e) = self.pending.closed() {
            return Ok(Err(e));
        }
        // No await from here to the copy, as on the writer thread: a region revoked
        // meanwhile (detached, say) sends the batch over TCP instead.
        let on = if bytes <= INLINE_COPY_MAX {
            CopyOn::ThisThread
        } else {
            CopyOn::LentThread
        };
        let mut sources = Some(sources);
        let copied = direct.try_copy(
            Dir::Write,
            &descs,
            || sources.take(),
            on,
            || {
                // Revoked because the session is ending, not by the peer's choice.
                Some(self.pending.closed().unwrap_or_else(|| {
                    Error::lost(self.peer.as_str(), Step::Write, "session ended")
                }))
            },
        );
        drop(room);
        match copied {
            Copied::Done(r) => Ok(r),
            Copied::NotDirect | Copied::AlreadyEnded => Err((
                descs,
                sources.expect("given back when the batch does not go direct"),
            )),
        }
    }

    /// Our batches waiting for room under the per-peer limit (not sent yet).
    pub(crate) fn waiting_for_room(&self) -> usize {
        self.pending.waiting_for_room()
    }

    /// Payload bytes of our batches waiting for completion.
    pub(crate) fn bytes_in_flight(&self) -> u64 {
        self.pending.bytes()
    }

    /// Fails every waiting batch and refuses new ones. Called by the session only after the
    /// reader and writer tasks have stopped.
    pub(crate) fn drain(&self, err: &Error) {
        self.pending.drain(err)
    }

    /// Batches waiting for completion.
    pub(crate) fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// The table of this session's waiting batches (its TCP readers and writers complete
    /// them there).
    pub(crate) fn pending(&self) -> Arc<Pending> {
        self.pending.clone()
    }

    /// The peer's batches this side accepted and has not completed yet (its TCP readers
    /// admit them there).
    pub(crate) fn incoming(&self) -> Arc<InFlight> {
        self.incoming.clone()
    }

    /// The direct route to the peer's regions, when this side reaches some.
    pub(crate) fn direct_route(&self) -> Option<DirectRoute> {
        self.direct.clone()
    }

    /// Runs one batch of `bytes` payload bytes to completion under `deadline`. The batch
    /// first waits for room under the per-peer limit on bytes in flight (in submission
    /// order); one that gets none before its deadline fails with `Timeout` without having
    /// been sent, and the session goes on.
    pub(crate) async fn run(
        &self,
        step: Step,
        deadline: Duration,
        bytes: u64,
        waiting: impl FnOnce(oneshot::Sender<Result<()>>) -> Waiting,
        outgoing: impl FnOnce(u64) -> Outgoing,
    ) -> Result<()> {
        self.submit(step, deadline, bytes, waiting, outgoing)
            .await?
            .outcome()
            .await
    }

    /// [`DataPath::run`]'s first half: waits for room, enters the batch and queues it on
    /// its connection (so it is ordered before anything queued after this returns). The
    /// outcome is [`Submitted::outcome`]'s, under the same deadline, counted from now.
    pub(crate) async fn submit(
        &self,
        step: Step,
        deadline: Duration,
        bytes: u64,
        waiting: impl FnOnce(oneshot::Sender<Result<()>>) -> Waiting,
        outgoing: impl FnOnce(u64) -> Outgoing,
    ) -> Result<Submitted> {
        self.submit_with(step, deadline, bytes, waiting, |id| Ok(outgoing(id)))
            .await
    }

    /// Submits a notification of `data` (its outcome is the peer's acknowledgement); it
    /// goes on the writer's fast lane when the connection is idle.
    pub(crate) async fn notify(&self, deadline: Duration, data: Vec<u8>) -> Result<Submitted> {
        self.submit_with(Step::Notify, deadline, 0, Waiting::Notify, |id| {
            Message::Notify(Notify {
                id,
                data: Blob(data),
                unacked: false,
            })
            .to_frame()
            .map(Outgoing::Frame)
            .map_err(|e| Error::Local(e.to_string()))
        })
        .await
    }

    /// Queues a notification of `data` for which the peer sends no acknowledgement: its
    /// delivery is confirmed by whatever the application answers later on this session
    /// (frames are handled in order). Returns once it is on the wire or queued behind
    /// everything queued before it; fails only when the session has ended or the queue
    /// stays full past `deadline`. A peer that does not honour this (an older build) gets
    /// an ordinary notification, whose acknowledgement nobody awaits.
    ///
    /// It spares the peer a send and this side a wake-up per notification: on a host
    /// with few cores, a chunk's `Written` note and its acknowledgement cost tens of
    /// microseconds of the cores that copy the next chunk.
    pub(crate) async fn notify_posted(&self, deadline: Duration, data: Vec<u8>) -> Result<()> {
        if !self.peer_unacked_notify {
            // The entry is completed by the acknowledgement, or drained with the session.
            drop(self.notify(deadline, data).await?);
            return Ok(());
        }
        if let Some(e) = self.pending.closed() {
            return Err(e);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = Message::Notify(Notify {
            id,
            data: Blob(data),
            unacked: true,
        })
        .to_frame()
        .map_err(|e| Error::Local(e.to_string()))?;
        match self.out.send_direct(&frame) {
            Direct::Sent => return Ok(()),
            Direct::Broken(e) => return Err(Error::lost(self.peer.as_str(), Step::Notify, e)),
            Direct::Queue => {}
        }
        match tokio::time::timeout(deadline, self.out.send(Outgoing::Frame(frame))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Error::lost(
                self.peer.as_str(),
                Step::Notify,
                "session ended",
            )),
            Err(_) => Err(Error::Timeout {
                peer: self.peer.to_string(),
                step: Step::Notify,
                after: deadline,
            }),
        }
    }

    /// [`DataPath::submit`] with an item that may fail to build (before anything is
    /// entered). An encoded frame tries the fast lane first.
    async fn submit_with(
        &self,
        step: Step,
        deadline: Duration,
        bytes: u64,
        waiting: impl FnOnce(oneshot::Sender<Result<()>>) -> Waiting,
        outgoing: impl FnOnce(u64) -> Result<Outgoing>,
    ) -> Result<Submitted> {
        let until = tokio::time::Instant::now() + deadline;
        let room = self
            .pending
            .acquire_room(step, deadline, until, bytes)
            .await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let o = outgoing(id)?;
        let (tx, rx) = oneshot::channel();
        // Entered before the frame is queued: no completion can precede its waiter.
        self.pending.enter(id, waiting(tx), bytes, room)?;
        let submitted = Submitted {
            rx,
            until,
            deadline,
            step,
            peer: self.peer.clone(),
            abort: self.abort.clone(),
        };
        if let Outgoing::Frame(frame) = &o {
            match self.out.send_direct(frame) {
                // On the wire; the outcome comes with the peer's acknowledgement.
                Direct::Sent => return Ok(submitted),
                // The session ends on the shut socket, and the outcome says so.
                Direct::Broken(e) => {
                    tracing::debug!(peer = %self.peer, error = %e, "frame cut short");
                    return Ok(submitted);
                }
                Direct::Queue => {}
            }
        }
        match tokio::time::timeout_at(until, self.out.send(o)).await {
            // A closed queue: the writer is gone; the session is tearing down and will
            // drain us (the outcome says so).
            Ok(_) => Ok(submitted),
            Err(_) => Err(submitted.abort_after_timeout().await),
        }
    }

    pub(crate) fn write_waiting(tx: oneshot::Sender<Result<()>>) -> Waiting {
        Waiting::Write(tx)
    }

    pub(crate) fn read_waiting(
        dests: Vec<LocalSlice>,
    ) -> impl FnOnce(oneshot::Sender<Result<()>>) -> Waiting {
        move |tx| Waiting::Read(dests, tx)
    }

    pub(crate) fn out_sender(&self) -> WriterQueue {
        self.out.clone()
    }
}

/// Splits a batch by bytes into up to `ways` contiguous parts of at least [`MIN_PART`]
/// bytes (an op may be cut between two parts); a batch too small to split stays whole.
pub(crate) fn split(
    descs: Vec<OpDesc>,
    locals: Vec<LocalSlice>,
    ways: usize,
) -> Vec<(Vec<OpDesc>, Vec<LocalSlice>)> {
    let total: u64 = descs.iter().map(|d| d.len).sum();
    let k = (ways as u64).min(total / MIN_PART).max(1) as usize;
    if k == 1 {
        return vec![(descs, locals)];
    }
    // Part p ends at byte total * (p + 1) / k of the batch.
    let end_of = |p: usize| total * (p as u64 + 1) / k as u64;
    let mut parts = Vec::with_capacity(k);
    let mut cur: (Vec<OpDesc>, Vec<LocalSlice>) = (Vec::new(), Vec::new());
    let mut done = 0u64;
    let mut part = 0usize;
    for (mut d, mut l) in descs.into_iter().zip(locals) {
        loop {
            let room = end_of(part) - done;
            if d.len <= room || part == k - 1 {
                done += d.len;
                cur.0.push(d);
                cur.1.push(l);
                if done == end_of(part) && part < k - 1 {
                    parts.push(std::mem::take(&mut cur));
                    part += 1;
                }
                break;
            }
            if room > 0 {
                cur.0.push(OpDesc {
                    region: d.region,
                    offset: d.offset,
                    len: room,
                });
                cur.1.push(LocalSlice {
                    region: l.region.again(),
                    offset: l.offset,
                    len: room as usize,
                });
                d.offset += room;
                d.len -= room;
                l.offset += room as usize;
                l.len -= room as usize;
                done += room;
            }
            if !cur.0.is_empty() {
                parts.push(std::mem::take(&mut cur));
            }
            part += 1;
        }
    }
    if !cur.0.is_empty() {
        parts.push(cur);
    }
    parts
}

/// Runs a batch queued on a connection by direct copies when every region it names is
/// reachable directly ([`DirectRoute::try_copy`]), completing it in `pending`; gives the
/// batch back otherwise (it then goes over TCP).
fn try_direct(
    pending: &Pending,
    direct: Option<&DirectRoute>,
    dir: Dir,
    id: u64,
    descs: Vec<OpDesc>,
    sources: Vec<LocalSlice>,
) -> Option<(Vec<OpDesc>, Vec<LocalSlice>)> {
    let Some(direct) = direct else {
        return Some((descs, sources));
    };
    let mut sources = Some(sources);
    let mut done = None;
    let copied = direct.try_copy(
        dir,
        &descs,
        || {
            // Gone when the batch already ended (the session is tearing down).
            let (dests, tx) = pending.take(id)?.into_parts();
            done = Some(tx);
            match dir {
                Dir::Write => sources.take(),
                Dir::Read => dests,
            }
        },
        CopyOn::ThisThread,
        || None,
    );
    match copied {
        Copied::NotDirect => Some((
            descs,
            sources.expect("given back when the batch does not go direct"),
        )),
        Copied::AlreadyEnded => None,
        Copied::Done(r) => {
            if let Some(tx) = done {
                let _ = tx.send(r);
            }
            None
        }
    }
}

/// The writer task: sends queued frames and payloads until `Shutdown` or a socket error.
/// Batches whose regions the peer mapped for us (`direct`) are copied here instead, in order
/// with the frames. Each payload (a write batch, a read response) must be on the wire
/// within `limit` (the op deadline): a peer that stops reading ends the session with
/// `Timeout` instead of holding the writer and the regions it sends from.
pub(crate) async fn run_writer(
    peer: PeerId,
    pending: Arc<Pending>,
    direct: Option<DirectRoute>,
    mut w: WriteHalf,
    mut rx: WriterRx,
    limit: Duration,
) -> Result<()> {
    let lost = |step, e: std::io::Error| {
        // WouldBlock: SO_SNDTIMEO expired on a blocking socket.
        if matches!(
            e.kind(),
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
        ) {
            Error::Timeout {
                peer: peer.to_string(),
                step,
                after: limit,
            }
        } else {
            Error::lost(peer.as_str(), step, e)
        }
    };
    // The turn is held until the item is on the wire (see `writer_queue`).
    while let Some((o, turn)) = rx.recv().await {
        if let Some(tail) = turn.tail() {
            within(limit, async {
                w.write_all(&tail).await?;
                w.flush().await
            })
            .await
            .map_err(|e| lost(Step::Notify, e))?;
        }
        match o {
            Outgoing::Write { id, descs, sources } => {
                let Some((descs, sources)) =
                    try_direct(&pending, direct.as_ref(), Dir::Write, id, descs, sources)
                else {
                    continue;
                };
                let mut frame = Message::WriteBatch(Batch { id, ops: descs })
                    .to_frame()
                    .map_err(|e| Error::Local(e.to_string()))?;
                let mut slices = Vec::with_capacity(sources.len() + 1);
                slices.push(PeerRange::owned(&mut frame));
                slices.extend(sources.iter().map(LocalSlice::as_range));
                write_all_vectored(&mut w, &mut slices, limit)
                    .await
                    .map_err(|e| lost(Step::Write, e))?;
            }
            Outgoing::Read { id, descs } => {
                let Some((descs, _)) =
                    try_direct(&pending, direct.as_ref(), Dir::Read, id, descs, Vec::new())
                else {
                    continue;
                };
                within(
                    limit,
                    write_msg(&mut w, &Message::ReadBatch(Batch { id, ops: descs })),
                )
                .await
                .map_err(|e| lost(Step::Read, e))?;
            }
            Outgoing::Frame(f) => within(limit, async {
                w.write_all(&f).await?;
                w.flush().await
            })
            .await
            .map_err(|e| lost(Step::Notify, e))?,
            Outgoing::Wake => {}
            Outgoing::ReadResp { id, result, held } => match result {
                Ok(sources) => {
                    let mut frame = Message::ReadResp(Ack { id, error: None })
                        .to_frame()
                        .map_err(|e| Error::Local(e.to_string()))?;
                    let mut slices = Vec::with_capacity(sources.len() + 1);
                    slices.push(PeerRange::owned(&mut frame));
                    slices.extend(sources.iter().map(LocalSlice::as_range));
                    write_all_vectored(&mut w, &mut slices, limit)
                        .await
                        .map_err(|e| lost(Step::Read, e))?;
                    drop(slices);
                    drop(held);
                }
                Err(reject) => within(
                    limit,
                    write_msg(
                        &mut w,
                        &Message::ReadResp(Ack {
                            id,
                            error: Some(reject),
                        }),
                    ),
                )
                .await
                .map_err(|e| lost(Step::Read, e))?,
            },
            Outgoing::Shutdown => break,
        }
    }
    Ok(())
}

/// A frame write bounded by `limit` (on a blocking socket `SO_SNDTIMEO` bounds each call).
async fn within(
    limit: Duration,
    write: impl std::future::Future<Output = std::io::Result<()>>,
) -> std::io::Result<()> {
    match tokio::time::timeout(limit, write).await {
        Ok(r) => r,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Everything the reader task needs.
pub(crate) struct ReaderCtx {
    pub(crate) peer: PeerId,
    /// Our batches waiting for their outcome: the peer's acknowledgements complete them.
    pub(crate) pending: Arc<Pending>,
    /// The peer's batches accepted here and not completed yet.
    pub(crate) incoming: Arc<InFlight>,
    /// The peer's incarnation, as the handshake established it.
    pub(crate) incarnation: kvbridge_proto::Incarnation,
    pub(crate) table: Arc<RegionTable>,
    pub(crate) limits: Limits,
    /// How long a batch's payload may take to arrive once its header did.
    pub(crate) payload_deadline: Duration,
    pub(crate) hooks: TestHooks,
    pub(crate) notifications: mpsc::Sender<Notification>,
    pub(crate) out: WriterQueue,
    /// The channel's count of batches refused for passing the per-peer limit on bytes in
    /// flight.
    pub(crate) in_flight_refused: Arc<AtomicU64>,
}

impl ReaderCtx {
    /// Sends a successful `WriteAck` or `NotifyAck`: on the fast lane when the connection
    /// is idle (this thread writes it), else through the writer. `Ok(false)`: the writer is
    /// gone (the session is ending).
    async fn ack(&self, m: Message, step: Step) -> Result<bool> {
        let frame = m.to_frame().map_err(|e| Error::Local(e.to_string()))?;
        match self.out.send_direct(&frame) {
            Direct::Sent => Ok(true),
            Direct::Broken(e) => Err(Error::lost(self.peer.as_str(), step, e)),
            Direct::Queue => Ok(self.out.send(Outgoing::Frame(frame)).await.is_ok()),
        }
    }

    fn payload_error(&self, step: Step, e: std::io::Error) -> Error {
        // WouldBlock: SO_SNDTIMEO expired on a blocking socket.
        if matches!(
            e.kind(),
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
        ) {
            Error::Timeout {
                peer: self.peer.to_string(),
                step,
                after: self.payload_deadline,
            }
        } else {
            Error::lost(self.peer.as_str(), step, e)
        }
    }

    fn misbehaved(&self, step: Step, detail: impl Into<String>) -> Error {
        Error::PeerMisbehaved {
            peer: self.peer.to_string(),
            step,
            detail: detail.into(),
        }
    }

    /// Holds `n` more bytes of the peer's batches here until the reservation drops, or
    /// refuses the batch when that would pass the per-peer limit.
    fn admit_incoming(&self, n: u64) -> std::result::Result<Reservation, Reject> {
        InFlight::try_reserve(&self.incoming, n).map_err(|Refused { held, max }| Reject {
            code: ErrorCode::LimitExceeded,
            message: format!(
                "a batch of {n} bytes with {held} bytes of this peer's already in flight \
                 passes the limit of {max} bytes in flight per peer"
            ),
        })
    }

    /// Admits a validated batch under the per-peer limit on bytes in flight (counting a
    /// refusal).
    fn admit(
        &self,
        b: &Batch,
        dests: Vec<LocalSlice>,
    ) -> std::result::Result<(Vec<LocalSlice>, Reservation), Reject> {
        let n = b.payload_len().unwrap_or(u64::MAX);
        match self.admit_incoming(n) {
            Ok(held) => Ok((dests, held)),
            Err(r) => {
                self.in_flight_refused.fetch_add(1, Ordering::Relaxed);
                Err(r)
            }
        }
    }

    /// Validates a peer's batch against our regions: every op in a region granted to the
    /// peer and inside it, the batch within limits. Returns the ranges, marked in use
    /// (`writes`: the batch writes into them).
    pub(crate) fn resolve(
        &self,
        b: &Batch,
        writes: bool,
    ) -> std::result::Result<Vec<LocalSlice>, Reject> {
        let reject = |code, message: String| Reject { code, message };
        if b.ops.len() > self.limits.max_ops_per_batch {
            return Err(reject(
                ErrorCode::LimitExceeded,
                format!(
                    "{} ops in one batch, limit {}",
                    b.ops.len(),
                    self.limits.max_ops_per_batch
                ),
            ));
        }
        match b.payload_len() {
            Some(n) if n <= self.limits.max_batch_bytes => {}
            n => {
                return Err(reject(
                    ErrorCode::LimitExceeded,
                    format!(
                        "batch of {n:?} bytes, limit {}",
                        self.limits.max_batch_bytes
                    ),
                ))
            }
        }
        let mut out = Vec::with_capacity(b.ops.len());
        for (i, op) in b.ops.iter().enumerate() {
            let region = match self
                .table
                .use_for(&self.peer, &op.region, op.offset, op.len, writes)
            {
                Ok(r) => r,
                Err(denied) => {
                    return Err(reject(denied.code(), denied.message(i, &op.region, writes)))
                }
            };
            if !region.region().contains(op.offset, op.len) {
                return Err(reject(
                    ErrorCode::OutOfBounds,
                    format!(
                        "op {i}: {} bytes at offset {} outside region {} of {} bytes",
                        op.len,
                        op.offset,
                        op.region,
                        region.region().len()
                    ),
                ));
            }
            out.push(LocalSlice {
                region,
                offset: op.offset as usize,
                len: op.len as usize,
            });
        }
        Ok(out)
    }

    /// [`ReaderCtx::resolve`] for a write batch. While one of its regions is being detached
    /// from shared memory (its bytes copied to fresh memory), the batch waits for the copy
    /// to end (bounded by the payload deadline) before it takes its ranges: a write during
    /// the copy would be lost.
    async fn resolve_write(&self, b: &Batch) -> std::result::Result<Vec<LocalSlice>, Reject> {
        loop {
            let dests = self.resolve(b, true)?;
            let Some(r) = dests
                .iter()
                .map(|d| d.region.region())
                .find(|r| r.detaching())
                .cloned()
            else {
                return Ok(dests);
            };
            drop(dests);
            r.wait_not_detaching(self.payload_deadline).await;
        }
    }
}

/// A write batch's destinations must not overlap: each becomes a `&mut [u8]` that the
/// payload is read into, and two of those over the same bytes are not allowed (nor is a
/// batch whose result depends on op order meaningful).
fn disjoint(dests: Vec<LocalSlice>, b: &Batch) -> std::result::Result<Vec<LocalSlice>, Reject> {
    let mut by_addr: Vec<(usize, usize, usize)> = dests
        .iter()
        .enumerate()
        .filter(|(_, d)| d.len > 0)
        .map(|(i, d)| (d.ptr() as usize, d.len, i))
        .collect();
    by_addr.sort_unstable();
    for w in by_addr.windows(2) {
        let ((a, alen, i), (c, _, j)) = (w[0], w[1]);
        if a + alen > c {
            let (i, j) = (i.min(j), i.max(j));
            return Err(Reject {
                code: ErrorCode::OutOfBounds,
                message: format!(
                    "ops {i} and {j} of write batch {} overlap in region {}",
                    b.id, b.ops[i].region
                ),
            });
        }
    }
    Ok(dests)
}

/// The reader task: serves the peer's batches and completes ours, until the connection ends.
pub(crate) async fn run_reader(mut r: ReadHalf, ctx: ReaderCtx) -> Result<()> {
    let peer = ctx.peer.clone();
    let mut buf = Vec::new();
    loop {
        let msg = match read_data_frame(
            &mut r,
            ctx.limits.max_frame_len,
            &mut buf,
            ctx.payload_deadline,
        )
        .await
        {
            Ok(m) => m,
            Err(ReadError::Eof) => {
                return Err(Error::lost(
                    peer.as_str(),
                    Step::Established,
                    "data connection closed",
                ))
            }
            Err(ReadError::Io(e)) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(Error::Timeout {
                    peer: peer.to_string(),
                    step: Step::Established,
                    after: ctx.payload_deadline,
                })
            }
            Err(ReadError::Io(e)) => return Err(Error::lost(peer.as_str(), Step::Established, e)),
            Err(ReadError::Frame(e)) => {
                return Err(ctx.misbehaved(Step::Established, e.to_string()))
            }
        };
        match msg {
            Message::WriteBatch(b) => {
                let (dests, held) = match ctx
                    .resolve_write(&b)
                    .await
                    .and_then(|d| disjoint(d, &b))
                    .and_then(|d| ctx.admit(&b, d))
                {
                    Ok(d) => d,
                    Err(reject) => {
                        let err = ctx.misbehaved(Step::Write, reject.message.clone());
                        let ack = Message::WriteAck(Ack {
                            id: b.id,
                            error: Some(reject),
                        });
                        if let Ok(f) = ack.to_frame() {
                            let _ = ctx.out.send(Outgoing::Frame(f)).await;
                        }
                        return Err(err);
                    }
                };
                if let Some(d) = ctx.hooks.write_apply_delay {
                    tokio::time::sleep(d).await;
                }
                let mut iov: Vec<PeerRange<'_>> = dests.iter().map(LocalSlice::as_range).collect();
                r.read_exact_vectored_within(&mut iov, ctx.payload_deadline)
                    .await
                    .map_err(|e| ctx.payload_error(Step::Write, e))?;
                drop(iov);
                drop(dests);
                drop(held);
                let ack = Message::WriteAck(Ack {
                    id: b.id,
                    error: None,
                });
                if !ctx.ack(ack, Step::Write).await? {
                    return Ok(());
                }
            }
            Message::ReadBatch(b) => {
                let (result, held) = match ctx.resolve(&b, false).and_then(|d| ctx.admit(&b, d)) {
                    Ok((d, held)) => (Ok(d), Some(held)),
                    Err(r) => (Err(r), None),
                };
                if let (Some(d), Ok(_)) = (ctx.hooks.read_serve_delay, &result) {
                    // Held without holding up the connection: the frames after it (the
                    // acknowledgements of our own notifications among them) are still read,
                    // as they would be behind a slow read on a real host.
                    let out = ctx.out.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(d).await;
                        let _ = out
                            .send(Outgoing::ReadResp {
                                id: b.id,
                                result,
                                held,
                            })
                            .await;
                    });
                    continue;
                }
                let bad = result.as_ref().err().map(|r| r.message.clone());
                if ctx
                    .out
                    .send(Outgoing::ReadResp {
                        id: b.id,
                        result,
                        held,
                    })
                    .await
                    .is_err()
                {
                    return Ok(());
                }
                if let Some(detail) = bad {
                    return Err(ctx.misbehaved(Step::Read, detail));
                }
            }
            Message::Notify(n) => {
                if n.data.0.len() > ctx.limits.max_notify_len {
                    return Err(ctx.misbehaved(
                        Step::Notify,
                        format!(
                            "notification of {} bytes, limit {}",
                            n.data.0.len(),
                            ctx.limits.max_notify_len
                        ),
                    ));
                }
                // Delivered only after every write before it was placed: this task handles
                // the connection's frames strictly in order.
                let _ = ctx
                    .notifications
                    .send(Notification {
                        peer: peer.clone(),
                        incarnation: ctx.incarnation,
                        data: n.data.0,
                    })
                    .await;
                if n.unacked {
                    continue;
                }
                let ack = Message::NotifyAck(Ack {
                    id: n.id,
                    error: None,
                });
                if !ctx.ack(ack, Step::Notify).await? {
                    return Ok(());
                }
            }
            Message::WriteAck(a) | Message::NotifyAck(a) => {
                let Some(w) = ctx.pending.take(a.id) else {
                    return Err(ctx.misbehaved(
                        Step::Write,
                        format!("completion for unknown batch {}", a.id),
                    ));
                };
                let step = if matches!(w, Waiting::Notify(_)) {
                    Step::Notify
                } else {
                    Step::Write
                };
                w.complete(match a.error {
                    None => Ok(()),
                    Some(rj) => Err(Error::Rejected {
                        peer: peer.to_string(),
                        step,
                        code: rj.code,
                        message: rj.message,
                    }),
                });
            }
            Message::ReadResp(a) => {
                let Some(Waiting::Read(dests, done)) = ctx.pending.take(a.id) else {
                    return Err(ctx.misbehaved(
                        Step::Read,
                        format!("read response for unknown batch {}", a.id),
                    ));
                };
                if let Some(rj) = a.error {
                    let _ = done.send(Err(Error::Rejected {
                        peer: peer.to_string(),
                        step: Step::Read,
                        code: rj.code,
                        message: rj.message,
                    }));
                    continue;
                }
                let mut iov: Vec<PeerRange<'_>> = dests.iter().map(LocalSlice::as_range).collect();
                let result = r
                    .read_exact_vectored_within(&mut iov, ctx.payload_deadline)
                    .await
                    .map_err(|e| ctx.payload_error(Step::Read, e));
                drop(iov);
                drop(dests);
                let failed = result.clone().err();
                let _ = done.send(result);
                if let Some(e) = failed {
                    return Err(e);
                }
            }
            // The listener refused the data connection (its session ended meanwhile).
            Message::Reject(rj) | Message::Bye(rj) => {
                return Err(Error::Rejected {
                    peer: peer.to_string(),
                    step: Step::DataBind,
                    code: rj.code,
                    message: rj.message,
                })
            }
            other => {
                return Err(ctx.misbehaved(
                    Step::Established,
                    format!("{} on a data connection", other.name()),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;

    fn batch(r: &Region, lens: &[u64]) -> (Vec<OpDesc>, Vec<LocalSlice>) {
        let mut off = 0u64;
        lens.iter()
            .map(|&len| {
                let d = OpDesc {
                    region: r.id(),
                    offset: off,
                    len,
                };
                let l = LocalSlice {
                    region: r.begin_use(),
                    offset: off as usize,
                    len: len as usize,
                };
                off += len;
                (d, l)
            })
            .unzip()
    }

    /// Parts are contiguous pieces of the batch in order, every byte once, sized by bytes.
    #[test]
    fn split_cuts_by_bytes_and_keeps_every_byte() {
        let r = Region::alloc(8 << 20, 4096).unwrap();
        let lens = [3 << 20, 1, 0, (2 << 20) + 5, 100];
        let total: u64 = lens.iter().sum();
        let (d, l) = batch(&r, &lens);
        let parts = split(d, l, 3);
        assert_eq!(parts.len(), 3);
        let mut next = 0u64;
        for (i, (descs, locals)) in parts.iter().enumerate() {
            assert_eq!(descs.len(), locals.len());
            let bytes: u64 = descs.iter().map(|d| d.len).sum();
            let want = total * (i as u64 + 1) / 3 - total * i as u64 / 3;
            assert_eq!(bytes, want, "part {i}");
            for (d, l) in descs.iter().zip(locals) {
                assert_eq!(d.offset, next);
                assert_eq!((l.offset as u64, l.len as u64), (d.offset, d.len));
                next += d.len;
            }
        }
        assert_eq!(next, total);
        // Every piece holds its own region-in-use guard.
        assert_eq!(r.in_use(), parts.iter().map(|p| p.1.len()).sum::<usize>());
    }

    /// Below two minimum parts a batch stays whole; the part count never exceeds the ways.
    #[test]
    fn small_batches_stay_whole() {
        let r = Region::alloc(8 << 20, 4096).unwrap();
        let (d, l) = batch(&r, &[MIN_PART, MIN_PART - 1]);
        assert_eq!(split(d, l, 4).len(), 1);
        let (d, l) = batch(&r, &[4 * MIN_PART]);
        assert_eq!(split(d, l, 2).len(), 2);
        let (d, l) = batch(&r, &[4 * MIN_PART]);
        assert_eq!(split(d, l, 1).len(), 1);
    }
}
