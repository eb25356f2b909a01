"""Restoring across tiers: the local disk (and its replicas), else the object store.

:func:`restore_across_tiers` is the local restore of a Checkpointer with a remote tier: the
newest step is the newest committed locally or complete on the store; a step this rank
lacks locally, or whose local copy fails its checks, is downloaded (verified against its
commit object as it lands), committed locally (healing) and then restored like any local
step, with every checksum of the format checked again.  A copy that fails is never
returned: the next tier, or (for the newest) the next older step, is tried.

:func:`heal_newest` prepares a collective restore: each rank heals the newest complete step
of the store if its disk lacks it (and has nothing newer), so that the ranks' agreement
counts the store like a local tier.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .._files.markers import Marker
from .._util.errors import IntegrityError, RemoteError, ResourceError
from .remote_tier import RemoteTier

log = logging.getLogger("astage.remote")


async def restore_across_tiers(
    tier: RemoteTier,
    committed: dict[int, Marker],
    step: int | None,
    restore_one: Callable[[int], Awaitable[Any]],
    where: str,
) -> Any:
    """The state of ``step`` (default: the newest any tier has) from the first tier that has
    a valid copy; ``committed`` (the local index) gains the steps healed.

    :param restore_one: restores a step from the local tier (own file, then replicas).
    :raises ResourceError: no tier has the step (or any step).
    :raises IntegrityError: every copy found is unusable (each named).
    """
    try:
        remote = await tier.listed_steps()
    except RemoteError as exc:
        log.warning("cannot list the remote tier, restoring from the local one only: %s", exc)
        remote = {}
    candidates = [step] if step is not None else sorted(set(committed) | set(remote), reverse=True)
    problems: list[Exception] = []
    for candidate in candidates:
        if candidate in committed or candidate not in remote:
            try:
                return await restore_one(candidate)
            except (ResourceError, IntegrityError) as exc:
                problems.append(exc)
        if candidate in remote:
            committed.pop(candidate, None)  # its local marker goes first (heal)
            try:
                commit = await tier.own_commit(candidate, remote[candidate])
                committed[candidate] = await tier.heal(commit)
                return await restore_one(candidate)
            except (IntegrityError, RemoteError, OSError) as exc:
                log.warning("step %d from the remote tier is unusable: %s", candidate, exc)
                problems.append(exc)
    if all(isinstance(p, ResourceError) for p in problems):
        raise ResourceError(f"no checkpoint of rank {tier.rank} (step {step}) in {where}")
    text = "; ".join(str(p) for p in problems)
    raise IntegrityError(f"cannot restore rank {tier.rank} from any tier ({where}): {text}")


async def heal_newest(tier: RemoteTier, committed: dict[int, Marker], step: int | None) -> None:
    """Before a collective restore: download (verified) and commit locally ``step`` (or the
    newest step complete on the store) if this rank lacks it.  Failures are logged: the
    collective restore then finds the step on a peer, or agrees on an older one."""
    try:
        remote = await tier.listed_steps()
    except RemoteError as exc:
        log.warning("cannot list the remote tier, restoring from the local one only: %s", exc)
        return
    wanted = step if step is not None else max(remote, default=None)
    if wanted is None or wanted in committed or wanted not in remote:
        return
    if step is None and wanted < max(committed, default=-1):
        return  # this rank's disk has newer: the agreement decides
    try:
        committed[wanted] = await tier.heal(await tier.own_commit(wanted, remote[wanted]))
    except (IntegrityError, RemoteError, OSError) as exc:
        log.warning("step %d from the remote tier is unusable: %s", wanted, exc)
