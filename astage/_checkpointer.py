"""The Checkpointer: save / latest / restore over a stager, durable files and replication.

``await ckpt.save(step, state_dict)`` returns once the state is staged; a task the
Checkpointer owns then encodes the staged copy (:mod:`astage._format`) and writes it durably
(:mod:`astage._persist`) while it hands the copy to the replication object, if there is
one; once both are done, it commits::

    directory/
        .astage-rank00000.lock          one live Checkpointer per directory and rank
        step_0000000042/
            rank00000.astage            this rank's state (an astage replica file)
            rank00000.COMMITTED         the commit marker (JSON), written last

Invariants:

* A step is committed exactly when its marker exists; the marker is written (temp file,
  fsync, rename, directory fsync) only after every file it names is durable, so a crash at
  any instruction leaves every committed step loadable.  :meth:`Checkpointer.steps` and
  :meth:`Checkpointer.latest` report committed steps only.
* Retention runs only right after a commit and never removes the step just committed.  It
  removes a marker first and fsyncs the directory before removing the files, so a
  half-deleted step is never committed.  A step it cannot delete stays committed; it never
  fails the save whose commit triggered it (a commit stands once its marker is durable).
* Nothing below the directory is followed: step directories are opened ``O_NOFOLLOW``
  from the directory's descriptor and their files relative to theirs, so a link planted
  under a step's name is foreign (refused, never written, read or deleted through).
  Markers, like every file read back, are untrusted: checksummed, naming only this rank's
  data file, and read only if they are regular files.
* Several ranks may share the directory: a step directory is removed only while empty,
  and a save whose step directory vanishes before its first file is in it creates it again.
* Start-up removes what crashed runs of this rank left: astage temp files and step files
  without a marker, nothing else; an exclusive lock keeps a live writer's files safe.
* At most ``max_in_flight`` saves are past staging and not yet finished; a further
  ``save`` waits *before* staging, so memory never piles up.
* Replication and commits run in save order, and replication is called for every staged
  save, even one whose local write failed: ranks that make the same sequence of ``save``
  calls make the same sequence of replication calls (peer exchanges stay in step).
* Every staged copy goes back to its stager, and an uncommitted step's files are removed,
  whatever ends a save (success, error, cancellation).  A failed save is never committed;
  its error is raised once, by the next ``save`` or ``wait`` (or its handle's ``wait``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import inspect
import json
import logging
import math
import os
import re
import struct
import time
import traceback
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Protocol, Self, runtime_checkable

import anyio
import anyio.abc
import crc32c

from ._errors import (
    AstageError,
    ClosedError,
    ConfigurationError,
    IntegrityError,
    PersistError,
    ResourceError,
)
from ._format import Encoded, ReplicaHeader, ReplicaLayout, lay_out
from ._limits import INT64 as _INT64
from ._limits import RANK_LIMIT as _RANK_LIMIT
from ._persist import (
    blocking_io,
    find_replicas,
    inspect_replica,
    is_temp_name,
    load_replica,
    load_replica_sync,
    open_directory,
    open_regular,
    write_replica,
)
from ._stager import AsyncStager, DefaultStager, StageStats
from ._threads import run_sync
from ._validate import check_path

log = logging.getLogger("astage.checkpointer")

MARKER_FORMAT: Final = "astage-checkpoint"
"""The ``format`` field of every commit marker."""

MARKER_VERSION: Final = 2
"""The only commit-marker version this module reads and writes (2 added the ``crc32c`` field)."""

_STEP_DIR_RE: Final = re.compile(r"\Astep_([0-9]{10,19})\Z")
_MARKER_CAP: Final = 1 << 20

EventKind = Literal["staged", "persisted", "replicated", "committed", "failed"]
"""What happened to a save: ``staged`` first, then ``persisted`` (the local file is durable)
and ``replicated`` in either order, then ``committed``, or ``failed`` instead."""


# -- protocols ----------------------------------------------------------------------------


@runtime_checkable
class Replicator(Protocol):
    """What the Checkpointer needs from a replication object (``astage.ReplicationStager``).

    ``replicate_staged`` is called once per staged save, in save order, while the local
    file is written; it must not change the staged copy.  An exception fails the save.
    """

    async def replicate_staged(self, staged: Any, *, step: int, checkpoint_id: str) -> object:
        """Send or store a replica of an already staged state_dict.

        An implementation that also takes an ``encoded`` keyword argument gets the save's
        :class:`astage._format.Encoded` replica (owner this rank, no holder), encoded and
        checksummed once for the local file and the replica alike.
        """
        ...


def _takes_encoded(replication: Replicator) -> bool:
    """Whether ``replication.replicate_staged`` accepts ``encoded=`` (see :class:`Replicator`)."""
    try:
        parameters = inspect.signature(replication.replicate_staged).parameters
    except (TypeError, ValueError):  # no signature to read: call it the plain way
        return False
    return "encoded" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


@runtime_checkable
class ReplicaSource(Protocol):
    """A replication object that can also find this rank's replica of a step (optional)."""

    async def fetch_replica(self, step: int) -> Path | None:
        """A local path holding this rank's replica of ``step``, or ``None``."""
        ...


@runtime_checkable
class _Releasing(Protocol):
    async def release(self, staged: Any) -> None: ...


# -- stats and events ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What one committed save cost.

    :ivar step: the step saved.
    :ivar nbytes: bytes of this rank's checkpoint file.
    :ivar staging_seconds: how long ``save()`` kept the caller (back-pressure included).
    :ivar backpressure_seconds: part of ``staging_seconds`` spent waiting for an earlier
        save to finish (``max_in_flight``).
    :ivar persist_seconds: encoding plus the durable write of the local file.
    :ivar replicate_seconds: the replication call, ``None`` without replication.
    :ivar total_seconds: from the ``save()`` call to the commit.
    :ivar stage: the stager's own stats, where it records them (``last_stats``).
    """

    step: int
    nbytes: int
    staging_seconds: float
    backpressure_seconds: float
    persist_seconds: float
    replicate_seconds: float | None
    total_seconds: float
    stage: StageStats | None = None

    @property
    def gbps(self) -> float:
        """Persist throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.persist_seconds / 1e9 if self.persist_seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class SaveEvent:
    """One progress report, passed to ``on_progress``.

    :ivar kind: ``staged``, ``persisted``, ``replicated``, ``committed`` or ``failed``.
    :ivar elapsed_seconds: since the ``save()`` call.
    :ivar stats: the save's stats, on ``committed``.
    :ivar error: why the save failed, on ``failed``.
    """

    kind: EventKind
    step: int
    checkpoint_id: str
    elapsed_seconds: float
    stats: SaveStats | None = None
    error: AstageError | None = None


# -- the commit marker --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _FileEntry:
    name: str
    nbytes: int
    storages_crc32c: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Marker:
    step: int
    rank: int
    checkpoint_id: str
    created: float
    files: tuple[_FileEntry, ...]

    def to_json(self) -> bytes:
        body = {
            "format": MARKER_FORMAT,
            "version": MARKER_VERSION,
            "step": self.step,
            "rank": self.rank,
            "checkpoint_id": self.checkpoint_id,
            "created": self.created,
            "files": [dataclasses.asdict(f) for f in self.files],
        }
        doc = {**body, "crc32c": _marker_crc32c(body)}
        return json.dumps(doc, indent=1, allow_nan=False).encode("ascii")


def _marker_crc32c(body: dict[str, Any]) -> int:
    """The checksum a marker carries: crc32c of its other fields as canonical JSON."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return int(crc32c.crc32c(canonical.encode("ascii")))


def _storages_crc32c(header: ReplicaHeader) -> int:
    """A checksum of a replica's storage table (offsets, lengths and their crc32c)."""
    table = b"".join(struct.pack("<QQI", s.offset, s.nbytes, s.crc32c) for s in header.segments)
    return int(crc32c.crc32c(struct.pack("<Q", header.body_nbytes) + table))


def _expect_int(doc: dict[str, Any], key: str, lo: int, hi: int) -> int:
    value = doc.get(key)
    if type(value) is not int or not lo <= value < hi:
        raise IntegrityError(
            f"commit marker field {key!r}: expected an int in [{lo}, {hi}), got {value!r:.40}"
        )
    return value


_MARKER_KEYS: Final = frozenset(
    {"format", "version", "step", "rank", "checkpoint_id", "created", "files", "crc32c"}
)
_CHECKPOINT_ID_RE: Final = re.compile(r"\A[0-9a-f]{32}\Z")


def _parse_marker(data: bytes, *, step: int, rank: int) -> _Marker:
    """Validate a commit marker strictly: it is untrusted input, like any file read back.

    Its checksum must match, and it may name only what astage writes there: this rank's
    data file of this step, once.

    :raises IntegrityError: malformed, tampered, of another format, step or rank, or
        naming any other file.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"commit marker is not valid JSON: {exc}") from exc
    if type(doc) is not dict or doc.get("format") != MARKER_FORMAT or doc.get("version") != MARKER_VERSION:
        raise IntegrityError(f"not a version-{MARKER_VERSION} {MARKER_FORMAT} marker")
    if set(doc) != _MARKER_KEYS:
        raise IntegrityError(
            f"commit marker: expected the fields {sorted(_MARKER_KEYS)}, got {sorted(doc)!r:.200}"
        )
    body = {key: value for key, value in doc.items() if key != "crc32c"}
    try:
        expected = _marker_crc32c(body)
    except (ValueError, RecursionError) as exc:  # a non-finite float, absurd nesting
        raise IntegrityError(f"commit marker: {exc}") from exc
    if type(doc["crc32c"]) is not int or doc["crc32c"] != expected:
        raise IntegrityError(
            f"commit marker checksum mismatch: it says {doc['crc32c']!r:.40}, the content gives {expected}"
        )
    if _expect_int(doc, "step", 0, _INT64) != step or _expect_int(doc, "rank", 0, _RANK_LIMIT) != rank:
        raise IntegrityError(
            f"commit marker is for step {doc['step']} rank {doc['rank']}, not step {step} rank {rank}"
        )
    checkpoint_id, created, files = doc["checkpoint_id"], doc["created"], doc["files"]
    if type(checkpoint_id) is not str or _CHECKPOINT_ID_RE.match(checkpoint_id) is None:
        raise IntegrityError(f"commit marker: bad checkpoint_id {checkpoint_id!r:.80}")
    if type(created) is not float or not math.isfinite(created):
        raise IntegrityError(f"commit marker: bad created {created!r:.40}")
    data_name = _names(rank)[0]
    if type(files) is not list or len(files) != 1:
        raise IntegrityError(f"commit marker: files must list exactly {data_name!r}, got {files!r:.120}")
    raw = files[0]
    if type(raw) is not dict or set(raw) != {"name", "nbytes", "storages_crc32c"}:
        raise IntegrityError(f"commit marker: bad file entry {raw!r:.120}")
    if raw["name"] != data_name:
        raise IntegrityError(f"commit marker: names the file {raw['name']!r:.80}, not {data_name!r}")
    entry = _FileEntry(
        data_name, _expect_int(raw, "nbytes", 0, _INT64), _expect_int(raw, "storages_crc32c", 0, 1 << 32)
    )
    return _Marker(step, rank, checkpoint_id, created, (entry,))


def read_marker(path: str | os.PathLike[str], *, step: int, rank: int, dir_fd: int | None = None) -> _Marker:
    """Read and validate the commit marker at ``path`` (blocking).

    Only a regular file is read (never a FIFO, device or symlink: :func:`open_regular`),
    and at most ``_MARKER_CAP`` bytes of it.

    :param dir_fd: open ``path`` relative to this directory descriptor.
    :raises FileNotFoundError: there is no marker: the step is not committed for ``rank``.
    :raises IntegrityError: it is not a regular file, is too long or is invalid.
    :raises OSError: it cannot be read.
    """
    fd = open_regular(path, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(_MARKER_CAP + 1)
    finally:
        os.close(fd)
    if len(data) > _MARKER_CAP:
        raise IntegrityError(f"commit marker {path} is over the {_MARKER_CAP}-byte cap")
    return _parse_marker(data, step=step, rank=rank)


# -- blocking file work (run in worker threads) --------------------------------------------


def _names(rank: int) -> tuple[str, str]:
    """This rank's data file and marker names inside a step directory."""
    return f"rank{rank:05d}.astage", f"rank{rank:05d}.COMMITTED"


def _step_of(name: str) -> int | None:
    match = _STEP_DIR_RE.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step < _INT64 and name == f"step_{step:010d}" else None


def _unlink(name: str, dir_fd: int) -> bool:
    """Remove the entry ``name`` of a directory (a link is removed, never followed)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _remove_dir_if_empty(name: str, dir_fd: int) -> bool:
    """Remove the step directory ``name`` if it is empty; another rank may be using it.

    Only an empty directory goes: a rank whose file is there keeps it.  A rank about to
    create its file there may see it vanish, and creates it again (see
    :func:`astage._persist._create_temp`).
    """
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            return False
        raise
    return True


def _open_step_dir(dir_fd: int, name: str, *, create: bool) -> int:
    """Open the step directory ``name`` of the checkpoint directory ``dir_fd``; its descriptor.

    With ``create``, it is made first if missing (mode 0700); the caller fsyncs the
    checkpoint directory before committing anything in it.  A link or anything else not
    a directory under a step's name is foreign: it is never followed, so nothing astage
    writes or deletes can land outside the directory.

    :raises PersistError: ``name`` is a symbolic link or not a directory.
    :raises FileNotFoundError: it does not exist (without ``create``: or it vanished).
    """
    if create:
        # No fsync here: another rank may remove the directory while it is empty, and the
        # shorter the way from mkdir to the first file in it, the less often that happens.
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    try:
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise PersistError(
            f"{name} in the checkpoint directory is a symbolic link or not a directory: "
            "not astage's, so it is neither followed nor deleted"
        ) from exc


def _open_directory(directory: Path, rank: int) -> tuple[int, int]:
    """Create ``directory`` if needed, open it and take this rank's lock.

    :returns: the directory's descriptor and the lock's.
    """
    if directory.exists() and not directory.is_dir():
        raise ConfigurationError(f"checkpoint directory {directory} exists and is not a directory")
    lock_name = f".astage-rank{rank:05d}.lock"
    try:
        dir_fd = open_directory(directory)
    except (FileExistsError, NotADirectoryError) as exc:
        raise ConfigurationError(f"checkpoint directory {directory} cannot be created: {exc}") from exc
    except OSError as exc:
        raise PersistError(f"cannot open the checkpoint directory {directory}: {exc}") from exc
    try:
        # Never through a link, never waiting on a FIFO: the lock file must be a plain file.
        fd = open_regular(lock_name, dir_fd=dir_fd, flags=os.O_CREAT)
    except IntegrityError as exc:
        os.close(dir_fd)
        raise PersistError(f"cannot use the lock file of rank {rank} in {directory}: {exc}") from exc
    except OSError as exc:
        os.close(dir_fd)
        raise PersistError(f"cannot open the checkpoint directory {directory}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        os.close(dir_fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ResourceError(
                f"{directory} is in use by another Checkpointer for rank {rank} (this process or another)"
            ) from exc
        raise PersistError(f"cannot lock the checkpoint directory {directory}: {exc}") from exc
    return dir_fd, fd


def _scan(directory: Path, dir_fd: int, rank: int) -> dict[int, _Marker]:
    """Find this rank's committed steps and remove what crashed runs left of this rank."""
    data_name, marker_name = _names(rank)
    ours = (f".{data_name}.", f".{marker_name}.")
    committed: dict[int, _Marker] = {}
    with os.scandir(dir_fd) as listing:
        names = [e.name for e in listing if e.is_dir(follow_symlinks=False)]
    for name in names:
        step = _step_of(name)
        if step is None:
            continue
        try:
            step_fd = _open_step_dir(dir_fd, name, create=False)
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
        elif _remove_dir_if_empty(name, dir_fd):
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
) -> _Marker | None:
    """This rank's commit in one step directory, after removing its crashed runs' leftovers."""
    for name in os.listdir(step_fd):
        if is_temp_name(name) and name.startswith(ours) and _unlink(name, step_fd):
            log.info("removed a stale temp file %s", step_dir / name)
    try:
        return read_marker(marker_name, step=step, rank=rank, dir_fd=step_fd)
    except FileNotFoundError:
        if _unlink(data_name, step_fd):
            log.info("removed the uncommitted checkpoint file %s", step_dir / data_name)
        return None
    except IntegrityError as exc:
        log.warning("ignoring step %d: invalid commit marker %s: %s", step, step_dir / marker_name, exc)
        return None


@contextlib.contextmanager
def _existing_step_dir(dir_fd: int, name: str) -> Iterator[int | None]:
    """The step directory ``name`` opened (never through a link), or ``None`` if it is gone."""
    try:
        step_fd = _open_step_dir(dir_fd, name, create=False)
    except FileNotFoundError:
        yield None
        return
    try:
        yield step_fd
    finally:
        os.close(step_fd)


def _delete_step(dir_fd: int, name: str, marker: _Marker, marker_name: str) -> None:
    """Retire a committed step: its marker first (made durable), then its files.

    :raises OSError: the marker could not be removed: the step is still committed.  Files
        left once the marker is gone are only logged (swept at the next start).
    """
    with _existing_step_dir(dir_fd, name) as step_fd:
        if step_fd is None:
            return
        _unlink(marker_name, step_fd)
        try:
            os.fsync(step_fd)
            for entry in marker.files:
                _unlink(entry.name, step_fd)
        except OSError as exc:
            log.warning(
                "cannot delete the files of step directory %s (swept at the next start): %s", name, exc
            )
            return
    try:
        if _remove_dir_if_empty(name, dir_fd):
            os.fsync(dir_fd)
    except OSError as exc:
        log.warning("cannot remove the step directory %s: %s", name, exc)


def _discard_uncommitted(dir_fd: int, name: str, data_name: str) -> None:
    with _existing_step_dir(dir_fd, name) as step_fd:
        if step_fd is None:
            return
        _unlink(data_name, step_fd)
    _remove_dir_if_empty(name, dir_fd)


# -- loading --------------------------------------------------------------------------------


def _header_check(
    path: Path, *, step: int, rank: int, checkpoint_id: str | None, entry: _FileEntry | None
) -> Callable[[ReplicaHeader], None]:
    def check(header: ReplicaHeader) -> None:
        if header.step != step or header.owner_rank != rank:
            raise IntegrityError(
                f"{path} holds step {header.step} of rank {header.owner_rank}, not step {step} of rank {rank}"
            )
        if checkpoint_id is not None and header.checkpoint_id != checkpoint_id:
            raise IntegrityError(
                f"{path} is checkpoint {header.checkpoint_id!r}, the commit marker names {checkpoint_id!r}"
            )
        if entry is not None and (
            header.total_nbytes != entry.nbytes or _storages_crc32c(header) != entry.storages_crc32c
        ):
            raise IntegrityError(f"{path} does not match its commit marker (size or checksums)")

    return check


# -- reading a directory from outside a Checkpointer (``astage ls`` / ``inspect``) ----------

LayoutRole = Literal["checkpoint", "marker"]
"""What a file in a step directory is: a rank's checkpoint file or its commit marker."""

_LAYOUT_NAME_RE: Final = re.compile(r"\Arank([0-9]{5,10})\.(?:astage|COMMITTED)\Z")


def step_of_dir(name: str) -> int | None:
    """The step a step directory's name stands for (``step_0000000042`` -> 42), or ``None``."""
    return _step_of(name)


def layout_role(name: str) -> tuple[LayoutRole, int] | None:
    """What ``name`` is inside a step directory, and for which rank; ``None`` if not astage's."""
    match = _LAYOUT_NAME_RE.match(name)
    if match is None or (rank := int(match.group(1))) >= _RANK_LIMIT:
        return None
    data_name, marker_name = _names(rank)
    return ("checkpoint", rank) if name == data_name else ("marker", rank) if name == marker_name else None


def check_committed(
    step_dir: Path, marker: _Marker, *, verify: bool, on_read: Callable[[int], None] | None = None
) -> None:
    """Check that every file a commit marker names is there and matches it (blocking).

    Without ``verify`` only each file's header is read and compared with the marker (size,
    storage checksums); with it every byte is read and every checksum verified, as
    :meth:`Checkpointer.restore` would.

    :param on_read: passed to :func:`~astage._persist.load_replica_sync` (progress).
    :raises IntegrityError: a file does not match its marker or is corrupt.
    :raises OSError: a file is missing or cannot be read.
    """
    for entry in marker.files:
        path = step_dir / entry.name
        check = _header_check(
            path, step=marker.step, rank=marker.rank, checkpoint_id=marker.checkpoint_id, entry=entry
        )
        check(inspect_replica(path).header)
        if verify:
            load_replica_sync(path, on_read=on_read)


# -- the Checkpointer -----------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Job:
    """One save from staging to commit (or failure)."""

    step: int
    checkpoint_id: str
    started: float
    staging_seconds: float
    backpressure_seconds: float
    stage_stats: StageStats | None
    previous: anyio.Event | None
    staged: Any = None
    layout: ReplicaLayout | None = None
    entry: _FileEntry | None = None
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    written: bool = False
    committed: bool = False
    nbytes: int = 0
    persist_seconds: float = 0.0
    replicate_seconds: float | None = None
    stats: SaveStats | None = None
    error: AstageError | None = None
    reported: bool = False


class SaveHandle:
    """A save that was staged: :meth:`wait` for its commit.

    :ivar step: the step being saved.
    :ivar checkpoint_id: the unique id recorded in its file and marker.
    :ivar staging_seconds: how long ``save()`` kept the caller.
    """

    def __init__(self, job: _Job) -> None:
        self._job = job
        self.step = job.step
        self.checkpoint_id = job.checkpoint_id
        self.staging_seconds = job.staging_seconds

    @property
    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._job.done.is_set()

    @property
    def stats(self) -> SaveStats | None:
        """The stats once committed, else ``None``."""
        return self._job.stats

    async def wait(self) -> SaveStats:
        """Wait until this save is committed.

        A failure raised here is not raised again by the Checkpointer's ``save``/``wait``.

        :returns: the save's stats.
        :raises PersistError: the save failed and was not committed (names the step).
        """
        await self._job.done.wait()
        if self._job.stats is None:
            self._job.reported = True
            assert self._job.error is not None
            raise self._job.error
        return self._job.stats

    def __repr__(self) -> str:
        state = "committed" if self.stats else ("failed" if self.done else "in flight")
        return f"<SaveHandle step={self.step} {state}>"


def _drop_frames(exc: BaseException) -> None:
    """Clear the locals of the finished frames in ``exc``'s tracebacks (and its causes').

    They would keep the encoded replica, and through it the staged buffers, alive for as
    long as the error is kept; the tracebacks still show where it happened.
    """
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__


@contextlib.contextmanager
def _frames_dropped() -> Iterator[None]:
    """Drop the frames of whatever escapes the block (see :func:`_drop_frames`)."""
    try:
        yield
    except BaseException as exc:
        _drop_frames(exc)
        raise


def _check_step(step: object) -> int:
    if type(step) is not int or not 0 <= step < _INT64:
        raise ConfigurationError(f"step must be an int in [0, 2**63), got {step!r}")
    return step


class Checkpointer:
    """Asynchronous checkpoints with commit markers, retention and replica fallback.

    ::

        async with astage.Checkpointer("ckpt", keep=3) as ckpt:
            if ckpt.latest() is not None:
                model.load_state_dict((await ckpt.restore())["model"])
            for step in range(start, steps):
                train_step()
                if step % 100 == 0:
                    await ckpt.save(step, {"model": model.state_dict()})  # returns once staged
        # leaving the block waits for in-flight saves

    Cancelling the scope around the ``async with`` abandons in-flight saves (nothing of
    them is committed); ``await ckpt.wait()`` first to keep them.  Meant for one live
    Checkpointer per directory and rank; several ranks may share a directory.

    :param directory: where checkpoints live; created (mode 0700) if missing.
    :param stager: stages the state_dicts; default: a :class:`DefaultStager` that the
        Checkpointer creates and closes.  A stager passed in is not closed.
    :param replication: called with each staged copy after the local write (see
        :class:`Replicator`); not closed by the Checkpointer.
    :param keep: committed steps to keep (the highest; the step just saved is always
        kept); ``None`` keeps all.
    :param max_in_flight: saves that may be persisting at once; more ``save`` calls wait.
    :param rank: this process's rank; names its files and the replicas it restores from.
    :param on_progress: called on the event loop with a :class:`SaveEvent` at each stage
        of each save; keep it quick.  Its exceptions are logged and ignored.
    :param fallback_dirs: directories holding replicas (``*.astage``) that
        :meth:`restore` may use when the local copy is missing or corrupt.
    :param threads: worker threads for encoding and file I/O.
    :raises ConfigurationError: an argument is out of range.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        stager: AsyncStager | None = None,
        replication: Replicator | None = None,
        keep: int | None = 3,
        max_in_flight: int = 1,
        rank: int = 0,
        on_progress: Callable[[SaveEvent], object] | None = None,
        fallback_dirs: Iterable[str | os.PathLike[str]] = (),
        threads: int = 2,
    ) -> None:
        for name, value, lo in (
            ("max_in_flight", max_in_flight, 1),
            ("threads", threads, 1),
            ("rank", rank, 0),
        ):
            if type(value) is not int or value < lo:
                raise ConfigurationError(f"{name} must be an int >= {lo}, got {value!r}")
        if rank >= _RANK_LIMIT:
            raise ConfigurationError(f"rank must be below 2**31, got {rank}")
        if keep is not None and (type(keep) is not int or keep < 1):
            raise ConfigurationError(f"keep must be an int >= 1 or None, got {keep!r}")
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
        fallbacks = tuple(check_path(f"fallback_dirs[{i}]", d) for i, d in enumerate(fallback_dirs))
        self._directory = check_path("directory", directory)
        self._owns_stager = stager is None
        self._stager: AsyncStager = DefaultStager() if stager is None else stager
        self._replication = replication
        self._share_encoded = replication is not None and _takes_encoded(replication)
        self._keep = keep
        self._max_in_flight = max_in_flight
        self._rank = rank
        self._on_progress = on_progress
        self._fallback_dirs = fallbacks
        self._threads = threads
        self._data_name, self._marker_name = _names(rank)
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._committed: dict[int, _Marker] = {}
        self._reserved: set[int] = set()  # steps between the start of save() and their end
        self._jobs: dict[int, _Job] = {}
        self._unreported: list[_Job] = []
        self._last_done: anyio.Event | None = None
        self._idle: anyio.Event | None = None
        self._lock_fd: int | None = None
        self._dir_fd: int | None = None  # the checkpoint directory: step directories are opened from it
        self._undeletable: set[int] = set()  # steps retention failed to delete (warned once)
        self._task_group: anyio.abc.TaskGroup | None = None
        self._slots: anyio.Semaphore | None = None
        self._limiter: anyio.CapacityLimiter | None = None
        self.last_stats: SaveStats | None = None
        """The stats of the latest committed save."""

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Open the directory: take the lock, sweep crashed runs' leftovers, index commits.

        :raises ConfigurationError: the path is not a directory.
        :raises ResourceError: another Checkpointer holds this directory for this rank.
        :raises PersistError: the directory cannot be created, locked or listed.
        :raises ClosedError: already entered.
        """
        if self._state != "new":
            raise ClosedError("a Checkpointer can be entered only once")
        self._limiter = anyio.CapacityLimiter(self._threads)
        self._dir_fd, self._lock_fd = await blocking_io(
            _open_directory, self._directory, self._rank, limiter=self._limiter
        )
        try:
            self._committed = await blocking_io(
                _scan, self._directory, self._dir_fd, self._rank, limiter=self._limiter
            )
            task_group = anyio.create_task_group()
            await task_group.__aenter__()
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._release_lock()
            if isinstance(exc, OSError) and not isinstance(exc, AstageError):
                raise PersistError(f"cannot scan the checkpoint directory {self._directory}: {exc}") from exc
            raise
        self._task_group = task_group
        self._slots = anyio.Semaphore(self._max_in_flight)
        self._state = "open"
        log.debug("opened %s for rank %d: committed steps %s", self._directory, self._rank, self.steps())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task_group = self._task_group
        try:
            await self._close(report=exc is None)
        finally:
            if task_group is not None:
                self._task_group = None
                # The saves are drained: only a cancellation is the task group's business.
                # Another error from the block must reach the caller as it is, not in a group.
                try:
                    if isinstance(exc, anyio.get_cancelled_exc_class()):
                        await task_group.__aexit__(exc_type, exc, tb)
                    else:
                        await task_group.__aexit__(None, None, None)
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._close_dir()

    async def aclose(self) -> None:
        """Wait for in-flight saves, then close the stager it created and the lock.

        Idempotent.  Leaving ``async with`` calls it.

        :raises PersistError: a save failed and was not yet reported (names the step);
            everything is closed first.
        """
        await self._close(report=True)

    async def _close(self, *, report: bool) -> None:
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._state = "closing"
        try:
            if report:
                await self.wait()
            else:
                await self._drain()
        finally:
            if not self.closed:  # a concurrent aclose() may have finished
                with anyio.CancelScope(shield=True):
                    if self._owns_stager:
                        await self._stager.aclose()
                    await self._release_lock()
                self._state = "closed"
            if not report:
                for job in self._take_unreported():
                    log.error("checkpoint step %d failed and was never reported: %s", job.step, job.error)

    async def _release_lock(self) -> None:
        """Close the lock, and the directory unless an abandoned save's cleanup still runs
        (relative to it): ``__aexit__`` closes it once the task group is done."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            await blocking_io(os.close, fd, limiter=self._limiter)
        if not self._jobs:
            await self._close_dir()

    async def _close_dir(self) -> None:
        fd, self._dir_fd = self._dir_fd, None
        if fd is not None:
            await blocking_io(os.close, fd, limiter=self._limiter)

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has finished."""
        return self._state == "closed"

    def _check_open(self, what: str) -> anyio.abc.TaskGroup:
        if self._state == "new" or self._task_group is None:
            raise ClosedError(f"{what}() needs an open Checkpointer: use `async with Checkpointer(...)`")
        if self._state != "open":
            raise ClosedError(f"{what}() called on a closed Checkpointer")
        return self._task_group

    # -- what is committed -----------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._directory

    @property
    def rank(self) -> int:
        """The rank whose files this Checkpointer writes and restores."""
        return self._rank

    def steps(self) -> list[int]:
        """This rank's committed steps, oldest first (known since entering; no I/O)."""
        return sorted(self._committed)

    def latest(self) -> int | None:
        """The newest committed step, or ``None``."""
        return max(self._committed, default=None)

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Steps staged and not yet committed or failed, in save order."""
        return tuple(self._jobs)

    def step_dir(self, step: int) -> Path:
        """The directory of ``step``'s files."""
        return self._directory / f"step_{_check_step(step):010d}"

    # -- saving --------------------------------------------------------------------------

    async def save(self, step: int, state_dict: Any) -> SaveHandle:
        """Stage ``state_dict`` and return; writing, replication and the commit go on.

        Waits first while ``max_in_flight`` saves are persisting.  Once this returns, the
        caller may change its tensors: the checkpoint holds the state as of this call.

        With replication, every rank must make the same sequence of saves: a ``save`` that
        raised has not happened, so retry it.

        :returns: a handle to await the commit and read the stats.
        :raises PersistError: an earlier save failed (names its step); nothing was saved.
        :raises ConfigurationError: ``step`` is negative, not an int, in flight or committed.
        :raises ClosedError: the Checkpointer is not open.
        :raises UnsupportedInputError: the stager cannot stage ``state_dict``, or the
            replica format cannot store a value in it (names its key path; checked here, so
            nothing of it fails later), and the stager's other errors, e.g.
            :class:`CapacityError`.
        """
        task_group = self._check_open("save")
        self._raise_unreported()
        _check_step(step)
        if step in self._reserved or step in self._committed:
            state = "being saved" if step in self._reserved else "committed"
            raise ConfigurationError(f"step {step} is already {state} in {self._directory}")
        assert self._slots is not None
        started = time.perf_counter()
        self._reserved.add(step)
        handed_off = False
        try:
            await self._slots.acquire()
            try:
                waited = time.perf_counter() - started
                staged = await self._stager.stage(state_dict)
                checkpoint_id = uuid.uuid4().hex
                try:
                    layout = await self._lay_out(staged, step, checkpoint_id)
                except BaseException:
                    staged = None  # given back by _lay_out; the traceback keeps this frame
                    raise
                stats = getattr(self._stager, "last_stats", None)
                job = _Job(
                    step=step,
                    checkpoint_id=checkpoint_id,
                    started=started,
                    staging_seconds=time.perf_counter() - started,
                    backpressure_seconds=waited,
                    stage_stats=stats if isinstance(stats, StageStats) else None,
                    previous=self._last_done,
                    staged=staged,
                    layout=layout,
                )
                del staged, layout
                previous_done, self._last_done = self._last_done, job.done
                self._jobs[step] = job
                try:
                    task_group.start_soon(self._persist, job, name=f"astage checkpoint step {step}")
                except BaseException:
                    del self._jobs[step]
                    self._last_done = previous_done
                    with anyio.CancelScope(shield=True):
                        await self._release_staged(job)
                    raise
                handed_off = True
            finally:
                if not handed_off:
                    self._slots.release()
        finally:
            if not handed_off:
                self._unreserve(step)
        self._emit("staged", job)
        return SaveHandle(job)

    async def wait(self) -> None:
        """Wait until no save is in flight.

        :raises PersistError: a save failed and was not yet reported (names the step).
        """
        await self._drain()
        self._raise_unreported()

    async def _drain(self) -> None:
        while self._reserved:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    def _unreserve(self, step: int) -> None:
        self._reserved.discard(step)
        if not self._reserved and self._idle is not None:
            self._idle.set()
            self._idle = None

    def _take_unreported(self) -> list[_Job]:
        jobs = [job for job in self._unreported if not job.reported]
        self._unreported.clear()
        for job in jobs:
            job.reported = True
        return jobs

    def _raise_unreported(self) -> None:
        jobs = self._take_unreported()
        if not jobs:
            return
        first = jobs[0].error
        assert first is not None
        if len(jobs) > 1:
            others = ", ".join(str(job.step) for job in jobs[1:])
            raise PersistError(f"{first} (also failed: step{'s' * (len(jobs) > 2)} {others})") from first
        raise first

    # -- the persisting task -------------------------------------------------------------

    async def _persist(self, job: _Job) -> None:
        try:
            await self._write_and_commit(job)
        except Exception as exc:  # reported to the caller, never into the task group
            if job.committed:  # a commit stands once its marker is durable
                log.warning("step %d is committed, but what followed the commit failed: %s", job.step, exc)
            else:
                self._fail(job, exc)
        except BaseException as exc:
            _drop_frames(exc)
            if not job.committed:
                job.error = PersistError(
                    f"checkpoint step {job.step} was abandoned (cancelled); not committed"
                )
                job.reported = True
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._release_staged(job)
                if job.written and not job.committed:
                    await self._discard(job)
            job.done.set()
            assert self._slots is not None
            self._slots.release()
            del self._jobs[job.step]
            self._unreserve(job.step)

    async def _write_local(self, job: _Job, encoded: Encoded, begin: float) -> _FileEntry:
        """Write this rank's file durably (not yet committed)."""
        try:
            entry = _FileEntry(self._data_name, encoded.total_nbytes, _storages_crc32c(encoded.header))
            job.written = True  # from here on, a file may exist that must not outlive a failure
            await write_replica(
                self.step_dir(job.step) / self._data_name,
                encoded,
                limiter=self._limiter,
                open_dir=self._step_dir_opener(job.step),
            )
            # The step directory's entry is durable before anything in it is committed.
            await blocking_io(os.fsync, self._dir_fd, limiter=self._limiter)
        finally:
            del encoded  # it views the staged buffers, which go back to the stager
        job.nbytes = entry.nbytes
        job.persist_seconds = time.perf_counter() - begin
        self._emit("persisted", job)
        return entry

    async def _write_and_commit(self, job: _Job) -> None:
        # The local write and the replication run side by side.  Replication is called for
        # every staged save, in save order, even when the local write failed: every rank
        # must make the same sequence of calls, or the peers' exchanges fall out of step.
        failures: dict[str, Exception] = {}
        begin = time.perf_counter()
        layout, job.layout = job.layout, None
        assert layout is not None
        # Encoded and checksummed once, for the local file and (relabelled) the replica.
        # It views the staged buffers, which go back to the stager: dropped before that.
        encoded: Encoded | None = None
        try:
            with _frames_dropped():
                encoded = await run_sync(layout.encode, limiter=self._limiter)
        except Exception as exc:
            failures["local"] = exc
        del layout

        async def write_local(box: list[Encoded]) -> None:
            try:
                with _frames_dropped():
                    job.entry = await self._write_local(job, box.pop(), begin)
            except Exception as exc:
                failures["local"] = exc

        try:
            async with anyio.create_task_group() as tg:
                if encoded is not None:
                    tg.start_soon(write_local, [encoded])
                if job.previous is not None:
                    await job.previous.wait()  # replicate and commit in save order
                if self._replication is not None:
                    shared = {"encoded": encoded} if self._share_encoded and encoded is not None else {}
                    encoded = None
                    replicate_begin = time.perf_counter()
                    try:
                        with _frames_dropped():
                            await self._replication.replicate_staged(
                                job.staged, step=job.step, checkpoint_id=job.checkpoint_id, **shared
                            )
                    except Exception as exc:
                        failures["replication"] = exc
                    else:
                        job.replicate_seconds = time.perf_counter() - replicate_begin
                        self._emit("replicated", job)
                    finally:
                        shared.clear()
                encoded = None
        finally:
            encoded = None
        if "local" in failures and "replication" in failures:
            log.error("replicating step %d failed as well: %s", job.step, failures["replication"])
        if failures:
            raise failures.get("local") or failures["replication"]
        assert job.entry is not None
        await self._release_staged(job)
        marker = _Marker(job.step, self._rank, job.checkpoint_id, time.time(), (job.entry,))
        marker_path = self.step_dir(job.step) / self._marker_name
        with anyio.CancelScope(shield=True):  # small, and once renamed it is committed
            await write_replica(
                marker_path,
                [marker.to_json()],
                limiter=self._limiter,
                open_dir=self._step_dir_opener(job.step),
            )
            # The step directory's entry is durable before anything in it is committed.
            await blocking_io(os.fsync, self._dir_fd, limiter=self._limiter)
            job.committed = True
            self._committed[job.step] = marker
        job.stats = SaveStats(
            step=job.step,
            nbytes=job.nbytes,
            staging_seconds=job.staging_seconds,
            backpressure_seconds=job.backpressure_seconds,
            persist_seconds=job.persist_seconds,
            replicate_seconds=job.replicate_seconds,
            total_seconds=time.perf_counter() - job.started,
            stage=job.stage_stats,
        )
        self.last_stats = job.stats
        log.info(
            "committed step %d: %d bytes, caller blocked %.4fs, persisted in %.4fs (%.2f GB/s)",
            job.step,
            job.nbytes,
            job.staging_seconds,
            job.persist_seconds,
            job.stats.gbps,
        )
        self._emit("committed", job)
        await self._retire_old(job.step)

    async def _lay_out(self, staged: Any, step: int, checkpoint_id: str) -> ReplicaLayout:
        """Check the staged copy against the replica format and lay it out, before ``save()``
        returns: what the background task could not write is refused here, with its key
        path.  The walk is the one encoding needs anyway; only the checksums are left for
        the background.  On any error the copy goes back to the stager."""
        try:
            return await run_sync(
                functools.partial(
                    lay_out, staged, owner_rank=self._rank, step=step, checkpoint_id=checkpoint_id
                ),
                limiter=self._limiter,
            )
        except BaseException as exc:
            _drop_frames(exc)
            with anyio.CancelScope(shield=True):
                await self._give_back(staged, step)
            # This frame stays in the error's traceback: it must not keep the copy it gave
            # back, which the stager may hand out again (a released copy is refilled).
            staged = None
            raise

    async def _release_staged(self, job: _Job) -> None:
        staged, job.staged, job.layout = job.staged, None, None
        await self._give_back(staged, job.step)

    async def _give_back(self, staged: Any, step: int) -> None:
        if staged is not None and isinstance(self._stager, _Releasing):
            try:
                await self._stager.release(staged)
            except Exception:
                log.exception("releasing the staged copy of step %d failed", step)

    async def _discard(self, job: _Job) -> None:
        try:
            await blocking_io(
                _discard_uncommitted,
                self._dir_fd,
                self.step_dir(job.step).name,
                self._data_name,
                limiter=self._limiter,
            )
        except OSError as exc:
            log.warning(
                "cannot remove the uncommitted files of step %d (swept at the next start): %s", job.step, exc
            )

    def _fail(self, job: _Job, exc: Exception) -> None:
        _drop_frames(exc)
        error = PersistError(f"checkpoint step {job.step} failed and was not committed: {exc}")
        error.__cause__ = exc
        job.error = error
        self._unreported.append(job)
        # One line, no traceback: the caller gets the error itself, traceback and all (next
        # save, wait or handle.wait); the log only says that it happened and why.
        log.error("checkpoint step %d failed and was not committed: %r", job.step, exc)
        self._emit("failed", job)

    async def _retire_old(self, just_committed: int) -> None:
        """Delete the committed steps beyond ``keep``.

        A step that cannot be deleted stays committed (``latest``/``restore`` see it) and
        is tried again after the next commit; its failure is logged once as a warning and
        never fails a save: the save that triggered retention is committed already.
        """
        if self._keep is None:
            return
        kept = set(sorted(self._committed, reverse=True)[: self._keep]) | {just_committed}
        for step in sorted(set(self._committed) - kept):
            try:
                await blocking_io(
                    _delete_step,
                    self._dir_fd,
                    self.step_dir(step).name,
                    self._committed[step],
                    self._marker_name,
                    limiter=self._limiter,
                )
            except Exception as exc:
                if step not in self._undeletable:
                    self._undeletable.add(step)
                    log.warning(
                        "retention (keep=%d) cannot delete step %d, which stays committed: %s",
                        self._keep,
                        step,
                        exc,
                    )
                continue
            del self._committed[step]
            self._undeletable.discard(step)
            log.info("deleted the checkpoint of step %d (keep=%d)", step, self._keep)

    def _step_dir_opener(self, step: int) -> Callable[[], int]:
        """Opens (creating it if need be) ``step``'s directory, never through a link."""
        assert self._dir_fd is not None
        return functools.partial(_open_step_dir, self._dir_fd, self.step_dir(step).name, create=True)

    def _emit(self, kind: EventKind, job: _Job) -> None:
        if self._on_progress is None:
            return
        event = SaveEvent(
            kind=kind,
            step=job.step,
            checkpoint_id=job.checkpoint_id,
            elapsed_seconds=time.perf_counter() - job.started,
            stats=job.stats if kind == "committed" else None,
            error=job.error if kind == "failed" else None,
        )
        try:
            self._on_progress(event)
        except Exception:
            log.exception("the on_progress callback failed on %s of step %d", kind, job.step)

    # -- restoring -----------------------------------------------------------------------

    async def restore(self, step: int | None = None, *, collective: bool | None = None) -> Any:
        """Load the state_dict of ``step`` (default: the latest committed), tensors on the CPU.

        **Collective** (``collective=True``; the default when ``replication`` is a
        :class:`~astage.ReplicationStager` and no ``fallback_dirs`` are given): every rank of
        the replication group calls ``restore`` at the same time; the ranks agree on the
        newest step that every rank can restore (or check ``step``), from its own files or
        from the replica its ring holder keeps, and every rank gets that step back.  A rank
        whose files are missing or corrupt receives its state from its holder over the
        process group, checksum-verified as it lands, and commits it locally again.  See
        :mod:`astage._restore` and the replication guide.

        **Local** (otherwise): the local file is checked against its commit marker and its
        checksums.  If it is missing or corrupt, or the step is not committed here, the
        newest valid replica of this rank's ``step`` is used: from the replication object's
        ``fetch_replica`` if it has one, then from ``fallback_dirs`` (a shared file system).

        :raises ResourceError: nothing is committed, or the step is neither committed
            here nor found among the replicas.
        :raises IntegrityError: every copy found is corrupt or does not match (each named).
        :raises ClosedError: the Checkpointer is not open.
        :raises PeerTimeoutError: (collective) a peer did not take part within the timeout.
        :raises TransportError: (collective) a peer failed; the group is then broken.
        :raises ConfigurationError: ``collective=True`` without a ReplicationStager.
        """
        self._check_open("restore")
        if collective is None or collective:
            from ._replication import ReplicationStager

            if isinstance(self._replication, ReplicationStager) and (collective or not self._fallback_dirs):
                from ._restore import collective_restore

                return await collective_restore(
                    self, self._replication, None if step is None else _check_step(step)
                )
            if collective:
                raise ConfigurationError("restore(collective=True) needs replication=ReplicationStager(...)")
        if step is None:
            step = self.latest()
            if step is None:
                raise ResourceError(f"no committed checkpoint of rank {self._rank} in {self._directory}")
        _check_step(step)
        marker = self._committed.get(step)
        problems: list[str] = []
        if marker is not None:
            path = self.step_dir(step) / marker.files[0].name
            check = _header_check(
                path, step=step, rank=self._rank, checkpoint_id=marker.checkpoint_id, entry=marker.files[0]
            )
            try:
                return await self._load_local(step, path, check)
            except (IntegrityError, OSError) as exc:
                log.warning("the local checkpoint of step %d is unusable, trying replicas: %s", step, exc)
                problems.append(str(exc))
        for path in await self._replica_candidates(step, problems):
            check = _header_check(
                path,
                step=step,
                rank=self._rank,
                checkpoint_id=None if marker is None else marker.checkpoint_id,
                entry=None,
            )
            try:
                state = await load_replica(path, limiter=self._limiter, check=check)
            except (IntegrityError, OSError) as exc:
                log.warning("replica %s is unusable: %s", path, exc)
                problems.append(str(exc))
                continue
            log.warning("restored step %d of rank %d from the replica %s", step, self._rank, path)
            return state
        if not problems:
            raise ResourceError(
                f"step {step} of rank {self._rank} is not committed in {self._directory} "
                "and no replica of it was found"
            )
        where = (
            "its local copy and every replica found are" if marker is not None else "every replica found is"
        )
        raise IntegrityError(
            f"cannot restore step {step} of rank {self._rank}: {where} unusable: " + "; ".join(problems)
        )

    async def _load_local(self, step: int, path: Path, check: Callable[[ReplicaHeader], None]) -> Any:
        """Load ``path``, this rank's file of ``step``, never through a link.

        :raises PersistError: the step directory is a link or not a directory.
        :raises IntegrityError: the file is not a regular file, is corrupt, or fails ``check``.
        """
        assert self._dir_fd is not None
        opener = functools.partial(_open_step_dir, self._dir_fd, self.step_dir(step).name, create=False)
        step_fd = await blocking_io(opener, limiter=self._limiter)
        try:
            return await load_replica(path, limiter=self._limiter, check=check, dir_fd=step_fd)
        finally:
            with anyio.CancelScope(shield=True):
                await blocking_io(os.close, step_fd, limiter=self._limiter)

    async def _replica_candidates(self, step: int, problems: list[str]) -> list[Path]:
        paths: list[Path] = []
        if isinstance(self._replication, ReplicaSource):
            try:
                fetched = await self._replication.fetch_replica(step)
            except Exception as exc:  # a peer may be gone: the fallback directories may still help
                log.warning("fetching the replica of step %d failed: %s", step, exc)
                problems.append(f"fetch_replica({step}) failed: {exc!r}")
                fetched = None
            if fetched is not None:
                paths.append(Path(fetched))
        for directory in self._fallback_dirs:
            try:
                found = await blocking_io(find_replicas, directory, limiter=self._limiter)
            except OSError as exc:
                log.warning("cannot list the replica directory %s: %s", directory, exc)
                continue
            paths += [r.path for r in found if r.owner_rank == self._rank and r.step == step]
        return list(dict.fromkeys(paths))
