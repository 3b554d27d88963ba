//! Who may address a local region and what they may do with it: the grant given at
//! `register`, and the table every incoming batch is checked against.
//!
//! A grant names peers ([`Grant`]) and an [`Access`] mode. The receiver of a batch enforces
//! both wherever it does the copy itself (TCP): a batch that reads a write-only region or
//! writes a read-only one is refused with [`ErrorCode::AccessDenied`] and ends the session,
//! like any other op outside what was granted.
//!
//! Shared memory and cross-memory attach let the *peer* do the copy, so no mode can be
//! enforced on them: a mapped memfd is readable and writable, and a read-only descriptor
//! does not help (a process holding an `O_RDONLY` memfd can reopen it read-write through
//! `/proc/self/fd`, the inode being mode 0777; the test below shows it). A region whose
//! access is not [`Access::ReadWrite`] is therefore never offered over shared memory or
//! cross-memory attach: its batches go over TCP, where the mode holds.
//!
//! A grant may also confine a peer's writes to *windows*
//! ([`Permission::writes_in_windows`]): byte ranges the owner opens for one peer
//! (`Channel::open_window`) and closes again (`Channel::close_window`); a write that is not
//! wholly inside that peer's open windows is refused with `AccessDenied`. Closing a window
//! stops new writes at once and returns a [`WindowDrain`] that waits for the writes that had
//! already passed it, so the owner can hand the bytes to someone else only when nothing of
//! the old holder can land. Windows hold where the receiver does the copy (TCP), so a
//! region with windows, like one with a mode, stays off shared memory and cross-memory
//! attach, unless its grant says [`Permission::with_direct_copies`]: then same-host peers
//! map it (or copy by address) and reach all of it, and the mode and windows hold for TCP
//! peers only (`docs/threat-model.md`).
//!
//! [`ErrorCode::AccessDenied`]: kvbridge_proto::msg::ErrorCode::AccessDenied

use crate::error::{Error, Result};
use crate::landing::{Landing, LandingHold};
use crate::region::{Region, RegionUse};
use kvbridge_proto::msg::{ErrorCode, MemInfo, RegionInfo};
use kvbridge_proto::{PeerId, RegionId};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

/// Which peers may address a region.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Grant {
    /// Every peer of the channel.
    #[default]
    AllPeers,
    /// Only these peers.
    Peers(Vec<PeerId>),
}

impl Grant {
    fn allows(&self, peer: &PeerId) -> bool {
        match self {
            Grant::AllPeers => true,
            Grant::Peers(p) => p.contains(peer),
        }
    }

    /// These peers may only read the region.
    pub fn read_only(self) -> Permission {
        self.with_access(Access::ReadOnly)
    }

    /// These peers may only write the region.
    pub fn write_only(self) -> Permission {
        self.with_access(Access::WriteOnly)
    }

    /// These peers get `access` to the region.
    pub fn with_access(self, access: Access) -> Permission {
        Permission {
            peers: self,
            access,
            windowed: false,
            direct: false,
        }
    }
}

/// What granted peers may do with a region.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Access {
    /// Read and write (what a plain [`Grant`] gives). The only mode offered over shared
    /// memory and cross-memory attach.
    #[default]
    ReadWrite,
    /// Read only: the peer's writes are refused. Carried over TCP only.
    ReadOnly,
    /// Write only: the peer's reads are refused. Carried over TCP only.
    WriteOnly,
}

impl Access {
    /// Whether a transfer that writes (`true`) or reads (`false`) the region is allowed.
    fn allows(self, writes: bool) -> bool {
        match self {
            Access::ReadWrite => true,
            Access::ReadOnly => !writes,
            Access::WriteOnly => writes,
        }
    }
}

/// A grant with its access mode: what `Channel::register` takes. A plain [`Grant`] converts
/// into read-write access, so `register(&r, Grant::AllPeers)` keeps its meaning.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Permission {
    /// Who.
    pub peers: Grant,
    /// What they may do.
    pub access: Access,
    /// Writes land only inside windows opened for the writing peer (see the module doc).
    pub windowed: bool,
    /// Offered over shared memory and cross-memory attach even with a mode or windows,
    /// which then hold for TCP peers only.
    pub direct: bool,
}

impl From<Grant> for Permission {
    fn from(peers: Grant) -> Self {
        Permission {
            peers,
            access: Access::ReadWrite,
            windowed: false,
            direct: false,
        }
    }
}

impl Permission {
    fn allows(&self, peer: &PeerId) -> bool {
        self.peers.allows(peer)
    }

    /// A peer's writes land only inside the windows opened for it with
    /// `Channel::open_window` (enforced where the receiver copies: TCP).
    pub fn writes_in_windows(mut self) -> Permission {
        self.windowed = true;
        self
    }

    /// Offers the region over shared memory and cross-memory attach despite a mode or
    /// windows: same-host peers then reach all of it, and the restriction holds for TCP
    /// peers only. For a hot path where a same-host peer is trusted as much as a process of
    /// the same user already is (it could ptrace us where the host allows that).
    pub fn with_direct_copies(mut self) -> Permission {
        self.direct = true;
        self
    }

    /// Whether a peer may copy by itself (shared memory, cross-memory attach).
    fn direct_allowed(&self) -> bool {
        self.direct || (self.access == Access::ReadWrite && !self.windowed)
    }
}

/// An open write window ([`Permission::writes_in_windows`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WindowId(u64);

/// The writes still landing through a closed window: no new one can pass it.
pub struct WindowDrain(Arc<Landing>);

impl WindowDrain {
    /// Whether no write through the window is landing any more.
    pub fn is_drained(&self) -> bool {
        self.0.count() == 0
    }

    /// Waits until no write through the window is landing. Each write is bounded by the
    /// channel's payload deadline (past it the writer's session ends and its write with it),
    /// so this returns within about the op deadline; callers still bound it.
    pub async fn drained(&self) {
        self.0.drained().await
    }
}

impl std::fmt::Debug for WindowDrain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WindowDrain({} landing)", self.0.count())
    }
}

struct Window {
    id: WindowId,
    end: u64,
    uses: Arc<Landing>,
}

struct Entry {
    region: Region,
    permission: Permission,
    /// Per peer, its open windows by start offset.
    windows: HashMap<PeerId, BTreeMap<u64, Window>>,
}

impl Entry {
    /// Holds on every window of `peer` that `offset..offset+len` passes through, when they
    /// cover it without a gap.
    fn cover(&self, peer: &PeerId, offset: u64, len: u64) -> Option<Vec<LandingHold>> {
        let end = offset.checked_add(len)?;
        let mut holds = Vec::new();
        if len == 0 {
            return Some(holds);
        }
        let ws = self.windows.get(peer)?;
        let mut pos = offset;
        while pos < end {
            let (_, w) = ws.range(..=pos).next_back()?;
            if w.end <= pos {
                return None;
            }
            holds.push(LandingHold::new(&w.uses));
            pos = w.end;
        }
        Some(holds)
    }
}

#[derive(Default)]
struct Tables {
    regions: HashMap<RegionId, Entry>,
    /// Where each open window is: region, peer, start.
    windows: HashMap<WindowId, (RegionId, PeerId, u64)>,
    next_window: u64,
}

/// Why a peer's op on a region is refused, for its `Reject`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Denied {
    /// No such region, or not granted to this peer (the two are not told apart).
    NotGranted,
    /// Granted, but not for this direction.
    Mode(Access),
    /// A write outside the windows open for this peer.
    OutsideWindows {
        /// First byte.
        offset: u64,
        /// Length.
        len: u64,
    },
}

impl Denied {
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            Denied::NotGranted => ErrorCode::UnknownRegion,
            Denied::Mode(_) | Denied::OutsideWindows { .. } => ErrorCode::AccessDenied,
        }
    }

    pub(crate) fn message(&self, op: usize, region: &RegionId, writes: bool) -> String {
        match self {
            Denied::NotGranted => format!("op {op}: region {region} is not granted to this peer"),
            Denied::Mode(a) => format!(
                "op {op}: region {region} is granted {} to this peer: {} refused",
                match a {
                    Access::ReadOnly => "read-only",
                    Access::WriteOnly => "write-only",
                    Access::ReadWrite => "read-write",
                },
                if writes { "writes" } else { "reads" }
            ),
            Denied::OutsideWindows { offset, len } => format!(
                "op {op}: {len} bytes at offset {offset} of region {region} are outside the \
                 ranges open to this peer for writing"
            ),
        }
    }
}

/// The channel's local regions, who may address them, and the write windows open on them.
/// Written by `register`, `deregister` and the window calls only; a region is in the table
/// before any peer can learn its id.
#[derive(Default)]
pub(crate) struct RegionTable {
    map: RwLock<Tables>,
}

impl RegionTable {
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Tables> {
        self.map.read().expect("region table poisoned")
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Tables> {
        self.map.write().expect("region table poisoned")
    }

    pub(crate) fn insert(&self, r: Region, p: Permission) -> Result<()> {
        let mut t = self.write();
        if t.regions.contains_key(&r.id()) {
            return Err(Error::Local(format!(
                "region {} already registered",
                r.id()
            )));
        }
        t.regions.insert(
            r.id(),
            Entry {
                region: r,
                permission: p,
                windows: HashMap::new(),
            },
        );
        Ok(())
    }

    pub(crate) fn remove(&self, id: &RegionId) -> Option<Region> {
        let mut t = self.write();
        let e = t.regions.remove(id)?;
        t.windows.retain(|_, (r, _, _)| r != id);
        Some(e.region)
    }

    /// Opens a window of `len` bytes at `offset` of region `id` for `peer`'s writes.
    pub(crate) fn open_window(
        &self,
        id: &RegionId,
        peer: &PeerId,
        offset: u64,
        len: u64,
    ) -> Result<WindowId> {
        let mut t = self.write();
        let wid = WindowId(t.next_window);
        let e = t
            .regions
            .get_mut(id)
            .ok_or_else(|| Error::Local(format!("region {id} is not registered")))?;
        if !e.permission.windowed {
            return Err(Error::Local(format!(
                "region {id} was not registered with writes_in_windows"
            )));
        }
        if len == 0 || !e.region.contains(offset, len) {
            return Err(Error::Local(format!(
                "window of {len} bytes at offset {offset} is not inside region {id} of {} bytes",
                e.region.len()
            )));
        }
        e.windows.entry(peer.clone()).or_default().insert(
            offset,
            Window {
                id: wid,
                end: offset + len,
                uses: Arc::default(),
            },
        );
        t.next_window += 1;
        t.windows.insert(wid, (*id, peer.clone(), offset));
        Ok(wid)
    }

    /// Closes a window: no write passes it from now on. `None` when it is not open.
    pub(crate) fn close_window(&self, wid: WindowId) -> Option<WindowDrain> {
        let mut t = self.write();
        let (id, peer, start) = t.windows.remove(&wid)?;
        let e = t.regions.get_mut(&id)?;
        let ws = e.windows.get_mut(&peer)?;
        let w = ws.remove(&start).filter(|w| w.id == wid)?;
        if ws.is_empty() {
            e.windows.remove(&peer);
        }
        Some(WindowDrain(w.uses))
    }

    /// Looks a region up for a transfer by `peer` of `len` bytes at `offset` and marks it in
    /// use (`writes`: the transfer writes into it), atomically with respect to `remove` and
    /// `close_window`.
    pub(crate) fn use_for(
        &self,
        peer: &PeerId,
        id: &RegionId,
        offset: u64,
        len: u64,
        writes: bool,
    ) -> std::result::Result<RegionUse, Denied> {
        let t = self.read();
        let e = match t.regions.get(id) {
            Some(e) if e.permission.allows(peer) => e,
            _ => return Err(Denied::NotGranted),
        };
        let p = &e.permission;
        if !p.access.allows(writes) {
            return Err(Denied::Mode(p.access));
        }
        if !writes {
            return Ok(e.region.begin_use());
        }
        if !p.windowed {
            return Ok(e.region.begin_write());
        }
        let holds = e
            .cover(peer, offset, len)
            .ok_or(Denied::OutsideWindows { offset, len })?;
        Ok(e.region.begin_write().within(holds))
    }

    /// The regions granted to `peer` that it may reach directly: the shared ones, and with
    /// `cma` those that cross-memory attach carries too. Only unrestricted grants (or those
    /// that ask for it): the peer copies by itself there, so no mode or window could be
    /// enforced (see the module doc).
    pub(crate) fn direct_copy_regions_for(&self, peer: &PeerId, cma: bool) -> Vec<Region> {
        let t = self.read();
        t.regions
            .values()
            .filter(|e| {
                let r = &e.region;
                e.permission.allows(peer) && (r.is_shared() || (cma && r.wants_cma()))
            })
            .filter(|e| {
                let direct = e.permission.direct_allowed();
                if !direct {
                    tracing::debug!(%peer, region = %e.region.id(), access = ?e.permission.access, windowed = e.permission.windowed, "region not offered over shared memory or cross-memory attach: the peer would copy by itself and its access mode or write windows could not be enforced; it is served over TCP");
                }
                direct
            })
            .map(|e| e.region.clone())
            .collect()
    }

    /// The regions granted to `peer` that it may reach over UCX: the unrestricted grants (or
    /// those that ask for direct copies), since the peer then writes and reads by itself, as
    /// over shared memory.
    #[cfg(feature = "ucx")]
    pub(crate) fn ucx_for(&self, peer: &PeerId) -> Vec<Region> {
        let t = self.read();
        t.regions
            .values()
            .filter(|e| e.permission.allows(peer) && e.permission.direct_allowed())
            .map(|e| e.region.clone())
            .collect()
    }

    /// What this side grants to `peer`.
    pub(crate) fn granted_to(&self, peer: &PeerId) -> MemInfo {
        let t = self.read();
        let mut regions: Vec<RegionInfo> = t
            .regions
            .values()
            .filter(|e| e.permission.allows(peer))
            .map(|e| e.region.info())
            .collect();
        regions.sort_by_key(|r| r.id);
        MemInfo { regions }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// Why a read-only descriptor is no read-only grant: whoever holds an `O_RDONLY` memfd
    /// reopens it read-write through `/proc/self/fd`, and can then map it writable.
    #[test]
    fn a_read_only_memfd_descriptor_reopens_read_write() {
        let fd = crate::region::memfd(4096).expect("memfd");
        let open = |path: String, flags| {
            let p = CString::new(path).unwrap();
            // SAFETY: p is a valid C string; open has no other argument here.
            let raw = unsafe { libc::open(p.as_ptr(), flags | libc::O_CLOEXEC) };
            assert!(raw >= 0, "open: {}", std::io::Error::last_os_error());
            // SAFETY: raw is a fresh descriptor that nothing else owns.
            unsafe { OwnedFd::from_raw_fd(raw) }
        };
        let ro = open(format!("/proc/self/fd/{}", fd.as_raw_fd()), libc::O_RDONLY);
        let rw = open(format!("/proc/self/fd/{}", ro.as_raw_fd()), libc::O_RDWR);
        // SAFETY: maps 4096 bytes of an open memfd of that size; unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                rw.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "the reopened descriptor maps writable");
        // SAFETY: p maps 4096 bytes.
        unsafe { libc::munmap(p, 4096) };
    }

    #[test]
    fn modes_refuse_the_other_direction_only() {
        let t = RegionTable::default();
        let me = PeerId::new("p").unwrap();
        let ro = Region::alloc(4096, 4096).unwrap();
        let wo = Region::alloc(4096, 4096).unwrap();
        let rw = Region::alloc(4096, 4096).unwrap();
        t.insert(ro.clone(), Grant::AllPeers.read_only()).unwrap();
        t.insert(wo.clone(), Grant::AllPeers.write_only()).unwrap();
        t.insert(rw.clone(), Grant::AllPeers.into()).unwrap();
        let use_for = |id: &RegionId, writes| t.use_for(&me, id, 0, 8, writes);
        assert!(use_for(&ro.id(), false).is_ok());
        assert_eq!(
            use_for(&ro.id(), true).err(),
            Some(Denied::Mode(Access::ReadOnly))
        );
        assert!(use_for(&wo.id(), true).is_ok());
        assert_eq!(
            use_for(&wo.id(), false).err(),
            Some(Denied::Mode(Access::WriteOnly))
        );
        assert!(use_for(&rw.id(), true).is_ok());
        assert!(use_for(&rw.id(), false).is_ok());
        // Only the read-write region is offered for direct copies.
        let direct: Vec<_> = t
            .direct_copy_regions_for(&me, true)
            .iter()
            .map(|r| r.id())
            .collect();
        assert_eq!(direct, vec![rw.id()]);
    }

    #[tokio::test]
    async fn windows_confine_writes_and_closing_one_waits_for_what_passed_it() {
        let t = RegionTable::default();
        let (a, b) = (PeerId::new("a").unwrap(), PeerId::new("b").unwrap());
        let r = Region::alloc(4 * 4096, 4096).unwrap();
        t.insert(r.clone(), Grant::AllPeers.write_only().writes_in_windows())
            .unwrap();
        let w1 = t.open_window(&r.id(), &a, 0, 4096).unwrap();
        let w2 = t.open_window(&r.id(), &a, 4096, 4096).unwrap();
        // Inside, and across two adjacent windows of the same peer.
        assert!(t.use_for(&a, &r.id(), 100, 8, true).is_ok());
        assert!(t.use_for(&a, &r.id(), 4000, 200, true).is_ok());
        // Outside, past the end of the last window, or another peer's.
        for (p, off, len) in [
            (&a, 8192, 8),
            (&a, 8000, 400),
            (&b, 0, 8),
            (&a, u64::MAX, 2),
        ] {
            assert!(
                matches!(
                    t.use_for(p, &r.id(), off, len, true),
                    Err(Denied::OutsideWindows { .. })
                ),
                "{p} {off} {len}"
            );
        }
        // A write in flight through w1 holds its drain.
        let landing = t.use_for(&a, &r.id(), 0, 8, true).unwrap();
        let again = landing.again();
        let d = t.close_window(w1).unwrap();
        assert!(t.close_window(w1).is_none());
        assert!(
            t.use_for(&a, &r.id(), 0, 8, true).is_err(),
            "closed window passed a write"
        );
        assert!(!d.is_drained());
        drop(landing);
        assert!(!d.is_drained(), "the split part still lands");
        let waiter = tokio::spawn(async move { d.drained().await });
        drop(again);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiter)
            .await
            .expect("drained")
            .unwrap();
        assert!(t.close_window(w2).unwrap().is_drained());
        assert!(t.open_window(&r.id(), &a, 4 * 4096, 1).is_err());
    }
}
