"""The read windows a held request's grant opens on a prefiller rank's KV cache
(``kvbridge_read_grants``, off by default).

With it on, a prefiller rank registers its KV layers (and its digest rows, digests.py) with
reads confined to windows, and without direct copies: every read of them goes over TCP,
where this process checks it. When its worker learns that a request is held (its grant from
the scheduler's ``grants``, its blocks from ``hold_blocks``), it opens one window per run of
adjacent blocks on every such region, to the grant's token, *before* it marks the request
held in the lease table (lease_table.py); a decoder's reads name the token (the grant it got
in ``kv_transfer_params``). A peer that holds the deployment's secret but not the request's
grant reads none of its blocks; the grantee reads only that request's blocks. A refused
read fails with ``AccessDenied``, is counted (``Channel.stats()['access_denied']``) and
does not end the reader's session. When the request is freed its windows close before its
blocks go back to vLLM, and the close waits (briefly) for reads already admitted through
them; the lease table still covers a read that outlives that wait.

Digest rows are windowed too: they are unkeyed digests of the KV, so a peer that can
compute a guessed prompt's KV (it has the model) could confirm the guess from them.

Same-host transports: a process of the same user can read another's memory whatever this
module does (cross-memory attach, ``/proc/<pid>/mem``); a deployment that does not trust its
workers runs them as different users, or on different hosts, and turns same-host transports
off (docs/threat-model.md).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: Seconds a closing grant waits for reads already admitted through its windows. They
#: were admitted before the request's end, so they finish in about a read's time; one that
#: does not is caught by the decoder's lease check.
CLOSE_WAIT_S = 2.0


def runs(blocks: list[int]) -> list[tuple[int, int]]:
    """``(first, count)`` of each run of adjacent block ids, ascending, duplicates merged."""
    out: list[tuple[int, int]] = []
    for b in sorted(set(blocks)):
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


class ReadGrants:
    """The open grants of one prefiller rank. One owner: the worker thread."""

    def __init__(self, channel: Any, regions: list[tuple[int, int]], blocks: int):
        # (region id, bytes per block) of each distinct confined region; blocks in the cache
        self._channel = channel
        self._regions = regions
        self._blocks = blocks
        self._open: dict[str, bytes] = {}

    def open(self, request_id: str, token_hex: str, blocks: list[int]) -> None:
        """Opens the request's blocks to its grant (once; again is a no-op). Raises
        ``ValueError`` (a grant or blocks the scheduler should never send) or
        ``kvbridge.KvbridgeError``; nothing stays open then."""
        if request_id in self._open:
            return
        token = bytes.fromhex(token_hex)
        if len(token) != 16:
            raise ValueError(f"a grant of {len(token)} bytes")
        spans = runs(blocks)
        if spans and not (spans[0][0] >= 0 and spans[-1][0] + spans[-1][1] <= self._blocks):
            raise ValueError(f"blocks {spans[0][0]}..{spans[-1][0] + spans[-1][1] - 1} outside {self._blocks}")
        self._open[request_id] = token
        try:
            for region, page in self._regions:
                for first, count in spans:
                    self._channel.open_window(region, first * page, count * page, token=token, access="read")
        except BaseException:
            self.close(request_id)
            raise

    def close(self, request_id: str) -> None:
        """Closes the request's windows and waits for reads admitted through them (at most
        :data:`CLOSE_WAIT_S`); no-op for a request without windows."""
        token = self._open.pop(request_id, None)
        if token is None:
            return
        try:
            self._channel.close_token(token, timeout=CLOSE_WAIT_S)
        except TimeoutError:
            log.warning(
                "kvbridge: reads of request %s still in flight %.0f s after its grant closed; "
                "the decoder's lease check fails them", request_id, CLOSE_WAIT_S,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the channel closed: nothing can read any more
            log.debug("kvbridge: closing the grant of %s: %s", request_id, e)

    def __len__(self) -> int:
        return len(self._open)
