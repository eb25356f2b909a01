"""What a backend's wire provides to a call: post a message, wait for it, break the group."""

from __future__ import annotations

from typing import Protocol

import torch


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
