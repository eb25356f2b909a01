"""Await a device event from the event loop without blocking it.

Anything with a ``query() -> bool`` method works: ``torch.cuda.Event``, ``torch.Event``,
or an object of the caller's.  The default strategy polls: first right away, then with a
back-off that doubles from ``initial_delay`` to ``max_delay``, so a short copy is noticed
within microseconds and a long one costs a few wake-ups per millisecond at most.  The
``"thread"`` strategy parks a worker thread in ``synchronize()`` instead, for events whose
completion time is long and unpredictable.  Both are cancellable; a cancelled thread
waiter is abandoned (it finishes on its own once the event completes).
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import anyio
import anyio.lowlevel

from .._util.errors import ConfigurationError
from .options import check_choice

Strategy = Literal["poll", "thread"]
STRATEGIES: tuple[Strategy, ...] = ("poll", "thread")


@runtime_checkable
class Queryable(Protocol):
    """An event the loop can poll."""

    def query(self) -> bool:
        """Whether the work recorded before the event has completed."""
        ...


@runtime_checkable
class Synchronizable(Queryable, Protocol):
    """An event a worker thread can block on."""

    def synchronize(self) -> None:
        """Block until the event has completed."""
        ...


async def wait_event(
    event: Queryable,
    *,
    strategy: Strategy = "poll",
    initial_delay: float = 20e-6,
    max_delay: float = 1e-3,
) -> None:
    """Return once ``event.query()`` is true, letting the loop run meanwhile.

    :param strategy: ``"poll"`` (default) or ``"thread"`` (needs ``synchronize()``).
    :param initial_delay: first back-off sleep in seconds.
    :param max_delay: cap of the back-off in seconds; bounds the added latency.
    :raises TypeError: ``"thread"`` asked for an event without ``synchronize()``.
    :raises ConfigurationError: an unknown strategy, or delays that are not positive numbers.
    """
    check_choice("wait_event(strategy=...)", strategy, STRATEGIES)
    for name, value in (("initial_delay", initial_delay), ("max_delay", max_delay)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ConfigurationError(
                f"wait_event({name}=...) must be a positive number of seconds, got {value!r}"
            )
    if strategy == "thread":
        if not isinstance(event, Synchronizable):
            raise TypeError(f"{type(event).__name__} has no synchronize(); use strategy='poll'")
        if not event.query():
            await anyio.to_thread.run_sync(event.synchronize, abandon_on_cancel=True)
        return
    delay = initial_delay
    # One free check, one plain yield (cheap on every backend), then timed back-off.
    if event.query():
        return
    await anyio.lowlevel.checkpoint()
    while not event.query():
        await anyio.sleep(delay)
        delay = min(delay * 2, max_delay)
