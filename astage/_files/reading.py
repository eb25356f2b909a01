"""Reading checkpoint files: open one without following a link, check its header, load it,
inspect it, find the replicas in a directory.  Every byte is verified before it is trusted."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel
import torch

from .._format.codec import (
    FIXED_PREFIX_NBYTES,
    FileHeader,
    byte_view,
    decode,
    parse_prefix,
    prefix_nbytes,
)
from .._util.errors import IntegrityError
from .durable import CHUNK_NBYTES, FILE_SUFFIX, blocking_io, list_entries

log = logging.getLogger("astage.persist")


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointFileInfo:
    """A replica file found on disk (only its prefix was read and validated).

    :ivar mtime: when the file was last written here (this machine's clock).
    :ivar nbytes: the file's size.
    """

    path: Path
    owner_rank: int
    holder_rank: int | None
    step: int
    checkpoint_id: str
    created: float
    nbytes: int
    mtime: float
    header: FileHeader = dataclasses.field(repr=False)


_FILE_KINDS: Final = (
    (stat.S_ISLNK, "a symbolic link (astage never follows one)"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None, flags: int = 0) -> int:
    """Open an existing regular file for reading, refusing anything else; its descriptor.

    The open never follows a link at the last component (``O_NOFOLLOW``) and never blocks
    (``O_NONBLOCK``: a FIFO would wait for a writer for ever, in a worker thread that a
    cancellation cannot stop); the descriptor is then checked with ``fstat`` and put back
    in blocking mode.  ``flags`` adds ``O_CREAT`` for a lock file, say.

    :raises IntegrityError: ``path`` is a symbolic link, a directory, a FIFO, a socket or a
        device: not a file astage wrote.
    :raises OSError: the file cannot be opened (missing, permissions).
    """
    try:
        fd = os.open(
            path,
            os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | flags,
            0o600,
            dir_fd=dir_fd,
        )
    except OSError as exc:
        # ELOOP: a link at the last component; ENXIO: a socket (or a FIFO opened for writing).
        if exc.errno not in (errno.ELOOP, errno.ENXIO):
            raise
        try:
            what = _kind(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            what = "not a regular file"
        raise IntegrityError(f"{path} is {what}, not a file astage wrote") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise IntegrityError(f"{path} is {_kind(mode)}, not a file astage wrote")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class CheckpointFile:
    """Blocking steps over one open replica file; run inline or in worker threads."""

    def __init__(self, path: Path, dir_fd: int | None = None) -> None:
        self.path = path
        self.prefix = b""  # the raw prefix, once :meth:`header` has read it
        self.fd = open_regular(path if dir_fd is None else path.name, dir_fd=dir_fd)

    def close(self) -> None:
        os.close(self.fd)

    def pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise IntegrityError(f"truncated: {len(data)} of {n} bytes at offset {offset}")
        return data

    def header(self) -> tuple[FileHeader, os.stat_result]:
        """Read and validate the prefix; check the file is exactly prefix plus body."""
        st = os.fstat(self.fd)
        try:
            total = prefix_nbytes(self.pread(FIXED_PREFIX_NBYTES, 0))
            if total > st.st_size:
                raise IntegrityError(f"truncated: the prefix is {total} bytes, the file {st.st_size}")
            self.prefix = self.pread(total, 0)
            header = parse_prefix(self.prefix)
        except IntegrityError as exc:
            raise IntegrityError(f"{self.path}: {exc}") from exc
        if st.st_size != header.total_nbytes:
            what = "truncated" if st.st_size < header.total_nbytes else "trailing bytes"
            raise IntegrityError(
                f"{self.path}: {what}: the file is {st.st_size} bytes, its header says {header.total_nbytes}"
            )
        return header, st

    def read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` from ``offset``; a short file is an integrity error."""
        while view:
            n = os.preadv(self.fd, [view], offset)
            if n == 0:
                raise IntegrityError(f"{self.path}: truncated while reading at offset {offset}")
            view = view[n:]
            offset += n

    def decode(self, header: FileHeader, body: torch.Tensor) -> Any:
        try:
            return decode(header, body)
        except IntegrityError as exc:
            raise IntegrityError(f"{self.path}: {exc}") from exc


@contextlib.asynccontextmanager
async def opened_checked(
    path: str | os.PathLike[str],
    *,
    limiter: anyio.CapacityLimiter | None,
    check: Callable[[FileHeader], None] | None,
    dir_fd: int | None,
) -> AsyncIterator[tuple[CheckpointFile, FileHeader]]:
    """``path`` opened (never through a link), its header read and passed to ``check``;
    closed after the block, whatever ends it.  The one way every reader opens a file."""
    f = await blocking_io(CheckpointFile, Path(path), dir_fd, limiter=limiter)
    try:
        header, _ = await blocking_io(f.header, limiter=limiter)
        if check is not None:
            check(header)
        yield f, header
    finally:
        with anyio.CancelScope(shield=True):
            await blocking_io(f.close, limiter=limiter)


def _chunks(header: FileHeader, body: torch.Tensor) -> Iterator[tuple[memoryview, int]]:
    view = byte_view(body)
    for start in range(0, len(view), CHUNK_NBYTES):
        yield view[start : start + CHUNK_NBYTES], header.prefix_nbytes + start


async def load_checkpoint_file(
    path: str | os.PathLike[str],
    *,
    limiter: anyio.CapacityLimiter | None = None,
    check: Callable[[FileHeader], None] | None = None,
    dir_fd: int | None = None,
    on_read: Callable[[int], None] | None = None,
) -> Any:
    """Read, validate and rebuild the state_dict stored at ``path`` (tensors on the CPU).

    Reads in worker threads, in chunks; checksums are verified (in a worker thread) before
    anything is returned.  Tensors share one body buffer (see :func:`astage._format.codec.decode`).

    :param check: called with the header of the very file being read, before its body is
        read; it raises to refuse the file (so a file replaced meanwhile is never mistaken).
    :param dir_fd: open ``path``'s name relative to this directory descriptor (``path``
        itself then only names the file in messages).
    :param on_read: called on the event loop with the byte count of each chunk of the body
        once read, as :func:`load_checkpoint_file_sync`'s (the body's length is the
        header's ``body_nbytes``, which ``check`` sees first).
    :raises IntegrityError: the file is truncated, has trailing bytes, or is corrupt or
        tampered anywhere; or it is not a regular file (a link, a FIFO, a device).
    :raises OSError: the file cannot be opened or read.
    """
    async with opened_checked(path, limiter=limiter, check=check, dir_fd=dir_fd) as (f, header):
        body = torch.empty(header.body_nbytes, dtype=torch.uint8)
        for view, offset in _chunks(header, body):
            await blocking_io(f.read_into, view, offset, limiter=limiter)
            if on_read is not None:
                on_read(len(view))
        return await blocking_io(f.decode, header, body, limiter=limiter)


def load_checkpoint_file_sync(
    path: str | os.PathLike[str], *, on_read: Callable[[int], None] | None = None
) -> Any:
    """Blocking :func:`load_checkpoint_file`, for scripts and the CLI.

    :param on_read: called with the byte count of each chunk of the body once read (a
        progress bar's ``advance``); the body's length is
        ``inspect_checkpoint_file(path).header.body_nbytes``.
    :raises IntegrityError: the file is truncated, has trailing bytes, or is corrupt; or
        it is not a regular file (a link, a FIFO, a device).
    :raises OSError: the file cannot be opened or read.
    """
    f = CheckpointFile(Path(path))
    try:
        header, _ = f.header()
        body = torch.empty(header.body_nbytes, dtype=torch.uint8)
        for view, offset in _chunks(header, body):
            f.read_into(view, offset)
            if on_read is not None:
                on_read(len(view))
        return f.decode(header, body)
    finally:
        f.close()


def inspect_checkpoint_file(path: str | os.PathLike[str]) -> CheckpointFileInfo:
    """Read and validate a replica's prefix (header), without reading its body.

    :raises IntegrityError: the prefix is invalid, or the file's size does not match it;
        or it is not a regular file (a link, a FIFO, a device).
    :raises OSError: the file cannot be opened or read.
    """
    f = CheckpointFile(Path(path))
    try:
        header, st = f.header()
    finally:
        f.close()
    ids = header.owner_rank, header.holder_rank, header.step, header.checkpoint_id, header.created
    return CheckpointFileInfo(Path(path), *ids, st.st_size, st.st_mtime, header)


def find_replicas(storage_dir: str | os.PathLike[str]) -> list[CheckpointFileInfo]:
    """List the valid replicas in ``storage_dir``, newest first (by mtime, then ``created``).

    Looks at regular files named ``*.astage`` (not temps, not symlinks) and reads only
    their prefixes.  Files that fail validation (corrupt, truncated, foreign) are skipped
    with a warning on the ``astage.persist`` logger; :func:`load_checkpoint_file` on one says why.

    :returns: ``[]`` when the directory does not exist.
    :raises OSError: the directory cannot be listed.
    """
    found: list[CheckpointFileInfo] = []
    for entry in list_entries(storage_dir):
        if not entry.name.endswith(FILE_SUFFIX) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            found.append(inspect_checkpoint_file(entry.path))
        except (IntegrityError, OSError) as exc:
            log.warning("skipping an invalid replica: %s", exc)
    found.sort(key=lambda r: (r.mtime, r.created, str(r.path)), reverse=True)
    return found
