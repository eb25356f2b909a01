"""Replica format benchmark: header encode and decode cost per tensor (target: 1 µs).

On ``small-20k`` (20,000 small fp32 tensors), times each step of the format, best of
``--runs``: ``lay_out`` (the walk that checks the staged tree and builds the header's tables
and JSON), ``encode`` (the storages' crc32c and the prefix; the segments' uint8 tensors are
made later, on first use), ``relabel`` (a replica's prefix for
another rank, its body and checksums kept), ``parse_prefix`` (header validation into a plan;
the storage table stays numpy columns, its records are made on use) and ``decode`` (body
verification and the rebuilt tree); and the header's size.  A step run with the cyclic
collector paused (all but ``relabel``) includes its pass over what the step made, which
runs as the pause ends.  Pure CPU, one thread: no event loop, file or process group.

    python -m benchmarks.bench_format [--scale S] [--runs N] [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import astage
from astage._format import codec as _format

from .common import default_scale, format_table, small_tensors_state_dict


def best_of(runs: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    """The fastest of ``runs`` calls of ``fn``, and its last result.

    The previous call's result is dropped before the next call is timed: freeing it (a
    20,000-tensor header's records, ~3 ms) was counted in the next call's time.
    """
    best, result = float("inf"), None
    for _ in range(runs):
        result = None
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return best, result


def run(scale: float, runs: int) -> tuple[int, int, list[tuple[str, float]]]:
    """Seconds of each step on ``small-20k`` at ``scale``; also the tensor count and header size."""
    state = small_tensors_state_dict(scale)
    count = sum(len(layer) for layer in state.values())
    meta = {"owner_rank": 0, "step": 1, "checkpoint_id": "bench"}
    t_lay, layout = best_of(runs, lambda: _format.lay_out(state, **meta))
    t_enc, encoded = best_of(runs, layout.encode)
    t_rel, _ = best_of(runs, lambda: encoded.relabel(owner_rank=0, holder_rank=1))
    t_parse, header = best_of(runs, lambda: _format.parse_prefix(encoded.prefix))
    body = torch.zeros(encoded.body_nbytes, dtype=torch.uint8)
    for offset, segment in encoded.segments:
        body[offset : offset + segment.numel()] = segment
    t_dec, _ = best_of(runs, lambda: _format.decode(header, body))
    steps = [("lay_out", t_lay), ("encode", t_enc), ("relabel", t_rel)]
    steps += [("parse_prefix", t_parse), ("decode", t_dec)]
    return count, len(encoded.prefix), steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=None, help="fraction of the 20,000 tensors")
    parser.add_argument("--runs", type=int, default=None, help="runs per step (best of)")
    parser.add_argument("--quick", action="store_true", help="smoke test: scale 0.01, 2 runs")
    args = parser.parse_args(argv)
    scale = args.scale if args.scale is not None else 0.01 if args.quick else default_scale()
    runs = args.runs if args.runs is not None else 2 if args.quick else 5
    count, prefix_nbytes, steps = run(scale, runs)
    print(f"astage {astage.__version__}, torch {torch.__version__}; format version {_format.FORMAT_VERSION}")
    per_tensor = prefix_nbytes / count
    print(f"{count} tensors; header {prefix_nbytes} bytes ({per_tensor:.0f} a tensor); best of {runs}")
    rows = [[name, f"{seconds * 1e3:.1f}", f"{seconds / count * 1e6:.2f}"] for name, seconds in steps]
    print(format_table(["step", "ms", "us a tensor"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
