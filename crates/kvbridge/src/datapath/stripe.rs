//! Striping: a batch cut by bytes into contiguous parts, one per data connection.

use crate::region::LocalSlice;
use kvbridge_proto::msg::OpDesc;

/// Least bytes per part of a striped batch: smaller batches stay on one connection.
pub(crate) const MIN_PART: u64 = 256 << 10;

/// Splits a batch by bytes into up to `ways` contiguous parts of at least [`MIN_PART`]
/// bytes (an op may be cut between two parts); a batch too small to split stays whole.
pub(crate) fn split(
    descs: Vec<OpDesc>,
    locals: Vec<LocalSlice>,
    ways: usize,
) -> Vec<(Vec<OpDesc>, Vec<LocalSlice>)> {
    let total: u64 = descs.iter().map(|d| d.len).sum();
    let k = (ways as u64).min(total / MIN_PART).max(1) as usize;
    if k == 1 {
        return vec![(descs, locals)];
    }
    // Part p ends at byte total * (p + 1) / k of the batch.
    let end_of = |p: usize| total * (p as u64 + 1) / k as u64;
    let mut parts = Vec::with_capacity(k);
    let mut cur: (Vec<OpDesc>, Vec<LocalSlice>) = (Vec::new(), Vec::new());
    let mut done = 0u64;
    let mut part = 0usize;
    for (mut d, mut l) in descs.into_iter().zip(locals) {
        loop {
            let room = end_of(part) - done;
            if d.len <= room || part == k - 1 {
                done += d.len;
                cur.0.push(d);
                cur.1.push(l);
                if done == end_of(part) && part < k - 1 {
                    parts.push(std::mem::take(&mut cur));
                    part += 1;
                }
                break;
            }
            if room > 0 {
                cur.0.push(OpDesc {
                    region: d.region,
                    offset: d.offset,
                    len: room,
                });
                cur.1.push(LocalSlice {
                    region: l.region.again(),
                    offset: l.offset,
                    len: room as usize,
                });
                d.offset += room;
                d.len -= room;
                l.offset += room as usize;
                l.len -= room as usize;
                done += room;
            }
            if !cur.0.is_empty() {
                parts.push(std::mem::take(&mut cur));
            }
            part += 1;
        }
    }
    if !cur.0.is_empty() {
        parts.push(cur);
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;

    fn batch(r: &Region, lens: &[u64]) -> (Vec<OpDesc>, Vec<LocalSlice>) {
        let mut off = 0u64;
        lens.iter()
            .map(|&len| {
                let d = OpDesc {
                    region: r.id(),
                    offset: off,
                    len,
                };
                let l = LocalSlice {
                    region: r.begin_use(),
                    offset: off as usize,
                    len: len as usize,
                };
                off += len;
                (d, l)
            })
            .unzip()
    }

    /// Parts are contiguous pieces of the batch in order, every byte once, sized by bytes.
    #[test]
    fn split_cuts_by_bytes_and_keeps_every_byte() {
        let r = Region::alloc(8 << 20, 4096).unwrap();
        let lens = [3 << 20, 1, 0, (2 << 20) + 5, 100];
        let total: u64 = lens.iter().sum();
        let (d, l) = batch(&r, &lens);
        let parts = split(d, l, 3);
        assert_eq!(parts.len(), 3);
        let mut next = 0u64;
        for (i, (descs, locals)) in parts.iter().enumerate() {
            assert_eq!(descs.len(), locals.len());
            let bytes: u64 = descs.iter().map(|d| d.len).sum();
            let want = total * (i as u64 + 1) / 3 - total * i as u64 / 3;
            assert_eq!(bytes, want, "part {i}");
            for (d, l) in descs.iter().zip(locals) {
                assert_eq!(d.offset, next);
                assert_eq!((l.offset as u64, l.len as u64), (d.offset, d.len));
                next += d.len;
            }
        }
        assert_eq!(next, total);
        // Every piece holds its own region-in-use guard.
        assert_eq!(r.in_use(), parts.iter().map(|p| p.1.len()).sum::<usize>());
    }

    /// Below two minimum parts a batch stays whole; the part count never exceeds the ways.
    #[test]
    fn small_batches_stay_whole() {
        let r = Region::alloc(8 << 20, 4096).unwrap();
        let (d, l) = batch(&r, &[MIN_PART, MIN_PART - 1]);
        assert_eq!(split(d, l, 4).len(), 1);
        let (d, l) = batch(&r, &[4 * MIN_PART]);
        assert_eq!(split(d, l, 2).len(), 2);
        let (d, l) = batch(&r, &[4 * MIN_PART]);
        assert_eq!(split(d, l, 1).len(), 1);
    }
}
