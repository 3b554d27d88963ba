//! Target `op_validation`: a peer's batch of op headers against a region table, through the
//! data path's own validation (`kvbridge::fuzzing::validate_batch`, which calls the reader's
//! `resolve`), compared with an independent model of the documented rules
//! (`docs/protocol.md`, "Data connection").
//!
//! Checked: nothing panics; the data path accepts exactly what the model accepts and refuses
//! with the model's code otherwise; everything accepted lies inside a region that exists and
//! is granted to the sender (`offset + len` without overflow, at most the region's length),
//! the batch within the op and byte limits; no region stays marked in use afterwards.

use arbitrary::{Arbitrary, Unstructured};
use kvbridge::fuzzing::{validate_batch, Accepted};
use kvbridge::{Grant, Limits, Region};
use kvbridge_proto::msg::{Batch, ErrorCode, OpDesc};
use kvbridge_proto::{PeerId, RegionId};

/// Largest region the target allocates (regions are allocated per input).
const MAX_REGION: u64 = 1 << 16;

#[derive(Debug, Arbitrary)]
struct RegionSpec {
    len: u16,
    page: u8,
    grant: GrantSpec,
}

#[derive(Debug, Arbitrary)]
enum GrantSpec {
    All,
    Sender,
    Others,
    Nobody,
}

/// A number chosen to land near the edges that matter.
#[derive(Debug, Arbitrary)]
enum Num {
    Raw(u64),
    Small(u16),
    /// The region's length minus this.
    FromEnd(u16),
    /// The region's length plus this.
    PastEnd(u16),
    /// `u64::MAX` minus this.
    NearMax(u16),
    /// A power of two.
    Pow2(u8),
}

#[derive(Debug, Arbitrary)]
struct OpSpec {
    /// Index into the table's regions; past the end names a region nobody registered.
    region: u8,
    offset: Num,
    len: Num,
}

#[derive(Debug, Arbitrary)]
struct Input {
    regions: Vec<RegionSpec>,
    max_ops: u8,
    max_bytes: Num,
    ops: Vec<OpSpec>,
}

fn num(n: &Num, region_len: u64) -> u64 {
    match *n {
        Num::Raw(v) => v,
        Num::Small(v) => u64::from(v),
        Num::FromEnd(v) => region_len.saturating_sub(u64::from(v)),
        Num::PastEnd(v) => region_len.saturating_add(u64::from(v)),
        Num::NearMax(v) => u64::MAX - u64::from(v),
        Num::Pow2(v) => 1u64.checked_shl(u32::from(v % 64)).unwrap_or(0),
    }
}

/// What the documented rules say about a batch: accepted, or the code of the first refusal.
fn model(
    sender: &PeerId,
    table: &[(Region, Grant)],
    limits: &Limits,
    ops: &[OpDesc],
) -> Result<(), ErrorCode> {
    if ops.len() > limits.max_ops_per_batch {
        return Err(ErrorCode::LimitExceeded);
    }
    let mut total: u64 = 0;
    for op in ops {
        total = total.checked_add(op.len).ok_or(ErrorCode::LimitExceeded)?;
    }
    if total > limits.max_batch_bytes {
        return Err(ErrorCode::LimitExceeded);
    }
    for op in ops {
        let granted = table.iter().find(|(r, g)| {
            r.id() == op.region
                && match g {
                    Grant::AllPeers => true,
                    Grant::Peers(p) => p.contains(sender),
                }
        });
        let Some((r, _)) = granted else {
            return Err(ErrorCode::UnknownRegion);
        };
        let fits = match op.offset.checked_add(op.len) {
            Some(end) => end <= r.len() as u64,
            None => false,
        };
        if !fits {
            return Err(ErrorCode::OutOfBounds);
        }
    }
    Ok(())
}

/// The target's body.
pub fn run(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(input) = Input::arbitrary(&mut u) else {
        return;
    };
    let sender = PeerId::new("prefill-0").unwrap();
    let other = PeerId::new("prefill-1").unwrap();
    let mut table: Vec<(Region, Grant)> = Vec::new();
    for spec in input.regions.iter().take(4) {
        let len = (u64::from(spec.len) % MAX_REGION) + 1;
        let page = usize::from(spec.page) + 1;
        let region = Region::alloc(len as usize, page).expect("small regions allocate");
        let grant = match spec.grant {
            GrantSpec::All => Grant::AllPeers,
            GrantSpec::Sender => Grant::Peers(vec![other.clone(), sender.clone()]),
            GrantSpec::Others => Grant::Peers(vec![other.clone()]),
            GrantSpec::Nobody => Grant::Peers(vec![]),
        };
        table.push((region, grant));
    }
    let limits = Limits {
        max_ops_per_batch: usize::from(input.max_ops),
        max_batch_bytes: num(&input.max_bytes, MAX_REGION),
        ..Limits::default()
    };
    let unknown = RegionId([0xee; 16]);
    let ops: Vec<OpDesc> = input
        .ops
        .iter()
        .take(300)
        .map(|o| {
            let (region, len) = match table.get(usize::from(o.region)) {
                Some((r, _)) => (r.id(), r.len() as u64),
                None => (unknown, MAX_REGION),
            };
            OpDesc {
                region,
                offset: num(&o.offset, len),
                len: num(&o.len, len),
            }
        })
        .collect();
    let batch = Batch {
        id: 1,
        ops,
        grant: None,
    };

    let got = validate_batch(&sender, &table, &limits, &batch);
    let want = model(&sender, &table, &limits, &batch.ops);
    match (&got, want) {
        (Ok(acc), Ok(())) => check_accepted(&sender, &table, &limits, &batch, acc),
        (Err(r), Err(code)) => {
            assert_eq!(r.code, code, "refused with another code: {r:?}");
            assert!(!r.message.is_empty());
        }
        _ => panic!("data path said {got:?}, the documented rules {want:?}, for {batch:?}"),
    }
    for (r, _) in &table {
        assert_eq!(r.in_use(), 0, "validation left region {} in use", r.id());
    }
}

fn check_accepted(
    sender: &PeerId,
    table: &[(Region, Grant)],
    limits: &Limits,
    batch: &Batch,
    acc: &[Accepted],
) {
    assert!(batch.ops.len() <= limits.max_ops_per_batch);
    assert_eq!(acc.len(), batch.ops.len());
    let mut total: u64 = 0;
    for (a, op) in acc.iter().zip(&batch.ops) {
        assert_eq!((a.region, a.offset, a.len), (op.region, op.offset, op.len));
        let (r, g) = table
            .iter()
            .find(|(r, _)| r.id() == a.region)
            .expect("accepted an op on a region that is not registered");
        if let Grant::Peers(p) = g {
            assert!(p.contains(sender), "accepted an op on a region not granted");
        }
        let end = a
            .offset
            .checked_add(a.len)
            .expect("accepted an overflowing op");
        assert!(
            end <= r.len() as u64,
            "accepted an op past its region's end"
        );
        total = total
            .checked_add(a.len)
            .expect("accepted an overflowing batch");
    }
    assert!(total <= limits.max_batch_bytes);
}
