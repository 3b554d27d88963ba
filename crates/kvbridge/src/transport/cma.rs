//! Same-host one-sided copies, and cross-memory attach (`process_vm_writev` /
//! `process_vm_readv`) for memory that cannot be mapped.
//!
//! # Two ways to copy, one trait
//! A batch to a peer on this host does not need a socket when this process can reach the
//! peer's memory directly. [`PieceCopy`] is that capability: copy a list of
//! (remote address, local address, length) pieces, in order, synchronously. It has two
//! implementations:
//! - [`MemCopy`]: the peer's region is mapped into this process (its memfd came over the
//!   unix socket, see `shm.rs`); a piece is one `memcpy`.
//! - [`CmaCopy`]: the region is the peer's own memory (`Region::from_raw`, or private memory
//!   where memfds are unavailable) that cannot be mapped; pieces are handed to the kernel
//!   as iovecs, up to [`IOV_MAX`] per `process_vm_writev`/`process_vm_readv` call, and a
//!   partial transfer is continued where it stopped.
//!
//! [`PieceCopy`] is the copy alone, below the same-host backend of the one-sided seam
//! (`same_host.rs`, [`crate::transport::one_sided::OneSided`]). Neither covers TCP: a TCP batch is
//! two-sided (the listener validates every op header and reads the payload into place),
//! while both direct copies are one-sided (this side checks bounds against what the
//! listener announced and the kernel does the rest). `same_host.rs` picks per batch:
//! every region reachable directly (mapped, else cross-memory attach when the probe passed
//! for this peer) → direct copy; else TCP.
//!
//! # When cross-memory attach is used
//! The kernel allows `process_vm_writev` into another process only with ptrace-attach
//! rights over it: same user, and Yama's `kernel.yama.ptrace_scope` 0 (or `CAP_SYS_PTRACE`);
//! seccomp filters (containers) or old kernels refuse the call outright (`ENOSYS`/`EPERM`).
//! So it is checked, per session, by doing it: a listener advertises it in its shared-memory
//! offer (`ShmOffer::cma`); an initiator that wants it (`ChannelConfig::cma`, env
//! `KVBRIDGE_CMA`) asks over the authenticated unix socket (`CmaAsk`); the listener answers
//! with the address of a fresh random canary (`CmaProbe`); the initiator reads it with
//! `process_vm_readv` and sends back what it read (`CmaProbed`). Only when the bytes are
//! the canary's does the listener announce the base addresses of its unmappable regions
//! (`ShmMap` with `addr`, no descriptor). On any failure the reason is logged (the first
//! time at info, then at debug), reported by [`crate::Channel::peer_cma`], and those regions
//! go over TCP.
//!
//! # Safety of unmapping
//! The listener cannot see a peer's `process_vm_writev` land, so it cannot count those
//! writes in the region's in-use count as it counts TCP writes. Instead a region offered
//! for cross-memory attach is *exported*, exactly like a mapped shared-memory region, and
//! the export is revoked the same way:
//! 1. The listener counts the export (`Region::cma_exports`) before the frame with the
//!    address leaves, so there is no moment when the peer knows the address and the count
//!    is zero.
//! 2. `deregister` removes the region from the table (no new grant, no new offer), which
//!    makes the session send `ShmUnmap`, and then waits (`quiesce`, within the op deadline)
//!    until the in-use count *and* the cross-memory exports are zero.
//! 3. The initiator copies (on the thread of the task that issued the write, or on its data
//!    writer thread for reads) holding the region's read lock for the whole call and
//!    checking the `revoked` flag under it. On `ShmUnmap` it takes the
//!    write lock — which waits for a copy in progress — sets `revoked`, and only then
//!    answers `ShmUnmapped`. Any later batch naming the region finds it revoked (or gone
//!    from the map) and fails with `Rejected { UnknownRegion }`.
//! 4. The listener drops the export only on that `ShmUnmapped`, or when the unix socket
//!    closes: the initiator closes it only after its data threads stopped and it revoked
//!    everything, and a dead process's socket closes only once it can no longer run.
//!
//! So when `deregister` returns `Ok`, every copy the initiator started into the region has
//! returned and none will start. Unlike a memfd, caller memory cannot be *detached* when a
//! peer does not confirm in time: the export then stays counted, the region is marked
//! tainted and `deregister` fails with an error that says so — the caller must keep the
//! memory alive (or stop the peer); returning `Ok` there would be a lie.
//!
//! # A peer that restarts with the same pid
//! An initiator writes to a pid. The listener's pid is bound to its session: the offer
//! carries it, the initiator checks it against the unix socket's peer credentials, and the
//! canary proves that this pid is the process holding this session's secret bytes. If the
//! listener dies, the kernel closes its sockets while it exits, before its pid can be
//! reused; the initiator's shared-memory task sees the close, revokes every region of that
//! session, and the session ends (a restarted listener is a new session with a new
//! incarnation, its own probe and its own addresses). The window left is between the
//! listener's death and the initiator noticing it; there every call first polls a pidfd
//! of the probed process (Linux 5.3+) and fails with `PeerGone` once it exited. What
//! remains is the moment between that poll and the system call, in which the whole pid
//! space would have to wrap and a process of the same user map the same address — not
//! excluded by construction, but not reachable in practice.
//!
//! # Threat model
//! As for shared memory: only peers on this host, after they authenticated, and only the
//! regions granted to them, within the bounds announced; the listener's address is never
//! used for a region it did not announce on this session's unix socket. A peer that may
//! `process_vm_writev` into us could as well `ptrace` us, so nothing here protects against
//! a hostile peer with that right; what is protected is memory the owner deregistered.

use crate::dir::Dir;
use crate::pidfd::Pidfd;
use crate::transport::split_copy;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

/// Most iovecs the kernel takes per call (`UIO_MAXIOV`).
pub(crate) const IOV_MAX: usize = 1024;

pub(crate) use crate::transport::piece::Piece;

/// Why a direct copy failed.
#[derive(Debug)]
pub(crate) enum CopyError {
    /// The peer process exited: its pidfd said so before the call (its pid may be reused,
    /// so no call was made), or the call found no such process (`ESRCH`: the process has
    /// dropped its memory while exiting, before its pidfd turns readable).
    PeerGone,
    /// The kernel refused or failed the copy (errno), after `done` bytes of the call.
    Os {
        /// The error.
        error: io::Error,
        /// Bytes copied before it.
        done: usize,
    },
}

impl std::fmt::Display for CopyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CopyError::PeerGone => f.write_str("the peer process exited"),
            CopyError::Os { error, done } => {
                write!(f, "{} after {done} bytes", describe(error, None))
            }
        }
    }
}

/// A same-host one-sided copy (module docs: why it does not cover TCP).
pub(crate) trait PieceCopy {
    /// Copies every piece (`Write`: local → remote; `Read`: remote → local), in order, and
    /// returns once all bytes are in place or on the first failure.
    ///
    /// # Safety
    /// Every remote range must be inside memory the peer announced for this session and
    /// that is not revoked (the caller holds the region's read lock); every local range must
    /// be inside a region held in use; nothing else may access either range meanwhile.
    unsafe fn copy(&self, dir: Dir, pieces: &[Piece]) -> Result<(), CopyError>;
}

/// Copies into or out of a peer's region mapped into this process.
pub(crate) struct MemCopy;

impl PieceCopy for MemCopy {
    unsafe fn copy(&self, dir: Dir, pieces: &[Piece]) -> Result<(), CopyError> {
        for p in pieces {
            let remote = p.remote as *mut u8;
            // SAFETY: by the caller's contract both ranges are `len` bytes of live memory (the
            // peer's region mapped here, under its read lock; a local region held in use),
            // and disjoint (a local region is never a peer's mapping of it in this process).
            unsafe {
                match dir {
                    // Streaming stores for large pieces: the other side reads them later,
                    // this thread never does (`stream_copy`).
                    Dir::Write => crate::stream_copy::copy(p.local, remote, p.len),
                    Dir::Read => crate::stream_copy::copy(remote, p.local, p.len),
                }
            }
        }
        Ok(())
    }
}

/// Copies into or out of another process's memory with `process_vm_writev`/`readv`.
pub(crate) struct CmaCopy {
    pid: libc::pid_t,
    /// A descriptor of the very process that passed the probe, polled before each call;
    /// `None` where `pidfd_open` is unavailable (before Linux 5.3).
    pidfd: Option<Pidfd>,
}

impl CmaCopy {
    /// For the process `pid` (which just passed the probe).
    pub(crate) fn new(pid: u32) -> CmaCopy {
        CmaCopy {
            pid: pid as libc::pid_t,
            pidfd: Pidfd::open(pid),
        }
    }

    /// Whether the process exited (its pidfd became readable).
    fn exited(&self) -> bool {
        self.pidfd.as_ref().is_some_and(Pidfd::exited)
    }
}

impl PieceCopy for CmaCopy {
    unsafe fn copy(&self, dir: Dir, pieces: &[Piece]) -> Result<(), CopyError> {
        if self.exited() {
            return Err(CopyError::PeerGone);
        }
        let pid = self.pid;
        // SAFETY: the caller's contract, which `vm_copies` takes on any part of the pieces.
        unsafe {
            split_copy::run(
                dir,
                pieces,
                split_copy::threads(),
                move |part| vm_copies(pid, dir, part),
                || CopyError::Os {
                    error: io::Error::other("a copy thread ended without answering"),
                    done: 0,
                },
            )
        }
    }
}

/// `pieces` in calls of at most [`IOV_MAX`] iovecs, in order; a process that is gone is
/// [`CopyError::PeerGone`].
///
/// # Safety
/// As [`PieceCopy::copy`].
unsafe fn vm_copies(pid: libc::pid_t, dir: Dir, pieces: &[Piece]) -> Result<(), CopyError> {
    for chunk in pieces.chunks(IOV_MAX) {
        // SAFETY: the caller's contract is `vm_copy`'s.
        match unsafe { vm_copy(pid, dir, chunk) } {
            Ok(()) => {}
            // An exiting process releases its memory before its pidfd turns readable; a
            // copy in that moment fails with ESRCH. Either way the peer is gone, and that is
            // a lost connection, not an internal error.
            Err(CopyError::Os { error, .. }) if error.raw_os_error() == Some(libc::ESRCH) => {
                return Err(CopyError::PeerGone)
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One batch of at most [`IOV_MAX`] pieces, continued after partial transfers.
///
/// # Safety
/// As [`PieceCopy::copy`].
unsafe fn vm_copy(pid: libc::pid_t, dir: Dir, pieces: &[Piece]) -> Result<(), CopyError> {
    let mut local: Vec<libc::iovec> = pieces
        .iter()
        .map(|p| libc::iovec {
            iov_base: p.local.cast(),
            iov_len: p.len,
        })
        .collect();
    let mut remote: Vec<libc::iovec> = pieces
        .iter()
        .map(|p| libc::iovec {
            iov_base: p.remote as *mut libc::c_void,
            iov_len: p.len,
        })
        .collect();
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let mut done = 0usize;
    // Index of the first piece not fully copied.
    let mut first = 0usize;
    // The two calls take the same arguments in the same order.
    let call = match dir {
        Dir::Write => libc::process_vm_writev,
        Dir::Read => libc::process_vm_readv,
    };
    while done < total {
        let (l, r) = (&local[first..], &remote[first..]);
        // SAFETY: both iovec arrays live through the call and hold the counts given; the
        // local ranges are live memory by the caller's contract, and the kernel checks the
        // remote ones (a range the peer does not have fails with EFAULT, no write lands).
        let n = unsafe {
            call(
                pid,
                l.as_ptr(),
                l.len() as libc::c_ulong,
                r.as_ptr(),
                r.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(CopyError::Os { error, done });
        }
        if n == 0 {
            // No progress and no error: the kernel stopped at an unreachable remote range.
            return Err(CopyError::Os {
                error: io::Error::from_raw_os_error(libc::EFAULT),
                done,
            });
        }
        // A partial transfer stops at an iovec boundary of the remote side or inside one;
        // continue with what is left of that piece.
        let mut n = n as usize;
        done += n;
        while n > 0 && first < local.len() {
            let left = local[first].iov_len;
            if n >= left {
                n -= left;
                first += 1;
            } else {
                // Address arithmetic only (the remote address is not ours to dereference):
                // `n` is less than the piece's length, so both stay inside their pieces.
                local[first].iov_base = local[first].iov_base.cast::<u8>().wrapping_add(n).cast();
                local[first].iov_len -= n;
                remote[first].iov_base = remote[first].iov_base.cast::<u8>().wrapping_add(n).cast();
                remote[first].iov_len -= n;
                n = 0;
            }
        }
        // Zero-length pieces left at the front would make the next call return 0.
        while first < local.len() && local[first].iov_len == 0 {
            first += 1;
        }
    }
    Ok(())
}

/// Reads `len` bytes at `addr` of process `pid` (the probe). The error says why in words
/// (`peer_uid`: the peer's user, from the unix socket's credentials, when known).
pub(crate) fn probe(
    pid: u32,
    addr: u64,
    len: usize,
    peer_uid: Option<u32>,
) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; len];
    let piece = Piece {
        remote: addr as usize,
        local: out.as_mut_ptr(),
        len,
    };
    // SAFETY: the local range is our own buffer; the remote range is only read, and the
    // kernel checks it in the peer's address space (a bad address is EFAULT, not UB here).
    match unsafe { vm_copy(pid as libc::pid_t, Dir::Read, &[piece]) } {
        Ok(()) => Ok(out),
        Err(CopyError::Os { error, .. }) => Err(describe(&error, peer_uid)),
        Err(CopyError::PeerGone) => Err("the peer process exited".into()),
    }
}

/// Why a cross-memory-attach call failed, in words an operator can act on.
pub(crate) fn describe(e: &io::Error, peer_uid: Option<u32>) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            // SAFETY: getuid cannot fail.
            let ours = unsafe { libc::getuid() };
            match peer_uid {
                Some(theirs) if theirs != ours => format!(
                    "not permitted ({e}): different user (the listener runs as uid {theirs}, we as uid {ours})"
                ),
                _ => match ptrace_scope() {
                    Some(s) if s > 0 => format!(
                        "not permitted ({e}): kernel.yama.ptrace_scope={s} (0 allows it between processes of one user)"
                    ),
                    _ => format!("not permitted ({e}): no ptrace access to the listener"),
                },
            }
        }
        Some(libc::ENOSYS) => format!(
            "process_vm_readv/writev unavailable ({e}): an old kernel or a seccomp filter (containers)"
        ),
        Some(libc::ESRCH) => format!("no such process ({e})"),
        Some(libc::EFAULT) => format!("bad address in the peer ({e})"),
        _ => format!("cross-memory attach failed: {e}"),
    }
}

/// Yama's `kernel.yama.ptrace_scope`, where Yama is on.
fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Logs why cross-memory attach is not used with a peer: the first time at info, then at
/// debug (every session to every peer would repeat the same reason).
pub(crate) fn log_refused(peer: &str, why: &str) {
    static LOGGED: AtomicBool = AtomicBool::new(false);
    if !LOGGED.swap(true, Ordering::Relaxed) {
        tracing::info!(%peer, "cross-memory attach not used; TCP carries caller memory: {why}");
    } else {
        tracing::debug!(%peer, "cross-memory attach not used: {why}");
    }
}

/// Whether this process can use cross-memory attach at all: it reads a buffer of its own
/// with `process_vm_readv` (a seccomp filter or an old kernel refuses even that). A peer's
/// permission is still checked per session by the probe. `Err` says why not.
pub fn cma_available() -> Result<(), String> {
    let canary = [0x5au8; 16];
    let got = probe(
        std::process::id(),
        canary.as_ptr() as u64,
        canary.len(),
        None,
    )?;
    if got[..] == canary[..] {
        Ok(())
    } else {
        Err("process_vm_readv returned other bytes than our own".into())
    }
}

/// Whether cross-memory attach carries this side's batches to a peer
/// ([`crate::Channel::peer_cma`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CmaStatus {
    /// The probe read the listener's canary: the regions it offers by address (those that
    /// cannot be mapped) are copied with `process_vm_writev`/`readv`. (Should the listener
    /// find other bytes than its canary, it offers none and logs why.)
    Active,
    /// Not used, and why (disabled, not offered, not on this host, not permitted, ...):
    /// those regions go over TCP.
    Off(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many pieces, more than one call's worth of iovecs, land in order and in place; a
    /// read brings them back.
    #[test]
    fn batches_split_at_iov_max_and_round_trip() {
        if cma_available().is_err() {
            return;
        }
        let n = IOV_MAX * 2 + 7;
        let src: Vec<u8> = (0..n * 3).map(|i| (i * 7 + 1) as u8).collect();
        let mut dst = vec![0u8; n * 4];
        // Piece i: 3 bytes of src at 3i → 4i of dst (gaps stay zero).
        let pieces: Vec<Piece> = (0..n)
            .map(|i| Piece {
                remote: dst.as_mut_ptr() as usize + 4 * i,
                local: src.as_ptr().wrapping_add(3 * i) as *mut u8,
                len: 3,
            })
            .collect();
        let c = CmaCopy::new(std::process::id());
        // SAFETY: both ranges are our own live buffers, disjoint.
        unsafe { c.copy(Dir::Write, &pieces) }.unwrap();
        for i in 0..n {
            assert_eq!(&dst[4 * i..4 * i + 3], &src[3 * i..3 * i + 3], "piece {i}");
            assert_eq!(dst[4 * i + 3], 0);
        }
        let mut back = vec![0u8; n * 3];
        let pieces: Vec<Piece> = (0..n)
            .map(|i| Piece {
                remote: dst.as_ptr() as usize + 4 * i,
                local: back.as_mut_ptr().wrapping_add(3 * i),
                len: 3,
            })
            .collect();
        // SAFETY: as above.
        unsafe { c.copy(Dir::Read, &pieces) }.unwrap();
        assert_eq!(back, src);
    }

    /// A remote range that is not mapped fails with a typed error after the bytes before
    /// it (a partial transfer is reported, not retried forever).
    #[test]
    fn unmapped_remote_range_is_an_error() {
        if cma_available().is_err() {
            return;
        }
        let src = [1u8; 8];
        let mut dst = [0u8; 8];
        let pieces = [
            Piece {
                remote: dst.as_mut_ptr() as usize,
                local: src.as_ptr() as *mut u8,
                len: 8,
            },
            Piece {
                remote: 8,
                local: src.as_ptr() as *mut u8,
                len: 8,
            },
        ];
        let c = CmaCopy::new(std::process::id());
        // SAFETY: the first remote range is our buffer; the second is unmapped (the kernel
        // refuses it with EFAULT).
        let e = unsafe { c.copy(Dir::Write, &pieces) }.unwrap_err();
        match e {
            CopyError::Os { error, done } => {
                assert_eq!(error.raw_os_error(), Some(libc::EFAULT));
                assert_eq!(done, 8);
            }
            other => panic!("{other}"),
        }
        assert_eq!(dst, [1u8; 8]);
    }

    /// A process that has exited but whose pidfd the copy cannot poll (no `pidfd_open`, or
    /// the moment between an exiting process dropping its memory and its pidfd turning
    /// readable) is `PeerGone`, not an OS error: the caller reports a lost peer. A zombie
    /// child stands in for it: its memory is gone and, unreaped, its pid cannot be reused.
    #[test]
    fn a_process_without_memory_is_gone_not_an_os_error() {
        if cma_available().is_err() {
            return;
        }
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as libc::pid_t;
        // Wait for the exit without reaping (WNOWAIT keeps the zombie).
        // SAFETY: siginfo_t is plain data; all zeroes is a valid value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a valid pid of our own child and a valid siginfo to fill.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        let c = CmaCopy { pid, pidfd: None };
        let src = [1u8; 8];
        let piece = Piece {
            remote: 4096,
            local: src.as_ptr() as *mut u8,
            len: 8,
        };
        // SAFETY: the remote process has no memory left; the local range is our buffer.
        let e = unsafe { c.copy(Dir::Write, &[piece]) }.unwrap_err();
        assert!(matches!(e, CopyError::PeerGone), "{e}");
        child.wait().unwrap();
    }

    #[test]
    fn reasons_name_the_cause() {
        let e = io::Error::from_raw_os_error(libc::ENOSYS);
        assert!(describe(&e, None).contains("seccomp"));
        // SAFETY: getuid cannot fail.
        let me = unsafe { libc::getuid() };
        let e = io::Error::from_raw_os_error(libc::EPERM);
        assert!(describe(&e, Some(me.wrapping_add(1))).contains("different user"));
    }
}
