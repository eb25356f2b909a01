"""Injected I/O failures at each step of a persist: named, never retried, nothing torn.

Each case persists a new replica over an existing one in a child process traced by strace,
which fails exactly one kind of system call on exactly one path (``-P``: the temp file, or
the directory for the directory fsync) with ``inject=...:error=...``.  strace records the
same calls, so the test sees the failed attempt itself and everything the writer did on that
path afterwards.  The expectations, for every step:

* :class:`astage.PersistError` naming the step (``fsync failed for <path>: ...``) with the
  injected errno as its cause;
* one attempt at the failed call, never a retry (a failed fsync may already have dropped the
  dirty pages: a second one could report success over lost data);
* afterwards only cleanup on that path (close, unlink), and no temp file left;
* the previous replica still in place, whole and loadable.  The directory fsync comes after
  the rename, so there the new replica is in place, whole and loadable (as documented).

strace's injector is used rather than libfiu's because it can fail the fsync of one path
(libfiu's ``posix/io/sync/fsync`` fails every fsync, so it cannot tell the file's from the
directory's) and because the call stays visible in the same trace to be counted.  libfiu's
``posix/io/rw/write/reduce`` makes short writes, which strace cannot do: the last test uses it.
A disk really filling up (ENOSPC from a 1 MiB tmpfs mid-file) is in ``test_persist.py``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from astage._files.durable import is_temp_name, write_checkpoint_file
from astage._files.reading import load_checkpoint_file_sync
from tests.strace import (
    CHUNK,
    CLEANUP,
    OPENS,
    RENAMES,
    TRACED,
    WRITES,
    Syscall,
    need_strace,
    parse_strace,
    path_opened,
    paths_renamed,
    replica,
    run_traced,
    syscall_set,
)


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected failure.

    :ivar step: astage's name for the step, as its :class:`PersistError` says it.
    :ivar syscalls: the system calls strace fails (each at its first attempt on the path).
    :ivar error: the errno they fail with.
    :ivar on_directory: fail calls on the target directory rather than on the temp file.
    """

    step: str
    syscalls: tuple[str, ...]
    error: str
    on_directory: bool = False


FAULTS = [
    Fault("open", ("open", "openat", "creat"), "ENOSPC"),
    Fault("write", tuple(sorted(WRITES)), "ENOSPC"),
    Fault("fsync", ("fsync", "fdatasync"), "EIO"),
    Fault("close", ("close",), "EIO"),
    Fault("replace", ("rename", "renameat", "renameat2"), "EIO"),
    Fault("dir-fsync", ("fsync", "fdatasync"), "EIO", on_directory=True),
]


def on_path(call: Syscall, path: Path) -> bool:
    """Whether ``call`` acts on ``path``: by a descriptor, or by a name (maybe directory-relative)."""
    if call.name in OPENS:
        return path_opened(call) == path
    if call.name in RENAMES:
        return paths_renamed(call)[0] == path
    return call.fd_path() == path


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("fault", FAULTS, ids=[f.step for f in FAULTS])
def test_a_failed_step_is_named_not_retried_and_leaves_a_whole_replica(
    tmp_path: Path, fault: Fault, backend: str
) -> None:
    final = tmp_path / "replica.astage"
    previous, new = replica(1), replica(2, nbytes=300_000)
    anyio.run(write_checkpoint_file, final, [previous])

    def strace_args(temps: list[Path]) -> list[str]:
        # The temp file is created, renamed and removed relative to its directory's
        # descriptor, so ``-P`` must name the directory for those calls to be seen.
        targets = [final.parent] if fault.on_directory else [temps[0], final.parent]
        return [
            *(arg for target in targets for arg in ("-P", str(target))),
            *("-e", f"trace={syscall_set(TRACED)}"),
            *("-e", f"inject={syscall_set(fault.syscalls)}:error={fault.error}"),
        ]

    traced = run_traced([(final, new)], strace_args, backend=backend, via_writer=True)
    target = final.parent if fault.on_directory else traced.temps[0]

    (outcome,) = traced.outcomes
    assert outcome.error == "PersistError", outcome
    assert outcome.message.startswith(f"{fault.step} failed for {final}: "), outcome.message
    assert outcome.errno == getattr(errno, fault.error)

    attempts = [c for c in traced.calls if c.name in fault.syscalls and on_path(c, target)]
    assert len(attempts) == 1, f"expected one attempt, got {[str(c) for c in attempts]}"
    (failed,) = attempts
    assert failed.injected
    assert failed.error == fault.error
    afterwards = traced.calls[traced.calls.index(failed) + 1 :]
    assert {c.name for c in afterwards} <= CLEANUP, [str(c) for c in afterwards]

    (temp,) = traced.temps
    if fault.step not in ("open", "dir-fsync"):
        assert any(
            c.name in ("unlink", "unlinkat") and any(temp.name in a for a in c.args) for c in afterwards
        )
    assert not any(is_temp_name(name) for name in os.listdir(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [final.name]
    # The directory is fsynced after the rename: then the new replica stands.
    assert final.read_bytes() == (new if fault.on_directory else previous)
    load_checkpoint_file_sync(final)


_SHORT_WRITER = """\
import sys
from pathlib import Path

import anyio
from astage._files.durable import write_checkpoint_file

final, data = sys.argv[1], Path(sys.argv[2]).read_bytes()
anyio.run(lambda: write_checkpoint_file(final, [data], chunk_nbytes=int(sys.argv[3])))
"""


def test_short_writes_are_continued_until_the_replica_is_whole(tmp_path: Path) -> None:
    """libfiu makes every write() write only part of what it was given; nothing is lost."""
    strace = need_strace()
    fiu_run = shutil.which("fiu-run")
    if fiu_run is None:
        pytest.skip("fiu-run is not installed (.ci/run installs fiu-utils with apt-get)")
    final, source = tmp_path / "replica.astage", tmp_path / "source.bin"
    previous, data = replica(1), replica(2, nbytes=300_000)
    anyio.run(write_checkpoint_file, final, [previous])
    source.write_bytes(data)
    trace = tmp_path / "trace"
    tracing = [strace, "-f", "--seccomp-bpf", "-y", "-s", "0", "-o", str(trace)]
    shortening = [fiu_run, "-x", "-f", "", "-c", "enable name=posix/io/rw/write/reduce"]
    writing = [sys.executable, "-c", _SHORT_WRITER, str(final), str(source), str(CHUNK)]
    command = [*tracing, "-e", f"trace={syscall_set(WRITES)}", *shortening, *writing]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr

    writes = [
        c
        for c in parse_strace(trace.read_text(errors="replace"))
        if c.name in WRITES and (path := c.fd_path()) is not None and is_temp_name(path.name)
    ]
    whole_chunks = -(-len(data) // CHUNK)
    assert len(writes) > 2 * whole_chunks, "libfiu did not shorten the writes"
    assert all(c.ok for c in writes)
    assert sum(c.ret or 0 for c in writes) == len(data)
    assert final.read_bytes() == data
    load_checkpoint_file_sync(final)
    assert sorted(os.listdir(tmp_path)) == sorted([final.name, source.name, trace.name])
