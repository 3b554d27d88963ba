"""``Call``: the asyncio future a ``Channel.*_async`` method returns, whose cancel ends only
once kvbridge's engine let go of the call (and so of the caller's memory)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional, TypeVar

from ._errors import Timeout

_T = TypeVar("_T")

logger = logging.getLogger("kvbridge")


class Call(asyncio.Future[_T]):
    """A call running in kvbridge's engine, as an asyncio future of the loop it was made on
    (``Channel``'s ``*_async`` methods make them; nothing else needs to).

    It is awaited as any future is (``await``, ``asyncio.wait_for``, ``asyncio.gather``,
    ``asyncio.ensure_future``, ``asyncio.shield``) and gives the call's value or raises its
    ``kvbridge.KvbridgeError``.

    ``cancel()`` (``Task.cancel`` of a task awaiting it, a ``wait_for`` timeout, a cancelled
    ``gather``) asks the engine to drop the call, and the future turns cancelled only once
    the engine's task let go of it: by then no byte of a cancelled read lands in its
    destinations any more and a cancelled write's sources are not read any more (the
    guarantee of ``Transfer.cancel``). Over UCX, whose posted operations cannot be called
    back, the cancel of a read or write ends the session with the peer, and the future
    turns cancelled once that session's teardown ended (as ``Transfer.cancel`` returns). A
    task awaiting it resumes with ``CancelledError`` only then, so it may reuse its pages in its
    ``except`` clause. The loop goes on meanwhile. Should the engine not let go within
    ``limit`` seconds (the channel's op deadline plus 2 s), the call ends the session with
    the peer, logs a warning and fails with ``kvbridge.Timeout`` naming the peer and the
    step instead of turning cancelled. A call that already ended keeps its outcome
    (``cancel()`` returns False), as any future does.

    A call never awaited runs to its end all the same; its value is dropped without a word,
    and its error, if it failed, is logged by asyncio when the future is collected ("Future
    exception was never retrieved"), as for any future.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        abort: Callable[[], None],
        end: Optional[Callable[[], None]],
        limit: float,
        what: str,
        peer: Optional[str],
        step: str,
    ) -> None:
        super().__init__(loop=loop)
        self._kvb_abort: Optional[Callable[[], None]] = abort
        self._kvb_end = end
        self._kvb_limit = limit
        self._kvb_what = what
        self._kvb_peer = peer
        self._kvb_step = step
        self._kvb_cancel_msg: object = None
        self._kvb_cancelling = False
        self._kvb_let_go = False
        self._kvb_timer: Optional[asyncio.TimerHandle] = None

    def cancel(self, msg: object = None) -> bool:
        if self.done():
            return False
        if self._kvb_let_go:
            # The task ended without an outcome for us (its loop was closing): nothing holds
            # the memory any more.
            return super().cancel(msg)
        if not self._kvb_cancelling:
            self._kvb_cancelling = True
            self._kvb_cancel_msg = msg
            abort = self._kvb_abort
            if abort is not None:
                abort()
            self._kvb_timer = self.get_loop().call_later(self._kvb_limit, self._kvb_expired)
        return True

    def _kvb_wants_outcome(self) -> bool:
        """Whether the engine's outcome is to be set (called on the loop's thread): not once
        a cancel was asked for, which the future ends with."""
        return not self.done() and not self._kvb_cancelling

    def _kvb_released(self) -> None:
        """The engine's task let go of the call (called on the loop's thread, after the
        outcome, if any, was handed over)."""
        self._kvb_let_go = True
        self._kvb_forget()
        if self._kvb_cancelling and not self.done():
            super().cancel(self._kvb_cancel_msg)

    def _kvb_expired(self) -> None:
        self._kvb_timer = None
        if self.done():
            return
        end = self._kvb_end
        message = (
            f"kvbridge: the cancelled {self._kvb_what} was still held by the engine "
            f"{self._kvb_limit:g} s after its cancel (step {self._kvb_step})"
        )
        if end is not None:
            message += f"; ending the session with peer {self._kvb_peer} so that nothing of it lands later"
        logger.warning("%s", message)
        self._kvb_forget()
        if end is not None:
            end()
        self.set_exception(Timeout(message, self._kvb_peer, self._kvb_step))

    def _kvb_forget(self) -> None:
        """Drops what a cancel needed (the abort handle, the channel the session end holds)."""
        self._kvb_abort = None
        self._kvb_end = None
        if self._kvb_timer is not None:
            self._kvb_timer.cancel()
            self._kvb_timer = None
