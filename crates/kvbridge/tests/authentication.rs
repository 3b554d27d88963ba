//! Mutual authentication with a shared secret: an unauthenticated peer gets no region and no
//! operation, and every mismatch is a typed `Unauthenticated` error.

mod common;
use common::*;
use kvbridge::proto::auth::Secret;
use kvbridge::proto::ids::Blob;
use kvbridge::proto::msg::*;
use kvbridge::proto::{Incarnation, PeerId};
use kvbridge::{Error, Op};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const PAGE: usize = 4096;

fn secret(s: &str) -> Option<Secret> {
    Secret::new(s.as_bytes().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matching_secrets_connect_and_write() {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.secret = secret("s3cret-of-the-cluster"),
        PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| c.secret = secret("s3cret-of-the-cluster"),
        PAGE,
        PAGE,
    )
    .await;
    fill(&src, 8);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 0, PAGE)])
        .await
        .unwrap();
}

async fn refused(init_secret: Option<&str>, listen_secret: Option<&str>) -> Error {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.secret = listen_secret.and_then(secret),
        PAGE,
        PAGE,
    )
    .await;
    let (pre, _src) = initiator(
        "prefill-0",
        |c| c.secret = init_secret.and_then(secret),
        PAGE,
        PAGE,
    )
    .await;
    let e = pre.connect(&addr(&dec)).await.unwrap_err();
    // Nothing is left on either side, and the region was never touched.
    let t = std::time::Instant::now();
    while dec.stats().await.unwrap().sessions > 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(dec.stats().await.unwrap().sessions, 0);
    assert_eq!(pre.stats().await.unwrap().sessions, 0);
    assert_eq!(kv.in_use(), 0);
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused() {
    let e = refused(
        Some("not-the-cluster-secret"),
        Some("s3cret-of-the-cluster"),
    )
    .await;
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_secret_is_refused_by_a_listener_that_requires_one() {
    let e = refused(None, Some("s3cret-of-the-cluster")).await;
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e}");
    assert!(e.to_string().contains("requires authentication"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_with_a_secret_refuses_a_listener_without_one() {
    let e = refused(Some("s3cret-of-the-cluster"), None).await;
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_without_a_valid_proof_can_write_nothing() {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.secret = secret("s3cret-of-the-cluster"),
        PAGE,
        PAGE,
    )
    .await;
    let me = PeerId::new("intruder").unwrap();
    let (mut ctl, w) = hello_without_proof(&dec).await;
    // Skip the proof; open the data connection and try to write anyway (knowing the id).
    let mut data = TcpStream::connect(addr(&dec)).await.unwrap();
    data.write_all(
        &Message::DataHello(DataHello {
            token: w.token,
            peer_id: me,
            stream: 0,
        })
        .to_frame()
        .unwrap(),
    )
    .await
    .unwrap();
    let batch = Message::WriteBatch(Batch {
        id: 1,
        ops: vec![OpDesc {
            region: kv.id(),
            offset: 0,
            len: 8,
        }],
        grant: None,
    });
    let _ = data.write_all(&batch.to_frame().unwrap()).await;
    let _ = data.write_all(&[0xEE; 8]).await;
    // Now a bogus proof: the session is refused.
    ctl.write_all(
        &Message::Proof(Auth {
            challenge: None,
            response: Some(Blob(vec![1; 32])),
        })
        .to_frame()
        .unwrap(),
    )
    .await
    .unwrap();
    match recv_frame(&mut ctl).await {
        Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::Unauthenticated),
        m => panic!("expected Reject, got {m:?}"),
    }
    let mut b = [0u8; 8];
    kv.read_at(0, &mut b).unwrap();
    assert_eq!(b, [0u8; 8], "an unauthenticated peer wrote into a region");
    let t = std::time::Instant::now();
    while dec.stats().await.unwrap().sessions > 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(dec.stats().await.unwrap().sessions, 0);
}

#[test]
fn the_secret_never_shows_in_debug_output() {
    let mut c = kvbridge::ChannelConfig::new("x", None);
    c.secret = secret("hunter2");
    assert!(!format!("{c:?}").contains("hunter2"));
}

/// Connects to the listener's shared-memory socket (abstract name from its `Welcome`) and
/// presents `token`; returns how many bytes arrive before the listener closes it.
fn shm_bytes_received(socket: &str, token: kvbridge::proto::SessionToken) -> usize {
    use std::io::{Read, Write};
    use std::os::linux::net::SocketAddrExt;
    let a = std::os::unix::net::SocketAddr::from_abstract_name(socket.as_bytes()).unwrap();
    let mut s = std::os::unix::net::UnixStream::connect_addr(&a).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello = Message::DataHello(DataHello {
        token,
        peer_id: PeerId::new("intruder").unwrap(),
        stream: 0,
    });
    s.write_all(&hello.to_frame().unwrap()).unwrap();
    let mut got = Vec::new();
    // Returns at EOF (the listener drops the connection); a timeout fails the test.
    s.read_to_end(&mut got)
        .expect("the listener neither served nor closed");
    got.len()
}

/// Shared memory is for authenticated peers only: a peer that skips its proof, or presents a
/// token no session has, gets no frame and no file descriptor on the unix socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_peer_gets_no_memory_descriptor() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| {
            c.secret = secret("s3cret-of-the-cluster");
            c.transport = kvbridge::Transport::Shm;
            c.deadlines.handshake_step = Duration::from_millis(500);
        },
        PAGE,
        PAGE,
    )
    .await;
    let (_ctl, w) = hello_without_proof(&dec).await;
    // Before the proof the listener says nothing about its host: no offer, no socket name.
    assert_eq!(
        w.shm, None,
        "the Welcome told an unauthenticated peer about the host"
    );
    assert!(w.host_after_proof);
    // A local user finds the name anyway (/proc/net/unix lists it).
    let socket = dec
        .shm_socket_name()
        .expect("a same-host listener offers shared memory");
    // A token no session has: closed at once.
    let o = socket.clone();
    let n = tokio::task::spawn_blocking(move || {
        shm_bytes_received(&o, kvbridge::proto::SessionToken([7; 16]))
    })
    .await
    .unwrap();
    assert_eq!(n, 0, "a wrong token was served");
    // The right token but no proof: parked until the handshake deadline ends the session.
    let n = tokio::task::spawn_blocking(move || shm_bytes_received(&socket, w.token))
        .await
        .unwrap();
    assert_eq!(n, 0, "an unauthenticated peer was served");
}

/// Opens a control connection to `dec` as "intruder" with a challenge but no proof, and
/// returns it with the listener's `Welcome`.
async fn hello_without_proof(dec: &kvbridge::Channel) -> (TcpStream, Welcome) {
    let mut ctl = TcpStream::connect(addr(dec)).await.unwrap();
    ctl.write_all(
        &Message::Hello(Hello {
            version: 1,
            peer_id: PeerId::new("intruder").unwrap(),
            incarnation: Incarnation(1),
            compat: Compat::default(),
            auth: Some(Auth {
                challenge: Some(Blob(vec![0; 32])),
                response: None,
            }),
            unacked_notify: false,
            host_after_proof: true,
            data_proof: true,
            data_connections: 0,
            ucx: false,
            grant_tokens: false,
        })
        .to_frame()
        .unwrap(),
    )
    .await
    .unwrap();
    let Some(Message::Welcome(w)) = recv_frame(&mut ctl).await else {
        panic!("no welcome")
    };
    (ctl, w)
}

/// A `Hello` that names an established peer but fails a check, sent on a raw socket: the
/// listener's answer (a `Reject`, or a `Welcome` answered with a wrong proof and then a
/// `Reject`). `hello` is changed from a valid-looking one by `tweak`.
async fn intrude_as(
    dec: &kvbridge::Channel,
    name: &str,
    tweak: impl FnOnce(&mut Hello),
) -> Message {
    let mut ctl = TcpStream::connect(addr(dec)).await.unwrap();
    let mut hello = Hello {
        version: 1,
        peer_id: PeerId::new(name).unwrap(),
        incarnation: Incarnation(0xbad),
        compat: Compat::default(),
        auth: Some(Auth {
            challenge: Some(Blob(vec![0; 32])),
            response: None,
        }),
        unacked_notify: false,
        host_after_proof: true,
        data_proof: true,
        data_connections: 0,
        ucx: false,
        grant_tokens: false,
    };
    tweak(&mut hello);
    send_frame(&mut ctl, &Message::Hello(hello)).await;
    let answer = recv_frame(&mut ctl).await.expect("the listener answers");
    let Message::Welcome(_) = answer else {
        return answer;
    };
    // A Welcome: answer it with a proof made without the secret.
    send_frame(
        &mut ctl,
        &Message::Proof(Auth {
            challenge: None,
            response: Some(Blob(vec![1; 32])),
        }),
    )
    .await;
    recv_frame(&mut ctl)
        .await
        .expect("the listener answers the proof")
}

/// A session may only be replaced by one that passed the version, compat and secret
/// checks: a `Hello` that names an established peer (ids are guessable) and fails any of
/// them leaves that peer's session up and working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unauthenticated_hello_does_not_replace_a_session() {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.secret = secret("s3cret-of-the-cluster"),
        PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| c.secret = secret("s3cret-of-the-cluster"),
        PAGE,
        PAGE,
    )
    .await;
    fill(&src, 3);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let p = PeerId::new("prefill-0").unwrap();
    let inc = dec.peer_incarnation(&p).await.unwrap();
    let mut events = dec.peer_events();
    let wrong_compat = |h: &mut Hello| {
        h.compat = Compat {
            hash: 0xdead,
            description: "not ours".into(),
        }
    };
    type Tweak = Box<dyn FnOnce(&mut Hello)>;
    let attempts: [(&str, Tweak, ErrorCode); 4] = [
        (
            "no proof at all",
            Box::new(|h| h.auth = None),
            ErrorCode::Unauthenticated,
        ),
        (
            "a wrong proof",
            Box::new(|_| {}),
            ErrorCode::Unauthenticated,
        ),
        (
            "a wrong compat",
            Box::new(wrong_compat),
            ErrorCode::Incompatible,
        ),
        (
            "a wrong version",
            Box::new(|h| h.version = 9),
            ErrorCode::UnsupportedVersion,
        ),
    ];
    for (what, tweak, code) in attempts {
        match intrude_as(&dec, "prefill-0", tweak).await {
            Message::Reject(r) => assert_eq!(r.code, code, "{what}: {}", r.message),
            m => panic!("{what}: expected Reject, got {m:?}"),
        }
        // The real session still carries writes both ways, and is the same session.
        pre.write(&peer, &[Op::page(&src, 0, kv.id(), 0, PAGE)])
            .await
            .unwrap_or_else(|e| panic!("after {what}: {e}"));
        dec.write(&p, &[Op::page(&kv, 0, src.id(), 0, PAGE)])
            .await
            .unwrap_or_else(|e| panic!("after {what}: {e}"));
        assert_eq!(dec.peer_incarnation(&p).await.unwrap(), inc, "{what}");
    }
    match events.try_recv() {
        Err(tokio::sync::broadcast::error::TryRecvError::Empty) => {}
        ev => panic!("the session saw {ev:?}"),
    }
    let s = dec.stats().await.unwrap();
    assert_eq!(s.established, 1, "{s:?}");
}

/// A short secret can be searched for offline from one listener proof: a channel refuses
/// one under 16 bytes with a configuration error naming both lengths, instead of running
/// with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_shorter_than_16_bytes_is_refused_with_a_config_error() {
    for (name, listen) in [("decode-0", Some("127.0.0.1:0")), ("prefill-0", None)] {
        let mut c = kvbridge::ChannelConfig::new(name, listen);
        c.secret = secret("hunter2");
        let e = kvbridge::Channel::new(c).await.unwrap_err();
        let m = e.to_string();
        assert!(m.contains("7 bytes") && m.contains("at least 16"), "{m}");
        let mut c = kvbridge::ChannelConfig::new(name, listen);
        c.secret = secret("exactly-16-bytes");
        kvbridge::Channel::new(c).await.unwrap();
    }
}

/// Failed authentications are counted (`Stats::auth_failed`), each ended session once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_authentications_are_counted() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| c.secret = secret("s3cret-of-the-cluster"),
        PAGE,
        PAGE,
    )
    .await;
    assert_eq!(dec.stats().await.unwrap().auth_failed, 0);
    for _ in 0..3 {
        match intrude_as(&dec, "intruder", |_| {}).await {
            Message::Reject(r) => assert_eq!(r.code, ErrorCode::Unauthenticated),
            m => panic!("{m:?}"),
        }
    }
    let (pre, _) = initiator(
        "prefill-0",
        |c| c.secret = secret("not-the-cluster-secret"),
        PAGE,
        PAGE,
    )
    .await;
    pre.connect(&addr(&dec)).await.unwrap_err();
    let t = std::time::Instant::now();
    while dec.stats().await.unwrap().sessions > 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Three wrong proofs, and an initiator whose own check of our proof failed (its
    // `Reject{Unauthenticated}` ends our session as a failed authentication too).
    let s = dec.stats().await.unwrap();
    assert_eq!(s.auth_failed, 4, "{s:?}");
    // The initiator counts its own failure.
    assert_eq!(pre.stats().await.unwrap().auth_failed, 1);
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Sends one byte with `n` copies of `fd` attached, without blocking; false once the
/// socket refuses (full, or closed by the other side).
fn send_descriptors(s: &std::os::unix::net::UnixStream, fd: i32, n: usize) -> bool {
    use std::os::fd::AsRawFd;
    let byte = [b'K'];
    let mut iov = libc::iovec {
        iov_base: byte.as_ptr() as *mut libc::c_void,
        iov_len: 1,
    };
    let fds = vec![fd; n];
    let bytes = std::mem::size_of_val(fds.as_slice());
    let mut cbuf = vec![0u64; 64];
    // SAFETY: an all-zero msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE of a small length (n <= 64).
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(bytes as u32) } as usize;
    // SAFETY: the control buffer (512 bytes) holds one cmsghdr with `bytes` of data.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(bytes as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), n);
    }
    // SAFETY: msg points at valid buffers for the call.
    let r = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    r == 1
}

/// Descriptors passed to the listener's unix socket before (or instead of) a token are
/// not kept: four connections pushing thousands of them leave the listener's descriptor
/// table as it was (it held every one of them before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptors_passed_to_the_unix_socket_are_not_kept() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| {
            c.transport = kvbridge::Transport::Shm;
            c.deadlines.first_frame = Duration::from_secs(10);
        },
        PAGE,
        PAGE,
    )
    .await;
    let (_ctl, w) = hello(&addr(&dec), "intruder").await;
    let offer = w.shm.expect("a same-host listener offers shared memory");
    let null = std::fs::File::open("/dev/null").unwrap();
    let base = open_fds();
    let peak = tokio::task::spawn_blocking(move || {
        use std::os::fd::AsRawFd;
        use std::os::linux::net::SocketAddrExt;
        let a =
            std::os::unix::net::SocketAddr::from_abstract_name(offer.socket.as_bytes()).unwrap();
        let conns: Vec<_> = (0..4)
            .map(|_| std::os::unix::net::UnixStream::connect_addr(&a).unwrap())
            .collect();
        let mut peak = 0usize;
        let t = std::time::Instant::now();
        let mut sent = 0;
        // Bounded in count and time.
        while sent < 20_000 && t.elapsed() < Duration::from_secs(3) {
            let mut any = false;
            for c in &conns {
                if send_descriptors(c, null.as_raw_fd(), 50) {
                    sent += 50;
                    any = true;
                }
            }
            peak = peak.max(open_fds().saturating_sub(base));
            if !any {
                break;
            }
        }
        // The listener had its chance to read what was sent.
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(500) {
            peak = peak.max(open_fds().saturating_sub(base));
            std::thread::yield_now();
        }
        drop(conns);
        peak
    })
    .await
    .unwrap();
    assert!(peak < 64, "the listener held {peak} more descriptors");
}

/// Drives the protocol's own initiator machine by hand over a raw socket as `name` with
/// `key`, declaring `streams` data connections, until the listener welcomed it (and its
/// `MemInfo` went out). Returns the control connection, the session token and the session's
/// data-connection key: what a real initiator holds, and what lets the test play both it
/// and an observer of its data connections.
async fn authenticated_by_hand(
    target: &str,
    name: &str,
    key: &str,
    streams: u32,
) -> (
    TcpStream,
    kvbridge::proto::SessionToken,
    kvbridge::proto::auth::DataKey,
) {
    use kvbridge::proto::handshake::{Initiator, LocalIdentity, Output};
    let mut ctl = TcpStream::connect(target).await.unwrap();
    let local = LocalIdentity {
        peer_id: PeerId::new(name).unwrap(),
        incarnation: Incarnation(7),
        compat: Compat::default(),
        secret: secret(key),
        peer_keys: None,
        peer_key: None,
    };
    let now = std::time::Instant::now;
    let mut m = Initiator::declaring(local, Duration::from_secs(10), now(), [3; 32], streams);
    let mut welcomed = None;
    loop {
        while let Some(o) = m.poll_output() {
            match o {
                Output::Send(msg) => send_frame(&mut ctl, &msg).await,
                Output::Welcomed {
                    token, data_key, ..
                } => {
                    welcomed = Some((
                        token,
                        data_key.expect("the listener checks data connections"),
                    ));
                    m.provide_mem_info(MemInfo::default(), now());
                }
                Output::Failed(e) => panic!("{e}"),
                _ => {}
            }
        }
        if let Some((token, key)) = welcomed {
            return (ctl, token, key);
        }
        let msg = recv_frame(&mut ctl).await.expect("the listener answers");
        m.handle_message(msg, now());
    }
}

/// Opens a data connection as stream `stream` with `token`, and answers the listener's
/// challenge with `answer(nonce)`; returns the connection and the listener's answer to
/// the proof (`None` when it sent nothing: the connection was bound).
async fn data_connection(
    target: &str,
    token: kvbridge::proto::SessionToken,
    stream: u32,
    answer: impl FnOnce(&[u8]) -> Vec<u8>,
) -> (TcpStream, Option<Message>) {
    let mut data = TcpStream::connect(target).await.unwrap();
    let hello = Message::DataHello(DataHello {
        token,
        peer_id: PeerId::new("prefill-0").unwrap(),
        stream,
    });
    send_frame(&mut data, &hello).await;
    let nonce = match recv_frame(&mut data).await {
        Some(Message::DataChallenge(c)) => c.nonce.0,
        other => return (data, other),
    };
    let proof = Message::DataProof(DataProof {
        response: Blob(answer(&nonce)),
    });
    send_frame(&mut data, &proof).await;
    let reply = tokio::time::timeout(Duration::from_millis(300), recv_frame(&mut data))
        .await
        .ok()
        .flatten();
    (data, reply)
}

/// The session token travels in the clear in every `DataHello`, so it must not be what
/// binds a data connection. Each data connection answers a fresh challenge under a key
/// derived from the session's authentication exchange: an observer who saw the token and
/// a real data connection's bytes cannot open another stream (nor replay one), writes
/// nothing, and the session goes on; a stream past the number the initiator declared is
/// refused outright.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_with_the_token_cannot_open_a_data_connection() {
    let key = "s3cret-of-the-cluster";
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            c.secret = secret(key);
            c.transport = kvbridge::Transport::Tcp;
        },
        PAGE,
        PAGE,
    )
    .await;
    let a = addr(&dec);
    let (mut ctl, token, data_key) = authenticated_by_hand(&a, "prefill-0", key, 2).await;
    // The real initiator's stream 0.
    let (_data0, reply) = data_connection(&a, token, 0, |n| data_key.prove(n, &token, 0)).await;
    assert_eq!(reply, None, "the real data connection was refused");
    until_ready(&mut ctl).await;
    let seen = data_key.prove(b"whatever the observer saw", &token, 0);
    // The observer, with the token and the bytes it saw: a replayed proof, a made-up one.
    type Answer = Box<dyn FnOnce(&[u8]) -> Vec<u8>>;
    let answers: [(&str, Answer); 2] = [
        ("a replayed proof", Box::new(move |_| seen)),
        ("a made-up proof", Box::new(|_| vec![0xAB; 32])),
    ];
    for (what, answer) in answers {
        let (mut data, reply) = data_connection(&a, token, 1, answer).await;
        match reply {
            Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::Unauthenticated, "{what}"),
            m => panic!("{what}: the observer's stream got {m:?}"),
        }
        // Whatever it sends now lands nowhere.
        let batch = Message::WriteBatch(Batch {
            id: 1,
            ops: vec![OpDesc {
                region: kv.id(),
                offset: 0,
                len: 8,
            }],
            grant: None,
        });
        let _ = data.write_all(&batch.to_frame().unwrap()).await;
        let _ = data.write_all(&[0xEE; 8]).await;
    }
    // Past the declared number of streams: refused before any challenge.
    let (_d, reply) = data_connection(&a, token, 2, |_| unreachable!()).await;
    match reply {
        Some(Message::Reject(r)) => assert_eq!(r.code, ErrorCode::UnknownSession),
        m => panic!("stream 2 of 2 got {m:?}"),
    }
    // The real initiator's second stream is still welcome, and the session lives.
    let (_data1, reply) = data_connection(&a, token, 1, |n| data_key.prove(n, &token, 1)).await;
    assert_eq!(reply, None, "the real second stream was refused");
    let mut b = [0u8; 8];
    kv.read_at(0, &mut b).unwrap();
    assert_eq!(b, [0u8; 8], "an observer wrote into a region");
    let s = dec.stats().await.unwrap();
    assert_eq!((s.sessions, s.established), (1, 1), "{s:?}");
    drop(ctl);
}

/// Before its proof a peer gets no larger frame than its first one: a frame header that
/// announces 1 MiB after the `Hello` (under `max_frame_len`, over the first-frame limit) is
/// refused at once, without waiting for its body, and the session ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_frame_before_the_proof_is_refused_at_once() {
    let (dec, _kv) = listener(
        "decode-0",
        |c| {
            c.secret = secret("s3cret-of-the-cluster");
            // Long enough that waiting for the body would be seen.
            c.deadlines.handshake_step = Duration::from_secs(30);
        },
        PAGE,
        PAGE,
    )
    .await;
    let (mut ctl, _w) = hello_without_proof(&dec).await;
    let started = std::time::Instant::now();
    ctl.write_all(&kvbridge::proto::frame::FrameHeader::encode(1 << 20))
        .await
        .unwrap();
    ctl.write_all(&[0u8; 64]).await.unwrap();
    // The listener answers (a Reject naming the limit) or closes, well before the step's
    // deadline; it never reads the megabyte.
    let mut b = [0u8; 256];
    let ended = loop {
        match tokio::time::timeout(
            Duration::from_secs(5),
            tokio::io::AsyncReadExt::read(&mut ctl, &mut b),
        )
        .await
        {
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(_)) => continue,
            Err(_) => break false,
        }
    };
    assert!(
        ended,
        "the listener waited for the body of a pre-proof frame"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    let t = std::time::Instant::now();
    while dec.stats().await.unwrap().sessions > 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(dec.stats().await.unwrap().sessions, 0);
}

/// A listener with per-peer keys (real sockets): "prefill-0" connects with its own key, and
/// a peer holding prefill-1's key (or the shared secret) cannot claim "prefill-0".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_key_binds_the_id_it_claims() {
    let mut ring = kvbridge::proto::auth::Keyring::new();
    ring.insert(
        PeerId::new("prefill-0").unwrap(),
        secret("key-of-prefill-0-xxxx").unwrap(),
    );
    ring.insert(
        PeerId::new("prefill-1").unwrap(),
        secret("key-of-prefill-1-xxxx").unwrap(),
    );
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            c.secret = secret("the-shared-secret-xx");
            c.peer_keys = Some(ring);
        },
        PAGE,
        PAGE,
    )
    .await;
    for wrong in ["key-of-prefill-1-xxxx", "the-shared-secret-xx"] {
        let (pre, _) = initiator("prefill-0", |c| c.secret = secret(wrong), PAGE, PAGE).await;
        let e = pre.connect(&addr(&dec)).await.unwrap_err();
        assert!(matches!(e, Error::Unauthenticated { .. }), "{e}");
    }
    let (pre, src) = initiator(
        "prefill-0",
        |c| c.secret = secret("key-of-prefill-0-xxxx"),
        PAGE,
        PAGE,
    )
    .await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 0, PAGE)])
        .await
        .unwrap();
    // An id the ring does not hold still authenticates with the shared secret.
    let (other, _) = initiator(
        "prefill-7",
        |c| c.secret = secret("the-shared-secret-xx"),
        PAGE,
        PAGE,
    )
    .await;
    other.connect(&addr(&dec)).await.unwrap();
}
