"""Property: whatever changes between two stages, a staged copy is bit for bit the state_dict
as it was when it was staged, and so are its replica on a peer and its checkpoint restored.

The seeded random driver of :mod:`tests.mutations` makes long sequences of the changes a
training job (or an adversary) makes between stages: values, metadata, aliasing, storages
freed and re-allocated, structure, scalars, inference tensors.  After each change set, the
state_dict is snapshotted (``torch.clone`` of every storage, :mod:`tests.snapshots`) and
staged; the copy must match the snapshot, and every copy still held must still match its
own.  Copies are released, dropped, or held for a while, with and without
``skip_unchanged``, with and without a memory cap; a shorter sequence goes through
``Checkpointer.save()`` and ``restore()`` in a real directory.

Replication runs in a real 2-rank gloo group (:mod:`tests.distributed`): each rank drives
its own sequence through ``ReplicationStager.replicate()``, and the replica it holds of its
peer (read back from the file, and as ``result.replica``) must match the snapshot the peer
took, sent over the group as a digest (:func:`tests.snapshots.digest`).  Then
``Checkpointer(replication=ReplicationStager(...)).save()`` of a shorter sequence, one rank's
directory lost, and a collective ``restore()`` that must give each rank its snapshot back.

The length comes from ``ASTAGE_SOAK_SCALE`` (default 1: a few seconds).  A failure names
its seed and step; ``ASTAGE_REUSE_SEED`` runs one seed again.
"""

from __future__ import annotations

import gc
import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist

import astage
from astage import DefaultStager, StagingOptions
from tests.distributed import run_group
from tests.mutations import CAP, World
from tests.snapshots import Digest, Snapshot, assert_matches, assert_matches_digest, digest, take
from tests.statedicts import Point, tensors_of

pytestmark = pytest.mark.anyio

SCALE = int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))
STAGES = 40 * SCALE
SAVES = 8 * SCALE
SEEDS = [int(os.environ["ASTAGE_REUSE_SEED"])] if "ASTAGE_REUSE_SEED" in os.environ else [1, 2]

GUARD_SECONDS = 60
"""A stage that waits for room nothing frees fails after this instead of hanging."""

RANKS = 2
REPLICATIONS = 10 * SCALE
"""Rounds of ``replicate()`` per case on each rank."""
REPLICATED_SAVES = 5 * SCALE
KEEP = 2
EXCHANGE_SECONDS = 30.0
"""A ``ReplicationStager``'s timeout: a rank that fails an assertion leaves its peer
waiting at most this long in the next exchange."""
GROUP_SECONDS = 120.0 * SCALE
"""The whole group's run (and its process group's timeout)."""
REPLICATION_CASES = (  # skip_unchanged, capped, keep
    (False, False, None),
    (True, False, KEEP),
    (False, True, KEEP),
    (True, True, None),
)


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


# -- replication: a real 2-rank gloo group -------------------------------------------------


async def gather(item: Any) -> list[Any]:
    """``item`` of every rank (plain data, pickled by torch), in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    await anyio.to_thread.run_sync(dist.all_gather_object, out, item)
    return out


async def replicate_rounds(rank: int, world_size: int, root: str, seed: int) -> list[int]:
    """Each case: a random sequence replicated round by round; after each round the replica
    this rank holds (its file, and ``result.replica``) is the peer's snapshot of that round,
    replicas held a while still are theirs, and ``recover()`` gives this rank its last state.

    :returns: the bytes ``skip_unchanged`` skipped, per case.
    """
    skipped: list[int] = []
    for case, (skip, capped, keep) in enumerate(REPLICATION_CASES):
        world = World(1000 * seed + 10 * case + rank)
        rng = world.rng
        held: list[tuple[Any, Digest, int]] = []  # replicas kept a while: their buffers are not reused
        kept_copies: list[tuple[Any, Snapshot, int]] = []  # own copies neither released nor dropped
        case_skipped = 0
        snap: Snapshot | None = None
        storage = Path(root) / f"rank{rank}" / f"case{case}"
        options = StagingOptions(skip_unchanged=skip, max_staging_bytes=CAP if capped else None)
        about = f"seed {seed} rank {rank} (skip_unchanged={skip}, capped={capped}, keep={keep})"
        async with astage.ReplicationStager(
            storage_dir=storage, timeout=EXCHANGE_SECONDS, options=options, keep=keep
        ) as rs:
            for step in range(REPLICATIONS):
                world.step()
                snap = take(world.sd)
                where = f"{about} step {step}"
                with anyio.fail_after(GUARD_SECONDS):
                    result = await rs.replicate(world.sd, step=step)
                # Before any check, so that a rank that fails one leaves no peer waiting here.
                want = (await gather(digest(snap)))[result.recv_from]
                assert_matches(result.staged, snap, f"{where}: own copy")
                assert result.stats.stage is not None
                case_skipped += result.stats.stage.bytes_skipped
                peer = f"{where}: the replica of rank {result.recv_from}"
                assert_matches_digest(
                    await astage.load_checkpoint_file(result.replica_path), want, f"{peer} (file)"
                )
                assert_matches_digest(result.replica, want, peer)
                for replica, its_digest, its_step in held:
                    assert_matches_digest(
                        replica, its_digest, f"{where}: the replica of step {its_step}, held"
                    )
                for copy, its_snap, its_step in kept_copies:
                    assert_matches(copy, its_snap, f"{where}: the copy of step {its_step}, kept")
                fate = rng.random()
                if fate < 0.7:
                    await rs.stager.release(result.staged)
                elif fate > 0.85 and not capped and len(kept_copies) < 2:
                    kept_copies.append((result.staged, snap, step))
                # else dropped with the result
                if kept_copies and rng.random() < 0.3:
                    copy, _, _ = kept_copies.pop(0)
                    await rs.stager.release(copy)
                    del copy
                if rng.random() < 0.2 and len(held) < 3:
                    held.append((result.replica, want, step))
                if held and rng.random() < 0.3:
                    held.pop(rng.randrange(len(held)))
                del result
            with anyio.fail_after(GUARD_SECONDS):
                back = await rs.recover()
            assert snap is not None
            assert_matches(back, snap, f"{about}: recovered from the peer")
        kept = sorted(info.step for info in await anyio.to_thread.run_sync(astage.find_replicas, storage))
        assert kept == list(range(REPLICATIONS))[-(keep or 1) :], f"{about}: replica files of steps {kept}"
        skipped.append(case_skipped)
    return skipped


async def save_and_restore(rank: int, world_size: int, root: str, seed: int) -> int:
    """A random sequence saved by a Checkpointer that replicates; the peer's replica files
    are its snapshots; then one rank loses its directory and a collective ``restore()``
    gives every rank its snapshot of the latest step, and ``restore(step)`` an earlier one.

    :returns: the bytes ``skip_unchanged`` skipped.
    """
    skip = bool(seed % 2)
    lost = seed % world_size  # the rank whose checkpoint directory is lost before restoring
    world = World(1000 * seed + 500 + rank)
    node = Path(root) / f"node{rank}"
    about = f"seed {seed} rank {rank} (skip_unchanged={skip})"
    snaps: dict[int, Snapshot] = {}
    handles: list[astage.SaveHandle] = []
    stager = DefaultStager(StagingOptions(skip_unchanged=skip, max_staging_bytes=2 * CAP))
    rs = astage.ReplicationStager(storage_dir=node / "replicas", timeout=EXCHANGE_SECONDS, keep=KEEP)
    async with (
        rs,
        astage.Checkpointer(node / "ckpt", rank=rank, keep=KEEP, stager=stager, replication=rs) as ckpt,
    ):
        for step in range(REPLICATED_SAVES):
            world.step()
            snaps[step] = take(world.sd)
            with anyio.fail_after(GUARD_SECONDS):
                handles.append(await ckpt.save(step, world.sd))
        with anyio.fail_after(GUARD_SECONDS):
            saved = [await handle.wait() for handle in handles]
    await stager.aclose()
    skipped = sum(stats.stage.bytes_skipped for stats in saved if stats.stage is not None)
    kept = list(range(REPLICATED_SAVES))[-KEEP:]
    peers = await gather({step: digest(snaps[step]) for step in kept})
    held = await anyio.to_thread.run_sync(rs.held_replicas)
    assert sorted(held) == kept, f"{about}: replicas of steps {sorted(held)}"
    for step, path in held.items():
        want = peers[rs.recv_from][step]
        assert_matches_digest(
            await astage.load_checkpoint_file(path), want, f"{about}: replica of step {step}"
        )

    if rank == lost:  # its node replaced: only its replica directory is left
        await anyio.to_thread.run_sync(shutil.rmtree, node / "ckpt")
    rs = astage.ReplicationStager(storage_dir=node / "replicas", timeout=EXCHANGE_SECONDS, keep=KEEP)
    async with rs, astage.Checkpointer(node / "ckpt", rank=rank, keep=KEEP, replication=rs) as ckpt:
        with anyio.fail_after(GUARD_SECONDS):
            restored = await ckpt.restore()
        assert_matches(restored, snaps[kept[-1]], f"{about}: restored (lost rank {lost})")
        del restored
        with anyio.fail_after(GUARD_SECONDS):
            restored = await ckpt.restore(kept[0])
        assert_matches(restored, snaps[kept[0]], f"{about}: restored step {kept[0]} (lost rank {lost})")
    return skipped


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_every_replica_is_the_peer_state_dict_as_it_was(tmp_path: Path, backend: str) -> None:
    seed = SEEDS[0]
    results = run_group(RANKS, replicate_rounds, str(tmp_path), seed, timeout=GROUP_SECONDS, backend=backend)
    skipped = [r.unwrap() for r in results]
    for case, (skip, _, _) in enumerate(REPLICATION_CASES):
        if skip:
            assert all(s[case] for s in skipped), "no replicate() skipped anything: skip_unchanged untested"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("seed", [2 * SEEDS[0], 2 * SEEDS[0] + 1], ids=["full-lose-rank0", "skip-lose-rank1"])
def test_every_replicated_save_restores_as_the_state_dict_was(
    tmp_path: Path, backend: str, seed: int
) -> None:
    results = run_group(RANKS, save_and_restore, str(tmp_path), seed, timeout=GROUP_SECONDS, backend=backend)
    skipped = [r.unwrap() for r in results]
    if seed % 2:
        assert all(skipped), "no save skipped anything: skip_unchanged untested"
