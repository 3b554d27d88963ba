//! Channel configuration.

use crate::net::Net;
use crate::test_hooks::TestHooks;
use kvbridge_proto::auth::{Keyring, Secret};
use kvbridge_proto::frame::DEFAULT_MAX_FRAME_LEN;
use kvbridge_proto::msg::Compat;
use std::path::PathBuf;
use std::time::Duration;

/// Deadlines of every wait. Defaults suit a datacenter network; all are configurable.
#[derive(Debug, Clone)]
pub struct Deadlines {
    /// Opening a TCP connection.
    pub connect: Duration,
    /// Each handshake step (Welcome, data bind, memory exchange, Ready).
    pub handshake_step: Duration,
    /// A whole batch of writes or reads, or a notification, from submit to completion.
    pub op: Duration,
    /// First frame on an accepted connection (slow or silent clients are dropped).
    pub first_frame: Duration,
    /// Writing one control frame.
    pub control_write: Duration,
    /// Interval of liveness probes on an established session.
    pub keepalive: Duration,
    /// Silence on the control connection after which a session is declared dead.
    pub peer_silence: Duration,
    /// Closing the channel (Bye to every peer, tasks torn down).
    pub close: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self {
            // A reachable address answers within a millisecond on a LAN; 5 s still covers
            // two lost SYNs (the kernel resends after 1 s, then 3 s).
            connect: Duration::from_secs(5),
            // One round trip per step; twice the 5 s after which the upstream fix gave up in
            // the seed's race, which `tests/handshake.rs` replays with a 6 s bind delay.
            handshake_step: Duration::from_secs(10),
            // A batch of a few hundred MiB takes well under a second on loopback; 30 s
            // leaves room for a shared 1 GbE link, and a stalled peer still fails in bounds.
            op: Duration::from_secs(30),
            // A client sends its first frame right after connecting; this bounds how long a
            // silent one holds a slot of `max_unidentified_connections`.
            first_frame: Duration::from_secs(5),
            // A control frame is a few KiB: only a peer that stopped reading stalls it.
            control_write: Duration::from_secs(5),
            // One small frame each way per 5 s costs nothing measurable, and gives a peer
            // four chances to be heard within `peer_silence`.
            keepalive: Duration::from_secs(5),
            // Four keepalives missed: a dead peer is found within 20 s, before `op` fails
            // its batches, while a peer paused for a few seconds is not.
            peer_silence: Duration::from_secs(20),
            // A `Bye` per peer and the tasks' teardown, all local work or one frame.
            close: Duration::from_secs(5),
        }
    }
}

/// Limits on what a peer may ask of us.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest frame body accepted.
    pub max_frame_len: u32,
    /// Most ops in one batch.
    pub max_ops_per_batch: usize,
    /// Most payload bytes in one batch.
    pub max_batch_bytes: u64,
    /// Largest notification.
    pub max_notify_len: usize,
    /// Most notifications of one peer received and not yet taken by the application
    /// (`Channel::recv_notification`). Past it, or past
    /// [`max_notify_bytes_per_peer`](Self::max_notify_bytes_per_peer), that peer's data
    /// connection pauses until the application takes one of them (within the `op`
    /// deadline; a notification that finds no room by then ends its session with
    /// `Timeout`). The application takes from the peers in turn (docs/protocol.md,
    /// *Notifications waiting for the application*).
    pub max_notifications_per_peer: usize,
    /// Most bytes of one peer's notifications received and not yet taken by the
    /// application; at least `max_notify_len`.
    pub max_notify_bytes_per_peer: u64,
    /// Most bytes of all peers' notifications received and not yet taken by the
    /// application; at least `max_notify_len`. When it is reached, the room the
    /// application frees goes first to the waiting peer that holds least.
    pub max_notify_bytes_queued: u64,
    /// Most sessions handshaking with this listener at once; more are refused with
    /// `LimitExceeded` (a flood of half-open peers cannot exhaust the listener).
    pub max_concurrent_handshakes: usize,
    /// Most sessions handshaking at once that came from one source address: one host
    /// cannot take every handshake slot and lock the others out. More are refused with
    /// `LimitExceeded`, like those past `max_concurrent_handshakes`.
    pub max_handshakes_per_source: usize,
    /// Most accepted connections that have not sent their first frame yet; more are closed
    /// at once (each waits up to `first_frame` and may announce a body of
    /// `max_first_frame_len`, before any authentication).
    pub max_unidentified_connections: usize,
    /// Largest first frame of a connection (`Hello`, `DataHello`, on TCP or the unix
    /// socket): they never need more than a few KiB, and they arrive before any
    /// authentication. A larger one is refused with `LimitExceeded`.
    pub max_first_frame_len: u32,
    /// Most payload bytes of write and read batches in flight with one peer, each way
    /// (docs/protocol.md, *Bytes in flight*). Our own batches wait for room (in order,
    /// within the op deadline; one larger than this fails at once with `InvalidOp`); a
    /// peer's batch that would pass it is refused with `LimitExceeded` and ends its session
    /// (`Stats::in_flight_refused`). Keep the initiator's value at most the listener's.
    pub max_bytes_in_flight_per_peer: u64,
    /// (Initiator) Most bytes of one listener's regions mapped at once over shared memory
    /// (default [`DEFAULT_MAX_SHM_MAPPED_PER_PEER`]). A region that would pass it, or that
    /// the listener offers for mapping before announcing it in a `MemInfo`, goes over TCP;
    /// one offered longer than announced ends the use of that listener's shared memory
    /// (docs/protocol.md, *Shared memory*).
    pub max_shm_mapped_per_peer: u64,
}

/// Default [`Limits::max_shm_mapped_per_peer`] (256 GiB): above any one listener's KV
/// buffer we know of, far below what would exhaust an initiator's page tables.
pub const DEFAULT_MAX_SHM_MAPPED_PER_PEER: u64 = 256 << 30;

impl Limits {
    /// The largest first frame a connection may send (`max_first_frame_len`, never more
    /// than `max_frame_len`).
    pub(crate) fn first_frame_limit(&self) -> u32 {
        self.max_first_frame_len.min(self.max_frame_len)
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            max_ops_per_batch: 65_536,
            max_batch_bytes: 16 << 30,
            max_notify_len: 1 << 20,
            // The capacity of the one queue all peers shared before: one peer alone is held
            // back no earlier than it was.
            max_notifications_per_peer: 4096,
            // 64 of the largest notifications: a PD request's notes (one `Alloc` of at most
            // 1 MiB, then a short one per chunk) fit many times over.
            max_notify_bytes_per_peer: 64 << 20,
            // Four peers' full queues; the one shared queue before could hold 4 GiB (4096 of
            // 1 MiB) for a single peer.
            max_notify_bytes_queued: 256 << 20,
            max_concurrent_handshakes: 256,
            max_handshakes_per_source: 64,
            max_unidentified_connections: 512,
            max_first_frame_len: MAX_FIRST_FRAME_LEN,
            max_bytes_in_flight_per_peer: 64 << 30,
            max_shm_mapped_per_peer: DEFAULT_MAX_SHM_MAPPED_PER_PEER,
        }
    }
}

/// Which transport carries the bytes of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// Shared memory when both peers prove they share a host and a mapping works; TCP
    /// otherwise (and for regions that cannot be mapped).
    #[default]
    Auto,
    /// TCP only: the listener offers no shared memory, the initiator uses none.
    Tcp,
    /// Shared memory required: a session whose peer offers none on this host fails with
    /// [`crate::Error::Incompatible`]. Regions that cannot be mapped still go over TCP.
    Shm,
    /// UCX (one-sided puts and gets between registered regions) with a peer that offers it,
    /// TCP with the reason logged otherwise. Which UCX transports run is UCX's choice under
    /// its own `UCX_TLS` and `UCX_NET_DEVICES`; a `UCX_TLS` that other users or hosts can
    /// reach needs [`ChannelConfig::ucx_trusted_fabric`]. Needs a build with the `kvbridge`
    /// crate's `ucx` feature: without it [`crate::Channel::new`] refuses this setting.
    Ucx,
}

impl Transport {
    /// Parses `auto`, `tcp`, `shm` or `ucx`.
    pub fn parse(s: &str) -> Option<Transport> {
        match s {
            "auto" => Some(Transport::Auto),
            "tcp" => Some(Transport::Tcp),
            "shm" => Some(Transport::Shm),
            "ucx" => Some(Transport::Ucx),
            _ => None,
        }
    }

    /// The setting's name.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Auto => "auto",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
            Transport::Ucx => "ucx",
        }
    }
}

/// Where PEM text comes from: a file, or the text itself.
#[derive(Clone, PartialEq, Eq)]
pub enum Pem {
    /// A file holding PEM blocks.
    File(PathBuf),
    /// PEM text (tests, generated certificates).
    Text(String),
}

impl std::fmt::Debug for Pem {
    /// Names the file; never prints inline PEM (it may be a private key).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pem::File(p) => write!(f, "Pem::File({})", p.display()),
            Pem::Text(t) => write!(f, "Pem::Text(<{} bytes>)", t.len()),
        }
    }
}

impl std::fmt::Display for Pem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pem::File(p) => write!(f, "{}", p.display()),
            Pem::Text(_) => f.write_str("<inline PEM>"),
        }
    }
}

/// TLS (1.3, rustls with the ring provider) on the control connection, and with
/// [`TlsConfig::data`] on the TCP data connections too. With it set, a listener accepts
/// control connections only over TLS and an initiator dials only over TLS. Without `data`,
/// data connections stay plaintext (docs/protocol.md, *TLS*): their bytes and the session
/// token in each `DataHello` are readable on the path; with a secret each data connection
/// is still bound by a challenge under a session key (docs/protocol.md, *Authentication*).
/// Shared memory never leaves the host and is not covered either way.
///
/// TLS authenticates the listener to the initiator; the initiator is authenticated to the
/// listener by the shared secret ([`ChannelConfig::secret`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// Listener: our certificate chain, leaf first (`KVBRIDGE_TLS_CERT`). Required for a
    /// channel that listens.
    pub cert_chain: Option<Pem>,
    /// Listener: the leaf certificate's private key, PKCS#8, PKCS#1 or SEC1
    /// (`KVBRIDGE_TLS_KEY`). Never logged.
    pub private_key: Option<Pem>,
    /// Initiator: the certificates to trust — a CA, or a listener's own self-signed
    /// certificate to pin it (`KVBRIDGE_TLS_CA`). Required to dial.
    pub trusted: Option<Pem>,
    /// Initiator: the name the listener's certificate must carry
    /// (`KVBRIDGE_TLS_SERVER_NAME`); by default the host part of the address dialled, a DNS
    /// name or an IP address.
    pub server_name: Option<String>,
    /// TLS on every TCP data connection too (`KVBRIDGE_TLS_DATA=1`), with the same
    /// certificates and trust as the control connection. An initiator with it on dials its
    /// data connections over TLS; a listener with it on refuses a plaintext `DataHello`
    /// with `Reject{Incompatible}` (docs/protocol.md, *TLS*). Costs throughput on large
    /// transfers: the measured cost is in docs/protocol.md.
    pub data: bool,
}

impl TlsConfig {
    /// The settings of `KVBRIDGE_TLS_CERT`, `KVBRIDGE_TLS_KEY`, `KVBRIDGE_TLS_CA` (paths to
    /// PEM files), `KVBRIDGE_TLS_SERVER_NAME` and `KVBRIDGE_TLS_DATA`; `None` (TLS off)
    /// when none of the first three is set.
    pub fn from_env() -> Option<TlsConfig> {
        Self::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    fn from_vars(var: impl Fn(&str) -> Option<String>) -> Option<TlsConfig> {
        let file = |k: &str| var(k).map(|p| Pem::File(PathBuf::from(p)));
        let c = TlsConfig {
            cert_chain: file("KVBRIDGE_TLS_CERT"),
            private_key: file("KVBRIDGE_TLS_KEY"),
            trusted: file("KVBRIDGE_TLS_CA"),
            server_name: var("KVBRIDGE_TLS_SERVER_NAME"),
            data: var("KVBRIDGE_TLS_DATA").is_some_and(|v| v != "0"),
        };
        (c.cert_chain.is_some() || c.private_key.is_some() || c.trusted.is_some()).then_some(c)
    }
}

/// Everything a [`crate::Channel`] needs.
#[derive(Debug, Clone)]
pub struct ChannelConfig {
    /// This side's peer id (stable across restarts).
    pub peer_id: String,
    /// Address to accept sessions on (`127.0.0.1:0` picks a port); `None` for an
    /// initiator-only channel.
    pub listen_addr: Option<String>,
    /// What peers must match (KV layout, dtype, page size, layers, TP).
    pub compat: Compat,
    /// Shared secret for mutual authentication (HMAC challenge/response). When set, a peer
    /// that cannot prove it knows the secret is granted no region and no operation. Read
    /// from `KVBRIDGE_SECRET` by [`ChannelConfig::new`]; never logged.
    pub secret: Option<Secret>,
    /// (Listener) Per-peer keys: a peer that claims an id of the ring must prove that id's
    /// key (the shared secret does not do for it), so holding one key does not make a peer
    /// any other. Ids not in the ring fall back to `secret`, or are refused without one.
    /// When `None`, [`Channel::new`](crate::Channel::new) loads the file named by
    /// `KVBRIDGE_PEER_KEYS` (lines `peer-id key`) if set, and fails if it cannot; never
    /// logged.
    pub peer_keys: Option<Keyring>,
    /// (Initiator) This side's own key, for the listeners whose keyring (`peer_keys`) lists
    /// it for this side's `peer_id`: dialing, the channel proves it to a listener that
    /// proves it, and the shared `secret` to any other. Its listener still takes `secret`
    /// (and its keyring) from others, so a peer can hold a key for its own id apart from
    /// the secret it accepts. Read from `KVBRIDGE_PEER_KEY` by [`ChannelConfig::new`];
    /// never logged. [`Channel::new`](crate::Channel::new) refuses one shorter than
    /// [`Secret::MIN_LEN`], one equal to `secret`, and one on a listening channel with
    /// neither `secret` nor `peer_keys` (that listener would take unauthenticated peers).
    pub peer_key: Option<Secret>,
    /// TLS on the control connection; `None` (the default, unless `KVBRIDGE_TLS_*` is set)
    /// for plaintext. See [`TlsConfig`].
    pub tls: Option<TlsConfig>,
    /// Deadlines.
    pub deadlines: Deadlines,
    /// Limits.
    pub limits: Limits,
    /// Real or simulated network.
    pub net: Net,
    /// Drive each data connection with two dedicated threads doing blocking I/O (faster for
    /// bulk transfers; two threads per peer). When false, data connections are tokio tasks.
    pub data_threads: bool,
    /// Transport selection (`KVBRIDGE_TRANSPORT=auto|tcp|shm|ucx`, default auto).
    pub transport: Transport,
    /// Cross-memory attach (`process_vm_writev`/`readv`) for the regions of a same-host
    /// peer that cannot be mapped (caller memory, `Region::from_raw`), where the kernel
    /// permits it (probed per session; otherwise TCP, with the reason logged). Part of
    /// the shared-memory transport: off when `transport` is `tcp`. Default on;
    /// `KVBRIDGE_CMA=0` turns it off. Either side may turn it off for its sessions.
    pub cma: bool,
    /// Same-host UCX endpoints over UCX's shared-memory lanes (default on;
    /// `KVBRIDGE_UCX_SHM_LANES=0` turns it off). With it, an initiator names its host in the
    /// UCX negotiation and connects to a listener on the same host without peer-failure
    /// detection, which UCX 1.13's shared-memory transports lack, so UCX may pick them: with
    /// `UCX_TLS=sm,self,tcp` they moved 1.5-2.1x what the tcp lane moved (docs/ucx.md). UCX
    /// cannot report a dead peer on such an endpoint: the session watches the listener's
    /// process instead (a pidfd), and a killed one fails the batches in flight once its
    /// control connection closed and its process is seen gone. Off, every endpoint asks for
    /// peer-failure detection (tcp alone there).
    pub ucx_shm_lanes: bool,
    /// The operator's statement that every process able to reach this host's UCX transports
    /// is trusted with this process's memory (`KVBRIDGE_UCX_TRUSTED_FABRIC=1`; default off).
    /// UCX authenticates no peer, and where it emulates remote memory access (UCX 1.13's tcp
    /// and shared memory) a worker's process copies to and from any address a peer names:
    /// reaching the worker is reaching all of its memory, before and beside kvbridge's
    /// authentication (docs/ucx.md, "Who can reach a UCX worker"). Without this statement
    /// [`Transport::Ucx`] runs only where `UCX_TLS` names transports that no other user and
    /// no other host can reach (`posix`, `cma`, `self`: `kvbridge_ucx::reach`), and
    /// [`crate::Channel::new`] refuses any other setting, unset `UCX_TLS` (every transport)
    /// included, naming the transports that reach further.
    pub ucx_trusted_fabric: bool,
    /// TCP data connections an initiator opens per session (`KVBRIDGE_DATA_CONNECTIONS`,
    /// default [`DEFAULT_DATA_CONNECTIONS`], at most [`MAX_DATA_CONNECTIONS`]). With more
    /// than one, a large write or read batch is split by bytes over them
    /// (docs/architecture.md). Values outside 1..=[`MAX_DATA_CONNECTIONS`] are clamped. A
    /// session carried by shared memory opens one.
    pub data_connections: usize,
    /// Injected delays and failures for tests ([`TestHooks`] with the `test-hooks` feature).
    #[cfg(feature = "test-hooks")]
    pub hooks: TestHooks,
    /// Left at its default (no delay) outside tests: without the `test-hooks` feature
    /// nothing outside this crate can set it.
    #[cfg(not(feature = "test-hooks"))]
    pub(crate) hooks: TestHooks,
}

impl ChannelConfig {
    /// A configuration with defaults for everything but the peer id and listen address.
    pub fn new(peer_id: impl Into<String>, listen_addr: Option<&str>) -> Self {
        Self {
            peer_id: peer_id.into(),
            listen_addr: listen_addr.map(str::to_string),
            compat: Compat::default(),
            secret: std::env::var("KVBRIDGE_SECRET")
                .ok()
                .and_then(|s| Secret::new(s.into_bytes())),
            peer_keys: None,
            peer_key: std::env::var("KVBRIDGE_PEER_KEY")
                .ok()
                .and_then(|s| Secret::new(s.into_bytes())),
            tls: TlsConfig::from_env(),
            deadlines: Deadlines::default(),
            limits: Limits::default(),
            net: Net::default(),
            // KVBRIDGE_DATA_THREADS=0 switches data connections to tokio tasks.
            data_threads: std::env::var("KVBRIDGE_DATA_THREADS").map_or(true, |v| v != "0"),
            transport: std::env::var("KVBRIDGE_TRANSPORT")
                .ok()
                .and_then(|v| Transport::parse(&v))
                .unwrap_or_default(),
            cma: std::env::var("KVBRIDGE_CMA").map_or(true, |v| v != "0"),
            ucx_shm_lanes: std::env::var("KVBRIDGE_UCX_SHM_LANES").map_or(true, |v| v != "0"),
            ucx_trusted_fabric: std::env::var("KVBRIDGE_UCX_TRUSTED_FABRIC")
                .is_ok_and(|v| v == "1"),
            data_connections: std::env::var("KVBRIDGE_DATA_CONNECTIONS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .map_or(DEFAULT_DATA_CONNECTIONS, |n| {
                    n.clamp(1, MAX_DATA_CONNECTIONS)
                }),
            hooks: TestHooks::default(),
        }
    }
}

/// Default [`Limits::max_first_frame_len`] (8 KiB): a `Hello` with the longest peer id and
/// compat description fits in about 4.5 KiB.
pub const MAX_FIRST_FRAME_LEN: u32 = 8 << 10;

/// TCP data connections per session unless configured: two streams moved 256 KiB-4 MiB
/// blocks 1.2-1.3x faster than one on loopback (docs/architecture.md), for two more threads
/// per TCP peer.
pub const DEFAULT_DATA_CONNECTIONS: usize = 2;

/// Most data connections one session may have (either role: a listener refuses more).
pub const MAX_DATA_CONNECTIONS: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_is_off_unless_a_certificate_key_or_ca_is_named() {
        assert_eq!(TlsConfig::from_vars(|_| None), None);
        let only_name = |k: &str| (k == "KVBRIDGE_TLS_SERVER_NAME").then(|| "x".to_string());
        assert_eq!(TlsConfig::from_vars(only_name), None);
        let ca = |k: &str| (k == "KVBRIDGE_TLS_CA").then(|| "/etc/ca.pem".to_string());
        let c = TlsConfig::from_vars(ca).expect("a CA turns TLS on");
        assert_eq!(c.trusted, Some(Pem::File("/etc/ca.pem".into())));
        assert_eq!(c.cert_chain, None);
        assert!(!c.data, "data TLS is off unless asked for");
        let data = |k: &str| match k {
            "KVBRIDGE_TLS_CA" => Some("/etc/ca.pem".to_string()),
            "KVBRIDGE_TLS_DATA" => Some("1".to_string()),
            _ => None,
        };
        assert!(TlsConfig::from_vars(data).expect("TLS on").data);
        let only_data = |k: &str| (k == "KVBRIDGE_TLS_DATA").then(|| "1".to_string());
        assert_eq!(
            TlsConfig::from_vars(only_data),
            None,
            "data TLS alone is no TLS"
        );
    }

    #[test]
    fn inline_pem_is_never_printed() {
        let p = Pem::Text("-----BEGIN PRIVATE KEY-----secret".into());
        assert!(!format!("{p:?} {p}").contains("secret"));
    }
}
