"""An asyncio loop on a thread of its own for the decoder's "done" notices: each notice its
own task, bounded by the channel's deadlines, so a notice to a prefiller that is gone never
waits ahead of notices to live ones."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from .cores import run_on


class NoticeLoop:
    """An asyncio loop on a thread of its own, started on first use, where notices run
    side by side (each bounded by the channel's deadlines)."""

    def __init__(self, cores: set[int]) -> None:
        self._cores = cores
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, coro) -> None:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self._run, args=(self._loop,), name="kvbridge-notices", daemon=True
                )
                self._thread.start()
            loop = self._loop
        asyncio.run_coroutine_threadsafe(coro, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        run_on(self._cores)
        loop.run_forever()

    def stop(self) -> None:
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return

        async def cancel_pending() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_pending(), loop).result(5.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        if not thread.is_alive():
            loop.close()
