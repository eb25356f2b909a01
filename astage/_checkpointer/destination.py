"""Match a checkpoint file's tensors to the caller's live tensors, before any byte is written.

``restore(into=state_dict)`` fills the caller's tensors in place.  This module decides,
from the file's header and the caller's tree alone, whether that can be done and how:
every tensor the file holds must have a tensor of the same dtype, shape and flags at the
same key path of the destination, and every destination tensor a tensor in the file; the
first problem (and how many more there are) is raised as :class:`DestinationMismatchError`
naming the key path and what was expected and found.  Nothing is read before that check.

Then each storage of the file gets a :class:`Mode`:

* ``DIRECT``: the file's bytes are read straight into the caller's storage (CPU, one
  destination storage of exactly the file storage's size, every tensor on it at the file's
  offset and strides, one of them covering it all: nothing outside the caller's tensors is
  written).
* ``BOUNCE``: read into a scratch buffer, verified, then copied into each destination
  tensor (views into a flat buffer, different strides): only the tensors' elements are written.
* ``DEVICE``: a destination on an accelerator: read into a pinned buffer, verified, then
  copied without blocking on a side stream (``whole``: the storage at once).
* ``FRESH``: the file holds a numpy array or an ``io.BytesIO`` there: it comes back new,
  in the returned tree, like the other non-tensor leaves.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch

from .._staging.plan import (
    DictNode,
    Node,
    ObjectNode,
    PlannedSource,
    RefNode,
    SeqNode,
    StagePlan,
    TensorKind,
    TensorNode,
    TensorSpec,
)
from .._util.errors import Attr, DestinationMismatchError, KeyPath
from .._util.timeslice import Steps, slice_over


class Mode(enum.Enum):
    """How one storage of the file reaches the caller's memory."""

    DIRECT = "direct"
    BOUNCE = "bounce"
    DEVICE = "device"
    FRESH = "fresh"


class StorageFill(NamedTuple):
    """What to do with one storage of the file."""

    mode: Mode
    pairs: tuple[tuple[TensorSpec, torch.Tensor], ...]
    """``(the file's tensor, the caller's plain tensor it fills)`` for each tensor on it."""
    whole: torch.UntypedStorage | None
    """``DIRECT`` / whole ``DEVICE``: the caller's storage, written whole."""
    keep: bool
    """The storage's bytes are needed afterwards: the file holds an array or BytesIO on it."""


class Fill(Protocol):
    """Every storage of a copy matched to the caller's memory: what the read, the report and
    the returned tree ask of a match (:class:`FillPlan`, or a same-shape match in columns)."""

    storages: list[StorageFill]
    """Every storage's :class:`StorageFill`, in body order (made whole on access)."""

    def storage(self, s: int) -> StorageFill:
        """What to do with storage ``s`` of the file."""
        ...

    def mode(self, s: int) -> Mode: ...

    def whole(self, s: int) -> torch.UntypedStorage | None:
        """``DIRECT`` / whole ``DEVICE``: the caller's storage that storage ``s`` is written over."""
        ...

    def device_storages(self) -> list[int]:
        """The storages bound for an accelerator (``DEVICE``)."""
        ...

    def fresh(self) -> frozenset[int]:
        """The storages whose bytes the returned tree keeps (arrays, BytesIOs: ``keep`` or ``FRESH``)."""
        ...

    def paths_of(self, s: int) -> Sequence[KeyPath]:
        """The destination key paths of the tensors storage ``s`` fills."""
        ...

    def tensor_paths(self) -> Sequence[KeyPath]:
        """Every destination key path holding a tensor, in the destination's order."""
        ...

    def original(self, position: int) -> Any:
        """The caller's own object (Parameter, DTensor, tensor) filled from the file's tensor
        ``position``, or ``None``."""
        ...


@dataclasses.dataclass
class FillPlan:
    """Every storage of the file matched to the caller's memory, and what the returned tree
    uses (a :class:`Fill`, from the plans of both trees)."""

    storages: list[StorageFill]
    originals: dict[int, Any]
    """The caller's own object (Parameter, DTensor, tensor) for each file tensor it fills."""
    paths: list[list[KeyPath]]
    """For each storage of the file, the destination key paths of the tensors it fills."""
    dest_paths: list[KeyPath] = dataclasses.field(default_factory=list)
    """Every destination key path holding a tensor, in the destination's order."""

    def storage(self, s: int) -> StorageFill:
        return self.storages[s]

    def mode(self, s: int) -> Mode:
        return self.storages[s].mode

    def whole(self, s: int) -> torch.UntypedStorage | None:
        return self.storages[s].whole

    def device_storages(self) -> list[int]:
        return [i for i, f in enumerate(self.storages) if f.mode is Mode.DEVICE]

    def fresh(self) -> frozenset[int]:
        return frozenset(i for i, f in enumerate(self.storages) if f.keep or f.mode is Mode.FRESH)

    def paths_of(self, s: int) -> Sequence[KeyPath]:
        return self.paths[s]

    def tensor_paths(self) -> Sequence[KeyPath]:
        return self.dest_paths

    def original(self, position: int) -> Any:
        return self.originals.get(position)


def places_in_slices(plan: StagePlan) -> Steps[dict[KeyPath, int]]:
    """Every key path at which ``plan``'s tree holds a tensor, and that tensor's position,
    in the tree's order; a container met twice is counted at each of its places."""
    places: dict[KeyPath, int] = {}
    yield from _places_in_slices(plan.root, (), {}, places)
    return places


def _places_in_slices(
    node: Node, path: KeyPath, memo: dict[int, Node], places: dict[KeyPath, int]
) -> Steps[None]:
    if type(node) is TensorNode:
        places[path] = node.position
        return
    children: list[tuple[Node, KeyPath]]
    if isinstance(node, DictNode):
        children = [(v, (*path, k)) for k, v in zip(node.keys, node.values, strict=True)]
        children += [(v, (*path, Attr(k))) for k, v in node.attrs]
    elif isinstance(node, SeqNode):
        children = [(v, (*path, i)) for i, v in enumerate(node.items)]
        children += [(v, (*path, Attr(k))) for k, v in node.attrs]
    elif isinstance(node, ObjectNode):
        children = [(v, (*path, Attr(k))) for k, v in node.fields]
    elif isinstance(node, RefNode):  # the container was walked (and remembered) before
        yield from _places_in_slices(memo[node.memo], path, memo, places)
        return
    else:
        return
    for child, child_path in children:
        if type(child) is TensorNode:
            places[child_path] = child.position
        else:
            yield from _places_in_slices(child, child_path, memo, places)
        if slice_over():
            yield
    memo[node.memo] = node  # as the planner numbers it: once its items are walked


def _describe(spec: TensorSpec) -> str:
    return f"a {str(spec.dtype).removeprefix('torch.')} tensor of shape {tuple(spec.size)}"


def _overlaps(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a strided view may reach one element from two indices (a sufficient test:
    dims sorted by stride, each stride past the reach of the smaller ones)."""
    dims = sorted((s, n) for n, s in zip(size, stride, strict=True) if n > 1)
    reach = 0
    for s, n in dims:
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def layout_problem(want: TensorSpec, have: TensorSpec) -> str | None:
    """Why the caller's tensor ``have`` cannot take the file's ``want``, or ``None``."""
    if have.dtype != want.dtype or tuple(have.size) != tuple(want.size):
        return f"expected {_describe(want)}, found {_describe(have)}"
    for flag, name in (("conj", "a conjugate bit"), ("neg", "a negative bit")):
        if getattr(want, flag) != getattr(have, flag):
            wanted, found = ("with", "without") if getattr(want, flag) else ("without", "with")
            return f"expected {_describe(want)} {wanted} {name}, found one {found}"
    return None


def _leaf_name(kind: TensorKind) -> str:
    return "a numpy array" if kind is TensorKind.NDARRAY else "an io.BytesIO"


def match_in_slices(file_plan: StagePlan, dest: PlannedSource, into: Any) -> Steps[FillPlan]:
    """The :class:`FillPlan` of filling ``into`` (planned as ``dest``) from a file of ``file_plan``.

    :raises DestinationMismatchError: a tensor missing on either side, or of another dtype,
        shape or flags, or a destination that cannot be written faithfully.
    """
    file_places = yield from places_in_slices(file_plan)
    dest_places = yield from places_in_slices(dest.plan)
    problems: list[tuple[KeyPath, str]] = []
    assigned: dict[int, int] = {}  # destination position -> file position
    for path, fpos in file_places.items():
        want = file_plan.tensors[fpos]
        dpos = dest_places.get(path)
        if want.kind in (TensorKind.NDARRAY, TensorKind.BYTESIO):
            if dpos is not None:
                problems.append(
                    (path, f"the file holds {_leaf_name(want.kind)} here, the destination a tensor")
                )
            continue
        if dpos is None:
            problems.append((path, f"missing from the destination: the file holds {_describe(want)} here"))
            continue
        if assigned.setdefault(dpos, fpos) != fpos:
            problems.append((path, "this destination tensor also sits where the file holds another tensor"))
            continue
        problem = layout_problem(want, dest.plan.tensors[dpos])
        if problem is not None:
            problems.append((path, problem))
        if slice_over():
            yield
    for path in dest_places:
        if path not in file_places:
            problems.append((path, "unexpected: the file holds no tensor here"))
        if slice_over():
            yield
    if problems:
        raise DestinationMismatchError(problems)
    return (yield from _fill_plan_in_slices(file_plan, dest, into, assigned, dest_places))


def _fill_plan_in_slices(
    file_plan: StagePlan,
    dest: PlannedSource,
    into: Any,
    assigned: Mapping[int, int],
    dest_places: Mapping[KeyPath, int],
) -> Steps[FillPlan]:
    by_storage: list[list[int]] = [[] for _ in file_plan.storages]  # destination positions
    for dpos, fpos in assigned.items():
        by_storage[file_plan.tensors[fpos].storage].append(dpos)
        if slice_over():
            yield
    users: dict[int, int] = {}  # destination storage -> file storages filling it
    for dposes in by_storage:
        for d in {dest.plan.tensors[p].storage for p in dposes}:
            users[d] = users.get(d, 0) + 1
        if slice_over():
            yield
    back = dict(assigned)
    leaves = (TensorKind.NDARRAY, TensorKind.BYTESIO)
    kept = frozenset(t.storage for t in file_plan.tensors if t.kind in leaves)
    pairing = _Pairing(file_plan, dest, back, users, kept)
    fills: list[StorageFill] = []
    problems: list[tuple[KeyPath, str]] = []
    for s, dposes in enumerate(by_storage):
        fill, problem = pairing.fill(s, dposes)
        fills.append(fill)
        if problem is not None:
            problems.append(problem)
        if slice_over():
            yield
    if problems:
        raise DestinationMismatchError(problems)
    paths: list[list[KeyPath]] = [[] for _ in file_plan.storages]
    for path, dpos in dest_places.items():
        paths[file_plan.tensors[back[dpos]].storage].append(path)
        if slice_over():
            yield
    originals: dict[int, Any] = {}
    for fpos in assigned.values():
        originals[fpos] = _lookup(into, file_plan.tensors[fpos].key_path)
        if slice_over():
            yield
    return FillPlan(fills, originals, paths, list(dest_places))


@dataclasses.dataclass(frozen=True)
class _Pairing:
    """The file's tensors paired with the destination's (``back``: destination position ->
    file position), and how many file storages fill each destination storage (``users``)."""

    file_plan: StagePlan
    dest: PlannedSource
    back: Mapping[int, int]
    users: Mapping[int, int]
    kept: frozenset[int]
    """File storages whose bytes the returned tree needs (an array or BytesIO on them)."""

    def fill(self, s: int, dposes: list[int]) -> tuple[StorageFill, tuple[KeyPath, str] | None]:
        """The fill of file storage ``s`` (filling the destination tensors ``dposes``), or why not."""
        file_plan, dest = self.file_plan, self.dest
        keep = s in self.kept
        if len(dposes) == 1 and not keep:
            direct = self._direct_one(s, dposes[0])
            if direct is not None:
                return direct, None
        pairs = tuple((file_plan.tensors[self.back[d]], dest.tensors[d]) for d in dposes)
        if not pairs:
            return StorageFill(Mode.FRESH, (), None, True), None
        on_cpu = all(local.is_cpu for _, local in pairs)
        one_device = len({local.device for _, local in pairs}) == 1
        whole = self._whole(s, dposes) if one_device and not keep else None
        if whole is None:
            for d in dposes:
                spec = dest.plan.tensors[d]
                if _overlaps(tuple(spec.size), tuple(spec.stride)):
                    problem = (
                        f"the destination tensor overlaps itself (stride {tuple(spec.stride)}) and does not "
                        "share the file's layout: it cannot be filled element by element"
                    )
                    return StorageFill(Mode.BOUNCE, pairs, None, keep), (spec.key_path, problem)
        mode = (Mode.DIRECT if whole is not None else Mode.BOUNCE) if on_cpu else Mode.DEVICE
        return StorageFill(mode, pairs, whole, keep), None

    def _whole(self, s: int, dposes: list[int]) -> torch.UntypedStorage | None:
        """The caller's storage as bytes, where file storage ``s`` may be written over it whole:
        one destination storage of the same size, filled from no other file storage, every
        tensor on it at the file's offset and strides, one of them covering all of it."""
        dest = self.dest
        dstorages = {dest.plan.tensors[d].storage for d in dposes}
        if len(dstorages) != 1:
            return None
        d = next(iter(dstorages))
        nbytes = self.file_plan.storages[s].nbytes
        if self.users[d] != 1 or dest.plan.storages[d].nbytes != nbytes:
            return None
        for p in dposes:
            have, want = dest.plan.tensors[p], self.file_plan.tensors[self.back[p]]
            if have.offset != want.offset or tuple(have.stride) != tuple(want.stride):
                return None
        if not any(_covers(dest.tensors[p], nbytes) for p in dposes):
            return None
        return dest.storages[d]

    def _direct_one(self, s: int, d: int) -> StorageFill | None:
        """The common case at a glance, from the plans' records alone: one CPU tensor alone on a
        storage of the file storage's size, at its offset and strides, covering it."""
        have, want = self.dest.plan.tensors[d], self.file_plan.tensors[self.back[d]]
        storage = self.dest.plan.storages[have.storage]
        nbytes = self.file_plan.storages[s].nbytes
        if (
            storage.nbytes != nbytes
            or have.offset != want.offset
            or have.stride != want.stride
            or storage.device.type != "cpu"
            or self.users[have.storage] != 1
            or have.offset
            or _dense_reach(have.size, have.stride) * have.dtype.itemsize != nbytes
        ):
            return None
        return StorageFill(
            Mode.DIRECT, ((want, self.dest.tensors[d]),), self.dest.storages[have.storage], False
        )


def _dense_reach(size: Sequence[int], stride: Sequence[int]) -> int:
    """The elements a view spans where it is dense in some order of its dims (expanded, stride
    0, dims aside), else -1: each stride, smallest first, the reach of those before it."""
    reach = 1
    for st, n in sorted((st, n) for n, st in zip(size, stride, strict=True) if n > 1 and st):
        if st != reach:
            return -1
        reach *= n
    return reach


def _covers(local: torch.Tensor, nbytes: int) -> bool:
    """Whether ``local`` reaches every byte of its ``nbytes``-byte storage and nothing twice
    but along expanded (stride 0) dims: dense in some order of its dims, from offset 0."""
    if local.storage_offset() != 0:
        return False
    return _dense_reach(local.shape, local.stride()) * local.element_size() == nbytes


def _lookup(tree: Any, path: KeyPath) -> Any:
    """The object at ``path`` in ``tree`` (dict keys, sequence indices, attributes)."""
    for entry in path:
        tree = getattr(tree, entry.name) if isinstance(entry, Attr) else tree[entry]
    return tree
