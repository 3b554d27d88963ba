//! Bytes of a peer's batches held in flight on this side, bounded by
//! `Limits::max_bytes_in_flight_per_peer`.
//!
//! A batch's bytes are reserved before it is served (the reader admits it) and released
//! exactly once when its [`Reservation`] drops: after the write landed or the read response
//! was sent, or when either fails or the session tears down and drops the queued item that
//! carries it. Reservation is one compare-and-swap, so readers of several connections of
//! one session admitting at once never pass the limit together. The loom models at the end
//! of this file check that under every interleaving (`scripts/loom.sh`).

#[cfg(all(test, kvbridge_loom))]
use loom::sync::atomic::AtomicU64;
#[cfg(not(all(test, kvbridge_loom)))]
use std::sync::atomic::AtomicU64;

use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The count of bytes held, and its limit.
#[derive(Debug)]
pub(crate) struct InFlight {
    held: AtomicU64,
    max: u64,
}

/// Bytes counted in an [`InFlight`]; released when this drops.
#[derive(Debug)]
#[must_use = "dropping a reservation releases its bytes"]
pub(crate) struct Reservation {
    of: Arc<InFlight>,
    bytes: u64,
}

/// A reservation refused: it would have passed the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refused {
    /// Bytes held when it was refused.
    pub(crate) held: u64,
    /// The limit.
    pub(crate) max: u64,
}

impl InFlight {
    /// No bytes held, at most `max`.
    pub(crate) fn new(max: u64) -> Arc<Self> {
        Arc::new(Self {
            held: AtomicU64::new(0),
            max,
        })
    }

    /// Bytes held now (`Stats::peer_bytes_in_flight`).
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// Reserves `bytes` unless that would pass the limit.
    pub(crate) fn try_reserve(this: &Arc<Self>, bytes: u64) -> Result<Reservation, Refused> {
        let mut held = this.held.load(Ordering::Acquire);
        loop {
            let now = held
                .checked_add(bytes)
                .filter(|&n| n <= this.max)
                .ok_or(Refused {
                    held,
                    max: this.max,
                })?;
            match this
                .held
                .compare_exchange_weak(held, now, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    return Ok(Reservation {
                        of: this.clone(),
                        bytes,
                    })
                }
                Err(actual) => held = actual,
            }
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let before = self.of.held.fetch_sub(self.bytes, Ordering::AcqRel);
        debug_assert!(before >= self.bytes, "released more than was held");
    }
}

#[cfg(all(test, kvbridge_loom))]
mod loom_models {
    //! `RUSTFLAGS="--cfg kvbridge_loom" cargo test -p kvbridge --lib loom_` (`scripts/loom.sh`).
    use super::*;

    /// Three readers admit batches at once; one completes its batch at once, two hand
    /// theirs on (as a read response goes to the writer) and they complete later: the bytes
    /// held never pass the limit, at most what fits is admitted, and once every batch
    /// completed nothing is held.
    #[test]
    fn loom_in_flight_is_bounded_and_released_once() {
        loom::model(|| {
            let f = InFlight::new(10);
            let readers: Vec<_> = (0..3)
                .map(|i| {
                    let f = f.clone();
                    loom::thread::spawn(move || {
                        let r = InFlight::try_reserve(&f, 4);
                        let held = f.held();
                        assert!(held <= 10, "{held} bytes held, limit 10");
                        if let Err(Refused { max, .. }) = r {
                            assert_eq!(max, 10);
                        }
                        if i == 0 {
                            // Completes here.
                            drop(r);
                            return None;
                        }
                        r.ok()
                    })
                })
                .collect();
            let handed: Vec<_> = readers.into_iter().map(|t| t.join().unwrap()).collect();
            assert!(f.held() <= 8, "{} held", f.held());
            drop(handed);
            assert_eq!(f.held(), 0, "bytes leaked or released twice");
        });
    }

    /// Two readers racing for the last room: at most one gets it.
    #[test]
    fn loom_in_flight_never_admits_past_the_limit() {
        loom::model(|| {
            let f = InFlight::new(8);
            let first = InFlight::try_reserve(&f, 4).unwrap();
            let ts: Vec<_> = (0..2)
                .map(|_| {
                    let f = f.clone();
                    loom::thread::spawn(move || InFlight::try_reserve(&f, 4).ok())
                })
                .collect();
            let got: Vec<_> = ts.into_iter().map(|t| t.join().unwrap()).collect();
            let admitted = got.iter().filter(|r| r.is_some()).count();
            assert_eq!(admitted, 1, "two batches shared the last 4 bytes of room");
            assert_eq!(f.held(), 8);
            drop(got);
            drop(first);
            assert_eq!(f.held(), 0);
        });
    }
}
