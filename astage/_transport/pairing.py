"""The order in which NCCL launches a call's messages: pure bookkeeping, tested without a GPU.

NCCL ignores tags and runs a rank's point-to-point work on one stream in launch order, so
the k-th message of each direction must be launched together with the k-th of the other.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Pairing(Generic[T]):
    """Group the messages of a call's two directions into launches, in order (no I/O).

    The k-th launch holds the k-th message of each direction that has one, so the k-th
    launches of two peers match message for message.  A launch waits for both directions
    while each may still post its k-th message, and goes alone once the other direction
    has posted all it said it would (:meth:`expect`).  A direction the call does not use
    is created closed.
    """

    def __init__(self, *, sends: bool, receives: bool) -> None:
        self._queued: dict[bool, deque[T]] = {True: deque(), False: deque()}
        self._posted = {True: 0, False: 0}
        self._total: dict[bool, int | None] = {True: None if sends else 0, False: None if receives else 0}

    def push(self, item: T, *, send: bool) -> None:
        """Queue the direction's next message."""
        total = self._total[send]
        if total is not None and self._posted[send] >= total:
            raise RuntimeError(f"{'send' if send else 'receive'} direction posted more than it announced")
        self._posted[send] += 1
        self._queued[send].append(item)

    def expect(self, total: int, *, send: bool) -> None:
        """Announce that the direction posts ``total`` messages in all (those so far included)."""
        if total < self._posted[send]:
            raise RuntimeError(f"announced {total} messages after posting {self._posted[send]}")
        self._total[send] = total

    def pop(self) -> tuple[T, ...] | None:
        """The next launch (send first), or ``None`` while it cannot be formed yet."""
        for send in (True, False):
            if not self._queued[send] and self._open(send):
                return None
        batch = tuple(self._queued[send].popleft() for send in (True, False) if self._queued[send])
        return batch or None

    def _open(self, send: bool) -> bool:
        total = self._total[send]
        return total is None or self._posted[send] < total
