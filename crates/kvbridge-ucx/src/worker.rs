//! A UCX worker: the progress engine of one channel, with the endpoints, remote keys and
//! operations it owns. One owner drives it (it is `Send`, not `Sync`), waiting on its event
//! fd when nothing is ready, so an idle worker costs no CPU.

use std::collections::HashMap;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvbridge_ucx_sys as sys;

use crate::busy::{armed_wait, wait_readable, ArmedWait, BusyBackoff};
use crate::context::{Context, ContextInner};
use crate::error::{Error, Result, Step};
use crate::region::{MemRegion, RegionInner};
use crate::status::{check, status};
use crate::wire::{self, Kind, RegionDescriptor};

/// How long dropping a worker waits for its endpoints to close.
const DROP_CLOSE_DEADLINE: Duration = Duration::from_secs(2);
/// How long a dropped worker, armed with nothing left to progress, waits on its event fd for
/// an event still under way (a connection UCX opened to send a wireup reply completing)
/// before it counts as quiet.
const DROP_QUIET_WAIT: Duration = Duration::from_millis(1);
/// How long UCX may say events are pending while progress handles none (a send waiting
/// for room at a peer, for ever if it is dead) before a dropped worker counts as quiet
/// anyway; it naps by `BusyBackoff` meanwhile.
const DROP_STUCK_WAIT: Duration = Duration::from_millis(20);
/// The longest a dropped worker progresses, waiting to be quiet, before it is destroyed.
const DROP_QUIET_DEADLINE: Duration = Duration::from_millis(200);

/// A connected peer (an endpoint of this worker).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EpId(u64);

/// A peer's region, reachable through one endpoint (an unpacked remote key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RkeyId(u64);

/// A posted operation, to wait for with [`Worker::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "an operation must be waited for to learn whether it succeeded"]
pub struct OpId(u64);

/// What an endpoint asks of UCX first ([`Worker::connect_preferring`]). UCX 1.13 offers
/// peer-failure detection (`UCP_ERR_HANDLING_MODE_PEER`) only on transports that have it,
/// which its shared-memory ones lack: the choice is between the two.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prefer {
    /// Peer-failure detection: the endpoint fails as soon as UCX sees its peer die. With a
    /// network transport in `UCX_TLS` the endpoint is built from it alone; with only
    /// shared-memory transports UCX refuses the mode and the endpoint goes without it.
    FailureDetection,
    /// Every transport UCX would pick (`UCP_ERR_HANDLING_MODE_NONE`): shared memory and
    /// cross-memory attach for a peer on this host. A dead peer then shows as a failed
    /// operation or a passed deadline. For a peer known to be on this host.
    SharedMemory,
}

/// Written by UCX's callbacks, read by the worker's owner.
struct Slot(AtomicI32);

const PENDING: i32 = sys::UCS_INPROGRESS as i32;

impl Slot {
    fn new() -> Box<Self> {
        Box::new(Slot(AtomicI32::new(PENDING)))
    }
    fn get(&self) -> Option<sys::ucs_status_t> {
        match self.0.load(Ordering::Acquire) {
            PENDING => None,
            s => Some(s as sys::ucs_status_t),
        }
    }
    fn set(&self, s: sys::ucs_status_t) {
        self.0.store(s as i32, Ordering::Release);
    }
}

unsafe extern "C" fn on_done(
    _request: *mut c_void,
    status: sys::ucs_status_t,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the `Slot` boxed in the operation's `InFlight`, which the worker
    // keeps until the request completed or the worker was destroyed.
    let slot = unsafe { &*user_data.cast::<Slot>() };
    slot.set(status);
}

unsafe extern "C" fn on_ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: `arg` is the `Slot` boxed in the endpoint's `Endpoint`, kept until the endpoint
    // is closed (and its close request has completed) or the worker destroyed.
    let slot = unsafe { &*arg.cast::<Slot>() };
    slot.set(status);
}

struct Endpoint {
    handle: sys::ucp_ep_h,
    peer: String,
    /// The endpoint's failure, once UCX reported one (`UCP_ERR_HANDLING_MODE_PEER`).
    failed: Box<Slot>,
    /// Whether UCX reports the peer's failure on this endpoint. Without it (UCX 1.13's
    /// shared-memory transports) a dead peer shows as a failed copy or a passed deadline.
    detects: bool,
}

struct RemoteKey {
    handle: sys::ucp_rkey_h,
    ep: u64,
    base: u64,
    len: u64,
}

struct InFlight {
    /// The UCX request, or null when the operation completed at once.
    req: *mut c_void,
    slot: Box<Slot>,
    step: Step,
    peer: String,
    /// Keeps the local memory registered (and allocated) while UCX may still touch it.
    _local: Option<Arc<RegionInner>>,
    /// Keeps an endpoint's error slot alive while its close request runs.
    _ep_slot: Option<Box<Slot>>,
    /// The endpoint it was posted on (its close, for a close).
    ep: Option<u64>,
    /// The caller stopped waiting (deadline): reaped silently once it ends.
    abandoned: bool,
    /// Its peer ended its side and UCX cannot report the peer's failure on its endpoint
    /// ([`Worker::close_peer_gone`]): to a dead peer it never ends, so a dropped worker does
    /// not wait for it.
    detached: bool,
}

/// One UCX worker and what it owns. See the module docs.
pub struct Worker {
    handle: sys::ucp_worker_h,
    efd: RawFd,
    address: Vec<u8>,
    eps: HashMap<u64, Endpoint>,
    rkeys: HashMap<u64, RemoteKey>,
    ops: HashMap<u64, InFlight>,
    next_id: u64,
    /// `wait_events` rounds in a row in which UCX reported pending events but handled none,
    /// or its armed fd woke it with nothing to handle.
    busy: BusyBackoff,
    /// The last `wait_events` ended with the event fd readable.
    woke: bool,
    /// Dropped after the worker is destroyed (field order is irrelevant: `Drop` destroys it
    /// explicitly before the fields go).
    _ctx: Arc<ContextInner>,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

// SAFETY: the worker is created in `UCS_THREAD_MODE_SERIALIZED`: any thread may use it, one at
// a time. `Worker` is not `Sync` and every UCX call takes `&mut self` or happens in `Drop`, so
// calls never overlap; the raw pointers it holds are UCX handles and boxes it owns.
unsafe impl Send for Worker {}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("efd", &self.efd)
            .field("endpoints", &self.eps.len())
            .field("in_flight", &self.ops.len())
            .finish_non_exhaustive()
    }
}

impl AsRawFd for Worker {
    fn as_raw_fd(&self) -> RawFd {
        self.efd
    }
}

impl Worker {
    /// Creates a worker on `ctx`, with its event fd.
    pub fn new(ctx: &Context) -> Result<Self> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut handle: sys::ucp_worker_h = ptr::null_mut();
        // SAFETY: the context is live (held by `_ctx`); params and out-pointer are valid.
        let code = unsafe { sys::ucp_worker_create(ctx.inner.handle, &params, &mut handle) };
        check(code).map_err(|status| Error::Ucx {
            step: Step::WorkerCreate,
            status,
        })?;
        let mut w = Worker {
            handle,
            efd: -1,
            address: Vec::new(),
            eps: HashMap::new(),
            rkeys: HashMap::new(),
            ops: HashMap::new(),
            next_id: 1,
            busy: BusyBackoff::new(),
            woke: false,
            _ctx: ctx.inner.clone(),
            _not_sync: PhantomData,
        };
        // From here on `w`'s drop destroys the worker if a step fails.
        let mut efd: i32 = -1;
        // SAFETY: live worker, valid out-pointer; the context asked for `UCP_FEATURE_WAKEUP`.
        let code = unsafe { sys::ucp_worker_get_efd(w.handle, &mut efd) };
        check(code).map_err(|status| Error::Ucx {
            step: Step::EventFd,
            status,
        })?;
        w.efd = efd;
        let mut addr: *mut sys::ucp_address_t = ptr::null_mut();
        let mut len: usize = 0;
        // SAFETY: live worker, valid out-pointers.
        let code = unsafe { sys::ucp_worker_get_address(w.handle, &mut addr, &mut len) };
        check(code).map_err(|status| Error::Ucx {
            step: Step::WorkerAddress,
            status,
        })?;
        // SAFETY: UCX returned `len` bytes at `addr`, valid until released below.
        let bytes = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: `addr` came from `ucp_worker_get_address` on this worker; released once.
        unsafe { sys::ucp_worker_release_address(w.handle, addr) };
        if bytes.len() > wire::MAX_PAYLOAD {
            return Err(Error::Ucx {
                step: Step::WorkerAddress,
                status: status(sys::UCS_ERR_EXCEEDS_LIMIT),
            });
        }
        w.address = wire::seal(Kind::WorkerAddress, &bytes);
        Ok(w)
    }

    /// This worker's address in its envelope: send it to a peer, which passes it to
    /// [`Worker::connect`].
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// The worker's event fd: readable when [`Worker::progress`] has work. Register it with
    /// an event loop (e.g. tokio's `AsyncFd`) and call [`Worker::arm`] before each wait.
    pub fn event_fd(&self) -> RawFd {
        self.efd
    }

    /// Runs UCX's progress once; returns how many events it handled. Also ends operations
    /// whose callers stopped waiting.
    pub fn progress(&mut self) -> u32 {
        // SAFETY: live worker, used by this owner only (`&mut self`).
        let n = unsafe { sys::ucp_worker_progress(self.handle) };
        self.reap_abandoned();
        n
    }

    /// Arms the event fd for the next wait. `Ok(false)`: events are already pending, call
    /// [`Worker::progress`] again instead of waiting.
    pub fn arm(&mut self) -> Result<bool> {
        // SAFETY: live worker, used by this owner only.
        let code = unsafe { sys::ucp_worker_arm(self.handle) };
        if code == sys::UCS_ERR_BUSY {
            return Ok(false);
        }
        check(code).map_err(|status| Error::Ucx {
            step: Step::Wait,
            status,
        })?;
        Ok(true)
    }

    /// Progresses, then sleeps on the event fd for at most `timeout` if nothing was ready.
    /// A peer that only receives puts and gets (UCX's tcp transport needs the target to
    /// progress) runs this in a loop.
    pub fn wait_events(&mut self, timeout: Duration) -> Result<()> {
        if self.progress() > 0 {
            self.busy.reset();
            self.woke = false;
            return Ok(());
        }
        if self.arm()? {
            // A readable fd with nothing to handle (UCX 1.13's tcp during a wire-up) would
            // return every poll at once: `armed_wait` backs off from it.
            match armed_wait(self.woke, &mut self.busy, timeout) {
                ArmedWait::Poll => self.woke = poll_fd(self.efd, timeout)?,
                ArmedWait::Nap(nap) => {
                    std::thread::sleep(nap);
                    self.woke = poll_fd(self.efd, Duration::ZERO)?;
                }
            }
            return Ok(());
        }
        // UCX says events are pending but progress handled none: a send waiting for room at
        // the peer (a same-host peer not yet scheduled, or one killed: then for ever). The
        // event fd stays readable meanwhile, so sleep without it, briefly at first, longer
        // while nothing moves (`BusyBackoff`).
        let nap = self.busy.idle().min(timeout);
        if !nap.is_zero() {
            std::thread::sleep(nap);
        }
        Ok(())
    }

    /// Opens an endpoint to the peer whose worker address (the bytes of its
    /// [`Worker::address`]) is `address`. `peer` names it in errors.
    ///
    /// Where the transports allow it, the endpoint reports the peer's failure
    /// (`UCP_ERR_HANDLING_MODE_PEER`): operations on it then fail instead of waiting (see
    /// [`Worker::detects_peer_failure`]).
    pub fn connect(&mut self, peer: &str, address: &[u8]) -> Result<EpId> {
        self.connect_preferring(peer, address, Prefer::FailureDetection)
    }

    /// [`Worker::connect`], asking UCX first for what `prefer` says (then for the other, if
    /// UCX finds the peer unreachable that way).
    pub fn connect_preferring(
        &mut self,
        peer: &str,
        address: &[u8],
        prefer: Prefer,
    ) -> Result<EpId> {
        let raw = wire::open(Kind::WorkerAddress, address).map_err(|reason| Error::Malformed {
            peer: peer.to_string(),
            step: Step::EpCreate,
            reason,
        })?;
        let failed = Slot::new();
        // UCX 1.13's shared-memory transports lack peer-failure handling and refuse an
        // endpoint that asks for it as unreachable (then it goes without, see `Endpoint`);
        // where a network transport has it, asking for it leaves shared memory out.
        let (peer_mode, none) = (
            sys::UCP_ERR_HANDLING_MODE_PEER,
            sys::UCP_ERR_HANDLING_MODE_NONE,
        );
        let modes = match prefer {
            Prefer::FailureDetection => [peer_mode, none],
            Prefer::SharedMemory => [none, peer_mode],
        };
        let mut handle: sys::ucp_ep_h = ptr::null_mut();
        let mut code = sys::UCS_ERR_UNREACHABLE;
        let mut detects = false;
        for mode in modes {
            let params = sys::ucp_ep_params_t {
                field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
                address: raw.as_ptr().cast(),
                err_mode: mode,
                err_handler: sys::ucp_err_handler_t {
                    cb: Some(on_ep_error),
                    arg: ptr::from_ref::<Slot>(&failed).cast_mut().cast(),
                },
                ..Default::default()
            };
            // SAFETY: live worker; `raw` is the address bytes (checked envelope), read during
            // the call only; the error slot lives as long as the endpoint (see `Endpoint`).
            code = unsafe { sys::ucp_ep_create(self.handle, &params, &mut handle) };
            detects = mode == sys::UCP_ERR_HANDLING_MODE_PEER;
            if code != sys::UCS_ERR_UNREACHABLE {
                break;
            }
        }
        check(code).map_err(|status| Error::Peer {
            peer: peer.to_string(),
            step: Step::EpCreate,
            status,
        })?;
        let id = self.next();
        self.eps.insert(
            id,
            Endpoint {
                handle,
                peer: peer.to_string(),
                failed,
                detects,
            },
        );
        Ok(EpId(id))
    }

    /// Whether UCX reports the failure of `ep`'s peer (`UCP_ERR_HANDLING_MODE_PEER`). UCX
    /// 1.13's shared-memory transports cannot; there a dead peer shows as a failed operation
    /// or a passed deadline.
    pub fn detects_peer_failure(&self, ep: EpId) -> Option<bool> {
        self.eps.get(&ep.0).map(|e| e.detects)
    }

    /// UCX's description of endpoint `ep` (`ucp_ep_print_info`): its configuration and the
    /// transport and device of each lane, e.g. `posix/memory`, `cma/memory`, `tcp/lo`.
    pub fn endpoint_info(&self, ep: EpId) -> Result<String> {
        let e = self.eps.get(&ep.0).ok_or(Error::NotOpen {
            step: Step::EpCreate,
            what: "endpoint",
            id: ep.0,
        })?;
        let os = |source| Error::Os {
            step: Step::EpCreate,
            source,
        };
        // SAFETY: plain call; the stream is closed below.
        let file = unsafe { libc::tmpfile() };
        if file.is_null() {
            return Err(os(std::io::Error::last_os_error()));
        }
        // SAFETY: live endpoint of this worker; `file` is an open stream, written to during
        // the call only.
        unsafe { sys::ucp_ep_print_info(e.handle, file.cast()) };
        let mut text = Vec::new();
        let mut buf = [0u8; 4096];
        // SAFETY: `file` is open; reads at most `buf.len()` bytes into `buf`.
        unsafe { libc::rewind(file) };
        loop {
            // SAFETY: as above.
            let n = unsafe { libc::fread(buf.as_mut_ptr().cast(), 1, buf.len(), file) };
            if n == 0 {
                break;
            }
            text.extend_from_slice(&buf[..n]);
        }
        // SAFETY: closed once; nothing uses `file` after.
        unsafe { libc::fclose(file) };
        Ok(String::from_utf8_lossy(&text).into_owned())
    }

    /// Unpacks a peer's region descriptor (the bytes of its `MemRegion::descriptor`) for use
    /// through endpoint `ep`.
    pub fn unpack_rkey(&mut self, ep: EpId, descriptor: &[u8]) -> Result<RkeyId> {
        let e = self.ep(Step::RkeyUnpack, ep)?;
        let peer = e.peer.clone();
        let handle_ep = e.handle;
        let d = RegionDescriptor::decode(descriptor).map_err(|reason| Error::Malformed {
            peer: peer.clone(),
            step: Step::RkeyUnpack,
            reason,
        })?;
        let mut rkey: sys::ucp_rkey_h = ptr::null_mut();
        // SAFETY: live endpoint of this worker; the key bytes passed the envelope check and
        // are read during the call only.
        let code = unsafe { sys::ucp_ep_rkey_unpack(handle_ep, d.rkey.as_ptr().cast(), &mut rkey) };
        check(code).map_err(|status| Error::Peer {
            peer,
            step: Step::RkeyUnpack,
            status,
        })?;
        let id = self.next();
        self.rkeys.insert(
            id,
            RemoteKey {
                handle: rkey,
                ep: ep.0,
                base: d.base,
                len: d.len,
            },
        );
        Ok(RkeyId(id))
    }

    /// Destroys a remote key (the peer revoked the region, or we are done with it).
    pub fn destroy_rkey(&mut self, rkey: RkeyId) -> Result<()> {
        let k = self.rkeys.remove(&rkey.0).ok_or(Error::NotOpen {
            step: Step::RkeyUnpack,
            what: "remote key",
            id: rkey.0,
        })?;
        // SAFETY: the key came from `ucp_ep_rkey_unpack` and is destroyed once. Operations
        // already posted with it keep what they need inside UCX.
        unsafe { sys::ucp_rkey_destroy(k.handle) };
        Ok(())
    }

    /// Posts a one-sided write of `local[local_offset..+len]` to the peer's region `rkey` at
    /// `remote_offset`. Complete it with [`Worker::wait`]; a [`Worker::flush`] after it
    /// orders it before later writes.
    pub fn post_put(
        &mut self,
        rkey: RkeyId,
        remote_offset: u64,
        local: &MemRegion,
        local_offset: usize,
        len: usize,
    ) -> Result<OpId> {
        self.post_rma(Step::Put, rkey, remote_offset, local, local_offset, len)
    }

    /// Posts a one-sided read of the peer's region `rkey` at `remote_offset` into
    /// `local[local_offset..+len]`.
    pub fn post_get(
        &mut self,
        rkey: RkeyId,
        remote_offset: u64,
        local: &MemRegion,
        local_offset: usize,
        len: usize,
    ) -> Result<OpId> {
        self.post_rma(Step::Get, rkey, remote_offset, local, local_offset, len)
    }

    /// Posts and waits for a write (see [`Worker::post_put`]) until `deadline`.
    pub fn put(
        &mut self,
        rkey: RkeyId,
        remote_offset: u64,
        local: &MemRegion,
        local_offset: usize,
        len: usize,
        deadline: Instant,
    ) -> Result<()> {
        let op = self.post_put(rkey, remote_offset, local, local_offset, len)?;
        self.wait(op, deadline)
    }

    /// Posts and waits for a read (see [`Worker::post_get`]) until `deadline`.
    pub fn get(
        &mut self,
        rkey: RkeyId,
        remote_offset: u64,
        local: &MemRegion,
        local_offset: usize,
        len: usize,
        deadline: Instant,
    ) -> Result<()> {
        let op = self.post_get(rkey, remote_offset, local, local_offset, len)?;
        self.wait(op, deadline)
    }

    fn post_rma(
        &mut self,
        step: Step,
        rkey: RkeyId,
        remote_offset: u64,
        local: &MemRegion,
        local_offset: usize,
        len: usize,
    ) -> Result<OpId> {
        let k = self.rkeys.get(&rkey.0).ok_or(Error::NotOpen {
            step,
            what: "remote key",
            id: rkey.0,
        })?;
        let (k_handle, k_ep, base, size) = (k.handle, k.ep, k.base, k.len);
        match remote_offset.checked_add(len as u64) {
            Some(end) if end <= size => {}
            _ => {
                return Err(Error::OutOfRange {
                    step,
                    what: "remote region",
                    offset: remote_offset,
                    len: len as u64,
                    size,
                })
            }
        }
        local.check_range(step, local_offset as u64, len as u64)?;
        let e = self.ep(step, EpId(k_ep))?;
        let (ep_handle, peer) = (e.handle, e.peer.clone());
        let slot = Slot::new();
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: (sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FIELD_MEMH),
            user_data: ptr::from_ref::<Slot>(&slot).cast_mut().cast(),
            memh: local.inner.memh,
            ..Default::default()
        };
        param.cb.send = Some(on_done);
        // SAFETY: `local_offset + len` lies inside the region (checked above).
        let buf = unsafe { local.inner.ptr.add(local_offset) }.cast::<c_void>();
        let remote = base + remote_offset;
        // SAFETY: live endpoint and remote key of this worker; `buf..+len` is registered
        // memory kept alive by the `InFlight` entry below until UCX ends the operation; the
        // slot outlives the request likewise.
        let ret = unsafe {
            if step == Step::Put {
                sys::ucp_put_nbx(ep_handle, buf, len, remote, k_handle, &param)
            } else {
                sys::ucp_get_nbx(ep_handle, buf, len, remote, k_handle, &param)
            }
        };
        self.track(ret, slot, step, peer, Some(local.inner.clone()), None)
            .map(|op| self.on_ep(op, k_ep))
    }

    /// Waits until every write and read posted on `ep` before this call has completed at the
    /// peer (`ucp_ep_flush_nbx`), at most until `deadline`. A write posted after a flush
    /// returned lands after everything flushed.
    pub fn flush(&mut self, ep: EpId, deadline: Instant) -> Result<()> {
        let op = self.post_flush(ep)?;
        self.wait(op, deadline)
    }

    /// Posts a flush of endpoint `ep` (see [`Worker::flush`]) without waiting: it completes,
    /// through [`Worker::test`] or [`Worker::wait`], once every write and read posted on `ep`
    /// before it has completed at the peer.
    pub fn post_flush(&mut self, ep: EpId) -> Result<OpId> {
        let e = self.ep(Step::Flush, ep)?;
        let (handle, peer) = (e.handle, e.peer.clone());
        let slot = Slot::new();
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: (sys::UCP_OP_ATTR_FIELD_CALLBACK | sys::UCP_OP_ATTR_FIELD_USER_DATA),
            user_data: ptr::from_ref::<Slot>(&slot).cast_mut().cast(),
            ..Default::default()
        };
        param.cb.send = Some(on_done);
        // SAFETY: live endpoint; the slot outlives the request (kept in `InFlight`).
        let ret = unsafe { sys::ucp_ep_flush_nbx(handle, &param) };
        self.track(ret, slot, Step::Flush, peer, None, None)
            .map(|op| self.on_ep(op, ep.0))
    }

    /// Closes endpoint `ep` and destroys the remote keys unpacked through it: flushes what
    /// was posted on it and tells the peer, at most until `deadline`. An endpoint whose peer
    /// failed is released without waiting (`UCP_EP_CLOSE_FLAG_FORCE`).
    pub fn close(&mut self, ep: EpId, deadline: Instant) -> Result<()> {
        let op = self.post_close(ep)?;
        self.wait(op, deadline)
    }

    /// Starts closing endpoint `ep` (see [`Worker::close`]) without waiting: the endpoint
    /// and its keys are gone at once; the close completes through [`Worker::test`] or
    /// [`Worker::wait`] (a caller that stops waiting leaves it to the worker).
    pub fn post_close(&mut self, ep: EpId) -> Result<OpId> {
        let e = self.eps.remove(&ep.0).ok_or(Error::NotOpen {
            step: Step::EpClose,
            what: "endpoint",
            id: ep.0,
        })?;
        let keys: Vec<u64> = self
            .rkeys
            .iter()
            .filter(|(_, k)| k.ep == ep.0)
            .map(|(id, _)| *id)
            .collect();
        for id in keys {
            let _ = self.destroy_rkey(RkeyId(id));
        }
        self.start_close(ep.0, e)
    }

    /// Closes endpoint `ep` whose peer ended its side of the conversation (the caller's own
    /// connection to it was closed by the peer or its host: the peer's session is over
    /// there, or its process died), without waiting where that is sound. UCX 1.13 refuses a
    /// forced close (`UCP_EP_CLOSE_FLAG_FORCE`) on an endpoint without peer-failure
    /// detection, and the flushing close of one to a dead same-host peer never ends (the
    /// peer never drains its shared-memory queue). So where UCX cannot report the peer's
    /// failure and no read is in flight on the endpoint (nothing that could still land in
    /// local memory), the close is posted as [`Worker::post_close`] does and left to the
    /// worker: reaped when it ends (a live peer drains it), never waited for, also not when
    /// the worker is dropped; nor are the writes still in flight on the endpoint when the
    /// worker is dropped (their callers still complete or abandon them). Returns
    /// `None` then. Otherwise (UCX detects the peer's failure, or a read is in flight) it is
    /// [`Worker::post_close`]: the close to wait for.
    pub fn close_peer_gone(&mut self, ep: EpId) -> Result<Option<OpId>> {
        let e = self.eps.get(&ep.0).ok_or(Error::NotOpen {
            step: Step::EpClose,
            what: "endpoint",
            id: ep.0,
        })?;
        let reading = self
            .ops
            .values()
            .any(|f| f.ep == Some(ep.0) && f.step == Step::Get && f.slot.get().is_none());
        if e.detects || reading {
            return self.post_close(ep).map(Some);
        }
        self.close_unwaited(ep).map(|()| None)
    }

    /// Closes endpoint `ep` whose peer process is known to have exited (the caller watched
    /// it exit), after a progress that handled what the peer had delivered before it died.
    /// Nothing more can arrive from it, so no operation on the endpoint can still complete
    /// into local memory: the close and every operation on it are left to the worker as
    /// [`Worker::close_peer_gone`] leaves a close without reads, reads included.
    pub fn close_peer_dead(&mut self, ep: EpId) -> Result<()> {
        self.close_unwaited(ep)
    }

    /// Posts the close of `ep` and leaves it, and the operations on the endpoint, to the
    /// worker: reaped when they end, never waited for (also not when the worker is dropped).
    fn close_unwaited(&mut self, ep: EpId) -> Result<()> {
        let close = self.post_close(ep)?;
        // The operations keep their callers (who complete or abandon them as before); the
        // close has none.
        for f in self.ops.values_mut() {
            if f.ep == Some(ep.0) {
                f.detached = true;
            }
        }
        if let Some(f) = self.ops.get_mut(&close.0) {
            f.abandoned = true;
        }
        self.reap_abandoned();
        Ok(())
    }

    fn start_close(&mut self, id: u64, e: Endpoint) -> Result<OpId> {
        let slot = Slot::new();
        // A live endpoint closes by flushing and telling the peer, bounded by the caller's
        // deadline: dropping a worker while the peer's reverse connection was still being
        // wired up made UCX 1.13 abort the *peer* ("unexpected error: Endpoint timeout"). A
        // failed endpoint is released at once (UCX accepts that only with peer-failure
        // handling, which a failed endpoint has).
        let failed = e.failed.get().is_some();
        let flags = if failed && e.detects {
            sys::UCP_EP_CLOSE_FLAG_FORCE
        } else {
            0
        };
        let mut param = sys::ucp_request_param_t {
            op_attr_mask: (sys::UCP_OP_ATTR_FIELD_CALLBACK
                | sys::UCP_OP_ATTR_FIELD_USER_DATA
                | sys::UCP_OP_ATTR_FIELD_FLAGS),
            flags,
            user_data: ptr::from_ref::<Slot>(&slot).cast_mut().cast(),
            ..Default::default()
        };
        param.cb.send = Some(on_done);
        // SAFETY: live endpoint, closed once (removed from the table by the caller); its
        // error slot and the request's slot are kept in `InFlight` until the close ends.
        let ret = unsafe { sys::ucp_ep_close_nbx(e.handle, &param) };
        self.track(ret, slot, Step::EpClose, e.peer, None, Some(e.failed))
            .map(|op| self.on_ep(op, id))
    }

    /// Records that `op` runs on endpoint `ep`.
    fn on_ep(&mut self, op: OpId, ep: u64) -> OpId {
        if let Some(f) = self.ops.get_mut(&op.0) {
            f.ep = Some(ep);
        }
        op
    }

    /// Waits for operation `op` until `deadline`. On [`Error::Deadline`] the operation stays
    /// with the worker (its memory registered) until UCX ends it.
    pub fn wait(&mut self, op: OpId, deadline: Instant) -> Result<()> {
        let started = Instant::now();
        loop {
            let f = self.ops.get_mut(&op.0).ok_or(Error::NotOpen {
                step: Step::Wait,
                what: "operation",
                id: op.0,
            })?;
            if let Some(code) = f.slot.get() {
                let f = self.ops.remove(&op.0).expect("present above");
                free_request(f.req);
                return check(code).map_err(|status| Error::Peer {
                    peer: f.peer,
                    step: f.step,
                    status,
                });
            }
            let now = Instant::now();
            if now >= deadline {
                f.abandoned = true;
                return Err(Error::Deadline {
                    peer: f.peer.clone(),
                    step: f.step,
                    waited: now - started,
                });
            }
            self.wait_events(deadline - now)?;
        }
    }

    /// Checks operation `op` without waiting (NIXL's `checkXfer`): `Ok(true)` once it
    /// completed (the operation is then gone), `Ok(false)` while it runs, its error if it
    /// failed. Call [`Worker::progress`] to advance it, e.g. when the event fd is readable.
    pub fn test(&mut self, op: OpId) -> Result<bool> {
        let f = self.ops.get(&op.0).ok_or(Error::NotOpen {
            step: Step::Wait,
            what: "operation",
            id: op.0,
        })?;
        let Some(code) = f.slot.get() else {
            return Ok(false);
        };
        let f = self.ops.remove(&op.0).expect("present above");
        free_request(f.req);
        check(code).map_err(|status| Error::Peer {
            peer: f.peer,
            step: f.step,
            status,
        })?;
        Ok(true)
    }

    /// How many operations UCX has not ended yet, including abandoned ones.
    pub fn in_flight(&self) -> usize {
        self.ops.values().filter(|f| f.slot.get().is_none()).count()
    }

    /// The operations a dropped worker waits for (bounded): those still running, except
    /// the ones toward a peer known to be gone.
    fn awaited_at_drop(&self) -> usize {
        self.ops
            .values()
            .filter(|f| !f.detached && f.slot.get().is_none())
            .count()
    }

    fn track(
        &mut self,
        ret: sys::ucs_status_ptr_t,
        slot: Box<Slot>,
        step: Step,
        peer: String,
        local: Option<Arc<RegionInner>>,
        ep_slot: Option<Box<Slot>>,
    ) -> Result<OpId> {
        if sys::status_ptr_is_err(ret) {
            // Nothing in flight: the local memory and slots can go now.
            return Err(Error::Peer {
                peer,
                step,
                status: status(sys::status_ptr_status(ret)),
            });
        }
        if ret.is_null() {
            slot.set(sys::UCS_OK);
        }
        let id = self.next();
        self.ops.insert(
            id,
            InFlight {
                req: ret,
                slot,
                step,
                peer,
                _local: local,
                _ep_slot: ep_slot,
                ep: None,
                abandoned: false,
                detached: false,
            },
        );
        Ok(OpId(id))
    }

    fn reap_abandoned(&mut self) {
        self.ops.retain(|_, f| {
            if f.abandoned && f.slot.get().is_some() {
                free_request(f.req);
                false
            } else {
                true
            }
        });
    }

    fn ep(&self, step: Step, ep: EpId) -> Result<&Endpoint> {
        let e = self.eps.get(&ep.0).ok_or(Error::NotOpen {
            step,
            what: "endpoint",
            id: ep.0,
        })?;
        if let Some(code) = e.failed.get() {
            return Err(Error::Peer {
                peer: e.peer.clone(),
                step,
                status: status(code),
            });
        }
        Ok(e)
    }

    fn next(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }
}

fn free_request(req: *mut c_void) {
    if !req.is_null() {
        // SAFETY: a request UCX returned from a `*_nbx` call, freed once: after completion, or
        // from `Drop` before the worker is destroyed (UCX then frees it when it ends; its
        // callback's slot is kept alive until the worker is gone).
        unsafe { sys::ucp_request_free(req) };
    }
}

/// Waits until `fd` is readable, at most `timeout`; whether it is.
fn poll_fd(fd: RawFd, timeout: Duration) -> Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // Round up so that a sub-millisecond remainder still sleeps instead of spinning.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Os {
                step: Step::Wait,
                source: err,
            });
        }
    }
    Ok(n > 0 && pfd.revents & libc::POLLIN != 0)
}

impl Worker {
    /// Progresses until nothing is left to send, at most until `deadline`: until progress
    /// handles nothing and the event fd, armed (UCX: no event pending), stays silent for
    /// [`DROP_QUIET_WAIT`]; a reply waiting for its connection is woken by the connection's
    /// event. While UCX says events are pending and progress handles none (a send waiting
    /// for room at a peer, for ever if it is dead) it naps by `BusyBackoff`, and once that
    /// lasted [`DROP_STUCK_WAIT`] counts as quiet. Returns whether it found the worker quiet
    /// before `deadline`.
    fn progress_until_quiet(&mut self, deadline: Instant) -> bool {
        let mut stuck_since: Option<Instant> = None;
        let mut busy = BusyBackoff::new();
        while Instant::now() < deadline {
            // SAFETY: live worker, used by this owner only.
            if unsafe { sys::ucp_worker_progress(self.handle) } > 0 {
                stuck_since = None;
                busy.reset();
                continue;
            }
            // SAFETY: as above.
            let code = unsafe { sys::ucp_worker_arm(self.handle) };
            if code == sys::UCS_ERR_BUSY {
                let since = *stuck_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= DROP_STUCK_WAIT {
                    return true;
                }
                let nap = busy
                    .idle()
                    .min(deadline.saturating_duration_since(Instant::now()));
                if !nap.is_zero() {
                    std::thread::sleep(nap);
                }
                continue;
            }
            if code != sys::UCS_OK {
                return false;
            }
            stuck_since = None;
            let wait = DROP_QUIET_WAIT.min(deadline.saturating_duration_since(Instant::now()));
            if !wait_readable(self.efd, wait) {
                return true;
            }
        }
        false
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        for (_, k) in self.rkeys.drain() {
            // SAFETY: keys unpacked on this worker, destroyed once, before their endpoints.
            unsafe { sys::ucp_rkey_destroy(k.handle) };
        }
        let eps: Vec<(u64, Endpoint)> = self.eps.drain().collect();
        for (id, e) in eps {
            let _ = self.start_close(id, e);
        }
        // What runs toward a peer known to be gone (`close_peer_gone`) is not waited for:
        // it never ends when the peer is dead.
        let deadline = Instant::now() + DROP_CLOSE_DEADLINE;
        while self.awaited_at_drop() > 0 && Instant::now() < deadline {
            if self.wait_events(deadline - Instant::now()).is_err() {
                break;
            }
        }
        let mut running = Vec::new();
        for (_, f) in self.ops.drain() {
            // UCX insists that every request be released before its endpoint goes; a request
            // still running is freed by UCX when it ends (here: with the worker).
            free_request(f.req);
            if f.slot.get().is_none() {
                // Its slot and the memory it may touch are dropped only after
                // `ucp_worker_destroy` below, so a late callback or transfer finds them alive.
                running.push(f);
            }
        }
        // Endpoints UCX made by itself for a peer's wireup are not ours to close; one whose
        // reply still waited in its send queue made UCX 1.13 abort the process in
        // `ucp_worker_destroy` (an assertion in the pending purge, "got REP message"; about
        // 1 in 4 runs of `tests/access_modes.rs` over tcp). Progress until the worker is
        // quiet lets such replies go out first, bounded.
        self.progress_until_quiet(Instant::now() + DROP_QUIET_DEADLINE);
        // SAFETY: live worker, destroyed once; endpoints closed and keys destroyed above.
        unsafe { sys::ucp_worker_destroy(self.handle) };
        drop(running);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::busy::BUSY_SPINS;
    use crate::context::ContextConfig;
    use std::os::fd::{FromRawFd, OwnedFd};

    /// UCX 1.13's tcp can leave the worker's fd readable with nothing for progress to handle.
    /// Stand a pipe holding a byte (readable until read, and never read) in for the fd: the
    /// rounds must back off to naps, not return at once for ever.
    #[test]
    fn a_readable_fd_with_nothing_to_handle_does_not_spin() {
        let ctx = Context::new(&ContextConfig::with_tls("tcp")).expect("context");
        let mut worker = Worker::new(&ctx).expect("worker");
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors `pipe` writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both fds were just opened by `pipe` and are owned here alone.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: one byte from a valid buffer into an open pipe.
        let written = unsafe { libc::write(write.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
        assert_eq!(written, 1);
        let efd = std::mem::replace(&mut worker.efd, read.as_raw_fd());
        let window = Duration::from_millis(200);
        let started = Instant::now();
        let mut rounds = 0u32;
        while started.elapsed() < window {
            worker.wait_events(Duration::from_millis(50)).expect("wait");
            rounds += 1;
        }
        worker.efd = efd;
        // Backing off: the spins, then naps from 10 µs doubling to 1 ms, about 270 rounds
        // in the window; a spinning loop takes tens of thousands.
        assert!(
            rounds > BUSY_SPINS,
            "{rounds} rounds: the fd was not readable"
        );
        assert!(rounds < 2_000, "{rounds} rounds in {window:?}: a busy loop");
    }
}
