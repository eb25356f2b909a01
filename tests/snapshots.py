"""A bit-exact oracle for staged copies: a snapshot of a state_dict taken when it is staged.

:func:`take` records the tree's structure (each tensor replaced by its position), every
tensor's metadata, which tensors are one object and which share a storage, and a byte copy
(``torch.clone``) of every storage.  :func:`assert_matches` then checks a staged copy against
it, whatever happened to the source since: the copy must hold exactly those bytes.

Across processes (a replica held by a peer rank), :func:`digest` reduces a snapshot to plain
picklable data (a sha256 of every storage instead of its bytes) for
``dist.all_gather_object``, and :func:`assert_matches_digest` checks a tree against it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from typing import Any

import torch

from tests.statedicts import tensors_of


@dataclasses.dataclass(frozen=True)
class Leaf:
    """Where a tensor sat in the tree: its position in walk order (:func:`tests.statedicts.tensors_of`)."""

    index: int


@dataclasses.dataclass(frozen=True)
class Snapshot:
    skeleton: Any
    metas: list[tuple[Any, ...]]
    storages: list[torch.Tensor]
    same_object: list[list[bool]]
    same_storage: list[list[bool]]


def meta(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        type(t),
        t.dtype,
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        t.requires_grad,
        t.is_conj(),
        t.is_neg(),
    )


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A byte copy of the whole storage ``t`` views (inference tensors too)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def skeleton(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by its :class:`Leaf` (``copy.deepcopy``'s memo)."""
    memo: dict[int, Any] = {}
    for i, t in enumerate(tensors):
        memo.setdefault(id(t), Leaf(i))
    return copy.deepcopy(tree, memo)


def take(tree: Any) -> Snapshot:
    """The snapshot of ``tree`` as it is now."""
    tensors = tensors_of(tree)
    return Snapshot(
        skeleton(tree, tensors),
        [meta(t) for t in tensors],
        [storage_bytes(t) for t in tensors],
        [[a is b for b in tensors] for a in tensors],
        [[a.untyped_storage()._cdata == b.untyped_storage()._cdata for b in tensors] for a in tensors],
    )


def same_skeleton(a: Any, b: Any, path: str) -> None:
    assert type(a) is type(b), f"{path}: {type(a).__qualname__} != {type(b).__qualname__}"
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same_skeleton(a[k], b[k], f"{path}[{k!r}]")
        assert getattr(a, "__dict__", {}) == getattr(b, "__dict__", {}), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_skeleton(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert repr(a) == repr(b), path  # bit for bit: -0.0 is not 0.0
    else:
        assert a == b, path


def assert_matches(staged: Any, snap: Snapshot, where: str = "") -> None:
    """``staged`` holds exactly what ``snap`` recorded: structure, values, metadata, which
    tensors are one object or share a storage, and every storage byte for byte."""
    tensors = tensors_of(staged)
    assert len(tensors) == len(snap.metas), where
    same_skeleton(skeleton(staged, tensors), snap.skeleton, f"{where} sd")
    for i, t in enumerate(tensors):
        assert t.device.type == "cpu", where
        assert meta(t) == snap.metas[i], f"{where} tensor {i}: {meta(t)} != {snap.metas[i]}"
        assert torch.equal(storage_bytes(t), snap.storages[i]), f"{where} tensor {i}: stale or wrong bytes"
    assert [[a is b for b in tensors] for a in tensors] == snap.same_object, where
    shared = [[a.untyped_storage()._cdata == b.untyped_storage()._cdata for b in tensors] for a in tensors]
    assert shared == snap.same_storage, where


@dataclasses.dataclass(frozen=True)
class Digest:
    """A :class:`Snapshot` as plain data: no tensor, no torch type (only their names)."""

    skeleton: Any
    metas: list[tuple[Any, ...]]
    sha256: list[str]
    same_object: list[list[bool]]
    same_storage: list[list[bool]]


def plain_meta(m: tuple[Any, ...]) -> tuple[Any, ...]:
    """A :func:`meta` tuple with the tensor's type and dtype as names."""
    kind, dtype, *rest = m
    return (f"{kind.__module__}.{kind.__qualname__}", str(dtype), *rest)


def digest(snap: Snapshot) -> Digest:
    """``snap`` as plain data, to send to another process."""
    return Digest(
        snap.skeleton,
        [plain_meta(m) for m in snap.metas],
        [hashlib.sha256(s.numpy().tobytes()).hexdigest() for s in snap.storages],
        snap.same_object,
        snap.same_storage,
    )


def assert_matches_digest(tree: Any, want: Digest, where: str = "") -> None:
    """``tree`` holds exactly what the snapshot ``want`` was made of (as :func:`assert_matches`)."""
    got = digest(take(tree))
    assert len(got.metas) == len(want.metas), f"{where}: {len(got.metas)} tensors != {len(want.metas)}"
    same_skeleton(got.skeleton, want.skeleton, f"{where} sd")
    for i, (m, n) in enumerate(zip(got.metas, want.metas, strict=True)):
        assert m == n, f"{where} tensor {i}: {m} != {n}"
    for i, (h, k) in enumerate(zip(got.sha256, want.sha256, strict=True)):
        assert h == k, f"{where} tensor {i}: stale or wrong bytes"
    assert got.same_object == want.same_object, f"{where}: other tensors are one object"
    assert got.same_storage == want.same_storage, f"{where}: other tensors share a storage"
