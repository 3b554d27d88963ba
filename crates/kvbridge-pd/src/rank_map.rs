//! Which prefiller ranks a decoder rank reads, and which of its heads each one supplies.
//!
//! A decoder rank needs the heads it holds ([`TpLayout::heads_of_rank`](crate::tp_layout::TpLayout::heads_of_rank)); each comes from a
//! prefiller rank that holds it. Where only one does (no replication on the prefiller), the
//! choice is forced, and consecutive heads of one prefiller rank form one run. Where several
//! do (MLA, or more prefiller ranks than KV heads), the decoder reads from the rank aligned
//! with it, `decoder_rank * prefiller_tp / decoder_tp`, as vLLM's NixlConnector does, when
//! that rank holds the head; otherwise from replica `decoder_rank % replicas`, so that
//! decoder ranks sharing a head spread over its replicas. Either way each head is read from
//! exactly one rank: MLA is read once, never once per prefiller rank.
//!
//! Unlike NixlConnector this needs no divisibility between the two TP sizes, only that each
//! side's heads split evenly over its ranks ([`TpLayout::validate`](crate::tp_layout::TpLayout::validate)).

use crate::tp_layout::Translation;

/// A run of consecutive heads that one decoder rank reads from one prefiller rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSource {
    /// The prefiller rank to read from.
    pub prefiller_rank: u32,
    /// The first head of the run, as an index among the prefiller rank's heads.
    pub src_head: u32,
    /// The first head of the run, as an index among the decoder rank's heads.
    pub dst_head: u32,
    /// Heads in the run.
    pub heads: u32,
}

/// The runs of heads decoder rank `decoder_rank` of `t` reads, in the decoder's head order;
/// empty for a rank the decoder does not have.
pub fn head_sources(t: &Translation, decoder_rank: u32) -> Vec<HeadSource> {
    let (p, d) = (t.prefiller(), t.decoder());
    if decoder_rank >= d.tp_size {
        return Vec::new();
    }
    let wanted = d.heads_of_rank(decoder_rank);
    let aligned = (decoder_rank as u64 * p.tp_size as u64 / d.tp_size as u64) as u32;
    let mut runs: Vec<HeadSource> = Vec::new();
    let mut head = wanted.start;
    while head < wanted.end {
        let holders = p.ranks_of_head(head);
        let rank = if holders.contains(&aligned) {
            aligned
        } else {
            holders.start + decoder_rank % holders.len().max(1) as u32
        };
        let held = p.heads_of_rank(rank);
        if !held.contains(&head) {
            // Cannot happen for a validated pair (the rank is one of the head's holders);
            // stopping keeps a broken invariant a short plan, which the tests catch, not a
            // loop that never ends.
            break;
        }
        let end = wanted.end.min(held.end);
        let run = HeadSource {
            prefiller_rank: rank,
            src_head: head - held.start,
            dst_head: head - wanted.start,
            heads: end - head,
        };
        match runs.last_mut() {
            // Adjacent heads of one rank are one run (a replica choice may split them).
            Some(last)
                if last.prefiller_rank == run.prefiller_rank
                    && last.src_head + last.heads == run.src_head =>
            {
                last.heads += run.heads
            }
            _ => runs.push(run),
        }
        head = end;
    }
    runs
}

/// The prefiller ranks decoder rank `decoder_rank` reads from (each once, ascending): the
/// ranks it must handshake with.
pub fn source_ranks(t: &Translation, decoder_rank: u32) -> Vec<u32> {
    let mut ranks: Vec<u32> = head_sources(t, decoder_rank)
        .iter()
        .map(|s| s.prefiller_rank)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// The decoder ranks that read from prefiller rank `prefiller_rank` (ascending): how many
/// readers must finish before that rank may free a request's blocks.
pub fn readers_of(t: &Translation, prefiller_rank: u32) -> Vec<u32> {
    (0..t.decoder().tp_size)
        .filter(|d| {
            head_sources(t, *d)
                .iter()
                .any(|s| s.prefiller_rank == prefiller_rank)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tp_layout::tests::dense;
    use crate::tp_layout::TpLayout;

    fn t(p_tp: u32, d_tp: u32, heads: u32, mla: bool) -> Translation {
        let l = |tp| TpLayout {
            total_kv_heads: heads,
            mla,
            ..dense(0, tp)
        };
        Translation::new(&l(p_tp), &l(d_tp)).unwrap()
    }

    fn src(prefiller_rank: u32, src_head: u32, dst_head: u32, heads: u32) -> HeadSource {
        HeadSource {
            prefiller_rank,
            src_head,
            dst_head,
            heads,
        }
    }

    #[test]
    fn same_tp_reads_its_own_rank() {
        let t = t(2, 2, 4, false);
        assert_eq!(head_sources(&t, 1), vec![src(1, 0, 0, 2)]);
        assert_eq!(readers_of(&t, 1), vec![1]);
    }

    #[test]
    fn decoder_tp_above_prefiller_reads_part_of_one_rank() {
        // 1 -> 2 and 2 -> 4 with 4 heads: NixlConnector's positive tp_ratio.
        let t12 = t(1, 2, 4, false);
        assert_eq!(head_sources(&t12, 1), vec![src(0, 2, 0, 2)]);
        assert_eq!(readers_of(&t12, 0), vec![0, 1]);
        let t24 = t(2, 4, 4, false);
        assert_eq!(head_sources(&t24, 3), vec![src(1, 1, 0, 1)]);
        assert_eq!(readers_of(&t24, 1), vec![2, 3]);
    }

    #[test]
    fn prefiller_tp_above_decoder_reads_several_ranks() {
        // 2 -> 1 and 4 -> 2: the negative tp_ratio.
        let t21 = t(2, 1, 4, false);
        assert_eq!(
            head_sources(&t21, 0),
            vec![src(0, 0, 0, 2), src(1, 0, 2, 2)]
        );
        assert_eq!(source_ranks(&t21, 0), vec![0, 1]);
        let t42 = t(4, 2, 4, false);
        assert_eq!(
            head_sources(&t42, 1),
            vec![src(2, 0, 0, 1), src(3, 0, 1, 1)]
        );
    }

    #[test]
    fn replicated_heads_are_read_once_spread_over_replicas() {
        // 2 heads on 4 prefiller ranks (each head on two), decoder TP 1: one replica per
        // head, the one aligned with decoder rank 0 where it holds the head.
        let t41 = t(4, 1, 2, false);
        assert_eq!(
            head_sources(&t41, 0),
            vec![src(0, 0, 0, 1), src(2, 0, 1, 1)]
        );
        // Decoder TP 4 over 2 heads too: every decoder rank reads the aligned rank.
        let t44 = t(4, 4, 2, false);
        for d in 0..4 {
            assert_eq!(head_sources(&t44, d), vec![src(d, 0, 0, 1)]);
        }
        // Prefiller TP 4, decoder TP 2 with 1 head: both decoders hold head 0, and read
        // from different replicas.
        let t42 = t(4, 2, 1, false);
        assert_eq!(head_sources(&t42, 0), vec![src(0, 0, 0, 1)]);
        assert_eq!(head_sources(&t42, 1), vec![src(2, 0, 0, 1)]);
    }

    #[test]
    fn mla_reads_one_rank_spread_by_decoder_rank() {
        let t = t(4, 2, 1, true);
        assert_eq!(head_sources(&t, 0), vec![src(0, 0, 0, 1)]);
        assert_eq!(head_sources(&t, 1), vec![src(2, 0, 0, 1)]);
        assert_eq!(readers_of(&t, 2), vec![1]);
        assert!(readers_of(&t, 1).is_empty());
        let t = super::tests::t(1, 4, 1, true);
        for d in 0..4 {
            assert_eq!(source_ranks(&t, d), vec![0]);
        }
    }

    #[test]
    fn rank_out_of_range_reads_nothing() {
        assert!(head_sources(&t(2, 2, 4, false), 2).is_empty());
    }
}
