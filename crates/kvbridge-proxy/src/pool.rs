//! Worker pools: the choice among admitting workers (by the pool's routing policy,
//! [`crate::routing::pool_router`]), per-decoder admission, and health state.

use std::sync::atomic::{
    AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering::Relaxed,
};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::routing::policy::Candidate;
use crate::routing::pool_router::{Chosen, PoolRouter};
use crate::routing::prompt_key::PromptKey;
use crate::routing::routed_prefixes::RoutedPrompt;

pub use crate::routing::policy::Role;

/// One worker and its live state.
#[derive(Debug)]
pub struct Worker {
    /// `host:port`.
    pub label: String,
    /// `http://host:port`.
    pub base: String,
    /// Most requests at once (0: no limit).
    pub max_requests: u32,
    /// Most estimated prompt tokens at once (0: no limit).
    pub kv_capacity_tokens: u64,
    healthy: AtomicBool,
    fails: AtomicU32,
    oks: AtomicU32,
    inflight: AtomicU64,
    tokens: AtomicU64,
    pending_prefill: AtomicU64,
    served: AtomicU64,
    /// Passive ejections so far: a health check that started before the latest one is
    /// older than the evidence that ejected the worker, so it cannot re-admit it.
    passive_ejections: AtomicU64,
    /// Ejections so far, of any kind.
    ejections: AtomicU64,
}

impl Worker {
    /// Times the worker was ejected so far: a request picked it at some count, and an
    /// ejection since then means what it holds for that request may be gone.
    pub fn ejections(&self) -> u64 {
        self.ejections.load(Relaxed)
    }
    /// Whether the worker takes requests now.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Relaxed)
    }
    /// Requests on this worker now.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Relaxed)
    }
    /// Estimated prompt tokens on this worker now.
    pub fn tokens(&self) -> u64 {
        self.tokens.load(Relaxed)
    }
    /// Prompt tokens this worker has to prefill for the requests on it now: each one's
    /// estimated prompt tokens less the leading tokens the policy knew it held when it was
    /// chosen (the routing load, [`crate::routing::policy`]).
    pub fn pending_prefill(&self) -> u64 {
        self.pending_prefill.load(Relaxed)
    }
}

/// Why no worker could be picked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PickError {
    /// Every worker of the pool is ejected.
    NoHealthy,
    /// Every healthy worker is at its admission limit.
    Full,
    /// The request alone exceeds the KV capacity of every healthy worker.
    TooLarge {
        /// Estimated prompt tokens of the request.
        tokens: u64,
        /// Largest capacity among healthy workers.
        capacity: u64,
    },
}

/// A pool of workers of one role.
#[derive(Debug)]
pub struct Pool {
    /// Prefill or decode.
    pub role: Role,
    /// The workers, in configuration order.
    pub workers: Vec<Worker>,
    lock: Mutex<()>,
    freed: Notify,
    rr: AtomicUsize,
    /// Requests waiting for a slot in this pool now.
    pub queued: AtomicI64,
    /// Health checks thresholds: failures that eject, successes that re-admit.
    thresholds: (u32, u32),
    /// The routing policy and what it knows of the workers' caches.
    pub router: PoolRouter,
}

/// A request's slot on one worker; dropping it frees the slot exactly once.
#[derive(Debug)]
pub struct Slot {
    pool: Arc<Pool>,
    idx: usize,
    tokens: u64,
    pending_prefill: u64,
    /// The worker's ejection count when it was picked.
    ejections: u64,
    cached_tokens: u64,
    /// The prompt's blocks, counted as the worker's while the request is on it and the
    /// worker prefills it itself (`kv-events`).
    routed: Option<RoutedPrompt>,
}

impl Slot {
    /// The worker holding this slot.
    pub fn worker(&self) -> &Worker {
        &self.pool.workers[self.idx]
    }
    /// Index of the worker in its pool.
    pub fn index(&self) -> usize {
        self.idx
    }
    /// The worker's [`Worker::ejections`] when it was picked (read under the pool's lock,
    /// so no ejection falls between the pick and this count).
    pub fn ejections_at_pick(&self) -> u64 {
        self.ejections
    }
    /// The prompt's leading tokens the worker held when it was chosen, as the pool's policy
    /// knows ([`Chosen::cached_tokens`]; 0 without a prompt key).
    pub fn cached_tokens(&self) -> u64 {
        self.cached_tokens
    }
    /// The worker's routing load ([`Candidate::load`]) less this request's part of it.
    pub fn load_of_others(&self) -> u64 {
        let w = self.worker();
        let pending = w.pending_prefill().saturating_sub(self.pending_prefill);
        Candidate {
            index: self.idx,
            inflight: w.inflight().saturating_sub(1),
            pending_prefill: pending,
            matched: 0,
            cached: 0,
        }
        .load()
    }
    /// The request's prompt is no prefill work of this worker's (any more): a decoder on
    /// the PD path receives its KV; a worker that answers has prefilled it.
    pub fn no_prefill_left(&mut self) {
        let w = &self.pool.workers[self.idx];
        w.pending_prefill.fetch_sub(self.pending_prefill, Relaxed);
        self.pending_prefill = 0;
    }
    /// The request goes the PD way: this decoder receives the prompt's KV from a prefiller
    /// and prefills none of it ([`Slot::no_prefill_left`]), and the prompt no longer counts
    /// as held here before the decoder's KV events say so. The KV arrives when the
    /// prefiller is done, not in the order the decoder prefills its own requests: a request
    /// sent here alone because the prompt counted as held started its prefill before that
    /// KV came, and computed what the decoder was counted as holding (a chat's next turn,
    /// a second question on a document).
    pub fn kv_from_prefiller(&mut self) {
        self.no_prefill_left();
        self.routed = None;
    }
}

/// The worker a pool's policy would choose now, and its state, without a slot taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peek {
    /// Its index in the pool.
    pub index: usize,
    /// Its routing load ([`Candidate::load`]).
    pub load: u64,
    /// The prompt's leading tokens it holds, as the policy knows.
    pub cached_tokens: u64,
}

/// The workers of a pool that admit a request, and why none might.
struct Admitting {
    cands: Vec<Candidate>,
    any_healthy: bool,
    too_large: bool,
    max_cap: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let w = &self.pool.workers[self.idx];
        w.inflight.fetch_sub(1, Relaxed);
        w.tokens.fetch_sub(self.tokens, Relaxed);
        w.pending_prefill.fetch_sub(self.pending_prefill, Relaxed);
        if self.pool.queued.load(Relaxed) > 0 {
            self.pool.freed.notify_waiters();
        }
    }
}

impl Pool {
    /// Builds a least-loaded pool; `workers` are `(host, port, max_requests,
    /// kv_capacity_tokens)`.
    pub fn new(
        role: Role,
        workers: impl IntoIterator<Item = (String, u16, u32, u64)>,
        unhealthy_after: u32,
        healthy_after: u32,
    ) -> Arc<Pool> {
        Self::routed(
            role,
            workers,
            unhealthy_after,
            healthy_after,
            PoolRouter::default(),
        )
    }

    /// Builds a pool that routes with `router`.
    pub fn routed(
        role: Role,
        workers: impl IntoIterator<Item = (String, u16, u32, u64)>,
        unhealthy_after: u32,
        healthy_after: u32,
        router: PoolRouter,
    ) -> Arc<Pool> {
        Arc::new(Pool {
            role,
            workers: workers
                .into_iter()
                .map(|(h, p, m, c)| Worker {
                    label: format!("{h}:{p}"),
                    base: format!("http://{h}:{p}"),
                    max_requests: m,
                    kv_capacity_tokens: c,
                    healthy: AtomicBool::new(true),
                    fails: AtomicU32::new(0),
                    oks: AtomicU32::new(0),
                    inflight: AtomicU64::new(0),
                    tokens: AtomicU64::new(0),
                    pending_prefill: AtomicU64::new(0),
                    served: AtomicU64::new(0),
                    passive_ejections: AtomicU64::new(0),
                    ejections: AtomicU64::new(0),
                })
                .collect(),
            lock: Mutex::new(()),
            freed: Notify::new(),
            rr: AtomicUsize::new(0),
            queued: AtomicI64::new(0),
            thresholds: (unhealthy_after.max(1), healthy_after.max(1)),
            router,
        })
    }

    /// Takes a slot on the least loaded healthy worker that admits `tokens` more, skipping
    /// the workers in `exclude` (indexes), whatever the pool's policy.
    pub fn try_pick(self: &Arc<Self>, tokens: u64, exclude: &[usize]) -> Result<Slot, PickError> {
        self.try_pick_for(tokens, exclude, None)
    }

    /// Takes a slot on the healthy worker that admits `tokens` more, skipping the workers in
    /// `exclude` (indexes), that the pool's policy chooses for `prompt` (least loaded
    /// without one).
    pub fn try_pick_for(
        self: &Arc<Self>,
        tokens: u64,
        exclude: &[usize],
        prompt: Option<&PromptKey>,
    ) -> Result<Slot, PickError> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let Admitting {
            cands,
            any_healthy,
            too_large,
            max_cap,
        } = self.admitting(tokens, exclude, self.rr.fetch_add(1, Relaxed));
        let best = match prompt {
            Some(p) => self.router.choose_scored(&cands, p),
            None => self.router.choose_unkeyed(&cands),
        };
        match best {
            Some(Chosen {
                index: i,
                cached_tokens,
            }) => {
                let routed = prompt.and_then(|p| self.router.routed(i, p));
                let w = &self.workers[i];
                w.inflight.fetch_add(1, Relaxed);
                w.tokens.fetch_add(tokens, Relaxed);
                // In the unit of `cached_tokens`: the prompt's tokens as its key counts
                // them (`tokens`, the body's bytes / 4, is well above a token-id prompt's).
                let prompt_tokens = prompt
                    .map(PromptKey::estimated_tokens)
                    .filter(|t| *t > 0)
                    .unwrap_or(tokens);
                let pending_prefill = prompt_tokens.saturating_sub(cached_tokens);
                w.pending_prefill.fetch_add(pending_prefill, Relaxed);
                w.served.fetch_add(1, Relaxed);
                Ok(Slot {
                    pool: self.clone(),
                    idx: i,
                    tokens,
                    pending_prefill,
                    ejections: w.ejections(),
                    cached_tokens,
                    routed,
                })
            }
            None if !any_healthy => Err(PickError::NoHealthy),
            None if too_large => Err(PickError::TooLarge {
                tokens,
                capacity: max_cap,
            }),
            None => Err(PickError::Full),
        }
    }

    /// The worker [`Pool::try_pick_for`] would choose now for `prompt`, with its load,
    /// without taking a slot or counting a routing decision.
    pub fn peek_for(&self, tokens: u64, prompt: Option<&PromptKey>) -> Option<Peek> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        // The rotation where the next pick starts, not advanced: a peek is no pick.
        let cands = self.admitting(tokens, &[], self.rr.load(Relaxed)).cands;
        let chosen = match prompt {
            Some(p) => self.router.score(&cands, p).0,
            None => crate::routing::policy::least_loaded(&cands).map(|index| Chosen {
                index,
                cached_tokens: 0,
            }),
        }?;
        let c = cands.iter().find(|c| c.index == chosen.index)?;
        Some(Peek {
            index: chosen.index,
            load: c.load(),
            cached_tokens: chosen.cached_tokens,
        })
    }

    /// The healthy workers outside `exclude` that admit `tokens` more, in the pool's
    /// rotating order from `start`. Called under the pool's lock.
    fn admitting(&self, tokens: u64, exclude: &[usize], start: usize) -> Admitting {
        let n = self.workers.len();
        let mut cands = Vec::with_capacity(n);
        let mut any_healthy = false;
        let mut max_cap = 0u64;
        let mut too_large = true;
        for k in 0..n {
            let i = (start + k) % n;
            let w = &self.workers[i];
            if !w.is_healthy() || exclude.contains(&i) {
                continue;
            }
            any_healthy = true;
            if w.kv_capacity_tokens == 0 || tokens <= w.kv_capacity_tokens {
                too_large = false;
            }
            max_cap = max_cap.max(w.kv_capacity_tokens);
            let inflight = w.inflight();
            let used = w.tokens();
            if w.max_requests > 0 && inflight >= w.max_requests as u64 {
                continue;
            }
            // An idle worker always admits a request that fits its capacity at all.
            if w.kv_capacity_tokens > 0 && used + tokens > w.kv_capacity_tokens && inflight > 0 {
                continue;
            }
            if w.kv_capacity_tokens > 0 && tokens > w.kv_capacity_tokens {
                continue;
            }
            cands.push(Candidate {
                index: i,
                inflight,
                pending_prefill: w.pending_prefill(),
                matched: 0,
                cached: 0,
            });
        }
        Admitting {
            cands,
            any_healthy,
            too_large,
            max_cap,
        }
    }

    /// Like [`Pool::try_pick`], but waits up to `timeout` for a slot while the pool is full,
    /// unless `max_queue` requests are already waiting. Waiting requests are counted in
    /// `queued` and in the `queue_gauge`.
    pub async fn pick(
        self: &Arc<Self>,
        tokens: u64,
        max_queue: usize,
        timeout: std::time::Duration,
        queue_gauge: &AtomicI64,
    ) -> Result<Slot, PickError> {
        self.pick_for(tokens, max_queue, timeout, queue_gauge, None)
            .await
    }

    /// [`Pool::pick`] by the pool's policy for `prompt` ([`Pool::try_pick_for`]).
    pub async fn pick_for(
        self: &Arc<Self>,
        tokens: u64,
        max_queue: usize,
        timeout: std::time::Duration,
        queue_gauge: &AtomicI64,
        prompt: Option<&PromptKey>,
    ) -> Result<Slot, PickError> {
        match self.try_pick_for(tokens, &[], prompt) {
            Err(PickError::Full) => {}
            other => return other,
        }
        if timeout.is_zero() || self.queued.load(Relaxed) >= max_queue as i64 {
            return Err(PickError::Full);
        }
        struct Queued<'a>(&'a AtomicI64, &'a AtomicI64);
        impl Drop for Queued<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Relaxed);
                self.1.fetch_sub(1, Relaxed);
            }
        }
        self.queued.fetch_add(1, Relaxed);
        queue_gauge.fetch_add(1, Relaxed);
        let _q = Queued(&self.queued, queue_gauge);
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_pick_for(tokens, &[], prompt) {
                Err(PickError::Full) => {}
                other => return other,
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.try_pick_for(tokens, &[], prompt);
            }
        }
    }

    /// Records a health-check result (or a passive failure: a refused connection counts as
    /// enough failures to eject at once). Returns true when the health state changed.
    pub fn report(&self, idx: usize, ok: bool, passive: bool) -> bool {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        self.apply(idx, ok, passive)
    }

    /// What a health check of worker `idx` notes before it starts, for
    /// [`Pool::report_check`].
    pub fn check_started(&self, idx: usize) -> u64 {
        self.workers
            .get(idx)
            .map_or(0, |w| w.passive_ejections.load(Relaxed))
    }

    /// Records the result of a health check that began when [`Pool::check_started`] returned
    /// `started`. A pass is ignored if the worker was passively ejected since: the check
    /// probed the worker before that evidence (and may not probe what failed: it connects to a
    /// decoder's KV init ports but makes no handshake there). Returns true when the health
    /// state changed.
    pub fn report_check(&self, idx: usize, ok: bool, started: u64) -> bool {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if ok && self.check_started(idx) != started {
            return false;
        }
        self.apply(idx, ok, false)
    }

    /// [`Pool::report`] under the pool's lock (so a stale check and an ejection cannot
    /// interleave).
    fn apply(&self, idx: usize, ok: bool, passive: bool) -> bool {
        let Some(w) = self.workers.get(idx) else {
            return false;
        };
        let (down_after, up_after) = self.thresholds;
        if ok {
            w.fails.store(0, Relaxed);
            let oks = w.oks.fetch_add(1, Relaxed) + 1;
            if !w.is_healthy() && oks >= up_after {
                w.healthy.store(true, Relaxed);
                tracing::info!(role = self.role.as_str(), worker = %w.label, "worker re-admitted");
                self.freed.notify_waiters();
                return true;
            }
        } else {
            w.oks.store(0, Relaxed);
            let fails = if passive {
                w.passive_ejections.fetch_add(1, Relaxed);
                down_after
            } else {
                w.fails.fetch_add(1, Relaxed) + 1
            };
            if w.is_healthy() && fails >= down_after {
                w.healthy.store(false, Relaxed);
                w.ejections.fetch_add(1, Relaxed);
                // It may come back restarted, its cache empty.
                self.router.forget(idx);
                tracing::warn!(role = self.role.as_str(), worker = %w.label, passive, "worker ejected");
                return true;
            }
        }
        false
    }

    /// Number of healthy workers.
    pub fn healthy_count(&self) -> usize {
        self.workers.iter().filter(|w| w.is_healthy()).count()
    }

    /// Appends this pool's per-worker lines to a `/metrics` text.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let role = self.role.as_str();
        for (name, help, kind) in [
            (
                "worker_healthy",
                "1 when the worker takes requests.",
                "gauge",
            ),
            ("worker_inflight", "Requests on the worker now.", "gauge"),
            (
                "worker_inflight_tokens",
                "Estimated prompt tokens on the worker now.",
                "gauge",
            ),
            (
                "worker_pending_prefill_tokens",
                "Prompt tokens the worker has to prefill for its requests now, as the routing policy knows (its load).",
                "gauge",
            ),
            (
                "worker_requests_total",
                "Requests routed to the worker.",
                "counter",
            ),
        ] {
            if self.role == Role::Prefill {
                let _ = writeln!(
                    out,
                    "# HELP kvbridge_proxy_{name} {help}\n# TYPE kvbridge_proxy_{name} {kind}"
                );
            }
            for w in &self.workers {
                let v = match name {
                    "worker_healthy" => w.is_healthy() as u64,
                    "worker_inflight" => w.inflight(),
                    "worker_inflight_tokens" => w.tokens(),
                    "worker_pending_prefill_tokens" => w.pending_prefill(),
                    _ => w.served.load(Relaxed),
                };
                let _ = writeln!(
                    out,
                    "kvbridge_proxy_{name}{{role=\"{role}\",worker=\"{}\"}} {v}",
                    w.label
                );
            }
        }
        self.render_kv_events(out);
    }

    /// The KV-events subscribers' counters and each worker's indexed blocks (`kv-events`
    /// pools only; HELP and TYPE with the prefill pool's lines, as for the lines above).
    fn render_kv_events(&self, out: &mut String) {
        use std::fmt::Write as _;
        let (Some(subs), Some(index)) = (&self.router.subscribers, &self.router.index) else {
            return;
        };
        let role = self.role.as_str();
        let st = &subs.stats;
        for (name, help, v) in [
            (
                "connects",
                "Connections made to workers' KV-events endpoints.",
                &st.connects,
            ),
            ("batches", "KV-events batches applied.", &st.batches),
            (
                "gaps",
                "Batches after a sequence gap (the worker's view was dropped first).",
                &st.gaps,
            ),
            (
                "restarts",
                "Batches whose sequence went back: a restarted worker (view dropped).",
                &st.restarts,
            ),
            (
                "bad",
                "Messages that were not a decodable batch (view dropped).",
                &st.bad,
            ),
            (
                "disconnects",
                "KV-events connections that failed or ended (view dropped).",
                &st.disconnects,
            ),
        ] {
            if self.role == Role::Prefill {
                let _ = writeln!(
                    out,
                    "# HELP kvbridge_proxy_kv_events_{name}_total {help}\n# TYPE kvbridge_proxy_kv_events_{name}_total counter"
                );
            }
            let _ = writeln!(
                out,
                "kvbridge_proxy_kv_events_{name}_total{{role=\"{role}\"}} {}",
                v.load(Relaxed)
            );
        }
        if self.role == Role::Prefill {
            let _ = writeln!(
                out,
                "# HELP kvbridge_proxy_kv_events_blocks Blocks the proxy knows the worker holds.\n# TYPE kvbridge_proxy_kv_events_blocks gauge"
            );
        }
        for (i, w) in self.workers.iter().enumerate() {
            let _ = writeln!(
                out,
                "kvbridge_proxy_kv_events_blocks{{role=\"{role}\",worker=\"{}\"}} {}",
                w.label,
                index.blocks(i)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pool(n: usize, max: u32, cap: u64) -> Arc<Pool> {
        Pool::new(
            Role::Decode,
            (0..n).map(|i| ("h".to_string(), i as u16, max, cap)),
            2,
            1,
        )
    }

    #[test]
    fn least_loaded_by_tokens_and_requests() {
        let p = pool(2, 0, 0);
        let a = p.try_pick(1000, &[]).unwrap();
        let b = p.try_pick(10, &[]).unwrap();
        assert_ne!(a.index(), b.index());
        let c = p.try_pick(10, &[]).unwrap();
        assert_eq!(c.index(), b.index(), "the worker with fewer tokens");
        assert_eq!(
            p.router
                .decisions(crate::routing::RoutingPolicy::LeastLoaded, false),
            3,
            "every choice is counted, also without a prompt"
        );
        drop((a, b, c));
        assert!(p
            .workers
            .iter()
            .all(|w| w.inflight() == 0 && w.tokens() == 0));
    }

    #[test]
    fn admission_by_requests_and_capacity() {
        let p = pool(1, 2, 100);
        let a = p.try_pick(60, &[]).unwrap();
        assert_eq!(p.try_pick(60, &[]).unwrap_err(), PickError::Full);
        let b = p.try_pick(40, &[]).unwrap();
        assert_eq!(p.try_pick(1, &[]).unwrap_err(), PickError::Full);
        assert_eq!(
            p.try_pick(101, &[]).unwrap_err(),
            PickError::TooLarge {
                tokens: 101,
                capacity: 100
            }
        );
        drop((a, b));
        assert!(p.try_pick(100, &[]).is_ok());
    }

    #[test]
    fn ejection_and_readmission() {
        let p = pool(2, 0, 0);
        assert!(!p.report(0, false, false), "one failure is not enough");
        assert!(p.report(0, false, false));
        assert!(
            p.report(1, false, true),
            "a refused connection ejects at once"
        );
        assert_eq!(p.try_pick(1, &[]).unwrap_err(), PickError::NoHealthy);
        assert!(p.report(1, true, false));
        assert_eq!(p.try_pick(1, &[]).unwrap().index(), 1);
        assert_eq!(p.try_pick(1, &[1]).unwrap_err(), PickError::NoHealthy);
    }

    #[test]
    fn a_check_older_than_a_passive_ejection_does_not_readmit() {
        let p = pool(1, 0, 0);
        let started = p.check_started(0);
        assert!(p.report(0, false, true), "passive ejection");
        assert!(!p.report_check(0, true, started), "stale pass ignored");
        assert_eq!(p.try_pick(1, &[]).unwrap_err(), PickError::NoHealthy);
        let fresh = p.check_started(0);
        assert!(p.report_check(0, true, fresh), "a later check re-admits");
        assert_eq!(p.try_pick(1, &[]).unwrap().index(), 0);
    }

    #[tokio::test]
    async fn queued_pick_gets_the_freed_slot_or_times_out() {
        let p = pool(1, 1, 0);
        let g = AtomicI64::new(0);
        let a = p.try_pick(1, &[]).unwrap();
        let t = std::time::Instant::now();
        assert_eq!(
            p.pick(1, 10, Duration::from_millis(50), &g)
                .await
                .unwrap_err(),
            PickError::Full
        );
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert_eq!(
            p.pick(1, 0, Duration::from_secs(5), &g).await.unwrap_err(),
            PickError::Full,
            "queue of 0"
        );
        let p2 = p.clone();
        let waiter = tokio::spawn(async move {
            let g = AtomicI64::new(0);
            p2.pick(1, 10, Duration::from_secs(10), &g)
                .await
                .map(|s| s.index())
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while p.queued.load(Relaxed) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter never queued"
            );
            tokio::task::yield_now().await;
        }
        drop(a);
        assert_eq!(
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .unwrap()
                .unwrap(),
            Ok(0)
        );
        assert_eq!(p.queued.load(Relaxed), 0);
        assert_eq!(g.load(Relaxed), 0);
    }

    fn routed_pool(router: PoolRouter) -> Arc<Pool> {
        Pool::routed(
            Role::Prefill,
            (0..3).map(|i| ("h".to_string(), i as u16, 0, 0)),
            2,
            1,
            router,
        )
    }

    /// A kv-events pool of 3 workers noting what it routes, every worker having reported a
    /// 32-token system prompt (blocks of 16), and its index.
    fn kv_events_pool_with_system_prompt() -> (Arc<Pool>, Arc<crate::routing::kv_index::KvIndex>) {
        let index = Arc::new(crate::routing::kv_index::KvIndex::new(3, 1000));
        let p = routed_pool(PoolRouter {
            policy: crate::routing::RoutingPolicy::KvEvents,
            index: Some(index.clone()),
            routed: Some(Arc::new(
                crate::routing::routed_prefixes::RoutedPrefixes::new(3),
            )),
            ..Default::default()
        });
        let system: Vec<u32> = (0..32).collect();
        for w in 0..3 {
            index.apply(w, 0, &stored(&system));
        }
        (p, index)
    }

    /// Question `q` about a 2000-token document that follows the system prompt; no worker
    /// has reported the document.
    fn ask(q: u32) -> PromptKey {
        PromptKey {
            tokens: Some((0..2000).chain([q; 10]).collect()),
            pieces: vec![],
        }
    }

    /// A worker's KV event: it stored `tokens` in blocks of 16.
    fn stored(tokens: &[u32]) -> kvbridge_proto::kv_events::KvEventBatch {
        use kvbridge_proto::kv_events::{BlockHash, BlockStored, KvEvent, KvEventBatch};
        KvEventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: (0..tokens.len() as i128 / 16).map(BlockHash::Int).collect(),
                parent_block_hash: None,
                token_ids: tokens.to_vec(),
                block_size: 16,
                lora_id: None,
                medium: None,
                lora_name: None,
                group_idx: None,
            })],
            data_parallel_rank: None,
        }
    }

    #[test]
    fn kv_events_routes_to_the_holder_and_forgets_an_ejected_worker() {
        use crate::routing::kv_index::KvIndex;
        let index = Arc::new(KvIndex::new(3, 100));
        let p = routed_pool(PoolRouter {
            policy: crate::routing::RoutingPolicy::KvEvents,
            index: Some(index.clone()),
            // The figures below weigh a token to prefill as a token of load.
            weights: crate::routing::policy::KvEventsWeights::EQUAL,
            ..Default::default()
        });
        let tokens: Vec<u32> = (0..64).collect();
        let batch = stored(&tokens);
        index.apply(2, 0, &batch);
        let key = PromptKey {
            tokens: Some(tokens.clone()),
            pieces: vec![],
        };
        for _ in 0..3 {
            let s = p.try_pick_for(64, &[], Some(&key)).unwrap();
            assert_eq!(s.index(), 2, "the worker holding the prefix");
        }
        // Loaded enough, it loses to an idle worker: 0 + 1024 + 256 > 64.
        let busy = p.try_pick_for(1024, &[], Some(&key)).unwrap();
        assert_eq!(busy.index(), 2);
        assert_ne!(p.try_pick_for(64, &[], Some(&key)).unwrap().index(), 2);
        drop(busy);
        assert!(p.report(2, false, true), "ejected");
        assert_eq!(index.blocks(2), 0, "its blocks are not trusted after");
        assert!(p.report(2, true, false));
        assert_eq!(index.matched_tokens(2, &tokens), 0);
    }

    #[test]
    fn a_held_prefix_is_not_load_so_its_holder_keeps_the_requests_that_share_it() {
        use crate::routing::kv_index::KvIndex;
        let index = Arc::new(KvIndex::new(3, 1000));
        let p = routed_pool(PoolRouter {
            policy: crate::routing::RoutingPolicy::KvEvents,
            index: Some(index.clone()),
            // The figures below weigh a token to prefill as a token of load.
            weights: crate::routing::policy::KvEventsWeights::EQUAL,
            ..Default::default()
        });
        // Worker 1 holds the first 960 tokens of a 1000-token prompt.
        let tokens: Vec<u32> = (0..1000).collect();
        let batch = stored(&tokens[..960]);
        index.apply(1, 0, &batch);
        let key = PromptKey {
            tokens: Some(tokens),
            pieces: vec![],
        };
        // With two in flight, the third costs it 40 + 2 * (40 + 256) = 632 < 1000 on an idle
        // worker. Counting their whole prompts as load sent the second away (40 + 1256).
        let held: Vec<Slot> = (0..3)
            .map(|_| p.try_pick_for(1000, &[], Some(&key)).unwrap())
            .collect();
        assert!(held.iter().all(|s| s.index() == 1), "the holder");
        assert_eq!(p.workers[1].pending_prefill(), 3 * 40);
        assert_eq!(
            p.workers[1].tokens(),
            3 * 1000,
            "admission still counts the prompt"
        );
        drop(held);
        assert_eq!(p.workers[1].pending_prefill(), 0);
    }

    #[test]
    fn a_peek_is_the_next_pick_and_pending_prefill_is_the_prompts_uncached_tokens() {
        use crate::routing::kv_index::KvIndex;
        use crate::routing::RoutingPolicy::KvEvents;
        let index = Arc::new(KvIndex::new(3, 1000));
        let p = routed_pool(PoolRouter {
            policy: KvEvents,
            index: Some(index.clone()),
            // The figures below weigh a token to prefill as a token of load.
            weights: crate::routing::policy::KvEventsWeights::EQUAL,
            ..Default::default()
        });
        let tokens: Vec<u32> = (0..1000).collect();
        index.apply(1, 0, &stored(&tokens[..512]));
        let key = PromptKey {
            tokens: Some(tokens),
            pieces: vec![],
        };
        // The body of a 1000-token prompt of ids is some 5000 bytes, 1250 `tokens`; the
        // work left on the holder is 1000 - 512 tokens, not 1250 - 512.
        let peek = p.peek_for(1250, Some(&key)).unwrap();
        assert_eq!((peek.index, peek.load, peek.cached_tokens), (1, 0, 512));
        assert_eq!(
            p.router.decisions(KvEvents, true),
            0,
            "a peek is not counted"
        );
        let mut s = p.try_pick_for(1250, &[], Some(&key)).unwrap();
        assert_eq!(s.index(), peek.index);
        assert_eq!(p.workers[1].pending_prefill(), 488);
        assert_eq!(p.workers[1].tokens(), 1250, "admission counts the body");
        assert_eq!(s.load_of_others(), 0);
        // Loaded (488 + 256 + 488 > 1000), the holder loses the next one to an idle worker.
        let peek = p.peek_for(1250, Some(&key)).unwrap();
        assert_ne!(peek.index, 1);
        assert_eq!((peek.load, peek.cached_tokens), (0, 0));
        // A decoder on the PD path receives the KV: no prefill work of its own.
        s.no_prefill_left();
        assert_eq!(p.workers[1].pending_prefill(), 0);
        drop(s);
        assert_eq!(p.workers[1].pending_prefill(), 0);
        // Ties: the peek starts where the next pick does, and does not move it.
        let none = PromptKey {
            tokens: Some(vec![7; 300]),
            pieces: vec![],
        };
        for _ in 0..4 {
            let peek = p.peek_for(10, Some(&none)).unwrap();
            assert_eq!(
                p.try_pick_for(10, &[], Some(&none)).unwrap().index(),
                peek.index
            );
        }
    }

    #[test]
    fn a_prompt_on_a_worker_counts_as_held_there_until_its_slot_is_released() {
        let (p, _index) = kv_events_pool_with_system_prompt();
        let mut first = p.try_pick_for(10, &[], Some(&ask(1))).unwrap();
        // Its first token out: the worker prefilled it, and its events may not say so yet.
        first.no_prefill_left();
        let peek = p.peek_for(10, Some(&ask(2))).unwrap();
        assert_eq!(
            (peek.index, peek.cached_tokens),
            (first.index(), 2000),
            "the worker the first question went to will hold the document"
        );
        let second = p.try_pick_for(10, &[], Some(&ask(2))).unwrap();
        assert_eq!(second.index(), first.index());
        assert_eq!(p.workers[second.index()].pending_prefill(), 10);
        let w = first.index();
        drop((first, second));
        // Released without the worker reporting the document: only the system prompt.
        assert_eq!(p.peek_for(10, Some(&ask(3))).unwrap().cached_tokens, 32);
        // Forgotten with the worker's view (an ejection).
        let again = p.try_pick_for(10, &[], Some(&ask(4))).unwrap();
        p.router.forget(again.index());
        assert_eq!(p.router.routed.as_ref().unwrap().blocks(again.index()), 0);
        let _ = w;
    }

    #[test]
    fn a_decoder_on_the_pd_path_is_not_counted_as_holding_the_prompt_before_its_kv_came() {
        let (p, index) = kv_events_pool_with_system_prompt();
        // The first question goes the PD way: its KV comes when the prefiller is done, and
        // a request this decoder prefilled alone meanwhile would find only the system
        // prompt. Counted as held, the second question went to it alone and computed the
        // document again.
        let mut first = p.try_pick_for(10, &[], Some(&ask(1))).unwrap();
        first.kv_from_prefiller();
        assert_eq!(p.workers[first.index()].pending_prefill(), 0);
        let peek = p.peek_for(10, Some(&ask(2))).unwrap();
        assert_eq!(peek.cached_tokens, 32, "only what its events report");
        assert_eq!(
            p.router.routed.as_ref().unwrap().blocks(first.index()),
            0,
            "its note dropped"
        );
        // Once its events report the document, it holds it.
        index.apply(first.index(), 1, &stored(&(0..2000).collect::<Vec<u32>>()));
        let peek = p.peek_for(10, Some(&ask(2))).unwrap();
        assert_eq!((peek.index, peek.cached_tokens), (first.index(), 2000));
        // A request it prefills itself still counts as held until its slot is released.
        let alone = p.try_pick_for(10, &[], Some(&ask(3))).unwrap();
        assert!(p.router.routed.as_ref().unwrap().blocks(alone.index()) > 0);
        drop((first, alone));
    }

    #[test]
    fn a_cold_worker_is_counted_as_holding_the_prefix_every_prompt_shares() {
        use crate::routing::kv_index::KvIndex;
        use crate::routing::RoutingPolicy::KvEvents;
        let index = Arc::new(KvIndex::new(3, 1000));
        let p = routed_pool(PoolRouter {
            policy: KvEvents,
            index: Some(index.clone()),
            ..Default::default()
        });
        // Worker 0 holds the system prompt (32 tokens) and document A; 1 and 2 are cold.
        let system: Vec<u32> = (0..32).collect();
        let doc = |d: u32| -> Vec<u32> { system.iter().copied().chain([d; 32]).collect() };
        index.apply(0, 0, &stored(&doc(100)));
        let ask = |d: u32| PromptKey {
            tokens: Some(doc(d).into_iter().chain([7; 16]).collect()),
            pieces: vec![],
        };
        // A question on A goes to its holder, asked twice (a repeated prompt is no common
        // prefix).
        for _ in 0..2 {
            assert_eq!(p.try_pick_for(10, &[], Some(&ask(100))).unwrap().index(), 0);
        }
        // Document B, idle workers: all three hold the system prompt as far as cost goes,
        // and a cold one has the most room.
        let b = p.try_pick_for(10, &[], Some(&ask(200))).unwrap();
        assert_ne!(b.index(), 0, "a cold worker, not the one holding A");
        assert_eq!(
            b.cached_tokens(),
            0,
            "it computes the system prompt this once"
        );
        drop(b);
        // A still goes to its holder.
        assert_eq!(p.try_pick_for(10, &[], Some(&ask(100))).unwrap().index(), 0);
    }

    #[test]
    fn cache_aware_sends_a_repeated_prefix_to_the_same_worker() {
        let p = routed_pool(PoolRouter {
            policy: crate::routing::RoutingPolicy::CacheAware,
            trees: Some(crate::routing::prefix_tree::PrefixTrees::new(3, 1000)),
            ..Default::default()
        });
        let doc =
            |tail: &str| PromptKey::from_raw(Some(&format!("{}{tail}", "shared ".repeat(40))));
        let first = p.try_pick_for(10, &[], Some(&doc("a"))).unwrap().index();
        for t in ["b", "c", "d"] {
            assert_eq!(
                p.try_pick_for(10, &[], Some(&doc(t))).unwrap().index(),
                first
            );
        }
        // Another document goes to the worker with the smallest tree, not `first`.
        let other = PromptKey::from_raw(Some(&"other ".repeat(40)));
        assert_ne!(
            p.try_pick_for(10, &[], Some(&other)).unwrap().index(),
            first
        );
    }
}
