//! The SUB side of vLLM's KV-events stream: one connection per worker to the worker's PUB
//! endpoint (vLLM `--kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'`,
//! the reference engine `--kv-events-endpoint`), feeding that worker's view in the
//! [`KvIndex`]. An endpoint is `tcp://host:port` (or `host:port`), or `ipc://path`, a Unix
//! socket: vLLM's publisher binds only a wildcard TCP endpoint or an `ipc://` one (to any
//! other it connects out), so a worker on the proxy's host that should not listen on every
//! interface publishes on `ipc://`.
//!
//! Our own bounded ZMTP 3.0 code (`kvbridge_proto::zmtp`), as on the outcome port: a frame
//! over [`SubLimits::max_frame`] or a message of more than three frames closes the
//! connection before anything is allocated for it; the handshake must finish within
//! [`SubLimits::handshake_timeout`] and a frame, once begun, within
//! [`SubLimits::frame_timeout`]. Whatever ends a connection, the worker's view is dropped
//! and the connection retried after [`SubLimits::retry`]; a new connection starts from an
//! empty view too (what was published while nobody listened is unknown). vLLM's replay
//! ROUTER socket (`replay_endpoint`), which could fill such holes, is not used.
//!
//! The subscriber task of a worker is the only writer of that worker's view.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use kvbridge_proto::kv_events::{decode_batch, split_message, DecodeLimits};
use kvbridge_proto::zmtp::{frame, PullEvent, PullLimits, PullSession};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::routing::kv_index::{Applied, KvIndex};

/// Bounds of a subscriber connection.
#[derive(Debug, Clone, Copy)]
pub struct SubLimits {
    /// Largest frame accepted (the payload's frame is the large one).
    pub max_frame: usize,
    /// Connect, greetings and `READY` within this.
    pub handshake_timeout: Duration,
    /// A frame, once begun, within this.
    pub frame_timeout: Duration,
    /// Wait before reconnecting.
    pub retry: Duration,
    /// Limits of a decoded payload.
    pub decode: DecodeLimits,
}

impl Default for SubLimits {
    fn default() -> Self {
        let decode = DecodeLimits::default();
        SubLimits {
            max_frame: decode.max_payload,
            handshake_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(10),
            retry: Duration::from_secs(1),
            decode,
        }
    }
}

/// Counters of the subscribers of one pool (for `/metrics`).
#[derive(Debug, Default)]
pub struct SubStats {
    /// Connections made (each one started its worker's view afresh).
    pub connects: AtomicU64,
    /// Batches applied.
    pub batches: AtomicU64,
    /// Batches after a sequence gap (the view was dropped first).
    pub gaps: AtomicU64,
    /// Batches whose sequence went back: a restarted publisher.
    pub restarts: AtomicU64,
    /// Messages that were not a decodable batch (the view was dropped).
    pub bad: AtomicU64,
    /// Connections that failed or ended.
    pub disconnects: AtomicU64,
    /// Notified after each batch is applied and each view drop.
    pub changed: Notify,
}

/// The running subscribers; dropping this stops them.
#[derive(Debug)]
pub struct KvEventsSubscribers {
    tasks: Vec<JoinHandle<()>>,
    /// Their counters.
    pub stats: Arc<SubStats>,
}

impl Drop for KvEventsSubscribers {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Subscribes to `topic` on each `(worker index, endpoint)` (`tcp://host:port`,
/// `host:port` or `ipc://path`), feeding `index`.
pub fn spawn(
    endpoints: Vec<(usize, String)>,
    topic: Vec<u8>,
    index: Arc<KvIndex>,
    limits: SubLimits,
) -> KvEventsSubscribers {
    let stats = Arc::new(SubStats::default());
    let tasks = endpoints
        .into_iter()
        .map(|(w, ep)| {
            let (topic, index, stats) = (topic.clone(), index.clone(), stats.clone());
            tokio::spawn(async move {
                let addr = ep.strip_prefix("tcp://").unwrap_or(&ep).to_string();
                loop {
                    let r = subscribe_once(w, &addr, &topic, &index, &limits, &stats).await;
                    index.forget(w);
                    stats.disconnects.fetch_add(1, Relaxed);
                    stats.changed.notify_waiters();
                    if let Err(e) = r {
                        tracing::debug!(worker = w, endpoint = %addr, "KV events: {e}");
                    }
                    tokio::time::sleep(limits.retry).await;
                }
            })
        })
        .collect();
    KvEventsSubscribers { tasks, stats }
}

/// A connection to a publisher, over TCP or a Unix socket.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Connects to `addr`: `ipc://path` is a Unix socket, anything else `host:port`.
async fn connect(addr: &str) -> std::io::Result<Box<dyn Stream>> {
    if let Some(path) = addr.strip_prefix("ipc://") {
        return Ok(Box::new(UnixStream::connect(path).await?));
    }
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(Box::new(stream))
}

fn bad(detail: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, detail.to_string())
}

async fn subscribe_once(
    w: usize,
    addr: &str,
    topic: &[u8],
    index: &KvIndex,
    limits: &SubLimits,
    stats: &SubStats,
) -> std::io::Result<()> {
    let mut session = PullSession::with_socket_types(
        PullLimits {
            max_frame: limits.max_frame,
            max_frames: 3,
        },
        "SUB",
        b"PUB",
    );
    let mut buf = vec![0u8; 64 * 1024];
    let handshake = async {
        let mut stream = connect(addr).await?;
        stream.write_all(&session.start()).await?;
        while !session.established() {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            for ev in session.feed(&buf[..n]).map_err(bad)? {
                if let PullEvent::Send(b) = ev {
                    stream.write_all(&b).await?;
                }
                // A PUB sends nothing before our subscription, which follows.
            }
        }
        let mut sub = vec![1u8];
        sub.extend_from_slice(topic);
        stream.write_all(&frame(0, &sub)).await?;
        Ok::<_, std::io::Error>(stream)
    };
    let mut stream = tokio::time::timeout(limits.handshake_timeout, handshake)
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    // Whatever the worker published before is unknown.
    index.forget(w);
    stats.connects.fetch_add(1, Relaxed);
    loop {
        let n = if session.mid_frame() {
            tokio::time::timeout(limits.frame_timeout, stream.read(&mut buf))
                .await
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??
        } else {
            stream.read(&mut buf).await?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        for ev in session.feed(&buf[..n]).map_err(bad)? {
            let PullEvent::Message(frames) = ev else {
                continue;
            };
            let decoded = split_message(&frames).and_then(|(_, seq, payload)| {
                decode_batch(payload, &limits.decode).map(|b| (seq, b))
            });
            match decoded {
                Ok((seq, batch)) => {
                    match index.apply(w, seq, &batch) {
                        Applied::InOrder => {}
                        Applied::Gap { expected, got } => {
                            stats.gaps.fetch_add(1, Relaxed);
                            tracing::info!(
                                worker = w,
                                expected,
                                got,
                                "KV events: sequence gap, the worker's view is rebuilt"
                            );
                        }
                        Applied::Restarted => {
                            stats.restarts.fetch_add(1, Relaxed);
                            tracing::info!(
                                worker = w,
                                seq,
                                "KV events: the publisher restarted, the worker's view is rebuilt"
                            );
                        }
                        Applied::Overflow => {
                            tracing::warn!(worker = w, "KV events: more blocks than the index keeps per worker, the worker's view is dropped");
                        }
                    }
                    stats.batches.fetch_add(1, Relaxed);
                }
                Err(e) => {
                    index.forget(w);
                    stats.bad.fetch_add(1, Relaxed);
                    tracing::warn!(worker = w, "KV events: {e}; the worker's view is dropped");
                }
            }
            stats.changed.notify_waiters();
        }
    }
}
