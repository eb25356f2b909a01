"""The replica format: one safe byte layout for the wire and the disk, pure.

A replica is a staged state_dict as bytes::

    MAGIC (8) | version u32 LE | header_len u64 LE | header (header_len bytes)
    | crc32c u32 LE of everything before it | zero padding to a 64-byte boundary | body

    header (version 3) = counts u64[4] | tensor table | dims int64[] | storage table
                         | JSON tree (ASCII, padded with spaces where needed)

The body holds each distinct storage's raw bytes once, in plan order, each segment starting
at the first 64-byte boundary after the previous one, gaps zero, nothing after the last.
The header says how to view those storages as tensors (a binary table of fixed-size
records, one per tensor and one per storage) and how to rebuild the tree (JSON that refers
to tensors by index).  Versions 1 and 2 kept the tables in the JSON; they are still read.
See ``docs/format.md`` for the schema.

This module touches no file, socket or thread; it turns a staged tree into
:class:`Encoded` (a prefix plus byte ranges) and a prefix plus body back into a tree.

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
  can allocate (:func:`_parse_cost`, plus a fixed cost a table record), a header that could
  need more than :data:`PARSE_AMPLIFICATION` times its length is refused, and the encoder
  pads a header with spaces where it would not fit.
* Encoding is faithful or fails: aliasing and object identity survive the round trip, leaves
  come back with their type and value (numpy scalars bit for bit, ``-0.0`` too), and a value the
  format cannot hold raises :class:`UnsupportedInputError` naming its key path.
"""

from __future__ import annotations

import binascii
import collections
import ctypes
import dataclasses
import functools
import itertools
import json
import math
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple

import crc32c
import numpy as np
import torch

from ._errors import Attr, ConfigurationError, IntegrityError, KeyPath, UnsupportedInputError, format_key_path
from ._gc import without_gc
from ._limits import CHUNK_BYTES
from ._limits import INT64 as _INT64
from ._limits import RANK_LIMIT as _RANK_LIMIT
from ._plan import (
    AtomNode,
    CopyNode,
    DictNode,
    Node,
    ObjectNode,
    RefNode,
    SeqNode,
    StagePlan,
    StorageSpec,
    TensorKind,
    TensorNode,
    TensorSpec,
    _Planner,
)
from ._rebuild import rebuild
from ._slices import drive

MAGIC: Final = b"ASTAGE\x00R"
"""First 8 bytes of every replica."""

FORMAT_VERSION: Final = 3
"""The layout version this module writes (version 2 added the leaves of :func:`encode`'s list,
version 3 the binary tensor and storage tables)."""

READ_VERSIONS: Final = frozenset({1, 2, 3})
"""The versions this module reads.  The binary version sets the parse bound
(:data:`PARSE_AMPLIFICATION`: version 2 and 3 headers are padded to it where needed) and the
header's layout (3: binary tables); in versions 1 and 2 the header's ``format`` field says
which nodes may appear: a format-1 header may use only format-1 nodes."""

ALIGNMENT: Final = 64
"""Prefix length and every body segment offset are multiples of this."""

HEADER_CAP: Final = 64 << 20
"""Largest header JSON accepted (and produced), checked before anything is allocated."""

FIXED_PREFIX_NBYTES: Final = 20
"""Magic, version and header length: what must be read first to learn the prefix length."""

PARSE_AMPLIFICATION: Final = 4
"""Parsing a format-2 header allocates at most this many times its length (plus
:data:`PARSE_SLACK`); a header that could need more is refused before it is parsed, and the
encoder pads every header with spaces to fit (see :func:`_parse_cost`)."""

LEGACY_PARSE_AMPLIFICATION: Final = 64
"""The same bound for version-1 headers, which were written unpadded: old files must stay
readable, and a valid one can count up to 48 (a long list of single-digit ints; it needs
about 37 times its length in fact)."""

PARSE_SLACK: Final = 256 << 10
"""Fixed allowance on top of the amplification bound: frames, small tables."""

MAX_DEPTH: Final = 128
"""Deepest container nesting accepted in the tree."""

MAX_NDIM: Final = 64
"""Most dimensions accepted for one tensor."""

_FIXED = struct.Struct("<8sIQ")
_COUNTS = struct.Struct("<QQQQ")  # version 3: tensors, dims, storages, reserved (zero)
_CRC = struct.Struct("<I")
_ZEROS = bytes(ALIGNMENT)
_ID_CAP = 4096
_INT_BITS_CAP = 13_000  # below CPython's 4300-digit int/str conversion limit

DTYPES: Final[Mapping[str, torch.dtype]] = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e5m2fnuz": torch.float8_e5m2fnuz,
    "float8_e8m0fnu": torch.float8_e8m0fnu,
    "float4_e2m1fn_x2": torch.float4_e2m1fn_x2,
}
"""The dtype allow-list: header names to torch dtypes.  Nothing else is read or written."""

NUMPY_DTYPES: Final[Mapping[str, np.dtype[Any]]] = {
    name: np.dtype(name)
    for name in (
        *("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
        *("float16", "float32", "float64", "complex64", "complex128"),
    )
}
"""numpy dtypes of the arrays and scalars a replica holds (each is also a torch dtype)."""

_TORCH_DTYPE_LEAVES: Final[Mapping[str, torch.dtype]] = {
    **DTYPES,
    **{
        name: getattr(torch, name)
        for name in (
            *("complex32", "qint8", "quint8", "qint32", "quint4x2", "quint2x4"),
            *("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"),
            *(f"int{n}" for n in range(1, 8)),
            *(f"uint{n}" for n in range(1, 8)),
        )
        if isinstance(getattr(torch, name, None), torch.dtype)
    },
}
"""Every torch dtype a ``torch.dtype`` leaf may name: tensors need the allow-list, a dtype
object is only a name."""

DTYPE_CODES: Final[tuple[str, ...]] = tuple(DTYPES)
"""Version 3's dtype codes: a tensor record's ``dtype`` byte indexes this tuple.  Append
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
"""One tensor of a version-3 header (16 bytes, little-endian).  Its ``ndim`` sizes and then
``ndim`` strides follow the previous tensor's in the dims array."""

STORAGE_RECORD: Final = np.dtype(
    [("offset", "<u8"), ("nbytes", "<u8"), ("crc32c", "<u4"), ("reserved", "<u4")]
)
"""One storage of a version-3 header (24 bytes, little-endian): where its bytes lie in the
body and their crc32c; ``reserved`` is zero."""

FLAG_REQUIRES_GRAD: Final = 1
FLAG_CONJ: Final = 2
FLAG_NEG: Final = 4
_FLAGS: Final = FLAG_REQUIRES_GRAD | FLAG_CONJ | FLAG_NEG

_DTYPE_NAMES: Final = {dtype: name for name, dtype in DTYPES.items()}
_DTYPE_CODE: Final = {DTYPES[name]: code for code, name in enumerate(DTYPE_CODES)}
_CODE_DTYPES: Final = tuple(DTYPES[name] for name in DTYPE_CODES)
_CODE_ITEMSIZE: Final = np.array([d.itemsize for d in _CODE_DTYPES], dtype=np.int64)
_CODE_FLOATING: Final = np.array([d.is_floating_point or d.is_complex for d in _CODE_DTYPES])
_CODE_COMPLEX: Final = np.array([d.is_complex for d in _CODE_DTYPES])
_CODE_NUMPY: Final = np.array([name in NUMPY_DTYPES for name in DTYPE_CODES])
_TORCH_DTYPE_LEAF_NAMES: Final = {dtype: name for name, dtype in _TORCH_DTYPE_LEAVES.items()}
_NUMPY_NAMES: Final = {(dt.kind, dt.itemsize): name for name, dt in NUMPY_DTYPES.items()}
_KINDS: Final = {
    "tensor": TensorKind.TENSOR,
    "parameter": TensorKind.PARAMETER,
    "ndarray": TensorKind.NDARRAY,
}
_KIND_CODES: Final = (TensorKind.TENSOR, TensorKind.PARAMETER, TensorKind.NDARRAY)
"""Version 3's kind codes (a DTensor is stored as its local tensor, code 0)."""
_KIND_CODE: Final = {
    TensorKind.TENSOR: 0,
    TensorKind.PARAMETER: 1,
    TensorKind.NDARRAY: 2,
    TensorKind.DTENSOR: 0,
}
_V2_KINDS: Final = frozenset({TensorKind.NDARRAY})
_V2_LEAVES: Final = frozenset({"bytes", "complex", "size", "dtype", "device", "numpy"})
_DEVICE_TYPE_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")
_NONFINITE: Final = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_SCALARS: Final = (type(None), bool, int, float, str)
_NAN_KEY: Final = ["float", "nan"]
_CPU: Final = torch.device("cpu")


# -- data ---------------------------------------------------------------------------------


class Segment(NamedTuple):
    """Where one storage's bytes lie in the body, and their crc32c.

    A NamedTuple rather than a frozen dataclass: a header holds one per storage, and a
    NamedTuple is built several times faster (headers of 20,000 storages are parsed).
    """

    offset: int
    nbytes: int
    crc32c: int


@dataclasses.dataclass(frozen=True, slots=True)
class DTensorNote:
    """What a DTensor was; decoding returns only its local shard, as a plain tensor."""

    placements: str
    global_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaHeader:
    """A validated replica header.

    :ivar owner_rank: the rank whose state this is.
    :ivar holder_rank: the rank that keeps this copy, where the encoder said so.
    :ivar step: the training step the state belongs to.
    :ivar checkpoint_id: the caller's name for this checkpoint.
    :ivar created: when it was encoded (seconds since the epoch, the owner's clock).
    :ivar body_nbytes: length of the body that follows the prefix.
    :ivar prefix_nbytes: length of everything before the body.
    :ivar segments: one per distinct storage, in body order.
    :ivar plan: how to view the storages as tensors and rebuild the tree.
    :ivar dtensors: per planned tensor, what DTensor it was (``None`` for plain tensors).
    """

    owner_rank: int
    holder_rank: int | None
    step: int
    checkpoint_id: str
    created: float
    body_nbytes: int
    prefix_nbytes: int
    segments: tuple[Segment, ...]
    plan: StagePlan
    dtensors: tuple[DTensorNote | None, ...]
    version: int = FORMAT_VERSION

    @property
    def num_tensors(self) -> int:
        """Distinct tensors in the replica (a tensor referenced twice counts once)."""
        return len(self.plan.tensors)

    @property
    def total_nbytes(self) -> int:
        """Length of the whole replica: prefix plus body."""
        return self.prefix_nbytes + self.body_nbytes


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A staged state_dict laid out as a replica, ready to write or send.

    :ivar prefix: every byte before the body.
    :ivar segments: ``(body offset, uint8 CPU tensor)`` per storage, viewing the staged
        storages themselves (nothing is copied); the bytes between them are zero.
    :ivar body_nbytes: length of the body.
    :ivar layout: what it was encoded from, with ``crcs`` the storages' checksums: kept so
        that :meth:`relabel` can make the prefix for another rank without checksumming the
        body again (``None`` for a replica received from a peer).
    """

    prefix: bytes
    segments: tuple[tuple[int, torch.Tensor], ...]
    body_nbytes: int
    layout: ReplicaLayout | None = dataclasses.field(default=None, repr=False)
    crcs: tuple[int, ...] = dataclasses.field(default=(), repr=False)

    def relabel(self, *, owner_rank: int, holder_rank: int | None) -> Encoded:
        """The same replica, body shared, with these ranks in its header.

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
    def header(self) -> ReplicaHeader:
        """The header, exactly as a reader parses it.

        Parsed on first use, not by :func:`encode`: a sender needs only the bytes, and on
        20,000 tensors the parse costs as much as the rest of encoding.
        """
        return parse_prefix(self.prefix)

    @property
    def total_nbytes(self) -> int:
        """Length of the whole replica."""
        return len(self.prefix) + self.body_nbytes

    def buffers(self, chunk_nbytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """The whole replica, in order, as memoryviews of at most ``chunk_nbytes`` bytes.

        Views alias the staged storages: they stay valid while those are not changed.
        """
        if chunk_nbytes <= 0:
            raise ConfigurationError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
        for view in self._pieces():
            for start in range(0, len(view), chunk_nbytes):
                yield view[start : start + chunk_nbytes]

    def _pieces(self) -> Iterator[memoryview]:
        yield memoryview(self.prefix)
        end = 0
        for offset, tensor in self.segments:
            if offset > end:
                yield memoryview(_ZEROS)[: offset - end]
            view = byte_view(tensor)
            yield view
            end = offset + len(view)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous 1-D uint8 CPU tensor's bytes (no copy)."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous() or tensor.is_cuda:
        raise ConfigurationError("byte_view needs a contiguous 1-D uint8 CPU tensor")
    return tensor.numpy().data


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


# -- encoding -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class ReplicaLayout:
    """A staged state_dict checked and laid out as a replica: everything but the checksums.

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

    @without_gc
    def encode(self) -> Encoded:
        """Checksum every storage and return the replica's bytes.

        CPU-bound, releases the GIL on large buffers; async callers run it in a worker thread.
        """
        segments = []
        crcs = []
        for offset, storage in zip(self.offsets, self.storages, strict=True):
            segments.append((offset, _storage_bytes(storage)))
            # A ctypes view for the checksum: a fifth of the cost of a numpy one, and the
            # storage outlives it (self holds it).
            view = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
            crcs.append(crc32c.crc32c(view))
        crc_tuple = tuple(crcs)
        return Encoded(self.prefix(crc_tuple), tuple(segments), self.body_nbytes, self, crc_tuple)

    def prefix(self, crcs: Sequence[int]) -> bytes:
        """Everything before the body, with these storage checksums."""
        return _prefix_bytes(self.header(crcs))

    def header(self, crcs: Sequence[int]) -> bytes:
        """The header (tables and JSON) with these storage checksums, padded (:func:`_padded`)."""
        storages = np.zeros(len(self.offsets), STORAGE_RECORD)
        storages["offset"] = self.offsets
        storages["nbytes"] = self.nbytes
        storages["crc32c"] = crcs
        binary = (
            _COUNTS.pack(self.num_tensors, self.num_dims, len(self.offsets), 0)
            + self.tables
            + storages.tobytes()
        )
        meta = {
            "format": FORMAT_VERSION,
            "owner_rank": self.owner_rank,
            "holder_rank": self.holder_rank,
            "step": self.step,
            "checkpoint_id": self.checkpoint_id,
            "created": self.created,
            "body_nbytes": self.body_nbytes,
        }
        head = json.dumps(meta, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
        text = f"{head[:-1]},{self.tree_json}}}".encode("ascii")
        charged = self.charged + _table_cost(self.num_tensors, self.num_dims, len(self.offsets))
        return binary + _padded(text, len(binary), charged)


@without_gc
def lay_out(
    staged_state_dict: Any,
    *,
    owner_rank: int,
    step: int,
    checkpoint_id: str,
    holder_rank: int | None = None,
    created: float | None = None,
) -> ReplicaLayout:
    """Check a staged (CPU) state_dict against the format and lay it out (see :func:`encode`).

    Walks the tree once; pure Python, no checksums: tens of milliseconds for 20,000
    tensors, so async callers run it in a worker thread.

    :raises UnsupportedInputError: as :func:`encode`.
    :raises ConfigurationError: as :func:`encode`.
    """
    created = float(time.time() if created is None else created)
    _check_meta(owner_rank, holder_rank, step, checkpoint_id, created)
    planner = _ReplicaPlanner()
    root = drive(planner.walk(staged_state_dict, ()))
    plan = StagePlan(root, tuple(planner.tensors), tuple(planner.storages))
    tree_encoder = _TreeEncoder(plan)
    tree = tree_encoder.node(plan.root, (), 0)
    offsets = []
    nbytes = [spec.nbytes for spec in plan.storages]
    end = 0
    for n in nbytes:
        offsets.append(_align(end))
        end = offsets[-1] + n
    dtensors = [
        [i, repr(tuple(spec.dtensor_spec.placements)), list(spec.dtensor_spec.shape)]
        for i, spec in enumerate(plan.tensors)
        if spec.kind is TensorKind.DTENSOR
    ]
    tree_json = json.dumps(
        {"dtensors": dtensors, "tree": tree}, ensure_ascii=True, allow_nan=False, separators=(",", ":")
    )[1:-1]
    table, dims = _tensor_table(plan.tensors)
    layout = ReplicaLayout(
        owner_rank=owner_rank,
        holder_rank=holder_rank,
        step=step,
        checkpoint_id=checkpoint_id,
        created=created,
        tree_json=tree_json,
        tables=table.tobytes() + dims.tobytes(),
        num_tensors=len(table),
        num_dims=len(dims),
        storages=tuple(planner.storage_objs),
        offsets=tuple(offsets),
        nbytes=tuple(nbytes),
        body_nbytes=end,
        charged=tree_encoder.charged,
    )
    # The longest header the metadata can make (the widest holder rank; checksums are
    # fixed-size), so that encode() and relabel() cannot fail on the cap later.
    widest = dataclasses.replace(layout, owner_rank=_RANK_LIMIT - 1, holder_rank=_RANK_LIMIT - 1)
    _check_header_len(len(widest.header([0] * len(offsets))))
    return layout


def _tensor_table(specs: Sequence[TensorSpec]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The version-3 tensor table and dims array of ``specs``, built column by column."""
    table = np.zeros(len(specs), TENSOR_RECORD)
    table["storage"] = [s.storage for s in specs]
    table["dtype"] = [_DTYPE_CODE[s.dtype] for s in specs]
    table["ndim"] = [len(s.size) for s in specs]
    table["kind"] = [_KIND_CODE[s.kind] for s in specs]
    table["flags"] = [
        FLAG_REQUIRES_GRAD * s.requires_grad + FLAG_CONJ * s.conj + FLAG_NEG * s.neg for s in specs
    ]
    table["offset"] = [s.offset for s in specs]
    count = 2 * int(table["ndim"].sum())
    dims = np.fromiter(itertools.chain.from_iterable(s.size + s.stride for s in specs), "<i8", count)
    return table, dims


def encode(
    staged_state_dict: Any,
    *,
    owner_rank: int,
    step: int,
    checkpoint_id: str,
    holder_rank: int | None = None,
    created: float | None = None,
) -> Encoded:
    """Lay out a staged (CPU) state_dict as a replica.

    Checksums every storage: CPU-bound, releases the GIL on large buffers; async callers
    run it in a worker thread.  The result views the staged storages, so they must not
    change until the replica is written or sent.  :func:`lay_out` plus
    :meth:`ReplicaLayout.encode`.

    A replica holds dicts, OrderedDicts, lists, tuples and namedtuples of: tensors and
    Parameters (CPU, allow-listed dtypes), numpy arrays and scalars of
    :data:`NUMPY_DTYPES`, ``None``, bools, ints, floats, complex numbers, strs, bytes,
    ``torch.Size``, ``torch.dtype`` and ``torch.device`` (see ``docs/format.md``).

    :param created: timestamp to record; default now.
    :raises UnsupportedInputError: a value the format cannot hold (names its key path), a
        tensor not on the CPU, or a header over :data:`HEADER_CAP`.
    :raises ConfigurationError: a rank, step or id out of range.
    """
    return lay_out(
        staged_state_dict,
        owner_rank=owner_rank,
        step=step,
        checkpoint_id=checkpoint_id,
        holder_rank=holder_rank,
        created=created,
    ).encode()


class _ReplicaPlanner(_Planner):
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

    def array(self, x: np.ndarray[Any, Any], path: KeyPath) -> TensorNode:
        known = self.arrays.get(id(x))
        if known is not None:
            return known
        if _NUMPY_NAMES.get((x.dtype.kind, x.dtype.itemsize)) is None or x.dtype.fields is not None:
            raise UnsupportedInputError(
                path, f"numpy dtype {x.dtype} cannot be stored in a replica (only {', '.join(NUMPY_DTYPES)})"
            )
        if x.ndim > MAX_NDIM:
            raise UnsupportedInputError(
                path, f"{x.ndim} dimensions, the replica format holds at most {MAX_NDIM}"
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
            (), f"the replica header would be {nbytes} bytes, over the {HEADER_CAP}-byte cap"
        )


def _prefix_bytes(header: bytes) -> bytes:
    _check_header_len(len(header))
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    head += _CRC.pack(crc32c.crc32c(head))
    return head + bytes(_align(len(head)) - len(head))


def _scalar(value: Any) -> Any:
    """The JSON form of a scalar leaf or key, or raise TypeError/ValueError."""
    cls = type(value)
    if cls is float and not math.isfinite(value):
        return ["float", "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")]
    if cls is int and value.bit_length() > _INT_BITS_CAP:
        raise ValueError(f"int of {value.bit_length()} bits is too large for a replica header")
    if cls not in _SCALARS:
        raise TypeError(f"{cls.__qualname__} is not JSON-representable")
    return value


def _leaf(value: Any) -> Any:
    """The JSON form of a leaf value (docs/format.md, tree nodes), or raise TypeError/ValueError.

    Exact: numpy scalars are stored as their bits, so NaN payloads and -0.0 survive too.
    """
    cls = type(value)
    if cls in _SCALARS:
        return _scalar(value)
    if cls is bytes:
        return ["bytes", binascii.b2a_base64(value, newline=False).decode("ascii")]
    if cls is complex:
        return ["complex", _scalar(value.real), _scalar(value.imag)]
    if cls is torch.Size:
        if len(value) > MAX_NDIM or not all(-_INT64 <= n < _INT64 for n in value):
            raise ValueError(f"a torch.Size must hold at most {MAX_NDIM} 64-bit ints")
        return ["size", list(value)]
    if cls is torch.dtype:
        name = _TORCH_DTYPE_LEAF_NAMES.get(value)
        if name is None:
            raise ValueError(f"{value} is not a dtype a replica can name")
        return ["dtype", name]
    if cls is torch.device:
        return ["device", value.type, value.index]
    if isinstance(value, np.generic):
        name = _NUMPY_NAMES.get((value.dtype.kind, value.dtype.itemsize))
        if name is None or value.dtype.fields is not None:
            raise TypeError(f"numpy {value.dtype} scalars are not stored (only {', '.join(NUMPY_DTYPES)})")
        little = NUMPY_DTYPES[name].newbyteorder("<")
        return ["numpy", name, int.from_bytes(np.asarray(value, dtype=little).tobytes(), "little")]
    raise TypeError(f"{cls.__qualname__} is not a value a replica holds")


def _attr_name_ok(name: object) -> bool:
    return type(name) is str and name.isidentifier() and not name.startswith("__")


def _namedtuple_class(typename: str, fields: Sequence[str]) -> type:
    """The class a reader makes for a namedtuple; ValueError/TypeError for bad names.

    Validates the name and fields as identifiers (no keywords, no leading underscores, no
    repeats); imports and executes nothing.  The encoder calls it too, so that it refuses
    whatever a reader would.
    """
    made: type = collections.namedtuple(typename, fields)  # type: ignore[misc]
    return made


def _namedtuple_fields(cls: type) -> tuple[str, ...] | None:
    fields = getattr(cls, "_fields", None)
    if issubclass(cls, tuple) and isinstance(fields, tuple) and all(type(f) is str for f in fields):
        return fields
    return None


class _TreeEncoder:
    """Plan nodes to the JSON tree (see docs/format.md), rejecting what JSON cannot hold.

    It refuses everything the reader (:class:`_HeaderParser`) would refuse in an honest
    header (too many dimensions, several NaN keys in one dict, namedtuple names that are not
    identifiers), so that a replica that leaves :func:`encode` always parses: a peer that
    could not parse it would have to abort the transfer and break the process group.
    """

    def __init__(self, plan: StagePlan) -> None:
        self.plan = plan
        self.memo: dict[int, int] = {}  # plan memo -> post-order container number
        self.seen: set[int] = set()
        self.namedtuples: set[tuple[str, tuple[str, ...]]] = set()
        self.charged = 0  # what the reader will charge to its parse budget, see _parse_cost

    def node(self, n: Node, path: KeyPath, depth: int) -> Any:
        match n:
            case TensorNode(index):
                return self.tensor(index, path)
            case AtomNode(value):
                try:
                    return _leaf(value)
                except (TypeError, ValueError) as exc:
                    raise UnsupportedInputError(path, f"cannot be stored in a replica: {exc}") from exc
            case RefNode(memo):
                return ["ref", self.memo[memo]]
            case DictNode(memo, keys, values, proto, attrs):
                if proto is not None and type(proto) is not collections.OrderedDict:
                    raise UnsupportedInputError(
                        path,
                        f"{type(proto).__qualname__} cannot be stored in a replica (only dict, OrderedDict)",
                    )
                self._check_depth(path, depth)
                json_keys = []
                for key in keys:
                    try:
                        json_keys.append(_scalar(key))
                    except (TypeError, ValueError) as exc:
                        raise UnsupportedInputError(path, f"dict key {key!r} is not allowed: {exc}") from exc
                if json_keys.count(_NAN_KEY) > 1:
                    raise UnsupportedInputError(path, "several NaN dict keys would read back as one")
                json_values = self.children(keys, values, path, depth)
                json_attrs = {}
                for name, value in attrs:
                    if not _attr_name_ok(name):
                        raise UnsupportedInputError(path, f"attribute name {name!r} is not allowed")
                    json_attrs[name] = self.node(value, (*path, Attr(name)), depth + 1)
                self._done(memo)
                node: list[Any] = ["dict" if proto is None else "odict", json_keys, json_values]
                if json_attrs:  # e.g. the ``_metadata`` torch puts on every module state_dict
                    node.append(json_attrs)
                return node
            case SeqNode(memo, cls, items, proto, attrs):
                fields = _namedtuple_fields(cls) if cls not in (list, tuple) else None
                if (cls not in (list, tuple) and fields is None) or proto is not None or attrs:
                    raise UnsupportedInputError(
                        path,
                        f"{cls.__qualname__} cannot be stored in a replica (only list, tuple, namedtuple)",
                    )
                if fields is not None:
                    self._check_namedtuple(cls, fields, len(items), path)
                self._check_depth(path, depth)
                json_items = self.children(range(len(items)), items, path, depth)
                self._done(memo)
                if fields is not None:
                    return ["namedtuple", cls.__name__, list(fields), json_items]
                return ["list" if cls is list else "tuple", json_items]
            case CopyNode(value) | ObjectNode(cls=value):
                what = value.__qualname__ if isinstance(value, type) else type(value).__qualname__
                raise UnsupportedInputError(
                    path,
                    f"{what} cannot be stored in a replica (only tensors, numpy arrays, containers "
                    "and plain values: see docs/format.md)",
                )
        raise AssertionError(f"unknown plan node {n!r}")  # pragma: no cover

    def tensor(self, index: int, path: KeyPath) -> list[Any]:
        if index not in self.seen:
            self.seen.add(index)
            self.charged += _COST_PATH + 8 * len(path)
            self._check_tensor(self.plan.tensors[index], path)
        return ["tensor", index]

    def children(self, keys: Iterable[Any], nodes: Sequence[Node], path: KeyPath, depth: int) -> list[Any]:
        # Tensors are the bulk of a state_dict: met again, they need no key path and no
        # dispatch (about a third of the walk's time on 20,000 tensors).
        out: list[Any] = []
        append = out.append
        seen = self.seen
        for key, child in zip(keys, nodes, strict=True):
            if type(child) is TensorNode and child.position in seen:
                append(["tensor", child.position])
            elif type(child) is TensorNode:
                append(self.tensor(child.position, (*path, key)))
            else:
                append(self.node(child, (*path, key), depth + 1))
        return out

    def _done(self, memo: int) -> None:
        self.memo[memo] = len(self.memo)

    @staticmethod
    def _check_depth(path: KeyPath, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise UnsupportedInputError(path, f"containers nested deeper than {MAX_DEPTH} levels")

    def _check_namedtuple(self, cls: type, fields: tuple[str, ...], arity: int, path: KeyPath) -> None:
        if (cls.__name__, fields) not in self.namedtuples:
            try:
                _namedtuple_class(cls.__name__, fields)
            except (ValueError, TypeError) as exc:
                raise UnsupportedInputError(
                    path, f"{cls.__qualname__} cannot be stored in a replica: {exc}"
                ) from exc
            self.namedtuples.add((cls.__name__, fields))
            self.charged += _COST_NAMEDTUPLE + 256 * len(fields)
        if arity != len(fields):
            raise UnsupportedInputError(path, f"{cls.__qualname__} holds {arity} items, {len(fields)} fields")

    @staticmethod
    def _check_tensor(spec: TensorSpec, path: KeyPath) -> None:
        if spec.dtype not in _DTYPE_NAMES:
            raise UnsupportedInputError(path, f"dtype {spec.dtype} is not in the replica format's allow-list")
        if len(spec.size) > MAX_NDIM:
            raise UnsupportedInputError(
                path, f"{len(spec.size)} dimensions, the replica format holds at most {MAX_NDIM}"
            )
        if spec.attrs is not None:
            raise UnsupportedInputError(
                path, "tensors carrying Python attributes cannot be stored in a replica"
            )


# -- the parse cost bound -------------------------------------------------------------------

# What parsing may allocate, per token of the header text (bytes, CPython 3.11, 64-bit),
# measured on the densest headers of each kind (tests/test_format.py checks the sum bounds
# the real peak): a value is a pointer in its JSON list, an object (an int, a float, an
# AtomNode in the plan) and its slot in a plan tuple; a quote pair is a str object; a colon
# is an object member (a pair tuple while the object is built, a dict slot after).
_COST_VALUE: Final = 80
_COST_QUOTE: Final = 30
_COST_COLON: Final = 100
_COST_DIGIT: Final = 10
_COST_PATH: Final = 48  # a tensor's key path, stored in its TensorSpec: a tuple, plus 8 per key
_COST_NAMEDTUPLE: Final = 8192  # a namedtuple class, plus 256 per field
# Version-3 tables, per record (measured like the rest, see tests/test_format.py): a tensor's
# TensorSpec, its columns' temporaries, its Segment and checks; a dimension's ints, tuple
# slots and index arrays; a storage's Segment and its three ints.
_COST_TENSOR: Final = 200
_COST_DIM: Final = 40
_COST_STORAGE: Final = 200
_DIGITS: Final = b"0123456789"
_SCAN: Final = 64 << 10  # bytes per step of the backwards search for the padding


def _parse_cost(raw: bytes) -> int:
    """An upper bound on what :func:`parse_prefix` allocates to parse header bytes ``raw``.

    Counted, not parsed: a few ``bytes.count`` passes and one ``translate`` (C speed).
    Values, strings, members and digits are charged by :data:`_COST_VALUE` and the like;
    the text itself once; the text without its trailing spaces (the padding) twice more,
    for string contents and transients, or five times where a backslash-u escape can widen
    a string to four bytes a character.  Tensor key paths and namedtuple classes depend on
    the structure, so the parser charges them as it meets them (:class:`_HeaderParser`) and
    the encoder counts them the same way (:class:`_TreeEncoder`).
    """
    unpadded = _unpadded_len(raw)
    text = raw[:unpadded]  # the padding holds no tokens: not scanned six times over
    values = text.count(b",") + text.count(b"[") + text.count(b"{") + 1
    digits = len(text) - len(text.translate(None, _DIGITS))
    return (
        len(raw)
        + (5 if b"\\u" in text else 2) * unpadded
        + _COST_VALUE * values
        + _COST_QUOTE * text.count(b'"')
        + _COST_COLON * text.count(b":")
        + _COST_DIGIT * digits
    )


def _unpadded_len(raw: bytes) -> int:
    """Length of ``raw`` without its trailing spaces; ``bytes.rstrip`` crawls over megabytes."""
    end = len(raw)
    while end:
        start = max(0, end - _SCAN)
        kept = np.frombuffer(raw, np.uint8, end - start, start) != 0x20
        if kept.any():
            return end - int(np.argmax(kept[::-1]))
        end = start
    return 0


def _table_cost(tensors: int, dims: int, storages: int) -> int:
    """What parsing version-3 tables of these sizes allocates: checks and Python objects."""
    return _COST_TENSOR * tensors + _COST_DIM * dims + _COST_STORAGE * storages


def _parse_budget(header_len: int, text: bytes, version: int, table_cost: int = 0) -> int:
    """What is left for the structure-dependent charges; negative: refuse the header.

    ``header_len`` is the whole header, ``text`` its JSON (all of it before version 3).
    """
    factor = PARSE_AMPLIFICATION if version >= 2 else LEGACY_PARSE_AMPLIFICATION
    return factor * header_len + PARSE_SLACK - _parse_cost(text) - table_cost


def _padded(text: bytes, binary_len: int, charged: int) -> bytes:
    """JSON ``text`` with the trailing spaces that make its header fit :data:`PARSE_AMPLIFICATION`.

    A space adds one byte of length and one of cost, so ``p`` spaces raise the budget by
    ``3p``.  ``binary_len`` bytes of tables precede the text in the header; ``charged`` is
    what the tables and the tree's structure cost beyond the text's tokens.
    """
    short = -_parse_budget(binary_len + len(text), text, FORMAT_VERSION) + charged
    return text + b" " * max(0, -(-short // (PARSE_AMPLIFICATION - 1)))


# -- decoding -----------------------------------------------------------------------------


def prefix_nbytes(fixed: bytes | bytearray | memoryview) -> int:
    """Length of the whole prefix, from its first :data:`FIXED_PREFIX_NBYTES` bytes.

    Checks magic, version and the header length cap, so a reader can size its next read
    without trusting anything else.

    :raises IntegrityError: fewer than 20 bytes, wrong magic or version, header too long.
    """
    if len(fixed) < FIXED_PREFIX_NBYTES:
        raise IntegrityError(f"truncated: {len(fixed)} bytes, a replica starts with {FIXED_PREFIX_NBYTES}")
    magic, version, header_len = _FIXED.unpack(bytes(fixed[:FIXED_PREFIX_NBYTES]))
    if magic != MAGIC:
        raise IntegrityError(f"not an astage replica: magic {magic!r}")
    if version not in READ_VERSIONS:
        raise IntegrityError(
            f"unsupported replica format version {version} (this astage reads {sorted(READ_VERSIONS)})"
        )
    if header_len > HEADER_CAP:
        raise IntegrityError(f"header length {header_len} is over the {HEADER_CAP}-byte cap")
    return _align(FIXED_PREFIX_NBYTES + header_len + _CRC.size)


@without_gc
def parse_prefix(data: bytes | bytearray | memoryview) -> ReplicaHeader:
    """Validate a replica's prefix and return its header; bytes after the prefix are ignored.

    :raises IntegrityError: truncated, corrupt, tampered or malformed in any way.
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
    raw = bytes(view[FIXED_PREFIX_NBYTES:header_end])
    tables = _split_tables(raw) if version >= 3 else None
    json_start = 0 if tables is None else tables.nbytes
    json_raw = raw[json_start:]  # the same object before version 3
    table_cost = 0 if tables is None else _table_cost(*tables.counts)
    budget = _parse_budget(header_len, json_raw, version, table_cost)
    if budget < 0:
        raise IntegrityError(
            f"header of {header_len} bytes is too dense: parsing it could allocate "
            f"{_parse_cost(json_raw) + table_cost} bytes, more than its format-{version} bound "
            "(docs/format.md)"
        )
    try:
        # Without the padding, which json.loads would only skip.
        text = str(memoryview(json_raw)[: _unpadded_len(json_raw)], "ascii")
    except UnicodeDecodeError as exc:  # the encoder escapes every non-ASCII character
        raise IntegrityError(f"header is not ASCII: {exc}") from exc
    del raw, json_raw
    try:
        doc = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"header is not valid JSON: {exc}") from exc
    del text
    return _HeaderParser(total, version, budget, tables).parse(doc)


class _Tables(NamedTuple):
    """The binary tables of a version-3 header, viewed in place (not yet validated)."""

    tensors: np.ndarray[Any, Any]
    dims: np.ndarray[Any, Any]
    storages: np.ndarray[Any, Any]
    nbytes: int

    @property
    def counts(self) -> tuple[int, int, int]:
        return len(self.tensors), len(self.dims), len(self.storages)


def _split_tables(raw: bytes) -> _Tables:
    """The tables at the start of a version-3 header; their sizes checked against ``raw``."""
    if len(raw) < _COUNTS.size:
        raise _fail("tables", f"{len(raw)} bytes, the table counts alone take {_COUNTS.size}")
    tensors, dims, storages, reserved = _COUNTS.unpack_from(raw)
    if reserved:
        raise _fail("tables", "the reserved count is not zero")
    # Each count is checked against the bytes before it is multiplied: no overflow.
    room = len(raw) - _COUNTS.size
    at = _COUNTS.size
    views = []
    for name, count, record in (
        ("tensor", tensors, TENSOR_RECORD),
        ("dims", dims, np.dtype("<i8")),
        ("storage", storages, STORAGE_RECORD),
    ):
        if count > room // record.itemsize:
            raise _fail("tables", f"{count} {name} records do not fit in the {len(raw)}-byte header")
        views.append(np.frombuffer(raw, record, count, at))
        at += count * record.itemsize
        room -= count * record.itemsize
    return _Tables(views[0], views[1], views[2], at)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a replica header")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return out


def _fail(where: str, message: str) -> IntegrityError:
    return IntegrityError(f"header {where}: {message}")


def _int(value: Any, where: str, lo: int = 0, hi: int = _INT64) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise _fail(where, f"expected an int in [{lo}, {hi}), got {value!r:.80}")
    return value


def _list(value: Any, where: str, length: int | None = None) -> list[Any]:
    if type(value) is not list or (length is not None and len(value) != length):
        raise _fail(where, f"expected a list{'' if length is None else f' of {length}'}, got {value!r:.80}")
    return value


def _object(
    value: Any, where: str, required: frozenset[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if type(value) is not dict or not required <= value.keys() <= required | optional:
        raise _fail(where, f"expected an object with keys {sorted(required)}, got {value!r:.120}")
    return value


def _dims(value: Any, where: str, what: str) -> tuple[int, ...]:
    """A shape-like list: at most :data:`MAX_NDIM` ints in [0, 2**63)."""
    if type(value) is not list or len(value) > MAX_NDIM:
        raise _fail(where, f"{what} must be a list of at most {MAX_NDIM} ints, got {value!r:.80}")
    for n in value:
        if type(n) is not int or not 0 <= n < _INT64:
            raise _fail(where, f"{what} {value!r:.80} holds {n!r:.40}, not an int in [0, 2**63)")
    return tuple(value)


_DOC_KEYS: Final = frozenset(
    {
        "format",
        "owner_rank",
        "holder_rank",
        "step",
        "checkpoint_id",
        "created",
        "body_nbytes",
        "storages",
        "tensors",
        "tree",
    }
)
_DOC_KEYS_V3: Final = (_DOC_KEYS - {"storages", "tensors"}) | {"dtensors"}
_DTENSOR_KEYS: Final = frozenset({"placements", "global_shape"})
_EXACT_LIMIT: Final = 1 << 20
"""Version-3 extents are computed column-wise in int64 for tensors whose sizes and strides
are all below this (no sum can overflow); the others, rare, are checked one by one."""


def _where(path: KeyPath) -> str:
    return f"tree at {format_key_path(path):.200}"


def _float_part(raw: Any) -> float | None:
    if type(raw) is float:
        return raw
    if type(raw) is list and len(raw) == 2 and raw[0] == "float" and raw[1] in _NONFINITE:
        return _NONFINITE[raw[1]]
    return None


def _bytes_leaf(text: Any) -> bytes | None:
    if type(text) is not str:
        return None
    return binascii.a2b_base64(text.encode("ascii"), strict_mode=True)


def _complex_leaf(real: Any, imag: Any) -> complex | None:
    re, im = _float_part(real), _float_part(imag)
    return None if re is None or im is None else complex(re, im)


def _size_leaf(dims: Any) -> torch.Size | None:
    if type(dims) is not list or len(dims) > MAX_NDIM:
        return None
    if not all(type(n) is int and -_INT64 <= n < _INT64 for n in dims):
        return None
    return torch.Size(dims)


def _dtype_leaf(name: Any) -> torch.dtype | None:
    return _TORCH_DTYPE_LEAVES.get(name) if type(name) is str else None


def _device_leaf(kind: Any, index: Any) -> torch.device | None:
    if type(kind) is not str or not 0 < len(kind) <= 32 or not _DEVICE_TYPE_CHARS.issuperset(kind):
        return None
    if index is None:
        return torch.device(kind)
    if type(index) is not int or not 0 <= index < 1 << 15:
        return None
    return torch.device(kind, index)  # RuntimeError for a type torch does not know


def _numpy_leaf(name: Any, bits: Any) -> np.generic | None:
    dtype = NUMPY_DTYPES.get(name) if type(name) is str else None
    if dtype is None or type(bits) is not int or not 0 <= bits < 1 << (8 * dtype.itemsize):
        return None
    if dtype.kind == "b" and bits > 1:
        return None
    value: np.generic = np.frombuffer(bits.to_bytes(dtype.itemsize, "little"), dtype.newbyteorder("<"))[0]
    return value


_LEAF_DECODERS: Final[Mapping[str, Callable[..., Any]]] = {
    "bytes": _bytes_leaf,
    "complex": _complex_leaf,
    "size": _size_leaf,
    "dtype": _dtype_leaf,
    "device": _device_leaf,
    "numpy": _numpy_leaf,
}
"""Format-2 leaf tags to their decoders: each returns the value, or ``None`` if malformed."""


class _Specs(NamedTuple):
    root: Node
    tensors: tuple[TensorSpec, ...]


class _Columns(NamedTuple):
    """A validated tensor table as Python lists, one per column (``tolist`` is one C call)."""

    storages: list[int]
    codes: list[int]
    ndims: list[int]
    starts: list[int]
    offsets: list[int]
    kinds: list[int]
    flags: list[int]
    dims: list[int]


def _first(bad: np.ndarray[Any, Any]) -> int:
    return int(np.flatnonzero(bad)[0])


def _storage_table(records: np.ndarray[Any, Any], body_nbytes: int) -> tuple[Segment, ...]:
    """Version 3's storages, checked as whole columns: canonical offsets, inside the body."""
    offsets = records["offset"]
    nbytes = records["nbytes"]
    if records["reserved"].any():
        raise _fail(f"storages[{_first(records['reserved'] != 0)}]", "the reserved field is not zero")
    # Both below 2**63 once checked against the body, so their sums cannot overflow uint64.
    over = (nbytes > body_nbytes) | (offsets > body_nbytes)
    if over.any():
        raise _fail(f"storages[{_first(over)}]", f"overruns the {body_nbytes}-byte body")
    ends = offsets + nbytes
    aligned = np.zeros(len(records), np.uint64)
    aligned[1:] = (ends[:-1] + (ALIGNMENT - 1)) // ALIGNMENT * ALIGNMENT
    misplaced = offsets != aligned
    if misplaced.any():
        i = _first(misplaced)
        raise _fail(f"storages[{i}]", f"offset {offsets[i]} is not the aligned offset {aligned[i]}")
    over = ends > body_nbytes
    if over.any():
        i = _first(over)
        raise _fail(f"storages[{i}]", f"bytes [{offsets[i]}, {ends[i]}) overrun the {body_nbytes}-byte body")
    end = int(ends[-1]) if len(ends) else 0
    if end != body_nbytes:
        raise _fail("body_nbytes", f"{body_nbytes} bytes, but the storages end at {end}")
    columns = zip(offsets.tolist(), nbytes.tolist(), records["crc32c"].tolist(), strict=True)
    return tuple(map(Segment._make, columns))


def _check_tensor_table(tables: _Tables, segments: Sequence[Segment]) -> _Columns:
    """Version 3's tensors, checked as whole columns with numpy: indices, codes, flags and
    every tensor inside its storage.  The rare tensor with a dimension or stride of
    :data:`_EXACT_LIMIT` or more is checked on its own with Python ints."""
    records, dims = tables.tensors, tables.dims
    count = len(records)
    storage = records["storage"].astype(np.int64)
    code = records["dtype"].astype(np.int64)
    ndim = records["ndim"].astype(np.int64)
    kind = records["kind"]
    flags = records["flags"]
    offset = records["offset"]
    for bad, what in (
        (storage >= len(segments), f"storage is not one of the {len(segments)} storages"),
        (code >= len(DTYPE_CODES), f"dtype code is not one of the {len(DTYPE_CODES)} allowed"),
        (ndim > MAX_NDIM, f"more than {MAX_NDIM} dimensions"),
        (kind >= len(_KIND_CODES), "kind code is not 0, 1 or 2"),
        ((flags | _FLAGS) != _FLAGS, "unknown flag bits"),
        (offset < 0, "negative storage offset"),
    ):
        if bad.any():
            raise _fail(f"tensors[{_first(bad)}]", what)
    if 2 * int(ndim.sum()) != len(dims):
        raise _fail("dims", f"{len(dims)} entries, the tensors have {int(ndim.sum())} dimensions")
    if (dims < 0).any():
        raise _fail("dims", "a negative size or stride")
    floating = _CODE_FLOATING[code]
    for bad, what in (
        ((flags & FLAG_REQUIRES_GRAD != 0) & ~floating, "only floating or complex tensors require grad"),
        ((flags & FLAG_CONJ != 0) & ~_CODE_COMPLEX[code], "only complex tensors have a conjugate bit"),
        ((flags & FLAG_NEG != 0) & ~floating, "only floating or complex tensors have a negative bit"),
        ((kind == 2) & (~_CODE_NUMPY[code] | (flags != 0)), "an ndarray needs a numpy dtype and no flags"),
    ):
        if bad.any():
            raise _fail(f"tensors[{_first(bad)}]", what)
    # Each tensor's sizes, then its strides, in the dims array; ``first`` is where its
    # dimensions start among all tensors' dimensions, ``owner`` the tensor of each.
    starts = np.zeros(count, np.int64)
    np.cumsum(2 * ndim[:-1], out=starts[1:])
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
    storage_nbytes = np.fromiter((s.nbytes for s in segments), np.int64, len(segments))
    past = ~empty & ~large & ((last + 1) * _CODE_ITEMSIZE[code] > storage_nbytes[storage])
    if past.any():
        i = _first(past)
        raise _fail(f"tensors[{i}]", f"reaches past its {segments[int(storage[i])].nbytes}-byte storage")
    if len(segments) and (np.bincount(storage, minlength=len(segments)) == 0).any():
        raise _fail("storages", "a storage is not referenced by any tensor")
    columns = _Columns(
        storage.tolist(),
        code.tolist(),
        ndim.tolist(),
        starts.tolist(),
        offset.tolist(),
        kind.tolist(),
        flags.tolist(),
        dims.tolist(),
    )
    for i in np.flatnonzero(large).tolist():
        _check_extent(columns, i, segments)
    return columns


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


def _check_extent(columns: _Columns, i: int, segments: Sequence[Segment]) -> None:
    """One tensor's element count and extent, with Python ints (see :func:`_check_tensor_table`)."""
    start, ndim = columns.starts[i], columns.ndims[i]
    size = columns.dims[start : start + ndim]
    stride = columns.dims[start + ndim : start + 2 * ndim]
    where = f"tensors[{i}]"
    if _numel_overflows(size):
        raise _fail(where, f"shape {size} has too many elements")
    if 0 in size:
        return
    last = columns.offsets[i] + sum((n - 1) * st for n, st in zip(size, stride, strict=True))
    nbytes = segments[columns.storages[i]].nbytes
    if last >= _INT64 or (last + 1) * _CODE_DTYPES[columns.codes[i]].itemsize > nbytes:
        raise _fail(where, f"shape {size} with stride {stride} reaches past its {nbytes}-byte storage")


class _RawTensor(NamedTuple):
    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    kind: TensorKind
    requires_grad: bool
    note: DTensorNote | None


class _HeaderParser:
    """Header JSON to :class:`ReplicaHeader`, checking every field."""

    def __init__(self, prefix_len: int, version: int, budget: int, tables: _Tables | None = None) -> None:
        self.prefix_len = prefix_len
        self.version = version
        self.budget = budget  # see _parse_cost
        self.tables = tables
        self.containers = 0
        self.paths: list[KeyPath | None] = []
        self.namedtuples: dict[tuple[str, tuple[str, ...]], type] = {}

    def parse(self, doc: Any) -> ReplicaHeader:
        if self.tables is not None:
            doc = _object(doc, "document", _DOC_KEYS_V3)
            if doc["format"] != FORMAT_VERSION or type(doc["format"]) is not int:
                raise _fail("format", f"expected {FORMAT_VERSION}, got {doc['format']!r:.40}")
        else:
            doc = _object(doc, "document", _DOC_KEYS)
            # The binary version set the parse bound; the JSON one says which nodes may appear.
            schema = doc["format"]
            if type(schema) is not int or schema not in (1, 2):
                raise _fail("format", f"expected one of [1, 2], got {schema!r:.40}")
            self.version = schema
        holder = doc["holder_rank"]
        checkpoint_id = doc["checkpoint_id"]
        if type(checkpoint_id) is not str or len(checkpoint_id) > _ID_CAP:
            raise _fail("checkpoint_id", f"expected a str of at most {_ID_CAP} characters")
        created = doc["created"]
        if type(created) is not float or not math.isfinite(created):
            raise _fail("created", f"expected a finite float, got {created!r:.40}")
        body_nbytes = _int(doc["body_nbytes"], "body_nbytes")
        if self.tables is not None:
            segments, specs, notes = self.tables_v3(self.tables, body_nbytes, doc)
        else:
            segments, specs, notes = self.tables_v2(doc, body_nbytes)
        plan = StagePlan(specs.root, specs.tensors, tuple(StorageSpec(s.nbytes, _CPU) for s in segments))
        return ReplicaHeader(
            owner_rank=_int(doc["owner_rank"], "owner_rank", 0, _RANK_LIMIT),
            holder_rank=None if holder is None else _int(holder, "holder_rank", 0, _RANK_LIMIT),
            step=_int(doc["step"], "step", -_INT64),
            checkpoint_id=checkpoint_id,
            created=created,
            body_nbytes=body_nbytes,
            prefix_nbytes=self.prefix_len,
            segments=segments,
            plan=plan,
            dtensors=notes,
            version=self.version,
        )

    def tables_v2(
        self, doc: dict[str, Any], body_nbytes: int
    ) -> tuple[tuple[Segment, ...], _Specs, tuple[DTensorNote | None, ...]]:
        """Storages and tensors as JSON lists (versions 1 and 2), then the tree."""
        segments = self.segments(_list(doc["storages"], "storages"), body_nbytes)
        raw_tensors = [
            self.tensor(t, f"tensors[{i}]", segments) for i, t in enumerate(_list(doc["tensors"], "tensors"))
        ]
        self.paths = [None] * len(raw_tensors)
        root = self.node(doc["tree"], (), 0)
        paths = self.all_paths()
        if len({t.storage for t in raw_tensors}) != len(segments):
            raise _fail("storages", "a storage is not referenced by any tensor")
        specs = tuple(
            TensorSpec(path, t.storage, t.dtype, t.size, t.stride, t.offset, t.kind, t.requires_grad)
            for t, path in zip(raw_tensors, paths, strict=True)
        )
        return segments, _Specs(root, specs), tuple(t.note for t in raw_tensors)

    def all_paths(self) -> list[KeyPath]:
        unused = [i for i, p in enumerate(self.paths) if p is None]
        if unused:
            raise _fail("tensors", f"tensor {unused[0]} is not referenced by the tree")
        return self.paths  # type: ignore[return-value]  # no None left

    def tables_v3(
        self, tables: _Tables, body_nbytes: int, doc: dict[str, Any]
    ) -> tuple[tuple[Segment, ...], _Specs, tuple[DTensorNote | None, ...]]:
        """The binary tables (version 3), checked column by column, then the tree."""
        self.paths = [None] * len(tables.tensors)
        # The JSON tree goes as soon as it is walked: the specs below are the peak.
        tree = doc.pop("tree")
        root = self.node(tree, (), 0)
        del tree
        paths = self.all_paths()
        segments = _storage_table(tables.storages, body_nbytes)
        columns = _check_tensor_table(tables, segments)
        notes = self.dtensor_notes(doc["dtensors"], columns.kinds)
        dims = columns.dims
        specs = tuple(
            TensorSpec(
                path,
                storage,
                _CODE_DTYPES[code],
                tuple(dims[start : start + ndim]),
                tuple(dims[start + ndim : start + 2 * ndim]),
                offset,
                _KIND_CODES[kind],
                flags & FLAG_REQUIRES_GRAD != 0,
                flags & FLAG_CONJ != 0,
                flags & FLAG_NEG != 0,
            )
            for path, storage, code, ndim, start, offset, kind, flags in zip(
                paths,
                columns.storages,
                columns.codes,
                columns.ndims,
                columns.starts,
                columns.offsets,
                columns.kinds,
                columns.flags,
                strict=True,
            )
        )
        return segments, _Specs(root, specs), notes

    def dtensor_notes(self, raw: Any, kinds: list[int]) -> tuple[DTensorNote | None, ...]:
        notes: list[DTensorNote | None] = [None] * len(kinds)
        last = -1
        for entry in _list(raw, "dtensors"):
            if type(entry) is not list or len(entry) != 3:
                raise _fail("dtensors", f"expected [index, placements, global_shape], got {entry!r:.80}")
            index, placements, global_shape = entry
            if type(index) is not int or not last < index < len(kinds) or kinds[index] == 2:
                raise _fail(
                    "dtensors", f"index {index!r:.40} is not a later tensor of kind tensor or parameter"
                )
            if type(placements) is not str:
                raise _fail("dtensors", "placements must be a str")
            notes[index] = DTensorNote(placements, _dims(global_shape, "dtensors", "global_shape"))
            self.charge(_COST_PATH + 8 * len(global_shape) + len(placements))
            last = index
        return tuple(notes)

    @staticmethod
    def segments(raw: list[Any], body_nbytes: int) -> tuple[Segment, ...]:
        # The layout is canonical (each segment at the first aligned offset after the
        # previous one, nothing after the last), so in-bounds and non-overlapping follow.
        # One pass of inline checks: a header may list tens of thousands of storages.
        out = []
        end = 0
        for i, entry in enumerate(raw):
            if type(entry) is not list or len(entry) != 3:
                raise _fail(f"storages[{i}]", f"expected a list of 3, got {entry!r:.80}")
            offset, nbytes, crc = entry
            aligned = _align(end)
            if type(offset) is not int or offset != aligned:
                raise _fail(f"storages[{i}]", f"offset {offset!r:.40} is not the aligned offset {aligned}")
            if type(nbytes) is not int or type(crc) is not int or not (nbytes >= 0 and 0 <= crc < 1 << 32):
                raise _fail(f"storages[{i}]", f"expected a length and a crc32c, got {entry!r:.80}")
            end = offset + nbytes
            if end > body_nbytes:
                raise _fail(f"storages[{i}]", f"bytes [{offset}, {end}) overrun the {body_nbytes}-byte body")
            out.append(Segment(offset, nbytes, crc))
        if end != body_nbytes:
            raise _fail("body_nbytes", f"{body_nbytes} bytes, but the storages end at {end}")
        return tuple(out)

    def tensor(self, raw: Any, where: str, segments: Sequence[Segment]) -> _RawTensor:
        # Inline checks, no helper calls per dimension: this runs once per tensor.
        if type(raw) is not list or len(raw) not in (7, 8):
            raise _fail(where, f"expected a list of 7 or 8 fields, got {raw!r:.80}")
        storage, dtype_name, shape, stride, offset, kind, requires_grad = raw[:7]
        if type(storage) is not int or not 0 <= storage < len(segments):
            raise _fail(where, f"storage {storage!r:.40} is not one of the {len(segments)} storages")
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise _fail(where, f"dtype {dtype_name!r:.40} is not allowed")
        size = _dims(shape, where, "shape")
        strides = _dims(stride, where, "stride")
        if len(strides) != len(size):
            raise _fail(where, f"{len(strides)} strides for {len(size)} dimensions")
        if type(offset) is not int or not 0 <= offset < _INT64:
            raise _fail(where, f"offset {offset!r:.40} is not an int in [0, 2**63)")
        if _numel_overflows(size):
            raise _fail(where, f"shape {size} has too many elements")
        if 0 not in size:
            last = offset
            for n, st in zip(size, strides, strict=True):
                last += (n - 1) * st
            if last >= _INT64 or (last + 1) * dtype.itemsize > segments[storage].nbytes:
                raise _fail(
                    where,
                    f"shape {size} with stride {strides} at offset {offset} reaches past its "
                    f"{segments[storage].nbytes}-byte storage",
                )
        tensor_kind = _KINDS.get(kind) if type(kind) is str else None
        if tensor_kind is None:
            raise _fail(where, f"kind must be one of {sorted(_KINDS)}, got {kind!r:.40}")
        if type(requires_grad) is not bool:
            raise _fail(where, "requires_grad must be a bool")
        if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
            raise _fail(where, f"a {dtype_name} tensor cannot require grad")
        if tensor_kind in _V2_KINDS and self.version < 2:
            raise _fail(where, f"kind {kind} needs format version 2")
        if tensor_kind is TensorKind.NDARRAY and (
            dtype_name not in NUMPY_DTYPES or requires_grad or len(raw) == 8
        ):
            raise _fail(
                where, f"an ndarray must have a numpy dtype, no grad and no DTensor note, got {raw!r:.80}"
            )
        note = None
        if len(raw) == 8:
            dt = _object(raw[7], f"{where} dtensor", _DTENSOR_KEYS)
            if type(dt["placements"]) is not str:
                raise _fail(f"{where} dtensor", "placements must be a str")
            global_shape = _dims(dt["global_shape"], f"{where} dtensor", "global_shape")
            note = DTensorNote(dt["placements"], global_shape)
        return _RawTensor(storage, dtype, size, strides, offset, tensor_kind, requires_grad, note)

    def charge(self, nbytes: int) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise _fail("document", "too dense: parsing it would allocate more than its bound (_parse_cost)")

    def scalar(self, raw: Any, path: KeyPath) -> Any:
        if type(raw) in _SCALARS:
            return raw
        if type(raw) is list and len(raw) == 2 and raw[0] == "float" and raw[1] in _NONFINITE:
            return _NONFINITE[raw[1]]
        raise _fail(_where(path), f"expected a JSON scalar, got {raw!r:.80}")

    def leaf(self, raw: list[Any], path: KeyPath) -> Any:
        """A tagged leaf of format version 2 (``raw[0]`` is in :data:`_V2_LEAVES`)."""
        tag = raw[0]
        if self.version < 2:
            raise _fail(_where(path), f"{tag!r} leaves need format version 2")
        try:
            value = _LEAF_DECODERS[tag](*raw[1:])
        except (TypeError, ValueError, OverflowError, RuntimeError, binascii.Error) as exc:
            raise _fail(_where(path), f"malformed {tag} leaf {raw!r:.80}: {exc}") from exc
        if value is None:
            raise _fail(_where(path), f"malformed {tag} leaf {raw!r:.80}")
        return value

    def node(self, raw: Any, path: KeyPath, depth: int) -> Node:
        if type(raw) is not list or not raw or raw[0] == "float":
            return AtomNode(self.scalar(raw, path))
        if type(raw[0]) is str and raw[0] in _V2_LEAVES:
            return AtomNode(self.leaf(raw, path))
        tag = raw[0]
        if tag == "tensor" and len(raw) == 2 and type(raw[1]) is int and 0 <= raw[1] < len(self.paths):
            index = raw[1]
            if self.paths[index] is None:
                self.paths[index] = path
                self.charge(_COST_PATH + 8 * len(path))
            return TensorNode(index)
        where = _where(path)
        if tag == "ref":
            return RefNode(_int(_list(raw, where, 2)[1], where, 0, self.containers))
        if depth >= MAX_DEPTH:
            raise _fail(where, f"containers nested deeper than {MAX_DEPTH} levels")
        node: Node
        if tag in ("dict", "odict"):
            _, keys, values, *more = _list(raw, where, 4 if tag == "odict" and len(raw) == 4 else 3)
            keys = [self.scalar(k, path) for k in _list(keys, where)]
            values = _list(values, where, len(keys))
            if len(dict.fromkeys(keys)) != len(keys):
                raise _fail(where, "duplicate dict key")
            nodes = self.children(keys, values, path, depth)
            attrs = self.attrs(more[0], path, depth) if more else ()
            proto: dict[Any, Any] | None = None if tag == "dict" else collections.OrderedDict()
            node = DictNode(self.containers, tuple(keys), nodes, proto, attrs)
        elif tag in ("list", "tuple"):
            items = _list(_list(raw, where, 2)[1], where)
            nodes = self.children(range(len(items)), items, path, depth)
            node = SeqNode(self.containers, list if tag == "list" else tuple, nodes, None, ())
        elif tag == "namedtuple":
            _, typename, fields, items = _list(raw, where, 4)
            fields = _list(fields, where)
            items = _list(items, where, len(fields))
            nodes = self.children(range(len(items)), items, path, depth)
            node = SeqNode(self.containers, self.namedtuple(typename, fields, where), nodes, None, ())
        else:
            raise _fail(where, f"unknown or malformed node {raw!r:.80}")
        self.containers += 1
        return node

    def children(self, keys: Iterable[Any], raws: list[Any], path: KeyPath, depth: int) -> tuple[Node, ...]:
        # Tensor references are the bulk of a tree: checked inline, a key path made only for
        # a tensor's first reference (the same checks as node()).
        out: list[Node] = []
        append = out.append
        paths = self.paths
        for key, raw in zip(keys, raws, strict=True):
            if (
                type(raw) is list
                and len(raw) == 2
                and raw[0] == "tensor"
                and type(raw[1]) is int
                and 0 <= raw[1] < len(paths)
            ):
                if paths[raw[1]] is None:
                    paths[raw[1]] = child = (*path, key)
                    self.charge(_COST_PATH + 8 * len(child))
                append(TensorNode(raw[1]))
            else:
                append(self.node(raw, (*path, key), depth + 1))
        return tuple(out)

    def attrs(self, raw: Any, path: KeyPath, depth: int) -> tuple[tuple[str, Node], ...]:
        if type(raw) is not dict or not raw or not all(_attr_name_ok(name) for name in raw):
            raise _fail(
                _where(path), f"attributes must be a non-empty object of plain names, got {raw!r:.80}"
            )
        return tuple((name, self.node(v, (*path, Attr(name)), depth + 1)) for name, v in raw.items())

    def namedtuple(self, typename: Any, fields: list[Any], where: str) -> type:
        if type(typename) is not str or not all(type(f) is str for f in fields):
            raise _fail(where, "namedtuple name and fields must be strs")
        key = (typename, tuple(fields))
        known = self.namedtuples.get(key)
        if known is not None:
            return known
        try:
            self.charge(_COST_NAMEDTUPLE + 256 * len(fields))
            made = _namedtuple_class(typename, fields)
        except (ValueError, TypeError) as exc:
            raise _fail(where, f"invalid namedtuple: {exc}") from exc
        self.namedtuples[key] = made
        return made


class BodyVerifier:
    """Checks a body against its header as the bytes arrive, in order: zero gaps, crcs.

    Feed the body from its first byte with :meth:`update`, in pieces of any size, then call
    :meth:`finish`.  Each storage's crc32c is compared as soon as its last byte is in, so a
    body streamed from a peer is verified while later pieces are still on the wire, and no
    second pass over it is needed.  CPU-bound (checksums): async callers run it in a worker
    thread.
    """

    def __init__(self, header: ReplicaHeader) -> None:
        self.header = header
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
        self._check(view, base, end)
        self.nbytes = end

    def finish(self) -> None:
        """Check that the whole body came in.

        :raises IntegrityError: fewer bytes than the header says.
        """
        if self.nbytes != self.header.body_nbytes:
            raise IntegrityError(f"body is {self.nbytes} bytes, the header says {self.header.body_nbytes}")
        self._check(memoryview(b""), self.nbytes, self.nbytes)  # empty storages at the very end

    def _check(self, view: memoryview, base: int, end: int) -> None:
        # Locals, not attributes, in the loop: it runs once per storage.
        segments = self.header.segments
        index, crc, pos = self._index, self._crc, base
        try:
            while index < len(segments):
                offset, nbytes, expected = segments[index]
                if pos < offset:
                    stop = offset if offset < end else end
                    if any(view[pos - base : stop - base]):
                        raise IntegrityError(f"non-zero padding before storage {index}")
                    pos = stop
                seg_end = offset + nbytes
                if seg_end > end:  # the storage goes on in the next piece
                    if end > pos:
                        crc = crc32c.crc32c(view[pos - base :], crc)
                        pos = end
                    return
                if seg_end > pos:
                    crc = crc32c.crc32c(view[pos - base : seg_end - base], crc)
                    pos = seg_end
                if crc != expected:
                    raise IntegrityError(f"checksum mismatch in storage {index} (body bytes from {offset})")
                index += 1
                crc = 0
        finally:
            self._index, self._crc = index, crc


def verify_body(header: ReplicaHeader, body: torch.Tensor) -> None:
    """Check that ``body`` is exactly the body ``header`` describes: length, zero gaps, crcs.

    CPU-bound (checksums); async callers run it in a worker thread.

    :param body: a contiguous 1-D uint8 CPU tensor.
    :raises IntegrityError: wrong length, non-zero padding, checksum mismatch.
    :raises ConfigurationError: ``body`` is not a contiguous 1-D uint8 CPU tensor.
    """
    view = byte_view(body)
    if len(view) != header.body_nbytes:
        raise IntegrityError(f"body is {len(view)} bytes, the header says {header.body_nbytes}")
    verifier = BodyVerifier(header)
    verifier.update(view)
    verifier.finish()


def decode(header: ReplicaHeader, body: torch.Tensor) -> Any:
    """Verify ``body`` against ``header`` and rebuild the state_dict over it.

    Each storage becomes its own exactly-sized storage viewing ``body``'s memory (no copy),
    so ``body`` stays alive while any returned tensor does.  DTensors come back as their
    local tensor (a plain Tensor); :attr:`ReplicaHeader.dtensors` says what they were.

    :param body: a contiguous 1-D uint8 CPU tensor of ``header.body_nbytes`` bytes.
    :raises IntegrityError: the body does not match the header.
    :raises ConfigurationError: ``body`` is not a contiguous 1-D uint8 CPU tensor.
    """
    verify_body(header, body)
    array = body.numpy()
    storages = [
        torch.from_numpy(array[seg.offset : seg.offset + seg.nbytes]).untyped_storage()
        for seg in header.segments
    ]
    try:
        return rebuild(header.plan, storages)
    except RuntimeError as exc:  # pragma: no cover - the header checks should make this unreachable
        raise IntegrityError(f"cannot rebuild the tensors the header describes: {exc}") from exc
