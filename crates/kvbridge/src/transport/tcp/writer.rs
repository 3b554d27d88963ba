//! The writer of one data connection: sends queued frames and payloads in order, payloads
//! taken straight from registered memory with vectored writes (no staging copy). A batch a
//! backend of the session runs in the caller (regions the peer mapped for us) is run here
//! instead, in order with the frames.

use crate::datapath::pending::Pending;
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

/// Runs a batch queued on a connection in the connection's writer when `here` (the
/// session's backend that completes batches in the caller, if any) reaches every region it
/// names ([`OneSided::run_queued`]), completing it in `pending`; gives the batch back
/// otherwise (it then goes over TCP).
fn try_run_here(
    pending: &Pending,
    here: Option<&dyn OneSided>,
    dir: Dir,
    id: u64,
    descs: Vec<OpDesc>,
    sources: Vec<LocalSlice>,
) -> Option<(Vec<OpDesc>, Vec<LocalSlice>)> {
    let Some(here) = here else {
        return Some((descs, sources));
    };
    let mut sources = Some(sources);
    let mut done = None;
    let ran = here.run_queued(dir, &descs, &mut || {
        // Gone when the batch already ended (the session is tearing down).
        let (dests, tx) = pending.take(id)?.into_parts();
        done = Some(tx);
        match dir {
            Dir::Write => sources.take(),
            Dir::Read => dests,
        }
    });
    match ran {
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
    }
}

/// The writer task: sends queued frames and payloads until `Shutdown` or a socket error.
/// Batches that `here` runs in the caller (the session's same-host backend: regions the peer
/// mapped for us) are run here instead, in order with the frames. Each payload (a write batch, a read response) must be on the wire
/// within `limit` (the op deadline): a peer that stops reading ends the session with
/// `Timeout` instead of holding the writer and the regions it sends from.
pub(crate) async fn run_writer(
    peer: PeerId,
    pending: Arc<Pending>,
    here: Option<Arc<dyn OneSided>>,
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
            Outgoing::Write {
                id,
                descs,
                sources,
                grant,
            } => {
                // A batch that names a grant token goes on the wire, where the peer checks
                // it against the token's windows (`kvbridge_proto::route::ways`).
                let here = here.as_deref().filter(|_| grant.is_none());
                let Some((descs, sources)) =
                    try_run_here(&pending, here, Dir::Write, id, descs, sources)
                else {
                    continue;
                };
                let mut frame = Message::WriteBatch(Batch {
                    id,
                    ops: descs,
                    grant,
                })
                .to_frame()
                .map_err(|e| Error::Local(e.to_string()))?;
                let mut slices = Vec::with_capacity(sources.len() + 1);
                slices.push(PeerRange::owned(&mut frame));
                slices.extend(sources.iter().map(LocalSlice::as_range));
                write_all_vectored(&mut w, &mut slices, limit)
                    .await
                    .map_err(|e| lost(Step::Write, e))?;
            }
            Outgoing::Read { id, descs, grant } => {
                let here = here.as_deref().filter(|_| grant.is_none());
                let Some((descs, _)) =
                    try_run_here(&pending, here, Dir::Read, id, descs, Vec::new())
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
