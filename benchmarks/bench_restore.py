"""Restore benchmark: astage's ``restore()`` and ``restore(into=...)`` beside what a user would pick instead.

For each input (``gpt2-adam``, 1.49 GB in 593 tensors at full size; ``moe-20k``, 20,160
tensors of 32 KiB, 0.66 GB; ``small-20k``, 20,000 tensors of 16-256 elements, 11 MB) the
files of every format are written once, read once (so every method reads from the page
cache), then each method runs in a fresh process, ``--runs`` times in turns (every method
once, then again), and the medians are printed with the median over the turns of each
turn's ratio to the baselines (each child builds the model and imports its method's
library before the clock starts):

* ``raw read``: the body's bytes read into one fresh buffer per tensor (no format, no checks);
* ``torch.load(weights_only=True)`` and ``torch.load(mmap=True)``;
* ``safetensors load_file`` and ``safetensors + load_state_dict`` (copied into the model's tensors);
* ``DCP load (in place)``: ``torch.distributed.checkpoint.load`` into existing tensors;
* ``astage restore()`` (new tensors over a private mapping of the file, or one body buffer
  under 64 MiB) and ``astage restore(into=)`` (the model's own tensors), both with every
  checksum verified.

Loads that return new tensors touch a byte of every page of the result (a mapped load
costs nothing until its pages are read).  ``peak RSS`` is the growth of the child's peak
over its RSS once the model's tensors exist: ``restore(into=)`` must not hold a second
copy.  ``lag`` is an asyncio heartbeat's lateness during the astage restores.  Each child
runs ``gc.collect()`` once its input exists, so a full collection that building the input
made due is not charged to the method that happens to allocate next.

Then the read paths for the body (``preadv`` into the destination, ``mmap`` + copy,
``readinto`` a file object), and the save side: a raw ``write`` + ``fsync`` of the same
bytes against a first ``Checkpointer.save`` + ``wait()`` on a fresh Checkpointer and a
steady one (each from before the Checkpointer is entered until the step is durable).
``--only saves|restores`` measures one half; ``--quick`` (the smoke test) runs every
method of a turn in one process.

    python -m benchmarks.bench_restore [--scale S] [--runs N] [--case C] [--only saves|restores]
        [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .common import (
    LoopLag,
    PeakRss,
    default_scale,
    environment,
    format_table,
    gpt2_adam_state_dict,
    median,
    moe_adam_state_dict,
    percentile,
    small_tensors_state_dict,
)

CASES: dict[str, Callable[[float], dict[str, Any]]] = {
    "gpt2-adam": gpt2_adam_state_dict,
    "moe-20k": moe_adam_state_dict,
    "small-20k": small_tensors_state_dict,
}

METHODS = (
    "raw read",
    "torch.load",
    "torch.load(mmap)",
    "safetensors",
    "safetensors + load_state_dict",
    "DCP load (in place)",
    "astage restore()",
    "astage restore(into=)",
)
READ_PATHS = ("preadv lanes", "mmap + copy", "readinto")
SAVES = ("raw write+fsync", "astage first save", "astage steady save")

TARGETS = (
    ("astage restore(into=)", "safetensors + load_state_dict", 1.0),
    ("astage restore()", "torch.load", 0.8),
    ("astage first save", "raw write+fsync", 1.5),
    ("astage steady save", "raw write+fsync", 1.2),
)


# -- the inputs, flat ------------------------------------------------------------------------------


def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of ``tree`` by a dotted name (safetensors and DCP take flat dicts)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            out |= flat(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def distinct(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each storage once (safetensors refuses tensors that share memory: GPT-2's tied head)."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out[name] = t
    return out


def model_like(tree: Any) -> Any:
    """Fresh tensors shaped as ``tree``'s, every page touched: the model a restore fills."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        done: dict[int, Any] = {}
        out = {}
        for key, value in tree.items():
            if isinstance(value, torch.Tensor) and id(value) in done:
                out[key] = done[id(value)]  # tied, as in the source
            else:
                out[key] = done.setdefault(id(value), model_like(value))
        return out
    if isinstance(tree, list):
        return [model_like(v) for v in tree]
    return tree


def touch(tree: Any) -> int:
    """Read a byte of every page of every tensor: what a mapped load costs once used."""
    total = 0
    for t in flat(tree).values():
        if t.numel():
            total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return total


# -- writing the files (parent) -------------------------------------------------------------------


def write_files(case: str, scale: float, root: Path) -> dict[str, Any]:
    """Every format's file of ``case``, read once so all sit in the page cache."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    import astage

    state = CASES[case](scale)
    tensors = distinct(flat(state))
    torch.save(state, root / "torch.pt")
    safetensors.torch.save_file(tensors, str(root / "model.safetensors"))
    dcp.save(flat(state), checkpoint_id=str(root / "dcp"), no_dist=True)  # type: ignore[call-arg]
    with open(root / "raw.bin", "wb") as f:
        for t in tensors.values():
            f.write(t.numpy().tobytes())

    async def save() -> None:
        async with astage.Checkpointer(root / "astage") as ckpt:
            await (await ckpt.save(1, state)).wait()

    asyncio.run(save())
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(64 << 20):
                    pass
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "tensors": len(flat(state))}


# -- one method in a fresh process (child) -----------------------------------------------------------


def child(case: str, scale: float, method: str, root: Path) -> dict[str, Any]:
    state_shape = CASES[case](scale)
    if method in SAVES:
        return child_save(state_shape, method, root)
    model = model_like(state_shape)
    del state_shape
    touch(model)
    preload(method)
    gc.collect()  # the model's own garbage (and the imports') is the program's, not the method's
    rss = PeakRss()
    started = time.perf_counter()
    result, lags = run_method(method, model, root)
    if method not in ("astage restore(into=)", "safetensors + load_state_dict", "DCP load (in place)"):
        touch(result)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "rss": rss.growth(), "lags": lags}


PRELOADS = {"astage": "astage", "safetensors": "safetensors.torch", "DCP": "torch.distributed.checkpoint"}


def preload(method: str) -> None:
    """Import the library ``method`` uses before its clock starts: a process pays for an
    import once, not once a restore (and where bytecode is not cached, as with
    ``PYTHONDONTWRITEBYTECODE=1``, astage's import compiles its sources: ~0.2 s)."""
    for prefix, module in PRELOADS.items():
        if method.startswith(prefix) or (prefix == "astage" and method in READ_PATHS):
            importlib.import_module(module)


def run_method(method: str, model: Any, root: Path) -> tuple[Any, list[float]]:
    if method == "raw read":
        return raw_read(root / "raw.bin", distinct(flat(model))), []
    if method == "torch.load":
        return torch.load(root / "torch.pt", weights_only=True), []
    if method == "torch.load(mmap)":
        return torch.load(root / "torch.pt", weights_only=True, mmap=True), []
    if method.startswith("safetensors"):
        import safetensors.torch

        loaded = safetensors.torch.load_file(str(root / "model.safetensors"))
        if method == "safetensors":
            return loaded, []
        with torch.no_grad():
            for name, t in distinct(flat(model)).items():  # what load_state_dict does
                t.copy_(loaded[name])
        return model, []
    if method == "DCP load (in place)":
        import torch.distributed.checkpoint as dcp

        dcp.load(flat(model), checkpoint_id=str(root / "dcp"), no_dist=True)  # type: ignore[call-arg]
        return model, []
    if method in READ_PATHS:
        return read_path(method, root, model), []
    return asyncio.run(astage_restore(method, model, root))


def raw_read(path: Path, like: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    out = []
    with open(path, "rb", buffering=0) as f:
        for t in like.values():
            buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
            if buf.numel():
                f.readinto(buf.numpy().data)
            out.append(buf)
    return out


async def astage_restore(method: str, model: Any, root: Path) -> tuple[Any, list[float]]:
    import astage

    async with astage.Checkpointer(root / "astage") as ckpt, LoopLag() as lag:
        result = await (ckpt.restore(into=model) if method.endswith("(into=)") else ckpt.restore())
    return result, lag.samples


def read_path(method: str, root: Path, model: Any) -> Any:
    """The body of the astage file into the model's storages by one of three read paths
    (no checksums: the I/O path alone)."""
    import astage
    from astage._files.body_reads import pieces_of

    path = next((root / "astage").rglob("*.astage"))
    header = astage.inspect_checkpoint_file(path).header
    views = [t.numpy().reshape(-1).view("uint8").data for t in distinct(flat(model)).values() if t.numel()]
    pieces = [p for p in pieces_of(header) if p.nbytes]
    pairs = list(zip(pieces, views, strict=False))
    base = header.prefix_nbytes
    if method == "mmap + copy":
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            whole = memoryview(mapped)
            for piece, view in pairs:
                view[:] = whole[base + piece.start : base + piece.start + len(view)]
            del whole
        return model
    with open(path, "rb", buffering=0) as f:
        for piece, view in pairs:
            if method == "readinto":
                f.seek(base + piece.start)
                f.readinto(view)
            else:
                os.preadv(f.fileno(), [view], base + piece.start)
    return model


def child_save(state: Any, method: str, root: Path) -> dict[str, Any]:
    import astage

    directory = Path(tempfile.mkdtemp(dir=root))
    tensors = distinct(flat(state))
    gc.collect()  # building the input's garbage is the program's, not the method's
    started = time.perf_counter()
    if method == "raw write+fsync":
        fd = os.open(directory / "raw.bin", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for t in tensors.values():
                os.write(fd, t.numpy().data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"seconds": time.perf_counter() - started, "rss": 0, "lags": []}

    async def save() -> float:
        # A first save counts the Checkpointer's set-up (opening its directory) and ends
        # when the step is durable, as a steady one does: closing it is not saving.
        began = time.perf_counter()
        async with astage.Checkpointer(directory) as ckpt:
            if method == "astage steady save":
                await (await ckpt.save(1, state)).wait()
                began = time.perf_counter()
            await (await ckpt.save(2, state)).wait()
            return time.perf_counter() - began

    return {"seconds": asyncio.run(save()), "rss": 0, "lags": []}


# -- the GPU -----------------------------------------------------------------------------------------


def gpu(scale: float, runs: int) -> int:
    """``restore(into=cuda tensors)`` against a pinned host-to-device ``copy_`` of the same
    bytes (target: at least 0.8x its throughput)."""
    if not torch.cuda.is_available():
        print("no CUDA device: the GPU restore benchmark did not run")
        return 0
    import astage

    state = gpt2_adam_state_dict(scale)
    model = model_like(state)
    cuda = {k: v.cuda() for k, v in distinct(flat(model)).items()}
    nbytes = sum(t.numel() * t.element_size() for t in cuda.values())
    pinned = {k: distinct(flat(state))[k].pin_memory() for k in cuda}

    def ceiling() -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        for k, t in cuda.items():
            t.copy_(pinned[k], non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - began

    async def restore(directory: Path) -> list[float]:
        async with astage.Checkpointer(directory) as ckpt:
            await (await ckpt.save(1, distinct(flat(state)))).wait()
            seconds = []
            for _ in range(runs):
                torch.cuda.synchronize()
                began = time.perf_counter()
                await ckpt.restore(into=cuda)
                seconds.append(time.perf_counter() - began)
        return seconds

    best_ceiling = median([ceiling() for _ in range(runs)])
    with tempfile.TemporaryDirectory() as tmp:
        restored = median(asyncio.run(restore(Path(tmp))))
    assert all(torch.equal(cuda[k].cpu(), distinct(flat(state))[k]) for k in cuda)
    ratio = best_ceiling / restored
    verdict = "PASS" if ratio >= 0.8 else "MISS"
    print(f"GPU restore (gpt2-adam, {nbytes / 1e9:.2f} GB):")
    print(f"  pinned copy_ ceiling {nbytes / best_ceiling / 1e9:.1f} GB/s")
    print(f"  restore(into=cuda) {nbytes / restored / 1e9:.1f} GB/s: {ratio:.2f}x (target >= 0.8x) {verdict}")
    return 0


# -- the parent -----------------------------------------------------------------------------------------


def spawn(case: str, scale: float, methods: Sequence[str], root: Path) -> dict[str, Any]:
    """``methods`` run one after another in one fresh process: their results by method."""
    flags = ("--scale", str(scale), "--root", str(root))
    children = [arg for method in methods for arg in ("--child", method)]
    done = subprocess.run(
        [sys.executable, "-m", __spec__.name, *children, *("--case", case), *flags],
        capture_output=True,
        text=True,
        check=False,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{case} / {', '.join(methods)} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(
    case: str,
    scale: float,
    runs: int,
    root: Path,
    methods: Sequence[str] = (*METHODS, *READ_PATHS, *SAVES),
    *,
    one_process: bool = False,
) -> dict[str, Any]:
    """Each method ``runs`` times, in turns (every method once, then again), so that a drift
    of the machine (the disk's write-back, another process) spreads over all of them; each
    in a fresh process, or (``one_process``, the smoke test) all of a turn in one."""
    info = write_files(case, scale, root)
    all_samples: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
    for _ in range(runs):
        for group in [list(methods)] if one_process else [[method] for method in methods]:
            for method, sample in spawn(case, scale, group, root).items():
                all_samples[method].append(sample)
    results: dict[str, Any] = {}
    for method, samples in all_samples.items():
        lags = [lag for s in samples for lag in s["lags"]]
        results[method] = {
            "seconds": median([s["seconds"] for s in samples]),
            "runs_s": [s["seconds"] for s in samples],
            "rss": median([s["rss"] for s in samples]),
            "lag_p99_ms": percentile(lags, 99) * 1e3 if lags else None,
            "lag_max_ms": max(lags) * 1e3 if lags else None,
        }
    return {"case": case, **info, "results": results}


def _methods(only: str | None) -> tuple[str, ...]:
    if only == "saves":
        return SAVES
    if only == "restores":
        return (*METHODS, *READ_PATHS)
    return (*METHODS, *READ_PATHS, *SAVES)


def turn_ratio(results: dict[str, Any], method: str, baseline: str) -> float:
    """The median over the turns of ``method`` / ``baseline`` measured in the same turn."""
    pairs = zip(results[method]["runs_s"], results[baseline]["runs_s"], strict=True)
    return median([a / b for a, b in pairs])


def report(measured: dict[str, Any]) -> str:
    results = measured["results"]
    rows = []
    for method, r in results.items():
        lag = "" if r["lag_p99_ms"] is None else f"{r['lag_p99_ms']:.2f} / {r['lag_max_ms']:.2f}"
        base = "raw write+fsync" if method in SAVES else "raw read"
        versus = (
            ""
            if method in SAVES or "safetensors + load_state_dict" not in results
            else (f"{turn_ratio(results, method, 'safetensors + load_state_dict'):.2f}")
        )
        rows.append(
            [
                method,
                f"{r['seconds']:.3f}",
                f"{turn_ratio(results, method, base):.2f}" if base in results else "",
                versus,
                f"{r['rss'] / 1e6:.0f}",
                lag,
            ]
        )
    headers = ["method", "median s", "x raw", "x safetensors+load", "peak RSS MB", "lag p99 / max ms"]
    lines = [f"{measured['case']}: {measured['bytes'] / 1e9:.2f} GB in {measured['tensors']} tensors"]
    lines.append(format_table(headers, rows))
    lines.append("  (ratios: medians over the turns of each turn's own ratio)")
    for method, baseline, bound in TARGETS:
        if method in results and baseline in results:
            ratio = turn_ratio(results, method, baseline)
            verdict = "PASS" if ratio <= bound else "MISS"
            lines.append(f"  {method} / {baseline}: {ratio:.2f}x (target <= {bound}x) {verdict}")
    if "astage restore(into=)" in results:
        rss = results["astage restore(into=)"]["rss"] / 1e6
        lines.append(
            f"  restore(into=) peak RSS growth {rss:.0f} MB over a {measured['bytes'] / 1e6:.0f} MB model"
            " (target <= 64 MB)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale", type=float, default=None, help="size scale (1.0: 1.49 GB / 20,000 tensors)"
    )
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per method (median)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: scale 0.01, one run, the gpt2-adam input only, every method in one process",
    )
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="only these inputs")
    parser.add_argument(
        "--only",
        choices=("restores", "saves"),
        default=None,
        help="only the restores (and read paths) or only the saves",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--gpu", action="store_true", help="restore(into=cuda) against a pinned copy_")
    parser.add_argument("--child", action="append", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    scale = args.scale if args.scale is not None else (0.01 if args.quick else default_scale())
    if args.child is not None:
        print(json.dumps({method: child(args.case[0], scale, method, args.root) for method in args.child}))
        return 0
    runs = 1 if args.quick else args.runs
    if args.gpu:
        return gpu(scale, max(runs, 2))
    payload: dict[str, Any] = {"environment": environment(), "scale": scale, "runs": runs, "cases": []}
    for case in args.case or (["gpt2-adam"] if args.quick else list(CASES)):
        with tempfile.TemporaryDirectory(prefix=f"bench-restore-{case}-") as tmp:
            measured = measure(case, scale, runs, Path(tmp), _methods(args.only), one_process=args.quick)
        payload["cases"].append(measured)
        print(report(measured), flush=True)
        print()
    if args.json is not None:
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
