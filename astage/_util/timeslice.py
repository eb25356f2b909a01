"""Cooperative time slicing: long pure-Python work that leaves the event loop responsive.

Walking or rebuilding a state_dict of tens of thousands of tensors takes tens of
milliseconds of Python that cannot leave the GIL.  Such work is written as a
:data:`Steps` generator that yields whenever it has run for :data:`SLICE_SECONDS`; an async
caller gives the loop a turn at each yield (:func:`run_steps`), a synchronous caller runs
it straight through (:func:`drive`).  The driver starts each slice; the work only asks
:func:`slice_over` and yields when it says so::

    for item in items:
        ...
        if slice_over():
            yield

The cyclic garbage collector is paused during each slice: a walk allocates one small
object per tensor that lives as long as the plan, and a collection pass triggered every
few hundred allocations would rescan all of them (it doubled the cost of planning).
Collection resumes between slices, so nothing is deferred for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Final, TypeVar, cast

import anyio
import anyio.lowlevel
import numpy as np

from .collector import gc_paused

T = TypeVar("T")

Steps = Generator[None, None, T]
"""A computation that yields whenever it has used up its time slice."""

SLICE_SECONDS = 0.0005
"""Longest stretch of pure-Python work between two yields of a :data:`Steps`."""

clock = time.perf_counter


class _SliceDeadline(threading.local):
    """When the slice running on this thread is used up (per thread: a worker thread may
    drive its own computation while the loop thread runs another)."""

    at = float("inf")  # outside any slice: never yield


_deadline = _SliceDeadline()


def slice_over() -> bool:
    """Whether the current slice has used up its :data:`SLICE_SECONDS` (then yield)."""
    return clock() > _deadline.at


def _slice(steps: Steps[T]) -> tuple[bool, T | None]:
    """Run one slice with the collector paused; ``(finished, value)``."""
    outer = _deadline.at  # a computation driven inside another's slice gives it back after
    _deadline.at = clock() + SLICE_SECONDS
    try:
        with gc_paused():
            try:
                next(steps)
            except StopIteration as done:
                return True, done.value
        return False, None
    finally:
        _deadline.at = outer


def drive(steps: Steps[T], between: Callable[[], object] | None = None) -> T:
    """Run a :data:`Steps` computation to its end on the calling thread.

    :param between: called between two slices (tests time the slices with it).
    """
    while True:
        finished, value = _slice(steps)
        if finished:
            return value  # type: ignore[return-value]
        if between is not None:
            between()


async def run_steps(steps: Steps[T]) -> T:
    """Run a :data:`Steps` computation, letting the event loop run between slices."""
    while True:
        finished, value = _slice(steps)
        if finished:
            return value  # type: ignore[return-value]
        await give_turn()


async def give_turn() -> None:
    """Let the tasks and the timers that fell due meanwhile run before this task goes on.

    A plain checkpoint is not enough on asyncio: it queues this task for the next loop turn
    *ahead of* the timers that expired during its slice (the loop moves due timers to the
    ready queue behind what is already there, and a timer only resolves the future its
    task waits on, which wakes that task one turn later still).  So a 1 ms heartbeat
    waited for the next slice as well: lag p99 ~1.7 ms with 0.5 ms slices.  Waiting on a
    timer of our own, due now, queues this task behind them.  On trio, tasks woken by
    deadlines and tasks that checkpointed share the next batch, in either order: two
    checkpoints put this task in the batch after.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        return
    turn = loop.create_future()
    # Due at once: the loop does not sleep for it (a timer due later would, rounded up to
    # a millisecond by epoll).
    timer = loop.call_at(loop.time(), _resolve, turn)
    try:
        await turn
    finally:
        timer.cancel()


def _resolve(turn: asyncio.Future[None]) -> None:
    if not turn.done():  # cancelled meanwhile
        turn.set_result(None)


BLOCK: Final = 1024
"""Items a sliced walk hands to one call at a time (:func:`each_block`): C-speed work on a
block (a ``map`` of a C function, a slice, a ``list.extend``) takes ~0.02-0.3 ms, so a
0.5 ms slice checks the clock a few times, and the per-block Python stays negligible."""


def each_block(items: Sequence[T], visit: Callable[[Sequence[T]], object], block: int = BLOCK) -> Steps[bool]:
    """Call ``visit`` on ``items`` a block at a time, yielding whenever the slice is over:
    the one way astage walks a long sequence in time slices.

    ``visit`` returning ``False`` (not merely falsy) stops the walk: then ``False``, else
    ``True``.  To walk two sequences side by side, walk ``range(len(...))``: a block is then
    a ``range`` whose ``start`` and ``stop`` slice both.
    """
    for start in range(0, len(items), block):
        if visit(items[start : start + block]) is False:
            return False
        if slice_over():
            yield
    return True


def distinct_in_slices(items: Sequence[object]) -> Steps[bool]:
    """Whether no object appears twice in ``items`` (by identity), in time slices.

    The ids are gathered a block at a time and sorted once: a set of all the ids made in one
    go held the loop for milliseconds, and one grown a block at a time still did whenever
    it grew its table (~1 ms at ten thousand entries).
    """
    ids = np.empty(len(items), dtype=np.int64)

    def gather(block: Sequence[int]) -> None:
        r = cast(range, block)
        ids[r.start : r.stop] = np.fromiter(map(id, items[r.start : r.stop]), dtype=np.int64, count=len(r))

    yield from each_block(range(len(items)), gather)
    ids.sort()
    return not bool((ids[1:] == ids[:-1]).any())


def drop_in_slices(items: list[Any], block: int = BLOCK) -> Steps[None]:
    """Empty ``items`` from the end, a block at a time, in time slices: the last reference
    to many small records, dropped at once, frees them all in one go (milliseconds)."""
    while items:
        del items[-block:]
        if slice_over():
            yield


def clear_in_slices(mapping: dict[Any, Any], block: int = BLOCK) -> Steps[None]:
    """Empty ``mapping`` a block of entries at a time, in time slices: a dict of many
    entries dropped at once frees them all in one go (milliseconds)."""
    pop = mapping.popitem
    while mapping:
        for _ in range(min(block, len(mapping))):
            pop()
        if slice_over():
            yield


def within(context: Callable[[], contextlib.AbstractContextManager[object]], steps: Steps[T]) -> Steps[T]:
    """``steps`` with each slice run inside a fresh ``context()``, left before every yield.

    Thread-local modes (``torch.no_grad``, ``torch.inference_mode``) must not stay set
    while a computation is suspended: other tasks on the same loop thread run meanwhile,
    and would run under them.
    """
    while True:
        with context():
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
        yield
