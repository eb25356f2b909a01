"""The layout of a checkpoint directory: names, step directories and the per-rank lock.

::

    directory/
        .astage-rank00000.lock          one live Checkpointer per directory and rank
        step_0000000042/
            rank00000.astage            this rank's state (an astage checkpoint file)
            rank00000.COMMITTED         the commit marker (:mod:`astage._files.markers`), written last

Every call here is blocking (run it in a worker thread).  Nothing below the directory is
followed: step directories are opened ``O_NOFOLLOW`` from the directory's descriptor and
their files relative to theirs, so a link planted under a step's name is foreign (refused,
never written, read or deleted through).  Several ranks may share the directory, so a step
directory is removed only while empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, Literal

from .._util.errors import ConfigurationError, IntegrityError, PersistError, ResourceError
from .._util.limits import INT64, RANK_LIMIT
from .durable import open_directory
from .reading import open_regular

_STEP_DIR_RE: Final = re.compile(r"\Astep_([0-9]{10,19})\Z")

LayoutRole = Literal["checkpoint", "marker"]
"""What a file in a step directory is: a rank's checkpoint file or its commit marker."""

_LAYOUT_NAME_RE: Final = re.compile(r"\Arank([0-9]{5,10})\.(?:astage|COMMITTED)\Z")


# -- names ------------------------------------------------------------------------------


def rank_file_names(rank: int) -> tuple[str, str]:
    """This rank's data file and marker names inside a step directory."""
    return f"rank{rank:05d}.astage", f"rank{rank:05d}.COMMITTED"


def step_dir_name(step: int) -> str:
    """The name of ``step``'s directory (42 -> ``step_0000000042``)."""
    return f"step_{step:010d}"


def step_of_dir(name: str) -> int | None:
    """The step a step directory's name stands for (``step_0000000042`` -> 42), or ``None``."""
    match = _STEP_DIR_RE.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    return step if step < INT64 and name == step_dir_name(step) else None


def layout_role(name: str) -> tuple[LayoutRole, int] | None:
    """What ``name`` is inside a step directory, and for which rank; ``None`` if not astage's."""
    match = _LAYOUT_NAME_RE.match(name)
    if match is None or (rank := int(match.group(1))) >= RANK_LIMIT:
        return None
    data_name, marker_name = rank_file_names(rank)
    return ("checkpoint", rank) if name == data_name else ("marker", rank) if name == marker_name else None


# -- step directories ---------------------------------------------------------------------


def unlink_entry(name: str, dir_fd: int) -> bool:
    """Remove the entry ``name`` of a directory (a link is removed, never followed)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def remove_dir_if_empty(name: str, dir_fd: int) -> bool:
    """Remove the step directory ``name`` if it is empty; another rank may be using it.

    Only an empty directory goes: a rank whose file is there keeps it.  A rank about to
    create its file there may see it vanish, and creates it again (see
    :func:`astage._files.durable._create_temp`).
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


def open_step_dir(dir_fd: int, name: str, *, create: bool) -> int:
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


@contextlib.contextmanager
def existing_step_dir(dir_fd: int, name: str) -> Iterator[int | None]:
    """The step directory ``name`` opened (never through a link), or ``None`` if it is gone."""
    try:
        step_fd = open_step_dir(dir_fd, name, create=False)
    except FileNotFoundError:
        yield None
        return
    try:
        yield step_fd
    finally:
        os.close(step_fd)


# -- the lock ---------------------------------------------------------------------------


def open_and_lock(directory: Path, rank: int) -> tuple[int, int]:
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


def step_dir_opener(dir_fd: int, step: int) -> Callable[[], int]:
    """Opens (creating it if need be) ``step``'s directory, never through a link."""
    return functools.partial(open_step_dir, dir_fd, step_dir_name(step), create=True)
