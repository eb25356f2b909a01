"""Load and concurrency: 32 tasks through one stager and one Checkpointer under a tight cap.

What FIFO means observably here.  The pool serves waiters for room in the order they began
waiting, and never lets a later request take room an earlier one is waiting for (no
barging).  The moment a stage is served is not visible from outside, but two consequences
are, and these tests pin them down exactly:

* When room for exactly one waiter is freed at a time, and the next is freed only once the
  last waiter served has finished staging, stages complete in the order they began waiting
  (:func:`test_waiting_stages_are_served_first_in_first_out`).  The order they began
  waiting is made known by starting each only once the previous one is counted among the
  pool's waiters; the order they *called* ``stage`` would not do, since planning a
  state_dict may yield before it joins the queue.
* A small request that would fit is not served while an earlier, larger one waits
  (:func:`test_a_small_stage_never_overtakes_a_larger_one_waiting_before_it`).

For the Checkpointer, the saves waiting for one of its ``max_in_flight`` slots are served
in the order they called ``save`` (nothing between the call and joining the slots' queue
yields).  A served save calls its stager's ``stage`` right away, but several saves served at
the same moment may resume in any order (trio shuffles them): so the order of the ``stage``
calls may differ from the order of the ``save`` calls by at most ``max_in_flight - 1``
places, and that is what is checked.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest
import torch

import astage
from tests.helpers import no_blocking_calls_on_the_loop, until  # noqa: F401 - autouse fixture
from tests.statedicts import assert_same_tree

pytestmark = pytest.mark.anyio

TASKS = 32
UNIT = 64 << 10
"""Bytes of the smallest state_dict's one tensor."""


def state(i: int, units: int = 1) -> dict[str, Any]:
    """A state_dict of ``units`` UNITs in one tensor (plus a tiny one) whose values say ``i``."""
    return {"w": torch.full((units * UNIT // 4,), float(i)), "id": torch.tensor([i])}


def nbytes(units: int) -> int:
    return units * UNIT + 8


class PeakMonitor:
    """Samples a pool's total bytes every 0.5 ms while it runs.

    It sleeps between samples rather than spinning at every loop turn: a spinning loop
    holds the GIL and starves the worker threads that stage and write (a run of seconds
    became minutes).  Buffers are held for milliseconds, so their peaks are seen.
    """

    def __init__(self, stats: Any) -> None:
        self.stats = stats
        self.peak = 0
        self.samples = 0

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, self.stats().total_bytes)
            self.samples += 1
            await anyio.sleep(0.0005)


async def test_32_concurrent_stages_all_complete_within_a_tight_cap() -> None:
    rng = random.Random(5)
    sizes = [rng.choice((1, 2)) for _ in range(TASKS)]
    holds = [rng.uniform(0, 0.01) for _ in range(TASKS)]
    cap = 3 * nbytes(2)  # three of the largest state_dicts
    done: list[int] = []
    async with astage.DefaultStager(astage.StagingOptions(max_staging_bytes=cap)) as stager:
        monitor = PeakMonitor(stager.pool_stats)

        async def job(i: int) -> None:
            source = state(i, sizes[i])
            staged = await stager.stage(source)
            assert_same_tree(staged, source)
            await anyio.sleep(holds[i])  # the copy is persisted, sent...
            assert_same_tree(staged, source)  # ...and never overwritten meanwhile
            await stager.release(staged)
            done.append(i)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as outer:
                outer.start_soon(monitor.run)
                async with anyio.create_task_group() as tg:
                    for i in range(TASKS):
                        tg.start_soon(job, i)
                outer.cancel_scope.cancel()
        stats = stager.pool_stats()
    assert sorted(done) == list(range(TASKS))
    assert monitor.samples > TASKS
    assert 0 < monitor.peak <= cap
    assert stats.leased_bytes == stats.handed_out_bytes == stats.waiters == 0


async def test_waiting_stages_are_served_first_in_first_out() -> None:
    cap = 3 * nbytes(1)
    async with astage.DefaultStager(astage.StagingOptions(max_staging_bytes=cap)) as stager:
        holders = [await stager.stage(state(-1 - h)) for h in range(3)]  # the cap is full
        served: list[int] = []
        release: list[anyio.Event] = []

        async def job(i: int, gate: anyio.Event) -> None:
            staged = await stager.stage(state(i))
            served.append(i)
            assert_same_tree(staged, state(i))
            await gate.wait()
            await stager.release(staged)

        async with anyio.create_task_group() as tg:
            for i in range(TASKS):  # join the queue one after the other, in a known order
                release.append(anyio.Event())
                tg.start_soon(job, i, release[i])
                await until(lambda i=i: stager.pool_stats().waiters == i + 1)
            assert served == []
            # Free room for one stage at a time, and the next only once it has staged.
            for n, held in enumerate(holders, start=1):
                await stager.release(held)
                await until(lambda n=n: len(served) == n)
            for i in range(TASKS):
                release[i].set()
                if i + 3 < TASKS:
                    await until(lambda i=i: len(served) == i + 4)
                assert stager.pool_stats().waiters == max(0, TASKS - 4 - i)
        assert served == list(range(TASKS))


async def test_a_small_stage_never_overtakes_a_larger_one_waiting_before_it() -> None:
    cap = nbytes(2) + nbytes(1)
    async with astage.DefaultStager(astage.StagingOptions(max_staging_bytes=cap)) as stager:
        held = await stager.stage(state(0, 2))  # room is left for a small one, not a large one
        order: list[str] = []

        async def stage(name: str, units: int) -> None:
            staged = await stager.stage(state(1, units))
            order.append(name)
            await stager.release(staged)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stage, "large", 2)  # does not fit: waits
            await until(lambda: stager.pool_stats().waiters == 1)
            tg.start_soon(stage, "small", 1)  # would fit, but the large one waits first
            await until(lambda: stager.pool_stats().waiters == 2)
            await anyio.wait_all_tasks_blocked()
            assert order == []
            assert stager.pool_stats().waiters == 2
            await stager.release(held)
        # The FIFO property is the one above: the small stage, which would have fitted, was
        # not served while the large one waited ahead of it.  Once both are served they
        # copy concurrently, so their completion order says nothing about fairness.
        assert sorted(order) == ["large", "small"]


class RecordingStager:
    """A DefaultStager that records, in call order, which step each ``stage`` call is for."""

    def __init__(self, inner: astage.DefaultStager) -> None:
        self.inner = inner
        self.calls: list[int] = []

    @property
    def last_stats(self) -> astage.StageStats | None:
        return self.inner.last_stats

    async def stage(self, state_dict: Any) -> Any:
        self.calls.append(int(state_dict["id"]))
        return await self.inner.stage(state_dict)

    async def release(self, staged: Any) -> None:
        await self.inner.release(staged)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def __aenter__(self) -> RecordingStager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def test_32_concurrent_saves_through_one_checkpointer_under_a_tight_cap(tmp_path: Any) -> None:
    max_in_flight = 2
    # Room for one and a half staged copies: the second save in flight waits for the first
    # one's copy to come back.
    cap = nbytes(2) * 3 // 2
    entered: list[int] = []
    async with (
        RecordingStager(astage.DefaultStager(astage.StagingOptions(max_staging_bytes=cap))) as stager,
        astage.Checkpointer(tmp_path, stager=stager, keep=None, max_in_flight=max_in_flight) as ckpt,
    ):
        monitor = PeakMonitor(stager.inner.pool_stats)

        async def save(step: int) -> None:
            entered.append(step)  # nothing yields between here and joining the slots' queue
            await ckpt.save(step, state(step, 2))

        with anyio.fail_after(120):
            async with anyio.create_task_group() as outer:
                outer.start_soon(monitor.run)
                async with anyio.create_task_group() as tg:
                    for step in range(TASKS):
                        tg.start_soon(save, step)
                await ckpt.wait()
                outer.cancel_scope.cancel()
        assert ckpt.steps() == list(range(TASKS))
        for step in range(TASKS):
            assert_same_tree(await ckpt.restore(step), state(step, 2))
        stats = stager.inner.pool_stats()
    assert sorted(entered) == list(range(TASKS))
    assert 0 < monitor.peak <= cap
    assert stats.leased_bytes == stats.handed_out_bytes == stats.waiters == 0
    position = {step: i for i, step in enumerate(stager.calls)}
    displaced = {step: position[step] - i for i, step in enumerate(entered) if position[step] != i}
    assert all(abs(d) <= max_in_flight - 1 for d in displaced.values()), (entered, stager.calls)
