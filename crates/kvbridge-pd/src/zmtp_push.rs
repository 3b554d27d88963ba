//! One ZMTP 3.0 PUSH connection (NULL mechanism) that knows when its peer is gone.
//!
//! Why not the `zeromq` crate's `PushSocket`: a PUSH socket never reads, and that crate
//! drops the read half of its connections, so it learns that the peer went away only when a
//! write fails, one or two messages after the peer's death. Messages sent in between are
//! "sent" into a closed connection and lost. For the proxy's outcomes that was every
//! request's first outcomes after a proxy restart: the new proxy answered them 504
//! `kv_ready_timeout` at its deadline. Here the read half is kept: a PULL peer sends nothing
//! after its handshake, so the connection is readable only once the peer closed it (or
//! broke the protocol), and [`PushConn::send`] checks that before every message.
//!
//! Wire format (ZMTP 3.0, rfc.zeromq.org/spec/23): a 64-byte greeting each way, then a
//! `READY` command each way carrying `Socket-Type`, then message frames (flags, size, body).

use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Largest command or frame body this side reads from the peer during the handshake.
const MAX_HANDSHAKE_BODY: u64 = 4096;

/// A connected, handshaken PUSH connection.
#[derive(Debug)]
pub(crate) struct PushConn {
    stream: TcpStream,
}

/// Our 64-byte greeting: signature, version 3.0, mechanism `NULL`, as-server 0, filler.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A `READY` command announcing `Socket-Type: PUSH`.
fn ready_command() -> Vec<u8> {
    let mut body = Vec::new();
    body.push(5);
    body.extend_from_slice(b"READY");
    let (name, value) = (b"Socket-Type", b"PUSH");
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(&(value.len() as u32).to_be_bytes());
    body.extend_from_slice(value);
    frame(0x04, &body)
}

/// One frame: `flags` (0x04 for a command, 0 for the last frame of a message), the long-size
/// flag when the body needs it, the size, the body.
fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(body.len() + 9);
    if body.len() > 255 {
        f.push(flags | 0x02);
        f.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        f.push(flags);
        f.push(body.len() as u8);
    }
    f.extend_from_slice(body);
    f
}

fn bad(detail: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, detail.into())
}

impl PushConn {
    /// Connects to `addr` (`host:port`) and runs the handshake, all within `deadline`.
    /// Fails when the peer is not a ZMTP 3 peer with the NULL mechanism, or is not a PULL.
    pub(crate) async fn connect(addr: &str, deadline: Duration) -> std::io::Result<PushConn> {
        let run = async {
            let mut stream = TcpStream::connect(addr).await?;
            stream.set_nodelay(true)?;
            stream.write_all(&greeting()).await?;
            let mut theirs = [0u8; 64];
            stream.read_exact(&mut theirs).await?;
            if theirs[0] != 0xFF || theirs[9] != 0x7F {
                return Err(bad("the peer did not greet as ZMTP"));
            }
            if theirs[10] < 3 {
                return Err(bad(format!("the peer speaks ZMTP {}", theirs[10])));
            }
            if &theirs[12..17] != b"NULL\0" {
                return Err(bad("the peer wants a security mechanism other than NULL"));
            }
            stream.write_all(&ready_command()).await?;
            let (flags, body) = read_frame(&mut stream).await?;
            if flags & 0x04 == 0 || body.get(1..6) != Some(b"READY") {
                return Err(bad("the peer did not answer READY"));
            }
            if !socket_type_is(&body[6..], b"PULL") {
                return Err(bad("the peer is not a PULL socket"));
            }
            Ok(PushConn { stream })
        };
        tokio::time::timeout(deadline, run)
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    }

    /// Whether the peer closed the connection or sent something a PULL never sends (either
    /// way this connection is done). Never waits. Asks the socket itself (a peek that does
    /// not block) rather than the runtime's cached readiness, which lags the peer's close
    /// by as long as the reactor takes to run: a send in that gap went into the closed
    /// connection and was lost.
    pub(crate) fn peer_gone(&self) -> bool {
        let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        match socket2::SockRef::from(&self.stream).peek(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            // End of stream, an error, or bytes (a PULL has nothing to say after READY).
            _ => true,
        }
    }

    /// Sends one single-frame message, within `deadline`. Fails without writing when the
    /// peer is already gone ([`PushConn::peer_gone`]).
    pub(crate) async fn send(&mut self, body: &[u8], deadline: Duration) -> std::io::Result<()> {
        if self.peer_gone() {
            return Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        }
        tokio::time::timeout(deadline, self.stream.write_all(&frame(0, body)))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))?
    }
}

/// Reads one frame during the handshake: its flags and body (at most
/// [`MAX_HANDSHAKE_BODY`] bytes).
async fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let flags = s.read_u8().await?;
    let len = if flags & 0x02 != 0 {
        s.read_u64().await?
    } else {
        u64::from(s.read_u8().await?)
    };
    if len > MAX_HANDSHAKE_BODY {
        return Err(bad(format!("a handshake frame of {len} bytes")));
    }
    let mut body = vec![0u8; len as usize];
    s.read_exact(&mut body).await?;
    Ok((flags, body))
}

/// Whether the `READY` metadata `props` says `Socket-Type` is `want` (names compare
/// without case, as the spec says).
fn socket_type_is(mut props: &[u8], want: &[u8]) -> bool {
    while let Some((&n, rest)) = props.split_first() {
        let n = n as usize;
        if rest.len() < n + 4 {
            return false;
        }
        let (name, rest) = rest.split_at(n);
        let (vlen, rest) = rest.split_at(4);
        let v = u32::from_be_bytes([vlen[0], vlen[1], vlen[2], vlen[3]]) as usize;
        if rest.len() < v {
            return false;
        }
        let (value, rest) = rest.split_at(v);
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return value == want;
        }
        props = rest;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_pick_their_size_field() {
        assert_eq!(frame(0, b"ab"), [0, 2, b'a', b'b']);
        let long = frame(0, &[7; 300]);
        assert_eq!(long[0], 0x02);
        assert_eq!(&long[1..9], &300u64.to_be_bytes());
        assert_eq!(long.len(), 309);
    }

    #[test]
    fn ready_names_the_socket_type() {
        let r = ready_command();
        assert_eq!(r[0], 0x04);
        assert_eq!(r[1] as usize, r.len() - 2);
        assert_eq!(&r[3..8], b"READY");
        assert!(socket_type_is(&r[8..], b"PUSH"));
        assert!(!socket_type_is(&r[8..], b"PULL"));
        // Truncated or malformed metadata is not a match, and does not panic.
        for cut in 8..r.len() - 1 {
            assert!(!socket_type_is(&r[8..cut], b"PUSH"));
        }
        assert!(!socket_type_is(&[200, 1, 2], b"PUSH"));
    }

    /// Against the `zeromq` crate's PULL (what the proxy binds): short and long messages
    /// arrive whole. (That a closed peer is noticed before the next send is
    /// `tests/outcome_reconnect.rs`, whose proxies close their connections as a killed
    /// process does; dropping that crate's socket does not.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn talks_to_the_proxys_pull() {
        use zeromq::{Socket, SocketRecv};
        let t = Duration::from_secs(5);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut pull = zeromq::PullSocket::new();
        pull.bind_listener(listener).await.unwrap();
        let mut c = PushConn::connect(&addr.to_string(), t).await.unwrap();
        for body in [b"short".to_vec(), vec![9u8; 1000]] {
            c.send(&body, t).await.unwrap();
            let m = tokio::time::timeout(t, pull.recv()).await.unwrap().unwrap();
            let got: Vec<Vec<u8>> = m.into_vec().into_iter().map(|b| b.to_vec()).collect();
            assert_eq!(got, vec![body]);
        }
        assert!(!c.peer_gone());
    }

    /// A peer that is not ZMTP is refused within the deadline, with no panic.
    #[tokio::test]
    async fn refuses_a_peer_that_is_not_zmtp() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.write_all(&[b'H'; 64]).await;
            let _ = s.read(&mut [0u8; 64]).await;
        });
        let e = PushConn::connect(&addr.to_string(), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    }
}
