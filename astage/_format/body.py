"""Checking a checkpoint file's body against its header, and rebuilding the tree over it.

:class:`BodyVerifier` checks a body as it arrives (zero gaps, every storage's crc32c);
:func:`verify_body` and :func:`decode` feed it a whole body.  Nothing is returned before
every storage is verified.  CPU-bound (checksums), pure: no file, socket or thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any, Final

import crc32c
import numpy as np
import torch

from .._staging.rebuild import rebuild
from .._util.collector import without_gc
from .._util.errors import ConfigurationError, IntegrityError
from .spec import ALIGNMENT, FileHeader

_GIL_BLOCK: Final = 2048
"""Items a C-speed ``map`` runs between two Python steps (~1 ms of small checksums)."""


def in_blocks(fn: Callable[[Any], int], items: Iterator[Any]) -> Iterator[int]:
    """``map(fn, items)`` a block at a time, for a worker thread.

    A ``map`` of a C function over tens of thousands of items is one C loop that holds the GIL for its
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
        crcs = np.fromiter(in_blocks(crc32c.crc32c, map(view.__getitem__, slices)), np.int64, last - first)
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
