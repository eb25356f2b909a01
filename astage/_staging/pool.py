"""An async pool of staging buffers: reused across checkpoints, capped, FIFO-fair.

A buffer is one CPU ``UntypedStorage`` of an exact byte size (plain, pinned or shared
memory).  ``acquire(sizes)`` hands out a :class:`Lease` holding one buffer per requested
size, reusing free buffers of the same size and allocating (and pre-faulting, off the event
loop) the rest.

Invariants:

* The pool never holds more than ``max_bytes`` of buffers.  A request that does not fit
  waits, first in first out; a request larger than the cap fails at once.
* A buffer handed out to a caller (``hand_out``) goes back to the free list only when
  nothing but the pool references its storage: no tensor, no view, no storage object.  A
  staged copy that a caller still holds is therefore never overwritten.
* ``give_back`` is for leases that were never handed out; the caller promises that no
  thread and no device copy can still write into them.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import logging
import operator
import sys
import time
import weakref
from collections.abc import Sequence
from typing import Any, cast

import anyio
import numpy as np
import torch

from .._util.errors import CapacityError, ClosedError, ConfigurationError
from .._util.threads import run_sync
from .._util.timeslice import Steps, drive, drop_in_slices, each_block, give_turn, run_steps
from .options import check_bool, check_positive_int, check_type

log = logging.getLogger("astage.pool")

RECLAIM_POLL_SECONDS = 0.02
"""How often a waiter re-checks for buffers whose staged copies were dropped."""

ALLOC_BATCH_BYTES = 64 << 20
"""Bytes allocated per worker-thread call (bounds cancellation latency)."""

_HAND_OUT_CHUNK = 256
"""Buffers handed out between two looks at the clock (~1.2 us a buffer: 2,048 held the
loop 2.5 ms)."""

ALLOC_BATCH_COUNT = 256
"""Storages allocated per worker-thread call.  Allocating many small ones is Python that
holds the GIL, which the loop thread then waits for up to the switch interval (5 ms) at a
time, again and again."""

CAP_WAIT_LOG_SECONDS = 1.0
"""How long a request may wait for room under ``max_bytes`` before the wait is logged (INFO)."""


class BufferKind(enum.Enum):
    """Where staging buffers live."""

    PLAIN = "plain"
    PINNED = "pinned"
    SHARED = "shared"
    SHARED_PINNED = "shared+pinned"

    @classmethod
    def of(cls, *, pinned: bool, shared: bool) -> BufferKind:
        """The kind for a pair of staging switches."""
        if shared:
            return cls.SHARED_PINNED if pinned else cls.SHARED
        return cls.PINNED if pinned else cls.PLAIN


def _pin_shared(storage: torch.UntypedStorage) -> None:
    """Page-lock an existing (shared) CPU storage once; unpinned when the storage dies."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    ptr, size = storage.data_ptr(), storage.nbytes()
    if int(cudart.cudaHostRegister(ptr, size, 0)) != 0:
        raise RuntimeError(f"cudaHostRegister failed for {size} bytes")
    weakref.finalize(storage, cudart.cudaHostUnregister, ptr).atexit = False


def allocate_storage(nbytes: int, kind: BufferKind) -> torch.UntypedStorage:
    """Allocate one CPU storage of ``kind``.

    Blocking: call it from a worker thread.  Shared storages use named shared memory
    (``file_system`` style), which keeps no file descriptor open per storage, so a
    state_dict of tens of thousands of tensors cannot exhaust descriptors.

    Pageable pages are not faulted in here: the first copy faults them in, in its own
    threads.  Faulting them in first (``MADV_POPULATE_WRITE``, one thread a buffer) made a
    first stage of the 1.49 GB ``gpt2-adam`` input take 0.78 s against 0.24 s without it
    (medians of 6, in turns), 3.18 s against 1.05 s in shared memory, and ``lora``'s 0.119
    against 0.093 s; no input was faster with it.
    """
    if kind in (BufferKind.SHARED, BufferKind.SHARED_PINNED):
        storage = torch.UntypedStorage._new_using_filename_cpu(nbytes)
        if kind is BufferKind.SHARED_PINNED and nbytes:
            _pin_shared(storage)
    elif kind is BufferKind.PINNED:
        storage = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
    else:  # directly: faster than through a tensor, which counts for many small buffers
        storage = torch.UntypedStorage(nbytes)  # type: ignore[no-untyped-call]
    return storage


Buffer = torch.UntypedStorage
"""One pooled staging storage, held as itself.

No record object wraps it: a pool of many small buffers would keep one more object a
buffer for every full pass of the cyclic collector to rescan.  Which copy holds a
handed-out buffer is kept by the pool, by the storage's ``_cdata``.
"""


_Taken = tuple[list[Buffer | None], int, int]
"""One free buffer per size of a request (``None`` where one must be made), the bytes and
the number of buffers to make."""


@dataclasses.dataclass(frozen=True)
class _Wanted:
    """A request's sizes as an array, and how many buffers of each size it asks for
    (ascending), made once per request at C speed."""

    sizes: np.ndarray[Any, np.dtype[np.int64]]
    counts: collections.Counter[int]

    @classmethod
    def of(cls, sizes: Sequence[int]) -> _Wanted:
        arr = np.fromiter(sizes, np.int64, len(sizes))
        distinct, counts = np.unique(arr, return_counts=True)
        return cls(arr, collections.Counter(dict(zip(distinct.tolist(), counts.tolist(), strict=True))))


@dataclasses.dataclass(eq=False)
class Lease:
    """Buffers held for one staging call, in the order they were requested."""

    buffers: list[Buffer]
    allocated_bytes: int
    reused_buffers: int
    wait_seconds: float
    sizes: Sequence[int] | None = None
    """Each buffer's size in bytes, when known (saves a call a buffer)."""

    @property
    def storages(self) -> list[torch.UntypedStorage]:
        """The leased storages, one per requested size."""
        return list(self.buffers)


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's memory."""

    total_bytes: int
    free_bytes: int
    leased_bytes: int
    handed_out_bytes: int
    allocated_bytes_ever: int
    waiters: int
    kept_bytes: int = 0
    """Of ``free_bytes``, the bytes of released copies their stager keeps whole, to refill in
    place at its next stage of the same structure."""


class BufferPool:
    """Reusable staging buffers of one :class:`BufferKind` under an optional byte cap.

    :param kind: plain, pinned or shared memory.
    :param max_bytes: cap on the bytes of buffers the pool holds; ``None`` for no cap.
    :param retain: keep returned buffers for reuse (``False``: free them at once).
    :param allocate_inline: allocate on the calling thread (for blocking stagers).
    :param wait_log_seconds: a request that has waited this long for room under
        ``max_bytes`` is logged once at INFO on ``astage.pool``, with what holds the memory.
    """

    def __init__(
        self,
        kind: BufferKind = BufferKind.PLAIN,
        *,
        max_bytes: int | None = None,
        retain: bool = True,
        allocate_inline: bool = False,
        wait_log_seconds: float = CAP_WAIT_LOG_SECONDS,
    ) -> None:
        check_type("BufferPool(kind=...)", kind, BufferKind)
        check_positive_int("BufferPool(max_bytes=...)", max_bytes, optional=True)
        check_bool("BufferPool(retain=...)", retain)
        check_bool("BufferPool(allocate_inline=...)", allocate_inline)
        if not wait_log_seconds >= 0:  # also refuses NaN
            raise ConfigurationError(f"wait_log_seconds must be >= 0, got {wait_log_seconds!r}")
        self.kind = kind
        self.max_bytes = max_bytes
        self.retain = retain
        self._inline = allocate_inline
        self._wait_log_seconds = wait_log_seconds
        self._copies_out = 0  # serial of the last lease handed out
        self._free: dict[int, list[Buffer]] = collections.defaultdict(list)
        self._free_bytes = 0
        self._leased_bytes = 0
        self._out: dict[int, Buffer] = {}  # by the storage's _cdata
        # _cdata -> (the handed-out lease (copy) holding it, its size when handed out)
        self._copy_of: dict[int, tuple[int, int]] = {}
        self._out_bytes = 0
        self._copy_buffers: collections.Counter[int] = collections.Counter()  # serial -> buffers out
        self._kept: dict[int, int] = {}  # serial -> bytes of released copies kept by their stager
        self._kept_bytes = 0
        self._reserved = 0  # bytes being allocated right now
        self._allocated_ever = 0
        self._queue: collections.deque[object] = collections.deque()
        self._changed: anyio.Event | None = None
        self._closed = False

    # -- accounting ---------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        """Bytes of every buffer the pool holds or is allocating."""
        return self._free_bytes + self._leased_bytes + self._out_bytes + self._reserved

    def stats(self) -> PoolStats:
        """A snapshot of the pool's memory."""
        return PoolStats(
            total_bytes=self.total_bytes,
            free_bytes=self._free_bytes + self._kept_bytes,
            leased_bytes=self._leased_bytes,
            handed_out_bytes=self._out_bytes - self._kept_bytes,
            allocated_bytes_ever=self._allocated_ever,
            waiters=len(self._queue),
            kept_bytes=self._kept_bytes,
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _free_push(self, buf: Buffer, nbytes: int) -> None:
        if self.retain and not self._closed:
            self._free[nbytes].append(buf)
            self._free_bytes += nbytes
        # Otherwise the buffer is dropped; its memory goes when the last reference does.

    # -- reclaiming -----------------------------------------------------------------------

    def reclaim(self) -> int:
        """Return handed-out buffers that nothing references any more; bytes reclaimed."""
        return drive(self.reclaim_in_slices())

    def reclaim_in_slices(self) -> Steps[int]:
        """:meth:`reclaim` in time slices (benchmarks/README.md, "Where the code slices").
        Each buffer is checked and taken back within one slice (a buffer given back
        or handed out meanwhile is simply not found, or found in use)."""
        use_count, refcount = torch._C._storage_Use_Count, sys.getrefcount
        # A buffer is free when its storage has no other C++ owner (tensor, view) and no other
        # Python reference than the pool's own (getrefcount adds its own argument).
        taken_back: list[int] = []

        def take_back(keys: Sequence[int]) -> None:
            out = self._out
            done = [k for k in keys if k in out and use_count(k) <= 1]
            taken_back.extend(self._take_back(k) for k in done if refcount(out[k]) <= 2)

        yield from each_block(list(self._out), take_back)
        freed = sum(taken_back)
        if freed:
            self._notify()
        return freed

    def _take_back(self, key: int) -> int:
        """Move the unreferenced handed-out buffer ``key`` back to the free lists; its bytes."""
        buf = self._out.pop(key)
        copy, nbytes = self._copy_of.pop(key)
        self._out_bytes -= nbytes
        self._copy_buffers[copy] -= 1
        if not self._copy_buffers[copy]:
            del self._copy_buffers[copy]
        if buf.nbytes() == nbytes:  # a caller may have resized it: then it is dropped
            self._free_push(buf, nbytes)
        return nbytes

    # -- acquiring ------------------------------------------------------------------------

    def _free_can_serve(self, wanted: _Wanted) -> bool:
        return all(len(self._free.get(n, ())) >= c for n, c in wanted.counts.items())

    def _take(self, wanted: _Wanted) -> _Taken | None:
        """Reserve free buffers for the request if it fits now: one per size, or ``None``
        where one must be made; the bytes and the buffers to make.  ``None`` if it does
        not fit.

        At C speed, a size's bucket at a time, not a Python step a buffer: 20,000 buffers
        taken one by one held the loop ~5 ms, and this runs in one loop step.
        """
        arr, wanted_counts = wanted.sizes, wanted.counts
        missing = sum(n * max(0, c - len(self._free.get(n, ()))) for n, c in wanted_counts.items())
        if self.max_bytes is not None and self.total_bytes + missing > self.max_bytes:
            self._evict(self.total_bytes + missing - self.max_bytes, wanted_counts)
            if self.total_bytes + missing > self.max_bytes:
                return None
        # Each distinct size's buffers (None where there are too few), in order of size,
        # then put back in the request's order.
        grouped: list[Buffer | None] = []
        short = 0
        for n, count in wanted_counts.items():  # ascending, as np.unique sorted them
            bucket = self._free.get(n)
            k = min(count, len(bucket)) if bucket else 0
            if k:
                assert bucket is not None
                grouped += bucket[len(bucket) - k :]
                del bucket[len(bucket) - k :]
                self._free_bytes -= n * k
                self._leased_bytes += n * k
            grouped += itertools.repeat(None, count - k)
            short += count - k
        self._reserved += missing
        if len(wanted_counts) <= 1 or bool((arr[1:] >= arr[:-1]).all()):
            return grouped, missing, short  # already in the request's order
        order = np.argsort(arr, kind="stable")
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return list(operator.itemgetter(*back.tolist())(grouped)), missing, short

    def _evict(self, excess: int, keep: collections.Counter[int]) -> None:
        """Free idle buffers that this request cannot use, largest first."""
        for n in sorted(self._free, reverse=True):
            bucket = self._free[n]
            spare = len(bucket) - keep.get(n, 0)
            while spare > 0 and excess > 0:
                bucket.pop()
                self._free_bytes -= n
                excess -= n
                spare -= 1
            if excess <= 0:
                return

    async def acquire(self, sizes: Sequence[int], *, limiter: anyio.CapacityLimiter | None = None) -> Lease:
        """Lease one buffer per entry of ``sizes`` (bytes), waiting for room if capped.

        New buffers are allocated and pre-faulted in worker threads under ``limiter``.

        :raises CapacityError: the request alone exceeds ``max_bytes``.
        :raises ClosedError: the pool is closed.
        """
        need = sum(sizes)
        if self.max_bytes is not None and need > self.max_bytes:
            raise CapacityError(
                f"staging needs {need:,} bytes but max_staging_bytes is {self.max_bytes:,}; "
                "raise the cap or stage the state_dict in parts"
            )
        self._check_open()
        started = time.perf_counter()
        got = await self._reserve(_Wanted.of(sizes), need, started)
        taken, missing, short = got
        waited = time.perf_counter() - started
        try:
            fresh = await self._allocate(
                [n for n, b in zip(sizes, taken, strict=True) if b is None] if short else [], limiter
            )
        except BaseException:
            self._reserved -= missing
            self.give_back(Lease([b for b in taken if b is not None], 0, 0, 0.0))
            raise
        self._reserved -= missing
        self._allocated_ever += missing
        self._leased_bytes += missing  # the fresh buffers' sizes, summed
        if fresh and short < len(taken):
            fresh_iter = iter(fresh)
            buffers = [next(fresh_iter) if b is None else b for b in taken]
        else:
            buffers = fresh or cast(list[Buffer], taken)
        reused = len(sizes) - len(fresh)
        if waited > 0.001:
            log.debug("waited %.3fs for %d staging bytes", waited, need)
        return Lease(buffers, missing, reused, waited, sizes)

    async def _reserve(
        self, wanted: _Wanted, need: int, started: float
    ) -> tuple[list[Buffer | None], int, int]:
        """:meth:`_take` once this request is first in line and fits, waiting (FIFO) until then."""
        ticket = object()
        self._queue.append(ticket)
        logged = False
        try:
            while True:
                self._check_open()
                if self._queue[0] is ticket:
                    if self._out and not self._free_can_serve(wanted):
                        await run_steps(self.reclaim_in_slices())
                        await give_turn()  # the last slice ran in this step: take in the next
                        self._check_open()
                    got = self._take(wanted)
                    if got is not None:
                        return got
                if not logged and time.perf_counter() - started >= self._wait_log_seconds:
                    logged = True
                    self._log_wait(need, time.perf_counter() - started)
                if self._changed is None:
                    self._changed = anyio.Event()
                with anyio.move_on_after(RECLAIM_POLL_SECONDS):
                    await self._changed.wait()
        finally:
            self._queue.remove(ticket)
            self._notify()  # the next in line may fit now

    def _log_wait(self, need: int, waited: float) -> None:
        # A stage stuck under the cap is the usual sign of staged copies never released
        # (or released late): say how much they hold, so the operator can tell.
        copies = len({copy for copy, _ in self._copy_of.values()})
        log.info(
            "staging has waited %.1f s for room under max_staging_bytes=%s: it needs %s bytes; "
            "%s bytes are held by %d staged %s not yet released, %s bytes are being staged, "
            "%d request(s) are waiting",
            waited,
            f"{self.max_bytes:,}",
            f"{need:,}",
            f"{self._out_bytes:,}",
            copies,
            "copy" if copies == 1 else "copies",
            f"{self._leased_bytes + self._reserved:,}",
            len(self._queue),
        )

    async def _allocate(self, sizes: list[int], limiter: anyio.CapacityLimiter | None) -> list[Buffer]:
        if not sizes:
            return []
        kind = self.kind

        def batch(chunk: list[int]) -> list[Buffer]:
            return [allocate_storage(n, kind) for n in chunk]

        if self._inline:
            return batch(sizes)
        out: list[Buffer] = []
        chunk: list[int] = []
        chunk_bytes = 0
        for n in sizes:
            chunk.append(n)
            chunk_bytes += n
            if chunk_bytes >= ALLOC_BATCH_BYTES or len(chunk) >= ALLOC_BATCH_COUNT:
                out.extend(await run_sync(batch, chunk, limiter=limiter))
                chunk, chunk_bytes = [], 0
        if chunk:
            out.extend(await run_sync(batch, chunk, limiter=limiter))
        return out

    # -- returning ------------------------------------------------------------------------

    def give_back(self, lease: Lease) -> None:
        """Return a lease that was never handed out (nothing can still write into it)."""
        for buf in lease.buffers:
            nbytes = buf.nbytes()
            self._leased_bytes -= nbytes
            self._free_push(buf, nbytes)
        lease.buffers = []
        self._notify()

    def hand_out(self, lease: Lease) -> int:
        """Mark a lease as owned by a caller: its buffers come back once unreferenced.

        Returns the lease's serial, which names this copy in :meth:`copy_of`."""
        return drive(self.hand_out_in_slices(lease))

    def hand_out_in_slices(self, lease: Lease) -> Steps[int]:
        """:meth:`hand_out` in time slices.  Between slices the lease is partly handed out, so an async caller
        runs it shielded from cancellation; its buffers are still referenced by the lease
        then, so :meth:`reclaim` leaves them alone."""
        self._copies_out += 1
        serial = self._copies_out
        buffers = lease.buffers
        sizes = lease.sizes if lease.sizes is not None else [buf.nbytes() for buf in buffers]

        def hand_out(block: Sequence[int]) -> None:
            r = cast(range, block)
            chunk, nbytes = buffers[r.start : r.stop], sizes[r.start : r.stop]
            total = sum(nbytes)
            self._leased_bytes -= total
            if not self._closed:
                keys = [buf._cdata for buf in chunk]
                self._out.update(zip(keys, chunk, strict=True))
                self._copy_of.update(
                    zip(keys, zip(itertools.repeat(serial), nbytes, strict=False), strict=True)
                )
                self._out_bytes += total
                self._copy_buffers[serial] = self._copy_buffers.get(serial, 0) + len(chunk)

        yield from each_block(range(len(buffers)), hand_out, _HAND_OUT_CHUNK)
        lease.buffers = []
        return serial

    def idle_storages(self) -> list[torch.UntypedStorage]:
        """The storages idle in the pool, free for the next request (diagnostics, tests)."""
        return [buf for bucket in self._free.values() for buf in bucket]

    def handed_out_buffers(self) -> dict[int, Buffer]:
        """The buffers currently handed out to callers, by their storage's ``_cdata`` (read only)."""
        return self._out

    def copy_of(self, key: int) -> int | None:
        """Which handed-out copy (lease serial) holds the buffer whose ``_cdata`` is ``key``."""
        known = self._copy_of.get(key)
        return None if known is None else known[0]

    def copy_buffers(self, serial: int) -> int:
        """How many buffers of the copy ``serial`` (:meth:`copy_of`) are handed out."""
        return self._copy_buffers.get(serial, 0)

    def handed_out_storages(self, *, kept: bool = False) -> set[int]:
        """Identities (``_cdata``) of the storages currently handed out to callers (and,
        with ``kept``, of those kept by their stager for re-use)."""
        if kept or not self._kept:
            return set(self._out)
        return {key for key, (copy, _) in self._copy_of.items() if copy not in self._kept}

    @property
    def waiting(self) -> int:
        """How many requests are waiting for room under the cap (or queued behind one)."""
        return len(self._queue)

    def keep(self, serial: int, nbytes: int) -> None:
        """Count the handed-out copy ``serial`` as idle: it was released and is kept whole by
        its stager, to be refilled in place (``free_bytes`` in :meth:`stats`); ``nbytes``
        is the size of all its buffers."""
        if serial in self._kept or not self._copy_buffers.get(serial):
            return
        self._kept[serial] = nbytes
        self._kept_bytes += nbytes

    def unkeep(self, serial: int) -> None:
        """Count the kept copy ``serial`` as handed out again (refilled, or given up by its
        stager: then :meth:`reclaim` takes it back once nothing references it)."""
        self._kept_bytes -= self._kept.pop(serial, 0)

    def forget_loop(self) -> None:
        """Drop the wake-up event made under the previous event loop (the pool is idle)."""
        self._changed = None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("the staging buffer pool is closed")

    async def aclose(self) -> None:
        """Drop every idle buffer and forget handed-out ones; idempotent.

        Buffers still referenced by staged copies are freed when those copies are dropped.
        """
        if self._closed:
            return
        self._closed = True
        doomed = [buf for bucket in self._free.values() for buf in bucket]
        doomed += self._out.values()  # a copy still held frees its own when it is dropped
        self._free.clear()
        self._free_bytes = 0
        self._out.clear()
        self._copy_of.clear()
        self._out_bytes = 0
        self._kept.clear()
        self._kept_bytes = 0
        self._copy_buffers.clear()
        self._notify()
        # One at a time: freeing a buffer gives its memory back to the system (munmap) on
        # the thread that drops the last reference, holding the GIL; dropping a large pool
        # at once held the loop for tens of milliseconds.  Cancelled, the rest go at once.
        await run_steps(drop_in_slices(doomed, block=1))
