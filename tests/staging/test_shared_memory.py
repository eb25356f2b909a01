"""Shared staging buffers: readable by another process, cheap in file descriptors."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from astage import DefaultStager, StagingOptions

# Process start-up dominates these tests; one backend is enough for what they pin down.
pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


def _checksum_in_child(queue: mp.Queue, out: mp.Queue) -> None:  # type: ignore[type-arg]
    staged = queue.get()
    out.put({k: (float(v.double().sum()), v.is_shared()) for k, v in staged.items()})


async def test_a_second_process_reads_the_staged_copy() -> None:
    sd = {"w": torch.randn(256, 256), "b": torch.arange(10, dtype=torch.float32)}
    async with DefaultStager(StagingOptions(use_shared_memory=True)) as stager:
        staged = await stager.stage(sd)
        assert all(t.untyped_storage().is_shared() for t in staged.values())
        ctx = mp.get_context("spawn")
        queue, out = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=_checksum_in_child, args=(queue, out))
        child.start()
        try:
            queue.put(staged)
            result = out.get(timeout=60)
        finally:
            child.join(timeout=60)
    assert child.exitcode == 0
    for key, (total, shared) in result.items():
        assert shared
        assert total == pytest.approx(float(sd[key].double().sum()))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_twenty_thousand_shared_tensors_do_not_exhaust_descriptors() -> None:
    sd = {f"t{i}": torch.full((4,), float(i)) for i in range(20_000)}
    before = open_fds()
    async with DefaultStager(StagingOptions(use_shared_memory=True)) as stager:
        staged = await stager.stage(sd)
        assert open_fds() - before < 100
        assert staged["t19999"][0].item() == 19999.0
        assert all(staged[k].untyped_storage().is_shared() for k in ("t0", "t12345"))
