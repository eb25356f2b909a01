"""``restore(into=...)`` of a tree with the file's shape: matched at a glance, read whole.

The common case (the caller's model and optimizer, the keys and tensors it saved, each a
plain CPU tensor alone on its storage) is matched by a side-by-side walk and column checks
(:mod:`astage._checkpointer.same_shape`) instead of a plan of the whole tree; the debug
record ``matched by shape`` says when.  Everything else goes the general way, with the
very errors it raised before: each case here is checked against the general match run
directly on the same file and tree.
"""

from __future__ import annotations

import collections
import gc
import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import astage
from astage._checkpointer.destination import match_in_slices
from astage._checkpointer.restore_into import FillReport
from astage._files.reading import opened_checked
from astage._format.spec import DTYPES
from astage._staging.plan import plan_in_slices, supported_devices
from astage._util.errors import UnsupportedInputError
from astage._util.timeslice import drive
from tests.checkpointer.test_collective_restore import Job, lose
from tests.checkpointer.test_restore_into import bits, elements, flip_byte_of, saved
from tests.distributed import run_group
from tests.helpers import no_blocking_calls_on_the_loop, run_cancelled_at  # noqa: F401 - autouse fixture

SAME_SHAPE = "matched by shape"
BY_KEY_PATH = "matched by key path"


@pytest.fixture
def matches(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """How each copy of the restores so far was matched: ``SAME_SHAPE`` or ``BY_KEY_PATH``."""
    caplog.set_level(logging.DEBUG, logger="astage.checkpointer")

    def seen() -> list[str]:
        messages = [r.getMessage() for r in caplog.records if r.name == "astage.checkpointer"]
        return [how for m in messages for how in (SAME_SHAPE, BY_KEY_PATH) if how in m]

    return seen


def flat_tensors(tree: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    """Every tensor of a tree of dicts and lists, by key path."""
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {}
    return {p: t for k, v in items for p, t in flat_tensors(v, (*path, k)).items()}


def like(tree: Any) -> Any:
    """A fresh tree of the same shape: new tensors (filled with a sentinel), same leaves."""
    if isinstance(tree, torch.nn.Parameter):
        return torch.nn.Parameter(like(tree.detach()), requires_grad=tree.requires_grad)
    if isinstance(tree, torch.Tensor):
        out = torch.empty(tree.shape, dtype=tree.dtype)
        if out.numel():
            out.reshape(-1).view(torch.uint8).fill_(0x5A)
        return out
    if isinstance(tree, dict):
        return type(tree)((k, like(v)) for k, v in tree.items())
    if isinstance(tree, (list, tuple)):
        return type(tree)(like(v) for v in tree)
    return tree


def every_dtype(seed: int) -> dict[str, Any]:
    """Every dtype the format stores, as plain, 0-d, empty and 1-element tensors, and a Parameter."""
    model: dict[str, Any] = {}
    for i, (name, dtype) in enumerate(sorted(DTYPES.items())):
        model[name] = {
            "plain": bits(dtype, 12, seed + 10 * i).view(3, 4),
            "scalar": bits(dtype, 1, seed + 10 * i + 1).view(()),
            "empty": bits(dtype, 0, seed).view(0, 3),
            "one": bits(dtype, 1, seed + 10 * i + 2),
        }
    g = torch.Generator().manual_seed(seed)
    return {
        "model": model,
        "param": torch.nn.Parameter(torch.randn(3, 4, generator=g)),
        "optim": {"state": {0: {"step": 3, "exp_avg": torch.randn(3, 4, generator=g)}}, "lr": 0.1},
        "layers": [
            torch.randn(2, generator=g),
            [torch.randn(3, generator=g), {"w": torch.randn(1, generator=g)}],
        ],
    }


def assert_bit_exact(dest: Any, source: Any) -> None:
    want = flat_tensors(source)
    got = flat_tensors(dest)
    assert got.keys() == want.keys()
    for path, t in got.items():
        assert elements(t) == elements(want[path]), path


# -- the fast path, taken -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_tree_of_the_files_shape_is_matched_at_a_glance_and_filled_bit_exact(
    tmp_path: Path, matches: Callable[[], list[str]]
) -> None:
    source = every_dtype(1)
    await saved(tmp_path, source)
    dest = like(source)
    ids = {p: (id(t), t.data_ptr()) for p, t in flat_tensors(dest).items()}
    async with astage.Checkpointer(tmp_path) as ckpt:
        got = await ckpt.restore(into=dest)
    assert matches() == [SAME_SHAPE]
    assert_bit_exact(dest, source)
    for path, t in flat_tensors(dest).items():
        assert (id(t), t.data_ptr()) == ids[path], path  # in place
    assert flat_tensors(got).keys() == ids.keys()
    assert all(flat_tensors(got)[p] is t for p, t in flat_tensors(dest).items())  # the caller's objects
    assert got["optim"]["state"][0]["step"] == 3
    assert got["optim"]["lr"] == 0.1
    assert type(got["param"]) is torch.nn.Parameter
    assert got["param"] is dest["param"]


@pytest.mark.anyio
async def test_a_modules_own_state_dict_is_matched_at_a_glance(
    tmp_path: Path, matches: Callable[[], list[str]]
) -> None:
    """``module.state_dict()`` is an OrderedDict with a ``_metadata`` attribute: the same shape."""
    torch.manual_seed(2)
    saved_model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    await saved(tmp_path, saved_model.state_dict())
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.restore(into=model.state_dict())
    assert matches() == [SAME_SHAPE]
    for (name, want), got in zip(saved_model.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


@pytest.mark.anyio
async def test_a_parameter_with_another_requires_grad_is_still_matched_at_a_glance(
    tmp_path: Path, matches: Callable[[], list[str]]
) -> None:
    source = {"w": torch.nn.Parameter(torch.randn(4, 4)), "b": torch.randn(4)}
    await saved(tmp_path, source)
    dest = {
        "w": torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False),
        "b": torch.nn.Parameter(torch.zeros(4)),
    }
    async with astage.Checkpointer(tmp_path) as ckpt:
        got = await ckpt.restore(into=dest)
    assert matches() == [SAME_SHAPE]
    assert got["w"] is dest["w"]
    assert not dest["w"].requires_grad
    assert got["b"] is dest["b"]
    assert dest["b"].requires_grad
    assert torch.equal(dest["w"], source["w"].detach())
    assert torch.equal(dest["b"].detach(), source["b"])


# -- everything else: the general match, with its own outcome ------------------------------------


async def general_outcome(directory: Path, dest: Any) -> BaseException | None:
    """What the general match (the whole tree planned, matched by key path) makes of ``dest``."""
    path = directory / "step_0000000001" / "rank00000.astage"
    async with opened_checked(path, limiter=None, check=None, dir_fd=None) as (_, header):
        try:
            source = drive(plan_in_slices(dest, allowed_devices=supported_devices()))
            drive(match_in_slices(header.plan, source, dest))
        except UnsupportedInputError as exc:
            return exc
    return None


def tied(dest: dict[str, Any]) -> None:
    dest["b"] = dest["a"]


def tied_both(dest: dict[str, Any]) -> None:  # the file's "a" and "b" were one tensor too
    dest["b"] = dest["a"]


def view_of_bigger(dest: dict[str, Any]) -> None:
    dest["a"] = torch.zeros(40)[4:16].view(3, 4)


def transposed(dest: dict[str, Any]) -> None:
    dest["a"] = torch.zeros(4, 3).t()


def shared_storage(dest: dict[str, Any]) -> None:
    base = torch.zeros(24)
    dest["a"], dest["b"] = base[:12].view(3, 4), base[12:].view(3, 4)


def extra_key(dest: dict[str, Any]) -> None:
    dest["extra"] = torch.zeros(2)


def missing_key(dest: dict[str, Any]) -> None:
    del dest["a"]


def other_dtype(dest: dict[str, Any]) -> None:
    dest["a"] = torch.zeros(3, 4, dtype=torch.float64)


def other_shape(dest: dict[str, Any]) -> None:
    dest["a"] = torch.zeros(4, 3)


def other_order(dest: dict[str, Any]) -> None:
    dest["a"] = dest.pop("a")  # the same keys, in another order


def one_empty_twice(dest: dict[str, Any]) -> None:
    dest["f"] = dest["e"]  # no storage bytes to tell them apart


def empties_on_one_storage(dest: dict[str, Any]) -> None:
    dest["e"], dest["f"] = (base := torch.zeros(0, 3)), base.view(0, 3)


def empties_source() -> dict[str, Any]:
    return {**base_source(), "e": torch.zeros(0, 3), "f": torch.zeros(0, 3)}


def int_less(dest: dict[str, Any]) -> None:
    del dest["n"]


def extra_int(dest: dict[str, Any]) -> None:
    dest["epoch"] = 3


def extra_dict(dest: dict[str, Any]) -> None:
    dest["scheduler"] = {"last_epoch": 3}


def tensor_for_int(dest: dict[str, Any]) -> None:
    dest["n"] = torch.zeros(())


def string_for_tensor(dest: dict[str, Any]) -> None:
    dest["a"] = "not a tensor"


def shorter_list(dest: dict[str, Any]) -> None:
    dest["layers"][1].pop()


def list_for_dict(dest: dict[str, Any]) -> None:
    dest["layers"][1][1] = [torch.zeros(1)]


def ordered_dict(dest: dict[str, Any]) -> None:
    dest["layers"][1][1] = collections.OrderedDict(dest["layers"][1][1])


def conjugate(dest: dict[str, Any]) -> None:
    dest["c"] = torch.zeros(3, dtype=torch.complex64).conj()


def meta_tensor(dest: dict[str, Any]) -> None:
    dest["a"] = torch.empty(3, 4, device="meta")


def tensor_with_attribute(dest: dict[str, Any]) -> None:
    dest["a"].note = "an attribute"


def numpy_in_both(dest: dict[str, Any]) -> None:
    dest["array"] = np.zeros(3)


def bytesio_in_both(dest: dict[str, Any]) -> None:
    dest["blob"] = io.BytesIO(b"")


def tensor_for_array(dest: dict[str, Any]) -> None:
    dest["array"] = torch.zeros(3, dtype=torch.float64)


def base_source() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.randn(3, 4, generator=g),
        "b": torch.randn(3, 4, generator=g),
        "c": torch.randn(3, generator=g).to(torch.complex64),
        "n": 7,
        "layers": [
            torch.randn(2, generator=g),
            [torch.randn(3, generator=g), {"w": torch.randn(1, generator=g)}],
        ],
    }


def tied_source() -> dict[str, Any]:
    source = base_source()
    source["b"] = source["a"]
    return source


def leaves_source() -> dict[str, Any]:
    source = base_source()
    source["array"] = np.arange(3.0)
    source["blob"] = io.BytesIO(b"opaque")
    return source


CASES: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]] = {
    "tied": (base_source, tied),
    "tied in both": (tied_source, tied_both),
    "view of a bigger storage": (base_source, view_of_bigger),
    "transposed": (base_source, transposed),
    "two tensors on one storage": (base_source, shared_storage),
    "extra key": (base_source, extra_key),
    "missing key": (base_source, missing_key),
    "other dtype": (base_source, other_dtype),
    "other shape": (base_source, other_shape),
    "keys in another order": (base_source, other_order),
    "one empty tensor where the file holds two": (empties_source, one_empty_twice),
    "two empty tensors on one storage": (empties_source, empties_on_one_storage),
    "an int less": (base_source, int_less),
    "an extra int": (base_source, extra_int),
    "an extra dict of values": (base_source, extra_dict),
    "tensor where the file holds an int": (base_source, tensor_for_int),
    "string where the file holds a tensor": (base_source, string_for_tensor),
    "shorter nested list": (base_source, shorter_list),
    "list where the file holds a dict": (base_source, list_for_dict),
    "OrderedDict where the file holds a dict": (base_source, ordered_dict),
    "conjugate bit": (base_source, conjugate),
    "meta tensor": (base_source, meta_tensor),
    "tensor with an attribute": (base_source, tensor_with_attribute),
    "numpy array in the file and the tree": (leaves_source, numpy_in_both),
    "BytesIO in the file and the tree": (leaves_source, bytesio_in_both),
    "tensor where the file holds an array": (leaves_source, tensor_for_array),
}


AT_A_GLANCE = {
    "OrderedDict where the file holds a dict",  # a dict all the same: its keys are what count
    "tied in both",  # one object where the file meets one tensor twice
    "an int less",  # keys that hold no tensor are not looked at
    "an extra int",
    "two empty tensors on one storage",  # nothing to write: each read whole, of 0 bytes
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(CASES))
async def test_a_tree_is_matched_at_a_glance_or_by_key_path_with_the_general_outcome(
    tmp_path: Path, case: str, matches: Callable[[], list[str]]
) -> None:
    make_source, change = CASES[case]
    source = make_source()
    await saved(tmp_path, source)
    dest = like(source)
    change(dest)
    expected = await general_outcome(tmp_path, dest)
    async with astage.Checkpointer(tmp_path) as ckpt:
        if expected is None:
            got = await ckpt.restore(into=dest)
        else:
            with pytest.raises(type(expected)) as info:
                await ckpt.restore(into=dest)
    if case in AT_A_GLANCE:
        assert matches() == [SAME_SHAPE], case
    else:
        assert matches() == [BY_KEY_PATH], case
    if expected is not None:
        assert str(info.value) == str(expected)
        assert info.value.key_path == expected.key_path  # type: ignore[attr-defined]
        report = info.value.fill_report  # type: ignore[attr-defined]
        assert report.filled == ()
        assert report.partial == ()
        return
    for path, t in flat_tensors(dest).items():
        assert elements(t) == elements(flat_tensors(source)[path]), path
        assert flat_tensors(got)[path] is t, path
    if "array" in source:
        assert np.array_equal(got["array"], source["array"])
        assert got["blob"].getvalue() == b"opaque"


# -- failing half-way on the fast path ------------------------------------------------------------


def many(seed: int, count: int = 24, numel: int = 1 << 16) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(numel, generator=g) for i in range(count)}, "step": seed}


@pytest.mark.anyio
async def test_a_corrupt_storage_on_the_fast_path_is_an_integrity_error_with_the_report(
    tmp_path: Path, matches: Callable[[], list[str]]
) -> None:
    source = many(4, count=3, numel=1 << 20)
    await saved(tmp_path, source)
    flip_byte_of(tmp_path / "step_0000000001" / "rank00000.astage", (4 << 20) + 100)  # inside w1
    dest = like(source)
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(astage.IntegrityError) as info:
            await ckpt.restore(into=dest)
    assert matches() == [SAME_SHAPE]
    report: FillReport = info.value.fill_report  # type: ignore[attr-defined]
    assert report.filled == (("model", "w0"),)
    assert report.partial == (("model", "w1"),)
    assert report.untouched == (("model", "w2"),)
    assert any("1 tensor(s) filled, 1 written in part, 1 untouched" in n for n in info.value.__notes__)
    assert torch.equal(dest["model"]["w0"], source["model"]["w0"])
    assert elements(dest["model"]["w2"]) == elements(like(source)["model"]["w2"])  # untouched


@pytest.mark.anyio
async def test_a_corrupt_storage_with_tied_tensors_reports_every_place_of_each(
    tmp_path: Path, matches: Callable[[], list[str]]
) -> None:
    g = torch.Generator().manual_seed(8)
    emb, w, x = (torch.randn(1 << 20, generator=g) for _ in range(3))
    source = {"emb": emb, "w": w, "head": emb, "x": x}  # "head" tied to "emb"
    await saved(tmp_path, source)
    flip_byte_of(tmp_path / "step_0000000001" / "rank00000.astage", (4 << 20) + 100)  # inside w
    dest = like({"emb": emb, "w": w, "x": x})
    dest = {"emb": dest["emb"], "w": dest["w"], "head": dest["emb"], "x": dest["x"]}
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(astage.IntegrityError) as info:
            await ckpt.restore(into=dest)
    assert matches() == [SAME_SHAPE]
    report: FillReport = info.value.fill_report  # type: ignore[attr-defined]
    assert report.filled == (("emb",), ("head",))
    assert report.partial == (("w",),)
    assert report.untouched == (("x",),)
    assert torch.equal(dest["head"], emb)


@pytest.mark.anyio
async def test_a_restore_on_the_fast_path_cancelled_at_every_await_reports_what_it_left(
    tmp_path: Path, matches: Callable[[], list[str]]
) -> None:
    source = many(5)
    await saved(tmp_path, source)
    points = 0
    async with astage.Checkpointer(tmp_path) as ckpt:
        while True:
            dest = like(source)
            before = {p: elements(t) for p, t in flat_tensors(dest).items()}
            reports: list[FillReport] = []

            async def restore(dest: Any = dest, reports: list[FillReport] = reports) -> Any:
                try:
                    return await ckpt.restore(into=dest)
                except BaseException as exc:
                    reports.append(exc.fill_report)  # type: ignore[attr-defined]
                    raise

            outcome = await run_cancelled_at(points, restore)
            if not outcome.cancelled:
                break
            (report,) = reports
            named = (*report.filled, *report.partial, *report.untouched)
            assert sorted(named) == sorted(before), points  # every tensor named, once
            for path, t in flat_tensors(dest).items():
                if path in report.filled:
                    assert elements(t) == elements(flat_tensors(source)[path]), (points, path)
                elif path not in report.partial:
                    assert elements(t) == before[path], (points, path)
            points += 1
            assert points < 2000
    assert_bit_exact(dest, source)
    assert outcome.value["model"]["w0"] is dest["model"]["w0"]
    assert points >= 3, points
    assert set(matches()) == {SAME_SHAPE}


# -- what a restore keeps alive -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_restore_into_many_tensors_keeps_few_tracked_objects_alive_per_tensor(tmp_path: Path) -> None:
    """While the body is read, what the match holds is a few columns, not records per tensor:
    every object it keeps is rescanned by each full collection meanwhile."""
    count = 3000
    g = torch.Generator().manual_seed(6)
    source = {
        "model": {f"layer.{i}.weight": torch.randn(8, generator=g) for i in range(count)},
        "optim": {i: {"exp_avg": torch.randn(8, generator=g)} for i in range(count)},
    }
    await saved(tmp_path, source)
    dest = like(source)
    tensors = 2 * count
    alive: list[int] = []

    def on_read(done: int, total: int) -> None:
        if not alive:  # the copy is matched, its body being read
            gc.collect()
            alive.append(len(gc.get_objects()))

    async with astage.Checkpointer(tmp_path) as ckpt:
        gc.collect()
        baseline = len(gc.get_objects())
        await ckpt.restore(into=dest, on_read=on_read)
    assert alive, "on_read was never called"
    per_tensor = (alive[0] - baseline) / tensors
    # The header's record and the read's piece stay (two a tensor); a plan of the caller's
    # tree and a record, a pair and a path list a storage (five a tensor in all) do not.
    assert per_tensor <= 3.0, per_tensor
    assert_bit_exact(dest, source)


# -- the collective restore -------------------------------------------------------------------------


def rank_state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"model": {f"w{i}": torch.randn(64, generator=g) for i in range(6)}, "step": step}


async def collective_same_shape_target(rank: int, world: int, root: str, lost: int) -> dict[str, Any]:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("astage.checkpointer")
    logger.addHandler(handler := Keep(logging.DEBUG))
    logger.setLevel(logging.DEBUG)
    try:
        async with Job(root, rank) as ckpt:
            await ckpt.save(1, rank_state(rank, 1))
            await ckpt.wait()
        await lose(root, rank, lost)
        async with Job(root, rank) as ckpt:
            dest = like(rank_state(rank, 1))
            got = await ckpt.restore(into=dest)
    finally:
        logger.removeHandler(handler)
    want = rank_state(rank, 1)
    return {
        "filled": all(torch.equal(dest["model"][k], want["model"][k]) for k in want["model"]),
        "same_objects": all(got["model"][k] is dest["model"][k] for k in want["model"]),
        "step": got["step"],
        "same_shape": any(SAME_SHAPE in m for m in records),
    }


def test_a_lost_rank_gets_its_replica_into_a_tree_of_the_same_shape_at_a_glance(tmp_path: Path) -> None:
    results = [r.unwrap() for r in run_group(2, collective_same_shape_target, str(tmp_path), 1, timeout=60)]
    for rank, value in enumerate(results):
        assert value == {"filled": True, "same_objects": True, "step": 1, "same_shape": True}, rank


@pytest.mark.anyio
async def test_a_restore_that_ends_before_any_copy_is_matched_names_every_tensor_untouched(
    tmp_path: Path,
) -> None:
    """The tree is planned only for a copy that needs it: a restore that finds none still
    names the caller's tensors in its report, in the tree's order."""
    dest = like(every_dtype(7))
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(astage.ResourceError) as info:
            await ckpt.restore(into=dest)
    report: FillReport = info.value.fill_report  # type: ignore[attr-defined]
    assert report.filled == ()
    assert report.partial == ()
    assert report.untouched == tuple(flat_tensors(dest))
    assert any("0 tensor(s) filled, 0 written in part" in note for note in info.value.__notes__)
