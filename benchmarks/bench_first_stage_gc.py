"""What a first stage costs the program's collector: fresh stagers' first stages, then
steady stages, with every collection they start (generation, ms) and the loop's lag.

``python -m benchmarks.bench_first_stage_gc [--case small-20k] [--firsts 3] [--steadies 10]
[--recipe]``; ``--recipe`` runs each first stage as ``docs/performance.md``'s program does
(collector off, then ``gc.freeze(); gc.unfreeze(); gc.enable()``).  One JSON line; run it in
turns against another checkout (``PYTHONPATH``) for an A/B.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import time
from typing import Any

import astage

from .bench_staging import CASES
from .common import LoopLag

_passes: list[tuple[int, float]] = []
_started = [0.0]


def _record(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _passes.append((info["generation"], time.perf_counter() - _started[0]))


def _take() -> tuple[int, float, int]:
    """(full passes, their ms, young passes) since the last call."""
    full = [d for g, d in _passes if g == 2]
    young = sum(1 for g, _ in _passes if g < 2)
    _passes.clear()
    return len(full), round(sum(full) * 1e3, 1), young


async def _stage(stager: astage.DefaultStager, sd: Any, recipe: bool) -> tuple[float, float]:
    if recipe:
        gc.disable()
    try:
        async with LoopLag() as lag:
            start = time.perf_counter()
            staged = await stager.stage(sd)
            elapsed = time.perf_counter() - start
    finally:
        if recipe:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
    await stager.release(staged)
    return elapsed, max(lag.samples or [0.0]) * 1e3


async def _run(sd: Any, firsts: int, steadies: int, recipe: bool) -> dict[str, Any]:
    first: list[tuple[float, float, tuple[int, float, int]]] = []
    steady: list[tuple[float, float, tuple[int, float, int]]] = []
    _take()
    for _ in range(firsts):
        async with astage.DefaultStager() as stager:
            first.append((*await _stage(stager, sd, recipe), _take()))
            for _ in range(steadies):
                steady.append((*await _stage(stager, sd, False), _take()))
    return {
        "first_s_median": round(statistics.median(x[0] for x in first), 4),
        "first_lag_max_ms": [round(x[1], 1) for x in first],
        "first_passes_full_ms_young": [x[2] for x in first],
        "steady_s_median": round(statistics.median(x[0] for x in steady), 4),
        "steady_lag_max_ms": round(max(x[1] for x in steady), 1),
        "steady_full_passes": sum(x[2][0] for x in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="small-20k", choices=sorted(CASES))
    parser.add_argument("--firsts", type=int, default=3)
    parser.add_argument("--steadies", type=int, default=10)
    parser.add_argument("--recipe", action="store_true")
    parser.add_argument("--quick", action="store_true", help="smoke test: scale 0.01, one stage of each")
    args = parser.parse_args()
    if args.quick:
        args.firsts, args.steadies = 1, 1
    sd = CASES[args.case](0.01 if args.quick else 1.0)
    gc.collect()  # building the input is not the stage's
    gc.callbacks.append(_record)
    print(json.dumps(asyncio.run(_run(sd, args.firsts, args.steadies, args.recipe))))


if __name__ == "__main__":
    main()
