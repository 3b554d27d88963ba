//! The one thread that owns a channel's [`UcxBackend`]: tasks hand it commands and await
//! the answers; it posts batches, completes them from the worker's event fd, and answers
//! each by its deadline. When nothing is to be done it sleeps in `poll` on two fds, the
//! worker's (armed) and its own command eventfd, so an idle worker costs no CPU. A UCX
//! worker is `Send`, not `Sync`: one owner is what UCX's serialized mode asks for.

use crate::dir::Dir;
use crate::region::Region;
use crate::transport::one_sided_engine::{OneSidedEngine, OneSidedError, OneSidedStep, RangeOp};
use crate::transport::ucx::{UcxBackend, UcxPosted};
use kvbridge_proto::RegionId;
use kvbridge_ucx::{armed_wait, wait_readable, ArmedWait, BusyBackoff};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

type Reply<T> = oneshot::Sender<Result<T, OneSidedError>>;

/// What a task asks of the backend's thread.
enum Cmd {
    Export(Region, Reply<Vec<u8>>),
    Connect(String, Vec<u8>, bool, Reply<()>),
    Import(String, RegionId, Vec<u8>, Reply<()>),
    Post(String, Dir, Vec<RangeOp>, Instant, Reply<()>),
    Release(String, RegionId, Instant, Reply<()>),
    Revoke(RegionId, Reply<()>),
    /// The peer, the close's deadline, how the peer left.
    Disconnect(String, Instant, Departure, Reply<()>),
    /// UCX's description of the endpoint to a peer (its lanes).
    #[cfg(test)]
    EndpointInfo(String, Reply<String>),
}

/// How a session's peer left, which decides what its endpoint's close waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Departure {
    /// The session ended with the peer alive (a `Bye` either way, or our own error): the
    /// close flushes, and a live peer may rely on our writes having landed once it sees the
    /// connection close ([`UcxBackend::post_disconnect`]).
    Bye,
    /// The peer closed the control connection: its session is over there, or its process
    /// died ([`UcxBackend::post_disconnect_gone`]).
    Left,
    /// The peer's process exited (a same-host peer, watched through a pidfd): its batches
    /// are answered at once, their operations and the close left to the worker
    /// ([`UcxBackend::disconnect_dead`]).
    Died,
}

/// The most rounds of progress that deliver what a dead peer left behind before its batches
/// are answered: past them (other peers keep the worker busy) the departure counts as
/// [`Departure::Left`], which waits where a read could still land.
const DRAIN_ROUNDS: usize = 10_000;

/// A batch, a release's flush or a disconnect's close, posted and not yet answered. None
/// is waited for on its own: the thread completes all of them in its loop, each answered by
/// its deadline, so one that cannot end (a dead peer) holds up no other.
struct Running {
    posted: UcxPosted,
    /// The step a passed deadline names.
    step: OneSidedStep,
    started: Instant,
    deadline: Instant,
    reply: Reply<()>,
}

/// The longest sleep: the thread progresses at least this often, ten cheap calls a second
/// when idle. It sleeps on the armed fd only after a progress that handled nothing (UCX's
/// rule for `ucp_worker_arm`); arming after one that handled events left a wake-up unsent
/// over tcp, and the batch waited for this bound (100 ms, the p99 of the UCX handshake).
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// Progress rounds in a row that handled events before the loop looks at its commands and
/// batches again anyway.
const PROGRESS_BURST: u32 = 64;

/// The handle tasks use; dropping it stops the thread (after it answered what is running,
/// failed at their deadlines at the latest).
pub(crate) struct UcxThread {
    tx: Option<mpsc::Sender<Cmd>>,
    wake: Arc<OwnedFd>,
    address: Vec<u8>,
    /// Rounds of the thread's loop (`UcxThread::wakeups`).
    // Read by this file's tests of the idle cost (`UcxThread::wakeups`, `napped`).
    #[cfg_attr(not(test), allow(dead_code))]
    wakeups: Arc<AtomicU64>,
    /// Microseconds slept in busy rounds (`UcxThread::napped`).
    #[cfg_attr(not(test), allow(dead_code))]
    napped: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for UcxThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxThread").finish_non_exhaustive()
    }
}

fn closed(step: OneSidedStep) -> OneSidedError {
    OneSidedError::Failed {
        peer: "local".to_string(),
        step,
        detail: "the UCX thread has stopped".to_string(),
    }
}

fn eventfd() -> Result<OwnedFd, OneSidedError> {
    // SAFETY: plain syscall; the fd is owned below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(OneSidedError::Failed {
            peer: "local".to_string(),
            step: OneSidedStep::Export,
            detail: format!("eventfd: {}", std::io::Error::last_os_error()),
        });
    }
    // SAFETY: a fresh fd nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl UcxThread {
    /// Starts the thread with a backend of its own (`tls` as in [`UcxBackend::new`]).
    pub(crate) fn start(name: &str, tls: Option<&str>) -> Result<Self, OneSidedError> {
        let backend = UcxBackend::new(tls)?;
        let address = backend.address();
        let wake = Arc::new(eventfd()?);
        let wakeups = Arc::new(AtomicU64::new(0));
        let napped = Arc::new(AtomicU64::new(0));
        let (tx, rx) = mpsc::channel();
        let counters = Counters {
            wakeups: wakeups.clone(),
            napped: napped.clone(),
        };
        let w = wake.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ucx-{name}"))
            .spawn(move || run(backend, rx, w, counters))
            .map_err(|e| OneSidedError::Failed {
                peer: "local".to_string(),
                step: OneSidedStep::Export,
                detail: format!("spawning the UCX thread: {e}"),
            })?;
        Ok(Self {
            tx: Some(tx),
            wake,
            address,
            wakeups,
            napped,
            thread: Some(thread),
        })
    }

    /// This side's worker address, for peers' `connect`.
    pub(crate) fn address(&self) -> &[u8] {
        &self.address
    }

    /// How many rounds the thread's loop ran (each after a sleep, unless the last round had
    /// work): a measure of idle cost that a spin cannot hide.
    #[cfg(test)]
    pub(crate) fn wakeups(&self) -> u64 {
        self.wakeups.load(Ordering::Relaxed)
    }

    /// How long the thread slept while UCX said events were pending and its progress
    /// handled none (waiting for room at a peer): time the thread lost to no event.
    #[cfg(test)]
    pub(crate) fn napped(&self) -> Duration {
        Duration::from_micros(self.napped.load(Ordering::Relaxed))
    }

    async fn ask<T>(
        &self,
        step: OneSidedStep,
        cmd: impl FnOnce(Reply<T>) -> Cmd,
    ) -> Result<T, OneSidedError> {
        let (reply, answer) = oneshot::channel();
        let tx = self.tx.as_ref().ok_or_else(|| closed(step))?;
        tx.send(cmd(reply)).map_err(|_| closed(step))?;
        wake(self.wake.as_raw_fd());
        answer.await.map_err(|_| closed(step))?
    }

    /// See [`OneSidedEngine::export`].
    pub(crate) async fn export(&self, region: &Region) -> Result<Vec<u8>, OneSidedError> {
        let r = region.clone();
        self.ask(OneSidedStep::Export, |tx| Cmd::Export(r, tx))
            .await
    }

    /// See [`UcxBackend::connect_on_host`].
    pub(crate) async fn connect(
        &self,
        peer: &str,
        address: &[u8],
        same_host: bool,
    ) -> Result<(), OneSidedError> {
        let (p, a) = (peer.to_string(), address.to_vec());
        self.ask(OneSidedStep::Connect, |tx| {
            Cmd::Connect(p, a, same_host, tx)
        })
        .await
    }

    /// See [`OneSidedEngine::import`].
    pub(crate) async fn import(
        &self,
        peer: &str,
        id: RegionId,
        descriptor: &[u8],
    ) -> Result<(), OneSidedError> {
        let (p, d) = (peer.to_string(), descriptor.to_vec());
        self.ask(OneSidedStep::Import, |tx| Cmd::Import(p, id, d, tx))
            .await
    }

    /// Posts a batch and waits until it completed at the peer, failed, or `deadline` passed.
    pub(crate) async fn transfer(
        &self,
        peer: &str,
        dir: Dir,
        ops: Vec<RangeOp>,
        deadline: Instant,
    ) -> Result<(), OneSidedError> {
        let p = peer.to_string();
        self.ask(OneSidedStep::Post, |tx| {
            Cmd::Post(p, dir, ops, deadline, tx)
        })
        .await
    }

    /// See [`OneSidedEngine::release`].
    pub(crate) async fn release(
        &self,
        peer: &str,
        id: RegionId,
        deadline: Instant,
    ) -> Result<(), OneSidedError> {
        let p = peer.to_string();
        self.ask(OneSidedStep::Release, |tx| {
            Cmd::Release(p, id, deadline, tx)
        })
        .await
    }

    /// See [`OneSidedEngine::revoke`].
    pub(crate) async fn revoke(&self, id: RegionId) -> Result<(), OneSidedError> {
        self.ask(OneSidedStep::Revoke, |tx| Cmd::Revoke(id, tx))
            .await
    }

    /// UCX's description of the endpoint to `peer`: its lanes' transports.
    #[cfg(test)]
    pub(crate) async fn endpoint_info(&self, peer: &str) -> Result<String, OneSidedError> {
        let p = peer.to_string();
        self.ask(OneSidedStep::Connect, |tx| Cmd::EndpointInfo(p, tx))
            .await
    }

    /// See [`OneSidedEngine::disconnect`], for a peer that left as `how` says.
    pub(crate) async fn disconnect(
        &self,
        peer: &str,
        deadline: Instant,
        how: Departure,
    ) -> Result<(), OneSidedError> {
        let p = peer.to_string();
        self.ask(OneSidedStep::Disconnect, |tx| {
            Cmd::Disconnect(p, deadline, how, tx)
        })
        .await
    }
}

impl Drop for UcxThread {
    fn drop(&mut self) {
        drop(self.tx.take());
        wake(self.wake.as_raw_fd());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn wake(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: 8 bytes from a live u64 to a live eventfd; a full counter (EAGAIN) already
    // wakes the thread.
    unsafe { libc::write(fd, std::ptr::from_ref(&one).cast(), 8) };
}

fn drain(fd: RawFd) {
    let mut v: u64 = 0;
    // SAFETY: 8 bytes into a live u64 from a live non-blocking eventfd.
    unsafe { libc::read(fd, std::ptr::from_mut(&mut v).cast(), 8) };
}

/// What the thread counts for its handle.
struct Counters {
    wakeups: Arc<AtomicU64>,
    napped: Arc<AtomicU64>,
}

/// The thread: take commands, complete batches, sleep on both fds when idle.
fn run(mut b: UcxBackend, rx: mpsc::Receiver<Cmd>, wake: Arc<OwnedFd>, counters: Counters) {
    let mut running: Vec<Running> = Vec::new();
    let mut open = true;
    let mut busy = BusyBackoff::new();
    // The last wait ended with the worker's fd readable: if the next progress handles
    // nothing and UCX arms the fd again, the wake-up was empty (below).
    let mut worker_was_ready = false;
    loop {
        counters.wakeups.fetch_add(1, Ordering::Relaxed);
        drain(wake.as_raw_fd());
        // Whatever woke the worker's fd is handled only by progress; arming alone would
        // clear the wake-up and leave the work (a peer's put to serve, say) undone. UCX
        // wants progress until it handles nothing before the fd is armed.
        let mut handled = false;
        for _ in 0..PROGRESS_BURST {
            if b.progress() == 0 {
                break;
            }
            handled = true;
        }
        while open {
            match rx.try_recv() {
                Ok(cmd) => {
                    serve(&mut b, cmd, &mut running);
                    handled = true;
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => open = false,
            }
        }
        let now = Instant::now();
        let mut i = 0;
        while i < running.len() {
            let r = &mut running[i];
            let outcome = match b.test(&mut r.posted) {
                Ok(false) if now < r.deadline => None,
                Ok(false) => {
                    b.abandon(&mut r.posted);
                    Some(Err(OneSidedError::Deadline {
                        peer: r.posted.peer().to_string(),
                        step: r.step,
                        waited: now - r.started,
                    }))
                }
                Ok(true) => Some(Ok(())),
                Err(e) => Some(Err(e)),
            };
            match outcome {
                None => i += 1,
                Some(result) => {
                    handled = true;
                    let _ = running.swap_remove(i).reply.send(result);
                }
            }
        }
        if !open && running.is_empty() {
            return;
        }
        if handled {
            // Posted work, answers sent or events handled: look again before sleeping
            // (what was posted may have events already, and the fd must be armed only
            // after a progress that handled nothing).
            busy.reset();
            worker_was_ready = false;
            continue;
        }
        // Sleep until the worker or a command wakes us, or the nearest deadline.
        let timeout = running
            .iter()
            .map(|r| r.deadline.saturating_duration_since(Instant::now()))
            .fold(MAX_SLEEP, Duration::min);
        match b.arm() {
            Ok(true) => match armed_wait(worker_was_ready, &mut busy, timeout) {
                ArmedWait::Poll => {
                    worker_was_ready = poll2(b.event_fd(), wake.as_raw_fd(), timeout);
                }
                ArmedWait::Nap(nap) => {
                    wait_readable(wake.as_raw_fd(), nap);
                    let us = u64::try_from(nap.as_micros()).unwrap_or(u64::MAX);
                    counters.napped.fetch_add(us, Ordering::Relaxed);
                    // Whether the fd is still readable: if not, the next wait is on it.
                    worker_was_ready = poll2(b.event_fd(), wake.as_raw_fd(), Duration::ZERO);
                }
            },
            Ok(false) => {
                // Events pending that progress did not handle: a send waiting for room at
                // the peer. The worker's fd stays readable meanwhile, so nap on the command
                // fd alone, briefly at first (a live same-host peer frees room within
                // microseconds), up to 1 ms a round while nothing moves (a killed one).
                let nap = busy.idle().min(timeout);
                if !nap.is_zero() {
                    wait_readable(wake.as_raw_fd(), nap);
                    let us = u64::try_from(nap.as_micros()).unwrap_or(u64::MAX);
                    counters.napped.fetch_add(us, Ordering::Relaxed);
                }
            }
            Err(e) => {
                // The worker cannot sleep: fail what runs, keep serving commands slowly.
                for r in running.drain(..) {
                    let _ = r.reply.send(Err(OneSidedError::Failed {
                        peer: "local".to_string(),
                        step: OneSidedStep::Complete,
                        detail: e.to_string(),
                    }));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn serve(b: &mut UcxBackend, cmd: Cmd, running: &mut Vec<Running>) {
    match cmd {
        Cmd::Export(region, tx) => drop(tx.send(b.export(&region))),
        Cmd::Connect(peer, address, same_host, tx) => {
            drop(tx.send(b.connect_on_host(&peer, &address, same_host)))
        }
        Cmd::Import(peer, id, d, tx) => drop(tx.send(b.import(&peer, id, &d))),
        Cmd::Post(peer, dir, ops, deadline, reply) => track(
            b.post(&peer, dir, &ops),
            OneSidedStep::Complete,
            deadline,
            reply,
            running,
        ),
        Cmd::Release(peer, id, deadline, reply) => track(
            b.post_release(&peer, id),
            OneSidedStep::Release,
            deadline,
            reply,
            running,
        ),
        Cmd::Revoke(id, tx) => drop(tx.send(b.revoke(id))),
        Cmd::Disconnect(peer, deadline, Departure::Bye, reply) => track(
            b.post_disconnect(&peer),
            OneSidedStep::Disconnect,
            deadline,
            reply,
            running,
        ),
        Cmd::Disconnect(peer, deadline, Departure::Died, reply) => {
            if deliver_all(b) {
                answer_dead(b, &peer, running);
                drop(reply.send(b.disconnect_dead(&peer)));
            } else {
                serve(
                    b,
                    Cmd::Disconnect(peer, deadline, Departure::Left, reply),
                    running,
                );
            }
        }
        Cmd::Disconnect(peer, deadline, Departure::Left, reply) => {
            match b.post_disconnect_gone(&peer) {
                Ok(None) => drop(reply.send(Ok(()))),
                Ok(Some(close)) => track(
                    Ok(close),
                    OneSidedStep::Disconnect,
                    deadline,
                    reply,
                    running,
                ),
                Err(e) => drop(reply.send(Err(e))),
            }
        }
        #[cfg(test)]
        Cmd::EndpointInfo(peer, tx) => drop(tx.send(b.endpoint_info(&peer))),
    }
}

/// Progresses the worker until a call handles nothing (at most [`DRAIN_ROUNDS`]); whether
/// it got there.
fn deliver_all(b: &mut UcxBackend) -> bool {
    (0..DRAIN_ROUNDS).any(|_| b.progress() == 0)
}

/// Answers every batch, flush and close of `peer`, whose process exited and whose worker
/// was drained since: one that completed is answered as such, the others fail naming the
/// peer, their operations abandoned to the worker (which keeps their memory registered
/// until UCX ends them).
fn answer_dead(b: &mut UcxBackend, peer: &str, running: &mut Vec<Running>) {
    let mut i = 0;
    while i < running.len() {
        if running[i].posted.peer() != peer {
            i += 1;
            continue;
        }
        let mut r = running.swap_remove(i);
        let result = match b.test(&mut r.posted) {
            Ok(true) => Ok(()),
            Ok(false) => {
                b.abandon(&mut r.posted);
                Err(OneSidedError::Failed {
                    peer: peer.to_string(),
                    step: r.step,
                    detail: "the peer's process exited".into(),
                })
            }
            Err(e) => Err(e),
        };
        let _ = r.reply.send(result);
    }
}

/// Answers `reply` once `posted` completed, failed, or `deadline` passed.
fn track(
    posted: Result<UcxPosted, OneSidedError>,
    step: OneSidedStep,
    deadline: Instant,
    reply: Reply<()>,
    running: &mut Vec<Running>,
) {
    match posted {
        Ok(posted) => running.push(Running {
            posted,
            step,
            started: Instant::now(),
            deadline,
            reply,
        }),
        Err(e) => drop(reply.send(Err(e))),
    }
}

/// Sleeps until one of two fds is readable or `timeout`; whether the first (the worker's)
/// is.
fn poll2(a: RawFd, b: RawFd, timeout: Duration) -> bool {
    let mut fds = [
        libc::pollfd {
            fd: a,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // Round up so a sub-millisecond remainder still sleeps instead of spinning.
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: two valid pollfds for the duration of the call; EINTR just loops the caller.
    unsafe { libc::poll(fds.as_mut_ptr(), 2, ms) };
    fds[0].revents & libc::POLLIN != 0
}

#[cfg(test)]
mod tests {
    //! Two owner threads of this process, the target only serving (its worker progressed
    //! from its event fd), the initiator posting from tokio tasks.

    use super::*;
    use std::future::Future;

    const LEN: usize = 4 << 20;
    /// Every await of a test is bounded: a lost wake-up fails instead of hanging.
    const BOUND: Duration = Duration::from_secs(30);

    async fn bounded<T>(f: impl Future<Output = T>) -> T {
        tokio::time::timeout(BOUND, f)
            .await
            .expect("no answer within the test's bound")
    }

    fn pattern(seed: u64, len: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    struct Pair {
        target: UcxThread,
        initiator: UcxThread,
        remote: Region,
        local: Region,
    }

    async fn pair(tls: &str) -> Pair {
        pair_on(tls, false).await
    }

    /// A pair whose initiator connects as to a peer on its host when `same_host` (UCX's
    /// shared-memory lanes where `tls` has them).
    async fn pair_on(tls: &str, same_host: bool) -> Pair {
        let target = UcxThread::start("target", Some(tls)).unwrap();
        let initiator = UcxThread::start("initiator", Some(tls)).unwrap();
        let remote = Region::alloc(LEN, 4096).unwrap();
        let local = Region::alloc(LEN, 4096).unwrap();
        let d = bounded(target.export(&remote)).await.unwrap();
        bounded(initiator.export(&local)).await.unwrap();
        bounded(initiator.connect("target", target.address(), same_host))
            .await
            .unwrap();
        bounded(initiator.import("target", remote.id(), &d))
            .await
            .unwrap();
        Pair {
            target,
            initiator,
            remote,
            local,
        }
    }

    fn range(p: &Pair, lo: u64, ro: u64, len: u64) -> RangeOp {
        RangeOp {
            local: p.local.id(),
            local_offset: lo,
            remote: p.remote.id(),
            remote_offset: ro,
            len,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_batches_complete_byte_exact_over_every_tls() {
        for tls in ["tcp", "sm,self"] {
            let p = pair(tls).await;
            let data = pattern(3, 2 << 20);
            p.local.write_at(0, &data).unwrap();
            // Eight batches of two 128 KiB ranges each, in flight together.
            let batches = (0..8u64).map(|i| {
                let ops = vec![
                    range(&p, i * (256 << 10), (2 << 20) + i * (256 << 10), 128 << 10),
                    range(
                        &p,
                        i * (256 << 10) + (128 << 10),
                        (2 << 20) + i * (256 << 10) + (128 << 10),
                        128 << 10,
                    ),
                ];
                p.initiator
                    .transfer("target", Dir::Write, ops, Instant::now() + BOUND)
            });
            let started = Instant::now();
            for r in bounded(futures_join(batches)).await {
                r.unwrap();
            }
            eprintln!("{tls}: 8 batches of 256 KiB in {:?}", started.elapsed());
            let mut got = vec![0u8; 2 << 20];
            p.remote.read_at(2 << 20, &mut got).unwrap();
            assert!(got == data, "{tls}: written bytes differ");
            // Read them back into the local region's upper half.
            let back = vec![range(&p, 2 << 20, 2 << 20, 2 << 20)];
            bounded(
                p.initiator
                    .transfer("target", Dir::Read, back, Instant::now() + BOUND),
            )
            .await
            .unwrap();
            p.local.read_at(2 << 20, &mut got).unwrap();
            assert!(got == data, "{tls}: read bytes differ");
            bounded(
                p.initiator
                    .disconnect("target", Instant::now() + BOUND, Departure::Bye),
            )
            .await
            .unwrap();
        }
    }

    /// Awaits every future concurrently (the crate has no `futures` dependency).
    async fn futures_join<F: Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
        let mut fs: Vec<std::pin::Pin<Box<F>>> = fs.map(Box::pin).collect();
        let mut out: Vec<Option<F::Output>> = fs.iter().map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for (f, o) in fs.iter_mut().zip(out.iter_mut()) {
                if o.is_none() {
                    match f.as_mut().poll(cx) {
                        std::task::Poll::Ready(v) => *o = Some(v),
                        std::task::Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        out.into_iter()
            .map(|o| o.expect("every future ended"))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn same_host_writes_keep_their_threads_awake_while_data_moves() {
        // Over UCX 1.13's shared memory a sender whose FIFO is full is told "busy" by
        // `ucp_worker_arm` until the target drained it. A thread that slept 1 ms per such
        // round once it had seen 64 of them (without starting over when events were then
        // handled) napped through most of a transfer: 0.15 GiB/s. Naps are for a peer that
        // frees no room, not for one that is draining.
        let p = pair_on("sm,self,tcp", true).await;
        let data = pattern(9, LEN);
        p.local.write_at(0, &data).unwrap();
        let rounds = 16;
        let started = Instant::now();
        for _ in 0..rounds {
            // Two batches in flight of four 512 KiB ranges each: the whole region.
            let batches = (0..2u64).map(|b| {
                let ops = (0..4u64)
                    .map(|k| {
                        let off = (b * 4 + k) * (512 << 10);
                        range(&p, off, off, 512 << 10)
                    })
                    .collect();
                p.initiator
                    .transfer("target", Dir::Write, ops, Instant::now() + BOUND)
            });
            for r in bounded(futures_join(batches)).await {
                r.unwrap();
            }
        }
        let took = started.elapsed();
        let napped = p.initiator.napped() + p.target.napped();
        eprintln!(
            "{rounds} x {} MiB in {took:?}: initiator napped {:?}, target {:?}",
            LEN >> 20,
            p.initiator.napped(),
            p.target.napped()
        );
        let mut got = vec![0u8; LEN];
        p.remote.read_at(0, &mut got).unwrap();
        assert!(got == data, "written bytes differ");
        assert!(
            napped < took / 4,
            "the threads napped {napped:?} of a {took:?} transfer"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_owner_threads_sleep_on_their_fds() {
        let p = pair("tcp").await;
        let ops = vec![range(&p, 0, 0, 1 << 20)];
        bounded(
            p.initiator
                .transfer("target", Dir::Write, ops, Instant::now() + BOUND),
        )
        .await
        .unwrap();
        let (t0, i0) = (p.target.wakeups(), p.initiator.wakeups());
        std::thread::sleep(Duration::from_secs(1));
        let (t, i) = (p.target.wakeups() - t0, p.initiator.wakeups() - i0);
        // A loop that polls instead of sleeping wakes thousands of times a second.
        assert!(
            t <= 20 && i <= 20,
            "idle for 1 s: target woke {t}, initiator {i} times"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_to_a_stopped_peer_fails_within_its_deadline() {
        let p = pair("tcp").await;
        let ops = vec![range(&p, 0, 0, 1 << 20)];
        bounded(
            p.initiator
                .transfer("target", Dir::Write, ops.clone(), Instant::now() + BOUND),
        )
        .await
        .unwrap();
        let Pair {
            target,
            initiator,
            remote,
            local,
        } = p;
        drop(target);
        let started = Instant::now();
        let r = bounded(initiator.transfer(
            "target",
            Dir::Write,
            ops,
            Instant::now() + Duration::from_secs(2),
        ))
        .await;
        assert!(r.is_err(), "a write to a stopped peer succeeded");
        assert!(
            started.elapsed() < Duration::from_secs(12),
            "took {:?}",
            started.elapsed()
        );
        drop((initiator, remote, local));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hostile_bytes_and_bad_ranges_are_refused_through_the_thread() {
        let p = pair("tcp").await;
        assert!(matches!(
            bounded(p.initiator.connect("evil", &[0xff; 40], false)).await,
            Err(OneSidedError::Malformed { .. })
        ));
        assert!(matches!(
            bounded(p.initiator.import("target", p.remote.id(), &[7; 100])).await,
            Err(OneSidedError::Malformed { .. })
        ));
        let ops = vec![range(&p, 0, LEN as u64 - 1, 2)];
        assert!(matches!(
            bounded(
                p.initiator
                    .transfer("target", Dir::Write, ops, Instant::now() + BOUND)
            )
            .await,
            Err(OneSidedError::OutOfBounds { .. })
        ));
        bounded(
            p.initiator
                .release("target", p.remote.id(), Instant::now() + BOUND),
        )
        .await
        .unwrap();
        let ops = vec![range(&p, 0, 0, 8)];
        assert!(matches!(
            bounded(
                p.initiator
                    .transfer("target", Dir::Write, ops, Instant::now() + BOUND)
            )
            .await,
            Err(OneSidedError::UnknownRegion { .. })
        ));
        bounded(p.initiator.revoke(p.local.id())).await.unwrap();
    }

    /// Set in the child process of `a_write_to_a_killed_peer_process_fails_within_its_deadline`.
    const CHILD_ENV: &str = "KVBRIDGE_UCX_CHILD_TLS";

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len() / 2)
            .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
            .collect()
    }

    /// The target process: this test re-run with `CHILD_ENV` set. It exports a region,
    /// prints its address and descriptor, and serves until it is killed (or 60 s pass).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn child_target_process() {
        let Ok(tls) = std::env::var(CHILD_ENV) else {
            return;
        };
        let t = UcxThread::start("child", Some(&tls)).unwrap();
        let r = Region::alloc(LEN, 4096).unwrap();
        let d = bounded(t.export(&r)).await.unwrap();
        println!("KVBX {} {} {}", hex(t.address()), hex(&d), hex(&r.id().0));
        std::thread::sleep(Duration::from_secs(60));
    }

    /// The target process started, an initiator's thread connected to it (on this host when
    /// `same_host`) with its region imported, a 1 MiB write done, then the target killed.
    /// Returns the initiator, its region (kept registered) and the write's ranges.
    async fn killed_target(tls: &str, same_host: bool) -> (UcxThread, Region, Vec<RangeOp>) {
        use std::io::BufRead;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "transport::ucx_thread::tests::child_target_process",
                "--exact",
                "--nocapture",
            ])
            .env(CHILD_ENV, tls)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let line = std::io::BufReader::new(out)
            .lines()
            .map(|l| l.unwrap())
            .find(|l| l.starts_with("KVBX "))
            .expect("the child's address line");
        let f: Vec<&str> = line.split(' ').collect();
        let (address, descriptor) = (unhex(f[1]), unhex(f[2]));
        let id = RegionId(unhex(f[3]).try_into().unwrap());
        let ini = UcxThread::start("initiator", Some(tls)).unwrap();
        let local = Region::alloc(LEN, 4096).unwrap();
        bounded(ini.export(&local)).await.unwrap();
        bounded(ini.connect("child", &address, same_host))
            .await
            .unwrap();
        bounded(ini.import("child", id, &descriptor)).await.unwrap();
        let ops = vec![RangeOp {
            local: local.id(),
            local_offset: 0,
            remote: id,
            remote_offset: 0,
            len: 1 << 20,
        }];
        bounded(ini.transfer("child", Dir::Write, ops.clone(), Instant::now() + BOUND))
            .await
            .unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        (ini, local, ops)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_disconnect_from_a_killed_peer_holds_up_no_write() {
        // Over shared memory a dead peer is not detected: a write to it ends at its
        // deadline, and the endpoint's close (a session's teardown) would run until its own,
        // longer one. The write must still end by its deadline, not the close's.
        for tls in ["sm,self", "sm,self,tcp"] {
            let (ini, _local, ops) = killed_target(tls, true).await;
            let write = Duration::from_secs(2);
            let close = Duration::from_secs(14);
            let started = Instant::now();
            // The write's command goes first (the first poll sends it), the close's second.
            let (w, c) = tokio::join!(
                async {
                    let r = ini
                        .transfer("child", Dir::Write, ops, Instant::now() + write)
                        .await;
                    (r, started.elapsed())
                },
                ini.disconnect("child", Instant::now() + close, Departure::Bye)
            );
            let (r, took) = w;
            eprintln!(
                "{tls}: write {r:?} after {took:?}; close {c:?} after {:?}",
                started.elapsed()
            );
            assert!(r.is_err(), "{tls}: a write to a killed peer succeeded");
            // The write's deadline plus room for a loaded host's scheduling, short of the
            // close's deadline.
            assert!(
                took < write + Duration::from_secs(8),
                "{tls}: took {took:?}"
            );
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_disconnect_from_a_peer_that_left_ends_without_waiting_for_the_close() {
        // The killed peer's control connection closed (`peer_left`): the close of its
        // same-host endpoint, which never ends, is neither waited for by the disconnect nor
        // by the worker's drop.
        for tls in ["sm,self", "sm,self,tcp"] {
            let (ini, _local, ops) = killed_target(tls, true).await;
            let close = Duration::from_secs(14);
            // A write left in flight toward the dead peer, as a session's last batch.
            let r = ini
                .transfer(
                    "child",
                    Dir::Write,
                    ops,
                    Instant::now() + Duration::from_secs(1),
                )
                .await;
            assert!(r.is_err(), "{tls}: a write to a killed peer succeeded");
            let started = Instant::now();
            bounded(ini.disconnect("child", Instant::now() + close, Departure::Left))
                .await
                .unwrap();
            let answered = started.elapsed();
            drop(ini);
            let dropped = started.elapsed();
            eprintln!(
                "{tls}: disconnect answered after {answered:?}, worker dropped after {dropped:?}"
            );
            // Far short of the close's deadline and of the drop's 2 s bound on closes,
            // with room for a loaded host.
            assert!(answered < Duration::from_secs(1), "{tls}: {answered:?}");
            assert!(dropped < Duration::from_millis(1500), "{tls}: {dropped:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_seen_dead_has_its_batches_answered_at_once() {
        // A same-host peer's exit, proven by its pidfd, lets the thread answer the writes and
        // reads left in flight toward it instead of at their deadline: after a progress
        // that delivered what it sent before dying, nothing more can land.
        for tls in ["sm,self", "posix,cma,self"] {
            let (ini, _local, ops) = killed_target(tls, true).await;
            let long = Instant::now() + Duration::from_secs(20);
            let started = Instant::now();
            // The commands go in this order (each future's first poll sends its own).
            let (w, r, d) = tokio::join!(
                ini.transfer("child", Dir::Write, ops.clone(), long),
                ini.transfer("child", Dir::Read, ops, long),
                ini.disconnect("child", long, Departure::Died),
            );
            let took = started.elapsed();
            eprintln!("{tls}: write {w:?}, read {r:?}, disconnect {d:?}, after {took:?}");
            d.unwrap();
            for (what, res) in [("write", w), ("read", r)] {
                assert!(
                    matches!(&res, Err(OneSidedError::Failed { peer, detail, .. })
                        if peer == "child" && detail.contains("exited")),
                    "{tls}: the {what}: {res:?}"
                );
            }
            // Far short of the 20 s deadlines, with room for a loaded host.
            assert!(took < Duration::from_secs(5), "{tls}: took {took:?}");
            let at = Instant::now();
            drop(ini);
            assert!(at.elapsed() < Duration::from_millis(1500), "{tls}: drop");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_to_a_killed_peer_process_fails_within_its_deadline() {
        for tls in ["tcp", "sm,self"] {
            let (ini, _local, ops) = killed_target(tls, false).await;
            let started = Instant::now();
            let r = bounded(ini.transfer(
                "child",
                Dir::Write,
                ops,
                Instant::now() + Duration::from_secs(3),
            ))
            .await;
            let took = started.elapsed();
            assert!(r.is_err(), "{tls}: a write to a killed peer succeeded");
            // The deadline plus room for a loaded host's scheduling.
            assert!(took < Duration::from_secs(13), "{tls}: took {took:?}");
            eprintln!("{tls}: write to the killed peer: {r:?} after {took:?}");
        }
    }
}
