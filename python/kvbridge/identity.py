"""The kvbridge peer id an integration's channel goes by (the LMCache channel, the SGLang
backend): random per start, unless the operator names it, so that a listener's keyring
(``KVBRIDGE_PEER_KEYS``: lines ``peer-id key``) can bind it to a key, which this side holds
as ``KVBRIDGE_PEER_KEY`` (the engine proves it when dialing a listener that binds the id).

``KVBRIDGE_PEER_ID`` is a template, since every TP rank of an engine is a process of its
own with the same environment: ``{role}`` (the integration's role: ``sender``/``receiver``
for LMCache, ``prefill``/``decode`` for SGLang) and ``{tp_rank}`` (or its alias ``{rank}``)
are filled in, and the rank must appear (two ranks with one id would replace each other's
sessions at every peer). E.g. ``KVBRIDGE_PEER_ID=prefill-a-{role}-tp{tp_rank}``. The id must
be what ``PeerId::new`` takes (1 to 256 bytes) and what a keyring line can name (no
whitespace, not starting with ``#``); anything else is a ``ValueError`` naming the variable.

A random id cannot be in any keyring: whoever holds the shared secret and learns it can
claim it. When ``KVBRIDGE_PEER_KEYS`` is set (the deployment binds ids to keys) and this
side's id is random, that is logged once per process; ``KVBRIDGE_PEER_KEY`` with a random id
(a key no keyring can list it under) is a ``ValueError`` naming both variables.
"""

from __future__ import annotations

import logging
import os
import string
from typing import Optional

logger = logging.getLogger(__name__)

#: The template of this side's kvbridge peer id.
PEER_ID_ENV = "KVBRIDGE_PEER_ID"
#: The listener's keyring file (read by the engine; here only to warn about random ids).
PEER_KEYS_ENV = "KVBRIDGE_PEER_KEYS"
#: This side's own key (read by the engine; here only to refuse it with a random id).
PEER_KEY_ENV = "KVBRIDGE_PEER_KEY"
#: ``PeerId::new``'s limit, in bytes.
MAX_PEER_ID_LEN = 256
_RANK_FIELDS = ("tp_rank", "rank")
_FIELDS = ("role",) + _RANK_FIELDS

_random_logged = False


def _fields(template: str, source: str) -> set[str]:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{source}={template!r}: {e} (write a literal brace as {{{{ or }}}})") from None
    names = {name for _, name, _, _ in parsed if name is not None}
    bad = sorted(n for n in names if n not in _FIELDS)
    if bad:
        raise ValueError(
            f"{source}={template!r}: unknown placeholder(s) {bad}; the template may use "
            f"{{role}}, {{tp_rank}} (or {{rank}})"
        )
    if not names & set(_RANK_FIELDS):
        raise ValueError(
            f"{source}={template!r} names no rank: add {{tp_rank}} (every TP rank is a process of "
            "its own with this environment, and two ranks with one id would replace each other's "
            "sessions)"
        )
    return names


def check_peer_id(peer_id: str, source: str) -> str:
    """``peer_id`` if a channel and a keyring line both take it; else ``ValueError``."""
    size = len(peer_id.encode())
    if not 0 < size <= MAX_PEER_ID_LEN:
        raise ValueError(f"{source}: peer id {peer_id!r} is {size} bytes; 1 to {MAX_PEER_ID_LEN} are allowed")
    if any(c.isspace() for c in peer_id) or peer_id.startswith("#"):
        raise ValueError(
            f"{source}: peer id {peer_id!r} cannot be named in a keyring (KVBRIDGE_PEER_KEYS lines "
            "are `peer-id key`: no whitespace in the id, and a line starting with # is a comment)"
        )
    return peer_id


def peer_id(random_id: str, *, role: str, rank: int, template: Optional[str] = None) -> str:
    """This side's kvbridge peer id: ``template`` (else ``KVBRIDGE_PEER_ID``) with ``role``
    and ``rank`` filled in, checked; ``random_id`` when neither is set."""
    source = "peer_id" if template is not None else PEER_ID_ENV
    if template is None:
        template = os.environ.get(PEER_ID_ENV) or None
    if template is None:
        if os.environ.get(PEER_KEY_ENV):
            raise ValueError(
                f"{PEER_KEY_ENV} is set but {PEER_ID_ENV} is not: this side's peer id is random "
                f"({random_id}), so no keyring can list the key under it; set {PEER_ID_ENV} "
                "(e.g. 'prefill-a-{role}-tp{tp_rank}') to the id the listeners' keyrings name"
            )
        _note_random(random_id)
        return random_id
    _fields(template, source)
    try:
        chosen = template.format(role=role, tp_rank=rank, rank=rank)
    except (ValueError, IndexError, KeyError, AttributeError) as e:
        raise ValueError(f"{source}={template!r}: {type(e).__name__}: {e}") from None
    return check_peer_id(chosen, f"{source}={template!r}")


def _note_random(random_id: str) -> None:
    global _random_logged
    if _random_logged or not os.environ.get(PEER_KEYS_ENV):
        return
    _random_logged = True
    logger.warning(
        "kvbridge: %s is set but this side's peer id %s is random (%s unset): no keyring can hold "
        "it, so it proves itself with the shared secret, and any holder of that secret who learns "
        "it can claim it. Set %s (e.g. 'prefill-a-{role}-tp{tp_rank}') and give the id a key "
        "(docs/threat-model.md, Per-peer keys)",
        PEER_KEYS_ENV, random_id, PEER_ID_ENV, PEER_ID_ENV,
    )  # fmt: skip
