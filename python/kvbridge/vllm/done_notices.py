"""The "done" notice a decoder rank sends a prefiller rank, and the prefiller rank's count
of them. No I/O: the worker feeds notices in and asks which held requests may be freed.

A notice names the decoder rank, how many decoder ranks this prefiller rank waits for, the
request's grant and the prefiller's request id:
``kvbridge-vllm/3 done <decoder rank> <expected> <grant> <request id>``.

The grant is 128 random bits the prefiller's scheduler draws for each request it holds and
hands out only in that request's ``kv_transfer_params``: a notice proves its sender was
given the request, so a peer that merely holds the deployment's secret cannot free another
request's blocks early (while its decoder may still read them). A prefiller rank frees a
request's blocks once ``expected`` distinct decoder ranks said done under the request's
grant (on success as on failure), or when its lease ends; a notice under another grant is
refused (the worker counts it).

Notices that come before the request is held or its grant is known (its decoder was faster
than the prefiller's step) are kept for one lease, per grant they claim (at most
:data:`MAX_GRANTS` of them per request), at most :data:`MAX_EARLY` requests of them, the
oldest dropped first.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

PREFIX = b"kvbridge-vllm/3 done "

#: Requests with notices and no hold yet that a prefiller rank keeps (each a few hundred
#: bytes): far more than the requests that can be in flight between its step and a
#: decoder's, and a bound on what notices for requests it never held can take.
MAX_EARLY = 65536

#: The most decoder ranks a notice may say a prefiller rank waits for (kvbridge-pd's bound
#: on TP ranks).
MAX_RANKS = 1 << 16

#: Different grants kept for one request before its own is known: the true one and a few
#: forged ones; more forgeries are dropped (the lease still frees the request).
MAX_GRANTS = 4

_GRANT = re.compile(rb"[0-9a-f]{32}")


def is_grant(text: str) -> bool:
    """Whether ``text`` has a grant's form: 32 lowercase hex digits."""
    return isinstance(text, str) and _GRANT.fullmatch(text.encode(errors="replace")) is not None


def encode(decoder_rank: int, expected: int, grant: str, request_id: str) -> bytes:
    return PREFIX + f"{decoder_rank} {expected} {grant} ".encode() + request_id.encode()


@dataclass(frozen=True)
class Notice:
    decoder_rank: int
    expected: int
    grant: str
    request_id: str


def decode(msg: bytes) -> Notice | None:
    """The notice in ``msg``, or None for anything else (a malformed one included)."""
    if not msg.startswith(PREFIX):
        return None
    parts = msg[len(PREFIX) :].split(b" ", 3)
    if len(parts) != 4 or not parts[3] or not all(p.isdigit() and len(p) <= 6 for p in parts[:2]):
        return None
    if _GRANT.fullmatch(parts[2]) is None:
        return None
    rank, expected = int(parts[0]), int(parts[1])
    if rank >= MAX_RANKS or not 0 < expected <= MAX_RANKS:
        return None
    return Notice(rank, expected, parts[2].decode(), parts[3].decode(errors="replace"))


@dataclass
class _Ranks:
    expected: int
    ranks: set[int] = field(default_factory=set)


@dataclass
class _Count:
    until: float
    # per grant claimed: how many ranks it waits for and which said done
    by_grant: dict[str, _Ranks] = field(default_factory=dict)


class DoneCounts:
    """Which decoder ranks said done, per request and grant, on one prefiller rank."""

    def __init__(self, keep_s: float, max_early: int = MAX_EARLY):
        self._keep_s = keep_s
        self._max = max_early
        self._counts: OrderedDict[str, _Count] = OrderedDict()

    def add(self, notice: Notice, now: float) -> None:
        c = self._counts.get(notice.request_id)
        if c is None:
            if len(self._counts) >= self._max:
                self._counts.popitem(last=False)
            c = self._counts[notice.request_id] = _Count(until=now + self._keep_s)
        r = c.by_grant.get(notice.grant)
        if r is None:
            if len(c.by_grant) >= MAX_GRANTS:
                return
            r = c.by_grant[notice.grant] = _Ranks(notice.expected)
        # decoder ranks agree on the count; a disagreeing one waits for the larger
        r.expected = max(r.expected, notice.expected)
        r.ranks.add(notice.decoder_rank)

    def complete(self, request_id: str, grant: str | None) -> bool:
        """Whether every decoder rank said done under ``grant`` (None: the grant is not
        known yet, so no count is complete)."""
        c = self._counts.get(request_id)
        r = c.by_grant.get(grant) if c is not None and grant is not None else None
        return r is not None and len(r.ranks) >= r.expected

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)

    def expire(self, now: float) -> None:
        """Drops the counts kept past one lease (their request was never held here, or its
        lease ended with some decoder ranks silent)."""
        while self._counts:
            req, c = next(iter(self._counts.items()))
            if c.until > now:
                break
            del self._counts[req]

    def __len__(self) -> int:
        return len(self._counts)
