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

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .._util.errors import ConfigurationError
from .._util.threads import run_sync
from .protocol import BREAK_TAG
from .wire import Message, Route

_WINDOW = 4
"""Gloo: chunks posted ahead of the one being waited for, per direction."""
_THREAD_GRACE = 0.5
"""A waiting thread's own gloo timeout runs this long past the deadline: a backstop in case
the loop cannot break the group; normally the loop reports the timeout first."""


class GlooWire:
    """CPU tensors straight through gloo; each wait in a worker thread (see the module docs)."""

    window = _WINDOW

    def __init__(self, route: Route) -> None:
        if route.rank in (route.send_to, route.recv_from):
            raise ConfigurationError("gloo cannot send to its own rank: a loopback needs an NCCL group")
        self.route = route

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    async def expect(self, total: int, *, send: bool) -> None:
        pass  # tags keep gloo's messages apart: no launch order to keep

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> Message:
        if send:
            work = dist.isend(tensor, group=self.route.pg, group_dst=self.route.send_to, tag=tag)
        else:
            work = dist.irecv(tensor, group=self.route.pg, group_src=self.route.recv_from, tag=tag)
        if work is None:
            raise ConfigurationError("this rank is not a member of the process group")
        return _GlooMessage(work, tensor, self)

    def break_group(self) -> None:
        # A timed-out gloo wait makes gloo close every pair of the group's context: all
        # pending work fails at once (so gloo lets go of our tensors) and the peers see a
        # closed connection right away instead of at their own deadline.
        route = self.route
        peer = route.recv_from if route.recv_from is not None else route.send_to
        probe = torch.empty(1, dtype=torch.uint8)
        try:
            work = dist.irecv(probe, group=route.pg, group_src=peer, tag=BREAK_TAG)
            if work is not None:
                work.wait(timedelta(milliseconds=1))
        except (RuntimeError, ValueError):
            pass  # the expected timeout, or a group already broken or destroyed


class _GlooMessage:
    def __init__(self, work: dist.Work, tensor: torch.Tensor, wire: GlooWire) -> None:
        self.work = work
        self.tensor = tensor
        self.wire = wire

    async def complete(self) -> None:
        # Gloo completes point-to-point work only inside wait(): wait in a worker thread.
        if not self.work.is_completed():
            done = await run_sync(
                _wait,
                self.work,
                self.wire.route.deadline + _THREAD_GRACE,
                limiter=self.wire.route.limiter,
                abandon_on_cancel=True,
            )
            if not done:
                raise RuntimeError("the backend aborted the operation")


def _wait(work: dist.Work, deadline: float) -> bool:
    # A zero timedelta means "no timeout" to c10d: never pass less than 1 ms.
    remaining = max(deadline - time.monotonic(), 1e-3)
    return bool(work.wait(timedelta(seconds=remaining)))
