//! The data path of one session, the callers' side of one-sided writes and reads and of
//! notifications. A batch waits for room under the per-peer limit, is entered in the table
//! of waiting batches (`pending.rs`), and is then either posted on one of the session's
//! one-sided backends (`transport/one_sided.rs`; which one is
//! `kvbridge_proto::route::ways`'s decision, and the data path knows none by name) or queued
//! on a data connection's writer (`transport/tcp`), cut over several connections when it is
//! large (`stripe.rs`). Ordering tickets keep a notification behind every transfer issued
//! before it.
//!
//! A completion is signalled only by the connection's reader or writer, or by the one-sided
//! backend (or by the session after the data tasks have stopped): when a caller learns that its
//! batch ended, no byte of it can still land. A batch that passes its deadline therefore
//! ends the whole session — tearing down the connection is the only way to be sure the
//! peer's late bytes never arrive. A write or read whose caller stops waiting before then
//! is cancelled instead (`cancel.rs`): it leaves the table, its drop waits for any copy of
//! its memory under way, and the peer's late answer to it is dropped when it comes; the
//! session goes on.

mod cancel;
pub(crate) mod pending;
mod stripe;
mod submitted;

pub(crate) use pending::AbortHandle;
pub(crate) use submitted::Submitted;

use crate::dir::Dir;
use crate::error::{Error, Result};
use crate::in_flight::InFlight;
use crate::region::LocalSlice;
use crate::transport::one_sided::{BatchRef, OneSided, Outcome, Posted};
use crate::writer_queue::Outgoing;
use crate::writer_queue::{self, FastSend, WriterQueue, WriterRx};
use kvbridge_proto::handshake::Step;
use kvbridge_proto::ids::Blob;
use kvbridge_proto::msg::{Message, Notify, OpDesc};
use kvbridge_proto::route::{self, Offer, Way};
use kvbridge_proto::{GrantToken, PeerId};
use pending::{Pending, Waiting};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use stripe::split;
use tokio::sync::oneshot;

/// A session's one-sided backends, in the order it got them.
type Backends = Arc<[Arc<dyn OneSided>]>;

/// What the peer said it honours, in its `Hello` or `Welcome`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PeerFeatures {
    /// Unacknowledged notifications ([`DataPath::notify_posted`]).
    pub(crate) unacked_notify: bool,
    /// Batches that name a grant token (`Batch::grant`).
    pub(crate) grant_tokens: bool,
}

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
    /// The one-sided backends through which this side reaches some of the peer's regions
    /// (a mapping, cross-memory attach, a fabric's endpoint); replaced whole when the session
    /// adds one, so a batch works on the set it read.
    one_sided: RwLock<Backends>,
    /// What the peer honours.
    features: PeerFeatures,
}

impl DataPath {
    /// A transfer's place in the order notifications wait for ([`DataPath::wait_earlier`]):
    /// `ids` consecutive ids, the first entered in `order`. Drawn and entered under one lock,
    /// so a notification that draws a later ticket finds this transfer in `order`.
    fn ticket(&self, ids: u64) -> Ticket<'_> {
        let mut order = self.order.lock().expect("order poisoned");
        let id = self.next_id.fetch_add(ids, Ordering::Relaxed);
        order.insert(id);
        Ticket { path: self, id }
    }
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
    /// each, connection 0 first. `one_sided`: the backends that reach some of the peer's
    /// regions from the start, if any; `frames_fast_lane`: the channel's count of frames that
    /// skipped a writer; `features`: what the peer honours.
    pub(crate) fn new(
        peer: PeerId,
        abort: AbortHandle,
        max_in_flight: u64,
        connections: usize,
        one_sided: Vec<Arc<dyn OneSided>>,
        frames_fast_lane: Arc<AtomicU64>,
        features: PeerFeatures,
    ) -> (Arc<Self>, Vec<WriterRx>) {
        let (out, rx) = writer_queue::channel(frames_fast_lane.clone());
        let mut rxs = vec![rx];
        let mut stripes = Vec::new();
        for _ in 1..connections.max(1) {
            let (tx, rx) = writer_queue::channel(frames_fast_lane.clone());
            stripes.push(tx);
            rxs.push(rx);
        }
        (
            Arc::new(Self {
                pending: Arc::new(Pending::new(peer.clone(), max_in_flight)),
                peer,
                next_id: AtomicU64::new(1),
                out,
                stripes,
                order: Mutex::new(Default::default()),
                order_changed: tokio::sync::Notify::new(),
                abort,
                incoming: InFlight::new(max_in_flight),
                one_sided: RwLock::new(one_sided.into()),
                features,
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

    /// From now on, batches may also go through `backend`. A session holds one backend of
    /// each kind: the first it adds stays (a later one of the same name is ignored).
    // Used by the UCX negotiation (`session/ucx.rs`) and the loopback backend's tests.
    #[cfg_attr(not(any(feature = "ucx", test)), allow(dead_code))]
    pub(crate) fn add_one_sided(&self, backend: Arc<dyn OneSided>) {
        let mut all = self.one_sided.write().expect("backends poisoned");
        if all.iter().any(|b| b.name() == backend.name()) {
            return;
        }
        let mut grown: Vec<Arc<dyn OneSided>> = all.iter().cloned().collect();
        grown.push(backend);
        *all = grown.into();
    }

    /// Whether the backend named `name` reaches some of the peer's regions now.
    // Asked by `Channel::peer_transport` about UCX, and by the loopback backend's tests.
    #[cfg_attr(not(any(feature = "ucx", test)), allow(dead_code))]
    pub(crate) fn carried_by(&self, name: &str) -> bool {
        let all = self.one_sided.read().expect("backends poisoned");
        all.iter().any(|b| b.name() == name && b.reaches_any())
    }

    /// Runs a write (`Dir::Write`, `locals` are the sources) or a read (`locals` are the
    /// destinations) under `deadline`, naming `grant` to the peer if set: on the first of
    /// the session's one-sided backends that takes it, in the order
    /// `kvbridge_proto::route::ways` gives, else over the data connections
    /// ([`DataPath::over_tcp`]). A batch that names a token to a peer that does not honour
    /// tokens fails with `Incompatible` before anything is sent.
    pub(crate) async fn transfer(
        &self,
        dir: Dir,
        deadline: Duration,
        descs: Vec<OpDesc>,
        locals: Vec<LocalSlice>,
        grant: Option<GrantToken>,
    ) -> Result<()> {
        let step = match dir {
            Dir::Write => Step::Write,
            Dir::Read => Step::Read,
        };
        if grant.is_some() && !self.features.grant_tokens {
            return Err(Error::Incompatible {
                peer: self.peer.to_string(),
                step,
                ours: "a batch that names a grant token".into(),
                theirs: "a build that predates grant tokens (its Hello or Welcome did not say \
                         grant_tokens): name no token to it, or upgrade it"
                    .into(),
            });
        }
        let bytes: u64 = descs.iter().map(|d| d.len).sum();
        let backends: Backends = self.one_sided.read().expect("backends poisoned").clone();
        if !backends.is_empty() {
            let offers: Vec<Offer> = backends.iter().map(|b| b.offer(dir, &descs)).collect();
            let batch = route::Batch {
                read: dir == Dir::Read,
                striped: !self.stripes.is_empty(),
                caller_may_copy: offers.iter().any(|o| o.copies_in_caller) && multi_thread(),
                grant: grant.is_some(),
            };
            for way in route::ways(batch, &offers) {
                let Way::OneSided(i) = way else { break };
                let r = self
                    .post_one_sided(&*backends[i], step, dir, deadline, bytes, &descs, &locals)
                    .await;
                if let Some(r) = r {
                    return r;
                }
            }
        }
        self.over_tcp(step, dir, deadline, bytes, (descs, locals), grant)
            .await
    }

    /// Posts a batch of `bytes` on `backend` and completes it; `None` when the backend gave
    /// it back (nothing done). The batch holds room under the per-peer limit and a ticket
    /// in `order` until it completed, so a notification issued meanwhile waits for it
    /// ([`DataPath::wait_earlier`]). No await from the check that the session is open to
    /// the post: a backend that copies inside `post` copies only while the session holds,
    /// and a session that ends waits for that copy before it says that nothing of it lands
    /// any more (`ShmPeer::revoke_all`).
    #[allow(clippy::too_many_arguments)]
    async fn post_one_sided(
        &self,
        backend: &dyn OneSided,
        step: Step,
        dir: Dir,
        deadline: Duration,
        bytes: u64,
        descs: &[OpDesc],
        locals: &[LocalSlice],
    ) -> Option<Result<()>> {
        let until = tokio::time::Instant::now() + deadline;
        let room = match self
            .pending
            .acquire_room(step, deadline, until, bytes)
            .await
        {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        let _ticket = self.ticket(1);
        if let Some(e) = self.pending.closed() {
            return Some(Err(e));
        }
        let posted = backend.post(BatchRef {
            peer: &self.peer,
            dir,
            descs,
            locals,
            bytes,
            deadline,
            until,
        });
        let ends = matches!(posted, Posted::Pending(_))
            .then(|| cancel::EndSessionOnDrop::new(self.abort.clone(), self.peer.clone(), step));
        let outcome = posted.complete().await;
        if let Some(g) = ends {
            g.disarm();
        }
        drop(room);
        match outcome {
            Outcome::Done => Some(Ok(())),
            Outcome::GivenBack => None,
            Outcome::Failed(e) => Some(Err(e)),
            Outcome::FailedMayLand(e) => {
                self.abort.abort(e.clone());
                Some(Err(e))
            }
            Outcome::SessionEnded => Some(Err(self
                .pending
                .closed()
                .unwrap_or_else(|| Error::lost(self.peer.as_str(), step, "session ended")))),
        }
    }

    /// Runs a batch (its op headers and local ranges) over the data connections, split by
    /// bytes over them when it is large enough ([`DataPath::striped`]), each part naming
    /// `grant`.
    async fn over_tcp(
        &self,
        step: Step,
        dir: Dir,
        deadline: Duration,
        bytes: u64,
        (descs, locals): (Vec<OpDesc>, Vec<LocalSlice>),
        grant: Option<GrantToken>,
    ) -> Result<()> {
        if !self.stripes.is_empty() {
            return self
                .striped(step, dir, deadline, bytes, (descs, locals), grant)
                .await;
        }
        match dir {
            Dir::Write => {
                self.run(step, deadline, bytes, DataPath::write_waiting, |id| {
                    Outgoing::Write {
                        id,
                        descs,
                        sources: locals,
                        grant,
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
                    |id| Outgoing::Read { id, descs, grant },
                )
                .await
            }
        }
    }

    /// After a part of a striped read was refused: waits, until `until`, for the parts not
    /// yet `resolved`. `None` when each completed or was refused too (nothing of the batch
    /// can land any more, the session goes on); else the error that must end the session:
    /// another part's failure, or `Timeout` past `until`.
    async fn after_refused_read(
        &self,
        rxs: &mut [oneshot::Receiver<Result<()>>],
        resolved: &mut usize,
        step: Step,
        until: tokio::time::Instant,
        deadline: Duration,
    ) -> Option<Error> {
        let rest = async {
            for rx in rxs.iter_mut().skip(*resolved) {
                let r = rx.await.unwrap_or_else(|_| {
                    Err(Error::lost(self.peer.as_str(), step, "session ended"))
                });
                *resolved += 1;
                match r {
                    Err(e) if !refused_read(&e) => return Some(e),
                    _ => {}
                }
            }
            None
        };
        match tokio::time::timeout_at(until, rest).await {
            Ok(other) => other,
            Err(_) => Some(Error::Timeout {
                peer: self.peer.to_string(),
                step,
                after: deadline,
            }),
        }
    }

    /// Runs a batch split by bytes over the data connections. It completes when every part
    /// is acknowledged; when any part fails the session ends (so no byte of the batch lands
    /// later) and the batch fails with the first part's error. A read part the peer refused
    /// ends no session: the batch fails with that refusal once every other part ended.
    async fn striped(
        &self,
        step: Step,
        dir: Dir,
        deadline: Duration,
        bytes: u64,
        (descs, locals): (Vec<OpDesc>, Vec<LocalSlice>),
        grant: Option<GrantToken>,
    ) -> Result<()> {
        let until = tokio::time::Instant::now() + deadline;
        // Room for the whole batch under the per-peer limit first, as for one connection;
        // each part then holds its share, released when it completes.
        let mut room = self
            .pending
            .acquire_room(step, deadline, until, bytes)
            .await?;
        let parts = split(descs, locals, self.connections());
        let ticket = self.ticket(parts.len() as u64);
        let first = ticket.id;
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
                        grant,
                    },
                ),
                Dir::Read => (
                    Waiting::Read(locals, tx),
                    Outgoing::Read { id, descs, grant },
                ),
            };
            entries.push((id, w, part_bytes, part_room));
            rxs.push(rx);
            sends.push((i, o));
        }
        // Every part is entered before any frame is queued.
        self.pending.enter_all(entries)?;
        let cancel = self.cancel_on_drop(step, first..first + last as u64 + 1, deadline, until);
        // Every return below comes once each part ended, or the session was ended and
        // drained them: only a drop before that cancels.
        let r = async move {
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
            // A read part the peer refused moved nothing (the refusal comes instead of its
            // bytes), and a read refused for its windows ends no session there: wait for the
            // other parts, and only one that fails otherwise, or runs late, ends the session.
            let err = if refused_read(&err) {
                match self
                    .after_refused_read(&mut rxs, &mut resolved, step, until, deadline)
                    .await
                {
                    None => return Err(err),
                    Some(ends) => ends,
                }
            } else {
                err
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
        .await;
        cancel.disarm();
        r
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
        self.submit_with(step, deadline, bytes, waiting, |id| Ok(outgoing(id)), true)
            .await
    }

    /// Submits a notification of `data` (its outcome is the peer's acknowledgement); it
    /// goes on the writer's fast lane when the connection is idle.
    pub(crate) async fn notify(&self, deadline: Duration, data: Vec<u8>) -> Result<Submitted> {
        // Not cancelled when its waiter goes: a notification dropped unconfirmed is still
        // delivered (`QueuedNotify`), and touches no memory of ours.
        self.submit_with(
            Step::Notify,
            deadline,
            0,
            Waiting::Notify,
            |id| {
                Message::Notify(Notify {
                    id,
                    data: Blob(data),
                    unacked: false,
                })
                .to_frame()
                .map(Outgoing::Frame)
                .map_err(|e| Error::Local(e.to_string()))
            },
            false,
        )
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
        if !self.features.unacked_notify {
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
        match self.out.send_fast(&frame) {
            FastSend::Sent => return Ok(()),
            FastSend::Broken(e) => return Err(Error::lost(self.peer.as_str(), Step::Notify, e)),
            FastSend::Queue => {}
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
    /// entered). An encoded frame tries the fast lane first. `cancellable`: the batch is
    /// cancelled when its caller stops waiting (`cancel.rs`), from the moment it is entered.
    async fn submit_with(
        &self,
        step: Step,
        deadline: Duration,
        bytes: u64,
        waiting: impl FnOnce(oneshot::Sender<Result<()>>) -> Waiting,
        outgoing: impl FnOnce(u64) -> Result<Outgoing>,
        cancellable: bool,
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
            cancel: cancellable.then(|| self.cancel_on_drop(step, id..id + 1, deadline, until)),
        };
        if let Outgoing::Frame(frame) = &o {
            match self.out.send_fast(frame) {
                // On the wire; the outcome comes with the peer's acknowledgement.
                FastSend::Sent => return Ok(submitted),
                // The session ends on the shut socket, and the outcome says so.
                FastSend::Broken(e) => {
                    tracing::debug!(peer = %self.peer, error = %e, "frame cut short");
                    return Ok(submitted);
                }
                FastSend::Queue => {}
            }
        }
        match tokio::time::timeout_at(until, self.out.send(o)).await {
            // A closed queue: the writer is gone; the session is tearing down and will
            // drain us (the outcome says so).
            Ok(_) => Ok(submitted),
            Err(_) => Err(submitted.abort_after_timeout().await),
        }
    }

    /// A guard that cancels the batches `ids` when dropped armed (`cancel.rs`).
    fn cancel_on_drop(
        &self,
        step: Step,
        ids: std::ops::Range<u64>,
        deadline: Duration,
        until: tokio::time::Instant,
    ) -> cancel::CancelOnDrop {
        cancel::CancelOnDrop::new(
            self.pending.clone(),
            self.abort.clone(),
            self.peer.clone(),
            step,
            ids,
            deadline,
            until,
        )
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

/// Whether `e` is the peer's refusal of a read (part): it answered instead of sending the
/// bytes, so none of them lands.
fn refused_read(e: &Error) -> bool {
    matches!(
        e,
        Error::Rejected {
            step: Step::Read,
            ..
        }
    )
}

/// Whether the calling task runs on a multi-thread runtime (a current-thread one has no
/// other thread to run its tasks while this one copies).
fn multi_thread() -> bool {
    matches!(
        tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()),
        Ok(tokio::runtime::RuntimeFlavor::MultiThread)
    )
}
