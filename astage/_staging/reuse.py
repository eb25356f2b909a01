"""What a stager keeps from one stage for the next stage of the same structure: one owner.

A repeated stage of one structure is re-checked, not re-planned, and a released copy is
refilled in place rather than staged anew.  Everything that makes that possible lives in
one :class:`Reuse`: the last plan in a form a later stage can check (``fast``), how its
storages are batched (``layout``), a released copy kept whole to be refilled (``spare``),
the record that knows that copy again when it is released again, and, with
``skip_unchanged``, what the last stage copied and the source storages it was planned from.

The one rule: everything here belongs to the one plan ``fast``, and is re-checked each
time it is used (a state_dict against the plan by :func:`~astage._staging.recheck.match_in_slices`,
a released copy against its record, every address against an object kept alive);
:meth:`Reuse.forget` drops all of it at once, when a stage meets another structure, when a
kept copy is given up (a refill failed or was cancelled) and when the stager closes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import weakref
from collections.abc import Sequence
from typing import Any, Final, cast

import torch

from .._util.timeslice import Steps, distinct_in_slices, each_block, slice_over
from .copies import CopyLayout
from .plan import StagePlan
from .pool import Buffer, BufferPool
from .recheck import AtomSlots, FastPlan, match_in_slices


class Reuse:
    """A stager's fast path for one plan (see the module docstring for its one rule)."""

    def __init__(self, pool: BufferPool, *, skip_unchanged: bool) -> None:
        self._pool = pool
        self._skip_unchanged = skip_unchanged
        self.fast: FastPlan | None = None
        """The last plan, in the form a later stage re-checks."""
        self.layout: CopyLayout | None = None
        """How the plan's storages are batched for the copy."""
        self.spare: Spare | None = None
        """A released copy of ``fast``'s plan, kept whole to be refilled in place."""
        self._last: Filled | None = None
        self._released: Released | None = None
        # With skip_unchanged, the source storages the plan was made of, kept alive: the
        # re-check compares storages by their StorageImpl's address, which only means "the
        # same storage" while that storage cannot be freed and its address taken by another.
        self._plan_storages: tuple[torch.UntypedStorage, ...] = ()

    @property
    def released_record(self) -> Released | None:
        """The record that knows the kept copy again when it is released again, if any."""
        return self._released

    def adopt(
        self, fast: FastPlan | None, layout: CopyLayout, storages: tuple[torch.UntypedStorage, ...]
    ) -> None:
        """Start over with a new plan (after :meth:`forget`)."""
        self.fast, self.layout = fast, layout
        if fast is not None and self._skip_unchanged:
            self._plan_storages = storages

    def forget(self) -> list[torch.Tensor] | None:
        """Drop everything kept; the kept copy's tensors, if there was one, for the caller
        to empty (its buffers go back to the pool once nothing references them)."""
        spare = self.spare
        self.fast = self.layout = self.spare = self._last = self._released = None
        self._plan_storages = ()
        if spare is None:
            return None
        self._pool.unkeep(spare.serial)
        return spare.tensors

    def keep(self, spare: Spare) -> None:
        """Keep ``spare`` (a released copy of ``fast``'s plan) for the next stage to refill."""
        assert self.spare is None
        assert spare.fast is self.fast
        self.spare = spare
        self._pool.keep(spare.serial, spare.fast.nbytes)

    def take_spare(self) -> Spare | None:
        """The kept copy, no longer kept: the stage that takes it refills it or drops it."""
        spare, self.spare = self.spare, None
        if spare is not None:
            self._pool.unkeep(spare.serial)
        return spare

    def see(self, sources: list[torch.Tensor]) -> Seen | None:
        """The sources' version counters and addresses, read before the copy (``skip_unchanged``).

        Before, not after: a source written while it is being copied (a writer racing the
        stage) may leave this copy torn, and its counter, read after, would then vouch for
        bytes the copy does not hold; read before, it differs by the next stage, which
        copies the storage again.
        """
        if not self._skip_unchanged:
            return None
        versions = versions_of(sources)
        fast = self.fast
        if fast is not None and fast.dtensors is not None and len(versions) == len(fast.dtensors.plain):
            # A DTensor's local is written by its in-place ops without a counter move: 0, never trusted.
            versions = list(map(operator.mul, versions, fast.dtensors.plain))
        return Seen(versions, list(map(_tensor_ptr, sources)))

    def remember(
        self, plan: StagePlan, serial: int, seen: Seen | None, staged: list[torch.Tensor], *, new: bool
    ) -> Steps[None]:
        """Record what the copy ``serial`` (the pool's lease serial) now holds, for
        ``skip_unchanged``: its staged tensors' version counters and, for a ``new`` copy,
        the tensors themselves, weakly (a copy its holder drops must come back to the
        pool): a refilled copy's are known by its :class:`Released` record."""
        self._last = None
        if seen is None or self.fast is None or self.fast.plan is not plan:
            return
        refs: list[weakref.ref[torch.Tensor]] | None = [] if new else None
        versions: list[int] = []

        def visit(block: Sequence[torch.Tensor]) -> None:
            if refs is not None:
                refs.extend(map(weakref.ref, block))
            versions.extend(versions_of(block))

        yield from each_block(staged, visit)
        self._last = Filled(serial, seen, refs, versions)

    def unchanged(self, spare: Spare, seen: Seen | None) -> set[int]:
        """Storages of ``spare`` that already hold what the sources ``seen`` hold (``skip_unchanged``).

        Only for the copy the last stage filled, when its tensors are the very ones that
        stage filled (``as_filled``) and none of them was written since (their version counters), and only
        storages whose every source tensor kept its version counter value and address.
        The sources' storages are those the plan was made of (the re-check compares them
        by address, and the stager keeps them alive: :attr:`_plan_storages`), so an
        address cannot have been freed and re-used by another storage in between.  A
        counter at 0 is never trusted: a new counter starts there (``.data``,
        ``torch.from_numpy``), so equal values would prove nothing; an inference tensor,
        which has none, counts as 0.
        """
        last = self._last
        self._last = None
        if seen is None or last is None or last.serial != spare.serial:
            return set()
        if not spare.as_filled:
            return set()  # a tensor swapped into the copy has a counter of its own
        if versions_of(spare.tensors) != last.staged_versions or 0 in last.staged_versions:
            return set()
        storages = range(len(spare.fast.plan.storages))
        before = last.seen
        if seen == before and 0 not in before.versions:
            return set(storages)
        # A column at a time, each a map of a C function: no Python frame a tensor.
        storage_of = spare.fast.storage_of
        if not len(storage_of) == len(seen.versions) == len(before.versions):
            return set()  # (one plan's sources: never)
        moved = map(
            operator.or_,
            map(operator.ne, seen.versions, before.versions),
            map(operator.ne, seen.data_ptrs, before.data_ptrs),
        )
        changed = set(itertools.compress(storage_of, moved))
        if 0 in before.versions:
            changed.update(itertools.compress(storage_of, map((0).__eq__, before.versions)))
        return set(storages) - changed

    def spare_of(self, fast: FastPlan, staged: Any) -> Steps[Spare | None]:
        """``staged`` as a copy to refill, if it is one whole copy of ``fast``'s plan as it
        was handed out: same tree, tensors, metadata, over all of one copy's buffers."""
        off_plan: list[tuple[int, Any]] = []  # atoms the copy holds other values at than the plan
        tensors = yield from match_in_slices(fast, staged, meta_only=True, patches=off_plan)
        if tensors is None:
            return None
        plan = fast.plan
        if not plan.storages:
            return None
        spare = yield from self._released_again(fast, staged, tensors)
        if spare is None:
            spare = yield from self._check_spare(fast, staged, tensors)
            if spare is not None:
                spare.as_filled = yield from self._as_filled(spare)
                self._released = yield from Released.of(spare, self._skip_unchanged)
        if spare is not None:
            spare.off_plan = tuple(slot for slot, _ in off_plan)
        return spare

    def _as_filled(self, spare: Spare) -> Steps[bool]:
        """Whether ``spare``'s tensors are the very ones the last stage filled, when that
        stage made the copy (its record holds them weakly); a refilled copy is known by its
        :class:`Released` record instead."""
        last = self._last
        if last is None or last.serial != spare.serial or last.staged is None:
            return False
        staged, tensors = last.staged, spare.tensors
        if len(staged) != len(tensors):
            return False
        return (yield from each_block(range(len(tensors)), functools.partial(_same_tensors, staged, tensors)))

    def _released_again(
        self, fast: FastPlan, staged: Any, tensors: list[torch.Tensor]
    ) -> Steps[Spare | None]:
        """``staged`` as a copy to refill, if it is the copy released last time, again.

        That copy was checked whole then (:meth:`_check_spare`); it is the same one
        now if all its buffers are still handed out as that copy (a buffer that came back
        to the pool cannot rejoin it: a copy is never handed out again), none resized, and
        every tensor views the buffer it did (by the storage itself, never a data address:
        a buffer resized away frees its memory for any other storage to take; the offsets
        were checked by the match) and is the tensor it was (a tensor swapped in has a
        version counter of its own).  The copy's tensors are then the ones the stages since
        refilled (``as_filled``).  C-speed comparisons a block at a time, not a Python
        step and three lookups a tensor.
        """
        known = self._released
        pool = self._pool
        if known is None or known.fast is not fast or pool.copy_buffers(known.serial) != len(known.buffers):
            return None
        out = pool.handed_out_buffers()
        buffers: list[Buffer] = []

        def still_known(block: Sequence[int]) -> bool:
            r = cast(range, block)
            try:
                found = list(map(out.__getitem__, known.buffers[r.start : r.stop]))
            except KeyError:
                return False
            if (
                list(map(_nbytes, found)) != known.nbytes[r.start : r.stop]
                or list(map(_cdata, map(_untyped_storage, tensors[r.start : r.stop])))
                != known.tensor_buffers[r.start : r.stop]
                or (known.tensors is not None and not _same_tensors(known.tensors, tensors, r))
            ):
                return False
            buffers.extend(found)
            return True

        if not (yield from each_block(range(max(len(known.buffers), len(tensors))), still_known)):
            return None
        if self._released is not known or pool.copy_buffers(known.serial) != len(buffers):
            return None  # (changed between two slices)
        as_filled = known.tensors is not None
        return Spare(fast, staged, tensors, tuple(buffers), known.serial, as_filled=as_filled)

    def _check_spare(self, fast: FastPlan, staged: Any, tensors: list[torch.Tensor]) -> Steps[Spare | None]:
        """``staged`` (whose ``tensors`` matched ``fast`` in their metadata) as a copy to
        refill, if its tensors view all the buffers of one copy, one buffer a storage."""
        plan = fast.plan
        pool = self._pool
        out = pool.handed_out_buffers()
        storages = plan.storages
        buffers: list[Buffer | None] = [None] * len(storages)
        serial = None
        for spec, t in zip(plan.tensors, tensors, strict=True):
            key = t.untyped_storage()._cdata
            buf = out.get(key)
            if buf is None:
                return None
            s = spec.storage
            have = buffers[s]
            if have is None:
                if buf.nbytes() != storages[s].nbytes:
                    return None
                copy = pool.copy_of(key)
                if serial is None:
                    serial = copy
                elif copy != serial:  # buffers of two copies
                    return None
                buffers[s] = buf
            elif have is not buf:
                return None
            if slice_over():
                yield
        # One buffer per planned storage, all distinct, and every buffer of that copy here:
        # one left out may still be in the caller's hands, and a copy not released is never
        # overwritten.
        if serial is None or None in buffers or not (yield from distinct_in_slices(buffers)):
            return None
        if self._pool.copy_buffers(serial) != len(buffers):
            return None
        return Spare(fast, staged, tensors, tuple(cast(list[Buffer], buffers)), serial)


@dataclasses.dataclass(eq=False, slots=True)
class Spare:
    """A released copy kept whole to be refilled by the next stage of its plan.

    ``tensors`` are the tree's tensors in plan order (the copy targets), ``buffers`` its
    pool buffers in plan storage order.  While kept, they hold the buffers out of the pool.
    """

    fast: FastPlan
    tree: Any
    tensors: list[torch.Tensor]
    buffers: tuple[Buffer, ...]
    serial: int
    as_filled: bool = False
    """Its tensors are, by identity, those that the last fill of its copy wrote."""
    off_plan: tuple[int, ...] = ()
    """Atom slots where the tree holds values other than the plan's (set by a stage)."""

    def storage(self, s: int) -> torch.UntypedStorage:
        """The buffer of planned storage ``s``."""
        return self.buffers[s]


_tensor_ptr: Final = torch.Tensor.data_ptr
_untyped_storage: Final = torch.Tensor.untyped_storage
_nbytes: Final = torch.UntypedStorage.nbytes
_cdata: Final = operator.attrgetter("_cdata")


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Released:
    """What a copy that was released and kept looked like, to know it when released again.

    Holds no buffer (a copy dropped instead must come back to the pool): the buffers by
    their storages' ``_cdata``, in plan storage order.  Those addresses name the buffers
    only while the pool holds them handed out as that copy, which
    :meth:`Reuse._released_again` checks first (a buffer that came back
    cannot rejoin a copy): then no other storage can have their address.
    """

    fast: FastPlan
    serial: int
    buffers: tuple[int, ...]
    nbytes: list[int]
    tensor_buffers: list[int]
    """The buffer (``_cdata``) each tensor views, in plan order."""
    tensors: list[weakref.ref[torch.Tensor]] | None
    """With ``skip_unchanged``, the tensors themselves, weakly (a copy dropped instead must
    come back): a full refill needs the buffers right, not the tensor objects."""

    @classmethod
    def of(cls, spare: Spare, weak: bool) -> Steps[Released]:
        """The record of ``spare``, made a block at a time (``weak``: with its tensors)."""
        keys: list[int] = []
        nbytes: list[int] = []

        def buffers(block: Sequence[Buffer]) -> None:
            keys.extend(map(_cdata, block))
            nbytes.extend(map(_nbytes, block))

        yield from each_block(spare.buffers, buffers)
        of = spare.fast.storage_of
        tensor_buffers: list[int] = []
        refs: list[weakref.ref[torch.Tensor]] | None = [] if weak else None

        def tensors(block: Sequence[int]) -> None:
            r = cast(range, block)
            tensor_buffers.extend(map(keys.__getitem__, of[r.start : r.stop]))
            if refs is not None:
                refs.extend(map(weakref.ref, spare.tensors[r.start : r.stop]))

        yield from each_block(range(len(of)), tensors)
        return cls(spare.fast, spare.serial, tuple(keys), nbytes, tensor_buffers, refs)


_VERSION: Final = operator.attrgetter("_version")

Patches = tuple[AtomSlots, Sequence[tuple[int, Any]]]
"""A plan's atom slots and the changed scalars to put into a staged tree (``set_atoms``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """The version counter and data address of each source tensor, in plan order."""

    versions: list[int]
    data_ptrs: list[int]


@dataclasses.dataclass(eq=False, slots=True)
class Filled:
    """What the last stage copied into the copy ``serial`` (``skip_unchanged``): the
    sources as ``seen`` before that copy, and its staged tensors' counters after it.

    A copy's tensors are known by identity, never by counter values alone (a tensor
    swapped into the copy has a counter of its own, whose value proves nothing): a new
    copy's by ``staged``, held weakly (a copy its holder drops must come back to the
    pool), a refilled one's by its :class:`Released` record, as holding a weak reference
    a tensor at every stage cost a seventh of a refill.
    """

    serial: int
    seen: Seen
    staged: list[weakref.ref[torch.Tensor]] | None
    """The new copy's tensors (``None`` after a refill: the kept copy's)."""
    staged_versions: list[int]


def versions_of(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's version counter, 0 ("never trusted") for an inference tensor, which
    has none (``_version`` raises on one)."""
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:
        return [0 if t.is_inference() else t._version for t in tensors]


_deref: Final = operator.methodcaller("__call__")


def _same_tensors(
    refs: list[weakref.ref[torch.Tensor]], tensors: list[torch.Tensor], block: Sequence[int]
) -> bool:
    """Whether the weakly held ``refs`` are, by identity, ``tensors`` over the range ``block``."""
    r = cast(range, block)
    return all(map(operator.is_, map(_deref, refs[r.start : r.stop]), tensors[r.start : r.stop]))


def empty_tensor(t: torch.Tensor) -> None:
    """Point a staged tensor, and the tensor it is a view of, at no storage (``set_()``).

    A staged conj or neg tensor is a view (:func:`~astage._staging.rebuild.make_tensor`), and its
    ``_base`` holds the buffer too: emptied alone, it left that buffer pinned for as long as
    the tree lived, and a stage waiting for room under the cap waited for ever.
    """
    base = t._base
    t.set_()  # type: ignore[call-overload]
    if base is not None:
        base.set_()  # type: ignore[call-overload]


def empty_all(tensors: list[torch.Tensor]) -> Steps[None]:
    """Empty each tensor (:func:`empty_tensor`), in time slices; the list is emptied too, so that
    no reference to the tensors is left behind in it."""
    tensors.reverse()
    while tensors:
        empty_tensor(tensors.pop())
        if slice_over():
            yield


def as_matched(
    fast: FastPlan | None, plan: StagePlan, rebuilt: list[torch.Tensor], locals_: list[torch.Tensor]
) -> Steps[list[torch.Tensor]]:
    """A new copy's tensors as a re-check of it returns them (``match_in_slices``): the rebuilt
    tensors, but a DTensor's local tensor, which is what its staged storage is known by."""
    if fast is None or fast.plan is not plan or fast.dtensors is None:
        return rebuilt
    out = list(rebuilt)

    def swap(positions: Sequence[int]) -> None:
        for p in positions:
            out[p] = locals_[p]

    yield from each_block(fast.dtensors.positions, swap)
    return out
