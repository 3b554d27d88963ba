//! The peer handshake, as two sans-IO state machines.
//!
//! ```text
//! initiator                                  listener (one session per peer id)
//! Hello{version, peer_id, incarnation,  ---> ListenerSession::accept: check version, compat
//!       compat, auth}
//!                                       <--- Welcome{peer_id, incarnation, token, compat}
//!                                            | Reject{code, message}
//! Proof (with a secret)                 ---> checked before anything is granted
//!                                       <--- HostOffer (with a secret: the shared-memory
//!                                            offer, told only to a peer that proved itself)
//! MemInfo{regions granted to listener}  ---> held until the data connection is bound
//! data connection: DataHello{token}     ---> driver binds it, calls data_bound()
//!                                       <--- MemInfo{regions granted to initiator}
//!                                       <--- Ready
//! ```
//!
//! The initiator sends its `MemInfo` as soon as it has the `Welcome`, without waiting for its
//! data connection: that is the seed's ordering, and the listener must survive it. Both
//! machines *hold* a data-path message that arrives before their own side's data connection
//! is bound, and replay it once [`ListenerSession::data_bound`] / [`Initiator::data_bound`]
//! is called. No message is ever answered from a state that cannot serve it: it is held, or
//! refused with a typed [`Reject`].
//!
//! Every state has a deadline ([`Initiator::poll_timeout`]); the driver calls
//! `handle_timeout(now)` when it passes. A failed machine emits exactly one `Failed` output
//! and nothing after it; the driver then drops all state of that session (rollback).

use crate::auth::{self, DataKey, Keyring, Role, Secret, CHALLENGE_LEN};
use crate::frame::PROTOCOL_VERSION;
use crate::ids::{Blob, Incarnation, PeerId, SessionToken};
use crate::msg::{
    Auth, Compat, ErrorCode, Hello, HostOffer, MemInfo, Message, Ping, Ready, Reject, ShmOffer,
    Welcome,
};
use std::collections::VecDeque;
use std::fmt;
use std::time::{Duration, Instant};
use thiserror::Error;

/// Most data-path messages a session holds while its data connection is not bound yet. A
/// correct peer sends one `MemInfo` (and the listener a `Ready`); more is misbehaviour.
pub const MAX_HELD: usize = 8;

/// Who we are, as the handshake states it.
#[derive(Debug, Clone)]
pub struct LocalIdentity {
    /// Our peer id.
    pub peer_id: PeerId,
    /// Our incarnation.
    pub incarnation: Incarnation,
    /// What the other side must match.
    pub compat: Compat,
    /// Shared secret; when set, the peer must prove it knows it (and so must we). An
    /// initiator proves itself with it unless its own key ([`Self::peer_key`]) is what the
    /// listener proves.
    pub secret: Option<Secret>,
    /// (Listener) Per-peer keys: a peer claiming an id of the ring must prove that id's
    /// key, not the shared secret ([`Keyring`]). Set, the listener always requires
    /// authentication.
    pub peer_keys: Option<Keyring>,
    /// (Initiator) This side's own key: the one a listener's keyring lists for our
    /// `peer_id`. A listener proves itself first, with the key it will require of us; we
    /// answer with our own key when that proof checks out under it, else with the shared
    /// secret (a listener that does not bind our id). Our listener never uses it: it
    /// accepts the shared secret (and its keyring) from others, so holding a key of our
    /// own does not change what our dialers must hold.
    pub peer_key: Option<Secret>,
}

impl LocalIdentity {
    /// Whether a listener with this identity requires peers to authenticate.
    pub fn authenticates(&self) -> bool {
        self.secret.is_some() || self.peer_keys.is_some()
    }

    /// The keys an initiator with this identity may prove, in the order it tries the
    /// listener's proof under them: its own key first, then the shared secret.
    fn dial_keys(&self) -> impl Iterator<Item = &Secret> {
        self.peer_key.iter().chain(self.secret.iter())
    }

    /// The key a peer claiming `claimed` must prove (`None`: no authentication).
    fn key_for(&self, claimed: &PeerId) -> Option<Secret> {
        match &self.peer_keys {
            Some(ring) => Some(ring.key_for(claimed, self.secret.as_ref())),
            None => self.secret.clone(),
        }
    }
}

/// The steps of the handshake, named in errors. New steps may be added: match with a
/// wildcard arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Step {
    /// Opening the control connection.
    Connect,
    /// The TLS handshake on the control connection (only when TLS is on; it runs below the
    /// protocol, before `Hello`).
    Tls,
    /// Waiting for the initiator's `Hello`.
    Hello,
    /// Waiting for the listener's `Welcome`.
    Welcome,
    /// Opening and binding the data connection.
    DataBind,
    /// Exchanging memory information.
    MemInfo,
    /// Waiting for the listener's `Ready`.
    Ready,
    /// The session is established.
    Established,
    /// A batch of writes.
    Write,
    /// A batch of reads.
    Read,
    /// A notification.
    Notify,
    /// Closing the session.
    Close,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Step::Connect => "connect",
            Step::Tls => "tls-handshake",
            Step::Hello => "hello",
            Step::Welcome => "welcome",
            Step::DataBind => "data-bind",
            Step::MemInfo => "mem-info",
            Step::Ready => "ready",
            Step::Established => "established",
            Step::Write => "write",
            Step::Read => "read",
            Step::Notify => "notify",
            Step::Close => "close",
        };
        f.write_str(s)
    }
}

/// Why a handshake (or an established session's control stream) failed.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum HandshakeError {
    /// The peer refused with a typed reason.
    #[error("peer rejected at step {step}: {code}: {message}")]
    Rejected {
        /// Where it happened.
        step: Step,
        /// The peer's code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
    /// Protocol versions differ.
    #[error("protocol version mismatch: ours {ours}, theirs {theirs}")]
    VersionMismatch {
        /// Our version.
        ours: u8,
        /// Theirs.
        theirs: u8,
    },
    /// Compatibility hashes differ.
    #[error("incompatible peers: ours {ours}, theirs {theirs}")]
    Incompatible {
        /// Our values.
        ours: Compat,
        /// Theirs.
        theirs: Compat,
    },
    /// The peer sent a message its state cannot explain.
    #[error("unexpected {got} at step {step}")]
    Unexpected {
        /// Where it happened.
        step: Step,
        /// Name of the message received.
        got: &'static str,
    },
    /// The peer sent something invalid (bad id, too many held messages, ...).
    #[error("malformed input at step {step}: {detail}")]
    Malformed {
        /// Where it happened.
        step: Step,
        /// What was wrong.
        detail: String,
    },
    /// The peer did not prove it knows the shared secret (or we require it and it did not
    /// try, or it requires it and we have none).
    #[error("authentication failed at step {step}: {detail}")]
    Unauthenticated {
        /// Where.
        step: Step,
        /// What.
        detail: String,
    },
    /// A step passed its deadline.
    #[error("step {step} passed its deadline of {after:?}")]
    Timeout {
        /// The step that did not finish.
        step: Step,
        /// The deadline that passed.
        after: Duration,
    },
    /// The peer closed the established session.
    #[error("peer closed the session: {code}: {message}")]
    Closed {
        /// The peer's code.
        code: ErrorCode,
        /// The peer's message.
        message: String,
    },
}

impl HandshakeError {
    /// The wire code that tells the peer about this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            HandshakeError::Rejected { code, .. } | HandshakeError::Closed { code, .. } => *code,
            HandshakeError::VersionMismatch { .. } => ErrorCode::UnsupportedVersion,
            HandshakeError::Incompatible { .. } => ErrorCode::Incompatible,
            HandshakeError::Unexpected { .. } => ErrorCode::UnexpectedMessage,
            HandshakeError::Malformed { .. } => ErrorCode::Malformed,
            HandshakeError::Unauthenticated { .. } => ErrorCode::Unauthenticated,
            HandshakeError::Timeout { .. } => ErrorCode::Timeout,
        }
    }

    fn to_reject(&self) -> Reject {
        Reject {
            code: self.code(),
            message: self.to_string(),
        }
    }
}

/// What the established peer is, as the handshake learnt it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Established {
    /// The peer's id.
    pub peer_id: PeerId,
    /// The peer's incarnation.
    pub incarnation: Incarnation,
    /// The regions the peer granted to us.
    pub regions: MemInfo,
}

/// What a state machine asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send this message on the control connection.
    Send(Message),
    /// (Initiator) The listener welcomed us: open the data connection with this token, and
    /// call [`Initiator::provide_mem_info`] with the regions granted to `peer_id`.
    Welcomed {
        /// The listener's id.
        peer_id: PeerId,
        /// The listener's incarnation.
        incarnation: Incarnation,
        /// Token to present on the data connection.
        token: SessionToken,
        /// The listener's shared-memory offer, if it made one.
        shm: Option<ShmOffer>,
        /// The listener honours unacknowledged notifications ([`Welcome::unacked_notify`]).
        unacked_notify: bool,
        /// The session's data-connection key, when the listener challenges every data
        /// connection ([`Welcome::data_proof`]): answer its `DataChallenge` with it.
        data_key: Option<DataKey>,
    },
    /// The session is established.
    Ready(Established),
    /// (Established) The peer changed the regions it grants us.
    PeerMemInfo(MemInfo),
    /// The handshake or session failed; tear everything down. Nothing follows this.
    Failed(HandshakeError),
}

/// Common part of both machines: deadline, output queue, held messages.
#[derive(Debug, Clone)]
struct Core {
    step_timeout: Duration,
    deadline: Option<Instant>,
    out: VecDeque<Output>,
    held: VecDeque<Message>,
    failed: bool,
}

impl Core {
    fn new(step_timeout: Duration, now: Instant) -> Self {
        Self {
            step_timeout,
            deadline: Some(now + step_timeout),
            out: VecDeque::new(),
            held: VecDeque::new(),
            failed: false,
        }
    }

    fn arm(&mut self, now: Instant) {
        self.deadline = Some(now + self.step_timeout);
    }

    fn send(&mut self, m: Message) {
        self.out.push_back(Output::Send(m));
    }

    /// Fails the machine: tells the peer why (unless the peer is the one that refused or
    /// closed) and emits the single `Failed` output.
    fn fail(&mut self, err: HandshakeError) {
        if self.failed {
            return;
        }
        if !matches!(
            err,
            HandshakeError::Rejected { .. } | HandshakeError::Closed { .. }
        ) {
            self.send(Message::Reject(err.to_reject()));
        }
        self.failed = true;
        self.deadline = None;
        self.held.clear();
        self.out.push_back(Output::Failed(err));
    }

    /// Ends the machine from our side with a `Bye`; false when it had already ended.
    fn close(&mut self, code: ErrorCode, message: String) -> bool {
        if self.failed {
            return false;
        }
        self.send(Message::Bye(Reject { code, message }));
        self.failed = true;
        self.deadline = None;
        true
    }

    fn hold(&mut self, m: Message, step: Step) {
        if self.held.len() >= MAX_HELD {
            self.fail(HandshakeError::Malformed {
                step,
                detail: format!(
                    "more than {MAX_HELD} messages before the data connection was bound"
                ),
            });
        } else {
            self.held.push_back(m);
        }
    }

    fn check_timeout(&mut self, now: Instant, step: Step) {
        if let Some(d) = self.deadline {
            if now >= d && !self.failed {
                let after = self.step_timeout;
                self.fail(HandshakeError::Timeout { step, after });
            }
        }
    }
}

/// Handles the messages that mean the same in every state: liveness and refusals. Returns the
/// message back when it is not one of those.
fn common(core: &mut Core, m: Message, step: Step) -> Option<Message> {
    match m {
        Message::Ping(p) => {
            core.send(Message::Pong(p));
            None
        }
        Message::Pong(_) => None,
        Message::Reject(r) => {
            core.fail(HandshakeError::Rejected {
                step,
                code: r.code,
                message: r.message,
            });
            None
        }
        Message::Bye(r) => {
            core.fail(HandshakeError::Closed {
                code: r.code,
                message: r.message,
            });
            None
        }
        other => Some(other),
    }
}

fn unexpected(core: &mut Core, step: Step, m: &Message) {
    core.fail(HandshakeError::Unexpected {
        step,
        got: m.name(),
    });
}

fn check_peer(
    local: &LocalIdentity,
    version: u8,
    compat: &Compat,
    peer_id: &PeerId,
    step: Step,
) -> Result<(), HandshakeError> {
    if version != PROTOCOL_VERSION {
        return Err(HandshakeError::VersionMismatch {
            ours: PROTOCOL_VERSION,
            theirs: version,
        });
    }
    if !peer_id.is_valid() {
        return Err(HandshakeError::Malformed {
            step,
            detail: "invalid peer id".into(),
        });
    }
    if compat.hash != local.compat.hash {
        return Err(HandshakeError::Incompatible {
            ours: local.compat.clone(),
            theirs: compat.clone(),
        });
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InitState {
    AwaitWelcome,
    /// Proof sent; the listener's `HostOffer` follows (`Welcome::host_after_proof`).
    AwaitHost,
    AwaitLocalMem,
    AwaitReady,
    Established,
    Done,
}

/// The initiator's side of a session (the side that calls `connect`).
#[derive(Debug, Clone)]
pub struct Initiator {
    local: LocalIdentity,
    challenge: [u8; CHALLENGE_LEN],
    core: Core,
    state: InitState,
    bound: bool,
    peer: Option<(PeerId, Incarnation)>,
    peer_mem: Option<MemInfo>,
    /// Our regions changed after our `MemInfo` went out and before the session was
    /// established: the newest list, sent as soon as it is.
    mem_update: Option<MemInfo>,
    /// (AwaitHost) What the `Welcome` said, announced once the `HostOffer` came:
    /// (token, the listener honours unacknowledged notifications).
    welcomed: Option<(SessionToken, bool)>,
    /// The session's data-connection key, once the listener proved itself and said it
    /// challenges data connections.
    data_key: Option<DataKey>,
    /// What our `Hello` and the listener's `Welcome` said about UCX.
    ucx: UcxWelcome,
    /// The listener's `Welcome` said it honours grant tokens ([`Welcome::grant_tokens`]).
    grant_tokens: bool,
}

/// An initiator's UCX as its `Hello` and the listener's `Welcome` said it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UcxWelcome {
    /// Our `Hello` did not ask for it.
    NotAsked,
    /// Asked; no `Welcome` yet, or one that offers none.
    Asked,
    /// Asked, and the `Welcome` said an offer follows.
    Offered,
}

impl Initiator {
    /// Starts a handshake: the first output is the `Hello` to send. `challenge` must be
    /// fresh random bytes (used when the identity has a secret).
    pub fn new(
        local: LocalIdentity,
        step_timeout: Duration,
        now: Instant,
        challenge: [u8; CHALLENGE_LEN],
    ) -> Self {
        Self::declaring(local, step_timeout, now, challenge, 0)
    }

    /// [`Initiator::new`], declaring in the `Hello` how many data connections it will open
    /// (0: not said); the listener refuses any beyond them.
    pub fn declaring(
        local: LocalIdentity,
        step_timeout: Duration,
        now: Instant,
        challenge: [u8; CHALLENGE_LEN],
        data_connections: u32,
    ) -> Self {
        let mut core = Core::new(step_timeout, now);
        core.send(Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            peer_id: local.peer_id.clone(),
            incarnation: local.incarnation,
            compat: local.compat.clone(),
            auth: local.dial_keys().next().map(|_| Auth {
                challenge: Some(Blob(challenge.to_vec())),
                response: None,
            }),
            unacked_notify: true,
            host_after_proof: true,
            // Only a key gives a data key to answer with.
            data_proof: local.dial_keys().next().is_some(),
            data_connections,
            ucx: false,
            grant_tokens: true,
        }));
        Self {
            local,
            challenge,
            core,
            state: InitState::AwaitWelcome,
            bound: false,
            peer: None,
            peer_mem: None,
            mem_update: None,
            welcomed: None,
            data_key: None,
            ucx: UcxWelcome::NotAsked,
            grant_tokens: false,
        }
    }

    /// Says in the `Hello` that this initiator takes a UCX offer once the session is
    /// established ([`Hello::ucx`]). Call it right after construction, before the first
    /// output is polled; later it changes nothing.
    pub fn with_ucx(mut self) -> Self {
        self.ucx = UcxWelcome::Asked;
        for o in self.core.out.iter_mut() {
            if let Output::Send(Message::Hello(h)) = o {
                h.ucx = true;
            }
        }
        self
    }

    /// Whether the listener's `Welcome` said a UCX offer follows the session's establishment
    /// ([`Welcome::ucx`]; only when our `Hello` asked for one).
    pub fn peer_offers_ucx(&self) -> bool {
        self.ucx == UcxWelcome::Offered
    }

    /// Whether the listener's `Welcome` said it honours grant tokens on our batches
    /// ([`Welcome::grant_tokens`]); `false` before the `Welcome` and from older listeners.
    pub fn peer_grant_tokens(&self) -> bool {
        self.grant_tokens
    }

    /// The step the handshake is waiting on.
    pub fn step(&self) -> Step {
        match self.state {
            InitState::AwaitWelcome | InitState::AwaitHost => Step::Welcome,
            InitState::AwaitLocalMem => Step::MemInfo,
            InitState::AwaitReady if !self.bound => Step::DataBind,
            InitState::AwaitReady if self.peer_mem.is_none() => Step::MemInfo,
            InitState::AwaitReady => Step::Ready,
            InitState::Established | InitState::Done => Step::Established,
        }
    }

    /// Whether the session is established.
    pub fn is_established(&self) -> bool {
        self.state == InitState::Established && !self.core.failed
    }

    /// The driver's answer to [`Output::Welcomed`]: the regions we grant the listener. Our
    /// `MemInfo` goes out at once, before our data connection exists (the seed's ordering).
    pub fn provide_mem_info(&mut self, mem: MemInfo, now: Instant) {
        if self.core.failed {
            return;
        }
        match self.state {
            InitState::AwaitLocalMem => {
                self.core.send(Message::MemInfo(mem));
                self.state = InitState::AwaitReady;
                self.core.arm(now);
                self.replay(now);
            }
            InitState::Established => self.core.send(Message::MemInfo(mem)),
            // Our list already went out: a change now must not be lost (a region registered
            // during the handshake would stay unknown to the peer until the next change).
            InitState::AwaitReady => self.mem_update = Some(mem),
            // Before: the driver is asked for the list (AwaitLocalMem) and reads it then.
            // After: the session is over.
            InitState::AwaitWelcome | InitState::AwaitHost | InitState::Done => {}
        }
    }

    /// The driver opened the data connection and bound it to this session.
    pub fn data_bound(&mut self, now: Instant) {
        if self.core.failed || self.bound {
            return;
        }
        self.bound = true;
        self.core.arm(now);
        self.replay(now);
    }

    fn replay(&mut self, now: Instant) {
        if self.state != InitState::AwaitReady || !self.bound {
            return;
        }
        while let Some(m) = self.core.held.pop_front() {
            self.handle_message(m, now);
            if self.core.failed {
                return;
            }
        }
    }

    /// A message arrived on the control connection.
    pub fn handle_message(&mut self, m: Message, now: Instant) {
        if self.core.failed {
            return;
        }
        let step = self.step();
        let Some(m) = common(&mut self.core, m, step) else {
            return;
        };
        match (self.state, m) {
            (InitState::AwaitWelcome, Message::Welcome(w)) => self.on_welcome(w, now),
            (InitState::AwaitHost, Message::HostOffer(h)) => {
                let (token, unacked_notify) = self.welcomed.take().expect("set with AwaitHost");
                self.welcome_done(token, h.shm, unacked_notify, now);
            }
            (InitState::AwaitLocalMem, m @ (Message::MemInfo(_) | Message::Ready(_))) => {
                self.core.hold(m, step)
            }
            (InitState::AwaitReady, m @ (Message::MemInfo(_) | Message::Ready(_)))
                if !self.bound =>
            {
                self.core.hold(m, step)
            }
            (InitState::AwaitReady, Message::MemInfo(mem)) => {
                self.peer_mem = Some(mem);
                self.core.arm(now);
            }
            (InitState::AwaitReady, Message::Ready(Ready {})) => match self.peer_mem.take() {
                Some(regions) => {
                    let (peer_id, incarnation) = self.peer.clone().expect("set by Welcome");
                    self.state = InitState::Established;
                    self.core.deadline = None;
                    self.core.out.push_back(Output::Ready(Established {
                        peer_id,
                        incarnation,
                        regions,
                    }));
                    if let Some(mem) = self.mem_update.take() {
                        self.core.send(Message::MemInfo(mem));
                    }
                }
                None => unexpected(&mut self.core, step, &Message::Ready(Ready {})),
            },
            (InitState::Established, Message::MemInfo(mem)) => {
                self.core.out.push_back(Output::PeerMemInfo(mem))
            }
            (_, m) => unexpected(&mut self.core, step, &m),
        }
    }

    fn on_welcome(&mut self, w: Welcome, now: Instant) {
        if let Err(e) = check_peer(&self.local, w.version, &w.compat, &w.peer_id, Step::Welcome) {
            self.core.fail(e);
            return;
        }
        if self.local.dial_keys().next().is_some() {
            // The listener proves itself first; only then do we prove ourselves, and only
            // then does anything of ours (memory, data connection) go to it.
            let unauth = |detail: &str| HandshakeError::Unauthenticated {
                step: Step::Welcome,
                detail: detail.to_string(),
            };
            let Some(Auth {
                challenge: Some(cl),
                response: Some(proof),
            }) = &w.auth
            else {
                self.core.fail(unauth(
                    "the listener does not authenticate, and we require it",
                ));
                return;
            };
            if cl.0.len() != CHALLENGE_LEN {
                self.core
                    .fail(unauth("the listener's challenge has the wrong length"));
                return;
            }
            let me = &self.local.peer_id;
            // The key the listener proved is the one it checks our proof against: our own
            // when its keyring binds our id, else the shared secret. Answering with any
            // other could never pass, and says nothing a proof under it would not.
            let Some(key) = self.local.dial_keys().find(|k| {
                auth::verify(
                    k,
                    Role::Listener,
                    &self.challenge,
                    &cl.0,
                    me,
                    &w.peer_id,
                    &proof.0,
                )
            }) else {
                self.core
                    .fail(unauth(match (&self.local.peer_key, &self.local.secret) {
                        (Some(_), Some(_)) => {
                            "the listener could not prove it knows our own key (peer_key) or \
                             the shared secret"
                        }
                        (Some(_), None) => {
                            "the listener could not prove it knows our own key (peer_key)"
                        }
                        _ => "the listener could not prove it knows the shared secret",
                    }));
                return;
            };
            let mine = auth::prove(key, Role::Initiator, &self.challenge, &cl.0, me, &w.peer_id);
            if w.data_proof {
                self.data_key = Some(auth::data_key(key, &self.challenge, &cl.0, me, &w.peer_id));
            }
            self.core.send(Message::Proof(Auth {
                challenge: None,
                response: Some(Blob(mine)),
            }));
        }
        self.peer = Some((w.peer_id.clone(), w.incarnation));
        self.grant_tokens = w.grant_tokens;
        if w.ucx && self.ucx == UcxWelcome::Asked {
            self.ucx = UcxWelcome::Offered;
        }
        if w.host_after_proof {
            // The listener tells only an authenticated peer about its host.
            self.welcomed = Some((w.token, w.unacked_notify));
            self.state = InitState::AwaitHost;
            self.core.arm(now);
            return;
        }
        self.welcome_done(w.token, w.shm, w.unacked_notify, now);
    }

    /// The listener's welcome is complete (with its host offer, if one came after our
    /// proof): the driver opens the data connection.
    fn welcome_done(
        &mut self,
        token: SessionToken,
        shm: Option<ShmOffer>,
        unacked_notify: bool,
        now: Instant,
    ) {
        let (peer_id, incarnation) = self.peer.clone().expect("set by Welcome");
        self.state = InitState::AwaitLocalMem;
        self.core.arm(now);
        self.core.out.push_back(Output::Welcomed {
            peer_id,
            incarnation,
            token,
            shm,
            unacked_notify,
            data_key: self.data_key.clone(),
        });
    }

    /// Ends the session from our side with a reason for the peer.
    pub fn close(&mut self, code: ErrorCode, message: String) {
        if self.core.close(code, message) {
            self.state = InitState::Done;
        }
    }
}

// ------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ListenState {
    AwaitMem,
    Established,
    Done,
}

/// The listener's side of one session, created when a `Hello` arrives.
#[derive(Debug, Clone)]
pub struct ListenerSession {
    core: Core,
    state: ListenState,
    bound: bool,
    /// Set when no secret is configured, or once the initiator's proof checked out. Until
    /// then the peer is granted nothing and its data connection is not bound.
    authenticated: bool,
    /// (initiator challenge, our challenge, our id), kept to check the initiator's proof.
    auth: Option<(Secret, Vec<u8>, [u8; CHALLENGE_LEN], PeerId)>,
    peer_id: PeerId,
    incarnation: Incarnation,
    /// The initiator honours unacknowledged notifications.
    unacked_notify: bool,
    granted: MemInfo,
    /// The `HostOffer` to send once the initiator's proof checks out (a listener with a
    /// secret says nothing about its host before that).
    host_offer: Option<HostOffer>,
    /// A keyring is configured: failures do not say which key was tried.
    keyed: bool,
    /// The session's data-connection key, once the initiator's proof checked out (with a
    /// secret): every data connection must answer a challenge with it.
    data_key: Option<DataKey>,
    /// Data connections the initiator declared (0: not said).
    data_connections: u32,
    /// The initiator takes a UCX offer ([`Hello::ucx`]).
    ucx: bool,
    /// The initiator honours grant tokens on our batches ([`Hello::grant_tokens`]).
    grant_tokens: bool,
}

impl ListenerSession {
    /// Answers a `Hello`: the first output is a `Welcome` carrying `token`, or a `Reject`
    /// followed by `Failed` when the peer is incompatible. `granted` is what this listener
    /// grants to the hello's peer id.
    /// `challenge` must be fresh random bytes (used when the identity has a secret).
    pub fn accept(
        hello: Hello,
        local: &LocalIdentity,
        token: SessionToken,
        granted: MemInfo,
        step_timeout: Duration,
        now: Instant,
        challenge: [u8; CHALLENGE_LEN],
    ) -> Self {
        Self::accept_with_shm(
            hello,
            local,
            token,
            granted,
            step_timeout,
            now,
            challenge,
            None,
        )
    }

    /// [`ListenerSession::accept`], with a shared-memory offer carried in the `Welcome`.
    #[allow(clippy::too_many_arguments)]
    pub fn accept_with_shm(
        hello: Hello,
        local: &LocalIdentity,
        token: SessionToken,
        granted: MemInfo,
        step_timeout: Duration,
        now: Instant,
        challenge: [u8; CHALLENGE_LEN],
        shm: Option<ShmOffer>,
    ) -> Self {
        let mut core = Core::new(step_timeout, now);
        let mut auth_state = None;
        let key = local.key_for(&hello.peer_id);
        // With a secret the offer (host identity, pid, socket name) waits for the proof; an
        // initiator that cannot take it then (an older one) gets none.
        let (shm, host_offer) = match (&key, hello.host_after_proof) {
            (None, _) => (shm, None),
            (Some(_), true) => (None, Some(HostOffer { shm })),
            (Some(_), false) => (None, None),
        };
        let checked = check_peer(
            local,
            hello.version,
            &hello.compat,
            &hello.peer_id,
            Step::Hello,
        )
        .and_then(|()| match &key {
            None => Ok(None),
            Some(secret) => match &hello.auth {
                Some(Auth {
                    challenge: Some(ci),
                    ..
                }) if ci.0.len() == CHALLENGE_LEN => {
                    let proof = auth::prove(
                        secret,
                        Role::Listener,
                        &ci.0,
                        &challenge,
                        &hello.peer_id,
                        &local.peer_id,
                    );
                    auth_state = Some((
                        secret.clone(),
                        ci.0.clone(),
                        challenge,
                        local.peer_id.clone(),
                    ));
                    Ok(Some(Auth {
                        challenge: Some(Blob(challenge.to_vec())),
                        response: Some(Blob(proof)),
                    }))
                }
                _ => Err(HandshakeError::Unauthenticated {
                    step: Step::Hello,
                    detail: "this listener requires authentication; the peer sent no challenge"
                        .into(),
                }),
            },
        })
        .and_then(|auth| {
            // Its data connections would be bound by a token seen in the clear: refused.
            if key.is_some() && !hello.data_proof {
                return Err(HandshakeError::Unauthenticated {
                    step: Step::Hello,
                    detail: "this listener authenticates every data connection (data_proof); \
                             the peer predates it: upgrade it"
                        .into(),
                });
            }
            Ok(auth)
        });
        match checked {
            Ok(auth) => core.send(Message::Welcome(Welcome {
                version: PROTOCOL_VERSION,
                peer_id: local.peer_id.clone(),
                incarnation: local.incarnation,
                token,
                compat: local.compat.clone(),
                auth,
                shm,
                unacked_notify: true,
                host_after_proof: host_offer.is_some(),
                data_proof: key.is_some(),
                ucx: false,
                grant_tokens: true,
            })),
            Err(e) => core.fail(e),
        }
        Self {
            core,
            state: ListenState::AwaitMem,
            bound: false,
            authenticated: auth_state.is_none(),
            auth: auth_state,
            peer_id: hello.peer_id,
            incarnation: hello.incarnation,
            unacked_notify: hello.unacked_notify,
            granted,
            host_offer,
            keyed: local.peer_keys.is_some(),
            data_key: None,
            data_connections: hello.data_connections,
            ucx: hello.ucx,
            grant_tokens: hello.grant_tokens,
        }
    }

    /// Whether the initiator honours unacknowledged notifications
    /// ([`Hello::unacked_notify`]).
    pub fn peer_unacked_notify(&self) -> bool {
        self.unacked_notify
    }

    /// The session's data-connection key: `Some` once the initiator proved itself (with a
    /// secret). Each data connection is bound only after it answered a fresh
    /// `DataChallenge` with it.
    pub fn data_key(&self) -> Option<&DataKey> {
        self.data_key.as_ref().filter(|_| self.authenticated)
    }

    /// How many data connections the initiator declared it opens (`None`: it did not say,
    /// as initiators that predate the field).
    pub fn declared_data_connections(&self) -> Option<u32> {
        (self.data_connections > 0).then_some(self.data_connections)
    }

    /// Whether the initiator said it takes a UCX offer once the session is established
    /// ([`Hello::ucx`]); the listener then starts a [`crate::ucx_link::UcxExport`].
    pub fn peer_takes_ucx(&self) -> bool {
        self.ucx
    }

    /// Whether the initiator's `Hello` said it honours grant tokens on our batches
    /// ([`Hello::grant_tokens`]).
    pub fn peer_grant_tokens(&self) -> bool {
        self.grant_tokens
    }

    /// Says in the `Welcome` that this listener (which has a UCX worker) offers UCX once the
    /// session is established ([`Welcome::ucx`]), when the initiator said it takes it. Call it
    /// right after construction, before the first output is polled; later it changes nothing.
    pub fn offering_ucx(mut self) -> Self {
        let takes = self.ucx;
        for o in self.core.out.iter_mut() {
            if let Output::Send(Message::Welcome(w)) = o {
                w.ucx = takes;
            }
        }
        self
    }

    /// The peer this session serves.
    pub fn peer_id(&self) -> &PeerId {
        &self.peer_id
    }

    /// The peer's incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// Whether the driver may bind a data connection now: never before the peer proved
    /// itself, so an unauthenticated peer gets no operation.
    pub fn may_bind(&self) -> bool {
        self.authenticated && !self.core.failed
    }

    /// The step the session is waiting on.
    pub fn step(&self) -> Step {
        match self.state {
            ListenState::AwaitMem if !self.authenticated => Step::Hello,
            ListenState::AwaitMem if !self.bound => Step::DataBind,
            ListenState::AwaitMem => Step::MemInfo,
            ListenState::Established | ListenState::Done => Step::Established,
        }
    }

    /// Whether the session is established.
    pub fn is_established(&self) -> bool {
        self.state == ListenState::Established && !self.core.failed
    }

    /// The driver bound the session's data connection (only once [`Self::may_bind`]).
    /// Held messages are served now.
    pub fn data_bound(&mut self, now: Instant) {
        if self.core.failed || self.bound {
            return;
        }
        if !self.authenticated {
            self.core.fail(HandshakeError::Unauthenticated {
                step: Step::DataBind,
                detail: "data connection bound before the peer authenticated".into(),
            });
            return;
        }
        self.bound = true;
        self.core.arm(now);
        while let Some(m) = self.core.held.pop_front() {
            self.handle_message(m, now);
            if self.core.failed {
                return;
            }
        }
    }

    /// Regions granted to the peer changed after the handshake: tell it.
    pub fn update_mem_info(&mut self, mem: MemInfo) {
        if self.core.failed {
            return;
        }
        if self.state == ListenState::Established {
            self.core.send(Message::MemInfo(mem));
        } else {
            self.granted = mem;
        }
    }

    /// A message arrived on the control connection.
    pub fn handle_message(&mut self, m: Message, now: Instant) {
        if self.core.failed {
            return;
        }
        let step = self.step();
        let Some(m) = common(&mut self.core, m, step) else {
            return;
        };
        match (self.state, m) {
            (ListenState::AwaitMem, Message::Proof(a)) if !self.authenticated => {
                let ok = match (&self.auth, a.response) {
                    (Some((secret, ci, cl, me)), Some(proof)) => {
                        let ok = auth::verify(
                            secret,
                            Role::Initiator,
                            ci,
                            cl,
                            &self.peer_id,
                            me,
                            &proof.0,
                        );
                        if ok {
                            self.data_key = Some(auth::data_key(secret, ci, cl, &self.peer_id, me));
                        }
                        ok
                    }
                    _ => false,
                };
                if ok {
                    self.authenticated = true;
                    self.core.arm(now);
                    if let Some(h) = self.host_offer.take() {
                        self.core.send(Message::HostOffer(h));
                    }
                } else {
                    // With a keyring the same words whether or not the id has a key of
                    // its own: no oracle for which ids the ring holds.
                    let detail = if self.keyed {
                        format!(
                            "the peer could not prove it holds the key of the id it claims ({})",
                            self.peer_id
                        )
                    } else {
                        "the peer could not prove it knows the shared secret".into()
                    };
                    self.core
                        .fail(HandshakeError::Unauthenticated { step, detail });
                }
            }
            (ListenState::AwaitMem, Message::MemInfo(_)) if !self.authenticated => {
                self.core.fail(HandshakeError::Unauthenticated {
                    step,
                    detail: "MemInfo before the peer's proof".into(),
                });
            }
            (ListenState::AwaitMem, m @ Message::MemInfo(_)) if !self.bound => {
                // The seed's race: the peer's memory info beat the binding of its data
                // connection. Hold it; data_bound() serves it.
                self.core.hold(m, step)
            }
            (ListenState::AwaitMem, Message::MemInfo(mem)) => {
                // Ready goes to the driver before the peer hears it, so the driver publishes
                // the session before the peer can use it.
                self.core.out.push_back(Output::Ready(Established {
                    peer_id: self.peer_id.clone(),
                    incarnation: self.incarnation,
                    regions: mem,
                }));
                self.core
                    .send(Message::MemInfo(std::mem::take(&mut self.granted)));
                self.core.send(Message::Ready(Ready {}));
                self.state = ListenState::Established;
                self.core.deadline = None;
                let _ = now;
            }
            (ListenState::Established, Message::MemInfo(mem)) => {
                self.core.out.push_back(Output::PeerMemInfo(mem))
            }
            (_, m) => unexpected(&mut self.core, step, &m),
        }
    }

    /// Ends the session from our side with a reason for the peer.
    pub fn close(&mut self, code: ErrorCode, message: String) {
        if self.core.close(code, message) {
            self.state = ListenState::Done;
        }
    }
}

/// The driver-facing calls both machines share, over their `core` and `step()`.
macro_rules! machine_io {
    ($ty:ident) => {
        impl $ty {
            /// Whether the machine has failed or closed.
            pub fn is_failed(&self) -> bool {
                self.core.failed
            }

            /// Next thing for the driver to do.
            pub fn poll_output(&mut self) -> Option<Output> {
                self.core.out.pop_front()
            }

            #[doc = concat!("When [`", stringify!($ty), "::handle_timeout`] must be called next.")]
            pub fn poll_timeout(&self) -> Option<Instant> {
                self.core.deadline
            }

            /// Time has passed.
            pub fn handle_timeout(&mut self, now: Instant) {
                let step = self.step();
                self.core.check_timeout(now, step);
            }
        }
    };
}

machine_io!(Initiator);
machine_io!(ListenerSession);

/// A liveness probe message.
pub fn ping(nonce: u64) -> Message {
    Message::Ping(Ping { nonce })
}
