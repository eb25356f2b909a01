"""The checkpoint file format: one safe byte layout for the wire and the disk, pure.

A checkpoint file is a staged state_dict as bytes (a replica, a peer's copy kept on this
rank, is one such file)::

    MAGIC (8) | version u32 LE | header_len u64 LE | header (header_len bytes)
    | crc32c u32 LE of everything before it | zero padding to a 64-byte boundary | body

    header (versions 3 to 5) = counts u64[4] | tensor table | dims int64[] | storage table
                             | JSON tree (ASCII, padded with spaces where needed)

The body holds each distinct storage's raw bytes once, in plan order, each segment starting
at the first 64-byte boundary after the previous one, gaps zero, nothing after the last.
The header says how to view those storages as tensors (a binary table of fixed-size
records, one per tensor and one per storage) and how to rebuild the tree (JSON that refers
to tensors by index; from version 4 a dict of tensors met there first, in a row, names only
the first; version 5 is padded for a parse bound that counts everything a load allocates).
Versions 1 and 2 kept the tables in the JSON, version 3 wrote no tensor runs, version 4
was padded for a looser bound; they are all still read.
See ``docs/format.md`` for the schema.

This module is the format's façade: it turns a staged tree into :class:`Encoded` (a prefix
plus byte ranges) and a prefix plus body back into a tree, and checks the prefix and the
body.  It touches no file, socket or thread.  The parts live beside it:
:mod:`astage._format.spec` (version, limits, allow-lists, header records),
:mod:`astage._format.tables` (the binary tables), :mod:`astage._format.tree` (the JSON tree
and the header parser) and :mod:`astage._format.parse_bound` (the parse allocation bound); the
names other modules use are re-exported here.

Invariants:

* No pickle, ``torch.load``, ``eval`` or import by name: the header is JSON, dtypes come from
  an explicit allow-list, namedtuples are rebuilt with :func:`collections.namedtuple`.
* Decoding trusts nothing.  Lengths are checked against :data:`HEADER_CAP` and against the
  bytes at hand before anything is allocated; the header is checksummed and its schema
  checked strictly (types, ranges, indices, layout, every tensor inside its storage; the
  binary tables column by column with numpy, not record by record in Python);
  every storage's crc32c is verified before any tensor is returned.  Each violation raises
  :class:`IntegrityError`; a wrong tensor is never returned.
* Parsing is bounded before it starts: a count of the header's tokens bounds what the parse
  can allocate (:func:`_parse_cost`, plus a fixed cost a table record and the structure's
  charges, all from :data:`astage._format.parse_bound.NODE_COSTS`), a header that could need more
  than :data:`PARSE_AMPLIFICATION` times its length is refused, and the encoder counts the
  same charges and pads a header with spaces where it would not fit.
* Encoding is faithful or fails: aliasing and object identity survive the round trip, leaves
  come back with their type and value (numpy scalars bit for bit, ``-0.0`` too), and a value the
  format cannot hold raises :class:`UnsupportedInputError` naming its key path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import io
import itertools
import json
import math
import operator
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NotRequired, TypedDict, Unpack, overload

import crc32c
import numpy as np
import torch

from .._staging.plan import AtomNode, Node, Planner, StagePlan, TensorKind, TensorNode
from .._staging.rebuild import rebuild
from .._util.collector import without_gc
from .._util.errors import ConfigurationError, IntegrityError, KeyPath, UnsupportedInputError
from .._util.limits import CHUNK_BYTES
from .._util.limits import INT64 as _INT64
from .._util.limits import RANK_LIMIT as _RANK_LIMIT
from .._util.timeslice import Steps, drive, iter_drop, slice_over
from .parse_bound import (
    _joined_cost,
    _padding,
    _parse_budget,
    _parse_cost,
    _table_cost,
    _text_tokens,
    _Tokens,
    _unpadded_len,
    note_cost,
)
from .spec import _ID_CAP, _NUMPY_NAMES, _align
from .spec import ALIGNMENT as ALIGNMENT
from .spec import DTYPES as DTYPES
from .spec import FIXED_PREFIX_NBYTES as FIXED_PREFIX_NBYTES
from .spec import FORMAT_VERSION as FORMAT_VERSION
from .spec import HEADER_CAP as HEADER_CAP
from .spec import LEGACY_PARSE_AMPLIFICATION as LEGACY_PARSE_AMPLIFICATION
from .spec import MAGIC as MAGIC
from .spec import MAX_DEPTH as MAX_DEPTH
from .spec import MAX_NDIM as MAX_NDIM
from .spec import NUMPY_DTYPES as NUMPY_DTYPES
from .spec import PARSE_AMPLIFICATION as PARSE_AMPLIFICATION
from .spec import PARSE_SLACK as PARSE_SLACK
from .spec import READ_VERSIONS as READ_VERSIONS
from .spec import DTensorNote as DTensorNote
from .spec import FileHeader as FileHeader
from .spec import Segment as Segment
from .spec import Segments as Segments
from .tables import _COUNTS, _split_tables, _Tables, _tensor_table
from .tables import STORAGE_RECORD as STORAGE_RECORD
from .tables import TENSOR_RECORD as TENSOR_RECORD
from .tree import (
    _all_storable,
    _HeaderParser,
    _reject_constant,
    _TreeEncoder,
    _unique_keys,
    iter_json_text,
    json_text,
)

_FIXED = struct.Struct("<8sIQ")
_CRC = struct.Struct("<I")
_ZEROS = bytes(ALIGNMENT)
_ZERO_VIEW: Final = memoryview(_ZEROS)
"""Gaps are slices of one view (a view made a gap was two objects more each)."""


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A staged state_dict laid out as a checkpoint file, ready to write or send.

    :ivar prefix: every byte before the body.
    :ivar segments: ``(body offset, uint8 CPU tensor)`` per storage, viewing the staged
        storages themselves (nothing is copied); the bytes between them are zero.  From
        :func:`encode` the tensors are made on first use (:class:`_StorageSegments`).
    :ivar body_nbytes: length of the body.
    :ivar layout: what it was encoded from, with ``crcs`` the storages' checksums: kept so
        that :meth:`relabel` can make the prefix for another rank without checksumming the
        body again (``None`` for a file received from a peer).
    """

    prefix: bytes
    segments: Sequence[tuple[int, torch.Tensor]]
    body_nbytes: int
    layout: FileLayout | None = dataclasses.field(default=None, repr=False)
    crcs: tuple[int, ...] = dataclasses.field(default=(), repr=False)

    def relabel(self, *, owner_rank: int, holder_rank: int | None) -> Encoded:
        """The same file, body shared, with these ranks in its header.

        A save that goes to a local file and to a peer is encoded and checksummed once;
        only the prefix (small) is made again for the peer's copy.

        :raises ConfigurationError: a rank out of range, or no layout to relabel.
        """
        if self.layout is None:
            raise ConfigurationError("only an Encoded made by encode() can be relabelled")
        layout = dataclasses.replace(self.layout, owner_rank=owner_rank, holder_rank=holder_rank)
        _check_meta(owner_rank, holder_rank, layout.step, layout.checkpoint_id, layout.created)
        return dataclasses.replace(self, prefix=layout.prefix(self.crcs), layout=layout)

    @functools.cached_property
    def header(self) -> FileHeader:
        """The header, exactly as a reader parses it.

        Parsed on first use, not by :func:`encode`: a sender needs only the bytes, and on
        20,000 tensors the parse costs as much as the rest of encoding.
        """
        return parse_prefix(self.prefix)

    @property
    def total_nbytes(self) -> int:
        """Length of the whole file."""
        return len(self.prefix) + self.body_nbytes

    def buffers(self, chunk_nbytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """The whole file, in order, as memoryviews of at most ``chunk_nbytes`` bytes.

        Views alias the staged storages (valid while those are not changed), and each
        keeps the storage it views alive: ``b"".join(encode(...).buffers())`` is safe even
        where this object held the only reference (a copy of a read-only numpy array).
        """
        return self._chunks(chunk_nbytes, owned=True)

    def held_buffers(self, chunk_nbytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """:meth:`buffers` without the owning objects (a tensor and an array a storage,
        microseconds each): valid only while the caller holds this object, as a writer
        that writes them before it returns does."""
        return self._chunks(chunk_nbytes, owned=False)

    def _chunks(self, chunk_nbytes: int, owned: bool) -> Iterator[memoryview]:
        if chunk_nbytes <= 0:
            raise ConfigurationError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
        return self._split(chunk_nbytes, owned)

    def _split(self, chunk_nbytes: int, owned: bool) -> Iterator[memoryview]:
        for view in self._pieces(owned):
            if len(view) <= chunk_nbytes:  # no new view: 20,000 storages, 20,000 objects fewer
                if len(view):
                    yield view
                continue
            for start in range(0, len(view), chunk_nbytes):
                yield view[start : start + chunk_nbytes]

    def _pieces(self, owned: bool) -> Iterator[memoryview]:
        yield memoryview(self.prefix)
        end = 0
        segments = self.segments
        pairs = (
            segments.byte_views()
            if isinstance(segments, _StorageSegments) and not owned
            else ((offset, byte_view(tensor)) for offset, tensor in segments)
        )
        for offset, view in pairs:
            if offset > end:
                yield _ZERO_VIEW[: offset - end]
            yield view
            end = offset + len(view)


class _StorageSegments(Sequence[tuple[int, torch.Tensor]]):
    """:attr:`Encoded.segments` of an encoded layout: ``(offset, uint8 tensor)`` a storage,
    the tensors made on first use.

    A uint8 tensor costs microseconds a storage, the bulk of encoding 20,000 small ones; a
    file writer needs only the bytes (:meth:`byte_views`, through :meth:`Encoded.buffers`),
    so the tensors are made only for a caller that asks for them (the transport).  Making
    them twice in a race is harmless: both are the same views.
    """

    __slots__ = ("_columns", "_made", "offsets", "storages")

    def __init__(
        self,
        offsets: Sequence[int],
        storages: Sequence[torch.UntypedStorage],
        columns: tuple[_Column, _Column] | None = None,
    ) -> None:
        self.offsets = offsets
        self.storages = storages
        self._made: tuple[tuple[int, torch.Tensor], ...] | None = None
        self._columns = columns  # the storages' addresses and sizes, read when encoded

    def _pairs(self) -> tuple[tuple[int, torch.Tensor], ...]:
        made = self._made
        if made is None:
            made = self._made = tuple(zip(self.offsets, map(_storage_bytes, self.storages), strict=True))
        return made

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[tuple[int, torch.Tensor]]: ...
    def __getitem__(self, index: int | slice) -> Any:
        return self._pairs()[index]

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        return iter(self._pairs())

    def byte_views(self) -> Iterator[tuple[int, memoryview]]:
        """``(offset, bytes)`` a storage, without making tensors; the views are valid while
        this object (which holds the storages) lives."""
        yield from zip(self.offsets, _storage_views(self.storages, self._columns), strict=True)

    def extents(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Offsets, sizes and addresses as columns (the transport's ``ByteExtents``): the
        transport plans and packs 20,000 small storages from these without a tensor each.
        The addresses are valid while this object (which holds the storages) lives."""
        addresses, sizes = self._columns or _storage_columns(self.storages)
        return np.fromiter(self.offsets, np.int64, len(self.offsets)), sizes, addresses

    def byte_tensor(self, index: int) -> torch.Tensor:
        """Storage ``index`` as a 1-D ``uint8`` tensor (a view, no copy)."""
        made = self._made
        return made[index][1] if made is not None else _storage_bytes(self.storages[index])

    def extents_now(self, indices: Sequence[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Storages ``indices``' addresses and sizes now, as int64 columns."""
        return _storage_columns(list(map(self.storages.__getitem__, indices)))


_memory_view: Final = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi)
)
_PYBUF_READ: Final = 0x100
_EMPTY: Final = memoryview(b"")
_data_ptr: Final = torch.UntypedStorage.data_ptr
_nbytes: Final = torch.UntypedStorage.nbytes


_Column = np.ndarray[Any, Any]


def _storage_columns(storages: Sequence[torch.UntypedStorage]) -> tuple[_Column, _Column]:
    """Each storage's data pointer and size in bytes, as int64 columns."""
    count = len(storages)
    pointers = np.fromiter(map(_data_ptr, storages), np.int64, count)
    return pointers, np.fromiter(map(_nbytes, storages), np.int64, count)


def _storage_views(
    storages: Sequence[torch.UntypedStorage], columns: tuple[_Column, _Column] | None = None
) -> Iterator[memoryview]:
    """Read-only memoryviews of the storages' bytes, made as they are taken, which do not
    hold the storages: the caller does, for as long as the views are used.

    Each is a slice of one view of the address range the storages lie in, made at C
    speed: a view made through ctypes costs a microsecond a storage, the bulk of encoding
    20,000 small ones, and a tensor or numpy view costs more (a ctypes array also leaves
    cyclic garbage).  Only the storages' own bytes are ever sliced out of that range.
    """
    pointers, sizes = (column.astype(np.uint64) for column in columns or _storage_columns(storages))
    held = pointers[sizes > 0]  # an empty storage's pointer may be null
    if not len(held):
        return itertools.repeat(_EMPTY, len(storages))
    low = int(held.min())
    span = _memory_view(low, int((pointers + sizes).max()) - low, _PYBUF_READ)
    # An empty storage's slice is empty wherever its (unused) pointer points, below
    # the range too (its start then wraps around to past the end).
    starts = pointers - np.uint64(low)
    return map(span.__getitem__, map(slice, starts.tolist(), (starts + sizes).tolist()))


_GIL_BLOCK: Final = 2048
"""Items a C-speed ``map`` runs between two Python steps (~1 ms of small checksums)."""


def _in_blocks(fn: Callable[[Any], int], items: Iterator[Any]) -> Iterator[int]:
    """``map(fn, items)`` a block at a time, for a worker thread.

    A ``map`` of a C function over 20,000 items is one C loop that holds the GIL for its
    whole length (~11 ms of checksums), and the interpreter hands the GIL to a waiting
    thread (the event loop) only between Python steps: so the loop waited as long.
    """
    blocks = iter(lambda: list(map(fn, itertools.islice(items, _GIL_BLOCK))), [])
    return itertools.chain.from_iterable(blocks)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous 1-D uint8 CPU tensor's bytes (no copy)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous() or tensor.is_cuda:
        raise ConfigurationError("byte_view needs a contiguous 1-D uint8 CPU tensor")
    return tensor.numpy().data


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


# -- encoding -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class FileLayout:
    """A staged state_dict checked and laid out as a checkpoint file: everything but the checksums.

    :func:`lay_out` makes every check that can refuse a value; :meth:`encode` then only
    checksums the storages and joins the bytes.  Splitting the two lets a caller refuse
    bad input at once, before the costly part runs in the background (the Checkpointer
    lays out inside ``save()``).  The layout views the staged storages, like
    :class:`Encoded`.
    """

    owner_rank: int
    holder_rank: int | None
    step: int
    checkpoint_id: str
    created: float
    tree_json: str
    """The header JSON's members after the metadata (``"dtensors":...,"tree":...``)."""
    tables: bytes
    """The tensor table and the dims array."""
    num_tensors: int
    num_dims: int
    storages: tuple[torch.UntypedStorage, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    body_nbytes: int
    charged: int
    """What a reader charges to its parse budget beyond the counted tokens (_parse_cost)."""
    tree_tokens: _Tokens
    """What :attr:`tree_json`'s tokens cost a reader: counted once, not for every header
    made from this layout (it is a megabyte of text on 20,000 tensors)."""
    storage_table: np.ndarray[Any, Any]
    """The storage table with :attr:`offsets` and :attr:`nbytes` in and zero checksums
    (read-only): each header copies it and sets the checksums."""

    @without_gc
    def encode(self) -> Encoded:
        """Checksum every storage and return the file's bytes.

        CPU-bound, releases the GIL on large buffers; async callers run it in a worker thread.
        """
        # The columns are read once, here in the worker, for the checksums and the
        # transport's plan (which reads them on the loop otherwise: ~5 ms for 20,000).
        columns = _storage_columns(self.storages)
        crcs = tuple(_in_blocks(crc32c.crc32c, _storage_views(self.storages, columns)))
        segments = _StorageSegments(self.offsets, self.storages, columns)
        return Encoded(self.prefix(crcs), segments, self.body_nbytes, self, crcs)

    def prefix(self, crcs: Sequence[int]) -> bytes:
        """Everything before the body, with these storage checksums."""
        parts, spaces = self.header_parts(crcs)
        return _join_prefix([*parts, b" " * spaces])

    def header_parts(self, crcs: Sequence[int]) -> tuple[list[bytes], int]:
        """The header's pieces (tables, then JSON) with these storage checksums, and the
        number of spaces that pad it (:func:`_padding`): joined once, in the prefix, for a
        header that is mostly padding on many small tensors."""
        storages = self.storage_table.copy()
        storages["crc32c"] = crcs
        counts = _COUNTS.pack(self.num_tensors, self.num_dims, len(self.offsets), 0)
        members = self._members()
        text = b"".join([members, self.tree_json.encode("ascii"), b"}"])
        cost = _joined_cost([_text_tokens(members), self.tree_tokens], len(text))
        binary = [counts, self.tables, storages.tobytes()]
        return [*binary, text], _padding(len(text), cost, sum(map(len, binary)), self._charged())

    def header_nbytes(self) -> int:
        """The length of the header :meth:`header_parts` makes, padding included, without
        making it (no table is copied, no text joined)."""
        members = self._members()
        text_len = len(members) + len(self.tree_json) + 1
        cost = _joined_cost([_text_tokens(members), self.tree_tokens], text_len)
        binary_len = _COUNTS.size + len(self.tables) + self.storage_table.nbytes
        return binary_len + text_len + _padding(text_len, cost, binary_len, self._charged())

    def _charged(self) -> int:
        """What a reader charges beyond the text's tokens: the tables and the structure."""
        return self.charged + _table_cost(self.num_tensors, self.num_dims, len(self.offsets))

    def _members(self) -> bytes:
        """The header JSON's metadata members, up to the comma before the tree's: joined
        there, no escape straddles the two and their token costs add up."""
        meta = {
            "format": FORMAT_VERSION,
            "owner_rank": self.owner_rank,
            "holder_rank": self.holder_rank,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "created": self.created,
            "body_nbytes": self.body_nbytes,
        }
        head = json_text(meta)
        return f"{head[:-1]},".encode("ascii")


@without_gc
def lay_out(staged_state_dict: Any, **meta: Unpack[FileMeta]) -> FileLayout:
    """Check a staged (CPU) state_dict against the format and lay it out (see :func:`encode`).

    Walks the tree once; pure Python, no checksums: about 6 us a tensor.  Async callers run
    :func:`iter_lay_out` in slices on the loop instead (a worker thread would hold the GIL
    from the loop up to the switch interval at a time, and buys nothing: this is Python).

    :raises UnsupportedInputError: as :func:`encode`.
    :raises ConfigurationError: as :func:`encode`.
    """
    return drive(iter_lay_out(staged_state_dict, **meta))


def iter_lay_out(
    staged_state_dict: Any,
    *,
    owner_rank: int,
    step: int,
    checkpoint_id: str,
    holder_rank: int | None = None,
    created: float | None = None,
) -> Steps[FileLayout]:
    """:func:`lay_out` in time slices (:mod:`astage._util.timeslice`, each with the collector
    paused)."""
    created = float(time.time() if created is None else created)
    _check_meta(owner_rank, holder_rank, step, checkpoint_id, created)
    planner = _FilePlanner()
    root = yield from planner.walk(staged_state_dict, ())
    plan = StagePlan(root, tuple(planner.tensors), tuple(planner.storages))
    storable = True
    for start in range(0, len(plan.tensors), _TABLE_BLOCK):
        storable = storable and _all_storable(plan.tensors[start : start + _TABLE_BLOCK])
        if slice_over():
            yield
    tree_encoder = _TreeEncoder(plan, storable)
    tree = yield from tree_encoder.node(plan.root, (), 0)
    yield
    # Each storage at the first aligned offset after the previous one: the previous offset
    # is aligned, so the offsets are the running sum of the aligned sizes.
    nbytes = list(map(_nbytes_of, plan.storages))
    padded = (np.array(nbytes, np.int64) + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
    offsets = np.zeros(len(nbytes), np.int64)
    np.cumsum(padded[:-1], out=offsets[1:])
    offset_list: list[int] = offsets.tolist()
    end = offset_list[-1] + nbytes[-1] if nbytes else 0
    del offsets, padded
    yield
    dtensors: list[list[Any]] = []
    charged = tree_encoder.charged
    if TensorKind.DTENSOR in map(_kind_of, plan.tensors):
        for i, spec in enumerate(plan.tensors):
            if spec.kind is TensorKind.DTENSOR:
                placements, shape = repr(tuple(spec.dtensor_spec.placements)), list(spec.dtensor_spec.shape)
                dtensors.append([i, placements, shape])
                # A reader charges each note as it meets it: the header pays for it.
                charged += note_cost(placements, len(shape))
            if slice_over():
                yield
    yield
    tree_json = (yield from iter_json_text({"dtensors": dtensors, "tree": tree}))[1:-1]
    yield
    del tree
    yield
    tables: list[bytes] = []
    dims: list[bytes] = []
    for start in range(0, max(1, len(plan.tensors)), _TABLE_BLOCK):
        table, dim = _tensor_table(plan.tensors[start : start + _TABLE_BLOCK])
        tables.append(table.tobytes())
        dims.append(dim.tobytes())
        if slice_over():
            yield
    tree_tokens = _text_tokens(tree_json.encode("ascii"))  # a few passes over the text
    yield
    storage_table = _blank_storage_table(offset_list, nbytes)
    yield
    layout = FileLayout(
        owner_rank=owner_rank,
        holder_rank=holder_rank,
        step=step,
        checkpoint_id=checkpoint_id,
        created=created,
        tree_json=tree_json,
        tables=b"".join(tables) + b"".join(dims),
        num_tensors=len(plan.tensors),
        num_dims=sum(map(len, dims)) // 8,
        storages=tuple(planner.storage_objs),
        offsets=tuple(offset_list),
        nbytes=tuple(nbytes),
        body_nbytes=end,
        charged=charged,
        tree_tokens=tree_tokens,
        storage_table=storage_table,
    )
    yield
    _check_widest_header(layout)
    yield
    # What the walk made (a TensorSpec and more a tensor) dies here, a piece at a time: all
    # at once, 20,000 tensors' worth held the loop ~7 ms.  The plan goes first (the encoder
    # holds it too), while the planner's list still holds its TensorSpecs, which that list
    # then lets go a block at a time.
    del tree_encoder, plan, root
    yield
    yield from iter_drop(nbytes)
    yield from iter_drop(offset_list)
    yield from planner.iter_forget()
    return layout


_TABLE_BLOCK: Final = 512
"""Tensors whose table records are packed at a time (~0.25 ms; 2,048 took ~1 ms)."""
_nbytes_of = operator.attrgetter("nbytes")
_kind_of = operator.attrgetter("kind")


def _blank_storage_table(offsets: Sequence[int], nbytes: Sequence[int]) -> np.ndarray[Any, Any]:
    table = np.zeros(len(offsets), STORAGE_RECORD)
    table["offset"] = offsets
    table["nbytes"] = nbytes
    table.flags.writeable = False
    return table


def _check_widest_header(layout: FileLayout) -> None:
    """Check the longest header ``layout``'s metadata can make (the widest ranks; checksums
    are fixed-size) against the cap, so that encode() and relabel() cannot fail on it later."""
    widest = dataclasses.replace(layout, owner_rank=_RANK_LIMIT - 1, holder_rank=_RANK_LIMIT - 1)
    parts, spaces = widest.header_parts([0] * len(layout.offsets))
    _check_header_len(sum(map(len, parts)) + spaces)


class FileMeta(TypedDict):
    """The metadata keywords of :func:`encode` and :func:`lay_out`, written once."""

    owner_rank: int
    step: int
    checkpoint_id: str
    holder_rank: NotRequired[int | None]
    created: NotRequired[float | None]


def encode(staged_state_dict: Any, **meta: Unpack[FileMeta]) -> Encoded:
    """Lay out a staged (CPU) state_dict as a checkpoint file.

    Checksums every storage: CPU-bound, releases the GIL on large buffers; async callers
    run it in a worker thread.  The result views the staged storages, so they must not
    change until the file is written or sent.  :func:`lay_out` plus
    :meth:`FileLayout.encode`.

    A checkpoint file holds dicts, OrderedDicts, lists, tuples and namedtuples of: tensors and
    Parameters (CPU, allow-listed dtypes), numpy arrays and scalars of
    :data:`NUMPY_DTYPES`, ``None``, bools, ints, floats, complex numbers, strs, bytes,
    ``io.BytesIO`` (its bytes; read back at position 0), ``torch.Size``, ``torch.dtype`` and
    ``torch.device`` (see ``docs/format.md``).

    :param meta: ``owner_rank``, ``step``, ``checkpoint_id``; optionally ``holder_rank``
        and ``created`` (the timestamp to record; default now).
    :raises UnsupportedInputError: a value the format cannot hold (names its key path), a
        tensor not on the CPU, or a header over :data:`HEADER_CAP`.
    :raises ConfigurationError: a rank, step or id out of range.
    """
    return lay_out(staged_state_dict, **meta).encode()


class _FilePlanner(Planner):
    """The planner of :func:`lay_out`: strict, CPU only, numpy arrays and scalars as leaves.

    A numpy array becomes a tensor entry of kind ``ndarray`` over its own storage: the
    array itself when it is C- or Fortran-contiguous, writable and in native byte order,
    else a C-contiguous native copy.  The same array object met twice is one entry met
    twice; distinct arrays never share a storage, even where their memory overlaps.
    """

    def __init__(self) -> None:
        super().__init__(strict=True, allowed_devices=frozenset({"cpu"}))
        self.arrays: dict[int, TensorNode] = {}

    def leaf(self, x: Any, cls: type, path: KeyPath) -> Node:
        if isinstance(x, np.generic):
            return AtomNode(x)  # the tree encoder checks its dtype
        if cls is np.ndarray:
            return self.array(x, path)
        return super().leaf(x, cls, path)

    def bytes_io(self, x: io.BytesIO, path: KeyPath) -> Node:
        """An ``io.BytesIO`` as a tensor entry of kind ``bytesio``: a 1-D uint8 view of its
        buffer (the export keeps the BytesIO from being resized until the file is written)."""
        known = self.arrays.get(id(x))  # (arrays and BytesIOs: one entry per object)
        if known is not None:
            return known
        data = np.frombuffer(x.getbuffer(), np.uint8)
        node = self.new_tensor(torch.from_numpy(data), path)
        self.tensors[node.position] = self.tensors[node.position]._replace(kind=TensorKind.BYTESIO)
        self.arrays[id(x)] = node
        self.keepalive.append(x)
        return node

    def array(self, x: np.ndarray[Any, Any], path: KeyPath) -> TensorNode:
        known = self.arrays.get(id(x))
        if known is not None:
            return known
        if _NUMPY_NAMES.get((x.dtype.kind, x.dtype.itemsize)) is None or x.dtype.fields is not None:
            raise UnsupportedInputError(
                path,
                f"numpy dtype {x.dtype} cannot be stored in a checkpoint file "
                f"(only {', '.join(NUMPY_DTYPES)})",
            )
        if x.ndim > MAX_NDIM:
            raise UnsupportedInputError(
                path, f"{x.ndim} dimensions, the checkpoint file format holds at most {MAX_NDIM}"
            )
        data = x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))
        if not ((data.flags.c_contiguous or data.flags.f_contiguous) and data.flags.writeable):
            # torch.from_numpy needs non-negative strides and warns on read-only arrays.
            data = np.array(data, order="F" if data.flags.f_contiguous else "C")
        node = self.new_tensor(torch.from_numpy(data), path)
        self.tensors[node.position] = self.tensors[node.position]._replace(kind=TensorKind.NDARRAY)
        self.arrays[id(x)] = node
        self.keepalive.append(x)  # ids stay unique only while the objects live
        return node


def _check_meta(
    owner_rank: int, holder_rank: int | None, step: int, checkpoint_id: str, created: float
) -> None:
    ranks = (
        {"owner_rank": owner_rank}
        if holder_rank is None
        else {"owner_rank": owner_rank, "holder_rank": holder_rank}
    )
    for name, rank in ranks.items():
        if type(rank) is not int or not 0 <= rank < _RANK_LIMIT:
            raise ConfigurationError(f"{name} must be an int in [0, 2**31), got {rank!r}")
    if type(step) is not int or not -_INT64 <= step < _INT64:
        raise ConfigurationError(f"step must be a 64-bit int, got {step!r}")
    if type(checkpoint_id) is not str or len(checkpoint_id) > _ID_CAP:
        raise ConfigurationError(f"checkpoint_id must be a str of at most {_ID_CAP} characters")
    if not math.isfinite(created):
        raise ConfigurationError(f"created must be a finite timestamp, got {created!r}")


def _check_header_len(nbytes: int) -> None:
    if nbytes > HEADER_CAP:
        raise UnsupportedInputError(
            (), f"the checkpoint file header would be {nbytes} bytes, over the {HEADER_CAP}-byte cap"
        )


def _prefix_bytes(header: bytes) -> bytes:
    return _join_prefix([header])


def _join_prefix(header: Sequence[bytes]) -> bytes:
    """The prefix around a header given in pieces: one copy of each, checksummed in place."""
    nbytes = sum(map(len, header))
    _check_header_len(nbytes)
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, nbytes)
    crc = crc32c.crc32c(fixed)
    for part in header:
        crc = crc32c.crc32c(part, crc)
    end = FIXED_PREFIX_NBYTES + nbytes + _CRC.size
    return b"".join([fixed, *header, _CRC.pack(crc), bytes(_align(end) - end)])


# -- decoding -----------------------------------------------------------------------------


def prefix_nbytes(fixed: bytes | bytearray | memoryview) -> int:
    """Length of the whole prefix, from its first :data:`FIXED_PREFIX_NBYTES` bytes.

    Checks magic, version and the header length cap, so a reader can size its next read
    without trusting anything else.

    :raises IntegrityError: fewer than 20 bytes, wrong magic or version, header too long.
    """
    if len(fixed) < FIXED_PREFIX_NBYTES:
        raise IntegrityError(
            f"truncated: {len(fixed)} bytes, a checkpoint file starts with {FIXED_PREFIX_NBYTES}"
        )
    magic, version, header_len = _FIXED.unpack(bytes(fixed[:FIXED_PREFIX_NBYTES]))
    if magic != MAGIC:
        raise IntegrityError(f"not an astage checkpoint file: magic {magic!r}")
    if version not in READ_VERSIONS:
        raise IntegrityError(
            f"unsupported checkpoint file format version {version} "
            f"(this astage reads {sorted(READ_VERSIONS)})"
        )
    if header_len > HEADER_CAP:
        raise IntegrityError(f"header length {header_len} is over the {HEADER_CAP}-byte cap")
    return _align(FIXED_PREFIX_NBYTES + header_len + _CRC.size)


@without_gc
def parse_prefix(data: bytes | bytearray | memoryview) -> FileHeader:
    """Validate a checkpoint file's prefix and return its header; bytes after the prefix are ignored.

    :raises IntegrityError: truncated, corrupt, tampered or malformed in any way.
    """
    return parse_checked(check_prefix(data))[0]


@dataclasses.dataclass(slots=True, eq=False)
class CheckedPrefix:
    """A prefix checked up to its JSON (:func:`check_prefix`), which is not parsed yet.

    :ivar text: the JSON, without its padding; :func:`parse_checked` takes it (it must not
        outlive the parse's start: the parse bound counts the text once).
    :ivar budget: what the parse may still charge for the structure (``_parse_bound``).
    :ivar text_at: where the text starts in the prefix.
    """

    total: int
    version: int
    tables: _Tables | None
    text: str
    budget: int
    text_at: int


def check_prefix(data: bytes | bytearray | memoryview) -> CheckedPrefix:
    """What every parse checks before it reads the JSON: length, checksum, padding, the
    tables' sizes and the parse bound.

    :raises IntegrityError: as :func:`parse_prefix`.
    """
    view = memoryview(data).cast("B")
    total = prefix_nbytes(view)
    if len(view) < total:
        raise IntegrityError(f"truncated: the prefix is {total} bytes, only {len(view)} available")
    _, version, header_len = _FIXED.unpack(bytes(view[:FIXED_PREFIX_NBYTES]))
    header_end = FIXED_PREFIX_NBYTES + header_len
    (stored,) = _CRC.unpack(view[header_end : header_end + _CRC.size])
    if crc32c.crc32c(view[:header_end]) != stored:
        raise IntegrityError("header checksum mismatch")
    if any(view[header_end + _CRC.size : total]):
        raise IntegrityError("non-zero bytes in the prefix padding")
    # Views, not copies: most of a many-tensor header is padding, which is only counted.
    raw = view[FIXED_PREFIX_NBYTES:header_end]
    tables = _split_tables(raw) if version >= 3 else None
    json_raw = raw[0 if tables is None else tables.nbytes :]
    table_cost = 0 if tables is None else _table_cost(*tables.counts)
    unpadded = _unpadded_len(json_raw)
    budget = _parse_budget(header_len, json_raw, version, table_cost, unpadded)
    if budget < 0:
        raise IntegrityError(
            f"header of {header_len} bytes is too dense: parsing it could allocate "
            f"{_parse_cost(json_raw, unpadded) + table_cost} bytes, more than its format-{version} bound "
            "(docs/format.md)"
        )
    try:
        # Without the padding, which json.loads would only skip.
        text = str(json_raw[:unpadded], "ascii")
    except UnicodeDecodeError as exc:  # the encoder escapes every non-ASCII character
        raise IntegrityError(f"header is not ASCII: {exc}") from exc
    return CheckedPrefix(total, version, tables, text, budget, header_end - len(json_raw))


def parse_checked(prefix: CheckedPrefix) -> tuple[FileHeader, int]:
    """The header of a :func:`check_prefix`-ed prefix, and what its structure charged
    against the parse bound.

    :raises IntegrityError: as :func:`parse_prefix`.
    """
    text, prefix.text = prefix.text, ""
    try:
        doc = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"header is not valid JSON: {exc}") from exc
    del text
    parser = _HeaderParser(prefix.total, prefix.version, prefix.budget, prefix.tables)
    header = parser.parse(doc)
    del doc
    return header, prefix.budget - parser.budget


class BodyVerifier:
    """Checks a body against its header as the bytes arrive, in order: zero gaps, crcs.

    Feed the body from its first byte with :meth:`update`, in pieces of any size, then call
    :meth:`finish`.  Each storage's crc32c is compared as soon as its last byte is in, so a
    body streamed from a peer is verified while later pieces are still on the wire, and no
    second pass over it is needed.  CPU-bound (checksums): async callers run it in a worker
    thread.

    The storages that lie whole in a piece are checked in bulk (their gaps in one numpy
    pass, their checksums in one C-speed pipeline), with the same first error as one by
    one; a storage that straddles two pieces is checked byte-range by byte-range, its
    checksum carried over.  :func:`verify_body` is this verifier fed one piece.
    """

    def __init__(self, header: FileHeader) -> None:
        self.header = header
        segments = header.segments
        # Plain lists: indexed once each by the straddling path.
        self._offsets: list[int] = segments.offsets.tolist()
        self._sizes: list[int] = segments.nbytes.tolist()
        self._crcs: list[int] = segments.crcs.tolist()
        self._ends = segments.offsets + segments.nbytes
        # Bulk needs the storages in body order, none overlapping the one before (every
        # parsed header's are); a header made by hand may be checked only one by one.
        self._bulk = bool((self._ends[:-1] <= segments.offsets[1:]).all())
        self.nbytes = 0
        self._index = 0  # the storage whose bytes come next
        self._crc = 0  # running crc32c of that storage's bytes so far

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Check the next ``len(data)`` bytes of the body.

        :raises IntegrityError: more bytes than the header says, non-zero padding, or a
            storage whose checksum does not match.
        """
        view = memoryview(data).cast("B")
        base = self.nbytes
        end = base + len(view)
        if end > self.header.body_nbytes:
            raise IntegrityError(f"body is longer than the {self.header.body_nbytes} bytes the header says")
        index = self._index
        pos = base
        if self._bulk:
            if index < len(self._offsets) and self._offsets[index] < base:  # begun in an earlier piece
                pos = self._check(view, base, pos, end, index + 1)
                if self._index == index:  # and goes on past this one
                    self.nbytes = end
                    return
            pos = self._check_whole(view, base, pos, end)
        self._check(view, base, pos, end, len(self._offsets))
        self.nbytes = end

    def finish(self) -> None:
        """Check that the whole body came in.

        :raises IntegrityError: fewer bytes than the header says.
        """
        if self.nbytes != self.header.body_nbytes:
            raise IntegrityError(f"body is {self.nbytes} bytes, the header says {self.header.body_nbytes}")
        end = self.nbytes
        self._check(memoryview(b""), end, end, end, len(self._offsets))  # empty storages at the very end

    def _check_whole(self, view: memoryview, base: int, pos: int, end: int) -> int:
        """Check the storages that end in this piece (none begun before ``pos``) and the
        gaps before them, in bulk; where the next check begins."""
        first = self._index
        last = int(np.searchsorted(self._ends, end, side="right"))
        if last <= first:
            return pos
        offsets = self.header.segments.offsets[first:last] - base
        ends = self._ends[first:last] - base
        gap_starts = np.empty_like(offsets)
        gap_starts[0] = pos - base
        gap_starts[1:] = ends[:-1]
        gapped = np.flatnonzero(gap_starts < offsets)
        dirty_gap = last - first
        if len(gapped):
            dirty = _dirty_gaps(np.frombuffer(view, np.uint8), gap_starts[gapped], offsets[gapped])
            if dirty.any():
                dirty_gap = int(gapped[np.argmax(dirty)])
        slices = map(slice, offsets.tolist(), ends.tolist())
        crcs = np.fromiter(_in_blocks(crc32c.crc32c, map(view.__getitem__, slices)), np.int64, last - first)
        mismatched = np.flatnonzero(crcs != self.header.segments.crcs[first:last])
        bad_crc = int(mismatched[0]) if len(mismatched) else last - first
        if dirty_gap <= bad_crc and dirty_gap < last - first:
            self._index = first + dirty_gap
            raise IntegrityError(f"non-zero padding before storage {first + dirty_gap}")
        if bad_crc < last - first:
            index = self._index = first + bad_crc
            at = self._offsets[index]
            raise IntegrityError(f"checksum mismatch in storage {index} (body bytes from {at})")
        self._index, self._crc = last, 0
        return int(self._ends[last - 1])

    def _check(self, view: memoryview, base: int, pos: int, end: int, stop: int) -> int:
        """Check storages one by one from ``pos``, up to storage ``stop`` or the piece's
        end (a storage going on past it carries its checksum over); where it got to."""
        # Locals, not attributes, in the loop.
        offsets, sizes, crcs = self._offsets, self._sizes, self._crcs
        index, crc = self._index, self._crc
        try:
            while index < stop:
                offset = offsets[index]
                if pos < offset:
                    gap_end = offset if offset < end else end
                    if any(view[pos - base : gap_end - base]):
                        raise IntegrityError(f"non-zero padding before storage {index}")
                    pos = gap_end
                seg_end = offset + sizes[index]
                if seg_end > end:  # the storage goes on in the next piece
                    if end > pos:
                        crc = crc32c.crc32c(view[pos - base :], crc)
                        pos = end
                    return pos
                if seg_end > pos:
                    crc = crc32c.crc32c(view[pos - base : seg_end - base], crc)
                    pos = seg_end
                if crc != crcs[index]:
                    raise IntegrityError(f"checksum mismatch in storage {index} (body bytes from {offset})")
                index += 1
                crc = 0
            return pos
        finally:
            self._index, self._crc = index, crc


_GAP_GATHER_BYTES: Final = 1 << 20
"""Gap bytes :func:`_dirty_gaps` gathers at once.  A parsed header's gaps are under
:data:`ALIGNMENT` bytes each; a wider one (only in a header made by hand) is checked alone."""


def _dirty_gaps(body: np.ndarray[Any, Any], starts: np.ndarray[Any, Any], ends: np.ndarray[Any, Any]) -> Any:
    """Whether each gap ``[starts[i], ends[i])`` of ``body`` (all non-empty, in order, not
    overlapping) holds a non-zero byte, with no pass over the storages' bytes between them.

    A gap inside one :data:`ALIGNMENT`-byte block of ``body`` (every gap of a parsed
    header, where the body or piece starts on a block) is read as that block's row, masked
    to the gap: one gather of rows for all of them.  Any other gap's bytes are gathered
    and reduced a gap each.
    """
    out = np.zeros(len(starts), bool)
    whole = len(body) // ALIGNMENT * ALIGNMENT
    rows = starts // ALIGNMENT
    in_block = (rows == (ends - 1) // ALIGNMENT) & (ends <= whole)
    inside = np.flatnonzero(in_block)
    if len(inside):
        blocks = body[:whole].reshape(-1, ALIGNMENT)
        columns = np.arange(ALIGNMENT)
        lo, hi = (starts[inside] % ALIGNMENT)[:, None], (ends[inside] - rows[inside] * ALIGNMENT)[:, None]
        out[inside] = ((blocks[rows[inside]] != 0) & (columns >= lo) & (columns < hi)).any(axis=1)
    rest = np.flatnonzero(~in_block)
    if len(rest):
        out[rest] = _gathered_dirty_gaps(body, starts[rest], ends[rest])
    return out


def _gathered_dirty_gaps(
    body: np.ndarray[Any, Any], starts: np.ndarray[Any, Any], ends: np.ndarray[Any, Any]
) -> Any:
    """:func:`_dirty_gaps` for any gaps: their bytes gathered, a batch at a time, and
    reduced a gap each."""
    lengths = ends - starts
    ahead = np.cumsum(lengths)  # gap bytes up to and including each gap
    out = np.zeros(len(lengths), bool)
    i = 0
    while i < len(lengths):
        if lengths[i] > _GAP_GATHER_BYTES:
            out[i] = body[int(starts[i]) : int(ends[i])].any()
            i += 1
            continue
        j = int(np.searchsorted(ahead, ahead[i] - lengths[i] + _GAP_GATHER_BYTES, side="right"))
        batch = lengths[i:j]
        firsts = np.zeros(j - i, np.int64)
        np.cumsum(batch[:-1], out=firsts[1:])
        where = np.arange(int(batch.sum()), dtype=np.int64) + np.repeat(starts[i:j] - firsts, batch)
        out[i:j] = np.logical_or.reduceat(body[where] != 0, firsts)
        i = j
    return out


def verify_body(header: FileHeader, body: torch.Tensor) -> None:
    """Check that ``body`` is exactly the body ``header`` describes: length, zero gaps, crcs.

    CPU-bound (checksums); async callers run it in a worker thread.

    :param body: a contiguous 1-D uint8 CPU tensor.
    :raises IntegrityError: wrong length, non-zero padding, checksum mismatch.
    :raises ConfigurationError: ``body`` is not a contiguous 1-D uint8 CPU tensor.
    """
    view = byte_view(body)
    if len(view) != header.body_nbytes:
        raise IntegrityError(f"body is {len(view)} bytes, the header says {header.body_nbytes}")
    # The body as one piece: the verifier checks its storages in bulk (one by one only for
    # a header made by hand that lists them out of body order), with the streaming verdict.
    verifier = BodyVerifier(header)
    verifier.update(view)
    verifier.finish()


@without_gc
def decode(header: FileHeader, body: torch.Tensor) -> Any:
    """Verify ``body`` against ``header`` and rebuild the state_dict over it.

    Each storage becomes its own exactly-sized storage viewing ``body``'s memory (no copy),
    so ``body`` stays alive while any returned tensor does.  DTensors come back as their
    local tensor (a plain Tensor); :attr:`FileHeader.dtensors` says what they were.

    :param body: a contiguous 1-D uint8 CPU tensor of ``header.body_nbytes`` bytes.
    :raises IntegrityError: the body does not match the header.
    :raises ConfigurationError: ``body`` is not a contiguous 1-D uint8 CPU tensor.
    """
    verify_body(header, body)
    # A slice of an untyped storage is a storage of exactly those bytes that holds the
    # whole one alive: a third cheaper than a numpy slice turned into a tensor.
    whole = body.untyped_storage()
    base = int(body.storage_offset())
    starts = (header.segments.offsets + base).tolist()
    ends = (header.segments.offsets + header.segments.nbytes + base).tolist()
    storages = list(map(whole.__getitem__, map(slice, starts, ends)))
    try:
        return rebuild(header.plan, storages)
    except RuntimeError as exc:  # pragma: no cover - the header checks should make this unreachable
        raise IntegrityError(f"cannot rebuild the tensors the header describes: {exc}") from exc


# The names of the first release (see astage._files.durable): the same objects.
ReplicaHeader = FileHeader
ReplicaLayout = FileLayout
