//! `Channel`: the Python face of `kvbridge::Channel`.
//!
//! Every op is checked here before the engine sees it (which checks again), so bad input is
//! an `InvalidOp` before any byte moves. The channel holds what keeps registered Python
//! memory alive until the region is deregistered, or for good when a peer may still write it.

use crate::buffer::{self, Keep, Memory};
use crate::call::{self, EngineResult, Outcome};
use crate::errors;
use crate::grants::{self, Windows};
use crate::runtime;
use crate::transfer::{Slot, StopGuard, Transfer};
use kvbridge::config::DEFAULT_DATA_CONNECTIONS;
use kvbridge::proto::auth::Secret;
use kvbridge::proto::msg::Compat;
use kvbridge::{
    Access, Channel, ChannelConfig, Grant, GrantToken, Op, PeerId, Pem, Region, RegionId, Transport,
};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyInt, PyList, PyString};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A batch ready to run on the runtime.
type Batch = Pin<Box<dyn Future<Output = EngineResult<()>> + Send>>;

/// Memory whose peer may still write it after its channel let go of it (a peer that knew its
/// address never confirmed it stopped): kept alive until the process ends.
static KEPT_FOREVER: Mutex<Vec<Keep>> = Mutex::new(Vec::new());

fn keep_forever(keep: Option<Keep>) {
    if let Some(k) = keep {
        KEPT_FOREVER
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(k);
    }
}

/// A region registered through this binding.
struct Registered {
    region: Region,
    /// The memory may not be written (a read-only buffer): no read lands in it.
    readonly: bool,
    /// What keeps the memory valid (none for raw pointers: the caller does).
    keep: Option<Keep>,
}

/// An open channel.
struct Open {
    channel: Channel,
    regions: Mutex<HashMap<u128, Registered>>,
    /// Notifications a cancelled or interrupted receive took from the engine before it
    /// could hand them over: the next receive returns them first.
    returned: Returned,
    /// The windows this binding opened, and closes still draining.
    windows: Windows,
}

/// Notifications handed back by receives that could not deliver them, oldest first; a
/// receive waiting on the engine wakes when one is handed back.
#[derive(Default)]
struct ReturnedQueue {
    queue: Mutex<VecDeque<(String, Vec<u8>)>>,
    added: tokio::sync::Notify,
}

type Returned = Arc<ReturnedQueue>;

fn give_back(returned: &Returned, got: Option<(String, Vec<u8>)>) {
    if let Some(n) = got {
        returned
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_front(n);
        returned.added.notify_waiters();
    }
}

fn take_returned(returned: &Returned) -> Option<(String, Vec<u8>)> {
    returned
        .queue
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop_front()
}

impl Open {
    fn regions(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Registered>> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Write,
    Read,
}

impl Dir {
    fn name(self) -> &'static str {
        match self {
            Dir::Write => "write",
            Dir::Read => "read",
        }
    }
}

fn region_key(id: RegionId) -> u128 {
    u128::from_be_bytes(id.0)
}

fn region_id(key: u128) -> RegionId {
    RegionId(key.to_be_bytes())
}

/// A non-negative integer argument that fits `u64`; `InvalidOp` when it is an integer out of
/// range, `TypeError` when it is not an integer.
pub(crate) fn index_arg(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    match obj.extract::<u64>() {
        Ok(v) => Ok(v),
        Err(_) if obj.is_instance_of::<PyInt>() || obj.hasattr("__index__")? => Err(
            errors::invalid(py, format!("{what} {obj} is out of range (0..2^64)")),
        ),
        Err(_) => Err(PyTypeError::new_err(format!(
            "{what} must be an int, not {}",
            obj.get_type().name()?
        ))),
    }
}

pub(crate) fn usize_arg(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<usize> {
    let v = index_arg(py, obj, what)?;
    usize::try_from(v).map_err(|_| errors::invalid(py, format!("{what} {v} is out of range")))
}

fn region_arg(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<u128> {
    match obj.extract::<u128>() {
        Ok(v) => Ok(v),
        Err(_) if obj.is_instance_of::<PyInt>() || obj.hasattr("__index__")? => Err(
            errors::invalid(py, format!("region id {obj} is out of range")),
        ),
        Err(_) => Err(PyTypeError::new_err(format!(
            "a region id must be an int, not {}",
            obj.get_type().name()?
        ))),
    }
}

fn indices(py: Python<'_>, seq: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    if seq.is_instance_of::<PyString>() || seq.is_instance_of::<PyBytes>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a sequence of ints"
        )));
    }
    let mut out = Vec::with_capacity(seq.len().unwrap_or(0));
    for item in seq.try_iter()? {
        out.push(index_arg(py, &item?, what)?);
    }
    Ok(out)
}

fn peer_arg(py: Python<'_>, peer: &str) -> PyResult<PeerId> {
    PeerId::new(peer).ok_or_else(|| errors::invalid(py, format!("{peer:?} is not a valid peer id")))
}

fn bytes_arg(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(b) = obj.downcast::<PyByteArray>() {
        return Ok(b.to_vec());
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err("data must be bytes, not str"));
    }
    let b = obj
        .py()
        .import("builtins")?
        .getattr("bytes")?
        .call1((obj,))?;
    Ok(b.downcast::<PyBytes>()?.as_bytes().to_vec())
}

/// A secret or key argument (bytes or str); empty is refused, naming `what`.
fn key_arg(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Secret> {
    let bytes = if let Ok(s) = obj.downcast::<PyString>() {
        s.to_str()?.as_bytes().to_vec()
    } else {
        bytes_arg(obj)?
    };
    Secret::new(bytes).ok_or_else(|| errors::invalid(py, format!("{what} is empty")))
}

fn none(py: Python<'_>, _: ()) -> PyResult<PyObject> {
    Ok(py.None())
}

/// What a cancelled batch waits for after the engine dropped it, where the drop cannot wait:
/// a batch posted on UCX may still land until its session's teardown ended (the engine ends
/// the session at the cancel; `Channel::disconnect` returns once the teardown ended). So a
/// cancel of a batch to a peer whose session carries UCX, or whose session is already
/// ending, ends that session and waits for its teardown.
fn ucx_teardown(channel: Channel, peer: PeerId, what: String) -> call::Settle {
    Box::new(move || {
        Box::pin(async move {
            let ending = match channel.peer_transport(&peer).await {
                Ok(t) => t == Transport::Ucx,
                Err(_) => true,
            };
            if ending {
                let reason = format!("the {what} was cancelled");
                let _ = channel.disconnect(&peer, &reason).await;
            }
        })
    })
}

/// FNV-1a: the compatibility hash of a description (peers compare hashes).
fn compat_hash(description: &str) -> u64 {
    description.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The regions a peer grants, as ``Channel.peer_regions`` lists them.
#[pyclass(frozen, get_all, module = "kvbridge._native", name = "RegionInfo")]
pub(crate) struct PyRegionInfo {
    /// The region's id (pass it as ``remote_region``).
    id: u128,
    /// Its size in bytes.
    length: u64,
    /// Its page size in bytes (remote pages are counted in it).
    page_size: u64,
}

#[pymethods]
impl PyRegionInfo {
    fn __repr__(&self) -> String {
        format!(
            "RegionInfo(id={}, length={}, page_size={})",
            self.id, self.length, self.page_size
        )
    }
}

/// A kvbridge endpoint: it listens for peers (when ``listen`` is set), connects to peers
/// lazily, and moves bytes between registered memory regions with one-sided batched writes
/// and reads, plus ordered notifications.
///
/// - ``peer_id``: this side's stable id, e.g. ``"prefill-0/rank0"``.
/// - ``listen``: ``"127.0.0.1:0"`` listens (port 0 picks one; see ``local_addr``); ``None``
///   makes an initiator-only channel.
/// - ``secret``: shared secret (bytes or str); peers that cannot prove they know it are
///   refused (``Unauthenticated``). Default: ``KVBRIDGE_SECRET``.
/// - ``peer_key``: this side's own key (bytes or str, 16 bytes or more), the one a
///   listener's keyring (``KVBRIDGE_PEER_KEYS``) lists for ``peer_id``: dialing, the channel
///   proves it to a listener that proves it and ``secret`` to any other; its own listener
///   still takes ``secret`` from others. A key equal to ``secret``, or one on a listening
///   channel without a secret, raises ``LocalError``. Default: ``KVBRIDGE_PEER_KEY``.
/// - ``transport``: ``"auto"`` (shared memory with a peer on this host, else TCP), ``"tcp"``,
///   ``"shm"`` or ``"ucx"`` (UCX's one-sided puts and gets with a peer that offers UCX, else
///   TCP; in a package built with UCX, see ``kvbridge.TRANSPORTS``). Default:
///   ``KVBRIDGE_TRANSPORT``, else auto.
/// - ``ucx_trusted_fabric``: the statement that every process able to reach this host's UCX
///   transports is trusted with this process's memory. UCX authenticates no peer; without
///   this statement ``"ucx"`` runs only where ``UCX_TLS`` names ``posix``, ``cma`` and
///   ``self`` (same-user, same-host transports) and any other setting raises ``LocalError``
///   naming the transports. Default: ``KVBRIDGE_UCX_TRUSTED_FABRIC=1``, else off.
/// - ``tls_cert``/``tls_key``: PEM files, for a listener with TLS on its control connection;
///   ``tls_ca``/``tls_server_name``: what an initiator trusts. Default: ``KVBRIDGE_TLS_*``.
/// - ``compat``: a description of what peers must match (KV layout, dtype...); peers with
///   different ones refuse each other (``Incompatible``).
/// - ``use_env``: read the ``KVBRIDGE_*`` environment variables as the Rust API does.
/// - ``deadlines``: seconds per step, by name: ``connect``, ``handshake_step``, ``op`` (a
///   whole batch or notification), ``first_frame``, ``control_write``, ``keepalive``,
///   ``peer_silence``, ``close``. Every wait has one; a passed deadline raises ``Timeout``.
///
/// Blocking methods release the GIL and wake every 100 ms to let Python handle signals
/// (Ctrl-C raises ``KeyboardInterrupt`` and abandons the call; the channel stays usable).
/// ``*_async`` methods return a ``kvbridge.Call``, an asyncio future of the running loop;
/// cancelling it (or the task awaiting it) ends only once the engine let go of the call's
/// memory, as ``Transfer.cancel`` does. ``submit_*`` methods return a ``Transfer`` to poll. Errors are ``kvbridge.KvbridgeError`` subclasses with
/// ``.peer`` and ``.step``. After ``close()`` every call raises ``kvbridge.Closed``.
#[pyclass(frozen, module = "kvbridge._native", name = "Channel")]
pub(crate) struct PyChannel {
    open: Mutex<Option<Arc<Open>>>,
    peer_id: String,
    local_addr: Option<String>,
    /// The process the channel was created in: its tasks run on that process's runtime, so
    /// in a child made by `fork` the channel cannot work (a call would wait for a task that
    /// does not exist there).
    pid: u32,
}

impl PyChannel {
    fn open(&self, py: Python<'_>) -> PyResult<Arc<Open>> {
        if self.forked() {
            return Err(errors::local(
                py,
                format!(
                    "channel {} was created in process {}, before a fork: create channels in the process that uses them",
                    self.peer_id, self.pid
                ),
            ));
        }
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| errors::closed(py))
    }

    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Lets go of an open channel: closes it in the process that created it; in a forked
    /// child, where its tasks do not exist, leaves it untouched (dropping it would wait on
    /// them, and its memory belongs to the parent's sessions).
    fn release(&self, py: Python<'_>, open: Arc<Open>) -> PyResult<()> {
        if self.forked() {
            std::mem::forget(open);
            return Ok(());
        }
        Self::shut(py, open)
    }

    /// The local side of a batch by pages: checked, before the peer's regions are known.
    #[allow(clippy::too_many_arguments)]
    fn pages_batch(
        &self,
        py: Python<'_>,
        dir: Dir,
        peer: &str,
        local_region: &Bound<'_, PyAny>,
        local_pages: &Bound<'_, PyAny>,
        remote_region: &Bound<'_, PyAny>,
        remote_pages: &Bound<'_, PyAny>,
        page_len: Option<&Bound<'_, PyAny>>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Batch, String)> {
        let open = self.open(py)?;
        let peer_id = peer_arg(py, peer)?;
        let token = grants::opt_token_arg(py, token)?;
        let local_key = region_arg(py, local_region)?;
        let remote = region_id(region_arg(py, remote_region)?);
        let local_pages = indices(py, local_pages, "local page")?;
        let remote_pages = indices(py, remote_pages, "remote page")?;
        let bad = |msg: String| {
            errors::make(
                py,
                "InvalidOp",
                format!("invalid op for peer {peer}: {msg}"),
                Some(peer),
                None,
                None,
            )
        };
        if local_pages.len() != remote_pages.len() {
            return Err(bad(format!(
                "{} local pages but {} remote pages",
                local_pages.len(),
                remote_pages.len()
            )));
        }
        let local = {
            let regions = open.regions();
            let reg = regions
                .get(&local_key)
                .ok_or_else(|| bad(format!("local region {local_key} is not registered")))?;
            if dir == Dir::Read && reg.readonly {
                return Err(bad(format!(
                    "local region {local_key} is a read-only buffer: nothing may be read into it"
                )));
            }
            reg.region.clone()
        };
        let page_len = match page_len {
            Some(p) => usize_arg(py, p, "page_len")?,
            None => local.page_size(),
        };
        if page_len == 0 {
            return Err(bad("page_len is 0".into()));
        }
        let mut local_offsets = Vec::with_capacity(local_pages.len());
        for (i, &p) in local_pages.iter().enumerate() {
            let off = usize::try_from(p)
                .ok()
                .and_then(|p| p.checked_mul(local.page_size()))
                .filter(|off| off.checked_add(page_len).is_some_and(|end| end <= local.len()))
                .ok_or_else(|| {
                    bad(format!(
                        "local page {p} (op {i}) with page_len {page_len} is outside local region {local_key} ({} pages of {} bytes)",
                        local.pages(),
                        local.page_size()
                    ))
                })?;
            local_offsets.push(off);
        }
        let channel = open.channel.clone();
        let what = format!(
            "{} of {} pages with peer {peer}",
            dir.name(),
            local_offsets.len()
        );
        let peer = peer.to_string();
        let batch = async move {
            let regions = channel.peer_regions(&peer_id).await?;
            let info = regions
                .iter()
                .find(|r| r.id == remote)
                .ok_or_else(|| Outcome::Invalid {
                    peer: peer.clone(),
                    message: format!("the peer grants no region {}", region_key(remote)),
                })?;
            let len = page_len as u64;
            let mut ops = Vec::with_capacity(local_offsets.len());
            for (i, (&lo, &rp)) in local_offsets.iter().zip(&remote_pages).enumerate() {
                let ro = rp
                    .checked_mul(info.page_size)
                    .filter(|off| off.checked_add(len).is_some_and(|end| end <= info.len))
                    .ok_or_else(|| Outcome::Invalid {
                        peer: peer.clone(),
                        message: format!(
                            "remote page {rp} (op {i}) with page_len {page_len} is outside the peer's region {} ({} bytes, pages of {})",
                            region_key(remote),
                            info.len,
                            info.page_size
                        ),
                    })?;
                ops.push(Op {
                    local: local.clone(),
                    local_offset: lo,
                    remote,
                    remote_offset: ro,
                    len: page_len,
                });
            }
            if ops.is_empty() {
                return Ok(());
            }
            Ok(run(&channel, dir, &peer_id, token, &ops).await?)
        };
        Ok((Box::pin(batch), what))
    }

    /// A batch of `(local_region, local_offset, remote_region, remote_offset, length)` ops,
    /// its local side checked (the engine checks the remote side before any byte moves).
    fn ops_batch(
        &self,
        py: Python<'_>,
        dir: Dir,
        peer: &str,
        ops: &Bound<'_, PyAny>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<(Batch, String)> {
        let open = self.open(py)?;
        let peer_id = peer_arg(py, peer)?;
        let token = grants::opt_token_arg(py, token)?;
        let bad = |msg: String| {
            errors::make(
                py,
                "InvalidOp",
                format!("invalid op for peer {peer}: {msg}"),
                Some(peer),
                None,
                None,
            )
        };
        let mut batch = Vec::with_capacity(ops.len().unwrap_or(0));
        {
            let regions = open.regions();
            for (i, op) in ops.try_iter()?.enumerate() {
                let op = op?;
                let n = op.len()?;
                if n != 5 {
                    return Err(bad(format!(
                        "op {i} has {n} fields, not (local_region, local_offset, remote_region, remote_offset, length)"
                    )));
                }
                let local_key = region_arg(py, &op.get_item(0)?)?;
                let local_offset = usize_arg(py, &op.get_item(1)?, "local offset")?;
                let remote = region_id(region_arg(py, &op.get_item(2)?)?);
                let remote_offset = index_arg(py, &op.get_item(3)?, "remote offset")?;
                let len = usize_arg(py, &op.get_item(4)?, "length")?;
                let reg = regions.get(&local_key).ok_or_else(|| {
                    bad(format!(
                        "op {i}: local region {local_key} is not registered"
                    ))
                })?;
                if dir == Dir::Read && reg.readonly {
                    return Err(bad(format!("op {i}: local region {local_key} is a read-only buffer: nothing may be read into it")));
                }
                if len == 0 {
                    return Err(bad(format!("op {i} has length 0")));
                }
                if local_offset
                    .checked_add(len)
                    .is_none_or(|end| end > reg.region.len())
                {
                    return Err(bad(format!(
                        "op {i}: local bytes {local_offset}+{len} are outside local region {local_key} ({} bytes)",
                        reg.region.len()
                    )));
                }
                if remote_offset.checked_add(len as u64).is_none() {
                    return Err(bad(format!(
                        "op {i}: remote offset {remote_offset}+{len} overflows"
                    )));
                }
                batch.push(Op {
                    local: reg.region.clone(),
                    local_offset,
                    remote,
                    remote_offset,
                    len,
                });
            }
        }
        let channel = open.channel.clone();
        let what = format!("{} of {} ops with peer {peer}", dir.name(), batch.len());
        let fut = async move {
            if batch.is_empty() {
                return Ok(());
            }
            Ok(run(&channel, dir, &peer_id, token, &batch).await?)
        };
        Ok((Box::pin(fut), what))
    }

    /// How long a close waits for its drain: `timeout` seconds, else the op deadline.
    fn drain_limit(&self, py: Python<'_>, open: &Open, timeout: Option<f64>) -> PyResult<Duration> {
        Ok(timeout_arg(py, timeout)?.unwrap_or(open.channel.config().deadlines.op))
    }

    /// `batch` as a [`Transfer`]; cancelled over UCX, it ends the session with `peer` and
    /// counts as stopped once that session's teardown ended.
    fn submit(
        &self,
        py: Python<'_>,
        (batch, what): (Batch, String),
        peer: &str,
    ) -> PyResult<Transfer> {
        let settle = ucx_teardown(
            self.open(py)?.channel.clone(),
            peer_arg(py, peer)?,
            what.clone(),
        );
        let slot = Arc::new(Slot::default());
        let filled = slot.clone();
        // Dropped right after the batch's future, even if that was never polled.
        let stop = StopGuard::new(slot.clone(), settle);
        let abort = call::spawn(
            py,
            call::Then::new(async move { filled.ran(batch.await) }, stop),
        )?;
        Ok(Transfer::new(slot, abort, what))
    }

    /// `batch` as an awaitable (`call::awaitable`): cancelled, it turns cancelled once the
    /// engine let go of the batch's memory; should that take longer than the op deadline and
    /// [`call::LET_GO_GRACE`], it ends the session with `peer` and raises `Timeout`.
    fn batch_awaitable<'py>(
        &self,
        py: Python<'py>,
        (batch, what): (Batch, String),
        peer: &str,
        dir: Dir,
    ) -> PyResult<Bound<'py, PyAny>> {
        let channel = self.open(py)?.channel.clone();
        let peer_id = peer_arg(py, peer)?;
        let limit = channel.config().deadlines.op + call::LET_GO_GRACE;
        let reason = format!("the cancelled {what} was still held {limit:?} after its cancel");
        let settle = ucx_teardown(channel.clone(), peer_id.clone(), what.clone());
        let end = move || {
            let (channel, peer, reason) = (channel.clone(), peer_id.clone(), reason.clone());
            if let Ok(rt) = runtime::handle() {
                rt.spawn(async move { channel.disconnect(&peer, &reason).await });
            }
        };
        let stuck = call::Stuck {
            what,
            peer: Some(peer.to_string()),
            step: dir.name(),
            limit,
            end: Some(Box::new(end)),
            settle: Some(settle),
        };
        call::awaitable(py, batch, none, stuck)
    }

    /// What a cancelled awaitable that touches no caller memory names when the engine did
    /// not let go of it in time (it ends no session).
    fn stuck(
        &self,
        open: &Open,
        what: String,
        peer: Option<String>,
        step: &'static str,
    ) -> call::Stuck {
        call::Stuck {
            what,
            peer,
            step,
            limit: open.channel.config().deadlines.op + call::LET_GO_GRACE,
            end: None,
            settle: None,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn register_memory(
        &self,
        py: Python<'_>,
        mem: Memory,
        page_size: usize,
        peers: Option<Vec<String>>,
        access: &str,
        direct_copies: bool,
        windows: Option<&str>,
    ) -> PyResult<u128> {
        let open = self.open(py)?;
        let Memory {
            ptr,
            len: length,
            readonly,
            keep,
        } = mem;
        if ptr == 0 {
            return Err(errors::invalid(py, "null pointer"));
        }
        if length == 0 {
            return Err(errors::invalid(py, "length is 0"));
        }
        if page_size == 0 {
            return Err(errors::invalid(py, "page size is 0"));
        }
        if length % page_size != 0 {
            return Err(errors::invalid(
                py,
                format!("page size {page_size} does not divide length {length}"),
            ));
        }
        if ptr.checked_add(length).is_none() {
            return Err(errors::invalid(
                py,
                format!("pointer {ptr:#x} + length {length} overflows the address space"),
            ));
        }
        let grant = match peers {
            None => Grant::AllPeers,
            Some(p) => Grant::Peers(p.iter().map(|s| peer_arg(py, s)).collect::<PyResult<_>>()?),
        };
        let access = grants::access_arg(py, access, "access")?;
        let confined = windows
            .map(|w| grants::access_arg(py, w, "windows"))
            .transpose()?;
        // Where a peer copies by itself (shared memory, cross-memory attach) no mode holds,
        // so only a region no peer can write over any transport may be read-only memory.
        let peers_cannot_write =
            grant == Grant::Peers(Vec::new()) || (access == Access::ReadOnly && !direct_copies);
        if readonly && !peers_cannot_write {
            return Err(errors::invalid(
                py,
                "a read-only buffer can only be registered with peers=[] or access=\"read\" without \
                 direct_copies (a peer that may write the region would write it)",
            ));
        }
        let mut permission = grant.with_access(access);
        if direct_copies {
            permission = permission.with_direct_copies();
        }
        if let Some(c) = confined {
            if c != Access::WriteOnly {
                permission = permission.reads_in_windows();
            }
            if c != Access::ReadOnly {
                permission = permission.writes_in_windows();
            }
        }
        // SAFETY: for raw pointers the caller guarantees what Channel.register's docstring
        // lists; for Python objects `keep` holds the buffer export, or the tensor and its
        // storage (never one torch may reallocate), until the region is deregistered and no
        // transfer touches it, or for good.
        let region = unsafe { Region::from_raw(ptr as *mut u8, length, page_size) }
            .map_err(|e| errors::to_py(py, &e))?;
        open.channel
            .register(&region, permission)
            .map_err(|e| errors::to_py(py, &e))?;
        let key = region_key(region.id());
        open.regions().insert(
            key,
            Registered {
                region,
                readonly,
                keep,
            },
        );
        Ok(key)
    }

    /// Closes the engine's channel, then lets go of registered memory no peer can still
    /// reach.
    fn shut(py: Python<'_>, open: Arc<Open>) -> PyResult<()> {
        let channel = open.channel.clone();
        let r = call::block_on_uninterrupted(py, async move { channel.close().await });
        let regions: Vec<Registered> = open.regions().drain().map(|(_, r)| r).collect();
        for r in regions {
            if r.region.is_tainted() || r.region.in_use() > 0 || r.region.cma_exports() > 0 {
                keep_forever(r.keep);
            }
        }
        r
    }
}

#[pymethods]
impl PyChannel {
    #[new]
    #[pyo3(signature = (peer_id, listen=None, *, secret=None, peer_key=None, transport=None, tls_cert=None, tls_key=None, tls_ca=None, tls_server_name=None, compat=None, use_env=true, deadlines=None, ucx_trusted_fabric=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        peer_id: &str,
        listen: Option<&str>,
        secret: Option<&Bound<'_, PyAny>>,
        peer_key: Option<&Bound<'_, PyAny>>,
        transport: Option<&str>,
        tls_cert: Option<PathBuf>,
        tls_key: Option<PathBuf>,
        tls_ca: Option<PathBuf>,
        tls_server_name: Option<String>,
        compat: Option<&str>,
        use_env: bool,
        deadlines: Option<HashMap<String, f64>>,
        ucx_trusted_fabric: Option<bool>,
    ) -> PyResult<Self> {
        peer_arg(py, peer_id)?;
        let mut config = ChannelConfig::new(peer_id, listen);
        if !use_env {
            config.secret = None;
            config.peer_key = None;
            config.tls = None;
            config.data_threads = true;
            config.transport = Transport::Auto;
            config.cma = true;
            config.data_connections = DEFAULT_DATA_CONNECTIONS;
            config.ucx_shm_lanes = true;
            config.ucx_trusted_fabric = false;
        }
        if let Some(trusted) = ucx_trusted_fabric {
            config.ucx_trusted_fabric = trusted;
        }
        if let Some(s) = secret {
            config.secret = Some(key_arg(py, s, "the secret")?);
        }
        if let Some(k) = peer_key {
            config.peer_key = Some(key_arg(py, k, "peer_key")?);
        }
        if let Some(t) = transport {
            config.transport = Transport::parse(t).ok_or_else(|| {
                errors::invalid(
                    py,
                    format!("transport {t:?}: expected auto, tcp, shm or ucx"),
                )
            })?;
        }
        // Whether it came from the argument or from KVBRIDGE_TRANSPORT: the engine would only
        // say its build has no UCX; the package's user needs to know how to build one.
        if config.transport == Transport::Ucx && !crate::features::UCX_BUILT {
            return Err(errors::invalid(
                py,
                "transport \"ucx\" (the argument or KVBRIDGE_TRANSPORT): this kvbridge package was built without UCX (build it with the cargo feature `ucx`: MATURIN_PEP517_ARGS=\"--features ucx\" pip install ./python)",
            ));
        }
        if tls_cert.is_some() || tls_key.is_some() || tls_ca.is_some() || tls_server_name.is_some()
        {
            let mut tls = config.tls.take().unwrap_or_default();
            if let Some(p) = tls_cert {
                tls.cert_chain = Some(Pem::File(p));
            }
            if let Some(p) = tls_key {
                tls.private_key = Some(Pem::File(p));
            }
            if let Some(p) = tls_ca {
                tls.trusted = Some(Pem::File(p));
            }
            if tls_server_name.is_some() {
                tls.server_name = tls_server_name;
            }
            config.tls = Some(tls);
        }
        if let Some(c) = compat {
            config.compat = Compat {
                hash: compat_hash(c),
                description: c.to_string(),
            };
        }
        for (name, secs) in deadlines.unwrap_or_default() {
            if !(secs.is_finite() && secs > 0.0 && secs < 1e9) {
                return Err(errors::invalid(
                    py,
                    format!("deadline {name}={secs}: expected seconds > 0"),
                ));
            }
            let d = Duration::from_secs_f64(secs);
            let slot = match name.as_str() {
                "connect" => &mut config.deadlines.connect,
                "handshake_step" => &mut config.deadlines.handshake_step,
                "op" => &mut config.deadlines.op,
                "first_frame" => &mut config.deadlines.first_frame,
                "control_write" => &mut config.deadlines.control_write,
                "keepalive" => &mut config.deadlines.keepalive,
                "peer_silence" => &mut config.deadlines.peer_silence,
                "close" => &mut config.deadlines.close,
                _ => {
                    return Err(errors::invalid(
                        py,
                        format!("unknown deadline {name:?}: expected connect, handshake_step, op, first_frame, control_write, keepalive, peer_silence or close"),
                    ))
                }
            };
            *slot = d;
        }
        let channel = call::block_on(py, async move { Ok(Channel::new(config).await?) })?;
        let local_addr = channel.local_addr().map(|a| a.to_string());
        Ok(Self {
            open: Mutex::new(Some(Arc::new(Open {
                channel,
                regions: Mutex::new(HashMap::new()),
                returned: Returned::default(),
                windows: Windows::default(),
            }))),
            peer_id: peer_id.to_string(),
            pid: std::process::id(),
            local_addr,
        })
    }

    /// This side's peer id.
    #[getter]
    fn peer_id(&self) -> &str {
        &self.peer_id
    }

    /// ``"host:port"`` the channel listens on, or ``None`` for an initiator-only channel.
    #[getter]
    fn local_addr(&self) -> Option<&str> {
        self.local_addr.as_deref()
    }

    /// The transport this channel was opened with (``"auto"``, ``"tcp"``, ``"shm"`` or
    /// ``"ucx"``), from the argument or ``KVBRIDGE_TRANSPORT``; ``None`` once closed.
    #[getter]
    fn transport(&self) -> Option<&'static str> {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.as_ref().map(|o| o.channel.config().transport.name())
    }

    /// Whether ``close()`` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
    }

    /// Registers caller memory ``ptr .. ptr+length`` in pages of ``page_size`` bytes (which
    /// must divide ``length``) and returns its region id. ``peers``: the peer ids that may
    /// address it (default: every peer). ``access``: what they may do, ``"readwrite"``
    /// (default), ``"read"`` or ``"write"``; a region with a mode is carried over TCP only,
    /// where the owner does the copy and refuses the rest, unless ``direct_copies=True``:
    /// then same-host peers map it or copy by address and reach all of it, and the mode
    /// holds for peers over TCP. ``windows``: ``"read"``, ``"write"`` or ``"readwrite"``
    /// confines peers' reads, writes or both to the windows opened with ``open_window`` (for
    /// a peer, or for a grant token); like a mode, it keeps the region on TCP unless
    /// ``direct_copies=True``.
    ///
    /// kvbridge cannot check a raw pointer; the caller guarantees, from this call until
    /// ``deregister`` (or ``close``) has returned, and for good if ``deregister`` raises that
    /// a peer may still write the region:
    ///
    /// * ``ptr .. ptr+length`` is memory of this process, readable, and writable if a peer
    ///   may write it, and is not freed, unmapped, reallocated or moved: its owner (a
    ///   tensor, an array, an mmap) is kept alive and never resized in place;
    /// * the process reads or writes those bytes only as data that peers may change at any
    ///   time (a transfer may land in the middle of a read), and frees nothing inside them.
    ///
    /// Breaking either lets a peer read or write freed or reused memory of this process.
    /// ``register_buffer`` keeps its object's memory valid itself; prefer it.
    #[pyo3(signature = (ptr, length, page_size, *, peers=None, access="readwrite", direct_copies=false, windows=None))]
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        py: Python<'_>,
        ptr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        page_size: &Bound<'_, PyAny>,
        peers: Option<Vec<String>>,
        access: &str,
        direct_copies: bool,
        windows: Option<&str>,
    ) -> PyResult<u128> {
        let ptr = usize_arg(py, ptr, "pointer")?;
        let length = usize_arg(py, length, "length")?;
        let page_size = usize_arg(py, page_size, "page size")?;
        self.register_memory(
            py,
            Memory {
                ptr,
                len: length,
                readonly: false,
                keep: None,
            },
            page_size,
            peers,
            access,
            direct_copies,
            windows,
        )
    }

    /// Registers the memory of ``obj`` and returns its region id: a C-contiguous
    /// buffer-protocol object (bytearray, numpy array, memoryview) or a contiguous CPU
    /// tensor (``data_ptr()`` and ``nbytes``). The channel keeps ``obj`` (and its buffer
    /// export, so a bytearray cannot be resized; a tensor's storage, so ``set_`` cannot free
    /// it) until ``deregister``/``close``. A tensor whose storage torch may reallocate
    /// (``resizable()``: any tensor torch allocated, such as ``torch.zeros``) is refused,
    /// as ``resize_`` would move its memory under the peers: register one over memory torch
    /// did not allocate (``torch.frombuffer``, ``torch.from_numpy``). ``peers``, ``access``
    /// and ``direct_copies`` as for ``register``. A read-only buffer is refused unless no
    /// peer can write it: ``peers=[]`` (then it can only be the source of writes), or
    /// ``access="read"`` without ``direct_copies``. ``windows`` as for ``register``.
    #[pyo3(signature = (obj, page_size, *, peers=None, access="readwrite", direct_copies=false, windows=None))]
    #[allow(clippy::too_many_arguments)]
    fn register_buffer(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        page_size: &Bound<'_, PyAny>,
        peers: Option<Vec<String>>,
        access: &str,
        direct_copies: bool,
        windows: Option<&str>,
    ) -> PyResult<u128> {
        self.open(py)?;
        let page_size = usize_arg(py, page_size, "page size")?;
        let mem = buffer::memory_of(obj)?;
        self.register_memory(py, mem, page_size, peers, access, direct_copies, windows)
    }

    /// Opens ``length`` bytes at ``offset`` of a region registered with ``windows=`` to
    /// either one peer (``peer="decode-0"``) or whoever names a grant token in its
    /// transfers (``token=``, 16 bytes: ``kvbridge.new_grant_token()``), for ``access``:
    /// ``"read"``, ``"write"`` or ``"readwrite"``. Returns the window's id. Cheap: nothing
    /// is sent. The region's owner checks each op of a peer's batch where it does the copy
    /// (TCP): an op in a confined direction passes only inside windows open to the token
    /// the batch names or to the peer itself; anything else raises ``Rejected`` with code
    /// ``AccessDenied`` on the peer's side (a write also ends its session; a read does
    /// not: it carries no payload, and the peer's other transfers go on). Raises ``InvalidOp`` when
    /// the region is not registered, the range is empty or outside it, it overlaps a window
    /// open to the same holder, or the region confines neither direction ``access`` names.
    #[pyo3(signature = (region, offset, length, *, peer=None, token=None, access))]
    #[allow(clippy::too_many_arguments)]
    fn open_window(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        offset: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
        peer: Option<&str>,
        token: Option<&Bound<'_, PyAny>>,
        access: &str,
    ) -> PyResult<u64> {
        let open = self.open(py)?;
        let key = region_arg(py, region)?;
        let offset = index_arg(py, offset, "offset")?;
        let length = index_arg(py, length, "length")?;
        let access = grants::access_arg(py, access, "access")?;
        let token = grants::opt_token_arg(py, token)?;
        if !open.regions().contains_key(&key) {
            return Err(errors::invalid(
                py,
                format!("region {key} is not registered"),
            ));
        }
        let opened = match (peer, token) {
            (Some(p), None) => {
                let p = peer_arg(py, p)?;
                open.channel
                    .open_peer_window(region_id(key), &p, offset, length, access)
            }
            (None, Some(t)) => {
                open.channel
                    .open_token_window(region_id(key), &t, offset, length, access)
            }
            _ => {
                return Err(errors::invalid(
                    py,
                    "a window is open to exactly one holder: pass peer= or token=",
                ))
            }
        };
        let id = opened.map_err(|e| errors::invalid(py, e.to_string()))?;
        Ok(open.windows.opened(id, token))
    }

    /// Opens one window per offset of ``offsets`` on ``region``, each ``lengths`` bytes long
    /// (an int for all of them, or one int per offset), to ``peer`` or ``token`` for
    /// ``access``, as ``open_window`` does for one; all or none, in one call and one lock of
    /// the engine's table (for an owner that opens the pages of an allocation together).
    /// Returns the windows' ids in the order of ``offsets``. Raises ``InvalidOp`` (nothing
    /// opened) when any window would fail alone, when two of them overlap, or when
    /// ``lengths`` is a list of another length than ``offsets``.
    #[pyo3(signature = (region, offsets, lengths, *, peer=None, token=None, access))]
    #[allow(clippy::too_many_arguments)]
    fn open_windows(
        &self,
        py: Python<'_>,
        region: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        peer: Option<&str>,
        token: Option<&Bound<'_, PyAny>>,
        access: &str,
    ) -> PyResult<Vec<u64>> {
        let open = self.open(py)?;
        let key = region_arg(py, region)?;
        let offsets = indices(py, offsets, "offset")?;
        let lengths = if lengths.is_instance_of::<PyInt>() || lengths.extract::<u64>().is_ok() {
            vec![index_arg(py, lengths, "length")?; offsets.len()]
        } else {
            indices(py, lengths, "length")?
        };
        if lengths.len() != offsets.len() {
            return Err(errors::invalid(
                py,
                format!("{} offsets but {} lengths", offsets.len(), lengths.len()),
            ));
        }
        let access = grants::access_arg(py, access, "access")?;
        let token = grants::opt_token_arg(py, token)?;
        if !open.regions().contains_key(&key) {
            return Err(errors::invalid(
                py,
                format!("region {key} is not registered"),
            ));
        }
        let ranges: Vec<(u64, u64)> = offsets.into_iter().zip(lengths).collect();
        let opened = match (peer, token) {
            (Some(p), None) => {
                let p = peer_arg(py, p)?;
                open.channel
                    .open_peer_windows(region_id(key), &p, &ranges, access)
            }
            (None, Some(t)) => open
                .channel
                .open_token_windows(region_id(key), &t, &ranges, access),
            _ => {
                return Err(errors::invalid(
                    py,
                    "a window is open to exactly one holder: pass peer= or token=",
                ))
            }
        };
        let ids = opened.map_err(|e| errors::invalid(py, e.to_string()))?;
        Ok(open.windows.opened_many(&ids, token))
    }

    /// Closes the windows of ``window_ids`` at once (one lock of the engine's table): no op
    /// passes any of them from now on. Then waits, at most ``timeout`` seconds for all of
    /// them together (default: the channel's ``op`` deadline; ``0`` does not wait), until
    /// the ops that had passed them ended. Returns the ids whose ops had not ended by then
    /// (call again with them to wait again); ``[]`` once every one drained. Unlike
    /// ``close_window``, an id that is neither open nor closing (never handed out, or its
    /// close already seen drained, by this or another caller) counts as drained: closers
    /// racing on one window (a free and a reallocation) all see it end.
    #[pyo3(signature = (window_ids, timeout=None))]
    fn close_windows(
        &self,
        py: Python<'_>,
        window_ids: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<u64>> {
        let open = self.open(py)?;
        let ids = indices(py, window_ids, "window id")?;
        let limit = self.drain_limit(py, &open, timeout)?;
        let closing = open.windows.close_windows(&open.channel, &ids);
        let waiting: Vec<_> = (closing.into_iter())
            .filter_map(|(id, (drain, _))| drain.filter(|d| !d.is_drained()).map(|d| (id, d)))
            .collect();
        let left: Vec<u64> = if waiting.is_empty() || limit.is_zero() {
            waiting.into_iter().map(|(id, _)| id).collect()
        } else {
            call::block_on(py, async move {
                let deadline = tokio::time::Instant::now() + limit;
                let mut left = Vec::new();
                for (id, d) in waiting {
                    if tokio::time::timeout_at(deadline, d.drained())
                        .await
                        .is_err()
                    {
                        left.push(id);
                    }
                }
                Ok(left)
            })?
        };
        let still: std::collections::HashSet<u64> = left.iter().copied().collect();
        let done: Vec<u64> = ids.into_iter().filter(|id| !still.contains(id)).collect();
        open.windows.drained_windows(&done);
        Ok(left)
    }

    /// Closes a window: no op passes it from now on. Then waits, at most ``timeout`` seconds
    /// (default: the channel's ``op`` deadline), until the ops that had passed it ended
    /// (writes landed, read responses sent), so its bytes may go to someone else. Past the
    /// timeout raises ``Timeout`` (step ``close-window``); the window stays closed, and
    /// calling this again waits again. ``InvalidOp`` for an id this channel did not hand
    /// out, or one already closed and drained.
    #[pyo3(signature = (window_id, timeout=None))]
    fn close_window(
        &self,
        py: Python<'_>,
        window_id: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<()> {
        let open = self.open(py)?;
        let id = index_arg(py, window_id, "window id")?;
        let limit = self.drain_limit(py, &open, timeout)?;
        let (drain, _) = open
            .windows
            .close_window(&open.channel, id)
            .ok_or_else(|| errors::invalid(py, format!("window {id} is not open")))?;
        wait_drained(py, drain, limit, format!("window {id}"))?;
        open.windows.drained_window(id);
        Ok(())
    }

    /// Closes every window open to ``token`` at once, waits for the ops that had passed
    /// them as ``close_window`` does (``Timeout`` past ``timeout``; call again to wait
    /// again), and returns the peers that used the token (see ``token_users``): complete,
    /// since every op admitted before the close was recorded first. ``[]`` when no window of
    /// the token is open.
    #[pyo3(signature = (token, timeout=None))]
    fn close_token(
        &self,
        py: Python<'_>,
        token: &Bound<'_, PyAny>,
        timeout: Option<f64>,
    ) -> PyResult<Vec<String>> {
        let open = self.open(py)?;
        let token = grants::token_arg(py, token)?;
        let limit = self.drain_limit(py, &open, timeout)?;
        let Some((drain, users)) = open.windows.close_token(&open.channel, &token) else {
            return Ok(Vec::new());
        };
        wait_drained(py, drain, limit, "the grant token's windows".into())?;
        open.windows.drained_token(&token);
        Ok(users)
    }

    /// The peers (their authenticated ids, sorted) that had a transfer naming ``token``
    /// admitted through the token's windows while any is open: the ones that read (or
    /// wrote) under the grant, for accepting a request's "done" only from them. Recorded
    /// when the transfer passed the checks, before any byte moved. ``[]`` once the token's
    /// last window closed.
    fn token_users(&self, py: Python<'_>, token: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let open = self.open(py)?;
        let token = grants::token_arg(py, token)?;
        Ok(open
            .channel
            .token_users(&token)
            .iter()
            .map(|p| p.to_string())
            .collect())
    }

    /// Removes a region: new transfers cannot find it; waits (within the op deadline) until
    /// no transfer touches it, then lets go of its memory. When a peer may still write it,
    /// raises and keeps the memory alive for good.
    fn deregister(&self, py: Python<'_>, region: &Bound<'_, PyAny>) -> PyResult<()> {
        let open = self.open(py)?;
        let key = region_arg(py, region)?;
        let reg = open
            .regions()
            .remove(&key)
            .ok_or_else(|| errors::invalid(py, format!("region {key} is not registered")))?;
        let channel = open.channel.clone();
        let r = call::block_on(
            py,
            async move { Ok(channel.deregister(region_id(key)).await?) },
        );
        if r.is_err() || reg.region.is_tainted() {
            keep_forever(reg.keep);
        }
        r
    }

    /// Connects to the listener at ``addr`` (``"host:port"``) and returns its peer id.
    /// Idempotent: an established session is reused.
    fn connect(&self, py: Python<'_>, addr: String) -> PyResult<String> {
        let channel = self.open(py)?.channel.clone();
        call::block_on(
            py,
            async move { Ok(channel.connect(&addr).await?.to_string()) },
        )
    }

    /// ``connect`` as an awaitable.
    fn connect_async<'py>(&self, py: Python<'py>, addr: String) -> PyResult<Bound<'py, PyAny>> {
        let open = self.open(py)?;
        let stuck = self.stuck(
            &open,
            format!("connect to {addr}"),
            Some(addr.clone()),
            "connect",
        );
        let channel = open.channel.clone();
        call::awaitable(
            py,
            async move { Ok(channel.connect(&addr).await?.to_string()) },
            |py, s: String| Ok(PyString::new(py, &s).into_any().unbind()),
            stuck,
        )
    }

    /// The regions a connected peer grants us, as ``RegionInfo`` (``.id``, ``.length``,
    /// ``.page_size``).
    fn peer_regions(&self, py: Python<'_>, peer: &str) -> PyResult<Vec<PyRegionInfo>> {
        let channel = self.open(py)?.channel.clone();
        let peer = peer_arg(py, peer)?;
        let infos = call::block_on(py, async move { Ok(channel.peer_regions(&peer).await?) })?;
        Ok(infos
            .into_iter()
            .map(|r| PyRegionInfo {
                id: region_key(r.id),
                length: r.len,
                page_size: r.page_size,
            })
            .collect())
    }

    /// Writes local pages into the peer's pages: ``local_pages[i]`` of ``local_region``
    /// into ``remote_pages[i]`` of the peer's ``remote_region``, ``page_len`` bytes each
    /// (default: the local page size; page indices count in each region's own page size).
    /// Every op is checked before any byte moves; returns once every byte is in the peer's
    /// memory.
    #[pyo3(signature = (peer, local_region, local_pages, remote_region, remote_pages, page_len=None, *, token=None))]
    #[allow(clippy::too_many_arguments)]
    fn write_pages(
        &self,
        py: Python<'_>,
        peer: &str,
        local_region: &Bound<'_, PyAny>,
        local_pages: &Bound<'_, PyAny>,
        remote_region: &Bound<'_, PyAny>,
        remote_pages: &Bound<'_, PyAny>,
        page_len: Option<&Bound<'_, PyAny>>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (batch, _) = self.pages_batch(
            py,
            Dir::Write,
            peer,
            local_region,
            local_pages,
            remote_region,
            remote_pages,
            page_len,
            token,
        )?;
        call::block_on(py, batch)
    }

    /// Reads the peer's pages into local pages (the mirror of ``write_pages``); returns once
    /// every byte is in local memory.
    #[pyo3(signature = (peer, local_region, local_pages, remote_region, remote_pages, page_len=None, *, token=None))]
    #[allow(clippy::too_many_arguments)]
    fn read_pages(
        &self,
        py: Python<'_>,
        peer: &str,
        local_region: &Bound<'_, PyAny>,
        local_pages: &Bound<'_, PyAny>,
        remote_region: &Bound<'_, PyAny>,
        remote_pages: &Bound<'_, PyAny>,
        page_len: Option<&Bound<'_, PyAny>>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (batch, _) = self.pages_batch(
            py,
            Dir::Read,
            peer,
            local_region,
            local_pages,
            remote_region,
            remote_pages,
            page_len,
            token,
        )?;
        call::block_on(py, batch)
    }

    /// ``write_pages`` as an awaitable.
    #[pyo3(signature = (peer, local_region, local_pages, remote_region, remote_pages, page_len=None, *, token=None))]
    #[allow(clippy::too_many_arguments)]
    fn write_pages_async<'py>(
        &self,
        py: Python<'py>,
        peer: &str,
        local_region: &Bound<'py, PyAny>,
        local_pages: &Bound<'py, PyAny>,
        remote_region: &Bound<'py, PyAny>,
        remote_pages: &Bound<'py, PyAny>,
        page_len: Option<&Bound<'py, PyAny>>,
        token: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let batch = self.pages_batch(
            py,
            Dir::Write,
            peer,
            local_region,
            local_pages,
            remote_region,
            remote_pages,
            page_len,
            token,
        )?;
        self.batch_awaitable(py, batch, peer, Dir::Write)
    }

    /// ``read_pages`` as an awaitable.
    #[pyo3(signature = (peer, local_region, local_pages, remote_region, remote_pages, page_len=None, *, token=None))]
    #[allow(clippy::too_many_arguments)]
    fn read_pages_async<'py>(
        &self,
        py: Python<'py>,
        peer: &str,
        local_region: &Bound<'py, PyAny>,
        local_pages: &Bound<'py, PyAny>,
        remote_region: &Bound<'py, PyAny>,
        remote_pages: &Bound<'py, PyAny>,
        page_len: Option<&Bound<'py, PyAny>>,
        token: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let batch = self.pages_batch(
            py,
            Dir::Read,
            peer,
            local_region,
            local_pages,
            remote_region,
            remote_pages,
            page_len,
            token,
        )?;
        self.batch_awaitable(py, batch, peer, Dir::Read)
    }

    /// ``write_pages`` without waiting: returns a ``Transfer`` to ``poll()`` or ``wait()``.
    #[pyo3(signature = (peer, local_region, local_pages, remote_region, remote_pages, page_len=None, *, token=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_write_pages(
        &self,
        py: Python<'_>,
        peer: &str,
        local_region: &Bound<'_, PyAny>,
        local_pages: &Bound<'_, PyAny>,
        remote_region: &Bound<'_, PyAny>,
        remote_pages: &Bound<'_, PyAny>,
        page_len: Option<&Bound<'_, PyAny>>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Transfer> {
        let batch = self.pages_batch(
            py,
            Dir::Write,
            peer,
            local_region,
            local_pages,
            remote_region,
            remote_pages,
            page_len,
            token,
        )?;
        self.submit(py, batch, peer)
    }

    /// ``read_pages`` without waiting: returns a ``Transfer`` to ``poll()`` or ``wait()``.
    #[pyo3(signature = (peer, local_region, local_pages, remote_region, remote_pages, page_len=None, *, token=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit_read_pages(
        &self,
        py: Python<'_>,
        peer: &str,
        local_region: &Bound<'_, PyAny>,
        local_pages: &Bound<'_, PyAny>,
        remote_region: &Bound<'_, PyAny>,
        remote_pages: &Bound<'_, PyAny>,
        page_len: Option<&Bound<'_, PyAny>>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Transfer> {
        let batch = self.pages_batch(
            py,
            Dir::Read,
            peer,
            local_region,
            local_pages,
            remote_region,
            remote_pages,
            page_len,
            token,
        )?;
        self.submit(py, batch, peer)
    }

    /// Writes a batch of ops, each ``(local_region, local_offset, remote_region,
    /// remote_offset, length)`` in bytes; returns once every byte is in the peer's memory.
    #[pyo3(signature = (peer, ops, *, token=None))]
    fn write(
        &self,
        py: Python<'_>,
        peer: &str,
        ops: &Bound<'_, PyAny>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (batch, _) = self.ops_batch(py, Dir::Write, peer, ops, token)?;
        call::block_on(py, batch)
    }

    /// Reads a batch of ops (see ``write``) from the peer's regions into local ones.
    #[pyo3(signature = (peer, ops, *, token=None))]
    fn read(
        &self,
        py: Python<'_>,
        peer: &str,
        ops: &Bound<'_, PyAny>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let (batch, _) = self.ops_batch(py, Dir::Read, peer, ops, token)?;
        call::block_on(py, batch)
    }

    /// ``write`` as an awaitable.
    #[pyo3(signature = (peer, ops, *, token=None))]
    fn write_async<'py>(
        &self,
        py: Python<'py>,
        peer: &str,
        ops: &Bound<'py, PyAny>,
        token: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let batch = self.ops_batch(py, Dir::Write, peer, ops, token)?;
        self.batch_awaitable(py, batch, peer, Dir::Write)
    }

    /// ``read`` as an awaitable.
    #[pyo3(signature = (peer, ops, *, token=None))]
    fn read_async<'py>(
        &self,
        py: Python<'py>,
        peer: &str,
        ops: &Bound<'py, PyAny>,
        token: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let batch = self.ops_batch(py, Dir::Read, peer, ops, token)?;
        self.batch_awaitable(py, batch, peer, Dir::Read)
    }

    /// ``write`` without waiting: returns a ``Transfer``.
    #[pyo3(signature = (peer, ops, *, token=None))]
    fn submit_write(
        &self,
        py: Python<'_>,
        peer: &str,
        ops: &Bound<'_, PyAny>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Transfer> {
        let batch = self.ops_batch(py, Dir::Write, peer, ops, token)?;
        self.submit(py, batch, peer)
    }

    /// ``read`` without waiting: returns a ``Transfer``.
    #[pyo3(signature = (peer, ops, *, token=None))]
    fn submit_read(
        &self,
        py: Python<'_>,
        peer: &str,
        ops: &Bound<'_, PyAny>,
        token: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Transfer> {
        let batch = self.ops_batch(py, Dir::Read, peer, ops, token)?;
        self.submit(py, batch, peer)
    }

    /// Sends ``data`` (bytes) to the peer's application; it is delivered after every write
    /// issued to that peer before it. Returns once the peer received it.
    fn notify(&self, py: Python<'_>, peer: &str, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let channel = self.open(py)?.channel.clone();
        let peer = peer_arg(py, peer)?;
        let data = bytes_arg(data)?;
        call::block_on(py, async move { Ok(channel.notify(&peer, &data).await?) })
    }

    /// ``notify`` as an awaitable.
    fn notify_async<'py>(
        &self,
        py: Python<'py>,
        peer: &str,
        data: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let open = self.open(py)?;
        let stuck = self.stuck(
            &open,
            format!("notify of peer {peer}"),
            Some(peer.to_string()),
            "notify",
        );
        let channel = open.channel.clone();
        let peer = peer_arg(py, peer)?;
        let data = bytes_arg(data)?;
        call::awaitable(
            py,
            async move { Ok(channel.notify(&peer, &data).await?) },
            none,
            stuck,
        )
    }

    /// The next notification from any peer as ``(peer_id, data)``, waiting at most
    /// ``timeout`` seconds (``None``: until one comes); ``None`` when the timeout passed.
    /// Peers take turns: a peer that sends many delays another's next by at most one of
    /// its own.
    #[pyo3(signature = (timeout=None))]
    fn recv_notification(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
    ) -> PyResult<Option<(String, Py<PyBytes>)>> {
        let open = self.open(py)?;
        let limit = timeout_arg(py, timeout)?;
        let returned = open.returned.clone();
        let fut = recv(open.channel.clone(), open.returned.clone(), limit);
        let got = call::block_on_with(py, fut, move |got| give_back(&returned, got))?;
        Ok(got.map(|(p, d)| (p, PyBytes::new(py, &d).unbind())))
    }

    /// ``recv_notification`` as an awaitable.
    #[pyo3(signature = (timeout=None))]
    fn recv_notification_async<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let open = self.open(py)?;
        let limit = timeout_arg(py, timeout)?;
        let returned = open.returned.clone();
        let fut = recv(open.channel.clone(), open.returned.clone(), limit);
        let stuck = self.stuck(&open, "receive of a notification".into(), None, "notify");
        call::awaitable_with(
            py,
            fut,
            |py, got: Option<(String, Vec<u8>)>| {
                Ok(match got {
                    Some((p, d)) => (p, PyBytes::new(py, &d))
                        .into_pyobject(py)?
                        .into_any()
                        .unbind(),
                    None => py.None(),
                })
            },
            move |got| give_back(&returned, got),
            stuck,
        )
    }

    /// Every notification already received, by peer: ``{peer_id: [data, ...]}`` (NIXL's
    /// ``get_new_notifs``). Never blocks.
    fn get_new_notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let open = self.open(py)?;
        let out = PyDict::new(py);
        let returned = std::iter::from_fn(|| take_returned(&open.returned));
        let fresh =
            std::iter::from_fn(|| try_recv(&open.channel).map(|n| (n.peer.to_string(), n.data)));
        for (peer, data) in returned.chain(fresh) {
            let data = PyBytes::new(py, &data);
            match out.get_item(&peer)? {
                Some(list) => list.downcast::<PyList>()?.append(data)?,
                None => out.set_item(&peer, PyList::new(py, [data])?)?,
            }
        }
        Ok(out)
    }

    /// What the channel holds right now (sessions, batches and bytes in flight, counters).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let channel = self.open(py)?.channel.clone();
        let s = call::block_on(py, async move { Ok(channel.stats().await?) })?;
        let d = PyDict::new(py);
        d.set_item("sessions", s.sessions)?;
        d.set_item("established", s.established)?;
        d.set_item("dialing", s.dialing)?;
        d.set_item("tokens", s.tokens)?;
        d.set_item("batches_in_flight", s.batches_in_flight)?;
        d.set_item("bytes_in_flight", s.bytes_in_flight)?;
        d.set_item("batches_waiting_for_room", s.batches_waiting_for_room)?;
        d.set_item("in_flight_refused", s.in_flight_refused)?;
        d.set_item("late_answers_discarded", s.late_answers_discarded)?;
        d.set_item("peer_bytes_in_flight", s.peer_bytes_in_flight)?;
        d.set_item("access_denied", s.access_denied)?;
        d.set_item("sessions_ended", s.sessions_ended)?;
        d.set_item("handshakes_refused", s.handshakes_refused)?;
        d.set_item("handshakes_displaced", s.handshakes_displaced)?;
        d.set_item("auth_failed", s.auth_failed)?;
        d.set_item("notifications_queued", s.notifications_queued)?;
        d.set_item("notify_bytes_queued", s.notify_bytes_queued)?;
        d.set_item("notify_bytes_peak", s.notify_bytes_peak)?;
        d.set_item("notify_paused", s.notify_paused)?;
        d.set_item("notify_pauses", s.notify_pauses)?;
        d.set_item("notify_timeouts", s.notify_timeouts)?;
        d.set_item("tls_refused", s.tls_refused)?;
        d.set_item("shm_batches", s.shm_batches)?;
        d.set_item("cma_batches", s.cma_batches)?;
        d.set_item("ucx_batches", s.ucx_batches)?;
        // The key Python has always read (`Stats::frames_fast_lane` in Rust).
        d.set_item("frames_direct", s.frames_fast_lane)?;
        let regions = self.open(py)?.regions().len();
        d.set_item("regions", regions)?;
        Ok(d)
    }

    /// Which transport carries this side's batches to the connected ``peer``: ``"shm"`` once
    /// it mapped one of the peer's regions, ``"ucx"`` once it imported one over UCX, else
    /// ``"tcp"`` (batches naming regions the transport does not reach still go over TCP).
    fn peer_transport(&self, py: Python<'_>, peer: &str) -> PyResult<&'static str> {
        let channel = self.open(py)?.channel.clone();
        let peer = peer_arg(py, peer)?;
        call::block_on(py, async move {
            Ok(channel.peer_transport(&peer).await?.name())
        })
    }

    /// Ends the session with ``peer`` from this side (the peer hears ``reason``); batches in
    /// flight on it fail with ``Disconnected``.
    #[pyo3(signature = (peer, reason="disconnect".to_string()), text_signature = "($self, peer, reason='disconnect')")]
    fn disconnect(&self, py: Python<'_>, peer: &str, reason: String) -> PyResult<()> {
        let channel = self.open(py)?.channel.clone();
        let peer = peer_arg(py, peer)?;
        call::block_on(
            py,
            async move { Ok(channel.disconnect(&peer, &reason).await?) },
        )
    }

    /// Closes every session (work in flight fails with ``Closed``), stops listening and
    /// lets go of registered memory. Idempotent; bounded by the close deadline.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let open = self.open.lock().unwrap_or_else(|p| p.into_inner()).take();
        match open {
            Some(open) => self.release(py, open),
            None => Ok(()),
        }
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { "closed" } else { "open" };
        match &self.local_addr {
            Some(a) => format!(
                "<kvbridge.Channel {} listening on {a}, {state}>",
                self.peer_id
            ),
            None => format!("<kvbridge.Channel {}, {state}>", self.peer_id),
        }
    }
}

impl Drop for PyChannel {
    fn drop(&mut self) {
        let open = self
            .open
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(open) = open {
            Python::with_gil(|py| {
                let _ = self.release(py, open);
            });
        }
    }
}

/// Waits, with the GIL released, at most `limit` for `drain`; `Timeout` (step
/// `close-window`) naming `what` past it.
fn wait_drained(
    py: Python<'_>,
    drain: Option<Arc<kvbridge::WindowDrain>>,
    limit: Duration,
    what: String,
) -> PyResult<()> {
    let Some(drain) = drain else {
        return Ok(());
    };
    let drained = call::block_on(py, async move {
        Ok(tokio::time::timeout(limit, drain.drained()).await.is_ok())
    })?;
    if drained {
        return Ok(());
    }
    Err(errors::make(
        py,
        "Timeout",
        format!(
            "{what}: closed, but the ops that had passed it did not end within {limit:?} \
             (call again to wait again)"
        ),
        None,
        Some("close-window".into()),
        None,
    ))
}

/// Runs a batch of `ops` with `peer`, naming `token` to it if set.
async fn run(
    channel: &Channel,
    dir: Dir,
    peer: &PeerId,
    token: Option<GrantToken>,
    ops: &[Op],
) -> kvbridge::Result<()> {
    match (dir, token) {
        (Dir::Write, None) => channel.write(peer, ops).await,
        (Dir::Read, None) => channel.read(peer, ops).await,
        (Dir::Write, Some(t)) => channel.write_with_grant(peer, t, ops).await,
        (Dir::Read, Some(t)) => channel.read_with_grant(peer, t, ops).await,
    }
}

fn timeout_arg(py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<Duration>> {
    match timeout {
        None => Ok(None),
        Some(t) if t.is_finite() && t >= 0.0 => Ok(Some(Duration::from_secs_f64(t.min(1e9)))),
        Some(t) => Err(errors::invalid(py, format!("timeout {t} is not >= 0"))),
    }
}

/// The next notification, or `None` once `limit` passed; `Closed` once the channel closed.
async fn recv(
    channel: Channel,
    returned: Returned,
    limit: Option<Duration>,
) -> EngineResult<Option<(String, Vec<u8>)>> {
    let next = async {
        loop {
            let added = returned.added.notified();
            let mut added = std::pin::pin!(added);
            added.as_mut().enable();
            if let Some(n) = take_returned(&returned) {
                return Some(n);
            }
            tokio::select! {
                n = channel.recv_notification() => {
                    return n.map(|n| (n.peer.to_string(), n.data));
                }
                () = &mut added => {}
            }
        }
    };
    let got = match limit {
        Some(d) => match tokio::time::timeout(d, next).await {
            Ok(n) => n,
            Err(_) => return Ok(None),
        },
        None => next.await,
    };
    match got {
        Some(n) => Ok(Some(n)),
        None => Err(Outcome::Engine(kvbridge::Error::Closed)),
    }
}

/// A notification that is already there, without waiting.
fn try_recv(channel: &Channel) -> Option<kvbridge::Notification> {
    let fut = channel.recv_notification();
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(n) => n,
        std::task::Poll::Pending => None,
    }
}
