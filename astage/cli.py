"""The ``astage`` command.  Uses the public API only.

``astage demo`` runs the README's main job on an embedded default: a small built-in model
and a temporary directory, no arguments needed.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

import astage

from ._demo import run_demo

console = Console()
errors = Console(stderr=True)


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
    demo = sub.add_parser(
        "demo",
        help="train on 2 local ranks, checkpoint and replicate every few steps, restore and check",
    )
    demo.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    demo.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    demo.add_argument("--ranks", type=int, default=2, help="local processes in the gloo group (default 2)")
    demo.add_argument("--directory", type=Path, default=None, help="default: a temporary directory")
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
            return run_demo(args.steps, args.every, args.ranks, args.directory)
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
