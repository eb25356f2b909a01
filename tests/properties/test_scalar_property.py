"""Scalars that change between saves, at random: every fast path reads as its full path.

The stager puts changed scalars into its staged tree, the Checkpointer's layout cache
replaces their entries in a kept layout's scalar table, and a holder's header cache
rebuilds its kept plan with them (see ``test_fast_path``, ``test_checkpointer_layouts``
and ``test_header_cache`` for the cases by name).  Here hypothesis draws the scalars:
floats of every kind (NaN, -0.0, subnormals, infinities), ints beyond 64 bits, any text,
bytes and complex numbers,
and each fast path must give exactly what the full one gives: the same staged values, the
same header bytes (or the same refusal), the same parsed plan.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import astage
from astage._format.codec import encode, lay_out, parse_prefix
from astage._format.header_cache import HeaderCache
from astage._format.layouts import LayoutCache, PendingLayout
from astage._format.scalars import changed_scalars, same_scalar, scalar_text

ID = "0" * 32

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.complex_numbers(allow_nan=True, allow_infinity=True),
)
four = st.tuples(scalars, scalars, scalars, scalars)


def tree(values: tuple[Any, Any, Any, Any] = (0, 0.5, "a", None)) -> dict[str, Any]:
    """Tensors in runs and dicts, and four scalar slots: in a dict, in a nested dict, in a
    list, and in a module state_dict's ``_metadata``."""
    model = collections.OrderedDict((f"w{i}", torch.full((3,), float(i))) for i in range(6))
    model._metadata = collections.OrderedDict({"": {"version": values[3]}})  # type: ignore[attr-defined]
    return {
        "model": model,
        "optim": {
            "state": {0: {"exp_avg": torch.ones(2)}},
            "param_groups": [{"lr": values[1], "params": [0]}],
        },
        "step": values[0],
        "history": [values[2], 1.0],
    }


def scalars_of(t: dict[str, Any]) -> list[tuple[type, str]]:
    got = [
        t["step"],
        t["optim"]["param_groups"][0]["lr"],
        t["history"][0],
        t["model"]._metadata[""]["version"],
    ]
    return [(type(v), repr(v)) for v in got]


def header_of(layout: Any) -> bytes:
    parts, spaces = dataclasses.replace(layout, created=0.0).header_parts([0] * len(layout.offsets))
    return b"".join(parts) + b" " * spaces


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(four)
def test_a_kept_layout_with_random_scalars_is_the_header_a_full_lay_out_writes(
    values: tuple[Any, ...],
) -> None:
    async def check() -> None:
        staged = tree()
        cache = LayoutCache(rank=0)
        first = await cache.lay_out(staged, step=1, checkpoint_id=ID)
        assert not isinstance(first, PendingLayout)
        await cache.keep(staged, first)
        changed = tree(values)  # type: ignore[arg-type]
        for key in ("model", "optim"):  # the same tensors: only the scalars differ
            changed[key] = _with_scalars(staged[key], changed[key])
        refused: str | None = None
        try:
            full = lay_out(changed, owner_rank=0, step=2, checkpoint_id=ID)
        except astage.UnsupportedInputError as exc:
            refused = str(exc)
        if refused is not None:
            with pytest.raises(astage.UnsupportedInputError) as cached:
                await cache.lay_out(changed, step=2, checkpoint_id=ID)
            assert str(cached.value) == refused
            return
        pending = await cache.lay_out(changed, step=2, checkpoint_id=ID)
        assert isinstance(pending, PendingLayout), "only scalars changed: the kept layout is re-used"
        layout = await pending.complete()
        assert layout is not None
        assert header_of(layout) == header_of(full)

    anyio.run(check)


def _with_scalars(tensors_from: Any, scalars_from: Any) -> Any:
    """``scalars_from`` with the tensors of ``tensors_from`` (same structure)."""
    if isinstance(scalars_from, torch.Tensor):
        return tensors_from
    if isinstance(scalars_from, dict):
        out = type(scalars_from)((k, _with_scalars(tensors_from[k], v)) for k, v in scalars_from.items())
        if hasattr(scalars_from, "_metadata"):
            out._metadata = scalars_from._metadata
        return out
    if isinstance(scalars_from, list):
        return [_with_scalars(a, b) for a, b in zip(tensors_from, scalars_from, strict=True)]
    return scalars_from


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(four)
def test_a_holder_reads_random_scalars_with_its_kept_plan_as_a_full_parse(values: tuple[Any, ...]) -> None:
    base = tree()
    cache = HeaderCache()
    cache.parse(encode(base, owner_rank=1, step=1, checkpoint_id="c").prefix)
    changed = _with_scalars(base, tree(values))  # type: ignore[arg-type]
    try:
        data = encode(changed, owner_rank=1, step=2, checkpoint_id="c").prefix
    except astage.UnsupportedInputError:
        return  # not a value a file holds (an int over the header's cap): nothing to read
    header, full = cache.parse(data), parse_prefix(data)
    assert cache.reused == 1
    # The plans by repr: NaN never equals itself, and -0.0 equals 0.0.
    assert repr(header.plan) == repr(full.plan)
    assert dataclasses.replace(header, plan=full.plan) == full


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(four, min_size=1, max_size=4))
def test_a_stager_stages_random_scalars_into_the_copy_it_refills(rounds: list[tuple[Any, ...]]) -> None:
    async def check() -> None:
        sd = tree()
        async with astage.DefaultStager() as stager:
            staged = await stager.stage(sd)
            for values in rounds:
                await stager.release(staged)
                changed = _with_scalars(sd, tree(values))  # type: ignore[arg-type]
                again, stats = await stager.stage_with_stats(changed)
                assert again is staged
                assert not stats.planned
                assert scalars_of(again) == scalars_of(changed)

    anyio.run(check)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(scalars, scalars, st.booleans()), max_size=30))
def test_the_changed_scalars_are_found_as_one_by_one(pairs: list[tuple[Any, Any, bool]]) -> None:
    # changed_scalars compares whole tables at C speed first: 1, 1.0 and True, 0.0 and
    # -0.0, NaN and NaN must still be told apart (or not) exactly as entry by entry.
    old = [a for a, _, _ in pairs]
    new = [a if same else b for a, b, same in pairs]
    want = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if not same_scalar(a, b)]
    assert changed_scalars(old, new) == want
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        assert same_scalar(a, b) == (scalar_text(a) == scalar_text(b)), (i, a, b)
