"""One call's view of the group: peers, deadline, wire, pending messages, progress, and breakage.

Every call (:mod:`._exchange`) runs its directions through :meth:`Link.run`, which holds the
invariants that do not depend on the backend:

* The whole call honours ``timeout``: it raises :class:`PeerTimeoutError` at the deadline,
  or :class:`TransportError` as soon as the backend reports a failure; it never waits for
  the process group's own timeout.
* Pending point-to-point work cannot be cancelled.  So when a call fails or is cancelled
  after posting anything, the link **breaks the group on purpose** before it returns (the
  wire says how); a call that fails before its first post leaves the group as it was.
* A buffer is reused or released only once every operation touching it has been seen
  complete, or the group has been broken.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Awaitable, Callable

import anyio
import torch
import torch.distributed as dist

from .._util.errors import ConfigurationError, PeerReportedError, PeerTimeoutError, TransportError
from .gloo import GlooWire
from .nccl import NcclWire
from .protocol import ExchangeStats, Received, wire_kind
from .wire import Message, Route, Wire

log = logging.getLogger("astage.transport")


class Link:
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
        route = Route(pg, self.rank, send_to, recv_from, self.deadline, self.limiter)
        self.wire: Wire = (GlooWire if wire_kind(dist.get_backend_config(pg)) == "gloo" else NcclWire)(route)
        # Posted messages not yet seen complete; each holds the tensors it reads or writes.
        self.pending: set[Message] = set()
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

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> Message:
        """Post a non-blocking send of ``tensor`` to ``send_to`` or receive into it from ``recv_from``."""
        self._posting()
        try:
            message = await self.wire.post(tensor, tag, send=send)
        except RuntimeError as exc:
            raise self._translate(exc, send=send) from exc
        self.pending.add(message)
        return message

    async def complete(self, message: Message, *, send: bool) -> None:
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
