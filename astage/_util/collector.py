"""The one owner of pausing the cyclic garbage collector.

Walking, planning, encoding or parsing a state_dict of tens of thousands of tensors makes
hundreds of thousands of small objects that all survive the call.  Every 700 of them
trigger a collection that walks the young objects, and the older generations are walked
again and again as they grow: measured at 2-3x the work itself.  Such work runs inside
:func:`gc_paused`.  Nothing astage runs there makes reference cycles; whatever the program
makes meanwhile is collected once the outermost pause ends.

Pauses nest and may overlap across threads (a worker encoding a header while the loop
thread plans): the collector is re-enabled when the last pause ends, and only if it was
enabled when the first began, so a program that disabled it itself keeps it disabled.

Promotion.  The first stage of 20,000 tensors leaves ~100,000 tracked objects behind (the
staged tensors and their storages, the plan; the source storages' Python objects, which
torch keeps once made).  Survivors of young collections count toward CPython's trigger for
a full collection (more than a quarter of the old generation's size), and a full pass
walks the whole heap on whichever thread allocates: 100-350 ms on the event loop with
torch loaded, which no slicing can split.  So such work runs inside one pause and asks
for :func:`promote` at its end: every object still young then moves straight into the
oldest generation (``gc.freeze()`` then ``gc.unfreeze()``: two list splices, no walk),
which is not counted toward that trigger.  The cost, documented: cyclic garbage the
program made during that pause is collected at the next full pass, not the next young one.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_pauses = 0
_was_enabled = False
_promote = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector for the ``with`` block (nesting and threads allowed)."""
    global _pauses, _was_enabled, _promote
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0:
                if _promote and _was_enabled:
                    gc.freeze()  # every tracked object into the permanent generation,
                    gc.unfreeze()  # and back into the oldest: nothing walked, nothing counted
                _promote = False
                if _was_enabled:
                    gc.enable()


PROMOTE_AT = 1_000
"""Tensors from which the objects a plan leaves behind are worth promoting."""


def promote(tensors: int) -> None:
    """Move what is young into the oldest generation when the outermost pause ends, if
    the work inside :func:`gc_paused` left objects behind for ``tensors`` tensors, at
    least :data:`PROMOTE_AT` (see the module's docstring); outside a pause, nothing."""
    global _promote
    with _lock:
        if _pauses and tensors >= PROMOTE_AT:
            _promote = True


def without_gc(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run inside :func:`gc_paused`."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return fn(*args, **kwargs)

    return paused
