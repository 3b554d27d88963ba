//! How the owner of a worker waits while UCX says events are pending but its progress
//! handles none.
//!
//! `ucp_worker_arm` refuses to arm the event fd (`UCS_ERR_BUSY`) while a transport has
//! something unfinished: data not yet handled, or sends waiting for room at the peer. The
//! second kind may last: UCX 1.13's shared-memory transports keep a write to a killed peer
//! pending forever (the fd then stays readable), and a live same-host peer frees its FIFO
//! only when it is scheduled. Spinning on `progress` burns a core either way; sleeping a
//! fixed millisecond per round throttled same-host writes to one FIFO's worth a millisecond
//! (0.15 GiB/s). [`BusyBackoff`] spins a few rounds, then sleeps from a few microseconds,
//! doubling up to a millisecond, and starts over as soon as anything was handled. An armed
//! fd that wakes its owner with nothing to handle is waited out the same way
//! ([`armed_wait`]).

use std::time::Duration;

/// Rounds of "busy, nothing handled" taken at once, without sleeping.
pub const BUSY_SPINS: u32 = 64;
/// The first sleep after the spins.
pub const BUSY_FIRST_SLEEP: Duration = Duration::from_micros(10);
/// The longest sleep: what a wait for a peer that never frees room costs per round.
pub const BUSY_MAX_SLEEP: Duration = Duration::from_millis(1);

/// The state of one owner's busy rounds; see the module docs.
#[derive(Debug, Default, Clone)]
pub struct BusyBackoff {
    rounds: u32,
}

impl BusyBackoff {
    /// No busy rounds yet.
    pub const fn new() -> Self {
        Self { rounds: 0 }
    }

    /// Something was handled (progress reported events, an operation ended, a command came
    /// in) or the fd was armed: the next busy round starts the count again.
    pub fn reset(&mut self) {
        self.rounds = 0;
    }

    /// One more round in which UCX said busy and nothing was handled: how long to sleep
    /// before the next (zero: go on at once).
    pub fn idle(&mut self) -> Duration {
        self.rounds = self.rounds.saturating_add(1);
        if self.rounds <= BUSY_SPINS {
            return Duration::ZERO;
        }
        let doublings = (self.rounds - BUSY_SPINS - 1).min(16);
        BUSY_FIRST_SLEEP
            .saturating_mul(1 << doublings)
            .min(BUSY_MAX_SLEEP)
    }
}

/// How an owner waits after a round that handled nothing, once UCX armed the worker's fd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArmedWait {
    /// On the worker's fd (and the owner's own, if it has one), up to the round's timeout.
    Poll,
    /// This long without the worker's fd (on the owner's own fd alone, if it has one); then
    /// a look at the worker's fd.
    Nap(Duration),
}

/// The wait after an armed round; `woke_empty`: the last wait ended with the worker's fd
/// readable, and the round after it handled nothing. UCX 1.13's tcp transport can leave its
/// epoll set readable with nothing for progress to handle (seen while a connection's
/// wire-up waited for the peer), so a wait on the fd returns at once, round after round,
/// until the peer progresses. Spinning there takes a core from the peer that has to answer:
/// on 2 cores a listener spun 700 rounds in 2.3 ms while its initiator's key import (20-70
/// µs of CPU) waited 3-6 ms for one. Such rounds count as UCX's busy ones
/// ([`BusyBackoff`]): a few spins, then naps, longer while it lasts; a round that handled
/// something starts over.
pub fn armed_wait(woke_empty: bool, busy: &mut BusyBackoff, timeout: Duration) -> ArmedWait {
    if !woke_empty {
        busy.reset();
        return ArmedWait::Poll;
    }
    match busy.idle().min(timeout) {
        nap if nap.is_zero() => ArmedWait::Poll,
        nap => ArmedWait::Nap(nap),
    }
}

/// Waits until `fd` is readable, at most `timeout` (to the microsecond); whether it is. The
/// one sleep of a worker's owner: on the worker's event fd, or on a fd that also carries
/// its commands.
#[cfg(feature = "ucx")]
pub fn wait_readable(fd: std::os::fd::RawFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
    };
    // SAFETY: one valid pollfd and timespec for the duration of the call; no signal mask.
    let n = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    n > 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_then_sleeps_doubling_up_to_the_cap() {
        let mut b = BusyBackoff::new();
        for _ in 0..BUSY_SPINS {
            assert_eq!(b.idle(), Duration::ZERO);
        }
        let sleeps: Vec<Duration> = (0..10).map(|_| b.idle()).collect();
        assert_eq!(sleeps[0], BUSY_FIRST_SLEEP);
        assert!(sleeps.windows(2).all(|w| w[1] >= w[0]), "{sleeps:?}");
        assert_eq!(*sleeps.last().unwrap(), BUSY_MAX_SLEEP);
        // Far later, still the cap.
        for _ in 0..100_000 {
            assert!(b.idle() <= BUSY_MAX_SLEEP);
        }
        assert_eq!(b.idle(), BUSY_MAX_SLEEP);
    }

    #[test]
    fn anything_handled_starts_over_with_spins() {
        let mut b = BusyBackoff::new();
        for _ in 0..BUSY_SPINS + 20 {
            b.idle();
        }
        assert_eq!(b.idle(), BUSY_MAX_SLEEP);
        b.reset();
        assert_eq!(b.idle(), Duration::ZERO);
    }

    #[test]
    fn a_wait_that_never_ends_sleeps_most_of_the_time() {
        // The killed-peer case: a second of busy rounds with nothing handled. Count what
        // the sleeps add up to in the first 1000 rounds: all but the first few spins and
        // short sleeps is the cap.
        let mut b = BusyBackoff::new();
        let total: Duration = (0..1000).map(|_| b.idle()).sum();
        assert!(total >= BUSY_MAX_SLEEP * 900, "{total:?}");
    }

    #[test]
    fn empty_wake_ups_back_off_and_a_round_with_events_starts_over() {
        const T: Duration = Duration::from_millis(100);
        let mut busy = BusyBackoff::new();
        // A wake-up that had something to handle: the next wait is on the worker's fd.
        assert_eq!(armed_wait(false, &mut busy, T), ArmedWait::Poll);
        // Empty wake-ups (the fd readable, nothing handled): a few spins, then naps
        // doubling from 10 µs to 1 ms, never past the nearest deadline.
        let waits: Vec<ArmedWait> = (0..100).map(|_| armed_wait(true, &mut busy, T)).collect();
        let spins = waits.iter().take_while(|w| **w == ArmedWait::Poll).count();
        assert_eq!(spins, BUSY_SPINS as usize, "{waits:?}");
        assert_eq!(waits[spins], ArmedWait::Nap(Duration::from_micros(10)));
        assert_eq!(waits[99], ArmedWait::Nap(Duration::from_millis(1)));
        assert_eq!(
            armed_wait(true, &mut busy, Duration::from_micros(5)),
            ArmedWait::Nap(Duration::from_micros(5))
        );
        // Events again: the wait is on the fd, and the next empty ones spin first again.
        assert_eq!(armed_wait(false, &mut busy, T), ArmedWait::Poll);
        assert_eq!(armed_wait(true, &mut busy, T), ArmedWait::Poll);
    }
}
