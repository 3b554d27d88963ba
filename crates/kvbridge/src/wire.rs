//! Reading and writing frames on async streams (check the header, then parse the body).

use crate::net::WriteHalf;
use crate::peer_memory::{self, PeerRange, IOV_MAX};
use kvbridge_proto::frame::{FrameError, FrameHeader, FRAME_HEADER_LEN};
use kvbridge_proto::msg::Message;
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Why reading a frame failed.
#[derive(Debug)]
pub(crate) enum ReadError {
    /// Clean end of stream between frames.
    Eof,
    /// The socket failed.
    Io(io::Error),
    /// The bytes are not a valid frame.
    Frame(FrameError),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Eof => f.write_str("connection closed by peer"),
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Frame(e) => write!(f, "{e}"),
        }
    }
}

/// Reads one frame; `buf` is reused between calls to avoid an allocation per frame.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_body: u32,
    buf: &mut Vec<u8>,
) -> Result<Message, ReadError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    // Distinguish a clean close between frames from a truncated frame.
    let n = r.read(&mut h).await.map_err(ReadError::Io)?;
    if n == 0 {
        return Err(ReadError::Eof);
    }
    if n < FRAME_HEADER_LEN {
        r.read_exact(&mut h[n..]).await.map_err(eof_is_truncation)?;
    }
    let header = FrameHeader::decode(&h, max_body).map_err(ReadError::Frame)?;
    read_body(r, header.body_len as usize, buf).await?;
    Message::decode(buf).map_err(ReadError::Frame)
}

/// Reads exactly `len` body bytes into `buf`, growing it as they arrive (doubling, from
/// 64 KiB): a peer that only announces a large frame, before it has even authenticated,
/// costs memory for what it sent, not for what it claimed.
async fn read_body<R: AsyncRead + Unpin>(
    r: &mut R,
    len: usize,
    buf: &mut Vec<u8>,
) -> Result<(), ReadError> {
    const FIRST: usize = 64 << 10;
    buf.clear();
    while buf.len() < len {
        let start = buf.len();
        let end = start.saturating_add(start.max(FIRST)).min(len);
        buf.resize(end, 0);
        r.read_exact(&mut buf[start..end])
            .await
            .map_err(eof_is_truncation)?;
    }
    Ok(())
}

/// Reads one frame from a data connection. Waiting for a frame to start has no deadline (a
/// data connection may idle); once its first byte is in, the rest of the frame must follow
/// within `limit`, or the read fails with `TimedOut`.
pub(crate) async fn read_data_frame(
    r: &mut crate::net::ReadHalf,
    max_body: u32,
    buf: &mut Vec<u8>,
    limit: std::time::Duration,
) -> Result<Message, ReadError> {
    let mut h = [0u8; FRAME_HEADER_LEN];
    let n = r.read(&mut h[..1]).await.map_err(ReadError::Io)?;
    if n == 0 {
        return Err(ReadError::Eof);
    }
    r.set_stall_timeout(Some(limit)).map_err(ReadError::Io)?;
    let rest = async {
        r.read_exact(&mut h[1..]).await.map_err(eof_is_truncation)?;
        let header = FrameHeader::decode(&h, max_body).map_err(ReadError::Frame)?;
        read_body(r, header.body_len as usize, buf).await?;
        Message::decode(buf).map_err(ReadError::Frame)
    };
    let res = match tokio::time::timeout(limit, rest).await {
        Ok(Err(ReadError::Io(e))) if e.kind() == io::ErrorKind::WouldBlock => {
            Err(ReadError::Io(io::ErrorKind::TimedOut.into()))
        }
        Ok(r) => r,
        Err(_) => Err(ReadError::Io(io::ErrorKind::TimedOut.into())),
    };
    r.set_stall_timeout(None).map_err(ReadError::Io)?;
    res
}

fn eof_is_truncation(e: io::Error) -> ReadError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        ReadError::Frame(FrameError::Truncated)
    } else {
        ReadError::Io(e)
    }
}

/// Writes one message as a frame, and flushes it (a no-op on a socket; TLS may hold
/// records back until flushed).
pub(crate) async fn write_msg<W: AsyncWrite + Unpin>(w: &mut W, m: &Message) -> io::Result<()> {
    let bytes = m
        .to_frame()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    w.write_all(&bytes).await?;
    w.flush().await
}

/// Bytes handed to the kernel per `writev`. One call with a whole 128 MiB batch measured
/// 25% slower on loopback than a stream of 1 MiB writes: the kernel pushes segments out as
/// each call ends, so moderate calls keep the receiver busy.
fn write_chunk() -> usize {
    static CHUNK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CHUNK.get_or_init(|| {
        std::env::var("KVBRIDGE_WRITE_CHUNK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1 << 20)
    })
}

/// Writes every byte of `bufs`, in `writev` calls of about [`write_chunk`] bytes, then
/// flushes, and fails with `TimedOut` once `limit` has passed: a peer that stops reading must not hold
/// the writer (and the memory it sends from) forever. A blocking socket cannot be raced
/// against a timer: its owner bounds each call with `SO_SNDTIMEO`
/// ([`crate::net::WriteHalf::set_stall_timeout`]), and the clock is checked between calls.
pub(crate) async fn write_all_vectored(
    w: &mut WriteHalf,
    mut bufs: &mut [PeerRange<'_>],
    limit: std::time::Duration,
) -> io::Result<()> {
    let until = tokio::time::Instant::now() + limit;
    let chunk = write_chunk();
    peer_memory::advance(&mut bufs, 0);
    while !bufs.is_empty() {
        // Gather up to `chunk` bytes, cutting the last buffer if needed.
        let mut call: Vec<PeerRange<'_>> = Vec::with_capacity(64);
        let mut bytes = 0;
        for b in bufs.iter() {
            if bytes >= chunk || call.len() == IOV_MAX {
                break;
            }
            let take = b.len().min(chunk - bytes);
            call.push(b.prefix(take));
            bytes += take;
        }
        if tokio::time::Instant::now() >= until {
            return Err(io::ErrorKind::TimedOut.into());
        }
        let n = match tokio::time::timeout_at(until, w.write_ranges(&call)).await {
            Ok(Ok(n)) => n,
            // SO_SNDTIMEO expired on a blocking socket.
            Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::ErrorKind::TimedOut.into())
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(io::ErrorKind::TimedOut.into()),
        };
        drop(call);
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        peer_memory::advance(&mut bufs, n);
    }
    // TLS may hold the last records back until flushed (a no-op on a socket): without it
    // a batch's tail could wait for the next frame, and its acknowledgement with it.
    match tokio::time::timeout_at(until, w.flush()).await {
        Ok(r) => r,
        Err(_) => Err(io::ErrorKind::TimedOut.into()),
    }
}
