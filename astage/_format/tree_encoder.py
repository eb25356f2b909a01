"""The header's structure as JSON: the tree encoder and its time-sliced writer.

:class:`TreeEncoder` turns plan nodes into the structure's JSON tree (docs/format.md) and
the scalar table beside it (:mod:`astage._format.scalars`), and refuses what a reader would
refuse.  :func:`json_text_in_slices` writes the tree as ``json.dumps`` would, in time slices.
Pure: no file, socket or thread.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Any, Final

from .._staging.plan import (
    AtomNode,
    CopyNode,
    DictNode,
    Node,
    ObjectNode,
    RefNode,
    SeqNode,
    StagePlan,
    TensorNode,
    TensorSpec,
)
from .._util.errors import Attr, KeyPath, UnsupportedInputError, shown_key
from .._util.timeslice import Steps, slice_over
from .parse_bound import container_cost, namedtuple_cost, path_cost
from .scalars import json_text, key_json, scalar_json
from .spec import DTYPES, MAX_DEPTH, MAX_NDIM, flag_bits, tensor_refused
from .tables import any_refused

_DTYPE_NAMES: Final = {dtype: name for name, dtype in DTYPES.items()}
_VERBATIM: Final = frozenset({type(None), bool, str})
"""Key types whose JSON form is the value itself, unchecked (ints and floats have limits
and non-finite forms)."""
_NAN_KEY: Final = ["float", "nan"]


def attr_name_ok(name: object) -> bool:
    return type(name) is str and name.isidentifier() and not name.startswith("__")


def namedtuple_class(typename: str, fields: Sequence[str]) -> type:
    """The class a reader makes for a namedtuple; ValueError/TypeError for bad names.

    Validates the name and fields as identifiers (no keywords, no leading underscores, no
    repeats); imports and executes nothing.  The encoder calls it too, so that it refuses
    whatever a reader would.
    """
    made: type = collections.namedtuple(typename, fields)  # type: ignore[misc]
    return made


def _namedtuple_fields(cls: type) -> tuple[str, ...] | None:
    fields = getattr(cls, "_fields", None)
    if issubclass(cls, tuple) and isinstance(fields, tuple) and all(type(f) is str for f in fields):
        return fields
    return None


class TreeEncoder:
    """Plan nodes to the JSON tree (see docs/format.md), rejecting what JSON cannot hold.

    It refuses everything the reader (:class:`HeaderParser`) would refuse in an honest
    header (too many dimensions, several NaN keys in one dict, namedtuple names that are not
    identifiers), so that a file that leaves :func:`encode` always parses: a peer that
    could not parse it would have to abort the transfer and break the process group.
    """

    def __init__(self, plan: StagePlan, storable: bool | None = None) -> None:
        self.plan = plan
        self.memo: dict[int, int] = {}  # plan memo -> post-order container number
        self.seen: set[int] = set()
        self.namedtuples: set[tuple[str, tuple[str, ...]]] = set()
        self.charged = 0  # what the reader will charge to its parse budget, see text_parse_cost
        self.scalars: list[Any] = []  # the scalar table: each leaf's entry, in walk order
        # Then no tensor needs _check_tensor.  A caller that checked it already says so.
        self.storable = all_storable(plan.tensors) if storable is None else storable

    def node(self, n: Node, path: KeyPath, depth: int) -> Steps[Any]:
        """The JSON form of ``n`` (at ``path``, ``depth`` containers deep), in time slices."""
        match n:
            case TensorNode(index):
                return self.tensor(index, path)
            case AtomNode(value):
                return self.scalar(value, path)
            case RefNode(memo):
                return ["ref", self.memo[memo]]
            case DictNode(memo, keys, values, proto, attrs):
                if proto is not None and type(proto) is not collections.OrderedDict:
                    raise UnsupportedInputError(
                        path,
                        f"{type(proto).__qualname__} cannot be stored in a checkpoint file "
                        "(only dict, OrderedDict)",
                    )
                self._check_depth(path, depth)
                json_keys = self._keys(keys, path)
                json_values: Any = self.run(keys, values, path)
                if json_values is None:
                    json_values = yield from self.children(keys, values, path, depth)
                json_attrs = {}
                for name, value in attrs:
                    if not attr_name_ok(name):
                        raise UnsupportedInputError(path, f"attribute name {name!r} is not allowed")
                    json_attrs[name] = yield from self.node(value, (*path, Attr(name)), depth + 1)
                self._done(memo)
                node: list[Any] = ["dict" if proto is None else "odict", json_keys, json_values]
                if json_attrs:  # e.g. the ``_metadata`` torch puts on every module state_dict
                    node.append(json_attrs)
                return node
            case SeqNode(memo, cls, items, proto, attrs):
                fields = _namedtuple_fields(cls) if cls not in (list, tuple) else None
                if (cls not in (list, tuple) and fields is None) or proto is not None or attrs:
                    raise UnsupportedInputError(
                        path,
                        f"{cls.__qualname__} cannot be stored in a checkpoint file "
                        "(only list, tuple, namedtuple)",
                    )
                if fields is not None:
                    self._check_namedtuple(cls, fields, len(items), path)
                self._check_depth(path, depth)
                json_items = yield from self.children(range(len(items)), items, path, depth)
                self._done(memo)
                if fields is not None:
                    return ["namedtuple", cls.__name__, list(fields), json_items]
                return ["list" if cls is list else "tuple", json_items]
            case CopyNode(value) | ObjectNode(cls=value):
                what = value.__qualname__ if isinstance(value, type) else type(value).__qualname__
                raise UnsupportedInputError(
                    path,
                    f"{what} cannot be stored in a checkpoint file (only tensors, numpy arrays, containers "
                    "and plain values: see docs/format.md)",
                )
        raise AssertionError(f"unknown plan node {n!r}")  # pragma: no cover

    def scalar(self, value: Any, path: KeyPath) -> int:
        """A leaf, as its index in the scalar table (which it is appended to)."""
        try:
            entry = scalar_json(value)
        except (TypeError, ValueError) as exc:
            raise UnsupportedInputError(path, f"cannot be stored in a checkpoint file: {exc}") from exc
        self.scalars.append(entry)
        return len(self.scalars) - 1

    def tensor(self, index: int, path: KeyPath) -> list[Any]:
        if index not in self.seen:
            self.seen.add(index)
            self.charged += path_cost(len(path))
            self._check_tensor(self.plan.tensors[index], path)
        return ["tensor", index]

    def run(self, keys: tuple[Any, ...], nodes: tuple[Node, ...], path: KeyPath) -> int | None:
        """The first position of ``nodes`` if they are tensors met here first and numbered in
        a row (a module's or a layer's state_dict), which a tensor run writes as that one int;
        else ``None``.  Each is checked and charged as :meth:`tensor` does, as a reader
        charges it: its key path."""
        if not nodes or list(map(type, nodes)).count(TensorNode) != len(nodes):
            return None
        first = nodes[0].position  # type: ignore[union-attr]
        end = first + len(nodes)
        if end > len(self.plan.tensors) or list(map(_position, nodes)) != list(range(first, end)):
            return None
        seen = self.seen
        if not seen.isdisjoint(range(first, end)):
            return None
        if not self.storable:
            specs = self.plan.tensors
            for key, position in zip(keys, range(first, end), strict=True):
                self._check_tensor(specs[position], (*path, key))
        seen.update(range(first, end))
        self.charged += len(nodes) * path_cost(len(path) + 1)
        return first

    def children(
        self, keys: Iterable[Any], nodes: Sequence[Node], path: KeyPath, depth: int
    ) -> Steps[list[Any]]:
        # Tensors are the bulk of a state_dict: met again, or all storable, they need no key
        # path, call or dispatch (about a third of the walk's time on many small tensors).
        out: list[Any] = []
        append = out.append
        seen = self.seen
        storable = self.storable
        fresh = path_cost(len(path) + 1)  # a child's key path, charged by a reader
        for key, child in zip(keys, nodes, strict=True):
            if type(child) is TensorNode:
                position = child.position
                if position not in seen:
                    if not storable:
                        append(self.tensor(position, (*path, key)))
                        continue
                    seen.add(position)
                    self.charged += fresh
                append(["tensor", position])
            else:
                append((yield from self.node(child, (*path, key), depth + 1)))
                if slice_over():  # an optimizer's state: thousands of small dicts
                    yield
        return out

    @staticmethod
    def _keys(keys: Sequence[Any], path: KeyPath) -> list[Any]:
        # Keys of the types JSON holds as they are (str above all) need no per-key call.
        if set(map(type, keys)) <= _VERBATIM:
            return list(keys)
        json_keys = []
        for key in keys:
            try:
                json_keys.append(key_json(key))
            except (TypeError, ValueError) as exc:
                raise UnsupportedInputError(path, f"dict key {shown_key(key)} is not allowed: {exc}") from exc
        if json_keys.count(_NAN_KEY) > 1:
            raise UnsupportedInputError(path, "several NaN dict keys would read back as one")
        return json_keys

    def _done(self, memo: int) -> None:
        """A container written: numbered as a reader numbers it, and charged as it charges it."""
        self.memo[memo] = len(self.memo)
        self.charged += _CONTAINER_COST

    @staticmethod
    def _check_depth(path: KeyPath, depth: int) -> None:
        if depth >= MAX_DEPTH:
            raise UnsupportedInputError(path, f"containers nested deeper than {MAX_DEPTH} levels")

    def _check_namedtuple(self, cls: type, fields: tuple[str, ...], arity: int, path: KeyPath) -> None:
        if (cls.__name__, fields) not in self.namedtuples:
            try:
                namedtuple_class(cls.__name__, fields)
            except (ValueError, TypeError) as exc:
                raise UnsupportedInputError(
                    path, f"{cls.__qualname__} cannot be stored in a checkpoint file: {exc}"
                ) from exc
            self.namedtuples.add((cls.__name__, fields))
            self.charged += namedtuple_cost(cls.__name__, fields)
        if arity != len(fields):
            raise UnsupportedInputError(path, f"{cls.__qualname__} holds {arity} items, {len(fields)} fields")

    @staticmethod
    def _check_tensor(spec: TensorSpec, path: KeyPath) -> None:
        why = tensor_refused(spec.dtype, spec.kind, flag_bits(spec.requires_grad, spec.conj, spec.neg))
        if why is not None:
            raise UnsupportedInputError(path, f"cannot be stored in a checkpoint file: {why}")
        if len(spec.size) > MAX_NDIM:
            raise UnsupportedInputError(
                path, f"{len(spec.size)} dimensions, the checkpoint file format holds at most {MAX_NDIM}"
            )
        if spec.attrs is not None:
            raise UnsupportedInputError(
                path, "tensors carrying Python attributes cannot be stored in a checkpoint file"
            )


_position = attrgetter("position")
_CONTAINER_COST: Final = container_cost()


def _is_container(x: Any) -> bool:
    return type(x) is list or type(x) is dict


def json_text_in_slices(x: Any, depth: int = 0) -> Steps[str]:
    """:func:`json_text` of a JSON tree, in time slices: in one call, the tree of an
    optimizer's thousands of small dicts holds the loop ~6 ms.  The same text: lists and
    dicts with ``str`` keys joined with the same separators, everything else dumped whole.

    Only containers at the top :data:`_SPLIT_DEPTH` levels, or of :data:`_SPLIT_WIDTH` items
    or more, are split, and a list's items that are not split are dumped a run at a time: a
    header's tree is mostly nodes of three items, and a ``json.dumps`` or more a node cost
    five to ten times the single call (now ~1.6 times).
    """
    if not _splits(x, depth):
        return json_text(x)  # a leaf, or a container dumped whole
    if type(x) is dict:
        members = []
        for key, value in x.items():
            members.append(json_text(key) + ":" + (yield from json_text_in_slices(value, depth + 1)))
            if slice_over():
                yield
        return "{" + ",".join(members) + "}"
    items: list[str] = []
    run: list[Any] = []  # items dumped whole, together: json.dumps of a list joins them so
    for item in x:
        if _splits(item, depth + 1):
            if run:
                items.append(json_text(run)[1:-1])
                run = []
            items.append((yield from json_text_in_slices(item, depth + 1)))
        else:
            run.append(item)
            if len(run) < _SPLIT_WIDTH:
                continue
            items.append(json_text(run)[1:-1])
            run = []
        if slice_over():
            yield
    if run:
        items.append(json_text(run)[1:-1])
    return "[" + ",".join(items) + "]"


def _splits(x: Any, depth: int) -> bool:
    """Whether :func:`json_text_in_slices` splits ``x`` rather than dumping it whole."""
    if type(x) is list:
        children: Any = x
    elif type(x) is dict and all(type(key) is str for key in x):
        children = x.values()
    else:
        return False
    return (depth < _SPLIT_DEPTH or len(x) >= _SPLIT_WIDTH) and any(map(_is_container, children))


_SPLIT_DEPTH: Final = 6
"""Levels of a JSON tree :func:`json_text_in_slices` always splits (a header's tree: a node, its
values list, their nodes...: three state_dict levels)."""
_SPLIT_WIDTH: Final = 32
"""Items from which :func:`json_text_in_slices` splits a container at any depth."""


def all_storable(specs: Sequence[TensorSpec]) -> bool:
    """Whether every tensor passes :meth:`TreeEncoder._check_tensor`, checked a column at
    a time (else each is checked as the walk meets it, to name its key path)."""
    return (
        set(map(attrgetter("dtype"), specs)) <= _DTYPE_NAMES.keys()
        and max(map(len, map(attrgetter("size"), specs)), default=0) <= MAX_NDIM
        and list(map(attrgetter("attrs"), specs)).count(None) == len(specs)
        and not any_refused(specs)
    )
