"""Tracebacks that do not keep staged buffers alive.

An error kept for later (a failed save is raised by the next ``save``/``wait``) keeps its
traceback, and the traceback keeps the locals of every frame it passed through: an encoded
replica, a staged copy, and through them buffers the pool must get back.  The frames that
have finished are cleared; the traceback still shows where the error happened.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator


def drop_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames in ``exc``'s tracebacks (and its causes')."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__


@contextlib.contextmanager
def frames_dropped() -> Iterator[None]:
    """Drop the frames of whatever escapes the block (see :func:`drop_frames`)."""
    try:
        yield
    except BaseException as exc:
        drop_frames(exc)
        raise
