//! A channel's UCX worker as its sessions and data paths use it: the owner thread
//! ([`UcxThread`]), the local regions registered with it, and per session the peer's regions
//! imported through its endpoint ([`UcxRoute`]).
//!
//! A local region is registered once per channel (UCX keys a registration by memory, and the
//! backend by region id) and counted: once per session that granted it to its peer, and once
//! when it served as the source or destination of our own batches. It is revoked when the
//! last session let it go and it serves no batch of ours any longer (it never did, or it was
//! deregistered: [`UcxChannel::deregistered`]), or when it is detached
//! ([`UcxChannel::revoke_now`]). The worker unmaps a revoked registration once the
//! operations still running on it ended.

use crate::dir::Dir;
use crate::error::Error;
use crate::region::{LocalSlice, Region};
use crate::transport::one_sided::{BatchRef, OneSided, Outcome, Posted};
use crate::transport::one_sided_engine::{OneSidedError, RangeOp};
use crate::transport::range_merge::merge_adjacent;
use crate::transport::ucx_thread::UcxThread;
use kvbridge_proto::handshake::Step;
use kvbridge_proto::msg::{ErrorCode, OpDesc};
use kvbridge_proto::route::Offer;
use kvbridge_proto::RegionId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// One local region registered with the worker.
struct Registered {
    descriptor: Vec<u8>,
    /// Sessions that granted it to their peer over UCX.
    sessions: usize,
    /// It served our own batches (kept until detached or the channel ends).
    local_use: bool,
}

/// The channel's worker and the local regions registered with it.
#[derive(Debug)]
pub(crate) struct UcxChannel {
    thread: UcxThread,
    registered: tokio::sync::Mutex<HashMap<RegionId, Registered>>,
    /// Batches of ours the worker carried to the end (`Stats::ucx_batches`).
    batches: AtomicU64,
}

impl std::fmt::Debug for Registered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registered")
            .field("sessions", &self.sessions)
            .field("local_use", &self.local_use)
            .finish_non_exhaustive()
    }
}

impl UcxChannel {
    /// Starts the channel's worker thread; UCX reads `UCX_TLS` and `UCX_NET_DEVICES` itself
    /// unless `tls` pins the transports.
    pub(crate) fn start(name: &str, tls: Option<&str>) -> Result<Self, OneSidedError> {
        Ok(Self {
            thread: UcxThread::start(name, tls)?,
            registered: Default::default(),
            batches: AtomicU64::new(0),
        })
    }

    /// How many of our batches the worker carried to the end.
    pub(crate) fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// The thread that owns the worker.
    pub(crate) fn thread(&self) -> &UcxThread {
        &self.thread
    }

    async fn register(&self, region: &Region, session: bool) -> Result<Vec<u8>, OneSidedError> {
        let mut reg = self.registered.lock().await;
        if let Some(r) = reg.get_mut(&region.id()) {
            if session {
                r.sessions += 1;
            } else {
                r.local_use = true;
            }
            return Ok(r.descriptor.clone());
        }
        let descriptor = self.thread.export(region).await?;
        reg.insert(
            region.id(),
            Registered {
                descriptor: descriptor.clone(),
                sessions: usize::from(session),
                local_use: !session,
            },
        );
        Ok(descriptor)
    }

    /// Registers `region` for one session's peer; returns its packed key.
    pub(crate) async fn export_for_session(
        &self,
        region: &Region,
    ) -> Result<Vec<u8>, OneSidedError> {
        self.register(region, true).await
    }

    /// One session no longer grants region `id` over UCX (its peer released the key, or the
    /// session ended).
    pub(crate) async fn unexport_for_session(&self, id: RegionId) {
        let mut reg = self.registered.lock().await;
        let Some(r) = reg.get_mut(&id) else {
            return;
        };
        r.sessions = r.sessions.saturating_sub(1);
        if r.sessions == 0 && !r.local_use {
            reg.remove(&id);
            if let Err(e) = self.thread.revoke(id).await {
                tracing::warn!(region = %id, error = %e, "UCX revoke failed");
            }
        }
    }

    /// Region `id` was deregistered: it serves no more batches of ours, and its registration
    /// goes as soon as no session grants it (at once when none does).
    pub(crate) async fn deregistered(&self, id: RegionId) {
        let mut reg = self.registered.lock().await;
        let Some(r) = reg.get_mut(&id) else {
            return;
        };
        r.local_use = false;
        if r.sessions == 0 {
            reg.remove(&id);
            if let Err(e) = self.thread.revoke(id).await {
                tracing::warn!(region = %id, error = %e, "UCX revoke failed");
            }
        }
    }

    /// Whether region `id` is registered with the worker (tests).
    #[cfg(test)]
    async fn is_registered(&self, id: RegionId) -> bool {
        self.registered.lock().await.contains_key(&id)
    }

    /// Revokes region `id`'s registration whatever uses it: its pages are about to be
    /// replaced (`Region::detach`). The worker keeps the registration until the operations
    /// still running on it ended.
    pub(crate) async fn revoke_now(&self, id: RegionId) {
        let mut reg = self.registered.lock().await;
        if reg.remove(&id).is_some() {
            if let Err(e) = self.thread.revoke(id).await {
                tracing::warn!(region = %id, error = %e, "UCX revoke failed");
            }
        }
    }
}

/// One session's way to its peer's regions over UCX (initiator side): the regions whose key
/// was unpacked on the endpoint, with their lengths.
#[derive(Debug)]
pub(crate) struct UcxRoute {
    channel: Arc<UcxChannel>,
    peer: String,
    regions: RwLock<HashMap<RegionId, u64>>,
}

impl UcxRoute {
    /// The route to `peer` through `channel`'s worker; no region yet.
    pub(crate) fn new(channel: Arc<UcxChannel>, peer: String) -> Self {
        Self {
            channel,
            peer,
            regions: Default::default(),
        }
    }

    /// Region `id` (of `len` bytes) is imported: batches on it may use UCX.
    pub(crate) fn add(&self, id: RegionId, len: u64) {
        self.regions
            .write()
            .expect("ucx regions poisoned")
            .insert(id, len);
    }

    /// Later batches on region `id` go over TCP.
    pub(crate) fn remove(&self, id: RegionId) {
        self.regions
            .write()
            .expect("ucx regions poisoned")
            .remove(&id);
    }

    /// How many of the peer's regions are imported.
    pub(crate) fn regions(&self) -> usize {
        self.regions.read().expect("ucx regions poisoned").len()
    }

    /// Whether every region `descs` names is imported (and the batch not empty).
    pub(crate) fn covers(&self, descs: &[OpDesc]) -> bool {
        let regions = self.regions.read().expect("ucx regions poisoned");
        !descs.is_empty() && descs.iter().all(|d| regions.contains_key(&d.region))
    }

    /// Moves a batch over UCX: registers its local regions (once per channel), then posts it
    /// and waits until its bytes are in place at the peer (writes end with a flush), it
    /// failed, or `deadline` passed.
    pub(crate) async fn transfer(
        &self,
        dir: Dir,
        descs: &[OpDesc],
        locals: &[LocalSlice],
        deadline: Instant,
    ) -> Result<(), OneSidedError> {
        let mut ops = Vec::with_capacity(descs.len());
        for (d, l) in descs.iter().zip(locals) {
            let region = l.region.region();
            self.channel.register(region, false).await?;
            ops.push(RangeOp {
                local: region.id(),
                local_offset: l.offset as u64,
                remote: d.region,
                remote_offset: d.offset,
                len: d.len,
            });
        }
        // Consecutive blocks go as one operation each run (transport/range_merge.rs).
        let ops = merge_adjacent(ops);
        self.channel
            .thread
            .transfer(&self.peer, dir, ops, deadline)
            .await?;
        self.channel.batches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl OneSided for UcxRoute {
    fn name(&self) -> &'static str {
        "ucx"
    }

    fn offer(&self, _dir: Dir, descs: &[OpDesc]) -> Offer {
        Offer {
            covers: self.covers(descs),
            copies_in_caller: false,
        }
    }

    fn reaches_any(&self) -> bool {
        self.regions() > 0
    }

    /// Posts the batch on the channel's worker; it completes once its bytes are in place at
    /// the peer (a write batch after a flush).
    fn post<'a>(&'a self, b: BatchRef<'a>) -> Posted<'a> {
        Posted::Pending(Box::pin(async move {
            // A mark on the session's timeline (`session::TIMELINE`, above this layer).
            let t = std::time::Instant::now();
            let r = self
                .transfer(b.dir, b.descs, b.locals, b.until.into_std())
                .await;
            tracing::debug!(target: "kvbridge::timeline", peer = %b.peer, dir = ?b.dir,
                bytes = b.bytes, took_us = t.elapsed().as_micros() as u64, ok = r.is_ok(),
                "ucx batch");
            match r {
                Ok(()) => Outcome::Done,
                // Unmapped by the peer between the check and the post: nothing was posted.
                Err(OneSidedError::UnknownRegion { side: "remote", .. }) => Outcome::GivenBack,
                // Some operations of the batch may still land: the session ends, as it does
                // for a TCP batch that failed after it was sent.
                Err(e) => Outcome::FailedMayLand(ucx_error(b.peer.as_str(), b.dir, b.deadline, e)),
            }
        }))
    }
}

/// The engine's error for a UCX batch that failed.
fn ucx_error(peer: &str, dir: Dir, after: std::time::Duration, e: OneSidedError) -> Error {
    let step = match dir {
        Dir::Write => Step::Write,
        Dir::Read => Step::Read,
    };
    match e {
        OneSidedError::Deadline { .. } => Error::Timeout {
            peer: peer.to_string(),
            step,
            after,
        },
        OneSidedError::OutOfBounds { .. } | OneSidedError::UnknownRegion { .. } => {
            Error::Rejected {
                peer: peer.to_string(),
                step,
                code: ErrorCode::OutOfBounds,
                message: format!("UCX: {e}"),
            }
        }
        e => Error::lost(peer, step, format!("UCX: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(30), f)
            .await
            .expect("no answer within the test's bound")
    }

    /// The worker still holds a registration of `r` exactly when exporting it again is
    /// refused ("already exported").
    async fn worker_holds(ch: &UcxChannel, r: &Region) -> bool {
        match bounded(ch.thread.export(r)).await {
            Ok(_) => {
                bounded(ch.thread.revoke(r.id())).await.unwrap();
                false
            }
            Err(_) => true,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_registration_goes_when_the_last_session_and_our_own_use_let_it_go() {
        let ch = UcxChannel::start("route-test", Some("tcp")).unwrap();
        let r = Region::alloc(1 << 20, 4096).unwrap();
        // Two sessions grant it, and it served one of our batches.
        bounded(ch.export_for_session(&r)).await.unwrap();
        bounded(ch.export_for_session(&r)).await.unwrap();
        bounded(ch.register(&r, false)).await.unwrap();
        bounded(ch.unexport_for_session(r.id())).await;
        bounded(ch.unexport_for_session(r.id())).await;
        assert!(
            bounded(ch.is_registered(r.id())).await,
            "our batches still use it"
        );
        assert!(worker_holds(&ch, &r).await);
        // Deregistered: nothing uses it any longer, the worker lets it go.
        bounded(ch.deregistered(r.id())).await;
        assert!(!bounded(ch.is_registered(r.id())).await);
        assert!(
            !worker_holds(&ch, &r).await,
            "deregister left it registered"
        );

        // Deregistered while a session still grants it: it goes with that session.
        bounded(ch.export_for_session(&r)).await.unwrap();
        bounded(ch.register(&r, false)).await.unwrap();
        bounded(ch.deregistered(r.id())).await;
        assert!(worker_holds(&ch, &r).await, "a session still grants it");
        bounded(ch.unexport_for_session(r.id())).await;
        assert!(!worker_holds(&ch, &r).await);
    }
}
