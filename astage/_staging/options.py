"""Staging options and their resolution against the machine.

:class:`StagingOptions` keeps the reference's four switches plus a memory cap.  Switches
that need an accelerator default to ``None`` ("automatic"): on where an accelerator is
available, off elsewhere, so the defaults work on every machine.  Asking explicitly for an
accelerator feature where there is none is a :class:`ConfigurationError` at construction,
not a crash at the first stage.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Self

import torch

from .._util.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import StagingOptions as TorchStagingOptions

_TORCH_STAGING = "torch.distributed.checkpoint.staging"
_TORCH_SWITCHES = ("use_pinned_memory", "use_shared_memory", "use_async_staging", "use_non_blocking_copy")


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
    :param skip_unchanged: incremental staging: when a released copy is refilled, a storage
        whose source tensors still have the version counters (``tensor._version``) they had
        when it was last copied into that same copy is not copied again (the stager then
        keeps the plan's source storages alive).  Writes that do not bump the counter of
        the staged tensor (through ``.data``, NumPy, DLPack, another process) go unseen;
        inference tensors, which have no counter, are always copied; see :doc:`concepts`.
    """

    use_pinned_memory: bool | None = None
    use_shared_memory: bool = False
    use_async_staging: bool = True
    use_non_blocking_copy: bool | None = None
    max_staging_bytes: int | None = None
    skip_unchanged: bool = False

    def __post_init__(self) -> None:
        for name in ("use_pinned_memory", "use_non_blocking_copy"):
            check_bool(f"StagingOptions.{name}", getattr(self, name), optional=True)
        for name in ("use_shared_memory", "use_async_staging", "skip_unchanged"):
            check_bool(f"StagingOptions.{name}", getattr(self, name))
        check_positive_int("StagingOptions.max_staging_bytes", self.max_staging_bytes, optional=True)

    @classmethod
    def from_torch(cls, options: TorchStagingOptions) -> Self:
        """The astage options for torch's ``StagingOptions``: its four switches, one to one.

        torch's defaults are all ``True``; here an explicit ``True`` for an accelerator
        feature (pinned memory, non-blocking copies) is refused on a machine without an
        accelerator, as torch refuses it.  Use astage's own ``StagingOptions()`` for "on
        where available".  torch has no memory cap: ``max_staging_bytes`` is ``None``.

        :raises ConfigurationError: ``options`` is not a torch ``StagingOptions``, a switch
            is not a bool (named), or an accelerator feature is on without an accelerator.
        """
        if not _is_torch_options(options):
            raise ConfigurationError(
                "expected a torch.distributed.checkpoint.staging.StagingOptions, "
                f"got {type(options).__qualname__}"
            )
        values = {}
        for name in _TORCH_SWITCHES:
            value = getattr(options, name)
            if not isinstance(value, bool):
                raise ConfigurationError(f"torch StagingOptions.{name} must be a bool, got {value!r}")
            values[name] = value
        needs = [n for n in ("use_pinned_memory", "use_non_blocking_copy") if values[n]]
        if needs and not accelerator_available():
            raise ConfigurationError(
                f"torch StagingOptions with {' and '.join(f'{n}=True' for n in needs)} needs an "
                "accelerator, and torch sees none on this machine (torch's defaults are all True); "
                "set them False, or pass astage.StagingOptions(), which turns them on only where "
                "an accelerator exists"
            )
        return cls(**values)

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
            skip_unchanged=self.skip_unchanged,
        )


@dataclasses.dataclass(frozen=True)
class ResolvedOptions:
    """:class:`StagingOptions` with every automatic switch decided."""

    pinned: bool
    shared: bool
    async_copy: bool
    non_blocking: bool
    max_bytes: int | None
    skip_unchanged: bool = False


def _is_torch_options(value: object) -> bool:
    # No import: whoever holds a torch StagingOptions has imported its module already, and
    # importing torch.distributed.checkpoint costs ~0.2 s that astage users need not pay.
    module = sys.modules.get(_TORCH_STAGING)
    return module is not None and isinstance(value, module.StagingOptions)


def coerce_options(
    options: StagingOptions | TorchStagingOptions | None, config: object = None
) -> StagingOptions:
    """The :class:`StagingOptions` a stager was given as ``options`` (or torch's ``config``).

    Accepts astage's options, torch's (mapped by :meth:`StagingOptions.from_torch`), or
    ``None`` for the defaults, under either keyword but not both.

    :raises ConfigurationError: both keywords given, or a value of another type.
    """
    if options is not None and config is not None:
        raise ConfigurationError("pass options or config, not both (config is torch's name for options)")
    given, label = (config, "config") if config is not None else (options, "options")
    if given is None:
        return StagingOptions()
    if isinstance(given, StagingOptions):
        return given
    if _is_torch_options(given):
        return StagingOptions.from_torch(given)  # type: ignore[arg-type]
    raise ConfigurationError(
        f"{label} must be an astage.StagingOptions, a torch.distributed.checkpoint.staging."
        f"StagingOptions or None, got {type(given).__qualname__}"
    )
