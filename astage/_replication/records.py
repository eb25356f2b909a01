"""What a replication reports and shares: its phase, stats and result, and the view of the
group that astage's collective operations borrow (:class:`GroupSession`)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from .. import _transport
from .._format.codec import FileHeader, decode
from .._staging.pool import BufferPool
from .._staging.stager import StageStats


class ReplicationPhase(enum.Enum):
    """How far one exchange got; it decides whether a failure breaks the process group."""

    STAGED = "staged"
    """Nothing posted yet: a failure leaves the group as it was."""
    POSTED = "posted"
    """Messages are on the wire: a failure breaks the group (the transport breaks it)."""
    EXCHANGED = "exchanged"
    """Both directions complete: a local failure is told to the peer in the acknowledgement;
    failing to tell it (or being cancelled first) leaves the peer out of step."""
    ACKNOWLEDGED = "acknowledged"
    """Both sides agreed on the outcome (success or a reported failure): the group is fine."""

    @property
    def failure_breaks_group(self) -> bool:
        """Whether a failure in this phase leaves the ranks out of step."""
        return self in (ReplicationPhase.POSTED, ReplicationPhase.EXCHANGED)


@dataclasses.dataclass(frozen=True)
class ReplicationStats:
    """What one ``replicate()`` did, by phase (seconds) and volume (bytes)."""

    stage: StageStats | None
    encode_seconds: float
    exchange: _transport.ExchangeStats
    persist_seconds: float
    ack_seconds: float
    seconds: float

    @property
    def bytes_sent(self) -> int:
        """Replica bytes sent to the peer."""
        return self.exchange.bytes_sent

    @property
    def bytes_received(self) -> int:
        """Replica bytes received from the peer."""
        return self.exchange.bytes_received


@dataclasses.dataclass(frozen=True)
class ReplicationResult:
    """The outcome of one ``replicate()``.

    :ivar staged: this rank's own staged copy (release it with the stager when done).
    :ivar replica_path: where the peer's replica now lies, durable.
    :ivar replica_header: the validated header of the received replica.
    :ivar send_to: the rank (group rank space) that holds our replica.
    :ivar recv_from: the rank whose replica we hold.
    """

    staged: Any
    replica_path: Path
    replica_header: FileHeader
    send_to: int
    recv_from: int
    stats: ReplicationStats
    # The received bytes, set by ``received_result``: off the constructor, which users read.
    _body: torch.Tensor = dataclasses.field(init=False, repr=False)

    @functools.cached_property
    def replica(self) -> Any:
        """The peer's state_dict, rebuilt over the received bytes (verified; CPU)."""
        return decode(self.replica_header, self._body)


def received_result(
    staged: Any,
    replica_path: Path,
    replica_header: FileHeader,
    send_to: int,
    recv_from: int,
    stats: ReplicationStats,
    body: torch.Tensor,
) -> ReplicationResult:
    """A :class:`ReplicationResult` holding the received replica's bytes for its ``replica``."""
    result = ReplicationResult(staged, replica_path, replica_header, send_to, recv_from, stats)
    object.__setattr__(result, "_body", body)  # frozen: set once, here
    return result


class GroupSession:
    """What a collective operation uses of a :class:`ReplicationStager` while it holds the
    group (:meth:`ReplicationStager.collective`): the ring, the deadline's length, the pool
    received copies land in, and the one path to the wire."""

    def __init__(
        self,
        ring: _Ring,
        inbox: BufferPool,
        transfer: Callable[..., Awaitable[_transport.Received | None]],
    ) -> None:
        self.rank, self.world_size = ring.rank, ring.world_size
        self.send_to, self.recv_from = ring.send_to, ring.recv_from
        self.timeout, self.process_group = ring.timeout, ring.process_group
        self.held_replicas = ring.held_replicas
        self.inbox = inbox
        self.transfer = transfer


class _Ring(Protocol):
    """The public side of a ReplicationStager that a :class:`GroupSession` copies."""

    rank: int
    world_size: int
    send_to: int
    recv_from: int
    timeout: float
    process_group: Any

    def held_replicas(self) -> dict[int, Path]: ...


def time_left(deadline: float) -> float:
    """Seconds left until ``deadline`` (``time.perf_counter``), at least a millisecond."""
    return max(deadline - time.perf_counter(), 1e-3)
