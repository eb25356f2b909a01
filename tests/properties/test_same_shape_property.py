"""The same-shape match of ``restore(into=...)`` agrees with the general match, on any tree.

Random trees of dicts and lists holding tensors (some tied), plain values and nested
containers are encoded as a checkpoint's header; the caller's tree is a fresh copy of their
shape, perhaps changed in one of many ways.  Whenever the same-shape match
(:func:`~astage._checkpointer.same_shape.same_shape_in_slices`) accepts a tree, the general
match (the whole tree planned, matched by key path) fills it the same way: every storage
read whole into the same caller's storage, the same key paths reported for it, the same
caller's objects in the returned tree.  A tree of the file's shape is always accepted.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from astage._checkpointer.destination import FillPlan, Mode, match_in_slices
from astage._checkpointer.same_shape import DirectFill, same_shape_in_slices
from astage._format.codec import encode, parse_prefix
from astage._staging.plan import StagePlan, plan_in_slices, supported_devices
from astage._util.errors import UnsupportedInputError
from astage._util.timeslice import drive

DTYPES = (torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool, torch.complex64)
SHAPES = ((), (0,), (1,), (3,), (2, 3), (3, 1, 2))


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from(SHAPES))
    t = torch.zeros(shape, dtype=dtype)
    return torch.nn.Parameter(t) if dtype.is_floating_point and draw(st.booleans()) else t


leaves = st.one_of(
    tensors(),
    tensors(),
    tensors(),
    st.integers(-5, 5),
    st.text(max_size=3),
    st.none(),
    st.floats(allow_nan=False),
)
keys = st.text(alphabet="abcxyz", min_size=1, max_size=2)
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(st.dictionaries(keys, inner, max_size=4), st.lists(inner, max_size=4)),
    max_leaves=14,
)


def tie_some(tree: Any, every: int) -> Any:
    """``tree`` with every ``every``-th tensor replaced by the one before it (tied weights)."""
    seen: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            seen.append(x)
            return seen[-2] if every and len(seen) % every == 0 and len(seen) > 1 else x
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(tree)


def fresh_like(tree: Any) -> Any:
    """New tensors of ``tree``'s shape (ties kept as ties), the same plain values."""
    made: dict[int, Any] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in made:
                t = torch.zeros(x.shape, dtype=x.dtype)
                made[id(x)] = torch.nn.Parameter(t, x.requires_grad) if type(x) is torch.nn.Parameter else t
            return made[id(x)]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(tree)


def places(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every (key path, value) of ``tree``'s leaves and containers, depth first."""
    out: list[tuple[tuple[Any, ...], Any]] = [(path, tree)]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += places(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += places(v, (*path, i))
    return out


def replace_at(tree: Any, path: tuple[Any, ...], make: Callable[[Any], Any]) -> Any:
    if not path:
        return make(tree)
    tree[path[0]] = replace_at(tree[path[0]], path[1:], make)
    return tree


def _bigger(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.numel() + 2, dtype=t.dtype)[1 : 1 + t.numel()].view(t.shape)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(tuple(reversed(t.shape)), dtype=t.dtype).t() if t.dim() == 2 else t


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _not_tensor(x: Any) -> bool:
    return not isinstance(x, torch.Tensor)


def _is_dict(x: Any) -> bool:
    return isinstance(x, dict)


def _is_list(x: Any) -> bool:
    return isinstance(x, list)


def _anything(_: Any) -> bool:
    return True


def _fresh_key(x: dict[Any, Any]) -> str:
    """A key ``x`` does not have (an extra key must not replace one of its values)."""
    key = "zz"
    while key in x:
        key += "z"
    return key


CHANGES: dict[str, tuple[Callable[[Any], bool], Callable[[Any], Any]]] = {
    "none": (_anything, lambda x: x),
    "view of a bigger storage": (_is_tensor, _bigger),
    "transposed": (lambda x: _is_tensor(x) and x.dim() == 2, _transposed),
    "other dtype": (_is_tensor, lambda x: torch.zeros(x.shape, dtype=torch.float64)),
    "other shape": (_is_tensor, lambda x: torch.zeros(x.numel() + 1, dtype=x.dtype)),
    "a tensor for a value": (_not_tensor, lambda _: torch.zeros(1)),
    "a value for anything": (_anything, lambda _: 7),
    "an extra key": (_is_dict, lambda x: {**x, _fresh_key(x): torch.zeros(1)}),
    "an extra value": (_is_dict, lambda x: {**x, _fresh_key(x): 1}),
    "a key less": (lambda x: _is_dict(x) and bool(x), lambda x: dict(list(x.items())[1:])),
    "keys reversed": (lambda x: _is_dict(x) and len(x) > 1, lambda x: dict(reversed(x.items()))),
    "a list shorter": (lambda x: _is_list(x) and bool(x), lambda x: x[:-1]),
    "a tuple for a list": (_is_list, tuple),
    "a copy": (_anything, lambda x: x.clone() if _is_tensor(x) else copy.deepcopy(x)),
    "a conjugate": (lambda x: _is_tensor(x) and x.is_complex(), lambda x: x.conj()),
    "an expanded view": (
        lambda x: _is_tensor(x) and x.dim() >= 1 and x.numel() > 1,
        lambda x: torch.zeros((1, *x.shape[1:]), dtype=x.dtype).expand(x.shape),
    ),
    "requires_grad flipped": (
        lambda x: isinstance(x, torch.nn.Parameter),
        lambda x: torch.nn.Parameter(x.detach(), not x.requires_grad),
    ),
    "a plain tensor for a Parameter": (lambda x: isinstance(x, torch.nn.Parameter), lambda x: x.detach()),
    "on the meta device": (_is_tensor, lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")),
}
"""How the caller's tree may differ from the file's: where it applies, and what it makes there."""


def tie_to_another(dest: Any, where: int) -> Any:
    """``dest`` with one tensor replaced by another of its tensors (of any shape)."""
    found = [(p, t) for p, t in places(dest) if _is_tensor(t)]
    if len(found) < 2:
        return dest
    (path, _), (_, other) = found[where % len(found)], found[(where + 1) % len(found)]
    return replace_at(dest, path, lambda _: other)


def share_a_storage(dest: Any, where: int) -> Any:
    """``dest`` with two of its tensors made views of one flat buffer."""
    found = [(p, t) for p, t in places(dest) if _is_tensor(t) and type(t) is torch.Tensor]
    pair = [(p, t) for p, t in found if t.dtype == found[where % len(found)][1].dtype][:2] if found else []
    if len(pair) < 2:
        return dest
    (first, a), (second, b) = pair
    flat = torch.zeros(a.numel() + b.numel(), dtype=a.dtype)
    dest = replace_at(dest, first, lambda _: flat[: a.numel()].view(a.shape))
    return replace_at(dest, second, lambda _: flat[a.numel() :].view(b.shape))


def changed(dest: Any, change: str, where: int) -> Any:
    if change == "tied to another":
        return tie_to_another(dest, where)
    if change == "a storage shared":
        return share_a_storage(dest, where)
    applies, make = CHANGES[change]
    spots = [path for path, value in places(dest) if applies(value)]
    return replace_at(dest, spots[where % len(spots)], make) if spots else dest


AT_A_GLANCE = {"none", "an extra value"}
"""Changes that leave the tree of the file's shape (the general match ignores a key of values)."""
AT_A_GLANCE_UNTIED = {"requires_grad flipped", "a plain tensor for a Parameter"}
"""Changes that leave it so where no tensor is tied (they put a new object at one place)."""


def general(plan: StagePlan, dest: Any) -> FillPlan | UnsupportedInputError:
    try:
        source = drive(plan_in_slices(dest, allowed_devices=supported_devices()))
        return drive(match_in_slices(plan, source, dest))
    except UnsupportedInputError as exc:
        return exc


def assert_same_fill(fast: DirectFill, slow: FillPlan, plan: StagePlan) -> None:
    assert len(slow.storages) == len(plan.storages)
    for s in range(len(plan.storages)):
        mine, theirs = fast.storage(s), slow.storage(s)
        assert mine.whole is not None
        if plan.storages[s].nbytes == 0:  # nothing to write: the general match bounces it
            assert [local for _, local in theirs.pairs] == [local for _, local in mine.pairs]
        else:
            assert theirs.mode is Mode.DIRECT, (s, theirs.mode)
            assert theirs.whole is not None
            assert (mine.whole.data_ptr(), mine.whole.nbytes()) == (
                theirs.whole.data_ptr(),
                theirs.whole.nbytes(),
            )
        assert sorted(map(repr, fast.paths_of(s))) == sorted(map(repr, slow.paths_of(s)))
    assert list(fast.tensor_paths()) == list(slow.tensor_paths())
    for position in range(len(plan.tensors)):
        assert fast.original(position) is slow.original(position), position


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tree=st.dictionaries(keys, trees, min_size=1, max_size=4),
    every=st.sampled_from([0, 0, 2, 3]),
    change=st.sampled_from([*sorted(CHANGES), "tied to another", "a storage shared"]),
    where=st.integers(0, 1000),
)
def test_the_same_shape_match_fills_as_the_general_match_whenever_it_accepts(
    tree: dict[str, Any], every: int, change: str, where: int
) -> None:
    source = tie_some(tree, every)
    header = parse_prefix(encode(source, owner_rank=0, step=1, checkpoint_id="property").prefix)
    dest = changed(fresh_like(source), change, where)
    fast = drive(same_shape_in_slices(header.plan, dest))
    slow = general(header.plan, dest)
    event(f"{change}: {'at a glance' if isinstance(fast, DirectFill) else 'by key path'}")
    if change in AT_A_GLANCE or (change in AT_A_GLANCE_UNTIED and not every):
        assert isinstance(fast, DirectFill), fast  # a tree of the file's shape: at a glance
    if isinstance(fast, DirectFill):
        assert isinstance(slow, FillPlan), slow
        assert_same_fill(fast, slow, header.plan)
