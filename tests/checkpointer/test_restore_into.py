"""``Checkpointer.restore(into=state_dict)``: the checkpoint's bytes in the caller's own tensors.

Real files, a real Checkpointer, real gloo groups for the collective restore.  Every dtype
the format stores and every layout family (contiguous, views sharing a storage, windows of a
larger storage, non-contiguous destinations, expanded, 0-d, empty, conjugate and negative
bits, Parameters) is filled bit-exact; the returned tree holds the caller's tensor objects;
a destination that does not fit is refused with its key path before any byte is written; a
restore that fails or is cancelled half-way says which tensors it filled.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import astage
from astage._checkpointer import restore_into
from astage._checkpointer.destination import DestinationMismatchError, Mode
from astage._checkpointer.restore_into import FillReport
from astage._files import body_reads
from astage._format.spec import DTYPES
from astage._util.errors import format_key_path
from tests.checkpointer.test_checkpointer import DirectoryReplicator
from tests.checkpointer.test_collective_restore import Job, lose
from tests.distributed import run_group
from tests.helpers import no_blocking_calls_on_the_loop, run_cancelled_at  # noqa: F401 - autouse fixture

# -- building sources and destinations ------------------------------------------------------------


def bits(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` with random bits (bools 0 or 1), NaN payloads included."""
    if not numel:
        return torch.empty(0, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 2 if dtype is torch.bool else 256, numel * dtype.itemsize)
    return torch.from_numpy(raw.astype(np.uint8)).view(dtype)


def families(dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """One dtype's layout families, as a source state would hold them."""
    base = bits(dtype, 20, seed).view(4, 5)
    flat = bits(dtype, 12, seed + 1)
    out: dict[str, Any] = {
        "plain": bits(dtype, 6, seed + 2).view(2, 3),
        "scalar": bits(dtype, 1, seed + 3).view(()),
        "empty": bits(dtype, 0, seed).view(0, 3),
        "shared": base,
        "shared_t": base.t(),
        "window": bits(dtype, 20, seed + 4).view(4, 5)[1:3, 1:4],
        "expanded": bits(dtype, 4, seed + 5).expand(3, 4),
        "flat_a": flat[:6].view(2, 3),
        "flat_b": flat[6:].view(3, 2),
        "strided": bits(dtype, 12, seed + 6).view(3, 4),
        "split": (split := bits(dtype, 6, seed + 9).view(2, 3)),
        "split_t": split.t(),  # one storage in the file, two in the destination
    }
    if dtype.is_complex:
        out["conj"] = bits(dtype, 6, seed + 7).conj()
    out["neg"] = torch._neg_view(bits(dtype, 5, seed + 8))
    return out


def destination_families(dtype: torch.dtype) -> dict[str, Any]:
    """Fresh tensors for :func:`families`, filled with a sentinel; some laid out otherwise."""
    base = torch.empty(4, 5, dtype=dtype)
    flat = torch.empty(12, dtype=dtype)  # the file's two storages land in one of the caller's
    out: dict[str, Any] = {
        "plain": torch.empty(2, 3, dtype=dtype),
        "scalar": torch.empty((), dtype=dtype),
        "empty": torch.empty(0, 3, dtype=dtype),
        "shared": base,
        "shared_t": base.t(),
        "window": torch.empty(2, 3, dtype=dtype),
        "expanded": torch.empty(4, dtype=dtype).expand(3, 4),
        "flat_a": flat[6:].view(2, 3),
        "flat_b": flat[:6].view(3, 2),
        "strided": torch.empty(4, 3, dtype=dtype).t(),  # column-major where the file is row-major
        "split": torch.empty(2, 3, dtype=dtype),
        "split_t": torch.empty(3, 2, dtype=dtype),
    }
    if dtype.is_complex:
        out["conj"] = torch.empty(6, dtype=dtype).conj()
    out["neg"] = torch._neg_view(torch.empty(5, dtype=dtype))
    for t in out.values():
        raw(t).fill_(0x5A)
    return out


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s own bytes, flags stripped, as a writable uint8 view of its storage."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def elements(t: torch.Tensor) -> bytes:
    """The raw bits of each element of ``t`` in index order (flags stripped, not applied)."""
    if t.is_conj():
        t = t.conj()
    if t.is_neg():
        t = torch._neg_view(t)
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def source_state(seed: int = 0) -> dict[str, Any]:
    model = {name: families(dtype, seed + 100 * i) for i, (name, dtype) in enumerate(sorted(DTYPES.items()))}
    weight = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)))
    return {
        "model": model,
        "param": weight,
        "optim": {"state": {0: {"step": 12, "exp_avg": torch.full((3, 4), float(seed))}}, "lr": 0.5},
        "rng": {"torch": torch.get_rng_state(), "numpy": np.arange(4, dtype=np.int64) + seed},
        "blob": io.BytesIO(b"opaque %d" % seed),
        "meta": [seed, "text", None, b"bytes", 2.5],
    }


def destination_state() -> dict[str, Any]:
    model = {name: destination_families(dtype) for name, dtype in sorted(DTYPES.items())}
    return {
        "model": model,
        "param": torch.nn.Parameter(torch.zeros(3, 4)),
        "optim": {"state": {0: {"exp_avg": torch.zeros(3, 4)}}},
        "rng": {"torch": torch.zeros_like(torch.get_rng_state())},
    }


def tensors_by_path(tree: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {path: tree}
    if isinstance(tree, dict):
        return {p: t for k, v in tree.items() for p, t in tensors_by_path(v, (*path, k)).items()}
    return {}


def at(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def assert_filled(dest: Any, source: Any, paths: Any = None) -> None:
    for path, t in tensors_by_path(dest).items():
        if paths is None or path in paths:
            assert elements(t) == elements(at(source, path)), format_key_path(path)


async def saved(directory: Path, state: Any, step: int = 1) -> None:
    async with astage.Checkpointer(directory) as ckpt:
        await (await ckpt.save(step, state)).wait()


# -- filling --------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_every_dtype_and_layout_is_filled_bit_exact_into_the_callers_tensors(tmp_path: Path) -> None:
    source = source_state(1)
    await saved(tmp_path, source)
    dest = destination_state()
    before = {path: (id(t), t.data_ptr(), t.stride()) for path, t in tensors_by_path(dest).items()}
    async with astage.Checkpointer(tmp_path) as ckpt:
        got = await ckpt.restore(into=dest)
    assert_filled(dest, source)
    for path, t in tensors_by_path(dest).items():
        assert (id(t), t.data_ptr(), t.stride()) == before[path], path  # filled in place, same layout
        assert at(got, path) is t, path  # the returned tree holds the caller's objects
    assert got["param"] is dest["param"]
    assert got["param"].requires_grad
    # Non-tensor leaves come from the checkpoint, new.
    assert got["optim"]["state"][0]["step"] == 12
    assert got["optim"]["lr"] == 0.5
    assert got["meta"] == source["meta"]
    assert np.array_equal(got["rng"]["numpy"], source["rng"]["numpy"])
    assert got["blob"].getvalue() == source["blob"].getvalue()
    # Storages shared in the caller's tree stay shared: one storage filled once.
    shared = dest["model"]["float32"]
    assert shared["shared_t"].untyped_storage().data_ptr() == shared["shared"].untyped_storage().data_ptr()


@pytest.mark.anyio
async def test_a_replica_fills_the_destination_when_the_own_file_is_gone(tmp_path: Path) -> None:
    peer, directory = tmp_path / "peer", tmp_path / "ckpt"
    source = source_state(2)
    async with astage.Checkpointer(
        directory, replication=DirectoryReplicator(peer), fallback_dirs=[peer]
    ) as ckpt:
        await (await ckpt.save(4, source)).wait()
    (directory / "step_0000000004" / "rank00000.astage").unlink()
    dest = destination_state()
    async with astage.Checkpointer(directory, fallback_dirs=[peer]) as ckpt:
        got = await ckpt.restore(4, into=dest)
    assert_filled(dest, source)
    assert got["model"]["int8"]["plain"] is dest["model"]["int8"]["plain"]


@pytest.mark.anyio
async def test_restore_without_a_destination_still_builds_new_tensors(tmp_path: Path) -> None:
    source = source_state(3)
    await saved(tmp_path, source)
    async with astage.Checkpointer(tmp_path) as ckpt:
        got = await ckpt.restore()
    for path, t in tensors_by_path(source).items():
        assert elements(at(got, path)) == elements(t), path
        assert at(got, path).stride() == t.stride(), path


# -- refusing ---------------------------------------------------------------------------------------


def _shape(dest: Any) -> None:
    dest["model"]["float32"]["plain"] = torch.zeros(3, 2)


def _dtype(dest: Any) -> None:
    dest["model"]["float32"]["plain"] = torch.zeros(2, 3, dtype=torch.float64)


def _missing(dest: Any) -> None:
    del dest["model"]["float32"]["plain"]


def _unexpected(dest: Any) -> None:
    dest["model"]["float32"]["extra"] = torch.zeros(2)


def _conj(dest: Any) -> None:
    dest["model"]["complex64"]["conj"] = torch.zeros(6, dtype=torch.complex64)


def _overlap(dest: Any) -> None:
    dest["model"]["float32"]["window"] = torch.zeros(1, 3).expand(2, 3)


def _tensor_for_array(dest: Any) -> None:
    dest["rng"]["numpy"] = torch.zeros(4, dtype=torch.int64)


MISMATCHES = {
    "shape": (_shape, ("model", "float32", "plain"), "expected a float32 tensor of shape (2, 3), found"),
    "dtype": (_dtype, ("model", "float32", "plain"), "found a float64 tensor"),
    "missing": (_missing, ("model", "float32", "plain"), "missing from the destination"),
    "unexpected": (_unexpected, ("model", "float32", "extra"), "unexpected"),
    "conj": (_conj, ("model", "complex64", "conj"), "conjugate bit"),
    "overlap": (_overlap, ("model", "float32", "window"), "overlaps itself"),
    "array": (_tensor_for_array, ("rng", "numpy"), "numpy array"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", sorted(MISMATCHES))
async def test_a_destination_that_does_not_fit_is_refused_with_its_key_path_before_any_write(
    tmp_path: Path, case: str
) -> None:
    change, path, words = MISMATCHES[case]
    await saved(tmp_path, source_state(4))
    dest = destination_state()
    change(dest)
    snapshot = {p: elements(t) for p, t in tensors_by_path(dest).items()}
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(DestinationMismatchError) as info:
            await ckpt.restore(into=dest)
        assert ckpt.latest() == 1  # still usable: a fitting destination restores
        await ckpt.restore(into=destination_state())
    exc = info.value
    assert isinstance(exc, astage.AstageError)
    assert isinstance(exc, TypeError)
    assert exc.key_path == path
    assert words in str(exc), str(exc)
    assert format_key_path(path) in str(exc)
    assert {p: elements(t) for p, t in tensors_by_path(dest).items()} == snapshot  # nothing written
    report = exc.fill_report  # type: ignore[attr-defined]
    assert isinstance(report, FillReport)
    assert report.filled == ()
    assert report.partial == ()


# -- failing half-way -------------------------------------------------------------------------------


def three_storages(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    # Each larger than one read batch: the read of one never writes into the next.
    return {name: torch.randn(1 << 20, generator=g) for name in ("a", "b", "c")}


def flip_byte_of(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.anyio
async def test_a_corrupt_copy_says_which_tensors_it_filled_and_a_good_one_fills_them_all(
    tmp_path: Path,
) -> None:
    peer, directory = tmp_path / "peer", tmp_path / "ckpt"
    source = three_storages(5)
    async with astage.Checkpointer(directory, replication=DirectoryReplicator(peer)) as ckpt:
        await (await ckpt.save(1, source)).wait()
    own = directory / "step_0000000001" / "rank00000.astage"
    flip_byte_of(own, (4 << 20) + 100)  # inside "b", the second of three storages
    dest = {name: torch.zeros(1 << 20) for name in "abc"}
    async with astage.Checkpointer(directory) as ckpt:  # no replica to fall back on
        with pytest.raises(astage.IntegrityError) as info:
            await ckpt.restore(into=dest)
    report = info.value.fill_report  # type: ignore[attr-defined]
    assert report.filled == (("a",),)
    assert report.partial == (("b",),)
    assert report.untouched == (("c",),)
    assert any("1 tensor(s) filled, 1 written in part, 1 untouched" in note for note in info.value.__notes__)
    assert torch.equal(dest["a"], source["a"])
    assert not dest["c"].any()
    # With the replica at hand the same restore fills everything, the bad copy overwritten.
    async with astage.Checkpointer(directory, fallback_dirs=[peer]) as ckpt:
        got = await ckpt.restore(into=dest)
    assert all(torch.equal(dest[k], source[k]) and got[k] is dest[k] for k in "abc")


@pytest.mark.anyio
async def test_a_restore_cancelled_at_every_await_reports_what_it_left_in_the_destination(
    tmp_path: Path,
) -> None:
    source = source_state(6)
    await saved(tmp_path, source)
    reports: list[FillReport] = []
    points = 0
    async with astage.Checkpointer(tmp_path) as ckpt:
        while True:
            dest = destination_state()
            untouched = {p: elements(t) for p, t in tensors_by_path(dest).items()}

            async def restore(dest: Any = dest) -> Any:
                try:
                    return await ckpt.restore(into=dest)
                except BaseException as exc:
                    reports.append(exc.fill_report)  # type: ignore[attr-defined]
                    raise

            outcome = await run_cancelled_at(points, restore)
            if not outcome.cancelled:
                break
            report = reports[-1]
            assert_filled(dest, source, set(report.filled))
            for path in untouched.keys() - {*report.filled, *report.partial}:  # not said written
                assert elements(at(dest, path)) == untouched[path], (points, path)
            points += 1
            assert points < 2000
        assert_filled(dest, source)
        assert outcome.value["model"]["uint8"]["plain"] is dest["model"]["uint8"]["plain"]
    assert points >= 3, points


# -- the collective restore -------------------------------------------------------------------------


def rank_source(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    base = torch.randn(60, generator=g)
    return {
        "model": {"w": base.view(6, 10), "w_t": base.view(6, 10).t(), "b": torch.arange(rank, rank + 5)},
        "step": step,
    }


def rank_destination() -> dict[str, Any]:
    base = torch.zeros(6, 10)
    return {"model": {"w": base, "w_t": base.t(), "b": torch.zeros(5, dtype=torch.int64)}}


async def collective_into_target(rank: int, world: int, root: str, lost: int) -> dict[str, Any]:
    async with Job(root, rank) as ckpt:
        for step in (1, 2):
            await ckpt.save(step, rank_source(rank, step))
        await ckpt.wait()
    await lose(root, rank, lost)
    out: dict[str, Any] = {}
    async with Job(root, rank) as ckpt:
        dest = rank_destination()
        got = await ckpt.restore(into=dest)
        want = rank_source(rank, 2)
        out["filled"] = all(torch.equal(dest["model"][k], want["model"][k]) for k in ("w", "w_t", "b"))
        out["same_objects"] = all(got["model"][k] is dest["model"][k] for k in ("w", "w_t", "b"))
        out["step"] = got["step"]
        out["steps"] = ckpt.steps()
        try:  # a destination that does not fit: refused on every rank, the group still usable
            await ckpt.restore(into={"model": {"w": torch.zeros(3)}})
        except DestinationMismatchError as exc:
            out["refused"] = format_key_path(exc.key_path)
        out["again"] = (
            rank_source(rank, 2)["model"]["b"].tolist() == (await ckpt.restore())["model"]["b"].tolist()
        )
    return out


@pytest.mark.parametrize(("lost", "backend"), [(1, "asyncio"), (0, "trio")])
def test_a_lost_rank_gets_its_peers_replica_into_its_own_tensors(
    tmp_path: Path, lost: int, backend: str
) -> None:
    results = [
        r.unwrap()
        for r in run_group(2, collective_into_target, str(tmp_path), lost, timeout=60, backend=backend)
    ]
    for rank, value in enumerate(results):
        assert value["filled"], (rank, value)
        assert value["same_objects"], (rank, value)
        assert value["step"] == 2, (rank, value)
        assert value["steps"] == ([2] if rank == lost else [1, 2]), (rank, value)  # healed
        assert value["refused"] == "state_dict['model']['w']", (rank, value)
        assert value["again"], rank


# -- accelerators -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.anyio
async def test_cuda_tensors_are_filled_through_pinned_buffers(tmp_path: Path) -> None:
    source = {
        "big": torch.randn(40 << 20),  # spans windows of pinned buffers
        "small": torch.randn(3, 4),
        "window": torch.randn(8, 8)[2:5, 1:4],
        "step": 3,
    }
    await saved(tmp_path, source)
    dest = {
        "big": torch.zeros(40 << 20, device="cuda"),
        "small": torch.zeros(4, 3, device="cuda").t(),
        "window": torch.zeros(3, 3, device="cuda"),
    }
    async with astage.Checkpointer(tmp_path) as ckpt:
        got = await ckpt.restore(into=dest)
    for k in ("big", "small", "window"):
        assert got[k] is dest[k], k
        assert torch.equal(dest[k].cpu(), source[k]), k
    assert got["step"] == 3


def as_device_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every CPU target through the accelerator path (windows of pooled buffers)."""
    match = restore_into.Destination.match

    async def as_device(self: restore_into.Destination, header: Any) -> Any:
        fill = await match(self, header)
        fill.storages = [
            f._replace(mode=Mode.DEVICE) if f.mode in (Mode.DIRECT, Mode.BOUNCE) else f for f in fill.storages
        ]
        return fill

    monkeypatch.setattr(restore_into.Destination, "match", as_device)
    monkeypatch.setattr(restore_into, "WINDOW_BYTES", 256)  # many windows, a buffer each


@pytest.mark.anyio
async def test_a_corrupt_copy_on_the_windowed_path_is_its_integrity_error_with_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = three_storages(8)
    await saved(tmp_path, source)
    flip_byte_of(tmp_path / "step_0000000001" / "rank00000.astage", (4 << 20) + 100)  # inside "b"
    as_device_targets(monkeypatch)
    dest = {name: torch.zeros(1 << 20) for name in "abc"}
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(astage.IntegrityError) as info:  # itself, not a group of it
            await ckpt.restore(into=dest)
    report = info.value.fill_report  # type: ignore[attr-defined]
    assert report.filled == (("a",),)
    assert report.partial == ()  # verified in its pinned buffer: the bad bytes never reach "b"
    assert report.untouched == (("b",), ("c",))
    assert torch.equal(dest["a"], source["a"])
    assert not dest["b"].any()
    assert not dest["c"].any()


@pytest.mark.anyio
async def test_the_windowed_pinned_path_fills_bit_exact_on_the_cpu_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The accelerator path (windows of pooled buffers, copies after each window's storages
    are verified, buffers given back once their copies are done) run with CPU tensors as its
    targets: what the GPU-marked test runs, checked on any machine."""
    source = source_state(7)
    await saved(tmp_path, source)
    as_device_targets(monkeypatch)
    dest = destination_state()
    async with astage.Checkpointer(tmp_path) as ckpt:
        got = await ckpt.restore(into=dest)
    assert_filled(dest, source)
    assert got["model"]["float16"]["window"] is dest["model"]["float16"]["window"]


@pytest.mark.anyio
async def test_the_windowed_path_stays_under_the_staging_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pinned buffers on their way to a device are the staging buffers of a restore: under a
    cap smaller than two default windows, the windows shrink to fit and the fill is whole."""
    source = source_state(8)
    await saved(tmp_path, source)
    as_device_targets(monkeypatch)
    monkeypatch.setattr(restore_into, "WINDOW_BYTES", 64 << 20)  # the default: two would pass the cap
    leased: list[int] = []
    acquire = restore_into.BufferPool.acquire

    async def counted(self: Any, sizes: Any, **kwargs: Any) -> Any:
        leased.append(sum(sizes))
        return await acquire(self, sizes, **kwargs)

    monkeypatch.setattr(restore_into.BufferPool, "acquire", counted)
    cap = 16 << 10  # above the largest storage (the RNG state, ~5 KB), far below 2 x 64 MiB
    stager = astage.DefaultStager(astage.StagingOptions(max_staging_bytes=cap))
    dest = destination_state()
    async with stager, astage.Checkpointer(tmp_path, stager=stager) as ckpt:
        await ckpt.restore(into=dest)
    assert_filled(dest, source)
    assert len(leased) > 2, leased  # many small windows, not one of 64 MiB
    assert max(leased) <= cap, leased


@pytest.mark.anyio
async def test_a_storage_bigger_than_the_staging_cap_is_refused_before_a_byte_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = {"small": torch.ones(4), "big": torch.arange(1000, dtype=torch.float64)}
    await saved(tmp_path, source)
    as_device_targets(monkeypatch)
    dest = {"small": torch.zeros(4), "big": torch.zeros(1000, dtype=torch.float64)}
    stager = astage.DefaultStager(astage.StagingOptions(max_staging_bytes=1024))
    async with stager, astage.Checkpointer(tmp_path, stager=stager) as ckpt:
        with pytest.raises(astage.CapacityError, match=r"\['big'\].*max_staging_bytes=1,024") as info:
            await ckpt.restore(into=dest)
        assert info.value.fill_report.untouched == (("small",), ("big",))  # type: ignore[attr-defined]
        assert bool((dest["big"] == 0).all())
        assert bool((dest["small"] == 0).all())
        got = await ckpt.restore()  # the Checkpointer is usable: a restore without a destination
    assert torch.equal(got["big"], source["big"])


@pytest.mark.anyio
async def test_dtensors_and_parameters_are_filled_through_their_local_tensors(
    one_rank_group: None, tmp_path: Path
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (1,))
    g = torch.Generator().manual_seed(9)
    source = {
        "w": DTensor.from_local(torch.randn(4, 6, generator=g), mesh, [Shard(0)], run_check=False),
        "p": torch.nn.Parameter(torch.randn(5, generator=g)),
        "r": DTensor.from_local(torch.randn(3, generator=g), mesh, [Replicate()], run_check=False),
    }
    await saved(tmp_path, source)
    dest = {
        "w": DTensor.from_local(torch.zeros(4, 6), mesh, [Shard(0)], run_check=False),
        "p": torch.nn.Parameter(torch.zeros(5)),
        "r": DTensor.from_local(torch.zeros(3), mesh, [Replicate()], run_check=False),
    }
    async with astage.Checkpointer(tmp_path) as ckpt:
        got = await ckpt.restore(into=dest)
    for key in ("w", "r"):
        assert got[key] is dest[key]  # the caller's DTensor itself, its local shard filled
        assert torch.equal(dest[key].to_local(), source[key].to_local()), key
    assert got["p"] is dest["p"]
    assert torch.equal(dest["p"].detach(), source["p"].detach())


@pytest.mark.anyio
async def test_a_restore_into_a_populated_body_is_bit_exact_and_cancellable_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``restore()`` without a destination, its body faulted in first (as for bodies of 64
    MiB and more), here for any size."""
    monkeypatch.setattr(body_reads, "POPULATE_MIN_BYTES", 0)
    source = source_state(10)
    await saved(tmp_path, source)
    async with astage.Checkpointer(tmp_path) as ckpt:
        points = 0
        while (outcome := await run_cancelled_at(points, ckpt.restore)).cancelled:
            points += 1
            assert points < 2000
        got = outcome.value
    assert points >= 3, points
    for path, t in tensors_by_path(source).items():
        assert elements(at(got, path)) == elements(t), path
