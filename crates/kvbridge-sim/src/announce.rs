//! How a decoder learns which PD request holds a prompt's KV.
//!
//! The proxy's lmcache flow gives the PD request id (`disagg_spec.req_id`) to the prefiller
//! only; the decode request carries the prompt (plus the first token) and no id. LMCache's
//! decoder finds KV by chunk keys over the prompt's tokens; the PD receiver retrieves by
//! request id. So the prefiller *announces* each transfer to the decoder before it starts:
//! one JSON line `{"req_id", "key", "tokens"}` (key: [`crate::model::tokens_key`] of the
//! prompt tokens) over TCP to the decoder's `receiver_alloc_port` of rank 0 (a port the PD
//! layer does not use), answered by `ok`. The decoder then finds the id from the tokens of
//! its decode request. The announcement is acknowledged before the prefiller answers (it
//! runs during the first chunk's compute), and the proxy sends the decode only after the
//! prefill answered, so it is always there in time.
//!
//! This is now the fallback: a decode request that carries the proxy's handoff id
//! (`kv_transfer_params.lmcache.pd_handoff_id`) is matched by id, proved by the PD layer's
//! chunk keys over its tokens (see `engine::find_kv`); the announcement serves clients that
//! send no id.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// One announced transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Announcement {
    /// The PD request id (`disagg_spec.req_id`).
    pub req_id: String,
    /// [`crate::model::tokens_key`] of the prompt tokens whose KV is sent.
    pub key: u64,
    /// Number of prompt tokens.
    pub tokens: u64,
}

/// Announcements are forgotten after this long (a transfer that failed is never claimed).
pub const ANNOUNCE_TTL: Duration = Duration::from_secs(120);

type Table = HashMap<u64, Vec<(Announcement, Instant)>>;

/// The decoder's table of announced transfers, by key (several requests may share a prompt).
#[derive(Debug, Default, Clone)]
pub struct Announced {
    inner: Arc<Mutex<Table>>,
}

impl Announced {
    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records an announcement and drops expired ones.
    pub fn insert(&self, a: Announcement) {
        let now = Instant::now();
        let mut m = self.lock();
        m.retain(|_, v| {
            v.retain(|(_, t)| now.duration_since(*t) < ANNOUNCE_TTL);
            !v.is_empty()
        });
        m.entry(a.key).or_default().push((a, now));
    }

    /// The announced request ids for `key` with `tokens` tokens, oldest first.
    pub fn candidates(&self, key: u64, tokens: u64) -> Vec<String> {
        self.lock()
            .get(&key)
            .map(|v| {
                v.iter()
                    .filter(|(a, _)| a.tokens == tokens)
                    .map(|(a, _)| a.req_id.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Forgets one request id.
    pub fn remove(&self, key: u64, req_id: &str) {
        let mut m = self.lock();
        if let Some(v) = m.get_mut(&key) {
            v.retain(|(a, _)| a.req_id != req_id);
            if v.is_empty() {
                m.remove(&key);
            }
        }
    }

    /// Announcements held.
    pub fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Serves announcements on `listener` until the task is aborted.
pub async fn serve(listener: TcpListener, table: Announced) {
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            continue;
        };
        let table = table.clone();
        tokio::spawn(async move {
            let _ = sock.set_nodelay(true);
            let (r, mut w) = sock.into_split();
            let mut lines = BufReader::new(r.take(64 << 10)).lines();
            // One connection may carry many announcements; each gets its answer.
            while let Ok(Ok(Some(line))) =
                tokio::time::timeout(Duration::from_secs(300), lines.next_line()).await
            {
                let answer = match serde_json::from_str::<Announcement>(&line) {
                    Ok(a) => {
                        table.insert(a);
                        "ok\n".to_string()
                    }
                    Err(e) => format!("error {e}\n"),
                };
                if w.write_all(answer.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
    }
}

use tokio::io::AsyncReadExt as _;

/// Errors of announcing.
#[derive(Debug, thiserror::Error)]
pub enum AnnounceError {
    /// No answer within the deadline.
    #[error("announcing {req_id} to {addr}: no answer within {after:?}")]
    Timeout {
        /// The request.
        req_id: String,
        /// The decoder's announce address.
        addr: String,
        /// The deadline.
        after: Duration,
    },
    /// The decoder could not be reached at all (connection refused, reset or timed out
    /// while connecting): nothing was delivered, so the request can go to another decoder.
    #[error("announcing {req_id} to {addr}: the decoder is unreachable: {detail}")]
    Unreachable {
        /// The request.
        req_id: String,
        /// The decoder's announce address.
        addr: String,
        /// What went wrong.
        detail: String,
    },
    /// Writing or reading failed, or the decoder refused.
    #[error("announcing {req_id} to {addr}: {detail}")]
    Failed {
        /// The request.
        req_id: String,
        /// The decoder's announce address.
        addr: String,
        /// What went wrong.
        detail: String,
    },
}

/// Announces `a` to `addr` (`host:port`) and waits for the decoder's `ok`, up to `deadline`.
pub async fn announce(
    addr: &str,
    a: &Announcement,
    deadline: Duration,
) -> Result<(), AnnounceError> {
    let failed = |detail: String| AnnounceError::Failed {
        req_id: a.req_id.clone(),
        addr: addr.to_string(),
        detail,
    };
    let unreachable = |detail: String| AnnounceError::Unreachable {
        req_id: a.req_id.clone(),
        addr: addr.to_string(),
        detail,
    };
    // An atomic, not a Cell: the future must stay Send.
    let connected = std::sync::atomic::AtomicBool::new(false);
    let work = async {
        let mut s = TcpStream::connect(addr)
            .await
            .map_err(|e| unreachable(format!("connect: {e}")))?;
        connected.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = s.set_nodelay(true);
        let mut line = serde_json::to_string(a).map_err(|e| failed(e.to_string()))?;
        line.push('\n');
        s.write_all(line.as_bytes())
            .await
            .map_err(|e| failed(format!("write: {e}")))?;
        let mut answer = String::new();
        BufReader::new(s.take(4096))
            .read_line(&mut answer)
            .await
            .map_err(|e| failed(format!("read: {e}")))?;
        if answer.trim_end() == "ok" {
            Ok(())
        } else {
            Err(failed(format!("decoder answered {:?}", answer.trim_end())))
        }
    };
    match tokio::time::timeout(deadline, work).await {
        Ok(r) => r,
        Err(_) if !connected.load(std::sync::atomic::Ordering::Relaxed) => Err(unreachable(
            format!("connect: no answer within {deadline:?}"),
        )),
        Err(_) => Err(AnnounceError::Timeout {
            req_id: a.req_id.clone(),
            addr: addr.to_string(),
            after: deadline,
        }),
    }
}
