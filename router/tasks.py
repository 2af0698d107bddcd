"""The one way an owned background task is stopped."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["stop_task"]


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (if any) and wait until it has ended, its CancelledError swallowed."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
