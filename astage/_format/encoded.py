"""A staged state_dict encoded as a checkpoint file: its prefix and the byte ranges of its body.

:class:`Encoded` views the staged storages themselves (nothing is copied): a writer or a
sender takes the file's bytes from :meth:`Encoded.buffers`, the transport its storages'
extents.  Pure: no file, socket or thread.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Final, Protocol, overload

import numpy as np
import torch

from .._util.errors import ConfigurationError
from .._util.limits import CHUNK_BYTES
from .body import byte_view
from .reader import parse_prefix
from .spec import ALIGNMENT, FileHeader

_ZEROS = bytes(ALIGNMENT)
_ZERO_VIEW: Final = memoryview(_ZEROS)
"""Gaps are slices of one view (a view made a gap was two objects more each)."""


class LaidOut(Protocol):
    """What an :class:`Encoded` was made from (:class:`astage._format.encoder.FileLayout`):
    its metadata, and the prefix it makes with given checksums and ranks."""

    @property
    def step(self) -> int: ...
    @property
    def checkpoint_id(self) -> str: ...
    @property
    def created(self) -> float: ...
    @property
    def owner_rank(self) -> int: ...
    @property
    def holder_rank(self) -> int | None: ...
    @property
    def storage_table(self) -> np.ndarray[Any, Any]: ...

    def with_ranks(self, owner_rank: int, holder_rank: int | None) -> LaidOut:
        """The same layout for these ranks (checked: :func:`astage._format.spec.check_meta`)."""
        ...

    def prefix(self, crcs: Sequence[int]) -> bytes:
        """Everything before the body, with these storage checksums."""
        ...


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A staged state_dict laid out as a checkpoint file, ready to write or send.

    :ivar prefix: every byte before the body.
    :ivar segments: ``(body offset, uint8 CPU tensor)`` per storage, viewing the staged
        storages themselves (nothing is copied); the bytes between them are zero.  From
        :func:`encode` the tensors are made on first use (:class:`StorageSegments`).
    :ivar body_nbytes: length of the body.
    :ivar layout: what it was encoded from, with ``crcs`` the storages' checksums: kept so
        that :meth:`relabel` can make the prefix for another rank without checksumming the
        body again (``None`` for a file received from a peer).
    """

    prefix: bytes
    segments: Sequence[tuple[int, torch.Tensor]]
    body_nbytes: int
    layout: LaidOut | None = dataclasses.field(default=None, repr=False)
    crcs: tuple[int, ...] = dataclasses.field(default=(), repr=False)

    def relabel(self, *, owner_rank: int, holder_rank: int | None) -> Encoded:
        """The same file, body shared, with these ranks in its header.

        A save that goes to a local file and to a peer is encoded and checksummed once;
        only the prefix (small) is made again for the peer's copy.

        :raises ConfigurationError: a rank out of range, or no layout to relabel.
        """
        if self.layout is None:
            raise ConfigurationError("only an Encoded made by encode() can be relabelled")
        layout = self.layout.with_ranks(owner_rank, holder_rank)
        return dataclasses.replace(self, prefix=layout.prefix(self.crcs), layout=layout)

    @functools.cached_property
    def header(self) -> FileHeader:
        """The header, exactly as a reader parses it.

        Parsed on first use, not by :func:`encode`: a sender needs only the bytes, and on
        many small tensors the parse costs as much as the rest of encoding.
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
            if len(view) <= chunk_nbytes:  # no new view: an object fewer a storage
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
            if isinstance(segments, StorageSegments) and not owned
            else ((offset, byte_view(tensor)) for offset, tensor in segments)
        )
        for offset, view in pairs:
            if offset > end:
                yield _ZERO_VIEW[: offset - end]
            yield view
            end = offset + len(view)


class StorageSegments(Sequence[tuple[int, torch.Tensor]]):
    """:attr:`Encoded.segments` of an encoded layout: ``(offset, uint8 tensor)`` a storage,
    the tensors made on first use.

    A uint8 tensor costs microseconds a storage, the bulk of encoding many small ones; a
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
        yield from zip(self.offsets, storage_views(self.storages, self._columns), strict=True)

    def extents(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Offsets, sizes and addresses as columns (the transport's ``ByteExtents``): the
        transport plans and packs many small storages from these without a tensor each.
        The addresses are valid while this object (which holds the storages) lives."""
        addresses, sizes = self._columns or storage_columns(self.storages)
        return np.fromiter(self.offsets, np.int64, len(self.offsets)), sizes, addresses

    def byte_tensor(self, index: int) -> torch.Tensor:
        """Storage ``index`` as a 1-D ``uint8`` tensor (a view, no copy)."""
        made = self._made
        return made[index][1] if made is not None else _storage_bytes(self.storages[index])

    def extents_now(self, indices: Sequence[int]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Storages ``indices``' addresses and sizes now, as int64 columns."""
        return storage_columns(list(map(self.storages.__getitem__, indices)))


_memory_view: Final = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi)
)
_PYBUF_READ: Final = 0x100
_EMPTY: Final = memoryview(b"")
_data_ptr: Final = torch.UntypedStorage.data_ptr
_nbytes: Final = torch.UntypedStorage.nbytes


_Column = np.ndarray[Any, Any]


def storage_columns(storages: Sequence[torch.UntypedStorage]) -> tuple[_Column, _Column]:
    """Each storage's data pointer and size in bytes, as int64 columns."""
    count = len(storages)
    pointers = np.fromiter(map(_data_ptr, storages), np.int64, count)
    return pointers, np.fromiter(map(_nbytes, storages), np.int64, count)


def storage_views(
    storages: Sequence[torch.UntypedStorage], columns: tuple[_Column, _Column] | None = None
) -> Iterator[memoryview]:
    """Read-only memoryviews of the storages' bytes, made as they are taken, which do not
    hold the storages: the caller does, for as long as the views are used.

    Each is a slice of one view of the address range the storages lie in, made at C
    speed: a view made through ctypes costs a microsecond a storage, the bulk of encoding
    many small ones, and a tensor or numpy view costs more (a ctypes array also leaves
    cyclic garbage).  Only the storages' own bytes are ever sliced out of that range.
    """
    pointers, sizes = (column.astype(np.uint64) for column in columns or storage_columns(storages))
    held = pointers[sizes > 0]  # an empty storage's pointer may be null
    if not len(held):
        return itertools.repeat(_EMPTY, len(storages))
    low = int(held.min())
    span = _memory_view(low, int((pointers + sizes).max()) - low, _PYBUF_READ)
    # An empty storage's slice is empty wherever its (unused) pointer points, below
    # the range too (its start then wraps around to past the end).
    starts = pointers - np.uint64(low)
    return map(span.__getitem__, map(slice, starts.tolist(), (starts + sizes).tolist()))


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)
