//! Helpers shared by the integration tests (included with `mod common;`).
#![allow(dead_code)]

use kvbridge::{Channel, ChannelConfig, Grant, Region};

/// Fills a region with a pattern that depends on `seed` and the byte offset.
pub fn fill(r: &Region, seed: u64) {
    let mut buf = vec![0u8; r.len()];
    pattern(&mut buf, seed, 0);
    r.write_at(0, &buf).unwrap();
}

/// The pattern byte at `offset` for `seed` (an xorshift of both, cheap and position-unique).
pub fn pattern(out: &mut [u8], seed: u64, base: u64) {
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut x = seed ^ (base / 8 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// A listening channel on 127.0.0.1:0 with one owned region granted to every peer.
pub async fn listener(
    name: &str,
    cfg: impl FnOnce(&mut ChannelConfig),
    region_len: usize,
    page: usize,
) -> (Channel, Region) {
    let mut c = ChannelConfig::new(name, Some("127.0.0.1:0"));
    RAW_MEMORY.set(false);
    cfg(&mut c);
    let ch = Channel::new(c).await.unwrap();
    let r = if RAW_MEMORY.get() {
        raw_region(region_len, page)
    } else {
        Region::alloc(region_len, page).unwrap()
    };
    ch.register(&r, Grant::AllPeers).unwrap();
    (ch, r)
}

std::thread_local! {
    /// Set by [`Carrier::apply`] for a carrier that wants the listener's region in caller
    /// memory; read by [`listener`] right after it applied the configuration (same call,
    /// same thread).
    static RAW_MEMORY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// A zeroed region in caller memory (`Region::from_raw`) that no peer can map. The memory
/// is leaked: it must outlive every handle and every transfer, and the test ends soon.
pub fn raw_region(len: usize, page: usize) -> Region {
    let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
    // SAFETY: non-zero size.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!p.is_null());
    // SAFETY: p..p+len is ours, zeroed, and never freed.
    unsafe { Region::from_raw(p, len, page) }.unwrap()
}

/// An initiator-only channel with one owned region.
pub async fn initiator(
    name: &str,
    cfg: impl FnOnce(&mut ChannelConfig),
    region_len: usize,
    page: usize,
) -> (Channel, Region) {
    let mut c = ChannelConfig::new(name, None);
    cfg(&mut c);
    let ch = Channel::new(c).await.unwrap();
    let r = Region::alloc(region_len, page).unwrap();
    ch.register(&r, Grant::AllPeers).unwrap();
    (ch, r)
}

pub fn addr(ch: &Channel) -> String {
    ch.local_addr().unwrap().to_string()
}

/// Waits (at most 5 s) until `ch` has a batch in flight.
pub async fn wait_in_flight(ch: &Channel) {
    let t = std::time::Instant::now();
    while ch.stats().await.unwrap().batches_in_flight == 0
        && t.elapsed() < std::time::Duration::from_secs(5)
    {
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    assert!(
        ch.stats().await.unwrap().batches_in_flight > 0,
        "no batch in flight"
    );
}

/// Reads one frame off a raw socket (a hand-written peer), within 5 s; `None` on close,
/// timeout or garbage.
pub async fn recv_frame(s: &mut tokio::net::TcpStream) -> Option<kvbridge::proto::msg::Message> {
    use tokio::io::AsyncReadExt;
    let mut h = [0u8; 8];
    tokio::time::timeout(std::time::Duration::from_secs(5), s.read_exact(&mut h))
        .await
        .ok()?
        .ok()?;
    let hdr = kvbridge::proto::frame::FrameHeader::decode(&h, 1 << 24).ok()?;
    let mut body = vec![0u8; hdr.body_len as usize];
    s.read_exact(&mut body).await.ok()?;
    kvbridge::proto::msg::Message::decode(&body).ok()
}

/// Writes one message as a frame on a raw socket.
pub async fn send_frame(s: &mut tokio::net::TcpStream, m: &kvbridge::proto::msg::Message) {
    use tokio::io::AsyncWriteExt;
    s.write_all(&m.to_frame().unwrap()).await.unwrap();
}

/// What a transfer test runs over: a transport and, for TCP, how many data connections
/// the initiator stripes its batches over.
#[derive(Debug, Clone, Copy)]
pub struct Carrier {
    pub transport: kvbridge::Transport,
    pub data_connections: usize,
    /// The listener's region is caller memory (`Region::from_raw`), which cross-memory
    /// attach carries where the kernel permits it (TCP otherwise).
    pub raw: bool,
    /// TLS on the control and the data connections (one CA-signed certificate for
    /// 127.0.0.1 per test process, trusted by both sides).
    pub tls: bool,
    /// The UCX transports (`UCX_TLS`) of both channels' workers, for `Transport::Ucx`.
    pub ucx_tls: Option<&'static str>,
    /// `ChannelConfig::ucx_trusted_fabric` on both channels.
    pub ucx_trusted_fabric: bool,
}

/// A CA and a leaf for 127.0.0.1 that it signed: (CA certificate PEM, leaf certificate
/// PEM, leaf key PEM), made once per test process.
pub fn test_ca_and_leaf() -> &'static (String, String, String) {
    static CERTS: std::sync::OnceLock<(String, String, String)> = std::sync::OnceLock::new();
    CERTS.get_or_init(|| {
        // A child process of the test (`ChildListener`) serves its parent's certificate.
        if let Ok(pems) = std::env::var(CHILD_CERTS) {
            let mut p = pems.split(PEM_SEPARATOR).map(str::to_string);
            if let (Some(ca), Some(cert), Some(key)) = (p.next(), p.next(), p.next()) {
                return (ca, cert, key);
            }
        }
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca_cert = ca.self_signed(&ca_key).unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf_cert = leaf.signed_by(&leaf_key, &ca_cert, &ca_key).unwrap();
        (ca_cert.pem(), leaf_cert.pem(), leaf_key.serialize_pem())
    })
}

/// TLS on the control and data connections with [`test_ca_and_leaf`]: a listener serves
/// the leaf, an initiator trusts the CA (one configuration fits both roles).
pub fn tls_everywhere() -> kvbridge::TlsConfig {
    let (ca, cert, key) = test_ca_and_leaf();
    kvbridge::TlsConfig {
        cert_chain: Some(kvbridge::Pem::Text(cert.clone())),
        private_key: Some(kvbridge::Pem::Text(key.clone())),
        trusted: Some(kvbridge::Pem::Text(ca.clone())),
        data: true,
        ..kvbridge::TlsConfig::default()
    }
}

impl Carrier {
    /// Sets both on a channel's configuration (and, for `raw`, asks [`listener`] for a
    /// region in caller memory).
    pub fn apply(self, c: &mut ChannelConfig) {
        c.transport = self.transport;
        c.data_connections = self.data_connections;
        if self.tls {
            c.tls = Some(tls_everywhere());
        }
        RAW_MEMORY.set(self.raw);
        #[cfg(feature = "ucx")]
        {
            c.hooks.ucx_tls = self.ucx_tls.map(str::to_string);
            // with UCX's shared-memory transports allowed, the same-host endpoint that takes them
            c.ucx_shm_lanes = self
                .ucx_tls
                .is_some_and(|t| t.starts_with("sm") || t.starts_with("posix"));
            // A test host's tcp and sysv are declared trusted: the carriers run the engine
            // over them as an operator on a closed fabric would (`ucx_reach.rs` checks the
            // refusal without the declaration).
            c.ucx_trusted_fabric = self.ucx_trusted_fabric;
        }
    }

    /// Cross-memory attach: caller memory on a same-host listener.
    pub fn cma() -> Carrier {
        Carrier {
            transport: kvbridge::Transport::Auto,
            data_connections: 1,
            raw: true,
            tls: false,
            ucx_tls: None,
            ucx_trusted_fabric: false,
        }
    }

    /// TCP with TLS on the control and data connections, striped over 2 data connections.
    pub fn tcp_tls() -> Carrier {
        Carrier {
            transport: kvbridge::Transport::Tcp,
            data_connections: 2,
            raw: false,
            tls: true,
            ucx_tls: None,
            ucx_trusted_fabric: false,
        }
    }
}

impl From<kvbridge::Transport> for Carrier {
    fn from(transport: kvbridge::Transport) -> Self {
        Carrier {
            transport,
            data_connections: 1,
            raw: false,
            tls: false,
            ucx_tls: None,
            ucx_trusted_fabric: false,
        }
    }
}

impl Carrier {
    /// UCX between the two channels, its worker limited to `tls` (`UCX_TLS`), the fabric
    /// declared trusted.
    pub fn ucx(tls: &'static str) -> Carrier {
        Carrier {
            ucx_tls: Some(tls),
            ucx_trusted_fabric: true,
            ..Carrier::from(kvbridge::Transport::Ucx)
        }
    }

    /// UCX over the transports only this user's processes reach (`posix,cma,self`), no
    /// declaration.
    pub fn ucx_same_user() -> Carrier {
        Carrier {
            ucx_tls: Some("posix,cma,self"),
            ..Carrier::from(kvbridge::Transport::Ucx)
        }
    }
}

/// Declares one `#[tokio::test]` per carrier, named `<name>::tcp`, `<name>::tcp_striped`
/// (TCP, 3 data connections), `<name>::tcp_tls` (TLS on control and data connections, 2
/// data connections), `<name>::shm`, `<name>::cma` (the listener's region in
/// caller memory, carried by cross-memory attach where permitted) and, with the `ucx`
/// feature, `<name>::ucx_tcp` and `<name>::ucx_sm` (UCX over `UCX_TLS=tcp` and
/// `sm,self,tcp` with `ucx_shm_lanes`: a same-host endpoint takes the shared-memory lanes
/// beside tcp; both with the fabric declared trusted) and `<name>::ucx_posix` (UCX over
/// `posix,cma,self`, what runs without that declaration),
/// that runs
/// `body(carrier)`: the suite is parametrized, not copied.
#[macro_export]
macro_rules! per_transport {
    ($name:ident, $body:path) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tcp() {
                $body(kvbridge::Transport::Tcp.into()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tcp_striped() {
                $body($crate::common::Carrier {
                    transport: kvbridge::Transport::Tcp,
                    data_connections: 3,
                    raw: false,
                    tls: false,
                    ucx_tls: None,
                    ucx_trusted_fabric: false,
                })
                .await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn tcp_tls() {
                $body($crate::common::Carrier::tcp_tls()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn shm() {
                $body(kvbridge::Transport::Shm.into()).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cma() {
                $body($crate::common::Carrier::cma()).await
            }
            #[cfg(feature = "ucx")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ucx_tcp() {
                $body($crate::common::Carrier::ucx("tcp")).await
            }
            #[cfg(feature = "ucx")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ucx_sm() {
                $body($crate::common::Carrier::ucx("sm,self,tcp")).await
            }
            #[cfg(feature = "ucx")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ucx_posix() {
                $body($crate::common::Carrier::ucx_same_user()).await
            }
        }
    };
}

/// Asserts that `ch` moves its batches to `peer` over `t`'s transport (shm only when it
/// mapped the peer's regions).
pub async fn assert_transport(ch: &Channel, peer: &kvbridge::PeerId, t: impl Into<Carrier>) {
    let c = t.into();
    if c.raw {
        // Caller memory is never mapped; cross-memory attach carries it where this host
        // permits process_vm_readv/writev, and the reason it does not is reported otherwise.
        assert_eq!(
            ch.peer_transport(peer).await.unwrap(),
            kvbridge::Transport::Tcp
        );
        let st = ch.peer_cma(peer).await.unwrap();
        match kvbridge::cma_available() {
            Ok(()) => assert_eq!(st, kvbridge::CmaStatus::Active, "cma to {peer}"),
            Err(why) => {
                eprintln!("cross-memory attach unavailable here ({why}): TCP fallback asserted");
                assert!(
                    matches!(&st, kvbridge::CmaStatus::Off(r) if !r.is_empty()),
                    "{st:?}"
                );
            }
        }
        return;
    }
    // No wait: a session is reported up only once its UCX negotiation settled, so the
    // transport is final from the first batch on.
    let t = c.transport;
    assert_eq!(
        ch.peer_transport(peer).await.unwrap(),
        t,
        "transport to {peer}"
    );
}

/// Opens a control connection by hand as peer `name` (no secret, no memory of its own):
/// `Hello`, the listener's `Welcome`, an empty `MemInfo`. Returns the connection and the
/// `Welcome`.
pub async fn hello(
    target: &str,
    name: &str,
) -> (tokio::net::TcpStream, kvbridge::proto::msg::Welcome) {
    hello_saying(target, name, false).await
}

/// [`hello`], saying in the `Hello` whether this peer honours unacknowledged notifications
/// (`false`: as a peer built before them).
pub async fn hello_saying(
    target: &str,
    name: &str,
    unacked_notify: bool,
) -> (tokio::net::TcpStream, kvbridge::proto::msg::Welcome) {
    use kvbridge::proto::msg::*;
    use kvbridge::proto::{Incarnation, PeerId};
    let mut ctl = tokio::net::TcpStream::connect(target).await.unwrap();
    send_frame(
        &mut ctl,
        &Message::Hello(Hello {
            version: 1,
            peer_id: PeerId::new(name).unwrap(),
            incarnation: Incarnation(1),
            compat: Compat::default(),
            auth: None,
            unacked_notify,
            host_after_proof: false,
            data_proof: false,
            data_connections: 0,
            ucx: false,
            grant_tokens: false,
        }),
    )
    .await;
    let Some(Message::Welcome(w)) = recv_frame(&mut ctl).await else {
        panic!("no welcome")
    };
    send_frame(&mut ctl, &Message::MemInfo(MemInfo::default())).await;
    (ctl, w)
}

/// A same-host peer `name` made by hand: it handshakes, opens its data connection, connects
/// the offered shared-memory socket and proves its token there, then waits (with a
/// deadline) until the listener's `ShmMap` frames are waiting on that socket, and leaves
/// them unread. Returns its (control, data, shared-memory) connections: dropped at once
/// they act like a killed process; kept, like a live peer that never confirms an unmap.
pub async fn peer_leaving_shm_frames_unread(
    target: &str,
    name: &str,
) -> (
    tokio::net::TcpStream,
    tokio::net::TcpStream,
    tokio::net::UnixStream,
) {
    use kvbridge::proto::msg::*;
    use kvbridge::proto::PeerId;
    let (ctl, w) = hello(target, name).await;
    let me = PeerId::new(name).unwrap();
    let offer = w
        .shm
        .clone()
        .expect("a listener on this host offers shared memory");
    let mut data = tokio::net::TcpStream::connect(target).await.unwrap();
    let hello = Message::DataHello(DataHello {
        token: w.token,
        peer_id: me,
        stream: 0,
    });
    send_frame(&mut data, &hello).await;
    let addr = {
        use std::os::linux::net::SocketAddrExt;
        std::os::unix::net::SocketAddr::from_abstract_name(offer.socket.as_bytes()).unwrap()
    };
    let s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
    s.set_nonblocking(true).unwrap();
    let mut s = tokio::net::UnixStream::from_std(s).unwrap();
    {
        use tokio::io::AsyncWriteExt;
        s.write_all(&hello.to_frame().unwrap()).await.unwrap();
    }
    tokio::time::timeout(std::time::Duration::from_secs(5), s.readable())
        .await
        .expect("the listener sends its ShmMap")
        .unwrap();
    (ctl, data, s)
}

/// Handshakes by hand as peer "hostile" (no secret, no memory of its own); returns its
/// (control, data) connections once the listener said `Ready`.
pub async fn handshake(target: &str) -> (tokio::net::TcpStream, tokio::net::TcpStream) {
    let (ctl, data, _) = handshake_as(target, "hostile").await;
    (ctl, data)
}

/// Handshakes by hand as peer `name` (no secret, no memory of its own, data connection 0);
/// returns its (control, data) connections and the session token once the listener said
/// `Ready`.
pub async fn handshake_as(
    target: &str,
    name: &str,
) -> (
    tokio::net::TcpStream,
    tokio::net::TcpStream,
    kvbridge::proto::SessionToken,
) {
    handshake_saying(target, name, false).await
}

/// [`handshake_as`], with [`hello_saying`]'s `unacked_notify`.
pub async fn handshake_saying(
    target: &str,
    name: &str,
    unacked_notify: bool,
) -> (
    tokio::net::TcpStream,
    tokio::net::TcpStream,
    kvbridge::proto::SessionToken,
) {
    use kvbridge::proto::msg::*;
    use kvbridge::proto::PeerId;
    let (mut ctl, w) = hello_saying(target, name, unacked_notify).await;
    let mut data = tokio::net::TcpStream::connect(target).await.unwrap();
    send_frame(
        &mut data,
        &Message::DataHello(DataHello {
            token: w.token,
            peer_id: PeerId::new(name).unwrap(),
            stream: 0,
        }),
    )
    .await;
    until_ready(&mut ctl).await;
    (ctl, data, w.token)
}

/// Reads the listener's last two handshake frames on a by-hand peer's control connection:
/// `MemInfo`, then `Ready`.
pub async fn until_ready(ctl: &mut tokio::net::TcpStream) {
    use kvbridge::proto::msg::Message;
    assert!(matches!(recv_frame(ctl).await, Some(Message::MemInfo(_))));
    assert!(matches!(recv_frame(ctl).await, Some(Message::Ready(_))));
}

/// The environment variable carrying the parent's test certificates to a [`ChildListener`].
const CHILD_CERTS: &str = "KVB_TEST_CHILD_CERTS";
/// The environment variable that makes a test binary a [`ChildListener`] (its carrier).
pub const CHILD_LISTENER: &str = "KVB_TEST_CHILD_LISTENER";
const PEM_SEPARATOR: &str = "\n--kvb--\n";

impl Carrier {
    /// The carrier as one line, for a child process ([`Carrier::decode`]).
    pub fn encode(&self) -> String {
        let t = match self.transport {
            kvbridge::Transport::Auto => "auto",
            kvbridge::Transport::Tcp => "tcp",
            kvbridge::Transport::Shm => "shm",
            kvbridge::Transport::Ucx => "ucx",
        };
        format!(
            "{t};{};{};{};{};{}",
            self.data_connections,
            self.raw,
            self.tls,
            self.ucx_tls.unwrap_or("-"),
            self.ucx_trusted_fabric
        )
    }

    /// The carrier [`Carrier::encode`] wrote.
    pub fn decode(s: &str) -> Carrier {
        let f: Vec<&str> = s.split(';').collect();
        assert_eq!(f.len(), 6, "carrier {s:?}");
        let ucx_tls = match f[4] {
            "-" => None,
            "tcp" => Some("tcp"),
            "sm,self" => Some("sm,self"),
            "sm,self,tcp" => Some("sm,self,tcp"),
            "posix,cma,self" => Some("posix,cma,self"),
            other => panic!("UCX transports {other:?}"),
        };
        Carrier {
            transport: kvbridge::Transport::parse(f[0]).expect("transport"),
            data_connections: f[1].parse().expect("data connections"),
            raw: f[2] == "true",
            tls: f[3] == "true",
            ucx_tls,
            ucx_trusted_fabric: f[5] == "true",
        }
    }
}

/// A listener in a child process: the test binary re-run as `test` (a test that calls
/// [`ChildListener::serve_if_child`] first) with the carrier in [`CHILD_LISTENER`]. Killed
/// (SIGKILL) when dropped.
pub struct ChildListener {
    child: std::process::Child,
    /// Its listening address.
    pub addr: String,
}

impl ChildListener {
    /// Starts the child and waits (at most 60 s) for its address.
    pub async fn start(test: &str, t: Carrier) -> ChildListener {
        use std::io::BufRead;
        let (ca, cert, key) = test_ca_and_leaf();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_LISTENER, t.encode())
            .env(
                CHILD_CERTS,
                [ca.as_str(), cert.as_str(), key.as_str()].join(PEM_SEPARATOR),
            )
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let read = tokio::task::spawn_blocking(move || {
            for line in std::io::BufReader::new(out).lines() {
                let line = line.ok()?;
                // libtest's "test NAME ... " precedes it on the same line.
                if let Some((_, a)) = line.split_once("KVB_CHILD_ADDR ") {
                    return Some(a.trim().to_string());
                }
            }
            None
        });
        let addr = tokio::time::timeout(std::time::Duration::from_secs(60), read).await;
        let Ok(Ok(Some(addr))) = addr else {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the child listener did not say its address: {addr:?}");
        };
        ChildListener { child, addr }
    }

    /// In the child ([`CHILD_LISTENER`] set): serves a listener named `name` with a region of
    /// `len` bytes granted to every peer, says its address, and waits to be killed (60 s at
    /// most, then exits). Returns at once in the parent.
    pub async fn serve_if_child(name: &str, len: usize, page: usize) {
        let Ok(spec) = std::env::var(CHILD_LISTENER) else {
            return;
        };
        let t = Carrier::decode(&spec);
        let (ch, _region) = listener(name, |c| t.apply(c), len, page).await;
        println!("KVB_CHILD_ADDR {}", addr(&ch));
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        std::process::exit(0);
    }

    /// SIGKILL, then reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildListener {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `r` is the owner's refusal of an op outside what it granted: `AccessDenied` at `step`,
/// naming the owner `owner` and saying `needle`.
pub fn assert_denied(r: kvbridge::Result<()>, owner: &str, step: kvbridge::Step, needle: &str) {
    match r {
        Err(kvbridge::Error::Rejected {
            peer,
            step: s,
            code: kvbridge::proto::msg::ErrorCode::AccessDenied,
            message,
        }) => {
            assert_eq!(peer, owner);
            assert_eq!(s, step);
            assert!(message.contains(needle), "{message}");
        }
        other => panic!("expected AccessDenied at {step}, got {other:?}"),
    }
}
