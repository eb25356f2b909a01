"""Collective restore over real gloo groups, each rank on its own "node" directory.

Every scenario restarts the job the way a real one restarts without re-creating its process
group: each rank closes its Checkpointer and ReplicationStager, the lost node's whole
directory is removed, and every rank opens new ones and calls ``restore()``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import astage
from astage import IntegrityError, PeerTimeoutError, ResourceError, TransportError
from astage._checkpointer import collective_restore as _restore
from astage._checkpointer.collective_restore import Inventory, plan_restore
from tests.distributed import holder_of, lose, node, run_group, stop_self
from tests.statedicts import same_state, state_of, storage_key

TIMEOUT = 3.0


def check(got: Any, rank: int, step: int) -> bool:
    return same_state(got, state_of(rank, step)) and storage_key(got["model"]["w"]) == storage_key(
        got["model"]["w_t"]
    )


class Job:
    """One rank's Checkpointer and ReplicationStager on its own node directory."""

    def __init__(self, root: str, rank: int, keep: int = 2, k: int | None = None) -> None:
        self.rs = astage.ReplicationStager(
            storage_dir=node(root, rank) / "replicas", timeout=TIMEOUT, keep=keep, peer_offset=k
        )
        self.ckpt = astage.Checkpointer(node(root, rank) / "ckpt", rank=rank, keep=keep, replication=self.rs)

    async def __aenter__(self) -> astage.Checkpointer:
        await self.rs.__aenter__()
        return await self.ckpt.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.ckpt.__aexit__(*exc)
        finally:
            await self.rs.aclose()


async def save(ckpt: astage.Checkpointer, rank: int, *steps: int) -> None:
    for step in steps:
        await ckpt.save(step, state_of(rank, step))
    await ckpt.wait()


async def lose_and_heal_target(rank: int, world: int, root: str, lost: int, k: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    job = Job(root, rank, k=k)
    async with job as ckpt:
        await save(ckpt, rank, 0, 1, 2)
    # The holder keeps the steps the owner keeps (keep=2), by step (the older ones are
    # deleted off the critical path: at the next save, or on closing).
    out["held"] = sorted(job.rs.held_replicas())
    await lose(root, rank, lost)
    async with Job(root, rank, k=k) as ckpt:
        out["steps_before"] = ckpt.steps()
        try:
            await ckpt.restore(7)  # never saved: the same error everywhere, the group intact
        except ResourceError as exc:
            out["missing_step"] = str(exc)
        out["restored_1"] = check(await ckpt.restore(1), rank, 1)
        out["restored"] = check(await ckpt.restore(), rank, 2)
        out["steps_after"] = ckpt.steps()
        await save(ckpt, rank, 3)  # the same objects save again after the restore
    # The replaced rank is whole again: now its holder can be lost, and restore still works.
    await lose(root, rank, holder_of(lost, world, k))
    async with Job(root, rank, k=k) as ckpt:
        out["restored_again"] = check(await ckpt.restore(), rank, 3)
        out["steps_final"] = ckpt.steps()
    return out


@pytest.mark.parametrize(
    ("world", "lost", "k", "backend"),
    [
        (2, 1, None, "asyncio"),
        (2, 0, None, "trio"),
        (3, 0, None, "asyncio"),
        (4, 2, None, "asyncio"),
        (4, 3, 1, "trio"),
    ],
)
def test_a_lost_node_is_restored_bit_exact_healed_and_survives_a_second_loss(
    tmp_path: Path, world: int, lost: int, k: int | None, backend: str
) -> None:
    results = [
        r.unwrap()
        for r in run_group(world, lose_and_heal_target, str(tmp_path), lost, k, timeout=60, backend=backend)
    ]
    assert len({v["missing_step"] for v in results}) == 1
    assert "cannot restore step 7" in results[0]["missing_step"]
    for rank, value in enumerate(results):
        assert value["held"] == [1, 2], rank
        assert value["steps_before"] == ([] if rank == lost else [1, 2]), (rank, value)
        assert value["restored_1"], rank
        assert value["restored"], rank
        assert value["steps_after"] == [1, 2], rank  # the lost rank committed both again (healed)
        assert value["restored_again"], rank
        assert 3 in value["steps_final"], rank


async def both_lost_target(rank: int, world: int, root: str, lost: list[int]) -> dict[str, Any]:
    async with Job(root, rank) as ckpt:
        await save(ckpt, rank, 1, 2)
    await lose(root, rank, *lost)
    async with Job(root, rank) as ckpt:
        started = time.monotonic()
        try:
            await ckpt.restore()
        except astage.AstageError as exc:
            return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - started}
        return {"error": None}


def test_a_rank_lost_with_its_holder_is_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    lost = [1, holder_of(1, 3)]
    results = [r.unwrap() for r in run_group(3, both_lost_target, str(tmp_path), lost, timeout=60)]
    for value in results:
        assert value["error"] == "ResourceError", value
        assert "rank 1 (no valid checkpoint of its own, and its holder rank 2" in value["message"]
        assert "steps considered: [1, 2]" in value["message"]
        assert value["elapsed"] < TIMEOUT
    assert len({v["message"] for v in results}) == 1  # every rank says the same


async def stopped_target(rank: int, world: int, root: str) -> dict[str, Any]:
    async with Job(root, rank) as ckpt:
        await save(ckpt, rank, 1)
    await lose(root, rank, 0)
    async with Job(root, rank) as ckpt:
        if rank == world - 1:
            stop_self()
        started = time.monotonic()
        try:
            await ckpt.restore()
        except TransportError as exc:
            return {"error": type(exc).__name__, "elapsed": time.monotonic() - started}
        return {"error": None}


@pytest.mark.parametrize("world", [2, 3])
def test_a_stopped_peer_during_restore_is_a_timeout_within_the_timeout(tmp_path: Path, world: int) -> None:
    results = run_group(world, stopped_target, str(tmp_path), timeout=60)
    assert results[-1].stopped
    survivors = [r.unwrap() for r in results[:-1]]
    for value in survivors:
        assert value["error"] in {"PeerTimeoutError", "TransportError"}, value
        assert value["elapsed"] < TIMEOUT + 1.0, value
    assert any(v["error"] == "PeerTimeoutError" for v in survivors)
    if world == 2:
        assert survivors[0]["error"] == "PeerTimeoutError"


def corrupt_held_replica(root: str, holder: int, owner: int, step: int) -> None:
    (path,) = (node(root, holder) / "replicas").glob(f"replica-owner{owner:05d}-*-step{step:010d}.astage")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # the body's last byte: the header still parses, a checksum fails
    path.write_bytes(bytes(data))


async def corrupt_target(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with Job(root, rank) as ckpt:
        await save(ckpt, rank, 1, 2)
    await lose(root, rank)
    if rank == 1:  # a corrupt local file: its holder's replica replaces it
        path = node(root, 1) / "ckpt" / "step_0000000002" / "rank00001.astage"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        path.write_bytes(bytes(data))
    async with Job(root, rank) as ckpt:
        out["from_holder"] = check(await ckpt.restore(), rank, 2)
        out["healed"] = check(await ckpt.restore(2, collective=False), rank, 2)  # local, verified
    await lose(root, rank, 1)
    if rank == 0:
        corrupt_held_replica(root, 0, 1, 2)
    async with Job(root, rank) as ckpt:
        # Step 2 of rank 1 exists only as a corrupt replica: every rank falls back to step 1,
        # and drops its step 2, which the job can never resume from.
        out["fallback"] = check(await ckpt.restore(), rank, 1)
        out["steps_after_fallback"] = ckpt.steps()
        await save(ckpt, rank, 2)  # so the resumed job can save step 2 again
        out["resaved"] = ckpt.steps()
    await lose(root, rank, 1)
    if rank == 0:
        corrupt_held_replica(root, 0, 1, 1)
        corrupt_held_replica(root, 0, 1, 2)
    async with Job(root, rank) as ckpt:
        try:
            await ckpt.restore()
        except astage.AstageError as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
        out["steps_final"] = ckpt.steps()
    return out


def test_corrupt_replicas_at_the_holder_are_refused_and_never_restored(tmp_path: Path) -> None:
    keeper, lost = (r.unwrap() for r in run_group(2, corrupt_target, str(tmp_path), timeout=60))
    for value in (keeper, lost):
        assert value["from_holder"]
        assert value["healed"]
    assert keeper["fallback"]
    assert lost["fallback"]
    assert lost["steps_after_fallback"] == keeper["steps_after_fallback"] == [1]
    assert lost["resaved"] == keeper["resaved"] == [1, 2]
    for value in (keeper, lost):
        assert value["error"] == "IntegrityError", value
        for step in (1, 2):
            assert f"replica of step {step} of rank 1 held by rank 0 (corrupt)" in value["message"]
    assert keeper["message"] == lost["message"]
    assert lost["steps_final"] == []  # nothing corrupt was ever committed
    assert keeper["steps_final"] == [1, 2]


async def cancelled_target(rank: int, world: int, root: str) -> dict[str, Any]:
    def job() -> tuple[astage.ReplicationStager, astage.Checkpointer]:
        rs = astage.ReplicationStager(
            storage_dir=node(root, rank) / "replicas", timeout=TIMEOUT, keep=1, chunk_bytes=64 << 10
        )
        return rs, astage.Checkpointer(node(root, rank) / "ckpt", rank=rank, keep=1, replication=rs)

    rs, ckpt = job()
    async with rs, ckpt:
        await ckpt.save(1, state_of(rank, 1, size=200_000))  # 0.8 MB: a dozen chunks
        await ckpt.wait()
    await lose(root, rank, 1)
    rs, ckpt = job()
    async with rs, ckpt:
        started = time.monotonic()
        if rank == 0:
            try:
                await ckpt.restore()
            except TransportError as exc:
                return {"error": type(exc).__name__, "elapsed": time.monotonic() - started}
            return {"error": None}
        # The lost rank is cancelled as the first chunk of its state lands.
        real_on_chunk = _restore._HealingSink.on_chunk
        with anyio.CancelScope() as scope:

            async def on_chunk(self: Any, offset: int, chunk: torch.Tensor) -> None:
                scope.cancel()
                await real_on_chunk(self, offset, chunk)

            _restore._HealingSink.on_chunk = on_chunk  # type: ignore[method-assign]
            await ckpt.restore()
        step_dir = ckpt.step_dir(1)
        left = sorted(p.name for p in step_dir.iterdir()) if step_dir.exists() else []
        refused = None
        try:
            await ckpt.save(2, state_of(rank, 2))
            await ckpt.wait()
        except astage.AstageError as exc:
            refused = type(exc).__name__
        return {"cancelled": scope.cancelled_caught, "left": left, "steps": ckpt.steps(), "refused": refused}


def test_a_restore_cancelled_mid_transfer_commits_nothing_and_the_peer_fails_in_time(tmp_path: Path) -> None:
    keeper, lost = (r.unwrap() for r in run_group(2, cancelled_target, str(tmp_path), timeout=60))
    assert lost["cancelled"]
    assert lost["left"] == []  # no temp file, no half-written checkpoint
    assert lost["steps"] == []
    assert lost["refused"] == "PersistError"  # the broken group is refused, clearly
    assert keeper["error"] in {"TransportError", "PeerTimeoutError"}
    assert keeper["elapsed"] < TIMEOUT + 1.0


# -- the decision, without processes ------------------------------------------------------------


def ring(world: int, own: list[set[int]], held: list[set[int]], k: int | None = None) -> list[Inventory]:
    step = world // 2 if k is None else k
    return [
        Inventory(frozenset(own[r]), frozenset(held[r]), (r + step) % world, (r - step) % world)
        for r in range(world)
    ]


def test_the_newest_step_every_rank_can_restore_is_chosen() -> None:
    # Rank 1 lost everything; its holder (rank 3 at k=2) has its steps 4 and 5.
    own = [{3, 4, 5}, set(), {4, 5, 6}, {4, 5}]
    held = [{4, 5}, {4, 5}, {5}, {4, 5}]
    plan = plan_restore(ring(4, own, held), None)
    assert (plan.step, plan.fetch) == (5, frozenset({1}))
    assert plan_restore(ring(4, own, held), 4).fetch == frozenset({1})


def test_no_common_step_names_the_unrecoverable_ranks_and_the_steps() -> None:
    with pytest.raises(ResourceError, match=r"rank 1 .*holder rank 2.*steps considered: \[1, 2\]"):
        plan_restore(ring(3, [{1, 2}, set(), {1, 2}], [{1, 2}, {1, 2}, set()], k=1), None)
    with pytest.raises(ResourceError, match="cannot restore step 7"):
        plan_restore(ring(2, [{1}, {1}], [{1}, {1}]), 7)
    with pytest.raises(IntegrityError, match="refused as corrupt"):
        plan_restore(ring(2, [{1}, set()], [set(), set()]), None, ["the replica of step 1 of rank 1"])


def test_ranks_that_disagree_on_the_ring_are_a_configuration_error() -> None:
    invs = ring(3, [{1}] * 3, [{1}] * 3, k=1)
    invs[0] = Inventory(frozenset({1}), frozenset({1}), 2, 1)
    with pytest.raises(astage.ConfigurationError, match="disagree on the replication ring"):
        plan_restore(invs, None)


def test_peer_timeout_is_still_a_transport_error() -> None:
    assert issubclass(PeerTimeoutError, TransportError)
