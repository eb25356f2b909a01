"""Stagers: make a training-safe CPU copy of a state_dict without blocking the event loop.

:class:`DefaultStager` carries out a plan (``_plan``) with buffers from a pool (``_pool``)
and copies (``_copy``) that run in worker threads or on a device side stream awaited
through ``_events``.  :class:`BlockingStager` is the same machinery configured like torch's
``BlockingAsyncStager``.

Invariants:

* ``stage()`` returns a copy that later changes to the source never reach, and that the
  stager never overwrites until it is released (``release()``) or no longer referenced.
* A later stage of the same structure re-uses the plan only after re-checking, per tensor
  and per container, everything the plan was derived from (``_match.match_in_slices``), and
  refills a released copy of it in place (the same tree comes back).  A kept copy given up
  (a refill that fails or is cancelled, a new plan, ``aclose()``) is emptied as
  ``release()`` empties a copy it does not keep, so that a caller's variable naming it pins
  no buffer.
* Whatever the fast path decides from an address (a ``StorageImpl``, a data pointer) is
  about an object it keeps alive: a freed address is soon another object's.
* Whatever happens inside ``stage()`` (error, cancellation at any ``await``), every leased
  buffer is back in the pool before it returns, and no thread or device copy still writes
  into it.  The stager stays usable.
* ``aclose()`` is idempotent and cancellable: it wakes every stage waiting for buffers
  (they raise :class:`ClosedError`), waits for the stages already copying, and releases
  every idle buffer.
* A stager serves one event loop at a time; a call from a second loop while the first is
  using it raises :class:`EventLoopError` instead of deadlocking.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import threading
import traceback
from collections.abc import Callable, Collection, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, cast, runtime_checkable

import anyio
import anyio.abc
import anyio.lowlevel
import anyio.to_thread
import torch

from .._util.errors import ClosedError, EventLoopError, UnsupportedInputError
from .._util.threads import run_sync
from .._util.timeslice import Steps, clock, drive, run_steps, slice_over, within
from .copies import (
    CopyLayout,
    CopyWork,
    DeviceCopy,
    batches_in_slices,
    copy_in_threads,
    copy_lanes,
    copy_layout_in_slices,
    enqueue_device_copies,
    group_by_device,
    run_batch,
)
from .events import STRATEGIES, Strategy, wait_event
from .options import (
    ResolvedOptions,
    StagingOptions,
    check_bool,
    check_choice,
    check_positive_int,
    coerce_options,
)
from .plan import PlannedSource, StagePlan, plan_in_slices, tensor_paths_in_slices
from .pool import BufferKind, BufferPool, Lease, PoolStats
from .rebuild import Rebuilder, copy_streams, make_tensor, plain_tensor_mode
from .recheck import fast_plan_in_slices, match_in_slices, set_atoms
from .reuse import Patches, Reuse, Spare, as_matched, empty_all, empty_tensor
from .torch_api import refuse_torch_caller

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import StagingOptions as TorchStagingOptions

log = logging.getLogger("astage.stager")

# anyio imports its asyncio backend on first use; importing it now keeps that (tens of ms)
# off the event loop during the first stage.
with contextlib.suppress(ImportError):
    importlib.import_module("anyio._backends._asyncio")


@runtime_checkable
class AsyncStager(Protocol):
    """What every astage stager offers: an awaitable ``stage`` and async closing."""

    async def stage(self, state_dict: Any) -> Any:
        """Return a staged copy of ``state_dict`` that later changes to it never reach."""
        ...

    async def aclose(self) -> None:
        """Release every resource; idempotent."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


@dataclasses.dataclass(frozen=True)
class StageStats:
    """What one ``stage()`` did.

    :ivar tensors: distinct tensors staged.
    :ivar storages: distinct storages copied (shared storages count once).
    :ivar bytes: bytes staged (of which ``bytes_skipped`` were not copied again).
    :ivar bytes_allocated: bytes of new buffers this stage had to allocate (0 on reuse).
    :ivar reused_buffers: buffers taken from the pool instead of allocated.
    :ivar seconds: wall time of the whole ``stage()``.
    :ivar wait_seconds: part of ``seconds`` spent waiting for room under the memory cap.
    :ivar bytes_skipped: part of ``bytes`` not copied because it was unchanged since the
        last stage (``StagingOptions(skip_unchanged=True)``).
    :ivar tensors_skipped: tensors whose storage was not copied again, likewise.
    :ivar copy: which staged copy came back, by serial number: a released copy refilled in
        place keeps its number (0 where the stager numbers none).
    :ivar refilled: the stage refilled a released copy in place: the tree it returned is the
        one handed out before under the same ``copy`` number, checked whole at its release.
    :ivar planned: the stage planned the state_dict from scratch (a first stage, or a
        structure that changed); ``False``: it re-checked the plan kept from the last stage
        and used it (the fast path of a repeated stage).
    """

    tensors: int
    storages: int
    bytes: int
    bytes_allocated: int
    reused_buffers: int
    seconds: float
    wait_seconds: float
    bytes_skipped: int = 0
    tensors_skipped: int = 0
    copy: int = 0
    refilled: bool = False
    planned: bool = False

    @property
    def gbps(self) -> float:
        """Copy throughput in GB/s (10^9 bytes per second) over the whole stage."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __repr__(self) -> str:
        # The throughput is what a reader of a log line wants first; it is derived, so
        # the generated repr would leave it out.
        return (
            f"StageStats({self.gbps:.2f} GB/s, tensors={self.tensors}, storages={self.storages}, "
            f"bytes={self.bytes:,}, bytes_allocated={self.bytes_allocated:,}, "
            f"reused_buffers={self.reused_buffers}, seconds={self.seconds:.4f}, "
            f"wait_seconds={self.wait_seconds:.4f}, bytes_skipped={self.bytes_skipped:,}, "
            f"tensors_skipped={self.tensors_skipped}, copy={self.copy}, refilled={self.refilled}, "
            f"planned={self.planned})"
        )


class DefaultStager(anyio.abc.AsyncResource):
    """Stage state_dicts into pooled CPU buffers; the asyncio/anyio-native ``DefaultStager``.

    ::

        async with astage.DefaultStager(astage.StagingOptions()) as stager:
            staged = await stager.stage(model.state_dict())
            ...                          # persist or send `staged`; training goes on
            await stager.release(staged)  # optional: buffers come back for the next stage

    :param options: staging switches and memory cap; defaults work on every machine.  A
        torch ``StagingOptions`` is accepted too (its four switches map one to one).
    :param config: the same as ``options``, under torch's ``DefaultStager`` keyword.
    :param threads: worker threads for CPU copies and buffer allocation; a copy of many
        storages runs in up to this many at once where the machine has a core to spare
        beyond the event loop's.
    :param event_strategy: how device events are awaited (``"poll"`` or ``"thread"``).
    :raises ConfigurationError: an argument has the wrong type or value, or an option
        cannot work on this machine.

    A stager serves one event loop at a time (see :class:`EventLoopError`).
    """

    def __init__(
        self,
        options: StagingOptions | TorchStagingOptions | None = None,
        *,
        config: StagingOptions | TorchStagingOptions | None = None,
        threads: int = 2,
        event_strategy: Strategy = "poll",
    ) -> None:
        self._set_up(options, config, threads, event_strategy, strict=False, retain_buffers=True)

    def _set_up(
        self,
        options: StagingOptions | TorchStagingOptions | None,
        config: StagingOptions | TorchStagingOptions | None,
        threads: int,
        event_strategy: Strategy,
        *,
        strict: bool,
        retain_buffers: bool,
    ) -> None:
        """The constructor's work, with the two switches only :class:`BlockingStager` sets
        (torch's ``type_check`` and ``cache_staged_state_dict``), kept off the public signature.

        :param strict: planning refuses leaves that are not tensors, containers or plain
            values instead of deep-copying them.
        :param retain_buffers: released buffers are kept for the next stage.
        """
        check_positive_int(f"{type(self).__name__}(threads=...)", threads)
        check_choice(f"{type(self).__name__}(event_strategy=...)", event_strategy, STRATEGIES)
        self.options = coerce_options(options, config)
        self._resolved: ResolvedOptions = self.options.resolve()
        r = self._resolved
        self._threads = threads
        self._lanes = copy_lanes(threads)
        self._limiter: anyio.CapacityLimiter | None = None
        self._event_strategy: Strategy = event_strategy
        self._strict = strict
        self._pool = BufferPool(
            BufferKind.of(pinned=r.pinned, shared=r.shared),
            max_bytes=r.max_bytes,
            retain=retain_buffers,
            allocate_inline=not r.async_copy,
        )
        self._side_streams = _side_streams(r.non_blocking)
        self._inflight = 0
        self._idle: anyio.Event | None = None
        self._closed = False
        self.last_stats: StageStats | None = None
        # Which event loop uses the stager, and how many of its calls are running: taken
        # and checked under a lock, as two loops in two threads may call at once.
        self._loop_lock = threading.Lock()
        self._loop: object = None
        self._loop_users = 0
        # The fast path, so a repeated stage of one structure is re-checked, not re-planned:
        # everything kept from the last stage for the next, with its one rule (reuse.py).
        self._reuse = Reuse(self._pool, skip_unchanged=r.skip_unchanged)

    # -- lifecycle (``async with`` comes from AsyncResource: it calls aclose) ---------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    async def aclose(self) -> None:
        """Release every idle buffer, wake stages waiting for buffers, wait for the others.

        Idempotent.  A stage still waiting for room under ``max_staging_bytes`` (or not yet
        at its buffers) raises :class:`ClosedError`; a stage already copying finishes, and
        this waits for it.  The copy kept for re-use is emptied (``set_()``).  Cancelling
        this wait leaves the stager closed and releases nothing twice: those stages hand
        their buffers to nobody when they end.

        :raises EventLoopError: another event loop is using the stager.
        """
        if self._closed:
            return
        with self._one_loop("aclose()"):
            self._closed = True
            await self._forget_plan()
            # Closing the pool first wakes every waiter; waiting for in-flight stages first
            # would hang forever when one waits for room that only its caller could free.
            await self._pool.aclose()
            while self._inflight:
                self._idle = self._idle or anyio.Event()
                await self._idle.wait()

    @contextlib.contextmanager
    def _one_loop(self, call: str) -> Iterator[None]:
        """Count a call of this stager's, refusing it if another event loop is using it.

        Between uses the stager may move to another loop: the loop-bound primitives made
        under the previous one (thread limiter, wake-up events) are dropped then.
        """
        loop = anyio.lowlevel.current_token().native_token
        with self._loop_lock:
            if self._loop_users and self._loop is not loop:
                raise EventLoopError(
                    f"{call} was called from a second event loop while another is using this "
                    f"{type(self).__name__}: a stager serves one event loop at a time; "
                    "create one stager per event loop (per thread)"
                )
            if self._loop is not loop:
                self._limiter = None
                self._idle = None
                self._pool.forget_loop()
                self._loop = loop
            self._loop_users += 1
        try:
            yield
        finally:
            with self._loop_lock:
                self._loop_users -= 1

    def pool_stats(self) -> PoolStats:
        """Memory held by this stager's buffer pool, as of now: buffers whose staged copy was
        dropped are taken back first, so ``handed_out_bytes`` does not count them."""
        self._pool.reclaim()
        return self._pool.stats()

    # -- staging --------------------------------------------------------------------------

    @refuse_torch_caller
    async def stage(self, state_dict: Any) -> Any:
        """Return a CPU copy of ``state_dict`` that later changes to the source never reach.

        The tree is rebuilt with the same structure; tensors that shared a storage share
        one in the copy.  Records :attr:`last_stats`.

        :raises UnsupportedInputError: a value cannot be staged (names its key path).
        :raises CapacityError: the state_dict alone is larger than ``max_staging_bytes``.
        :raises ClosedError: the stager was closed.
        :raises ConfigurationError: called synchronously by torch's ``dcp.async_save``
            (wrap the stager in :class:`astage.dcp.StagerAdapter`).
        """
        staged, _ = await self.stage_with_stats(state_dict)
        return staged

    async def stage_with_stats(self, state_dict: Any) -> tuple[Any, StageStats]:
        """Like :meth:`stage`, and also return this call's own :class:`StageStats`.

        :attr:`last_stats` belongs to whichever stage finished last; with stages running
        concurrently, only these stats are surely this call's.
        """
        staged, stats, _ = await self.stage_planned(state_dict)
        return staged, stats

    async def stage_planned(self, state_dict: Any) -> Staged:
        """Like :meth:`stage_with_stats`, and also return, for a stage that planned a new
        structure, its plan bound to the copy's own tensors and storages, where that plan is
        :attr:`~astage._staging.plan.PlannedSource.plain`: what laying the copy out would
        find by walking it (``None`` otherwise).  It holds the copy's buffers: drop it with
        the copy, and trust it only while the copy is untouched.
        """
        if self._closed:
            raise ClosedError("stage() called on a closed stager")
        with self._one_loop("stage()"):
            self._inflight += 1
            try:
                return await self._stage(state_dict)
            finally:
                self._inflight -= 1
                if not self._inflight and self._idle is not None:
                    self._idle.set()
                    self._idle = None

    async def _run(self, steps: Steps[Any], *, makes_tensors: bool = True) -> Any:
        """Run ``steps`` in slices (inline for a blocking stager); one that makes tensors runs
        in plain tensor mode (entering it at each slice costs, so read-only walks skip it)."""
        if makes_tensors:
            steps = within(plain_tensor_mode, steps)
        return await run_steps(steps) if self._resolved.async_copy else drive(steps)

    async def _stage(self, state_dict: Any) -> Staged:
        started = clock()
        fast = self._reuse.fast
        sources: list[torch.Tensor] | None = None
        # Scalars that changed since the plan was made (a learning rate, a step count): put
        # into the staged tree, not a reason to plan again.
        patches: list[tuple[int, Any]] = []
        if fast is not None:
            sources = await self._run(match_in_slices(fast, state_dict, patches=patches), makes_tensors=False)
        layout = self._reuse.layout
        if sources is None or fast is None or layout is None:
            return await self._stage_first(state_dict, started)  # a new structure
        spare = self._reuse.spare
        if spare is not None and spare.fast is fast:
            # No local may keep the copy alive past a failed refill (the pool takes its
            # buffers back once nothing references them): _refill takes it from self.
            del spare
            return await self._refill(sources, layout, started, patches)
        del spare
        return await self._stage_new(fast.plan, layout, sources, started, patches=(fast.atoms, patches))

    async def _stage_first(self, state_dict: Any, started: float) -> Staged:
        """Plan ``state_dict`` and stage it into new buffers; drop the copy kept for the old
        plan first, whose buffers may be needed under the memory cap."""
        await self._forget_plan()
        planning = plan_in_slices(state_dict, strict=self._strict)
        source: PlannedSource = await self._run(planning, makes_tensors=False)
        layout = await self._run(copy_layout_in_slices(source.plan, source.tensors), makes_tensors=False)
        fast = await self._run(fast_plan_in_slices(source), makes_tensors=False)
        self._reuse.adopt(fast, layout, source.storages)
        return await self._stage_new(
            source.plan, layout, list(source.tensors), started, first=True, carry=source.plain
        )

    async def _stage_new(
        self,
        plan: StagePlan,
        layout: CopyLayout,
        sources: list[torch.Tensor],
        started: float,
        *,
        first: bool = False,
        carry: bool = False,
        patches: Patches | None = None,
    ) -> Staged:
        """Stage into newly leased buffers and build a new tree over them (with ``patches``:
        the plan's atom slots and the changed scalars to put there)."""
        if self._resolved.async_copy and self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self._threads)
        # The collector runs while this waits for buffers: a copy that only a reference cycle
        # keeps comes back once collected.
        try:
            lease = await self._pool.acquire([s.nbytes for s in plan.storages], limiter=self._limiter)
        except ClosedError as exc:
            raise ClosedError("the stager was closed while this stage() waited for staging buffers") from exc
        return await self._fill_new(
            plan, layout, sources, lease, started, patches, planned=first, carry=carry
        )

    async def _fill_new(
        self,
        plan: StagePlan,
        layout: CopyLayout,
        sources: list[torch.Tensor],
        lease: Lease,
        started: float,
        patches: Patches | None,
        *,
        planned: bool,
        carry: bool = False,
    ) -> Staged:
        """Copy into a new lease and build the tree over it; hand it out (with ``carry``,
        with the plan bound to the copy's tensors and storages: see :meth:`stage_planned`)."""
        staged_locals: list[torch.Tensor] | None = None
        rebuilder: Rebuilder | None = None
        seen = self._reuse.see(sources)
        try:
            staged_locals = await self._run(_locals_in_slices(plan, lease.storages))
            await self._copy(plan, layout, staged_locals, sources, lease.storages.__getitem__)
            streams = await copy_streams(plan, self._limiter, threaded=self._resolved.async_copy)
            rebuilder = Rebuilder(plan, staged_locals.__getitem__, streams)
            staged = await self._run(rebuilder.node(plan.root))
            if patches is not None:
                set_atoms(staged, *patches)
        except BaseException as exc:
            # No copy is in flight any more (the copy paths wait for theirs).  Tensors over the
            # leased buffers may survive in this frame and in the traceback's frames, where a
            # reference cycle would keep them until the garbage collector runs: drop them, and
            # let the pool take each buffer back as soon as nothing references it.
            staged_locals = rebuilder = None
            traceback.clear_frames(exc.__traceback__)
            self._pool.hand_out(lease)
            self._pool.reclaim()
            raise
        # (Bound before the lease is handed out, which empties it.)
        carried = PlannedSource(plan, tuple(staged_locals), tuple(lease.storages), True) if carry else None
        with anyio.CancelScope(shield=True):  # half handed out between its slices
            serial = await self._run(self._pool.hand_out_in_slices(lease), makes_tensors=False)
            rebuilt = cast(list[torch.Tensor], rebuilder.tensors)
            staged_tensors = await self._run(
                as_matched(self._reuse.fast, plan, rebuilt, staged_locals), makes_tensors=False
            )
            del rebuilt
            remember = self._reuse.remember(plan, serial, seen, staged_tensors, new=True)
            await self._run(remember, makes_tensors=False)
            del remember
            del staged_tensors
        stats = self._record(
            plan,
            lease.allocated_bytes,
            lease.reused_buffers,
            lease.wait_seconds,
            started,
            copy=serial,
            planned=planned,
        )
        return staged, stats, carried

    async def _refill(
        self, sources: list[torch.Tensor], layout: CopyLayout, started: float, patches: list[tuple[int, Any]]
    ) -> Staged:
        """Copy into the kept copy of the same plan, in place, and return its tree again,
        its atoms set to the sources' (``patches``, and the plan's values where the copy
        held others)."""
        spare: Spare | None = self._reuse.take_spare()  # checked by the caller, with no await since
        assert spare is not None
        plan, atoms = spare.fast.plan, spare.fast.atoms
        # The scalars first: a tree its holder broke after release() (which it must not)
        # is dropped before anything is copied into it, and a new copy is staged.
        patched = {slot for slot, _ in patches}
        back = [(slot, atoms.nodes[slot].value) for slot in spare.off_plan if slot not in patched]
        try:
            set_atoms(spare.tree, atoms, back + patches)
        except (LookupError, TypeError, AttributeError) as exc:
            log.warning("a released copy was changed after its release (%r); staging a new one", exc)
            await self._drop(spare.tensors)
            spare = None
            return await self._stage_new(plan, layout, sources, started, patches=(atoms, patches))
        try:
            seen = self._reuse.see(sources)
            skip = self._reuse.unchanged(spare, seen)
            await self._copy(plan, layout, spare.tensors, sources, spare.storage, skip, spare.fast.storage_of)
        except BaseException as exc:
            # The copy is half refilled: drop it, emptied, so that its buffers go back to
            # the pool even while a caller's variable still names the released tree.
            traceback.clear_frames(exc.__traceback__)
            await self._drop(spare.tensors)
            spare = None
            raise
        with anyio.CancelScope(shield=True):  # the copy is whole: return it
            remember = self._reuse.remember(plan, spare.serial, seen, spare.tensors, new=False)
            await self._run(remember, makes_tensors=False)
            del remember
        stats = self._record(
            plan,
            0,
            len(plan.storages),
            0.0,
            started,
            skip,
            spare.fast.storage_of,
            copy=spare.serial,
            refilled=True,
        )
        return spare.tree, stats, None

    async def _copy(
        self,
        plan: StagePlan,
        layout: CopyLayout,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        dst_storage: Callable[[int], torch.UntypedStorage],
        skip: Collection[int] = (),
        storage_of: Sequence[int] = (),
    ) -> None:
        first: dict[int, int] = {}

        def src_storage(s: int) -> torch.UntypedStorage:
            # Asked only for storages copied through byte views: usually none.
            if not first:
                for i, spec in enumerate(plan.tensors):
                    first.setdefault(spec.storage, i)
            return src[first[s]].untyped_storage()

        def batches(on_host: bool) -> Steps[CopyWork]:
            return batches_in_slices(
                plan,
                layout,
                dst,
                src,
                dst_storage,
                src_storage,
                on_host=on_host,
                skip=skip,
                storage_of=storage_of,
            )

        if layout.device or layout.device_other:
            await self._copy_from_device(await self._run(batches(on_host=False)))
        if layout.host or layout.host_other:
            await self._copy_from_host(await self._run(batches(on_host=True)))

    # -- re-use ---------------------------------------------------------------------------

    async def _forget_plan(self) -> None:
        """Drop the cached plan, the copy kept for re-use (emptied) and the record of the last stage."""
        tensors = self._reuse.forget()
        if tensors is not None:
            await self._drop(tensors)

    async def _drop(self, tensors: list[torch.Tensor]) -> None:
        """Empty the tensors of a copy handed back to the stager that it will not return
        (``set_()``, as :meth:`release` empties a copy it does not keep), and take its
        buffers back.

        A copy dropped unemptied holds its buffers for as long as anything references its
        tree, and every ``staged = await stager.stage(sd) ... release(staged)`` loop does
        until its next assignment: a stage waiting for room under ``max_staging_bytes``
        then waited for ever.  Shielded: the copy is the stager's, and half emptied it
        would still pin its other buffers.
        """
        with anyio.CancelScope(shield=True):
            await self._run(empty_all(tensors))
        del tensors
        self._pool.reclaim()

    async def _copy_from_host(self, work: CopyWork) -> None:
        if self._resolved.async_copy:
            await copy_in_threads(work, self._limiter, lanes=self._lanes)
        else:
            for batch in work.batches:
                run_batch(batch)

    async def _copy_from_device(self, work: CopyWork) -> None:
        if not self._resolved.non_blocking:  # blocking device copies, off the loop unless inline
            await self._copy_from_host(work)
            return
        groups: list[DeviceCopy] = []
        for device, batches in group_by_device(work.batches).items():
            side = self._side_streams.get(device)
            if side is None:
                side = self._side_streams[device] = torch.Stream(device=device)
            # The caller's stream on that device, read on the loop thread (streams are per thread).
            groups.append((side, torch.accelerator.current_stream(device), batches))
        sides = [side for side, _, _ in groups]
        try:
            if self._resolved.async_copy:
                events = await run_sync(enqueue_device_copies, groups, limiter=self._limiter)
            else:
                events = enqueue_device_copies(groups)
            del groups
            for event in events:
                await wait_event(event, strategy=self._event_strategy)
        except BaseException:
            # Copies may still be in flight into the leased buffers, on any of the devices:
            # wait for all of them before the caller hands the buffers back.
            with anyio.CancelScope(shield=True):
                for side in sides:
                    await wait_event(side.record_event(), strategy=self._event_strategy)
            raise

    def _record(
        self,
        plan: StagePlan,
        allocated: int,
        reused: int,
        waited: float,
        started: float,
        skipped: Collection[int] = (),
        storage_of: Sequence[int] = (),
        *,
        copy: int,
        refilled: bool = False,
        planned: bool = False,
    ) -> StageStats:
        storages = plan.storages
        skipped_tensors = sum(map(skipped.__contains__, storage_of)) if skipped else 0
        fast = self._reuse.fast
        stats = StageStats(
            tensors=len(plan.tensors),
            storages=len(storages),
            bytes=fast.nbytes if fast is not None and fast.plan is plan else plan.nbytes,
            bytes_allocated=allocated,
            reused_buffers=reused,
            seconds=clock() - started,
            wait_seconds=waited,
            bytes_skipped=sum(storages[s].nbytes for s in skipped),
            tensors_skipped=skipped_tensors,
            copy=copy,
            refilled=refilled,
            planned=planned,
        )
        self.last_stats = stats
        log.debug(
            "staged %d tensors (%d storages, %d bytes, %d newly allocated) in %.4fs, %.2f GB/s",
            stats.tensors,
            stats.storages,
            stats.bytes,
            stats.bytes_allocated,
            stats.seconds,
            stats.gbps,
        )
        return stats

    # -- releasing ------------------------------------------------------------------------

    async def release(self, staged: Any) -> None:
        """Hand a staged copy back to the stager, for re-use.

        A copy of the structure the stager staged last is kept whole, and the next stage of
        that structure refills it in place and returns the same tree (nothing is allocated
        or rebuilt); a reference to it kept past this call sees that later checkpoint, and
        must not change it (the stager owns it now: a tensor or container swapped into it
        after this call would be returned as is, not refilled).  Any other copy's tensors
        are emptied (``set_()``) and its buffers go back to the pool.
        A copy that is not released is never overwritten; its buffers come back on their own
        once every reference to it is dropped.  Releasing a copy again does nothing; on a
        closed stager this does nothing either, as closing let go of every buffer.

        :raises UnsupportedInputError: ``staged`` holds a tensor with data that this stager
            did not stage (names its key path); nothing is released then.
        :raises EventLoopError: another event loop is using the stager.
        """
        if self._closed:
            return
        with self._one_loop("release()"):
            reuse = self._reuse
            fast = reuse.fast
            # A stager that keeps no buffers (BlockingStager without its cache) keeps no copy,
            # nor does one whose pool has stages waiting for room: they need these buffers
            # (kept, the copy would hold its bytes under the cap from them for ever).
            if fast is not None and reuse.spare is None and self._pool.retain and not self._pool.waiting:
                spare = await run_steps(reuse.spare_of(fast, staged))
                # (Checked again: a stage may have begun to wait for room meanwhile.)
                if (
                    spare is not None
                    and reuse.spare is None
                    and reuse.fast is fast
                    and not self._pool.waiting
                ):
                    reuse.keep(spare)
                    return
            found: list[tuple[Any, torch.Tensor]] = await run_steps(tensor_paths_in_slices(staged))
            ours = self._pool.handed_out_storages(kept=True)
            for path, tensor in found:
                # An empty storage is a tensor released before (or one with no data at all).
                # (No local names the storage: it would keep the buffer from coming back.)
                if tensor.untyped_storage()._cdata not in ours and tensor.untyped_storage().nbytes():
                    raise UnsupportedInputError(
                        path,
                        f"release() got a tensor that this {type(self).__name__} did not stage "
                        "(a source tensor, or another stager's copy); nothing was released",
                    )
            # The kept copy's tensors are never emptied: they are the stager's now.
            ours = self._pool.handed_out_storages()
            with plain_tensor_mode():
                for _, tensor in found:
                    if tensor.untyped_storage()._cdata in ours:
                        empty_tensor(tensor)
            del found
            self._pool.reclaim()


def _locals_in_slices(plan: StagePlan, storages: Sequence[torch.UntypedStorage]) -> Steps[list[torch.Tensor]]:
    """The plain staged tensor of every planned tensor, in time slices."""
    out: list[torch.Tensor] = []
    for spec in plan.tensors:
        out.append(make_tensor(spec, storages[spec.storage]))
        if slice_over():
            yield
    return out


def _side_streams(non_blocking: bool) -> dict[torch.device, Any]:
    """One side stream per device: the current device's is made here, on the constructing
    thread, after the caller's device setup; another device's when a stage first copies
    from it.  New streams, so never a compute stream."""
    if not non_blocking:
        return {}
    side = torch.Stream()
    return {side.device: side}


Staged = tuple[Any, StageStats, PlannedSource | None]
"""A staged copy, its stage's stats, and the plan it carries (see :meth:`DefaultStager.stage_planned`)."""


class BlockingStager(DefaultStager):
    """Stage inline on the calling thread, like torch's ``BlockingAsyncStager``.

    The same machinery as :class:`DefaultStager`, configured for blocking copies.

    :param cache_staged_state_dict: keep staging buffers (pinned where an accelerator is)
        for reuse by the next stage; a copy the caller still holds is never overwritten.
    :param type_check: reject leaves that are not tensors, containers or plain values
        instead of deep-copying them.
    """

    def __init__(self, cache_staged_state_dict: bool = False, type_check: bool = False) -> None:
        check_bool("BlockingStager(cache_staged_state_dict=...)", cache_staged_state_dict)
        check_bool("BlockingStager(type_check=...)", type_check)
        # DefaultStager's private set-up, not its constructor: the public signature has no
        # place for these two switches.
        self._set_up(
            StagingOptions(
                use_pinned_memory=None if cache_staged_state_dict else False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            ),
            None,
            2,
            "poll",
            strict=type_check,
            retain_buffers=cache_staged_state_dict,
        )
        self.cache_staged_state_dict = cache_staged_state_dict
        self.type_check = type_check
