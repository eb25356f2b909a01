"""GPU staging benchmark: device-to-host staging into pinned buffers, on a CUDA machine.

Inputs live on the GPU: the staging benchmark's GPT-2-small-shaped checkpoint with Adam
state (~1.5 GB), the 20,160-tensor mixture-of-experts checkpoint (0.66 GB) and 20,000 small
tensors (~11 MB).  Methods, taking turns as in ``bench_staging`` (first stages by fresh
instances, then steady stages by the last one, each copy released before the next):

* ``bandwidth (one flat copy_)``: one ``copy_`` of a flat device buffer of the same bytes into
  a pinned buffer: what the link gives, with no per-tensor work;
* ``ceiling (pinned copy_)``: a plain loop of ``copy_(non_blocking=True)`` per storage, on a
  side stream, into pinned buffers the first stage allocated, then one synchronize;
* ``astage``: ``astage.DefaultStager`` with pinned pool buffers and non-blocking copies;
* ``torch DefaultStager``: torch's, with pinned memory, non-blocking copies, async staging.

A 1 ms heartbeat measures the event loop's lag during every stage.  Then a compute stream
runs a loop of bf16 matmuls, timed with CUDA events, alone and while each method stages
over and over: the slowdown is what staging costs a training step running beside it.
Without a CUDA device the benchmark prints :data:`NO_CUDA` and exits 0.

    python -m benchmarks.bench_gpu [--runs N] [--case NAME] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

import astage

from .bench_staging import ASTAGE, TORCH, Astage, Method, TorchDefault, judge, stage_once, time_methods
from .common import (
    distinct_storages,
    format_table,
    gpt2_adam_state_dict,
    iter_tensors,
    median,
    moe_adam_state_dict,
    nbytes,
    percentile,
    small_tensors_state_dict,
)

NO_CUDA = "no CUDA device: torch.cuda.is_available() is False; the GPU staging benchmark did not run"
CASES: dict[str, Callable[[float], Any]] = {
    "gpt2-adam": gpt2_adam_state_dict,
    "moe-20k": moe_adam_state_dict,
    "small-20k": small_tensors_state_dict,
}
BANDWIDTH, CEILING = "bandwidth (one flat copy_)", "ceiling (pinned copy_)"
LAG_P99_MS, LAG_MAX_MS = 2.0, 5.0
MATMUL_N = 16384
"""Side of the square bf16 matmuls of the compute loop (~10 ms each on an H100/H200)."""


def to_device(tree: Any, device: torch.device, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``tree`` with every tensor moved to ``device``; a tensor met twice (tied) moves once."""
    memo = {} if memo is None else memo
    if isinstance(tree, torch.Tensor):
        if id(tree) not in memo:
            memo[id(tree)] = tree.to(device)
        return memo[id(tree)]
    if isinstance(tree, dict):
        return {k: to_device(v, device, memo) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_device(v, device, memo) for v in tree)
    return tree


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class PinnedCeiling:
    """``copy_(non_blocking=True)`` per storage on a side stream into pinned buffers; blocks."""

    note = ""

    def __init__(self, state_dict: Any) -> None:
        self._sources = distinct_storages(state_dict)  # walked once, outside the timing
        self._buffers: list[torch.Tensor] = []
        self._stream = torch.cuda.Stream()

    async def stage(self, state_dict: Any) -> Any:
        if not self._buffers:
            self._buffers = [_pinned_like(t) for t in self._sources]
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for dst, src in zip(self._buffers, self._sources, strict=True):
                dst.copy_(src, non_blocking=True)
        self._stream.synchronize()
        return self._buffers

    async def release(self, staged: Any) -> None:
        pass

    async def aclose(self) -> None:
        self._buffers = []


class FlatCopy(PinnedCeiling):
    """One ``copy_`` of all the bytes at once: the link's bandwidth, no per-tensor work."""

    def __init__(self, state_dict: Any) -> None:
        super().__init__(state_dict)
        total = sum(t.untyped_storage().nbytes() for t in self._sources)
        device = self._sources[0].device
        self._sources = [torch.empty(total, dtype=torch.uint8, device=device)]


class AstageGpu(Astage):
    """``astage.DefaultStager``: pinned pool buffers, non-blocking copies on its side stream."""

    extra: ClassVar[dict[str, Any]] = {"use_pinned_memory": True, "use_non_blocking_copy": True}


class TorchGpu(TorchDefault):
    """torch's ``DefaultStager``: pinned memory, non-blocking copies, staging in its thread."""

    on_device = True


METHODS: dict[str, Callable[[Any], Method]] = {
    BANDWIDTH: FlatCopy,
    CEILING: PinnedCeiling,
    ASTAGE: AstageGpu,
    TORCH: TorchGpu,
}


class ComputeLoop:
    """bf16 matmuls on their own stream, each timed with a pair of CUDA events."""

    def __init__(self, n: int = MATMUL_N) -> None:
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            self._a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            self._b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            self._c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        self.stream.synchronize()

    def enqueue(self, iters: int) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """Enqueue ``iters`` matmuls; returns their (start, end) events."""
        events = []
        with torch.cuda.stream(self.stream):
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.mm(self._a, self._b, out=self._c)
                end.record()
                events.append((start, end))
        return events

    def iters_for(self, seconds: float) -> int:
        """How many matmuls take about ``seconds`` here (10 to 400)."""
        events = self.enqueue(5)
        events[-1][1].synchronize()
        per_iter_ms = median([s.elapsed_time(e) for s, e in events])
        return max(10, min(400, round(seconds * 1e3 / max(per_iter_ms, 1e-3))))

    async def run(self, iters: int, method: Method | None, state_dict: Any) -> dict[str, Any]:
        """The matmuls' times (ms), alone or while ``method`` stages again and again."""
        events = self.enqueue(iters)
        done = events[-1][1]
        stages, lags = 0, []
        while method is not None and not done.query():
            _, lag = await stage_once(method, state_dict)
            stages += 1
            lags.extend(lag.samples)
        done.synchronize()
        return {
            "iter_ms": [s.elapsed_time(e) for s, e in events],
            "window_ms": events[0][0].elapsed_time(done),
            "stages": stages,
            "lag_p99_ms": percentile(lags or [0.0], 99) * 1e3,
            "lag_max_ms": max(lags, default=0.0) * 1e3,
        }


async def compute_slowdown(state_dict: Any, seconds: float) -> dict[str, Any]:
    """The compute loop alone, then beside each method's steady stages, then alone again."""
    loop = ComputeLoop()
    iters = loop.iters_for(seconds)
    out: dict[str, Any] = {"iters": iters, "alone": [await loop.run(iters, None, state_dict)]}
    for name, factory in METHODS.items():
        method = factory(state_dict)
        try:
            await stage_once(method, state_dict)  # the first stage allocates: not what is measured
            out[name] = await loop.run(iters, method, state_dict)
        finally:
            await method.aclose()
    out["alone"].append(await loop.run(iters, None, state_dict))
    alone_iter = median([t for run in out["alone"] for t in run["iter_ms"]])
    alone_window = median([run["window_ms"] for run in out["alone"]])
    out["alone_iter_ms"] = alone_iter
    for name in METHODS:
        out[name]["slowdown_iter"] = median(out[name]["iter_ms"]) / alone_iter
        out[name]["slowdown_window"] = out[name]["window_ms"] / alone_window
    return out


def run_case(case: str, scale: float, runs: int, seconds: float) -> tuple[str, dict[str, Any]]:
    """Time every method on ``case`` (on the GPU) and the compute slowdown; the text and JSON."""
    state_dict = to_device(CASES[case](scale), torch.device("cuda"))
    gc.collect()
    size, count = nbytes(state_dict), sum(1 for _ in iter_tensors(state_dict))
    timed, series = asyncio.run(time_methods(state_dict, runs, METHODS))
    compute = asyncio.run(compute_slowdown(state_dict, seconds))
    del state_dict
    gc.collect()
    torch.cuda.empty_cache()

    def ratio(a: list[float], b: list[float]) -> float:
        return median([x / y for x, y in zip(a, b, strict=True)])

    rows, results = [], {}
    for name, t in timed.items():
        lags = t.first_lags + t.steady_lags
        r = {
            "method": name,
            "first_s": median(t.first),
            "steady_s": median(t.steady),
            "first_runs_s": t.first,
            "steady_runs_s": t.steady,
            "first_x_torch": ratio(t.first, timed[TORCH].first),
            "steady_x_ceiling": ratio(t.steady, timed[CEILING].steady),
            "steady_x_bandwidth": ratio(t.steady, timed[BANDWIDTH].steady),
            "lag_p99_ms": percentile(lags or [0.0], 99) * 1e3,
            "lag_max_ms": max(lags, default=0.0) * 1e3,
            "compute_slowdown_iter": compute[name]["slowdown_iter"],
            "compute_slowdown_window": compute[name]["slowdown_window"],
        }
        results[name] = r
        rows.append(
            [
                name,
                f"{r['first_s']:.4f}",
                f"{r['first_x_torch']:.2f}",
                f"{r['steady_s']:.4f}",
                f"{size / r['steady_s'] / 1e9:.1f}",
                f"{r['steady_x_ceiling']:.2f}",
                f"{r['steady_x_bandwidth']:.2f}",
                f"{r['lag_p99_ms']:.2f}",
                f"{r['lag_max_ms']:.2f}",
                f"{r['compute_slowdown_iter']:.3f}",
            ]
        )
    headers = ["method", "first s", "x torch", "steady s", "steady GB/s", "x ceiling", "x bandwidth"]
    headers += ["lag p99 ms", "lag max ms", "compute x"]
    ours, theirs = results[ASTAGE], results[TORCH]
    judged, checks = judge(
        [
            ("astage first / torch DefaultStager first", ours["first_x_torch"], 1.0, "x"),
            ("astage steady / torch DefaultStager steady", ours["steady_s"] / theirs["steady_s"], 1.0, "x"),
            ("astage loop lag p99", ours["lag_p99_ms"], LAG_P99_MS, " ms"),
            ("astage loop lag max", ours["lag_max_ms"], LAG_MAX_MS, " ms"),
        ]
    )
    title = f"({case}) {size / 1e6:.1f} MB in {count} tensors, on {torch.cuda.get_device_name()}"
    note = (
        f"  compute x: median {MATMUL_N}x{MATMUL_N} bf16 matmul time while the method stages, over its "
        f"time alone ({compute['alone_iter_ms']:.3f} ms; {compute['iters']} matmuls a window)"
    )
    text = "\n".join([title, format_table(headers, rows), note, "", judged])
    payload = {
        "case": case,
        "bytes": size,
        "tensors": count,
        "results": list(results.values()),
        "targets": checks,
        "compute": compute,
        "lag_series": series,
    }
    return text, payload


def machine() -> dict[str, Any]:
    """What ran the benchmark: devices, torch and CUDA versions."""
    return {
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "astage": astage.__version__,
        "cpus": os.cpu_count(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the tables; exit 0 also without CUDA or on a missed target."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--scale", type=float, default=None, help="size scale, 1.0 = full (default)")
    parser.add_argument("--runs", type=int, default=None, help="first stages, and steady stages (5)")
    parser.add_argument(
        "--case", choices=list(CASES), action="append", help="run only this case (repeatable)"
    )
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="smoke test: scale 0.05, 2 runs, short windows")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, flush=True)
        return 0
    scale = args.scale if args.scale is not None else 0.05 if args.quick else 1.0
    runs = args.runs if args.runs is not None else 2 if args.quick else 5
    seconds = 0.2 if args.quick else 1.0
    info = machine()
    print(
        f"astage {info['astage']}, torch {info['torch']}, CUDA {info['cuda']}, {info['devices']}, "
        f"{info['cpus']} CPUs; scale {scale}; medians of {runs} runs\n",
        flush=True,
    )
    payload: dict[str, Any] = {"machine": info, "scale": scale, "runs": runs, "cases": {}}
    for case in args.case or CASES:
        text, result = run_case(case, scale, runs, seconds)
        print(text, end="\n\n", flush=True)
        payload["cases"][case] = result
        if args.json:  # after every case, so a later failure or timeout keeps what was measured
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
