"""The background half of a save: from the staged copy to a durable, committed checkpoint.

Once ``Checkpointer.save`` has staged a state_dict, one :class:`Job` is carried through a
:class:`Persister`: the staged copy is encoded and checksummed once, written durably as this
rank's file while it is handed to the replication object (in save order), and, once both
are done, committed by writing the marker (:mod:`astage._files.markers`).  Replication is called
for every staged save, even one whose local write failed: ranks that make the same sequence
of saves make the same sequence of replication calls, so the peers' exchanges stay in step.
Every staged copy goes back to its stager, and a failed save's file is removed.

Two paths.  Without replication, or with a :class:`~astage.ReplicationStager` on a gloo
group, the whole half runs in order in a daemon thread that ``save()`` starts before it
returns (:meth:`Persister.launch`): no step of it waits for a turn of the event loop, so a
program that holds the loop with a synchronous training step finds its save durable when
the step ends.  The loop only hears of it (events posted to it) and keeps the books
(releasing the staged copy, the index, retention).  A replication object that needs the
loop (its own ``replicate_staged``, NCCL) keeps the loop path
(:meth:`Persister.write_and_replicate`), whose steps run in worker threads in turn."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import anyio
import sniffio

from .._files.directory import step_dir_name
from .._files.durable import blocking_io, write_checkpoint_file, write_checkpoint_file_blocking
from .._files.markers import FileEntry, Marker, encoded_storages_crc32c
from .._files.retention import discard_uncommitted
from .._files.steps import StepStore
from .._format.codec import Encoded, FileLayout
from .._format.layouts import LayoutCache, PendingLayout, PlannedLayout
from .._replication.stager import ReplicationStager
from .._staging.plan import PlannedSource
from .._staging.stager import AsyncStager, StageStats
from .._util.errors import AstageError
from .._util.frames import drop_frames, frames_dropped
from .._util.threads import run_sync
from .interfaces import EventKind, Replicator, SaveStats

# The Checkpointer's logger: splitting the module changes nothing users configure.
log = logging.getLogger("astage.checkpointer")


@dataclasses.dataclass(eq=False)
class Job:
    """One save from staging to commit (or failure)."""

    step: int
    checkpoint_id: str
    started: float
    staging_seconds: float
    backpressure_seconds: float
    stage_stats: StageStats | None
    previous: anyio.Event | None
    staged: Any = None
    layout: FileLayout | PendingLayout | PlannedLayout | None = None
    """Made in full or from the stager's plan (kept for later saves in the background), or
    a kept one re-used."""
    entry: FileEntry | None = None
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    written: bool = False
    committed: bool = False
    nbytes: int = 0
    persist_seconds: float = 0.0
    replicate_seconds: float | None = None
    stats: SaveStats | None = None
    error: AstageError | None = None
    reported: bool = False
    before: Job | None = None
    """The save made just before this one, until this one has waited for it (in order)."""
    threaded: bool = False
    """Whether a worker thread carries this save (see :meth:`Persister.launch`)."""
    finished: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    """Set on the event loop once the worker thread has returned."""
    chain_done: bool = False
    """Set by the worker thread as it ends (under the persister's condition)."""
    abandoned: bool = False
    """Set on the event loop when the save is cancelled: the worker stops at its next step."""
    chain_error: Exception | None = None
    marker: Marker | None = None
    durable_at: float | None = None
    """``time.perf_counter()`` when the marker (and so the whole save) became durable."""


def _started(work: Callable[[], object] | None, name: str) -> threading.Thread | None:
    """``work`` running on a new daemon thread (``None``: nothing to run)."""
    if work is None:
        return None
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    return thread


class Abandoned(Exception):
    """A save's worker thread stopped because the save was cancelled (never reaches a user)."""


def _poster() -> Callable[[Callable[[], object]], None]:
    """A function that queues a call on this event loop from any thread, without waiting.

    Called on the loop; what it returns may be called from any thread.  Once the loop has
    ended the call is dropped: nobody is left to hear of it.
    """
    if sniffio.current_async_library() == "trio":
        import trio

        queue: Callable[..., object] = trio.lowlevel.current_trio_token().run_sync_soon
    else:
        queue = asyncio.get_running_loop().call_soon_threadsafe

    def post(fn: Callable[[], object]) -> None:
        try:
            queue(fn)
        except RuntimeError:  # the loop has ended (trio: RunFinishedError)
            log.debug("the event loop ended before a save's worker thread could report to it")

    return post


@runtime_checkable
class _Releasing(Protocol):
    async def release(self, staged: Any) -> None: ...


def _blocking_replicator(replication: Replicator | None) -> ReplicationStager | None:
    """``replication`` if a save's worker thread can drive it without the event loop."""
    # Only astage's own replicate_staged: a subclass that overrides it is called through it.
    if (
        isinstance(replication, ReplicationStager)
        and type(replication).replicate_staged is ReplicationStager.replicate_staged
        and replication.can_replicate_blocking()
    ):
        return replication
    return None


def _takes_encoded(replication: Replicator) -> bool:
    """Whether ``replication`` declares that its ``replicate_staged`` takes ``encoded=``.

    The declaration (see ``Replicator``) is ``accepts_encoded = True`` in the body of the
    class that defines ``replicate_staged``: a subclass that overrides the method without
    declaring it again is called the plain way, whatever its parent declared.
    """
    for cls in type(replication).__mro__:
        if "replicate_staged" in vars(cls):
            return vars(cls).get("accepts_encoded", False) is True
    return False


class Persister:
    """Carries jobs of one Checkpointer (directory, rank) from staged copy to commit.

    :param emit: reports a job's progress (``persisted``, ``replicated``).
    """

    def __init__(
        self,
        store: StepStore,
        stager: AsyncStager,
        replication: Replicator | None,
        emit: Callable[[EventKind, Job], None],
    ) -> None:
        self._store = store
        self._stager = stager
        self._replication = replication
        self._share_encoded = replication is not None and _takes_encoded(replication)
        self._limiter = store.limiter
        self._emit = emit
        self._layouts = LayoutCache(store.rank)
        # Save order among the worker threads: each waits for the one before it to end.
        self._order = threading.Condition()
        self._blocking_replication = _blocking_replicator(replication)
        self.threaded = replication is None or self._blocking_replication is not None
        """Whether saves run whole in worker threads (:meth:`launch`); else on the loop (a
        replication object that needs the loop: its own ``replicate_staged``, or NCCL)."""

    async def lay_out(
        self,
        staged: Any,
        step: int,
        checkpoint_id: str,
        refilled: int | None = None,
        planned: PlannedSource | None = None,
    ) -> FileLayout | PendingLayout | PlannedLayout:
        """Check the staged copy against the replica format and lay it out, before ``save()``
        returns: what the background task could not write is refused here, with its key
        path.  A copy of a structure laid out before re-uses that layout once checked
        against it (:mod:`astage._format.layouts`); only the checksums are left for the
        background.  On any error the copy goes back to the stager.

        """
        try:
            return await self._layouts.lay_out(
                staged, step=step, checkpoint_id=checkpoint_id, refilled=refilled, planned=planned
            )
        except BaseException as exc:
            drop_frames(exc)
            planned = None
            with anyio.CancelScope(shield=True):
                await self.give_back(staged, step)
            # This frame stays in the error's traceback: it must not keep the copy it gave
            # back, which the stager may hand out again (a released copy is refilled).
            staged = None
            raise

    # -- the worker-thread path: no turn of the event loop between the steps ---------------

    def launch(self, job: Job) -> None:
        """Start ``job``'s background half in a thread of its own, now (on the event loop).

        Started before ``save()`` returns, so that it needs no turn of the loop even to
        begin: a program that runs its training step on the loop right after ``save()``
        finds the save durable at its next ``await``.  The thread is a daemon: a process
        never waits for it to exit.  It ends by posting ``job.finished.set`` to the loop.
        """
        post = _poster()
        job.threaded = True
        thread = threading.Thread(
            target=self._run_chain, args=(job, post), name=f"astage save step {job.step}", daemon=True
        )
        thread.start()

    def abandon(self, job: Job) -> None:
        """Tell ``job``'s worker thread to stop at its next step (the save was cancelled)."""
        with self._order:
            job.abandoned = True
            self._order.notify_all()

    def _run_chain(self, job: Job, post: Callable[[Callable[[], object]], None]) -> None:
        try:
            self._chain(job, post)
        except Exception as exc:
            drop_frames(exc)  # its frames view the staged buffers
            job.chain_error = exc
        finally:
            with self._order:
                job.chain_done = True
                job.before = None
                self._order.notify_all()
            post(job.finished.set)

    def _check(self, job: Job) -> None:
        if job.abandoned:
            raise Abandoned(f"checkpoint step {job.step} was abandoned")

    def _between(self, job: Job) -> None:
        """Between two slices of Python work: stop if abandoned, and let the loop thread
        have the GIL if it waits for it (else it would wait a whole switch interval)."""
        self._check(job)
        time.sleep(0)

    def _chain(self, job: Job, post: Callable[[Callable[[], object]], None]) -> None:
        """The whole background half, in order, on this worker thread: complete the layout,
        encode, write the local file durably, wait for the save before (save order), and
        write the marker.  ``job.committed`` once the marker is durable."""
        begin = time.perf_counter()
        layout, job.layout = job.layout, None
        assert layout is not None
        copy = job.stage_stats.copy if job.stage_stats is not None else None
        layout, keep = self._layouts.complete_blocking(
            job.staged, layout, copy=copy, between=functools.partial(self._between, job)
        )
        self._check(job)
        encoded: Encoded | None = layout.encode()
        del layout
        assert encoded is not None
        replication = self._blocking_replication
        box = [encoded]  # the one reference: it views the staged buffers, which go back
        del encoded
        # Keeping a new structure's layout for the saves to come is Python, and writing
        # mostly waits on the disk: the one runs beside the other, not before it.
        keeper = _started(keep, f"astage keep layout of step {job.step}")
        try:
            if replication is None:
                entry = self._write_blocking(job, box.pop(), begin, post)
                self._wait_turn(job)  # commit in save order
            else:
                entry = self._write_and_replicate_blocking(job, box, begin, post, replication)
        finally:
            if keeper is not None:
                keeper.join()  # it reads the staged copy, which goes back after this
        self._check(job)
        job.marker = self._commit_blocking(job, entry)

    def _write_and_replicate_blocking(
        self,
        job: Job,
        box: list[Encoded],
        begin: float,
        post: Callable[[Callable[[], object]], None],
        replication: ReplicationStager,
    ) -> FileEntry:
        """Write the local file on a helper thread while this one replicates, in save order."""
        encoded: Encoded | None = box.pop()
        failures: dict[str, Exception] = {}
        written: list[FileEntry] = []

        def write_local(box: list[Encoded]) -> None:
            try:
                written.append(self._write_blocking(job, box.pop(), begin, post))
            except Exception as exc:
                drop_frames(exc)
                failures["local"] = exc

        writer = threading.Thread(
            target=write_local, args=([encoded],), name=f"astage write step {job.step}", daemon=True
        )
        writer.start()
        try:
            self._wait_turn(job)  # replicate (and commit) in save order
            self._check(job)
            replicate_begin = time.perf_counter()
            try:
                assert encoded is not None
                replication.replicate_blocking(
                    step=job.step, checkpoint_id=job.checkpoint_id, encoded=encoded
                )
            except Exception as exc:
                drop_frames(exc)
                failures["replication"] = exc
            else:
                job.replicate_seconds = time.perf_counter() - replicate_begin
                post(functools.partial(self._emit, "replicated", job))
        finally:
            encoded = None
            writer.join()
        if "local" in failures and "replication" in failures:
            log.error("replicating step %d failed as well: %s", job.step, failures["replication"])
        if failures:
            raise failures.get("local") or failures["replication"]
        return written[0]

    def interrupt_replication(self) -> None:
        """Break a worker thread's replication exchange in flight (blocking, ~1 ms)."""
        if self._blocking_replication is not None:
            self._blocking_replication.interrupt()

    def _write_blocking(
        self, job: Job, encoded: Encoded, begin: float, post: Callable[[Callable[[], object]], None]
    ) -> FileEntry:
        """Write this rank's file durably (not yet committed), on the calling thread."""
        try:
            entry = FileEntry(self._store.data_name, encoded.total_nbytes, encoded_storages_crc32c(encoded))
            job.written = True  # from here on, a file may exist that must not outlive a failure
            write_checkpoint_file_blocking(
                self._store.data_path(job.step),
                encoded,
                open_dir=self._store.step_dir_opener(job.step),
                check=functools.partial(self._check, job),
            )
        finally:
            del encoded  # it views the staged buffers, which go back to the stager
        # The step directory's entry is durable before anything in it is committed.
        os.fsync(self._store.dir_fd)
        job.nbytes = entry.nbytes
        job.persist_seconds = time.perf_counter() - begin
        post(functools.partial(self._emit, "persisted", job))
        return entry

    def _wait_turn(self, job: Job) -> None:
        """Wait until the save before ``job`` has ended (committed or not), or ``job`` is abandoned."""
        before = job.before
        with self._order:
            self._order.wait_for(lambda: job.abandoned or before is None or before.chain_done)
            job.before = None

    def _commit_blocking(self, job: Job, entry: FileEntry) -> Marker:
        """Write the marker durably: once renamed, the step is committed."""
        marker = Marker(job.step, self._store.rank, job.checkpoint_id, time.time(), (entry,))
        write_checkpoint_file_blocking(
            self._store.marker_path(job.step),
            [marker.to_json()],
            open_dir=self._store.step_dir_opener(job.step),
        )
        # The step directory's entry is durable before anything in it is committed.
        os.fsync(self._store.dir_fd)
        job.durable_at = time.perf_counter()
        job.committed = True
        return marker

    # -- the event-loop path (a replication object that needs the loop) --------------------

    async def write_and_replicate(self, job: Job) -> FileEntry:
        """Encode once, then write the local file durably while replicating, in save order.

        :returns: the local file's entry for the marker.
        :raises Exception: the local write's failure, else the replication's.
        """
        failures: dict[str, Exception] = {}
        begin = time.perf_counter()
        layout, job.layout = job.layout, None
        assert layout is not None
        # A layout made in full is kept now that the caller is gone, for the saves to come.
        copy = job.stage_stats.copy if job.stage_stats is not None else None
        layout = await self._layouts.finish(job.staged, layout, copy=copy)
        # Encoded and checksummed once, for the local file and (relabelled) the replica.
        # It views the staged buffers, which go back to the stager: dropped before that.
        encoded: Encoded | None = None
        try:
            with frames_dropped():
                encoded = await run_sync(layout.encode, limiter=self._limiter)
        except Exception as exc:
            failures["local"] = exc
        del layout

        async def write_local(box: list[Encoded]) -> None:
            try:
                with frames_dropped():
                    job.entry = await self._write_local(job, box.pop(), begin)
            except Exception as exc:
                failures["local"] = exc

        try:
            async with anyio.create_task_group() as tg:
                if encoded is not None:
                    tg.start_soon(write_local, [encoded])
                if job.previous is not None:
                    await job.previous.wait()  # replicate and commit in save order
                shared = {"encoded": encoded} if self._share_encoded and encoded is not None else {}
                encoded = None
                await self._replicate(job, shared, failures)
        finally:
            encoded = None
        if "local" in failures and "replication" in failures:
            log.error("replicating step %d failed as well: %s", job.step, failures["replication"])
        if failures:
            raise failures.get("local") or failures["replication"]
        assert job.entry is not None
        return job.entry

    async def _replicate(self, job: Job, shared: dict[str, Encoded], failures: dict[str, Exception]) -> None:
        """Hand the staged copy (and, shared, its encoding) to the replication object, if any."""
        if self._replication is None:
            return
        begin = time.perf_counter()
        try:
            with frames_dropped():
                await self._replication.replicate_staged(
                    job.staged, step=job.step, checkpoint_id=job.checkpoint_id, **shared
                )
        except Exception as exc:
            failures["replication"] = exc
        else:
            job.replicate_seconds = time.perf_counter() - begin
            self._emit("replicated", job)
        finally:
            shared.clear()

    async def _write_local(self, job: Job, encoded: Encoded, begin: float) -> FileEntry:
        """Write this rank's file durably (not yet committed)."""
        try:
            entry = FileEntry(self._store.data_name, encoded.total_nbytes, encoded_storages_crc32c(encoded))
            job.written = True  # from here on, a file may exist that must not outlive a failure
            await write_checkpoint_file(
                self._store.data_path(job.step),
                encoded,
                limiter=self._limiter,
                open_dir=self._store.step_dir_opener(job.step),
            )
            # The step directory's entry is durable before anything in it is committed.
            await blocking_io(os.fsync, self._store.dir_fd, limiter=self._limiter)
        finally:
            del encoded  # it views the staged buffers, which go back to the stager
        job.nbytes = entry.nbytes
        job.persist_seconds = time.perf_counter() - begin
        self._emit("persisted", job)
        return entry

    async def commit(self, job: Job, entry: FileEntry) -> Marker:
        """Write the marker durably (shielded: small, and once renamed it is committed).

        ``job.committed`` is set once it is; the caller records the marker at once.
        """
        marker = Marker(job.step, self._store.rank, job.checkpoint_id, time.time(), (entry,))
        marker_path = self._store.marker_path(job.step)
        with anyio.CancelScope(shield=True):
            await write_checkpoint_file(
                marker_path,
                [marker.to_json()],
                limiter=self._limiter,
                open_dir=self._store.step_dir_opener(job.step),
            )
            # The step directory's entry is durable before anything in it is committed.
            await blocking_io(os.fsync, self._store.dir_fd, limiter=self._limiter)
            job.durable_at = time.perf_counter()
            job.committed = True
        return marker

    async def release_staged(self, job: Job) -> None:
        """Give the job's staged copy back to the stager (once)."""
        staged, job.staged, job.layout = job.staged, None, None
        await self.give_back(staged, job.step)

    async def give_back(self, staged: Any, step: int) -> None:
        """Release ``staged`` to a stager that takes copies back; failures are only logged."""
        if staged is not None and isinstance(self._stager, _Releasing):
            try:
                await self._stager.release(staged)
            except Exception:
                log.exception("releasing the staged copy of step %d failed", step)

    async def discard(self, job: Job) -> None:
        """Remove an uncommitted job's file (what cannot be removed is swept at the next start)."""
        try:
            await blocking_io(
                discard_uncommitted,
                self._store.dir_fd,
                step_dir_name(job.step),
                self._store.data_name,
                limiter=self._limiter,
            )
        except OSError as exc:
            log.warning(
                "cannot remove the uncommitted files of step %d (swept at the next start): %s", job.step, exc
            )
