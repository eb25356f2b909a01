"""``restore(into=state_dict)``: a checkpoint's bytes straight into the caller's live tensors.

A :class:`Destination` is the caller's tree, planned once.  For each copy a restore tries
(its own file, a replica, a copy received from a peer), the copy's header is matched to
it first (:mod:`astage._checkpointer.destination`: nothing is written on a mismatch), then
the body is read by worker-thread lanes (:mod:`astage._files.body_reads`) straight into
the caller's CPU storages where the layouts agree, through a scratch buffer where they do
not, and through pooled pinned buffers and non-blocking copies on a side stream for
accelerator tensors (:class:`_DeviceCopies`), each storage verified before it is copied
on.  The returned tree is the file's, with the caller's own tensor objects in it.

What was written is tracked per destination key path (:class:`FillReport`): whatever ends
a restore before its end (a corrupt copy and no good one, an I/O error, cancellation), the
exception carries the report as ``fill_report`` (and in a note where it cannot), so no
tensor is ever left half-filled without saying so.  A copy refused half-way is followed
by the next one, which fills everything again.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import torch

from .._files.body_reads import (
    Piece,
    ReadLedger,
    pieces_in_slices,
    read_checkpoint_file,
    read_pieces,
    storages_in_slices,
)
from .._files.reading import opened_checked
from .._format.codec import FileHeader
from .._staging.events import wait_event
from .._staging.plan import PlannedSource, StagePlan, TensorSpec, plan_in_slices, supported_devices
from .._staging.pool import BufferKind, BufferPool, Lease
from .._staging.rebuild import Rebuilder, make_tensor, plain_tensor_mode
from .._util.collector import without_gc
from .._util.errors import CapacityError, KeyPath, format_key_path, one_error
from .._util.threads import run_sync
from .._util.timeslice import Steps, drive, run_steps, slice_over, within
from .destination import Fill, Mode, StorageFill, match_in_slices, places_in_slices
from .same_shape import same_shape_in_slices

log = logging.getLogger("astage.checkpointer")

WINDOW_BYTES: Final = 64 << 20
"""Bytes of accelerator-bound storages read into one pinned buffer before their copies are
enqueued; two such buffers are in use at once (one filling, one copying)."""

CALL_BYTES: Final = 32 << 20
"""Most bytes one worker-thread call copies out of a body already in memory."""

SAME_SHAPE_MESSAGE: Final = (
    "restore(into=...): matched by shape, %d storages read whole into the caller's tensors"
)
"""The debug record of a copy matched at a glance (:mod:`astage._checkpointer.same_shape`);
one matched by key path logs ``restore(into=...): matched by key path (why not by shape)``."""

FILLED: Final = "filled"
PARTIAL: Final = "partial"


@dataclasses.dataclass(frozen=True)
class FillReport:
    """What a ``restore(into=...)`` that did not finish did to the caller's tensors.

    :ivar filled: key paths whose tensors hold the checkpoint's verified bytes.
    :ivar partial: key paths whose tensors were written in part, or with bytes that then
        failed their checksum: their contents are undefined.
    :ivar untouched: key paths whose tensors were not written at all.
    """

    filled: tuple[KeyPath, ...]
    partial: tuple[KeyPath, ...]
    untouched: tuple[KeyPath, ...]

    def __str__(self) -> str:
        shown = ", ".join(map(format_key_path, self.partial[:3])) + (", ..." if len(self.partial) > 3 else "")
        text = (
            f"restore(into=...) did not finish: {len(self.filled)} tensor(s) filled, "
            f"{len(self.partial)} written in part, {len(self.untouched)} untouched"
        )
        return text + (f" (in part: {shown})" if self.partial else "")


class Destination:
    """The caller's tree being filled, and what has been written to it so far.

    Each copy's header is matched to the tree as it comes (:meth:`match`): at a glance where
    the tree has the file's shape (:mod:`astage._checkpointer.same_shape`), else by key path
    over a plan of the whole tree, made once, at the first copy that needs it.
    """

    def __init__(self, into: Any, max_bytes: int | None = None) -> None:
        self.into = into
        self.max_bytes = max_bytes
        """The staging cap (``max_staging_bytes``) its pinned buffers stay under, if any."""
        self.source: PlannedSource | None = None
        # Per copy tried, in order: its fill, and the storages written (in part or
        # unverified) and filled; the sets are added to from worker threads.
        self.copies: list[tuple[Fill, set[int], set[int]]] = []
        self.all_paths: Sequence[KeyPath] = ()

    def _plan_in_slices(self) -> Steps[PlannedSource]:
        """Plan ``into`` whole: its tensors (CPU or the machine's accelerator) and their key paths.

        :raises UnsupportedInputError: a value of ``into`` that cannot be planned, named.
        """
        if self.source is None:
            source = yield from plan_in_slices(self.into, allowed_devices=supported_devices())
            places = yield from places_in_slices(source.plan)
            self.source, self.all_paths = source, list(places)
        return self.source

    async def match(self, header: FileHeader) -> Fill:
        """How to fill this destination from a copy of ``header``.

        :raises DestinationMismatchError: before any byte of it is written.
        :raises UnsupportedInputError: a value of ``into`` that cannot be planned, named.
        """
        return await run_steps(self._match_in_slices(header))

    def _match_in_slices(self, header: FileHeader) -> Steps[Fill]:
        fill: Fill | str = yield from same_shape_in_slices(header.plan, self.into)
        if isinstance(fill, str):
            log.debug("restore(into=...): matched by key path (%s)", fill)
            source = yield from self._plan_in_slices()
            fill = yield from match_in_slices(header.plan, source, self.into)
        else:
            log.debug(SAME_SHAPE_MESSAGE, len(header.plan.storages))
        self.copies.append((fill, set(), set()))
        return fill

    def mark(self, fill: Fill, storage: int, state: str) -> None:
        """Storage ``storage`` of the copy ``fill`` is being written (``PARTIAL``) or filled."""
        current, touched, filled = self.copies[-1]  # registered by match(), on the loop
        assert current is fill, "a storage of an earlier copy"
        (touched if state == PARTIAL else filled).add(storage)

    def report(self) -> FillReport:
        """What this restore has done to the caller's tensors so far."""
        return drive(self.report_in_slices())

    def report_in_slices(self) -> Steps[FillReport]:
        """:meth:`report`, in time slices (a state of 20,000 tensors takes ~20 ms)."""
        state: dict[KeyPath, str] = {}
        for fill, touched, filled in self.copies:  # a later copy overwrites what an earlier wrote
            for storages, mark in ((list(touched - filled), PARTIAL), (list(filled), FILLED)):
                for storage in storages:
                    state.update(dict.fromkeys(fill.paths_of(storage), mark))
                    if slice_over():
                        yield
        # Every copy matched has the destination's tensors; before any, the plan has them.
        all_paths = self.copies[-1][0].tensor_paths() if self.copies else self.all_paths
        sorted_out: dict[str, list[KeyPath]] = {FILLED: [], PARTIAL: [], "": []}
        for path in all_paths:
            sorted_out[state.get(path, "")].append(path)
            if slice_over():
                yield
        return FillReport(tuple(sorted_out[FILLED]), tuple(sorted_out[PARTIAL]), tuple(sorted_out[""]))

    async def annotate(self, exc: BaseException) -> None:
        """Tell what ``exc`` left in the caller's tensors: ``exc.fill_report`` and a note.

        Shielded, in time slices: a restore that ended before any copy was matched plans the
        tree here, to name its tensors (all untouched).
        """
        with anyio.CancelScope(shield=True):
            if not self.copies:
                with contextlib.suppress(Exception):  # a tree that cannot be planned: none named
                    await run_steps(self._plan_in_slices())
            report = await run_steps(self.report_in_slices())
        with contextlib.suppress(AttributeError, TypeError):  # an exception class with slots
            exc.fill_report = report  # type: ignore[attr-defined]
        exc.add_note(str(report))
        if report.partial:
            log.warning("%s", report)


class _IntoRebuilder(Rebuilder):
    """The file's tree, with the caller's own objects where it holds the tensors filled."""

    def __init__(
        self, plan: StagePlan, local: Callable[[int], torch.Tensor], original: Callable[[int], Any]
    ) -> None:
        super().__init__(plan, local)
        self.original = original

    def tensor(self, index: int) -> torch.Tensor:
        original = self.original(index)
        if original is None:
            return super().tensor(index)
        self.tensors[index] = original
        return original  # type: ignore[no-any-return]


async def returned_tree(header: FileHeader, fill: Fill, kept: dict[int, torch.UntypedStorage]) -> Any:
    """The restored tree: the caller's tensors, and new non-tensor leaves (``kept``: the
    storages of the arrays and BytesIOs the file holds)."""
    specs = header.plan.tensors
    rebuilder = _IntoRebuilder(
        header.plan, lambda i: make_tensor(specs[i], kept[specs[i].storage]), fill.original
    )
    return await run_steps(within(plain_tensor_mode, rebuilder.node(header.plan.root)))


# -- copying a verified storage on --------------------------------------------------------------


def copy_pairs(
    fill: StorageFill, storage: torch.UntypedStorage, at: int = 0, *, non_blocking: bool = False
) -> None:
    """Copy a verified storage of the file, at byte ``at`` of ``storage``, into each caller
    tensor it fills (no autograd)."""
    with torch.no_grad():
        if fill.whole is not None:
            whole = _bytes(fill.whole)
            src = torch.empty(0, dtype=torch.uint8).set_(storage, at, (whole.numel(),), (1,))
            whole.copy_(src, non_blocking=non_blocking)
            return
        for spec, local in fill.pairs:
            local.copy_(_view(spec, storage, at), non_blocking=non_blocking)


def _view(spec: TensorSpec, storage: torch.UntypedStorage, at: int) -> torch.Tensor:
    """The file's tensor ``spec`` over ``storage`` whose bytes start at ``at`` (a multiple of
    the element size)."""
    if not at:
        return make_tensor(spec, storage)
    t = torch.empty(0, dtype=spec.dtype).set_(
        storage, spec.offset + at // spec.dtype.itemsize, spec.size, spec.stride
    )
    if spec.conj:
        t = t.conj()
    if spec.neg:
        t = torch._neg_view(t)
    return t


class _DeviceCopies:
    """Side streams that copy verified pinned bytes to accelerator tensors without blocking.

    Each side stream first waits for its device's current stream (the caller's pending
    work on the tensors comes first); copies are enqueued from the lanes' worker threads;
    :meth:`record` gives an event per stream, polled from the loop.
    """

    def __init__(self, devices: set[torch.device]) -> None:
        self.streams: dict[torch.device, Any] = {}
        for device in devices:
            if device.type == "cuda":
                side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream(device))
                self.streams[device] = side

    def enqueue(self, fill: StorageFill, storage: torch.UntypedStorage, at: int) -> None:
        """Enqueue ``fill``'s copies from byte ``at`` of the pinned ``storage`` (in a worker thread)."""
        device = fill.pairs[0][1].device
        side = self.streams.get(device)
        if side is None:  # no side stream for this device (CPU in tests): a blocking copy
            copy_pairs(fill, storage, at)
            return
        with torch.cuda.stream(side):
            copy_pairs(fill, storage, at, non_blocking=True)

    def record(self) -> list[Any]:
        return [side.record_event() for side in self.streams.values()]


# -- the sink -----------------------------------------------------------------------------------


class IntoSink:
    """Where each storage of a copy goes, and what happens once it is verified (worker threads)."""

    def __init__(self, fill: Fill, header: FileHeader, destination: Destination) -> None:
        self.fill, self.header, self.destination = fill, header, destination
        self.bounce: dict[int, torch.UntypedStorage] = {}
        # DIRECT storages being read: the caller's storage, held while its bytes land
        self.held: dict[int, torch.UntypedStorage] = {}
        # DEVICE storages of the windows being read or copied: (pinned buffer, byte offset)
        self.pinned: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self.devices: _DeviceCopies | None = None
        self.enqueued: list[int] = []  # DEVICE storages whose copies were enqueued, not yet waited for

    def dest(self, storage: int) -> memoryview:
        mode = self.fill.mode(storage)
        if mode is Mode.DIRECT:
            whole = self.fill.whole(storage)
            assert whole is not None
            self.held[storage] = whole
            self.destination.mark(self.fill, storage, PARTIAL)
            return _memory(whole.data_ptr(), whole.nbytes())
        nbytes = int(self.header.segments.nbytes[storage])
        if mode is Mode.DEVICE:
            pinned, at = self.pinned[storage]
            return _memory(pinned.data_ptr() + at, nbytes)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self.bounce[storage] = buf.untyped_storage()
        return _writable(buf)

    def take_enqueued(self) -> tuple[list[int], list[Any]]:
        """The storages whose copies were enqueued since the last call, and an event per
        side stream recorded after them (on the loop, between two windows)."""
        enqueued, self.enqueued = self.enqueued, []
        return enqueued, [] if self.devices is None else self.devices.record()

    def verified(self, storage: int, view: memoryview) -> None:
        mode = self.fill.mode(storage)
        if mode is Mode.DIRECT:
            self.destination.mark(self.fill, storage, FILLED)
            self.held.pop(storage, None)
            return
        if mode is Mode.FRESH:
            return
        fill = self.fill.storage(storage)
        self.destination.mark(self.fill, storage, PARTIAL)
        if fill.mode is Mode.DEVICE:
            assert self.devices is not None
            self.devices.enqueue(fill, *self.pinned[storage])
            self.enqueued.append(storage)
            return
        copy_pairs(fill, self.bounce[storage])
        if not fill.keep:
            del self.bounce[storage]
        self.destination.mark(self.fill, storage, FILLED)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """``storage`` as a 1-D uint8 tensor (made in the worker thread that uses it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _memory(address: int, nbytes: int) -> memoryview:
    """Writable bytes at ``address``, owned elsewhere (a caller's or a pooled storage that
    outlives the read): a ctypes view is made in ~1 us, a tensor's numpy view in ~5."""
    if not nbytes:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def _writable(t: torch.Tensor) -> memoryview:
    return t.numpy().data if t.numel() else memoryview(bytearray())


# -- reading a file into the destination -----------------------------------------------------------


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


def windows(
    pieces: Sequence[Piece], fill: Fill, body_nbytes: int, window_bytes: int
) -> list[tuple[int, int, list[Piece]]]:
    """``pieces`` cut where the accelerator-bound bytes of a window would pass
    ``window_bytes`` (one window when there are none): ``(start, stop, pieces)``."""
    out: list[tuple[int, int, list[Piece]]] = []
    start, device_bytes = 0, 0
    current: list[Piece] = []
    for piece in pieces:
        on_device = fill.mode(piece.storage) is Mode.DEVICE
        size = _aligned(piece.nbytes) if on_device else 0  # as its pinned buffer holds it
        if on_device and current and device_bytes + size > window_bytes:
            stop = current[-1].start + current[-1].nbytes
            out.append((start, stop, current))
            start, current, device_bytes = stop, [], 0
        current.append(piece)
        device_bytes += size
    out.append((start, body_nbytes, current))
    return out


@dataclasses.dataclass
class _Reading:
    fd: int
    path: Path
    header: FileHeader
    lanes: int
    limiter: anyio.CapacityLimiter | None
    on_read: Callable[[int], None] | None


async def fill_body(
    reading: _Reading, fill: Fill, destination: Destination
) -> dict[int, torch.UntypedStorage]:
    """Read the body of an open file into ``destination``; the storages kept for new leaves.

    :raises IntegrityError: a storage failed its checksum (the storages before it are
        filled, it and those being read beside it are marked in part).
    """
    header = reading.header
    sink = IntoSink(fill, header, destination)
    device_storages = fill.device_storages()
    pieces = await run_steps(pieces_in_slices(header))
    if not device_storages:
        await _read_window(reading, sink, (0, header.body_nbytes, pieces))
        return sink.bounce
    window_bytes, pool_bytes = _window_sizes(header, fill, device_storages, destination.max_bytes)
    cut = await run_sync(
        without_gc(windows), pieces, fill, header.body_nbytes, window_bytes, limiter=reading.limiter
    )
    sink.devices = _DeviceCopies({fill.storage(i).pairs[0][1].device for i in device_storages})
    kind = BufferKind.PINNED if torch.cuda.is_available() else BufferKind.PLAIN
    pool = BufferPool(kind, max_bytes=pool_bytes, retain=True)
    try:
        with one_error():  # the read's own error, not a group of it
            async with anyio.create_task_group() as group:
                for window in cut:
                    lease = await _lease(pool, window, fill, sink, window_bytes)
                    try:
                        await _read_window(reading, sink, window)
                    finally:
                        copies = sink.take_enqueued()
                        if lease is not None:
                            group.start_soon(_settle, sink, pool, lease, copies, (destination, fill))
    finally:
        with anyio.CancelScope(shield=True):
            await pool.aclose()
    return sink.bounce


async def _read_window(reading: _Reading, sink: IntoSink, window: tuple[int, int, list[Piece]]) -> ReadLedger:
    start, stop, pieces = window
    return await read_pieces(
        reading.fd,
        reading.header,
        pieces,
        sink,
        path=reading.path,
        lanes=reading.lanes,
        limiter=reading.limiter,
        on_read=reading.on_read,
        span=(start, stop),
    )


def _window_sizes(header: FileHeader, fill: Fill, device: list[int], cap: int | None) -> tuple[int, int]:
    """The bytes of a window and of the pool of pinned buffers for ``device`` storages: two
    windows in use at once (one filling, one copying), under the staging cap where there
    is one (the second waits for room: back-pressure, as for a stage).

    :raises CapacityError: one storage alone needs more than the cap (names its key path).
    """
    sizes = header.segments.nbytes
    biggest = max(device, key=lambda s: int(sizes[s]))
    need = _aligned(int(sizes[biggest]))
    if cap is None:
        return WINDOW_BYTES, 2 * max(WINDOW_BYTES, need)
    if need > cap:
        path = format_key_path(fill.paths_of(biggest)[0])
        raise CapacityError(
            f"{path}: restoring it to its device needs a {need:,}-byte pinned buffer, more than "
            f"max_staging_bytes={cap:,}; raise the cap, or restore into CPU tensors and copy"
        )
    return max(1, min(WINDOW_BYTES, cap // 2)), cap


async def _lease(
    pool: BufferPool, window: tuple[int, int, list[Piece]], fill: Fill, sink: IntoSink, window_bytes: int
) -> Lease | None:
    """A pinned buffer for the window's accelerator-bound storages, parted into ``sink.pinned``
    (each at a 64-byte boundary: a multiple of every element size)."""
    on_device = [p for p in window[2] if fill.mode(p.storage) is Mode.DEVICE]
    if not on_device:
        return None
    need = sum(_aligned(p.nbytes) for p in on_device)
    lease = await pool.acquire([max(need, window_bytes)])
    at = 0
    for piece in on_device:
        sink.pinned[piece.storage] = (lease.buffers[0], at)
        at += _aligned(piece.nbytes)
    return lease


async def _settle(
    sink: IntoSink,
    pool: BufferPool,
    lease: Lease,
    copies: tuple[list[int], list[Any]],
    target: tuple[Destination, Fill],
) -> None:
    """Wait for a window's copies, mark their tensors filled, give the pinned buffer back.

    The wait is shielded: the buffer must not be reused (nor the restore end) while the
    device may still read it, and the copies enqueued complete anyway.
    """
    enqueued, events = copies
    destination, fill = target
    try:
        with anyio.CancelScope(shield=True):
            for event in events:
                await wait_event(event)
        for storage in enqueued:
            destination.mark(fill, storage, FILLED)
    finally:
        for storage in enqueued:
            sink.pinned.pop(storage, None)
        pool.give_back(lease)


async def fill_checkpoint_file(
    path: str | os.PathLike[str],
    *,
    destination: Destination,
    lanes: int = 1,
    limiter: anyio.CapacityLimiter | None = None,
    check: Callable[[FileHeader], None] | None = None,
    dir_fd: int | None = None,
    on_read: Callable[[int], None] | None = None,
) -> Any:
    """:func:`astage._files.durable.load_checkpoint_file` into ``destination``'s tensors.

    :raises DestinationMismatchError: the file does not fit the destination; nothing written.
    :raises IntegrityError: as ``load_checkpoint_file`` (the destination's state is tracked).
    :raises OSError: the file cannot be opened or read.
    """
    async with opened_checked(path, limiter=limiter, check=check, dir_fd=dir_fd) as (f, header):
        fill = await destination.match(header)
        reading = _Reading(f.fd, f.path, header, lanes, limiter, on_read)
        kept = await fill_body(reading, fill, destination)
    return await returned_tree(header, fill, kept)


async def fill_from_body(
    header: FileHeader,
    body: torch.Tensor,
    destination: Destination,
    limiter: anyio.CapacityLimiter | None = None,
) -> Any:
    """Fill ``destination`` from a body already in memory, every byte of it verified (a copy
    received from a peer); the returned tree as :func:`fill_checkpoint_file`'s.

    :raises DestinationMismatchError: the copy does not fit the destination; nothing written.
    """
    fill = await destination.match(header)
    storages = await run_steps(storages_in_slices(header, body))
    kept = {s: storages[s] for s in fill.fresh()}
    for batch in await run_steps(_batches_in_slices(fill, header.segments.nbytes.tolist())):
        await run_sync(without_gc(_copy_batch), fill, storages, batch, destination, limiter=limiter)
    return await returned_tree(header, fill, kept)


def _batches_in_slices(fill: Fill, sizes: list[int]) -> Steps[list[list[int]]]:
    """The storages to copy out of a body (not ``FRESH``), in batches of about :data:`CALL_BYTES`."""
    batches: list[list[int]] = [[]]
    size = 0
    for s, nbytes in enumerate(sizes):
        if fill.mode(s) is not Mode.FRESH:
            if size >= CALL_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(s)
            size += nbytes
        if slice_over():
            yield
    return batches


def _copy_batch(
    fill: Fill, storages: list[torch.UntypedStorage], batch: list[int], destination: Destination
) -> None:
    for s in batch:
        destination.mark(fill, s, PARTIAL)
        copy_pairs(fill.storage(s), storages[s])
        destination.mark(fill, s, FILLED)


Loader = Callable[..., Awaitable[Any]]
"""Reads one checkpoint file, with ``load_checkpoint_file``'s keyword arguments."""


@dataclasses.dataclass(frozen=True)
class RestoreLoads:
    """How one restore reads a file, and turns a verified body received from a peer into its result."""

    file: Loader
    body: Callable[[FileHeader, torch.Tensor], Awaitable[Any]] | None
    """``None``: the body is decoded into new tensors (:func:`collective_restore`'s own way)."""


def restore_loads(
    destination: Destination | None, lanes: int, limiter: anyio.CapacityLimiter | None
) -> RestoreLoads:
    """The loads of a restore: into ``destination``'s tensors, or into one new body buffer."""
    if destination is None:
        return RestoreLoads(functools.partial(read_checkpoint_file, lanes=lanes), None)
    return RestoreLoads(
        functools.partial(fill_checkpoint_file, destination=destination, lanes=lanes),
        functools.partial(fill_from_body, destination=destination, limiter=limiter),
    )
