//! Peers whose chunk keys are computed differently (an older FNV peer and a SHA-256 one)
//! refuse each other at the handshake with a typed error naming both schemes, in either
//! direction, instead of sharing a buffer whose keys do not match.

mod common;
use common::*;
use kvbridge::proto::msg::ErrorCode;
use kvbridge::{Channel, ChannelConfig, Error};
use kvbridge_pd::{OutcomeSink, PdError, KEY_SCHEME};

/// An older sender (its channel's compat is plain) against a receiver of this version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_sender_is_refused_by_the_receiver_typed() {
    let rx = receiver(4, |_| {}).await;
    let old = Channel::new(ChannelConfig::new("prefill-old", None))
        .await
        .unwrap();
    let err = old
        .connect(&rx.local_addr().unwrap().to_string())
        .await
        .unwrap_err();
    match &err {
        Error::Rejected { code, message, .. } => {
            assert_eq!(*code, ErrorCode::Incompatible, "{err}");
            assert!(message.contains(KEY_SCHEME), "{err}");
        }
        _ => panic!("expected an Incompatible rejection, got {err}"),
    }
    assert_eq!(rx.counters().free, 4);
}

/// A sender of this version against an older receiver (a plain listener).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sender_refuses_an_older_receiver_typed() {
    let mut c = ChannelConfig::new("decode-old", Some("127.0.0.1:0"));
    c.deadlines.op = S * 5;
    let old = Channel::new(c).await.unwrap();
    let port = old.local_addr().unwrap().port();
    let tx = sender("prefill-0", OutcomeSink::None).await;
    let spec = kvbridge_pd::DisaggSpec {
        req_id: "r".into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: vec![port],
        receiver_alloc_port: vec![],
    };
    let err = match tx.begin(&spec, &tokens(1, 16)).await {
        Err(e) => e,
        Ok(_) => panic!("an older receiver was accepted"),
    };
    let text = err.to_string();
    assert!(
        matches!(err, PdError::Transfer { .. } | PdError::Refused { .. }),
        "{text}"
    );
    assert!(
        text.contains(KEY_SCHEME) && text.to_lowercase().contains("incompatible"),
        "{text}"
    );
}
