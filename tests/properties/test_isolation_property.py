"""Property: a staged copy equals the source at staging time, whatever happens after.

Random nested state_dicts mix dtypes, 0-d and empty tensors, non-contiguous and offset
views, and tensors sharing storages; after staging, every source storage is overwritten
and the staged copy must still hold the old bytes, with the same aliasing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astage import DefaultStager, StagingOptions
from tests.statedicts import ALL_DTYPES, bytes_equal, random_tensor, storage_key, tensors_of

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensor_pool(draw: st.DrawFn) -> list[torch.Tensor]:
    """Base tensors plus views of them (so some leaves share storages)."""
    bases = [
        random_tensor(draw(shapes), draw(st.sampled_from(ALL_DTYPES))) for _ in range(draw(st.integers(1, 4)))
    ]
    out = list(bases)
    for _ in range(draw(st.integers(0, 4))):
        base = draw(st.sampled_from(bases))
        kind = draw(st.sampled_from(["slice", "transpose", "flat", "expand0d"]))
        if kind == "slice" and base.dim() and base.shape[0] > 1:
            out.append(base[1:])
        elif kind == "transpose" and base.dim() >= 2:
            out.append(base.transpose(0, 1))
        elif kind == "flat" and base.is_contiguous() and base.numel():
            out.append(base.view(-1)[base.numel() // 2 :])
        elif kind == "expand0d" and base.numel():
            out.append(base.view(-1)[0])
    return out


@st.composite
def state_dicts(draw: st.DrawFn) -> dict[str, Any]:
    tensors = draw(tensor_pool())
    leaf = st.one_of(
        st.sampled_from(tensors),
        st.integers(-5, 5),
        st.text(max_size=3),
        st.none(),
    )
    tree = st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.tuples(children, children),
            st.dictionaries(st.text(min_size=1, max_size=3), children, max_size=3),
        ),
        max_leaves=10,
    )
    return draw(st.dictionaries(st.text(min_size=1, max_size=4), tree, min_size=1, max_size=4))


def aliasing(tensors: list[torch.Tensor]) -> list[list[bool]]:
    keys = [storage_key(t) for t in tensors]
    return [[a == b for b in keys] for a in keys]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sd=state_dicts(), inline=st.booleans())
def test_staged_copy_is_immune_to_source_mutation(sd: dict[str, Any], inline: bool) -> None:
    before = [t.clone() for t in tensors_of(sd)]

    async def stage() -> Any:
        async with DefaultStager(StagingOptions(use_async_staging=not inline)) as stager:
            return await stager.stage(sd)

    staged = asyncio.run(stage())
    for t in tensors_of(sd):  # overwrite every source byte
        torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).bitwise_not_()
    got = tensors_of(staged)
    assert len(got) == len(before)
    for new, old, src in zip(got, before, tensors_of(sd), strict=True):
        assert new.dtype == old.dtype
        assert new.shape == old.shape
        assert new.stride() == src.stride()
        assert new.storage_offset() == src.storage_offset()
        assert new.untyped_storage().nbytes() <= src.untyped_storage().nbytes()
        assert bytes_equal(new, old)
    assert aliasing(got) == aliasing(tensors_of(sd))
