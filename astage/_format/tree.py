"""The checkpoint file header's JSON: the tree encoder and the strict header parser.

:class:`_TreeEncoder` turns plan nodes into the JSON tree (docs/format.md) and refuses what
a reader would refuse; :class:`_HeaderParser` turns the header's JSON (and, from version 3,
its checked binary tables, :mod:`astage._format.tables`) back into a :class:`FileHeader`,
checking every field and charging the parse bound (:mod:`astage._format.parse_bound`) as it goes.
Leaves are rebuilt from an explicit list of tags; nothing is imported or evaluated by name.
Pure: no file, socket or thread.
"""

from __future__ import annotations

import binascii
import collections
import itertools
import json
import math
import re
import secrets
from collections.abc import Iterable, Sequence
from itertools import islice, repeat
from operator import attrgetter
from typing import Any, Final, NamedTuple

import numpy as np
import torch

from .._staging.plan import (
    AtomNode,
    CopyNode,
    DictNode,
    Node,
    ObjectNode,
    RefNode,
    SeqNode,
    StagePlan,
    StorageSpec,
    TensorKind,
    TensorNode,
    TensorSpec,
    tensor_nodes,
)
from .._util.errors import Attr, KeyPath, UnsupportedInputError, format_key_path, shown_key
from .._util.limits import INT64 as _INT64
from .._util.limits import RANK_LIMIT as _RANK_LIMIT
from .._util.timeslice import Steps, slice_over
from .parse_bound import container_cost, namedtuple_cost, note_cost, path_cost
from .spec import (
    _ID_CAP,
    _LEAF_DECODERS,
    _NONFINITE,
    _NUMPY_NAMES,
    _TORCH_DTYPE_LEAVES,
    DTYPES,
    FLAG_REQUIRES_GRAD,
    MAX_DEPTH,
    MAX_NDIM,
    NUMPY_DTYPES,
    DTensorNote,
    FileHeader,
    Segment,
    Segments,
    _align,
    _fail,
    flag_bits,
    tensor_refused,
)
from .tables import (
    _any_refused,
    _check_tensor_table,
    _new_tuple,
    _numel_overflows,
    _storage_table,
    _Tables,
    _tensor_specs,
)

_INT_BITS_CAP = 13_000  # below CPython's 4300-digit int/str conversion limit

_DTYPE_NAMES: Final = {dtype: name for name, dtype in DTYPES.items()}
_TORCH_DTYPE_LEAF_NAMES: Final = {dtype: name for name, dtype in _TORCH_DTYPE_LEAVES.items()}
_KINDS: Final = {
    "tensor": TensorKind.TENSOR,
    "parameter": TensorKind.PARAMETER,
    "ndarray": TensorKind.NDARRAY,
}
_V2_KINDS: Final = frozenset({TensorKind.NDARRAY})
_V2_LEAVES: Final = frozenset({"bytes", "complex", "size", "dtype", "device", "numpy"})
_SCALARS: Final = (type(None), bool, int, float, str)
_VERBATIM: Final = frozenset({type(None), bool, str})
"""Leaf and key types whose JSON form is the value itself, unchecked (ints and floats have
limits and non-finite forms)."""
_NAN_KEY: Final = ["float", "nan"]
_CPU: Final = torch.device("cpu")


def _scalar(value: Any) -> Any:
    """The JSON form of a scalar leaf or key, or raise TypeError/ValueError."""
    cls = type(value)
    if cls is float and not math.isfinite(value):
        return ["float", "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")]
    if cls is int and value.bit_length() > _INT_BITS_CAP:
        raise ValueError(f"int of {value.bit_length()} bits is too large for a checkpoint file header")
    if cls not in _SCALARS:
        raise TypeError(f"{cls.__qualname__} is not JSON-representable")
    return value


def _leaf(value: Any) -> Any:
    """The JSON form of a leaf value (docs/format.md, tree nodes), or raise TypeError/ValueError.

    Exact: numpy scalars are stored as their bits, so NaN payloads and -0.0 survive too.
    """
    cls = type(value)
    if cls in _SCALARS:
        return _scalar(value)
    if cls is bytes:
        return ["bytes", binascii.b2a_base64(value, newline=False).decode("ascii")]
    if cls is complex:
        return ["complex", _scalar(value.real), _scalar(value.imag)]
    if cls is torch.Size:
        if len(value) > MAX_NDIM or not all(-_INT64 <= n < _INT64 for n in value):
            raise ValueError(f"a torch.Size must hold at most {MAX_NDIM} 64-bit ints")
        return ["size", list(value)]
    if cls is torch.dtype:
        name = _TORCH_DTYPE_LEAF_NAMES.get(value)
        if name is None:
            raise ValueError(f"{value} is not a dtype a checkpoint file can name")
        return ["dtype", name]
    if cls is torch.device:
        return ["device", value.type, value.index]
    if isinstance(value, np.generic):
        name = _NUMPY_NAMES.get((value.dtype.kind, value.dtype.itemsize))
        if name is None or value.dtype.fields is not None:
            raise TypeError(f"numpy {value.dtype} scalars are not stored (only {', '.join(NUMPY_DTYPES)})")
        little = NUMPY_DTYPES[name].newbyteorder("<")
        return ["numpy", name, int.from_bytes(np.asarray(value, dtype=little).tobytes(), "little")]
    raise TypeError(f"{cls.__qualname__} is not a value a checkpoint file holds")


def _attr_name_ok(name: object) -> bool:
    return type(name) is str and name.isidentifier() and not name.startswith("__")


def _namedtuple_class(typename: str, fields: Sequence[str]) -> type:
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


class _TreeEncoder:
    """Plan nodes to the JSON tree (see docs/format.md), rejecting what JSON cannot hold.

    It refuses everything the reader (:class:`_HeaderParser`) would refuse in an honest
    header (too many dimensions, several NaN keys in one dict, namedtuple names that are not
    identifiers), so that a file that leaves :func:`encode` always parses: a peer that
    could not parse it would have to abort the transfer and break the process group.
    """

    def __init__(self, plan: StagePlan, storable: bool | None = None) -> None:
        self.plan = plan
        self.memo: dict[int, int] = {}  # plan memo -> post-order container number
        self.seen: set[int] = set()
        self.namedtuples: set[tuple[str, tuple[str, ...]]] = set()
        self.charged = 0  # what the reader will charge to its parse budget, see _parse_cost
        # Then no tensor needs _check_tensor.  A caller that checked it already says so.
        self.storable = _all_storable(plan.tensors) if storable is None else storable

    def node(self, n: Node, path: KeyPath, depth: int) -> Steps[Any]:
        """The JSON form of ``n`` (at ``path``, ``depth`` containers deep), in time slices."""
        match n:
            case TensorNode(index):
                return self.tensor(index, path)
            case AtomNode(value):
                try:
                    return _leaf(value)
                except (TypeError, ValueError) as exc:
                    raise UnsupportedInputError(
                        path, f"cannot be stored in a checkpoint file: {exc}"
                    ) from exc
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
                    if not _attr_name_ok(name):
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

    def tensor(self, index: int, path: KeyPath) -> list[Any]:
        if index not in self.seen:
            self.seen.add(index)
            self.charged += path_cost(len(path))
            self._check_tensor(self.plan.tensors[index], path)
        return ["tensor", index]

    def run(self, keys: tuple[Any, ...], nodes: tuple[Node, ...], path: KeyPath) -> int | None:
        """The first position of ``nodes`` if they are tensors met here first and numbered in
        a row (a module's or a layer's state_dict), which version 4 writes as that one int;
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
        # path, call or dispatch (about a third of the walk's time on 20,000 tensors).
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
                json_keys.append(_scalar(key))
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
                _namedtuple_class(cls.__name__, fields)
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


def json_text(value: Any) -> str:
    """``value`` as the header writes JSON: compact, ASCII, no NaN constants."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def leaf_text(value: Any) -> str:
    """A leaf's text in a header's tree (:func:`_leaf`), or raise TypeError/ValueError."""
    return json_text(_leaf(value))


def _is_container(x: Any) -> bool:
    return type(x) is list or type(x) is dict


def iter_json_text(x: Any, depth: int = 0) -> Steps[str]:
    """:func:`json_text` of a JSON tree, in time slices: in one call, the tree of an
    optimizer's thousands of small dicts holds the loop ~6 ms.  The same text: lists and
    dicts with ``str`` keys joined with the same separators, everything else dumped whole.

    Only containers at the top :data:`_SPLIT_DEPTH` levels, or of :data:`_SPLIT_WIDTH` items
    or more, are split, and a list's items that are not split are dumped a run at a time: a
    header's tree is mostly nodes of three items, and a ``json.dumps`` or more a node cost
    five to ten times the single call (now ~1.6 times, with no slice over ~2.5 ms on
    20,000 tensors).
    """
    if not _splits(x, depth):
        return json_text(x)  # a leaf, or a container dumped whole
    if type(x) is dict:
        members = []
        for key, value in x.items():
            members.append(json_text(key) + ":" + (yield from iter_json_text(value, depth + 1)))
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
            items.append((yield from iter_json_text(item, depth + 1)))
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
    """Whether :func:`iter_json_text` splits ``x`` rather than dumping it whole."""
    if type(x) is list:
        children: Any = x
    elif type(x) is dict and all(type(key) is str for key in x):
        children = x.values()
    else:
        return False
    return (depth < _SPLIT_DEPTH or len(x) >= _SPLIT_WIDTH) and any(map(_is_container, children))


_SPLIT_DEPTH: Final = 6
"""Levels of a JSON tree :func:`iter_json_text` always splits (a header's tree: a node, its
values list, their nodes...: three state_dict levels)."""
_SPLIT_WIDTH: Final = 32
"""Items from which :func:`iter_json_text` splits a container at any depth."""


class _MarkingEncoder(_TreeEncoder):
    """The tree encoder, writing a marker string in place of each of some atoms."""

    def __init__(self, plan: StagePlan, markers: dict[int, str]) -> None:
        super().__init__(plan, storable=True)  # laid out or parsed once: every tensor is storable
        self.markers = markers

    def node(self, n: Node, path: KeyPath, depth: int) -> Steps[Any]:
        if type(n) is AtomNode and id(n) in self.markers:
            return self.markers[id(n)]
        return (yield from super().node(n, path, depth))


def iter_cut(
    plan: StagePlan, atoms: Sequence[AtomNode], text: str
) -> Steps[tuple[list[str], list[int], list[str]] | None]:
    """``text``, the tree members a header of ``plan`` holds (``"dtensors":[],"tree":...``),
    cut around each of ``atoms``' texts, in time slices: the pieces, which atom (its index in
    ``atoms``) lies between each two, and its text there.  ``None`` unless the pieces joined with
    the atoms' :func:`leaf_text` give ``text`` back exactly (another layout, DTensor notes,
    an atom met twice).

    The cut is found by encoding the plan with a marker in place of each atom (a random
    nonce: no key or string of the tree holds it by chance) and splitting at the markers.
    """
    nonce = secrets.token_hex(8)
    markers: dict[int, str] = {}
    for k, node in enumerate(atoms):  # an optimizer's params list: thousands of atoms
        markers[id(node)] = f"\0{nonce}:{k}\0"
        if not k & 255 and slice_over():
            yield
    if len(markers) != len(atoms):
        return None
    tree = yield from _MarkingEncoder(plan, markers).node(plan.root, (), 0)
    marked = '"dtensors":[],"tree":' + (yield from iter_json_text(tree))
    del tree
    yield
    parts = re.split(rf'"\\u0000{nonce}:(\d+)\\u0000"', marked)
    del marked
    yield
    pieces, order = parts[0::2], list(map(int, parts[1::2]))
    del parts
    yield
    if sorted(order) != list(range(len(atoms))):
        return None
    yield
    texts = []
    for k in order:
        try:
            texts.append(leaf_text(atoms[k].value))
        except (TypeError, ValueError):  # not a value a header holds: then it was not laid out
            return None
        if slice_over():
            yield
    # Compared a block of pieces at a time: one join and compare of an optimizer's
    # thousands of pieces held the loop milliseconds.
    at = len(pieces[0])
    if text[:at] != pieces[0]:
        return None
    for start in range(0, len(texts), 512):
        pairs = zip(texts[start : start + 512], pieces[start + 1 : start + 513], strict=True)
        joined = "".join(itertools.chain.from_iterable(pairs))
        if text[at : at + len(joined)] != joined:
            return None
        at += len(joined)
        if slice_over():
            yield
    if at != len(text):
        return None
    return pieces, order, texts


def _all_storable(specs: Sequence[TensorSpec]) -> bool:
    """Whether every tensor passes :meth:`_TreeEncoder._check_tensor`, checked a column at
    a time (else each is checked as the walk meets it, to name its key path)."""
    return (
        set(map(attrgetter("dtype"), specs)) <= _DTYPE_NAMES.keys()
        and max(map(len, map(attrgetter("size"), specs)), default=0) <= MAX_NDIM
        and list(map(attrgetter("attrs"), specs)).count(None) == len(specs)
        and not _any_refused(specs)
    )


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a checkpoint file header")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return out


def _int(value: Any, where: str, lo: int = 0, hi: int = _INT64) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise _fail(where, f"expected an int in [{lo}, {hi}), got {value!r:.80}")
    return value


def _list(value: Any, where: str, length: int | None = None) -> list[Any]:
    if type(value) is not list or (length is not None and len(value) != length):
        raise _fail(where, f"expected a list{'' if length is None else f' of {length}'}, got {value!r:.80}")
    return value


def _object(
    value: Any, where: str, required: frozenset[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if type(value) is not dict or not required <= value.keys() <= required | optional:
        raise _fail(where, f"expected an object with keys {sorted(required)}, got {value!r:.120}")
    return value


def _dims(value: Any, where: str, what: str) -> tuple[int, ...]:
    """A shape-like list: at most :data:`MAX_NDIM` ints in [0, 2**63)."""
    if type(value) is not list or len(value) > MAX_NDIM:
        raise _fail(where, f"{what} must be a list of at most {MAX_NDIM} ints, got {value!r:.80}")
    for n in value:
        if type(n) is not int or not 0 <= n < _INT64:
            raise _fail(where, f"{what} {value!r:.80} holds {n!r:.40}, not an int in [0, 2**63)")
    return tuple(value)


_DOC_KEYS: Final = frozenset(
    {
        "format",
        "owner_rank",
        "holder_rank",
        "step",
        "checkpoint_id",
        "created",
        "body_nbytes",
        "storages",
        "tensors",
        "tree",
    }
)
_DOC_KEYS_V3: Final = (_DOC_KEYS - {"storages", "tensors"}) | {"dtensors"}
_DTENSOR_KEYS: Final = frozenset({"placements", "global_shape"})


def _meta(doc: dict[str, Any]) -> dict[str, Any]:
    """A header's metadata fields, checked, as :class:`FileHeader` keywords: all of it but
    the tables and the tree."""
    checkpoint_id = doc["checkpoint_id"]
    if type(checkpoint_id) is not str or len(checkpoint_id) > _ID_CAP:
        raise _fail("checkpoint_id", f"expected a str of at most {_ID_CAP} characters")
    created = doc["created"]
    if type(created) is not float or not math.isfinite(created):
        raise _fail("created", f"expected a finite float, got {created!r:.40}")
    holder = doc["holder_rank"]
    return {
        "owner_rank": _int(doc["owner_rank"], "owner_rank", 0, _RANK_LIMIT),
        "holder_rank": None if holder is None else _int(holder, "holder_rank", 0, _RANK_LIMIT),
        "step": _int(doc["step"], "step", -_INT64),
        "checkpoint_id": checkpoint_id,
        "created": created,
        "body_nbytes": _int(doc["body_nbytes"], "body_nbytes"),
    }


def _where(path: KeyPath) -> str:
    return f"tree at {format_key_path(path):.200}"


class _Specs(NamedTuple):
    root: Node
    tensors: tuple[TensorSpec, ...]


class _HeaderParser:
    """Header JSON to :class:`FileHeader`, checking every field."""

    def __init__(self, prefix_len: int, version: int, budget: int, tables: _Tables | None = None) -> None:
        self.prefix_len = prefix_len
        self.version = version
        self.budget = budget  # see _parse_cost
        self.bound_version = version  # the binary version: it says what the padding paid for
        self.container_cost = container_cost(version)
        self.tables = tables
        self.containers = 0
        self.paths: list[KeyPath | None] = []
        self.namedtuples: dict[tuple[str, tuple[str, ...]], type] = {}

    def parse(self, doc: Any) -> FileHeader:
        doc = self.document(doc)
        meta = _meta(doc)
        if self.tables is not None:
            segments, specs, notes = self.tables_v3(self.tables, meta["body_nbytes"], doc)
        else:
            segments, specs, notes = self.tables_v2(doc, meta["body_nbytes"])
        # Equal specs shared, like equal shapes (see _tensor_table._shapes).
        sizes = segments.nbytes.tolist()
        shared = {nbytes: StorageSpec(nbytes, _CPU) for nbytes in set(sizes)}
        storages = tuple(map(shared.__getitem__, sizes))
        plan = StagePlan(specs.root, specs.tensors, storages)
        return FileHeader(
            **meta,
            prefix_nbytes=self.prefix_len,
            segments=segments,
            plan=plan,
            dtensors=notes,
            version=self.version,
        )

    def document(self, raw: Any) -> dict[str, Any]:
        """The document object, its keys and its format field checked."""
        doc: dict[str, Any]
        if self.tables is not None:
            doc = _object(raw, "document", _DOC_KEYS_V3)
            # From version 3 the JSON field repeats the binary version, which says what may appear.
            if doc["format"] != self.version or type(doc["format"]) is not int:
                raise _fail("format", f"expected {self.version}, got {doc['format']!r:.40}")
        else:
            doc = _object(raw, "document", _DOC_KEYS)
            # The binary version set the parse bound; the JSON one says which nodes may appear.
            schema = doc["format"]
            if type(schema) is not int or schema not in (1, 2):
                raise _fail("format", f"expected one of [1, 2], got {schema!r:.40}")
            self.version = schema
        return doc

    def tables_v2(
        self, doc: dict[str, Any], body_nbytes: int
    ) -> tuple[Segments, _Specs, tuple[DTensorNote | None, ...]]:
        """Storages and tensors as JSON lists (versions 1 and 2), then the tree."""
        segments = self.segments(_list(doc["storages"], "storages"), body_nbytes)
        entries = [
            self.tensor(t, f"tensors[{i}]", segments) for i, t in enumerate(_list(doc["tensors"], "tensors"))
        ]
        self.paths = [None] * len(entries)
        root = self.node(doc["tree"], (), 0)
        paths = self.all_paths()
        if len({spec.storage for spec, _ in entries}) != len(segments):
            raise _fail("storages", "a storage is not referenced by any tensor")
        specs = tuple(spec._replace(key_path=path) for (spec, _), path in zip(entries, paths, strict=True))
        return Segments.of(segments), _Specs(root, specs), tuple(note for _, note in entries)

    def all_paths(self) -> list[KeyPath]:
        if None in self.paths:
            raise _fail("tensors", f"tensor {self.paths.index(None)} is not referenced by the tree")
        return self.paths  # type: ignore[return-value]  # no None left

    def tables_v3(
        self, tables: _Tables, body_nbytes: int, doc: dict[str, Any]
    ) -> tuple[Segments, _Specs, tuple[DTensorNote | None, ...]]:
        """The binary tables (versions 3, 4), checked column by column, then the tree."""
        self.paths = [None] * len(tables.tensors)
        # The JSON tree goes as soon as it is walked: the specs below are the peak.
        tree = doc.pop("tree")
        root = self.node(tree, (), 0)
        del tree
        paths = self.all_paths()
        segments = _storage_table(tables.storages, body_nbytes)
        columns = _check_tensor_table(tables, segments)
        notes = self.dtensor_notes(doc["dtensors"], columns.records["kind"].tolist())
        specs = _tensor_specs(columns, paths)
        return segments, _Specs(root, specs), notes

    def dtensor_notes(self, raw: Any, kinds: list[int]) -> tuple[DTensorNote | None, ...]:
        notes: list[DTensorNote | None] = [None] * len(kinds)
        last = -1
        for entry in _list(raw, "dtensors"):
            if type(entry) is not list or len(entry) != 3:
                raise _fail("dtensors", f"expected [index, placements, global_shape], got {entry!r:.80}")
            index, placements, global_shape = entry
            if type(index) is not int or not last < index < len(kinds) or kinds[index] >= 2:
                raise _fail(
                    "dtensors", f"index {index!r:.40} is not a later tensor of kind tensor or parameter"
                )
            if type(placements) is not str:
                raise _fail("dtensors", "placements must be a str")
            notes[index] = DTensorNote(placements, _dims(global_shape, "dtensors", "global_shape"))
            self.charge(note_cost(placements, len(global_shape), self.bound_version))
            last = index
        return tuple(notes)

    @staticmethod
    def segments(raw: list[Any], body_nbytes: int) -> tuple[Segment, ...]:
        # The layout is canonical (each segment at the first aligned offset after the
        # previous one, nothing after the last), so in-bounds and non-overlapping follow.
        # One pass of inline checks: a header may list tens of thousands of storages.
        out = []
        end = 0
        for i, entry in enumerate(raw):
            if type(entry) is not list or len(entry) != 3:
                raise _fail(f"storages[{i}]", f"expected a list of 3, got {entry!r:.80}")
            offset, nbytes, crc = entry
            aligned = _align(end)
            if type(offset) is not int or offset != aligned:
                raise _fail(f"storages[{i}]", f"offset {offset!r:.40} is not the aligned offset {aligned}")
            if type(nbytes) is not int or type(crc) is not int or not (nbytes >= 0 and 0 <= crc < 1 << 32):
                raise _fail(f"storages[{i}]", f"expected a length and a crc32c, got {entry!r:.80}")
            end = offset + nbytes
            if end > body_nbytes:
                raise _fail(f"storages[{i}]", f"bytes [{offset}, {end}) overrun the {body_nbytes}-byte body")
            out.append(Segment(offset, nbytes, crc))
        if end != body_nbytes:
            raise _fail("body_nbytes", f"{body_nbytes} bytes, but the storages end at {end}")
        return tuple(out)

    def tensor(
        self, raw: Any, where: str, segments: Sequence[Segment]
    ) -> tuple[TensorSpec, DTensorNote | None]:
        """A version-1/2 tensor entry, its key path not yet known (``()``), and its DTensor note."""
        # Inline checks, no helper calls per dimension: this runs once per tensor.
        if type(raw) is not list or len(raw) not in (7, 8):
            raise _fail(where, f"expected a list of 7 or 8 fields, got {raw!r:.80}")
        storage, dtype_name, shape, stride, offset, kind, requires_grad = raw[:7]
        if type(storage) is not int or not 0 <= storage < len(segments):
            raise _fail(where, f"storage {storage!r:.40} is not one of the {len(segments)} storages")
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise _fail(where, f"dtype {dtype_name!r:.40} is not allowed")
        size = _dims(shape, where, "shape")
        strides = _dims(stride, where, "stride")
        if len(strides) != len(size):
            raise _fail(where, f"{len(strides)} strides for {len(size)} dimensions")
        if type(offset) is not int or not 0 <= offset < _INT64:
            raise _fail(where, f"offset {offset!r:.40} is not an int in [0, 2**63)")
        if _numel_overflows(size):
            raise _fail(where, f"shape {size} has too many elements")
        if 0 not in size:
            last = offset
            for n, st in zip(size, strides, strict=True):
                last += (n - 1) * st
            if last >= _INT64 or (last + 1) * dtype.itemsize > segments[storage].nbytes:
                raise _fail(
                    where,
                    f"shape {size} with stride {strides} at offset {offset} reaches past its "
                    f"{segments[storage].nbytes}-byte storage",
                )
        tensor_kind = _KINDS.get(kind) if type(kind) is str else None
        if tensor_kind is None:
            raise _fail(where, f"kind must be one of {sorted(_KINDS)}, got {kind!r:.40}")
        if type(requires_grad) is not bool:
            raise _fail(where, "requires_grad must be a bool")
        why = tensor_refused(dtype, TensorKind.TENSOR, FLAG_REQUIRES_GRAD * requires_grad)
        if why is not None:
            raise _fail(where, why)
        if tensor_kind in _V2_KINDS and self.version < 2:
            raise _fail(where, f"kind {kind} needs format version 2")
        if tensor_kind is TensorKind.NDARRAY and (
            dtype_name not in NUMPY_DTYPES or requires_grad or len(raw) == 8
        ):
            raise _fail(
                where, f"an ndarray must have a numpy dtype, no grad and no DTensor note, got {raw!r:.80}"
            )
        note = None
        if len(raw) == 8:
            dt = _object(raw[7], f"{where} dtensor", _DTENSOR_KEYS)
            if type(dt["placements"]) is not str:
                raise _fail(f"{where} dtensor", "placements must be a str")
            global_shape = _dims(dt["global_shape"], f"{where} dtensor", "global_shape")
            note = DTensorNote(dt["placements"], global_shape)
        return TensorSpec((), storage, dtype, size, strides, offset, tensor_kind, requires_grad), note

    def charge(self, nbytes: int) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise _fail("document", "too dense: parsing it would allocate more than its bound (_parse_cost)")

    def scalar(self, raw: Any, path: KeyPath) -> Any:
        if type(raw) in _SCALARS:
            return raw
        if type(raw) is list and len(raw) == 2 and raw[0] == "float" and raw[1] in _NONFINITE:
            return _NONFINITE[raw[1]]
        raise _fail(_where(path), f"expected a JSON scalar, got {raw!r:.80}")

    def leaf(self, raw: list[Any], path: KeyPath) -> Any:
        """A tagged leaf of format version 2 (``raw[0]`` is in :data:`_V2_LEAVES`)."""
        tag = raw[0]
        if self.version < 2:
            raise _fail(_where(path), f"{tag!r} leaves need format version 2")
        try:
            value = _LEAF_DECODERS[tag](*raw[1:])
        except (TypeError, ValueError, OverflowError, RuntimeError, binascii.Error) as exc:
            raise _fail(_where(path), f"malformed {tag} leaf {raw!r:.80}: {exc}") from exc
        if value is None:
            raise _fail(_where(path), f"malformed {tag} leaf {raw!r:.80}")
        return value

    def node(self, raw: Any, path: KeyPath, depth: int) -> Node:
        if type(raw) is not list or not raw or raw[0] == "float":
            return AtomNode(self.scalar(raw, path))
        if type(raw[0]) is str and raw[0] in _V2_LEAVES:
            return AtomNode(self.leaf(raw, path))
        tag = raw[0]
        if tag == "tensor" and len(raw) == 2 and type(raw[1]) is int and 0 <= raw[1] < len(self.paths):
            index = raw[1]
            if self.paths[index] is None:
                self.paths[index] = path
                self.charge(path_cost(len(path)))
            return TensorNode(index)
        where = _where(path)
        if tag == "ref":
            return RefNode(_int(_list(raw, where, 2)[1], where, 0, self.containers))
        if depth >= MAX_DEPTH:
            raise _fail(where, f"containers nested deeper than {MAX_DEPTH} levels")
        node: Node
        if tag in ("dict", "odict"):
            _, keys, values, *more = _list(raw, where, 4 if tag == "odict" and len(raw) == 4 else 3)
            keys = _list(keys, where)
            try:  # hashable: each is a JSON scalar as it is
                distinct = len(set(keys))
            except TypeError:  # a list (a non-finite float) or an object among them
                keys = [self.scalar(k, path) for k in keys]
                distinct = len(set(keys))
            if distinct != len(keys):
                raise _fail(where, "duplicate dict key")
            if type(values) is int and self.version >= 4:
                nodes = self.run(keys, values, path, where)
            else:
                nodes = self.children(keys, _list(values, where, len(keys)), path, depth)
            attrs = self.attrs(more[0], path, depth) if more else ()
            proto: dict[Any, Any] | None = None if tag == "dict" else collections.OrderedDict()
            node = DictNode(self.containers, tuple(keys), nodes, proto, attrs)
        elif tag in ("list", "tuple"):
            items = _list(_list(raw, where, 2)[1], where)
            nodes = self.children(range(len(items)), items, path, depth)
            node = SeqNode(self.containers, list if tag == "list" else tuple, nodes, None, ())
        elif tag == "namedtuple":
            _, typename, fields, items = _list(raw, where, 4)
            fields = _list(fields, where)
            items = _list(items, where, len(fields))
            nodes = self.children(range(len(items)), items, path, depth)
            node = SeqNode(self.containers, self.namedtuple(typename, fields, where), nodes, None, ())
        else:
            raise _fail(where, f"unknown or malformed node {raw!r:.80}")
        self.charge(self.container_cost)
        self.containers += 1
        return node

    def run(self, keys: list[Any], first: int, path: KeyPath, where: str) -> tuple[Node, ...]:
        """A version-4 tensor run: the dict's values are tensors ``first``, ``first + 1``, ...,
        each met here first."""
        nodes = self.take_run(keys, first, len(keys), path) if keys else None
        if nodes is None:
            raise _fail(where, f"tensors {first!r:.40}.. are not {len(keys)} tensors met here first")
        return nodes

    def take_run(self, keys: Iterable[Any], first: int, count: int, path: KeyPath) -> tuple[Node, ...] | None:
        """The nodes of tensors ``first`` .. ``first + count - 1``, the values of ``keys``
        under ``path``, their key paths recorded and charged; ``None`` unless they all exist
        and none is referenced yet."""
        paths = self.paths
        if not (
            first >= 0 and first + count <= len(paths) and paths[first : first + count].count(None) == count
        ):
            return None
        # Its nodes are shared (tensor_nodes); where made anew, each tensor's table charge
        # covers its node (tests/test_format.py measures the densest runs).
        self.charge(count * path_cost(len(path) + 1))
        # Each key path is one tuple, made by zip: the path's keys repeated, then the key.
        paths[first : first + count] = zip(*map(repeat, path), keys, strict=False)
        return tensor_nodes(first, first + count)

    def children(self, keys: Iterable[Any], raws: list[Any], path: KeyPath, depth: int) -> tuple[Node, ...]:
        fresh = self.fresh_tensors(keys, raws, path)
        return fresh if fresh is not None else self.mixed_children(keys, raws, path, depth)

    def fresh_tensors(self, keys: Iterable[Any], raws: list[Any], path: KeyPath) -> tuple[Node, ...] | None:
        """The children of a container that holds only first references to distinct tensors
        (a module's state_dict), checked and built a column at a time; ``None`` otherwise.

        The same checks as :meth:`mixed_children`, in bulk: ``list.count`` rather than a
        set where a value may be unhashable.  All the key paths are charged before any is made.
        """
        count = len(raws)
        if not count:
            return None
        try:  # one pass splits the [tag, index] pairs and checks they all have one length
            columns = list(islice(zip(*raws, strict=True), 3))  # no more: long items are refused
        except (TypeError, ValueError):  # a scalar among them, or pairs and triples
            return None
        # A str or an object among them is split too, but its tag is a character or its
        # index a str: only lists of "tensor" and an int get through.
        if len(columns) != 2 or columns[0].count("tensor") != count:
            return None
        indices: tuple[int, ...] = columns[1]
        if list(map(type, indices)).count(int) != count:
            return None
        first, last = indices[0], indices[-1]
        # The common case, as the encoder numbers tensors: consecutive (a C-speed check).
        if last - first == count - 1 and indices == tuple(range(first, last + 1)):
            return self.take_run(keys, first, count, path)
        if not self.claim(indices):
            return None
        self.charge(count * path_cost(len(path) + 1))
        # Each key path is one tuple, made by zip: the path's keys repeated, then the key.
        children = zip(*map(repeat, path), keys, strict=False)  # the repeats are endless
        paths = self.paths
        for index, child in zip(indices, children, strict=True):
            paths[index] = child
        return tuple(map(_new_tuple, repeat(TensorNode), zip(indices)))

    def claim(self, indices: tuple[int, ...]) -> bool:
        """Whether ``indices`` (ints) are distinct tensors not yet referenced."""
        paths, count = self.paths, len(indices)
        if min(indices) < 0 or max(indices) >= len(paths):
            return False
        return list(map(paths.__getitem__, indices)).count(None) == count and len(set(indices)) == count

    def mixed_children(
        self, keys: Iterable[Any], raws: list[Any], path: KeyPath, depth: int
    ) -> tuple[Node, ...]:
        # Tensor references are the bulk of a tree: checked inline (the same checks as
        # node()), a key path made only for a tensor's first reference, the budget kept in a
        # local between nested calls, each node one tuple.__new__ (see _tensor_table).
        out: list[Node] = []
        append = out.append
        paths = self.paths
        count = len(paths)
        cost = path_cost(len(path) + 1)  # a child's key path: one key more
        budget = self.budget
        for key, raw in zip(keys, raws, strict=True):
            if type(raw) is list and len(raw) == 2 and raw[0] == "tensor" and type(raw[1]) is int:
                index = raw[1]
                if 0 <= index < count:
                    if paths[index] is None:
                        paths[index] = (*path, key)
                        budget -= cost
                        if budget < 0:
                            self.budget = budget
                            self.charge(0)  # raises
                    append(_new_tuple(TensorNode, (index,)))
                    continue
            self.budget = budget
            append(self.node(raw, (*path, key), depth + 1))
            budget = self.budget
        self.budget = budget
        return tuple(out)

    def attrs(self, raw: Any, path: KeyPath, depth: int) -> tuple[tuple[str, Node], ...]:
        if type(raw) is not dict or not raw or not all(_attr_name_ok(name) for name in raw):
            raise _fail(
                _where(path), f"attributes must be a non-empty object of plain names, got {raw!r:.80}"
            )
        return tuple((name, self.node(v, (*path, Attr(name)), depth + 1)) for name, v in raw.items())

    def namedtuple(self, typename: Any, fields: list[Any], where: str) -> type:
        if type(typename) is not str or not all(type(f) is str for f in fields):
            raise _fail(where, "namedtuple name and fields must be strs")
        key = (typename, tuple(fields))
        known = self.namedtuples.get(key)
        if known is not None:
            return known
        try:
            self.charge(namedtuple_cost(typename, fields, self.bound_version))
            made = _namedtuple_class(typename, fields)
        except (ValueError, TypeError) as exc:
            raise _fail(where, f"invalid namedtuple: {exc}") from exc
        self.namedtuples[key] = made
        return made
