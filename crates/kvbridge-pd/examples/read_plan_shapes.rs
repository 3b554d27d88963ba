//! Prints the reads the planner issues for the deployment shapes of issue 39: an 8B-class
//! model (32 layers, 8 KV heads of 128, bf16) and an MLA model (61 layers, latent 576),
//! a 1000-token request, under three block layouts and several TP pairs.
//!
//! `cargo run -p kvbridge-pd --example read_plan_shapes`

use kvbridge_pd::{BlockDim, Dtype, ReadPlanner, TpLayout, Translation};

const TOKENS: u64 = 1000;

fn layout(mla: bool, order: &[BlockDim], block: u32, tp_rank: u32, tp_size: u32) -> TpLayout {
    TpLayout {
        model: if mla { "mla-61" } else { "llama-8b" }.into(),
        layers: if mla { 61 } else { 32 },
        total_kv_heads: if mla { 1 } else { 8 },
        head_dim: if mla { 576 } else { 128 },
        mla,
        dtype: Dtype::Bf16,
        block_tokens: block,
        block_order: order.to_vec(),
        tp_rank,
        tp_size,
    }
}

/// Block ids for `tokens` tokens: adjacent (`0, 1, 2, ..`) or scattered (`0, 2, 4, ..`).
fn blocks(tokens: u64, block: u32, adjacent: bool) -> Vec<u32> {
    let n = tokens.div_ceil(block as u64) as u32;
    (0..n).map(|i| if adjacent { i } else { 2 * i }).collect()
}

fn main() {
    let chunk = TpLayout::CHUNK_ORDER.to_vec();
    let cpu = vec![BlockDim::Head, BlockDim::Kv, BlockDim::Token];
    let flash = vec![BlockDim::Token, BlockDim::Head];
    let orders: [(&str, &[BlockDim]); 3] = [
        ("pd chunk [layer,kv,token,head]", &chunk),
        ("vllm cpu [head,kv,token]/layer", &cpu),
        ("flash [token,head]/layer,kv", &flash),
    ];
    println!(
        "{:<31} {:>5} {:>7} {:>9} {:>9} {:>11}  reads from",
        "block layout (planes)", "tp", "blocks", "ops/rank", "adjacent", "MiB/rank"
    );
    for (name, order) in orders {
        let block = if order.len() == 4 { 256 } else { 16 };
        let shapes: Vec<(bool, u32, u32, u32, u32)> = vec![
            (false, 1, 1, block, block),
            (false, 1, 2, block, block),
            (false, 2, 1, block, block),
            (false, 2, 4, block, block),
            (false, 4, 2, block, block),
            (false, 1, 1, block / 2, block),
            (false, 1, 1, block, block / 2),
            (false, 1, 2, block / 2, block),
            (true, 1, 2, block, block),
            (true, 2, 4, block, block),
        ];
        for (mla, tp_p, tp_d, bp, bd) in shapes {
            // Decoder rank 0 and the last rank: they differ only in whom they read.
            for d in [0, tp_d - 1]
                .into_iter()
                .collect::<std::collections::BTreeSet<_>>()
            {
                let t = Translation::new(
                    &layout(mla, order, bp, 0, tp_p),
                    &layout(mla, order, bd, d, tp_d),
                )
                .expect("the shapes translate");
                let planner = ReadPlanner::new(&t);
                let plan = |adjacent| {
                    planner
                        .plan(
                            &blocks(TOKENS, bp, adjacent),
                            &blocks(TOKENS, bd, adjacent),
                            TOKENS,
                        )
                        .expect("the request plans")
                };
                let (scattered, adjacent) = (plan(false), plan(true));
                assert_eq!(scattered.bytes(), planner.wanted_bytes(TOKENS));
                println!(
                    "{:<31} {:>5} {:>7} {:>9} {:>9} {:>11.2}  {:?} (rank {d}){}",
                    name,
                    format!("{tp_p}->{tp_d}"),
                    format!("{bp}->{bd}"),
                    scattered.ops(),
                    adjacent.ops(),
                    scattered.bytes() as f64 / (1 << 20) as f64,
                    scattered.prefiller_ranks(),
                    if mla { " mla" } else { "" },
                );
            }
        }
    }
}
