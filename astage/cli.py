"""The ``astage`` command.  Uses the public API only.

``astage demo`` runs the README's main job on an embedded default: a small built-in model
and a temporary directory, no arguments needed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import astage

console = Console()


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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``astage`` console script."""
    parser = argparse.ArgumentParser(prog="astage", description=astage.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small built-in model and stage its state every few steps")
    demo.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    demo.add_argument("--every", type=int, default=5, help="stage every N steps (default 5)")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return asyncio.run(_demo(args.steps, args.every))
    except astage.AstageError as exc:
        console.print(f"[red]astage: {exc}[/red]")
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
