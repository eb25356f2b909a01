"""The gloo wire: CPU tensors straight through gloo, each wait in a worker thread.

Serves any group with ``cpu:gloo`` (``cpu:gloo,cuda:nccl`` included: the payload is on the
CPU already), so every test without a GPU exercises it.  Gloo reports a point-to-point
``Work`` complete only from inside ``wait()`` (its ``is_completed()`` stays false and
``get_future()`` is missing; checked on torch 2.13), so each direction waits in its own
worker thread (two per call, under the link's limiter).  Gloo sends are rendezvous: a send
completes only once the peer has posted the matching receive.  A group is broken on
purpose with a 1 ms timed-out receive, which makes gloo close every connection of the
group on this rank: pending work fails at once and the peers see it at once.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .._util.errors import ConfigurationError
from .._util.threads import run_sync
from .core import wait_seconds
from .protocol import BREAK_TAG
from .wire import Message, Route

WINDOW = 4
"""Gloo: chunks posted ahead of the one being waited for, per direction."""
_THREAD_GRACE = 0.5
"""A waiting thread's own gloo timeout runs this long past the deadline: a backstop in case
the loop cannot break the group; normally the loop reports the timeout first."""


def host_buffer(nbytes: int) -> torch.Tensor:
    """A buffer to pack chunks into: gloo sends from any CPU memory."""
    return torch.empty(nbytes, dtype=torch.uint8)


class Posted:
    """A posted gloo message: its work, and the tensor it reads or writes (held with it)."""

    __slots__ = ("tensor", "work")

    def __init__(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self.work = work
        self.tensor = tensor


def post(
    pg: dist.ProcessGroup | None, peer: int | None, tensor: torch.Tensor, tag: int, *, send: bool
) -> Posted:
    """Post a send of ``tensor`` to ``peer``, or a receive into it from ``peer``.

    :raises RuntimeError: gloo refused it.
    """
    if send:
        work = dist.isend(tensor, group=pg, group_dst=peer, tag=tag)
    else:
        work = dist.irecv(tensor, group=pg, group_src=peer, tag=tag)
    if work is None:
        raise ConfigurationError("this rank is not a member of the process group")
    return Posted(work, tensor)


def wait(work: dist.Work, deadline: float) -> None:
    """Block until ``work`` is complete, until ``deadline`` at the latest.

    :raises RuntimeError: gloo's timeout, or any failure it reports.
    """
    if not work.wait(timedelta(seconds=wait_seconds(deadline))):
        raise RuntimeError("the backend aborted the operation")


def break_group(pg: dist.ProcessGroup | None, peer: int | None) -> None:
    """Break the group on this rank (blocking, ~1 ms), whatever state it is in."""
    # A timed-out gloo wait makes gloo close every pair of the group's context: all
    # pending work fails at once (so gloo lets go of our tensors) and the peers see a
    # closed connection right away instead of at their own deadline.
    probe = torch.empty(1, dtype=torch.uint8)
    try:
        work = dist.irecv(probe, group=pg, group_src=peer, tag=BREAK_TAG)
        if work is not None:
            work.wait(timedelta(milliseconds=1))
    except (RuntimeError, ValueError):
        pass  # the expected timeout, or a group already broken or destroyed


class GlooWire:
    """CPU tensors straight through gloo; each wait in a worker thread (see the module docs)."""

    window = WINDOW

    def __init__(self, route: Route) -> None:
        if route.rank in (route.send_to, route.recv_from):
            raise ConfigurationError("gloo cannot send to its own rank: a loopback needs an NCCL group")
        self.route = route

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return host_buffer(nbytes)

    async def expect(self, total: int, *, send: bool) -> None:
        pass  # tags keep gloo's messages apart: no launch order to keep

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> Message:
        route = self.route
        return _GlooMessage(
            post(route.pg, route.send_to if send else route.recv_from, tensor, tag, send=send), route
        )

    def break_group(self) -> None:
        route = self.route
        break_group(route.pg, route.recv_from if route.recv_from is not None else route.send_to)


class _GlooMessage:
    def __init__(self, posted: Posted, route: Route) -> None:
        self.posted = posted
        self.route = route

    async def complete(self) -> None:
        # Gloo completes point-to-point work only inside wait(): wait in a worker thread
        # (given the work only: an abandoned wait holds no tensor).
        work = self.posted.work
        if not work.is_completed():
            await run_sync(
                wait,
                work,
                self.route.deadline + _THREAD_GRACE,
                limiter=self.route.limiter,
                abandon_on_cancel=True,
            )
