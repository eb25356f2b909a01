"""The event loop keeps its turn while a big state_dict is staged."""

from __future__ import annotations

import gc

import pytest
import torch

from astage import DefaultStager
from tests.helpers import Beats, heartbeat_gaps

pytestmark = pytest.mark.anyio


def assert_loop_kept_its_turn(
    beats: Beats, max_hold_cpu: float, max_outlier_cpu: float | None = None
) -> None:
    """Bounds that fail a blocked loop, stably on a loaded 2-core machine.

    The wall-time bounds are generous (a garbage collection or a descheduled process can
    stall a beat for 100+ ms there); the CPU bound is tight, because time the process does
    not run is not CPU time of the loop thread.  (The benchmarks measure the real lag.)

    :param max_hold_cpu: most CPU seconds the loop thread may spend between two beats.
    :param max_outlier_cpu: if given, one gap (only one) may reach this instead: a single
        hold that the process, not the work, costs on a loaded CI machine (11 ms seen once in
        a full run, never in isolation).  A regression that does the work on the loop holds
        it at every step, so it still fails the bound on the second-largest hold.
    """
    gaps, elapsed = beats.gaps, beats.elapsed
    assert len(gaps) >= elapsed / 0.025, (len(gaps), elapsed)  # a beat every 25 ms on average
    assert max(gaps) < max(0.15, elapsed / 2), (max(gaps), elapsed)
    holds = sorted(beats.busy, reverse=True)
    if max_outlier_cpu is None:
        assert holds[0] < max_hold_cpu, (holds[:3], elapsed)
    else:
        assert holds[0] < max_outlier_cpu, (holds[:3], elapsed)
        assert len(holds) < 2 or holds[1] < max_hold_cpu, (holds[:3], elapsed)


async def test_heartbeat_keeps_ticking_during_a_512_mib_stage() -> None:
    sd = {f"layer{i}": torch.randn(16 << 20) for i in range(8)}  # 8 x 64 MiB
    async with DefaultStager() as stager:

        async def work() -> None:
            await stager.stage(sd)

        beats = await heartbeat_gaps(work)
    assert beats.elapsed > 0.02
    # The loop holds well under 1 ms between beats here (measured); copying the 64 MiB
    # tensors on the loop would hold it ~10 ms each (8 holds), all 512 MiB at once ~80 ms.
    assert_loop_kept_its_turn(beats, max_hold_cpu=0.005, max_outlier_cpu=0.03)


async def test_heartbeat_keeps_ticking_while_staging_many_small_tensors() -> None:
    sd = {f"m{i}": {"w": torch.randn(32), "b": torch.randn(4)} for i in range(10_000)}
    async with DefaultStager() as stager:

        async def work() -> None:
            await stager.stage(sd)

        # The first stage, with the cyclic collector off: what astage itself holds the loop
        # for.  (With it on, a full collection triggered by the ~100,000 objects a first stage
        # creates holds the loop 0.1-0.3 s on its own, whatever astage slices: issue 11's
        # open item, not a slicing regression.)  Measured: holds up to ~0.04 s; staging these
        # 20,000 tensors on the loop in one go would hold it 0.5 s or more.
        gc.disable()
        try:
            beats = await heartbeat_gaps(work)
        finally:
            gc.enable()
        assert_loop_kept_its_turn(beats, max_hold_cpu=0.15)
        # A steady stage (the plan re-checked, the released copy refilled), collector on,
        # once the first stage's collection debt is paid: measured holds of ~6 ms.
        gc.collect()
        await stager.release(await stager.stage(sd))
        beats = await heartbeat_gaps(work)
    assert_loop_kept_its_turn(beats, max_hold_cpu=0.06)
