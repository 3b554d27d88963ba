"""Slots of a scratch region a decoder registered once (a load never registers memory):
lease table pages, digest rows. A load takes a slot and gives it back when its reads into
it ended; a slot whose read was given up is never given back, since the read's bytes may
still land there. No I/O here."""

from __future__ import annotations

import queue
import time


class SlotsTaken(Exception):
    """No slot came free by the deadline."""


class ScratchSlots:
    """``count`` slots, any thread may take and give back."""

    def __init__(self, count: int):
        self.count = count
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(count):
            self._free.put(slot)

    def take(self, deadline: float) -> int:
        """A free slot, waiting for one until ``deadline`` (monotonic); ``SlotsTaken`` then."""
        try:
            return self._free.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise SlotsTaken from None

    def give_back(self, slot: int) -> None:
        """``slot``'s reads all ended: another load may use it."""
        self._free.put(slot)

    def free(self) -> int:
        """Slots free now."""
        return self._free.qsize()
