"""Re-check a plan against a later state_dict: the fast path of a repeated stage.

Planning 20,000 tensors costs more than copying them.  A later stage of a state_dict with
the same structure re-uses the plan after checking, per tensor, everything the plan was
derived from (:func:`match_in_slices`).  Object identity is never trusted: ``model.state_dict()``
returns new tensor objects (and new dicts) every call.  A DTensor (every FSDP2
``get_state_dict``, which returns new DTensors over the same local storages for parameters
and the very same ones for optimizer state) is checked around its local tensor
(:class:`DTensorColumns`) and its local as a plain tensor is.

Reading a tensor's fields from Python costs ~0.1 us each, ten of them a tensor.  Where
this torch has dynamo's C++ ``TensorGuards`` (type, dtype, dispatch keys, which carry the
conj and neg bits, ``requires_grad``, sizes and strides of many tensors in one call, ~10x
cheaper), a chunk of tensors that passed the full check once gets one, built from those
very tensors, and later checks ask it and read only the storage, its size and the offset
in Python.  It only ever speeds up a "yes": a chunk it refuses (another thread-local mode
changes the dispatch keys, say) gets the full check, which decides.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from .._util.timeslice import Steps, distinct_in_slices, each_block, slice_over
from . import guards
from .plan import (
    AtomNode,
    DictNode,
    Node,
    PlannedSource,
    SeqNode,
    StagePlan,
    TensorKind,
    TensorNode,
    TensorSpec,
    dtensor_class,
)


def tensor_signature(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything a plan records about one tensor, as one tuple compared in C.

    The storage is named by its ``StorageImpl`` (``_cdata``, what the planner groups
    storages by) with its byte size, so a tensor moved to another storage (``set_``,
    ``.data =``), a storage resized, or two tensors that start or stop sharing one, all
    change some tensor's signature.  An address names the same storage only while that
    storage cannot be freed: equal addresses at one instant decide the plan's grouping
    whatever was freed before, but a claim that a storage is the one seen at an earlier
    stage (``skip_unchanged``) holds only because the stager keeps the plan's source
    storages alive.  Layouts the plan refuses need no field of their own:
    sparse, mkldnn and compressed tensors have no storage and nested ones no strides, so
    reading the signature of one raises (and the re-check fails).  About 1 us a tensor:
    every field read costs, so nothing is read twice.

    Every field is an atom (the type by its ``id``: classes live as long as the program,
    and ``shape`` compares equal to the plain tuple a plan keeps), so the cyclic collector
    stops tracking a plan's signatures after its first look at them: a plan of 20,000
    tensors does not add 20,000 objects to every later full collection.
    """
    st = t.untyped_storage()
    return (
        id(type(t)),
        t.dtype,
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.requires_grad,
        t.is_conj(),
        t.is_neg(),
        st._cdata,
        st.nbytes(),
    )


_META = slice(0, 8)
"""The part of a :func:`tensor_signature` that is not about which storage the tensor views."""


_EQUAL_ATOMS: frozenset[type] = frozenset({int, str, bytes, type(None), torch.Size, torch.device})
"""Atom types whose ``==`` means "the same value" (``bool``, ``dtype`` are singletons)."""


def _same_atom(old: Any, new: Any) -> bool:
    if new is old:
        return True
    cls = type(old)
    if type(new) is not cls:
        return False
    if cls in _EQUAL_ATOMS:
        return bool(new == old)
    if cls is float:  # NaN never equals itself (re-plan), and -0.0 == 0.0 must not pass
        return bool(new == old) and (new != 0.0 or str(new) == str(old))
    return False


_PATCHABLE: frozenset[type] = frozenset({type(None), bool, int, float, complex, str, bytes})
"""Atoms a later stage may bring changed without a new plan: the scalars a training loop
updates every step (a learning rate under a scheduler, a step count, a loss, a tag)."""


Trail = tuple[int, ...]
"""A leaf's place in a plan: the child positions (:func:`plan_children`) from the root down."""


def plan_children(node: Node) -> tuple[Node, ...]:
    """A container's children in walk order: a dict's values, then its attributes'."""
    if type(node) is DictNode:
        return node.values + tuple(value for _, value in node.attrs) if node.attrs else node.values
    if type(node) is SeqNode:
        return node.items
    return ()


def scalar_trails_in_slices(root: Node) -> Steps[tuple[Trail, ...]]:
    """Every atom's trail in a plan, numbered in walk order (a dict's values, then its
    attributes; a sequence's items; a container met again is a reference, not walked
    again), in time slices.  The one numbering of a plan's scalars: a checkpoint file's
    scalar table (:mod:`astage._format.scalars`) and :class:`AtomSlots` use it."""
    if type(root) is AtomNode:
        return ((),)
    out: list[Trail] = []
    stack: list[tuple[Trail, tuple[Node, ...], int]] = [((), plan_children(root), 0)]
    while stack:
        trail, nodes, at = stack.pop()
        for i in range(at, len(nodes)):
            child = nodes[i]
            if type(child) is AtomNode:
                out.append((*trail, i))
            elif type(child) is DictNode or type(child) is SeqNode:
                stack.append((trail, nodes, i + 1))
                stack.append(((*trail, i), plan_children(child), 0))
                break
            if not i & 1023 and slice_over():  # a long list (an optimizer's params) goes on later
                stack.append((trail, nodes, i + 1))
                break
        if slice_over():
            yield
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class AtomSlots:
    """Where a plan's patchable atoms sit: each one directly in a plain dict or a list (its
    *slot*), so a staged tree can take a new value in place (:func:`set_atoms`).

    A slot is named by the atom's number in the walk of :func:`scalar_trails_in_slices` (every
    atom counted): the index of its entry in a checkpoint file's scalar table, so a patch
    names the same scalar for the stager, the layout cache and the file, and its place is
    that walk's trail.  An atom in a tuple, or in an object's attributes, has no slot: a
    change there re-plans.
    """

    by_values: dict[int, tuple[int, ...]]
    """``id(node.values or node.items)`` -> the slot of each position, ``-1`` for none."""
    trails: Mapping[int, Trail] = dataclasses.field(default_factory=dict)
    """Each slot's trail in :attr:`root`."""
    root: Node | None = None
    """The plan's root: what names each step of a trail in a staged tree."""
    nodes: Mapping[int, AtomNode] = dataclasses.field(default_factory=dict)
    """The plan's :class:`AtomNode` at each slot (its ``value`` is the plan's)."""
    count: int = 0
    """How many atoms the plan holds, slots or not (its scalar table's length)."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class FastPlan:
    """A plan with what is needed to check that a later state_dict has the same one.

    ``signatures[i]`` is :func:`tensor_signature` of ``plan.tensors[i]``'s source when the
    plan was made; ``key_types`` the types of every dict's keys, by memo.
    """

    plan: StagePlan
    signatures: tuple[tuple[Any, ...], ...]
    key_types: dict[int, tuple[type, ...]]
    nbytes: int
    runs: dict[int, int]
    """Containers whose items are all tensors met there first, at consecutive positions:
    ``id(node.values or node.items)`` -> the first position (checked in one tight loop)."""
    guards: dict[int, tuple[Any, tuple[tuple[Any, ...], ...]]] = dataclasses.field(default_factory=dict)
    """Chunks of the plan's tensors that passed a full check, by first position: their
    ``TensorGuards`` and the columns left to check in Python (offsets, storages, their
    sizes; and that no tensor has attributes)."""
    shared: tuple[int, ...] = ()
    """Positions of the tensors whose storage the plan has other tensors view too: the only
    ones that can be one tensor object at two positions and pass the storage check."""
    meta_guards: dict[int, tuple[Any, tuple[tuple[Any, ...], ...]]] = dataclasses.field(default_factory=dict)
    """The same for ``meta_only`` checks (a staged copy's tensors: offsets, no attributes)."""
    atoms: AtomSlots = AtomSlots({})
    """The plan's patchable atoms (:func:`match_in_slices`'s ``patches``)."""
    storage_of: Sequence[int] = ()
    """Each planned tensor's storage index, in plan order (a column made once per plan)."""
    dtensors: DTensorColumns | None = None
    """The plan's DTensors, as checked around their local tensors (``None``: there are none)."""
    meta_signatures: tuple[tuple[Any, ...], ...] | None = None
    """The signatures a staged copy's tensors have where they differ from the sources'
    (``None``: they do not): a staged DTensor's local is a plain tensor without grad."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DTensorColumns:
    """What a plan's DTensors were besides their local tensors, a column each, in the
    order of their plan positions.

    A DTensor is the same as the planned one when its type, ``requires_grad``, attributes
    (none) and spec are: the spec's device mesh by identity (a mesh is a process group's
    view; torch hands the same one out with every ``get_state_dict``), its other fields
    (placements, global shape, stride and dtype, shard order) by value, which is identity
    first (torch re-uses the very spec objects across calls) and an equal value else.  The
    fields are the values recorded at planning, not the spec object: a spec changed in
    place does not pass.  Its local tensor is then checked as a plain tensor is.
    """

    positions: tuple[int, ...]
    requires_grad: tuple[bool, ...]
    meshes: tuple[Any, ...]
    fields: tuple[tuple[Any, ...], ...]
    """Each spec's fields but the mesh (:func:`_spec_fields`)."""
    plain: tuple[int, ...]
    """Per planned tensor, 0 for a DTensor and 1 for any other: an in-place op on a DTensor
    writes its local without moving the local's version counter (DTensor dispatches below
    autograd), so ``skip_unchanged`` must never trust a DTensor's counter."""


_spec_getters: dict[type, Any] = {}


def _spec_fields(spec_cls: type) -> Any:
    """A C getter of every dataclass field of ``spec_cls`` (DTensorSpec) but ``mesh``, as a tuple."""
    getter = _spec_getters.get(spec_cls)
    if getter is None:
        names = [f.name for f in dataclasses.fields(spec_cls) if f.name != "mesh"]
        getter = _spec_getters[spec_cls] = operator.attrgetter(*names) if len(names) > 1 else None
        if getter is None:  # pragma: no cover - DTensorSpec has had placements and more since 2.4
            raise TypeError(f"{spec_cls.__qualname__} has too few fields to check")
    return getter


def _dtensor_columns_in_slices(source: PlannedSource) -> Steps[DTensorColumns | None]:
    """The :class:`DTensorColumns` of ``source``'s plan (``None``: it has no DTensor)."""
    positions: list[int] = []
    dtensor = TensorKind.DTENSOR
    for start in range(0, len(source.plan.tensors), 2048):
        block = source.plan.tensors[start : start + 2048]
        positions += itertools.compress(
            range(start, start + len(block)), map(functools.partial(operator.is_, dtensor), map(_kind, block))
        )
        if slice_over():
            yield
    if not positions:
        return None
    tensors = source.plan.tensors
    grads: list[bool] = []
    meshes: list[Any] = []
    fields: list[tuple[Any, ...]] = []
    spec_cls = type(tensors[positions[0]].dtensor_spec)
    getter = _spec_fields(spec_cls)
    for start in range(0, len(positions), _UNWRAP_BLOCK):  # ~1 us a DTensor
        specs = [tensors[p].dtensor_spec for p in positions[start : start + _UNWRAP_BLOCK]]
        if set(map(type, specs)) != {spec_cls}:
            return None  # (one torch has one spec class)
        grads += (tensors[p].requires_grad for p in positions[start : start + _UNWRAP_BLOCK])
        meshes += map(_mesh, specs)
        fields += map(getter, specs)
        if slice_over():
            yield
    plain = [1] * len(tensors)
    for start in range(0, len(positions), 2048):
        for p in positions[start : start + 2048]:
            plain[p] = 0
        if slice_over():
            yield
    return DTensorColumns(tuple(positions), tuple(grads), tuple(meshes), tuple(fields), tuple(plain))


_KEY_ATOMS = frozenset({str, int, bool, bytes, type(None)})


class _SlotsMade:
    """:class:`AtomSlots` as :func:`_eligible` finds them: every atom numbered in walk order
    (as :func:`scalar_trails_in_slices` numbers them), and the patchable ones given that number
    as their slot."""

    def __init__(self) -> None:
        self.by_values: dict[int, tuple[int, ...]] = {}
        self.nodes: dict[int, AtomNode] = {}
        self.count = 0

    def add(self, node: AtomNode, slots: list[int] | None, i: int) -> None:
        """Number atom ``node``, child ``i`` of its container; where ``slots`` (that
        container's slots: a dict's values or a list's items) is given and the value can be
        patched, it is a slot of that number."""
        k = self.count
        self.count = k + 1
        if slots is not None and i < len(slots) and type(node.value) in _PATCHABLE:
            slots[i] = k
            self.nodes[k] = node

    def close(self, nodes: tuple[Node, ...], slots: list[int] | None) -> None:
        """Record the slots of a container's values or items, if it has any."""
        if slots is not None and any(k >= 0 for k in slots):
            self.by_values[id(nodes)] = tuple(slots)

    def made_in_slices(self, root: Node) -> Steps[AtomSlots]:
        """The slots, each with its trail (``{}`` where the walks disagree: no patches)."""
        trails = yield from scalar_trails_in_slices(root)
        if len(trails) != (1 if type(root) is AtomNode else self.count):
            return AtomSlots({})  # pragma: no cover - one walk order, counted twice
        slot_trails: dict[int, Trail] = {}

        def take(slots: Sequence[int]) -> None:
            slot_trails.update(zip(slots, map(trails.__getitem__, slots), strict=True))

        yield from each_block(list(self.nodes), take)
        return AtomSlots(self.by_values, slot_trails, root, self.nodes, len(trails))


def _eligible(
    node: Node,
    key_types: dict[int, tuple[type, ...]],
    runs: dict[int, int],
    slots: _SlotsMade,
) -> Steps[bool]:
    """Whether a re-check can prove ``node``'s subtree unchanged: plain dicts, lists,
    tuples, immutable atoms and tensors, Parameters or DTensors without attributes only
    (anything else is planned anew at every stage).  Numbers the subtree's atoms on the way."""
    here: list[int] | None = None  # the slots of a dict's values or a list's items
    match node:
        case AtomNode() | TensorNode():
            return True
        case DictNode(memo, keys, values, proto, attrs) if (proto is None and not attrs) or type(
            proto
        ) is collections.OrderedDict:
            # OrderedDict: what nn.Module.state_dict() returns, with its `_metadata` attribute.
            types_ = tuple(map(type, keys))
            if not _KEY_ATOMS.issuperset(types_):
                return False
            key_types[memo] = types_
            if not _all_tensor_nodes(values):
                here = [-1] * len(values)
            children: tuple[Node, ...] = values + tuple(n for _, n in attrs)
        case SeqNode(_, cls, items, None, ()) if cls is list or cls is tuple:
            if cls is list and not _all_tensor_nodes(items):
                here = [-1] * len(items)
            children = items
        case _:
            return False
    for i, child in enumerate(children):
        if type(child) is AtomNode:
            slots.add(child, here, i)
        elif type(child) is not TensorNode and not (yield from _eligible(child, key_types, runs, slots)):
            return False
        if slice_over():  # an optimizer's state: thousands of small dicts
            yield
    items_ = node.values if type(node) is DictNode else node.items  # type: ignore[union-attr]
    slots.close(items_, here)
    if items_ and _all_tensor_nodes(items_):
        first = items_[0].position  # type: ignore[union-attr]
        # At C speed, a block at a time: a generator over a module's 20,000 tensors held
        # the loop ~3 ms.
        for start in range(0, len(items_), 2048):
            block = items_[start : start + 2048]
            if list(map(_position, block)) != list(range(first + start, first + start + len(block))):
                return True
            if slice_over():
                yield
        runs[id(items_)] = first
    return True


_position = operator.attrgetter("position")


def _all_tensor_nodes(nodes: Sequence[Node]) -> bool:
    """Whether every node is a :class:`TensorNode` (at C speed)."""
    return set(map(type, nodes)) <= {TensorNode}


def fast_plan_in_slices(source: PlannedSource) -> Steps[FastPlan | None]:
    """The checkable form of ``source``'s plan, or ``None`` where it cannot be re-checked."""
    plan = source.plan
    for i, spec in enumerate(plan.tensors):
        if spec.attrs is not None:
            return None
        if not i & 1023 and slice_over():
            yield
    dtensors = yield from _dtensor_columns_in_slices(source)
    key_types: dict[int, tuple[type, ...]] = {}
    runs: dict[int, int] = {}
    slots = _SlotsMade()
    if not (yield from _eligible(plan.root, key_types, runs, slots)):
        return None
    atoms = yield from slots.made_in_slices(plan.root)
    cdata: list[int] = []
    yield from each_block(source.storages, lambda block: cdata.extend(map(_cdata, block)))
    signatures, meta_signatures = yield from _signatures(source, cdata)
    nbytes, of, shared = yield from _storage_columns(plan)
    fast = FastPlan(
        plan,
        signatures,
        key_types,
        nbytes,
        runs,
        shared=shared,
        atoms=atoms,
        storage_of=of,
        dtensors=dtensors,
        meta_signatures=meta_signatures,
    )
    yield from _arm_guards(fast, source)
    return fast


def _signatures(
    source: PlannedSource, cdata: list[int]
) -> Steps[tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...] | None]]:
    """What ``tensor_signature()`` would read of each source, built from what the plan
    recorded of them (no tensor is asked again); and, where a DTensor's staged local differs
    from its source local, the signatures a staged copy's tensors have."""
    plan = source.plan
    storages = plan.storages
    cls = {TensorKind.TENSOR: id(torch.Tensor), TensorKind.PARAMETER: id(torch.nn.Parameter)}
    signatures = []
    dtensor = TensorKind.DTENSOR
    odd: list[int] = []  # DTensors whose staged local's signature is not their source local's
    for i, spec in enumerate(plan.tensors):
        s = spec.storage
        if spec.kind is dtensor:
            # A DTensor's local's own type and grad flag (the DTensor's are in the columns).
            local = source.tensors[i]
            kind, grad = id(type(local)), local.requires_grad
            if grad or kind != id(torch.Tensor):
                odd.append(i)
        else:
            kind, grad = cls[spec.kind], spec.requires_grad
        signatures.append(
            (
                kind,
                spec.dtype,
                spec.size,
                spec.stride,
                spec.offset,
                grad,
                spec.conj,
                spec.neg,
                cdata[s],
                storages[s].nbytes,
            )
        )
        if slice_over():
            yield
    meta_signatures = None
    if odd:  # a staged copy's local is a plain tensor without grad
        meta = list(signatures)
        for p in odd:
            meta[p] = (id(torch.Tensor), *meta[p][1:5], False, *meta[p][6:])
        meta_signatures = tuple(meta)
    return tuple(signatures), meta_signatures


def _storage_columns(plan: StagePlan) -> Steps[tuple[int, list[int], tuple[int, ...]]]:
    """The plan's bytes, each tensor's storage, and the tensors that share a storage (at C
    speed, a block at a time: neither a Python step a tensor nor one pass over all)."""
    sizes: list[int] = []
    yield from each_block(plan.storages, lambda block: sizes.append(sum(s.nbytes for s in block)))
    of: list[int] = []
    views: collections.Counter[int] = collections.Counter()

    def count(block: Sequence[TensorSpec]) -> None:
        storage_of = list(map(_storage_of, block))
        of.extend(storage_of)
        views.update(storage_of)

    yield from each_block(plan.tensors, count)
    shared: tuple[int, ...] = ()
    if len(views) != len(of):
        shared = tuple(itertools.compress(range(len(of)), map((1).__lt__, map(views.__getitem__, of))))
    return sum(sizes), of, shared


def _arm_guards(fast: FastPlan, source: PlannedSource) -> Steps[None]:
    """Arm the chunk guards of a new ``fast`` plan from the sources it was made of.

    The sources are what the plan was made of, so each chunk passes the full check as it
    stands: its guard is armed now, and the next stage, not the one after, is guarded (a
    full check and the guards built on the stage's path made the first re-check twice as
    slow as the later ones).
    """
    if not guards.AVAILABLE:
        return
    for start in range(0, len(source.tensors), _CHUNK):
        chunk = source.tensors[start : start + _CHUNK]
        expected = fast.signatures[start : start + len(chunk)]
        if tuple(id(type(t)) for t in chunk) == tuple(sig[0] for sig in expected):
            guards.arm(fast.guards, start, chunk, expected, meta_only=False)
        if slice_over():
            yield


_CHUNK = guards.CHUNK
"""Tensors checked together (one guard, one look at the clock) in :meth:`_Matcher.tensors`."""


class _Matcher:
    """Walks a state_dict alongside a plan, collecting its tensors in plan order.

    The walk checks containers, keys and atoms and only collects tensors; their checks come
    after (:meth:`tensors`), over the flat list in chunks of :data:`_CHUNK`, so that one
    guard covers many small containers (an optimizer's ``{"exp_avg", "exp_avg_sq"}`` per
    parameter) instead of a guard call each.
    """

    def __init__(self, fast: FastPlan, meta_only: bool, patches: list[tuple[int, Any]] | None) -> None:
        self.meta_only = meta_only
        self.patches = patches
        self.slots = fast.atoms.by_values
        self.signatures = fast.signatures
        if meta_only and fast.meta_signatures is not None:
            self.signatures = fast.meta_signatures
        self.key_types = fast.key_types
        self.runs = fast.runs
        self.guards = fast.meta_guards if meta_only else fast.guards
        self.sources: list[Any] = []
        self.containers: set[int] = set()
        self.keepalive: list[object] = []  # ids stay unique only while the objects live

    def enter(self, x: Any) -> bool:
        """Whether ``x`` is met for the first time (a container met twice would be a
        RefNode, or a refused cycle, in a new plan)."""
        if id(x) in self.containers:
            return False
        self.containers.add(id(x))
        self.keepalive.append(x)
        return True

    def dict_items(self, node: DictNode, x: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """The values and attribute values of dict ``x`` if its type, keys and attribute
        names are ``node``'s; one snapshot, taken before the walk yields, so
        another task that changes ``x`` meanwhile cannot tear the walk."""
        proto = node.prototype
        if type(x) is not (dict if proto is None else type(proto)):
            return None
        keys, values = tuple(x), tuple(x.values())
        if len(keys) != len(values) or keys != node.keys:
            return None
        if tuple(map(type, keys)) != self.key_types[node.memo]:
            return None
        if proto is None:  # a plain dict has no attributes
            return values, ()
        state = getattr(x, "__dict__", None) or {}
        names, attr_values = tuple(state), tuple(state.values())
        if names != tuple(name for name, _ in node.attrs):
            return None
        return values, attr_values

    def container(self, node: Node, x: Any) -> Steps[bool]:
        if not self.enter(x):
            return False
        if type(node) is DictNode:
            items = self.dict_items(node, x)
            if items is None:
                return False
            # The planner walks the items first, then the attributes: tensors keep their order.
            if not (yield from self.many(node.values, items[0])):
                return False
            return (yield from self.many(tuple(n for _, n in node.attrs), items[1]))
        if type(node) is SeqNode:
            if type(x) is not node.cls:
                return False
            values: tuple[Any, ...] = tuple(cast(Any, x))
            if len(values) != len(node.items):
                return False
            return (yield from self.many(node.items, values))
        return False  # pragma: no cover - an eligible plan holds no other node

    def run_dict(self, node: DictNode, x: Any) -> bool:
        """A dict whose items are all tensors met there first (the common leaf), without a
        generator: its tensors are collected, and checked later with the rest."""
        if not self.enter(x):
            return False
        items = self.dict_items(node, x)
        if items is None or items[1]:
            return False
        self.sources.extend(items[0])
        return True

    def many(self, nodes: tuple[Node, ...], values: tuple[Any, ...]) -> Steps[bool]:
        sources, append, runs = self.sources, self.sources.append, self.runs
        if len(values) != len(nodes):
            return False
        first = runs.get(id(nodes))
        if first is not None and first == len(sources):
            sources.extend(values)
            return True
        try:
            for node, v in zip(nodes, values, strict=True):
                cls = type(node)
                if cls is TensorNode:
                    p = node.position  # type: ignore[union-attr]
                    n = len(sources)
                    if p == n:
                        append(v)
                    elif p > n or v is not sources[p]:  # the plan met this very tensor before
                        return False
                elif cls is AtomNode:
                    if not _same_atom(node.value, v) and not self.patch(nodes, node, v):  # type: ignore[union-attr]
                        return False
                elif (
                    cls is DictNode
                    and not node.attrs  # type: ignore[union-attr]
                    and runs.get(id(node.values)) == len(sources)  # type: ignore[union-attr]
                ):
                    if not self.run_dict(node, v):  # type: ignore[arg-type]
                        return False
                elif not (yield from self.container(node, v)):
                    return False
                if slice_over():
                    yield
        except Exception:  # a value the plan never saw
            return False
        return True

    def patch(self, nodes: tuple[Node, ...], node: Node, value: Any) -> bool:
        """Note ``value`` for ``node``'s slot, if the caller takes patches and it has one."""
        slots = self.slots.get(id(nodes))
        if self.patches is None or slots is None or type(value) not in _PATCHABLE:
            return False
        slot = slots[next(i for i, n in enumerate(nodes) if n is node)]
        if slot < 0:
            return False
        self.patches.append((slot, value))
        return True

    def tensors(self) -> Steps[bool]:
        """Check every collected value against its planned tensor, a chunk at a time: by its
        guard where the chunk passed in full once, else in full (which then arms one)."""
        sources, signatures = self.sources, self.signatures
        for start in range(0, len(sources), _CHUNK):
            chunk = tuple(sources[start : start + _CHUNK])
            if not self.guarded(start, chunk):
                expected = signatures[start : start + len(chunk)]
                try:
                    if not self.full(chunk, expected):
                        return False
                except Exception:  # not a tensor, or one with no storage (sparse, nested, ...)
                    return False
                if guards.AVAILABLE:
                    guards.arm(self.guards, start, chunk, expected, self.meta_only)
            if slice_over():
                yield
        return True

    def full(self, chunk: tuple[Any, ...], expected: tuple[tuple[Any, ...], ...]) -> bool:
        """Every field of every tensor of ``chunk`` (raises on a value that is not one)."""
        got = tuple(map(tensor_signature, chunk))
        if self.meta_only:  # release(): the staged copy's storages are checked apart
            got, expected = tuple(g[_META] for g in got), tuple(e[_META] for e in expected)
        return got == expected and not any(v.__dict__ for v in chunk)

    def guarded(self, position: int, chunk: tuple[Any, ...]) -> bool:
        """Whether the chunk's guard passes it: a "no" only means "check it in full"."""
        return guards.passes(self.guards, position, chunk, self.meta_only)


def _unwrap_in_slices(columns: DTensorColumns, values: list[Any]) -> Steps[list[Any] | None]:
    """``values`` with each planned DTensor replaced by its local tensor, if every one is
    the planned DTensor but for its local (:class:`DTensorColumns`), else ``None``.

    A column at a time, a block of DTensors at a time: each a ``map`` of a C getter or
    comparison, no Python frame a DTensor.
    """
    cls = dtensor_class()
    if cls is None:  # pragma: no cover - a plan with DTensors was made after the import
        return None
    out = list(values)
    positions = columns.positions
    getter: Any = None
    for start in range(0, len(positions), _UNWRAP_BLOCK):
        end = start + _UNWRAP_BLOCK
        try:
            block = list(map(values.__getitem__, positions[start:end]))
            if set(map(type, block)) != {cls} or any(map(_attributes, block)):
                return None
            if tuple(map(_requires_grad, block)) != columns.requires_grad[start:end]:
                return None
            specs = list(map(_spec, block))
            if not all(map(operator.is_, map(_mesh, specs), columns.meshes[start:end])):
                return None
            if getter is None:
                getter = _spec_fields(type(specs[0]))
            if tuple(map(getter, specs)) != columns.fields[start:end]:
                return None
            for p, local in zip(positions[start:end], map(_local_tensor, block), strict=True):
                out[p] = local
        except Exception:  # a spec of another class, or a value the plan never saw
            return None
        if slice_over():
            yield
    return out


_UNWRAP_BLOCK = 512
"""DTensors unwrapped between two looks at the clock (~0.9 us each: 2,048 held the loop ~2.6 ms)."""
_kind = operator.attrgetter("kind")
_mesh = operator.attrgetter("mesh")
_spec = operator.attrgetter("_spec")
_local_tensor = operator.attrgetter("_local_tensor")
_requires_grad = operator.attrgetter("requires_grad")
_storage_offset = torch.Tensor.storage_offset  # the C methods themselves (TensorBase's)
_untyped_storage = torch.Tensor.untyped_storage
_nbytes = torch.UntypedStorage.nbytes
_cdata = operator.attrgetter("_cdata")
_attributes = operator.attrgetter("__dict__")
_storage_of = operator.attrgetter("storage")


def match_in_slices(
    fast: FastPlan,
    state_dict: Any,
    *,
    meta_only: bool = False,
    walk_only: bool = False,
    patches: list[tuple[int, Any]] | None = None,
) -> Steps[list[torch.Tensor] | None]:
    """``state_dict``'s source tensors in plan order (a DTensor's local tensor for a DTensor)
    if ``fast.plan`` is its plan, else ``None``.

    Checks everything the plan was derived from: container types, keys (in order, with
    their types), lengths and non-tensor values; each DTensor's type, grad flag and spec
    (:class:`DTensorColumns`), its local tensor then in its place; each tensor's :func:`tensor_signature`
    (storage, dtype, shape, stride, offset, type, ``requires_grad``, conj/neg bits); that no
    tensor carries attributes; and that the same tensor object, and only it, appears
    wherever the plan met one tensor twice.  The cyclic collector stays paused while it
    runs (see :mod:`astage._util.timeslice`) and it keeps no per-tensor objects.

    :param meta_only: check every tensor but not which storage it views (for a staged
        copy, whose storages are the caller's to check).
    :param walk_only: check the containers, keys and atoms and where each tensor sits, but
        no tensor's metadata or storage: for a tree whose tensors were proven to be the
        plan's by other means (a staged copy the stager checked at its release and refilled).
    :param patches: where given, an atom of a dict or list (a slot, :class:`AtomSlots`)
        that differs from the plan's but is still a plain scalar does not refuse the match:
        ``(slot, value)`` is appended here instead, for :func:`set_atoms`.  Left as it was
        when the match fails.
    """
    matcher = _Matcher(fast, meta_only, None if patches is None else [])
    ok = yield from matcher.many((fast.plan.root,), (state_dict,))
    values = sources = matcher.sources
    if not ok or len(sources) != len(fast.signatures):
        return None
    if fast.dtensors is not None:
        unwrapped = yield from _unwrap_in_slices(fast.dtensors, values)
        if unwrapped is None:
            return None
        sources = matcher.sources = unwrapped
    if not walk_only and not (yield from matcher.tensors()):
        return None
    # A tensor object met at two positions the plan holds apart would be one in a new plan.
    # Once every storage is checked, only tensors of a shared storage can be one object (the
    # storage check refuses one object at the positions of two storages): 20,000 ids
    # hashed into a set cost ~2.5 ms, and most plans share no storage.  The objects of the
    # tree, not DTensors' locals: the planner knows a tensor met twice by the tree's object.
    distinct = values if meta_only or walk_only else list(map(values.__getitem__, fast.shared))
    if not (yield from distinct_in_slices(distinct)):
        return None
    if patches is not None and matcher.patches:
        patches += matcher.patches
    return sources


def set_atoms(tree: Any, atoms: AtomSlots, values: Iterable[tuple[int, Any]]) -> None:
    """Put each ``(slot, value)`` into ``tree`` (a staged tree of the plan ``atoms`` is of),
    following the slot's trail: each step names the key, index or attribute the plan has
    at that position.

    Only where the slot is: a key or index that is gone raises ``LookupError`` (setting the
    key would add it back, at the end of its dict).
    """
    for slot, value in values:
        *steps, last = atoms.trails[slot]
        node: Any = atoms.root
        container = tree
        for i in steps:
            if type(node) is DictNode and i >= len(node.values):
                container = getattr(container, node.attrs[i - len(node.values)][0])
            else:
                container = container[node.keys[i] if type(node) is DictNode else i]
            node = plan_children(node)[i]
        key = node.keys[last] if type(node) is DictNode else last
        if type(container) is not list and key not in container:
            raise KeyError(key)
        container[key] = value
