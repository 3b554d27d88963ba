"""Which prefill rank a decode rank believes in: the signature of a prefill rank's bootstrap
registration, and the decode's check of what the bootstrap server says about the rank
(``KVBRIDGE_SGLANG_REQUIRE_BOUND_PREFILL``; docs/sglang.md, *Identities*).

A prefill rank signs its registration (HMAC-SHA256 over the canonical JSON, everything but
``kvbridge_sig``) with its own key (``KVBRIDGE_PEER_KEY``), else the shared secret. The
bootstrap server forwards the signed registration with each lookup; a decode that requires
bound prefills checks, before it registers with the rank or opens a page to it:

1. the rank's kvbridge id is bound in its keyring (``KVBRIDGE_PEER_KEYS``), step ``keyring``;
2. the registration is signed with the key bound to that id, and names the id, the kvbridge
   address, the ZMQ address and port that the lookup answered, the rank the decode asked for,
   and the topology the server announced, step ``bootstrap``.

So an answer changed on the plain-HTTP path, or a registration made by a holder of the
shared secret (or of another prefill server's key), is refused with
``kvbridge.Unauthenticated`` naming the id and the step. What it does not stop: a replay of
an earlier registration of the same rank signed with the same key (a key per start makes an
old one useless), and anything done by a holder of the prefill's own key.

The keyring is read as the engine reads it (``Keyring::parse``): one ``peer-id key`` line per
peer, blank lines and lines starting with ``#`` skipped, the key the rest of the line, trimmed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Dict, Mapping, Optional, Tuple, Union

import kvbridge

from .config import REQUIRE_BOUND_ENV, ConfigError

#: The field of a lookup's answer that carries the rank's signed registration.
SIGNED_FIELD = "kvbridge_registration"
#: The fields of a lookup's answer that the decode uses, each vouched for by the signature.
VOUCHED_FIELDS = ("kvbridge_peer", "kvbridge_addr", "rank_ip", "rank_port")
_TOPOLOGY_FIELDS = ("attn_tp_size", "attn_cp_size", "pp_size", "page_size")
_MAX_KEYRING = 1 << 20

Rank = Tuple[int, int, int, int]  # (dp, cp, tp, pp), as SGLang's lookup asks


def _canonical(payload: Mapping[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in payload.items() if k != "kvbridge_sig"}, sort_keys=True).encode()


def sign(key: Union[str, bytes, None], payload: Mapping[str, Any]) -> str:
    """The signature of a registration with ``key`` (``""`` without one)."""
    if not key:
        return ""
    raw = key.encode() if isinstance(key, str) else key
    return hmac.new(raw, _canonical(payload), hashlib.sha256).hexdigest()


def signed_by(key: Union[str, bytes, None], payload: Mapping[str, Any]) -> bool:
    sig = payload.get("kvbridge_sig")
    return bool(key) and isinstance(sig, str) and hmac.compare_digest(sig, sign(key, payload))


def load_keyring(path: Optional[str]) -> Dict[str, bytes]:
    """The keyring at ``path`` (``KVBRIDGE_PEER_KEYS``): peer id -> key bytes. ``ConfigError``
    naming the variables when it is unset, unreadable or malformed."""
    if not path:
        raise ConfigError(
            f"{REQUIRE_BOUND_ENV}=1 needs KVBRIDGE_PEER_KEYS, the keyring binding each prefill "
            "rank's id to its key (docs/sglang.md, Identities)"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_KEYRING + 1)
        if len(raw) > _MAX_KEYRING:
            raise ValueError(f"more than {_MAX_KEYRING} bytes")
        text = raw.decode()
    except (OSError, ValueError) as e:
        raise ConfigError(f"KVBRIDGE_PEER_KEYS={path!r}: {e}") from None
    ring: Dict[str, bytes] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) != 2:
            raise ConfigError(f"KVBRIDGE_PEER_KEYS={path!r}: line {n}: expected `peer-id key`")
        ring[parts[0]] = parts[1].strip().encode()
    if not ring:
        raise ConfigError(f"KVBRIDGE_PEER_KEYS={path!r} binds no id, and {REQUIRE_BOUND_ENV}=1 would refuse every prefill")
    return ring


def _signed_rank(reg: Mapping[str, Any]) -> Tuple[Any, ...]:
    dp = reg.get("attn_dp_rank") if reg.get("system_dp_size") == 1 else reg.get("system_dp_rank")
    return (dp, reg.get("attn_cp_rank"), reg.get("attn_tp_rank"), reg.get("pp_rank"))


def check_lookup(
    info: Mapping[str, Any],
    ring: Mapping[str, bytes],
    rank: Rank,
    bootstrap_addr: str,
    topology: Optional[Any] = None,
) -> str:
    """The prefill id of a lookup's answer ``info`` for ``rank``, once vouched for; raises
    ``kvbridge.Unauthenticated`` (step ``keyring`` or ``bootstrap``) naming it otherwise.
    ``topology``: what the server's parallel-info answer announced (SGLang's
    ``PrefillServerInfo``), which the registration must match."""
    where = f"prefill rank (dp {rank[0]}, cp {rank[1]}, tp {rank[2]}, pp {rank[3]}) of bootstrap {bootstrap_addr}"
    peer = info.get("kvbridge_peer")
    if not isinstance(peer, str) or peer not in ring:
        raise kvbridge.Unauthenticated(
            f"the {where} is {str(peer)[:300]!r}, an id not bound in KVBRIDGE_PEER_KEYS, and "
            f"{REQUIRE_BOUND_ENV}=1 takes KV only from bound prefill ids",
            peer=peer if isinstance(peer, str) else None,
            step="keyring",
        )

    def refuse(why: str) -> kvbridge.Unauthenticated:
        return kvbridge.Unauthenticated(f"the {where}, {peer}: {why}"[:1000], peer=peer, step="bootstrap")

    reg = info.get(SIGNED_FIELD)
    if not isinstance(reg, dict):
        raise refuse("the bootstrap server forwarded no signed registration (a prefill server without this check?)")
    if not signed_by(ring[peer], reg):
        raise refuse("its registration is not signed with the key KVBRIDGE_PEER_KEYS binds to the id")
    for field in VOUCHED_FIELDS:
        if reg.get(field) != info.get(field):
            raise refuse(f"the lookup says {field} {info.get(field)!r}, the signed registration {reg.get(field)!r}")
    if _signed_rank(reg) != tuple(rank):
        raise refuse(f"the signed registration is of rank (dp, cp, tp, pp) {_signed_rank(reg)}, not the one asked for")
    for field in _TOPOLOGY_FIELDS:
        announced = getattr(topology, field, None)
        if announced is not None and reg.get(field) != announced:
            raise refuse(f"the server announced {field} {announced!r}, the signed registration says {reg.get(field)!r}")
    return peer

