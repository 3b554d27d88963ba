//! A channel's own key (`ChannelConfig::peer_key`), on real sockets: it proves the dialer's
//! id to a listener whose keyring binds that id, while the channel's own listener still
//! takes the shared secret from others (a decode's probe of a prefill), and a holder of the
//! shared secret who claims the bound id is refused at the handshake.

mod common;
use common::*;
use kvbridge::proto::auth::{Keyring, Secret};
use kvbridge::proto::PeerId;
use kvbridge::{Channel, ChannelConfig, Error, Op, Transport};
use std::time::Duration;

const PAGE: usize = 4096;
const SHARED: &str = "the-shared-secret-xx";
const KEY_P: &str = "key-of-prefill-0-xxxx";

fn secret(s: &str) -> Option<Secret> {
    Secret::new(s.as_bytes().to_vec())
}

/// A decode whose keyring binds "prefill-0" to its key, beside the shared secret; TCP, so
/// every data connection answers the session's data-key challenge.
async fn binding_decode() -> (Channel, kvbridge::Region) {
    let mut ring = Keyring::new();
    ring.insert(PeerId::new("prefill-0").unwrap(), secret(KEY_P).unwrap());
    listener(
        "decode-0",
        |c| {
            c.secret = secret(SHARED);
            c.peer_keys = Some(ring);
            c.transport = Transport::Tcp;
        },
        4 * PAGE,
        PAGE,
    )
    .await
}

/// A listening prefill holding the shared secret and, when `own` is set, its own key.
async fn prefill(name: &str, secret_: &str, own: Option<&str>) -> (Channel, kvbridge::Region) {
    listener(
        name,
        |c| {
            c.secret = secret(secret_);
            c.peer_key = own.and_then(secret);
            c.transport = Transport::Tcp;
        },
        4 * PAGE,
        PAGE,
    )
    .await
}

async fn page_of(r: &kvbridge::Region, page: usize) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    r.read_at(page * PAGE, &mut b).unwrap();
    b
}

/// Waits (at most 5 s) until `ch` has counted `n` failed authentications.
async fn auth_failed_reaches(ch: &Channel, n: u64) -> u64 {
    let t = std::time::Instant::now();
    loop {
        let got = ch.stats().await.unwrap().auth_failed;
        if got >= n || t.elapsed() > Duration::from_secs(5) {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The real prefill (shared secret + its own key) writes to the decode that binds its id,
/// and its own listener takes the decode's probe, which holds only the shared secret. An
/// impostor holding the shared secret who claims "prefill-0", with no own key or a wrong
/// one, is refused at the handshake (`Unauthenticated`, counted in the decode's
/// `auth_failed`), lands no byte, and leaves the real session in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_own_key_binds_the_dialer_while_its_listener_takes_the_shared_secret() {
    let (dec, kv) = binding_decode().await;
    let (pre, src) = prefill("prefill-0", SHARED, Some(KEY_P)).await;
    fill(&src, 11);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_eq!(peer.as_str(), "decode-0");
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 0, PAGE)])
        .await
        .unwrap();
    assert_eq!(page_of(&kv, 0).await, page_of(&src, 0).await);

    // The decode's probe dials the prefill's listener with the shared secret alone.
    let (probe, _) = initiator("decode-0/probe", |c| c.secret = secret(SHARED), PAGE, PAGE).await;
    let got = probe.connect(&addr(&pre)).await.unwrap();
    assert_eq!(got.as_str(), "prefill-0");
    probe.notify(&got, b"ping").await.unwrap();

    let before = dec.stats().await.unwrap().auth_failed;
    for (n, own) in [None, Some("not-the-key-of-prefill-0")]
        .into_iter()
        .enumerate()
    {
        let (imp, isrc) = initiator(
            "prefill-0",
            |c| {
                c.secret = secret(SHARED);
                c.peer_key = own.and_then(secret);
                c.transport = Transport::Tcp;
            },
            PAGE,
            PAGE,
        )
        .await;
        fill(&isrc, 99);
        let e = imp.connect(&addr(&dec)).await.unwrap_err();
        assert!(matches!(e, Error::Unauthenticated { .. }), "{own:?}: {e}");
        let want = before + n as u64 + 1;
        assert_eq!(auth_failed_reaches(&dec, want).await, want, "{own:?}");
    }
    // No byte of the impostors' landed; the real session is still the one that writes.
    assert_eq!(page_of(&kv, 0).await, page_of(&src, 0).await);
    assert_eq!(page_of(&kv, 1).await, vec![0u8; PAGE]);
    pre.write(&peer, &[Op::page(&src, 1, kv.id(), 1, PAGE)])
        .await
        .unwrap();
    assert_eq!(page_of(&kv, 1).await, page_of(&src, 1).await);
}

/// The same key dials a listener that binds nothing (shared secret only): the dialer falls
/// back to the shared secret, so an own key costs no listener that predates the keyring.
/// Without the own key, the old way (the key held as the channel's secret) still binds the
/// id, and its listener refuses the shared-secret probe: why the own key exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_own_key_falls_back_to_the_shared_secret_and_the_old_way_still_binds() {
    let (shared_only, kv) = listener(
        "decode-1",
        |c| {
            c.secret = secret(SHARED);
            c.transport = Transport::Tcp;
        },
        PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = prefill("prefill-0", SHARED, Some(KEY_P)).await;
    fill(&src, 12);
    let peer = pre.connect(&addr(&shared_only)).await.unwrap();
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 0, PAGE)])
        .await
        .unwrap();
    assert_eq!(page_of(&kv, 0).await, page_of(&src, 0).await);

    let (dec, kv) = binding_decode().await;
    let (old, osrc) = prefill("prefill-0", KEY_P, None).await;
    fill(&osrc, 13);
    let peer = old.connect(&addr(&dec)).await.unwrap();
    old.write(&peer, &[Op::page(&osrc, 0, kv.id(), 0, PAGE)])
        .await
        .unwrap();
    let (probe, _) = initiator("decode-0/probe", |c| c.secret = secret(SHARED), PAGE, PAGE).await;
    let e = probe.connect(&addr(&old)).await.unwrap_err();
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e}");
}

/// A bad own key fails the channel at startup with a configuration error naming the
/// setting: too short, equal to the shared secret, or on a listener that would take
/// unauthenticated peers. An initiator-only channel may hold it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_own_key_is_refused_at_startup_naming_the_setting() {
    let refused = |c: ChannelConfig, says: &'static str| async move {
        let e = Channel::new(c).await.unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::Local(_)), "{m}");
        assert!(m.contains("KVBRIDGE_PEER_KEY") && m.contains(says), "{m}");
    };
    for listen in [Some("127.0.0.1:0"), None] {
        let mut c = ChannelConfig::new("prefill-0", listen);
        c.secret = secret(SHARED);
        c.peer_key = secret("short-key");
        refused(c, "9 bytes; at least 16").await;
        let mut c = ChannelConfig::new("prefill-0", listen);
        c.secret = secret(SHARED);
        c.peer_key = secret(SHARED);
        refused(c, "is the shared secret").await;
    }
    let mut c = ChannelConfig::new("prefill-0", Some("127.0.0.1:0"));
    c.secret = None;
    c.peer_key = secret(KEY_P);
    refused(c, "unauthenticated").await;
    let mut c = ChannelConfig::new("prefill-0", None);
    c.secret = None;
    c.peer_key = secret(KEY_P);
    Channel::new(c).await.unwrap();
}
