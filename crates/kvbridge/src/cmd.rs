//! The messages between the channel's tasks: to the core task ([`CoreCmd`]) and to a session
//! task ([`SessionCmd`]), and the handle of a live session the core hands out
//! ([`PeerHandle`]). They sit below the tasks that send and receive them, so no task imports
//! another to talk to it.

use crate::datapath::DataPath;
use crate::error::{Error, Result};
use crate::events::Stats;
use crate::net::Stream;
use crate::transport::shm::ShmPeer;
use kvbridge_proto::msg::{DataHello, Message, RegionInfo};
use kvbridge_proto::{Incarnation, PeerId, RegionId};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::sync::oneshot;

/// A live session, as the core hands it to callers.
#[derive(Clone)]
pub(crate) struct PeerHandle {
    pub(crate) peer_id: PeerId,
    pub(crate) incarnation: Incarnation,
    pub(crate) data: Arc<DataPath>,
    pub(crate) remote: Arc<RwLock<HashMap<RegionId, RegionInfo>>>,
    /// The peer's regions mapped into this process (shared memory), if any.
    pub(crate) shm: Option<Arc<ShmPeer>>,
}

/// Messages to the core task.
pub(crate) enum CoreCmd {
    Connect {
        addr: String,
        reply: oneshot::Sender<Result<PeerHandle>>,
    },
    Lookup {
        peer: PeerId,
        reply: oneshot::Sender<Option<PeerHandle>>,
    },
    Incoming {
        stream: Stream,
        first: Box<Message>,
        /// Where the connection came from (handshake quotas, logs).
        from: SocketAddr,
    },
    /// A shared-memory connection presenting a session token.
    ShmIncoming {
        stream: tokio::net::UnixStream,
        hello: DataHello,
    },
    SessionUp {
        id: u64,
        handle: PeerHandle,
    },
    SessionDown {
        id: u64,
        error: Error,
    },
    MemChanged,
    /// A region is being detached from shared memory: every session but `except` whose
    /// peer still maps it ends ([`SessionCmd::EndIfMapping`]).
    EndMappers {
        region: RegionId,
        except: Option<u64>,
        after: Duration,
    },
    /// A connection refused on TLS grounds (counted in [`Stats::tls_refused`]).
    TlsRefused,
    Disconnect {
        peer: PeerId,
        reason: String,
        reply: oneshot::Sender<Result<()>>,
    },
    Stats {
        reply: oneshot::Sender<Stats>,
    },
    Close {
        reply: oneshot::Sender<()>,
    },
}

/// Messages to a session task.
pub(crate) enum SessionCmd {
    /// (Listener) A data connection that presented this session's token, with its stream
    /// index (`DataHello::stream`).
    DataConn(Stream, PeerId, u32),
    /// (Listener) A data connection answered its challenge under the session's key: it
    /// may be bound as stream `u32` (unless that stream was bound meanwhile).
    DataProven(Stream, u32),
    /// (Listener) A data connection did not answer its challenge (it was refused).
    DataUnproven,
    /// A newer session of the same peer took over; fail with this error.
    Replace(Error),
    /// (Listener, handshaking) The session's handshake slot went to a `Hello` from `by`
    /// (`handshake_slots`); the session ends, unless it is established already (it then
    /// holds no slot).
    SlotTaken {
        /// Our control connection's source address.
        from: SocketAddr,
        /// The source address of the `Hello` that took the slot.
        by: SocketAddr,
    },
    /// A batch passed its deadline; tear down with this error.
    Abort(Error),
    /// Local regions changed; tell the peer what it may address now.
    MemChanged,
    /// (Listener) A shared-memory connection that presented this session's token.
    ShmConn(tokio::net::UnixStream, PeerId),
    /// (Listener) A region is being detached from shared memory and peers that map it
    /// did not confirm unmapping it within `after`: when this session's peer is one of
    /// them, the session ends (its teardown waits for the peer to close the shared-memory
    /// connection, its word that no copy into the region runs), so that the region can be
    /// detached without a write of this peer landing in memory that is cut loose.
    EndIfMapping {
        /// The region.
        region: RegionId,
        /// How long the peer had to confirm.
        after: Duration,
    },
    /// The channel is closing.
    Close,
}
