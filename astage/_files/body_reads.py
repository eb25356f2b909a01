"""Read a checkpoint file's body straight into the memory it is meant for, verified as it lands.

A body read is a list of :class:`Piece` records, one per storage of the file in body order:
where its bytes lie in the body and the crc32c they must have.  A :class:`Sink` says where
each storage's bytes go (a slice of one body buffer, the caller's own tensor, a bounce
buffer) and hears when a storage has been verified.  The body is cut into contiguous
lanes of about equal bytes, read by worker threads at once; each lane reads a batch of
pieces with one ``preadv`` (the padding between them into a scratch buffer, checked to be
zero) and checksums each piece right after, while its bytes are still in the cache: one
pass over memory does both, and no byte reaches the caller unverified without the read
saying so (:class:`ReadLedger`).

Measured on the 1.49 GB GPT-2-like input, from the page cache (``benchmarks/bench_restore.py``):
``preadv`` into the destination beat ``mmap`` plus a copy (the copy then faults every page
of the mapping as well as the destination) and a ``readinto`` of a file object (the same
syscall under an extra layer); see ``benchmarks/README.md``.

Invariants:

* Every storage a sink is told is verified has exactly the bytes of the file whose
  checksum matched; every storage whose memory got any byte is in
  :attr:`ReadLedger.started` before the byte is written.
* A lane's worker-thread call reads about :data:`astage._files.durable.CHUNK_NBYTES`:
  cancellation lands after it, and progress is reported between calls, on the event loop.
* A failure in one lane stops the others after their current call; the first error is
  raised as it is.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol, cast

import anyio
import crc32c
import torch

from .._format.codec import FileHeader
from .._staging.copies import usable_cores
from .._staging.rebuild import make_tensor, rebuild_in_slices
from .._util.collector import without_gc
from .._util.errors import IntegrityError, one_error
from .._util.frames import drop_frames
from .._util.threads import run_sync
from .._util.timeslice import Steps, drive, each_block, run_steps, slice_over
from . import durable
from .durable import blocking_io
from .reading import opened_checked

log = logging.getLogger("astage.persist")

BATCH_BYTES: Final = 2 << 20
"""Most bytes one ``preadv`` reads: its bytes are checksummed right after, still in the cache."""

IOV_MAX: Final = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16

_ZEROS: Final = bytes(BATCH_BYTES)


class Piece(NamedTuple):
    """One storage of the body: where its bytes start and end, and their crc32c."""

    start: int
    nbytes: int
    crc: int
    storage: int


class Sink(Protocol):
    """Where each storage's bytes go; both methods are called in worker threads."""

    def dest(self, storage: int) -> memoryview:
        """Writable bytes of exactly the storage's size, for its bytes from the file."""
        ...

    def verified(self, storage: int, view: memoryview) -> None:
        """The storage's bytes are in ``view`` (what :meth:`dest` returned) and match."""
        ...


@dataclasses.dataclass
class ReadLedger:
    """What a read has done to its sink's memory, filled in by the lanes as they go."""

    started: set[int] = dataclasses.field(default_factory=set)
    """Storages whose memory got a byte (or was about to): they may be partly written."""
    verified: set[int] = dataclasses.field(default_factory=set)
    """Storages whose bytes were read whole and matched their checksum."""
    nbytes: int = 0


def read_lanes(threads: int) -> int:
    """Lanes a body read uses: one core fewer than the process may use, at most ``threads``."""
    return max(1, min(threads, usable_cores() - 1, 8))


def pieces_of(header: FileHeader) -> list[Piece]:
    """Every storage of ``header`` as a :class:`Piece`, in body order (run straight through)."""
    return drive(pieces_in_slices(header))


def pieces_in_slices(header: FileHeader) -> Steps[list[Piece]]:
    """:func:`pieces_of` a block of storages at a time, for the loop: made at once, 20,000
    records held a worker thread's GIL for ~5 ms, and the loop waited for it."""
    segments = header.segments
    pieces: list[Piece] = []
    columns = (segments.offsets, segments.nbytes, segments.crcs)

    def visit(block: Sequence[int]) -> None:
        r = cast(range, block)
        made = zip(*(c[r.start : r.stop].tolist() for c in columns), r, strict=True)
        pieces.extend(map(Piece._make, made))

    yield from each_block(range(len(segments)), visit)
    return pieces


def split_lanes(
    pieces: Sequence[Piece], begin: int, end: int, lanes: int
) -> list[tuple[int, int, list[Piece]]]:
    """``pieces`` (in body order, inside ``[begin, end)``) cut into at most ``lanes`` runs of
    about equal bytes: ``(start, stop, pieces)`` each, the runs covering ``[begin, end)`` in order."""
    target = -(-(end - begin) // max(1, lanes))
    runs: list[tuple[int, int, list[Piece]]] = []
    start, current = begin, []
    for piece in pieces:
        current.append(piece)
        stop = piece.start + piece.nbytes
        if stop - start >= target and len(runs) < lanes - 1:
            runs.append((start, stop, current))
            start, current = stop, []
    runs.append((start, end, current))
    return [run for run in runs if run[2] or run[1] > run[0]]


class LaneReader:
    """One lane: reads its run of the body in batches, checksums each piece as it lands.

    Blocking; each :meth:`run` is one worker-thread call of at most ``budget`` bytes.
    A short read (a signal, a read past 2 GiB) goes on from where it stopped.
    """

    def __init__(
        self,
        fd: int,
        prefix_nbytes: int,
        run: tuple[int, int, list[Piece]],
        sink: Sink,
        ledger: ReadLedger,
        path: Path,
    ) -> None:
        self.fd, self.base, self.sink, self.ledger, self.path = fd, prefix_nbytes, sink, ledger, path
        self.pos, self.end, self.pieces = run
        self.index = 0  # the piece whose bytes come next
        self.into = 0  # bytes of that piece already read
        self.crc = 0  # their running crc32c
        self.views: dict[int, memoryview] = {}  # destinations of the pieces begun, not finished
        self.scratch = bytearray(min(IOV_MAX, 1 + len(self.pieces)) * 64 + 64)

    @property
    def finished(self) -> bool:
        return self.pos >= self.end and self.index >= len(self.pieces)

    def close(self) -> None:
        self.views.clear()
        self.sink = _CLOSED

    def run(self, budget: int) -> int:
        """Read up to about ``budget`` bytes of the lane; the bytes read."""
        done = 0
        while not self.finished and done < budget:
            done += self._batch(min(BATCH_BYTES, budget - done))
        return done

    def _batch(self, budget: int) -> int:
        """One ``preadv`` of the next pieces and gaps, then their checks; the bytes read."""
        entries: list[tuple[int, memoryview]] = []  # (piece index, or -1 for a gap; view)
        pos, index, into, scratch_at, total = self.pos, self.index, self.into, 0, 0
        pieces = self.pieces
        while total < budget and len(entries) < IOV_MAX and (pos < self.end or index < len(pieces)):
            piece = pieces[index] if index < len(pieces) else None
            gap_end = self.end if piece is None else piece.start
            if pos < gap_end:  # padding before the next piece (or after the last)
                take = min(gap_end - pos, budget - total, len(self.scratch) - scratch_at)
                if take <= 0:
                    break
                entries.append((-1, memoryview(self.scratch)[scratch_at : scratch_at + take]))
                scratch_at += take
            else:
                assert piece is not None
                view = self.views.get(index)
                if view is None:
                    view = self.views[index] = self._dest(piece)
                take = min(piece.nbytes - into, budget - total)
                entries.append((index, view[into : into + take]))
                into += take
                if into == piece.nbytes:
                    index, into = index + 1, 0
            pos += take
            total += take
        got = self._read([view for _, view in entries], self.pos) if total else 0
        self._check(entries, got)
        return got

    def _dest(self, piece: Piece) -> memoryview:
        self.ledger.started.add(piece.storage)
        view = self.sink.dest(piece.storage)
        if len(view) != piece.nbytes:
            raise AssertionError(f"a sink gave {len(view)} bytes for a {piece.nbytes}-byte storage")
        return view

    def _read(self, views: list[memoryview], at: int) -> int:
        n = os.preadv(self.fd, views, self.base + at)
        if n == 0:
            raise IntegrityError(f"{self.path}: truncated while reading at offset {self.base + at}")
        return n

    def _check(self, entries: list[tuple[int, memoryview]], got: int) -> None:
        """Check the ``got`` bytes read into ``entries`` (in order); move the lane on.

        After a short read the entries past it wait for the next batch, which starts there.
        """
        for index, view in entries:
            k = min(len(view), got)
            got -= k
            if index < 0:
                if view[:k] != _ZEROS[:k]:
                    raise IntegrityError(f"{self.path}: non-zero padding before body offset {self.pos + k}")
            elif k:
                self.crc = crc32c.crc32c(view[:k], self.crc)
                self.into += k
            self.pos += k
            if index >= 0 and self.into == self.pieces[index].nbytes:
                self._finish(index)
            if k < len(view):
                return

    def _finish(self, index: int) -> None:
        piece = self.pieces[index]
        if self.crc != piece.crc:
            raise IntegrityError(
                f"{self.path}: checksum mismatch in storage {piece.storage} (body bytes from {piece.start})"
            )
        view = self.views.pop(index)
        self.index, self.into, self.crc = index + 1, 0, 0
        self.sink.verified(piece.storage, view)
        self.ledger.verified.add(piece.storage)
        self.ledger.nbytes += piece.nbytes


async def read_pieces(
    fd: int,
    header: FileHeader,
    pieces: Sequence[Piece],
    sink: Sink,
    *,
    path: Path,
    lanes: int,
    limiter: anyio.CapacityLimiter | None,
    on_read: Callable[[int], None] | None = None,
    ledger: ReadLedger | None = None,
    span: tuple[int, int] | None = None,
) -> ReadLedger:
    """Read ``pieces`` of the file open at ``fd`` into ``sink``, ``lanes`` worker threads at once.

    :param on_read: called on the loop with the bytes each worker-thread call read.
    :param span: the part of the body ``pieces`` lie in (default: all of it), padding included.
    :raises IntegrityError: a checksum mismatch, non-zero padding, or a truncated file; the
        other lanes stop after their current call.
    :raises OSError: a read failed.
    """
    ledger = ReadLedger() if ledger is None else ledger
    begin, end = (0, header.body_nbytes) if span is None else span
    runs = (
        split_lanes(pieces, begin, end, lanes)
        if len(pieces) < 1024
        else await run_sync(without_gc(split_lanes), pieces, begin, end, lanes, limiter=limiter)
    )

    readers = [LaneReader(fd, header.prefix_nbytes, run, sink, ledger, path) for run in runs]
    await _run_lanes(readers, limiter, on_read)
    return ledger


class _Lane(Protocol):
    @property
    def finished(self) -> bool: ...

    def run(self, budget: int) -> int: ...

    def close(self) -> None:
        """Let go of the memory read into (an idle worker thread keeps its last call, this
        lane's method, until its next one)."""


async def _run_lanes(
    lanes: Sequence[_Lane], limiter: anyio.CapacityLimiter | None, on_read: Callable[[int], None] | None
) -> None:
    """Each lane in its own task, a worker-thread call of about a chunk at a time."""

    async def lane(reader: _Lane) -> None:
        try:
            while not reader.finished:
                n = await run_sync(without_gc(reader.run), durable.CHUNK_NBYTES, limiter=limiter)
                if on_read is not None and n:
                    on_read(n)
        finally:
            reader.close()

    if len(lanes) == 1:
        await lane(lanes[0])
        return
    with one_error():
        async with anyio.create_task_group() as group:
            for reader in lanes:
                group.start_soon(lane, reader)


class _ClosedSink:
    """The sink of a lane that ended: it reads no more."""

    def dest(self, storage: int) -> memoryview:
        raise AssertionError("a closed lane read on")

    def verified(self, storage: int, view: memoryview) -> None:
        raise AssertionError("a closed lane read on")


_CLOSED: Final = _ClosedSink()


class BodySink:
    """Every storage into its place in one body buffer (a restore without a destination)."""

    def __init__(self, header: FileHeader, body: torch.Tensor) -> None:
        self.view = body.numpy().data if body.numel() else memoryview(bytearray())
        self.offsets = header.segments.offsets
        self.sizes = header.segments.nbytes

    def dest(self, storage: int) -> memoryview:
        start = int(self.offsets[storage])
        return self.view[start : start + int(self.sizes[storage])]

    def verified(self, storage: int, view: memoryview) -> None:
        """Nothing to do: the storage is already where the tree will view it."""


def storages_in_slices(header: FileHeader, body: torch.Tensor) -> Steps[list[torch.UntypedStorage]]:
    """Each storage of ``header`` as a storage of exactly its bytes viewing ``body``, in time slices."""
    whole = body.untyped_storage()
    base = int(body.storage_offset())
    starts = (header.segments.offsets + base).tolist()
    ends = (header.segments.offsets + header.segments.nbytes + base).tolist()
    out: list[torch.UntypedStorage] = []
    for start in range(0, len(starts), 512):
        out += map(whole.__getitem__, map(slice, starts[start : start + 512], ends[start : start + 512]))
        if slice_over():
            yield
    return out


def rebuild_verified_in_slices(header: FileHeader, body: torch.Tensor) -> Steps[Any]:
    """The state_dict over a body every byte of which was verified, in time slices."""
    storages = yield from storages_in_slices(header, body)
    specs = header.plan.tensors
    tree = yield from rebuild_in_slices(
        header.plan, lambda i: make_tensor(specs[i], storages[specs[i].storage])
    )
    return tree


MAP_MIN_BYTES: Final = 64 << 20
"""From this size a restore without a destination maps the file (:func:`mapped_body`)
instead of reading its body into a new buffer."""

POPULATE_MIN_BYTES: Final = 64 << 20
"""From this size a body buffer has its pages faulted in before the read (:func:`new_body`)."""

_MADV_POPULATE_READ: Final = 22  # Linux 5.14 and later
_MADV_POPULATE_WRITE: Final = 23
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
if _libc is not None:
    _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.madvise.restype = ctypes.c_int


def _populate(address: int, length: int, advice: int = _MADV_POPULATE_WRITE) -> bool:
    """Fault in the whole pages of ``[address, address + length)``, the GIL released (a
    ctypes call: ``mmap.madvise`` holds it); ``False`` where the kernel cannot (before
    Linux 5.14): the read then faults them itself.  ``_MADV_POPULATE_READ`` maps a file's
    pages readable without copying them (a private mapping's write would)."""
    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + length) // page * page
    if _libc is None:
        return False
    return end <= start or _libc.madvise(start, end - start, advice) == 0


async def new_body(nbytes: int, limiter: anyio.CapacityLimiter | None) -> torch.Tensor:
    """A fresh ``nbytes``-byte buffer for a body, its pages faulted in first where it is large.

    Faulting pages in by ``MADV_POPULATE_WRITE``, a chunk a worker-thread call, then reading
    into them beat reading into pages the read faults as it goes: 1 GB took 0.4-0.7 s to
    populate and 0.2-0.4 s to read, against 1.1-2.1 s read into fresh pages; ``restore()``
    of the 1.49 GB GPT-2 input went from 1.78-1.93 s to 1.54-1.66 s (medians of 3, two
    sessions on a shared 2-core VM).
    """
    body = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes < POPULATE_MIN_BYTES:
        return body
    address, chunk = body.data_ptr(), durable.CHUNK_NBYTES * 4
    for start in range(0, nbytes, chunk):
        if not await blocking_io(_populate, address + start, min(chunk, nbytes - start), limiter=limiter):
            break
    return body


async def read_checkpoint_file(
    path: str | os.PathLike[str],
    *,
    limiter: anyio.CapacityLimiter | None = None,
    check: Callable[[FileHeader], None] | None = None,
    dir_fd: int | None = None,
    on_read: Callable[[int], None] | None = None,
    lanes: int = 1,
) -> Any:
    """:func:`astage._files.durable.load_checkpoint_file`, read by ``lanes`` worker threads at
    once into one body buffer and verified in the same pass; the tree is rebuilt over it on
    the loop, in time slices (tensors view the one buffer: no allocation per tensor).

    :raises IntegrityError: as ``load_checkpoint_file``.
    :raises OSError: the file cannot be opened or read.
    """
    body: torch.Tensor | None = None
    try:
        async with opened_checked(path, limiter=limiter, check=check, dir_fd=dir_fd) as (f, header):
            pieces = await run_steps(pieces_in_slices(header))
            if header.body_nbytes >= MAP_MIN_BYTES:
                body = await blocking_io(mapped_body, f.fd, header, limiter=limiter)
            if body is not None:
                await verify_mapped(
                    body, header, pieces, path=f.path, lanes=lanes, limiter=limiter, on_read=on_read
                )
            else:
                body = await new_body(header.body_nbytes, limiter)
                sink = BodySink(header, body)
                await read_pieces(
                    f.fd, header, pieces, sink, path=f.path, lanes=lanes, limiter=limiter, on_read=on_read
                )
                del sink
        return await run_steps(rebuild_verified_in_slices(header, body))
    except BaseException as exc:
        # The body (a mapping of the file, or a buffer its size) goes now, not whenever the
        # traceback's frames are let go.
        body = None
        drop_frames(exc)
        raise


async def verify_mapped(
    body: torch.Tensor,
    header: FileHeader,
    pieces: Sequence[Piece],
    *,
    path: Path,
    lanes: int,
    limiter: anyio.CapacityLimiter | None,
    on_read: Callable[[int], None] | None = None,
) -> ReadLedger:
    """Check a mapped body (:func:`mapped_body`) in place, ``lanes`` worker threads at once:
    every storage's crc32c, every byte of padding zero.

    :raises IntegrityError: the first mismatch; the other lanes stop after their current call.
    """
    ledger = ReadLedger()
    runs = await run_sync(without_gc(split_lanes), pieces, 0, header.body_nbytes, lanes, limiter=limiter)
    view = body.numpy().data
    await _run_lanes([MappedLane(view, run, ledger, path) for run in runs], limiter, on_read)
    return ledger


# -- a body mapped, not read ----------------------------------------------------------------------


def mapped_body(fd: int, header: FileHeader) -> torch.Tensor | None:
    """The body of the file open at ``fd`` as a 1-D uint8 tensor over a private, writable
    mapping of the file, or ``None`` where it cannot be mapped (the file is shorter than
    its header says: reading it then says so).

    Safe to hand out as the restored tensors' memory because astage never writes a file in
    place: a file is written under a temporary name and renamed, and removed by unlink, and
    a mapped file's pages outlive both.  The mapping is private: a write to a restored
    tensor copies its page, and never reaches the file.  (A file truncated or rewritten in
    place by something else would change, or fault, tensors over it: a reason to
    ``restore(into=...)`` instead, which copies.)  The tensor holds the mapping; it is
    unmapped once no tensor views it.
    """
    end = header.prefix_nbytes + header.body_nbytes
    if os.fstat(fd).st_size < end or not header.body_nbytes:
        return None
    try:
        mapping = mmap.mmap(fd, end, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    return torch.frombuffer(mapping, dtype=torch.uint8)[header.prefix_nbytes :]


class MappedLane:
    """One lane of a mapped body: checks its run in place, piece by piece (crc32c), padding
    zero; each :meth:`run` a worker-thread call of about ``budget`` bytes, its pages mapped
    in first by one call that leaves the GIL released."""

    def __init__(self, body: memoryview, run: tuple[int, int, list[Piece]], ledger: ReadLedger, path: Path):
        self.body, self.ledger, self.path = body, ledger, path
        self.pos, self.end, self.pieces = run
        self.index = 0  # the next piece to check
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(body)) if len(body) else 0

    @property
    def finished(self) -> bool:
        return self.pos >= self.end

    def close(self) -> None:
        self.body = memoryview(b"")
        self.pos = self.end

    def run(self, budget: int) -> int:
        """Check the next pieces (about ``budget`` bytes, at least one) and the padding
        before them; the body bytes checked."""
        begin, first = self.pos, self.index
        while self.index < len(self.pieces) and (self.index == first or self._reach() - begin < budget):
            self.index += 1
        stop = self.end if self.index == len(self.pieces) else self._reach()
        _populate(self.address + begin, stop - begin, _MADV_POPULATE_READ)
        pos = begin
        for piece in self.pieces[first : self.index]:
            self._zeros(pos, piece.start)
            if crc32c.crc32c(self.body[piece.start : piece.start + piece.nbytes]) != piece.crc:
                where = f"storage {piece.storage} (body bytes from {piece.start})"
                raise IntegrityError(f"{self.path}: checksum mismatch in {where}")
            self.ledger.verified.add(piece.storage)
            self.ledger.nbytes += piece.nbytes
            pos = piece.start + piece.nbytes
        self._zeros(pos, stop)
        self.pos = stop
        return stop - begin

    def _reach(self) -> int:
        """Where the pieces checked so far end."""
        last = self.pieces[self.index - 1]
        return last.start + last.nbytes

    def _zeros(self, begin: int, end: int) -> None:
        for at in range(begin, end, BATCH_BYTES):
            k = min(BATCH_BYTES, end - at)
            if self.body[at : at + k] != _ZEROS[:k]:
                raise IntegrityError(f"{self.path}: non-zero padding before body offset {end}")
