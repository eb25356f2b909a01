"""The staging fast path for states with DTensors (every FSDP2 ``get_state_dict``).

A repeated stage of the same structure re-checks the kept plan instead of planning again:
each DTensor is checked around its local tensor (type, grad flag, attributes, spec: mesh by
identity, placements and global shape by value), its local as a plain tensor is.  Any
change there must re-plan, and every staged copy must be a DTensor of the source's spec
holding the source's bytes.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import astage
from astage import DefaultStager, StagingOptions
from astage._format.codec import FileLayout, lay_out
from astage._format.layouts import LayoutCache, PendingLayout
from tests.distributed import run_group
from tests.fsdp2_job import fsdp2_job, train_step
from tests.statedicts import storage_key

pytestmark = [pytest.mark.anyio, pytest.mark.filterwarnings("ignore::UserWarning")]


def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{path}/{key}")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{path}/{i}")
    else:
        yield path, tree


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_staged_as(staged: Any, source: Any) -> None:
    """``staged`` is a faithful copy of ``source``: DTensors of the same spec (the very mesh),
    locals of the same metadata and bytes in storages of their own; the rest equal."""
    got, want = dict(_leaves(staged)), dict(_leaves(source))
    assert list(got) == list(want)
    for path, s in got.items():
        w = want[path]
        assert type(s) is type(w), path
        if isinstance(w, DTensor):
            assert s._spec == w._spec, path
            assert s.device_mesh is w.device_mesh, path
            assert (s.placements, s.shape, s.stride(), s.requires_grad) == (
                w.placements,
                w.shape,
                w.stride(),
                w.requires_grad,
            ), path
            s, w = s._local_tensor, w._local_tensor
        if isinstance(w, torch.Tensor):
            assert (s.dtype, s.shape, s.stride(), s.storage_offset()) == (
                w.dtype,
                w.shape,
                w.stride(),
                w.storage_offset(),
            ), path
            assert _bits(s) == _bits(w), path
            assert storage_key(s) != storage_key(w), path
        else:
            assert s == w, path


def _dtensor_count(tree: Any) -> int:
    return sum(isinstance(v, DTensor) for _, v in _leaves(tree))


@pytest.mark.parametrize("released", [True, False], ids=["released", "held"])
async def test_repeated_stages_of_an_fsdp2_state_take_the_fast_path_and_are_bit_exact(
    one_rank_group: None, released: bool
) -> None:
    model, optim = fsdp2_job()
    train_step(model, optim, 0, 0)
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        state = get_state_dict(model, optim)
        assert _dtensor_count(state) >= 300
        staged, stats = await stager.stage_with_stats(state)
        assert not stats.refilled
        assert_staged_as(staged, state)
        assert stats.planned
        held = []
        for step in range(1, 4):
            if released:
                await stager.release(staged)
            else:
                held.append(
                    (staged, {p: _bits(v.to_local()) for p, v in _leaves(staged) if isinstance(v, DTensor)})
                )
            train_step(model, optim, step, 0)
            state = get_state_dict(model, optim)  # new objects, torch's own habit
            staged, stats = await stager.stage_with_stats(state)
            assert not stats.planned  # the kept plan, re-checked
            assert stats.refilled is released
            assert_staged_as(staged, state)
        for copy, bits in held:  # a copy not released is never written
            assert {p: _bits(v.to_local()) for p, v in _leaves(copy) if isinstance(v, DTensor)} == bits


async def test_a_state_of_thousands_of_dtensors_takes_the_fast_path(one_rank_group: None) -> None:
    # More DTensors than the re-check takes in one block, in dicts of 200 as a model's layers.
    mesh = init_device_mesh("cpu", (1,))
    sd = {
        f"layer{i}": {
            f"p{j}": DTensor.from_local(torch.randn(3 + j % 5), mesh, [Shard(0)]) for j in range(200)
        }
        for i in range(8)
    }
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        for step in range(3):
            await stager.release(staged)
            for layer in sd.values():
                for t in layer.values():
                    t.to_local().add_(step)
            staged, stats = await stager.stage_with_stats(sd)
            assert not stats.planned  # the kept plan, re-checked
            assert stats.refilled
            assert_staged_as(staged, sd)


def _simple_state(mesh: DeviceMesh) -> dict[str, Any]:
    return {
        "model": {f"w{i}": DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)]) for i in range(6)},
        "step": torch.tensor(3.0),
        "plain": torch.randn(5),
    }


def _replace(key: str, make: Callable[[DTensor], Any]) -> Callable[[dict[str, Any]], None]:
    def change(sd: dict[str, Any]) -> None:
        sd["model"][key] = make(sd["model"][key])

    return change


def _other_mesh(dt: DTensor) -> DTensor:
    mesh = DeviceMesh("cpu", [0], mesh_dim_names=("other",))
    return DTensor.from_local(dt._local_tensor, mesh, dt.placements)


def _set_local_to_a_bigger_storage(sd: dict[str, Any]) -> None:
    local = sd["model"]["w1"]._local_tensor  # the same DTensor and local objects, another storage
    local.set_(torch.randn(8, 3).untyped_storage(), 0, (4, 3), (3, 1))


def _spec_changed_in_place(sd: dict[str, Any]) -> None:
    spec = sd["model"]["w2"]._spec
    spec.placements = (Replicate(),)  # the very spec object the plan saw, changed


DTENSOR_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "placements": _replace("w0", lambda d: DTensor.from_local(d._local_tensor, d.device_mesh, [Replicate()])),
    "mesh": _replace("w0", _other_mesh),
    "global shape": _replace(
        "w0",
        lambda d: DTensor.from_local(d._local_tensor, d.device_mesh, [Shard(0)], shape=(8, 3), stride=(3, 1)),
    ),
    "spec changed in place": _spec_changed_in_place,
    "local swapped": _replace(
        "w3", lambda d: DTensor.from_local(d._local_tensor.clone(), d.device_mesh, [Shard(0)])
    ),
    "local set_ to a bigger storage": _set_local_to_a_bigger_storage,
    "local view moved": _replace(
        "w4", lambda d: DTensor.from_local(d._local_tensor.t().contiguous().t(), d.device_mesh, [Shard(0)])
    ),
    "local dtype": _replace(
        "w0", lambda d: DTensor.from_local(d._local_tensor.double(), d.device_mesh, [Shard(0)])
    ),
    "requires_grad": _replace("w5", lambda d: d.detach().requires_grad_(True)),
    "attribute": lambda sd: setattr(sd["model"]["w0"], "note", 1),
    "DTensor to its local": _replace("w0", lambda d: d._local_tensor),
    "plain tensor to DTensor": lambda sd: sd.update(
        plain=DTensor.from_local(sd["plain"], sd["model"]["w0"].device_mesh, [Replicate()])
    ),
    "one DTensor at two places": lambda sd: sd["model"].update(w1=sd["model"]["w0"]),
}


@pytest.mark.parametrize("released", [True, False], ids=["released", "held"])
@pytest.mark.parametrize("name", list(DTENSOR_CHANGES))
async def test_a_changed_dtensor_is_planned_again_and_staged_faithfully(
    one_rank_group: None, name: str, released: bool
) -> None:
    sd = _simple_state(init_device_mesh("cpu", (1,)))
    async with DefaultStager() as stager:
        first = await stager.stage(sd)
        if released:
            await stager.release(first)
        again, stats = await stager.stage_with_stats(sd)  # unchanged: the fast path
        assert not stats.planned
        assert stats.refilled is released
        assert_staged_as(again, sd)
        if released:
            await stager.release(again)
        DTENSOR_CHANGES[name](sd)
        second, stats = await stager.stage_with_stats(sd)
        assert stats.planned
        assert not stats.refilled
        assert_staged_as(second, sd)
        # And the stage after the change re-uses what the change led to.
        await stager.release(second)
        third, stats = await stager.stage_with_stats(sd)
        assert_staged_as(third, sd)
        assert stats.refilled is not stats.planned


async def test_skip_unchanged_copies_every_dtensor_again(one_rank_group: None) -> None:
    # An in-place op on a DTensor writes its local tensor without moving that tensor's
    # version counter (DTensor dispatches below autograd): nothing can vouch that a DTensor's
    # storage is unchanged, so it is copied at every stage; plain tensors beside it are not.
    sd = _simple_state(init_device_mesh("cpu", (1,)))
    for _, t in _leaves(sd):
        (t.to_local() if isinstance(t, DTensor) else t).add_(0)  # a counter at 0 is never trusted
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        sd["model"]["w2"].to_local().add_(1)  # through a view of the local
        with torch.no_grad():
            sd["model"]["w4"].mul_(2)  # through the DTensor: the local's counter stays
        again, stats = await stager.stage_with_stats(sd)
        assert again is staged
        assert stats.refilled
        assert stats.tensors_skipped == 2  # "step" and "plain"
        assert_staged_as(again, sd)
        await stager.release(again)
        with torch.no_grad():
            sd["model"]["w0"].add_(1)
        again["model"]["w5"].zero_()  # a holder writing into the released copy, through a DTensor
        await stager.release(again)
        again, stats = await stager.stage_with_stats(sd)
        assert stats.refilled
        assert_staged_as(again, sd)


SOAK = int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))


def _random_change(sd: dict[str, Any], rng: random.Random, meshes: list[DeviceMesh]) -> str:
    """One seeded random change to a DTensor of ``sd["model"]`` (or a plain one there), of
    the kinds a job or an adversary makes between two stages; its name."""
    key = rng.choice(list(sd["model"]))
    t = sd["model"][key]
    if not isinstance(t, DTensor):
        sd["model"][key] = DTensor.from_local(t, rng.choice(meshes), [Shard(0)])
        return "to DTensor"
    local, mesh, placements = t._local_tensor, t.device_mesh, t.placements
    kind = rng.choice(
        ["write", "write local", "placements", "mesh", "clone", "set_", "grad", "to plain", "same spec anew"]
    )
    if kind == "write":
        with torch.no_grad():
            t.add_(1.0)
    elif kind == "write local":
        local.mul_(-1.0)
    elif kind == "placements":
        other = [Replicate()] if isinstance(placements[0], Shard) else [Shard(0)]
        sd["model"][key] = DTensor.from_local(local, mesh, other)
    elif kind == "mesh":
        sd["model"][key] = DTensor.from_local(local, meshes[1 - meshes.index(mesh)], placements)
    elif kind == "clone":
        sd["model"][key] = DTensor.from_local(local.clone(), mesh, placements)
    elif kind == "set_":
        local.set_(torch.randn(local.numel() * 2).untyped_storage(), 0, local.shape, local.stride())
    elif kind == "grad":
        sd["model"][key] = t.detach().requires_grad_(not t.requires_grad)
    elif kind == "to plain":
        sd["model"][key] = local
    else:  # a new DTensor object over the same local: still the fast path
        sd["model"][key] = DTensor.from_local(local, mesh, placements)
    return kind


@pytest.mark.parametrize("seed", range(3))
async def test_random_dtensor_changes_between_stages_are_staged_bit_exact(
    one_rank_group: None, seed: int
) -> None:
    rng = random.Random(seed)
    meshes = [init_device_mesh("cpu", (1,)), DeviceMesh("cpu", [0], mesh_dim_names=("other",))]
    sd = _simple_state(meshes[0])
    held: list[tuple[Any, dict[str, Any]]] = []
    options = StagingOptions(skip_unchanged=rng.random() < 0.5)
    async with DefaultStager(options) as stager:
        for _ in range(20 * SOAK):
            for _ in range(rng.randrange(3)):
                _random_change(sd, rng, meshes)
            staged = await stager.stage(sd)
            assert_staged_as(staged, sd)
            if rng.random() < 0.7:
                await stager.release(staged)
            else:
                held.append(
                    (
                        staged,
                        {
                            p: _bits(v.to_local() if isinstance(v, DTensor) else v)
                            for p, v in _leaves(staged)
                            if isinstance(v, torch.Tensor)
                        },
                    )
                )
        for copy, bits in held:  # a copy not released is never written
            assert {
                p: _bits(v.to_local() if isinstance(v, DTensor) else v)
                for p, v in _leaves(copy)
                if isinstance(v, torch.Tensor)
            } == bits


ID = "0" * 32


@pytest.mark.parametrize("name", ["unchanged", "step", *DTENSOR_CHANGES])
async def test_the_checkpointer_layout_of_a_dtensor_state_is_reused_only_when_a_full_lay_out_agrees(
    one_rank_group: None, name: str
) -> None:
    staged = _simple_state(init_device_mesh("cpu", (1,)))
    cache = LayoutCache(rank=0)
    first = await cache.lay_out(staged, step=1, checkpoint_id=ID)
    assert isinstance(first, FileLayout)
    await cache.keep(staged, first)
    if name == "step":
        staged["step"] = torch.tensor(4.0)  # a new tensor object, the same metadata
        staged["model"]["w0"].to_local().fill_(2.0)
    elif name != "unchanged":
        DTENSOR_CHANGES[name](staged)
    try:
        want = lay_out(staged, owner_rank=0, step=2, checkpoint_id=ID)
    except astage.UnsupportedInputError as exc:
        with pytest.raises(astage.UnsupportedInputError, match=re.escape(str(exc))):
            await cache.lay_out(staged, step=2, checkpoint_id=ID)
        return
    layout = await cache.lay_out(staged, step=2, checkpoint_id=ID)
    if name in ("unchanged",):
        assert isinstance(layout, PendingLayout), "the same structure re-uses the kept layout"
        layout = await layout.complete()
    elif name not in ("step",):
        assert isinstance(layout, FileLayout), "a changed DTensor must not re-use the kept layout"
    if isinstance(layout, PendingLayout):
        layout = await layout.complete()
    assert layout is not None
    assert layout.structure_json == want.structure_json
    assert layout.scalars == want.scalars
    assert [s._cdata for s in layout.storages] == [s._cdata for s in want.storages]
    assert layout.offsets == want.offsets


async def test_repeated_saves_of_a_dtensor_state_restore_bit_exact(
    one_rank_group: None, tmp_path: Path
) -> None:
    sd = _simple_state(init_device_mesh("cpu", (1,)))
    async with astage.Checkpointer(tmp_path, rank=0) as ckpt:
        for step in range(1, 4):
            for t in sd["model"].values():
                t.to_local().add_(step)
            await ckpt.save(step, sd)
            await ckpt.wait()
        mesh = sd["model"]["w0"].device_mesh
        sd["model"]["w0"] = DTensor.from_local(sd["model"]["w0"].to_local(), mesh, [Replicate()])
        await ckpt.save(4, sd)
        await ckpt.wait()
    async with astage.Checkpointer(tmp_path, rank=0) as fresh:
        restored = await fresh.restore(4)
    for key, value in sd["model"].items():
        assert _bits(restored["model"][key]) == _bits(value.to_local())


async def _fsdp2_fast_stages(rank: int, world: int) -> int:
    """Stage a two-rank FSDP2 job's state after each of three steps: every repeated stage a
    refill of the released copy, bit for bit the rank's state."""
    model, optim = fsdp2_job()
    refills = 0
    async with DefaultStager() as stager:
        for step in range(4):
            train_step(model, optim, step, rank)
            state = get_state_dict(model, optim)
            staged, stats = await stager.stage_with_stats(state)
            assert_staged_as(staged, state)
            refills += stats.refilled
            await stager.release(staged)
    return refills


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_two_ranks_of_an_fsdp2_job_refill_their_copies_at_every_repeated_stage(backend: str) -> None:
    assert [r.unwrap() for r in run_group(2, _fsdp2_fast_stages, timeout=120, backend=backend)] == [3, 3]
