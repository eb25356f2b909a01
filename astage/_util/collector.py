"""The one owner of pausing the cyclic garbage collector, inside astage's own work only.

Walking, planning, encoding or parsing a state_dict of tens of thousands of tensors makes
hundreds of thousands of small objects.  A young collection every 700 of them, walking
what is young, cost 2-3x the work itself when it ran inside such a walk.  So each time
slice of that work (:func:`astage._slices.drive`, ``run_steps``) and each CPU-bound call
a worker thread runs for astage (``encode``, ``parse_prefix``, ``decode``) runs inside
:func:`gc_paused`: a slice lasts ~0.5 ms, a worker's call tens of milliseconds.  No pause
spans an ``await``, so the program's own tasks never run in one on the loop thread.

What astage leaves to the program's heap.  Nothing here moves, ages, freezes or collects
an object: what a first stage keeps (about four tracked objects a tensor) ages through the
generations like any object the program makes, and, as
any program that makes that many, may make one full collection due, once per structure
(a first stage, or a stage after the structure changed; steady stages make almost no
objects).  A program that wants its long-lived heap out of every collection can say so
itself: ``gc.freeze()`` after its first checkpoint (see ``docs/performance.md``).

The collector's state is the program's.  Pauses nest and may overlap across threads (a
worker encoding a header while the loop thread plans): the first to begin records whether
the collector is enabled and disables it; the last to end enables it again only if it
was enabled then.  A program that disabled the collector keeps it disabled; one that
enables it during a pause (from another thread) keeps it enabled.  One that disables it
from another thread while a pause is on finds it enabled again when the pause ends (CPython
cannot tell that call from the pause's own); the window is a slice or a worker's call.
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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector for the ``with`` block (nesting and threads allowed);
    the block must not ``await``: the pause is the process's, and only astage's work may
    run inside it."""
    global _pauses, _was_enabled
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
            if _pauses == 0 and _was_enabled:
                gc.enable()


def without_gc(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` run inside :func:`gc_paused`."""

    @functools.wraps(fn)
    def paused(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return fn(*args, **kwargs)

    return paused
