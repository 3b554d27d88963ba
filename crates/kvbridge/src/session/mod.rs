//! One task per peer session: the single owner of that peer's state.
//!
//! The task drives the sans-IO handshake machine of its role over the control connection,
//! binds the data connection, runs the data path, and tears everything down on any failure:
//! it tells the peer why, stops both data tasks, fails every batch still waiting, and only
//! then reports the session gone to the channel core. Other tasks talk to it by message
//! ([`SessionCmd`]); nothing about the session lives in a map that someone else fills.

use crate::cmd::{CoreCmd, PeerHandle, SessionCmd};
use crate::config::ChannelConfig;
use crate::config::Transport;
use crate::datapath::{AbortHandle, DataPath, PeerFeatures};
use crate::error::{Error, Result};
use crate::grant::RegionTable;
use crate::net::{ReadHalf, Stream, WriteHalf};
use crate::transport::one_sided::OneSided;
use crate::transport::same_host::SameHostRoute;
use crate::transport::tcp::reader::{run_reader, ReaderCtx};
use crate::transport::tcp::writer::run_writer;
use crate::wire::{read_frame, write_msg, ReadError};
use crate::writer_queue::Outgoing;
use crate::writer_queue::{WriterQueue, WriterRx};
use kvbridge_proto::handshake::{
    ping, Established, Initiator, ListenerSession, LocalIdentity, Output, Step,
};
use kvbridge_proto::ids::Blob;
use kvbridge_proto::msg::{DataHello, ErrorCode, Hello, MemInfo, Message, RegionInfo, ShmOffer};
use kvbridge_proto::{Incarnation, PeerId, RegionId, SessionToken};
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

mod direct_copies;
#[cfg(feature = "ucx")]
pub(crate) mod ucx;

pub(crate) use direct_copies::detach_region;
use direct_copies::{ShmRound, ShmState};

/// The target of the marks of a session's way from dial to its first batch
/// (`RUST_LOG=kvbridge::timeline=debug`): each control message sent and received, the
/// handshake's steps, and the UCX negotiation's local work with its duration.
pub(crate) const TIMELINE: &str = "kvbridge::timeline";

/// What every session task gets from its channel.
#[derive(Clone)]
pub(crate) struct SessionEnv {
    pub(crate) local: LocalIdentity,
    pub(crate) config: Arc<ChannelConfig>,
    pub(crate) table: Arc<RegionTable>,
    pub(crate) core: mpsc::UnboundedSender<CoreCmd>,
    /// Where the peers' notifications wait for the application (`notify_queues`).
    pub(crate) notifications: Arc<crate::notify_queues::Inlet>,
    /// (Listener) The shared-memory offer for same-host initiators.
    pub(crate) shm_offer: Option<ShmOffer>,
    /// TLS on the control connection, when on.
    pub(crate) tls: Option<Arc<crate::tls::Tls>>,
    /// The channel's count of peer batches refused for bytes in flight.
    pub(crate) in_flight_refused: Arc<std::sync::atomic::AtomicU64>,
    /// The channel's count of answers to cancelled batches, dropped when they came
    /// (`Stats::late_answers_discarded`).
    pub(crate) late_answers: Arc<std::sync::atomic::AtomicU64>,
    /// The channel's counts of batches copied directly (shared memory, cross-memory attach).
    pub(crate) direct_copies: Arc<crate::transport::shm::DirectCopyCounters>,
    /// The channel's count of frames written past the writers (`Stats::frames_fast_lane`).
    pub(crate) frames_fast_lane: Arc<std::sync::atomic::AtomicU64>,
    /// The channel's UCX worker and its owner thread, when the transport is UCX.
    #[cfg(feature = "ucx")]
    pub(crate) ucx: Option<Arc<crate::transport::ucx_route::UcxChannel>>,
}

enum Machine {
    Init(Initiator),
    Listen(ListenerSession),
}

impl Machine {
    fn poll_output(&mut self) -> Option<Output> {
        match self {
            Machine::Init(m) => m.poll_output(),
            Machine::Listen(m) => m.poll_output(),
        }
    }
    fn poll_timeout(&self) -> Option<std::time::Instant> {
        match self {
            Machine::Init(m) => m.poll_timeout(),
            Machine::Listen(m) => m.poll_timeout(),
        }
    }
    fn handle_timeout(&mut self, now: std::time::Instant) {
        match self {
            Machine::Init(m) => m.handle_timeout(now),
            Machine::Listen(m) => m.handle_timeout(now),
        }
    }
    fn handle_message(&mut self, msg: Message, now: std::time::Instant) {
        match self {
            Machine::Init(m) => m.handle_message(msg, now),
            Machine::Listen(m) => m.handle_message(msg, now),
        }
    }
    fn data_bound(&mut self, now: std::time::Instant) {
        match self {
            Machine::Init(m) => m.data_bound(now),
            Machine::Listen(m) => m.data_bound(now),
        }
    }
    /// Whether a data connection may be bound now (never before the peer authenticated).
    fn may_bind(&self) -> bool {
        match self {
            Machine::Init(_) => true,
            Machine::Listen(m) => m.may_bind(),
        }
    }
    /// (Listener) The session's data-connection key, once the peer proved itself, when
    /// data connections must answer a challenge (a secret is set).
    fn data_key(&self) -> Option<kvbridge_proto::auth::DataKey> {
        match self {
            Machine::Init(_) => None,
            Machine::Listen(m) => m.data_key().cloned(),
        }
    }
    /// (Listener) The most data connections the peer may open.
    fn data_connection_cap(&self) -> u32 {
        let max = crate::config::MAX_DATA_CONNECTIONS as u32;
        match self {
            Machine::Init(_) => max,
            Machine::Listen(m) => m.declared_data_connections().unwrap_or(max).min(max),
        }
    }
    fn step(&self) -> Step {
        match self {
            Machine::Init(m) => m.step(),
            Machine::Listen(m) => m.step(),
        }
    }
    fn close(&mut self, code: ErrorCode, message: String) {
        match self {
            Machine::Init(m) => m.close(code, message),
            Machine::Listen(m) => m.close(code, message),
        }
    }
    fn update_mem(&mut self, mem: MemInfo, now: std::time::Instant) {
        match self {
            Machine::Init(m) => m.provide_mem_info(mem, now),
            Machine::Listen(m) => m.update_mem_info(mem),
        }
    }
}

struct ActiveData {
    path: Arc<DataPath>,
    /// Connection 0 first; a striped session's extra connections after it.
    conns: Vec<DataConn>,
}

/// One data connection's reader and writer.
struct DataConn {
    /// `DataHello::stream` of this connection.
    stream: u32,
    reader: JoinHandle<Result<()>>,
    writer: JoinHandle<Result<()>>,
    /// Its writer's queue (teardown asks the writer to flush and stop through it).
    out: WriterQueue,
    /// For data threads: stops them when dropped.
    threads: Option<ThreadStop>,
}

/// Resolves when any data task of the session ends (never when there is none). A handle is
/// not polled again after it returned: the caller ends the session on the first result.
async fn any_data_task(
    data: Option<&mut ActiveData>,
) -> std::result::Result<Result<()>, tokio::task::JoinError> {
    let Some(d) = data else {
        return std::future::pending().await;
    };
    std::future::poll_fn(|cx| {
        for c in d.conns.iter_mut() {
            for h in [&mut c.reader, &mut c.writer] {
                if let std::task::Poll::Ready(r) = std::pin::Pin::new(h).poll(cx) {
                    return std::task::Poll::Ready(r);
                }
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// Stops a connection's data threads when dropped — in teardown, or when an aborted session
/// task is dropped without reaching its teardown — so they never outlive their session.
struct ThreadStop {
    /// Stops them at their next await.
    stop: tokio::sync::watch::Sender<bool>,
    /// Its shutdown unblocks them inside a system call.
    sock: std::net::TcpStream,
}

impl Drop for ThreadStop {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

/// Runs `fut` on a dedicated thread (blocking I/O inside is fine there) until it ends or
/// `stop` fires; the returned task resolves when the thread is done with it.
fn spawn_data_thread(
    name: &str,
    mut stop: tokio::sync::watch::Receiver<bool>,
    fut: impl Future<Output = Result<()>> + Send + 'static,
) -> JoinHandle<Result<()>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let handle = tokio::runtime::Handle::current();
    let spawned = crate::data_threads::run(
        name,
        Box::new(move || {
            let r = handle.block_on(async move {
                tokio::select! {
                    r = fut => r,
                    _ = stop.wait_for(|s| *s) => Err(Error::Closed),
                }
            });
            let _ = tx.send(r);
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = spawned {
            return Err(Error::Local(format!("cannot start a data thread: {e}")));
        }
        rx.await
            .unwrap_or_else(|_| Err(Error::Local("data thread ended without a result".into())))
    })
}

struct Session {
    id: u64,
    env: SessionEnv,
    /// Address we dialled (initiator) — the core's key for waiters.
    addr: Option<String>,
    /// Name for errors: the peer id once known, else the address.
    peer_name: String,
    peer_id: Option<PeerId>,
    /// The peer's incarnation, once the handshake named it.
    peer_incarnation: Option<Incarnation>,
    /// The peer honours unacknowledged notifications (its `Hello` or `Welcome` said so).
    peer_unacked_notify: bool,
    machine: Machine,
    ctl_w: WriteHalf,
    ctl_rx: mpsc::Receiver<std::result::Result<Message, ReadError>>,
    ctl_reader: JoinHandle<()>,
    cmds: mpsc::UnboundedReceiver<SessionCmd>,
    cmd_tx: mpsc::UnboundedSender<SessionCmd>,
    data: Option<ActiveData>,
    /// Data connections waiting to be bound (test hooks delay binding).
    pending_bind: Option<(Instant, Vec<Stream>)>,
    /// A data connection that arrived before the peer authenticated: parked, not bound.
    parked_data: Option<Stream>,
    /// (Listener) Extra data connections of a striped session (stream index ≥ 1), parked
    /// until connection 0 is bound.
    parked_extra: Vec<(u32, Stream)>,
    /// (Listener, with a secret) Data connections waiting for the peer's proof before they
    /// are challenged: (stream index, connection).
    unproven: Vec<(u32, Stream)>,
    /// (Listener, with a secret) Challenges under way on data connections.
    proving: Vec<JoinHandle<()>>,
    /// (Listener) The session's token.
    token: Option<SessionToken>,
    data_connect: Option<JoinHandle<Result<Vec<Stream>>>>,
    remote: Arc<RwLock<HashMap<RegionId, RegionInfo>>>,
    established: bool,
    last_heard: Instant,
    /// Shared memory, either role.
    shm: ShmState,
    /// UCX, either role.
    #[cfg(feature = "ucx")]
    ucx: ucx::UcxLink,
}

/// A fresh authentication challenge.
fn challenge() -> [u8; kvbridge_proto::auth::CHALLENGE_LEN] {
    let mut c = [0u8; kvbridge_proto::auth::CHALLENGE_LEN];
    crate::random::rand_bytes(&mut c);
    c
}

/// (Initiator) What it takes to open a session's data connections.
struct DataDial {
    net: crate::net::Net,
    /// The listener's address.
    addr: String,
    /// The listener's name in errors.
    peer: String,
    /// Bounds each TCP connect.
    connect: Duration,
    /// Bounds the TLS handshake and the challenge on each connection.
    step: Duration,
    me: PeerId,
    token: SessionToken,
    /// With a secret: the session's key, to answer each connection's challenge.
    data_key: Option<kvbridge_proto::auth::DataKey>,
    /// TLS on data connections ([`crate::TlsConfig::data`]).
    tls: Option<Arc<crate::tls::Tls>>,
}

impl DataDial {
    /// Opens data connections `0..n`, in order. Every wait is bounded; every failure is
    /// typed and names the listener and [`Step::DataBind`].
    async fn all(self, n: u32) -> Result<Vec<Stream>> {
        let mut all = Vec::with_capacity(n as usize);
        for stream in 0..n {
            all.push(self.one(stream).await?);
        }
        Ok(all)
    }

    async fn one(&self, stream: u32) -> Result<Stream> {
        let step = Step::DataBind;
        let timeout = |after| Error::Timeout {
            peer: self.peer.clone(),
            step,
            after,
        };
        let lost = |e: std::io::Error| Error::lost(&self.peer, step, e);
        let mut s = tokio::time::timeout(self.connect, self.net.connect(&self.addr))
            .await
            .map_err(|_| timeout(self.connect))?
            .map_err(lost)?;
        if let Some(tls) = &self.tls {
            // TLS from the first byte: the token below is then never seen on the path.
            s = tls
                .connect_data(s, &self.addr, &self.peer, self.step)
                .await?;
        }
        let hello = Message::DataHello(DataHello {
            token: self.token,
            peer_id: self.me.clone(),
            stream,
        });
        write_msg(&mut s, &hello).await.map_err(lost)?;
        if let Some(key) = &self.data_key {
            // The listener binds it only once we answer its challenge.
            let mut buf = Vec::new();
            let nonce = match tokio::time::timeout(self.step, read_frame(&mut s, 1024, &mut buf))
                .await
                .map_err(|_| timeout(self.step))?
            {
                Ok(Message::DataChallenge(c)) => c.nonce.0,
                Ok(Message::Reject(r)) => {
                    return Err(Error::Rejected {
                        peer: self.peer.clone(),
                        step,
                        code: r.code,
                        message: format!("data connection {stream}: {}", r.message),
                    })
                }
                Ok(m) => {
                    return Err(Error::PeerMisbehaved {
                        peer: self.peer.clone(),
                        step,
                        detail: format!("{} instead of DataChallenge", m.name()),
                    })
                }
                Err(ReadError::Frame(e)) => {
                    return Err(Error::PeerMisbehaved {
                        peer: self.peer.clone(),
                        step,
                        detail: e.to_string(),
                    })
                }
                Err(e) => return Err(Error::lost(&self.peer, step, e)),
            };
            let proof = Message::DataProof(kvbridge_proto::msg::DataProof {
                response: Blob(key.prove(&nonce, &self.token, stream)),
            });
            write_msg(&mut s, &proof).await.map_err(lost)?;
        }
        Ok(s)
    }
}

fn std_now() -> std::time::Instant {
    // tokio's clock, so that paused or simulated time drives the deadlines too.
    Instant::now().into_std()
}

async fn maybe<T, F: Future<Output = T> + Unpin>(f: Option<&mut F>) -> T {
    match f {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The frame limit before the peer's proof, and the test for the frame that carries it.
type UntilProof = (u32, fn(&Message) -> bool);

/// The control connection's frames, read by their own task. With `until_proof` (a secret is
/// set) frames are held to the pre-authentication limit until the frame that carries the
/// peer's proof has passed (`Proof` from an initiator, `Welcome` from a listener): a peer
/// that has not proved itself gets no more than its first frame did. A proof that turns out
/// wrong ends the session, and this task with it.
fn spawn_control_reader(
    mut r: ReadHalf,
    max: u32,
    mut until_proof: Option<UntilProof>,
) -> (
    mpsc::Receiver<std::result::Result<Message, ReadError>>,
    JoinHandle<()>,
) {
    let (tx, rx) = mpsc::channel(64);
    let h = tokio::spawn(async move {
        let mut buf = Vec::new();
        loop {
            let limit = until_proof.map_or(max, |(pre_proof, _)| pre_proof);
            let r = read_frame(&mut r, limit, &mut buf).await;
            if let (Some((_, proves)), Ok(m)) = (until_proof, &r) {
                if proves(m) {
                    until_proof = None;
                }
            }
            let stop = r.is_err();
            if tx.send(r).await.is_err() || stop {
                return;
            }
        }
    });
    (rx, h)
}

/// Runs the initiator side: dial, handshake, serve, tear down.
pub(crate) async fn run_initiator(
    env: SessionEnv,
    id: u64,
    addr: String,
    cmds: mpsc::UnboundedReceiver<SessionCmd>,
    cmd_tx: mpsc::UnboundedSender<SessionCmd>,
) {
    let d = &env.config.deadlines;
    tracing::debug!(target: TIMELINE, session = id, peer = %addr, "dial");
    let stream = match tokio::time::timeout(d.connect, env.config.net.connect(&addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            let err = Error::lost(&addr, Step::Connect, e);
            let _ = env.core.send(CoreCmd::SessionDown { id, error: err });
            return;
        }
        Err(_) => {
            let err = Error::Timeout {
                peer: addr.clone(),
                step: Step::Connect,
                after: d.connect,
            };
            let _ = env.core.send(CoreCmd::SessionDown { id, error: err });
            return;
        }
    };
    // TLS wraps the control connection below the protocol; its handshake gets one step's
    // deadline, and its failures are typed at `Step::Tls`.
    let stream = match &env.tls {
        Some(tls) => match tls.connect(stream, &addr, d.handshake_step).await {
            Ok(s) => s,
            Err(error) => {
                let _ = env.core.send(CoreCmd::SessionDown { id, error });
                return;
            }
        },
        None => stream,
    };
    tracing::debug!(target: TIMELINE, session = id, peer = %addr, "control connected");
    // Declared in the Hello: the listener refuses any data connection beyond them.
    let streams = env
        .config
        .data_connections
        .clamp(1, crate::config::MAX_DATA_CONNECTIONS) as u32;
    let machine = Machine::Init(Initiator::declaring(
        env.local.clone(),
        d.handshake_step,
        std_now(),
        challenge(),
        streams,
    ));
    #[cfg(feature = "ucx")]
    let machine = match machine {
        Machine::Init(m) if env.ucx.is_some() => Machine::Init(m.with_ucx()),
        m => m,
    };
    Session::start(
        env,
        id,
        Some(addr.clone()),
        addr,
        None,
        None,
        machine,
        stream,
        cmds,
        cmd_tx,
    )
    .run()
    .await;
}

/// Runs the listener side of a session whose `Hello` was already read.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_listener(
    env: SessionEnv,
    id: u64,
    stream: Stream,
    hello: Hello,
    token: SessionToken,
    cmds: mpsc::UnboundedReceiver<SessionCmd>,
    cmd_tx: mpsc::UnboundedSender<SessionCmd>,
) {
    tracing::debug!(target: TIMELINE, session = id, peer = %hello.peer_id, "hello read");
    if let Some(d) = env.config.hooks.listener_welcome_delay {
        tokio::time::sleep(d).await;
    }
    let granted = env.table.granted_to(&hello.peer_id);
    let peer = hello.peer_id.clone();
    let incarnation = hello.incarnation;
    let machine = Machine::Listen(ListenerSession::accept_with_shm(
        hello,
        &env.local,
        token,
        granted,
        env.config.deadlines.handshake_step,
        std_now(),
        challenge(),
        env.shm_offer.clone(),
    ));
    #[cfg(feature = "ucx")]
    let machine = match machine {
        Machine::Listen(m) if env.ucx.is_some() => Machine::Listen(m.offering_ucx()),
        m => m,
    };
    let mut session = Session::start(
        env,
        id,
        None,
        peer.to_string(),
        Some(peer),
        Some(incarnation),
        machine,
        stream,
        cmds,
        cmd_tx,
    );
    session.token = Some(token);
    session.run().await;
}

impl Session {
    #[allow(clippy::too_many_arguments)]
    fn start(
        env: SessionEnv,
        id: u64,
        addr: Option<String>,
        peer_name: String,
        peer_id: Option<PeerId>,
        peer_incarnation: Option<Incarnation>,
        machine: Machine,
        stream: Stream,
        cmds: mpsc::UnboundedReceiver<SessionCmd>,
        cmd_tx: mpsc::UnboundedSender<SessionCmd>,
    ) -> Self {
        #[cfg(feature = "ucx")]
        let (env_ucx, initiator) = (env.ucx.clone(), matches!(machine, Machine::Init(_)));
        #[cfg(feature = "ucx")]
        let ucx_shm_lanes = env.config.ucx_shm_lanes;
        let (r, w) = stream.into_split();
        let until_proof = env.local.authenticates().then(|| {
            let proves: fn(&Message) -> bool = match &machine {
                Machine::Listen(_) => |m| matches!(m, Message::Proof(_)),
                Machine::Init(_) => |m| matches!(m, Message::Welcome(_)),
            };
            (env.config.limits.first_frame_limit(), proves)
        });
        let (ctl_rx, ctl_reader) =
            spawn_control_reader(r, env.config.limits.max_frame_len, until_proof);
        let peer_unacked_notify = match &machine {
            Machine::Listen(m) => m.peer_unacked_notify(),
            // Learnt from the `Welcome`.
            Machine::Init(_) => false,
        };
        Session {
            id,
            env,
            addr,
            peer_name,
            peer_id,
            peer_incarnation,
            peer_unacked_notify,
            machine,
            ctl_w: w,
            ctl_rx,
            ctl_reader,
            cmds,
            cmd_tx,
            data: None,
            pending_bind: None,
            parked_data: None,
            parked_extra: Vec::new(),
            unproven: Vec::new(),
            proving: Vec::new(),
            token: None,
            data_connect: None,
            remote: Arc::new(RwLock::new(HashMap::new())),
            established: false,
            last_heard: Instant::now(),
            shm: ShmState::default(),
            #[cfg(feature = "ucx")]
            ucx: ucx::UcxLink::new(env_ucx, initiator, ucx_shm_lanes),
        }
    }

    async fn run(mut self) {
        let err = self.serve().await;
        self.teardown(err).await;
    }

    /// A message from the peer's control connection (`None`: the reader ended). The error
    /// that ends the session, if it does.
    fn on_control(&mut self, m: Option<std::result::Result<Message, ReadError>>) -> Option<Error> {
        self.last_heard = Instant::now();
        if let Some(Ok(m)) = &m {
            tracing::debug!(target: TIMELINE, session = self.id, peer = %self.peer_name,
                msg = m.name(), "received");
        }
        match m {
            #[cfg(feature = "ucx")]
            Some(Ok(m)) if self.ucx.takes(&m) => {
                self.ucx.handle_message(m);
                None
            }
            Some(Ok(m)) => {
                self.machine.handle_message(m, std_now());
                None
            }
            Some(Err(ReadError::Frame(e))) => Some(Error::PeerMisbehaved {
                peer: self.peer_name.clone(),
                step: self.machine.step(),
                detail: e.to_string(),
            }),
            Some(Err(e)) => {
                #[cfg(feature = "ucx")]
                self.ucx.peer_left();
                Some(Error::lost(&self.peer_name, self.machine.step(), e))
            }
            None => {
                #[cfg(feature = "ucx")]
                self.ucx.peer_left();
                Some(Error::lost(
                    &self.peer_name,
                    self.machine.step(),
                    "control reader ended",
                ))
            }
        }
    }

    /// A command from the core or a data connection's classifier (`None`: the core is
    /// gone). The error that ends the session, if it does.
    async fn on_command(&mut self, c: Option<SessionCmd>) -> Option<Error> {
        match c {
            Some(SessionCmd::DataConn(s, peer, stream)) if self.env.local.authenticates() => {
                // Bound only once it answers a fresh challenge under the session's
                // key: its token alone (seen in the clear) proves nothing.
                if stream >= self.machine.data_connection_cap()
                    || Some(&peer) != self.peer_id.as_ref()
                {
                    tokio::spawn(refuse(
                        s,
                        ErrorCode::UnknownSession,
                        "data connection does not match this session",
                    ));
                } else if self.unproven.len() + self.proving.len()
                    >= 2 * crate::config::MAX_DATA_CONNECTIONS
                {
                    tokio::spawn(refuse(
                        s,
                        ErrorCode::LimitExceeded,
                        "too many data connections being checked",
                    ));
                } else if let Some(key) = self.machine.data_key() {
                    self.challenge(&key, stream, s);
                } else {
                    self.unproven.push((stream, s));
                }
            }
            Some(SessionCmd::DataUnproven) => self.proving.retain(|h| !h.is_finished()),
            Some(SessionCmd::DataProven(s, stream)) => {
                self.proving.retain(|h| !h.is_finished());
                self.park_proven(s, stream);
            }
            Some(SessionCmd::DataConn(s, peer, stream)) if stream > 0 => {
                let known = self.parked_extra.iter().any(|(i, _)| *i == stream)
                    || self
                        .data
                        .as_ref()
                        .is_some_and(|d| d.conns.iter().any(|c| c.stream == stream));
                if known
                    || stream >= self.machine.data_connection_cap()
                    || Some(&peer) != self.peer_id.as_ref()
                {
                    tokio::spawn(refuse(
                        s,
                        ErrorCode::UnknownSession,
                        "data connection does not match this session",
                    ));
                } else {
                    self.parked_extra.push((stream, s));
                }
            }
            Some(SessionCmd::DataConn(s, peer, _)) => {
                if self.data.is_some()
                    || self.pending_bind.is_some()
                    || self.parked_data.is_some()
                    || Some(&peer) != self.peer_id.as_ref()
                {
                    // A second data connection, or one naming another peer: refuse it
                    // without disturbing this session.
                    tokio::spawn(refuse(
                        s,
                        ErrorCode::UnknownSession,
                        "data connection does not match this session",
                    ));
                } else {
                    self.parked_data = Some(s);
                }
            }
            Some(SessionCmd::Replace(e)) | Some(SessionCmd::Abort(e)) => return Some(e),
            // Established meanwhile: it holds no handshake slot any more.
            Some(SessionCmd::SlotTaken { .. }) if self.established => {}
            Some(SessionCmd::SlotTaken { from, by }) => {
                return Some(Error::HandshakeSlotTaken {
                    peer: self.peer_name.clone(),
                    from: from.to_string(),
                    step: self.machine.step(),
                    by: by.ip().to_string(),
                })
            }
            Some(SessionCmd::MemChanged) => {
                if let Some(p) = &self.peer_id {
                    let mem = self.env.table.granted_to(p);
                    self.machine.update_mem(mem, std_now());
                }
                #[cfg(feature = "ucx")]
                self.ucx.grants_changed();
                if let Err(e) = self.sync_exports().await {
                    return Some(e);
                }
            }
            Some(SessionCmd::ShmConn(s, peer)) => {
                if self.shm.conn.is_some()
                    || self.shm.parked.is_some()
                    || Some(&peer) != self.peer_id.as_ref()
                {
                    drop(s);
                } else {
                    self.shm.parked = Some(s);
                }
            }
            Some(SessionCmd::EndIfMapping { region, after }) => {
                if self.shm.exports.contains_key(&region) || self.shm.revoking.contains_key(&region)
                {
                    return Some(Error::UnmapTimeout {
                        peer: self.peer_name.clone(),
                        step: Step::Established,
                        region,
                        after,
                    });
                }
            }
            Some(SessionCmd::Close) | None => return Some(Error::Closed),
        }
        None
    }

    /// A data connection that answered its challenge, parked until the session can bind
    /// it; refused when its stream is bound or parked already.
    fn park_proven(&mut self, s: Stream, stream: u32) {
        let bound = self
            .data
            .as_ref()
            .is_some_and(|d| d.conns.iter().any(|c| c.stream == stream))
            || (stream == 0
                && (self.data.is_some()
                    || self.pending_bind.is_some()
                    || self.parked_data.is_some()))
            || self.parked_extra.iter().any(|(i, _)| *i == stream);
        if bound {
            tokio::spawn(refuse(
                s,
                ErrorCode::UnknownSession,
                "this data connection's stream is already bound",
            ));
        } else if stream == 0 {
            self.parked_data = Some(s);
        } else {
            self.parked_extra.push((stream, s));
        }
    }

    /// Binds what waited for the session to be ready for it: data connections to challenge
    /// or to bind, the shared-memory connection. `Ok(true)`: something was done (look
    /// again before waiting).
    async fn bind_waiting(&mut self) -> std::result::Result<bool, Error> {
        if !self.unproven.is_empty() {
            if let Some(key) = self.machine.data_key() {
                for (stream, s) in std::mem::take(&mut self.unproven) {
                    self.challenge(&key, stream, s);
                }
                return Ok(true);
            }
        }
        if self.parked_data.is_some() && self.machine.may_bind() {
            let s = self.parked_data.take().expect("checked");
            let delay = self.env.config.hooks.listener_bind_delay;
            self.bind_after(delay, vec![s]);
            return Ok(true);
        }
        if !self.parked_extra.is_empty() && self.data.is_some() {
            for (stream, s) in std::mem::take(&mut self.parked_extra) {
                self.bind_extra(stream, s);
            }
            return Ok(true);
        }
        if self.shm.parked.is_some() && self.machine.may_bind() {
            let s = self.shm.parked.take().expect("checked");
            let (shm, cx) = self.shm_round();
            shm.bind(&cx, s);
            self.sync_exports().await?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Serves until the session ends; returns why.
    async fn serve(&mut self) -> Error {
        let keepalive = self.env.config.deadlines.keepalive;
        let mut tick = tokio::time::interval_at(Instant::now() + keepalive, keepalive);
        loop {
            if let Some(e) = self.process_outputs().await {
                return e;
            }
            #[cfg(feature = "ucx")]
            if let Some(e) = self.ucx_pump().await {
                return e;
            }
            match self.bind_waiting().await {
                Ok(true) => continue,
                Ok(false) => {}
                Err(e) => return e,
            }
            let ready_at = self.shm.pending_ready.as_ref().map(|(_, at)| *at);
            let deadline = self.machine.poll_timeout();
            #[cfg(feature = "ucx")]
            let deadline = match (deadline, self.ucx.poll_timeout()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let deadline = deadline.map(Instant::from_std);
            let bind_at = self.pending_bind.as_ref().map(|(at, _)| *at);
            tokio::select! {
                m = self.ctl_rx.recv() => {
                    if let Some(e) = self.on_control(m) {
                        return e;
                    }
                }
                c = self.cmds.recv() => {
                    if let Some(e) = self.on_command(c).await {
                        return e;
                    }
                }
                _ = sleep_until_opt(deadline) => {
                    self.machine.handle_timeout(std_now());
                    #[cfg(feature = "ucx")]
                    self.ucx.handle_timeout(std_now());
                }
                _ = sleep_until_opt(bind_at) => {
                    let (_, s) = self.pending_bind.take().expect("bind_at implies pending_bind");
                    self.bind(s);
                }
                r = maybe(self.data_connect.as_mut()) => {
                    self.data_connect = None;
                    match r {
                        Ok(Ok(s)) => {
                            let delay = self.env.config.hooks.initiator_bind_delay;
                            self.bind_after(delay, s);
                        }
                        Ok(Err(e)) => return e,
                        Err(e) => return Error::lost(&self.peer_name, Step::DataBind, e),
                    }
                }
                m = recv_opt(self.shm.rx.as_mut()) => {
                    let (shm, cx) = self.shm_round();
                    if let Err(e) = shm.on_frame(&cx, m).await {
                        return e;
                    }
                }
                _ = synced(self.shm.synced.as_mut()) => {
                    self.shm.synced = None;
                    if let Some((est, _)) = self.shm.pending_ready.take() {
                        self.on_established(est);
                    }
                }
                _ = sleep_until_opt(ready_at) => {
                    self.shm.synced = None;
                    let (est, _) = self.shm.pending_ready.take().expect("ready_at implies pending");
                    if self.env.config.transport == Transport::Shm {
                        return Error::Timeout { peer: self.peer_name.clone(), step: Step::DataBind,
                            after: self.env.config.deadlines.handshake_step };
                    }
                    tracing::warn!(peer = %self.peer_name, "shared memory not ready in time; using TCP");
                    self.on_established(est);
                }
                r = any_data_task(self.data.as_mut()) => {
                    let e = flatten(&self.peer_name, r);
                    return self.peer_word_after(e).await;
                }
                _ = tick.tick(), if self.established => {
                    if self.last_heard.elapsed() > self.env.config.deadlines.peer_silence {
                        return Error::Timeout { peer: self.peer_name.clone(), step: Step::Established,
                            after: self.env.config.deadlines.peer_silence };
                    }
                    if let Err(e) = self.send(&ping(self.id)).await { return e; }
                }
            }
        }
    }

    /// Carries out what the UCX negotiation asked for; returns an error when the session
    /// must end.
    #[cfg(feature = "ucx")]
    async fn ucx_pump(&mut self) -> Option<Error> {
        let round = ucx::Round {
            peer: &self.peer_name,
            session: self.id,
            peer_id: self.peer_id.as_ref(),
            table: &self.env.table,
            data: self.data.as_ref().map(|d| &d.path),
            op: self.env.config.deadlines.op,
        };
        let (send, err) = self.ucx.pump(&round).await;
        for m in send {
            if let Err(e) = self.send(&m).await {
                return Some(e);
            }
        }
        if err.is_none() {
            if let Some(handle) = self.ucx.take_released() {
                tracing::debug!(target: TIMELINE, session = self.id, peer = %self.peer_name,
                    "up");
                let _ = self.env.core.send(CoreCmd::SessionUp {
                    id: self.id,
                    handle,
                });
            }
        }
        err
    }

    async fn send(&mut self, m: &Message) -> Result<()> {
        tracing::debug!(target: TIMELINE, session = self.id, peer = %self.peer_name,
            msg = m.name(), "send");
        let limit = self.env.config.deadlines.control_write;
        match tokio::time::timeout(limit, write_msg(&mut self.ctl_w, m)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::lost(&self.peer_name, self.machine.step(), e)),
            Err(_) => Err(Error::Timeout {
                peer: self.peer_name.clone(),
                step: self.machine.step(),
                after: limit,
            }),
        }
    }

    /// A data connection ended with `lost`. A peer that ends the session on purpose says so
    /// on the control connection first (`Bye`, `Reject`), then closes its data connections;
    /// our data reader, on its own thread, can see that close before the control reader
    /// reads the word that preceded it. So the control connection gets [`PEER_WORD_GRACE`]
    /// to deliver it: the session then ends with the peer's reason, not "data connection
    /// closed". A peer that died closes its control connection too, which ends the wait.
    async fn peer_word_after(&mut self, lost: Error) -> Error {
        if !matches!(lost, Error::ConnectionLost { .. }) {
            return lost;
        }
        let until = Instant::now() + PEER_WORD_GRACE;
        loop {
            match tokio::time::timeout_at(until, self.ctl_rx.recv()).await {
                Ok(Some(Ok(m))) => {
                    self.machine.handle_message(m, std_now());
                    if let Some(e) = self.process_outputs().await {
                        return e;
                    }
                }
                Ok(Some(Err(ReadError::Frame(_)))) | Err(_) => return lost,
                Ok(Some(Err(_)) | None) => {
                    // The control connection ended too.
                    #[cfg(feature = "ucx")]
                    self.ucx.peer_left();
                    return lost;
                }
            }
        }
    }

    /// Carries out what the machine asked for; returns an error when the session must end.
    async fn process_outputs(&mut self) -> Option<Error> {
        while let Some(o) = self.machine.poll_output() {
            match o {
                Output::Send(m) => {
                    if let Err(e) = self.send(&m).await {
                        return Some(e);
                    }
                }
                Output::Welcomed {
                    peer_id,
                    token,
                    incarnation,
                    shm,
                    unacked_notify,
                    data_key,
                } => {
                    self.peer_incarnation = Some(incarnation);
                    self.peer_unacked_notify = unacked_notify;
                    self.peer_name = peer_id.to_string();
                    self.peer_id = Some(peer_id.clone());
                    let (state, cx) = self.shm_round();
                    if let Err(e) = state.start(&cx, shm, token) {
                        return Some(e);
                    }
                    #[cfg(feature = "ucx")]
                    if let Machine::Init(m) = &self.machine {
                        // Connecting, the offer, its answer and the keys: two steps' time.
                        let settle = 2 * self.env.config.deadlines.handshake_step;
                        self.ucx.welcomed(m.peer_offers_ucx(), settle, std_now());
                    }
                    let mem = self.env.table.granted_to(&peer_id);
                    self.machine.update_mem(mem, std_now());
                    // Shared memory carries the data itself: no striping beside it.
                    let n = kvbridge_proto::route::data_connections(
                        self.shm.peer.is_some(),
                        self.env.config.data_connections,
                        crate::config::MAX_DATA_CONNECTIONS,
                    );
                    let dial = DataDial {
                        net: self.env.config.net,
                        addr: self.addr.clone().unwrap_or_default(),
                        peer: self.peer_name.clone(),
                        connect: self.env.config.deadlines.connect,
                        step: self.env.config.deadlines.handshake_step,
                        me: self.env.local.peer_id.clone(),
                        token,
                        data_key,
                        tls: self.env.tls.clone().filter(|t| t.on_data()),
                    };
                    self.data_connect = Some(tokio::spawn(dial.all(n as u32)));
                }
                Output::Ready(est) => {
                    // The offers being synced are checked against these lengths.
                    if let Some(p) = &self.shm.peer {
                        p.announce(est.regions.regions.iter().map(|r| (r.id, r.len)));
                    }
                    let waiting = self.shm.synced.as_ref().is_some_and(|w| !*w.borrow());
                    if waiting {
                        let at = Instant::now() + self.env.config.deadlines.handshake_step;
                        self.shm.pending_ready = Some((est, at));
                    } else {
                        self.shm.synced = None;
                        self.on_established(est);
                    }
                }
                Output::PeerMemInfo(mem) => self.set_remote(mem),
                Output::Failed(e) => {
                    return Some(Error::from_handshake(
                        &self.peer_name,
                        self.machine.step(),
                        e,
                    ))
                }
            }
        }
        None
    }

    /// (Listener) Challenges data connection `stream` to prove, under the session's key,
    /// that it belongs to this session; it comes back as `DataProven` (or is refused with
    /// `Unauthenticated`, and comes back as `DataUnproven`), within a handshake step.
    fn challenge(&mut self, key: &kvbridge_proto::auth::DataKey, stream: u32, mut s: Stream) {
        let key = key.clone();
        let token = self.token.expect("a listener session has a token");
        let tx = self.cmd_tx.clone();
        let limit = self.env.config.deadlines.handshake_step;
        let peer = self.peer_name.clone();
        self.proving.push(tokio::spawn(async move {
            let nonce = challenge();
            let exchange = async {
                let c = Message::DataChallenge(kvbridge_proto::msg::DataChallenge {
                    nonce: Blob(nonce.to_vec()),
                });
                write_msg(&mut s, &c).await.map_err(|e| e.to_string())?;
                let mut buf = Vec::new();
                match read_frame(&mut s, 1024, &mut buf).await {
                    Ok(Message::DataProof(p)) => Ok(p.response.0),
                    Ok(m) => Err(format!("{} instead of DataProof", m.name())),
                    Err(e) => Err(e.to_string()),
                }
            };
            let answer = match tokio::time::timeout(limit, exchange).await {
                Ok(r) => r,
                Err(_) => Err(format!("no DataProof within {limit:?}")),
            };
            match answer {
                Ok(proof) if key.verify(&nonce, &token, stream, &proof) => {
                    let _ = tx.send(SessionCmd::DataProven(s, stream));
                }
                Ok(_) => {
                    if let Some(suppressed) = crate::refusals::AUTH_FAILED.allow() {
                        tracing::warn!(%peer, stream, suppressed, "a data connection's proof does not check out; refused");
                    }
                    refuse(s, ErrorCode::Unauthenticated, "the data connection's proof does not check out").await;
                    let _ = tx.send(SessionCmd::DataUnproven);
                }
                Err(why) => {
                    tracing::debug!(%peer, stream, %why, "data connection not proven; refused");
                    refuse(s, ErrorCode::Unauthenticated, &why).await;
                    let _ = tx.send(SessionCmd::DataUnproven);
                }
            }
        }));
    }

    /// Binds now, or after a test hook's delay (while control messages keep being served,
    /// so the state machine — not a queue in front of it — holds early arrivals).
    fn bind_after(&mut self, delay: Option<Duration>, s: Vec<Stream>) {
        match delay {
            // A zero-length timer would still wait for the timer wheel's next tick (1 ms).
            None => self.bind(s),
            Some(d) => self.pending_bind = Some((Instant::now() + d, s)),
        }
    }

    /// Binds the session's data connections (connection 0 first) and starts their tasks.
    fn bind(&mut self, streams: Vec<Stream>) {
        let peer = self
            .peer_id
            .clone()
            .expect("bound only after the peer is known");
        let cmds = self.cmd_tx.clone();
        let abort = AbortHandle::new(move |e| {
            let _ = cmds.send(SessionCmd::Abort(e));
        });
        // The session's one-sided backends from the start; UCX joins once negotiated
        // (`ucx.rs`).
        let same_host = self
            .shm
            .peer
            .clone()
            .map(|shm| Arc::new(SameHostRoute::new(peer.clone(), shm)));
        let one_sided: Vec<Arc<dyn OneSided>> = same_host
            .iter()
            .map(|r| r.clone() as Arc<dyn OneSided>)
            .collect();
        let (path, rxs) = DataPath::new(
            peer,
            abort,
            self.env.config.limits.max_bytes_in_flight_per_peer,
            streams.len(),
            one_sided,
            self.env.frames_fast_lane.clone(),
            PeerFeatures {
                unacked_notify: self.peer_unacked_notify,
                grant_tokens: match &self.machine {
                    Machine::Listen(m) => m.peer_grant_tokens(),
                    Machine::Init(m) => m.peer_grant_tokens(),
                },
            },
        );
        let mut conns = Vec::with_capacity(streams.len());
        for (i, (s, rx)) in streams.into_iter().zip(rxs).enumerate() {
            // Connection 0's writer runs the batches queued on it that the same-host
            // backend reaches (regions the peer mapped), in order with its frames.
            let run_here = if i == 0 {
                same_host.clone().map(|r| r as Arc<dyn OneSided>)
            } else {
                None
            };
            let out = path.queue_of(i);
            match self.start_conn(&path, s, i as u32, out, rx, run_here) {
                Ok(c) => conns.push(c),
                Err(e) => return self.fail_bind(e),
            }
        }
        self.data = Some(ActiveData { path, conns });
        tracing::debug!(target: TIMELINE, session = self.id, peer = %self.peer_name,
            "data bound");
        self.machine.data_bound(std_now());
    }

    /// (Listener) Binds an extra data connection of a striped session: it serves the
    /// peer's batch parts that arrive on it and acknowledges them on it.
    fn bind_extra(&mut self, stream: u32, s: Stream) {
        let Some(path) = self.data.as_ref().map(|d| d.path.clone()) else {
            return;
        };
        let (out, rx) = crate::writer_queue::channel(self.env.frames_fast_lane.clone());
        match self.start_conn(&path, s, stream, out, rx, None) {
            Ok(c) => self.data.as_mut().expect("checked").conns.push(c),
            Err(e) => self.fail_bind(e),
        }
    }

    /// Starts one data connection's reader and writer (threads or tasks).
    fn start_conn(
        &self,
        path: &Arc<DataPath>,
        s: Stream,
        stream: u32,
        out: WriterQueue,
        out_rx: WriterRx,
        run_here: Option<Arc<dyn OneSided>>,
    ) -> std::io::Result<DataConn> {
        let ctx = ReaderCtx {
            peer: path.peer.clone(),
            pending: path.pending(),
            incoming: path.incoming(),
            incarnation: self
                .peer_incarnation
                .expect("bound only after the peer is known"),
            table: self.env.table.clone(),
            limits: self.env.config.limits.clone(),
            payload_deadline: self.env.config.deadlines.op,
            hooks: self.env.config.hooks.clone(),
            notifications: self.env.notifications.clone(),
            out: out.clone(),
            in_flight_refused: self.env.in_flight_refused.clone(),
            late_answers: self.env.late_answers.clone(),
        };
        let hooks = &self.env.config.hooks;
        let copy_delay = hooks
            .direct_copy_delay
            .map(|d| (d, hooks.direct_copies_delayed.clone()));
        let (s, blocking) = if self.env.config.data_threads {
            match s {
                Stream::Tokio(t) => match Stream::Tokio(t).into_blocking_split() {
                    Ok(b) => (None, b),
                    Err(e) => {
                        tracing::warn!(error = %e, "blocking data path unavailable");
                        return Err(e);
                    }
                },
                #[allow(unreachable_patterns)]
                other => (Some(other), None),
            }
        } else {
            (Some(s), None)
        };
        Ok(match (s, blocking) {
            (_, Some((r, w, sock))) => {
                // Small frames may skip the writer thread (see `writer_queue`).
                out_rx.open_lane(sock.try_clone()?);
                // No blocking write outlives the op deadline (`run_writer`).
                w.set_stall_timeout(Some(self.env.config.deadlines.op))?;
                let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
                let writer = spawn_data_thread(
                    "kvb-data-tx",
                    stop_rx.clone(),
                    run_writer(
                        path.peer.clone(),
                        path.pending(),
                        run_here,
                        w,
                        out_rx,
                        (self.env.config.deadlines.op, copy_delay.clone()),
                    ),
                );
                let reader = spawn_data_thread("kvb-data-rx", stop_rx, run_reader(r, ctx));
                DataConn {
                    stream,
                    reader,
                    writer,
                    out,
                    threads: Some(ThreadStop {
                        stop: stop_tx,
                        sock,
                    }),
                }
            }
            (Some(s), None) => {
                let (r, w) = s.into_split();
                DataConn {
                    stream,
                    writer: tokio::spawn(run_writer(
                        path.peer.clone(),
                        path.pending(),
                        run_here,
                        w,
                        out_rx,
                        (self.env.config.deadlines.op, copy_delay),
                    )),
                    reader: tokio::spawn(run_reader(r, ctx)),
                    out,
                    threads: None,
                }
            }
            (None, None) => unreachable!("a stream is either split for threads or kept"),
        })
    }

    /// Binding failed locally: fail the session through the machine's deadline path.
    fn fail_bind(&mut self, e: std::io::Error) {
        let err = Error::lost(&self.peer_name, Step::DataBind, e);
        let _ = self.cmd_tx.send(SessionCmd::Abort(err));
    }

    /// The session's same-host state, with what it needs of the session for one step.
    fn shm_round(&mut self) -> (&mut ShmState, ShmRound<'_>) {
        let cx = ShmRound {
            session: self.id,
            peer: &self.peer_name,
            peer_id: self.peer_id.as_ref(),
            me: &self.env.local.peer_id,
            may_bind: self.machine.may_bind(),
            config: &self.env.config,
            table: &self.env.table,
            core: &self.env.core,
            counters: &self.env.direct_copies,
            remote: &self.remote,
        };
        (&mut self.shm, cx)
    }

    /// (Listener) See [`ShmState::sync_exports`].
    async fn sync_exports(&mut self) -> Result<()> {
        let (shm, cx) = self.shm_round();
        shm.sync_exports(&cx).await
    }

    /// See [`ShmState::end`].
    async fn end_shm(&mut self) {
        let (shm, cx) = self.shm_round();
        shm.end(&cx).await
    }

    fn set_remote(&mut self, mem: MemInfo) {
        let mut map = self.remote.write().expect("remote regions poisoned");
        map.clear();
        for r in mem.regions {
            map.insert(r.id, r);
        }
        drop(map);
        if let Some(p) = &self.shm.peer {
            p.announce(self.remote_lengths());
        }
    }

    /// The lengths of the peer's regions, as its latest `MemInfo` announced them.
    fn remote_lengths(&self) -> Vec<(RegionId, u64)> {
        let map = self.remote.read().expect("remote regions poisoned");
        map.values().map(|r| (r.id, r.len)).collect()
    }

    fn on_established(&mut self, est: Established) {
        self.set_remote(est.regions);
        self.established = true;
        self.peer_name = est.peer_id.to_string();
        tracing::debug!(target: TIMELINE, session = self.id, peer = %self.peer_name,
            "established");
        let data = self
            .data
            .as_ref()
            .expect("established implies bound")
            .path
            .clone();
        let handle = PeerHandle {
            peer_id: est.peer_id,
            incarnation: est.incarnation,
            data,
            remote: self.remote.clone(),
            shm: self.shm.peer.clone(),
        };
        // The channel learns of the session once its UCX negotiation settled.
        #[cfg(feature = "ucx")]
        let Some(handle) = self.ucx.hold_up(handle) else {
            return;
        };
        tracing::debug!(target: TIMELINE, session = self.id, peer = %self.peer_name, "up");
        let _ = self.env.core.send(CoreCmd::SessionUp {
            id: self.id,
            handle,
        });
        #[cfg(feature = "ucx")]
        if let Machine::Listen(m) = &self.machine {
            let step = self.env.config.deadlines.handshake_step;
            self.ucx.established(m.peer_takes_ucx(), step);
        }
    }

    /// Rollback: tell the peer, stop the data tasks, fail waiting batches, report to the
    /// core. After this nothing of the session is left anywhere.
    async fn teardown(mut self, err: Error) {
        tracing::debug!(peer = %self.peer_name, error = %err, "session ends");
        self.refuse_late_connections();
        // The machine already queued a Reject for its own failures; for the others say Bye.
        let tell_peer = !matches!(
            err,
            Error::ConnectionLost { .. }
                | Error::Rejected { .. }
                | Error::PeerClosed { .. }
                | Error::PeerMisbehaved { .. }
        );
        if tell_peer {
            self.machine.close(err.code(), err.to_string());
            while let Some(o) = self.machine.poll_output() {
                if let Output::Send(m) = o {
                    let _ = self.send(&m).await;
                }
            }
        }
        if let Some(h) = self.data_connect.take() {
            h.abort();
        }
        #[cfg(feature = "ucx")]
        {
            let round = ucx::Round {
                peer: &self.peer_name,
                session: self.id,
                peer_id: self.peer_id.as_ref(),
                table: &self.env.table,
                data: None,
                op: self.env.config.deadlines.op,
            };
            let close = self.env.config.deadlines.close;
            self.ucx.close(&round, close).await;
        }
        if let Some(mut d) = self.data.take() {
            let peer_closing = match &err {
                Error::PeerClosed { .. } => true,
                Error::Rejected { code, .. } => *code == ErrorCode::ShuttingDown,
                _ => false,
            };
            if peer_closing {
                // The peer is closing (it said Bye, or refused a connection because it is
                // closing) and flushes and closes its data connections: what it wrote there
                // before (confirmations of our notifications and writes) is still on its
                // way. The readers read it to the end, within PEER_FLUSH_GRACE, before
                // waiting batches learn the outcome.
                let until = Instant::now() + PEER_FLUSH_GRACE;
                for c in d.conns.iter_mut() {
                    if !c.reader.is_finished() {
                        let _ = tokio::time::timeout_at(until, &mut c.reader).await;
                    }
                }
            }
            // Let the writers flush what is queued (an error ack for the peer), briefly.
            for c in &d.conns {
                c.out.try_send(Outgoing::Shutdown);
            }
            let flush_until = Instant::now() + WRITER_FLUSH;
            let mut flushed = Vec::with_capacity(d.conns.len());
            for c in d.conns.iter_mut() {
                // A handle that already returned its result in `serve` must not be polled
                // again; `is_finished` covers it.
                flushed.push(
                    c.writer.is_finished()
                        || tokio::time::timeout_at(flush_until, &mut c.writer)
                            .await
                            .is_ok(),
                );
            }
            // Stop every connection before waiting for any: threads cannot be aborted, so
            // they stop at their next await, and a socket shutdown unblocks a system call.
            let stops: Vec<Option<ThreadStop>> =
                d.conns.iter_mut().map(|c| c.threads.take()).collect();
            let on_threads: Vec<bool> = stops.iter().map(Option::is_some).collect();
            drop(stops);
            for ((c, flushed), on_threads) in d.conns.into_iter().zip(flushed).zip(on_threads) {
                let (writer, mut reader) = (c.writer, c.reader);
                if on_threads {
                    if !flushed {
                        let _ = writer.await;
                    }
                    if !reader.is_finished() {
                        let _ = (&mut reader).await;
                    }
                } else {
                    if !flushed {
                        writer.abort();
                        let _ = writer.await;
                    }
                    reader.abort();
                    if !reader.is_finished() {
                        let _ = reader.await;
                    }
                }
            }
            self.end_shm().await;
            // The directory forgets the session before its waiting batches learn the
            // outcome: a caller that sees its batch fail and then looks at the channel finds
            // nothing of the session left (the core handles messages in order).
            let _ = self.env.core.send(CoreCmd::SessionDown {
                id: self.id,
                error: err.clone(),
            });
            d.path.drain(&err);
        } else {
            self.end_shm().await;
            let _ = self.env.core.send(CoreCmd::SessionDown {
                id: self.id,
                error: err,
            });
        }
        self.ctl_reader.abort();
    }
}

impl Session {
    /// From here on the session serves no new connection: its command queue is closed (the
    /// core then refuses what it would route here), and every data connection queued or
    /// parked but not bound gets a typed refusal instead of a silent close at the end of a
    /// teardown that may take the close deadline.
    fn refuse_late_connections(&mut self) {
        const WHY: &str = "the session for this token has ended";
        self.cmds.close();
        let mut late: Vec<Stream> = Vec::new();
        while let Ok(c) = self.cmds.try_recv() {
            match c {
                SessionCmd::DataConn(s, _, _) | SessionCmd::DataProven(s, _) => late.push(s),
                // Never bound: nothing of ours was mapped through it.
                SessionCmd::ShmConn(s, _) => drop(s),
                _ => {}
            }
        }
        for h in self.proving.drain(..) {
            h.abort();
        }
        late.extend(
            std::mem::take(&mut self.unproven)
                .into_iter()
                .map(|(_, s)| s),
        );
        late.extend(self.parked_data.take());
        late.extend(
            std::mem::take(&mut self.parked_extra)
                .into_iter()
                .map(|(_, s)| s),
        );
        if let Some((_, streams)) = self.pending_bind.take() {
            late.extend(streams);
        }
        for s in late {
            tokio::spawn(refuse(s, ErrorCode::UnknownSession, WHY));
        }
    }
}

async fn recv_opt<T>(rx: Option<&mut mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Resolves once the watched flag is set, or its sender is gone.
async fn synced(w: Option<&mut tokio::sync::watch::Receiver<bool>>) {
    match w {
        Some(w) => {
            let _ = w.wait_for(|s| *s).await;
        }
        None => std::future::pending().await,
    }
}

/// How long a session's teardown lets its data writers flush what is queued.
const WRITER_FLUSH: Duration = Duration::from_millis(200);

/// How long a session whose peer said `Bye` waits for its data connections to end, so that
/// what the peer wrote there before its `Bye` is read: longer than the peer's own flush of its
/// writers ([`WRITER_FLUSH`]).
const PEER_FLUSH_GRACE: Duration = Duration::from_millis(300);

/// How long a session whose data connection ended waits for the peer's `Bye` or `Reject`
/// on the control connection ([`Session::peer_word_after`]).
const PEER_WORD_GRACE: Duration = Duration::from_millis(100);

fn flatten(peer: &str, r: std::result::Result<Result<()>, tokio::task::JoinError>) -> Error {
    match r {
        Ok(Ok(())) => Error::lost(peer, Step::Established, "data connection ended"),
        Ok(Err(e)) => e,
        Err(e) => Error::lost(peer, Step::Established, e),
    }
}

/// Answers a connection we will not serve with a typed refusal, then drops it.
pub(crate) async fn refuse(s: Stream, code: ErrorCode, message: &str) {
    let (_r, mut w) = s.into_split();
    let m = Message::Reject(kvbridge_proto::msg::Reject {
        code,
        message: message.to_string(),
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), write_msg(&mut w, &m)).await;
}

/// [`refuse`] for a connection whose first bytes were not read whole (a TLS ClientHello on a
/// plaintext listener): after the refusal, reads and drops what the peer sent until it
/// closes (1 s at most, 64 KiB at most), so that the close is not a reset that overtakes the
/// refusal.
pub(crate) async fn refuse_lingering(s: Stream, code: ErrorCode, message: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut r, mut w) = s.into_split();
    let m = Message::Reject(kvbridge_proto::msg::Reject {
        code,
        message: message.to_string(),
    });
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        write_msg(&mut w, &m).await?;
        w.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut left = 64usize << 10;
        while left > 0 {
            match r.read(&mut sink).await? {
                0 => break,
                n => left = left.saturating_sub(n),
            }
        }
        std::io::Result::Ok(())
    })
    .await;
}
