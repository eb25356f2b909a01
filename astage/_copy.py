"""Move bytes from source storages into staging buffers, off the event loop.

A copy is a list of ``(dst, src)`` tensor pairs, one per distinct storage: the staged and
source tensor themselves when one tensor covers its whole storage contiguously with a dtype
that ``copy_`` moves bit for bit (no extra tensor objects: this is what keeps 20,000 small
tensors cheap), else byte views of the two storages.  Either way a storage is copied as
bytes: no dtype that happens to view it may change a bit.  Pairs are cut into batches of
at most :data:`CHUNK_BYTES` and each batch is one worker-thread call, so a cancellation
takes effect within one chunk (a few ms).
``Tensor.copy_`` is used throughout because it releases the GIL (``UntypedStorage.copy_``
holds it for the whole copy).

Device sources are enqueued ``non_blocking`` on a side stream that first waits for the
caller's compute stream, and completion is an event the caller awaits from the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from ._plan import PlannedSource
from ._slices import SLICE_SECONDS, Steps, clock

CHUNK_BYTES = 16 << 20
"""Largest amount copied by one worker-thread call: ~2-4 ms at memory bandwidth."""

Pair = tuple[torch.Tensor, torch.Tensor]
Batch = list[Pair]

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
lost every other value (issue 9).  Others have no kernel (``int1``..``int7``, quantized)
or are too new to trust (float8, ``complex32``); copying those as bytes costs one tensor
object per storage, nothing more.
"""


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


Pairs = list[tuple[torch.Tensor, torch.Tensor, int]]


def iter_pairs(
    source: PlannedSource,
    dst_storages: Sequence[torch.UntypedStorage],
    staged_locals: Sequence[torch.Tensor],
) -> Steps[tuple[Pairs, Pairs]]:
    """One ``(dst, src, nbytes)`` per distinct non-empty storage, in time slices.

    :returns: the pairs whose source is on the CPU, and those whose source is on a device.
    """
    plan = source.plan
    cover: list[int | None] = [None] * len(plan.storages)
    deadline = clock() + SLICE_SECONDS
    for i, spec in enumerate(plan.tensors):
        s = spec.storage
        if cover[s] is None and spec.offset == 0 and not spec.conj and not spec.neg:
            nbytes = plan.storages[s].nbytes
            src = source.tensors[i]
            if (
                spec.dtype in _BIT_COPIED
                and src.numel() * src.element_size() == nbytes
                and src.is_contiguous()
            ):
                cover[s] = i
        if clock() > deadline:
            yield
            deadline = clock() + SLICE_SECONDS
    host: Pairs = []
    device: Pairs = []
    for s, storage_spec in enumerate(plan.storages):
        if storage_spec.nbytes == 0:
            continue
        pairs = host if storage_spec.device.type == "cpu" else device
        covering = cover[s]
        if covering is not None:
            pairs.append((staged_locals[covering], source.tensors[covering], storage_spec.nbytes))
        else:
            pairs.append((_bytes(dst_storages[s]), _bytes(source.storages[s]), storage_spec.nbytes))
        if clock() > deadline:
            yield
            deadline = clock() + SLICE_SECONDS
    return host, device


def iter_batches(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor, int]], chunk_bytes: int = CHUNK_BYTES
) -> Steps[list[Batch]]:
    """Group small pairs and split large ones so each batch moves at most ``chunk_bytes``."""
    out: list[Batch] = []
    current: Batch = []
    current_bytes = 0
    deadline = clock() + SLICE_SECONDS
    for dst, src, nbytes in pairs:
        if nbytes > chunk_bytes:
            d, s = dst.reshape(-1), src.reshape(-1)
            step = max(1, chunk_bytes // dst.element_size())
            out.extend([(d[i : i + step], s[i : i + step])] for i in range(0, d.numel(), step))
        else:
            if current_bytes + nbytes > chunk_bytes and current:
                out.append(current)
                current, current_bytes = [], 0
            current.append((dst, src))
            current_bytes += nbytes
        if clock() > deadline:
            yield
            deadline = clock() + SLICE_SECONDS
    if current:
        out.append(current)
    return out


def run_batch(batch: Batch, non_blocking: bool = False) -> None:
    """Copy one batch on the calling thread (a worker thread, or a side stream context)."""
    with torch.no_grad():
        if len(batch) == 1:
            dst, src = batch[0]
            dst.copy_(src, non_blocking=non_blocking)
        else:
            torch._foreach_copy_([d for d, _ in batch], [s for _, s in batch], non_blocking=non_blocking)


async def copy_in_threads(plan_batches: Sequence[Batch], limiter: anyio.CapacityLimiter | None) -> None:
    """Run every batch, in order, in one worker-thread call.

    One call rather than one per batch: a hand-off per 16 MiB left the copy idle between
    batches (~15 % of a 1.5 GB stage).  On cancellation the thread is told to stop after
    the batch it is copying, and this waits for that (a few ms) before the cancellation
    propagates, so no thread writes into a buffer after this returns.
    """
    stop, done = threading.Event(), threading.Event()
    claim = threading.Lock()
    state = ["queued"]  # -> "running" (claimed by the thread) or "dropped" (by a cancellation)
    # An idle worker thread keeps its last call's arguments alive: the batches travel in a
    # box emptied by the thread (or by a cancellation), so nothing parked pins the buffers.
    box = [list(plan_batches)]

    def work() -> None:
        with claim:
            if state[0] == "dropped":
                return
            state[0] = "running"
        batches = box.pop()
        batches.reverse()
        try:
            while batches and not stop.is_set():
                run_batch(batches.pop())
        finally:
            # Before done is set: a waiter resumes then and hands the buffers back, while
            # this thread may not run again for a while (see astage._threads).
            batches.clear()
            done.set()

    try:
        await anyio.to_thread.run_sync(work, limiter=limiter, abandon_on_cancel=True)
    except BaseException:
        stop.set()
        with claim:
            running = state[0] == "running"
            if not running:  # the thread will never touch the batches: drop them now
                state[0] = "dropped"
                box.clear()
        if running:  # wait for the batch it is copying
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(done.wait)
        raise


def enqueue_device_copies(plan_batches: list[Sequence[Batch]], side_stream: Any, compute_stream: Any) -> Any:
    """Enqueue every batch non-blocking on ``side_stream``; return an event recorded after.

    The side stream first waits for ``compute_stream`` so it never copies stale data.
    Blocking only for the enqueueing: run it in a worker thread for big state_dicts.
    ``plan_batches`` is a one-element box, emptied here (see :func:`copy_in_threads`).
    """
    side_stream.wait_stream(compute_stream)
    with side_stream:
        for batch in plan_batches.pop():
            run_batch(batch, non_blocking=True)
        return side_stream.record_event()
