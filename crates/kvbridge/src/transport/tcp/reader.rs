//! The reader of one data connection: serves the peer's batches, validating each op header
//! (region exists, granted to this peer, in bounds) before it reads a payload byte straight
//! into place, and completes our own batches when their acknowledgements arrive.

use crate::config::Limits;
use crate::datapath::pending::{Landing, Pending, Waiting};
use crate::error::{Error, Result};
use crate::events::Notification;
use crate::grant::{Denied, RegionTable};
use crate::in_flight::{InFlight, Refused, Reservation};
use crate::net::ReadHalf;
use crate::notify_queues::{Admission, Inlet};
use crate::peer_memory::PeerRange;
use crate::region::LocalSlice;
use crate::test_hooks::TestHooks;
use crate::wire::{read_data_frame, ReadError};
use crate::writer_queue::Outgoing;
use crate::writer_queue::{FastSend, WriterQueue};
use kvbridge_proto::handshake::Step;
use kvbridge_proto::msg::{Ack, Batch, ErrorCode, Message, Notify, Reject};
use kvbridge_proto::PeerId;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
    /// Where the peer's notifications wait for the application.
    pub(crate) notifications: Arc<Inlet>,
    pub(crate) out: WriterQueue,
    /// The channel's count of batches refused for passing the per-peer limit on bytes in
    /// flight.
    pub(crate) in_flight_refused: Arc<AtomicU64>,
    /// The channel's count of answers to batches cancelled after they were sent, dropped
    /// when they came (`Stats::late_answers_discarded`).
    pub(crate) late_answers: Arc<AtomicU64>,
}

impl ReaderCtx {
    /// Sends a successful `WriteAck` or `NotifyAck`: on the fast lane when the connection
    /// is idle (this thread writes it), else through the writer. `Ok(false)`: the writer is
    /// gone (the session is ending).
    async fn ack(&self, m: Message, step: Step) -> Result<bool> {
        let frame = m.to_frame().map_err(|e| Error::Local(e.to_string()))?;
        match self.out.send_fast(&frame) {
            FastSend::Sent => Ok(true),
            FastSend::Broken(e) => Err(Error::lost(self.peer.as_str(), step, e)),
            FastSend::Queue => Ok(self.out.send(Outgoing::Frame(frame)).await.is_ok()),
        }
    }

    /// The error that ends the connection when its next frame cannot be read.
    fn read_failed(&self, e: ReadError) -> Error {
        match e {
            ReadError::Eof => Error::lost(
                self.peer.as_str(),
                Step::Established,
                "data connection closed",
            ),
            ReadError::Io(e) if e.kind() == std::io::ErrorKind::TimedOut => Error::Timeout {
                peer: self.peer.to_string(),
                step: Step::Established,
                after: self.payload_deadline,
            },
            ReadError::Io(e) => Error::lost(self.peer.as_str(), Step::Established, e),
            ReadError::Frame(e) => self.misbehaved(Step::Established, e.to_string()),
        }
    }

    /// The peer's write batch `b`: its op headers checked, its payload read straight into
    /// place from `r`, then acknowledged. A batch refused is acknowledged with the reason and
    /// ends the session. `Ok(false)`: the writer is gone.
    async fn apply_write(&self, r: &mut ReadHalf, b: Batch) -> Result<bool> {
        let (dests, held) = match self
            .resolve_write(&b)
            .await
            .and_then(|d| disjoint(d, &b))
            .and_then(|d| self.admit(&b, d))
        {
            Ok(d) => d,
            Err(reject) => {
                let err = self.misbehaved(Step::Write, reject.message.clone());
                let ack = Message::WriteAck(Ack {
                    id: b.id,
                    error: Some(reject),
                });
                if let Ok(f) = ack.to_frame() {
                    let _ = self.out.send(Outgoing::Frame(f)).await;
                }
                return Err(err);
            }
        };
        if let Some(d) = self.hooks.write_apply_delay {
            tokio::time::sleep(d).await;
        }
        let mut iov: Vec<PeerRange<'_>> = dests.iter().map(LocalSlice::as_range).collect();
        r.read_exact_vectored_within(&mut iov, self.payload_deadline)
            .await
            .map_err(|e| self.payload_error(Step::Write, e))?;
        drop(iov);
        drop(dests);
        drop(held);
        let ack = Message::WriteAck(Ack {
            id: b.id,
            error: None,
        });
        self.ack(ack, Step::Write).await
    }

    /// The peer's read batch `b`: its op headers checked, then handed to the writer, which
    /// sends the bytes (or the refusal, which ends the session, except for a read refused
    /// as outside the windows open to the peer and to the token it names: a soft refusal,
    /// see [`ReaderCtx::check`]). `Ok(false)`: the writer is gone.
    async fn serve_read(&self, b: Batch) -> Result<bool> {
        let (result, held, soft) = match self.check(&b, false) {
            Ok(d) => match self.admit(&b, d) {
                Ok((d, held)) => (Ok(d), Some(held), false),
                Err(r) => (Err(r), None, false),
            },
            Err((r, soft)) => (Err(r), None, soft),
        };
        if let (Some(d), Ok(_)) = (self.hooks.read_serve_delay, &result) {
            // Held without holding up the connection: the frames after it (the
            // acknowledgements of our own notifications among them) are still read,
            // as they would be behind a slow read on a real host.
            let out = self.out.clone();
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
            return Ok(true);
        }
        let bad = result
            .as_ref()
            .err()
            .filter(|_| !soft)
            .map(|r| r.message.clone());
        if self
            .out
            .send(Outgoing::ReadResp {
                id: b.id,
                result,
                held,
            })
            .await
            .is_err()
        {
            return Ok(false);
        }
        if let Some(detail) = bad {
            return Err(self.misbehaved(Step::Read, detail));
        }
        Ok(true)
    }

    /// The peer's notification `n`, delivered to the application (and confirmed, unless the
    /// peer asked for no confirmation). `Ok(false)`: the writer is gone.
    async fn deliver(&self, n: Notify) -> Result<bool> {
        if n.data.0.len() > self.limits.max_notify_len {
            return Err(self.misbehaved(
                Step::Notify,
                format!(
                    "notification of {} bytes, limit {}",
                    n.data.0.len(),
                    self.limits.max_notify_len
                ),
            ));
        }
        // Delivered only after every write before it was placed: this task handles
        // the connection's frames strictly in order.
        let notification = Notification {
            peer: self.peer.clone(),
            incarnation: self.incarnation,
            data: n.data.0,
        };
        // Room in the peer's queue first (this connection reads nothing more until there
        // is some: backpressure on this peer alone, `notify_queues`), then the
        // confirmation on its way (written, or queued ahead of anything a close queues
        // after it), then the delivery, with no await between the last two: an
        // application that closes the moment it has the notification cannot end the
        // session before the confirmation left, and one not confirmed is not delivered.
        // (No room ever: the application dropped its channel; confirmed as before.)
        let room = match self
            .notifications
            .room(&self.peer, notification.data.len(), self.payload_deadline)
            .await
        {
            Admission::Room(r) => Some(r),
            Admission::Gone => None,
            Admission::TimedOut => {
                return Err(Error::Timeout {
                    peer: self.peer.to_string(),
                    step: Step::Notify,
                    after: self.payload_deadline,
                })
            }
        };
        if !n.unacked {
            let ack = Message::NotifyAck(Ack {
                id: n.id,
                error: None,
            });
            if !self.ack(ack, Step::Notify).await? {
                return Ok(false);
            }
        }
        if let Some(room) = room {
            room.fill(notification);
        }
        Ok(true)
    }

    /// The peer's answer `a` to one of our reads: its payload read straight into the read's
    /// destinations (claimed meanwhile, so that a cancel of the read waits for the copy),
    /// then the read completed. The answer to a read cancelled after it was sent is read
    /// past and dropped, and counted: a slow peer is not a hostile one.
    async fn land_read(&self, r: &mut ReadHalf, a: Ack, own_thread: bool) -> Result<bool> {
        let (dests, done, claim) = match self.pending.land(a.id, own_thread) {
            Landing::Live(l) => l,
            Landing::Late { bytes } => {
                self.late_answers.fetch_add(1, Ordering::Relaxed);
                if a.error.is_none() {
                    self.read_past(r, bytes).await?;
                }
                return Ok(true);
            }
            Landing::Unknown => {
                return Err(self.misbehaved(
                    Step::Read,
                    format!("read response for unknown batch {}", a.id),
                ))
            }
        };
        if let Some(rj) = a.error {
            let _ = done.send(Err(Error::Rejected {
                peer: self.peer.to_string(),
                step: Step::Read,
                code: rj.code,
                message: rj.message,
            }));
            return Ok(true);
        }
        let mut iov: Vec<PeerRange<'_>> = dests.iter().map(LocalSlice::as_range).collect();
        let result = r
            .read_exact_vectored_within(&mut iov, self.payload_deadline)
            .await
            .map_err(|e| self.payload_error(Step::Read, e));
        drop(iov);
        drop(dests);
        let failed = result.clone().err();
        let _ = done.send(result);
        drop(claim);
        match failed {
            Some(e) => Err(e),
            None => Ok(true),
        }
    }

    /// Reads `bytes` of payload off the connection into a scratch buffer, within the
    /// payload deadline (the answer to a cancelled read).
    async fn read_past(&self, r: &mut ReadHalf, mut bytes: u64) -> Result<()> {
        /// Scratch bytes per read: the payload's destinations are gone, so it goes nowhere.
        const SCRATCH: usize = 256 << 10;
        let mut scratch = vec![0u8; SCRATCH.min(usize::try_from(bytes).unwrap_or(SCRATCH))];
        let start = std::time::Instant::now();
        while bytes > 0 {
            let n = scratch
                .len()
                .min(usize::try_from(bytes).unwrap_or(usize::MAX));
            // At least a millisecond: a zero timeout is refused by the socket.
            let left = self
                .payload_deadline
                .saturating_sub(start.elapsed())
                .max(std::time::Duration::from_millis(1));
            let mut iov = [PeerRange::owned(&mut scratch[..n])];
            r.read_exact_vectored_within(&mut iov, left)
                .await
                .map_err(|e| self.payload_error(Step::Read, e))?;
            bytes -= n as u64;
        }
        Ok(())
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
    /// peer, in that direction, inside it and inside the windows open to the peer or to the
    /// grant token the batch names where the region confines that direction; the batch
    /// within limits. Returns the ranges, marked in use (`writes`: the batch writes into
    /// them) and counted in the windows they pass.
    pub(crate) fn resolve(
        &self,
        b: &Batch,
        writes: bool,
    ) -> std::result::Result<Vec<LocalSlice>, Reject> {
        self.check(b, writes).map_err(|(r, _)| r)
    }

    /// [`ReaderCtx::resolve`], a refusal paired with whether it is soft: a read that reaches
    /// outside the windows open to the peer and to the grant token it names (if any). Such
    /// a read fails with `AccessDenied`, is counted, and the session goes on: it is the
    /// ordinary race of a holder with its grant (a read just before the owner opened the
    /// request's windows, or just after it closed them), or a peer that holds the secret
    /// but not the grant, which could connect again anyway; no byte of the batch moved, and
    /// a read request carries no payload, so nothing is left to resynchronise on the
    /// connection. Every other refusal (a write outside its windows, whose payload follows
    /// its header; a mode, a region, bounds or limits) still ends the session.
    fn check(
        &self,
        b: &Batch,
        writes: bool,
    ) -> std::result::Result<Vec<LocalSlice>, (Reject, bool)> {
        let reject = |code, message: String| (Reject { code, message }, false);
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
        let uses = self
            .table
            .admit(&self.peer, b.grant.as_ref(), &b.ops, writes)
            .map_err(|(i, denied)| {
                let message = denied.message(i, &b.ops[i], writes);
                let soft = !writes && matches!(denied, Denied::OutsideWindows { .. });
                if denied.code() == ErrorCode::AccessDenied {
                    self.table.note_denied(&self.peer, &message, !soft);
                }
                (
                    Reject {
                        code: denied.code(),
                        message,
                    },
                    soft,
                )
            })?;
        Ok(b.ops
            .iter()
            .zip(uses)
            .map(|(op, region)| LocalSlice {
                region,
                offset: op.offset as usize,
                len: op.len as usize,
            })
            .collect())
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
    let own_thread = matches!(r, ReadHalf::Blocking(_));
    let mut buf = Vec::new();
    loop {
        let msg = read_data_frame(
            &mut r,
            ctx.limits.max_frame_len,
            &mut buf,
            ctx.payload_deadline,
        )
        .await
        .map_err(|e| ctx.read_failed(e))?;
        // Whether the session goes on (`false`: the writer is gone, the session ends).
        let goes_on = match msg {
            Message::WriteBatch(b) => ctx.apply_write(&mut r, b).await?,
            Message::ReadBatch(b) => ctx.serve_read(b).await?,
            Message::Notify(n) => ctx.deliver(n).await?,
            Message::WriteAck(a) | Message::NotifyAck(a) => {
                let w = match ctx.pending.take(a.id) {
                    Landing::Live(w) => w,
                    Landing::Late { .. } => {
                        ctx.late_answers.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    Landing::Unknown => {
                        return Err(ctx.misbehaved(
                            Step::Write,
                            format!("completion for unknown batch {}", a.id),
                        ))
                    }
                };
                let step = if matches!(w, Waiting::Notify(_)) {
                    Step::Notify
                } else {
                    Step::Write
                };
                match a.error {
                    None => w.complete(Ok(())),
                    // The peer ends the session of a refused write (`apply_write`): the
                    // session ends here too, and the caller learns of the refusal once
                    // the session is down.
                    Some(rj) if step == Step::Write => {
                        let ends = Error::PeerClosed {
                            peer: peer.to_string(),
                            code: rj.code,
                            message: format!("it refused write batch {}: {}", a.id, rj.message),
                        };
                        ctx.pending.complete_at_end(
                            w,
                            Error::Rejected {
                                peer: peer.to_string(),
                                step,
                                code: rj.code,
                                message: rj.message,
                            },
                        );
                        return Err(ends);
                    }
                    Some(rj) => w.complete(Err(Error::Rejected {
                        peer: peer.to_string(),
                        step,
                        code: rj.code,
                        message: rj.message,
                    })),
                }
                true
            }
            Message::ReadResp(a) => ctx.land_read(&mut r, a, own_thread).await?,
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
        };
        if !goes_on {
            return Ok(());
        }
    }
}
