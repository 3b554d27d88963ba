//! The one place kvbridge touches the network.
//!
//! Everything above this module talks to [`Net`], [`Stream`], [`ReadHalf`] and [`WriteHalf`],
//! so the same driver code runs over real tokio sockets or, with the `sim` feature, over
//! turmoil's deterministic network simulator (random latency, held messages, partitions,
//! simulated time). Enum dispatch keeps the data path free of dynamic calls.

use crate::peer_memory::{self, PeerRange};
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A TLS stream over a real socket (either role).
pub type TlsStream = tokio_rustls::TlsStream<tokio::net::TcpStream>;

/// Which network to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Net {
    /// Real sockets.
    #[default]
    Tokio,
    /// turmoil's simulated network (tests only).
    #[cfg(feature = "sim")]
    Sim,
}

/// A listening socket.
pub enum Listener {
    /// Real socket.
    Tokio(tokio::net::TcpListener),
    /// Simulated socket.
    #[cfg(feature = "sim")]
    Sim(turmoil::net::TcpListener),
}

/// A connected stream, before it is split into halves.
#[derive(Debug)]
pub enum Stream {
    /// Real socket.
    Tokio(tokio::net::TcpStream),
    /// Real socket with TLS on it (control connections when TLS is on).
    Tls(Box<TlsStream>),
    /// Simulated socket.
    #[cfg(feature = "sim")]
    Sim(turmoil::net::TcpStream),
}

/// The read half of a [`Stream`].
#[derive(Debug)]
pub enum ReadHalf {
    /// Real socket.
    Tokio(tokio::net::tcp::OwnedReadHalf),
    /// Real socket in blocking mode, driven by a dedicated thread (see
    /// [`Stream::into_blocking_split`]).
    Blocking(std::net::TcpStream),
    /// TLS stream (the halves share the TLS session behind a lock).
    Tls(tokio::io::ReadHalf<TlsStream>),
    /// Simulated socket.
    #[cfg(feature = "sim")]
    Sim(turmoil::net::tcp::OwnedReadHalf),
}

/// The write half of a [`Stream`].
#[derive(Debug)]
pub enum WriteHalf {
    /// Real socket.
    Tokio(tokio::net::tcp::OwnedWriteHalf),
    /// Real socket in blocking mode, driven by a dedicated thread.
    Blocking(std::net::TcpStream),
    /// TLS stream.
    Tls(tokio::io::WriteHalf<TlsStream>),
    /// Simulated socket.
    #[cfg(feature = "sim")]
    Sim(turmoil::net::tcp::OwnedWriteHalf),
}

impl Net {
    /// Binds a listener. `addr` is `host:port`; use port 0 and [`Listener::local_addr`] to
    /// learn the port.
    pub async fn bind(self, addr: &str) -> io::Result<Listener> {
        match self {
            Net::Tokio => Ok(Listener::Tokio(tokio::net::TcpListener::bind(addr).await?)),
            #[cfg(feature = "sim")]
            Net::Sim => Ok(Listener::Sim(
                turmoil::net::TcpListener::bind(addr.to_string()).await?,
            )),
        }
    }

    /// Connects to `addr` (`host:port`) with TCP_NODELAY set: every control message and
    /// completion is latency-bound.
    pub async fn connect(self, addr: &str) -> io::Result<Stream> {
        match self {
            Net::Tokio => {
                let s = tokio::net::TcpStream::connect(addr).await?;
                s.set_nodelay(true)?;
                Ok(Stream::Tokio(s))
            }
            #[cfg(feature = "sim")]
            Net::Sim => Ok(Stream::Sim(
                turmoil::net::TcpStream::connect(addr.to_string()).await?,
            )),
        }
    }
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Listener({:?})", self.local_addr().ok())
    }
}

impl Listener {
    /// Accepts one connection, with TCP_NODELAY set.
    pub async fn accept(&self) -> io::Result<(Stream, SocketAddr)> {
        match self {
            Listener::Tokio(l) => {
                let (s, a) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok((Stream::Tokio(s), a))
            }
            #[cfg(feature = "sim")]
            Listener::Sim(l) => {
                let (s, a) = l.accept().await?;
                Ok((Stream::Sim(s), a))
            }
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Listener::Tokio(l) => l.local_addr(),
            #[cfg(feature = "sim")]
            Listener::Sim(l) => l.local_addr(),
        }
    }
}

impl Stream {
    /// For a bulk data connection on a real socket: switches it to blocking mode and returns
    /// its halves plus a handle that can shut it down from outside. A thread blocked in the
    /// kernel moves bulk bytes with fewer system calls and wake-ups than readiness polling
    /// (measured: `kvbridge bench transfer`). `None` for simulated sockets and TLS streams.
    pub fn into_blocking_split(
        self,
    ) -> io::Result<Option<(ReadHalf, WriteHalf, std::net::TcpStream)>> {
        match self {
            Stream::Tokio(s) => {
                let s = s.into_std()?;
                s.set_nonblocking(false)?;
                let r = s.try_clone()?;
                let stop = s.try_clone()?;
                Ok(Some((ReadHalf::Blocking(r), WriteHalf::Blocking(s), stop)))
            }
            Stream::Tls(_) => Ok(None),
            #[cfg(feature = "sim")]
            Stream::Sim(_) => Ok(None),
        }
    }

    /// Splits into independently owned halves (no lock between them).
    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Stream::Tokio(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Tokio(r), WriteHalf::Tokio(w))
            }
            Stream::Tls(s) => {
                let (r, w) = tokio::io::split(*s);
                (ReadHalf::Tls(r), WriteHalf::Tls(w))
            }
            #[cfg(feature = "sim")]
            Stream::Sim(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Sim(r), WriteHalf::Sim(w))
            }
        }
    }
}

impl WriteHalf {
    /// Writes some of `bufs` (one `writev` on a real socket) and returns how many bytes
    /// went. Streams that write only from a `&[u8]` (TLS, simulated) send a copy
    /// ([`crate::peer_memory`] says why).
    pub async fn write_ranges(&mut self, bufs: &[PeerRange<'_>]) -> io::Result<usize> {
        use std::os::fd::AsRawFd;
        /// The most bytes copied per write where a copy is needed: about what a TLS stream
        /// takes in one write, so no byte is copied twice.
        const BOUNCE: usize = 64 << 10;
        match self {
            WriteHalf::Blocking(w) => peer_memory::writev(w.as_raw_fd(), bufs),
            WriteHalf::Tokio(w) => {
                let s: &tokio::net::TcpStream = w.as_ref();
                let fd = s.as_raw_fd();
                loop {
                    match s.try_io(tokio::io::Interest::WRITABLE, || {
                        peer_memory::writev(fd, bufs)
                    }) {
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => s.writable().await?,
                        r => return r,
                    }
                }
            }
            WriteHalf::Tls(w) => {
                use tokio::io::AsyncWriteExt;
                w.write(&peer_memory::gather(bufs, BOUNCE)).await
            }
            #[cfg(feature = "sim")]
            WriteHalf::Sim(w) => {
                use tokio::io::AsyncWriteExt;
                w.write(&peer_memory::gather(bufs, BOUNCE)).await
            }
        }
    }

    /// Bounds each blocking system call on this half (`SO_SNDTIMEO`): a peer that stops
    /// reading cannot block the writing thread past `limit`. A no-op for non-blocking
    /// halves, which callers bound with timers.
    pub fn set_stall_timeout(&self, limit: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            WriteHalf::Blocking(w) => w.set_write_timeout(limit),
            _ => Ok(()),
        }
    }
}

impl ReadHalf {
    /// Bounds each blocking system call on this half (`SO_RCVTIMEO`); `None` removes the
    /// bound. A no-op for non-blocking halves, which callers bound with timers.
    pub fn set_stall_timeout(&self, limit: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            ReadHalf::Blocking(r) => r.set_read_timeout(limit),
            _ => Ok(()),
        }
    }

    /// [`ReadHalf::read_exact_vectored`] that fails with `TimedOut` once `limit` has passed:
    /// a peer that announces a payload and then stalls must not hold the destination memory
    /// (and this task) forever.
    pub async fn read_exact_vectored_within(
        &mut self,
        bufs: &mut [PeerRange<'_>],
        limit: std::time::Duration,
    ) -> io::Result<()> {
        match self {
            ReadHalf::Blocking(r) => {
                // A blocking socket cannot be raced against a timer: bound each system call
                // with SO_RCVTIMEO and the whole read by checking the clock between calls.
                let start = std::time::Instant::now();
                let total: usize = bufs.iter().map(|b| b.len()).sum();
                r.set_read_timeout(Some(limit))?;
                let lowat = payload_lowat(r, total);
                let res = Self::blocking_read_exact(r, bufs, Some((start, limit)), lowat);
                r.set_read_timeout(None)?;
                res
            }
            _ => match tokio::time::timeout(limit, self.read_exact_vectored(bufs)).await {
                Ok(r) => r,
                Err(_) => Err(io::ErrorKind::TimedOut.into()),
            },
        }
    }

    /// Fills `bufs` from a blocking socket. With a `deadline` (start, limit) the whole read
    /// is bounded by checking the clock between calls (the caller has set `SO_RCVTIMEO`).
    ///
    /// With `lowat` > 1 the kernel is asked to wake this thread only once `lowat` bytes are
    /// queued (`SO_RCVLOWAT`, lowered to what is left near the end): a few wake-ups and
    /// `readv` calls per MiB instead of one per 64 KiB segment. On loopback one connection
    /// moved 256 KiB-4 MiB blocks 1.6-1.8x faster with it (docs/architecture.md). Should
    /// the kernel ever not wake us although the bytes are on their way (a receive window
    /// smaller than `lowat`), a call that waits [`LOWAT_PATIENCE`] drops back to waking on
    /// every byte; the read's deadline is unchanged.
    fn blocking_read_exact(
        r: &mut std::net::TcpStream,
        bufs: &mut [PeerRange<'_>],
        deadline: Option<(std::time::Instant, std::time::Duration)>,
        lowat: usize,
    ) -> io::Result<()> {
        Self::blocking_read_exact_patient(r, bufs, deadline, lowat, LOWAT_PATIENCE)
    }

    /// [`ReadHalf::blocking_read_exact`] that waits `patience` for the low-water mark.
    fn blocking_read_exact_patient(
        r: &mut std::net::TcpStream,
        mut bufs: &mut [PeerRange<'_>],
        deadline: Option<(std::time::Instant, std::time::Duration)>,
        mut lowat: usize,
        patience: std::time::Duration,
    ) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let wait = deadline.map_or(patience, |(_, limit)| limit.min(patience));
        if lowat > 1 {
            set_rcvlowat(r, lowat);
            r.set_read_timeout(Some(wait))?;
        }
        peer_memory::advance(&mut bufs, 0);
        let res = loop {
            if bufs.is_empty() {
                break Ok(());
            }
            if lowat > 1 {
                let left: usize = bufs.iter().map(|b| b.len()).sum();
                if left < lowat {
                    lowat = left.max(1);
                    set_rcvlowat(r, lowat);
                }
            }
            if let Some((start, limit)) = deadline {
                if start.elapsed() > limit {
                    break Err(io::ErrorKind::TimedOut.into());
                }
            }
            // With the low-water mark raised, wait in poll and read only once it is met: a
            // readv blocked in the kernel after copying part of it sleeps until its timeout
            // (`lowat_wait` says why).
            let read = match lowat > 1 {
                true => match lowat_wait(r, wait) {
                    Ok(true) => peer_memory::readv(r.as_raw_fd(), bufs),
                    Ok(false) => Err(io::ErrorKind::WouldBlock.into()),
                    Err(e) => Err(e),
                },
                false => peer_memory::readv(r.as_raw_fd(), bufs),
            };
            match read {
                Ok(0) => break Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => peer_memory::advance(&mut bufs, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && lowat > 1 => {
                    tracing::debug!(lowat, "no wake-up with SO_RCVLOWAT; reading as bytes come");
                    lowat = 1;
                    set_rcvlowat(r, 1);
                    let rest = deadline.map(|(start, limit)| limit.saturating_sub(start.elapsed()));
                    if rest.is_some_and(|d| d.is_zero()) {
                        break Err(io::ErrorKind::TimedOut.into());
                    }
                    r.set_read_timeout(rest)?;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    break Err(io::ErrorKind::TimedOut.into())
                }
                Err(e) => break Err(e),
            }
        };
        if lowat > 1 {
            set_rcvlowat(r, 1);
        }
        res
    }

    /// Fills every buffer completely, with as few `readv` calls as the kernel allows: a
    /// batch of small pages lands with a handful of system calls instead of one per page.
    /// Streams that need a `&mut [u8]` (TLS, simulated) read through a bounce buffer
    /// ([`crate::peer_memory`] says why).
    pub async fn read_exact_vectored(&mut self, mut bufs: &mut [PeerRange<'_>]) -> io::Result<()> {
        peer_memory::advance(&mut bufs, 0);
        match self {
            ReadHalf::Blocking(r) => Self::blocking_read_exact(r, bufs, None, 1),
            ReadHalf::Tokio(r) => {
                use std::os::fd::AsRawFd;
                let s: &tokio::net::TcpStream = r.as_ref();
                while !bufs.is_empty() {
                    let fd = s.as_raw_fd();
                    let batch = &*bufs;
                    match s.try_io(tokio::io::Interest::READABLE, || {
                        peer_memory::readv(fd, batch)
                    }) {
                        Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                        Ok(n) => peer_memory::advance(&mut bufs, n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => s.readable().await?,
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
            ReadHalf::Tls(r) => read_through_bounce(r, bufs).await,
            #[cfg(feature = "sim")]
            ReadHalf::Sim(r) => read_through_bounce(r, bufs).await,
        }
    }
}

/// Fills `bufs` from a stream that reads only into a `&mut [u8]`: through an owned buffer
/// and a copy, so no reference is ever formed over registered memory.
async fn read_through_bounce<R: AsyncRead + Unpin>(
    r: &mut R,
    bufs: &[PeerRange<'_>],
) -> io::Result<()> {
    use tokio::io::AsyncReadExt;
    /// The bounce buffer's size: big enough for a TLS record or a few.
    const BOUNCE: usize = 64 << 10;
    let total: usize = bufs.iter().map(PeerRange::len).sum();
    let mut tmp = vec![0u8; total.min(BOUNCE)];
    for b in bufs {
        let mut off = 0;
        while off < b.len() {
            let n = (b.len() - off).min(tmp.len());
            r.read_exact(&mut tmp[..n]).await?;
            b.copy_from(off, &tmp[..n]);
            off += n;
        }
    }
    Ok(())
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Tokio(r) => Pin::new(r).poll_read(cx, buf),
            ReadHalf::Blocking(r) => {
                use std::io::Read;
                // Blocks this (dedicated) thread, by design.
                let n = r.read(buf.initialize_unfilled())?;
                buf.advance(n);
                Poll::Ready(Ok(()))
            }
            ReadHalf::Tls(r) => Pin::new(r).poll_read(cx, buf),
            #[cfg(feature = "sim")]
            ReadHalf::Sim(r) => Pin::new(r).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tokio(w) => Pin::new(w).poll_write(cx, buf),
            WriteHalf::Blocking(w) => Poll::Ready(std::io::Write::write(w, buf)),
            WriteHalf::Tls(w) => Pin::new(w).poll_write(cx, buf),
            #[cfg(feature = "sim")]
            WriteHalf::Sim(w) => Pin::new(w).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tokio(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            WriteHalf::Blocking(w) => Poll::Ready(std::io::Write::write_vectored(w, bufs)),
            WriteHalf::Tls(w) => Pin::new(w).poll_write_vectored(cx, bufs),
            #[cfg(feature = "sim")]
            WriteHalf::Sim(w) => Pin::new(w).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            WriteHalf::Tokio(w) => w.is_write_vectored(),
            WriteHalf::Blocking(_) => true,
            WriteHalf::Tls(w) => w.is_write_vectored(),
            #[cfg(feature = "sim")]
            WriteHalf::Sim(w) => w.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tokio(w) => Pin::new(w).poll_flush(cx),
            WriteHalf::Blocking(_) => Poll::Ready(Ok(())),
            WriteHalf::Tls(w) => Pin::new(w).poll_flush(cx),
            #[cfg(feature = "sim")]
            WriteHalf::Sim(w) => Pin::new(w).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tokio(w) => Pin::new(w).poll_shutdown(cx),
            WriteHalf::Blocking(w) => Poll::Ready(w.shutdown(std::net::Shutdown::Write)),
            WriteHalf::Tls(w) => Pin::new(w).poll_shutdown(cx),
            #[cfg(feature = "sim")]
            WriteHalf::Sim(w) => Pin::new(w).poll_shutdown(cx),
        }
    }
}

/// A whole stream reads and writes too (the first frame of an accepted connection, a
/// refusal, a `DataHello`), before it is split.
impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tokio(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            #[cfg(feature = "sim")]
            Stream::Sim(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tokio(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            #[cfg(feature = "sim")]
            Stream::Sim(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tokio(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            #[cfg(feature = "sim")]
            Stream::Sim(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tokio(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            #[cfg(feature = "sim")]
            Stream::Sim(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// How long a payload read waits with `SO_RCVLOWAT` raised before it wakes on every byte.
const LOWAT_PATIENCE: std::time::Duration = std::time::Duration::from_millis(50);

/// The `SO_RCVLOWAT` for a blocking payload read of `total` bytes: at most
/// `KVBRIDGE_RCVLOWAT` (default 1 MiB; 1 turns it off), at most `total`, and at most a
/// quarter of the socket's receive buffer. Above that the kernel grows the buffer and clamps
/// the receive window to the low-water mark, and a window that never reaches it would leave
/// the reader waiting for bytes the sender may not send. 1: not worth a system call.
fn payload_lowat(r: &std::net::TcpStream, total: usize) -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let max = *MAX.get_or_init(|| {
        std::env::var("KVBRIDGE_RCVLOWAT")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1 << 20)
    });
    /// Below this a read is a couple of segments: gathering saves nothing.
    const WORTH_IT: usize = 128 << 10;
    if max <= 1 || total < WORTH_IT {
        return 1;
    }
    let rcvbuf = recv_buffer(r);
    let v = max.min(total).min(rcvbuf / 4);
    if v < WORTH_IT {
        1
    } else {
        v
    }
}

fn set_rcvlowat(r: &std::net::TcpStream, v: usize) {
    use std::os::fd::AsRawFd;
    let v = v.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: a valid socket, and a c_int option of its size. A failure leaves the
    // default (wake on every byte), which is only slower.
    unsafe {
        libc::setsockopt(
            r.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Waits until `SO_RCVLOWAT` bytes are queued on `r` (or it is closed or failed), at most
/// `wait`; `Ok(false)` when `wait` passed first.
///
/// Why not a blocking `readv` with the mark raised: `tcp_recvmsg` copies what is queued as
/// it comes and sleeps until it has copied the mark, but the kernel wakes a sleeping reader
/// only when the bytes queued *since its last copy* reach the mark (`tcp_data_ready`). A
/// call that copied part of a megabyte and sleeps for the rest is woken by its timeout, not
/// by the rest arriving: 50 ms stalls on one read in 10-30 of 256 KiB objects over loopback.
/// `poll` asks the kernel the question its wake-up answers (queued bytes against the mark),
/// and the `readv` after it copies them without sleeping.
fn lowat_wait(r: &std::net::TcpStream, wait: std::time::Duration) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: r.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = wait.as_millis().clamp(1, libc::c_int::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd, the count given.
    let n = unsafe { libc::poll(&mut p, 1, ms) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n > 0)
}

/// The socket's receive buffer (`SO_RCVBUF`), 0 if unknown.
fn recv_buffer(r: &std::net::TcpStream) -> usize {
    int_sockopt(r, libc::SO_RCVBUF).map_or(0, |v| v.max(0) as usize)
}

/// A `SOL_SOCKET` option of type `int`.
fn int_sockopt(r: &std::net::TcpStream, opt: libc::c_int) -> Option<libc::c_int> {
    use std::os::fd::AsRawFd;
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid socket, and a c_int buffer of the length given.
    let rc = unsafe {
        libc::getsockopt(
            r.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::{Duration, Instant};

    /// A connected loopback pair: (the reader's blocking stream, the writer's).
    fn pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let w = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (r, _) = l.accept().unwrap();
        (r, w)
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 131 + 7) as u8).collect()
    }

    /// Bytes that come in two bursts with a pause longer than the patience, the first
    /// smaller than the low-water mark: the read drops back to waking on every byte and
    /// gets them all, in order, well within its deadline (it does not wait for bytes that
    /// are not coming, nor fail).
    #[test]
    fn a_gathered_read_gets_bytes_that_trickle_in_below_the_mark() {
        let (mut r, mut w) = pair();
        let data = pattern(600 << 10);
        let sent = data.clone();
        let t = std::thread::spawn(move || {
            w.write_all(&sent[..100 << 10]).unwrap();
            std::thread::sleep(LOWAT_PATIENCE * 4);
            w.write_all(&sent[100 << 10..]).unwrap();
            w
        });
        let mut got = vec![0u8; data.len()];
        let start = Instant::now();
        let limit = Duration::from_secs(20);
        let mut iov = [PeerRange::owned(&mut got)];
        ReadHalf::blocking_read_exact(&mut r, &mut iov, Some((start, limit)), 512 << 10).unwrap();
        assert!(got == data, "bytes differ");
        assert!(start.elapsed() < Duration::from_secs(10));
        drop(t.join().unwrap());
        // The socket is back to waking on every byte for the next frame.
        assert_eq!(int_sockopt(&r, libc::SO_RCVLOWAT), Some(1));
    }

    /// Row 24's failure, as the reader sees it: the bytes queued stop short of the mark
    /// and more come only once the reader has acted (as with a receive window clamped
    /// below the mark, where the sender sends no more until the reader takes what is
    /// queued). The writer here sends more only once the reader has dropped its mark to 1
    /// (watched from a clone of the socket), so the read completes only through that
    /// fallback; without it the writer waits 5 s and the read misses its bound. The mark
    /// starts at 2, a value the read never sets, so 1 can only mean the fallback, however
    /// late the watcher looks. (This kernel no longer stalls a blocking read behind a
    /// clamped window by itself: it wakes the reader when the window is used up, so the
    /// clamp is played by the writer.)
    #[test]
    fn a_gathered_read_short_of_the_mark_drops_it_before_more_bytes_come() {
        let (mut r, mut w) = pair();
        set_rcvlowat(&r, 2);
        let watch = r.try_clone().unwrap();
        let data = pattern(600 << 10);
        let sent = data.clone();
        let t = std::thread::spawn(move || {
            w.write_all(&sent[..100 << 10]).unwrap();
            let until = Instant::now() + Duration::from_secs(5);
            while Instant::now() < until && int_sockopt(&watch, libc::SO_RCVLOWAT) != Some(1) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let fell_back = Instant::now() < until;
            w.write_all(&sent[100 << 10..]).unwrap();
            (w, fell_back)
        });
        let mut got = vec![0u8; data.len()];
        let start = Instant::now();
        let mut iov = [PeerRange::owned(&mut got)];
        ReadHalf::blocking_read_exact(
            &mut r,
            &mut iov,
            Some((start, Duration::from_secs(20))),
            512 << 10,
        )
        .unwrap();
        let took = start.elapsed();
        let (w, fell_back) = t.join().unwrap();
        assert!(
            fell_back,
            "the mark stayed up while the bytes were short of it"
        );
        assert!(got == data, "bytes differ");
        assert!(took < Duration::from_secs(3), "took {took:?}");
        drop(w);
    }

    /// The bytes that complete the mark wake the read at once, also when it took the first
    /// part before it slept: the kernel wakes a reader blocked in `recv` only when the bytes
    /// queued since its last copy reach the mark, so such a read slept until its timeout
    /// (`lowat_wait`). The patience here is 10 s, so a read woken only by its timeout misses
    /// the 5 s bound by far.
    #[test]
    fn the_bytes_that_complete_the_mark_wake_the_read() {
        let (mut r, mut w) = pair();
        // A mark of a quarter of the receive buffer, as `payload_lowat` sets it at most.
        let mark = recv_buffer(&r) / 4;
        let data = pattern(mark);
        // Queued before the read starts, so that a `recv` would take it at once.
        w.write_all(&data[..mark / 3]).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            // SAFETY: no arguments; the calling thread's id.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let mut got = vec![0u8; mark];
            let start = Instant::now();
            let mut iov = [PeerRange::owned(&mut got)];
            ReadHalf::blocking_read_exact_patient(
                &mut r,
                &mut iov,
                Some((start, Duration::from_secs(20))),
                mark,
                Duration::from_secs(10),
            )
            .unwrap();
            (got, Instant::now())
        });
        let tid = rx.recv().unwrap();
        // Until the reader sleeps in the kernel (its state `S`), waiting for the rest.
        let stat = format!("/proc/self/task/{tid}/stat");
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let s = std::fs::read_to_string(&stat).unwrap_or_default();
            let state = s.rsplit_once(") ").map(|(_, rest)| rest.as_bytes()[0]);
            if state == Some(b'S') {
                break;
            }
            assert!(Instant::now() < until, "the reader never slept: {s}");
            std::thread::yield_now();
        }
        w.write_all(&data[mark / 3..]).unwrap();
        let sent = Instant::now();
        let (got, done) = reader.join().unwrap();
        assert!(got == data, "bytes differ");
        let late = done.saturating_duration_since(sent);
        assert!(
            late < Duration::from_secs(5),
            "woke {late:?} after the rest came"
        );
    }

    /// A payload that stops short still fails at its deadline, with `TimedOut`.
    #[test]
    fn a_gathered_read_of_bytes_that_never_come_times_out() {
        let (mut r, mut w) = pair();
        w.write_all(&pattern(64 << 10)).unwrap();
        let mut got = vec![0u8; 512 << 10];
        let start = Instant::now();
        let mut iov = [PeerRange::owned(&mut got)];
        let e = ReadHalf::blocking_read_exact(
            &mut r,
            &mut iov,
            Some((start, Duration::from_millis(300))),
            256 << 10,
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(start.elapsed() < Duration::from_secs(5));
        drop(w);
    }

    /// Small reads and small sockets are not worth a system call.
    #[test]
    fn the_mark_is_capped_by_the_read_and_the_receive_buffer() {
        let (r, _w) = pair();
        assert_eq!(payload_lowat(&r, 4 << 10), 1);
        let buf = recv_buffer(&r);
        assert!(buf > 0);
        let v = payload_lowat(&r, 64 << 20);
        assert!(
            v == 1 || (v <= buf / 4 && v <= 1 << 20),
            "{v} with a buffer of {buf}"
        );
    }
}
