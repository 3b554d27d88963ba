//! A sender writes only the pages reserved for its own live push requests: a hostile
//! sender (real sockets, TCP) that writes another sender's reserved page, or its own page
//! after that chunk landed, is refused with a typed error, and the victim's KV is
//! byte-identical.

mod common;
use common::*;
use kvbridge::proto::msg::ErrorCode;
use kvbridge::{Error, Grant, Op, PeerId, Region, Step, Transport};
use kvbridge_pd::OutcomeSink;

/// `direct_copies`: the receiver's setting (on: same-host senders may map the buffer, and
/// the hostile sender is forced to TCP; off: nobody maps it).
async fn hostile_sender_is_held_to_its_pages(direct_copies: bool, own_landed_page: bool) {
    let rx = receiver(6, |c| c.direct_copies = direct_copies).await;
    let tx_v = sender("prefill-v", OutcomeSink::None).await;
    let tx_h = sender_with("prefill-h", OutcomeSink::None, |c| {
        if direct_copies {
            c.channel.transport = Transport::Tcp;
        }
    })
    .await;
    // The victim's request: two chunks landed, not finished yet (its pages are reserved).
    let mut v = tx_v.begin(&disagg("V", &rx), &tokens(1, 32)).await.unwrap();
    let len = v.chunk_bytes(0) as usize;
    v.send_chunk(0, &kv(1, 0, len)).await.unwrap();
    v.send_chunk(1, &kv(1, 1, len)).await.unwrap();
    let victim_page = rx.chunk("V", 1, S).await.unwrap().page();
    // The hostile sender's own request: its own page takes its write.
    let mut h = tx_h.begin(&disagg("H", &rx), &tokens(2, 32)).await.unwrap();
    h.send_chunk(0, &kv(2, 0, len)).await.unwrap();
    let own_landed = rx.chunk("H", 0, S).await.unwrap().page();
    let target = if own_landed_page {
        own_landed
    } else {
        victim_page
    };
    let before = rx.chunk("H", 0, S).await.unwrap().to_vec();
    // Now it writes by hand, with its channel, into the target page.
    let ch = tx_h.channel();
    let decoder = PeerId::new("decode-0").unwrap();
    assert_eq!(
        ch.peer_transport(&decoder).await.unwrap(),
        Transport::Tcp,
        "the hostile sender must be over TCP"
    );
    let remote = ch.peer_regions(&decoder).await.unwrap()[0].id;
    let src = Region::alloc(len, 4096).unwrap();
    src.write_at(0, &vec![0xEE; len]).unwrap();
    ch.register(&src, Grant::AllPeers).unwrap();
    let err = ch
        .write(
            &decoder,
            &[Op {
                local: src.clone(),
                local_offset: 0,
                remote,
                remote_offset: u64::from(target) * rx.page_bytes(),
                len,
            }],
        )
        .await
        .unwrap_err();
    match &err {
        Error::Rejected {
            peer,
            step: Step::Write,
            code: ErrorCode::AccessDenied,
            message,
        } => {
            assert_eq!(peer, "decode-0");
            assert!(message.contains("outside"), "{message}");
        }
        e => panic!("expected AccessDenied at write, got {e:?}"),
    }
    // The victim finishes and gets exactly what it sent; the hostile's landed chunk too.
    v.finish().await.unwrap();
    let got = rx.retrieve("V", S).await.unwrap();
    assert_eq!(got, vec![kv(1, 0, len), kv(1, 1, len)]);
    if own_landed_page {
        let now = rx.borrow_chunk("H", 0).map(|c| c.to_vec());
        // The refusal ended the hostile's session, which may have ended H meanwhile; if H
        // still has its chunk, it is the bytes that landed first.
        if let Ok(now) = now {
            assert_eq!(now, before);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_into_another_senders_pages_is_refused_over_tcp() {
    hostile_sender_is_held_to_its_pages(true, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_into_another_senders_pages_is_refused_without_direct_copies() {
    hostile_sender_is_held_to_its_pages(false, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_into_its_own_landed_chunk_is_refused() {
    hostile_sender_is_held_to_its_pages(true, true).await
}
