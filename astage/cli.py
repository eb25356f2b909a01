"""The ``astage`` command: look at checkpoint directories and files, run the demo and benchmarks.

Everything it prints that comes from a file (keys, values, checkpoint ids, file names) is
untrusted: the consoles render no markup and no emoji codes, and such text is passed as
:class:`rich.text.Text` with non-printable characters escaped, so a key such as ``"x[/]"``
is shown as itself and cannot break the output or drive the terminal.  Tables are never cut
to a terminal width when the output is piped, and ``--json`` gives the same facts to
programs.  Progress bars (on stderr) appear only on a terminal.

The commit markers and the layout are read through the code that
:meth:`astage.Checkpointer.restore` trusts, so ``ls`` flags exactly the copies it would refuse.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import os
import pkgutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

import astage
import astage.files

from ._demo import run_demo
from ._files.directory import layout_role, step_of_dir
from ._files.directory import rank_file_names as _names
from ._files.durable import FILE_SUFFIX, is_temp_name
from ._files.markers import Marker as _Marker
from ._files.markers import check_committed, read_marker
from ._format.codec import FileHeader
from ._staging.plan import AtomNode, CopyNode, DictNode, Node, ObjectNode, RefNode, SeqNode, TensorNode
from ._util.errors import Attr, format_key_path

DESCRIPTION = """\
Look at and verify astage checkpoints and replicas, run the demo and the benchmarks.

A checkpoint file (header, then body) is the format of a rank's local file in a
Checkpointer's step directory and of a replica: a peer's copy of a rank's state.

`astage ls DIR` lists the checkpoint steps under DIR (committed or not, the latest, size,
ranks) and the replicas, and checks every committed step as a restore would;
`astage inspect FILE` shows one checkpoint file, replica or commit marker in full.

exit status: 0 all good; 1 damaged data found (a committed step or a replica that would not
restore) or a benchmark failed; 2 bad arguments or unreadable input."""

EXIT_DAMAGED = 1
EXIT_ERROR = 2


def _stdout_console() -> Console:
    # Piped output is never cut to a width: a table takes the width its cells need.
    wide = None if sys.stdout.isatty() else 1 << 16
    return Console(markup=False, emoji=False, highlight=False, width=wide)


console = _stdout_console()
errors = Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)


def shown(value: object) -> Text:
    """Untrusted text for display: never markup, non-printable characters escaped."""
    text = str(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return Text(text)


def _bar(on: Console, *, nbytes: bool) -> Progress | None:
    """A transient progress bar on ``on`` if it is a terminal (never in a pipe or a file)."""
    if not on.is_terminal:
        return None
    columns: list[ProgressColumn] = [
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        DownloadColumn() if nbytes else MofNCompleteColumn(),
        TimeElapsedColumn(),
    ]
    return Progress(*columns, console=on, transient=True)


@contextlib.contextmanager
def _progress(description: str, total: float | None, *, nbytes: bool) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (a terminal only; stdout may be JSON); yields ``advance(amount)``."""
    bar = _bar(Console(stderr=True, markup=False, emoji=False, highlight=False), nbytes=nbytes)
    if bar is None:
        yield lambda amount: None
        return
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda amount: bar.advance(task, amount)


def _iso(timestamp: float) -> str:
    """A local date and time for any timestamp a valid file can hold (every finite float).

    Beyond what the platform's calendar reaches (about ±1e17 s here) it is shown as seconds:
    a valid file is displayed, never reported unreadable for its date.
    """
    try:
        t = time.localtime(timestamp)
    except (OverflowError, OSError, ValueError):
        return f"{timestamp:.6g} s from the epoch (beyond the calendar)"
    return f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d} {t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d}"


# -- inspect --------------------------------------------------------------------------------


def _leaves(node: Node, path: tuple[object, ...]) -> Iterator[tuple[tuple[object, ...], Node]]:
    """Every leaf of a decoded tree with its key path (containers met twice: a reference)."""
    if isinstance(node, DictNode):
        for key, value in zip(node.keys, node.values, strict=True):
            yield from _leaves(value, (*path, key))
        children = node.attrs
    elif isinstance(node, SeqNode):
        for index, item in enumerate(node.items):
            yield from _leaves(item, (*path, index))
        children = node.attrs
    elif isinstance(node, ObjectNode):
        children = node.fields
    else:
        yield path, node
        return
    for name, child in children:
        yield from _leaves(child, (*path, Attr(name)))


def _key_text(path: tuple[object, ...]) -> str:
    return format_key_path(path).removeprefix("state_dict") or "<root>"


def _leaf_rows(header: FileHeader) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path, node in _leaves(header.plan.root, ()):
        row: dict[str, Any] = {"key_path": _key_text(path)}
        if isinstance(node, TensorNode):
            spec = header.plan.tensors[node.position]
            row |= {
                "type": spec.kind.value,
                "dtype": str(spec.dtype).removeprefix("torch."),
                "shape": list(spec.size),
                "storage": spec.storage,
                "nbytes": spec.dtype.itemsize * math.prod(spec.size),
            }
        elif isinstance(node, RefNode):
            row |= {"type": "reference", "value": "the same container as an earlier key"}
        else:
            assert isinstance(node, AtomNode | CopyNode)
            value = node.value
            text = repr(value)
            row |= {"type": type(value).__name__, "value": text if len(text) <= 200 else text[:199] + "…"}
        rows.append(row)
    return rows


def _replica_summary(info: astage.files.CheckpointFileInfo) -> dict[str, Any]:
    header = info.header
    return {
        "owner_rank": info.owner_rank,
        "holder_rank": info.holder_rank,
        "step": info.step,
        "checkpoint_id": info.checkpoint_id,
        "created": info.created,
        "nbytes": info.nbytes,
        "body_nbytes": header.body_nbytes,
        "tensors": header.num_tensors,
        "storages": len(header.segments),
    }


def _verify_file(path: Path, body_nbytes: int) -> None:
    with _progress(f"verifying {shown(path.name)}", body_nbytes, nbytes=True) as advance:
        astage.files.load_checkpoint_file_sync(path, on_read=advance)


def _file_kind(path: Path) -> tuple[str, int | None, int | None]:
    """``("marker" | "checkpoint" | "replica", step, rank)`` from where and how a file is named.

    ``"checkpoint"`` is a rank's file in a Checkpointer's step directory; any other file of
    the format is taken for a replica until its header says whether a holder keeps it.
    """
    role = layout_role(path.name)
    step = step_of_dir(path.parent.name)
    if role is not None and step is not None:
        return role[0], step, role[1]
    return ("marker" if path.name.endswith(".COMMITTED") else "replica"), step, None


def _committed_by_marker(path: Path, step: int, rank: int) -> bool:
    """Whether a valid commit marker beside a checkpoint file names it."""
    try:
        marker = read_marker(path.with_name(_names(rank)[1]), step=step, rank=rank)
    except (astage.IntegrityError, OSError):
        return False
    return any(f.name == path.name for f in marker.files)


def _inspect(path: Path, verify: bool, as_json: bool) -> int:
    kind, step, rank = _file_kind(path)
    if kind == "marker":
        return _inspect_marker(path, step, rank, verify, as_json)
    info = astage.files.inspect_checkpoint_file(path)
    if kind == "replica" and info.holder_rank is None:
        kind = "checkpoint"  # a rank's own file (no holder), outside a Checkpointer's layout
    doc: dict[str, Any] = {"path": str(path), "kind": kind, **_replica_summary(info)}
    if step is not None and rank is not None:
        doc["committed"] = _committed_by_marker(path, step, rank)
    doc["leaves"] = _leaf_rows(info.header)
    if verify:
        _verify_file(path, info.header.body_nbytes)
    doc["verified"] = verify
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        _print_file(path, info, doc)
    return 0


def _print_file(path: Path, info: astage.files.CheckpointFileInfo, doc: dict[str, Any]) -> None:
    """``astage inspect`` of a checkpoint file or a replica, as text."""
    if "committed" in doc:
        state = "committed" if doc["committed"] else "not committed (no valid commit marker names it)"
        title = f"checkpoint file of rank {info.owner_rank}, step {info.step}: {state}"
    elif doc["kind"] == "checkpoint":
        title = (
            f"checkpoint file of rank {info.owner_rank}, step {info.step} "
            "(outside a Checkpointer's step directory: no commit marker applies)"
        )
    else:
        title = f"replica of rank {info.owner_rank}'s step {info.step}, kept by rank {info.holder_rank}"
    console.print(shown(path), style="bold")
    console.print(title)
    console.print(
        Text.assemble(
            "checkpoint id ",
            shown(repr(info.checkpoint_id)),
            f", created {_iso(info.created)}; {info.header.num_tensors} tensors in "
            f"{len(info.header.segments)} storages, {info.header.body_nbytes:,} data bytes, "
            f"{info.nbytes:,} bytes on disk",
        )
    )
    table = Table(show_edge=False)
    for column in ("key path", "type", "dtype / value", "shape", "storage", "bytes"):
        table.add_column(column, justify="right" if column in ("storage", "bytes") else "left")
    for row in doc["leaves"]:
        if "dtype" in row:
            cells = [row["dtype"], str(row["shape"]), str(row["storage"]), f"{row['nbytes']:,}"]
        else:
            cells = [row["value"], "", "", ""]
        table.add_row(shown(row["key_path"]), shown(row["type"]), *(shown(c) for c in cells))
    console.print(table)
    if doc["verified"]:
        console.print("checksums verified: header and every storage", style="green")


def _inspect_marker(path: Path, step: int | None, rank: int | None, verify: bool, as_json: bool) -> int:
    if step is None or rank is None:
        raise astage.ConfigurationError(
            f"{path} looks like a commit marker, but only one named rankNNNNN.COMMITTED inside its "
            "step directory (step_NNNNNNNNNN) can be checked"
        )
    marker = read_marker(path, step=step, rank=rank)
    total = sum(f.nbytes for f in marker.files) if verify else None
    with _progress(f"verifying step {marker.step}", total, nbytes=True) as advance:
        problem = _check(path.parent, marker, verify, advance)
    doc = {
        "path": str(path),
        "kind": "marker",
        "step": marker.step,
        "rank": marker.rank,
        "checkpoint_id": marker.checkpoint_id,
        "created": marker.created,
        "files": [dataclasses.asdict(f) for f in marker.files],
        "verified": verify,
        "problem": problem,
    }
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        console.print(shown(path), style="bold")
        console.print(f"commit marker: step {marker.step} of rank {marker.rank} is committed")
        console.print(
            Text.assemble("checkpoint id ", shown(repr(marker.checkpoint_id)), f", {_iso(marker.created)}")
        )
        for entry in marker.files:
            console.print(Text.assemble("  names ", shown(entry.name), f" ({entry.nbytes:,} bytes)"))
        if problem:
            errors.print(Text.assemble("DAMAGED: ", shown(problem)), style="red")
        else:
            what = "checksums verified" if verify else "headers match the marker"
            console.print(f"the files it names are there; {what}", style="green")
    return EXIT_DAMAGED if problem else 0


def _check(step_dir: Path, marker: _Marker, verify: bool, advance: Callable[[int], None]) -> str | None:
    """Why a committed step would not restore, or ``None``; ``advance`` gets its file bytes."""
    total = sum(f.nbytes for f in marker.files) if verify else 0
    try:
        with _accounted(advance, total) as read:
            check_committed(step_dir, marker, verify=verify, on_read=read)
    except FileNotFoundError as exc:
        return f"its checkpoint file is missing: {exc.filename}"
    except (astage.IntegrityError, OSError) as exc:
        return f"its checkpoint file is corrupt: {exc}"
    return None


@contextlib.contextmanager
def _accounted(advance: Callable[[int], None], total: int) -> Iterator[Callable[[int], None]]:
    """Pass reads on to ``advance``; at the end, count what was not read (headers, a failure)."""
    done = 0

    def read(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        advance(nbytes)

    try:
        yield read
    finally:
        advance(total - done)


# -- ls -------------------------------------------------------------------------------------


@dataclasses.dataclass
class _RankState:
    rank: int
    checkpoint_file: str | None = None
    nbytes: int = 0
    marker: _Marker | None = None  # the parsed commit marker, if valid
    marker_file: str | None = None
    problem: str | None = None

    @property
    def committed(self) -> bool:
        return self.marker is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "checkpoint_file": self.checkpoint_file,
            "marker_file": self.marker_file,
            "committed": self.committed,
            "checkpoint_id": None if self.marker is None else self.marker.checkpoint_id,
            "created": None if self.marker is None else self.marker.created,
            "nbytes": self.nbytes,
            "problem": self.problem,
        }


@dataclasses.dataclass
class _Step:
    step: int
    path: Path
    ranks: dict[int, _RankState] = dataclasses.field(default_factory=dict)
    temps: list[str] = dataclasses.field(default_factory=list)
    others: list[str] = dataclasses.field(default_factory=list)

    def rank(self, rank: int) -> _RankState:
        return self.ranks.setdefault(rank, _RankState(rank))

    @property
    def committed(self) -> bool:
        """Every rank present has a valid commit marker (as the Checkpointer sees it)."""
        return bool(self.ranks) and all(r.committed for r in self.ranks.values())

    @property
    def problems(self) -> list[str]:
        return [f"rank {r.rank}: {r.problem}" for r in self.ranks.values() if r.problem]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks.values())


def _read_step(step_dir: Path, step: int) -> _Step:
    found = _Step(step, step_dir)
    with os.scandir(step_dir) as listing:
        entries = sorted(listing, key=lambda e: e.name)
    for entry in entries:
        role = layout_role(entry.name)
        if role is None:
            (found.temps if is_temp_name(entry.name) else found.others).append(entry.name)
            continue
        what, rank = role
        state = found.rank(rank)
        size = entry.stat(follow_symlinks=False).st_size
        state.nbytes += size
        if what == "checkpoint":
            state.checkpoint_file = entry.name
            continue
        state.marker_file = entry.name
        try:
            state.marker = read_marker(Path(entry.path), step=step, rank=rank)
        except (astage.IntegrityError, OSError) as exc:
            state.problem = f"its commit marker {entry.name} is invalid: {exc}"
    return found


def _find(top: Path) -> tuple[dict[Path, list[_Step]], dict[Path, list[Path]]]:
    """Checkpoint directories (with their step directories) and the other checkpoint files
    (replicas) under ``top``."""
    checkpoints: dict[Path, list[_Step]] = {}
    replicas: dict[Path, list[Path]] = {}
    if (step := step_of_dir(top.name)) is not None:
        checkpoints[top.parent] = [_read_step(top, step)]
        return checkpoints, replicas
    for here, dirs, files in os.walk(top):  # symlinked directories are listed, never entered
        directory = Path(here)
        # A symlinked step directory is not the Checkpointer's (it never follows one): skipped.
        steps = sorted(
            (s, d) for d in dirs if (s := step_of_dir(d)) is not None and not (directory / d).is_symlink()
        )
        if steps:
            checkpoints[directory] = [_read_step(directory / d, s) for s, d in steps]
        dirs[:] = sorted(d for d in dirs if step_of_dir(d) is None)
        found = sorted(directory / f for f in files if f.endswith(FILE_SUFFIX))
        found = [p for p in found if p.is_file() and not p.is_symlink()]
        if found:
            replicas[directory] = found
    return checkpoints, replicas


def _rank_span(ranks: Sequence[int]) -> str:
    if not ranks:
        return "-"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _ls(top: Path, verify: bool, as_json: bool) -> int:
    if not top.is_dir():
        raise astage.ConfigurationError(f"{top} is not a directory")
    checkpoints, replica_dirs = _find(top)
    replicas = _check_all(checkpoints, replica_dirs, verify)
    doc: dict[str, Any] = {
        "directory": str(top),
        "verified": verify,
        "checkpoints": [_checkpoint_dir_doc(directory, steps) for directory, steps in checkpoints.items()],
        "replicas": [{"directory": str(d), "files": entries} for d, entries in replicas.items()],
    }
    problems = [
        f"{step['path']}: {p}" for c in doc["checkpoints"] for step in c["steps"] for p in step["problems"]
    ] + [
        f"{f['path']}: not a valid checkpoint file: {f['problem']}"
        for d in doc["replicas"]
        for f in d["files"]
        if f["problem"]
    ]
    doc["problems"] = problems
    doc["ok"] = not problems
    if as_json:
        print(json.dumps(doc, indent=1))
    else:
        _print_ls(doc)
    return EXIT_DAMAGED if problems else 0


def _remote(command: str, url: str, verify: bool, as_json: bool) -> int:
    """``astage ls URL``: a remote tier's steps, complete or not, checked; ``astage inspect
    URL``: one object, downloaded (checked against its commit object) and shown as a file."""
    # obstore is an optional dependency (the ``remote`` extra): loaded only for a URL.
    try:
        from ._remote import catalog
    except ImportError as exc:
        print(f"astage {command}: a URL needs 'pip install astage[remote]' ({exc})", file=sys.stderr)
        return 2
    if command == "inspect":
        with catalog.scratch_dir() as (path, _):
            name = anyio.run(catalog.download_object, url, path, as_json)
            return _inspect(path / name, verify, as_json)
    doc = anyio.run(functools.partial(catalog.list_remote, url, verify=verify))
    _stdout_console().print_json(data=doc) if as_json else _stdout_console().print(catalog.remote_table(doc))
    return EXIT_DAMAGED if doc["problems"] else 0


def _check_all(
    checkpoints: dict[Path, list[_Step]], replica_dirs: dict[Path, list[Path]], verify: bool
) -> dict[Path, list[dict[str, Any]]]:
    """Check every committed step (recording problems on it) and read every other file."""
    committed = [
        (s, r, r.marker)
        for steps in checkpoints.values()
        for s in steps
        for r in s.ranks.values()
        if r.marker is not None
    ]
    total = None
    if verify:
        total = sum(f.nbytes for _, _, m in committed for f in m.files)
        total += sum(p.stat().st_size for paths in replica_dirs.values() for p in paths)
    replicas: dict[Path, list[dict[str, Any]]] = {}
    with _progress("checking committed steps and replicas", total, nbytes=True) as advance:
        for s, r, marker in committed:
            r.problem = _check(s.path, marker, verify, advance)
        for directory, paths in replica_dirs.items():
            replicas[directory] = [_replica_entry(p, verify, advance) for p in paths]
    return replicas


def _checkpoint_dir_doc(directory: Path, steps: list[_Step]) -> dict[str, Any]:
    """One Checkpointer directory for ``ls --json``: its steps and the latest complete one."""
    all_ranks = sorted({r.rank for s in steps for r in s.ranks.values() if r.committed})
    complete = [s.step for s in steps if s.committed and not s.problems and sorted(s.ranks) == all_ranks]
    return {
        "directory": str(directory),
        "latest": max(complete, default=None),
        "ranks": all_ranks,
        "steps": [
            {
                "step": s.step,
                "path": str(s.path),
                "committed": s.committed,
                "damaged": bool(s.problems),
                "nbytes": s.nbytes,
                "ranks": [r.to_json() for r in sorted(s.ranks.values(), key=lambda r: r.rank)],
                "temp_files": s.temps,
                "other_files": s.others,
                "problems": s.problems,
            }
            for s in steps
        ],
    }


def _replica_entry(path: Path, verify: bool, advance: Callable[[int], None]) -> dict[str, Any]:
    try:
        with _accounted(advance, path.stat().st_size if verify else 0) as read:
            info = astage.files.inspect_checkpoint_file(path)
            if verify:
                astage.files.load_checkpoint_file_sync(path, on_read=read)
    except (astage.IntegrityError, OSError) as exc:
        return {"path": str(path), "name": path.name, "problem": str(exc)}
    return {
        "path": str(path),
        "name": path.name,
        "problem": None,
        "mtime": info.mtime,
        **_replica_summary(info),
    }


def _print_ls(doc: dict[str, Any]) -> None:
    if not doc["checkpoints"] and not doc["replicas"]:
        console.print(Text.assemble("no checkpoints and no replicas under ", shown(doc["directory"])))
    for c in doc["checkpoints"]:
        latest = "none" if c["latest"] is None else str(c["latest"])
        # Titles go on their own line: a table's title would wrap at the table's width.
        console.print(Text.assemble("checkpoint directory ", shown(c["directory"])), style="bold")
        table = Table()
        for column in ("step", "committed", "ranks", "bytes", "committed at", "notes"):
            table.add_column(column, justify="right" if column in ("step", "bytes") else "left")
        for s in c["steps"]:
            ranks = s["ranks"]
            done = [r["rank"] for r in ranks if r["committed"] and not r["problem"]]
            created = max((r["created"] for r in ranks if r["created"] is not None), default=None)
            notes = [*s["problems"]]
            pending = [r["rank"] for r in ranks if not r["committed"] and not r["problem"]]
            if pending:
                notes.append(f"uncommitted checkpoint file(s) of rank(s) {_rank_span(pending)}")
            if s["temp_files"]:
                notes.append(f"{len(s['temp_files'])} unfinished temp file(s)")
            if s["step"] == c["latest"]:
                notes.insert(0, "latest")
            state = "DAMAGED" if s["damaged"] else "yes" if s["committed"] else "no"
            table.add_row(
                str(s["step"]),
                Text(state, style="red" if s["damaged"] else "green" if s["committed"] else "yellow"),
                _rank_span(done),
                f"{s['nbytes']:,}",
                _iso(created) if created is not None else "-",
                shown("; ".join(notes)),
            )
        console.print(table)
        console.print(f"latest complete step: {latest}; ranks {_rank_span(c['ranks'])}\n")
    for d in doc["replicas"]:
        # Outside a Checkpointer's step directories: replicas, and any file without a holder.
        console.print(
            Text.assemble("replicas and other checkpoint files in ", shown(d["directory"])), style="bold"
        )
        table = Table()
        for column in ("file", "owner rank", "holder rank", "step", "checkpoint id", "bytes", "written"):
            table.add_column(column, justify="right" if column in ("step", "bytes") else "left")
        for f in d["files"]:
            if f["problem"]:
                table.add_row(
                    shown(f["name"]), Text("INVALID", style="red"), "", "", shown(f["problem"]), "", ""
                )
                continue
            table.add_row(
                shown(f["name"]),
                str(f["owner_rank"]),
                "-" if f["holder_rank"] is None else str(f["holder_rank"]),
                str(f["step"]),
                shown(repr(f["checkpoint_id"])),
                f"{f['nbytes']:,}",
                _iso(f["mtime"]),
            )
        console.print(table)
    for problem in doc["problems"]:
        errors.print(Text.assemble("DAMAGED: ", shown(problem)), style="red")


# -- bench ----------------------------------------------------------------------------------


def _bench_package() -> tuple[str, Path | None]:
    """The benchmarks' package, and the directory to run it from (a checkout) or ``None``."""
    # Installed: astage._bench (pyproject.toml); a checkout: benchmarks/ beside astage/.
    if importlib.util.find_spec("astage._bench") is not None:
        return "astage._bench", None
    root = Path(astage.__file__).resolve().parent.parent
    if (root / "benchmarks" / "__init__.py").is_file():
        return "benchmarks", root
    raise astage.ConfigurationError("this installation of astage has no benchmarks")


def bench_names() -> list[str]:
    """The benchmarks ``astage bench`` can run (``bench_NAME`` modules of the package)."""
    package, root = _bench_package()
    path = importlib.import_module(package).__path__ if root is None else [str(root / "benchmarks")]
    names = (m.name for m in pkgutil.iter_modules(path))
    return sorted(name.removeprefix("bench_") for name in names if name.startswith("bench_"))


def _run_bench(args: list[str], cwd: Path | None, env: dict[str, str], bar: Progress | None) -> int:
    if bar is None:
        return subprocess.run(args, cwd=cwd, env=env, check=False).returncode
    with subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            bar.console.out(line.rstrip("\n"), highlight=False)
        return proc.wait()


def _bench(names: list[str], quick: bool) -> int:
    valid = bench_names()
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise astage.ConfigurationError(
            f"no benchmark named {', '.join(map(repr, unknown))}; the benchmarks are: {', '.join(valid)}"
        )
    package, root = _bench_package()
    chosen = names or valid
    failed: list[str] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # On a terminal the benchmarks' output is passed through the bar's console, so that it
    # scrolls above the bar instead of being overwritten by it.
    bar = _bar(console, nbytes=False)
    with bar or contextlib.nullcontext():
        task = None if bar is None else bar.add_task("benchmarks", total=len(chosen))
        say = errors.print if bar is None else bar.console.print
        for name in chosen:
            say(f"astage bench: running {name}{' (quick)' if quick else ''}", style="bold")
            args = [sys.executable, "-m", f"{package}.bench_{name}", *(["--quick"] if quick else [])]
            # Each benchmark runs in its own process: one that crashes or leaks cannot take
            # the others with it, and every one runs whatever an earlier one did.
            code = _run_bench(args, root, env, bar)
            if code != 0:
                failed.append(f"{name} (exit status {code})")
                say(f"astage bench: {name} failed with exit status {code}", style="red")
            if bar is not None and task is not None:
                bar.advance(task, 1)
    if failed:
        errors.print(f"astage bench: {len(failed)} of {len(chosen)} failed: {', '.join(failed)}", style="red")
        return EXIT_DAMAGED
    return 0


# -- the command ------------------------------------------------------------------------------


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``astage demo``'s arguments."""
    demo = sub.add_parser(
        "demo",
        help="train on local ranks, checkpoint and replicate every few steps, restore and check",
        description="Train a small model on local ranks, checkpoint and replicate every few steps, "
        "then restore, also from a peer's replica, and check every byte.",
    )
    demo.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    demo.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    demo.add_argument("--ranks", type=int, default=2, help="local processes in the gloo group (default 2)")
    demo.add_argument(
        "--directory", type=Path, default=None, help="where to checkpoint (default: a temporary directory)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser (every argument has help text)."""
    parser = argparse.ArgumentParser(
        prog="astage", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"astage {astage.__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to do (`astage COMMAND --help`: more)"
    )
    _add_demo(sub)
    inspect = sub.add_parser(
        "inspect",
        help="show a checkpoint file, replica or commit marker, and verify its checksums",
        description="Show one file: a checkpoint file (step_N/rankR.astage), a replica, or a commit "
        "marker (step_N/rankR.COMMITTED, checked against the file it names). Exits 1 if a marker's "
        "file is damaged, 2 if the file itself cannot be read or is corrupt.",
    )
    inspect.add_argument(
        "path",
        metavar="FILE",
        help="the file to show, or an object's URL (s3://bucket/run/step_N/rankR.astage)",
    )
    inspect.add_argument(
        "--no-verify", action="store_true", help="read only the header, not every checksum of the data"
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    ls = sub.add_parser(
        "ls",
        help="list checkpoint steps and replicas under a directory, and check the committed ones",
        description="List what lies under DIR, recursively: each checkpoint directory's steps (committed "
        "or not, ranks, size, the latest complete step) and each replica (any other checkpoint file). "
        "Every committed step is checked against its commit marker, as a restore would; exits 1 if one "
        "is damaged.",
    )
    ls.add_argument(
        "directory",
        metavar="DIR",
        help="a checkpoint directory, a step directory, or a parent; or a remote tier's URL "
        "(s3://bucket/run: credentials from the environment, as the client reads them)",
    )
    ls.add_argument(
        "--no-verify",
        action="store_true",
        help="compare headers with the markers only, without reading every byte to verify checksums",
    )
    ls.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    bench = sub.add_parser(
        "bench",
        help="run the benchmarks and print their tables",
        description="Run benchmarks, each in its own process; every one runs even if an earlier one "
        "fails, and the exit status is 1 if any failed.",
    )
    bench.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    bench.add_argument(
        "--quick", action="store_true", help="every benchmark at its smallest size (a smoke run)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``astage`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            return run_demo(args.steps, args.every, args.ranks, args.directory)
        target = args.path if args.command == "inspect" else getattr(args, "directory", "")
        if "://" in target:
            return _remote(args.command, target, not args.no_verify, args.json)
        if args.command == "inspect":
            return _inspect(Path(target), not args.no_verify, args.json)
        if args.command == "ls":
            return _ls(Path(target), not args.no_verify, args.json)
        if args.command == "bench":
            return _bench(args.names, args.quick)
    except (astage.AstageError, OSError) as exc:
        errors.print(Text.assemble(f"astage {args.command}: ", shown(exc)), style="red")
        return EXIT_ERROR
    return 0
