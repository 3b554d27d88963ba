//! Shared memory behind the one-sided seam ([`OneSided`]): a peer's region is its memfd,
//! mapped into this process, and a batch is one `memcpy` per range on the calling thread.
//!
//! The batches go through the engine's own table of a peer's reachable regions
//! ([`ShmPeer`]: its bounds, its revocation lock, its copy), so what this backend's tests
//! prove holds for the sessions' direct copies too. What the trait's bytes cannot carry is
//! said where it matters: a mapping needs the memfd itself, which travels beside the
//! descriptor bytes (`SCM_RIGHTS` on the session's unix socket): the importer hands it over
//! first ([`ShmBackend::receive_fd`]).
//!
//! The negotiation (offer, `ShmMap`/`ShmUnmap`, the announced lengths and the per-peer cap
//! of mapped bytes) stays with the session (`session/direct.rs`); this is the data plane.

use crate::dir::Dir;
use crate::region::{LocalSlice, Region};
use crate::transport::one_sided::{OneSided, OneSidedError, OneSidedStep, RangeOp};
use crate::transport::shm::{host_id, DirectCounters, Mapping, ShmFail, ShmPeer};
use kvbridge_proto::msg::OpDesc;
use kvbridge_proto::RegionId;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

/// A batch of a same-host backend. The copies run on the caller's thread inside
/// [`OneSided::post`], so a posted batch is already complete: its bytes are in place at
/// the peer when `post` returns.
#[derive(Debug)]
pub(crate) struct Landed;

/// What both same-host backends share: the local regions exported, and per peer the table
/// of its regions this side reaches, through which every batch is checked and copied.
#[derive(Default)]
pub(super) struct SameHost {
    /// Regions this side exported.
    pub(super) local: HashMap<RegionId, Region>,
    /// Per peer, its regions this side reaches.
    pub(super) peers: HashMap<String, Arc<ShmPeer>>,
    /// Counts of the batches copied (shared with the channel's `Stats` in the engine).
    pub(super) counters: Arc<DirectCounters>,
}

impl SameHost {
    /// The table of `peer`, or why not.
    pub(super) fn peer(
        &self,
        peer: &str,
        step: OneSidedStep,
    ) -> Result<&Arc<ShmPeer>, OneSidedError> {
        self.peers
            .get(peer)
            .ok_or_else(|| OneSidedError::NotConnected {
                peer: peer.to_string(),
                step,
            })
    }

    /// Adds `peer` with the table `table`; a peer connected twice is refused.
    pub(super) fn connect(&mut self, peer: &str, table: ShmPeer) -> Result<(), OneSidedError> {
        if self.peers.contains_key(peer) {
            return Err(OneSidedError::Failed {
                peer: peer.to_string(),
                step: OneSidedStep::Connect,
                detail: "already connected".into(),
            });
        }
        self.peers.insert(peer.to_string(), Arc::new(table));
        Ok(())
    }

    /// Checks every range against both regions, then copies them in order.
    pub(super) fn post(
        &self,
        peer: &str,
        dir: Dir,
        ops: &[RangeOp],
    ) -> Result<Landed, OneSidedError> {
        let step = OneSidedStep::Post;
        let table = self.peer(peer, step)?;
        if ops.is_empty() {
            return Ok(Landed);
        }
        let unknown = |side, region| OneSidedError::UnknownRegion {
            peer: peer.to_string(),
            step,
            side,
            region,
        };
        let out = |side, region, offset, len, size| OneSidedError::OutOfBounds {
            peer: peer.to_string(),
            step,
            side,
            region,
            offset,
            len,
            size,
        };
        let mut descs = Vec::with_capacity(ops.len());
        let mut locals = Vec::with_capacity(ops.len());
        for op in ops {
            let local = self
                .local
                .get(&op.local)
                .ok_or_else(|| unknown("local", op.local))?;
            if !local.contains(op.local_offset, op.len) {
                return Err(out(
                    "local",
                    op.local,
                    op.local_offset,
                    op.len,
                    local.len() as u64,
                ));
            }
            descs.push(OpDesc {
                region: op.remote,
                offset: op.remote_offset,
                len: op.len,
            });
            locals.push(LocalSlice {
                region: local.begin_use(),
                // Within the region (checked above), so within usize.
                offset: op.local_offset as usize,
                len: op.len as usize,
            });
        }
        let Some(remotes) = table.resolve(&descs) else {
            let missing = descs
                .iter()
                .find(|d| table.resolve(std::slice::from_ref(d)).is_none())
                .map_or(descs[0].region, |d| d.region);
            return Err(unknown("remote", missing));
        };
        // Every range before any byte moves: nothing is copied when one does not fit.
        for (d, r) in descs.iter().zip(&remotes) {
            if !d.in_bounds(r.len() as u64) {
                return Err(out("remote", d.region, d.offset, d.len, r.len() as u64));
            }
        }
        table
            .copy_batch(dir, &descs, &remotes, &locals)
            .map_err(|f| match f {
                // Revoked between the resolve above and the copy (the engine's tables are
                // shared with the session's negotiation).
                ShmFail::Revoked(r) => unknown("remote", r),
                ShmFail::OutOfBounds(r) => OneSidedError::Failed {
                    peer: peer.to_string(),
                    step,
                    detail: format!("region {r}: a range does not fit its local slice"),
                },
                ShmFail::Cma(r, e) => OneSidedError::Failed {
                    peer: peer.to_string(),
                    step,
                    detail: format!("region {r}: cross-memory attach: {e}"),
                },
            })?;
        Ok(Landed)
    }

    /// Ends the use of `peer`'s region `id`: waits for a copy into it still running (there
    /// is none when the backend's owner calls, as copies run inside `post`).
    pub(super) fn release(&self, peer: &str, id: RegionId) -> Result<(), OneSidedError> {
        let step = OneSidedStep::Release;
        if self.peer(peer, step)?.revoke(&id) {
            Ok(())
        } else {
            Err(OneSidedError::UnknownRegion {
                peer: peer.to_string(),
                step,
                side: "remote",
                region: id,
            })
        }
    }

    /// Stops exporting local region `id`, and hands it back.
    pub(super) fn unexport(&mut self, id: RegionId) -> Result<Region, OneSidedError> {
        self.local
            .remove(&id)
            .ok_or_else(|| OneSidedError::UnknownRegion {
                peer: "local".into(),
                step: OneSidedStep::Revoke,
                side: "local",
                region: id,
            })
    }

    /// Leaves `peer`: every region of it revoked (waits for copies still running).
    pub(super) fn disconnect(&mut self, peer: &str) -> Result<(), OneSidedError> {
        let table = self
            .peers
            .remove(peer)
            .ok_or_else(|| OneSidedError::NotConnected {
                peer: peer.to_string(),
                step: OneSidedStep::Disconnect,
            })?;
        table.revoke_all();
        Ok(())
    }
}

/// The descriptor bytes of a region: its length (the memfd travels beside them).
fn encode_len(len: u64) -> Vec<u8> {
    len.to_le_bytes().to_vec()
}

/// Shared memory as a one-sided backend.
#[derive(Default)]
pub(crate) struct ShmBackend {
    host: SameHost,
    /// Memfds received from peers, waiting for their descriptor bytes.
    fds: HashMap<(String, RegionId), OwnedFd>,
}

impl ShmBackend {
    /// A backend whose copies are counted in `counters`.
    pub(crate) fn new(counters: Arc<DirectCounters>) -> Self {
        Self {
            host: SameHost {
                counters,
                ..SameHost::default()
            },
            fds: HashMap::new(),
        }
    }

    /// (Exporter) The memfd of exported region `id`, to pass beside its descriptor bytes.
    pub(crate) fn memfd(&self, id: RegionId) -> Option<OwnedFd> {
        self.host.local.get(&id).and_then(Region::memfd)
    }

    /// (Importer) The memfd `peer` passed for its region `id`, kept until
    /// [`OneSided::import`] maps it (a later one for the same region replaces it).
    pub(crate) fn receive_fd(&mut self, peer: &str, id: RegionId, fd: OwnedFd) {
        self.fds.insert((peer.to_string(), id), fd);
    }
}

impl OneSided for ShmBackend {
    type Posted = Landed;

    /// Only a memfd-backed region can be exported (others are reached by cross-memory
    /// attach or TCP). The bytes are its length; its memfd goes beside them
    /// ([`ShmBackend::memfd`]).
    fn export(&mut self, region: &Region) -> Result<Vec<u8>, OneSidedError> {
        if !region.is_shared() {
            return Err(OneSidedError::Failed {
                peer: "local".into(),
                step: OneSidedStep::Export,
                detail: format!(
                    "region {} is not memfd-backed (or was withdrawn from shared memory)",
                    region.id()
                ),
            });
        }
        self.host.local.insert(region.id(), region.clone());
        Ok(encode_len(region.len() as u64))
    }

    /// This host's identity: shared memory reaches only peers on the same host.
    fn address(&self) -> Vec<u8> {
        host_id().unwrap_or_default().into_bytes()
    }

    /// Accepts a peer on this host only (equal [`host_id`]).
    fn connect(&mut self, peer: &str, address: &[u8]) -> Result<(), OneSidedError> {
        let ours = host_id();
        if ours.is_none() || Some(address) != ours.as_deref().map(str::as_bytes) {
            return Err(OneSidedError::Failed {
                peer: peer.to_string(),
                step: OneSidedStep::Connect,
                detail: format!(
                    "not on this host (theirs {:?}, ours {:?})",
                    String::from_utf8_lossy(address),
                    ours
                ),
            });
        }
        let table = ShmPeer::new(
            self.host.counters.clone(),
            crate::transport::cma::CmaStatus::Off("shared memory only".into()),
        );
        self.host.connect(peer, table)
    }

    /// Maps the memfd [`ShmBackend::receive_fd`] took for this region, after the checks of
    /// [`Mapping::map`] (shared memory, long enough, sealed, allocated). No memfd is
    /// `Malformed`, as a `ShmMap` without a descriptor is in the engine.
    fn import(&mut self, peer: &str, id: RegionId, descriptor: &[u8]) -> Result<(), OneSidedError> {
        let step = OneSidedStep::Import;
        let malformed = |detail: String| OneSidedError::Malformed {
            peer: peer.to_string(),
            step,
            detail,
        };
        let table = self.host.peer(peer, step)?.clone();
        let len: [u8; 8] = descriptor
            .try_into()
            .map_err(|_| malformed(format!("{} descriptor bytes, not 8", descriptor.len())))?;
        let len = u64::from_le_bytes(len);
        let fd = self
            .fds
            .remove(&(peer.to_string(), id))
            .ok_or_else(|| malformed(format!("region {id}: no memfd came with it")))?;
        let m = Mapping::map(&fd, len).map_err(|e| OneSidedError::Failed {
            peer: peer.to_string(),
            step,
            detail: format!("region {id}: {e}"),
        })?;
        table.insert(id, m);
        Ok(())
    }

    fn post(&mut self, peer: &str, dir: Dir, ops: &[RangeOp]) -> Result<Landed, OneSidedError> {
        self.host.post(peer, dir, ops)
    }

    /// Always complete ([`Landed`]).
    fn test(&mut self, _posted: &mut Landed) -> Result<bool, OneSidedError> {
        Ok(true)
    }

    /// Returns at once ([`Landed`]).
    fn wait(&mut self, _posted: Landed, _deadline: Instant) -> Result<(), OneSidedError> {
        Ok(())
    }

    /// Unmaps the region; no copy runs by then (copies run inside `post`), so the deadline
    /// is never reached.
    fn release(
        &mut self,
        peer: &str,
        id: RegionId,
        _deadline: Instant,
    ) -> Result<(), OneSidedError> {
        self.host.release(peer, id)
    }

    /// Detaches the region ([`Region::detach`]): its bytes move to fresh memory at the
    /// same address, so the peers' mappings of its memfd no longer reach it, whether they
    /// released it or not. The owner must not write into the region meanwhile (the engine
    /// first asks its peers to unmap and holds its writers back: `session::detach_region`).
    fn revoke(&mut self, id: RegionId) -> Result<(), OneSidedError> {
        let region = self.host.unexport(id)?;
        region.detach().map_err(|e| OneSidedError::Failed {
            peer: "local".into(),
            step: OneSidedStep::Revoke,
            detail: format!("region {id}: {e}"),
        })
    }

    /// Unmaps every region of `peer`; nothing is in flight (copies run inside `post`).
    fn disconnect(&mut self, peer: &str, _deadline: Instant) -> Result<(), OneSidedError> {
        self.fds.retain(|(p, _), _| p != peer);
        self.host.disconnect(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEER: &str = "listener";

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(5)
    }

    /// A listener's backend that exported `target`, and an initiator's that imported it
    /// and exported `local` (the two sides in one process, as two processes would be).
    fn pair(target: &Region, local: &Region) -> (ShmBackend, ShmBackend) {
        let mut listener = ShmBackend::default();
        let desc = listener.export(target).unwrap();
        let mut init = ShmBackend::default();
        init.export(local).unwrap();
        init.connect(PEER, &listener.address()).unwrap();
        init.receive_fd(PEER, target.id(), listener.memfd(target.id()).unwrap());
        init.import(PEER, target.id(), &desc).unwrap();
        (listener, init)
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

    fn shared(len: usize) -> Option<Region> {
        let r = Region::alloc(len, 4096).unwrap();
        // Where memfds are unavailable regions are private: nothing to test here.
        r.is_shared().then_some(r)
    }

    /// Writes land byte-exact where the ranges say, reads bring them back, and bytes
    /// outside the ranges stay as they were.
    #[test]
    fn writes_and_reads_are_byte_exact() {
        let (Some(target), Some(local)) = (shared(1 << 16), shared(1 << 16)) else {
            return;
        };
        let (_l, mut init) = pair(&target, &local);
        let data = pattern(3, 1 << 16);
        local.write_at(0, &data).unwrap();
        let ops = [
            op(&local, 0, &target, 4096, 1000),
            op(&local, 5000, &target, 0, 3000),
            op(&local, 10_000, &target, 60_000, 5536),
        ];
        let mut p = init.post(PEER, Dir::Write, &ops).unwrap();
        assert!(init.test(&mut p).unwrap());
        let mut got = vec![0u8; 1 << 16];
        target.read_at(0, &mut got).unwrap();
        let mut want = vec![0u8; 1 << 16];
        want[4096..5096].copy_from_slice(&data[..1000]);
        want[..3000].copy_from_slice(&data[5000..8000]);
        want[60_000..].copy_from_slice(&data[10_000..15_536]);
        assert_eq!(got, want);

        let back = shared(1 << 16).unwrap();
        init.export(&back).unwrap();
        let p = init
            .post(PEER, Dir::Read, &[op(&back, 0, &target, 4096, 1000)])
            .unwrap();
        init.wait(p, far()).unwrap();
        let mut b = vec![0u8; 1000];
        back.read_at(0, &mut b).unwrap();
        assert_eq!(b, data[..1000]);
    }

    /// A range past either region's end is refused before any byte moves, even when the
    /// ranges before it fit; so is a region that was never exported or imported.
    #[test]
    fn ranges_out_of_bounds_are_refused_and_nothing_lands() {
        let (Some(target), Some(local)) = (shared(8192), shared(8192)) else {
            return;
        };
        let (_l, mut init) = pair(&target, &local);
        local.write_at(0, &[9u8; 8192]).unwrap();
        let fits = op(&local, 0, &target, 0, 4096);
        for (bad, side) in [
            (op(&local, 0, &target, 4097, 4096), "remote"),
            (op(&local, 4097, &target, 0, 4096), "local"),
            (op(&local, 0, &target, u64::MAX, 2), "remote"),
        ] {
            match init.post(PEER, Dir::Write, &[fits, bad]) {
                Err(OneSidedError::OutOfBounds { side: s, .. }) => assert_eq!(s, side),
                other => panic!("{other:?}"),
            }
        }
        let mut got = vec![1u8; 8192];
        target.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0), "a byte landed");

        let stranger = shared(4096).unwrap();
        assert!(matches!(
            init.post(PEER, Dir::Write, &[op(&local, 0, &stranger, 0, 1)]),
            Err(OneSidedError::UnknownRegion { side: "remote", .. })
        ));
        assert!(matches!(
            init.post(PEER, Dir::Write, &[op(&stranger, 0, &target, 0, 1)]),
            Err(OneSidedError::UnknownRegion { side: "local", .. })
        ));
        assert!(matches!(
            init.post("nobody", Dir::Write, &[fits]),
            Err(OneSidedError::NotConnected { .. })
        ));
    }

    /// After the importer released a region, or left the peer, its batches are refused;
    /// after the exporter revoked (detached) it, a write through a mapping held from before
    /// no longer reaches the region's memory.
    #[test]
    fn released_and_revoked_regions_are_out_of_reach() {
        let (Some(target), Some(local)) = (shared(8192), shared(8192)) else {
            return;
        };
        let (mut listener, mut init) = pair(&target, &local);
        local.write_at(0, &[5u8; 8192]).unwrap();
        let w = op(&local, 0, &target, 0, 8192);
        init.release(PEER, target.id(), far()).unwrap();
        assert!(matches!(
            init.post(PEER, Dir::Write, &[w]),
            Err(OneSidedError::UnknownRegion { side: "remote", .. })
        ));
        assert!(matches!(
            init.release(PEER, target.id(), far()),
            Err(OneSidedError::UnknownRegion { .. })
        ));

        // Mapped again, then revoked by its owner while the importer still maps it.
        let (_, mut again) = pair(&target, &local);
        listener.revoke(target.id()).unwrap();
        assert!(target.is_detached());
        again.post(PEER, Dir::Write, &[w]).unwrap();
        let mut got = vec![1u8; 8192];
        target.read_at(0, &mut got).unwrap();
        assert!(
            got.iter().all(|&b| b == 0),
            "a write reached a revoked region"
        );
        assert!(matches!(
            listener.revoke(target.id()),
            Err(OneSidedError::UnknownRegion { side: "local", .. })
        ));

        again.disconnect(PEER, far()).unwrap();
        assert!(matches!(
            again.post(PEER, Dir::Write, &[w]),
            Err(OneSidedError::NotConnected { .. })
        ));
    }

    /// Bytes a peer sends are checked: a descriptor of the wrong size, a region without its
    /// memfd, a peer on another host.
    #[test]
    fn malformed_imports_and_other_hosts_are_refused() {
        let Some(target) = shared(4096) else {
            return;
        };
        let mut listener = ShmBackend::default();
        let desc = listener.export(&target).unwrap();
        let mut init = ShmBackend::default();
        assert!(matches!(
            init.connect(PEER, b"another-host/net/pid"),
            Err(OneSidedError::Failed {
                step: OneSidedStep::Connect,
                ..
            })
        ));
        init.connect(PEER, &listener.address()).unwrap();
        assert!(matches!(
            init.import(PEER, target.id(), &desc),
            Err(OneSidedError::Malformed { .. })
        ));
        init.receive_fd(PEER, target.id(), listener.memfd(target.id()).unwrap());
        assert!(matches!(
            init.import(PEER, target.id(), &desc[..7]),
            Err(OneSidedError::Malformed { .. })
        ));
        // Longer than the memfd: refused by the mapping's checks.
        init.receive_fd(PEER, target.id(), listener.memfd(target.id()).unwrap());
        assert!(matches!(
            init.import(PEER, target.id(), &encode_len(1 << 30)),
            Err(OneSidedError::Failed { .. })
        ));
    }
}
