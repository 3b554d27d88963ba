//! The shared-memory transport (same host).
//!
//! A listener with shared memory on binds a unix socket under a random name in the abstract
//! namespace and offers it in its `Welcome`, with its host identity and pid. An initiator on
//! the same host (equal [`host_id`]) connects to it, checks the socket's peer credentials
//! against the offered pid, and presents the session token (`DataHello`), exactly as on the
//! TCP data connection: the listener's core routes it to the session the token names, and
//! that session serves it only once the peer has authenticated. An fd-passing connection
//! that does not prove the token gets nothing.
//!
//! The listener then passes the memfd of every region it grants the peer (`ShmMap`, the fd
//! in SCM_RIGHTS, one region per frame) and a `ShmSync` after each round. The initiator maps
//! each (checking its size and seals first) and from then on writes into it with one memcpy
//! and reads from it with one memcpy. A read runs on its data writer thread, in submission
//! order with the frames of the TCP data connection. A write is copied by the task that
//! issued it, on its own thread (on a multi-thread runtime; else on the writer thread too),
//! which spares two thread hand-offs per write; it holds a ticket meanwhile, so a `Notify`
//! issued while it runs waits for it. Either way a `Notify` leaves only after the bytes of
//! every write issued before it are in place. Batches that name a region not (or no longer)
//! mapped go over TCP as before.
//!
//! Revocation: the listener cannot see copies land, so a region leaves a peer's reach only
//! when that peer says so. When a region stops being granted (deregistered, or a grant
//! changed) the listener sends `ShmUnmap`; the initiator marks the mapping revoked under its
//! write lock (which waits for a copy in progress), unmaps it and answers `ShmUnmapped`.
//! Until then the region counts an export, and `deregister` waits for it within the op
//! deadline. When the session ends the listener waits (close deadline) for the initiator to
//! close the unix socket, which it does only after its data threads stopped and its
//! mappings are gone (a reset counts as that close: a dead process unmapped everything).
//!
//! Detaching: a peer that is alive but does not confirm in time may still copy into the
//! region, so the region is *detached*: its contents are copied to fresh anonymous memory
//! remapped over the same address, and late copies land only in the memfd the owner no
//! longer uses. Every other peer's mapping of that memfd is cut loose by the same remap, so
//! the detach waits until none of them can copy any more (`session::detach_region`):
//!
//! 1. the region is withdrawn from shared memory for good ([`crate::Region::is_shared`] is
//!    false from then on): no session maps it again, reconnecting peers included, and peers
//!    reach it over TCP;
//! 2. every other peer that maps it is asked to unmap it (`ShmUnmap`): once it confirms, no
//!    copy of its runs, a batch that had already picked the mapping fails with
//!    `Rejected{UnknownRegion}` ("revoked"), and later batches go over TCP;
//! 3. a peer that does not confirm within the op deadline has its session ended with
//!    [`crate::Error::UnmapTimeout`] (its batches in flight fail; it may reconnect), and that
//!    session's teardown waits for its close like any other;
//! 4. the copy runs with writers over TCP held back (they wait for it to end), so no write
//!    lands in the old pages during it.
//!
//! Exports whose peer was given up on (silent ones) are not waited for: theirs are the
//! copies the detach cuts loose. `Channel::deregister` takes steps 3 and 4 for peers that do
//! not confirm its unmap.
//!
//! Regions that cannot be mapped (caller memory) travel on the same connection by address
//! instead of by descriptor, after a probe, and are copied with cross-memory attach: see
//! `cma.rs`. Both kinds are revoked the same way.
//!
//! Threat model: shared memory is offered only to peers on the same host and used only
//! after they authenticated (when a secret is configured). A peer that maps a region can
//! write anywhere in it at any time; what is protected is memory the owner no longer grants
//! (it is detached) and the owner's process: before a mapping is trusted its file must be
//! shared memory (tmpfs: a hole punched in it later reads as zeros, no fault), long enough,
//! sealed against shrinking and growing, and allocated (so populating it allocates nothing
//! in the initiator); the unix socket takes connections of our own user only, a bounded
//! number of them, and no descriptor a frame may not carry.

use crate::dir::Dir;
use crate::region::LocalSlice;
use crate::transport::cma::{CmaCopy, CmaStatus, CopyError, MemCopy, Piece, PieceCopy};
use kvbridge_proto::frame::{FrameHeader, FRAME_HEADER_LEN};
use kvbridge_proto::msg::{Message, OpDesc, ShmRegion, ShmRevoke};
use kvbridge_proto::RegionId;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use tokio::io::Interest;
use tokio::net::UnixStream;

/// This host's identity for the shared-memory check: the boot id plus the network and pid
/// namespaces (the abstract unix socket lives in the network namespace, the pid check needs
/// the pid namespace). `None` when it cannot be read (then shared memory is not used).
pub fn host_id() -> Option<String> {
    static ID: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let ns = |n: &str| std::fs::read_link(format!("/proc/self/ns/{n}")).ok();
        let net = ns("net")?;
        let pid = ns("pid")?;
        Some(format!(
            "{}/{}/{}",
            boot.trim(),
            net.display(),
            pid.display()
        ))
    })
    .clone()
}

/// The process id of the other end of a unix socket.
fn peer_pid(s: &UnixStream) -> io::Result<u32> {
    Ok(peer_cred(s)?.pid as u32)
}

/// The user id of the other end of a unix socket.
pub(crate) fn peer_uid(s: &UnixStream) -> Option<u32> {
    peer_cred(s).ok().map(|c| c.uid)
}

fn peer_cred(s: &UnixStream) -> io::Result<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid out-parameters of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred)
}

/// A fresh random socket name in the abstract namespace.
pub(crate) fn socket_name() -> String {
    let mut b = [0u8; 16];
    crate::random::rand_bytes(&mut b);
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("kvbridge-{hex}")
}

fn abstract_addr(name: &str) -> io::Result<std::os::unix::net::SocketAddr> {
    use std::os::linux::net::SocketAddrExt;
    std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
}

/// Binds the listener's unix socket.
pub(crate) fn bind(name: &str) -> io::Result<tokio::net::UnixListener> {
    let l = std::os::unix::net::UnixListener::bind_addr(&abstract_addr(name)?)?;
    l.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(l)
}

/// Connects to a listener's unix socket and checks that the listener's process owns it.
pub(crate) async fn connect(name: &str, pid: u32) -> io::Result<UnixStream> {
    let s = std::os::unix::net::UnixStream::connect_addr(&abstract_addr(name)?)?;
    s.set_nonblocking(true)?;
    let s = UnixStream::from_std(s)?;
    let theirs = peer_pid(&s)?;
    if theirs != pid {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("unix socket owned by pid {theirs}, the listener offered pid {pid}"),
        ));
    }
    Ok(s)
}

/// Sends one frame, with `fd` attached (SCM_RIGHTS) when given.
pub(crate) async fn send_frame(s: &UnixStream, m: &Message, fd: Option<RawFd>) -> io::Result<()> {
    let frame = m
        .to_frame()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut off = 0;
    let mut fd = fd;
    while off < frame.len() {
        s.writable().await?;
        let r = s.try_io(Interest::WRITABLE, || {
            sendmsg(s.as_raw_fd(), &frame[off..], fd)
        });
        match r {
            Ok(n) => {
                off += n;
                // The descriptor went with the first byte.
                fd = None;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn sendmsg(sock: RawFd, data: &[u8], fd: Option<RawFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // Room for one descriptor, aligned for cmsghdr.
    let mut cbuf = [0u64; 4];
    // SAFETY: an all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        // SAFETY: CMSG_SPACE of a constant.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space;
        // SAFETY: msg_control points at `space` <= 32 bytes of our buffer; the first cmsghdr
        // fits, and CMSG_DATA points inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
        }
    }
    // SAFETY: msg points at valid buffers for the duration of the call.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Most descriptors one `recvmsg` accepts; the kernel closes any beyond them, and the read
/// fails (a correct peer sends one per frame).
const FDS_PER_READ: usize = 4;

/// Reads frames and the descriptors that travel with them off a unix socket.
///
/// Each descriptor belongs to the frame whose bytes arrived with it. A frame hands out at
/// most `max_fds` of its own ([`FdReader::take_fd`]); the others, and any left untaken,
/// are closed when the next frame is read. More than `max_fds` + [`FDS_PER_READ`] waiting
/// at once is an error: a peer cannot make us hold descriptors it passes.
pub(crate) struct FdReader {
    buf: Vec<u8>,
    /// Descriptors received, with the stream offset of the first byte read with each.
    fds: VecDeque<(u64, OwnedFd)>,
    /// The frame last returned's descriptors.
    frame_fds: VecDeque<OwnedFd>,
    /// Stream offset of `buf[0]`.
    consumed: u64,
    max_body: u32,
    max_fds: usize,
}

impl FdReader {
    /// A reader of frames of up to `max_body` bytes, each carrying at most `max_fds`
    /// descriptors (0: a descriptor is an error).
    pub(crate) fn new(max_body: u32, max_fds: usize) -> Self {
        Self {
            buf: Vec::new(),
            fds: VecDeque::new(),
            frame_fds: VecDeque::new(),
            consumed: 0,
            max_body,
            max_fds,
        }
    }

    /// Hands the descriptors that arrived with the stream's bytes before `end` to the frame
    /// that ends there (closing those over the limit).
    fn close_frame(&mut self, end: u64) -> io::Result<()> {
        self.frame_fds.clear();
        while self.fds.front().is_some_and(|(at, _)| *at < end) {
            let (_, fd) = self.fds.pop_front().expect("checked");
            self.frame_fds.push_back(fd);
        }
        if self.frame_fds.len() > self.max_fds {
            self.frame_fds.clear();
            if self.max_fds == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a descriptor where none is expected",
                ));
            }
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("more than {} descriptors with one frame", self.max_fds),
            ));
        }
        Ok(())
    }

    /// The next frame; `Ok(None)` on a clean end of stream.
    pub(crate) async fn next(&mut self, s: &UnixStream) -> io::Result<Option<Message>> {
        // What the previous frame did not take is closed now.
        self.frame_fds.clear();
        loop {
            if self.buf.len() >= FRAME_HEADER_LEN {
                let h: [u8; FRAME_HEADER_LEN] = self.buf[..FRAME_HEADER_LEN]
                    .try_into()
                    .expect("length checked");
                let header = FrameHeader::decode(&h, self.max_body)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                let end = FRAME_HEADER_LEN + header.body_len as usize;
                if self.buf.len() >= end {
                    let m = Message::decode(&self.buf[FRAME_HEADER_LEN..end])
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    self.buf.drain(..end);
                    self.consumed += end as u64;
                    self.close_frame(self.consumed)?;
                    return Ok(Some(m));
                }
            }
            if self.fds.len() > self.max_fds + FDS_PER_READ {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} descriptors waiting for their frames", self.fds.len()),
                ));
            }
            s.readable().await?;
            let mut chunk = [0u8; 4096];
            let at = self.consumed + self.buf.len() as u64;
            let mut got = Vec::new();
            let r = s.try_io(Interest::READABLE, || {
                recvmsg(s.as_raw_fd(), &mut chunk, &mut got)
            });
            self.fds.extend(got.into_iter().map(|fd| (at, fd)));
            if self.max_fds == 0 && !self.fds.is_empty() {
                self.fds.clear();
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a descriptor where none is expected",
                ));
            }
            match r {
                Ok(0) if self.buf.is_empty() => return Ok(None),
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// The (first) descriptor that came with the frame last returned.
    pub(crate) fn take_fd(&mut self) -> Option<OwnedFd> {
        self.frame_fds.pop_front()
    }
}

fn recvmsg(sock: RawFd, data: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // Room for FDS_PER_READ descriptors (CMSG_SPACE(16) = 32 bytes); the kernel closes any
    // beyond that and sets MSG_CTRUNC.
    let mut cbuf = [0u64; 4];
    debug_assert!(
        // SAFETY: CMSG_SPACE of a constant.
        unsafe { libc::CMSG_SPACE((FDS_PER_READ * std::mem::size_of::<RawFd>()) as u32) } as usize
            <= std::mem::size_of_val(&cbuf)
    );
    // SAFETY: an all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg points at valid buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel filled msg_control with well-formed cmsghdrs up to msg_controllen;
    // the CMSG_* macros walk them inside that bound.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    // The descriptor is ours now.
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "descriptors truncated",
        ));
    }
    Ok(n as usize)
}

/// A peer's region mapped into this process.
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; access is serialised by its `Remote`'s
// `revoked` lock for its lifetime and by the transfer contract for the bytes.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `Mapping::map` with this length; no copy can hold it (we are the
        // last reference).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

impl Mapping {
    /// Maps `len` bytes of a peer's memfd, after checking that it is shared memory (tmpfs),
    /// at least that long, sealed against shrinking and growing (a shrunk file would make
    /// our copies fault), and allocated (populating a sparse file would allocate it here).
    pub(crate) fn map(fd: &OwnedFd, len: u64) -> io::Result<Mapping> {
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad region length"))?;
        // SAFETY: an all-zero stat is valid; fd is open.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: st is a valid out-parameter.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if (st.st_size as u64) < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("memfd of {} bytes for a region of {len}", st.st_size),
            ));
        }
        // Shared memory (tmpfs), not hugetlbfs or a file: a hole punched in it reads as
        // zeros instead of faulting (a hugetlb page that cannot be had is a SIGBUS).
        // SAFETY: an all-zero statfs is valid; fd is open.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: fs is a valid out-parameter.
        if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if fs.f_type != libc::TMPFS_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the peer's descriptor is not shared memory (file system {:#x})",
                    fs.f_type
                ),
            ));
        }
        // SAFETY: fd is open; F_GET_SEALS has no other argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let needed = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & needed != needed {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the peer's memfd is not sealed against shrinking and growing",
            ));
        }
        // A kvbridge region's pages are all allocated by its owner (it touches every page).
        // Populating a sparse file would allocate its holes here, charged to us: a peer
        // could announce any size and have this process killed for memory.
        let allocated = (st.st_blocks as u64).saturating_mul(512);
        if allocated < len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the peer's memfd has {allocated} bytes allocated for a region of {len}: \
                     not mapping a sparse file"
                ),
            ));
        }
        // Populate now: the first copy into the region must not pay for page faults.
        // SAFETY: a fresh shared mapping of an fd we checked; the kernel picks the address.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }
}

/// How a peer's region is reached without the data connection.
enum Via {
    /// Mapped into this process (memfd).
    Mapped(Mapping),
    /// In the peer's address space at this base address (cross-memory attach).
    Cma(usize),
}

/// A peer's region this side copies into and out of directly.
pub(crate) struct Remote {
    /// Bytes the listener announced (every op is checked against them).
    len: usize,
    via: Via,
    /// Set (under the write lock) when the peer revoked the region: a copy holds the read
    /// lock for its whole length, so once the write lock is taken none runs or will start.
    revoked: RwLock<bool>,
}

impl Remote {
    /// Marks the region revoked; returns once no copy into or out of it is running.
    fn revoke(&self) {
        *self.revoked.write().unwrap_or_else(|e| e.into_inner()) = true;
    }

    /// Where byte 0 of the region is, for the copier that reaches it.
    fn base(&self) -> usize {
        match &self.via {
            Via::Mapped(m) => m.ptr as usize,
            Via::Cma(base) => *base,
        }
    }
}

/// Why a direct batch failed.
#[derive(Debug)]
pub(crate) enum ShmFail {
    /// The peer revoked this region (deregistered it or withdrew its grant).
    Revoked(RegionId),
    /// The op does not fit the region (the peer's MemInfo and its offer disagree).
    OutOfBounds(RegionId),
    /// The kernel refused or failed a cross-memory-attach copy for this region.
    Cma(RegionId, CopyError),
}

/// Batches this channel copied directly instead of sending them over TCP, by way.
#[derive(Debug, Default)]
pub(crate) struct DirectCopyCounters {
    /// Batches whose ops all went to mapped memfds.
    pub(crate) shm: AtomicU64,
    /// Batches with at least one op copied with cross-memory attach.
    pub(crate) cma: AtomicU64,
}

/// The peer's regions this side reaches directly, for one session. Filled by the session's
/// shared-memory task, used by its data writer.
pub(crate) struct ShmPeer {
    maps: RwLock<HashMap<RegionId, Arc<Remote>>>,
    /// The copier into the listener's process, once the probe read its canary.
    cma: OnceLock<CmaCopy>,
    /// Whether cross-memory attach is in use with this peer, or why not.
    cma_status: Mutex<CmaStatus>,
    counters: Arc<DirectCopyCounters>,
    /// Set by [`ShmPeer::revoke_all`]: the session is ending.
    ended: std::sync::atomic::AtomicBool,
    /// Region lengths the listener announced in its `MemInfo`: no mapping may be longer.
    announced: tokio::sync::watch::Sender<HashMap<RegionId, u64>>,
    /// Most bytes mapped from this peer at once ([`crate::Limits::max_shm_mapped_per_peer`]).
    max_mapped: AtomicU64,
}

/// Why a region the listener offers for mapping (`ShmMap`) is not mapped.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub(crate) enum MapRefused {
    /// Longer than the listener announced the region in its `MemInfo`: the listener
    /// contradicts itself, and its shared memory is not used any more.
    LongerThanAnnounced {
        /// The region.
        region: RegionId,
        /// Bytes offered for mapping.
        len: u64,
        /// Bytes announced.
        announced: u64,
    },
    /// Not announced in a `MemInfo` within the wait: TCP carries it.
    NotAnnounced {
        /// The region.
        region: RegionId,
        /// How long the announcement was waited for.
        after: std::time::Duration,
    },
    /// Mapping it would pass the per-peer cap: TCP carries it.
    OverCap {
        /// The region.
        region: RegionId,
        /// Bytes offered for mapping.
        len: u64,
        /// Bytes already mapped from this peer.
        mapped: u64,
        /// The cap.
        cap: u64,
    },
}

impl std::fmt::Display for MapRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MapRefused::LongerThanAnnounced {
                region,
                len,
                announced,
            } => write!(
                f,
                "ShmMap of {len} bytes for region {region}, announced with {announced}: refused"
            ),
            MapRefused::NotAnnounced { region, after } => write!(
                f,
                "ShmMap for region {region}, not announced in a MemInfo within {after:?}: not mapped"
            ),
            MapRefused::OverCap {
                region,
                len,
                mapped,
                cap,
            } => write!(
                f,
                "ShmMap of {len} bytes for region {region} with {mapped} bytes mapped from this \
                 peer would pass the cap of {cap} (max_shm_mapped_per_peer): not mapped"
            ),
        }
    }
}

impl ShmPeer {
    pub(crate) fn new(counters: Arc<DirectCopyCounters>, cma_status: CmaStatus) -> ShmPeer {
        ShmPeer {
            maps: Default::default(),
            cma: OnceLock::new(),
            cma_status: Mutex::new(cma_status),
            counters,
            ended: Default::default(),
            announced: tokio::sync::watch::channel(HashMap::new()).0,
            max_mapped: AtomicU64::new(u64::MAX),
        }
    }

    /// Records the region lengths of the listener's latest `MemInfo`.
    pub(crate) fn announce(&self, regions: impl IntoIterator<Item = (RegionId, u64)>) {
        self.announced.send_replace(regions.into_iter().collect());
    }

    /// Caps the bytes mapped from this peer at once.
    pub(crate) fn set_max_mapped(&self, cap: u64) {
        self.max_mapped.store(cap, Ordering::Relaxed);
    }

    /// Whether region `id` may be mapped with `len` bytes: no longer than the listener
    /// announced it (its `MemInfo` travels on the control connection, so it may come after
    /// the offer: waited for up to `wait`), and within the per-peer cap of mapped bytes.
    pub(crate) async fn admit_map(
        &self,
        id: RegionId,
        len: u64,
        wait: std::time::Duration,
    ) -> std::result::Result<(), MapRefused> {
        let mut rx = self.announced.subscribe();
        let announced = match tokio::time::timeout(wait, rx.wait_for(|m| m.contains_key(&id))).await
        {
            Ok(Ok(m)) => m[&id],
            _ => {
                return Err(MapRefused::NotAnnounced {
                    region: id,
                    after: wait,
                })
            }
        };
        if len > announced {
            return Err(MapRefused::LongerThanAnnounced {
                region: id,
                len,
                announced,
            });
        }
        let mapped: u64 = self
            .maps
            .read()
            .expect("shm maps poisoned")
            .iter()
            .filter(|(k, r)| **k != id && matches!(r.via, Via::Mapped(_)))
            .map(|(_, r)| r.len as u64)
            .sum();
        let cap = self.max_mapped.load(Ordering::Relaxed);
        if mapped.saturating_add(len) > cap {
            return Err(MapRefused::OverCap {
                region: id,
                len,
                mapped,
                cap,
            });
        }
        Ok(())
    }

    pub(crate) fn insert(&self, id: RegionId, m: Mapping) {
        let r = Remote {
            len: m.len,
            via: Via::Mapped(m),
            revoked: RwLock::new(false),
        };
        self.maps
            .write()
            .expect("shm maps poisoned")
            .insert(id, Arc::new(r));
    }

    /// Records a region offered for cross-memory attach; ignored (the region goes over TCP)
    /// unless the probe passed.
    pub(crate) fn insert_cma(&self, id: RegionId, base: u64, len: u64) -> bool {
        let (Ok(base), Ok(len)) = (usize::try_from(base), usize::try_from(len)) else {
            return false;
        };
        if self.cma.get().is_none() || base.checked_add(len).is_none() || len == 0 {
            return false;
        }
        let r = Remote {
            len,
            via: Via::Cma(base),
            revoked: RwLock::new(false),
        };
        self.maps
            .write()
            .expect("shm maps poisoned")
            .insert(id, Arc::new(r));
        true
    }

    /// The probe read the listener's canary: regions it offers for cross-memory attach may
    /// be used from now on.
    pub(crate) fn enable_cma(&self, pid: u32) {
        let _ = self.cma.set(CmaCopy::new(pid));
        self.set_cma_status(CmaStatus::Active);
    }

    pub(crate) fn set_cma_status(&self, s: CmaStatus) {
        *self.cma_status.lock().expect("cma status poisoned") = s;
    }

    pub(crate) fn cma_status(&self) -> CmaStatus {
        self.cma_status.lock().expect("cma status poisoned").clone()
    }

    /// Removes and revokes a region; returns once no copy into it runs. Blocking. Whether
    /// the region was reachable.
    pub(crate) fn revoke(&self, id: &RegionId) -> bool {
        let m = self.maps.write().expect("shm maps poisoned").remove(id);
        if let Some(m) = &m {
            m.revoke();
        }
        m.is_some()
    }

    /// Revokes every region (the connection that could revoke them is ending). Blocking.
    pub(crate) fn revoke_all(&self) {
        self.ended.store(true, Ordering::Release);
        let all: Vec<Arc<Remote>> = self
            .maps
            .write()
            .expect("shm maps poisoned")
            .drain()
            .map(|(_, m)| m)
            .collect();
        for m in all {
            m.revoke();
        }
    }

    /// Whether [`ShmPeer::revoke_all`] ran: a revoked region then means the session ended.
    pub(crate) fn ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// The direct way to every op's region, or `None` when one region is not reachable
    /// directly (the batch goes over TCP).
    pub(crate) fn resolve(&self, descs: &[OpDesc]) -> Option<Vec<Arc<Remote>>> {
        let maps = self.maps.read().expect("shm maps poisoned");
        if maps.is_empty() {
            return None;
        }
        descs.iter().map(|d| maps.get(&d.region).cloned()).collect()
    }

    /// Regions mapped into this process (shared memory proper).
    pub(crate) fn len(&self) -> usize {
        self.maps
            .read()
            .expect("shm maps poisoned")
            .values()
            .filter(|r| matches!(r.via, Via::Mapped(_)))
            .count()
    }

    /// Executes a batch by direct copies: each run of consecutive ops into one region is
    /// one call of that region's [`PieceCopy`] (one `memcpy` per op for a mapping; up to
    /// [`crate::transport::cma::IOV_MAX`] ops per system call for cross-memory attach). Runs on the
    /// data writer thread (reads, and writes on a current-thread runtime) or on the thread of
    /// the task that issued the write.
    pub(crate) fn copy_batch(
        &self,
        dir: Dir,
        descs: &[OpDesc],
        maps: &[Arc<Remote>],
        local: &[LocalSlice],
    ) -> Result<(), ShmFail> {
        let mut used_cma = false;
        let mut i = 0;
        while i < descs.len() {
            let m = &maps[i];
            let mut end = i + 1;
            while end < descs.len() && Arc::ptr_eq(&maps[end], m) {
                end += 1;
            }
            let region = descs[i].region;
            // One read lock per run: a revocation waits for the run to finish.
            let g = m.revoked.read().unwrap_or_else(|e| e.into_inner());
            if *g {
                return Err(ShmFail::Revoked(region));
            }
            let mut pieces = Vec::with_capacity(end - i);
            for (d, l) in descs[i..end].iter().zip(&local[i..end]) {
                if !d.in_bounds(m.len as u64) || d.len as usize != l.len {
                    return Err(ShmFail::OutOfBounds(region));
                }
                pieces.push(Piece {
                    remote: m.base() + d.offset as usize,
                    local: l.ptr(),
                    len: l.len,
                });
            }
            // SAFETY: every remote range is inside the region as the peer announced it on
            // this session (checked above), and the read lock keeps it from being revoked
            // meanwhile; the local ranges were checked against their regions, which the
            // slices hold in use. The transfer contract excludes concurrent access.
            let r = unsafe {
                match &m.via {
                    Via::Mapped(_) => MemCopy.copy(dir, &pieces),
                    Via::Cma(_) => {
                        used_cma = true;
                        match self.cma.get() {
                            Some(c) => c.copy(dir, &pieces),
                            None => return Err(ShmFail::Revoked(region)),
                        }
                    }
                }
            };
            drop(g);
            r.map_err(|e| ShmFail::Cma(region, e))?;
            i = end;
        }
        let c = if used_cma {
            &self.counters.cma
        } else {
            &self.counters.shm
        };
        c.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Messages of the shared-memory connection, for the session.
pub(crate) fn unmapped(id: RegionId) -> Message {
    Message::ShmUnmapped(ShmRevoke { id })
}

/// A `ShmMap` for a region.
pub(crate) fn map_msg(id: RegionId, len: u64) -> Message {
    Message::ShmMap(ShmRegion {
        id,
        len,
        addr: None,
    })
}

/// A `ShmMap` offering a region for cross-memory attach at `addr`.
pub(crate) fn cma_map_msg(id: RegionId, len: u64, addr: u64) -> Message {
    Message::ShmMap(ShmRegion {
        id,
        len,
        addr: Some(addr),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::{memfd, Region};

    fn op(id: RegionId, offset: u64, len: u64, local: &Region) -> (OpDesc, LocalSlice) {
        (
            OpDesc {
                region: id,
                offset,
                len,
            },
            LocalSlice {
                region: local.begin_use(),
                offset: 0,
                len: len as usize,
            },
        )
    }

    fn open_fds() -> usize {
        std::fs::read_dir("/proc/self/fd").unwrap().count()
    }

    /// A sealed memfd whose pages were never allocated (a hostile listener announcing a
    /// huge region) is refused before it is mapped: populating it would allocate all of
    /// it in this process.
    #[test]
    fn a_sparse_memfd_is_not_mapped() {
        let len = 256usize << 20;
        let fd = memfd(len).unwrap();
        let e = Mapping::map(&fd, len as u64)
            .err()
            .expect("a sparse memfd was mapped");
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("sparse"), "{e}");
        // An allocated one of the same kind maps (what a kvbridge listener passes).
        let len = 1usize << 20;
        let fd = memfd(len).unwrap();
        // SAFETY: fd is open; the range is the file's.
        let rc = unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, len as i64) };
        assert_eq!(rc, 0);
        Mapping::map(&fd, len as u64).unwrap();
    }

    /// A descriptor that is not shared memory (a file, a pipe) is refused.
    #[test]
    fn a_descriptor_that_is_not_shared_memory_is_not_mapped() {
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let fd = OwnedFd::from(f);
        let e = Mapping::map(&fd, 4096).err().expect("a file was mapped");
        assert!(e.to_string().contains("not shared memory"), "{e}");
    }

    /// Descriptors a frame may not carry are closed, not kept: with none allowed the first
    /// one ends the read; with one allowed, extra ones and those sent with other frames
    /// are closed, and the one sent with the frame is handed out.
    #[tokio::test]
    async fn descriptors_beyond_a_frames_share_are_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        let base = open_fds();
        // Three descriptors with a whole frame, none allowed.
        let frame = Message::ShmSync(kvbridge_proto::msg::Ready {})
            .to_frame()
            .unwrap();
        send_fds(&a, &frame, &[null.as_raw_fd(); 3]);
        let mut fr = FdReader::new(1 << 12, 0);
        let e = fr.next(&b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{e}");
        drop(fr);
        drop((a, b));
        assert!(open_fds() <= base, "{} descriptors kept", open_fds() - base);

        // A frame's bytes trickling in, each piece with descriptors: the waiting ones are
        // bounded before the frame is even complete.
        let (a, b) = UnixStream::pair().unwrap();
        for _ in 0..5 {
            send_fds(&a, &frame[..1], &[null.as_raw_fd(); 3]);
        }
        let mut fr = FdReader::new(1 << 12, 1);
        let e = tokio::time::timeout(std::time::Duration::from_secs(5), fr.next(&b))
            .await
            .expect("descriptors kept while waiting for the frame")
            .unwrap_err();
        assert!(e.to_string().contains("waiting"), "{e}");
        drop(fr);
        drop((a, b));
        assert!(open_fds() <= base, "{} descriptors kept", open_fds() - base);

        let (a, b) = UnixStream::pair().unwrap();
        let base = open_fds();
        let map = Message::ShmMap(ShmRegion {
            id: RegionId([1; 16]),
            len: 4096,
            addr: None,
        })
        .to_frame()
        .unwrap();
        // A ShmMap with one descriptor, then a ShmSync with one it may not carry.
        send_fds(&a, &map, &[null.as_raw_fd()]);
        send_fds(&a, &frame, &[null.as_raw_fd()]);
        let mut fr = FdReader::new(1 << 12, 1);
        assert!(matches!(
            fr.next(&b).await.unwrap(),
            Some(Message::ShmMap(_))
        ));
        let fd = fr.take_fd().expect("the ShmMap's descriptor");
        assert!(fr.take_fd().is_none());
        assert!(matches!(
            fr.next(&b).await.unwrap(),
            Some(Message::ShmSync(_))
        ));
        // Still held until the next frame is read; not handed out as a ShmMap's.
        drop(fd);
        drop(a);
        assert!(fr.next(&b).await.unwrap().is_none());
        assert!(open_fds() <= base, "{} descriptors kept", open_fds() - base);

        // A ShmMap with two descriptors: refused, both closed.
        let (a, b) = UnixStream::pair().unwrap();
        send_fds(&a, &map, &[null.as_raw_fd(); 2]);
        let mut fr = FdReader::new(1 << 12, 1);
        let e = fr.next(&b).await.unwrap_err();
        assert!(e.to_string().contains("more than 1"), "{e}");
        assert!(fr.take_fd().is_none());
        drop((fr, a, b));
        assert!(open_fds() <= base, "{} descriptors kept", open_fds() - base);
    }

    /// Sends `data` with `fds` attached, blocking.
    fn send_fds(s: &UnixStream, data: &[u8], fds: &[RawFd]) {
        let mut iov = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        let mut cbuf = [0u64; 16];
        // SAFETY: an all-zero msghdr is valid.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        let bytes = std::mem::size_of_val(fds);
        msg.msg_control = cbuf.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE of a small length.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
        // SAFETY: the control buffer holds one cmsghdr with `bytes` of data.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
        // SAFETY: msg points at valid buffers for the call.
        let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, 0) };
        assert_eq!(n, data.len() as isize, "{}", io::Error::last_os_error());
    }

    /// A region reached by cross-memory attach is checked like a mapping: an op past its
    /// announced end is refused before any byte moves, and once revoked nothing is copied.
    #[test]
    fn cma_ops_are_bounded_and_revocable() {
        if crate::transport::cma::cma_available().is_err() {
            return;
        }
        let mut target = vec![0u8; 8192];
        let local = Region::alloc(4096, 4096).unwrap();
        local.write_at(0, &[7u8; 4096]).unwrap();
        let peer = ShmPeer::new(Default::default(), CmaStatus::Off(String::new()));
        let id = RegionId([1; 16]);
        // Nothing is recorded before the probe passed.
        assert!(!peer.insert_cma(id, target.as_mut_ptr() as u64, 4096));
        peer.enable_cma(std::process::id());
        // Only the first 4096 bytes are announced.
        assert!(peer.insert_cma(id, target.as_mut_ptr() as u64, 4096));
        assert_eq!(peer.len(), 0, "not a mapping");

        let (d, l) = op(id, 1, 4096, &local);
        let maps = peer.resolve(std::slice::from_ref(&d)).unwrap();
        let r = peer.copy_batch(Dir::Write, &[d], &maps, &[l]);
        assert!(matches!(r, Err(ShmFail::OutOfBounds(_))), "{r:?}");
        assert!(target.iter().all(|&b| b == 0));

        let (d, l) = op(id, 0, 4096, &local);
        let maps = peer.resolve(std::slice::from_ref(&d)).unwrap();
        peer.copy_batch(Dir::Write, std::slice::from_ref(&d), &maps, &[l])
            .unwrap();
        assert!(target[..4096].iter().all(|&b| b == 7));
        assert!(target[4096..].iter().all(|&b| b == 0));
        assert_eq!(peer.counters.cma.load(Ordering::Relaxed), 1);

        // Resolved before the revocation, copied after: refused.
        peer.revoke(&id);
        local.write_at(0, &[9u8; 4096]).unwrap();
        let (d, l) = op(id, 0, 4096, &local);
        let r = peer.copy_batch(Dir::Write, std::slice::from_ref(&d), &maps, &[l]);
        assert!(matches!(r, Err(ShmFail::Revoked(_))), "{r:?}");
        assert!(target[..4096].iter().all(|&b| b == 7));
        assert!(peer.resolve(&[d]).is_none(), "gone from the map");
    }

    /// A region offered for mapping is admitted only within what the listener announced
    /// in its `MemInfo` (waiting for a `MemInfo` that comes after the offer) and within the
    /// per-peer cap of mapped bytes.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_mapping_is_bounded_by_the_announced_region_and_the_cap() {
        let peer = Arc::new(ShmPeer::new(
            Default::default(),
            CmaStatus::Off(String::new()),
        ));
        let (a, b) = (RegionId([1; 16]), RegionId([2; 16]));
        let wait = std::time::Duration::from_secs(1);
        assert_eq!(
            peer.admit_map(a, 8192, wait).await,
            Err(MapRefused::NotAnnounced {
                region: a,
                after: wait
            })
        );
        // Announced while the offer waits.
        let p = peer.clone();
        let late = tokio::spawn(async move { p.admit_map(a, 8192, wait).await });
        tokio::task::yield_now().await;
        peer.announce([(a, 8192), (b, 8192)]);
        assert_eq!(late.await.unwrap(), Ok(()));
        assert_eq!(
            peer.admit_map(a, 1 << 40, wait).await,
            Err(MapRefused::LongerThanAnnounced {
                region: a,
                len: 1 << 40,
                announced: 8192
            })
        );
        // The cap counts what is mapped already, not the region being replaced.
        peer.set_max_mapped(12288);
        let fd = memfd(8192).unwrap();
        touch(&fd, 8192);
        peer.insert(a, Mapping::map(&fd, 8192).unwrap());
        assert_eq!(peer.admit_map(a, 8192, wait).await, Ok(()));
        assert_eq!(
            peer.admit_map(b, 8192, wait).await,
            Err(MapRefused::OverCap {
                region: b,
                len: 8192,
                mapped: 8192,
                cap: 12288
            })
        );
        peer.set_max_mapped(16384);
        assert_eq!(peer.admit_map(b, 8192, wait).await, Ok(()));
    }

    /// Allocates every page of a fresh memfd, as a region's owner does.
    fn touch(fd: &OwnedFd, len: usize) {
        let f = std::fs::File::from(fd.try_clone().unwrap());
        std::os::unix::fs::FileExt::write_all_at(&f, &vec![1u8; len], 0).unwrap();
    }
}
