//! A listener process killed (SIGKILL) while the initiator writes into it or reads from
//! it, over every transport: the operations in flight fail before their deadline, with a
//! typed error naming the peer (a lost peer, never an internal error or a region "revoked
//! by the peer"), also where UCX cannot detect the dead peer (same-host shared memory): the
//! session sees the listener's process exit (its pidfd) once the control connection
//! closed. Nothing hangs. The session's teardown (its UCX endpoint's close, bounded by the
//! close deadline, far longer here than the op deadline) holds up no operation, and does
//! not run to the close deadline: the session ends (`PeerEvent::Down`) and the channel
//! closes well before it.

mod common;
use common::*;
use kvbridge::{Error, Op, PeerEvent};
use std::time::{Duration, Instant};

const PAGE: usize = 64 << 10;
const NAME: &str = "decode-killed";
/// The initiator's op deadline: operations on the killed peer must fail before it, by
/// detection rather than by the deadline.
const OP: Duration = Duration::from_secs(6);
/// Room for a loaded 2-core host's scheduling on top of a deadline.
const SLACK: Duration = Duration::from_secs(10);
/// The initiator's close deadline: a teardown that held a write up until it passed would
/// make that write end past `OP + SLACK`.
const CLOSE: Duration = Duration::from_secs(20);

/// The child process of [`killed_mid_write`]: a listener that waits to be killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_listener() {
    ChildListener::serve_if_child(NAME, 64 * PAGE, PAGE).await;
}

/// Which one-sided operation the initiator loops on while the listener is killed.
#[derive(Debug, Clone, Copy)]
enum Doing {
    Writes,
    Reads,
}

async fn killed_mid_write(t: Carrier) {
    killed_mid(t, Doing::Writes).await
}

async fn killed_mid_read(t: Carrier) {
    killed_mid(t, Doing::Reads).await
}

async fn killed_mid(t: Carrier, doing: Doing) {
    let mut child = ChildListener::start("child_listener", t).await;
    let (pre, src) = initiator(
        "prefill-k",
        |c| {
            t.apply(c);
            c.deadlines.op = OP;
            c.deadlines.close = CLOSE;
        },
        16 * PAGE,
        PAGE,
    )
    .await;
    fill(&src, 3);
    let peer = pre.connect(&child.addr).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    // The listener's region, as its MemInfo announced it.
    let kv = pre.peer_regions(&peer).await.unwrap()[0].id;
    let ops: Vec<Op> = (0..16)
        .map(|i| Op::page(&src, i, kv, 4 * i as u64, PAGE))
        .collect();
    let (p2, peer2) = (pre.clone(), peer.clone());
    let (tx, mut started) = tokio::sync::watch::channel(0usize);
    // Operations in a loop (bounded in count and time); each one's duration is measured.
    let w = tokio::spawn(async move {
        let t0 = Instant::now();
        let mut longest = Duration::ZERO;
        for n in 0..100_000usize {
            let at = Instant::now();
            let r = match doing {
                Doing::Writes => p2.write(&peer2, &ops).await,
                Doing::Reads => p2.read(&peer2, &ops).await,
            };
            longest = longest.max(at.elapsed());
            let _ = tx.send(n + 1);
            if let Err(e) = r {
                // When it failed: the session's end is awaited first, which may take longer.
                return (Some((e, Instant::now())), longest);
            }
            if t0.elapsed() > Duration::from_secs(60) {
                break;
            }
        }
        (None, longest)
    });
    tokio::time::timeout(Duration::from_secs(30), started.wait_for(|n| *n >= 3))
        .await
        .expect("operations never got going")
        .unwrap();
    let mut events = pre.peer_events();
    child.kill();
    let killed = Instant::now();
    // The session's end, reported once its teardown (the UCX endpoint's close included)
    // finished.
    let down = tokio::time::timeout(CLOSE + SLACK, async {
        loop {
            match events.recv().await {
                Ok(PeerEvent::Down { peer: p, error, .. }) if p == peer => break error,
                Ok(_) => continue,
                Err(e) => panic!("peer events: {e}"),
            }
        }
    })
    .await
    .expect("the session never ended after the peer was killed");
    let ended = killed.elapsed();
    eprintln!("{t:?} {doing:?}: session down {ended:?} after the kill: {down}");
    assert!(
        ended < SLACK,
        "the session ended {ended:?} after the kill (close deadline {CLOSE:?})"
    );
    let (err, longest) = tokio::time::timeout(OP + SLACK + Duration::from_secs(20), w)
        .await
        .expect("operations hung after the peer was killed")
        .unwrap();
    let (e, failed_at) = err.expect("operations on a killed peer kept succeeding");
    let took = failed_at.saturating_duration_since(killed);
    eprintln!("{t:?} {doing:?}: failed {took:?} after the kill, longest {longest:?}: {e}");
    assert!(
        took < OP,
        "{took:?} after the kill, at the op deadline ({OP:?}) rather than detected: {e}"
    );
    assert!(longest < OP, "an operation took {longest:?}");
    assert!(
        matches!(
            e,
            Error::ConnectionLost { .. }
                | Error::Timeout { .. }
                | Error::PeerClosed { .. }
                | Error::UnknownPeer { .. }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains(NAME),
        "the error names the peer: {e}"
    );
    // Nothing left to wait for: the channel closes and drops at once.
    let at = Instant::now();
    pre.close().await;
    drop(pre);
    let closed = at.elapsed();
    eprintln!("{t:?}: channel closed and dropped in {closed:?}");
    assert!(closed < SLACK, "closing the channel took {closed:?}");
}
per_transport!(killed_mid_write_per_transport, super::killed_mid_write);
per_transport!(killed_mid_read_per_transport, super::killed_mid_read);
