"""astage: asyncio-native checkpoint staging for PyTorch.

Stage a state_dict into reusable CPU buffers without blocking the event loop, replicate
it to a peer rank, and persist it durably.  Everything public is re-exported here, and
only what a user needs (the reasons, name by name: "What is public and why" in docs/api.rst).
"""

import logging as _logging

from ._checkpointer.checkpointer import Checkpointer as Checkpointer
from ._checkpointer.handle import SaveHandle as SaveHandle
from ._checkpointer.interfaces import ReplicaSource as ReplicaSource
from ._checkpointer.interfaces import Replicator as Replicator
from ._checkpointer.interfaces import SaveEvent as SaveEvent
from ._checkpointer.interfaces import SaveStats as SaveStats
from ._checkpointer.restore_into import FillReport as FillReport
from ._replication.records import ReplicationPhase as ReplicationPhase
from ._replication.records import ReplicationResult as ReplicationResult
from ._replication.records import ReplicationStats as ReplicationStats
from ._replication.stager import ReplicationStager as ReplicationStager
from ._staging.options import StagingOptions as StagingOptions
from ._staging.pool import PoolStats as PoolStats
from ._staging.stager import AsyncStager as AsyncStager
from ._staging.stager import BlockingStager as BlockingStager
from ._staging.stager import DefaultStager as DefaultStager
from ._staging.stager import StageStats as StageStats
from ._util.errors import AstageError as AstageError
from ._util.errors import CapacityError as CapacityError
from ._util.errors import ClosedError as ClosedError
from ._util.errors import ConfigurationError as ConfigurationError
from ._util.errors import DestinationMismatchError as DestinationMismatchError
from ._util.errors import EventLoopError as EventLoopError
from ._util.errors import IntegrityError as IntegrityError
from ._util.errors import PeerReportedError as PeerReportedError
from ._util.errors import PeerTimeoutError as PeerTimeoutError
from ._util.errors import PersistError as PersistError
from ._util.errors import RemoteError as RemoteError
from ._util.errors import ResourceError as ResourceError
from ._util.errors import TransportError as TransportError
from ._util.errors import UnsupportedInputError as UnsupportedInputError

__version__ = "0.1.0"

# A library logs but never configures logging: without this, Python's last-resort handler
# would print astage's warnings to stderr of applications that chose not to log them.
_logging.getLogger("astage").addHandler(_logging.NullHandler())


# Names that were public once and are not any more: each still resolves, silently (a warning
# would fail the test suites of programs that turn warnings into errors), so old code keeps
# running; they are left out of ``__all__`` and ``dir()``, and the API docs say why.
_RETIRED: dict[str, str] = {"BufferPool": "astage._staging.pool", "BufferKind": "astage._staging.pool"}

# The checkpoint-file readers live in :mod:`astage.files` (a program that only reads files
# needs nothing else); their first-release top-level names still resolve, the same way.
_FILE_READERS = "CheckpointFileInfo find_replicas inspect_checkpoint_file load_checkpoint_file"
_RETIRED |= dict.fromkeys(
    f"{_FILE_READERS} load_checkpoint_file_sync sweep_stale_temps".split(), "astage.files"
)
# Rooms of their own, so that the top level stays a short list; their names resolve here too.
_RETIRED |= {"wait_event": "astage.events", "Remote": "astage.remote", "UploadStats": "astage.remote"}
_RETIRED |= dict.fromkeys(
    ["Policy", "StepInfo", "best", "every_seconds", "every_steps", "keep_if", "latest"], "astage.retention"
)


def __getattr__(name: str) -> object:
    import importlib

    # ``astage.dcp`` loads torch.distributed.checkpoint (~0.2 s): only when first used.
    if name in ("dcp", "events", "files", "remote", "retention"):
        return importlib.import_module(f".{name}", __name__)
    if name in _RETIRED:
        return getattr(importlib.import_module(_RETIRED[name]), name)
    raise AttributeError(f"module 'astage' has no attribute {name!r}")


__all__ = [
    "AstageError",
    "AsyncStager",
    "BlockingStager",
    "CapacityError",
    "Checkpointer",
    "ClosedError",
    "ConfigurationError",
    "DefaultStager",
    "DestinationMismatchError",
    "EventLoopError",
    "FillReport",
    "IntegrityError",
    "PeerReportedError",
    "PeerTimeoutError",
    "PersistError",
    "PoolStats",
    "RemoteError",
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
]
