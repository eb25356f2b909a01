"""A local restore: this rank's own file of a step, else a replica of it found elsewhere.

The own file is checked against its commit marker (size, storage checksums) and every
checksum of its body.  If it is missing or corrupt, or the step is not committed here, the
newest valid replica of this rank's step is used: from the replication object's
``fetch_replica`` if it has one, then from the fallback directories (a shared file system).
Every copy is untrusted until its header names this rank's step (and, once committed here,
the marker's checkpoint).  The collective restore is :mod:`astage._checkpointer.collective_restore`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from .._files.durable import blocking_io
from .._files.markers import Marker, header_check
from .._files.reading import find_replicas, load_checkpoint_file
from .._format.codec import FileHeader
from .._util.errors import IntegrityError, ResourceError

# The Checkpointer's logger: splitting the module changes nothing users configure.
log = logging.getLogger("astage.checkpointer")

LoadOwn = Callable[[Path, Callable[[FileHeader], None]], Awaitable[Any]]
"""Loads this rank's own file of the step, checking its header first."""

OnRead = Callable[[int, int], object]
"""``Checkpointer.restore``'s ``on_read(bytes_done, bytes_total)``."""

_LOG_EVERY = 1.0  # seconds: the first line comes once a restore has taken this long


class ReadProgress:
    """Reports the body bytes a restore has read or received: to ``on_read`` and the log.

    Each copy tried (the own file, a replica, a copy received from the holder) starts again
    from 0 with :meth:`begin`; the bytes then only grow, to that copy's body size.
    """

    def __init__(self, on_read: OnRead | None) -> None:
        self.on_read = on_read
        self.step = -1
        self.done = 0
        self.total = 0
        self.logged = time.monotonic()  # no line before the restore has taken _LOG_EVERY

    def begin(self, step: int, total: int) -> None:
        """A copy of ``step`` with a ``total``-byte body is about to be read."""
        self.step, self.done, self.total = step, 0, total
        self._report()

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the body were read or received."""
        self.done += nbytes
        self._report()

    def checking(self, step: int, check: Callable[[FileHeader], None]) -> Callable[[FileHeader], None]:
        """``check``, then :meth:`begin` with the body size of the header it accepted."""

        def checked(header: FileHeader) -> None:
            check(header)
            self.begin(step, header.body_nbytes)

        return checked

    def _report(self) -> None:
        if self.on_read is not None:
            try:
                self.on_read(self.done, self.total)
            except Exception:  # a progress display must not fail the restore
                log.exception("the on_read callback failed at %d of %d bytes", self.done, self.total)
        now = time.monotonic()
        if now - self.logged >= _LOG_EVERY:
            self.logged = now
            log.info("restoring step %d: %.1f of %.1f MB", self.step, self.done / 1e6, self.total / 1e6)


@dataclasses.dataclass(frozen=True)
class ReplicaPlaces:
    """Where replicas of this rank's steps may be found besides its own directory."""

    fetch: Callable[[int], Awaitable[Path | None]] | None
    """The replication object's ``fetch_replica``, if it has one."""
    fallback_dirs: tuple[Path, ...]
    limiter: anyio.CapacityLimiter | None
    load: Callable[..., Awaitable[Any]] = load_checkpoint_file
    """Reads a replica (``load_checkpoint_file``'s arguments): into the caller's tensors, say."""


async def restore_local(
    step: int,
    marker: Marker | None,
    step_dir: Path,
    rank: int,
    load_own: LoadOwn,
    places: ReplicaPlaces,
    progress: ReadProgress,
) -> Any:
    """The state_dict of ``rank``'s ``step``: from its own file if committed, else a replica.

    :param marker: the step's commit marker, ``None`` when it is not committed here.
    :param step_dir: the step's directory under the checkpoint directory.
    :param load_own: reports its bytes read to ``progress`` itself.
    :raises ResourceError: the step is neither committed here nor found among the replicas.
    :raises IntegrityError: every copy found is corrupt or does not match (each named).
    """
    problems: list[str] = []
    if marker is not None:
        path = step_dir / marker.files[0].name
        check = header_check(
            path, step=step, rank=rank, checkpoint_id=marker.checkpoint_id, entry=marker.files[0]
        )
        try:
            return await load_own(path, progress.checking(step, check))
        except (IntegrityError, OSError) as exc:
            log.warning("the local checkpoint of step %d is unusable, trying replicas: %s", step, exc)
            problems.append(str(exc))
    checkpoint_id = None if marker is None else marker.checkpoint_id
    for path in await _replica_candidates(step, rank, places, problems):
        check = header_check(path, step=step, rank=rank, checkpoint_id=checkpoint_id, entry=None)
        try:
            state = await places.load(
                path, limiter=places.limiter, check=progress.checking(step, check), on_read=progress.advance
            )
        except (IntegrityError, OSError) as exc:
            log.warning("replica %s is unusable: %s", path, exc)
            problems.append(str(exc))
            continue
        log.warning("restored step %d of rank %d from the replica %s", step, rank, path)
        return state
    if not problems:
        raise ResourceError(
            f"step {step} of rank {rank} is not committed in {step_dir.parent} and no replica of it was found"
        )
    where = "its local copy and every replica found are" if marker is not None else "every replica found is"
    raise IntegrityError(
        f"cannot restore step {step} of rank {rank}: {where} unusable: " + "; ".join(problems)
    )


async def _replica_candidates(step: int, rank: int, places: ReplicaPlaces, problems: list[str]) -> list[Path]:
    """Paths that may hold a replica of ``rank``'s ``step``, best first, each once."""
    paths: list[Path] = []
    if places.fetch is not None:
        try:
            fetched = await places.fetch(step)
        except Exception as exc:  # a peer may be gone: the fallback directories may still help
            log.warning("fetching the replica of step %d failed: %s", step, exc)
            problems.append(f"fetch_replica({step}) failed: {exc!r}")
            fetched = None
        if fetched is not None:
            paths.append(Path(fetched))
    for directory in places.fallback_dirs:
        try:
            found = await blocking_io(find_replicas, directory, limiter=places.limiter)
        except OSError as exc:
            log.warning("cannot list the replica directory %s: %s", directory, exc)
            continue
        paths += [r.path for r in found if r.owner_rank == rank and r.step == step]
    return list(dict.fromkeys(paths))
