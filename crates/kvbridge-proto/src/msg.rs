//! Messages exchanged by kvbridge peers.
//!
//! A frame body is one [`Message`], msgpack-encoded with named fields: a one-entry map from
//! the message name to a map of its fields (`{"Hello": {"version": 1, "peer_id": ...}}`).
//! `docs/protocol.md` lists who sends each message and in which state.

use crate::frame::{FrameError, FrameHeader, FRAME_HEADER_LEN, MAGIC, PROTOCOL_VERSION};
use crate::ids::{Blob, GrantToken, Incarnation, PeerId, RegionId, SessionToken};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Every message of the protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    // ---- control connection ----
    /// Initiator → listener: opens a session.
    Hello(Hello),
    /// Listener → initiator: session accepted; carries the data-connection token.
    Welcome(Welcome),
    /// Either side: a typed refusal; the sender tears the session down after it.
    Reject(Reject),
    /// Either side: the regions this side grants to the peer (full list; sent again whenever
    /// it changes after the handshake).
    MemInfo(MemInfo),
    /// Listener → initiator: data connection bound and memory exchanged; the session is live.
    Ready(Ready),
    /// Either side: orderly close with a reason.
    Bye(Reject),
    /// Initiator → listener, right after `Welcome` when authentication is on: its proof.
    Proof(Auth),
    /// Either side: liveness probe.
    Ping(Ping),
    /// Answer to [`Message::Ping`].
    Pong(Ping),
    /// Listener → initiator, once the initiator's proof checked out: what the listener tells
    /// only an authenticated peer about its host (sent when both said
    /// `host_after_proof` in `Hello` and `Welcome`).
    HostOffer(HostOffer),

    // ---- data connection ----
    /// Initiator → listener, first frame of a data connection.
    DataHello(DataHello),
    /// Listener → initiator, answer to a `DataHello` when the session authenticates its
    /// data connections (`Welcome::data_proof`): a fresh challenge.
    DataChallenge(DataChallenge),
    /// Initiator → listener: the answer to [`Message::DataChallenge`], under the session's
    /// data-connection key ([`crate::auth::DataKey`]).
    DataProof(DataProof),
    /// Write ops; the concatenated payloads of all ops follow the frame, in op order.
    WriteBatch(Batch),
    /// Completion of a [`Message::WriteBatch`].
    WriteAck(Ack),
    /// Read ops.
    ReadBatch(Batch),
    /// Completion of a [`Message::ReadBatch`]; on success the concatenated payloads follow.
    ReadResp(Ack),
    /// A small message for the peer's application, delivered after every write before it.
    Notify(Notify),
    /// Delivery of a [`Message::Notify`].
    NotifyAck(Ack),

    // ---- shared-memory connection (unix socket, same host) ----
    /// Listener → initiator: map this region; its memfd travels with the frame (SCM_RIGHTS).
    ShmMap(ShmRegion),
    /// Listener → initiator: stop every copy into or out of this region and unmap it.
    ShmUnmap(ShmRevoke),
    /// Initiator → listener: the region is unmapped; no copy into it runs or will start.
    ShmUnmapped(ShmRevoke),
    /// Listener → initiator: every region granted so far has been offered (`ShmMap`).
    ShmSync(Ready),
    /// Initiator → listener: asks to copy with cross-memory attach (`process_vm_writev`);
    /// sent only to a listener whose [`ShmOffer::cma`] is set.
    CmaAsk(Ready),
    /// Listener → initiator: the canary to read with `process_vm_readv` (answer to
    /// [`Message::CmaAsk`]).
    CmaProbe(CmaCanary),
    /// Initiator → listener: the canary's bytes as read, or why they could not be.
    CmaProbed(CmaEcho),

    // ---- UCX negotiation (control connection, after the session is established) ----
    /// Listener → initiator: its UCX worker address, sent only to an initiator that said
    /// [`Hello::ucx`] and only once the session is established (so after its proof).
    UcxOffer(UcxAddress),
    /// Initiator → listener: it connected to the offered address and takes keys. (UCX wires
    /// the endpoint up through the listener's worker; the listener needs no address back.)
    UcxAccept(Ready),
    /// Initiator → listener: it will not use UCX in this session (the reason is logged on
    /// both sides); the session goes on over TCP.
    UcxDecline(UcxDecline),
    /// Listener → initiator: a region granted to the initiator, reachable with this remote
    /// key. Sent only after [`Message::UcxAccept`].
    UcxMap(UcxRegion),
    /// Listener → initiator: every region granted so far has been sent (`UcxMap`).
    UcxSync(Ready),
    /// Listener → initiator: stop every operation on this region and drop its remote key.
    UcxUnmap(ShmRevoke),
    /// Initiator → listener: no operation on the region runs or will start; its key is gone.
    UcxUnmapped(ShmRevoke),
}

impl Message {
    /// The message's name, for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "Hello",
            Message::Welcome(_) => "Welcome",
            Message::Reject(_) => "Reject",
            Message::MemInfo(_) => "MemInfo",
            Message::Ready(_) => "Ready",
            Message::Bye(_) => "Bye",
            Message::Proof(_) => "Proof",
            Message::Ping(_) => "Ping",
            Message::Pong(_) => "Pong",
            Message::HostOffer(_) => "HostOffer",
            Message::DataHello(_) => "DataHello",
            Message::DataChallenge(_) => "DataChallenge",
            Message::DataProof(_) => "DataProof",
            Message::WriteBatch(_) => "WriteBatch",
            Message::WriteAck(_) => "WriteAck",
            Message::ReadBatch(_) => "ReadBatch",
            Message::ReadResp(_) => "ReadResp",
            Message::Notify(_) => "Notify",
            Message::NotifyAck(_) => "NotifyAck",
            Message::ShmMap(_) => "ShmMap",
            Message::ShmUnmap(_) => "ShmUnmap",
            Message::ShmUnmapped(_) => "ShmUnmapped",
            Message::ShmSync(_) => "ShmSync",
            Message::CmaAsk(_) => "CmaAsk",
            Message::CmaProbe(_) => "CmaProbe",
            Message::CmaProbed(_) => "CmaProbed",
            Message::UcxOffer(_) => "UcxOffer",
            Message::UcxAccept(_) => "UcxAccept",
            Message::UcxDecline(_) => "UcxDecline",
            Message::UcxMap(_) => "UcxMap",
            Message::UcxSync(_) => "UcxSync",
            Message::UcxUnmap(_) => "UcxUnmap",
            Message::UcxUnmapped(_) => "UcxUnmapped",
        }
    }

    /// Encodes the body (without the frame header).
    pub fn encode_body(&self) -> Result<Vec<u8>, FrameError> {
        rmp_serde::to_vec_named(self).map_err(|e| FrameError::Malformed(e.to_string()))
    }

    /// Encodes a whole frame: header plus body.
    pub fn to_frame(&self) -> Result<Vec<u8>, FrameError> {
        let mut out = vec![0u8; FRAME_HEADER_LEN];
        rmp_serde::encode::write_named(&mut out, self)
            .map_err(|e| FrameError::Malformed(e.to_string()))?;
        let body_len =
            u32::try_from(out.len() - FRAME_HEADER_LEN).map_err(|_| FrameError::TooLarge {
                len: u32::MAX,
                limit: u32::MAX,
            })?;
        out[..FRAME_HEADER_LEN].copy_from_slice(&FrameHeader::encode(body_len));
        Ok(out)
    }

    /// Decodes a body.
    pub fn decode(body: &[u8]) -> Result<Self, FrameError> {
        rmp_serde::from_slice(body).map_err(|e| FrameError::Malformed(e.to_string()))
    }
}

/// What a peer must share with its counterpart to exchange KV: layout, dtype, page size,
/// layer count, tensor parallelism. Peers compare `hash`; `description` is for the error
/// message that names both sides' values.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Compat {
    /// A hash over everything that must match.
    pub hash: u64,
    /// Human-readable form of what was hashed (at most [`MAX_COMPAT_DESCRIPTION_LEN`]
    /// bytes on the wire).
    #[serde(deserialize_with = "bounded_description")]
    pub description: String,
}

/// Longest [`Compat::description`] accepted off the wire, in bytes.
pub const MAX_COMPAT_DESCRIPTION_LEN: usize = 4096;

fn bounded_description<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    crate::ids::bounded_string(d, MAX_COMPAT_DESCRIPTION_LEN)
}

impl fmt::Display for Compat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x} ({})", self.hash, self.description)
    }
}

/// Peer authentication (HMAC challenge/response, see [`crate::auth`]): a challenge for the
/// other side and/or this side's proof.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Auth {
    /// A fresh random challenge for the other side.
    pub challenge: Option<Blob>,
    /// The answer to the other side's challenge.
    pub response: Option<Blob>,
}

/// Initiator → listener: the first message of a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// Protocol version the initiator speaks (also in every frame header).
    pub version: u8,
    /// The initiator's peer id.
    pub peer_id: PeerId,
    /// The initiator's incarnation.
    pub incarnation: Incarnation,
    /// What must match between the peers.
    pub compat: Compat,
    /// Reserved for authentication.
    pub auth: Option<Auth>,
    /// The initiator honours [`Notify::unacked`] (sends no acknowledgement for such a
    /// notification). Absent (false) from older initiators.
    #[serde(default, skip_serializing_if = "is_false")]
    pub unacked_notify: bool,
    /// The initiator takes the listener's host identity (the shared-memory offer) in a
    /// [`Message::HostOffer`] after its proof, when the listener authenticates. Absent
    /// (false) from older initiators: a listener with a secret then offers them no shared
    /// memory, rather than tell an unauthenticated peer about its host.
    #[serde(default, skip_serializing_if = "is_false")]
    pub host_after_proof: bool,
    /// The initiator answers a [`Message::DataChallenge`] on each of its data connections.
    /// Absent (false) from older initiators, which a listener with a secret refuses with
    /// `Unauthenticated` (their data connections would be bound by the token alone).
    #[serde(default, skip_serializing_if = "is_false")]
    pub data_proof: bool,
    /// How many data connections the initiator will open (stream indices
    /// `0..data_connections`); a listener refuses any other. Absent (0) from older
    /// initiators: then up to the listener's maximum.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub data_connections: u32,
    /// The initiator can reach the listener's regions through UCX, and takes a
    /// [`Message::UcxOffer`] once the session is established. Absent (false) from older
    /// initiators and builds without UCX: they are offered nothing and use TCP.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ucx: bool,
    /// The initiator honours [`Batch::grant`] on the listener's batches (checks the ops of a
    /// batch that names a token against that token's windows). Absent (false) from older
    /// initiators: the listener then names no token to them (its call fails with a typed
    /// error before anything is sent).
    #[serde(default, skip_serializing_if = "is_false")]
    pub grant_tokens: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Listener → initiator: the session exists.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// Protocol version the listener speaks.
    pub version: u8,
    /// The listener's peer id.
    pub peer_id: PeerId,
    /// The listener's incarnation.
    pub incarnation: Incarnation,
    /// Token that binds data connections to this session.
    pub token: SessionToken,
    /// The listener's compatibility values.
    pub compat: Compat,
    /// Reserved for authentication.
    pub auth: Option<Auth>,
    /// Shared memory on offer to an initiator on the same host (absent from older
    /// listeners and when shared memory is off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<ShmOffer>,
    /// The listener honours [`Notify::unacked`]. Absent (false) from older listeners.
    #[serde(default, skip_serializing_if = "is_false")]
    pub unacked_notify: bool,
    /// A [`Message::HostOffer`] follows the initiator's proof (and `shm` is absent here):
    /// set by a listener with a secret for an initiator that said `host_after_proof`.
    /// Absent (false) from older listeners, which carry the offer in `shm`.
    #[serde(default, skip_serializing_if = "is_false")]
    pub host_after_proof: bool,
    /// The listener sends a [`Message::DataChallenge`] on each data connection and binds it
    /// only once answered under the session's key (set with a secret). Absent (false) from
    /// older listeners, which bind a data connection by its token.
    #[serde(default, skip_serializing_if = "is_false")]
    pub data_proof: bool,
    /// The listener offers UCX ([`Message::UcxOffer`]) once the session is established: set
    /// when the initiator said [`Hello::ucx`] and the listener has a UCX worker. The
    /// initiator holds its session's start until that negotiation ended. Absent (false)
    /// from listeners without UCX: no offer follows, and an offer that comes is unexpected.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ucx: bool,
    /// The listener honours [`Batch::grant`] (checks the ops of a batch that names a token
    /// against that token's windows). Absent (false) from older listeners: the initiator
    /// then names no token to them (its call fails with a typed error before anything is
    /// sent).
    #[serde(default, skip_serializing_if = "is_false")]
    pub grant_tokens: bool,
}

/// What a listener tells only an authenticated initiator about its host
/// ([`Message::HostOffer`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct HostOffer {
    /// The shared-memory offer, as [`Welcome::shm`] carries it without authentication;
    /// absent when there is none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<ShmOffer>,
}

/// A listener's offer of shared memory (in [`Welcome`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmOffer {
    /// The listener's host identity (boot id and namespace ids); an initiator uses the
    /// offer only when its own is equal.
    pub host: String,
    /// The listener's process id (checked against the unix socket's peer credentials).
    pub pid: u32,
    /// Name of the listener's unix socket in the abstract namespace (random, unguessable).
    pub socket: String,
    /// The listener may offer regions that cannot be mapped (caller memory) for
    /// cross-memory attach, after the initiator proved it can read its memory
    /// ([`Message::CmaAsk`]). Absent (false) from older listeners and when it is off.
    #[serde(default, skip_serializing_if = "is_false")]
    pub cma: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A region offered for mapping ([`Message::ShmMap`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmRegion {
    /// Region id.
    pub id: RegionId,
    /// Length in bytes (the memfd is at least this long and sealed against shrinking).
    pub len: u64,
    /// Set for a region offered for cross-memory attach: its base address in the listener's
    /// address space. No descriptor travels with such a frame. Sent only after the
    /// initiator passed the canary probe; absent (memfd offer) otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<u64>,
}

/// The listener's canary for the cross-memory-attach probe ([`Message::CmaProbe`]): random
/// bytes of this session at an address of the listener's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmaCanary {
    /// Address of the canary in the listener's address space.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u32,
}

/// The initiator's answer to a [`CmaCanary`] ([`Message::CmaProbed`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CmaEcho {
    /// The bytes read from the canary (empty when the read failed).
    pub data: Blob,
    /// Why the read failed (`None` when it worked).
    pub error: Option<String>,
}

/// Most bytes of a UCX worker address or packed remote key, envelope included (UCX's own
/// blobs are a few hundred bytes; `kvbridge-ucx` caps its envelope payload at 64 KiB).
pub const MAX_UCX_BLOB: usize = 64 << 10;

/// A UCX worker address, in `kvbridge-ucx`'s checked envelope ([`Message::UcxOffer`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UcxAddress {
    /// The enveloped address (at most [`MAX_UCX_BLOB`] bytes).
    pub address: Blob,
    /// The listener's host identity (boot id and namespace ids, as [`ShmOffer::host`]; at
    /// most [`MAX_UCX_HOST_LEN`] bytes). An initiator whose own is equal asks UCX for an
    /// endpoint that may use shared-memory transports; a claim buys nothing else. Absent
    /// from older listeners and when the listener cannot read its own.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "bounded_host"
    )]
    pub host: Option<String>,
    /// The listener's process id, sent beside [`UcxAddress::host`]. An initiator on the same
    /// host watches that process: a listener killed with batches in flight over shared
    /// memory, where UCX cannot report a dead peer, fails them once the process is seen
    /// gone instead of at their deadline. A claim, like the host: a wrong one only moves
    /// when the claimant's own batches fail. Absent from older listeners.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

/// Most bytes of [`UcxAddress::host`].
pub const MAX_UCX_HOST_LEN: usize = 256;

fn bounded_host<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    crate::ids::bounded_string(d, MAX_UCX_HOST_LEN).map(Some)
}

/// Why an initiator does not use UCX in a session ([`Message::UcxDecline`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UcxDecline {
    /// What went wrong or what is missing (at most [`MAX_UCX_REASON_LEN`] bytes).
    #[serde(deserialize_with = "bounded_reason")]
    pub reason: String,
}

/// Most bytes of a [`UcxDecline::reason`].
pub const MAX_UCX_REASON_LEN: usize = 1024;

fn bounded_reason<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    crate::ids::bounded_string(d, MAX_UCX_REASON_LEN)
}

/// A region a listener grants to the initiator over UCX ([`Message::UcxMap`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UcxRegion {
    /// Region id (as in [`MemInfo`]).
    pub id: RegionId,
    /// The region's base address in the listener's address space (UCX addresses remote
    /// memory by it).
    pub base: u64,
    /// Length in bytes.
    pub len: u64,
    /// The packed remote key, in `kvbridge-ucx`'s checked envelope (at most
    /// [`MAX_UCX_BLOB`] bytes).
    pub rkey: Blob,
}

/// Names a region to unmap, or one that was unmapped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmRevoke {
    /// Region id.
    pub id: RegionId,
}

/// Error codes carried by [`Reject`], [`Message::Bye`] and failed [`Ack`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorCode {
    /// Protocol versions differ.
    UnsupportedVersion,
    /// Compatibility hashes differ.
    Incompatible,
    /// A message arrived that the receiver's state cannot serve.
    UnexpectedMessage,
    /// A message could not be decoded or breaks a limit.
    Malformed,
    /// The data connection named a session that does not exist (any more).
    UnknownSession,
    /// A step took longer than its deadline.
    Timeout,
    /// The op names a region that does not exist or is not granted to this peer.
    UnknownRegion,
    /// The op reaches outside its region.
    OutOfBounds,
    /// A limit (ops per batch, bytes in flight, handshakes) was exceeded.
    LimitExceeded,
    /// The peer id restarted with a new incarnation.
    PeerRestarted,
    /// A newer session of the same peer replaced this one.
    SessionReplaced,
    /// Authentication failed or is required.
    Unauthenticated,
    /// The sender is shutting down.
    ShuttingDown,
    /// Anything else.
    Internal,
    /// The op names a region granted to this peer, but not in that direction (a write to a
    /// read-only grant, a read of a write-only one). A peer that predates access modes
    /// cannot decode this code: it ends the session with a malformed-frame error.
    AccessDenied,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A typed refusal: a code for programs, a message for people.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reject {
    /// What went wrong.
    pub code: ErrorCode,
    /// Details, naming both sides' values where they differ.
    pub message: String,
}

/// Kind of memory behind a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MemKind {
    /// Host memory.
    Cpu,
}

/// One region as the peer may address it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    /// Region id.
    pub id: RegionId,
    /// Size in bytes.
    pub len: u64,
    /// Page size in bytes, for addressing by page index.
    pub page_size: u64,
    /// Where the memory lives.
    pub kind: MemKind,
}

/// The regions one side grants to the other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct MemInfo {
    /// All regions granted to the receiver of this message.
    pub regions: Vec<RegionInfo>,
}

/// Listener → initiator: the session is live.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Ready {}

/// Liveness probe payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ping {
    /// Echoed back in the pong.
    pub nonce: u64,
}

/// First frame on a data connection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataHello {
    /// The token from `Welcome`.
    pub token: SessionToken,
    /// The initiator's peer id (checked against the session's).
    pub peer_id: PeerId,
    /// Which of the session's data connections this is: 0 for the first (the only one
    /// before striping existed), 1.. for the extra ones of a striped session. Absent on the
    /// wire means 0, so peers that predate it interoperate unchanged.
    #[serde(default)]
    pub stream: u32,
}

/// A fresh challenge on a data connection ([`Message::DataChallenge`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataChallenge {
    /// 32 random bytes, never used twice.
    pub nonce: Blob,
}

/// The answer to a [`DataChallenge`] ([`Message::DataProof`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataProof {
    /// HMAC-SHA256 under the session's data-connection key over the challenge, the session
    /// token and the stream index.
    pub response: Blob,
}

/// One remote range of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpDesc {
    /// Target region on the receiver of the batch.
    pub region: RegionId,
    /// Byte offset in that region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl OpDesc {
    /// Whether the op fits inside a region of `region_len` bytes (overflow-safe).
    pub fn in_bounds(&self, region_len: u64) -> bool {
        self.offset
            .checked_add(self.len)
            .is_some_and(|end| end <= region_len)
    }
}

/// A batch of write or read ops.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Batch {
    /// Sender-chosen id, echoed in the completion.
    pub id: u64,
    /// The ops, in payload order.
    pub ops: Vec<OpDesc>,
    /// The grant token the batch runs under: an op on a region whose receiver confines that
    /// direction to windows is admitted when it lies wholly inside the windows open for
    /// this token (or for the sender itself). Sent only to a peer that said it honours it
    /// ([`Hello::grant_tokens`], [`Welcome::grant_tokens`]); absent from older peers and
    /// from batches that name none, so such a frame is byte for byte what it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<GrantToken>,
}

impl Batch {
    /// Total payload bytes, or `None` on overflow.
    pub fn payload_len(&self) -> Option<u64> {
        self.ops
            .iter()
            .try_fold(0u64, |acc, op| acc.checked_add(op.len))
    }
}

/// Completion of a batch or a notification.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// The id of the batch or notification.
    pub id: u64,
    /// `None` on success, else why it failed.
    pub error: Option<Reject>,
}

/// An application message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notify {
    /// Sender-chosen id, echoed in the [`Message::NotifyAck`].
    pub id: u64,
    /// The bytes.
    pub data: Blob,
    /// The sender wants no [`Message::NotifyAck`]: the application's own answer, later on
    /// the same session, confirms delivery (frames are handled in order). Sent only to a
    /// peer that said it honours it ([`Hello::unacked_notify`], [`Welcome::unacked_notify`]);
    /// absent (false) from older peers.
    #[serde(default, skip_serializing_if = "is_false")]
    pub unacked: bool,
}

/// The version a `Hello` must carry.
pub const fn current_version() -> u8 {
    PROTOCOL_VERSION
}

/// Incremental decoder over a byte buffer, for callers that read in arbitrary pieces (tests,
/// fuzzing, a future non-tokio driver). The tokio driver reads header and body directly.
#[derive(Debug)]
pub struct FrameDecoder {
    max_body: u32,
}

impl FrameDecoder {
    /// A decoder that refuses bodies over `max_body` bytes.
    pub fn new(max_body: u32) -> Self {
        Self { max_body }
    }

    /// Tries to take one whole frame off the front of `buf`.
    ///
    /// Returns `Ok(None)` when more bytes are needed, `Ok(Some((message, consumed)))` when a
    /// frame was decoded, and an error when the bytes can never become a valid frame.
    pub fn decode(&self, buf: &[u8]) -> Result<Option<(Message, usize)>, FrameError> {
        if buf.len() < FRAME_HEADER_LEN {
            // Reject a bad magic or version as early as possible.
            if buf.len() >= 2 && buf[0..2] != MAGIC {
                return Err(FrameError::BadMagic {
                    got: [buf[0], buf[1]],
                });
            }
            return Ok(None);
        }
        let mut h = [0u8; FRAME_HEADER_LEN];
        h.copy_from_slice(&buf[..FRAME_HEADER_LEN]);
        let header = FrameHeader::decode(&h, self.max_body)?;
        let end = FRAME_HEADER_LEN + header.body_len as usize;
        if buf.len() < end {
            return Ok(None);
        }
        let msg = Message::decode(&buf[FRAME_HEADER_LEN..end])?;
        Ok(Some((msg, end)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `DataHello` from a peer that predates `stream` decodes as stream 0, and a peer
    /// that predates it ignores the new field (serde skips unknown map keys).
    #[test]
    fn data_hello_stream_is_compatible() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct OldDataHello {
            token: SessionToken,
            peer_id: PeerId,
        }
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        enum Old {
            DataHello(OldDataHello),
        }
        let token = SessionToken([7; 16]);
        let peer_id = PeerId::new("p").unwrap();
        let old = rmp_serde::to_vec_named(&Old::DataHello(OldDataHello {
            token,
            peer_id: peer_id.clone(),
        }))
        .unwrap();
        let new = Message::DataHello(DataHello {
            token,
            peer_id: peer_id.clone(),
            stream: 0,
        });
        assert_eq!(Message::decode(&old).unwrap(), new);
        let third = Message::DataHello(DataHello {
            token,
            peer_id: peer_id.clone(),
            stream: 3,
        });
        let body = third.encode_body().unwrap();
        let Old::DataHello(seen) = rmp_serde::from_slice::<Old>(&body).unwrap();
        assert_eq!(seen, OldDataHello { token, peer_id });
        assert_eq!(Message::decode(&body).unwrap(), third);
    }

    /// A notification from a peer that predates unacknowledged ones decodes as an ordinary
    /// (acknowledged) one, and such a peer reads a new one, ignoring the flag.
    #[test]
    fn notify_unacked_is_compatible() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct OldNotify {
            id: u64,
            data: Blob,
        }
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        enum Old {
            Notify(OldNotify),
        }
        let old = rmp_serde::to_vec_named(&Old::Notify(OldNotify {
            id: 5,
            data: Blob(vec![1, 2]),
        }))
        .unwrap();
        let acked = Message::Notify(Notify {
            id: 5,
            data: Blob(vec![1, 2]),
            unacked: false,
        });
        assert_eq!(Message::decode(&old).unwrap(), acked);
        let posted = Message::Notify(Notify {
            id: 6,
            data: Blob(vec![3]),
            unacked: true,
        });
        let body = posted.encode_body().unwrap();
        let Old::Notify(seen) = rmp_serde::from_slice::<Old>(&body).unwrap();
        assert_eq!(
            seen,
            OldNotify {
                id: 6,
                data: Blob(vec![3])
            }
        );
        assert_eq!(Message::decode(&body).unwrap(), posted);
    }

    /// A batch from a peer that predates grant tokens decodes with none named, and is byte
    /// for byte what a batch without one encodes to; a peer that predates them reads a
    /// batch that names one, ignoring the token (it then checks the ops as it always did,
    /// which is why a token is named only to a peer that said `grant_tokens`). The flags of
    /// `Hello` and `Welcome` are absent when false.
    #[test]
    fn batch_grant_is_compatible() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct OldBatch {
            id: u64,
            ops: Vec<OpDesc>,
        }
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        enum Old {
            ReadBatch(OldBatch),
        }
        let ops = vec![OpDesc {
            region: RegionId([4; 16]),
            offset: 8,
            len: 16,
        }];
        let old = rmp_serde::to_vec_named(&Old::ReadBatch(OldBatch {
            id: 3,
            ops: ops.clone(),
        }))
        .unwrap();
        let plain = Message::ReadBatch(Batch {
            id: 3,
            ops: ops.clone(),
            grant: None,
        });
        assert_eq!(Message::decode(&old).unwrap(), plain);
        assert_eq!(plain.encode_body().unwrap(), old);
        let token = GrantToken::from_bytes([0xA5; 16]);
        let granted = Message::ReadBatch(Batch {
            id: 3,
            ops: ops.clone(),
            grant: Some(token),
        });
        let body = granted.encode_body().unwrap();
        let Old::ReadBatch(seen) = rmp_serde::from_slice::<Old>(&body).unwrap();
        assert_eq!(seen, OldBatch { id: 3, ops });
        assert_eq!(Message::decode(&body).unwrap(), granted);
        // A token of another length is refused while decoding.
        #[derive(Serialize)]
        struct Short {
            id: u64,
            ops: Vec<OpDesc>,
            grant: Blob,
        }
        #[derive(Serialize)]
        enum Raw {
            ReadBatch(Short),
        }
        let short = rmp_serde::to_vec_named(&Raw::ReadBatch(Short {
            id: 1,
            ops: vec![],
            grant: Blob(vec![1; 15]),
        }))
        .unwrap();
        assert!(matches!(
            Message::decode(&short),
            Err(FrameError::Malformed(_))
        ));
        // Never printed.
        assert_eq!(format!("{token:?}"), "GrantToken(<redacted>)");
        assert!(!format!("{granted:?}").contains("a5"));
    }

    /// An offer and a region from a peer that predates cross-memory attach decode with it
    /// off, and a peer that predates it ignores the new fields.
    #[test]
    fn cma_fields_are_compatible() {
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct OldRegion {
            id: RegionId,
            len: u64,
        }
        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        enum Old {
            ShmMap(OldRegion),
        }
        let id = RegionId([3; 16]);
        let old = rmp_serde::to_vec_named(&Old::ShmMap(OldRegion { id, len: 9 })).unwrap();
        let plain = Message::ShmMap(ShmRegion {
            id,
            len: 9,
            addr: None,
        });
        assert_eq!(Message::decode(&old).unwrap(), plain);
        // A memfd offer is byte for byte what it was.
        assert_eq!(plain.encode_body().unwrap(), old);
        let cma = Message::ShmMap(ShmRegion {
            id,
            len: 9,
            addr: Some(0x7f00_0000_1000),
        });
        let body = cma.encode_body().unwrap();
        let Old::ShmMap(seen) = rmp_serde::from_slice::<Old>(&body).unwrap();
        assert_eq!(seen, OldRegion { id, len: 9 });
        assert_eq!(Message::decode(&body).unwrap(), cma);

        #[derive(Serialize, Deserialize, PartialEq, Debug)]
        struct OldOffer {
            host: String,
            pid: u32,
            socket: String,
        }
        let off = ShmOffer {
            host: "h".into(),
            pid: 7,
            socket: "s".into(),
            cma: false,
        };
        let o = OldOffer {
            host: "h".into(),
            pid: 7,
            socket: "s".into(),
        };
        let old = rmp_serde::to_vec_named(&o).unwrap();
        assert_eq!(rmp_serde::from_slice::<ShmOffer>(&old).unwrap(), off);
        assert_eq!(rmp_serde::to_vec_named(&off).unwrap(), old);
        let on = ShmOffer { cma: true, ..off };
        let seen: OldOffer = rmp_serde::from_slice(&rmp_serde::to_vec_named(&on).unwrap()).unwrap();
        assert_eq!(seen, o);
    }

    /// A peer id or compat description longer than any valid one is refused while the
    /// frame body is decoded (before the handshake allocates or looks at it); the longest
    /// valid ones decode.
    #[test]
    fn overlong_ids_and_descriptions_are_refused_while_decoding() {
        #[derive(Serialize)]
        struct RawHello {
            version: u8,
            peer_id: String,
            incarnation: u64,
            compat: RawCompat,
            auth: Option<Auth>,
        }
        #[derive(Serialize)]
        struct RawCompat {
            hash: u64,
            description: String,
        }
        #[derive(Serialize)]
        enum Raw {
            Hello(RawHello),
        }
        let hello = |id: usize, desc: usize| {
            rmp_serde::to_vec_named(&Raw::Hello(RawHello {
                version: 1,
                peer_id: "p".repeat(id),
                incarnation: 1,
                compat: RawCompat {
                    hash: 0,
                    description: "d".repeat(desc),
                },
                auth: None,
            }))
            .unwrap()
        };
        let max_id = crate::ids::MAX_PEER_ID_LEN;
        assert!(Message::decode(&hello(max_id, MAX_COMPAT_DESCRIPTION_LEN)).is_ok());
        for body in [
            hello(max_id + 1, 1),
            hello(1, MAX_COMPAT_DESCRIPTION_LEN + 1),
        ] {
            let e = Message::decode(&body).unwrap_err();
            assert!(matches!(e, FrameError::Malformed(_)), "{e}");
        }
    }

    /// The host-offer flags are optional both ways: a peer that predates them decodes a new
    /// `Hello`/`Welcome` (ignoring the field), and a new peer reads an old one as `false`.
    #[test]
    fn host_after_proof_is_compatible() {
        let hello = Hello {
            version: 1,
            peer_id: PeerId::new("p").unwrap(),
            incarnation: Incarnation(1),
            compat: Compat::default(),
            auth: None,
            unacked_notify: false,
            host_after_proof: false,
            data_proof: false,
            data_connections: 0,
            ucx: false,
            grant_tokens: false,
        };
        // Absent when false: byte for byte what an older peer sends.
        let old = Message::Hello(hello.clone()).encode_body().unwrap();
        assert!(!String::from_utf8_lossy(&old).contains("host_after_proof"));
        assert!(!String::from_utf8_lossy(&old).contains("grant_tokens"));
        let new = Message::Hello(Hello {
            host_after_proof: true,
            data_proof: false,
            ..hello
        });
        let body = new.encode_body().unwrap();
        assert_eq!(Message::decode(&body).unwrap(), new);
        assert!(matches!(
            Message::decode(&old).unwrap(),
            Message::Hello(Hello {
                host_after_proof: false,
                data_proof: false,
                ..
            })
        ));
    }

    #[test]
    fn messages_are_maps_with_named_fields() {
        let m = Message::Ping(Ping { nonce: 5 });
        let body = m.encode_body().unwrap();
        // fixmap(1) "Ping" fixmap(1) "nonce" 5
        assert_eq!(body[0], 0x81);
        assert_eq!(&body[1..6], b"\xa4Ping");
        assert_eq!(body[6], 0x81);
        assert_eq!(&body[7..13], b"\xa5nonce");
        assert_eq!(Message::decode(&body).unwrap(), m);
    }

    #[test]
    fn op_bounds_are_overflow_safe() {
        let op = OpDesc {
            region: RegionId([0; 16]),
            offset: u64::MAX,
            len: 2,
        };
        assert!(!op.in_bounds(u64::MAX));
        let op = OpDesc {
            region: RegionId([0; 16]),
            offset: 10,
            len: 6,
        };
        assert!(op.in_bounds(16));
        assert!(!op.in_bounds(15));
    }
}
