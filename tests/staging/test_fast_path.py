"""The staging fast path: a re-checked plan, released copies refilled in place,
``skip_unchanged``.

Every change a later state_dict may bring must be seen: the re-check never trusts object
identity, and a copy is only refilled when it was released whole.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, cast

import anyio
import pytest
import torch

import astage._staging.copies
from astage import DefaultStager, StagingOptions, UnsupportedInputError
from astage._staging.plan import plan_state_dict
from astage._staging.recheck import fast_plan_in_slices, match_in_slices
from astage._util.timeslice import drive
from tests.helpers import collections_started, heartbeat_gaps, run_cancelled_at
from tests.statedicts import assert_same_tree, bytes_equal, storage_key, tensors_of

pytestmark = pytest.mark.anyio


def model_like() -> dict[str, Any]:
    """A small state_dict of the shapes the fast path serves: nested dicts, a list, atoms, a
    tied pair and a view sharing a storage."""
    base = torch.arange(24.0).reshape(4, 6)
    tied = torch.randn(5)
    return {
        "model": {"w": base, "w_row": base[1], "b": torch.randn(6), "emb": tied, "head": tied},
        "optim": {
            "state": {0: {"exp_avg": torch.randn(4, 6), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1], "name": "g"}],
        },
        "extra": [torch.ones(3), 7, None, "tag", -0.0],
    }


def aliasing(tree: Any) -> list[int]:
    """Which tensors share a storage, as a partition by first occurrence (walk order)."""
    seen: dict[int, int] = {}
    return [seen.setdefault(storage_key(t), len(seen)) for t in tensors_of(tree)]


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def assert_faithful(staged: Any, source: Any) -> None:
    """The staged tree is a faithful copy: structure, values, metadata, storages byte for byte."""
    plain = [t for t in tensors_of(source) if not (t.is_conj() or t.is_neg())]
    if len(plain) == len(tensors_of(source)):
        assert_same_tree(staged, source)
    assert aliasing(staged) == aliasing(source)
    for s, t in zip(tensors_of(staged), tensors_of(source), strict=True):
        assert type(s) is type(t)
        assert (s.dtype, s.shape, s.stride(), s.storage_offset()) == (
            t.dtype,
            t.shape,
            t.stride(),
            t.storage_offset(),
        )
        assert (s.requires_grad, s.is_conj(), s.is_neg()) == (t.requires_grad, t.is_conj(), t.is_neg())
        assert torch.equal(storage_bytes(s), storage_bytes(t))
        assert storage_key(s) != storage_key(t)


# -- refilling a released copy ------------------------------------------------------------------


async def test_a_released_copy_is_refilled_in_place_and_the_same_tree_returned() -> None:
    sd = model_like()
    async with DefaultStager() as stager:
        first = await stager.stage(sd)
        tensors = tensors_of(first)
        await stager.release(first)
        assert stager.pool_stats().handed_out_bytes == 0, "a kept copy counts as idle"
        with torch.no_grad():
            sd["model"]["w"].add_(1)
        second = await stager.stage(sd)
        assert second is first
        assert all(a is b for a, b in zip(tensors_of(second), tensors, strict=True)), "no view rebuilt"
        assert stager.last_stats is not None
        assert stager.last_stats.bytes_allocated == 0
        assert stager.last_stats.reused_buffers == stager.last_stats.storages
        assert_faithful(second, sd)


async def test_a_copy_not_released_is_never_overwritten() -> None:
    sd = model_like()
    async with DefaultStager() as stager:
        first = await stager.stage(sd)
        kept = [t.clone() for t in tensors_of(first)]
        second = await stager.stage(sd)
        await stager.release(second)
        with torch.no_grad():
            sd["model"]["w"].fill_(-5)
        third = await stager.stage(sd)
        assert third is second
        assert third is not first
        assert all(bytes_equal(a, b) for a, b in zip(tensors_of(first), kept, strict=True))
        assert_faithful(third, sd)


async def test_a_tree_mixing_two_copies_is_not_kept() -> None:
    sd = {"a": torch.ones(3), "b": torch.zeros(3)}
    async with DefaultStager() as stager:
        one = await stager.stage(sd)
        two = await stager.stage(sd)
        await stager.release({"a": one["a"], "b": two["b"]})
        with torch.no_grad():
            sd["a"].fill_(9)
        three = await stager.stage(sd)
        assert three is not one
        assert three is not two
        assert torch.equal(two["a"], torch.ones(3)), "two was not released: never written"
        assert_faithful(three, sd)


async def test_a_released_copy_changed_by_its_holder_is_not_refilled() -> None:
    sd = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        staged["b"] = staged["b"].t()  # the holder changed the tree: it is no copy of the plan
        await stager.release(staged)
        again = await stager.stage(sd)
        assert again is not staged
        assert_faithful(again, sd)


def _set_elsewhere(staged: dict[str, Any]) -> None:
    t = staged["b"]
    t.set_(torch.zeros(4).untyped_storage(), 0, t.shape, t.stride())  # same metadata


def _set_at_an_offset(staged: dict[str, Any]) -> None:
    # Within its own buffer, one element on: the same metadata but for the offset.
    t = staged["a"]
    t.set_(t.untyped_storage(), 0, (2,), (1,))
    t.set_(t.untyped_storage(), 1, (2,), (1,))


def _swap_in_a_copy_of_another_stage(staged: dict[str, Any], other: dict[str, Any]) -> None:
    staged["b"] = other["b"]


def _resize_a_buffer(staged: dict[str, Any]) -> None:
    staged["a"].untyped_storage().resize_(64)


HOLDER_CHANGES: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "set_ to another storage": lambda staged, _: _set_elsewhere(staged),
    "set_ at another offset": lambda staged, _: _set_at_an_offset(staged),
    "a tensor of another copy": _swap_in_a_copy_of_another_stage,
    "buffer resized": lambda staged, _: _resize_a_buffer(staged),
}


@pytest.mark.parametrize("change", list(HOLDER_CHANGES))
async def test_a_copy_released_again_after_its_holder_changed_it_is_not_refilled(change: str) -> None:
    # The first release checks a copy whole and records it; a later release of the same
    # copy is checked against that record.  A change the holder made between the two,
    # metadata kept, must still keep the copy from being refilled.
    sd = {"a": torch.arange(3.0), "b": torch.ones(2, 2)}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        assert await stager.stage(sd) is staged  # refilled: the record holds
        await stager.release(staged)
        assert await stager.stage(sd) is staged
        other = await stager.stage(sd)
        HOLDER_CHANGES[change](staged, other)
        # Held here, these storages cannot go back to the pool: nothing may write them.
        held = [t.untyped_storage() for t in tensors_of(staged)]
        before = [bytes(s) for s in held]
        if change == "set_ to another storage":  # no copy of this stager's any more
            with pytest.raises(UnsupportedInputError, match="did not stage"):
                await stager.release(staged)
        else:
            await stager.release(staged)
        assert stager.pool_stats().kept_bytes == 0, "a changed copy was kept"
        with torch.no_grad():
            for t in sd.values():
                t.add_(10)
        again = await stager.stage(sd)
        assert again is not staged
        assert_faithful(again, sd)
        assert [bytes(s) for s in held] == before, "a storage the caller holds was written"


async def test_a_copy_released_again_unchanged_is_kept_without_a_full_check() -> None:
    sd = {f"k{i}": torch.full((4,), float(i)) for i in range(300)}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        record = stager._reuse.released_record  # made by the full check
        assert record is not None
        for _ in range(3):
            assert await stager.stage(sd) is staged
            await stager.release(staged)
            assert stager._reuse.released_record is record  # recognised by its record, not checked again
            assert stager.pool_stats().kept_bytes == 300 * 16
        with torch.no_grad():
            sd["k7"].fill_(-1)
        assert_faithful(await stager.stage(sd), sd)


async def test_aclose_drops_the_kept_copy() -> None:
    sd = {"a": torch.randn(1000)}
    stager = DefaultStager()
    staged = await stager.stage(sd)
    await stager.release(staged)
    assert stager.pool_stats().free_bytes == 4000
    await stager.aclose()
    assert stager.pool_stats().total_bytes == 0
    assert stager.pool_stats().kept_bytes == 0


async def test_a_refused_stage_drops_the_kept_copy_and_the_next_stage_is_faithful() -> None:
    sd = model_like()
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        del staged
        with pytest.raises(UnsupportedInputError):
            await stager.stage({"x": torch.randn(3).to_sparse()})
        assert stager.pool_stats().kept_bytes == 0
        assert stager.pool_stats().handed_out_bytes == 0, "the dropped copy went back to the pool"
        again = await stager.stage(sd)
        assert stager.last_stats is not None
        assert stager.last_stats.bytes_allocated == 0
        assert_faithful(again, sd)


@pytest.mark.parametrize("change", ["reshape", "dtype", "shared", "set_"])
async def test_a_released_copy_whose_last_tensor_fails_the_recheck_is_never_returned(change: str) -> None:
    # Many tensors, and the change in the very last one: a refill that copied the batches
    # checked so far (the refill overlaps the re-check) must drop that half-refilled copy.
    sd = {f"k{i}": torch.full((16,), float(i)) for i in range(4096)}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        with torch.no_grad():
            for t in sd.values():
                t.add_(1)
        last = f"k{len(sd) - 1}"
        if change == "reshape":
            sd[last] = sd[last].reshape(4, 4)
        elif change == "dtype":
            sd[last] = sd[last].double()
        elif change == "shared":
            sd[last] = sd["k0"][:]
        else:
            sd[last].set_(torch.full((16,), -1.0).untyped_storage())
        again = await stager.stage(sd)
        assert again is not staged, "a copy planned for another structure was returned"
        assert_faithful(again, sd)
        assert stager.pool_stats().kept_bytes == 0


@pytest.mark.parametrize("skip", [False, True], ids=["full", "skip_unchanged"])
@pytest.mark.parametrize("step", [0, 1, 2, 3, 5, 8, 13])
async def test_a_cancelled_refill_leaves_the_kept_copy_intact_or_drops_it(step: int, skip: bool) -> None:
    sd = {f"k{i}": torch.empty(64).fill_(i) for i in range(200)}
    async with DefaultStager(StagingOptions(skip_unchanged=skip)) as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        before = [t.clone() for t in tensors_of(staged)]
        with torch.no_grad():
            for t in list(sd.values())[::2]:
                t.add_(1)
        outcome = await run_cancelled_at(step, lambda: stager.stage(sd))
        if not outcome.cancelled:
            assert outcome.value is staged
            assert_faithful(outcome.value, sd)
            return
        if stager.pool_stats().kept_bytes:  # cancelled before the refill began: untouched
            assert all(bytes_equal(a, b) for a, b in zip(tensors_of(staged), before, strict=True))
        again = await stager.stage(sd)
        assert_faithful(again, sd)


# -- every change between stages is seen ---------------------------------------------------------


def _set_to_other_storage(sd: dict[str, Any]) -> None:
    sd["model"]["b"].set_(torch.randn(6).untyped_storage())


def _share_a_storage(sd: dict[str, Any]) -> None:
    # "b" now views the storage of "exp_avg": two storages become one.
    avg = sd["optim"]["state"][0]["exp_avg"]
    sd["model"]["b"] = torch.empty(0).set_(avg.untyped_storage(), 6, (6,), (1,))


def _unshare(sd: dict[str, Any]) -> None:
    sd["model"]["w_row"] = sd["model"]["w"][1].clone()


def _untie(sd: dict[str, Any]) -> None:
    sd["model"]["head"] = sd["model"]["emb"].detach()  # same storage, another tensor object


def _tie(sd: dict[str, Any]) -> None:
    sd["model"]["b"] = sd["optim"]["state"][0]["step"]


def _resize_storage(sd: dict[str, Any]) -> None:
    sd["extra"][0].untyped_storage().resize_(64)


def _share_a_dict(sd: dict[str, Any]) -> None:
    sd["optim"]["state"][1] = sd["optim"]["state"][0]


def _set_item(path: tuple[Any, ...], value: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    def change(sd: dict[str, Any]) -> None:
        node = sd
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value(node[path[-1]])

    return change


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "reshape": _set_item(("model", "b"), lambda t: t.view(2, 3)),
    "view of another offset": _set_item(("model", "w_row"), lambda t: t.as_strided((6,), (1,), 12)),
    "set_ to another storage": _set_to_other_storage,
    "dtype": _set_item(("model", "b"), lambda t: t.double()),
    "same-size dtype view": _set_item(("model", "b"), lambda t: t.view(torch.int32)),
    "new key": lambda sd: sd["model"].update(new=torch.zeros(2)),
    "removed key": lambda sd: sd["model"].pop("b"),
    "storage becomes shared": _share_a_storage,
    "storage stops being shared": _unshare,
    "tied tensors untied": _untie,
    "tensors become tied": _tie,
    "non-contiguous": _set_item(("optim", "state", 0, "exp_avg"), lambda t: t.t()),
    "requires_grad": _set_item(("model", "b"), lambda t: t.requires_grad_(True)),
    "tensor to Parameter": _set_item(("model", "b"), lambda t: torch.nn.Parameter(t)),
    "int leaf": _set_item(("extra", 1), lambda v: v + 1),
    "float leaf": _set_item(("optim", "param_groups", 0, "lr"), lambda v: v / 2),
    "negative zero": _set_item(("extra", 4), lambda _: 0.0),
    "str leaf": _set_item(("optim", "param_groups", 0, "name"), lambda _: "h"),
    "None to tensor": _set_item(("extra", 2), lambda _: torch.ones(1)),
    "tuple item": _set_item(("optim", "param_groups", 0, "betas"), lambda b: (b[0], 0.99)),
    "key order": lambda sd: sd.update(model=dict(reversed(list(sd["model"].items())))),
    "key type": lambda sd: sd["optim"]["state"].update({"0": sd["optim"]["state"].pop(0)}),
    "list length": lambda sd: sd["extra"].append(1),
    "list to tuple": lambda sd: sd.update(extra=tuple(sd["extra"])),
    "dict subclass": lambda sd: sd.update(model=type("D", (dict,), {})(sd["model"])),
    "storage resized": _resize_storage,
    "tensor attribute": lambda sd: setattr(sd["model"]["b"], "note", 1),
    "a dict met twice": _share_a_dict,
    "conj bit": _set_item(("extra", 0), lambda t: torch.complex(t, t).conj()),
    "neg bit": _set_item(("model", "b"), lambda t: torch._neg_view(t)),
}


@pytest.mark.parametrize("released", [True, False], ids=["released", "held"])
@pytest.mark.parametrize("name", list(CHANGES))
async def test_every_change_between_stages_is_staged_faithfully(name: str, released: bool) -> None:
    sd = model_like()
    async with DefaultStager() as stager:
        first = await stager.stage(sd)
        if released:
            await stager.release(first)
        else:
            snapshot = [t.clone() for t in tensors_of(first)]
        CHANGES[name](sd)
        second = await stager.stage(sd)
        assert_faithful(second, sd)
        if not released:
            assert all(bytes_equal(a, b) for a, b in zip(tensors_of(first), snapshot, strict=True))
        # And the stage after the change re-uses what the change led to.
        await stager.release(second)
        third = await stager.stage(sd)
        assert_faithful(third, sd)


@pytest.mark.parametrize("released", [True, False], ids=["released", "held"])
@pytest.mark.parametrize("guarded", [False, True], ids=["first-recheck", "guarded"])
async def test_two_views_of_one_storage_that_become_one_object_are_one_staged_tensor(
    released: bool, guarded: bool
) -> None:
    # Two tensor objects with the same storage and metadata pass every per-tensor check as
    # one object at both places: only the identity check can tell, and the staged tree
    # must then hold one tensor there too (and two again after they part).
    base = torch.randn(300)
    sd = {"layer": {f"w{i}": torch.randn(3) for i in range(299)}, "a": base, "b": base.detach()}
    async with DefaultStager() as stager:
        for step in range(3 if guarded else 1):  # each re-check of a chunk that passed arms its guard
            staged = await stager.stage(sd)
            if released or step < 2:
                await stager.release(staged)
        sd["b"] = sd["a"]
        staged = await stager.stage(sd)
        assert staged["a"] is staged["b"]
        assert_faithful(staged, sd)
        if released:
            await stager.release(staged)
        sd["b"] = sd["a"].detach()
        staged = await stager.stage(sd)
        assert staged["a"] is not staged["b"]
        assert_faithful(staged, sd)


def run_like() -> dict[str, Any]:
    """A state_dict whose containers hold only tensors: what the re-check's guarded chunks serve."""
    layer = {f"w{i}": torch.randn(2, 3) for i in range(300)}
    layer["w260"] = torch.randn(12)[:6].view(2, 3)  # room in its storage for another offset
    return {"layer": layer, "step": torch.tensor(1.0)}


def _in_run(change: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    def apply(sd: dict[str, Any]) -> None:
        sd["layer"]["w260"] = change(sd["layer"]["w260"])  # in the second chunk of the run

    return apply


def optimizer_like() -> dict[str, Any]:
    """Adam's state: a two-tensor dict a parameter, so one guarded chunk spans 128 dicts."""
    state = {i: {"exp_avg": torch.randn(2, 3), "exp_avg_sq": torch.randn(2, 3)} for i in range(150)}
    state[130]["exp_avg"] = torch.randn(12)[:6].view(2, 3)  # tensor 260, in the second chunk
    return {"state": state, "param_groups": [{"lr": 0.1, "params": list(range(150))}]}


def _in_state(change: Callable[[torch.Tensor], Any]) -> Callable[[dict[str, Any]], None]:
    def apply(sd: dict[str, Any]) -> None:
        sd["state"][130]["exp_avg"] = change(sd["state"][130]["exp_avg"])

    return apply


def _share_in_state(sd: dict[str, Any]) -> None:
    other = sd["state"][1]["exp_avg_sq"]  # a tensor of the first chunk, in another dict
    sd["state"][130]["exp_avg"] = torch.empty(0).set_(other.untyped_storage(), 0, (2, 3), (3, 1))


def _share_in_run(sd: dict[str, Any]) -> None:
    other = sd["layer"]["w3"]
    sd["layer"]["w260"] = torch.empty(0).set_(other.untyped_storage(), 0, (2, 3), (3, 1))  # w3's


def _inference_tensor(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return t.clone()


def _with_attribute(t: torch.Tensor) -> torch.Tensor:
    t.note = 1  # type: ignore[attr-defined]
    return t


def _resized(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(64)
    return t


TENSOR_CHANGES: dict[str, Callable[[torch.Tensor], Any]] = {
    "reshape": lambda t: t.view(3, 2),
    "another offset": lambda t: t.as_strided((2, 3), (3, 1), 1),
    "set_ to another storage": lambda t: t.set_(torch.randn(12).untyped_storage(), 0, (2, 3)),
    "dtype": lambda t: t.double(),
    "same-size dtype view": lambda t: t.view(torch.int32),
    "non-contiguous": lambda t: t.t().contiguous().t(),
    "requires_grad": lambda t: t.requires_grad_(True),
    "tensor to Parameter": lambda t: torch.nn.Parameter(t),
    "conj bit": lambda t: torch.complex(t, t).conj(),
    "neg bit": torch._neg_view,
    "storage resized": _resized,
    "tensor attribute": _with_attribute,
    "inference tensor": _inference_tensor,
    "not a tensor": lambda _: 3,
}
"""Changes to one tensor that a re-check must catch, wherever the tensor sits."""

RUN_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    **{name: _in_run(change) for name, change in TENSOR_CHANGES.items()},
    "storage becomes shared": _share_in_run,
    "key removed": lambda sd: sd["layer"].pop("w299"),
}


STATE_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    **{name: _in_state(change) for name, change in TENSOR_CHANGES.items()},
    "storage becomes shared": _share_in_state,
    "key removed": lambda sd: sd["state"][130].pop("exp_avg_sq"),
    "key added": lambda sd: sd["state"][130].update(max_exp_avg_sq=torch.zeros(2, 3)),
    "dict replaced by a list": lambda sd: sd["state"].__setitem__(130, list(sd["state"][130].values())),
    "same tensor twice": lambda sd: sd["state"][131].__setitem__("exp_avg", sd["state"][130]["exp_avg"]),
    "atom changed": lambda sd: sd["param_groups"][0].__setitem__("lr", 0.2),
}


WARM_CHANGES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]] = {
    **{f"run, {name}": (run_like, change) for name, change in RUN_CHANGES.items()},
    **{f"small dicts, {name}": (optimizer_like, change) for name, change in STATE_CHANGES.items()},
}
"""Each change, in a container of tensors and in an optimizer's many small dicts (where one
guarded chunk of 256 tensors spans 128 dicts)."""


@pytest.mark.parametrize("case", list(WARM_CHANGES))
async def test_every_change_after_a_warm_recheck_is_staged_faithfully(case: str) -> None:
    # The second stage's full check arms the chunk guards; the change comes at the third,
    # and must fail its chunk's check whichever container and chunk it lands in.
    make, change = WARM_CHANGES[case]
    sd = make()
    async with DefaultStager() as stager:
        for _ in range(2):
            await stager.release(await stager.stage(sd))
        assert len(stager._reuse.fast.guards) == 2  # type: ignore[union-attr]  # armed: ~300 tensors
        change(sd)
        staged = await stager.stage(sd)
        assert_faithful(staged, sd)
        await stager.release(staged)
        assert_faithful(await stager.stage(sd), sd)


def test_a_plan_arms_the_guards_of_the_tensors_it_was_made_of() -> None:
    sd = run_like()
    fast = drive(fast_plan_in_slices(plan_state_dict(sd)))
    assert fast is not None
    assert len(fast.guards) == 2  # the 301 tensors, in chunks of 256: the next stage is guarded
    armed = dict(fast.guards)
    assert drive(match_in_slices(fast, sd)) == [*sd["layer"].values(), sd["step"]]
    assert fast.guards == armed  # they passed it: nothing re-armed


def test_a_chunk_that_passed_the_full_check_is_guarded_next_time() -> None:
    sd = run_like()
    fast = drive(fast_plan_in_slices(plan_state_dict(sd)))
    assert fast is not None
    fast.guards.clear()  # as a plan made where dynamo's guards were not at hand
    assert drive(match_in_slices(fast, sd)) is not None
    assert len(fast.guards) == 2  # the 301 tensors, in chunks of 256
    again = {"layer": dict(sd["layer"]), "step": sd["step"]}
    assert drive(match_in_slices(fast, again)) == [*sd["layer"].values(), sd["step"]]
    with torch.no_grad():  # another thread-local mode: the guard may refuse, the full check decides
        assert drive(match_in_slices(fast, again)) is not None


async def test_a_new_state_dict_object_of_the_same_model_reuses_the_copy() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    async with DefaultStager() as stager:
        first = await stager.stage(model.state_dict())
        await stager.release(first)
        with torch.no_grad():
            model[0].weight.add_(1)
        sd = model.state_dict()  # a new OrderedDict, new tensor objects, same storages
        second = await stager.stage(sd)
        assert second is first
        assert_faithful(second, sd)
        assert second._metadata == sd._metadata  # type: ignore[attr-defined]


async def test_a_steady_stage_leaves_no_objects_per_tensor_for_the_collector() -> None:
    sd = {f"l{i}": {f"w{j}": torch.randn(8) for j in range(4)} for i in range(500)}
    async with DefaultStager() as stager:
        for _ in range(2):
            await stager.release(await stager.stage(sd))
        gc.collect()
        before = len(gc.get_objects())
        await stager.release(await stager.stage(sd))
        gc.collect()
        assert len(gc.get_objects()) - before < 100  # 2,000 tensors


async def test_a_first_stage_keeps_few_objects_per_tensor_for_the_collector() -> None:
    # Every object a stager keeps is rescanned by each full collection of the program, and a
    # first stage that keeps many triggers one on the loop thread (~200 ms for
    # 20,000 tensors).  The staged tensor, its buffer's storage and the pool's record of it,
    # its TensorSpec and tree node are needed; sizes, signatures and storage specs are not.
    n = 2_000
    sd = {f"l{i}": {f"w{j}": torch.randn(4) for j in range(50)} for i in range(n // 50)}
    for t in tensors_of(sd):
        t.untyped_storage()  # the sources' storage objects exist already, as in training
    async with DefaultStager() as warm:  # first-use caches of the process are not the stager's
        await warm.release(await warm.stage({"x": [torch.randn(2), {"y": torch.randn(3)}]}))
    async with DefaultStager() as stager:
        gc.collect()
        before = len(gc.get_objects())
        await stager.release(await stager.stage(sd))  # kept whole, with its plan
        for _ in range(2):  # a pass untracks the tuples of atoms, the next the tuples of those
            gc.collect()
        assert len(gc.get_objects()) - before <= 4.5 * n  # 8 a tensor before this was fixed


async def test_a_first_stage_of_a_few_thousand_tensors_runs_no_full_pass() -> None:
    # A full pass over a heap with torch loaded holds the loop 100-350 ms.  A first stage of
    # 2,000 tensors keeps ~4 tracked objects a tensor, far below CPython's full-pass trigger
    # (survivors over a quarter of the old generation); a larger one may make a pass due
    # once per structure, as any program making that many objects does (astage._util.collector).
    sd = {f"l{i}": {f"w{j}": torch.randn(4) for j in range(50)} for i in range(40)}  # 2,000
    async with DefaultStager() as stager:
        with collections_started() as collections:
            staged = await stager.stage(sd)
            assert gc.isenabled()
        assert 2 not in collections, "no full collection"
        await stager.release(staged)


async def test_a_cancelled_first_stage_leaves_the_collector_as_it_found_it() -> None:
    sd = {f"l{i}": {f"w{j}": torch.randn(4) for j in range(50)} for i in range(40)}
    async with DefaultStager() as stager:
        assert (await run_cancelled_at(3, lambda: stager.stage(sd))).cancelled
        assert gc.isenabled()
        gc.disable()  # a program that turned it off itself keeps it off
        try:
            await stager.release(await stager.stage(sd))
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_a_plan_signatures_are_atoms_the_collector_stops_tracking() -> None:
    sd = {"a": torch.randn(3), "b": torch.nn.Parameter(torch.randn(2, 2)), "c": torch.randn(3)}
    fast = drive(fast_plan_in_slices(plan_state_dict(sd)))
    assert fast is not None
    for _ in range(2):  # a pass untracks a tuple whose items it has untracked already
        gc.collect()
    assert not any(gc.is_tracked(sig) for sig in fast.signatures)
    # Storages of one size and device share one spec.
    assert fast.plan.storages[0] is fast.plan.storages[2]
    # The type, kept by id, still tells a Parameter from a plain tensor.
    assert drive(match_in_slices(fast, dict(sd))) is not None
    assert drive(match_in_slices(fast, {**sd, "a": torch.nn.Parameter(sd["a"])})) is None


# -- skip_unchanged -------------------------------------------------------------------------------


def lora_like() -> dict[str, Any]:
    frozen = {f"base{i}": torch.empty(256).fill_(i) for i in range(8)}  # fill_ bumps _version
    trainable = {f"lora{i}": torch.empty(4).fill_(i) for i in range(2)}
    return {"frozen": frozen, "trainable": trainable}


async def test_skip_unchanged_copies_only_what_changed() -> None:
    sd = lora_like()
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        staged = await stager.stage(sd)
        assert stager.last_stats is not None
        assert stager.last_stats.bytes_skipped == 0
        await stager.release(staged)
        with torch.no_grad():
            sd["trainable"]["lora0"].add_(1)
        again = await stager.stage(sd)
        assert again is staged
        stats = stager.last_stats
        assert (stats.tensors_skipped, stats.bytes_skipped) == (9, 8 * 1024 + 16)
        assert_faithful(again, sd)


async def test_skip_unchanged_needs_the_copy_to_be_released_and_intact() -> None:
    sd = lora_like()
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        first = await stager.stage(sd)
        second = await stager.stage(sd)  # first not released: a new copy, all copied
        assert stager.last_stats is not None
        assert stager.last_stats.bytes_skipped == 0
        await stager.release(first)  # kept
        await stager.release(second)  # emptied: one copy is kept
        third = await stager.stage(sd)  # refills `first`, which the last stage did not fill
        assert third is first
        assert stager.last_stats.bytes_skipped == 0
        third["frozen"]["base3"].fill_(-1)  # the holder wrote into its copy (bumps its version)
        await stager.release(third)
        fourth = await stager.stage(sd)
        assert fourth is third
        assert stager.last_stats.bytes_skipped == 0
        assert_faithful(fourth, sd)


async def test_skip_unchanged_sees_a_tensor_replaced_or_its_storage_swapped() -> None:
    sd = lora_like()
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        await stager.release(await stager.stage(sd))
        sd["frozen"]["base0"] = torch.empty(256).fill_(42)  # a new storage: re-planned
        staged = await stager.stage(sd)
        assert_faithful(staged, sd)
        await stager.release(staged)
        again = await stager.stage(sd)
        assert again is staged
        assert again["frozen"]["base0"][0].item() == 42


async def test_skip_unchanged_never_trusts_a_new_version_counter() -> None:
    base = lora_like()
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        for value in (1.0, 2.0):
            for t in base["frozen"].values():
                t.data.fill_(value)  # .data: bumps no counter the source shares
            # `.data` aliases carry new counters, at 0: never taken as "unchanged".
            sd = {"frozen": {k: t.data for k, t in base["frozen"].items()}}
            staged = await stager.stage(sd)
            assert stager.last_stats is not None
            assert stager.last_stats.bytes_skipped == 0
            assert staged["frozen"]["base0"][0].item() == value
            await stager.release(staged)


async def test_skip_unchanged_caveat_writes_through_data_are_not_seen() -> None:
    """The documented caveat (docs/concepts.md): a write through ``.data`` bumps no version
    counter, so an unchanged-looking storage keeps its previous staged bytes."""
    sd = lora_like()
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        await stager.release(await stager.stage(sd))
        sd["frozen"]["base1"].data.fill_(100)
        staged = await stager.stage(sd)
        assert staged["frozen"]["base1"][0].item() == 1.0  # stale, as documented
    async with DefaultStager() as plain:  # without the option every byte is copied
        await plain.release(await plain.stage(sd))
        assert (await plain.stage(sd))["frozen"]["base1"][0].item() == 100.0


@pytest.mark.parametrize("during", [0, 1], ids=["first-stage", "refill"])
async def test_skip_unchanged_recopies_a_source_written_while_it_was_being_copied(
    monkeypatch: pytest.MonkeyPatch, during: int
) -> None:
    """A source written during a stage's copy (a writer racing the stage) may leave that
    copy torn; the next stage must copy it again, not keep the torn bytes as "unchanged":
    the version counters a stage records are those it saw before copying."""
    sd = lora_like()
    target = sd["trainable"]["lora1"]
    copying = {"stage": -1}
    original = astage._staging.copies.run_batch

    def copy_then_write(batch: Any, non_blocking: bool = False) -> None:
        original(batch, non_blocking)
        if copying["stage"] == during and any(t is target for t in batch[1]):
            with torch.no_grad():
                target.add_(100)  # after its bytes were copied: this stage's copy is stale

    monkeypatch.setattr(astage._staging.copies, "run_batch", copy_then_write)
    async with DefaultStager(StagingOptions(skip_unchanged=True, use_pinned_memory=False)) as stager:
        for stage in range(3):
            copying["stage"] = stage
            if stage == during:
                with torch.no_grad():
                    target.add_(0)  # changed, so that this stage copies it (a refill would skip it)
            staged = await stager.stage(sd)
            if stage > during:
                assert_faithful(staged, sd)
                assert staged["trainable"]["lora1"][0].item() == 101.0
            await stager.release(staged)
            del staged


async def test_skip_unchanged_is_validated() -> None:
    from astage import ConfigurationError

    with pytest.raises(ConfigurationError, match="skip_unchanged"):
        StagingOptions(skip_unchanged=1)  # type: ignore[arg-type]
    assert anyio  # the module is imported for the backends' fixtures


async def test_pool_stats_count_a_dropped_copy_as_back_and_a_released_one_as_kept() -> None:
    sd = {"a": torch.randn(1000), "b": torch.randn(24)}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        assert stager.pool_stats().handed_out_bytes == 4096
        assert stager.pool_stats().kept_bytes == 0
        del staged  # dropped, never released: no further stage has to come for the stat to see it
        assert stager.pool_stats().handed_out_bytes == 0
        staged = await stager.stage(sd)
        await stager.release(staged)
        stats = stager.pool_stats()
        assert stats.kept_bytes == 4096
        assert stats.free_bytes >= 4096
        assert stats.handed_out_bytes == 0
        assert await stager.stage(sd) is staged, "the kept copy is what the next stage refills"
        assert stager.pool_stats().kept_bytes == 0


async def test_a_first_stage_of_an_optimizer_s_many_small_dicts_leaves_the_loop_its_turn() -> None:
    # Planning, checking that the plan can be re-checked, leasing and handing out buffers:
    # every per-container and per-buffer walk of a first stage is sliced.  Measured on
    # 4,000 two-tensor dicts: the eligibility walk alone held the loop ~25 ms, handing
    # out the buffers ~4 ms; now no hold reaches 5 ms of the loop thread's CPU.  The
    # collector's full pass that 12,000 tensors' new objects may make due is the program's
    # to schedule (astage._util.collector; docs/performance.md): this program keeps it off meanwhile.
    sd = {
        "model": {f"w{i}": torch.randn(4) for i in range(4_000)},
        "optim": {i: {"exp_avg": torch.randn(4), "exp_avg_sq": torch.randn(4)} for i in range(4_000)},
    }
    gc.collect()
    async with DefaultStager() as stager:
        staged: list[Any] = []

        async def stage() -> None:
            staged.append(await stager.stage(sd))

        gc.disable()
        try:
            beats = await heartbeat_gaps(stage)
        finally:
            gc.enable()
        assert_faithful(staged[0], sd)
    assert max(beats.busy) < 0.015, sorted(beats.busy)[-3:]


# -- scalars that change between stages -----------------------------------------------------------


def trainer_like() -> dict[str, Any]:
    """What a training loop checkpoints: a module's state_dict (with its ``_metadata``), an
    optimizer's, and scalars that change every step."""
    return {
        "model": torch.nn.Linear(4, 2).state_dict(),
        "optim": {
            "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(2, 4)}},
            "param_groups": [
                {
                    "lr": 0.1,
                    "betas": (0.9, 0.999),
                    "weight_decay": 0.01,
                    "flag": True,
                    "extra": None,
                    "name": "g",
                    "params": [0],
                }
            ],
        },
        "step": 100,
        "losses": [0.5, 0.25],
        "blob": b"abc",
        "z": 1 + 2j,
    }


def _group(sd: dict[str, Any]) -> dict[str, Any]:
    return cast(dict[str, Any], sd["optim"]["param_groups"][0])


SCALAR_CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "learning rate": lambda sd: _group(sd).update(lr=_group(sd)["lr"] / 2),
    "step count": lambda sd: sd.update(step=sd["step"] + 1),
    "list item": lambda sd: sd["losses"].__setitem__(1, 0.125),
    "str": lambda sd: _group(sd).update(name="h"),
    "bool": lambda sd: _group(sd).update(flag=False),
    "None to float": lambda sd: _group(sd).update(extra=1.5),
    "int to float": lambda sd: sd.update(step=100.5),
    "float to int": lambda sd: _group(sd).update(weight_decay=0),
    "negative zero": lambda sd: _group(sd).update(weight_decay=-0.0),
    "nan": lambda sd: _group(sd).update(lr=float("nan")),
    "bytes": lambda sd: sd.update(blob=b"abd"),
    "complex": lambda sd: sd.update(z=1 - 2j),
    "module metadata": lambda sd: sd["model"]._metadata[""].update(version=2),
    "several at once": lambda sd: (
        sd.update(step=7),
        _group(sd).update(lr=0.3),
        sd["losses"].__setitem__(0, 9.0),
    ),
}


def scalars_of(tree: Any, path: str = "sd") -> dict[str, tuple[type, str]]:
    """Every non-tensor leaf (dict attributes too) by path, as its type and repr: ``-0.0``
    and ``nan`` told apart, unlike ``==``."""
    out: dict[str, tuple[type, str]] = {}
    if isinstance(tree, torch.Tensor):
        return out
    if isinstance(tree, dict):
        for k, v in tree.items():
            out |= scalars_of(v, f"{path}[{k!r}]")
        for k, v in getattr(tree, "__dict__", {}).items():
            out |= scalars_of(v, f"{path}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out |= scalars_of(v, f"{path}[{i}]")
    else:
        out[path] = (type(tree), repr(tree))
    return out


def assert_same_scalars(staged: Any, source: Any) -> None:
    assert scalars_of(staged) == scalars_of(source)


@pytest.mark.parametrize("name", list(SCALAR_CHANGES))
async def test_a_changed_scalar_is_put_into_the_refilled_copy_without_a_new_plan(name: str) -> None:
    sd = trainer_like()
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        SCALAR_CHANGES[name](sd)
        again, stats = await stager.stage_with_stats(sd)
        assert stats.refilled
        assert again is staged
        assert not stats.planned
        if name not in {"nan", "negative zero"}:  # (== cannot tell those)
            assert_faithful(again, sd)
        assert_same_scalars(again, sd)
        with torch.no_grad():  # the bytes are refilled too
            for t in tensors_of(sd):
                t.add_(1)
        await stager.release(again)
        third = await stager.stage(sd)
        assert third is staged
        assert_same_scalars(third, sd)
        assert all(bytes_equal(a, b) for a, b in zip(tensors_of(third), tensors_of(sd), strict=True))


@pytest.mark.parametrize("name", list(SCALAR_CHANGES))
async def test_a_changed_scalar_goes_into_a_new_copy_and_the_held_copy_keeps_its_own(name: str) -> None:
    sd = trainer_like()
    async with DefaultStager() as stager:
        held = await stager.stage(sd)
        before = scalars_of(held)
        SCALAR_CHANGES[name](sd)
        second, stats = await stager.stage_with_stats(sd)
        assert not stats.refilled
        assert second is not held
        assert_same_scalars(second, sd)
        assert scalars_of(held) == before, "a copy the caller holds was changed"


async def test_a_scalar_changed_back_to_the_planned_value_is_put_back() -> None:
    sd = trainer_like()
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        for step in (101, 102, 100, 100, 5):  # 100 is the value the plan was made with
            await stager.release(staged)
            sd["step"] = step
            again = await stager.stage(sd)
            assert again is staged
            assert again["step"] == step


async def test_a_scalar_the_holder_changed_in_a_released_copy_is_set_back() -> None:
    sd = trainer_like()
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        staged["losses"][0] = -1.0  # against release()'s contract, but not kept stale
        _group(staged)["name"] = "mine"
        await stager.release(staged)
        again = await stager.stage(sd)
        assert_same_scalars(again, sd)


@pytest.mark.parametrize(
    "change",
    [
        lambda sd: _group(sd).update(betas=(0.8, 0.999)),  # in a tuple: no slot
        lambda sd: _group(sd).update(lr=torch.tensor(0.05)),  # a scalar that became a tensor
        lambda sd: sd.update(step=[1, 2]),  # a scalar that became a container
        lambda sd: sd.update(step=torch.float32),  # an atom, but not a plain scalar
    ],
    ids=["tuple item", "to tensor", "to list", "to dtype"],
)
async def test_a_change_that_is_not_a_scalar_in_a_dict_or_list_is_planned_anew(
    change: Callable[[dict[str, Any]], None],
) -> None:
    sd = trainer_like()
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        change(sd)
        again, stats = await stager.stage_with_stats(sd)
        assert stats.planned
        assert_faithful(again, sd)


async def test_changed_scalars_and_skip_unchanged_together() -> None:
    sd = lora_like() | {"step": 1, "lr": 0.5}
    async with DefaultStager(StagingOptions(skip_unchanged=True)) as stager:
        staged = await stager.stage(sd)
        for step in range(2, 5):
            await stager.release(staged)
            sd.update(step=step, lr=0.5 / step)
            staged, stats = await stager.stage_with_stats(sd)
            assert stats.refilled
            assert stats.bytes_skipped == stats.bytes
            assert (staged["step"], staged["lr"]) == (step, 0.5 / step)


async def test_a_released_copy_broken_after_its_release_is_replaced_by_a_new_copy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sd = trainer_like()
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
        await stager.release(staged)
        del staged["optim"]["param_groups"][0]["lr"]  # against release()'s contract
        sd["optim"]["param_groups"][0]["lr"] = 0.01
        with caplog.at_level("WARNING", logger="astage.stager"):
            again = await stager.stage(sd)
        assert again is not staged
        assert_faithful(again, sd)
        assert "changed after its release" in caplog.text
        await stager.release(again)
        assert await stager.stage(sd) is again  # and the new copy is refilled from then on
