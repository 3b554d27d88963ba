//! A read whose caller stops waiting (its task aborted, as `Transfer.cancel` in the Python
//! binding does) lands nothing in its destinations once the cancel returned, over every
//! transport: the initiator cancels a read whose bytes are still to come (over TCP the
//! owner's answer is held back; over shared memory and cross-memory attach the copy is held
//! after it was taken), writes a marker over the destination, lets the bytes come, and finds
//! the marker still there. The session stays usable: a new read succeeds on it. (Over UCX,
//! whose posted gets cannot be called back, a cancel ends the session instead: the unit
//! test `datapath::cancel::tests::a_cancelled_batch_posted_elsewhere_ends_the_session`.)

mod common;
use common::*;
use kvbridge::{Channel, ChannelConfig, Op, PeerId, Region};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const PAGE: usize = 16 << 10;
const LEN: usize = 8 * PAGE;
/// How long the owner's answer (or the initiator's direct copy) is held back.
const HELD: Duration = Duration::from_millis(400);
/// The marker written over the cancelled read's destination.
const MARK: u8 = 0xA5;

/// Polls `cond` (every 2 ms, at most 10 s); whether it came true.
async fn eventually<F: std::future::Future<Output = bool>>(mut cond: impl FnMut() -> F) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        if cond().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    false
}

fn page_of(r: &Region, page: usize) -> Vec<u8> {
    let mut out = vec![0u8; PAGE];
    r.read_at(page * PAGE, &mut out).unwrap();
    out
}

/// How the bytes of a read come on this carrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// The owner answers over TCP (held back by `read_serve_delay`).
    Answer,
    /// The initiator copies them itself (held back by `direct_copy_delay`).
    DirectCopy,
}

fn way(t: Carrier) -> Way {
    match t.transport {
        kvbridge::Transport::Shm => Way::DirectCopy,
        _ if t.raw && kvbridge::cma_available().is_ok() => Way::DirectCopy,
        _ => Way::Answer,
    }
}

/// Spawns a read of the owner's page 0 into page 0 of `dst` and returns once its bytes are
/// on their way (the owner holds the read, or the initiator's copy of it is under way).
async fn start_read(
    ini: &Channel,
    lst: &Channel,
    peer: &PeerId,
    (dst, src): (&Region, &Region),
    way: Way,
    delayed: &std::sync::atomic::AtomicU64,
) -> tokio::task::JoinHandle<kvbridge::Result<()>> {
    let ops = [Op::page(dst, 0, src.id(), 0, PAGE)];
    let (ch, p) = (ini.clone(), peer.clone());
    let task = tokio::spawn(async move { ch.read(&p, &ops).await });
    let under_way = match way {
        Way::Answer => {
            eventually(|| async { lst.stats().await.unwrap().peer_bytes_in_flight > 0 }).await
        }
        Way::DirectCopy => eventually(|| async { delayed.load(Ordering::Relaxed) > 0 }).await,
    };
    assert!(under_way, "the read never got under way");
    task
}

async fn cancelled_read_lands_nothing(t: Carrier) {
    let way = way(t);
    let (lst, src) = listener(
        "owner",
        |c| {
            t.apply(c);
            if way == Way::Answer {
                c.hooks.read_serve_delay = Some(HELD);
            }
        },
        LEN,
        PAGE,
    )
    .await;
    fill(&src, 11);
    let hooks = kvbridge::TestHooks {
        direct_copy_delay: (way == Way::DirectCopy).then_some(HELD),
        ..Default::default()
    };
    let delayed = hooks.direct_copies_delayed.clone();
    let (ini, dst) = initiator(
        "reader",
        |c: &mut ChannelConfig| {
            t.apply(c);
            c.hooks.direct_copy_delay = hooks.direct_copy_delay;
            c.hooks.direct_copies_delayed = hooks.direct_copies_delayed.clone();
        },
        LEN,
        PAGE,
    )
    .await;
    let peer = ini.connect(&addr(&lst)).await.unwrap();
    let task = start_read(&ini, &lst, &peer, (&dst, &src), way, &delayed).await;

    // The cancel: the read's task is aborted and its future dropped.
    task.abort();
    let joined = task.await;
    assert!(
        joined.as_ref().is_err_and(|e| e.is_cancelled()),
        "the read ended before its cancel: {joined:?}"
    );
    dst.write_at(0, &[MARK; PAGE]).unwrap();

    // The session goes on: a new read succeeds (its answer comes after the held one on the
    // same connection, or its copy after the held copy on the same writer).
    ini.read(&peer, &[Op::page(&dst, 1, src.id(), 1, PAGE)])
        .await
        .unwrap();
    if way == Way::Answer {
        // With several data connections the late answer may come on another one: wait
        // until it was read past, so that it had its chance to land.
        assert!(
            eventually(|| async { ini.stats().await.unwrap().late_answers_discarded == 1 }).await,
            "the late answer was never discarded: {:?}",
            ini.stats().await.unwrap()
        );
    }
    let st = ini.stats().await.unwrap();
    assert_eq!(st.established, 1, "{st:?}");
    let mut want = vec![0u8; LEN];
    pattern(&mut want, 11, 0);
    assert!(
        page_of(&dst, 0).iter().all(|&b| b == MARK),
        "bytes of the cancelled read landed after its cancel ({way:?})"
    );
    assert_eq!(page_of(&dst, 1), want[PAGE..2 * PAGE], "the new read");
    let st = ini.stats().await.unwrap();
    assert_eq!((st.batches_in_flight, st.bytes_in_flight), (0, 0), "{st:?}");
    ini.close().await;
    lst.close().await;
}

// `per_transport!`'s carriers but UCX (see the top of this file).
mod a_cancelled_read_lands_nothing {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp() {
        cancelled_read_lands_nothing(kvbridge::Transport::Tcp.into()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp_striped() {
        cancelled_read_lands_nothing(Carrier {
            data_connections: 3,
            ..kvbridge::Transport::Tcp.into()
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp_tls() {
        cancelled_read_lands_nothing(Carrier::tcp_tls()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shm() {
        cancelled_read_lands_nothing(kvbridge::Transport::Shm.into()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn cma() {
        cancelled_read_lands_nothing(Carrier::cma()).await
    }
}

/// A write cancelled after it went on the wire (the owner holds it before applying it):
/// its acknowledgement, when it comes, is recognised and dropped, and the session goes on.
/// (Its bytes were sent before the cancel returned, and land at the owner: the owner's
/// memory is the owner's to protect, by its windows.)
async fn cancelled_write_keeps_the_session(t: Carrier) {
    let (lst, dst) = listener(
        "owner",
        |c| {
            t.apply(c);
            c.hooks.write_apply_delay = Some(HELD);
        },
        LEN,
        PAGE,
    )
    .await;
    let (ini, src) = initiator("writer", |c| t.apply(c), LEN, PAGE).await;
    fill(&src, 5);
    let peer = ini.connect(&addr(&lst)).await.unwrap();
    let task = {
        let (ch, p) = (ini.clone(), peer.clone());
        let ops = [Op::page(&src, 0, dst.id(), 0, PAGE)];
        tokio::spawn(async move { ch.write(&p, &ops).await })
    };
    assert!(
        eventually(|| async { lst.stats().await.unwrap().peer_bytes_in_flight > 0 }).await,
        "the write never reached the owner"
    );
    task.abort();
    let joined = task.await;
    assert!(
        joined.as_ref().is_err_and(|e| e.is_cancelled()),
        "the write ended before its cancel: {joined:?}"
    );
    ini.write(&peer, &[Op::page(&src, 1, dst.id(), 1, PAGE)])
        .await
        .unwrap();
    assert!(
        eventually(|| async { ini.stats().await.unwrap().late_answers_discarded == 1 }).await,
        "the late acknowledgement was never discarded: {:?}",
        ini.stats().await.unwrap()
    );
    let st = ini.stats().await.unwrap();
    assert_eq!(
        (st.established, st.batches_in_flight, st.bytes_in_flight),
        (1, 0, 0),
        "{st:?}"
    );
    let mut want = vec![0u8; LEN];
    pattern(&mut want, 5, 0);
    assert_eq!(page_of(&dst, 1), want[PAGE..2 * PAGE], "the new write");
    ini.close().await;
    lst.close().await;
}

// Over TCP only: a write copied by the caller's task (shared memory, cross-memory attach)
// ends inside one poll, where no cancel reaches it.
mod a_cancelled_write_keeps_the_session {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp() {
        cancelled_write_keeps_the_session(kvbridge::Transport::Tcp.into()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp_striped() {
        cancelled_write_keeps_the_session(Carrier {
            data_connections: 3,
            ..kvbridge::Transport::Tcp.into()
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tcp_tls() {
        cancelled_write_keeps_the_session(Carrier::tcp_tls()).await
    }
}
