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
* Each container is read once, as a snapshot taken before its items are walked: the walk
  yields to the event loop between slices, and a container another task changes meanwhile
  is staged as it was when its walk began, never torn.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import copyreg
import dataclasses
import decimal
import enum
import fractions
import io
import pathlib
import socket
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple, NoReturn, cast

import torch

from ._errors import Attr, KeyPath, UnsupportedInputError
from ._slices import SLICE_SECONDS, Steps, clock, drive, within


def _dtensor_class() -> type | None:
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
    ((io.IOBase,), "an open file or stream holds state outside Python (a descriptor, a position)"),
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


# Specs and leaf nodes are NamedTuples, not frozen dataclasses: a plan holds one per tensor,
# and a NamedTuple is built ~8x faster, which matters for state_dicts of 20,000 tensors.


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


class TensorNode(NamedTuple):
    """A tensor leaf: position in :attr:`StagePlan.tensors`."""

    position: int


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


Node = AtomNode | CopyNode | TensorNode | RefNode | DictNode | SeqNode | ObjectNode


@dataclasses.dataclass(frozen=True, slots=True)
class StagePlan:
    """What to copy (storages) and how to rebuild the tree over the copies (tensors, root)."""

    root: Node
    tensors: tuple[TensorSpec, ...]
    storages: tuple[StorageSpec, ...]

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


def _slot_names(cls: type) -> list[str]:
    names: list[str] = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        names.extend(s for s in slots if s not in ("__dict__", "__weakref__") and s not in names)
    return names


class _Rebuild(enum.Enum):
    """How the rebuild recreates an object (see :meth:`_Planner.rebuild_of`)."""

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


class _Planner:
    def __init__(self, *, strict: bool, allowed_devices: frozenset[str]) -> None:
        self.strict = strict
        self.allowed_devices = allowed_devices
        self.tensors: list[TensorSpec] = []
        self.sources: list[torch.Tensor] = []
        self.storages: list[StorageSpec] = []
        self.storage_objs: list[torch.UntypedStorage] = []
        self.storage_index: dict[int, int] = {}
        self.tensor_index: dict[int, int] = {}
        self.memo: dict[int, int] = {}
        self.active: set[int] = set()
        self.keepalive: list[object] = []
        self.clock = clock
        self.deadline = clock() + SLICE_SECONDS
        self.rebuilds: dict[type, _Rebuild | str] = {}

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
        clock = self.clock
        for k, v in pairs:
            # Tensors and atoms are the bulk of a state_dict: handle them without a generator.
            if type(v) in _ATOMS:
                append(AtomNode(v))
            elif isinstance(v, torch.Tensor) and id(v) not in self.tensor_index:
                append(self.new_tensor(v, (*path, k)))
            else:
                append((yield from self.walk(v, (*path, k))))
            if clock() > self.deadline:
                yield
                self.deadline = clock() + SLICE_SECONDS
        return tuple(out)

    def container(self, x: Any, cls: type, path: KeyPath) -> Steps[Node]:
        # Every container is read into a snapshot before its items are walked: the walk yields
        # to the loop, and another task may change the container meanwhile (issue 9).
        if isinstance(x, dict):
            pairs = tuple(x.items())
            for k, _ in pairs:
                if isinstance(k, torch.Tensor):
                    raise UnsupportedInputError(path, "tensors cannot be dict keys in a state_dict")
            values = yield from self._items(pairs, path)
            attrs = () if cls is dict else (yield from self._attrs(x, path))
            keys = tuple(k for k, _ in pairs)
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

    def leaf(self, x: Any, cls: type, path: KeyPath) -> Node:
        if self.strict:
            raise UnsupportedInputError(
                path, f"type check: {cls.__qualname__} is not a tensor, container or plain value"
            )
        try:
            copy.deepcopy(x)
        except Exception as exc:
            raise UnsupportedInputError(path, f"{cls.__qualname__} cannot be copied: {exc}") from exc
        return CopyNode(x)

    def tensor(self, x: torch.Tensor, path: KeyPath) -> Steps[Node]:
        known = self.tensor_index.get(id(x))
        if known is not None:
            return TensorNode(known)
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
        elif cls is _dtensor_class():
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
        storage = local.untyped_storage()
        key = storage._cdata
        sidx = self.storage_index.get(key)
        if sidx is None:
            sidx = len(self.storages)
            self.storage_index[key] = sidx
            self.storages.append(StorageSpec(storage.nbytes(), device))
            self.storage_objs.append(storage)
        attrs = x.__dict__
        attr_node = drive(self.walk(attrs, (*path, Attr("__dict__")))) if attrs else None
        index = len(self.tensors)
        self.tensors.append(
            TensorSpec(
                path,
                sidx,
                local.dtype,
                local.shape,
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
        return TensorNode(index)

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


class _Collector(_Planner):
    """A planner that only gathers the tree's tensors (plain or local) and their paths."""

    def __init__(self) -> None:
        super().__init__(strict=False, allowed_devices=frozenset())
        self.paths: list[KeyPath] = []

    def new_tensor(self, x: torch.Tensor, path: KeyPath) -> TensorNode:
        index = len(self.sources)
        is_dtensor = type(x) is not torch.Tensor and type(x) is _dtensor_class()
        self.sources.append(x._local_tensor if is_dtensor else x)  # type: ignore[attr-defined]
        self.paths.append(path)
        self.tensor_index[id(x)] = index
        self.keepalive.append(x)
        return TensorNode(index)


def iter_tensor_paths(tree: Any) -> Steps[list[tuple[KeyPath, torch.Tensor]]]:
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
    """Walk ``state_dict`` once and return its plan bound to its source tensors (see :func:`iter_plan`)."""
    return drive(iter_plan(state_dict, strict=strict, allowed_devices=allowed_devices))


def iter_plan(
    state_dict: Any, *, strict: bool = False, allowed_devices: frozenset[str] | None = None
) -> Steps[PlannedSource]:
    """Walk ``state_dict`` once, in time slices, and return its plan bound to its sources.

    :param strict: reject leaves that are not tensors, containers, objects or immutable
        values, instead of deep-copying them (the reference's ``type_check``).
    :param allowed_devices: device types tensors may live on; default: CPU and the
        machine's accelerator.
    :raises UnsupportedInputError: a value that cannot be staged faithfully, with its path.
    """
    planner = _Planner(strict=strict, allowed_devices=allowed_devices or supported_devices())
    root = yield from planner.walk(state_dict, ())
    plan = StagePlan(root, tuple(planner.tensors), tuple(planner.storages))
    return PlannedSource(plan, tuple(planner.sources), tuple(planner.storage_objs))


# -- rebuild ------------------------------------------------------------------------------


def make_tensor(spec: TensorSpec, storage: torch.UntypedStorage) -> torch.Tensor:
    """A plain tensor viewing ``storage`` exactly as the source viewed its storage."""
    t = torch.empty(0, dtype=spec.dtype).set_(storage, spec.offset, spec.size, spec.stride)
    if spec.conj:
        t = t.conj()
    if spec.neg:
        t = torch._neg_view(t)
    return t


def rebuild(plan: StagePlan, storages: Sequence[torch.UntypedStorage]) -> Any:
    """Rebuild the planned tree over staged ``storages`` (one per :attr:`StagePlan.storages`)."""
    return drive(
        iter_rebuild(plan, lambda i: make_tensor(plan.tensors[i], storages[plan.tensors[i].storage]))
    )


def iter_rebuild(plan: StagePlan, local_tensor: Callable[[int], torch.Tensor]) -> Steps[Any]:
    """Rebuild the planned tree in time slices; ``local_tensor(i)`` gives the plain staged
    tensor of ``plan.tensors[i]`` (wrapped here as a Parameter or DTensor as planned)."""
    return (yield from within(plain_tensor_mode, Rebuilder(plan, local_tensor).node(plan.root)))


@contextlib.contextmanager
def plain_tensor_mode() -> Iterator[None]:
    """Create and write staged tensors as plain tensors, whatever mode the caller is in.

    Under ``torch.inference_mode()`` new tensors are inference tensors, which the worker
    threads (outside that mode) may not write: ``stage()`` inside it always failed
    (issue 9).  Gradients are off too: staging records no autograd history.
    """
    with torch.inference_mode(False), torch.no_grad():
        yield


class Rebuilder:
    # A class rather than nested closures: closures that call each other form a reference
    # cycle, which would keep the staged tensors (and so their buffers) alive until the
    # garbage collector happens to run.
    def __init__(self, plan: StagePlan, local_tensor: Callable[[int], torch.Tensor]) -> None:
        self.plan = plan
        self.local_tensor = local_tensor
        self.built: dict[int, Any] = {}
        self.tensors: list[torch.Tensor | None] = [None] * len(plan.tensors)
        self.deadline = clock() + SLICE_SECONDS

    def tensor(self, index: int) -> torch.Tensor:
        done = self.tensors[index]
        if done is not None:
            return done
        spec = self.plan.tensors[index]
        local = self.local_tensor(index)
        out: torch.Tensor
        if spec.kind is TensorKind.PARAMETER:
            out = torch.nn.Parameter(local, requires_grad=spec.requires_grad)
        elif spec.kind is TensorKind.DTENSOR:
            out = cast(Any, _dtensor_class())(local, spec.dtensor_spec, requires_grad=spec.requires_grad)
        elif spec.kind is TensorKind.NDARRAY:
            out = cast(Any, local.numpy())  # shares the storage's memory, like every tensor here
        else:
            out = local.requires_grad_(spec.requires_grad) if spec.requires_grad else local
        if spec.attrs is not None:
            vars(out).update(drive(self.node(spec.attrs)))
        self.tensors[index] = out
        return out

    def many(self, nodes: Iterable[Node]) -> Steps[list[Any]]:
        out: list[Any] = []
        append = out.append
        for n in nodes:
            if type(n) is TensorNode:
                append(self.tensor(n.position))
            elif type(n) is AtomNode:
                append(n.value)
            else:
                append((yield from self.node(n)))
            if clock() > self.deadline:
                yield
                self.deadline = clock() + SLICE_SECONDS
        return out

    def pairs(self, attrs: tuple[tuple[str, Node], ...]) -> Steps[list[tuple[str, Any]]]:
        values = yield from self.many(v for _, v in attrs)
        return [(k, v) for (k, _), v in zip(attrs, values, strict=True)]

    def node(self, n: Node) -> Steps[Any]:
        match n:
            case TensorNode(index):
                return self.tensor(index)
            case AtomNode(value):
                return value
            case CopyNode(value):
                return copy.deepcopy(value)
            case RefNode(memo):
                return self.built[memo]
            case DictNode(memo, keys, values, proto, attrs):
                built_values = yield from self.many(values)
                if proto is None:
                    out_d: dict[Any, Any] = dict(zip(keys, built_values, strict=True))
                else:
                    out_d = copy.copy(proto)
                    out_d.clear()
                    for k, v in zip(keys, built_values, strict=True):
                        out_d[k] = v
                    vars(out_d).update((yield from self.pairs(attrs)))
                self.built[memo] = out_d
                return out_d
            case SeqNode(memo, cls, items, proto, attrs):
                values_l = yield from self.many(items)
                out_s: Any
                if cls is list:
                    out_s = values_l
                elif cls is tuple:
                    out_s = tuple(values_l)
                elif proto is not None:
                    out_s = copy.copy(proto)
                    out_s.clear()
                    out_s.extend(values_l)
                    vars(out_s).update((yield from self.pairs(attrs)))
                elif hasattr(cls, "_make"):
                    out_s = cls._make(values_l)
                else:
                    out_s = cls(values_l)
                self.built[memo] = out_s
                return out_s
            case ObjectNode(memo, cls, fields):
                obj = cast(Any, cls).__new__(cls)
                self.built[memo] = obj
                for name, value in (yield from self.pairs(fields)):
                    object.__setattr__(obj, name, value)
                return obj
        raise AssertionError(f"unknown plan node {n!r}")  # pragma: no cover


# -- re-using a plan ----------------------------------------------------------------------
#
# Planning 20,000 tensors costs more than copying them.  A later stage of a state_dict with
# the same structure re-uses the plan after checking, per tensor, everything the plan was
# derived from.  Object identity is never trusted: ``model.state_dict()`` returns new
# tensor objects (and new dicts) every call.


def tensor_signature(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything a plan records about one tensor, as one tuple compared in C.

    The storage is named by its ``StorageImpl`` (``_cdata``, what the planner groups
    storages by) with its byte size, so a tensor moved to another storage (``set_``,
    ``.data =``), a storage resized, or two tensors that start or stop sharing one, all
    change some tensor's signature.  Layouts the plan refuses need no field of their own:
    sparse, mkldnn and compressed tensors have no storage and nested ones no strides, so
    reading the signature of one raises (and the re-check fails).  About 1 us a tensor:
    every field read costs, so nothing is read twice.
    """
    st = t.untyped_storage()
    return (*_meta_signature(t), st._cdata, st.nbytes())


_META = slice(0, 8)
"""The part of a :func:`tensor_signature` that is not about which storage the tensor views."""


def _meta_signature(t: torch.Tensor) -> tuple[Any, ...]:
    """``tensor_signature(t)[_META]``, without asking for the storage."""
    return (
        type(t),
        t.dtype,
        t.shape,
        t.stride(),
        t.storage_offset(),
        t.requires_grad,
        t.is_conj(),
        t.is_neg(),
    )


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


_KEY_ATOMS = frozenset({str, int, bool, bytes, type(None)})


def _eligible(node: Node, key_types: dict[int, tuple[type, ...]], runs: dict[int, int]) -> Steps[bool]:
    """Whether a re-check can prove ``node``'s subtree unchanged: plain dicts, lists,
    tuples, immutable atoms and plain tensors or Parameters only (anything else is planned
    anew at every stage, as before)."""
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
            children: tuple[Node, ...] = values + tuple(n for _, n in attrs)
        case SeqNode(_, cls, items, None, ()) if cls is list or cls is tuple:
            children = items
        case _:
            return False
    for child in children:
        if (
            type(child) is not AtomNode
            and type(child) is not TensorNode
            and not (yield from _eligible(child, key_types, runs))
        ):
            return False
    items_ = node.values if type(node) is DictNode else node.items  # type: ignore[union-attr]
    if items_ and all(type(c) is TensorNode for c in items_):
        first = items_[0].position  # type: ignore[union-attr]
        if all(c.position == first + i for i, c in enumerate(items_)):
            runs[id(items_)] = first
    return True


def iter_fast_plan(source: PlannedSource) -> Steps[FastPlan | None]:
    """The checkable form of ``source``'s plan, or ``None`` where it cannot be re-checked."""
    plan = source.plan
    for spec in plan.tensors:
        if spec.kind is TensorKind.DTENSOR or spec.attrs is not None:
            return None
    key_types: dict[int, tuple[type, ...]] = {}
    runs: dict[int, int] = {}
    if not (yield from _eligible(plan.root, key_types, runs)):
        return None
    # The signatures are what tensor_signature() would read from the sources, built from
    # what the plan recorded of them: no tensor is asked again.
    cdata = [st._cdata for st in source.storages]
    storages = plan.storages
    cls = {TensorKind.TENSOR: torch.Tensor, TensorKind.PARAMETER: torch.nn.Parameter}
    signatures = []
    deadline = clock() + SLICE_SECONDS
    for spec in plan.tensors:
        s = spec.storage
        signatures.append(
            (
                cls[spec.kind],
                spec.dtype,
                spec.size,
                spec.stride,
                spec.offset,
                spec.requires_grad,
                spec.conj,
                spec.neg,
                cdata[s],
                storages[s].nbytes,
            )
        )
        if clock() > deadline:
            yield
            deadline = clock() + SLICE_SECONDS
    return FastPlan(plan, tuple(signatures), key_types, plan.nbytes, runs)


_RUN_CHUNK = 256
"""Tensors checked between two looks at the clock in :meth:`_Matcher.run`."""


class _Matcher:
    """Walks a state_dict alongside a plan, collecting its tensors in plan order."""

    def __init__(self, fast: FastPlan, meta_only: bool) -> None:
        self.meta_only = meta_only
        self.signatures = fast.signatures
        self.key_types = fast.key_types
        self.runs = fast.runs
        self.sources: list[torch.Tensor] = []
        self.containers: set[int] = set()
        self.keepalive: list[object] = []  # ids stay unique only while the objects live
        self.deadline = clock() + SLICE_SECONDS

    def container(self, node: Node, x: Any) -> Steps[bool]:
        if id(x) in self.containers:  # met twice: the planner would make a RefNode (or refuse a cycle)
            return False
        self.containers.add(id(x))
        self.keepalive.append(x)
        if type(node) is DictNode:
            proto = node.prototype
            if type(x) is not (dict if proto is None else type(proto)):
                return False
            # One snapshot of keys and values, taken before the walk yields (issue 9).
            keys, values = tuple(x), tuple(x.values())
            if len(keys) != len(values) or keys != node.keys:
                return False
            if tuple(map(type, keys)) != self.key_types[node.memo]:
                return False
            state = getattr(x, "__dict__", None) or {}
            names, attr_values = tuple(state), tuple(state.values())
            if names != tuple(name for name, _ in node.attrs):
                return False
            # The planner walks the items first, then the attributes: tensors keep their order.
            if not (yield from self.many(node.values, values)):
                return False
            return (yield from self.many(tuple(n for _, n in node.attrs), attr_values))
        if type(node) is SeqNode:
            if type(x) is not node.cls:
                return False
            items: tuple[Any, ...] = tuple(cast(Any, x))
            if len(items) != len(node.items):
                return False
            return (yield from self.many(node.items, items))
        return False  # pragma: no cover - an eligible plan holds no other node

    def run(self, first: int, values: tuple[Any, ...]) -> Steps[bool]:
        """Check a container's items that are all new tensors: the common case, kept to the
        cost of reading each signature (~1 us a tensor)."""
        signatures, sources = self.signatures, self.sources
        for start in range(0, len(values), _RUN_CHUNK):
            chunk = values[start : start + _RUN_CHUNK]
            expected = signatures[first + start : first + start + len(chunk)]
            if len(chunk) != len(expected):
                return False
            if self.meta_only:
                for v, sig in zip(chunk, expected, strict=True):
                    if (
                        type(v),
                        v.dtype,
                        v.shape,
                        v.stride(),
                        v.storage_offset(),
                        v.requires_grad,
                        v.is_conj(),
                        v.is_neg(),
                    ) != sig[_META] or v.__dict__:
                        return False
            else:
                for v, sig in zip(chunk, expected, strict=True):
                    st = v.untyped_storage()  # not a tensor: AttributeError, caught by many()
                    if (
                        type(v),
                        v.dtype,
                        v.shape,
                        v.stride(),
                        v.storage_offset(),
                        v.requires_grad,
                        v.is_conj(),
                        v.is_neg(),
                        st._cdata,
                        st.nbytes(),
                    ) != sig or v.__dict__:
                        return False
            sources.extend(chunk)
            if clock() > self.deadline:
                yield
                self.deadline = clock() + SLICE_SECONDS
        return True

    def many(self, nodes: tuple[Node, ...], values: tuple[Any, ...]) -> Steps[bool]:
        signatures, sources, append = self.signatures, self.sources, self.sources.append
        first = self.runs.get(id(nodes))
        if first is not None and first == len(sources) and len(values) == len(nodes):
            try:
                return (yield from self.run(first, values))
            except Exception:  # a value the plan never saw
                return False
        Tensor = torch.Tensor
        try:
            for node, v in zip(nodes, values, strict=True):
                cls = type(node)
                if cls is TensorNode:
                    p = node.position  # type: ignore[union-attr]
                    n = len(sources)
                    if p == n:
                        if not isinstance(v, Tensor) or v.__dict__:
                            return False
                        if self.meta_only:
                            if _meta_signature(v) != signatures[p][_META]:
                                return False
                        elif tensor_signature(v) != signatures[p]:
                            return False
                        append(v)
                    elif p > n or v is not sources[p]:  # the plan met this very tensor before
                        return False
                elif cls is AtomNode:
                    if not _same_atom(node.value, v):  # type: ignore[union-attr]
                        return False
                elif not (yield from self.container(node, v)):
                    return False
                if clock() > self.deadline:
                    yield
                    self.deadline = clock() + SLICE_SECONDS
        except Exception:  # a value the plan never saw (a sparse tensor has no storage, ...)
            return False
        return True


def iter_match(
    fast: FastPlan, state_dict: Any, *, meta_only: bool = False
) -> Steps[list[torch.Tensor] | None]:
    """``state_dict``'s source tensors in plan order if ``fast.plan`` is its plan, else ``None``.

    Checks everything the plan was derived from: container types, keys (in order, with
    their types), lengths and non-tensor values; each tensor's :func:`tensor_signature`
    (storage, dtype, shape, stride, offset, type, ``requires_grad``, conj/neg bits); that no
    tensor carries attributes; and that the same tensor object, and only it, appears
    wherever the plan met one tensor twice.  The cyclic collector stays paused while it
    runs (see :mod:`astage._slices`) and it keeps no per-tensor objects.

    :param meta_only: check every tensor but not which storage it views (for a staged
        copy, whose storages are the caller's to check).
    """
    matcher = _Matcher(fast, meta_only)
    ok = yield from matcher.many((fast.plan.root,), (state_dict,))
    sources = matcher.sources
    if not ok or len(sources) != len(fast.signatures):
        return None
    # A tensor object met at two positions the plan holds apart would be one in a new plan.
    if len(set(map(id, sources))) != len(sources):
        return None
    return sources
