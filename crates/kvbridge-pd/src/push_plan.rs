//! The push between different TP sizes: which heads of each PD chunk every prefiller rank
//! writes to which decoder rank, one write per chunk and part.
//!
//! A PD chunk is heads-innermost, `(layers, 2, tokens, heads, head_dim)` (LMCache's layout,
//! [`crate::layout`]), so the heads one decoder rank needs are not contiguous in a prefiller
//! rank's chunk, nor, when several prefiller ranks feed it, in the decoder rank's own chunk.
//! Written where they lie they cost one write per token, layer and K/V (64,000 writes for a
//! 1000-token request of an 8B-class model: [`crate::read_plan`]). A heads-outer chunk order
//! would make them contiguous but change the chunk layout every LMCache peer and every
//! engine hook shares. So each *part* — the run of heads one prefiller rank supplies to one
//! decoder rank ([`crate::rank_map::head_sources`]: the same choice of source rank as the
//! read planner, each head from exactly one rank) — travels as a chunk of its own, laid out
//! as a PD chunk holding only those heads ([`PushPlan::part_spec`]):
//!
//! - the prefiller rank packs it ([`PushPlan::pack`]: one copy of the part's rows inside its
//!   own memory, none when the part is its whole chunk, as with prefiller TP >= decoder TP);
//! - it moves as one write per chunk, exactly the part's bytes;
//! - the decoder rank places the parts of a chunk into its own layout
//!   ([`PushPlan::unpack`]: none when one part is its whole chunk, as with prefiller TP <=
//!   decoder TP); its chunk is complete only when every part has landed.
//!
//! So a chunk costs one write per part — [`PushPlan::ops_per_chunk`] is max(prefiller TP,
//! decoder TP) where one divides the other and the heads split over both, fewer than their
//! sum always — and the bytes moved are exactly what the decoder ranks
//! hold ([`PushPlan::decoder_bytes`]). MLA (the cache is replicated): each decoder rank gets
//! the latent once, from one prefiller rank; never once per prefiller rank.

use crate::layout::{KvLayout, KvSpec};
use crate::rank_map::head_sources;
use crate::read_plan::Side;
use crate::tp_layout::{BlockDim, TpLayout, Translation};

/// The heads one prefiller rank pushes to one decoder rank, in every chunk of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PushPart {
    /// The part's index in [`PushPlan::parts`]: the rank of the sender and receiver pair
    /// that moves it (one PD session per part).
    pub lane: u32,
    /// The prefiller rank that sends it.
    pub prefiller_rank: u32,
    /// The decoder rank it lands on.
    pub decoder_rank: u32,
    /// First head of the run among the prefiller rank's heads.
    pub src_head: u32,
    /// First head of the run among the decoder rank's heads.
    pub dst_head: u32,
    /// Heads in the run.
    pub heads: u32,
}

/// Why a push cannot be planned or a part cannot be packed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PushError {
    /// The push moves PD chunks: both sides must use the PD chunk order
    /// ([`TpLayout::CHUNK_ORDER`]).
    #[error("{side} layout ({layout}) is not the PD chunk layout [layer, kv, token, head]")]
    NotChunkLayout {
        /// Whose layout.
        side: Side,
        /// The layout.
        layout: Box<TpLayout>,
    },
    /// A buffer handed to [`PushPlan::pack`] or [`PushPlan::unpack`] has the wrong size.
    #[error("{what}: {got} bytes, expected {expected}")]
    BufferSize {
        /// Which buffer.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The size the plan needs.
        expected: u64,
    },
    /// A part that is not one of the plan's (its lane names another part, or none).
    #[error("lane {lane}: not a part of this push")]
    UnknownPart {
        /// The part's lane.
        lane: u32,
    },
    /// [`PushPlan::unpack`] was given a different number of parts than the decoder rank has.
    #[error("decoder rank {decoder_rank} has {expected} parts, got {got}")]
    PartCount {
        /// The decoder rank.
        decoder_rank: u32,
        /// Parts given.
        got: usize,
        /// Parts it has.
        expected: usize,
    },
}

/// Every part of a push from one prefiller engine to one decoder engine. Made once per peer
/// engine, from a [`Translation`] that accepted the pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushPlan {
    prefiller: TpLayout,
    decoder: TpLayout,
    /// By decoder rank, then decoder head: `parts[i].lane == i`.
    parts: Vec<PushPart>,
}

impl PushPlan {
    /// The parts of `t`, every decoder rank's from [`head_sources`].
    pub fn new(t: &Translation) -> Result<Self, PushError> {
        for (side, l) in [
            (Side::Prefiller, t.prefiller()),
            (Side::Decoder, t.decoder()),
        ] {
            if l.block_order != TpLayout::CHUNK_ORDER {
                return Err(PushError::NotChunkLayout {
                    side,
                    layout: Box::new(l.clone()),
                });
            }
        }
        let mut parts = Vec::new();
        for d in 0..t.decoder().tp_size {
            for s in head_sources(t, d) {
                parts.push(PushPart {
                    lane: parts.len() as u32,
                    prefiller_rank: s.prefiller_rank,
                    decoder_rank: d,
                    src_head: s.src_head,
                    dst_head: s.dst_head,
                    heads: s.heads,
                });
            }
        }
        Ok(Self {
            prefiller: t.prefiller().clone(),
            decoder: t.decoder().clone(),
            parts,
        })
    }

    /// Every part, by decoder rank then head; a part's `lane` is its index here.
    pub fn parts(&self) -> &[PushPart] {
        &self.parts
    }

    /// The parts prefiller rank `p` sends (by decoder rank).
    pub fn parts_from(&self, p: u32) -> Vec<PushPart> {
        self.parts
            .iter()
            .filter(|x| x.prefiller_rank == p)
            .copied()
            .collect()
    }

    /// The parts that make decoder rank `d`'s chunk, in its head order.
    pub fn parts_into(&self, d: u32) -> &[PushPart] {
        let start = self.parts.partition_point(|x| x.decoder_rank < d);
        let end = self.parts.partition_point(|x| x.decoder_rank <= d);
        &self.parts[start..end]
    }

    /// The prefiller's layout.
    pub fn prefiller(&self) -> &TpLayout {
        &self.prefiller
    }

    /// The decoder's layout.
    pub fn decoder(&self) -> &TpLayout {
        &self.decoder
    }

    /// Writes per chunk: one per part.
    pub fn ops_per_chunk(&self) -> u64 {
        self.parts.len() as u64
    }

    /// Rows of a chunk of `tokens` tokens: `(layer, kv, token)`; a head run is contiguous
    /// within a row.
    fn rows(&self, tokens: u64) -> u64 {
        let d = &self.decoder;
        d.extent(BlockDim::Layer) * d.extent(BlockDim::Kv) * tokens
    }

    /// Bytes of `part` in a chunk of `tokens` tokens: what its one write moves.
    pub fn part_bytes(&self, part: &PushPart, tokens: u64) -> u64 {
        self.rows(tokens) * part.heads as u64 * self.decoder.head_bytes()
    }

    /// Bytes of one decoder rank's chunk of `tokens` tokens.
    pub fn decoder_chunk_bytes(&self, tokens: u64) -> u64 {
        self.rows(tokens) * self.decoder.extent(BlockDim::Head) * self.decoder.head_bytes()
    }

    /// Bytes of one prefiller rank's chunk of `tokens` tokens.
    pub fn prefiller_chunk_bytes(&self, tokens: u64) -> u64 {
        self.rows(tokens) * self.prefiller.extent(BlockDim::Head) * self.prefiller.head_bytes()
    }

    /// Bytes the decoder ranks hold for `tokens` tokens, all of them together: what a push
    /// must move, no more.
    pub fn decoder_bytes(&self, tokens: u64) -> u64 {
        self.decoder_chunk_bytes(tokens) * self.decoder.tp_size as u64
    }

    /// Bytes every part moves for `tokens` tokens (equal to [`Self::decoder_bytes`]).
    pub fn pushed_bytes(&self, tokens: u64) -> u64 {
        self.parts.iter().map(|p| self.part_bytes(p, tokens)).sum()
    }

    /// The KV spec of `part`'s chunks: a PD chunk of `chunk_tokens` tokens holding only the
    /// part's heads (MLA: the latent, as on every rank). The pair of PD sender and receiver
    /// that moves the part uses it, so their pages are the part's size.
    pub fn part_spec(&self, part: &PushPart, spec: KvSpec) -> KvSpec {
        let layout = match spec.layout {
            KvLayout::Standard {
                layers, head_dim, ..
            } => KvLayout::Standard {
                layers,
                kv_heads: part.heads,
                head_dim,
            },
            mla @ KvLayout::Mla { .. } => mla,
        };
        KvSpec { layout, ..spec }
    }

    /// Checks that `part` is one of the plan's, so that its heads lie inside both chunks.
    fn known(&self, part: &PushPart) -> Result<(), PushError> {
        match self.parts.get(part.lane as usize) {
            Some(p) if p == part => Ok(()),
            _ => Err(PushError::UnknownPart { lane: part.lane }),
        }
    }

    /// Packs `part` of a prefiller chunk of `tokens` tokens (the prefiller rank's own chunk,
    /// all its heads) into `out`, laid out as the part's own chunk.
    pub fn pack(
        &self,
        part: &PushPart,
        tokens: u64,
        chunk: &[u8],
        out: &mut [u8],
    ) -> Result<(), PushError> {
        self.known(part)?;
        let p_heads = self.prefiller.extent(BlockDim::Head);
        check(
            "prefiller chunk",
            chunk.len(),
            self.prefiller_chunk_bytes(tokens),
        )?;
        check("packed part", out.len(), self.part_bytes(part, tokens))?;
        copy_head_run(
            self.rows(tokens),
            self.decoder.head_bytes(),
            (chunk, p_heads, part.src_head as u64),
            (out, part.heads as u64, 0),
            part.heads as u64,
        );
        Ok(())
    }

    /// `part` cut out of decoder rank `part.decoder_rank`'s chunk of `tokens` tokens: the
    /// bytes [`Self::pack`] makes of the prefiller rank's chunk, for an engine that holds
    /// its KV in the decoder's split (the reference engine computes it so).
    pub fn part_of_decoder_chunk(
        &self,
        part: &PushPart,
        tokens: u64,
        chunk: &[u8],
        out: &mut [u8],
    ) -> Result<(), PushError> {
        self.known(part)?;
        check(
            "decoder chunk",
            chunk.len(),
            self.decoder_chunk_bytes(tokens),
        )?;
        check("packed part", out.len(), self.part_bytes(part, tokens))?;
        copy_head_run(
            self.rows(tokens),
            self.decoder.head_bytes(),
            (
                chunk,
                self.decoder.extent(BlockDim::Head),
                part.dst_head as u64,
            ),
            (out, part.heads as u64, 0),
            part.heads as u64,
        );
        Ok(())
    }

    /// Places the parts of decoder rank `d`'s chunk of `tokens` tokens (in
    /// [`Self::parts_into`] order, each laid out as [`Self::pack`] writes it) into `out`, the
    /// decoder rank's chunk.
    pub fn unpack(
        &self,
        d: u32,
        tokens: u64,
        parts: &[&[u8]],
        out: &mut [u8],
    ) -> Result<(), PushError> {
        let mine = self.parts_into(d);
        if parts.len() != mine.len() {
            return Err(PushError::PartCount {
                decoder_rank: d,
                got: parts.len(),
                expected: mine.len(),
            });
        }
        check("decoder chunk", out.len(), self.decoder_chunk_bytes(tokens))?;
        for (part, bytes) in mine.iter().zip(parts) {
            check("packed part", bytes.len(), self.part_bytes(part, tokens))?;
        }
        let d_heads = self.decoder.extent(BlockDim::Head);
        for (part, bytes) in mine.iter().zip(parts) {
            copy_head_run(
                self.rows(tokens),
                self.decoder.head_bytes(),
                (bytes, part.heads as u64, 0),
                (out, d_heads, part.dst_head as u64),
                part.heads as u64,
            );
        }
        Ok(())
    }
}

fn check(what: &'static str, got: usize, expected: u64) -> Result<(), PushError> {
    if got as u64 == expected {
        Ok(())
    } else {
        Err(PushError::BufferSize {
            what,
            got,
            expected,
        })
    }
}

/// Copies a run of `run` heads in each of `rows` rows from a heads-innermost buffer with
/// `src.1` heads per row, starting at head `src.2`, to one with `dst.1` heads per row,
/// starting at head `dst.2`. Callers checked both buffers' sizes.
fn copy_head_run(
    rows: u64,
    head_bytes: u64,
    src: (&[u8], u64, u64),
    dst: (&mut [u8], u64, u64),
    run: u64,
) {
    let (src, src_heads, src_first) = src;
    let (dst, dst_heads, dst_first) = dst;
    let len = (run * head_bytes) as usize;
    if src_heads == run && dst_heads == run {
        // The run is every head on both sides: one copy.
        dst.copy_from_slice(src);
        return;
    }
    for r in 0..rows {
        let s = ((r * src_heads + src_first) * head_bytes) as usize;
        let d = ((r * dst_heads + dst_first) * head_bytes) as usize;
        dst[d..d + len].copy_from_slice(&src[s..s + len]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::Dtype;
    use proptest::prelude::*;

    fn layout(tp_rank: u32, tp_size: u32, heads: u32, mla: bool) -> TpLayout {
        TpLayout {
            model: "m".into(),
            layers: 2,
            total_kv_heads: heads,
            head_dim: if mla { 6 } else { 4 },
            mla,
            dtype: Dtype::Fp16,
            block_tokens: 16,
            block_order: TpLayout::CHUNK_ORDER.to_vec(),
            tp_rank,
            tp_size,
        }
    }

    fn plan(p: u32, d: u32, heads: u32, mla: bool) -> PushPlan {
        let t = Translation::new(&layout(0, p, heads, mla), &layout(0, d, heads, mla)).unwrap();
        PushPlan::new(&t).unwrap()
    }

    /// A byte of global head `g`, row `r`, byte `b` of the head: every one distinct within
    /// a test's sizes (2 layers, 2 K/V, up to 40 tokens, up to 12 heads, 12 bytes).
    fn byte_of(g: u64, r: u64, b: u64) -> u8 {
        (g.wrapping_mul(131) ^ r.wrapping_mul(29) ^ b.wrapping_mul(7)) as u8
    }

    /// Rank `rank`'s chunk of `tokens` tokens in `l`'s split: the bytes of its heads.
    fn chunk_of(l: &TpLayout, rank: u32, tokens: u64) -> Vec<u8> {
        let heads = l.heads_of_rank(rank);
        let hb = l.head_bytes();
        let rows = l.extent(BlockDim::Layer) * l.extent(BlockDim::Kv) * tokens;
        let mut v = Vec::new();
        for r in 0..rows {
            for g in heads.clone() {
                for b in 0..hb {
                    v.push(byte_of(g as u64, r, b));
                }
            }
        }
        v
    }

    /// Pushes every part of `plan` (each prefiller rank's chunk packed, then unpacked on
    /// its decoder rank) and returns each decoder rank's chunk and the bytes moved.
    fn push_all(plan: &PushPlan, tokens: u64) -> (Vec<Vec<u8>>, u64) {
        let p = plan.prefiller();
        let chunks: Vec<Vec<u8>> = (0..p.tp_size).map(|r| chunk_of(p, r, tokens)).collect();
        let mut moved = 0;
        let out = (0..plan.decoder().tp_size)
            .map(|d| {
                let packed: Vec<Vec<u8>> = plan
                    .parts_into(d)
                    .iter()
                    .map(|part| {
                        let mut o = vec![0u8; plan.part_bytes(part, tokens) as usize];
                        plan.pack(part, tokens, &chunks[part.prefiller_rank as usize], &mut o)
                            .unwrap();
                        moved += o.len() as u64;
                        o
                    })
                    .collect();
                let refs: Vec<&[u8]> = packed.iter().map(Vec::as_slice).collect();
                // Poisoned: a byte no part writes stays wrong.
                let mut chunk = vec![0xa5u8; plan.decoder_chunk_bytes(tokens) as usize];
                plan.unpack(d, tokens, &refs, &mut chunk).unwrap();
                chunk
            })
            .collect();
        (out, moved)
    }

    #[test]
    fn demo_shapes_parts_and_ops() {
        // 8 heads: 1 -> 2 (one prefiller rank feeds two), 2 -> 1 (two fill one chunk),
        // 2 -> 4, and MLA 2 -> 4 (each decoder rank once, from the aligned prefiller rank).
        let p12 = plan(1, 2, 8, false);
        assert_eq!(p12.ops_per_chunk(), 2);
        assert_eq!(p12.parts_from(0).len(), 2);
        assert_eq!((p12.parts()[1].src_head, p12.parts()[1].heads), (4, 4));
        let p21 = plan(2, 1, 8, false);
        assert_eq!(p21.parts_into(0).len(), 2);
        assert_eq!(p21.parts_into(0)[1].dst_head, 4);
        assert_eq!(plan(2, 4, 8, false).ops_per_chunk(), 4);
        let mla = plan(2, 4, 1, true);
        assert_eq!(mla.ops_per_chunk(), 4);
        let from: Vec<u32> = mla.parts().iter().map(|x| x.prefiller_rank).collect();
        assert_eq!(from, vec![0, 0, 1, 1]);
        assert_eq!(mla.pushed_bytes(10), mla.decoder_bytes(10));
        assert_eq!(mla.decoder_bytes(10), 4 * 2 * 10 * 12);
    }

    #[test]
    fn chunk_order_is_required_naming_the_layout() {
        let flash = TpLayout {
            block_order: vec![BlockDim::Token, BlockDim::Head],
            ..layout(0, 2, 8, false)
        };
        let t = Translation::new(
            &flash,
            &TpLayout {
                tp_size: 1,
                ..flash.clone()
            },
        )
        .unwrap();
        let e = PushPlan::new(&t).unwrap_err();
        assert!(e.to_string().contains("prefiller layout"), "{e}");
        assert!(e.to_string().contains("tp rank 0 of 2"), "{e}");
    }

    #[test]
    fn bad_buffers_are_typed_errors() {
        let p = plan(2, 1, 8, false);
        let part = p.parts()[0];
        let mut out = vec![0u8; 3];
        assert!(matches!(
            p.pack(&part, 4, &[0u8; 5], &mut out),
            Err(PushError::BufferSize {
                what: "prefiller chunk",
                ..
            })
        ));
        let shifted = PushPart {
            src_head: part.src_head + 1,
            ..part
        };
        assert_eq!(
            p.pack(&shifted, 4, &[0u8; 5], &mut out),
            Err(PushError::UnknownPart { lane: 0 })
        );
        assert!(matches!(
            p.unpack(0, 4, &[&[0u8; 1]], &mut out),
            Err(PushError::PartCount {
                got: 1,
                expected: 2,
                ..
            })
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Every byte of every head a decoder rank holds lands exactly once, from a rank
        /// that holds it, and nothing else moves: the decoder chunks equal the decoder
        /// split's own chunks, and the bytes moved equal the decoder ranks' bytes. MLA:
        /// one part per decoder rank.
        #[test]
        fn every_wanted_byte_lands_exactly_once(
            heads in prop::sample::select(vec![1u32, 2, 3, 4, 6, 8, 12]),
            p_tp in 1u32..=12,
            d_tp in 1u32..=12,
            mla in any::<bool>(),
            tokens in 1u64..=40,
        ) {
            let heads = if mla { 1 } else { heads };
            let (pl, dl) = (layout(0, p_tp, heads, mla), layout(0, d_tp, heads, mla));
            prop_assume!(pl.validate().is_ok() && dl.validate().is_ok());
            let t = Translation::new(&pl, &dl).unwrap();
            let plan = PushPlan::new(&t).unwrap();
            for part in plan.parts() {
                let held = pl.heads_of_rank(part.prefiller_rank);
                let first = held.start + part.src_head;
                prop_assert!(first + part.heads <= held.end);
                let wanted = dl.heads_of_rank(part.decoder_rank);
                prop_assert_eq!(first, wanted.start + part.dst_head);
            }
            let (chunks, moved) = push_all(&plan, tokens);
            for (d, chunk) in chunks.iter().enumerate() {
                prop_assert_eq!(chunk, &chunk_of(&dl, d as u32, tokens), "decoder rank {}", d);
            }
            // Cut out of the decoder's split, a part is what the prefiller rank packs.
            for part in plan.parts() {
                let n = plan.part_bytes(part, tokens) as usize;
                let (mut a, mut b) = (vec![0u8; n], vec![1u8; n]);
                let own = chunk_of(&pl, part.prefiller_rank, tokens);
                plan.pack(part, tokens, &own, &mut a).unwrap();
                let theirs = &chunks[part.decoder_rank as usize];
                plan.part_of_decoder_chunk(part, tokens, theirs, &mut b).unwrap();
                prop_assert_eq!(a, b);
            }
            prop_assert_eq!(moved, plan.decoder_bytes(tokens));
            prop_assert_eq!(plan.pushed_bytes(tokens), plan.decoder_bytes(tokens));
            if mla {
                prop_assert_eq!(plan.ops_per_chunk(), d_tp as u64);
            }
            let (lo, hi) = (p_tp.min(d_tp), p_tp.max(d_tp));
            if !mla && heads % hi == 0 && hi % lo == 0 {
                // One TP divides the other: each part is a whole rank's heads on one side.
                prop_assert_eq!(plan.ops_per_chunk(), hi as u64);
            }
            // A part starts at every head boundary of either side, at most.
            prop_assert!(plan.ops_per_chunk() < (p_tp + d_tp) as u64);
        }
    }
}
