"""What a backend's wire provides to a call: post a message, wait for it, break the group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import anyio
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Route:
    """Where one call's messages go, by when, and under which thread limiter.

    :ivar pg: the process group (``None``: the default group).
    :ivar rank: this rank, in ``pg``'s rank space.
    :ivar send_to: the peer this call sends to, if it sends.
    :ivar recv_from: the peer this call receives from, if it receives.
    :ivar deadline: ``time.monotonic()`` by which the call must end.
    :ivar limiter: the call's worker threads (one a direction).
    """

    pg: dist.ProcessGroup | None
    rank: int
    send_to: int | None
    recv_from: int | None
    deadline: float
    limiter: anyio.CapacityLimiter


class Message(Protocol):
    """One posted message, holding what it reads or writes until it completes."""

    async def complete(self) -> None:
        """Return once the message has gone, or has landed in its tensor.

        :raises RuntimeError: the backend reported a failure.
        """
        ...


class Wire(Protocol):
    """Moves the messages of one call over one backend."""

    window: int
    """Chunks a direction keeps in flight."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A CPU ``uint8`` buffer to pack chunks into."""
        ...

    async def expect(self, total: int, *, send: bool) -> None:
        """The direction posts ``total`` messages in all in this call."""
        ...

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> Message:
        """Post a send of the CPU ``tensor``, or a receive into it."""
        ...

    def break_group(self) -> None:
        """Break the group so that nothing touches this call's tensors any more (blocking)."""
        ...
