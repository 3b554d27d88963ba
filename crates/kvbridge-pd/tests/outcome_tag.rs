//! Under a shared secret the outcome pusher tags every outcome: on the wire, each message
//! carries a `tag` entry that authenticates its type, rank and request id under the secret
//! (what a proxy given the same secret requires); without one, the message is untagged and
//! byte for byte what it was. The receiving end is the `zeromq` crate's PULL, another ZMTP
//! implementation.

use kvbridge_pd::{Outcome, OutcomeSink, ZmqPusher};
use kvbridge_proto::outcome_tag::verify_outcome_tag;
use serde::Deserialize;
use std::time::Duration;
use zeromq::{Socket, SocketRecv};

const T: Duration = Duration::from_secs(10);

#[derive(Deserialize)]
struct Wire {
    #[serde(rename = "type")]
    kind: String,
    req_id: String,
    #[serde(default)]
    rank: u32,
    #[serde(default)]
    tag: Option<String>,
}

async fn pushed(secret: Option<Vec<u8>>, outcomes: &[Outcome]) -> Vec<Vec<u8>> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut pull = zeromq::PullSocket::new();
    pull.bind_listener(listener).await.unwrap();
    let sink = OutcomeSink::Zmq(ZmqPusher::spawn_with_secret(
        format!("tcp://{addr}"),
        T,
        secret,
    ));
    for o in outcomes {
        sink.emit(o.clone());
    }
    let mut got = Vec::new();
    for _ in outcomes {
        let m = tokio::time::timeout(T, pull.recv()).await.unwrap().unwrap();
        got.push(m.get(0).unwrap().to_vec());
    }
    got
}

fn outcomes() -> Vec<Outcome> {
    vec![
        Outcome::KvReady {
            req_id: "kvb-1".into(),
            rank: 3,
            chunks: 2,
            bytes: 10,
            sent_by: None,
        },
        Outcome::KvFailed {
            req_id: "kvb-2".into(),
            rank: 1,
            reason: "buffer full".into(),
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_secret_every_outcome_carries_its_tag() {
    let os = outcomes();
    for (bytes, o) in pushed(Some(b"s3cret".to_vec()), &os).await.iter().zip(&os) {
        assert_eq!(&Outcome::decode(bytes).unwrap(), o, "the shape is kept");
        let w: Wire = rmp_serde::from_slice(bytes).unwrap();
        let tag = w.tag.expect("tagged");
        assert!(verify_outcome_tag(
            b"s3cret", &w.kind, w.rank, &w.req_id, &tag
        ));
        assert!(!verify_outcome_tag(
            b"other", &w.kind, w.rank, &w.req_id, &tag
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_secret_outcomes_are_untagged_and_unchanged() {
    let os = outcomes();
    for (bytes, o) in pushed(None, &os).await.iter().zip(&os) {
        assert_eq!(bytes, &o.encode());
    }
}
