"""Laying out a staged state_dict as a checkpoint file, and encoding it.

:func:`lay_out` walks a staged tree once, checks everything the format can refuse, and
returns a :class:`FileLayout`: the header's tables, its structure JSON and its scalar table
(:mod:`astage._format.scalars`), everything but the storages' checksums.
:meth:`FileLayout.encode` then checksums the storages and joins the bytes.  Pure: no file,
socket or thread.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import operator
import time
from collections.abc import Sequence
from typing import Any, Final, NotRequired, TypedDict, Unpack

import crc32c
import numpy as np
import torch

from .._staging.plan import AtomNode, Node, PlannedSource, Planner, StagePlan, TensorKind, TensorNode
from .._util.collector import without_gc
from .._util.errors import KeyPath, UnsupportedInputError
from .._util.limits import RANK_LIMIT as _RANK_LIMIT
from .._util.timeslice import Steps, drive, drop_in_slices, slice_over
from .body import in_blocks
from .encoded import Encoded, StorageSegments, storage_columns, storage_views
from .parse_bound import Tokens, joined_cost, note_cost, pad_spaces, scalars_cost, tables_cost, text_tokens
from .scalars import NUMPY_NAMES, json_text
from .spec import (
    ALIGNMENT,
    FIXED_FIELDS,
    FIXED_PREFIX_NBYTES,
    FORMAT_VERSION,
    HEADER_CAP,
    HEADER_CRC,
    MAGIC,
    MAX_NDIM,
    NUMPY_DTYPES,
    align_up,
    check_meta,
)
from .tables import COUNTS, STORAGE_RECORD, pack_tensor_table
from .tree_encoder import TreeEncoder, all_storable, json_text_in_slices


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
    structure_json: str
    """The structure document (``{"dtensors":...,"tree":...}``)."""
    scalars: tuple[Any, ...]
    """The scalar table's entries, as JSON values (:func:`astage._format.scalars.scalar_json`)."""
    tables: bytes
    """The tensor table and the dims array."""
    num_tensors: int
    num_dims: int
    storages: tuple[torch.UntypedStorage, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    body_nbytes: int
    charged: int
    """What a reader charges to its parse budget beyond the counted tokens (text_parse_cost)."""
    structure_tokens: Tokens
    """What :attr:`structure_json`'s tokens cost a reader: counted once, not for every
    header made from this layout (it is ~50 bytes of text a tensor)."""
    storage_table: np.ndarray[Any, Any]
    """The storage table with :attr:`offsets` and :attr:`nbytes` in and zero checksums
    (read-only): each header copies it and sets the checksums."""

    @without_gc
    def encode(self) -> Encoded:
        """Checksum every storage and return the file's bytes.

        CPU-bound, releases the GIL on large buffers; async callers run it in a worker thread.
        """
        # The columns are read once, here in the worker, for the checksums and the
        # transport's plan (which reads them on the loop otherwise).
        columns = storage_columns(self.storages)
        crcs = tuple(in_blocks(crc32c.crc32c, storage_views(self.storages, columns)))
        segments = StorageSegments(self.offsets, self.storages, columns)
        return Encoded(self.prefix(crcs), segments, self.body_nbytes, self, crcs)

    def with_ranks(self, owner_rank: int, holder_rank: int | None) -> FileLayout:
        """The same layout for these ranks.

        :raises ConfigurationError: a rank out of range.
        """
        check_meta(owner_rank, holder_rank, self.step, self.checkpoint_id, self.created)
        return dataclasses.replace(self, owner_rank=owner_rank, holder_rank=holder_rank)

    def with_scalars(self, changed: Sequence[tuple[int, Any]]) -> FileLayout:
        """The same layout with scalar table entries ``changed`` (index, JSON value) replaced."""
        scalars = list(self.scalars)
        for index, entry in changed:
            scalars[index] = entry
        return dataclasses.replace(self, scalars=tuple(scalars))

    def prefix(self, crcs: Sequence[int]) -> bytes:
        """Everything before the body, with these storage checksums."""
        parts, spaces = self.header_parts(crcs)
        return join_prefix([*parts, b" " * spaces])

    def header_parts(self, crcs: Sequence[int]) -> tuple[list[bytes], int]:
        """The header's pieces (tables, structure, values) with these storage checksums,
        and the number of spaces that pad it (:func:`pad_spaces`): joined once, in the prefix,
        for a header that is mostly padding on many small tensors."""
        storages = self.storage_table.copy()
        storages["crc32c"] = crcs
        structure = self.structure_json.encode("ascii")
        counts = COUNTS.pack(self.num_tensors, self.num_dims, len(self.offsets), len(structure))
        values = self._values()
        binary = [counts, self.tables, storages.tobytes()]
        text_len, cost = self._text_cost(values)
        return [*binary, structure, values], pad_spaces(
            text_len, cost, sum(map(len, binary)), self._charged()
        )

    def header_nbytes(self) -> int:
        """The length of the header :meth:`header_parts` makes, padding included, without
        making it (no table is copied)."""
        text_len, cost = self._text_cost(self._values())
        binary_len = COUNTS.size + len(self.tables) + self.storage_table.nbytes
        return binary_len + text_len + pad_spaces(text_len, cost, binary_len, self._charged())

    def _text_cost(self, values: bytes) -> tuple[int, int]:
        """The JSON text's length and what its tokens cost (the structure's counted once)."""
        text_len = len(self.structure_json) + len(values)
        return text_len, joined_cost([self.structure_tokens, text_tokens(values)], text_len)

    def _charged(self) -> int:
        """What a reader charges beyond the text's tokens: the tables and the structure."""
        return self.charged + tables_cost(self.num_tensors, self.num_dims, len(self.offsets))

    def _values(self) -> bytes:
        """The values document: the metadata, then the scalar table."""
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
        return f'{head[:-1]},"scalars":{self._table}}}'.encode("ascii")

    @functools.cached_property
    def _table(self) -> str:
        """The scalar table's text, made once a layout."""
        return json_text(list(self.scalars))


@without_gc
def lay_out(staged_state_dict: Any, **meta: Unpack[FileMeta]) -> FileLayout:
    """Check a staged (CPU) state_dict against the format and lay it out (see :func:`encode`).

    Walks the tree once; pure Python, no checksums: about 6 us a tensor.  Async callers run
    :func:`lay_out_in_slices` in slices on the loop instead (a worker thread would hold the GIL
    from the loop up to the switch interval at a time, and buys nothing: this is Python).

    :raises UnsupportedInputError: as :func:`encode`.
    :raises ConfigurationError: as :func:`encode`.
    """
    return drive(lay_out_in_slices(staged_state_dict, **meta))


def lay_out_in_slices(
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
    check_meta(owner_rank, holder_rank, step, checkpoint_id, created)
    planner = _FilePlanner()
    root = yield from planner.walk(staged_state_dict, ())
    plan = StagePlan(root, tuple(planner.tensors), tuple(planner.storages))
    del root
    meta = FileMeta(owner_rank=owner_rank, step=step, checkpoint_id=checkpoint_id, holder_rank=holder_rank)
    layout = yield from _plan_laid_out_in_slices(plan, tuple(planner.storage_objs), meta, created)
    # What the walk made (a TensorSpec and more a tensor) dies here, a piece at a time, not
    # all at once in one slice of the loop.  The plan goes first, while the
    # planner's list still holds its TensorSpecs, which that list then lets go a block at a time.
    del plan
    yield
    yield from planner.forget_in_slices()
    return layout


def lay_out_planned_in_slices(
    staged: PlannedSource, *, owner_rank: int, step: int, checkpoint_id: str
) -> Steps[FileLayout]:
    """:func:`lay_out_in_slices` of a staged copy from the plan it was staged by, without
    walking it: ``staged`` is the plan (:attr:`PlannedSource.plain`) bound to the copy's own
    tensors and storages, and the tree is that plan's rebuild, untouched since.  The
    layout is then the one :func:`lay_out` makes of the tree: its file plan would be this
    plan (the storages on the CPU, where the layout does not look), and the structure and
    the tables, which are made from the plan alone, check its values the same way.
    """
    assert staged.plain, "a plan whose rebuild may plan otherwise"
    created = float(time.time())
    check_meta(owner_rank, None, step, checkpoint_id, created)
    meta = FileMeta(owner_rank=owner_rank, step=step, checkpoint_id=checkpoint_id, holder_rank=None)
    return (yield from _plan_laid_out_in_slices(staged.plan, staged.storages, meta, created))


def _plan_laid_out_in_slices(
    plan: StagePlan, storages: tuple[torch.UntypedStorage, ...], meta: FileMeta, created: float
) -> Steps[FileLayout]:
    """The layout of the tree ``plan`` was made of, over ``storages`` (one per plan storage)."""
    owner_rank, step, checkpoint_id = meta["owner_rank"], meta["step"], meta["checkpoint_id"]
    holder_rank = meta.get("holder_rank")
    structure = yield from _structure_in_slices(plan)
    offsets, nbytes, end = _storage_offsets(plan)
    yield
    tables = yield from _tables_in_slices(plan)
    layout = FileLayout(
        owner_rank=owner_rank,
        holder_rank=holder_rank,
        step=step,
        checkpoint_id=checkpoint_id,
        created=created,
        structure_json=structure.text,
        scalars=structure.scalars,
        tables=tables[0],
        num_tensors=len(plan.tensors),
        num_dims=tables[1],
        storages=storages,
        offsets=tuple(offsets),
        nbytes=tuple(nbytes),
        body_nbytes=end,
        charged=structure.charged,
        structure_tokens=structure.tokens,
        storage_table=_blank_storage_table(offsets, nbytes),
    )
    yield
    _check_widest_header(layout)
    yield
    del structure
    yield from drop_in_slices(nbytes)
    yield from drop_in_slices(offsets)
    return layout


@dataclasses.dataclass(frozen=True, slots=True)
class _Structure:
    """A plan's structure document, its scalar table and what a reader charges for them."""

    text: str
    tokens: Tokens
    scalars: tuple[Any, ...]
    charged: int


def _structure_in_slices(plan: StagePlan) -> Steps[_Structure]:
    """The structure document of ``plan`` (the tree and its DTensor notes) and its scalar
    table, every value checked, in time slices."""
    storable = True
    for start in range(0, len(plan.tensors), _TABLE_BLOCK):
        storable = storable and all_storable(plan.tensors[start : start + _TABLE_BLOCK])
        if slice_over():
            yield
    tree_encoder = TreeEncoder(plan, storable)
    tree = yield from tree_encoder.node(plan.root, (), 0)
    yield
    dtensors: list[list[Any]] = []
    charged = tree_encoder.charged + scalars_cost(len(tree_encoder.scalars))
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
    text = yield from json_text_in_slices({"dtensors": dtensors, "tree": tree})
    del tree
    yield
    tokens = text_tokens(text.encode("ascii"))  # a few passes over the text
    yield
    return _Structure(text, tokens, tuple(tree_encoder.scalars), charged)


def _storage_offsets(plan: StagePlan) -> tuple[list[int], list[int], int]:
    """Each storage's body offset and size, and the body's length.

    Each storage at the first aligned offset after the previous one: the previous offset
    is aligned, so the offsets are the running sum of the aligned sizes.
    """
    nbytes = list(map(_nbytes_of, plan.storages))
    padded = (np.array(nbytes, np.int64) + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
    offsets = np.zeros(len(nbytes), np.int64)
    np.cumsum(padded[:-1], out=offsets[1:])
    offset_list: list[int] = offsets.tolist()
    return offset_list, nbytes, offset_list[-1] + nbytes[-1] if nbytes else 0


def _tables_in_slices(plan: StagePlan) -> Steps[tuple[bytes, int]]:
    """The tensor table and dims array of ``plan``, joined, and the number of dims entries."""
    tables: list[bytes] = []
    dims: list[bytes] = []
    for start in range(0, max(1, len(plan.tensors)), _TABLE_BLOCK):
        table, dim = pack_tensor_table(plan.tensors[start : start + _TABLE_BLOCK])
        tables.append(table.tobytes())
        dims.append(dim.tobytes())
        if slice_over():
            yield
    return b"".join(tables) + b"".join(dims), sum(map(len, dims)) // 8


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
    _check_header_len(widest.header_nbytes())


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
        if NUMPY_NAMES.get((x.dtype.kind, x.dtype.itemsize)) is None or x.dtype.fields is not None:
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


def _check_header_len(nbytes: int) -> None:
    if nbytes > HEADER_CAP:
        raise UnsupportedInputError(
            (), f"the checkpoint file header would be {nbytes} bytes, over the {HEADER_CAP}-byte cap"
        )


def join_prefix(header: Sequence[bytes]) -> bytes:
    """The prefix around a header given in pieces: one copy of each, checksummed in place.

    :raises UnsupportedInputError: a header over :data:`HEADER_CAP`.
    """
    nbytes = sum(map(len, header))
    _check_header_len(nbytes)
    fixed = FIXED_FIELDS.pack(MAGIC, FORMAT_VERSION, nbytes)
    crc = crc32c.crc32c(fixed)
    for part in header:
        crc = crc32c.crc32c(part, crc)
    end = FIXED_PREFIX_NBYTES + nbytes + HEADER_CRC.size
    return b"".join([fixed, *header, HEADER_CRC.pack(crc), bytes(align_up(end) - end)])
