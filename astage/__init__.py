"""astage: asyncio-native checkpoint staging for PyTorch.

Stage a state_dict into reusable CPU buffers without blocking the event loop, replicate
it to a peer rank, and persist it durably.  Everything public is re-exported here, and
only what a user needs (the reasons, name by name: "What is public and why" in docs/api.rst).
"""

import logging as _logging

from ._checkpointer import Checkpointer as Checkpointer
from ._checkpointer import ReplicaSource as ReplicaSource
from ._checkpointer import Replicator as Replicator
from ._checkpointer import SaveEvent as SaveEvent
from ._checkpointer import SaveHandle as SaveHandle
from ._checkpointer import SaveStats as SaveStats
from ._errors import AstageError as AstageError
from ._errors import CapacityError as CapacityError
from ._errors import ClosedError as ClosedError
from ._errors import ConfigurationError as ConfigurationError
from ._errors import EventLoopError as EventLoopError
from ._errors import IntegrityError as IntegrityError
from ._errors import PeerReportedError as PeerReportedError
from ._errors import PeerTimeoutError as PeerTimeoutError
from ._errors import PersistError as PersistError
from ._errors import ResourceError as ResourceError
from ._errors import TransportError as TransportError
from ._errors import UnsupportedInputError as UnsupportedInputError
from ._events import wait_event as wait_event
from ._options import StagingOptions as StagingOptions
from ._persist import CheckpointFileInfo as CheckpointFileInfo
from ._persist import find_replicas as find_replicas
from ._persist import inspect_checkpoint_file as inspect_checkpoint_file
from ._persist import load_checkpoint_file as load_checkpoint_file
from ._persist import load_checkpoint_file_sync as load_checkpoint_file_sync
from ._persist import sweep_stale_temps as sweep_stale_temps
from ._pool import PoolStats as PoolStats
from ._replication import ReplicationPhase as ReplicationPhase
from ._replication import ReplicationResult as ReplicationResult
from ._replication import ReplicationStager as ReplicationStager
from ._replication import ReplicationStats as ReplicationStats
from ._stager import AsyncStager as AsyncStager
from ._stager import BlockingStager as BlockingStager
from ._stager import DefaultStager as DefaultStager
from ._stager import StageStats as StageStats

__version__ = "0.1.0"

# A library logs but never configures logging: without this, Python's last-resort handler
# would print astage's warnings to stderr of applications that chose not to log them.
_logging.getLogger("astage").addHandler(_logging.NullHandler())


# Names that were public once and are not any more: each still resolves, silently (a warning
# would fail the test suites of programs that turn warnings into errors), so old code keeps
# running; they are left out of ``__all__`` and ``dir()``, and the API docs say why.
_RETIRED: dict[str, str] = {"BufferPool": "astage._pool", "BufferKind": "astage._pool"}


def __getattr__(name: str) -> object:
    import importlib

    # ``astage.dcp`` loads torch.distributed.checkpoint (~0.2 s): only when first used.
    if name == "dcp":
        return importlib.import_module(".dcp", __name__)
    if name in _RETIRED:
        return getattr(importlib.import_module(_RETIRED[name]), name)
    raise AttributeError(f"module 'astage' has no attribute {name!r}")


__all__ = [
    "AstageError",
    "AsyncStager",
    "BlockingStager",
    "CapacityError",
    "CheckpointFileInfo",
    "Checkpointer",
    "ClosedError",
    "ConfigurationError",
    "DefaultStager",
    "EventLoopError",
    "IntegrityError",
    "PeerReportedError",
    "PeerTimeoutError",
    "PersistError",
    "PoolStats",
    "ReplicaSource",
    "ReplicationPhase",
    "ReplicationResult",
    "ReplicationStager",
    "ReplicationStats",
    "Replicator",
    "ResourceError",
    "SaveEvent",
    "SaveHandle",
    "SaveStats",
    "StageStats",
    "StagingOptions",
    "TransportError",
    "UnsupportedInputError",
    "__version__",
    "find_replicas",
    "inspect_checkpoint_file",
    "load_checkpoint_file",
    "load_checkpoint_file_sync",
    "sweep_stale_temps",
    "wait_event",
]
