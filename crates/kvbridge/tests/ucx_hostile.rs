//! Peers that break the UCX negotiation, spoken by hand against a real channel: a hostile
//! initiator (replayed, misdirected and unknown UCX messages) gets a typed `Bye` and loses
//! its session; a hostile listener (an offer with garbage bytes, an offer its `Welcome` did
//! not announce, an oversized host identity, no offer at all, a key before the accept, keys
//! with garbage bytes) gets a decline or a typed refusal, and the initiator's `connect`
//! returns by its deadline.
#![cfg(feature = "ucx")]

mod common;
use common::*;
use kvbridge::proto::ids::Blob;
use kvbridge::proto::msg::*;
use kvbridge::proto::{Incarnation, PeerId, RegionId, SessionToken};
use kvbridge::{Error, Op, Transport};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const PAGE: usize = 4096;

fn ucx(c: &mut kvbridge::ChannelConfig) {
    Carrier::ucx("tcp").apply(c);
}

/// Reads control frames until one `pick` accepts (at most 16 frames, 5 s each).
async fn recv_until<T>(s: &mut TcpStream, mut pick: impl FnMut(Message) -> Option<T>) -> T {
    for _ in 0..16 {
        let m = recv_frame(s)
            .await
            .expect("the connection ended or stalled");
        if let Some(t) = pick(m) {
            return t;
        }
    }
    panic!("not within 16 frames");
}

/// A `Bye` or `Reject` with `code` arrives, then the connection ends.
async fn expect_refusal(s: &mut TcpStream, code: ErrorCode) {
    let r = recv_until(s, |m| match m {
        Message::Bye(r) | Message::Reject(r) => Some(r),
        _ => None,
    })
    .await;
    assert_eq!(r.code, code, "{}", r.message);
    let mut b = [0u8; 64];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut b)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return,
            Ok(Ok(_)) => continue,
            Err(_) => panic!("the connection stayed open after the refusal"),
        }
    }
}

// ---- a hostile initiator against a UCX listener ----

/// A hand-spoken initiator that says `ucx` in its `Hello`, up to the listener's `UcxOffer`.
/// Returns (control, data).
async fn ucx_session(target: &str, name: &str) -> (TcpStream, TcpStream) {
    let mut ctl = TcpStream::connect(target).await.unwrap();
    let me = PeerId::new(name).unwrap();
    send_frame(
        &mut ctl,
        &Message::Hello(Hello {
            version: 1,
            peer_id: me.clone(),
            incarnation: Incarnation(1),
            compat: Compat::default(),
            auth: None,
            unacked_notify: false,
            host_after_proof: false,
            data_proof: false,
            data_connections: 0,
            ucx: true,
            grant_tokens: false,
        }),
    )
    .await;
    let Some(Message::Welcome(w)) = recv_frame(&mut ctl).await else {
        panic!("no welcome")
    };
    assert!(w.ucx, "a UCX listener announces its offer in the Welcome");
    send_frame(&mut ctl, &Message::MemInfo(MemInfo::default())).await;
    let mut data = TcpStream::connect(target).await.unwrap();
    send_frame(
        &mut data,
        &Message::DataHello(DataHello {
            token: w.token,
            peer_id: me,
            stream: 0,
        }),
    )
    .await;
    recv_until(&mut ctl, |m| {
        matches!(m, Message::UcxOffer(_)).then_some(())
    })
    .await;
    (ctl, data)
}

/// The listener still serves a real UCX initiator, byte-exact, after the hostile one.
/// A good initiator's UCX write lands on `dec`; its channel is returned, so that its session
/// stays up for as long as the caller holds it.
async fn still_serves(dec: &kvbridge::Channel, kv: &kvbridge::Region) -> kvbridge::Channel {
    let (pre, src) = initiator("prefill-good", ucx, 2 * PAGE, PAGE).await;
    fill(&src, 11);
    let peer = pre.connect(&addr(dec)).await.unwrap();
    assert_transport(&pre, &peer, Carrier::ucx("tcp")).await;
    pre.write(&peer, &[Op::page(&src, 1, kv.id(), 2, PAGE)])
        .await
        .unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    src.read_at(PAGE, &mut a).unwrap();
    kv.read_at(2 * PAGE, &mut b).unwrap();
    assert!(a == b, "the page differs");
    pre
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_initiator_s_ucx_messages_end_its_session_with_a_typed_bye() {
    let (dec, kv) = listener("decode-0", ucx, 4 * PAGE, PAGE).await;
    let target = addr(&dec);
    let unknown = ShmRevoke {
        id: RegionId([0x5a; 16]),
    };
    // An acknowledgement of an unmap nobody asked for.
    let (mut ctl, _data) = ucx_session(&target, "hostile-1").await;
    send_frame(&mut ctl, &Message::UcxUnmapped(unknown.clone())).await;
    expect_refusal(&mut ctl, ErrorCode::UnexpectedMessage).await;
    // A replayed accept: the first one gets the keys, the second a refusal.
    let (mut ctl, _data) = ucx_session(&target, "hostile-2").await;
    send_frame(&mut ctl, &Message::UcxAccept(Ready {})).await;
    let key = recv_until(&mut ctl, |m| match m {
        Message::UcxMap(r) => Some(r),
        _ => None,
    })
    .await;
    assert_eq!((key.id, key.len), (kv.id(), kv.len() as u64));
    send_frame(&mut ctl, &Message::UcxAccept(Ready {})).await;
    expect_refusal(&mut ctl, ErrorCode::UnexpectedMessage).await;
    // A listener's message sent the wrong way.
    let (mut ctl, _data) = ucx_session(&target, "hostile-3").await;
    send_frame(&mut ctl, &Message::UcxMap(key)).await;
    expect_refusal(&mut ctl, ErrorCode::UnexpectedMessage).await;
    // Only the good session is left: the hostile ones ended (its own is held up until then).
    let _good = still_serves(&dec, &kv).await;
    for _ in 0..200 {
        if dec.stats().await.unwrap().sessions == 1 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("hostile sessions left: {:?}", dec.stats().await.unwrap());
}

// ---- a hostile listener against a UCX initiator ----

/// A listener spoken by hand up to its `Ready`, saying `ucx` in its `Welcome` as told, and
/// granting one region of 4 pages. Returns (control, data).
async fn raw_listener(l: &TcpListener, ucx: bool) -> (TcpStream, TcpStream) {
    let (mut ctl, _) = l.accept().await.unwrap();
    let Some(Message::Hello(h)) = recv_frame(&mut ctl).await else {
        panic!("no hello")
    };
    assert!(h.ucx, "a UCX initiator says so in its Hello");
    send_frame(
        &mut ctl,
        &Message::Welcome(Welcome {
            version: 1,
            peer_id: PeerId::new("raw-decoder").unwrap(),
            incarnation: Incarnation(7),
            token: SessionToken([9; 16]),
            compat: h.compat,
            auth: None,
            shm: None,
            unacked_notify: false,
            host_after_proof: false,
            data_proof: false,
            ucx,
            grant_tokens: false,
        }),
    )
    .await;
    assert!(matches!(
        recv_frame(&mut ctl).await,
        Some(Message::MemInfo(_))
    ));
    let (mut data, _) = l.accept().await.unwrap();
    assert!(matches!(
        recv_frame(&mut data).await,
        Some(Message::DataHello(_))
    ));
    let regions = vec![RegionInfo {
        id: RegionId([3; 16]),
        len: 4 * PAGE as u64,
        page_size: PAGE as u64,
        kind: MemKind::Cpu,
    }];
    send_frame(&mut ctl, &Message::MemInfo(MemInfo { regions })).await;
    send_frame(&mut ctl, &Message::Ready(Ready {})).await;
    (ctl, data)
}

/// A UCX initiator whose handshake step is `step` (its negotiation settles within 2 steps).
async fn ucx_initiator(step: Duration) -> kvbridge::Channel {
    initiator(
        "prefill-0",
        |c| {
            ucx(c);
            c.deadlines.handshake_step = step;
        },
        4 * PAGE,
        PAGE,
    )
    .await
    .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_with_garbage_bytes_is_declined_and_the_session_uses_tcp() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap().to_string();
    let pre = ucx_initiator(Duration::from_secs(10)).await;
    let hostile = async {
        let (mut ctl, data) = raw_listener(&l, true).await;
        let mut garbage = vec![0u8; 300];
        for (i, b) in garbage.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37) ^ 0x5c;
        }
        send_frame(
            &mut ctl,
            &Message::UcxOffer(UcxAddress {
                address: Blob(garbage),
                host: None,
                pid: None,
            }),
        )
        .await;
        let d = recv_until(&mut ctl, |m| match m {
            Message::UcxDecline(d) => Some(d),
            _ => None,
        })
        .await;
        (ctl, data, d)
    };
    let (peer, (_ctl, _data, decline)) =
        tokio::join!(async { pre.connect(&at).await.unwrap() }, hostile);
    assert!(!decline.reason.is_empty());
    eprintln!("declined: {}", decline.reason);
    assert_eq!(pre.peer_transport(&peer).await.unwrap(), Transport::Tcp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_with_an_oversized_host_identity_fails_the_connect_by_name() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap().to_string();
    let pre = ucx_initiator(Duration::from_secs(10)).await;
    let hostile = async {
        let (mut ctl, data) = raw_listener(&l, true).await;
        send_frame(
            &mut ctl,
            &Message::UcxOffer(UcxAddress {
                address: Blob(vec![1; 64]),
                host: Some("h".repeat(MAX_UCX_HOST_LEN + 1)),
                pid: None,
            }),
        )
        .await;
        (ctl, data)
    };
    let (r, _kept) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(30), pre.connect(&at)),
        hostile
    );
    let r = r.expect("the connect did not return");
    match r {
        Err(e) => {
            eprintln!("refused: {e}");
            assert!(e.to_string().contains("raw-decoder"), "names the peer: {e}");
        }
        Ok(p) => panic!("a session started after an oversized host identity: {p}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_the_welcome_did_not_announce_ends_the_session() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap().to_string();
    let pre = ucx_initiator(Duration::from_secs(10)).await;
    let (peer, (mut ctl, _data)) = tokio::join!(
        async { pre.connect(&at).await.unwrap() },
        raw_listener(&l, false)
    );
    // No UCX announced: the session started at once, over TCP.
    assert_eq!(pre.peer_transport(&peer).await.unwrap(), Transport::Tcp);
    send_frame(
        &mut ctl,
        &Message::UcxOffer(UcxAddress {
            address: Blob(vec![1; 64]),
            host: None,
            pid: None,
        }),
    )
    .await;
    expect_refusal(&mut ctl, ErrorCode::UnexpectedMessage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_offer_after_an_announcing_welcome_settles_on_tcp_at_the_deadline() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap().to_string();
    let step = Duration::from_millis(1500);
    let pre = ucx_initiator(step).await;
    let t0 = Instant::now();
    let hostile = async {
        let (mut ctl, data) = raw_listener(&l, true).await;
        let d = recv_until(&mut ctl, |m| match m {
            Message::UcxDecline(d) => Some(d),
            _ => None,
        })
        .await;
        (ctl, data, d)
    };
    let (peer, (_ctl, _data, decline)) =
        tokio::join!(async { pre.connect(&at).await.unwrap() }, hostile);
    let took = t0.elapsed();
    eprintln!("connect took {took:?}; declined: {}", decline.reason);
    // Held until the negotiation settled, at its deadline (two steps), not later.
    assert!(took >= 2 * step, "connect returned after {took:?}");
    assert!(took < 2 * step + Duration::from_secs(10), "{took:?}");
    assert_eq!(pre.peer_transport(&peer).await.unwrap(), Transport::Tcp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_before_the_accept_fails_the_connect_with_a_typed_error() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = l.local_addr().unwrap().to_string();
    let pre = ucx_initiator(Duration::from_secs(10)).await;
    let hostile = async {
        let (mut ctl, data) = raw_listener(&l, true).await;
        send_frame(
            &mut ctl,
            &Message::UcxMap(UcxRegion {
                id: RegionId([3; 16]),
                base: 0x1000,
                len: 4 * PAGE as u64,
                rkey: Blob(vec![7; 32]),
            }),
        )
        .await;
        expect_refusal(&mut ctl, ErrorCode::UnexpectedMessage).await;
        data
    };
    let (r, _data) = tokio::join!(pre.connect(&at), hostile);
    match r {
        Err(Error::PeerMisbehaved { peer, detail, .. }) => {
            assert_eq!(peer, "raw-decoder");
            assert!(detail.contains("UcxMap"), "{detail}");
        }
        r => panic!("expected PeerMisbehaved, got {r:?}"),
    }
}

// ---- garbage keys from a real listener, through a proxy that corrupts them ----

/// Forwards `from` to `to` frame by frame, replacing every `UcxMap`'s key with garbage.
async fn corrupt_keys(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
) {
    loop {
        let mut h = [0u8; 8];
        if from.read_exact(&mut h).await.is_err() {
            return;
        }
        let Ok(hdr) = kvbridge::proto::frame::FrameHeader::decode(&h, 1 << 24) else {
            return;
        };
        let mut body = vec![0u8; hdr.body_len as usize];
        if from.read_exact(&mut body).await.is_err() {
            return;
        }
        let frame = match Message::decode(&body) {
            Ok(Message::UcxMap(mut r)) => {
                for b in r.rkey.0.iter_mut() {
                    *b ^= 0xa5;
                }
                Message::UcxMap(r).to_frame().unwrap()
            }
            _ => [&h[..], &body[..]].concat(),
        };
        if to.write_all(&frame).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_with_garbage_bytes_are_refused_and_the_region_goes_over_tcp() {
    let (dec, kv) = listener("decode-0", ucx, 4 * PAGE, PAGE).await;
    let target = addr(&dec);
    let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = proxy.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        // The first connection is the control connection; the rest carry data unchanged.
        for n in 0..8 {
            let Ok((c, _)) = proxy.accept().await else {
                return;
            };
            let s = TcpStream::connect(&target).await.unwrap();
            let (cr, cw) = c.into_split();
            let (sr, sw) = s.into_split();
            tokio::spawn(async move {
                let (mut cr, mut sw) = (cr, sw);
                let _ = tokio::io::copy(&mut cr, &mut sw).await;
            });
            if n == 0 {
                tokio::spawn(corrupt_keys(sr, cw));
            } else {
                tokio::spawn(async move {
                    let (mut sr, mut cw) = (sr, cw);
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                });
            }
        }
    });
    let (pre, src) = initiator("prefill-0", ucx, 4 * PAGE, PAGE).await;
    fill(&src, 5);
    let peer = pre.connect(&at).await.unwrap();
    // The key did not unpack: the region goes over TCP, and writes still land.
    assert_eq!(pre.peer_transport(&peer).await.unwrap(), Transport::Tcp);
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 3, PAGE)])
        .await
        .unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    src.read_at(0, &mut a).unwrap();
    kv.read_at(3 * PAGE, &mut b).unwrap();
    assert!(a == b, "the page differs");
}
