//! Adjacent ranges of a one-sided batch as one operation. A batch often names consecutive
//! blocks (a request's pages laid out in order on both sides); each range posted on its own
//! costs a message and, where UCX emulates remote writes with active messages (its tcp
//! transport on UCX 1.13), an acknowledgement from the target and a copy on each side per
//! range. Two ranges merge when the second starts where the first ends, on both sides, in
//! the same local and remote regions; the merged batch moves the same bytes in the same
//! order.

use crate::transport::one_sided_engine::RangeOp;

/// `ops` with every run of adjacent ranges (see the module docs) as one range.
pub(crate) fn merge_adjacent(ops: Vec<RangeOp>) -> Vec<RangeOp> {
    let mut out: Vec<RangeOp> = Vec::with_capacity(ops.len());
    for op in ops {
        if let Some(last) = out.last_mut() {
            if let Some(merged) = joined(last, &op) {
                *last = merged;
                continue;
            }
        }
        out.push(op);
    }
    out
}

/// `a` followed by `b` as one range, where `b` continues `a` on both sides.
fn joined(a: &RangeOp, b: &RangeOp) -> Option<RangeOp> {
    let continues = a.local == b.local
        && a.remote == b.remote
        && a.local_offset.checked_add(a.len)? == b.local_offset
        && a.remote_offset.checked_add(a.len)? == b.remote_offset;
    continues.then_some(RangeOp {
        len: a.len.checked_add(b.len)?,
        ..*a
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvbridge_proto::RegionId;

    const L: RegionId = RegionId([1; 16]);
    const R: RegionId = RegionId([2; 16]);

    fn op(local_offset: u64, remote_offset: u64, len: u64) -> RangeOp {
        RangeOp {
            local: L,
            local_offset,
            remote: R,
            remote_offset,
            len,
        }
    }

    /// Every (local byte, remote byte) pair a batch moves, in order.
    fn bytes(ops: &[RangeOp]) -> Vec<(RegionId, u64, RegionId, u64)> {
        ops.iter()
            .flat_map(|o| {
                (0..o.len)
                    .map(move |i| (o.local, o.local_offset + i, o.remote, o.remote_offset + i))
            })
            .collect()
    }

    #[test]
    fn consecutive_blocks_become_one_range() {
        let ops: Vec<_> = (0..16).map(|i| op(i * 64, 4096 + i * 64, 64)).collect();
        assert_eq!(merge_adjacent(ops), vec![op(0, 4096, 16 * 64)]);
    }

    #[test]
    fn ranges_adjacent_on_one_side_only_stay_apart() {
        let local_only = vec![op(0, 0, 64), op(64, 256, 64)];
        assert_eq!(merge_adjacent(local_only.clone()), local_only);
        let remote_only = vec![op(0, 0, 64), op(256, 64, 64)];
        assert_eq!(merge_adjacent(remote_only.clone()), remote_only);
        let backwards = vec![op(64, 64, 64), op(0, 0, 64)];
        assert_eq!(merge_adjacent(backwards.clone()), backwards);
        let other_region = vec![
            op(0, 0, 64),
            RangeOp {
                remote: RegionId([3; 16]),
                ..op(64, 64, 64)
            },
        ];
        assert_eq!(merge_adjacent(other_region.clone()), other_region);
        let other_local = vec![
            op(0, 0, 64),
            RangeOp {
                local: RegionId([3; 16]),
                ..op(64, 64, 64)
            },
        ];
        assert_eq!(merge_adjacent(other_local.clone()), other_local);
    }

    #[test]
    fn offsets_at_the_end_of_u64_do_not_wrap_into_a_merge() {
        let ops = vec![op(u64::MAX - 3, 0, 8), op(4, 8, 8)];
        assert_eq!(merge_adjacent(ops.clone()), ops);
    }

    #[test]
    fn a_merged_batch_moves_the_same_bytes_in_the_same_order() {
        // A fixed pseudo-random mix of runs, gaps, repeats and region changes.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200 {
            let (mut lo, mut ro) = (next() % 64, next() % 64);
            let ops: Vec<RangeOp> = (0..next() % 20)
                .map(|_| {
                    let len = next() % 9;
                    let o = RangeOp {
                        local: if next() % 5 == 0 { R } else { L },
                        ..op(lo, ro, len)
                    };
                    match next() % 4 {
                        0 => lo += len + next() % 3,
                        1 => ro += len + next() % 3,
                        _ => {
                            lo += len;
                            ro += len;
                        }
                    }
                    o
                })
                .collect();
            let merged = merge_adjacent(ops.clone());
            assert_eq!(bytes(&merged), bytes(&ops), "{ops:?} -> {merged:?}");
            assert!(merged.len() <= ops.len());
            assert!(
                merged.windows(2).all(|w| joined(&w[0], &w[1]).is_none()),
                "{merged:?} still has adjacent ranges"
            );
        }
    }
}
