"""Cooperative time slicing: long pure-Python work that leaves the event loop responsive.

Walking or rebuilding a state_dict of tens of thousands of tensors takes tens of
milliseconds of Python that cannot leave the GIL.  Such work is written as a
:data:`Steps` generator that yields whenever it has run for :data:`SLICE_SECONDS`; an async
caller gives the loop a turn at each yield (:func:`run_steps`), a synchronous caller runs
it straight through (:func:`drive`).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")

Steps = Generator[None, None, T]
"""A computation that yields whenever it has used up its time slice."""

SLICE_SECONDS = 0.0005
"""Longest stretch of pure-Python work between two yields of a :data:`Steps`."""

clock = time.perf_counter


def drive(steps: Steps[T]) -> T:
    """Run a :data:`Steps` computation to its end on the calling thread."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def run_steps(steps: Steps[T]) -> T:
    """Run a :data:`Steps` computation, letting the event loop run between slices."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await anyio.lowlevel.checkpoint()
