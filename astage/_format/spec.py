"""The checkpoint file format's vocabulary: version, limits, dtype allow-list, header records, leaf tags.

Every other format module (:mod:`astage._format.codec` and the modules it is built from) takes
its constants from here, so a limit is written once: what the encoder refuses and what the
reader refuses cannot drift apart.  The layout itself is described in :mod:`astage._format.codec`
and ``docs/format.md``.  Pure: no file, socket or thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple, overload

import numpy as np
import torch

from .._staging.plan import StagePlan, TensorKind
from .._util.errors import ConfigurationError, IntegrityError
from .._util.limits import INT64 as _INT64
from .._util.limits import RANK_LIMIT as _RANK_LIMIT

MAGIC: Final = b"ASTAGE\x00R"
"""First 8 bytes of every checkpoint file."""

FORMAT_VERSION: Final = 6
"""The one layout version this module writes and reads: binary tensor and storage tables,
then the header's structure (the tree, with tensor runs, and its DTensor notes) as JSON,
then its values (the metadata and the scalar table the tree refers to) as JSON, padded for
the parse bound of :data:`astage._format.parse_bound.NODE_COSTS`.  A file of any other
version is refused (:func:`check_version`)."""

ALIGNMENT: Final = 64
"""Prefix length and every body segment offset are multiples of this."""

HEADER_CAP: Final = 64 << 20
"""Largest header JSON accepted (and produced), checked before anything is allocated."""

FIXED_PREFIX_NBYTES: Final = 20
"""Magic, version and header length: what must be read first to learn the prefix length."""

FIXED_FIELDS: Final = struct.Struct("<8sIQ")
"""The fixed start of a prefix: magic, version (u32) and header length (u64), little-endian."""

HEADER_CRC: Final = struct.Struct("<I")
"""The crc32c after the header, of every byte before it (u32, little-endian)."""

PARSE_AMPLIFICATION: Final = 4
"""Parsing a header allocates at most this many times its length (plus
:data:`PARSE_SLACK`); a header that could need more is refused before it is parsed, and the
encoder pads every header with spaces to fit (see :func:`text_parse_cost`)."""

PARSE_SLACK: Final = 256 << 10
"""Fixed allowance on top of the amplification bound: frames, small tables."""

MAX_DEPTH: Final = 128
"""Deepest container nesting accepted in the tree."""

MAX_NDIM: Final = 64
"""Most dimensions accepted for one tensor."""

ID_CAP: Final = 4096
"""Longest ``checkpoint_id`` a file holds (characters)."""

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

FLAG_REQUIRES_GRAD: Final = 1
FLAG_CONJ: Final = 2
FLAG_NEG: Final = 4
FLAG_NAMES: Final[Mapping[int, str]] = {
    FLAG_REQUIRES_GRAD: "requires_grad",
    FLAG_CONJ: "a conjugate bit",
    FLAG_NEG: "a negative bit",
}
"""The flags a file keeps for a tensor (its record's flag bits), and how a message names each."""


def allowed_flags(dtype: torch.dtype) -> int:
    """The flag bits a tensor of ``dtype`` may carry in a file: the one rule the encoder
    refuses by and the reader checks by, the flags torch itself lets such a tensor carry.

    Torch keeps a lazy negation on a tensor of any dtype (``torch._neg_view``; copying one
    negated view into another copies the bits as they are) and rebuilds it with the same
    call; a conjugate bit only on a complex tensor; ``requires_grad`` only on a floating or
    complex one.
    """
    flags = FLAG_NEG
    if dtype.is_floating_point or dtype.is_complex:
        flags |= FLAG_REQUIRES_GRAD
    if dtype.is_complex:
        flags |= FLAG_CONJ
    return flags


def flag_bits(requires_grad: bool, conj: bool, neg: bool) -> int:
    """A tensor's flags as bits."""
    return FLAG_REQUIRES_GRAD * requires_grad | FLAG_CONJ * conj | FLAG_NEG * neg


def tensor_refused(dtype: torch.dtype, kind: TensorKind, flags: int) -> str | None:
    """Why a file cannot hold a tensor of ``dtype``, ``kind`` and ``flags``, or ``None``.

    The one rule for a tensor's record: the encoder refuses by it (naming the key path)
    and the reader's table check is a lookup table made from it, so what one accepts the
    other does.  A DTensor is stored as its local tensor (kind ``tensor``).
    """
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        return f"dtype {dtype} is not in the checkpoint file format's allow-list"
    refused = flags & ~allowed_flags(dtype)
    if refused:
        names = " and ".join(what for bit, what in FLAG_NAMES.items() if refused & bit)
        return f"a {name} tensor cannot carry {names}"
    if kind is TensorKind.NDARRAY and (name not in NUMPY_DTYPES or flags):
        return "an ndarray needs a numpy dtype and no flags"
    if kind is TensorKind.BYTESIO and (name != "uint8" or flags):
        return "a bytesio entry is uint8 bytes with no flags"
    return None


NUMPY_DTYPES: Final[Mapping[str, np.dtype[Any]]] = {
    name: np.dtype(name)
    for name in (
        *("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"),
        *("float16", "float32", "float64", "complex64", "complex128"),
    )
}
"""numpy dtypes of the arrays and scalars a checkpoint file holds (each is also a torch dtype)."""

_NUMPY_NAMES: Final = {(dt.kind, dt.itemsize): name for name, dt in NUMPY_DTYPES.items()}
_DTYPE_NAMES: Final = {dtype: name for name, dtype in DTYPES.items()}


# -- data ---------------------------------------------------------------------------------


class Segment(NamedTuple):
    """Where one storage's bytes lie in the body, and their crc32c.

    A NamedTuple rather than a frozen dataclass: a header holds one per storage, and a
    NamedTuple is built several times faster (headers of tens of thousands of storages are parsed).
    """

    offset: int
    nbytes: int
    crc32c: int


class Segments(Sequence[Segment]):
    """A header's storages in body order, one :class:`Segment` each, kept as three int64
    columns (read-only numpy arrays: ``offsets``, ``nbytes``, ``crcs``).

    The records are made only where they are asked for, one at a time: a parse of many
    storages would otherwise make a tuple each that the cyclic collector tracks for as
    long as the header lives (a tuple subclass is never untracked), and the body checks
    and :func:`~astage._format.codec.decode` read the columns.  Equal to another ``Segments``
    (or a sequence of segments) with the same records.
    """

    __slots__ = ("crcs", "nbytes", "offsets")

    def __init__(
        self, offsets: np.ndarray[Any, Any], nbytes: np.ndarray[Any, Any], crcs: np.ndarray[Any, Any]
    ):
        columns = [np.array(c, np.int64) for c in (offsets, nbytes, crcs)]  # copies, never views
        if len({c.shape for c in columns}) != 1 or columns[0].ndim != 1:
            raise ValueError("Segments needs three 1-D columns of one length")
        for column in columns:
            column.flags.writeable = False
        self.offsets, self.nbytes, self.crcs = columns

    @classmethod
    def of(cls, records: Iterable[tuple[int, int, int]]) -> Segments:
        """The segments of ``(offset, nbytes, crc32c)`` records."""
        table = np.array(list(records), np.int64).reshape(-1, 3)
        return cls(table[:, 0], table[:, 1], table[:, 2])

    def columns(self) -> Iterator[tuple[int, int, int]]:
        """Each storage's ``(offset, nbytes, crc32c)`` as a plain tuple of ints, made as it is taken."""
        return zip(self.offsets.tolist(), self.nbytes.tolist(), self.crcs.tolist(), strict=True)

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, index: int) -> Segment: ...
    @overload
    def __getitem__(self, index: slice) -> Segments: ...
    def __getitem__(self, index: int | slice) -> Segment | Segments:
        if isinstance(index, slice):
            return Segments(self.offsets[index], self.nbytes[index], self.crcs[index])
        return Segment(int(self.offsets[index]), int(self.nbytes[index]), int(self.crcs[index]))

    def __iter__(self) -> Iterator[Segment]:
        return map(tuple.__new__, itertools.repeat(Segment), self.columns())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Segments):
            return all(np.array_equal(a, b) for a, b in zip(self.arrays(), other.arrays(), strict=True))
        if isinstance(other, Sequence):
            return list(self.columns()) == [tuple(item) for item in other]
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.columns()))

    def __repr__(self) -> str:
        return f"Segments({list(self)!r:.200})"

    def arrays(self) -> tuple[np.ndarray[Any, Any], ...]:
        """The three columns as arrays: offsets, sizes, checksums."""
        return self.offsets, self.nbytes, self.crcs


@dataclasses.dataclass(frozen=True, slots=True)
class DTensorNote:
    """What a DTensor was; decoding returns only its local shard, as a plain tensor."""

    placements: str
    global_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FileHeader:
    """A validated checkpoint file header.

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
    segments: Segments
    plan: StagePlan
    dtensors: tuple[DTensorNote | None, ...]
    version: int = FORMAT_VERSION

    @property
    def num_tensors(self) -> int:
        """Distinct tensors in the file (a tensor referenced twice counts once)."""
        return len(self.plan.tensors)

    @property
    def total_nbytes(self) -> int:
        """Length of the whole file: prefix plus body."""
        return self.prefix_nbytes + self.body_nbytes


def check_version(version: int) -> None:
    """Refuse a file of any version but :data:`FORMAT_VERSION`, naming both.

    :raises IntegrityError: another version.
    """
    if version != FORMAT_VERSION:
        raise IntegrityError(
            f"unsupported checkpoint file format version {version}: this astage reads "
            f"only version {FORMAT_VERSION} (files of older versions cannot be loaded)"
        )


def check_meta(
    owner_rank: int, holder_rank: int | None, step: int, checkpoint_id: str, created: float
) -> None:
    """Check a file's metadata as the encoder is given it.

    :raises ConfigurationError: a rank, step, id or time out of range.
    """
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
    if type(checkpoint_id) is not str or len(checkpoint_id) > ID_CAP:
        raise ConfigurationError(f"checkpoint_id must be a str of at most {ID_CAP} characters")
    if not math.isfinite(created):
        raise ConfigurationError(f"created must be a finite timestamp, got {created!r}")


def align_up(n: int) -> int:
    """``n`` rounded up to :data:`ALIGNMENT`."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def header_error(where: str, message: str) -> IntegrityError:
    """The error for a malformed header field: ``header <where>: <message>``."""
    return IntegrityError(f"header {where}: {message}")
