//! `kvbridge demo --prefill-tp P --decode-tp D [--mla]`: the model split over P prefiller
//! ranks and D decoder ranks, checked as two engines would check each other at their first
//! handshake ([`Translation::new`]) and planned as a push ([`PushPlan`]).
//!
//! The model has `--kv-heads × --tp` KV heads in all (one latent with `--mla`); each side
//! splits them over its own ranks. The reference engines compute KV in the decoder's split
//! (the colocated engine runs it too), so the model below is that split.

use crate::cli::ModelArgs;
use crate::model::Model;
use kvbridge_pd::{KvLayout, PushPlan, TpLayout, Translation};
use std::sync::Arc;

/// The latent dimension `--mla` uses when `--latent-dim` is not given (DeepSeek-class:
/// 512 + 64 rope).
pub const DEFAULT_MLA_LATENT_DIM: u32 = 576;

/// Both sides' TP sizes, the model in the decoder's split, and the push between them.
#[derive(Debug, Clone)]
pub struct TpShape {
    /// Ranks of each prefill engine.
    pub prefill_tp: u32,
    /// Ranks of each decode engine.
    pub decode_tp: u32,
    /// The model as the decoders (and the colocated engine) hold it.
    pub model: Model,
    /// The push from a prefill engine to a decode engine; `None` without
    /// `--prefill-tp`/`--decode-tp` (one PD lane per rank, as many on both sides).
    pub push: Option<Arc<PushPlan>>,
}

impl TpShape {
    /// The shape the flags describe. Refuses what no push can translate (KV heads that do
    /// not split over one side's ranks) with the layouts of both sides.
    pub fn from_flags(
        model: &ModelArgs,
        prefill_tp: Option<u32>,
        decode_tp: Option<u32>,
        mla: bool,
    ) -> anyhow::Result<TpShape> {
        let mut flags = model.clone();
        if mla && flags.latent_dim == 0 {
            flags.latent_dim = DEFAULT_MLA_LATENT_DIM;
        }
        let base = flags.build()?;
        if prefill_tp.is_none() && decode_tp.is_none() {
            return Ok(TpShape {
                prefill_tp: base.world_size,
                decode_tp: base.world_size,
                model: base,
                push: None,
            });
        }
        let p = prefill_tp.unwrap_or(base.world_size);
        let d = decode_tp.unwrap_or(base.world_size);
        if p == 0 || d == 0 {
            anyhow::bail!("--prefill-tp and --decode-tp must be at least 1");
        }
        let (pl, dl) = (layout(&base, p), layout(&base, d));
        let t = Translation::new(&pl, &dl).map_err(|e| {
            anyhow::anyhow!(
                "--prefill-tp {p} --decode-tp {d}: {e} (prefiller: {pl}; decoder: {dl})"
            )
        })?;
        let plan = PushPlan::new(&t)?;
        let layout = match base.spec.layout {
            KvLayout::Standard {
                layers, head_dim, ..
            } => KvLayout::Standard {
                layers,
                kv_heads: dl.heads_per_rank(),
                head_dim,
            },
            mla @ KvLayout::Mla { .. } => mla,
        };
        Ok(TpShape {
            prefill_tp: p,
            decode_tp: d,
            model: Model {
                spec: kvbridge_pd::KvSpec {
                    layout,
                    ..base.spec
                },
                world_size: d,
                ..base
            },
            push: Some(Arc::new(plan)),
        })
    }

    /// Writes each chunk costs: one per part of the push, or one per rank.
    pub fn parts_per_chunk(&self) -> u64 {
        self.push
            .as_ref()
            .map_or(self.model.world_size as u64, |p| p.ops_per_chunk())
    }
}

/// Rank 0's layout of `model`'s KV heads (`kv_heads × world_size` in all, or MLA's one
/// latent) split over `tp` ranks, in PD chunks.
pub fn layout(model: &Model, tp: u32) -> TpLayout {
    let (layers, total_kv_heads, head_dim, mla) = match model.spec.layout {
        KvLayout::Standard {
            layers,
            kv_heads,
            head_dim,
        } => (
            layers,
            kv_heads.saturating_mul(model.world_size),
            head_dim,
            false,
        ),
        KvLayout::Mla { layers, latent_dim } => (layers, 1, latent_dim, true),
    };
    TpLayout {
        model: model.name.clone(),
        layers,
        total_kv_heads,
        head_dim,
        mla,
        dtype: model.spec.dtype,
        block_tokens: model.spec.chunk_tokens,
        block_order: TpLayout::CHUNK_ORDER.to_vec(),
        tp_rank: 0,
        tp_size: tp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        model: ModelArgs,
    }

    fn flags(extra: &[&str]) -> ModelArgs {
        let mut a = vec!["x"];
        a.extend_from_slice(extra);
        Cli::parse_from(a).model
    }

    #[test]
    fn decoder_split_of_the_total_heads() {
        let s = TpShape::from_flags(&flags(&[]), Some(2), Some(4), false).unwrap();
        assert_eq!((s.prefill_tp, s.decode_tp, s.model.world_size), (2, 4, 4));
        assert!(matches!(
            s.model.spec.layout,
            KvLayout::Standard { kv_heads: 2, .. }
        ));
        assert_eq!(s.parts_per_chunk(), 4);
        let s = TpShape::from_flags(&flags(&[]), Some(2), Some(1), false).unwrap();
        assert_eq!(s.parts_per_chunk(), 2);
        let s = TpShape::from_flags(&flags(&[]), None, None, true).unwrap();
        assert!(s.push.is_none());
        assert!(matches!(
            s.model.spec.layout,
            KvLayout::Mla {
                latent_dim: DEFAULT_MLA_LATENT_DIM,
                ..
            }
        ));
    }

    #[test]
    fn heads_that_do_not_split_are_refused_naming_both_layouts() {
        let e = TpShape::from_flags(&flags(&["--kv-heads", "6"]), Some(4), Some(2), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("do not split"), "{e}");
        assert!(
            e.contains("prefiller:") && e.contains("tp rank 0 of 4"),
            "{e}"
        );
        assert!(
            e.contains("decoder:") && e.contains("tp rank 0 of 2"),
            "{e}"
        );
    }
}
