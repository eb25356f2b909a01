"""The ``astage`` command.  Uses the public API only.

``astage demo`` runs the README's main job on an embedded default: a small built-in model
and a temporary directory, no arguments needed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import astage

console = Console()
errors = Console(stderr=True)


def _demo_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.GELU(),
        torch.nn.LayerNorm(512),
        torch.nn.Linear(512, 256),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    x = torch.randn(64, 256)
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


async def _demo(steps: int, every: int) -> int:
    model, opt = _demo_model()
    table = Table(title="astage demo: staging a training run's state")
    for column in ("step", "loss", "tensors", "MB", "new MB", "reused", "ms", "GB/s"):
        table.add_column(column, justify="right")
    async with astage.DefaultStager() as stager:
        for step in range(1, steps + 1):
            loss = _train_step(model, opt)
            if step % every:
                continue
            state: dict[str, Any] = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            expected = {k: v.clone() for k, v in state["model"].items()}
            staged = await stager.stage(state)
            _train_step(model, opt)  # training goes on: the staged copy must not change
            ok = all(torch.equal(staged["model"][k], v) for k, v in expected.items())
            stats = stager.last_stats
            assert stats is not None
            table.add_row(
                str(step),
                f"{loss:.4f}",
                str(stats.tensors),
                f"{stats.bytes / 1e6:.1f}",
                f"{stats.bytes_allocated / 1e6:.1f}",
                str(stats.reused_buffers),
                f"{stats.seconds * 1e3:.1f}",
                f"{stats.gbps:.2f}",
            )
            if not ok:
                console.print("[red]a staged copy changed with training[/red]")
                return 1
            await stager.release(staged)
    console.print(table)
    console.print("Every staged copy stayed isolated from training; buffers were reused after the first.")
    return 0


def _inspect(path: Path, verify: bool) -> int:
    info = astage.inspect_replica(path)
    header = info.header
    console.print(f"[bold]{path}[/bold]")
    console.print(
        f"owner rank {info.owner_rank}, holder rank {info.holder_rank}, step {info.step}, "
        f"checkpoint {info.checkpoint_id!r}, created {time.ctime(info.created)}"
    )
    console.print(
        f"{header.num_tensors} tensors in {len(header.segments)} storages, "
        f"{header.body_nbytes:,} data bytes, {info.nbytes:,} bytes on disk"
    )
    table = Table(show_edge=False)
    for column in ("key path", "dtype", "shape", "storage", "bytes"):
        table.add_column(column, justify="right" if column in ("storage", "bytes") else "left")
    for spec in header.plan.tensors:
        path_text = "".join(f"[{k!r}]" if not hasattr(k, "name") else f".{k.name}" for k in spec.key_path)
        nbytes = spec.dtype.itemsize * math.prod(spec.size)
        table.add_row(
            path_text or "<root>",
            str(spec.dtype).removeprefix("torch."),
            str(list(spec.size)),
            str(spec.storage),
            f"{nbytes:,}",
        )
    console.print(table)
    if verify:
        astage.load_replica_sync(path)
        console.print("[green]checksums verified: header and every storage[/green]")
    return 0


def _ls(directory: Path) -> int:
    if not directory.is_dir():
        raise astage.ConfigurationError(f"{directory} is not a directory")
    replicas = astage.find_replicas(directory)
    table = Table(title=f"replicas in {directory}")
    for column in ("file", "owner", "holder", "step", "checkpoint", "bytes", "written"):
        table.add_column(column)
    for r in replicas:
        table.add_row(
            r.path.name,
            str(r.owner_rank),
            str(r.holder_rank),
            str(r.step),
            r.checkpoint_id,
            f"{r.nbytes:,}",
            time.ctime(r.mtime),
        )
    console.print(table if replicas else f"no replicas in {directory}")
    return 0


def _bench(names: list[str], quick: bool) -> int:
    root = Path(astage.__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__init__.py").exists():
        raise astage.ConfigurationError(
            "the benchmarks live in astage's source tree; run `astage bench` from a checkout"
        )
    code = 0
    for name in names:
        args = [sys.executable, "-m", f"benchmarks.bench_{name}", *(["--quick"] if quick else [])]
        code = code or subprocess.run(args, cwd=root, check=False).returncode
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``astage`` console script."""
    parser = argparse.ArgumentParser(prog="astage", description=astage.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small built-in model and stage its state every few steps")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--every", type=int, default=5, help="stage every N steps (default 5)")
    inspect = sub.add_parser("inspect", help="show a replica's header and tensors, and verify its checksums")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--no-verify", action="store_true", help="read only the header")
    ls = sub.add_parser("ls", help="list the replicas in a directory")
    ls.add_argument("directory", type=Path)
    bench = sub.add_parser("bench", help="run the benchmarks and print their tables")
    bench.add_argument("names", nargs="*", default=["staging", "replication"], help="which benchmarks")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return asyncio.run(_demo(args.steps, args.every))
        if args.command == "inspect":
            return _inspect(args.path, not args.no_verify)
        if args.command == "ls":
            return _ls(args.directory)
        if args.command == "bench":
            return _bench(args.names, args.quick)
    except (astage.AstageError, OSError) as exc:
        errors.print(f"astage {args.command}: {exc}", style="red", highlight=False, soft_wrap=True)
        return 2
    return 0
