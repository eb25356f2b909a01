"""The Checkpointer: save / latest / restore over a stager, durable files and replication.

``await ckpt.save(step, state_dict)`` returns once the state is staged; the save's own
worker thread (or, for a replication object that needs the loop, a task) then encodes the
staged copy (:mod:`astage._format.codec`) and writes it durably (:mod:`astage._files.durable`) while it
hands the copy to the replication object, if there is one; once both are done, it commits
(:mod:`astage._checkpointer.save_pipeline`); a task the Checkpointer owns keeps the books.
This module is the façade
and the bookkeeping of saves in flight; the rest has a module of its own:

* :mod:`astage._files.directory`: the directory's layout (step directories, file names) and the
  per-rank lock;
* :mod:`astage._files.markers`: commit markers, written last and read back as untrusted input;
* :mod:`astage._files.retention`: the start-up sweep and index, retention, discarding a failed save;
* :mod:`astage._checkpointer.local_restore`: a restore from the own file or a replica found elsewhere
  (the collective restore is :mod:`astage._checkpointer.collective_restore`).

Invariants:

* A step is committed exactly when its marker exists; the marker is written (temp file,
  fsync, rename, directory fsync) only after every file it names is durable, so a crash at
  any instruction leaves every committed step loadable.  :meth:`Checkpointer.steps` and
  :meth:`Checkpointer.latest` report committed steps only.
* Retention runs only right after a commit and never removes the step just committed; it
  never fails the save whose commit triggered it (a commit stands once its marker is durable).
* Nothing below the directory is followed (see :mod:`astage._files.directory`).
* Start-up removes what crashed runs of this rank left: astage temp files and step files
  without a marker, nothing else; an exclusive lock keeps a live writer's files safe.
* At most ``max_in_flight`` saves are past staging and not yet finished; a further
  ``save`` waits *before* staging, so memory never piles up.
* Replication and commits run in save order, and replication is called for every staged
  save, even one whose local write failed: ranks that make the same sequence of ``save``
  calls make the same sequence of replication calls (peer exchanges stay in step).
* Every staged copy goes back to its stager, and an uncommitted step's files are removed,
  whatever ends a save (success, error, cancellation).  A failed save is never committed;
  its error is raised once, by the next ``save`` or ``wait`` (or its handle's ``wait``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.abc

from .._files.body_reads import read_lanes
from .._files.markers import Marker
from .._files.policies import Policy
from .._files.retention import Retention
from .._files.steps import StepStore
from .._remote.config import Remote, as_remote
from .._remote.layout import check_metrics
from .._replication.stager import ReplicationStager
from .._staging.plan import PlannedSource
from .._staging.stager import AsyncStager, DefaultStager, StageStats
from .._util.errors import (
    ClosedError,
    ConfigurationError,
    IntegrityError,
    PersistError,
    ResourceError,
)
from .._util.frames import drop_frames
from .._util.resource import AsyncResource
from .._util.validate import check_path
from .arguments import check_arguments, check_step
from .collective_restore import collective_restore
from .handle import SaveHandle
from .interfaces import EventKind, ReplicaSource, Replicator, SaveEvent, SaveStats
from .local_restore import OnRead, ReadProgress, ReplicaPlaces, restore_local
from .remote_restore import heal_newest, restore_across_tiers
from .remote_tier import RemoteTier, UploadStats
from .restore_into import Destination, RestoreLoads, restore_loads
from .save_pipeline import Job, Persister

log = logging.getLogger("astage.checkpointer")


# -- the Checkpointer -----------------------------------------------------------------------


class Checkpointer(AsyncResource):
    """Asynchronous checkpoints with commit markers, retention and replica fallback.

    ::

        async with astage.Checkpointer("ckpt", keep=3) as ckpt:
            if ckpt.latest() is not None:
                model.load_state_dict((await ckpt.restore())["model"])
            for step in range(start, steps):
                train_step()
                if step % 100 == 0:
                    await ckpt.save(step, {"model": model.state_dict()})  # returns once staged
        # leaving the block waits for in-flight saves

    Cancelling the scope around the ``async with`` abandons in-flight saves (nothing of
    them is committed); ``await ckpt.wait()`` first to keep them.  Meant for one live
    Checkpointer per directory and rank; several ranks may share a directory.

    :param directory: where checkpoints live; created (mode 0700) if missing.
    :param stager: stages the state_dicts; default: a :class:`DefaultStager` that the
        Checkpointer creates and closes.  A stager passed in is not closed.
    :param replication: called with each staged copy after the local write (see
        :class:`Replicator`); not closed by the Checkpointer.
    :param keep: committed steps to keep (the highest; the step just saved is always
        kept); ``None`` keeps all.  Retention follows each commit in the background: until
        it has run, up to ``max_in_flight + 1`` more committed steps may be on disk.
    :param max_in_flight: saves that may be persisting at once; more ``save`` calls wait.
    :param rank: this process's rank; names its files and the replicas it restores from.
    :param on_progress: called on the event loop with a :class:`SaveEvent` at each stage
        of each save; keep it quick.  Its exceptions are logged and ignored.
    :param fallback_dirs: directories holding replicas (``*.astage``) that
        :meth:`restore` may use when the local copy is missing or corrupt.
    :param threads: worker threads for encoding and file I/O.
    :param remote: the remote tier, an object store (a :class:`~astage.Remote` or a URL):
        committed steps are uploaded in the background and :meth:`restore` falls back to
        it (see the remote guide).  ``keep`` is then the local tier's retention policy.
    :raises ConfigurationError: an argument is out of range.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        stager: AsyncStager | None = None,
        replication: Replicator | None = None,
        keep: int | Policy | None = 3,
        max_in_flight: int = 1,
        rank: int = 0,
        on_progress: Callable[[SaveEvent], object] | None = None,
        fallback_dirs: Iterable[str | os.PathLike[str]] = (),
        threads: int = 2,
        remote: Remote | str | None = None,
    ) -> None:
        fallbacks = check_arguments(
            stager, replication, keep, max_in_flight, rank, on_progress, fallback_dirs, threads
        )
        self._store = StepStore(check_path("directory", directory), rank, threads)
        self._owns_stager = stager is None
        self._stager: AsyncStager = DefaultStager() if stager is None else stager
        self._replication = replication
        self._retention = Retention(keep, self._store.marker_name)
        self._max_in_flight = max_in_flight
        self._on_progress = on_progress
        self._threads = threads
        self._fallback_dirs = fallbacks
        self._remote = as_remote(remote)
        self._remote_tier: RemoteTier | None = None
        self._metrics: dict[int, dict[str, float]] = {}
        self._force_upload: set[int] = set()  # steps saved by save_now_and_upload
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._reserved: set[int] = set()  # steps between the start of save() and their end
        self._jobs: dict[int, Job] = {}
        self._unreported: list[Job] = []
        self._last_done: anyio.Event | None = None
        self._last_job: Job | None = None
        self._retiring: anyio.Lock | None = None
        self._idle: anyio.Event | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._slots: anyio.Semaphore | None = None
        self._persister: Persister | None = None  # made on entering, over the opened store
        self.last_stats: SaveStats | None = None
        """The stats of the latest committed save."""
        self.last_upload_stats: UploadStats | None = None
        """The stats of the latest upload to the remote tier."""

    # -- lifecycle -----------------------------------------------------------------------

    async def _enter(self) -> None:
        """Open the directory: take the lock, sweep crashed runs' leftovers, index commits.

        :raises ConfigurationError: the path is not a directory.
        :raises ResourceError: another Checkpointer holds this directory for this rank.
        :raises PersistError: the directory cannot be created, locked or listed.
        :raises ClosedError: already entered.
        """
        if self._state != "new":
            raise ClosedError("a Checkpointer can be entered only once")
        await self._store.open()
        try:
            if self._remote is not None:  # a wrong URL, bucket or credential fails here, not later
                store = self._store
                tier = RemoteTier(self._remote, store.directory, store.rank, store.dir_fd, store.limiter)
                tier.on_uploaded = self._emit_uploaded
                await tier.check()
            task_group = anyio.create_task_group()
            await task_group.__aenter__()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._release_lock()
            raise
        self._task_group = task_group
        self._slots = anyio.Semaphore(self._max_in_flight)
        self._persister = Persister(self._store, self._stager, self._replication, self._emit)
        if self._remote is not None:
            self._remote_tier = tier
            tier.start(task_group)
            tier.resume(self._store.index())
        self._state = "open"
        log.debug("opened %s for rank %d: committed steps %s", self.directory, self.rank, self.steps())

    async def _exit(self, exc: BaseException | None) -> None:
        task_group = self._task_group
        try:
            await self._close(report=exc is None)
        finally:
            if task_group is not None:
                self._task_group = None
                # The saves are drained: only a cancellation is the task group's business.
                # Another error from the block must reach the caller as it is, not in a group.
                try:
                    if isinstance(exc, anyio.get_cancelled_exc_class()):
                        await task_group.__aexit__(type(exc), exc, exc.__traceback__)
                    else:
                        await task_group.__aexit__(None, None, None)
                finally:
                    with anyio.CancelScope(shield=True):
                        await self._close_dir()

    async def aclose(self) -> None:
        """Wait for in-flight saves, then close the stager it created and the lock.

        Idempotent.  Leaving ``async with`` calls it.

        :raises PersistError: a save failed and was not yet reported (names the step);
            everything is closed first.
        """
        await self._close(report=True)

    async def _close(self, *, report: bool) -> None:
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._state = "closing"
        try:
            if report:
                await self.wait()
            else:
                await self._drain()
            if report and self._remote_tier is not None:
                await self._remote_tier.drain()  # uploads of committed steps finish too
        finally:
            if self._remote_tier is not None:
                self._remote_tier.close()
            if not self.closed:  # a concurrent aclose() may have finished
                with anyio.CancelScope(shield=True):
                    if self._owns_stager:
                        await self._stager.aclose()
                    await self._release_lock()
                self._state = "closed"
            if not report:
                for job in self._take_unreported():
                    log.error("checkpoint step %d failed and was never reported: %s", job.step, job.error)

    async def _release_lock(self) -> None:
        """Close the lock, and the directory unless an abandoned save's cleanup (or its
        retention) still runs relative to it: ``__aexit__`` closes it once the task group is
        done."""
        await self._store.release_lock()
        if not self._jobs and not self._reserved:
            await self._close_dir()

    async def _close_dir(self) -> None:
        await self._store.close_dir()

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has finished."""
        return self._state == "closed"

    def _check_open(self, what: str) -> anyio.abc.TaskGroup:
        if self._state == "new" or self._task_group is None:
            raise ClosedError(f"{what}() needs an open Checkpointer: use `async with Checkpointer(...)`")
        if self._state != "open":
            raise ClosedError(f"{what}() called on a closed Checkpointer")
        return self._task_group

    # -- what is committed -----------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._store.directory

    @property
    def rank(self) -> int:
        """The rank whose files this Checkpointer writes and restores."""
        return self._store.rank

    def steps(self) -> list[int]:
        """This rank's committed steps, oldest first (known since entering; no I/O)."""
        return self._store.steps()

    def latest(self) -> int | None:
        """The newest committed step, or ``None``."""
        return self._store.latest()

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Steps staged and not yet committed or failed, in save order."""
        return tuple(self._jobs)

    def step_dir(self, step: int) -> Path:
        """The directory of ``step``'s files."""
        return self._store.step_dir(check_step(step))

    # -- saving --------------------------------------------------------------------------

    async def save(
        self, step: int, state_dict: Any, *, metrics: dict[str, float] | None = None
    ) -> SaveHandle:
        """Stage ``state_dict`` and return; writing, replication and the commit go on.

        ``metrics`` (short names to numbers, e.g. ``{"loss": 0.31}``) are what a ``best``
        retention policy ranks steps by; they travel in the step's remote commit object.

        Waits first while ``max_in_flight`` saves are persisting.  Once this returns, the
        caller may change its tensors: the checkpoint holds the state as of this call.

        With replication, every rank must make the same sequence of saves: a ``save`` that
        raised has not happened, so retry it.

        :returns: a handle to await the commit and read the stats.
        :raises PersistError: an earlier save failed (names its step); nothing was saved.
        :raises ConfigurationError: ``step`` is negative, not an int, in flight or committed.
        :raises ClosedError: the Checkpointer is not open.
        :raises UnsupportedInputError: the stager cannot stage ``state_dict``, or the
            replica format cannot store a value in it (names its key path; checked here, so
            nothing of it fails later), and the stager's other errors, e.g.
            :class:`CapacityError`.
        """
        task_group = self._check_open("save")
        self._raise_unreported()
        check_step(step)
        try:
            checked_metrics = check_metrics(metrics)
        except IntegrityError as exc:
            raise ConfigurationError(f"save(metrics=...): {exc}") from None
        if step in self._reserved or self._store.marker(step) is not None:
            state = "being saved" if step in self._reserved else "committed"
            raise ConfigurationError(f"step {step} is already {state} in {self.directory}")
        assert self._slots is not None
        started = time.perf_counter()
        self._reserved.add(step)
        handed_off = False
        try:
            await self._slots.acquire()
            try:
                job = await self._stage(step, state_dict, started)
                await self._start(task_group, job)
                handed_off = True
            finally:
                if not handed_off:
                    self._slots.release()
        finally:
            if not handed_off:
                self._unreserve(step)
        if checked_metrics:
            self._metrics[step] = checked_metrics
        self._emit("staged", job)
        return SaveHandle(job, self._remote_tier)

    async def _stage(self, step: int, state_dict: Any, started: float) -> Job:
        """Stage ``state_dict`` and lay it out: the part of a save its caller waits for."""
        assert self._persister is not None
        waited = time.perf_counter() - started
        stats: StageStats | None = None
        refilled: int | None = None
        planned: PlannedSource | None = None
        stager = self._stager
        if isinstance(stager, DefaultStager) and type(stager).stage is DefaultStager.stage:
            # This stage's own stats, not the latest's (a subclass that overrides stage() is
            # called through it), and the plan of a new structure's copy, which no one else
            # holds: laying it out needs no walk of it (see astage._format.layouts).
            staged, stats, planned = await stager.stage_planned(state_dict)
            # A copy it refilled in place, which it checked whole at its release, needs no
            # new check of its tensors.
            refilled = stats.copy if stats.refilled else None
        else:
            staged = await stager.stage(state_dict)
            stats = getattr(stager, "last_stats", None)
        checkpoint_id = uuid.uuid4().hex
        try:
            layout = await self._persister.lay_out(staged, step, checkpoint_id, refilled, planned)
        except BaseException:
            staged = planned = None  # given back by lay_out; the traceback keeps this frame
            raise
        del planned  # the layout holds it, dropped with the staged copy
        return Job(
            step=step,
            checkpoint_id=checkpoint_id,
            started=started,
            staging_seconds=time.perf_counter() - started,
            backpressure_seconds=waited,
            stage_stats=stats if isinstance(stats, StageStats) else None,
            previous=self._last_done,
            staged=staged,
            layout=layout,
        )

    async def _start(self, task_group: anyio.abc.TaskGroup, job: Job) -> None:
        """Hand a staged job to its background task, after the saves before it.

        Where the save runs in a worker thread, the thread starts here, before ``save()``
        returns (see :meth:`Persister.launch`); the task only waits for it and keeps the books.
        """
        persister = self._persister
        assert persister is not None
        previous_done, self._last_done = self._last_done, job.done
        job.before, self._last_job = self._last_job, job
        self._jobs[job.step] = job
        try:
            task_group.start_soon(self._persist, job, name=f"astage checkpoint step {job.step}")
        except BaseException:
            del self._jobs[job.step]
            self._last_done = previous_done
            self._last_job, job.before = job.before, None
            with anyio.CancelScope(shield=True):
                await persister.release_staged(job)
            raise
        if persister.threaded:
            try:
                persister.launch(job)
            except BaseException as exc:  # no thread to be had: the task reports the failure
                job.chain_error = exc if isinstance(exc, Exception) else RuntimeError(repr(exc))
                job.finished.set()
                if not isinstance(exc, Exception):
                    raise

    async def wait(self) -> None:
        """Wait until no save is in flight.

        :raises PersistError: a save failed and was not yet reported (names the step).
        """
        await self._drain()
        self._raise_unreported()

    async def _drain(self) -> None:
        while self._reserved:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    def _unreserve(self, step: int) -> None:
        self._reserved.discard(step)
        if not self._reserved and self._idle is not None:
            self._idle.set()
            self._idle = None

    def _take_unreported(self) -> list[Job]:
        jobs = [job for job in self._unreported if not job.reported]
        self._unreported.clear()
        for job in jobs:
            job.reported = True
        return jobs

    def _raise_unreported(self) -> None:
        jobs = self._take_unreported()
        if not jobs:
            return
        first = jobs[0].error
        assert first is not None
        if len(jobs) > 1:
            others = ", ".join(str(job.step) for job in jobs[1:])
            raise PersistError(f"{first} (also failed: step{'s' * (len(jobs) > 2)} {others})") from first
        raise first

    # -- the persisting task -------------------------------------------------------------

    async def _persist(self, job: Job) -> None:
        persister = self._persister
        assert persister is not None
        try:
            try:
                if job.threaded:
                    await self._finish_threaded(job, persister)
                else:
                    await self._write_and_commit(job, persister)
            except Exception as exc:  # reported to the caller, never into the task group
                if job.committed:  # a commit stands once its marker is durable
                    log.warning(
                        "step %d is committed, but what followed the commit failed: %s", job.step, exc
                    )
                else:
                    self._fail(job, exc)
            except BaseException as exc:
                drop_frames(exc)
                if not job.committed:
                    job.error = PersistError(
                        f"checkpoint step {job.step} was abandoned (cancelled); not committed"
                    )
                    job.reported = True
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    await persister.release_staged(job)
                    if job.written and not job.committed:
                        await persister.discard(job)
                job.before = None
                assert self._slots is not None
                # Retention runs after the slot is free, so that the next save() need not
                # wait for old steps' deletion; but at most one runs so: a save finishing
                # while one still runs retires before it frees its slot.  Committed steps
                # beyond ``keep`` are then at most ``max_in_flight + 1``, crash or not.
                retired = job.committed and self._retiring is not None and self._retiring.locked()
                try:
                    if retired:
                        await self._retire(job.step)
                finally:
                    self._slots.release()
                    del self._jobs[job.step]
            if job.committed and not retired:
                await self._retire(job.step)
        finally:
            job.done.set()
            self._unreserve(job.step)

    async def _finish_threaded(self, job: Job, persister: Persister) -> None:
        """Wait for ``job``'s worker thread (abandoning it if cancelled), then keep the books."""
        try:
            await job.finished.wait()
        except BaseException:
            persister.abandon(job)
            with anyio.CancelScope(shield=True):
                if not job.finished.is_set():
                    # An exchange in flight cannot be cancelled: it is broken, as an async
                    # one is when cancelled, so that the thread (and the peers) stop at once.
                    await anyio.to_thread.run_sync(persister.interrupt_replication)
                await job.finished.wait()  # the thread stops at its next step
            raise
        if job.chain_error is not None:
            error, job.chain_error = job.chain_error, None
            raise error
        assert job.marker is not None
        self._record_commit(job, job.marker)

    async def _write_and_commit(self, job: Job, persister: Persister) -> None:
        entry = await persister.write_and_replicate(job)
        await persister.release_staged(job)
        self._record_commit(job, await persister.commit(job, entry))

    def _record_commit(self, job: Job, marker: Marker) -> None:
        """Keep the books of a save whose marker is durable: index, stats, log, event."""
        assert job.durable_at is not None
        self._store.record(job.step, marker)
        job.stats = SaveStats(
            step=job.step,
            nbytes=job.nbytes,
            staging_seconds=job.staging_seconds,
            backpressure_seconds=job.backpressure_seconds,
            persist_seconds=job.persist_seconds,
            replicate_seconds=job.replicate_seconds,
            total_seconds=job.durable_at - job.started,
            stage=job.stage_stats,
            durable_at=job.durable_at,
        )
        self.last_stats = job.stats
        if self._remote_tier is not None:
            metrics = self._metrics.get(job.step, {})
            force = job.step in self._force_upload  # a save on preemption
            self._force_upload.discard(job.step)
            self._remote_tier.committed(job.step, marker, metrics, force=force, started=job.started)
        log.info(
            "committed step %d: %d bytes, caller blocked %.4fs, persisted in %.4fs (%.2f GB/s)",
            job.step,
            job.nbytes,
            job.staging_seconds,
            job.persist_seconds,
            job.stats.gbps,
        )
        self._emit("committed", job)

    async def _retire(self, just_committed: int) -> None:
        """Retention after a commit, one at a time (two saves' may be due together)."""
        if self._retiring is None:
            self._retiring = anyio.Lock()
        async with self._retiring:
            pinned = self._remote_tier.pinned() if self._remote_tier is not None else ()
            await self._store.retire(self._retention, just_committed, pinned, self._metrics)
            for step in set(self._metrics) - set(self._store.steps()) - self._reserved:
                del self._metrics[step]

    def _fail(self, job: Job, exc: Exception) -> None:
        self._force_upload.discard(job.step)
        drop_frames(exc)
        error = PersistError(f"checkpoint step {job.step} failed and was not committed: {exc}")
        error.__cause__ = exc
        job.error = error
        self._unreported.append(job)
        # One line, no traceback: the caller gets the error itself, traceback and all (next
        # save, wait or handle.wait); the log only says that it happened and why.
        log.error("checkpoint step %d failed and was not committed: %r", job.step, exc)
        self._emit("failed", job)

    def _emit(self, kind: EventKind, job: Job) -> None:
        if self._on_progress is None:
            return
        event = SaveEvent(
            kind=kind,
            step=job.step,
            checkpoint_id=job.checkpoint_id,
            elapsed_seconds=time.perf_counter() - job.started,
            stats=job.stats if kind == "committed" else None,
            error=job.error if kind == "failed" else None,
        )
        try:
            self._on_progress(event)
        except Exception:
            log.exception("the on_progress callback failed on %s of step %d", kind, job.step)

    def _emit_uploaded(self, step: int, checkpoint_id: str, started: float, stats: UploadStats) -> None:
        self.last_upload_stats = stats
        if self._on_progress is None:
            return
        elapsed = time.perf_counter() - started
        event = SaveEvent("uploaded", step, checkpoint_id, elapsed, upload=stats)
        try:
            self._on_progress(event)
        except Exception:
            log.exception("the on_progress callback failed on uploaded of step %d", step)

    # -- restoring -----------------------------------------------------------------------

    async def restore(
        self,
        step: int | None = None,
        *,
        collective: bool | None = None,
        on_read: OnRead | None = None,
        into: Any = None,
    ) -> Any:
        """Load the state_dict of ``step`` (default: the latest committed), tensors on the CPU,
        or into the caller's own tensors (``into``).

        **In place** (``into=state_dict``): the caller's tensors (CPU or accelerator) are
        filled, matched by key path and checked before any byte is written; the returned
        tree holds them, with new non-tensor leaves.  An exception that ends it early
        carries ``fill_report`` (:class:`~astage.FillReport`).  See ``docs/guides/restore_in_place.md``.

        **Collective** (``collective=True``; the default when ``replication`` is a
        :class:`~astage.ReplicationStager` and no ``fallback_dirs`` are given): every rank of
        the replication group calls ``restore`` at the same time; the ranks agree on the
        newest step that every rank can restore (or check ``step``), from its own files or
        from the replica its ring holder keeps, and every rank gets that step back.  A rank
        whose files are missing or corrupt receives its state from its holder over the
        process group, checksum-verified as it lands, and commits it locally again.  See
        :mod:`astage._checkpointer.collective_restore` and the replication guide.

        **Local** (otherwise): the local file is checked against its commit marker and its
        checksums.  If it is missing or corrupt, or the step is not committed here, the
        newest valid replica of this rank's ``step`` is used: from the replication object's
        ``fetch_replica`` if it has one, then from ``fallback_dirs`` (a shared file system).

        **Across tiers** (``remote=...``): a step the local tier lacks, or holds corrupt, is
        downloaded from the store, verified against its commit object and committed locally.

        :param on_read: called on the event loop as ``on_read(bytes_done, bytes_total)``
            while the body is read or received, from ``(0, total)`` up to
            ``(total, total)``; a copy refused and replaced by another starts again from 0.
            An exception it raises is logged, not propagated.  Restores that take over a
            second also log their progress at INFO on ``astage.checkpointer``.
        :raises ResourceError: nothing is committed, or the step is neither committed
            here nor found among the replicas.
        :raises IntegrityError: every copy found is corrupt or does not match (each named).
        :raises ClosedError: the Checkpointer is not open.
        :raises PeerTimeoutError: (collective) a peer did not take part within the timeout.
        :raises TransportError: (collective) a peer failed; the group is then broken.
        :raises ConfigurationError: ``collective=True`` without a ReplicationStager, or
            ``on_read`` is not callable.
        :raises DestinationMismatchError: (``into``) the checkpoint does not fit ``into``.
        """
        self._check_open("restore")
        if on_read is not None and not callable(on_read):
            raise ConfigurationError(f"on_read must be callable or None, not {type(on_read).__name__}")
        progress = ReadProgress(on_read)
        if into is None:
            loads = restore_loads(None, read_lanes(self._threads), self._store.limiter)
            return await self._restore(step, collective, progress, loads)
        # Pinned buffers on their way to a device stay under the staging cap, as a stage's do.
        cap = self._stager.options.max_staging_bytes if isinstance(self._stager, DefaultStager) else None
        return await self._restore_into(step, collective, progress, Destination(into, cap))

    async def _restore_into(
        self, step: int | None, collective: bool | None, progress: ReadProgress, destination: Destination
    ) -> Any:
        """:meth:`restore` into ``destination``, matched to each copy; its report on any exception."""
        try:
            loads = restore_loads(destination, read_lanes(self._threads), self._store.limiter)
            return await self._restore(step, collective, progress, loads)
        except BaseException as exc:
            await destination.annotate(exc)
            raise

    async def _restore(
        self, step: int | None, collective: bool | None, progress: ReadProgress, loads: RestoreLoads
    ) -> Any:
        """:meth:`restore`, routed: collective, or local (own file, then replicas)."""
        if collective is None or collective:
            if isinstance(self._replication, ReplicationStager) and (collective or not self._fallback_dirs):
                requested = None if step is None else check_step(step)
                if self._remote_tier is not None:  # the store's steps become local ones first
                    await heal_newest(self._remote_tier, self._store.index(), requested)
                return await collective_restore(
                    self._store, self._replication, requested, progress, self._drain, loads
                )
            if collective:
                raise ConfigurationError("restore(collective=True) needs replication=ReplicationStager(...)")
        if self._remote_tier is not None:
            return await self._restore_tiers(None if step is None else check_step(step), progress, loads)
        if step is None:
            step = self.latest()
            if step is None:
                raise ResourceError(f"no committed checkpoint of rank {self.rank} in {self.directory}")
        return await self._restore_one(check_step(step), progress, loads)

    async def _restore_one(self, step: int, progress: ReadProgress, loads: RestoreLoads) -> Any:
        """``step`` from this rank's own file, else a replica (see :func:`restore_local`)."""
        fetch = self._replication.fetch_replica if isinstance(self._replication, ReplicaSource) else None
        places = ReplicaPlaces(fetch, self._fallback_dirs, self._store.limiter, loads.file)
        load_own = functools.partial(self._store.load, step, on_read=progress.advance, load=loads.file)
        marker = self._store.marker(step)
        return await restore_local(step, marker, self.step_dir(step), self.rank, load_own, places, progress)

    async def _restore_tiers(self, step: int | None, progress: ReadProgress, loads: RestoreLoads) -> Any:
        """``step`` (default: the newest any tier has) from the local tier, else healed
        from the store (see :func:`restore_across_tiers`)."""
        assert self._remote_tier is not None
        restore_one = functools.partial(self._restore_one, progress=progress, loads=loads)
        where = f"{self.directory} or on {self._remote_tier.client.url}"
        return await restore_across_tiers(self._remote_tier, self._store.index(), step, restore_one, where)

    async def wait_uploaded(self, step: int) -> UploadStats | None:
        """Wait until ``step`` (saved before) is committed and on the remote tier.

        :returns: its upload's stats (this rank's commit object is durable on the store);
            ``None`` if the step was not picked for upload (``Remote(every=...)``).
        :raises ConfigurationError: there is no remote tier.
        :raises RemoteError: the upload failed.
        """
        self._check_open("wait_uploaded")
        if self._remote_tier is None:
            raise ConfigurationError("wait_uploaded() needs Checkpointer(remote=...)")
        job = self._jobs.get(check_step(step))
        if job is not None:
            await job.done.wait()
            if job.error is not None:
                job.reported = True
                raise job.error
        return await self._remote_tier.wait(step)

    async def save_now_and_upload(
        self, step: int, state_dict: Any, *, deadline: float, metrics: dict[str, float] | None = None
    ) -> UploadStats:
        """Save ``step`` now and wait until it is on the store: the save for a preemption
        notice (SIGTERM).  The step is uploaded whatever ``Remote(every=...)`` says, after
        the uploads queued before it.

        :param deadline: seconds from now for the whole of it (staging, commit, upload).
        :raises TimeoutError: the deadline passed first (the save and upload go on).
        :raises ConfigurationError: there is no remote tier.
        :raises PersistError: the save failed.
        :raises RemoteError: the upload failed.
        """
        if self._remote_tier is None:
            raise ConfigurationError("save_now_and_upload() needs Checkpointer(remote=...)")
        with anyio.fail_after(deadline):
            self._force_upload.add(step)  # read at its commit, which may come before save() returns
            try:
                handle = await self.save(step, state_dict, metrics=metrics)
            except BaseException:
                self._force_upload.discard(step)
                raise
            stats = await handle.uploaded()
        assert stats is not None
        return stats
