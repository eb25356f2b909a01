"""What ``Checkpointer.save()`` hands back: a handle to await the commit (and the upload)."""

from __future__ import annotations

from .interfaces import SaveStats
from .remote_tier import RemoteTier, UploadStats
from .save_pipeline import Job


class SaveHandle:
    """A save that was staged: :meth:`wait` for its commit.

    :ivar step: the step being saved.
    :ivar checkpoint_id: the unique id recorded in its file and marker.
    :ivar staging_seconds: how long ``save()`` kept the caller.
    """

    def __init__(self, job: Job, remote: RemoteTier | None = None) -> None:
        self._job = job
        self._remote = remote
        self.step = job.step
        self.checkpoint_id = job.checkpoint_id
        self.staging_seconds = job.staging_seconds

    @property
    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._job.done.is_set()

    @property
    def stats(self) -> SaveStats | None:
        """The stats once committed, else ``None``."""
        return self._job.stats

    @property
    def durable_at(self) -> float | None:
        """When the save became durable (``time.perf_counter()``), as soon as it has, even
        before the event loop has had a turn to hear of it; ``None`` until then."""
        return self._job.durable_at

    async def wait(self) -> SaveStats:
        """Wait until this save is committed.

        A failure raised here is not raised again by the Checkpointer's ``save``/``wait``.

        :returns: the save's stats.
        :raises PersistError: the save failed and was not committed (names the step).
        """
        await self._job.done.wait()
        if self._job.stats is None:
            self._job.reported = True
            assert self._job.error is not None
            raise self._job.error
        return self._job.stats

    async def uploaded(self) -> UploadStats | None:
        """Wait until this save is committed and uploaded to the remote tier.

        :returns: the upload's stats, once this rank's commit object is durable on the
            store; ``None`` without a remote tier or if the step was not picked for upload
            (``Remote(every=...)``).
        :raises PersistError: the save failed (nothing to upload).
        :raises RemoteError: the upload failed (names the step).
        """
        await self.wait()
        return None if self._remote is None else await self._remote.wait(self.step)

    def __repr__(self) -> str:
        state = "committed" if self.stats else ("failed" if self.done else "in flight")
        return f"<SaveHandle step={self.step} {state}>"
