//! The Channel API end to end over real loopback sockets.

mod common;
use common::*;
use kvbridge::{Channel, ChannelConfig, Error, Grant, Op, Region, Step, Transport};
use std::time::Duration;

const PAGE: usize = 16 << 10;

/// Both data-path drivers (dedicated blocking threads, tokio tasks) must behave the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_read_notify_round_trip_on_data_threads() {
    write_read_notify_round_trip(true, Transport::Tcp.into()).await
}

async fn round_trip_on(t: Carrier) {
    write_read_notify_round_trip(true, t).await
}
per_transport!(
    write_read_notify_round_trip_per_transport,
    super::round_trip_on
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_read_notify_round_trip_on_data_tasks() {
    write_read_notify_round_trip(false, Transport::Tcp.into()).await
}

async fn write_read_notify_round_trip(threads: bool, t: Carrier) {
    let cfg = |c: &mut kvbridge::ChannelConfig| {
        c.data_threads = threads;
        t.apply(c);
    };
    let (dec, kv) = listener("decode-0", cfg, 64 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", cfg, 8 * PAGE, PAGE).await;
    fill(&src, 1);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_eq!(peer.as_str(), "decode-0");
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
    assert_eq!(n.peer.as_str(), "prefill-0");
    for i in 0..8usize {
        let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
        src.read_at(i * PAGE, &mut a).unwrap();
        kv.read_at((63 - i * 7) * PAGE, &mut b).unwrap();
        assert!(a == b, "page {i} differs");
    }
    // Read back into a second local region.
    let back = Region::alloc(8 * PAGE, PAGE).unwrap();
    pre.register(&back, Grant::AllPeers).unwrap();
    let rops: Vec<Op> = (0..8)
        .map(|i| Op::page(&back, i, kv.id(), (63 - i * 7) as u64, PAGE))
        .collect();
    pre.read(&peer, &rops).await.unwrap();
    let (mut a, mut b) = (vec![0u8; 8 * PAGE], vec![0u8; 8 * PAGE]);
    src.read_at(0, &mut a).unwrap();
    back.read_at(0, &mut b).unwrap();
    assert!(a == b);
    let s = pre.stats().await.unwrap();
    assert_eq!(s.established, 1);
    assert_eq!(s.batches_in_flight, 0);
    // The write and the read, both on the worker over UCX; none anywhere else.
    let over_ucx = if t.transport == Transport::Ucx { 2 } else { 0 };
    assert_eq!(s.ucx_batches, over_ucx, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_writes_into_initiator_regions() {
    let (dec, kv) = listener("decode-0", |_| {}, 4 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", |_| {}, 4 * PAGE, PAGE).await;
    fill(&kv, 9);
    pre.connect(&addr(&dec)).await.unwrap();
    let p = kvbridge::PeerId::new("prefill-0").unwrap();
    dec.write(&p, &[Op::page(&kv, 2, src.id(), 1, PAGE)])
        .await
        .unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    kv.read_at(2 * PAGE, &mut a).unwrap();
    src.read_at(PAGE, &mut b).unwrap();
    assert!(a == b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_connects_share_one_handshake() {
    let (dec, _kv) = listener("decode-0", |_| {}, PAGE, PAGE).await;
    let (pre, _src) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    let a = addr(&dec);
    let joins: Vec<_> = (0..16)
        .map(|_| {
            let pre = pre.clone();
            let a = a.clone();
            tokio::spawn(async move { pre.connect(&a).await })
        })
        .collect();
    for j in joins {
        assert_eq!(j.await.unwrap().unwrap().as_str(), "decode-0");
    }
    let s = dec.stats().await.unwrap();
    assert_eq!(s.sessions_ended, 0, "a second handshake replaced the first");
    assert_eq!(s.established, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_misuse_is_a_typed_error_and_keeps_the_session() {
    let (dec, kv) = listener("decode-0", |_| {}, 4 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", |_| {}, 4 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let e = pre
        .write(&peer, &[Op::page(&src, 0, kv.id(), 4, PAGE)])
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidOp { .. }), "{e}");
    let e = pre
        .write(
            &peer,
            &[Op::page(&src, 0, kvbridge::RegionId([7; 16]), 0, PAGE)],
        )
        .await
        .unwrap_err();
    assert!(matches!(e, Error::InvalidOp { .. }), "{e}");
    let e = pre
        .write(&kvbridge::PeerId::new("nobody").unwrap(), &[])
        .await
        .unwrap_err();
    assert!(matches!(e, Error::UnknownPeer { .. }), "{e}");
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 3, PAGE)])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_fails_in_flight_work_with_closed() {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.hooks.write_apply_delay = Some(Duration::from_secs(30)),
        4 * PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator("prefill-0", |_| {}, 4 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let p2 = pre.clone();
    let (src2, kvid) = (src.clone(), kv.id());
    let w =
        tokio::spawn(async move { p2.write(&peer, &[Op::page(&src2, 0, kvid, 0, PAGE)]).await });
    // Wait until the batch is in flight.
    wait_in_flight(&pre).await;
    pre.close().await;
    let e = tokio::time::timeout(Duration::from_secs(5), w)
        .await
        .unwrap()
        .unwrap()
        .unwrap_err();
    assert_eq!(e, Error::Closed);
    let _ = Step::Write;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn op_deadline_fails_the_batch_and_the_session() {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.hooks.write_apply_delay = Some(Duration::from_secs(30)),
        4 * PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| c.deadlines.op = Duration::from_millis(200),
        4 * PAGE,
        PAGE,
    )
    .await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let t = std::time::Instant::now();
    let e = pre
        .write(&peer, &[Op::page(&src, 0, kv.id(), 0, PAGE)])
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Timeout {
                step: Step::Write,
                ..
            }
        ),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(5));
    let s = pre.stats().await.unwrap();
    assert_eq!((s.sessions, s.tokens, s.dialing), (0, 0, 0), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_ends_one_session_and_fails_its_work() {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.hooks.write_apply_delay = Some(Duration::from_secs(30)),
        4 * PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator("prefill-0", |_| {}, 4 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let mut events = dec.peer_events();
    let p2 = pre.clone();
    let (src2, kvid, peer2) = (src.clone(), kv.id(), peer.clone());
    let w =
        tokio::spawn(async move { p2.write(&peer2, &[Op::page(&src2, 0, kvid, 0, PAGE)]).await });
    wait_in_flight(&pre).await;
    pre.disconnect(&peer, "sender gave up").await.unwrap();
    let e = w.await.unwrap().unwrap_err();
    assert!(matches!(e, Error::Disconnected { .. }), "{e}");
    // The peer saw the session go down, with our reason (its `Up` may come first: the
    // subscription began after our connect returned).
    let error = loop {
        match tokio::time::timeout(Duration::from_secs(5), events.recv())
            .await
            .unwrap()
            .unwrap()
        {
            kvbridge::PeerEvent::Down { error, .. } => break error,
            kvbridge::PeerEvent::Up { .. } => continue,
        }
    };
    assert!(error.to_string().contains("sender gave up"), "{error}");
    let e = pre.disconnect(&peer, "again").await.unwrap_err();
    assert!(matches!(e, Error::UnknownPeer { .. }), "{e}");
    // A new connect starts a fresh session.
    pre.connect(&addr(&dec)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notifications_carry_the_session_incarnation() {
    let (dec, _kv) = listener("decode-0", |_| {}, PAGE, PAGE).await;
    let (pre, _src) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    pre.notify(&peer, b"x").await.unwrap();
    let n = dec.recv_notification().await.unwrap();
    assert_eq!(n.incarnation, pre.incarnation());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregister_waits_for_writes_in_flight_then_refuses_new_ones() {
    // Long enough that a loaded machine still sees the write held.
    let h = held_writes(Duration::from_secs(2)).await;
    let w = h.spawn_write(1);
    let HeldWrites {
        dec,
        kv,
        pre,
        src,
        peer,
    } = h;
    let kvid = kv.id();
    // Wait until the listener has accepted the batch (the region is in use by it).
    let t = std::time::Instant::now();
    while kv.in_use() == 0 && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert_eq!(kv.in_use(), 1, "write never reached the listener");
    dec.deregister(kv.id()).await.unwrap();
    // deregister returned only after the held write landed: nothing can write there now.
    assert_eq!(kv.in_use(), 0);
    w.await.unwrap().unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    src.read_at(0, &mut a).unwrap();
    kv.read_at(PAGE, &mut b).unwrap();
    assert!(a == b);
    drop(kv); // the memory is freed here; a later write must not reach it
    let e = pre
        .write(&peer, &[Op::page(&src, 0, kvid, 1, PAGE)])
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidOp { .. } | Error::Rejected { .. } | Error::PeerMisbehaved { .. }
        ),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_owned_memory_receives_writes() {
    let dec = kvbridge::Channel::new(kvbridge::ChannelConfig::new(
        "decode-0",
        Some("127.0.0.1:0"),
    ))
    .await
    .unwrap();
    let mut buf = vec![0u8; 4 * PAGE];
    // SAFETY: `buf` outlives the region: it is deregistered (and its handle dropped) before
    // `buf` goes out of scope, and nothing else touches it meanwhile.
    let r = unsafe { Region::from_raw(buf.as_mut_ptr(), buf.len(), PAGE) }.unwrap();
    dec.register(&r, Grant::AllPeers).unwrap();
    let (pre, src) = initiator("prefill-0", |_| {}, PAGE, PAGE).await;
    fill(&src, 11);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    pre.write(&peer, &[Op::page(&src, 0, r.id(), 2, PAGE)])
        .await
        .unwrap();
    dec.deregister(r.id()).await.unwrap();
    drop(r);
    let mut a = vec![0u8; PAGE];
    src.read_at(0, &mut a).unwrap();
    assert!(buf[2 * PAGE..3 * PAGE] == a[..]);
    assert!(buf[..2 * PAGE].iter().all(|&b| b == 0) && buf[3 * PAGE..].iter().all(|&b| b == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_held_in_flight_fails_cleanly_when_the_session_ends() {
    let (dec, kv) = listener(
        "decode-0",
        |c| c.hooks.read_serve_delay = Some(Duration::from_secs(30)),
        4 * PAGE,
        PAGE,
    )
    .await;
    let (pre, dst) = initiator("prefill-0", |_| {}, 4 * PAGE, PAGE).await;
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    let p2 = pre.clone();
    let (dst2, kvid, peer2) = (dst.clone(), kv.id(), peer.clone());
    let r =
        tokio::spawn(async move { p2.read(&peer2, &[Op::page(&dst2, 0, kvid, 0, PAGE)]).await });
    wait_in_flight(&pre).await;
    pre.disconnect(&peer, "test").await.unwrap();
    let e = r.await.unwrap().unwrap_err();
    assert!(matches!(e, Error::Disconnected { .. }), "{e}");
    // The destination is no longer in use: nothing of the read can land now.
    assert_eq!(dst.in_use(), 0);
}

/// The listener deregisters a region while the initiator writes into it in a loop: the
/// writes fail with a typed error, nothing crashes, and once `deregister` returned no byte
/// lands in the region's memory (the owner reuses it at once).
async fn deregister_while_the_initiator_writes(t: Carrier) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let (dec, kv) = listener("decode-0", |c| t.apply(c), 64 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", |c| t.apply(c), 16 * PAGE, PAGE).await;
    fill(&src, 9);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    let done = Arc::new(AtomicUsize::new(0));
    let (p2, peer2, kvid, d2) = (pre.clone(), peer.clone(), kv.id(), done.clone());
    let ops: Vec<Op> = (0..16)
        .map(|i| Op::page(&src, i, kvid, 4 * i as u64, PAGE))
        .collect();
    let w = tokio::spawn(async move {
        let t0 = std::time::Instant::now();
        // Bounded in count and in time.
        for _ in 0..200_000 {
            if let Err(e) = p2.write(&peer2, &ops).await {
                return Some(e);
            }
            d2.fetch_add(1, Ordering::Relaxed);
            if t0.elapsed() > Duration::from_secs(20) {
                break;
            }
        }
        None
    });
    let t0 = std::time::Instant::now();
    while done.load(Ordering::Relaxed) < 10 && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(done.load(Ordering::Relaxed) >= 10, "writes never got going");
    dec.deregister(kv.id()).await.unwrap();
    assert_eq!(kv.exports(), 0, "a peer still maps the region");
    // The owner reuses the memory at once.
    kv.write_at(0, &vec![0xEE; kv.len()]).unwrap();
    let e = w
        .await
        .unwrap()
        .expect("writes into a deregistered region kept succeeding");
    assert!(
        matches!(
            e,
            Error::InvalidOp { .. } | Error::Rejected { .. } | Error::PeerMisbehaved { .. }
        ),
        "{e}"
    );
    let mut all = vec![0u8; kv.len()];
    kv.read_at(0, &mut all).unwrap();
    assert!(
        all.iter().all(|&b| b == 0xEE),
        "a write landed after deregister returned"
    );
}
per_transport!(
    deregister_while_writing,
    super::deregister_while_the_initiator_writes
);

/// A peer restart (same id, new incarnation) over each transport: the old session goes
/// `Down` with `PeerRestarted`, the new one works, and its writes land.
async fn peer_restart(t: Carrier) {
    let (dec, kv) = listener("decode-0", |c| t.apply(c), 16 * PAGE, PAGE).await;
    let mut events = dec.peer_events();
    let (pre, src) = initiator("prefill-0", |c| t.apply(c), 4 * PAGE, PAGE).await;
    fill(&src, 3);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    pre.write(&peer, &[Op::page(&src, 0, kv.id(), 1, PAGE)])
        .await
        .unwrap();
    let old = pre.incarnation();
    drop(pre); // killed without a goodbye: its tasks stop with the channel
    let (pre2, src2) = initiator("prefill-0", |c| t.apply(c), 4 * PAGE, PAGE).await;
    fill(&src2, 4);
    let peer = pre2.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre2, &peer, t).await;
    pre2.write(&peer, &[Op::page(&src2, 1, kv.id(), 2, PAGE)])
        .await
        .unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    src2.read_at(PAGE, &mut a).unwrap();
    kv.read_at(2 * PAGE, &mut b).unwrap();
    assert!(a == b);
    let t0 = std::time::Instant::now();
    let mut down = None;
    while down.is_none() && t0.elapsed() < Duration::from_secs(10) {
        match tokio::time::timeout(Duration::from_secs(10), events.recv()).await {
            Ok(Ok(kvbridge::PeerEvent::Down {
                incarnation, error, ..
            })) if incarnation == old => down = Some(error),
            Ok(Ok(_)) => {}
            _ => break,
        }
    }
    let e = down.expect("the old session never went down");
    assert!(
        matches!(
            e,
            Error::PeerRestarted { .. } | Error::ConnectionLost { .. } | Error::PeerClosed { .. }
        ),
        "{e}"
    );
}
per_transport!(peer_restart_per_transport, super::peer_restart);

/// Notifications queued without waiting (`notify_queued`) still follow the writes issued
/// before them, arrive in order, and are confirmed later.
async fn queued_notifications_follow_their_writes(t: Carrier) {
    let (dec, kv) = listener("decode-0", |c| t.apply(c), 16 * PAGE, PAGE).await;
    let (pre, src) = initiator("prefill-0", |c| t.apply(c), 8 * PAGE, PAGE).await;
    fill(&src, 5);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    let mut queued = Vec::new();
    for i in 0..8usize {
        pre.write(&peer, &[Op::page(&src, i, kv.id(), (15 - i) as u64, PAGE)])
            .await
            .unwrap();
        queued.push(pre.notify_queued(&peer, &[i as u8]).await.unwrap());
    }
    for i in 0..8usize {
        let n = tokio::time::timeout(Duration::from_secs(5), dec.recv_notification())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.data, [i as u8], "notifications out of order");
        // The page written before the notification has landed.
        let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
        src.read_at(i * PAGE, &mut a).unwrap();
        kv.read_at((15 - i) * PAGE, &mut b).unwrap();
        assert!(
            a == b,
            "page {i} not in place when its notification arrived"
        );
    }
    for q in queued {
        q.delivered().await.unwrap();
    }
}
per_transport!(
    queued_notifications_follow_their_writes_per_transport,
    super::queued_notifications_follow_their_writes
);

/// A queued notification whose peer goes away before confirming it fails typed when its
/// confirmation is awaited, long before the op deadline; it does not hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_notification_whose_peer_closes_fails_when_awaited() {
    // The listener holds each write 30 s, so the notification queued behind one cannot
    // be confirmed before the listener closes.
    let h = held_writes(Duration::from_secs(30)).await;
    let w = h.spawn_write(0);
    let HeldWrites { dec, pre, peer, .. } = h;
    // The write is entered (and, in the same poll, queued) before the notification.
    let t0 = std::time::Instant::now();
    while pre.stats().await.unwrap().batches_in_flight == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the write never started"
        );
        tokio::task::yield_now().await;
    }
    let q = pre
        .notify_queued(&peer, b"after the held write")
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    dec.close().await;
    let e = tokio::time::timeout(Duration::from_secs(10), q.delivered())
        .await
        .expect("the confirmation of a notification to a closed peer hung")
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::PeerClosed { .. } | Error::Disconnected { .. } | Error::ConnectionLost { .. }
        ),
        "{e:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
    assert!(w.await.unwrap().is_err(), "the held write succeeded");
}

/// A TCP listener that holds every write it applies for `hold` (the hook acts on the
/// batches the listener applies: TCP's), and an initiator connected to it over one data
/// connection (with several, a notification waits for the writes before it to complete
/// rather than queue behind them).
struct HeldWrites {
    dec: kvbridge::Channel,
    kv: Region,
    pre: kvbridge::Channel,
    src: Region,
    peer: kvbridge::PeerId,
}

async fn held_writes(hold: Duration) -> HeldWrites {
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            c.hooks.write_apply_delay = Some(hold);
            c.transport = Transport::Tcp;
        },
        4 * PAGE,
        PAGE,
    )
    .await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| {
            c.transport = Transport::Tcp;
            c.data_connections = 1;
        },
        4 * PAGE,
        PAGE,
    )
    .await;
    fill(&src, 5);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    HeldWrites {
        dec,
        kv,
        pre,
        src,
        peer,
    }
}

impl HeldWrites {
    /// Writes the initiator's page 0 into the listener's page `to`, in a task of its own.
    fn spawn_write(&self, to: u64) -> tokio::task::JoinHandle<kvbridge::Result<()>> {
        let (pre, peer, src, kv) = (
            self.pre.clone(),
            self.peer.clone(),
            self.src.clone(),
            self.kv.id(),
        );
        tokio::spawn(async move { pre.write(&peer, &[Op::page(&src, 0, kv, to, PAGE)]).await })
    }
}

/// A listener restarted in the same process binds its old address as soon as `close`
/// returns (the accept task, which owns the socket, is gone by then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_frees_the_listening_port_before_it_returns() {
    for _ in 0..20 {
        let first = Channel::new(ChannelConfig::new("decode-0", Some("127.0.0.1:0")))
            .await
            .unwrap();
        let addr = first.local_addr().expect("listening");
        first.close().await;
        let again = Channel::new(ChannelConfig::new("decode-0", Some(&addr.to_string())))
            .await
            .unwrap_or_else(|e| panic!("rebinding {addr} right after close: {e}"));
        again.close().await;
    }
}

/// A build without the `ucx` feature refuses `Transport::Ucx` with an error that says so,
/// instead of running over another transport.
#[cfg(not(feature = "ucx"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_without_the_feature_is_a_typed_configuration_error() {
    let mut c = ChannelConfig::new("prefill-0", None);
    c.transport = Transport::Ucx;
    match Channel::new(c).await {
        Err(Error::Local(m)) => assert!(m.contains("no UCX"), "{m}"),
        other => panic!(
            "expected a configuration error, got {:?}",
            other.map(|_| ())
        ),
    }
    assert_eq!(Transport::parse("ucx"), Some(Transport::Ucx));
}

/// A notification the peer's application received is confirmed to its sender even when the
/// peer closes its channel the moment it has it: `notify` returns `Ok`, not the peer's
/// `Bye` overtaking the confirmation. Repeated, as the close races the confirmation.
async fn a_notification_received_then_closed_on_is_confirmed(t: Carrier) {
    for round in 0..20 {
        let cfg = |c: &mut ChannelConfig| t.apply(c);
        let (dec, _kv) = listener("decode-0", cfg, 4 * PAGE, PAGE).await;
        let (pre, _src) = initiator("prefill-0", cfg, 4 * PAGE, PAGE).await;
        let peer = pre.connect(&addr(&dec)).await.unwrap();
        let closer = tokio::spawn(async move {
            let n = tokio::time::timeout(Duration::from_secs(10), dec.recv_notification())
                .await
                .expect("no notification within 10 s")
                .expect("the channel ended");
            dec.close().await;
            n.data
        });
        let r = tokio::time::timeout(Duration::from_secs(10), pre.notify(&peer, b"last"))
            .await
            .expect("notify hung");
        assert_eq!(closer.await.unwrap(), b"last");
        if let Err(e) = r {
            panic!("round {round}: a received notification failed at its sender: {e}");
        }
        pre.close().await;
    }
}
per_transport!(
    a_notification_received_then_closed_on_is_confirmed_per_transport,
    super::a_notification_received_then_closed_on_is_confirmed
);
