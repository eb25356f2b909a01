"""Match a destination that has the file's shape, at a glance: the common ``restore(into=)``.

A caller restoring into its live model and optimizer hands over a tree with the same keys,
containers and tensors as the one it saved (a key of plain values more or less, such as the
step), every tensor a plain CPU tensor or Parameter alone on its storage (tied weights
tied alike).  Then every storage of the file is read whole into one caller's
storage (``Mode.DIRECT``), and planning the caller's tree as a whole
(:mod:`astage._staging.plan`) and matching it by key path
(:mod:`astage._checkpointer.destination`), about 20 us and a dozen objects a tensor, is
work spent to learn what a side-by-side walk tells at once.

:func:`same_shape_in_slices` walks the file's tree and the caller's side by side (a dict's
keys compared as one tuple, a run of tensors taken in one ``extend``), then checks the
tensors a block at a time with C-speed column comparisons: dtype, shape and strides as the
file's, contiguous from offset 0 over a storage of the file storage's size, on the CPU, no
conjugate or negative bit, no attributes, no two on one storage.  What passes becomes a
:class:`DirectFill`: the caller's tensors in body order and the file's tensor on each
storage, in two columns, the per-storage records made only when asked for.  Anything else
(a tensor more or less, keys in another order, a container of another kind or length, a
device tensor, a DTensor, tensors sharing a storage, views, an array or a BytesIO in the
file, ...) is handed to the general match, which fills or refuses, with key paths, exactly
as without this path (``tests/properties/test_same_shape_property.py`` checks that it would
fill what this path accepts the same way).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from itertools import chain, compress, repeat
from typing import Any, Final, cast

import numpy as np
import torch

from .._staging.plan import (
    AtomNode,
    CopyNode,
    DictNode,
    Node,
    SeqNode,
    StagePlan,
    TensorKind,
    TensorNode,
    TensorSpec,
)
from .._util.errors import KeyPath
from .._util.timeslice import BLOCK, Steps, distinct_in_slices, drive, each_block, slice_over
from .destination import Mode, StorageFill, places_in_slices

_TENSORS: Final = frozenset({torch.Tensor, torch.nn.Parameter})
_LEAVES: Final = frozenset(
    {type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size}
)
"""Values that hold no tensor, taken where the file holds a plain value."""

_position = operator.itemgetter(0)
_key_path = operator.attrgetter("key_path")
_storage = operator.attrgetter("storage")
_dtype = operator.attrgetter("dtype")
_size = operator.attrgetter("size")
_stride = operator.attrgetter("stride")
_offset = operator.attrgetter("offset")
_kind = operator.attrgetter("kind")
_conj = operator.attrgetter("conj")
_neg = operator.attrgetter("neg")
_attrs = operator.attrgetter("attrs")
_spec_nbytes = operator.attrgetter("nbytes")
_shape = operator.attrgetter("shape")
_is_cpu = operator.attrgetter("is_cpu")
_layout = operator.attrgetter("layout")
_nbytes = operator.attrgetter("nbytes")
_vars = operator.attrgetter("__dict__")
_node_attrs = operator.attrgetter("attrs")
_node_keys = operator.attrgetter("keys")
_node_values = operator.attrgetter("values")

CHECK_BLOCK: Final = 128
"""Tensors checked in one go: ~15 C-speed passes over a block take ~0.3-0.5 ms."""


class DirectFill:
    """A :class:`~astage._checkpointer.destination.Fill` in columns: storage ``s`` of the
    file is read whole into ``tensors[s]``, the caller's tensor, which holds the file's
    tensor ``positions[s]``.

    Two columns, not a record a storage: a match lives as long as its restore, and every
    object it holds is rescanned by each full collection meanwhile.  The
    :class:`StorageFill` records are made when asked for; assigning :attr:`storages`
    replaces them all (then they are what this fill says).
    """

    def __init__(
        self, plan: StagePlan, tensors: list[torch.Tensor], positions: np.ndarray[Any, Any], *, tied: bool
    ) -> None:
        self.plan = plan
        self.tensors = tensors
        self.positions = positions
        self.tied = tied
        """The file meets a tensor at several places: the report walks its tree for them."""
        self.records: list[StorageFill] | None = None
        self.places: dict[int, list[KeyPath]] | None = None

    @property
    def storages(self) -> list[StorageFill]:
        if self.records is not None:
            return self.records
        return [self.storage(s) for s in range(len(self.tensors))]

    @storages.setter
    def storages(self, records: list[StorageFill]) -> None:
        self.records = records

    def storage(self, s: int) -> StorageFill:
        if self.records is not None:
            return self.records[s]
        spec = self.plan.tensors[int(self.positions[s])]
        local = self.tensors[s]
        return StorageFill(Mode.DIRECT, ((spec, local),), local.untyped_storage(), False)

    def mode(self, s: int) -> Mode:
        return Mode.DIRECT if self.records is None else self.records[s].mode

    def whole(self, s: int) -> torch.UntypedStorage | None:
        return self.tensors[s].untyped_storage() if self.records is None else self.records[s].whole

    def device_storages(self) -> list[int]:
        if self.records is None:
            return []
        return [i for i, f in enumerate(self.records) if f.mode is Mode.DEVICE]

    def fresh(self) -> frozenset[int]:
        return frozenset()  # the file holds no array or BytesIO

    def paths_of(self, s: int) -> Sequence[KeyPath]:
        position = int(self.positions[s])
        if not self.tied:
            return (self.plan.tensors[position].key_path,)
        if self.places is None:
            self.places = {}
            for path, at in drive(places_in_slices(self.plan)).items():
                self.places.setdefault(at, []).append(path)
        return self.places[position]

    def tensor_paths(self) -> Sequence[KeyPath]:
        # The trees have one shape: the caller's tensors sit where the file's are met.
        if self.tied:
            return list(drive(places_in_slices(self.plan)))
        return list(map(_key_path, self.plan.tensors))

    def original(self, position: int) -> Any:
        return self.tensors[self.plan.tensors[position].storage]


def same_shape_in_slices(plan: StagePlan, into: Any) -> Steps[DirectFill | str]:
    """The :class:`DirectFill` of reading a file of ``plan`` into ``into``, or why it is
    not one (then the general match decides, and refuses with key paths)."""
    walked = yield from _walk_in_slices(plan.root, into)
    if isinstance(walked, str):
        return walked
    once = _once(walked.positions, walked.found)
    if isinstance(once, str):
        return once
    positions, tensors, tied = once
    if slice_over():
        yield
    if not (yield from distinct_in_slices(tensors)):  # storages can tell only where they hold bytes
        return "the destination holds one tensor where the file holds two"
    n = len(plan.tensors)
    if len(positions) != n:
        return "the file holds a tensor the walk did not meet (in an attribute)"
    if len(plan.storages) != n:
        return "the file holds a storage with more than one tensor"
    columns = _Columns(plan, positions, tensors)
    if not (yield from each_block(range(n), columns.check, CHECK_BLOCK)):
        return columns.problem
    by_storage = columns.by_storage()
    if by_storage is None:
        return columns.problem
    order, positions_by_storage = by_storage
    if slice_over():
        yield
    in_order: list[torch.Tensor] = []  # the caller's tensors in body order, a block at a time
    yield from each_block(order.tolist(), lambda block: in_order.extend(map(tensors.__getitem__, block)))
    return DirectFill(plan, in_order, positions_by_storage, tied=tied)


def _once(positions: list[int], found: list[Any]) -> tuple[list[int], list[Any], bool] | str:
    """Each tensor of the file once, with the caller's object there, and whether the file
    meets one at several places (tied weights): the caller's tree must hold one object
    at all of them."""
    at = np.asarray(positions, np.int64)
    order = np.argsort(at, kind="stable")
    ranked = at[order]
    again = np.flatnonzero(ranked[1:] == ranked[:-1]) + 1
    if not again.size:
        return positions, found, False
    for k in again.tolist():
        if found[order[k]] is not found[order[k - 1]]:
            return "the file holds one tensor where the destination holds two"
    keep = np.ones(len(at), bool)
    keep[again] = False
    chosen = order[keep]
    return at[chosen].tolist(), list(map(found.__getitem__, chosen.tolist())), True


def _walk_in_slices(root: Node, into: Any) -> Steps[_SideBySide | str]:
    """The file's tensor positions and the caller's objects at the same places (or why the
    trees differ), walking both side by side."""
    walk = _SideBySide()
    problem = yield from walk.take_in_slices((root,), (into,))
    while problem is None and walk.stack:
        children = _children(*walk.stack.pop())
        if isinstance(children, str):
            return children
        problem = yield from walk.take_in_slices(*children)
        if slice_over():
            yield
    return walk if problem is None else problem


def _children(node: Node, value: Any) -> tuple[tuple[Node, ...], tuple[Any, ...]] | str:
    """The child nodes of a container node and the caller's values in their places."""
    if type(node) is DictNode:
        if not isinstance(value, dict):
            return "a dict of the file is not one in the destination"
        if node.keys == tuple(value):
            nodes, values = node.values, tuple(value.values())
        else:
            shared = _shared_keys(node, value)
            if isinstance(shared, str):
                return shared
            nodes, values = shared
    else:
        assert type(node) is SeqNode
        if not isinstance(value, (list, tuple)) or len(value) != len(node.items):
            return "a list or tuple of the file is not one of its length in the destination"
        nodes, values = node.items, tuple(value)
    state = getattr(value, "__dict__", None) or {}
    if tuple(name for name, _ in node.attrs) != tuple(state):
        return "the attributes of a container differ"
    if state:
        nodes += tuple(child for _, child in node.attrs)
        values += tuple(state.values())
    return nodes, values


def _shared_keys(node: DictNode, value: dict[Any, Any]) -> tuple[tuple[Node, ...], tuple[Any, ...]] | str:
    """The children under the keys both dicts have, where the others hold no tensor (as
    the general match ignores them) and the shared ones come in one order."""
    mine, theirs = set(value), set(node.keys)
    shared = [i for i, key in enumerate(node.keys) if key in mine]
    keys = tuple(node.keys[i] for i in shared)
    if keys != tuple(key for key in value if key in theirs):
        return "the keys of a dict come in another order"
    if any(
        _holds_tensor(child) for key, child in zip(node.keys, node.values, strict=True) if key not in mine
    ):
        return "the file holds a tensor under a key the destination lacks"
    if any(type(value[key]) not in _LEAVES for key in value if key not in theirs):
        return "the destination holds a tensor or a container under a key the file lacks"
    return tuple(node.values[i] for i in shared), tuple(map(value.__getitem__, keys))


def _holds_tensor(node: Node) -> bool:
    """Whether the file's subtree ``node`` may hold a tensor (a repeat, or an object: maybe)."""
    todo = [node]
    while todo:
        node = todo.pop()
        kind = type(node)
        if kind is DictNode:
            todo += cast(DictNode, node).values
            todo += (child for _, child in cast(DictNode, node).attrs)
        elif kind is SeqNode:
            todo += cast(SeqNode, node).items
            todo += (child for _, child in cast(SeqNode, node).attrs)
        elif kind is not AtomNode and kind is not CopyNode:
            return True
    return False


DICTS: Final = "plain dicts"
"""What :meth:`_SideBySide.take_run` says of a run of plain dicts with the file's keys."""


class _SideBySide:
    """What a side-by-side walk found: the file's tensor positions and the caller's objects
    there (two columns), and the containers still to walk."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.found: list[Any] = []
        self.stack: list[tuple[Node, Any]] = []

    def take_in_slices(self, nodes: tuple[Node, ...], values: Sequence[Any]) -> Steps[str | None]:
        """Take one run of children: tensors into the columns, containers onto the stack
        (dicts of plain dicts taken at once); ``None``, or why the destination's differ.

        Each kind of node is taken as a run of its own, at C speed: not a step a child; a
        long run a block at a time, a slice checked before each."""
        if slice_over():
            yield
        if len(nodes) > BLOCK:
            for start in range(0, len(nodes), BLOCK):
                block = nodes[start : start + BLOCK], values[start : start + BLOCK]
                problem = yield from self.take_in_slices(*block)
                if problem is not None:
                    return problem
            return None
        types = list(map(type, nodes))
        kinds = set(types)
        if len(kinds) > 1:
            for kind in kinds:
                chosen = list(map(operator.is_, types, repeat(kind)))
                problem = yield from self.take_in_slices(
                    tuple(compress(nodes, chosen)), tuple(compress(values, chosen))
                )
                if problem is not None:
                    return problem
            return None
        problem = self.take_run(kinds.pop() if kinds else AtomNode, nodes, values)
        if problem is DICTS:
            inner = tuple(chain.from_iterable(map(_node_values, cast("tuple[DictNode, ...]", nodes))))
            problem = yield from self.take_in_slices(
                inner, tuple(chain.from_iterable(map(dict.values, values)))
            )
        return problem

    def take_run(self, kind: type, nodes: tuple[Node, ...], values: Sequence[Any]) -> str | None:
        """Take a run of children of one ``kind``; :data:`DICTS` where they are plain dicts
        of the file's keys, whose children are to be taken next, as one run."""
        if kind is TensorNode:  # a model's parameters
            if not set(map(type, values)) <= _TENSORS:
                return "the destination holds something else than a plain tensor where the file holds one"
            self.positions.extend(map(_position, cast("tuple[TensorNode, ...]", nodes)))
            self.found.extend(values)
            return None
        if kind is AtomNode:  # plain values (a list of parameter ids)
            return None if set(map(type, values)) <= _LEAVES else "a tensor may sit where the file holds none"
        if kind is DictNode and set(map(type, values)) == {dict}:  # an optimizer's state
            dicts = cast("tuple[DictNode, ...]", nodes)
            if list(map(_node_attrs, dicts)).count(()) != len(dicts):
                return "the attributes of a container differ"
            if list(map(_node_keys, dicts)) == list(map(tuple, values)):
                return DICTS
        if kind is DictNode or kind is SeqNode:  # each walked on its own (keys that differ)
            self.stack.extend(zip(nodes, values, strict=True))
            return None
        return "the file holds an object, a repeat or a BytesIO where the destination may hold a tensor"


class _Columns:
    """The file's tensors and the caller's, side by side, checked a block at a time."""

    def __init__(self, plan: StagePlan, positions: list[int], tensors: list[Any]) -> None:
        self.plan, self.positions, self.tensors = plan, positions, tensors
        n = len(positions)
        self.storages = np.empty(n, np.int64)  # the file's storage of each caller's tensor
        self.addresses = np.empty(n, np.int64)  # its data, where it has any bytes (else 0)
        self.problem = ""

    def check(self, block: Sequence[int]) -> bool:
        r = cast(range, block)
        mine: list[torch.Tensor] = self.tensors[r.start : r.stop]
        theirs: list[TensorSpec] = list(map(self.plan.tensors.__getitem__, self.positions[r.start : r.stop]))
        try:
            problem = _file_problem(theirs) or _layout_problem(mine, theirs)
        except RuntimeError:  # a nested tensor has no shape or strides to give
            problem = "a tensor of the destination is not a dense CPU tensor"
        if problem is None:
            sizes: list[int] = list(
                map(_spec_nbytes, map(self.plan.storages.__getitem__, map(_storage, theirs)))
            )
            if (
                list(map(_nbytes, mine)) != sizes
                or list(map(torch.UntypedStorage.nbytes, map(torch.Tensor.untyped_storage, mine))) != sizes
            ):
                problem = "a tensor of the destination is a view of a storage of another size"
            else:
                self.storages[r.start : r.stop] = list(map(_storage, theirs))
                self.addresses[r.start : r.stop] = [
                    a if n else 0 for a, n in zip(map(torch.Tensor.data_ptr, mine), sizes, strict=True)
                ]
        if problem is not None:
            self.problem = problem
            return False
        return True

    def by_storage(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None:
        """The caller's tensors' order by file storage, and the file's tensor on each
        storage; ``None`` if two tensors share a storage on either side."""
        n = len(self.positions)
        order = np.argsort(self.storages, kind="stable")
        if not np.array_equal(self.storages[order], np.arange(n)):
            self.problem = "the file holds a storage with more than one tensor"
            return None
        addresses = np.sort(self.addresses[self.addresses != 0])
        if (addresses[1:] == addresses[:-1]).any():
            self.problem = "two tensors of the destination share a storage"
            return None
        positions = np.asarray(self.positions, np.int64)[order]
        if not np.array_equal(np.sort(positions), np.arange(n)):
            self.problem = "the destination holds a tensor of the file twice"
            return None
        return order, positions


def _file_problem(theirs: list[TensorSpec]) -> str | None:
    """Why the file's tensors are not all plain, dense from their storage's start."""
    kinds = list(map(_kind, theirs))  # list.count compares by identity first: no enum hashing
    if kinds.count(TensorKind.TENSOR) + kinds.count(TensorKind.PARAMETER) != len(kinds):
        return "the file holds an array, a BytesIO or a DTensor"
    if any(map(_offset, theirs)) or any(map(_conj, theirs)) or any(map(_neg, theirs)):
        return "the file holds a view or a tensor with a conjugate or negative bit"
    if list(map(_attrs, theirs)).count(None) != len(theirs):
        return "the file holds a tensor with attributes"
    return None


def _layout_problem(mine: list[torch.Tensor], theirs: list[TensorSpec]) -> str | None:
    """Why the caller's tensors cannot each take a file storage whole, at C speed."""
    if list(map(_dtype, mine)) != list(map(_dtype, theirs)):
        return "a dtype differs"
    if list(map(_shape, mine)) != list(map(_size, theirs)):
        return "a shape differs"
    if list(map(torch.Tensor.stride, mine)) != list(map(_stride, theirs)):
        return "a stride differs"
    if not all(map(_is_cpu, mine)) or set(map(_layout, mine)) != {torch.strided}:
        return "a tensor of the destination is not a dense CPU tensor"
    if not all(map(torch.Tensor.is_contiguous, mine)) or any(map(torch.Tensor.storage_offset, mine)):
        return "a tensor of the destination is a view"
    if any(map(torch.Tensor.is_conj, mine)) or any(map(torch.Tensor.is_neg, mine)):
        return "a tensor of the destination has a conjugate or negative bit"
    if any(map(_vars, mine)):
        return "a tensor of the destination has attributes"
    return None
