"""Replicate each rank's state to its ring peer; launch with torchrun.

    torchrun --nproc-per-node 2 examples/replication_torchrun.py --steps 3 --directory /tmp/replicas

Each rank trains a small model, and every step ``ReplicationStager.replicate`` stages its
state, exchanges it with its peers over gloo and persists the peer's replica durably under
``DIR/rank{r}``.  At the end every rank recovers its own state from its peer's disk (what a
restarted rank would do) and checks it against what it replicated last.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import astage


async def run(steps: int, directory: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    opt = torch.optim.Adam(model.parameters())
    storage = directory / f"rank{rank}"
    async with astage.ReplicationStager(storage_dir=storage, timeout=60) as rs:
        for step in range(1, steps + 1):
            x = torch.randn(16, 64)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            result = await rs.replicate({"model": model.state_dict(), "step": step}, step=step)
            print(
                f"rank {rank}/{world} step {step}: sent {result.stats.bytes_sent:,} B to rank "
                f"{result.send_to}, holding rank {result.recv_from}'s replica at {result.replica_path.name} "
                f"({result.stats.seconds * 1e3:.1f} ms)",
                flush=True,
            )
            last = {k: v.clone() for k, v in model.state_dict().items()}
            await rs.stager.release(result.staged)
        recovered = await rs.recover()
    if recovered is None or recovered["step"] != steps:
        raise SystemExit(f"rank {rank}: no step-{steps} replica came back")
    if not all(torch.equal(recovered["model"][k], v) for k, v in last.items()):
        raise SystemExit(f"rank {rank}: the recovered state differs from what was replicated")
    print(f"rank {rank}: recovered its step-{steps} state from rank {rs.send_to}'s disk", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--directory", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        directory = (
            args.directory
            or Path(tempfile.gettempdir())
            / f"astage-replicas-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
        )
        asyncio.run(run(args.steps, directory))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
