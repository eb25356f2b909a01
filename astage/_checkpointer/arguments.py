"""The Checkpointer's argument checks: every public entry point validates its input."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from .._files.policies import Policy
from .._staging.stager import AsyncStager
from .._util.errors import ConfigurationError
from .._util.limits import INT64 as _INT64
from .._util.limits import RANK_LIMIT as _RANK_LIMIT
from .._util.validate import check_path
from .interfaces import Replicator, SaveEvent


def check_arguments(
    stager: AsyncStager | None,
    replication: Replicator | None,
    keep: int | Policy | None,
    max_in_flight: int,
    rank: int,
    on_progress: Callable[[SaveEvent], object] | None,
    fallback_dirs: Iterable[str | os.PathLike[str]],
    threads: int,
) -> tuple[Path, ...]:
    """Check the Checkpointer's arguments; the fallback directories as paths.

    :raises ConfigurationError: an argument is out of range or of the wrong kind.
    """
    for name, value, lo in (
        ("max_in_flight", max_in_flight, 1),
        ("threads", threads, 1),
        ("rank", rank, 0),
    ):
        if type(value) is not int or value < lo:
            raise ConfigurationError(f"{name} must be an int >= {lo}, got {value!r}")
    if rank >= _RANK_LIMIT:
        raise ConfigurationError(f"rank must be below 2**31, got {rank}")
    if keep is not None and not isinstance(keep, Policy) and (type(keep) is not int or keep < 1):
        raise ConfigurationError(f"keep must be an int >= 1, a retention policy or None, got {keep!r}")
    if replication is not None and not isinstance(replication, Replicator):
        raise ConfigurationError(
            f"replication must have an async replicate_staged() method, got {type(replication).__name__}"
        )
    if on_progress is not None and not callable(on_progress):
        raise ConfigurationError("on_progress must be callable")
    # Only stage() is used on a stager passed in (it is not closed here).
    if stager is not None and not callable(getattr(stager, "stage", None)):
        raise ConfigurationError(
            f"stager must be an astage stager (an async stage() method), got {type(stager).__qualname__}"
        )
    if isinstance(fallback_dirs, str | bytes | os.PathLike):
        # A lone path would be iterated character by character.
        raise ConfigurationError(
            f"fallback_dirs must be an iterable of paths, got the single path {fallback_dirs!r}"
        )
    if not isinstance(fallback_dirs, Iterable):
        raise ConfigurationError(
            f"fallback_dirs must be an iterable of paths, got {type(fallback_dirs).__qualname__}"
        )
    return tuple(check_path(f"fallback_dirs[{i}]", d) for i, d in enumerate(fallback_dirs))


def check_step(step: object) -> int:
    if type(step) is not int or not 0 <= step < _INT64:
        raise ConfigurationError(f"step must be an int in [0, 2**63), got {step!r}")
    return step
