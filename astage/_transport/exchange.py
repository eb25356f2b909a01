"""The calls: exchange, send and receive a payload, and acknowledge it, over a :class:`Link`.

Each call plans (pure, :mod:`._protocol`), then runs one coroutine per direction under the
link.  The sender posts the preamble, the prefix, then the body chunks: a chunk that one
segment covers goes as a view of it (no copy); any other is packed (one memmove a part) in
a worker thread into one of two reusable buffers while the previous chunk is on the wire.
The receiver checks the preamble before it allocates anything, hands the prefix to
``on_prefix`` (which may refuse it) before it allocates the body, then keeps a window of
chunk receives posted into the body and hands each chunk to ``on_chunk`` as it lands.
"""

from __future__ import annotations

import ctypes
import functools
from collections import deque
from collections.abc import Awaitable, Callable

import numpy as np
import torch
import torch.distributed as dist

from .._util.errors import ConfigurationError
from .._util.threads import run_sync
from .._util.timeslice import run_steps
from .link import Link
from .protocol import (
    ACK_BYTES,
    ACK_TAG,
    BODY_TAG,
    CHUNK_BYTES,
    MAX_PREFIX_BYTES,
    PREAMBLE_TAG,
    PREAMBLE_WORDS,
    PREFIX_TAG,
    Allocate,
    Chunk,
    ChunkPlan,
    ExchangeStats,
    Gather,
    Limits,
    OnChunk,
    OnPrefix,
    Payload,
    Received,
    check_preamble,
    decode_ack,
    encode_ack,
    plan_chunks,
    preamble_words,
)
from .wire import Message

_PACK_BUFFERS = 2


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
    link = Link(pg, timeout, send_to=send_to, recv_from=recv_from, on_posted=on_posted)
    limits = Limits(max_body_bytes, max_prefix_bytes, allocate, on_prefix, on_chunk)
    return await _received(link, (payload, chunk_bytes), limits)


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
    link = Link(pg, timeout, send_to=to)
    await _run(link, (payload, chunk_bytes), None)
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
    link = Link(pg, timeout, recv_from=from_)
    return await _received(
        link, None, Limits(max_body_bytes, max_prefix_bytes, allocate, on_prefix, on_chunk)
    )


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
    link = Link(pg, timeout, send_to=to)
    await link.run(lambda: _send_ack(link, ok, message))


async def recv_ack(pg: dist.ProcessGroup | None, from_: int, *, timeout: float) -> None:  # noqa: ASYNC109
    """Wait for ``from_`` to acknowledge the replica we sent it.

    :raises PeerReportedError: the peer reports failure (its message is in the error); the
        group is still healthy.
    :raises IntegrityError: the acknowledgement is malformed.
    :raises: as :func:`exchange` otherwise.
    """
    link = Link(pg, timeout, recv_from=from_)
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
    link = Link(pg, timeout, send_to=recv_from, recv_from=send_to)
    await link.run(lambda: _send_ack(link, ok, message), lambda: _recv_ack(link))
    link.raise_peer_failure()


async def _run(link: Link, outgoing: tuple[Payload, int] | None, limits: Limits | None) -> None:
    """Run the directions ``link`` takes part in: send ``outgoing`` (payload, chunk size),
    receive under ``limits``; the payload is validated and planned before anything is posted."""
    directions: list[Callable[[], Awaitable[None]]] = []
    if outgoing is not None:
        payload, chunk_bytes = outgoing
        plan = await run_steps(plan_chunks(payload.segments, payload.body_nbytes, chunk_bytes))
        directions.append(functools.partial(_send, link, payload.prefix, plan))
    if limits is not None:
        directions.append(functools.partial(_receive, link, limits))
    await link.run(*directions)


async def _received(link: Link, outgoing: tuple[Payload, int] | None, limits: Limits) -> Received:
    await _run(link, outgoing, limits)
    return link.received()


async def _send(link: Link, prefix: bytes, plan: ChunkPlan) -> None:
    body_nbytes = sum(c.nbytes for c in plan.chunks)
    preamble = torch.tensor(preamble_words(len(prefix), body_nbytes, plan.chunk_bytes), dtype=torch.int64)
    await link.expect(1 + int(bool(prefix)) + len(plan.chunks), send=True)
    # (message, pack buffer it holds or None), in posting order.
    inflight: deque[tuple[Message, torch.Tensor | None]] = deque()
    inflight.append((await link.post(preamble, PREAMBLE_TAG, send=True), None))
    if prefix:
        blob = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        inflight.append((await link.post(blob, PREFIX_TAG, send=True), None))
        link.bytes_sent += len(prefix)
    buffers = PackBuffers(link.wire.host_buffer, min(plan.chunk_bytes, body_nbytes))

    async def retire_oldest() -> None:
        message, buffer = inflight.popleft()
        await link.complete(message, send=True)
        buffers.give_back(buffer)

    for chunk in plan.chunks:
        buffer = None
        tensor = direct_tensor(chunk)
        if tensor is None:
            while not buffers.ready:
                await retire_oldest()
            buffer, tensor = buffers.take(chunk.nbytes)
            await run_sync(_pack, chunk.parts, tensor, limiter=link.limiter)
            link.chunks_packed += 1
        while len(inflight) >= link.wire.window:
            await retire_oldest()
        inflight.append((await link.post(tensor, BODY_TAG, send=True), buffer))
        link.chunks_sent += 1
        link.bytes_sent += chunk.nbytes
    while inflight:
        await retire_oldest()


def direct_tensor(chunk: Chunk) -> torch.Tensor | None:
    """What a body chunk of one part is sent as (the part itself, or zeros for a gap), or
    ``None``: the chunk is packed into a buffer (:class:`PackBuffers`, :func:`_pack`)."""
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


def _pack(parts: tuple[torch.Tensor | int | Gather, ...], out: torch.Tensor) -> None:
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


async def _receive(link: Link, limits: Limits) -> None:
    preamble = torch.zeros(PREAMBLE_WORDS, dtype=torch.int64)
    await link.complete(await link.post(preamble, PREAMBLE_TAG, send=False), send=False)
    prefix_len, body_nbytes, chunk_bytes = check_preamble(preamble.tolist(), link.recv_from, limits)
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
    inflight: deque[Message] = deque()
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


async def _send_ack(link: Link, ok: bool, message: str) -> None:
    tensor = torch.frombuffer(encode_ack(ok, message), dtype=torch.uint8)
    await link.expect(1, send=True)
    await link.complete(await link.post(tensor, ACK_TAG, send=True), send=True)


async def _recv_ack(link: Link) -> None:
    tensor = torch.zeros(ACK_BYTES, dtype=torch.uint8)
    await link.expect(1, send=False)
    await link.complete(await link.post(tensor, ACK_TAG, send=False), send=False)
    link.peer_failure = decode_ack(tensor.numpy().tobytes(), link.recv_from)
