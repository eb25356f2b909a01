"""A real FSDP2 job (``fully_shard``, AdamW, ``get_state_dict``/``set_state_dict``) on two gloo
ranks, checkpointed by the Checkpointer with peer replication, restored in fresh processes.

The state of each rank is what every FSDP2 user saves: about 300 DTensors (parameters and
AdamW moments sharded on dim 0) and plain step tensors.  The restored job must see the saved
shards bit for bit and train on with the very losses the uninterrupted job had.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import astage
from tests.distributed import run_group
from tests.fsdp2_job import fsdp2_job, train_step

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SAVE_EVERY = 5
STEPS = 10  # saves at 5 and 10
MORE = 3  # steps trained on after the last save, by the job and by its restored copy


def _checkpointer(root: Path, rank: int) -> astage.Checkpointer:
    replication = astage.ReplicationStager(storage_dir=root / f"replicas{rank}", timeout=60.0)
    return astage.Checkpointer(root / f"rank{rank}", rank=rank, replication=replication, keep=2)


def _snapshot(state: Any) -> dict[str, Any]:
    """The state's leaves by key path, tensors as (dtype, shape, stride, bytes), DTensors as
    their local shards (restore gives those back as plain tensors).  Plain data: a tensor
    sent to the parent would travel through shared memory that dies with the rank."""
    flat: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}/{key}")
        elif isinstance(node, torch.Tensor):
            local = node.to_local() if isinstance(node, DTensor) else node
            data = local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            flat[path] = ("tensor", str(local.dtype), tuple(local.shape), local.stride(), data)
        else:
            flat[path] = node

    walk(state, "")
    return flat


def _count_dtensors(state: Any) -> int:
    if isinstance(state, dict):
        return sum(_count_dtensors(v) for v in state.values())
    return int(isinstance(state, DTensor))


async def _train_and_save(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    model, optim = fsdp2_job()
    async with _checkpointer(root, rank) as ckpt:
        for step in range(1, STEPS + 1):
            train_step(model, optim, step, rank)
            if step % SAVE_EVERY == 0:
                model_sd, optim_sd = get_state_dict(model, optim)
                state = {"model": model_sd, "optim": optim_sd, "step": step}
                saved = _snapshot(state)
                dtensors = _count_dtensors(state)
                handle = await ckpt.save(step, state)
                await handle.wait()
        assert ckpt.steps() == [SAVE_EVERY, STEPS]
    losses = [train_step(model, optim, step, rank) for step in range(STEPS + 1, STEPS + MORE + 1)]
    return {"saved": saved, "losses": losses, "dtensors": dtensors}


async def _restore_and_train(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    model, optim = fsdp2_job()
    model_sd, optim_sd = get_state_dict(model, optim)
    async with _checkpointer(root, rank) as ckpt:
        restored = await ckpt.restore()
    assert restored["step"] == STEPS
    # Loaded into the live sharded state_dict as DCP users do: local shards copied in place.
    _copy_into(model_sd, restored["model"])
    _copy_into(optim_sd, restored["optim"])
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
    model_sd, optim_sd = get_state_dict(model, optim)  # what the job trains on from here
    seen = _snapshot({"model": model_sd, "optim": optim_sd, "step": restored["step"]})
    losses = [train_step(model, optim, step, rank) for step in range(STEPS + 1, STEPS + MORE + 1)]
    return {"seen": seen, "restored": _snapshot(restored), "losses": losses}


def _copy_into(target: Any, source: Any) -> None:
    for key, value in source.items():
        if isinstance(value, dict):
            _copy_into(target[key], value)
        elif isinstance(target[key], DTensor):  # restored as its local shard
            target[key].to_local().copy_(value)
        elif isinstance(value, torch.Tensor):
            target[key].copy_(value)
        else:
            target[key] = value


def _assert_same(expected: dict[str, Any], actual: dict[str, Any]) -> None:
    assert expected.keys() == actual.keys()
    for path, want in expected.items():
        assert want == actual[path], path


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_fsdp2_job_saved_by_checkpointer_restores_bit_exact_and_trains_on(
    tmp_path: Path, backend: str
) -> None:
    saved = [r.unwrap() for r in run_group(2, _train_and_save, tmp_path, timeout=180.0, backend=backend)]
    for result in saved:
        assert result["dtensors"] >= 300  # the family that broke: hundreds of DTensor notes
    back = [r.unwrap() for r in run_group(2, _restore_and_train, tmp_path, timeout=180.0, backend=backend)]
    for before, after in zip(saved, back, strict=True):
        _assert_same(before["saved"], after["restored"])
        _assert_same(before["saved"], after["seen"])
        assert after["losses"] == before["losses"]


async def _lose_rank_and_restore(rank: int, world_size: int, root: Path) -> dict[str, Any]:
    if rank == 1:  # rank 1's node is gone: its own directory is empty
        await anyio.to_thread.run_sync(_remove_tree, root / "rank1")
    return await _restore_and_train(rank, world_size, root)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


def test_fsdp2_rank_that_lost_its_disk_gets_its_shards_from_the_peer(tmp_path: Path) -> None:
    saved = [r.unwrap() for r in run_group(2, _train_and_save, tmp_path, timeout=180.0)]
    back = [r.unwrap() for r in run_group(2, _lose_rank_and_restore, tmp_path, timeout=180.0)]
    for before, after in zip(saved, back, strict=True):
        _assert_same(before["saved"], after["restored"])
        assert after["losses"] == before["losses"]
