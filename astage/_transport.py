"""Move one replica between ranks of a process group without blocking the event loop.

A replica travels as a :class:`Payload`: a small ``prefix`` blob (the format's header) and
a logical ``body`` described by ``(offset, uint8 tensor)`` segments, gaps being zeros.  On
the wire it is a few large messages, each kind on its own tag, in this order::

    PREAMBLE  int64[8]   magic, version, prefix_len, body_nbytes, chunk_bytes, 0, 0, 0
    PREFIX    uint8[prefix_len]                    (absent when prefix_len == 0)
    BODY      uint8[chunk_bytes] x n, then the rest (absent when body_nbytes == 0)

and, once the receiver has persisted the replica, an acknowledgement back (``ACK``: 256
bytes holding ok/failed and a short message).  Body chunks lie on a fixed grid of
``chunk_bytes``, so both sides cut the body alike.  A chunk that one segment covers is sent
as a view of it (no copy); any other chunk is packed (one memmove a part) in a worker thread
into one of two reusable buffers while the previous chunk is on the wire.  The receiver
checks the preamble before it allocates anything, hands the prefix to ``on_prefix`` (which
may refuse it) before it allocates the body, then posts a window of chunk receives into the
body tensor and hands each chunk to ``on_chunk`` as it lands, while the next ones are in
flight.

Gloo reports a point-to-point ``Work`` complete only from inside ``wait()`` (its
``is_completed()`` stays false and ``get_future()`` is missing; checked on torch 2.13), so
each direction waits in its own worker thread (two per call, under a private limiter).
Gloo sends are rendezvous: a send completes only once the peer has posted the matching
receive, which is why acknowledgements go both ways at once (:func:`exchange_ack`).

Invariants:

* Every message is posted non-blocking, receives first, and each direction waits only on
  its own peer, so an exchange cannot deadlock for any world size and ring offset (W = 2,
  where both peers are one rank, included) as long as every rank takes part.
* The whole call honours ``timeout``: it raises :class:`PeerTimeoutError` at the deadline,
  or :class:`TransportError` as soon as gloo sees a broken connection; it never waits for
  the process group's own timeout.  ``timeout`` is a parameter rather than the caller's
  cancel scope (ruff ASYNC109) because it must reach the gloo waits in worker threads.
* Pending gloo work cannot be cancelled.  So when a call fails after posting anything, or
  is cancelled, it **breaks the group on purpose** before it returns (a 1 ms timed-out
  receive makes gloo close every connection of the group on this rank): gloo then lets go
  of every payload and body tensor at once, and the peers fail at once instead of at their
  own deadline.  The caller must treat the group as dead: destroy it
  (``dist.destroy_process_group(pg)``) and make a new one, or restart the job.  A subgroup
  made with ``new_group`` breaks alone: the default group survives.  A failure that the
  peer *reports* in a well-formed acknowledgement (:class:`PeerReportedError`) leaves the
  group intact.
* Cancellation is delivered at once; only a packing copy (one chunk) finishes first.  The
  threads waiting on the abandoned work return when the group is broken, a few ms later.

Only gloo with CPU tensors is supported; other backends get no group-breaking guarantee.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import anyio
import torch
import torch.distributed as dist

from ._errors import ConfigurationError, IntegrityError, PeerReportedError, PeerTimeoutError, TransportError
from ._slices import SLICE_SECONDS, Steps, clock, run_steps

log = logging.getLogger("astage.transport")

MAGIC = 0x4153_5441_4745_5752
"""First preamble word: ``b"ASTAGEWR"`` read as a big-endian int64."""
VERSION = 1
PREAMBLE_WORDS = 8

_TAG_BASE = 0x4153_0000
PREAMBLE_TAG = _TAG_BASE + 1
PREFIX_TAG = _TAG_BASE + 2
BODY_TAG = _TAG_BASE + 3
ACK_TAG = _TAG_BASE + 4
_BREAK_TAG = _TAG_BASE + 5
"""Nobody ever sends on it: a timed-out receive there is how a group is broken."""

CHUNK_BYTES = 16 << 20
"""Default body chunk: large enough to amortise a message, small enough to pipeline."""
MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 1 << 30
MAX_PREFIX_BYTES = 64 << 20
"""Default cap on a received prefix, checked before it is allocated."""

ACK_BYTES = 256
_ACK_MAGIC = b"ASTGACK1"
_ACK_HEAD = struct.Struct("<8sBH")
ACK_MESSAGE_BYTES = ACK_BYTES - _ACK_HEAD.size
"""Longest peer message an acknowledgement carries (UTF-8 bytes; longer ones are cut)."""

_WINDOW = 4
"""Chunks posted ahead of the one being waited for, per direction."""
_PACK_BUFFERS = 2
_THREAD_GRACE = 0.5
"""A waiting thread's own gloo timeout runs this long past the deadline: a backstop in case
the loop cannot break the group; normally the loop reports the timeout first."""


@dataclass(frozen=True)
class Payload:
    """One replica to send.

    :ivar prefix: a small header blob, sent first.
    :ivar segments: ``(body_offset, tensor)`` pairs: 1-D contiguous CPU ``uint8`` tensors in
        ascending, non-overlapping offset order, inside ``body_nbytes``.  Gaps are zeros.
    :ivar body_nbytes: size of the logical body.
    """

    prefix: bytes
    segments: Sequence[tuple[int, torch.Tensor]]
    body_nbytes: int


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


@dataclass(frozen=True)
class Chunk:
    """One body message: ``parts`` fill ``[offset, offset + nbytes)`` in order.

    A part is a tensor (a segment or a slice of one) or an ``int``: that many zero bytes.
    """

    offset: int
    nbytes: int
    parts: tuple[torch.Tensor | int, ...]


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
        raise ConfigurationError(f"peer offset {k} maps every rank of {world_size} to itself")
    return (rank + k) % world_size, (rank - k) % world_size


def plan_chunks(
    segments: Sequence[tuple[int, torch.Tensor]], body_nbytes: int, chunk_bytes: int
) -> Steps[ChunkPlan]:
    """Validate ``segments`` and cut the body into chunks on a grid of ``chunk_bytes``.

    Pure: touches no tensor data.  Runs as time-sliced :data:`Steps`.

    :raises ConfigurationError: a bad chunk size, segment tensor or segment offset.
    """
    _check_chunk_bytes(chunk_bytes, ConfigurationError, "chunk_bytes")
    if body_nbytes < 0:
        raise ConfigurationError(f"body_nbytes must be >= 0, got {body_nbytes}")
    # Non-empty segments as parallel lists, closed by a sentinel start at the body's end.
    starts: list[int] = []
    ends: list[int] = []
    tensors: list[torch.Tensor] = []
    end = 0
    deadline = clock() + SLICE_SECONDS
    for i, (offset, tensor) in enumerate(segments):
        if not (
            isinstance(tensor, torch.Tensor)
            and tensor.dtype is torch.uint8
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
        if clock() > deadline:
            yield
            deadline = clock() + SLICE_SECONDS
    starts.append(body_nbytes)
    chunks: list[Chunk] = []
    s = 0
    for start in range(0, body_nbytes, chunk_bytes):
        stop = min(start + chunk_bytes, body_nbytes)
        parts: list[torch.Tensor | int] = []
        pos = start
        while pos < stop:
            seg_start = starts[s]
            if seg_start > pos:
                gap_end = min(seg_start, stop)
                parts.append(gap_end - pos)
                pos = gap_end
            elif pos == seg_start and ends[s] <= stop:
                parts.append(tensors[s])
                pos = ends[s]
                s += 1
            else:
                part_end = min(ends[s], stop)
                parts.append(tensors[s][pos - seg_start : part_end - seg_start])
                pos = part_end
                if pos == ends[s]:
                    s += 1
            if clock() > deadline:
                yield
                deadline = clock() + SLICE_SECONDS
        chunks.append(Chunk(start, stop - start, tuple(parts)))
    return ChunkPlan(tuple(chunks), chunk_bytes)


async def exchange(
    pg: dist.ProcessGroup | None,
    payload: Payload,
    *,
    send_to: int,
    recv_from: int,
    timeout: float,  # noqa: ASYNC109 (see the module docstring)
    max_body_bytes: int,
    max_prefix_bytes: int = MAX_PREFIX_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
    allocate: Allocate | None = None,
    on_prefix: OnPrefix | None = None,
    on_chunk: OnChunk | None = None,
) -> Received:
    """Send ``payload`` to ``send_to`` and receive a replica from ``recv_from``, concurrently.

    Ranks are in ``pg``'s rank space (``None``: the default group).  Every rank of a ring
    calls this at the same time; ``send_to == recv_from`` is fine.

    :param timeout: seconds for the whole call, ``on_chunk`` included.
    :param max_body_bytes: largest body accepted from the peer; checked before allocating.
    :param max_prefix_bytes: largest prefix accepted; checked before allocating.
    :param chunk_bytes: size of the body messages this rank sends.
    :param allocate: ``allocate(nbytes)`` returns a contiguous CPU ``uint8`` tensor of at
        least ``nbytes`` to receive the body into (default ``torch.empty``).
    :param on_prefix: awaited with the prefix as soon as it lands, before the body is
        allocated: raising there (say, on a header that does not parse) aborts the transfer.
    :param on_chunk: awaited with ``(body_offset, chunk)`` as each chunk lands, in order,
        while later chunks are in flight.
    :returns: the peer's prefix and body, and the stats of the call.
    :raises ConfigurationError: bad peers, timeout, caps, chunk size, payload or allocation.
    :raises IntegrityError: the peer's preamble is malformed or over a cap.
    :raises PeerTimeoutError: the exchange did not finish within ``timeout``.
    :raises TransportError: gloo reported a failure (for example a peer that died).
    """
    link = _Link(pg, timeout, send_to=send_to, recv_from=recv_from)
    limits = _Limits(max_body_bytes, max_prefix_bytes, allocate, on_prefix, on_chunk)
    plan = await run_steps(plan_chunks(payload.segments, payload.body_nbytes, chunk_bytes))
    await link.run(lambda: _send(link, payload.prefix, plan), lambda: _receive(link, limits))
    return link.received()


async def send(
    pg: dist.ProcessGroup | None,
    payload: Payload,
    *,
    to: int,
    timeout: float,  # noqa: ASYNC109 (see the module docstring)
    chunk_bytes: int = CHUNK_BYTES,
) -> ExchangeStats:
    """Send ``payload`` to ``to``, which must call :func:`recv` at the same time.

    :returns: the stats of the call.
    :raises: as :func:`exchange`.
    """
    link = _Link(pg, timeout, send_to=to)
    plan = await run_steps(plan_chunks(payload.segments, payload.body_nbytes, chunk_bytes))
    await link.run(lambda: _send(link, payload.prefix, plan))
    return link.stats()


async def recv(
    pg: dist.ProcessGroup | None,
    *,
    from_: int,
    timeout: float,  # noqa: ASYNC109 (see the module docstring)
    max_body_bytes: int,
    max_prefix_bytes: int = MAX_PREFIX_BYTES,
    allocate: Allocate | None = None,
    on_prefix: OnPrefix | None = None,
    on_chunk: OnChunk | None = None,
) -> Received:
    """Receive a replica that ``from_`` sends with :func:`send` (or :func:`exchange`).

    :returns: the peer's prefix and body, and the stats of the call.
    :raises: as :func:`exchange`.
    """
    link = _Link(pg, timeout, recv_from=from_)
    limits = _Limits(max_body_bytes, max_prefix_bytes, allocate, on_prefix, on_chunk)
    await link.run(lambda: _receive(link, limits))
    return link.received()


async def send_ack(
    pg: dist.ProcessGroup | None,
    to: int,
    ok: bool,
    *,
    timeout: float,  # noqa: ASYNC109 (see the module docstring)
    message: str = "",
) -> None:
    """Tell ``to`` whether the replica it sent us is durable (``ok``), with a short ``message``.

    Gloo sends are rendezvous: this returns only once ``to`` is in :func:`recv_ack`, so a
    ring in which every rank first sends then receives deadlocks; use :func:`exchange_ack`.

    :param message: cut to :data:`ACK_MESSAGE_BYTES` UTF-8 bytes.
    :raises: as :func:`exchange`.
    """
    link = _Link(pg, timeout, send_to=to)
    await link.run(lambda: _send_ack(link, ok, message))


async def recv_ack(pg: dist.ProcessGroup | None, from_: int, *, timeout: float) -> None:  # noqa: ASYNC109
    """Wait for ``from_`` to acknowledge the replica we sent it.

    :raises PeerReportedError: the peer reports failure (its message is in the error); the
        group is still healthy.
    :raises IntegrityError: the acknowledgement is malformed.
    :raises: as :func:`exchange` otherwise.
    """
    link = _Link(pg, timeout, recv_from=from_)
    await link.run(lambda: _recv_ack(link))
    link.raise_peer_failure()


async def exchange_ack(
    pg: dist.ProcessGroup | None,
    ok: bool,
    *,
    send_to: int,
    recv_from: int,
    timeout: float,  # noqa: ASYNC109 (see the module docstring)
    message: str = "",
) -> None:
    """Agree on the outcome of an :func:`exchange` made with the same peers.

    Acknowledgements run backwards along the ring: this rank tells ``recv_from`` whether
    its replica is durable here (``ok``, ``message``) while it hears from ``send_to`` whether
    ours is durable there, both at once (so no ring can deadlock).

    :raises PeerReportedError: ``send_to`` reports failure (its message is in the error);
        the group is still healthy.
    :raises: as :func:`recv_ack` otherwise.
    """
    link = _Link(pg, timeout, send_to=recv_from, recv_from=send_to)
    await link.run(lambda: _send_ack(link, ok, message), lambda: _recv_ack(link))
    link.raise_peer_failure()


# -- one call's connection --------------------------------------------------------------


@dataclass(frozen=True)
class _Limits:
    """How the receiving side checks, places and hands on what arrives."""

    max_body_bytes: int
    max_prefix_bytes: int
    allocate: Allocate | None
    on_prefix: OnPrefix | None
    on_chunk: OnChunk | None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 0 or self.max_prefix_bytes < 0:
            raise ConfigurationError("max_body_bytes and max_prefix_bytes must be >= 0")


class _Link:
    """One call's view of the group: peers, deadline, pending work and progress."""

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        timeout: float,
        *,
        send_to: int | None = None,
        recv_from: int | None = None,
    ) -> None:
        if not (isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0):
            raise ConfigurationError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError("torch.distributed is not initialised")
        self.rank = dist.get_rank(pg)
        if self.rank < 0:
            raise ConfigurationError("this rank is not a member of the process group")
        world = dist.get_world_size(pg)
        for name, peer in (("send_to", send_to), ("recv_from", recv_from)):
            if peer is not None and not (isinstance(peer, int) and 0 <= peer < world and peer != self.rank):
                raise ConfigurationError(f"{name}={peer!r} is not another rank of this group of {world}")
        self.pg = pg
        self.timeout = float(timeout)
        self.send_to = send_to
        self.recv_from = recv_from
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout
        # One waiting thread per direction, and packing shares the sender's.
        self.limiter = anyio.CapacityLimiter(2)
        # Posted work not yet seen complete, with the tensor it reads or writes.
        self.pending: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.bytes_expected: int | None = None
        self.chunks_sent = 0
        self.chunks_packed = 0
        self.chunks_received = 0
        self.prefix = b""
        self.body: torch.Tensor | None = None
        # A failure the peer reported in a well-formed acknowledgement: the group is fine.
        self.peer_failure: str | None = None

    async def run(self, *directions: Callable[[], Awaitable[None]]) -> None:
        """Run the directions concurrently under the deadline; break the group on failure.

        :raises: the first direction's error, :class:`PeerTimeoutError` at the deadline, or
            the caller's cancellation.
        """
        errors: list[Exception] = []

        async def guarded(direction: Callable[[], Awaitable[None]], scope: anyio.CancelScope) -> None:
            try:
                await direction()
            except Exception as exc:
                errors.append(exc)
                scope.cancel()

        try:
            with anyio.CancelScope(
                deadline=anyio.current_time() + (self.deadline - time.monotonic())
            ) as timer:
                async with anyio.create_task_group() as tg:
                    for direction in directions:
                        tg.start_soon(guarded, direction, tg.cancel_scope)
            if errors:
                raise errors[0]
            if timer.cancelled_caught:
                raise PeerTimeoutError(f"{self._progress()}: not complete within {self.timeout:g} s")
        except BaseException as exc:
            # Whatever went wrong, the two sides no longer agree on what comes next.
            log.warning("rank %d: breaking the process group after a failed transfer: %r", self.rank, exc)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._break, limiter=self.limiter)
            raise
        stats = self.stats()
        log.debug(
            "rank %d: sent %d B to %s, received %d B from %s in %.3f s (%.2f GB/s)",
            self.rank,
            stats.bytes_sent,
            self.send_to,
            stats.bytes_received,
            self.recv_from,
            stats.seconds,
            stats.gbps,
        )

    def stats(self) -> ExchangeStats:
        return ExchangeStats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            seconds=time.monotonic() - self.started,
            chunks_sent=self.chunks_sent,
            chunks_packed=self.chunks_packed,
            chunks_received=self.chunks_received,
        )

    def raise_peer_failure(self) -> None:
        if self.peer_failure is not None:
            raise PeerReportedError(self.peer_failure)

    def received(self) -> Received:
        assert self.body is not None
        return Received(self.prefix, self.body, self.stats())

    def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> dist.Work:
        """Post a non-blocking send to ``send_to`` or receive from ``recv_from``."""
        try:
            if send:
                work = dist.isend(tensor, group=self.pg, group_dst=self.send_to, tag=tag)
            else:
                work = dist.irecv(tensor, group=self.pg, group_src=self.recv_from, tag=tag)
        except RuntimeError as exc:
            raise self._translate(exc, send=send) from exc
        if work is None:
            raise ConfigurationError("this rank is not a member of the process group")
        self.pending[id(work)] = (work, tensor)
        return work

    async def complete(self, work: dist.Work, *, send: bool) -> None:
        """Wait for ``work`` in a worker thread: gloo completes p2p work only in ``wait``."""
        try:
            if not work.is_completed():
                done = await anyio.to_thread.run_sync(
                    _wait_boxed,
                    [work],
                    self.deadline + _THREAD_GRACE,
                    limiter=self.limiter,
                    abandon_on_cancel=True,
                )
                if not done:
                    raise RuntimeError("the backend aborted the operation")
        except RuntimeError as exc:
            raise self._translate(exc, send=send) from exc
        del self.pending[id(work)]

    def _break(self) -> None:
        # A timed-out gloo wait makes gloo close every pair of the group's context: all
        # pending work fails at once (so gloo lets go of our tensors) and the peers see a
        # closed connection right away instead of at their own deadline.
        peer = self.recv_from if self.recv_from is not None else self.send_to
        probe = torch.empty(1, dtype=torch.uint8)
        try:
            if dist.get_backend(self.pg) == "gloo":
                work = dist.irecv(probe, group=self.pg, group_src=peer, tag=_BREAK_TAG)
                if work is not None:
                    work.wait(timedelta(milliseconds=1))
        except (RuntimeError, ValueError):
            pass  # the expected timeout, or a group already broken or destroyed
        self.pending.clear()

    def _translate(self, exc: RuntimeError, *, send: bool) -> TransportError:
        what = f"rank {self.rank}: " + (
            f"sending to rank {self.send_to}" if send else f"receiving from rank {self.recv_from}"
        )
        text = str(exc).strip()
        # Gloo prefixes its messages with a source location: keep the words, not the path.
        text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else type(exc).__name__
        if "timed out" in text.lower():
            return PeerTimeoutError(f"{what}: {text}")
        return TransportError(f"{what}: {text}")

    def _progress(self) -> str:
        parts = []
        if self.send_to is not None:
            parts.append(f"sending to rank {self.send_to} ({self.bytes_sent} B so far)")
        if self.recv_from is not None:
            of = "" if self.bytes_expected is None else f" of {self.bytes_expected}"
            parts.append(f"receiving from rank {self.recv_from} ({self.bytes_received}{of} B so far)")
        return f"rank {self.rank}: " + " and ".join(parts)


def _wait_boxed(box: list[dist.Work], deadline: float) -> bool:
    # An idle worker thread keeps its last call's arguments alive: the box is emptied here
    # so that a parked thread does not pin the work and the tensors it holds.
    work = box.pop()
    # A zero timedelta means "no timeout" to c10d: never pass less than 1 ms.
    remaining = max(deadline - time.monotonic(), 1e-3)
    return bool(work.wait(timedelta(seconds=remaining)))


def _check_chunk_bytes(chunk_bytes: int, error: type[Exception], name: str) -> None:
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise error(f"{name} must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")


# -- the directions ---------------------------------------------------------------------


async def _send(link: _Link, prefix: bytes, plan: ChunkPlan) -> None:
    body_nbytes = sum(c.nbytes for c in plan.chunks)
    words = [MAGIC, VERSION, len(prefix), body_nbytes, plan.chunk_bytes]
    preamble = torch.tensor(words + [0] * (PREAMBLE_WORDS - len(words)), dtype=torch.int64)
    # (work, pack buffer it holds or None), in posting order.
    inflight: deque[tuple[dist.Work, torch.Tensor | None]] = deque()
    inflight.append((link.post(preamble, PREAMBLE_TAG, send=True), None))
    if prefix:
        blob = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        inflight.append((link.post(blob, PREFIX_TAG, send=True), None))
        link.bytes_sent += len(prefix)
    free: list[torch.Tensor] = []
    allocated = 0

    async def retire_oldest() -> None:
        work, buffer = inflight.popleft()
        await link.complete(work, send=True)
        if buffer is not None:
            free.append(buffer)

    for chunk in plan.chunks:
        buffer = None
        if len(chunk.parts) == 1:
            part = chunk.parts[0]
            tensor = part if isinstance(part, torch.Tensor) else torch.zeros(part, dtype=torch.uint8)
        else:
            while not free and allocated == _PACK_BUFFERS:
                await retire_oldest()
            if free:
                buffer = free.pop()
            else:
                buffer = torch.empty(min(plan.chunk_bytes, body_nbytes), dtype=torch.uint8)
                allocated += 1
            tensor = buffer[: chunk.nbytes]
            await anyio.to_thread.run_sync(_pack_boxed, [(chunk.parts, tensor)], limiter=link.limiter)
            link.chunks_packed += 1
        inflight.append((link.post(tensor, BODY_TAG, send=True), buffer))
        link.chunks_sent += 1
        link.bytes_sent += chunk.nbytes
        while len(inflight) > _WINDOW:
            await retire_oldest()
    while inflight:
        await retire_oldest()


def _pack_boxed(box: list[tuple[tuple[torch.Tensor | int, ...], torch.Tensor]]) -> None:
    # One memmove per part (validated contiguous CPU uint8, kept alive by the plan), over a
    # buffer zeroed first when the chunk has gaps: ~2.5 us a part where torch.cat of views
    # costs ~8, which matters with 20,000 tiny tensors.
    parts, out = box.pop()
    if any(isinstance(p, int) for p in parts):
        out.zero_()
    at = out.data_ptr()
    for part in parts:
        if isinstance(part, int):
            at += part
        else:
            n = part.numel()
            ctypes.memmove(at, part.data_ptr(), n)
            at += n


async def _receive(link: _Link, limits: _Limits) -> None:
    preamble = torch.zeros(PREAMBLE_WORDS, dtype=torch.int64)
    await link.complete(link.post(preamble, PREAMBLE_TAG, send=False), send=False)
    prefix_len, body_nbytes, chunk_bytes = _check_preamble(preamble.tolist(), link.recv_from, limits)
    link.bytes_expected = prefix_len + body_nbytes

    prefix = torch.empty(prefix_len, dtype=torch.uint8)
    if prefix_len:
        await link.complete(link.post(prefix, PREFIX_TAG, send=False), send=False)
        link.bytes_received += prefix_len
    link.prefix = prefix.numpy().tobytes()
    if limits.on_prefix is not None:
        await limits.on_prefix(link.prefix)
    body = _allocate_body(limits.allocate, body_nbytes)
    # The chunk views are made as they are posted: a lazy grid stays small however many
    # chunks the peer announces.
    offsets = range(0, body_nbytes, chunk_bytes)
    inflight: deque[dist.Work] = deque()
    for offset in offsets[:_WINDOW]:
        inflight.append(link.post(body[offset : offset + chunk_bytes], BODY_TAG, send=False))
    for i, offset in enumerate(offsets):
        await link.complete(inflight.popleft(), send=False)
        if i + _WINDOW < len(offsets):
            ahead = offsets[i + _WINDOW]
            inflight.append(link.post(body[ahead : ahead + chunk_bytes], BODY_TAG, send=False))
        chunk = body[offset : offset + chunk_bytes]
        link.bytes_received += chunk.numel()
        link.chunks_received += 1
        if limits.on_chunk is not None:
            await limits.on_chunk(offset, chunk)
    link.body = body


def _check_preamble(words: list[int], peer: int | None, limits: _Limits) -> tuple[int, int, int]:
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
    _check_chunk_bytes(chunk_bytes, IntegrityError, f"{source}'s chunk size")
    return prefix_len, body_nbytes, chunk_bytes


def _allocate_body(allocate: Allocate | None, nbytes: int) -> torch.Tensor:
    body = torch.empty(nbytes, dtype=torch.uint8) if allocate is None else allocate(nbytes)
    if not (
        isinstance(body, torch.Tensor)
        and body.dtype == torch.uint8
        and body.device.type == "cpu"
        and body.is_contiguous()
        and body.numel() >= nbytes
    ):
        raise ConfigurationError(
            f"allocate({nbytes}) must return a contiguous CPU uint8 tensor of >= {nbytes} elements"
        )
    return body.reshape(-1)[:nbytes]


async def _send_ack(link: _Link, ok: bool, message: str) -> None:
    text = message.encode("utf-8")[:ACK_MESSAGE_BYTES].decode("utf-8", errors="ignore").encode("utf-8")
    blob = bytearray(ACK_BYTES)
    _ACK_HEAD.pack_into(blob, 0, _ACK_MAGIC, 1 if ok else 0, len(text))
    blob[_ACK_HEAD.size : _ACK_HEAD.size + len(text)] = text
    tensor = torch.frombuffer(blob, dtype=torch.uint8)
    await link.complete(link.post(tensor, ACK_TAG, send=True), send=True)


async def _recv_ack(link: _Link) -> None:
    tensor = torch.zeros(ACK_BYTES, dtype=torch.uint8)
    await link.complete(link.post(tensor, ACK_TAG, send=False), send=False)
    blob = tensor.numpy().tobytes()
    magic, ok, length = _ACK_HEAD.unpack_from(blob)
    if magic != _ACK_MAGIC or ok not in (0, 1) or length > ACK_MESSAGE_BYTES:
        raise IntegrityError(f"rank {link.recv_from} sent a malformed acknowledgement")
    if not ok:
        text = blob[_ACK_HEAD.size : _ACK_HEAD.size + length].decode("utf-8", errors="replace")
        link.peer_failure = f"rank {link.recv_from} reports failure: {text or 'no reason given'}"
