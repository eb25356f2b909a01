"""Worker-thread calls that pin nothing once they return.

An idle anyio worker thread keeps its last call's arguments alive until it runs another
call or exits (after ten seconds).  A buffer passed to it would stay pinned that long: not
freed, and invisible to the pool's accounting.  :func:`run_unpinned` hands the arguments
over in a box that the thread empties before it starts, so once the call returns only the
caller holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


async def run_unpinned(
    fn: Callable[..., T],
    *args: Any,
    limiter: anyio.CapacityLimiter | None = None,
    abandon_on_cancel: bool = False,
) -> T:
    """``anyio.to_thread.run_sync(fn, *args)``, but the parked thread keeps no argument alive.

    ``fn`` should be a module-level function: a bound method would pin its object.
    """
    return await anyio.to_thread.run_sync(
        _unbox, fn, [args], limiter=limiter, abandon_on_cancel=abandon_on_cancel
    )


def _unbox(fn: Callable[..., T], box: list[tuple[Any, ...]]) -> T:
    return fn(*box.pop())
