//! The state every part of one engine shares (`Inner`, behind an `Arc`), and the counters
//! it reports. The types that several parts hand each other live here, below their users.

use super::config::EngineConfig;
use super::error::SimError;
use super::stats::{BusyClock, Counts, EngineStats};
use crate::announce::Announced;
use crate::chunk_memory::ChunkMemory;
use crate::kv_events_pub::KvEventsPublisher;
use crate::model::{Model, SeqState};
use crate::prefix_cache::PrefixCache;
use kvbridge_pd::{Counters, KvSpec, OutcomeSink, PdReceiver, PdSender};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tokio::task::JoinHandle;

pub(super) struct Inner {
    pub(super) cfg: EngineConfig,
    pub(super) model: Arc<Model>,
    pub(super) senders: Vec<Arc<PdSender>>,
    pub(super) receivers: Vec<PdReceiver>,
    pub(super) outcomes: OutcomeSink,
    pub(super) announced: Announced,
    /// The simulated accelerator: one prefill at a time.
    pub(super) accel: tokio::sync::Mutex<()>,
    /// How long the mock accelerator took per token of the last chunk it computed, ps (0
    /// until known): the lead with which a prefill step's KV computation starts
    /// ([`jit_wait`](super::prefill::jit_wait)).
    pub(super) fill_ps_per_token: AtomicU64,
    pub(super) counts: Counts,
    pub(super) busy: BusyClock,
    /// The same for write calls only.
    pub(super) write_busy: BusyClock,
    /// Woken whenever `counts.in_flight` drops.
    pub(super) settled: tokio::sync::Notify,
    pub(super) seq: AtomicU64,
    /// Decode: per granted request, the task digesting its KV as it lands.
    /// Prefill: each sender rank's chunk memory (see [`crate::chunk_memory`]).
    pub(super) chunk_memory: Vec<Arc<ChunkMemory>>,
    /// The KV spec of each PD lane (sender or receiver): the model's, or a push part's.
    pub(super) lane_specs: Vec<KvSpec>,
    pub(super) consumers: std::sync::Mutex<HashMap<String, JoinHandle<Result<Consumed, SimError>>>>,
    /// Decode: PD requests taken by a decode request, until their pages are released (so
    /// two decode requests naming one id cannot both read, and release, its pages).
    pub(super) claimed: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Prompt chunks computed or received, and the events they make (one owner: this lock;
    /// events are published under it, so batches leave in the order of the changes).
    pub(super) prefix_cache: std::sync::Mutex<PrefixCache>,
    /// Where the prefix cache's events go.
    pub(super) kv_events: Option<KvEventsPublisher>,
}

impl Inner {
    pub(super) fn work_started(&self) {
        self.counts.in_flight.fetch_add(1, Relaxed);
    }
    pub(super) fn work_done(&self) {
        self.counts.in_flight.fetch_sub(1, Relaxed);
        self.settled.notify_waiters();
    }
}

impl Inner {
    pub(super) fn stats(&self) -> EngineStats {
        let c = &self.counts;
        let mut pages = Counters::default();
        for r in &self.receivers {
            let x = r.counters();
            pages.total += x.total;
            pages.free += x.free;
            pages.leaked += x.leaked;
        }
        EngineStats {
            role: Some(self.cfg.role),
            requests: c.requests.load(Relaxed),
            errors: c.errors.load(Relaxed),
            prompt_tokens: c.prompt_tokens.load(Relaxed),
            generated_tokens: c.generated_tokens.load(Relaxed),
            kv_transfers_ok: c.kv_transfers_ok.load(Relaxed),
            kv_transfers_failed: c.kv_transfers_failed.load(Relaxed),
            kv_bytes_sent: c.kv_bytes_sent.load(Relaxed),
            kv_send_busy_s: self.busy.total().as_secs_f64(),
            kv_write_busy_s: self.write_busy.total().as_secs_f64(),
            kv_finishes: c.kv_finishes.load(Relaxed),
            kv_finish_s: c.kv_finish_ns.load(Relaxed) as f64 / 1e9,
            kv_requests_received: c.kv_requests_received.load(Relaxed),
            kv_chunks_received: c.kv_chunks_received.load(Relaxed),
            kv_bytes_received: c.kv_bytes_received.load(Relaxed),
            kv_mismatches: c.kv_mismatches.load(Relaxed),
            kv_retrieve_failed: c.kv_retrieve_failed.load(Relaxed),
            local_prefills: c.local_prefills.load(Relaxed),
            prefill_tokens_computed: c.prefill_tokens_computed.load(Relaxed),
            prefix_cache_hit_tokens: c.prefix_cache_hit_tokens.load(Relaxed),
            prefix_cache_chunks: lock(&self.prefix_cache).len() as u64,
            pages_total: pages.total,
            pages_free: pages.free,
            pages_leaked: pages.leaked,
            announced_pending: self.announced.len() as u64,
            in_flight: c.in_flight.load(Relaxed),
            kv_load_s: c.kv_load_ns.load(Relaxed) as f64 / 1e9,
            kv_writes: c.kv_writes.load(Relaxed),
            kv_requests_consumed: c.kv_requests_consumed.load(Relaxed),
            kv_chunks_consumed: c.kv_chunks_consumed.load(Relaxed),
            kv_bytes_needed: c.kv_bytes_needed.load(Relaxed),
        }
    }
}

/// What a decoder took from a request's KV as it landed.
pub(super) struct Consumed {
    /// The sequence state after the KV (its prefix hash is set once the prompt is known).
    pub(super) state: SeqState,
    /// Per chunk, per world rank, the digest of each position's KV as it was read
    /// (`[chunk][rank][position]`): checked against the prompt's KV after the first token,
    /// without reading the pages again.
    pub(super) digests: Vec<Vec<Vec<u64>>>,
    /// Bytes read, counted per world rank (an MLA chunk sent once counts for every rank).
    pub(super) bytes: u64,
}

pub(super) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
