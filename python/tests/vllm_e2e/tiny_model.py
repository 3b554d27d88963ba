"""A tiny Llama with random weights and a tokenizer, both made locally (nothing from a hub).

The weights are drawn with a large standard deviation so that every next token depends
sharply on the context: a KV cache with a wrong byte changes the top logprobs, which a
near-uniform (default-initialised) random model would hide.

    python tiny_model.py OUT_DIR [--layers N --kv-heads N --head-dim N --seed N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: Words of the vocabulary; token ids 0..3 are special. Readable, so outputs can be read.
WORDS = (
    "the a an of to in on at by for with from and or but not is was are were be been it this that "
    "these those he she they we you i me him her them us my your his its our their what which who "
    "when where why how all any both each few more most other some such no nor only own same so than "
    "too very can will just should now one two three four five six seven eight nine ten red green "
    "blue black white cat dog bird fish tree river stone cloud rain sun moon star sky sea ship road "
    "house door window table chair book page word line story time day night year hand eye head heart "
    "mind voice light dark fire water earth wind cold warm old new long short high low good bad"
).split()
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def tokenizer(out: Path) -> int:
    """The word-level tokenizer every tiny model shares, saved in ``out``; its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(SPECIALS + tuple(WORDS) + (":",))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(vocab)


def sharpen(model, attention: float = 0.5) -> None:
    """Projections and embeddings drawn wide: peaky attention and logits (``attention``: the
    standard deviation of the attention's projections)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 if "embed" in name else attention if "self_attn" in name else 0.5)


#: What both models share: tiny widths, and the tokenizer's special ids (``tokenizer``).
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    tie_word_embeddings=False,
    initializer_range=0.02,
    torch_dtype="bfloat16",
)


def _save(out: Path, model_class, config, *, attention: float, seed: int, meta: dict) -> Path:
    """Random weights from ``seed``, sharpened, saved in bf16 with ``meta`` beside them."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    sharpen(model, attention=attention)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "kvbridge-tiny.json").write_text(json.dumps(meta))
    return out


def build(out: Path, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 32, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tokenizer(out),
        num_hidden_layers=layers,
        num_attention_heads=kv_heads * 2,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        **_COMMON,
    )
    meta = {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "seed": seed}
    return _save(out, LlamaForCausalLM, config, attention=0.5, seed=seed, meta=meta)


#: The latent vLLM CPU's MLA decode kernel is compiled for (``CPUMLABackend``: head size
#: 576 = kv_lora_rank 512 + rope 64 only; it also forces blocks of 16 tokens).
MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
#: The standard deviation of the MLA model's attention projections (the Llama's, by default).
MLA_ATTENTION_STD = 0.5


def build_mla(
    out: Path,
    *,
    layers: int = 2,
    heads: int = 2,
    nope_dim: int = 16,
    v_dim: int = 16,
    kv_lora_rank: int = MLA_KV_LORA_RANK,
    rope_dim: int = MLA_ROPE_DIM,
    attention: float = MLA_ATTENTION_STD,
    seed: int = 0,
) -> Path:
    """A DeepSeek-V2-shaped model (MLA attention, dense MLPs: no expert weights) as small as vLLM
    CPU's MLA backend serves: only the latent (``kv_lora_rank + qk_rope_head_dim``) is fixed,
    at 576; the per-head dimensions and the hidden size are free."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    config = DeepseekV2Config(
        vocab_size=tokenizer(out),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=None,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=nope_dim,
        v_head_dim=v_dim,
        head_dim=rope_dim,
        # experts are named (the config wants numbers) but no layer has them: every layer
        # below first_k_dense_replace is dense, in transformers and in vLLM
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        moe_intermediate_size=32,
        first_k_dense_replace=layers,
        **_COMMON,
    )
    meta = {"mla": True, "layers": layers, "heads": heads, "nope_dim": nope_dim, "v_dim": v_dim,
            "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim, "attention_std": attention, "seed": seed}  # fmt: skip
    return _save(out, DeepseekV2ForCausalLM, config, attention=attention, seed=seed, meta=meta)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mla", action="store_true", help="the DeepSeek-V2-shaped MLA model (--layers, --heads, --seed)")
    ap.add_argument("--heads", type=int, default=2, help="MLA: attention heads")
    ap.add_argument("--kv-lora-rank", type=int, default=MLA_KV_LORA_RANK, help="MLA (vLLM CPU serves 512 only)")
    ap.add_argument("--rope-dim", type=int, default=MLA_ROPE_DIM, help="MLA (vLLM CPU serves 64 only)")
    ap.add_argument("--attention-std", type=float, default=MLA_ATTENTION_STD, help="MLA: attention weights' std")
    a = ap.parse_args()
    if a.mla:
        build_mla(a.out, layers=a.layers, heads=a.heads, kv_lora_rank=a.kv_lora_rank, rope_dim=a.rope_dim,
                  attention=a.attention_std, seed=a.seed)  # fmt: skip
        return
    build(a.out, layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim, seed=a.seed)


if __name__ == "__main__":
    main()
