"""The examples' heartbeat counts the loop's lag during a save only, not the training step.

``examples/_lag.py`` is what ``async_training_loop.py`` and ``dcp_async_save.py`` report
with; here the loop is held on purpose (``time.sleep`` on the loop thread stands for a
synchronous training step, or for a save that blocks) inside and outside the window.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("examples_lag", ROOT / "examples" / "_lag.py")
assert _spec is not None
assert _spec.loader is not None
_lag = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lag)
SaveLag = _lag.SaveLag


def hold_the_loop(seconds: float) -> None:
    """Block the calling thread on purpose, as synchronous model code does."""
    time.sleep(seconds)


async def _probe(hold_outside: float, hold_inside: float) -> list[float]:
    lag = SaveLag()
    beat = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0)  # the heartbeat starts: a beat is pending
        hold_the_loop(hold_outside)  # a training step: holds the loop, outside any save
        with lag.measuring():
            await asyncio.sleep(0.02)  # a save that lets the loop run ...
            hold_the_loop(hold_inside)  # ... and then holds it
        hold_the_loop(hold_outside)  # the next training step
        await lag.next_beat()  # the late beat wakes up now, outside the save
    finally:
        beat.cancel()
    return lag.samples


def test_a_training_step_outside_the_save_is_not_counted() -> None:
    samples = asyncio.run(_probe(hold_outside=0.3, hold_inside=0.0))
    assert samples, "the heartbeat ran during the save"
    assert max(samples) < 0.2  # the 0.3 s steps before and after are not in it


def test_a_save_that_holds_the_loop_is_counted_once() -> None:
    samples = asyncio.run(_probe(hold_outside=0.3, hold_inside=0.05))
    # The held beat is counted when the save ends (less the part of its 1 ms period that had
    # passed before the hold began), up to then and not through the following step, once.
    assert max(samples) >= 0.05 - 0.001
    assert max(samples) < 0.2
    assert sum(s >= 0.04 for s in samples) == 1
