"""Staging options and their resolution against the machine.

:class:`StagingOptions` keeps the reference's four switches plus a memory cap.  Switches
that need an accelerator default to ``None`` ("automatic"): on where an accelerator is
available, off elsewhere, so the defaults work on every machine.  Asking explicitly for an
accelerator feature where there is none is a :class:`ConfigurationError` at construction,
not a crash at the first stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch

from ._errors import ConfigurationError


def check_bool(name: str, value: Any, *, optional: bool = False) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is a bool (or ``None`` if optional)."""
    if not (isinstance(value, bool) or (optional and value is None)):
        expected = "a bool or None" if optional else "a bool"
        raise ConfigurationError(f"{name} must be {expected}, got {value!r}")


def check_positive_int(name: str, value: Any, *, optional: bool = False) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is an int >= 1 (or ``None`` if optional)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        expected = "a positive int or None" if optional else "a positive int"
        raise ConfigurationError(f"{name} must be {expected}, got {value!r}")


def check_choice(name: str, value: Any, choices: Collection[object]) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is one of ``choices``."""
    if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
        raise ConfigurationError(f"{name} must be one of {sorted(map(repr, choices))}, got {value!r}")


def check_type(name: str, value: Any, cls: type) -> None:
    """Raise :class:`ConfigurationError` unless ``value`` is an instance of ``cls``."""
    if not isinstance(value, cls):
        got = f"{type(value).__qualname__} {value!r}"
        raise ConfigurationError(f"{name} must be a {cls.__qualname__}, got {got}")


def accelerator_available() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, ...) on this machine."""
    return bool(torch.accelerator.is_available())


@dataclasses.dataclass(frozen=True)
class StagingOptions:
    """How a stager copies a state_dict and where its buffers live.

    :param use_pinned_memory: page-locked staging buffers for fast, truly asynchronous
        device-to-host copies.  ``None``: on when an accelerator is available.
    :param use_shared_memory: staging buffers in shared memory, so another process
        (``torch.multiprocessing``) can read the staged copy without a second copy.
    :param use_async_staging: copy off the event loop (worker threads for CPU sources);
        ``False`` copies inline on the calling thread.
    :param use_non_blocking_copy: enqueue device copies ``non_blocking`` on a side stream
        and await their event.  ``None``: on when an accelerator is available.
    :param max_staging_bytes: cap on the bytes of staging buffers the stager may hold;
        ``stage()`` waits for room instead of allocating past it.  ``None``: no cap.
    """

    use_pinned_memory: bool | None = None
    use_shared_memory: bool = False
    use_async_staging: bool = True
    use_non_blocking_copy: bool | None = None
    max_staging_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("use_pinned_memory", "use_non_blocking_copy"):
            check_bool(f"StagingOptions.{name}", getattr(self, name), optional=True)
        for name in ("use_shared_memory", "use_async_staging"):
            check_bool(f"StagingOptions.{name}", getattr(self, name))
        check_positive_int("StagingOptions.max_staging_bytes", self.max_staging_bytes, optional=True)

    def resolve(self) -> ResolvedOptions:
        """Decide every automatic switch for this machine.

        :raises ConfigurationError: an accelerator feature was asked for explicitly and no
            accelerator is available.
        """
        has_accel = accelerator_available()
        for name in ("use_pinned_memory", "use_non_blocking_copy"):
            if getattr(self, name) is True and not has_accel:
                raise ConfigurationError(
                    f"StagingOptions.{name}=True needs an accelerator, and torch sees none "
                    "on this machine; leave it as None to enable it only where one exists"
                )
        return ResolvedOptions(
            pinned=has_accel if self.use_pinned_memory is None else self.use_pinned_memory,
            shared=self.use_shared_memory,
            async_copy=self.use_async_staging,
            non_blocking=has_accel if self.use_non_blocking_copy is None else self.use_non_blocking_copy,
            max_bytes=self.max_staging_bytes,
        )


@dataclasses.dataclass(frozen=True)
class ResolvedOptions:
    """:class:`StagingOptions` with every automatic switch decided."""

    pinned: bool
    shared: bool
    async_copy: bool
    non_blocking: bool
    max_bytes: int | None
