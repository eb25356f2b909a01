"""The strict header parser: a header's two JSON documents and its checked tables to a
:class:`FileHeader`.

The structure document (``{"dtensors": [...], "tree": ...}``) says how to rebuild the tree;
the values document holds the metadata and the scalar table the tree refers to
(:mod:`astage._format.scalars`).  Every field is checked, and the parse bound
(:mod:`astage._format.parse_bound`) charged, as the parse meets it.  Leaves are rebuilt from
an explicit list of tags; nothing is imported or evaluated by name.  Pure: no file, socket
or thread.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Iterable
from itertools import islice, repeat
from typing import Any, Final

import sniffio
import torch

from .._staging.plan import (
    AtomNode,
    DictNode,
    Node,
    RefNode,
    SeqNode,
    StagePlan,
    StorageSpec,
    TensorNode,
    tensor_nodes,
)
from .._util.errors import Attr, KeyPath, format_key_path
from .._util.limits import INT64 as _INT64
from .._util.limits import RANK_LIMIT as _RANK_LIMIT
from .parse_bound import container_cost, namedtuple_cost, note_cost, path_cost, scalars_cost
from .scalars import key_value, scalar_values
from .spec import FORMAT_VERSION, ID_CAP, MAX_DEPTH, MAX_NDIM, DTensorNote, FileHeader, header_error
from .tables import RawTables, check_storage_table, check_tensor_table, new_tuple, tensor_specs
from .tree_encoder import attr_name_ok, namedtuple_class

GIL_TURN_SECONDS: Final = 0.0005
"""Longest stretch of a header's walk between two offers of the GIL to a waiting thread."""

_CPU: Final = torch.device("cpu")
_CONTAINER_COST: Final = container_cost()

META_KEYS: Final = ("format", "owner_rank", "holder_rank", "step", "checkpoint_id", "created", "body_nbytes")
"""The values document's metadata members, in the order the encoder writes them."""
VALUES_KEYS: Final = frozenset({*META_KEYS, "scalars"})
STRUCTURE_KEYS: Final = frozenset({"dtensors", "tree"})


def reject_constant(name: str) -> Any:
    """``json.loads``'s ``parse_constant``: no NaN or Infinity in a header."""
    raise ValueError(f"{name} is not allowed in a checkpoint file header")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: no key twice in an object."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a JSON object")
    return out


def _int(value: Any, where: str, lo: int = 0, hi: int = _INT64) -> int:
    if type(value) is not int or not lo <= value < hi:
        raise header_error(where, f"expected an int in [{lo}, {hi}), got {value!r:.80}")
    return value


def _list(value: Any, where: str, length: int | None = None) -> list[Any]:
    if type(value) is not list or (length is not None and len(value) != length):
        raise header_error(
            where, f"expected a list{'' if length is None else f' of {length}'}, got {value!r:.80}"
        )
    return value


def _object(value: Any, where: str, keys: frozenset[str]) -> dict[str, Any]:
    if type(value) is not dict or value.keys() != keys:
        raise header_error(where, f"expected an object with keys {sorted(keys)}, got {value!r:.120}")
    return value


def _dims(value: Any, where: str, what: str) -> tuple[int, ...]:
    """A shape-like list: at most :data:`MAX_NDIM` ints in [0, 2**63)."""
    if type(value) is not list or len(value) > MAX_NDIM:
        raise header_error(where, f"{what} must be a list of at most {MAX_NDIM} ints, got {value!r:.80}")
    for n in value:
        if type(n) is not int or not 0 <= n < _INT64:
            raise header_error(where, f"{what} {value!r:.80} holds {n!r:.40}, not an int in [0, 2**63)")
    return tuple(value)


def parse_values(doc: Any) -> tuple[dict[str, Any], list[Any]]:
    """A values document's metadata, checked, as :class:`FileHeader` keywords, and its
    scalar table's values, each checked.

    :raises IntegrityError: a missing, extra or malformed member.
    """
    doc = _object(doc, "document values", VALUES_KEYS)
    if doc["format"] != FORMAT_VERSION or type(doc["format"]) is not int:
        raise header_error("format", f"expected {FORMAT_VERSION}, got {doc['format']!r:.40}")
    checkpoint_id = doc["checkpoint_id"]
    if type(checkpoint_id) is not str or len(checkpoint_id) > ID_CAP:
        raise header_error("checkpoint_id", f"expected a str of at most {ID_CAP} characters")
    created = doc["created"]
    if type(created) is not float or not math.isfinite(created):
        raise header_error("created", f"expected a finite float, got {created!r:.40}")
    holder = doc["holder_rank"]
    meta = {
        "owner_rank": _int(doc["owner_rank"], "owner_rank", 0, _RANK_LIMIT),
        "holder_rank": None if holder is None else _int(holder, "holder_rank", 0, _RANK_LIMIT),
        "step": _int(doc["step"], "step", -_INT64),
        "checkpoint_id": checkpoint_id,
        "created": created,
        "body_nbytes": _int(doc["body_nbytes"], "body_nbytes"),
    }
    return meta, scalar_values(doc["scalars"])


def _where(path: KeyPath) -> str:
    return f"tree at {format_key_path(path):.200}"


def _off_the_loop() -> bool:
    """Whether this thread runs no event loop (a worker thread, or a program without one)."""
    try:
        sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return True
    return False


class HeaderParser:
    """A header's documents and tables to :class:`FileHeader`, checking every field.

    :param budget: what the parse may charge for the structure (the parse bound less what
        the text's tokens and the tables cost); :attr:`budget` is what is left after it.
    """

    def __init__(self, prefix_len: int, budget: int, tables: RawTables) -> None:
        self.prefix_len = prefix_len
        self.budget = budget
        self.tables = tables
        self.containers = 0
        self.paths: list[KeyPath | None] = [None] * len(tables.tensors)
        self.namedtuples: dict[tuple[str, tuple[str, ...]], type] = {}
        self.scalars: list[Any] = []
        self.next_scalar = 0
        self.turn_at = time.perf_counter() + GIL_TURN_SECONDS if _off_the_loop() else math.inf

    def give_gil(self) -> None:
        """Let a thread waiting for the GIL (the event loop's, while a worker parses) have
        it now: else it waits the interpreter's whole switch interval (5 ms) at a time, and
        a parse of 20,000 tensors' header (~0.1 s of Python) made the loop's heartbeat
        late by 5 ms every 6 ms.  (Nothing on an event loop's own thread.)"""
        if self.turn_at != math.inf:
            time.sleep(0)
            self.turn_at = time.perf_counter() + GIL_TURN_SECONDS

    def parse(self, structure: Any, values: Any) -> FileHeader:
        """The header of these documents (``structure``'s tree is dropped as it is walked)."""
        meta, self.scalars = parse_values(values)
        self.charge(scalars_cost(len(self.scalars)))
        doc = _object(structure, "document structure", STRUCTURE_KEYS)
        tree = doc.pop("tree")
        root = self.node(tree, (), 0)
        del tree  # the JSON tree goes as soon as it is walked: the specs below are the peak
        self.give_gil()
        if self.next_scalar != len(self.scalars):
            raise header_error(
                "scalars", f"{len(self.scalars)} scalars, the tree refers to {self.next_scalar}"
            )
        if None in self.paths:
            raise header_error("tensors", f"tensor {self.paths.index(None)} is not referenced by the tree")
        segments = check_storage_table(self.tables.storages, meta["body_nbytes"])
        columns = check_tensor_table(self.tables, segments)
        self.give_gil()
        notes = self.dtensor_notes(doc["dtensors"], columns.records["kind"].tolist())
        specs = tensor_specs(columns, self.paths, self.give_gil)  # type: ignore[arg-type]  # no None left
        # Equal specs shared, like equal shapes (see astage._format.tables._shapes).
        sizes = segments.nbytes.tolist()
        shared = {nbytes: StorageSpec(nbytes, _CPU) for nbytes in set(sizes)}
        plan = StagePlan(root, specs, tuple(map(shared.__getitem__, sizes)))
        return FileHeader(**meta, prefix_nbytes=self.prefix_len, segments=segments, plan=plan, dtensors=notes)

    def dtensor_notes(self, raw: Any, kinds: list[int]) -> tuple[DTensorNote | None, ...]:
        notes: list[DTensorNote | None] = [None] * len(kinds)
        last = -1
        for entry in _list(raw, "dtensors"):
            if type(entry) is not list or len(entry) != 3:
                raise header_error(
                    "dtensors", f"expected [index, placements, global_shape], got {entry!r:.80}"
                )
            index, placements, global_shape = entry
            if type(index) is not int or not last < index < len(kinds) or kinds[index] >= 2:
                raise header_error(
                    "dtensors", f"index {index!r:.40} is not a later tensor of kind tensor or parameter"
                )
            if type(placements) is not str:
                raise header_error("dtensors", "placements must be a str")
            notes[index] = DTensorNote(placements, _dims(global_shape, "dtensors", "global_shape"))
            self.charge(note_cost(placements, len(global_shape)))
            last = index
        return tuple(notes)

    def charge(self, nbytes: int) -> None:
        self.budget -= nbytes
        if self.budget < 0:
            raise header_error(
                "document", "too dense: parsing it would allocate more than its bound (text_parse_cost)"
            )

    def scalar(self, raw: int, path: KeyPath) -> AtomNode:
        """The leaf ``raw`` refers to: the next entry of the scalar table, and only it."""
        k = self.next_scalar
        if raw != k or k >= len(self.scalars):
            raise header_error(_where(path), f"scalar {raw} where the table's entry {k} comes next")
        self.next_scalar = k + 1
        return AtomNode(self.scalars[k])

    def node(self, raw: Any, path: KeyPath, depth: int) -> Node:
        if type(raw) is int:
            return self.scalar(raw, path)
        if time.perf_counter() > self.turn_at:
            self.give_gil()
        where = _where(path)
        if type(raw) is not list or not raw:
            raise header_error(where, f"expected a node, got {raw!r:.80}")
        tag = raw[0]
        if tag == "tensor" and len(raw) == 2 and type(raw[1]) is int and 0 <= raw[1] < len(self.paths):
            index = raw[1]
            if self.paths[index] is None:
                self.paths[index] = path
                self.charge(path_cost(len(path)))
            return TensorNode(index)
        if tag == "ref":
            return RefNode(_int(_list(raw, where, 2)[1], where, 0, self.containers))
        if depth >= MAX_DEPTH:
            raise header_error(where, f"containers nested deeper than {MAX_DEPTH} levels")
        node: Node
        if tag in ("dict", "odict"):
            node = self.dict_node(raw, path, depth, where)
        elif tag in ("list", "tuple", "namedtuple"):
            node = self.seq_node(raw, path, depth, where)
        else:
            raise header_error(where, f"unknown or malformed node {raw!r:.80}")
        self.charge(_CONTAINER_COST)
        self.containers += 1
        return node

    def dict_node(self, raw: list[Any], path: KeyPath, depth: int, where: str) -> DictNode:
        tag = raw[0]
        _, keys, values, *more = _list(raw, where, 4 if tag == "odict" and len(raw) == 4 else 3)
        keys = _list(keys, where)
        try:  # hashable: each is a JSON scalar as it is
            distinct = len(set(keys))
        except TypeError:  # a list (a non-finite float) or an object among them
            keys = [key_value(k, where) for k in keys]
            distinct = len(set(keys))
        if distinct != len(keys):
            raise header_error(where, "duplicate dict key")
        if type(values) is int:
            nodes = self.run(keys, values, path, where)
        else:
            nodes = self.children(keys, _list(values, where, len(keys)), path, depth)
        attrs = self.attrs(more[0], path, depth) if more else ()
        proto: dict[Any, Any] | None = None if tag == "dict" else collections.OrderedDict()
        return DictNode(self.containers, tuple(keys), nodes, proto, attrs)

    def seq_node(self, raw: list[Any], path: KeyPath, depth: int, where: str) -> SeqNode:
        if raw[0] == "namedtuple":
            _, typename, fields, items = _list(raw, where, 4)
            fields = _list(fields, where)
            items = _list(items, where, len(fields))
            cls: type = self.namedtuple(typename, fields, where)
        else:
            items = _list(_list(raw, where, 2)[1], where)
            cls = list if raw[0] == "list" else tuple
        nodes = self.children(range(len(items)), items, path, depth)
        return SeqNode(self.containers, cls, nodes, None, ())

    def run(self, keys: list[Any], first: int, path: KeyPath, where: str) -> tuple[Node, ...]:
        """A tensor run: the dict's values are tensors ``first``, ``first + 1``, ..., each
        met here first."""
        nodes = self.take_run(keys, first, len(keys), path) if keys else None
        if nodes is None:
            raise header_error(where, f"tensors {first!r:.40}.. are not {len(keys)} tensors met here first")
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
        return tuple(map(new_tuple, repeat(TensorNode), zip(indices)))

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
        # local between nested calls, each node one tuple.__new__ (see pack_tensor_table).
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
                    append(new_tuple(TensorNode, (index,)))
                    continue
            self.budget = budget
            append(self.node(raw, (*path, key), depth + 1))
            budget = self.budget
        self.budget = budget
        return tuple(out)

    def attrs(self, raw: Any, path: KeyPath, depth: int) -> tuple[tuple[str, Node], ...]:
        if type(raw) is not dict or not raw or not all(attr_name_ok(name) for name in raw):
            raise header_error(
                _where(path), f"attributes must be a non-empty object of plain names, got {raw!r:.80}"
            )
        return tuple((name, self.node(v, (*path, Attr(name)), depth + 1)) for name, v in raw.items())

    def namedtuple(self, typename: Any, fields: list[Any], where: str) -> type:
        if type(typename) is not str or not all(type(f) is str for f in fields):
            raise header_error(where, "namedtuple name and fields must be strs")
        key = (typename, tuple(fields))
        known = self.namedtuples.get(key)
        if known is not None:
            return known
        try:
            self.charge(namedtuple_cost(typename, fields))
            made = namedtuple_class(typename, fields)
        except (ValueError, TypeError) as exc:
            raise header_error(where, f"invalid namedtuple: {exc}") from exc
        self.namedtuples[key] = made
        return made
