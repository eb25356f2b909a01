"""The collective restore with a remote tier: a job whose every node lost its disk (new
machines) restores collectively from the store alone; a job that lost one node gets it back
from the store or its peer, and the store's newest step wins only where it is newest."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch.distributed as dist

import astage
from tests.checkpointer.test_collective_restore import TIMEOUT, check, node, state_of
from tests.distributed import run_group

pytestmark = pytest.mark.anyio


def job(root: str, rank: int, store: str) -> tuple[astage.ReplicationStager, astage.Checkpointer]:
    rs = astage.ReplicationStager(storage_dir=node(root, rank) / "replicas", timeout=TIMEOUT, keep=2)
    remote = astage.Remote(store, every=2)
    ckpt = astage.Checkpointer(node(root, rank) / "ckpt", rank=rank, keep=2, replication=rs, remote=remote)
    return rs, ckpt


async def barrier() -> None:
    await anyio.to_thread.run_sync(dist.barrier)


async def target(rank: int, world: int, root: str, store: str) -> dict[str, Any]:
    rs, ckpt = job(root, rank, store)
    async with rs, ckpt:
        handles = [await ckpt.save(step, state_of(rank, step)) for step in (1, 2, 3)]
        uploaded = [await h.uploaded() is not None for h in handles]
    await barrier()
    # Every node is new: empty disks, the store alone holds steps 1 and 3.
    shutil.rmtree(node(root, rank))
    await barrier()
    rs, ckpt = job(root, rank, store)
    async with rs, ckpt:
        got = await ckpt.restore()
        fresh = {"ok": check(got, rank, 3), "steps": ckpt.steps()}
        older = check(await ckpt.restore(step=1), rank, 1)
    await barrier()
    # Rank 1 loses its disk again; rank 0 keeps steps 1 and 3: the job agrees on 3, rank 1
    # heals it from the store (its peer's replica went with its node too).
    if rank == 1:
        shutil.rmtree(node(root, rank))
    await barrier()
    rs, ckpt = job(root, rank, store)
    async with rs, ckpt:
        again = check(await ckpt.restore(), rank, 3)
    return {"uploaded": uploaded, "fresh": fresh, "older": older, "again": again}


async def test_a_job_on_new_machines_restores_collectively_from_the_store(tmp_path: Path) -> None:
    store = (tmp_path / "store").as_uri()
    results = await anyio.to_thread.run_sync(
        lambda: run_group(2, target, str(tmp_path / "nodes"), store, timeout=120)
    )
    for result in results:
        value = result.unwrap()
        assert value["uploaded"] == [True, False, True]
        assert value["fresh"] == {"ok": True, "steps": [3]}
        assert value["older"] is True
        assert value["again"] is True
