//! A sender that stays connected but never acknowledges a fence is disconnected after the
//! receiver's `fence_timeout`, and its quarantined pages return.

mod common;
use common::*;
use kvbridge::{Channel, Grant, Op, Region, RegionId};
use kvbridge_pd::msg::PdMsg;
use std::time::Duration;

async fn next_msg(ch: &Channel) -> PdMsg {
    let n = tokio::time::timeout(5 * S, ch.recv_notification())
        .await
        .expect("a PD message within 5 s")
        .expect("channel open");
    PdMsg::decode(&n.data).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_sender_is_disconnected_and_its_pages_return() {
    let rx = receiver(4, |c| c.fence_timeout = Duration::from_millis(500)).await;
    let s = spec();
    // A hand-driven sender: speaks the protocol, then ignores the fence.
    let ch = Channel::new(channel("silent", false)).await.unwrap();
    let src = Region::alloc(s.page_bytes() as usize, s.page_bytes() as usize).unwrap();
    ch.register(&src, Grant::AllPeers).unwrap();
    let peer = ch
        .connect(&rx.local_addr().unwrap().to_string())
        .await
        .unwrap();
    let alloc = PdMsg::Alloc {
        call: 1,
        req_id: "stuck".into(),
        incarnation: ch.incarnation().0,
        spec: s,
        keys: vec![11, 12],
        tokens: 32,
        pull: false,
    };
    ch.notify(&peer, &alloc.encode()).await.unwrap();
    let PdMsg::AllocOk { region, pages, .. } = next_msg(&ch).await else {
        panic!("expected AllocOk");
    };
    let op = Op {
        local: src.clone(),
        local_offset: 0,
        remote: RegionId(region),
        remote_offset: pages[0] as u64 * s.page_bytes(),
        len: s.page_bytes() as usize,
    };
    ch.write(&peer, &[op]).await.unwrap();
    rx.cancel("stuck").unwrap();
    assert!(matches!(next_msg(&ch).await, PdMsg::Fence { ref req_id } if req_id == "stuck"));
    // No acknowledgement: the pages stay quarantined for now...
    assert_eq!(rx.counters().quarantined, 2);
    // ...until the fence deadline disconnects the sender.
    assert!(
        eventually(5 * S, || {
            let c = rx.counters();
            c.quarantined == 0 && c.free == 4 && c.leaked == 0
        })
        .await,
        "{:?}",
        rx.counters()
    );
    assert_eq!(rx.channel().stats().await.unwrap().established, 0);
    assert!(ch.notify(&peer, b"late").await.is_err());
}
