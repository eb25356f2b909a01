"""The reuse paths (a re-checked plan, a released copy kept and refilled, ``skip_unchanged``)
never return stale bytes, never wait for room that nothing will free, and accept every input
the default stager accepts, under every option.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any, NamedTuple

import anyio
import pytest
import torch

from astage import BlockingStager, DefaultStager, StagingOptions
from astage._staging.options import accelerator_available
from astage._staging.reuse import Reuse
from astage._staging.stager import AsyncStager
from tests.helpers import run_cancelled_at
from tests.snapshots import assert_matches, take, tensors_of
from tests.statedicts import random_tensor

pytestmark = pytest.mark.anyio

GUARD_SECONDS = 20
"""A stage that waits for room nothing will free never returns: the test fails after this
instead of hanging (a guard, never reached when the stager is right)."""


# -- stale bytes: an address is trusted only while what it names is kept -------------------------


def _free_by_set(t: torch.Tensor) -> None:
    t.set_()  # type: ignore[call-overload]


def _free_by_data(t: torch.Tensor) -> None:
    t.data = torch.empty(0)


def _free_by_set_elsewhere(t: torch.Tensor) -> None:
    t.set_(torch.empty(0).untyped_storage())


@pytest.mark.parametrize("free", [_free_by_set, _free_by_data, _free_by_set_elsewhere])
async def test_skip_unchanged_never_takes_a_reused_address_for_the_same_storage(free: Any) -> None:
    """The source's storage is freed after a stage, and a new tensor (same counter value)
    gets its memory: the next stage must copy the new bytes, not skip them."""
    for _ in range(32):  # the allocator re-uses the freed block most of the time
        async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
            old = torch.empty(4096)
            old.fill_(1.0)  # version 1
            await stager.release(await stager.stage({"w": old}))
            free(old)
            new = torch.empty(4096)
            new.fill_(7.0)  # version 1 as well
            staged, stats = await stager.stage_with_stats({"w": new})
            assert torch.equal(staged["w"], new)
            assert stats.bytes_skipped == 0


async def test_skip_unchanged_keeps_skipping_what_did_not_change() -> None:
    """Keeping the plan's storages does not cost the option its point."""
    frozen = {f"base{i}": torch.empty(256).fill_(i) for i in range(8)}
    sd = {"frozen": frozen, "lora": torch.empty(4).fill_(1)}
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        for step in range(4):
            with torch.no_grad():
                sd["lora"].add_(1)
            snap = take(sd)
            staged, stats = await stager.stage_with_stats(sd)
            assert_matches(staged, snap, f"step {step}")
            if step >= 2:  # refilled the copy the stage before filled: only lora copied
                assert stats.bytes_skipped == 8 * 1024
            await stager.release(staged)


async def test_skip_unchanged_never_trusts_a_tensor_swapped_into_the_released_copy() -> None:
    """A tensor the holder put into its copy before releasing it (same buffer, same place)
    has a counter of its own: equal counter values prove nothing about the buffer."""
    sd = {"w": torch.empty(1024).fill_(1.0)}
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        staged = await stager.stage(sd)  # refilled: the stage to compare against
        t = staged["w"]
        twin = torch.empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
        twin.fill_(-5.0)  # the holder writes its copy through the twin, then swaps it in
        torch._C._autograd._unsafe_set_version_counter((twin,), (t._version,))
        staged["w"] = twin
        await stager.release(staged)
        again, stats = await stager.stage_with_stats(sd)
        assert again is staged
        assert torch.equal(again["w"], sd["w"])
        assert stats.bytes_skipped == 0


# -- hangs: every copy handed back and dropped is emptied --------------------------------------------


def weights(kind: str) -> torch.Tensor:
    """4,000 bytes of weights: plain, or a conj or neg view (staged as views too, whose
    base holds the buffer as well)."""
    if kind == "conj":
        return torch.randn(500, dtype=torch.complex64).conj()
    if kind == "neg":
        return torch._neg_view(torch.randn(1000))
    return torch.randn(1000)


KINDS = ["plain", "conj", "neg"]


def small_state(kind: str = "plain") -> dict[str, Any]:
    return {"w": weights(kind), "lr": 0.1}


CAP = 6000
"""Room for one copy of :func:`small_state` (4,000 bytes), not two."""


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg() and torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_new_structure_does_not_wait_for_the_copy_it_dropped(kind: str) -> None:
    sd = small_state(kind)
    async with DefaultStager(StagingOptions(max_staging_bytes=CAP)) as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)  # kept whole, to be refilled
        sd["lr"] = torch.float16  # a new structure: the kept copy is dropped
        with anyio.fail_after(GUARD_SECONDS):
            staged = await stager.stage(sd)  # while `staged` still names the released tree
        assert staged["lr"] is torch.float16
        assert same(staged["w"], sd["w"])


@pytest.mark.parametrize("kind", KINDS)
async def test_a_refill_refused_does_not_wait_for_the_copy_it_dropped(kind: str) -> None:
    sd = small_state(kind)
    async with DefaultStager(StagingOptions(max_staging_bytes=CAP)) as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        del staged["lr"]  # the holder broke the tree after releasing it (it must not)
        sd["lr"] = 0.2  # a scalar to put back: the refill finds no slot and drops the copy
        with anyio.fail_after(GUARD_SECONDS):
            again = await stager.stage(sd)
        assert again is not staged
        assert again["lr"] == 0.2
        assert same(again["w"], sd["w"])


@pytest.mark.parametrize("step", range(8))
async def test_a_cancelled_refill_does_not_leave_its_copy_pinning_the_cap(step: int) -> None:
    sd = {f"k{i}": torch.empty(64).fill_(i) for i in range(40)}
    cap = 40 * 64 * 4 + 100
    async with DefaultStager(StagingOptions(max_staging_bytes=cap)) as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        with torch.no_grad():
            sd["k0"].add_(1)
        outcome = await run_cancelled_at(step, lambda: stager.stage(sd))
        if outcome.cancelled:
            with anyio.fail_after(GUARD_SECONDS):
                again = await stager.stage(sd)  # `staged` still names the released tree
            assert all(torch.equal(again[k], sd[k]) for k in sd)


@pytest.mark.parametrize("kind", KINDS)
async def test_closing_empties_the_kept_copy(kind: str) -> None:
    sd = small_state(kind)
    stager = DefaultStager()
    staged = await stager.stage(sd)
    await stager.release(staged)
    assert stager.pool_stats().kept_bytes == 4000
    await stager.aclose()
    # Closing let go of the copy it was given back: its memory goes now, not when the
    # caller's variable is next assigned.
    assert staged["w"].untyped_storage().nbytes() == 0
    base = staged["w"]._base
    assert base is None or base.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_copy_that_release_empties_comes_back_while_a_variable_names_it(kind: str) -> None:
    sd = {"w": weights(kind)}
    async with DefaultStager(StagingOptions(max_staging_bytes=2 * 4000 + 100)) as stager:
        first = await stager.stage(sd)
        second = await stager.stage(sd)
        await stager.release(first)  # kept
        await stager.release(second)  # emptied: one copy is kept
        first = await stager.stage(sd)  # the kept copy, refilled
        with anyio.fail_after(GUARD_SECONDS):
            third = await stager.stage(sd)  # needs the room of `second`, which still names it
        assert same(third["w"], sd["w"])
        assert second["w"].untyped_storage().nbytes() == 0


async def test_a_release_does_not_keep_a_copy_that_a_stage_began_to_wait_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage that begins to wait for room while a release is checking its copy: the
    copy must go back to the pool for it, not be kept for a refill."""
    sd = small_state()
    original = Reuse.spare_of

    def spare_then_a_waiter(self: Reuse, fast: Any, staged: Any) -> Any:
        spare = yield from original(self, fast, staged)
        while not self._pool.waiting:  # give the loop turns until the stage waits for room
            yield
        return spare

    monkeypatch.setattr(Reuse, "spare_of", spare_then_a_waiter)
    async with DefaultStager(StagingOptions(max_staging_bytes=2 * 4000)) as stager:
        first = await stager.stage(sd)
        second = await stager.stage(sd)  # the cap is full now
        done: list[Any] = []

        async def stage() -> None:
            done.append(await stager.stage(sd))

        with anyio.fail_after(GUARD_SECONDS):
            async with anyio.create_task_group() as group:
                group.start_soon(stager.release, first)
                group.start_soon(stage)
        assert torch.equal(done[0]["w"], sd["w"])
        assert second is not None


# -- no option narrows what is accepted ------------------------------------------------------------


class Pair(NamedTuple):
    a: torch.Tensor
    b: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    weight: torch.Tensor
    steps: int


def zoo(fast: bool) -> dict[str, Any]:
    """Valid inputs of every kind the default stager accepts; with ``fast``, only those the
    fast path re-checks (no namedtuple or dataclass), so that the refill and
    ``skip_unchanged`` serve the later stages."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        ema = torch.randn(16, generator=gen)
        ema_view = ema[4:]
    base = torch.randn(6, 8, generator=gen)
    tied = torch.nn.Parameter(torch.randn(3, 3, generator=gen))
    frozen = torch.nn.Parameter(torch.randn(2, generator=gen), requires_grad=False)
    model = collections.OrderedDict(weight=base, weight_t=base.t(), row=base[2], window=base[1:4, 2:6])
    model._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    complex_ = torch.randn(4, dtype=torch.complex64, generator=gen)
    out = {
        "inference": {"ema": ema, "view": ema_view},
        "model": model,
        "tied": [tied, tied],
        "frozen": frozen,
        "noncontiguous": torch.randn(5, 6, generator=gen)[:, ::2],
        "expanded": torch.randn(3, generator=gen).expand(4, 3),
        "empty": torch.empty(0, 3),
        "empty_view": base[6:],  # zero elements of a storage that has some
        "scalar": torch.tensor(2.5),
        "step": torch.tensor(3, dtype=torch.int64),
        "conj": complex_.conj(),
        "neg": torch._neg_view(torch.randn(3, generator=gen)),
        "dtypes": {
            str(d): random_tensor((3,), d, gen)
            for d in (torch.bool, torch.float8_e4m3fn, torch.bfloat16, torch.uint16, torch.int8)
        },
        "nested": {
            "a": [1, (2.5, "x"), {"b": [None, b"raw", torch.ones(2)]}],
            "pair": Pair(torch.zeros(2), 1),
        },
        "frozen_obj": Frozen(torch.arange(4.0), 3),
        "lr": 0.01,
        "dtype": torch.float16,
        "empty_containers": ([], {}, ()),
    }
    if fast:
        del out["frozen_obj"], out["nested"]["pair"]
    return out


def _switch_values(name: str) -> list[Any]:
    accel = accelerator_available()
    return {
        "use_pinned_memory": [None, False, True] if accel else [None, False],
        "use_shared_memory": [False, True],
        "use_async_staging": [True, False],
        "use_non_blocking_copy": [None, False, True] if accel else [None, False],
        "max_staging_bytes": [None, 1 << 20],
        "skip_unchanged": [False, True],
    }[name]


def every_options() -> Iterator[StagingOptions]:
    names = [f.name for f in dataclasses.fields(StagingOptions)]
    for values in itertools.product(*map(_switch_values, names)):
        yield StagingOptions(**dict(zip(names, values, strict=True)))


def _change(sd: dict[str, Any], step: int) -> None:
    """Change values between stages the way training does (in place, and a scalar)."""
    with torch.no_grad():
        sd["model"]["weight"].add_(1)
        sd["noncontiguous"].mul_(2)
        if "frozen_obj" in sd:
            sd["frozen_obj"].weight.add_(step)
    with torch.inference_mode():
        sd["inference"]["ema"].mul_(0.5)  # an inference tensor, changed where it may be
    sd["lr"] = 0.01 * (step + 2)


async def _stage_three_times(stager: AsyncStager, mode: str) -> None:
    for fast in (False, True):
        await _stage_zoo(stager, mode, fast)


async def _stage_zoo(stager: AsyncStager, mode: str, fast: bool) -> None:
    sd = zoo(fast)
    for step in range(3):
        snap = take(sd)
        if mode == "inference_mode":
            with torch.inference_mode():
                staged = await stager.stage(sd)
        else:
            staged = await stager.stage(sd)
        assert_matches(staged, snap, f"step {step}")
        if isinstance(stager, DefaultStager):
            assert stager.last_stats is not None
            if fast and step and mode == "plain" and type(stager) is DefaultStager:
                assert stager.last_stats.refilled  # the reuse paths were taken
            await stager.release(staged)
        del staged
        _change(sd, step)


@pytest.mark.parametrize("mode", ["plain", "inference_mode"])
async def test_every_option_accepts_what_the_default_accepts(mode: str) -> None:
    await _stage_three_times(DefaultStager(), mode)  # the default accepts the zoo
    for options in every_options():
        async with DefaultStager(options) as stager:
            try:
                await _stage_three_times(stager, mode)
            except Exception as exc:
                raise AssertionError(f"{options} refused or miscopied a valid input: {exc!r}") from exc


@pytest.mark.parametrize("cache", [False, True])
async def test_blocking_stager_accepts_what_the_default_accepts(cache: bool) -> None:
    async with BlockingStager(cache_staged_state_dict=cache) as stager:
        await _stage_three_times(stager, "plain")


async def test_skip_unchanged_stages_inference_tensors_and_always_copies_them() -> None:
    with torch.inference_mode():
        ema = torch.randn(64)
    sd = {"ema": ema, "w": torch.empty(64).fill_(1)}
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        for step in range(3):
            snap = take(sd)
            staged, stats = await stager.stage_with_stats(sd)
            assert_matches(staged, snap, f"step {step}")
            if step:  # the plain tensor is skipped; the inference tensor has no counter to trust
                assert stats.bytes_skipped == 64 * 4
            await stager.release(staged)
            with torch.inference_mode():
                ema.add_(1)  # bumps no counter: it has none


def test_zoo_holds_every_kind() -> None:
    tensors = tensors_of(zoo(fast=True))
    assert any(t.is_inference() for t in tensors)
    assert any(t.is_conj() for t in tensors)
    assert any(t.is_neg() for t in tensors)
    assert any(not t.is_contiguous() for t in tensors)
    assert any(t.numel() == 0 for t in tensors)
