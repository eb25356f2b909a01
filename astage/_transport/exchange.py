"""The async calls: exchange, send and receive a payload, and acknowledge it.

Each call checks its arguments, plans the payload (pure, :mod:`.protocol`), then runs one
direction of the protocol core (:mod:`.core`) for each way it goes, awaited by a
:class:`~.link.Link`.  The sender posts the preamble, the prefix, then the body chunks: a
chunk that one segment covers goes as a view of it (no copy); any other is packed (one
memmove a part) in a worker thread into one of two reusable buffers while the previous
chunk is on the wire.  The receiver checks the preamble before it allocates anything, hands
the prefix to ``on_prefix`` (which may refuse it) before it allocates the body, then keeps a
window of chunk receives posted into the body and hands each chunk to ``on_chunk`` as it
lands.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from .._util.timeslice import run_steps
from .core import Direction, receiving, receiving_ack, sending, sending_ack
from .core import pack as _pack  # noqa: F401 (the tests pack a chunk by this name)
from .link import Link
from .protocol import (
    CHUNK_BYTES,
    MAX_PREFIX_BYTES,
    Allocate,
    ExchangeStats,
    Limits,
    OnChunk,
    OnPrefix,
    Payload,
    Received,
    plan_chunks,
)


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
    link = Link(pg, timeout, (send_to, recv_from), on_posted)
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
    link = Link(pg, timeout, (to, None))
    await _run(link, (payload, chunk_bytes), None)
    return link.call.stats()


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
    link = Link(pg, timeout, (None, from_))
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
    link = Link(pg, timeout, (to, None))
    await link.run(sending_ack(ok, message))


async def recv_ack(pg: dist.ProcessGroup | None, from_: int, *, timeout: float) -> None:  # noqa: ASYNC109
    """Wait for ``from_`` to acknowledge the replica we sent it.

    :raises PeerReportedError: the peer reports failure (its message is in the error); the
        group is still healthy.
    :raises IntegrityError: the acknowledgement is malformed.
    :raises: as :func:`exchange` otherwise.
    """
    link = Link(pg, timeout, (None, from_))
    await link.run(receiving_ack(link.call))
    link.call.raise_peer_failure()


async def exchange_ack(
    pg: dist.ProcessGroup | None,
    ok: bool,
    *,
    message: str = "",
    send_to: int,
    recv_from: int,
    timeout: float,  # noqa: ASYNC109 (see the module docstring)
) -> None:
    """Agree on the outcome of an :func:`exchange` made with the same peers.

    Acknowledgements run backwards along the ring: this rank tells ``recv_from`` whether
    its replica is durable here (``ok``, ``message``) while it hears from ``send_to`` whether
    ours is durable there, both at once (so no ring can deadlock).

    :raises PeerReportedError: ``send_to`` reports failure (its message is in the error);
        the group is still healthy.
    :raises: as :func:`recv_ack` otherwise.
    """
    link = Link(pg, timeout, (recv_from, send_to))
    await link.run(sending_ack(ok, message), receiving_ack(link.call))
    link.call.raise_peer_failure()


async def _run(link: Link, outgoing: tuple[Payload, int] | None, limits: Limits | None) -> None:
    """Run the directions ``link`` takes part in: send ``outgoing`` (payload, chunk size),
    receive under ``limits``; the payload is validated and planned before anything is posted."""
    directions: list[Direction] = []
    if outgoing is not None:
        payload, chunk_bytes = outgoing
        plan = await run_steps(plan_chunks(payload.segments, payload.body_nbytes, chunk_bytes))
        directions.append(sending(link.call, payload.prefix, plan, link.wire.window, link.wire.host_buffer))
    if limits is not None:
        directions.append(receiving(link.call, limits, link.wire.window))
    await link.run(*directions)


async def _received(link: Link, outgoing: tuple[Payload, int] | None, limits: Limits) -> Received:
    await _run(link, outgoing, limits)
    return link.call.received()
