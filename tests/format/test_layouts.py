"""A save re-uses the layout of an earlier save of the same structure, and only then.

``Checkpointer.save`` must refuse what the checkpoint file format cannot store before it returns,
which costs a walk of the whole staged tree (:func:`astage._format.codec.lay_out`).  A training
job saves one structure again and again, so the layout is kept and re-used once the staged
tree is checked against it (:mod:`astage._format.layouts`).  These tests pin both halves: a
repeated structure is not laid out again, and every change is laid out anew (or refused)
exactly as a full lay-out would.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import astage
import astage._format.codec
import astage._format.encoder
import astage._format.layouts
from astage._format.codec import FileLayout, lay_out, lay_out_in_slices
from astage._format.encoder import lay_out_planned_in_slices
from astage._format.layouts import LayoutCache, PendingLayout
from astage._staging.plan import PlannedSource
from astage._util.timeslice import Steps
from tests.helpers import (  # noqa: F401 - autouse fixture
    collections_started,
    heartbeat_gaps,
    no_blocking_calls_on_the_loop,
)
from tests.statedicts import assert_same_tree

pytestmark = pytest.mark.anyio

ID = "0" * 32


def tree() -> dict[str, Any]:
    """A staged-looking tree: tensors (one a view of another's storage), atoms, a nested dict."""
    base = torch.arange(12, dtype=torch.float32)
    return {
        "a": base,
        "view": base[2:6],
        "b": torch.ones(3, 4),
        "step": 1,
        "betas": (0.9, 0.999),
        "nested": {"c": torch.zeros(5, dtype=torch.int64), "lr": 0.5, "name": "adam"},
        "history": [0.25, None, "x"],
    }


def _set_storage(t: dict[str, Any]) -> None:
    t["b"].set_(torch.full((3, 4), 2.0))  # same tensor object, same shape: another storage


def _share(t: dict[str, Any]) -> None:
    t["b"].set_(t["a"].untyped_storage(), 0, (3, 4))  # now a view of "a"'s storage


def _unstorable(t: dict[str, Any]) -> None:
    t["nested"]["name"] = lambda: 0


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "reshape": lambda t: t.__setitem__("b", t["b"].reshape(4, 3)),
    "set_": _set_storage,
    "dtype": lambda t: t.__setitem__("b", t["b"].double()),
    "new key": lambda t: t["nested"].__setitem__("new", torch.ones(2)),
    "removed key": lambda t: t.pop("view"),
    "storage becomes shared": _share,
    "atom in a tuple": lambda t: t.__setitem__("betas", (0.9, 0.98)),
    "scalar to tensor": lambda t: t.__setitem__("step", torch.tensor(2)),
    "scalar to dtype": lambda t: t["nested"].__setitem__("lr", torch.float16),
    "requires_grad": lambda t: t["b"].requires_grad_(True),
    "parameter": lambda t: t.__setitem__("b", torch.nn.Parameter(t["b"])),
}


def header_of(layout: FileLayout) -> bytes:
    parts, spaces = dataclasses.replace(layout, created=0.0).header_parts([0] * len(layout.offsets))
    return b"".join(parts) + b" " * spaces


def assert_same_layout(got: FileLayout, expected: FileLayout) -> None:
    assert header_of(got) == header_of(expected)
    assert [s._cdata for s in got.storages] == [s._cdata for s in expected.storages]
    assert got.offsets == expected.offsets


async def kept_cache(staged: dict[str, Any]) -> LayoutCache:
    cache = LayoutCache(rank=0)
    layout = await cache.lay_out(staged, step=1, checkpoint_id=ID)
    assert isinstance(layout, FileLayout)
    await cache.keep(staged, layout)
    return cache


async def test_the_same_tree_again_gets_the_layout_a_full_lay_out_would_give() -> None:
    staged = tree()
    cache = await kept_cache(staged)
    staged["b"].fill_(7.0)  # refilled in place, as the stager does: the layout stays
    pending = await cache.lay_out(staged, step=2, checkpoint_id="1" * 32)
    assert isinstance(pending, PendingLayout), "the same tree re-uses the kept layout"
    layout = await pending.complete()
    assert (layout.step, layout.checkpoint_id) == (2, "1" * 32)
    assert_same_layout(layout, lay_out(staged, owner_rank=0, step=2, checkpoint_id="1" * 32))


@pytest.mark.parametrize("change", list(CHANGES.values()), ids=list(CHANGES))
async def test_every_change_to_the_tree_is_laid_out_anew(change: Callable[[dict[str, Any]], None]) -> None:
    staged = tree()
    cache = await kept_cache(staged)
    change(staged)
    layout = await cache.lay_out(staged, step=2, checkpoint_id=ID)
    assert isinstance(layout, FileLayout), "a changed tree must not re-use the kept layout"
    assert_same_layout(layout, lay_out(staged, owner_rank=0, step=2, checkpoint_id=ID))


def _nested(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda t: t["nested"].__setitem__(key, value)


SCALARS: dict[str, Callable[[dict[str, Any]], None]] = {
    "step": lambda t: t.__setitem__("step", 2),
    "negative step": lambda t: t.__setitem__("step", -5),
    "large int": lambda t: t.__setitem__("step", 2**70),
    "int to float": lambda t: t.__setitem__("step", 2.5),
    "int to None": lambda t: t.__setitem__("step", None),
    "int to bool": lambda t: t.__setitem__("step", True),
    "int to bytes": lambda t: t.__setitem__("step", b"\x00\xff"),
    "int to complex": lambda t: t.__setitem__("step", 1 - 0.5j),
    "lr": _nested("lr", 0.1),
    "negative zero": _nested("lr", -0.0),
    "nan": _nested("lr", float("nan")),
    "inf": _nested("lr", float("-inf")),
    "tiny": _nested("lr", 5e-324),
    "str": _nested("name", "sgd"),
    "empty str": _nested("name", ""),
    "str with escapes": _nested("name", 'a"b\\c\n'),
    "non-ascii str": _nested("name", "\u00e4dam \u2603"),
    "list item": lambda t: t["history"].__setitem__(1, 0.125),
    "several": lambda t: (t.__setitem__("step", 9), t["history"].__setitem__(2, "y"), _nested("lr", 1.0)(t)),
}


@pytest.mark.parametrize("change", list(SCALARS.values()), ids=list(SCALARS))
async def test_a_changed_scalar_re_uses_the_layout_with_the_text_a_full_lay_out_writes(
    change: Callable[[dict[str, Any]], None],
) -> None:
    staged = tree()
    cache = await kept_cache(staged)
    for step in (2, 3):  # changed, then the same again
        if step == 2:
            change(staged)
        pending = await cache.lay_out(staged, step=step, checkpoint_id=ID)
        assert isinstance(pending, PendingLayout), "a changed scalar is no new structure"
        layout = await pending.complete()
        assert layout is not None
        assert_same_layout(layout, lay_out(staged, owner_rank=0, step=step, checkpoint_id=ID))


async def test_a_changed_scalar_replaces_its_table_entry_and_leaves_the_structure_as_it_was() -> None:
    # The kept structure document is re-used as it is (no text cut, joined or re-made); the
    # stager's patch slot is the scalar's index in the table, as a walk numbers them (a
    # dict's values, nested containers and tuples met on the way counted too).
    staged = tree()
    staged["first"] = {"deep": [7, (8, 9)], "more": {"x": 10}}
    cache = await kept_cache(staged)
    kept = lay_out(staged, owner_rank=0, step=1, checkpoint_id=ID)
    staged["first"]["more"]["x"] = 11
    staged["nested"]["lr"] = 0.125
    staged["first"]["deep"][0] = "seven"
    pending = await cache.lay_out(staged, step=2, checkpoint_id=ID)
    assert isinstance(pending, PendingLayout)
    layout = await pending.complete()
    assert layout is not None
    want = lay_out(staged, owner_rank=0, step=2, checkpoint_id=ID)
    assert_same_layout(layout, want)
    assert layout.structure_json == kept.structure_json == want.structure_json
    assert layout.tables == kept.tables
    changed = [k for k, (a, b) in enumerate(zip(kept.scalars, layout.scalars, strict=True)) if a != b]
    assert [layout.scalars[k] for k in changed] == [0.125, "seven", 11]


async def test_scalars_changed_and_changed_back_over_many_saves_match_a_full_lay_out() -> None:
    staged = tree()
    cache = await kept_cache(staged)
    values = [1, 2, 1, 0.5, -0.0, float("nan"), "s", None, 1]
    for step, value in enumerate(values, start=2):
        staged["step"] = value
        staged["nested"]["lr"] = values[-step % len(values)]
        pending = await cache.lay_out(staged, step=step, checkpoint_id=ID)
        assert isinstance(pending, PendingLayout)
        layout = await pending.complete()
        assert layout is not None
        assert_same_layout(layout, lay_out(staged, owner_rank=0, step=step, checkpoint_id=ID))


async def test_a_module_metadata_version_change_re_uses_the_layout() -> None:
    staged: dict[str, Any] = {"model": torch.nn.Linear(3, 2).state_dict(), "step": 0}
    cache = await kept_cache(staged)
    staged["model"]._metadata[""]["version"] = 7
    pending = await cache.lay_out(staged, step=2, checkpoint_id=ID)
    assert isinstance(pending, PendingLayout)
    layout = await pending.complete()
    assert layout is not None
    assert_same_layout(layout, lay_out(staged, owner_rank=0, step=2, checkpoint_id=ID))


async def test_a_changed_scalar_the_format_cannot_store_is_refused_as_a_full_lay_out_refuses_it() -> None:
    staged = tree()
    cache = await kept_cache(staged)
    staged["nested"]["lr"] = 1 << 20_000  # an int too large for a header
    with pytest.raises(astage.UnsupportedInputError) as expected:
        lay_out(staged, owner_rank=0, step=2, checkpoint_id=ID)
    with pytest.raises(astage.UnsupportedInputError) as got:
        await cache.lay_out(staged, step=2, checkpoint_id=ID)
    assert str(got.value) == str(expected.value)
    assert got.value.key_path == ("nested", "lr")


async def test_a_changed_scalar_that_would_break_the_header_cap_is_refused_as_a_full_lay_out_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    staged = tree()
    cache = await kept_cache(staged)
    kept = lay_out(staged, owner_rank=0, step=2, checkpoint_id=ID)
    # A cap the kept layout fits under (with the widest metadata), and a new name does not.
    cap = (
        dataclasses.replace(
            kept,
            owner_rank=astage._format.layouts.RANK_LIMIT - 1,
            holder_rank=astage._format.layouts.RANK_LIMIT - 1,
        ).header_nbytes()
        + 4096
    )
    for module in (astage._format.encoder, astage._format.layouts):
        monkeypatch.setattr(module, "HEADER_CAP", cap)
    staged["nested"]["name"] = "n" * 8192
    with pytest.raises(astage.UnsupportedInputError, match="cap"):
        await cache.lay_out(staged, step=2, checkpoint_id=ID)


async def test_re_using_a_layout_of_20000_tensors_leaves_the_loop_its_turn() -> None:
    staged = {f"m{i}": {"w": torch.randn(32), "b": torch.randn(4)} for i in range(10_000)}
    cache = await kept_cache(staged)

    async def work() -> None:
        await anyio.wait_all_tasks_blocked()  # the heartbeat is ticking before the work starts
        pending = await cache.lay_out(staged, step=2, checkpoint_id=ID)
        assert isinstance(pending, PendingLayout)
        await pending.complete()

    # The collector off: a full pass over this heap holds the loop on its own, whatever
    # astage slices.  Measured: holds of ~1 ms; the same re-check in one go holds the loop
    # ~80 ms of CPU time, so a bound on every hold fails it.
    gc.collect()
    gc.disable()
    try:
        beats = await heartbeat_gaps(work)
    finally:
        gc.enable()
    assert max(beats.busy) < 0.03, (sorted(beats.busy)[-3:], beats.elapsed)


async def test_what_the_format_cannot_store_is_refused_even_after_a_kept_layout() -> None:
    staged = tree()
    cache = await kept_cache(staged)
    _unstorable(staged)
    with pytest.raises(astage.UnsupportedInputError) as info:
        await cache.lay_out(staged, step=2, checkpoint_id=ID)
    assert info.value.key_path == ("nested", "name")


def model(step: int) -> dict[str, Any]:
    return {
        "model": {f"layer{i}": torch.full((8, 4), float(step + i)) for i in range(20)},
        "optim": {"step": torch.tensor(float(step)), "lr": 0.1},
    }


async def test_repeated_saves_lay_out_once_and_restore_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counted(staged: Any, **kwargs: Any) -> Steps[FileLayout]:
        calls.append(kwargs["step"])
        return lay_out_in_slices(staged, **kwargs)

    def counted_planned(planned: PlannedSource, **kwargs: Any) -> Steps[FileLayout]:
        calls.append(kwargs["step"])  # a new structure's copy, laid out from its stage's plan
        return lay_out_planned_in_slices(planned, **kwargs)

    monkeypatch.setattr(astage._format.layouts, "lay_out_in_slices", counted)
    monkeypatch.setattr(astage._format.layouts, "lay_out_planned_in_slices", counted_planned)
    state = model(0)  # trained in place, as model.state_dict() views the same storages
    saved: dict[int, Any] = {}
    async with astage.Checkpointer(tmp_path, keep=None) as ckpt:
        for step in range(1, 5):
            for i, t in enumerate(state["model"].values()):
                t.fill_(float(step * 100 + i))
            saved[step] = copy.deepcopy(state)
            await (await ckpt.save(step, state)).wait()
        assert calls == [1], "a repeated structure is laid out once, not on every save's path"
        state["model"]["layer3"] = state["model"]["layer3"].reshape(4, 8)
        await (await ckpt.save(5, state)).wait()
        assert calls == [1, 5]
        for step in range(1, 5):
            assert_same_tree(await ckpt.restore(step), saved[step])
        assert_same_tree(await ckpt.restore(5), state)


async def test_a_save_refuses_a_value_the_format_cannot_store_after_saves_that_re_used_a_layout(
    tmp_path: Path,
) -> None:
    stager = astage.DefaultStager()
    async with stager, astage.Checkpointer(tmp_path, stager=stager) as ckpt:
        for step in (1, 2):
            await (await ckpt.save(step, model(step))).wait()
        bad = model(3)
        bad["optim"]["lr"] = object()
        with pytest.raises(astage.UnsupportedInputError) as info:
            await ckpt.save(3, bad)
        assert info.value.key_path == ("optim", "lr")
        assert ckpt.in_flight == ()
        await ckpt.wait()  # nothing is reported later
        await (await ckpt.save(3, model(3))).wait()
        assert ckpt.steps() == [1, 2, 3]
        assert stager.pool_stats().handed_out_bytes == 0


def source() -> dict[str, Any]:
    """What a training job stages: tensors (one a view of another's storage), atoms, a nested dict."""
    return tree()


async def test_a_copy_the_stager_refilled_is_walked_not_checked_again() -> None:
    # The stager checked the copy whole when it was released; the kept layout was made for
    # that very copy (same serial), so only the structure is walked, and the layout is
    # still the one a full lay-out gives.
    sd = source()
    async with astage.DefaultStager() as stager:
        staged, stats = await stager.stage_with_stats(sd)
        assert not stats.refilled
        cache = LayoutCache(rank=0)
        layout = await cache.lay_out(staged, step=1, checkpoint_id=ID)
        assert isinstance(layout, FileLayout)
        await cache.keep(staged, layout, stats.copy)
        assert cache._kept is not None
        # Its plan armed its guards; a check of a chunk that finds none arms one again.
        cache._kept.fast.guards.clear()
        await stager.release(staged)
        sd["b"].fill_(3.0)
        again, stats = await stager.stage_with_stats(sd)
        assert again is staged
        assert stats.refilled
        pending = await cache.lay_out(again, step=2, checkpoint_id=ID, refilled=stats.copy)
        assert isinstance(pending, PendingLayout)
        assert cache._kept is not None
        assert not cache._kept.fast.guards, "no tensor was checked"
        completed = await pending.complete()
        assert completed is not None
        assert_same_layout(completed, lay_out(again, owner_rank=0, step=2, checkpoint_id=ID))
        # Without the stager's word (another copy, or none), every tensor is checked.
        pending = await cache.lay_out(again, step=3, checkpoint_id=ID, refilled=stats.copy + 1)
        assert isinstance(pending, PendingLayout)
        assert cache._kept.fast.guards, "the full check arms the guards"


async def test_a_refilled_copy_changed_after_its_release_is_laid_out_in_full(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sd = source()
    async with astage.DefaultStager() as stager:
        staged, stats = await stager.stage_with_stats(sd)
        cache = LayoutCache(rank=0)
        layout = await cache.lay_out(staged, step=1, checkpoint_id=ID)
        assert isinstance(layout, FileLayout)
        await cache.keep(staged, layout, stats.copy)
        await stager.release(staged)
        # Misuse (the copy is the stager's now): a storage of another size under a tensor.
        staged["b"].set_(torch.full((5, 4), 9.0).untyped_storage(), 0, (3, 4))
        again, stats = await stager.stage_with_stats(sd)
        assert again is staged
        assert stats.refilled
        pending = await cache.lay_out(again, step=2, checkpoint_id=ID, refilled=stats.copy)
        assert isinstance(pending, PendingLayout)
        with caplog.at_level("WARNING", logger="astage.layout_cache"):
            assert await pending.complete() is None, "a storage of another size is never written as laid out"
        assert "changed after its release" in caplog.text


async def test_keeping_a_layout_of_many_tensors_runs_no_full_pass() -> None:
    # The kept plan lives as long as the layout: made in slices, each with the collector
    # paused; 2,000 tensors' worth of survivors make no full pass due (astage._util.collector).
    staged = {f"m{i}": {f"w{j}": torch.randn(4) for j in range(50)} for i in range(40)}  # 2,000
    cache = LayoutCache(rank=0)
    layout = await cache.lay_out(staged, step=1, checkpoint_id=ID)
    assert isinstance(layout, FileLayout)
    with collections_started() as collections:
        await cache.keep(staged, layout)
    assert 2 not in collections
    assert cache._kept is not None


async def test_saves_whose_scalars_change_restore_each_save_s_own_scalars(tmp_path: Path) -> None:
    sd = {f"w{i}": torch.full((4,), float(i)) for i in range(50)}
    sd["trainer"] = {"step": 0, "lr": 0.1, "tag": "a", "losses": [1.0, None]}
    expected = {}
    async with astage.Checkpointer(tmp_path, keep=5) as ckpt:
        for step in range(1, 5):
            sd["trainer"].update(step=step, lr=0.1 / step, tag="a" * step)
            sd["trainer"]["losses"][1] = 1.0 / step
            handle = await ckpt.save(step, sd)
            await handle.wait()
            expected[step] = copy.deepcopy(sd)
        for step, want in expected.items():
            assert_same_tree(await ckpt.restore(step), want)


@pytest.mark.parametrize("name", ["", "n" * 5000, "\u00e9\\"], ids=["short", "long", "escapes"])
def test_header_nbytes_is_the_length_header_parts_makes(name: str) -> None:
    staged = tree()
    staged["nested"]["name"] = name
    layout = lay_out(staged, owner_rank=3, step=2**40, checkpoint_id="7" * 32, holder_rank=1)
    parts, spaces = layout.header_parts([0] * len(layout.offsets))
    assert layout.header_nbytes() == sum(map(len, parts)) + spaces
