//! A large cross-memory-attach copy split over a few threads.
//!
//! `process_vm_readv`/`writev` pin the peer's pages one by one before copying them, and on
//! memory in 4 KiB pages (a tmpfs or `/dev/shm` mapping, as LMCache's L1 arena is; anonymous
//! memory without transparent huge pages) one thread copies at about half the speed of a
//! `memcpy`: 4.2 GB/s on this project's 2-core VM against 10.3 GB/s for a `memcpy` of the same
//! mapping. The work per page is the calling thread's, so two threads copying disjoint halves
//! moved 6.4-8.4 GB/s there. A copy of at least [`MIN_PART`] bytes per part is therefore cut
//! into up to [`threads`] parts of about equal bytes; the calling thread copies the first, and
//! threads parked in a pool (no spawn per copy) the others. The caller returns only once
//! every part has ended, so no byte of the copy lands after it returns, whatever failed.
//!
//! A batch is copied in order ([`super::cma::PieceCopy`]); that order is visible only where
//! two pieces copy into the same bytes, so such a batch (overlapping destinations) is never
//! split.

use crate::dir::Dir;
use crate::thread_pool::ThreadPool;
use crate::transport::piece::Piece;
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::Duration;

/// The least bytes a part gets: below this, handing a part to another thread (tens of
/// microseconds on a loaded host) costs more than the thread saves (about 250 µs per MiB).
pub(crate) const MIN_PART: usize = 1 << 20;

/// The most threads one copy uses: the engine shares the host with the inference engine, so
/// a copy takes a few cores, not all.
pub(crate) const MAX_THREADS: usize = 4;

/// Threads parked between copies (a host's copies in flight at once use at most this many
/// helpers without a spawn).
static COPY_THREADS: ThreadPool = ThreadPool::new(16, Duration::from_secs(30), || {});

/// How many threads a large copy uses in this process: `KVBRIDGE_CMA_THREADS` (1 copies on
/// the calling thread alone; at most 16), else the host's cores, at most [`MAX_THREADS`].
pub(crate) fn threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("KVBRIDGE_CMA_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map(|n| n.clamp(1, 16))
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map_or(1, |n| n.get())
                    .min(MAX_THREADS)
            })
    })
}

/// Pieces handed to another thread. Their addresses are plain numbers there; the thread
/// that hands them over waits until that thread is done with them.
struct Part(Vec<Piece>);

// SAFETY: a `Piece`'s raw pointer names memory the copy's caller keeps valid and exclusive
// to this copy until `run` returns, and `run` returns only after every part it handed to
// another thread has ended.
unsafe impl Send for Part {}

/// Copies `pieces` with `copy` (which must copy a list of pieces in order and return when
/// done or failed), split over up to `threads` threads when each part gets at least
/// [`MIN_PART`] bytes and no two pieces copy into the same bytes; on the calling thread
/// alone otherwise. Returns once every part ended: the first part's error in piece order,
/// or `Ok`; `lost()` stands for a part whose thread ended without answering.
///
/// # Safety
/// As [`super::cma::PieceCopy::copy`] for `pieces`, and `copy` must be sound to call on
/// any sub-list of them from any thread.
pub(crate) unsafe fn run<E, F>(
    dir: Dir,
    pieces: &[Piece],
    threads: usize,
    copy: F,
    lost: impl Fn() -> E,
) -> Result<(), E>
where
    E: Send + 'static,
    F: Fn(&[Piece]) -> Result<(), E> + Clone + Send + 'static,
{
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let parts = threads.min(total / MIN_PART);
    if parts <= 1 || !disjoint_destinations(dir, pieces) {
        return copy(pieces);
    }
    let mut split = split(pieces, parts);
    let first = split.remove(0);
    let (tx, rx) = mpsc::channel();
    let mut inline = Vec::new();
    let mut handed = 0usize;
    for (i, part) in split.into_iter().enumerate() {
        let (tx, copy) = (tx.clone(), copy.clone());
        let kept = part.clone();
        let part = Part(part);
        let job = Box::new(move || {
            let part = part;
            let _ = tx.send((i + 1, copy(&part.0)));
        });
        match COPY_THREADS.run("kvbridge-copy", job) {
            Ok(()) => handed += 1,
            // No thread to be had: this thread copies that part too.
            Err(_) => inline.push((i + 1, kept)),
        }
    }
    drop(tx);
    let mut results = vec![(0, copy(&first))];
    for (i, part) in inline {
        results.push((i, copy(&part)));
    }
    for _ in 0..handed {
        match rx.recv() {
            Ok(r) => results.push(r),
            // Every sender is gone, so every part's thread has ended, one of them without
            // answering (it panicked): its copy stopped there.
            Err(_) => {
                results.push((usize::MAX, Err(lost())));
                break;
            }
        }
    }
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().try_for_each(|(_, r)| r)
}

/// `pieces` cut into `n` parts of about equal bytes, in order (a piece may be cut between
/// two parts); fewer parts when there are fewer bytes than `n`.
pub(crate) fn split(pieces: &[Piece], n: usize) -> Vec<Vec<Piece>> {
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let n = n.clamp(1, total.max(1));
    let mut parts = Vec::with_capacity(n);
    let mut current = Vec::new();
    let mut filled = 0usize;
    // Part k ends at byte total * (k + 1) / n of the whole copy.
    let mut k = 0usize;
    let end_of = |k: usize| (total as u128 * (k as u128 + 1) / n as u128) as usize;
    let mut done = 0usize;
    for p in pieces {
        let mut off = 0usize;
        while off < p.len {
            let take = (p.len - off).min(end_of(k) - done - filled);
            current.push(Piece {
                remote: p.remote + off,
                local: p.local.wrapping_add(off),
                len: take,
            });
            off += take;
            filled += take;
            if done + filled == end_of(k) && k + 1 < n {
                parts.push(std::mem::take(&mut current));
                done += filled;
                filled = 0;
                k += 1;
            }
        }
    }
    if !current.is_empty() || parts.is_empty() {
        parts.push(current);
    }
    parts
}

/// Whether no two pieces copy into the same bytes (the local ranges of a read, the peer's
/// ranges of a write).
fn disjoint_destinations(dir: Dir, pieces: &[Piece]) -> bool {
    let mut ranges: Vec<(usize, usize)> = pieces
        .iter()
        .filter(|p| p.len > 0)
        .map(|p| match dir {
            Dir::Read => (p.local as usize, p.len),
            Dir::Write => (p.remote, p.len),
        })
        .collect();
    ranges.sort_unstable();
    ranges
        .windows(2)
        .all(|w| w[0].0.checked_add(w[0].1).is_some_and(|end| end <= w[1].0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    fn lost() -> std::io::Error {
        std::io::Error::other("lost")
    }
    use std::sync::{Arc, Mutex};

    fn piece(remote: usize, local: usize, len: usize) -> Piece {
        Piece {
            remote,
            local: local as *mut u8,
            len,
        }
    }

    /// The (remote, local) byte addresses a list of pieces copies, in order.
    fn bytes(pieces: &[Piece]) -> Vec<(usize, usize)> {
        pieces
            .iter()
            .flat_map(|p| (0..p.len).map(move |i| (p.remote + i, p.local as usize + i)))
            .collect()
    }

    #[test]
    fn parts_cover_the_same_bytes_in_order_and_about_evenly() {
        let pieces = vec![
            piece(1000, 50_000, 7),
            piece(2000, 60_000, 300),
            piece(9000, 70_000, 1),
            piece(5000, 80_000, 92),
        ];
        for n in 1..=8 {
            let parts = split(&pieces, n);
            assert_eq!(parts.len(), n);
            let flat: Vec<Piece> = parts.iter().flatten().copied().collect();
            assert_eq!(bytes(&flat), bytes(&pieces), "n = {n}");
            let sizes: Vec<usize> = parts
                .iter()
                .map(|p| p.iter().map(|x| x.len).sum())
                .collect();
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(hi - lo <= 1, "n = {n}: part sizes {sizes:?}");
            assert!(flat.iter().all(|p| p.len > 0), "n = {n}: an empty piece");
        }
        assert_eq!(split(&[piece(0, 0, 3)], 8).len(), 3);
    }

    #[test]
    fn overlapping_destinations_are_seen() {
        let a = piece(0, 100, 10);
        let b = piece(50, 110, 10);
        assert!(disjoint_destinations(Dir::Read, &[b, a]));
        assert!(!disjoint_destinations(Dir::Read, &[a, piece(70, 109, 10)]));
        // Reads write the local side, writes the remote one.
        assert!(disjoint_destinations(Dir::Write, &[a, piece(70, 109, 10)]));
        assert!(!disjoint_destinations(Dir::Write, &[a, piece(5, 500, 10)]));
    }

    /// Runs `run` over a copy that records which thread copied which piece; each part
    /// waits (at most 5 s) until `together` parts run at once, so parts that run one after
    /// another on one thread take 5 s each and show as one thread.
    fn record(
        pieces: &[Piece],
        dir: Dir,
        threads: usize,
        together: usize,
    ) -> (Vec<Piece>, HashSet<String>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let names = Arc::new(Mutex::new(HashSet::new()));
        let (s, n) = (seen.clone(), names.clone());
        let arrived = Arc::new((Mutex::new(0usize), std::sync::Condvar::new()));
        // SAFETY: the copy only records the pieces; no memory is touched.
        let r = unsafe {
            run(
                dir,
                pieces,
                threads,
                move |part: &[Piece]| -> std::io::Result<()> {
                    let id = format!("{:?}", std::thread::current().id());
                    n.lock().unwrap().insert(id);
                    let (count, all) = &*arrived;
                    let mut c = count.lock().unwrap();
                    *c += 1;
                    all.notify_all();
                    let _ = all
                        .wait_timeout_while(c, Duration::from_secs(5), |c| *c < together)
                        .unwrap();
                    s.lock()
                        .unwrap()
                        .extend(part.iter().map(|p| (p.remote, p.local as usize, p.len)));
                    Ok(())
                },
                lost,
            )
        };
        r.unwrap();
        let mut seen: Vec<Piece> = seen
            .lock()
            .unwrap()
            .iter()
            .map(|&(r, l, n)| piece(r, l, n))
            .collect();
        seen.sort_by_key(|p| p.local as usize);
        let names = names.lock().unwrap().clone();
        (seen, names)
    }

    #[test]
    fn a_large_copy_runs_on_several_threads_and_copies_every_byte_once() {
        let pieces: Vec<Piece> = (0..16)
            .map(|i| piece(i * (1 << 20), (i + 100) * (1 << 20), 1 << 20))
            .collect();
        let (seen, threads) = record(&pieces, Dir::Read, 3, 3);
        assert_eq!(threads.len(), 3, "threads used: {threads:?}");
        let total: usize = seen.iter().map(|p| p.len).sum();
        assert_eq!(total, 16 << 20);
        let mut want = bytes(&pieces);
        let mut got = bytes(&seen);
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want);
    }

    #[test]
    fn small_or_overlapping_copies_stay_on_the_calling_thread() {
        let small = vec![piece(0, 1 << 30, MIN_PART)];
        assert_eq!(record(&small, Dir::Read, 4, 1).1.len(), 1);
        // Two pieces reading into the same local bytes: the later must win, so in order.
        let overlapping = vec![piece(0, 1 << 30, 8 << 20), piece(8 << 20, 1 << 30, 8 << 20)];
        assert_eq!(record(&overlapping, Dir::Read, 4, 1).1.len(), 1);
    }

    #[test]
    fn the_first_error_in_piece_order_is_returned_after_every_part_ended() {
        let pieces: Vec<Piece> = (0..4)
            .map(|i| piece(i * (4 << 20), (i + 100) * (4 << 20), 4 << 20))
            .collect();
        let ended = Arc::new(Mutex::new(0usize));
        let e = ended.clone();
        // SAFETY: the copy touches no memory.
        let r = unsafe {
            run(
                Dir::Write,
                &pieces,
                4,
                move |part: &[Piece]| {
                    // The parts after the first fail; the last one slowly.
                    let first = part[0].remote;
                    if first == 3 * (4 << 20) {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    *e.lock().unwrap() += 1;
                    if first == 0 {
                        Ok(())
                    } else {
                        Err(first)
                    }
                },
                || usize::MAX,
            )
        };
        assert_eq!(
            *ended.lock().unwrap(),
            4,
            "returned before every part ended"
        );
        assert_eq!(r, Err(4 << 20), "not the first part's error in piece order");
    }
}
