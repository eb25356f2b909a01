"""Durable replica files: crash-safe writes, sweeping, finding and loading.

A replica is written to a unique temp file in its target directory
(``.{final name}.astage-tmp.{32 hex digits}``, created with ``O_EXCL``, mode 0600), fsynced,
renamed over its final name with :func:`os.replace`, and the directory is fsynced.  Blocking
calls run in worker threads, in chunks of :data:`CHUNK_NBYTES`, so the event loop stays free
and cancellation is prompt: under asyncio through aiofiles' executor wrappers, under trio
(where aiofiles cannot run) through ``anyio.to_thread`` (see :func:`blocking_io`).

Invariants:

* The final path only ever holds a complete, fsynced replica: the old one or the new one,
  whatever happens (error, cancellation, a crash at any instruction).
* Whatever fails before the rename, cancellation included, the temp file is removed under a
  cancel shield and :class:`PersistError` names the step that failed (open, write, fsync,
  close, replace, dir-fsync) and the path.  A failed fsync is never retried: the kernel may
  already have dropped the dirty pages, so a retry could report success over lost data.
* A worker thread always finishes its chunk before the file descriptor is closed; cleanup
  never races a write.
* Only files named like astage's own temps are ever swept.
* Loading validates everything (:mod:`astage._format.codec`) and checks that the file is exactly
  as long as its header says before allocating the body.
* Nothing below the directory a caller names is followed: the temp file is created and
  renamed relative to a descriptor of its directory, never through a symbolic link, and
  every file is read only once opened without following a link and found to be a regular
  file (:func:`open_regular`).  A FIFO or device cannot block a worker thread, and a link
  planted in the directory cannot lead a write, a read or a deletion outside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import aiofiles.os
import anyio
import anyio.abc
import anyio.lowlevel
import sniffio

from .._format.codec import (
    Encoded,
)
from .._util.errors import ClosedError, ConfigurationError, PersistError
from .._util.limits import CHUNK_BYTES
from .._util.resource import AsyncResource
from .._util.threads import Call, run_sync

T = TypeVar("T")

log = logging.getLogger("astage.persist")

CHUNK_NBYTES: Final = CHUNK_BYTES
"""Most bytes one worker-thread call reads or writes: bounds how late cancellation lands."""

FILE_SUFFIX: Final = ".astage"
"""File name suffix of every replica :func:`find_replicas` looks at."""

_TEMP_RE: Final = re.compile(r"\A\..+\.astage-tmp\.[0-9a-f]{32}\Z", re.DOTALL)

BytesLike = bytes | bytearray | memoryview
"""A buffer :class:`CheckpointFileWriter` accepts."""

_Step = Literal["open", "write", "fsync", "close", "replace", "dir-fsync"]


def replica_path(
    storage_dir: str | os.PathLike[str], *, owner_rank: int, holder_rank: int, step: int | None = None
) -> Path:
    """Where the replica of ``owner_rank``'s state kept by ``holder_rank`` lives.

    ``replica-owner{owner:05d}-holder{holder:05d}.astage``: one file per owner and holder, a
    newer replica replaces the older one atomically.  With ``step``, one file per step:
    ``replica-owner{owner:05d}-holder{holder:05d}-step{step:010d}.astage``.
    """
    name = f"replica-owner{owner_rank:05d}-holder{holder_rank:05d}"
    if step is not None:
        name += f"-step{step:010d}"
    return Path(storage_dir) / f"{name}{FILE_SUFFIX}"


def temp_path_for(path: Path) -> Path:
    """A fresh temp name for writing ``path``: same directory, recognisable by the sweeper."""
    return path.with_name(f".{path.name}.astage-tmp.{uuid.uuid4().hex}")


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of astage's temp file names."""
    return _TEMP_RE.match(name) is not None


# -- writing ------------------------------------------------------------------------------


async def blocking_io(fn: Callable[..., T], *args: Any, limiter: anyio.CapacityLimiter | None = None) -> T:
    """Run a blocking file call in a worker thread and wait for it, even if cancelled.

    The call holds one of ``limiter``'s tokens (when given) on every backend: under asyncio
    it runs through aiofiles' executor wrapper once the token is held, under any other
    anyio backend in an anyio worker thread under the limiter.  Either way a cancellation
    is delivered only once the call has returned, never while it may still touch a
    descriptor that cleanup would close (and the OS could hand to another file).  The worker
    thread keeps no reference to the arguments (views of staged buffers, when writing) or
    the result once this returns (see :mod:`astage._util.threads`).
    """
    if sniffio.current_async_library() == "asyncio":
        # A pending cancellation is delivered before the call starts (waiting for a token
        # included); once started, the call's result is always returned (a file it created
        # must reach its cleanup).
        await anyio.lowlevel.checkpoint_if_cancelled()
        call = Call(fn, *args)
        del fn, args
        async with limiter if limiter is not None else contextlib.nullcontext():
            with anyio.CancelScope(shield=True):
                await aiofiles.os.wrap(call.run)()
        return call.take()
    return await run_sync(fn, *args, limiter=limiter)


def make_dirs(directory: Path) -> list[Path]:
    missing = []
    while not directory.is_dir():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    created = []
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        created.append(d)
    return created


DirOpener = Callable[[], int]
"""A blocking call that returns a new descriptor of a writer's directory (closed by the writer)."""

_OPEN_RETRIES: Final = 1000
"""Attempts at creating a temp file whose directory vanishes meanwhile (see :func:`_create_temp`)."""


def make_dirs_durable(directory: Path) -> None:
    """Create ``directory`` and its missing parents, mode 0700, and fsync where they were made."""
    created = make_dirs(directory)
    if created:
        fsync_dirs(sorted({d.parent for d in created}))


def open_directory(directory: Path) -> int:
    """Create ``directory`` if missing (mode 0700, made durable) and open it.

    The path itself is the caller's and is followed like any path a user names.
    """
    make_dirs_durable(directory)
    return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def create_new(name: str, dir_fd: int) -> int:
    """Create ``name`` in ``dir_fd`` for writing, owner-only; never an existing file or
    through a link (``O_EXCL | O_NOFOLLOW``)."""
    return os.open(
        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
    )


def _create_temp(open_dir: DirOpener, name: str) -> tuple[int, int]:
    """Open the directory and create the temp file ``name`` in it: ``(dir fd, file fd)``.

    Several ranks may share a directory, and one may remove a directory that is empty for
    an instant (its retention, its start-up) between another's opening it and creating
    its temp file there, which then fails with ``ENOENT``.  Opening the directory again
    (the opener creates it again) is safe: nothing was written yet.  Each attempt lasts
    a few system calls, so losing a thousand in a row takes a deliberate adversary.
    """
    for attempt in range(_OPEN_RETRIES):
        try:
            dir_fd = open_dir()
        except FileNotFoundError:
            if attempt + 1 == _OPEN_RETRIES:
                raise
            continue
        try:
            fd = create_new(name, dir_fd)
        except FileNotFoundError:
            os.close(dir_fd)
            if attempt + 1 == _OPEN_RETRIES:
                raise
            log.debug("the directory of %s vanished before the temp file was created: again", name)
            continue
        except BaseException:
            os.close(dir_fd)
            raise
        return dir_fd, fd
    raise AssertionError("unreachable")  # pragma: no cover


_SYNC_FILE_RANGE_WRITE: Final = 2
_IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16
"""Most buffers one ``writev`` takes (Linux: 1024)."""


@functools.cache
def _sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _write_all(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Write ``buffers`` at the end of the file (at ``offset``), then start their write-back.

    Linux keeps written pages dirty until memory runs short or the final fsync, which then
    waits for all of them.  Written back as they come (``sync_file_range``, which starts
    the I/O and does not wait for it), the pages reach the disk while later chunks are still
    being produced (a replica streamed from a peer), and fsync finds little left to do.  The
    hint is advisory: its result is ignored, and fsync still reports any write error.
    """
    total = 0
    # Gathered writes: a replica of 20,000 small tensors is 40,000 buffers (storages and
    # their alignment gaps), which one write each made as many system calls.
    pending = [view for view in buffers if len(view)]
    first = 0
    while first < len(pending):
        group = pending[first : first + _IOV_MAX]
        n = os.write(fd, group[0]) if len(group) == 1 else os.writev(fd, group)
        total += n
        while n:  # past the buffers written whole, then into a partly written one
            size = len(pending[first])
            if n < size:
                pending[first] = pending[first][n:]
                break
            n -= size
            first += 1
    start_writeback = _sync_file_range()
    if start_writeback is not None and total:
        start_writeback(fd, offset, total, _SYNC_FILE_RANGE_WRITE)
    return total


def fsync_dirs(directories: list[Path]) -> None:
    for directory in directories:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _discard_file(fd: int | None, path: Path, dir_fd: int | None, *, created: bool) -> None:
    """Close the temp file, remove it (relative to its directory) if created, close that."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError as exc:
            log.warning("closing the temp file %s failed: %s", path, exc)
    if dir_fd is None:
        return
    try:
        if created:
            os.unlink(path.name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("removing the temp file %s failed: %s", path, exc)
    try:
        os.close(dir_fd)
    except OSError as exc:  # the descriptor is released whatever close() says
        log.warning("closing the directory of %s failed: %s", path, exc)


_BATCH_BUFFERS: Final = 256
"""Most buffers in one worker-thread write.  Each is a live memoryview until written, and
the objects alive when the collector runs are promoted: at 1,024 a batch, a save of
20,000 small storages promoted ~10,000 views, and every ~5 saves that pending count made
the collector walk the whole heap (100-130 ms, holding the GIL)."""
_EMPTY: Final = memoryview(b"")


def _batches(data: BytesLike | Iterable[BytesLike], chunk_nbytes: int) -> Iterator[list[memoryview]]:
    """Group buffers into lists of at most ``chunk_nbytes`` bytes (big ones are split) and
    :data:`_BATCH_BUFFERS` buffers.

    The grouping runs on the caller's thread (the event loop, for an async writer), about
    a microsecond a buffer: a file of 20,000 small storages is 40,000 buffers in one chunk,
    which held the loop ~45 ms in one go before a batch was also cut at
    :data:`_BATCH_BUFFERS` buffers.
    """
    buffers: Iterable[BytesLike] = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    batch: list[memoryview] = []
    size = 0
    for buf in buffers:
        if isinstance(buf, memoryview) and buf.format == "B" and buf.ndim == 1 and buf.c_contiguous:
            view = buf
        else:
            view = memoryview(buf).cast("B")
        while view:
            if len(view) <= chunk_nbytes - size:  # whole: no new view (see _BATCH_BUFFERS)
                piece, view = view, _EMPTY
            else:
                piece = view[: chunk_nbytes - size]
                view = view[len(piece) :]
            batch.append(piece)
            size += len(piece)
            if size == chunk_nbytes or len(batch) == _BATCH_BUFFERS:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


class CheckpointFileWriter(AsyncResource):
    """Stream bytes into a temp file next to ``path``; :meth:`commit` makes them durable there.

    ::

        async with CheckpointFileWriter(path) as writer:
            async for chunk in receive():
                await writer.write(chunk)
            await writer.commit()

    Leaving the block without :meth:`commit` (an error, cancellation) removes the temp file
    and leaves whatever was at ``path`` untouched.  The writer does not check what it is
    given: callers verify a replica (:func:`astage._format.codec.verify_body`) before committing.

    :param path: the final path; missing directories are created with mode 0700.
    :param limiter: worker-thread limiter for the blocking calls (default: anyio's).
    :param chunk_nbytes: most bytes written per worker-thread call.
    :param open_dir: a blocking call that opens (creating it if need be) the directory
        ``path`` lies in, for callers that must not follow links on the way there; it may
        be called again if the directory vanishes before the temp file is created.
        Default: :func:`open_directory` of ``path``'s parent.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        limiter: anyio.CapacityLimiter | None = None,
        chunk_nbytes: int = CHUNK_NBYTES,
        open_dir: DirOpener | None = None,
    ) -> None:
        if chunk_nbytes <= 0:
            raise ConfigurationError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
        self.path = Path(path)
        self.temp_path = temp_path_for(self.path)
        self.nbytes_written = 0
        self._limiter = limiter
        self._chunk = chunk_nbytes
        self._open_dir = open_dir or functools.partial(open_directory, self.path.parent)
        self._fd: int | None = None
        self._dir_fd: int | None = None
        self._created = False
        self._state: Literal["new", "open", "done"] = "new"
        self._started = 0.0

    async def _enter(self) -> None:
        await self.open()

    async def _run(self, step: _Step, fn: Any, *args: Any) -> Any:
        try:
            return await blocking_io(fn, *args, limiter=self._limiter)
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, OSError) and not isinstance(exc, PersistError):
                raise PersistError(f"{step} failed for {self.path}: {exc}") from exc
            raise

    async def open(self) -> None:
        """Create the directories and the temp file (done by ``async with``).

        :raises PersistError: the directory or the temp file cannot be created.
        :raises ClosedError: already opened, committed or discarded.
        """
        if self._state != "new":
            raise ClosedError(f"CheckpointFileWriter for {self.path} was already opened")
        self._state = "open"
        self._started = time.perf_counter()
        self._dir_fd, self._fd = await self._run("open", _create_temp, self._open_dir, self.temp_path.name)
        self._created = True

    def _check_open(self) -> int:
        if self._state != "open" or self._fd is None:
            raise ClosedError(
                f"CheckpointFileWriter for {self.path} is not open (committed, discarded or never opened)"
            )
        return self._fd

    async def write(self, data: BytesLike | Iterable[BytesLike]) -> None:
        """Append one buffer, or several in order; returns once they are all written.

        Small buffers are grouped so that each worker-thread call writes up to
        ``chunk_nbytes``: every buffer an iterable yields must stay unchanged until this
        returns (yield distinct buffers, not one buffer refilled).

        :raises PersistError: the write failed (disk full, I/O error); the temp is removed.
        :raises ClosedError: the writer is not open.
        """
        fd = self._check_open()
        for batch in _batches(data, self._chunk):
            self.nbytes_written += await self._run("write", _write_all, fd, batch, self.nbytes_written)

    async def commit(self) -> Path:
        """Fsync the temp file, rename it over the final path, fsync the directory.

        Once the rename has started, it and the directory fsync finish even if the caller
        is cancelled: when this returns, the replica is durable at :attr:`path`.

        :returns: the final path.
        :raises PersistError: a step failed; before the rename the previous replica is
            intact and the temp removed; a ``dir-fsync`` failure means the new replica is in
            place but its directory entry may not survive a crash.
        :raises ClosedError: the writer is not open.
        """
        fd = self._check_open()
        dir_fd = self._dir_fd
        assert dir_fd is not None
        await self._run("fsync", os.fsync, fd)
        self._fd = None
        # Shielded: once the descriptor is forgotten, a cancellation here would leak it.
        with anyio.CancelScope(shield=True):
            await self._run("close", os.close, fd)
        with anyio.CancelScope(shield=True):
            # Both names relative to the directory's descriptor: a link planted in place of
            # the final name is replaced, never followed.
            rename = functools.partial(
                os.replace, self.temp_path.name, self.path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd
            )
            await self._run("replace", rename)
            self._created = False
            self._state = "done"
            await self._run("dir-fsync", os.fsync, dir_fd)
            await self.aclose()
        seconds = time.perf_counter() - self._started
        log.debug(
            "wrote %s: %d bytes in %.4fs (%.2f GB/s)",
            self.path,
            self.nbytes_written,
            seconds,
            self.nbytes_written / seconds / 1e9 if seconds > 0 else 0.0,
        )
        return self.path

    async def aclose(self) -> None:
        """Discard the temp file unless committed; idempotent, always completes."""
        self._state = "done"
        fd, self._fd = self._fd, None
        dir_fd, self._dir_fd = self._dir_fd, None
        created, self._created = self._created, False
        if fd is None and dir_fd is None:
            return
        with anyio.CancelScope(shield=True):
            await blocking_io(
                functools.partial(_discard_file, fd, self.temp_path, dir_fd, created=created),
                limiter=self._limiter,
            )


async def write_checkpoint_file(
    path: str | os.PathLike[str],
    replica: Encoded | Iterable[BytesLike],
    *,
    limiter: anyio.CapacityLimiter | None = None,
    chunk_nbytes: int = CHUNK_NBYTES,
    open_dir: DirOpener | None = None,
) -> Path:
    """Write a replica durably at ``path``, atomically replacing any previous one.

    :param replica: an :class:`Encoded` replica, or its bytes as buffers in order.
    :param open_dir: opens ``path``'s directory (see :class:`CheckpointFileWriter`).
    :returns: the final path.
    :raises PersistError: a step failed (named in the message); the previous replica is
        intact (unless only the final directory fsync failed) and no temp file is left.
    """
    # The replica is held here until the writer is done with its views.
    buffers = replica.held_buffers(chunk_nbytes) if isinstance(replica, Encoded) else replica
    async with CheckpointFileWriter(
        path, limiter=limiter, chunk_nbytes=chunk_nbytes, open_dir=open_dir
    ) as writer:
        await writer.write(buffers)
        return await writer.commit()


class BlockingWriter:
    """:class:`CheckpointFileWriter` on the calling thread (a worker's, which must not wait
    for the event loop): a temp file next to ``path``, written, then fsynced and renamed
    over ``path`` by :meth:`commit`; :meth:`discard` removes it unless committed."""

    def __init__(self, path: Path, *, open_dir: DirOpener | None = None) -> None:
        self.path = path
        self.temp_path = temp_path_for(path)
        self.nbytes_written = 0
        self._open_dir = open_dir or functools.partial(open_directory, path.parent)
        self._fd: int | None = None
        self._dir_fd: int | None = None

    def _failed(self, step: _Step, exc: OSError) -> PersistError:
        self.discard()
        return PersistError(f"{step} failed for {self.path}: {exc}")

    def open(self) -> None:
        """Create the temp file. :raises PersistError: it cannot be created."""
        try:
            self._dir_fd, self._fd = _create_temp(self._open_dir, self.temp_path.name)
        except OSError as exc:
            raise self._failed("open", exc) from exc

    def write(self, data: memoryview) -> None:
        """Append ``data``. :raises PersistError: the write failed; the temp is removed."""
        if self._fd is None:
            raise ClosedError(f"the writer of {self.path} is not open")
        try:
            for batch in _batches(data, CHUNK_NBYTES):
                self.nbytes_written += _write_all(self._fd, batch, self.nbytes_written)
        except OSError as exc:
            raise self._failed("write", exc) from exc

    def commit(self) -> None:
        """Fsync, rename over the final path, fsync the directory.

        :raises PersistError: a step failed (named); before the rename the temp is removed.
        """
        fd, dir_fd = self._fd, self._dir_fd
        if fd is None or dir_fd is None:
            raise ClosedError(f"the writer of {self.path} is not open")
        step: _Step = "fsync"
        try:
            os.fsync(fd)
            step = "close"
            self._fd = None
            os.close(fd)
            step = "replace"
            os.replace(self.temp_path.name, self.path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            step = "dir-fsync"
            self._dir_fd = None
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise self._failed(step, exc) from exc

    def discard(self) -> None:
        """Remove the temp file unless committed; idempotent."""
        fd, self._fd = self._fd, None
        dir_fd, self._dir_fd = self._dir_fd, None
        if dir_fd is not None:
            _discard_file(fd, self.temp_path, dir_fd, created=True)


def write_checkpoint_file_blocking(
    path: str | os.PathLike[str],
    replica: Encoded | Iterable[BytesLike],
    *,
    chunk_nbytes: int = CHUNK_NBYTES,
    open_dir: DirOpener | None = None,
    check: Callable[[], None] | None = None,
) -> Path:
    """:func:`write_checkpoint_file` on the calling thread, for a worker that must not wait
    for the event loop between its steps (a save's background half, see
    :mod:`astage._checkpointer.save_pipeline`): the same temp file, fsync, rename and directory fsync, the
    same guarantees.

    :param check: called before every chunk and before the fsync; what it raises (a
        save abandoned) discards the temp file and propagates.  Not called once the rename
        has begun: from there the new file is finished, as :meth:`CheckpointFileWriter.commit`
        finishes it under a shield.
    :raises PersistError: a step failed (named); the previous file is intact (unless only
        the final directory fsync failed) and no temp file is left.
    """
    if chunk_nbytes <= 0:
        raise ConfigurationError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
    path = Path(path)
    temp = temp_path_for(path)
    opener = open_dir or functools.partial(open_directory, path.parent)
    buffers = replica.held_buffers(chunk_nbytes) if isinstance(replica, Encoded) else replica
    started = time.perf_counter()
    step: _Step = "open"
    dir_fd: int | None = None
    fd: int | None = None
    try:
        dir_fd, fd = _create_temp(opener, temp.name)
        step = "write"
        written = _write_checked(fd, buffers, chunk_nbytes, check)
        step = "fsync"
        os.fsync(fd)
        step = "close"
        closing = fd
        fd = None
        os.close(closing)
        step = "replace"
        os.replace(temp.name, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        step = "dir-fsync"
        os.fsync(dir_fd)
    except BaseException as exc:
        if dir_fd is not None:  # the temp exists unless the rename is done
            _discard_file(fd, temp, dir_fd, created=step != "dir-fsync")
        if isinstance(exc, OSError) and not isinstance(exc, PersistError):
            raise PersistError(f"{step} failed for {path}: {exc}") from exc
        raise
    finally:
        buffers = ()
    assert dir_fd is not None
    os.close(dir_fd)
    seconds = time.perf_counter() - started
    log.debug(
        "wrote %s: %d bytes in %.4fs (%.2f GB/s)", path, written, seconds, written / max(seconds, 1e-9) / 1e9
    )
    return path


def _write_checked(
    fd: int, buffers: BytesLike | Iterable[BytesLike], chunk_nbytes: int, check: Callable[[], None] | None
) -> int:
    """Write ``buffers`` to ``fd`` from offset 0, calling ``check`` before every batch and
    once more at the end; the bytes written."""
    written = 0
    for batch in _batches(buffers, chunk_nbytes):
        if check is not None:
            check()
        written += _write_all(fd, batch, written)
        del batch  # views of the caller's buffers
    if check is not None:
        check()
    return written


def list_entries(directory: str | os.PathLike[str]) -> list[os.DirEntry[str]]:
    """The entries of ``directory``, none if it does not exist (blocking).

    :raises OSError: it exists but cannot be listed.
    """
    try:
        with os.scandir(directory) as listing:
            return list(listing)
    except FileNotFoundError:
        return []


def sweep_stale_temps(directory: str | os.PathLike[str], *, older_than: float = 0.0) -> list[Path]:
    """Remove astage temp files left in ``directory`` by crashed writers; nothing else.

    Run it at start-up, before this process writes there.  With ``older_than`` (seconds),
    only temps not modified for that long are removed, which is safe beside live writers.

    :returns: the removed paths (a missing directory gives ``[]``).
    :raises OSError: the directory cannot be listed.
    """
    removed: list[Path] = []
    deadline = time.time() - older_than
    for entry in list_entries(directory):
        if not is_temp_name(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            if older_than and entry.stat(follow_symlinks=False).st_mtime > deadline:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot remove stale temp file %s: %s", entry.path, exc)
            continue
        log.info("removed stale temp file %s", entry.path)
        removed.append(Path(entry.path))
    return removed
