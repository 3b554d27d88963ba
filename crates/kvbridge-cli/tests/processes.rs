//! The handshake across real processes: a listener killed with SIGKILL mid-handshake, then
//! restarted on the same address.

use kvbridge::{Channel, ChannelConfig, Error, Grant, Op, Region};
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Peer {
    child: Child,
    addr: String,
    region: kvbridge::RegionId,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_peer(listen: &str, extra: &[&str]) -> Peer {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args([
            "bench",
            "peer",
            "--region-bytes",
            "1048576",
            "--listen",
            listen,
        ])
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start kvbridge bench peer");
    let mut out = child.stdout.take().unwrap();
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    while out.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
        line.push(b[0]);
    }
    let line = String::from_utf8(line).unwrap();
    let parts: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(parts[0], "READY", "{line}");
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(&parts[2][2 * i..2 * i + 2], 16).unwrap();
    }
    Peer {
        child,
        addr: parts[1].to_string(),
        region: kvbridge::RegionId(id),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listener_process_killed_mid_handshake_then_restarted() {
    let stalled = start_peer("127.0.0.1:0", &["--welcome-delay-ms", "60000"]);
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
    // Wait until the dial is under way, then kill the listener process outright.
    for _ in 0..2000 {
        if ch.stats().await.unwrap().sessions == 1 {
            break;
        }
        tokio::task::yield_now().await;
    }
    drop(stalled); // SIGKILL + wait
    let err = tokio::time::timeout(Duration::from_secs(15), connecting)
        .await
        .expect("connect must end within its deadlines")
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(err, Error::ConnectionLost { .. }),
        "expected a lost connection, got {err}"
    );
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
