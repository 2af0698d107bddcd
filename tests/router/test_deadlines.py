"""The proxy's timing wheel of attempt deadlines (router.proxy.deadlines), on real event loops.

The deadlines fire by cancelling their task; the tests below drive them the way
`Proxy._attempt` does (arm, move with an idle limit, `waiting_since` stamped around each read,
disarm in `finally`, `timed_out()` after the CancelledError).  Timing assertions are about
order and generous bounds ("not before its time", "within 1 s of it"), never exact instants.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest

from router.proxy.deadlines import Deadline, Deadlines

RESOLUTION_S = 0.01
LATE_S = 1.0  # how late a deadline may fire on a noisy machine
FAR_S = 60.0  # a deadline that must never come up during a test


@pytest.fixture
async def deadlines() -> AsyncIterator[Deadlines]:
    wheel = Deadlines(resolution_s=RESOLUTION_S)
    wheel.start()
    try:
        yield wheel
    finally:
        await wheel.stop()


@dataclass
class Outcome:
    """What an attempt-like task saw when its CancelledError came (if it came)."""

    cancelled_at: float | None = None
    timed_out: bool | None = None
    kind: str | None = None
    finished: bool = False


class Attempt:
    """An attempt-like body: `steps` arms a deadline (storing it as `.deadline` before its first
    await) and waits the way `Proxy._attempt` does."""

    deadline: Deadline | None = None

    def __init__(self, steps: Callable[[Attempt, Outcome], Awaitable[None]]) -> None:
        self.steps = steps


def start(
    steps: Callable[[Attempt, Outcome], Awaitable[None]],
) -> tuple[asyncio.Task[None], Outcome, Attempt]:
    """Run `steps` in a task of its own, as `Proxy._attempt` would: on CancelledError, record
    `timed_out()` and the kind, swallow it if it was the deadline's, re-raise it otherwise."""
    body, outcome = Attempt(steps), Outcome()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        try:
            await body.steps(body, outcome)
        except asyncio.CancelledError:
            outcome.cancelled_at = loop.time()
            assert body.deadline is not None
            outcome.timed_out = body.deadline.timed_out()
            outcome.kind = body.deadline.kind
            if not outcome.timed_out:
                raise
        else:
            outcome.finished = True

    return asyncio.get_running_loop().create_task(run()), outcome, body


async def test_deadline_cancels_a_waiting_task_not_before_its_time(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    when = loop.time() + 0.1

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(when, "timeout_first_byte")
        try:
            await asyncio.sleep(30)
        finally:
            deadlines.disarm(me.deadline)

    task, outcome, _ = start(steps)
    await asyncio.wait_for(task, timeout=10)

    assert not outcome.finished
    assert outcome.timed_out is True
    assert outcome.kind == "timeout_first_byte"
    assert outcome.cancelled_at is not None
    assert when <= outcome.cancelled_at <= when + LATE_S
    # The deadline's cancellation was consumed: the task is not left cancelling.
    assert not task.cancelled()
    assert task.cancelling() == 0


async def test_disarmed_deadline_never_fires(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    when = loop.time() + 0.3

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(when, "timeout_total")
        await asyncio.sleep(0.01)
        assert loop.time() < when, "machine too slow: disarmed after the deadline"
        deadlines.disarm(me.deadline)
        # Well past the time, by many resolutions.
        await asyncio.sleep(when - loop.time() + 20 * RESOLUTION_S)

    task, outcome, body = start(steps)
    await asyncio.wait_for(task, timeout=10)

    assert outcome.finished
    assert outcome.cancelled_at is None
    assert body.deadline is not None and not body.deadline.fired
    assert loop.time() > when


async def test_move_to_a_later_total_deadline(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    now = loop.time()
    first_byte, total = now + 0.1, now + 0.35

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(first_byte, "timeout_first_byte")
        await asyncio.sleep(0)
        deadlines.move(me.deadline, total, "timeout_total", None)
        try:
            await asyncio.sleep(30)
        finally:
            deadlines.disarm(me.deadline)

    task, outcome, _ = start(steps)
    await asyncio.wait_for(task, timeout=10)

    assert outcome.timed_out is True
    assert outcome.kind == "timeout_total"
    assert outcome.cancelled_at is not None
    # Nothing at the old time: the first firing came at (or after) the new one.
    assert total <= outcome.cancelled_at <= total + LATE_S


async def test_move_to_an_earlier_deadline(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    now = loop.time()
    sooner = now + 0.1

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(now + FAR_S, "timeout_total")
        deadlines.move(me.deadline, sooner, "timeout_first_byte", None)
        await asyncio.sleep(30)

    task, outcome, _ = start(steps)
    await asyncio.wait_for(task, timeout=10)

    assert outcome.timed_out is True
    assert outcome.kind == "timeout_first_byte"
    assert outcome.cancelled_at is not None
    assert sooner <= outcome.cancelled_at <= sooner + LATE_S


# The idle limit, and the short waits under it.  The margins are wide (waits a tenth of the
# limit) so a stalled loop on a noisy machine does not turn a short wait into an idle one.
IDLE_S = 0.2
SHORT_WAIT_S = 0.02
SHORT_WAITS = 20  # 0.4 s of waiting in all: twice the idle limit
SLOW_WRITE_S = 0.5  # time not waiting on the replica: more than twice the idle limit


async def test_idle_counts_one_wait_only_and_fires_as_timeout_idle(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    total = loop.time() + FAR_S
    marks: dict[str, float] = {}

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadline = deadlines.arm(loop.time() + FAR_S / 2, "timeout_first_byte")
        try:
            await asyncio.sleep(0)  # the first byte
            deadlines.move(deadline, total, "timeout_total", IDLE_S)
            started = loop.time()
            for _ in range(SHORT_WAITS):  # chunks that come quicker than the idle limit
                deadline.waiting_since = loop.time()
                await asyncio.sleep(SHORT_WAIT_S)
                deadline.waiting_since = None
            marks["short_waits"] = loop.time() - started
            # A slow client: time spent writing, not waiting on the replica.
            started = loop.time()
            await asyncio.sleep(SLOW_WRITE_S)
            marks["slow_write"] = loop.time() - started
            # Then the replica stalls.
            deadline.waiting_since = marks["stall"] = loop.time()
            await asyncio.sleep(30)
            deadline.waiting_since = None
        finally:
            deadlines.disarm(deadline)

    task, outcome, _ = start(steps)
    await asyncio.wait_for(task, timeout=10)

    # Several idle periods went by in short waits and in the write without a firing...
    assert marks["short_waits"] >= 1.5 * IDLE_S
    assert marks["slow_write"] >= 2 * IDLE_S
    # ...and the one long wait fired, as an idle timeout, not before the limit.
    assert outcome.timed_out is True
    assert outcome.kind == "timeout_idle"
    assert outcome.cancelled_at is not None
    assert marks["stall"] + IDLE_S <= outcome.cancelled_at <= marks["stall"] + IDLE_S + LATE_S


async def test_idle_never_counts_time_not_waiting(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadline = deadlines.arm(loop.time() + FAR_S, "timeout_first_byte")
        deadlines.move(deadline, loop.time() + FAR_S, "timeout_total", IDLE_S)
        # Long stretches with nothing awaited from the replica, then a short wait each.
        for _ in range(2):
            await asyncio.sleep(SLOW_WRITE_S / 2)  # > idle_s, but not waiting
            deadline.waiting_since = loop.time()
            await asyncio.sleep(SHORT_WAIT_S)
            deadline.waiting_since = None
        deadlines.disarm(deadline)

    task, outcome, body = start(steps)
    await asyncio.wait_for(task, timeout=10)

    assert outcome.finished
    assert outcome.cancelled_at is None
    assert body.deadline is not None and not body.deadline.fired


async def test_external_cancel_while_the_deadline_fired_propagates(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    when = loop.time() + FAR_S
    armed = asyncio.Event()

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(when, "timeout_total")
        armed.set()
        try:
            await asyncio.sleep(2 * FAR_S)
        finally:
            deadlines.disarm(me.deadline)

    task, outcome, body = start(steps)
    await armed.wait()
    # Both before the task runs again: the client goes away and the deadline comes up (a
    # synthetic sweep time stands for the deadline's time having come).
    task.cancel()
    deadlines.sweep(when + 1)
    assert body.deadline is not None and body.deadline.fired

    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert outcome.timed_out is False


async def test_deadline_fired_then_external_cancel_propagates(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    when = loop.time() + FAR_S
    armed = asyncio.Event()

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(when, "timeout_total")
        armed.set()
        await asyncio.sleep(2 * FAR_S)

    task, outcome, _ = start(steps)
    await armed.wait()
    deadlines.sweep(when + 1)  # the other order: the deadline first, then the client
    task.cancel()

    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert outcome.timed_out is False


async def test_plain_external_cancel_is_not_a_timeout(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    armed = asyncio.Event()

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(loop.time() + FAR_S, "timeout_total")
        armed.set()
        try:
            await asyncio.sleep(2 * FAR_S)
        finally:
            deadlines.disarm(me.deadline)

    task, outcome, body = start(steps)
    await armed.wait()
    task.cancel()

    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert outcome.timed_out is False
    assert body.deadline is not None and not body.deadline.fired


async def test_disarmed_deadlines_leave_nothing_in_the_wheel(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    cycles = 500
    latest: list[float] = []

    async def steps(me: Attempt, outcome: Outcome) -> None:
        now = loop.time()
        for i in range(cycles):
            # Spread over many slots, some moved (with and without an idle limit) first.
            when = now + 1 + (i % 97) * 0.013
            me.deadline = deadline = deadlines.arm(when, "timeout_first_byte")
            if i % 3 == 0:
                deadlines.move(deadline, when + 0.5, "timeout_total", 0.2 if i % 2 else None)
            latest.append(deadline.when)
            deadlines.disarm(deadline)
        # One deadline still armed, as a control that the wheel is inspected at all.
        me.deadline = deadlines.arm(now + FAR_S, "timeout_total")
        await asyncio.sleep(0)

    task, outcome, body = start(steps)
    await asyncio.wait_for(task, timeout=10)
    assert outcome.finished
    control = body.deadline
    assert control is not None

    # There is no public view of the wheel's contents (and a disarmed deadline leaves no trace
    # in behaviour), so this test alone looks at the private `_slots`.
    def held() -> list[Deadline]:
        return [d for slot in deadlines._slots.values() for d in slot]

    assert held() == [control]
    deadlines.sweep(max(latest) + 1)  # every disarmed deadline's slot has come up
    assert held() == [control]
    assert all(slot for slot in deadlines._slots.values()), "empty slots left behind"
    assert len(deadlines._slots) == 1

    deadlines.disarm(control)
    assert held() == []


async def test_sweep_at_a_synthetic_time(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    # Far enough ahead that the wheel's own sweeps never reach it during the test.
    when = loop.time() + FAR_S
    armed = asyncio.Event()

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(when, "timeout_total")
        armed.set()
        await asyncio.sleep(2 * FAR_S)

    task, outcome, body = start(steps)
    await armed.wait()
    deadline = body.deadline
    assert deadline is not None

    deadlines.sweep(when - 1)
    assert not deadline.fired
    await asyncio.sleep(0)
    assert not task.done()

    deadlines.sweep(when + 1)
    assert deadline.fired
    assert deadline.kind == "timeout_total"
    await asyncio.wait_for(task, timeout=10)
    assert outcome.timed_out is True
    assert outcome.kind == "timeout_total"


@pytest.mark.parametrize("offset", [i / 7 for i in range(7)])
async def test_synthetic_sweeps_fire_not_early_and_within_two_resolutions(
    deadlines: Deadlines, offset: float
) -> None:
    loop = asyncio.get_running_loop()
    # Deadlines at various places within a slot, swept every third of a resolution around it.
    when = loop.time() + FAR_S + offset * RESOLUTION_S
    armed = asyncio.Event()

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(when, "timeout_first_byte")
        armed.set()
        await asyncio.sleep(2 * FAR_S)

    task, outcome, body = start(steps)
    await armed.wait()
    deadline = body.deadline
    assert deadline is not None

    step = RESOLUTION_S / 3
    now = when - 5 * RESOLUTION_S
    while not deadline.fired:
        assert now <= when + 2 * RESOLUTION_S, "not fired within two resolutions of its time"
        deadlines.sweep(now)
        fired_by = now
        now += step
    # A coarse wheel may fire up to a resolution late, but never early.
    assert when <= fired_by <= when + 2 * RESOLUTION_S
    await asyncio.wait_for(task, timeout=10)
    assert outcome.timed_out is True
    assert outcome.kind == "timeout_first_byte"


async def test_deadline_already_past_fires_at_the_next_tick(deadlines: Deadlines) -> None:
    loop = asyncio.get_running_loop()
    when = loop.time() - 5

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadlines.arm(when, "timeout_total")
        await asyncio.sleep(30)

    started = loop.time()
    task, outcome, _ = start(steps)
    await asyncio.wait_for(task, timeout=10)

    assert outcome.timed_out is True
    assert outcome.cancelled_at is not None
    assert outcome.cancelled_at <= started + LATE_S


def _sweepers() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "proxy-deadlines"]


async def test_stop_ends_the_sweeping_task() -> None:
    loop = asyncio.get_running_loop()
    wheel = Deadlines(resolution_s=RESOLUTION_S)
    await wheel.stop()  # before start: nothing to do

    wheel.start()
    (sweeper,) = _sweepers()
    await asyncio.sleep(5 * RESOLUTION_S)  # let it tick a few times
    assert not sweeper.done()

    await wheel.stop()
    assert sweeper.done()
    assert sweeper.cancelled()
    assert _sweepers() == []
    await wheel.stop()  # twice: harmless

    # With no sweeper, nothing fires any more.
    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = wheel.arm(loop.time() + RESOLUTION_S, "timeout_total")
        await asyncio.sleep(10 * RESOLUTION_S)
        wheel.disarm(me.deadline)

    task, outcome, body = start(steps)
    await asyncio.wait_for(task, timeout=10)
    assert outcome.finished
    assert body.deadline is not None and not body.deadline.fired


async def test_a_far_deadline_first_does_not_delay_a_near_one(deadlines: Deadlines) -> None:
    """The wheel wakes from idle on its first deadline; one armed later but due sooner still
    fires on time (waking must not skip ahead to the far deadline's slot)."""
    loop = asyncio.get_running_loop()
    far = asyncio.create_task(asyncio.sleep(FAR_S))
    await asyncio.sleep(0)
    far_deadline = deadlines.arm(loop.time() + FAR_S, "timeout_total")

    async def steps(me: Attempt, outcome: Outcome) -> None:
        me.deadline = deadline = deadlines.arm(loop.time() + 0.1, "timeout_first_byte")
        try:
            await asyncio.sleep(FAR_S)
        finally:
            deadlines.disarm(deadline)

    await asyncio.sleep(3 * RESOLUTION_S)  # the sweeper is awake, the far slot ahead
    armed_at = loop.time()
    task, outcome, _ = start(steps)
    await asyncio.wait_for(task, timeout=10)
    deadlines.disarm(far_deadline)
    far.cancel()
    assert outcome.timed_out is True and outcome.kind == "timeout_first_byte"
    assert outcome.cancelled_at is not None
    assert armed_at + 0.1 <= outcome.cancelled_at <= armed_at + 0.1 + LATE_S
