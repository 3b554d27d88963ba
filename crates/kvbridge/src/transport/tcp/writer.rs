//! The writer of one data connection: sends queued frames and payloads in order, payloads
//! taken straight from registered memory with vectored writes (no staging copy). A batch a
//! backend of the session runs in the caller (regions the peer mapped for us) is run here
//! instead, in order with the frames.

use crate::datapath::pending::{Claim, Pending};
use crate::dir::Dir;
use crate::error::{Error, Result};
use crate::net::WriteHalf;
use crate::peer_memory::PeerRange;
use crate::region::LocalSlice;
use crate::transport::one_sided::{OneSided, RunQueued};
use crate::wire::{write_all_vectored, write_msg};
use crate::writer_queue::Outgoing;
use crate::writer_queue::WriterRx;
use kvbridge_proto::handshake::Step;
use kvbridge_proto::msg::{Ack, Batch, Message, OpDesc};
use kvbridge_proto::PeerId;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;

/// A test hook: how long to hold a batch taken for a direct copy before copying it, and the
/// count of batches held (`TestHooks::direct_copy_delay`).
pub(crate) type CopyDelay = Option<(Duration, Arc<std::sync::atomic::AtomicU64>)>;

/// Runs a batch queued on a connection in the connection's writer when `here` (the
/// session's backend that completes batches in the caller, if any) reaches every region it
/// names ([`OneSided::run_queued`]), completing it in `pending`; gives the batch back
/// otherwise (it then goes over TCP). The batch is claimed while it is copied, so a cancel
/// of it waits for the copy (`own_thread`: this writer runs on a thread of its own).
/// `copy_delay` (a test hook) holds the claimed batch before its copy.
fn try_run_here(
    pending: &Pending,
    here: Option<&dyn OneSided>,
    (dir, id, own_thread): (Dir, u64, bool),
    descs: Vec<OpDesc>,
    sources: Vec<LocalSlice>,
    copy_delay: &CopyDelay,
) -> Option<(Vec<OpDesc>, Vec<LocalSlice>)> {
    let Some(here) = here else {
        return Some((descs, sources));
    };
    let mut sources = Some(sources);
    let mut done = None;
    let mut claim = None;
    let ran = here.run_queued(dir, &descs, &mut || {
        // Gone when the batch already ended (the session is tearing down) or was cancelled.
        let (waiting, held) = pending.take_claimed(id, own_thread)?;
        claim = Some(held);
        let (dests, tx) = waiting.into_parts();
        done = Some(tx);
        if let Some((d, held)) = copy_delay {
            held.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::thread::sleep(*d);
        }
        match dir {
            Dir::Write => sources.take(),
            Dir::Read => dests,
        }
    });
    let r = match ran {
        RunQueued::NotHere => Some((
            descs,
            sources.expect("given back when the batch does not run here"),
        )),
        RunQueued::AlreadyEnded => None,
        RunQueued::Done(r) => {
            if let Some(tx) = done {
                let _ = tx.send(r);
            }
            None
        }
    };
    drop(claim);
    r
}

/// The writer task: sends queued frames and payloads until `Shutdown` or a socket error.
/// Batches that `here` runs in the caller (the session's same-host backend: regions the peer
/// mapped for us) are run here instead, in order with the frames. Each payload (a write
/// batch, a read response) must be on the wire within `limit` (the op deadline): a peer that
/// stops reading ends the session with `Timeout` instead of holding the writer and the
/// regions it sends from. A batch of ours is claimed in `pending` while its request is
/// written (a write's sources are read then) and skipped when it was cancelled before.
/// `copy_delay`: [`try_run_here`]'s test hook.
pub(crate) async fn run_writer(
    peer: PeerId,
    pending: Arc<Pending>,
    here: Option<Arc<dyn OneSided>>,
    mut w: WriteHalf,
    mut rx: WriterRx,
    (limit, copy_delay): (Duration, CopyDelay),
) -> Result<()> {
    let own_thread = matches!(w, WriteHalf::Blocking(_));
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
            Outgoing::Write {
                id,
                descs,
                sources,
                grant,
            } => {
                // A batch that names a grant token goes on the wire, where the peer checks
                // it against the token's windows (`kvbridge_proto::route::ways`).
                let here = here.as_deref().filter(|_| grant.is_none());
                let batch = (Dir::Write, id, own_thread);
                let Some((descs, sources, claim)) =
                    to_send(&pending, here, batch, descs, sources, &copy_delay)
                else {
                    continue;
                };
                let m = Message::WriteBatch(Batch {
                    id,
                    ops: descs,
                    grant,
                });
                send_with_payload(&mut w, &m, &sources, limit)
                    .await?
                    .map_err(|e| lost(Step::Write, e))?;
                drop(claim);
            }
            Outgoing::Read { id, descs, grant } => {
                let here = here.as_deref().filter(|_| grant.is_none());
                let batch = (Dir::Read, id, own_thread);
                let Some((descs, _, claim)) =
                    to_send(&pending, here, batch, descs, Vec::new(), &copy_delay)
                else {
                    continue;
                };
                let batch = Batch {
                    id,
                    ops: descs,
                    grant,
                };
                within(limit, write_msg(&mut w, &Message::ReadBatch(batch)))
                    .await
                    .map_err(|e| lost(Step::Read, e))?;
                drop(claim);
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
                    let m = Message::ReadResp(Ack { id, error: None });
                    send_with_payload(&mut w, &m, &sources, limit)
                        .await?
                        .map_err(|e| lost(Step::Read, e))?;
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

/// A batch of ours queued on the connection, to put on the wire: `None` when nothing of it
/// is to be sent (`here` ran it, [`try_run_here`]; or it ended or was cancelled before).
/// It is marked sent and claimed while its request (and a write's payload, read from its
/// sources) is written, so that a cancel from then on waits for that and leaves a tombstone
/// for the peer's answer.
fn to_send<'p>(
    pending: &'p Pending,
    here: Option<&dyn OneSided>,
    batch: (Dir, u64, bool),
    descs: Vec<OpDesc>,
    sources: Vec<LocalSlice>,
    copy_delay: &CopyDelay,
) -> Option<(Vec<OpDesc>, Vec<LocalSlice>, Claim<'p>)> {
    let (descs, sources) = try_run_here(pending, here, batch, descs, sources, copy_delay)?;
    let (_, id, own_thread) = batch;
    let claim = pending.claim_to_send(id, own_thread)?;
    Some((descs, sources, claim))
}

/// Writes `m`'s frame followed by the bytes of `payload`, straight from registered memory,
/// within `limit`; the outer error: `m` could not be encoded.
async fn send_with_payload(
    w: &mut WriteHalf,
    m: &Message,
    payload: &[LocalSlice],
    limit: Duration,
) -> Result<std::io::Result<()>> {
    let mut frame = m.to_frame().map_err(|e| Error::Local(e.to_string()))?;
    let mut slices = Vec::with_capacity(payload.len() + 1);
    slices.push(PeerRange::owned(&mut frame));
    slices.extend(payload.iter().map(LocalSlice::as_range));
    Ok(write_all_vectored(w, &mut slices, limit).await)
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
