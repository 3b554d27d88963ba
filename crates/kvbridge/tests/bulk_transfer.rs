//! 1 GiB moved as 16 KiB pages scattered to random remote pages, verified byte-exact, both
//! by writes and by reads.

mod common;
use common::*;
use kvbridge::{Grant, Op, Region};

const PAGE: usize = 16 << 10;
const TOTAL: usize = 1 << 30;
const PAGES: usize = TOTAL / PAGE;
const BATCH: usize = 1024;

fn permutation(n: usize, mut seed: u64) -> Vec<usize> {
    let mut p: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        p.swap(i, (seed % (i as u64 + 1)) as usize);
    }
    p
}

fn page(r: &Region, i: usize) -> &[u8] {
    // SAFETY: in bounds; no transfer is in flight while the test compares.
    unsafe { std::slice::from_raw_parts(r.as_ptr().add(i * PAGE), PAGE) }
}

async fn one_gib_scattered_pages_written_and_read_back_byte_exact(t: Carrier) {
    let (dec, kv) = listener("decode-0", |c| t.apply(c), TOTAL, PAGE).await;
    let (pre, src) = initiator("prefill-0", |c| t.apply(c), TOTAL, PAGE).await;
    fill(&src, 0xC0FFEE);
    let peer = pre.connect(&addr(&dec)).await.unwrap();
    assert_transport(&pre, &peer, t).await;
    let perm = permutation(PAGES, 0x1234_5678_9abc_def1);

    for chunk in (0..PAGES).collect::<Vec<_>>().chunks(BATCH) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|&i| Op::page(&src, i, kv.id(), perm[i] as u64, PAGE))
            .collect();
        pre.write(&peer, &ops).await.unwrap();
    }
    for (i, &p) in perm.iter().enumerate() {
        assert!(
            page(&src, i) == page(&kv, p),
            "written page {i} (remote {p}) differs"
        );
    }

    let back = Region::alloc(TOTAL, PAGE).unwrap();
    pre.register(&back, Grant::AllPeers).unwrap();
    for chunk in (0..PAGES).collect::<Vec<_>>().chunks(BATCH) {
        let ops: Vec<Op> = chunk
            .iter()
            .map(|&i| Op::page(&back, i, kv.id(), perm[i] as u64, PAGE))
            .collect();
        pre.read(&peer, &ops).await.unwrap();
    }
    for i in 0..PAGES {
        assert!(
            page(&src, i) == page(&back, i),
            "read-back page {i} differs"
        );
    }
    let s = pre.stats().await.unwrap();
    assert_eq!(s.batches_in_flight, 0);
}

per_transport!(
    one_gib_scattered_pages,
    super::one_gib_scattered_pages_written_and_read_back_byte_exact
);
