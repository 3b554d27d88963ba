//! Ports for workers that the soak restarts on the same addresses.
//!
//! A port the kernel picks for a bind to port 0 lies in its ephemeral range
//! (`/proc/sys/net/ipv4/ip_local_port_range`), the range it also draws from for every outgoing
//! connection on the host. Once a worker is killed, any new connection (the proxy's pool, a
//! prefiller dialing, the load generator) may be given one of its ports, and the worker's
//! restart then fails with `EADDRINUSE` for as long as that connection lives. Ports below the
//! range are only ever handed to explicit binds, so a worker that starts on one can start there
//! again. The pool probes each port with a bind before handing it out; another process on the
//! host may still take it in between, which the caller handles by starting over with new ports.

use std::net::TcpListener;

/// Lowest port handed out: well above the well-known and registered ports that local services
/// commonly listen on.
const FLOOR: u16 = 20_000;

/// The ephemeral range's lower end when `/proc` cannot be read (Linux's default).
const DEFAULT_EPHEMERAL_LOW: u16 = 32_768;

/// Ports on 127.0.0.1 below the kernel's ephemeral range, handed out in turn from a start that
/// depends on a seed (so two soaks on one host rarely probe the same ports).
#[derive(Debug)]
pub struct StablePorts {
    low: u16,
    high: u16,
    next: u16,
}

impl StablePorts {
    /// A pool below this host's ephemeral range, starting at a point chosen by `seed`.
    pub fn new(seed: u64) -> StablePorts {
        let high = ephemeral_low().unwrap_or(DEFAULT_EPHEMERAL_LOW);
        StablePorts::within(FLOOR.min(high.saturating_sub(1024)), high, seed)
    }

    /// A pool of `low..high`, starting at a point chosen by `seed`.
    pub fn within(low: u16, high: u16, seed: u64) -> StablePorts {
        let span = u64::from(high.saturating_sub(low)).max(1);
        StablePorts {
            low,
            high,
            next: low + (seed % span) as u16,
        }
    }

    /// The next port that a bind on 127.0.0.1 accepts now, or `None` after one full turn of the
    /// range found none.
    pub fn take(&mut self) -> Option<u16> {
        for _ in self.low..self.high {
            let p = self.next;
            self.next = if p + 1 >= self.high { self.low } else { p + 1 };
            if TcpListener::bind(("127.0.0.1", p)).is_ok() {
                return Some(p);
            }
        }
        None
    }

    /// `n` ports, or `None` when the range has fewer free ones.
    pub fn take_n(&mut self, n: usize) -> Option<Vec<u16>> {
        (0..n).map(|_| self.take()).collect()
    }
}

/// The lower end of the kernel's ephemeral port range.
fn ephemeral_low() -> Option<u16> {
    let s = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_lie_below_the_ephemeral_range() {
        let high = ephemeral_low().unwrap_or(DEFAULT_EPHEMERAL_LOW);
        let mut pool = StablePorts::new(0xfeed);
        for _ in 0..16 {
            let p = pool.take().expect("a free port");
            assert!(p < high, "{p} is in the ephemeral range (from {high})");
        }
    }

    #[test]
    fn a_port_in_use_is_skipped_and_the_pool_wraps() {
        let busy = TcpListener::bind("127.0.0.1:0").unwrap();
        let b = busy.local_addr().unwrap().port();
        // A range of two ports: the busy one and the next. Starting at the busy one, the pool
        // hands out the other.
        let mut pool = StablePorts::within(b, b.saturating_add(2), 0);
        let got = pool.take();
        assert_ne!(got, Some(b));
        // One port, busy: no port at all rather than a loop.
        let mut full = StablePorts::within(b, b + 1, 0);
        assert_eq!(full.take(), None);
    }
}
