"""The transport's wire format and the pure decisions about it: no I/O, no thread, no device.

A replica travels as a :class:`Payload`: a small ``prefix`` blob (the format's header) and
a logical ``body`` described by ``(offset, uint8 tensor)`` segments, gaps being zeros (or,
from the replica format, by :class:`ByteExtents`: offsets, sizes and addresses as columns,
with no tensor a segment).  On
the wire it is a preamble (``int64[PREAMBLE_WORDS]``), the prefix, then the body in
messages on a fixed grid of ``chunk_bytes`` (:func:`plan_chunks`), each kind on its own tag,
and an acknowledgement back (:func:`encode_ack`, :func:`decode_ack`).  Everything here is
checked before anything is allocated or sent; every function is testable without a group.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

from .._util.errors import ConfigurationError, IntegrityError
from .._util.limits import CHUNK_BYTES as CHUNK_BYTES  # the default body chunk, shared with the writers
from .._util.timeslice import Steps, slice_over

MAGIC = 0x4153_5441_4745_5752
"""First preamble word: ``b"ASTAGEWR"`` read as a big-endian int64."""
VERSION = 1
PREAMBLE_WORDS = 8

_TAG_BASE = 0x4153_0000
PREAMBLE_TAG = _TAG_BASE + 1
PREFIX_TAG = _TAG_BASE + 2
BODY_TAG = _TAG_BASE + 3
ACK_TAG = _TAG_BASE + 4
BREAK_TAG = _TAG_BASE + 5
"""Nobody ever sends on it: a timed-out receive there is how a group is broken."""

MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 1 << 30
MAX_PREFIX_BYTES = 64 << 20
"""Default cap on a received prefix, checked before it is allocated."""

ACK_BYTES = 256
_ACK_MAGIC = b"ASTGACK1"
_ACK_HEAD = struct.Struct("<8sBH")
ACK_MESSAGE_BYTES = ACK_BYTES - _ACK_HEAD.size
"""Longest peer message an acknowledgement carries (UTF-8 bytes; longer ones are cut)."""


@dataclass(frozen=True)
class Payload:
    """One replica to send.

    :ivar prefix: a small header blob, sent first.
    :ivar segments: ``(body_offset, tensor)`` pairs: 1-D contiguous CPU ``uint8`` tensors in
        ascending, non-overlapping offset order, inside ``body_nbytes``.  Gaps are zeros.
        A sequence that is also a :class:`ByteExtents` is planned from its columns.
    :ivar body_nbytes: size of the logical body.
    """

    prefix: bytes
    segments: Sequence[tuple[int, torch.Tensor]]
    body_nbytes: int

    def __post_init__(self) -> None:
        # The segments are checked where they are walked anyway (plan_chunks).
        if not isinstance(self.prefix, bytes):
            raise ConfigurationError(f"Payload.prefix must be bytes, got {type(self.prefix).__qualname__}")
        if type(self.body_nbytes) is not int or self.body_nbytes < 0:
            raise ConfigurationError(f"Payload.body_nbytes must be an int >= 0, got {self.body_nbytes!r}")


@dataclass(frozen=True)
class ExchangeStats:
    """What one call moved.

    :ivar bytes_sent: prefix and body bytes sent (the preamble not counted).
    :ivar bytes_received: prefix and body bytes received.
    :ivar seconds: wall time of the call.
    :ivar chunks_sent: body messages sent.
    :ivar chunks_packed: those of them that needed a packing copy.
    :ivar chunks_received: body messages received.
    """

    bytes_sent: int
    bytes_received: int
    seconds: float
    chunks_sent: int
    chunks_packed: int
    chunks_received: int

    @property
    def gbps(self) -> float:
        """Bytes moved in both directions per second, in GB/s."""
        return (self.bytes_sent + self.bytes_received) / max(self.seconds, 1e-9) / 1e9


@dataclass(frozen=True)
class Received:
    """A replica received from a peer.

    :ivar prefix: the header blob.
    :ivar body: a ``uint8`` CPU tensor of exactly ``body_nbytes`` (a view of the allocated one).
    :ivar stats: what the call moved.
    """

    prefix: bytes
    body: torch.Tensor
    stats: ExchangeStats


@runtime_checkable
class ByteExtents(Protocol):
    """Segments that describe themselves as columns, so that a body of many small storages
    is planned and packed without a tensor (and its checks, microseconds each) a segment.

    The producer vouches that every extent is readable CPU memory for as long as this
    object lives (it holds the storages); the plan still checks the offsets and sizes.
    """

    def extents(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """``(offsets, sizes, addresses)``: int64 body offsets, byte counts and data pointers."""
        ...

    def byte_tensor(self, index: int) -> torch.Tensor:
        """Segment ``index`` as a 1-D contiguous CPU ``uint8`` tensor (for a direct send)."""
        ...

    def extents_now(self, indices: Sequence[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """The addresses and sizes of segments ``indices`` now, as int64 columns (checked
        again just before they are read)."""
        ...


@dataclass(frozen=True)
class Gather:
    """A chunk packed from raw addresses: ``sizes[i]`` bytes at ``addresses[i]`` go to
    ``starts[i]`` (from the chunk's start); ``gaps`` says whether the rest must be zeroed.

    Part ``i`` lies in segment ``segments[i]`` of ``source``, planned at address
    ``bases[i]`` with ``extents[i]`` bytes: the packer checks that it still is before it
    reads (a storage resized meanwhile has moved; its old memory may be gone).  ``source``
    holds the memory the addresses point into.  ``starts``, ``bases`` and ``extents`` are
    int64 columns: the packer checks and places a chunk's parts in bulk.
    """

    starts: np.ndarray[Any, Any]
    addresses: list[int]
    sizes: list[int]
    gaps: bool
    source: ByteExtents
    segments: list[int]
    bases: np.ndarray[Any, Any]
    extents: np.ndarray[Any, Any]


@dataclass(frozen=True)
class Chunk:
    """One body message: ``parts`` fill ``[offset, offset + nbytes)`` in order.

    A part is a tensor (a segment or a slice of one), an ``int`` (that many zero bytes) or,
    alone, a :class:`Gather` that packs the whole chunk from raw addresses.
    """

    offset: int
    nbytes: int
    parts: tuple[torch.Tensor | int | Gather, ...]


@dataclass(frozen=True)
class ChunkPlan:
    """How a payload's body is cut into messages of at most ``chunk_bytes``."""

    chunks: tuple[Chunk, ...]
    chunk_bytes: int


Allocate = Callable[[int], torch.Tensor]
OnPrefix = Callable[[bytes], Awaitable[None]]
OnChunk = Callable[[int, torch.Tensor], Awaitable[None]]


def ring_peers(rank: int, world_size: int, offset: int | None = None) -> tuple[int, int]:
    """Return ``(send_to, recv_from)`` for ``rank`` in a ring with step ``offset``.

    ``send_to = (rank + k) % world_size`` and ``recv_from = (rank - k) % world_size``, with
    ``k = world_size // 2`` by default, so every rank receives exactly one replica.

    :raises ConfigurationError: ``world_size < 2``, ``rank`` out of range, or ``offset`` a
        multiple of ``world_size`` (a rank would send to itself).
    """
    if world_size < 2:
        raise ConfigurationError(f"replication needs at least 2 ranks, the group has {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigurationError(f"rank {rank} is not in a group of {world_size}")
    k = world_size // 2 if offset is None else offset
    if k % world_size == 0:
        raise ConfigurationError(
            f"peer_offset={k} maps every rank of a group of {world_size} to itself: "
            f"it must not be a multiple of {world_size}"
        )
    return (rank + k) % world_size, (rank - k) % world_size


WireKind = Literal["gloo", "nccl"]


def wire_kind(backend_config: str) -> WireKind:
    """Which wire serves a group with ``backend_config`` (``dist.get_backend_config(pg)``).

    ``"cpu:gloo,cuda:gloo"`` (plain gloo) and ``"cpu:gloo,cuda:nccl"`` get the gloo wire:
    the payload is on the CPU already, and a broken gloo group fails the peers at once.
    ``"cuda:nccl"`` (plain NCCL) gets the NCCL wire.

    :raises ConfigurationError: a group with neither gloo for CPU nor NCCL for CUDA.
    """
    by_device = dict(pair.split(":", 1) for pair in backend_config.lower().split(",") if ":" in pair)
    if by_device.get("cpu") == "gloo":
        return "gloo"
    if by_device.get("cuda") == "nccl":
        return "nccl"
    raise ConfigurationError(
        f"the transport needs gloo for CPU or NCCL for CUDA; this group's backends are {backend_config!r}"
    )


def plan_chunks(
    segments: Sequence[tuple[int, torch.Tensor]], body_nbytes: int, chunk_bytes: int
) -> Steps[ChunkPlan]:
    """Validate ``segments`` and cut the body into chunks on a grid of ``chunk_bytes``.

    Pure: touches no tensor data.  Runs as time-sliced :data:`Steps`.

    :raises ConfigurationError: a bad chunk size, segment tensor or segment offset.
    """
    check_chunk_bytes(chunk_bytes, ConfigurationError, "chunk_bytes")
    if body_nbytes < 0:
        raise ConfigurationError(f"body_nbytes must be >= 0, got {body_nbytes}")
    if isinstance(segments, ByteExtents):
        return (yield from _plan_extents(segments, body_nbytes, chunk_bytes))
    starts, ends, tensors = yield from _nonempty_segments(segments, body_nbytes)
    chunks: list[Chunk] = []
    s = 0
    steps = 0
    for start in range(0, body_nbytes, chunk_bytes):
        stop = min(start + chunk_bytes, body_nbytes)
        parts: list[torch.Tensor | int] = []
        append = parts.append
        pos = start
        while pos < stop:
            seg_start = starts[s]
            if seg_start > pos:
                gap_end = min(seg_start, stop)
                append(gap_end - pos)
                pos = gap_end
            elif pos == seg_start and ends[s] <= stop:
                append(tensors[s])
                pos = ends[s]
                s += 1
            else:
                part_end = min(ends[s], stop)
                append(tensors[s][pos - seg_start : part_end - seg_start])
                pos = part_end
                if pos == ends[s]:
                    s += 1
            steps += 1
            if not steps & _CLOCK_EVERY and slice_over():
                yield
        chunks.append(Chunk(start, stop - start, tuple(parts)))
    return ChunkPlan(tuple(chunks), chunk_bytes)


def _plan_extents(extents: ByteExtents, body_nbytes: int, chunk_bytes: int) -> Steps[ChunkPlan]:
    """:func:`plan_chunks` over columns: checked in bulk, each chunk sent straight from one
    segment when one covers it, else gathered from raw addresses."""
    offsets, sizes, addresses = (np.asarray(column, dtype=np.int64) for column in extents.extents())
    _check_extents(offsets, sizes, body_nbytes)
    held = np.flatnonzero(sizes > 0)
    offsets, sizes, addresses = offsets[held], sizes[held], addresses[held]
    ends = offsets + sizes
    chunks: list[Chunk] = []
    for start in range(0, body_nbytes, chunk_bytes):
        stop = min(start + chunk_bytes, body_nbytes)
        # The segments that overlap [start, stop): ends are ascending, as offsets are.
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(offsets, stop, side="left"))
        if last == first:
            chunks.append(Chunk(start, stop - start, (stop - start,)))
        elif last - first == 1 and offsets[first] <= start and ends[first] >= stop:
            at = int(held[first])
            skip = start - int(offsets[first])
            view = extents.byte_tensor(at)[skip : skip + stop - start]
            chunks.append(Chunk(start, stop - start, (view,)))
        else:
            lo = np.maximum(offsets[first:last], start)
            hi = np.minimum(ends[first:last], stop)
            moved = hi - lo
            gather = Gather(
                starts=lo - start,
                addresses=(addresses[first:last] + (lo - offsets[first:last])).tolist(),
                sizes=moved.tolist(),
                gaps=int(moved.sum()) != stop - start,
                source=extents,
                segments=held[first:last].tolist(),
                bases=addresses[first:last],
                extents=sizes[first:last],
            )
            chunks.append(Chunk(start, stop - start, (gather,)))
        if slice_over():
            yield
    return ChunkPlan(tuple(chunks), chunk_bytes)


def _check_extents(offsets: np.ndarray[Any, Any], sizes: np.ndarray[Any, Any], body_nbytes: int) -> None:
    """The checks of :func:`_nonempty_segments`, over whole columns."""
    if not (offsets.ndim == sizes.ndim == 1 and len(offsets) == len(sizes)):
        raise ConfigurationError("extents must be three 1-D columns of one length")
    bad = np.flatnonzero((sizes < 0) | (offsets < 0))
    if len(bad):
        raise ConfigurationError(f"segment {int(bad[0])} has a negative offset or size")
    # Each offset at or past the end of every non-empty segment before it.
    ends = np.where(sizes > 0, offsets + sizes, 0)
    before = np.maximum.accumulate(np.concatenate(([0], ends[:-1]))) if len(ends) else ends
    bad = np.flatnonzero(offsets < before)
    if len(bad):
        i = int(bad[0])
        raise ConfigurationError(
            f"segment {i} at offset {int(offsets[i])} overlaps or precedes the one before it"
        )
    bad = np.flatnonzero(offsets + sizes > body_nbytes)
    if len(bad):
        i = int(bad[0])
        raise ConfigurationError(
            f"segment {i} ends at {int(offsets[i] + sizes[i])}, past the body's {body_nbytes} bytes"
        )


_CLOCK_EVERY = 63
"""Walks read the clock once every 64 steps (a step is well under a microsecond; reading the
clock every step was a third of a walk over 20,000 small segments)."""


def _nonempty_segments(
    segments: Sequence[tuple[int, torch.Tensor]], body_nbytes: int
) -> Steps[tuple[list[int], list[int], list[torch.Tensor]]]:
    """Check the segments; the non-empty ones as parallel lists of starts, ends and tensors.

    ``starts`` is closed by a sentinel at the body's end, so the grid walk needs no bound
    check.
    """
    starts: list[int] = []
    ends: list[int] = []
    tensors: list[torch.Tensor] = []
    end = 0
    tensor_type, uint8 = torch.Tensor, torch.uint8
    for i, (offset, tensor) in enumerate(segments):
        if not (
            isinstance(tensor, tensor_type)
            and tensor.dtype is uint8
            and tensor.is_cpu
            and tensor.dim() == 1
            and tensor.is_contiguous()
        ):
            raise ConfigurationError(f"segment {i} must be a 1-D contiguous CPU uint8 tensor")
        if offset < end:
            raise ConfigurationError(f"segment {i} at offset {offset} overlaps or precedes the one before it")
        n = tensor.numel()
        if offset + n > body_nbytes:
            raise ConfigurationError(f"segment {i} ends at {offset + n}, past the body's {body_nbytes} bytes")
        if n:
            end = offset + n
            starts.append(offset)
            ends.append(end)
            tensors.append(tensor)
        if not i & _CLOCK_EVERY and slice_over():
            yield
    starts.append(body_nbytes)
    return starts, ends, tensors


@dataclass(frozen=True)
class Limits:
    """How the receiving side checks, places and hands on what arrives.

    The hooks are awaited (:data:`OnPrefix`, :data:`OnChunk`) by the async calls, called by
    the blocking ones: whoever drives the call says which.
    """

    max_body_bytes: int
    max_prefix_bytes: int
    allocate: Allocate | None
    on_prefix: Callable[[bytes], object] | None
    on_chunk: Callable[[int, torch.Tensor], object] | None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prefix_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigurationError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("allocate", "on_prefix", "on_chunk"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigurationError(f"{name} must be callable or None, got {getattr(self, name)!r}")


def check_chunk_bytes(chunk_bytes: int, error: type[Exception], name: str) -> None:
    if type(chunk_bytes) is not int or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise error(f"{name} must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")


def preamble_words(prefix_len: int, body_nbytes: int, chunk_bytes: int) -> list[int]:
    """The sender's preamble, reserved words zero."""
    words = [MAGIC, VERSION, prefix_len, body_nbytes, chunk_bytes]
    return words + [0] * (PREAMBLE_WORDS - len(words))


def check_preamble(words: list[int], peer: int | None, limits: Limits) -> tuple[int, int, int]:
    magic, version, prefix_len, body_nbytes, chunk_bytes, *reserved = words
    source = f"rank {peer}"
    if magic != MAGIC:
        raise IntegrityError(f"{source} sent a preamble with bad magic {magic:#x}: not an astage transport")
    if version != VERSION:
        raise IntegrityError(f"{source} speaks transport version {version}, this rank speaks {VERSION}")
    if any(reserved):
        raise IntegrityError(f"{source} sent a preamble with non-zero reserved words")
    if not 0 <= prefix_len <= limits.max_prefix_bytes:
        raise IntegrityError(
            f"{source} announces a prefix of {prefix_len} B; the cap is {limits.max_prefix_bytes} B"
        )
    if not 0 <= body_nbytes <= limits.max_body_bytes:
        raise IntegrityError(
            f"{source} announces a body of {body_nbytes} B; the cap is {limits.max_body_bytes} B"
        )
    check_chunk_bytes(chunk_bytes, IntegrityError, f"{source}'s chunk size")
    return prefix_len, body_nbytes, chunk_bytes


def encode_ack(ok: bool, message: str) -> bytearray:
    """An acknowledgement: ``ok`` and ``message`` cut to :data:`ACK_MESSAGE_BYTES` whole characters."""
    text = message.encode("utf-8")[:ACK_MESSAGE_BYTES].decode("utf-8", errors="ignore").encode("utf-8")
    blob = bytearray(ACK_BYTES)
    _ACK_HEAD.pack_into(blob, 0, _ACK_MAGIC, 1 if ok else 0, len(text))
    blob[_ACK_HEAD.size : _ACK_HEAD.size + len(text)] = text
    return blob


def decode_ack(blob: bytes, peer: int | None) -> str | None:
    """``None`` for an ok acknowledgement from ``peer``, else the failure it reports.

    :raises IntegrityError: the acknowledgement is malformed.
    """
    magic, ok, length = _ACK_HEAD.unpack_from(blob)
    if magic != _ACK_MAGIC or ok not in (0, 1) or length > ACK_MESSAGE_BYTES:
        raise IntegrityError(f"rank {peer} sent a malformed acknowledgement")
    if ok:
        return None
    text = blob[_ACK_HEAD.size : _ACK_HEAD.size + length].decode("utf-8", errors="replace")
    return f"rank {peer} reports failure: {text or 'no reason given'}"
