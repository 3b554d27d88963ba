//! TLS on the control connection: it works (with and without the shared secret), and every
//! mismatch — plaintext against TLS either way, an untrusted, expired or misnamed
//! certificate, a listener that never answers — is a typed error at `Step::Tls` (or the
//! listener's typed refusal), never a hang. Certificates are generated here with rcgen.

mod common;
use common::*;
use kvbridge::proto::auth::Secret;
use kvbridge::proto::msg::ErrorCode;
use kvbridge::{ChannelConfig, Error, Op, Pem, Step, TlsConfig, Transport};
use std::time::Duration;

const PAGE: usize = 4096;

/// A certificate and its key, as PEM.
struct Cert {
    cert: String,
    key: String,
}

fn self_signed(names: &[&str]) -> Cert {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let c = rcgen::generate_simple_self_signed(names).unwrap();
    Cert {
        cert: c.cert.pem(),
        key: c.key_pair.serialize_pem(),
    }
}

/// A CA and a leaf for 127.0.0.1 that it signed: (CA certificate PEM, leaf).
fn ca_and_leaf() -> (String, Cert) {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    let leaf_key = rcgen::KeyPair::generate().unwrap();
    let leaf_cert = leaf.signed_by(&leaf_key, &ca_cert, &ca_key).unwrap();
    (
        ca_cert.pem(),
        Cert {
            cert: leaf_cert.pem(),
            key: leaf_key.serialize_pem(),
        },
    )
}

fn serve_with(c: &Cert) -> impl Fn(&mut ChannelConfig) + '_ {
    move |cfg| {
        cfg.tls = Some(TlsConfig {
            cert_chain: Some(Pem::Text(c.cert.clone())),
            private_key: Some(Pem::Text(c.key.clone())),
            ..TlsConfig::default()
        })
    }
}

fn trusting(pem: &str) -> impl Fn(&mut ChannelConfig) + '_ {
    move |cfg| {
        cfg.tls = Some(TlsConfig {
            trusted: Some(Pem::Text(pem.to_string())),
            ..TlsConfig::default()
        })
    }
}

/// Connects, writes 8 pages and notifies; checks the bytes and the notification.
async fn write_and_notify(
    listen: impl FnOnce(&mut ChannelConfig),
    init: impl FnOnce(&mut ChannelConfig),
    t: impl Into<Carrier>,
) {
    let t: Carrier = t.into();
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            listen(c);
            t.apply(c);
        },
        64 * PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| {
            init(c);
            t.apply(c);
        },
        8 * PAGE,
        PAGE,
    )
    .await;
    fill(&src, 3);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    let ops: Vec<Op> = (0..8)
        .map(|i| Op::page(&src, i, kv.id(), (63 - i * 7) as u64, PAGE))
        .collect();
    pre.write(&peer, &ops).await.unwrap();
    pre.notify(&peer, b"req-1 done").await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), dec.recv_notification())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.data, b"req-1 done");
    for i in 0..8usize {
        let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
        src.read_at(i * PAGE, &mut a).unwrap();
        kv.read_at((63 - i * 7) * PAGE, &mut b).unwrap();
        assert!(a == b, "page {i} differs");
    }
    assert_eq!(dec.stats().await.unwrap().tls_refused, 0);
}

async fn ca_signed_write_and_notify(t: Carrier) {
    let (ca, leaf) = ca_and_leaf();
    write_and_notify(serve_with(&leaf), trusting(&ca), t).await;
}
per_transport!(
    tls_with_a_ca_connects_writes_and_notifies,
    super::ca_signed_write_and_notify
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_pinned_self_signed_certificate_and_the_secret_works() {
    let c = self_signed(&["127.0.0.1"]);
    let secret = || Secret::new(b"s3cret-of-the-cluster".to_vec());
    write_and_notify(
        |cfg| {
            serve_with(&c)(cfg);
            cfg.secret = secret();
        },
        |cfg| {
            trusting(&c.cert)(cfg);
            cfg.secret = secret();
        },
        Transport::Tcp,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_wrong_secret_is_still_unauthenticated() {
    let c = self_signed(&["127.0.0.1"]);
    let (dec, _kv) = listener(
        "decode-0",
        |cfg| {
            serve_with(&c)(cfg);
            cfg.secret = Secret::new(b"s3cret-of-the-cluster".to_vec());
        },
        PAGE,
        PAGE,
    )
    .await;
    let (pre, _src) = initiator(
        "prefill-0",
        |cfg| {
            trusting(&c.cert)(cfg);
            cfg.secret = Secret::new(b"not-the-cluster-secret".to_vec());
        },
        PAGE,
        PAGE,
    )
    .await;
    let e = pre.connect(&addr(&dec)).await.unwrap_err();
    match &e {
        Error::Unauthenticated { peer, step, .. } => {
            assert_ne!(*step, Step::Tls, "TLS itself succeeded: {e}");
            assert!(peer.contains("127.0.0.1") || peer == "decode-0", "{e}");
        }
        _ => panic!("expected Unauthenticated, got {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_initiator_is_refused_by_a_tls_listener_with_a_typed_error() {
    let c = self_signed(&["127.0.0.1"]);
    let (dec, kv) = listener("decode-0", serve_with(&c), PAGE, PAGE).await;
    let (pre, _src) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    let e = pre.connect(&addr(&dec)).await.unwrap_err();
    match &e {
        Error::Rejected {
            peer,
            step,
            code,
            message,
        } => {
            assert_eq!(*code, ErrorCode::Incompatible, "{e}");
            assert_eq!(*step, Step::Welcome, "{e}");
            assert_eq!(peer, &addr(&dec), "{e}");
            assert!(message.contains("requires TLS"), "{e}");
        }
        _ => panic!("expected Rejected(Incompatible), got {e}"),
    }
    // Counted before the refusal went out; nothing was built for it.
    let s = dec.stats().await.unwrap();
    assert_eq!((s.tls_refused, s.sessions, s.tokens), (1, 0, 0));
    assert_eq!(pre.stats().await.unwrap().sessions, 0);
    assert_eq!(kv.in_use(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_initiator_against_a_plaintext_listener_fails_typed() {
    let c = self_signed(&["127.0.0.1"]);
    let (dec, _kv) = listener("decode-0", |_| {}, PAGE, PAGE).await;
    let (pre, _src) = initiator("prefill-0", trusting(&c.cert), PAGE, PAGE).await;
    let e = pre.connect(&addr(&dec)).await.unwrap_err();
    match &e {
        Error::Incompatible { peer, step, .. } => {
            assert_eq!(*step, Step::Tls, "{e}");
            assert_eq!(peer, &addr(&dec), "{e}");
        }
        _ => panic!("expected Incompatible at the TLS step, got {e}"),
    }
    let s = dec.stats().await.unwrap();
    assert_eq!((s.tls_refused, s.sessions), (1, 0));
    assert_eq!(pre.stats().await.unwrap().sessions, 0);
}

/// The listener serves `served`; the initiator trusts `trusted` (and checks `name`, when
/// set): the handshake must fail with `Unauthenticated` at the TLS step, detail containing
/// `why`.
async fn certificate_refused(served: &Cert, trusted: &str, name: Option<&str>, why: &str) {
    let (dec, _kv) = listener("decode-0", serve_with(served), PAGE, PAGE).await;
    let (pre, _src) = initiator(
        "prefill-0",
        |cfg| {
            trusting(trusted)(cfg);
            if let Some(t) = cfg.tls.as_mut() {
                t.server_name = name.map(str::to_string);
            }
        },
        PAGE,
        PAGE,
    )
    .await;
    let e = pre.connect(&addr(&dec)).await.unwrap_err();
    match &e {
        Error::Unauthenticated { peer, step, detail } => {
            assert_eq!(*step, Step::Tls, "{e}");
            assert_eq!(peer, &addr(&dec), "{e}");
            assert!(detail.contains(why), "{e}");
        }
        _ => panic!("expected Unauthenticated at the TLS step, got {e}"),
    }
    assert_eq!(pre.stats().await.unwrap().sessions, 0);
    assert_eq!(dec.stats().await.unwrap().established, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_certificate_fails_typed() {
    let served = self_signed(&["127.0.0.1"]);
    let other = self_signed(&["127.0.0.1"]);
    certificate_refused(&served, &other.cert, None, "certificate is not acceptable").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_certificate_fails_typed() {
    let mut p = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
    p.not_before = rcgen::date_time_ymd(2001, 1, 1);
    p.not_after = rcgen::date_time_ymd(2002, 1, 1);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = p.self_signed(&key).unwrap();
    let served = Cert {
        cert: cert.pem(),
        key: key.serialize_pem(),
    };
    certificate_refused(&served, &served.cert, None, "certificate expired").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_for_another_name_fails_typed() {
    let served = self_signed(&["decode-0.pool"]);
    // Dialled by IP: the certificate does not name 127.0.0.1.
    certificate_refused(&served, &served.cert, None, "not valid for name").await;
    // With the name it carries set explicitly, the same certificate is accepted.
    let (dec, _kv) = listener("decode-0", serve_with(&served), PAGE, PAGE).await;
    let (pre, _src) = initiator(
        "prefill-0",
        |cfg| {
            trusting(&served.cert)(cfg);
            cfg.tls.as_mut().unwrap().server_name = Some("decode-0.pool".into());
        },
        PAGE,
        PAGE,
    )
    .await;
    pre.connect(&addr(&dec)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_never_answers_the_tls_handshake_times_out_typed() {
    // A raw socket that accepts and stays silent.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = silent.local_addr().unwrap().to_string();
    let c = self_signed(&["127.0.0.1"]);
    let (pre, _src) = initiator(
        "prefill-0",
        |cfg| {
            trusting(&c.cert)(cfg);
            cfg.deadlines.handshake_step = Duration::from_millis(300);
        },
        PAGE,
        PAGE,
    )
    .await;
    let (dialled, _held) = tokio::join!(pre.connect(&at), silent.accept());
    match dialled.unwrap_err() {
        Error::Timeout { peer, step, after } => {
            assert_eq!(
                (peer, step, after),
                (at, Step::Tls, Duration::from_millis(300))
            );
        }
        e => panic!("expected Timeout at the TLS step, got {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misconfigured_tls_is_a_local_error_at_start() {
    // A listener without a certificate.
    let mut cfg = ChannelConfig::new("decode-0", Some("127.0.0.1:0"));
    cfg.tls = Some(TlsConfig::default());
    assert!(matches!(
        kvbridge::Channel::new(cfg).await,
        Err(Error::Local(_))
    ));
    // A key that does not belong to the certificate.
    let (a, b) = (self_signed(&["127.0.0.1"]), self_signed(&["127.0.0.1"]));
    let mut cfg = ChannelConfig::new("decode-0", Some("127.0.0.1:0"));
    cfg.tls = Some(TlsConfig {
        cert_chain: Some(Pem::Text(a.cert.clone())),
        private_key: Some(Pem::Text(b.key.clone())),
        ..TlsConfig::default()
    });
    match kvbridge::Channel::new(cfg).await {
        Err(Error::Local(m)) => assert!(!m.contains("PRIVATE KEY"), "{m}"),
        other => panic!("expected a local error, got {:?}", other.err()),
    }
    // An initiator without certificates to trust cannot dial.
    let mut cfg = ChannelConfig::new("prefill-0", None);
    cfg.tls = Some(TlsConfig::default());
    let pre = kvbridge::Channel::new(cfg).await.unwrap();
    assert!(matches!(
        pre.connect("127.0.0.1:1").await,
        Err(Error::Local(_))
    ));
}
