//! TLS on the data connections (`TlsConfig::data`): a recorder on the path sees neither the
//! KV bytes nor the peer ids (and sees both with it off); a listener that requires it and an
//! initiator that does not use it tell each other apart with a typed error, with and
//! without the shared secret; a data connection whose TLS handshake never completes fails
//! within its deadline. The transfer suites run over it too (`per_transport!`, `tcp_tls`).

mod common;
use common::*;
use kvbridge::proto::auth::Secret;
use kvbridge::proto::msg::ErrorCode;
use kvbridge::{ChannelConfig, Error, Op, Step, Transport};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PAGE: usize = 4096;

/// A loopback TCP relay in front of `target` that records every byte it forwards, both
/// ways. Connections after the first `forwarded` are accepted and then left silent (a
/// black hole); `None` forwards all. [`Relay::kill`] resets every connection at once, as
/// the death of the host behind it would.
struct Relay {
    addr: String,
    seen: Arc<Mutex<Vec<u8>>>,
    kill: tokio::sync::watch::Sender<bool>,
}

impl Relay {
    fn kill(&self) {
        let _ = self.kill.send(true);
    }
}

async fn relay(target: String, forwarded: Option<usize>) -> Relay {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let rec = seen.clone();
    let (kill, killed) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut held = Vec::new();
        for i in 0usize.. {
            let Ok((inbound, _)) = l.accept().await else {
                return;
            };
            if forwarded.is_some_and(|n| i >= n) {
                held.push(inbound);
                continue;
            }
            let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                return;
            };
            // Closed with a reset, not a FIN, when killed.
            let _ = inbound.set_zero_linger();
            let _ = outbound.set_zero_linger();
            let (ri, wi) = inbound.into_split();
            let (ro, wo) = outbound.into_split();
            tokio::spawn(pump(ri, wo, rec.clone(), killed.clone()));
            tokio::spawn(pump(ro, wi, rec.clone(), killed.clone()));
        }
    });
    Relay { addr, seen, kill }
}

/// Copies `from` to `to` until either closes, recording what passed; drops both (a reset)
/// when `killed`.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    rec: Arc<Mutex<Vec<u8>>>,
    mut killed: tokio::sync::watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 << 10];
    let copy = async {
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            rec.lock().unwrap().extend_from_slice(&buf[..n]);
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::select! {
        _ = copy => {}
        _ = killed.wait_for(|k| *k) => {}
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// TLS on the control connection, on the data connections when `data`.
fn tls(data: bool) -> impl Fn(&mut ChannelConfig) {
    move |c| {
        let mut t = tls_everywhere();
        t.data = data;
        c.tls = Some(t);
        c.transport = Transport::Tcp;
        c.secret = Secret::new(b"s3cret-of-the-cluster".to_vec());
    }
}

/// Writes 16 pages through a recording relay and reads them back (both checked
/// byte-exact); returns what the relay saw.
async fn through_a_recorder(data: bool) -> Vec<u8> {
    let (dec, kv) = listener("decode-0", tls(data), 64 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", tls(data), 32 * PAGE, PAGE).await;
    let r = relay(addr(&dec), None).await;
    fill(&src, 11);
    let peer = pre.connect(&r.addr).await.unwrap();
    let w: Vec<Op> = (0..16)
        .map(|i| Op::page(&src, i, kv.id(), (40 + i) as u64, PAGE))
        .collect();
    pre.write(&peer, &w).await.unwrap();
    let back: Vec<Op> = (0..16)
        .map(|i| Op::page(&src, 16 + i, kv.id(), (40 + i) as u64, PAGE))
        .collect();
    pre.read(&peer, &back).await.unwrap();
    let (mut a, mut b) = (vec![0u8; 16 * PAGE], vec![0u8; 16 * PAGE]);
    src.read_at(0, &mut a).unwrap();
    src.read_at(16 * PAGE, &mut b).unwrap();
    assert!(a == b, "the pages read back differ from the pages written");
    kv.read_at(40 * PAGE, &mut b).unwrap();
    assert!(a == b, "the pages written differ at the listener");
    pre.close().await;
    dec.close().await;
    let seen = r.seen.lock().unwrap().clone();
    assert!(seen.len() > 32 * PAGE, "the relay carried the transfer");
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_data_tls_a_recorder_on_the_path_sees_no_payload_and_no_peer_id() {
    let seen = through_a_recorder(true).await;
    let mut page = vec![0u8; 64];
    pattern(&mut page, 11, 0);
    assert!(!contains(&seen, &page), "KV bytes readable on the path");
    assert!(
        !contains(&seen, b"prefill-0"),
        "a peer id readable on the path"
    );
}

/// The same recorder with data TLS off: it does see the KV bytes and the `DataHello`
/// (that is what the test above would see if data TLS did nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_data_tls_the_same_recorder_sees_the_payload() {
    let seen = through_a_recorder(false).await;
    let mut page = vec![0u8; 64];
    pattern(&mut page, 11, 0);
    assert!(
        contains(&seen, &page),
        "KV bytes not found in the plaintext stream"
    );
    assert!(
        contains(&seen, b"prefill-0"),
        "the DataHello's peer id not found"
    );
}

/// A listener that requires data TLS, an initiator with TLS on the control connection
/// only: the initiator's connect fails with the listener's typed refusal at `data-bind`,
/// nothing is left behind on either side.
async fn plaintext_data_refused(secret: bool) {
    let with_secret = move |c: &mut ChannelConfig| {
        if !secret {
            c.secret = None;
        }
    };
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            tls(true)(c);
            with_secret(c);
        },
        PAGE,
        PAGE,
    )
    .await;
    let (pre, _src) = initiator(
        "prefill-0",
        |c| {
            tls(false)(c);
            with_secret(c);
            c.deadlines.handshake_step = Duration::from_secs(2);
        },
        PAGE,
        PAGE,
    )
    .await;
    let t = std::time::Instant::now();
    let e = pre.connect(&addr(&dec)).await.unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    match &e {
        Error::Rejected {
            peer,
            step,
            code,
            message,
        } => {
            assert_eq!(*code, ErrorCode::Incompatible, "{e}");
            assert_eq!(*step, Step::DataBind, "{e}");
            assert!(peer == "decode-0" || peer == &addr(&dec), "{e}");
            assert!(message.contains("requires TLS on data connections"), "{e}");
        }
        _ => panic!("expected Rejected(Incompatible) at data-bind, got {e}"),
    }
    assert!(dec.stats().await.unwrap().tls_refused >= 1);
    assert_eq!(pre.stats().await.unwrap().sessions, 0);
    // The listener's half-built session goes within its handshake deadline.
    let t = std::time::Instant::now();
    while dec.stats().await.unwrap().sessions > 0 && t.elapsed() < Duration::from_secs(15) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let s = dec.stats().await.unwrap();
    assert_eq!((s.sessions, s.established), (0, 0));
    assert_eq!(kv.in_use(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_data_against_a_listener_requiring_data_tls_is_a_typed_refusal() {
    plaintext_data_refused(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_data_against_a_listener_requiring_data_tls_is_a_typed_refusal_with_a_secret() {
    plaintext_data_refused(true).await;
}

/// The initiator decides: data TLS on an initiator works against a TLS listener that does
/// not require it (the listener tells TLS from a frame by the first byte).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_tls_initiator_works_with_a_listener_that_does_not_require_it() {
    let (dec, kv) = listener("decode-0", tls(false), 8 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", tls(true), 8 * PAGE, PAGE).await;
    fill(&src, 5);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let ops: Vec<Op> = (0..8)
        .map(|i| Op::page(&src, i, kv.id(), (7 - i) as u64, PAGE))
        .collect();
    pre.write(&peer, &ops).await.unwrap();
    for i in 0..8usize {
        let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
        src.read_at(i * PAGE, &mut a).unwrap();
        kv.read_at((7 - i) * PAGE, &mut b).unwrap();
        assert!(a == b, "page {i} differs");
    }
    assert_eq!(dec.stats().await.unwrap().tls_refused, 0);
}

/// The control connection goes through; every data connection lands in a black hole that
/// never answers the TLS handshake: connect fails with `Timeout` at `data-bind`, naming the
/// listener, within the handshake step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_tls_handshake_that_never_completes_times_out_typed() {
    let (dec, _kv) = listener("decode-0", tls(true), PAGE, PAGE).await;
    let r = relay(addr(&dec), Some(1)).await;
    let (pre, _src) = initiator(
        "prefill-0",
        |c| {
            tls(true)(c);
            c.deadlines.handshake_step = Duration::from_millis(500);
        },
        PAGE,
        PAGE,
    )
    .await;
    let t = std::time::Instant::now();
    let e = pre.connect(&r.addr).await.unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t.elapsed()
    );
    match &e {
        Error::Timeout { peer, step, after } => {
            assert_eq!(*step, Step::DataBind, "{e}");
            assert_eq!(*after, Duration::from_millis(500), "{e}");
            assert!(peer == "decode-0" || peer == &r.addr, "{e}");
        }
        _ => panic!("expected Timeout at data-bind, got {e}"),
    }
    assert_eq!(pre.stats().await.unwrap().sessions, 0);
}

/// Batches large enough to be split over both data connections, both ways, byte-exact.
async fn striped_batches(conns: usize) {
    const P: usize = 16 << 10;
    const N: usize = 4096;
    let (dec, kv) = listener("decode-0", tls(true), N * P, P).await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| {
            tls(true)(c);
            c.data_connections = conns;
        },
        N * P,
        P,
    )
    .await;
    fill(&src, 21);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    for part in 0..4 {
        let ops: Vec<Op> = (part * 1024..(part + 1) * 1024)
            .map(|i| Op::page(&src, i, kv.id(), (N - 1 - i) as u64, P))
            .collect();
        pre.write(&peer, &ops).await.unwrap();
    }
    let (mut a, mut b) = (vec![0u8; P], vec![0u8; P]);
    for i in (0..N).step_by(97) {
        src.read_at(i * P, &mut a).unwrap();
        kv.read_at((N - 1 - i) * P, &mut b).unwrap();
        assert!(a == b, "page {i} differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_mib_batches_over_one_tls_data_connection() {
    striped_batches(1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_mib_batches_striped_over_two_tls_data_connections() {
    striped_batches(2).await;
}

/// The listener's host dies (every connection reset) while a write is held at the listener:
/// the write fails with a typed error naming the listener, within the op deadline, and the
/// initiator is left with nothing in flight and no session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_flight_when_the_peer_dies_fails_typed() {
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            tls(true)(c);
            c.hooks.write_apply_delay = Some(Duration::from_secs(3));
        },
        64 * PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator("prefill-0", tls(true), 64 * PAGE, PAGE).await;
    let r = relay(addr(&dec), None).await;
    let peer = pre.connect(&r.addr).await.unwrap();
    let ops: Vec<Op> = (0..64)
        .map(|i| Op::page(&src, i, kv.id(), i as u64, PAGE))
        .collect();
    let t = std::time::Instant::now();
    let (res, ()) = tokio::join!(pre.write(&peer, &ops), async {
        wait_in_flight(&pre).await;
        r.kill();
    });
    let e = res.unwrap_err();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    match &e {
        Error::ConnectionLost { peer, .. } | Error::PeerClosed { peer, .. } => {
            assert_eq!(peer, "decode-0", "{e}")
        }
        _ => panic!("expected the connection lost, got {e}"),
    }
    let until = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let s = pre.stats().await.unwrap();
        if s.batches_in_flight == 0 && s.sessions == 0 {
            break;
        }
        assert!(std::time::Instant::now() < until, "{s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
