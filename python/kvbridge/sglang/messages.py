"""The backend's messages, and their checks: every field a peer sends is validated here,
so a malformed or hostile message is refused with a ``BadMessage`` naming the field, never
an exception deep in a worker thread (SGLang's own backends parse frames in place; a bad
one kills their bootstrap thread).

Over SGLang's ZMQ control socket (decode -> prefill rank), as its backends do:

* ``[b"KVBRIDGE_REG", json]``: a decode rank's registration, once per prefill rank: where
  its kvbridge channel listens, its peer id, and the regions (one per KV buffer, one per
  metadata buffer) that a grant can open.
* ``[b"KVBRIDGE_XFER", json, int32 page indices]``: one request's destination: room, the
  decode's pages and metadata slot, and the grant token that opens them to the writer.
* SGLang's ``ABORT`` frames, handled by ``CommonKVManager``'s parser.

Over kvbridge (prefill rank -> decode rank, authenticated, delivered after the writes that
preceded them): ``{"t": "status", "room", "status", "rank", "reason"}``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, List, Optional

import numpy as np

REG_TAG = b"KVBRIDGE_REG"
XFER_TAG = b"KVBRIDGE_XFER"

MAX_JSON = 64 << 10
MAX_LIST = 1 << 16
MAX_PAGES = 1 << 24
MAX_U63 = (1 << 63) - 1
MAX_STR = 512
MAX_REGION = (1 << 128) - 1  # kvbridge region ids are 128-bit


class BadMessage(ValueError):
    """A message that cannot be used; the text names the field."""


def _int(d: dict, key: str, lo: int = 0, hi: int = MAX_U63, optional: bool = False) -> Optional[int]:
    v = d.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadMessage(f"{key!r} must be an integer in {lo}..{hi}, got {v!r}"[:300])
    return v


def _str(d: dict, key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= MAX_STR:
        raise BadMessage(f"{key!r} must be a non-empty string of at most {MAX_STR} characters")
    return v


def _ints(d: dict, key: str, lo: int = 0, hi: int = MAX_U63) -> List[int]:
    v = d.get(key)
    if not isinstance(v, list) or len(v) > MAX_LIST:
        raise BadMessage(f"{key!r} must be a list of at most {MAX_LIST} integers")
    for x in v:
        if not isinstance(x, int) or isinstance(x, bool) or not lo <= x <= hi:
            raise BadMessage(f"{key!r} holds {x!r}, not an integer in {lo}..{hi}"[:300])
    return list(v)


def _addr(d: dict, key: str) -> str:
    v = _str(d, key)
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadMessage(f"{key!r} must be host:port, got {v!r}"[:300])
    return v


def _json(frame: bytes, what: str) -> dict:
    if len(frame) > MAX_JSON:
        raise BadMessage(f"{what}: {len(frame)} bytes of JSON, at most {MAX_JSON}")
    try:
        d = json.loads(frame)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadMessage(f"{what}: not JSON ({e})") from None
    except RecursionError:
        raise BadMessage(f"{what}: not JSON (nested too deep)") from None
    if not isinstance(d, dict):
        raise BadMessage(f"{what}: not a JSON object")
    return d


@dataclasses.dataclass(frozen=True)
class Registration:
    """A decode rank, as it registered with one prefill rank."""

    endpoint: str  # its ZMQ address: SGLang's key for the peer (with port)
    port: int
    addr: str  # its kvbridge channel
    peer_id: str
    tp_rank: int
    tp_size: int
    page_size: int
    kv_cache_dtype: str
    kv_item_lens: List[int]
    kv_regions: List[int]
    aux_item_lens: List[int]
    aux_regions: List[int]

    @property
    def key(self) -> tuple[str, int]:
        return (self.endpoint, self.port)

    def to_zmq(self) -> List[bytes]:
        return [REG_TAG, json.dumps(dataclasses.asdict(self)).encode()]

    @classmethod
    def from_zmq(cls, msg: List[bytes]) -> "Registration":
        if len(msg) != 2 or msg[0] != REG_TAG:
            raise BadMessage(f"registration: {len(msg)} frames, expected 2 starting with {REG_TAG!r}")
        d = _json(msg[1], "registration")
        reg = cls(
            endpoint=_str(d, "endpoint"),
            port=_int(d, "port", 1, 65535),
            addr=_addr(d, "addr"),
            peer_id=_str(d, "peer_id"),
            tp_rank=_int(d, "tp_rank", 0, 1 << 16),
            tp_size=_int(d, "tp_size", 1, 1 << 16),
            page_size=_int(d, "page_size", 1, 1 << 24),
            kv_cache_dtype=_str(d, "kv_cache_dtype"),
            kv_item_lens=_ints(d, "kv_item_lens", 1),
            kv_regions=_ints(d, "kv_regions", 0, MAX_REGION),
            aux_item_lens=_ints(d, "aux_item_lens", 1),
            aux_regions=_ints(d, "aux_regions", 0, MAX_REGION),
        )
        if reg.tp_rank >= reg.tp_size:
            raise BadMessage(f"registration: tp_rank {reg.tp_rank} outside tp_size {reg.tp_size}")
        if len(reg.kv_regions) != len(reg.kv_item_lens) or len(reg.aux_regions) != len(reg.aux_item_lens):
            raise BadMessage("registration: one region per KV and metadata buffer, with its item length")
        return reg


@dataclasses.dataclass
class TransferInfo:
    """One decode rank's destination for one request (the fields ``CommonKVManager``
    reads keep SGLang's names)."""

    room: int
    endpoint: str
    dst_port: int
    peer_id: str
    dst_kv_indices: np.ndarray
    dst_aux_index: Optional[int]
    required_dst_info_num: int
    decode_prefix_len: int
    is_dummy: bool
    token: bytes

    def to_zmq(self) -> List[bytes]:
        head = {
            "room": self.room,
            "endpoint": self.endpoint,
            "port": self.dst_port,
            "peer_id": self.peer_id,
            "aux_index": self.dst_aux_index,
            "required_dst_info_num": self.required_dst_info_num,
            "decode_prefix_len": self.decode_prefix_len,
            "is_dummy": self.is_dummy,
            "token": self.token.hex(),
        }
        pages = np.ascontiguousarray(self.dst_kv_indices, dtype="<i4").tobytes()
        return [XFER_TAG, json.dumps(head).encode(), pages]

    @classmethod
    def from_zmq(cls, msg: List[bytes]) -> "TransferInfo":
        if len(msg) != 3 or msg[0] != XFER_TAG:
            raise BadMessage(f"transfer: {len(msg)} frames, expected 3 starting with {XFER_TAG!r}")
        d = _json(msg[1], "transfer")
        pages = msg[2]
        if len(pages) % 4 or len(pages) // 4 > MAX_PAGES:
            raise BadMessage(f"transfer: {len(pages)} bytes of page indices, not a whole number of int32 (at most {MAX_PAGES})")
        indices = np.frombuffer(pages, dtype="<i4").astype(np.int64)
        if indices.size and int(indices.min()) < 0:
            raise BadMessage("transfer: a negative page index")
        token_hex = _str(d, "token")
        try:
            token = bytes.fromhex(token_hex)
        except ValueError:
            raise BadMessage("transfer: 'token' is not hex") from None
        if len(token) != 16:
            raise BadMessage(f"transfer: a grant token of {len(token)} bytes, expected 16")
        is_dummy = d.get("is_dummy")
        if not isinstance(is_dummy, bool):
            raise BadMessage("transfer: 'is_dummy' must be true or false")
        return cls(
            room=_int(d, "room"),
            endpoint=_str(d, "endpoint"),
            dst_port=_int(d, "port", 1, 65535),
            peer_id=_str(d, "peer_id"),
            dst_kv_indices=indices,
            dst_aux_index=_int(d, "aux_index", optional=True),
            required_dst_info_num=_int(d, "required_dst_info_num", 1, 1 << 16),
            decode_prefix_len=_int(d, "decode_prefix_len"),
            is_dummy=is_dummy,
            token=token,
        )


def status_note(room: int, status: int, rank: int, reason: Optional[str]) -> bytes:
    return json.dumps({"t": "status", "room": room, "status": status, "rank": rank, "reason": reason or ""}).encode()


def parse_note(data: bytes) -> dict[str, Any]:
    """A notification from a prefill rank: ``{"t": "status", ...}`` checked, or ``{"t":
    "ping"}``; raises ``BadMessage``."""
    d = _json(data, "notification")
    t = d.get("t")
    if t == "ping":
        return d
    if t != "status":
        raise BadMessage(f"notification: unknown type {t!r}"[:200])
    _int(d, "room")
    _int(d, "status", 0, 4)
    _int(d, "rank", 0, 1 << 20)
    reason = d.get("reason", "")
    if not isinstance(reason, str):
        raise BadMessage("notification: 'reason' must be a string")
    d["reason"] = reason[:2000]
    return d
