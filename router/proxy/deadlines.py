"""The timeouts of attempts in flight, kept in a coarse timing wheel swept by one task.

Why not one timer per attempt (`asyncio.timeout_at`, or a bare `loop.call_at`): arming and
cancelling a TimerHandle for every request cost more than the rest of its timeout handling,
and the timeouts are seconds to minutes long, so a resolution of `resolution_s` (50 ms) is
plenty.  Adding and removing a deadline is a set operation; each tick visits only the slots
whose time has come.

A `Deadline` fires by cancelling its task; the attempt tells that CancelledError from a real
cancellation (client gone, shutdown) with `timed_out`, as `asyncio.timeout` does.  It also
carries a stream's idle timeout: the attempt stamps `waiting_since` while it waits on the
replica, and the deadline fires when one wait has lasted `idle_s` — checked lazily, when its
slot comes up, never per chunk.
"""

from __future__ import annotations

import asyncio
import math

from router.tasks import stop_task

__all__ = ["Deadline", "Deadlines"]


class Deadline:
    """The timeout of one attempt: `kind` names the one that applies now."""

    __slots__ = ("_slot", "fired", "idle_s", "kind", "task", "waiting_since", "when")

    def __init__(self, task: asyncio.Task[object], when: float, kind: str) -> None:
        self.task = task
        self.when = when
        self.kind = kind
        self.idle_s: float | None = None
        self.waiting_since: float | None = None
        self.fired = False
        self._slot = 0

    def due(self, now: float) -> float:
        """When the deadline must next be looked at: its time, or sooner where a wait (going
        on, or starting any moment) could last `idle_s`."""
        if self.idle_s is None:
            return self.when
        since = self.waiting_since
        return min(self.when, (now if since is None else since) + self.idle_s)

    def expired(self, now: float) -> str | None:
        """The kind of timeout that has passed at `now`, if one has."""
        since = self.waiting_since
        if self.idle_s is not None and since is not None and now - since >= self.idle_s:
            return "timeout_idle"
        return self.kind if now >= self.when else None

    def fire(self, kind: str) -> None:
        self.kind = kind
        self.fired = True
        self.task.cancel()

    def timed_out(self) -> bool:
        """After a CancelledError: it is this deadline's (and nobody else's) doing."""
        return self.fired and self.task.uncancel() == 0


class Deadlines:
    """All deadlines of one proxy.  `start` the sweeping task; `stop` it at shutdown."""

    def __init__(self, resolution_s: float = 0.05) -> None:
        self._resolution_s = resolution_s
        self._slots: dict[int, set[Deadline]] = {}
        self._armed = asyncio.Event()  # set when the wheel holds something: an idle gateway
        # does not tick at all
        self._swept = 0  # slots up to this one have been visited
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._swept = self._slot_of(self._loop.time())
        self._task = self._loop.create_task(self._run(), name="proxy-deadlines")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    def arm(self, when: float, kind: str) -> Deadline:
        """A deadline for the current task."""
        task = asyncio.current_task(self._loop)
        assert task is not None
        deadline = Deadline(task, when, kind)
        self._add(deadline, self._now())
        return deadline

    def move(self, deadline: Deadline, when: float, kind: str, idle_s: float | None) -> None:
        """Change what `deadline` bounds (e.g. from first byte to total, with an idle limit)."""
        self.disarm(deadline)
        deadline.when, deadline.kind, deadline.idle_s = when, kind, idle_s
        self._add(deadline, self._now())

    def disarm(self, deadline: Deadline) -> None:
        key = deadline._slot
        slot = self._slots.get(key)
        if slot is not None:
            slot.discard(deadline)
            if not slot:
                del self._slots[key]

    def _slot_of(self, when: float) -> int:
        return math.ceil(when / self._resolution_s)

    def _now(self) -> float:
        assert self._loop is not None, "Deadlines.start() first"
        return self._loop.time()

    def _add(self, deadline: Deadline, now: float) -> None:
        # Never into a slot already swept: it would be missed.
        # A time already past goes into the next slot to sweep.
        key = deadline._slot = max(self._slot_of(max(deadline.due(now), now)), self._swept + 1)
        slot = self._slots.get(key)
        if slot is None:
            if not self._slots:
                self._armed.set()
            slot = self._slots[key] = set()
        slot.add(deadline)

    async def _run(self) -> None:
        assert self._loop is not None
        while True:
            if not self._slots:
                self._armed.clear()
                await self._armed.wait()
                # Skip the empty slots of the idle time (never one in the future, nor one with
                # something in it).
                first = min(self._slots, default=self._swept + 1)
                now_slot = self._slot_of(self._loop.time())
                self._swept = max(self._swept, min(first, now_slot) - 1)
            await asyncio.sleep(self._resolution_s)
            self.sweep(self._loop.time())

    def sweep(self, now: float) -> None:
        """Fire what has expired by `now`; look again later at what has not (idle waits)."""
        current = self._slot_of(now)
        for key in range(self._swept + 1, current + 1):
            slot = self._slots.pop(key, None)
            if not slot:
                continue
            for deadline in slot:
                kind = deadline.expired(now)
                if kind is not None:
                    deadline.fire(kind)
                else:
                    self._swept = key  # re-added beyond this slot
                    self._add(deadline, now)
        self._swept = max(self._swept, current)
