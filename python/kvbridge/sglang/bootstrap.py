"""``KvbridgeKVBootstrapServer``: SGLang's bootstrap registry (the prefill server's HTTP
endpoint the decode asks where each prefill rank is), with its inputs checked.

SGLang's ``CommonKVBootstrapServer`` indexes the JSON of a registration and the query of a
lookup in place: a malformed one is answered with a 500 and a traceback, and anyone who can
reach the port can register a rank at an address of their choosing. This one answers every
malformed request with a 400 naming the field, refuses a registration that changes the
topology the first one set (409), and, with ``KVBRIDGE_SECRET`` set, one not signed with
the secret (401): a rank signs its registration (HMAC-SHA256 over the canonical JSON), so
only a holder of the secret can say where a prefill rank's KV comes from. With
``KVBRIDGE_PEER_KEY`` (the prefill's own key, in the environment the server shares with its
ranks) the signature is made and checked with that key instead, so a holder of the shared
secret cannot re-register a rank whose id a decode binds at another address or id. A lookup also
returns the rank's kvbridge channel (``kvbridge_addr``, ``kvbridge_peer``) and its signed
registration (``kvbridge_registration``), which a decode that requires bound prefills checks
against its keyring (trust.py). The checks of a registration's fields and the limits on
bodies are in ``check_registration`` and ``_body``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Dict, Tuple

from aiohttp import web
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from .config import settings
from .trust import SIGNED_FIELD, sign, signed_by

__all__ = ["KvbridgeKVBootstrapServer", "BadRequest", "check_registration", "sign"]

logger = logging.getLogger(__name__)

_MAX_BODY = 64 << 10
_MAX_COUNT = 1 << 16  # ranks of one kind (TP, CP, DP, PP)
_MAX_PAGE = 1 << 24  # tokens a page, as the decode's registration allows (messages.py)
# (size, rank) pairs: a size is 1.._MAX_COUNT, its rank below it
_COUNTS = (
    ("attn_tp_size", "attn_tp_rank"), ("attn_cp_size", "attn_cp_rank"), ("attn_dp_size", "attn_dp_rank"),
    ("pp_size", "pp_rank"), ("system_dp_size", "system_dp_rank"),
)  # fmt: skip
# optional fields SGLang reads, and the types it can use
_OPTIONAL = {
    "kv_layout": (str,), "load_balance_method": (str,), "decode_allocation_policy": (str,),
    "enable_dsa_cache_layer_split": (bool,), "enable_kv_cache_sharding": (bool,),
    "dsv41_spec_layout": (dict,), "prefill_http_port": (int,), "kvbridge_sig": (str,),
}  # fmt: skip


class BadRequest(ValueError):
    pass


class _TooLarge(BadRequest):
    pass


def _int(data: Dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = data.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise BadRequest(f"{key!r} must be an integer in {lo}..{hi}, got {v!r}"[:200])
    return v


def _text(data: Dict[str, Any], key: str, most: int = 256) -> str:
    v = data.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= most:
        raise BadRequest(f"{key!r} must be a string of 1 to {most} characters, got {v!r}"[:200])
    return v


def check_registration(data: Any) -> Dict[str, Any]:
    """The registration's fields, checked; raises ``BadRequest`` naming the field."""
    if not isinstance(data, dict):
        raise BadRequest("a registration is a JSON object")
    for size, rank in _COUNTS:
        _int(data, size, 1, _MAX_COUNT)
        if _int(data, rank, 0, _MAX_COUNT) >= data[size]:
            raise BadRequest(f"{rank!r} {data[rank]} is outside {size!r} {data[size]}")
    _int(data, "rank_port", 1, 65535)
    _int(data, "page_size", 1, _MAX_PAGE)
    for key in ("rank_ip", "kvbridge_peer"):
        _text(data, key)
    _text(data, "kv_cache_dtype", 64)
    host, sep, port = _text(data, "kvbridge_addr").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadRequest(f"'kvbridge_addr' must be host:port, got {data['kvbridge_addr']!r}"[:200])
    for key, types in _OPTIONAL.items():
        v = data.get(key)
        if v is not None and (not isinstance(v, types) or (types == (int,) and isinstance(v, bool))):
            raise BadRequest(f"{key!r} must be {types[0].__name__} or absent, got {type(v).__name__}")
    if data.get("prefill_http_port") is not None:
        _int(data, "prefill_http_port", 1, 65535)
    return data


def dp_group(data: Dict[str, Any]) -> int:
    """The DP group a registration is filed under (as SGLang files it)."""
    return data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]


async def _body(request: web.Request) -> bytes:
    """The request's body, read to its end or to one byte past ``_MAX_BODY`` (a read returns
    what has arrived, which may be part of an honest body)."""
    chunks, size = [], 0
    while size <= _MAX_BODY:
        chunk = await request.content.read(_MAX_BODY + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _json(body: bytes) -> Any:
    """``json.loads``, with what it raises on hostile input as ``BadRequest``."""
    if len(body) > _MAX_BODY:
        raise _TooLarge(f"more than {_MAX_BODY} bytes")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"not JSON ({e})"[:200]) from None
    except RecursionError:
        raise BadRequest("not JSON (nested too deep)") from None


def _rank_query(request: web.Request) -> Tuple[int, int, int, int]:
    out = []
    for key in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"):
        raw = request.query.get(key)
        try:
            v = int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise BadRequest(f"query parameter {key!r} must be an integer, got {raw!r}"[:200]) from None
        if not -1 <= v < (1 << 31):
            raise BadRequest(f"query parameter {key!r} out of range: {v}")
        out.append(v)
    return out[0], out[1], out[2], out[3]


class KvbridgeKVBootstrapServer(CommonKVBootstrapServer):
    def __init__(self, host: str, port: int):
        self._key_name, self._secret = settings().registration_key
        self.kvbridge_table: Dict[Tuple[int, int, int, int], Dict[str, Any]] = {}
        self.refused = 0
        super().__init__(host, port)

    def _bad(self, status: int, text: str) -> web.Response:
        self.refused += 1
        logger.warning("kvbridge bootstrap: refused (%d): %s", status, text)
        return web.Response(text=text, status=status)

    async def _handle_route_put(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            data = check_registration(_json(body))
        except BadRequest as e:
            return self._bad(413 if isinstance(e, _TooLarge) else 400, f"bad registration: {e}")
        if self._secret and not signed_by(self._secret, data):
            return self._bad(401, f"registration not signed with {self._key_name}")
        dp_size = data["attn_dp_size"] if data["system_dp_size"] == 1 else data["system_dp_size"]
        for field, got, mine in (
            ("attn_tp_size", data["attn_tp_size"], self.attn_tp_size),
            ("attn_cp_size", data["attn_cp_size"], self.attn_cp_size),
            ("pp_size", data["pp_size"], self.pp_size),
            ("dp size", dp_size, self.dp_size),
            ("page_size", data["page_size"], self.page_size),
            ("kv_cache_dtype", data["kv_cache_dtype"], self.kv_cache_dtype),
        ):
            if mine is not None and got != mine:
                return self._bad(409, f"{field} {got!r} differs from the registered {mine!r}"[:300])
        key = (dp_group(data), data["attn_cp_rank"], data["attn_tp_rank"], data["pp_rank"])
        again = key in self.kvbridge_table
        request._read_bytes = body  # lets SGLang's handler read the same body
        response = await super()._handle_route_put(request)
        if response.status == 200:
            if again:  # the same rank again (a retried PUT): SGLang counts ranks, not PUTs
                self._registered_count -= 1
            # the lookup forwards the signed registration, for a decode to check (trust.py)
            self.kvbridge_table[key] = {
                "kvbridge_addr": data["kvbridge_addr"], "kvbridge_peer": data["kvbridge_peer"], SIGNED_FIELD: data,
            }  # fmt: skip
        return response

    async def _handle_route_get(self, request: web.Request) -> web.Response:
        try:
            key = _rank_query(request)
        except BadRequest as e:
            return self._bad(400, str(e))
        response = await super()._handle_route_get(request)
        if response.status != 200 or key == (-1, -1, -1, -1):
            return response
        info = json.loads(response.body)
        info.update(self.kvbridge_table.get(key, {}))
        return web.json_response(info, status=200)

    async def _handle_register_dp_rank(self, request: web.Request) -> web.Response:
        try:
            data = _json(await _body(request))
            if not isinstance(data, dict):
                raise BadRequest("not a JSON object")
            for key in ("bootstrap_room", "dp_rank"):
                v = data.get(key)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise BadRequest(f"{key!r} must be a non-negative integer")
        except BadRequest as e:
            return self._bad(413 if isinstance(e, _TooLarge) else 400, f"bad dp rank registration: {e}")
        request._read_bytes = json.dumps(data).encode()
        return await super()._handle_register_dp_rank(request)

    async def _handle_query_dp_ranks(self, request: web.Request) -> web.Response:
        try:
            data = _json(await _body(request))
            rooms = data.get("bootstrap_rooms") if isinstance(data, dict) else None
            if not isinstance(rooms, list) or len(rooms) > 65536:
                raise BadRequest("'bootstrap_rooms' must be a list")
            for r in rooms:
                if not isinstance(r, int) or isinstance(r, bool):
                    raise BadRequest(f"bootstrap room {r!r} is not an integer"[:200])
        except BadRequest as e:
            return self._bad(413 if isinstance(e, _TooLarge) else 400, f"bad dp rank query: {e}")
        request._read_bytes = json.dumps(data).encode()
        return await super()._handle_query_dp_ranks(request)
