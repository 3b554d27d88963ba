//! Cross-memory attach (`process_vm_writev`/`readv`) for a same-host listener's caller
//! memory: used when permitted, TCP when turned off or refused (with the reason), grants and
//! bounds kept, and deregistration never followed by a write.
//!
//! Where this host forbids process_vm_* (a seccomp filter in a container), every test still
//! runs and asserts the TCP fallback and its reason instead.

mod common;
use common::*;
use kvbridge::{Channel, ChannelConfig, CmaStatus, Error, Grant, Op, PeerId, Region};
use std::time::Duration;

const PAGE: usize = 4096;

/// Whether this host lets us use cross-memory attach (the same process reads itself: only a
/// seccomp filter or an old kernel says no).
fn cma_here() -> bool {
    match kvbridge::cma_available() {
        Ok(()) => true,
        Err(why) => {
            eprintln!("cross-memory attach unavailable here: {why}; asserting the TCP fallback");
            false
        }
    }
}

/// A listener with one region of caller memory granted to every peer.
async fn raw_listener(cfg: impl FnOnce(&mut ChannelConfig)) -> (Channel, Region) {
    let mut c = ChannelConfig::new("decode-0", Some("127.0.0.1:0"));
    cfg(&mut c);
    let ch = Channel::new(c).await.unwrap();
    let r = raw_region(256 * PAGE, PAGE);
    ch.register(&r, Grant::AllPeers).unwrap();
    (ch, r)
}

fn bytes(r: &Region) -> Vec<u8> {
    let mut v = vec![0u8; r.len()];
    r.read_at(0, &mut v).unwrap();
    v
}

/// Writes `n` scattered pages (one op each, more than one system call's worth of iovecs
/// when n > 1024 is not needed: pages are 4 KiB, n ops) and reads them back; checks both.
async fn round_trip(pre: &Channel, peer: &PeerId, src: &Region, kv: &Region, seed: u64) {
    fill(src, seed);
    let n = 200;
    let ops: Vec<Op> = (0..n)
        .map(|i| Op::page(src, i, kv.id(), ((i * 37) % 256) as u64, PAGE))
        .collect();
    pre.write(peer, &ops).await.unwrap();
    let kvb = bytes(kv);
    let srcb = bytes(src);
    for i in 0..n {
        let r = (i * 37) % 256;
        assert!(
            kvb[r * PAGE..(r + 1) * PAGE] == srcb[i * PAGE..(i + 1) * PAGE],
            "page {i} → {r}"
        );
    }
    let back = Region::alloc(n * PAGE, PAGE).unwrap();
    pre.register(&back, Grant::AllPeers).unwrap();
    let ops: Vec<Op> = (0..n)
        .map(|i| Op::page(&back, i, kv.id(), ((i * 37) % 256) as u64, PAGE))
        .collect();
    pre.read(peer, &ops).await.unwrap();
    assert!(bytes(&back)[..] == srcb[..n * PAGE]);
    pre.deregister(back.id()).await.unwrap();
}

/// Cross-memory attach carries the batch when permitted (counted as such, not as TCP or
/// shm); an initiator with it turned off moves the same batch over TCP, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_memory_goes_over_cma_and_over_tcp_when_turned_off() {
    let here = cma_here();
    let (dec, kv) = raw_listener(|_| {}).await;
    let (pre, src) = initiator("prefill-0", |_| {}, 256 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    // Caller memory is never mapped: shm proper is not in use.
    assert_eq!(
        pre.peer_transport(&peer).await.unwrap(),
        kvbridge::Transport::Tcp
    );
    let st = pre.peer_cma(&peer).await.unwrap();
    round_trip(&pre, &peer, &src, &kv, 1).await;
    let s = pre.stats().await.unwrap();
    if here {
        assert_eq!(st, CmaStatus::Active);
        // The write and the read, each one batch.
        assert_eq!(s.cma_batches, 2, "{s:?}");
    } else {
        assert!(matches!(st, CmaStatus::Off(_)), "{st:?}");
        assert_eq!(s.cma_batches, 0);
    }
    assert_eq!(s.shm_batches, 0);

    let (off, src2) = initiator("prefill-1", |c| c.cma = false, 256 * PAGE, PAGE).await;
    let peer = off.connect(&addr(&dec)).await.unwrap();
    assert_eq!(
        off.peer_cma(&peer).await.unwrap(),
        CmaStatus::Off("disabled by configuration (KVBRIDGE_CMA=0)".into())
    );
    round_trip(&off, &peer, &src2, &kv, 2).await;
    let s = off.stats().await.unwrap();
    assert_eq!((s.cma_batches, s.shm_batches), (0, 0), "TCP carried it");
}

/// A listener with cross-memory attach off does not offer it: the initiator says so and
/// uses TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_with_cma_off_offers_none() {
    let (dec, kv) = raw_listener(|c| c.cma = false).await;
    let (pre, src) = initiator("prefill-0", |_| {}, 256 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    match pre.peer_cma(&peer).await.unwrap() {
        CmaStatus::Off(why) => assert!(why.contains("offers no cross-memory attach"), "{why}"),
        other => panic!("{other:?}"),
    }
    round_trip(&pre, &peer, &src, &kv, 3).await;
    assert_eq!(pre.stats().await.unwrap().cma_batches, 0);
}

/// Where the kernel refuses the probe (forced here by a hook, as ptrace_scope or another
/// user would), the initiator reports the reason and TCP carries the batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_probe_falls_back_to_tcp_with_the_reason() {
    let (dec, kv) = raw_listener(|_| {}).await;
    let (pre, src) = initiator("prefill-0", |c| c.hooks.cma_deny = true, 256 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    match pre.peer_cma(&peer).await.unwrap() {
        CmaStatus::Off(why) => assert!(why.contains("not permitted"), "{why}"),
        other => panic!("{other:?}"),
    }
    round_trip(&pre, &peer, &src, &kv, 4).await;
    assert_eq!(pre.stats().await.unwrap().cma_batches, 0);
}

/// Ops outside the region, and ops naming a region granted to another peer, are refused
/// with typed errors; nothing is written; the session keeps working over cma.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_bounds_and_ungranted_ops_are_refused() {
    let here = cma_here();
    let (dec, kv) = raw_listener(|_| {}).await;
    let other = raw_region(4 * PAGE, PAGE);
    dec.register(
        &other,
        Grant::Peers(vec![PeerId::new("someone-else").unwrap()]),
    )
    .unwrap();
    let (pre, src) = initiator("prefill-0", |_| {}, 256 * PAGE, PAGE).await;
    fill(&src, 9);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    // The ungranted region is neither listed nor offered by address.
    let regions = pre.peer_regions(&peer).await.unwrap();
    assert!(regions.iter().all(|r| r.id != other.id()));
    let e = pre
        .write(&peer, &[Op::page(&src, 0, other.id(), 0, PAGE)])
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidOp { .. }), "{e}");
    // One byte past the end, in an otherwise fine batch.
    let ops = [
        Op::page(&src, 0, kv.id(), 0, PAGE),
        Op {
            local: src.clone(),
            local_offset: 0,
            remote: kv.id(),
            remote_offset: kv.len() as u64 - PAGE as u64 + 1,
            len: PAGE,
        },
    ];
    let e = pre.write(&peer, &ops).await.unwrap_err();
    assert!(matches!(e, Error::InvalidOp { .. }), "{e}");
    assert!(bytes(&kv).iter().all(|&b| b == 0), "nothing was written");
    assert!(bytes(&other).iter().all(|&b| b == 0), "nothing was written");
    assert_eq!(pre.stats().await.unwrap().cma_batches, 0);
    pre.write(&peer, &[Op::page(&src, 1, kv.id(), 3, PAGE)])
        .await
        .unwrap();
    assert_eq!(
        pre.stats().await.unwrap().cma_batches,
        u64::from(here),
        "the session still copies directly"
    );
}

/// Deregistering caller memory while the initiator keeps writing into it by address: once
/// `deregister` returned, not one more byte lands, and the initiator's later writes fail
/// with a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_write_lands_after_deregister_returned() {
    let here = cma_here();
    let (dec, kv) = raw_listener(|_| {}).await;
    let (pre, src) = initiator("prefill-0", |_| {}, 16 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let writer = {
        let pre = pre.clone();
        let kv_id = kv.id();
        tokio::spawn(async move {
            let mut started = Some(started_tx);
            let mut ok = 0u64;
            for round in 1u64.. {
                // Every round writes different bytes: a late write shows.
                src.write_at(0, &vec![round as u8 | 1; 16 * PAGE]).unwrap();
                let ops: Vec<Op> = (0..16)
                    .map(|i| {
                        Op::page(
                            &src,
                            i,
                            kv_id,
                            ((round as usize * 16 + i) % 256) as u64,
                            PAGE,
                        )
                    })
                    .collect();
                match tokio::time::timeout(Duration::from_secs(10), pre.write(&peer, &ops)).await {
                    Ok(Ok(())) => {
                        ok += 1;
                        if ok == 20 {
                            let _ = started.take().map(|t| t.send(()));
                        }
                    }
                    Ok(Err(e)) => return (ok, e),
                    Err(_) => panic!("a write hung"),
                }
                if round > 1_000_000 {
                    panic!("writes never failed after deregister");
                }
            }
            unreachable!()
        })
    };
    tokio::time::timeout(Duration::from_secs(10), started_rx)
        .await
        .expect("writes started")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), dec.deregister(kv.id()))
        .await
        .expect("deregister returned in time")
        .unwrap();
    let snapshot = bytes(&kv);
    assert!(snapshot.iter().any(|&b| b != 0), "writes landed before");
    let (ok, err) = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("writer ended")
        .unwrap();
    assert!(ok >= 20);
    // Revoked while copying (cma), refused by the listener (TCP), or no longer granted.
    assert!(
        matches!(
            &err,
            Error::Rejected {
                code: kvbridge::proto::msg::ErrorCode::UnknownRegion,
                ..
            } | Error::InvalidOp { .. }
                | Error::PeerMisbehaved { .. }
        ),
        "{err}"
    );
    // Give a late copy every chance to land, then compare.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        bytes(&kv) == snapshot,
        "a write landed after deregister returned"
    );
    assert_eq!(kv.cma_exports(), 0);
    assert!(!kv.is_tainted());
    if here {
        assert!(pre.stats().await.unwrap().cma_batches >= 20);
    }
}

/// A frame off a unix socket that carries no descriptors (bounded wait).
async fn next_frame(s: &mut tokio::net::UnixStream) -> kvbridge::proto::msg::Message {
    use kvbridge::proto::frame::{FrameHeader, DEFAULT_MAX_FRAME_LEN, FRAME_HEADER_LEN};
    use tokio::io::AsyncReadExt;
    let read = async {
        let mut h = [0u8; FRAME_HEADER_LEN];
        s.read_exact(&mut h).await.unwrap();
        let h = FrameHeader::decode(&h, DEFAULT_MAX_FRAME_LEN).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).await.unwrap();
        kvbridge::proto::msg::Message::decode(&body).unwrap()
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .expect("a frame in time")
}

/// A peer that handshakes by hand and asks for cross-memory attach: it gets the listener's
/// region addresses only after echoing the canary, and only for regions granted to it.
/// With a wrong echo it gets none, and `ShmSync` still comes (it then uses TCP).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn addresses_go_only_to_a_peer_that_read_the_canary_and_only_for_its_grants() {
    use kvbridge::proto::ids::Blob;
    use kvbridge::proto::msg::*;
    use tokio::io::AsyncWriteExt;
    let (dec, kv) = raw_listener(|_| {}).await;
    let other = raw_region(PAGE, PAGE);
    dec.register(
        &other,
        Grant::Peers(vec![PeerId::new("someone-else").unwrap()]),
    )
    .unwrap();
    let target = addr(&dec);
    for (name, honest) in [("liar", false), ("honest", true)] {
        let (_ctl, w) = hello(&target, name).await;
        let offer = w.shm.clone().expect("a shared-memory offer on this host");
        assert!(offer.cma, "the listener offers cross-memory attach");
        let hello = Message::DataHello(DataHello {
            token: w.token,
            peer_id: PeerId::new(name).unwrap(),
            stream: 0,
        });
        let mut data = tokio::net::TcpStream::connect(&target).await.unwrap();
        send_frame(&mut data, &hello).await;
        let a = {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(offer.socket.as_bytes()).unwrap()
        };
        let s = std::os::unix::net::UnixStream::connect_addr(&a).unwrap();
        s.set_nonblocking(true).unwrap();
        let mut s = tokio::net::UnixStream::from_std(s).unwrap();
        s.write_all(&hello.to_frame().unwrap()).await.unwrap();
        // No memfd region here: the first round is just the sync.
        assert!(matches!(next_frame(&mut s).await, Message::ShmSync(_)));
        s.write_all(&Message::CmaAsk(Ready {}).to_frame().unwrap())
            .await
            .unwrap();
        let Message::CmaProbe(c) = next_frame(&mut s).await else {
            panic!("no probe")
        };
        assert_eq!(c.len, 32);
        let data = if honest {
            // Same process: reading the canary needs no system call.
            // SAFETY: the listener keeps its canary alive for the session.
            unsafe { std::slice::from_raw_parts(c.addr as *const u8, c.len as usize) }.to_vec()
        } else {
            vec![0u8; c.len as usize]
        };
        let echo = Message::CmaProbed(CmaEcho {
            data: Blob(data),
            error: None,
        });
        s.write_all(&echo.to_frame().unwrap()).await.unwrap();
        let mut offered = Vec::new();
        loop {
            match next_frame(&mut s).await {
                Message::ShmMap(r) => offered.push(r),
                Message::ShmSync(_) => break,
                other => panic!("{}", other.name()),
            }
        }
        if honest {
            assert_eq!(
                offered,
                vec![ShmRegion {
                    id: kv.id(),
                    len: kv.len() as u64,
                    addr: Some(kv.as_ptr() as u64),
                }]
            );
            // Counted from before the address left, while the peer is connected.
            assert_eq!(kv.cma_exports(), 1);
        } else {
            assert!(offered.is_empty(), "{offered:?}");
            assert_eq!(kv.cma_exports(), 0);
        }
        assert_eq!(other.cma_exports(), 0);
    }
    // The honest peer closed its connections: that is its word that it stopped copying.
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while kv.cma_exports() != 0 {
        assert!(std::time::Instant::now() < until, "export never released");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!kv.is_tainted());
}

/// A batch of several MiB is copied by several threads at once on a host with more than one
/// core (`transport/split_copy.rs`); its pages, scattered on both sides and cut between the
/// threads' parts wherever the bytes fall, arrive byte-exact both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_scattered_batches_split_over_threads_round_trip_byte_exact() {
    const BIG: usize = 12 * 1024 + 512;
    // More than one system call's iovecs, 18.7 MiB in all; an odd count, so that halves
    // (and thirds, quarters) of the batch cut a page between two threads.
    const PAGES: usize = 1535;
    let here = cma_here();
    let dec = {
        let mut c = ChannelConfig::new("decode-0", Some("127.0.0.1:0"));
        c.cma = true;
        Channel::new(c).await.unwrap()
    };
    let kv = raw_region(PAGES * BIG, BIG);
    dec.register(&kv, Grant::AllPeers).unwrap();
    let (pre, src) = initiator("prefill-0", |_| {}, PAGES * BIG, BIG).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    fill(&src, 7);
    let to = |i: usize| (i * 769) % PAGES;
    let ops: Vec<Op> = (0..PAGES)
        .map(|i| Op::page(&src, i, kv.id(), to(i) as u64, BIG))
        .collect();
    pre.write(&peer, &ops).await.unwrap();
    let (kvb, srcb) = (bytes(&kv), bytes(&src));
    for i in 0..PAGES {
        let r = to(i);
        assert!(
            kvb[r * BIG..(r + 1) * BIG] == srcb[i * BIG..(i + 1) * BIG],
            "written page {i} → {r} differs"
        );
    }
    let back = raw_region(PAGES * BIG, BIG);
    pre.register(&back, Grant::AllPeers).unwrap();
    let from = |i: usize| (i * 389) % PAGES;
    let ops: Vec<Op> = (0..PAGES)
        .map(|i| Op::page(&back, i, kv.id(), from(i) as u64, BIG))
        .collect();
    pre.read(&peer, &ops).await.unwrap();
    let backb = bytes(&back);
    for i in 0..PAGES {
        let r = from(i);
        assert!(
            backb[i * BIG..(i + 1) * BIG] == kvb[r * BIG..(r + 1) * BIG],
            "read page {r} → {i} differs"
        );
    }
    let s = pre.stats().await.unwrap();
    assert_eq!(s.cma_batches, if here { 2 } else { 0 }, "{s:?}");
}
