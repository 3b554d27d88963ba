//! The handshake across real processes: a listener killed with SIGKILL mid-handshake, then
//! restarted on the same address.

use kvbridge::{Channel, ChannelConfig, Error, Grant, Op, Region, Step};
mod common;
use common::{spawn_peer, Peer};
use std::process::Command;
use std::time::Duration;

fn start_peer(listen: &str, extra: &[&str]) -> Peer {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvbridge"));
    cmd.args([
        "bench",
        "peer",
        "--region-bytes",
        "1048576",
        "--listen",
        listen,
    ])
    .args(extra);
    spawn_peer(cmd)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_process_killed_mid_handshake_then_restarted() {
    let mut stalled = start_peer("127.0.0.1:0", &["--welcome-delay-ms", "60000"]);
    let addr = stalled.addr.clone();
    let ch = Channel::new(ChannelConfig::new("prefill-0", None))
        .await
        .unwrap();
    let src = Region::alloc(4096, 4096).unwrap();
    src.write_at(0, &[0x5A; 4096]).unwrap();
    ch.register(&src, Grant::AllPeers).unwrap();
    let back = Region::alloc(4096, 4096).unwrap();
    ch.register(&back, Grant::AllPeers).unwrap();

    let c2 = ch.clone();
    let a2 = addr.clone();
    let connecting = tokio::spawn(async move { c2.connect(&a2).await });
    // Wait until the listener holds our Hello (it says so on stdout), so the handshake is
    // past the TCP connect and waiting for `Welcome`; then kill the listener outright.
    let said = tokio::task::block_in_place(|| stalled.next_line());
    assert_eq!(said, "HELLO", "the stalled peer's next line");
    drop(stalled); // SIGKILL + wait
    let err = tokio::time::timeout(Duration::from_secs(15), connecting)
        .await
        .expect("connect must end within its deadlines")
        .unwrap()
        .unwrap_err();
    // Typed, naming the peer (its address: its id is not known before `Welcome`) and the
    // step the handshake was at.
    match &err {
        Error::ConnectionLost { peer, step, .. } => {
            assert_eq!(peer, &addr, "{err}");
            assert_eq!(*step, Step::Welcome, "{err}");
        }
        _ => panic!("expected a lost connection, got {err}"),
    }
    let s = ch.stats().await.unwrap();
    assert_eq!((s.sessions, s.dialing, s.established), (0, 0, 0), "{s:?}");

    // Same address, new process (new incarnation): the next connect starts clean.
    let restarted = start_peer(&addr, &[]);
    let peer = ch.connect(&addr).await.unwrap();
    ch.write(&peer, &[Op::page(&src, 0, restarted.region, 3, 4096)])
        .await
        .unwrap();
    ch.read(&peer, &[Op::page(&back, 0, restarted.region, 3, 4096)])
        .await
        .unwrap();
    let mut got = [0u8; 4096];
    back.read_at(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&b| b == 0x5A),
        "write did not land byte-exact"
    );
}
