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


def build(out: Path, *, layers: int = 2, kv_heads: int = 2, head_dim: int = 32, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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

    heads = kv_heads * 2
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        initializer_range=0.02,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # projections and embeddings: peaky attention and logits
                p.normal_(0.0, 0.5 if "embed" not in name else 1.0)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "kvbridge-tiny.json").write_text(json.dumps({"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "seed": seed}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    build(a.out, layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim, seed=a.seed)


if __name__ == "__main__":
    main()
