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

The protocol above is the same on every backend; a *wire* per backend moves the messages
(:func:`wire_kind` picks it from the group's backend configuration):

* **gloo** (any group with ``cpu:gloo``, ``cpu:gloo,cuda:nccl`` included: the payload is on
  the CPU already).  CPU tensors go straight through.  Gloo reports a point-to-point
  ``Work`` complete only from inside ``wait()`` (its ``is_completed()`` stays false and
  ``get_future()`` is missing; checked on torch 2.13), so each direction waits in its own
  worker thread (two per call, under a private limiter).  Gloo sends are rendezvous: a send
  completes only once the peer has posted the matching receive, which is why
  acknowledgements go both ways at once (:func:`exchange_ack`).
* **nccl** (a ``cuda:nccl`` group without gloo).  NCCL moves device tensors only, so each
  message crosses through a device bounce buffer from a small per-call pool: a message to
  send is copied host-to-device on a side stream (from the loop when the host tensor is
  pinned, in a worker thread otherwise) and the NCCL launch waits for that stream; a
  received message lands in a bounce buffer and is copied device-to-host on a second side
  stream, and counts as received once that copy has completed.  NCCL's
  ``Work.is_completed()`` queries the work's CUDA end event, so completion is polled from
  the loop with :func:`astage._events.wait_event`'s back-off and no thread waits.  NCCL
  ignores tags and runs a rank's point-to-point work on one stream in launch order: a lone
  send to a peer that is itself sending would never complete, so the k-th message of each
  direction is launched together with the k-th of the other, as one ``batch_isend_irecv``
  (one NCCL group), which :class:`Pairing` schedules.  Launches run one at a time, in
  order, in a worker thread: the first one on a group creates its NCCL communicator and
  blocks until every rank of the group has arrived.

Invariants:

* Every message is posted non-blocking, receives first, and each direction waits only on
  its own peer, so an exchange cannot deadlock for any world size and ring offset (W = 2,
  where both peers are one rank, included) as long as every rank takes part.  On NCCL the
  k-th launch of every rank matches the k-th launches of its peers, and a direction posts
  message k only once its message k - window has completed, so by induction on k every
  launch finds its matches.
* The whole call honours ``timeout``: it raises :class:`PeerTimeoutError` at the deadline,
  or :class:`TransportError` as soon as the backend reports a failure; it never waits for
  the process group's own timeout.  ``timeout`` is a parameter rather than the caller's
  cancel scope (ruff ASYNC109) because it must reach the gloo waits in worker threads.
* Pending point-to-point work cannot be cancelled.  So when a call fails or is cancelled
  after posting anything, it **breaks the group on purpose** before it returns (a call that
  fails before its first post, say on a bad argument, leaves the group as it was).  Gloo: a
  1 ms timed-out receive makes gloo close every connection of the group on this rank; gloo
  lets go of every payload and body tensor at once, and the peers fail at once instead of
  at their own deadline.  NCCL: ``ProcessGroup.abort()`` tears the communicator down (its
  kernels exit and let go of the bounce buffers, which torch keeps alive until then) and
  the side streams are drained, so no copy touches a payload or body afterwards; NCCL has
  no connection to close, so the peers fail at their own deadline.  The call returns once
  the abort has (torch bounds an abort by the group's own timeout).  Either way the caller
  must treat the group as dead: destroy it (``dist.destroy_process_group(pg)``) and make a
  new one, or restart the job.  A subgroup made with ``new_group`` breaks alone: the
  default group survives.  A failure that the peer *reports* in a well-formed
  acknowledgement (:class:`PeerReportedError`) leaves the group intact.
* Cancellation is delivered at once; only a packing copy or a copy from or to pageable
  memory (one chunk) finishes first.  Gloo threads waiting on abandoned work return when
  the group is broken, a few ms later.
* A buffer (a pack buffer, a bounce buffer, the caller's segments and body) is reused or
  released only once every copy and every backend operation touching it has been seen
  complete, or the group has been broken.

One call at a time per group, on every backend.  On NCCL, moreover, nothing else may use
the group during a call: its collectives and our launches share one communicator, whose
operations every rank must issue in the same order, so give replication a group of its own
(``dist.new_group``).  Each rank must use its own device: the group's bound device
(``init_process_group(device_id=...)``), else the current CUDA device
(``torch.cuda.set_device``).  The first call on a group must be made by all of its ranks (a
ring exchange is), unless the group was initialised with ``device_id``, which creates the
communicator up front.  In a group of one rank, NCCL may loop back (``send_to == recv_from
== 0``): one GPU runs the whole path that way.  Other backends are refused.
"""

from __future__ import annotations

import contextlib
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
from typing import Generic, Literal, Protocol, TypeVar

import anyio
import torch
import torch.distributed as dist

from ._errors import ConfigurationError, IntegrityError, PeerReportedError, PeerTimeoutError, TransportError
from ._events import Queryable, wait_event
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
"""Gloo: chunks posted ahead of the one being waited for, per direction."""
_NCCL_WINDOW = 2
"""NCCL: the same, kept small because each message in flight holds a device bounce buffer
(at most ``2 * _NCCL_WINDOW`` chunks of device memory a call)."""
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


T = TypeVar("T")


class Pairing(Generic[T]):
    """Group the messages of a call's two directions into launches, in order (no I/O).

    The k-th launch holds the k-th message of each direction that has one, so the k-th
    launches of two peers match message for message.  A launch waits for both directions
    while each may still post its k-th message, and goes alone once the other direction
    has posted all it said it would (:meth:`expect`).  A direction the call does not use
    is created closed.
    """

    def __init__(self, *, sends: bool, receives: bool) -> None:
        self._queued: dict[bool, deque[T]] = {True: deque(), False: deque()}
        self._posted = {True: 0, False: 0}
        self._total: dict[bool, int | None] = {True: None if sends else 0, False: None if receives else 0}

    def push(self, item: T, *, send: bool) -> None:
        """Queue the direction's next message."""
        total = self._total[send]
        if total is not None and self._posted[send] >= total:
            raise RuntimeError(f"{'send' if send else 'receive'} direction posted more than it announced")
        self._posted[send] += 1
        self._queued[send].append(item)

    def expect(self, total: int, *, send: bool) -> None:
        """Announce that the direction posts ``total`` messages in all (those so far included)."""
        if total < self._posted[send]:
            raise RuntimeError(f"announced {total} messages after posting {self._posted[send]}")
        self._total[send] = total

    def pop(self) -> tuple[T, ...] | None:
        """The next launch (send first), or ``None`` while it cannot be formed yet."""
        for send in (True, False):
            if not self._queued[send] and self._open(send):
                return None
        batch = tuple(self._queued[send].popleft() for send in (True, False) if self._queued[send])
        return batch or None

    def _open(self, send: bool) -> bool:
        total = self._total[send]
        return total is None or self._posted[send] < total


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
    on_posted: Callable[[], None] | None = None,
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
    :param on_posted: called once, just before this call first touches the group (posts or
        launches a message).  A call that fails before that leaves the group as it was; one
        that fails after it has broken the group (see the module docstring).
    :returns: the peer's prefix and body, and the stats of the call.
    :raises ConfigurationError: bad peers, timeout, caps, chunk size, payload or allocation;
        a backend other than gloo or NCCL; an NCCL group without CUDA.
    :raises IntegrityError: the peer's preamble is malformed or over a cap.
    :raises PeerTimeoutError: the exchange did not finish within ``timeout``.
    :raises TransportError: the backend reported a failure (for example a peer that died).
    """
    link = _Link(pg, timeout, send_to=send_to, recv_from=recv_from, on_posted=on_posted)
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

    Sends are rendezvous (gloo) or launched in order on one stream (NCCL): this returns only
    once ``to`` is in :func:`recv_ack`, so a ring in which every rank first sends then
    receives deadlocks; use :func:`exchange_ack`.

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
        for name in ("max_body_bytes", "max_prefix_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigurationError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("allocate", "on_prefix", "on_chunk"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ConfigurationError(f"{name} must be callable or None, got {getattr(self, name)!r}")


class _Link:
    """One call's view of the group: peers, deadline, wire, pending messages and progress."""

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        timeout: float,
        *,
        send_to: int | None = None,
        recv_from: int | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> None:
        if not (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0
        ):
            raise ConfigurationError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError("torch.distributed is not initialised")
        self.rank = dist.get_rank(pg)
        if self.rank < 0:
            raise ConfigurationError("this rank is not a member of the process group")
        world = dist.get_world_size(pg)
        for name, peer in (("send_to", send_to), ("recv_from", recv_from)):
            # A group of one has no other rank: there the only peer is a loopback.
            if peer is not None and not (
                type(peer) is int and 0 <= peer < world and (peer != self.rank or world == 1)
            ):
                raise ConfigurationError(f"{name}={peer!r} is not another rank of this group of {world}")
        self.pg = pg
        self.timeout = float(timeout)
        self.send_to = send_to
        self.recv_from = recv_from
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout
        # One worker thread per direction at a time (a wait, a packing or pageable copy, or
        # an NCCL launch): a direction awaits each before its next step.
        self.limiter = anyio.CapacityLimiter(2)
        self.wire: _Wire = (_GlooWire if wire_kind(dist.get_backend_config(pg)) == "gloo" else _NcclWire)(
            pg, self.rank, send_to, recv_from, self.deadline, self.limiter
        )
        # Posted messages not yet seen complete; each holds the tensors it reads or writes.
        self.pending: set[_Message] = set()
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
        # Whether this call has touched the group: before that, a failure leaves nothing
        # pending and no peer out of step, so there is nothing to break.
        self.posted = False
        self.on_posted = on_posted

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
            if not self.posted:
                raise  # nothing of this call is on the wire: the group is as it was
            # Whatever went wrong, the two sides no longer agree on what comes next.
            log.warning("rank %d: breaking the process group after a failed transfer: %r", self.rank, exc)
            with anyio.CancelScope(shield=True):
                # Not under the link's limiter: under trio its tokens stay with the abandoned
                # waiting threads until they end, which is what breaking the group makes happen.
                await anyio.to_thread.run_sync(self._break)
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

    def _posting(self) -> None:
        if not self.posted:
            self.posted = True
            if self.on_posted is not None:
                self.on_posted()

    async def expect(self, total: int, *, send: bool) -> None:
        """Announce that the direction posts ``total`` messages in all in this call."""
        self._posting()  # (NCCL may launch from here)
        try:
            await self.wire.expect(total, send=send)
        except RuntimeError as exc:
            raise self._translate(exc, send=send) from exc

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> _Message:
        """Post a non-blocking send of ``tensor`` to ``send_to`` or receive into it from ``recv_from``."""
        self._posting()
        try:
            message = await self.wire.post(tensor, tag, send=send)
        except RuntimeError as exc:
            raise self._translate(exc, send=send) from exc
        self.pending.add(message)
        return message

    async def complete(self, message: _Message, *, send: bool) -> None:
        """Wait until ``message`` has gone, or has landed in its tensor."""
        try:
            await message.complete()
        except RuntimeError as exc:
            raise self._translate(exc, send=send) from exc
        self.pending.discard(message)

    def _break(self) -> None:
        self.wire.break_group()
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


# -- wires: how each backend moves a message ------------------------------------------


class _Message(Protocol):
    """One posted message, holding what it reads or writes until it completes."""

    async def complete(self) -> None:
        """Return once the message has gone, or has landed in its tensor.

        :raises RuntimeError: the backend reported a failure.
        """
        ...


class _Wire(Protocol):
    """Moves the messages of one call over one backend."""

    window: int
    """Chunks a direction keeps in flight."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A CPU ``uint8`` buffer to pack chunks into."""
        ...

    async def expect(self, total: int, *, send: bool) -> None:
        """The direction posts ``total`` messages in all in this call."""
        ...

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> _Message:
        """Post a send of the CPU ``tensor``, or a receive into it."""
        ...

    def break_group(self) -> None:
        """Break the group so that nothing touches this call's tensors any more (blocking)."""
        ...


class _GlooWire:
    """CPU tensors straight through gloo; each wait in a worker thread (see the module docs)."""

    window = _WINDOW

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        rank: int,
        send_to: int | None,
        recv_from: int | None,
        deadline: float,
        limiter: anyio.CapacityLimiter,
    ) -> None:
        if rank in (send_to, recv_from):
            raise ConfigurationError("gloo cannot send to its own rank: a loopback needs an NCCL group")
        self.pg = pg
        self.send_to = send_to
        self.recv_from = recv_from
        self.deadline = deadline
        self.limiter = limiter

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    async def expect(self, total: int, *, send: bool) -> None:
        pass  # tags keep gloo's messages apart: no launch order to keep

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> _Message:
        if send:
            work = dist.isend(tensor, group=self.pg, group_dst=self.send_to, tag=tag)
        else:
            work = dist.irecv(tensor, group=self.pg, group_src=self.recv_from, tag=tag)
        if work is None:
            raise ConfigurationError("this rank is not a member of the process group")
        return _GlooMessage(work, tensor, self)

    def break_group(self) -> None:
        # A timed-out gloo wait makes gloo close every pair of the group's context: all
        # pending work fails at once (so gloo lets go of our tensors) and the peers see a
        # closed connection right away instead of at their own deadline.
        peer = self.recv_from if self.recv_from is not None else self.send_to
        probe = torch.empty(1, dtype=torch.uint8)
        try:
            work = dist.irecv(probe, group=self.pg, group_src=peer, tag=_BREAK_TAG)
            if work is not None:
                work.wait(timedelta(milliseconds=1))
        except (RuntimeError, ValueError):
            pass  # the expected timeout, or a group already broken or destroyed


class _GlooMessage:
    def __init__(self, work: dist.Work, tensor: torch.Tensor, wire: _GlooWire) -> None:
        self.work = work
        self.tensor = tensor
        self.wire = wire

    async def complete(self) -> None:
        # Gloo completes point-to-point work only inside wait(): wait in a worker thread.
        if not self.work.is_completed():
            done = await anyio.to_thread.run_sync(
                _wait_boxed,
                [self.work],
                self.wire.deadline + _THREAD_GRACE,
                limiter=self.wire.limiter,
                abandon_on_cancel=True,
            )
            if not done:
                raise RuntimeError("the backend aborted the operation")


def _wait_boxed(box: list[dist.Work], deadline: float) -> bool:
    # An idle worker thread keeps its last call's arguments alive: the box is emptied here
    # so that a parked thread does not pin the work and the tensors it holds.
    work = box.pop()
    # A zero timedelta means "no timeout" to c10d: never pass less than 1 ms.
    remaining = max(deadline - time.monotonic(), 1e-3)
    return bool(work.wait(timedelta(seconds=remaining)))


class _NcclWire:
    """Every message through a device bounce buffer, launched in pairs (see the module docs).

    Two side streams: ``h2d`` carries the copies into bounce buffers and is the current
    stream at each launch (so NCCL waits for those copies); ``d2h`` carries the copies out.
    A message's ``complete()`` polls its launch's works, then makes the stream that touches
    its bounce buffer next wait for them too (``Work.wait()`` on that stream), so the
    ordering holds on the device whatever the host saw.
    """

    window = _NCCL_WINDOW

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        rank: int,
        send_to: int | None,
        recv_from: int | None,
        deadline: float,
        limiter: anyio.CapacityLimiter,
    ) -> None:
        if not torch.cuda.is_available():
            raise ConfigurationError(
                "an NCCL process group needs CUDA, and torch.cuda.is_available() is False"
            )
        group = pg if pg is not None else dist.group.WORLD
        assert group is not None  # torch.distributed is initialised
        self.pg = pg
        self.group = group
        self.send_to = send_to
        self.recv_from = recv_from
        self.limiter = limiter
        bound = group.bound_device_id
        self.device = bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
        self.h2d = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.d2h = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.pairing: Pairing[_NcclMessage] = Pairing(
            sends=send_to is not None, receives=recv_from is not None
        )
        self.launching = anyio.Lock()
        self.free: list[torch.Tensor] = []

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Pinned, so that its copy to the device is asynchronous and issued from the loop.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    async def expect(self, total: int, *, send: bool) -> None:
        self.pairing.expect(total, send=send)
        await self._launch_ready()

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> _Message:
        host = tensor.reshape(-1).view(torch.uint8)
        buffer = self.take(host.numel())
        message = _NcclMessage(self, host, buffer, send)
        if send:
            message.copied = await self.copy(buffer[: host.numel()], host, self.h2d)
        self.pairing.push(message, send=send)
        await self._launch_ready()
        return message

    def break_group(self) -> None:
        # Blocking (abort, stream synchronisation): only ever called through _Link._break,
        # which runs in a worker thread.
        # Aborting the communicator makes its kernels exit, so no launch waits any more on
        # a peer; torch keeps the bounce buffers alive until the NCCL stream is done with
        # them.  Our own copies never wait for NCCL: draining their streams is quick, and
        # afterwards no copy touches the caller's segments or body.
        with contextlib.suppress(RuntimeError):  # already aborted or destroyed
            self.group.abort()
        self.h2d.synchronize()
        self.d2h.synchronize()

    # -- device buffers and copies

    def take(self, nbytes: int) -> torch.Tensor:
        """The smallest free bounce buffer of at least ``nbytes``, or a new one."""
        fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if fits:
            return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        # Allocated on h2d, the stream that writes it first: a block the caching allocator
        # hands out there is one no other stream may still be using.
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    async def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> Queryable | None:
        """Copy between a host tensor and a bounce buffer on ``stream``.

        Pinned host memory: issued from the loop; returns an event recorded after the copy.
        Pageable host memory: the copy blocks the thread that issues it, so it runs to its
        end in a worker thread (not abandoned on cancellation: it is one chunk); returns
        ``None``.
        """
        host = dst if dst.device.type == "cpu" else src
        if host.is_pinned():
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                copied: Queryable = stream.record_event()
            return copied
        await anyio.to_thread.run_sync(_copy_boxed, [(dst, src)], self.device, stream, limiter=self.limiter)
        return None

    # -- launching

    async def _launch_ready(self) -> None:
        """Launch every batch that can be formed, in order, one at a time."""
        async with self.launching:
            while (batch := self.pairing.pop()) is not None:
                ops = [
                    dist.P2POp(
                        dist.isend if m.send else dist.irecv,
                        m.buffer[: m.host.numel()],
                        group=self.pg,
                        group_peer=self.send_to if m.send else self.recv_from,
                    )
                    for m in batch
                ]
                works = await anyio.to_thread.run_sync(
                    _launch_boxed, [ops], self.device, self.h2d, limiter=self.limiter, abandon_on_cancel=True
                )
                if not works:
                    raise RuntimeError("the backend returned no work for a launch")
                for message in batch:
                    message.launched(works)


class _NcclMessage:
    def __init__(self, wire: _NcclWire, host: torch.Tensor, buffer: torch.Tensor, send: bool) -> None:
        self.wire = wire
        self.host = host
        self.buffer = buffer
        self.send = send
        self.copied: Queryable | None = None
        self.works: list[dist.Work] = []
        self._launched = anyio.Event()

    def launched(self, works: list[dist.Work]) -> None:
        self.works = works
        self._launched.set()

    async def complete(self) -> None:
        wire = self.wire
        await self._launched.wait()
        await wait_event(_WorksDone(self.works))
        # Raise the backend's error if the launch failed, and make the stream that touches
        # this bounce buffer next wait for the launch on the device as well.
        with torch.cuda.device(wire.device), torch.cuda.stream(wire.h2d if self.send else wire.d2h):
            for work in self.works:
                work.wait()
        if self.send:
            if self.copied is not None:
                await wait_event(self.copied)  # the host tensor may be reused from here on
        else:
            copied = await wire.copy(self.host, self.buffer[: self.host.numel()], wire.d2h)
            if copied is not None:
                await wait_event(copied)
        wire.free.append(self.buffer)


class _WorksDone:
    """``wait_event`` adapter: NCCL work is complete once its CUDA end event is."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def query(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _launch_boxed(
    box: list[list[dist.P2POp]], device: torch.device, stream: torch.cuda.Stream
) -> list[dist.Work]:
    # Boxed like _wait_boxed: a parked thread must not pin the bounce buffers.
    ops = box.pop()
    # NCCL's stream waits for the current one at launch: ``stream`` (h2d) holds the copies
    # into these bounce buffers and the waits that guard their reuse.
    with torch.cuda.device(device), torch.cuda.stream(stream):
        return dist.batch_isend_irecv(ops)


def _copy_boxed(
    box: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device, stream: torch.cuda.Stream
) -> None:
    dst, src = box.pop()
    with torch.cuda.device(device), torch.cuda.stream(stream):
        dst.copy_(src)  # blocking: returns once the copy is complete


def _check_chunk_bytes(chunk_bytes: int, error: type[Exception], name: str) -> None:
    if type(chunk_bytes) is not int or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise error(f"{name} must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")


# -- the directions ---------------------------------------------------------------------


async def _send(link: _Link, prefix: bytes, plan: ChunkPlan) -> None:
    body_nbytes = sum(c.nbytes for c in plan.chunks)
    words = [MAGIC, VERSION, len(prefix), body_nbytes, plan.chunk_bytes]
    preamble = torch.tensor(words + [0] * (PREAMBLE_WORDS - len(words)), dtype=torch.int64)
    await link.expect(1 + int(bool(prefix)) + len(plan.chunks), send=True)
    # (message, pack buffer it holds or None), in posting order.
    inflight: deque[tuple[_Message, torch.Tensor | None]] = deque()
    inflight.append((await link.post(preamble, PREAMBLE_TAG, send=True), None))
    if prefix:
        blob = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        inflight.append((await link.post(blob, PREFIX_TAG, send=True), None))
        link.bytes_sent += len(prefix)
    free: list[torch.Tensor] = []
    allocated = 0

    async def retire_oldest() -> None:
        message, buffer = inflight.popleft()
        await link.complete(message, send=True)
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
                buffer = link.wire.host_buffer(min(plan.chunk_bytes, body_nbytes))
                allocated += 1
            tensor = buffer[: chunk.nbytes]
            await anyio.to_thread.run_sync(_pack_boxed, [(chunk.parts, tensor)], limiter=link.limiter)
            link.chunks_packed += 1
        while len(inflight) >= link.wire.window:
            await retire_oldest()
        inflight.append((await link.post(tensor, BODY_TAG, send=True), buffer))
        link.chunks_sent += 1
        link.bytes_sent += chunk.nbytes
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
    await link.complete(await link.post(preamble, PREAMBLE_TAG, send=False), send=False)
    prefix_len, body_nbytes, chunk_bytes = _check_preamble(preamble.tolist(), link.recv_from, limits)
    link.bytes_expected = prefix_len + body_nbytes
    # The chunk views are made as they are posted: a lazy grid stays small however many
    # chunks the peer announces.
    offsets = range(0, body_nbytes, chunk_bytes)
    await link.expect(1 + int(prefix_len > 0) + len(offsets), send=False)

    prefix = torch.empty(prefix_len, dtype=torch.uint8)
    if prefix_len:
        await link.complete(await link.post(prefix, PREFIX_TAG, send=False), send=False)
        link.bytes_received += prefix_len
    link.prefix = prefix.numpy().tobytes()
    if limits.on_prefix is not None:
        await limits.on_prefix(link.prefix)
    body = _allocate_body(limits.allocate, body_nbytes)
    window = link.wire.window
    inflight: deque[_Message] = deque()
    for offset in offsets[:window]:
        inflight.append(await link.post(body[offset : offset + chunk_bytes], BODY_TAG, send=False))
    for i, offset in enumerate(offsets):
        await link.complete(inflight.popleft(), send=False)
        if i + window < len(offsets):
            ahead = offsets[i + window]
            inflight.append(await link.post(body[ahead : ahead + chunk_bytes], BODY_TAG, send=False))
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
    await link.expect(1, send=True)
    await link.complete(await link.post(tensor, ACK_TAG, send=True), send=True)


async def _recv_ack(link: _Link) -> None:
    tensor = torch.zeros(ACK_BYTES, dtype=torch.uint8)
    await link.expect(1, send=False)
    await link.complete(await link.post(tensor, ACK_TAG, send=False), send=False)
    blob = tensor.numpy().tobytes()
    magic, ok, length = _ACK_HEAD.unpack_from(blob)
    if magic != _ACK_MAGIC or ok not in (0, 1) or length > ACK_MESSAGE_BYTES:
        raise IntegrityError(f"rank {link.recv_from} sent a malformed acknowledgement")
    if not ok:
        text = blob[_ACK_HEAD.size : _ACK_HEAD.size + length].decode("utf-8", errors="replace")
        link.peer_failure = f"rank {link.recv_from} reports failure: {text or 'no reason given'}"
