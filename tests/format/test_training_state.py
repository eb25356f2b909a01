"""What training states hold goes into a replica and comes back exactly; the rest is refused
by ``Checkpointer.save()`` itself.

Format 2 stores numpy arrays (as raw storages) and scalars, ``torch.Size``, ``torch.dtype``,
``torch.device``, ``bytes`` and ``complex``; RNG states of torch, numpy and :mod:`random`
round-trip bit for bit.  Each kind goes through :func:`encode`/:func:`decode` and through a
real Checkpointer (real files, fsync).  A value the format cannot hold raises
:class:`UnsupportedInputError` from ``save()``, naming its key path, and nothing of it
is reported later; a failure in the background is logged in one line.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import math
import random
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import astage
from astage._format.codec import (
    FORMAT_VERSION,
    NUMPY_DTYPES,
    TENSOR_RECORD,
    decode,
    encode,
    parse_prefix,
)
from tests.forgery import header_bytes, join, split, wrap
from tests.helpers import (
    expand_tensor_runs,
    no_blocking_calls_on_the_loop,  # noqa: F401 - autouse fixture
)

# -- helpers ------------------------------------------------------------------------------


def round_trip(state: Any) -> Any:
    """``state`` through encode, the bytes, parse_prefix and decode."""
    # The views alias the storages, which the Encoded holds (a converted numpy array's
    # storage, only it): it must outlive the join.
    encoded = encode(state, owner_rank=0, step=1, checkpoint_id="t")
    data = b"".join(encoded.buffers())
    del encoded
    header = parse_prefix(data)
    body = torch.from_numpy(np.frombuffer(bytearray(data[header.prefix_nbytes :]), dtype=np.uint8))
    return decode(header, body)


def assert_exact(got: Any, want: Any, where: str = "state") -> None:
    """Equal type and bits all the way down (NaNs with their payload, -0.0 with its sign)."""
    assert type(got) is type(want), (where, type(got), type(want))
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype.newbyteorder("="), where  # native byte order
        assert got.shape == want.shape, where
        assert got.tobytes() == np.ascontiguousarray(want, dtype=got.dtype).tobytes(), where
    elif isinstance(want, np.generic):
        assert got.dtype == want.dtype, where
        assert got.tobytes() == want.tobytes(), (where, got, want)
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, where
        assert got.shape == want.shape, where
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_exact(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_exact(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want) or (math.isnan(got) and math.isnan(want))
    elif isinstance(want, complex):
        assert_exact(got.real, want.real, f"{where}.real")
        assert_exact(got.imag, want.imag, f"{where}.imag")
    else:
        assert got == want, (where, got, want)


def rng_states() -> dict[str, Any]:
    """Every RNG state a training loop saves, after some draws (torch's global one untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        torch.rand(5)
        torch_state = torch.get_rng_state()
    legacy = np.random.RandomState(4)
    legacy.standard_normal(3)  # leaves a cached gaussian: the state's float is not 0.0
    generator = np.random.default_rng(5)
    generator.random(7)
    python = random.Random(6)
    python.random()
    return {
        "torch": torch_state,
        "numpy_legacy": legacy.get_state(),
        "numpy_generator": generator.bit_generator.state,
        "python": python.getstate(),
    }


def training_state() -> dict[str, Any]:
    """A training state as people write them: every leaf kind format 2 added, and RNGs."""
    weights = torch.randn(4, 3)
    return {
        "model": {"weight": weights, "bias": torch.zeros(3)},
        "shapes": {"weight": weights.shape, "empty": torch.Size([])},
        "dtype": torch.bfloat16,
        "amp_dtype": torch.float16,
        "device": torch.device("cuda", 1),
        "cpu": torch.device("cpu"),
        "rng": rng_states(),
        "loss_history": np.array([0.5, 0.25, np.nan], dtype=np.float32),
        "best": np.float64(0.125),
        "epoch": np.int64(7),
        "done": np.bool_(False),
        "seen": np.uint64(2**64 - 1),
        "digest": b"\x00\x01\xfe\xff",
        "phase": complex(1.0, -0.0),
        "big": 2**200 + 1,
        "neg_zero": -0.0,
    }


# -- every leaf kind, through encode/decode --------------------------------------------------


_LEAVES = {
    "torch.Size": torch.Size([2, 0, 5]),
    "torch.Size()": torch.Size([]),
    "torch.dtype": torch.float8_e4m3fn,
    "torch.dtype outside the tensor allow-list": torch.complex32,
    "torch.device cuda:3": torch.device("cuda", 3),
    "torch.device cpu": torch.device("cpu"),
    "torch.device meta": torch.device("meta"),
    "bytes": bytes(range(256)),
    "empty bytes": b"",
    "complex": complex(-1.5, 2.25),
    "complex inf nan": complex(math.inf, math.nan),
    "np.bool_": np.bool_(True),
    "np.float16": np.float16(-0.0),
    "np.float32": np.float32(1) / 3,
    "np.float64 NaN payload": np.frombuffer(struct.pack("<Q", 0x7FF8_0000_0000_0ABC), np.float64)[0],
    "np.int8": np.int8(-128),
    "np.uint64": np.uint64(2**64 - 1),
    "np.complex128": np.complex128(1 - 2j),
    "np.intc": np.intc(5),
    "int 2**200": -(2**200),
    "float -0.0": -0.0,
    "np 0-d array": np.array(2.5),
    "np bool array": np.array([[True, False], [False, True]]),
    "np Fortran array": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "np strided view": np.arange(20, dtype=np.int16)[::3],
    "np transposed view": np.arange(24, dtype=np.uint32).reshape(2, 3, 4).transpose(2, 0, 1),
    "np big-endian array": np.arange(5, dtype=">f8"),
    "np read-only broadcast": np.broadcast_to(np.arange(3, dtype=np.int64), (4, 3)),
    "np empty array": np.zeros((0, 3), dtype=np.complex64),
}


@pytest.mark.parametrize("value", list(_LEAVES.values()), ids=list(_LEAVES))
def test_each_leaf_kind_round_trips_exactly(value: Any) -> None:
    assert_exact(round_trip({"x": value, "in": [value]}), {"x": value, "in": [value]})


def test_headers_say_the_current_format_whatever_the_tree_holds() -> None:
    for state in ({"w": torch.ones(2), "lr": 0.1}, {"w": np.ones(2), "shape": torch.Size([2])}):
        data = b"".join(encode(state, owner_rank=0, step=0, checkpoint_id="").buffers())
        header = parse_prefix(data)
        assert header.version == FORMAT_VERSION == 6
        assert b'{"format":6,' in data[: header.prefix_nbytes]


def test_a_dict_of_fresh_tensors_is_one_run_and_scalars_sit_in_their_table() -> None:
    state = {"layer": {"a": torch.ones(2), "b": torch.zeros(3)}, "mixed": {"c": torch.ones(1), "lr": 0.5}}
    data = b"".join(encode(state, owner_rank=0, step=0, checkpoint_id="").buffers())
    assert b'["dict",["a","b"],0]' in data  # the run: the first tensor's position alone
    assert b'["dict",["c","lr"],[["tensor",2],0]]' in data  # a mixed dict keeps its list; lr is scalar 0
    assert b'"scalars":[0.5]}' in data
    assert_exact(round_trip(state), state)


def test_rng_states_round_trip_bit_exactly_and_continue_the_same_streams() -> None:
    saved = rng_states()
    back = round_trip(saved)
    assert_exact(back, saved)
    legacy, generator, python = np.random.RandomState(), np.random.default_rng(), random.Random()
    legacy.set_state(back["numpy_legacy"])
    generator.bit_generator.state = back["numpy_generator"]
    python.setstate(back["python"])
    torch_from_back, torch_from_saved = torch.Generator(), torch.Generator()
    torch_from_back.set_state(back["torch"])
    torch_from_saved.set_state(saved["torch"])
    draws = (
        legacy.standard_normal(4),
        generator.random(4),
        python.random(),
        torch.rand(4, generator=torch_from_back),
    )
    legacy.set_state(saved["numpy_legacy"])
    generator.bit_generator.state = saved["numpy_generator"]
    python.setstate(saved["python"])
    expected = (
        legacy.standard_normal(4),
        generator.random(4),
        python.random(),
        torch.rand(4, generator=torch_from_saved),
    )
    assert_exact(list(draws), list(expected))


def test_an_array_met_twice_comes_back_as_one_array() -> None:
    array = np.arange(6)
    back = round_trip({"a": array, "b": [array], "other": array.copy()})
    assert back["a"] is back["b"][0]
    assert back["a"] is not back["other"]


_NUMPY_DTYPE_LIST = list(NUMPY_DTYPES.values())


@settings(max_examples=200, deadline=None)
@given(
    array=hnp.arrays(
        st.sampled_from(_NUMPY_DTYPE_LIST).flatmap(lambda d: st.sampled_from([d, d.newbyteorder()])),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
        elements=None,
    ),
    layout=st.sampled_from(["as is", "F", "transposed", "step", "read-only"]),
)
def test_numpy_arrays_of_every_dtype_and_layout_round_trip(array: np.ndarray[Any, Any], layout: str) -> None:
    if layout == "F":
        array = np.asfortranarray(array)
    elif layout == "transposed":
        array = array.T
    elif layout == "step" and array.ndim:
        array = array[::2]
    elif layout == "read-only":
        array.flags.writeable = False
    assert_exact(round_trip({"a": array}), {"a": array})


@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(_NUMPY_DTYPE_LIST), data=st.data())
def test_numpy_scalars_round_trip_their_exact_bits(dtype: np.dtype[Any], data: st.DataObject) -> None:
    raw = data.draw(st.binary(min_size=dtype.itemsize, max_size=dtype.itemsize))
    if dtype.kind == "b":
        raw = bytes([raw[0] & 1])
    scalar = np.frombuffer(raw, dtype)[0]
    assert_exact(round_trip({"s": scalar}), {"s": scalar})


@settings(max_examples=200, deadline=None)
@given(
    value=st.one_of(
        st.integers(-(2**4000), 2**4000),
        st.floats(allow_nan=False),
        st.complex_numbers(allow_nan=False),
        st.binary(max_size=64),
    )
)
def test_python_ints_floats_complex_and_bytes_round_trip(value: Any) -> None:
    assert_exact(round_trip({"v": value, "k": [value]}), {"v": value, "k": [value]})


# -- old files --------------------------------------------------------------------------------


def _refused_old(tmp_path: Path, data: bytes, version: int) -> None:
    """``data``, an old replica of ``version``, is refused from a real file: loaded, found
    or parsed, with an error naming its version and the one this astage reads."""
    path = tmp_path / "old.astage"
    path.write_bytes(data)
    message = rf"version {version}: this astage reads only version {FORMAT_VERSION}"
    with pytest.raises(astage.IntegrityError, match=message):
        parse_prefix(data)
    with pytest.raises(astage.IntegrityError, match=message):
        astage.load_checkpoint_file_sync(path)
    assert astage.find_replicas(tmp_path) == []  # skipped, with a warning


# A version-1 replica written by astage before format 2 (main at 2fa0a77):
# {"w": arange(6.).reshape(2, 3), "p": P(a=1, b=[2.5, nan]), "od": OrderedDict(x=tensor([True,
# False])), "alias": <w again>}, owner 3, step 7, checkpoint "v1".
_VERSION_1 = base64.b64decode(
    "QVNUQUdFAFIBAAAAmQEAAAAAAAB7ImZvcm1hdCI6MSwib3duZXJfcmFuayI6MywiaG9sZGVyX3JhbmsiOm51bGwsInN0ZXAi"
    "OjcsImNoZWNrcG9pbnRfaWQiOiJ2MSIsImNyZWF0ZWQiOjEuNSwiYm9keV9uYnl0ZXMiOjY2LCJzdG9yYWdlcyI6W1swLDI0"
    "LDIwMjA4ODMwMzddLFs2NCwyLDM4MDQ0OTE2ODVdXSwidGVuc29ycyI6W1swLCJmbG9hdDMyIixbMiwzXSxbMywxXSwwLCJ0"
    "ZW5zb3IiLGZhbHNlXSxbMSwiYm9vbCIsWzJdLFsxXSwwLCJ0ZW5zb3IiLGZhbHNlXV0sInRyZWUiOlsiZGljdCIsWyJ3Iiwi"
    "cCIsIm9kIiwiYWxpYXMiXSxbWyJ0ZW5zb3IiLDBdLFsibmFtZWR0dXBsZSIsIlAiLFsiYSIsImIiXSxbMSxbImxpc3QiLFsy"
    "LjUsWyJmbG9hdCIsIm5hbiJdXV1dXSxbIm9kaWN0IixbIngiXSxbWyJ0ZW5zb3IiLDFdXV0sWyJ0ZW5zb3IiLDBdXV19PzrM"
    "pwAAAAAAAAAAAAAAAAAAAAAAAAAAAIA/AAAAQAAAQEAAAIBAAACgQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAABAA=="
)


def test_version_1_files_are_refused(tmp_path: Path) -> None:
    # Read until format 6 (the tree, aliasing, a namedtuple with a NaN, an OrderedDict).
    _refused_old(tmp_path, _VERSION_1, 1)


# A version-2 replica written by astage before format 3 (main at 9e360b1), owner 3, step 7,
# checkpoint "v2": w = arange(6.).reshape(2, 3), {"w": w, "t": w.t(), "p": Parameter([1.5, -2.0]),
# "a": np.arange(3, dtype=int16), "n": np.float32(0.25), "b": b"xy", "c": 1+2j,
# "s": torch.Size([2, 3]), "d": torch.bfloat16, "od": OrderedDict(x=tensor([True, False]))}.
_VERSION_2 = base64.b64decode(
    "QVNUQUdFAFICAAAAkAIAAAAAAAB7ImZvcm1hdCI6Miwib3duZXJfcmFuayI6MywiaG9sZGVyX3JhbmsiOm51bGwsInN0ZXAi"
    "OjcsImNoZWNrcG9pbnRfaWQiOiJ2MiIsImNyZWF0ZWQiOjEuNSwiYm9keV9uYnl0ZXMiOjE5NCwidGVuc29ycyI6W1swLCJm"
    "bG9hdDMyIixbMiwzXSxbMywxXSwwLCJ0ZW5zb3IiLGZhbHNlXSxbMCwiZmxvYXQzMiIsWzMsMl0sWzEsM10sMCwidGVuc29y"
    "IixmYWxzZV0sWzEsImZsb2F0MzIiLFsyXSxbMV0sMCwicGFyYW1ldGVyIix0cnVlXSxbMiwiaW50MTYiLFszXSxbMV0sMCwi"
    "bmRhcnJheSIsZmFsc2VdLFszLCJib29sIixbMl0sWzFdLDAsInRlbnNvciIsZmFsc2VdXSwidHJlZSI6WyJkaWN0IixbInci"
    "LCJ0IiwicCIsImEiLCJuIiwiYiIsImMiLCJzIiwiZCIsIm9kIl0sW1sidGVuc29yIiwwXSxbInRlbnNvciIsMV0sWyJ0ZW5z"
    "b3IiLDJdLFsidGVuc29yIiwzXSxbIm51bXB5IiwiZmxvYXQzMiIsMTA0ODU3NjAwMF0sWyJieXRlcyIsImVIaz0iXSxbImNv"
    "bXBsZXgiLDEuMCwyLjBdLFsic2l6ZSIsWzIsM11dLFsiZHR5cGUiLCJiZmxvYXQxNiJdLFsib2RpY3QiLFsieCJdLFtbInRl"
    "bnNvciIsNF1dXV1dLCJzdG9yYWdlcyI6W1swLDI0LDIwMjA4ODMwMzddLFs2NCw4LDI3NTQ3ODM1MjJdLFsxMjgsNiwyOTA1"
    "MjY5OTgwXSxbMTkyLDIsMzgwNDQ5MTY4NV1dfbZs9xsAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACAPwAAAEAAAEBA"
    "AACAQAAAoEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAADAPwAAAMAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAQACAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABAA=="
)


# A version-3 replica written by astage before format 4 (main at 5a0c106), owner 3, step 7,
# checkpoint "v3": w = arange(6.).reshape(2, 3), {"layer": {"a": tensor([1., 2.]), "b":
# tensor([3.]), "c": tensor([True, False])}, "od": OrderedDict(x=tensor([1, 2], int8),
# y=tensor([0.5])) with _metadata {"": {"version": 1}}, "w": w, "t": w.t(), "mixed": {"p":
# tensor([7]), "lr": 0.25}}: dicts a version-4 header writes as tensor runs.
_VERSION_3 = base64.b64decode(
    "QVNUQUdFAFIDAAAAfAMAAAAAAAAIAAAAAAAAABQAAAAAAAAABwAAAAAAAAAAAAAAAAAAAAAAAAALAQAAAAAAAAAAAAABAAAA"
    "CwEAAAAAAAAAAAAAAgAAAAABAAAAAAAAAAAAAAMAAAACAQAAAAAAAAAAAAAEAAAACwEAAAAAAAAAAAAABQAAAAsCAAAAAAAA"
    "AAAAAAUAAAALAgAAAAAAAAAAAAAGAAAABQEAAAAAAAAAAAAAAgAAAAAAAAABAAAAAAAAAAEAAAAAAAAAAQAAAAAAAAACAAAA"
    "AAAAAAEAAAAAAAAAAgAAAAAAAAABAAAAAAAAAAEAAAAAAAAAAQAAAAAAAAACAAAAAAAAAAMAAAAAAAAAAwAAAAAAAAABAAAA"
    "AAAAAAMAAAAAAAAAAgAAAAAAAAABAAAAAAAAAAMAAAAAAAAAAQAAAAAAAAABAAAAAAAAAAAAAAAAAAAACAAAAAAAAACxycAo"
    "AAAAAEAAAAAAAAAABAAAAAAAAAB/kAv2AAAAAIAAAAAAAAAAAgAAAAAAAACl78PiAAAAAMAAAAAAAAAAAgAAAAAAAABSn/gD"
    "AAAAAAABAAAAAAAABAAAAAAAAABSPpcmAAAAAEABAAAAAAAAGAAAAAAAAABdOnR4AAAAAIABAAAAAAAACAAAAAAAAACOt3F2"
    "AAAAAHsiZm9ybWF0IjozLCJvd25lcl9yYW5rIjozLCJob2xkZXJfcmFuayI6bnVsbCwic3RlcCI6NywiY2hlY2twb2ludF9p"
    "ZCI6InYzIiwiY3JlYXRlZCI6MS41LCJib2R5X25ieXRlcyI6MzkyLCJkdGVuc29ycyI6W10sInRyZWUiOlsiZGljdCIsWyJs"
    "YXllciIsIm9kIiwidyIsInQiLCJtaXhlZCJdLFtbImRpY3QiLFsiYSIsImIiLCJjIl0sW1sidGVuc29yIiwwXSxbInRlbnNv"
    "ciIsMV0sWyJ0ZW5zb3IiLDJdXV0sWyJvZGljdCIsWyJ4IiwieSJdLFtbInRlbnNvciIsM10sWyJ0ZW5zb3IiLDRdXSx7Il9t"
    "ZXRhZGF0YSI6WyJkaWN0IixbIiJdLFtbImRpY3QiLFsidmVyc2lvbiJdLFsxXV1dXX1dLFsidGVuc29yIiw1XSxbInRlbnNv"
    "ciIsNl0sWyJkaWN0IixbInAiLCJsciJdLFtbInRlbnNvciIsN10sMC4yNV1dXV19026GxwAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACAPwAAAEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAQEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAABAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    "AQIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAD8AAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAACAPwAAAEAAAEBA"
    "AACAQAAAoEAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABwAAAAAAAAA="
)


def test_version_3_files_are_refused_and_their_state_written_now_reads_back(tmp_path: Path) -> None:
    _refused_old(tmp_path, _VERSION_3, 3)
    w = torch.arange(6.0).reshape(2, 3)
    od = collections.OrderedDict(x=torch.tensor([1, 2], dtype=torch.int8), y=torch.tensor([0.5]))
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    state = {
        "layer": {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0]), "c": torch.tensor([True, False])},
        "od": od,
        "w": w,
        "t": w.t(),
        "mixed": {"p": torch.tensor([7]), "lr": 0.25},
    }
    # The same state written now is the current version, with runs, and reads back the same.
    data = b"".join(encode(state, owner_rank=3, step=7, checkpoint_id="v3").buffers())
    assert parse_prefix(data).version == FORMAT_VERSION
    assert b'["dict",["a","b","c"],0]' in data
    back = round_trip(state)
    assert [t.tolist() for t in back["layer"].values()] == [[1.0, 2.0], [3.0], [True, False]]
    assert back["od"]._metadata == state["od"]._metadata
    assert back["mixed"]["lr"] == 0.25
    assert torch.equal(back["t"], w.t())
    assert back["t"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()


def test_version_2_files_are_refused(tmp_path: Path) -> None:
    # Read until format 6 (views, a Parameter, an ndarray, numpy and Python leaves).
    _refused_old(tmp_path, _VERSION_2, 2)


def _as_version(state: Any, version: int) -> bytes:
    """A replica of ``state`` as versions 1 and 2 wrote it: tensors and storages in the JSON,
    scalars in the tree, the JSON ``format`` equal to the binary version, no padding."""
    data = b"".join(encode(state, owner_rank=0, step=0, checkpoint_id="").buffers())
    header = parse_prefix(data)
    _, doc = split(data)
    scalars = iter(doc.pop("scalars"))
    doc["tree"] = expand_tensor_runs(doc["tree"], lambda index: next(scalars))
    names = {dtype: name for name, dtype in astage._format.codec.DTYPES.items()}
    kinds = {"TENSOR": "tensor", "PARAMETER": "parameter", "NDARRAY": "ndarray"}
    doc["tensors"] = [
        [
            t.storage,
            names[t.dtype],
            list(t.size),
            list(t.stride),
            t.offset,
            kinds[t.kind.name],
            t.requires_grad,
        ]
        for t in header.plan.tensors
    ]
    doc["storages"] = [list(s) for s in header.segments]
    del doc["dtensors"], doc["padding"]
    doc["format"] = version
    return wrap(json.dumps(doc, separators=(",", ":")).encode(), version) + data[header.prefix_nbytes :]


@pytest.mark.parametrize(
    "value",
    [np.arange(3), np.float32(1), torch.Size([1]), b"x"],
    ids=["ndarray", "np scalar", "Size", "bytes"],
)
@pytest.mark.parametrize("version", [1, 2])
def test_a_version_1_or_2_header_is_refused_whatever_nodes_it_uses(value: Any, version: int) -> None:
    # A version-1 header with version-2 nodes was refused for them ("version 2"); both
    # versions are refused whole now, before their JSON is read.
    with pytest.raises(astage.IntegrityError, match=f"version {version}: this astage reads only"):
        parse_prefix(_as_version({"v": value}, version))


# -- through the Checkpointer (real files) ------------------------------------------------------


@pytest.mark.anyio
async def test_a_training_state_round_trips_through_the_checkpointer(tmp_path: Path) -> None:
    state = training_state()
    async with astage.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state)).wait()
    async with astage.Checkpointer(tmp_path) as ckpt:
        restored = await ckpt.restore()
    assert_exact(restored, state)


class _NotStorable:
    pass


_UNSTORABLE = {
    "lambda": (lambda: 0, "function"),
    "object": (_NotStorable(), "_NotStorable"),
    "set": ({1, 2}, "set"),
    "bytearray": (bytearray(b"x"), "bytearray"),
    "float128": (np.longdouble(1), "float128"),
    "object array": (np.array([None, 1], dtype=object), "object"),
    "generator": (np.random.default_rng(0), "Generator"),
    "layout": (torch.strided, "layout"),
}


@pytest.mark.anyio
@pytest.mark.parametrize(("value", "fragment"), list(_UNSTORABLE.values()), ids=list(_UNSTORABLE))
async def test_save_refuses_what_the_format_cannot_store_and_reports_nothing_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: Any, fragment: str
) -> None:
    stager = astage.DefaultStager()
    async with stager, astage.Checkpointer(tmp_path, stager=stager) as ckpt:
        with caplog.at_level(logging.WARNING, logger="astage"):
            with pytest.raises(astage.UnsupportedInputError) as info:
                await ckpt.save(1, {"model": {"w": torch.ones(3)}, "extra": [0, {"bad": value}]})
            assert info.value.key_path[:3] == ("extra", 1, "bad")
            assert "state_dict['extra'][1]['bad']" in str(info.value)
            assert fragment in str(info.value)
            assert ckpt.in_flight == ()
            await ckpt.wait()  # nothing is reported later
            await (await ckpt.save(1, {"w": torch.ones(3)})).wait()  # the same step, fixed
        assert ckpt.steps() == [1]
        assert stager.pool_stats().handed_out_bytes == 0
    assert caplog.records == []


class _FailingReplicator:
    async def replicate_staged(self, staged: Any, *, step: int, checkpoint_id: str) -> None:
        raise astage.TransportError(f"peer went away while replicating step {step}")


@pytest.mark.anyio
async def test_a_background_failure_is_logged_once_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with astage.Checkpointer(tmp_path, replication=_FailingReplicator()) as ckpt:
        with caplog.at_level(logging.DEBUG, logger="astage"):
            handle = await ckpt.save(1, {"w": torch.ones(2)})
            with pytest.raises(astage.PersistError, match="step 1"):
                await handle.wait()
    failures = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(failures) == 1
    (record,) = failures
    assert record.exc_info is None
    assert "\n" not in record.getMessage()
    assert "step 1 failed" in record.getMessage()
    assert "peer went away while replicating step 1" in record.getMessage()


# -- hostile scalar table entries and array records ---------------------------------------------


def _forged(edit: Any = None, **record: int) -> bytes:
    """A replica of ``{"a": np.arange(3), "x": 1.5}`` with its documents (merged, as
    :func:`tests.forgery.split` gives them) ``edit``-ed and its array's tensor record
    fields set to ``record``, checksum right."""
    data = b"".join(encode({"a": np.arange(3), "x": 1.5}, owner_rank=0, step=0, checkpoint_id="").buffers())
    tables, doc = split(data)
    if record:
        records = np.frombuffer(tables, TENSOR_RECORD, 1, 32).copy()
        for field, value in record.items():
            records[field][0] = value
        tables = tables[:32] + records.tobytes() + tables[32 + TENSOR_RECORD.itemsize :]
    if edit is not None:
        edit(doc)
    return join(tables, doc) + data[parse_prefix(data).prefix_nbytes :]


def _leaf_is(node: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        doc["scalars"][0] = node  # the value of "x", the table's only entry

    return edit


def _array_record(**record: int) -> Any:
    return lambda: _forged(**record)


_HOSTILE_NODES = {
    "numpy bits too wide": _leaf_is(["numpy", "float32", 2**32]),
    "numpy negative bits": _leaf_is(["numpy", "int8", -1]),
    "numpy bool of 2": _leaf_is(["numpy", "bool", 2]),
    "numpy object dtype": _leaf_is(["numpy", "object", 0]),
    "numpy float bits": _leaf_is(["numpy", "float64", 1.5]),
    "numpy missing bits": _leaf_is(["numpy", "float64"]),
    "device index -1": _leaf_is(["device", "cuda", -1]),
    "device unknown type": _leaf_is(["device", "bogus", None]),
    "device with a colon": _leaf_is(["device", "cuda:0", None]),
    "device huge index": _leaf_is(["device", "cuda", 2**40]),
    "dtype unknown": _leaf_is(["dtype", "float"]),
    "dtype not a str": _leaf_is(["dtype", ["float32"]]),
    "bytes not base64": _leaf_is(["bytes", "!!!!"]),
    "bytes bad padding": _leaf_is(["bytes", "YQ"]),
    "bytes non-ASCII": _leaf_is(["bytes", "\u00e9"]),
    "complex of ints": _leaf_is(["complex", 1, 2]),
    "complex missing part": _leaf_is(["complex", 1.0]),
    "size of floats": _leaf_is(["size", [1.5]]),
    "size past 2**63": _leaf_is(["size", [2**63]]),
    "size too long": _leaf_is(["size", [1] * 65]),
    "unhashable tag": _leaf_is([[1], 2]),
    "a list of a tag": _leaf_is(["list", [1]]),
    "a tensor reference": _leaf_is(["tensor", 0]),
}
_HOSTILE_RECORDS = {
    # What versions 1 and 2 wrote as a JSON tensor entry is a binary record now.
    "ndarray of float8": _array_record(dtype=list(astage._format.codec.DTYPES).index("float8_e4m3fn")),
    "ndarray requiring grad": _array_record(flags=1),
    "ndarray with a DTensor note": lambda: _forged(lambda doc: doc.update(dtensors=[[0, "", [3]]])),
    # A header whose JSON says another format than its binary version: refused (version 1
    # headers could not hold ndarrays or tagged leaves; none are read now).
    "ndarray in a format-1 header": lambda: _forged(lambda doc: doc.update(format=1)),
    "tagged leaf in a format-1 header": lambda: _forged(
        lambda doc: (doc.update(format=1), _leaf_is(["size", [1]])(doc))
    ),
}


@pytest.mark.parametrize(
    "make",
    [*(lambda edit=edit: _forged(edit) for edit in _HOSTILE_NODES.values()), *_HOSTILE_RECORDS.values()],
    ids=[*_HOSTILE_NODES, *_HOSTILE_RECORDS],
)
def test_malformed_scalar_entries_and_array_records_are_integrity_errors(make: Any, tmp_path: Path) -> None:
    data = make()
    with pytest.raises(astage.IntegrityError, match="header"):
        parse_prefix(data)
    path = tmp_path / "forged.astage"
    path.write_bytes(data)
    with pytest.raises(astage.IntegrityError):
        astage.load_checkpoint_file_sync(path)


def test_the_forgery_helper_makes_valid_replicas() -> None:
    back = round_trip({"a": np.arange(3), "x": 1.5})
    assert back["x"] == 1.5
    header = parse_prefix(_forged(_leaf_is(["numpy", "float32", 0x3F800000])))
    assert header.num_tensors == 1
    assert parse_prefix(_forged(lambda doc: None, flags=0)).num_tensors == 1


# Version-1 replicas written by astage before format 2 (main at 2fa0a77), dense ones: a list
# of 100,000 zeros and an optimizer's param_groups of 3,000 indices.  Unpadded, they count
# far above the bound; version 1 was read under a looser one, and is not read now.
_DENSE_VERSION_1 = {
    "zeros": lambda: {"z": [0] * 100_000},
    "param_groups": lambda: {"param_groups": [{"params": list(range(3000)), "lr": 0.1}]},
}


@pytest.mark.parametrize("make", list(_DENSE_VERSION_1.values()), ids=list(_DENSE_VERSION_1))
def test_dense_version_1_headers_are_refused_and_unpadded_ones_too_dense(make: Any) -> None:
    state = make()
    data = _as_version(state, 1)
    header_len = struct.unpack_from("<Q", data, 12)[0]
    assert header_len < len(json.dumps(state)) + 400, "unpadded, as version 1 wrote them"
    with pytest.raises(astage.IntegrityError, match="version 1: "):
        parse_prefix(data)
    # The same state written now is padded to the bound, and without its padding refused.
    encoded = encode(state, owner_rank=0, step=0, checkpoint_id="")
    assert parse_prefix(encoded.prefix).num_tensors == 0
    header = header_bytes(encoded.prefix)
    assert header.endswith(b" ")
    with pytest.raises(astage.IntegrityError, match="too dense"):  # what padding is for
        parse_prefix(wrap(header.rstrip(b" ")))
