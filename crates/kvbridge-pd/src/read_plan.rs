//! The read planner: "decoder rank d wants the first `tokens` tokens of a request, held in
//! prefiller blocks `S` and to land in its blocks `D`" becomes the fewest ranged reads.
//!
//! Tokens are matched by position: token `t` sits in prefiller block `S[t / Bp]` at row
//! `t % Bp` and lands in decoder block `D[t / Bd]` at row `t % Bd`, with `Bp`, `Bd` the
//! two block sizes (any two sizes, either one larger, divisible or not). The token axis is
//! cut where either side's block ends; for each piece and each run of heads one prefiller
//! rank supplies ([`crate::rank_map::head_sources`]), the bytes to move form a box inside
//! one prefiller block and one decoder block. Going from the innermost dimension outward, a
//! read extends over every dimension that the box covers whole on both sides, plus the
//! first one it does not; each index of the dimensions further out is one more read. So:
//!
//! - same heads and block size on both sides: one read per block, and a run of blocks
//!   adjacent on both sides is one read;
//! - a head range in a block whose heads are outermost (vLLM's CPU layout
//!   `[blocks, heads, 2 * block_size, head_size]`): one read per block;
//! - a head range in a block whose heads are innermost (flash-attention's
//!   `[.., block_size, heads, head_dim]`) is strided: one read per token (and per layer
//!   and K/V inside the block) — inherent to ranged reads, and counted by
//!   [`ReadPlan::ops`];
//! - MLA: the whole latent from one rank, one read per block.
//!
//! Finally reads adjacent on both sides are merged (in the decoder's byte order), which
//! the tests prove gives the fewest reads that move exactly the wanted bytes.
//!
//! Reads are per *plane* ([`crate::tp_layout::TpLayout::planes`]): offsets are bytes from
//! the start of a plane (block 0), and the same reads apply to every plane.

use crate::rank_map::{head_sources, HeadSource};
use crate::tp_layout::{BlockDim, TpLayout, Translation};
use std::fmt;

/// One ranged read: `len` bytes from a prefiller rank into the decoder rank's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RangeRead {
    /// The prefiller rank to read from.
    pub prefiller_rank: u32,
    /// Offset in the prefiller rank's plane.
    pub src_offset: u64,
    /// Offset in the decoder rank's plane.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The reads of one request on one decoder rank.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReadPlan {
    /// The reads of one plane, by prefiller rank, then decoder offset.
    pub reads: Vec<RangeRead>,
    /// Planes to apply them to (each read is issued once per plane).
    pub planes: u64,
}

impl ReadPlan {
    /// Reads issued in all: [`Self::reads`] times [`Self::planes`].
    pub fn ops(&self) -> u64 {
        self.reads.len() as u64 * self.planes
    }

    /// Bytes moved in all.
    pub fn bytes(&self) -> u64 {
        self.reads.iter().map(|r| r.len).sum::<u64>() * self.planes
    }

    /// The prefiller ranks read from (ascending, each once).
    pub fn prefiller_ranks(&self) -> Vec<u32> {
        let mut ranks: Vec<u32> = self.reads.iter().map(|r| r.prefiller_rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }
}

/// Which side of a transfer a value belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The prefiller (source).
    Prefiller,
    /// The decoder (destination).
    Decoder,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Prefiller => "prefiller",
            Side::Decoder => "decoder",
        })
    }
}

/// Why a request cannot be planned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The block list does not hold the request's tokens.
    #[error("{side} blocks: {tokens} tokens in blocks of {block_tokens} need {expected} blocks, got {got}")]
    BlockCount {
        /// Whose block list.
        side: Side,
        /// The request's tokens.
        tokens: u64,
        /// That side's block size.
        block_tokens: u32,
        /// Blocks needed.
        expected: u64,
        /// Blocks given.
        got: usize,
    },
    /// A block's bytes do not all have a 64-bit offset.
    #[error("{side} block {block}: its offset overflows 64 bits")]
    OffsetOverflow {
        /// Whose block.
        side: Side,
        /// The block id.
        block: u32,
    },
}

/// Plans the reads of one decoder rank from one prefiller engine. Made once per peer
/// engine (after [`Translation::new`] accepted the pair); [`Self::plan`] runs per request.
#[derive(Debug, Clone)]
pub struct ReadPlanner {
    prefiller: TpLayout,
    decoder: TpLayout,
    sources: Vec<HeadSource>,
}

/// One dimension of a box: where it starts on each side, how far it goes, and each side's
/// extent and byte stride.
#[derive(Debug, Clone, Copy)]
struct BoxDim {
    src_start: u64,
    dst_start: u64,
    count: u64,
    src_extent: u64,
    dst_extent: u64,
    src_stride: u64,
    dst_stride: u64,
}

impl BoxDim {
    fn whole_on_both_sides(&self) -> bool {
        self.src_start == 0
            && self.dst_start == 0
            && self.count == self.src_extent
            && self.count == self.dst_extent
    }
}

impl ReadPlanner {
    /// The planner for the decoder rank of `t` (its `decoder().tp_rank`).
    pub fn new(t: &Translation) -> Self {
        Self {
            prefiller: t.prefiller().clone(),
            decoder: t.decoder().clone(),
            sources: head_sources(t, t.decoder().tp_rank),
        }
    }

    /// The prefiller ranks this decoder rank reads from (ascending).
    pub fn source_ranks(&self) -> Vec<u32> {
        let mut ranks: Vec<u32> = self.sources.iter().map(|s| s.prefiller_rank).collect();
        ranks.sort_unstable();
        ranks.dedup();
        ranks
    }

    /// The bytes this decoder rank needs for `tokens` tokens, over all planes: what a plan
    /// must move, no more.
    pub fn wanted_bytes(&self, tokens: u64) -> u64 {
        let d = &self.decoder;
        tokens
            .saturating_mul(d.layers as u64)
            .saturating_mul(d.extent(BlockDim::Kv))
            .saturating_mul(d.extent(BlockDim::Head))
            .saturating_mul(d.head_bytes())
    }

    /// The reads that move the first `tokens` tokens from prefiller blocks `src_blocks`
    /// (the request's blocks in token order; the same ids on every prefiller rank, as
    /// vLLM allocates them per engine) into decoder blocks `dst_blocks` (in token order).
    pub fn plan(
        &self,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        tokens: u64,
    ) -> Result<ReadPlan, PlanError> {
        let (p, d) = (&self.prefiller, &self.decoder);
        for (side, layout, blocks) in [
            (Side::Prefiller, p, src_blocks),
            (Side::Decoder, d, dst_blocks),
        ] {
            let expected = tokens.div_ceil(layout.block_tokens as u64);
            if blocks.len() as u64 != expected {
                return Err(PlanError::BlockCount {
                    side,
                    tokens,
                    block_tokens: layout.block_tokens,
                    expected,
                    got: blocks.len(),
                });
            }
        }
        let (bp, bd) = (p.block_tokens as u64, d.block_tokens as u64);
        let (src_strides, dst_strides) = (p.strides(), d.strides());
        let mut reads = Vec::new();
        let mut t = 0u64;
        while t < tokens {
            let (si, di) = ((t / bp) as usize, (t / bd) as usize);
            let end = ((si as u64 + 1) * bp).min((di as u64 + 1) * bd).min(tokens);
            let src_base = block_offset(Side::Prefiller, src_blocks[si], p.block_bytes())?;
            let dst_base = block_offset(Side::Decoder, dst_blocks[di], d.block_bytes())?;
            for s in &self.sources {
                let dims: Vec<BoxDim> = p
                    .block_order
                    .iter()
                    .enumerate()
                    .map(|(k, dim)| {
                        let (src_start, dst_start, count) = match dim {
                            BlockDim::Layer | BlockDim::Kv => (0, 0, p.extent(*dim)),
                            BlockDim::Token => (t - si as u64 * bp, t - di as u64 * bd, end - t),
                            BlockDim::Head => {
                                (s.src_head as u64, s.dst_head as u64, s.heads as u64)
                            }
                        };
                        BoxDim {
                            src_start,
                            dst_start,
                            count,
                            src_extent: p.extent(*dim),
                            dst_extent: d.extent(*dim),
                            src_stride: src_strides[k],
                            dst_stride: dst_strides[k],
                        }
                    })
                    .collect();
                push_box(
                    &mut reads,
                    s.prefiller_rank,
                    src_base,
                    dst_base,
                    &dims,
                    p.head_bytes(),
                );
            }
            t = end;
        }
        Ok(ReadPlan {
            reads: merge(reads),
            planes: d.planes(),
        })
    }
}

/// The offset of `block`, checked so that every byte up to the block's end is addressable
/// (offsets inside the block need no further checks).
fn block_offset(side: Side, block: u32, block_bytes: u64) -> Result<u64, PlanError> {
    (block as u64 + 1)
        .checked_mul(block_bytes)
        .map(|end| end - block_bytes)
        .ok_or(PlanError::OffsetOverflow { side, block })
}

/// Appends the reads of one box: the innermost dimensions it covers whole on both sides
/// plus the next one make one read; every index of the dimensions outside those is a read.
fn push_box(
    reads: &mut Vec<RangeRead>,
    prefiller_rank: u32,
    src_base: u64,
    dst_base: u64,
    dims: &[BoxDim],
    head_bytes: u64,
) {
    let mut len = head_bytes;
    let mut outer = 0;
    for k in (0..dims.len()).rev() {
        len *= dims[k].count;
        if !dims[k].whole_on_both_sides() {
            outer = k;
            break;
        }
    }
    // `block_offset` checked that the block's end fits, so no offset inside it overflows.
    let src0 = src_base + dims.iter().map(|b| b.src_start * b.src_stride).sum::<u64>();
    let dst0 = dst_base + dims.iter().map(|b| b.dst_start * b.dst_stride).sum::<u64>();
    let outer = &dims[..outer];
    let mut index = vec![0u64; outer.len()];
    loop {
        let src = src0
            + outer
                .iter()
                .zip(&index)
                .map(|(b, i)| i * b.src_stride)
                .sum::<u64>();
        let dst = dst0
            + outer
                .iter()
                .zip(&index)
                .map(|(b, i)| i * b.dst_stride)
                .sum::<u64>();
        reads.push(RangeRead {
            prefiller_rank,
            src_offset: src,
            dst_offset: dst,
            len,
        });
        // Next index, last dimension fastest; done when every dimension wrapped.
        let mut k = outer.len();
        loop {
            if k == 0 {
                return;
            }
            k -= 1;
            index[k] += 1;
            if index[k] < outer[k].count {
                break;
            }
            index[k] = 0;
        }
    }
}

/// Merges reads that continue each other on both sides, in the decoder's byte order (every
/// decoder byte is written once, so that order is total), then orders them by prefiller
/// rank for batching per peer.
fn merge(mut reads: Vec<RangeRead>) -> Vec<RangeRead> {
    reads.sort_unstable_by_key(|r| r.dst_offset);
    let mut merged: Vec<RangeRead> = Vec::with_capacity(reads.len());
    for r in reads {
        match merged.last_mut() {
            Some(last)
                if last.prefiller_rank == r.prefiller_rank
                    && last.src_offset + last.len == r.src_offset
                    && last.dst_offset + last.len == r.dst_offset =>
            {
                last.len += r.len
            }
            _ => merged.push(r),
        }
    }
    merged.sort_by_key(|r| (r.prefiller_rank, r.dst_offset));
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Dtype;
    use crate::tp_layout::tests::dense;
    use proptest::prelude::*;

    /// A byte that no wanted byte carries: what every unwanted prefiller byte holds.
    const JUNK: u32 = u32::MAX;

    /// Where one head-byte of the cache sits on a rank: (plane, offset in block).
    fn position(l: &TpLayout, layer: u64, kv: u64, row: u64, head: u64, byte: u64) -> (u64, u64) {
        let value = |d: &BlockDim| match d {
            BlockDim::Layer => layer,
            BlockDim::Kv => kv,
            BlockDim::Token => row,
            BlockDim::Head => head,
        };
        let plane = l
            .plane_dims()
            .iter()
            .fold(0, |acc, d| acc * l.extent(*d) + value(d));
        let offset = l
            .block_order
            .iter()
            .zip(l.strides())
            .map(|(d, s)| value(d) * s)
            .sum::<u64>()
            + byte;
        (plane, offset)
    }

    /// A distinct label for every byte of the model's KV of the request (global head).
    fn label(l: &TpLayout, tokens: u64, layer: u64, kv: u64, t: u64, head: u64, byte: u64) -> u32 {
        let kvs = l.extent(BlockDim::Kv);
        let heads = l.total_kv_heads as u64;
        (((((layer * kvs + kv) * tokens + t) * heads + head) * l.head_bytes() + byte) + 1) as u32
    }

    /// Calls `f(plane, offset, label)` for every byte `rank` of `l` holds of the request.
    fn for_each_byte(
        l: &TpLayout,
        rank: u32,
        blocks: &[u32],
        tokens: u64,
        mut f: impl FnMut(u64, u64, u32),
    ) {
        let heads = l.heads_of_rank(rank);
        for layer in 0..l.layers as u64 {
            for kv in 0..l.extent(BlockDim::Kv) {
                for t in 0..tokens {
                    let block = blocks[(t / l.block_tokens as u64) as usize] as u64;
                    let row = t % l.block_tokens as u64;
                    for (local, head) in heads.clone().enumerate() {
                        for byte in 0..l.head_bytes() {
                            let (plane, off) = position(l, layer, kv, row, local as u64, byte);
                            let lab = label(l, tokens, layer, kv, t, head as u64, byte);
                            f(plane, block * l.block_bytes() + off, lab);
                        }
                    }
                }
            }
        }
    }

    /// Runs `plan` on simulated buffers and checks that every wanted byte of the decoder
    /// rank lands once with the right content, nothing else is written, and only wanted
    /// bytes are read.
    fn check_bytes(
        t: &Translation,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        tokens: u64,
        plan: &ReadPlan,
    ) -> Result<(), String> {
        let (p, d) = (t.prefiller(), t.decoder());
        let region = |l: &TpLayout, blocks: &[u32]| {
            (blocks.iter().max().map_or(0, |m| *m as u64 + 1) * l.block_bytes()) as usize
        };
        let (src_len, dst_len) = (region(p, src_blocks), region(d, dst_blocks));
        let planes = d.planes() as usize;
        // src[rank][plane][byte]
        let mut src = vec![vec![vec![JUNK; src_len]; planes]; p.tp_size as usize];
        for (rank, buf) in src.iter_mut().enumerate() {
            for_each_byte(p, rank as u32, src_blocks, tokens, |pl, off, lab| {
                buf[pl as usize][off as usize] = lab
            });
        }
        let mut dst = vec![vec![0u32; dst_len]; planes];
        let mut writes = vec![vec![0u32; dst_len]; planes];
        if plan.planes != d.planes() {
            return Err(format!("{} planes, want {}", plan.planes, d.planes()));
        }
        for pl in 0..planes {
            for r in &plan.reads {
                let s = &src[r.prefiller_rank as usize][pl];
                for i in 0..r.len as usize {
                    let (so, dof) = (r.src_offset as usize + i, r.dst_offset as usize + i);
                    if so >= s.len() || dof >= dst_len {
                        return Err(format!("{r:?} out of bounds"));
                    }
                    dst[pl][dof] = s[so];
                    writes[pl][dof] += 1;
                }
            }
        }
        let mut want = vec![vec![0u32; dst_len]; planes];
        for_each_byte(d, d.tp_rank, dst_blocks, tokens, |pl, off, lab| {
            want[pl as usize][off as usize] = lab
        });
        for pl in 0..planes {
            for i in 0..dst_len {
                let wanted = want[pl][i] != 0;
                if writes[pl][i] != wanted as u32 || dst[pl][i] != want[pl][i] {
                    return Err(format!(
                        "plane {pl} byte {i}: written {} times with {:#x}, want {} with {:#x}",
                        writes[pl][i], dst[pl][i], wanted as u32, want[pl][i]
                    ));
                }
            }
        }
        Ok(())
    }

    /// The fewest reads possible: every head-byte run as its own read, in the decoder's
    /// order, merged wherever both sides continue. Any read covers bytes contiguous on both
    /// sides, so it lies inside one of these maximal runs.
    fn fewest_reads(t: &Translation, src_blocks: &[u32], dst_blocks: &[u32], tokens: u64) -> u64 {
        let (p, d) = (t.prefiller(), t.decoder());
        let inside = |dim| d.block_order.contains(&dim);
        let layers = if inside(BlockDim::Layer) {
            d.layers as u64
        } else {
            1
        };
        let kvs = if inside(BlockDim::Kv) {
            d.extent(BlockDim::Kv)
        } else {
            1
        };
        let mut atoms = Vec::new();
        for s in head_sources(t, d.tp_rank) {
            for layer in 0..layers {
                for kv in 0..kvs {
                    for tok in 0..tokens {
                        let (bp, bd) = (p.block_tokens as u64, d.block_tokens as u64);
                        for h in 0..s.heads as u64 {
                            let (_, so) =
                                position(p, layer, kv, tok % bp, s.src_head as u64 + h, 0);
                            let (_, dof) =
                                position(d, layer, kv, tok % bd, s.dst_head as u64 + h, 0);
                            atoms.push(RangeRead {
                                prefiller_rank: s.prefiller_rank,
                                src_offset: src_blocks[(tok / bp) as usize] as u64
                                    * p.block_bytes()
                                    + so,
                                dst_offset: dst_blocks[(tok / bd) as usize] as u64
                                    * d.block_bytes()
                                    + dof,
                                len: p.head_bytes(),
                            });
                        }
                    }
                }
            }
        }
        merge(atoms).len() as u64 * d.planes()
    }

    fn layout(heads: u32, tp: u32, rank: u32, block: u32, order: &[BlockDim]) -> TpLayout {
        TpLayout {
            total_kv_heads: heads,
            block_tokens: block,
            block_order: order.to_vec(),
            tp_rank: rank,
            tp_size: tp,
            ..dense(0, 1)
        }
    }

    fn ids(n: u64, seed: u64) -> Vec<u32> {
        // Consecutive ids (merge candidates) for a third of the seeds, shuffled otherwise.
        let mut v: Vec<u32> = (0..n as u32 + (seed % 4) as u32).collect();
        if !seed.is_multiple_of(3) {
            let mut x = seed | 1;
            for i in (1..v.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                v.swap(i, (x % (i as u64 + 1)) as usize);
            }
        } else {
            v.drain(..(seed % 4) as usize);
        }
        v.truncate(n as usize);
        v
    }

    const ORDERS: [&[BlockDim]; 8] = [
        &TpLayout::CHUNK_ORDER,
        &[BlockDim::Head, BlockDim::Kv, BlockDim::Token],
        &[BlockDim::Token, BlockDim::Head],
        &[BlockDim::Head, BlockDim::Token],
        &[
            BlockDim::Layer,
            BlockDim::Head,
            BlockDim::Kv,
            BlockDim::Token,
        ],
        &[BlockDim::Kv, BlockDim::Token, BlockDim::Head],
        &[
            BlockDim::Token,
            BlockDim::Layer,
            BlockDim::Head,
            BlockDim::Kv,
        ],
        &[
            BlockDim::Head,
            BlockDim::Token,
            BlockDim::Kv,
            BlockDim::Layer,
        ],
    ];

    /// What the two sides share in a generated case.
    struct Model {
        heads: u32,
        mla: bool,
        layers: u32,
        head_dim: u32,
        dtype: Dtype,
    }

    fn case(
        m: &Model,
        tps: (u32, u32),
        blocks: (u32, u32),
        order: &[BlockDim],
    ) -> Option<Translation> {
        let side = |tp, block| TpLayout {
            mla: m.mla,
            total_kv_heads: if m.mla { 1 } else { m.heads },
            layers: m.layers,
            head_dim: m.head_dim,
            dtype: m.dtype,
            ..layout(m.heads, tp, 0, block, order)
        };
        Translation::new(&side(tps.0, blocks.0), &side(tps.1, blocks.1)).ok()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn every_wanted_byte_lands_once_in_the_fewest_reads(
            heads in prop::sample::select(vec![1u32, 2, 3, 4, 6, 8]),
            tp_p in prop::sample::select(vec![1u32, 2, 3, 4, 6, 8, 12]),
            tp_d in prop::sample::select(vec![1u32, 2, 3, 4, 6, 8, 12]),
            bp in 1u32..9,
            bd in 1u32..9,
            order in 0usize..ORDERS.len(),
            mla in prop::bool::weighted(0.2),
            layers in 1u32..4,
            head_dim in 1u32..4,
            wide in any::<bool>(),
            tokens in 0u64..40,
            rank_pick in any::<u32>(),
            seeds in (any::<u64>(), any::<u64>()),
        ) {
            let dtype = if wide { Dtype::Fp16 } else { Dtype::Fp8 };
            let model = Model { heads, mla, layers, head_dim, dtype };
            let t = case(&model, (tp_p, tp_d), (bp, bd), ORDERS[order]);
            prop_assume!(t.is_some());
            let t = t.unwrap();
            let rank = rank_pick % tp_d;
            let mut dl = t.decoder().clone();
            dl.tp_rank = rank;
            let t = Translation::new(t.prefiller(), &dl).unwrap();
            let src = ids(tokens.div_ceil(bp as u64), seeds.0);
            let dst = ids(tokens.div_ceil(bd as u64), seeds.1);
            let planner = ReadPlanner::new(&t);
            let plan = planner.plan(&src, &dst, tokens).unwrap();
            check_bytes(&t, &src, &dst, tokens, &plan).map_err(TestCaseError::fail)?;
            prop_assert_eq!(plan.bytes(), planner.wanted_bytes(tokens));
            prop_assert_eq!(plan.ops(), fewest_reads(&t, &src, &dst, tokens));
            prop_assert_eq!(plan.prefiller_ranks().len() <= planner.source_ranks().len(), true);
        }
    }

    fn planner(p: TpLayout, d: TpLayout) -> ReadPlanner {
        ReadPlanner::new(&Translation::new(&p, &d).unwrap())
    }

    #[test]
    fn same_layout_reads_whole_blocks_and_merges_adjacent_ones() {
        let o = &TpLayout::CHUNK_ORDER;
        let pl = planner(layout(4, 1, 0, 16, o), layout(4, 1, 0, 16, o));
        // Blocks 3,4,5 -> 7,8,9: adjacent on both sides, one read.
        let plan = pl.plan(&[3, 4, 5], &[7, 8, 9], 48).unwrap();
        let bb = layout(4, 1, 0, 16, o).block_bytes();
        assert_eq!(
            plan.reads,
            vec![RangeRead {
                prefiller_rank: 0,
                src_offset: 3 * bb,
                dst_offset: 7 * bb,
                len: 3 * bb
            }]
        );
        // A gap on one side splits the run.
        assert_eq!(pl.plan(&[3, 5, 6], &[7, 8, 9], 48).unwrap().ops(), 2);
        // Blocks listed in descending order still merge (the decoder's byte order counts).
        assert_eq!(pl.plan(&[5, 4], &[9, 8], 32).unwrap().ops(), 1);
        // A partial last block: its rows are one read per layer and K/V, and the first of
        // those continues the full block before it on both sides.
        assert_eq!(pl.plan(&[3, 4], &[7, 8], 20).unwrap().ops(), 2 * 2);
        assert_eq!(pl.plan(&[3, 5], &[7, 8], 20).unwrap().ops(), 1 + 2 * 2);
        assert_eq!(
            pl.plan(&[], &[], 0).unwrap(),
            ReadPlan {
                reads: vec![],
                planes: 1
            }
        );
    }

    #[test]
    fn heads_outermost_is_one_read_per_block_heads_innermost_one_per_token() {
        // vLLM CPU per layer: [blocks, heads, 2 * block, head] = order [Head, Kv, Token],
        // the layer outside. Decoder TP 2 of prefiller TP 1: half the heads of each block.
        let cpu = &[BlockDim::Head, BlockDim::Kv, BlockDim::Token];
        let pl = planner(layout(4, 1, 0, 16, cpu), layout(4, 2, 1, 16, cpu));
        let plan = pl.plan(&[0, 2, 4], &[1, 3, 5], 48).unwrap();
        assert_eq!(plan.reads.len(), 3);
        assert_eq!(plan.planes, 2);
        assert_eq!(plan.ops(), 3 * 2);
        // flash-attention: [2, blocks, block, heads, head] = [Token, Head], layer and K/V
        // outside: a head range is strided, one read per token.
        let fa = &[BlockDim::Token, BlockDim::Head];
        let pl = planner(layout(4, 1, 0, 16, fa), layout(4, 2, 1, 16, fa));
        let plan = pl.plan(&[0, 2, 4], &[1, 3, 5], 48).unwrap();
        assert_eq!(plan.reads.len(), 48);
        assert_eq!(plan.ops(), 48 * 2 * 2);
    }

    #[test]
    fn prefiller_tp_above_decoder_reads_each_rank_once_per_block() {
        let cpu = &[BlockDim::Head, BlockDim::Kv, BlockDim::Token];
        let pl = planner(layout(4, 2, 0, 16, cpu), layout(4, 1, 0, 16, cpu));
        assert_eq!(pl.source_ranks(), vec![0, 1]);
        let plan = pl.plan(&[0, 1], &[4, 6], 32).unwrap();
        assert_eq!(plan.prefiller_ranks(), vec![0, 1]);
        assert_eq!(plan.reads.len(), 2 * 2);
    }

    #[test]
    fn smaller_and_larger_prefiller_blocks() {
        let cpu = &[BlockDim::Head, BlockDim::Kv, BlockDim::Token];
        // Prefiller blocks of 4 into decoder blocks of 16 (NixlConnector's
        // block_size_ratio 4): heads outermost, so one read per prefiller block, per head
        // and K/V (the rows of one head are contiguous only within the smaller block).
        let pl = planner(layout(4, 1, 0, 4, cpu), layout(4, 1, 0, 16, cpu));
        // Two planes (layers).
        let plan = pl.plan(&[9, 8, 7, 6], &[0], 16).unwrap();
        assert_eq!(plan.ops(), 4 * 4 * 2 * 2);
        // The other direction: one prefiller block of 16 into four decoder blocks of 4.
        let pl = planner(layout(4, 1, 0, 16, cpu), layout(4, 1, 0, 4, cpu));
        assert_eq!(
            pl.plan(&[0], &[3, 2, 1, 0], 16).unwrap().ops(),
            4 * 4 * 2 * 2
        );
    }

    #[test]
    fn mla_reads_the_latent_once_from_one_rank() {
        let mla = |tp, rank| TpLayout {
            mla: true,
            total_kv_heads: 1,
            head_dim: 576,
            ..layout(1, tp, rank, 16, &TpLayout::CHUNK_ORDER)
        };
        for d in 0..4 {
            let pl = planner(mla(2, 0), mla(4, d));
            let plan = pl.plan(&[0, 2], &[1, 3], 32).unwrap();
            assert_eq!(plan.prefiller_ranks(), vec![d / 2]);
            assert_eq!(plan.ops(), 2);
            assert_eq!(plan.bytes(), 32 * 2 * 576 * 2);
            assert_eq!(plan.bytes(), pl.wanted_bytes(32));
        }
    }

    #[test]
    fn bad_requests_are_typed_errors() {
        let o = &TpLayout::CHUNK_ORDER;
        let pl = planner(layout(4, 1, 0, 16, o), layout(4, 1, 0, 8, o));
        assert_eq!(
            pl.plan(&[0], &[0, 1], 17),
            Err(PlanError::BlockCount {
                side: Side::Prefiller,
                tokens: 17,
                block_tokens: 16,
                expected: 2,
                got: 1
            })
        );
        assert!(matches!(
            pl.plan(&[0, 1], &[0], 17),
            Err(PlanError::BlockCount {
                side: Side::Decoder,
                expected: 3,
                ..
            })
        ));
        assert!(matches!(
            pl.plan(&[0], &[], u64::MAX),
            Err(PlanError::BlockCount { .. })
        ));
        // A block id whose bytes lie past 2^64 (blocks of 2^35 bytes).
        let huge = TpLayout {
            head_dim: 1 << 20,
            ..layout(4, 1, 0, 1 << 10, o)
        };
        let pl = planner(huge.clone(), huge);
        assert_eq!(
            pl.plan(&[u32::MAX], &[0], 1),
            Err(PlanError::OffsetOverflow {
                side: Side::Prefiller,
                block: u32::MAX
            })
        );
        assert!(pl.plan(&[0], &[u32::MAX], 1).is_err());
    }
}
