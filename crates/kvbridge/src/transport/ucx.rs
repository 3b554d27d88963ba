//! UCX behind the one-sided seam ([`OneSidedEngine`]): one UCX worker per channel, owned by the one
//! thread that drives it (its event fd says when there is something to do, so an idle worker
//! costs no CPU). Local regions are registered in place (`ucp_mem_map` of the region's own
//! memory), writes and reads are `ucp_put_nbx`/`ucp_get_nbx` straight from and into them,
//! and a write batch completes only after a flush of the peer's endpoint, i.e. once its
//! bytes are in place at the peer.
//!
//! Which UCX transports run (tcp, shared memory, RDMA verbs) is UCX's choice under `UCX_TLS`
//! and `UCX_NET_DEVICES`; nothing here depends on it.

use crate::dir::Dir;
use crate::region::Region;
use crate::transport::one_sided_engine::{OneSidedEngine, OneSidedError, OneSidedStep, RangeOp};
use kvbridge_proto::RegionId;
use kvbridge_ucx::wire::RegionDescriptor;
use kvbridge_ucx::{Context, ContextConfig, EpId, MemRegion, OpId, Prefer, RkeyId, Worker};
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// A peer this worker reaches, and the regions of it imported.
struct UcxPeer {
    ep: EpId,
    regions: HashMap<RegionId, Imported>,
}

/// A peer's region: the key unpacked through the peer's endpoint, and its length.
struct Imported {
    rkey: RkeyId,
    len: u64,
}

/// A batch posted on a [`UcxBackend`] and not yet completed.
#[derive(Debug)]
pub(crate) struct UcxPosted {
    peer: String,
    /// Operations not seen complete yet.
    ops: Vec<OpId>,
    /// The flush that completes a write batch at the peer (posted after its writes).
    flush: Option<OpId>,
}

impl UcxPosted {
    /// The peer the batch goes to.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }
}

/// The UCX backend of one channel.
pub(crate) struct UcxBackend {
    // Field order is drop order: the worker (and with it every endpoint, key and operation)
    // before the regions it used, the context last.
    worker: Worker,
    /// Every exported region: its registration, and the region itself, which keeps its
    /// memory mapped while the registration lives.
    local: HashMap<RegionId, (MemRegion, Region)>,
    /// Revoked regions whose operations may still run: kept until the worker has none.
    retired: Vec<(MemRegion, Region)>,
    peers: HashMap<String, UcxPeer>,
    /// Whether the transports allowed (`UCX_TLS`) may include shared memory or cross-memory
    /// attach: if not, a same-host endpoint has nothing to prefer over failure detection.
    shared_memory: bool,
    ctx: Context,
}

impl std::fmt::Debug for UcxBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxBackend")
            .field("local", &self.local.len())
            .field("peers", &self.peers.len())
            .finish()
    }
}

/// Whether `UCX_TLS` (`tls`, else the environment's) may let UCX pick a shared-memory or
/// cross-memory-attach transport: unset, `all`, an exclusion list (`^...`) that leaves one,
/// or a list naming one of them or one of their aliases. In doubt, yes.
fn may_use_shared_memory(tls: Option<&str>) -> bool {
    const SHARED: [&str; 8] = ["sm", "shm", "mm", "posix", "sysv", "cma", "xpmem", "knem"];
    let tls = ContextConfig {
        tls: tls.map(str::to_string),
        net_devices: None,
    }
    .effective_tls();
    kvbridge_ucx::reach::may_open_any(tls.as_deref(), &SHARED)
}

/// The environment variables that set the segment size of UCX's shared-memory transports
/// (its `mm` family: `posix`, `sysv`, `xpmem`; `MM_` sets all three).
const MM_SEG_SIZE_VARS: [&str; 4] = [
    "UCX_MM_SEG_SIZE",
    "UCX_POSIX_SEG_SIZE",
    "UCX_SYSV_SEG_SIZE",
    "UCX_XPMEM_SEG_SIZE",
];

/// The largest shared-memory segment size UCX carries correctly. Its `mm` transports let a
/// copied active message be as long as a segment (`max_bcopy = seg_size`) but write its
/// length into the 16-bit `length` of their FIFO element (`uct_mm_fifo_element_t`): a
/// message of 65536 bytes or more arrives with its length wrapped, and UCX 1.13 aborted the
/// process on the first such read reply (`ucp_get_rep_handler`: "Assertion `frag_length >=
/// 0' failed", `UCX_SYSV_SEG_SIZE=64K` or `256K`, SIGABRT).
const MM_MAX_SEG_SIZE: u64 = u16::MAX as u64;

/// A size in UCX's notation (`ucs_str_to_memunits`): a number with an optional unit
/// `b`, `k`, `m`, `g` or `t` (powers of 1024, either case, the unit optionally followed by
/// `b`), or `inf`; `None` for `auto` and for what this does not understand (UCX's own
/// parser judges it).
fn memunits(value: &str) -> Option<u64> {
    let v = value.trim().to_ascii_lowercase();
    if v == "inf" {
        return Some(u64::MAX);
    }
    let v = v.strip_suffix('b').unwrap_or(&v);
    let digits = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let shift = match &v[digits.len()..] {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return None,
    };
    let n: u64 = digits.parse().ok()?;
    Some(n.saturating_mul(1 << shift))
}

/// Refuses a shared-memory segment size UCX cannot carry ([`MM_MAX_SEG_SIZE`]) where UCX may
/// use its shared-memory transports (`shared_memory`); `env` reads the environment.
fn check_mm_seg_sizes(
    env: impl Fn(&str) -> Option<String>,
    shared_memory: bool,
) -> Result<(), OneSidedError> {
    if !shared_memory {
        return Ok(());
    }
    for name in MM_SEG_SIZE_VARS {
        let Some(value) = env(name) else { continue };
        if memunits(&value).is_some_and(|n| n > MM_MAX_SEG_SIZE) {
            return Err(OneSidedError::Failed {
                peer: "local".to_string(),
                step: OneSidedStep::Export,
                detail: format!(
                    "{name}={value} is larger than UCX's shared-memory transports carry: they \
                     store a message's length in 16 bits, so messages of a 64 KiB segment or \
                     more arrive corrupted (UCX 1.13 aborts the process); set it to at most \
                     {MM_MAX_SEG_SIZE} bytes, or leave it unset"
                ),
            });
        }
    }
    Ok(())
}

/// A failure of `kvbridge-ucx` as a one-sided error of `step` toward `peer`.
fn ucx_error(peer: &str, step: OneSidedStep, e: kvbridge_ucx::Error) -> OneSidedError {
    match e {
        kvbridge_ucx::Error::Deadline { waited, .. } => OneSidedError::Deadline {
            peer: peer.to_string(),
            step,
            waited,
        },
        kvbridge_ucx::Error::Malformed { reason, .. } => OneSidedError::Malformed {
            peer: peer.to_string(),
            step,
            detail: reason.to_string(),
        },
        e => OneSidedError::Failed {
            peer: peer.to_string(),
            step,
            detail: e.to_string(),
        },
    }
}

impl UcxBackend {
    /// A context and a worker. `tls` pins `UCX_TLS`; `None` leaves UCX's environment
    /// (`UCX_TLS`, `UCX_NET_DEVICES`) and defaults in charge.
    pub(crate) fn new(tls: Option<&str>) -> Result<Self, OneSidedError> {
        check_mm_seg_sizes(|name| std::env::var(name).ok(), may_use_shared_memory(tls))?;
        let config = ContextConfig {
            tls: tls.map(str::to_string),
            net_devices: None,
        };
        let ctx = Context::new(&config).map_err(|e| ucx_error("local", OneSidedStep::Export, e))?;
        let worker = Worker::new(&ctx).map_err(|e| ucx_error("local", OneSidedStep::Export, e))?;
        Ok(Self {
            worker,
            local: HashMap::new(),
            retired: Vec::new(),
            peers: HashMap::new(),
            shared_memory: may_use_shared_memory(tls),
            ctx,
        })
    }

    /// The worker's event fd: readable when [`UcxBackend::wait_events`] has work to do.
    pub(crate) fn event_fd(&self) -> RawFd {
        self.worker.event_fd()
    }

    /// Progresses the worker, then sleeps on its event fd for at most `timeout` when nothing
    /// was ready. The owner of a backend that only serves peers' puts and gets (UCX's tcp
    /// transport needs the target to progress) runs this in its loop.
    pub(crate) fn wait_events(&mut self, timeout: Duration) -> Result<(), OneSidedError> {
        let r = self
            .worker
            .wait_events(timeout)
            .map_err(|e| ucx_error("local", OneSidedStep::Complete, e));
        self.reap_retired();
        r
    }

    /// Lets revoked regions go once no operation can use them any more.
    fn reap_retired(&mut self) {
        if !self.retired.is_empty() && self.worker.in_flight() == 0 {
            self.retired.clear();
        }
    }

    /// Operations UCX has not ended yet, abandoned ones included.
    // Read by this file's tests: an ended batch leaves no operation behind.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn in_flight(&self) -> usize {
        self.worker.in_flight()
    }

    /// Takes `peer` out of the table for a disconnect: its endpoint and keys are this
    /// caller's to close.
    fn take_peer(&mut self, peer: &str) -> Result<UcxPeer, OneSidedError> {
        self.peers
            .remove(peer)
            .ok_or_else(|| OneSidedError::NotConnected {
                peer: peer.to_string(),
                step: OneSidedStep::Disconnect,
            })
    }

    /// Removes `peer`'s region `id` from its table, so that no later batch resolves it;
    /// the endpoint it was imported through, and its key, still to be destroyed.
    fn take_import(&mut self, peer: &str, id: RegionId) -> Result<(EpId, Imported), OneSidedError> {
        let p = self
            .peers
            .get_mut(peer)
            .ok_or_else(|| OneSidedError::NotConnected {
                peer: peer.to_string(),
                step: OneSidedStep::Release,
            })?;
        let imported = p
            .regions
            .remove(&id)
            .ok_or_else(|| OneSidedError::UnknownRegion {
                peer: peer.to_string(),
                step: OneSidedStep::Release,
                side: "remote",
                region: id,
            })?;
        Ok((p.ep, imported))
    }

    fn peer(&self, peer: &str, step: OneSidedStep) -> Result<&UcxPeer, OneSidedError> {
        self.peers
            .get(peer)
            .ok_or_else(|| OneSidedError::NotConnected {
                peer: peer.to_string(),
                step,
            })
    }

    /// Runs UCX's progress once; how many events it handled.
    pub(crate) fn progress(&mut self) -> u32 {
        let n = self.worker.progress();
        self.reap_retired();
        n
    }

    /// Arms the worker's event fd for a sleep; `Ok(false)`: events are pending, progress
    /// instead of sleeping.
    pub(crate) fn arm(&mut self) -> Result<bool, OneSidedError> {
        self.worker
            .arm()
            .map_err(|e| ucx_error("local", OneSidedStep::Complete, e))
    }

    /// Gives up the operations of a batch that failed or passed its deadline: the worker
    /// keeps each (its memory registered) until UCX ends it.
    pub(crate) fn abandon(&mut self, posted: &mut UcxPosted) {
        let past = Instant::now();
        for op in posted.ops.drain(..).chain(posted.flush.take()) {
            // Marks a running operation abandoned, or frees an ended one; either way the
            // batch's outcome is already decided.
            let _ = self.worker.wait(op, past);
        }
    }

    /// [`OneSidedEngine::connect`] to a peer that is on this host (`same_host`: its host identity
    /// equals ours) or may not be. A same-host endpoint asks UCX for its shared-memory and
    /// cross-memory-attach transports first, which cannot report a dead peer (it shows at
    /// the operation deadlines); any other, and a same-host one where `UCX_TLS` allows none
    /// of those transports, asks for peer-failure detection first.
    pub(crate) fn connect_on_host(
        &mut self,
        peer: &str,
        address: &[u8],
        same_host: bool,
    ) -> Result<(), OneSidedError> {
        if self.peers.contains_key(peer) {
            return Err(OneSidedError::Failed {
                peer: peer.to_string(),
                step: OneSidedStep::Connect,
                detail: "already connected".to_string(),
            });
        }
        let prefer = if same_host && self.shared_memory {
            Prefer::SharedMemory
        } else {
            Prefer::FailureDetection
        };
        let ep = self
            .worker
            .connect_preferring(peer, address, prefer)
            .map_err(|e| ucx_error(peer, OneSidedStep::Connect, e))?;
        self.peers.insert(
            peer.to_string(),
            UcxPeer {
                ep,
                regions: HashMap::new(),
            },
        );
        Ok(())
    }

    /// Whether UCX reports the failure of `peer` on its endpoint.
    #[cfg(test)]
    fn detects_peer_failure(&self, peer: &str) -> Option<bool> {
        self.worker.detects_peer_failure(self.peers.get(peer)?.ep)
    }

    /// UCX's description of the endpoint to `peer` (its lanes' transports).
    #[cfg(test)]
    pub(crate) fn endpoint_info(&self, peer: &str) -> Result<String, OneSidedError> {
        let p = self.peer(peer, OneSidedStep::Connect)?;
        self.worker
            .endpoint_info(p.ep)
            .map_err(|e| ucx_error(peer, OneSidedStep::Connect, e))
    }

    /// [`OneSidedEngine::release`] without waiting: the region is gone from the peer's table and
    /// its key destroyed at once; the returned flush completes (through
    /// [`OneSidedEngine::test`]) once every operation posted on it before has ended.
    pub(crate) fn post_release(
        &mut self,
        peer: &str,
        id: RegionId,
    ) -> Result<UcxPosted, OneSidedError> {
        let (ep, imported) = self.take_import(peer, id)?;
        // Later batches no longer resolve the region (removed above); the flush ends every
        // one posted before, so the peer may unmap once it completed. Operations already
        // posted keep inside UCX what they need of the key.
        let flush = self
            .worker
            .post_flush(ep)
            .map_err(|e| ucx_error(peer, OneSidedStep::Release, e));
        let destroyed = self
            .worker
            .destroy_rkey(imported.rkey)
            .map_err(|e| ucx_error(peer, OneSidedStep::Release, e));
        let flush = flush?;
        destroyed?;
        Ok(UcxPosted {
            peer: peer.to_string(),
            ops: Vec::new(),
            flush: Some(flush),
        })
    }

    /// [`OneSidedEngine::disconnect`] without waiting: the peer, its endpoint and keys are gone
    /// at once; the returned close completes (through [`OneSidedEngine::test`]) once UCX flushed
    /// the endpoint and told the peer. Nothing waits on it here, so a close to a dead peer
    /// holds up no other batch.
    pub(crate) fn post_disconnect(&mut self, peer: &str) -> Result<UcxPosted, OneSidedError> {
        let p = self.take_peer(peer)?;
        // Closing the endpoint destroys the keys unpacked through it.
        let close = self
            .worker
            .post_close(p.ep)
            .map_err(|e| ucx_error(peer, OneSidedStep::Disconnect, e))?;
        Ok(UcxPosted {
            peer: peer.to_string(),
            ops: Vec::new(),
            flush: Some(close),
        })
    }

    /// [`UcxBackend::post_disconnect`] for a peer that ended its side: the control
    /// connection to it was closed by the peer (its session is over there, or its process
    /// died). The peer's endpoint and keys are gone at once. Where UCX cannot report the
    /// peer's failure on the endpoint (shared memory) and no read is in flight on it, the
    /// close is left to the worker and `None` returned: the close of an endpoint to a dead
    /// same-host peer never ends, and UCX 1.13 refuses to force it (`Worker::close_peer_gone`).
    /// Nothing is cancelled: writes still in flight land if the peer lives, in a session
    /// the peer itself has already ended. Otherwise the close to complete, as
    /// `post_disconnect`'s.
    pub(crate) fn post_disconnect_gone(
        &mut self,
        peer: &str,
    ) -> Result<Option<UcxPosted>, OneSidedError> {
        let p = self.take_peer(peer)?;
        let close = self
            .worker
            .close_peer_gone(p.ep)
            .map_err(|e| ucx_error(peer, OneSidedStep::Disconnect, e))?;
        Ok(close.map(|close| UcxPosted {
            peer: peer.to_string(),
            ops: Vec::new(),
            flush: Some(close),
        }))
    }

    /// [`UcxBackend::post_disconnect`] for a peer whose process the caller saw exit: the
    /// peer's endpoint and keys are gone at once, and its close and every operation on it
    /// are left to the worker (`Worker::close_peer_dead`). The caller progressed the worker
    /// until it handled nothing since it saw the exit, so whatever the peer delivered
    /// before it died has landed, and nothing more will: its batches can be answered now.
    pub(crate) fn disconnect_dead(&mut self, peer: &str) -> Result<(), OneSidedError> {
        let p = self.take_peer(peer)?;
        self.worker
            .close_peer_dead(p.ep)
            .map_err(|e| ucx_error(peer, OneSidedStep::Disconnect, e))
    }

    /// Checks one range against its two regions.
    fn check(&self, peer: &UcxPeer, name: &str, op: &RangeOp) -> Result<(), OneSidedError> {
        let out = |side, region, size| OneSidedError::OutOfBounds {
            peer: name.to_string(),
            step: OneSidedStep::Post,
            side,
            region,
            offset: if side == "local" {
                op.local_offset
            } else {
                op.remote_offset
            },
            len: op.len,
            size,
        };
        let unknown = |side, region| OneSidedError::UnknownRegion {
            peer: name.to_string(),
            step: OneSidedStep::Post,
            side,
            region,
        };
        let (local, _) = self
            .local
            .get(&op.local)
            .ok_or_else(|| unknown("local", op.local))?;
        let size = local.len() as u64;
        if !fits(op.local_offset, op.len, size) {
            return Err(out("local", op.local, size));
        }
        let remote = peer
            .regions
            .get(&op.remote)
            .ok_or_else(|| unknown("remote", op.remote))?;
        if !fits(op.remote_offset, op.len, remote.len) {
            return Err(out("remote", op.remote, remote.len));
        }
        Ok(())
    }
}

/// Whether `offset..+len` lies inside `size` bytes.
fn fits(offset: u64, len: u64, size: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= size)
}

impl OneSidedEngine for UcxBackend {
    type Posted = UcxPosted;

    fn export(&mut self, region: &Region) -> Result<Vec<u8>, OneSidedError> {
        let e = |e| ucx_error("local", OneSidedStep::Export, e);
        if self.local.contains_key(&region.id()) {
            return Err(OneSidedError::Failed {
                peer: "local".to_string(),
                step: OneSidedStep::Export,
                detail: format!("region {} is already exported", region.id()),
            });
        }
        // SAFETY: the region's memory stays mapped while a clone of it lives; the backend
        // keeps one beside the registration, and after `revoke` until the worker has no
        // operation left (`retired`). Peers writing it at any time is what a region is for.
        let mem = unsafe { MemRegion::map_existing(&self.ctx, region.as_ptr(), region.len()) }
            .map_err(e)?;
        let descriptor = mem.descriptor().map_err(e)?;
        self.local.insert(region.id(), (mem, region.clone()));
        Ok(descriptor)
    }

    fn address(&self) -> Vec<u8> {
        self.worker.address().to_vec()
    }

    fn connect(&mut self, peer: &str, address: &[u8]) -> Result<(), OneSidedError> {
        self.connect_on_host(peer, address, false)
    }

    fn import(&mut self, peer: &str, id: RegionId, descriptor: &[u8]) -> Result<(), OneSidedError> {
        let ep = self.peer(peer, OneSidedStep::Import)?.ep;
        let len = RegionDescriptor::decode(descriptor)
            .map_err(|reason| OneSidedError::Malformed {
                peer: peer.to_string(),
                step: OneSidedStep::Import,
                detail: reason.to_string(),
            })?
            .len;
        let rkey = self
            .worker
            .unpack_rkey(ep, descriptor)
            .map_err(|e| ucx_error(peer, OneSidedStep::Import, e))?;
        let p = self.peers.get_mut(peer).expect("looked up above");
        if let Some(old) = p.regions.insert(id, Imported { rkey, len }) {
            // A region announced again replaces its key.
            let _ = self.worker.destroy_rkey(old.rkey);
        }
        Ok(())
    }

    fn post(&mut self, peer: &str, dir: Dir, ops: &[RangeOp]) -> Result<UcxPosted, OneSidedError> {
        let p = self.peer(peer, OneSidedStep::Post)?;
        for op in ops {
            self.check(p, peer, op)?;
        }
        let ep = p.ep;
        let keys: Vec<RkeyId> = ops.iter().map(|op| p.regions[&op.remote].rkey).collect();
        let mut posted = UcxPosted {
            peer: peer.to_string(),
            ops: Vec::with_capacity(ops.len()),
            flush: None,
        };
        for (op, rkey) in ops.iter().zip(keys) {
            let (local, _) = &self.local[&op.local];
            let (lo, len) = (op.local_offset as usize, op.len as usize);
            let r = match dir {
                Dir::Write => self.worker.post_put(rkey, op.remote_offset, local, lo, len),
                Dir::Read => self.worker.post_get(rkey, op.remote_offset, local, lo, len),
            };
            match r {
                Ok(id) => posted.ops.push(id),
                Err(e) => {
                    self.abandon(&mut posted);
                    return Err(ucx_error(peer, OneSidedStep::Post, e));
                }
            }
        }
        if dir == Dir::Write {
            match self.worker.post_flush(ep) {
                Ok(id) => posted.flush = Some(id),
                Err(e) => {
                    self.abandon(&mut posted);
                    return Err(ucx_error(peer, OneSidedStep::Post, e));
                }
            }
        }
        Ok(posted)
    }

    fn test(&mut self, posted: &mut UcxPosted) -> Result<bool, OneSidedError> {
        self.worker.progress();
        self.reap_retired();
        let mut i = 0;
        while i < posted.ops.len() {
            match self.worker.test(posted.ops[i]) {
                Ok(true) => {
                    let _ended = posted.ops.swap_remove(i);
                }
                Ok(false) => i += 1,
                Err(e) => {
                    let _failed = posted.ops.swap_remove(i);
                    let peer = posted.peer.clone();
                    self.abandon(posted);
                    return Err(ucx_error(&peer, OneSidedStep::Complete, e));
                }
            }
        }
        if let Some(flush) = posted.flush {
            match self.worker.test(flush) {
                Ok(true) => posted.flush = None,
                Ok(false) => {}
                Err(e) => {
                    posted.flush = None;
                    let peer = posted.peer.clone();
                    self.abandon(posted);
                    return Err(ucx_error(&peer, OneSidedStep::Complete, e));
                }
            }
        }
        Ok(posted.ops.is_empty() && posted.flush.is_none())
    }

    fn wait(&mut self, mut posted: UcxPosted, deadline: Instant) -> Result<(), OneSidedError> {
        let started = Instant::now();
        loop {
            if self.test(&mut posted)? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                self.abandon(&mut posted);
                return Err(OneSidedError::Deadline {
                    peer: posted.peer,
                    step: OneSidedStep::Complete,
                    waited: now - started,
                });
            }
            self.wait_events(deadline - now)?;
        }
    }

    fn release(
        &mut self,
        peer: &str,
        id: RegionId,
        deadline: Instant,
    ) -> Result<(), OneSidedError> {
        let (ep, imported) = self.take_import(peer, id)?;
        // Later batches no longer resolve the region (removed above); the flush ends every
        // one posted before, so the peer may unmap once this returned.
        let flushed = self
            .worker
            .flush(ep, deadline)
            .map_err(|e| ucx_error(peer, OneSidedStep::Release, e));
        let destroyed = self
            .worker
            .destroy_rkey(imported.rkey)
            .map_err(|e| ucx_error(peer, OneSidedStep::Release, e));
        flushed.and(destroyed)
    }

    fn revoke(&mut self, id: RegionId) -> Result<(), OneSidedError> {
        // The worker holds the registration of every operation still using the region, so
        // it is unmapped only once they ended; the region's memory is kept as long.
        match self.local.remove(&id) {
            Some(r) => {
                self.retired.push(r);
                self.reap_retired();
                Ok(())
            }
            None => Err(OneSidedError::UnknownRegion {
                peer: "local".to_string(),
                step: OneSidedStep::Revoke,
                side: "local",
                region: id,
            }),
        }
    }

    fn disconnect(&mut self, peer: &str, deadline: Instant) -> Result<(), OneSidedError> {
        let p = self.take_peer(peer)?;
        // Closing the endpoint destroys the keys unpacked through it.
        self.worker
            .close(p.ep, deadline)
            .map_err(|e| ucx_error(peer, OneSidedStep::Disconnect, e))
    }
}

/// The transports of an endpoint's lanes, as UCX prints them in [`UcxBackend::endpoint_info`]
/// (`posix/memory`, `tcp/lo`), sorted and without repeats.
#[cfg(test)]
pub(crate) fn lane_transports(info: &str) -> Vec<String> {
    let mut out: Vec<String> = info
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',')
        .filter(|w| w.contains('/') && !w.starts_with('/'))
        .map(|w| w.trim_start_matches(|c: char| c.is_ascii_digit() || c == ':'))
        .map(str::to_string)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Whether a lane's transport (as [`lane_transports`] names it) is shared memory or
/// cross-memory attach.
#[cfg(test)]
pub(crate) fn is_shared_memory(lane: &str) -> bool {
    ["posix/", "sysv/", "cma/", "xpmem/", "knem/"]
        .iter()
        .any(|t| lane.starts_with(t))
}

#[cfg(test)]
mod tests {
    //! Two backends of this process over UCX's tcp and shared-memory transports: the target
    //! in a thread of its own that only progresses its worker (UCX's tcp transport needs the
    //! target to), as the owner of a channel's worker does.

    use super::*;
    use crate::region::Region;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::thread::JoinHandle;

    const TLS_VARIANTS: [&str; 2] = ["tcp", "sm,self"];
    const LEN: usize = 4 << 20;
    const DEADLINE: Duration = Duration::from_secs(20);

    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.truncate(len);
        out
    }

    /// The target: its region, exported, and the thread that progresses its backend until
    /// `paused` or `stop` says otherwise.
    struct Target {
        region: Region,
        descriptor: Vec<u8>,
        address: Vec<u8>,
        stop: Arc<AtomicBool>,
        paused: Arc<AtomicBool>,
        thread: Option<JoinHandle<UcxBackend>>,
    }

    impl Target {
        fn start(tls: &str) -> Target {
            let region = Region::alloc(LEN, 4096).unwrap();
            let mut backend = UcxBackend::new(Some(tls)).unwrap();
            let descriptor = backend.export(&region).unwrap();
            let address = backend.address();
            let stop = Arc::new(AtomicBool::new(false));
            let paused = Arc::new(AtomicBool::new(false));
            let (s, p) = (stop.clone(), paused.clone());
            let thread = std::thread::spawn(move || {
                while !s.load(Ordering::Acquire) {
                    if p.load(Ordering::Acquire) {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                    backend.wait_events(Duration::from_millis(20)).unwrap();
                }
                backend
            });
            Target {
                region,
                descriptor,
                address,
                stop,
                paused,
                thread: Some(thread),
            }
        }

        /// Stops the thread and hands back its backend.
        fn join(&mut self) -> UcxBackend {
            self.stop.store(true, Ordering::Release);
            self.thread.take().unwrap().join().unwrap()
        }
    }

    impl Drop for Target {
        fn drop(&mut self) {
            if self.thread.is_some() {
                drop(self.join());
            }
        }
    }

    /// An initiator connected to `t` with the target's region imported, and a local region.
    fn initiator(tls: &str, t: &Target) -> (UcxBackend, Region) {
        let local = Region::alloc(LEN, 4096).unwrap();
        let mut b = UcxBackend::new(Some(tls)).unwrap();
        b.export(&local).unwrap();
        b.connect("target", &t.address).unwrap();
        b.import("target", t.region.id(), &t.descriptor).unwrap();
        (b, local)
    }

    fn op(local: &Region, lo: u64, remote: &Region, ro: u64, len: u64) -> RangeOp {
        RangeOp {
            local: local.id(),
            local_offset: lo,
            remote: remote.id(),
            remote_offset: ro,
            len,
        }
    }

    fn deadline() -> Instant {
        Instant::now() + DEADLINE
    }

    #[test]
    fn shared_memory_segment_sizes_ucx_cannot_carry_are_refused_by_name() {
        for (value, refused) in [
            ("64K", true),
            ("256k", true),
            ("65536", true),
            ("1m", true),
            ("64kb", true),
            ("inf", true),
            ("65535", false),
            ("60K", false),
            ("8256", false),
            ("auto", false),
            ("lots", false),
        ] {
            for name in MM_SEG_SIZE_VARS {
                let env = |n: &str| (n == name).then(|| value.to_string());
                let r = check_mm_seg_sizes(env, true);
                assert_eq!(r.is_err(), refused, "{name}={value}: {r:?}");
                if let Err(e) = r {
                    let text = e.to_string();
                    assert!(text.contains(&format!("{name}={value}")), "{text}");
                }
                // Without shared memory in `UCX_TLS` the setting is never used.
                assert!(check_mm_seg_sizes(env, false).is_ok());
            }
        }
    }

    /// Set in the child process of `a_shared_memory_segment_size_of_64k_is_a_typed_error`.
    const SEG_CHILD: &str = "KVBRIDGE_UCX_SEG_CHILD";

    /// The child: a write and a read back over `sm,self` with the environment's segment
    /// sizes; prints `REFUSED <error>` when a backend is refused, `OK` when the bytes are
    /// exact.
    #[test]
    fn seg_size_child() {
        if std::env::var(SEG_CHILD).is_err() {
            return;
        }
        let tls = "sm,self";
        if let Err(e) = UcxBackend::new(Some(tls)) {
            println!("REFUSED {e}");
            return;
        }
        let t = Target::start(tls);
        let (mut b, local) = initiator(tls, &t);
        let data = pattern(11, 1 << 20);
        local.write_at(0, &data).unwrap();
        let ops = [op(&local, 0, &t.region, 0, 1 << 20)];
        let posted = b.post("target", Dir::Write, &ops).unwrap();
        b.wait(posted, deadline()).unwrap();
        let back = [op(&local, 1 << 20, &t.region, 0, 1 << 20)];
        let posted = b.post("target", Dir::Read, &back).unwrap();
        b.wait(posted, deadline()).unwrap();
        let mut got = vec![0u8; 1 << 20];
        local.read_at(1 << 20, &mut got).unwrap();
        assert!(got == data, "read back differs");
        println!("OK");
    }

    /// Runs [`seg_size_child`] with `var=value`; its exit status and output, or a panic
    /// after 60 s.
    fn run_seg_child(var: &str, value: &str) -> (std::process::ExitStatus, String) {
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "transport::ucx::tests::seg_size_child",
                "--exact",
                "--nocapture",
            ])
            .env(SEG_CHILD, "1")
            .env(var, value)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let id = child.id();
        std::thread::spawn(move || drop(tx.send(child.wait_with_output())));
        let Ok(out) = rx.recv_timeout(Duration::from_secs(60)) else {
            // SAFETY: a signal to the child this test started.
            unsafe { libc::kill(id as i32, libc::SIGKILL) };
            panic!("{var}={value}: the child hung");
        };
        let out = out.unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    #[test]
    fn a_shared_memory_segment_size_of_64k_is_a_typed_error() {
        // UCX 1.13 aborted the process on the first read reply with these (SIGABRT).
        for (var, value) in [("UCX_SYSV_SEG_SIZE", "64K"), ("UCX_POSIX_SEG_SIZE", "256K")] {
            let (status, out) = run_seg_child(var, value);
            assert!(status.success(), "{var}={value}: {status}, output: {out}");
            assert!(
                out.contains("REFUSED") && out.contains(&format!("{var}={value}")),
                "{var}={value}: {out}"
            );
        }
        // A size it carries: the transfer works.
        let (status, out) = run_seg_child("UCX_SYSV_SEG_SIZE", "60K");
        assert!(
            status.success() && out.contains("OK"),
            "60K: {status}: {out}"
        );
    }

    #[test]
    fn writes_and_reads_land_byte_exact_over_every_tls() {
        for tls in TLS_VARIANTS {
            let t = Target::start(tls);
            let (mut b, local) = initiator(tls, &t);
            let data = pattern(7, 3 << 20);
            local.write_at(4096, &data).unwrap();
            // Three ranges of one batch, out of order in the target, two of them unaligned.
            let ops = [
                op(&local, 4096, &t.region, (1 << 20) + 3, 1 << 20),
                op(&local, 4096 + (1 << 20), &t.region, 0, 1 << 20),
                op(&local, 4096 + (2 << 20), &t.region, (2 << 20) + 8, 1 << 20),
            ];
            let posted = b.post("target", Dir::Write, &ops).unwrap();
            b.wait(posted, deadline()).unwrap();
            let mut got = vec![0u8; 1 << 20];
            for (o, want) in ops.iter().zip(data.chunks(1 << 20)) {
                t.region
                    .read_at(o.remote_offset as usize, &mut got)
                    .unwrap();
                assert!(got == want, "{tls}: write at {} differs", o.remote_offset);
            }
            // Read back into another part of the local region.
            let back = [op(&local, 3 << 20, &t.region, 0, 1 << 20)];
            let posted = b.post("target", Dir::Read, &back).unwrap();
            b.wait(posted, deadline()).unwrap();
            local.read_at(3 << 20, &mut got).unwrap();
            assert!(got == data[1 << 20..2 << 20], "{tls}: read differs");
            b.disconnect("target", deadline()).unwrap();
            assert_eq!(b.in_flight(), 0, "{tls}");
        }
    }

    #[test]
    fn a_completed_write_batch_is_in_place_at_the_peer_before_test_says_so() {
        // The property a notification after a write relies on: once `test` returned true,
        // every byte of the batch is visible at the target.
        for tls in TLS_VARIANTS {
            let t = Target::start(tls);
            let (mut b, local) = initiator(tls, &t);
            for round in 0..20u64 {
                let data = pattern(round, 256 << 10);
                local.write_at(0, &data).unwrap();
                let ops: Vec<RangeOp> = (0..4u64)
                    .map(|i| op(&local, i * (64 << 10), &t.region, i * (64 << 10), 64 << 10))
                    .collect();
                let mut posted = b.post("target", Dir::Write, &ops).unwrap();
                let end = deadline();
                while !b.test(&mut posted).unwrap() {
                    assert!(Instant::now() < end, "{tls}: batch never completed");
                    b.wait_events(Duration::from_millis(10)).unwrap();
                }
                let mut got = vec![0u8; 256 << 10];
                t.region.read_at(0, &mut got).unwrap();
                assert!(
                    got == data,
                    "{tls}: round {round}: completed but not in place"
                );
            }
        }
    }

    #[test]
    fn a_range_outside_either_region_is_refused_and_nothing_is_posted() {
        let tls = "tcp";
        let t = Target::start(tls);
        let (mut b, local) = initiator(tls, &t);
        let len = LEN as u64;
        for (o, side) in [
            (op(&local, 0, &t.region, len - 10, 11), "remote"),
            (op(&local, len - 10, &t.region, 0, 11), "local"),
            (op(&local, 0, &t.region, u64::MAX - 1, 4), "remote"),
            (op(&local, u64::MAX, &t.region, 0, 1), "local"),
        ] {
            // A good range first: the bad one after it must stop the whole batch.
            let ops = [op(&local, 0, &t.region, 0, 4096), o];
            match b.post("target", Dir::Write, &ops) {
                Err(OneSidedError::OutOfBounds { side: s, peer, .. }) => {
                    assert_eq!((s, peer.as_str()), (side, "target"))
                }
                other => panic!("{o:?}: {other:?}"),
            }
            assert_eq!(b.in_flight(), 0, "{o:?} posted something");
        }
    }

    #[test]
    fn released_and_revoked_regions_are_refused_by_name() {
        let tls = "sm,self";
        let t = Target::start(tls);
        let (mut b, local) = initiator(tls, &t);
        let ops = [op(&local, 0, &t.region, 0, 4096)];
        let posted = b.post("target", Dir::Write, &ops).unwrap();
        b.wait(posted, deadline()).unwrap();
        b.release("target", t.region.id(), deadline()).unwrap();
        assert!(matches!(
            b.post("target", Dir::Write, &ops),
            Err(OneSidedError::UnknownRegion { side: "remote", .. })
        ));
        assert!(matches!(
            b.release("target", t.region.id(), deadline()),
            Err(OneSidedError::UnknownRegion { .. })
        ));
        b.import("target", t.region.id(), &t.descriptor).unwrap();
        b.revoke(local.id()).unwrap();
        assert!(matches!(
            b.post("target", Dir::Write, &ops),
            Err(OneSidedError::UnknownRegion { side: "local", .. })
        ));
        assert!(matches!(
            b.post("nobody", Dir::Write, &ops),
            Err(OneSidedError::NotConnected { .. })
        ));
    }

    #[test]
    fn hostile_address_and_descriptor_bytes_are_refused_before_ucx() {
        let tls = "tcp";
        let t = Target::start(tls);
        let mut b = UcxBackend::new(Some(tls)).unwrap();
        let mut bad_addr = t.address.clone();
        let last = bad_addr.len() - 1;
        bad_addr[last] ^= 0xff;
        for a in [
            &[][..],
            &t.address[..t.address.len() / 2],
            &bad_addr[..],
            &[0xff; 64][..],
        ] {
            assert!(
                matches!(b.connect("evil", a), Err(OneSidedError::Malformed { .. })),
                "address of {} bytes accepted",
                a.len()
            );
        }
        b.connect("target", &t.address).unwrap();
        let mut bad = t.descriptor.clone();
        let mid = bad.len() / 2;
        bad[mid] ^= 0x55;
        for d in [&[][..], &t.descriptor[..20], &bad[..], &[0u8; 200][..]] {
            assert!(
                matches!(
                    b.import("target", t.region.id(), d),
                    Err(OneSidedError::Malformed { .. })
                ),
                "descriptor of {} bytes accepted",
                d.len()
            );
        }
    }

    #[test]
    fn a_write_to_a_stalled_tcp_peer_ends_at_its_deadline() {
        // UCX's tcp transport completes a flush only when the target progresses: a target
        // that stopped (hung, or its owner gone) must cost the writer its deadline, no more.
        let tls = "tcp";
        let t = Target::start(tls);
        let (mut b, local) = initiator(tls, &t);
        let ops = [op(&local, 0, &t.region, 0, 1 << 20)];
        let posted = b.post("target", Dir::Write, &ops).unwrap();
        b.wait(posted, deadline()).unwrap();
        t.paused.store(true, Ordering::Release);
        let posted = b.post("target", Dir::Write, &ops).unwrap();
        let started = Instant::now();
        let r = b.wait(posted, Instant::now() + Duration::from_millis(500));
        let took = started.elapsed();
        assert!(
            matches!(&r, Err(OneSidedError::Deadline { peer, .. }) if peer == "target"),
            "{r:?}"
        );
        assert!(took < Duration::from_secs(5), "waited {took:?}");
        // The abandoned batch ends once the target progresses again.
        t.paused.store(false, Ordering::Release);
        let end = deadline();
        while b.in_flight() > 0 {
            assert!(Instant::now() < end, "abandoned operations never ended");
            b.wait_events(Duration::from_millis(10)).unwrap();
        }
    }

    #[test]
    fn a_write_to_a_peer_whose_worker_is_gone_fails_within_its_deadline() {
        let tls = "tcp";
        let mut t = Target::start(tls);
        let (mut b, local) = initiator(tls, &t);
        let ops = [op(&local, 0, &t.region, 0, 1 << 20)];
        let posted = b.post("target", Dir::Write, &ops).unwrap();
        b.wait(posted, deadline()).unwrap();
        drop(t.join());
        let started = Instant::now();
        let r = b
            .post("target", Dir::Write, &ops)
            .and_then(|p| b.wait(p, Instant::now() + Duration::from_secs(3)));
        assert!(r.is_err(), "a write to a gone peer succeeded");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "waited {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn a_same_host_endpoint_gets_shared_memory_lanes_beside_tcp() {
        // With a network transport in `UCX_TLS`, asking for peer-failure detection builds
        // the endpoint from that transport alone; a same-host endpoint asks for every
        // transport UCX picks, so its lanes include shared memory or cross-memory attach.
        let tls = "sm,self,tcp";
        let t = Target::start(tls);
        let local = Region::alloc(LEN, 4096).unwrap();
        let mut b = UcxBackend::new(Some(tls)).unwrap();
        b.export(&local).unwrap();
        b.connect_on_host("same", &t.address, true).unwrap();
        b.connect_on_host("other", &t.address, false).unwrap();
        let same = b.endpoint_info("same").unwrap();
        let other = b.endpoint_info("other").unwrap();
        eprintln!("same host:\n{same}\nother:\n{other}");
        let (same, other) = (lane_transports(&same), lane_transports(&other));
        assert!(
            same.iter().any(|l| is_shared_memory(l)),
            "a same-host endpoint without shared-memory lanes: {same:?}"
        );
        assert!(
            !other.iter().any(|l| is_shared_memory(l)),
            "an endpoint with peer-failure detection over shared memory: {other:?}"
        );
        // Both carry bytes.
        for peer in ["same", "other"] {
            b.import(peer, t.region.id(), &t.descriptor).unwrap();
            let data = pattern(11, 1 << 20);
            local.write_at(0, &data).unwrap();
            let posted = b
                .post(peer, Dir::Write, &[op(&local, 0, &t.region, 0, 1 << 20)])
                .unwrap();
            b.wait(posted, deadline()).unwrap();
            let mut got = vec![0u8; 1 << 20];
            t.region.read_at(0, &mut got).unwrap();
            assert!(got == data, "{peer}: bytes differ");
        }
    }

    #[test]
    fn ucx_tls_lists_that_exclude_shared_memory_are_told_apart() {
        for tls in ["tcp", "tcp,self", "rc,ud", " TCP "] {
            assert!(!may_use_shared_memory(Some(tls)), "{tls}");
        }
        for tls in [
            "all",
            "sm,self,tcp",
            "tcp,cma",
            "posix",
            "^tcp",
            "",
            "rc,\\sysv",
        ] {
            assert!(may_use_shared_memory(Some(tls)), "{tls}");
        }
    }

    #[test]
    fn a_same_host_endpoint_keeps_failure_detection_where_ucx_tls_has_no_shared_memory() {
        // With `UCX_TLS=tcp` a same-host endpoint would gain no lane by giving up failure
        // detection: a killed peer then fails its writes at once instead of at the deadline.
        let t = Target::start("tcp");
        let mut b = UcxBackend::new(Some("tcp")).unwrap();
        b.connect_on_host("same", &t.address, true).unwrap();
        assert_eq!(b.detects_peer_failure("same"), Some(true));
        let mut b = UcxBackend::new(Some("sm,self,tcp")).unwrap();
        b.connect_on_host("same", &t.address, true).unwrap();
        assert_eq!(b.detects_peer_failure("same"), Some(false));
    }

    #[test]
    fn a_same_host_claim_over_tcp_alone_still_fails_a_write_to_a_gone_peer_by_its_deadline() {
        // What a peer lying about its host gets where `UCX_TLS` allows shared memory: an
        // endpoint without peer-failure detection over UCX's network transport. A write to
        // it after its worker is gone ends by the deadline, with an error, and the process
        // lives on.
        let tls = "sm,self,tcp";
        let mut t = Target::start("tcp");
        let local = Region::alloc(LEN, 4096).unwrap();
        let mut b = UcxBackend::new(Some(tls)).unwrap();
        b.export(&local).unwrap();
        b.connect_on_host("liar", &t.address, true).unwrap();
        b.import("liar", t.region.id(), &t.descriptor).unwrap();
        let ops = [op(&local, 0, &t.region, 0, 1 << 20)];
        let posted = b.post("liar", Dir::Write, &ops).unwrap();
        b.wait(posted, deadline()).unwrap();
        drop(t.join());
        let started = Instant::now();
        let r = b
            .post("liar", Dir::Write, &ops)
            .and_then(|p| b.wait(p, Instant::now() + Duration::from_secs(3)));
        let took = started.elapsed();
        eprintln!("write to the gone peer: {r:?} after {took:?}");
        assert!(r.is_err(), "a write to a gone peer succeeded");
        assert!(took < Duration::from_secs(13), "waited {took:?}");
        let closed = b
            .post_disconnect("liar")
            .and_then(|p| b.wait(p, Instant::now() + Duration::from_secs(3)));
        eprintln!("close: {closed:?}");
    }

    #[test]
    fn a_disconnect_posted_returns_at_once_and_ends_through_test() {
        for tls in TLS_VARIANTS {
            let t = Target::start(tls);
            let (mut b, local) = initiator(tls, &t);
            let ops = [op(&local, 0, &t.region, 0, 1 << 20)];
            let posted = b.post("target", Dir::Write, &ops).unwrap();
            b.wait(posted, deadline()).unwrap();
            let mut close = b.post_disconnect("target").unwrap();
            assert!(
                matches!(
                    b.post("target", Dir::Write, &ops),
                    Err(OneSidedError::NotConnected { .. })
                ),
                "{tls}: the peer is gone from the table at once"
            );
            let end = deadline();
            while !b.test(&mut close).unwrap() {
                assert!(Instant::now() < end, "{tls}: the close never ended");
                b.wait_events(Duration::from_millis(10)).unwrap();
            }
        }
    }
}
