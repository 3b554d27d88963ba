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
returns the rank's kvbridge channel (``kvbridge_addr``, ``kvbridge_peer``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any, Dict, Optional, Tuple

from aiohttp import web
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from .config import settings

logger = logging.getLogger(__name__)

_INT_FIELDS = (
    "attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size",
    "attn_dp_rank", "pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_port",
    "page_size",
)  # fmt: skip
_MAX_BODY = 64 << 10


def _canonical(payload: Dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in payload.items() if k != "kvbridge_sig"}, sort_keys=True).encode()


def sign(secret: Optional[str], payload: Dict[str, Any]) -> str:
    if not secret:
        return ""
    return hmac.new(secret.encode(), _canonical(payload), hashlib.sha256).hexdigest()


class BadRequest(ValueError):
    pass


def check_registration(data: Any) -> Dict[str, Any]:
    """The registration's fields, checked; raises ``BadRequest`` naming the field."""
    if not isinstance(data, dict):
        raise BadRequest("a registration is a JSON object")
    for key in _INT_FIELDS:
        v = data.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < (1 << 31):
            raise BadRequest(f"{key!r} must be a non-negative integer, got {v!r}"[:200])
    for size, rank in (("attn_tp_size", "attn_tp_rank"), ("attn_cp_size", "attn_cp_rank"), ("pp_size", "pp_rank")):
        if data[size] < 1 or data[rank] >= data[size]:
            raise BadRequest(f"{rank!r} {data[rank]} is outside {size!r} {data[size]}")
    if data["attn_dp_size"] < 1 or data["system_dp_size"] < 1:
        raise BadRequest("'attn_dp_size' and 'system_dp_size' must be at least 1")
    if not 0 < data["rank_port"] < 65536:
        raise BadRequest(f"'rank_port' {data['rank_port']} is not a port")
    for key in ("rank_ip", "kvbridge_addr", "kvbridge_peer"):
        v = data.get(key)
        if not isinstance(v, str) or not 0 < len(v) <= 256:
            raise BadRequest(f"{key!r} must be a non-empty string")
    if not isinstance(data.get("kv_cache_dtype"), str):
        raise BadRequest("'kv_cache_dtype' must be a string")
    return data


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
        self.kvbridge_table: Dict[Tuple[int, int, int, int], Dict[str, str]] = {}
        self.refused = 0
        super().__init__(host, port)

    def _bad(self, status: int, text: str) -> web.Response:
        self.refused += 1
        logger.warning("kvbridge bootstrap: refused (%d): %s", status, text)
        return web.Response(text=text, status=status)

    async def _handle_route_put(self, request: web.Request) -> web.Response:
        body = await request.content.read(_MAX_BODY + 1)
        if len(body) > _MAX_BODY:
            return self._bad(413, f"a registration of more than {_MAX_BODY} bytes")
        try:
            data = check_registration(json.loads(body))
        except (ValueError, UnicodeDecodeError) as e:
            return self._bad(400, f"bad registration: {e}")
        if self._secret:
            sig = data.get("kvbridge_sig")
            if not isinstance(sig, str) or not hmac.compare_digest(sig, sign(self._secret, data)):
                return self._bad(401, f"registration not signed with {self._key_name}")
        for field, mine in (("attn_tp_size", self.attn_tp_size), ("attn_cp_size", self.attn_cp_size), ("pp_size", self.pp_size)):
            if mine is not None and data[field] != mine:
                return self._bad(409, f"{field} {data[field]} differs from the registered {mine}")
        request._read_bytes = body  # lets SGLang's handler read the same body
        response = await super()._handle_route_put(request)
        if response.status == 200:
            dp = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
            key = (dp, data["attn_cp_rank"], data["attn_tp_rank"], data["pp_rank"])
            self.kvbridge_table[key] = {"kvbridge_addr": data["kvbridge_addr"], "kvbridge_peer": data["kvbridge_peer"]}
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
            data = json.loads(await request.content.read(_MAX_BODY))
            if not isinstance(data, dict):
                raise BadRequest("not a JSON object")
            for key in ("bootstrap_room", "dp_rank"):
                v = data.get(key)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise BadRequest(f"{key!r} must be a non-negative integer")
        except (ValueError, UnicodeDecodeError) as e:
            return self._bad(400, f"bad dp rank registration: {e}")
        request._read_bytes = json.dumps(data).encode()
        return await super()._handle_register_dp_rank(request)

    async def _handle_query_dp_ranks(self, request: web.Request) -> web.Response:
        try:
            data = json.loads(await request.content.read(_MAX_BODY))
            rooms = data.get("bootstrap_rooms") if isinstance(data, dict) else None
            if not isinstance(rooms, list) or len(rooms) > 65536:
                raise BadRequest("'bootstrap_rooms' must be a list")
            for r in rooms:
                if not isinstance(r, int) or isinstance(r, bool):
                    raise BadRequest(f"bootstrap room {r!r} is not an integer"[:200])
        except (ValueError, UnicodeDecodeError) as e:
            return self._bad(400, f"bad dp rank query: {e}")
        request._read_bytes = json.dumps(data).encode()
        return await super()._handle_query_dp_ranks(request)
