"""Builders and checks for state_dicts used across the tests: one place for all of them."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import torch

ALL_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator | None = None
) -> torch.Tensor:
    """Random contents of any dtype, made by filling bytes (works for fp8 and bool too)."""
    t = torch.empty(shape, dtype=dtype)
    raw = t.view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    if dtype == torch.bool:
        t.copy_(raw.view(torch.bool).view(shape) if t.numel() else t)
        t.view(torch.uint8).bitwise_and_(1)
    return t


class Point(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass(frozen=True)
class Frozen:
    weight: torch.Tensor
    steps: int


class Slotted:
    __slots__ = ("name", "scale")

    def __init__(self, scale: torch.Tensor, name: str) -> None:
        self.scale = scale
        self.name = name


def rich_state_dict() -> dict[str, Any]:
    """Every structure the stager promises to keep, with aliasing between entries."""
    base = torch.randn(8, 6)
    tied = torch.nn.Parameter(torch.randn(5, 3))
    model = collections.OrderedDict(
        weight=base,
        weight_t=base.t(),
        row=base[2],
        window=base[1:4, 2:5],
        tied_a=tied,
        tied_b=tied,
    )
    model._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    tagged = torch.randn(4)
    tagged.tag = "kept"  # type: ignore[attr-defined]
    frozen_param = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    return {
        "model": model,
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(8, 6)}},
            "param_groups": [{"lr": 1e-3, "params": [0], "betas": (0.9, 0.999), "name": None}],
        },
        "point": Point(torch.arange(3), "p"),
        "frozen": Frozen(torch.ones(2, 2), 3),
        "slotted": Slotted(torch.full((2,), 0.5), "s"),
        "tagged": tagged,
        "frozen_param": frozen_param,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "dtypes": {str(d): random_tensor((3, 2), d) for d in ALL_DTYPES},
        "extras": [1, 2.5, "text", None, True, b"bytes", torch.float16, torch.device("cpu")],
    }


def nested_tensors(tensors: int, depth: int) -> Any:
    """``tensors`` one-element tensors in a dict nested ``depth`` dicts deep."""
    tree: Any = {f"t{i}": torch.zeros(1) for i in range(tensors)}
    for _ in range(depth):
        tree = {"x": tree}
    return tree


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """Every tensor in a tree, in walk order (containers, dataclasses, slots, namedtuples).

    A loop over a stack, not a recursive closure: a closure that calls itself is a
    reference cycle, which would keep the returned list (and, through it, a staged copy's
    buffers under a memory cap) alive until the cyclic collector runs.
    """
    out: list[torch.Tensor] = []
    stack: list[Any] = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
            continue
        if isinstance(x, dict):
            children = list(x.values())
        elif isinstance(x, (list, tuple)):
            children = list(x)
        elif dataclasses.is_dataclass(x) or hasattr(x, "__slots__"):
            children = [getattr(x, name) for name in getattr(x, "__slots__", ()) or vars(x)]
        else:
            continue
        stack.extend(reversed(children))  # the first child is walked first
    return out


def assert_same_tree(staged: Any, source: Any, path: str = "sd") -> None:
    """Structure, types, values, tensor metadata and attributes equal; tensors on CPU."""
    assert type(staged) is type(source), f"{path}: {type(staged)} != {type(source)}"
    if isinstance(source, torch.Tensor):
        assert staged.device.type == "cpu", path
        assert staged.dtype == source.dtype, path
        assert staged.shape == source.shape, path
        assert staged.stride() == source.stride(), path
        assert staged.storage_offset() == source.storage_offset(), path
        assert staged.requires_grad == source.requires_grad, path
        assert bytes_equal(staged, source), path
        assert getattr(staged, "__dict__", {}).keys() == getattr(source, "__dict__", {}).keys(), path
        return
    if isinstance(source, dict):
        assert list(staged) == list(source), path
        for k in source:
            assert_same_tree(staged[k], source[k], f"{path}[{k!r}]")
        assert getattr(staged, "__dict__", {}) == getattr(source, "__dict__", {}), path
    elif isinstance(source, (list, tuple)):
        assert len(staged) == len(source), path
        for i, (a, b) in enumerate(zip(staged, source, strict=True)):
            assert_same_tree(a, b, f"{path}[{i}]")
    elif dataclasses.is_dataclass(source) or hasattr(source, "__slots__"):
        for name in getattr(source, "__slots__", ()) or vars(source):
            assert_same_tree(getattr(staged, name), getattr(source, name), f"{path}.{name}")
    else:
        assert staged == source, path


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality of two tensors' visible elements (NaNs and fp8 included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    ac, bc = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return bool(torch.equal(ac.view(-1).view(torch.uint8), bc.view(-1).view(torch.uint8)))


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage."""
    return int(t.untyped_storage()._cdata)


def rank_state(seed: int, rank: int, meta: dict[str, Any], size: int = 1000) -> dict[str, Any]:
    """A rank's distinctive state: aliasing views, a Parameter, several dtypes, ``meta`` leaves."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=gen)
    return {
        "model": {
            "w": base.view(10, size // 10),
            "w_t": base.view(10, size // 10).t(),
            "p": torch.nn.Parameter(torch.randn(7, generator=gen)),
            "ids": torch.arange(rank, rank + 5),
            "half": torch.randn(3, generator=gen).to(torch.bfloat16),
        },
        "meta": meta,
    }


def same_state(got: Any, want: Any) -> bool:
    """Same tree: keys in order, tensors byte-equal with equal strides, equal other leaves."""
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and bytes_equal(got, want) and got.stride() == want.stride()
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and list(got) == list(want)
            and all(same_state(got[k], want[k]) for k in want)
        )
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(same_state(a, b) for a, b in zip(got, want, strict=True))
    return bool(got == want)


def model_state(step: int, nbytes: int = 64 << 10) -> dict[str, Any]:
    """A training-like state whose contents follow from ``step`` alone."""
    g = torch.Generator().manual_seed(step)
    weight = random_tensor((max(nbytes // 4, 4),), torch.float32, g)
    return {
        "model": {"weight": weight, "head": weight[:8], "bias": torch.arange(step, step + 4)},
        "optim": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1}]},
        "step": step,
    }


def state_of(rank: int, step: int, size: int = 1000) -> dict[str, Any]:
    """A rank's distinctive state at a step: aliasing, a Parameter, non-tensor leaves."""
    meta = {"rank": rank, "step": step, "lr": 0.5, "tags": [1, None, True]}
    return rank_state(1000 * step + rank, rank, meta, size)
