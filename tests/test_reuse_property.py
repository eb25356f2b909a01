"""Property: whatever changes between two stages, a staged copy is bit for bit the state_dict
as it was when it was staged.

The seeded random driver of :mod:`tests.mutations` makes long sequences of the changes a
training job (or an adversary) makes between stages: values, metadata, aliasing, storages
freed and re-allocated, structure, scalars, inference tensors.  After each change set, the
state_dict is snapshotted (``torch.clone`` of every storage, :mod:`tests.snapshots`) and
staged; the copy must match the snapshot, and every copy still held must still match its
own.  Copies are released, dropped, or held for a while, with and without
``skip_unchanged``, with and without a memory cap; a shorter sequence goes through
``Checkpointer.save()`` and ``restore()`` in a real directory.

The length comes from ``ASTAGE_SOAK_SCALE`` (default 1: a few seconds).  A failure names
its seed and step; ``ASTAGE_REUSE_SEED`` runs one seed again.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import astage
from astage import DefaultStager, StagingOptions
from tests.mutations import CAP, World
from tests.snapshots import Snapshot, assert_matches, take
from tests.statedicts import Point, tensors_of

pytestmark = pytest.mark.anyio

SCALE = int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))
STAGES = 40 * SCALE
SAVES = 8 * SCALE
SEEDS = [int(os.environ["ASTAGE_REUSE_SEED"])] if "ASTAGE_REUSE_SEED" in os.environ else [1, 2]

GUARD_SECONDS = 60
"""A stage that waits for room nothing frees fails after this instead of hanging."""


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("capped", [False, True], ids=["uncapped", "capped"])
@pytest.mark.parametrize("skip", [False, True], ids=["full", "skip_unchanged"])
async def test_every_stage_is_the_state_dict_as_it_was(seed: int, skip: bool, capped: bool) -> None:
    """Copies are released (the variable naming them kept until the next stage, as in every
    ``staged = await stager.stage(sd)`` loop), dropped, or (uncapped) held a while."""
    world = World(seed)
    rng = world.rng
    held: list[tuple[Any, Snapshot, int]] = []
    skipped = 0
    staged: Any = None
    options = StagingOptions(skip_unchanged=skip, max_staging_bytes=CAP if capped else None)
    async with DefaultStager(options) as stager:
        for step in range(STAGES):
            world.step()
            snap = take(world.sd)
            where = f"seed {seed} step {step} (skip_unchanged={skip}, capped={capped})"
            with anyio.fail_after(GUARD_SECONDS):
                staged, stats = await stager.stage_with_stats(world.sd)
            assert_matches(staged, snap, where)
            skipped += stats.bytes_skipped
            for copy, its_snap, its_step in held:  # a copy not released is never written
                assert_matches(copy, its_snap, f"{where}: the copy of step {its_step}")
            fate = rng.random()
            if fate < 0.7:
                await stager.release(staged)
            elif fate < 0.85 or capped or held:
                staged = None  # dropped: its buffers come back once nothing references it
            else:
                held.append((staged, snap, step))
                staged = None
            if held and rng.random() < 0.3:
                copy, _, _ = held.pop()
                if rng.random() < 0.5:
                    await stager.release(copy)
                del copy
    if skip:
        assert skipped, "no stage skipped anything: the sequence did not test skip_unchanged"


@pytest.mark.parametrize("skip", [False, True], ids=["full", "skip"])
async def test_every_save_restores_as_the_state_dict_was(tmp_path: Path, skip: bool) -> None:
    world = World(7 + skip)
    snaps: dict[int, Snapshot] = {}
    stager = DefaultStager(StagingOptions(skip_unchanged=skip, max_staging_bytes=2 * CAP))
    async with astage.Checkpointer(tmp_path / "ckpt", stager=stager, keep=None) as ckpt:
        for step in range(SAVES):
            world.step()
            snaps[step] = take(world.sd)
            with anyio.fail_after(GUARD_SECONDS):
                await ckpt.save(step, world.sd)
        await ckpt.wait()
    async with astage.Checkpointer(tmp_path / "ckpt", keep=None) as fresh:
        for step, snap in snaps.items():
            assert_matches(await fresh.restore(step), snap, f"restored step {step}")
    await stager.aclose()


def test_walking_a_tree_keeps_nothing_alive() -> None:
    """The oracle's and the driver's walks leave no reference cycle: a tensor they listed is
    freed as soon as the caller drops it, not when the cyclic collector runs (until then,
    under a memory cap, a dropped copy's buffers cannot come back and the next stage waits)."""
    world = World(0)
    gc.disable()
    try:
        tensor = torch.ones(3)
        tree = {"a": [tensor, (tensor.view(3, 1),)], "b": Point(tensor, "p")}
        alive = weakref.ref(tensor)
        found, slots, snap = tensors_of(tree), world.slots(), take(tree)
        assert len(found) == 3
        assert slots
        assert len(snap.metas) == 3
        del found, slots, snap, tree, tensor
        assert alive() is None, "the walk's result outlived its last reference"
    finally:
        gc.enable()
