"""Reading checkpoint files without a Checkpointer: inspect, load, find replicas, sweep.

For tools and programs that only read what astage wrote (an evaluation job, a converter,
``astage inspect``).  Every reader validates the file in full before it trusts a byte:
the header within its parse bound, every checksum, no pickle.
"""

from ._files.durable import sweep_stale_temps as sweep_stale_temps
from ._files.reading import CheckpointFileInfo as CheckpointFileInfo
from ._files.reading import find_replicas as find_replicas
from ._files.reading import inspect_checkpoint_file as inspect_checkpoint_file
from ._files.reading import load_checkpoint_file as load_checkpoint_file
from ._files.reading import load_checkpoint_file_sync as load_checkpoint_file_sync

__all__ = [
    "CheckpointFileInfo",
    "find_replicas",
    "inspect_checkpoint_file",
    "load_checkpoint_file",
    "load_checkpoint_file_sync",
    "sweep_stale_temps",
]
