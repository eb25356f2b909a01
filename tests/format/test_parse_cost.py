"""The parse bound's cost table, measured: for each kind of node a header holds, what loading
the densest header of that kind really allocates (tracemalloc, the header read into memory
as a loader reads it, then parsed) stays within what the bound charged for it, and so
within 4 times the header; and the encoder pads for exactly the charge the parser makes.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import astage
from astage._format.codec import (
    FIXED_PREFIX_NBYTES,
    FORMAT_VERSION,
    PARSE_AMPLIFICATION,
    PARSE_SLACK,
    check_prefix,
    encode,
    parse_checked,
)
from astage._format.parse_bound import NODE_COSTS, namedtuple_cost
from tests.format.test_format import _DENSE_HEADERS, _forge_version
from tests.statedicts import nested_tensors


class Loaded:
    """What loading one header cost: its length, the peak allocated, what the bound charged."""

    def __init__(self, prefix: bytes) -> None:
        self.header_len = struct.unpack_from("<Q", prefix, 12)[0]
        source = bytearray(prefix)  # not counted: a loader reads the file into a new buffer
        gc.collect()
        tracemalloc.start()
        try:
            data = bytes(source)
            checked = check_prefix(data)
            budget = checked.budget
            _, structure = parse_checked(checked)
            self.peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        self.left = budget - structure
        self.charged = PARSE_AMPLIFICATION * self.header_len + PARSE_SLACK - self.left
        self.padded = prefix[FIXED_PREFIX_NBYTES + self.header_len - 1] == ord(" ")

    def check(self) -> None:
        ratio = self.peak / self.header_len
        assert self.peak <= self.charged + PARSE_SLACK, (self.peak, self.charged, ratio)
        assert self.peak <= PARSE_AMPLIFICATION * self.header_len + PARSE_SLACK, ratio
        # The encoder counts what the parser charges, to the byte: padded, the header has
        # less than one space's worth of budget left (a space buys PARSE_AMPLIFICATION - 1).
        assert self.left >= 0
        if self.padded:
            assert self.left < PARSE_AMPLIFICATION - 1, self.left


def _load(state: Any) -> Loaded:
    return Loaded(encode(state, owner_rank=0, step=0, checkpoint_id="cost").prefix)


def _namedtuple(fields: int, name_len: int = 2) -> Any:
    names = [f"f{i}".ljust(name_len, "x") for i in range(fields)]
    return collections.namedtuple("N", names)(*range(fields))


_B = torch.zeros(1)

_KINDS: dict[str, Callable[[], Any]] = {
    # tensors, dims and storages: the binary tables
    "20k tiny tensors, a storage each": lambda: {f"layer{i}.w": torch.zeros(1) for i in range(20_000)},
    "20k tensors in a list": lambda: {"l": [torch.zeros(1) for _ in range(20_000)]},
    "20k views of one storage": lambda: {"l": list(torch.zeros(20_000).unbind())},
    "90k 1-d tensors, distinct large strides": lambda: {
        f"k{i}": torch.zeros(1).as_strided((1,), (10**6 + i,)) for i in range(90_000)
    },
    "60k views, distinct strides, in a dict run": lambda: {
        str(i): _B.as_strided((1,), (10**6 + i,)) for i in range(60_000)
    },
    "3k 64-d tensors, distinct shapes": lambda: {
        f"k{i}": torch.zeros(0).as_strided((0, *[1] * 62, i + 2), (1,) * 64) for i in range(3_000)
    },
    "3k shapes past the int64 numbering": lambda: {
        f"k{i}": _B.as_strided((0, 2**40 + i, 2**40 - i), (2**40 + i, 1, 2**41)) for i in range(3_000)
    },
    # key paths
    "tensors 120 containers deep": lambda: nested_tensors(2_000, 120),
    # namedtuples: one class of many fields, long names, many classes, many instances
    "a namedtuple of 5,000 fields": lambda: {"z": _namedtuple(5_000)},
    "a namedtuple of 1,000 long fields": lambda: {"z": _namedtuple(1_000, 200)},
    "300 namedtuple classes": lambda: {
        "z": [collections.namedtuple(f"N{i}", ["a", "b", "c"])(i, 0, 0) for i in range(300)]
    },
    "20k namedtuples of one class": lambda: {"z": [_Pair(i, 0.5) for i in range(20_000)]},
    # containers and leaves
    "60k empty lists": lambda: {"z": [[] for _ in range(60_000)]},
    "30k empty dicts": lambda: {"z": [{} for _ in range(30_000)]},
    "20k ordered dicts with attributes": lambda: {"z": [_odict_with_attrs() for _ in range(20_000)]},
    "40k tuples aliased": lambda: {"z": [(0,)] * 2 + [((i,), (i,)) for i in range(20_000)]},
    "100k small ints": lambda: {"z": list(range(100_000))},
    "30k big ints": lambda: {"z": [10**40 + i for i in range(30_000)]},
    "30k floats, non-finite too": lambda: {"z": [float(i) / 3 for i in range(30_000)] + [np.nan, -np.inf]},
    "30k short strs and non-ASCII": lambda: {"z": [f"\u4e00{i}" for i in range(30_000)]},
    "20k numpy scalars": lambda: {"z": [np.float64(i) for i in range(20_000)]},
    "20k sizes, dtypes and devices": lambda: {
        "z": [(torch.Size([i, 2]), torch.float16, torch.device("cpu", i % 4)) for i in range(20_000)]
    },
    "20k complex numbers": lambda: {"z": [complex(i, -i) for i in range(20_000)]},
    "10k bytes leaves": lambda: {"z": [bytes([i % 256]) * 3 for i in range(10_000)]},
    "10k ndarrays": lambda: {"z": [np.zeros(1, np.int16) for _ in range(10_000)]},
}


_Pair = collections.namedtuple("_Pair", ["a", "b"])


def _odict_with_attrs() -> collections.OrderedDict[str, Any]:
    od: collections.OrderedDict[str, Any] = collections.OrderedDict(a=1)
    od._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    return od


@pytest.mark.parametrize("make", list(_KINDS.values()), ids=list(_KINDS))
def test_loading_the_densest_header_of_each_kind_stays_within_its_charge(make: Callable[[], Any]) -> None:
    loaded = _load(make())
    assert loaded.charged > 2 * PARSE_SLACK  # large enough that the slack does not decide
    loaded.check()


@pytest.fixture
def one_rank_group() -> Iterator[Any]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ndim", [1, 8])
def test_dtensor_notes_are_charged_and_paid_alike(one_rank_group: Any, ndim: int) -> None:
    # The parser charged each note, the encoder did not pay: with ~250 DTensors a padded
    # header was refused (main: "too dense" on every FSDP2 save of a 6-layer model).
    mesh = one_rank_group
    for count in (300, 3_000):
        state = {
            str(i): DTensor.from_local(torch.zeros((1,) * ndim), mesh, [Shard(0) if i % 2 else Replicate()])
            for i in range(count)
        }
        loaded = _load(state)
        assert loaded.padded
        loaded.check()


@pytest.mark.parametrize("make", list(_DENSE_HEADERS.values()), ids=list(_DENSE_HEADERS))
def test_loading_a_hostile_header_stays_within_the_bound(make: Any) -> None:
    data = _forge_version(make(), FORMAT_VERSION)
    header_len = struct.unpack_from("<Q", data, 12)[0]
    source = bytearray(data)
    gc.collect()
    tracemalloc.start()
    try:
        with contextlib.suppress(astage.IntegrityError):  # refused or parsed: within the bound
            parse_checked(check_prefix(bytes(source)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= PARSE_AMPLIFICATION * header_len + PARSE_SLACK, peak / header_len


def test_a_namedtuple_class_is_charged_what_making_it_allocates() -> None:
    # collections.namedtuple compiles a __new__ with a parameter a field: ~1.7 KB a field at
    # its peak, where 256 bytes were charged (5,000 fields read at 13 times the header).
    for fields, name_len in ((1, 2), (100, 2), (3_000, 2), (300, 200)):
        names = [f"f{i}".ljust(name_len, "x") for i in range(fields)]
        gc.collect()
        tracemalloc.start()
        try:
            collections.namedtuple("N", names)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak <= namedtuple_cost("N", names), (fields, name_len, peak)


def test_the_cost_table_has_one_entry_a_node_kind() -> None:
    assert set(NODE_COSTS) >= {"value", "quote", "member", "digit", "tensor", "dim", "storage"}
    assert set(NODE_COSTS) >= {"key_path", "namedtuple", "dtensor_note", "container", "scalar"}
    assert all(cost.base >= 0 and cost.each >= 0 and cost.char >= 0 for cost in NODE_COSTS.values())
