"""Worker-thread calls that leave no reference behind in the worker thread.

A worker thread reports its result to the event loop and only then drops its own
references to the call: trio's thread cache holds the call's outcome until its delivery
callback returns, anyio's asyncio worker and ``concurrent.futures`` hold the function, its
arguments and its result until after they have woken the loop.  The awaiting task may
resume, finish with the result and hand buffers back to the pool inside that window, while
the thread, descheduled, still pins them: the pool then sees them as referenced, and takes
them back only at some later reclaim: a save cancelled right after encoding left its staged
copy "handed out" after its Checkpointer had closed.

:func:`run_sync` passes the call and its outcome through a box that the thread empties
before it returns and the caller empties as it resumes, so the thread is left holding an
empty box and ``None``.

Invariant: once ``await run_sync(fn, *args)`` has returned or raised, no worker thread
references ``fn``, ``args``, the result or the error (unless the call was abandoned on
cancellation and is still running).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


class Call(Generic[T]):
    """One call to run in a worker thread, and its outcome, in a box both sides empty."""

    __slots__ = ("_args", "_claim", "_error", "_fn", "_result")

    def __init__(self, fn: Callable[..., T], *args: Any) -> None:
        self._fn: Callable[..., T] | None = fn
        self._args: tuple[Any, ...] = args
        self._result: T | None = None
        self._error: BaseException | None = None
        self._claim = threading.Lock()

    def run(self) -> None:
        """Run the call (in the worker thread); keep its outcome in the box, return nothing."""
        with self._claim:
            fn, args = self._fn, self._args
            self._fn, self._args = None, ()
        if fn is None:  # dropped by a cancellation before the thread reached it
            return
        try:
            self._result = fn(*args)
        except BaseException as exc:
            # The traceback keeps this frame: it must not keep the call's arguments.
            fn = args = None  # type: ignore[assignment]
            self._error = exc

    def take(self) -> T:
        """The call's result (or raise its error), leaving the box empty."""
        result, error = self._result, self._error
        self._result = self._error = None
        if error is not None:
            try:
                raise error
            finally:
                del error
        return result  # type: ignore[return-value]

    def drop(self) -> bool:
        """Empty the box (the caller was cancelled and will not take the outcome).

        Returns whether a thread had already started the call: then it may still be running
        (a call not yet started never will be).
        """
        with self._claim:
            started = self._fn is None
            self._fn, self._args = None, ()
        self._result = self._error = None
        return started


async def run_sync(
    fn: Callable[..., T],
    *args: Any,
    limiter: anyio.CapacityLimiter | None = None,
    abandon_on_cancel: bool = False,
) -> T:
    """``anyio.to_thread.run_sync``, leaving nothing referenced in the worker thread.

    Use it for calls whose arguments or result view staging buffers (see the module).
    """
    call = Call(fn, *args)
    del fn, args
    try:
        await anyio.to_thread.run_sync(call.run, limiter=limiter, abandon_on_cancel=abandon_on_cancel)
    except BaseException:
        call.drop()
        raise
    return call.take()
