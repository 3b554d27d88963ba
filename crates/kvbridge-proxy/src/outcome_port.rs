//! The outcome port: the PULL side of ZMTP 3.0 (NULL mechanism) on which prefiller ranks
//! push their KV outcomes, served by our own bounded code (`kvbridge_proto::zmtp`).
//!
//! Anyone who can reach this port can connect, so nothing a peer announces is trusted: a
//! frame over [`OutcomePortLimits::max_frame`] or a message of more than
//! [`OutcomePortLimits::max_frames`] frames closes the connection before anything is
//! allocated for it; the greeting and `READY` must arrive within the handshake deadline and
//! a frame, once begun, within the frame deadline. At most
//! [`OutcomePortLimits::max_conns`] connections are served; a new one beyond that takes the
//! place of the oldest connection that never delivered an accepted outcome, or, when every
//! one did, of the one that went longest without (real senders deliver; with a secret, a
//! connection held open to fill the table cannot).
//!
//! With a secret, an outcome counts only with a valid `tag` ([`crate::notif::authentic`]);
//! others are refused and counted (`kv_outcomes_unauthenticated_total`). Without one, any
//! well-formed outcome counts, LMCache's untagged `ProxyNotif` included.
//!
//! Each connection has an id; the KV waits learn from its outcomes which prefiller it
//! belongs to, and a connection the peer closes or breaks (a killed prefiller's) fails the
//! waits of that prefiller at once ([`crate::kvwait`]). One the proxy evicts does not.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use kvbridge_proto::zmtp::{PullEvent, PullLimits, PullSession};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::{OutcomePortLimits, Secret};
use crate::kvwait::KvWaiters;
use crate::metrics::Metrics;
use crate::notif;

/// What every connection task shares.
struct Ctx {
    waiters: KvWaiters,
    metrics: Arc<Metrics>,
    secret: Option<Secret>,
    limits: OutcomePortLimits,
    /// The clock of `last_accepted` stamps.
    epoch: Instant,
}

/// One served connection, as the accept loop sees it.
struct Conn {
    /// Its id for [`KvWaiters::deliver_on`].
    id: u64,
    /// When it was accepted, in ms since `epoch`.
    accepted_at: u64,
    /// When it last delivered an accepted outcome, in ms since `epoch` plus 1; 0: never.
    delivered: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Conn {
    /// Eviction order, lowest first: never delivered before delivered, then the oldest.
    fn staleness(&self) -> (bool, u64) {
        match self.delivered.load(Relaxed) {
            0 => (false, self.accepted_at),
            d => (true, d),
        }
    }
}

/// The served connections; dropping it (the accept loop ended or was aborted) closes them.
struct Conns(Vec<Conn>, KvWaiters);

impl Drop for Conns {
    fn drop(&mut self) {
        for c in &self.0 {
            c.task.abort();
            self.1.conn_ended(c.id, false);
        }
    }
}

/// Binds the outcome port on `host:port` (port 0 picks a free one) and serves it in a task
/// that hands every accepted outcome to `waiters`. Returns the bound address and the task
/// (aborting it closes every connection).
pub async fn bind(
    host: &str,
    port: u16,
    waiters: KvWaiters,
    metrics: Arc<Metrics>,
    secret: Option<Secret>,
    limits: OutcomePortLimits,
) -> anyhow::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind((host, port)).await.map_err(|e| {
        anyhow::anyhow!("cannot bind the notification socket on {host}:{port}: {e}")
    })?;
    let addr = listener.local_addr()?;
    let ctx = Arc::new(Ctx {
        waiters,
        metrics,
        secret,
        limits,
        epoch: Instant::now(),
    });
    Ok((addr, tokio::spawn(accept_loop(listener, ctx))))
}

async fn accept_loop(listener: TcpListener, ctx: Arc<Ctx>) {
    let mut conns = Conns(Vec::new(), ctx.waiters.clone());
    let mut next_id = 0u64;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: pause so that a persistent error cannot spin.
                tracing::warn!(error = %e, "outcome port: accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        conns.0.retain(|c| !c.task.is_finished());
        if conns.0.len() >= ctx.limits.max_conns {
            let stalest = (0..conns.0.len())
                .min_by_key(|&i| conns.0[i].staleness())
                .unwrap_or(0);
            let evicted = conns.0.swap_remove(stalest);
            evicted.task.abort();
            ctx.waiters.conn_ended(evicted.id, false);
            ctx.metrics.outcome_conns_evicted.fetch_add(1, Relaxed);
            tracing::debug!(%peer, cap = ctx.limits.max_conns, "outcome port full: the stalest connection was closed");
        }
        let delivered = Arc::new(AtomicU64::new(0));
        let c = ctx.clone();
        let stamp = delivered.clone();
        let id = next_id;
        next_id += 1;
        let task = tokio::spawn(async move {
            if let Err(why) = serve(stream, id, &c, &stamp).await {
                c.metrics.outcome_conns_refused.fetch_add(1, Relaxed);
                tracing::debug!(%peer, "outcome connection closed: {why}");
            }
            // Closed or broken by the peer: a killed prefiller's connection ends so.
            c.waiters.conn_ended(id, true);
        });
        conns.0.push(Conn {
            id,
            accepted_at: ctx.epoch.elapsed().as_millis() as u64,
            delivered,
            task,
        });
    }
}

/// Serves one connection until the peer closes it (`Ok`) or breaks a rule (`Err`, why).
async fn serve(
    mut s: TcpStream,
    conn: u64,
    ctx: &Ctx,
    delivered: &AtomicU64,
) -> Result<(), String> {
    let _ = s.set_nodelay(true);
    let limits = ctx.limits;
    let mut session = PullSession::new(PullLimits {
        max_frame: limits.max_frame,
        max_frames: limits.max_frames,
    });
    let handshake_until = Instant::now() + limits.handshake;
    write(&mut s, &session.start(), handshake_until).await?;
    let mut buf = vec![0u8; 8192];
    // When the unit now being received (frame or message) began.
    let mut begun: Option<Instant> = None;
    loop {
        let until = if !session.established() {
            Some(handshake_until)
        } else {
            begun.map(|t| t + limits.frame)
        };
        let n = match until {
            Some(u) => tokio::time::timeout_at(u, s.read(&mut buf))
                .await
                .map_err(|_| "deadline passed mid-handshake or mid-frame".to_string())?,
            None => s.read(&mut buf).await,
        }
        .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return if session.mid_frame() {
                Err("closed mid-frame".into())
            } else {
                Ok(())
            };
        }
        for ev in session.feed(&buf[..n]).map_err(|e| e.to_string())? {
            match ev {
                PullEvent::Send(b) => write(&mut s, &b, handshake_until).await?,
                PullEvent::Message(frames) => {
                    for f in frames {
                        if accept(ctx, conn, &f) {
                            delivered.store(ctx.epoch.elapsed().as_millis() as u64 + 1, Relaxed);
                        }
                    }
                }
            }
        }
        begun = match (session.mid_frame(), begun) {
            (false, _) => None,
            (true, Some(t)) => Some(t),
            (true, None) => Some(Instant::now()),
        };
    }
}

async fn write(s: &mut TcpStream, b: &[u8], until: Instant) -> Result<(), String> {
    tokio::time::timeout_at(until, s.write_all(b))
        .await
        .map_err(|_| "deadline passed writing the handshake".to_string())?
        .map_err(|e| format!("write: {e}"))
}

/// Decodes and checks one outcome message; hands it on when it counts. Whether it did.
fn accept(ctx: &Ctx, conn: u64, frame: &[u8]) -> bool {
    let (msg, tag) = match notif::decode_tagged(frame) {
        Ok(m) => m,
        Err(e) => {
            ctx.metrics.kv_outcomes_malformed.fetch_add(1, Relaxed);
            tracing::warn!(error = %e, len = frame.len(), "malformed notification dropped");
            return false;
        }
    };
    if let Some(secret) = &ctx.secret {
        if !notif::authentic(&msg, tag.as_deref(), secret.bytes()) {
            let n = ctx
                .metrics
                .kv_outcomes_unauthenticated
                .fetch_add(1, Relaxed)
                + 1;
            // Logged at the 1st, 2nd, 4th, 8th... refusal: a flood cannot flood the log.
            if n.is_power_of_two() {
                tracing::warn!(
                    req_id = msg.req_id(),
                    kind = msg.kind(),
                    refused = n,
                    "outcome without a valid tag refused (a secret is set)"
                );
            }
            return false;
        }
    }
    tracing::debug!(target: "kvbridge::timeline", stage = "proxy.outcome_received", id = msg.req_id());
    ctx.waiters.deliver_on(conn, msg);
    true
}
