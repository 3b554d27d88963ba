//! Warnings about refused connections, rate-limited.
//!
//! Refusals before authentication (a failed proof, a connection past a limit, a TLS
//! mismatch) are what probing and brute force look like, so they are logged at WARN; but
//! whoever causes them controls their rate, so each kind logs at most one line per
//! [`INTERVAL`], saying how many it left out since the last one. The counts in
//! [`crate::Stats`] stay exact.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one warning of a kind per this interval.
pub(crate) const INTERVAL: Duration = Duration::from_secs(1);

/// One kind of warning: when it was last logged, and how many were left out since.
pub(crate) struct Throttle(Mutex<(Option<Instant>, u64)>);

impl Throttle {
    const fn new() -> Self {
        Throttle(Mutex::new((None, 0)))
    }

    /// `Some(left out since the last one)` when a warning may be logged now; `None` when it
    /// is to be left out (and is counted).
    pub(crate) fn allow(&self) -> Option<u64> {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        match g.0 {
            Some(last) if now.duration_since(last) < INTERVAL => {
                g.1 += 1;
                None
            }
            _ => {
                let left_out = g.1;
                *g = (Some(now), 0);
                Some(left_out)
            }
        }
    }
}

/// A `Hello` refused for lack of a handshake slot.
pub(crate) static HANDSHAKE_LIMIT: Throttle = Throttle::new();
/// A connection closed because too many had not sent their first frame.
pub(crate) static UNIDENTIFIED_LIMIT: Throttle = Throttle::new();
/// A control connection refused on TLS grounds.
pub(crate) static TLS_REFUSED: Throttle = Throttle::new();
/// A peer that failed authentication.
pub(crate) static AUTH_FAILED: Throttle = Throttle::new();
/// A unix-socket (shared memory) connection refused: wrong user, or past the limit.
pub(crate) static UNIX_REFUSED: Throttle = Throttle::new();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_logs_once_and_the_next_line_counts_what_it_left_out() {
        let t = Throttle::new();
        assert_eq!(t.allow(), Some(0));
        for _ in 0..5 {
            assert_eq!(t.allow(), None);
        }
        // Pretend the interval passed.
        t.0.lock().unwrap().0 = Some(Instant::now() - INTERVAL);
        assert_eq!(t.allow(), Some(5));
    }
}
