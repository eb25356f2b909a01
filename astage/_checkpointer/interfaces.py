"""What the Checkpointer asks of the objects it is given and what it reports back: the
replication protocols it calls, and the stats and events of a save."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from .._staging.stager import StageStats
from .._util.errors import AstageError
from .remote_tier import UploadStats

EventKind = Literal["staged", "persisted", "replicated", "committed", "failed", "uploaded"]
"""What happened to a save: ``staged`` first, then ``persisted`` (the local file is durable)
and ``replicated`` in either order, then ``committed``, or ``failed`` instead; with a remote
tier, ``uploaded`` once its commit object is durable on the store."""


# -- protocols ----------------------------------------------------------------------------


@runtime_checkable
class Replicator(Protocol):
    """What the Checkpointer needs from a replication object (``astage.ReplicationStager``).

    ``replicate_staged`` is called once per staged save, in save order, while the local
    file is written; it must not change the staged copy.  An exception fails the save.

    One optional capability, declared rather than guessed from the method's signature: a
    class whose ``replicate_staged`` also takes an ``encoded`` keyword argument says so with
    the class attribute ``accepts_encoded = True``, in the same class body that defines
    ``replicate_staged``.  The Checkpointer then passes ``encoded=``, the save's
    :class:`astage._format.codec.Encoded` replica (owner this rank, no holder), encoded and
    checksummed once for the local file and the replica alike.  Without the declaration (or
    in a subclass that overrides ``replicate_staged`` without repeating it) the method is
    called with ``staged``, ``step`` and ``checkpoint_id`` only.
    :class:`astage.ReplicationStager` declares it.
    """

    async def replicate_staged(self, staged: Any, *, step: int, checkpoint_id: str) -> object:
        """Send or store a replica of an already staged state_dict."""
        ...


@runtime_checkable
class ReplicaSource(Protocol):
    """A replication object that can also find this rank's replica of a step (optional)."""

    async def fetch_replica(self, step: int) -> Path | None:
        """A local path holding this rank's replica of ``step``, or ``None``."""
        ...


# -- stats and events ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SaveStats:
    """What one committed save cost.

    :ivar step: the step saved.
    :ivar nbytes: bytes of this rank's checkpoint file.
    :ivar staging_seconds: how long ``save()`` kept the caller (back-pressure included).
    :ivar backpressure_seconds: part of ``staging_seconds`` spent waiting for an earlier
        save to finish (``max_in_flight``).
    :ivar persist_seconds: encoding plus the durable write of the local file.
    :ivar replicate_seconds: the replication call, ``None`` without replication.
    :ivar total_seconds: from the ``save()`` call to the commit (the marker durable).
    :ivar stage: the stager's own stats, where it records them (``last_stats``).
    :ivar durable_at: when the marker became durable, on the ``time.perf_counter()``
        clock: recorded by the thread that wrote it, at that moment, however busy the
        event loop was then (``save() -> durable`` is this minus the time of the call).
    """

    step: int
    nbytes: int
    staging_seconds: float
    backpressure_seconds: float
    persist_seconds: float
    replicate_seconds: float | None
    total_seconds: float
    stage: StageStats | None = None
    durable_at: float | None = None

    @property
    def gbps(self) -> float:
        """Persist throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.persist_seconds / 1e9 if self.persist_seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class SaveEvent:
    """One progress report, passed to ``on_progress``.

    :ivar kind: ``staged``, ``persisted``, ``replicated``, ``committed`` or ``failed``;
        with a remote tier, ``uploaded`` once the step's commit object is on the store.
    :ivar elapsed_seconds: since the ``save()`` call.
    :ivar stats: the save's stats, on ``committed``.
    :ivar error: why the save failed, on ``failed``.
    :ivar upload: the upload's stats, on ``uploaded``.
    """

    kind: EventKind
    step: int
    checkpoint_id: str
    elapsed_seconds: float
    stats: SaveStats | None = None
    error: AstageError | None = None
    upload: UploadStats | None = None
