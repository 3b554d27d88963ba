//! The description of one tensor-parallel rank's KV cache that both sides exchange at the
//! handshake, and the check that a prefiller's and a decoder's can be translated into each
//! other.
//!
//! A rank's cache is an array of *blocks* of `block_tokens` tokens each. Inside a block the
//! dimensions [`BlockDim::Layer`], [`BlockDim::Kv`], [`BlockDim::Token`] and
//! [`BlockDim::Head`] come in the order [`TpLayout::block_order`] names (outermost first),
//! and the `head_dim` elements of one head of one token are always innermost. A dimension
//! the order leaves out (only `Layer` and `Kv` may be left out) lies *outside* the block:
//! every value of it is a separate *plane*, an array of blocks of its own (vLLM registers
//! one region per layer, and flash-attention keeps K and V apart:
//! `[2, num_blocks, block_size, heads, head_dim]` is order `[Token, Head]` with `Layer` and
//! `Kv` outside). Every plane has the same structure, so a read plan is computed once and
//! applied to each plane.
//!
//! Heads are split over the ranks as vLLM splits them: with `tp_size <= total_kv_heads`
//! rank `r` holds heads `r * h .. (r + 1) * h` where `h = total_kv_heads / tp_size`; with
//! more ranks than heads each rank holds one head, `r * total_kv_heads / tp_size`,
//! replicated on `tp_size / total_kv_heads` ranks. MLA has one latent "head" of
//! `head_dim` = latent dimension, the same on every rank.
//!
//! Everything a peer sends is checked by [`TpLayout::validate`]: zero sizes, a rank out of
//! range, heads that do not split, sizes that overflow — each a typed [`LayoutError`],
//! never a panic. [`Translation::new`] refuses only pairs that no ranged read can translate,
//! naming both layouts; it runs once per peer engine, at the first handshake.

use crate::layout::Dtype;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;

/// A dimension of the KV cache that can lie inside a block (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockDim {
    /// Transformer layers (`layers`).
    Layer,
    /// K and V (2), or the one latent of MLA (1).
    Kv,
    /// Tokens of the block (`block_tokens`).
    Token,
    /// The KV heads this rank holds.
    Head,
}

impl fmt::Display for BlockDim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BlockDim::Layer => "layer",
            BlockDim::Kv => "kv",
            BlockDim::Token => "token",
            BlockDim::Head => "head",
        })
    }
}

/// The longest model name a layout may carry (a peer's layout is untrusted input).
pub const MAX_MODEL_NAME: usize = 256;

/// The most KV heads, and the most TP ranks, a layout may name: enough for any model
/// served today, and a bound on the work a peer's layout can ask of the planner.
pub const MAX_HEADS_OR_RANKS: u32 = 1 << 16;

/// The largest block of one rank and one plane this layer accepts (1 TiB): beyond it,
/// block offsets stop being addressable with room to spare.
pub const MAX_BLOCK_BYTES: u64 = 1 << 40;

/// One rank's KV cache layout, as it travels in a handshake.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TpLayout {
    /// The model (name or fingerprint); both sides must serve the same one.
    pub model: String,
    /// Transformer layers.
    pub layers: u32,
    /// KV heads of the whole model, before the tensor-parallel split (1 for MLA).
    pub total_kv_heads: u32,
    /// Elements per head per token (the latent dimension for MLA).
    pub head_dim: u32,
    /// Multi-head latent attention: one latent per token and layer, the same on every rank.
    pub mla: bool,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens per block.
    pub block_tokens: u32,
    /// The dimensions inside a block, outermost first (`head_dim` is innermost, implied).
    pub block_order: Vec<BlockDim>,
    /// This rank.
    pub tp_rank: u32,
    /// Ranks of the engine.
    pub tp_size: u32,
}

impl fmt::Display for TpLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} {} layers, {} {} x {} {}, {} tokens/block, block [",
            self.model,
            self.layers,
            self.total_kv_heads,
            if self.mla { "latent" } else { "kv heads" },
            self.head_dim,
            self.dtype,
            self.block_tokens,
        )?;
        for (i, d) in self.block_order.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "], tp rank {} of {}", self.tp_rank, self.tp_size)
    }
}

/// What is wrong with one layout on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayoutProblem {
    /// A size that must be positive is zero (named).
    Zero(&'static str),
    /// `tp_rank >= tp_size`.
    RankOutOfRange,
    /// The KV heads do not split evenly over the ranks (neither divides the other).
    HeadsNotDivisible,
    /// `total_kv_heads` or `tp_size` is above [`MAX_HEADS_OR_RANKS`] (named).
    TooMany(&'static str),
    /// MLA with `total_kv_heads != 1`.
    MlaHeads,
    /// The block order names a dimension twice.
    DuplicateDim(BlockDim),
    /// The block order lacks `Token` or `Head` (only `Layer` and `Kv` may lie outside).
    MissingDim(BlockDim),
    /// The model name is longer than [`MAX_MODEL_NAME`] bytes.
    ModelNameTooLong,
    /// One block of one plane would be larger than [`MAX_BLOCK_BYTES`] (or overflow).
    BlockTooLarge,
}

impl fmt::Display for LayoutProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayoutProblem::Zero(what) => write!(f, "{what} is zero"),
            LayoutProblem::RankOutOfRange => f.write_str("tp_rank is not below tp_size"),
            LayoutProblem::HeadsNotDivisible => {
                f.write_str("the KV heads do not split over the ranks (neither divides the other)")
            }
            LayoutProblem::TooMany(what) => {
                write!(f, "{what} is above {MAX_HEADS_OR_RANKS}")
            }
            LayoutProblem::MlaHeads => f.write_str("MLA must have exactly 1 KV head"),
            LayoutProblem::DuplicateDim(d) => write!(f, "the block order names {d} twice"),
            LayoutProblem::MissingDim(d) => write!(f, "the block order lacks {d}"),
            LayoutProblem::ModelNameTooLong => {
                write!(f, "the model name is longer than {MAX_MODEL_NAME} bytes")
            }
            LayoutProblem::BlockTooLarge => {
                write!(f, "one block is larger than {MAX_BLOCK_BYTES} bytes")
            }
        }
    }
}

/// Why a prefiller's layout cannot be translated into a decoder's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mismatch {
    /// Different models.
    Model,
    /// Different layer counts.
    Layers,
    /// Different KV head counts.
    KvHeads,
    /// Different head (or latent) dimensions.
    HeadDim,
    /// One side is MLA and the other is not.
    Mla,
    /// Different element types.
    Dtype,
    /// Different orders of the dimensions in a block: translating them is a transpose, one
    /// read per head per token, which this layer refuses rather than hides.
    BlockOrder,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mismatch::Model => "different models",
            Mismatch::Layers => "different layer counts",
            Mismatch::KvHeads => "different KV head counts",
            Mismatch::HeadDim => "different head dimensions",
            Mismatch::Mla => "MLA on one side only",
            Mismatch::Dtype => "different dtypes",
            Mismatch::BlockOrder => "different block dimension orders (a transpose)",
        })
    }
}

/// A layout that is invalid, or a pair that cannot be translated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// One layout is invalid on its own.
    #[error("invalid KV layout ({layout}): {problem}")]
    Invalid {
        /// The layout.
        layout: Box<TpLayout>,
        /// What is wrong.
        problem: LayoutProblem,
    },
    /// The two layouts cannot be translated into each other.
    #[error(
        "prefiller layout ({prefiller}) cannot be read into decoder layout ({decoder}): {mismatch}"
    )]
    Incompatible {
        /// Why.
        mismatch: Mismatch,
        /// The prefiller's layout.
        prefiller: Box<TpLayout>,
        /// The decoder's layout.
        decoder: Box<TpLayout>,
    },
}

impl TpLayout {
    /// The kvbridge PD chunk order, `(layers, 2, tokens, kv_heads, head_dim)` in one block.
    pub const CHUNK_ORDER: [BlockDim; 4] = [
        BlockDim::Layer,
        BlockDim::Kv,
        BlockDim::Token,
        BlockDim::Head,
    ];

    /// Checks everything that must hold for this layout alone.
    pub fn validate(&self) -> Result<(), LayoutError> {
        self.problem().map_or(Ok(()), |problem| {
            Err(LayoutError::Invalid {
                layout: Box::new(self.clone()),
                problem,
            })
        })
    }

    fn problem(&self) -> Option<LayoutProblem> {
        for (value, name) in [
            (self.layers, "layers"),
            (self.total_kv_heads, "total_kv_heads"),
            (self.head_dim, "head_dim"),
            (self.block_tokens, "block_tokens"),
            (self.tp_size, "tp_size"),
        ] {
            if value == 0 {
                return Some(LayoutProblem::Zero(name));
            }
        }
        if self.model.len() > MAX_MODEL_NAME {
            return Some(LayoutProblem::ModelNameTooLong);
        }
        for (value, name) in [
            (self.total_kv_heads, "total_kv_heads"),
            (self.tp_size, "tp_size"),
        ] {
            if value > MAX_HEADS_OR_RANKS {
                return Some(LayoutProblem::TooMany(name));
            }
        }
        if self.tp_rank >= self.tp_size {
            return Some(LayoutProblem::RankOutOfRange);
        }
        if self.mla && self.total_kv_heads != 1 {
            return Some(LayoutProblem::MlaHeads);
        }
        if !self.mla
            && !self.total_kv_heads.is_multiple_of(self.tp_size)
            && !self.tp_size.is_multiple_of(self.total_kv_heads)
        {
            return Some(LayoutProblem::HeadsNotDivisible);
        }
        for (i, d) in self.block_order.iter().enumerate() {
            if self.block_order[..i].contains(d) {
                return Some(LayoutProblem::DuplicateDim(*d));
            }
        }
        for d in [BlockDim::Token, BlockDim::Head] {
            if !self.block_order.contains(&d) {
                return Some(LayoutProblem::MissingDim(d));
            }
        }
        match self.checked_block_bytes() {
            Some(b) if b <= MAX_BLOCK_BYTES => None,
            _ => Some(LayoutProblem::BlockTooLarge),
        }
    }

    /// KV heads each rank holds (1 for MLA, 1 when ranks outnumber heads).
    pub fn heads_per_rank(&self) -> u32 {
        if self.mla {
            1
        } else {
            (self.total_kv_heads / self.tp_size.max(1)).max(1)
        }
    }

    /// The global KV heads rank `rank` holds (for MLA, `0..1` on every rank).
    pub fn heads_of_rank(&self, rank: u32) -> Range<u32> {
        if self.mla {
            return 0..1;
        }
        let per = self.heads_per_rank();
        let first = if self.tp_size <= self.total_kv_heads {
            rank.saturating_mul(per)
        } else {
            // More ranks than heads: vLLM's replication, rank r holds head r * K / tp.
            (rank as u64 * self.total_kv_heads as u64 / self.tp_size as u64) as u32
        };
        first..first.saturating_add(per)
    }

    /// The ranks holding global head `head` (several where heads are replicated; every
    /// rank for MLA).
    pub fn ranks_of_head(&self, head: u32) -> Range<u32> {
        if self.mla {
            return 0..self.tp_size;
        }
        if self.tp_size <= self.total_kv_heads {
            let r = head / self.heads_per_rank();
            r..r.saturating_add(1)
        } else {
            let copies = self.tp_size / self.total_kv_heads;
            head.saturating_mul(copies)..head.saturating_add(1).saturating_mul(copies)
        }
    }

    /// The size of dimension `dim` on this rank.
    pub fn extent(&self, dim: BlockDim) -> u64 {
        match dim {
            BlockDim::Layer => self.layers as u64,
            BlockDim::Kv => {
                if self.mla {
                    1
                } else {
                    2
                }
            }
            BlockDim::Token => self.block_tokens as u64,
            BlockDim::Head => self.heads_per_rank() as u64,
        }
    }

    /// Bytes of one head of one token (`head_dim` elements): the innermost contiguous unit.
    pub fn head_bytes(&self) -> u64 {
        self.head_dim as u64 * self.dtype.size()
    }

    fn checked_block_bytes(&self) -> Option<u64> {
        self.block_order
            .iter()
            .try_fold(self.head_bytes(), |acc, d| acc.checked_mul(self.extent(*d)))
    }

    /// Bytes of one block of one plane on this rank (valid layouts only; saturates).
    pub fn block_bytes(&self) -> u64 {
        self.checked_block_bytes().unwrap_or(u64::MAX)
    }

    /// The dimensions outside a block (each value a separate plane), outermost first:
    /// `Layer` before `Kv`.
    pub fn plane_dims(&self) -> Vec<BlockDim> {
        [BlockDim::Layer, BlockDim::Kv]
            .into_iter()
            .filter(|d| !self.block_order.contains(d))
            .collect()
    }

    /// Planes of this rank's cache: the product of the dimensions outside a block.
    pub fn planes(&self) -> u64 {
        self.plane_dims().iter().map(|d| self.extent(*d)).product()
    }

    /// The byte stride of each dimension of [`Self::block_order`] inside a block.
    pub fn strides(&self) -> Vec<u64> {
        let mut strides = vec![0; self.block_order.len()];
        let mut s = self.head_bytes();
        for (i, d) in self.block_order.iter().enumerate().rev() {
            strides[i] = s;
            s = s.saturating_mul(self.extent(*d));
        }
        strides
    }
}

/// A checked pair of engines: a prefiller's layout and a decoder's, with every rank of
/// each sharing everything but `tp_rank`. Made once per peer engine, at the first
/// handshake; [`crate::read_plan::ReadPlanner`] plans requests from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translation {
    prefiller: TpLayout,
    decoder: TpLayout,
}

impl Translation {
    /// Validates both layouts and checks that the prefiller's can be read into the
    /// decoder's with ranged reads. Different TP sizes (either way), different block sizes
    /// (either way, divisible or not) and replicated heads translate; different models,
    /// layer counts, KV heads, head dims, dtypes, MLA-ness or block orders do not.
    pub fn new(prefiller: &TpLayout, decoder: &TpLayout) -> Result<Self, LayoutError> {
        prefiller.validate()?;
        decoder.validate()?;
        let mismatch = if prefiller.model != decoder.model {
            Some(Mismatch::Model)
        } else if prefiller.layers != decoder.layers {
            Some(Mismatch::Layers)
        } else if prefiller.mla != decoder.mla {
            Some(Mismatch::Mla)
        } else if prefiller.total_kv_heads != decoder.total_kv_heads {
            Some(Mismatch::KvHeads)
        } else if prefiller.head_dim != decoder.head_dim {
            Some(Mismatch::HeadDim)
        } else if prefiller.dtype != decoder.dtype {
            Some(Mismatch::Dtype)
        } else if prefiller.block_order != decoder.block_order {
            Some(Mismatch::BlockOrder)
        } else {
            None
        };
        match mismatch {
            Some(mismatch) => Err(LayoutError::Incompatible {
                mismatch,
                prefiller: Box::new(prefiller.clone()),
                decoder: Box::new(decoder.clone()),
            }),
            None => Ok(Self {
                prefiller: prefiller.clone(),
                decoder: decoder.clone(),
            }),
        }
    }

    /// The prefiller's layout.
    pub fn prefiller(&self) -> &TpLayout {
        &self.prefiller
    }

    /// The decoder's layout.
    pub fn decoder(&self) -> &TpLayout {
        &self.decoder
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn dense(tp_rank: u32, tp_size: u32) -> TpLayout {
        TpLayout {
            model: "tiny-llama".into(),
            layers: 2,
            total_kv_heads: 4,
            head_dim: 8,
            mla: false,
            dtype: Dtype::Bf16,
            block_tokens: 16,
            block_order: TpLayout::CHUNK_ORDER.to_vec(),
            tp_rank,
            tp_size,
        }
    }

    fn invalid(l: &TpLayout) -> LayoutProblem {
        match l.validate() {
            Err(LayoutError::Invalid { problem, layout }) => {
                assert_eq!(*layout, *l);
                problem
            }
            other => panic!("{l}: expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn heads_split_like_vllm() {
        let l = dense(0, 2);
        assert_eq!(l.heads_of_rank(0), 0..2);
        assert_eq!(l.heads_of_rank(1), 2..4);
        assert_eq!(l.ranks_of_head(3), 1..2);
        // 8 ranks over 4 heads: each head on two ranks, rank r holds head r * 4 / 8.
        let l = dense(0, 8);
        assert_eq!(l.heads_per_rank(), 1);
        assert_eq!(l.heads_of_rank(5), 2..3);
        assert_eq!(l.ranks_of_head(2), 4..6);
        for r in 0..8 {
            let h = l.heads_of_rank(r).start;
            assert!(l.ranks_of_head(h).contains(&r));
        }
    }

    #[test]
    fn sizes_and_planes() {
        let l = dense(0, 2);
        // (2 layers, 2, 16 tokens, 2 heads, 8 x bf16)
        assert_eq!(l.block_bytes(), 2 * 2 * 16 * 2 * 16);
        assert_eq!(l.strides(), vec![2 * 16 * 2 * 16, 16 * 2 * 16, 2 * 16, 16]);
        assert_eq!(l.planes(), 1);
        // flash-attention: [2, blocks, tokens, heads, dim] per layer.
        let f = TpLayout {
            block_order: vec![BlockDim::Token, BlockDim::Head],
            ..dense(0, 2)
        };
        assert_eq!(f.plane_dims(), vec![BlockDim::Layer, BlockDim::Kv]);
        assert_eq!(f.planes(), 4);
        assert_eq!(f.block_bytes(), 16 * 2 * 16);
        let mla = TpLayout {
            mla: true,
            total_kv_heads: 1,
            head_dim: 576,
            ..dense(1, 4)
        };
        assert_eq!(mla.heads_of_rank(3), 0..1);
        assert_eq!(mla.ranks_of_head(0), 0..4);
        assert_eq!(mla.block_bytes(), 2 * 16 * 576 * 2);
    }

    #[test]
    fn invalid_layouts_are_typed_errors() {
        let ok = dense(1, 2);
        ok.validate().unwrap();
        for (l, want) in [
            (
                TpLayout {
                    total_kv_heads: 0,
                    ..ok.clone()
                },
                LayoutProblem::Zero("total_kv_heads"),
            ),
            (
                TpLayout {
                    tp_size: 0,
                    tp_rank: 0,
                    ..ok.clone()
                },
                LayoutProblem::Zero("tp_size"),
            ),
            (
                TpLayout {
                    block_tokens: 0,
                    ..ok.clone()
                },
                LayoutProblem::Zero("block_tokens"),
            ),
            (
                TpLayout {
                    tp_rank: 2,
                    ..ok.clone()
                },
                LayoutProblem::RankOutOfRange,
            ),
            (
                TpLayout {
                    tp_rank: u32::MAX,
                    ..ok.clone()
                },
                LayoutProblem::RankOutOfRange,
            ),
            (
                TpLayout {
                    tp_size: 3,
                    ..ok.clone()
                },
                LayoutProblem::HeadsNotDivisible,
            ),
            (
                TpLayout {
                    mla: true,
                    ..ok.clone()
                },
                LayoutProblem::MlaHeads,
            ),
            (
                TpLayout {
                    total_kv_heads: u32::MAX,
                    ..ok.clone()
                },
                LayoutProblem::TooMany("total_kv_heads"),
            ),
            (
                TpLayout {
                    tp_size: u32::MAX,
                    ..ok.clone()
                },
                LayoutProblem::TooMany("tp_size"),
            ),
            (
                TpLayout {
                    block_order: vec![BlockDim::Token, BlockDim::Head, BlockDim::Token],
                    ..ok.clone()
                },
                LayoutProblem::DuplicateDim(BlockDim::Token),
            ),
            (
                TpLayout {
                    block_order: vec![BlockDim::Layer, BlockDim::Token],
                    ..ok.clone()
                },
                LayoutProblem::MissingDim(BlockDim::Head),
            ),
            (
                TpLayout {
                    model: "m".repeat(MAX_MODEL_NAME + 1),
                    ..ok.clone()
                },
                LayoutProblem::ModelNameTooLong,
            ),
            (
                // Overflows u64 on the way.
                TpLayout {
                    layers: u32::MAX,
                    head_dim: u32::MAX,
                    block_tokens: u32::MAX,
                    dtype: Dtype::Fp32,
                    ..ok.clone()
                },
                LayoutProblem::BlockTooLarge,
            ),
            (
                // Fits u64, but not the limit.
                TpLayout {
                    head_dim: 1 << 20,
                    block_tokens: 1 << 20,
                    ..ok.clone()
                },
                LayoutProblem::BlockTooLarge,
            ),
        ] {
            assert_eq!(invalid(&l), want, "{l}");
            // The message names the layout and the problem.
            let msg = l.validate().unwrap_err().to_string();
            assert!(msg.contains(&want.to_string()), "{msg}");
        }
        // Huge but sane sizes stay valid and do not panic anywhere.
        let big = TpLayout {
            total_kv_heads: MAX_HEADS_OR_RANKS,
            tp_size: MAX_HEADS_OR_RANKS,
            tp_rank: MAX_HEADS_OR_RANKS - 1,
            head_dim: 1,
            layers: 1,
            block_tokens: 1,
            ..ok.clone()
        };
        big.validate().unwrap();
        let last = MAX_HEADS_OR_RANKS - 1;
        assert_eq!(big.heads_of_rank(last), last..last + 1);
        assert_eq!(big.ranks_of_head(u32::MAX), u32::MAX..u32::MAX);
    }

    #[test]
    fn incompatible_pairs_name_both_layouts() {
        let p = dense(0, 2);
        let d = dense(0, 4);
        Translation::new(&p, &d).unwrap();
        // Different block sizes and TP translate.
        Translation::new(
            &TpLayout {
                block_tokens: 48,
                ..dense(0, 1)
            },
            &d,
        )
        .unwrap();
        let cases: Vec<(TpLayout, Mismatch)> = vec![
            (
                TpLayout {
                    model: "other".into(),
                    ..p.clone()
                },
                Mismatch::Model,
            ),
            (
                TpLayout {
                    layers: 3,
                    ..p.clone()
                },
                Mismatch::Layers,
            ),
            (
                TpLayout {
                    total_kv_heads: 8,
                    ..p.clone()
                },
                Mismatch::KvHeads,
            ),
            (
                TpLayout {
                    head_dim: 16,
                    ..p.clone()
                },
                Mismatch::HeadDim,
            ),
            (
                TpLayout {
                    dtype: Dtype::Fp16,
                    ..p.clone()
                },
                Mismatch::Dtype,
            ),
            (
                TpLayout {
                    mla: true,
                    total_kv_heads: 1,
                    ..p.clone()
                },
                Mismatch::Mla,
            ),
            (
                TpLayout {
                    block_order: vec![
                        BlockDim::Layer,
                        BlockDim::Kv,
                        BlockDim::Head,
                        BlockDim::Token,
                    ],
                    ..p.clone()
                },
                Mismatch::BlockOrder,
            ),
        ];
        for (bad, want) in cases {
            let err = Translation::new(&bad, &d).unwrap_err();
            match &err {
                LayoutError::Incompatible {
                    mismatch,
                    prefiller,
                    decoder,
                } => {
                    assert_eq!(*mismatch, want);
                    assert_eq!(**prefiller, bad);
                    assert_eq!(**decoder, d);
                }
                other => panic!("expected Incompatible, got {other:?}"),
            }
            let msg = err.to_string();
            assert!(msg.contains(&bad.to_string()) && msg.contains(&d.to_string()));
        }
        // An invalid peer layout is Invalid, not Incompatible.
        let bad = TpLayout {
            tp_rank: 9,
            ..p.clone()
        };
        assert!(matches!(
            Translation::new(&bad, &d),
            Err(LayoutError::Invalid { .. })
        ));
    }

    #[test]
    fn travels_in_a_handshake() {
        let l = TpLayout {
            block_order: vec![BlockDim::Head, BlockDim::Kv, BlockDim::Token],
            ..dense(1, 2)
        };
        let bytes = rmp_serde::to_vec_named(&l).unwrap();
        assert_eq!(rmp_serde::from_slice::<TpLayout>(&bytes).unwrap(), l);
        let json = serde_json::to_string(&l).unwrap();
        assert!(
            json.contains(r#""block_order":["head","kv","token"]"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<TpLayout>(&json).unwrap(), l);
        // Garbage from a peer is a decode error, not a panic.
        assert!(rmp_serde::from_slice::<TpLayout>(&[0xc1, 0xff]).is_err());
        assert!(serde_json::from_str::<TpLayout>(r#"{"block_order":["row"]}"#).is_err());
    }
}
