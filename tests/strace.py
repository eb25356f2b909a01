"""Tracing a real persist with strace: a writer child, the trace parser, and test replicas.

A writer child (forked from the forkserver, torch already imported) is attached by
``strace -f -y`` while it persists (:func:`run_traced`); :func:`parse_strace` reads the
trace into :class:`Syscall` records.  Shared by ``test_durable_order.py`` (the order of the
durable steps) and ``test_faults_io.py`` (failures injected with strace's ``inject=``).
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import anyio
import pytest
import torch

import astage
from astage._files.durable import CheckpointFileWriter, write_checkpoint_file
from astage._format.codec import encode
from tests.distributed import _context

CHUNK = 64 << 10
"""Small write chunks, so that a persist makes several write calls."""

OPENS = frozenset({"open", "openat", "openat2", "creat"})
WRITES = frozenset({"write", "pwrite64", "writev", "pwritev", "pwritev2"})
SYNCS = frozenset({"fsync", "fdatasync"})
RENAMES = frozenset({"rename", "renameat", "renameat2"})
MKDIRS = frozenset({"mkdir", "mkdirat"})
CLEANUP = frozenset({"close", "unlink", "unlinkat"})
TRACED = sorted(OPENS | WRITES | SYNCS | RENAMES | MKDIRS | CLEANUP | {"sync_file_range", "syncfs"})


def syscall_set(names: Iterable[str]) -> str:
    """An strace syscall set; ``?`` tolerates names this architecture lacks (``open`` on arm64)."""
    return ",".join(f"?{name}" for name in sorted(names))


# -- parsing strace's output ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Syscall:
    """One completed system call as ``strace -f -y`` printed it.

    :ivar args: the arguments as printed, split at top-level commas.
    :ivar ret: the return value (``None`` when strace printed ``?``).
    :ivar ret_path: the ``-y`` path of a returned file descriptor.
    :ivar error: the errno name of a failed call.
    :ivar injected: strace injected the failure (``inject=``).
    :ivar start: position of the call's entry in the trace.
    :ivar end: position of its exit; ``a.end < b.start`` means ``a`` finished before ``b`` began.
    """

    name: str
    args: tuple[str, ...]
    ret: int | None
    ret_path: str | None = None
    error: str | None = None
    injected: bool = False
    tid: int = 0
    start: int = 0
    end: int = 0

    @property
    def ok(self) -> bool:
        return self.ret is not None and self.ret >= 0

    def fd_path(self, i: int = 0) -> Path | None:
        """The ``-y`` path of file descriptor argument ``i`` (``9</a/b>`` gives ``/a/b``)."""
        match = re.fullmatch(r"(?:-?\d+|AT_FDCWD)<(.*)>", self.args[i]) if i < len(self.args) else None
        return Path(match.group(1)) if match else None

    def path_arg(self, i: int, dirfd: int | None = None) -> Path:
        """String argument ``i`` as a path, resolved against directory fd argument ``dirfd``."""
        text = self.args[i]
        if not (text.startswith('"') and text.endswith('"')):
            raise ValueError(f"argument {i} of {self} is not a string")
        path = codecs.escape_decode(text[1:-1].encode())[0].decode("utf-8", "surrogateescape")
        base = self.fd_path(dirfd) if dirfd is not None else None
        return Path(os.path.normpath(os.path.join(base, path) if base is not None else path))

    def __str__(self) -> str:
        result = "?" if self.ret is None else str(self.ret)
        return f"{self.name}({', '.join(self.args)}) = {result}{f' {self.error}' if self.error else ''}"


_LINE = re.compile(r"(?P<tid>\d+)\s+(?P<text>.*)")
_CALL = re.compile(r"(?P<name>\w+)\((?P<args>.*)\)\s+=\s+(?P<outcome>.*)")
_RESULT = re.compile(
    r"(?P<ret>-?\d+|\?)(?:<(?P<path>.*)>)?(?:\s+(?P<error>E[A-Z0-9]+)\s+\(.*?\))?(?P<injected>\s+\(INJECTED\))?"
)


def parse_strace(text: str) -> list[Syscall]:
    """Parse ``strace -f -y -o`` output into completed calls, in order of completion.

    Calls split across threads (``<unfinished ...>`` / ``<... resumed>``) are joined;
    signals and exits are skipped.
    """
    calls: list[Syscall] = []
    pending: dict[int, tuple[str, int]] = {}
    for position, line in enumerate(text.splitlines()):
        match = _LINE.fullmatch(line.strip())
        if match is None:
            continue
        tid, body = int(match["tid"]), match["text"]
        start = position
        if body.startswith(("+++", "---")) or body.endswith("<detached ...>"):
            continue
        if body.endswith("<unfinished ...>"):
            pending[tid] = (body.removesuffix("<unfinished ...>").rstrip(), position)
            continue
        resumed = re.fullmatch(r"<\.\.\. (\w+) resumed>(.*)", body)
        if resumed is not None:
            head, start = pending.pop(tid)
            body = head + resumed.group(2)
        calls.append(_parse_call(body, tid, start, position))
    return calls


def _parse_call(body: str, tid: int, start: int, end: int) -> Syscall:
    call = _CALL.fullmatch(body)
    result = _RESULT.fullmatch(call["outcome"].strip()) if call else None
    if call is None or result is None:
        raise ValueError(f"not a system call line: {body!r}")
    return Syscall(
        name=call["name"],
        args=tuple(_split_args(call["args"])),
        ret=None if result["ret"] == "?" else int(result["ret"]),
        ret_path=result["path"],
        error=result["error"],
        injected=result["injected"] is not None,
        tid=tid,
        start=start,
        end=end,
    )


def _split_args(text: str) -> Iterator[str]:
    """Split at commas outside strings, brackets and ``<...>`` fd paths."""
    depth, quoted, escaped, current = 0, False, False, []
    for ch in text:
        if quoted:
            quoted = not (ch == '"' and not escaped)
            escaped = ch == "\\" and not escaped
        elif ch == '"':
            quoted = True
        elif ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        elif ch == "," and depth == 0:
            yield "".join(current).strip()
            current = []
            continue
        current.append(ch)
    if "".join(current).strip():
        yield "".join(current).strip()


def path_opened(call: Syscall) -> Path | None:
    if call.name in ("open", "creat"):
        return call.path_arg(0)
    if call.name in ("openat", "openat2"):
        return call.path_arg(1, dirfd=0)
    return None


def paths_renamed(call: Syscall) -> tuple[Path, Path]:
    if call.name == "rename":
        return call.path_arg(0), call.path_arg(1)
    return call.path_arg(1, dirfd=0), call.path_arg(3, dirfd=2)


# -- tracing a writer child -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one persist in the child ended: ``error`` is ``None`` on success."""

    error: str | None = None
    message: str = ""
    errno: int | None = None


@dataclasses.dataclass(frozen=True)
class Traced:
    """A traced child's persists: their outcomes, temp names (writer mode) and system calls."""

    outcomes: list[Outcome]
    temps: list[Path]
    calls: list[Syscall]


def _persist_child(conn: Connection, jobs: list[tuple[str, bytes]], backend: str, via_writer: bool) -> None:
    """Persist each ``(path, data)`` once told to go; report one :class:`Outcome` each.

    ``via_writer``: use :class:`CheckpointFileWriter` (exactly what ``write_checkpoint_file`` does) made
    before the go, so that the parent knows the temp names while setting up strace.  Their
    directories are opened before the go too (the writers get duplicates): strace's ``-P``
    then matches a call made relative to a directory only by that descriptor, never by an
    open of the directory's own path.
    """
    writers = []
    for path, _ in jobs if via_writer else []:
        dir_fd = os.open(Path(path).parent, os.O_RDONLY | os.O_DIRECTORY)  # lives as long as the child
        writers.append(
            CheckpointFileWriter(path, chunk_nbytes=CHUNK, open_dir=functools.partial(os.dup, dir_fd))
        )
    conn.send([str(w.temp_path) for w in writers])
    conn.recv()

    async def persist(i: int, path: str, data: bytes) -> None:
        if writers:
            async with writers[i] as writer:
                await writer.write(data)
                await writer.commit()
        else:
            await write_checkpoint_file(path, [data], chunk_nbytes=CHUNK)

    async def run_all() -> list[Outcome]:
        outcomes = []
        for i, (path, data) in enumerate(jobs):
            try:
                await persist(i, path, data)
            except astage.PersistError as exc:
                errno = exc.__cause__.errno if isinstance(exc.__cause__, OSError) else None
                outcomes.append(Outcome(type(exc).__name__, str(exc), errno))
            else:
                outcomes.append(Outcome())
        return outcomes

    conn.send(anyio.run(run_all, backend=backend))


def need_strace() -> str:
    """The path of strace, or skip the test saying how to get it."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed (.ci/run installs it with apt-get)")
    return strace


def _await_attached(tracer: subprocess.Popen[str], pid: int | None) -> None:
    """Wait for strace's report that it attached to ``pid``; skip where ptrace is refused."""
    assert tracer.stderr is not None
    said = []
    for line in tracer.stderr:
        if f"Process {pid} attached" in line:
            return
        said.append(line)
    if any("Operation not permitted" in line for line in said):
        pytest.skip(f"strace may not attach here (no ptrace permission): {''.join(said).strip()}")
    raise AssertionError(f"strace did not attach: {''.join(said).strip()}")


def run_traced(
    jobs: list[tuple[Path, bytes]],
    strace_args: Callable[[list[Path]], list[str]],
    *,
    backend: str = "asyncio",
    via_writer: bool = False,
) -> Traced:
    """Persist ``jobs`` in a child process traced by ``strace -f -y <strace_args(temps)>``.

    The child waits, blocked on a pipe, until strace reports it attached: every system call
    of the persists (worker threads included, ``-f``) is seen, and injected into.
    """
    strace = need_strace()
    ctx = _context()
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(
        target=_persist_child,
        args=(child_end, [(str(p), d) for p, d in jobs], backend, via_writer),
        daemon=True,
    )
    child.start()
    child_end.close()
    with tempfile.TemporaryDirectory() as scratch:
        trace_file = Path(scratch) / "trace"
        tracer: subprocess.Popen[str] | None = None
        try:
            temps = [Path(t) for t in parent_end.recv()]
            command = [strace, "-f", "-y", "-s", "0", "-o", str(trace_file), *strace_args(temps)]
            tracer = subprocess.Popen(
                [*command, "-p", str(child.pid)], stderr=subprocess.PIPE, text=True, errors="replace"
            )
            _await_attached(tracer, child.pid)
            parent_end.send("go")
            if not parent_end.poll(60):
                raise AssertionError("the traced writer did not finish within 60 s")
            outcomes: list[Outcome] = parent_end.recv()
            child.join(30)
            tracer.wait(30)
            calls = parse_strace(trace_file.read_text(errors="replace"))
        finally:
            if child.is_alive():
                child.kill()
                child.join(5)
            if tracer is not None:
                if tracer.poll() is None:
                    tracer.kill()
                tracer.communicate()
            parent_end.close()
    return Traced(outcomes, temps, calls)


# -- replicas -------------------------------------------------------------------------------


def replica(seed: int, nbytes: int = 200_000) -> bytes:
    """A valid replica of a small state_dict, ``nbytes`` of body or so (several chunks)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(nbytes // 4, generator=gen)
    state = {"w": base, "w_t": base[: nbytes // 8].view(2, -1).t(), "step": seed}
    return b"".join(encode(state, owner_rank=0, holder_rank=1, step=seed, checkpoint_id=f"c{seed}").buffers())
