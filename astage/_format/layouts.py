"""Laying out a staged copy once per structure, not once per save.

:func:`astage._format.codec.lay_out` walks the whole staged tree (about 8 us a tensor) to check it
against the checkpoint file format and lay it out, and ``Checkpointer.save`` must do that before it
returns, so that what the format cannot store is refused there, with its key path.  But a
training job saves the same structure again and again, and with :class:`DefaultStager` the
staged copy is the very same tree, refilled in place.

So once a layout has been made (and the save's background task has time), the staged tree
is planned and its plan kept in its checkable form (:class:`astage._staging.recheck.FastPlan`).  A
later save matches its staged tree against that plan (:func:`astage._staging.recheck.match_in_slices`,
about 1 us a tensor, time-sliced on the loop): container types, keys, non-tensor values,
and every tensor's type, dtype, shape, stride, offset, flags and storage.  Where it
matches, ``lay_out`` would return the same layout but for the metadata (step, checkpoint
id, time) and the storage objects, so the kept layout is re-stamped instead; nothing is
assumed unchanged without that check.  Reading the storage objects (one call a storage) is
left to the background (:class:`PendingLayout`).  The kept layout holds no storage: it must
not keep the staged buffers from going back to the pool.

A save that :class:`~astage.DefaultStager` staged by refilling a released copy in place
(``StageStats.refilled``) skips even that: the stager checked that very tree against its
own plan when it was released (every tensor's metadata, and that its storages are one
whole copy's buffers, one each), so if the kept layout was made for the same copy (by the
serial ``StageStats.copy``), only the structure is walked, to collect the tensors.  Their
storages' sizes are checked when the layout is completed; a mismatch (a copy changed after
its release) sends the save back to a full lay-out, in the background.

Scalars are data, not structure (as for the stager, :func:`astage._staging.recheck.match_in_slices`'s
``patches``): a learning rate or step count in the tree may change from save to save.  A
patch names a scalar by its index in the file's scalar table
(:class:`astage._staging.recheck.AtomSlots`), so a save whose tree differs only there gets
the kept layout with those table entries replaced: the structure document is not touched,
and no walk of the tree's tensors is made for a new learning rate.

Invariant: a layout comes back from :meth:`LayoutCache.lay_out` only if ``lay_out`` on the
same staged tree would have returned it; ``UnsupportedInputError`` is raised exactly where
``lay_out`` raises it.  The header cap is checked once, with the widest metadata any save
can have, before a layout is kept.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Final

import torch

from .._staging.plan import PlannedSource, plan_in_slices
from .._staging.rebuild import plain_tensor_mode
from .._staging.recheck import FastPlan, fast_plan_in_slices, match_in_slices
from .._util.limits import INT64, RANK_LIMIT
from .._util.timeslice import Steps, drive, run_steps, slice_over, within
from .codec import HEADER_CAP, FileLayout, lay_out_in_slices
from .encoder import lay_out_planned_in_slices
from .scalars import json_text, scalar_json

log = logging.getLogger("astage.layout_cache")

_CHUNK: Final = 256
"""Storages read between two looks at the clock."""

_WIDEST_TIME: Final = -2.2250738585072014e-308
"""A float with the longest JSON form (24 characters): no ``created`` makes a longer header."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Kept:
    """A layout with what proves that a later staged tree has the same one."""

    fast: FastPlan
    layout: FileLayout
    """Laid out for the staged tree ``fast`` was planned from; its ``storages`` dropped."""
    firsts: tuple[int, ...]
    """For each storage of the layout, the plan position of the first tensor viewing it."""
    copy: int | None
    """The stager's serial of the staged copy ``fast`` was planned from, if known."""
    patchable: bool
    """Whether ``fast``'s atom slots are the layout's scalar table indices (checked when
    kept); else a changed scalar is laid out in full."""


def _slots_are_table_in_slices(fast: FastPlan, layout: FileLayout) -> Steps[bool]:
    """Whether ``fast``'s atom slots number the scalars as ``layout``'s scalar table does:
    as many atoms as entries, and each slot's value the entry at its index (exactly), in
    time slices (an optimizer's ``params`` list is thousands of slots)."""
    atoms = fast.atoms
    if not atoms.nodes or atoms.count != len(layout.scalars):
        return False
    slots = list(atoms.nodes)
    for start in range(0, len(slots), _CHUNK):
        block = slots[start : start + _CHUNK]
        try:
            planned = [scalar_json(atoms.nodes[k].value) for k in block]
        except (TypeError, ValueError):
            return False
        if json_text(planned) != json_text([layout.scalars[k] for k in block]):
            return False
        if slice_over():
            yield
    return True


@dataclasses.dataclass(eq=False)
class PendingLayout:
    """A kept layout that a staged tree matched, all but its storages.

    The match has checked every tensor's storage (``_cdata`` and size), so the storages
    are known; only reading them (a Python call a storage) is left, for the background.
    It holds the staged tensors: drop it with the staged copy.
    """

    layout: FileLayout
    sources: list[torch.Tensor]
    firsts: tuple[int, ...]

    async def complete(self) -> FileLayout | None:
        """The layout with the staged tree's storages (time-sliced on the loop), or ``None``
        if a storage is not the size laid out (lay the tree out in full then)."""
        try:
            storages = await run_steps(_storages(self.sources, self.firsts, self.layout.nbytes))
        finally:
            self.sources = []
        if storages is None:
            log.warning("a staged copy changed after its release; laying it out in full")
            return None
        return dataclasses.replace(self.layout, storages=storages)


def _storages(
    sources: list[torch.Tensor], firsts: tuple[int, ...], nbytes: tuple[int, ...]
) -> Steps[tuple[torch.UntypedStorage, ...] | None]:
    storages: list[torch.UntypedStorage] = []
    try:
        for start in range(0, len(firsts), _CHUNK):
            chunk = [sources[i].untyped_storage() for i in firsts[start : start + _CHUNK]]
            if [s.nbytes() for s in chunk] != list(nbytes[start : start + _CHUNK]):
                return None
            storages += chunk
            if slice_over():  # a chunk takes far less than a slice
                yield
    except Exception:  # not a tensor where one was laid out: only a walk_only match lets one by
        return None
    return tuple(storages)


@dataclasses.dataclass(eq=False)
class PlannedLayout:
    """A layout made from the plan the stager staged the copy by, with that plan: keeping
    the layout for later saves then needs no walk of the copy either.  It holds the copy's
    buffers: drop it with the staged copy."""

    layout: FileLayout
    planned: PlannedSource


class LayoutCache:
    """Lays out one rank's staged copies, re-using the layout of the same structure.

    Invalidation rule: the kept layout is re-used only for a staged tree that
    :func:`~astage._staging.recheck.match_in_slices` proves to have the kept plan (containers,
    keys, atoms, and every tensor's metadata and storage; for the very copy it was kept
    for, refilled in place by the stager, its containers, keys and atoms), where scalars
    may differ only at patch slots proven, when kept, to be the scalar table's indices,
    and only if the re-stamped header still fits the cap; every full lay-out that
    :meth:`keep` can plan replaces it.

    :param rank: the owner rank written into every layout.
    """

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._kept: _Kept | None = None

    async def lay_out(
        self,
        staged: Any,
        *,
        step: int,
        checkpoint_id: str,
        refilled: int | None = None,
        planned: PlannedSource | None = None,
    ) -> FileLayout | PendingLayout | PlannedLayout:
        """Lay out ``staged`` as :func:`astage._format.codec.lay_out` would.

        :param refilled: the serial of the copy ``staged`` is, if the stager refilled that
            released copy in place (``StageStats.copy`` where ``StageStats.refilled``).
        :param planned: the plan the stager staged ``staged`` by, bound to its tensors
            (``DefaultStager.stage_planned``): with no kept layout for it, the layout is
            made from that plan instead of a walk of the tree.
        :returns: a new layout (worth :meth:`keep`-ing), or the kept one for this save,
            pending its storages.
        :raises UnsupportedInputError: as ``lay_out``.
        :raises ConfigurationError: as ``lay_out``.
        """
        kept = self._kept
        if kept is not None:
            walk_only = refilled is not None and refilled == kept.copy
            restamped = await run_steps(
                within(plain_tensor_mode, _restamp(kept, staged, step, checkpoint_id, walk_only))
            )
            if restamped is not None:
                return restamped
        if planned is not None:
            steps = lay_out_planned_in_slices(
                planned, owner_rank=self._rank, step=step, checkpoint_id=checkpoint_id
            )
            return PlannedLayout(await run_steps(steps), planned)
        return await self.lay_out_in_full(staged, step=step, checkpoint_id=checkpoint_id)

    async def lay_out_in_full(self, staged: Any, *, step: int, checkpoint_id: str) -> FileLayout:
        """:func:`astage._format.codec.lay_out` with no kept layout, in time slices on the loop.

        Not in a worker thread: it is Python, which a worker runs no faster (the GIL), while
        the loop then waits for the GIL up to the switch interval (5 ms) at a time: the
        first save's heartbeat lagged through its whole layout (benchmarks/README.md).
        """
        steps = lay_out_in_slices(staged, owner_rank=self._rank, step=step, checkpoint_id=checkpoint_id)
        return await run_steps(within(plain_tensor_mode, steps))

    async def finish(
        self,
        staged: Any,
        layout: FileLayout | PendingLayout | PlannedLayout,
        *,
        copy: int | None,
    ) -> FileLayout:
        """The complete layout of what :meth:`lay_out` returned for ``staged``.

        A pending one gets its storages (or, if the copy changed after its release, a full
        lay-out); one made in full is kept, with the serial ``copy`` of the staged copy, for
        the saves to come.
        """
        planned = None
        if isinstance(layout, PlannedLayout):
            planned = layout.planned
            layout = layout.layout
        if isinstance(layout, PendingLayout):
            completed = await layout.complete()
            if completed is not None:
                return completed
            layout = await self.lay_out_in_full(
                staged, step=layout.layout.step, checkpoint_id=layout.layout.checkpoint_id
            )
        await self.keep(staged, layout, copy, planned)
        return layout

    async def keep(
        self, staged: Any, layout: FileLayout, copy: int | None = None, planned: PlannedSource | None = None
    ) -> None:
        """Keep ``layout`` (made by ``lay_out`` for ``staged``) for later trees of its structure.

        :param copy: the stager's serial of the copy ``staged`` is (``StageStats.copy``).
        :param planned: ``staged``'s plan, if the layout was made from it (no walk then).

        Meant for the background: it plans ``staged`` (about as long as ``lay_out``).  A tree
        whose plan cannot be re-checked (tensors with attributes, custom
        containers) is not kept; those saves are laid out in full every time.
        """
        await run_steps(self._keep_in_slices(staged, layout, copy, planned))

    def _keep_in_slices(
        self, staged: Any, layout: FileLayout, copy: int | None, planned: PlannedSource | None
    ) -> Steps[None]:
        """:meth:`keep` in time slices, for the loop or a worker thread."""
        try:
            if _fits_every_save(layout):
                kept = yield from within(plain_tensor_mode, _plan_kept(staged, layout, copy, planned))
                if kept is not None:
                    self._kept = kept
        except Exception as exc:  # only a lost speed-up: the next save is laid out in full
            log.debug("cannot keep the layout of step %d: %r", layout.step, exc)

    def complete_blocking(
        self,
        staged: Any,
        layout: FileLayout | PendingLayout | PlannedLayout,
        *,
        copy: int | None,
        between: Callable[[], object] | None = None,
    ) -> tuple[FileLayout, Callable[[], None] | None]:
        """The complete layout, and what keeps it for later saves (``None``: nothing to
        keep), to be called on a worker thread: with the plan carried, keeping needs no
        lay-out, so a save may run it beside its write, which waits on the disk."""
        planned = None
        if isinstance(layout, PlannedLayout):
            planned = layout.planned
            layout = layout.layout
        if isinstance(layout, PendingLayout):
            try:
                storages = drive(_storages(layout.sources, layout.firsts, layout.layout.nbytes), between)
            finally:
                layout.sources = []
            if storages is not None:
                return dataclasses.replace(layout.layout, storages=storages), None
            log.warning("a staged copy changed after its release; laying it out in full")
            made = layout.layout
            steps = lay_out_in_slices(
                staged, owner_rank=self._rank, step=made.step, checkpoint_id=made.checkpoint_id
            )
            layout = drive(within(plain_tensor_mode, steps), between)
        return layout, functools.partial(self._keep_blocking, staged, layout, copy, planned, between)

    def _keep_blocking(
        self,
        staged: Any,
        layout: FileLayout,
        copy: int | None,
        planned: PlannedSource | None,
        between: Callable[[], object] | None,
    ) -> None:
        """:meth:`keep` on the calling thread (``between`` runs between two slices)."""
        try:
            drive(self._keep_in_slices(staged, layout, copy, planned), between)
        except Exception as exc:  # a save abandoned meanwhile: ``between`` raised
            log.debug("stopped keeping the layout of step %d: %r", layout.step, exc)


def _plan_kept(
    staged: Any, layout: FileLayout, copy: int | None, planned: PlannedSource | None
) -> Steps[_Kept | None]:
    """``layout`` with the checkable plan of ``staged`` (``planned``, or a walk of it), if the
    plan's storages are the layout's."""
    source = planned if planned is not None else (yield from plan_in_slices(staged))
    # Each walk over every tensor or storage below looks at the clock a block at a time.
    if len(source.plan.tensors) != layout.num_tensors or len(source.storages) != len(layout.storages):
        return None
    for i, (ours, theirs) in enumerate(zip(source.storages, layout.storages, strict=True)):
        if ours._cdata != theirs._cdata:
            return None  # e.g. numpy arrays, which only the format's planner stores as tensors
        if not i & 1023 and slice_over():
            yield
    fast = yield from fast_plan_in_slices(source)
    if fast is None:
        return None
    firsts: dict[int, int] = {}
    for position, spec in enumerate(fast.plan.tensors):
        firsts.setdefault(spec.storage, position)
        if not position & 1023 and slice_over():
            yield
    patchable = yield from _slots_are_table_in_slices(fast, layout)
    layout = dataclasses.replace(layout, storages=())
    return _Kept(fast, layout, tuple(map(firsts.__getitem__, range(len(firsts)))), copy, patchable)


def _restamp(
    kept: _Kept, staged: Any, step: int, checkpoint_id: str, walk_only: bool
) -> Steps[PendingLayout | None]:
    """The kept layout for ``staged`` and this save, or ``None`` if ``staged`` does not match."""
    patches: list[tuple[int, Any]] | None = [] if kept.patchable else None
    sources = yield from match_in_slices(kept.fast, staged, walk_only=walk_only, patches=patches)
    if sources is None:
        return None
    layout = dataclasses.replace(
        kept.layout, step=step, checkpoint_id=checkpoint_id, created=float(time.time())
    )
    if patches:
        try:
            layout = layout.with_scalars([(slot, scalar_json(value)) for slot, value in patches])
        except (TypeError, ValueError):  # not a value a file holds: a full lay-out refuses it
            return None
        if not _fits_every_save(layout):
            return None  # laid out in full, which refuses it
    return PendingLayout(layout, sources, kept.firsts)


def _fits_every_save(layout: FileLayout) -> bool:
    """Whether ``layout``'s header fits under the cap with the widest metadata any later save
    can give it (ranks, step, time), so that re-stamping it can never break the cap."""
    widest = dataclasses.replace(
        layout, owner_rank=RANK_LIMIT - 1, holder_rank=RANK_LIMIT - 1, step=INT64 - 1, created=_WIDEST_TIME
    )
    return widest.header_nbytes() <= HEADER_CAP
