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
//! The framing (greeting, `READY`, frames, with size limits) is `kvbridge_proto::zmtp`,
//! shared with the proxy's PULL side.

use kvbridge_proto::zmtp::{
    check_greeting, frame, greeting, parse_frame_header, ready_command, ready_properties,
    socket_type_is, FLAG_COMMAND, GREETING_LEN, MAX_COMMAND_BODY,
};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A connected, handshaken PUSH connection.
#[derive(Debug)]
pub(crate) struct PushConn {
    stream: TcpStream,
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
            let mut theirs = [0u8; GREETING_LEN];
            stream.read_exact(&mut theirs).await?;
            check_greeting(&theirs).map_err(|e| bad(e.to_string()))?;
            stream.write_all(&ready_command("PUSH")).await?;
            let (flags, body) = read_frame(&mut stream).await?;
            let props = ready_properties(&body)
                .ok()
                .filter(|_| flags & FLAG_COMMAND != 0)
                .ok_or_else(|| bad("the peer did not answer READY"))?;
            if !socket_type_is(props, b"PULL") {
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
/// [`MAX_COMMAND_BODY`] bytes, checked before the body is read).
async fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let mut hdr = [0u8; 9];
    s.read_exact(&mut hdr[..2]).await?;
    let mut have = 2;
    let h = loop {
        match parse_frame_header(&hdr[..have], MAX_COMMAND_BODY as u64) {
            Ok(Some(h)) => break h,
            Ok(None) => {
                s.read_exact(&mut hdr[have..9]).await?;
                have = 9;
            }
            Err(e) => return Err(bad(e.to_string())),
        }
    };
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).await?;
    Ok((h.flags, body))
}

#[cfg(test)]
mod tests {
    use super::*;

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
