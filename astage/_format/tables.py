"""The binary per-tensor and per-storage tables of a checkpoint file header.

The header starts with four counts (tensors, dims, storages, and the length of the
structure JSON that follows the tables), then one fixed-size record a tensor
(:data:`TENSOR_RECORD`), every tensor's sizes and strides as one int64 array, and one
record a storage (:data:`STORAGE_RECORD`).  This module packs them from a plan and, on
the way back, checks them whole columns at a time with numpy (indices, codes, flags,
canonical storage offsets, every tensor inside its storage) before turning them into
:class:`TensorSpec` records: per-tensor Python work is what a many-tensor header costs.
Pure: no file, socket or thread.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Iterable, Sequence
from itertools import islice, repeat
from typing import Any, Final, NamedTuple

import numpy as np

from .._staging.plan import TensorKind, TensorNode, TensorSpec
from .._util.errors import KeyPath
from .._util.limits import INT64 as _INT64
from .spec import (
    ALIGNMENT,
    DTYPES,
    FLAG_CONJ,
    FLAG_NEG,
    FLAG_REQUIRES_GRAD,
    MAX_NDIM,
    Segment,
    Segments,
    header_error,
    tensor_refused,
)

COUNTS = struct.Struct("<QQQQ")  # tensors, dims, storages, structure JSON bytes

DTYPE_CODES: Final[tuple[str, ...]] = tuple(DTYPES)
"""The dtype codes: a tensor record's ``dtype`` byte indexes this tuple.  Append
only: a code once written means that dtype forever."""

TENSOR_RECORD: Final = np.dtype(
    [
        ("storage", "<u4"),
        ("dtype", "u1"),
        ("ndim", "u1"),
        ("kind", "u1"),
        ("flags", "u1"),
        ("offset", "<i8"),
    ]
)
"""One tensor of a header (16 bytes, little-endian).  Its ``ndim`` sizes and then
``ndim`` strides follow the previous tensor's in the dims array."""

STORAGE_RECORD: Final = np.dtype(
    [("offset", "<u8"), ("nbytes", "<u8"), ("crc32c", "<u4"), ("reserved", "<u4")]
)
"""One storage of a header (24 bytes, little-endian): where its bytes lie in the
body and their crc32c; ``reserved`` is zero."""

_FLAGS: Final = FLAG_REQUIRES_GRAD | FLAG_CONJ | FLAG_NEG

_DTYPE_NAMES: Final = {dtype: name for name, dtype in DTYPES.items()}
_DTYPE_CODE: Final = {DTYPES[name]: code for code, name in enumerate(DTYPE_CODES)}
_CODE_DTYPES: Final = tuple(DTYPES[name] for name in DTYPE_CODES)
_CODE_ITEMSIZE: Final = np.array([d.itemsize for d in _CODE_DTYPES], dtype=np.int64)
_KIND_CODES: Final = (TensorKind.TENSOR, TensorKind.PARAMETER, TensorKind.NDARRAY, TensorKind.BYTESIO)
"""The kind codes (a DTensor is stored as its local tensor, code 0).  Append only."""
_KIND_CODE: Final = {
    TensorKind.TENSOR: 0,
    TensorKind.PARAMETER: 1,
    TensorKind.NDARRAY: 2,
    TensorKind.DTENSOR: 0,
    TensorKind.BYTESIO: 3,
}


def _objects(values: Sequence[Any]) -> np.ndarray[Any, Any]:
    """A 1-D object array of ``values``: a code column indexes it to gather Python objects."""
    out = np.empty(len(values), object)
    for i, value in enumerate(values):
        out[i] = value
    return out


_REFUSED: Final = np.array(
    [
        [
            [tensor_refused(dtype, kind, flags) is not None for flags in range(_FLAGS + 1)]
            for kind in _KIND_CODES
        ]
        for dtype in _CODE_DTYPES
    ]
)
"""``_REFUSED[dtype code, kind code, flags]``: whether :func:`astage._format.spec.tensor_refused`
refuses that record; both sides' checks, a column at a time."""
_CODE_DTYPE_OBJECTS: Final = _objects(_CODE_DTYPES)
_KIND_OBJECTS: Final = _objects(_KIND_CODES)
new_tuple: Final = tuple.__new__
"""Builds a NamedTuple from the complete tuple of its fields, skipping its Python-level
``__new__``: a call a record is most of what a many-tensor parse costs.  The fields
given (here and in :mod:`astage._format.tree`) are checked against the classes below, so
a field added to them fails at import."""
if TensorNode._fields != ("position",):
    raise ImportError("astage._format.tree builds TensorNode records field by field")
if Segment._fields != ("offset", "nbytes", "crc32c") or TensorSpec._fields != (
    *("key_path", "storage", "dtype", "size", "stride", "offset", "kind", "requires_grad"),
    *("conj", "neg", "attrs", "dtensor_spec"),
):
    raise ImportError("astage builds Segment and TensorSpec records field by field")

_EXACT_LIMIT: Final = 1 << 20
"""Extents are computed column-wise in int64 for tensors whose sizes and strides
are all below this (no sum can overflow); the others, rare, are checked one by one."""


def pack_tensor_table(specs: Sequence[TensorSpec]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The tensor table and dims array of ``specs``, built column by column (the
    columns come out of one ``zip(*specs)``, at C speed)."""
    table = np.zeros(len(specs), TENSOR_RECORD)
    if not specs:
        return table, np.zeros(0, "<i8")
    _, storage, dtype, size, stride, offset, kind, requires_grad, conj, neg, *_ = zip(*specs, strict=True)
    table["storage"] = storage
    table["dtype"] = list(map(_DTYPE_CODE.__getitem__, dtype))
    table["ndim"] = ndims = list(map(len, size))
    table["kind"] = list(map(_KIND_CODE.__getitem__, kind))
    table["flags"] = _flag_column(requires_grad, conj, neg)
    table["offset"] = offset
    dims = np.fromiter(itertools.chain.from_iterable(map(tuple.__add__, size, stride)), "<i8", 2 * sum(ndims))
    return table, dims


def _flag_column(
    requires_grad: Sequence[bool], conj: Sequence[bool], neg: Sequence[bool]
) -> np.ndarray[Any, Any]:
    """The flag bits of tensors given as three columns (:func:`astage._format.spec.flag_bits`)."""
    flags = np.array(requires_grad, np.uint8) * FLAG_REQUIRES_GRAD
    flags |= np.array(conj, np.uint8) * FLAG_CONJ
    flags |= np.array(neg, np.uint8) * FLAG_NEG
    return flags


def any_refused(specs: Sequence[Any]) -> bool:
    """Whether :func:`astage._format.spec.tensor_refused` refuses a tensor among ``specs``
    (checked a column at a time)."""
    if not specs:
        return False
    _, _, dtype, _, _, _, kind, requires_grad, conj, neg, *_ = zip(*specs, strict=True)
    if not set(dtype) <= _DTYPE_CODE.keys():
        return True
    codes = np.fromiter(map(_DTYPE_CODE.__getitem__, dtype), np.int64, len(specs))
    kinds = np.fromiter(map(_KIND_CODE.__getitem__, kind), np.int64, len(specs))
    return bool(_REFUSED[codes, kinds, _flag_column(requires_grad, conj, neg)].any())


class RawTables(NamedTuple):
    """The binary tables of a header, viewed in place (not yet validated), and the length
    of the structure JSON after them (checked to fit in the header)."""

    tensors: np.ndarray[Any, Any]
    dims: np.ndarray[Any, Any]
    storages: np.ndarray[Any, Any]
    nbytes: int
    structure_len: int

    @property
    def counts(self) -> tuple[int, int, int]:
        return len(self.tensors), len(self.dims), len(self.storages)


def split_tables(raw: bytes | memoryview) -> RawTables:
    """The tables at the start of a header; their sizes, and the structure JSON's, checked
    against ``raw``."""
    if len(raw) < COUNTS.size:
        raise header_error("tables", f"{len(raw)} bytes, the table counts alone take {COUNTS.size}")
    tensors, dims, storages, structure_len = COUNTS.unpack_from(raw)
    # Each count is checked against the bytes before it is multiplied: no overflow.
    room = len(raw) - COUNTS.size
    at = COUNTS.size
    views = []
    for name, count, record in (
        ("tensor", tensors, TENSOR_RECORD),
        ("dims", dims, np.dtype("<i8")),
        ("storage", storages, STORAGE_RECORD),
    ):
        if count > room // record.itemsize:
            raise header_error("tables", f"{count} {name} records do not fit in the {len(raw)}-byte header")
        views.append(np.frombuffer(raw, record, count, at))
        at += count * record.itemsize
        room -= count * record.itemsize
    if structure_len > room:
        raise header_error(
            "tables", f"a {structure_len}-byte structure does not fit in the {len(raw)}-byte header"
        )
    return RawTables(views[0], views[1], views[2], at, structure_len)


class _Columns(NamedTuple):
    """A validated tensor table: its records and dims array, and the int64 columns derived
    from them (``starts``: where each tensor's sizes begin in ``dims``)."""

    records: np.ndarray[Any, Any]
    dims: np.ndarray[Any, Any]
    storage: np.ndarray[Any, Any]
    code: np.ndarray[Any, Any]
    ndim: np.ndarray[Any, Any]
    starts: np.ndarray[Any, Any]


def _first(bad: np.ndarray[Any, Any]) -> int:
    return int(np.flatnonzero(bad)[0])


def check_storage_table(records: np.ndarray[Any, Any], body_nbytes: int) -> Segments:
    """The storages, checked as whole columns: canonical offsets, inside the body."""
    offsets = records["offset"]
    nbytes = records["nbytes"]
    if records["reserved"].any():
        raise header_error(f"storages[{_first(records['reserved'] != 0)}]", "the reserved field is not zero")
    # Both below 2**63 once checked against the body, so their sums cannot overflow uint64.
    over = (nbytes > body_nbytes) | (offsets > body_nbytes)
    if over.any():
        raise header_error(f"storages[{_first(over)}]", f"overruns the {body_nbytes}-byte body")
    ends = offsets + nbytes
    aligned = np.zeros(len(records), np.uint64)
    aligned[1:] = (ends[:-1] + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
    misplaced = offsets != aligned
    if misplaced.any():
        i = _first(misplaced)
        raise header_error(f"storages[{i}]", f"offset {offsets[i]} is not the aligned offset {aligned[i]}")
    over = ends > body_nbytes
    if over.any():
        i = _first(over)
        raise header_error(
            f"storages[{i}]", f"bytes [{offsets[i]}, {ends[i]}) overrun the {body_nbytes}-byte body"
        )
    end = int(ends[-1]) if len(ends) else 0
    if end != body_nbytes:
        raise header_error("body_nbytes", f"{body_nbytes} bytes, but the storages end at {end}")
    return Segments(offsets, nbytes, records["crc32c"])


def check_tensor_table(tables: RawTables, segments: Segments) -> _Columns:
    """The tensors, checked as whole columns with numpy: indices, codes, flags and
    every tensor inside its storage.  The rare tensor with a dimension or stride of
    :data:`_EXACT_LIMIT` or more is checked on its own with Python ints."""
    records, dims = tables.tensors, tables.dims
    _check_codes(records, dims, len(segments))
    storage, code, ndim = _int_columns(records)
    # Each tensor's sizes, then its strides, in the dims array.
    starts = np.zeros(len(records), np.int64)
    np.cumsum(2 * ndim[:-1], out=starts[1:])
    large = _check_extents(records, starts, dims, segments)
    if len(segments) and (np.bincount(storage, minlength=len(segments)) == 0).any():
        raise header_error("storages", "a storage is not referenced by any tensor")
    columns = _Columns(records, dims, storage, code, ndim, starts)
    for i in np.flatnonzero(large).tolist():
        _check_extent(columns, i, segments)
    for i in np.flatnonzero(records["kind"] == _KIND_CODE[TensorKind.NDARRAY]).tolist():
        _check_array(columns, i, segments)
    return columns


def _check_array(columns: _Columns, i: int, segments: Segments) -> None:
    """An ndarray entry is a contiguous array over its own storage (the writer copies any
    other into one): no more elements than its storage's bytes hold.  (A stride-0 view of
    astronomically many elements is a valid tensor, but no numpy array.)"""
    ndim, start = int(columns.ndim[i]), int(columns.starts[i])
    size = columns.dims[start : start + ndim].tolist()
    itemsize = int(_CODE_ITEMSIZE[int(columns.code[i])])
    nbytes = segments[int(columns.storage[i])].nbytes
    if math.prod(size) * itemsize > nbytes:
        raise header_error(f"tensors[{i}]", f"an ndarray of shape {tuple(size)} over a {nbytes}-byte storage")
    # numpy refuses a shape whose non-zero sizes multiply past its index range, empty or not.
    if math.prod(n for n in size if n) * itemsize >= 1 << 63:
        raise header_error(f"tensors[{i}]", f"no numpy array has the shape {tuple(size)}")


def _int_columns(records: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], ...]:
    """The storage, dtype and ndim columns as int64, for index arithmetic."""
    return tuple(records[name].astype(np.int64) for name in ("storage", "dtype", "ndim"))


def _check_codes(records: np.ndarray[Any, Any], dims: np.ndarray[Any, Any], nstorages: int) -> None:
    """The tensor records' indices, codes and flags and the dims array's length and signs,
    each column at once."""
    storage, code, ndim = _int_columns(records)
    kind, flags = records["kind"], records["flags"]
    for bad, what in (
        (storage >= nstorages, f"storage is not one of the {nstorages} storages"),
        (code >= len(DTYPE_CODES), f"dtype code is not one of the {len(DTYPE_CODES)} allowed"),
        (ndim > MAX_NDIM, f"more than {MAX_NDIM} dimensions"),
        (kind >= len(_KIND_CODES), f"kind code is not one of the {len(_KIND_CODES)} kinds"),
        ((flags | _FLAGS) != _FLAGS, "unknown flag bits"),
        (records["offset"] < 0, "negative storage offset"),
    ):
        if bad.any():
            raise header_error(f"tensors[{_first(bad)}]", what)
    if 2 * int(ndim.sum()) != len(dims):
        raise header_error("dims", f"{len(dims)} entries, the tensors have {int(ndim.sum())} dimensions")
    if (dims < 0).any():
        raise header_error("dims", "a negative size or stride")
    refused = _REFUSED[code, kind, flags]
    if refused.any():
        i = _first(refused)
        why = tensor_refused(_CODE_DTYPES[int(code[i])], _KIND_CODES[int(kind[i])], int(flags[i]))
        raise header_error(f"tensors[{i}]", str(why))
    flat = (kind == _KIND_CODE[TensorKind.BYTESIO]) & (ndim != 1)
    if flat.any():
        raise header_error(f"tensors[{_first(flat)}]", "a bytesio entry has exactly one dimension")


def _check_extents(
    records: np.ndarray[Any, Any],
    starts: np.ndarray[Any, Any],
    dims: np.ndarray[Any, Any],
    segments: Segments,
) -> np.ndarray[Any, Any]:
    """Every tensor inside its storage, in int64 columns; returns the mask of the tensors
    too large for that (a size, stride or offset of :data:`_EXACT_LIMIT` or more, or near
    2**63 elements), which the caller checks one by one."""
    storage, code, ndim = _int_columns(records)
    offset = records["offset"]
    count = len(offset)
    # ``first`` is where a tensor's dimensions start among all tensors' dimensions,
    # ``owner`` the tensor of each dimension.
    first = starts // 2
    owner = np.repeat(np.arange(count), ndim)
    size_at = np.repeat(starts, ndim) + np.arange(len(owner)) - np.repeat(first, ndim)
    sizes = dims[size_at]
    strides = dims[size_at + ndim[owner]]
    empty = np.bincount(owner[sizes == 0], minlength=count) > 0
    large = np.bincount(owner[(sizes >= _EXACT_LIMIT) | (strides >= _EXACT_LIMIT)], minlength=count) > 0
    large |= offset >= _EXACT_LIMIT
    # log2 of the product of the sizes but zeros (torch multiplies them in order, and fails
    # on an overflow before a zero): near 2**63 the float is not trusted, checked exactly.
    log_numel = np.bincount(owner, weights=np.log2(np.maximum(sizes, 1)), minlength=count)
    large |= log_numel > 62
    # Below the limit no term reaches 2**40, and no sum of up to 2**22 of them (a header
    # cannot hold more dims) overflows int64.
    terms = np.where(large[owner] | empty[owner], 0, (sizes - 1) * strides)
    total = np.zeros(len(terms) + 1, np.int64)
    np.cumsum(terms, out=total[1:])
    last = offset + total[first + ndim] - total[first]
    past = ~empty & ~large & ((last + 1) * _CODE_ITEMSIZE[code] > segments.nbytes[storage])
    if past.any():
        i = _first(past)
        raise header_error(
            f"tensors[{i}]", f"reaches past its {segments[int(storage[i])].nbytes}-byte storage"
        )
    return large


def _numel_overflows(size: Sequence[int]) -> bool:
    """Whether torch's element count of ``size`` overflows int64.

    Torch multiplies the sizes left to right and fails on the first overflow, even when a
    later size is 0: (2**32, 2**32, 0) is refused, (0, 2**62, 2**62) is not.
    """
    product = 1
    for n in size:
        product *= n
        if product >= _INT64:
            return True
    return False


def _check_extent(columns: _Columns, i: int, segments: Segments) -> None:
    """One tensor's element count and extent, with Python ints (see :func:`check_tensor_table`)."""
    start, ndim = int(columns.starts[i]), int(columns.ndim[i])
    size = columns.dims[start : start + ndim].tolist()
    stride = columns.dims[start + ndim : start + 2 * ndim].tolist()
    where = f"tensors[{i}]"
    if _numel_overflows(size):
        raise header_error(where, f"shape {size} has too many elements")
    if 0 in size:
        return
    last = int(columns.records["offset"][i]) + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
    nbytes = segments[int(columns.storage[i])].nbytes
    if last >= _INT64 or (last + 1) * _CODE_DTYPES[int(columns.code[i])].itemsize > nbytes:
        raise header_error(where, f"shape {size} with stride {stride} reaches past its {nbytes}-byte storage")


def tensor_specs(
    columns: _Columns, paths: Sequence[KeyPath], between: Callable[[], object] | None = None
) -> tuple[TensorSpec, ...]:
    """The checked tensor table as plan records, with the key paths the tree gave them.

    Column by column: each field is one numpy ``tolist`` (or an object-array gather), and
    each record one ``tuple.__new__``; a Python call a tensor would cost more than the
    rest of the parse (headers of tens of thousands of tensors are parsed).  The records
    are made a block at a time, ``between`` called after each (20,000 in one C call held
    the GIL ~10 ms).
    """
    flags = columns.records["flags"]
    sizes, strides = _shapes(columns)
    fields = zip(
        paths,
        columns.storage.tolist(),
        _column(columns.code, _CODE_DTYPE_OBJECTS),
        sizes,
        strides,
        _column(columns.records["offset"]),
        _column(columns.records["kind"], _KIND_OBJECTS),
        _column(flags & FLAG_REQUIRES_GRAD != 0),
        _column(flags & FLAG_CONJ != 0),
        _column(flags & FLAG_NEG != 0),
        repeat(None),  # attrs: a checkpoint file holds none
        repeat(None),  # dtensor_spec: DTensors come back as their local tensor
        strict=False,  # the repeats are endless; paths and the columns have one a tensor
    )
    made = map(new_tuple, repeat(TensorSpec), fields)
    specs: list[TensorSpec] = []
    while block := list(islice(made, _SPEC_BLOCK)):
        specs += block
        if between is not None:
            between()
    return tuple(specs)


_SPEC_BLOCK: Final = 2048
"""Tensor records made in one C call (~1 ms)."""


def _column(values: np.ndarray[Any, Any], objects: np.ndarray[Any, Any] | None = None) -> Iterable[Any]:
    """A column's Python values (``objects`` indexed by them, where given): one value
    repeated where all are equal, as dtypes, kinds, flags and offsets mostly are."""
    if len(values) and not (values != values[0]).any():
        first = values[0].item()
        return repeat(first if objects is None else objects[first])
    column: list[Any] = (values if objects is None else objects[values]).tolist()
    return column


def _shapes(columns: _Columns) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Every tensor's size and stride tuples, gathered a dimension count at a time.

    Equal tuples are shared (most tensors of a model have one of a few shapes, and nearly
    all contiguous 1-D ones the stride ``(1,)``): fewer objects for the collector to walk
    once the parse is over, and less memory.
    """
    count = len(columns.ndim)
    ndims = np.flatnonzero(np.bincount(columns.ndim)).tolist()
    sizes = np.empty(count, object)
    strides = np.empty(count, object)
    for ndim in ndims:
        which = np.flatnonzero(columns.ndim == ndim) if len(ndims) > 1 else slice(None)
        block = columns.dims[columns.starts[which, None] + np.arange(2 * ndim)]
        sizes[which] = _rows(block[:, :ndim])
        strides[which] = _rows(block[:, ndim:])
        del block
    return sizes.tolist(), strides.tolist()


def _rows(block: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The rows of a non-empty 2-D block of non-negative int64s as tuples, in an object
    array, equal rows one tuple.

    The rows are numbered with numpy (each by its digits in base largest entry + 1 where
    that fits in int64, else compared whole), a tuple is made per distinct row and the
    array gathered from them: no Python object a row but its tuple, where a dict or set of
    the rows' numbers cost ~300 bytes a row more at the parse's peak (90,000 tensors of
    distinct strides: its charge did not cover that).
    """
    count, width = block.shape
    if width == 0:
        empty = np.empty(count, object)
        empty.fill(())
        return empty
    base = int(block.max()) + 1
    if base**width < _INT64:  # one int64 a row: sorted as one column
        weights = base ** np.arange(width, dtype=np.int64)
        numbers, inverse = _distinct((block @ weights)[:, None])
        distinct = (numbers[:, 0, None] // weights) % base
        del numbers
    else:
        distinct, inverse = _distinct(block)
    tuples = np.fromiter(map(tuple, distinct.tolist()), object, len(distinct))
    del distinct
    out: np.ndarray[Any, Any] = tuples[inverse]
    return out


def _distinct(block: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The distinct rows of a non-empty 2-D int64 block, and for each row the index of its
    own among them.  (Not ``np.unique``: it imports ``numpy.ma`` on first use, and a
    loader imports nothing.)"""
    order = np.lexsort(block.T[::-1])
    rows = block[order]
    first = np.ones(len(rows), bool)
    first[1:] = (rows[1:] != rows[:-1]).any(axis=1)
    inverse = np.empty(len(rows), np.int64)
    inverse[order] = np.cumsum(first) - 1
    return rows[first], inverse
