"""The Checkpointer's remote tier: committed steps uploaded in the background, and healed back.

Uploading.  Each commit of a step the remote policy picks (every ``Remote.every``-th
commit) queues it; one task of the Checkpointer's task group uploads the queue in order,
never on a ``save()``'s path.  A step is streamed from this rank's committed local file
(:meth:`RemoteClient.upload_file`: multipart, bounded concurrency and memory), each
object retried with backoff on transient errors, the whole step under the remote's
deadline.  The data object goes first; once the store has acknowledged it, this rank's
commit object (:class:`~astage._remote.layout.CommitObject`, with the object's crc32c)
goes last.  Only then is the step reported uploaded (:class:`UploadStats`).  Until its
upload has ended, a queued step is *pinned*: local retention keeps it on disk.  After each
upload, retention on the store deletes the steps its policy no longer wants, commit
objects first (so a half-deleted step is incomplete, never complete and wrong).

Restoring.  :meth:`RemoteTier.complete_steps` lists the store (hostile keys ignored) and
reads the commit objects of the steps where every rank's is there.  :meth:`RemoteTier.heal`
downloads this rank's object of a step into its local step directory, verified against
the commit object's size and crc32c as it lands, and commits it locally (marker last), so
the usual local restore then reads it, checking every checksum of the format again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._files.directory import open_step_dir, rank_file_names, step_dir_name, step_dir_opener, unlink_entry
from .._files.durable import blocking_io, write_checkpoint_file
from .._files.markers import FileEntry, Marker
from .._files.policies import StepInfo, retained
from .._files.reading import open_regular
from .._remote.client import RemoteClient, TransientRemoteError
from .._remote.config import Remote
from .._remote.layout import (
    COMMIT_CAP,
    RUN_KEY,
    CommitObject,
    StepObjects,
    commit_key,
    data_key,
    group_listing,
    parse_commit,
)
from .._util.errors import AstageError, IntegrityError, RemoteError, ResourceError

log = logging.getLogger("astage.remote")

_BACKOFF_FIRST = 0.2
_BACKOFF_MAX = 5.0


@dataclasses.dataclass(frozen=True)
class UploadStats:
    """What one step's upload of this rank cost; reported once its commit object is durable.

    :ivar step: the step.
    :ivar nbytes: bytes of this rank's data object.
    :ivar seconds: from the start of the upload to the commit object's durability.
    :ivar attempts: tries of the data object (1 when no transient error happened).
    :ivar uploaded_at: ``time.time()`` when the commit object was durable.
    """

    step: int
    nbytes: int
    seconds: float
    attempts: int
    uploaded_at: float

    @property
    def gbps(self) -> float:
        """Upload throughput in GB/s (10^9 bytes per second)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclasses.dataclass(eq=False)
class _Upload:
    step: int
    marker: Marker
    metrics: dict[str, float]
    started: float
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    stats: UploadStats | None = None
    error: AstageError | None = None


def default_world_size() -> int:
    """The ``torch.distributed`` world size when it is initialised, else 1."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class RemoteTier:
    """Uploads a Checkpointer's committed steps and brings them back (one rank)."""

    def __init__(
        self, remote: Remote, directory: Path, rank: int, dir_fd: int, limiter: anyio.CapacityLimiter
    ) -> None:
        self.remote = remote
        self._directory = directory
        self.client: RemoteClient = remote.client()
        self.rank = rank
        self.world_size = remote.world_size or default_world_size()
        if rank >= self.world_size:
            raise ResourceError(f"rank {rank} is not below the remote tier's world_size {self.world_size}")
        self._dir_fd = dir_fd
        self._limiter = limiter
        self._data_name, self._marker_name = rank_file_names(rank)
        self._commits = 0
        self._uploads: dict[int, _Upload] = {}
        self._send: MemoryObjectSendStream[_Upload] | None = None
        self._idle = anyio.Event()
        self._idle.set()
        self._pending = 0
        self.last_stats: UploadStats | None = None
        self._listed: set[int] = set()  # steps with this rank's commit object, when entered
        self._commit_cache: dict[tuple[int, int], CommitObject] = {}
        self.on_uploaded: Callable[[int, str, float, UploadStats], None] | None = None
        """Called on the event loop once a step is uploaded (step, checkpoint id, when its
        save started on the ``perf_counter`` clock, the stats)."""

    # -- uploading ------------------------------------------------------------------------

    async def check(self) -> None:
        """List the prefix once: a wrong URL, bucket or credential fails here, clearly.

        :raises RemoteError: the store refuses the listing or cannot be reached.
        """
        listing = await self._with_retries("list", "", self.client.listing)
        self._listed = {
            step for step, objects in group_listing(listing).items() if self.rank in objects.commits
        }
        if self.remote.run is not None:
            mine = json.dumps({"format": "astage-run", "run": self.remote.run}).encode()
            owner = await self._with_retries("claim", RUN_KEY, self.client.claim, RUN_KEY, mine, COMMIT_CAP)
            if owner != mine:
                shown = owner[:300].decode("utf-8", "replace")
                raise RemoteError(
                    f"{self.client.url} belongs to another run ({RUN_KEY}: {shown}), not to run "
                    f"{self.remote.run!r}: use a prefix of its own"
                )

    def start(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the uploading task in the Checkpointer's task group."""
        send, receive = anyio.create_memory_object_stream[_Upload](math.inf)
        self._send = send
        task_group.start_soon(self._run, receive, name="astage remote uploads")

    def resume(self, committed: Mapping[int, Marker]) -> None:
        """After a restart: queue the newest local step if the store lacks this rank's
        commit of it (an upload the last run did not finish, a preemption's last save)."""
        newest = max(committed, default=None)
        if newest is not None and newest > max(self._listed, default=-1):
            log.info("step %d is not on %s yet: uploading it", newest, self.client.url)
            self.committed(newest, committed[newest], {}, force=True)
            self._commits -= 1  # not a new commit: the every-N count goes on as before

    def committed(
        self,
        step: int,
        marker: Marker,
        metrics: Mapping[str, float],
        *,
        force: bool = False,
        started: float | None = None,
    ) -> bool:
        """A step was committed locally: queue its upload if the policy picks it (or ``force``)."""
        self._commits += 1
        if not force and (self._commits - 1) % self.remote.every != 0:
            return False
        if step in self._uploads and not self._uploads[step].done.is_set():
            return True
        upload = _Upload(step, marker, dict(metrics), time.perf_counter() if started is None else started)
        self._uploads[step] = upload
        self._pending += 1
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        assert self._send is not None
        self._send.send_nowait(upload)
        return True

    def pinned(self) -> set[int]:
        """Steps queued or uploading: local retention must keep them."""
        return {step for step, u in self._uploads.items() if not u.done.is_set()}

    async def wait(self, step: int) -> UploadStats | None:
        """Wait for ``step``'s upload: its stats, ``None`` if it was not picked for upload.

        :raises RemoteError: the upload failed (names the step).
        """
        upload = self._uploads.get(step)
        if upload is None:
            return None
        await upload.done.wait()
        if upload.error is not None:
            raise upload.error
        return upload.stats

    async def drain(self) -> None:
        """Wait until every queued upload has ended."""
        await self._idle.wait()

    def close(self) -> None:
        """No more uploads: the uploading task ends once the queue is empty."""
        if self._send is not None:
            self._send.close()

    async def _run(self, receive: MemoryObjectReceiveStream[_Upload]) -> None:
        async with receive:
            async for upload in receive:
                try:
                    await self._upload(upload)
                    await self._retire_remote()
                finally:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    async def _upload(self, upload: _Upload) -> None:
        step = upload.step
        try:
            with anyio.fail_after(self.remote.deadline):
                upload.stats = await self._upload_step(upload)
            self.last_stats = upload.stats
            if self.on_uploaded is not None:
                self.on_uploaded(step, upload.marker.checkpoint_id, upload.started, upload.stats)
            log.info(
                "uploaded step %d to %s: %d bytes in %.3fs (%.2f GB/s)",
                step,
                self.client.url,
                upload.stats.nbytes,
                upload.stats.seconds,
                upload.stats.gbps,
            )
        except TimeoutError:
            upload.error = RemoteError(
                f"uploading step {step} to {self.client.url} took over its deadline "
                f"of {self.remote.deadline}s"
            )
        except Exception as exc:  # reported by uploaded(), never into the Checkpointer's task group
            upload.error = (
                exc if isinstance(exc, RemoteError) else RemoteError(f"uploading step {step}: {exc!r}")
            )
        finally:
            upload.done.set()
        if upload.error is not None:
            log.error("step %d was not uploaded to %s: %s", step, self.client.url, upload.error)

    async def _upload_step(self, upload: _Upload) -> UploadStats:
        begin = time.perf_counter()
        step, entry = upload.step, upload.marker.files[0]
        key = data_key(step, self.rank)
        attempts = 0
        while True:
            attempts += 1
            fd = await blocking_io(self._open_local, step, limiter=self._limiter)
            try:
                upload_file = self.client.upload_file
                crc = await self.client.run("upload", key, upload_file, key, fd, entry.nbytes, owns=fd)
                break
            except TransientRemoteError as exc:
                if attempts >= self.remote.attempts:
                    raise
                delay = min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** (attempts - 1))
                log.warning("upload of %s failed (attempt %d), again in %.1fs: %s", key, attempts, delay, exc)
                await anyio.sleep(delay)  # backoff before the next attempt
        # A put that returned is durable on the store (S3, GCS and Azure say so of a
        # finished upload); the bytes it sent were exactly the file's (checked as read).
        commit = CommitObject(
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            checkpoint_id=upload.marker.checkpoint_id,
            created=upload.marker.created,
            nbytes=entry.nbytes,
            crc32c=crc,
            storages_crc32c=entry.storages_crc32c,
            metrics=upload.metrics,
        )
        ckey = commit_key(step, self.rank)
        await self._with_retries("put", ckey, self.client.put_bytes, ckey, commit.to_json())
        return UploadStats(step, entry.nbytes, time.perf_counter() - begin, attempts, time.time())

    async def _with_retries(self, operation: str, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        for attempt in range(1, self.remote.attempts + 1):
            try:
                return await self.client.run(operation, key, fn, *args)
            except TransientRemoteError:
                if attempt >= self.remote.attempts:
                    raise
                await anyio.sleep(min(_BACKOFF_MAX, _BACKOFF_FIRST * 2 ** (attempt - 1)))  # backoff
        raise AssertionError("unreachable")  # pragma: no cover

    def _open_local(self, step: int) -> int:
        """This rank's committed file of ``step``, opened read-only (never through a link)."""
        step_fd = open_step_dir(self._dir_fd, step_dir_name(step), create=False)
        try:
            return open_regular(self._data_name, dir_fd=step_fd)
        finally:
            os.close(step_fd)

    async def _retire_remote(self) -> None:
        """Delete from the store the steps its policy no longer wants (commit objects first).

        Only rank 0 deletes (one writer of deletions); failures are logged, never raised.
        """
        if self.remote.keep is None or self.rank != 0:
            return
        try:
            steps = await self.complete_steps()
            infos = [StepInfo(s, c[0].created, c[0].metrics) for s, c in steps.items()]
            for step in sorted(set(steps) - retained(self.remote.keep, infos)):
                await self.delete_step(step, self.world_size)
                log.info("deleted step %d from %s (keep=%s)", step, self.client.url, self.remote.keep)
        except Exception as exc:  # never into the Checkpointer's task group
            log.warning(
                "retention on %s failed (tried again after the next upload): %s", self.client.url, exc
            )

    async def delete_step(self, step: int, world_size: int) -> None:
        """Delete a step from the store: every commit object first, then the data."""
        for rank in range(world_size):
            self._commit_cache.pop((step, rank), None)
            await self.client.run(
                "delete", commit_key(step, rank), self.client.delete, commit_key(step, rank)
            )
        for rank in range(world_size):
            await self.client.run("delete", data_key(step, rank), self.client.delete, data_key(step, rank))

    # -- reading back -----------------------------------------------------------------------

    async def listed_steps(self) -> dict[int, StepObjects]:
        """The steps whose every rank's commit object is listed on the store (complete, as
        far as the listing says; the commit objects are read when a step is used)."""
        listing = await self.client.run("list", "", self.client.listing)
        ranks = set(range(self.world_size))
        return {
            step: objects for step, objects in group_listing(listing).items() if set(objects.commits) == ranks
        }

    async def own_commit(self, step: int, objects: StepObjects) -> CommitObject:
        """This rank's commit object of a listed step, checked against the listing.

        :raises IntegrityError: invalid, of another world size, or naming a data object of
            another size than the one listed.
        :raises RemoteError: it cannot be read.
        """
        commit = await self._read_commit(step, self.rank)
        if commit.world_size != self.world_size or objects.data.get(self.rank) != commit.nbytes:
            raise IntegrityError(f"step {step} on {self.client.url}: its objects do not match its commit")
        return commit

    async def complete_steps(self) -> dict[int, list[CommitObject]]:
        """The steps complete on the store, each with every rank's commit object (all read:
        for retention and listings).  A step whose commit objects are invalid or disagree
        (world size, a rank's data object's size) is left out (and logged)."""
        complete: dict[int, list[CommitObject]] = {}
        for step, objects in sorted((await self.listed_steps()).items()):
            try:
                commits = [await self._read_commit(step, rank) for rank in range(self.world_size)]
            except (IntegrityError, RemoteError) as exc:
                log.warning("ignoring step %d on %s: %s", step, self.client.url, exc)
                continue
            if any(c.world_size != self.world_size or objects.data.get(c.rank) != c.nbytes for c in commits):
                log.warning(
                    "ignoring step %d on %s: its objects do not match its commits", step, self.client.url
                )
                continue
            complete[step] = commits
        return complete

    async def _read_commit(self, step: int, rank: int) -> CommitObject:
        """A commit object, read once per tier (a commit object is never rewritten in place
        with other content: a step is deleted, commit objects first, before it is reused)."""
        cached = self._commit_cache.get((step, rank))
        if cached is not None:
            return cached
        key = commit_key(step, rank)
        data = await self.client.run("get", key, self.client.get_bytes, key, COMMIT_CAP)
        commit = parse_commit(data, step=step, rank=rank)
        self._commit_cache[(step, rank)] = commit
        return commit

    async def heal(self, commit: CommitObject) -> Marker:
        """Download this rank's object of ``commit.step``, verified, and commit it locally.

        Any local marker of the step goes first: the directory never shows a marker over
        a file it does not describe.  :returns: the new local marker.
        :raises IntegrityError: the object does not match its commit object (nothing kept).
        :raises RemoteError: the download failed.
        """
        step = commit.step
        name = step_dir_name(step)
        step_fd = await blocking_io(step_dir_opener(self._dir_fd, step), limiter=self._limiter)
        try:
            await blocking_io(unlink_entry, self._marker_name, step_fd, limiter=self._limiter)
            await blocking_io(os.fsync, step_fd, limiter=self._limiter)
            dup = await blocking_io(os.dup, step_fd, limiter=self._limiter)
        finally:
            await blocking_io(os.close, step_fd, limiter=self._limiter)
        key = data_key(step, self.rank)
        with anyio.fail_after(self.remote.deadline):
            download, nbytes, crc = self.client.download, commit.nbytes, commit.crc32c
            await self.client.run("download", key, download, key, dup, self._data_name, nbytes, crc, owns=dup)
        await blocking_io(os.fsync, self._dir_fd, limiter=self._limiter)
        entry = FileEntry(self._data_name, commit.nbytes, commit.storages_crc32c)
        marker = Marker(step, self.rank, commit.checkpoint_id, commit.created, (entry,))
        await write_checkpoint_file(
            self._directory / name / self._marker_name,
            [marker.to_json()],
            limiter=self._limiter,
            open_dir=step_dir_opener(self._dir_fd, step),
        )
        log.info(
            "restored step %d of rank %d from %s into the local directory", step, self.rank, self.client.url
        )
        return marker
