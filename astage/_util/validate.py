"""Argument checks shared by the public constructors.

Every public class validates each argument in ``__init__``, so that a bad value is a
:class:`ConfigurationError` naming the argument and what was expected at construction,
never a failure at the first use (which, for replication, could leave peers out of step).
"""

from __future__ import annotations

import math
import os
from datetime import timedelta
from pathlib import Path

from .errors import ConfigurationError


def check_int(name: str, value: object, *, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in ``[lo, hi]`` (``bool`` is not an int here).

    :raises ConfigurationError: names ``name`` and the range.
    """
    if type(value) is not int or value < lo or (hi is not None and value > hi):
        bounds = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigurationError(f"{name} must be an int {bounds}, got {value!r}")
    return value


def check_seconds(name: str, value: object) -> float:
    """``value`` (seconds as an int or float, or a ``timedelta``) as a finite float > 0.

    :raises ConfigurationError: names ``name``; a bool, a string, NaN, infinity or <= 0.
    """
    seconds: float | None = None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    if seconds is None or not (math.isfinite(seconds) and seconds > 0):
        raise ConfigurationError(
            f"{name} must be a finite number of seconds > 0 or a positive timedelta, got {value!r}"
        )
    return seconds


def check_path(name: str, value: object) -> Path:
    """``value`` (a ``str`` or ``os.PathLike`` of ``str``) as a :class:`Path`.

    :raises ConfigurationError: names ``name``; bytes, another type, an empty path or a NUL.
    """
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(text, str) or not text or "\0" in text:
        raise ConfigurationError(f"{name} must be a non-empty str or os.PathLike path, got {value!r}")
    return Path(text)
