"""A host copy in several worker threads at once (copy lanes): dealt by cost, exact, and
stopped whole on an error or a cancellation."""

from __future__ import annotations

import threading

import anyio
import anyio.from_thread
import pytest
import torch

import astage
import astage._staging.copies
from astage._staging.copies import (
    LANE_MIN_COST,
    PAIR_COST_BYTES,
    CopyWork,
    copy_in_threads,
    copy_lanes,
    deal_lanes,
)
from tests.helpers import quiet
from tests.statedicts import assert_same_tree


def pairs(count: int, numel: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    src = [torch.randn(numel, generator=gen) for _ in range(count)]
    return [torch.zeros(numel) for _ in range(count)], src


def work_of(dst: list[torch.Tensor], src: list[torch.Tensor], per_batch: int) -> CopyWork:
    batches = [(dst[i : i + per_batch], src[i : i + per_batch]) for i in range(0, len(dst), per_batch)]
    costs = [sum(t.nbytes for t in d) + len(d) * PAIR_COST_BYTES for d, _ in batches]
    return CopyWork(batches, costs)


def test_lanes_leave_one_core_to_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    for cores, threads, lanes in [(1, 4, 1), (2, 2, 1), (3, 2, 2), (16, 2, 2), (16, 4, 4), (3, 8, 2)]:
        monkeypatch.setattr(astage._staging.copies, "usable_cores", lambda cores=cores: cores)
        assert copy_lanes(threads) == lanes, (cores, threads)


def test_batches_are_dealt_costliest_first_to_the_least_loaded_lane() -> None:
    unit = LANE_MIN_COST
    batches = [([torch.zeros(1)], [torch.zeros(1)]) for _ in range(5)]
    costs = [3 * unit, 3 * unit, 2 * unit, 2 * unit, 2 * unit]
    lanes = deal_lanes(CopyWork(batches, costs), 2)
    cost_of = {id(b): c for b, c in zip(batches, costs, strict=True)}
    loads = sorted(sum(cost_of[id(b)] for b in lane) for lane in lanes)
    assert loads == [5 * unit, 7 * unit]  # costliest first: {3, 2, 2} and {3, 2}
    assert sorted(id(b) for lane in lanes for b in lane) == sorted(map(id, batches))


def test_a_small_copy_stays_in_one_lane() -> None:
    batches = [([torch.zeros(1)], [torch.zeros(1)]) for _ in range(8)]
    assert len(deal_lanes(CopyWork(batches, [LANE_MIN_COST // 8] * 8), 4)) == 1
    assert len(deal_lanes(CopyWork(batches, [LANE_MIN_COST // 4] * 8), 4)) == 2
    assert len(deal_lanes(CopyWork(batches[:3], [LANE_MIN_COST] * 3), 4)) == 3  # a lane a batch at most


@pytest.mark.anyio
async def test_every_pair_is_copied_once_across_lanes() -> None:
    dst, src = pairs(3000, 1024)
    threads: set[int] = set()
    work = work_of(dst, src, per_batch=100)
    assert len(deal_lanes(work, 3)) == 3
    original = astage._staging.copies.run_batch

    def recording(batch: astage._staging.copies.Batch, non_blocking: bool = False) -> None:
        threads.add(threading.get_ident())
        original(batch, non_blocking)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(astage._staging.copies, "run_batch", recording)
        await copy_in_threads(work, anyio.CapacityLimiter(3), lanes=3)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert len(threads) >= 2  # copied by more than one thread (the limiter allows 3)


@pytest.mark.anyio
async def test_a_failing_lane_raises_its_own_error_and_stops_the_others() -> None:
    dst, src = pairs(4000, 1024)
    for i in range(100):  # the first batch is the costliest: the first lane starts with it
        dst[i], src[i] = torch.zeros(4096), torch.ones(4096)
    dst[50] = torch.zeros(7)  # this pair's copy_ fails: sizes differ
    work = work_of(dst, src, per_batch=100)
    failed = threading.Event()
    original = astage._staging.copies.run_batch

    def fail_first(batch: astage._staging.copies.Batch, non_blocking: bool = False) -> None:
        if batch[0][50] is dst[50]:
            try:
                original(batch, non_blocking)
            finally:
                failed.set()
        failed.wait(10)  # the other lane copies nothing before the first one failed
        original(batch, non_blocking)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(astage._staging.copies, "run_batch", fail_first)
        with pytest.raises(RuntimeError, match="must match"):  # not an ExceptionGroup
            await copy_in_threads(work, anyio.CapacityLimiter(2), lanes=2)
    assert failed.is_set()
    copied = sum(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    # The other lane stopped after a batch or two, instead of copying its ~2,000 pairs.
    assert copied < 1000


@pytest.mark.anyio
async def test_a_cancelled_copy_waits_for_every_lane_to_stop() -> None:
    dst, src = pairs(4000, 1024)
    work = work_of(dst, src, per_batch=50)
    started = threading.Event()
    original = astage._staging.copies.run_batch
    scope = anyio.CancelScope()

    def cancel_on_first(batch: astage._staging.copies.Batch, non_blocking: bool = False) -> None:
        if not started.is_set():
            started.set()
            anyio.from_thread.run_sync(scope.cancel)
        original(batch, non_blocking)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(astage._staging.copies, "run_batch", cancel_on_first)
        with scope:
            await copy_in_threads(work, anyio.CapacityLimiter(2), lanes=2)
    assert scope.cancelled_caught
    # Every lane's thread has stopped when the cancellation arrives: nothing copies later.
    for d in dst:
        d.fill_(-1.0)
    await quiet(astage._staging.copies, window=0.02)
    assert all(bool((d == -1.0).all()) for d in dst)


@pytest.mark.anyio
async def test_a_stager_with_two_lanes_stages_many_small_tensors_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(astage._staging.copies, "usable_cores", lambda: 3)
    gen = torch.Generator().manual_seed(3)
    sd = {f"layer{i}": {"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64)} for i in range(800)}
    async with astage.DefaultStager(threads=2) as stager:
        assert stager._lanes == 2
        for _ in range(2):  # a first stage, then a refill of the released copy
            staged = await stager.stage(sd)
            assert_same_tree(staged, sd)
            await stager.release(staged)
            for layer in sd.values():
                layer["w"].add_(1.0)
