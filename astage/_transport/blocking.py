"""The blocking driver: the gloo calls on the calling thread, with no event loop.

A Checkpointer runs a save's background half in a worker thread of its own, so that it
progresses while the program holds the event loop (a synchronous training step); the
replication exchange is part of that half, and the peer's loop may be held as well.  The
async calls (:mod:`.exchange`) await each action of the protocol core (:mod:`.core`) on the
loop; these perform the same actions, so the same messages go on the wire in the same order,
with blocking gloo waits: the receiving direction on the calling thread, the sending one on
a daemon thread.

Invariants (as the async calls'):

* The whole call honours the deadline: a gloo wait is given the time left, and a
  timed-out wait is :class:`PeerTimeoutError`.
* Pending point-to-point work cannot be cancelled: when a direction fails after anything
  was posted, the group is broken on purpose (a 1 ms timed-out receive), so that the other
  direction's waits fail at once and the peers see it at once.  :meth:`BlockingLink.interrupt`
  does the same from another thread (the save was abandoned).
* Buffers are reused or released only once the call has returned: every wait has ended.

Gloo only: NCCL's completions are polled from the loop (:mod:`.nccl`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from .._util.errors import ConfigurationError
from .._util.timeslice import drive
from . import gloo
from .core import (
    Action,
    Call,
    Complete,
    Direction,
    Hand,
    Pack,
    Post,
    advance,
    pack,
    receiving,
    receiving_ack,
    sending,
    sending_ack,
)
from .protocol import MAX_PREFIX_BYTES, Limits, Payload, plan_chunks, wire_kind

OnPrefixSync = Callable[[bytes], None]
OnChunkSync = Callable[[int, torch.Tensor], None]


def supports(pg: dist.ProcessGroup | None) -> bool:
    """Whether ``pg`` can be driven from a thread with no event loop (its CPU backend is gloo)."""
    try:
        return wire_kind(dist.get_backend_config(pg)) == "gloo"
    except (ConfigurationError, RuntimeError, ValueError):
        return False


class BlockingLink:
    """One blocking call's view of the group (:class:`~.core.Call`), driven on threads."""

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        deadline: float,
        *,
        send_to: int | None = None,
        recv_from: int | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> None:
        self.call = Call(pg, dist.get_rank(pg), (send_to, recv_from), deadline, on_posted)

    def interrupt(self) -> None:
        """Break the group if this call has posted anything (any thread): every pending
        wait fails at once, here and at the peers."""
        call = self.call
        if call.claim_break():
            gloo.break_group(call.pg, call.any_peer)
            call.broke()

    def run(self, *directions: Direction) -> None:
        """Run the directions at once (the first here, the others on daemon threads); break
        the group and raise the first error if one fails."""
        helpers = [
            threading.Thread(target=self._guarded, args=(d,), name="astage transport", daemon=True)
            for d in directions[1:]
        ]
        for helper in helpers:
            helper.start()
        self._guarded(directions[0])
        for helper in helpers:
            helper.join()
        if self.call.failures:
            self.interrupt()
            self.call.raise_failure()

    def _guarded(self, direction: Direction) -> None:
        try:
            reply: object = None
            while (action := advance(direction, reply)) is not None:
                reply = self._perform(action)
        except BaseException as exc:
            self.call.failed(exc)
            self.interrupt()  # the other direction's waits fail at once

    def _perform(self, action: Action) -> object:
        """Perform one action; the reply its direction is sent back."""
        call = self.call
        if type(action) is Complete:
            with call.translating(send=action.send):
                gloo.wait(action.message.work, call.deadline)
            call.release(action.message)
        elif type(action) is Post:
            call.posting()
            with call.translating(send=action.send):
                posted = gloo.post(
                    call.pg, call.peer(send=action.send), action.tensor, action.tag, send=action.send
                )
            return call.hold(posted)
        elif type(action) is Hand:
            action.hook(*action.args)
        elif type(action) is Pack:
            pack(action.parts, action.out)
        return None  # Expect: gloo's tags keep messages apart, there is no launch order


def exchange(
    link: BlockingLink,
    payload: Payload,
    *,
    chunk_bytes: int,
    max_body_bytes: int,
    allocate: Callable[[int], torch.Tensor] | None = None,
    on_prefix: OnPrefixSync | None = None,
    on_chunk: OnChunkSync | None = None,
) -> tuple[bytes, torch.Tensor]:
    """Send ``payload`` to ``link.send_to`` while receiving a replica from ``link.recv_from``.

    :returns: the peer's prefix and body.
    :raises: as :func:`astage._transport.exchange`.
    """
    call = link.call
    plan = drive(plan_chunks(payload.segments, payload.body_nbytes, chunk_bytes))
    limits = Limits(max_body_bytes, MAX_PREFIX_BYTES, allocate, on_prefix, on_chunk)
    link.run(
        receiving(call, limits, gloo.WINDOW),
        sending(call, payload.prefix, plan, gloo.WINDOW, gloo.host_buffer),
    )
    assert call.body is not None
    return call.prefix, call.body


def exchange_ack(link: BlockingLink, ok: bool, message: str = "") -> None:
    """Tell ``link.send_to`` (the rank whose replica we hold) whether it is durable here while
    hearing from ``link.recv_from`` (our holder) whether ours is, both at once.

    :raises PeerReportedError: the holder reports failure; the group is still healthy.
    """
    link.run(receiving_ack(link.call), sending_ack(ok, message))
    link.call.raise_peer_failure()
