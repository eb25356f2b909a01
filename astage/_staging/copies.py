"""Move bytes from source storages into staging buffers, off the event loop.

A copy is a list of ``(dst, src)`` tensor pairs, one per distinct storage: the staged and
source tensor themselves when one tensor covers its whole storage contiguously with a dtype
that ``copy_`` moves bit for bit (no extra tensor objects: this is what keeps many small
tensors cheap), else byte views of the two storages.  Either way a storage is copied as
bytes: no dtype that happens to view it may change a bit.  Pairs are cut into batches of
at most :data:`CHUNK_BYTES` and each batch is one worker-thread call, so a cancellation
takes effect within one chunk (a few ms).
``Tensor.copy_`` is used because it releases the GIL (``UntypedStorage.copy_`` holds it for
the whole copy), except for host storages of middling size (:data:`DIRECT_MIN_NUMEL`
elements up to :data:`DIRECT_MAX_BYTES`), which are copied with one ``memmove`` each
(:class:`DirectBatch`): there ``copy_`` forks torch's OpenMP team for every tensor, and
from a thread that is not the one the team was made for that costs more than the copy.

Device sources are enqueued ``non_blocking`` on a side stream that first waits for the
caller's compute stream, and completion is an event the caller awaits from the loop.
"""

from __future__ import annotations

import ctypes
import dataclasses
import heapq
import itertools
import operator
import os
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final, NamedTuple

import anyio
import torch

from .._util.errors import UnsupportedInputError
from .._util.limits import CHUNK_BYTES
from .._util.threads import Call
from .._util.timeslice import Steps, slice_over
from .plan import StagePlan

_DTYPE: Final = operator.attrgetter("dtype")
_IS_CPU: Final = operator.attrgetter("is_cpu")
_NBYTES: Final = operator.attrgetter("nbytes")
_DATA_PTR: Final = torch.Tensor.data_ptr

Batch = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Staged tensors and their sources, copied pairwise by one ``torch._foreach_copy_``."""

_BIT_COPIED: frozenset[torch.dtype] = frozenset(
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    }
)
"""Dtypes whose same-dtype ``copy_`` moves every bit unchanged, NaN payloads included.

A storage is copied through one of its own tensors only when that tensor has one of these
dtypes; any other storage is copied through byte views.  ``bool`` is why this is an allow
list: its kernel normalises each byte to 0 or 1, so a ``uint8`` storage viewed as ``bool``
lost every other value.  Others have no kernel (``int1``..``int7``, quantized)
or are too new to trust (float8, ``complex32``); copying those as bytes costs one tensor
object per storage, nothing more.
"""


class DirectBatch(tuple[list[torch.Tensor], list[torch.Tensor]]):
    """A host batch of covering pairs copied with one ``memmove`` each (:func:`run_batch`).

    Each pair is re-checked in the copying thread, right before its ``memmove``: a source
    that is no longer a contiguous CPU tensor of the staged tensor's dtype and size (changed
    by another task since the stage checked it) is copied by ``copy_``, which then does
    what it does for any pair: convert, or raise on a size mismatch.
    """

    __slots__ = ()


DIRECT_MIN_NUMEL: Final = 32768
"""Fewest elements of a :class:`DirectBatch` pair: torch's intra-op grain
(``at::internal::GRAIN_SIZE``), from which one ``copy_`` runs as an OpenMP parallel region.

Measured on 2 cores, from a worker thread while the main thread also runs torch ops (as a
training step does): 10-35 us a region, a fork and join of the worker thread's own team
against the main thread's; ``skip_unchanged``'s LoRA copy (288 tensors of 46-184 KB,
26 MB) took 4.0 ms by ``_foreach_copy_`` and 2.2 ms by ``memmove``.
"""

DIRECT_MAX_BYTES: Final = 2 << 20
"""Largest :class:`DirectBatch` pair: from about here torch's parallel ``copy_`` (two
threads on two cores) is faster than one thread's ``memmove`` in spite of its fork."""


def _direct(spec_numel: int, nbytes: int) -> bool:
    return spec_numel >= DIRECT_MIN_NUMEL and nbytes <= DIRECT_MAX_BYTES


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


MAX_BATCH_PAIRS = 2048
"""Most pairs in one batch: the worker holds the GIL while torch reads a batch's tensor
lists (~0.1 us a tensor), so this bounds how long one batch can keep the loop waiting."""

PAIR_COST_BYTES: Final = 8 << 10
"""What copying one pair costs beside its bytes (torch's dispatch, ~0.85 us), counted in
bytes of copying at ~10 GB/s: a batch's cost is its bytes plus this a pair."""

LANE_MIN_COST: Final = 4 << 20
"""Each lane (worker thread) of a copy gets at least this much cost: starting a thread
call costs ~0.1 ms, and a copy of a few MiB is over in about as long."""


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def copy_lanes(threads: int) -> int:
    """How many worker threads one host copy uses at once: up to ``threads``, and one core
    fewer than the process may use, left to the event loop.

    Measured on 2 cores, a second lane took ``skip_unchanged``'s LoRA stage to 0.79x and
    ``small-20k``'s steady stage to 0.96x, but the loop then had no core of its own: its
    lag p99 went from ~1.1 to ~2.5 ms and its max from ~4 to ~8 ms (``docs/performance.md``).
    """
    return max(1, min(threads, usable_cores() - 1))


class CopyWork(NamedTuple):
    """The batches of one copy and the cost of each (bytes plus :data:`PAIR_COST_BYTES` a pair)."""

    batches: list[Batch]
    costs: list[int]


def covering_in_slices(plan: StagePlan, sources: Sequence[torch.Tensor]) -> Steps[list[int | None]]:
    """For each planned storage, the tensor that covers it whole (copied as itself), or ``None``.

    Depends only on what the plan records (``sources`` are the plan's own source tensors,
    whose metadata the plan fixes), so it is computed once per plan.
    """
    cover: list[int | None] = [None] * len(plan.storages)
    for i, spec in enumerate(plan.tensors):
        s = spec.storage
        if cover[s] is None and spec.offset == 0 and not spec.conj and not spec.neg:
            src = sources[i]
            if (
                spec.dtype in _BIT_COPIED
                and src.numel() * src.element_size() == plan.storages[s].nbytes
                and src.is_contiguous()
            ):
                cover[s] = i
        if slice_over():
            yield
    return cover


@dataclasses.dataclass(frozen=True, slots=True)
class CopyLayout:
    """How a plan's storages are cut into batches, decided once per plan.

    ``host``/``device`` hold batches of covering tensor indices (small storages, copied as
    their own tensors); ``host_other``/``device_other`` the storages copied through byte
    views or split across batches, whose views are made at each stage.  A host batch is
    either all middling storages, copied by ``memmove`` (``host_direct``), or none.
    """

    cover: tuple[int | None, ...]
    host: tuple[tuple[int, ...], ...]
    device: tuple[tuple[int, ...], ...]
    host_other: tuple[int, ...]
    device_other: tuple[int, ...]
    host_bytes: tuple[int, ...]
    """Bytes of each ``host`` batch (its cost, with its pairs: :class:`CopyWork`)."""
    device_bytes: tuple[int, ...]
    """Bytes of each ``device`` batch."""
    host_direct: tuple[bool, ...] = ()
    """For each ``host`` batch, whether it is a :class:`DirectBatch`."""


def copy_layout_in_slices(
    plan: StagePlan, sources: Sequence[torch.Tensor], chunk_bytes: int = CHUNK_BYTES
) -> Steps[CopyLayout]:
    """Group the plan's storages into batches of at most ``chunk_bytes`` and :data:`MAX_BATCH_PAIRS`."""
    cover = yield from covering_in_slices(plan, sources)
    tensors = plan.tensors
    batches: dict[bool, list[tuple[int, ...]]] = {True: [], False: []}
    sizes: dict[bool, list[int]] = {True: [], False: []}
    direct: list[bool] = []
    other: dict[bool, list[int]] = {True: [], False: []}
    # The batch being filled, by kind: (on host, copied by memmove, device).  A device
    # batch holds one device's storages only: each device's copies go on its own stream.
    current: dict[tuple[bool, bool, torch.device], tuple[list[int], list[int]]] = {}

    def close(kind: tuple[bool, bool, torch.device]) -> None:
        idx, size = current.pop(kind)
        batches[kind[0]].append(tuple(idx))
        sizes[kind[0]].append(size[0])
        if kind[0]:
            direct.append(kind[1])

    for s, storage_spec in enumerate(plan.storages):
        n = storage_spec.nbytes
        if n == 0:
            continue
        on_host = storage_spec.device.type == "cpu"
        c = cover[s]
        if c is None or n > chunk_bytes:
            other[on_host].append(s)
            continue
        kind = (on_host, on_host and _direct(n // tensors[c].dtype.itemsize, n), storage_spec.device)
        idx, size = current.setdefault(kind, ([], [0]))
        if idx and (size[0] + n > chunk_bytes or len(idx) >= MAX_BATCH_PAIRS):
            close(kind)
            idx, size = current.setdefault(kind, ([], [0]))
        idx.append(c)
        size[0] += n
        if slice_over():
            yield
    for kind in list(current):
        close(kind)
    return CopyLayout(
        tuple(cover),
        tuple(batches[True]),
        tuple(batches[False]),
        tuple(other[True]),
        tuple(other[False]),
        tuple(sizes[True]),
        tuple(sizes[False]),
        tuple(direct),
    )


def batches_in_slices(
    plan: StagePlan,
    layout: CopyLayout,
    dst: Sequence[torch.Tensor],
    src: Sequence[torch.Tensor],
    dst_storage: Callable[[int], torch.UntypedStorage],
    src_storage: Callable[[int], torch.UntypedStorage],
    *,
    on_host: bool,
    skip: Collection[int] = (),
    storage_of: Sequence[int] = (),
    chunk_bytes: int = CHUNK_BYTES,
) -> Steps[CopyWork]:
    """The batches that copy every planned storage on the host (or on a device), and their
    costs, in time slices.

    ``dst[i]``/``src[i]`` are the staged and source tensor of ``plan.tensors[i]``;
    ``*_storage(s)`` give the storages of ``plan.storages[s]`` (asked only for storages
    copied through byte views).  Storages in ``skip`` are not copied (``storage_of``, each
    tensor's storage index, :attr:`astage._staging.recheck.FastPlan.storage_of`, is needed with it).
    """
    out: list[Batch] = []
    costs: list[int] = []
    tensors, storages = plan.tensors, plan.storages
    if on_host:
        batch_idx, batch_bytes, direct = layout.host, layout.host_bytes, layout.host_direct
    else:
        batch_idx, batch_bytes, direct = layout.device, layout.device_bytes, ()
    if skip:
        # Whether each tensor's storage is copied, a column at a time (maps of C functions).
        copied = list(map(operator.not_, map(skip.__contains__, range(len(storages)))))
        copied_of = list(map(copied.__getitem__, storage_of))
    for b, (idx, nbytes) in enumerate(zip(batch_idx, batch_bytes, strict=True)):
        if skip:
            kept = tuple(itertools.compress(idx, map(copied_of.__getitem__, idx)))
            if not kept:
                continue
            if len(kept) != len(idx):
                nbytes = sum(storages[tensors[i].storage].nbytes for i in kept)
            idx = kept
        pairs = ([dst[i] for i in idx], [src[i] for i in idx])
        out.append(DirectBatch(pairs) if b < len(direct) and direct[b] else pairs)
        costs.append(nbytes + len(idx) * PAIR_COST_BYTES)
        if slice_over():
            yield
    cover = layout.cover
    for s in layout.host_other if on_host else layout.device_other:
        if s in skip:
            continue
        c = cover[s]
        d, sr = (dst[c], src[c]) if c is not None else (_bytes(dst_storage(s)), _bytes(src_storage(s)))
        _add_whole_storage(out, costs, d, sr, plan.storages[s].nbytes, chunk_bytes)
        if slice_over():
            yield
    return CopyWork(out, costs)


def _add_whole_storage(
    out: list[Batch], costs: list[int], d: torch.Tensor, sr: torch.Tensor, nbytes: int, chunk_bytes: int
) -> None:
    """Batches that copy one storage no planned tensor covers in one pair: whole, or in
    chunks of ``chunk_bytes`` so that a large one spreads over the copy lanes."""
    if nbytes <= chunk_bytes:
        out.append(([d], [sr]))
        costs.append(nbytes + PAIR_COST_BYTES)
        return
    d, sr = d.reshape(-1), sr.reshape(-1)
    step = max(1, chunk_bytes // d.element_size())
    for i in range(0, d.numel(), step):
        out.append(([d[i : i + step]], [sr[i : i + step]]))
        costs.append(min(step, d.numel() - i) * d.element_size() + PAIR_COST_BYTES)


def deal_lanes(work: CopyWork, lanes: int) -> list[list[Batch]]:
    """The batches of ``work`` dealt to at most ``lanes`` worker threads that copy at once.

    Costliest first, each to the lane with the least cost so far, and no lane with less
    than :data:`LANE_MIN_COST`: a copy of many small storages costs a dispatch a pair
    (~0.85 us), which one thread cannot go below, and a second core can take half of them.
    Large storages gain less (torch already spreads one large ``copy_`` over its own
    threads), but cost no more: memory bandwidth is shared either way.
    """
    batches, costs = work
    lanes = min(lanes, len(batches), max(1, sum(costs) // LANE_MIN_COST))
    if lanes <= 1:
        return [batches]
    loads = [(0, k) for k in range(lanes)]
    out: list[list[Batch]] = [[] for _ in range(lanes)]
    for i in sorted(range(len(batches)), key=costs.__getitem__, reverse=True):
        load, k = heapq.heappop(loads)
        out[k].append(batches[i])
        heapq.heappush(loads, (load + costs[i], k))
    return out


def run_batch(batch: Batch, non_blocking: bool = False) -> None:
    """Copy one batch on the calling thread (a worker thread, or a side stream context)."""
    dsts, srcs = batch
    if type(batch) is DirectBatch and not non_blocking:
        _run_direct(dsts, srcs)
        return
    with torch.no_grad():
        if len(dsts) == 1:
            dsts[0].copy_(srcs[0], non_blocking=non_blocking)
        else:
            torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def _run_direct(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """Copy a :class:`DirectBatch`: ``memmove`` (which releases the GIL) for each pair whose
    source is, right now, what ``copy_`` would copy bit for bit; ``copy_`` for any other.

    The batch is checked a column at a time (maps of C methods, no Python frame a pair),
    and pair by pair only when that finds a pair ``memmove`` would not copy.  Each source's
    storage is still measured right before its own ``memmove``: that check is what keeps
    a storage shrunk meanwhile from being read past its end.
    """
    sizes = list(map(_NBYTES, dsts))
    if not (
        list(map(_DTYPE, srcs)) == list(map(_DTYPE, dsts))
        and all(map(_IS_CPU, srcs))
        and list(map(_NBYTES, srcs)) == sizes
        and all(map(torch.Tensor.is_contiguous, srcs))
        and not any(map(torch.Tensor.is_conj, srcs))
        and not any(map(torch.Tensor.is_neg, srcs))
    ):
        _run_direct_pairs(dsts, srcs)
        return
    for d, s, n in zip(map(_DATA_PTR, dsts), srcs, sizes, strict=True):
        _check_bound(s, n)
        ctypes.memmove(d, s.data_ptr(), n)


def _run_direct_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """:func:`_run_direct` a pair at a time: ``copy_`` for the pairs it would not ``memmove``."""
    for d, s in zip(dsts, srcs, strict=True):
        n = d.nbytes
        if not (
            s.dtype is d.dtype
            and s.is_cpu
            and s.nbytes == n
            and s.is_contiguous()
            and not s.is_conj()
            and not s.is_neg()
        ):
            with torch.no_grad():
                d.copy_(s)
            continue
        _check_bound(s, n)
        ctypes.memmove(d.data_ptr(), s.data_ptr(), n)


def _check_bound(src: torch.Tensor, nbytes: int) -> None:
    """Raise unless ``src``'s storage holds the ``nbytes`` from its data pointer on."""
    have, need = src.untyped_storage().nbytes(), src.storage_offset() * src.element_size() + nbytes
    if have < need:  # (copy_ would read past the end of it)
        raise UnsupportedInputError(
            (),
            f"a source tensor's storage shrank to {have:,} bytes while it was being staged "
            f"(its tensor needs {need:,}); nothing was read from it",
        )


async def copy_in_threads(work: CopyWork, limiter: anyio.CapacityLimiter | None, lanes: int = 1) -> None:
    """Run every batch in worker threads: one call a lane, up to ``lanes`` at once (:func:`deal_lanes`).

    One call a lane rather than one a batch: a hand-off per 16 MiB left the copy idle
    between batches (~15 % of a 1.5 GB stage).  On cancellation, or when a lane's copy
    fails, every thread is told to stop after the batch it is copying, and this waits for
    them (a few ms) before the cancellation or the error propagates, so no thread writes
    into a buffer after this returns.  A lane's error is raised as it is, not in a group.
    """
    dealt = deal_lanes(work, lanes)
    del work
    stop = threading.Event()
    if len(dealt) == 1:
        await _copy_lane(dealt.pop(), limiter, stop)
        return
    errors: list[Exception] = []

    async def lane(box: list[list[Batch]]) -> None:
        # The batches come in a box that this frame empties: a lane cancelled before its
        # thread started would keep them (views of the buffers) in its traceback's frames.
        try:
            await _copy_lane(box.pop(), limiter, stop)
        except Exception as exc:  # the others stop after their batch; raised below
            errors.append(exc)

    async with anyio.create_task_group() as group:
        while dealt:
            group.start_soon(lane, [dealt.pop()])
    if errors:
        try:
            raise errors[0]
        finally:
            errors.clear()


async def _copy_lane(
    batches: list[Batch], limiter: anyio.CapacityLimiter | None, stop: threading.Event
) -> None:
    """One worker-thread call that runs ``batches`` in order until ``stop`` is set.

    The batches travel in a :class:`~astage._util.threads.Call` box, so an idle worker thread
    pins no buffer.
    """
    done = threading.Event()

    def work(batches: list[Batch]) -> None:
        batches.reverse()
        try:
            while batches and not stop.is_set():
                run_batch(batches.pop())
        except BaseException:
            stop.set()
            raise
        finally:
            # Before done is set: a waiter resumes then and hands the buffers back, while
            # this thread may not run again for a while (see astage._util.threads).
            batches.clear()
            done.set()

    call = Call(work, batches)
    del batches
    try:
        await anyio.to_thread.run_sync(call.run, limiter=limiter, abandon_on_cancel=True)
    except BaseException:
        stop.set()
        if call.drop():  # the thread has the batches: wait for the batch it is copying
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(done.wait)
        raise
    call.take()


def group_by_device(batches: Sequence[Batch]) -> dict[torch.device, list[Batch]]:
    """The batches by the device of their sources, each device's in their order.

    A batch never mixes devices (:func:`copy_layout_in_slices` cuts one where the device
    changes), so its first source names the device of all of them.
    """
    groups: dict[torch.device, list[Batch]] = {}
    for batch in batches:
        groups.setdefault(batch[1][0].device, []).append(batch)
    return groups


DeviceCopy = tuple[Any, Any, Sequence[Batch]]
"""One device's share of a copy: its side stream, its compute stream, and its batches."""


def enqueue_device_copies(groups: Sequence[DeviceCopy]) -> list[Any]:
    """Enqueue each device's batches non-blocking on its side stream; an event per device,
    recorded after its copies.

    Each side stream first waits for its device's compute stream, so it never copies stale
    data; a copy from a device is enqueued on that device's side stream only, as a
    non-blocking copy runs on the current stream of its source's device.  Blocking only
    for the enqueueing: run it in a worker thread for big state_dicts, through
    :func:`astage._util.threads.run_sync` (the batches view staging buffers).
    """
    events: list[Any] = []
    for side_stream, compute_stream, batches in groups:
        side_stream.wait_stream(compute_stream)
        with side_stream:
            for batch in batches:
                run_batch(batch, non_blocking=True)
            events.append(side_stream.record_event())
    return events
