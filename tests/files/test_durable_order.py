"""The order of a persist's durable operations, read from its real system calls.

A writer child (forked from the forkserver, torch already imported) is attached by
``strace -f -y`` while it persists, and the recorded calls are checked by a pure function,
:func:`durable_order_problems`: the temp file is created with ``O_CREAT|O_EXCL`` under a
unique astage temp name in the target directory, written, fsynced, renamed over the final
name, and the directory is fsynced after the rename (and the parent of any directory the
persist created, after it was created).  The same function rejects every mutant of a good
trace that removes or reorders one of those steps, so the check cannot pass vacuously.

The tracing machinery (:func:`run_traced`, :func:`parse_strace`, :class:`Syscall`) lives
in ``tests/strace.py``, shared with ``test_faults_io.py``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from astage._files.durable import is_temp_name, write_checkpoint_file
from astage._files.reading import load_checkpoint_file_sync
from tests.strace import (
    MKDIRS,
    OPENS,
    RENAMES,
    SYNCS,
    TRACED,
    WRITES,
    Outcome,
    Syscall,
    Traced,
    parse_strace,
    path_opened,
    paths_renamed,
    replica,
    run_traced,
    syscall_set,
)

# -- the order check (pure) -----------------------------------------------------------------


def _open_flags(call: Syscall) -> set[str]:
    if call.name == "creat":
        return {"O_CREAT", "O_WRONLY", "O_TRUNC"}
    text = call.args[1 if call.name == "open" else 2]
    return set(re.findall(r"O_[A-Z]+", text))


def _made_dir(call: Syscall) -> Path:
    return call.path_arg(0) if call.name == "mkdir" else call.path_arg(1, dirfd=0)


def _before(a: Syscall, b: Syscall) -> bool:
    return a.end < b.start


def durable_order_problems(calls: Sequence[Syscall], final: Path, nbytes: int | None = None) -> list[str]:
    """What is wrong with the persist of ``final`` recorded in ``calls`` (``[]``: nothing).

    The persist must: create a temp file in ``final``'s directory, named like astage's
    temps for ``final`` (``.{name}.astage-tmp.{32 hex}``), with ``O_CREAT|O_EXCL``; write
    it (``nbytes`` in all, when given); fsync it after the last write; rename it over
    ``final`` after that fsync; fsync ``final``'s directory after the rename; and fsync the
    parent of every directory it created, after creating it.
    """
    renames = [c for c in calls if c.name in RENAMES and paths_renamed(c)[1] == final]
    if len(renames) != 1:
        return [f"expected one rename onto {final}, found {len(renames)}"]
    rename = renames[0]
    temp = paths_renamed(rename)[0]
    problems = [] if rename.ok else [f"the rename failed: {rename}"]
    if temp.parent != final.parent:
        problems.append(f"the temp file {temp} is not in the target directory {final.parent}")
    if not (is_temp_name(temp.name) and temp.name.startswith(f".{final.name}.astage-tmp.")):
        problems.append(f"{temp.name} is not a unique astage temp name for {final.name}")

    opens = [c for c in calls if c.name in OPENS and path_opened(c) == temp]
    if len(opens) != 1:
        return [*problems, f"expected one open of the temp file, found {len(opens)}"]
    opened = opens[0]
    if not opened.ok:
        problems.append(f"the temp file could not be opened: {opened}")
    if not {"O_CREAT", "O_EXCL"} <= _open_flags(opened):
        problems.append(f"the temp file was not created exclusively (O_CREAT|O_EXCL): {opened}")

    writes = [c for c in calls if c.name in WRITES and c.fd_path() == temp]
    if not writes:
        problems.append("nothing was written to the temp file")
    if any(not w.ok for w in writes):
        problems.append("a write to the temp file failed")
    if nbytes is not None and sum(w.ret or 0 for w in writes) != nbytes:
        problems.append(f"{sum(w.ret or 0 for w in writes)} bytes written to the temp file, not {nbytes}")
    if any(not _before(opened, w) for w in writes):
        problems.append("a write came before the temp file was created")

    synced = [
        s
        for s in calls
        if s.name in SYNCS and s.ok and s.fd_path() == temp and all(_before(w, s) for w in writes)
    ]
    if not synced:
        problems.append("the temp file was not fsynced after its last write")
    elif not _before(synced[0], rename):
        problems.append("the rename came before the temp file's fsync")

    directory = final.parent
    if not any(s.name in SYNCS and s.ok and s.fd_path() == directory and _before(rename, s) for s in calls):
        problems.append(f"the directory {directory} was not fsynced after the rename")
    for made in calls:
        if made.name in MKDIRS and made.ok and _made_dir(made) in final.parents:
            parent = _made_dir(made).parent
            if not any(
                s.name in SYNCS and s.ok and s.fd_path() == parent and _before(made, s) for s in calls
            ):
                problems.append(f"{parent} was not fsynced after {_made_dir(made)} was created in it")
    return problems


# -- the live trace -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LiveRun:
    traced: Traced
    created: Path
    replaced: Path
    data: tuple[bytes, bytes]


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LiveRun:
    """Two persists traced in one child: one into new directories, one replacing a replica."""
    root = tmp_path_factory.mktemp("order")
    created = root / "new" / "sub" / "created.astage"
    replaced = root / "replaced.astage"
    anyio.run(write_checkpoint_file, replaced, [replica(1)])
    data = (replica(2), replica(3, nbytes=300_000))
    traced = run_traced(
        [(created, data[0]), (replaced, data[1])],
        lambda _: ["-e", f"trace={syscall_set(TRACED)}"],
        backend=request.param,
    )
    return LiveRun(traced, created, replaced, data)


def test_a_real_persist_makes_its_steps_durable_in_order(live: LiveRun) -> None:
    assert live.traced.outcomes == [Outcome(), Outcome()]
    for final, data in zip((live.created, live.replaced), live.data, strict=True):
        assert final.read_bytes() == data
        load_checkpoint_file_sync(final)
        assert durable_order_problems(live.traced.calls, final, nbytes=len(data)) == []
    made = [_made_dir(c) for c in live.traced.calls if c.name in MKDIRS and c.ok]
    assert made == [live.created.parent.parent, live.created.parent]


def test_each_persist_uses_its_own_temp_name(live: LiveRun) -> None:
    temps = [paths_renamed(c)[0] for c in live.traced.calls if c.name in RENAMES]
    assert len(temps) == 2
    assert temps[0].name != temps[1].name
    assert all(is_temp_name(t.name) for t in temps)
    assert not any(is_temp_name(name) for _, _, names in os.walk(live.replaced.parent) for name in names)


# -- the check rejects every step removed or reordered ----------------------------------------

# A persist as strace recorded it here (paths shortened, writes trimmed to three), so that the
# mutants run without strace too.  Thread 52 is a worker thread, 48 the event loop's.
RECORDED_FINAL = Path("/s/c/r.astage")
RECORDED_NBYTES = 3 * 65536
RECORDED = """\
52  mkdir("/s/c", 0700)       = 0
52  openat(AT_FDCWD</w>, "/s/c/.r.astage.astage-tmp.1ced72c7b69a4bc18b4c93cb73572f73", \
O_WRONLY|O_CREAT|O_EXCL|O_CLOEXEC, 0600) = 9</s/c/.r.astage.astage-tmp.1ced72c7b69a4bc18b4c93cb73572f73>
52  write(9</s/c/.r.astage.astage-tmp.1ced72c7b69a4bc18b4c93cb73572f73>, ""..., 65536) = 65536
52  write(9</s/c/.r.astage.astage-tmp.1ced72c7b69a4bc18b4c93cb73572f73>, ""..., 65536 <unfinished ...>
48  close(7<socket:[74045]>)          = 0
52  <... write resumed>)              = 65536
52  write(9</s/c/.r.astage.astage-tmp.1ced72c7b69a4bc18b4c93cb73572f73>, ""..., 65536) = 65536
52  fsync(9</s/c/.r.astage.astage-tmp.1ced72c7b69a4bc18b4c93cb73572f73>) = 0
52  close(9</s/c/.r.astage.astage-tmp.1ced72c7b69a4bc18b4c93cb73572f73>) = 0
52  rename("/s/c/.r.astage.astage-tmp.1ced72c7b69a4bc18b4c93cb73572f73", "/s/c/r.astage") = 0
52  openat(AT_FDCWD</w>, "/s/c", O_RDONLY|O_CLOEXEC|O_DIRECTORY) = 9</s/c>
52  fsync(9</s/c>)                    = 0
52  close(9</s/c>)                    = 0
52  openat(AT_FDCWD</w>, "/s", O_RDONLY|O_CLOEXEC|O_DIRECTORY) = 9</s>
52  fsync(9</s>)                      = 0
52  close(9</s>)                      = 0
52  +++ exited with 0 +++
"""

Mutant = Callable[[list[Syscall], Path], list[Syscall]]


def _sequential(calls: Sequence[Syscall]) -> list[Syscall]:
    """The calls one after another, in list order (mutants move calls around)."""
    return [dataclasses.replace(c, start=2 * i, end=2 * i + 1) for i, c in enumerate(calls)]


def _indices(calls: Sequence[Syscall], final: Path, step: str) -> list[int]:
    """Positions of the calls that make ``step`` of the persist of ``final``."""
    temp = next(paths_renamed(c)[0] for c in calls if c.name in RENAMES and paths_renamed(c)[1] == final)
    ancestors = set(final.parent.parents)
    matches: dict[str, Callable[[Syscall], bool]] = {
        "open": lambda c: c.name in OPENS and path_opened(c) == temp,
        "write": lambda c: c.name in WRITES and c.fd_path() == temp,
        "fsync": lambda c: c.name in SYNCS and c.fd_path() == temp,
        "rename": lambda c: c.name in RENAMES and paths_renamed(c)[1] == final,
        "dir-fsync": lambda c: c.name in SYNCS and c.fd_path() == final.parent,
        "parent-fsync": lambda c: c.name in SYNCS and c.fd_path() in ancestors,
    }
    return [i for i, c in enumerate(calls) if matches[step](c)]


def _drop(step: str, every: bool = False) -> Mutant:
    def mutate(calls: list[Syscall], final: Path) -> list[Syscall]:
        found = _indices(calls, final, step)
        doomed = set(found if every else found[:1])
        return [c for i, c in enumerate(calls) if i not in doomed]

    return mutate


def _move(step: str, anchor: str, *, after: bool = False) -> Mutant:
    """Move the first ``step`` call just before (or just after) the first ``anchor`` call."""

    def mutate(calls: list[Syscall], final: Path) -> list[Syscall]:
        i = _indices(calls, final, step)[0]
        target = _indices(calls, final, anchor)[0] + after
        calls.insert(target - (i < target), calls.pop(i))
        return calls

    return mutate


def _edit(step: str, **changes: Any) -> Mutant:
    def mutate(calls: list[Syscall], final: Path) -> list[Syscall]:
        i = _indices(calls, final, step)[0]
        calls[i] = dataclasses.replace(calls[i], **changes)
        return calls

    return mutate


def _without_flag(flag: str) -> Mutant:
    def mutate(calls: list[Syscall], final: Path) -> list[Syscall]:
        i = _indices(calls, final, "open")[0]
        args = tuple(a.replace(f"|{flag}", "").replace(f"{flag}|", "") for a in calls[i].args)
        calls[i] = dataclasses.replace(calls[i], args=args)
        return calls

    return mutate


def _temp_renamed(new_path: Callable[[Path, Path], Path]) -> Mutant:
    """The same calls with the temp file at ``new_path(temp, final)`` everywhere."""

    def mutate(calls: list[Syscall], final: Path) -> list[Syscall]:
        temp = paths_renamed(calls[_indices(calls, final, "rename")[0]])[0]
        old, new = str(temp), str(new_path(temp, final))

        def edit(arg: str) -> str:
            # A name relative to the directory's descriptor becomes the new absolute path.
            return f'"{new}"' if arg == f'"{temp.name}"' else arg.replace(old, new)

        return [
            dataclasses.replace(
                c,
                args=tuple(edit(a) for a in c.args),
                ret_path=c.ret_path.replace(old, new) if c.ret_path else None,
            )
            for c in calls
        ]

    return mutate


def _in_place(calls: list[Syscall], final: Path) -> list[Syscall]:
    """Write the final file directly: no temp file, no rename."""
    return [c for c in _temp_renamed(lambda temp, final: final)(calls, final) if c.name not in RENAMES]


MUTANTS: dict[str, tuple[Mutant, str]] = {
    "temp open removed": (_drop("open"), "expected one open of the temp file"),
    "temp opened without O_EXCL": (_without_flag("O_EXCL"), "not created exclusively"),
    "temp opened without O_CREAT": (_without_flag("O_CREAT"), "not created exclusively"),
    "temp open failed": (_edit("open", ret=-1, error="EEXIST", ret_path=None), "could not be opened"),
    "writes removed": (_drop("write", every=True), "nothing was written"),
    "a write lost": (_drop("write"), "bytes written to the temp file, not"),
    "a write failed": (_edit("write", ret=-1, error="ENOSPC"), "a write to the temp file failed"),
    "a write before the open": (_move("write", "open"), "a write came before the temp file was created"),
    "file fsync removed": (_drop("fsync"), "not fsynced after its last write"),
    "file fsync failed": (_edit("fsync", ret=-1, error="EIO"), "not fsynced after its last write"),
    "file fsync is sync_file_range": (_edit("fsync", name="sync_file_range"), "not fsynced after its last"),
    "file fsync before the writes": (_move("fsync", "write"), "not fsynced after its last write"),
    "a write after the file fsync": (_move("write", "fsync", after=True), "not fsynced after its last write"),
    "rename removed": (_drop("rename"), "expected one rename"),
    "rename failed": (_edit("rename", ret=-1, error="EXDEV"), "the rename failed"),
    "rename before the file fsync": (
        _move("rename", "fsync"),
        "the rename came before the temp file's fsync",
    ),
    "directory fsync removed": (_drop("dir-fsync"), "was not fsynced after the rename"),
    "directory fsync failed": (_edit("dir-fsync", ret=-1, error="EIO"), "was not fsynced after the rename"),
    "directory fsync before the rename": (_move("dir-fsync", "rename"), "was not fsynced after the rename"),
    "new directories' parents not fsynced": (_drop("parent-fsync", every=True), "was created in it"),
    "fixed temp name": (
        _temp_renamed(lambda temp, final: final.with_name(f".{final.name}.tmp")),
        "is not a unique astage temp name",
    ),
    "another file's temp name": (
        _temp_renamed(lambda temp, final: temp.with_name(temp.name.replace(final.name, "other.astage", 1))),
        "is not a unique astage temp name",
    ),
    "temp in another directory": (
        _temp_renamed(lambda temp, final: final.parent.parent / temp.name),
        "is not in the target directory",
    ),
    "written in place": (_in_place, "expected one rename"),
}


def test_the_recorded_trace_parses_and_passes() -> None:
    calls = parse_strace(RECORDED)
    assert [c.name for c in calls][:5] == ["mkdir", "openat", "write", "close", "write"]  # by completion
    joined, concurrent = calls[4], calls[3]
    assert (joined.ret, joined.fd_path()) == (65536, calls[2].fd_path())
    assert joined.start < concurrent.start < joined.end  # the write was in flight during the close
    assert durable_order_problems(calls, RECORDED_FINAL, RECORDED_NBYTES) == []
    assert durable_order_problems(_sequential(calls), RECORDED_FINAL, RECORDED_NBYTES) == []


def test_the_parser_reads_paths_results_errors_and_injections() -> None:
    fsync, opened = parse_strace(
        "12  fsync(6</a/b (c), d>) = -1 EIO (Input/output error) (INJECTED)\n"
        "12  +++ killed by SIGKILL +++\n"
        '3  openat(AT_FDCWD</w>, "x\\"y/../z", O_RDONLY) = 4</w/z>\n'
    )
    assert (fsync.name, fsync.ret, fsync.error, fsync.injected) == ("fsync", -1, "EIO", True)
    assert fsync.fd_path() == Path("/a/b (c), d")
    assert opened.path_arg(1, dirfd=0) == Path("/w/z")
    assert (opened.ret, opened.ret_path, opened.error, opened.injected) == (4, "/w/z", None, False)


def _assert_rejected(calls: list[Syscall], final: Path, nbytes: int, mutant: str) -> None:
    good = _sequential(calls)
    assert durable_order_problems(good, final, nbytes) == []
    mutate, reason = MUTANTS[mutant]
    bad = _sequential(mutate(list(good), final))
    assert bad != good
    problems = durable_order_problems(bad, final, nbytes)
    assert any(reason in p for p in problems), f"{mutant} went unnoticed: {problems}"


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_check_rejects_each_step_removed_or_misordered(mutant: str) -> None:
    _assert_rejected(parse_strace(RECORDED), RECORDED_FINAL, RECORDED_NBYTES, mutant)


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_the_check_rejects_each_step_removed_or_misordered_in_a_live_trace(
    mutant: str, live: LiveRun
) -> None:
    _assert_rejected(live.traced.calls, live.created, len(live.data[0]), mutant)
