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

import json
import logging
import os
import subprocess
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


# -- a commit stands once its marker is durable ----------------------------------------------


def chattr(flag: str, path: Path) -> None:
    done = subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False)
    if done.returncode:
        pytest.skip(f"chattr {flag} is not available here: {done.stderr.decode().strip()}")


async def test_a_retention_failure_after_the_commit_is_one_warning_not_a_failed_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with astage.Checkpointer(tmp_path, keep=1) as ckpt:
        await (await ckpt.save(1, state(1))).wait()
        marker = ckpt.step_dir(1) / "rank00000.COMMITTED"
        chattr("+i", marker)  # root ignores permissions, not the immutable flag
        try:
            with caplog.at_level(logging.WARNING, logger="astage.checkpointer"):
                for step in (2, 3):
                    stats = await (await ckpt.save(step, state(step))).wait()
                    assert stats.step == step
                await ckpt.wait()
            assert ckpt.steps() == [1, 3], "the undeletable step stays committed, the others go"
            assert ckpt.latest() == 3
            assert torch.equal((await ckpt.restore(1))["w"], state(1)["w"])
        finally:
            chattr("-i", marker)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "step 1, which stays committed" in warnings[0].getMessage()


async def test_an_old_step_that_cannot_be_retired_never_fails_the_new_save(tmp_path: Path) -> None:
    """On main, retention raised ``ValueError`` on a file name with a NUL byte taken from an
    old marker, and the save just committed was reported as failed."""
    step_dir = tmp_path / "step_0000000001"
    step_dir.mkdir(mode=0o700)
    (step_dir / "rank00000.astage").write_bytes(b"x")
    (step_dir / "rank00000.COMMITTED").write_text(json.dumps(v1_marker(1, name="rank00000.astage\0")))
    async with astage.Checkpointer(tmp_path, keep=1) as ckpt:
        stats = await (await ckpt.save(2, state(2))).wait()
        assert stats.step == 2
        await ckpt.wait()
        assert ckpt.latest() == 2


def v1_marker(step: int, *, name: str = "rank00000.astage", rank: int = 0) -> dict[str, Any]:
    """A commit marker as astage 0.1 wrote it (version 1, no checksum)."""
    return {
        "format": "astage-checkpoint",
        "version": 1,
        "step": step,
        "rank": rank,
        "checkpoint_id": "0" * 32,
        "created": 1.5,
        "files": [{"name": name, "nbytes": 1, "storages_crc32c": 0}],
    }
