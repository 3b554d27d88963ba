"""A prefiller rank's directory: the small region that tells a decoder rank where each KV
layer's region is, where the lease table is, which engine and TP rank it serves, and what its
KV cache looks like (layout.py). The prefiller writes it once at registration; a decoder
rank reads it once per session and trusts nothing in it: a malformed one is refused by
name. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass

import kvbridge

from .layout import RankLayout

#: Size of the directory region; a prime, so no KV layer region (an even number of bytes)
#: can be mistaken for it.
DIRECTORY_LEN = 65521
DIRECTORY_MAGIC = b"kvbridge-vllm/2 directory\n"


@dataclass
class Peer:
    peer_id: str
    regions: dict[str, int]  # layer name -> remote region id
    leases: int  # remote region id of its lease table
    engine_id: str  # the vLLM engine it serves (kv_transfer_params' remote_engine_id)
    tp_rank: int = 0
    tp_size: int = 1
    layout: RankLayout | None = None  # its KV cache's description (layout.py)
    # remote region id of its digest rows, and the bytes of a chunk (digests.py); None: it
    # offers none (kvbridge_integrity off there, or a cache not in host memory)
    digests: int | None = None
    digest_chunk_bytes: int = 0
    # its reads are confined to each request's grant (read_grants.py): a load names the
    # request's grant to it (and so reads over TCP)
    read_grants: bool = False


def parse_directory(peer_id: str, doc: dict) -> Peer:
    """A prefiller rank's directory (untrusted: a malformed one raises KeyError, TypeError
    or ValueError)."""
    tp = doc["layout"]
    if tp is not None and not isinstance(tp, dict):
        raise TypeError("layout is not an object")
    layout = RankLayout(
        str(doc["pages"]), tp, str(doc.get("why_not", "")), str(doc.get("dtype", "")), doc.get("token_rows") is True
    )
    rank, size = int(doc["tp_rank"]), int(doc["tp_size"])
    if not 0 <= rank < size:
        raise ValueError(f"TP rank {rank} of {size}")
    rows, chunk = None, 0
    # digests of another hash are no use here: such a prefiller's loads go unchecked
    if "digests" in doc and doc.get("digest_algorithm") == kvbridge.DIGEST_ALGORITHM:
        rows, chunk = int(doc["digests"]), int(doc["digest_chunk_bytes"])
        if chunk <= 0:
            raise ValueError(f"digest chunks of {chunk} bytes")
    return Peer(
        peer_id,
        {name: int(rid) for name, rid in doc["layers"].items()},
        int(doc["leases"]),
        str(doc["engine_id"]),
        rank,
        size,
        layout,
        rows,
        chunk,
        doc.get("read_grants") is True,
    )


def same_engine_layout(a: Peer, b: Peer) -> bool:
    """Two ranks of one prefiller engine describe the same KV cache (but for their rank)."""
    la, lb = a.layout, b.layout
    if la is None or lb is None or la.pages != lb.pages or la.dtype != lb.dtype:
        return False
    if la.tp is None or lb.tp is None:
        return la.tp is lb.tp
    return {**la.tp, "tp_rank": 0} == {**lb.tp, "tp_rank": 0}
