//! The state every request shares ([`App`]): the configuration, the HTTP client, both worker
//! pools and the KV waiters, and the small services on it that every step uses (request ids,
//! worker URIs, the busy-poll mark).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use axum::http::{HeaderMap, HeaderValue, Uri};

use crate::busy_poll::{Awaiting, BusyPoll};
use crate::config::Config;
use crate::kvwait::KvWaiters;
use crate::metrics::Metrics;
use crate::pool::{Pool, Role};
use crate::reply::X_REQUEST_ID;
use crate::request::Api;

/// `tracing` target of the per-request timeline marks (`kvbridge demo --timeline`).
pub(crate) const TL: &str = "kvbridge::timeline";

pub(crate) type HttpClient = crate::tokenize::HttpClient;

/// Shared state of all requests.
pub(crate) struct App {
    pub(crate) cfg: Config,
    pub(crate) client: HttpClient,
    pub(crate) prefill: Arc<Pool>,
    pub(crate) decode: Arc<Pool>,
    pub(crate) waiters: Option<KvWaiters>,
    pub(crate) metrics: Arc<Metrics>,
    /// Per worker, the URIs of its APIs (completions, chat, SGLang's `/generate`), parsed
    /// once.
    pub(crate) prefill_uris: Vec<[Uri; 3]>,
    pub(crate) decode_uris: Vec<[Uri; 3]>,
    /// Polls for backend answers at low load (one-thread runtime only).
    pub(crate) busy_poll: Option<Arc<BusyPoll>>,
    /// Whether a request goes to its decoder alone or the PD way.
    pub(crate) decider: crate::routing::decider::Decider,
    /// `/tokenize` calls by result (`--kv-events-tokenize http`).
    pub(crate) tokenize_stats: crate::tokenize::TokenizeStats,
    /// The turn of the next worker asked to tokenize.
    pub(crate) tokenize_turn: AtomicU64,
    /// Each decoder's load counters as its `/metrics` last said (`--flow vllm` with health
    /// checks on; empty otherwise).
    pub(crate) decoder_loads: crate::decoder_loads::Board,
}

/// Per worker of `pool`, the URIs of its completions, chat and `/generate` APIs.
pub(crate) fn api_uris(pool: &Pool) -> anyhow::Result<Vec<[Uri; 3]>> {
    pool.workers
        .iter()
        .map(|w| {
            let u = |api: Api| {
                format!("{}{}", w.base, api.path())
                    .parse::<Uri>()
                    .map_err(|e| anyhow::anyhow!("bad worker address {}: {e}", w.label))
            };
            Ok([u(Api::Completions)?, u(Api::Chat)?, u(Api::Generate)?])
        })
        .collect()
}

/// A fresh request id: `kvb-` and 128 random bits in hex. Unguessable, so that no one who
/// sees some ids (a client gets its own back) can name another request's id, e.g. in a
/// forged outcome.
pub(crate) fn random_id() -> String {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        // The OS source failing is not seen on Linux past early boot. `RandomState` is
        // keyed from the same source at start; its SipHash of a counter is still not
        // guessable from outside.
        use std::hash::{BuildHasher, Hasher};
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Relaxed);
        for (i, half) in b.chunks_mut(8).enumerate() {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(n);
            h.write_usize(i);
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    let mut s = String::with_capacity(36);
    s.push_str("kvb-");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

impl App {
    pub(crate) fn next_id(&self) -> String {
        random_id()
    }

    /// The client's `x-request-id` when it is a usable one, else a fresh id.
    pub(crate) fn request_id(&self, headers: &HeaderMap) -> HeaderValue {
        match headers.get(X_REQUEST_ID) {
            Some(v) if !v.is_empty() && v.len() <= 256 && v.to_str().is_ok() => v.clone(),
            _ => HeaderValue::from_str(&self.next_id()).unwrap_or(HeaderValue::from_static("kvb")),
        }
    }

    /// Worker `idx`'s URI for `api`.
    pub(crate) fn uri(&self, role: Role, idx: usize, api: Api) -> Uri {
        let uris = match role {
            Role::Prefill => &self.prefill_uris,
            Role::Decode => &self.decode_uris,
        };
        let i = match api {
            Api::Completions => 0,
            Api::Chat => 1,
            Api::Generate => 2,
        };
        uris[idx][i].clone()
    }

    /// A prefiller was ejected: the KV waits bound to it fail now.
    pub(crate) fn prefiller_ejected(&self, idx: usize) {
        if let (Some(w), Some(p)) = (&self.waiters, self.prefill.workers.get(idx)) {
            w.prefiller_ejected(idx, p.ejections());
        }
    }

    /// Marks a backend call in flight, so that the runtime polls for its answer if it belongs
    /// to the only request being served (see [`crate::busy_poll`]).
    pub(crate) fn awaiting_backend(&self) -> Option<Awaiting> {
        let bp = self.busy_poll.as_ref()?;
        Some(bp.awaiting(self.metrics.in_flight.load(Relaxed)))
    }
}
