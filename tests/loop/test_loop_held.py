"""A save's background half progresses while the program holds the event loop.

The README's pattern runs a synchronous training step between two ``await``s: the loop is
held for the whole step.  A save's encode, write, fsync and commit must not wait for the
program's next ``await``.  Each test holds the loop with a synchronous wait for a condition
(the save durable on disk), with a generous hang detector, and asserts that the condition
was reached while the loop was held: no time is measured (the timings are
``benchmarks/bench_loop_held.py``'s).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import astage
from tests.distributed import run_group
from tests.helpers import no_blocking_calls_on_the_loop  # noqa: F401 - autouse fixture
from tests.statedicts import assert_same_tree

HANG_SECONDS = 60.0
"""Far past any save here: reaching it means the save waits for the loop."""


def state(step: int, tensors: int = 300) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(step)
    return {
        "weight": torch.randn(64 << 10, generator=gen),
        "layers": {f"l{i}": torch.randn(16, generator=gen) for i in range(tensors)},
        "step": step,
        "lr": 0.1 / (step + 1),
    }


def hold_loop_until(marker: Path, handle: astage.SaveHandle) -> None:
    """Hold the event loop (a synchronous 'training step') until the save is durable.

    Durable: its marker is on disk and the handle says so.  Fails if that takes
    :data:`HANG_SECONDS` (the save waits for the loop, which this call never gives back).
    """
    deadline = time.monotonic() + HANG_SECONDS
    while not (marker.exists() and handle.durable_at is not None):
        assert time.monotonic() < deadline, f"{marker} not durable while the loop was held"
        time.sleep(0.001)  # the polling interval of the held loop, not a wait for an order


@pytest.mark.anyio
async def test_saves_become_durable_while_the_program_holds_the_loop(tmp_path: Path) -> None:
    events: list[tuple[str, int]] = []
    async with astage.Checkpointer(
        tmp_path / "ckpt", keep=2, on_progress=lambda e: events.append((e.kind, e.step))
    ) as ckpt:
        handles = []
        for step in range(1, 5):  # a first layout, then kept layouts over refilled copies
            handle = await ckpt.save(step, state(step))
            hold_loop_until(ckpt.step_dir(step) / "rank00000.COMMITTED", handle)
            durable_at = handle.durable_at
            assert durable_at is not None
            handles.append(handle)
        for handle in handles:
            stats = await handle.wait()
            assert stats.durable_at == handle.durable_at
            assert stats.total_seconds > 0
        assert ckpt.steps() == [3, 4]
        for step in (3, 4):
            assert_same_tree(await ckpt.restore(step), state(step))
    # The loop heard of each save in order, though all of it happened while the loop was held.
    for step in range(1, 5):
        kinds = [kind for kind, s in events if s == step]
        assert kinds == ["staged", "persisted", "committed"], (step, kinds)


@pytest.mark.anyio
async def test_a_save_does_not_wait_for_one_that_finished_while_the_loop_was_held(tmp_path: Path) -> None:
    # Saves in flight: max_in_flight=2 lets the second start while the first is held up
    # by nothing but the loop; both must commit, in order, while the loop is held.
    async with astage.Checkpointer(tmp_path / "ckpt", keep=None, max_in_flight=2) as ckpt:
        first = await ckpt.save(1, state(1))
        second = await ckpt.save(2, state(2))
        hold_loop_until(ckpt.step_dir(2) / "rank00000.COMMITTED", second)
        assert first.durable_at is not None
        assert second.durable_at is not None
        assert first.durable_at <= second.durable_at  # committed in save order
        await ckpt.wait()
        assert ckpt.steps() == [1, 2]
        # The books were kept at the first await: the next save finds its slot free.
        third = await ckpt.save(3, state(3))
        assert third.stats is None
        hold_loop_until(ckpt.step_dir(3) / "rank00000.COMMITTED", third)
        await third.wait()
        assert_same_tree(await ckpt.restore(3), state(3))


@pytest.mark.anyio
async def test_a_save_abandoned_while_its_thread_runs_leaves_nothing(tmp_path: Path) -> None:
    # Cancelled before the thread could finish: the save is not committed, its file is
    # removed, its copy goes back, and the same step can be saved again.
    directory = tmp_path / "ckpt"
    async with astage.DefaultStager() as stager:
        with anyio.CancelScope() as scope:
            async with astage.Checkpointer(directory, stager=stager) as ckpt:
                handle = await ckpt.save(1, state(1, tensors=3000))
                scope.cancel()
        assert ckpt.closed
        if handle.durable_at is None:
            with pytest.raises(astage.PersistError, match="abandoned"):
                await handle.wait()
        assert stager.pool_stats().handed_out_bytes == stager.pool_stats().leased_bytes == 0
        async with astage.Checkpointer(directory, stager=stager) as ckpt:
            assert ckpt.steps() in ([], [1])
            saved = state(1, tensors=3000)  # the save committed before the cancel landed
            if not ckpt.steps():
                saved = state(1)
                await (await ckpt.save(1, saved)).wait()
            assert_same_tree(await ckpt.restore(1), saved)


async def replicating_rank_holding_the_loop(rank: int, world: int, root: str) -> list[int]:
    """Each rank saves, then holds its loop until its save is committed: the exchange with
    the peer (whose loop is held as well) and both commits happen with no loop turn."""
    base = Path(root)
    async with (
        astage.ReplicationStager(storage_dir=base / f"replicas{rank}", timeout=HANG_SECONDS) as replication,
        astage.Checkpointer(base / "ckpt", rank=rank, replication=replication, keep=2) as ckpt,
    ):
        for step in (1, 2, 3):
            handle = await ckpt.save(step, state(10 * step + rank))
            hold_loop_until(ckpt.step_dir(step) / f"rank{rank:05d}.COMMITTED", handle)
            await handle.wait()
        # The peer holds our replica of the last step, durable, written while both loops were held.
        held = replication.held_replicas()
        assert list(held) == [3]
        peer_state = state(30 + replication.recv_from)
        assert_same_tree(astage.load_checkpoint_file_sync(held[3]), peer_state)
        return ckpt.steps()


def test_replication_progresses_while_both_ranks_hold_their_loops(tmp_path: Path) -> None:
    results = run_group(2, replicating_rank_holding_the_loop, str(tmp_path), timeout=2 * HANG_SECONDS)
    assert [r.unwrap() for r in results] == [[2, 3], [2, 3]]


def test_replication_progresses_while_both_ranks_hold_their_loops_under_trio(tmp_path: Path) -> None:
    results = run_group(
        2, replicating_rank_holding_the_loop, str(tmp_path), timeout=2 * HANG_SECONDS, backend="trio"
    )
    assert [r.unwrap() for r in results] == [[2, 3], [2, 3]]
