"""The prefiller's table of held requests, which a decoder reads after its blocks.

A prefiller frees a finished request's blocks when the decoder says it has read them, or
when the request's lease ends (``kvbridge_lease_s``) without that notice. A decoder whose
read starts after the lease ended would read blocks that vLLM may already have given to
another request: the bytes arrive, the load looks fine, and the decode runs on another
prompt's KV. No transport can stop such a read in flight (over cross-memory attach and
shared memory the decoder copies the memory itself), so the decoder checks afterwards.

The prefiller marks every request it holds in this table, a small region its peers can
read, and marks it ended *before* it hands the blocks back to vLLM. A decoder reads its
blocks first and the table second: if the table still shows the request held, no block
had been handed back when the blocks were read, so they were the request's; if it shows
the request ended, the load fails (``lease_ended``) and vLLM's ``kv_load_failure_policy``
applies. A request the table does not show yet (the prefiller learns of its finished
requests one engine step after they finish) is read again until the load's deadline.

Layout: ``GROUPS`` groups of ``GROUP_SLOTS`` little-endian u64 slots; one group per page,
so a decoder's check is one read of one page. A request lives in the group its tag picks:
``tag`` while held, ``tag & ~1`` once ended (a tombstone), 0 in a slot never used. A new
request takes an empty slot of its group, else the slot of an ended one; with every slot
of its group held (``GROUP_SLOTS`` held requests of one group, out of ``GROUPS``), it is
not marked and its decoder's load fails at its deadline, never reads freed blocks.

No I/O here: the worker registers :attr:`LeaseTable.memory` and calls
:meth:`LeaseTable.hold` and :meth:`LeaseTable.end`; a decoder calls :func:`where` and
:func:`state` on the page it read.
"""

from __future__ import annotations

import enum
import hashlib
import struct

GROUP_SLOTS = 16
GROUPS = 4096
SLOT_BYTES = 8
PAGE_BYTES = GROUP_SLOTS * SLOT_BYTES
TABLE_BYTES = GROUPS * PAGE_BYTES

_SLOT = struct.Struct("<Q")
_PAGE = struct.Struct(f"<{GROUP_SLOTS}Q")


class LeaseState(enum.Enum):
    """What a decoder reads of a request in the table."""

    #: the prefiller still holds the request's blocks
    HELD = "held"
    #: its lease ended or it was freed: the blocks may belong to another request now
    ENDED = "ended"
    #: not in the table (not marked yet; or its slot was taken since it ended)
    UNKNOWN = "unknown"


def tag(request_id: str) -> int:
    """The request's 64-bit tag: its two low bits set, so neither it nor its tombstone
    (``tag & ~1``) is ever 0, an empty slot."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 3


def where(request_id: str) -> int:
    """The group (page index) where ``request_id`` lives."""
    return (tag(request_id) >> 2) % GROUPS


def state(request_id: str, page: bytes) -> LeaseState:
    """The request's state in a page read from a prefiller's table (the page of
    :func:`where`)."""
    if len(page) != PAGE_BYTES:
        raise ValueError(f"a lease table page is {PAGE_BYTES} bytes, not {len(page)}")
    t = tag(request_id)
    slots = _PAGE.unpack(page)
    if t in slots:
        return LeaseState.HELD
    if t & ~1 in slots:
        return LeaseState.ENDED
    return LeaseState.UNKNOWN


class LeaseTable:
    """The prefiller's side. One owner: the worker thread that runs vLLM's steps."""

    def __init__(self) -> None:
        self.memory = bytearray(TABLE_BYTES)
        # request id -> byte offset of its slot, while held
        self._held: dict[str, int] = {}

    def hold(self, request_id: str) -> bool:
        """Marks the request held; False when every slot of its group is held (the request
        stays unmarked, so no decoder can take its blocks for read)."""
        if request_id in self._held:
            return True
        t = tag(request_id)
        base = where(request_id) * PAGE_BYTES
        slots = _PAGE.unpack_from(self.memory, base)
        free = [i for i, v in enumerate(slots) if v == 0] or [i for i, v in enumerate(slots) if v & 1 == 0]
        if not free:
            return False
        off = base + free[0] * SLOT_BYTES
        _SLOT.pack_into(self.memory, off, t)
        self._held[request_id] = off
        return True

    def end(self, request_id: str) -> None:
        """Marks the request ended; call before its blocks go back to vLLM. A request that
        was never held gets a tombstone too (when its group has room), so a decoder still
        reading it learns at once that its blocks are gone."""
        off = self._held.pop(request_id, None)
        t = tag(request_id)
        if off is not None:
            _SLOT.pack_into(self.memory, off, t & ~1)
            return
        base = where(request_id) * PAGE_BYTES
        slots = _PAGE.unpack_from(self.memory, base)
        if t & ~1 in slots:
            return
        free = [i for i, v in enumerate(slots) if v == 0] or [i for i, v in enumerate(slots) if v & 1 == 0]
        if free:
            _SLOT.pack_into(self.memory, base + free[0] * SLOT_BYTES, t & ~1)

    def held(self) -> int:
        return len(self._held)
