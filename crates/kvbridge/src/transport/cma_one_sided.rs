//! Cross-memory attach behind the one-sided seam ([`OneSided`]): a peer's region is a range
//! of the peer's address space, and a batch is `process_vm_writev`/`readv` on the calling
//! thread (`transport/cma.rs`).
//!
//! The batches go through the engine's own table of a peer's reachable regions
//! (`ShmPeer`, shared with [`super::shm_one_sided`]). The session decides whether
//! cross-memory attach may be used with a peer by the canary probe (`session/direct.rs`,
//! `CmaAsk`/`CmaProbe`/`CmaProbed`); [`OneSided::connect`] here takes the pid as given, and
//! a process the kernel does not let us reach fails the first batch instead.

use crate::dir::Dir;
use crate::region::Region;
use crate::transport::cma::CmaStatus;
use crate::transport::one_sided::{OneSided, OneSidedError, OneSidedStep, RangeOp};
use crate::transport::shm::{DirectCounters, ShmPeer};
use crate::transport::shm_one_sided::{Landed, SameHost};
use kvbridge_proto::RegionId;
use std::sync::Arc;
use std::time::Instant;

/// Cross-memory attach as a one-sided backend.
#[derive(Default)]
pub(crate) struct CmaBackend {
    host: SameHost,
}

impl CmaBackend {
    /// A backend whose copies are counted in `counters`.
    pub(crate) fn new(counters: Arc<DirectCounters>) -> Self {
        Self {
            host: SameHost {
                counters,
                ..SameHost::default()
            },
        }
    }
}

/// The descriptor bytes of a region: its base address and length in the exporter's
/// address space (what `ShmMap` with an address carries).
fn encode(base: u64, len: u64) -> Vec<u8> {
    let mut b = base.to_le_bytes().to_vec();
    b.extend_from_slice(&len.to_le_bytes());
    b
}

impl OneSided for CmaBackend {
    type Posted = Landed;

    /// Any region can be exported: the peer reaches it by address.
    fn export(&mut self, region: &Region) -> Result<Vec<u8>, OneSidedError> {
        self.host.local.insert(region.id(), region.clone());
        Ok(encode(region.as_ptr() as u64, region.len() as u64))
    }

    /// This process's pid.
    fn address(&self) -> Vec<u8> {
        std::process::id().to_le_bytes().to_vec()
    }

    /// Copies into and out of process `address` from now on (module docs: the probe).
    fn connect(&mut self, peer: &str, address: &[u8]) -> Result<(), OneSidedError> {
        let pid: [u8; 4] = address.try_into().map_err(|_| OneSidedError::Malformed {
            peer: peer.to_string(),
            step: OneSidedStep::Connect,
            detail: format!("{} address bytes, not a 4-byte pid", address.len()),
        })?;
        let table = ShmPeer::new(
            self.host.counters.clone(),
            CmaStatus::Off("not probed".into()),
        );
        table.enable_cma(u32::from_le_bytes(pid));
        self.host.connect(peer, table)
    }

    /// Records the region's range; an empty or wrapping range is `Malformed`.
    fn import(&mut self, peer: &str, id: RegionId, descriptor: &[u8]) -> Result<(), OneSidedError> {
        let step = OneSidedStep::Import;
        let table = self.host.peer(peer, step)?;
        let malformed = |detail: String| OneSidedError::Malformed {
            peer: peer.to_string(),
            step,
            detail,
        };
        let bytes: [u8; 16] = descriptor
            .try_into()
            .map_err(|_| malformed(format!("{} descriptor bytes, not 16", descriptor.len())))?;
        let base = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes"));
        if table.insert_cma(id, base, len) {
            Ok(())
        } else {
            Err(malformed(format!(
                "region {id}: {len} bytes at {base:#x} is empty or wraps"
            )))
        }
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

    /// Forgets the region; no copy runs by then (copies run inside `post`), so the deadline
    /// is never reached.
    fn release(
        &mut self,
        peer: &str,
        id: RegionId,
        _deadline: Instant,
    ) -> Result<(), OneSidedError> {
        self.host.release(peer, id)
    }

    /// Stops exporting the region. Unlike shared memory, memory reached by address cannot
    /// be taken back from a peer that imported it: it stays reachable until that peer
    /// released it (the engine waits for its `ShmUnmapped`, and marks the region tainted
    /// when none comes; `transport/cma.rs`, *Safety of unmapping*).
    fn revoke(&mut self, id: RegionId) -> Result<(), OneSidedError> {
        self.host.unexport(id).map(drop)
    }

    /// Forgets every region of `peer`; nothing is in flight (copies run inside `post`).
    fn disconnect(&mut self, peer: &str, _deadline: Instant) -> Result<(), OneSidedError> {
        self.host.disconnect(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::cma::cma_available;
    use std::sync::atomic::Ordering;

    const PEER: &str = "listener";

    fn far() -> Instant {
        Instant::now() + std::time::Duration::from_secs(5)
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

    /// A listener's backend that exported `target`, and an initiator's that imported it
    /// and exported `local`; both in this process, reached through its own pid.
    fn pair(target: &Region, local: &Region) -> (CmaBackend, CmaBackend) {
        let mut listener = CmaBackend::default();
        let desc = listener.export(target).unwrap();
        let mut init = CmaBackend::default();
        init.export(local).unwrap();
        init.connect(PEER, &listener.address()).unwrap();
        init.import(PEER, target.id(), &desc).unwrap();
        (listener, init)
    }

    /// Writes land byte-exact where the ranges say (more ranges than one system call
    /// takes), reads bring them back, and every batch is counted as cross-memory attach.
    #[test]
    fn writes_and_reads_are_byte_exact() {
        if cma_available().is_err() {
            return;
        }
        let target = Region::alloc(1 << 16, 4096).unwrap();
        let local = Region::alloc(1 << 16, 4096).unwrap();
        let (_l, mut init) = pair(&target, &local);
        let data: Vec<u8> = (0..1 << 16).map(|i| (i * 7 + 3) as u8).collect();
        local.write_at(0, &data).unwrap();
        // Ranges of 8 bytes, each 16 bytes apart at the target: 2048 of them, two calls.
        let ops: Vec<RangeOp> = (0..2048u64)
            .map(|i| op(&local, 8 * i, &target, 16 * i + 4, 8))
            .collect();
        let mut p = init.post(PEER, Dir::Write, &ops).unwrap();
        assert!(init.test(&mut p).unwrap());
        let mut got = vec![0u8; 1 << 16];
        target.read_at(0, &mut got).unwrap();
        for i in 0..2048usize {
            let at = 16 * i + 4;
            assert_eq!(&got[at..at + 8], &data[8 * i..8 * i + 8], "range {i}");
            assert!(got[16 * i..at].iter().all(|&b| b == 0), "before range {i}");
            assert!(
                got[at + 8..16 * i + 16].iter().all(|&b| b == 0),
                "after {i}"
            );
        }
        let back = Region::alloc(4096, 4096).unwrap();
        init.export(&back).unwrap();
        let p = init
            .post(PEER, Dir::Read, &[op(&back, 0, &target, 4, 8)])
            .unwrap();
        init.wait(p, far()).unwrap();
        let mut b = [0u8; 8];
        back.read_at(0, &mut b).unwrap();
        assert_eq!(b[..], data[..8]);
        assert_eq!(init.host.counters.cma.load(Ordering::Relaxed), 2);
    }

    /// A range past either region's end is refused before any byte moves, even when the
    /// ranges before it fit.
    #[test]
    fn ranges_out_of_bounds_are_refused_and_nothing_lands() {
        if cma_available().is_err() {
            return;
        }
        let target = Region::alloc(8192, 4096).unwrap();
        let local = Region::alloc(8192, 4096).unwrap();
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
    }

    /// After the importer released a region, or left the peer, its batches are refused and
    /// nothing lands.
    #[test]
    fn released_regions_and_left_peers_are_refused() {
        if cma_available().is_err() {
            return;
        }
        let target = Region::alloc(8192, 4096).unwrap();
        let local = Region::alloc(8192, 4096).unwrap();
        let (mut listener, mut init) = pair(&target, &local);
        local.write_at(0, &[5u8; 8192]).unwrap();
        let w = op(&local, 0, &target, 0, 8192);
        init.release(PEER, target.id(), far()).unwrap();
        assert!(matches!(
            init.post(PEER, Dir::Write, &[w]),
            Err(OneSidedError::UnknownRegion { side: "remote", .. })
        ));
        let mut got = vec![1u8; 8192];
        target.read_at(0, &mut got).unwrap();
        assert!(
            got.iter().all(|&b| b == 0),
            "a write reached a released region"
        );

        init.import(PEER, target.id(), &listener.export(&target).unwrap())
            .unwrap();
        init.disconnect(PEER, far()).unwrap();
        assert!(matches!(
            init.post(PEER, Dir::Write, &[w]),
            Err(OneSidedError::NotConnected { .. })
        ));
        listener.revoke(target.id()).unwrap();
        assert!(matches!(
            listener.revoke(target.id()),
            Err(OneSidedError::UnknownRegion { side: "local", .. })
        ));
    }

    /// Bytes a peer sends are checked before they are used.
    #[test]
    fn malformed_addresses_and_descriptors_are_refused() {
        let mut init = CmaBackend::default();
        assert!(matches!(
            init.connect(PEER, &[1, 2, 3]),
            Err(OneSidedError::Malformed { .. })
        ));
        init.connect(PEER, &std::process::id().to_le_bytes())
            .unwrap();
        let id = RegionId([4; 16]);
        for bad in [vec![0u8; 15], encode(4096, 0), encode(u64::MAX - 8, 16)] {
            assert!(matches!(
                init.import(PEER, id, &bad),
                Err(OneSidedError::Malformed { .. })
            ));
        }
    }
}
