"""Staging options and their resolution against the machine.

:class:`StagingOptions` keeps the reference's four switches plus a memory cap.  Switches
that need an accelerator default to ``None`` ("automatic"): on where an accelerator is
available, off elsewhere, so the defaults work on every machine.  Asking explicitly for an
accelerator feature where there is none is a :class:`ConfigurationError` at construction,
not a crash at the first stage.
"""

from __future__ import annotations

import dataclasses

import torch

from ._errors import ConfigurationError


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
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ConfigurationError(f"StagingOptions.{name} must be a bool or None, got {value!r}")
        for name in ("use_shared_memory", "use_async_staging"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigurationError(f"StagingOptions.{name} must be a bool, got {value!r}")
        cap = self.max_staging_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0):
            raise ConfigurationError(
                f"StagingOptions.max_staging_bytes must be a positive int or None, got {cap!r}"
            )

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
