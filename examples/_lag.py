"""The examples' event-loop lag probe: a 1 ms heartbeat that counts only while a save runs.

A heartbeat that also counted the training step would report the step itself (synchronous
model code holds the loop for as long as it runs, ~1 s on a small CPU), not what staging
costs the loop.  So a beat counts only if it began inside a ``measuring()`` block, and a
beat still overdue when the block ends counts up to that moment: the loop was held until
then by the save, not by what comes after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

clock = time.perf_counter


class SaveLag:
    """Lag samples (seconds) of a heartbeat in this event loop, taken inside ``measuring()``."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.samples: list[float] = []
        self._woke = asyncio.Event()  # set at each wake-up, counted or not
        self._window: float | None = None  # when the current measuring() block began
        self._expected: float | None = None  # when the pending beat should wake up

    def _counts(self, expected: float) -> bool:
        return self._window is not None and expected - self.period >= self._window

    async def run(self) -> None:
        """The heartbeat; run it as a task for as long as saves are to be measured."""
        while True:
            self._expected = expected = clock() + self.period
            await asyncio.sleep(self.period)
            self._woke.set()
            if self._counts(expected):
                self.samples.append(clock() - expected)
            self._expected = None

    async def next_beat(self) -> None:
        """Return once the heartbeat has woken up again (tests wait on it, not on time)."""
        self._woke.clear()
        await self._woke.wait()

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Count the beats of the block: wrap ``await stager.stage(...)`` or ``await ckpt.save(...)``."""
        self._window = clock()
        try:
            yield
        finally:
            expected = self._expected
            if expected is not None and self._counts(expected) and clock() > expected:
                self.samples.append(clock() - expected)
                self._expected = None  # counted once: the beat's late wake-up is outside
            self._window = None

    def summary(self, during: str) -> str:
        """One line for the example's output, saying what was measured (``during``: the call)."""
        ordered = sorted(self.samples) or [0.0]
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        return (
            f"heartbeat lag during {during} only (1 ms beat; training steps excluded): "
            f"max {ordered[-1] * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms over {len(self.samples)} beats"
        )
