"""Where torch's checkpoint API meets astage's stagers: refuse misuse with the fix in the error.

torch's ``dcp.async_save(..., async_stager=s)`` calls ``s.stage(state_dict)`` synchronously
and expects a state_dict or a ``concurrent.futures.Future``.  An astage stager's ``stage``
is a coroutine function: torch would hand the un-awaited coroutine to its upload thread as
the "state_dict" and then fail deep inside (``AttributeError: ... should_synchronize_after_execute``),
leaving a failing upload and a never-awaited coroutine behind.  Making the coroutine work
there would mean running it on some event loop of the stager's choosing, while a stager
belongs to one loop, its caller's: that is exactly what :class:`astage.dcp.StagerAdapter`
does, explicitly, with its own loop thread.  So ``stage`` refuses a call that comes from
torch's checkpoint package, before any coroutine exists, with an error that names the adapter.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from .._util.errors import ConfigurationError

_TORCH_DCP = "torch.distributed.checkpoint"


class TorchCallerError(ConfigurationError, TypeError):
    """torch called an astage coroutine function synchronously (a :class:`ConfigurationError`
    that is also a ``TypeError``: the wrong kind of object was handed to torch)."""


S = TypeVar("S")
P = ParamSpec("P")
T = TypeVar("T")


def refuse_torch_caller(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """Make an async ``stage`` method raise at once when torch's DCP calls it synchronously.

    The check looks at the immediate caller's module (one frame): ``dcp.async_save`` calls
    ``async_stager.stage(...)`` from ``torch.distributed.checkpoint.state_dict_saver``.
    Every other caller gets the coroutine as before.
    """

    @functools.wraps(method)
    def stage(self: S, /, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T]:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == _TORCH_DCP or str(caller).startswith(_TORCH_DCP + "."):
            name = type(self).__qualname__
            raise TorchCallerError(
                f"{name}.stage() is a coroutine function, and torch.distributed.checkpoint calls "
                f"stage() synchronously: pass async_stager=astage.dcp.StagerAdapter(your_{name.lower()}) "
                "to dcp.async_save (it runs the stager on its own event loop thread), or from async "
                "code use astage.dcp.async_save(state_dict, stager=...)"
            )
        return method(self, *args, **kwargs)

    mark = getattr(inspect, "markcoroutinefunction", None)  # Python 3.12+; marks in place
    if mark is not None:
        mark(stage)
    return stage
