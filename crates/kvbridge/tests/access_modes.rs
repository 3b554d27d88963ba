//! Grants with an access mode: a peer reads a read-only region and writes a write-only one,
//! and the other direction is refused with a typed error naming the peer and the step, on
//! every transport (restricted regions are never offered for direct copies, so the
//! receiver does the copy and checks the mode).

mod common;
use common::*;
use kvbridge::{Grant, Op, Region, Step};

const PAGE: usize = 4096;

fn region(t: Carrier) -> Region {
    if t.raw {
        raw_region(2 * PAGE, PAGE)
    } else {
        Region::alloc(2 * PAGE, PAGE).unwrap()
    }
}

async fn modes_hold(t: Carrier) {
    let cfg = |c: &mut kvbridge::ChannelConfig| t.apply(c);
    let (dec, _rw) = listener("decode-0", cfg, 2 * PAGE, PAGE).await;
    let (ro, wo) = (region(t), region(t));
    fill(&ro, 7);
    dec.register(&ro, Grant::AllPeers.read_only()).unwrap();
    dec.register(&wo, Grant::AllPeers.write_only()).unwrap();
    let (pre, src) = initiator("prefill-0", cfg, 2 * PAGE, PAGE).await;
    fill(&src, 1);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;

    // The granted direction works.
    let back = Region::alloc(2 * PAGE, PAGE).unwrap();
    pre.register(&back, Grant::AllPeers).unwrap();
    pre.read(&peer, &[Op::page(&back, 0, ro.id(), 1, PAGE)])
        .await
        .unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    ro.read_at(PAGE, &mut a).unwrap();
    back.read_at(0, &mut b).unwrap();
    assert!(a == b, "read of the read-only region differs");
    pre.write(&peer, &[Op::page(&src, 0, wo.id(), 1, PAGE)])
        .await
        .unwrap();
    src.read_at(0, &mut a).unwrap();
    wo.read_at(PAGE, &mut b).unwrap();
    assert!(a == b, "write into the write-only region differs");

    // The other direction is refused, and nothing lands.
    let mut before = vec![0u8; 2 * PAGE];
    ro.read_at(0, &mut before).unwrap();
    write_into_read_only(&pre, &peer, &src, &ro).await;
    let mut after = vec![0u8; 2 * PAGE];
    ro.read_at(0, &mut after).unwrap();
    assert!(before == after, "a write landed in the read-only region");

    // The refusal ended that session (like any op outside a grant); a new one is refused a
    // read of the write-only region.
    let peer = reconnect(&pre, &dec).await;
    assert_denied(
        pre.read(&peer, &[Op::page(&back, 1, wo.id(), 1, PAGE)])
            .await,
        "decode-0",
        Step::Read,
        "granted",
    );
}

/// Writes `src`'s first page over the first page of `ro`, a region `decode-0` grants
/// read-only: the write is refused, `AccessDenied` at step write.
async fn write_into_read_only(
    pre: &kvbridge::Channel,
    peer: &kvbridge::PeerId,
    src: &Region,
    ro: &Region,
) {
    assert_denied(
        pre.write(peer, &[Op::page(src, 0, ro.id(), 0, PAGE)]).await,
        "decode-0",
        Step::Write,
        "granted",
    );
}

/// Connects again once both sides have dropped the session that broke the grant (a
/// connect before that could be handed the dying session, whose read then fails otherwise).
async fn reconnect(pre: &kvbridge::Channel, dec: &kvbridge::Channel) -> kvbridge::PeerId {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (d, p) = (dec.stats().await.unwrap(), pre.stats().await.unwrap());
        if d.established == 0 && p.established == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the broken session is still up after 30 s: {d:?} {p:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    pre.connect(&addr(dec)).await.unwrap()
}

per_transport!(access_modes_hold_per_transport, super::modes_hold);

/// The owner ends the session of a refused write; the writer is told of the refusal only
/// once its own side of that session is down, so a dial right after the refusal gets a new
/// session, never the ending one (whose lookups would fail once it is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dial_right_after_a_refused_write_gets_a_new_session() {
    let (dec, _rw) = listener("decode-0", |_| {}, 2 * PAGE, PAGE).await;
    let ro = Region::alloc(2 * PAGE, PAGE).unwrap();
    dec.register(&ro, Grant::AllPeers.read_only()).unwrap();
    let (pre, src) = initiator("prefill-0", |_| {}, 2 * PAGE, PAGE).await;
    for round in 0..5 {
        let peer = pre.connect(&addr(&dec)).await.unwrap();
        pre.peer_regions(&peer).await.unwrap();
        write_into_read_only(&pre, &peer, &src, &ro).await;
        let s = pre.stats().await.unwrap();
        assert_eq!(
            (s.established, s.sessions),
            (0, 0),
            "round {round}: the refused session is still on the writer's side: {s:?}"
        );
    }
}
