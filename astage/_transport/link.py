"""The awaiting driver: one call's actions performed on the event loop, over gloo or NCCL.

Every async call (:mod:`.exchange`) runs its directions (:mod:`.core`) through
:meth:`Link.run`, which holds the invariants that do not depend on the backend:

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
from collections.abc import Callable

import anyio
import torch.distributed as dist

from .._util.threads import run_sync
from .core import Action, Call, Complete, Direction, Expect, Hand, Pack, Post, advance, pack
from .gloo import GlooWire
from .nccl import NcclWire
from .protocol import wire_kind
from .wire import Route, Wire

log = logging.getLogger("astage.transport")


class Link:
    """One call's wire, worker threads and state (:class:`~.core.Call`), driven from the loop.

    :param peers: ``(send_to, recv_from)``, either ``None`` when the call does not go that way.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        timeout: float,
        peers: tuple[int | None, int | None],
        on_posted: Callable[[], None] | None = None,
    ) -> None:
        self.call = call = Call.within(pg, timeout, peers, on_posted)
        # One worker thread per direction at a time (a wait, a packing or pageable copy, or
        # an NCCL launch): a direction awaits each before its next step.
        self.limiter = anyio.CapacityLimiter(2)
        route = Route(pg, call.rank, call.send_to, call.recv_from, call.deadline, self.limiter)
        self.wire: Wire = (GlooWire if wire_kind(dist.get_backend_config(pg)) == "gloo" else NcclWire)(route)

    async def run(self, *directions: Direction) -> None:
        """Run the directions concurrently under the deadline; break the group on failure.

        :raises: the first direction's error, :class:`PeerTimeoutError` at the deadline, or
            the caller's cancellation.
        """
        call = self.call
        try:
            with anyio.CancelScope(deadline=anyio.current_time() + call.left()) as timer:
                async with anyio.create_task_group() as tg:
                    for direction in directions:
                        tg.start_soon(self._guarded, direction, tg.cancel_scope)
            call.raise_failure()
            if timer.cancelled_caught:
                raise call.timed_out()
        except BaseException as exc:
            if not call.claim_break():
                raise  # nothing of this call is on the wire: the group is as it was
            # Whatever went wrong, the two sides no longer agree on what comes next.
            log.warning("rank %d: breaking the process group after a failed transfer: %r", call.rank, exc)
            with anyio.CancelScope(shield=True):
                # Not under the link's limiter: under trio its tokens stay with the abandoned
                # waiting threads until they end, which is what breaking the group makes happen.
                await anyio.to_thread.run_sync(self._break)
            raise
        stats = call.stats()
        log.debug(
            "rank %d: sent %d B to %s, received %d B from %s in %.3f s (%.2f GB/s)",
            call.rank,
            stats.bytes_sent,
            call.send_to,
            stats.bytes_received,
            call.recv_from,
            stats.seconds,
            stats.gbps,
        )

    async def _guarded(self, direction: Direction, scope: anyio.CancelScope) -> None:
        try:
            reply: object = None
            while (action := advance(direction, reply)) is not None:
                reply = await self._perform(action)
        except Exception as exc:
            self.call.failed(exc)
            scope.cancel()

    async def _perform(self, action: Action) -> object:
        """Perform one action; the reply its direction is sent back."""
        call = self.call
        # The common actions first, by type (a ``match`` costs a microsecond more a message).
        if type(action) is Complete:
            with call.translating(send=action.send):
                await action.message.complete()
            call.release(action.message)
        elif type(action) is Post:
            call.posting()
            with call.translating(send=action.send):
                return call.hold(await self.wire.post(action.tensor, action.tag, send=action.send))
        elif type(action) is Hand:
            await action.hook(*action.args)
        elif type(action) is Pack:
            await run_sync(pack, action.parts, action.out, limiter=self.limiter)
        elif type(action) is Expect:
            call.posting()
            with call.translating(send=action.send):  # (NCCL may launch from here)
                await self.wire.expect(action.total, send=action.send)
        return None

    def _break(self) -> None:
        self.wire.break_group()
        self.call.broke()
