"""Staging benchmark: astage against a raw-copy ceiling and torch's own stagers, in one table.

Two inputs: (a) a GPT-2-small-shaped checkpoint with Adam state (~1.5 GB fp32) and (b)
20,000 small tensors.  Each method stages each input ``--runs`` times from a fresh instance
(first stage: buffers are allocated and page-faulted), then ``--runs`` times more with the
last instance (steady state), releasing the previous staged copy before each stage.  The
methods take turns, so every astage run has a ceiling and a torch run made seconds apart
and the ratios quoted are medians of those pairs: on these shared machines memory
bandwidth swings several-fold over tens of seconds, so absolute times mean little.  A
heartbeat task in the same event loop measures the loop's lag during every stage.  Peak
RSS is measured afterwards, each method in a fresh subprocess, so the growth is its own.

    python -m benchmarks.bench_staging [--scale S] [--runs N] [--case NAME] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch.distributed.checkpoint import staging as dcp

import astage

from .common import (
    LoopLag,
    PeakRss,
    clock,
    default_scale,
    distinct_storages,
    format_table,
    gpt2_adam_state_dict,
    idle_lag,
    iter_tensors,
    median,
    nbytes,
    percentile,
    small_tensors_state_dict,
)

ROOT = Path(__file__).resolve().parents[__spec__.name.count(".")]
"""Where this package is imported from: a checkout, or site-packages (``astage._bench``)."""
CASES: dict[str, Callable[[float], Any]] = {
    "gpt2-adam": gpt2_adam_state_dict,
    "small-20k": small_tensors_state_dict,
}
STEADY_BOUND = {"gpt2-adam": 1.15, "small-20k": 1.5}
"""Largest astage steady-state time allowed, as a multiple of the ceiling's."""
LAG_P99_MS, LAG_MAX_MS = 2.0, 5.0
CEILING, TORCH = "ceiling (copy_)", "torch DefaultStager"
HEADERS = ["method", "first s", "first GB/s", "x torch", "steady s", "steady GB/s", "x ceiling"]
HEADERS += ["peak RSS MB", "lag p99 ms", "lag max ms"]


class Method(Protocol):
    """One way of staging, driven the same way for every method."""

    note: str

    async def stage(self, state_dict: Any) -> Any: ...

    async def release(self, staged: Any) -> None: ...

    async def aclose(self) -> None: ...


class Ceiling:
    """Raw ``Tensor.copy_`` in a plain loop into buffers allocated (and written) by the first stage."""

    note = ""

    def __init__(self, state_dict: Any) -> None:
        self._sources = distinct_storages(state_dict)  # walked once, outside the timing
        self._buffers: list[torch.Tensor] = []

    async def stage(self, state_dict: Any) -> Any:
        if not self._buffers:
            self._buffers = [torch.empty_like(t) for t in self._sources]
        for dst, src in zip(self._buffers, self._sources, strict=True):
            dst.copy_(src)
        return self._buffers

    async def release(self, staged: Any) -> None:
        pass

    async def aclose(self) -> None:
        self._buffers = []


class Astage:
    """``astage.DefaultStager`` with the CPU options torch's stager is given below."""

    note = ""

    def __init__(self, state_dict: Any) -> None:
        options = astage.StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        )
        self._stager = astage.DefaultStager(options)

    async def stage(self, state_dict: Any) -> Any:
        return await self._stager.stage(state_dict)

    async def release(self, staged: Any) -> None:
        await self._stager.release(staged)

    async def aclose(self) -> None:
        await self._stager.aclose()


class TorchDefault:
    """torch's ``DefaultStager`` (async staging in its thread); its future awaited from the loop."""

    note = ""

    def __init__(self, state_dict: Any) -> None:
        self._stager = dcp.DefaultStager(
            dcp.StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )

    async def stage(self, state_dict: Any) -> Any:
        return await asyncio.wrap_future(cast(Future[Any], self._stager.stage(state_dict)))

    async def release(self, staged: Any) -> None:
        pass  # torch keeps its cached storages and overwrites them on the next stage

    async def aclose(self) -> None:
        self._stager.close()


class TorchBlocking:
    """torch's ``BlockingAsyncStager``, cached when this machine allows it; blocks the loop."""

    def __init__(self, state_dict: Any) -> None:
        self.note = ""
        try:  # the cached variant pins memory, which needs an accelerator
            dcp.BlockingAsyncStager(cache_staged_state_dict=True).stage({"probe": torch.zeros(1)})
            cache = True
        except RuntimeError as exc:
            cache = False
            self.note = f"cache_staged_state_dict=True raises here ({exc}); measured with False"
        self._stager = dcp.BlockingAsyncStager(cache_staged_state_dict=cache)

    async def stage(self, state_dict: Any) -> Any:
        return self._stager.stage(state_dict)

    async def release(self, staged: Any) -> None:
        pass

    async def aclose(self) -> None:
        self._stager.close()


METHODS: dict[str, Callable[[Any], Method]] = {
    CEILING: Ceiling,
    "astage": Astage,
    TORCH: TorchDefault,
    "torch Blocking": TorchBlocking,
}


@dataclasses.dataclass(frozen=True)
class Timings:
    """One method's stage times (seconds) and loop-lag samples (seconds), by phase."""

    first: list[float]
    steady: list[float]
    first_lags: list[float]
    steady_lags: list[float]
    note: str


@dataclasses.dataclass(frozen=True)
class Result:
    """One method on one case; times in seconds (medians over runs), lags in milliseconds."""

    case: str
    method: str
    bytes: int
    tensors: int
    first_s: float
    steady_s: float
    first_runs_s: tuple[float, ...]
    steady_runs_s: tuple[float, ...]
    steady_x_ceiling: float
    first_x_torch: float
    peak_rss_bytes: int
    lag_p99_ms: float
    lag_max_ms: float
    steady_lag_p99_ms: float
    steady_lag_max_ms: float
    note: str


async def stage_once(method: Method, state_dict: Any) -> tuple[float, list[float]]:
    """Stage once under a loop-lag probe, then release: the seconds taken and the lag samples."""
    async with LoopLag() as lag:
        start = clock()
        staged = await method.stage(state_dict)
        elapsed = clock() - start
    await method.release(staged)
    return elapsed, lag.samples


def _rotated(names: Sequence[str], r: int) -> list[str]:
    return [*names[r % len(names) :], *names[: r % len(names)]]


async def time_methods(state_dict: Any, runs: int) -> dict[str, Timings]:
    """Every method's first-stage and steady-state times and loop lags.

    Methods take turns, in a rotating order, so that each run of astage is paired with a run
    of every other method made within seconds of it: the host's noise moves them together.
    Each first stage uses a fresh instance; the last instance then stages ``runs`` more times.
    """
    names = list(METHODS)
    t = {n: Timings([], [], [], [], "") for n in names}
    live: dict[str, Method] = {}
    try:
        for r in range(runs):
            for name in _rotated(names, r):
                if name in live:
                    await live.pop(name).aclose()
                live[name] = METHODS[name](state_dict)
                elapsed, samples = await stage_once(live[name], state_dict)
                t[name].first.append(elapsed)
                t[name].first_lags.extend(samples)
        for r in range(runs):
            for name in _rotated(names, r):
                elapsed, samples = await stage_once(live[name], state_dict)
                t[name].steady.append(elapsed)
                t[name].steady_lags.extend(samples)
        return {n: dataclasses.replace(t[n], note=live[n].note) for n in names}
    finally:
        for method in live.values():
            await method.aclose()


def _p99_ms(lags: list[float]) -> float:
    return percentile(lags or [0.0], 99) * 1e3  # no sample: the heartbeat was never overdue


async def peak_rss(method: str, state_dict: Any, stages: int = 3) -> int:
    """Growth of peak RSS over ``stages`` stages (first, then steady) by a fresh ``method``."""
    rss = PeakRss()
    m = METHODS[method](state_dict)
    try:
        for _ in range(stages):
            await stage_once(m, state_dict)
        return rss.growth()
    finally:
        await m.aclose()


def _peak_rss_isolated(case: str, method: str, scale: float) -> int:
    cmd = [sys.executable, "-m", __spec__.name, "--scale", str(scale)]
    done = subprocess.run(
        [*cmd, "--rss-worker", case, method], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True
    )
    return int(done.stdout.split()[-1])


def run_case(case: str, scale: float, runs: int, isolate: bool) -> list[Result]:
    """Time every method on one case, then measure each one's peak RSS (in a fresh process)."""
    state_dict = CASES[case](scale)
    size, count = nbytes(state_dict), sum(1 for _ in iter_tensors(state_dict))
    timed = asyncio.run(time_methods(state_dict, runs))
    if isolate:
        del state_dict
        gc.collect()
        rss = {m: _peak_rss_isolated(case, m, scale) for m in METHODS}
    else:
        rss = {m: asyncio.run(peak_rss(m, state_dict)) for m in METHODS}
    ceiling, torch_first = timed[CEILING].steady, timed[TORCH].first
    results = []
    for method, t in timed.items():
        lags = t.first_lags + t.steady_lags
        results.append(
            Result(
                case=case,
                method=method,
                bytes=size,
                tensors=count,
                first_s=median(t.first),
                steady_s=median(t.steady),
                first_runs_s=tuple(t.first),
                steady_runs_s=tuple(t.steady),
                steady_x_ceiling=median([m / c for m, c in zip(t.steady, ceiling, strict=True)]),
                first_x_torch=median([m / c for m, c in zip(t.first, torch_first, strict=True)]),
                peak_rss_bytes=rss[method],
                lag_p99_ms=_p99_ms(lags),
                lag_max_ms=max(lags, default=0.0) * 1e3,
                steady_lag_p99_ms=_p99_ms(t.steady_lags),
                steady_lag_max_ms=max(t.steady_lags, default=0.0) * 1e3,
                note=t.note,
            )
        )
    return results


def report(results: Sequence[Result]) -> tuple[str, list[dict[str, Any]]]:
    """One case's table and its targets (name, value, bound, pass)."""
    ours = next(r for r in results if r.method == "astage")
    rows = [
        [
            r.method,
            f"{r.first_s:.4f}",
            f"{r.bytes / r.first_s / 1e9:.2f}",
            f"{r.first_x_torch:.2f}",
            f"{r.steady_s:.4f}",
            f"{r.bytes / r.steady_s / 1e9:.2f}",
            f"{r.steady_x_ceiling:.2f}",
            f"{r.peak_rss_bytes / 1e6:.0f}",
            f"{r.lag_p99_ms:.2f}",
            f"{r.lag_max_ms:.2f}",
        ]
        for r in results
    ]
    bound = STEADY_BOUND[ours.case]
    targets = [
        ("astage steady / ceiling steady", ours.steady_x_ceiling, bound, "x"),
        ("astage first / torch DefaultStager first", ours.first_x_torch, 1.0, "x"),
        ("astage loop lag p99", ours.lag_p99_ms, LAG_P99_MS, " ms"),
        ("astage loop lag max", ours.lag_max_ms, LAG_MAX_MS, " ms"),
    ]
    checks = [{"target": n, "value": v, "bound": b, "pass": v <= b} for n, v, b, _ in targets]
    lines = [
        [n, f"{v:.2f}{unit}", f"<= {b}{unit}", "PASS" if v <= b else "MISS"] for n, v, b, unit in targets
    ]
    notes = [f"  note, {r.method}: {r.note}" for r in results if r.note]
    title = f"({ours.case}) {ours.bytes / 1e6:.1f} MB in {ours.tensors} tensors"
    table = format_table(HEADERS, rows)
    text = "\n".join([title, table, *notes, "", format_table(["target", "value", "bound", ""], lines)])
    return text, checks


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the tables; exit status 0 even when a target is missed."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_staging", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--scale", type=float, default=None, help="size scale, 1.0 = full (env ASTAGE_BENCH_SCALE)"
    )
    parser.add_argument(
        "--runs", type=int, default=None, help="first stages, and steady stages, per method (5)"
    )
    parser.add_argument(
        "--case", choices=list(CASES), action="append", help="run only this case (repeatable)"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="smoke test: scale 0.01, 2 runs, one process")
    parser.add_argument("--rss-worker", nargs=2, metavar=("CASE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    scale = args.scale if args.scale is not None else 0.01 if args.quick else default_scale()
    runs = args.runs if args.runs is not None else 2 if args.quick else 5

    if args.rss_worker:
        case, method = args.rss_worker
        print(asyncio.run(peak_rss(method, CASES[case](scale))))
        return 0

    idle = asyncio.run(idle_lag())
    print(
        f"astage {astage.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; scale {scale}; "
        f"medians of {runs} runs; idle loop lag p99 {percentile(idle, 99) * 1e3:.2f} ms, "
        f"max {max(idle) * 1e3:.2f} ms\n"
    )
    payload: dict[str, Any] = {"scale": scale, "runs": runs, "results": [], "targets": {}}
    for case in args.case or CASES:
        results = run_case(case, scale, runs, isolate=not args.quick)
        text, checks = report(results)
        print(text, end="\n\n", flush=True)
        payload["results"] += [dataclasses.asdict(r) for r in results]
        payload["targets"][case] = checks
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
