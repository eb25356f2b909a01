"""What the writer accepts the reader reads back bit-exact; what the reader refuses the writer
refuses first, with its key path.

Encode -> parse -> decode over every allow-listed dtype, every flag torch lets a tensor
carry (conjugate, negative, requires_grad), strided layouts (non-contiguous, offset,
expanded, overlapping, empty, 0-d), kinds (tensor, Parameter, ndarray), DTensor notes and
tree sizes up to thousands of DTensors; the table-level rule checked on both sides for
every dtype x kind x flag bits, including those torch never makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import astage
from astage._format.codec import DTYPES, NUMPY_DTYPES, decode, encode, lay_out, parse_prefix
from astage._format.encoder import lay_out_planned_in_slices
from astage._format.header_cache import HeaderCache
from astage._format.spec import FLAG_CONJ, FLAG_NEG, FLAG_REQUIRES_GRAD, allowed_flags, tensor_refused
from astage._format.tree_encoder import TreeEncoder
from astage._staging.plan import DictNode, StagePlan, StorageSpec, TensorKind, TensorNode, TensorSpec
from astage._util.timeslice import drive
from tests.format.test_format import _table_edit

_SCALE = max(1, int(os.environ.get("ASTAGE_SOAK_SCALE", "1")))
_CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


# -- building sources -----------------------------------------------------------------------


def _buffer(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` with random bits (bools 0 or 1)."""
    gen = np.random.default_rng(seed)
    raw = gen.integers(0, 2 if dtype is torch.bool else 256, numel * dtype.itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype)


@st.composite
def _tensors(draw: st.DrawFn, mesh: DeviceMesh | None) -> Any:
    """A source value: a tensor, Parameter, ndarray or DTensor, any strided layout and flags."""
    name = draw(st.sampled_from(sorted(DTYPES)))
    dtype = DTYPES[name]
    ndim = draw(st.integers(0, 3))
    size = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    stride = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    offset = draw(st.integers(0, 5))
    reach = offset + (0 if 0 in size else sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1)
    base = _buffer(dtype, reach + draw(st.integers(1, 3)), draw(st.integers(0, 2**32 - 1)))
    t = base.as_strided(size, stride, offset)
    kind = draw(st.sampled_from(["tensor", "parameter", "ndarray", "dtensor"]))
    if kind == "ndarray":
        if name not in NUMPY_DTYPES:
            kind = "tensor"
        else:
            return t.numpy()
    flags = draw(st.integers(0, 7)) & allowed_flags(dtype)
    if flags & FLAG_CONJ:
        t = t.conj()
    if flags & FLAG_NEG:
        t = torch._neg_view(t)
    grad = bool(flags & FLAG_REQUIRES_GRAD)
    if kind == "parameter":
        return torch.nn.Parameter(t, requires_grad=grad)
    if grad:
        t.requires_grad_()
    if kind == "dtensor" and mesh is not None and t.dim() > 0:
        placements = [Shard(0)] if draw(st.booleans()) else [Replicate()]
        return DTensor.from_local(t, mesh, placements, run_check=False)
    return t


def _trees(mesh: DeviceMesh | None) -> st.SearchStrategy[Any]:
    leaves = _tensors(mesh)
    return st.one_of(
        st.dictionaries(st.text(max_size=3), leaves, max_size=6),
        st.lists(leaves, max_size=6).map(lambda items: {"l": items, "t": tuple(items[:2])}),
        leaves.map(lambda t: {"same": t, "again": t}),  # one tensor met twice
    )


# -- comparing --------------------------------------------------------------------------------


def _storage_bytes(t: torch.Tensor) -> bytes:
    storage = t.untyped_storage()
    return bytes(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()) if storage.nbytes() else b""


def _expected(value: Any, locals_: dict[int, torch.Tensor] | None = None) -> Any:
    """What a file gives back for a source value: a DTensor as its local tensor (one object
    for one DTensor met twice)."""
    locals_ = {} if locals_ is None else locals_
    if isinstance(value, DTensor):
        return locals_.setdefault(id(value), value.to_local())
    if isinstance(value, dict):
        return {key: _expected(v, locals_) for key, v in value.items()}
    if isinstance(value, list):
        return [_expected(v, locals_) for v in value]
    if isinstance(value, tuple):
        return tuple(_expected(v, locals_) for v in value)
    return value


def _assert_bit_exact(got: Any, want: Any, path: str = "") -> None:
    assert type(got) is type(want), path
    if isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, torch.Tensor):
        meta = (want.dtype, want.shape, want.stride(), want.storage_offset())
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == meta, path
        assert (got.is_conj(), got.is_neg(), got.requires_grad) == (
            want.is_conj(),
            want.is_neg(),
            want.requires_grad,
        ), path
        assert _storage_bytes(got) == _storage_bytes(want), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            _assert_bit_exact(got[key], want[key], f"{path}/{key!r}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _assert_bit_exact(a, b, f"{path}/{i}")
    else:
        assert got == want, path


def _identities(tree: Any) -> list[int]:
    """Where each tensor leaf's object is first met, in walk order: aliasing, as positions."""
    seen: dict[int, int] = {}
    out: list[int] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)
        elif isinstance(value, torch.Tensor | np.ndarray):
            out.append(seen.setdefault(id(value), len(out)))

    walk(tree)
    return out


def _round_trip(state: Any) -> tuple[Any, Any]:
    """``state`` encoded, parsed (by parse_prefix and as a replica holder parses) and decoded."""
    encoded = encode(state, owner_rank=0, step=1, checkpoint_id="property")
    data = b"".join(encoded.buffers())
    header = parse_prefix(data)
    assert HeaderCache().parse(data).plan == header.plan
    raw = bytearray(data[header.prefix_nbytes :])
    body = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return header, decode(header, body)


def _check(state: Any) -> None:
    try:
        header, back = _round_trip(state)
    except astage.UnsupportedInputError:
        pytest.fail("the writer refused a value made only of what it stores")
    _assert_bit_exact(back, _expected(state))
    assert _identities(back) == _identities(_expected(state))
    notes = [note for note in header.dtensors if note is not None]
    dtensors = [v for v in _leaves(state) if isinstance(v, DTensor)]
    assert len(notes) == len({id(v) for v in dtensors})
    for note, dt in zip(notes, dict.fromkeys(dtensors), strict=True):
        assert note.placements == repr(tuple(dt.placements))
        assert note.global_shape == tuple(dt.shape)


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


# -- the properties -----------------------------------------------------------------------------


@settings(
    max_examples=150 * _SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_whatever_the_writer_accepts_reads_back_bit_exact(mesh: DeviceMesh, data: st.DataObject) -> None:
    _check(data.draw(_trees(mesh)))


def test_a_negative_bit_reads_back_on_every_dtype() -> None:
    # An int64 negative view was written and then refused by the reader ("only floating or
    # complex tensors have a negative bit"): the two sides kept two lists.
    state = {name: torch._neg_view(_buffer(dtype, 3, i)) for i, (name, dtype) in enumerate(DTYPES.items())}
    _check(state)
    _, back = _round_trip({"i": torch._neg_view(torch.arange(4))})
    assert back["i"].is_neg()
    assert torch.equal(back["i"], torch._neg_view(torch.arange(4)))


@pytest.mark.parametrize("count", [1, 250, 300, 3_000 * _SCALE])
def test_thousands_of_dtensors_read_back_with_their_notes(mesh: DeviceMesh, count: int) -> None:
    state = {
        "model": {
            f"layer{i}.weight": DTensor.from_local(_buffer(torch.float32, 6, i).view(2, 3), mesh, [Shard(0)])
            for i in range(count)
        },
        "optim": {f"{i}": {"step": torch.tensor(float(i)), "exp_avg": torch.zeros(2)} for i in range(count)},
    }
    _check(state)


_KINDS = (TensorKind.TENSOR, TensorKind.PARAMETER, TensorKind.NDARRAY)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_the_reader_refuses_exactly_what_the_writer_refuses(name: str) -> None:
    # Every dtype x kind x flag bits, torch-made or not: the writer's walk refuses with the
    # key path exactly where the reader's table check refuses the record.
    dtype = DTYPES[name]
    for kind in _KINDS:
        for bits in range(8):
            spec = TensorSpec(
                ("x",),
                0,
                dtype,
                (1,),
                (1,),
                0,
                kind,
                bool(bits & FLAG_REQUIRES_GRAD),
                bool(bits & FLAG_CONJ),
                bool(bits & FLAG_NEG),
            )
            plan = StagePlan(
                DictNode(0, ("x",), (TensorNode(0),), None, ()), (spec,), (StorageSpec(dtype.itemsize, _CPU),)
            )
            why = tensor_refused(dtype, kind, bits)
            writer = contextlib.nullcontext() if why is None else pytest.raises(astage.UnsupportedInputError)
            with writer as refused:
                drive(TreeEncoder(plan).node(plan.root, (), 0))
            if refused is not None:
                assert refused.value.key_path == ("x",)
            assert _reader_accepts(dtype, kind, bits) is (why is None), (name, kind, bits, why)


def _reader_accepts(dtype: torch.dtype, kind: TensorKind, bits: int) -> bool:
    """Whether a file whose one record has this dtype, kind and flags parses."""
    codes = list(DTYPES.values())

    def edit(counts: list[int], tensors: Any, dims: Any, storages: Any) -> None:
        tensors["dtype"][0] = codes.index(dtype)
        tensors["kind"][0] = _KINDS.index(kind)
        tensors["flags"][0] = bits

    data = _table_edit(edit, {"x": torch.zeros(16, dtype=torch.uint8)[:1]})  # room for any dtype
    assert struct.unpack_from("<Q", data, 20)[0] == 1  # one tensor in the table
    try:
        parse_prefix(data)
    except astage.IntegrityError:
        return False
    return True


@pytest.mark.anyio
async def test_a_negative_integer_view_saved_by_the_checkpointer_restores(tmp_path: Path) -> None:
    # Main: save() committed and restore() raised IntegrityError "only floating or complex
    # tensors have a negative bit".
    source = torch._neg_view(torch.arange(4))
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(1, {"i": source, "b": torch._neg_view(torch.tensor([True, False]))})
        await ckpt.wait()
    async with astage.Checkpointer(tmp_path) as again:
        back = await again.restore(1)
    assert back["i"].is_neg()
    assert torch.equal(back["i"], source)
    assert back["b"].is_neg()
    assert _storage_bytes(back["b"]) == b"\x01\x00"


# -- a staged copy laid out from its stage's plan ----------------------------------------------


def _laid_out_both_ways(state: Any) -> tuple[bytes | str | None, bytes | str]:
    """The file of a first stage of ``state`` laid out from the plan the stage carries and
    by walking the copy: its bytes, or the error it raised; ``None`` where the stage carries
    no plan."""

    def outcome(make: Any) -> bytes | str:
        try:
            layout = dataclasses.replace(make(), created=1.0)
        except astage.UnsupportedInputError as exc:
            return f"refused: {exc}"
        return b"".join(bytes(b) for b in layout.encode().buffers())

    async def stage() -> tuple[bytes | str | None, bytes | str]:
        async with astage.DefaultStager() as stager:
            staged, _, planned = await stager.stage_planned(state)
            walked = outcome(lambda: lay_out(staged, owner_rank=0, step=1, checkpoint_id="plan"))
            if planned is None:
                return None, walked
            steps = lay_out_planned_in_slices(planned, owner_rank=0, step=1, checkpoint_id="plan")
            return outcome(lambda: drive(steps)), walked

    return asyncio.run(stage())


@settings(
    max_examples=100 * _SCALE,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_a_copy_laid_out_from_its_stage_plan_is_the_file_a_walk_of_it_makes(
    mesh: DeviceMesh, data: st.DataObject
) -> None:
    state = data.draw(_trees(mesh))
    state["scalars"] = {"lr": 1e-3, "step": 7, "name": "run", "none": None, "flag": True}
    from_plan, walked = _laid_out_both_ways(state)
    arrays = any(isinstance(v, np.ndarray) for v in _leaves(state))
    assert (from_plan is None) == arrays  # only a deep-copied leaf keeps the plan from being carried
    if from_plan is not None:
        assert from_plan == walked


def test_a_stage_of_what_a_walk_may_plan_otherwise_carries_no_plan() -> None:
    class Holder:
        def __init__(self) -> None:
            self.w = torch.ones(2)

    tagged = torch.ones(3)
    tagged.note = "attribute"  # type: ignore[attr-defined]
    for state in (
        {"obj": Holder()},
        {"io": io.BytesIO(b"abc")},
        {"copied": np.float32(1.5)},
        {"tagged": tagged},
    ):
        assert _laid_out_both_ways(state)[0] is None, state
    assert _laid_out_both_ways({"w": torch.ones(2), "n": [1, (2, 3)]})[0] is not None


@pytest.mark.gpu
def test_a_cuda_copy_laid_out_from_its_stage_plan_is_the_file_a_walk_of_it_makes() -> None:
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(8, 6, generator=gen).cuda()
    state = {
        "w": base,
        "w_t": base.t(),
        "row": base[2],
        "p": torch.nn.Parameter(torch.randn(5, 3, generator=gen).cuda()),
        "half": torch.randn(7, generator=gen).half().cuda(),
        "cpu": torch.arange(4),
        "step": 3,
    }
    from_plan, walked = _laid_out_both_ways(state)
    assert from_plan is not None
    assert from_plan == walked
