"""DefaultStager and BlockingStager: isolation, aliasing, reuse, caps, cancellation, closing."""

from __future__ import annotations

import gc
import logging
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import astage
from astage import (
    AsyncStager,
    BlockingStager,
    CapacityError,
    ClosedError,
    ConfigurationError,
    DefaultStager,
    StagingOptions,
    UnsupportedInputError,
)
from tests.helpers import until
from tests.statedicts import assert_same_tree, bytes_equal, rich_state_dict, storage_key, tensors_of

pytestmark = pytest.mark.anyio


def snapshot(sd: Any) -> list[torch.Tensor]:
    """Independent clones of every tensor, to compare against later."""
    return [t.detach().clone() for t in tensors_of(sd)]


def mutate_all(sd: Any) -> None:
    """Flip every bit of every source storage."""
    for t in tensors_of(sd):
        torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).bitwise_not_()


def assert_matches_snapshot(staged: Any, snap: list[torch.Tensor]) -> None:
    got = tensors_of(staged)
    assert len(got) == len(snap)
    for a, b in zip(got, snap, strict=True):
        assert bytes_equal(a, b)


async def test_staged_copy_is_isolated_from_later_source_changes() -> None:
    sd = rich_state_dict()
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        assert_same_tree(staged, sd)
        snap = snapshot(staged)
        mutate_all(sd)
        assert_matches_snapshot(staged, snap)


async def test_aliasing_and_storage_sizes_follow_the_source() -> None:
    base = torch.randn(16, 8)
    sd = {"w": base, "wt": base.t(), "tail": base[10:], "other": torch.randn(3), "view": base[0, :4]}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
    keys = {k: storage_key(v) for k, v in staged.items()}
    assert keys["w"] == keys["wt"] == keys["tail"] == keys["view"] != keys["other"]
    for k, v in staged.items():
        assert v.untyped_storage().nbytes() == sd[k].untyped_storage().nbytes()
        assert v.storage_offset() == sd[k].storage_offset()
        assert v.stride() == sd[k].stride()
        assert storage_key(v) != storage_key(sd[k])


async def test_second_stage_of_a_released_copy_allocates_nothing() -> None:
    sd = rich_state_dict()
    async with DefaultStager() as stager:
        first = await stager.stage(sd)
        assert stager.last_stats is not None
        assert stager.last_stats.bytes_allocated == stager.last_stats.bytes > 0
        ptrs = {t.untyped_storage().data_ptr() for t in tensors_of(first) if t.untyped_storage().nbytes()}
        await stager.release(first)
        assert all(t.numel() == 0 for t in tensors_of(first)), "released tensors are emptied"
        second = await stager.stage(sd)
        assert stager.last_stats.bytes_allocated == 0
        assert stager.last_stats.reused_buffers == stager.last_stats.storages
        assert {
            t.untyped_storage().data_ptr() for t in tensors_of(second) if t.untyped_storage().nbytes()
        } == ptrs
        assert_same_tree(second, sd)


async def test_dropping_every_reference_returns_the_buffers() -> None:
    sd = {"a": torch.randn(1000), "b": torch.randn(10)}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        del staged
        gc.collect()
        await stager.stage(sd)
        assert stager.last_stats is not None
        assert stager.last_stats.bytes_allocated == 0


async def test_a_held_copy_is_never_overwritten() -> None:
    sd = {"w": torch.arange(100, dtype=torch.float32)}
    async with DefaultStager() as stager:
        held = await stager.stage(sd)
        sd["w"].add_(1000)
        newer = await stager.stage(sd)
        assert stager.last_stats is not None
        assert stager.last_stats.bytes_allocated > 0, "a held copy's buffer must not be reused"
        assert torch.equal(held["w"], torch.arange(100, dtype=torch.float32))
        assert torch.equal(newer["w"], sd["w"])


async def test_a_kept_view_of_one_tensor_keeps_its_buffer() -> None:
    sd = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(4)}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        row = staged["w"][8:16]
        del staged
        gc.collect()
        sd["w"].zero_()
        await stager.stage(sd)
        assert torch.equal(row, torch.arange(8, 16, dtype=torch.float32))


async def test_concurrent_stages_on_one_stager_do_not_corrupt_each_other() -> None:
    sources = [{"x": torch.full((20000,), float(i)), "y": [torch.arange(i + 1)]} for i in range(8)]
    async with DefaultStager() as stager:
        results: list[Any] = [None] * len(sources)

        async def one(i: int) -> None:
            results[i] = await stager.stage(sources[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(sources)):
                tg.start_soon(one, i)
    for src, got in zip(sources, results, strict=True):
        assert_same_tree(got, src)


async def test_memory_cap_applies_back_pressure_and_is_never_exceeded() -> None:
    one = 1 << 20
    cap = 3 * one
    peak = most_waiting = 0
    finished: list[int] = []
    async with DefaultStager(StagingOptions(max_staging_bytes=cap)) as stager:

        async def monitor() -> None:
            nonlocal peak, most_waiting
            while True:
                stats = stager.pool_stats()
                peak = max(peak, stats.total_bytes)
                most_waiting = max(most_waiting, stats.waiters)
                await anyio.lowlevel.checkpoint()

        async def job(i: int) -> None:
            staged = await stager.stage({"x": torch.full((one // 4,), float(i))})
            assert staged["x"][0].item() == float(i)
            # Hold the copy until another stage waits for room (until the last few, which
            # all fit): the cap, not the timing, is what makes the others wait.
            await until(lambda: stager.pool_stats().waiters > 0 or len(finished) >= 12 - cap // one)
            await stager.release(staged)
            finished.append(i)

        async with anyio.create_task_group() as outer:
            outer.start_soon(monitor)
            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(job, i)
            outer.cancel_scope.cancel()
    assert sorted(finished) == list(range(12))
    assert 0 < peak <= cap
    assert most_waiting > 0, "no stage ever waited: the cap was never what held one back"


async def test_a_request_larger_than_the_cap_fails_at_once() -> None:
    async with DefaultStager(StagingOptions(max_staging_bytes=1000)) as stager:
        with anyio.fail_after(1), pytest.raises(CapacityError, match="max_staging_bytes"):
            await stager.stage({"big": torch.zeros(1000)})
        staged = await stager.stage({"small": torch.zeros(10)})
        assert staged["small"].shape == (10,)


async def test_cancellation_at_every_await_point_leaves_the_stager_consistent() -> None:
    sd = {"big": torch.randn(3 << 20), "small": {f"k{i}": torch.randn(8) for i in range(300)}}

    async def run(stager: DefaultStager, out: list[Any]) -> None:
        out.append(await stager.stage(sd))

    async with DefaultStager() as stager:
        steps = 0
        while True:
            result: list[Any] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(run, stager, result)
                for _ in range(steps):  # let the stage advance `steps` await points, then cancel
                    await anyio.lowlevel.checkpoint()
                tg.cancel_scope.cancel()
            stats = stager.pool_stats()
            assert stats.leased_bytes == 0, f"leak after cancelling at step {steps}"
            if result:
                break
            assert stats.handed_out_bytes == 0
            steps += 1
            assert steps < 10_000
        assert steps > 3, "the stage should have several await points"
        result.clear()
        staged = await stager.stage(sd)
        assert_same_tree(staged, sd)


async def test_close_is_idempotent_and_stage_after_close_fails_clearly() -> None:
    stager = DefaultStager()
    staged = await stager.stage({"a": torch.ones(3)})
    await stager.aclose()
    await stager.aclose()
    assert stager.closed
    assert stager.pool_stats().free_bytes == 0
    assert torch.equal(staged["a"], torch.ones(3)), "a copy handed out survives the close"
    with pytest.raises(ClosedError, match="closed"):
        await stager.stage({"a": torch.ones(3)})


async def test_close_waits_for_an_in_flight_stage() -> None:
    stager = DefaultStager()
    results: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            results.append(await stager.stage({"x": torch.randn(4 << 20)}))

        tg.start_soon(run)
        # Until a stage holds its buffers it may still be planning, and closing then makes
        # it raise ClosedError (documented); under load planning one tensor can outlast a
        # slice, so wait for the lease rather than for the task to start.
        while not results and stager.pool_stats().leased_bytes == 0:
            await anyio.lowlevel.checkpoint()
        await stager.aclose()
        assert results, "aclose returned before the in-flight stage finished"


async def test_unsupported_input_is_an_astage_error_with_its_key_path() -> None:
    async with DefaultStager() as stager:
        with pytest.raises(UnsupportedInputError) as err:
            await stager.stage({"layers": [{"w": torch.empty(2, device="meta")}]})
        assert err.value.key_path == ("layers", 0, "w")
        assert stager.pool_stats().leased_bytes == 0
        assert (await stager.stage({"ok": torch.ones(1)}))["ok"].item() == 1.0


async def test_stats_are_recorded_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="astage")
    base = torch.randn(100)
    async with DefaultStager() as stager:
        await stager.stage({"a": base, "b": base[:10], "c": torch.randn(5)})
    stats = stager.last_stats
    assert stats is not None
    assert (stats.tensors, stats.storages, stats.bytes) == (3, 2, 420)
    assert stats.seconds > 0
    assert stats.gbps > 0
    assert any("staged 3 tensors" in r.getMessage() for r in caplog.records if r.name == "astage.stager")


async def test_inline_staging_gives_the_same_copy() -> None:
    sd = rich_state_dict()
    async with DefaultStager(StagingOptions(use_async_staging=False)) as stager:
        assert_same_tree(await stager.stage(sd), sd)


def test_stagers_satisfy_the_protocol() -> None:
    assert isinstance(DefaultStager(), AsyncStager)
    assert isinstance(BlockingStager(), AsyncStager)


@pytest.mark.skipif(astage._staging.options.accelerator_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("name", ["use_pinned_memory", "use_non_blocking_copy"])
def test_asking_for_accelerator_features_without_one_is_a_configuration_error(name: str) -> None:
    with pytest.raises(ConfigurationError, match=name):
        DefaultStager(StagingOptions(**{name: True}))


def test_defaults_work_on_every_machine() -> None:
    resolved = StagingOptions().resolve()
    assert resolved.pinned == resolved.non_blocking == torch.accelerator.is_available()


@pytest.mark.parametrize("cap", [0, -5, 1.5, True])
def test_a_bad_cap_is_a_configuration_error(cap: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_staging_bytes"):
        StagingOptions(max_staging_bytes=cap)


class TestBlockingStager:
    async def test_cached_buffers_are_reused_once_released(self) -> None:
        sd = rich_state_dict()
        async with BlockingStager(cache_staged_state_dict=True) as stager:
            first = await stager.stage(sd)
            await stager.release(first)
            second = await stager.stage(sd)
            assert stager.last_stats is not None
            assert stager.last_stats.bytes_allocated == 0
            assert_same_tree(second, sd)

    async def test_cached_copy_still_held_is_not_overwritten(self) -> None:
        sd = {"w": torch.zeros(10)}
        async with BlockingStager(cache_staged_state_dict=True) as stager:
            held = await stager.stage(sd)
            sd["w"].fill_(5)
            await stager.stage(sd)
            assert torch.equal(held["w"], torch.zeros(10))

    async def test_without_cache_every_stage_allocates(self) -> None:
        sd = {"w": torch.zeros(10)}
        async with BlockingStager() as stager:
            await stager.release(await stager.stage(sd))
            await stager.stage(sd)
            assert stager.last_stats is not None
            assert stager.last_stats.bytes_allocated == 40
            assert stager.pool_stats().free_bytes == 0

    async def test_type_check_rejects_arbitrary_leaves(self) -> None:
        async with BlockingStager(type_check=True) as stager:
            with pytest.raises(UnsupportedInputError, match="type check"):
                await stager.stage({"x": {1, 2}})
