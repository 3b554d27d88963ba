//! Fault suite: memory that cannot be had. A region or a receive buffer that cannot be
//! allocated is a typed error naming the size, never a crash or an OOM kill, and a receiver
//! that failed to start leaves nothing behind (its port is free again).

mod common;
use common::*;
use kvbridge::Region;
use kvbridge_pd::{PdError, PdReceiver, ReceiverConfig};

const ONE_TIB: u64 = 1 << 40;

#[test]
fn a_region_larger_than_memory_is_a_typed_error_naming_its_size() {
    let e = Region::alloc(ONE_TIB as usize, 4096).unwrap_err();
    assert!(e.to_string().contains(&ONE_TIB.to_string()), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_buffer_that_cannot_be_allocated_fails_start_and_frees_its_port() {
    // A port that was free a moment ago; the receiver is told to listen on it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut ch = channel("decode-huge", true);
    ch.listen_addr = Some(listen.clone());
    let cfg = ReceiverConfig::new(ch, 0, spec(), ONE_TIB);
    let e = PdReceiver::start(cfg).await.unwrap_err();
    assert!(matches!(e, PdError::Config(_)), "{e:?}");
    assert!(e.to_string().contains(&ONE_TIB.to_string()), "{e}");
    // Rolled back: the port is free again, and a sane receiver starts on it.
    let mut ch = channel("decode-sane", true);
    ch.listen_addr = Some(listen);
    let rx = PdReceiver::start(ReceiverConfig::new(ch, 0, spec(), 16 * spec().page_bytes()))
        .await
        .expect("a receiver with a sane buffer starts on the same port");
    assert_eq!(rx.counters().leaked, 0);
}
