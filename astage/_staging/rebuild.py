"""Rebuild a planned tree over staged storages: the inverse of the plan's walk.

:func:`rebuild_in_slices` turns a :class:`~astage._staging.plan.StagePlan` back into the user's tree,
with each planned tensor viewing its staged storage exactly as its source viewed the
source storage (:func:`make_tensor`), wrapped as the Parameter or DTensor it was; the
same object met twice in the source comes back as one object met twice.

An ``io.BytesIO`` comes back as a new BytesIO with a copy of its bytes: of the source, at
its position (:func:`copy_bytes_io`, which a stage runs in a worker thread beforehand:
:func:`copy_streams`), or of a file's ``bytesio`` entry, at position 0.
"""

from __future__ import annotations

import contextlib
import copy
import io
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
import torch

from .._util.errors import UnsupportedInputError
from .._util.threads import run_sync
from .._util.timeslice import Steps, drive, slice_over, within
from .plan import (
    AtomNode,
    BytesIONode,
    CopyNode,
    DictNode,
    ObjectNode,
    RefNode,
    SeqNode,
    TensorKind,
    TensorNode,
    dtensor_class,
)

if TYPE_CHECKING:
    from .plan import Node, StagePlan, TensorSpec


def make_tensor(spec: TensorSpec, storage: torch.UntypedStorage) -> torch.Tensor:
    """A plain tensor viewing ``storage`` exactly as the source viewed its storage."""
    t = torch.empty(0, dtype=spec.dtype).set_(storage, spec.offset, spec.size, spec.stride)
    if spec.conj:
        t = t.conj()
    if spec.neg:
        t = torch._neg_view(t)
    return t


def filled_bytes_io(src: torch.Tensor) -> io.BytesIO:
    """A new ``io.BytesIO`` (position 0) holding a copy of the 1-D uint8 tensor ``src``.

    The BytesIO owns its buffer (shared with nothing, so reading it costs no copy later),
    and torch copies into it with the GIL released: a large one does not stall the loop
    from a worker thread.
    """
    n = src.numel()
    out = io.BytesIO(bytes(n))  # the zeroed bytes object is the BytesIO's alone
    if n:
        with out.getbuffer() as view:
            dst = torch.frombuffer(view, dtype=torch.uint8)
            dst.copy_(src)
            del dst  # its export of the buffer, before the view is released
    return out


def copy_bytes_io(node: BytesIONode) -> io.BytesIO:
    """A new ``io.BytesIO`` with a copy of ``node.source``'s bytes, at its position.

    :raises UnsupportedInputError: the source was closed after it was planned.
    """
    source = node.source
    try:
        with source.getbuffer() as view:
            src = (
                torch.frombuffer(view, dtype=torch.uint8)
                if view.nbytes
                else torch.empty(0, dtype=torch.uint8)
            )
            out = filled_bytes_io(src)
            del src
        out.seek(source.tell())
    except ValueError as exc:  # closed meanwhile
        raise UnsupportedInputError(node.key_path, f"the io.BytesIO could not be read: {exc}") from exc
    return out


async def copy_streams(
    plan: StagePlan, limiter: anyio.CapacityLimiter | None, *, threaded: bool
) -> list[io.BytesIO]:
    """Copies of every BytesIO of ``plan`` (:attr:`StagePlan.streams`), made in one worker
    thread call (``threaded``), else on this thread."""
    if not plan.streams:
        return []
    if not threaded:
        return list(map(copy_bytes_io, plan.streams))
    return await run_sync(list, map(copy_bytes_io, plan.streams), limiter=limiter)


def rebuild(plan: StagePlan, storages: Sequence[torch.UntypedStorage]) -> Any:
    """Rebuild the planned tree over staged ``storages`` (one per :attr:`StagePlan.storages`)."""
    return drive(
        rebuild_in_slices(plan, lambda i: make_tensor(plan.tensors[i], storages[plan.tensors[i].storage]))
    )


def rebuild_in_slices(plan: StagePlan, local_tensor: Callable[[int], torch.Tensor]) -> Steps[Any]:
    """Rebuild the planned tree in time slices; ``local_tensor(i)`` gives the plain staged
    tensor of ``plan.tensors[i]`` (wrapped here as a Parameter or DTensor as planned)."""
    return (yield from within(plain_tensor_mode, Rebuilder(plan, local_tensor).node(plan.root)))


@contextlib.contextmanager
def plain_tensor_mode() -> Iterator[None]:
    """Create and write staged tensors as plain tensors, whatever mode the caller is in.

    Under ``torch.inference_mode()`` new tensors are inference tensors, which the worker
    threads (outside that mode) may not write: without this, ``stage()`` inside that
    mode would always fail.  Gradients are off too: staging records no autograd history.
    """
    with torch.inference_mode(False), torch.no_grad():
        yield


class Rebuilder:
    # A class rather than nested closures: closures that call each other form a reference
    # cycle, which would keep the staged tensors (and so their buffers) alive until the
    # garbage collector happens to run.
    def __init__(
        self,
        plan: StagePlan,
        local_tensor: Callable[[int], torch.Tensor],
        streams: Sequence[io.BytesIO] | None = None,
    ) -> None:
        """:param streams: the copies of ``plan.streams`` (:func:`copy_streams`); ``None``:
        copied here, as the tree is rebuilt."""
        self.plan = plan
        self.local_tensor = local_tensor
        self.built: dict[int, Any] = {}
        self.tensors: list[torch.Tensor | None] = [None] * len(plan.tensors)
        self.streams = {} if streams is None else dict(zip(map(id, plan.streams), streams, strict=True))

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
            out = cast(Any, dtensor_class())(local, spec.dtensor_spec, requires_grad=spec.requires_grad)
        elif spec.kind is TensorKind.NDARRAY:
            out = cast(Any, local.numpy())  # shares the storage's memory, like every tensor here
        elif spec.kind is TensorKind.BYTESIO:
            out = cast(Any, filled_bytes_io(local))  # a copy: a BytesIO cannot view the storage
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
            if slice_over():
                yield
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
            case BytesIONode(memo):
                copied = self.streams.get(id(n))
                out_b = copied if copied is not None else copy_bytes_io(n)
                self.built[memo] = out_b
                return out_b
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
                    if attrs:  # C subclasses (defaultdict) have no __dict__ to restore
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
                    if attrs:
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
