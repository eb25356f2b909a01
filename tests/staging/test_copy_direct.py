"""Middling host storages are copied with one ``memmove`` each (``astage._staging.copies.DirectBatch``).

``copy_`` of a tensor of torch's intra-op grain or more forks an OpenMP team, which from a
worker thread costs more than the copy (``DIRECT_MIN_NUMEL``).  The direct path must copy
exactly what ``copy_`` would, bit for bit, and a source changed after the stage checked it
must get what ``copy_`` gives it (a conversion, a size error), never a silent wrong copy or
a read past the end of its storage.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from astage import DefaultStager, StagingOptions, UnsupportedInputError
from astage._staging.copies import (
    DIRECT_MAX_BYTES,
    DIRECT_MIN_NUMEL,
    DirectBatch,
    copy_layout_in_slices,
    run_batch,
)
from astage._staging.plan import plan_state_dict
from astage._util.timeslice import drive
from tests.statedicts import assert_same_tree, bytes_equal, tensors_of

pytestmark = pytest.mark.anyio

MIDDLING = DIRECT_MIN_NUMEL + 17


def nan_payloads(numel: int) -> torch.Tensor:
    """float32 NaNs with distinct payloads: any conversion on the way would lose them."""
    return (torch.arange(numel, dtype=torch.int32) | 0x7FC00000).view(torch.float32)


def mixed() -> dict[str, Any]:
    big = DIRECT_MAX_BYTES // 4 + 1
    return {
        "small": torch.randn(1000),
        "fp32": torch.randn(MIDDLING),
        "nan": nan_payloads(MIDDLING),
        "fp16": torch.randn(2, MIDDLING).half(),
        "bf16": torch.randn(MIDDLING).bfloat16(),
        "i64": torch.arange(MIDDLING, dtype=torch.int64) * 3,
        "u8": torch.randint(0, 256, (MIDDLING,), dtype=torch.uint8),
        "c64": torch.randn(MIDDLING, dtype=torch.complex64),
        "big": torch.randn(big),
        "row": torch.randn(3, MIDDLING)[1],  # a view: its storage is copied through bytes
        "just_under": torch.randn(DIRECT_MIN_NUMEL - 1),
        "top": torch.randn(DIRECT_MAX_BYTES // 4),
    }


def direct_keys(sd: dict[str, Any]) -> set[str]:
    """The keys whose storages the layout copies by ``memmove``."""
    source = plan_state_dict(sd)
    layout = drive(copy_layout_in_slices(source.plan, source.tensors))
    ids = {id(t): k for k, t in sd.items()}
    out: set[str] = set()
    for batch, direct in zip(layout.host, layout.host_direct, strict=True):
        if direct:
            out |= {ids[id(source.tensors[i])] for i in batch}
    return out


def test_only_middling_covering_host_storages_are_copied_by_memmove() -> None:
    sd = mixed()
    assert direct_keys(sd) == {"fp32", "nan", "fp16", "bf16", "i64", "u8", "c64", "top"}


async def test_a_direct_copy_is_bit_for_bit_on_every_stage_and_refill() -> None:
    sd = mixed()
    opts = StagingOptions(use_pinned_memory=False, use_non_blocking_copy=False)
    for options in (opts, StagingOptions(use_pinned_memory=False, skip_unchanged=True)):
        async with DefaultStager(options) as stager:
            for step in range(3):
                staged = await stager.stage(sd)
                assert_same_tree(staged, sd)
                for s, t in zip(tensors_of(staged), tensors_of(sd), strict=True):
                    assert bytes_equal(s, t)
                await stager.release(staged)
                del staged
                with torch.no_grad():
                    sd["fp32"].add_(step + 1)
                    sd["i64"].mul_(5)
                    sd["nan"].view(torch.int32).sub_(step + 1)  # still NaNs, other payloads


def pair(numel: int = MIDDLING) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((numel,), -1.0), torch.randn(numel)


def test_a_source_that_is_no_longer_contiguous_is_copied_as_copy_copies_it() -> None:
    dst, _ = pair()
    src = torch.randn(MIDDLING, 2).t()[0]  # same size, stride 2
    run_batch(DirectBatch(([dst], [src])))
    assert torch.equal(dst, src)


def test_a_source_of_another_dtype_is_converted_as_copy_converts_it() -> None:
    dst, src = pair()
    src.data = torch.arange(MIDDLING, dtype=torch.float64)  # a .data swap changes the dtype
    run_batch(DirectBatch(([dst], [src])))
    assert torch.equal(dst, torch.arange(MIDDLING, dtype=torch.float32))


def test_a_source_of_another_size_raises_as_copy_raises() -> None:
    dst, _ = pair()
    with pytest.raises(RuntimeError, match="must match"):
        run_batch(DirectBatch(([dst], [torch.randn(MIDDLING + 1)])))


def test_a_source_whose_storage_shrank_is_refused_and_nothing_is_read() -> None:
    dst, src = pair()
    src.untyped_storage().resize_(1024)  # copy_ would read past its end (a crash)
    with pytest.raises(UnsupportedInputError, match="shrank to 1,024 bytes"):
        run_batch(DirectBatch(([dst], [src])))
    assert bool((dst == -1.0).all())


def test_a_conjugated_source_is_resolved_as_copy_resolves_it() -> None:
    dst = torch.zeros(MIDDLING, dtype=torch.complex64)
    src = torch.randn(MIDDLING, dtype=torch.complex64)
    run_batch(DirectBatch(([dst], [src.conj()])))
    assert torch.equal(dst, src.conj().resolve_conj())


def test_every_pair_of_a_direct_batch_is_copied() -> None:
    dsts, srcs = zip(*(pair(MIDDLING + i) for i in range(5)), strict=True)
    run_batch(DirectBatch((list(dsts), list(srcs))))
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))


def _not_contiguous() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randn(MIDDLING, 2).t()[0]
    return src, src.contiguous()


def _other_dtype() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randn(MIDDLING)
    src.data = torch.arange(MIDDLING, dtype=torch.float64)
    return src, torch.arange(MIDDLING, dtype=torch.float32)


def _negated() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randn(MIDDLING)
    return torch._neg_view(src), -src


ODD_SOURCES = {"not contiguous": _not_contiguous, "another dtype": _other_dtype, "neg bit": _negated}


@pytest.mark.parametrize("odd", sorted(ODD_SOURCES))
def test_one_odd_pair_among_plain_ones_is_copied_as_copy_copies_it_and_the_rest_exactly(odd: str) -> None:
    """The batch is checked a column at a time; one pair that fails sends the whole batch
    pair by pair, where that pair gets ``copy_`` and the others their ``memmove``."""
    odd_src, expected = ODD_SOURCES[odd]()
    plain = [pair(MIDDLING) for _ in range(4)]
    dsts = [d for d, _ in plain[:2]] + [torch.full((MIDDLING,), -1.0)] + [d for d, _ in plain[2:]]
    srcs = [s for _, s in plain[:2]] + [odd_src] + [s for _, s in plain[2:]]
    run_batch(DirectBatch((dsts, srcs)))
    assert torch.equal(dsts[2], expected)
    assert all(bytes_equal(d, s) for d, s in zip(dsts[:2] + dsts[3:], srcs[:2] + srcs[3:], strict=True))


def test_a_shrunk_storage_among_plain_pairs_is_refused_before_its_own_memmove() -> None:
    """A storage that shrank passes every column (its tensor's metadata is unchanged): its
    size is measured right before its own ``memmove``, which never reads it."""
    plain = [pair(MIDDLING) for _ in range(3)]
    dsts, srcs = [d for d, _ in plain], [s for _, s in plain]
    srcs[1].untyped_storage().resize_(1024)
    with pytest.raises(UnsupportedInputError, match="shrank to 1,024 bytes"):
        run_batch(DirectBatch((dsts, srcs)))
    assert torch.equal(dsts[0], srcs[0])
    assert bool((dsts[1] == -1.0).all())
