"""Interop with ``torch.distributed.checkpoint`` (DCP): astage staging under DCP's writers.

Two entry points:

* :class:`StagerAdapter` gives any astage stager the synchronous face that
  ``torch.distributed.checkpoint.async_save(..., async_stager=...)`` expects: ``stage()``
  returns a ``concurrent.futures.Future`` at once, while the astage stager runs on an event
  loop in a background thread that the adapter owns (an anyio blocking portal, started by
  the first ``stage()`` and stopped by ``close()``, or at the latest when the adapter is
  collected or the interpreter exits).
* :func:`async_save` is the native path for async code: it stages on the caller's own event
  loop (asyncio or trio), returns once the copy is training-safe, and runs ``dcp.save`` of
  the staged copy in a thread; the returned :class:`AsyncSaveHandle` awaits that upload
  without blocking the loop.  It needs only ``dcp.save``, the most stable part of DCP.

Invariants:

* A staged copy handed to DCP is never released early: the only references to it are
  DCP's, and the stager's pool takes its buffers back once DCP has dropped them.
* Errors astage raises on purpose pass through unchanged; every other failure of a DCP save
  surfaces as :class:`~astage.PersistError` whose ``__cause__`` is torch's exception.
* ``StagerAdapter.close()`` is idempotent, waits for stages in flight and always stops the
  portal thread.
* Nothing here keeps the interpreter from exiting, closed or not: the portal's thread is a
  daemon, and an adapter left open is closed by an exit hook while that thread still runs
  (a portal torn down later, when the interpreter finalizes its objects, waited for ever
  on a thread that no longer runs).  Only the upload thread of :func:`async_save` delays the
  exit, until the checkpoint it writes is complete, as torch's own executor does.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any, Self

import anyio
import torch
import torch.distributed as dist
from anyio.from_thread import BlockingPortal
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager as TorchAsyncStager
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter

from ._staging.events import wait_event
from ._staging.options import accelerator_available
from ._staging.stager import AsyncStager, DefaultStager
from ._util.errors import (
    AstageError,
    ClosedError,
    ConfigurationError,
    PersistError,
    UnsupportedInputError,
    describe,
)

__all__ = ["AsyncSaveHandle", "StagerAdapter", "async_save"]

log = logging.getLogger(__name__)

StateDict = dict[str, Any]
CheckpointId = str | os.PathLike[str]

UPLOAD_POLL_MAX_SECONDS = 0.02
"""Longest pause between two checks of a running upload (bounds the added latency)."""


class StagerAdapter(TorchAsyncStager):
    """Use an astage stager as ``async_stager=`` of ``torch.distributed.checkpoint.async_save``.

    ::

        with astage.dcp.StagerAdapter(astage.DefaultStager()) as adapter:
            response = dcp.async_save(state_dict, checkpoint_id=path, async_stager=adapter)
            response.staging_completion.result()   # training may mutate its tensors now
            ...
            response.upload_completion.result()

    Because ``stage()`` returns a future, DCP returns an ``AsyncSaveResponse``; this needs a
    torch whose ``async_save`` accepts a future from ``stage()`` (2.13 does).
    The stager runs on the adapter's own event loop thread and must not be used from any
    other loop while the adapter has it.  Where an accelerator is present, each stage runs
    on the device and stream that were current on the thread that called ``stage()``.
    Thread-safe; call :meth:`close` (or leave the ``with`` block) after the last save.  An
    adapter left open never keeps the interpreter from exiting: it is closed when it is
    collected, or at exit (cancelling a stage nobody waits for any more).

    A staging error reaches ``upload_completion``.  torch's ``async_save`` (as of 2.13) reports
    ``staging_completion`` as successful when the staging future had already failed by the
    time ``async_save`` looked at it, so check ``upload_completion`` for errors.

    :param stager: the astage stager; ``None`` for a :class:`~astage.DefaultStager`.
    :param close_stager: whether :meth:`close` closes the stager too (always true for the
        default one).
    :raises ConfigurationError: ``stager`` is not an astage stager, or ``close_stager`` not a bool.
    """

    def __init__(self, stager: AsyncStager | None = None, *, close_stager: bool = True) -> None:
        if stager is not None and not isinstance(stager, AsyncStager):
            raise ConfigurationError(
                f"StagerAdapter needs an astage stager (async stage() and aclose()), "
                f"got {type(stager).__qualname__}"
            )
        if not isinstance(close_stager, bool):
            raise ConfigurationError(f"close_stager must be a bool, got {close_stager!r}")
        self._stager: AsyncStager = stager if stager is not None else DefaultStager()
        self._close_stager = close_stager or stager is None
        self._lock = threading.Lock()
        self._loop: _LoopThread | None = None
        # Closes an adapter left open when it is collected or the interpreter exits.
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._pending: set[concurrent.futures.Future[StateDict]] = set()
        self._closed = False

    @property
    def stager(self) -> AsyncStager:
        """The astage stager this adapter drives."""
        return self._stager

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def stage(self, state_dict: StateDict) -> concurrent.futures.Future[StateDict]:
        """Start staging ``state_dict`` and return a future of the staged copy.

        The source must not change until the future is done (DCP's ``staging_completion``).

        :raises UnsupportedInputError: ``state_dict`` is not a dict with ``str`` keys (the
            future carries any error the stager raises later).
        :raises ClosedError: the adapter was closed.
        """
        _check_state_dict(state_dict)
        # The portal thread has its own current device and stream; copy the caller's.
        stream = torch.accelerator.current_stream() if accelerator_available() else None
        with self._lock:
            if self._closed:
                raise ClosedError("stage() called on a closed StagerAdapter")
            future = self._start_portal().start_task_soon(_stage, self._stager, state_dict, stream)
            self._pending.add(future)
        future.add_done_callback(self._settled)
        return future

    def _start_portal(self) -> BlockingPortal:
        if self._loop is None:
            self._loop = _LoopThread()
            # The hook holds what it closes, never the adapter (or it would never be collected).
            owned = self._stager if self._close_stager else None
            self._finalizer = weakref.finalize(self, _abandon, self._loop, owned, self._pending)
        return self._loop.portal

    def _settled(self, future: concurrent.futures.Future[StateDict]) -> None:
        # Forget finished stages at once: holding their futures would keep staged copies
        # (and their buffers) alive after DCP has written them.
        with self._lock:
            self._pending.discard(future)

    def synchronize_staging(self) -> None:
        """Block until every stage in flight has finished.

        :raises AstageError: a stage in flight failed (the first such error).
        """
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.result()

    def close(self) -> None:
        """Wait for stages in flight, close the stager if owned, stop the thread; idempotent.

        Blocks the calling thread: from async code, run it in a worker thread.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._close_stager:
                self._start_portal()
            loop, finalizer = self._loop, self._finalizer
            self._loop = self._finalizer = None
        if loop is None:
            return
        if finalizer is not None:
            finalizer.detach()
        try:
            if self._close_stager:
                loop.portal.call(self._stager.aclose)
        finally:
            loop.stop(cancel_remaining=False)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def _stage(stager: AsyncStager, state_dict: StateDict, stream: torch.Stream | None) -> StateDict:
    # A function, not a method: a task on the loop thread must not keep the adapter alive.
    if stream is not None:
        torch.accelerator.set_stream(stream)
    staged: StateDict = await stager.stage(state_dict)
    return staged


class _LoopThread:
    """An anyio event loop (asyncio) in a daemon thread, entered through a blocking portal.

    A daemon, unlike a non-daemon thread, cannot hold the interpreter's exit; the worker
    threads its loop starts inherit that.  anyio's ``start_blocking_portal`` also runs a
    daemon thread, but its stop lives in a generator that, left open, the interpreter closed
    only while finalizing, when that thread no longer ran: the exit hung for ever.
    """

    def __init__(self) -> None:
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="astage-dcp-stager", daemon=True)
        self.thread.start()
        self.portal = ready.result()

    @staticmethod
    def _run(ready: concurrent.futures.Future[BlockingPortal]) -> None:
        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        try:
            anyio.run(serve)
        except BaseException as exc:  # handed to the thread that waits for the portal
            if not ready.done():
                ready.set_exception(exc)
            else:
                log.error("the StagerAdapter's event loop failed: %s", describe(exc))

    def stop(self, *, cancel_remaining: bool) -> None:
        """Stop the loop (cancelling its tasks, or after them) and wait for its thread."""
        with contextlib.suppress(RuntimeError):  # stopped already
            self.portal.call(self.portal.stop, cancel_remaining)
        self.thread.join()


def _abandon(
    loop: _LoopThread, stager: AsyncStager | None, pending: set[concurrent.futures.Future[StateDict]]
) -> None:
    """Close an adapter nobody closed: it was collected, or the interpreter is exiting.

    At exit this runs before daemon threads stop and after every other thread has ended
    (torch's upload threads included), so nobody waits for a stage still in flight: it is
    cancelled.  A collection may run on the loop's own thread, which cannot wait for
    itself: another thread closes it then.
    """
    if threading.current_thread() is loop.thread:
        helper = threading.Thread(
            target=_abandon, args=(loop, stager, pending), name="astage-dcp-close", daemon=True
        )
        helper.start()
        return
    for future in list(pending):
        future.cancel()
    try:
        if stager is not None:
            loop.portal.call(stager.aclose)
    except Exception as exc:  # nobody to raise to
        log.warning("closing the stager of an unclosed StagerAdapter failed: %s", describe(exc))
    finally:
        loop.stop(cancel_remaining=True)


class AsyncSaveHandle:
    """A DCP save whose staging is done and whose upload may still be running.

    Returned by :func:`async_save`.  Dropping it does not stop the upload.

    :ivar checkpoint_id: where the checkpoint is written (``None``: the writer decides).
    :ivar staging_seconds: how long staging kept the caller waiting.
    """

    def __init__(
        self,
        future: concurrent.futures.Future[Metadata],
        *,
        checkpoint_id: CheckpointId | None,
        staging_seconds: float,
    ) -> None:
        self._future = future
        self.checkpoint_id = checkpoint_id
        self.staging_seconds = staging_seconds

    @property
    def future(self) -> concurrent.futures.Future[Metadata]:
        """The upload as a ``concurrent.futures.Future`` (for synchronous code)."""
        return self._future

    def done(self) -> bool:
        """Whether the upload has finished, successfully or not."""
        return self._future.done()

    async def wait(self) -> Metadata:
        """Wait for the upload without blocking the event loop; cancelling leaves it running.

        :returns: DCP's metadata of the written checkpoint.
        :raises PersistError: DCP failed to write the checkpoint (``__cause__`` is torch's).
        """
        await wait_event(_Done(self._future), max_delay=UPLOAD_POLL_MAX_SECONDS)
        return self._future.result()

    def __repr__(self) -> str:
        state = "done" if self.done() else "uploading"
        return f"<AsyncSaveHandle {self.checkpoint_id!r} {state}>"


class _Done:
    """A future seen as a queryable event, so :func:`wait_event` can poll it."""

    def __init__(self, future: concurrent.futures.Future[Any]) -> None:
        self._future = future

    def query(self) -> bool:
        return self._future.done()


async def async_save(
    state_dict: Mapping[str, Any],
    *,
    checkpoint_id: CheckpointId | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: dist.ProcessGroup | None = None,
    stager: AsyncStager | None = None,
    no_dist: bool = False,
) -> AsyncSaveHandle:
    """Stage ``state_dict`` on this event loop, then write it with DCP in a thread.

    Returns as soon as the staged copy is training-safe; ``await handle.wait()`` waits for
    the write.  ``Stateful`` values are replaced by their ``state_dict()`` first, as DCP does.
    The write runs DCP's collectives on ``process_group`` (the default group if ``None``)
    from its own thread: in a multi-rank job, wait for one save before starting the next
    and keep other collectives off that group meanwhile (e.g. a dedicated gloo group).

    :param checkpoint_id: the checkpoint's directory (or the writer's key).
    :param storage_writer: a DCP writer; inferred from ``checkpoint_id`` if ``None``.
    :param planner: a DCP save planner; DCP's default if ``None``.
    :param process_group: the group that saves together; ``None``: the default group.
    :param stager: the astage stager to stage with (reuses its buffers across saves);
        ``None`` stages with a fresh :class:`~astage.DefaultStager` for this save only.
    :param no_dist: save as a single process even if ``torch.distributed`` is initialized.
    :returns: a handle on the running upload.
    :raises UnsupportedInputError: ``state_dict`` is not a dict with ``str`` keys, or the
        stager cannot stage a value in it.
    :raises ConfigurationError: neither ``checkpoint_id`` nor ``storage_writer`` is given, or
        an argument has the wrong type, or ``process_group`` cannot be used for DCP.
    :raises ClosedError: ``stager`` was closed.
    """
    _check_state_dict(state_dict)
    _check_save_arguments(checkpoint_id, storage_writer, planner, process_group, stager, no_dist)
    plain = {
        key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()
    }
    started = time.perf_counter()
    if stager is None:
        async with DefaultStager() as own:
            staged: StateDict = await own.stage(plain)
    else:
        staged = await stager.stage(plain)
    staging_seconds = time.perf_counter() - started
    future = _start_upload(
        staged,
        checkpoint_id=checkpoint_id,
        storage_writer=storage_writer,
        planner=planner,
        process_group=process_group,
        no_dist=no_dist,
    )
    return AsyncSaveHandle(future, checkpoint_id=checkpoint_id, staging_seconds=staging_seconds)


def _start_upload(staged: StateDict, **save_kwargs: Any) -> concurrent.futures.Future[Metadata]:
    """Run :func:`_save` in a fresh thread; the future completes after the copy is dropped."""
    future: concurrent.futures.Future[Metadata] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    # The thread holds the only reference to the staged copy and lets go of it before the
    # future completes, so a caller who awaited the upload finds the buffers reusable.
    box = [staged]
    del staged

    def upload() -> None:
        try:
            metadata = _save(box.pop(), **save_kwargs)
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(metadata)

    # Not a daemon: the interpreter waits for a checkpoint being written before it exits.
    threading.Thread(target=upload, name="astage-dcp-upload").start()
    return future


def _save(staged: StateDict, *, checkpoint_id: CheckpointId | None, **save_kwargs: Any) -> Metadata:
    """``dcp.save`` with torch's failures translated to :class:`PersistError`."""
    try:
        metadata: Metadata = dcp_save(staged, checkpoint_id=checkpoint_id, **save_kwargs)
        return metadata
    except AstageError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        where = f" to {os.fspath(checkpoint_id)!r}" if checkpoint_id is not None else ""
        why = _describe_failures(exc)
        raise PersistError(f"torch.distributed.checkpoint.save{where} failed: {why}") from exc


def _describe_failures(exc: BaseException) -> str:
    """One line per failure; DCP's own message carries a traceback per rank."""
    if isinstance(exc, CheckpointException):
        return "; ".join(
            f"rank {rank}: {_describe_failures(error)}" for rank, (error, _) in sorted(exc.failures.items())
        )
    return describe(exc)


def _check_state_dict(state_dict: object) -> None:
    """Reject what DCP cannot save as a state_dict: not a mapping, or keys not ``str``.

    :raises UnsupportedInputError: names the offending key.
    """
    if not isinstance(state_dict, Mapping):
        raise UnsupportedInputError((), f"DCP saves a dict of str keys, got {type(state_dict).__qualname__}")
    for key in state_dict:
        if not isinstance(key, str):
            raise UnsupportedInputError((key,), f"DCP needs str top-level keys, got {type(key).__qualname__}")


def _check_save_arguments(
    checkpoint_id: object,
    storage_writer: object,
    planner: object,
    process_group: object,
    stager: object,
    no_dist: object,
) -> None:
    """Validate :func:`async_save`'s arguments before anything is staged.

    :raises ConfigurationError: names the argument and what is wrong with it.
    """
    if checkpoint_id is None and storage_writer is None:
        raise ConfigurationError("async_save needs a checkpoint_id or a storage_writer")
    if checkpoint_id is not None and not isinstance(checkpoint_id, str | os.PathLike):
        raise ConfigurationError(
            f"checkpoint_id must be a str or a path, got {type(checkpoint_id).__qualname__}"
        )
    for name, value, cls in (
        ("storage_writer", storage_writer, StorageWriter),
        ("planner", planner, SavePlanner),
        ("process_group", process_group, dist.ProcessGroup),
    ):
        if value is not None and not isinstance(value, cls):
            raise ConfigurationError(f"{name} must be a {cls.__qualname__}, got {type(value).__qualname__}")
    if stager is not None and not isinstance(stager, AsyncStager):
        raise ConfigurationError(
            f"stager must be an astage stager (async stage() and aclose()), got {type(stager).__qualname__}"
        )
    if not isinstance(no_dist, bool):
        raise ConfigurationError(f"no_dist must be a bool, got {no_dist!r}")
    initialized = dist.is_available() and dist.is_initialized()
    if process_group is not None and not initialized:
        raise ConfigurationError("process_group given, but torch.distributed is not initialized")
    if initialized and not no_dist:
        group: Any = process_group if process_group is not None else dist.group.WORLD
        # DCP's collectives exchange CPU objects: the group needs a CPU backend (gloo).
        if group is not None and torch.device("cpu") not in group._device_types:
            raise ConfigurationError(
                "DCP needs a process group with a CPU backend; initialize it with "
                "'cpu:gloo,cuda:nccl' or pass a gloo process_group"
            )
