"""What of a checkpoint directory stays: the start-up sweep and index, and retention.

* Start-up (:func:`scan`) indexes this rank's committed steps and removes what crashed
  runs of this rank left: astage temp files and data files without a marker, nothing else.
* Retention (:class:`Retention`) runs only right after a commit and never removes the step
  just committed.  It removes a marker first and fsyncs the directory before removing the
  files, so a half-deleted step is never committed.  A step it cannot delete stays
  committed; it never fails the save whose commit triggered it.
* A failed save's files go (:func:`discard_uncommitted`); a step directory only while empty.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Collection, Mapping
from pathlib import Path

import anyio

from .._util.errors import IntegrityError, PersistError
from .directory import (
    existing_step_dir,
    open_step_dir,
    rank_file_names,
    remove_dir_if_empty,
    step_dir_name,
    step_of_dir,
    unlink_entry,
)
from .durable import blocking_io, is_temp_name
from .markers import Marker, read_marker
from .policies import Policy, StepInfo, as_policy, retained

# The Checkpointer's logger: splitting the module changes nothing users configure.
log = logging.getLogger("astage.checkpointer")


def scan(directory: Path, dir_fd: int, rank: int) -> dict[int, Marker]:
    """Find this rank's committed steps and remove what crashed runs left of this rank."""
    data_name, marker_name = rank_file_names(rank)
    ours = (f".{data_name}.", f".{marker_name}.")
    committed: dict[int, Marker] = {}
    with os.scandir(dir_fd) as listing:
        names = [e.name for e in listing if e.is_dir(follow_symlinks=False)]
    for name in names:
        step = step_of_dir(name)
        if step is None:
            continue
        try:
            step_fd = open_step_dir(dir_fd, name, create=False)
        except FileNotFoundError:  # another rank's retention removed it meanwhile
            continue
        except PersistError as exc:
            log.warning("ignoring %s: %s", directory / name, exc)
            continue
        try:
            marker = _scan_step(directory / name, step_fd, step, rank, data_name, marker_name, ours)
        finally:
            os.close(step_fd)
        if marker is not None:
            committed[step] = marker
        elif remove_dir_if_empty(name, dir_fd):
            os.fsync(dir_fd)
    return committed


def _scan_step(
    step_dir: Path,
    step_fd: int,
    step: int,
    rank: int,
    data_name: str,
    marker_name: str,
    ours: tuple[str, str],
) -> Marker | None:
    """This rank's commit in one step directory, after removing its crashed runs' leftovers."""
    for name in os.listdir(step_fd):
        if is_temp_name(name) and name.startswith(ours) and unlink_entry(name, step_fd):
            log.info("removed a stale temp file %s", step_dir / name)
    try:
        return read_marker(marker_name, step=step, rank=rank, dir_fd=step_fd)
    except FileNotFoundError:
        if unlink_entry(data_name, step_fd):
            log.info("removed the uncommitted checkpoint file %s", step_dir / data_name)
        return None
    except IntegrityError as exc:
        log.warning("ignoring step %d: invalid commit marker %s: %s", step, step_dir / marker_name, exc)
        return None


def delete_step(dir_fd: int, name: str, marker: Marker, marker_name: str) -> None:
    """Retire a committed step: its marker first (made durable), then its files.

    :raises OSError: the marker could not be removed: the step is still committed.  Files
        left once the marker is gone are only logged (swept at the next start).
    """
    with existing_step_dir(dir_fd, name) as step_fd:
        if step_fd is None:
            return
        unlink_entry(marker_name, step_fd)
        try:
            os.fsync(step_fd)
            for entry in marker.files:
                unlink_entry(entry.name, step_fd)
        except OSError as exc:
            log.warning(
                "cannot delete the files of step directory %s (swept at the next start): %s", name, exc
            )
            return
    try:
        if remove_dir_if_empty(name, dir_fd):
            os.fsync(dir_fd)
    except OSError as exc:
        log.warning("cannot remove the step directory %s: %s", name, exc)


def discard_uncommitted(dir_fd: int, name: str, data_name: str) -> None:
    """Remove a failed save's data file and, if nothing else is in it, its step directory."""
    with existing_step_dir(dir_fd, name) as step_fd:
        if step_fd is None:
            return
        unlink_entry(data_name, step_fd)
    remove_dir_if_empty(name, dir_fd)


class Retention:
    """Keeps the committed steps of a rank that its policy wants (an int ``n``: the ``n``
    highest; ``None``: all), the newest, and the steps another tier still needs (pinned).

    A step that cannot be deleted stays committed (``latest``/``restore`` see it) and is
    tried again after the next commit; its failure is logged once as a warning and never
    fails a save: the save that triggered retention is committed already.
    """

    def __init__(self, keep: Policy | int | None, marker_name: str) -> None:
        self.keep = keep
        self.policy = as_policy("keep", keep)
        self._marker_name = marker_name
        self._undeletable: set[int] = set()  # steps it failed to delete (warned once)

    async def retire(
        self,
        committed: dict[int, Marker],
        just_committed: int,
        dir_fd: int,
        limiter: anyio.CapacityLimiter | None,
        pinned: Collection[int] = (),
        metrics: Mapping[int, Mapping[str, float]] | None = None,
    ) -> None:
        """Delete the committed steps the policy does not keep from ``committed`` and from
        disk; never ``just_committed`` nor a ``pinned`` step."""
        if self.policy is None:
            return
        infos = [StepInfo(step, m.created, (metrics or {}).get(step, {})) for step, m in committed.items()]
        kept = retained(self.policy, infos, pinned) | {just_committed}
        for step in sorted(set(committed) - kept):
            delete = functools.partial(
                delete_step, dir_fd, step_dir_name(step), committed[step], self._marker_name
            )
            try:
                await blocking_io(delete, limiter=limiter)
            except Exception as exc:
                if step not in self._undeletable:
                    self._undeletable.add(step)
                    log.warning(
                        "retention (keep=%s) cannot delete step %d, which stays committed: %s",
                        self.policy,
                        step,
                        exc,
                    )
                continue
            del committed[step]
            self._undeletable.discard(step)
            log.info("deleted the checkpoint of step %d (keep=%s)", step, self.policy)
