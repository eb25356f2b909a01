"""A save's progress while the training step holds the event loop.

The README's pattern runs a synchronous training step between two ``await``s: the step
holds the event loop.  This benchmark trains with a synthetic step of ``--step-seconds``
(matmuls until that much time has passed: torch releases the GIL inside them, as in a real
step; ``--work python`` spins in Python instead, holding the GIL) and saves after every
``--every`` steps, in two variants:

* ``loop``: the step runs on the loop (``train_step()``), as in the README;
* ``thread``: the step runs in a worker thread (``await anyio.to_thread.run_sync(train_step)``),
  so the loop is free all along: the reference.

For each save it records ``save->durable`` (from the ``save()`` call to the moment its
marker was durable, ``SaveHandle.durable_at``, recorded by the thread that wrote it; where a
build has no ``durable_at``, the time the loop heard of the commit) and how long ``save()``
blocked.  Medians over every save but each run's first, over ``--runs`` runs; the ratio
loop / thread is the target: ``save->durable`` within 1.5x.  With ``--ranks 2`` two local
gloo ranks save through ``Checkpointer`` + ``ReplicationStager``, both stepping on the loop
(or in a thread) alike.

    python -m benchmarks.bench_loop_held [--ranks 1|2|both] [--step-seconds S] [--mb MB]
        [--tensors N] [--steps N] [--every N] [--runs N] [--work matmul|python] [--json PATH] [--quick]

``ASTAGE_BENCH_STEP_SECONDS`` sets the default step time.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch

import astage

from .common import environment, format_table, median
from .ranks import run_group

VARIANTS = ("loop", "thread")
TARGET = 1.5
"""save->durable with the step on the loop, at most this many times the threaded variant's."""


def make_state(mb: float, tensors: int, seed: int = 0) -> dict[str, Any]:
    """``tensors`` fp32 tensors of ``mb`` MiB in all, a step count and a learning rate."""
    gen = torch.Generator().manual_seed(seed)
    per = max(1, int(mb * (1 << 20)) // 4 // max(tensors, 1))
    return {
        "model": {f"layer{i}": torch.randn(per, generator=gen) for i in range(tensors)},
        "step": 0,
        "lr": 0.1,
    }


def make_step(seconds: float, work: str) -> Callable[[], None]:
    """A synchronous training step that keeps a core busy for ``seconds``."""
    a = torch.randn(192, 192)
    b = torch.randn(192, 192)

    def matmuls() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            a.copy_(torch.tanh(a @ b))

    def python() -> None:
        end = time.perf_counter() + seconds
        x = 0
        while time.perf_counter() < end:
            for i in range(1000):
                x += i * i

    return matmuls if work == "matmul" else python


async def train(
    variant: str,
    directory: Path,
    args: argparse.Namespace,
    replication: Any = None,
    rank: int = 0,
) -> dict[str, list[float]]:
    """One run: train ``args.steps`` steps, saving every ``args.every``; per-save timings."""
    state = make_state(args.mb, args.tensors, seed=rank)
    step_fn = make_step(args.step_seconds, args.work)
    committed_at: dict[int, float] = {}

    def on_progress(event: astage.SaveEvent) -> None:
        if event.kind == "committed":
            committed_at[event.step] = time.perf_counter()

    called: dict[int, float] = {}
    blocked: list[float] = []
    handles = []
    async with astage.Checkpointer(
        directory, keep=2, replication=replication, rank=rank, on_progress=on_progress
    ) as ckpt:
        for step in range(1, args.steps + 1):
            if variant == "loop":
                step_fn()  # holds the loop
            else:
                await anyio.to_thread.run_sync(step_fn)
            state["step"], state["lr"] = step, 0.1 / step
            for tensor in list(state["model"].values())[:8]:
                tensor.add_(1.0)
            if step % args.every == 0:
                called[step] = time.perf_counter()
                handles.append(await ckpt.save(step, state))
                blocked.append(time.perf_counter() - called[step])
        await ckpt.wait()
    durable = []
    for handle in handles:
        at = getattr(handle, "durable_at", None)
        durable.append((at if at is not None else committed_at[handle.step]) - called[handle.step])
    return {"durable_s": durable, "blocked_s": blocked}


async def _rank_main(rank: int, world_size: int, variant: str, root: str, args: argparse.Namespace) -> Any:
    async with astage.ReplicationStager(storage_dir=Path(root) / f"replicas{rank}", timeout=120) as rs:
        return await train(variant, Path(root) / "ckpt", args, replication=rs, rank=rank)


def measure(ranks: int, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """Per variant, every save's timings over ``args.runs`` runs (each run's first dropped)."""
    out: dict[str, dict[str, list[float]]] = {v: {"durable_s": [], "blocked_s": []} for v in VARIANTS}
    for _ in range(args.runs):
        for variant in VARIANTS:
            with tempfile.TemporaryDirectory(prefix="astage-bench-loop-") as root:
                if ranks == 1:
                    runs = [anyio.run(train, variant, Path(root) / "ckpt", args)]
                else:
                    results = run_group(ranks, _rank_main, variant, root, args, timeout=600)
                    runs = [r.unwrap() for r in results]
            for result in runs:
                for key in ("durable_s", "blocked_s"):
                    out[variant][key] += result[key][1:] or result[key]
    return out


def report(ranks: int, timings: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Print the table and the target; the JSON entry."""
    rows = []
    medians = {v: {k: median(timings[v][k]) for k in ("durable_s", "blocked_s")} for v in VARIANTS}
    for variant in VARIANTS:
        m = medians[variant]
        rows.append(
            [
                f"step on the {variant}",
                f"{m['durable_s']:.3f}",
                f"{max(timings[variant]['durable_s']):.3f}",
                f"{m['blocked_s'] * 1e3:.1f}",
                f"{max(timings[variant]['blocked_s']) * 1e3:.1f}",
                str(len(timings[variant]["durable_s"])),
            ]
        )
    what = "1 rank" if ranks == 1 else f"{ranks} ranks, Checkpointer + ReplicationStager (gloo)"
    print(f"\n{what}")
    headers = ["variant", "save->durable s", "max s", "save() ms", "max ms", "saves"]
    print(format_table(headers, rows))
    ratio = medians["loop"]["durable_s"] / medians["thread"]["durable_s"]
    blocked_ratio = medians["loop"]["blocked_s"] / medians["thread"]["blocked_s"]
    verdict = "PASS" if ratio <= TARGET else "MISS"
    print(f"save->durable, step on the loop / in a thread: {ratio:.2f}x (target <= {TARGET}x) {verdict}")
    print(f"save() blocked, step on the loop / in a thread: {blocked_ratio:.2f}x")
    return {
        "ranks": ranks,
        "medians": medians,
        "timings": timings,
        "durable_ratio": ratio,
        "blocked_ratio": blocked_ratio,
        "pass": ratio <= TARGET,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print one table per world size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_step = float(os.environ.get("ASTAGE_BENCH_STEP_SECONDS", "1.0"))
    parser.add_argument("--ranks", choices=("1", "2", "both"), default="both")
    parser.add_argument("--step-seconds", type=float, default=default_step, help="the synthetic step's time")
    parser.add_argument("--work", choices=("matmul", "python"), default="matmul")
    parser.add_argument("--mb", type=float, default=64.0, help="MiB saved a rank")
    parser.add_argument("--tensors", type=int, default=2000, help="tensors saved a rank")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=1, help="save after every N steps")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file")
    parser.add_argument("--quick", action="store_true", help="smoke-test size: tiny steps and state")
    args = parser.parse_args(argv)
    if args.quick:
        args.step_seconds, args.mb, args.tensors, args.steps, args.runs = 0.02, 1.0, 50, 3, 1
    print(
        f"synthetic step {args.step_seconds:g} s ({args.work}), {args.mb:g} MiB in {args.tensors} tensors a "
        f"rank, a save every {args.every} step(s), {args.steps} steps, {args.runs} run(s)"
    )
    worlds = {"1": [1], "2": [2], "both": [1, 2]}[args.ranks]
    results = [report(ranks, measure(ranks, args)) for ranks in worlds]
    if args.json:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "environment": environment()}
        payload["results"] = results
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
