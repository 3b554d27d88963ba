//! Bearer-token windows (`Channel::open_token_window`), attacked by peers that hold the
//! secret (or reach a listener without one) and misbehave on purpose: a region whose reads
//! (or writes) are confined to windows serves a peer only inside the windows of the grant
//! token its batch names, or its own; anything else is refused with `AccessDenied`, nothing
//! of it moves, and the owner learns which authenticated peers used a token.

mod common;
use common::*;
use kvbridge::proto::msg::{Batch, ErrorCode, MemInfo, MemKind, Message, OpDesc, RegionInfo};
use kvbridge::{
    new_grant_token, Access, Channel, Error, Grant, GrantToken, Op, PeerId, Region, Step,
};
use std::time::Duration;
use tokio::io::AsyncReadExt;

const PAGE: usize = 4096;
const PAGES: usize = 8;

fn peer(name: &str) -> PeerId {
    PeerId::new(name).unwrap()
}

/// A region of `PAGES` pages of a pattern, in caller memory when `raw`.
fn kv_region(raw: bool, seed: u64) -> Region {
    let r = if raw {
        raw_region(PAGES * PAGE, PAGE)
    } else {
        Region::alloc(PAGES * PAGE, PAGE).unwrap()
    };
    fill(&r, seed);
    r
}

fn page_of(r: &Region, page: usize) -> Vec<u8> {
    let mut b = vec![0u8; PAGE];
    r.read_at(page * PAGE, &mut b).unwrap();
    b
}

/// Local page `l` ↔ remote page `r` of `remote`, for each pair.
fn ops(local: &Region, remote: &Region, pages: &[(usize, u64)]) -> Vec<Op> {
    pages
        .iter()
        .map(|&(l, r)| Op::page(local, l, remote.id(), r, PAGE))
        .collect()
}

/// Connects again once both sides dropped the session a refusal ended.
async fn reconnect(me: &Channel, owner: &Channel) -> PeerId {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (a, b) = (me.stats().await.unwrap(), owner.stats().await.unwrap());
        if (a.established == 0 && b.established == 0) || std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    me.connect(&addr(owner)).await.unwrap()
}

/// The prefiller's case on every transport: its KV is read-only with reads confined to
/// windows; the decoder reads the request's pages under the token, byte for byte, over TCP
/// whatever the transport (the region is not offered for direct copies); without the
/// token, outside its window, and after it closed, the read is refused and nothing lands,
/// and the session goes on (a refused read moves nothing: it ends no session).
async fn token_windows_hold(t: Carrier) {
    let cfg = |c: &mut kvbridge::ChannelConfig| t.apply(c);
    let (pre, _own) = listener("prefill-0", cfg, PAGE, PAGE).await;
    let kv = kv_region(t.raw, 42);
    pre.register(&kv, Grant::AllPeers.read_only().reads_in_windows())
        .unwrap();
    let (dec, dst) = initiator("decode-0", cfg, PAGES * PAGE, PAGE).await;
    let p = dec.connect(&addr(&pre)).await.unwrap();
    assert_transport(&dec, &p, t).await;

    let tok = new_grant_token();
    pre.open_token_window(
        kv.id(),
        &tok,
        2 * PAGE as u64,
        3 * PAGE as u64,
        Access::ReadOnly,
    )
    .unwrap();
    dec.read_with_grant(&p, tok, &ops(&dst, &kv, &[(0, 2), (1, 3), (2, 4)]))
        .await
        .unwrap();
    for i in 0..3 {
        assert!(page_of(&dst, i) == page_of(&kv, 2 + i), "page {i} differs");
    }
    assert_eq!(pre.token_users(&tok), vec![peer("decode-0")]);
    let s = dec.stats().await.unwrap();
    assert_eq!(
        (s.shm_batches, s.cma_batches, s.ucx_batches),
        (0, 0, 0),
        "a windowed region was reached without the owner"
    );

    // No token: refused, nothing read.
    let zero = vec![0u8; PAGE];
    assert_denied(
        dec.read(&p, &ops(&dst, &kv, &[(5, 2)])).await,
        "prefill-0",
        Step::Read,
        "for reading",
    );
    assert!(page_of(&dst, 5) == zero, "a refused read landed");
    // The token, one page past its window.
    assert_denied(
        dec.read_with_grant(&p, tok, &ops(&dst, &kv, &[(5, 4), (6, 5)]))
            .await,
        "prefill-0",
        Step::Read,
        "grant token",
    );
    assert!(page_of(&dst, 5) == zero && page_of(&dst, 6) == zero);
    // After the close.
    let closed = pre.close_token(&tok).unwrap();
    assert_eq!(closed.users, vec![peer("decode-0")]);
    assert!(closed.drain.is_drained());
    assert_denied(
        dec.read_with_grant(&p, tok, &ops(&dst, &kv, &[(5, 2)]))
            .await,
        "prefill-0",
        Step::Read,
        "grant token",
    );
    assert!(page_of(&dst, 5) == zero);
    let s = pre.stats().await.unwrap();
    assert_eq!(
        (s.access_denied, s.sessions_ended, s.established),
        (3, 0, 1)
    );
    assert_eq!(dec.stats().await.unwrap().sessions_ended, 0);
    assert!(pre.token_users(&tok).is_empty());
}

per_transport!(token_windows_hold_per_transport, super::token_windows_hold);

/// A read refused for its windows ends no session: racing it on the same session, the
/// decoder's reads under its token complete byte for byte, while the refused ones (outside
/// the token's window, under another token, without a token) fail with `AccessDenied`,
/// nothing of them landing; the session is still the same afterwards and serves again. A
/// refused write (its payload follows its header) still ends the session.
async fn a_refused_read_ends_no_session(t: Carrier) {
    let cfg = |c: &mut kvbridge::ChannelConfig| t.apply(c);
    let (pre, _own) = listener("prefill-0", cfg, PAGE, PAGE).await;
    let kv = kv_region(t.raw, 17);
    pre.register(&kv, Grant::AllPeers.read_only().reads_in_windows())
        .unwrap();
    let tok = new_grant_token();
    pre.open_token_window(kv.id(), &tok, 0, 4 * PAGE as u64, Access::ReadOnly)
        .unwrap();
    let (dec, dst) = initiator("decode-0", cfg, PAGES * PAGE, PAGE).await;
    let p = dec.connect(&addr(&pre)).await.unwrap();
    let read = |grant: Option<GrantToken>, pages: Vec<(usize, u64)>| {
        let (dec, p, o) = (dec.clone(), p.clone(), ops(&dst, &kv, &pages));
        tokio::spawn(async move {
            match grant {
                Some(g) => dec.read_with_grant(&p, g, &o).await,
                None => dec.read(&p, &o).await,
            }
        })
    };
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for (i, (grant, page)) in [(Some(tok), 5u64), (Some(new_grant_token()), 0), (None, 1)]
        .into_iter()
        .enumerate()
    {
        good.push(read(Some(tok), vec![(i, i as u64)]));
        bad.push((i, read(grant, vec![(5 + i, page)])));
    }
    good.push(read(Some(tok), vec![(3, 3)]));
    for g in good {
        g.await.unwrap().expect("a read inside the token's window");
    }
    for (i, b) in bad {
        let needle = if i == 2 { "for reading" } else { "grant token" };
        assert_denied(b.await.unwrap(), "prefill-0", Step::Read, needle);
    }
    let zero = vec![0u8; PAGE];
    for i in 0..4 {
        assert!(page_of(&dst, i) == page_of(&kv, i), "page {i} differs");
    }
    for i in 5..8 {
        assert!(
            page_of(&dst, i) == zero,
            "a refused read landed in page {i}"
        );
    }
    let s = pre.stats().await.unwrap();
    assert_eq!(
        (s.access_denied, s.sessions_ended, s.established),
        (3, 0, 1)
    );
    assert_eq!(dec.stats().await.unwrap().sessions_ended, 0);
    // The same session serves again.
    dec.read_with_grant(&p, tok, &ops(&dst, &kv, &[(4, 2)]))
        .await
        .unwrap();
    assert!(page_of(&dst, 4) == page_of(&kv, 2));
    assert_eq!(pre.token_users(&tok), vec![peer("decode-0")]);
    // A refused write still ends the session.
    assert_denied(
        dec.write(&p, &ops(&dst, &kv, &[(0, 6)])).await,
        "prefill-0",
        Step::Write,
        "writes refused",
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while pre.stats().await.unwrap().sessions_ended == 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(pre.stats().await.unwrap().sessions_ended, 1);
}

per_transport!(
    a_refused_read_ends_no_session_per_transport,
    super::a_refused_read_ends_no_session
);

/// Two decoders that hold the token (and the secret) both read under it and are both its
/// users, by the ids their sessions authenticated; a third with another token is refused
/// and is not one, nor is a fourth that reads through a window open to it by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_peer_that_reads_under_a_token_is_its_user() {
    let secret = kvbridge::proto::auth::Secret::new(b"0123456789abcdef0123".to_vec()).unwrap();
    let cfg = |c: &mut kvbridge::ChannelConfig| {
        c.transport = kvbridge::Transport::Tcp;
        c.secret = Some(secret.clone());
    };
    let (pre, _own) = listener("prefill-0", cfg, PAGE, PAGE).await;
    let kv = kv_region(false, 7);
    pre.register(&kv, Grant::AllPeers.read_only().reads_in_windows())
        .unwrap();
    let tok = new_grant_token();
    pre.open_token_window(kv.id(), &tok, 0, 4 * PAGE as u64, Access::ReadOnly)
        .unwrap();
    pre.open_peer_window(
        kv.id(),
        &peer("decode-3"),
        4 * PAGE as u64,
        PAGE as u64,
        Access::ReadOnly,
    )
    .unwrap();
    let mut readers = Vec::new();
    for name in ["decode-1", "decode-0", "decode-2", "decode-3"] {
        let (ch, dst) = initiator(name, cfg, PAGES * PAGE, PAGE).await;
        let p = ch.connect(&addr(&pre)).await.unwrap();
        readers.push((ch, dst, p));
    }
    for (i, (ch, dst, p)) in readers.iter().take(2).enumerate() {
        ch.read_with_grant(p, tok, &ops(dst, &kv, &[(0, i as u64)]))
            .await
            .unwrap();
        assert!(page_of(dst, 0) == page_of(&kv, i));
    }
    let (ch, dst, p) = &readers[2];
    assert_denied(
        ch.read_with_grant(p, new_grant_token(), &ops(dst, &kv, &[(0, 0)]))
            .await,
        "prefill-0",
        Step::Read,
        "grant token",
    );
    let (ch, dst, p) = &readers[3];
    ch.read_with_grant(p, tok, &ops(dst, &kv, &[(0, 4)]))
        .await
        .unwrap();
    let users = vec![peer("decode-0"), peer("decode-1")];
    assert_eq!(pre.token_users(&tok), users);
    assert_eq!(pre.close_token(&tok).unwrap().users, users);
}

/// The LMCache receiver's case: its arena takes writes only inside windows; a sender
/// writes the pages of a request under the request's token and nowhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_under_a_token_land_only_inside_its_windows() {
    let cfg = |c: &mut kvbridge::ChannelConfig| c.transport = kvbridge::Transport::Auto;
    let (rx, _own) = listener("receiver", cfg, PAGE, PAGE).await;
    let arena = Region::alloc(PAGES * PAGE, PAGE).unwrap();
    rx.register(&arena, Grant::AllPeers.write_only().writes_in_windows())
        .unwrap();
    let tok = new_grant_token();
    rx.open_token_window(
        arena.id(),
        &tok,
        PAGE as u64,
        2 * PAGE as u64,
        Access::WriteOnly,
    )
    .unwrap();
    let (tx, src) = initiator("sender", cfg, PAGES * PAGE, PAGE).await;
    fill(&src, 99);
    let p = tx.connect(&addr(&rx)).await.unwrap();
    tx.write_with_grant(&p, tok, &ops(&src, &arena, &[(0, 1), (1, 2)]))
        .await
        .unwrap();
    assert!(page_of(&arena, 1) == page_of(&src, 0));
    assert!(page_of(&arena, 2) == page_of(&src, 1));
    assert_eq!(rx.token_users(&tok), vec![peer("sender")]);
    let zero = vec![0u8; PAGE];
    for (case, grant, pages) in [
        ("past the window", Some(tok), [(2, 3)]),
        ("inside it, without the token", None, [(2, 1)]),
        (
            "inside it, another token",
            Some(new_grant_token()),
            [(2, 1)],
        ),
    ] {
        let p = reconnect(&tx, &rx).await;
        let o = ops(&src, &arena, &pages);
        let r = match grant {
            Some(g) => tx.write_with_grant(&p, g, &o).await,
            None => tx.write(&p, &o).await,
        };
        assert_denied(r, "receiver", Step::Write, "for writing");
        assert!(page_of(&arena, 3) == zero, "{case}: a refused write landed");
        assert!(page_of(&arena, 1) == page_of(&src, 0), "{case}");
    }
}

/// Closing a token's window stops new reads at once, and its drain waits for the read
/// admitted before the close (its response still being sent): that read completes, byte
/// for byte, and only then is the drain done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_token_window_drains_the_reads_it_admitted() {
    let (pre, _own) = listener(
        "prefill-0",
        |c| {
            c.transport = kvbridge::Transport::Tcp;
            c.hooks.read_serve_delay = Some(Duration::from_millis(300));
        },
        PAGE,
        PAGE,
    )
    .await;
    let kv = kv_region(false, 5);
    pre.register(&kv, Grant::AllPeers.read_only().reads_in_windows())
        .unwrap();
    let tok = new_grant_token();
    let w = pre
        .open_token_window(kv.id(), &tok, 0, PAGE as u64, Access::ReadOnly)
        .unwrap();
    let (dec, dst) = initiator("decode-0", |_| {}, PAGES * PAGE, PAGE).await;
    let p = dec.connect(&addr(&pre)).await.unwrap();
    let reading = {
        let (dec, p, o) = (dec.clone(), p.clone(), ops(&dst, &kv, &[(0, 0)]));
        tokio::spawn(async move { dec.read_with_grant(&p, tok, &o).await })
    };
    // Admitted: its peer is recorded before any byte moves.
    let t = std::time::Instant::now();
    while pre.token_users(&tok).is_empty() && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let drain = pre.close_window(w).expect("open");
    assert!(
        !drain.is_drained(),
        "the admitted read is still being served"
    );
    tokio::time::timeout(Duration::from_secs(5), drain.drained())
        .await
        .expect("drained once the response is sent");
    reading.await.unwrap().expect("admitted before the close");
    assert!(page_of(&dst, 0) == page_of(&kv, 0));
    assert_denied(
        dec.read_with_grant(&p, tok, &ops(&dst, &kv, &[(1, 0)]))
            .await,
        "prefill-0",
        Step::Read,
        "grant token",
    );
}

/// A peer written by hand, which says what it likes in its frames: the owner checks the
/// token it names and records the session's own id as the user, whatever the peer claims;
/// a refused read leaves the connection open; a token that is not 16 bytes ends the
/// session before anything is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_written_peer_gets_exactly_what_the_token_opens() {
    let (pre, _own) = listener(
        "prefill-0",
        |c| c.transport = kvbridge::Transport::Tcp,
        PAGE,
        PAGE,
    )
    .await;
    let kv = kv_region(false, 11);
    pre.register(&kv, Grant::AllPeers.read_only().reads_in_windows())
        .unwrap();
    let tok = new_grant_token();
    pre.open_token_window(kv.id(), &tok, PAGE as u64, PAGE as u64, Access::ReadOnly)
        .unwrap();
    let read = |offset: u64, grant: Option<GrantToken>| {
        Message::ReadBatch(Batch {
            id: 1,
            ops: vec![OpDesc {
                region: kv.id(),
                offset,
                len: PAGE as u64,
            }],
            grant,
        })
    };
    let target = addr(&pre);
    for (case, batch) in [
        ("no token", read(PAGE as u64, None)),
        ("another token", read(PAGE as u64, Some(new_grant_token()))),
        ("outside the window", read(0, Some(tok))),
    ] {
        let (_ctl, mut data, _) = handshake_as(&target, "mallory").await;
        send_frame(&mut data, &batch).await;
        match recv_frame(&mut data).await {
            Some(Message::ReadResp(a)) => {
                let e = a.error.expect("refused");
                assert_eq!(e.code, ErrorCode::AccessDenied, "{case}: {e:?}");
            }
            other => panic!("{case}: {other:?}"),
        }
        // Nothing follows the refusal, and the connection stays open: a refused read
        // ends no session.
        let mut b = [0u8; 1];
        let r = tokio::time::timeout(Duration::from_millis(300), data.read(&mut b)).await;
        assert!(r.is_err(), "{case}: {r:?}");
    }
    assert!(pre.token_users(&tok).is_empty());

    // A token of 15 bytes: not a batch at all.
    let (_ctl, mut data, _) = handshake_as(&target, "mallory").await;
    // Encoded with a real token, then its `bin 16` cut to `bin 15`.
    let t16 = new_grant_token();
    let whole = read(PAGE as u64, Some(t16)).encode_body().unwrap();
    let mut field = vec![0xc4, 16];
    field.extend_from_slice(&t16.to_bytes());
    let at = whole
        .windows(field.len())
        .position(|w| w == field)
        .expect("the token's bin");
    let mut body = whole[..at].to_vec();
    body.extend_from_slice(&[0xc4, 15]);
    body.extend_from_slice(&t16.to_bytes()[..15]);
    body.extend_from_slice(&whole[at + field.len()..]);
    assert!(Message::decode(&body).is_err());
    let mut frame = kvbridge::proto::FrameHeader::encode(body.len() as u32).to_vec();
    frame.extend_from_slice(&body);
    tokio::io::AsyncWriteExt::write_all(&mut data, &frame)
        .await
        .unwrap();
    let mut b = [0u8; 64];
    let r = tokio::time::timeout(Duration::from_secs(5), data.read(&mut b)).await;
    assert!(matches!(r, Ok(Ok(0)) | Ok(Err(_))), "{r:?}");
    assert!(pre.token_users(&tok).is_empty());

    // The token, inside its window: served byte for byte, and the user is the session's.
    let (_ctl, mut data, _) = handshake_as(&target, "mallory").await;
    send_frame(&mut data, &read(PAGE as u64, Some(tok))).await;
    match recv_frame(&mut data).await {
        Some(Message::ReadResp(a)) => assert_eq!(a.error, None),
        other => panic!("{other:?}"),
    }
    let mut got = vec![0u8; PAGE];
    tokio::time::timeout(Duration::from_secs(5), data.read_exact(&mut got))
        .await
        .unwrap()
        .unwrap();
    assert!(got == page_of(&kv, 1));
    assert_eq!(pre.token_users(&tok), vec![peer("mallory")]);
    assert_eq!(pre.stats().await.unwrap().access_denied, 3);
}

/// A peer that predates grant tokens (its `Hello` does not say `grant_tokens`) still has
/// its session; naming a token to it fails typed, before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_never_named_to_a_peer_that_predates_them() {
    let (pre, _own) = listener(
        "prefill-0",
        |c| c.transport = kvbridge::Transport::Tcp,
        PAGE,
        PAGE,
    )
    .await;
    let (mut ctl, _data, _) = handshake_as(&addr(&pre), "old-decoder").await;
    let theirs = RegionInfo {
        id: kvbridge::RegionId([3; 16]),
        len: PAGE as u64,
        page_size: PAGE as u64,
        kind: MemKind::Cpu,
    };
    send_frame(
        &mut ctl,
        &Message::MemInfo(MemInfo {
            regions: vec![theirs.clone()],
        }),
    )
    .await;
    let old = peer("old-decoder");
    let t = std::time::Instant::now();
    while pre.peer_regions(&old).await.unwrap().is_empty() && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mine = Region::alloc(PAGE, PAGE).unwrap();
    pre.register(&mine, Grant::Peers(vec![])).unwrap();
    let op = [Op {
        local: mine.clone(),
        local_offset: 0,
        remote: theirs.id,
        remote_offset: 0,
        len: PAGE,
    }];
    match pre.write_with_grant(&old, new_grant_token(), &op).await {
        Err(Error::Incompatible {
            peer, step, theirs, ..
        }) => {
            assert_eq!(peer, "old-decoder");
            assert_eq!(step, Step::Write);
            assert!(theirs.contains("grant_tokens"), "{theirs}");
        }
        other => panic!("expected Incompatible, got {other:?}"),
    }
    let s = pre.stats().await.unwrap();
    assert_eq!((s.established, s.batches_in_flight), (1, 0));
}

/// Shared memory cannot be checked: a region registered `with_direct_copies` is mapped by a
/// same-host peer, which then reads all of it without a token. A batch that names a token
/// still goes over TCP, where the owner checks it and records its user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_direct_copies_a_same_host_peer_reads_everything_but_token_batches_are_checked() {
    let cfg = |c: &mut kvbridge::ChannelConfig| c.transport = kvbridge::Transport::Shm;
    let (pre, _own) = listener("prefill-0", cfg, PAGE, PAGE).await;
    let kv = kv_region(false, 3);
    pre.register(
        &kv,
        Grant::AllPeers
            .read_only()
            .reads_in_windows()
            .with_direct_copies(),
    )
    .unwrap();
    let tok = new_grant_token();
    pre.open_token_window(kv.id(), &tok, 0, PAGE as u64, Access::ReadOnly)
        .unwrap();
    let arena = kv_region(false, 0);
    pre.register(
        &arena,
        kvbridge::Permission::from(Grant::AllPeers)
            .writes_in_windows()
            .with_direct_copies(),
    )
    .unwrap();
    let wtok = new_grant_token();
    pre.open_token_window(arena.id(), &wtok, 0, PAGE as u64, Access::WriteOnly)
        .unwrap();
    let (dec, dst) = initiator("decode-0", cfg, PAGES * PAGE, PAGE).await;
    let p = dec.connect(&addr(&pre)).await.unwrap();
    assert_eq!(
        dec.peer_transport(&p).await.unwrap(),
        kvbridge::Transport::Shm
    );
    dec.read(&p, &ops(&dst, &kv, &[(1, 5)])).await.unwrap();
    assert!(page_of(&dst, 1) == page_of(&kv, 5), "no window, still read");
    assert!(pre.token_users(&tok).is_empty());
    let shm = dec.stats().await.unwrap().shm_batches;
    dec.read_with_grant(&p, tok, &ops(&dst, &kv, &[(0, 0)]))
        .await
        .unwrap();
    assert_eq!(dec.stats().await.unwrap().shm_batches, shm, "went over shm");
    assert_eq!(pre.token_users(&tok), vec![peer("decode-0")]);
    // A write under a token into a direct region: the caller would copy it into the
    // mapping; it goes over TCP instead. (Without the token it is copied.)
    dec.write(&p, &ops(&dst, &arena, &[(0, 1)])).await.unwrap();
    let before = shm;
    let shm = dec.stats().await.unwrap().shm_batches;
    assert_eq!(
        shm,
        before + 1,
        "the direct region is mapped and copied into"
    );
    dec.write_with_grant(&p, wtok, &ops(&dst, &arena, &[(0, 0)]))
        .await
        .unwrap();
    assert!(page_of(&arena, 0) == page_of(&dst, 0));
    assert_eq!(dec.stats().await.unwrap().shm_batches, shm, "went over shm");
    assert_eq!(pre.token_users(&wtok), vec![peer("decode-0")]);
    assert_denied(
        dec.read_with_grant(&p, tok, &ops(&dst, &kv, &[(2, 2)]))
            .await,
        "prefill-0",
        Step::Read,
        "grant token",
    );
}
