//! Entry points for the fuzz targets in `fuzz/`. Not a stable API: hidden from the docs and
//! free to change with the code it exposes.

use crate::config::Limits;
use crate::datapath::{AbortHandle, DataPath, PeerFeatures};
use crate::grant::{Grant, RegionTable};
use crate::region::Region;
use crate::test_hooks::TestHooks;
use crate::transport::tcp::reader::ReaderCtx;
use kvbridge_proto::msg::{Batch, Reject};
use kvbridge_proto::{Incarnation, PeerId, RegionId};
use std::sync::Arc;
use std::time::Duration;

/// One op of a batch as the data path accepted it: the local range its payload goes to (a
/// write) or comes from (a read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    /// The region the range lies in.
    pub region: RegionId,
    /// Byte offset in that region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Validates the op headers of a peer's `WriteBatch` or `ReadBatch` exactly as the data
/// path's reader does before it reads (or sends) a payload byte: `regions` is this side's
/// region table, `peer` the sender of the batch. Returns the local ranges the ops resolved
/// to, in op order, or the `Reject` the peer would be answered with. Every region-in-use
/// guard taken while validating is released before this returns.
pub fn validate_batch(
    peer: &PeerId,
    regions: &[(Region, Grant)],
    limits: &Limits,
    batch: &Batch,
) -> Result<Vec<Accepted>, Reject> {
    let table = Arc::new(RegionTable::default());
    for (r, g) in regions {
        // A duplicate id is refused by the table; the fuzz target never builds one.
        let _ = table.insert(r.clone(), g.clone().into());
    }
    // Nothing here runs past a deadline; a session to end there is not.
    let abort = AbortHandle::new(|_| {});
    let (path, _out_rx) = DataPath::new(
        peer.clone(),
        abort,
        limits.max_bytes_in_flight_per_peer,
        1,
        Vec::new(),
        Default::default(),
        PeerFeatures {
            unacked_notify: true,
            grant_tokens: true,
        },
    );
    let (notifications, _outlet) = crate::notify_queues::queues(crate::notify_queues::Caps {
        per_peer: 1,
        per_peer_bytes: 0,
        total_bytes: 0,
    });
    let out = path.out_sender();
    let ctx = ReaderCtx {
        peer: peer.clone(),
        pending: path.pending(),
        incoming: path.incoming(),
        incarnation: Incarnation(0),
        table,
        limits: limits.clone(),
        payload_deadline: Duration::from_secs(1),
        hooks: TestHooks::default(),
        notifications,
        out,
        in_flight_refused: Default::default(),
        late_answers: Default::default(),
    };
    ctx.resolve(batch, true).map(|slices| {
        slices
            .iter()
            .map(|s| Accepted {
                region: s.region.region().id(),
                offset: s.offset as u64,
                len: s.len as u64,
            })
            .collect()
    })
}

/// How [`read_frames`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEnd {
    /// The stream ended cleanly between two frames.
    Eof,
    /// A frame was refused (`Truncated` when the stream ended inside one).
    Frame(kvbridge_proto::FrameError),
    /// The reader failed (never expected from an in-memory stream).
    Io(String),
    /// `max_frames` frames were read before the stream ended.
    Limit,
}

/// An in-memory stream that hands out at most `chunk` bytes per read, as a socket may.
struct Chunked<'a> {
    data: &'a [u8],
    chunk: usize,
}

impl tokio::io::AsyncRead for Chunked<'_> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let n = self.data.len().min(self.chunk).min(buf.remaining());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        std::task::Poll::Ready(Ok(()))
    }
}

/// Reads frames off `stream` with the engine's control-connection reader (`wire::read_frame`),
/// handing it at most `chunk` bytes per read, until the stream ends, a frame is refused, or
/// `max_frames` frames were read.
pub fn read_frames(
    stream: &[u8],
    max_body: u32,
    chunk: usize,
    max_frames: usize,
) -> (Vec<kvbridge_proto::msg::Message>, StreamEnd) {
    use crate::wire::{read_frame, ReadError};
    use std::future::Future;
    let mut r = Chunked {
        data: stream,
        chunk: chunk.max(1),
    };
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    for _ in 0..max_frames {
        let fut = read_frame(&mut r, max_body, &mut buf);
        let mut fut = std::pin::pin!(fut);
        // The stream never blocks, so one poll runs the read to its end.
        let std::task::Poll::Ready(res) = fut.as_mut().poll(&mut cx) else {
            return (
                out,
                StreamEnd::Io("the in-memory read did not complete".into()),
            );
        };
        match res {
            Ok(m) => out.push(m),
            Err(ReadError::Eof) => return (out, StreamEnd::Eof),
            Err(ReadError::Frame(e)) => return (out, StreamEnd::Frame(e)),
            Err(ReadError::Io(e)) => return (out, StreamEnd::Io(e.to_string())),
        }
    }
    (out, StreamEnd::Limit)
}
