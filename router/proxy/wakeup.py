"""The one-shot wake-up a protocol's single waiting coroutine sleeps on.

The edge server's connection task waits for the next request and for the client to drain; the
upstream client's response waits for the next bytes.  Each time: a transport callback wakes one
coroutine.  `arm()` returns a fresh future to await; `set()` or `fail()` resolve the armed one,
and do nothing when there is none or it is already resolved (e.g. cancelled with its task).
"""

from __future__ import annotations

import asyncio

__all__ = ["Wakeup"]


class Wakeup:
    __slots__ = ("_future", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._future: asyncio.Future[None] | None = None

    def arm(self) -> asyncio.Future[None]:
        """A fresh future for the waiter to await (a plain future, not a coroutine: this runs
        for every request)."""
        future = self._future = self._loop.create_future()
        return future

    def set(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    def fail(self, exc: BaseException) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_exception(exc)
