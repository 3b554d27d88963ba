//! A UCX session starts with its transport settled, whatever the order in which the
//! listener's offer and our own data connection's binding come.
#![cfg(feature = "ucx")]

mod common;
use common::*;
use kvbridge::Op;
use std::time::Duration;

const PAGE: usize = 4096;

/// The listener's `Ready` and `UcxOffer` arrive before the initiator bound its side of the
/// data connection (delayed by a test hook): the first batch still goes over UCX.
async fn offer_before_our_bind(t: Carrier) {
    let (dec, kv) = listener("decode-0", |c| t.apply(c), 4 * PAGE, PAGE).await;
    let (pre, src) = initiator(
        "prefill-0",
        |c| {
            t.apply(c);
            c.hooks.initiator_bind_delay = Some(Duration::from_millis(300));
        },
        2 * PAGE,
        PAGE,
    )
    .await;
    fill(&src, 4);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    pre.write(&peer, &[Op::page(&src, 1, kv.id(), 3, PAGE)])
        .await
        .unwrap();
    let (mut a, mut b) = (vec![0u8; PAGE], vec![0u8; PAGE]);
    src.read_at(PAGE, &mut a).unwrap();
    kv.read_at(3 * PAGE, &mut b).unwrap();
    assert!(a == b, "the page differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_before_our_bind_still_starts_the_session_on_ucx_tcp() {
    offer_before_our_bind(Carrier::ucx("tcp")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_before_our_bind_still_starts_the_session_on_ucx_sm() {
    offer_before_our_bind(Carrier::ucx("sm,self")).await
}
