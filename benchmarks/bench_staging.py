"""Staging benchmark: astage against a raw-copy ceiling and torch's own stagers, in one table.

Six inputs: (a) a GPT-2-small-shaped checkpoint with Adam state (~1.5 GB fp32), (b)
20,000 small tensors (~11 MB), (c) a mixture-of-experts checkpoint, 20,160 tensors of 32 KiB
(0.66 GB), (d) a LoRA fine-tuning checkpoint whose adapters and their Adam state (5% of
the bytes) are written by a "training step" before every stage, and (e) (b) with a step
count, learning rate and loss beside the tensors that change before every stage, as a
training loop's do, and (f) (b) as 20,000 DTensors on a one-rank mesh (an FSDP2
``get_state_dict``'s shape; the ceiling copies their local tensors).  On (d) a stager made
with ``StagingOptions(skip_unchanged=True)`` is timed too, where astage has that option.

Each method stages each input ``--runs`` times from a fresh instance (first stage: buffers
are allocated and page-faulted), then ``--runs`` times more with the last instance (steady
state), releasing the previous staged copy before each stage.  The methods take turns, so
every astage run has a ceiling and a torch run made seconds apart and the ratios quoted are
medians of those pairs: on these shared machines memory bandwidth swings several-fold over
tens of seconds, so absolute times mean little.  A heartbeat task in the same event loop
measures the loop's lag during every stage.  Peak RSS is measured afterwards, each method
in a fresh subprocess, so the growth is its own.  Last, ``Checkpointer.save`` of (e): how
long the caller is blocked, against the ceiling's copy of the same tensors, timed in turn
with it.

    python -m benchmarks.bench_staging [--scale S] [--runs N] [--case NAME] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar, Protocol, cast

import torch
from torch.distributed.checkpoint import staging as dcp

import astage

from .common import (
    LoopLag,
    PeakRss,
    clock,
    default_scale,
    distinct_storages,
    dtensor_state_dict,
    environment,
    format_table,
    gpt2_adam_state_dict,
    idle_lag,
    iter_tensors,
    lora_state_dict,
    lora_trainable,
    median,
    moe_adam_state_dict,
    nbytes,
    percentile,
    small_tensors_state_dict,
    train_step,
    trainer_state_dict,
    trainer_step,
)

ROOT = Path(__file__).resolve().parents[__spec__.name.count(".")]
"""Where this package is imported from: a checkout, or site-packages (``astage._bench``)."""
CASES: dict[str, Callable[[float], Any]] = {
    "gpt2-adam": gpt2_adam_state_dict,
    "small-20k": small_tensors_state_dict,
    "moe-20k": moe_adam_state_dict,
    "lora": lora_state_dict,
    "trainer-20k": trainer_state_dict,
    "dtensor-20k": dtensor_state_dict,
}
SAVE_CASE = "checkpointer-save"
"""The ``--case`` name of the ``Checkpointer.save`` measurement (on ``trainer-20k``'s input:
the 20,000 small tensors, and scalars that change between saves)."""
STEADY_BOUND = {"gpt2-adam": 1.15, "small-20k": 1.5, "moe-20k": 1.5, "trainer-20k": 1.5}
"""Largest astage steady-state time allowed, as a multiple of the ceiling's."""
INCREMENTAL_BOUND = 0.10
"""Largest ``skip_unchanged`` steady stage of the LoRA input, as a fraction of a full one."""
SAVE_BOUND = 1.5
"""Largest time ``Checkpointer.save`` blocks its caller, as a multiple of the ceiling's copy."""
LAG_P99_MS, LAG_MAX_MS = 2.0, 5.0
CEILING, TORCH, ASTAGE = "ceiling (copy_)", "torch DefaultStager", "astage"
INCREMENTAL = "astage skip_unchanged"
DROPPED = "astage dropped"
SERIES_METHODS = (ASTAGE, INCREMENTAL, TORCH)
"""Methods whose lag time series (last first stage, last steady stage) the JSON keeps."""
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
    extra: ClassVar[dict[str, Any]] = {}
    """Options beyond, or instead of, the four torch's stager is given."""

    def __init__(self, state_dict: Any) -> None:
        base = {
            "use_pinned_memory": False,
            "use_shared_memory": False,
            "use_async_staging": True,
            "use_non_blocking_copy": False,
        }
        self._stager = astage.DefaultStager(astage.StagingOptions(**{**base, **self.extra}))

    async def stage(self, state_dict: Any) -> Any:
        return await self._stager.stage(state_dict)

    async def release(self, staged: Any) -> None:
        await self._stager.release(staged)

    async def aclose(self) -> None:
        await self._stager.aclose()


class AstageIncremental(Astage):
    """:class:`Astage` with ``skip_unchanged=True``: unchanged tensors are not copied again."""

    extra: ClassVar[dict[str, Any]] = {"skip_unchanged": True}


class AstageDropped(Astage):
    """:class:`Astage` whose caller drops each staged copy instead of releasing it (torch's
    habit: every reference gone): the copy's buffers come back to the pool on their own and
    the next stage re-uses them, building a new tree over them (a released copy is refilled
    in place instead, the same tree returned)."""

    async def release(self, staged: Any) -> None:
        pass  # dropped: stage_once lets go of its last reference


def skip_unchanged_available() -> bool:
    """Whether this astage's ``StagingOptions`` has ``skip_unchanged`` (older versions lack it)."""
    return "skip_unchanged" in {f.name for f in dataclasses.fields(astage.StagingOptions)}


SKIP_UNAVAILABLE = "n/a (skip_unchanged not available)"

DROPPED_BOUND = 1.5
"""A dropped copy's re-use (buffers from the pool, a new tree) against a released copy's
(refilled in place): both skip planning and allocation; only the tree is built again."""


class TorchDefault:
    """torch's ``DefaultStager`` (async staging in its thread); its future awaited from the loop."""

    note = ""
    on_device = False
    """Pinned memory and non-blocking copies (the GPU benchmark's subclass sets it)."""

    def __init__(self, state_dict: Any) -> None:
        self._stager = dcp.DefaultStager(
            dcp.StagingOptions(
                use_pinned_memory=self.on_device,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=self.on_device,
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
    ASTAGE: Astage,
    DROPPED: AstageDropped,
    TORCH: TorchDefault,
    "torch Blocking": TorchBlocking,
}
TOUCH: dict[str, Callable[[Any], None]] = {
    "lora": lambda sd: train_step(lora_trainable(sd)),
    "trainer-20k": trainer_step,
}
"""What happens to a case's state_dict before each stage, outside the timing."""
TOUCH_NOTE = {
    "lora": "its trainable tensors are written before every stage",
    "trainer-20k": "its step, learning rate and loss change before every stage",
}


def methods_for(case: str) -> tuple[dict[str, Callable[[Any], Method]], dict[str, str]]:
    """The methods timed on ``case``, and those that would be but this astage lacks (why)."""
    if case != "lora":
        return dict(METHODS), {}
    names = list(METHODS)
    if not skip_unchanged_available():
        return dict(METHODS), {INCREMENTAL: SKIP_UNAVAILABLE}
    with_incremental = [*names[:2], INCREMENTAL, *names[2:]]
    return {n: METHODS.get(n, AstageIncremental) for n in with_incremental}, {}


@dataclasses.dataclass(frozen=True)
class Timings:
    """One method's stage times (seconds) and loop-lag samples (seconds), by phase."""

    first: list[float]
    steady: list[float]
    first_lags: list[float]
    steady_lags: list[float]
    note: str
    steady_series: list[list[tuple[float, float]]]


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
    steady_x_astage: float
    peak_rss_bytes: int
    lag_p99_ms: float
    lag_max_ms: float
    steady_lag_p99_ms: float
    steady_lag_max_ms: float
    note: str
    lag_series: tuple[tuple[float, float], ...]
    """Heartbeats of the steady stage of median time: (seconds since the stage began, lag ms)."""


async def stage_once(
    method: Method, state_dict: Any, touch: Callable[[Any], None] | None = None
) -> tuple[float, LoopLag]:
    """``touch`` the input, stage once under a loop-lag probe, release: the seconds and the probe."""
    if touch is not None:
        touch(state_dict)
    async with LoopLag() as lag:
        start = clock()
        staged = await method.stage(state_dict)
        elapsed = clock() - start
    await method.release(staged)
    return elapsed, lag


def lag_series(elapsed: float, lag: LoopLag) -> dict[str, Any]:
    """One stage's lag probe as JSON: when each heartbeat woke (s) and how late (ms)."""
    return {
        "stage_s": elapsed,
        "t_s": lag.times,
        "lag_ms": [x * 1e3 for x in lag.samples],
    }


def _rotated(names: Sequence[str], r: int) -> list[str]:
    return [*names[r % len(names) :], *names[: r % len(names)]]


async def time_methods(
    state_dict: Any,
    runs: int,
    methods: dict[str, Callable[[Any], Method]] | None = None,
    touch: Callable[[Any], None] | None = None,
) -> tuple[dict[str, Timings], dict[str, dict[str, Any]]]:
    """Every method's first-stage and steady-state times and loop lags, and lag series.

    Methods take turns, in a rotating order, so that each run of astage is paired with a run
    of every other method made within seconds of it: the host's noise moves them together.
    Each first stage uses a fresh instance; the last instance then stages ``runs`` more times.
    The series are the last first stage's and last steady stage's of :data:`SERIES_METHODS`.
    """
    methods = methods if methods is not None else METHODS
    names = list(methods)
    t = {n: Timings([], [], [], [], "", []) for n in names}
    series: dict[str, dict[str, Any]] = {n: {} for n in names if n in SERIES_METHODS}
    live: dict[str, Method] = {}
    try:
        for phase in ("first", "steady"):
            # What every method's first stages made (torch's and the ceiling's new tensors
            # too) makes a full collection due: run it here, outside any timing, rather than
            # in whichever steady stage allocates next (a pass over this heap takes ~150 ms).
            gc.collect()
            for r in range(runs):
                for name in _rotated(names, r):
                    if phase == "first":
                        if name in live:
                            await live.pop(name).aclose()
                        live[name] = methods[name](state_dict)
                    elapsed, lag = await stage_once(live[name], state_dict, touch)
                    (t[name].first if phase == "first" else t[name].steady).append(elapsed)
                    (t[name].first_lags if phase == "first" else t[name].steady_lags).extend(lag.samples)
                    if phase == "steady":
                        t[name].steady_series.append(
                            list(zip(lag.times, [s * 1e3 for s in lag.samples], strict=True))
                        )
                    if name in series:
                        series[name][phase] = lag_series(elapsed, lag)
        return {n: dataclasses.replace(t[n], note=live[n].note) for n in names}, series
    finally:
        for method in live.values():
            await method.aclose()


def _median_run(times: list[float], series: list[list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """The lag series of the run whose time is the median (the lower middle for an even count)."""
    if not series:
        return []
    order = sorted(range(len(times)), key=times.__getitem__)
    return series[order[(len(order) - 1) // 2]]


def _p99_ms(lags: list[float]) -> float:
    return percentile(lags or [0.0], 99) * 1e3  # no sample: the heartbeat was never overdue


async def peak_rss(case: str, method: str, state_dict: Any, stages: int = 3) -> int:
    """Growth of peak RSS over ``stages`` stages (first, then steady) by a fresh ``method``."""
    rss = PeakRss()
    m = methods_for(case)[0][method](state_dict)
    try:
        for _ in range(stages):
            await stage_once(m, state_dict, TOUCH.get(case))
        return rss.growth()
    finally:
        await m.aclose()


def _peak_rss_isolated(case: str, method: str, scale: float) -> int:
    cmd = [sys.executable, "-m", __spec__.name, "--scale", str(scale)]
    done = subprocess.run(
        [*cmd, "--rss-worker", case, method], cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@dataclasses.dataclass(frozen=True)
class CaseRun:
    """One case: a result per method, the lag series, and the methods this astage lacks."""

    results: list[Result]
    series: dict[str, dict[str, Any]]
    unavailable: dict[str, str]


def run_case(case: str, scale: float, runs: int, isolate: bool) -> CaseRun:
    """Time every method on one case, then measure each one's peak RSS (in a fresh process)."""
    methods, unavailable = methods_for(case)
    state_dict = CASES[case](scale)
    # A program has long built its model when it first checkpoints: the full collection
    # that building this input made due runs here, not in whichever method comes first.
    gc.collect()
    size, count = nbytes(state_dict), sum(1 for _ in iter_tensors(state_dict))
    timed, series = asyncio.run(time_methods(state_dict, runs, methods, TOUCH.get(case)))
    if isolate:
        del state_dict
        gc.collect()
        rss = {m: _peak_rss_isolated(case, m, scale) for m in methods}
    else:
        rss = {m: asyncio.run(peak_rss(case, m, state_dict)) for m in methods}
    ceiling, torch_first, ours = timed[CEILING].steady, timed[TORCH].first, timed[ASTAGE].steady
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
                steady_x_astage=median([m / c for m, c in zip(t.steady, ours, strict=True)]),
                peak_rss_bytes=rss[method],
                lag_p99_ms=_p99_ms(lags),
                lag_max_ms=max(lags, default=0.0) * 1e3,
                steady_lag_p99_ms=_p99_ms(t.steady_lags),
                steady_lag_max_ms=max(t.steady_lags, default=0.0) * 1e3,
                note=t.note,
                lag_series=tuple(_median_run(t.steady, t.steady_series)),
            )
        )
    return CaseRun(results, series, unavailable)


Target = tuple[str, float | None, float, str]
"""(what, value or ``None`` where not measurable here, bound, unit); a value passes at or below."""


def judge(targets: Sequence[Target], missing: str = "") -> tuple[str, list[dict[str, Any]]]:
    """The PASS/MISS table of ``targets`` and their JSON; ``missing`` says why a value is ``None``."""
    checks: list[dict[str, Any]] = []
    lines = []
    for name, value, bound, unit in targets:
        if value is None:
            checks.append({"target": name, "value": None, "bound": bound, "pass": None, "note": missing})
            lines.append([name, "n/a", f"<= {bound}{unit}", "n/a"])
        else:
            ok = value <= bound
            checks.append({"target": name, "value": value, "bound": bound, "pass": ok})
            lines.append([name, f"{value:.2f}{unit}", f"<= {bound}{unit}", "PASS" if ok else "MISS"])
    return format_table(["target", "value", "bound", ""], lines), checks


def report(
    results: Sequence[Result], unavailable: dict[str, str] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """One case's table and its targets (name, value, bound, pass)."""
    unavailable = unavailable or {}
    by_method = {r.method: r for r in results}
    ours = by_method[ASTAGE]
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
    rows += [[method, *["n/a"] * (len(HEADERS) - 1)] for method in unavailable]
    targets: list[Target] = []
    if ours.case in STEADY_BOUND:
        bound = STEADY_BOUND[ours.case]
        targets.append(("astage steady / ceiling steady", ours.steady_x_ceiling, bound, "x"))
    targets.append(("astage first / torch DefaultStager first", ours.first_x_torch, 1.0, "x"))
    dropped = by_method.get(DROPPED)
    if dropped is not None:  # both re-use cycles: a copy released, and one dropped
        targets.append(("astage dropped steady / astage steady", dropped.steady_x_astage, DROPPED_BOUND, "x"))
    if ours.case == "lora":
        incremental = by_method.get(INCREMENTAL)
        targets.append(
            (
                "astage skip_unchanged steady / astage steady",
                incremental.steady_x_astage if incremental else None,
                INCREMENTAL_BOUND,
                "x",
            )
        )
    for r in (ours, by_method.get(INCREMENTAL)):
        if r is not None:
            targets += [
                (f"{r.method} loop lag p99", r.lag_p99_ms, LAG_P99_MS, " ms"),
                (f"{r.method} loop lag max", r.lag_max_ms, LAG_MAX_MS, " ms"),
            ]
    judged, checks = judge(targets, unavailable.get(INCREMENTAL, ""))
    notes = [f"  note, {r.method}: {r.note}" for r in results if r.note]
    notes += [f"  note, {method}: {why}" for method, why in unavailable.items()]
    title = f"({ours.case}) {ours.bytes / 1e6:.1f} MB in {ours.tensors} tensors"
    if ours.case in TOUCH:
        title += "; " + TOUCH_NOTE[ours.case]
    table = format_table(HEADERS, rows)
    return "\n".join([title, table, *notes, "", judged]), checks


# -- Checkpointer.save ----------------------------------------------------------------------


async def time_save(state_dict: Any, runs: int, directory: Path) -> dict[str, Any]:
    """How long ``Checkpointer.save`` blocks its caller, in turns with the ceiling's copy.

    Round 0 is the first save (a fresh Checkpointer and stager) and the ceiling's first copy;
    ``runs`` more rounds follow.  Each save's commit is awaited outside the timing, so no
    save waits behind an earlier one (``max_in_flight``): what is timed is the staging.
    """
    ceiling = Ceiling(state_dict)
    blocked: list[float] = []
    reported: list[float] = []
    copies: list[float] = []
    lags: list[float] = []
    series: dict[str, Any] = {}
    async with astage.Checkpointer(directory, keep=1) as ckpt:
        for r in range(runs + 1):
            for name in _rotated(["save", CEILING], r):
                if name == CEILING:
                    copies.append((await stage_once(ceiling, state_dict))[0])
                    continue
                trainer_step(state_dict)  # a training loop's scalars move between saves
                async with LoopLag() as lag:
                    start = clock()
                    handle = await ckpt.save(r, state_dict)
                    elapsed = clock() - start
                await handle.wait()
                blocked.append(elapsed)
                reported.append(handle.staging_seconds)
                lags.extend(lag.samples)
                series["first" if r == 0 else "steady"] = lag_series(elapsed, lag)
            if r == 0:
                gc.collect()  # as in time_methods: the first round's new objects, outside timing
    await ceiling.aclose()
    steady = blocked[1:]
    return {
        "case": SAVE_CASE,
        "input": "trainer-20k",
        "bytes": nbytes(state_dict),
        "tensors": sum(1 for _ in iter_tensors(state_dict)),
        "first_s": blocked[0],
        "steady_s": median(steady),
        "blocked_runs_s": blocked,
        "staging_seconds_runs": reported,
        "ceiling_runs_s": copies,
        "ceiling_steady_s": median(copies[1:]),
        "steady_x_ceiling": median([b / c for b, c in zip(steady, copies[1:], strict=True)]),
        "lag_p99_ms": _p99_ms(lags),
        "lag_max_ms": max(lags, default=0.0) * 1e3,
        "lag_series": series,
    }


def run_save(scale: float, runs: int, parent: Path | None) -> dict[str, Any]:
    """:func:`time_save` on the ``trainer-20k`` input, in a temporary directory."""
    root = Path(tempfile.mkdtemp(prefix="astage-bench-save-", dir=parent))
    try:
        state_dict = trainer_state_dict(scale)
        gc.collect()  # as in run_case: building the input is not the save's
        return asyncio.run(time_save(state_dict, runs, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report_save(result: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The ``Checkpointer.save`` table and its targets."""
    rows = [
        [
            "Checkpointer.save (caller blocked)",
            f"{result['first_s']:.4f}",
            f"{result['steady_s']:.4f}",
            f"{result['steady_x_ceiling']:.2f}",
            f"{result['lag_p99_ms']:.2f}",
            f"{result['lag_max_ms']:.2f}",
        ],
        [CEILING, f"{result['ceiling_runs_s'][0]:.4f}", f"{result['ceiling_steady_s']:.4f}", "1.00", "", ""],
    ]
    headers = ["method", "first s", "steady s", "x ceiling", "lag p99 ms", "lag max ms"]
    judged, checks = judge(
        [
            ("save blocked steady / ceiling steady", result["steady_x_ceiling"], SAVE_BOUND, "x"),
            ("save loop lag p99", result["lag_p99_ms"], LAG_P99_MS, " ms"),
            ("save loop lag max", result["lag_max_ms"], LAG_MAX_MS, " ms"),
        ]
    )
    size = f"{result['bytes'] / 1e6:.1f} MB in {result['tensors']} tensors"
    title = f"({SAVE_CASE}) Checkpointer.save of {size}"
    return "\n".join([title, format_table(headers, rows), "", judged]), checks


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
        "--case", choices=[*CASES, SAVE_CASE], action="append", help="run only this case (repeatable)"
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the Checkpointer writes (a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="smoke test: scale 0.01, 2 runs, one process")
    parser.add_argument("--rss-worker", nargs=2, metavar=("CASE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    scale = args.scale if args.scale is not None else 0.01 if args.quick else default_scale()
    runs = args.runs if args.runs is not None else 2 if args.quick else 5

    if args.rss_worker:
        case, method = args.rss_worker
        print(asyncio.run(peak_rss(case, method, CASES[case](scale))))
        return 0

    idle = asyncio.run(idle_lag())
    idle_p99, idle_max = percentile(idle, 99) * 1e3, max(idle) * 1e3
    print(
        f"astage {astage.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; scale {scale}; "
        f"medians of {runs} runs; idle loop lag p99 {idle_p99:.2f} ms, max {idle_max:.2f} ms\n"
    )
    payload: dict[str, Any] = {
        "scale": scale,
        "environment": environment(),
        "runs": runs,
        "results": [],
        "targets": {},
        "idle_lag_ms": {"p99": idle_p99, "max": idle_max},
        "lag_series": {},
        "unavailable": {},
    }
    for case in args.case or [*CASES, SAVE_CASE]:
        if case == SAVE_CASE:
            saved = run_save(scale, runs, args.dir)
            text, checks = report_save(saved)
            payload["checkpointer"] = {k: v for k, v in saved.items() if k != "lag_series"}
            payload["lag_series"][case] = {"Checkpointer.save": saved["lag_series"]}
        else:
            run = run_case(case, scale, runs, isolate=not args.quick)
            text, checks = report(run.results, run.unavailable)
            payload["results"] += [dataclasses.asdict(r) for r in run.results]
            payload["lag_series"][case] = run.series
            payload["unavailable"][case] = run.unavailable
        print(text, end="\n\n", flush=True)
        payload["targets"][case] = checks
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
