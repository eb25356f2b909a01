"""astage: asyncio-native checkpoint staging for PyTorch.

Stage a state_dict into reusable CPU buffers without blocking the event loop, replicate
it to a peer rank, and persist it durably.  Everything public is re-exported here, and
only what a user needs (the reasons, name by name: "What is public and why" in docs/api.rst).
"""

import logging as _logging

from ._checkpointer.checkpointer import Checkpointer as Checkpointer
from ._checkpointer.checkpointer import ReplicaSource as ReplicaSource
from ._checkpointer.checkpointer import Replicator as Replicator
from ._checkpointer.checkpointer import SaveEvent as SaveEvent
from ._checkpointer.checkpointer import SaveHandle as SaveHandle
from ._checkpointer.checkpointer import SaveStats as SaveStats
from ._checkpointer.remote_tier import UploadStats as UploadStats
from ._files.durable import CheckpointFileInfo as CheckpointFileInfo
from ._files.durable import find_replicas as find_replicas
from ._files.durable import inspect_checkpoint_file as inspect_checkpoint_file
from ._files.durable import load_checkpoint_file as load_checkpoint_file
from ._files.durable import load_checkpoint_file_sync as load_checkpoint_file_sync
from ._files.durable import sweep_stale_temps as sweep_stale_temps
from ._files.policies import Policy as Policy
from ._files.policies import StepInfo as StepInfo
from ._files.policies import best as best
from ._files.policies import every_seconds as every_seconds
from ._files.policies import every_steps as every_steps
from ._files.policies import keep_if as keep_if
from ._files.policies import latest as latest
from ._remote.config import Remote as Remote
from ._replication.stager import ReplicationPhase as ReplicationPhase
from ._replication.stager import ReplicationResult as ReplicationResult
from ._replication.stager import ReplicationStager as ReplicationStager
from ._replication.stager import ReplicationStats as ReplicationStats
from ._staging.events import wait_event as wait_event
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
    "Policy",
    "PoolStats",
    "Remote",
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
    "StepInfo",
    "TransportError",
    "UnsupportedInputError",
    "UploadStats",
    "__version__",
    "best",
    "every_seconds",
    "every_steps",
    "find_replicas",
    "inspect_checkpoint_file",
    "keep_if",
    "latest",
    "load_checkpoint_file",
    "load_checkpoint_file_sync",
    "sweep_stale_temps",
    "wait_event",
]
