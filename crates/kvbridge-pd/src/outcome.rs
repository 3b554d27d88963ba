//! Outcomes for the proxy: one per request and rank, pushed over ZMQ as msgpack.
//!
//! The wire shape is msgspec's tagged struct: a map whose `"type"` key names the message,
//! e.g. `{"type": "KvReady", "req_id": "r1", "rank": 0, "chunks": 4, "bytes": 1048576}`.
//! `ProxyNotif{req_id}` is LMCache's success message; `KvReady` and `KvFailed` are ours.
//! The structs duplicate the proxy's (`kvbridge-proxy::notif`) on purpose: the two crates
//! agree on bytes (pinned by golden tests on both sides), not on Rust types.
//!
//! With a shared secret (`KVBRIDGE_SECRET`, as for the channel), every outcome also carries a
//! `tag` key: the HMAC of its kind, rank and request id (`kvbridge_proto::outcome_tag`), which
//! a proxy given the same secret requires. msgspec decoders that do not know the key skip it.

use crate::zmtp_push::PushConn;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::sync::mpsc;

/// One rank's outcome for one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Outcome {
    /// LMCache's success message (names no rank).
    ProxyNotif {
        /// The request id from the `disagg_spec`.
        req_id: String,
    },
    /// A rank wrote all KV chunks of the request.
    KvReady {
        /// The request id from the `disagg_spec`.
        req_id: String,
        /// The tensor-parallel rank.
        rank: u32,
        /// KV chunks of the request on this rank (including chunks the receiver already held).
        chunks: u64,
        /// Bytes written by this rank.
        bytes: u64,
        /// MLA send-once: the rank that sent this rank's (identical) KV; this rank wrote
        /// nothing. Absent on the wire otherwise (the shape stays LMCache-compatible).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sent_by: Option<u32>,
    },
    /// A rank could not transfer the request's KV.
    KvFailed {
        /// The request id from the `disagg_spec`.
        req_id: String,
        /// The tensor-parallel rank.
        rank: u32,
        /// Why, for people.
        reason: String,
    },
}

impl Outcome {
    /// The request id.
    pub fn req_id(&self) -> &str {
        match self {
            Outcome::ProxyNotif { req_id }
            | Outcome::KvReady { req_id, .. }
            | Outcome::KvFailed { req_id, .. } => req_id,
        }
    }

    /// The message type's name on the wire (`"type"`).
    pub fn kind(&self) -> &'static str {
        match self {
            Outcome::ProxyNotif { .. } => "ProxyNotif",
            Outcome::KvReady { .. } => "KvReady",
            Outcome::KvFailed { .. } => "KvFailed",
        }
    }

    /// The rank the outcome is about (0 for `ProxyNotif`, which names none).
    fn rank(&self) -> u32 {
        match self {
            Outcome::ProxyNotif { .. } => 0,
            Outcome::KvReady { rank, .. } | Outcome::KvFailed { rank, .. } => *rank,
        }
    }

    /// msgpack bytes in the tagged-map shape.
    pub fn encode(&self) -> Vec<u8> {
        // A plain enum of strings and integers always serialises.
        rmp_serde::to_vec_named(self).unwrap_or_default()
    }

    /// msgpack bytes with, under `secret`, a `tag` entry that authenticates the kind, rank
    /// and request id (without a secret, the same as [`Outcome::encode`]).
    pub fn encode_tagged(&self, secret: Option<&[u8]>) -> Vec<u8> {
        let mut b = self.encode();
        let Some(secret) = secret else { return b };
        // Every outcome is a fixmap of at most 6 entries (header 0x80 | n): one more entry
        // keeps it a fixmap, so the tag is appended and the count raised.
        match b.first() {
            Some(&h) if h & 0xf0 == 0x80 && h & 0x0f < 15 => b[0] = h + 1,
            _ => return b,
        }
        let tag = kvbridge_proto::outcome_tag::outcome_tag(
            secret,
            self.kind(),
            self.rank(),
            self.req_id(),
        );
        b.extend_from_slice(b"\xa3tag");
        b.push(0xd9); // str8
        b.push(tag.len() as u8);
        b.extend_from_slice(tag.as_bytes());
        b
    }

    /// Decodes msgpack bytes (rejects anything over 64 KiB).
    pub fn decode(bytes: &[u8]) -> Result<Outcome, String> {
        if bytes.len() > 64 << 10 {
            return Err(format!("outcome of {} bytes is too large", bytes.len()));
        }
        rmp_serde::from_slice(bytes).map_err(|e| e.to_string())
    }
}

/// Where outcomes go.
#[derive(Debug, Clone)]
pub enum OutcomeSink {
    /// Dropped (tests, or a deployment without a proxy).
    None,
    /// An in-process queue (tests, embedding).
    Queue(mpsc::UnboundedSender<Outcome>),
    /// A ZMQ PUSH socket connected to the proxy's PULL address.
    Zmq(ZmqPusher),
}

impl OutcomeSink {
    /// Hands an outcome over; never blocks (the ZMQ sink sends from its own task).
    pub fn emit(&self, o: Outcome) {
        match self {
            OutcomeSink::None => {}
            OutcomeSink::Queue(q) => {
                let _ = q.send(o);
            }
            OutcomeSink::Zmq(z) => z.emit(o),
        }
    }
}

/// A ZMQ PUSH connection to the proxy, driven by its own task: it connects lazily and
/// sends in order. Each outcome has `deadline` from when it was emitted to reach the proxy:
/// while the proxy is unreachable (restarting, say) the task reconnects, with growing
/// pauses, and sends it then; an outcome still undelivered at its deadline is logged and
/// dropped (the proxy's own deadline then answers the client). A proxy that went away is
/// noticed before the next send (see `zmtp_push.rs`), not by losing that send.
#[derive(Debug, Clone)]
pub struct ZmqPusher {
    tx: mpsc::UnboundedSender<(tokio::time::Instant, Outcome)>,
}

/// The shared secret that tags outcomes: `KVBRIDGE_SECRET`, as the channel reads it.
fn secret_from_env() -> Option<Vec<u8>> {
    std::env::var("KVBRIDGE_SECRET")
        .ok()
        .map(String::into_bytes)
        .filter(|s| !s.is_empty())
}

/// First pause before connecting again to an unreachable proxy; it doubles up to
/// [`RECONNECT_PAUSE_MAX`].
const RECONNECT_PAUSE_MIN: Duration = Duration::from_millis(20);
/// Longest pause between attempts to connect to an unreachable proxy.
const RECONNECT_PAUSE_MAX: Duration = Duration::from_millis(500);

impl ZmqPusher {
    /// Starts the pusher for `endpoint` (`tcp://host:port`); must run inside a tokio runtime.
    /// Outcomes are tagged under `KVBRIDGE_SECRET` when it is set.
    pub fn spawn(endpoint: String, deadline: Duration) -> ZmqPusher {
        Self::spawn_with_secret(endpoint, deadline, secret_from_env())
    }

    /// [`ZmqPusher::spawn`] with the secret given (`None`: outcomes go untagged).
    pub fn spawn_with_secret(
        endpoint: String,
        deadline: Duration,
        secret: Option<Vec<u8>>,
    ) -> ZmqPusher {
        let (tx, mut rx) = mpsc::unbounded_channel::<(tokio::time::Instant, Outcome)>();
        tokio::spawn(async move {
            let Some(addr) = endpoint.strip_prefix("tcp://").map(str::to_string) else {
                tracing::warn!(%endpoint, "outcome endpoint is not tcp://host:port; outcomes are dropped");
                while rx.recv().await.is_some() {}
                return;
            };
            let mut conn: Option<PushConn> = None;
            while let Some((emitted, o)) = rx.recv().await {
                let body = o.encode_tagged(secret.as_deref());
                if !deliver(&mut conn, &addr, &endpoint, &body, emitted + deadline).await {
                    tracing::warn!(%endpoint, ?deadline, req_id = o.req_id(), "outcome not delivered to the proxy within its deadline; dropped");
                }
            }
        });
        ZmqPusher { tx }
    }

    /// Queues an outcome; its deadline starts now.
    pub fn emit(&self, o: Outcome) {
        let _ = self.tx.send((tokio::time::Instant::now(), o));
    }
}

/// Sends `body` on `conn` (connecting, or reconnecting to a proxy that went away, with
/// growing pauses) until it is on the wire or `until` passes; whether it went.
async fn deliver(
    conn: &mut Option<PushConn>,
    addr: &str,
    endpoint: &str,
    body: &[u8],
    until: tokio::time::Instant,
) -> bool {
    let mut pause = RECONNECT_PAUSE_MIN;
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        let c = match conn {
            Some(c) if !c.peer_gone() => c,
            _ => match PushConn::connect(addr, left).await {
                Ok(c) => conn.insert(c),
                Err(e) => {
                    *conn = None;
                    tracing::debug!(%endpoint, error = %e, "cannot connect to the proxy yet");
                    tokio::time::sleep(pause.min(left)).await;
                    pause = (pause * 2).min(RECONNECT_PAUSE_MAX);
                    continue;
                }
            },
        };
        match c.send(body, left).await {
            Ok(()) => return true,
            Err(e) => {
                tracing::debug!(%endpoint, error = %e, "proxy connection lost; reconnecting");
                *conn = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes msgspec writes for `KvReady(req_id="r1", rank=0, chunks=4, bytes=1048576)`
    /// as a tagged struct (tag first, then fields in order). The proxy's decoder is pinned to
    /// the same bytes (see `golden_bytes_decode` in its tests, or the Python interop test).
    pub(crate) const GOLDEN_KV_READY: &[u8] = b"\x85\xa4type\xa7KvReady\xa6req_id\xa2r1\xa4rank\x00\xa6chunks\x04\xa5bytes\xce\x00\x10\x00\x00";
    pub(crate) const GOLDEN_KV_FAILED: &[u8] =
        b"\x84\xa4type\xa8KvFailed\xa6req_id\xa2r2\xa4rank\x01\xa6reason\xa3oom";
    pub(crate) const GOLDEN_PROXY_NOTIF: &[u8] = b"\x82\xa4type\xaaProxyNotif\xa6req_id\xa2r3";

    #[test]
    fn golden_bytes() {
        let ready = Outcome::KvReady {
            req_id: "r1".into(),
            rank: 0,
            chunks: 4,
            bytes: 1 << 20,
            sent_by: None,
        };
        assert_eq!(ready.encode(), GOLDEN_KV_READY);
        let failed = Outcome::KvFailed {
            req_id: "r2".into(),
            rank: 1,
            reason: "oom".into(),
        };
        assert_eq!(failed.encode(), GOLDEN_KV_FAILED);
        let notif = Outcome::ProxyNotif {
            req_id: "r3".into(),
        };
        assert_eq!(notif.encode(), GOLDEN_PROXY_NOTIF);
        for (b, o) in [
            (GOLDEN_KV_READY, ready),
            (GOLDEN_KV_FAILED, failed),
            (GOLDEN_PROXY_NOTIF, notif),
        ] {
            assert_eq!(Outcome::decode(b).unwrap(), o);
        }
        assert!(Outcome::decode(b"\xc1").is_err());
    }

    /// The tag rides as one more map entry; the message still decodes as before (extra keys
    /// are skipped) and carries the pinned tag of `kvbridge_proto::outcome_tag`.
    #[test]
    fn tagged_outcomes_keep_their_shape() {
        let o = Outcome::KvReady {
            req_id: "kvb-00".into(),
            rank: 1,
            chunks: 4,
            bytes: 1 << 20,
            sent_by: None,
        };
        assert_eq!(o.encode_tagged(None), o.encode());
        let b = o.encode_tagged(Some(b"secret"));
        assert_eq!(b[0], 0x86);
        assert_eq!(Outcome::decode(&b).unwrap(), o);
        #[derive(Deserialize)]
        struct Tag {
            tag: String,
        }
        let t: Tag = rmp_serde::from_slice(&b).unwrap();
        assert_eq!(
            t.tag,
            "c3d132555ac9569aaa46fc7fdb2d7b5ab3bffc257ae9a40dba9368fd2e11838c"
        );
    }
}
