"""The "done" notice a decoder rank sends a prefiller rank, and the prefiller rank's count
of them. No I/O: the worker feeds notices in and asks which held requests may be freed.

A notice names the decoder rank, how many decoder ranks this prefiller rank waits for, and
the prefiller's request id: ``kvbridge-vllm/2 done <decoder rank> <expected> <request id>``.
A prefiller rank frees a request's blocks once ``expected`` distinct decoder ranks said
done (on success as on failure), or when its lease ends. Notices that come before the
request is held (its decoder was faster than the prefiller's step) are kept for one lease,
at most :data:`MAX_EARLY` requests of them, the oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

PREFIX = b"kvbridge-vllm/2 done "

#: Requests with notices and no hold yet that a prefiller rank keeps (each a few hundred
#: bytes): far more than the requests that can be in flight between its step and a
#: decoder's, and a bound on what notices for requests it never held can take.
MAX_EARLY = 65536

#: The most decoder ranks a notice may say a prefiller rank waits for (kvbridge-pd's bound
#: on TP ranks).
MAX_RANKS = 1 << 16


def encode(decoder_rank: int, expected: int, request_id: str) -> bytes:
    return PREFIX + f"{decoder_rank} {expected} ".encode() + request_id.encode()


@dataclass(frozen=True)
class Notice:
    decoder_rank: int
    expected: int
    request_id: str


def decode(msg: bytes) -> Notice | None:
    """The notice in ``msg``, or None for anything else (a malformed one included)."""
    if not msg.startswith(PREFIX):
        return None
    parts = msg[len(PREFIX) :].split(b" ", 2)
    if len(parts) != 3 or not parts[2] or not all(p.isdigit() and len(p) <= 6 for p in parts[:2]):
        return None
    rank, expected = int(parts[0]), int(parts[1])
    if rank >= MAX_RANKS or not 0 < expected <= MAX_RANKS:
        return None
    return Notice(rank, expected, parts[2].decode(errors="replace"))


@dataclass
class _Count:
    expected: int
    ranks: set[int] = field(default_factory=set)
    until: float = 0.0


class DoneCounts:
    """Which decoder ranks said done, per request, on one prefiller rank."""

    def __init__(self, keep_s: float, max_early: int = MAX_EARLY):
        self._keep_s = keep_s
        self._max = max_early
        self._counts: OrderedDict[str, _Count] = OrderedDict()

    def add(self, notice: Notice, now: float) -> None:
        c = self._counts.get(notice.request_id)
        if c is None:
            if len(self._counts) >= self._max:
                self._counts.popitem(last=False)
            c = self._counts[notice.request_id] = _Count(notice.expected, until=now + self._keep_s)
        # decoder ranks agree on the count; a disagreeing one waits for the larger
        c.expected = max(c.expected, notice.expected)
        c.ranks.add(notice.decoder_rank)

    def complete(self, request_id: str) -> bool:
        c = self._counts.get(request_id)
        return c is not None and len(c.ranks) >= c.expected

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
