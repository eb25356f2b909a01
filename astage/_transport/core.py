"""The transport's protocol core, without I/O: one call's state, and its directions as
generators of the actions a driver performs.

Two drivers run the same core (in the manner of h11 or httpcore: the protocol decides, a
driver moves bytes): :class:`~.link.Link` awaits each action on the event loop (gloo or
NCCL), :class:`~.blocking.BlockingLink` performs it on the calling thread (gloo).  The
core decides what to post next and in which order (:func:`sending`, :func:`receiving`,
:func:`sending_ack`, :func:`receiving_ack`), keeps the window of messages in flight and
the pack buffers, counts progress, holds the deadline, says how a backend's failure reads,
which error the call ends with, and whether the group must be broken (:class:`Call`).

A direction yields one action at a time and is sent back the driver's reply:

* :class:`Post`: post a send of a tensor, or a receive into it; the reply is the posted
  message, an opaque handle that a later :class:`Complete` names.
* :class:`Complete`: return once the message has gone, or has landed in its tensor.
* :class:`Expect`: the direction posts this many messages in all (NCCL pairs launches by it).
* :class:`Pack`: pack a chunk's parts into a buffer (one memmove a part).
* :class:`Hand`: hand what landed to the caller's hook (awaited, or called).
"""

from __future__ import annotations

import ctypes
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._util.errors import ConfigurationError, PeerReportedError, PeerTimeoutError, TransportError
from .protocol import (
    ACK_BYTES,
    ACK_TAG,
    BODY_TAG,
    PREAMBLE_TAG,
    PREAMBLE_WORDS,
    PREFIX_TAG,
    Allocate,
    Chunk,
    ChunkPlan,
    ExchangeStats,
    Gather,
    Limits,
    Received,
    check_preamble,
    decode_ack,
    encode_ack,
    preamble_words,
)

_PACK_BUFFERS = 2
_MIN_WAIT = 1e-3
"""The shortest wait given to the backend: a zero timedelta means "no timeout" to c10d."""


# -- actions --------------------------------------------------------------------------------
# Plain slotted records, made once a message: a frozen dataclass costs three times as much
# to make, a named tuple half again.


@dataclass(slots=True)
class Post:
    """Post a non-blocking send of ``tensor`` (``send``) or a receive into it, on ``tag``."""

    tensor: torch.Tensor
    tag: int
    send: bool


@dataclass(slots=True)
class Complete:
    """Wait until ``message`` (a :class:`Post`'s reply) has gone, or has landed."""

    message: Any  # the driver's own kind of message: opaque here
    send: bool


@dataclass(slots=True)
class Expect:
    """The direction posts ``total`` messages in all in this call."""

    total: int
    send: bool


@dataclass(slots=True)
class Pack:
    """Pack ``parts`` into ``out`` (:func:`pack`)."""

    parts: tuple[torch.Tensor | int | Gather, ...]
    out: torch.Tensor


@dataclass(slots=True)
class Hand:
    """Hand ``args`` to the caller's ``hook``: awaited by the async driver, called by the
    blocking one."""

    hook: Callable[..., Any]
    args: tuple[Any, ...]


Action = Post | Complete | Expect | Pack | Hand
Direction = Generator[Action, object, None]
"""One direction of a call: yields actions, is sent each one's reply (a message for a
:class:`Post`, ``None`` otherwise)."""


def advance(direction: Direction, reply: object) -> Action | None:
    """The direction's next action, given the reply to its last one; ``None`` once it is done
    (a ``StopIteration`` from a driver's own work is not taken for the direction's end)."""
    try:
        return direction.send(reply)
    except StopIteration:
        return None


def wait_seconds(deadline: float) -> float:
    """What is left until ``deadline`` (``time.monotonic()``), as a backend wait's timeout."""
    return max(deadline - time.monotonic(), _MIN_WAIT)


class Translating:
    """A context in which a backend's ``RuntimeError`` is raised as the call's error: a
    :class:`PeerTimeoutError` when the backend says it timed out, else a
    :class:`TransportError`; ``what`` says which rank was doing what with which peer."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, RuntimeError):
            text = str(exc).strip()
            # Gloo prefixes its messages with a source location: keep the words, not the path.
            text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else type(exc).__name__
            error = PeerTimeoutError if "timed out" in text.lower() else TransportError
            raise error(f"{self.what}: {text}") from exc


# -- one call's state ------------------------------------------------------------------------


class Call:
    """One call's view of the group: peers, deadline, progress, pending messages, the
    outcome, and whether the group has been touched, interrupted or broken.

    Thread-safe where the blocking driver needs it: its directions run on two threads, and
    :meth:`claim_break` may come from a third.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        rank: int,
        peers: tuple[int | None, int | None],
        deadline: float,
        on_posted: Callable[[], None] | None = None,
        *,
        started: float | None = None,
        timeout: float | None = None,
    ) -> None:
        self.pg = pg
        self.rank = rank
        self.send_to, self.recv_from = peers
        self.started = time.monotonic() if started is None else started
        self.deadline = deadline  # time.monotonic()
        self.timeout = deadline - self.started if timeout is None else timeout
        self.on_posted = on_posted
        # Posted messages not yet seen complete; each holds the tensors it reads or writes,
        # until it completes or the group is broken.
        self.pending: set[object] = set()
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
        self.failures: list[BaseException] = []
        # Whether this call has touched the group: before that, a failure leaves nothing
        # pending and no peer out of step, so there is nothing to break.
        self.posted = False
        self.interrupted = False
        self.broken = False
        self._lock = threading.Lock()
        self._translating = (
            Translating(f"rank {rank}: receiving from rank {self.recv_from}"),
            Translating(f"rank {rank}: sending to rank {self.send_to}"),
        )

    @classmethod
    def within(
        cls,
        pg: dist.ProcessGroup | None,
        timeout: float,
        peers: tuple[int | None, int | None],
        on_posted: Callable[[], None] | None,
    ) -> Call:
        """A call that must end ``timeout`` seconds from now, its arguments checked first.

        :raises ConfigurationError: a bad timeout or peer; no group; not a member.
        """
        if not (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0
        ):
            raise ConfigurationError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError("torch.distributed is not initialised")
        rank = dist.get_rank(pg)
        if rank < 0:
            raise ConfigurationError("this rank is not a member of the process group")
        world = dist.get_world_size(pg)
        for name, peer in zip(("send_to", "recv_from"), peers, strict=True):
            # A group of one has no other rank: there the only peer is a loopback.
            if peer is not None and not (
                type(peer) is int and 0 <= peer < world and (peer != rank or world == 1)
            ):
                raise ConfigurationError(f"{name}={peer!r} is not another rank of this group of {world}")
        started = time.monotonic()
        return cls(pg, rank, peers, started + timeout, on_posted, started=started, timeout=float(timeout))

    def left(self) -> float:
        """Seconds until the deadline (negative past it)."""
        return self.deadline - time.monotonic()

    def peer(self, *, send: bool) -> int | None:
        """The peer a direction talks to."""
        return self.send_to if send else self.recv_from

    @property
    def any_peer(self) -> int | None:
        """A peer of this call, the one it receives from if any (to break the group by)."""
        return self.recv_from if self.recv_from is not None else self.send_to

    # -- touching the group

    def posting(self) -> None:
        """Before a post or a launch: marks the group touched (the first time, calls
        ``on_posted``); refuses once the call is interrupted."""
        if self.posted and not self.interrupted:
            return  # the common case, without the lock (as if an interrupt came just after)
        with self._lock:
            if self.interrupted:
                raise TransportError(
                    f"rank {self.rank}: the exchange was interrupted (its save was abandoned)"
                )
            first, self.posted = not self.posted, True
        if first and self.on_posted is not None:
            self.on_posted()

    def translating(self, *, send: bool) -> Translating:
        """Around a backend's operation in a direction: its ``RuntimeError`` becomes the call's
        :class:`PeerTimeoutError` or :class:`TransportError`, naming the rank and the peer."""
        return self._translating[send]

    def hold(self, message: object) -> object:
        """Keep a posted ``message`` (and its tensors) until it completes or the group breaks."""
        self.pending.add(message)
        return message

    def release(self, message: object) -> None:
        """``message`` has completed: its tensors may be reused."""
        self.pending.discard(message)

    # -- the outcome

    def failed(self, exc: BaseException) -> None:
        """A direction failed with ``exc`` (the first failure is the call's error)."""
        self.failures.append(exc)

    def raise_failure(self) -> None:
        """Raise the first direction's failure, if any."""
        if self.failures:
            raise self.failures[0]

    def timed_out(self) -> PeerTimeoutError:
        """The error of a call that reached its deadline, with how far it got."""
        return PeerTimeoutError(f"{self._progress()}: not complete within {self.timeout:g} s")

    def claim_break(self) -> bool:
        """The call ends early (failed, cancelled or interrupted): whether the caller must
        break the group now.  True once, and only if the call has touched the group; no
        post is accepted afterwards."""
        with self._lock:
            self.interrupted = True
            if not self.posted or self.broken:
                return False
            self.broken = True
            return True

    def broke(self) -> None:
        """The group is broken: nothing touches this call's tensors any more."""
        self.pending.clear()

    def stats(self) -> ExchangeStats:
        return ExchangeStats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            seconds=time.monotonic() - self.started,
            chunks_sent=self.chunks_sent,
            chunks_packed=self.chunks_packed,
            chunks_received=self.chunks_received,
        )

    def received(self) -> Received:
        assert self.body is not None
        return Received(self.prefix, self.body, self.stats())

    def raise_peer_failure(self) -> None:
        """Raise the failure the peer reported in its acknowledgement, if it did."""
        if self.peer_failure is not None:
            raise PeerReportedError(self.peer_failure)

    def _progress(self) -> str:
        parts = []
        if self.send_to is not None:
            parts.append(f"sending to rank {self.send_to} ({self.bytes_sent} B so far)")
        if self.recv_from is not None:
            of = "" if self.bytes_expected is None else f" of {self.bytes_expected}"
            parts.append(f"receiving from rank {self.recv_from} ({self.bytes_received}{of} B so far)")
        return f"rank {self.rank}: " + " and ".join(parts)


# -- the directions --------------------------------------------------------------------------


def sending(
    call: Call, prefix: bytes, plan: ChunkPlan, window: int, host_buffer: Callable[[int], torch.Tensor]
) -> Direction:
    """Send the preamble, the prefix, then the body chunks, ``window`` of them in flight.

    A chunk that one segment covers goes as a view of it (no copy); any other is packed
    into one of two reusable buffers (from ``host_buffer``) while earlier ones are on the
    wire, and that buffer is taken again once its send has completed.
    """
    body_nbytes = sum(c.nbytes for c in plan.chunks)
    preamble = torch.tensor(preamble_words(len(prefix), body_nbytes, plan.chunk_bytes), dtype=torch.int64)
    yield Expect(1 + int(bool(prefix)) + len(plan.chunks), send=True)
    # (message, pack buffer it holds or None), in posting order.
    inflight: deque[tuple[object, torch.Tensor | None]] = deque()
    inflight.append(((yield Post(preamble, PREAMBLE_TAG, send=True)), None))
    if prefix:
        blob = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        inflight.append(((yield Post(blob, PREFIX_TAG, send=True)), None))
        call.bytes_sent += len(prefix)
    buffers = PackBuffers(host_buffer, min(plan.chunk_bytes, body_nbytes))
    for chunk in plan.chunks:
        buffer = None
        tensor = direct_tensor(chunk)
        if tensor is None:
            while not buffers.ready:
                yield from _retire_oldest(inflight, buffers)
            buffer, tensor = buffers.take(chunk.nbytes)
            yield Pack(chunk.parts, tensor)
            call.chunks_packed += 1
        while len(inflight) >= window:
            message, held = inflight.popleft()
            yield Complete(message, send=True)
            buffers.give_back(held)
        inflight.append(((yield Post(tensor, BODY_TAG, send=True)), buffer))
        call.chunks_sent += 1
        call.bytes_sent += chunk.nbytes
    while inflight:
        yield from _retire_oldest(inflight, buffers)


def _retire_oldest(inflight: deque[tuple[object, torch.Tensor | None]], buffers: PackBuffers) -> Direction:
    message, buffer = inflight.popleft()
    yield Complete(message, send=True)
    buffers.give_back(buffer)


def receiving(call: Call, limits: Limits, window: int) -> Direction:
    """Receive the preamble and check it before anything is allocated, the prefix (handed to
    ``on_prefix``, which may refuse it, before the body is allocated), then the body, with a
    window of chunk receives posted into it, each chunk handed to ``on_chunk`` as it lands."""
    preamble = torch.zeros(PREAMBLE_WORDS, dtype=torch.int64)
    yield Complete((yield Post(preamble, PREAMBLE_TAG, send=False)), send=False)
    prefix_len, body_nbytes, chunk_bytes = check_preamble(preamble.tolist(), call.recv_from, limits)
    call.bytes_expected = prefix_len + body_nbytes
    # The chunk views are made as they are posted: a lazy grid stays small however many
    # chunks the peer announces.
    offsets = range(0, body_nbytes, chunk_bytes)
    yield Expect(1 + int(prefix_len > 0) + len(offsets), send=False)
    prefix = torch.empty(prefix_len, dtype=torch.uint8)
    if prefix_len:
        yield Complete((yield Post(prefix, PREFIX_TAG, send=False)), send=False)
        call.bytes_received += prefix_len
    call.prefix = prefix.numpy().tobytes()
    if limits.on_prefix is not None:
        yield Hand(limits.on_prefix, (call.prefix,))
    body = allocate_body(limits.allocate, body_nbytes)
    inflight: deque[object] = deque()
    for offset in offsets[:window]:
        inflight.append((yield Post(body[offset : offset + chunk_bytes], BODY_TAG, send=False)))
    for i, offset in enumerate(offsets):
        yield Complete(inflight.popleft(), send=False)
        if i + window < len(offsets):
            ahead = offsets[i + window]
            inflight.append((yield Post(body[ahead : ahead + chunk_bytes], BODY_TAG, send=False)))
        chunk = body[offset : offset + chunk_bytes]
        call.bytes_received += chunk.numel()
        call.chunks_received += 1
        if limits.on_chunk is not None:
            yield Hand(limits.on_chunk, (offset, chunk))
    call.body = body


def sending_ack(ok: bool, message: str) -> Direction:
    """Send an acknowledgement: ``ok`` and a short ``message``."""
    tensor = torch.frombuffer(encode_ack(ok, message), dtype=torch.uint8)
    yield Expect(1, send=True)
    yield Complete((yield Post(tensor, ACK_TAG, send=True)), send=True)


def receiving_ack(call: Call) -> Direction:
    """Receive an acknowledgement; a failure it reports becomes ``call.peer_failure``."""
    tensor = torch.zeros(ACK_BYTES, dtype=torch.uint8)
    yield Expect(1, send=False)
    yield Complete((yield Post(tensor, ACK_TAG, send=False)), send=False)
    call.peer_failure = decode_ack(tensor.numpy().tobytes(), call.recv_from)


# -- what a direction sends and receives into -----------------------------------------------


def direct_tensor(chunk: Chunk) -> torch.Tensor | None:
    """What a body chunk of one part is sent as (the part itself, or zeros for a gap), or
    ``None``: the chunk is packed into a buffer (:class:`PackBuffers`, :func:`pack`)."""
    only = chunk.parts[0] if len(chunk.parts) == 1 else None
    if isinstance(only, torch.Tensor):
        return only
    if isinstance(only, int):
        return torch.zeros(only, dtype=torch.uint8)
    return None


class PackBuffers:
    """At most ``_PACK_BUFFERS`` buffers a sender packs chunks into, each taken again once
    the send that used it has completed (:meth:`give_back`)."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], nbytes: int) -> None:
        self._allocate = allocate
        self._nbytes = nbytes
        self._free: list[torch.Tensor] = []
        self._allocated = 0

    @property
    def ready(self) -> bool:
        """Whether :meth:`take` can serve now (else a send in flight must complete first)."""
        return bool(self._free) or self._allocated < _PACK_BUFFERS

    def take(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A buffer and its first ``nbytes``, the tensor to pack a chunk into."""
        if self._free:
            buffer = self._free.pop()
        else:
            buffer = self._allocate(self._nbytes)
            self._allocated += 1
        return buffer, buffer[:nbytes]

    def give_back(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self._free.append(buffer)


def pack(parts: tuple[torch.Tensor | int | Gather, ...], out: torch.Tensor) -> None:
    """Pack a chunk's ``parts`` into ``out``: blocking (a worker thread's, off the loop)."""
    # One memmove per part (validated contiguous CPU uint8, kept alive by the plan), over a
    # buffer zeroed first when the chunk has gaps: ~2.5 us a part where torch.cat of views
    # costs ~8, which matters with 20,000 tiny tensors.
    only = parts[0]
    if isinstance(only, Gather):
        _gather(only, out)
        return
    if any(isinstance(p, int) for p in parts):
        out.zero_()
    at = out.data_ptr()
    for part in parts:
        if isinstance(part, int):
            at += part
        else:
            assert isinstance(part, torch.Tensor)
            n = part.numel()
            ctypes.memmove(at, part.data_ptr(), n)
            at += n


def _gather(gather: Gather, out: torch.Tensor) -> None:
    # From raw addresses (checked by the plan, held by gather.source), at ~0.5 us a part:
    # the parts' addresses and sizes are read again first, in bulk.  A staged storage must
    # not change while it is sent; one that was resized has moved, and its old memory may
    # be unmapped.
    if gather.gaps:
        out.zero_()
    addresses, sizes = gather.source.extents_now(gather.segments)
    changed = np.flatnonzero((addresses != gather.bases) | (sizes != gather.extents))
    if len(changed):
        raise ConfigurationError(
            f"segment {gather.segments[int(changed[0])]} changed between planning and sending (a "
            "staged storage resized or replaced while it was being sent)"
        )
    destinations = (gather.starts + out.data_ptr()).tolist()
    deque(map(ctypes.memmove, destinations, gather.addresses, gather.sizes), maxlen=0)


def allocate_body(allocate: Allocate | None, nbytes: int) -> torch.Tensor:
    """The tensor the body is received into: ``allocate``'s (checked), or a new one."""
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
