//! The outcome pusher outlives a proxy restart: an outcome emitted after the proxy went
//! away and came back on the same address reaches the new proxy. (With the `zeromq`
//! crate's PUSH socket, which notices a closed peer only when a write into it fails, the
//! first outcomes after a restart were "sent" into the dead connection and lost, and the
//! new proxy answered those requests 504 `kv_ready_timeout` at its deadline.)
//!
//! The proxies here are minimal ZMTP 3 PULL servers run by the test, so that "the proxy
//! died" is exact: its connection is closed, as a killed process's is.

use kvbridge_pd::{Outcome, OutcomeSink, ZmqPusher};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

const T: Duration = Duration::from_secs(10);

fn ready(id: &str) -> Outcome {
    Outcome::KvReady {
        req_id: id.into(),
        rank: 0,
        chunks: 1,
        bytes: 1,
        sent_by: None,
    }
}

/// Reads one ZMTP frame: flags and body.
async fn frame(s: &mut TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
    let flags = s.read_u8().await?;
    let len = if flags & 0x02 != 0 {
        s.read_u64().await?
    } else {
        u64::from(s.read_u8().await?)
    };
    let mut b = vec![0u8; len as usize];
    s.read_exact(&mut b).await?;
    Ok((flags, b))
}

/// Serves one PUSH peer as a ZMTP 3.0 PULL (NULL mechanism): every message body goes to
/// `out`, until the connection ends.
async fn serve_pull(mut s: TcpStream, out: mpsc::UnboundedSender<Vec<u8>>) -> std::io::Result<()> {
    let mut greeting = [0u8; 64];
    s.read_exact(&mut greeting).await?;
    let mut mine = [0u8; 64];
    mine[0] = 0xFF;
    mine[9] = 0x7F;
    mine[10] = 3;
    mine[12..16].copy_from_slice(b"NULL");
    s.write_all(&mine).await?;
    let (flags, body) = frame(&mut s).await?;
    assert!(flags & 0x04 != 0 && &body[1..6] == b"READY", "no READY");
    let mut ready = vec![5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&4u32.to_be_bytes());
    ready.extend_from_slice(b"PULL");
    let mut f = vec![0x04, ready.len() as u8];
    f.extend_from_slice(&ready);
    s.write_all(&f).await?;
    loop {
        let (_, body) = frame(&mut s).await?;
        let _ = out.send(body);
    }
}

/// A proxy's notification socket on `addr`, serving one connection at a time; abort the
/// task to kill it (its listener and connection close).
fn proxy(
    listener: TcpListener,
    out: mpsc::UnboundedSender<Vec<u8>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let _ = serve_pull(s, out.clone()).await;
        }
    })
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Vec<u8>>) -> Outcome {
    let b = tokio::time::timeout(T, rx.recv())
        .await
        .expect("an outcome arrives")
        .expect("the proxy runs");
    Outcome::decode(&b).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_reach_a_restarted_proxy() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let first = proxy(listener, tx);
    let sink = OutcomeSink::Zmq(ZmqPusher::spawn(format!("tcp://{addr}"), T));
    sink.emit(ready("before"));
    assert_eq!(next(&mut rx).await, ready("before"));

    // The proxy dies: its connection and listener close.
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    // Emitted while no proxy listens: delivered once one does.
    sink.emit(ready("while-down"));
    let listener = TcpListener::bind(addr).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _second = proxy(listener, tx);
    for i in 0..3 {
        sink.emit(ready(&format!("after-{i}")));
    }
    let mut got = Vec::new();
    while got.len() < 4 {
        got.push(next(&mut rx).await);
    }
    let mut want = vec![ready("while-down")];
    want.extend((0..3).map(|i| ready(&format!("after-{i}"))));
    assert_eq!(got, want, "outcomes lost or reordered across the restart");
}

/// An outcome that cannot reach any proxy within its deadline is dropped, and the next one
/// is not held up behind it for longer than its own deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undeliverable_outcome_is_dropped_at_its_deadline() {
    // A port with nothing listening.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let deadline = Duration::from_millis(300);
    let sink = OutcomeSink::Zmq(ZmqPusher::spawn(format!("tcp://{addr}"), deadline));
    sink.emit(ready("lost-0"));
    sink.emit(ready("lost-1"));
    tokio::time::sleep(deadline * 2).await;
    let listener = TcpListener::bind(addr).await.unwrap();
    let (tx, mut rx) = mpsc::unbounded_channel();
    let _p = proxy(listener, tx);
    sink.emit(ready("later"));
    assert_eq!(
        next(&mut rx).await,
        ready("later"),
        "a stale outcome came first"
    );
}
