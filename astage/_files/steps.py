"""One rank's steps in a checkpoint directory, with one owner: the :class:`StepStore`.

The store holds what every part of a Checkpointer works relative to — the directory's file
descriptor (step directories are opened from it, never through a link), the per-rank lock,
the index of committed steps (a step is committed exactly when its marker exists), the
rank's file names and the thread limiter for their I/O — and the operations on steps:
open, load, commit, forget, delete.  The Checkpointer, the save pipeline and the collective
restore all receive the one store; none keeps a copy of its fields.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import anyio

from .._format.codec import FileHeader
from .._util.errors import AstageError, ClosedError, PersistError
from .directory import (
    existing_step_dir,
    open_and_lock,
    open_step_dir,
    rank_file_names,
    step_dir_name,
    step_dir_opener,
)
from .durable import blocking_io, write_checkpoint_file
from .markers import Marker
from .reading import load_checkpoint_file
from .retention import Retention, delete_step, scan

log = logging.getLogger("astage.checkpointer")


class StepStore:
    """The committed steps of ``rank`` in ``directory``, and the only handle on them.

    Made closed; :meth:`open` takes the lock, sweeps what crashed runs left and indexes the
    commits; :meth:`release_lock` and :meth:`close_dir` undo it (the directory stays open
    while an abandoned save's cleanup still runs relative to it).
    """

    def __init__(self, directory: Path, rank: int, threads: int) -> None:
        self.directory = directory
        self.rank = rank
        self.data_name, self.marker_name = rank_file_names(rank)
        self._threads = threads
        self._committed: dict[int, Marker] = {}
        self._dir_fd: int | None = None
        self._lock_fd: int | None = None
        self._limiter: anyio.CapacityLimiter | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def open(self) -> None:
        """Lock the directory for this rank and index its committed steps.

        :raises ConfigurationError: the path is not a directory.
        :raises ResourceError: another Checkpointer holds this directory for this rank.
        :raises PersistError: the directory cannot be created, locked or listed.
        """
        self._limiter = anyio.CapacityLimiter(self._threads)
        self._dir_fd, self._lock_fd = await blocking_io(
            open_and_lock, self.directory, self.rank, limiter=self._limiter
        )
        try:
            self._committed = await blocking_io(
                scan, self.directory, self._dir_fd, self.rank, limiter=self._limiter
            )
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self.release_lock()
                await self.close_dir()
            if isinstance(exc, OSError) and not isinstance(exc, AstageError):
                raise PersistError(f"cannot scan the checkpoint directory {self.directory}: {exc}") from exc
            raise

    async def release_lock(self) -> None:
        """Let another process take this rank's directory (idempotent)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            await blocking_io(os.close, fd, limiter=self._limiter)

    async def close_dir(self) -> None:
        """Close the directory's descriptor (idempotent): nothing may use the store after."""
        fd, self._dir_fd = self._dir_fd, None
        if fd is not None:
            await blocking_io(os.close, fd, limiter=self._limiter)

    @property
    def dir_fd(self) -> int:
        """The open directory every step directory is opened from."""
        if self._dir_fd is None:
            raise ClosedError(f"the checkpoint directory {self.directory} is not open")
        return self._dir_fd

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """Worker threads for this directory's I/O (made when the store opens)."""
        if self._limiter is None:
            raise ClosedError(f"the checkpoint directory {self.directory} was never opened")
        return self._limiter

    # -- the index -----------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first (no I/O)."""
        return sorted(self._committed)

    def latest(self) -> int | None:
        """The newest committed step, or ``None``."""
        return max(self._committed, default=None)

    def marker(self, step: int) -> Marker | None:
        """``step``'s commit marker, or ``None`` if it is not committed."""
        return self._committed.get(step)

    def committed(self) -> list[tuple[int, Marker]]:
        """Every committed step with its marker, oldest first."""
        return sorted(self._committed.items())

    def record(self, step: int, marker: Marker) -> None:
        """Index ``step`` as committed: its marker is durable."""
        self._committed[step] = marker

    # -- steps ---------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        """The directory of ``step``'s files."""
        return self.directory / step_dir_name(step)

    def data_path(self, step: int) -> Path:
        """This rank's checkpoint file of ``step``."""
        return self.step_dir(step) / self.data_name

    def marker_path(self, step: int) -> Path:
        """This rank's commit marker of ``step``."""
        return self.step_dir(step) / self.marker_name

    def step_dir_opener(self, step: int) -> Callable[[], int]:
        """Opens (creating it if need be) ``step``'s directory, never through a link."""
        return step_dir_opener(self.dir_fd, step)

    async def load(
        self,
        step: int,
        path: Path,
        check: Callable[[FileHeader], None],
        on_read: Callable[[int], None] | None = None,
        load: Callable[..., Awaitable[Any]] = load_checkpoint_file,
    ) -> Any:
        """Load ``path``, a file of ``step``, opened relative to its step directory (with
        ``load``: a reader with :func:`load_checkpoint_file`'s signature).

        :raises PersistError: the step directory is a link or not a directory.
        :raises IntegrityError: the file is not a regular file, is corrupt, or fails ``check``.
        """
        opener = functools.partial(open_step_dir, self.dir_fd, step_dir_name(step), create=False)
        step_fd = await blocking_io(opener, limiter=self.limiter)
        try:
            return await load(path, limiter=self.limiter, check=check, dir_fd=step_fd, on_read=on_read)
        finally:
            with anyio.CancelScope(shield=True):
                await blocking_io(os.close, step_fd, limiter=self.limiter)

    async def commit(self, marker: Marker) -> None:
        """Commit ``marker.step``: its files are written; the directory entry is made
        durable, then the marker is written durably, then indexed."""
        await blocking_io(os.fsync, self.dir_fd, limiter=self.limiter)
        await write_checkpoint_file(
            self.marker_path(marker.step),
            [marker.to_json()],
            limiter=self.limiter,
            open_dir=self.step_dir_opener(marker.step),
        )
        self._committed[marker.step] = marker

    async def forget(self, step: int) -> None:
        """Uncommit ``step`` (its files are about to be replaced): the marker goes first,
        removed durably; the files stay for the caller to overwrite."""
        self._committed.pop(step, None)
        dir_fd, name, marker_name = self.dir_fd, step_dir_name(step), self.marker_name

        def remove() -> None:
            # Relative to the step directory, opened without following a link: never outside.
            with existing_step_dir(dir_fd, name) as step_fd:
                if step_fd is None:
                    return
                try:
                    os.unlink(marker_name, dir_fd=step_fd)
                except FileNotFoundError:
                    return
                os.fsync(step_fd)

        await blocking_io(remove, limiter=self.limiter)

    async def delete(self, step: int) -> None:
        """Delete committed ``step`` (marker first); it stays indexed if that fails.

        :raises OSError: the step could not be removed.
        """
        marker = self._committed.pop(step)
        try:
            await blocking_io(
                delete_step, self.dir_fd, step_dir_name(step), marker, self.marker_name, limiter=self.limiter
            )
        except BaseException:
            self._committed[step] = marker
            raise

    async def retire(
        self,
        retention: Retention,
        just_committed: int,
        pinned: Collection[int] = (),
        metrics: Mapping[int, Mapping[str, float]] | None = None,
    ) -> None:
        """Apply ``retention`` after ``just_committed`` was committed; ``pinned`` steps
        (another tier still wants them) stay."""
        await retention.retire(self._committed, just_committed, self.dir_fd, self.limiter, pinned, metrics)

    def index(self) -> dict[int, Marker]:
        """The live index of committed steps, for the remote tier, which heals steps into it
        and reads what it must upload: it records and forgets steps only as this store
        does (a step is in it exactly when its marker is durable)."""
        return self._committed
