//! The PUB side of vLLM's KV-events stream, for the reference engine: subscribers connect,
//! and every batch goes to each one subscribed to a prefix of the topic, as
//! `[topic, 8-byte big-endian sequence, msgpack KVEventBatch]` (vLLM's `ZmqEventPublisher`).
//!
//! As a ZMQ PUB: a subscriber that does not keep up loses batches (each has a queue of
//! [`PubLimits::hwm`] batches; what does not fit is dropped and counted), which it sees as
//! a gap in the sequence; nothing waits on a subscriber. Bounded like the rest of our ZMTP:
//! at most [`PubLimits::max_subscribers`] connections, handshakes within
//! [`PubLimits::handshake_timeout`], a write within [`PubLimits::write_timeout`] (else the
//! subscriber is dropped), subscription frames of at most 1 KiB, at most 64 subscriptions.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvbridge::proto::kv_events::{encode_batch, KvEventBatch};
use kvbridge::proto::zmtp::{frame, PullEvent, PullLimits, PullSession, FLAG_MORE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Bounds of the publisher.
#[derive(Debug, Clone, Copy)]
pub struct PubLimits {
    /// Batches queued per subscriber before batches are dropped for it.
    pub hwm: usize,
    /// Most subscriber connections.
    pub max_subscribers: usize,
    /// Greetings and `READY` within this.
    pub handshake_timeout: Duration,
    /// One batch written within this.
    pub write_timeout: Duration,
}

impl Default for PubLimits {
    fn default() -> Self {
        PubLimits {
            hwm: 10_000,
            max_subscribers: 16,
            handshake_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
        }
    }
}

const MAX_SUBSCRIPTIONS: usize = 64;

/// A subscriber's queue of encoded messages.
type Queue = mpsc::Sender<Arc<Vec<u8>>>;

struct Inner {
    topic: Vec<u8>,
    /// The next sequence number and the subscribers' queues: one lock, so batches enter
    /// every queue in sequence order.
    state: Mutex<(u64, Vec<Queue>)>,
    dropped: AtomicU64,
    /// Connections that have subscribed at least once.
    subscribed: watch::Sender<usize>,
    limits: PubLimits,
}

/// A bound publisher; dropping it closes the port and every subscriber connection.
pub struct KvEventsPublisher {
    inner: Arc<Inner>,
    addr: std::net::SocketAddr,
    accept: JoinHandle<()>,
}

impl Drop for KvEventsPublisher {
    fn drop(&mut self) {
        self.accept.abort();
        // Closing the queues ends the connection tasks.
        self.inner
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clear();
    }
}

impl KvEventsPublisher {
    /// Binds `addr` (`host:port`, or `tcp://host:port`; `*` as host binds every address)
    /// and publishes on `topic`.
    pub async fn bind(addr: &str, topic: &str, limits: PubLimits) -> std::io::Result<Self> {
        let addr = addr.strip_prefix("tcp://").unwrap_or(addr);
        let addr = match addr.strip_prefix("*:") {
            Some(port) => format!("0.0.0.0:{port}"),
            None => addr.to_string(),
        };
        let listener = TcpListener::bind(&addr).await?;
        let local = listener.local_addr()?;
        let inner = Arc::new(Inner {
            topic: topic.as_bytes().to_vec(),
            state: Mutex::new((0, Vec::new())),
            dropped: AtomicU64::new(0),
            subscribed: watch::channel(0).0,
            limits,
        });
        let accept = tokio::spawn(accept_loop(listener, inner.clone()));
        Ok(KvEventsPublisher {
            inner,
            addr: local,
            accept,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// Publishes one batch (never waits): it takes the next sequence number whether or not
    /// anyone listens, as vLLM's publisher does.
    pub fn publish(&self, batch: &KvEventBatch) {
        let payload = encode_batch(batch);
        let mut st = self.inner.state.lock().unwrap_or_else(|p| p.into_inner());
        let seq = st.0;
        st.0 += 1;
        let mut wire = frame(FLAG_MORE, &self.inner.topic);
        wire.extend_from_slice(&frame(FLAG_MORE, &seq.to_be_bytes()));
        wire.extend_from_slice(&frame(0, &payload));
        let wire = Arc::new(wire);
        st.1.retain(|q| match q.try_send(wire.clone()) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.inner.dropped.fetch_add(1, Relaxed);
                true
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        });
    }

    /// Skips `n` sequence numbers, as if `n` batches had been lost on the way (tests).
    #[doc(hidden)]
    pub fn skip_sequence(&self, n: u64) {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner()).0 += n;
    }

    /// Batches dropped for subscribers that did not keep up.
    pub fn dropped(&self) -> u64 {
        self.inner.dropped.load(Relaxed)
    }

    /// Waits until `n` connections have subscribed, up to `timeout`; false when they did not.
    pub async fn wait_subscribed(&self, n: usize, timeout: Duration) -> bool {
        let mut rx = self.inner.subscribed.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|&k| k >= n))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

async fn accept_loop(listener: TcpListener, inner: Arc<Inner>) {
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            continue;
        };
        let rx = {
            let mut st = inner.state.lock().unwrap_or_else(|p| p.into_inner());
            st.1.retain(|q| !q.is_closed());
            if st.1.len() >= inner.limits.max_subscribers {
                tracing::warn!(%peer, "KV events: subscriber refused, at the limit");
                continue;
            }
            let (tx, rx) = mpsc::channel(inner.limits.hwm.max(1));
            st.1.push(tx);
            rx
        };
        let inner = inner.clone();
        tokio::spawn(async move {
            if let Err(e) = serve(stream, rx, &inner).await {
                tracing::debug!(%peer, "KV events subscriber gone: {e}");
            }
        });
    }
}

async fn serve(
    mut stream: TcpStream,
    mut rx: mpsc::Receiver<Arc<Vec<u8>>>,
    inner: &Inner,
) -> std::io::Result<()> {
    let bad = |e: kvbridge::proto::zmtp::ZmtpError| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
    };
    stream.set_nodelay(true)?;
    let mut session = PullSession::with_socket_types(
        PullLimits {
            max_frame: 1024,
            max_frames: 1,
        },
        "PUB",
        b"SUB",
    );
    let mut buf = vec![0u8; 4096];
    let mut subs: Vec<Vec<u8>> = Vec::new();
    let mut counted = false;
    // What arrives with the peer's READY (its first subscription, often) is kept.
    let mut early = Vec::new();
    let handshake = async {
        stream.write_all(&session.start()).await?;
        while !session.established() {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            for ev in session.feed(&buf[..n]).map_err(bad)? {
                match ev {
                    PullEvent::Send(b) => stream.write_all(&b).await?,
                    PullEvent::Message(m) => early.push(m),
                }
            }
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(inner.limits.handshake_timeout, handshake)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    for m in early {
        subscription(&m, &mut subs, &mut counted, inner);
    }
    loop {
        tokio::select! {
            r = stream.read(&mut buf) => {
                let n = r?;
                if n == 0 {
                    return Ok(());
                }
                for ev in session.feed(&buf[..n]).map_err(bad)? {
                    if let PullEvent::Message(m) = ev {
                        subscription(&m, &mut subs, &mut counted, inner);
                    }
                }
            }
            m = rx.recv() => {
                let Some(m) = m else { return Ok(()) };
                if subs.iter().any(|s| inner.topic.starts_with(s)) {
                    tokio::time::timeout(inner.limits.write_timeout, stream.write_all(&m))
                        .await
                        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
                }
            }
        }
    }
}

/// Applies a subscriber's message: `\x01prefix` subscribes, `\x00prefix` unsubscribes.
fn subscription(frames: &[Vec<u8>], subs: &mut Vec<Vec<u8>>, counted: &mut bool, inner: &Inner) {
    let Some(body) = frames.first() else { return };
    match body.split_first() {
        Some((1, prefix)) if subs.len() < MAX_SUBSCRIPTIONS => {
            subs.push(prefix.to_vec());
            if !*counted {
                *counted = true;
                inner.subscribed.send_modify(|k| *k += 1);
            }
        }
        Some((0, prefix)) => {
            if let Some(i) = subs.iter().position(|s| s == prefix) {
                subs.swap_remove(i);
            }
        }
        _ => {}
    }
}
