"""Checkpoint with peer replication, lose a node, restart, resume bit-exact; launch with torchrun.

    torchrun --nproc-per-node 2 --max-restarts 1 examples/replication_torchrun.py --steps 4 --lose-rank 1

Each rank trains a small model and saves a checkpoint every step through a Checkpointer
whose saves are also replicated to its ring peer over gloo.  Each rank has a directory of
its own (``DIR/node{rank}``), as on separate machines with no shared file system.

With ``--lose-rank R``, rank R deletes its whole directory after the last save and dies
(SIGKILL), as a machine that is lost and replaced would.  torchrun restarts the job, and
every rank calls ``Checkpointer.restore()`` collectively: the ranks agree on the newest
step that every rank can restore, rank R receives its state from the peer that holds its
replica (and commits it locally again), and every rank checks bit for bit that it resumed
from exactly the state it had at that step (by replaying its deterministic training).  Then
they train on and save again with the same objects.

Without ``--directory`` it works in a temporary directory, which it removes at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import astage

MORE_STEPS = 2
"""Steps trained (and saved) after resuming."""


def new_model(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    # The batch depends only on (rank, step): a resumed run sees the same data.
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1_000_003 * rank + step))
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}


def same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(b, dict):
        return (
            isinstance(a, dict)
            and sorted(map(str, a)) == sorted(map(str, b))
            and all(same(a[k], b[k]) for k in b)
        )
    if isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


async def run(steps: int, root: Path, lose_rank: int | None, restart: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    node = root / f"node{rank}"
    model, opt = new_model(rank)
    start = 0
    async with (
        astage.ReplicationStager(storage_dir=node / "replicas", keep=2, timeout=60) as replication,
        astage.Checkpointer(node / "ckpt", rank=rank, keep=2, replication=replication) as ckpt,
    ):
        if restart:
            state = await ckpt.restore()  # collective: every rank calls it
            start = state["step"]
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            # What this rank had at that step, replayed from scratch: it must match bit for bit.
            replay, replay_opt = new_model(rank)
            for step in range(1, start + 1):
                train_step(replay, replay_opt, rank, step)
            if not same(state, snapshot(replay, replay_opt, start)):
                raise SystemExit(
                    f"rank {rank}: the restored state differs from the one saved at step {start}"
                )
            print(f"rank {rank}: resumed from step {start}, bit-exact (every rank agreed on it)", flush=True)
        end = steps if not restart else start + MORE_STEPS
        for step in range(start + 1, end + 1):
            train_step(model, opt, rank, step)
            handle = await ckpt.save(step, snapshot(model, opt, step))  # returns once staged
            stats = await handle.wait()
            print(
                f"rank {rank}/{world} step {step}: committed {stats.nbytes:,} B, replicated to rank "
                f"{replication.send_to} in {(stats.replicate_seconds or 0) * 1e3:.1f} ms",
                flush=True,
            )
    if rank == lose_rank and not restart:
        shutil.rmtree(node)
        print(f"rank {rank}: lost its node (directory {node} removed); dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def init_process_group(restart: int) -> None:
    """``init_process_group("gloo")``, with the rendezvous keys of each restart apart.

    torchrun keeps its store across restarts: without a prefix, a restarted rank could read
    the addresses its dead predecessors published there and fail to connect.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0 and not hosted_by_agent,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"restart{restart}", store), rank=rank, world_size=world
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--directory", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument(
        "--lose-rank", type=int, default=None, help="this rank loses its node after the last save"
    )
    args = parser.parse_args()
    if not all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        print(
            "this example runs one process per rank: launch it with torchrun, e.g.\n\n"
            "    torchrun --nproc-per-node 2 --max-restarts 1 examples/replication_torchrun.py "
            "--steps 4 --lose-rank 1\n",
            file=sys.stderr,
        )
        return 2
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    temporary = args.directory is None
    # The same path on every rank and across restarts (torchrun keeps the run id).
    root = (
        args.directory
        or Path(tempfile.gettempdir()) / f"astage-example-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
    )
    init_process_group(restart)
    try:
        asyncio.run(run(args.steps, root, args.lose_rank, restart))
        finished = args.lose_rank is None or restart > 0
        if temporary and finished:
            shutil.rmtree(root / f"node{dist.get_rank()}", ignore_errors=True)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
