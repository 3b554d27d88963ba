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
    let (dec, kv) = listener("decode-0", |c| c.secret = secret("s3cret"), PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", |c| c.secret = secret("s3cret"), PAGE, PAGE).await;
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
    let e = refused(Some("wrong"), Some("s3cret")).await;
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_secret_is_refused_by_a_listener_that_requires_one() {
    let e = refused(None, Some("s3cret")).await;
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e}");
    assert!(e.to_string().contains("requires authentication"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_with_a_secret_refuses_a_listener_without_one() {
    let e = refused(Some("s3cret"), None).await;
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_without_a_valid_proof_can_write_nothing() {
    let (dec, kv) = listener("decode-0", |c| c.secret = secret("s3cret"), PAGE, PAGE).await;
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
fn shm_bytes_received(offer: &ShmOffer, token: kvbridge::proto::SessionToken) -> usize {
    use std::io::{Read, Write};
    use std::os::linux::net::SocketAddrExt;
    let a = std::os::unix::net::SocketAddr::from_abstract_name(offer.socket.as_bytes()).unwrap();
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
            c.secret = secret("s3cret");
            c.transport = kvbridge::Transport::Shm;
            c.deadlines.handshake_step = Duration::from_millis(500);
        },
        PAGE,
        PAGE,
    )
    .await;
    let (_ctl, w) = hello_without_proof(&dec).await;
    let offer = w.shm.expect("a same-host listener offers shared memory");
    // A token no session has: closed at once.
    let o = offer.clone();
    let n = tokio::task::spawn_blocking(move || {
        shm_bytes_received(&o, kvbridge::proto::SessionToken([7; 16]))
    })
    .await
    .unwrap();
    assert_eq!(n, 0, "a wrong token was served");
    // The right token but no proof: parked until the handshake deadline ends the session.
    let n = tokio::task::spawn_blocking(move || shm_bytes_received(&offer, w.token))
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
