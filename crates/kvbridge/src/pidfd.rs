//! A descriptor of another process (`pidfd_open`) that turns readable when the process
//! exits: how a same-host peer's death is proven, not guessed from a closed connection.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A process this one watches.
#[derive(Debug)]
pub(crate) struct Pidfd(OwnedFd);

impl Pidfd {
    /// A descriptor of process `pid`; `None` where there is no such process or
    /// `pidfd_open` is unavailable (before Linux 5.3). The pid names the process only
    /// while it lives: the caller opens it while the process is known to be alive.
    pub(crate) fn open(pid: u32) -> Option<Pidfd> {
        let pid = libc::pid_t::try_from(pid).ok().filter(|p| *p > 0)?;
        // SAFETY: pidfd_open takes a pid and flags; it returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0)?;
        // SAFETY: a fresh descriptor that nothing else owns.
        Some(Pidfd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Whether the process has exited, now.
    pub(crate) fn exited(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & libc::POLLIN != 0
    }

    /// Whether the process exits within `bound` (waits on the descriptor, no polling
    /// loop). A killed process closes its sockets before its pidfd turns readable, so a
    /// peer seen leaving may still need a moment to be seen dead. Only UCX sessions wait on
    /// a peer's exit (cross-memory attach polls [`Pidfd::exited`]).
    #[cfg(any(feature = "ucx", test))]
    pub(crate) async fn exits_within(&self, bound: std::time::Duration) -> bool {
        use tokio::io::unix::AsyncFd;

        if self.exited() {
            return true;
        }
        // SAFETY: the descriptor is `self`'s, open for all of `self`'s life, which outlasts
        // this local registration (dropped before the function returns).
        let registered = unsafe {
            AsyncFd::register_with_interest(self.0.as_raw_fd(), tokio::io::Interest::READABLE)
        };
        let Ok(fd) = registered else {
            return false;
        };
        matches!(tokio::time::timeout(bound, fd.readable()).await, Ok(Ok(_))) && self.exited()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_child_is_seen_alive_then_exited() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let fd = Pidfd::open(child.id()).expect("pidfd_open");
        assert!(!fd.exited());
        assert!(!fd.exits_within(Duration::from_millis(20)).await);
        child.kill().unwrap();
        assert!(fd.exits_within(Duration::from_secs(10)).await);
        child.wait().unwrap();
        assert!(Pidfd::open(0).is_none());
    }
}
