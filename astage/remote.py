"""The object-store tier: where a Checkpointer uploads committed steps and restores from.

``Checkpointer(directory, remote="s3://bucket/run-7")`` or, with options,
``Checkpointer(directory, remote=astage.remote.Remote("s3://bucket/run-7", every=100))``;
see the remote guide for what "complete" means on the store, retries and costs.
"""

from ._checkpointer.remote_tier import UploadStats as UploadStats
from ._remote.config import Remote as Remote

__all__ = ["Remote", "UploadStats"]
