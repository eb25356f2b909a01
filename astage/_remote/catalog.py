"""What a run's prefix on the store holds, for ``astage ls URL`` and ``astage inspect URL``.

:func:`list_remote` lists the prefix (hostile keys ignored), reads every commit object, and
says per step which ranks are committed, whether the step is complete (every rank's commit
object there, valid, agreeing, each data object of the size it names), its size, and with
``verify`` downloads every object of each complete step into a temporary directory,
checking it against the commit object's size and crc32c as it lands and then every
checksum of the file format, as a restore would.  :func:`download_object` fetches one
object for ``inspect``.  Every download lands in a temporary directory that is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
from rich.table import Table
from rich.text import Text

from .._files.reading import load_checkpoint_file_sync
from .._util.errors import AstageError, IntegrityError
from .client import RemoteClient
from .config import Remote
from .layout import COMMIT_CAP, CommitObject, StepObjects, commit_key, data_key, group_listing, parse_commit


@contextlib.contextmanager
def scratch_dir() -> Iterator[tuple[Path, int]]:
    """A temporary directory and its open descriptor, both gone on exit."""
    path = Path(tempfile.mkdtemp(prefix="astage-remote-"))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield path, fd
    finally:
        os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


async def _commits(client: RemoteClient, objects: StepObjects) -> tuple[dict[int, CommitObject], list[str]]:
    commits: dict[int, CommitObject] = {}
    problems: list[str] = []
    for rank in sorted(objects.commits):
        key = commit_key(objects.step, rank)
        try:
            data = await client.run("get", key, client.get_bytes, key, COMMIT_CAP)
            commits[rank] = parse_commit(data, step=objects.step, rank=rank)
        except AstageError as exc:
            problems.append(f"{key}: {exc}")
            continue
        if objects.data.get(rank) != commits[rank].nbytes:
            problems.append(f"{data_key(objects.step, rank)}: missing or not {commits[rank].nbytes} bytes")
    return commits, problems


async def _verify(client: RemoteClient, commits: dict[int, CommitObject], problems: list[str]) -> None:
    with scratch_dir() as (path, fd):
        for rank, commit in sorted(commits.items()):
            key = data_key(commit.step, rank)
            name = f"rank{rank:05d}.astage"
            try:
                dup = os.dup(fd)
                nbytes, crc = commit.nbytes, commit.crc32c
                await client.run("download", key, client.download, key, dup, name, nbytes, crc, owns=dup)
                await anyio.to_thread.run_sync(load_checkpoint_file_sync, path / name)
            except (AstageError, OSError) as exc:
                problems.append(f"{key}: {exc}")
            finally:
                with contextlib.suppress(FileNotFoundError):
                    (path / name).unlink()


async def list_remote(url: str, *, verify: bool) -> dict[str, Any]:
    """A JSON-able account of the steps under ``url`` (see the module's docstring)."""
    client = Remote(url).client()
    listing = await client.run("list", "", client.listing)
    steps: list[dict[str, Any]] = []
    for step, objects in sorted(group_listing(listing).items()):
        commits, problems = await _commits(client, objects)
        sizes = {c.world_size for c in commits.values()}
        world_size = sizes.pop() if len(sizes) == 1 else None
        if len(sizes) > 0:
            problems.append("the commit objects disagree on the world size")
        complete = world_size is not None and not problems and set(commits) == set(range(world_size))
        if complete and verify:
            await _verify(client, commits, problems)
            complete = not problems
        steps.append(
            {
                "step": step,
                "complete": complete,
                "world_size": world_size,
                "committed_ranks": sorted(commits),
                "data_ranks": sorted(objects.data),
                "nbytes": objects.nbytes,
                "problems": problems,
            }
        )
    complete_steps = [s["step"] for s in steps if s["complete"]]
    # A step that is not complete is not a problem (an upload in flight, a rank lost);
    # a complete-looking step that fails its checks is.
    problems = [f"step {s['step']}: {p}" for s in steps for p in s["problems"] if s["committed_ranks"]]
    return {
        "url": client.url,
        "verified": verify,
        "steps": steps,
        "latest_complete": max(complete_steps, default=None),
        "problems": problems,
        "ok": not problems,
    }


def split_object_url(url: str) -> tuple[str, str]:
    """``s3://b/run/step_N/rankR.astage`` -> (``s3://b/run``, ``step_N/rankR.astage``)."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/")
    head, _, name = path.rpartition("/")
    head, _, step_dir = head.rpartition("/")
    if not name or not step_dir:
        raise IntegrityError(f"{url}: expected .../step_N/rankR.astage")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, head, parts.query, "")), f"{step_dir}/{name}"


async def download_object(url: str, into: Path, quiet: bool = False) -> str:
    """Download the object at ``url`` into the directory ``into``; its file name there.

    Checked against its commit object (size, crc32c) when there is one; unless ``quiet``,
    one line says which.
    """
    base, key = split_object_url(url)
    client = Remote(base).client()
    step_dir, _, name = key.partition("/")
    rank_text = name.removeprefix("rank").split(".", 1)[0]
    commit: CommitObject | None = None
    step = int(step_dir.removeprefix("step_")) if step_dir.removeprefix("step_").isdigit() else None
    if rank_text.isdigit() and step is not None:
        ckey = commit_key(step, int(rank_text))
        if await client.run("head", ckey, client.size, ckey) is not None:
            data = await client.run("get", ckey, client.get_bytes, ckey, COMMIT_CAP)
            commit = parse_commit(data, step=step, rank=int(rank_text))
    nbytes = await client.run("head", key, client.size, key)
    if nbytes is None:
        raise IntegrityError(f"{url}: no such object")
    fd = os.open(into, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    crc = None if commit is None else commit.crc32c
    await client.run("download", key, client.download, key, fd, name, nbytes, crc, owns=fd)
    if not quiet:
        checked = "checked against its commit object" if commit is not None else "no commit object"
        print(f"{url}: {nbytes} bytes downloaded ({checked})")
    return name


def remote_table(doc: dict[str, Any]) -> Table:
    """:func:`list_remote`'s account as a table for the terminal."""
    table = Table(title=f"{doc['url']}: latest complete step {doc['latest_complete']}")
    for column in ("step", "complete", "ranks committed", "size", "problems"):
        table.add_column(column)
    for step in doc["steps"]:
        table.add_row(
            str(step["step"]),
            "yes" if step["complete"] else "no",
            f"{len(step['committed_ranks'])}/{step['world_size'] or '?'}",
            f"{step['nbytes'] / 1e6:.1f} MB",
            Text("; ".join(step["problems"])),
        )
    return table
