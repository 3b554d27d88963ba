//! The listener's unix socket (shared memory) accepts at most
//! `max_unidentified_connections` connections that have not presented a token, closes the
//! ones past it at once, frees the slots at the first-frame deadline, and closes a
//! connection from another user at once.

mod common;
use common::*;
use kvbridge::Transport;
use std::io::Read;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::{Duration, Instant};

const PAGE: usize = 4096;

fn dial(name: &str) -> UnixStream {
    let a = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    UnixStream::connect_addr(&a).unwrap()
}

/// Whether the listener closed `s` within `within` (EOF or reset), without sending a byte.
fn closed_within(s: &mut UnixStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => true,
        Ok(_) => panic!("the listener sent bytes to a silent connection"),
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_connections_past_the_limit_are_closed_and_a_real_peer_gets_in_after() {
    let (dec, kv) = listener(
        "decode-0",
        |c| {
            c.limits.max_unidentified_connections = 4;
            c.deadlines.first_frame = Duration::from_millis(1500);
        },
        16 * PAGE,
        PAGE,
    )
    .await;
    let name = dec
        .shm_socket_name()
        .expect("a listener offers shared memory");
    let mut held: Vec<UnixStream> = (0..4).map(|_| dial(&name)).collect();
    let mut over: Vec<UnixStream> = (0..3).map(|_| dial(&name)).collect();
    for s in over.iter_mut() {
        assert!(
            closed_within(s, Duration::from_millis(500)),
            "past the limit, still open"
        );
    }
    for s in held.iter_mut() {
        assert!(
            !closed_within(s, Duration::from_millis(50)),
            "within the limit, closed early"
        );
    }
    // The silent ones are dropped at the first-frame deadline; a real peer then gets in.
    for s in held.iter_mut() {
        assert!(
            closed_within(s, Duration::from_secs(3)),
            "kept past its deadline"
        );
    }
    let (pre, src) = initiator(
        "prefill-0",
        |c| c.transport = Transport::Shm,
        16 * PAGE,
        PAGE,
    )
    .await;
    fill(&src, 1);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, Transport::Shm).await;
    pre.write(&peer, &[kvbridge::Op::page(&src, 0, kv.id(), 3, PAGE)])
        .await
        .unwrap();
}

/// A connection from another uid is closed at once; one of ours is left to its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unix_connection_from_another_user_is_closed_at_once() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: only root can start a child under another uid here");
        return;
    }
    let (dec, _kv) = listener(
        "decode-0",
        |c| c.deadlines.first_frame = Duration::from_secs(5),
        PAGE,
        PAGE,
    )
    .await;
    let name = dec.shm_socket_name().unwrap();
    // Ours: still open after a second.
    let mut mine = dial(&name);
    assert!(!closed_within(&mut mine, Duration::from_secs(1)));
    // nobody's: closed well before the first-frame deadline. The child prints how long
    // the listener took to close it.
    use std::os::unix::process::CommandExt;
    let script = format!(
        "import socket,time\ns=socket.socket(socket.AF_UNIX)\ns.connect('\\0{name}')\n\
         t=time.time()\ns.settimeout(4)\ntry:\n  d=s.recv(1)\n  print('closed' if d==b'' else 'data', time.time()-t)\n\
         except socket.timeout:\n  print('open', time.time()-t)\nexcept ConnectionResetError:\n  print('closed', time.time()-t)\n"
    );
    let t = Instant::now();
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.starts_with("closed"),
        "another user's connection: {said}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(3),
        "took {:?}",
        t.elapsed()
    );
}
