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
//! [`ErrorCode::AccessDenied`]: kvbridge_proto::msg::ErrorCode::AccessDenied

use crate::error::{Error, Result};
use crate::region::{Region, RegionUse};
use kvbridge_proto::msg::{ErrorCode, MemInfo, RegionInfo};
use kvbridge_proto::{PeerId, RegionId};
use std::collections::HashMap;
use std::sync::RwLock;

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
}

impl From<Grant> for Permission {
    fn from(peers: Grant) -> Self {
        Permission {
            peers,
            access: Access::ReadWrite,
        }
    }
}

impl Permission {
    fn allows(&self, peer: &PeerId) -> bool {
        self.peers.allows(peer)
    }
}

/// Why a peer's op on a region is refused, for its `Reject`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Denied {
    /// No such region, or not granted to this peer (the two are not told apart).
    NotGranted,
    /// Granted, but not for this direction.
    Mode(Access),
}

impl Denied {
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            Denied::NotGranted => ErrorCode::UnknownRegion,
            Denied::Mode(_) => ErrorCode::AccessDenied,
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
        }
    }
}

/// The channel's local regions and who may address them. Written by `register` and
/// `deregister` only; a region is in the table before any peer can learn its id.
#[derive(Default)]
pub(crate) struct RegionTable {
    map: RwLock<HashMap<RegionId, (Region, Permission)>>,
}

impl RegionTable {
    pub(crate) fn insert(&self, r: Region, p: Permission) -> Result<()> {
        let mut m = self.map.write().expect("region table poisoned");
        if m.contains_key(&r.id()) {
            return Err(Error::Local(format!(
                "region {} already registered",
                r.id()
            )));
        }
        m.insert(r.id(), (r, p));
        Ok(())
    }

    pub(crate) fn remove(&self, id: &RegionId) -> Option<Region> {
        self.map
            .write()
            .expect("region table poisoned")
            .remove(id)
            .map(|(r, _)| r)
    }

    /// Looks a region up for a transfer by `peer` and marks it in use (`writes`: the
    /// transfer writes into it), atomically with respect to `remove`.
    pub(crate) fn use_for(
        &self,
        peer: &PeerId,
        id: &RegionId,
        writes: bool,
    ) -> std::result::Result<RegionUse, Denied> {
        let m = self.map.read().expect("region table poisoned");
        match m.get(id) {
            Some((_, p)) if p.allows(peer) && !p.access.allows(writes) => {
                Err(Denied::Mode(p.access))
            }
            Some((r, p)) if p.allows(peer) && writes => Ok(r.begin_write()),
            Some((r, p)) if p.allows(peer) => Ok(r.begin_use()),
            _ => Err(Denied::NotGranted),
        }
    }

    /// The regions granted to `peer` that it may reach directly: the shared ones, and with
    /// `cma` those that cross-memory attach carries too. Only read-write grants: the peer
    /// copies by itself there, so no mode could be enforced (see the module doc).
    pub(crate) fn direct_for(&self, peer: &PeerId, cma: bool) -> Vec<Region> {
        let m = self.map.read().expect("region table poisoned");
        m.values()
            .filter(|(r, p)| p.allows(peer) && (r.is_shared() || (cma && r.wants_cma())))
            .filter(|(r, p)| {
                let direct = p.access == Access::ReadWrite;
                if !direct {
                    tracing::debug!(%peer, region = %r.id(), access = ?p.access, "region not offered over shared memory or cross-memory attach: the peer would copy by itself and its access mode could not be enforced; it is served over TCP");
                }
                direct
            })
            .map(|(r, _)| r.clone())
            .collect()
    }

    /// What this side grants to `peer`.
    pub(crate) fn granted_to(&self, peer: &PeerId) -> MemInfo {
        let m = self.map.read().expect("region table poisoned");
        let mut regions: Vec<RegionInfo> = m
            .values()
            .filter(|(_, p)| p.allows(peer))
            .map(|(r, _)| r.info())
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
        let fd = crate::shm::memfd(4096).expect("memfd");
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
        assert!(t.use_for(&me, &ro.id(), false).is_ok());
        assert_eq!(
            t.use_for(&me, &ro.id(), true).err(),
            Some(Denied::Mode(Access::ReadOnly))
        );
        assert!(t.use_for(&me, &wo.id(), true).is_ok());
        assert_eq!(
            t.use_for(&me, &wo.id(), false).err(),
            Some(Denied::Mode(Access::WriteOnly))
        );
        assert!(t.use_for(&me, &rw.id(), true).is_ok());
        assert!(t.use_for(&me, &rw.id(), false).is_ok());
        // Only the read-write region is offered for direct copies.
        let direct: Vec<_> = t.direct_for(&me, true).iter().map(|r| r.id()).collect();
        assert_eq!(direct, vec![rw.id()]);
    }
}
