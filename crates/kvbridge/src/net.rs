//! The one place kvbridge touches the network.
//!
//! Everything above this module talks to [`Net`], [`Stream`], [`ReadHalf`] and [`WriteHalf`],
//! so the same driver code runs over real tokio sockets or, with the `sim` feature, over
//! turmoil's deterministic network simulator (random latency, held messages, partitions,
//! simulated time). Enum dispatch keeps the data path free of dynamic calls.

use std::io::{self, IoSlice, IoSliceMut};
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
        bufs: &mut [IoSliceMut<'_>],
        limit: std::time::Duration,
    ) -> io::Result<()> {
        match self {
            ReadHalf::Blocking(r) => {
                // A blocking socket cannot be raced against a timer: bound each system call
                // with SO_RCVTIMEO and the whole read by checking the clock between calls.
                let start = std::time::Instant::now();
                r.set_read_timeout(Some(limit))?;
                let res = Self::blocking_read_exact(r, bufs, Some((start, limit)));
                r.set_read_timeout(None)?;
                res
            }
            _ => match tokio::time::timeout(limit, self.read_exact_vectored(bufs)).await {
                Ok(r) => r,
                Err(_) => Err(io::ErrorKind::TimedOut.into()),
            },
        }
    }

    fn blocking_read_exact(
        r: &mut std::net::TcpStream,
        mut bufs: &mut [IoSliceMut<'_>],
        deadline: Option<(std::time::Instant, std::time::Duration)>,
    ) -> io::Result<()> {
        use std::io::Read;
        /// Linux refuses `readv` with more than this many buffers.
        const IOV_MAX: usize = 1024;
        IoSliceMut::advance_slices(&mut bufs, 0);
        while !bufs.is_empty() {
            if let Some((start, limit)) = deadline {
                if start.elapsed() > limit {
                    return Err(io::ErrorKind::TimedOut.into());
                }
            }
            let end = bufs.len().min(IOV_MAX);
            match r.read_vectored(&mut bufs[..end]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Err(io::ErrorKind::TimedOut.into())
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Fills every buffer completely, with as few `readv` calls as the kernel allows: a
    /// batch of small pages lands with a handful of system calls instead of one per page.
    pub async fn read_exact_vectored(&mut self, mut bufs: &mut [IoSliceMut<'_>]) -> io::Result<()> {
        /// Linux refuses `readv` with more than this many buffers.
        const IOV_MAX: usize = 1024;
        IoSliceMut::advance_slices(&mut bufs, 0);
        match self {
            ReadHalf::Blocking(r) => Self::blocking_read_exact(r, bufs, None),
            ReadHalf::Tokio(r) => {
                while !bufs.is_empty() {
                    let end = bufs.len().min(IOV_MAX);
                    match r.try_read_vectored(&mut bufs[..end]) {
                        Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                        Ok(n) => IoSliceMut::advance_slices(&mut bufs, n),
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => r.readable().await?,
                        Err(e) => return Err(e),
                    }
                }
                Ok(())
            }
            ReadHalf::Tls(r) => {
                use tokio::io::AsyncReadExt;
                for b in bufs.iter_mut() {
                    r.read_exact(b).await?;
                }
                Ok(())
            }
            #[cfg(feature = "sim")]
            ReadHalf::Sim(r) => {
                use tokio::io::AsyncReadExt;
                for b in bufs.iter_mut() {
                    r.read_exact(b).await?;
                }
                Ok(())
            }
        }
    }
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
