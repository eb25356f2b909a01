"""Soak: many stage/release cycles and Checkpointer saves, with nothing growing.

Each run records, after every cycle, the process's resident memory (RSS), its open file
descriptors, the pool's bytes (total, free, handed out) and, for shared-memory staging, this
process's entries in ``/dev/shm``; then checks that nothing grows after a warm-up: the maximum over
the last quarter of the cycles is at most the maximum over the first quarter (after the
warm-up) plus a small slack.  Pool bytes, descriptors and ``/dev/shm`` entries are exact
counts and get no slack; RSS gets a few MiB for the allocator's own bookkeeping.

The size comes from ``ASTAGE_SOAK_SCALE`` (default 1: 100 stage cycles and 20 saves, a few
seconds); ``ASTAGE_SOAK_SCALE=10`` runs the full 1,000 cycles and 200 saves.  The curve is
written as CSV to ``ASTAGE_SOAK_DIR`` when it is set (else to the test's temp directory)
and printed as a table (``pytest -s`` shows it).
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import astage
from tests.helpers import no_blocking_calls_on_the_loop  # noqa: F401 - autouse fixture
from tests.statedicts import assert_same_tree

SCALE = int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))
STAGE_CYCLES = 100 * SCALE
SAVES = 20 * SCALE
STAGE_RSS_SLACK = 8 << 20
"""Allowed RSS growth between the first and the last quarter of stage cycles: allocator
bookkeeping (measured: under 0.2 MiB over 1,000 cycles)."""
SAVE_RSS_SLACK = 32 << 20
"""The same for saves, whose encoding and writing go through worker threads' malloc arenas:
measured to swing by 26 MiB over 200 saves, with no trend.  A leak of one 4 MiB state a
save would add 40 MiB between the quarters of even the default 20 saves."""

# One backend: what could grow (buffers, descriptors, memory) is astage's, not the loop's.
pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]


def training_state(step: int) -> dict[str, Any]:
    """4.2 MiB: a large tensor and an alias of it, a bias, 200 small tensors (optimizer-like), a
    scalar tensor and a float."""
    gen = torch.Generator().manual_seed(step)
    weight = torch.randn(1 << 20, generator=gen)
    return {
        "model": {"weight": weight, "head": weight[:1024], "bias": torch.randn(4096, generator=gen)},
        "optim": {f"exp_avg.{i}": torch.randn(256, generator=gen) for i in range(200)},
        "step": torch.tensor(step),
        "lr": 0.1,
    }


def shm_entries() -> int:
    """This process's entries in ``/dev/shm`` (torch names them ``torch_<pid>_...``)."""
    ours = f"torch_{os.getpid()}_"
    try:
        return sum(name.startswith(ours) for name in os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - not Linux
        return 0


@dataclasses.dataclass(frozen=True)
class Sample:
    cycle: int
    rss: int
    fds: int
    pool_total: int
    pool_free: int
    pool_handed_out: int
    shm: int


class Recorder:
    """Samples the process and a pool after each cycle; writes and checks the curve."""

    def __init__(self, name: str, pool: Callable[[], astage.PoolStats], out_dir: Path) -> None:
        self.name = name
        self.pool = pool
        self.out_dir = out_dir
        self.process = psutil.Process()
        self.samples: list[Sample] = []

    def sample(self, cycle: int) -> None:
        stats = self.pool()
        self.samples.append(
            Sample(
                cycle=cycle,
                rss=self.process.memory_info().rss,
                fds=self.process.num_fds(),
                pool_total=stats.total_bytes,
                pool_free=stats.free_bytes,
                pool_handed_out=stats.handed_out_bytes,
                shm=shm_entries(),
            )
        )

    def write(self) -> Path:
        path = self.out_dir / f"soak-{self.name}.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([field.name for field in dataclasses.fields(Sample)])
            for s in self.samples:
                writer.writerow(dataclasses.astuple(s))
        return path

    def table(self, rows: int = 10) -> str:
        picked = self.samples[:: max(1, len(self.samples) // rows)] + self.samples[-1:]
        lines = [f"{self.name}: cycle    RSS MiB  fds  pool total/free/out MiB   /dev/shm"]
        for s in dict.fromkeys(picked):
            lines.append(
                f"{self.name}: {s.cycle:5d} {s.rss / 2**20:10.1f} {s.fds:4d}  "
                f"{s.pool_total / 2**20:7.2f} {s.pool_free / 2**20:6.2f} {s.pool_handed_out / 2**20:6.2f}"
                f"   {s.shm:8d}"
            )
        return "\n".join(lines)

    def check_no_growth(self, warmup: int, rss_slack: int) -> None:
        """The last quarter's maximum is at most the first quarter's plus the slack."""
        steady = self.samples[warmup:]
        quarter = max(1, len(steady) // 4)
        first, last = steady[:quarter], steady[-quarter:]
        problems = []
        for field, slack in (("rss", rss_slack), ("fds", 0), ("pool_total", 0), ("shm", 0)):
            before = max(getattr(s, field) for s in first)
            after = max(getattr(s, field) for s in last)
            if after > before + slack:
                problems.append(f"{field} grew from {before:,} to {after:,} (slack {slack:,})")
        assert not problems, "\n".join(problems) + "\n" + self.table()


@pytest.fixture
def curve_dir(tmp_path: Path) -> Path:
    where = os.environ.get("ASTAGE_SOAK_DIR")
    if not where:
        return tmp_path
    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    return path


def report(recorder: Recorder, warmup: int, rss_slack: int) -> None:
    path = recorder.write()
    print(f"\n{recorder.table()}\n(curve: {path})")
    recorder.check_no_growth(warmup, rss_slack)


def every(n: int, total: int) -> set[int]:
    """Cycles at which to compare contents: the first, some in between, the last."""
    return {0, total - 1, *range(0, total, max(1, total // n))}


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared"])
async def test_stage_release_cycles_hold_memory_descriptors_and_pool_flat(
    curve_dir: Path, shared: bool
) -> None:
    sources = [training_state(0), training_state(1)]
    checked = every(10, STAGE_CYCLES)
    async with astage.DefaultStager(astage.StagingOptions(use_shared_memory=shared)) as stager:
        recorder = Recorder(f"stage-{'shared' if shared else 'plain'}", stager.pool_stats, curve_dir)
        for cycle in range(STAGE_CYCLES):
            source = sources[cycle % 2]
            staged = await stager.stage(source)
            if cycle in checked:
                assert_same_tree(staged, source)
            await stager.release(staged)
            del staged
            recorder.sample(cycle)
        stats = stager.pool_stats()
    assert stats.leased_bytes == stats.handed_out_bytes == 0
    # Two sources of one layout: every cycle after the first reuses the same buffers.
    assert stats.allocated_bytes_ever == stats.total_bytes
    gc.collect()
    report(recorder, warmup=min(5, STAGE_CYCLES // 4), rss_slack=STAGE_RSS_SLACK)


async def test_checkpointer_saves_hold_memory_descriptors_and_pool_flat(
    tmp_path: Path, curve_dir: Path
) -> None:
    directory = tmp_path / "ckpt"
    async with (
        astage.DefaultStager() as stager,
        astage.Checkpointer(directory, stager=stager, keep=2, max_in_flight=2) as ckpt,
    ):
        recorder = Recorder("checkpointer", stager.pool_stats, curve_dir)
        for step in range(SAVES):
            await ckpt.save(step, training_state(step))
            if step % 2:  # let saves overlap, then catch up
                await ckpt.wait()
                # Sampled with no save in flight: one in flight holds its file and directory
                # open for as long as it writes, whether or not the sample lands then.
                recorder.sample(step)
        await ckpt.wait()
        assert ckpt.steps() == [SAVES - 2, SAVES - 1]
        assert_same_tree(await ckpt.restore(), training_state(SAVES - 1))
    assert sorted(p.name for p in directory.iterdir()) == [
        ".astage-rank00000.lock",
        f"step_{SAVES - 2:010d}",
        f"step_{SAVES - 1:010d}",
    ]
    report(recorder, warmup=min(4, SAVES // 4), rss_slack=SAVE_RSS_SLACK)
