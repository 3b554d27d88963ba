//! An engine's counters: the live ones, the busy clocks, and the snapshot served at
//! `/health` and `/metrics`.

use super::config::Role;
use serde::Serialize;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

/// Counters of one engine (also served as JSON at `/health` and as Prometheus text at
/// `/metrics`).
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) requests: AtomicU64,
    pub(super) errors: AtomicU64,
    pub(super) prompt_tokens: AtomicU64,
    pub(super) generated_tokens: AtomicU64,
    pub(super) kv_transfers_ok: AtomicU64,
    pub(super) kv_transfers_failed: AtomicU64,
    pub(super) kv_bytes_sent: AtomicU64,
    pub(super) kv_requests_received: AtomicU64,
    pub(super) kv_chunks_received: AtomicU64,
    pub(super) kv_bytes_received: AtomicU64,
    pub(super) kv_mismatches: AtomicU64,
    pub(super) kv_retrieve_failed: AtomicU64,
    pub(super) local_prefills: AtomicU64,
    pub(super) prefill_tokens_computed: AtomicU64,
    pub(super) prefix_cache_hit_tokens: AtomicU64,
    /// Rank transfers not yet finished, plus received KV not yet verified.
    pub(super) in_flight: AtomicU64,
    pub(super) kv_load_ns: AtomicU64,
    pub(super) kv_finishes: AtomicU64,
    pub(super) kv_finish_ns: AtomicU64,
    pub(super) kv_writes: AtomicU64,
    pub(super) kv_requests_consumed: AtomicU64,
    pub(super) kv_chunks_consumed: AtomicU64,
    pub(super) kv_bytes_needed: AtomicU64,
}

/// Wall time during which at least one KV write or finish call was in progress (the union
/// of busy intervals, so concurrent transfers over one link are not counted twice).
#[derive(Debug, Default)]
pub(super) struct BusyClock {
    state: std::sync::Mutex<(u32, Option<Instant>, Duration)>,
}

impl BusyClock {
    pub(super) fn enter(&self) {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if g.0 == 0 {
            g.1 = Some(Instant::now());
        }
        g.0 += 1;
    }
    pub(super) fn leave(&self) {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = g.0.saturating_sub(1);
        if g.0 == 0 {
            if let Some(t) = g.1.take() {
                g.2 += t.elapsed();
            }
        }
    }
    pub(super) fn total(&self) -> Duration {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).2
    }
}

/// A snapshot of an engine's counters.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct EngineStats {
    /// The engine's role.
    pub role: Option<Role>,
    /// Generation requests answered or failed.
    pub requests: u64,
    /// Requests answered with an error.
    pub errors: u64,
    /// Prompt tokens seen.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Prefill: rank transfers that ended in `KvReady`.
    pub kv_transfers_ok: u64,
    /// Prefill: rank transfers that ended in `KvFailed`.
    pub kv_transfers_failed: u64,
    /// Prefill: KV bytes written to decoders.
    pub kv_bytes_sent: u64,
    /// Prefill: wall time during which at least one PD write or finish call was in progress
    /// (KV bytes over this is the transfer throughput).
    pub kv_send_busy_s: f64,
    /// Prefill: wall time during which at least one PD write call was in progress (the part
    /// of `kv_send_busy_s` that moved chunks; the rest waited for finishes).
    pub kv_write_busy_s: f64,
    /// Prefill: finish calls made (each waits for the receiver's confirmation).
    pub kv_finishes: u64,
    /// Prefill: time inside those finish calls, summed, seconds.
    pub kv_finish_s: f64,
    /// Decode: requests whose KV came through the PD layer.
    pub kv_requests_received: u64,
    /// Decode: KV chunks received and verified.
    pub kv_chunks_received: u64,
    /// Decode: KV bytes received.
    pub kv_bytes_received: u64,
    /// Decode: received chunks that differ from the KV the model says they must hold.
    pub kv_mismatches: u64,
    /// Decode: announced KV that could not be retrieved.
    pub kv_retrieve_failed: u64,
    /// Decode: requests prefilled locally because no KV was announced for them.
    pub local_prefills: u64,
    /// Prompt tokens prefilled here that the prefix cache did not hold (what the cost
    /// model charged).
    pub prefill_tokens_computed: u64,
    /// Prompt tokens of prefills here that the prefix cache held (not charged).
    pub prefix_cache_hit_tokens: u64,
    /// Chunks in the prefix cache now.
    pub prefix_cache_chunks: u64,
    /// Decode: pages of the receive buffers (all ranks).
    pub pages_total: u64,
    /// Decode: free pages.
    pub pages_free: u64,
    /// Decode: leaked pages (must be 0).
    pub pages_leaked: u64,
    /// Decode: announcements not yet claimed.
    pub announced_pending: u64,
    /// Rank transfers not finished plus received KV not yet verified.
    pub in_flight: u64,
    /// Decode: time from claiming a request's KV to its state being ready (copy out of the
    /// receive buffer and digest), summed over requests, seconds.
    pub kv_load_s: f64,
    /// Prefill: chunk writes (or offers) that succeeded, one per chunk and lane: the
    /// transfer's operations.
    pub kv_writes: u64,
    /// Decode: requests whose KV was taken in whole (every chunk on every lane).
    pub kv_requests_consumed: u64,
    /// Decode: chunks of those requests (one per chunk index, whatever the lanes).
    pub kv_chunks_consumed: u64,
    /// Decode: bytes the decoding ranks hold for those requests (their tokens times the
    /// bytes a token takes on every rank that holds KV): what the transfers had to move.
    pub kv_bytes_needed: u64,
}
