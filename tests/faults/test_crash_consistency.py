"""Crash consistency at scale: a writer SIGKILLed at random points, again and again.

The writer is a fresh process from the forkserver of :mod:`tests.distributed` (torch
already imported, never forked from pytest's threads) that, at the same time, replaces a
replica file over and over (``write_checkpoint_file``, alternating two replicas of different
sizes) and commits Checkpointer saves of ever higher steps (``keep=2``, two saves in
flight).  It is killed at a random moment after it has started, and then:

* the replica path holds one of the two replicas exactly, checksum-valid, and loads equal
  to it: never a torn file;
* ``sweep_stale_temps`` removes what the killed write left, and only that;
* a fresh Checkpointer opens the directory (its start-up sweeps temps and uncommitted step
  files), ``latest()`` loads and equals the state saved at that step, every committed step
  does, and nothing but committed steps is left;
* the latest committed step never goes backwards from one kill to the next.

``ASTAGE_SOAK_SCALE`` sizes it: 20 kills by default, 200 with ``ASTAGE_SOAK_SCALE=10``.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import anyio
import torch

import astage
from astage._files.durable import is_temp_name, sweep_stale_temps, write_checkpoint_file
from astage._files.reading import load_checkpoint_file_sync
from astage._format.codec import encode
from tests.distributed import _context
from tests.statedicts import assert_same_tree

KILLS = 20 * int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))
WINDOW = 0.25
"""Kills land uniformly in this many seconds after the writer reports it has started."""


def replica_state(which: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(which)
    weight = torch.randn((1 + which) << 18, generator=gen)  # 1 MiB and 2 MiB
    return {"weight": weight, "row": weight[:16], "which": which}


def checkpoint_state(step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(10_000 + step)
    weight = torch.randn(128 << 10, generator=gen)  # 512 KiB
    return {"model": {"weight": weight, "head": weight[:8]}, "step": torch.tensor(step)}


async def _write_forever(directory: Path, replica: Path, ready: Connection) -> None:
    replicas = [
        encode(replica_state(w), owner_rank=1, holder_rank=0, step=w, checkpoint_id=f"r{w}") for w in (0, 1)
    ]

    async def replace_replica() -> None:
        for i in range(1 << 30):
            await write_checkpoint_file(replica, replicas[i % 2], chunk_nbytes=64 << 10)

    async with (
        astage.Checkpointer(directory, keep=2, max_in_flight=2) as ckpt,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(replace_replica)
        ready.send(ckpt.latest())
        step = (ckpt.latest() or 0) + 1
        while True:
            await ckpt.save(step, checkpoint_state(step))
            step += 1


def crash_writer(directory: str, replica: str, ready: Connection) -> None:
    """The writer process: runs until it is killed."""
    anyio.run(_write_forever, Path(directory), Path(replica), ready)


async def _check_checkpoints(directory: Path) -> tuple[int | None, list[int]]:
    async with astage.Checkpointer(directory, keep=2) as ckpt:
        steps = ckpt.steps()
        for step in steps:
            assert_same_tree(await ckpt.restore(step), checkpoint_state(step))
        return ckpt.latest(), steps


def test_a_writer_killed_at_random_points_leaves_old_or_new_never_torn(tmp_path: Path) -> None:
    directory, replica_dir = tmp_path / "ckpt", tmp_path / "replicas"
    replica = replica_dir / "replica-owner00001-holder00000.astage"
    ctx = _context()
    rng = random.Random(20_240)
    seen: Counter[str] = Counter()
    latest_so_far: int | None = None
    for kill in range(KILLS):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=crash_writer, args=(str(directory), str(replica), writer), daemon=True)
        proc.start()
        writer.close()
        try:
            assert reader.poll(60), "the writer did not start"
            reader.recv()
            time.sleep(rng.uniform(0.0, WINDOW))
        finally:
            proc.kill()
            proc.join(10)
            reader.close()
        assert proc.exitcode == -9, f"kill {kill}: the writer ended on its own ({proc.exitcode})"

        # The replica: one of the two, whole (loading verifies every checksum and the size).
        if replica.exists():
            loaded = load_checkpoint_file_sync(replica)
            which = loaded["which"]
            assert_same_tree(loaded, replica_state(which))
            assert astage.inspect_checkpoint_file(replica).checkpoint_id == f"r{which}"
            seen[f"replica {which}"] += 1
        else:
            seen["no replica yet"] += 1
        stale = [n for n in os.listdir(replica_dir) if is_temp_name(n)] if replica_dir.exists() else []
        seen["replica temp swept"] += bool(stale)
        assert sorted(p.name for p in sweep_stale_temps(replica_dir)) == sorted(stale)
        assert sorted(os.listdir(replica_dir)) == ([replica.name] if replica.exists() else [])

        # The checkpoints: a fresh start sweeps, and every committed step loads.
        leftovers = [p for p in directory.rglob("*") if p.is_file() and is_temp_name(p.name)]
        uncommitted = [
            p for p in directory.glob("step_*/rank00000.astage") if not p.with_suffix(".COMMITTED").exists()
        ]
        seen["checkpoint temp swept"] += bool(leftovers)
        seen["uncommitted step swept"] += bool(uncommitted)
        latest, steps = anyio.run(_check_checkpoints, directory)
        assert not [p for p in directory.rglob("*") if p.is_file() and is_temp_name(p.name)]
        assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()) == sorted(
            [".astage-rank00000.lock"]
            + [f"step_{s:010d}/rank00000.{kind}" for s in steps for kind in ("astage", "COMMITTED")]
        ), f"kill {kill}: more than committed steps left after a fresh start"
        if latest_so_far is not None:
            assert latest is not None
            assert latest >= latest_so_far, f"kill {kill}: the latest step went back to {latest}"
        latest_so_far = latest
        seen["checkpoint committed"] += latest is not None
    print(f"\n{KILLS} kills: {dict(sorted(seen.items()))}; latest step {latest_so_far}")
    # The kills must have landed in the middle of writes, not only between them.
    assert seen["replica temp swept"], seen
    assert seen["checkpoint temp swept"] + seen["uncommitted step swept"], seen
    assert latest_so_far is not None, seen
