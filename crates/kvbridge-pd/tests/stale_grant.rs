//! A grant answers only the call it was made for: a receiver's answer that carries the
//! right call id but another request (as a grant deferred for a sender's previous
//! incarnation would, call ids restarting with every sender process) never passes for the
//! grant of this request.

mod common;
use common::*;
use kvbridge::{Channel, Grant, Region};
use kvbridge_pd::msg::PdMsg;
use kvbridge_pd::{DisaggSpec, PdError};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_for_another_request_is_not_taken_for_ours() {
    let s = spec();
    // A hand-driven receiver: it answers every allocation with a grant for another request.
    let rx = Channel::new(channel("decode-0", true)).await.unwrap();
    let buf = Region::alloc(4 * s.page_bytes() as usize, s.page_bytes() as usize).unwrap();
    rx.register(&buf, Grant::AllPeers).unwrap();
    let port = rx.local_addr().unwrap().port();
    let rx2 = rx.clone();
    let answering = tokio::spawn(async move {
        let n = tokio::time::timeout(5 * S, rx2.recv_notification())
            .await
            .expect("an allocation within 5 s")
            .expect("channel open");
        let PdMsg::Alloc { call, req_id, .. } = PdMsg::decode(&n.data).unwrap() else {
            panic!("expected Alloc");
        };
        assert_eq!(req_id, "mine");
        let stale = PdMsg::AllocOk {
            call,
            req_id: "someone-elses".into(),
            region: buf.id().0,
            page_bytes: s.page_bytes(),
            pages: vec![0, 1],
            held: vec![false, false],
        };
        rx2.notify(&n.peer, &stale.encode()).await.unwrap();
    });
    let (outcomes, _q) = queue();
    let tx = sender_with("prefill-0", outcomes, |c| {
        c.alloc_deadline = Duration::from_millis(1500)
    })
    .await;
    let spec = DisaggSpec {
        req_id: "mine".into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: vec![port],
        receiver_alloc_port: vec![],
    };
    let r = tx.begin(&spec, &tokens(1, 32)).await;
    answering.await.unwrap();
    match r {
        Err(PdError::Timeout { req_id, .. }) => assert_eq!(req_id, "mine"),
        Err(e) => panic!("expected the allocation to time out, got {e}"),
        Ok(_) => panic!("a grant made for another request was taken for this one"),
    }
    // the failed begin rolled back what it half-built: the dispatcher no longer tracks it
    assert_eq!(tx.in_flight(), 0, "a failed begin left its transfer behind");
}
