//! A test-only one-sided backend: the "peer's" regions are regions of this process, and a
//! batch is a `memmove` per range. It exists to show what adding a transport takes: this
//! file, and its line where `transport/mod.rs` lists the backends. Nothing else of the
//! engine names it; the data path reaches it through [`OneSided`] alone.

use crate::dir::Dir;
use crate::error::Error;
use crate::region::Region;
use crate::transport::one_sided::{BatchRef, OneSided, Outcome, Posted};
use kvbridge_proto::handshake::Step;
use kvbridge_proto::msg::{ErrorCode, OpDesc};
use kvbridge_proto::route::Offer;
use kvbridge_proto::RegionId;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Regions of this process that play the peer's.
pub(crate) struct Loopback {
    remote: HashMap<RegionId, Region>,
    /// Batches it carried.
    pub(crate) batches: AtomicU64,
}

impl Loopback {
    /// A backend that reaches `remote` as the peer's regions.
    pub(crate) fn new(remote: impl IntoIterator<Item = Region>) -> Self {
        Self {
            remote: remote.into_iter().map(|r| (r.id(), r)).collect(),
            batches: AtomicU64::new(0),
        }
    }
}

impl OneSided for Loopback {
    fn name(&self) -> &'static str {
        "loopback"
    }

    fn offer(&self, _dir: Dir, descs: &[OpDesc]) -> Offer {
        Offer {
            covers: !descs.is_empty() && descs.iter().all(|d| self.remote.contains_key(&d.region)),
            copies_in_caller: false,
        }
    }

    fn reaches_any(&self) -> bool {
        !self.remote.is_empty()
    }

    fn post<'a>(&'a self, b: BatchRef<'a>) -> Posted<'a> {
        // Every range is checked before any byte moves: a batch that does not fit moves
        // nothing.
        let mut ranges = Vec::with_capacity(b.descs.len());
        for (d, l) in b.descs.iter().zip(b.locals) {
            let Some(r) = self.remote.get(&d.region) else {
                return Posted::Ended(Outcome::GivenBack);
            };
            let fits = d
                .offset
                .checked_add(d.len)
                .is_some_and(|end| end <= r.len() as u64);
            if !fits || d.len != l.len as u64 {
                let step = match b.dir {
                    Dir::Write => Step::Write,
                    Dir::Read => Step::Read,
                };
                return Posted::Ended(Outcome::Failed(Error::Rejected {
                    peer: b.peer.to_string(),
                    step,
                    code: ErrorCode::OutOfBounds,
                    message: format!("region {} (loopback)", d.region),
                }));
            }
            // SAFETY: `offset + len` lies within the region (checked above), which lives as
            // long as `self`.
            ranges.push((unsafe { r.as_ptr().add(d.offset as usize) }, l));
        }
        for (remote, l) in ranges {
            // SAFETY: both ranges are `l.len` bytes of live regions (the local one held in use
            // by `l`); `copy` allows them to overlap.
            unsafe {
                match b.dir {
                    Dir::Write => std::ptr::copy(l.ptr(), remote, l.len),
                    Dir::Read => std::ptr::copy(remote, l.ptr(), l.len),
                }
            }
        }
        self.batches.fetch_add(1, Ordering::Relaxed);
        Posted::Ended(Outcome::Done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::{AbortHandle, DataPath, PeerFeatures};
    use crate::region::LocalSlice;
    use kvbridge_proto::PeerId;
    use std::sync::Arc;
    use std::time::Duration;

    fn path() -> Arc<DataPath> {
        path_to(PeerFeatures {
            unacked_notify: true,
            grant_tokens: true,
        })
    }

    fn path_to(features: PeerFeatures) -> Arc<DataPath> {
        let (path, _rxs) = DataPath::new(
            PeerId::new("loopback-peer").unwrap(),
            AbortHandle::new(|_| {}),
            1 << 30,
            1,
            Vec::new(),
            Arc::new(AtomicU64::new(0)),
            features,
        );
        path
    }

    fn slice(r: &Region, offset: usize, len: usize) -> LocalSlice {
        LocalSlice {
            region: r.begin_use(),
            offset,
            len,
        }
    }

    fn desc(r: &Region, offset: u64, len: u64) -> OpDesc {
        OpDesc {
            region: r.id(),
            offset,
            len,
        }
    }

    /// Batches on regions the backend reaches go through it, writes and reads, with no
    /// data connection serving the path (a batch sent over TCP would wait until its
    /// deadline); a batch on a region it does not reach goes over TCP.
    #[tokio::test]
    async fn the_data_path_drives_a_backend_it_does_not_know_by_name() {
        let path = path();
        let local = Region::alloc(1 << 16, 4096).unwrap();
        let remote = Region::alloc(1 << 16, 4096).unwrap();
        let elsewhere = Region::alloc(4096, 4096).unwrap();
        let lo = Arc::new(Loopback::new([remote.clone()]));
        path.add_one_sided(lo.clone());
        assert!(path.carried_by("loopback"));

        local.write_at(0, &[7u8; 8192]).unwrap();
        let deadline = Duration::from_secs(5);
        path.transfer(
            Dir::Write,
            deadline,
            vec![desc(&remote, 4096, 8192)],
            vec![slice(&local, 0, 8192)],
            None,
        )
        .await
        .expect("written over the loopback backend");
        let mut got = vec![0u8; 8192];
        remote.read_at(4096, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 7), "the write did not land");

        remote.write_at(0, &[9u8; 4096]).unwrap();
        path.transfer(
            Dir::Read,
            deadline,
            vec![desc(&remote, 0, 4096)],
            vec![slice(&local, 16384, 4096)],
            None,
        )
        .await
        .expect("read over the loopback backend");
        let mut got = vec![0u8; 4096];
        local.read_at(16384, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 9), "the read did not land");
        assert_eq!(lo.batches.load(Ordering::Relaxed), 2);

        // A region it does not reach: TCP, where no writer serves this path.
        let r = path
            .transfer(
                Dir::Write,
                Duration::from_millis(200),
                vec![desc(&elsewhere, 0, 4096)],
                vec![slice(&local, 0, 4096)],
                None,
            )
            .await;
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert_eq!(lo.batches.load(Ordering::Relaxed), 2);
    }

    /// A batch that names a grant token never goes through a one-sided backend, even one
    /// that reaches its region: only the peer can check it (here it goes to TCP, where no
    /// writer serves this path); to a peer that does not honour tokens it fails typed
    /// before anything is sent.
    #[tokio::test]
    async fn a_batch_under_a_grant_token_skips_one_sided_backends() {
        let local = Region::alloc(8192, 4096).unwrap();
        let remote = Region::alloc(8192, 4096).unwrap();
        let token = Some(crate::grant::new_grant_token());
        let path = path();
        let lo = Arc::new(Loopback::new([remote.clone()]));
        path.add_one_sided(lo.clone());
        let r = path
            .transfer(
                Dir::Read,
                Duration::from_millis(200),
                vec![desc(&remote, 0, 4096)],
                vec![slice(&local, 0, 4096)],
                token,
            )
            .await;
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        assert_eq!(lo.batches.load(Ordering::Relaxed), 0, "went one-sided");
        let old = path_to(PeerFeatures {
            unacked_notify: true,
            grant_tokens: false,
        });
        let r = old
            .transfer(
                Dir::Write,
                Duration::from_secs(5),
                vec![desc(&remote, 0, 4096)],
                vec![slice(&local, 0, 4096)],
                token,
            )
            .await;
        match r {
            Err(Error::Incompatible { peer, theirs, .. }) => {
                assert_eq!(peer, "loopback-peer");
                assert!(theirs.contains("grant_tokens"), "{theirs}");
            }
            r => panic!("expected Incompatible, got {r:?}"),
        }
        assert_eq!(old.in_flight(), 0);
    }

    /// A range outside the peer's region moves nothing and fails naming the peer.
    #[tokio::test]
    async fn a_batch_that_does_not_fit_moves_nothing() {
        let path = path();
        let local = Region::alloc(8192, 4096).unwrap();
        let remote = Region::alloc(4096, 4096).unwrap();
        path.add_one_sided(Arc::new(Loopback::new([remote.clone()])));
        local.write_at(0, &[3u8; 8192]).unwrap();
        let r = path
            .transfer(
                Dir::Write,
                Duration::from_secs(5),
                vec![desc(&remote, 0, 2048), desc(&remote, 2048, 4096)],
                vec![slice(&local, 0, 2048), slice(&local, 2048, 4096)],
                None,
            )
            .await;
        match r {
            Err(Error::Rejected { peer, code, .. }) => {
                assert_eq!(peer, "loopback-peer");
                assert_eq!(code, ErrorCode::OutOfBounds);
            }
            r => panic!("expected OutOfBounds, got {r:?}"),
        }
        let mut got = vec![1u8; 4096];
        remote.read_at(0, &mut got).unwrap();
        assert!(
            got.iter().all(|&b| b == 0),
            "bytes of a refused batch landed"
        );
    }
}
