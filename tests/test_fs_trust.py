"""Trusting the file system as little as an adversary would: real files, links, FIFOs, ranks.

* Ranks sharing one directory: another rank's housekeeping (start-up, retention) may remove
  a step directory while it is empty; no save may fail because of it.
* A commit stands once its marker is durable: a retention failure after it is a warning.
* Links planted anywhere under the directory are never followed: nothing outside it is
  created, written or deleted (:data:`OUTSIDE` is checked byte for byte after each case).
* FIFOs, sockets, directories and devices where a file is expected are refused at once.
* Commit markers are untrusted input: checksummed, naming only astage's own file.
* Directories astage creates are 0700 whatever the umask.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import astage
from tests.helpers import no_blocking_calls_on_the_loop, until  # noqa: F401 - autouse fixture

SCALE = int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))

pytestmark = pytest.mark.anyio


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step": step}


# -- ranks sharing one directory ------------------------------------------------------------


async def test_ranks_sharing_a_directory_with_keep_1_never_lose_a_save(tmp_path: Path) -> None:
    ranks, saves = 4, 60 * SCALE
    failures: list[str] = []

    async def rank(r: int) -> None:
        async with astage.Checkpointer(tmp_path, rank=r, keep=1, threads=1) as ckpt:
            for step in range(saves):
                handle = await ckpt.save(step, state(step))
                try:
                    await handle.wait()
                except astage.PersistError as exc:
                    failures.append(f"rank {r} step {step}: {exc}")
            assert ckpt.steps() == [saves - 1]

    async with anyio.create_task_group() as tg:
        for r in range(ranks):
            tg.start_soon(rank, r)
    assert not failures, f"{len(failures)} of {ranks * saves} saves failed: {failures[:3]}"
    for r in range(ranks):
        async with astage.Checkpointer(tmp_path, rank=r) as ckpt:
            assert ckpt.steps() == [saves - 1]
            assert torch.equal((await ckpt.restore())["w"], state(saves - 1)["w"])


_RACER = """
import os, sys
names, stop = sys.argv[1:-1], sys.argv[-1]
log = open(stop + ".removed", "w", buffering=1)
open(stop + ".ready", "w").close()
left = {name: 3 for name in names}  # each step directory removed three times, as soon as empty
while left and not os.path.exists(stop):
    for name in list(left):
        try:
            os.rmdir(name)
        except OSError:
            continue
        log.write(name + "\\n")
        left[name] -= 1
        if not left[name]:
            del left[name]
"""


async def test_a_step_directory_removed_while_empty_never_fails_the_save(tmp_path: Path) -> None:
    """A competing process removes each step directory as soon as it exists and is empty
    (three times at most), as another rank's retention or start-up may: it hits the window
    between creating a step directory and creating a file in it.  Saves go on until it has
    hit a few times (on a loaded machine it may miss some).
    """
    names = [str(tmp_path / f"step_{s:010d}") for s in range(200)]
    stop = tmp_path.parent / f"{tmp_path.name}.stop"
    removed = Path(f"{stop}.removed")
    racer = await anyio.open_process([sys.executable, "-c", _RACER, *names, str(stop)])
    try:
        await until(lambda: Path(f"{stop}.ready").exists())
        async with astage.Checkpointer(tmp_path, keep=2) as ckpt:
            for step in range(len(names)):
                await (await ckpt.save(step, state(step))).wait()
                if lines(removed) >= 5:
                    break
            assert ckpt.steps() == [step - 1, step]
    finally:
        await anyio.Path(stop).touch()
        with anyio.fail_after(30):
            await racer.wait()
    assert lines(removed), "the racer removed nothing: the test proves nothing"


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())
