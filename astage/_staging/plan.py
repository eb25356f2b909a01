"""Plan a state_dict: one pure walk that says what to copy and how to rebuild the tree.

:func:`plan_state_dict` walks the user's tree once and returns a :class:`StagePlan` (frozen
data: the tree's shape, one :class:`TensorSpec` per distinct tensor, one
:class:`StorageSpec` per distinct storage) plus the source tensors it refers to.  It touches
no device, thread or file, so every rule here is tested on CPU.

Invariants:

* Tensors that share a storage in the source share one storage in the plan, with the same
  ``storage_offset``, size and stride; tensors that do not, do not.  A staged storage has
  exactly the source storage's byte size.
* The same Python object met twice (a tied Parameter, a dict referenced from two places)
  is rebuilt as one object met twice; a reference cycle is rejected.
* Anything that cannot be copied faithfully raises :class:`UnsupportedInputError` with its
  key path, while planning, before any byte is copied: open files, sockets, threads,
  locks, generators, weak references, objects that need arguments to be created again or
  keep state outside their attributes, and nesting deeper than :data:`MAX_DEPTH`.
  Nothing is ever silently dropped or copied wrongly.
* An ``io.BytesIO`` is the one stream staged (DCP saves it as an item of its own): a
  :class:`BytesIONode` that names the source, whose bytes and position are copied as the
  stage runs (never from an earlier stage: a plan with one is never re-used).
* Each container is read once, as a snapshot taken before its items are walked: the walk
  yields to the event loop between slices, and a container another task changes meanwhile
  is staged as it was when its walk began, never torn.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import decimal
import enum
import fractions
import io
import itertools
import operator
import pathlib
import socket
import sys
import threading
import types
import weakref
from collections.abc import Iterable
from typing import Any, Final, NamedTuple, NoReturn, cast

import torch

from .._util.errors import Attr, KeyPath, UnsupportedInputError
from .._util.timeslice import Steps, clear_in_slices, drive, drop_in_slices, slice_over

_first = operator.itemgetter(0)


def dtensor_class() -> type | None:
    """DTensor if torch.distributed.tensor is loaded (it costs ~1.7 s to import; a state_dict
    cannot hold a DTensor unless its user has imported it already)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


_CPU = torch.device("cpu")

_ATOMS: frozenset[type] = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        range,
        slice,
        type(Ellipsis),
        decimal.Decimal,
        fractions.Fraction,
        torch.dtype,
        torch.device,
        torch.Size,
        torch.layout,
        torch.memory_format,
        types.FunctionType,
        types.BuiltinFunctionType,
        types.ModuleType,
    }
)
"""Immutable leaf types kept by reference: copying them could never isolate anything."""

MAX_DEPTH = 200
"""Deepest nesting of containers and objects a state_dict may have.

The walk and the rebuild recurse once per level (three Python frames each), so this
bound keeps both well inside Python's default recursion limit of 1,000 frames whatever
the caller's own stack; a deeper tree is refused with its key path instead of failing
with a bare ``RecursionError``.  Real state_dicts nest a handful of levels.
"""

_REFUSED: tuple[tuple[tuple[type, ...], str], ...] = (
    (
        (io.IOBase,),
        "a file or stream keeps state outside its attributes (a position, for a file a descriptor); "
        "of streams only io.BytesIO itself is staged",
    ),
    ((socket.socket,), "a socket is an operating-system resource"),
    ((threading.Thread,), "a thread cannot be copied"),
    (
        (type(threading.Lock()), type(threading.RLock()), threading.Condition, threading.Semaphore),
        "a lock belongs to the threads that use it",
    ),
    (
        (
            types.GeneratorType,
            types.CoroutineType,
            types.AsyncGeneratorType,
            types.FrameType,
            types.TracebackType,
        ),
        "a running computation (generator, coroutine, frame) cannot be copied",
    ),
    (
        (weakref.ReferenceType, weakref.ProxyType, weakref.CallableProxyType),
        "a weak reference would still point at the source object",
    ),
)
"""Types refused outright, with the reason given to the caller."""

_POINTER = 8 if sys.maxsize > 2**32 else 4
_NEWOBJ = vars(copyreg)["__newobj__"]  # what __reduce_ex__ names for "cls.__new__(cls), then state"


class TensorKind(enum.Enum):
    """Which Python type a staged tensor is rebuilt as."""

    TENSOR = "tensor"
    PARAMETER = "parameter"
    DTENSOR = "dtensor"
    NDARRAY = "ndarray"  # a numpy array stored as a raw storage; only replicas (_format) make it
    BYTESIO = "bytesio"  # an io.BytesIO stored as its bytes (1-D uint8); only _format makes it


# Specs and leaf nodes are NamedTuples, not frozen dataclasses: a plan holds one per tensor,
# and a NamedTuple is built several times faster, which matters for many small tensors.


class StorageSpec(NamedTuple):
    """One distinct source storage: its byte size and device."""

    nbytes: int
    device: torch.device


class TensorSpec(NamedTuple):
    """One distinct source tensor: how to view its staged storage and what to rebuild."""

    key_path: KeyPath
    storage: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    kind: TensorKind
    requires_grad: bool
    conj: bool = False
    neg: bool = False
    attrs: Node | None = None
    dtensor_spec: Any = None


# -- tree nodes ---------------------------------------------------------------------------


class AtomNode(NamedTuple):
    """An immutable leaf, kept by reference."""

    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class CopyNode:
    """A mutable non-container leaf, deep-copied at rebuild so the source can change."""

    value: Any


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class BytesIONode:
    """An ``io.BytesIO`` leaf: staged as a new BytesIO holding a copy of its bytes, at its position.

    The bytes are read from ``source`` when the stage copies (:func:`astage._staging.rebuild.copy_bytes_io`,
    in a worker thread), not when it plans; ``memo`` makes the same BytesIO met twice one copy.
    """

    memo: int
    source: io.BytesIO
    key_path: KeyPath


class TensorNode(NamedTuple):
    """A tensor leaf: position in :attr:`StagePlan.tensors`."""

    position: int


SHARED_TENSOR_NODES: Final = 1 << 17
"""Positions below this have one :class:`TensorNode` each, shared by every plan (~10 MiB at
most, made as plans need them)."""
_tensor_nodes: tuple[TensorNode, ...] = ()


def tensor_nodes(first: int, end: int) -> tuple[TensorNode, ...]:
    """``TensorNode(first)`` to ``TensorNode(end - 1)``, shared between plans where ``end``
    is at most :data:`SHARED_TENSOR_NODES`: a slice, where a parse made a node and its int
    a tensor.  Nodes are immutable, so sharing them is safe."""
    global _tensor_nodes
    if end > SHARED_TENSOR_NODES:
        return _new_nodes(first, end)
    known = _tensor_nodes
    if end > len(known):  # grown a multiple of 4,096 at a time: ~0.6 ms a step, in a walk's slice
        size = min(SHARED_TENSOR_NODES, -(-end // 4096) * 4096)
        known = known + _new_nodes(len(known), size)
        _tensor_nodes = known
    return known[first:end]


def tensor_node(position: int) -> TensorNode:
    """``TensorNode(position)``, shared where :func:`tensor_nodes` shares it: a planner made
    a node and an int a tensor, which all died with the plan."""
    known = _tensor_nodes
    if position < len(known):
        return known[position]
    return tensor_nodes(position, position + 1)[0]


def _new_nodes(first: int, end: int) -> tuple[TensorNode, ...]:
    # tuple.__new__ on each 1-tuple zip makes: no Python-level __new__ or _make a node.
    return tuple(map(tuple.__new__, itertools.repeat(TensorNode), zip(range(first, end))))


@dataclasses.dataclass(frozen=True, slots=True)
class RefNode:
    """A container already met elsewhere in the tree (identity is preserved)."""

    memo: int


@dataclasses.dataclass(frozen=True, slots=True)
class DictNode:
    """A dict or dict subclass; ``prototype`` is the source (used for subclasses only)."""

    memo: int
    keys: tuple[Any, ...]
    values: tuple[Node, ...]
    prototype: dict[Any, Any] | None
    attrs: tuple[tuple[str, Node], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class SeqNode:
    """A list, tuple, namedtuple or a subclass of list/tuple."""

    memo: int
    cls: type
    items: tuple[Node, ...]
    prototype: list[Any] | None
    attrs: tuple[tuple[str, Node], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectNode:
    """An object rebuilt from its ``__dict__`` and ``__slots__`` (dataclasses, frozen too)."""

    memo: int
    cls: type
    fields: tuple[tuple[str, Node], ...]


Node = AtomNode | CopyNode | TensorNode | RefNode | DictNode | SeqNode | ObjectNode | BytesIONode


@dataclasses.dataclass(frozen=True, slots=True)
class StagePlan:
    """What to copy (storages) and how to rebuild the tree over the copies (tensors, root)."""

    root: Node
    tensors: tuple[TensorSpec, ...]
    storages: tuple[StorageSpec, ...]
    streams: tuple[BytesIONode, ...] = ()
    """Every ``io.BytesIO`` of the tree, once each: what the stage copies besides storages."""

    @property
    def nbytes(self) -> int:
        """Bytes of all distinct storages: what staging copies and allocates."""
        return sum(s.nbytes for s in self.storages)


@dataclasses.dataclass(frozen=True, slots=True)
class PlannedSource:
    """A plan bound to the source objects it was made from.

    ``tensors[i]`` is the plain (local) source tensor of ``plan.tensors[i]`` and
    ``storages[j]`` the source storage of ``plan.storages[j]``.
    """

    plan: StagePlan
    tensors: tuple[torch.Tensor, ...]
    storages: tuple[torch.UntypedStorage, ...]
    plain: bool = False
    """Every node is a container, an atom or a tensor without attributes (no object, no
    deep-copied leaf, no BytesIO): a rebuild of the tree over new storages plans again to
    this very plan, but for the storages' devices."""


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        names.extend(s for s in slots if s not in ("__dict__", "__weakref__") and s not in names)
    return names


class _Rebuild(enum.Enum):
    """How the rebuild recreates an object (see :meth:`Planner.rebuild_of`)."""

    ATTRIBUTES = "cls.__new__(cls), then its attributes"
    BY_NAME = "the same object: a global that pickles by name"


def _has_fileno(x: object) -> bool:
    try:
        return callable(getattr(x, "fileno", None))
    except Exception:  # a __getattr__ that fails in its own way: not a file wrapper we know
        return False


def _plain_size(cls: type, slots: list[str]) -> int:
    """The instance size of ``cls`` if all its state were ``__dict__``, ``__slots__`` and
    the weak-reference slot (the check ``pickle`` makes before copying an object)."""
    size = object.__basicsize__ + _POINTER * len(slots)
    if cls.__weakrefoffset__:
        size += _POINTER
    if cls.__dictoffset__ > 0:  # a negative or managed dict lives outside the basic size
        size += _POINTER
    return size


class Planner:
    def __init__(self, *, strict: bool, allowed_devices: frozenset[str]) -> None:
        self.strict = strict
        self.allowed_devices = allowed_devices
        self.tensors: list[TensorSpec] = []
        self.sources: list[torch.Tensor] = []
        self.storages: list[StorageSpec] = []
        self.storage_objs: list[torch.UntypedStorage] = []
        self.storage_index: dict[int, int] = {}
        self.storage_specs: dict[tuple[int, torch.device], StorageSpec] = {}
        self.tensor_index: dict[int, int] = {}
        self.memo: dict[int, int] = {}
        self.active: set[int] = set()
        self.keepalive: list[object] = []
        self.rebuilds: dict[type, _Rebuild | str] = {}
        self.streams: list[BytesIONode] = []
        self.plain = True  # see PlannedSource.plain

    def walk(self, x: Any, path: KeyPath) -> Steps[Node]:
        cls = type(x)
        if cls in _ATOMS:
            return AtomNode(x)
        if isinstance(x, torch.Tensor):
            return (yield from self.tensor(x, path))
        if id(x) in self.memo:
            return RefNode(self.memo[id(x)])
        if isinstance(x, (enum.Enum, type, pathlib.PurePath)):  # immutable values too
            return AtomNode(x)
        if id(x) in self.active:
            raise UnsupportedInputError(path, "reference cycle: this object contains itself")
        if len(self.active) >= MAX_DEPTH:  # `active` holds exactly the containers above x
            raise UnsupportedInputError(path, f"nested deeper than {MAX_DEPTH} levels of containers")
        self.active.add(id(x))
        try:
            node = yield from self.container(x, cls, path)
        finally:
            self.active.discard(id(x))
        return node

    def forget_in_slices(self) -> Steps[None]:
        """Empty the walk's indexes and lists (copied into the plan), in time slices.

        They hold an entry or two per tensor and storage: dropped with the planner at once,
        50,000 tensors' entries were freed in one go (6-12 ms on the loop, ~2 ms of it only
        the lists' references let go).
        """
        for index in (self.tensor_index, self.storage_index, self.storage_specs, self.memo):
            yield from clear_in_slices(index)
        for items in (
            self.tensors,
            self.sources,
            self.storages,
            self.storage_objs,
            self.keepalive,
            self.streams,
        ):
            yield from drop_in_slices(cast(list[Any], items))

    def _memo(self, x: object) -> int:
        memo = len(self.memo)
        self.memo[id(x)] = memo
        self.keepalive.append(x)  # ids stay unique only while the objects live
        return memo

    def _attrs(self, x: object, path: KeyPath) -> Steps[tuple[tuple[str, Node], ...]]:
        state = getattr(x, "__dict__", None)
        if not state:
            return ()
        out = []
        for k, v in tuple(state.items()):  # a snapshot: the walk yields to the loop
            out.append((k, (yield from self.walk(v, (*path, Attr(k))))))
        return tuple(out)

    def _items(self, pairs: Iterable[tuple[Any, Any]], path: KeyPath) -> Steps[tuple[Node, ...]]:
        out: list[Node] = []
        append = out.append
        for k, v in pairs:
            # Tensors and atoms are the bulk of a state_dict: handle them without a generator.
            if type(v) in _ATOMS:
                append(AtomNode(v))
            elif isinstance(v, torch.Tensor) and id(v) not in self.tensor_index:
                append(self.new_tensor(v, (*path, k)))
            else:
                append((yield from self.walk(v, (*path, k))))
            if slice_over():
                yield
        return tuple(out)

    def container(self, x: Any, cls: type, path: KeyPath) -> Steps[Node]:
        # Every container is read into a snapshot before its items are walked: the walk yields
        # to the loop, and another task may change the container meanwhile.
        if isinstance(x, dict):
            pairs = tuple(x.items())
            # At C speed, by distinct key type: not a Python step a key.
            keys = tuple(map(_first, pairs))
            if any(issubclass(t, torch.Tensor) for t in set(map(type, keys))):
                raise UnsupportedInputError(path, "tensors cannot be dict keys in a state_dict")
            values = yield from self._items(pairs, path)
            attrs = () if cls is dict else (yield from self._attrs(x, path))
            return DictNode(self._memo(x), keys, values, None if cls is dict else x, attrs)
        if isinstance(x, (list, tuple)):
            items = yield from self._items(enumerate(tuple(x)), path)
            attrs = () if cls in (list, tuple) else (yield from self._attrs(x, path))
            memo = self._memo(x)
            if isinstance(x, tuple) and attrs:
                raise UnsupportedInputError(path, f"tuple subclass {cls.__qualname__} carries attributes")
            proto = x if isinstance(x, list) and cls is not list else None
            return SeqNode(memo, cls, items, proto, attrs)
        if isinstance(x, (types.MethodType, types.BuiltinMethodType)):
            return AtomNode(x)
        if cls is io.BytesIO:
            check_bytes_io(x, path)
            return self.bytes_io(x, path)
        for refused, reason in _REFUSED:
            if isinstance(x, refused):
                raise UnsupportedInputError(path, f"{cls.__qualname__} cannot be copied: {reason}")
        if _has_fileno(x):  # file wrappers outside io (tempfile's, mmap, epoll, ...)
            raise UnsupportedInputError(
                path,
                f"{cls.__qualname__} cannot be copied: it wraps an operating-system descriptor (fileno())",
            )
        slots = _slot_names(cls)
        if not (hasattr(x, "__dict__") or slots):
            return self.leaf(x, cls, path)
        how = self.rebuild_of(x, cls, slots)
        if how is _Rebuild.BY_NAME:
            return AtomNode(x)
        if isinstance(how, str):
            raise UnsupportedInputError(path, how)
        slot_values = [(name, getattr(x, name)) for name in slots if hasattr(x, name)]
        fields: list[tuple[str, Node]] = list((yield from self._attrs(x, path)))
        for name, value in slot_values:
            fields.append((name, (yield from self.walk(value, (*path, Attr(name))))))
        self.plain = False
        return ObjectNode(self._memo(x), cls, tuple(fields))

    def rebuild_of(self, x: Any, cls: type, slots: list[str]) -> _Rebuild | str:
        """How an object of ``cls`` is rebuilt, or why it cannot be; decided once per class.

        Python's copy protocol (``__reduce_ex__``) says how the class wants to be rebuilt.
        Accepted are "create without arguments, then restore the state" (the rebuild does
        ``cls.__new__(cls)`` and sets the attributes) and "a global found by name" (kept by
        reference, as ``copy.deepcopy`` does).  A class rebuilt from arguments
        (``functools.partial``) or whose ``__new__`` needs them, and one that keeps state in
        C fields next to its attributes (what ``io.BytesIO`` does), would come back broken:
        the returned message refuses it before any byte is copied.
        """
        known = self.rebuilds.get(cls)
        if known is not None:
            return known
        name = cls.__qualname__
        problem: str | None = None
        try:
            reduced = x.__reduce_ex__(4)
        except Exception as exc:
            problem = f"{name} cannot be copied: {exc}"
        else:
            if isinstance(reduced, str):
                self.rebuilds[cls] = _Rebuild.BY_NAME
                return _Rebuild.BY_NAME
            func, args = (reduced[0], reduced[1]) if isinstance(reduced, tuple) else (None, None)
            if not ((func is _NEWOBJ and args == (cls,)) or (func is cls and args == ())):
                problem = (
                    f"{name} is rebuilt from constructor arguments ({func!r} with {args!r}), "
                    "not from its attributes, so it cannot be staged"
                )
        if problem is None and cls.__basicsize__ > _plain_size(cls, slots):
            problem = f"{name} keeps state outside its attributes (in C fields): a copy would be incomplete"
        if problem is None:
            try:
                cast(Any, cls).__new__(cls)
            except Exception as exc:
                problem = f"{name} cannot be created without arguments, so it cannot be staged ({exc})"
        how = _Rebuild.ATTRIBUTES if problem is None else problem
        self.rebuilds[cls] = how
        return how

    def bytes_io(self, x: io.BytesIO, path: KeyPath) -> Node:
        """The node of an ``io.BytesIO`` (checked by :func:`check_bytes_io`)."""
        node = BytesIONode(self._memo(x), x, path)
        self.streams.append(node)
        self.plain = False
        return node

    def leaf(self, x: Any, cls: type, path: KeyPath) -> Node:
        if self.strict:
            raise UnsupportedInputError(
                path, f"type check: {cls.__qualname__} is not a tensor, container or plain value"
            )
        try:
            copy.deepcopy(x)
        except Exception as exc:
            raise UnsupportedInputError(path, f"{cls.__qualname__} cannot be copied: {exc}") from exc
        self.plain = False
        return CopyNode(x)

    def tensor(self, x: torch.Tensor, path: KeyPath) -> Steps[Node]:
        known = self.tensor_index.get(id(x))
        if known is not None:
            return tensor_node(known)
        node = self.new_tensor(x, path)
        if False:  # pragma: no cover - makes this a generator like every other walk step
            yield
        return node

    def new_tensor(self, x: torch.Tensor, path: KeyPath) -> TensorNode:
        cls = type(x)
        dtensor_spec = None
        if cls is torch.Tensor:
            kind = TensorKind.TENSOR
            local = x
        elif cls is torch.nn.Parameter:
            kind = TensorKind.PARAMETER
            local = x
        elif cls is dtensor_class():
            kind = TensorKind.DTENSOR
            local = x._local_tensor  # type: ignore[attr-defined]
            dtensor_spec = x._spec  # type: ignore[attr-defined]
        else:
            raise UnsupportedInputError(
                path, f"tensor subclass {cls.__qualname__} is not supported (only Tensor, Parameter, DTensor)"
            )
        if local.layout is not torch.strided or local.is_nested or local.is_quantized or local.is_meta:
            self._reject(local, path)
        device = _CPU if local.is_cpu else local.device
        if device.type not in self.allowed_devices:
            raise UnsupportedInputError(
                path,
                f"device {device} is not supported here (expected one of {sorted(self.allowed_devices)})",
            )
        sidx = self.storage_of(local, device)
        attrs = x.__dict__
        attr_node = None
        if attrs:
            attr_node = drive(self.walk(attrs, (*path, Attr("__dict__"))))
            self.plain = False
        index = len(self.tensors)
        self.tensors.append(
            TensorSpec(
                path,
                sidx,
                local.dtype,
                tuple(local.shape),  # a plain tuple: the collector stops tracking it (Size stays)
                local.stride(),
                int(local.storage_offset()),
                kind,
                x.requires_grad,
                local.is_complex() and local.is_conj(),
                local.is_neg(),
                attr_node,
                dtensor_spec,
            )
        )
        self.sources.append(local)
        self.tensor_index[id(x)] = index
        self.keepalive.append(x)
        return tensor_node(index)

    def storage_of(self, local: torch.Tensor, device: torch.device) -> int:
        """The plan's index of ``local``'s storage, planned at its first tensor."""
        storage = local.untyped_storage()
        key = storage._cdata
        sidx = self.storage_index.get(key)
        if sidx is None:
            sidx = len(self.storages)
            self.storage_index[key] = sidx
            nbytes = storage.nbytes()
            # One StorageSpec per (size, device), shared: a plan lives as long as its stager,
            # and every object it holds is rescanned by each full collection.
            spec = self.storage_specs.get((nbytes, device))
            if spec is None:
                spec = self.storage_specs[nbytes, device] = StorageSpec(nbytes, device)
            self.storages.append(spec)
            self.storage_objs.append(storage)
        return sidx

    def _reject(self, t: torch.Tensor, path: KeyPath) -> NoReturn:
        if t.is_meta:
            raise UnsupportedInputError(path, "meta tensors have no data to stage")
        if t.is_nested:
            raise UnsupportedInputError(path, "nested tensors are not supported")
        if t.layout != torch.strided:
            raise UnsupportedInputError(
                path, f"layout {t.layout} is not supported (only dense strided tensors)"
            )
        raise UnsupportedInputError(path, "quantized tensors are not supported")


def check_bytes_io(x: io.BytesIO, path: KeyPath) -> None:
    """Refuse a BytesIO whose bytes and position are not all it holds.

    :raises UnsupportedInputError: it is closed (no bytes left), or carries attributes.
    """
    if x.closed:
        raise UnsupportedInputError(path, "a closed io.BytesIO has no bytes left to stage")
    if vars(x):
        raise UnsupportedInputError(
            path,
            f"an io.BytesIO with attributes ({', '.join(map(repr, vars(x)))}) cannot be staged: "
            "only its bytes and position are",
        )


class _Collector(Planner):
    """A planner that only gathers the tree's tensors (plain or local) and their paths."""

    def __init__(self) -> None:
        super().__init__(strict=False, allowed_devices=frozenset())
        self.paths: list[KeyPath] = []

    def new_tensor(self, x: torch.Tensor, path: KeyPath) -> TensorNode:
        index = len(self.sources)
        is_dtensor = type(x) is not torch.Tensor and type(x) is dtensor_class()
        self.sources.append(x._local_tensor if is_dtensor else x)  # type: ignore[attr-defined]
        self.paths.append(path)
        self.tensor_index[id(x)] = index
        self.keepalive.append(x)
        return tensor_node(index)


def tensor_paths_in_slices(tree: Any) -> Steps[list[tuple[KeyPath, torch.Tensor]]]:
    """Every distinct tensor in ``tree`` (DTensors as their local tensor) with its key
    path, in time slices."""
    collector = _Collector()
    yield from collector.walk(tree, ())
    return list(zip(collector.paths, collector.sources, strict=True))


def supported_devices() -> frozenset[str]:
    """Device types a stager on this machine can copy from: the CPU and the accelerator."""
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return frozenset({"cpu"} | ({accel.type} if accel is not None else set()))


def plan_state_dict(
    state_dict: Any, *, strict: bool = False, allowed_devices: frozenset[str] | None = None
) -> PlannedSource:
    """Walk ``state_dict`` once and return its plan bound to its source tensors
    (:func:`plan_in_slices`, run straight through)."""
    return drive(plan_in_slices(state_dict, strict=strict, allowed_devices=allowed_devices))


def plan_in_slices(
    state_dict: Any, *, strict: bool = False, allowed_devices: frozenset[str] | None = None
) -> Steps[PlannedSource]:
    """Walk ``state_dict`` once, in time slices, and return its plan bound to its sources.

    :param strict: reject leaves that are not tensors, containers, objects or immutable
        values, instead of deep-copying them (the reference's ``type_check``).
    :param allowed_devices: device types tensors may live on; default: CPU and the
        machine's accelerator.
    :raises UnsupportedInputError: a value that cannot be staged faithfully, with its path.
    """
    planner = Planner(strict=strict, allowed_devices=allowed_devices or supported_devices())
    root = yield from planner.walk(state_dict, ())
    plan = StagePlan(root, tuple(planner.tensors), tuple(planner.storages), tuple(planner.streams))
    source = PlannedSource(plan, tuple(planner.sources), tuple(planner.storage_objs), planner.plain)
    yield from planner.forget_in_slices()
    return source
